"""Chapter 07's device files: every GPU number with its source, a bad file refused naming its field, and a
measured file (gpu_efficiency.py) read back as the planner reads a described one. No GPU is needed: the GPU's
own measurement here is written by hand; the links' (collective_efficiency.py) is measured on two CPU ranks."""
import json
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

from common.errors import ConfigError

from harness import every_rank, run_group

ROOT = Path(__file__).resolve().parents[1]
gpu_efficiency = import_module("07_choosing_a_layout.gpu_efficiency")
collective_efficiency = import_module("07_choosing_a_layout.collective_efficiency")
device_files = import_module("07_choosing_a_layout.device_files")
block_time = import_module("07_choosing_a_layout.block_time")


def test_every_described_device_loads_and_every_number_names_its_source():
    assert device_files.names() == ["a100-80g", "h100-sxm", "h200"]
    for name in device_files.names():
        raw = json.loads(device_files.path_of(name).read_text())
        objects = [v for v in raw.values() if isinstance(v, dict)] + raw["networks"]
        assert all(len(o["source"]) > 20 for o in objects), name
        dev = device_files.load(name, "bf16")
        assert dev.peak["run"] == raw["peak_tflops"]["bf16"] * 1e12 and dev.tiers[0].rate > dev.tiers[1].rate
    assert device_files.load("a100", "bf16") == device_files.load("a100-80g", "bf16")      # the alias


def test_a_matmul_runs_at_the_share_its_size_gets_and_memory_adds_under_no_overlap():
    dev = device_files.load("a100-80g", "bf16")
    big, small = block_time.matmul("big", 8192, 8192, 8192, 2), block_time.matmul("small", 256, 1024, 1024, 2)
    assert big.flops >= 128e9 and 1e6 < small.flops < 1e9           # the table's 0.95 and 0.1 rows
    arithmetic = {op.name: op.flops / (312e12 * share) for op, share in ((big, 0.95), (small, 0.1))}
    traffic = {op.name: op.nbytes / (2039e9 * share) for op, share in ((big, 0.9), (small, 0.6))}
    for op in (big, small):
        assert block_time.op_seconds(op, dev) == pytest.approx(arithmetic[op.name] + traffic[op.name])
    roofline = device_files.DeviceFile(**{**vars(dev), "overlap": True})
    assert block_time.op_seconds(big, roofline) == pytest.approx(max(arithmetic["big"], traffic["big"]))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["hbm"].pop("gbps"), "field hbm.gbps is missing"),
    (lambda d: d["peak_tflops"].update(bf16=-1), "field peak_tflops.bf16 must be a number > 0, got -1"),
    (lambda d: d["matmul_efficiency"].update(gflop=[[1, 0.5]]), "field matmul_efficiency.gflop must end at size 0"),
    (lambda d: d["networks"][1].update(efficiency=1.5), "field networks.1.efficiency must be a number > 0 and ≤ 1"),
    (lambda d: d["vector_tflops"].pop("source"), "field vector_tflops.source is missing"),
])
def test_a_bad_device_file_is_refused_naming_its_field(tmp_path, edit, field):
    raw = json.loads(device_files.path_of("h100").read_text())
    edit(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(".", r"\.")):
        device_files.load(str(path), "bf16")


def test_a_measured_file_is_read_back_as_the_planner_reads_a_described_one(tmp_path):
    base = json.loads(device_files.path_of("h100-sxm").read_text())
    nccl = collective_efficiency.summary([(8, 20e-6), (2**20, 12e-6 + 2**20 / 300e9), (2**28, 2**28 / 220e9),
                                          (2**30, 2**30 / 200e9)], 8)         # the best is not the largest
    fake = {"matmul": [(1e8, 0.2), (5e10, 0.7), (4e11, 0.8)], "flash": 0.55,
            "copy": [(2e6, 1.0e12), (2e9, 3.0e12), (2e8, 2.7e12)], "nccl": nccl}
    path = tmp_path / "h100-measured.json"
    path.write_text(gpu_efficiency.dumps(gpu_efficiency.device_file(base, fake, "NVIDIA H100 80GB HBM3", "test")))
    dev = device_files.load(str(path), "bf16")
    assert dev.matmul == ((400e9, 0.8), (50e9, 0.7), (0.0, 0.2)) and dev.flash == 0.55
    assert dev.hbm_rate == 3.0e12 and dev.hbm[:2] == ((2e9, 1.0), (200e6, 0.9))
    assert dev.hbm[2][0] == 0 and dev.hbm[2][1] == pytest.approx(1 / 3, abs=1e-3)
    busbw = 220e9 * 2 * 7 / 8              # 256 MiB at 220 GB/s among 8: nccl-tests' busbw, 385 of the line's 450
    assert nccl["busbw"] == pytest.approx(busbw) and nccl["at"] == 2**28 and nccl["latency"] == 20e-6
    assert dev.tiers[0].rate == pytest.approx(busbw, rel=1e-3) and dev.tiers[0].latency == pytest.approx(20e-6)
    assert dev.tiers[1] == device_files.load("h100-sxm", "bf16").tiers[1]          # across nodes: as described
    assert dev.overlap and dev.peak == device_files.load("h100-sxm", "bf16").peak


def measure_links() -> dict:
    """A job: collective_efficiency's sweep on this CPU's ranks (gloo), small sizes, few repetitions."""
    return collective_efficiency.measure(sizes=(8, 2**16, 2**20), reps=3, device="cpu")


def test_the_links_measured_on_two_ranks_are_written_and_read_back(tmp_path):
    """The measurement gpu_efficiency.py makes among a node's GPUs, made with gloo on two CPU ranks: every size
    timed, the bus bandwidth nccl-tests' of the best, and a file written from it that the planner loads with
    that rate and the smallest all-reduce's time as its first tier."""
    nccl, other = every_rank(run_group(2, [("test_gpu_efficiency:measure_links",)])[0])
    assert nccl == other                                     # each size the slowest rank's time, on every rank
    assert [size for size, _ in nccl["sizes"]] == [8, 2**16, 2**20] and nccl["ranks"] == 2
    assert nccl["busbw"] == max(collective_efficiency.busbw(b, t, 2) for b, t in nccl["sizes"][1:]) > 0
    base = json.loads(device_files.path_of("h100-sxm").read_text())
    fake = {"matmul": [(4e11, 0.8), (1e8, 0.2)], "flash": 0.5, "copy": [(2e9, 3e12), (2e6, 1e12)], "nccl": nccl}
    path = tmp_path / "measured.json"
    path.write_text(gpu_efficiency.dumps(gpu_efficiency.device_file(base, fake, "a CPU (gloo)", "test")))
    dev = device_files.load(str(path), "bf16")
    assert dev.tiers[0].rate == pytest.approx(nccl["busbw"], rel=1e-3)
    assert dev.tiers[0].latency == pytest.approx(nccl["sizes"][0][1], abs=1e-7)


def test_without_cuda_the_measurement_says_so_in_one_line_and_exits_0():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: `make gpu-efficiency` measures it")
    done = subprocess.run([sys.executable, "07_choosing_a_layout/gpu_efficiency.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().count("\n") == 0 and "no CUDA device" in done.stdout
