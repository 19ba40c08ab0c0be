"""S06, sampling on the device: S04's logits processors and draw in torch, where the logits are.

What is new since S04
    S04's sampler written again in torch, so that code/s06_torch.py's `Engine.sample` never
    brings a row of logits to the host. One function per S04 processor, same name, same rule,
    same order: `apply_min_tokens`, `apply_repetition_penalty`,
    `apply_presence_frequency_penalties`, `apply_temperature`, `apply_min_p`, `apply_top_k`,
    `apply_top_p`, each float32 logits (V,) on the device in, (V,) out. `draw` is S04's
    inverse-CDF draw with `cumsum` and `searchsorted`, the uniform number drawn on the device
    too. `DeviceSampler` holds one request's state on the device (the history as a bool mask
    and as counts, the EOS and stop ids, a `torch.Generator`) and runs the pipeline over it
    (`process`, `draw`, `update`); `compute_logprobs` is S04's, and brings n + 1 numbers to the
    host (only for a request that asks for logprobs). Nothing else here waits for the device:
    no `.item()`, no shape that depends on the data (top-p scatters its mask back to vocabulary
    order instead of indexing with it). A row S04 refuses (NaN or +inf, no finite entry,
    min_tokens ruling out every token) comes back from `DeviceSampler.draw` as a negative id,
    and `BAD_ROW_ERRORS` gives the message the host raises for each: the check rides on the one
    number that crosses anyway.

What must match S04, and what cannot
    Greedy is the same rule (argmax, lowest id on a tie) after the same min_tokens and penalty
    steps. Given the same uniform number u, `draw` picks the same token as S04's `draw` (tests
    feed NumPy's u to both), and the filters keep the same token sets, except when a float32
    softmax sum lands within rounding of a top_p boundary. The uniforms themselves come from a
    `torch.Generator` on the device, not NumPy's generator, so a seed gives *different* tokens
    than S04 (and a CUDA generator different numbers than a CPU one); a seed still makes a
    request reproducible on the same device.

What it does not handle yet
    One request at a time: every function works on one (V,) row, and `DeviceSampler` holds one
    request's state (S08 batches requests). Each processor is its own torch calls, one or more
    kernel launches each, every step (vLLM sorts once for top-k and top-p together; S16
    captures a step in a CUDA graph).

Run it
    This module has no main: python code/s06_torch.py --temperature 0.8 --top-p 0.9 samples
    through it.

Tests
    tests/test_s06_sampler.py: every processor against S04's on the same rows (equal arrays,
    and the input row not edited); `DeviceSampler`'s pipeline against S04 `process_logits`
    with histories grown token by token, the extreme temperatures `SamplingParams` accepts
    included; `draw` against S04's `draw` with shared uniforms (hypothesis: any row, ties and
    -inf entries included, any u in [0, 1)) and its edges by hand; logprobs against S04's.
    tests/test_s04_top_p_boundary.py: `apply_top_p` against HF `TopPLogitsWarper` where the
    mass reaches top_p exactly. tests/test_s06_torch.py: the engine's completions (logprobs
    included) against S04's engine, the bad rows flagged on the device, and on CUDA (marker
    `gpu`) decode steps with every processor on under CUDA's sync-debug mode "error".

References
    S04's processors and their sources; vLLM's v1 sampler (the processor order, kept from
    S04); Hugging Face transformers `TopPLogitsWarper` (the top-p rule and its torch ops).
    PyTorch documentation: "CUDA semantics" (which calls synchronise),
    `torch.cuda.set_sync_debug_mode`, `torch.searchsorted`, `torch.Generator`.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; N stop ids.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

import s04_sampling as s04


# ---------------------------------------------------------------------------------------------
# S04's logits processors in torch
# ---------------------------------------------------------------------------------------------
# Each function maps float32 logits (V,) on the device to new logits (V,), as its S04 namesake
# does for a NumPy row; the request's history lives on the device too (`DeviceSampler`), so no
# step needs anything from the host except Python ints and floats it already has.

def apply_min_tokens(logits: torch.Tensor, num_output_tokens: int, min_tokens: int,
                     stop_ids: torch.Tensor) -> torch.Tensor:
    """S04 `apply_min_tokens`: stop_ids (int64 (N,), on the device) to -inf while fewer than
    min_tokens tokens exist."""
    if num_output_tokens >= min_tokens or stop_ids.numel() == 0:
        return logits
    return logits.index_fill(0, stop_ids, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float
                             ) -> torch.Tensor:
    """S04 `apply_repetition_penalty` with the history as a mask: seen is bool (V,), True for
    every id in the prompt or the output. Positive logits of seen ids are divided by penalty,
    negative ones multiplied."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(logits: torch.Tensor, counts: torch.Tensor,
                                       presence_penalty: float, frequency_penalty: float
                                       ) -> torch.Tensor:
    """S04 `apply_presence_frequency_penalties` with the history as counts: float32 (V,), how
    often each id occurs in the output. Subtracts frequency * count + presence * (count > 0)."""
    if presence_penalty == 0 and frequency_penalty == 0:
        return logits
    return logits - (frequency_penalty * counts + presence_penalty * (counts > 0).float())


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """S04 `apply_temperature`: (logits - max) / T, T > 0, divided in float64 and returned in
    float32, so a T that rounds to 0 in float32 (1e-50) cannot turn the max into 0 / 0 = NaN."""
    return ((logits.double() - logits.max().double()) / temperature).float()


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """S04 `apply_min_p`: drop ids with logit - max < log(min_p), compared in float64."""
    if min_p == 0:
        return logits
    gap = logits.double() - logits.max().double()
    return logits.masked_fill(gap < math.log(min_p), float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """S04 `apply_top_k`: keep the top_k largest logits (ties with the k-th all kept)."""
    if top_k <= 0 or top_k >= logits.numel():
        return logits
    kth_largest = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """S04 `apply_top_p` with HF `TopPLogitsWarper`'s own torch ops, so on the same device the
    kept set is HF's even where the mass reaches top_p exactly: logits (V,) float32 sorted
    ascending, softmax, cumsum (smallest first, so even a float32 accumulation loses no term
    while V < 2**24), drop where the sum <= 1 - top_p (a Python float, so compared in
    float32), the most likely id always kept. Ties: the lower id counts as the more likely
    (the stable descending sort, reversed). S04 `apply_top_p` keeps the same set unless a sum
    lies within a few float32 ulps of 1 - top_p (S04 rounds each probability from float64;
    torch's float32 softmax can differ from that in the last bits)."""
    if top_p >= 1.0:
        return logits
    descending, order = torch.sort(logits, descending=True, stable=True)      # (V,)
    sorted_logits, order = descending.flip(0), order.flip(0)                  # least likely first
    mass_up_to = torch.softmax(sorted_logits.float(), dim=-1).cumsum(dim=-1)  # inclusive sums
    drop = mass_up_to <= 1.0 - float(top_p)
    drop[-1] = False
    # Back to vocabulary order with a scatter. (`order[drop]` would be shorter: its length
    # depends on the data, so on CUDA it would make the host wait for the device to learn it.)
    drop_by_id = torch.zeros_like(drop).scatter_(0, order, drop)
    return logits.masked_fill(drop_by_id, float("-inf"))



# ---------------------------------------------------------------------------------------------
# The draw, and one request's state on the device
# ---------------------------------------------------------------------------------------------

def draw(processed: torch.Tensor, params: s04.SamplingParams, u: torch.Tensor | None
         ) -> torch.Tensor:
    """S04 `draw` on the device. Returns the token id as an int64 (1,) device tensor.

    Greedy: argmax, lowest id on a tie (torch.argmax returns the first maximum, as NumPy
    does); u is not used. Otherwise inverse-CDF with the uniform u (a float64 scalar tensor in
    [0, 1)): the id whose interval of the float64 cumulative distribution contains u x total,
    never an id of probability 0 (if u x total rounds up to total, the last id with mass).
    """
    if params.greedy:
        return torch.argmax(processed).view(1)
    cdf = torch.cumsum(torch.softmax(processed, dim=-1).double(), dim=-1)    # (V,)
    total = cdf[-1]
    token = torch.searchsorted(cdf, (u * total).view(1), right=True)        # (1,)
    last_with_mass = (cdf < total).sum().view(1)   # cdf reaches total at the last id with mass
    return torch.minimum(token, last_with_mass)


# What the host raises for each negative id `DeviceSampler.draw` can return (S04's messages).
BAD_ROW_ERRORS = {
    -1: s04.MIN_TOKENS_RULED_OUT,
    -4: s04.PENALTY_OVERFLOW,
    -5: s04.PENALTY_RULED_OUT,
    -2: "logits must not contain NaN or +inf",
    -3: "logits must have at least one finite entry (every token is ruled out)",
}
# The request parameter to blame for each flag, where the request's own parameters broke its
# row (S19 answers those with a 400 naming the field); NaN or +inf from the model is no one's.
BAD_ROW_PARAMETERS = {-1: "min_tokens", -4: "repetition_penalty", -5: "repetition_penalty"}


class DeviceSampler:
    """One request's sampling state on the device, and S04's pipeline over it.

    seen: bool (V,), the ids of prompt and output (repetition penalty); counts: float32 (V,),
    occurrences in the output (presence / frequency penalties); stop_ids: int64 (N,), EOS and
    stop_token_ids (min_tokens). `update(token)` adds the token, still on the device, to the
    history. generator: a `torch.Generator` on the device seeded with params.seed (fresh
    entropy for None); each sampled token consumes exactly one uniform number, greedy none.
    Only the state a request's parameters use is kept up to date.
    """

    def __init__(self, params: s04.SamplingParams, prompt_ids: Sequence[int],
                 eos_ids: Sequence[int], vocab_size: int, device: torch.device):
        self.params = params
        self.device = device
        stop = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
        self.stop_ids = torch.tensor(stop, dtype=torch.int64, device=device)
        self.seen = self.counts = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)] = True
        if params.presence_penalty != 0 or params.frequency_penalty != 0:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(params.seed))   # a NumPy int is a TypeError
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self.penalized: torch.Tensor | None = None   # the last row after the penalties

    def process(self, logits: torch.Tensor, num_output_tokens: int) -> torch.Tensor:
        """S04 `process_logits` on the device, same order: min_tokens, repetition, presence and
        frequency penalties, then (sampling only) temperature, min_p, top_k, top_p.
        logits: float32 (V,). Returns float32 (V,). The row after the penalties is kept as
        `penalized`: `draw` checks it, where S04 checks it (before temperature)."""
        p = self.params
        row = apply_min_tokens(logits, num_output_tokens, p.min_tokens, self.stop_ids)
        if self.seen is not None:
            row = apply_repetition_penalty(row, self.seen, p.repetition_penalty)
        if self.counts is not None:
            row = apply_presence_frequency_penalties(row, self.counts, p.presence_penalty,
                                                     p.frequency_penalty)
        self.penalized = row
        if p.greedy:
            return row
        row = apply_temperature(row, p.temperature)
        row = apply_min_p(row, p.min_p)
        row = apply_top_k(row, p.top_k)
        return apply_top_p(row, p.top_p)

    def draw(self, processed: torch.Tensor, num_output_tokens: int,
             raw: torch.Tensor | None = None) -> torch.Tensor:
        """Draw from `process`'s output (V,): the next token as an int64 (1,) device tensor.

        Instead of a token, a negative id from `BAD_ROW_ERRORS` when the host must raise: -1
        when min_tokens ruled out every token; -4 / -5 when the repetition penalty pushed a
        logit to +inf / every logit to -inf; -2 when the model's logits `raw` (V,) hold NaN
        or +inf; -3 when they have no finite entry. (S04 checks the row on the host; here the
        check rides on the one id that crosses anyway, so it costs no extra synchronisation.)
        """
        u = None
        if self.generator is not None:
            u = torch.rand((), generator=self.generator, device=self.device, dtype=torch.float64)
        return self.flag(draw(processed, self.params, u), processed, num_output_tokens, raw)

    def flag(self, token: torch.Tensor, processed: torch.Tensor, num_output_tokens: int,
             raw: torch.Tensor | None = None) -> torch.Tensor:
        """The token (int64 (1,)), or in its place the negative id of `BAD_ROW_ERRORS` that
        `draw` describes, for the row `process` just made (S15 flags each verified position
        with it)."""
        # What S04's `process_logits` raises for the processed row, flagged without a host
        # round trip: +inf or NaN from the repetition penalty (-4); no finite entry left, from
        # min_tokens (-1) or from the penalty (-5).
        top = (processed if self.penalized is None else self.penalized).max()
        ruled_out = -1 if num_output_tokens < self.params.min_tokens else -5
        token = torch.where(torch.isnan(top) | (top == float("inf")), -4,
                            torch.where(top > float("-inf"), token, ruled_out))
        if raw is not None:
            top = raw.max()  # NaN if any entry is NaN (max propagates NaN), +inf if any is +inf
            token = torch.where(torch.isnan(top) | (top == float("inf")), -2,
                                torch.where(top == float("-inf"), -3, token))
        return token

    def update(self, token: torch.Tensor) -> None:
        """Add the sampled token (int64 (1,), on the device) to the request's history; it is
        also the next decode step's input (`last_token`)."""
        self.last_token = token
        if self.seen is not None:
            self.seen.index_fill_(0, token, True)
        if self.counts is not None:
            self.counts.index_add_(0, token, self._one)


def compute_logprobs(logits: torch.Tensor, token_id: int, n: int) -> s04.TokenLogprobs:
    """S04 `compute_logprobs` on the device: log-softmax of logits (V,), the token's value and
    the n largest (stable order: lowest id first on a tie). Only n + 1 numbers come to the host."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.sort(logp, descending=True, stable=True)
    top = torch.cat([logp[token_id].view(1), values[:n]]).tolist()
    top_ids = ids[:n].tolist()
    return s04.TokenLogprobs(token_id=int(token_id), logprob=float(top[0]),
                             top_logprobs=tuple(zip(top_ids, top[1:])))
