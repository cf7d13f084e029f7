"""Starting and stopping the distributed runtime: backend, device, threads, timeouts, printing.

`torchrun` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process it
starts. A plain `python script.py` has none of them: then we are world size 1, and we still create a
process group (of one) so that the same code path, collectives included, runs in every layout.
"""
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.errors import require


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_group: bool   # False when a test harness created the process group and keeps it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """The world size before any process group exists, so configurations can be checked first."""
    return int(os.environ.get("WORLD_SIZE", 1))


def choose_device(requested: str | None, local_rank: int) -> torch.device:
    """NCCL with one GPU per local rank when CUDA is there, gloo on CPU otherwise; `--device` overrides."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    require(requested in ("cpu", "cuda"), f"--device must be cpu or cuda, not {requested!r}")
    if requested == "cuda":
        require(torch.cuda.is_available(), "--device cuda was asked for but CUDA is not available; use --device cpu")
        require(local_rank < torch.cuda.device_count(),
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                "launch at most one rank per GPU with --nproc_per_node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str | None = None, timeout_s: float = 60.0) -> Runtime:
    """Initialise (or join) the default process group and return who we are.

    The timeout bounds how long a collective waits for a peer: if a rank dies or hangs, the others
    fail with an error after `timeout_s` instead of waiting forever.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = choose_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    owns = not dist.is_initialized()
    if owns:
        # NCCL binds each rank to its GPU up front (device_id), so barriers and collectives never
        # have to guess which device a rank uses.
        bind = {"device_id": dev} if dev.type == "cuda" else {}
        timeout = datetime.timedelta(seconds=timeout_s)
        if "WORLD_SIZE" not in os.environ:          # plain `python script.py`: a group of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bind)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=attempt_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, **bind)
        else:
            dist.init_process_group(backend, timeout=timeout, **bind)
    if dev.type == "cpu":
        set_cpu_threads()
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend, owns)


def attempt_store(timeout) -> dist.Store:
    """Under torchrun, the rendezvous store of this attempt: torchrun's own store (its agent serves it
    at MASTER_ADDR:MASTER_PORT), with every key under `attempt_<restart count>/`.

    When torchrun restarts a failed group (--max-restarts), the new ranks meet in the same store as the
    dead ones. The process groups publish their addresses there under names that are the same in every
    attempt, so without a prefix a new rank can read a dead rank's address and fail to connect to it
    ("Connection refused"), failing the restart. A prefix per attempt makes each attempt's keys its own."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def set_cpu_threads() -> None:
    """Ranks on one machine share its cores: give each an equal slice, at least one thread.

    Without this every rank starts one thread per core and they fight over the cores, which makes
    an 8-rank run on a 4-core laptop many times slower than it needs to be. Where other work shares the
    machine too (the test suite runs three files at once), `THREADS_PER_RANK=N` sets the slice instead:
    two runs of one rank, each taking every core, spin against each other many times slower than one
    thread each.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    share = max(1, (os.cpu_count() or 1) // local_world)
    given = os.environ.get("THREADS_PER_RANK")
    require(given is None or (given.isdigit() and int(given) >= 1),
            f"THREADS_PER_RANK must be a whole number ≥ 1, got {given!r}; unset it to give each rank its share "
            f"of the cores ({share})")
    torch.set_num_threads(share if given is None else int(given))


def shutdown(rt: Runtime) -> None:
    if rt.owns_group and dist.is_initialized():
        dist.destroy_process_group()
