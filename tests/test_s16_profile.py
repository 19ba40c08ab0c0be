"""Tests for chapter S16's step profiler (code/s16_profile.py).

Oracles: the same engine without the profiler (greedy tokens and finish reasons, counting or
not); S09's `StepTracer` (who ran, how many tokens, prefill or decode) and the raw
`StepResult`s an observer of the test's own keeps (the engine's clock readings, the runner's
model_s and prepare_s); ops written out by hand for a small function; hand-made profiles with
round numbers for the summary, the table, the timeline and the JSON. Timings are never
asserted, only their bookkeeping (inside the step, in order, adding up).

The engines are S09's (one slot per request) and S13's (paged, prefix caching, chunked
prefill) on the bundled model.
"""
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import s06_torch
import s09_continuous_batching as s09
import s13_prefix_caching as s13
import s16_profile as s16
from engine_testing import FailingRunner, greedy
from s01_generation_loop import ParameterError
from s09_llm import LLM
from s09_trace import DECODE, trace

PROMPTS = ["To be, or not to be", "O Romeo, Romeo!", "Now is the winter of our discontent",
           "Friends, Romans, countrymen"]
BUILDERS = {"s09": s09.build_engine, "s13": s13.build_engine}
EPS = 1e-9                      # seconds: float rounding of perf_counter differences


@pytest.fixture(scope="module")
def bundled():
    return s06_torch.load()


class Recorder:
    """The test's own observer: every StepResult, by the plan's step number."""

    def __init__(self):
        self.results = {}

    def on_plan(self, engine, plan):
        pass

    def on_step(self, engine, result):
        if result.run is not None:
            self.results[result.plan.step] = result


def run(bundled, build, observers=(), max_tokens=10, **options):
    model, tok = bundled
    engine = build(model, tok, max_num_seqs=4, **options)
    engine.observers.extend(observers)
    done = LLM(engine).generate(PROMPTS, greedy(max_tokens, ignore_eos=True))
    return [(c.token_ids, c.finish_reason) for c in done]


# --- outputs unchanged ----------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILDERS)
def test_outputs_with_the_profiler_equal_those_without(bundled, name):
    build = BUILDERS[name]
    alone = run(bundled, build)
    timed, counted = s16.StepProfiler(), s16.StepProfiler(count_ops=True)
    assert run(bundled, build, [timed]) == alone
    assert run(bundled, build, [counted]) == alone
    assert timed.profiles and counted.profiles
    assert all(p.ops is None and p.model_ops is None for p in timed.profiles)   # off by default
    assert _get_current_dispatch_mode() is None


# --- the phases of a step -------------------------------------------------------------------

def check_phases(profile, result):
    """The profile's bookkeeping against the StepResult it came from."""
    step_ms = profile.step_s * 1e3
    previous_end = 0.0
    for phase, start, end in profile.segments:
        assert 0.0 <= start <= end <= step_ms + EPS * 1e3, (phase, start, end, step_ms)
        assert start >= previous_end - EPS * 1e3, f"{phase} overlaps the phase before it"
        previous_end = end
    phases = [p for p, _, _ in profile.segments]
    assert phases == [p for p in ("propose", "schedule", "prepare", "forward", "sample",
                                  "postprocess", "update") if p in phases]
    assert {"schedule", "prepare", "forward", "sample", "postprocess", "update"} <= set(phases)
    total = sum(getattr(profile, f"{p}_s") for p in s16.PHASES)
    assert total + profile.other_s == pytest.approx(profile.step_s, abs=EPS)
    assert profile.other_s >= -EPS
    assert profile.host_s + profile.forward_s == pytest.approx(profile.step_s, abs=EPS)
    assert 0.0 <= profile.host_fraction <= 1.0
    # Each phase is the engine's reading; the model call splits at the runner's prepare_s.
    for phase in ("schedule", "sample", "postprocess", "update"):
        start, end = result.times[phase]
        assert getattr(profile, f"{phase}_s") == pytest.approx(end - start, abs=EPS)
    assert profile.prepare_s == pytest.approx(result.run.prepare_s, abs=EPS)
    assert profile.prepare_s + profile.forward_s == pytest.approx(result.run.model_s, abs=EPS)
    assert profile.step_s == result.step_s


def test_phases_lie_inside_their_step_and_match_the_plan(bundled):
    """S13 with a token budget of 32: short requests decode, then a long prompt arrives and
    is prefilled in chunks beside them (mixed steps), then everyone decodes."""
    model, tok = bundled
    engine = s13.build_engine(model, tok, max_num_seqs=4, max_num_batched_tokens=32)
    profiler, recorder, tracer = s16.profile(engine), Recorder(), trace(engine)
    engine.observers.append(recorder)
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, greedy(12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.add_request(" ".join(PROMPTS * 3), greedy(4))     # a prompt of several chunks
    while engine.has_unfinished_requests():
        engine.step()
    records = {r.step: r for r in tracer.records}
    assert [p.step for p in profiler.profiles] == sorted(recorder.results)
    kinds = set()
    for p in profiler.profiles:
        check_phases(p, recorder.results[p.step])
        record = records[p.step]
        assert p.num_seqs == len(record.running)
        assert p.num_tokens == record.num_tokens
        decodes = [kind == DECODE for kind in record.kinds]
        expected = "decode" if all(decodes) else "prefill" if not any(decodes) else "mixed"
        assert p.kind == expected, (p.step, record.kinds, record.num_scheduled_tokens)
        if p.kind == "decode":
            assert p.num_tokens == p.num_seqs
        kinds.add(p.kind)
    assert kinds == {"prefill", "mixed", "decode"}
    assert {p.num_seqs for p in profiler.profiles if p.kind == "decode"} >= {3, 4}


# --- counting ops ---------------------------------------------------------------------------

def test_the_counter_counts_the_ops_written_out_by_hand():
    a, b = torch.ones(3), torch.full((3,), 2.0)
    with s16.OpCounter() as counter:
        c = torch.add(a, b).mul(2)                    # aten::add.Tensor, aten::mul.Tensor
    assert counter.total == 2
    assert counter.by_name == {"aten::add.Tensor": 1, "aten::mul.Tensor": 1}
    assert c.tolist() == [6.0, 6.0, 6.0]              # the ops ran as they would have
    assert _get_current_dispatch_mode() is None

    def three(x):
        return x.view(-1).sum() + 1                   # view, sum, add (the scalar)
    counter = s16.count_ops(three, torch.ones(2, 2))
    assert counter.total == 3
    assert set(counter.by_name) == {"aten::view", "aten::sum", "aten::add.Tensor"}
    assert counter.count_between(counter.times[0], counter.times[-1]) == 3
    assert counter.count_between(counter.times[-1] + 1.0, counter.times[-1] + 2.0) == 0
    assert counter.times == sorted(counter.times)


def test_the_counter_enters_once_and_closes_only_its_own_mode():
    counter = s16.OpCounter()
    assert counter.close() is False                   # never entered: nothing to leave
    with counter:
        with pytest.raises(RuntimeError, match="entered once at a time"):
            counter.__enter__()
        inner = s16.OpCounter().__enter__()
        with pytest.raises(RuntimeError, match="leave it first"):
            counter.close()
        assert inner.close() is True
    assert _get_current_dispatch_mode() is None
    with pytest.raises(ZeroDivisionError):
        s16.count_ops(lambda: 1 / 0)
    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize("name", BUILDERS)
def test_a_decode_step_launches_the_same_ops_at_the_same_batch_size(bundled, name):
    profiler, recorder = s16.StepProfiler(count_ops=True), Recorder()
    run(bundled, BUILDERS[name], [profiler, recorder], max_tokens=12)
    by_size = {}
    for p in profiler.profiles:
        assert p.ops > 0 and 0 < p.model_ops <= p.ops
        # A step that takes a fresh KV block (S12 on) also zeroes it: a few more ops.
        if p.kind == "decode" and not recorder.results[p.step].plan.new_block_ids:
            by_size.setdefault(p.num_seqs, []).append((p.ops, p.model_ops))
    assert max(len(counts) for counts in by_size.values()) >= 4     # B=4 decodes, 11 steps
    for size, counts in by_size.items():
        assert len(set(counts)) == 1, (size, counts)


def test_a_step_that_raises_leaves_no_mode_entered(bundled):
    model, tok = bundled
    expected = [tokens for tokens, _ in run(bundled, s09.build_engine, max_tokens=4)]

    engine = s09.build_engine(model, tok, max_num_seqs=4)
    profiler = s16.profile(engine, count_ops=True)
    engine.runner = FailingRunner(engine.runner, failures=1)
    ids = [engine.add_request(prompt, greedy(4, ignore_eos=True)) for prompt in PROMPTS]
    tokens = {rid: [] for rid in ids}

    def step():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids

    with pytest.raises(RuntimeError, match="injected"):
        step()
    assert isinstance(_get_current_dispatch_mode(), s16.OpCounter)   # the step left it
    step()                                            # the next step's on_plan leaves it
    assert _get_current_dispatch_mode() is None
    assert [p.kind for p in profiler.profiles] == ["prefill"]

    engine.runner.failures = 1
    with pytest.raises(RuntimeError, match="injected"):
        step()
    profiler.close()
    assert _get_current_dispatch_mode() is None
    profiler.close()                                  # twice: nothing to do

    engine.runner.failures = 1
    with profiler, pytest.raises(RuntimeError, match="injected"):
        step()
    assert _get_current_dispatch_mode() is None
    while engine.has_unfinished_requests():
        step()
    assert _get_current_dispatch_mode() is None
    assert all(p.ops > 0 for p in profiler.profiles)
    # The failed steps were reverted: every request's tokens are those of a clean run.
    assert [tokens[rid] for rid in ids] == expected


# --- the worked example's arithmetic ----------------------------------------------------------

def profile_of(step_ms=2.0, ops=400, model_ops=380, kind="decode", num_seqs=4, **ms):
    """A hand-made profile: phases in ms (schedule 0.1, prepare 0.2, forward 1.0, sample 0.3,
    postprocess 0.2, update 0.1, other 0.1 unless given), laid end to end."""
    phases = dict(propose=0.0, schedule=0.1, prepare=0.2, forward=1.0, sample=0.3,
                  postprocess=0.2, update=0.1)
    phases.update(ms)
    segments, clock = [], 0.0
    for phase, length in phases.items():
        if length:
            segments.append((phase, clock, clock + length))
            clock += length
    return s16.StepProfile(
        step=7, num_seqs=num_seqs, num_tokens=num_seqs, kind=kind, step_s=step_ms / 1e3,
        **{f"{p}_s": v / 1e3 for p, v in phases.items()},
        other_s=(step_ms - sum(phases.values())) / 1e3, ops=ops, model_ops=model_ops,
        segments=tuple(segments))


def test_overhead_estimate_is_ops_times_the_cost_of_one_op():
    p = profile_of(ops=400, model_ops=380)
    assert s16.overhead_estimate(p, 2e-6) == pytest.approx(400 * 2e-6)
    assert s16.overhead_estimate(p, 2e-6, model_only=True) == pytest.approx(380 * 2e-6)
    with pytest.raises(ParameterError, match="count_ops=True") as error:
        s16.overhead_estimate(profile_of(ops=None, model_ops=None), 2e-6)
    assert error.value.parameter == "count_ops"
    for bad in (0, -1e-6, float("nan"), "2us"):
        with pytest.raises(ParameterError, match="per_op_s must be a number > 0"):
            s16.overhead_estimate(p, bad)


def test_one_tiny_op_costs_microseconds_not_milliseconds():
    per_op = s16.per_op_overhead_s("cpu", n=200, repeats=3)
    assert 1e-8 < per_op < 1e-3
    for kwargs, parameter in (({"n": 0}, "n"), ({"repeats": 1.5}, "repeats"),
                              ({"device": "tpu:x"}, "device"), ({"device": "meta"}, "device")):
        with pytest.raises(ParameterError) as error:
            s16.per_op_overhead_s(**kwargs)
        assert error.value.parameter == parameter
    if not torch.cuda.is_available():
        with pytest.raises(ParameterError, match="needs a CUDA device"):
            s16.per_op_overhead_s("cuda")


# --- summary, table, timeline, JSON ---------------------------------------------------------

def test_summary_takes_medians_per_kind_and_batch_size():
    profiles = [profile_of(step_ms=2.0, forward=1.0, ops=400),
                profile_of(step_ms=3.0, forward=1.5, ops=400),
                profile_of(step_ms=10.0, forward=8.0, ops=410),
                profile_of(step_ms=5.0, kind="prefill", num_seqs=4, ops=None, model_ops=None),
                profile_of(step_ms=4.0, num_seqs=1, forward=3.0, ops=300)]
    rows = s16.summarize(profiles)
    assert [(r.kind, r.num_seqs, r.steps) for r in rows] == [
        ("decode", 1, 1), ("decode", 4, 3), ("prefill", 4, 1)]
    four = rows[1]
    assert four.step_s == pytest.approx(3.0e-3) and four.forward_s == pytest.approx(1.5e-3)
    assert four.host_s == pytest.approx(1.5e-3) and four.ops == 400
    assert four.host_fraction == pytest.approx(0.5)      # median of 0.5, 0.5, 0.2
    assert rows[2].ops is None and rows[2].model_ops is None


def test_table_timeline_and_json_carry_the_numbers_they_were_given():
    p = profile_of(step_ms=2.0, ops=400, model_ops=380)
    table = s16.format_profile_table([p])
    header, line = table.splitlines()
    assert header.split()[:5] == ["kind", "B", "steps", "step", "ms"]
    assert "propose" not in header                      # no step drafted
    assert line.split() == ["decode", "4", "1", "2.000", "1.000", "0.100", "0.200", "0.300",
                            "0.200", "0.100", "0.100", "50.0", "400"]
    assert s16.format_profile_table(s16.summarize([p])) == table
    drafted = s16.format_profile_table([profile_of(propose=0.05, ops=None)])
    assert "propose" in drafted.splitlines()[0] and drafted.splitlines()[1].split()[-1] == "-"

    timeline = s16.format_timeline(p, width=20).splitlines()
    assert timeline[0] == "step 7  decode  B=4  T=4  2.000 ms  host 50.0%  ops 400 (model 380)"
    bars = {line.split()[0]: line for line in timeline[1:]}
    # forward runs 0.3 to 1.3 of 2.0 ms: columns 3 to 13 of 20.
    forward = bars["forward"]
    assert "0.300" in forward and "1.300" in forward
    assert forward.split("|")[1] == " " * 3 + "#" * 10 + " " * 7
    assert bars["schedule"].split("|")[1] == "#" + " " * 19
    assert "0.100 ms" in bars["other"]
    with pytest.raises(ParameterError, match="width must be an integer >= 10"):
        s16.format_timeline(p, width=5)

    item, = s16.to_json([p])
    assert item["step_ms"] == pytest.approx(2.0) and item["forward_ms"] == pytest.approx(1.0)
    assert item["host_ms"] == pytest.approx(1.0) and item["host_fraction"] == pytest.approx(0.5)
    assert item["other_ms"] == pytest.approx(0.1)
    assert (item["ops"], item["model_ops"], item["kind"], item["num_seqs"]) == (
        400, 380, "decode", 4)
    assert item["segments"][2] == ["forward", pytest.approx(0.3), pytest.approx(1.3)]
    summary, = s16.to_json(s16.summarize([p]))
    assert summary["steps"] == 1 and summary["host_ms"] == pytest.approx(1.0)


def test_profiler_keeps_the_latest_and_refuses_bad_settings(bundled):
    profiler = s16.StepProfiler(limit=2)
    run(bundled, s09.build_engine, [profiler], max_tokens=5)
    assert len(profiler.profiles) == 2 and profiler.num_profiled == 5
    assert [p.step for p in profiler.profiles] == [3, 4]
    with pytest.raises(ParameterError, match="count_ops must be True or False"):
        s16.StepProfiler(count_ops="yes")
    with pytest.raises(ParameterError, match="limit must be None or an integer >= 1"):
        s16.StepProfiler(limit=0)
