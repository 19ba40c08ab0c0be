"""Graded tests for the S13 exercises (see exercises/s13_prefix_caching.py).

Oracles, none of them the solution: hits, hashes and free queues worked by hand; for the radix
tree, a brute-force longest common prefix with every earlier sequence, and a trie of one token
per node (a dict of prefixes) that evicts the least recently used leaf token by token; S13's
engine's scheduler (S11's `ChunkedScheduler` over a `PrefixCachingKVCacheManager`) serving
prompts one after another with a fake model (a pool too large to evict anything), its
`num_cached_tokens` read at each admission; and `PrefixCachingKVCacheManager` driven through
the same admissions and frees as your function (find the cached run, take it, allocate the
rest, name the full blocks, free last block first), its hits, evictions and free queue read
after every operation. No model is needed. What your functions return is compared as lists,
so any sequence is accepted.
"""
import random
from collections import Counter

import pytest

from exercise_loader import load_exercise
import s13_prefix_caching as s13
from s09_scheduler import Request
from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig

ex = load_exercise("s13_prefix_caching")


def refuses(what: str, fn, *args) -> None:
    """fn(*args) must raise ValueError; a failure names the call (`what`)."""
    try:
        fn(*args)
    except ValueError:
        return
    pytest.fail(f"{what}: got no error, expected ValueError")


# Exercise 1 ----------------------------------------------------------------------------------

class TokenTrie:
    """The radix tree's specification, written the slow way: every held prefix is a key of
    `used` (its tick of last use); a leaf is a prefix no other held prefix extends. Eviction
    removes the least recently used leaf, one token at a time."""

    def __init__(self, capacity=None):
        self.capacity, self.used, self.children, self.clock = capacity, {}, Counter(), 0

    def match_prefix(self, ids) -> int:
        self.clock += 1
        k = 0
        while k < len(ids) and tuple(ids[:k + 1]) in self.used:
            self.used[tuple(ids[:k + 1])] = self.clock
            k += 1
        return k

    def insert(self, ids) -> None:
        self.clock += 1
        for k in range(1, len(ids) + 1):
            prefix = tuple(ids[:k])
            if prefix not in self.used:
                self.children[prefix[:-1]] += 1
            self.used[prefix] = self.clock
        while self.capacity is not None and len(self.used) > self.capacity:
            leaf = min((p for p in self.used if self.children[p] == 0),
                       key=lambda p: (self.used[p], -len(p)))
            del self.used[leaf]
            self.children[leaf[:-1]] -= 1


def longest_common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.points(1)
def test_radix_cache_by_hand():
    cache = ex.RadixCache()
    assert cache.num_tokens == 0 and cache.match_prefix([1, 2]) == 0
    cache.insert([1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 9]) == 3                 # ends inside the first node
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]) == 5
    cache.insert([1, 2, 7])                                      # splits [1..5] after 1, 2
    assert cache.num_tokens == 6                                 # 1 2 3 4 5 and 7
    assert cache.match_prefix([1, 2, 7, 7]) == 3
    assert cache.match_prefix([1, 2, 3, 4, 5]) == 5
    assert cache.match_prefix([2]) == 0
    # Capacity 6 tokens. Ticks: 1 inserts 1 2 3 4, 2 inserts 1 2 5 6, 3 matches 1 2 3 (so 4
    # alone keeps tick 1), 4 inserts 7 8: 8 tokens. The leaves are 4 (tick 1), 5 6 (tick 2)
    # and 7 8 (tick 4): 4 goes, then 6, the last token of the next least recently used leaf.
    small = ex.RadixCache(6)
    for op, ids in [("insert", [1, 2, 3, 4]), ("insert", [1, 2, 5, 6]),
                    ("match_prefix", [1, 2, 3]), ("insert", [7, 8])]:
        getattr(small, op)(ids)
    calls = ("RadixCache(6), insert [1, 2, 3, 4], insert [1, 2, 5, 6], match [1, 2, 3], "
             "insert [7, 8]")
    assert small.num_tokens == 6, f"got num_tokens {small.num_tokens}, expected 6 after {calls}"
    got = [small.match_prefix(ids) for ids in ([1, 2, 5, 6], [1, 2, 3, 4], [7, 8])]
    assert got == [3, 3, 2], (f"match_prefix of [1, 2, 5, 6], [1, 2, 3, 4], [7, 8]: got {got}, "
                              f"expected [3, 3, 2] (4 and 6 evicted) after {calls}")
    for bad in (0, -1, 2.5, "6", True, False):               # a bool is not a capacity
        refuses(f"RadixCache({bad!r})", ex.RadixCache, bad)


def chat_workload(rng):
    """Three conversations behind one system prompt, their turns interleaved: each turn's
    prompt is its conversation so far (prompts and answers) and a new message. Small token
    ids, so prompts also share prefixes by chance."""
    system = [rng.randint(0, 3) for _ in range(rng.randint(3, 13))]
    conversations = [list(system) for _ in range(3)]
    turns = []
    for _ in range(rng.randint(8, 14)):
        c = rng.randrange(3)
        prompt = conversations[c] + [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
        answer = [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
        turns.append((prompt, answer))
        conversations[c] = prompt + answer
    return turns


def block_cache_hits(turns, block_size: int) -> list[int]:
    """S13's scheduler and block cache serve the turns one after another, each to its last
    answer token (a fake model that answers what the turn says): each turn's
    num_cached_tokens at admission."""
    longest = max(len(p) + len(a) for p, a in turns) + 1
    num_blocks = 2 + sum(-(-(len(p) + len(a)) // block_size) for p, a in turns)
    sched = ChunkedScheduler(ChunkedSchedulerConfig(1, longest, 4 * longest),
                             s13.PrefixCachingKVCacheManager(num_blocks, block_size))
    hits = []
    for k, (prompt, answer) in enumerate(turns):
        req = Request.for_tokens(f"t{k}", prompt, len(answer), arrival=k)
        sched.add_request(req)
        while True:
            out = sched.schedule()
            if req.request_id in out.scheduled_new_ids:
                hits.append(req.num_cached_tokens)
            n = out.num_scheduled_tokens[req.request_id]
            if out.num_computed_tokens[req.request_id] + n == req.num_tokens:
                req.append_token(answer[len(req.output_ids)])
            done = len(req.output_ids) == len(answer)
            sched.update_from_output(out, [req.request_id] if done else [])
            if done:
                break
    assert len(hits) == len(turns)
    return hits


@pytest.mark.points(1)
def test_radix_hits_are_the_longest_prefix_and_beat_blocks_by_the_tail():
    tails = 0
    for seed in range(40):
        rng = random.Random(seed)
        size = rng.choice([2, 3, 4, 5, 8])
        turns = chat_workload(rng)
        blocks = block_cache_hits(turns, size)
        cache = ex.RadixCache()
        computed = []             # KV written by each turn: its prompt, its answer but the last
        for k, (prompt, answer) in enumerate(turns):
            # The oracle: the longest prefix any earlier turn computed, less the last token.
            want = min(max([longest_common_prefix(prompt, s) for s in computed], default=0),
                       len(prompt) - 1)
            # The block cache takes that rounded down to whole blocks: the tail is missed.
            def where():                      # built only when an assertion fails
                return (f"seed {seed}, turn {k} of {[p for p, _ in turns]} (block size {size}), "
                        f"prompt {prompt}")
            assert blocks[k] == want // size * size, (f"oracle check: block cache got "
                                                      f"{blocks[k]}, expected "
                                                      f"{want // size * size}; {where()}")
            got = min(cache.match_prefix(prompt), len(prompt) - 1)
            assert got == want, (f"min(match_prefix(prompt), len(prompt) - 1): got {got}, "
                                 f"expected {want}; {where()}")
            assert got >= blocks[k] and got - blocks[k] == got % size, (
                f"got {got}, block cache {blocks[k]}: expected got - blocks == got % {size}; "
                f"{where()}")
            tails += got % size > 0
            computed.append(prompt + answer[:-1])
            cache.insert(computed[-1])
    assert tails > 100                       # the workload has tails for the tree to win


@pytest.mark.points(1)
def test_radix_cache_evicts_like_the_token_trie():
    rng = random.Random(131)
    evicted = 0
    for _ in range(200):
        capacity = rng.choice([None, rng.randint(1, 40)])
        mine, trie = ex.RadixCache(capacity), TokenTrie(capacity)
        ops = []                              # this case's operations so far, to replay it
        for _ in range(rng.randint(1, 30)):
            ids = [rng.randint(0, 3) for _ in range(rng.randint(0, 15))]
            if rng.random() < 0.5:
                ops.append(("match_prefix", ids))
                got, want = mine.match_prefix(ids), trie.match_prefix(ids)
                assert got == want, (f"match_prefix({ids}): got {got}, expected {want}; "
                                     f"RadixCache({capacity}) after {ops}")
            else:
                ops.append(("insert", ids))
                grown = len(trie.used) + sum(tuple(ids[:k]) not in trie.used
                                             for k in range(1, len(ids) + 1))
                mine.insert(ids)
                trie.insert(ids)
                evicted += len(trie.used) < grown              # this insert evicted
            assert mine.num_tokens == len(trie.used), (
                f"num_tokens: got {mine.num_tokens}, expected {len(trie.used)}; "
                f"RadixCache({capacity}) after {ops}")
    assert evicted > 50


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
        case = f"num_cached_tokens({earlier}, {prompt}, {size})"
        assert cached_by_scheduler(earlier, prompt, size) == want, f"oracle check: {case}"
        got = ex.num_cached_tokens(earlier, prompt, size)
        assert got == want, f"got {got}, expected {want} from {case}"
    for bad in (([A], [], 4), ([A], A, 0)):
        refuses(f"num_cached_tokens{bad}", ex.num_cached_tokens, *bad)


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
        got = ex.num_cached_tokens(earlier, prompt, size)
        assert got == want, (f"got {got}, expected {want} (the scheduler's num_cached_tokens) "
                             f"from num_cached_tokens({earlier}, {prompt}, {size})")
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


def check_serve(num_blocks, size, ops, want):
    """ex.serve against `want` (one (hit, evicted, free queue) per operation); a mismatch names
    the first operation whose result differs, the operations up to it, and both results."""
    got = serve(num_blocks, size, ops)
    call = f"serve({num_blocks}, {size}, ops)"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (f"{call}, operation {i} {ops[i][:2]}: got (hit, evicted, free) {g}, "
                        f"expected {w}; after {ops[:i + 1]}")
    assert len(got) == len(want), f"{call}: got {len(got)} results, expected {len(want)}: {ops}"


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
    check_serve(7, 4, ops, want)
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
    check_serve(5, 4, small, want_small)


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
        check_serve(num_blocks, size, ops, want)
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
    check_serve(4, 4, fits, want)
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
        refuses(f"serve({num_blocks}, {size}, {ops})", ex.serve, num_blocks, size, ops)
    # An id may come back once freed: a again hits block 1 only (at most (8 - 1) // 4 blocks)
    # and takes 3 from the front, which leaves block 2, named, in the queue.
    again = [admit_a, ("free", "a"), admit_a]
    want = [([], [], [3]), ([], [], [3, 2, 1]), ([1], [], [2])]
    assert by_manager(4, 4, again, {"a": SYSTEM}) == want
    check_serve(4, 4, again, want)
