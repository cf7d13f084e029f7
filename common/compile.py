"""`--compile`: torch.compile applied to each transformer block, the way large training frameworks do it.

Why per block and not the whole model? Every block of a preset has the same code and the same shapes,
so the compiler traces one block once and reuses the compiled code for the others (its parameters are
inputs of the graph, not constants baked into it): a 24-layer model compiles as fast as a 1-layer
one. And what lies *between* the blocks stays plain Python, which is exactly where the chapters do
their own work: a pipeline stage's send/recv, ZeRO-3's all-gathers, the executor's schedule.

`block.compile()` (nn.Module.compile) compiles the block *in place*: its parameters keep their names
(`layers.3.attn.wq.weight`), so checkpoints, the optimizer's weight-decay groups and every
chapter's name-based sharding see the same model as without `--compile`. The compiler runs at the
block's first call, not here, so whatever a chapter later puts inside a block (chapter 02's
tensor-parallel attention, chapter 05's expert-parallel MoE, chapter 06's ring attention) is what
gets compiled.

Where the compiler cannot follow. A collective written by hand (TP's f and g, the ring's send/recv,
EP's all-to-all) is a call into the process group that the compiler does not trace: the graph breaks
there, the compiler compiles the pieces before and after it, and the call itself runs as in eager
mode (common/comm.py marks every collective so). A tensor-parallel block is then a few compiled pieces
around its f and g; chapter 06's context-parallel attention and chapter 05's MoE layers are marked to
run eagerly as a whole (the ring's hops and its work count, the routing's row counts that only the data decide),
with the rest of their block compiled. The losses are the same either way; only the speed-up shrinks
with each break.

Backends (`--compile BACKEND`):
  inductor   the default: generates fused kernels (Triton on a GPU, C++ on a CPU, which needs a C++
             compiler and takes about a minute the first time on a laptop; later runs read a cache)
  aot_eager  traces and differentiates each block exactly as inductor does, then runs PyTorch's own
             kernels: no speed-up, but it compiles in seconds, so it checks on a laptop that a chapter's
             blocks compile and give the eager losses (the tests use it)
"""
import functools
import importlib.util
import shutil

import torch

from common.errors import require

BACKENDS = ("none", "inductor", "aot_eager")


# What runs eagerly. `@eager` marks a function the compiler must not trace (a collective of common/comm.py,
# the MoE layer's forward, the ring's attention): under --compile the graph is cut at its call, and the call
# runs as written. torch.compiler.disable does exactly that, but applied at import it imports the compiler
# (about 1.5 s of CPU per process), and many processes never compile: a rank that refuses its flags, the
# planner, a notebook's kernel. So the mark asks at each call whether the compiler is tracing it: in eager
# mode (`torch.compiler.is_compiling()` is False, a flag read, the compiler not imported) it calls `fn`;
# while the compiler traces a block, it hands the call to `fn`'s compiler-disabled twin, and the compiler
# cuts the graph there. The mark holds all it does: nothing is installed later.


def eager(fn):
    """`fn`, a module's function or a class's method, run as written between compiled pieces."""
    @functools.wraps(fn)
    def as_written(*args, **kwargs):
        if torch.compiler.is_compiling():                   # traced: cut the graph, run fn eagerly
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)
    return as_written


def compile_blocks(model, backend: str):
    """Mark every block of `model` (its `.layers`) to be compiled by `backend` at its first call.

    A block under full recomputation (common/recompute.py) keeps its forward eager and compiles its body:
    the recomputation wraps the body (torch.utils.checkpoint, run as written, with the course's context
    for the rerun), and the body it runs twice, once in the forward and once in the backward, is the
    compiled one. This is the order large training frameworks use too: recomputation outside, the
    compiler inside it."""
    if backend == "none":
        return model
    for block in model.layers:
        if block.recompute_mode == "full":
            block.body = torch.compile(block.body, backend=backend)     # forward: recomputed(self.body, ...)
        else:
            block.compile(backend=backend)
    return model


def check_compile(args, split_w: bool = False) -> None:
    """Refuse, in one line, a --compile that cannot work here (before any process group exists).
    split_w: the run's pipeline schedule splits the backward in two, B now, W later, by giving each linear
    layer a backward of its own that postpones dW (03_pipeline_parallel/zero_bubble.py; the schedule's
    `split_w` in pipeline_schedules.SCHEDULES). A compiled block has one backward for the whole block,
    computed by the compiler's own code, which knows nothing of that split."""
    backend, device, recompute = args.compile, args.device, args.recompute
    if backend == "none":
        return
    schedule = getattr(args, "schedule", None)
    require(not split_w,
            f"--compile {backend} with --schedule {schedule}: a compiled block's backward cannot be split into "
            "zero bubble's B and W; use --schedule 1f1b (or gpipe, interleaved) with --compile")
    # chapter 04's meter (common/live_memory.py) is a dispatch mode: torch.compile does not compile a frame
    # while one is active, so the run would silently be eager (seen: no graph built under it)
    require(not getattr(args, "measure_memory", False),
            f"--compile {backend} with --measure-memory: torch.compile does not compile while the meter counts "
            "every operation (the run would be eager); measure memory without --compile, or compile without "
            "--measure-memory")
    require(torch._dynamo.is_dynamo_supported(),
            f"--compile {backend}: torch.compile does not support this Python/PyTorch build; "
            "leave --compile out (eager mode gives the same losses)")
    # Selective recomputation chooses pieces *inside* a block (a norm, SwiGLU's product), told by a context
    # variable that a compiled graph cannot read. Inside a compiled block the compiler makes that choice
    # itself: inductor's partitioner recomputes cheap elementwise results in the backward when that moves
    # fewer bytes than keeping them. Full recomputation wraps a whole block and composes (compile_blocks).
    require(recompute != "selective",
            f"--compile {backend} with --recompute selective: which pieces of a compiled block are kept is "
            "the compiler's choice (inductor recomputes cheap elementwise results itself); use --recompute "
            "full (the whole block rerun, compiled inside) or none with --compile")
    if backend != "inductor":
        return
    cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    if cuda:
        require(importlib.util.find_spec("triton") is not None,
                "--compile inductor on a GPU needs Triton, which this PyTorch lacks; install a PyTorch build "
                "with Triton, or use --compile aot_eager")
    else:
        require(any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
                "--compile inductor on a CPU needs a C++ compiler (g++ or clang++) on PATH; install one, "
                "or use --compile aot_eager (no speed-up, same losses)")
