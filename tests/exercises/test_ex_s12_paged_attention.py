"""Graded tests for the S12 exercises (see exercises/s12_paged_attention.py).

Oracles, none of them the solution: slots, block counts and tables worked by hand; S12's
`slot_mapping` for every chunk S11's scheduler plans over S12's `KVCacheManager` (a fake model,
small pools that preempt); a NumPy pool
(num_blocks, block_size) written through your slot mapping and read back by gathering whole
blocks through the block table, the way S12's attention reads (`pool[block_table]`), which must
give every token at its position; the smallest block count that holds the tokens, found by
counting up; S12's tested block pool and KV manager (code/s12_paged_attention.py), driven on
random workloads, whose block tables your `allocate` must reproduce block for block; and, for
the copy-on-write fork, a pool of real storage (a dict from slot to the token written there)
that replays every copy you ask for, and must read back through every block table exactly the
tokens each sequence was given, with reference counts equal to how many tables hold each block.
"""
import math
import random
from collections import Counter, deque

import numpy as np
import pytest

from exercise_loader import load_exercise
from s09_scheduler import Request

ex = load_exercise("s12_paged_attention")


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_slot_mapping_by_hand():
    assert list(ex.slot_mapping([7, 2], 3, 3, 4)) == [31, 8, 9]
    assert list(ex.slot_mapping([7, 2], 0, 8, 4)) == [28, 29, 30, 31, 8, 9, 10, 11]
    assert list(ex.slot_mapping([5], 2, 1, 16)) == [82]            # a decode: one slot
    assert list(ex.slot_mapping([3, 9, 1], 5, 0, 2)) == []
    assert list(ex.slot_mapping([4, 0, 6], 0, 3, 1)) == [4, 0, 6]    # block_size 1: slot = block
    for bad in (([1], 0, 2, 1), ([1, 2], 7, 2, 4), ([1], 0, 1, 0), ([1], -1, 1, 4),
                ([1], 0, -1, 4)):
        with pytest.raises(ValueError):
            ex.slot_mapping(*bad)


@pytest.mark.points(1)
def test_slot_mapping_writes_what_the_block_table_reads():
    rng = random.Random(12)
    for _ in range(300):
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        num_blocks = rng.randint(2, 40)
        length = rng.randint(1, (num_blocks - 1) * block_size)
        held = math.ceil(length / block_size)
        table = rng.sample(range(num_blocks), held)                 # any blocks, any order
        pool = np.full((num_blocks, block_size), -1, dtype=np.int64)
        tokens = [rng.randint(0, 10**6) for _ in range(length)]
        start, written = 0, []
        while start < length:                                       # random chunks, then decodes
            n = rng.randint(1, length - start)
            slots = [int(s) for s in ex.slot_mapping(table, start, n, block_size)]
            assert len(slots) == n
            pool.reshape(-1)[slots] = tokens[start:start + n]
            written += slots
            start += n
        assert len(set(written)) == length                          # no slot written twice
        gathered = pool[table].reshape(-1)[:length]                 # (held * block_size,)[:S]
        assert gathered.tolist() == tokens, (block_size, table)
        others = np.setdiff1d(np.arange(num_blocks), table)
        assert (pool[others] == -1).all()                           # nothing outside the table


@pytest.mark.points(1)
def test_slot_mapping_matches_the_scheduler_and_slot_mapping_of_s12():
    # S11's scheduler over S12's block manager (S12's engine's), a fake model (one token for
    # each request whose new tokens reach its end), small pools so that requests are
    # preempted: every scheduled chunk's slots.
    import s12_paged_attention as s12
    from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig
    rng, checked, preempted = random.Random(34), 0, 0
    for _ in range(30):
        block_size = rng.choice([1, 2, 4, 16])
        seats = rng.randint(1, 4)
        budget = rng.randint(seats, 40)
        num_blocks = rng.randint(64 // block_size + 2, 200 // block_size + 2)
        sched = ChunkedScheduler(ChunkedSchedulerConfig(seats, 64, budget),
                                 s12.KVCacheManager(num_blocks, block_size))
        reqs = {}
        for step in range(40):
            if rng.random() < 0.4:
                rid = f"r{step}"
                prompt = rng.randint(1, 40)
                reqs[rid] = Request.for_tokens(rid, [5] * prompt, rng.randint(1, 64 - prompt),
                                               arrival=len(reqs))
                sched.add_request(reqs[rid])
            out = sched.schedule()
            preempted += len(out.preempted_ids)
            finished = []
            for rid, n in out.num_scheduled_tokens.items():
                start, table = out.num_computed_tokens[rid], list(out.block_tables[rid])
                want = s12.slot_mapping(table, start, n, block_size)
                assert [int(x) for x in ex.slot_mapping(table, start, n, block_size)] == want
                checked += 1
                req = reqs[rid]
                if start + n == req.num_tokens:
                    req.append_token(1000 + req.num_tokens)
                    if len(req.output_ids) >= req.params.max_tokens:
                        finished.append(rid)
            sched.update_from_output(out, finished)
    assert checked > 300 and preempted > 5


# Exercise 2 ----------------------------------------------------------------------------------

def blocks_for(tokens: int, block_size: int) -> int:
    """The fewest blocks that hold `tokens`, by counting up (no division)."""
    k = 0
    while k * block_size < tokens:
        k += 1
    return k


@pytest.mark.points(1)
def test_num_new_blocks_by_hand_and_by_counting():
    assert ex.num_new_blocks(15, 1, 2, 16) == 1
    assert ex.num_new_blocks(15, 1, 1, 16) == 0
    assert ex.num_new_blocks(0, 0, 183, 16) == 12                   # a 183-token prompt
    assert ex.num_new_blocks(16, 1, 1, 16) == 1                     # the 17th token
    assert ex.num_new_blocks(3, 4, 5, 4) == 0                       # blocks held ahead
    for tokens in range(0, 40):
        for new in range(0, 20):
            for block_size in (1, 3, 16):
                held = blocks_for(tokens, block_size) + (tokens % 3 == 0)
                want = max(0, blocks_for(tokens + new, block_size) - held)
                assert ex.num_new_blocks(tokens, held, new, block_size) == want
    for bad in ((17, 1, 1, 16), (0, 0, 1, 0), (-1, 0, 1, 4), (0, 0, -1, 4), (0, -1, 0, 4)):
        with pytest.raises(ValueError):
            ex.num_new_blocks(*bad)


@pytest.mark.points(2)
def test_allocate_by_hand_and_against_the_real_block_pool():
    table, queue = [3], deque([5, 1, 4])
    assert ex.allocate(table, queue, 4, 5, 4) is True
    assert table == [3, 5, 1] and list(queue) == [4]
    assert ex.allocate(table, queue, 9, 4, 4) is True               # 13 tokens: one more block
    assert table == [3, 5, 1, 4] and list(queue) == []
    assert ex.allocate(table, queue, 13, 3, 4) is True              # 16 fit in 4 blocks
    assert ex.allocate(table, queue, 16, 1, 4) is False             # all or nothing
    assert table == [3, 5, 1, 4] and list(queue) == []
    real_pool_agrees(random.Random(5), trials=40, steps=60)


def real_pool_agrees(rng: random.Random, trials: int, steps: int) -> None:
    """S12's KV manager and your allocate, side by side on random requests: the same answer
    (room or not) and the same block table after every call; the free queue S12 keeps is
    replayed by your own deque (front allocated, freed blocks appended to the back)."""
    import s12_paged_attention as s12
    checked = refused = 0
    for _ in range(trials):
        block_size = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randint(4, 30)
        manager = s12.KVCacheManager(num_blocks, block_size)       # block 0: the null block
        queue = deque(manager.pool.free_block_queue.block_ids())
        tables: dict[str, list[int]] = {}
        tokens: dict[str, int] = {}
        requests: dict[str, Request] = {}        # the manager keys its tables by request id
        for step in range(steps):
            if tables and rng.random() < 0.2:                       # a finish, abort or preempt
                rid = rng.choice(sorted(tables))
                manager.free(requests[rid])
                queue.extend(reversed(tables.pop(rid)))             # the tail first, to the back
                tokens.pop(rid)
                assert list(queue) == manager.pool.free_block_queue.block_ids()
                continue
            rid = rng.choice(sorted(tables) + [f"r{step}"])
            n = rng.randint(1, 3 * block_size)
            table = tables.get(rid, [])
            mine = list(table)
            ok = ex.allocate(mine, queue, tokens.get(rid, 0), n, block_size)
            request = requests.setdefault(rid, Request.for_tokens(rid, [5]))
            real = manager.allocate_slots(request, n)
            assert ok == real, (rid, tokens.get(rid, 0), n, block_size)
            if real:
                tables[rid], tokens[rid] = mine, tokens.get(rid, 0) + n
                assert mine == list(manager.block_table(rid))
                checked += 1
            else:
                assert mine == table
                refused += 1
            assert list(queue) == manager.pool.free_block_queue.block_ids()
            manager.check()
    assert checked > 500 and refused > 50


# Exercise 3 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_fork_and_copy_on_write_by_hand():
    tables, ref, queue = {"a": [4]}, {4: 1}, deque([9, 2])
    ex.fork(tables, ref, "a", "b")
    assert tables == {"a": [4], "b": [4]} and ref == {4: 2}
    tables["b"].append(0)                                           # the child's own list
    assert tables["a"] == [4]
    tables["b"].pop()
    assert tuple(ex.append_slot(tables, ref, queue, "b", 3, 4)) == (39, (4, 9))
    assert tables == {"a": [4], "b": [9]} and ref == {4: 1, 9: 1} and list(queue) == [2]
    assert tuple(ex.append_slot(tables, ref, queue, "a", 3, 4)) == (19, None)  # its own now
    assert tuple(ex.append_slot(tables, ref, queue, "a", 4, 4)) == (8, None)   # a new block
    assert tables["a"] == [4, 2] and ref == {4: 1, 9: 1, 2: 1} and list(queue) == []
    with pytest.raises(ValueError):
        ex.append_slot(tables, ref, queue, "b", 4, 4)               # needs a block, none free
    assert tables["b"] == [9] and ref == {4: 1, 9: 1, 2: 1}
    assert list(ex.free(tables, ref, queue, "a")) == [2, 4]         # the tail first
    assert list(queue) == [2, 4] and ref == {9: 1} and "a" not in tables
    # A full shared block is only read: the fork's next token goes to a new block, no copy.
    tables, ref, queue = {"p": [1, 3]}, {1: 1, 3: 1}, deque([0, 5])
    ex.fork(tables, ref, "p", "c")
    assert tuple(ex.append_slot(tables, ref, queue, "c", 8, 4)) == (0, None)
    assert tables["c"] == [1, 3, 0] and ref == {1: 2, 3: 2, 0: 1}
    assert list(ex.free(tables, ref, queue, "p")) == []              # still held by c
    assert ref == {1: 1, 3: 1, 0: 1}
    for call in (lambda: ex.fork(tables, ref, "zz", "y"), lambda: ex.fork(tables, ref, "c", "c"),
                 lambda: ex.free(tables, ref, queue, "zz"),
                 lambda: ex.append_slot(tables, ref, queue, "c", 5, 4)):   # 3 blocks, not 2
        with pytest.raises(ValueError):
            call()


@pytest.mark.points(3)
def test_copy_on_write_keeps_every_sequence_intact_on_real_storage():
    rng = random.Random(1212)
    copies = forks = 0
    for trial in range(60):
        block_size = rng.choice([1, 2, 4, 8])
        num_blocks = rng.randint(8, 48)
        queue = deque(rng.sample(range(num_blocks), num_blocks))
        tables: dict[str, list[int]] = {}
        ref: dict[int, int] = {}
        storage: dict[int, int] = {}                                # slot -> token written
        tokens: dict[str, list[int]] = {}                           # what each sequence was given
        for step in range(120):
            op = rng.random()
            if not tables or op < 0.1:
                rid = f"s{trial}.{step}"
                tables[rid], tokens[rid] = [], []
            elif op < 0.25:
                parent = rng.choice(sorted(tables))
                child = f"{parent}/{step}"
                ex.fork(tables, ref, parent, child)
                tokens[child] = list(tokens[parent])
                forks += 1
            elif op < 0.35:
                rid = rng.choice(sorted(tables))
                before = list(queue)
                freed = [int(b) for b in ex.free(tables, ref, queue, rid)]
                assert list(queue) == before + freed                # appended to the back
                tokens.pop(rid)
            else:
                rid = rng.choice(sorted(tables))
                n = len(tokens[rid])
                last = tables[rid][-1] if tables[rid] else None
                shared = last is not None and n % block_size and ref[last] > 1
                front = queue[0] if queue else None
                try:
                    slot, copy = ex.append_slot(tables, ref, queue, rid, n, block_size)
                except ValueError:
                    assert front is None                            # only when none is free
                    continue
                if n % block_size == 0 or shared:
                    assert tables[rid][-1] == front                 # from the front
                if shared:
                    assert tuple(copy) == (last, front)
                    old, new = copy
                    for i in range(block_size):                     # the engine's block copy
                        if old * block_size + i in storage:
                            storage[new * block_size + i] = storage[old * block_size + i]
                    copies += 1
                else:
                    assert copy is None
                assert ref[slot // block_size] == 1                 # never write a shared block
                token = rng.randint(0, 10**6)
                storage[slot] = token
                tokens[rid].append(token)
            held = Counter(b for t in tables.values() for b in t)
            assert dict(held) == {b: c for b, c in ref.items() if c > 0}
            assert sorted(list(queue) + list(held)) == list(range(num_blocks))
            for rid, table in tables.items():
                n = len(tokens[rid])
                assert len(table) == math.ceil(n / block_size)
                read = [storage[table[p // block_size] * block_size + p % block_size]
                        for p in range(n)]
                assert read == tokens[rid], (rid, table)
    assert copies > 100 and forks > 300
