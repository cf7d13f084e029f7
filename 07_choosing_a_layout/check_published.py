"""The planner against published runs at scale: check_layouts.py's published table (results/layouts_published.md).

Each run of published.py is planned on its cluster and batch (choose_layout's flags in the run's `argv`); the
published layout is found among the rows (its best-ranked form: the levers its paper leaves open are the
planner's), and what its authors measured stands beside the planner's number for the same quantity: an MFU
counted as they count it, a step time, or a memory per GPU against the fullest rank's total (and, for
torchtitan's run, the same run as its own code holds it, and what the allocator reserves for that:
torchtitan_memory.py). Then where the published layout
ranks among the layouts that fit, its step over the fastest's, and the planner's own first choice.

The planner's memory is the course's code's. Another framework may hold less: Llama 3's held its 8K layout
without activation checkpointing (§3.3.2) where the course's code would need 156 GiB a GPU. What a framework
is known to fit is read from what it ran: its published runs whose sources state the form they ran
(published.Published.ran), each counted as the course counts it. A layout that holds no more than that, by
the same count, fits as surely as the published one did (`known_to_fit`; the count is taken as a yardstick:
what moves one layout's memory against another's moves the framework's the same way). The last column ranks
the published layout again among the layouts that fit in either sense.
"""
from importlib import import_module
from pathlib import Path

choose_layout = import_module("07_choosing_a_layout.choose_layout")        # this chapter: the planner's flags
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")        # this chapter: models and devices
planner = import_module("07_choosing_a_layout.planner")                    # this chapter: the plan
pipeline_time = import_module("07_choosing_a_layout.pipeline_time")        # this chapter: a schedule on paper
published = import_module("07_choosing_a_layout.published")                # this chapter: the published runs
torchtitan_memory = import_module("07_choosing_a_layout.torchtitan_memory")   # this chapter: torchtitan's code


def known_to_fit(run) -> tuple[int, str] | None:
    """(bytes by the course's count, the run that held them) of the most a layout of `run`'s framework is known
    to have held on `run`'s GPU: its published runs whose source states the form they ran, each in that form
    (its fastest, then least, if the statement leaves levers open); None where none states it."""
    device = choose_layout.parse_args(list(run.argv)).device
    known = []
    for other in published.RUNS:
        if other.framework != run.framework or not (other.framework and other.ran):
            continue
        args = choose_layout.parse_args(list(other.argv))
        if args.device != device:
            continue
        forms = planner.plan(args, {**other.layout, **other.ran}).rows
        ran = min(forms, key=fastest)
        known.append((ran["memory_bytes"]["total"], other.name))
    return max(known) if known else None


def fits_as_known(rows: list[dict], known: tuple[int, str] | None) -> list[dict]:
    """The rows that fit by the planner's count or hold no more than `known` (known_to_fit), fastest first,
    equal times (to four digits) by memory."""
    most = known[0] if known else -1
    kept = [r for r in rows if r["fits"] or r["memory_bytes"]["total"] <= most]
    return sorted(kept, key=fastest)


def fastest(r: dict) -> tuple:
    """The planner's order among the layouts that fit, by the row's own step (planner.time_then_memory)."""
    return planner.time_then_memory(r["step_time_s"], r)


def published_rows(argv, layout: dict) -> tuple[str, list[dict], dict | None, int | None]:
    """(device name, every row the planner made, the published layout's best-ranked row or None, its rank
    among the rows that fit or None)."""
    args = choose_layout.parse_args(list(argv))
    rows, dev, _ = planner.plan(args)
    fitting = [r for r in rows if r["fits"]]
    matches = [r for r in rows if published.matches(r, layout)]
    mine = matches[0] if matches else None                                   # rows are in ranking order
    rank = fitting.index(mine) + 1 if mine in fitting else None
    return dev.name, rows, mine, rank


def measured_words(run) -> tuple[str, str]:
    """(the word for what the authors measured, its key in run.measured and in predicted_value's rows)."""
    for key, word in (("mfu", "MFU"), ("step_time_s", "step"), ("memory_gib", "memory")):
        if key in run.measured:
            return word, key
    return "-", ""


def predicted_value(run, row: dict, key: str) -> float:
    """The planner's number for measured key `key` of published run `run`: its MFU counted as the authors
    count theirs (published.mfu_as_published), its step time, or its fullest rank's total in GiB."""
    if key == "memory_gib":
        return row["memory_bytes"]["total"] / 2**30
    if key == "mfu":
        args = choose_layout.parse_args(list(run.argv))
        return published.mfu_as_published(run, row, layout_inputs.model_for(args.model), args.seq_len)
    return row[key]


def measured_cells(run, mine: dict | None, theirs: dict | None = None) -> tuple[str, str]:
    """(published, predicted) table cells, the same quantity in the same unit: "MFU 43.0%" against the row's
    MFU, "step 13.75 s" against its step time, "memory 82.4 GiB" against its fullest rank's GiB per GPU; with
    no published number, the planner's MFU alone. A torchtitan run's memory also as torchtitan's code holds it
    (`theirs`: torchtitan_gib's numbers, computed here if not given)."""
    what, key = measured_words(run)
    if not key:
        return "-", f"{mine['mfu']:.1%} MFU" if mine else "-"
    unit = {"mfu": lambda x: f"{x:.1%}", "step_time_s": lambda x: f"{x:.2f} s",
            "memory_gib": lambda x: f"{x:,.1f} GiB"}[key]
    predicted = unit(predicted_value(run, mine, key)) if mine else "-"
    if key == "memory_gib" and run.framework == "torchtitan":       # the course's code, then torchtitan's
        theirs = theirs or torchtitan_gib(run)
        predicted = (f"{predicted} (the course's code); torchtitan's code: {unit(theirs['count'])} of tensors "
                     f"(torchtitan_memory.py; {unit(theirs['tensors'])} as its step runs on fake tensors), "
                     f"**{unit(theirs['expandable'])} reserved** by the caching allocator with expandable segments "
                     f"as torchtitan launches ({unit(theirs['segments'])} by default: caching_allocator.py)")
    return f"{what} {unit(run.measured[key])}", predicted


def torchtitan_gib(run) -> dict:
    """A torchtitan run's memory per GPU in GiB as torchtitan's code holds it: its tensors counted ("count",
    torchtitan_memory.peak), its step traced on fake tensors ("tensors") and the caching allocator's reserve
    for that trace ("segments", "expandable": torchtitan_memory.reserved; about 20 s for Llama 3.1 8B)."""
    args = choose_layout.parse_args(list(run.argv))
    traced = torchtitan_memory.of_args(args, torchtitan_memory.reserved)
    return {"count": torchtitan_memory.of_args(args)["total"] / 2**30, **{k: v / 2**30 for k, v in traced.items()}}


def table() -> tuple[list[str], tuple]:
    """The published table's lines (markdown) and the run whose layouts the memory plot shows."""
    lines = ["| run | published layout (its best-ranked form here) | published | predicted | memory per GPU | "
             "rank among the layouts that fit | its step ÷ the fastest's | planner's first choice | "
             "the same among the layouts its framework is known to fit |",
             "|---|---|---|---|---|---|---|---|---|"]
    plot_case = None
    for run in published.RUNS:
        line, fitting, mine = published_line(run)
        lines.append(line)
        if run.name == "llama3-405b-8k-16384gpu":
            plot_case = (run.name, fitting, mine)
    lines += ["", "Sources:"] + [f"- {run.name}: {run.source}" for run in published.RUNS]
    return lines, plot_case


def published_line(run) -> tuple[str, list[dict], dict | None]:
    """(the table's row for one published run, the layouts that fit, the published layout's row)."""
    device, rows, mine, rank = published_rows(run.argv, run.layout)
    fitting = [r for r in rows if r["fits"]]
    best = fitting[0] if fitting else None
    said, predicted = measured_cells(run, mine)
    memory = f"{mine['memory_bytes']['total'] / 2**30:,.1f} GiB{'' if mine['fits'] else ' (does not fit)'}" \
        if mine else "-"
    place = f"{rank:,} of {len(fitting):,} (top {rank / len(fitting):.1%})" if rank else "-"
    first = f"{choose_layout.describe(best)}: {best['step_time_s']:.2f} s, MFU {best['mfu']:.1%}" if best else "-"
    return (f"| {run.name} ({device}) | {choose_layout.describe(mine) if mine else 'not runnable here'} | "
            f"{said} | {predicted} | {memory} | {place} | {against_fastest(run, mine, fitting)} | {first} | "
            f"{known_cell(run, rows)} |"), fitting, mine


def against_fastest(run, mine: dict | None, fitting: list[dict]) -> str:
    """The published layout's step over the fastest of `fitting` (fastest first): among every layout there, and
    among those with the schedules its framework ran (published.Published.schedules)."""
    if mine is None or mine not in fitting:
        return "-"
    ratio = f"{mine['step_time_s'] / fitting[0]['step_time_s']:.2f}×"
    own = [r for r in fitting if r["schedule"] in run.schedules]
    return ratio + (f" ({mine['step_time_s'] / own[0]['step_time_s']:.2f}× among {', '.join(run.schedules)})"
                    if own and own[0] is not fitting[0] else "")


def known_cell(run, rows: list[dict]) -> str:
    """The last column: the published layout among the layouts its framework is known to fit (as_known), by the
    textbook's bubble and on paper (on_paper)."""
    known = known_to_fit(run)
    cell = as_known(run, rows, known)
    return cell if cell == "-" else f"{cell}; {on_paper(run, fits_as_known(rows, known))}"


def as_known(run, rows: list[dict], known: tuple[int, str] | None) -> str:
    """The published layout's best form among the layouts that fit as surely as its framework's known runs
    (fits_as_known with `known`, known_to_fit's), its rank there and its step over the fastest's; "-" where
    nothing is known beyond the planner's count."""
    if not known:
        return "-"
    kept = fits_as_known(rows, known)
    mine = next((r for r in kept if published.matches(r, run.layout)), None)
    if mine is None:
        return "-"
    return (f"{choose_layout.describe(mine)}, {mine['memory_bytes']['total'] / 2**30:,.1f} GiB by the course's "
            f"count, against {known[0] / 2**30:,.1f} GiB held by {known[1]} as it ran: {kept.index(mine) + 1:,} of "
            f"{len(kept):,}, {against_fastest(run, mine, kept)}")


def on_paper(run, kept: list[dict]) -> str:
    """The same comparison with every pipeline's bubble from its own schedule run on paper (pipeline_time.py:
    each stage's own forward, input and weight gradients), not the textbook's: the published layout's fastest
    form on paper against the fastest of `kept` on paper, and of those with its framework's schedules (each
    found exactly: pipeline_time.fastest_on_paper)."""
    args = choose_layout.parse_args(list(run.argv))
    dev = layout_inputs.device_for(args.device, args.dtype, args.world, args.efficiency)
    bubble_of = pipeline_time.bubbles(planner.run_of(args), dev)
    mine, step = pipeline_time.fastest_on_paper([r for r in kept if published.matches(r, run.layout)], bubble_of)
    best = pipeline_time.fastest_on_paper(kept, bubble_of)
    own = pipeline_time.fastest_on_paper([r for r in kept if r["schedule"] in run.schedules], bubble_of)
    among = f"; {step / own[1]:.2f}× among {', '.join(run.schedules)}" if own and own[0] is not best[0] else ""
    return (f"on paper (each schedule run with its stages' own times): its best form {schedule_words(mine)}: "
            f"{step:.4g} s, {step / best[1]:.2f}× the fastest, {choose_layout.describe(best[0])} "
            f"({best[1]:.4g} s){among}")


def schedule_words(r: dict) -> str:
    """A row's schedule, virtual stages, micro-batches and recomputation: what tells a layout's forms apart."""
    return f"{r['schedule']} v={r['virtual_stages']} m={r['microbatches']}, recompute {r['recompute']}"


def replace_published_line(name: str, path: Path) -> str:
    """Plan one published run again and put its row in place of the old one in `path` (the other runs take
    minutes each): for a change that touches one run only."""
    line = published_line(published.BY_NAME[name])[0]
    old = path.read_text().splitlines()
    path.write_text("\n".join(line if row.startswith(f"| {name} (") else row for row in old) + "\n")
    return line
