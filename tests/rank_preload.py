"""What the harness's fork server imports once, so that its ranks need not (harness.PRELOAD): every chapter's
training script, the shape checks autograd imports at a pipeline stage's first backward with a given gradient
(torch.fx's symbolic_shapes, with sympy: ~0.3 s of CPU a rank), and the compiler (torch._dynamo, ~1 s), which
torch.utils.checkpoint imports at its first call: every rank that recomputes (--recompute) would pay it.

A module that fails to import (a student copy's, a planted bug's) is left out here: the rank that needs it
imports it again and reports the error there, in the test that ran it."""
import importlib

MODULES = ["torch.fx.experimental.symbolic_shapes", "torch._dynamo",
           "01_data_parallel.train_dp", "01_data_parallel.train_zero", "02_tensor_parallel.train_tp",
           "03_pipeline_parallel.train_pp", "04_3d_combined.train_3d", "05_moe_expert_parallel.train_moe",
           "05_moe_expert_parallel.train_4d", "06_context_parallel.train_cp", "06_context_parallel.train_5d"]

for name in MODULES:
    try:
        importlib.import_module(name)
    except Exception:       # noqa: BLE001 (any error: the rank that imports it shows it)
        pass
