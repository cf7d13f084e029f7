"""What train_3d.py prints around its loop: the configuration, the grid's ranks and groups, the
timeline file, the summary's bubble, each rank's memory beside the formulas, the sample.

Kept apart from the loop so that the first screenful of `main()` is the training itself; run_tail.py
calls these. A later chapter's run (chapter 05's train_4d.py) prints the same tables with its own rows
and columns added.
"""
from importlib import import_module

from rich.console import Group
from rich.table import Table
from rich.text import Text

from common.generate import sample
from common.metrics import format_bytes
from common.model import describe_size
from common.timeline import write_chrome_trace

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")


def config_rows(args, cfg, layout, rt, data, start: int) -> dict:
    """The configuration table printed at start."""
    m = layout.microbatches
    mb_rows = args.global_batch // layout.dp // m
    v = pipeline_schedules.stages_per_rank(args.schedule, args.virtual_stages)     # the V schedules hold 2
    theory = pipeline_schedules.theory_bubble(args.schedule, layout.pp, m, v)
    return {
        "world size": f"{rt.world_size} = {layout.describe()}" + (" (+ sequence parallel)" if args.sequence_parallel else ""),
        "device / backend": f"{rt.device} / {rt.backend}", "data": data.describe(),
        "model": f"{args.model}: {describe_size(cfg)}, {cfg.n_layers} layers",
        "optimizer": describe_optimizer(args, layout),
        "pipeline": f"{args.schedule}, {m} micro-batch(es) of {mb_rows} seq, {v} virtual stage(s), "
                    f"theory bubble {theory:.3f} (measured: `bubble_fraction` of every step)",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens, warmup {args.warmup} + cosine, clip {args.clip}",
        "resumed from step": start or "-"}


def describe_optimizer(args, layout) -> str:
    """AdamW, or what ZeRO shards over which group (each kind of state over the group that sums it)."""
    if not args.zero_stage:
        return "AdamW on each rank's piece"
    what = {1: "AdamW's state", 2: "AdamW's state and gradients", 3: "AdamW's state, gradients and weights"}
    over = ", ".join(f"{kind} over {group.replace('_', ' × ')}" for kind, group in layout.gradient_groups().items())
    return f"ZeRO-{args.zero_stage}: {what[args.zero_stage]} sharded ({over}; chapter 01's, zero_3d.py)"


def rank_table(mesh, columns: dict | None = None) -> Group:
    """One line per rank: its coordinates on the joined dimensions (chapter 05's dp = (edp, ep): the
    data-parallel index d = edp·ep + ep), then on the grid, then a later chapter's own columns: `columns`
    maps a title to a function of the rank's row (chapter 05: the experts the rank holds). Its groups
    are `group_table`'s: short cells only, so the table reads in an 80-column terminal."""
    columns = columns or {}
    names = ["rank", *mesh.joined, *mesh.dims]
    table = Table()
    for name in (*names, *columns):
        table.add_column(name)
    for row in mesh.rank_rows():
        table.add_row(*(str(row[n]) for n in names), *(describe(row) for describe in columns.values()))
    return Group(Text(f"the ranks: grid = arange(world).view({', '.join(mesh.dims)})", style="italic"), table)


def group_table(mesh) -> Group:
    """One row per dimension, the grid's then the joined ones (with the dimensions they join): its groups,
    each the ranks of one line of the grid along it (dp 2 × pp 2 × tp 2: the dp groups are (0,4) (1,5)
    (2,6) (3,7)). Whatever a group sums, sends or exchanges stays among its ranks. A row too long for the
    terminal wraps between two groups, never inside one."""
    table = Table()
    table.add_column("dimension")
    table.add_column("its groups")
    for dim in (*mesh.dims, *mesh.joined):
        name = f"{dim} = {' × '.join(mesh.joined[dim])}" if dim in mesh.joined else dim
        table.add_row(name, " ".join(f"({','.join(map(str, line))})" for line in mesh.lines(dim)))
    return Group(Text("the groups: the ranks of each line of the grid along a dimension", style="italic"), table)


def bubble_row(history: list[dict], args, layout) -> dict:
    """For the summary: the measured bubble (median over the steps) beside the theory."""
    measured = sorted(r["bubble_fraction"] for r in history)
    theory = pipeline_schedules.theory_bubble(args.schedule, layout.pp, layout.microbatches,
                                              pipeline_schedules.stages_per_rank(args.schedule, args.virtual_stages))
    median = f"{measured[len(measured) // 2]:.3f}" if measured else "-"
    return {"pipeline bubble: measured (median) / theory": f"{median} / {theory:.3f}"}


def write_timeline(path, timeline, rt, log, args, layout) -> None:
    """Every rank's pipeline events, gathered on rank 0 into one Chrome trace (a collective)."""
    events = timeline.gather()
    if rt.is_main:
        m, v = layout.microbatches, pipeline_schedules.stages_per_rank(args.schedule, args.virtual_stages)
        write_chrome_trace(path, events, {
            "schedule": args.schedule, **layout.grid(), "dp": layout.dp, "microbatches": m,
            "virtual_stages": v,
            "theory_bubble": pipeline_schedules.theory_bubble(args.schedule, layout.pp, m, v),
            **timeline.clock_metadata()})
        log.note(f"timeline written: {path} (plot: python 03_pipeline_parallel/plot_timeline.py)")


def memory_of(trainer, mesh) -> dict:
    """This rank's memory after the last step, by component, and what the formulas say: the trainer's
    (chapter 01's ZeRO formulas for its piece and groups) and the activation ledger's prediction for its
    pipeline rank (None where the ledger does not apply: bf16, experts)."""
    mem, predicted = trainer.memory(), trainer.predicted
    return {"held": {k: mem[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")},
            "peak": {"param_bytes": mem.get("peak_param_bytes", mem["param_bytes"]),
                     "grad_bytes": mem.get("peak_grad_bytes", mem["grad_bytes"])},
            "activations": mem["peak_activation_bytes"],
            "formula": trainer.memory_formula(),
            "activations_predicted": predicted[mesh.coord("pp")] if predicted else None}


def memory_table(per_rank: list[dict]) -> Group:
    """Every rank's memory by component beside the formulas, ranks with the same numbers on one line:
    what it holds between steps, the most it held during the step (ZeRO 2 and 3 gather), the formula."""
    table = Table()
    for title in ("ranks", "", "params", "grads", "AdamW", "activations"):
        table.add_column(title, justify="right" if title not in ("ranks", "") else "left")
    same = {}
    for rank, m in enumerate(per_rank):
        same.setdefault(repr(m), (m, []))[1].append(rank)
    fmt = lambda n: "-" if n is None else format_bytes(n)               # noqa: E731
    for m, ranks in same.values():
        held, peak, formula = m["held"], m["peak"], m["formula"]
        table.add_row(rank_ranges(ranks), "held", fmt(held["param_bytes"]), fmt(held["grad_bytes"]),
                      fmt(held["optim_bytes"]), fmt(m["activations"]))
        if peak != {k: held[k] for k in peak}:
            table.add_row("", "in a step", fmt(peak["param_bytes"]), fmt(peak["grad_bytes"]), "", "")
        table.add_row("", "formula", fmt(formula["param_bytes"]), fmt(formula["grad_bytes"]),
                      fmt(formula["optim_bytes"]), fmt(m["activations_predicted"]), end_section=True)
    return Group(Text("memory per rank after the last step (held: between steps, activations: the step's peak; "
                      "formula: chapter 01's ZeRO formulas, the activation ledger)", style="italic"), table)


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8, 9, 10, 11] -> "0-3,8-11": runs of consecutive ranks as ranges."""
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def print_sample(log, rt, full_model, cfg, args) -> None:
    """A text sample from the trained model, on rank 0."""
    if full_model is not None and rt.is_main and not args.quiet:
        prompt = "The "
        text = sample(full_model, cfg, prompt, args.sample_tokens, seed=args.seed)
        log.print(f"[bold]sample from the trained model[/bold] (prompt {prompt!r}):\n{prompt}{text}")
