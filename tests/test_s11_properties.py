"""Property tests for chapter S11's chunked prefill (hypothesis).

1. A state machine of add / abort / step on the model-free `ChunkedScheduler` (over S10's
   `TokenKVPool`), with random max_num_seqs, token budgets from max_num_seqs up (far below
   max_model_len too), chunk limits (long_prefill_token_threshold), KV capacities and
   policies, driven by the fake model of tests/scheduler_testing.py (its next token is a fixed
   function of the context it has computed, and it checks that each request is sent exactly
   the tokens after those it holds), with S09's `StepTracer` attached as the engine attaches
   it. After every rule: the budget and max_num_seqs hold, KV accounting is exact, no chunk
   exceeds the threshold, a request samples only in the step its new tokens reach the end of
   its token_ids (the record's `sampled`; never before its prompt or recompute is complete),
   a request is a prefill piece (the record's `kinds`) exactly when it has not sampled since
   it was last admitted (the fake model's outputs and the preemptions say when: a 1-token
   piece that ends a chunked recompute is still a prefill), every running request is
   scheduled in every step, and without a threshold at most one request is part-way through
   its prefill, the last. At teardown everything drains within a bounded number of steps,
   every KV token and slot is free, and every request not aborted has exactly the fake
   model's tokens for it alone (closed forms from tests/scheduler_testing.py).
2. The engine on a tiny random Qwen3 with random budgets, thresholds and arrivals: every
   request's greedy tokens equal S05 alone (the oracle, computed once per prompt), every
   request finishes, no step over its budget, and every request's first token comes in the
   step its prompt's last chunk ran.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import s03_transformer as s03
import s05_kv_cache as s05
import s06_torch as s06
import s11_chunked_prefill as s11
from engine_testing import greedy, id_text
from model_testing import V, IdTokenizer, build_tiny
from s01_generation_loop import ParameterError
from s09_trace import DECODE, PREFILL, StepTracer, trace
from s10_scheduler import POLICIES, TokenKVPool
from scheduler_testing import (ObservedFakeModel, abort_drawn, check_invariants,
                               check_outputs_alone, chunked_scheduler, drain, make_request)

MAX_MODEL_LEN = 24


class ChunkedMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 30),
                threshold=st.sampled_from([0, 0, 1, 2, 3, 5, 8]),
                capacity=st.integers(1, 60), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, threshold, capacity, policy):
        # slots as long as the capacity, so any capacity fits max_num_seqs slots (the engine's
        # slots are max_context long; here only the capacity in tokens matters)
        pool = TokenKVPool(max_num_seqs, max(MAX_MODEL_LEN, capacity), capacity)
        self.model = ObservedFakeModel(chunked_scheduler(
            pool, max_num_seqs, max_num_seqs + extra_budget, MAX_MODEL_LEN, policy, threshold),
            MAX_MODEL_LEN)
        self.tracer = StepTracer()
        self.model.observers.append(self.tracer)
        self.aborted: set[str] = set()
        self.decoding: set[str] = set()   # sampled in its last step, not preempted since
        self.count = 0

    @property
    def s(self) -> s11.ChunkedScheduler:
        return self.model.scheduler

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN - 1), max_tokens=st.integers(1, 10),
          priority=st.integers(-2, 2))
    def add(self, prompt_len, max_tokens, priority):
        req = make_request(str(self.count), prompt_len, max_tokens, priority=priority)
        if prompt_len > self.s.kv_capacity:        # G1: refused even though it could be chunked
            with pytest.raises(ParameterError, match="could never be scheduled"):
                self.model.add(req)
            assert not any(r is req for r in self.s.waiting)
            return
        self.model.add(req)
        self.count += 1

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def abort(self, data):
        abort_drawn(self, data)

    @rule()
    def step(self):
        before = {rid: len(r.output_ids) for rid, r in self.model.by_id.items()}
        records = len(self.tracer.records)
        out = self.model.step()
        s = self.s
        assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
        if not out.planned:
            assert len(self.tracer.records) == records     # an idle call is not a step
            return
        r = self.tracer.records[-1]
        assert r.step == out.step and r.running == out.scheduled_ids
        threshold = s.config.long_prefill_token_threshold
        for rid, n, start, total, kind in zip(r.running, r.num_scheduled_tokens,
                                              r.num_computed_tokens, r.request_num_tokens,
                                              r.kinds):
            req = self.model.by_id[rid]
            if threshold:
                assert n <= threshold
            reached = start + n == total
            assert (rid in r.sampled) is reached
            made = len(req.output_ids) - before[rid]
            assert made == (1 if reached else 0), "sampled before the prompt was complete"
            assert (kind == PREFILL) is (rid not in self.decoding), rid
            if rid in self.decoding:        # a decode: the one output it sampled last
                assert n == 1 and start == req.num_tokens - 2 >= len(req.prompt_ids)
        self.decoding -= set(out.preempted_ids)
        self.decoding |= set(r.sampled)
        partial = [rid for rid, n, start, total in zip(r.running, r.num_scheduled_tokens,
                                                       r.num_computed_tokens,
                                                       r.request_num_tokens)
                   if start + n < total]
        if not threshold:                       # only the budget cuts: one part-way, last
            assert partial in ([], list(out.scheduled_ids[-1:])), partial
        # Every request still running after the plan was scheduled in it, preemption or not
        # (a request is admitted only with budget left, and those ahead never take more).
        assert [q.request_id for q in s.running if q.request_id not in out.scheduled_ids] \
            == [], "a running request got no token"

    @invariant()
    def accounting(self):
        if not hasattr(self, "model"):
            return
        if self.model.plans:
            check_invariants(self.s, self.model.plans[-1])

    def teardown(self):
        if not hasattr(self, "model"):
            return
        work = sum(len(r.prompt_ids) + r.params.max_tokens + 1
                   for r in self.model.by_id.values())
        drain(self, work)
        kv = self.s.kv
        assert kv.num_free_tokens == kv.capacity and not kv.tokens and not kv.slots
        assert kv.free_slots == list(range(kv.num_slots))
        check_outputs_alone(self, MAX_MODEL_LEN)


ChunkedMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_chunked_scheduler_state_machine = ChunkedMachine.TestCase


# --- the engine, real model -------------------------------------------------------------------

CONTEXT = 64
NEW = 6
PROMPTS = [np.random.default_rng(900 + n).integers(2, V, size=n).tolist()
           for n in (1, 5, 12, 23, 40, 57)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = tmp_path_factory.mktemp("s11_props_qwen3")
    build_tiny("qwen3_gqa_tied", directory)
    model = s06.TorchTransformer.from_pretrained(directory)
    s05_engine = s05.Engine(s03.Transformer.from_pretrained(directory), IdTokenizer(), CONTEXT)
    references = [s05_engine.generate(id_text(p), greedy(NEW)).token_ids for p in PROMPTS]
    return model, references


@settings(max_examples=12, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(max_num_seqs=st.integers(1, 4), extra=st.integers(0, 40),
       threshold=st.sampled_from([0, 1, 4, 9]),
       order=st.permutations(range(len(PROMPTS))),
       gaps=st.lists(st.integers(0, 3), min_size=len(PROMPTS), max_size=len(PROMPTS)))
def test_engine_outputs_do_not_depend_on_budget_chunks_or_arrivals(qwen, max_num_seqs, extra,
                                                                   threshold, order, gaps):
    model, references = qwen
    engine = s11.build_engine(model, IdTokenizer(), max_context=CONTEXT,
                              max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_seqs + extra,
                              long_prefill_token_threshold=threshold)
    tracer = trace(engine)
    arrivals = np.cumsum(gaps).tolist()
    ids, got, first, call = {}, {}, {}, 0
    while len(ids) < len(order) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call and i not in ids:
                ids[i] = engine.add_request(PROMPTS[order[i]], greedy(NEW))
        records = len(tracer.records)
        outputs = engine.step()
        call += 1
        assert call < 2000
        if len(tracer.records) == records:
            assert not any(o.new_token_ids for o in outputs)
            continue
        record = tracer.records[-1]
        assert record.num_tokens <= record.token_budget == max_num_seqs + extra
        for o in outputs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = record
    for i, rid in ids.items():
        assert got[rid] == references[order[i]], (i, order[i])
        # the first token comes in the step where the prompt's last piece ran
        record = first[rid]
        k = record.running.index(rid)
        assert record.kinds[k] == PREFILL and rid in record.sampled
        assert record.num_computed_tokens[k] + record.num_scheduled_tokens[k] == len(
            PROMPTS[order[i]])
    for record in tracer.records:
        for rid, kind, n in zip(record.running, record.kinds, record.num_scheduled_tokens):
            assert kind in (PREFILL, DECODE) and (kind == PREFILL or n == 1)
    kv = engine.scheduler.kv
    assert kv.num_free_tokens == kv.capacity and not engine.requests
