"""Tests for chapter S13, prefix caching (code/s13_prefix_caching.py).

Oracles: the byte encoding and the chain written out by hand (hashlib's SHA-256 of those
bytes); a hit/miss/eviction sequence worked out by hand in the comments; S05 alone and HF
`generate` alone (greedy ids, tests/engine_testing.py's tiny_references); the engine with the
cache off (seeded runs; logits of the first token); closed forms (after everything is done,
free blocks == usable blocks). The model-free tests run S13's manager under S11's scheduler
with tests/scheduler_testing.py's `PagedFakeModel`, which checks every KV position a request
reads; tests/test_s13_properties.py holds the state machine and the forced-collision run.

The engine is S09's, built by `s13.build_engine`; hits, reference counts and the pool's
changes are read from S09's `StepTracer`, S12's `BlockTracer` and S13's `CacheTracer`, logits
from a `LogitsRecorder` around the runner (tests/engine_testing.py).

Public bug reports (../shared/cases/public-bugs.md, section (h) and (g)), each a test below:
H1 vllm #5543 (completions with prefix caching differ from without, and between runs of the
same server: "dirty cache"), H2 vllm #40896 (the first request, a miss, differs from later
identical ones, hits, at temperature 0), H3 tenstorrent/vllm #415 (a hit returns corrupted KV:
a prefill resuming at num_computed_tokens = k > 0 must give the logits of a full prefill),
G5 sglang PR #2238 / PR #1674 / #6778 (idle means free + evictable cached == total).
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import s12_engine
import s13_prefix_caching as s13
from engine_testing import LogitsRecorder, drive, greedy, tiny_fixture
from model_testing import V, IdTokenizer
from s01_generation_loop import ParameterError
from s04_sampling import SamplingParams
from s08_batch_variance import BATCH_TOLERANCE
from s09_scheduler import Request
from s09_trace import trace
from s12_paged_attention import KVCacheManager
from s13_prefix_caching import (ROOT_HASH, PrefixCachingKVCacheManager, encode_block,
                                hash_block_tokens, hash_request_tokens)
from scheduler_testing import (PagedFakeModel, alone_tokens, check_block_manager,
                               chunked_scheduler)

CODE = Path(__file__).resolve().parents[1] / "code"
CONTEXT = 96
NEW = 6
BLOCK = 8
rng = np.random.default_rng(1300)
SYSTEM = rng.integers(2, V, size=40).tolist()            # 5 full blocks of 8
PROMPTS = [SYSTEM + rng.integers(2, V, size=n).tolist() for n in (3, 9, 17)] + [
    SYSTEM,                                              # all its blocks cached: cap at 39
    rng.integers(2, V, size=21).tolist()]                # shares nothing


# (name, HF model, S06 model, {prompt index: (S05 alone, HF alone)}) for a tiny random Qwen3.
tiny = tiny_fixture("s13", ["qwen3_gqa_tied"], PROMPTS, CONTEXT, NEW)


def build(model, max_num_seqs=3, **options):
    """S13's engine on a tiny model (IdTokenizer, context CONTEXT, blocks of BLOCK unless
    given), the pool's events kept."""
    options.setdefault("block_size", BLOCK)
    return s13.build_engine(model, IdTokenizer(), max_context=CONTEXT,
                            max_num_seqs=max_num_seqs, enable_kv_cache_events=True, **options)


def model_free(max_num_seqs, budget, num_blocks, block_size, max_model_len=64, events=False):
    """S13's manager under S11's scheduler, run by the fake model that checks every read."""
    kv = PrefixCachingKVCacheManager(num_blocks, block_size, enable_kv_cache_events=events)
    return PagedFakeModel(chunked_scheduler(kv, max_num_seqs, budget, max_model_len),
                          max_model_len)


# --- the hash chain -----------------------------------------------------------------------------

def test_the_encoding_is_the_fixed_width_layout_written_by_hand():
    parent = bytes(range(32))
    want = (parent + b"\x02\x00\x00\x00"                           # 2 tokens, uint32 LE
            + b"\x05\x00\x00\x00\x00\x00\x00\x00" + b"\xff" * 8   # 5 and -1, int64 LE
            + b"\x01\x00\x00\x00"                                  # 1 extra key
            + b"\x04\x00\x00\x00" + b"ab\xc3\xa9")                 # its UTF-8 length, bytes
    assert encode_block(parent, [5, -1], ("abé",)) == want
    assert hash_block_tokens(parent, [5, -1], ("abé",)) == hashlib.sha256(want).digest()


def test_the_encoding_keeps_different_inputs_apart():
    # Joining keys or tokens without lengths would make these pairs the same bytes.
    assert encode_block(ROOT_HASH, [1], ("ab",)) != encode_block(ROOT_HASH, [1], ("a", "b"))
    assert encode_block(ROOT_HASH, [1, 2], ()) != encode_block(ROOT_HASH, [1], ("\x02",))
    assert encode_block(ROOT_HASH, [258], ()) != encode_block(ROOT_HASH, [2, 1], ())
    with pytest.raises(ValueError, match="32 bytes"):
        encode_block(b"short", [1])
    with pytest.raises(ValueError, match="token ids must be ints"):
        encode_block(ROOT_HASH, [1.0])
    for bad in (2 ** 63, -2 ** 63 - 1):                           # one past each int64 end
        with pytest.raises(ValueError, match="token ids must be ints in the int64 range"):
            hash_request_tokens([bad] * 4, 4)
    assert len(encode_block(ROOT_HASH, [2 ** 63 - 1, -2 ** 63])) == 32 + 4 + 16 + 4
    with pytest.raises(ValueError, match="extra keys must be strings"):
        encode_block(ROOT_HASH, [1], (3,))


def test_the_chain_names_only_full_blocks_and_each_name_depends_on_all_before_it():
    ids = list(range(10, 30))                                     # 20 tokens: 2 full blocks of 8
    hashes = hash_request_tokens(ids, BLOCK)
    h0 = hashlib.sha256(encode_block(ROOT_HASH, ids[:8])).digest()
    h1 = hashlib.sha256(encode_block(h0, ids[8:16])).digest()
    assert hashes == [h0, h1]
    changed = hash_request_tokens([99] + ids[1:], BLOCK)          # first token only
    assert changed[0] != h0 and changed[1] != h1                  # block 1's tokens are equal
    assert hash_request_tokens(ids, BLOCK, known=[h0]) == hashes
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        hash_request_tokens(ids, 0)
    # the manager names a request's blocks with the same chain, kept on the request
    request = Request.for_tokens("r", ids, 2)
    assert PrefixCachingKVCacheManager(4, BLOCK).block_hashes(request) == hashes
    assert request.block_hashes == hashes


def test_the_cache_salt_is_in_the_first_block_and_so_in_every_name():
    ids = list(range(16))
    plain, a, b = (hash_request_tokens(ids, BLOCK, salt) for salt in (None, "a", "b"))
    assert a[0] == hashlib.sha256(encode_block(ROOT_HASH, ids[:8], ("a",))).digest()
    assert a[1] == hashlib.sha256(encode_block(a[0], ids[8:])).digest()     # no key of its own
    assert len({plain[0], a[0], b[0]}) == 3 and len({plain[1], a[1], b[1]}) == 3
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string or None"):
        hash_request_tokens(ids, BLOCK, "")


def test_names_are_the_same_in_every_process_whatever_pythonhashseed():
    # Python's hash() of a str changes with PYTHONHASHSEED; SHA-256 of the bytes does not.
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import s13_prefix_caching as s; "
              "print(s.hash_request_tokens(list(range(20)), 4, 'salt')[-1].hex(), "
              "hash('salt'))")
    seen = []
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", script, str(CODE)], capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        seen.append(out.stdout.split())
    assert seen[0][0] == seen[1][0] == hash_request_tokens(list(range(20)), 4, "salt")[-1].hex()
    assert seen[0][1] != seen[1][1]          # the seed did change Python's own hash


# --- what the engine refuses, and what the manager forgets -----------------------------------

def test_bad_inputs_are_refused_before_anything_is_queued(tiny):
    _, _, model, _ = tiny
    lone_surrogate = json.loads('"\\ud800"')           # what a JSON client can send
    engine = build(model)
    with pytest.raises(ParameterError, match="cache_salt must be valid Unicode without lone surrogates") as err:
        engine.add_request(PROMPTS[0], greedy(), cache_salt=lone_surrogate)
    assert err.value.parameter == "cache_salt"
    with pytest.raises(ParameterError, match=r"prompt token ids must lie in \[0, V=97\)"):
        engine.add_request([1, 2, 3, 2 ** 63], greedy())
    assert not engine.requests and not engine.scheduler.has_unfinished_requests()
    assert not engine.scheduler.kv.stats.requests
    with pytest.raises(ParameterError, match="cache_salt must be valid Unicode without lone surrogates"):
        Request.for_tokens("a", [1, 2, 3, 4, 5], 2, cache_salt=lone_surrogate)
    for flag in ("false", 0, 1):
        with pytest.raises(ParameterError, match="enable_prefix_caching must be None, True or "
                                                 "False") as err:
            build(model, enable_prefix_caching=flag)
        assert err.value.parameter == "enable_prefix_caching"


def test_a_request_that_outgrew_the_pool_leaves_no_block_hashes_behind():
    # 5 blocks of 2 (4 usable, 8 tokens). x's prompt fits (6 tokens); at its 9th token it
    # outgrows the pool and S10's capacity rule ends it. A new request reusing the id "x"
    # with another prompt must name its blocks by its own tokens (its hashes live on the
    # new Request): then y, with that prompt, finds its first (5 - 1) // 2 = 2 blocks cached.
    model = model_free(2, 16, 5, 2, max_model_len=40)
    s = model.scheduler
    model.add(Request.for_tokens("x", [1, 2, 3, 4, 5, 6], 10))
    while s.has_unfinished_requests():
        model.step()
    assert model.ended["x"] == "length" and "x" not in s.kv.req_entries
    del model.ended["x"]                         # the id is free again
    model.add(Request.for_tokens("x", [9, 8, 7, 6, 5], 2))
    while s.has_unfinished_requests():
        model.step()
    y = model.add(Request.for_tokens("y", [9, 8, 7, 6, 5], 2))
    plan = model.step()
    assert plan.scheduled_new_ids == ("y",) and plan.num_computed_tokens == {"y": 4}
    assert y.num_cached_tokens == 4


def test_check_finds_cache_entries_kept_for_a_request_that_left():
    model = model_free(2, 16, 10, 2, max_model_len=40)
    s, kv = model.scheduler, model.scheduler.kv
    a = model.add(Request.for_tokens("a", [1, 2, 3, 4, 5], 3))
    model.step()
    kv.check()
    kept = list(kv.req_entries["a"])
    assert kept and s.finish_requests(["a"]) == ["a"]
    kv.check()
    assert "a" not in kv.req_entries and a.block_hashes
    kv.req_entries["a"] = kept                  # as if a leaving path had forgotten it
    with pytest.raises(AssertionError, match="cache entries kept for 'a', which holds no KV"):
        kv.check()
    del kv.req_entries["a"]
    model.add(Request.for_tokens("b", [1, 2, 3, 4, 5], 3))
    model.step()
    kv.req_entries["b"].append(99)              # more entries than full blocks held
    with pytest.raises(AssertionError, match="'b' keeps more cache entries than it holds"):
        kv.check()


# --- a hand-worked example, model-free ------------------------------------------------------

def test_hits_misses_and_lru_evictions_of_a_hand_worked_example():
    """block_size 4, 9 blocks (block 0 null, 1..8 usable; free queue 1..8). Each request runs
    alone to its one token. Worked out by hand (front of the free queue on the left):
    A [0..9]: no hit; blocks 1,2,3; blocks 1 ([0..3]) and 2 ([4..7]) full and cached; freed
        last first: queue 4,5,6,7,8,3,2,1.                     hits 0 of 10
    B [0..7,20,21,22]: cap (11-1)//4 = 2 blocks: 1, 2 hit (out of the queue); 1 new block,
        the front: 4; freed 4,2,1: queue 5,6,7,8,3,4,2,1.       hits 8 of 11
    C [0..7]: a full-prompt match, capped at (8-1)//4 = 1 block: 1 hits; new block 5 computes
        [4..7] (block 2 holds that already, so 5 stays unnamed); queue 6,7,8,3,4,2,5,1.
                                                                hits 4 of 8
    D [0..9] salt "x": block 0's name has the salt: no hit; blocks 6,7,8, 6 and 7 cached
        (salted); queue 3,4,2,5,1,8,7,6.                        hits 0 of 10
    E [100..115]: no hit; 4 blocks from the front: 3,4,2,5, and 2 was cached: EVICTED;
        all four full and cached; queue 1,8,7,6,5,2,4,3.        hits 0 of 16
    F = B again: block 1 hits; block 2 no longer holds [4..7] (evicted, reused by E): miss,
        so an evicted block never hits.                         hits 4 of 11
    In all: 6 requests, 3 with a hit, 66 tokens asked, 16 found."""
    model = model_free(4, 64, 9, 4, events=True)
    s = model.scheduler
    runs = [("A", list(range(10)), None), ("B", list(range(8)) + [20, 21, 22], None),
            ("C", list(range(8)), None), ("D", list(range(10)), "x"),
            ("E", list(range(100, 116)), None), ("F", list(range(8)) + [20, 21, 22], None)]
    seen = {}
    for rid, prompt, salt in runs:
        request = model.add(Request.for_tokens(rid, prompt, 1, cache_salt=salt))
        out = model.step()
        assert not s.has_unfinished_requests()
        events = s.kv.take_events()              # the step's: hit, evicted, allocated, ...
        seen[rid] = (out.num_computed_tokens[rid], out.block_tables[rid],
                     [e for e in events if e[1] == rid],
                     s.kv.pool.free_block_queue.block_ids())
        assert request.num_cached_tokens == out.num_computed_tokens[rid]
    assert seen["A"] == (0, (1, 2, 3), [("allocated", "A", (1, 2, 3)), ("cached", "A", (1, 2)),
                                        ("freed", "A", (3, 2, 1))], [4, 5, 6, 7, 8, 3, 2, 1])
    assert seen["B"] == (8, (1, 2, 4), [("hit", "B", (1, 2)), ("allocated", "B", (4,)),
                                        ("freed", "B", (4, 2, 1))], [5, 6, 7, 8, 3, 4, 2, 1])
    assert seen["C"] == (4, (1, 5), [("hit", "C", (1,)), ("allocated", "C", (5,)),
                                     ("freed", "C", (5, 1))], [6, 7, 8, 3, 4, 2, 5, 1])
    assert seen["D"] == (0, (6, 7, 8), [("allocated", "D", (6, 7, 8)), ("cached", "D", (6, 7)),
                                        ("freed", "D", (8, 7, 6))], [3, 4, 2, 5, 1, 8, 7, 6])
    assert seen["E"] == (0, (3, 4, 2, 5), [("evicted", "E", (2,)),
                                           ("allocated", "E", (3, 4, 2, 5)),
                                           ("cached", "E", (3, 4, 2, 5)),
                                           ("freed", "E", (5, 2, 4, 3))],
                         [1, 8, 7, 6, 5, 2, 4, 3])
    assert seen["F"][0] == 4 and seen["F"][1][0] == 1 and seen["F"][1][1] != 2
    st = s.kv.stats
    assert (st.requests, st.hit_requests, st.queries, st.hits) == (6, 3, 66, 16)
    assert st.hit_rate == 16 / 66 and st.request_hit_rate == 0.5
    # Idle: nothing held, yet cached blocks remain in the free queue: the cache, not a leak.
    assert s.kv.num_free_blocks == 8 and s.kv.pool.num_cached_free_blocks > 0
    cached = s.kv.pool.num_cached_blocks
    assert s.kv.reset_prefix_cache() == cached and s.kv.pool.num_cached_blocks == 0


def test_two_requests_share_blocks_with_ref_counts_and_the_last_one_frees_them():
    # Hand-worked: block_size 4. A (12 tokens) runs a step: blocks 1, 2, 3 cached once
    # computed (12 // 4 = 3 full). B shares A's first 8 tokens: hits 1, 2 (ref_cnt 2 each).
    model = model_free(4, 64, 20, 4)
    s, pool = model.scheduler, model.scheduler.kv.pool
    model.add(Request.for_tokens("A", list(range(12)), 5))
    model.step()
    model.add(Request.for_tokens("B", list(range(8)) + [50, 51, 52], 5))
    out = model.step()
    assert out.scheduled_new_ids == ("B",) and out.num_computed_tokens["B"] == 8
    assert [pool.blocks[b].ref_cnt for b in (1, 2, 3)] == [2, 2, 1]
    s.finish_requests(["A"])
    assert [pool.blocks[b].ref_cnt for b in (1, 2, 3)] == [1, 1, 0]
    assert 3 in pool.free_block_queue.block_ids()                # freed but still named
    s.finish_requests(["B"])
    assert s.kv.num_free_blocks == pool.num_usable_blocks
    assert {1, 2, 3} <= set(b.block_id for b in pool.blocks if b.block_hash)


def test_preemption_resumes_from_its_own_cached_blocks():
    # Worked out by hand: 8 blocks of 2 (7 usable). A (8 tokens, 4 blocks) and B (4 tokens,
    # 2 blocks) prefill; 1 block free. Next step A's 9th token takes it; B's 5th needs a 3rd
    # block, none is free: B, the tail, is preempted, its blocks freed last first (queue: B's
    # [42,43], B's [40,41]). A's 11th token takes the front, evicting [42,43]. When A is done
    # B resumes with 5 tokens, capped at (5 - 1) // 2 = 2 blocks: [40,41] still cached (a hit
    # of 2 tokens), [42,43] evicted (a miss).
    model = model_free(2, 16, 8, 2)
    s = model.scheduler
    model.add(Request.for_tokens("A", list(range(8)), 4))
    b = model.add(Request.for_tokens("B", [40, 41, 42, 43], 8))
    resumed = []
    while s.has_unfinished_requests():
        out = model.step()
        resumed += [(rid, out.num_computed_tokens[rid]) for rid in out.scheduled_resumed_ids]
    assert s.num_preemptions == 1 and resumed == [("B", 2)]
    assert b.num_cached_tokens == 0              # its hit at first admission; resumes aside
    assert model.by_id["B"].output_ids == alone_tokens([40, 41, 42, 43], 8, 64)
    assert model.by_id["A"].output_ids == alone_tokens(list(range(8)), 4, 64)


# --- the engine on a tiny random model -----------------------------------------------------

def run_engine(engine, prompts, params, every=1, salts=None, hits=None):
    """Add one prompt every `every` steps (0: all first); step until done (`drive`). After
    every step: the manager's accounting and every block's ref_cnt == the block tables
    holding it (`check_block_manager`), the same from the traced plan, and each output's
    num_cached_tokens == its request's hit at first admission. At the end nothing is held
    (G5). Returns the tokens by prompt index; hits, if a list, gets every admission's
    (request id, cached tokens, tokens in all) (the `CacheRecord`s' cache_hits)."""
    caching = isinstance(engine.scheduler.kv, PrefixCachingKVCacheManager)
    steps = trace(engine)
    cache = s13.trace_cache(engine) if caching else None     # the cache off: no hit ever
    first_hits = {}
    seen = [0]

    def check(engine, call, outputs):
        check_block_manager(engine.scheduler)
        if cache is not None and len(steps.records) > seen[0]:
            seen[0] = len(steps.records)
            r, c = steps.records[-1], cache.records[-1]
            assert r.step == c.step
            for table, refs in zip(r.block_tables, c.ref_cnts):
                for block, ref in zip(table, refs):   # held by exactly the tables holding it
                    assert ref == sum(block in t for t in r.block_tables)
            first_hits.update((rid, n) for rid, n, _ in c.cache_hits if rid in r.joined)
        for o in outputs:
            assert o.num_cached_tokens == first_hits.get(o.request_id, 0), o

    requests = [(p, params, {"cache_salt": (salts or {}).get(k)}) for k, p in enumerate(prompts)]
    outputs, _ = drive(engine, requests, [k * every for k in range(len(prompts))], check=check)
    kv = engine.scheduler.kv
    assert not kv.req_blocks and kv.num_free_blocks == kv.pool.num_usable_blocks  # G5
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])
    engine.observers.remove(steps)
    if cache is not None:
        engine.observers.remove(cache)
    if hits is not None and cache is not None:
        hits += [h for c in cache.records for h in c.cache_hits]
    return {k: [t for o in outs for t in o.new_token_ids] for k, outs in outputs.items()}


CONFIGS = {"sequential": dict(), "chunked": dict(max_num_batched_tokens=8),
           "preempting": dict(num_blocks=11, max_num_batched_tokens=32)}


@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_with_the_cache_equals_s05_and_hf_alone(tiny, config):
    _, _, model, references = tiny
    engine = build(model, **CONFIGS[config])
    got = run_engine(engine, PROMPTS, greedy(NEW))
    for k, (s05_alone, hf_alone) in references.items():
        assert got[k] == s05_alone.token_ids == hf_alone, (config, k)
    stats = engine.scheduler.kv.stats
    assert stats.hits >= 3 * 40 - BLOCK or config == "preempting"
    assert stats.hits > 0
    if config == "preempting":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("config", CONFIGS)
def test_seeded_outputs_are_the_same_with_the_cache_on_and_off(tiny, config):
    """Seeded sampling with logprobs, the cache on and off: the same tokens, and logprobs
    within S08's BATCH_TOLERANCE (a prefill that starts after a hit is a different matmul
    shape, so not bitwise)."""
    _, _, model, _ = tiny
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=NEW, seed=13, logprobs=2)
    on = build(model, **CONFIGS[config])
    off = build(model, enable_prefix_caching=False, **CONFIGS[config])
    assert isinstance(on.scheduler.kv, PrefixCachingKVCacheManager)
    assert type(off.scheduler.kv) is KVCacheManager
    on_recorder = LogprobsRecorder(on)
    off_recorder = LogprobsRecorder(off)
    assert run_engine(on, PROMPTS, params) == run_engine(off, PROMPTS, params)
    assert on.scheduler.kv.stats.hits > 0
    tol = BATCH_TOLERANCE[torch.float32]
    assert on_recorder.logprobs.keys() == off_recorder.logprobs.keys()
    for rid, entries in on_recorder.logprobs.items():
        for a, b in zip(entries, off_recorder.logprobs[rid], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < tol
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            assert all(abs(x - y) < tol for (_, x), (_, y) in zip(a.top_logprobs,
                                                                   b.top_logprobs))


class LogprobsRecorder:
    """An observer keeping the logprobs entries of every output, per request id."""

    def __init__(self, engine):
        self.logprobs: dict[str, list] = {}
        engine.observers.append(self)

    def on_plan(self, engine, plan):
        pass

    def on_step(self, engine, result):
        for o in result.outputs:
            self.logprobs.setdefault(o.request_id, []).extend(o.logprobs or [])


def test_h1_vllm_5543_outputs_equal_without_the_cache_in_every_run(tiny):
    """vllm #5543: completions differed with and without prefix caching, and between runs of
    the caching server. One engine, the same prompts twice (the second run finds a warm,
    dirty cache): every completion equals the cache-off one."""
    _, _, model, _ = tiny
    off = run_engine(build(model, enable_prefix_caching=False), PROMPTS, greedy(NEW), every=0)
    engine = build(model)
    first = run_engine(engine, PROMPTS, greedy(NEW), every=0)
    hits_first = engine.scheduler.kv.stats.hits
    second = run_engine(engine, PROMPTS, greedy(NEW), every=0)
    assert first == second == off
    assert engine.scheduler.kv.stats.hits - hits_first > hits_first  # the second run hits more


def test_h2_vllm_40896_first_and_repeated_identical_requests_agree(tiny):
    """vllm #40896: at temperature 0 the first request (a miss) and later identical ones
    (hits) differed. The same prompt three times, one after the other: all equal, equal to
    S05 alone, and the later ones were hits (capped one block short of the 43 tokens)."""
    _, _, model, references = tiny
    engine = build(model)
    outs, hits = [], []
    for _ in range(3):
        outs.append(run_engine(engine, [PROMPTS[0]], greedy(NEW), hits=hits)[0])
    assert outs[0] == outs[1] == outs[2] == references[0][0].token_ids
    assert [n for _, n, _ in hits] == [0, 40, 40] and all(t == 43 for _, _, t in hits)


@pytest.mark.parametrize("case", ["same prompt twice", "shared system prompt"])
def test_h3_tenstorrent_vllm_415_a_hit_gives_the_logits_of_a_full_prefill(tiny, case):
    """tenstorrent/vllm #415: hits returned corrupted KV (the prefill resuming at
    num_computed_tokens = k > 0). The first-token logits of a request that found k cached
    tokens equal those of the same prompt prefilled whole (cache off), within S08's
    BATCH_TOLERANCE (a chunk is a different matmul shape, so not bitwise), and so do the
    logits of every later step."""
    _, _, model, _ = tiny
    warm, probe = (PROMPTS[0], PROMPTS[0]) if case == "same prompt twice" else (PROMPTS[0],
                                                                                PROMPTS[2])
    on = build(model)
    on.runner = LogitsRecorder(on.runner)
    run_engine(on, [warm], greedy(NEW))
    on.runner.logits.clear()
    hits = []
    run_engine(on, [probe], greedy(NEW), hits=hits)
    (hit,) = hits
    assert hit[1] == 40                                      # k = 40 cached tokens
    off = build(model, enable_prefix_caching=False)
    off.runner = LogitsRecorder(off.runner)
    run_engine(off, [probe], greedy(NEW))
    (hit_rows,) = on.runner.logits.values()
    (miss_rows,) = off.runner.logits.values()
    assert len(hit_rows) == len(miss_rows) == NEW
    tol = BATCH_TOLERANCE[torch.float32]
    for a, b in zip(hit_rows, miss_rows):
        assert float((a - b).abs().max()) < tol


def test_cache_salt_isolates_requests(tiny):
    _, _, model, _ = tiny
    engine = build(model)
    hits = []
    run_engine(engine, [PROMPTS[0]] * 4, greedy(NEW), salts={0: "u1", 1: "u2", 2: "u1"},
               hits=hits)
    assert [n for _, n, _ in hits] == [0, 0, 40, 0]       # u1 miss, u2 miss, u1 hit, no salt: miss
    with pytest.raises(ParameterError, match="cache_salt must be a non-empty string or None"):
        engine.add_request(PROMPTS[0], greedy(), cache_salt="")
    with pytest.raises(ParameterError, match="cache_salt must be valid Unicode without lone surrogates"):
        engine.add_request(PROMPTS[0], greedy(), cache_salt=json.loads('"\\ud800"'))
    assert not engine.has_unfinished_requests()        # nothing queued, the next step runs
    assert engine.step() == []


def test_g5_aborts_while_waiting_running_and_mid_chunk_leave_nothing_held(tiny):
    """sglang PR #2238 / #1674 / #6778: once idle, free + evictable cached == total."""
    _, _, model, _ = tiny
    engine = build(model, 2, max_num_batched_tokens=8)
    ids = [engine.add_request(p, greedy(NEW)) for p in PROMPTS[:4]]
    engine.step()
    engine.step()                      # ids[0] mid-chunk (16 of 43), ids[2:] waiting
    assert engine.requests[ids[0]].num_computed_tokens == 16
    assert engine.abort(ids[0]) and engine.abort(ids[3])
    aborted_running = False
    while engine.has_unfinished_requests():
        engine.step()
        check_block_manager(engine.scheduler)
        request = engine.requests.get(ids[2])
        if request is not None and request.status == "running" and not aborted_running:
            aborted_running = engine.abort(ids[2])
    assert aborted_running
    kv = engine.scheduler.kv
    assert not kv.req_blocks and kv.num_free_blocks == kv.pool.num_usable_blocks
    assert kv.pool.num_cached_free_blocks == kv.pool.num_cached_blocks > 0


def test_aborting_a_request_still_waiting_leaves_nothing_behind(tiny):
    """A waiting request the scheduler looked up (its block hashes computed, on the Request)
    but could not admit is aborted through the engine: it holds no block and no cache entry,
    and the manager's accounting holds at every step after."""
    _, _, model, _ = tiny
    engine = build(model, 2, max_num_batched_tokens=16, block_size=4,
                   num_blocks=12)                        # 11 usable blocks = 44 tokens
    kv = engine.scheduler.kv
    engine.add_request(list(range(2, 38)), greedy(4), request_id="a")    # 9 blocks
    for _ in range(3):
        engine.step()
    engine.add_request(list(range(40, 52)), greedy(4), request_id="b")   # needs 3, 2 free
    engine.step()
    b = engine.requests["b"]
    assert b.status == "waiting" and len(b.block_hashes) == 3
    assert engine.abort("b")
    assert "b" not in kv.req_blocks and "b" not in kv.req_entries
    kv.check()
    while engine.has_unfinished_requests():
        engine.step()
        check_block_manager(engine.scheduler)


def test_the_engine_refuses_the_cache_in_batch_invariant_mode(tiny):
    _, _, model, _ = tiny
    with pytest.raises(ParameterError, match="enable_prefix_caching needs the fast mode"):
        build(model, batch_invariant=True, enable_prefix_caching=True)
    for flag in (False, None):                 # None, the default: off in that mode
        engine = build(model, batch_invariant=True, enable_prefix_caching=flag)
        assert type(engine.scheduler.kv) is KVCacheManager
    assert isinstance(build(model).scheduler.kv, PrefixCachingKVCacheManager)
    with pytest.raises(ParameterError, match="enable_prefix_caching must be None, True or False"):
        build(model, enable_prefix_caching="no")


def test_the_trace_table_shows_hits_shared_blocks_and_evictions(tiny):
    _, _, model, _ = tiny
    engine = build(model, num_blocks=16)
    blocks = s12_engine.trace_blocks(engine)
    steps, cache = trace(engine), s13.trace_cache(engine)
    run_engine(engine, PROMPTS, greedy(NEW))
    assert [r.step for r in steps.records] == [b.step for b in blocks.records] == [
        c.step for c in cache.records]
    table = s13.format_cache_table(steps.records, blocks.records, cache.records)
    assert "x2" in table and "evicted:" in table and "cached:" in table and "/43" in table
    assert any(e[0] == "evicted" for b in blocks.records for e in b.block_events)
    with pytest.raises(ValueError, match="max_rows must be an integer >= 2"):
        s13.format_cache_table(steps.records, blocks.records, cache.records, 1)
    with pytest.raises(ValueError, match="of the same steps"):
        s13.format_cache_table(steps.records, blocks.records, cache.records[1:])


def test_command_line_runs_with_a_shared_prefix(capsys):
    s13.main(["--shared-prefix", "16", "--num-prompts", "3", "--max-tokens", "3",
              "--block-size", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "prefix cache: " in out and "16 found cached at admission" in out
    s13.main(["--batch-invariant", "--num-prompts", "2", "--max-tokens", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "prefix cache off" in out and "prefix cache: " not in out


# --- the chapter's figure ---------------------------------------------------------------------

def test_the_figure_is_the_benchmarks_json_drawn_with_its_legend_off_the_data():
    """chapters/figures/s13_prefix_caching.png is scripts/s13_figure.py's drawing of the
    committed benchmark figures; the token counts in the JSON are the closed forms: a prompt
    sharing s tokens finds s rounded down to whole blocks cached and computes the rest; chat
    turn t finds turn t - 1's prompt and answer cached, less the answer's last token (sampled,
    never computed), rounded down to whole blocks."""
    import statistics

    from legend_check import covered_by_legends, describe
    sys.path.insert(0, str(CODE.parent / "scripts"))
    import s13_figure
    figures = json.loads(s13_figure.DATA.read_text())
    found = covered_by_legends(s13_figure.build_figure(figures))
    assert not found, describe(found)
    config = figures["config"]
    size, prompt = config["block_size"], config["prompt_tokens"]
    for row in figures["system_prompt"]:
        assert row["shared_tokens"] == round(row["fraction"] * prompt)
        assert row["cached_tokens"] == row["shared_tokens"] // size * size
        assert row["computed_tokens"] == {"on": prompt - row["cached_tokens"], "off": prompt}
        for mode in ("on", "off"):
            runs = row["ttft_ms_of_repeats"][mode]
            assert len(runs) == config["repeats"]
            assert row["ttft_ms"][mode] == statistics.median(runs)
        ratios = [b / a for a, b in zip(row["ttft_ms_of_repeats"]["on"],
                                        row["ttft_ms_of_repeats"]["off"])]
        assert row["speedup"] == statistics.median(ratios)
    before = None
    for turn in figures["chat"]:
        if before is not None:
            assert turn["cached_tokens"] == (before + config["answer_tokens"] - 1) // size * size
        before = turn["prompt_tokens"]
    done = subprocess.run([sys.executable, str(CODE.parent / "scripts" / "s13_figure.py"),
                           "--check"], cwd=CODE.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
