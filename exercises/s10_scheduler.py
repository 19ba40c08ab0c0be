"""S10 exercises: conservative admission (a policy the chapter does not contain), the running
requests and their preemptions, the waiting queue's order.

Fill in each one, then grade your work:

    make grade            # or: python exercises/grade.py s10

The chapter's code is in code/s10_scheduler.py (`Scheduler.schedule`, `admits`, `_victim`,
`_preempt`, `_to_waiting`, `TokenKVPool`). Exercise 1 is a subclass of that real scheduler:
the tests run it and the stock (optimistic) one on the same seeded workloads, driven by a fake
model, and count preemptions and tokens. Exercises 2 and 3 are functions of your own: the tests
compare them with values worked by hand and with what S10's tested `Scheduler` does, step by
step, on random queues (no model is needed). Reference solutions are in exercises/solutions/
-- try first, peek later.

Every count here is in tokens: a request that computes n tokens in a step needs n tokens of
the step's token budget and n more KV positions.
"""
from __future__ import annotations

from typing import Sequence

from s09_scheduler import Request
from s10_scheduler import Scheduler, SchedulerConfig


# Exercise 1: conservative admission (3 points) -------------------------------------------------
# S10's `Scheduler` admits optimistically, as vLLM V1 does: a waiting request joins when its
# tokens fit the free KV now, and when the running requests outgrow the KV a few steps later,
# one of them is preempted and recomputed. SGLang admits conservatively: before a request joins,
# it keeps KV aside for what the running requests will still decode, scaled by an estimate
# (`new_token_ratio`) of how much of their max_tokens they will really use. Here you write
# that policy as a subclass of the REAL scheduler, through its seam `Scheduler.admits`.

class ReservingScheduler(Scheduler):
    """S10's `Scheduler` with conservative admission: `admits` (yours) refuses the head of the
    waiting queue when the KV it would leave free cannot hold what everyone may still decode.

    new_token_ratio: a float in [0, 1], the share of each RUNNING request's remaining output
    that is reserved (1.0: all of it; SGLang starts high and lowers it while no retraction
    happens). Raises ValueError outside [0, 1].
    """

    def __init__(self, config: SchedulerConfig, kv, new_token_ratio: float = 1.0):
        super().__init__(config, kv)
        if not isinstance(new_token_ratio, (int, float)) or not 0 <= new_token_ratio <= 1:
            raise ValueError(f"new_token_ratio must be in [0, 1] (got {new_token_ratio!r})")
        self.new_token_ratio = float(new_token_ratio)

    def admits(self, request: Request, num_new_tokens: int) -> bool:
        """True when `request`, the head of the waiting queue, may join in this step.

        The scheduler calls this once a seat and the step's token budget allow the request's
        num_new_tokens (its prompt, or after a preemption its prompt + outputs), and before
        it takes the request's KV. At that moment `self.running` holds every running request
        (those admitted earlier in this step included) and `self.kv.num_free_tokens` is the
        KV left after this step's allocations so far. A request's remaining output is
        `request.params.max_tokens - len(request.output_ids)` tokens.

        The rule: admit when no request is running (otherwise a request whose whole output
        cannot be reserved would wait forever); else admit when
            num_new_tokens + the request's own remaining output
            + new_token_ratio x (the sum of every running request's remaining output)
        is at most the free KV. The candidate's own output is reserved whole (SGLang does the
        same for the request it admits). Read the state; change nothing.
        Example: KV capacity 40; a running request (prompt 10, max_tokens 20) has made 1
        token and holds 11 positions after this step's decode, so 29 are free. A waiting
        request with a prompt of 8 and max_tokens 5 needs 8 + 5 + 19 = 32 > 29 at ratio 1.0:
        refused; at ratio 0.5, 8 + 5 + 9.5 = 22.5: admitted.
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
