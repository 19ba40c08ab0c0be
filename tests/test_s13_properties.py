"""Property tests for chapter S13's prefix caching (hypothesis), model-free.

The manager (`PrefixCachingKVCacheManager`) under S11's `ChunkedScheduler`, as S13's engine
assembles them (S10's scheduler asks the manager for prefix hits at admission and names the
filled blocks after each step). The oracle is tests/scheduler_testing.py's `PagedFakeModel`,
which keeps what each pool slot holds: the whole token prefix up to and including that
position, and the salt of the request that wrote it (a real key/value vector depends on every
token before it, so the prefix stands for it). In every step, for every scheduled request, it
checks that each position it reads (those before its start, through its block table, cached
hits included) holds exactly its own prefix and was written under its own salt, and that
each position it writes is in a block only it holds and that has no name (a shared or cached
block is never written). Its next token is a fixed function of the context
(`scheduler_testing.next_token`), so a wrong hit changes the outputs too.

1. A state machine over add (prompts built from a few shared prefixes, optional salts) /
   abort / step, on small pools (evictions and preemptions happen), with chunked prefill;
   after every rule S12's and S13's accounting (`kv.check()`: the cache map, the cache entries
   kept only for requests holding blocks), and ref_cnt == the number of block tables holding
   the block (`check_block_manager`). At teardown everything drains, no block is held (cached
   free blocks may remain), and every request not aborted has the fake model's tokens for it
   alone.
2. The same workloads with the hash forced to one constant (every block collides): the same
   outputs and the same hits (the cache key, not the hash, decides a hit).
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import s13_prefix_caching as s13
from s01_generation_loop import ParameterError
from s09_scheduler import Request
from s10_scheduler import POLICIES
from scheduler_testing import (PagedFakeModel, abort_drawn, alone_tokens, check_block_manager,
                               chunked_scheduler)

MAX_MODEL_LEN = 40
PREFIXES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5]]


def prompt_from(prefix: int, suffix: list[int]) -> list[int]:
    return (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix


def prefix_cached_model(max_num_seqs, budget, num_blocks, block_size, policy="fcfs",
                        threshold=0) -> PagedFakeModel:
    kv = s13.PrefixCachingKVCacheManager(num_blocks, block_size)
    return PagedFakeModel(chunked_scheduler(kv, max_num_seqs, budget, MAX_MODEL_LEN, policy,
                                            threshold), MAX_MODEL_LEN)


class CacheMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 40),
                threshold=st.sampled_from([0, 0, 3, 7]), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(6, 40), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, threshold, block_size, num_blocks, policy):
        self.model = prefix_cached_model(max_num_seqs, max_num_seqs + extra_budget, num_blocks,
                                         block_size, policy, threshold)
        self.aborted: set[str] = set()
        self.count = 0

    @property
    def s(self):
        return self.model.scheduler

    @rule(prefix=st.integers(0, len(PREFIXES)), suffix=st.lists(st.integers(0, 96), max_size=8),
          max_tokens=st.integers(1, 8), salt=st.sampled_from([None, None, "a", "b"]),
          priority=st.integers(-1, 1))
    def add(self, prefix, suffix, max_tokens, salt, priority):
        prompt = prompt_from(prefix, suffix) or [7]
        req = Request.for_tokens(str(self.count), prompt, max_tokens, priority=priority,
                                 cache_salt=salt)
        if len(prompt) > self.s.kv_capacity:      # G1: refused
            with pytest.raises(ParameterError, match="could never be scheduled"):
                self.model.add(req)
            return
        self.model.add(req)
        self.count += 1

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def abort(self, data):
        abort_drawn(self, data)

    @rule()
    def step(self):
        self.model.step()

    @invariant()
    def accounting(self):
        if hasattr(self, "model"):
            check_block_manager(self.s)

    def teardown(self):
        if not hasattr(self, "model"):
            return
        steps, limit = 0, sum(r.num_tokens + r.params.max_tokens + 2
                              for r in self.model.by_id.values())
        while self.s.has_unfinished_requests():
            self.model.step()
            steps += 1
            assert steps <= limit, "the scheduler does not drain"
        kv = self.s.kv
        assert not kv.req_blocks and kv.num_free_blocks == kv.pool.num_usable_blocks   # G5
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:]) and not kv.req_entries
        for rid, req in self.model.by_id.items():
            want = alone_tokens(req.prompt_ids, req.params.max_tokens, MAX_MODEL_LEN)
            if rid in self.aborted:
                assert req.output_ids == want[:len(req.output_ids)], rid
                continue
            room = self.s.kv_capacity - len(req.prompt_ids) + 1
            assert req.output_ids == want[:min(len(want), room)], rid


CacheMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_state_machine = CacheMachine.TestCase


def run_workload(requests, block_size, num_blocks, budget):
    model = prefix_cached_model(3, budget, num_blocks, block_size)
    for k, (prompt, max_tokens, salt, arrive) in enumerate(requests):
        for _ in range(arrive):
            if model.scheduler.has_unfinished_requests():
                model.step()
        model.add(Request.for_tokens(str(k), prompt, max_tokens, cache_salt=salt))
    for _ in range(10_000):
        if not model.scheduler.has_unfinished_requests():
            break
        model.step()
    return ({rid: r.output_ids for rid, r in model.by_id.items()},
            vars(model.scheduler.kv.stats).copy())


workloads = st.lists(st.tuples(
    st.builds(prompt_from, st.integers(0, len(PREFIXES)), st.lists(st.integers(0, 96),
                                                                    min_size=1, max_size=6)),
    st.integers(1, 6), st.sampled_from([None, None, "a"]), st.integers(0, 3)),
    min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(requests=workloads, block_size=st.sampled_from([1, 2, 4]),
       num_blocks=st.integers(26, 60), budget=st.integers(3, 24))
def test_a_constant_hash_changes_no_output_and_no_hit(requests, block_size, num_blocks,
                                                      budget):
    """Every block colliding with every other (one hash for all) may cost hits, never give a
    wrong one: the cache key (parent entry, tokens, salt) decides. Here it costs none either,
    since the key holds everything the hash was made of."""
    real = run_workload(requests, block_size, num_blocks, budget)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(s13, "hash_block_tokens", lambda parent, tokens, extra=(): b"\0" * 32)
        collided = run_workload(requests, block_size, num_blocks, budget)
    assert collided == real
    for (prompt, max_tokens, _, _), (rid, out) in zip(requests, sorted(
            real[0].items(), key=lambda kv: int(kv[0]))):
        assert out == alone_tokens(prompt, max_tokens, MAX_MODEL_LEN)
