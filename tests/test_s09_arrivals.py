"""Tests for code/s09_arrivals.py: S07's harness driving S09's step API with arrival times.

Oracles: the arrival times' own definition (sorted, from 0, exponential gaps of mean
1 / rate, checked on 2,000 draws), and the S06 engine alone for the tokens each measured
request must carry.
"""
import numpy as np
import pytest

import s04_sampling as s04
import s06_torch as s06
import s07_workloads
import s09_continuous_batching as s09
from model_testing import V, IdTokenizer, build_tiny
from s09_arrivals import poisson_arrivals, run_arrivals

CONTEXT = 96
PROMPTS = [np.random.default_rng(400 + n).integers(2, V, size=n).tolist() for n in (1, 5, 20, 60)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("s09_arrivals")
    build_tiny("qwen3_gqa_tied", directory)
    return s06.TorchTransformer.from_pretrained(directory)


def text(ids):
    return " ".join(map(str, ids))


def test_poisson_arrivals_start_at_zero_are_sorted_and_reproducible():
    times = poisson_arrivals(2000, 4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times) and times == poisson_arrivals(2000, 4.0, 1)
    assert abs(np.mean(np.diff(times)) - 0.25) < 0.02       # mean gap 1 / rate
    with pytest.raises(ValueError, match="rate_per_s must be a finite number > 0"):
        poisson_arrivals(3, 0.0)
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1"):
        poisson_arrivals(0, 1.0)


def test_run_arrivals_measures_every_request_through_add_request_and_step(model):
    requests = tuple(s07_workloads.Request(i, text(p), len(p), 5) for i, p in enumerate(PROMPTS))
    workload = s07_workloads.Workload("ragged", 0, requests)
    single = s06.Engine(model, IdTokenizer(), CONTEXT)
    engine = s09.build_engine(model, IdTokenizer(), max_context=CONTEXT, max_num_seqs=2)
    # The last request arrives after the others are done: the client waits, idle, for it.
    run = run_arrivals(engine, workload, [0.0, 0.0, 0.001, 0.3], model="tiny")
    assert [r.output_tokens for r in run.requests] == [5] * 4
    for r, p in zip(run.requests, PROMPTS):
        alone = single.generate(text(p), s04.SamplingParams(temperature=0.0, max_tokens=5,
                                                            ignore_eos=True))
        assert r.token_ids == alone.token_ids
        assert r.ttft_s >= 0 and len(r.itl_s) == 4
    assert run.wall_s >= 0.3 and run.output_tokens == 20
    assert engine.scheduler.kv.free_slots == [0, 1] and engine.scheduler.kv.num_used_tokens == 0
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="one time per request, in order"):
        run_arrivals(engine, workload, [0.0, 1.0, 0.5, 2.0])
