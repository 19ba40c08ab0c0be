"""S09, arrivals: S07's harness serving requests that arrive over time, through the step API.

What is here
    S07's `run_benchmark` sends one request after another. A step-based engine (S09's
    `LLMEngine`) serves many at once, so its client is different, as S07's docstring says at
    its Part II seam: `run_arrivals` adds each request at its arrival time (`add_request`),
    calls `step` while anything is unfinished, and records every `RequestOutput` into its
    request's S07 `TimedRequest` at the moment `step` returned it. Everything from the
    TimedRequests on is S07's (`RequestResult.from_timed`, `BenchmarkRun`: TTFT, ITL, e2e,
    tokens/s, percentiles). `poisson_arrivals` draws arrival times as vLLM's serving benchmark
    does (exponential gaps at a given rate).

What it does not handle
    A client that sleeps between arrivals while the engine is idle (time.sleep), one process:
    no server, no network (S20's load test). Model time per step is not reported per request.

Run it
    python benchmarks/bench_s09_continuous_batching.py --quick     # the "arrivals" table

Tests
    tests/test_s09_arrivals.py: the arrival times' rules and mean gap; every request measured
    with its tokens equal to the request alone, on a tiny model.

References
    vLLM `benchmarks/benchmark_serving.py` (Poisson request rate, TTFT / ITL definitions, now
    `vllm bench serve`); S07's harness.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import numpy as np

import s01_generation_loop as s01
import s04_sampling as s04
import s07_measuring as s07
from s07_workloads import Workload



def poisson_arrivals(num_requests: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times in seconds from 0: exponential gaps of mean 1 / rate_per_s (a Poisson
    process, as vLLM's benchmark_serving.py draws them), the first request at 0. Raises
    ValueError for num_requests < 1 or a rate that is not > 0."""
    if not s01.is_int(num_requests) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1 (got {num_requests!r})")
    if not s01.is_finite(rate_per_s) or rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be a finite number > 0 (got {rate_per_s!r})")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def run_arrivals(engine, workload: Workload, arrival_s: Sequence[float], name: str = "s09",
                 model: str = "", clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, warmup: bool = True):
    """S07's harness with arrivals (the seam in `s07_measuring.run_benchmark`): request i is
    added at arrival_s[i] seconds after the start (greedy, ignore_eos, exactly its
    max_tokens), `step` is called while anything is unfinished, and every output is recorded
    into its request's `TimedRequest` at clock() right after `step` returns. A request's
    start is its arrival time, so TTFT includes the time it queued. Returns S07's
    `BenchmarkRun`. engine: anything with S09's `add_request`, `step` and
    `has_unfinished_requests`. Raises ValueError when arrival_s is not one sorted time per
    request."""
    requests = workload.requests
    if len(arrival_s) != len(requests) or any(b < a for a, b in zip(arrival_s, arrival_s[1:])):
        raise ValueError("arrival_s must hold one time per request, in order")
    params = lambda n: s04.SamplingParams(temperature=0.0, max_tokens=n,  # noqa: E731
                                          ignore_eos=True)
    if warmup:   # one-off costs (allocation, kernel choice) outside the measured run
        engine.add_request(requests[0].prompt, params(min(2, requests[0].max_tokens)))
        while engine.has_unfinished_requests():
            engine.step()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    began = clock()
    timed, by_id, next_up = [], {}, 0
    while next_up < len(requests) or engine.has_unfinished_requests():
        now = clock() - began
        while next_up < len(requests) and arrival_s[next_up] <= now:
            request = requests[next_up]
            timed.append(s07.TimedRequest(request.request_id, began + arrival_s[next_up]))
            by_id[engine.add_request(request.prompt, params(request.max_tokens))] = timed[-1]
            next_up += 1
        if not engine.has_unfinished_requests():
            sleep(max(0.0, arrival_s[next_up] - (clock() - began)))
            continue
        outputs = engine.step()
        now = clock()
        for output in outputs:
            by_id[output.request_id].record(output, now)
            if output.finished:
                by_id[output.request_id].finish_reason = output.finish_reason
    wall = clock() - began
    results = [s07.RequestResult.from_timed(r, t) for r, t in zip(requests, timed)]
    return s07.BenchmarkRun(name, model, workload.name, workload.seed, results, wall,
                            s07.peak_memory(), load_average_1min=load)
