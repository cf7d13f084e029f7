"""Every flag of every train_*.py is refused outside its domain, before any process group exists.

The flags are not listed here: each script's own parser is caught as the script parses, and every
flag it holds is walked with values outside the domain the flag declares (0, negative, nan, inf, a
directory, a missing, empty or binary file...). A flag without a declared domain fails the test.
All of it runs in this process: the checks are pure functions of the flags (and of the file system),
identical on every rank, so one process stands for all of them.
"""
import shlex
from importlib import import_module
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from common.cli import Parser, pipeline_microbatches
from common.domains import Domain
from common.distributed import set_cpu_threads
from common.errors import ConfigError
from harness import ROOT

SCRIPTS = sorted(f"{path.parent.name}.{path.stem}" for path in ROOT.glob("0*/train_*.py"))


class _Caught(Exception):
    pass


class _ReachedTraining(Exception):
    pass


def parser_of(module_name: str) -> Parser:
    """The parser `module_name`'s main() builds, caught when it starts parsing."""
    caught = []

    def catch(self, args=None, namespace=None):
        caught.append(self)
        raise _Caught

    with mock.patch.object(Parser, "parse_known_args", catch), pytest.raises(_Caught):
        import_module(module_name).main(["--quiet"])
    return caught[0]


def run_until_training(module_name: str, argv: list) -> None:
    """main(argv) in this process, stopped where it would create the process group."""
    def stop(*args, **kwargs):
        raise _ReachedTraining
    with mock.patch.object(dist, "init_process_group", stop):
        import_module(module_name).main(argv + ["--quiet"])


def bad_values(action, tmp) -> list[str]:
    """Values outside the flag's declared domain."""
    if action.choices is not None:
        ints = [c for c in action.choices if isinstance(c, int)]
        return [str(max(ints) + 1)] if ints else ["nosuch"]
    domain: Domain = action.type
    if domain.kind.startswith("int"):
        values = [str(domain.low - 1), "-1", "1.5", "nan", "x"]
    elif domain.kind.startswith("real"):
        below = domain.low if domain.kind.startswith("real>") else domain.low - 1e-3
        values = [f"{below:g}", "-1", "nan", "inf", "-inf", "x"]
    elif domain.kind == "text file":
        values = [tmp["missing"], tmp["dir"], tmp["empty"], tmp["binary"], tmp["latin1"]]
    elif domain.kind == "output directory":
        values = [tmp["file"], tmp["under_file"], ""]
    elif domain.kind == "output file":
        values = [tmp["dir"], tmp["under_file"], ""]
    else:
        assert domain.kind == "preset", domain.kind
        values = ["nosuch", ""]
    if domain.high is not None:
        values.append(str(domain.high * 2))
    return list(dict.fromkeys(values))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_inputs")
    (d / "dir").mkdir()
    (d / "empty.txt").write_text("")
    (d / "binary.bin").write_bytes(b"text, then \x00\x01\x02 bytes" * 100)
    (d / "latin1.txt").write_bytes("caf\xe9 au lait, ".encode("latin-1") * 100)
    (d / "file.txt").write_text("a file where a directory should be")
    return {"missing": str(d / "missing.txt"), "dir": str(d / "dir"), "empty": str(d / "empty.txt"),
            "binary": str(d / "binary.bin"), "latin1": str(d / "latin1.txt"), "file": str(d / "file.txt"),
            "under_file": str(d / "file.txt" / "sub")}


def flags(parser):
    return [a for a in parser._actions if a.option_strings and a.nargs != 0]      # switches take no value


def test_every_script_is_found():
    assert {"01_data_parallel.train_dp", "01_data_parallel.train_zero", "02_tensor_parallel.train_tp",
            "03_pipeline_parallel.train_pp", "03_pipeline_parallel.train_gpipe", "03_pipeline_parallel.train_1f1b",
            "04_3d_combined.train_3d"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_declares_a_domain_and_help_shows_its_default(script):
    parser = parser_of(script)
    formatter = parser._get_formatter()
    for action in flags(parser):
        flag = action.option_strings[0]
        assert isinstance(action.type, Domain) or action.choices is not None, f"{script} {flag}: no domain"
        assert "default" in formatter._get_help_string(action), f"{script} {flag}: --help hides its default"
    text = " ".join(parser.format_help().split())
    assert "(default: None)" not in text and text.count("(default: the bundled corpus") == 1


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_refuses_values_outside_its_domain(script, tmp):
    tried = 0
    for action in flags(parser_of(script)):
        flag = action.option_strings[0]
        for value in bad_values(action, tmp):
            with pytest.raises(ConfigError) as err:
                run_until_training(script, [f"{flag}={value}"])      # = : `--lr -inf` would read -inf as a flag
            message = str(err.value)
            assert flag in message and (shlex.quote(value) in message or repr(value) in message), (flag, message)
            assert "\n" not in message, message
            tried += 1
    assert tried >= 40, tried


@pytest.mark.parametrize("script", SCRIPTS)
def test_defaults_pass_every_check(script):
    with pytest.raises(_ReachedTraining):
        run_until_training(script, [])


# /proc is a directory that takes no new file, whoever asks; its permission bits say so to a user but
# not to root (os.access says yes), which is how a run as root on a special or read-only file system
# used to pass the check and fail at its first metrics write (or its last checkpoint) with a traceback.
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("flag, value, refused", [
    ("--metrics", "/proc/metrics.jsonl", "cannot be created: '/proc' refuses new files"),
    ("--metrics", "/proc/runs/3d/metrics.jsonl", "cannot be created: '/proc' refuses new files"),
    ("--checkpoint-dir", "/proc/checkpoints", "cannot be created: '/proc' refuses new files"),
    ("--checkpoint-dir", "/proc", "is not writable"),
])
def test_an_output_path_that_refuses_new_files_is_refused_before_training(flag, value, refused):
    with pytest.raises(ConfigError) as err:
        run_until_training("01_data_parallel.train_dp", [flag, value])
    assert str(err.value).startswith(f"{flag} {value}: {refused} (") and "\n" not in str(err.value), str(err.value)


def test_probing_the_output_paths_leaves_nothing_behind(tmp_path):
    (tmp_path / "old.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints").mkdir()
    before = sorted(tmp_path.rglob("*"))
    for argv in (["--metrics", tmp_path / "old.jsonl", "--checkpoint-dir", tmp_path / "checkpoints"],
                 ["--metrics", tmp_path / "new" / "m.jsonl", "--checkpoint-dir", tmp_path / "run" / "ckpt"]):
        with pytest.raises(_ReachedTraining):
            run_until_training("01_data_parallel.train_dp", [str(a) for a in argv])
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "old.jsonl").read_text() == '{"step": 1}\n'


def test_data_too_short_for_one_sequence(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("héllo " * 20)                           # 126 bytes
    with pytest.raises(ConfigError, match="too short for --seq-len 128"):
        run_until_training("01_data_parallel.train_dp", ["--data", str(short)])
    with pytest.raises(_ReachedTraining):
        run_until_training("01_data_parallel.train_dp", ["--data", str(short), "--seq-len", "16"])


def test_resume_with_nothing_left_to_train(tmp_path, capsys):
    from common import checkpoint
    from common.training import resume_state, run_identity
    train_dp = import_module("01_data_parallel.train_dp")
    args = train_dp.parse_args(["--checkpoint-dir", str(tmp_path), "--resume", "--steps", "5"])
    # no checkpoint yet: the same command starts the run (what torchrun --max-restarts re-runs), in one line
    assert resume_state(args) is None
    assert capsys.readouterr().out == f"--resume: no checkpoint in {str(tmp_path)!r} yet, so this run starts at step 1\n"
    checkpoint.save(tmp_path, 5, {}, {}, run_identity(args))
    with pytest.raises(ConfigError, match="is at step 5 and --steps is 5: nothing is left to train; pass --steps "
                                          "greater than 5"):
        resume_state(args)
    args.steps = 6
    assert resume_state(args)["step"] == 5


def test_a_fixed_schedule_script_refuses_another_schedule():
    with pytest.raises(ConfigError, match="argument --schedule: invalid choice: '1f1b' \\(choose from 'gpipe'\\)"):
        run_until_training("03_pipeline_parallel.train_gpipe", ["--schedule", "1f1b"])
    with pytest.raises(ConfigError, match="invalid choice: 'gpipe'"):
        run_until_training("03_pipeline_parallel.train_1f1b", ["--schedule", "gpipe"])
    help_text = parser_of("03_pipeline_parallel.train_gpipe").format_help()
    assert "fixed to gpipe by this script" in " ".join(help_text.split())


@pytest.mark.parametrize("world, argv, refused", [
    # 3 ranks, interleaved: no multiple of 3 splits 16 rows, so the batch must change
    (3, ["--schedule", "interleaved", "--virtual-stages", "2"], "use --global-batch 18 --microbatches 3"),
    (3, ["--schedule", "interleaved", "--virtual-stages", "2", "--global-batch", "18", "--microbatches", "4"],
     "use --microbatches 3 or 6 or 9"),
    (2, ["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3", "--global-batch", "6"],
     "use --microbatches 2 or 6"),
])
def test_the_micro_batch_suggestion_is_a_count_that_works(monkeypatch, world, argv, refused):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match="multiple of --pp") as err:
        run_until_training("03_pipeline_parallel.train_pp", argv)
    assert refused in str(err.value), str(err.value)
    fixed = dict(zip(argv[::2], argv[1::2]))
    suggestion = refused.removeprefix("use ").split(" or ")[0].split()
    fixed.update(zip(suggestion[::2], suggestion[1::2]))
    with pytest.raises(_ReachedTraining):                        # the suggestion passes every check
        run_until_training("03_pipeline_parallel.train_pp", [x for kv in fixed.items() for x in kv])


@pytest.mark.parametrize("rows, pp, schedule, expect", [
    (16, 2, "1f1b", 4), (16, 3, "1f1b", 4), (16, 4, "gpipe", 8), (18, 3, "interleaved", 6), (8, 4, "zb-h1", 8),
    (7, 2, "1f1b", 1)])
def test_default_micro_batches_are_the_largest_count_up_to_2pp_that_splits_the_rows(rows, pp, schedule, expect):
    args = mock.Mock(global_batch=rows * 2, microbatches=None, schedule=schedule)
    assert pipeline_microbatches(args, dp=2, pp=pp) == expect


DISTRIBUTES_EXPERTS = {"05_moe_expert_parallel.train_moe", "05_moe_expert_parallel.train_4d",
                       "06_context_parallel.train_5d"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_dense_only_script_refuses_a_mixture_of_experts_naming_the_script_that_splits_it(script):
    """Without its balancing terms and expert metrics a mixture of experts would train as something else:
    a script that does not distribute experts refuses the preset before any process group exists."""
    if script in DISTRIBUTES_EXPERTS:
        with pytest.raises(_ReachedTraining):
            run_until_training(script, ["--model", "tiny-moe"])
        return
    with pytest.raises(ConfigError, match=r"--model tiny-moe is a mixture of experts, which this script does not "
                                          r"distribute; run it with 0[56]_\w+/train_(moe|4d|5d)\.py") as refused:
        run_until_training(script, ["--model", "tiny-moe"])
    if script.startswith(("02", "03", "04")):
        assert "train_4d.py" in str(refused.value), "TP and PP with experts is chapter 05's 4D run"
    if script.startswith("06"):
        assert "train_5d.py" in str(refused.value), "CP with experts is chapter 06's 5D run"


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5", ""])
def test_threads_per_rank_outside_its_domain_is_one_line(monkeypatch, value):
    monkeypatch.setenv("THREADS_PER_RANK", value)
    with pytest.raises(ConfigError) as err:
        set_cpu_threads()
    assert str(err.value).startswith(f"THREADS_PER_RANK must be a whole number ≥ 1, got {value!r}")


@pytest.mark.parametrize("script", ["01_data_parallel.train_dp", "01_data_parallel.train_zero",
                                    "02_tensor_parallel.train_tp", "03_pipeline_parallel.train_pp"])
def test_no_activation_meter_with_pytorchs_implementation_is_refused(script):
    with pytest.raises(ConfigError, match="--no-activation-meter is for the course's own --impl"):
        run_until_training(script, ["--impl", "torch", "--no-activation-meter"])
