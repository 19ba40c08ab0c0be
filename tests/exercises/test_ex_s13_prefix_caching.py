"""Graded tests for the S13 exercises (see exercises/s13_prefix_caching.py).

Oracles, none of them the solution: hashes, hits and free queues worked by hand (the first
block's hash is rebuilt here with hashlib and struct from the encoding the exercise states);
S13's tested code (code/s13_prefix_caching.py): `hash_request_tokens`, the hash chain the
engine uses, on random token ids, block sizes and salts; S13's engine's scheduler (S11's
`ChunkedScheduler` over a `PrefixCachingKVCacheManager`) serving the earlier prompts one after
another with a fake model (one output token each, a pool too large to evict anything), then
asked how many cached tokens the new prompt is admitted with; and
`PrefixCachingKVCacheManager` driven through the same admissions and frees as your function
(find the cached run, take it, allocate the rest, name the full blocks, free last block first),
its hits, evictions and free queue read after every operation. No model is needed. What your
functions return is compared as lists, so any sequence is accepted.
"""
import hashlib
import random
import struct

import pytest

from exercise_loader import load_exercise
import s13_prefix_caching as s13
from s09_scheduler import Request
from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig

ex = load_exercise("s13_prefix_caching")


# Exercise 1 ----------------------------------------------------------------------------------

def one_block(parent: bytes, tokens, keys=()) -> bytes:
    """The encoding as the exercise states it, written out once more by hand."""
    data = parent + struct.pack("<I", len(tokens)) + b"".join(struct.pack("<q", t) for t in tokens)
    data += struct.pack("<I", len(keys))
    for key in keys:
        data += struct.pack("<I", len(key.encode())) + key.encode()
    return hashlib.sha256(data).digest()


@pytest.mark.points(1)
def test_block_hashes_by_hand():
    root = hashlib.sha256(b"s13 prefix cache: no parent block").digest()
    got = [bytes(h) for h in ex.block_hashes([5, 6, 7, 8, 9], 2)]
    h0 = one_block(root, [5, 6])
    h1 = one_block(h0, [7, 8])
    assert got == [h0, h1]                                     # token 9 fills no block
    assert [bytes(h) for h in ex.block_hashes([5, 6, 7], 2, "alice")] == [
        one_block(root, [5, 6], ["alice"])]                    # the salt in block 0 only
    assert list(ex.block_hashes([5], 2)) == []
    assert bytes(ex.block_hashes([7, 8], 2)[0]) != h1          # same tokens, other parent
    for bad in (([1, 2], 0, None), ([1, 2], 2, ""), ([1, 2], 2, 3)):
        with pytest.raises(ValueError):
            ex.block_hashes(*bad)


@pytest.mark.points(2)
def test_block_hashes_equal_the_engines_chain():
    rng = random.Random(13)
    for _ in range(300):
        size = rng.randint(1, 9)
        ids = [rng.randint(0, 2 ** 40) for _ in range(rng.randint(0, 40))]
        salt = rng.choice([None, None, "tenant-1", "é" * rng.randint(1, 3)])
        got = [bytes(h) for h in ex.block_hashes(ids, size, salt)]
        assert got == s13.hash_request_tokens(ids, size, salt), (size, len(ids), salt)
        if len(got) >= 2:                                      # change one token of block j:
            j = rng.randrange(len(got))                        # blocks j.. change, not before
            changed = list(ids)
            changed[j * size + rng.randrange(size)] += 1
            other = [bytes(h) for h in ex.block_hashes(changed, size, salt)]
            assert other[:j] == got[:j] and all(a != b for a, b in zip(other[j:], got[j:]))


# Exercise 2 ----------------------------------------------------------------------------------

A = list(range(1, 9))             # two blocks of 4
BY_HAND = [                       # (earlier prompts, prompt, block size) -> tokens skipped
    (([A], A + [9], 4), 8),       # both blocks cached, the 9th token computed
    (([A], A, 4), 4),             # exactly two blocks: the last token must be computed
    (([A], A[:6], 4), 4),         # the second block is not full: only full blocks match
    (([A], [1, 2, 3, 4, 5, 6, 7, 0, 9], 4), 4),                 # block 2 differs at its end
    (([A], [9, 9, 9, 9, 5, 6, 7, 8, 1], 4), 0),                 # same block 2, other parent
    (([A], [0] + A[1:] + [9], 4), 0),                           # the first block misses
    (([A, [1, 2, 3, 4, 0, 0, 0, 0, 7]], [1, 2, 3, 4, 0, 0, 0, 0, 5], 4), 8),   # the newer one
    (([], A + [9], 4), 0),
    (([A], A + [9], 1), 8),       # block size 1: every token but the last
]


def cached_by_scheduler(earlier, prompt, block_size: int) -> int:
    """S13's engine's scheduler serves each earlier prompt alone to its first token (a fake
    model), in a pool too large to evict, then admits `prompt`: the tokens it is admitted
    with (where its first chunk starts)."""
    longest = max(len(p) for p in [*earlier, prompt]) + 1
    num_blocks = 2 + sum(-(-(len(p) + 1) // block_size) for p in [*earlier, prompt])
    sched = ChunkedScheduler(ChunkedSchedulerConfig(1, longest, 4 * longest),
                             s13.PrefixCachingKVCacheManager(num_blocks, block_size))
    for k, ids in enumerate([*earlier, prompt]):
        req = Request.for_tokens(f"r{k}", ids, 1, arrival=k)
        sched.add_request(req)
        out = sched.schedule()
        if k == len(earlier):
            assert req.num_cached_tokens == out.num_computed_tokens[req.request_id]
            return req.num_cached_tokens
        while True:                                            # chunks until the first token
            n = out.num_scheduled_tokens[req.request_id]
            done = out.num_computed_tokens[req.request_id] + n == req.num_tokens
            if done:
                req.append_token(1)
            sched.update_from_output(out, [req.request_id] if done else [])
            if done:
                break
            out = sched.schedule()


@pytest.mark.points(1)
def test_num_cached_tokens_by_hand():
    for (earlier, prompt, size), want in BY_HAND:
        assert cached_by_scheduler(earlier, prompt, size) == want, (earlier, prompt, size)
        assert ex.num_cached_tokens(earlier, prompt, size) == want, (earlier, prompt, size)
    for bad in (([A], [], 4), ([A], A, 0)):
        with pytest.raises(ValueError):
            ex.num_cached_tokens(*bad)


@pytest.mark.points(2)
def test_num_cached_tokens_matches_the_scheduler():
    rng = random.Random(31)
    hits = 0
    for _ in range(150):
        size = rng.randint(1, 6)
        base = [rng.randint(0, 5) for _ in range(rng.randint(1, 30))]
        def variant():                                         # shares a prefix of base
            cut = rng.randint(0, len(base))
            return base[:cut] + [rng.randint(0, 5) for _ in range(rng.randint(0, 12))] or [1]
        earlier = [variant() for _ in range(rng.randint(0, 3))]
        prompt = variant()
        want = cached_by_scheduler(earlier, prompt, size)
        assert ex.num_cached_tokens(earlier, prompt, size) == want, (earlier, prompt, size)
        hits += want > 0
    assert hits > 40


# Exercise 3 ----------------------------------------------------------------------------------

def names(ids, size):
    return [h.hex()[:12] for h in s13.hash_request_tokens(ids, size)]


def by_manager(num_blocks: int, size: int, ops, tokens) -> list[tuple]:
    """S13's manager through the same operations: for an admission, find the cached run (at
    most (n - 1) // size blocks), take it and allocate the rest, then name the full blocks (the
    step has written them); a free gives the blocks back last first. After each operation: the
    blocks hit, the blocks whose name was evicted, the free queue front first. None when an
    admission does not fit in the free blocks."""
    kv = s13.PrefixCachingKVCacheManager(num_blocks, size, enable_kv_cache_events=True)
    held: dict[str, Request] = {}
    out = []
    for op in ops:
        kv.take_events()
        if op[0] == "admit":
            _, rid, _, n = op
            request = held[rid] = Request.for_tokens(rid, tokens[rid], 1)
            run, num_cached = kv.get_computed_blocks(request)
            if not kv.allocate_slots(request, n - num_cached, run):
                return None
            kv.cache_blocks(request, n)
        else:
            kv.free(held.pop(op[1]))
        kv.check()
        events = kv.take_events()
        hit = [list(ids) for kind, _, ids in events if kind == "hit"]
        evicted = [list(ids) for kind, _, ids in events if kind == "evicted"]
        out.append((hit[0] if hit else [], evicted[0] if evicted else [],
                    kv.pool.free_block_queue.block_ids()))
    return out


def serve(num_blocks, size, ops):
    return [(list(h), list(e), list(f)) for h, e, f in ex.serve(num_blocks, size, ops)]


SYSTEM = [7, 7, 7, 7, 8, 8, 8, 8]                              # two blocks of 4, shared


@pytest.mark.points(1)
def test_serve_by_hand():
    tokens = {"a": SYSTEM + [1, 2, 3], "b": SYSTEM + [4, 5], "c": [9] * 9,
              "d": SYSTEM + [1, 2, 3]}
    ops = [("admit", "a", names(tokens["a"], 4), 11), ("free", "a"),
           ("admit", "b", names(tokens["b"], 4), 10), ("free", "b"),
           ("admit", "c", names(tokens["c"], 4), 9), ("admit", "d", names(tokens["d"], 4), 11)]
    # Worked by hand, blocks 1..6 (block 0 is the null block), block size 4, free queue front
    # first. a takes 1, 2, 3 and names 1, 2 (block 3 holds 3 tokens, not full). a gives back
    # its last block first: 3, 2, 1 go to the back, keeping their names. b hits 1, 2 (the
    # system prompt) and takes 4 for its last 2 tokens. b gives back 4, 2, 1. c (9 tokens, 3
    # blocks, no hit) takes the front three, 5, 6, 3, none of them named. d hits 1, 2 again
    # and takes 4.
    want = [([], [], [4, 5, 6]),
            ([], [], [4, 5, 6, 3, 2, 1]),
            ([1, 2], [], [5, 6, 3]),
            ([], [], [5, 6, 3, 4, 2, 1]),
            ([], [], [4, 2, 1]),
            ([1, 2], [], [])]
    assert by_manager(7, 4, ops, tokens) == want
    assert serve(7, 4, ops) == want
    # The same with blocks 1..4 only, and c let go before d comes. c's three blocks come from
    # the front, 3, 4, 2: block 2 held the system prompt's second block, so c evicts it (the
    # tail of a chain goes before its head). c names 3 and 4 and gives back 2, 4, 3. d still
    # finds block 1, the system prompt's first block, but not the second: it takes 2 and 4
    # from the front, evicting c's block 4, and names 2 again.
    small = ops[:4] + [("admit", "c", names(tokens["c"], 4), 9), ("free", "c"),
                       ("admit", "d", names(tokens["d"], 4), 11)]
    want_small = [([], [], [4]),
                  ([], [], [4, 3, 2, 1]),
                  ([1, 2], [], [3]),
                  ([], [], [3, 4, 2, 1]),
                  ([], [2], [1]),
                  ([], [], [1, 2, 4, 3]),
                  ([1], [4], [3])]
    assert by_manager(5, 4, small, tokens) == want_small
    assert serve(5, 4, small) == want_small


@pytest.mark.points(2)
def test_serve_matches_the_manager():
    rng = random.Random(17)
    evictions = hits = 0
    for _ in range(120):
        size = rng.randint(1, 4)
        num_blocks = rng.randint(4, 14)
        prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(0, 10))] for _ in range(2)]
        tokens, ops, held = {}, [], []
        for k in range(rng.randint(4, 16)):
            if held and (rng.random() < 0.45 or len(held) > 3):
                rid = held.pop(rng.randrange(len(held)))
                ops.append(("free", rid))
                continue
            rid = f"r{k}"
            ids = rng.choice(prefixes) + [rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
            ids = ids or [1]
            tokens[rid] = ids
            trial = ops + [("admit", rid, names(ids, size), len(ids))]
            if by_manager(num_blocks, size, trial, tokens) is None:     # does not fit: skip it
                del tokens[rid]
                continue
            ops, held = trial, held + [rid]
        want = by_manager(num_blocks, size, ops, tokens)
        assert serve(num_blocks, size, ops) == want, (num_blocks, size, ops)
        evictions += sum(bool(e) for _, e, _ in want)
        hits += sum(bool(h) for h, _, _ in want)
    assert evictions > 30 and hits > 60


@pytest.mark.points(1)
def test_serve_refuses_what_its_docstring_refuses():
    # Blocks 1..3, block size 4. a holds the system prompt's two blocks, 1 and 2, then gives
    # them back: the free queue is 3, 2, 1, all free, 2 and 1 still named. b (12 tokens, 3
    # blocks) hits 1 and 2 and needs one new block: the queue less its hits holds 3, so it
    # fits. b2 (13 tokens, 4 blocks) also hits 1 and 2 but needs two new blocks: only block 3
    # is free once its hits are taken, so it does not fit (the manager refuses it too).
    tokens = {"a": SYSTEM, "b": SYSTEM + [1, 2, 3, 4], "b2": SYSTEM + [1, 2, 3, 4, 5]}
    start = [("admit", "a", names(SYSTEM, 4), 8), ("free", "a")]
    fits = start + [("admit", "b", names(tokens["b"], 4), 12)]
    want = [([], [], [3]), ([], [], [3, 2, 1]), ([1, 2], [], [])]
    assert by_manager(4, 4, fits, tokens) == want
    assert serve(4, 4, fits) == want
    too_big = start + [("admit", "b2", names(tokens["b2"], 4), 13)]
    assert by_manager(4, 4, too_big, tokens) is None
    admit_a = ("admit", "a", names(SYSTEM, 4), 8)
    for num_blocks, size, ops in [
            (1, 4, []),                                        # no usable block
            (4, 0, []),                                        # block_size < 1
            (4, 4, too_big),                                   # does not fit
            (4, 4, [("evict", "a")]),                          # unknown operation
            (4, 4, [admit_a, admit_a]),                        # a is still held
            (4, 4, [("admit", "a", names(SYSTEM, 4)[:1], 8)]),     # one name for two blocks
            (4, 4, [("admit", "a", [], 0)]),                   # no tokens
            (4, 4, [("free", "a")]),                           # a holds nothing
            (4, 4, [admit_a, ("free", "a"), ("free", "a")])]:  # freed already
        with pytest.raises(ValueError):
            ex.serve(num_blocks, size, ops)
    # An id may come back once freed: a again hits block 1 only (at most (8 - 1) // 4 blocks)
    # and takes 3 from the front, which leaves block 2, named, in the queue.
    again = [admit_a, ("free", "a"), admit_a]
    want = [([], [], [3]), ([], [], [3, 2, 1]), ([1], [], [2])]
    assert by_manager(4, 4, again, {"a": SYSTEM}) == want
    assert serve(4, 4, again) == want
