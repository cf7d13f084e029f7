"""Lab 05's answer key: runs every command of LAB.md and writes LAB_ANSWERS.md from what they print
(part three's in lab_answers_balancing.py).

    python 05_moe_expert_parallel/lab_answers.py          # runs every command of LAB.md
"""
import math
import sys
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # repo root: `common`
from common.exercises.museum import key_section  # noqa: E402
from common.lab_key import Edit, Key, mesh_groups, mesh_row, mib, table  # noqa: E402
from common.model import PRESETS, count_parameters  # noqa: E402

balancing = import_module("05_moe_expert_parallel.lab_answers_balancing")   # part three: M9–M12

CH = "05_moe_expert_parallel"
SMALL = "--steps 10 --seq-len 32 --global-batch 8"
M5 = [f"python 05_moe_expert_parallel/train_moe.py {SMALL} --metrics /tmp/m5_1.jsonl --quiet",
      f"torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py {SMALL} --metrics /tmp/m5_4.jsonl --quiet",
      f"torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py {SMALL} --ep 2 --metrics /tmp/m5_22.jsonl --quiet"]
M6 = f"python 05_moe_expert_parallel/train_moe.py {SMALL} --microbatches 2 --metrics /tmp/m6_mb2.jsonl --quiet"
M6_CMP = "python -m common.compare_metrics /tmp/m5_1.jsonl /tmp/m6_mb2.jsonl /tmp/m5_4.jsonl --key aux_loss"
M13 = "torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py --steps 3 --sample-tokens 0"
M13_SMALL = ("torchrun --nproc_per_node=8 05_moe_expert_parallel/train_4d.py --steps 10 --seq-len 32 --global-batch 8 "
             "--quiet --sample-tokens 0 --checkpoint-dir /tmp/ck13")


def parameter_arithmetic() -> str:
    """M1's sums, from the presets (and checked against count_parameters)."""
    tiny, moe = PRESETS["tiny"], PRESETS["tiny-moe"]
    D, L, E, k, F, H = moe.dim, moe.n_layers, moe.n_experts, moe.top_k, tiny.ffn_hidden, moe.expert_hidden
    dense, expert, router = L * 3 * D * F, 3 * D * H, D * E
    total = count_parameters(tiny) - dense + L * (E * expert + router)
    active = count_parameters(tiny) - dense + L * (k * expert + router)
    assert (total, active) == (count_parameters(moe), count_parameters(moe, active=True))
    same = "exactly" if k * H == F else "almost"
    return f"""Total: tiny's {count_parameters(tiny):,} − its {L} dense SwiGLUs ({L} · 3 · {D} · {F} = {dense:,}) + {L} layers
× ({E} experts × 3 · {D} · {H} + a {D} × {E} router) = {total:,}. Active per token: the same with {k}
experts instead of {E} per layer, {active:,}: tiny's dense MLP (hidden {F}) has {same} the parameters of
{k} experts of hidden {H} ({k} · {H} = {k * H}), so the difference from tiny is the routers, {L} · {router:,} =
{active - count_parameters(tiny):,}. With `--top-k 1`: one expert per layer, {L} · 3 · {D} · {H} = {L * expert:,} fewer."""


def part_one(key: Key) -> None:
    m1 = key.run("python 05_moe_expert_parallel/train_moe.py --help | grep -A2 tiny-moe").out.strip()
    key.section("M1 — total and active parameters", f"""
```
{m1}
```

{parameter_arithmetic()}
With k = 1 the single gate, renormalised over one chosen expert, is always 1: the LM loss has no
path to the router's probabilities, which then learn only from the balance and z losses (the comment
on the gates in `route`).""")

    key.run("python 05_moe_expert_parallel/train_moe.py --steps 1 --metrics /tmp/m2.jsonl --quiet")
    row = key.rows("/tmp/m2.jsonl")[0]
    key.section("M2 — the balance loss at uniform routing", f"""
Step 1: `aux_loss` **{row["aux_loss"]:.4f}** (uniform: L·α = 0.08), `z_loss` **{row["z_loss"]:.4f}** (uniform:
L·β·(ln 8)² = {8 * 0.001 * math.log(8) ** 2:.4f}).

E·Σᵢ fᵢPᵢ is 1 at uniform routing and grows when the experts that take many slots (large fᵢ) also
have high mean probability (large Pᵢ); at step 1 the router is not exactly uniform, and top-2 picks
correlate with the probabilities, so it is a little above. The gradient flows only through Pᵢ
(fᵢ is a count of argmax choices: not differentiable), and ∂/∂Pᵢ = α·E·fᵢ: the expert chosen more
often than its share gets the larger push *down* on its probability, so its share falls. The
closed forms in `tests/test_moe.py`: uniform routing gives exactly 1 per sequence (α per layer), and a
whole model with zero routers gives α·L and β·L·(ln E)² (`tests/test_moe_ep.py` checks the same
numbers in what `train_moe.py` reports); every token on one expert gives E·P₀ (towards E as P₀ → 1);
and the per-sequence definition, whatever the split of the batch.""")

    key.section("M3 — capacity by hand", """
Capacity = ⌈0.75 · 4 · 2 / 3⌉ = ⌈2⌉ = 2 slots per expert. In order: token 0 takes expert 0 (1/2) and
1 (1/2); token 1 takes 1 (2/2) and 0 (2/2); token 2 asks for 0 (full: dropped) and 2 (1/2); token 3
asks for 2 (2/2) and 1 (full: dropped). So token 2 loses expert 0 and token 3 loses expert 1, as the
test asserts. With factor 0.375 the capacity is ⌈1⌉ = 1: token 0 gets 0 and 1, token 1 finds both
full and passes through the block on the residual alone; token 2 gets 2 only, token 3 nothing.""")


def control_reading(parted: dict) -> str:
    """What M5's control shows, from its numbers: {"4", "22", "mb2"} -> compare_metrics summaries."""
    first = {name: d["first_above_tol"] for name, d in parted.items()}
    largest = ", ".join(f"{d['max']:.1e}" for d in parted.values())
    if first["mb2"] is None:
        return (f"Here the control stayed within 1e-5 for all 50 steps (largest differences, EP 4, EP 2 × DP 2, "
                f"control: {largest}): whether a run meets a near-tie is chance, and this one did not.")
    return (f"What to compare on any machine: the first step above 1e-5 is {first['4'] or 'none'} for EP 4, "
            f"{first['22'] or 'none'} for EP 2 × DP 2 and {first['mb2']} for the control, the largest differences "
            f"{largest}. The single device with no parallelism at all parts from itself too, as soon as its "
            f"gradient is summed in two parts instead of one: expert parallelism is not to blame.")


def part_two(key: Key) -> float:
    """Returns the largest relative loss difference of M5's 50-step runs from one device: how far runs
    part with no change at all (M9 compares its losses with it)."""
    out = key.run("torchrun --nproc_per_node=8 05_moe_expert_parallel/train_moe.py --ep 4 --steps 1").out
    start = next((i for i, line in enumerate(out.splitlines()) if "mixture of experts" in line), 0)
    config = "\n".join(out.splitlines()[start:start + 30])
    key.section("M4 — who holds what, who sums what", f"""
The configuration table rank 0 printed:

```
{config}
```

The grid is `arange(8).view(edp, ep)` = [[0, 1, 2, 3], [4, 5, 6, 7]] (dp 8 = edp 2 × ep 4): rank 6 is
at edp = 1, ep = 2 and holds experts 4 and 5 (E/ep = 2 per rank); its EP group is the row [4, 5, 6, 7].
Expert 5's weights exist on the ranks at ep = 2 of every row, [2, 6]: its gradient is summed over that
edp group. The router is dense (every rank routes its own rows with the same weights), so its
gradient is summed over dp, all 8 ranks.""")

    for cmd in M5:
        key.run(cmd)
    cmps = {k: key.run(f"python -m common.compare_metrics /tmp/m5_1.jsonl /tmp/m5_4.jsonl /tmp/m5_22.jsonl{flag}",
                       check=False) for k, flag in (("loss", ""), ("grad_norm", " --key grad_norm"), ("aux_loss", " --key aux_loss"))}
    for cmd in ["python 05_moe_expert_parallel/train_moe.py --metrics /tmp/m5d_1.jsonl --quiet",
                "torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --metrics /tmp/m5d_4.jsonl --quiet",
                "torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --ep 2 --metrics /tmp/m5d_22.jsonl --quiet"]:
        key.run(cmd)
    default = key.run("python -m common.compare_metrics /tmp/m5d_1.jsonl /tmp/m5d_4.jsonl /tmp/m5d_22.jsonl", check=False)
    pair = key.worst("/tmp/m5d_4.jsonl", "/tmp/m5d_22.jsonl")
    key.run("python 05_moe_expert_parallel/train_moe.py --microbatches 2 --metrics /tmp/m5d_mb2.jsonl --quiet")
    control = key.run("python -m common.compare_metrics /tmp/m5d_1.jsonl /tmp/m5d_mb2.jsonl", check=False)
    parted = {name: key.worst("/tmp/m5d_1.jsonl", f"/tmp/m5d_{name}.jsonl") for name in ("4", "22", "mb2")}
    lines = "\n".join(f"- `{k}`: exit {r.code}; " + "; ".join(r.line_with(f"{n}.jsonl: max") for n in ("m5_4", "m5_22"))
                      for k, r in cmps.items())
    key.section("M5 — the same losses", f"""
10 steps, 8 × 32 tokens:
{lines}

Default run (50 steps, 16 × 128): exit {default.code};
- {default.line_with("m5d_4.jsonl: max")}
- {default.line_with("m5d_22.jsonl: max")}
- EP 4 against EP 2 × DP 2: max {pair["max"]:.1e} at step {pair["max_step"]}, first step above 1e-5:
  {pair["first_above_tol"] or "none"}.
- The control, 1 rank with 2 micro-batches against 1 rank: exit {control.code};
  {control.line_with("m5d_mb2.jsonl: max")}

These 50-step numbers are this machine's: another CPU orders its float32 additions differently and
meets its first near-tie at another step (the README's machine: step 13, largest 7.4e-3; another x86
CPU: step 10, 1.7e-2). {control_reading(parted)}

Routing is discrete: a token goes to the experts with the two largest probabilities. When two
probabilities are nearly tied, a round-off difference (another order of summation) can flip the
choice; from then on the two runs compute different functions for that token, and the difference
is no longer round-off (README section 8). A dense model has no such discontinuity, so its
differences stay round-off-sized. Any change in the order of the float32 additions (a layout,
accumulation, another version of the code) moves the first near-tie's outcome, and after it the runs
are different, equally good runs.""")

    key.run(M6)
    mb = key.run(M6_CMP, check=False)
    edits = [Edit("common/moe_routing.py", "f = whole.float() / (S * parts * top_k)", "f = whole.sum(0) / (B * S * parts * top_k)"),
             Edit("common/moe_routing.py", "P = probs.mean(dim=1) / parts", "P = probs.mean(dim=(0, 1)) / parts"),
             Edit("common/moe_routing.py", "aux_sum = (E * (f * P).sum(dim=-1)).sum()", "aux_sum = B * E * (f * P).sum()")]
    with key.broken(*edits) as root:          # the same commands (and /tmp files) as the student
        for cmd in M5[:2] + [M6]:
            key.run(cmd, root=root)
        broken = key.run(M6_CMP, root=root, check=False)
    key.section("M6 — per-sequence statistics", f"""
Unbroken, `aux_loss` against 1 rank (exit {mb.code}): {mb.line_with("m6_mb2.jsonl: max")}; {mb.line_with("m5_4.jsonl: max")}

Broken (statistics over whatever batch the call sees): exit {broken.code};
{broken.line_with("m6_mb2.jsonl: max")}; {broken.line_with("m5_4.jsonl: max")}

fᵢ and Pᵢ are averages over a group of tokens, and E·Σᵢ fᵢPᵢ is not linear in them: the loss of the
whole batch is not the sum of the losses of its parts. Defined per sequence, a sequence's statistics
are the same whether it is routed on one rank with seven others, in a micro-batch of four, or on a
rank of its own; summed over sequences, the total is the same in every layout. Defined over the
batch, each micro-batch or EP rank computes statistics over its own share, a different number: the
aux loss differs from step 1, its gradient too, and the LM loss follows.""")
    key.run("torchrun --nproc_per_node=2 05_moe_expert_parallel/train_moe.py --steps 3 --seq-len 64 --global-batch 16 --metrics /tmp/m7.jsonl --quiet")
    key.run("torchrun --nproc_per_node=2 05_moe_expert_parallel/train_moe.py --steps 3 --seq-len 64 --global-batch 16 --capacity-factor 0.5 --metrics /tmp/m7_cf.jsonl --quiet")
    formula = 8 * (8 * 0.5 * 512 * 2 * 128 * 4 + 16 * 1 * 4)
    m7 = [r["comm_bytes_ep"] for r in key.rows("/tmp/m7.jsonl")]
    cf = [r["comm_bytes_ep"] for r in key.rows("/tmp/m7_cf.jsonl")]
    key.section("M7 — all-to-all bytes", f"""
Formula: {formula:,.0f} bytes. Measured `comm_bytes_ep` per step: {", ".join(f"{b:,}" for b in m7)}
({", ".join(f"{b / formula - 1:+.1%}" for b in m7)}). With `--capacity-factor 0.5`:
{", ".join(f"{b:,}" for b in cf)}.

Not exactly the formula because routing does not care where a token lives: (ep−1)/ep of the slots
leave the rank only on average; in a given step the tokens of rank 0 may prefer its own experts
more or less often than that. With a capacity factor, dropped slots are not sent at all (the
dispatch sends only the kept ones), so the bytes fall with the dropped share.""")

    key.run("for ep in 1 2 4; do torchrun --nproc_per_node=4 05_moe_expert_parallel/train_moe.py --ep $ep --steps 1 --seq-len 32 --global-batch 8 --metrics /tmp/m8_$ep.jsonl --quiet; done")
    rows = [[ep, f"{key.rows(f'/tmp/m8_{ep}.jsonl')[0]['expert_param_bytes']:,}",
             f"{key.rows(f'/tmp/m8_{ep}.jsonl')[0]['param_bytes']:,}", f"{18_874_368 // ep + 1_876_480:,}"] for ep in (1, 2, 4)]
    key.section("M8 — memory per rank", table(["ep", "expert_param_bytes", "param_bytes", "predicted param_bytes"], rows)
                + """

Experts are split over the EP group (E/ep per rank); everything else (attention, norms, embedding,
head, routers: 1,876,480 bytes) is replicated on every rank, as in data parallelism.""")
    return max(d["max"] for d in parted.values())


def part_four(key: Key) -> None:
    grids = {"(default)": key.run(f"{M13} --metrics /tmp/m13.jsonl").out,
             "`--dp 2 --ep 2 --tp 2 --pp 2`": key.run(f"{M13} --dp 2 --ep 2 --tp 2 --pp 2 --metrics /tmp/m13b.jsonl").out}
    rows = []
    for flags, out in grids.items():
        r, g = mesh_row(out, 5, 7), mesh_groups(out, 5)   # rank, dp, edp, ep, pp, tp, experts; {dimension: ranks}
        rows.append([flags, f"({', '.join(r[1:6])})", g["ep"], g["edp"], r[6], g["dp"]])
    last = {name: key.rows(f"/tmp/{name}.jsonl")[-1] for name in ("m13", "m13b")}
    experts = 4 * 4 * 3 * 128 * 192 * 4          # rank 0's experts: 4 MoE layers of stage 0 × 4 of 8 experts, fp32
    dense = (last["m13"]["comm_bytes_dp"] - 2 * experts) / 3
    key.run("python 05_moe_expert_parallel/train_moe.py --steps 3 --quiet --metrics /tmp/m13_1.jsonl")
    same = [key.run(f"python -m common.compare_metrics /tmp/m13_1.jsonl /tmp/m13.jsonl /tmp/m13b.jsonl{k}", check=False)
            for k in ("", " --key aux_loss")]
    key.fresh("/tmp/ck13")
    key.run(f"{M13_SMALL} --checkpoint-every 5 --metrics /tmp/m13_a.jsonl")
    key.run("echo step_000005.pt > /tmp/ck13/latest")
    key.run(f"{M13_SMALL} --resume --dp 4 --ep 4 --tp 1 --pp 2 --metrics /tmp/m13_b.jsonl")
    resumed = key.run("python -m common.compare_metrics /tmp/m13_a.jsonl /tmp/m13_b.jsonl", check=False)
    steps = [r["step"] for r in key.rows("/tmp/m13_b.jsonl")]
    key.names("04_3d_combined/replicated_3d.py", "def grads_ready")
    key.names(f"{CH}/expert_parallel.py", 'mark_replicated(p, "ep", ep)')
    key.section("M13 — experts on chapter 04's grid", f"""
Rank 5 in the ranks table and the groups table:

{table(["flags", "rank 5: (dp, edp, ep, pp, tp)", "ep group", "edp group", "experts", "dp group"], rows)}

By default the grid is `arange(8).view(edp 2, ep 2, pp 2, tp 1)`: 5 = 4·1 + 2·0 + 1, so edp 1, ep 0,
pp 1, and dp = 2·1 + 0 = 2. The four data-parallel ranks of stage 1 (1, 3, 5, 7) form two EP pairs,
(1, 3) and (5, 7): rank 5 shares the 8 experts of its stage's layers with rank 7 (it holds 0–3, rank 7
holds 4–7), and rank 1 holds the same experts as rank 5: that is its edp group. With
`--dp 2 --ep 2 --tp 2 --pp 2` the grid is `view(1, 2, 2, 2)`: 5 = 4·1 + 2·0 + 1, so ep 1, pp 0, tp 1,
edp 0; dp = ep = 2, so the ep group is the whole dp group, and the edp group is rank 5 alone: no other
data-parallel rank of its stage holds experts 4–7. (Rank 4, its TP partner, holds them whole too, but
routes the same rows through them: its expert gradients come out identical and are not summed.)

- Dense gradients (embedding, attention, norms, routers, head) are summed over **dp**: every dp rank
  holds them and saw its own rows. An expert's gradient is summed over **edp** only: the other dp
  ranks hold other experts, and the all-to-all already brought every row routed to an expert to its
  holder, so its holders' gradients are the only partial sums there are (chapter 04's
  `ReplicatedOptimizer.grads_ready`, each kind over the group `Layout4D.gradient_groups()` names).
  In the clipping norm the squares are summed over ep (its ranks hold different experts); a dense
  weight is the same on every ep rank, and `mark_replicated(p, "ep", ep)` makes `counted_here` count
  it on ep rank 0 only; an expert lives on one ep rank, which counts it.
- `comm_bytes_ep` at step 3: **{mib(last["m13"]["comm_bytes_ep"])}** by default, **{mib(last["m13b"]["comm_bytes_ep"])}**
  with `--dp 2 --ep 2 --tp 2 --pp 2`. Predicted for the default: 512 tokens × 2 slots × ½ that leave
  the rank = 512 rows of 512 B, 0.25 MiB per all-to-all; × 4 all-to-alls × 4 layers = 4 MiB sent and
  as many received, 8 MiB (about: the share of slots that leaves is near ½, not exactly, and the count
  exchanges add a few hundred bytes). With dp 2 each rank holds twice the rows: 16 MiB. TP does not
  change a rank's ep bytes (both TP ranks route the same rows through their own EP group).
- `comm_bytes_dp` of the default run: **{mib(last["m13"]["comm_bytes_dp"])}**. The experts: {mib(experts)} over edp 2,
  sent and received 2·(1/2)·n each way = {mib(2 * experts)}; the rest, 3 × {mib(dense)}, is the stage's dense
  weights over dp 4 (2·(3/4)·n each way): the embedding and 4 layers' attention, norms and routers.
- Against this chapter's single device, 3 steps: `loss` exit **{same[0].code}** ({same[0].line_with("m13.jsonl: max")};
  {same[0].line_with("m13b.jsonl: max")}), `aux_loss` exit **{same[1].code}** ({same[1].line_with("m13.jsonl: max")};
  {same[1].line_with("m13b.jsonl: max")}).
- Resume at ep 4 from the ep-2 checkpoint of step 5: `m13_b.jsonl` holds steps {steps[0]}–{steps[-1]}; the
  comparison exits **{resumed.code}**: {resumed.line_with("m13_b.jsonl: max")}. The checkpoint holds the
  single-device state, every expert once under its single-device name (written by the ranks of edp 0
  and tp 0), so ep 4 takes its own quarter of them. The smaller batch keeps the ten steps clear of a
  routing near-tie, after which any two layouts part (M5).""")


def main() -> None:
    key = Key(CH, "Chapter 05 lab — mixture of experts and expert parallelism")
    key.names("common/moe_routing.py", "def route")
    key.names("common/model.py", 'register_buffer("selection_bias"')
    part_one(key)
    spread = part_two(key)
    balancing.part_three(key, spread)
    part_four(key)
    key.section(*key_section("05"))      # the museum's bugs of this chapter: how each is found
    key.write()


if __name__ == "__main__":
    main()
