"""What train_3d.py prints around its loop: the configuration, the grid, the timeline file, the sample.

Kept apart from the loop so that the first screenful of `main()` is the training itself. A later
chapter's run (chapter 05's train_4d.py) prints the same tables with its own rows and columns added.
"""
from importlib import import_module

from rich.table import Table

from common.generate import sample
from common.model import describe_size
from common.timeline import write_chrome_trace

pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")


def config_rows(args, cfg, layout, rt, data, start: int) -> dict:
    """The configuration table printed at start."""
    m = layout.microbatches
    mb_rows = args.global_batch // layout.dp // m
    theory = pipeline_schedules.theory_bubble(args.schedule, layout.pp, m, args.virtual_stages)
    return {
        "world size": f"{rt.world_size} = {layout.describe()}" + (" (+ sequence parallel)" if args.sequence_parallel else ""),
        "device / backend": f"{rt.device} / {rt.backend}", "data": data.describe(),
        "model": f"{args.model}: {describe_size(cfg)}, {cfg.n_layers} layers",
        "optimizer": "ZeRO-1 over the DP group (chapter 01)" if args.zero_stage else "AdamW on each rank's piece",
        "pipeline": f"{args.schedule}, {m} micro-batch(es) of {mb_rows} seq, {args.virtual_stages} virtual stage(s), "
                    f"theory bubble {theory:.3f} (measured: `bubble_fraction` of every step)",
        "global batch": f"{args.global_batch} seq × {args.seq_len} tokens, warmup {args.warmup} + cosine, clip {args.clip}",
        "resumed from step": start or "-"}


def grid_rows(mesh, extra_cols: tuple = ()) -> tuple[list[str], list[list[str]]]:
    """The console's grid: column names, then one row per rank (its coordinates and groups, a group's
    ranks as `0,2,4,6`). A later chapter adds its own columns (`extra_cols`, from mesh.rank_rows())."""
    cols = ["rank", *mesh.joined, *mesh.dims, *(f"{d} group" for d in ("dp", "pp", "tp")), *extra_cols]
    return cols, [[ranks_text(r[c]) for c in cols] for r in mesh.rank_rows()]


def ranks_text(value) -> str:
    """A coordinate, or a list of ranks written compactly (`0,2,4,6`): the 12-column 4D grid fits the
    160 columns the console uses in a pipe or a notebook; an 80-column terminal folds its cells."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def grid_table(title: str, cols: list[str], rows: list[list[str]]) -> Table:
    """The grid as a rich table (a header wraps onto two lines before a cell does)."""
    table = Table(title=title, title_justify="left")
    for col in cols:
        table.add_column(col.replace(" ", "\n"), overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_start(log, rt, title: str, rows: dict, grid: Table, launch_hint: str) -> None:
    """The configuration table, the grid (rank 0 only, not with --quiet), and at world size 1 how to
    launch more ranks."""
    log.config_table(title, rows)
    log.print(grid)
    if rt.world_size == 1:
        log.print(f"world size 1: the single-device reference. More ranks: {launch_hint}")


def bubble_row(history: list[dict], args, layout) -> dict:
    """For the summary: the measured bubble (median over the steps) beside the theory."""
    measured = sorted(r["bubble_fraction"] for r in history)
    theory = pipeline_schedules.theory_bubble(args.schedule, layout.pp, layout.microbatches, args.virtual_stages)
    median = f"{measured[len(measured) // 2]:.3f}" if measured else "-"
    return {"pipeline bubble: measured (median) / theory": f"{median} / {theory:.3f}"}


def write_timeline(path, timeline, rt, log, args, layout) -> None:
    """Every rank's pipeline events, gathered on rank 0 into one Chrome trace (a collective)."""
    events = timeline.gather()
    if rt.is_main:
        m = layout.microbatches
        write_chrome_trace(path, events, {
            "schedule": args.schedule, **layout.grid(), "dp": layout.dp, "microbatches": m,
            "virtual_stages": args.virtual_stages,
            "theory_bubble": pipeline_schedules.theory_bubble(args.schedule, layout.pp, m, args.virtual_stages),
            **timeline.clock_metadata()})
        log.note(f"timeline written: {path} (plot: python 03_pipeline_parallel/plot_timeline.py)")


def print_sample(log, rt, full_model, cfg, args) -> None:
    """A text sample from the trained model, on rank 0."""
    if full_model is not None and rt.is_main and not args.quiet:
        prompt = "The "
        text = sample(full_model, cfg, prompt, args.sample_tokens, seed=args.seed)
        log.print(f"[bold]sample from the trained model[/bold] (prompt {prompt!r}):\n{prompt}{text}")
