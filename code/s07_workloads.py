"""S07, workloads: seeded requests of exact token lengths, drawn from the corpus.

What is here
    The requests the harness (`s07_measuring.py`) sends. A `Request` is a prompt that encodes
    to exactly `prompt_tokens` tokens with the workload's tokenizer and the number of tokens to
    generate, `max_tokens` (EOS is ignored, so every engine does the same work). A `Workload`
    is a named, seeded list of them, made by `make_workload` in three kinds: "chat" (short
    prompts, longer answers: decode-heavy), "long" (long prompts, short answers:
    prefill-heavy) and "mixed" (lengths drawn across the whole range). Same seed, tokenizer and
    arguments, same requests, on every machine.

What it does not handle
    Arrival times: every request is there when the previous one is done (batch 1). A load test
    with arrival rates (Poisson arrivals, as vLLM's `benchmark_serving.py` draws them) comes
    with batching (S08, S09) and the load test (S20). Prompts are cuts of the Shakespeare
    corpus, not real chat transcripts (vLLM's benchmarks use ShareGPT).

Run it
    Through the harness: python code/s07_measuring.py --workload long --requests 8

Tests
    tests/test_s07_workloads.py: reproducible from a seed, exact token counts for the project
    tokenizer and S01's word tokenizer, the lengths of each kind, and every error message.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import s01_generation_loop as s01

ROOT = Path(__file__).resolve().parents[1]
CORPUS_PATH = ROOT / "data" / "shakespeare.txt"


@dataclass(frozen=True)
class Request:
    """One request of a workload: `prompt` encodes to exactly `prompt_tokens` tokens with the
    workload's tokenizer, and the engine is asked for exactly `max_tokens` tokens (EOS ignored,
    so every engine does the same work)."""

    request_id: int
    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """A named, seeded list of requests (see `make_workload`)."""

    name: str
    seed: int
    requests: tuple[Request, ...]

    @property
    def max_context(self) -> int:
        """Tokens the longest request needs in the context: prompt + output."""
        return max(r.prompt_tokens + r.max_tokens for r in self.requests)


# (prompt tokens low, high), (output tokens low, high), both inclusive. Sized for the bundled
# model's 256-position context; `make_workload` checks they fit the one it is given.
WORKLOAD_KINDS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "chat": ((8, 32), (16, 64)),      # a question, a short answer: decode-heavy
    "long": ((128, 192), (8, 32)),    # a document and a short answer: prefill-heavy
    "mixed": ((4, 192), (4, 64)),     # lengths drawn across the whole range
}


def prompt_of_length(text: str, start: int, num_tokens: int, tokenizer) -> str | None:
    """The text from character `start` of `text` cut to exactly `num_tokens` tokens, or None.

    Encodes a stretch of text, keeps the first num_tokens ids and decodes them; the cut is
    accepted only when the decoded prompt encodes back to those same ids (a cut inside a word
    can re-encode differently with BPE), so the prompt's length is exact for this tokenizer.
    """
    stretch = text[start:start + 16 * num_tokens + 64]  # a token is rarely over 16 characters
    ids = list(tokenizer.encode(stretch))[:num_tokens]
    if len(ids) < num_tokens:
        return None
    prompt = tokenizer.decode(ids)
    if not prompt.strip() or list(tokenizer.encode(prompt)) != ids:
        return None
    return prompt


def make_workload(kind: str, tokenizer, num_requests: int, seed: int, max_context: int,
                  max_output_tokens: int | None = None, text: str | None = None,
                  max_attempts: int = 200) -> Workload:
    """A reproducible workload of `num_requests` requests of kind "chat", "long" or "mixed".

    Lengths are drawn uniformly from `WORKLOAD_KINDS[kind]` (output lengths capped at
    max_output_tokens when given); each prompt starts at the beginning of a speech of the
    corpus (`text`, default data/shakespeare.txt), chosen at random, and is cut to its exact
    token count by `prompt_of_length` (speeches are tried in random order until one fits).
    Everything random comes from `np.random.default_rng(seed)`: same seed, tokenizer and
    arguments, same requests.

    Raises ValueError for an unknown kind, num_requests < 1, a seed that is not an integer
    >= 0, max_output_tokens < 1, a kind whose longest request does not fit in max_context
    tokens, or when no speech gives a prompt of the drawn length in max_attempts tries.
    """
    if kind not in WORKLOAD_KINDS:
        raise ValueError(f"workload kind must be one of {sorted(WORKLOAD_KINDS)} (got {kind!r})")
    if not s01.is_int(num_requests) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1 (got {num_requests!r})")
    if seed is None or not s01.is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0 (got {seed!r})")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1 (got {max_output_tokens})")
    (p_lo, p_hi), (o_lo, o_hi) = WORKLOAD_KINDS[kind]
    if max_output_tokens is not None:
        o_lo, o_hi = min(o_lo, max_output_tokens), min(o_hi, max_output_tokens)
    if p_hi + o_hi > max_context:
        raise ValueError(f"workload {kind!r} needs max_context >= {p_hi + o_hi} tokens "
                         f"(prompt up to {p_hi} + output up to {o_hi}); got {max_context}")
    text = CORPUS_PATH.read_text(encoding="utf-8") if text is None else text
    # Character offsets where speeches begin: the corpus split the way S01 splits it.
    starts, pos = [], 0
    for block in s01.speeches(text):
        pos = text.index(block, pos)
        starts.append(pos)
        pos += len(block)
    rng = np.random.default_rng(seed)
    requests = []
    for request_id in range(num_requests):
        prompt_tokens = int(rng.integers(p_lo, p_hi + 1))
        max_tokens = int(rng.integers(o_lo, o_hi + 1))
        for _ in range(max_attempts):
            prompt = prompt_of_length(text, starts[int(rng.integers(len(starts)))],
                                      prompt_tokens, tokenizer)
            if prompt is not None:
                break
        else:
            raise ValueError(f"no speech of the corpus gave a prompt of exactly {prompt_tokens} "
                             f"tokens in {max_attempts} attempts")
        requests.append(Request(request_id, prompt, prompt_tokens, max_tokens))
    return Workload(kind, seed, tuple(requests))
