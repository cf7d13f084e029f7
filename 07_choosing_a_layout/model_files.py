"""A model of one's own for the planner: `--model PATH.json`, common/model.ModelConfig's fields and the MLP's kind.

    {"vocab_size": 32000, "dim": 5120, "n_layers": 40, "n_heads": 40, "n_kv_heads": 8,
     "ffn_hidden": 13824, "max_seq_len": 4096, "mlp": "swiglu"}

`mlp` is "swiglu" (the default: the course's gate, up and down matrices of width ffn_hidden) or "gelu"
(a GPT MLP: two matrices, up and down, of width ffn_hidden, and a GELU between). The chapters' memory and
byte formulas count a SwiGLU; a GELU MLP of width F holds the weights of a SwiGLU of width 2F/3 and
saves as much for backward (its input, the up projection and the GELU's output: 2F per token, as the
SwiGLU's gate, up and product of 2F/3 each), so the planner hands them that width (`ffn_hidden` of the
PlannedModel) and times the two matrices of width F as they run (block_time.py: `gelu_hidden`).
`bias`, `dropout` and `tied_embeddings` (true or false, false by default) add a GPT's other pieces to the
time: a bias on every matmul (its gradient a sum over the tokens), dropout after attention and after the
MLP (a one-byte mask), the LM head tied to the embedding (its gradient all-reduced between the two ends of a
pipeline each step); the memory stays the course's count.
A field missing, unknown or out of its range is refused with one line that names it (exit 2).
"""
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from common.errors import require
from common.model import ModelConfig

MLPS = ("swiglu", "gelu")
GPT_PIECES = ("bias", "dropout", "tied_embeddings")      # PlannedModel's: a GPT as Megatron-LM builds it


@dataclass(frozen=True)
class PlannedModel(ModelConfig):
    """A ModelConfig whose MLP may be a GPT one: ffn_hidden is then the SwiGLU width of the same weights; and
    a GPT's other pieces, as Megatron-LM builds one (GPT-3), for its time."""
    mlp: str = "swiglu"
    bias: bool = False              # every matmul adds a bias: its gradient a sum over the tokens in backward
    dropout: bool = False           # dropout after attention and after the MLP, in the residual add: a 1-byte mask
    tied_embeddings: bool = False   # the LM head is the embedding: its gradient all-reduced between the two ends

    @property
    def gelu_hidden(self) -> int:
        """The width of a GELU MLP's two matrices (ffn_hidden is its SwiGLU equivalent, two thirds of it)."""
        return self.ffn_hidden * 3 // 2


def gelu_model(ffn_hidden: int, **shape) -> PlannedModel:
    """A model with a GPT MLP of width `ffn_hidden`, in the planner's terms."""
    require(2 * ffn_hidden % 3 == 0, f"a GELU MLP's ffn_hidden must be a multiple of 3 (its SwiGLU equivalent "
                                     f"is 2/3 of it), got {ffn_hidden}")
    return PlannedModel(ffn_hidden=2 * ffn_hidden // 3, mlp="gelu", **shape)


def load(path: str) -> PlannedModel:
    """The model of file `path`, checked field by field."""
    require(Path(path).is_file(), f"--model {path}: no such file")
    try:
        raw = json.loads(Path(path).read_text())
    except ValueError as err:
        require(False, f"--model {path}: not JSON ({err})")
    require(isinstance(raw, dict), f"--model {path}: the file holds {type(raw).__name__}, not an object")
    known = {f.name: f for f in fields(ModelConfig)}
    for key in raw:
        require(key in known or key == "mlp" or key in GPT_PIECES,
                f"--model {path}: unknown field {key!r}; the fields are {', '.join(known)}, mlp and "
                f"{', '.join(GPT_PIECES)}")
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
        require(key in raw, f"--model {path}: field {key} is missing")
    for key, value in raw.items():
        if key == "mlp":
            require(value in MLPS, f"--model {path}: field mlp must be one of {', '.join(MLPS)}, got {value!r}")
        elif key in GPT_PIECES:
            require(isinstance(value, bool), f"--model {path}: field {key} must be true or false, got {value!r}")
        elif known[key].type in (float, "float"):
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value > 0, f"--model {path}: field {key} must be a number > 0, got {value!r}")
        else:
            low = 0 if key in ("n_experts", "expert_hidden") else 1
            require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                    f"--model {path}: field {key} must be a whole number ≥ {low}, got {value!r}")
    shape = {k: v for k, v in raw.items() if k != "mlp"}          # GPT_PIECES among them: PlannedModel's
    shape.setdefault("n_kv_heads", shape["n_heads"])
    require(shape["dim"] % shape["n_heads"] == 0,
            f"--model {path}: field n_heads ({shape['n_heads']}) must divide dim ({shape['dim']})")
    require(shape["n_heads"] % shape["n_kv_heads"] == 0,
            f"--model {path}: field n_kv_heads ({shape['n_kv_heads']}) must divide n_heads ({shape['n_heads']})")
    if shape.get("n_experts"):
        require(raw.get("mlp", "swiglu") == "swiglu", f"--model {path}: field mlp: experts are SwiGLU here")
        require(shape.get("expert_hidden", 0) > 0, f"--model {path}: field expert_hidden is missing (experts)")
        require(1 <= shape.get("top_k", 2) <= shape["n_experts"],
                f"--model {path}: field top_k must be between 1 and n_experts")
    if raw.get("mlp") == "gelu":
        return gelu_model(**shape)
    return PlannedModel(**shape)
