"""Which layouts the course runs: each candidate is asked of the training script that would run it.

The planner writes no rule of its own about which degrees compose. A candidate layout becomes the
flags of the first chapter's script that has all its dimensions,

    dense, DP alone, ZeRO-3
                      01_data_parallel/train_zero.py      (a unit's weights gathered just in time, freed
                                                           after use, as FSDP does: chapter 04's grid
                                                           gathers the whole model once per step)
    dense, no CP      04_3d_combined/train_3d.py          (DP × TP × PP, ZeRO, SP, recomputation)
    experts, no CP    05_moe_expert_parallel/train_4d.py  (+ EP among the data-parallel ranks)
    CP                06_context_parallel/train_5d.py     (+ CP)

and that script's own `checked_layout` answers: the same parser, layout decision and pipeline plan its
`main` runs on every rank before any communication. A layout is runnable when they accept it; the
refusal, when they do not, is the script's own one-line message. Because the planner only calls them,
a rule a chapter adds or lifts reaches the planner with no edit here.

A published shape (llama3-405b, deepseek-v3, ...) is not one of the scripts' presets: its flags name the
course preset of the same kind (tiny, or tiny-moe for a mixture), and its configuration is handed to the
checks in place of the preset's, so every check sees the real heads, layers and experts.
"""
import shlex
from functools import lru_cache
from importlib import import_module

from common.errors import ConfigError
from common.model import PRESETS

scatter_gather = import_module("04_3d_combined.scatter_gather")    # chapter 04: --pp-sends, what it splits

# (script path, module) of each chapter's run; the module's checked_layout(args, world, cfg, build) -> (layout, ...)
SCRIPTS = {"zero": ("01_data_parallel/train_zero.py", "01_data_parallel.train_zero"),
           "3d": ("04_3d_combined/train_3d.py", "04_3d_combined.train_3d"),
           "4d": ("05_moe_expert_parallel/train_4d.py", "05_moe_expert_parallel.train_4d"),
           "5d": ("06_context_parallel/train_5d.py", "06_context_parallel.train_5d")}


def script_of(cfg, c) -> str:
    """The first chapter whose script has every dimension of layout `c`."""
    if c.cp > 1:
        return "5d"
    if cfg.n_experts:
        return "4d"
    return "zero" if c.zero_stage == 3 and c.tp == c.pp == 1 else "3d"


def preset_name(model: str, cfg) -> str:
    """The --model the flags name: the model itself when it is a preset, else the preset of its kind."""
    return model if model in PRESETS else ("tiny-moe" if cfg.n_experts else "tiny")


def flags(c, model: str, cfg, global_batch: int, seq_len: int, dtype: str) -> list[str]:
    """The training script's flags for layout `c`: every degree and lever written out (chapter 01's ZeRO
    has no degree flags: its DP degree is the world size)."""
    out = ["--model", preset_name(model, cfg)]
    if script_of(cfg, c) != "zero":
        out += ["--dp", str(c.dp), "--tp", str(c.tp), "--pp", str(c.pp)]
    if c.cp > 1:
        out += ["--cp", str(c.cp)] + (["--cp-attention", c.cp_attention] if c.cp_attention != "ring" else [])
    if cfg.n_experts:
        out += ["--ep", str(c.ep)]
    if c.zero_stage:
        out += ["--zero-stage", str(c.zero_stage)]
    if c.sequence_parallel:
        out += ["--sequence-parallel"]
    if c.tp_overlap:
        out += ["--tp-overlap"]
    if c.recompute != "none":
        out += ["--recompute", c.recompute]
    if c.recompute_layers:
        out += ["--recompute-layers", str(c.recompute_layers)]
    if c.pp > 1:
        out += ["--schedule", c.schedule] + (["--virtual-stages", str(c.virtual_stages)] if c.virtual_stages > 1 else [])
    out += ["--microbatches", str(c.microbatches), "--global-batch", str(global_batch), "--seq-len", str(seq_len)]
    return out + (["--dtype", dtype] if dtype != "fp32" else [])


@lru_cache(maxsize=None)
def parser_of(kind: str):
    """The script's own parser, built once (the planner asks it thousands of times)."""
    return import_module(SCRIPTS[kind][1]).parser()


def refusal(c, model: str, cfg, global_batch: int, seq_len: int, dtype: str = "fp32") -> str | None:
    """None when the script that would run layout `c` accepts it, else that script's own message."""
    kind, world = script_of(cfg, c), c.layout().world
    # >>> exercise 07.refusal
    try:
        args = parser_of(kind).parse_args(flags(c, model, cfg, global_batch, seq_len, dtype))
        import_module(SCRIPTS[kind][1]).checked_layout(args, world, cfg, build=False)   # (not every rank's actions)
    except ConfigError as err:
        return str(err)
    return None
    # <<< exercise 07.refusal


def sends(c, pp_sends: str) -> list[str]:
    """--pp-sends for layout `c` of a plan made with `pp_sends`: chapter 04's scatter-gather where it splits a
    message (TP and a pipeline, no SP), else nothing (the scripts send whole)."""
    split = pp_sends == "scatter-gather" and scatter_gather.splits(c.tp, c.pp, c.sequence_parallel)
    return ["--pp-sends", pp_sends] if split else []


def command(c, model: str, cfg, global_batch: int, seq_len: int, dtype: str = "fp32", extra=()) -> str:
    """The command that runs layout `c`: torchrun with one rank per device of the layout."""
    path, _ = SCRIPTS[script_of(cfg, c)]
    argv = flags(c, model, cfg, global_batch, seq_len, dtype) + list(extra)
    return f"torchrun --nproc_per_node={c.layout().world} {path} " + shlex.join(argv)


def miniature(c, cfg, pp_sends: str = "whole"):
    """The same layout on this machine: every degree above 1 becomes 2 (ep at most dp), the same levers (the
    plan's `pp_sends` among them), on the course preset of the same kind, 16 sequences of 128 tokens; None if
    its script refuses it."""
    from dataclasses import replace
    small = PRESETS["tiny-moe" if cfg.n_experts else "tiny"]
    dp, tp, pp, cp = (min(d, 2) for d in (c.dp, c.tp, c.pp, c.cp))
    mini = replace(c, dp=dp, tp=tp, pp=pp, cp=cp, ep=min(c.ep, dp), virtual_stages=min(c.virtual_stages, 2),
                   microbatches=2 * pp if pp > 1 else 1)
    mini = replace(mini, zero_stage=c.zero_stage if mini.zero_group() > 1 else 0)     # ZeRO where it has a group
    name = "tiny-moe" if cfg.n_experts else "tiny"
    return None if refusal(mini, name, small, 16, 128) else \
        (mini, command(mini, name, small, 16, 128, extra=sends(mini, pp_sends)))
