"""Graded tests for the S12 exercises (see exercises/s12_paged_attention.py).

Oracles, none of them the solution: values worked by hand; S11's real `ChunkedScheduler` over
S12's real `KVCacheManager`, driven with a fake model (one token per scheduled request and
step), whose counters give the waste of every step (capacity - free - used) and whose
`num_preemptions` says whether a seat count preempts, tried for every seat count (more seats
can preempt where fewer and still more do not: the seeded queues include such cases, counted)
and every candidate block size; and, for the copy-on-write fork, a pool of real storage (a dict
from slot to the token written there) that replays every copy you ask for, and must read back
through every block table exactly the tokens each sequence was given, with reference counts
equal to how many tables hold each block. Block 0 is the null block: never in a table or a
free queue.
"""
import math
import random
from collections import Counter, deque

import pytest

from exercise_loader import load_exercise
from s09_scheduler import Request

ex = load_exercise("s12_paged_attention")


def run_real(requests, num_blocks, block_size, max_num_seqs):
    """S11's scheduler over S12's manager on this queue, to the end: (preemptions, positions
    wasted, positions held), the last two summed over the steps as the manager counts them
    right after each plan. A preempted request recomputes (S10), so the run always ends."""
    import s12_paged_attention as s12
    from s11_chunked_prefill import ChunkedScheduler, ChunkedSchedulerConfig
    max_len = max(p + o for p, o in requests)
    kv = s12.KVCacheManager(num_blocks, block_size)
    sched = ChunkedScheduler(ChunkedSchedulerConfig(max_num_seqs, max_len), kv)
    reqs = {}
    for i, (prompt_len, max_tokens) in enumerate(requests):
        reqs[f"r{i}"] = Request.for_tokens(f"r{i}", [5] * prompt_len, max_tokens, arrival=i)
        sched.add_request(reqs[f"r{i}"])
    wasted = held = 0
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        held_now = kv.capacity - kv.num_free_tokens
        held += held_now
        wasted += held_now - kv.num_used_tokens
        finished = []
        for rid, n in out.num_scheduled_tokens.items():
            req = reqs[rid]
            if out.num_computed_tokens[rid] + n == req.num_tokens:     # its last token: sample
                req.append_token(1000 + req.num_tokens)
                if len(req.output_ids) >= req.params.max_tokens:
                    finished.append(rid)
        sched.update_from_output(out, finished)
        kv.check()
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == num_blocks - 1                       # everything back
    return sched.num_preemptions, wasted, held


def random_queue(rng, n, max_len=40):
    return [(rng.randint(1, max_len // 2), rng.randint(1, max_len // 2)) for _ in range(n)]


# Exercise 1 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_run_waste_by_hand():
    assert tuple(ex.run_waste([(5, 3)], 4)) == (6, 24)
    assert tuple(ex.run_waste([(5, 3)], 1)) == (0, 5 + 6 + 7)
    assert tuple(ex.run_waste([(16, 1)], 16)) == (0, 16)             # one full block, one step
    assert tuple(ex.run_waste([(1, 2), (3, 1)], 8)) == (7 + 6 + 5, 24)
    assert tuple(ex.run_waste([], 16)) == (0, 0)
    for bad in (([(5, 3)], 0), ([(0, 3)], 4), ([(5, 0)], 4)):
        with pytest.raises(ValueError):
            ex.run_waste(*bad)


@pytest.mark.points(1)
def test_run_waste_matches_the_real_manager_over_a_run():
    rng = random.Random(1201)
    for _ in range(25):
        requests = random_queue(rng, rng.randint(1, 6))
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        need = sum(math.ceil((p + o - 1) / block_size) for p, o in requests)
        preempted, wasted, held = run_real(requests, need + 1, block_size, len(requests))
        assert preempted == 0
        got = tuple(int(x) for x in ex.run_waste(requests, block_size))
        assert got == (wasted, held), (
            f"got (wasted, held) {got}, expected {(wasted, held)} (the real manager summed "
            f"over the run) from run_waste({requests}, {block_size})")


@pytest.mark.points(1)
def test_largest_block_size_against_every_candidate_run_for_real():
    assert ex.largest_block_size([(5, 3)], [1, 2, 4, 8], 0.2) == 2
    assert ex.largest_block_size([(5, 3)], [8, 4], 0.25) == 8
    assert ex.largest_block_size([(5, 3)], [4, 8], 0.1) is None
    # An empty workload holds and wastes nothing: every candidate passes (the docstring's rule,
    # wasted <= share x held, no 0 / 0), and the largest wins, whatever the share.
    assert ex.largest_block_size([], [4, 16, 8], 0.0) == 16
    assert ex.largest_block_size([], [1], 1.0) == 1
    for bad in (([(5, 3)], [], 0.1), ([(5, 3)], [4], 1.5), ([(5, 3)], [4], -0.1)):
        with pytest.raises(ValueError):
            ex.largest_block_size(*bad)
    rng = random.Random(1202)
    candidates = [1, 2, 4, 8, 16, 32]
    for _ in range(12):
        requests = random_queue(rng, rng.randint(2, 6), max_len=120)
        share = rng.choice([0.02, 0.05, 0.1, 0.2, 0.3])
        ok = []
        for bs in candidates:
            need = sum(math.ceil((p + o - 1) / bs) for p, o in requests)
            _, wasted, held = run_real(requests, need + 1, bs, len(requests))
            if wasted <= share * held:
                ok.append(bs)
        want = max(ok) if ok else None
        order = rng.sample(candidates, 6)
        got = ex.largest_block_size(requests, order, share)
        assert got == want, (f"got {got}, expected {want} (block sizes within the share when "
                             f"run for real: {ok}) from largest_block_size({requests}, "
                             f"{order}, {share})")


# Exercise 2 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_max_num_seqs_by_hand():
    assert ex.max_num_seqs_without_preemption([(4, 6)] * 3, 7, 4) == 2
    assert ex.max_num_seqs_without_preemption([(4, 6)] * 3, 6, 4) == 1   # two also collide
    assert ex.max_num_seqs_without_preemption([(4, 6)] * 3, 10, 4) == 3  # 9 usable: all fit
    assert ex.max_num_seqs_without_preemption([(2, 1)], 2, 2) == 1
    # More seats can preempt where fewer do not and still more do not: the real scheduler over
    # this queue is free of preemption with 1 to 6 seats as [yes, yes, no, yes, no, no]. The
    # answer is 4; stopping at the first seat count that preempts says 2.
    queue = [(3, 9), (3, 4), (6, 8), (5, 12), (2, 12), (11, 12)]
    got = ex.max_num_seqs_without_preemption(queue, 22, 2)
    assert got == 4, (f"max_num_seqs_without_preemption({queue}, 22, 2): got {got}, expected 4 "
                      f"(preemption-free with 1 to 6 seats: yes, yes, no, yes, no, no)")
    for bad in (([], 8, 4), ([(4, 6)], 1, 4), ([(4, 6)], 8, 0), ([(0, 6)], 8, 4),
                ([(4, 0)], 8, 4), ([(8, 10)], 4, 4)):                   # 17 tokens > 3 blocks
        with pytest.raises(ValueError):
            ex.max_num_seqs_without_preemption(*bad)


@pytest.mark.points(2)
def test_max_num_seqs_against_the_real_scheduler_at_every_seat_count():
    rng = random.Random(1203)
    edge = random.Random(1213)
    interesting = not_monotone = 0
    cases = [([(3, 9), (3, 4), (6, 8), (5, 12), (2, 12), (11, 12)], 22, 2)]
    for trial in range(70):
        if trial < 40:              # any pool from the largest request alone to all at once
            n = rng.randint(2, 7)
            requests = random_queue(rng, n)
            block_size = rng.choice([1, 2, 4, 8])
            lo, hi = 0.0, 1.0
        else:                       # tighter pools, where a seat more can help or hurt
            n = edge.randint(5, 7)
            requests = [(edge.randint(1, 12), edge.randint(1, 12)) for _ in range(n)]
            block_size = 2
            lo, hi = 0.2, 0.6
        gen = rng if trial < 40 else edge
        alone = max(math.ceil((p + o - 1) / block_size) for p, o in requests)
        total = sum(math.ceil((p + o - 1) / block_size) for p, o in requests)
        first = alone + int(lo * (total - alone))
        num_blocks = gen.randint(first, max(first, alone + int(hi * (total - alone)))) + 1
        cases.append((requests, num_blocks, block_size))
    for requests, num_blocks, block_size in cases:
        n = len(requests)
        free = [run_real(requests, num_blocks, block_size, k)[0] == 0 for k in range(1, n + 1)]
        want = max(k for k in range(1, n + 1) if free[k - 1])
        got = ex.max_num_seqs_without_preemption(requests, num_blocks, block_size)
        assert got == want, (
            f"max_num_seqs_without_preemption({requests}, {num_blocks}, {block_size}): got "
            f"{got}, expected {want} (the real scheduler is free of preemption with 1 to {n} "
            f"seats: {['yes' if f else 'no' for f in free]})")
        interesting += 1 < want < n
        not_monotone += not all(free[:want])          # a seat count below the answer preempts
    assert interesting >= 5 and not_monotone >= 3, (interesting, not_monotone)


# Exercise 3 ----------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_fork_and_copy_on_write_by_hand():
    tables, ref, queue = {"a": [4]}, {4: 1}, deque([9, 2])
    ex.fork(tables, ref, "a", "b")
    assert tables == {"a": [4], "b": [4]} and ref == {4: 2}
    tables["b"].append(99)                                          # the child's own list
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
    tables, ref, queue = {"p": [1, 3]}, {1: 1, 3: 1}, deque([7, 5])
    ex.fork(tables, ref, "p", "c")
    assert tuple(ex.append_slot(tables, ref, queue, "c", 8, 4)) == (28, None)
    assert tables["c"] == [1, 3, 7] and ref == {1: 2, 3: 2, 7: 1}
    assert list(ex.free(tables, ref, queue, "p")) == []              # still held by c
    assert ref == {1: 1, 3: 1, 7: 1}
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
        queue = deque(rng.sample(range(1, num_blocks), num_blocks - 1))  # 0: the null block
        tables: dict[str, list[int]] = {}
        ref: dict[int, int] = {}
        storage: dict[int, int] = {}                                # slot -> token written
        tokens: dict[str, list[int]] = {}                           # what each sequence was given
        for step in range(120):
            op = rng.random()
            case = f"trial {trial} (block_size {block_size}, {num_blocks} blocks), step {step}"
            if not tables or op < 0.1:
                rid = f"s{trial}.{step}"
                tables[rid], tokens[rid] = [], []
                call = f"a new sequence {rid!r}"
            elif op < 0.25:
                parent = rng.choice(sorted(tables))
                child = f"{parent}/{step}"
                call = f"fork(tables, ref, {parent!r}, {child!r}) of table {tables[parent]}"
                ex.fork(tables, ref, parent, child)
                tokens[child] = list(tokens[parent])
                forks += 1
            elif op < 0.35:
                rid = rng.choice(sorted(tables))
                before = list(queue)
                call = f"free(tables, ref, queue, {rid!r}) of table {tables[rid]}"
                freed = [int(b) for b in ex.free(tables, ref, queue, rid)]
                assert list(queue) == before + freed, (
                    f"got free queue {list(queue)}, expected {before + freed} (the returned "
                    f"blocks {freed} appended to the back) from {call}; {case}")
                tokens.pop(rid)
            else:
                rid = rng.choice(sorted(tables))
                n = len(tokens[rid])
                last = tables[rid][-1] if tables[rid] else None
                shared = last is not None and n % block_size and ref[last] > 1
                front = queue[0] if queue else None
                call = (f"append_slot(tables, ref, queue, {rid!r}, {n}, {block_size}) with table "
                        f"{tables[rid]}, ref counts {[ref[b] for b in tables[rid]]}, queue front "
                        f"{front}")
                try:
                    slot, copy = ex.append_slot(tables, ref, queue, rid, n, block_size)
                except ValueError as error:
                    assert front is None, (f"got ValueError ({error}), expected a slot (a "
                                           f"free block is left) from {call}; {case}")
                    continue
                if n % block_size == 0 or shared:
                    assert tables[rid][-1] == front, (
                        f"got last block {tables[rid][-1]}, expected {front} (the front of "
                        f"the free queue) from {call}; {case}")
                if shared:
                    assert copy is not None and tuple(copy) == (last, front), (
                        f"got copy {copy}, expected {(last, front)} (the shared last block "
                        f"is copied before it is written) from {call}; {case}")
                    old, new = copy
                    for i in range(block_size):                     # the engine's block copy
                        if old * block_size + i in storage:
                            storage[new * block_size + i] = storage[old * block_size + i]
                    copies += 1
                else:
                    assert copy is None, f"got copy {copy}, expected None from {call}; {case}"
                assert ref.get(slot // block_size) == 1, (
                    f"got slot {slot} in block {slot // block_size} with ref count "
                    f"{ref.get(slot // block_size)}, expected a block held once (never write a "
                    f"shared block) from {call}; {case}")
                token = rng.randint(0, 10**6)
                storage[slot] = token
                tokens[rid].append(token)
            held = Counter(b for t in tables.values() for b in t)
            counts = {b: c for b, c in ref.items() if c > 0}
            assert dict(held) == counts, (
                f"got ref counts {counts}, expected {dict(held)} (how many tables hold each "
                f"block) after {call}; {case}")
            blocks = sorted(list(queue) + list(held))
            assert blocks == list(range(1, num_blocks)), (
                f"got free queue + held blocks {blocks}, expected each of 1 to "
                f"{num_blocks - 1} once, after {call}; {case}")
            for rid, table in tables.items():
                n = len(tokens[rid])
                assert len(table) == math.ceil(n / block_size), (
                    f"got {len(table)} blocks in {rid!r}'s table {table}, expected "
                    f"{math.ceil(n / block_size)} for its {n} tokens, after {call}; {case}")
                read = [storage.get(table[p // block_size] * block_size + p % block_size)
                        for p in range(n)]
                assert read == tokens[rid], (
                    f"got {read} read back through {rid!r}'s table {table}, expected "
                    f"{tokens[rid]}, after {call}; {case}")
    assert copies > 100 and forks > 300, (copies, forks)
