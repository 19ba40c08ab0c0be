"""S08 exercises: position ids from a mask, the waste of a static batch, a right-padding bug.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s08

The chapter's code is in code/s08_static_batching.py (`left_pad`, `position_ids_from_mask`,
`Engine`, `BatchStats`). Write your own versions here: the graded tests compare you with
closed forms worked by hand, with the S08 engine's own counters on real batches, and with each
prompt run alone through Hugging Face transformers. Reference solutions are in
exercises/solutions/ -- try first, peek later.

Shape legend: B batch, T tokens (columns) in the block, V vocabulary.
"""
from __future__ import annotations

from typing import Sequence

import torch


# Exercise 1: position ids from a mask (3 points) ----------------------------------------------
# A left-padded row starts with padding, so its first real token is not in column 0. Its
# position must still be 0: the model was trained with positions counted from the first token.

def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Position ids int64 (B, T) for a bool (or 0/1 integer) mask (B, T), True on real tokens.

    A real token's position is the number of real tokens before it in its row (so each row's
    first real token is at 0). A padding column gets 0. The mask need not be left padding:
    right padding and holes in the middle of a row follow the same rule.
    Example: [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1]] ->
             [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 1, 2]].
    Raises ValueError for a mask that is not 2-D.
    """
    raise NotImplementedError("exercise 1a")


def decode_position_ids(mask: torch.Tensor, step: int) -> torch.Tensor:
    """int64 (B,): the position of the token each row feeds in decode step `step` (1 = the
    first decode step, right after the prefill of the block `mask` describes).

    The prefill's last token of a row with n real tokens is at n - 1, so the token fed in
    decode step k is at n - 1 + k. Raises ValueError for step < 1 or a mask that is not 2-D.
    Example: mask [[0, 0, 1], [1, 1, 1]], step 1 -> [1, 3].
    """
    raise NotImplementedError("exercise 1b")


# Exercise 2: what a static batch wastes (4 points) --------------------------------------------
# The engine runs one prefill of the (B, T) block, then decode steps of one column for every
# row until the longest output is done. A row that finished keeps its slot: it is computed,
# and its result thrown away.

def static_batch_waste(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> dict:
    """The token slots of one static batch, counted as `BatchStats` counts them.

    prompt_lens[i] >= 1, output_lens[i] >= 1: request i's prompt and generated lengths. The
    batch pads to T = max(prompt_lens). The prefill computes B x T slots (the prompts' tokens
    useful, the rest padding) and yields every row's first token; then there are
    max(output_lens) - 1 decode steps of B slots each. In decode step k (k = 1, 2, ...) row i
    is useful while it still has tokens to make (k < output_lens[i]) and idle otherwise.

    Returns a dict with int values: "slots" (all computed), "useful", "padding", "idle" (all
    three summing to slots), "decode_row_steps" (B x decode steps) and "idle_row_steps"
    (decode row-steps of finished rows; the same number as "idle").
    Raises ValueError for empty or unequal lists or a length < 1.
    Example: prompts [3, 1], outputs [2, 4]: T = 3, prefill 6 slots (4 useful, 2 padding),
    3 decode steps of 2 slots: row 0 useful in step 1 only, row 1 in all three ->
    slots 12, useful 8, padding 2, idle 2, decode_row_steps 6, idle_row_steps 2.
    """
    raise NotImplementedError("exercise 2a")


def ragged_slots(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """The token slots the same requests need with no padding and no idle rows (what S09's
    continuous batching computes): every prompt token once, and one decode slot per generated
    token after a request's first. Same argument rules as `static_batch_waste`.
    Example: prompts [3, 1], outputs [2, 4] -> 4 + (1 + 3) = 8.
    """
    raise NotImplementedError("exercise 2b")


# Exercise 3: find the right-padding bug (3 points) --------------------------------------------
# Someone batched the first token of greedy generation with RIGHT padding. Most answers come
# out wrong. Read buggy_first_tokens, find why, and write first_tokens without the bug.

@torch.inference_mode()
def buggy_first_tokens(hf_model, prompts: Sequence[Sequence[int]], pad_id: int) -> list[int]:
    """Greedy first token of each prompt, batched with right padding. Has a bug."""
    t_len = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t_len), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(list(prompt))
        mask[row, :len(prompt)] = 1
    logits = hf_model(input_ids=ids, attention_mask=mask).logits       # (B, T, V)
    return logits[:, -1].argmax(-1).tolist()


def first_tokens(hf_model, prompts: Sequence[Sequence[int]], pad_id: int) -> list[int]:
    """The greedy first token of each prompt (token id lists, each of length >= 1) in one
    right-padded forward pass of the Hugging Face causal LM `hf_model` (a
    `...ForCausalLM`; call it as buggy_first_tokens does, with input_ids and attention_mask).

    Must equal, row by row, the argmax of the last logits of each prompt run alone, whatever
    pad_id is and whichever prompts share the batch. Keep right padding: the point is to find
    what right padding changes, not to switch to left padding.
    """
    raise NotImplementedError("exercise 3")
