"""Tests for chapter S12, paged attention (code/s12_paged_attention.py, code/s12_engine.py).

Oracles: S11's engine with its contiguous per-request slots (the same workload and budget, so
the same schedule: logits allclose at every step, bitwise in batch-invariant mode), S05 alone
and HF `generate` alone (greedy ids, via tests/engine_testing.py's tiny_references), closed
forms worked out in the comments (ceil(tokens / block_size) blocks; slot = block * block_size +
offset, by hand), and a dense copy of the keys for the gather.

Public bug reports (../shared/cases/public-bugs.md, section (g)), each a test below: G1 vllm
PR #1534 (a prompt needing more blocks than the pool must be refused, not block the queue:
the check is in blocks), G2 vllm #16832 (output incomplete after recompute preemption: here
the victim's blocks are freed and it recomputes into new ones), G5 sglang PR #2238 / PR #1674
/ #6778 (aborted or finished requests leaked KV: once idle, free blocks == usable blocks),
G4 vllm #24584 / PR #24586 (a stream closed mid-request must free what it holds).
"""
import numpy as np
import pytest
import torch

import s04_sampling as s04
import s11_chunked_prefill as s11
from engine_testing import SampledLogits, id_text, nan_for, tiny_references
import s12_engine
from s12_engine import LLMEngine, PagedKVCache, format_block_table, main
from s12_paged_attention import (MAX_NUM_BLOCKS, NULL_BLOCK_ID, BlockPool, BlockPoolError,
                                 KVCacheManager, PagedScheduler, slot_mapping)
from test_s03_transformer import V, IdTokenizer
from test_s10_scheduler import Req

CONTEXT = 96
NEW = 8
LENGTHS = [1, 3, 7, 16, 31, 50, 80, 88]
PROMPTS = [np.random.default_rng(500 + n).integers(2, V, size=n).tolist() for n in LENGTHS]
BIG_BLOCK = 100        # larger than any prompt here (and than CONTEXT: one block per request)


def greedy(max_tokens=NEW) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens)


def ceil_div(a, b):
    return (a + b - 1) // b


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["gpt2", "qwen3_gqa_tied"])
def tiny(request, tmp_path_factory):
    """(name, HF model, S06 model, {prompt index: (S05 alone, HF alone)})."""
    directory = tmp_path_factory.mktemp(f"s12_{request.param}")
    hf, model, references = tiny_references(request.param, directory, PROMPTS, CONTEXT, NEW)
    return request.param, hf, model, references


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
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 2"):
        BlockPool(1, 4)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        BlockPool(4, 0)
    with pytest.raises(ValueError, match="num_blocks must be at most .*one Python object"):
        BlockPool(MAX_NUM_BLOCKS + 1, 4)         # refused before a block is built


# --- the manager --------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_blocks_on_demand_are_ceil_tokens_over_block_size(block_size):
    """A request grown token by token, then by a chunk of 9: it holds ceil(t / bs) blocks
    at every t, and asks for a new block exactly when t crosses a multiple of bs."""
    m = KVCacheManager(40, block_size)
    t = 0
    for n in [1] * 20 + [9]:
        assert m.num_blocks_to_allocate("a", n) == ceil_div(t + n, block_size) - ceil_div(
            t, block_size)
        assert m.allocate_slots("a", n)
        t += n
        assert len(m.block_table("a")) == ceil_div(t, block_size) and m.num_tokens("a") == t
        m.check()
    assert m.num_used_tokens == 29 and m.capacity == 39 * block_size
    # internal waste: the unused tail of the last block
    assert m.capacity - m.num_used_tokens - m.num_free_tokens == (-29) % block_size
    assert m.free("a") == 29 and m.num_free_blocks == 39


def test_allocation_is_all_or_nothing_and_free_gives_the_last_block_first():
    m = KVCacheManager(5, 4)                     # 4 usable blocks, 16 tokens
    assert m.allocate_slots("a", 9)              # 3 blocks: 1, 2, 3
    assert not m.allocate_slots("b", 5)          # needs 2, 1 free: nothing taken
    assert m.block_table("b") == [] and m.num_free_blocks == 1 and m.num_tokens("b") == 0
    assert m.allocate_slots("b", 4) and m.block_table("b") == [4]
    assert m.allocate_slots("a", 3)              # 12 tokens still in 3 blocks
    assert not m.allocate_slots("a", 1)
    assert m.block_table("a") == [1, 2, 3] and m.num_tokens("a") == 12
    m.free("a")
    assert m.pool.free_block_queue.block_ids() == [3, 2, 1]
    assert m.take_events() == [("allocated", "a", (1, 2, 3)), ("allocated", "b", (4,)),
                               ("freed", "a", (3, 2, 1))]
    m.trim("b", 0)
    assert m.block_table("b") == [] and m.num_free_blocks == 4
    with pytest.raises(ValueError, match="num_new_tokens must be an integer >= 0"):
        m.allocate_slots("a", -1)


def test_revert_keeps_the_blocks_of_the_computed_tokens():
    """S10's `revert` (a failed step) goes through the manager's `trim`: the request keeps
    the blocks its computed tokens are in (their KV is there), gives back the rest."""
    s = PagedScheduler(2, 16, 20, 4, 64)
    req = Req("a", 10, 4)
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out)                    # 10 computed, 3 blocks
    req.token_ids.append(1)
    req.output_ids.append(1)
    table = s.kv.block_table("a")
    s.kv.allocate_slots("a", 3)                  # as if a step scheduled 3 more
    s.revert(out)
    assert s.kv.block_table("a") == table and s.kv.num_tokens("a") == 10
    s.kv.check()


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


def test_paged_cache_refuses_bad_rows_block_ids_and_a_pool_too_big_for_memory():
    cache = PagedKVCache(1, 4, 2, 1, 4, 2, 8)      # blocks 1..3 usable, rows 0..1
    for row in (-1, 2, 1.0, True):
        with pytest.raises(ValueError, match=r"row must be an integer in \[0, 2\)"):
            cache.set_block_table(row, [1])
    for ids in ([4], [0, 1], [-1]):
        with pytest.raises(ValueError, match="block ids must be in 1 .. 3 .*null block"):
            cache.set_block_table(0, ids)
    assert not cache.block_tables.any()
    # 2 x 1 layer x 4 blocks x 10**9 tokens x 1 head x 4 x 4 bytes = 119.2 GiB > this host's
    with pytest.raises(ValueError, match=r"the KV pool would take 119\.2 GiB .*more than"):
        PagedKVCache(1, 4, 10**9, 1, 4, 2, 8)


def test_paged_cache_writes_by_slot_and_gathers_by_block_table():
    """Keys written through the slot mapping of two requests with scattered blocks come back
    from `gather` in position order, equal to a dense copy; the null block stays zero."""
    L, bs, hkv, d = 2, 3, 2, 4
    cache = PagedKVCache(L, 10, bs, hkv, d, 2, 12)
    tables = {0: [5, 1, 8], 1: [2, 9]}
    lengths = {0: 8, 1: 5}
    dense = {}
    g = torch.Generator().manual_seed(0)
    for row, table in tables.items():
        cache.set_block_table(row, table)
        dense[row] = torch.randn(L, hkv, lengths[row], d, generator=g)
        slots = cache.slot_mapping(torch.full((lengths[row],), row),
                                   torch.arange(lengths[row]))
        assert slots.tolist() == slot_mapping(table, 0, lengths[row], bs)
        for layer in range(L):
            cache.k[layer].view(-1, hkv, d).index_copy_(0, slots, dense[row][layer].transpose(0, 1))
    for layer in range(L):
        k, _ = cache.gather(layer, torch.tensor([0, 1]), 8)        # (2, Hkv, 8, D)
        assert torch.equal(k[0], dense[0][layer])
        assert torch.equal(k[1, :, :5], dense[1][layer])
    assert not cache.k[:, NULL_BLOCK_ID].any()


# --- the engine against S11, S05 and HF ---------------------------------------------------------

class PagedRecording(SampledLogits, LLMEngine):
    pass


class ContiguousRecording(SampledLogits, s11.LLMEngine):
    pass


def check_blocks(engine, out) -> None:
    """Block accounting after a step: the manager's invariants; each running request holds
    ceil(computed / block_size) blocks; no block in two tables; the cache's rows hold the
    scheduler's tables; the step wrote no slot twice and never the null block."""
    kv, bs = engine.scheduler.kv, engine.block_size
    kv.check()
    tables = [kv.block_table(seq.request_id) for seq in engine.running]
    ids = [b for t in tables for b in t]
    assert len(ids) == len(set(ids)), "a block held by two live requests"
    assert kv.num_free_blocks + len(ids) == engine.num_blocks - 1
    for seq, table in zip(engine.running, tables):
        assert len(table) == ceil_div(seq.num_computed_tokens, bs)
        row = engine.runner.cache.block_tables[seq.slot].tolist()
        assert row[:len(table)] == table and not any(row[len(table):])
    slots = [k for rid, n in out.num_scheduled_tokens.items()
             for k in slot_mapping(out.block_tables[rid], out.num_computed_tokens[rid], n, bs)]
    assert len(slots) == len(set(slots)), "a slot written twice in one step"
    assert min(slots, default=bs) >= bs, "the null block was written"


def drive(engine, requests, arrivals, aborts=None):
    """Run [(prompt, params)] through add_request / step (request i before step call
    arrivals[i]; aborts {call: [index]}), checking the blocks after every step. Returns
    ({index: token ids}, {index: finish_reason}); everything is free at the end (G5)."""
    aborts = aborts or {}
    ids, tokens, reasons, call = {}, {}, {}, 0
    while len(ids) < len(requests) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call and i not in ids:
                ids[i] = engine.add_request(*requests[i])
        for i in aborts.get(call, []):
            if i in ids:
                engine.abort(ids[i])
        index_of = {rid: i for i, rid in ids.items()}
        for o in engine.step():
            tokens.setdefault(index_of[o.request_id], []).extend(o.new_token_ids)
            if o.finished:
                reasons[index_of[o.request_id]] = o.finish_reason
        if isinstance(engine, LLMEngine) and engine.scheduler_output is not None:
            check_blocks(engine, engine.scheduler_output)
        call += 1
        assert call < 10_000
    if not isinstance(engine, LLMEngine):
        return tokens, reasons
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == engine.num_blocks - 1 and not kv.req_blocks     # G5
    assert engine.runner.cache.free_slots == list(range(engine.max_num_seqs))
    assert not engine.runner.cache.block_tables.any()
    return tokens, reasons


@pytest.mark.parametrize("block_size", [1, 16, BIG_BLOCK])
def test_logits_equal_s11_contiguous_cache_at_every_step(tiny, block_size):
    """The same eight requests, arrivals and token budget (8: prompts chunked) on S11's
    contiguous slots and on the block pool: the same schedule, step for step, and the logits of
    every sampled row allclose (the gather only copies keys; the decode batch's shape differs
    from S11's slot range, so not bitwise); in batch-invariant mode bitwise equal."""
    name, _, model, _ = tiny
    requests = [(id_text(p), greedy()) for p in PROMPTS]
    arrivals = [0, 0, 1, 2, 4, 5, 9, 10]
    for invariant in (False, True):
        kw = dict(max_num_batched_tokens=8, batch_invariant=invariant)
        paged = PagedRecording(model, IdTokenizer(), CONTEXT, 3, block_size=block_size, **kw)
        contiguous = ContiguousRecording(model, IdTokenizer(), CONTEXT, 3, **kw)
        got, _ = drive(paged, requests, arrivals)
        want, _ = drive(contiguous, requests, arrivals)
        assert got == want
        assert [(r.running, r.num_scheduled_tokens) for r in paged.trace] == [
            (r.running, r.num_scheduled_tokens) for r in contiguous.trace]
        assert paged.logits.keys() == contiguous.logits.keys()
        for rid, rows in paged.logits.items():
            for a, b in zip(rows, contiguous.logits[rid], strict=True):
                if invariant:
                    assert torch.equal(a, b), (name, block_size, rid)
                else:
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, BIG_BLOCK])
def test_greedy_equals_s05_and_hf_alone(tiny, block_size):
    """Eight prompts of 1 to 88 tokens, staggered, three seats, prompts chunked by a budget
    of 24: each request's greedy ids equal S05's and HF's alone."""
    name, _, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, max_num_batched_tokens=24,
                       block_size=block_size)
    assert engine.num_blocks == 3 * ceil_div(CONTEXT, block_size) + 1   # the default pool
    tokens, reasons = drive(engine, [(id_text(p), greedy()) for p in PROMPTS],
                            [0, 0, 1, 2, 4, 5, 9, 10])
    for i in range(len(PROMPTS)):
        assert tokens[i] == references[i][0].token_ids == references[i][1], (name, i)
        assert reasons[i] == references[i][0].finish_reason


@pytest.mark.parametrize("block_size", [1, 16])
def test_g2_outputs_equal_alone_after_block_preemption(tiny, block_size):
    """G2 (vllm #16832: output incomplete after recompute preemption). A pool far smaller
    than the requests' sum (but holding the largest, 96 tokens): requests are preempted, their
    blocks freed and their recompute written into other blocks; every request's greedy ids
    still equal S05's and HF's alone, and the blocks add up after every step."""
    name, _, model, references = tiny
    num_blocks = ceil_div(CONTEXT, block_size) + ceil_div(10, block_size) + 1
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, max_num_batched_tokens=16,
                       block_size=block_size, num_blocks=num_blocks)
    tokens, _ = drive(engine, [(id_text(p), greedy()) for p in PROMPTS], [0] * len(PROMPTS))
    assert engine.scheduler.num_preemptions > 0, "nothing was preempted"
    for i in range(len(PROMPTS)):
        assert tokens[i] == references[i][0].token_ids == references[i][1], (name, i)


def test_g1_a_prompt_needing_more_blocks_than_the_pool_is_refused(tiny):
    """G1 (vllm PR #1534). A pool of 5 usable blocks of 4 tokens: a 21-token prompt needs 6
    blocks, refused by add_request in blocks (queueing nothing); a 20-token one fits and the
    requests behind it complete."""
    _, _, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, block_size=4, num_blocks=6)
    long = np.random.default_rng(1).integers(2, V, size=21).tolist()
    with pytest.raises(ValueError, match="21 tokens, 6 blocks of 4, but the pool has 5 usable "
                                         "blocks: it could never be scheduled"):
        engine.add_request(id_text(long))
    assert not engine.waiting and not engine.requests
    with pytest.raises(ValueError, match="6 blocks of 4.*5 usable blocks"):
        engine.scheduler.add_request(Req("x", 21, 1))
    tokens, reasons = drive(engine, [(id_text(long[:20]), greedy(4)),
                                     (id_text(PROMPTS[1]), greedy(4))], [0, 0])
    assert reasons == {0: "length", 1: "length"} and len(tokens[1]) == 4


def test_g5_everything_free_after_aborts_while_waiting_running_and_mid_chunk(tiny):
    """G5 (sglang PR #2238 / #1674 / #6778). Aborts of a waiting request, of a decoding one
    and of one part-way through its chunked prompt, then everyone else finishes: once idle,
    free blocks == usable blocks and every block-table row is back to the null block
    (`drive` checks it), and no aborted request holds a block right after its abort."""
    _, _, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=8,
                       block_size=4)
    requests = [(id_text(PROMPTS[i]), greedy(20)) for i in (5, 1, 6, 2)]
    _, reasons = drive(engine, requests, [0, 0, 0, 0], aborts={3: [0], 9: [1], 11: [3]})
    assert reasons[0] == reasons[1] == reasons[3] == "abort" and reasons[2] == "length"
    ran = {rid: [r for r in engine.trace if rid in r.running] for rid in "013"}
    assert ran["0"] and not any("0" in r.sampled for r in ran["0"])     # aborted mid-chunk
    assert any("1" in r.sampled for r in ran["1"])                      # aborted decoding
    assert not ran["3"]                                                 # aborted waiting


NaNFor = nan_for(LLMEngine)   # request `bad`: NaN logits from its second token on


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_failed_step_gives_its_blocks_back_and_the_trace_still_replays(tiny, block_size):
    """A row S04 refuses fails step() while another request starts its chunked prompt: the
    blocks the step took go back (each running request holds ceil(computed / block_size)),
    after the abort the other request equals S05 and HF alone, and the trace's block_events
    (the failed plan's allocations included, then the revert's frees) replay to every
    record's free_blocks."""
    _, _, model, references = tiny
    engine = NaNFor(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=8,
                    block_size=block_size, num_blocks=80)
    engine.bad = "b"
    engine.add_request(id_text(PROMPTS[2]), greedy(), request_id="b")       # 7 tokens
    engine.step()
    engine.add_request(id_text(PROMPTS[5]), greedy(), request_id="a")       # 50 tokens
    with pytest.raises(ValueError, match="^request 'b': logits must not contain NaN"):
        engine.step()                              # b decodes (NaN), a's first chunk
    kv = engine.scheduler.kv
    kv.check()
    assert kv.block_table("a") == [] and engine.requests["a"].num_computed_tokens == 0
    for seq in engine.running:
        assert len(kv.block_table(seq.request_id)) == ceil_div(seq.num_computed_tokens,
                                                               block_size)
    engine.abort("b")
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == "a" for t in o.new_token_ids]
        kv.check()
    assert tokens == references[5][0].token_ids == references[5][1]
    assert len(replay_events(engine.trace, 80)) == 79 == kv.num_free_blocks


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_stale_kv_in_reused_blocks_never_reaches_attention(tiny, poison):
    """Every free block (not the null block) filled with NaN or inf after a request
    finished, then two requests of different lengths decode together (the masked batch
    reads past the shorter one's context into the tail of its last block): their outputs
    equal an unpoisoned run's, because a block is zeroed when it is handed out."""
    _, _, model, _ = tiny

    def run(value):
        engine = LLMEngine(model, IdTokenizer(), 64, 2, block_size=4, num_blocks=20)
        engine.generate([id_text(PROMPTS[3])], greedy(6))       # frees its blocks
        if value is not None:
            free = engine.scheduler.kv.pool.free_block_queue.block_ids()
            assert NULL_BLOCK_ID not in free and len(free) == 19
            engine.runner.cache.k[:, free] = value
            engine.runner.cache.v[:, free] = value
        out = engine.generate([id_text(PROMPTS[1]), id_text(PROMPTS[2][:6])], greedy(6))
        return [o.token_ids for o in out]

    assert run(poison) == run(None)


def test_g4_a_stream_closed_mid_chunk_frees_its_blocks_and_row(tiny):
    """G4 (vllm #24584 / PR #24586: a client that disconnects must not leave its request
    holding KV). The stream is closed after its first output while the 30-token prompt is
    part-way through its chunks; once idle every block and block-table row is free, and the
    next request's greedy ids equal S05's and HF's alone."""
    _, _, model, references = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 2, max_num_batched_tokens=8,
                       block_size=4, num_blocks=30)
    stream = engine.stream([id_text(PROMPTS[1]), id_text(PROMPTS[4][:30])], greedy(30))
    next(stream)
    long = engine.requests["1"]
    assert 0 < long.num_computed_tokens < 30 and engine.scheduler.kv.block_table("1")
    stream.close()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv.num_free_blocks == 29 and not engine.scheduler.kv.req_blocks
    assert engine.runner.cache.free_slots == [0, 1]
    assert not engine.runner.cache.block_tables.any()
    got = engine.generate([id_text(PROMPTS[2])], greedy())[0].token_ids
    assert got == references[2][0].token_ids == references[2][1]


def replay_events(trace, num_blocks) -> set[int]:
    """Replay every record's block_events on the free set {1 .. num_blocks - 1}: each
    allocation takes free blocks, each free gives back the tail of its holder's table, last
    block first, and after each record the free set has its free_blocks. Returns the set."""
    free, held = set(range(1, num_blocks)), {}
    for r in trace:
        for kind, rid, ids in r.block_events:
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


def test_trace_replays_the_pool(tiny):
    """Replaying every record's block_events on a set of free blocks gives each record's
    free_blocks, and each record's tables are blocks allocated and not freed since."""
    _, _, model, _ = tiny
    engine = LLMEngine(model, IdTokenizer(), CONTEXT, 3, max_num_batched_tokens=16,
                       block_size=8, num_blocks=16)
    drive(engine, [(id_text(p), greedy()) for p in PROMPTS[:6]], [0, 0, 0, 1, 2, 3])
    for r in engine.trace:
        for rid, table, slots, start in zip(r.running, r.block_tables, r.slot_mapping,
                                            r.num_computed_tokens):
            assert list(slots) == slot_mapping(table, start, len(slots), 8)
    assert len(replay_events(engine.trace, 16)) == 15
    text = format_block_table(engine.trace, max_rows=6)
    assert "steps not shown" in text and "| " in text


def test_command_line_prints_the_block_tables(capsys, monkeypatch):
    """The block-table view; "at most N blocks in use" is the most held while a step ran
    (the plan's free blocks, before that step's finished requests gave theirs back), from
    the trace the CLI drew; --kv-capacity is refused and not listed; a block size whose
    pool cannot fit in memory ends with exit status 2 naming the rule."""
    traces = []
    draw = s12_engine.format_block_table
    monkeypatch.setattr(s12_engine, "format_block_table",
                        lambda trace, *a: traces.append(list(trace)) or draw(trace, *a))
    main(["--max-tokens", "24", "--block-size", "4", "--num-blocks", "40", "--max-num-seqs",
          "4"])
    out = capsys.readouterr().out
    assert "KV pool 40 blocks of 4 tokens" in out and "block tables (id:[blocks]+tokens)" in out
    (trace,) = traces
    planned = max(39 - r.kv_free_tokens // 4 for r in trace)
    after = max(39 - r.free_blocks for r in trace)
    assert planned > after, "this workload no longer tells the two apart"
    assert f"at most {planned} blocks in use" in out
    with pytest.raises(SystemExit):
        main(["--kv-capacity", "64"])
    assert "--num-blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--kv-capacity" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--block-size", str(10**8), "--max-tokens", "2"])
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
