"""The Layout of chapters 04-06 (parallel_3d.Layout → Layout4D → Layout5D), asked without process groups as
chapter 07's planner asks it: each group's size and span are the mesh grid's, the gradient group of each
kind of state is the rule of chapter 06's table, and a rank's parameters of a stage are the model's own
tensors cut as chapter 02 and chapter 05 cut them."""
import math
from importlib import import_module
from types import SimpleNamespace

import pytest
import torch

from common.mesh import Mesh
from common.model import PRESETS, build_model, count_parameters

parallel_3d = import_module("04_3d_combined.parallel_3d")
parallel_4d = import_module("05_moe_expert_parallel.parallel_4d")
parallel_5d = import_module("06_context_parallel.parallel_5d")
tensor_parallel = import_module("02_tensor_parallel.tensor_parallel")
expert_parallel = import_module("05_moe_expert_parallel.expert_parallel")
pipeline_stages = import_module("03_pipeline_parallel.pipeline_stages")

LAYOUTS = [parallel_3d.Layout(2, 2, 2, 2), parallel_4d.Layout4D(4, 1, 2, 2, ep=2),
           parallel_5d.Layout5D(4, 2, 2, 2, ep=2, cp=2), parallel_5d.Layout5D(2, 1, 1, 1, cp=4)]


def grid_lines(layout, name: str) -> list[list[int]]:
    """common/mesh.Mesh.lines on the Layout's grid: every group of `name`, as lists of ranks (no group made)."""
    grid = torch.arange(layout.world).view(*layout.grid().values())
    return Mesh.lines(SimpleNamespace(grid=grid, dims=tuple(layout.grid()), joined=layout.joined), name)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.describe())
def test_each_group_s_size_and_span_are_the_grid_s(layout):
    """A group's size is the length of its lines on the grid; its span is the smallest aligned block of
    consecutive ranks (a suffix of the grid: TP fastest) that holds each of its lines (a group of one rank
    talks to nobody: its span is not asked)."""
    sizes = list(layout.grid().values())
    blocks = sorted({math.prod(sizes[i:]) for i in range(len(sizes))})
    for name in (*layout.grid(), *layout.joined):
        lines = grid_lines(layout, name)
        assert {len(line) for line in lines} == {layout.group_size(name)}, name
        tightest = min(b for b in blocks if all(min(line) // b == max(line) // b for line in lines))
        assert layout.group_span(name) == tightest or layout.group_size(name) == 1, name
    assert layout.world == len(sum(grid_lines(layout, "tp"), []))


def test_each_kind_of_state_sums_over_the_ranks_holding_it():
    """Chapter 06's table: dense gradients over dp × cp, experts over edp × cp; at cp 1 chapter 05's groups."""
    layout = parallel_5d.Layout5D(8, 2, 2, 1, ep=4, cp=2)
    groups = layout.gradient_groups()
    assert (layout.group_size(groups["dense"]), layout.group_size(groups["experts"])) == (8 * 2, 8 // 4 * 2)
    flat = parallel_5d.Layout5D(8, 2, 2, 1, ep=4)
    four = parallel_4d.Layout4D(8, 2, 2, 1, ep=4)
    assert [flat.group_size(g) for g in flat.gradient_groups().values()] == \
        [four.group_size(g) for g in four.gradient_groups().values()] == [8, 2]
    assert parallel_3d.Layout(2, 1, 1, 1, dtype="bf16").element_size == 2 and parallel_3d.Layout(2, 1, 1, 1).element_size == 4


def test_a_pipeline_message_is_a_micro_batch_at_the_rank_s_positions():
    """(rows of a micro-batch, positions: S, S/cp, and over tp too under SP, D), as the executor allocates it."""
    cfg = PRESETS["tiny"]
    assert parallel_3d.Layout(2, 2, 2, 4).message_shape(cfg, 16, 128, False) == (2, 128, cfg.dim)
    assert parallel_3d.Layout(2, 2, 2, 4).message_shape(cfg, 16, 128, True) == (2, 64, cfg.dim)
    assert parallel_5d.Layout5D(2, 2, 2, 2, cp=4).message_shape(cfg, 16, 128, False) == (4, 32, cfg.dim)
    assert parallel_5d.Layout5D(2, 2, 2, 2, cp=4).message_shape(cfg, 16, 128, True) == (4, 16, cfg.dim)


@pytest.mark.parametrize("model, tp, ep", [("tiny", 1, 1), ("tiny", 2, 1), ("tiny", 8, 1), ("tiny-moe", 2, 4)])
def test_a_rank_s_parameters_are_the_model_s_tensors_cut_as_the_chapters_cut_them(model, tp, ep):
    """Every stage's parameters on rank 0 of its TP and EP groups: the built model's tensors, each through
    chapter 02's tp_to_local (tp 8 > the 4 KV heads: one replicated head) and the experts of chapter 05's
    local_experts; over the stages of a pipeline of 2 at tp = ep = 1, the whole model."""
    cfg = PRESETS[model]
    layout = parallel_5d.Layout5D(ep, tp, 2, 1, ep=ep)
    specs = pipeline_stages.stage_specs(cfg, 2, 1, 128)
    full = dict(build_model(cfg, 0).named_parameters())
    mine = expert_parallel.local_experts(cfg.n_experts, 0, ep)
    for spec in specs:
        names = [n for n in full if (n.startswith("tok_emb") and spec.first) or (n.startswith(("norm", "lm_head"))
                 and spec.last) or (n.startswith("layers.") and int(n.split(".")[1]) in spec.layers)]
        dense = sum(tensor_parallel.tp_to_local(n, full[n], 0, tp, cfg.n_kv_heads).numel() for n in names
                    if not tensor_parallel.in_experts(n))
        experts = sum(full[n].numel() for n in names if tensor_parallel.in_experts(n) and int(n.split(".")[4]) in mine)
        assert layout.stage_parameters(cfg, spec) == (dense, experts), spec
    if tp == ep == 1:
        assert sum(sum(layout.stage_parameters(cfg, s)) for s in specs) == count_parameters(cfg)
