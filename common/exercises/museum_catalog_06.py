"""Chapter 06's rows of the museum of real bugs (common/exercises/museum_catalog.py explains the fields):
ring attention reusing stale K/V, a loss not reduced over the CP group, tokens counted before the CP split,
an all-to-all putting the heads back in the wrong order."""
from .museum_exhibit import Exhibit

CP_EXHIBITS = (
    Exhibit("06.bug1",
        "context-parallel runs match one device at step 1 but not from step 2; the ring's bytes are as the "
        "formula says",
        "a ring-attention backward that reuses stale K/V",
        "06_context_parallel/ring_attention.py",
        "                if t < cp - 1:\n                    kv = kv_next\n            if partial is not None:",
        "            if partial is not None:",
        ("tests/test_ring_attention.py::test_matches_single_device_attention",),
        ("python 06_context_parallel/train_cp.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=2 06_context_parallel/train_cp.py --cp 2 --steps 5 --quiet --metrics runs/bug/cp2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/cp2.jsonl --key grad_norm"),
        "Step 1 matches to 1e-6 (attention's share of the gradient is small at initialisation); the gradient "
        "norm parts from step 2, the loss after it. "
        "`tests/test_ring_attention.py` narrows it to the attention: the output matches, the gradients of q, "
        "k, v do not. In the backward ring each step must compute with the K/V block that just arrived "
        "(`kv = kv_next`), like the forward; without it every step reuses the rank's own block, so the "
        "gradients are those of attention to one block, repeated. The bytes still equal the formula: "
        "everything is sent, it is just never used. Fix: advance `kv` after each hop in backward too."),
    Exhibit("06.bug2",
        "train_cp.py at cp 2 reports about half the loss of one device, yet it trains exactly as well",
        "a CP×TP loss not reduced over the context-parallel group",
        "06_context_parallel/train_cp.py",
        "loss_value = global_sum(local_loss, mesh.group(\"dp_cp\"))",
        "loss_value = global_sum(local_loss, mesh.group(\"dp\"))",
        ("tests/test_cp.py::test_every_cp_layout_matches_one_device",),
        ("python 06_context_parallel/train_cp.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=2 06_context_parallel/train_cp.py --cp 2 --steps 5 --quiet --metrics runs/bug/cp2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/cp2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/cp2.jsonl --key grad_norm"),
        "`compare_metrics` fails on `loss` and passes on `grad_norm`: training is right, only the reported "
        "number is wrong. Each rank's loss is its own positions' share of the step's mean; the printed loss "
        "must sum the shares over every rank that holds other tokens: dp (other rows) *and* cp (other "
        "positions of the same rows). Summed over dp only, rank 0 reports the share of its own positions "
        "(with zig-zag, about half at cp 2). Fix: `global_sum` over `dp_cp`."),
    Exhibit("06.bug3",
        "the 5D run with cp 2 reports twice chapter 05's aux loss, and its losses part from step 2",
        "tokens counted before the CP split (the balance statistics' denominator)",
        "common/moe_routing.py",
        "f = whole.float() / (S * parts * top_k)",
        "f = whole.float() / (S * top_k)",
        ("tests/test_cp.py::test_5d_layouts_match_chapter_05_on_one_device",),
        ("python 06_context_parallel/train_5d.py --model tiny-moe --aux-loss-coef 0.1 --steps 5 --quiet "
         "--metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=4 06_context_parallel/train_5d.py --model tiny-moe --aux-loss-coef 0.1 --dp 2 --ep 2 "
         "--tp 1 --pp 1 --cp 2 --steps 5 --quiet --metrics runs/bug/cp2.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/cp2.jsonl --key aux_loss"),
        "`compare_metrics --key aux_loss` shows a ratio of exactly cp (2) at step 1 (about 2 after), and the loss "
        "follows. "
        "Under CP each rank holds S of the sequence's cp·S positions; the slot counts fᵢ are summed over the CP "
        "group (the whole sequence's), so they must be divided by the whole sequence's slots, cp·S·k. "
        "Dividing by this rank's S·k counts the sequence's tokens as if it were not split: fᵢ is cp× too "
        "large, and so is the balance loss and its gradient. Fix: divide by `S * parts * top_k`."),
    Exhibit("06.bug4",
        "--cp-attention alltoall runs, its bytes equal the formula and its work is balanced, but its losses "
        "part from one device's at step 1",
        "an all-to-all re-partition that puts the heads back in the wrong order",
        "06_context_parallel/alltoall_attention.py",
        "        return t.transpose(0, 1).reshape(B, self.n * g, nL // self.n, hd)       # (B, a, L, hd)",
        "        return t.permute(1, 2, 0, 3, 4).reshape(B, self.n * g, nL // self.n, hd)  # (B, a, L, hd)",
        ("tests/test_ring_attention.py::test_matches_single_device_attention",),
        ("python 06_context_parallel/train_cp.py --steps 5 --quiet --metrics runs/bug/one.jsonl",
         "torchrun --nproc_per_node=2 06_context_parallel/train_cp.py --cp 2 --cp-attention alltoall --steps 5 --quiet "
         "--metrics runs/bug/a2a.jsonl",
         "python -m common.compare_metrics runs/bug/one.jsonl runs/bug/a2a.jsonl"),
        "The loss differs already at step 1, so the forward is wrong; the bytes equal the formula and the "
        "shapes are right, so nothing is lost or duplicated: something is in the wrong place. "
        "`tests/test_ring_attention.py` narrows it to the all-to-all variant (ring and all-gather pass), every "
        "case at cp ≥ 2, the output off by ~100 %. After the second all-to-all piece j holds head group j; "
        "`(n, B, h/n, L, hd)` must become `(B, n, h/n, L, hd)` (group, then head within it) before the heads "
        "are merged. Permuting to `(B, h/n, n, L, hd)` merges them as (head within group, group): head slot i "
        "receives another rank's head, and `wo` mixes the wrong heads — every rank attends correctly and then "
        "labels its results with another rank's heads. Fix: `t.transpose(0, 1)`, the inverse of `to_heads`' "
        "split `view(B, n, h/n, L, hd)`."),
)
