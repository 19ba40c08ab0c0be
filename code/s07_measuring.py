"""S07, measuring: time to first token, inter-token latency, throughput, and the roofline.

What is new since S06
    Until now each chapter timed itself its own way. This chapter writes the one benchmark
    harness every later chapter uses, and the physical limits its numbers are judged against.

    - Workloads (`make_workload`): requests drawn from the corpus with a seed, each a prompt of
      an exact number of tokens and a number of tokens to generate. Three kinds: "chat" (short
      prompts, short answers), "long" (long prompts, short answers: prefill-heavy) and "mixed"
      (lengths drawn across the whole range). The same seed gives the same requests.
    - The harness (`run_benchmark`): runs a workload through an engine one request at a time and
      timestamps every generated token with a hook that does not change what the engine does
      (`stamp_calls` wraps the engine's per-step call and records when each call starts: the
      step for token k + 1 starts right after token k exists; `transformers` generate() gets a
      streamer instead, `StampStreamer`). From the stamps it computes, per request, the three
      numbers a user feels: TTFT (time to first token: request start to first generated token),
      ITL (inter-token latency: the gaps between consecutive tokens) and end-to-end latency, plus
      the aggregate output tokens per second. `Distribution` reports mean, p50, p90 and p99 with
      NumPy's percentiles. `machine_facts` and `peak_memory` record where the numbers were taken;
      `BenchmarkRun.to_json` and `format_table` write them down.
    - The roofline (`measure_bandwidth`, `measure_matmul_flops`, `decode_step_cost`,
      `prefill_cost`, `plot_roofline`): this machine's memory bandwidth and matmul FLOP/s,
      measured by a short, stated method, and the FLOPs and bytes of a prefill and of a decode
      step computed from the model config with S03's cost functions (K/V reads included). A
      decode step at batch 1 does about 0.5 FLOP per float32 byte it reads, so its floor is
      `bytes moved / bandwidth` (`bandwidth_floor_s`); a prefill of hundreds of tokens reuses
      every weight hundreds of times and lands on the compute roof. `decode_vs_floor` is the
      factor an engine's decode step is above that floor. (The floor assumes the weights come
      from main memory: a model small enough to live in the CPU's caches, like the bundled
      one at 5.8 MB, is limited by per-operation overheads instead, and its ratio says so.)

What it does not handle yet
    One request at a time (batch 1): the harness sends the next request when the previous one
    is done, so there is no queueing delay in TTFT yet. Many requests at once, arrival rates and
    the throughput / latency trade arrive with batching (S08, S09) and the load test (S20).
    Only CPU threads and one CUDA device are described in the machine facts.

Run it
    python code/s07_measuring.py                       # bundled model: roofline + a small run
    python benchmarks/bench_s07_engines.py             # the chapter's comparison (results/)

Tests
    tests/test_s07_measuring.py: TTFT / ITL / e2e / tokens-per-second bookkeeping on a fake
    engine driven by a fake clock, checked against hand-computed values; percentiles against
    hand values; workloads reproducible from a seed with exact token counts; the hooks leave
    the S01 / S05 / S06 engines' tokens unchanged and equal to `transformers`'; roofline
    arithmetic against hand-computed FLOPs and bytes; the JSON schema of the results.

References
    TTFT / ITL / TPOT / e2e latency and percentile reporting follow vLLM's
    `benchmarks/benchmark_serving.py` and its docs; S. Williams, A. Waterman, D. Patterson,
    "Roofline: An Insightful Visual Performance Model for Multicore Architectures" (CACM 2009);
    J. McCalpin, "STREAM" (copy bandwidth counted as bytes read + bytes written); Pope et al.,
    "Efficiently Scaling Transformer Inference" (2022) and Kaplan et al. (2020) for the FLOPs
    and bytes of a step (through S03's `flops_per_token` / `bytes_per_token`). The streamer
    protocol is Hugging Face transformers' `generation/streamers.py` (`put` gets the prompt
    first, then each new token).

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; C hidden size.
"""
from __future__ import annotations

import os

# Before NumPy loads: on matmuls this small, BLAS threads cost more than they give
# (set OPENBLAS_NUM_THREADS in the environment to choose another count).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

import s03_transformer as s03
from s01_generation_loop import speeches

ROOT = Path(__file__).resolve().parents[1]
CORPUS_PATH = ROOT / "data" / "shakespeare.txt"
RESULTS_DIR = ROOT / "results"

Clock = Callable[[], float]
RESULTS_SCHEMA = "s07-benchmark/1"


# ---------------------------------------------------------------------------------------------
# Workloads: requests of exact token lengths, drawn from the corpus with a seed
# ---------------------------------------------------------------------------------------------

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

    Raises ValueError for an unknown kind, num_requests < 1, max_output_tokens < 1, a kind
    whose longest request does not fit in max_context tokens, or when no speech gives a prompt
    of the drawn length in max_attempts tries.
    """
    if kind not in WORKLOAD_KINDS:
        raise ValueError(f"workload kind must be one of {sorted(WORKLOAD_KINDS)} (got {kind!r})")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1 (got {num_requests!r})")
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
    for block in speeches(text):
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


# ---------------------------------------------------------------------------------------------
# Timestamps without changing the engine: call stamps and a generate() streamer
# ---------------------------------------------------------------------------------------------

@contextmanager
def stamp_calls(targets: Sequence[tuple[object, str]], clock: Clock) -> Iterator[list[float]]:
    """Record the clock each time one of the named methods is called, inside the `with`.

    targets: (object, method name) pairs, for example (engine.runner, "decode"). Each method is
    replaced, on that object only, by a wrapper that appends clock() to the yielded list and
    then calls the original with the same arguments and returns its result: the engine computes
    exactly what it computed before. Everything is restored on exit, even after an error.
    Raises ValueError when an object has no such method.
    """
    starts: list[float] = []
    saved: list[tuple[object, str, bool, object]] = []
    try:
        for obj, name in targets:
            original = getattr(obj, name, None)
            if not callable(original):
                raise ValueError(f"{type(obj).__name__} has no method {name!r} to time")
            own = name in vars(obj)          # an instance attribute, not the class's method

            def stamped(*args, _original=original, **kwargs):
                starts.append(clock())
                return _original(*args, **kwargs)

            saved.append((obj, name, own, original))
            setattr(obj, name, stamped)      # shadows the class's method on this object only
        yield starts
    finally:
        for obj, name, own, original in reversed(saved):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)


class StampStreamer:
    """A `transformers` streamer that timestamps tokens instead of printing them.

    generate() calls `put(prompt_ids)` once, then `put(token)` once per new token (batch 1),
    then `end()` (transformers `generation/streamers.py`, `BaseStreamer`). The first put is
    the prompt and is skipped; every later one appends clock() to `times` and its ids to
    `token_ids`.
    """

    def __init__(self, clock: Clock):
        self.clock = clock
        self.times: list[float] = []
        self.token_ids: list[int] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = self.clock()
        for token in value.reshape(-1).tolist():
            self.times.append(now)
            self.token_ids.append(int(token))

    def end(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Engines under test: one request in, token ids and their timestamps out
# ---------------------------------------------------------------------------------------------

@dataclass
class TimedGeneration:
    """One request as the harness saw it. Times are clock() readings in seconds.

    start_s: just before the engine got the prompt; token_times_s[k]: when token k was
    available (k = 0 is the first generated token); end_s: when the engine returned.
    model_step_s: seconds of each decode step spent in the model, when the engine reports it
    (S01/S05/S06 `Stats.pass_times_s` after the prefill), else None.
    """

    token_ids: list[int]
    start_s: float
    token_times_s: list[float]
    end_s: float
    model_step_s: list[float] | None = None


class BenchEngine(Protocol):
    """What the harness needs from an engine: a name and `run(request, clock)`."""

    name: str

    def run(self, request: Request, clock: Clock) -> TimedGeneration: ...


def token_times_from_step_starts(step_starts: Sequence[float], end_s: float,
                                 num_tokens: int) -> list[float]:
    """When each token was available, from the start times of the engine's steps.

    Step k (k = 0 is the prefill) computes the logits that token k is sampled from; the engine
    starts step k + 1 as soon as token k is sampled and checked, so token k's time is the start
    of step k + 1, and the last token's is the moment the engine returned (so whatever the
    engine does after its last token, a final text flush for instance, counts in the last
    gap; with S04-style engines that is microseconds). Raises RuntimeError
    when the number of steps is not the number of tokens (one step, one token is every engine's
    contract in Part I).
    """
    if len(step_starts) != num_tokens:
        raise RuntimeError(f"the engine made {len(step_starts)} steps for {num_tokens} tokens; "
                           "the harness needs one step per generated token")
    return list(step_starts[1:]) + ([end_s] if num_tokens else [])


class HookedEngine:
    """A Part I engine (S01's loop, or an S04-style engine such as S05's and S06's) behind the
    harness's interface, timed by `stamp_calls` on its per-step methods.

    name: the label in tables. engine: the engine object. steps: the (object, method) pairs
    that run once per generated token: S01 `(engine.model, "forward")`; S05 / S06
    `(engine.runner, "prefill")` and `(engine.runner, "decode")`. Use `for_s01` and
    `for_cached` rather than building it by hand. Every request runs greedy with EOS ignored,
    so each engine generates exactly `max_tokens` tokens.
    """

    def __init__(self, name: str, engine, steps: Sequence[tuple[object, str]],
                 generate: Callable[[Request], object]):
        self.name, self.engine, self.steps, self._generate = name, engine, list(steps), generate

    @classmethod
    def for_s01(cls, name: str, engine) -> "HookedEngine":
        """S01's `Engine`: greedy, with EOS ignored. S01 has no ignore_eos setting, so during
        each request the engine sees its tokenizer through `_NoEos` (same encode and decode,
        `eos_id` None): S01's stop rule then never matches; everything else is unchanged."""
        def generate(request: Request):
            tokenizer, engine.tokenizer = engine.tokenizer, _NoEos(engine.tokenizer)
            try:
                return engine.generate(request.prompt, request.max_tokens, temperature=0.0)
            finally:
                engine.tokenizer = tokenizer
        return cls(name, engine, [(engine.model, "forward")], generate)

    @classmethod
    def for_cached(cls, name: str, engine) -> "HookedEngine":
        """An S04-style engine with a `runner` that has `prefill` and `decode` (S05, S06), or
        without one (S04's uncached `next_logits`): greedy, `ignore_eos=True`."""
        import s04_sampling as s04
        runner = getattr(engine, "runner", None)
        steps = ([(runner, "prefill"), (runner, "decode")] if runner is not None
                 else [(engine, "next_logits")])
        return cls(name, engine, steps, lambda r: engine.generate(r.prompt, s04.SamplingParams(
            temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)))

    def run(self, request: Request, clock: Clock) -> TimedGeneration:
        with stamp_calls(self.steps, clock) as step_starts:
            start = clock()
            result = self._generate(request)
            end = clock()
        ids = list(result.token_ids)
        times = token_times_from_step_starts(step_starts, end, len(ids))
        passes = getattr(result.stats, "pass_times_s", None)
        return TimedGeneration(ids, start, times, end, list(passes[1:]) if passes else None)


class _NoEos:
    """A tokenizer seen through a window where it has no EOS id (for S01's loop, which has no
    ignore_eos setting)."""

    eos_id = None

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids) -> str:
        return self.inner.decode(ids)


class HFGenerateEngine:
    """`transformers` `model.generate()` at batch 1 behind the harness's interface.

    Greedy (`do_sample=False`), exactly `max_tokens` new tokens (the generation config's EOS is
    removed, as S06's benchmark does), the prompt encoded by `tokenizer` inside the timed
    request as our engines do. Token times come from `StampStreamer`.
    """

    def __init__(self, name: str, model, tokenizer, pad_token_id: int = 0):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.pad_token_id = pad_token_id
        model.generation_config.eos_token_id = None   # never stop early: exactly max_tokens
        model.generation_config.pad_token_id = pad_token_id

    def run(self, request: Request, clock: Clock) -> TimedGeneration:
        import torch
        streamer = StampStreamer(clock)
        device = next(self.model.parameters()).device
        start = clock()
        ids = torch.tensor([self.tokenizer.encode(request.prompt)], device=device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=request.max_tokens,
                                      pad_token_id=self.pad_token_id, streamer=streamer)
        generated = out[0, ids.shape[1]:].tolist()
        self.tokenizer.decode(generated)   # our engines return text too: same work
        end = clock()
        if streamer.token_ids != generated:
            raise RuntimeError("the streamer saw other tokens than generate() returned")
        return TimedGeneration(generated, start, streamer.times, end, None)


# ---------------------------------------------------------------------------------------------
# The numbers: per request, then distributions over a run
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestResult:
    """One request's latencies, in seconds.

    ttft_s: request start to first generated token. itl_s: gaps between consecutive tokens
    (output_tokens - 1 of them). e2e_s: request start to the engine's return. tpot_s (time per
    output token after the first, vLLM's TPOT): (e2e - ttft) / (output_tokens - 1), None for a
    single token. model_step_s: model time of each decode step when the engine reports it.
    """

    request_id: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_s: list[float]
    e2e_s: float
    token_ids: list[int]
    model_step_s: list[float] | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def from_timed(cls, request: Request, timed: TimedGeneration) -> "RequestResult":
        """Latencies from the stamps. Raises ValueError when no token was generated or the
        stamps are not one per token and in order."""
        times = timed.token_times_s
        if not timed.token_ids:
            raise ValueError(f"request {request.request_id} generated no token: no TTFT")
        if len(times) != len(timed.token_ids):
            raise ValueError(f"{len(times)} timestamps for {len(timed.token_ids)} tokens")
        if not timed.start_s <= times[0] or any(b < a for a, b in zip(times, times[1:])) \
                or timed.end_s < times[-1]:
            raise ValueError("timestamps must be in order: start <= token 0 <= ... <= end")
        return cls(request.request_id, request.prompt_tokens, len(timed.token_ids),
                   ttft_s=times[0] - timed.start_s,
                   itl_s=[b - a for a, b in zip(times, times[1:])],
                   e2e_s=timed.end_s - timed.start_s, token_ids=list(timed.token_ids),
                   model_step_s=timed.model_step_s)


PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Distribution:
    """mean, p50, p90, p99 and count of a list of values (seconds, unless stated otherwise).

    Percentiles are `np.percentile` with its default "linear" method: the p-th percentile of n
    sorted values x_0..x_{n-1} is the value at fractional index p/100 x (n - 1), linearly
    interpolated between the two neighbours.
    """

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Distribution":
        """Raises ValueError for an empty list or a value that is not finite."""
        array = np.asarray(values, dtype=np.float64)
        if array.size == 0:
            raise ValueError("a distribution needs at least one value")
        if not np.isfinite(array).all():
            raise ValueError("every value must be finite")
        p50, p90, p99 = np.percentile(array, PERCENTILES)
        return cls(float(array.mean()), float(p50), float(p90), float(p99), int(array.size))


@dataclass
class BenchmarkRun:
    """One engine on one workload: the per-request results and their summary.

    wall_s: clock time from the first request's start to the last one's end (requests run one
    after another). output_tokens_per_s: all generated tokens / wall_s. ttft_s, e2e_s: one value
    per request; itl_s: every gap of every request pooled; tpot_s: one per request with >= 2
    tokens. decode_floor_s / decode_vs_floor: filled in by `attach_floor`. load_average_1min:
    the machine's 1-minute load average when the run began (other jobs slow every number).
    """

    engine: str
    model: str
    workload: str
    seed: int
    requests: list[RequestResult]
    wall_s: float
    peak_memory: dict = field(default_factory=dict)
    decode_floor_s: float | None = None
    decode_context_len: int | None = None
    load_average_1min: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def ttft_s(self) -> Distribution:
        return Distribution.of([r.ttft_s for r in self.requests])

    @property
    def itl_s(self) -> Distribution | None:
        gaps = [gap for r in self.requests for gap in r.itl_s]
        return Distribution.of(gaps) if gaps else None

    @property
    def e2e_s(self) -> Distribution:
        return Distribution.of([r.e2e_s for r in self.requests])

    @property
    def tpot_s(self) -> Distribution | None:
        values = [r.tpot_s for r in self.requests if r.tpot_s is not None]
        return Distribution.of(values) if values else None

    @property
    def model_step_s(self) -> Distribution | None:
        """Model time per decode step (engines that report it), pooled over requests."""
        values = [t for r in self.requests for t in (r.model_step_s or [])]
        return Distribution.of(values) if values else None

    @property
    def decode_vs_floor(self) -> float | None:
        """Median inter-token latency / the bandwidth floor of a decode step (see
        `attach_floor`): how many times slower than `bytes moved / bandwidth` a step is."""
        if self.decode_floor_s is None or self.itl_s is None:
            return None
        return self.itl_s.p50 / self.decode_floor_s

    def summary(self) -> dict:
        """The run's numbers as plain JSON-ready values (Distributions as dicts, or None)."""
        def dist(d: Distribution | None) -> dict | None:
            return None if d is None else asdict(d)
        return {"requests": len(self.requests), "output_tokens": self.output_tokens,
                "wall_s": self.wall_s, "output_tokens_per_s": self.output_tokens_per_s,
                "ttft_s": dist(self.ttft_s), "itl_s": dist(self.itl_s),
                "tpot_s": dist(self.tpot_s), "e2e_s": dist(self.e2e_s),
                "model_step_s": dist(self.model_step_s),
                "decode_floor_s": self.decode_floor_s,
                "decode_context_len": self.decode_context_len,
                "decode_vs_floor": self.decode_vs_floor}

    def to_json(self) -> dict:
        """Everything about the run, per-request detail included, as a JSON-ready dict."""
        return {"engine": self.engine, "model": self.model, "workload": self.workload,
                "seed": self.seed, "summary": self.summary(), "peak_memory": self.peak_memory,
                "load_average_1min": self.load_average_1min,
                "per_request": [{**asdict(r), "tpot_s": r.tpot_s} for r in self.requests]}


def run_benchmark(engine: BenchEngine, workload: Workload, model: str = "",
                  clock: Clock = time.perf_counter, warmup: bool = True,
                  progress: bool = True) -> BenchmarkRun:
    """Run every request of `workload` through `engine`, one after another, and measure it.

    warmup: first run the first request once for 2 tokens, not recorded (the first call of an
    engine pays one-off costs: lazy allocation, kernel selection, caches). progress: a tqdm bar
    on stderr. clock: seconds as a float; injectable so tests can drive a fake engine with a
    fake clock. Returns a BenchmarkRun with peak memory read after the last request.
    """
    from tqdm import tqdm

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if warmup:
        first = workload.requests[0]
        engine.run(Request(-1, first.prompt, first.prompt_tokens, min(2, first.max_tokens)), clock)
    results = []
    began = clock()
    for request in tqdm(workload.requests, desc=f"{engine.name} / {workload.name}",
                        disable=not progress, leave=False):
        results.append(RequestResult.from_timed(request, engine.run(request, clock)))
    wall = clock() - began
    return BenchmarkRun(engine.name, model, workload.name, workload.seed, results, wall,
                        peak_memory(), load_average_1min=load)


# ---------------------------------------------------------------------------------------------
# Where the numbers were taken
# ---------------------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts(device: str = "cpu") -> dict:
    """CPU model, cores, torch / numpy / transformers versions, torch threads, the device (and
    its name on CUDA), Python, OS, and the 1-minute load average (a busy machine is slower)."""
    import torch
    facts = {"cpu_model": cpu_model(), "logical_cores": os.cpu_count(),
             "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count(),
             "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
             "platform": platform.platform(), "numpy": np.__version__,
             "torch": torch.__version__, "device": device,
             "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    try:
        import transformers
        facts["transformers"] = transformers.__version__
    except ImportError:
        facts["transformers"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return facts


def peak_memory() -> dict:
    """Peak resident memory of this process so far (`resource.getrusage` ru_maxrss, which
    Linux reports in KiB and macOS in bytes), and on CUDA the peak bytes torch allocated
    (`torch.cuda.max_memory_allocated`). Both are peaks over the process's life so far."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"max_rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
    try:
        import torch
        if torch.cuda.is_available():
            out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    except ImportError:
        pass
    return out


# ---------------------------------------------------------------------------------------------
# The roofline: this machine's limits, and the cost of a step from the config
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MachinePeaks:
    """What this machine sustains, as measured by `measure_bandwidth` and
    `measure_matmul_flops`: bytes per second and FLOP per second, with the method stated."""

    bandwidth_bytes_per_s: float
    matmul_flops_per_s: float
    bandwidth_method: str
    matmul_method: str

    @property
    def ridge_intensity(self) -> float:
        """FLOP per byte where the two roofs meet: below it a step is bandwidth-bound."""
        return self.matmul_flops_per_s / self.bandwidth_bytes_per_s


def _best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation are not the machine's speed
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: str = "cpu"
                      ) -> tuple[float, str]:
    """Memory bandwidth in bytes/s: copy a float32 tensor of `nbytes` into another, best of
    `repeats` (after one warm-up copy), counting nbytes read + nbytes written (STREAM's "copy").
    Uses torch's `copy_` with torch's current thread count. Returns (bytes/s, the method as a
    sentence). Raises ValueError for nbytes < 4 or repeats < 1.
    """
    import torch
    if nbytes < 4 or repeats < 1:
        raise ValueError(f"need nbytes >= 4 and repeats >= 1 (got {nbytes}, {repeats})")
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = _best_time(lambda: dst.copy_(src), repeats, lambda: _sync(device))
    moved = 2 * src.numel() * 4
    method = (f"torch copy_ of a {moved // 2 / 2**20:.0f} MiB float32 tensor on {device}, "
              f"{torch.get_num_threads()} thread(s), best of {repeats}; bytes read + written")
    return moved / best, method


def measure_matmul_flops(n: int = 2048, repeats: int = 5, device: str = "cpu",
                         dtype: str = "float32") -> tuple[float, str]:
    """Matmul throughput in FLOP/s: an (n, n) @ (n, n) torch matmul of `dtype`, best of
    `repeats` after one warm-up, counted as 2 n^3 FLOPs (one multiply and one add per term).
    Returns (FLOP/s, the method as a sentence). Raises ValueError for n < 1 or repeats < 1."""
    import torch
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1 (got {n}, {repeats})")
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(torch_dtype)
    b = torch.randn(n, n, device=device).to(torch_dtype)
    best = _best_time(lambda: a @ b, repeats, lambda: _sync(device))
    method = (f"torch {dtype} matmul ({n} x {n}) @ ({n} x {n}) on {device}, "
              f"{torch.get_num_threads()} thread(s), best of {repeats}; 2 n^3 FLOPs")
    return 2 * n ** 3 / best, method


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def measure_peaks(device: str = "cpu", bandwidth_bytes: int = 256 * 2**20,
                  matmul_n: int = 2048, repeats: int = 5) -> MachinePeaks:
    """Both measurements of this machine (see `measure_bandwidth`, `measure_matmul_flops`)."""
    bw, bw_method = measure_bandwidth(bandwidth_bytes, repeats, device)
    flops, flops_method = measure_matmul_flops(matmul_n, repeats, device)
    return MachinePeaks(bw, flops, bw_method, flops_method)


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes moved by one forward step; intensity is FLOP per byte."""

    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def decode_step_cost(config: s03.TransformerConfig, context_len: int, dtype_bytes: int = 4
                     ) -> StepCost:
    """One decode step at batch 1: one new token attending to S = context_len positions
    (itself included), with a KV cache. S03's `flops_per_token` and `bytes_per_token`: every
    weight read once (the LM head too), K and V of the S - 1 cached positions read and the
    new token's written, 2 FLOPs per weight plus 4 H D S per layer for attention.
    Raises ValueError for context_len < 1 or dtype_bytes < 1."""
    return StepCost(s03.flops_per_token(config, context_len),
                    s03.bytes_per_token(config, context_len, dtype_bytes))


def prefill_cost(config: s03.TransformerConfig, prompt_tokens: int, dtype_bytes: int = 4
                 ) -> StepCost:
    """The prefill of a prompt of T = prompt_tokens tokens in one step, LM head on the last
    position only (as S05's and S06's engines do).

    FLOPs: the T tokens' forward passes, token s attending to s positions (causal: the useful
    work, not masked-out pairs), i.e. sum over s = 1..T of S03's `flops_per_token(config, s)`,
    minus the LM head (2 C V) of the T - 1 rows whose logits are not computed.
    Bytes: every weight once and K/V of one position (S03's `bytes_per_token(config, 1)`),
    plus K and V written for the other T - 1 positions (2 L Hkv D each); activations and the
    extra embedding rows are not counted, as in S03. Raises ValueError for prompt_tokens < 1
    or dtype_bytes < 1.
    """
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1 (got {prompt_tokens})")
    cfg = config
    attention_per_position = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    per_token = s03.flops_per_token(cfg, 1) - attention_per_position   # everything but attention
    flops = (prompt_tokens * per_token
             + attention_per_position * prompt_tokens * (prompt_tokens + 1) // 2
             - (prompt_tokens - 1) * 2 * cfg.hidden_size * cfg.vocab_size)
    kv_per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    moved = (s03.bytes_per_token(cfg, 1, dtype_bytes)
             + (prompt_tokens - 1) * kv_per_position * dtype_bytes)
    return StepCost(flops, moved)


def bandwidth_floor_s(cost: StepCost, peaks: MachinePeaks) -> float:
    """Seconds a step needs at least to move its bytes: bytes / bandwidth."""
    return cost.bytes / peaks.bandwidth_bytes_per_s


def roofline_floor_s(cost: StepCost, peaks: MachinePeaks) -> float:
    """The roofline's lower bound on a step's time: the larger of bytes / bandwidth and
    FLOPs / matmul FLOP/s (whichever resource the step runs out of first)."""
    return max(cost.bytes / peaks.bandwidth_bytes_per_s, cost.flops / peaks.matmul_flops_per_s)


def attach_floor(run: BenchmarkRun, config: s03.TransformerConfig, peaks: MachinePeaks,
                 dtype_bytes: int = 4) -> None:
    """Fill run.decode_floor_s: the bandwidth floor of a decode step at the (low) median context
    length of the run's decode steps (step k of a request reads prompt + k tokens), so
    run.decode_vs_floor = ITL p50 / floor. Does nothing for a run without decode steps."""
    contexts = [r.prompt_tokens + k for r in run.requests for k in range(1, r.output_tokens)]
    if not contexts:
        return
    context = statistics.median_low(contexts)   # an actual step's context, not a midpoint
    run.decode_context_len = context
    run.decode_floor_s = bandwidth_floor_s(decode_step_cost(config, context, dtype_bytes), peaks)


def plot_roofline(peaks: MachinePeaks, points: Sequence[tuple[str, StepCost, float]],
                  path: str | Path, title: str = "Roofline") -> Path:
    """Draw the roofline and where measured steps land; save it as a PNG at `path`.

    The roof: attainable FLOP/s = min(matmul FLOP/s, bandwidth x intensity), log-log. points:
    (label, the step's cost, its measured seconds); each is drawn at (cost.intensity,
    cost.flops / seconds), with a hollow marker on the roof above it (what the step could reach).
    Returns the path.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intensities = [c.intensity for _, c, _ in points] or [1.0]
    lo = min(min(intensities), peaks.ridge_intensity) / 4
    hi = max(max(intensities), peaks.ridge_intensity) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    roof = np.minimum(peaks.matmul_flops_per_s, peaks.bandwidth_bytes_per_s * x)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.loglog(x, roof, color="black", lw=2,
              label=f"roof: {peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                    f"{peaks.matmul_flops_per_s / 1e9:.0f} GFLOP/s")
    ax.axvline(peaks.ridge_intensity, color="grey", ls=":", lw=1)
    for where, text, align in ((peaks.ridge_intensity / 1.3, "bandwidth-bound", "right"),
                               (peaks.ridge_intensity * 1.3, "compute-bound", "left")):
        ax.text(where, peaks.matmul_flops_per_s * 1.3, text, ha=align, va="bottom",
                fontsize=8, color="grey")
    measured = [c.flops / t for _, c, t in points]
    ax.set_ylim(min([roof.min(), *measured]) / 2, peaks.matmul_flops_per_s * 3)
    colors = plt.get_cmap("tab20").colors          # 20 distinct colours, one per point
    for i, (label, cost, seconds) in enumerate(points):
        color = colors[(2 * i) % 20 + (2 * i) // 20 % 2]   # dark shades first, then light
        attainable = min(peaks.matmul_flops_per_s,
                         peaks.bandwidth_bytes_per_s * cost.intensity)
        ax.scatter([cost.intensity], [cost.flops / seconds], color=color, zorder=3, label=label)
        ax.scatter([cost.intensity], [attainable], facecolors="none", edgecolors=color, zorder=3)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Reports: the JSON file and the printed table
# ---------------------------------------------------------------------------------------------

def results_json(runs: Sequence[BenchmarkRun], machine: dict, peaks: MachinePeaks | None,
                 extra: dict | None = None) -> dict:
    """The whole benchmark as a JSON-ready dict: schema tag, UTC time, machine facts, the
    roofline measurements, every run (summary and per-request detail) and `extra` (models,
    workloads, notes)."""
    return {"schema": RESULTS_SCHEMA,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine,
            "roofline": None if peaks is None else {
                **asdict(peaks), "ridge_intensity_flop_per_byte": peaks.ridge_intensity},
            "runs": [run.to_json() for run in runs],
            **(extra or {})}


def write_results(path: str | Path, results: dict) -> Path:
    """Write `results` as indented JSON at `path` (folders created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return path


def format_table(runs: Sequence[BenchmarkRun]) -> str:
    """One line per run: requests, tokens, TTFT / ITL / e2e (p50 and p99, milliseconds),
    output tokens/s, and the decode step against its bandwidth floor when known."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    lines = [f"{'model':<12} {'engine':<27} {'workload':<10} {'req':>4} {'tok':>5} "
             f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'e2e p50':>9} "
             f"{'tok/s':>8} {'ITL/floor':>9}"]
    for run in runs:
        itl = run.itl_s
        ratio = run.decode_vs_floor
        lines.append(
            f"{run.model[:12]:<12} {run.engine[:27]:<27} {run.workload:<10} "
            f"{len(run.requests):>4} {run.output_tokens:>5} {ms(run.ttft_s.p50):>9} "
            f"{ms(run.ttft_s.p99):>8} {ms(itl and itl.p50):>8} {ms(itl and itl.p99):>8} "
            f"{ms(run.e2e_s.p50):>9} {run.output_tokens_per_s:>8.1f} "
            f"{'-' if ratio is None else f'{ratio:.1f}x':>9}")
    lines.append("(times in ms; ITL/floor = ITL p50 / (bytes a decode step moves / measured "
                 "bandwidth))")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main: the roofline of this machine and a small run on the bundled model
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 7: TTFT, ITL, throughput and the roofline on the bundled model.")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--workload", default="chat", choices=sorted(WORKLOAD_KINDS))
    parser.add_argument("--requests", type=int, default=4, help="requests in the workload")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    import torch
    import s05_kv_cache as s05
    import s06_torch as s06

    torch.set_num_threads(args.threads)
    try:
        model, tokenizer = s03.load(args.model)
        max_context = min(model.config.max_position_embeddings, 1024)
        workload = make_workload(args.workload, tokenizer, args.requests, args.seed, max_context)
    except ValueError as err:
        parser.error(f"{err} (the bundled model is written by scripts/train_bundled_model.py)")
    cfg = model.config
    print(f"{args.model}: {s03.parameter_count(cfg):,} parameters; workload {workload.name!r}: "
          f"{len(workload.requests)} requests, seed {workload.seed}")
    peaks = measure_peaks(repeats=3)
    print(f"memory bandwidth {peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
          f"({peaks.bandwidth_method})")
    print(f"matmul {peaks.matmul_flops_per_s / 1e9:.1f} GFLOP/s ({peaks.matmul_method})")
    print(f"ridge point: {peaks.ridge_intensity:.1f} FLOP/byte; a decode step here does "
          f"{decode_step_cost(cfg, workload.max_context).intensity:.2f}, a prefill of "
          f"{workload.requests[0].prompt_tokens} tokens "
          f"{prefill_cost(cfg, workload.requests[0].prompt_tokens).intensity:.1f}\n", flush=True)
    torch_model = s06.TorchTransformer.from_pretrained(args.model)
    engines = [
        HookedEngine.for_cached("S05 NumPy + KV cache", s05.Engine(model, tokenizer, max_context)),
        HookedEngine.for_cached("S06 torch", s06.Engine(torch_model, tokenizer, max_context))]
    label = "bundled" if Path(args.model).resolve() == s03.BUNDLED_MODEL_DIR.resolve() \
        else Path(args.model).name
    runs = []
    for engine in engines:
        # A bar only on a terminal, where it erases itself: in a log or a pipe its carriage
        # returns are not undone, and the table would start on the bar's line.
        run = run_benchmark(engine, workload, model=label,
                            progress=sys.stderr.isatty())
        attach_floor(run, cfg, peaks)
        runs.append(run)
    print(format_table(runs))
    if args.json:
        path = write_results(args.json, results_json(runs, machine_facts(), peaks))
        print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
