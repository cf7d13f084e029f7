"""07_choosing_a_layout/caching_allocator.py: the CUDA caching allocator's rules, one by one, on sequences of
allocations whose answer is worked out by hand in each test (MiB and GiB as the allocator counts them)."""
from importlib import import_module

import pytest

caching_allocator = import_module("07_choosing_a_layout.caching_allocator")
Event = import_module("07_choosing_a_layout.allocation_trace").Event

MiB, GiB = 2 ** 20, 2 ** 30


def trace(*steps, stream="compute"):
    """Events from ("+", key, bytes[, stream]) allocations and ("-", key) frees."""
    sizes, events = {}, []
    for kind, key, *rest in steps:
        if kind == "+":
            sizes[key] = rest[0]
            events.append(Event("alloc", key, rest[0], rest[1] if len(rest) > 1 else stream))
        else:
            events.append(Event("free", key, sizes[key], next(e.stream for e in events if e.key == key)))
    return events


def reserved(events, expandable=False) -> int:
    return caching_allocator.reserved_peak(events, expandable)


def test_requests_are_rounded_and_served_from_their_pool():
    # small requests share one 2 MiB segment; a request under 10 MiB takes a 20 MiB one, the next ones its rest
    assert reserved(trace(("+", 1, 100), ("+", 2, 1000), ("+", 3, MiB))) == 2 * MiB
    assert reserved(trace(("+", 1, 5 * MiB), ("+", 2, 5 * MiB), ("+", 3, 5 * MiB), ("+", 4, 5 * MiB))) == 20 * MiB
    # a large request: rounded up to 2 MiB, its own segment
    assert reserved(trace(("+", 1, 100 * MiB + 1))) == 102 * MiB
    # a small and a large request never share a segment
    assert reserved(trace(("+", 1, 100), ("+", 2, 5 * MiB))) == 22 * MiB
    # expandable: pages of 2 MiB (small) and 20 MiB (large)
    assert reserved(trace(("+", 1, 100 * MiB + 1)), expandable=True) == 120 * MiB
    assert reserved(trace(("+", 1, 100), ("+", 2, 3 * MiB)), expandable=True) == 22 * MiB


def test_a_block_s_rest_is_split_off_only_if_it_is_more_than_a_mib():
    # 9 MiB, then 10 MiB from the same 20 MiB segment's rest leave 1 MiB: handed out with the 10, so the next
    # request of just over a MiB takes a new segment
    assert reserved(trace(("+", 1, 9 * MiB), ("+", 2, 10 * MiB), ("+", 3, MiB + 512))) == 40 * MiB
    # 9.5 MiB leaves 1.5 MiB: split off, and the next request fits in it
    assert reserved(trace(("+", 1, 9 * MiB), ("+", 2, 9 * MiB + MiB // 2), ("+", 3, MiB + 512))) == 20 * MiB


def test_a_freed_block_serves_what_fits_in_it_and_merges_with_its_free_neighbours():
    """The loss of a step in small: 10, 4, 8 and 8 GiB live; the 4 and the 8 after it freed (one 12 GiB hole,
    merged); an 8 GiB request fits in the hole, the next 8 does not: 34 GiB of tensors at most, 38 reserved."""
    events = trace(("+", 1, 10 * GiB), ("+", 2, 4 * GiB), ("+", 3, 8 * GiB), ("+", 4, 8 * GiB),
                   ("-", 3), ("-", 2), ("+", 5, 8 * GiB), ("+", 6, 8 * GiB))
    assert import_module("07_choosing_a_layout.allocation_trace").live_peak(events) == 34 * GiB
    assert reserved(events) == 38 * GiB               # segments: the 4 and the 8 were apart, one each
    assert reserved(events, expandable=True) == 38 * GiB + 8 * MiB      # 20 MiB pages
    for expandable in (False, True):     # at the peak: the second 8 GiB asked, the hole's 4 GiB left empty
        moment = caching_allocator.peak_moment(events, expandable)
        assert (moment["request"], moment["largest free"]) == (8 * GiB, 4 * GiB)
        slack = 8 * MiB if expandable else 0                      # the last page's rest
        assert moment["pools"][("compute", "large")] == (moment["reserved"], 4 * GiB + slack)
    # two 6 GiB requests fit only in the merged 12 GiB hole: one expandable segment merges the 4 and the 8;
    # separate segments never merge, and the second 6 takes a new one
    then = trace(("+", 1, 4 * GiB), ("+", 2, 8 * GiB), ("+", 3, GiB), ("-", 1), ("-", 2),
                 ("+", 4, 6 * GiB), ("+", 5, 6 * GiB))
    first = then[:3]
    assert reserved(then, expandable=True) == reserved(first, expandable=True)
    assert reserved(then) == reserved(first) + 6 * GiB


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    """Holes of 9 and 6 GiB between live blocks: 5 GiB goes in the 6 and 8 GiB in the 9, so no more memory
    than the live blocks took (the first hole that fits, the 9, would leave no room for the 8)."""
    then = trace(("+", 1, 9 * GiB), ("+", 2, GiB), ("+", 3, 6 * GiB), ("+", 4, GiB), ("-", 1), ("-", 3),
                 ("+", 5, 5 * GiB), ("+", 6, 8 * GiB))
    for expandable in (False, True):
        assert reserved(then, expandable) == reserved(then[:4], expandable)


def test_an_expandable_segment_grows_its_free_end_in_place():
    # 100 MiB freed at the end, then 300 MiB: the free end grows by 200 MiB; separate segments need 400
    events = trace(("+", 1, 100 * MiB), ("-", 1), ("+", 2, 300 * MiB))
    assert reserved(events, expandable=True) == 300 * MiB
    assert reserved(events) == 400 * MiB
    # a hole below the end is not grown: it stays, and the request is mapped above
    events = trace(("+", 1, 100 * MiB), ("+", 2, 20 * MiB), ("-", 1), ("+", 3, 300 * MiB))
    assert reserved(events, expandable=True) == 420 * MiB


@pytest.mark.parametrize("expandable", [False, True])
def test_each_stream_keeps_its_own_blocks(expandable):
    # freed on the all-gather stream, 100 MiB does not serve the compute stream's 100 MiB
    events = trace(("+", 1, 100 * MiB, "stream 1"), ("-", 1), ("+", 2, 100 * MiB, "compute"))
    assert reserved(events, expandable) == 200 * MiB
    assert reserved(trace(("+", 1, 100 * MiB), ("-", 1), ("+", 2, 100 * MiB)), expandable) == 100 * MiB


def test_the_replay_makes_each_allocation_and_frees_each_in_order():
    """replay_allocations.replay (what a GPU runs to ask PyTorch's own allocator), here on the CPU under the
    meter: the bytes live at once at their most are the trace's."""
    from common.live_memory import LiveTensors
    replay_allocations = import_module("07_choosing_a_layout.replay_allocations")
    events = trace(("+", 1, 10 * MiB), ("+", 2, 4 * MiB), ("+", 3, 8 * MiB, "stream 1"), ("-", 2), ("+", 4, 3 * MiB),
                   ("-", 1), ("+", 5, 12 * MiB), ("-", 3), ("-", 4), ("-", 5))
    with LiveTensors() as meter:
        replay_allocations.replay(events, device="cpu")
    assert meter.peak == import_module("07_choosing_a_layout.allocation_trace").live_peak(events) == 23 * MiB
    assert meter.live == 0


def test_without_a_gpu_the_replay_gives_the_model_s_numbers(capsys):
    replay_allocations = import_module("07_choosing_a_layout.replay_allocations")
    assert replay_allocations.main(["--model", "tiny", "--world", "2", "--rows", "2", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "GiB (segments)" in out and "needs a GPU" in out


@pytest.mark.parametrize("flags, message", [
    (["--model", "nope"], "--model nope: unknown model"),
    (["--world", "0"], "--world must be a whole number ≥ 1, got 0"),
    (["--rows", "-2"], "--rows must be a whole number ≥ 1, got -2"),
    (["--model", "tiny", "--seq-len", "100000"], "--seq-len 100000 is longer than tiny's 256 positions"),
])
def test_a_bad_flag_of_the_replay_is_one_line(flags, message):
    """Refused before anything is traced, with the flag named (the script exits 2: run_main)."""
    from common.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        import_module("07_choosing_a_layout.replay_allocations").main(flags)
    assert message in str(err.value)


def test_a_bad_flag_of_the_replay_exits_2_with_its_line():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "07_choosing_a_layout/replay_allocations.py"), "--world", "0"],
                         capture_output=True, text=True, cwd=root)
    assert run.returncode == 2
    assert run.stderr.strip().startswith("error: --world must be a whole number ≥ 1") and run.stderr.count("\n") == 1
