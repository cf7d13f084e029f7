"""Text in, batches out: a byte-level tokenizer and deterministic global batches.

Tokenizer: UTF-8 bytes, so the vocabulary is the 256 byte values and nothing needs downloading.

Determinism is what makes every layout comparable. The global batch of step t depends only on
(seed, t): a generator seeded with both picks `global_batch` random windows of the training split.
Every rank builds the same global batch and keeps only its rows (its data-parallel slice), so the
union over ranks is the batch the single-device run sees, and resuming at step t needs no saved
data position beyond t itself.
"""
from pathlib import Path

import torch

from common.errors import require

DEFAULT_CORPUS = Path(__file__).parent / "corpus" / "stdlib_docstrings.txt"
VALID_FRACTION = 0.05   # the last 5% of the text is held out for the validation loss


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def held_out(n_tokens: int, seq_len: int) -> int:
    """Tokens at the end of the text kept for validation: 5%, and at least one sequence."""
    return max(seq_len + 1, int(n_tokens * VALID_FRACTION))


def check_length(path, n_tokens: int, seq_len: int) -> None:
    """The text must hold a training window and a validation window of seq_len + 1 tokens each."""
    require(n_tokens - held_out(n_tokens, seq_len) > seq_len + 1,
            f"data file {str(path)!r} has {n_tokens} bytes: too short for --seq-len {seq_len}; "
            "use a longer text or a shorter --seq-len")


class TextData:
    def __init__(self, path: str | None, seq_len: int, seed: int):
        path = Path(path) if path else DEFAULT_CORPUS
        require(path.is_file(), f"data file {str(path)!r} does not exist; pass --data PATH to a text file "
                                "(or leave --data out to use the bundled corpus)")
        tokens = encode(path.read_text(encoding="utf-8"))     # (N,) ints in [0, 256); the CLI checked it is UTF-8
        check_length(path, len(tokens), seq_len)
        n_valid = held_out(len(tokens), seq_len)
        self.train, self.valid = tokens[:-n_valid], tokens[-n_valid:]
        self.seq_len, self.seed, self.path = seq_len, seed, path

    def describe(self) -> str:
        """Which text this run trains on, for the configuration table."""
        shown = f"common/corpus/{self.path.name}" if self.path == DEFAULT_CORPUS else str(self.path)
        return f"{shown}: {len(self.train) + len(self.valid):,} tokens, the last {len(self.valid):,} held out"

    def global_batch(self, step: int, batch_size: int, split: str = "train"):
        """Inputs and next-token targets of the whole global batch at `step`: two (batch_size, S) tensors."""
        data = self.train if split == "train" else self.valid
        g = torch.Generator().manual_seed(self.seed * 7_919 + step * 2 + (split == "valid"))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=g)
        windows = torch.stack([data[s:s + self.seq_len + 1] for s in starts.tolist()])   # (B, S+1)
        return windows[:, :-1], windows[:, 1:]


def shard_rows(x: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Rows [index·n/count, (index+1)·n/count) of x: a data-parallel rank's slice, or a micro-batch."""
    n = x.shape[0] // count
    return x[index * n:(index + 1) * n]
