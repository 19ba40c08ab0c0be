"""Regression tests for what an adversarial review of the composed Part II engine found
(code/s09_continuous_batching.py, s09_ragged.py, s09_llm.py, s09_trace.py and the chapters'
`build_engine`s). Each test names the fault it pins; the oracle is always the request run
alone by S06's single-request engine, never the code under test.

- The batch-invariant reference (`RaggedRunner._requests_alone`) must not trust a count of
  positions it computed that the scheduler no longer agrees with: a request id used again, a
  step that failed after the runner ran (the plan taken back), a preemption in a failed step,
  a preemption whose recompute comes back in chunks that do not sample (S11, S12).
- `LLM` must never give an open stream's id to another stream, and a stream closed or dropped
  at any point (before its first step too) must abort its requests and not wedge the LLM.
- `queue` takes only requests this engine made; an observer that raises loses nothing and
  leaves the KV books right, and so does a draw that raises after the model ran; the trace
  lists what a failed step's plan did.
- Every build option that breaks a rule is a ParameterError naming it, before any KV is
  allocated.
"""
import gc

import pytest

import s01_generation_loop as s01
import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s09_continuous_batching as s09
import s10_scheduler as s10
import s11_chunked_prefill as s11
import s12_engine as s12
import s13_prefix_caching as s13
from engine_testing import FailingRunner, drive, tokens_of
from s09_llm import LLM
from s09_trace import trace

PROMPTS = ["To be, or not to be, that is the question", "Now is the winter",
           "O Romeo, Romeo! wherefore art thou", "First Citizen.\nBefore we proceed"]


def greedy(n: int) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled():
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").exists():
        pytest.skip("bundled model not trained yet")
    model, tokenizer = s06.load()
    alone = s06.Engine(model, tokenizer, 96)
    return model, tokenizer, {p: alone.generate(p, greedy(6)).token_ids for p in PROMPTS}


def drain(engine) -> dict[str, list]:
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    return got


def drain_through_failures(engine, injected, check_kv=False) -> tuple[dict[str, list], int]:
    """drain, stepping on past each RuntimeError for which injected(err) is true (any other
    propagates); with check_kv, the KV books are checked after every step that succeeds.
    Returns the outputs by request id and the number of failed steps."""
    got: dict[str, list] = {}
    failures = steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 200, "the engine does not drain"
        try:
            outputs = engine.step()
        except RuntimeError as err:
            if not injected(err):
                raise
            failures += 1
            continue
        if check_kv:
            engine.scheduler.kv.check()
        for out in outputs:
            got.setdefault(out.request_id, []).append(out)
    return got, failures


# --- the batch-invariant reference ----------------------------------------------------------

@pytest.mark.parametrize("build", [s10.build_engine, s12.build_engine], ids=["s10", "s12"])
def test_reference_mode_with_a_request_id_used_again_equals_each_request_alone(bundled, build):
    model, tok, alone = bundled
    llm = LLM(build(model, tok, max_context=96, max_num_seqs=2, batch_invariant=True))
    for prompt in PROMPTS[:3]:          # each call gives its request id "0" again
        assert llm.generate(prompt, greedy(6)).token_ids == alone[prompt]


@pytest.mark.parametrize("build", [s10.build_engine, s12.build_engine], ids=["s10", "s12"])
def test_reference_mode_after_a_step_that_failed_late_equals_each_request_alone(bundled, build):
    """The model run fails after the runner computed (and counted) the step's passes: the
    plan is reverted, and the retry, with another request now beside it, must compute it
    again rather than trust the count."""
    model, tok, alone = bundled
    engine = build(model, tok, max_context=96, max_num_seqs=3, batch_invariant=True)
    engine.runner = FailingRunner(engine.runner)
    first = engine.add_request(PROMPTS[0], greedy(6))
    made = engine.step()                 # the prompt, and its first token
    engine.runner.failures = 1
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    second = engine.add_request(PROMPTS[1], greedy(6))
    got = drain(engine)
    assert tokens_of(made + got[first]) == alone[PROMPTS[0]]
    assert tokens_of(got[second]) == alone[PROMPTS[1]]
    assert engine.scheduler.kv.num_used_tokens == 0


def test_reference_mode_with_failed_preempting_and_resuming_steps_equals_alone(bundled):
    """Steps that fail before the runner runs, at a preemption and then at the resume: the
    resumed request is computed from position 0 with S06's passes."""
    model, tok, alone = bundled
    engine = s10.build_engine(model, tok, max_context=96, max_num_seqs=3, kv_capacity=40,
                              batch_invariant=True)
    failing = {"left": 0}

    class Failing:
        def on_plan(self, engine, plan):
            if plan.preempted_ids or plan.scheduled_resumed_ids:
                if failing["left"] > 0:
                    failing["left"] -= 1
                    raise RuntimeError("injected at a preempting or resuming plan")

        def on_step(self, engine, result):
            pass

    engine.observers.append(Failing())
    ids = [engine.add_request(p, greedy(6)) for p in PROMPTS[:3]]
    failing["left"] = 2
    got, failures = drain_through_failures(engine, lambda err: "injected" in str(err))
    assert failures == 2 and failing["left"] == 0 and engine.scheduler.num_preemptions >= 1
    for rid, prompt in zip(ids, PROMPTS[:3]):
        assert tokens_of(got[rid]) == alone[prompt]
    assert engine.scheduler.kv.num_used_tokens == 0


SHARED = "Romeo.\nBut soft! what light through yonder window breaks?\n"
RECOMPUTE_PROMPTS = [SHARED + "Jul.\n", SHARED + "Ham.\nTo be", "First Citizen.\nBefore we",
                     SHARED + "Jul.\nAy me", SHARED, "Ham.\n"]


@pytest.mark.parametrize("build, options", [
    (s11.build_engine, dict(kv_capacity=128)),
    (s12.build_engine, dict(block_size=8, num_blocks=14)),
], ids=["s11", "s12"])
def test_reference_mode_with_a_recompute_in_chunks_that_do_not_sample_equals_alone(
        bundled, build, options):
    """A preempted request's recompute comes back in prompt chunks that do not sample (the
    reference computes nothing for those rows); by the time it samples, num_computed_tokens
    is past the count of positions the runner computed before the preemption. The runner
    must see the count drop at the first chunk, not trust it at the sampling one: that KV was
    freed (S12 hands out zeroed blocks, S11 a slot another request may have written)."""
    model, tok, _ = bundled
    alone = s06.Engine(model, tok, 96)
    expected = [alone.generate(p, greedy(24)).token_ids for p in RECOMPUTE_PROMPTS]
    engine = build(model, tok, max_num_batched_tokens=8, max_num_seqs=4, max_context=96,
                   batch_invariant=True, **options)
    chunked = set()

    class ChunkedRecompute:
        def on_plan(self, engine, plan):
            for rid in plan.scheduled_resumed_ids:
                start, n = plan.num_computed_tokens[rid], plan.num_scheduled_tokens[rid]
                if start + n < len(engine.requests[rid].token_ids):
                    chunked.add(rid)

        def on_step(self, engine, result):
            pass

    engine.observers.append(ChunkedRecompute())
    outs, _ = drive(engine, [(p, greedy(24)) for p in RECOMPUTE_PROMPTS], [0, 0, 1, 1, 2, 5])
    assert chunked, "no recompute came in chunks: the test checks nothing"
    assert [tokens_of(outs[i]) for i in range(len(RECOMPUTE_PROMPTS))] == expected


# --- LLM ------------------------------------------------------------------------------------

def test_llm_never_gives_an_open_streams_id_to_another(bundled):
    model, tok, alone = bundled
    llm = LLM(s09.build_engine(model, tok, max_context=96, max_num_seqs=4))
    first = llm.stream(PROMPTS[0], greedy(6))
    second = llm.stream(PROMPTS[1], greedy(6))
    list(second)                        # runs the first stream's request to its end too
    third = llm.stream(PROMPTS[2], greedy(6))
    assert [t for o in first for t in o.new_token_ids] == alone[PROMPTS[0]]
    assert [t for o in third for t in o.new_token_ids] == alone[PROMPTS[2]]
    old = llm.stream([PROMPTS[0], PROMPTS[1]], greedy(6))
    list(old)
    new = llm.stream([PROMPTS[2], PROMPTS[3]], greedy(6))
    next(new)
    del old
    gc.collect()                        # the finished stream's cleanup leaves the new one be
    assert [c.token_ids for c in s01.run_to_end(new)] == [alone[PROMPTS[2]], alone[PROMPTS[3]]]


def test_a_stream_dropped_or_closed_before_its_first_step_frees_everything(bundled):
    model, tok, alone = bundled
    engine = s09.build_engine(model, tok, max_context=16, max_num_seqs=2)
    llm = LLM(engine)
    dropped = llm.stream([[5] * 16, PROMPTS[1]], 3)   # the first fills the context: done
    del dropped
    gc.collect()
    closed = llm.stream([PROMPTS[1], PROMPTS[2]], 3)
    closed.close()
    assert engine.scheduler.kv.num_used_tokens == 0
    assert llm.generate(PROMPTS[1], greedy(3)).token_ids == alone[PROMPTS[1]][:3]
    assert not engine.has_unfinished_requests()


# --- the engine's edges ---------------------------------------------------------------------

def test_queue_takes_only_requests_this_engine_made_once(bundled):
    model, tok, _ = bundled
    big = s09.build_engine(model, tok, max_context=96)
    small = s09.build_engine(model, tok, max_context=32)
    foreign = big.make_request([5] * 60, 4)
    with pytest.raises(s01.ParameterError, match="make_request") as err:
        small.queue(foreign)
    assert err.value.parameter == "request"
    mine = small.make_request(PROMPTS[1], 4)
    small.queue(mine)
    with pytest.raises(s01.ParameterError, match="make_request"):
        small.queue(mine)


@pytest.mark.parametrize("hook", ["on_plan", "on_step"])
def test_an_observer_that_raises_loses_nothing_and_leaves_the_kv_books_right(bundled, hook):
    model, tok, alone = bundled
    engine = s12.build_engine(model, tok, max_context=96, max_num_seqs=2, block_size=4)
    calls = {"n": 0}

    class Raises:
        def on_plan(self, engine, plan):
            if hook == "on_plan" and calls["n"] == 1:
                calls["n"] += 1
                raise RuntimeError("observer failed")
            calls["n"] += hook == "on_plan"

        def on_step(self, engine, result):
            if hook == "on_step" and calls["n"] == 1:
                calls["n"] += 1
                raise RuntimeError("observer failed")
            calls["n"] += hook == "on_step"

    engine.observers.append(Raises())
    ids = [engine.add_request(p, greedy(6)) for p in PROMPTS[:2]]
    got, failures = drain_through_failures(engine, lambda err: str(err) == "observer failed",
                                           check_kv=True)
    assert calls["n"] >= 2 and failures == 1
    for rid, prompt in zip(ids, PROMPTS[:2]):
        assert tokens_of(got[rid]) == alone[prompt]
    assert engine.scheduler.kv.num_used_tokens == 0


@pytest.mark.parametrize("build", [s09.build_engine, s10.build_engine, s13.build_engine],
                         ids=["s09", "s10", "s13"])
def test_a_draw_that_raises_reverts_the_step_and_loses_nothing(bundled, build):
    """The model ran, then the sampler raised (an interrupt, a device error surfacing at the
    copy to the host): the step is taken back like a failed model run, so no KV is held twice
    (S09's slot would otherwise overflow and refuse every later step)."""
    model, tok, alone = bundled
    engine = build(model, tok, max_context=96, max_num_seqs=2)
    ids = [engine.add_request(p, greedy(6)) for p in PROMPTS[:2]]
    draw, calls = engine.processor.sample_batch, {"n": 0}

    def raises_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("injected while drawing")
        return draw(*args, **kwargs)

    engine.processor.sample_batch = raises_once
    got = {rid: [] for rid in ids}
    for out in engine.step():
        got[out.request_id].append(out)
    held = [engine.scheduler.kv.num_tokens(rid) for rid in ids]
    computed = [engine.requests[rid].num_computed_tokens for rid in ids]
    with pytest.raises(KeyboardInterrupt, match="injected"):
        engine.step()
    assert [engine.scheduler.kv.num_tokens(rid) for rid in ids] == held
    assert [engine.requests[rid].num_computed_tokens for rid in ids] == computed
    for rid, outs in drain(engine).items():
        got[rid] += outs
    for rid, prompt in zip(ids, PROMPTS[:2]):
        assert tokens_of(got[rid]) == alone[prompt]
    assert engine.scheduler.kv.num_used_tokens == 0


def test_the_trace_lists_what_a_failed_steps_plan_did(bundled):
    model, tok, _ = bundled
    engine = s10.build_engine(model, tok, max_context=96, max_num_seqs=3, kv_capacity=40)
    engine.runner = FailingRunner(engine.runner)
    tracer = trace(engine)
    ids = [engine.add_request(p, greedy(6)) for p in PROMPTS[:3]]
    engine.runner.failures = 1                       # the first step: every admission in it
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    drain(engine)
    assert engine.scheduler.num_preemptions >= 1     # else the checks below hold trivially
    records = tracer.records
    joined = [rid for r in records for rid in r.joined]
    assert sorted(joined) == sorted(ids)
    preempted = [rid for r in records for rid in r.preempted]
    resumed = [rid for r in records for rid in r.resumed]
    assert len(preempted) == engine.scheduler.num_preemptions and sorted(preempted) == sorted(
        resumed)


@pytest.mark.parametrize("build, options, parameter", [
    (s09.build_engine, dict(max_context=10**6), "max_context"),
    (s09.build_engine, dict(logprobs_mode="x"), "logprobs_mode"),
    (s09.build_engine, dict(attention="flash", max_num_seqs=3000), "attention"),
    (s10.build_engine, dict(max_num_seqs=10**30), "max_num_seqs"),
    (s10.build_engine, dict(kv_capacity=0), "kv_capacity"),
    (s12.build_engine, dict(block_size=10**9), "block_size"),
    (s12.build_engine, dict(max_num_seqs=10**7), "max_num_seqs"),
    (s12.build_engine, dict(enable_kv_cache_events="yes"), "enable_kv_cache_events"),
    (s12.build_engine, dict(kv_capacity=64), "kv_capacity"),
    (s13.build_engine, dict(batch_invariant=True, enable_prefix_caching=True),
     "enable_prefix_caching"),
], ids=lambda v: v.__module__ if callable(v) else None)
def test_every_bad_build_option_is_a_parameter_error_naming_it(bundled, build, options,
                                                               parameter):
    model, tok, _ = bundled
    with pytest.raises(s01.ParameterError) as err:
        build(model, tok, **options)
    assert err.value.parameter == parameter


def test_trace_cache_refuses_an_engine_without_the_cache(bundled):
    model, tok, _ = bundled
    engine = s13.build_engine(model, tok, max_context=96, enable_prefix_caching=False)
    with pytest.raises(s01.ParameterError) as err:
        s13.trace_cache(engine)
    assert err.value.parameter == "enable_prefix_caching"


@pytest.mark.parametrize("build", [s10.build_engine, s12.build_engine], ids=["s10", "s12"])
def test_a_schedule_that_raises_keeps_the_outputs_held_since_the_last_step(bundled, build):
    """An abort between steps leaves its request's last output held for the next step. If that
    step's schedule() raises, the held output must still come out of the step after it (it was
    taken out of the pending list before the scheduler ran, and lost)."""
    model, tok, alone = bundled
    engine = build(model, tok, max_context=96, max_num_seqs=2)
    kept, aborted = (engine.add_request(p, greedy(6)) for p in PROMPTS[:2])
    got = {kept: [], aborted: []}
    for out in engine.step():
        got[out.request_id].append(out)
    engine.abort(aborted)
    schedule, calls = engine.scheduler.schedule, {"n": 0}

    def raises_once():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected in schedule")
        return schedule()

    engine.scheduler.schedule = raises_once
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    for rid, outs in drain(engine).items():
        got[rid] += outs
    assert got[aborted] and got[aborted][-1].finished
    assert got[aborted][-1].finish_reason == s09.FINISH_ABORT
    assert tokens_of(got[kept]) == alone[PROMPTS[0]]
    assert engine.scheduler.kv.num_used_tokens == 0
