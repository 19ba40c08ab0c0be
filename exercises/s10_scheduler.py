"""S10 exercises: admission under two budgets, the running requests and their preemptions, the
waiting queue's order.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s10

The chapter's code is in code/s10_scheduler.py (`Scheduler.schedule`, `_victim`, `_preempt`,
`_to_waiting`, `TokenKVPool`). Write your own versions here: the graded tests compare you with
values worked by hand and with what S10's tested `Scheduler` does, step by step, on random
queues driven by a fake model (no model is needed). Reference solutions are in
exercises/solutions/ -- try first, peek later.

Every count here is in tokens: a request that computes n tokens in a step needs n tokens of
the step's token budget and n more KV positions.
"""
from __future__ import annotations

from typing import Sequence


# Exercise 1: admission under seats, tokens and KV (3 points) ----------------------------------
# After the running requests have their tokens, waiting requests are admitted from the head of
# the queue while three things allow it: a free seat (max_num_seqs), room in the step's token
# budget, and free KV. The first request that does not fit stops admission: nobody overtakes
# the head, so the policy's order holds.

def admit(waiting: Sequence[tuple[str, int]], num_running: int, max_num_seqs: int,
          token_budget: int, kv_free_tokens: int) -> list[str]:
    """The ids admitted in this step, in order, as a list (any sequence is accepted: the tests
    compare list(result)).

    waiting: (request id, num_new_tokens) in queue order, the head first; num_new_tokens is
    what the request computes when admitted (its prompt, or prompt + outputs after a
    preemption). num_running: requests already running (they hold seats). token_budget:
    tokens left in this step's budget. kv_free_tokens: free KV positions.
    A request is admitted when num_running + (admitted so far) < max_num_seqs, its tokens fit
    in what is left of token_budget and of kv_free_tokens; each admission uses its tokens of
    both. Stop at the first request that does not fit.
    Example: admit([("a", 5), ("b", 9), ("c", 1)], 1, 4, 12, 20) -> ["a"] (b needs 9 tokens,
    7 are left in the budget; c may not overtake it).
    Raises ValueError for num_running, token_budget or kv_free_tokens < 0, max_num_seqs < 1,
    or a num_new_tokens < 1.
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: the running requests and their preemptions (4 points) ----------------------------
# The running requests are scheduled first, in the order they were admitted. Each is decoding
# and needs one more KV position. When none is free, a victim is preempted: its KV is freed
# and it goes back to the waiting queue, to recompute later.

def schedule_running(running: Sequence[tuple[str, int, int, int]], kv_free_tokens: int,
                     policy: str = "fcfs") -> tuple[list[str], list[str]]:
    """(scheduled ids, preempted ids) for the running requests of one step: a pair of lists
    (any two sequences are accepted: the tests compare them as lists).

    running: (request id, KV tokens it holds, priority, arrival) in admission order.
    kv_free_tokens: free KV positions before this step. Go through the requests in order; each
    needs one KV position. While the request cannot get one, preempt a victim among the
    requests still running (those already scheduled in this step and the request itself
    included): "fcfs", the most recently admitted (the last one still running); "priority",
    the one with the largest (priority, arrival). The victim's KV comes back (what it held,
    and the position it was given in this step if it was scheduled already), and it is no
    longer scheduled. If the victim is the request itself, it does not run in this step; the
    requests after it go on, and may use the KV it gave back.
    Returns the scheduled ids in admission order and the preempted ids in the order they were
    preempted. You may assume no request holds every KV position there is (kv_free_tokens +
    the sum of all held): such a request can never grow, and the scheduler ends it instead.
    Example: schedule_running([("a", 10, 0, 0), ("b", 8, 0, 1), ("c", 5, 0, 2)], 1) ->
    (["a", "b"], ["c"]): a takes the free position, b preempts c and takes one of its 5.
    Raises ValueError for an unknown policy, kv_free_tokens < 0 or a held count < 0.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: the waiting queue's order (3 points) ---------------------------------------------
# Under "fcfs" a new request joins the back of the queue and a preempted one goes to the front
# (it was admitted before everyone waiting). Under "priority" every request, new or preempted,
# takes its place in (priority, arrival) order: lower priority values first, then earlier
# arrivals.

def waiting_order(events: Sequence[tuple], policy: str = "fcfs") -> list[str]:
    """The waiting queue after the events (in the order they happened), head first, as a list
    of ids. A deque or any other sequence is accepted too: the tests compare list(result).

    events: ("add", request id, priority): a new request, whose arrival is the number of
    "add" events before it (0, 1, ...); ("admit", request id): the request leaves the queue to
    run (it is always the head); ("preempt", request id): a running request comes back, with
    the priority and arrival of its "add"; ("abort", request id): the request leaves the queue
    if it is in it (an abort of a running or finished request changes nothing here).
    Example: waiting_order([("add", "a", 0), ("add", "b", 0), ("admit", "a"),
    ("add", "c", 0), ("preempt", "a")]) -> ["a", "b", "c"].
    Raises ValueError for an unknown policy or event kind.
    """
    raise NotImplementedError("exercise 3")
