"""Calibration data sampled from the float model itself (data-free calibration).

When no representative text is at hand, the model's own samples are: every sequence starts from
one token (the given start tokens, else a token drawn uniformly from the vocabulary) and is
continued by sampling the float model's next-token distribution, as in LLM-QAT's data-free
generation (Liu et al., 2023, "LLM-QAT: Data-Free Quantization Aware Training for Large Language
Models"). The result is a list of token-id tensors [1, seq_len], the calibration format of
quantize_model.

    calib = torch_qmm.quantizers.generate_calibration(model, samples=16, seq_len=512, seed=0)
    torch_qmm.quantize_model(model, bits=4, method="gptq", calibration=calib)
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


@torch.no_grad()
def generate_calibration(model: nn.Module, samples: int = 16, seq_len: int = 512, seed: int = 0,
                         start: Sequence[int] | None = None, batch: int = 8, temperature: float = 1.0,
                         vocab_size: int | None = None) -> list[torch.Tensor]:
    """`samples` sequences of `seq_len` tokens sampled from `model` (a causal LM with `generate`,
    e.g. a transformers model), reproducibly for a seed (the global RNG is left as it was).

    start: the first token of every sequence, cycled (e.g. the beginning-of-text id); None draws
    each sequence's first token uniformly from the vocabulary (vocab_size, default the model
    config's). The end-of-text token is not sampled before seq_len (generate's min_new_tokens),
    so every sample has exactly seq_len tokens."""
    for name, v in (("samples", samples), ("seq_len", seq_len), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"argument '{name}' must be a positive int, got {v!r}")
    if seq_len < 2:
        raise ValueError(f"argument 'seq_len' must be at least 2, got {seq_len}")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"argument 'temperature' must be > 0, got {temperature!r}")
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"argument 'model' must be a causal LM with a generate method (e.g. a transformers "
                        f"model), got {type(model).__name__}")
    if start is None:
        vocab_size = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
        if not vocab_size:
            raise ValueError("argument 'vocab_size' is needed: the model has no config.vocab_size")
        firsts = torch.randint(0, vocab_size, (samples,), generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        start = list(start)
        if not start:
            raise ValueError("argument 'start' is empty (give token ids, or None)")
        firsts = [int(start[i % len(start)]) for i in range(samples)]
    out: list[torch.Tensor] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, samples, batch):
            first = torch.tensor(firsts[i:i + batch], dtype=torch.int64).unsqueeze(1)
            ids = model.generate(first, attention_mask=torch.ones_like(first), do_sample=True, top_k=0, top_p=1.0,
                                 temperature=float(temperature), max_new_tokens=seq_len - 1,
                                 min_new_tokens=seq_len - 1, pad_token_id=0)
            out.extend(row[:seq_len].unsqueeze(0).clone() for row in ids)
    return out
