"""The allocator's model against PyTorch's own allocator, on a GPU: replay a step's allocations and compare.

    python 07_choosing_a_layout/replay_allocations.py            # torchtitan's Llama 3.1 8B run, one rank
    python 07_choosing_a_layout/replay_allocations.py --model tiny --seq-len 256 --rows 4 --world 2

torchtitan_step.fake_trace traces the run's step on fake tensors (seconds, any machine); caching_allocator.py
says what the CUDA caching allocator would reserve for it, by default and with expandable segments. On a
GPU this then asks the real allocator: every allocation of the trace made with torch.empty on its stream
(each stream of the trace a CUDA stream), every free a `del`, in order, and torch.cuda.max_memory_reserved
read at the end, once per mode (expandable segments set in a fresh process, before CUDA starts). It prints
both and writes results/allocator_replay.json. No arithmetic runs: the replay moves no data, it only asks
for memory, so the tensors' bytes and order are the step's and nothing else is. Without CUDA it prints the
model's numbers and says the replay needs a GPU.
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.cli import Parser  # noqa: E402
from common.domains import POSITIVE_INT  # noqa: E402
from common.errors import require, run_main  # noqa: E402

caching_allocator = import_module("07_choosing_a_layout.caching_allocator")
allocation_trace = import_module("07_choosing_a_layout.allocation_trace")
choose_layout = import_module("07_choosing_a_layout.choose_layout")        # this chapter: the --model domain
layout_inputs = import_module("07_choosing_a_layout.layout_inputs")        # this chapter: the models
RESULT = Path(__file__).resolve().parent / "results" / "allocator_replay.json"
GiB = 2 ** 30


def replay(events, device: str = "cuda") -> None:
    """Each allocation of `events` made (torch.empty on its stream), each free a del, in order."""
    streams = {}
    live = {}
    for e in events:
        if e.kind == "free":
            del live[e.key]
            continue
        if device == "cuda" and e.stream != "compute":
            stream = streams.setdefault(e.stream, torch.cuda.Stream())
        else:
            stream = None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            live[e.key] = torch.empty(e.nbytes, dtype=torch.uint8, device=device)


def replay_on_gpu(path: str) -> dict:
    """In this process (started for it, its allocator set by PYTORCH_CUDA_ALLOC_CONF): the real allocator's
    peaks for the trace saved at `path`."""
    events = [allocation_trace.Event(*e) for e in json.loads(Path(path).read_text())]
    replay(events)
    torch.cuda.synchronize()
    return {"reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.max_memory_allocated()}


def peak_words(moment: dict) -> str:
    """The expandable allocator's peak in one line: the request that set it, each pool's reserve and free."""
    pools = "; ".join(f"{stream} ({size}) {held / GiB:.2f} GiB reserved, {free / GiB:.2f} free"
                      for (stream, size), (held, free) in moment["pools"].items() if held >= GiB // 100)
    return (f"its peak (expandable): a request of {moment['request'] / GiB:.2f} GiB; {pools}; the largest free "
            f"block {moment['largest free'] / GiB:.2f} GiB")


def main(argv=None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=choose_layout.MODEL, default="llama3-8b",
                   help=f"a course preset or a published shape ({', '.join(layout_inputs.MODELS)}) or PATH.json")
    p.add_argument("--world", type=POSITIVE_INT, default=8, help="FSDP ranks (the trace is one rank's)")
    p.add_argument("--rows", type=POSITIVE_INT, default=2, help="sequences per rank in its one micro-batch")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=8192, help="tokens per sequence")
    p.add_argument("--replay", choices=[str(RESULT.with_suffix(".trace.json"))], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.replay:                                     # the child: one mode, one fresh allocator
        print(json.dumps(replay_on_gpu(args.replay)))
        return 0
    cfg = layout_inputs.model_for(args.model)
    require(args.seq_len <= cfg.max_seq_len, f"--seq-len {args.seq_len} is longer than {args.model}'s "
                                             f"{cfg.max_seq_len} positions")
    events = import_module("07_choosing_a_layout.torchtitan_step").fake_trace(cfg, args.world, args.rows, args.seq_len)
    result = {"run": vars(args) | {"replay": None}, "tensors": allocation_trace.live_peak(events),
              "model": {mode: caching_allocator.reserved_peak(events, mode == "expandable")
                        for mode in ("segments", "expandable")}}
    print(f"{len(events):,} events; tensors at most {result['tensors'] / GiB:.2f} GiB; the model reserves "
          f"{result['model']['segments'] / GiB:.2f} GiB (segments), {result['model']['expandable'] / GiB:.2f} "
          f"GiB (expandable)")
    print(peak_words(caching_allocator.peak_moment(events, expandable=True)))
    if not torch.cuda.is_available():
        print("no CUDA here: the replay against PyTorch's allocator needs a GPU")
        return 0
    trace = RESULT.with_suffix(".trace.json")
    trace.write_text(json.dumps([list(e) for e in events]))
    result["gpu"] = {"name": torch.cuda.get_device_name()}
    for mode in ("segments", "expandable"):
        conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if mode == "expandable" else {}
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"} | conf
        out = subprocess.run([sys.executable, __file__, "--replay", str(trace)], env=env,
                             capture_output=True, text=True, check=True).stdout
        result["gpu"][mode] = json.loads(out.splitlines()[-1])
        real, model = result["gpu"][mode]["reserved"], result["model"][mode]
        print(f"{mode}: PyTorch's allocator reserved {real / GiB:.2f} GiB, the model {model / GiB:.2f} "
              f"({model / real - 1:+.1%}); allocated {result['gpu'][mode]['allocated'] / GiB:.2f} GiB")
    trace.unlink()
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
