"""S08 exercises, reference solutions: position ids, the waste of a static batch, right padding.

Try the stubs in exercises/s08_static_batching.py first; grade these with
`python exercises/grade.py --solutions s08`.

Sources followed: Hugging Face transformers `generate()`'s position ids from the attention mask
(a running count of real tokens); the chapter's accounting of token slots (`BatchStats`); and
the usual fix for right padding, reading each row's logits at its own last real column.
"""
from __future__ import annotations

from typing import Sequence

import torch


# Exercise 1: position ids from a mask ---------------------------------------------------------

def _mask_2d(mask) -> torch.Tensor:
    mask = torch.as_tensor(mask)
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D (B, T) (got {mask.dim()} dimensions)")
    return mask.bool()


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Real tokens before each column, per row (a running count); padding gets 0."""
    mask = _mask_2d(mask)
    counted = mask.long().cumsum(dim=1) - 1          # real tokens up to and including a column
    return torch.where(mask, counted, torch.zeros_like(counted))


def decode_position_ids(mask: torch.Tensor, step: int) -> torch.Tensor:
    """The position of the token fed in decode step `step`: n - 1 + step for n real tokens."""
    mask = _mask_2d(mask)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (got {step!r})")
    return mask.long().sum(dim=1) - 1 + step


# Exercise 2: what a static batch wastes -------------------------------------------------------

def _check_lengths(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> None:
    if not prompt_lens or len(prompt_lens) != len(output_lens):
        raise ValueError("need one output length per prompt length, and at least one of each")
    if any(int(n) < 1 for n in list(prompt_lens) + list(output_lens)):
        raise ValueError("every prompt and output length must be >= 1")


def static_batch_waste(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> dict:
    """Slots of one static batch: prefill B x T, then B per decode step to the longest output."""
    _check_lengths(prompt_lens, output_lens)
    batch, t_len, longest = len(prompt_lens), max(prompt_lens), max(output_lens)
    decode_steps = longest - 1
    useful = sum(prompt_lens) + sum(n - 1 for n in output_lens)
    padding = sum(t_len - n for n in prompt_lens)
    idle = sum(longest - n for n in output_lens)
    return {"slots": batch * t_len + batch * decode_steps, "useful": useful, "padding": padding,
            "idle": idle, "decode_row_steps": batch * decode_steps, "idle_row_steps": idle}


def ragged_slots(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """Every prompt token once, plus one decode slot per generated token after the first."""
    _check_lengths(prompt_lens, output_lens)
    return sum(prompt_lens) + sum(n - 1 for n in output_lens)


# Exercise 3: find the right-padding bug -------------------------------------------------------

@torch.inference_mode()
def buggy_first_tokens(hf_model, prompts: Sequence[Sequence[int]], pad_id: int) -> list[int]:
    """The exercise's given function, unchanged (the tests run it to show the bug)."""
    t_len = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t_len), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(list(prompt))
        mask[row, :len(prompt)] = 1
    logits = hf_model(input_ids=ids, attention_mask=mask).logits       # (B, T, V)
    return logits[:, -1].argmax(-1).tolist()

# The bug: with right padding a short row's last real token is in column len - 1, and column
# T - 1 holds padding. logits[:, -1] reads the prediction made at a padding position, for every
# row shorter than the longest. The fix reads each row at its own last real column.

@torch.inference_mode()
def first_tokens(hf_model, prompts: Sequence[Sequence[int]], pad_id: int) -> list[int]:
    """Greedy first tokens of a right-padded batch, each read at its row's last real column."""
    lengths = [len(p) for p in prompts]
    t_len = max(lengths)
    ids = torch.full((len(prompts), t_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t_len), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(list(prompt))
        mask[row, :len(prompt)] = 1
    logits = hf_model(input_ids=ids, attention_mask=mask).logits       # (B, T, V)
    last = torch.tensor(lengths) - 1                                    # (B,)
    return logits[torch.arange(len(prompts)), last].argmax(-1).tolist()
