"""S10 exercises, reference solutions: conservative admission, the running requests and their
preemptions, the waiting queue's order.

Try the stubs in exercises/s10_scheduler.py first; grade these with
`python exercises/grade.py --solutions s10`.

Sources followed: SGLang's conservative admission (`PrefillAdder` in
python/sglang/srt/managers/schedule_policy.py reserves, for every running request, its remaining
max_new_tokens times `new_token_ratio`, and for the request it admits its input plus its whole
remaining max_new_tokens); the two phases of vLLM V1's `Scheduler.schedule` (running requests
first, preempting the last admitted, or under priority the lowest priority, when KV runs out;
then waiting requests while the budgets allow, only if nobody was preempted); the chapter's
rules (unlike vLLM V1, a request that is its own victim does not stop the running requests
after it).
"""
from __future__ import annotations

from typing import Sequence

from s09_scheduler import Request
from s10_scheduler import Scheduler, SchedulerConfig

POLICIES = ("fcfs", "priority")


# Exercise 1: conservative admission -----------------------------------------------------------

class ReservingScheduler(Scheduler):
    """S10's scheduler with SGLang-style conservative admission (see the stub's docstring)."""

    def __init__(self, config: SchedulerConfig, kv, new_token_ratio: float = 1.0):
        super().__init__(config, kv)
        if not isinstance(new_token_ratio, (int, float)) or not 0 <= new_token_ratio <= 1:
            raise ValueError(f"new_token_ratio must be in [0, 1] (got {new_token_ratio!r})")
        self.new_token_ratio = float(new_token_ratio)

    def admits(self, request: Request, num_new_tokens: int) -> bool:
        if not self.running:                 # alone, it must be let in, or it waits forever
            return True
        own = num_new_tokens + request.params.max_tokens - len(request.output_ids)
        others = sum(self.new_token_ratio * (r.params.max_tokens - len(r.output_ids))
                     for r in self.running)
        return own + others <= self.kv.num_free_tokens


# Exercise 2: the running requests and their preemptions --------------------------------------

def schedule_running(running: Sequence[tuple[str, int, int, int]], kv_free_tokens: int,
                     policy: str = "fcfs") -> tuple[list[str], list[str]]:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES} (got {policy!r})")
    if kv_free_tokens < 0 or any(held < 0 for _, held, _, _ in running):
        raise ValueError("KV counts must be >= 0")
    still = [list(r) for r in running]              # [id, held, priority, arrival], in order
    free, scheduled, preempted = kv_free_tokens, [], []
    i = 0
    while i < len(still):
        rid, itself = still[i][0], False
        while free < 1:
            victim = still[-1] if policy == "fcfs" else max(still, key=lambda r: (r[2], r[3]))
            at = still.index(victim)
            still.pop(at)
            free += victim[1]                       # held includes this step's token if scheduled
            if victim[0] in scheduled:
                scheduled.remove(victim[0])
            preempted.append(victim[0])
            if victim[0] == rid:                    # it waits; the next one takes index i
                itself = True
                break
            if at < i:
                i -= 1
        if itself:
            continue
        free -= 1
        still[i][1] += 1
        scheduled.append(rid)
        i += 1
    return scheduled, preempted


# Exercise 3: the waiting queue's order -------------------------------------------------------

def waiting_order(events: Sequence[tuple], policy: str = "fcfs") -> list[str]:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES} (got {policy!r})")
    key: dict[str, tuple[int, int]] = {}            # request id -> (priority, arrival)
    queue: list[str] = []

    def place(rid: str, front: bool) -> None:
        if policy == "fcfs":
            queue.insert(0, rid) if front else queue.append(rid)
            return
        at = next((k for k, other in enumerate(queue) if key[other] > key[rid]), len(queue))
        queue.insert(at, rid)

    for event in events:
        kind, rid = event[0], event[1]
        if kind == "add":
            key[rid] = (int(event[2]), len(key))
            place(rid, front=False)
        elif kind == "preempt":
            place(rid, front=True)
        elif kind in ("admit", "abort"):
            if rid in queue:
                queue.remove(rid)
        else:
            raise ValueError(f"unknown event {kind!r}")
    return queue
