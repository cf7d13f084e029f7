"""Chapter 03 benchmark: bubble vs theory, activation memory GPipe vs 1F1B, ours vs torch.distributed.pipelining.

    python 03_pipeline_parallel/bench_pp.py            # launches torchrun at 2 and 4 ranks, ~2 min on 2 cores
    python 03_pipeline_parallel/bench_pp.py --quick    # fewer configurations (for the notebook)
    python 03_pipeline_parallel/bench_pp.py --v-schedules   # the V schedules beside 1F1B and ZB-H1, ~3 min
    python 03_pipeline_parallel/bench_pp.py --v-schedules --rounds 7   # more paired rounds: a tighter median

Writes 03_pipeline_parallel/results/pp_bench.md, bubble.png, timelines_p2.png, timelines_p4.png
(with --v-schedules: pp_bench_v.md, timelines_v_p2.png, timelines_v_p4.png, timelines_v_simulated.png).
Each world size is ONE torchrun launch whose ranks run every configuration in turn (train_pp.main
joins the running process group), so start-up is paid once.
  - bubble: 1F1B with a FIXED micro-batch (1 sequence × 128 tokens), so that m micro-batches are m
    units of work, as the theory assumes; global batch = m. Measured on steps 2.. of each run.
  - memory: peak bytes autograd kept for backward per rank, GPipe vs 1F1B vs ZB-H1 (--v-schedules: 1F1B, ZB-H1,
    ZB-V, DualPipeV), m = 8, measured by the meter beside the ledger's prediction.
  - throughput: each schedule, ours and torch's, m = 8, global batch 16 × 128 tokens, run back to back,
    in 3 rounds (paired ratios; the machine is noisy). Ours runs with its timeline (the measured bubble)
    but without the activation meter, which the memory runs have (breakdown_pp.py: what it costs).
"""
import argparse
import json
import statistics
import sys
import tempfile
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.launch import launch  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
CLASSIC = {"speed": [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)],
           "memory": ("gpipe", "1f1b", "zb-h1")}
V_SET = {"speed": [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)],       # --v-schedules
         "memory": ("1f1b", "zb-h1", "zb-v", "dualpipev")}


def configs(p: int, quick: bool, tmp: Path, chosen=CLASSIC, n_rounds: int = 3) -> list[tuple[str, list[str]]]:
    common = ["--seq-len", "128", "--quiet", "--warmup", "2"]
    out = []
    for m in ([1, 2, 4, 8] if quick else [1, 2, 4, 8, 16]) if chosen is CLASSIC else []:    # bubble sweep
        out.append((f"bubble 1f1b m={m}", common + ["--schedule", "1f1b", "--microbatches", str(m),
                                                     "--global-batch", str(m), "--steps", "4"]))
    for name in chosen["memory"]:                                                  # memory
        out.append((f"memory {name}", common + ["--schedule", name, "--microbatches", "8", "--global-batch", "8",
                                                "--steps", "2"]))
    steps = "4" if quick else "6"
    for r in range(n_rounds):                         # throughput + timelines, ours and torch alternated
        for name, v in chosen["speed"]:
            for impl in ("ours", "torch"):
                flags = common + ["--schedule", name, "--virtual-stages", str(v), "--microbatches", "8",
                                  "--global-batch", "16", "--steps", steps, "--impl", impl]
                if impl == "ours":                    # the last round's trace is the one kept
                    flags += ["--timeline", str(tmp / f"p{p}_{name}.json"), "--no-activation-meter"]
                out.append((f"speed {name} {impl} round {r}", flags))
    return out


def worker(p: int, quick: bool, tmp: Path, chosen=CLASSIC, n_rounds: int = 3) -> None:
    """Runs inside torchrun: every configuration in turn, results written by rank 0."""
    import torch.distributed as dist
    from common.distributed import init_distributed
    train_pp = import_module("03_pipeline_parallel.train_pp")
    init_distributed()
    results = {}
    for label, argv in configs(p, quick, tmp, chosen, n_rounds):
        results[label] = train_pp.main(argv)
    if dist.get_rank() == 0:
        (tmp / f"p{p}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def median(rows, key, skip=1):
    return statistics.median(r[key] for r in rows[skip:])


def report(all_results: dict, tmp: Path, quick: bool, chosen=CLASSIC, n_rounds: int = 3) -> None:
    v_set = chosen is V_SET
    stem = "_v" if v_set else ""                      # --v-schedules writes its own files beside the classic ones
    pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")
    schedule_simulator = import_module("03_pipeline_parallel.schedule_simulator")
    plot_timeline = import_module("03_pipeline_parallel.plot_timeline")
    from common.metrics import format_bytes
    from common.timeline import load_trace
    import matplotlib
    matplotlib.use("Agg")
    OUT.mkdir(exist_ok=True)
    lines = ["# Chapter 03 — pipeline benchmark", "",
             "Machine: 2-core CPU, gloo, torch CPU; `tiny` model (8 layers), 128 tokens per sequence. "
             f"Command: `python 03_pipeline_parallel/bench_pp.py{' --quick' if quick else ''}"
             f"{' --v-schedules' if v_set else ''}{f' --rounds {n_rounds}' if n_rounds != (1 if quick else 3) else ''}`. "
             "With 4 ranks the 2 cores are oversubscribed 2×: see the README for what that does to the bubble.", ""]
    # --- bubble -----------------------------------------------------------------------------------
    lines += [] if v_set else ["## Bubble fraction, 1F1B, measured vs theory (p-1)/(m+p-1)", "",
              "| p | m | measured (median of steps 2..) | theory | simulated (unit costs) |", "|---|---|---|---|---|"]
    curves = {}
    for p, res in sorted(all_results.items()):
        ms, meas = curves.setdefault(p, ([], []))
        for label, rows in res.items():
            if label.startswith("bubble"):
                m = int(label.split("m=")[1])
                ms.append(m)
                meas.append(median(rows, "bubble_fraction"))
                sim = schedule_simulator.simulate(pipeline_schedules.build_schedule("1f1b", p, m), p)["bubble"]
                theory = pipeline_schedules.theory_bubble("1f1b", p, m)
                lines.append(f"| {p} | {m} | {meas[-1]:.3f} | {theory:.3f} | {sim:.3f} |")
    if not v_set:
        plot_timeline.plot_bubble(curves, OUT / "bubble.png", "1F1B bubble (2-core CPU, gloo)")
        lines += ["", "![bubble](bubble.png)", ""]
    # --- memory -----------------------------------------------------------------------------------
    lines += ["## Peak activation memory per rank, m = 8 (bytes autograd saved for backward; for zero bubble "
              "also the (x, dy) pairs its B actions leave for W), measured (ledger's prediction)", "",
              "| p | schedule | " + " | ".join(f"rank {i}" for i in range(4)) + " | max / min |",
              "|---|---|---|---|---|---|---|"]
    for p, res in sorted(all_results.items()):
        for name in chosen["memory"]:
            row = res[f"memory {name}"][-1]
            peaks, predicted = row["peak_activation_bytes"], row["activation_bytes_predicted"] or [None] * p
            cells = [format_bytes(b) + (f" ({format_bytes(q)})" if q else "") for b, q in zip(peaks, predicted)]
            lines.append(f"| {p} | {name} | " + " | ".join(cells + [""] * (4 - len(peaks)))
                         + f" | {max(peaks) / min(peaks):.2f} |")
    # --- throughput -------------------------------------------------------------------------------
    lines += ["", "## Throughput, ours vs torch.distributed.pipelining (m = 8, 16 × 128 tokens per step)", "",
              f"Median over {n_rounds} round(s); in each round ours and torch run back to back and each run's "
              "value is the median of its timed steps; the range is that of the per-round ratios. Ours records "
              "its timeline (the bubble column) but does not meter activations (the memory table's runs do).", "",
              "| p | schedule | ours tokens/s | torch tokens/s | ours / torch | per-round ratios | "
              "ours bubble (measured) | theory |",
              "|---|---|---|---|---|---|---|---|"]
    for p, res in sorted(all_results.items()):
        for name, v in chosen["speed"]:
            per_round = {impl: [res[f"speed {name} {impl} round {r}"] for r in range(n_rounds)]
                         for impl in ("ours", "torch")}
            a, b = (statistics.median(median(rows, "tokens_per_s") for rows in per_round[i]) for i in ("ours", "torch"))
            ratios = sorted(median(o, "tokens_per_s") / median(t, "tokens_per_s")
                            for o, t in zip(per_round["ours"], per_round["torch"]))
            bubble = statistics.median(median(rows, "bubble_fraction") for rows in per_round["ours"])
            theory = pipeline_schedules.theory_bubble(name, p, 8, v)
            lines.append(f"| {p} | {name}{' v=2' if v > 1 else ''} | {a:,.0f} | {b:,.0f} | {a / b:.2f} | "
                         f"{ratios[0]:.2f} – {ratios[-1]:.2f} | {bubble:.3f} | {theory:.3f} |")
    # --- action durations -------------------------------------------------------------------------
    lines += ["", "## How long one action takes (median over the F, B, W boxes of ranks 1.. in steps 2.., "
              "m = 8 micro-batches of 2 × 128 tokens)", "",
              "A plain backward is 1F1B's B; ZB-H1 splits it into B (input gradients) and W (weight gradients). "
              "Rank 0 is left out: in ZB-H1 its B is empty and its W is the whole backward (nobody waits for "
              "the gradient of the tokens). The V schedules run most of their backwards as one whole pass, a "
              "BW action (pipeline_actions.py): its own column.", "",
              "| p | schedule | F ms | B ms | W ms | B + W ms | BW ms |", "|---|---|---|---|---|---|---|"]
    for p in sorted(all_results):
        for name, _ in chosen["speed"]:
            events, _ = load_trace(tmp / f"p{p}_{name}.json")
            ms = {k: [1e3 * (e["end"] - e["start"]) for e in events
                      if e["kind"] == k and e["step"] > 1 and e["rank"] > 0] for k in ("F", "B", "W", "BW")}
            med = {k: statistics.median(v) if v else None for k, v in ms.items()}
            cell = lambda x: "" if x is None else f"{x:.1f}"                      # noqa: E731
            both = med["B"] + med["W"] if med["W"] is not None else None
            lines.append(f"| {p} | {name} | {cell(med['F'])} | {cell(med['B'])} | {cell(med['W'])} | {cell(both)} "
                         f"| {cell(med['BW'])} |")
    # --- timelines --------------------------------------------------------------------------------
    lines += ["", "## Timelines (real runs, last step, m = 8)", ""]
    for p in sorted(all_results):
        panels = []
        for name, _ in chosen["speed"]:
            events, meta = load_trace(tmp / f"p{p}_{name}.json")
            panels.append((plot_timeline.step_of(events, None), meta))
        plot_timeline.plot(panels, OUT / f"timelines{stem}_p{p}.png", "ms", f"p = {p}, 2-core CPU, gloo")
        lines.append(f"![timelines p={p}](timelines{stem}_p{p}.png)")
    simulated = [plot_timeline.simulated_events(n, 4, 8, v) for n, v in chosen["speed"]]
    plot_timeline.plot(simulated, OUT / f"timelines{stem}_simulated.png", "units",
                       "simulated, unit costs (F = 1, B = 2; zero-bubble B = W = 1, BW = 2)")
    lines += ["", f"![simulated](timelines{stem}_simulated.png)", ""]
    (OUT / f"pp_bench{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    from common.cli import Parser
    from common.domains import POSITIVE_INT
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--v-schedules", action="store_true", help="the V schedules (zb-v, dualpipev) beside 1f1b and zb-h1")
    ap.add_argument("--rounds", type=POSITIVE_INT, default=None,
                    help="paired rounds of the throughput runs (default 3, 1 with --quick)")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    chosen = V_SET if args.v_schedules else CLASSIC
    n_rounds = args.rounds or (1 if args.quick else 3)
    if args.worker:
        return worker(args.worker, args.quick, Path(args.tmp), chosen, n_rounds)
    tmp = Path(tempfile.mkdtemp(prefix="bench_pp_"))
    results = {}
    for p in (2, 4):
        launch(__file__, p, ["--worker", p, "--tmp", tmp, "--rounds", n_rounds] + (["--quick"] if args.quick else [])
               + (["--v-schedules"] if args.v_schedules else []))
        results[p] = json.loads((tmp / f"p{p}.json").read_text())
    report(results, tmp, args.quick, chosen, n_rounds)


if __name__ == "__main__":
    from common.errors import run_main
    run_main(main)       # its workers, too, leave the way the training scripts do
