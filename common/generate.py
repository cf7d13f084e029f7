"""Sampling text from a trained model, given its consolidated single-device state dict.

Generation is not what this course parallelises, so it runs on one rank with the plain reference
model: the parallel run gathers its weights (the same consolidation a checkpoint does), rank 0 loads
them into `common.model.Transformer` and samples. This also proves the gathered weights are whole.
"""
import torch

from common.data import decode, encode
from common.model import ModelConfig, Transformer


@torch.no_grad()
def sample(state_dict: dict, cfg: ModelConfig, prompt: str, max_new_tokens: int = 200,
           temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> str:
    model = Transformer(cfg)
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    tokens = encode(prompt)[None, :]                                   # (1, T)
    for _ in range(max_new_tokens):
        context = tokens[:, -cfg.max_seq_len:]                         # the model sees at most max_seq_len
        logits = model(context)[:, -1, :] / temperature                # (1, V) for the next token
        kth = torch.topk(logits, top_k).values[:, -1:]                 # keep the top_k most likely bytes
        logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)   # (1, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
    return decode(tokens[0, len(encode(prompt)):].tolist())
