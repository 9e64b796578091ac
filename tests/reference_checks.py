"""Comparisons against transformers shared by the model and engine tests."""

from __future__ import annotations

import numpy as np

# transformers' top-2 logit gap under which float noise may flip a greedy choice.
NEAR_TIE = 1e-3


def teacher_forced_logits(torch_model, token_ids: list[int]) -> np.ndarray:  # [len, vocab]
    import torch

    with torch.no_grad():
        return torch_model(torch.tensor([token_ids])).logits[0].float().numpy()


def check_greedy(torch_model, prompt: list[int], generated: list[int]) -> tuple[int, int]:
    """Assert every generated token is transformers' argmax given the same prefix,
    skipping positions where transformers' own top two are a near tie.
    Returns (compared, total)."""
    logits = teacher_forced_logits(torch_model, prompt + generated)
    compared = 0
    for i, token in enumerate(generated):
        row = logits[len(prompt) + i - 1]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            continue
        assert token == int(np.argmax(row)), (
            f"step {i}: jaxserve chose {token}, transformers {int(np.argmax(row))} (gap {top2[1] - top2[0]:.2e})"
        )
        compared += 1
    return compared, len(generated)
