"""Property tests for chapter S13's prefix caching (hypothesis), model-free.

The oracle is a fake paged model (`PagedFakeModel`) that keeps what each pool slot holds: the
whole token prefix up to and including that position, and the salt of the request that wrote
it (a real key/value vector depends on every token before it, so the prefix stands for it).
In every step, for every scheduled request, it checks that each position it reads (those
before its start, through its block table, cached hits included) holds exactly its own
prefix and was written under its own salt, and that each position it writes is in a block
only it holds and that has no name (a shared or cached block is never written). Its next
token is a fixed function of the context (tests/test_s10_scheduler.py's `next_token`), so a
wrong hit changes the outputs too.

1. A state machine over add (prompts built from a few shared prefixes, optional salts) /
   abort / step, on small pools (evictions and preemptions happen), with chunked prefill;
   after every rule S12's and S13's accounting (`check`), and ref_cnt == the number of block
   tables holding the block. At teardown everything drains, no block is held (cached free
   blocks may remain), and every request not aborted has the fake model's tokens for it alone.
2. The same workloads with the hash forced to one constant (every block collides): the same
   outputs and the same hits (the cache key, not the hash, decides a hit).
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import s13_prefix_caching as s13
from s10_scheduler import POLICIES
from s13_prefix_caching import PrefixCachingScheduler
from test_s10_scheduler import next_token

MAX_MODEL_LEN = 40
PREFIXES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5]]


class Req:
    """A stand-in request with the prompt it is given (S10's has a prompt from its length)."""

    def __init__(self, request_id, prompt, max_tokens, cache_salt=None):
        self.request_id, self.prompt_ids = request_id, list(prompt)
        self.token_ids, self.output_ids = list(prompt), []
        self.num_computed_tokens, self.max_tokens, self.cache_salt = 0, max_tokens, cache_salt


def alone(prompt, max_tokens, max_model_len=MAX_MODEL_LEN):
    """The fake model's tokens for one request with all the room it wants."""
    ids, out = list(prompt), []
    while len(out) < max_tokens and len(ids) < max_model_len:
        ids.append(next_token(ids))
        out.append(ids[-1])
    return out


class PagedFakeModel:
    """Runs a PrefixCachingSchedulerOutput against a fake pool of slots (see the docstring)."""

    def __init__(self, scheduler: PrefixCachingScheduler):
        self.scheduler = scheduler
        self.slots: dict[int, tuple] = {}
        self.by_id: dict[str, Req] = {}
        self.ended: dict[str, str] = {}

    def add(self, req, priority=0):
        self.scheduler.add_request(req, priority)
        self.by_id[req.request_id] = req

    def step(self):
        s = self.scheduler
        out = s.schedule()
        size, pool = out.block_size, s.kv.pool
        for rid in out.finished_ids:
            self.ended[rid] = "length"
        finished = []
        for rid, n in out.num_scheduled_tokens.items():
            req, start, table = self.by_id[rid], out.num_computed_tokens[rid], \
                out.block_tables[rid]
            assert start == req.num_computed_tokens and n >= 1
            assert len(table) == -(-(start + n) // size)
            for p in range(start):              # what it reads, cached hits included
                held = self.slots.get(table[p // size] * size + p % size)
                assert held == (tuple(req.token_ids[:p + 1]), req.cache_salt), \
                    f"request {rid} reads wrong KV at position {p}"
            for p in range(start, start + n):   # what it writes: its own, unnamed blocks
                block = pool.blocks[table[p // size]]
                assert block.ref_cnt == 1 and block.block_hash is None, \
                    f"request {rid} writes position {p} into a shared or cached block"
                self.slots[block.block_id * size + p % size] = (tuple(req.token_ids[:p + 1]),
                                                                 req.cache_salt)
            if start + n == len(req.token_ids):
                token = next_token(req.token_ids)
                req.token_ids.append(token)
                req.output_ids.append(token)
                if (len(req.output_ids) >= req.max_tokens
                        or len(req.token_ids) >= s.max_model_len):
                    finished.append(rid)
                    self.ended[rid] = "stop"
        s.update_from_output(out, finished)
        check(s)
        return out


def check(s: PrefixCachingScheduler) -> None:
    s.check()          # S12's accounting, the cache map, block hashes kept only while queued
    holders: dict[int, int] = {}
    for blocks in s.kv.req_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for block in s.kv.pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block.block_id
    for r in s.running:
        assert s.kv.num_tokens(r.request_id) == r.num_computed_tokens
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and r.request_id not in s.kv.req_blocks
    stats = s.stats
    assert 0 <= stats.hits <= stats.queries and stats.hit_requests <= stats.requests


def prompt_from(prefix: int, suffix: list[int]) -> list[int]:
    return (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix


class CacheMachine(RuleBasedStateMachine):
    @initialize(max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 40),
                threshold=st.sampled_from([0, 0, 3, 7]), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(6, 40), policy=st.sampled_from(POLICIES))
    def build(self, max_num_seqs, extra_budget, threshold, block_size, num_blocks, policy):
        self.model = PagedFakeModel(PrefixCachingScheduler(
            max_num_seqs, max_num_seqs + extra_budget, num_blocks, block_size, MAX_MODEL_LEN,
            policy, threshold))
        self.aborted: set[str] = set()
        self.count = 0

    @property
    def s(self) -> PrefixCachingScheduler:
        return self.model.scheduler

    @rule(prefix=st.integers(0, len(PREFIXES)), suffix=st.lists(st.integers(0, 96), max_size=8),
          max_tokens=st.integers(1, 8), salt=st.sampled_from([None, None, "a", "b"]),
          priority=st.integers(-1, 1))
    def add(self, prefix, suffix, max_tokens, salt, priority):
        prompt = prompt_from(prefix, suffix) or [7]
        req = Req(str(self.count), prompt, max_tokens, salt)
        if len(prompt) > self.s.kv_capacity:      # G1: refused
            with pytest.raises(ValueError, match="could never be scheduled"):
                self.s.add_request(req, priority)
            return
        self.model.add(req, priority)
        self.count += 1

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def abort(self, data):
        rid = str(data.draw(st.integers(0, self.count - 1)))
        held = any(r.request_id == rid for r in (*self.s.running, *self.s.waiting))
        assert self.s.abort(rid) is held
        if held:
            self.aborted.add(rid)

    @rule()
    def step(self):
        self.model.step()

    @invariant()
    def accounting(self):
        if hasattr(self, "model"):
            check(self.s)

    def teardown(self):
        if not hasattr(self, "model"):
            return
        steps, limit = 0, sum(len(r.token_ids) + r.max_tokens + 2
                              for r in self.model.by_id.values())
        while self.s.has_unfinished_requests():
            self.model.step()
            steps += 1
            assert steps <= limit, "the scheduler does not drain"
        kv = self.s.kv
        assert not kv.req_blocks and kv.num_free_blocks == kv.pool.num_usable_blocks   # G5
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])
        for rid, req in self.model.by_id.items():
            want = alone(req.prompt_ids, req.max_tokens)
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
    model = PagedFakeModel(PrefixCachingScheduler(3, budget, num_blocks, block_size,
                                                  MAX_MODEL_LEN))
    for k, (prompt, max_tokens, salt, arrive) in enumerate(requests):
        for _ in range(arrive):
            if model.scheduler.has_unfinished_requests():
                model.step()
        model.add(Req(str(k), prompt, max_tokens, salt))
    for _ in range(10_000):
        if not model.scheduler.has_unfinished_requests():
            break
        model.step()
    return ({rid: r.output_ids for rid, r in model.by_id.items()},
            vars(model.scheduler.stats).copy())


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
        assert out == alone(prompt, max_tokens)
