"""The flags added with the V schedules, ZeRO on every grid and the CP variants, refused in one line by the
script that reads them, each message as the user reads it. Every case runs the script's own `main` in this
process at its world size, stopped where it would start its process group (the checks come before it)."""
import os
from importlib import import_module
from unittest import mock

import pytest
import torch.distributed as dist

from common.errors import ConfigError


class _Accepted(Exception):
    """The script got past its checks."""


def refusal(script: str, world: int, argv: list) -> str:
    """The one-line ConfigError `script` raises at `world` ranks for argv (a failure if it accepts them)."""
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world)}), \
            mock.patch.object(dist, "init_process_group", side_effect=_Accepted), pytest.raises(ConfigError) as err:
        import_module(script).main(argv + ["--quiet", "--steps", "1"])
    assert "\n" not in str(err.value)
    return str(err.value)


PP, GRID, EXPERTS, FIVE = ("03_pipeline_parallel.train_pp", "04_3d_combined.train_3d",
                           "05_moe_expert_parallel.train_4d", "06_context_parallel.train_5d")
CASES = {
    "dualpipev, too few micro-batches": (PP, 2, ["--schedule", "dualpipev", "--microbatches", "2"],
                                         "dualpipev needs --microbatches ≥ 2 × --pp (4), got 2; use --microbatches 4"),
    "zb-v with --virtual-stages": (PP, 2, ["--schedule", "zb-v", "--virtual-stages", "3"],
                                   "the zb-v schedule holds 2 stages per rank; drop --virtual-stages"),
    "dualpipev on the 3D grid": (GRID, 4, ["--dp", "1", "--tp", "1", "--pp", "4", "--schedule", "dualpipev",
                                           "--microbatches", "4"],
                                 "dualpipev needs --microbatches ≥ 2 × --pp (8), got 4; use --microbatches 8"),
    "dualpipev with experts": (EXPERTS, 4, ["--dp", "2", "--ep", "2", "--pp", "2", "--tp", "1", "--schedule",
                                            "dualpipev", "--microbatches", "2"],
                               "dualpipev needs --microbatches ≥ 2 × --pp (4), got 2; use --microbatches 4"),
    "ZeRO-5 on the 3D grid": (GRID, 4, ["--dp", "4", "--tp", "1", "--pp", "1", "--zero-stage", "5"],
                              "argument --zero-stage: invalid choice: 5 (choose from 0, 1, 2, 3)"),
    "ZeRO-4 with experts": (EXPERTS, 4, ["--dp", "4", "--ep", "2", "--zero-stage", "4"],
                            "argument --zero-stage: invalid choice: 4 (choose from 0, 1, 2, 3)"),
    "ZeRO -1 with CP": (FIVE, 4, ["--dp", "2", "--cp", "2", "--zero-stage", "-1"],
                        "argument --zero-stage: invalid choice: -1 (choose from 0, 1, 2, 3)"),
    "--cp-alltoall without the hybrid": ("06_context_parallel.train_cp", 4, ["--cp", "4", "--cp-alltoall", "2"],
                                         "--cp-alltoall 2 sets the all-to-all degree of --cp-attention alltoall+ring "
                                         "only; leave it out with --cp-attention ring"),
    "--cp-alltoall that does not divide cp": (FIVE, 4, ["--cp", "4", "--dp", "1", "--cp-attention", "alltoall+ring",
                                                         "--cp-alltoall", "3"], "--cp-alltoall 3 must divide --cp 4; "
                                                                                "use a divisor of 4"),
    "--pp-sends scatter-gather with SP and experts": (EXPERTS, 8, ["--dp", "2", "--ep", "2", "--tp", "2", "--pp", "2",
                                                                   "--sequence-parallel", "--pp-sends",
                                                                   "scatter-gather"],
                                                      "--pp-sends scatter-gather splits each pipeline message over TP"),
    "--pp-sends scatter-gather with CP, no TP": (FIVE, 4, ["--dp", "1", "--tp", "1", "--pp", "2", "--cp", "2",
                                                           "--pp-sends", "scatter-gather"],
                                                 "--pp-sends scatter-gather splits each pipeline message over TP"),
    "--pp-sends of another kind": (FIVE, 4, ["--cp", "2", "--pp-sends", "halves"],
                                   "argument --pp-sends: invalid choice: 'halves'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_flag_is_refused_in_one_line(case):
    script, world, argv, message = CASES[case]
    assert refusal(script, world, argv).startswith(message)


@pytest.mark.parametrize("script, world, argv", [
    (GRID, 2, ["--dp", "1", "--tp", "1", "--pp", "2", "--schedule", "zb-v", "--virtual-stages", "3"]),
    (EXPERTS, 4, ["--dp", "2", "--ep", "2", "--pp", "2", "--tp", "1", "--schedule", "dualpipev", "--virtual-stages",
                  "3", "--microbatches", "4"])])
def test_a_v_schedule_with_other_virtual_stages_is_refused_on_every_grid(script, world, argv):
    assert "drop --virtual-stages" in refusal(script, world, argv)
