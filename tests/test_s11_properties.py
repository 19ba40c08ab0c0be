"""Property tests for chapter S11's chunked prefill (hypothesis).

1. A state machine of add / abort / step on the model-free `ChunkedScheduler`, with random
   max_num_seqs, token budgets from max_num_seqs up (far below max_model_len too), chunk limits
   (long_prefill_token_threshold), KV capacities and policies, driven by S10's fake model (its
   next token is a fixed function of the context it has computed, and it checks that each
   request is sent exactly the tokens after those it holds). After every rule: the budget and
   max_num_seqs hold, KV accounting is exact, no chunk exceeds the threshold, a request samples
   only in the step its new tokens reach the end of its token_ids (`sample_ids`; never before
   its prompt or recompute is complete), a request is a prefill piece (`prefill_ids`) exactly
   when it has not sampled since it was last admitted (the fake model's outputs and the
   preemptions say when: a 1-token piece that ends a chunked recompute is still a prefill),
   every running request is scheduled in every step,
   and without a threshold at most one request is part-way through its prefill, the last.
   At teardown everything drains within a bounded number of steps, every KV token is free,
   and every request not aborted has exactly the fake model's tokens for it alone (closed forms
   from tests/test_s10_scheduler.py).
2. The engine on a tiny random Qwen3 with random budgets, thresholds and arrivals: every
   request's greedy tokens equal S05 alone (the oracle, computed once per prompt), every
   request finishes, no step over its budget, and every request's first token comes in the step
   its prompt's last chunk ran.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import s03_transformer as s03
import s04_sampling as s04
import s05_kv_cache as s05
import s06_torch as s06
from s10_scheduler import POLICIES
from s11_chunked_prefill import DECODE, PREFILL, ChunkedScheduler, LLMEngine
from test_s03_transformer import V, IdTokenizer, build_tiny
from test_s10_properties import abort_drawn, check_outputs_alone, drain
from test_s10_scheduler import FakeModel, Req, check_invariants

MAX_MODEL_LEN = 24


class ChunkedMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 30),
                threshold=st.sampled_from([0, 0, 1, 2, 3, 5, 8]),
                capacity=st.integers(1, 60), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, threshold, capacity, policy):
        self.model = FakeModel(ChunkedScheduler(max_num_seqs, max_num_seqs + extra_budget,
                                                capacity, MAX_MODEL_LEN, policy, threshold))
        self.aborted: set[str] = set()
        self.decoding: set[str] = set()   # sampled in its last step, not preempted since
        self.count = 0

    @property
    def s(self) -> ChunkedScheduler:
        return self.model.scheduler

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN - 1), max_tokens=st.integers(1, 10),
          priority=st.integers(-2, 2))
    def add(self, prompt_len, max_tokens, priority):
        req = Req(str(self.count), prompt_len, max_tokens)
        if prompt_len > self.s.kv_capacity:        # G1: refused even though it could be chunked
            with pytest.raises(ValueError, match="could never be scheduled"):
                self.s.add_request(req, priority)
            return
        self.model.add(req, priority)
        self.count += 1

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def abort(self, data):
        abort_drawn(self, data)

    @rule()
    def step(self):
        before = {rid: len(r.output_ids) for rid, r in self.model.by_id.items()}
        out = self.model.step()
        s = self.s
        assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
        for rid, n in out.num_scheduled_tokens.items():
            req, start = self.model.by_id[rid], out.num_computed_tokens[rid]
            if s.long_prefill_token_threshold:
                assert n <= s.long_prefill_token_threshold
            reached = start + n == out.request_num_tokens[rid]
            assert (rid in out.sample_ids) is reached
            made = len(req.output_ids) - before[rid]
            assert made == (1 if reached else 0), "sampled before the prompt was complete"
            assert (rid in out.prefill_ids) is (rid not in self.decoding), rid
            if rid in self.decoding:        # a decode: the one output it sampled last
                assert n == 1 and start == len(req.token_ids) - 2 >= len(req.prompt_ids)
        self.decoding -= set(out.preempted_ids)
        self.decoding |= {rid for rid in out.num_scheduled_tokens
                          if len(self.model.by_id[rid].output_ids) > before[rid]}
        partial = [rid for rid, n in out.num_scheduled_tokens.items()
                   if out.num_computed_tokens[rid] + n < out.request_num_tokens[rid]]
        if not s.long_prefill_token_threshold:   # only the budget cuts: one part-way, last
            assert partial in ([], list(out.scheduled_ids[-1:])), partial
        # Every request still running after the plan was scheduled in it, preemption or not
        # (a request is admitted only with budget left, and those ahead never take more).
        assert [r.request_id for r in s.running if r.request_id not in out.scheduled_ids] \
            == [], "a running request got no token"

    @invariant()
    def accounting(self):
        if not hasattr(self, "model"):
            return
        if self.model.outputs:
            check_invariants(self.s, self.model.outputs[-1])

    def teardown(self):
        if not hasattr(self, "model"):
            return
        work = sum(len(r.prompt_ids) + r.max_tokens + 1 for r in self.model.by_id.values())
        drain(self, work)
        assert self.s.kv.num_free_tokens == self.s.kv_capacity and not self.s.kv.held
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
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("s11_props_qwen3")
    build_tiny("qwen3_gqa_tied", directory)
    model = s06.TorchTransformer.from_pretrained(directory)
    s05_engine = s05.Engine(s03.Transformer.from_pretrained(directory), IdTokenizer(), CONTEXT)
    greedy = s04.SamplingParams(temperature=0.0, max_tokens=NEW)
    references = [s05_engine.generate(" ".join(map(str, p)), greedy).token_ids
                  for p in PROMPTS]
    yield model, references
    torch.set_num_threads(before)


@settings(max_examples=12, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(max_num_seqs=st.integers(1, 4), extra=st.integers(0, 40),
       threshold=st.sampled_from([0, 1, 4, 9]),
       order=st.permutations(range(len(PROMPTS))),
       gaps=st.lists(st.integers(0, 3), min_size=len(PROMPTS), max_size=len(PROMPTS)))
def test_engine_outputs_do_not_depend_on_budget_chunks_or_arrivals(qwen, max_num_seqs, extra,
                                                                   threshold, order, gaps):
    model, references = qwen
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, max_num_seqs,
                       max_num_batched_tokens=max_num_seqs + extra,
                       long_prefill_token_threshold=threshold)
    arrivals = np.cumsum(gaps).tolist()
    params = s04.SamplingParams(temperature=0.0, max_tokens=NEW)
    ids, got, first, call = {}, {}, {}, 0
    while len(ids) < len(order) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call and i not in ids:
                ids[i] = engine.add_request(" ".join(map(str, PROMPTS[order[i]])), params)
        outputs = engine.step()
        call += 1
        assert call < 2000
        if not engine.trace:
            continue
        record = engine.trace[-1]
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
    for record in engine.trace:
        for rid, kind, n in zip(record.running, record.kinds, record.num_scheduled_tokens):
            assert kind in (PREFILL, DECODE) and (kind == PREFILL or n == 1)
    assert engine.kv_free_tokens == engine.kv_capacity and not engine.requests
