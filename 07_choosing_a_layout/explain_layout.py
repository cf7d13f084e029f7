"""The planner's words: its table, the first choices explained, and any one layout explained on demand.

    python 07_choosing_a_layout/choose_layout.py --model tiny --world 8 --explain dp=2,tp=2,pp=2,m=4
    python 07_choosing_a_layout/choose_layout.py --explain llama3-405b-8k-16384gpu   # a published run by name

A layout is written as comma-separated fields, each `key=value`, a bare `sp` (sequence parallelism) or a
bare `tpo` (with sp: chapter 02's --tp-overlap, its rings under the matmuls; the plan's own rows have none,
so asking for it adds the overlapped twin of every SP layout to the plan):
dp, tp, pp, cp, ep, zero, recompute, layers (--recompute-layers), schedule, v (virtual stages), m (micro-batches). Fields left out
match any value: the explained row is then the best-ranked layout with the fields given. A published
run's name (published.py) plans that run's cluster and batch and explains the layout it ran.

Everything reads at 80 columns: the table's cells are short (memory in the unit its smallest row needs), and
the words wrap to the terminal's width (COLUMNS first, as rich reads it; 80 when the output is not a
terminal), each continuation line indented 4, a command continued with ` \\` so that it still pastes.
"""
import re
import shutil
import textwrap
from importlib import import_module

from common.domains import Domain, Refused
from common.metrics import format_bytes
from common.model import count_parameters
from common.recompute import MODES

published = import_module("07_choosing_a_layout.published")
working_set = import_module("07_choosing_a_layout.working_set")             # this chapter: the two moments' peak
pipeline_schedules = import_module("03_pipeline_parallel.pipeline_schedules")     # chapter 03: the schedules

FIELDS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero_stage", "recompute": "recompute",
          "layers": "recompute_layers", "schedule": "schedule", "v": "virtual_stages", "m": "microbatches"}
WORDS = ("compute", "memory", "bubble", "comm_dp", "comm_tp", "comm_pp", "comm_ep", "comm_cp", "optimizer")


def _layout(domain: Domain, text: str) -> dict:
    """{"name": published name} or {row field: value} from `dp=2,tp=2,sp,...`."""
    if text in published.BY_NAME:
        return {"name": text}
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key == "sp" and not value:
            out["sequence_parallel"] = True
        elif key == "tpo" and not value:
            out["tp_overlap"] = True
        elif key in FIELDS and value:
            out[FIELDS[key]] = _value(key, value)
        else:
            raise Refused(f"{part!r} is not a layout field",
                          f"write key=value pairs of {', '.join(FIELDS)} (and sp, tpo), or a published run: "
                          f"{', '.join(published.BY_NAME)}")
    if not out:
        raise Refused("names no field", "e.g. --explain dp=2,tp=2,pp=2")
    if out.get("tp_overlap") and not out.get("sequence_parallel"):
        raise Refused("tpo without sp", "--tp-overlap decomposes sequence parallelism's all-gather and "
                                        "reduce-scatter: write sp,tpo")
    return out


# The fields whose values are few: ZeRO's stages (0: none), the recomputation modes (common/recompute.py), the
# schedules (chapter 03's registry).
CHOICES = {"zero": ("0", "1", "2", "3"), "recompute": MODES, "schedule": tuple(pipeline_schedules.SCHEDULES)}


def _value(key: str, value: str):
    """One field's value; outside its domain, refused in one line that names the field."""
    if key in CHOICES:
        if value not in CHOICES[key]:
            raise Refused(f"{key}={value} is not one of {', '.join(CHOICES[key])}", f"e.g. {key}={CHOICES[key][1]}")
        return int(value) if key == "zero" else value
    return _whole(value, key)


def _whole(value: str, key: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise Refused(f"{key}={value} is not a whole number ≥ 1", f"e.g. {key}=2")
    return int(value)


LAYOUT = Domain("layout", "key=value fields, or a published run's name", _layout)


def columns() -> int:
    """Where the words wrap: the terminal's width (COLUMNS first), 80 when not a terminal, 40 to 100."""
    return max(40, min(shutil.get_terminal_size((80, 24)).columns, 100))


def wrap(line: str, indent: str = "") -> list[str]:
    """One logical line in lines a terminal shows whole: `indent` first, then 4 spaces on every continuation;
    a number keeps its unit on its line (a no-break space while wrapping)."""
    kept = re.sub(r"(?<=[0-9]) (?=(?:GiB|MiB|KiB|B|s)\b)", "\xa0", line)
    return [x.replace("\xa0", " ") for x in textwrap.wrap(kept, columns(), initial_indent=indent,
                                                          subsequent_indent="    ", break_long_words=False,
                                                          break_on_hyphens=False)]


def wrap_command(command: str, indent: str = "  ") -> list[str]:
    """A shell command in lines of at most columns(), each but the last ending in ` \\` (it still pastes)."""
    lines = textwrap.wrap(command, columns() - 2, initial_indent=indent, subsequent_indent="    ",
                          break_long_words=False, break_on_hyphens=False)
    return [x + " \\" for x in lines[:-1]] + lines[-1:]


def unwrapped(text: str) -> list[str]:
    """The logical lines of printed text: each continuation (4 spaces in) joined back to the line it continues."""
    out = []
    for x in text.splitlines():
        if x.startswith("    ") and out:
            out[-1] = out[-1].removesuffix(" \\") + " " + x.strip()
        else:
            out.append(x)
    return out


def table(rows: list[dict], dev, world: int) -> list[str]:
    """The printed rows: degrees, ZeRO stage, recomputation, schedule (v, m), memory of the fullest rank in
    one unit for the column, step time, bubble; then what a reader needs to read them (a row that does not
    fit, blocks recomputed, and why rows of different bubbles tie on a CPU)."""
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if min(r["memory_bytes"]["total"] for r in rows) >= s or s == 1)
    digits = 2 if min(r["memory_bytes"]["total"] for r in rows) / scale < 10 else 1
    head = ("dp", "tp", "pp", "cp") + (("ep",) if any(r["ep"] > 1 for r in rows) else ()) + \
        ("SP", "ZeRO", "recompute", "schedule", "v", "m", f"{unit}/rank", "step (s)", "bubble")
    cells = [[str(r[k]) for k in head[:head.index("SP")]] +
             [("SP+o" if r.get("tp_overlap") else "SP") if r["sequence_parallel"] else "-", str(r["zero_stage"]),
              r["recompute"] + (f" ({r['recompute_layers']})" if r.get("recompute_layers") else ""),
              r["schedule"] if r["pp"] > 1 else "-", str(r["virtual_stages"]), str(r["microbatches"]),
              f"{r['memory_bytes']['total'] / scale:,.{digits}f}" + ("" if r["fits"] else "*"),
              f"{r['step_time_s']:.4g}", f"{r['bubble']:.1%}"] for r in rows]
    left = {"SP", "recompute", "schedule"}
    width = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    line = lambda row: "  " + " ".join(x.ljust(w) if h in left else x.rjust(w) for x, w, h in zip(row, width, head))
    out = [line(head).rstrip()] + [line(c).rstrip() for c in cells]
    if not all(r["fits"] for r in rows):
        out += wrap(f"* does not fit: more than {capacity(dev)} per rank")
    if any(r.get("recompute_layers") for r in rows):
        out += wrap("full (k): full recomputation of the first k blocks of each stage only (--recompute-layers k)")
    tied = {f"{r['step_time_s']:.4g}" for r in rows for q in rows if f"{r['step_time_s']:.4g}" ==
            f"{q['step_time_s']:.4g}" and r["bubble"] != q["bubble"]}
    if tied and dev.cores is not None and world > dev.cores:
        out += [""] + wrap(f"Equal step times, different bubbles: on this CPU the {world} ranks share {dev.cores} "
                           f"cores, so a rank idle in the pipeline's bubble leaves its core to another rank's work; "
                           f"the model charges no bubble when ranks outnumber cores (layout_costs.time_parts), and "
                           f"layouts that differ only in their schedule's bubble tie (then the one that holds less "
                           f"comes first).")
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else format_bytes(n)


def capacity(dev) -> str:
    """What a rank of `dev` may hold, in words: its memory, less the headroom a GPU keeps free."""
    return gib(dev.memory) + (f" less its {dev.headroom:.0%} headroom" if dev.headroom else "")


def memory_words(mem: dict) -> str:
    words = (f"weights {gib(mem['params'])}, gradients {gib(mem['grads'])}, AdamW {gib(mem['optim_bytes'])}, "
             f"activations {gib(mem['peak_activation_bytes'])}, working set {gib(mem['working'])}")
    if working_set.sync_beyond(mem):                                 # the gradient sync is the peak
        words += f"; the peak is the gradient sync's: the gradients' copy {gib(mem['gradient_copy'])} in the " \
                 "activations' place"
    return words


def decision_tree(rows: list[dict], cfg, dev, args, describe, top: int) -> list[str]:
    """The decision tree, with this case's numbers: does the model fit one device, which lever buys
    memory, what the first choices pay their time for."""
    n = count_parameters(cfg)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    out = [f"{args.model}: {size} parameters; weights, gradients and AdamW's moments take "
           f"16 bytes each = {gib(16 * n)}, against {gib(dev.memory)} per {dev.name} rank."]
    plain = [r for r in rows if r["dp"] == args.world and r["zero_stage"] == 0 and r["recompute"] == "none"]
    if plain:
        p = min(plain, key=lambda r: r["memory_bytes"]["total"])
        out.append(f"Plain data parallelism would hold {gib(p['memory_bytes']['total'])} per rank: "
                   + ("it fits, so anything else must buy speed." if p["fits"] else
                      "it does not fit, so the state must be split (ZeRO, TP, PP) or the activations cut."))
    for i, r in enumerate([r for r in rows if r["fits"]][:top]):
        parts = r["time_parts_s"]
        slowest = max((k for k in parts if k != "compute"), key=parts.get)
        out.append(f"{i + 1}. {describe(r)}: {r['step_time_s']:.3g} s per step (MFU {r['mfu']:.1%}), "
                   f"{gib(r['memory_bytes']['total'])} on its fullest rank ({memory_words(r['memory_bytes'])}). "
                   f"Compute {parts['compute']:.3g} s; the largest other cost is {slowest.replace('_', ' ')}, "
                   f"{parts[slowest]:.3g} s" + (f"; the bubble is {r['bubble']:.1%} of a pipeline step"
                                                if r["pp"] > 1 else "") + ".")
    return [x for line in out for x in wrap(line)]


def explain_one(spec: dict, rows: list[dict], dev, describe, refusal_of, run_it, on_paper=None) -> list[str]:
    """One layout: where it ranks and why, its memory by component, its time by part, against the first.
    `refusal_of(spec)` gives the chapters' refusal of a layout that is not among the rows; `run_it(row)` the
    command that runs it here (itself, or its miniature for a published shape); `on_paper(row)`, on a GPU
    with a pipeline, its schedule run on paper (pipeline_time.words)."""
    wanted = published.BY_NAME[spec["name"]].layout if "name" in spec else spec
    found = [r for r in rows if published.matches(r, wanted)]
    if not found:
        why = refusal_of(wanted)
        return wrap(f"--explain {fields(wanted)}: no runnable layout of this plan has these fields"
                    + (f"; the chapters refuse it: {why}" if why else "; it is not among the candidates the planner "
                       "tries (degrees that divide the world, the batch split over dp, the course's micro-batch "
                       "counts, an interleaved v from 2 to layers ÷ pp)"))
    r, fitting = found[0], [x for x in rows if x["fits"]]
    first, mem, parts = fitting[0] if fitting else rows[0], r["memory_bytes"], r["time_parts_s"]
    where = (f"ranks {fitting.index(r) + 1} of the {len(fitting)} layouts that fit" if r["fits"] else
             f"does not fit: {gib(mem['total'])} on pipeline rank {r['fullest_pp_rank']} against {capacity(dev)}")
    out = [f"{describe(r)} ({len(found)} layouts have the fields asked; this is the best ranked): {where}.",
           f"  memory, its fullest pipeline rank ({r['fullest_pp_rank']}) at the peak of a step: "
           f"{memory_words(mem)}; total {gib(mem['total'])}, {gib(mem['held_between_steps'])} "
           f"of weights, gradients and AdamW held between steps",
           f"  time per step {r['step_time_s']:.4g} s (MFU {r['mfu']:.1%}{busiest(r, dev)}): "
           + ", ".join(f"{k.replace('_', ' ')} {parts[k]:.3g} s" for k in WORDS if parts.get(k))]
    if on_paper and gpu_pipeline(r, dev):
        out[-1] += "; " + on_paper(r)
    if r is not first:
        gaps = sorted(((parts.get(k, 0) - first["time_parts_s"].get(k, 0), k) for k in WORDS), reverse=True)
        out.append(f"  against the first ({describe(first)}, {first['step_time_s']:.4g} s): "
                   + ", ".join(f"{k.replace('_', ' ')} {d:+.3g} s" for d, k in gaps if abs(d) > 1e-12))
    said = [wrap(line.strip(), "  " if i else "") for i, line in enumerate(out)]
    return [x for lines in said[:3] + [run_lines(run_it(r), "  ")] + said[3:] for x in lines]


def gpu_pipeline(r: dict, dev) -> bool:
    """Is row `r` a layout with a pipeline on a GPU (where the busiest rank and the run on paper are said)?"""
    return dev.spec is not None and r["pp"] > 1


def busiest(r: dict, dev) -> str:
    """Which pipeline rank's work and collectives the time is, on a GPU with a pipeline (a CPU's: rank 0's)."""
    return f"; pipeline rank {r['busiest_pp_rank']}, the busiest" if gpu_pipeline(r, dev) else ""


def run_lines(text: str, indent: str = "") -> list[str]:
    """run_it's text ("Run it:", then the command on the next line, 2 in) wrapped: the command 2 further in."""
    head, _, command = text.partition("\n  ")
    return wrap(head, indent) + (wrap_command(command, indent + "  ") if command else [])


def fields(layout: dict) -> str:
    back = {v: k for k, v in FIELDS.items()}
    bare = {"sequence_parallel": "sp", "tp_overlap": "tpo"}
    return ",".join(bare[k] if k in bare else f"{back.get(k, k)}={v}" for k, v in layout.items()
                    if not (k in bare and not v))
