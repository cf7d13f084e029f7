"""--pp-sends scatter-gather: each TP rank sends 1/tp of a stage's message, the next stage gathers it.

Without sequence parallelism every rank of a TP group holds the same activation between two blocks (the
row-parallel layer's all-reduce made it whole on each), and the same gradient of it in backward (the
column-parallel entrance's all-reduce). Sent as it is, the tp ranks of a stage send the next stage tp copies
of one tensor, each to its own peer:

    whole            stage s, TP rank r  ──(mb, S, D)──▶  stage s+1, TP rank r                      tp × M bytes
    scatter-gather   stage s, TP rank r  ──1/tp of it──▶  stage s+1, TP rank r, then an all-gather    M bytes
                                                          over stage s+1's TP group rebuilds (mb, S, D)

(M: one message, mb·S·D elements.) The bytes between stages drop tp-fold; the all-gather moves (tp−1)/tp·M
to and from each rank, inside the TP group: on a GPU cluster, fast links inside a node for the slow ones
between nodes (Megatron-LM's scatter_gather_tensors_in_pipeline, its default). The gathered tensor is the
one sent whole, element for element: the losses are the same to the bit.

With --sequence-parallel there is nothing to split: each TP rank already holds and sends its own S/tp
positions (parallel_3d.act_shape), so the flag asks for TP > 1, PP > 1 and no SP (check_pp_sends).
"""
import math

import torch

from common import comm
from common.errors import require

CHOICES = ("whole", "scatter-gather")


def add_pp_sends_arg(p) -> None:
    p.add_argument("--pp-sends", default="whole", choices=CHOICES,
                   help="what each TP rank sends the next pipeline stage without --sequence-parallel: whole "
                        "(its copy of the activation) or scatter-gather (its 1/tp; the next stage all-gathers "
                        "it over TP)")


def splits(tp: int, pp: int, sequence_parallel: bool) -> bool:
    """Whether a layout has a pipeline message to split over TP: TP and a pipeline, and no SP (which splits it
    already). The one rule the scripts' check, the planner's bytes and its commands ask."""
    return tp > 1 and pp > 1 and not sequence_parallel


def check_pp_sends(pp_sends: str, tp: int, pp: int, sequence_parallel: bool) -> None:
    """On every rank, before any communication: scatter-gather needs something to split."""
    if pp_sends == "scatter-gather":
        require(splits(tp, pp, sequence_parallel),
                f"--pp-sends scatter-gather splits each pipeline message over TP: it needs --tp > 1 and --pp > 1 "
                f"without --sequence-parallel (whose messages are already 1/tp); got --tp {tp} --pp {pp}"
                + (" with --sequence-parallel" if sequence_parallel else ""))


class ScatterGather:
    """chapter 03's executor's `wire`: this TP rank's 1/tp of each message out, the whole gathered in."""

    def __init__(self, tp_group):
        self.group = tp_group
        self.tp, self.rank = torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)

    def shape(self, act_shape: tuple) -> tuple:
        return (math.prod(act_shape) // self.tp,)                        # (mb·S·D / tp,)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1).chunk(self.tp)[self.rank].contiguous()    # my 1/tp of the flat message

    def unpack(self, received: torch.Tensor, act_shape: tuple) -> torch.Tensor:
        whole = torch.empty(self.tp * received.numel(), dtype=received.dtype, device=received.device)
        comm.all_gather_into(whole, received, group=self.group, name="tp")  # TP rank k's part at k/tp
        return whole.view(act_shape)                                        # (mb, S, D)


def wire_of(pp_sends: str, tp_group):
    """The executor's wire for --pp-sends: None (chapter 03's Whole) or a ScatterGather over `tp_group`."""
    return ScatterGather(tp_group) if pp_sends == "scatter-gather" else None
