"""Tests for chapter S12, paged attention (code/s12_paged_attention.py, code/s12_engine.py).

Oracles: S11's engine with its contiguous per-request slots (the same workload and budget, so
the same schedule: logits allclose at every step, bitwise in batch-invariant mode), S05 alone
and HF `generate` alone (greedy ids, via tests/engine_testing.py's tiny_references), closed
forms worked out in the comments (ceil(tokens / block_size) blocks; slot = block * block_size +
offset, by hand), and a dense copy of the keys for the gather.

The engine is S09's, built by `s12_engine.build_engine`; steps and the pool's changes are read
from S09's `StepTracer` and S12's `BlockTracer` (an engine built with
enable_kv_cache_events=True), logits from a `LogitsRecorder` around the runner, and failures
are injected by runner wrappers (tests/engine_testing.py).

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G1 vllm
PR #1534 (a prompt needing more blocks than the pool must be refused, not block the queue:
the check is in blocks), G2 vllm #16832 (output incomplete after recompute preemption: here
the victim's blocks are freed and it recomputes into new ones), G5 sglang PR #2238 / PR #1674
/ #6778 (aborted or finished requests leaked KV: once idle, free blocks == usable blocks),
G4 vllm #24584 (reported: a stream closed mid-request kept its request running; PR #24586 was
closed unmerged). Whatever an engine does, an abort must free what the request holds.
"""
import numpy as np
import pytest
import torch

import s11_chunked_prefill as s11
import s12_engine
from engine_testing import (FailingRunner, LogitsRecorder, NaNRows, drive, greedy, id_text,
                            tiny_fixture, tokens_of)
from model_testing import V, IdTokenizer
from s01_generation_loop import ParameterError
from s09_llm import LLM
from s09_trace import trace
from s12_engine import PagedKVCache, format_block_table
from s12_paged_attention import (MAX_NUM_BLOCKS, NULL_BLOCK_ID, BlockPool, BlockPoolError,
                                 KVCacheManager, slot_mapping)
from scheduler_testing import ceil_div, chunked_scheduler, make_request

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 88]
PROMPTS = [np.random.default_rng(500 + n).integers(2, V, size=n).tolist() for n in LENGTHS]
BIG_BLOCK = 100        # larger than any prompt here (and than CONTEXT: one block per request)

text = id_text
tiny = tiny_fixture("s12", ["gpt2", "qwen3_gqa_tied"], PROMPTS, CONTEXT, NEW)


def build(model, max_num_seqs, max_context=CONTEXT, **options):
    """S12's engine on a tiny model (IdTokenizer), the pool's events kept."""
    return s12_engine.build_engine(model, IdTokenizer(), max_context=max_context,
                                   max_num_seqs=max_num_seqs, enable_kv_cache_events=True,
                                   **options)


# --- the block pool -----------------------------------------------------------------------------

def test_block_pool_hands_out_from_the_front_and_takes_back_at_the_back():
    pool = BlockPool(6, 4)            # block 0 null, 1..5 usable
    assert pool.num_usable_blocks == 5 and pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5]
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [1, 2] and all(b.ref_cnt == 1 for b in a)
    b = pool.allocate(3)
    assert [x.block_id for x in b] == [3, 4, 5] and pool.num_free_blocks == 0
    with pytest.raises(BlockPoolError, match="only 0 of 5 are free"):
        pool.allocate(1)
    pool.free(a[::-1])                # back of the queue, in the order given
    assert pool.free_block_queue.block_ids() == [2, 1]
    pool.touch([b[0]])                # a second holder: ref 2, so one free keeps it held
    pool.free([b[0]])
    assert b[0].ref_cnt == 1 and pool.free_block_queue.block_ids() == [2, 1]
    pool.free([b[0]])
    assert pool.free_block_queue.block_ids() == [2, 1, 3]
    assert pool.take_new_blocks() == [1, 2, 3, 4, 5] and pool.take_new_blocks() == []
    pool.touch([pool.blocks[1]])      # a free block touched leaves the queue (S13's hit)
    assert pool.free_block_queue.block_ids() == [2, 3] and pool.blocks[1].ref_cnt == 1
    assert pool.take_new_blocks() == []               # not new: a hit keeps the block's KV
    assert pool.null_block.block_id == NULL_BLOCK_ID
    assert NULL_BLOCK_ID not in [x.block_id for x in pool.allocate(2)]
    assert pool.take_new_blocks() == [2, 3]


def test_block_pool_errors_name_the_rule_and_change_nothing():
    pool = BlockPool(4, 2)
    held = pool.allocate(2)
    with pytest.raises(BlockPoolError, match="cannot allocate 2 blocks: only 1 of 3"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1                       # all or nothing
    pool.free(held[:1])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free(held)                                     # held[0] already back
    assert held[1].ref_cnt == 1 and pool.num_free_blocks == 2   # checked before changing
    with pytest.raises(BlockPoolError, match="null block"):
        pool.free([pool.null_block])
    with pytest.raises(BlockPoolError, match="not a block of this pool"):
        pool.free(BlockPool(4, 2).allocate(1))
    with pytest.raises(BlockPoolError, match="null block"):
        pool.touch([pool.null_block])
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="integer >= 0"):
            pool.allocate(bad)
    with pytest.raises(ParameterError, match="num_blocks must be an integer >= 2"):
        BlockPool(1, 4)
    with pytest.raises(ParameterError, match="block_size must be an integer >= 1"):
        BlockPool(4, 0)
    with pytest.raises(ParameterError, match="num_blocks must be at most .*one Python object"):
        BlockPool(MAX_NUM_BLOCKS + 1, 4)         # refused before a block is built


# --- the manager --------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_blocks_on_demand_are_ceil_tokens_over_block_size(block_size):
    """A request grown token by token, then by a chunk of 9: it holds ceil(t / bs) blocks
    at every t, and asks for a new block exactly when t crosses a multiple of bs."""
    m = KVCacheManager(40, block_size)
    a = make_request("a", 1, 1)
    t = 0
    for n in [1] * 20 + [9]:
        assert m.num_blocks_to_allocate("a", n) == ceil_div(t + n, block_size) - ceil_div(t, block_size)
        assert m.allocate_slots(a, n)
        t += n
        assert len(m.block_table("a")) == ceil_div(t, block_size) and m.num_tokens("a") == t
        m.check()
    assert m.num_used_tokens == 29 and m.capacity == 39 * block_size
    # internal waste: the unused tail of the last block
    assert m.capacity - m.num_used_tokens - m.num_free_tokens == (-29) % block_size
    assert m.free(a) == 29 and m.num_free_blocks == 39


def test_allocation_is_all_or_nothing_and_free_gives_the_last_block_first():
    m = KVCacheManager(5, 4, enable_kv_cache_events=True)    # 4 usable blocks, 16 tokens
    a, b = make_request("a", 1, 1), make_request("b", 1, 1)
    assert m.allocate_slots(a, 9)                # 3 blocks: 1, 2, 3
    assert not m.allocate_slots(b, 5)            # needs 2, 1 free: nothing taken
    assert m.block_table("b") == [] and m.num_free_blocks == 1 and m.num_tokens("b") == 0
    assert m.allocate_slots(b, 4) and m.block_table("b") == [4]
    assert m.allocate_slots(a, 3)                # 12 tokens still in 3 blocks
    assert not m.allocate_slots(a, 1)
    assert m.block_table("a") == [1, 2, 3] and m.num_tokens("a") == 12
    assert m.free(a) == 12
    assert m.pool.free_block_queue.block_ids() == [3, 2, 1]
    assert m.take_events() == [("allocated", "a", (1, 2, 3)), ("allocated", "b", (4,)),
                               ("freed", "a", (3, 2, 1))]
    assert m.take_events() == []
    m.trim(b, 0)
    assert m.block_table("b") == [] and m.num_free_blocks == 4
    assert m.free(make_request("x", 1, 1)) == 0 and m.num_free_blocks == 4   # holds nothing
    with pytest.raises(ValueError, match="num_new_tokens must be an integer >= 0"):
        m.allocate_slots(a, -1)
    assert KVCacheManager(5, 4).take_events() == []          # events off: none kept


def test_revert_keeps_the_blocks_of_the_computed_tokens():
    """A failed step's revert (S10's `revert`, through the manager's `trim`): the request
    keeps the blocks its computed tokens are in (their KV is there) and gives back the block
    the failed plan took; the step's number is taken back."""
    s = chunked_scheduler(KVCacheManager(20, 4), 2, 16, 64)
    req = make_request("a", 12, 4)
    s.check_request(req)
    s.add_request(req)
    first = s.schedule()
    s.update_from_output(first)                  # 12 computed, 3 full blocks
    req.append_token(1)
    table, free = s.kv.block_table("a"), s.kv.num_free_blocks
    second = s.schedule()                        # its 13th token: a 4th block
    assert second.step == 1 and len(second.block_tables["a"]) == 4
    assert second.new_block_ids == (second.block_tables["a"][-1],)
    s.revert(second)
    assert s.kv.block_table("a") == table and s.kv.num_tokens("a") == 12
    assert s.kv.num_free_blocks == free and req.num_computed_tokens == 12
    s.kv.check()
    assert s.schedule().step == 1                # the failed step's number, taken again


def test_slot_mapping_by_hand():
    # block table [7, 2, 5], block_size 4: positions 0-3 in block 7 (slots 28-31), 4-7 in
    # block 2 (slots 8-11), 8-11 in block 5 (slots 20-23).
    assert slot_mapping([7, 2, 5], 0, 12, 4) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert slot_mapping([7, 2, 5], 6, 3, 4) == [10, 11, 20]
    with pytest.raises(ValueError, match="need 4 blocks"):
        slot_mapping([7, 2, 5], 10, 3, 4)
    for args, rule in ((([7], -1, 2, 4)), "start must be an integer >= 0"), \
                      ((([7], 0, -1, 4)), "n must be an integer >= 0"), \
                      ((([7], 0, 2, 0)), "block_size must be an integer >= 1"):
        with pytest.raises(ValueError, match=rule):
            slot_mapping(*args)


def test_paged_cache_refuses_a_pool_too_big_for_memory():
    # 2 x 1 layer x 4 blocks x 10**9 tokens x 1 head x 4 x 4 bytes = 119.2 GiB > this host's
    with pytest.raises(ParameterError, match=r"the KV pool would take 119\.2\d GiB .*more than"
                       ) as err:
        PagedKVCache(1, 4, 10**9, 1, 4, 8)
    assert err.value.parameter == "num_blocks"


def test_paged_cache_writes_by_slot_and_gathers_by_block_table():
    """Keys written through the slot mapping of two requests with scattered blocks come back
    from `gather` in position order, equal to a dense copy; the null block (the padding of
    the shorter table) stays zero."""
    L, bs, hkv, d = 2, 3, 2, 4
    cache = PagedKVCache(L, 10, bs, hkv, d, 12)
    tables = {0: [5, 1, 8], 1: [2, 9]}
    lengths = {0: 8, 1: 5}
    padded = torch.tensor([tables[0], tables[1] + [NULL_BLOCK_ID]])          # (B, 3)
    dense = {}
    g = torch.Generator().manual_seed(0)
    for row, table in tables.items():
        dense[row] = torch.randn(L, hkv, lengths[row], d, generator=g)
        slots = cache.slot_mapping(padded, torch.full((lengths[row],), row),
                                   torch.arange(lengths[row]))
        assert slots.tolist() == slot_mapping(table, 0, lengths[row], bs)
        for layer in range(L):
            cache.k[layer].view(-1, hkv, d).index_copy_(0, slots, dense[row][layer].transpose(0, 1))
    for layer in range(L):
        k, _ = cache.gather(layer, padded, 8)                      # (2, Hkv, 8, D)
        assert k.shape == (2, hkv, 8, d)
        assert torch.equal(k[0], dense[0][layer])
        assert torch.equal(k[1, :, :5], dense[1][layer])
        assert not k[1, :, 6:].any()                                # the null block's zeros
    assert not cache.k[:, NULL_BLOCK_ID].any()
    cache.zero_blocks([5, 9])
    assert not cache.k[:, [5, 9]].any() and cache.k[:, 1].any()


# --- the engine against S11, S05 and HF ---------------------------------------------------------

def block_checks(engine):
    """A `StepTracer` on the engine, and the check `drive` runs after every step: the
    manager's invariants (`check`: free + used == usable, ref counts); each running request
    holds ceil(computed / block_size) blocks, a waiting one none; no block in two tables; the
    step wrote no slot twice and never the null block, whose storage is still zeros.
    Returns (tracer, check)."""
    tracer = trace(engine)
    seen = [0]

    def check(engine, call, outputs):
        kv, bs = engine.scheduler.kv, engine.scheduler.kv.block_size
        kv.check()
        running = engine.scheduler.running
        tables = [kv.block_table(r.request_id) for r in running]
        ids = [b for t in tables for b in t]
        assert len(ids) == len(set(ids)), "a block held by two live requests"
        assert kv.num_free_blocks + len(ids) == kv.num_blocks - 1
        for r, table in zip(running, tables):
            assert len(table) == ceil_div(r.num_computed_tokens, bs)
        assert not any(kv.block_table(r.request_id) for r in engine.scheduler.waiting)
        cache = engine.runner.cache
        assert not cache.k[:, NULL_BLOCK_ID].any() and not cache.v[:, NULL_BLOCK_ID].any()
        if len(tracer.records) == seen[0]:
            return
        seen[0] = len(tracer.records)
        r = tracer.records[-1]
        slots = [k for table, start, n in zip(r.block_tables, r.num_computed_tokens,
                                              r.num_scheduled_tokens)
                 for k in slot_mapping(table, start, n, bs)]
        assert len(slots) == len(set(slots)), "a slot written twice in one step"
        assert min(slots, default=bs) >= bs, "the null block was written"

    return tracer, check


def run(engine, requests, arrivals, aborts=None):
    """`drive` with `block_checks` after every step; at the end every block is free (G5).
    Returns (outputs, ids, tracer)."""
    tracer, check = block_checks(engine)
    outputs, ids = drive(engine, requests, arrivals, aborts, check)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks - 1 and not kv.req_blocks     # G5
    assert not kv.req_tokens
    return outputs, ids, tracer


@pytest.mark.parametrize("block_size", [1, 16, BIG_BLOCK])
def test_logits_equal_s11_contiguous_cache_at_every_step(tiny, block_size):
    """The same eight requests, arrivals and token budget (8: prompts chunked) on S11's
    contiguous slots and on the block pool: the same schedule, step for step, and the logits of
    every sampled row allclose (the gather only copies keys; the decode batch's shape differs
    from S11's slot range, so not bitwise); in batch-invariant mode bitwise equal."""
    name, _, model, _ = tiny
    requests = [(p, greedy()) for p in PROMPTS]
    arrivals = [0, 0, 1, 2, 4, 5, 9, 10]
    for invariant in (False, True):
        kw = dict(max_num_batched_tokens=8, batch_invariant=invariant)
        paged = build(model, 3, block_size=block_size, **kw)
        contiguous = s11.build_engine(model, IdTokenizer(), max_context=CONTEXT,
                                      max_num_seqs=3, **kw)
        paged.runner = LogitsRecorder(paged.runner)
        contiguous.runner = LogitsRecorder(contiguous.runner)
        got, _, paged_trace = run(paged, requests, arrivals)
        contiguous_trace = trace(contiguous)
        want, _ = drive(contiguous, requests, arrivals)
        assert {i: tokens_of(o) for i, o in got.items()} == {
            i: tokens_of(o) for i, o in want.items()}
        assert [(r.running, r.num_scheduled_tokens) for r in paged_trace.records] == [
            (r.running, r.num_scheduled_tokens) for r in contiguous_trace.records]
        paged_logits, contiguous_logits = paged.runner.logits, contiguous.runner.logits
        assert paged_logits.keys() == contiguous_logits.keys()
        for rid, rows in paged_logits.items():
            for a, b in zip(rows, contiguous_logits[rid], strict=True):
                if invariant:
                    assert torch.equal(a, b), (name, block_size, rid)
                else:
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, BIG_BLOCK])
def test_greedy_equals_s05_and_hf_alone(tiny, block_size):
    """Eight prompts of 1 to 88 tokens, staggered, three seats, prompts chunked by a budget
    of 24: each request's greedy ids equal S05's and HF's alone."""
    name, _, model, references = tiny
    engine = build(model, 3, max_num_batched_tokens=24, block_size=block_size)
    assert engine.scheduler.kv.num_blocks == 3 * ceil_div(CONTEXT, block_size) + 1  # the default
    outs, _, _ = run(engine, [(p, greedy()) for p in PROMPTS], [0, 0, 1, 2, 4, 5, 9, 10])
    for i in range(len(PROMPTS)):
        assert tokens_of(outs[i]) == references[i][0].token_ids == references[i][1], (name, i)
        assert outs[i][-1].finish_reason == references[i][0].finish_reason


@pytest.mark.parametrize("block_size", [1, 16])
def test_g2_outputs_equal_alone_after_block_preemption(tiny, block_size):
    """G2 (vllm #16832: output incomplete after recompute preemption). A pool far smaller
    than the requests' sum (but holding the largest, 96 tokens): requests are preempted, their
    blocks freed and their recompute written into other blocks; every request's greedy ids
    still equal S05's and HF's alone, and the blocks add up after every step."""
    name, _, model, references = tiny
    num_blocks = ceil_div(CONTEXT, block_size) + ceil_div(10, block_size) + 1
    engine = build(model, 3, max_num_batched_tokens=16, block_size=block_size,
                   num_blocks=num_blocks)
    outs, _, _ = run(engine, [(p, greedy()) for p in PROMPTS], [0] * len(PROMPTS))
    assert engine.scheduler.num_preemptions > 0, "nothing was preempted"
    for i in range(len(PROMPTS)):
        assert tokens_of(outs[i]) == references[i][0].token_ids == references[i][1], (name, i)


def test_g1_a_prompt_needing_more_blocks_than_the_pool_is_refused(tiny):
    """G1 (vllm PR #1534). A pool of 5 usable blocks of 4 tokens: a 21-token prompt needs 6
    blocks, refused by add_request in blocks (queueing nothing); a 20-token one fits and the
    requests behind it complete."""
    _, _, model, _ = tiny
    engine = build(model, 2, block_size=4, num_blocks=6)
    long = np.random.default_rng(1).integers(2, V, size=21).tolist()
    with pytest.raises(ParameterError, match="21 tokens, 6 blocks of 4, but the pool has 5 "
                                             "usable blocks: it could never be scheduled"
                       ) as err:
        engine.add_request(long)
    assert err.value.parameter == "prompt"
    assert not engine.scheduler.waiting and not engine.requests
    with pytest.raises(ParameterError, match="6 blocks of 4.*5 usable blocks"):
        engine.scheduler.check_request(make_request("x", 21, 1))
    outs, _, _ = run(engine, [(long[:20], greedy(4)), (PROMPTS[1], greedy(4))], [0, 0])
    assert [outs[i][-1].finish_reason for i in (0, 1)] == ["length", "length"]
    assert len(tokens_of(outs[1])) == 4


def test_g5_everything_free_after_aborts_while_waiting_running_and_mid_chunk(tiny):
    """G5 (sglang PR #2238 / #1674 / #6778). Aborts of a waiting request, of a decoding one
    and of one part-way through its chunked prompt, then everyone else finishes: once idle,
    free blocks == usable blocks (`run` checks it), and no aborted request holds a block
    right after its abort (checked after every step)."""
    _, _, model, _ = tiny
    engine = build(model, 2, max_num_batched_tokens=8, block_size=4)
    requests = [(PROMPTS[i], greedy(20)) for i in (5, 1, 6, 2)]
    outs, ids, tracer = run(engine, requests, [0, 0, 0, 0], aborts={3: [0], 9: [1], 11: [3]})
    reasons = {i: o[-1].finish_reason for i, o in outs.items()}
    assert reasons[0] == reasons[1] == reasons[3] == "abort" and reasons[2] == "length"
    ran = {i: [r for r in tracer.records if ids[i] in r.running] for i in (0, 1, 3)}
    assert ran[0] and not any(ids[0] in r.sampled for r in ran[0])     # aborted mid-chunk
    assert any(ids[1] in r.sampled for r in ran[1])                    # aborted decoding
    assert not ran[3]                                                  # aborted waiting


def replay_events(records, num_blocks) -> set[int]:
    """Replay every `BlockRecord`'s block_events on the free set {1 .. num_blocks - 1}: each
    allocation takes free blocks, each free gives back the tail of its holder's table, last
    block first (so no block is freed that nobody was seen taking), and after each record the
    free set has its free_blocks. Returns the set."""
    free, held = set(range(1, num_blocks)), {}
    for r in records:
        for kind, rid, ids in r.block_events:
            assert kind in ("allocated", "freed"), kind
            if kind == "allocated":
                assert free >= set(ids), (r.step, rid, ids)
                free -= set(ids)
                held.setdefault(rid, []).extend(ids)
            else:                      # given back last block first, by their holder
                assert held.get(rid, [])[::-1][:len(ids)] == list(ids), (r.step, rid, ids)
                del held[rid][len(held[rid]) - len(ids):]
                free |= set(ids)
        assert len(free) == r.free_blocks, r.step
    return free


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_failed_step_gives_its_blocks_back_and_the_trace_still_replays(tiny, block_size):
    """A model run that raises (after writing its KV) while request a starts its chunked
    prompt: `step()` raises, the plan is reverted (every request's block table and tokens as
    before the step, the blocks the step took back in the free queue); the engine goes on
    and both requests equal S05 and HF alone, and the `BlockTracer`'s block_events (the
    failed plan's allocations included, then the revert's frees) replay to every record's
    free_blocks."""
    _, _, model, references = tiny
    engine = build(model, 2, max_num_batched_tokens=8, block_size=block_size, num_blocks=80)
    engine.runner = FailingRunner(engine.runner)
    blocks = s12_engine.trace_blocks(engine)
    tracer, check = block_checks(engine)
    kv = engine.scheduler.kv
    engine.add_request(PROMPTS[2], greedy(), request_id="b")       # 7 tokens
    got = {"b": engine.step()}
    engine.add_request(PROMPTS[5], greedy(), request_id="a")       # 50 tokens
    before = ({rid: kv.block_table(rid) for rid in "ab"}, {rid: kv.num_tokens(rid)
                                                          for rid in "ab"}, kv.num_free_blocks)
    engine.runner.failures = 1
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()                              # b decodes, a's first chunk
    kv.check()
    assert ({rid: kv.block_table(rid) for rid in "ab"}, {rid: kv.num_tokens(rid)
                                                         for rid in "ab"},
            kv.num_free_blocks) == before
    assert kv.block_table("a") == [] and engine.requests["a"].num_computed_tokens == 0
    assert len(blocks.records) == len(tracer.records) == 1
    call = 1
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for o in outputs:
            got.setdefault(o.request_id, []).append(o)
        check(engine, call, outputs)
        call += 1
    assert tokens_of(got["a"]) == references[5][0].token_ids == references[5][1]
    assert tokens_of(got["b"]) == references[2][0].token_ids == references[2][1]
    assert [b.step for b in blocks.records] == [r.step for r in tracer.records]
    assert len(replay_events(blocks.records, 80)) == 79 == kv.num_free_blocks


def test_a_nan_row_gives_that_requests_blocks_back_and_the_others_go_on(tiny):
    """A row S04 refuses (NaN logits for b's second token) while a starts its chunked
    prompt: b ends alone ("abort", the error on its output) and its blocks are free after
    that step; a's chunk is computed in the same step, and a equals S05 and HF alone."""
    _, _, model, references = tiny
    engine = build(model, 2, max_num_batched_tokens=8, block_size=4, num_blocks=80)
    engine.runner = NaNRows(engine.runner, bad="b")
    kv = engine.scheduler.kv
    engine.add_request(PROMPTS[2], greedy(), request_id="b")       # 7 tokens
    engine.step()
    engine.add_request(PROMPTS[5], greedy(), request_id="a")       # 50 tokens
    (out,) = engine.step()                         # b decodes (NaN), a's first chunk of 7
    assert (out.request_id, out.finish_reason, out.new_token_ids) == ("b", "abort", [])
    assert isinstance(out.error, ParameterError)
    kv.check()
    assert kv.block_table("b") == [] and len(kv.block_table("a")) == 2 == kv.num_used_blocks
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
        kv.check()
    assert {o.request_id for o in seen} == {"a"}
    assert tokens_of(seen) == references[5][0].token_ids == references[5][1]
    assert kv.num_free_blocks == 79 and not kv.req_blocks


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_stale_kv_in_reused_blocks_never_reaches_attention(tiny, poison):
    """Every free block (not the null block) filled with NaN or inf after a request
    finished, then two requests of different lengths decode together (the masked batch
    reads past the shorter one's context into the tail of its last block): their outputs
    equal an unpoisoned run's, because a block is zeroed when it is handed out."""
    _, _, model, _ = tiny

    def once(value):
        engine = build(model, 2, max_context=64, block_size=4, num_blocks=20)
        LLM(engine).generate([text(PROMPTS[3])], greedy(6))       # frees its blocks
        if value is not None:
            free = engine.scheduler.kv.pool.free_block_queue.block_ids()
            assert NULL_BLOCK_ID not in free and len(free) == 19
            engine.runner.cache.k[:, free] = value
            engine.runner.cache.v[:, free] = value
        out = LLM(engine).generate([text(PROMPTS[1]), text(PROMPTS[2][:6])], greedy(6))
        return [o.token_ids for o in out]

    assert once(poison) == once(None)


def test_g4_a_stream_closed_mid_chunk_frees_its_blocks(tiny):
    """G4 (vllm #24584, reported; its PR #24586 closed unmerged: a client that disconnects
    must not leave its request holding KV). The `LLM` stream is closed after its first output while the 30-token prompt
    is part-way through its chunks: every block is free before close returns, and once the
    engine has handed over the aborted requests' last outputs the next request's greedy ids
    equal S05's and HF's alone."""
    _, _, model, references = tiny
    engine = build(model, 2, max_num_batched_tokens=8, block_size=4, num_blocks=30)
    kv = engine.scheduler.kv
    stream = LLM(engine).stream([text(PROMPTS[1]), text(PROMPTS[4][:30])], greedy(30))
    next(stream)
    long = engine.requests["1"]
    assert 0 < long.num_computed_tokens < 30 and kv.block_table("1")
    stream.close()
    assert kv.num_free_blocks == 29 and not kv.req_blocks and not engine.requests
    while engine.has_unfinished_requests():
        engine.step()
    kv.check()
    got = LLM(engine).generate([text(PROMPTS[2])], greedy())[0].token_ids
    assert got == references[2][0].token_ids == references[2][1]
    assert kv.num_free_blocks == 29


def test_trace_replays_the_pool(tiny):
    """Replaying every `BlockRecord`'s block_events on a set of free blocks gives each
    record's free_blocks; each record's slot mapping is the closed form of its step's block
    tables; the two tracers' records are of the same steps, and the table prints them."""
    _, _, model, _ = tiny
    engine = build(model, 3, max_num_batched_tokens=16, block_size=8, num_blocks=16)
    blocks = s12_engine.trace_blocks(engine)
    _, _, steps = run(engine, [(p, greedy()) for p in PROMPTS[:6]], [0, 0, 0, 1, 2, 3])
    assert [b.step for b in blocks.records] == [r.step for r in steps.records]
    for r, b in zip(steps.records, blocks.records):
        assert (b.num_blocks, b.block_size) == (16, 8)
        for table, slots, start, n in zip(r.block_tables, b.slot_mapping,
                                          r.num_computed_tokens, r.num_scheduled_tokens):
            assert list(slots) == slot_mapping(table, start, n, 8)
    assert len(replay_events(blocks.records, 16)) == 15
    table = format_block_table(steps.records, blocks.records, max_rows=6)
    assert "steps not shown" in table and "| " in table
    with pytest.raises(ValueError, match="of the same steps"):
        format_block_table(steps.records[1:], blocks.records)


def test_command_line_prints_the_block_tables(capsys, monkeypatch):
    """The block-table view; "at most N blocks in use" is the most held while a step ran
    (the plan's free blocks, before that step's finished requests gave theirs back), from
    the records the CLI drew; --kv-capacity is refused with a pointer to the pool's flags and
    not listed in --help (the pool is counted in blocks); a block size whose pool cannot fit in memory ends with exit status 2 naming
    the rule."""
    drawn = []
    draw = s12_engine.format_block_table
    monkeypatch.setattr(s12_engine, "format_block_table",
                        lambda steps, blocks, *a: drawn.append((list(steps), list(blocks)))
                        or draw(steps, blocks, *a))
    s12_engine.main(["--max-tokens", "24", "--block-size", "4", "--num-blocks", "40",
                     "--max-num-seqs", "4"])
    out = capsys.readouterr().out
    assert "KV pool 40 blocks of 4 tokens" in out and "block tables (id:[blocks]+tokens)" in out
    ((steps, blocks),) = drawn
    planned = max(39 - r.kv_free_tokens // 4 for r in steps)
    after = max(39 - b.free_blocks for b in blocks)
    assert planned > after, "this workload no longer tells the two apart"
    assert f"at most {planned} blocks in use" in out
    with pytest.raises(SystemExit) as exit_info:
        s12_engine.main(["--kv-capacity", "64"])
    assert exit_info.value.code == 2
    assert "--kv-capacity counts tokens; the paged engine's capacity is --num-blocks" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        s12_engine.main(["--help"])
    assert "--kv-capacity" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        s12_engine.main(["--block-size", str(10**8), "--max-tokens", "2"])
    assert exit_info.value.code == 2
    assert "the KV pool would take" in capsys.readouterr().err


# --- the chapter's figure -------------------------------------------------------------------

def test_the_figure_is_the_benchmarks_json_drawn_with_its_legend_off_the_data():
    """chapters/figures/s12_paged_attention.png is scripts/s12_figure.py's drawing of the
    committed benchmark figures; no legend covers data; the JSON's summaries are its series'
    (utilisation = used / reserved over the steps; the waste at the run's block size is the
    closed form's, recomputed here from the workload)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from legend_check import covered_by_legends, describe
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    import s12_figure
    figures = json.loads(s12_figure.DATA.read_text())
    found = covered_by_legends(s12_figure.build_figure(figures))
    assert not found, describe(found)
    for m in figures["memory"].values():
        assert m["utilisation"] == pytest.approx(sum(m["used_tokens"]) / sum(
            m["reserved_tokens"]))
        assert max(m["reserved_tokens"]) <= figures["config"]["kv_budget_tokens"]
        assert m["max_running"] == max(m["running"])
    w = figures["workload"]
    for entry in figures["waste"]:
        b = entry["block_size"]
        held = [t for p, n in zip(w["prompt_lens"], w["output_lens"]) for t in range(p, p + n)]
        allocated = sum(ceil_div(t, b) * b for t in held)
        assert entry["waste_share"] == pytest.approx((allocated - sum(held)) / allocated)
    assert "uptime_before" in figures and "load average" in figures["uptime_after"]
    done = subprocess.run([sys.executable, str(root / "scripts" / "s12_figure.py"), "--check"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
