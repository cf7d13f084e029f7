"""One clear message and a non-zero exit on every rank: the project's way of failing.

Configuration checks raise `ConfigError`. They run on every rank on the same inputs, so every rank
reaches the same verdict without talking to the others, and nobody is left waiting in a collective.
`run_main` turns the exception into one line on the console (printed by rank 0) and exit code 2 on
every rank; under torchrun, the launcher's closing report ends with the same reason (see `fail`).
A peer that died shows up here as a RuntimeError from the communication backend; it is reported on
each surviving rank in one line, with exit code 1.

A run that succeeds leaves through `exit_now(0)` too, not through the interpreter's normal teardown.
The reason is a race at exit: gloo finishes a collective on its own worker thread, and that thread
may still be dropping its last reference to the collective's tensors when the main thread has already
returned from `main()`. Freeing a tensor that Python knows about needs Python; once Python is shutting
down, the thread is stopped in the middle of that cleanup, and the C++ runtime aborts the whole
process (SIGABRT, "terminate called without an active exception") after all the work was done. It
happened in about one run in twenty on a busy 2-core machine. Nothing we need happens in the
teardown: the metrics file is closed, checkpoints are written atomically, the console is flushed.
"""
import json
import os
import sys
import time

PEER_GRACE_S = 5.0   # how long ranks other than 0 let rank 0 report a configuration error first
# Under torchrun, which stops every rank as soon as rank 0 exits, the wait costs nothing when rank 0 fails
# too, and a loaded machine can start rank 0 seconds after the others: there they wait longer.
LAUNCHED_GRACE_S = 30.0


class ConfigError(Exception):
    """An invalid configuration: the message says what is wrong and how to fix it."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def run_main(main) -> None:
    """Run `main()` as a script entry point with the project's failure rules."""
    rank = int(os.environ.get("RANK", 0))
    try:
        main()
    except ConfigError as err:
        if rank != 0:
            # Every rank reaches the same verdict, but the launcher stops all ranks as soon as the first
            # one exits: if that were rank 1, rank 0 would die before printing. So the others wait a
            # moment for rank 0 to print and exit (the launcher then stops them, and the user reads the
            # message once); a rank that waited in vain (rank 0 slow, or the check failed only here)
            # prints the message itself.
            time.sleep(LAUNCHED_GRACE_S if "TORCHELASTIC_RUN_ID" in os.environ else PEER_GRACE_S)
        fail("error", str(err), 2)
    except KeyboardInterrupt:
        exit_now(130)
    except (MemoryError, RuntimeError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, MemoryError) or "out of memory" in text or "can't allocate memory" in text:
            fail(f"error [rank {rank}]", f"out of memory ({text[:160]}); use a smaller --model, --global-batch "
                 "or --seq-len, more --microbatches, or more ranks", 1)
        if _looks_like_peer_failure(text):
            text = text.split("] ", 1)[-1].split(". This is typically")[0][:160]   # drop the backend's file:line
            fail(f"error [rank {rank}]", f"lost contact with another rank ({text}); "
                 "it probably crashed or was killed; see its own output above", 1)
        raise
    exit_now(0)     # success: leave without the interpreter's teardown (see the module docstring)


def fail(prefix: str, reason: str, code: int) -> None:
    """Print the one line `prefix: reason`, leave `reason` where torchrun looks for this rank's, and
    exit with `code` (at once: a half-initialised process group must not block the interpreter's teardown).

    torchrun ends a failed run with its own report, which names the rank that failed first and its
    exit code. Its last line is that rank's error file (TORCHELASTIC_ERROR_FILE, one per rank): when
    the rank wrote none, the report says "To enable traceback see: <url>", as if a traceback were
    hidden; with the reason in the file, the report ends with the reason itself."""
    print(f"{prefix}: {reason}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        if path:
            # Written whole or not at all: torchrun may SIGTERM this rank at any moment (another rank died),
            # and it reads the file as JSON; an empty file left by a kill mid-write would crash its agent
            # instead of letting it restart the group. So: a temporary file, then one atomic rename.
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as file:        # the layout torchrun's own ErrorHandler writes
                json.dump({"message": {"message": reason, "extraInfo": {"timestamp": str(int(time.time()))}}}, file)
            os.replace(tmp, path)
    except OSError:
        pass                                    # the line is printed; the report keeps its own words
    exit_now(code)


def exit_now(code: int) -> None:
    """Flush the console and end the process at once, skipping the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):      # a closed or broken pipe: nothing more can be said there
            pass
    os._exit(code)


def _looks_like_peer_failure(text: str) -> bool:
    keys = ("Connection closed", "Connection reset", "connection", "Broken pipe", "timed out", "Timeout",
            "NCCL", "Gloo", "gloo", "recv", "peer")
    return any(k in text for k in keys)
