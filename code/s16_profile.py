r"""S16's step profiler: where a step's time goes, host against model, and how many ops it launches.

What is new since S15
    Part II made steps do more work per token; this chapter makes each step cost less, and a
    step has to be taken apart before it can be made cheaper. The engine already notes when
    each phase of its step began and ended (`StepResult.times`: "propose" (S15), "schedule",
    "model", "sample", "postprocess", "update"; and `run.prepare_s`, the batch preparation
    inside the model call). This module turns those readings into numbers, from outside the
    step, through the engine's observer seam (`on_plan`, `on_step`): nothing is patched.

    - `StepProfile`: one step that ran the model. Its shape (`kind`: "decode", "prefill" or
      "mixed"; B requests, T tokens) and its seconds per phase: schedule, batch preparation,
      forward (the model call less the preparation), sample, postprocess (detokenize and stop
      rules), update (the scheduler told), other (the rest: observers, building outputs).
      host_s is everything but the forward; host_fraction its share of the step. `segments`
      is the step's timeline, (phase, start ms, end ms) from the step's start.
    - `StepProfiler`, the observer that makes one per step (`profile(engine)` attaches one),
      and, with count_ops=True, counts the torch ops each step dispatches (`ops`) and those
      inside the model call (`model_ops`).
    - `OpCounter`: a `TorchDispatchMode` (PyTorch's hook that sees every aten op as the
      dispatcher runs it) that counts ops by name and notes when each one came, so ops can be
      put in the phase they ran in. It works alone too: `with OpCounter() as c: fn()`, or
      `count_ops(fn, *args)`.
    - The worked example's arithmetic: `per_op_overhead_s(device)`, the wall time of one tiny
      op (a 1-element add: the floor of dispatch), and `overhead_estimate(profile, per_op_s)`,
      ops per step times a per-op cost. With the floor the product is a fraction of the step
      (a fifth on the bundled model); with the cost an op really has in the model (the
      forward over its ops: the layer code's Python between calls, views, allocation and the
      small kernels) it is the forward.
    - Reading them: `summarize` (median per kind and batch size), `format_profile_table`,
      `format_timeline` (one step's phases as bars), `to_json` (plain dicts, times in ms, for
      the simulator and the notebook).

    What "forward" means depends on the device. On a CPU the thread that issues an op also
    runs it, so forward_s is Python issuing the ops plus the kernels computing. On CUDA a
    kernel launch returns before the kernel ends: without the engine's sync_timing=True,
    forward_s is mostly launch time and the wait for the device lands in whatever next reads
    a result (the sampler's copy to the host, in sample_s). Build a CUDA engine with
    sync_timing=True when the split between forward and sample must be the device's.

What it does not handle
    Counting ops costs a Python call per op, so a counting step is several times slower than
    an ordinary one: take op counts from one run and times from another (the counts of a
    decode step depend only on its batch size and kind, not on timing); the first counting
    step of a process also pays torch._dynamo's import (about a second on this course's
    machines), which entering a dispatch mode triggers. The counter sees the ops dispatched
    in the engine's thread, as the dispatcher meets them: under `torch.inference_mode` (the
    runner's) a composite op such as `linear` or `scaled_dot_product_attention` counts once,
    outside it as the pieces it decomposes into (`t`, `mm`, ...); a view (`view`,
    `transpose`) counts though it launches no kernel; a replayed CUDA graph counts as
    nothing; and work on another thread (an async loop's forward) is not seen. While a
    dispatch mode is active, torch.compile'd code runs eagerly (dynamo steps aside), so count
    the ops of a compiled runner by its eager twin. An engine loop whose phases overlap (S16's
    async scheduling) can report a negative other_s: the overlap. The mode is entered in
    `on_plan` and left in `on_step`; when a step raises in between, the mode stays entered
    until the next step's `on_plan` or `close()` (the profiler is also a context manager that
    closes on exit).

Use it
    import s06_torch, s13_prefix_caching as s13, s16_profile as s16
    from s09_llm import LLM
    model, tok = s06_torch.load()
    engine = s13.build_engine(model, tok, max_num_seqs=8)
    with s16.profile(engine) as profiler:
        LLM(engine).generate(["To be, or not"] * 8, max_tokens=32)
    print(s16.format_profile_table(profiler.profiles))
    print(s16.format_timeline(profiler.profiles[-1]))
    python code/s16_host.py --help                  # the chapter script (tables by batch size)

Tests
    tests/test_s16_profile.py: outputs with the profiler (counting or not) equal those
    without; phases lie inside their step, in order, without overlap, and add up to it;
    kind, B and T match the plan; a decode step's op count repeats at the same batch size;
    the counter against ops counted by hand; a step that raises leaves no mode entered; the
    table, timeline and JSON carry the numbers they were given.

References
    PyTorch, "Extending all torch API with Modes" (docs/notes/extending.rst) and
    `torch.utils._python_dispatch.TorchDispatchMode`: the hook that counts. `torch.profiler`
    is the fuller tool (kernel times, CUDA activity, Chrome traces), and heavier. vLLM times
    its steps the same way, from readings around the phases: `ObservabilityConfig.
    collect_detailed_traces` ("model", "worker": model forward and execute time per step,
    documented as possibly costly), V1's `IterationStats` / `SchedulerStats`, and the
    `VLLM_TORCH_PROFILER_DIR` hook around `torch.profiler`.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

import s01_generation_loop as s01
import s06_torch as s06
from s01_generation_loop import ParameterError

DECODE, PREFILL, MIXED = "decode", "prefill", "mixed"
KINDS = (DECODE, MIXED, PREFILL)                    # the order tables list them in
# The phases a profile times, in the order a step runs them; "prepare" and "forward" split the
# engine's "model" phase at run.prepare_s. Every one but "forward" is host work.
PHASES = ("propose", "schedule", "prepare", "forward", "sample", "postprocess", "update")
HOST_PHASES = tuple(p for p in PHASES if p != "forward")


# ---------------------------------------------------------------------------------------------
# Counting ops: a dispatch mode
# ---------------------------------------------------------------------------------------------

class OpCounter(TorchDispatchMode):
    """Counts the torch ops dispatched while it is entered, in this thread.

    total: ops counted. by_name: Counter {aten op name with its overload, e.g.
    "aten::add.Tensor": count}. times: the `time.perf_counter()` reading as each op came (in
    order), to put ops in the phase they ran in (`count_between`). Use it as a context manager
    (`with OpCounter() as c: ...`) or enter it and `close()` it (the profiler's way: entered in
    one callback, left in another). Every op runs as it would have: the mode only counts, at a
    Python call per op. Raises RuntimeError when entered while already entered.
    Source: PyTorch's `TorchDispatchMode` (torch/utils/_python_dispatch.py).
    """

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.times: list[float] = []
        self.active = False

    @property
    def total(self) -> int:
        return len(self.times)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The reading before the op runs: an op belongs to the phase that issued it.
        self.times.append(time.perf_counter())
        self.by_name[func.name()] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> OpCounter:
        if self.active:
            raise RuntimeError("an OpCounter is entered once at a time (it is already active)")
        super().__enter__()
        self.active = True
        return self

    def __exit__(self, exc_type, exc, tb):
        self.active = False
        return super().__exit__(exc_type, exc, tb)

    def close(self) -> bool:
        """Leave the mode if it is still entered; True if it was. Raises RuntimeError when
        another dispatch mode entered after it is still active: leaving this one would pop
        that one off the stack (torch's mode stack is last in, first out)."""
        if not self.active:
            return False
        if _get_current_dispatch_mode() is not self:
            raise RuntimeError("a dispatch mode entered inside this OpCounter is still active: "
                               "leave it first (modes leave last in, first out)")
        self.__exit__(None, None, None)
        return True

    def count_between(self, start: float, end: float) -> int:
        """Ops whose readings lie in [start, end] (perf_counter seconds)."""
        return bisect.bisect_right(self.times, end) - bisect.bisect_left(self.times, start)


def count_ops(fn: Callable, *args, **kwargs) -> OpCounter:
    """Run fn(*args, **kwargs) once under a fresh `OpCounter` and return the counter (its
    total, by_name, times; fn's return value is dropped: use `with OpCounter()` to keep it).
    Whatever fn raises propagates, with the mode left."""
    with OpCounter() as counter:
        fn(*args, **kwargs)
    return counter


# ---------------------------------------------------------------------------------------------
# One step, taken apart
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepProfile:
    """One step that ran the model, from its `StepResult` (all times wall seconds).

    step: the scheduler's number of the step (`plan.step`: 0-based, counting planned steps;
    S09's `StepRecord` of the same step has the same number). num_seqs: B, the requests
    scheduled. num_tokens: T, the tokens computed. kind: the step's shape, "decode" when every
    scheduled request computes one new token (with S15's drafts: one past the drafts it
    verifies), "prefill" when none does, "mixed" otherwise (a chunked prefill beside decodes).
    step_s: the whole step (`result.step_s`, from before the scheduler ran to the result
    built). propose_s (S15's drafts; 0 before), schedule_s, prepare_s (the runner's batch
    preparation, `run.prepare_s`), forward_s (the model call less prepare_s), sample_s,
    postprocess_s (detokenize and stop rules), update_s (`update_from_output`): each a
    phase's length, 0.0 when the phase did not run. other_s: step_s less all of them
    (observers' on_plan, bookkeeping, building outputs; negative only when phases overlap).
    ops: torch ops dispatched from `on_plan` to `on_step` (None unless counting), model_ops:
    those inside the model call (preparation included). segments: the timeline, ((phase,
    start_ms, end_ms), ...) from the step's start, in time order; the engine's "model" phase
    is split into "prepare" then "forward".
    """

    step: int
    num_seqs: int
    num_tokens: int
    kind: str
    step_s: float
    propose_s: float
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    postprocess_s: float
    update_s: float
    other_s: float
    ops: int | None
    model_ops: int | None
    segments: tuple[tuple[str, float, float], ...]

    @property
    def host_s(self) -> float:
        """Everything but the forward: the host's part of the step (seconds)."""
        return self.step_s - self.forward_s

    @property
    def host_fraction(self) -> float:
        """host_s / step_s, in [0, 1]."""
        return self.host_s / self.step_s if self.step_s > 0 else 0.0


def step_kind(plan) -> str:
    """"decode", "prefill" or "mixed" for a plan with scheduled tokens (see `StepProfile`)."""
    drafts = plan.scheduled_spec_decode_tokens
    decodes = [n == 1 + len(drafts.get(rid, ())) for rid, n in plan.num_scheduled_tokens.items()]
    return DECODE if all(decodes) else PREFILL if not any(decodes) else MIXED


def profile_step(result, counter: OpCounter | None = None) -> StepProfile | None:
    """The `StepProfile` of an engine step's `StepResult` (None when no model ran: a step
    that only preempted or ended requests, or had nothing to do). counter: the `OpCounter`
    that was entered for the step, or None (ops and model_ops None)."""
    run = result.run
    if run is None:
        return None
    times = result.times
    # The first phase starts at the step's start (a loop that took no readings: all "other").
    start = min((t0 for t0, _ in times.values()), default=0.0)
    spans = {}
    for phase, (t0, t1) in times.items():
        if phase == "model":
            # The runner reports its preparation as a length from the call's start; a runner
            # that does not (prepare_s 0) leaves the whole call to the forward.
            split = min(t1, t0 + getattr(run, "prepare_s", 0.0))
            spans["prepare"], spans["forward"] = (t0, split), (split, t1)
        else:
            spans[phase] = (t0, t1)
    seconds = {p: spans[p][1] - spans[p][0] if p in spans else 0.0 for p in PHASES}
    segments = tuple(sorted(((p, (t0 - start) * 1e3, (t1 - start) * 1e3)
                             for p, (t0, t1) in spans.items()), key=lambda s: (s[1], s[2])))
    ops = model_ops = None
    if counter is not None:
        ops = counter.total
        model_ops = counter.count_between(*times["model"]) if "model" in times else 0
    plan = result.plan
    return StepProfile(
        step=plan.step, num_seqs=len(plan.num_scheduled_tokens),
        num_tokens=plan.total_num_scheduled_tokens, kind=step_kind(plan), step_s=result.step_s,
        **{f"{p}_s": seconds[p] for p in PHASES},
        other_s=result.step_s - sum(seconds.values()), ops=ops, model_ops=model_ops,
        segments=segments)


# ---------------------------------------------------------------------------------------------
# The observer
# ---------------------------------------------------------------------------------------------

class StepProfiler:
    """The observer that makes a `StepProfile` for every step that runs the model, into
    `profiles` (limit: None, keep all, or keep the latest `limit`; `num_profiled` counts every
    one made).

    count_ops: also count each step's torch ops (`ops`, `model_ops`): an `OpCounter` is entered
    in `on_plan` and left in `on_step`. Counting slows the step (a Python call per op), so the
    times of a counting run are not the ones to quote. A step that raises between the two
    leaves its counter entered: the next `on_plan` leaves it (its count is dropped), and so
    does `close()` (or leaving `with profiler:`). Attach it with `engine.observers.append`, or
    `profile(engine)`. It only reads what the engine hands it. Raises ParameterError for a
    count_ops that is not a bool or a limit that is not None or an integer >= 1.
    """

    def __init__(self, count_ops: bool = False, limit: int | None = None):
        if not isinstance(count_ops, bool):
            raise ParameterError(f"count_ops must be True or False (got {count_ops!r})",
                                 "count_ops", count_ops)
        if limit is not None and (not s01.is_int(limit) or limit < 1):
            raise ParameterError(f"limit must be None or an integer >= 1 (got {limit!r})",
                                 "limit", limit)
        self.count_ops, self.limit = count_ops, limit
        self.profiles: list[StepProfile] = []
        self.num_profiled = 0
        self._counter: OpCounter | None = None

    def on_plan(self, engine, plan) -> None:
        self._stop_counting()               # left entered by a step that raised: drop it
        if self.count_ops and plan.num_scheduled_tokens:
            self._counter = OpCounter().__enter__()

    def on_step(self, engine, result) -> None:
        counter = self._stop_counting()
        profile = profile_step(result, counter)
        if profile is None:
            return
        self.profiles.append(profile)
        self.num_profiled += 1
        if self.limit is not None and len(self.profiles) > self.limit:
            del self.profiles[:len(self.profiles) - self.limit]

    def close(self) -> None:
        """Leave a counting mode still entered (after a step that raised); a no-op otherwise.
        The profiler stays attached and counts again from the next step."""
        self._stop_counting()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _stop_counting(self) -> OpCounter | None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.close()
        return counter


def profile(engine, count_ops: bool = False, limit: int | None = None) -> StepProfiler:
    """A `StepProfiler` attached to the engine (its profiles grow as the engine steps)."""
    profiler = StepProfiler(count_ops, limit)
    engine.observers.append(profiler)
    return profiler


# ---------------------------------------------------------------------------------------------
# The worked example: ops per step x the cost of one op
# ---------------------------------------------------------------------------------------------

def per_op_overhead_s(device: str | torch.device = "cpu", n: int = 2000, repeats: int = 5
                      ) -> float:
    """The wall seconds of one tiny torch op on device: n adds of two 1-element float32
    tensors (each allocating its output, as a forward's ops do) under
    `torch.inference_mode`, per op, the median over `repeats` timed runs after a warm-up.
    On CUDA the device is waited for before and after each run, so this is the rate ops can
    be issued at (launch-bound: a 1-element kernel runs faster than it is launched). Raises
    ParameterError for an unknown device, CUDA where there is none, or n / repeats that are
    not integers >= 1."""
    for name, value in (("n", n), ("repeats", repeats)):
        if not s01.is_int(value) or value < 1:
            raise ParameterError(f"{name} must be an integer >= 1 (got {value!r})", name, value)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ParameterError(f"device must name a torch device (got {device!r}): {error}",
                             "device", device) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError("device cuda needs a CUDA device (none found)", "device", device)
    if device.type not in ("cpu", "cuda"):
        raise ParameterError(f"device must be cpu or cuda (got {device})", "device", device)
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    samples = []
    with torch.inference_mode():
        for _ in range(min(n, 200)):                   # warm: allocator, first-call paths
            torch.add(a, b)
        for _ in range(repeats):
            s06.synchronize(device)
            start = time.perf_counter()
            for _ in range(n):
                torch.add(a, b)
            s06.synchronize(device)
            samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def overhead_estimate(profile, per_op_s: float, model_only: bool = False) -> float:
    """ops x per_op_s: seconds the step's ops would take if each cost one tiny op's overhead
    (the chapter's worked example: on an overhead-bound model, close to the measured step).
    profile: a `StepProfile` or `ProfileSummary` from a counting run; model_only: use
    model_ops (compare with prepare_s + forward_s) instead of ops (compare with step_s).
    Compare with the times of a run that did not count. Raises ParameterError when the
    profile has no op count or per_op_s is not a positive number."""
    ops = profile.model_ops if model_only else profile.ops
    if ops is None:
        raise ParameterError("the profile has no op count: profile with count_ops=True",
                             "count_ops")
    if not s01.is_real(per_op_s) or not per_op_s > 0:
        raise ParameterError(f"per_op_s must be a number > 0 (got {per_op_s!r})", "per_op_s",
                             per_op_s)
    return ops * float(per_op_s)


# ---------------------------------------------------------------------------------------------
# Reading profiles: summary, table, timeline, JSON
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProfileSummary:
    """The steps of one kind and batch size: steps (how many), and the median over them of
    num_tokens, step_s, each phase, other_s, host_s and host_fraction (each its own median:
    host_fraction is not host_s / step_s of the medians), ops and model_ops (None when no
    step was counted)."""

    kind: str
    num_seqs: int
    steps: int
    num_tokens: float
    step_s: float
    propose_s: float
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    postprocess_s: float
    update_s: float
    other_s: float
    host_s: float
    host_fraction: float
    ops: float | None
    model_ops: float | None


def summarize(profiles: Sequence[StepProfile]) -> list[ProfileSummary]:
    """One `ProfileSummary` per (kind, B) among profiles, decode first, then mixed and
    prefill, each by B."""
    groups: dict[tuple[str, int], list[StepProfile]] = {}
    for p in profiles:
        groups.setdefault((p.kind, p.num_seqs), []).append(p)

    def median(group, name):
        values = [getattr(p, name) for p in group if getattr(p, name) is not None]
        return statistics.median(values) if values else None

    return [ProfileSummary(kind, b, len(group), median(group, "num_tokens"),
                           *(median(group, f"{p}_s") for p in ("step",) + PHASES),
                           *(median(group, name) for name in
                             ("other_s", "host_s", "host_fraction", "ops", "model_ops")))
            for (kind, b), group in sorted(groups.items(),
                                           key=lambda item: (KINDS.index(item[0][0]),
                                                             item[0][1]))]


def format_profile_table(rows: Sequence[StepProfile] | Sequence[ProfileSummary]) -> str:
    """The profiles (summarized first) or summaries as aligned text: one line per kind and
    batch size, with steps, median step and forward ms, each host phase in ms ("propose"
    only when a step drafted), host share in % and ops per step ("-" when not counted)."""
    rows = list(rows)
    if rows and isinstance(rows[0], StepProfile):
        rows = summarize(rows)
    host = [p for p in HOST_PHASES if p != "propose" or any(r.propose_s for r in rows)]
    names = {"propose": "propose", "schedule": "sched", "prepare": "prepare",
             "sample": "sample", "postprocess": "post", "update": "update"}
    lines = [f"{'kind':<8}{'B':>4}{'steps':>6}{'step ms':>9}{'fwd ms':>9}"
             + "".join(f"{names[p]:>9}" for p in host) + f"{'other':>9}{'host %':>8}{'ops':>7}"]
    for r in rows:
        ops = "-" if r.ops is None else f"{r.ops:.0f}"
        lines.append(f"{r.kind:<8}{r.num_seqs:>4}{r.steps:>6}{r.step_s * 1e3:>9.3f}"
                     f"{r.forward_s * 1e3:>9.3f}"
                     + "".join(f"{getattr(r, p + '_s') * 1e3:>9.3f}" for p in host)
                     + f"{r.other_s * 1e3:>9.3f}{r.host_fraction * 100:>8.1f}{ops:>7}")
    return "\n".join(lines)


def format_timeline(profile: StepProfile, width: int = 60) -> str:
    """One step as text: a heading (step, kind, B, T, step ms, host %, ops), then a line per
    segment with its start and end in ms and a bar placed on a ruler `width` characters long
    for the whole step, then the other time. Raises ParameterError for a width that is not an
    integer >= 10."""
    if not s01.is_int(width) or width < 10:
        raise ParameterError(f"width must be an integer >= 10 (got {width!r})", "width", width)
    step_ms = profile.step_s * 1e3
    ops = "" if profile.ops is None else f"  ops {profile.ops} (model {profile.model_ops})"
    lines = [f"step {profile.step}  {profile.kind}  B={profile.num_seqs}  "
             f"T={profile.num_tokens}  {step_ms:.3f} ms  host {profile.host_fraction:.1%}"
             + ops]
    scale = width / step_ms if step_ms > 0 else 0.0
    for phase, start, end in profile.segments:
        first = min(width - 1, max(0, int(start * scale)))
        last = min(width, max(first + 1, round(end * scale)))   # a phase shows at least 1
        bar = " " * first + "#" * (last - first) + " " * (width - last)
        lines.append(f"  {phase:<12}{start:>9.3f}{end:>9.3f} ms |{bar}|")
    lines.append(f"  {'other':<12}{profile.other_s * 1e3:>18.3f} ms (observers, outputs)")
    return "\n".join(lines)


def to_json(rows: Sequence[StepProfile] | Sequence[ProfileSummary]) -> list[dict]:
    """Profiles (or summaries) as plain dicts: every `*_s` field and host_s as `*_ms` (floats,
    milliseconds), host_fraction, the counts as they are, segments as [[phase, start_ms,
    end_ms], ...]."""
    out = []
    for row in rows:
        item = {}
        for f in fields(row):
            value = getattr(row, f.name)
            if f.name.endswith("_s"):
                item[f.name[:-2] + "_ms"] = value * 1e3
            elif f.name == "segments":
                item["segments"] = [[phase, start, end] for phase, start, end in value]
            else:
                item[f.name] = value
        if isinstance(row, StepProfile):
            item["host_ms"], item["host_fraction"] = row.host_s * 1e3, row.host_fraction
        out.append(item)
    return out
