"""S07, measuring: time to first token, inter-token latency, throughput, through the stream.

What is new since S06
    Until now each chapter timed itself its own way. This chapter writes the one benchmark
    harness every later chapter uses. It measures an engine the way a user meets it, through
    its public stream (`engine.stream(prompt, max_tokens, ...)`, the interface every engine of
    the course shares since S01): it takes clock() right after each `next` hands it a
    `RequestOutput` and notes how many tokens that output carried. Nothing in the engine is
    patched or wrapped, so the engine computes exactly what it computes without the harness.

    - Stamps (`Stamp`, `TimedRequest.record`, `stamp_stream`): one stamp per output that
      carries tokens, in arrival order. An output carrying k tokens stamps those k tokens at
      the same time (Part I's engines yield one token per output; speculative decoding, S15,
      yields several).
    - Clients: how a request reaches an engine, as vLLM's `backend_request_func.py` has one
      request function per backend. `StreamClient` drives any course engine through `stream`,
      greedy with `ignore_eos=True`, so every request generates exactly `max_tokens` tokens;
      `HFGenerateClient` drives `transformers` `model.generate()` (not our engine) with a
      streamer, `StampStreamer`, that records the same stamps at the moment generate() hands
      it each token. Both return a `TimedRequest`.
    - The numbers (`RequestResult.from_timed`), per request, as vLLM's `benchmark_serving.py`
      defines them: TTFT (request start to the first output with a token), ITL (the gaps
      between consecutive outputs: one value per output after the first, whatever number of
      tokens each carried; with one token per output, the gap between tokens), e2e latency
      (request start to the last output), TPOT ((e2e - TTFT) / (n - 1) for n tokens: per
      token, where ITL is per output) and the request's tokens per second. Over a run
      (`run_benchmark`, `BenchmarkRun`): output tokens per second, and mean, p50, p90 and p99
      of each latency (`Distribution`, NumPy's percentiles).
    - Where the numbers were taken (`machine_facts`, `peak_memory`) and how they are written
      down (`results_json`, `write_results`, `format_table`).

    Its siblings: `s07_workloads.py` (the seeded requests) and `s07_roofline.py` (this
    machine's bandwidth and matmul roofs, and the FLOPs and bytes of a step, the yardstick the
    harness's decode steps are put against).

What it does not handle yet
    One request at a time (batch 1): the harness sends the next request when the previous one
    is done, so there is no queueing delay in TTFT yet. An engine that serves several requests
    at once (S09's `LLMEngine`: `add_request`, `step`) is driven through that API instead, by a
    client that adds each request at its arrival time and records every `RequestOutput` of a
    step into its request's `TimedRequest`: see the seam in `run_benchmark`. Arrival rates and
    the throughput / latency trade arrive with batching (S08, S09) and the load test (S20).
    Only CPU threads and one CUDA device are described in the machine facts.

Run it
    python code/s07_measuring.py                      # bundled model: roofs + a small run
    python code/s07_measuring.py --workload long --requests 8 --json mine.json
    python benchmarks/bench_s07_engines.py --skip-qwen   # the chapter's comparison (scratch)

Tests
    tests/test_s07_measuring.py: TTFT / ITL / e2e / TPOT / tokens-per-second bookkeeping on
    fake engines driven by a fake clock (one token per output, and 2-3 tokens per output),
    checked against hand-computed values; percentiles against hand values; the S01, S05 and
    S06 engines and `transformers` through the harness give HF's greedy tokens; the JSON schema
    of the results; every command-line rule (exit 2, checked before the run).
    tests/test_s07_workloads.py, tests/test_s07_roofline.py: the siblings.
    tests/test_s07_bench.py: the benchmark's output paths and argument rules.

References
    TTFT / ITL / TPOT / e2e latency, the per-output ITL and percentile reporting follow vLLM's
    `benchmarks/benchmark_serving.py` (`calculate_metrics`) and
    `benchmarks/backend_request_func.py` (a stamp per streamed chunk that carries a
    completion; latency = last chunk - start), now `vllm bench serve`. The streamer protocol is Hugging
    Face transformers' `generation/streamers.py` (`put` gets the prompt first, then each new
    token). Roofline references: see s07_roofline.py.

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
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

import numpy as np

import s01_generation_loop as s01
import s03_transformer as s03
from s07_workloads import WORKLOAD_KINDS, Request, Workload, make_workload

if TYPE_CHECKING:  # the roofline is imported where it is used (main), not to run the harness
    from s07_roofline import MachinePeaks

ROOT = Path(__file__).resolve().parents[1]

Clock = Callable[[], float]
# 2: e2e ends at the last output (vLLM's latency), ITL is per output, per_request gains
# tokens_per_output and tokens_per_s. results/ files of schema 1 ended e2e when the engine
# returned (microseconds later) and had one token per output, so their ITLs read the same.
RESULTS_SCHEMA = "s07-benchmark/2"


# ---------------------------------------------------------------------------------------------
# Stamps: the clock, read as each output arrives
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stamp:
    """One output as the harness received it: clock() seconds right after it arrived, and the
    token ids it carried (one in Part I; several per output from S15 on)."""

    time_s: float
    token_ids: tuple[int, ...]


@dataclass
class TimedRequest:
    """One request as the harness saw it. Times are clock() readings in seconds.

    start_s: just before the engine got the prompt (its encoding is inside TTFT). stamps: one
    per output that carried tokens, in arrival order (`record`). model_step_s: seconds of each
    decode step spent in the model, when the engine reports it (`Completion.stats.pass_times_s`
    after the prefill), else None. finish_reason: the engine's, when it reports one.
    """

    request_id: int
    start_s: float
    stamps: list[Stamp] = field(default_factory=list)
    model_step_s: list[float] | None = None
    finish_reason: str | None = None

    def record(self, output: s01.RequestOutput, now: float) -> None:
        """Note that `output` arrived at clock() = now. An output without a new token (a
        request's last message may carry only its finish_reason) is not a stamp: there is no
        token to time, as vLLM's request functions skip a last chunk that carries only the
        usage summary."""
        if output.new_token_ids:
            self.stamps.append(Stamp(now, tuple(int(t) for t in output.new_token_ids)))

    @property
    def token_ids(self) -> list[int]:
        return [t for stamp in self.stamps for t in stamp.token_ids]

    @property
    def token_times_s(self) -> list[float]:
        """When each token arrived: the k tokens of one output share its stamp."""
        return [stamp.time_s for stamp in self.stamps for _ in stamp.token_ids]


def stamp_stream(timed: TimedRequest, outputs: Iterable[s01.RequestOutput], clock: Clock
                 ) -> None:
    """Drain a stream of RequestOutputs into `timed`, reading the clock right after each `next`
    returns: the moment a caller of the stream has the output in hand. The one place where a
    course engine's outputs are timed."""
    for output in outputs:
        timed.record(output, clock())


# ---------------------------------------------------------------------------------------------
# Clients: one request in, a TimedRequest out
# ---------------------------------------------------------------------------------------------

class BenchClient(Protocol):
    """What the harness needs to send one request: a name (the label in tables) and
    `measure(request, clock) -> TimedRequest`."""

    name: str

    def measure(self, request: Request, clock: Clock) -> TimedRequest: ...


class StreamClient:
    """Any course engine (S01's `Engine` and every later one) behind the harness, through its
    public `stream`: greedy, `ignore_eos=True`, so each request generates exactly
    `request.max_tokens` tokens, with `options` (further params fields) passed on.

    The engine is not touched: the client calls `engine.stream(prompt, max_tokens,
    temperature=0.0, ignore_eos=True, **options)`, stamps each output as it arrives
    (`stamp_stream`), then reads `stream.result` and checks that the stream's tokens are the
    result's.
    """

    def __init__(self, name: str, engine, **options):
        self.name, self.engine, self.options = name, engine, options

    def measure(self, request: Request, clock: Clock) -> TimedRequest:
        """Raises RuntimeError when the streamed tokens differ from the Completion's."""
        timed = TimedRequest(request.request_id, clock())
        stream = self.engine.stream(request.prompt, request.max_tokens, temperature=0.0,
                                    ignore_eos=True, **self.options)
        stamp_stream(timed, stream, clock)
        completion = stream.result
        if list(completion.token_ids) != timed.token_ids:
            raise RuntimeError(f"{self.name}: the streamed tokens are not the result's tokens")
        timed.model_step_s = list(completion.stats.pass_times_s[1:])   # pass 0 is the prefill
        timed.finish_reason = completion.finish_reason
        return timed


class StampStreamer:
    """A `transformers` streamer that records stamps into a TimedRequest instead of printing.

    generate() calls `put(prompt_ids)` once, then `put(new_ids)` once per step (one token at
    batch 1), then `end()` (transformers `generation/streamers.py`, `BaseStreamer`). The first
    put is the prompt and is skipped; every later one is the output generate() would hand a
    caller at that moment, recorded with `TimedRequest.record` at clock(), as `stamp_stream`
    records our engines' outputs.
    """

    def __init__(self, timed: TimedRequest, clock: Clock):
        self.timed, self.clock = timed, clock
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = self.clock()
        ids = [int(t) for t in value.reshape(-1).tolist()]
        self.timed.record(s01.RequestOutput(str(self.timed.request_id), ids, "", False), now)

    def end(self) -> None:
        pass


class HFGenerateClient:
    """`transformers` `model.generate()` at batch 1 behind the harness: not our engine, so it
    is driven by its own API, and presents the same stamps.

    Greedy (`do_sample=False`), exactly `max_tokens` new tokens (the generation config's EOS is
    removed, as S06's benchmark does), the prompt encoded by `tokenizer` inside the timed
    request as our engines do. generate() pushes tokens to a streamer rather than being
    iterated, so the stamps are taken inside `StampStreamer.put`: the moment generate() hands
    over each token, after its stopping criteria ran and just before its next step. (Turning
    the push into an iterator would need a thread, and the stamps would then time the thread
    switch.) It streams token ids, not text: our engines also detokenize inside each step.
    """

    def __init__(self, name: str, model, tokenizer, pad_token_id: int = 0):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.pad_token_id = pad_token_id
        model.generation_config.eos_token_id = None   # never stop early: exactly max_tokens
        model.generation_config.pad_token_id = pad_token_id

    def measure(self, request: Request, clock: Clock) -> TimedRequest:
        """Raises RuntimeError when the streamer saw other tokens than generate() returned."""
        import torch
        device = next(self.model.parameters()).device
        timed = TimedRequest(request.request_id, clock())
        ids = torch.tensor([self.tokenizer.encode(request.prompt)], device=device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=request.max_tokens,
                                      pad_token_id=self.pad_token_id,
                                      streamer=StampStreamer(timed, clock))
        if timed.token_ids != out[0, ids.shape[1]:].tolist():
            raise RuntimeError(f"{self.name}: the streamer saw other tokens than generate() "
                               "returned")
        timed.finish_reason = s01.FINISH_LENGTH
        return timed


# ---------------------------------------------------------------------------------------------
# The numbers: per request, then distributions over a run
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestResult:
    """One request's latencies, in seconds (vLLM's `benchmark_serving.py` definitions).

    ttft_s: request start to the first output that carried a token. itl_s: the gaps between
    consecutive outputs, one per output after the first: with one token per output (Part I)
    the gaps between tokens, output_tokens - 1 of them; an output carrying k tokens is one gap,
    as in vLLM, whose stream chunks may carry several tokens. e2e_s: request start to the last
    output. tpot_s (time per output token after the first): (e2e - ttft) / (output_tokens - 1),
    None for a single token; it counts tokens where itl_s counts outputs. tokens_per_s: the
    request's output_tokens / e2e_s. model_step_s: model time of each decode step when the
    engine reports it. tokens_per_output: how many tokens each output carried.
    """

    request_id: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_s: list[float]
    e2e_s: float
    token_ids: list[int]
    model_step_s: list[float] | None = None
    tokens_per_output: list[int] | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over e2e latency; None when e2e is 0 (a clock that did not move)."""
        return self.output_tokens / self.e2e_s if self.e2e_s > 0 else None

    @classmethod
    def from_timed(cls, request: Request, timed: TimedRequest) -> "RequestResult":
        """Latencies from the stamps. Raises ValueError when no token was generated, when the
        request did not get exactly request.max_tokens tokens (the harness compares engines
        doing the same work), or when the stamps are not in order."""
        stamps = timed.stamps
        n = sum(len(s.token_ids) for s in stamps)
        if n == 0:
            raise ValueError(f"request {request.request_id} generated no token: no TTFT")
        if n != request.max_tokens:
            raise ValueError(f"request {request.request_id} generated {n} tokens; the harness "
                             f"asks for exactly max_tokens = {request.max_tokens} (EOS ignored)")
        times = [s.time_s for s in stamps]
        if not timed.start_s <= times[0] or any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("timestamps must be in order: start <= first output <= ... <= "
                             "last output")
        return cls(request.request_id, request.prompt_tokens, n,
                   ttft_s=times[0] - timed.start_s,
                   itl_s=[b - a for a, b in zip(times, times[1:])],
                   e2e_s=times[-1] - timed.start_s, token_ids=timed.token_ids,
                   model_step_s=timed.model_step_s,
                   tokens_per_output=[len(s.token_ids) for s in stamps])


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
    per request; itl_s: every gap of every request pooled (as vLLM does); tpot_s: one per
    request with >= 2 tokens. decode_floor_s / decode_vs_floor: filled in by s07_roofline's
    `attach_floor`. load_average_1min: the machine's 1-minute load average when the run began
    (other jobs slow every number).
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
        `s07_roofline.attach_floor`): how many times slower than `bytes moved / bandwidth` a
        step is."""
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
                "per_request": [{**asdict(r), "tpot_s": r.tpot_s, "tokens_per_s": r.tokens_per_s}
                                for r in self.requests]}


def run_benchmark(client: BenchClient, workload: Workload, model: str = "",
                  clock: Clock = time.perf_counter, warmup: bool = True,
                  progress: bool = True) -> BenchmarkRun:
    """Send every request of `workload` through `client`, one after another, and measure it.

    warmup: first send the first request once for 2 tokens, not recorded (the first call of an
    engine pays one-off costs: lazy allocation, kernel selection, caches). progress: a tqdm bar
    on stderr. clock: seconds as a float; injectable so tests can drive a fake engine with a
    fake clock. Returns a BenchmarkRun with peak memory read after the last request.
    """
    from tqdm import tqdm

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if warmup:
        first = workload.requests[0]
        client.measure(Request(-1, first.prompt, first.prompt_tokens, min(2, first.max_tokens)),
                       clock)
    began = clock()
    # The Part II seam: an engine that serves many requests at once gets a client that adds
    # each request at its arrival time (add_request), calls step() and records every
    # RequestOutput of a step, stamped once per step, into its request's TimedRequest with
    # `TimedRequest.record`. This loop, one request after another, is what that client
    # replaces; everything from the TimedRequests on stays as it is.
    timed = [client.measure(request, clock)
             for request in tqdm(workload.requests, desc=f"{client.name} / {workload.name}",
                                 disable=not progress, leave=False)]
    wall = clock() - began
    results = [RequestResult.from_timed(r, t) for r, t in zip(workload.requests, timed)]
    return BenchmarkRun(client.name, model, workload.name, workload.seed, results, wall,
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
# Reports: the JSON file and the printed table
# ---------------------------------------------------------------------------------------------

def results_json(runs: Sequence[BenchmarkRun], machine: dict, peaks: MachinePeaks | None = None,
                 extra: dict | None = None) -> dict:
    """The whole benchmark as a JSON-ready dict: schema tag, UTC time, machine facts, the
    roofline measurements (an s07_roofline `MachinePeaks`, or None), every run (summary and
    per-request detail) and `extra` (models, workloads, notes)."""
    return {"schema": RESULTS_SCHEMA,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine,
            "roofline": None if peaks is None else {
                **asdict(peaks), "ridge_intensity_flop_per_byte": peaks.ridge_intensity},
            "runs": [run.to_json() for run in runs],
            **(extra or {})}


def check_output_file(path: str | Path) -> Path:
    """`path` as a file the results can be written to, checked before a run spends minutes.

    Raises ValueError naming the rule: the path must not be a directory; its nearest existing
    folder must be a directory (not a file) that this process may write into (missing folders
    below it are created when writing); an existing file must be writable.
    """
    path = Path(path)
    try:
        if path.is_dir():
            raise ValueError(f"{path} is a directory: name a file to write the results to")
        if path.is_symlink() and not path.exists():
            raise ValueError(f"cannot write {path}: it is a link to {os.readlink(path)}, "
                             "which does not exist")
        folder = path.parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            raise ValueError(f"cannot write {path}: {folder} is a file, not a directory")
        target = path if path.exists() else folder
        if not os.access(target, os.W_OK):
            raise ValueError(f"cannot write {path}: no permission to write {target}")
        if path.exists() and not path.is_file():
            raise ValueError(f"cannot write {path}: not a regular file")
        if not path.exists() and path.parent.is_dir():
            path.open("x").close()    # permissions say little on /proc or a read-only mount:
            path.unlink()             # creating the file (and removing it) is the real test
    except OSError as err:   # a name too long for the file system, for one (ENAMETOOLONG)
        shown = str(path) if len(str(path)) <= 80 else str(path)[:80] + "..."
        raise ValueError(f"cannot write {shown}: {err.strerror}") from None
    return path


def write_results(path: str | Path, results: dict) -> Path:
    """Write `results` as indented JSON at `path` (folders created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return path


# The model label main() and benchmarks/bench_s07_engines.py give the bundled model's runs.
BUNDLED_LABEL = "bundled"


def format_table(runs: Sequence[BenchmarkRun]) -> str:
    """One line per run: requests, tokens, TTFT / ITL / e2e (p50 and p99, milliseconds),
    output tokens/s, and the decode step against its bandwidth floor when that floor applies.

    The floor is bytes moved / main-memory bandwidth, the yardstick of a model whose weights
    stream from DRAM every step (the Qwen3-0.6B shape). The bundled model's 5.8 MB of weights
    fit in a CPU's last-level cache, so that floor says nothing about its steps: a run labelled
    BUNDLED_LABEL shows "n/a" in the column, and a table with only such runs drops the column.
    """
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    def floor_cell(run: BenchmarkRun) -> str:
        if run.model == BUNDLED_LABEL:
            return "n/a"
        ratio = run.decode_vs_floor
        return "-" if ratio is None else f"{ratio:.1f}x"

    with_floor = any(run.model != BUNDLED_LABEL for run in runs)
    header = (f"{'model':<12} {'engine':<27} {'workload':<10} {'req':>4} {'tok':>5} "
              f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'e2e p50':>9} "
              f"{'tok/s':>8}")
    lines = [header + (f" {'ITL/floor':>9}" if with_floor else "")]
    for run in runs:
        itl = run.itl_s
        line = (f"{run.model[:12]:<12} {run.engine[:27]:<27} {run.workload:<10} "
                f"{len(run.requests):>4} {run.output_tokens:>5} {ms(run.ttft_s.p50):>9} "
                f"{ms(run.ttft_s.p99):>8} {ms(itl and itl.p50):>8} {ms(itl and itl.p99):>8} "
                f"{ms(run.e2e_s.p50):>9} {run.output_tokens_per_s:>8.1f}")
        lines.append(line + (f" {floor_cell(run):>9}" if with_floor else ""))
    notes = ["times in ms"]
    if with_floor:
        notes.append("ITL/floor = ITL p50 / (bytes a decode step moves / measured bandwidth)")
    if any(run.model == BUNDLED_LABEL for run in runs):
        notes.append(("n/a" if with_floor else "no ITL/floor") + ": the bundled model fits in "
                     "the CPU's cache, so a main-memory bandwidth floor does not apply to it")
    lines.append("(" + "; ".join(notes) + ")")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main: the roofline of this machine and a small run on the bundled model
# ---------------------------------------------------------------------------------------------

# --requests at most: at batch 1 a chat request of the bundled model takes tens of
# milliseconds per engine here, so 1,000 are a few minutes; more is a load test (S20).
MAX_REQUESTS = 1000


def check_count(parser: argparse.ArgumentParser, flag: str, value: int, low: int,
                high: int | None = None) -> None:
    """Exit with a usage error (status 2) naming `flag` unless low <= value (<= high)."""
    if value < low or (high is not None and value > high):
        rule = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        parser.error(f"{flag} must be {rule} (got {value})")


def main(argv: Sequence[str] | None = None) -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(
        description="Chapter 7: TTFT, ITL, throughput and the roofline on the bundled model.")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory or hub id (default: the bundled model)")
    parser.add_argument("--workload", default="chat", choices=sorted(WORKLOAD_KINDS),
                        help="kind of requests: chat (short prompts and answers), long (long "
                             "prompts), mixed (default: chat)")
    parser.add_argument("--requests", type=int, default=4,
                        help=f"requests in the workload, 1 to {MAX_REQUESTS} (default: 4)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the workload, >= 0 (default: 0)")
    parser.add_argument("--threads", type=int, default=1,
                        help=f"torch intra-op threads, 1 to the logical cores ({cores}) "
                             "(default: 1)")
    parser.add_argument("--json", default=None,
                        help="also write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)

    # Every rule is checked here, before a model is loaded or a request sent.
    check_count(parser, "--requests", args.requests, 1, MAX_REQUESTS)
    check_count(parser, "--seed", args.seed, 0)
    check_count(parser, "--threads", args.threads, 1, cores)
    if args.json is not None:
        try:
            check_output_file(args.json)
        except ValueError as err:
            parser.error(f"--json: {err}")
    from s03_checkpoint import resolve_checkpoint
    try:   # S03's rule: a missing local path is "no such directory", never a hub download
        model_dir = resolve_checkpoint(args.model)
    except ValueError as err:
        parser.error(f"--model: {err}")
    bundled = model_dir.resolve() == s03.BUNDLED_MODEL_DIR.resolve()

    import torch
    import s05_kv_cache as s05
    import s06_torch as s06
    from s03_checkpoint import CheckpointTokenizer, load_config, load_state_dict
    from s07_roofline import attach_floor, decode_step_cost, measure_peaks, prefill_cost

    torch.set_num_threads(args.threads)
    try:
        config = load_config(model_dir)
        weights = load_state_dict(model_dir)
        model = s03.Transformer(config, weights)
        tokenizer = CheckpointTokenizer.from_pretrained(model_dir)
        max_context = min(config.max_position_embeddings, 1024)
        workload = make_workload(args.workload, tokenizer, args.requests, args.seed, max_context)
    except ValueError as err:
        hint = ""
        if bundled and not (model_dir / "model.safetensors").is_file():
            hint = " (the bundled model is written by scripts/train_bundled_model.py)"
        parser.error(f"{err}{hint}")
    print(f"{args.model}: {s03.parameter_count(config):,} parameters; workload "
          f"{workload.name!r}: {len(workload.requests)} requests, seed {workload.seed}")
    peaks = measure_peaks(repeats=3)
    print(f"memory bandwidth {peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
          f"({peaks.bandwidth_method})")
    print(f"matmul {peaks.matmul_flops_per_s / 1e9:.1f} GFLOP/s ({peaks.matmul_method})")
    print(f"ridge point: {peaks.ridge_intensity:.1f} FLOP/byte; a decode step here does "
          f"{decode_step_cost(config, workload.max_context).intensity:.2f}, a prefill of "
          f"{workload.requests[0].prompt_tokens} tokens "
          f"{prefill_cost(config, workload.requests[0].prompt_tokens).intensity:.1f}\n",
          flush=True)
    torch_model = s06.TorchTransformer(config, weights)
    clients = [StreamClient("S05 NumPy + KV cache", s05.Engine(model, tokenizer, max_context)),
               StreamClient("S06 torch", s06.Engine(torch_model, tokenizer, max_context))]
    label = BUNDLED_LABEL if bundled else model_dir.name
    runs = []
    for client in clients:
        # A bar only on a terminal, where it erases itself: in a log or a pipe its carriage
        # returns are not undone, and the table would start on the bar's line.
        run = run_benchmark(client, workload, model=label, progress=sys.stderr.isatty())
        attach_floor(run, config, peaks)
        runs.append(run)
    print(format_table(runs))
    if args.json:
        path = write_results(args.json, results_json(runs, machine_facts(), peaks))
        print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
