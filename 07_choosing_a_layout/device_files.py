"""A GPU as the planner sees it: one JSON file of its rates (devices/*.json), each number with its source.

    --device a100-80g | h100-sxm | h200        a file of devices/ by its name (a100, h100: the first two)
    --device path/to/my-gpu.json               any file of the same form (gpu_efficiency.py writes one)

The form, one object per unit that does the work (every object carries a "source" string):

    peak_tflops        {"bf16": 312, "tf32": 156, ...}      the tensor cores' dense peak by dtype
    matmul_efficiency  {"gflop": [[128, 0.95], [16, 0.9], [1, 0.6], [0, 0.1]]}
                       the share of the peak a matmul of at least that many GFLOP reaches (the first row
                       whose threshold it meets): a small matmul has too few tiles to fill the chip
    attention_efficiency  {"flash": 0.35}                the share of the peak a fused (flash) attention
                       kernel's products reach, forward and backward (a measured kernel, not a GEMM)
    vector_tflops      {"bf16": 39, ..., "gflop": [[16, 0.95], [1, 0.5], [0, 0.1]]}
                       the other units (elementwise arithmetic), and the share an operation's size gets
    hbm                {"gib": 80, "gbps": 2039, "mb_efficiency": [[100, 0.9], ..., [0, 0.3]]}
                       capacity, bandwidth, and the share of it a transfer of at least that many MB reaches
    processing         {"mode": "no_overlap"}: an operation's arithmetic and memory traffic add up
                       ("roofline": the larger of the two counts)
    networks           [{"name", "gbps", "efficiency", "latency_us"}, ...]: the tiers, fastest first; the
                       first is the links inside a node (NVLink), the second the network across nodes.
                       gbps is one direction's GB/s; efficiency the share a collective reaches (nccl-tests'
                       busbw over the line rate); latency what one collective costs before its bytes

A bad file is refused with one line that names the field (common/errors.require: exit 2).
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

from common.errors import require

DEVICES_DIR = Path(__file__).resolve().parent / "devices"
ALIASES = {"a100": "a100-80g", "h100": "h100-sxm"}        # the planner's first two names


@dataclass(frozen=True)
class Tier:
    name: str
    rate: float            # bytes per second, one direction, at the tier's efficiency
    latency: float         # seconds per collective or message


@dataclass(frozen=True)
class DeviceFile:
    name: str
    path: str
    peak: dict             # {dtype: FLOP/s}
    matmul: tuple          # ((FLOPs at least, share of peak), ...), largest first
    flash: float           # the share of the peak the fused attention kernel reaches
    vector: dict           # {dtype: FLOP/s}
    vector_share: tuple    # ((FLOPs at least, share of the vector peak), ...), largest first
    memory_bytes: float
    hbm_rate: float        # bytes per second (datasheet)
    hbm: tuple             # ((bytes at least, share of the bandwidth), ...), largest first
    overlap: bool          # processing mode: "roofline" (arithmetic and traffic overlap) or "no_overlap"
    tiers: tuple           # (Tier inside a node, Tier across nodes)

    def op_seconds(self, engine: str, flops: float, nbytes: float) -> float:
        """One operation in the run's dtype: `flops` on the tensor cores ("matrix") or the vector units at
        the share their size gets, `nbytes` read + written in HBM at the share theirs gets; added, or under
        the roofline mode the larger."""
        peak, table = {"matrix": (self.peak, self.matmul), "flash": (self.peak, ((0.0, self.flash),)),
                       "vector": (self.vector, self.vector_share)}[engine]
        arithmetic = flops / (peak["run"] * share(table, flops)) if flops > 0 else 0.0
        traffic = nbytes / (self.hbm_rate * share(self.hbm, nbytes)) if nbytes > 0 else 0.0
        return max(arithmetic, traffic) if self.overlap else arithmetic + traffic


def share(table: tuple, size: float) -> float:
    """The efficiency of the first row (largest threshold first) whose threshold `size` meets."""
    return next(e for at_least, e in table if size >= at_least)


def path_of(name: str) -> Path:
    """A file of devices/ by name (or alias), or a path to any JSON file."""
    if name.endswith(".json"):
        return Path(name)
    return DEVICES_DIR / f"{ALIASES.get(name, name)}.json"


def names() -> list[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.json"))


def load(name: str, dtype: str) -> DeviceFile:
    """The device file `name` (a name of devices/ or a path), checked field by field."""
    path = path_of(name)
    require(path.is_file(), f"--device {name}: no such device file ({path}); a name of devices/ "
                            f"({', '.join(names())}) or a path to a .json file")
    try:
        raw = json.loads(path.read_text())
    except ValueError as err:
        require(False, f"--device {path}: not JSON ({err})")
    require(isinstance(raw, dict), f"--device {path}: the file holds {type(raw).__name__}, not an object")
    field = _Fields(path, raw)
    kind = "tf32" if dtype == "fp32" else dtype         # fp32 matmuls on TF32 tensor cores, as torch allows
    peak = {d: field.number(f"peak_tflops.{d}") * 1e12 for d in field.keys("peak_tflops")}
    require(kind in peak, f"--device {path}: field peak_tflops.{kind} is missing (the --dtype {dtype} matmuls' rate)")
    vector = {d: field.number(f"vector_tflops.{d}") * 1e12 for d in field.keys("vector_tflops") if d != "gflop"}
    require(dtype in vector, f"--device {path}: field vector_tflops.{dtype} is missing (--dtype {dtype})")
    tiers = field.get("networks")
    require(isinstance(tiers, list) and len(tiers) == 2,
            f"--device {path}: field networks must list two tiers (inside a node, across nodes)")
    for i in range(2):
        field.keys(f"networks.{i}")                                   # each tier names its source
    field.keys("processing")
    field.keys("attention_efficiency")
    mode = field.get("processing.mode")
    require(mode in ("no_overlap", "roofline"),
            f"--device {path}: field processing.mode must be \"no_overlap\" or \"roofline\", got {mode!r}")
    return DeviceFile(
        name=str(field.get("name")), path=str(path),
        peak={"run": peak[kind], **peak}, vector={"run": vector[dtype], **vector},
        matmul=field.table("matmul_efficiency.gflop", 1e9), flash=field.number("attention_efficiency.flash", 1),
        vector_share=field.table("vector_tflops.gflop", 1e9),
        memory_bytes=field.number("hbm.gib") * 2**30, hbm_rate=field.number("hbm.gbps") * 1e9,
        hbm=field.table("hbm.mb_efficiency", 1e6), overlap=mode == "roofline",
        tiers=tuple(Tier(str(field.get(f"networks.{i}.name")),
                         field.number(f"networks.{i}.gbps") * 1e9 * field.number(f"networks.{i}.efficiency", 1),
                         field.number(f"networks.{i}.latency_us", allow_zero=True) * 1e-6)
                    for i in range(2)))


class _Fields:
    """Reads dotted fields of a device file; a missing or wrong one is refused naming it."""

    def __init__(self, path: Path, raw: dict):
        self.path, self.raw = path, raw

    def get(self, dotted: str):
        value = self.raw
        for part in dotted.split("."):
            found = isinstance(value, dict) and part in value or \
                isinstance(value, list) and part.isdigit() and int(part) < len(value)
            require(found, f"--device {self.path}: field {dotted} is missing")
            value = value[int(part)] if isinstance(value, list) else value[part]
        return value

    def keys(self, dotted: str) -> list[str]:
        value = self.get(dotted)
        require(isinstance(value, dict), f"--device {self.path}: field {dotted} must be an object")
        require(isinstance(value.get("source"), str) and value["source"],
                f"--device {self.path}: field {dotted}.source is missing (every number says where it comes from)")
        return [k for k in value if k != "source"]

    def number(self, dotted: str, high: float = math.inf, allow_zero: bool = False) -> float:
        value = self.get(dotted)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (value >= 0 if allow_zero else value > 0) and value <= high
        require(ok, f"--device {self.path}: field {dotted} must be a number {'≥' if allow_zero else '>'} 0"
                    + (f" and ≤ {high:g}" if high < math.inf else "") + f", got {value!r}")
        return float(value)

    def table(self, dotted: str, unit: float) -> tuple:
        """[[threshold, share], ...] as ((threshold × unit, share), ...), largest threshold first, ending at 0."""
        self.keys(dotted.rsplit(".", 1)[0])                             # its object names a source
        rows = self.get(dotted)
        good = isinstance(rows, list) and rows and all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                        and math.isfinite(x) for x in r)
            and r[0] >= 0 and 0 < r[1] <= 1 for r in rows)
        require(good, f"--device {self.path}: field {dotted} must be [[size, share of the peak], ...] with "
                      f"sizes ≥ 0 and shares in (0, 1]")
        out = tuple(sorted(((a * unit, e) for a, e in rows), reverse=True))
        require(out[-1][0] == 0, f"--device {self.path}: field {dotted} must end at size 0 (every size gets a share)")
        return out
