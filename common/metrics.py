"""What a run reports: the JSON Lines metrics file and the rich console, both from global rank 0.

One object per optimizer step, at least: step (1 for the first), loss (mean cross-entropy over every
token of the step's global batch, before the update), lr, tokens, step_time_s, tokens_per_s,
peak_memory_bytes (the CUDA allocator's peak during the step on rank 0; null off a GPU), and
mfu (model FLOPs utilisation, common/mfu.py) once the script has called `track_mfu`.
Chapters add their own keys through `log_step(**extra)`.
"""
import contextvars
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from common import mfu
from common.domains import Refused, read_utf8
from common.errors import ConfigError

EXAMPLE_ROW = '{"step": 1, "loss": 5.5}'   # what a metrics file's line looks like, for messages

PIPE_COLUMNS = 160      # the console's width when it is not a terminal (a pipe, a file, a notebook's cell)

_after_row = contextvars.ContextVar("after_row", default=None)      # inside `after_each_row`: fn(row)


@contextmanager
def after_each_row(fn):
    """Inside, every RunLog's row, once logged, is passed to `fn(row)`: what a tool that runs a script in its
    own process does between the script's steps (common/bench_overhead.py runs a plain step there)."""
    token = _after_row.set(fn)
    try:
        yield
    finally:
        _after_row.reset(token)


def console() -> Console:
    """Rank 0's rich console. A table takes the width of its content, up to the console's width, and
    wraps its cells beyond it. In a terminal that width is the window's; through a pipe, into a file or
    a notebook's cell, rich would assume 80 columns and break a mesh row in two (a group `[0, 1, 2, 3]`
    printed as `[0, 1,` over `2, 3]`), so there it is PIPE_COLUMNS, unless COLUMNS says otherwise."""
    out = Console(highlight=False)
    if not out.is_terminal and not out.is_jupyter and "COLUMNS" not in os.environ:
        out.width = PIPE_COLUMNS
    return out


class RunLog:
    def __init__(self, rank: int, total_steps: int, metrics_path: str | None, quiet: bool, append: bool = False):
        """Global rank 0 writes one JSON row per step to `metrics_path`. `append` (a run given --resume, which
        may be a restart): the rows go after those of the earlier attempts, so a step re-run after a restart
        appears twice and `read_metrics` keeps its last row."""
        self.is_main, self.total = rank == 0, total_steps
        self.show = self.is_main and not quiet
        self.console = console()
        self.history: list[dict] = []
        self.file = None
        if self.is_main and metrics_path:
            Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(metrics_path, "a" if append else "w")
        self.progress = None
        self.t0 = time.perf_counter()
        self.flops_per_token = self.peak_flops = None

    def track_mfu(self, cfg, seq_len: int, dtype: str, rt) -> None:
        """Report `mfu` from now on: the model's FLOPs per token (cfg, seq_len) against the peak of
        every device of the run `rt` (a Runtime). Only rank 0 reports, so only rank 0 looks the
        peak up (on a CPU: measures it, the first time on this machine)."""
        if self.is_main:
            self.set_flops(mfu.flops_per_token(cfg, seq_len), mfu.peak_flops_total(rt.device, dtype, rt.world_size))

    def set_flops(self, flops_per_token: float, peak_flops_total: float) -> None:
        """mfu = flops_per_token × tokens_per_s ÷ peak_flops_total, in every row from now on."""
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops_total

    def print(self, *args, **kwargs):
        if self.show:
            self.console.print(*args, **kwargs)

    def config_table(self, title: str, rows: dict):
        if not self.show:
            return
        table = Table(title=title, show_header=False, title_justify="left")
        for k, v in rows.items():
            table.add_row(str(k), str(v))
        self.console.print(table)

    def start(self, first_step: int = 1):
        if self.show:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
                                     TimeElapsedColumn(), console=self.console, transient=False)
            self.task = self.progress.add_task("train", total=self.total, completed=first_step - 1, loss=float("nan"),
                                               tps=0.0)
            self.progress.start()

    def log_step(self, step: int, loss: float, lr: float, tokens: int, step_time_s: float, **extra) -> dict:
        row = {"step": step, "loss": loss, "lr": lr, "tokens": tokens, "step_time_s": step_time_s,
               "tokens_per_s": tokens / step_time_s if step_time_s > 0 else 0.0,
               "peak_memory_bytes": gpu_peak_memory_bytes(), **extra}
        if self.peak_flops:
            row["mfu"] = self.flops_per_token * row["tokens_per_s"] / self.peak_flops
        self.history.append(row)
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.progress:
            self.progress.update(self.task, completed=step, loss=loss, tps=row["tokens_per_s"])
        if _after_row.get() is not None:
            _after_row.get()(row)
        return row

    def note(self, text: str):
        """A line printed above the progress bar (validation loss, checkpoint saved...)."""
        if self.progress:
            self.progress.console.print(text)
        elif self.show:
            self.console.print(text)

    def finish(self, extra_rows: dict | None = None):
        if self.progress:
            self.progress.stop()
        if self.file:
            self.file.close()
        if not self.show or not self.history:
            return
        steady = self.history[1:] or self.history          # step 1 includes warm-up costs
        times = sorted(r["step_time_s"] for r in steady)
        median = times[len(times) // 2]
        table = Table(title="summary", show_header=False, title_justify="left")
        table.add_row("steps", f"{self.history[0]['step']}..{self.history[-1]['step']}")
        table.add_row("loss first → last", f"{self.history[0]['loss']:.4f} → {self.history[-1]['loss']:.4f}")
        table.add_row("median step time", f"{median * 1e3:.1f} ms")
        table.add_row("median tokens/s", f"{self.history[0]['tokens'] / median:,.0f}")
        if self.peak_flops:
            table.add_row("median MFU", f"{self.flops_per_token * self.history[0]['tokens'] / median / self.peak_flops:.2%}"
                          f" of {self.peak_flops / 1e9:,.0f} GFLOP/s peak")
        peaks = [r["peak_memory_bytes"] for r in self.history if r.get("peak_memory_bytes") is not None]
        if peaks:
            table.add_row("peak GPU memory", f"{format_bytes(max(peaks))} (the allocator's, on rank 0)")
        table.add_row("wall time", f"{time.perf_counter() - self.t0:.1f} s")
        for k, v in (extra_rows or {}).items():
            table.add_row(str(k), str(v))
        self.console.print(table)


def gpu_peak_memory_bytes() -> int | None:
    """The most bytes the CUDA allocator held at once since the previous row (then its peak is reset):
    weights, gradients, optimizer state, activations and the allocator's own workspace, all of it.
    None (null in the file: not measured) when this process does not use a GPU. On a CPU there is no
    such counter; the activation meter's `peak_activation_bytes` is the course's own measure there."""
    if not torch.cuda.is_initialized():
        return None
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return peak


def read_metrics(path) -> list[dict]:
    """The rows of a metrics file, one per step in step order: the last row written for each step (a run
    restarted from a checkpoint appends the steps it re-runs after the rows of the attempt that died)."""
    return [row for _, row in read_rows(path).values()]


def read_rows(path) -> dict[int, tuple[int, dict]]:
    """{step: (line number, row)} of a metrics file, the last row of each step; anything that is not a
    metrics file is refused with one line naming the file (and the line)."""
    what = f"a metrics file holds one JSON object per line, one per optimizer step, e.g. {EXAMPLE_ROW}"
    try:
        text = read_utf8(Path(path), what, "a metrics file")
    except Refused as refused:
        why, fix = refused.args
        raise ConfigError(f"{path} {why}; {fix}") from None
    rows = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not JSON ({err.msg} at column {err.colno}); {what}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: a JSON {_json_kind(row)}, not an object; {what}")
        if "step" not in row:
            raise ConfigError(f"{where}: the object has no `step`; {what}")
        step = row["step"]
        if isinstance(step, float) and step.is_integer():
            step = int(step)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError(f"{where}: `step` must be a whole number ≥ 1 (1 for the first step), "
                              f"got {json.dumps(row['step'])}")
        rows[step] = (number, row)
    if not rows:
        raise ConfigError(f"{path} is empty (no rows); {what}")
    return dict(sorted(rows.items()))


def _json_kind(value) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
