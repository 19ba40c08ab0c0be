"""S08 exercises: planning static batches by length, the waste of a static batch, a right-padding
bug.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s08

The chapter's code is in code/s08_static_batching.py (`left_pad`, `Engine`, `BatchStats`). The
graded tests run your plans and your counts through the S08 engine itself (its `BatchStats`
counters on real batches of the bundled model), check plans against a brute-force search over
every way to split small workloads, and compare first tokens with each prompt run alone through
Hugging Face transformers. Reference solutions are in exercises/solutions/ -- try first, peek
later.

Shape legend: B batch, T tokens (columns) in the block, V vocabulary.
"""
from __future__ import annotations

from typing import Sequence

import torch


# Exercise 1: plan static batches by length (3 points) ------------------------------------------
# A static batch pads every prompt to its longest. Serving requests in arrival order (FIFO:
# the first max_batch_size, then the next, ...) puts long and short prompts together and pays
# for it in padding slots. A planner that sees the queue can group them better.

def plan_batches(prompt_lens: Sequence[int], max_batch_size: int) -> list[list[int]]:
    """Split the requests into static batches that pad as little as possible.

    prompt_lens[i] >= 1: request i's prompt length in tokens. Returns a list of batches, each a
    list of request indices (into prompt_lens), such that:
    - every request is in exactly one batch; no batch is empty or holds more than
      max_batch_size requests;
    - there are exactly as many batches as FIFO batching makes, ceil(n / max_batch_size): the
      point is to fill rows, not to run every request alone (which pads nothing);
    - the prefills pad as little as any such plan can. A batch pads each prompt to its longest,
      so it costs len(batch) * max(its lengths) - sum(its lengths) padding slots (what
      `BatchStats.padding_slots` counts); the total over all batches must be the least possible.
    The order of the batches, and of requests inside one, is yours.
    Raises ValueError for an empty list, a length < 1, or max_batch_size < 1.
    Example: lengths [10, 5, 5], max_batch_size 2 -> [[0], [1, 2]] (or [[1, 2], [0]]): no
    padding, where FIFO ([[0, 1], [2]]) pads 5 slots.
    """
    raise NotImplementedError("exercise 1")


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
    pad_id is and whichever prompts share the batch. Make exactly ONE call of hf_model, on
    input_ids of shape (B, T) with T the longest prompt, each prompt at the start of its row
    (right padding): the point is to find what right padding changes, not to run each prompt
    alone or to switch to left padding. The tests watch the model's calls.
    """
    raise NotImplementedError("exercise 3")
