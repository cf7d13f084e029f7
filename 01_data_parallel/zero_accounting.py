"""What ZeRO holds and sends, by formula, and its sharded AdamW state made whole again.

The formulas of zero_sharding.py's docstring as functions (every chapter that predicts ZeRO's memory or
bytes reads them here: train_zero.py's table, bench_zero.py, chapter 04's memory table, chapter 06's
planner), and the two halves of a checkpoint of the moments: each unit's shards all-gathered into the
single-device tensors (`gather_optim_state`), and each piece given its slice back on resume
(`load_optim_pieces`).
"""
import torch

from common import comm
from common.optim import saved_step


def zero_memory_bytes(stage: int, M: float, N: int, alpha: float = 2.0) -> float:
    """Per-rank bytes of parameters + gradients + optimizer state (stage 0 = plain DP), M the
    parameters' bytes: zero_sharding.py's formulas (and zero_stage3.py's for stage 3)."""
    return sum(zero_memory_components(stage, M, N, alpha).values())


def zero_memory_components(stage: int, M: float, N: int, alpha: float = 2.0) -> dict:
    """The same, by component, held between steps: stage s shards the optimizer state (s ≥ 1), the
    gradients (s ≥ 2) and the parameters (s = 3) over N ranks."""
    return {"param_bytes": M / N if stage >= 3 else M, "grad_bytes": M / N if stage >= 2 else M,
            "optim_bytes": alpha * M / N if stage >= 1 else alpha * M}


def zero_sent_share(stage: int, N: int, per_microbatch: bool = True) -> float:
    """Bytes one rank sends per step, as a multiple of M (it receives as many): plain DP's all-reduce
    2(N-1)/N; stage 1 adds the all-gather of the updated shards, 3(N-1)/N; stage 2 reduce-scatters
    instead, 2(N-1)/N; stage 3 gathers the parameters again for backward, 3(N-1)/N. In the pipeline
    form (per_microbatch=False: chapter 04's grid) stage 3 gathers the weights once for the whole step
    and keeps them for backward: one gather and one reduce-scatter, 2(N-1)/N."""
    third = 3 if per_microbatch else 2
    return {0: 2, 1: 3, 2: 2, 3: third}[stage] * (N - 1) / N


def gather_optim_state(units, pieces, optimizer, group, name="dp") -> dict:
    """AdamW's moments of every tensor, in full: each unit's moment shards are all-gathered."""
    by_name = {n: p for n, p in pieces}
    device = pieces[0][1].device
    out, step = {}, None
    for unit in units:
        full = {}
        for key in ("exp_avg", "exp_avg_sq"):
            shard = torch.zeros(unit.chunk, device=device)                # (padded/N,), padding zero
            for n, a, b, _, _ in unit.pieces():
                st = optimizer.state.get(by_name[n], {})
                if st:
                    shard[a:b] = st[key].detach()
                    step = st["step"]
            flat = torch.empty(unit.padded, device=device)                # (padded,)
            comm.all_gather_into(flat, shard, group=group, name=name)
            full[key] = unit.split(flat.cpu())
        for i, n in enumerate(unit.names):
            out[n] = {"exp_avg": full["exp_avg"][i].clone(), "exp_avg_sq": full["exp_avg_sq"][i].clone()}
    if step is None:
        return {}                       # no step taken yet
    for st in out.values():
        st["step"] = step.clone()
    return out


def load_optim_pieces(units, pieces, optimizer, states: dict) -> None:
    """Give each piece its slice of the saved full moments."""
    by_name = {n: p for n, p in pieces}
    for unit in units:
        for n, a, b, ta, tb in unit.pieces():
            if n in states:
                s, p = states[n], by_name[n]
                optimizer.state[p] = {"step": saved_step(optimizer, s["step"], p.device),
                                      "exp_avg": s["exp_avg"].reshape(-1)[ta:tb].to(p.device).clone(),
                                      "exp_avg_sq": s["exp_avg_sq"].reshape(-1)[ta:tb].to(p.device).clone()}
