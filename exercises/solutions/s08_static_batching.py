"""S08 exercises, reference solutions: static batches planned by length, the waste of a static
batch, right padding.

Try the stubs in exercises/s08_static_batching.py first; grade these with
`python exercises/grade.py --solutions s08`.

Sources followed: the chapter's accounting of token slots (`BatchStats`); for the planner, the
exchange argument that some optimal split of sorted lengths is contiguous, then dynamic
programming over the cut points; and the usual fix for right padding, reading each row's logits
at its own last real column.
"""
from __future__ import annotations

from typing import Sequence

import torch


# Exercise 1: plan static batches by length ----------------------------------------------------
# Why sorting and cutting is enough: take any plan and list its batches by their longest prompt,
# longest first, with sizes s1, s2, ... Refill them with the s1 longest requests, then the next
# s2, and so on. Batch k's longest can only shrink (the requests longer than its new longest all
# fit in the batches before it), sizes are unchanged, so padding cannot grow. An optimal plan
# is therefore a cut of the sorted lengths into contiguous runs; choose the cuts by dynamic
# programming. Cutting sorted lengths into runs of exactly max_batch_size is not enough, from either end:
# [10, 5, 5] and [5, 10, 10] by 2.

def plan_batches(prompt_lens: Sequence[int], max_batch_size: int) -> list[list[int]]:
    """ceil(n / max_batch_size) batches of at most max_batch_size requests, least padding."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) \
            or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1 (got {max_batch_size!r})")
    lens = [int(n) for n in prompt_lens]
    if not lens or min(lens) < 1:
        raise ValueError("need at least one request, each prompt at least 1 token long")
    n = len(lens)
    num_batches = -(-n // max_batch_size)
    order = sorted(range(n), key=lambda i: -lens[i])          # longest first
    prefix = [0]
    for i in order:
        prefix.append(prefix[-1] + lens[i])
    inf = float("inf")
    # best[k][j]: least padding splitting the j longest requests into k batches; cut[k][j]: where
    # the last of those k batches starts (its longest request is order[start]).
    best = [[inf] * (n + 1) for _ in range(num_batches + 1)]
    cut = [[0] * (n + 1) for _ in range(num_batches + 1)]
    best[0][0] = 0
    for k in range(1, num_batches + 1):
        for j in range(1, n + 1):
            for start in range(max(0, j - max_batch_size), j):
                if best[k - 1][start] == inf:
                    continue
                pad = (j - start) * lens[order[start]] - (prefix[j] - prefix[start])
                if best[k - 1][start] + pad < best[k][j]:
                    best[k][j], cut[k][j] = best[k - 1][start] + pad, start
    batches, j = [], n
    for k in range(num_batches, 0, -1):
        start = cut[k][j]
        batches.append(order[start:j])
        j = start
    return batches[::-1]


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
