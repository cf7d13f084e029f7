"""DualPipeV's pairs, one action at a time and two at once: the experts' all-to-all waits they leave exposed.

    python 05_moe_expert_parallel/bench_pairs.py           # → 05_moe_expert_parallel/results/pairs.md, ~5 min on 2 cores

Each layout runs train_4d.py with --schedule dualpipev, once as chapter 03's executor runs a schedule (one
action after the other) and once with --pair-overlap (each pair's forward on a second thread beside its
backward: paired_executor.py), the two back to back in every round. From each step's timeline, on every
rank (the metrics row is rank 0's): the time inside all-to-alls during the schedule (`a2a_wait_s`) and the
part of it while no thread of the rank computed (`a2a_exposed_s`). The table gives medians over the steady
steps (2..N) of all rounds and the median of the per-round ratios, paired vs one at a time. Losses are
checked equal. Times vary by machine and from run to run; the losses and bytes do not.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common.launch import launch  # noqa: E402

# name -> (ranks, degree flags): the EP group inside dp, two pipeline ranks (four stages in a V)
# (16 rows: 8 micro-batches of one row on each of 2 dp ranks, 4 of one row on each of 4)
LAYOUTS = {"dp2·ep2 × pp2, 8 micro-batches": (4, ["--dp", "2", "--ep", "2", "--tp", "1", "--pp", "2", "--microbatches", "8"]),
           "dp4·ep4 × pp2, 4 micro-batches": (8, ["--dp", "4", "--ep", "4", "--tp", "1", "--pp", "2", "--microbatches", "4"])}
FLAGS = ["--model", "tiny-moe", "--schedule", "dualpipev", "--global-batch", "16", "--seq-len", "128", "--quiet",
         "--sample-tokens", "0", "--val-every", "0"]
MODES = {"one at a time": [], "paired": ["--pair-overlap"]}
KEYS = ("step_time_s", "a2a_wait_s", "a2a_exposed_s")


def measure(rounds: int, steps: int) -> dict:
    """{(layout, mode): {"rows": per round, the metrics rows of steps 2..N}}."""
    out = {(name, mode): [] for name in LAYOUTS for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, (ranks, degrees) in LAYOUTS.items():
                for mode, extra in MODES.items():
                    path = Path(tmp) / f"{r}.jsonl"
                    launch(HERE / "train_4d.py", ranks, [*FLAGS, *degrees, *extra, "--steps", str(steps),
                                                         "--metrics", str(path)], echo=False, quiet=True)
                    rows = [json.loads(line) for line in path.read_text().splitlines()]
                    out[(name, mode)].append(rows)
                    steady = rows[1:]
                    print(f"round {r + 1}: {name}, {mode}: step {statistics.median(h['step_time_s'] for h in steady):.3f} s,"
                          f" a2a exposed {statistics.median(h['a2a_exposed_s'] for h in steady):.3f} s", flush=True)
    return out


def table(runs: dict, rounds: int, steps: int) -> list[str]:
    lines = [f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, gloo, one thread per rank (two during a pair). "
             f"Model tiny-moe, global batch 16 × 128 tokens, DualPipeV; {rounds} round(s) × "
             f"{steps} steps, medians over steps 2..{steps} (rank 0's row).",
             f"Command: `python 05_moe_expert_parallel/bench_pairs.py --rounds {rounds} --steps {steps}`", "",
             "| layout | ranks | how the pairs run | median step (s) | in all-to-alls (s/step) | exposed (s/step) "
             "| exposed ÷ one at a time (median of rounds) | step ÷ one at a time | losses equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (ranks, _) in LAYOUTS.items():
        base = runs[(name, "one at a time")]
        for mode in MODES:
            mine = runs[(name, mode)]
            med = {k: statistics.median(h[k] for rows in mine for h in rows[1:]) for k in KEYS}
            ratio = {k: statistics.median(statistics.median(h[k] for h in a[1:]) / statistics.median(h[k] for h in b[1:])
                                          for a, b in zip(mine, base)) for k in ("a2a_exposed_s", "step_time_s")}
            same = all([h["loss"] for h in a] == [h["loss"] for h in b] for a, b in zip(mine, base))
            lines.append(f"| {name} | {ranks} | {mode} | {med['step_time_s']:.3f} | {med['a2a_wait_s']:.3f} | "
                         f"{med['a2a_exposed_s']:.3f} | {ratio['a2a_exposed_s']:.2f} | {ratio['step_time_s']:.2f} | "
                         f"{'yes, bit for bit' if same else 'NO'} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=str(HERE / "results" / "pairs.md"))
    args = p.parse_args()
    lines = table(measure(args.rounds, args.steps), args.rounds, args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
