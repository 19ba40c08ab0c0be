"""The S16 step-overlap simulator: its schedule keeps the loops' rules, and its steps are the
engine's.

site/simulators/step-overlap/export.py records windows of decode steps of S13's engine on the
bundled model with code/s16_profile.py's StepProfiler (B = 1, 8, 16, 64) and holds `schedule`,
the timeline the page draws in four modes: eager, graph (the forward replaced by the compiled
step's time), async (code/s16_async.py's loop: the host plans and postprocesses while the
worker runs the forward) and graph+async. tests/test_s16_simulator_browser.py checks the page
against it. The oracles here do not use `schedule`'s code:

- closed forms derived by hand from the loops' rules: eager, n x the sum of a step's phases;
  async with every step alike, max(2S, S + P + F) + A for the first step, then
  max(P + F, O + U + S) + A per step while a plan follows, max(P + F, O + U) + A for the last,
  and its O + U (S schedule, P prepare, F forward, A sample, O postprocess, U update);
- rules every schedule keeps, on the exported runs and on random steps: no two boxes of a lane
  overlap; each phase of each step once, as long as recorded; async never starts prepare or
  forward N + 1 before sample N ends, never samples N before forward N ends, never launches a
  step before it is planned; the eager total is the sum of its boxes; async is never slower
  than eager nor faster than its host lane or its critical path;
- the recorded steps against the profiler's own readings (segments, other time, host
  fraction), and the engine's greedy output against S06's engine alone;
- where the graph rows' forward comes from: the benchmark record's row, read here again, or
  the static step's measured median, labelled as not compiled.
"""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest

import s03_transformer as s03
from sim_browser import load_exporter

pytestmark = pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
                                reason="data/model has no bundled model")

so = load_exporter("step-overlap", "s16_sim_export_data")
PHASES = ("schedule", "prepare", "forward", "sample", "postprocess", "update")
REL = 1e-12


@pytest.fixture(scope="module")
def data():
    return json.loads(json.dumps(so.export(), allow_nan=False))    # what the page gets


def step(s, p, f, a, o, u) -> dict:
    return {"schedule_ms": s, "prepare_ms": p, "forward_ms": f, "sample_ms": a,
            "postprocess_ms": o, "update_ms": u}


def random_steps(rng: random.Random, n: int) -> list[dict]:
    return [step(*(rng.choice((0.0, rng.uniform(0.01, 3.0))) for _ in range(6)))
            for _ in range(n)]


def async_closed_form(n: int, s, p, f, a, o, u) -> float:
    """Worked by hand from code/s16_async.py's loop, every step alike."""
    if n == 1:
        return s + p + f + a + o + u
    first = max(2 * s, s + p + f) + a                  # step 1 is planned during forward 0
    middle = (n - 2) * (max(p + f, o + u + s) + a)     # each sample waits for the later lane
    last = max(p + f, o + u) + a                       # nothing left to plan
    return first + middle + last + o + u


def boxes(result, lane=None):
    lanes = ("host", "worker") if lane is None else (lane,)
    return [(ln, *b) for ln in lanes for b in result["lanes"][ln]]


def check_rules(steps: list[dict], mode: str, result: dict, graph_forward: float) -> None:
    n = len(steps)
    for lane in ("host", "worker"):
        previous = 0.0
        for phase, i, start, end in result["lanes"][lane]:
            assert start >= previous and end >= start, (mode, lane, phase, i)
            previous = end
    found = {}
    for lane, phase, i, start, end in boxes(result):
        assert (phase, i) not in found, (mode, phase, i)
        found[phase, i] = (lane, start, end)
        want = graph_forward if phase == "forward" and mode.startswith("graph") \
            else steps[i][f"{phase}_ms"]
        assert end - start == pytest.approx(want, rel=1e-9, abs=1e-12), (mode, phase, i)
    assert set(found) == {(p, i) for p in PHASES for i in range(n)}
    ends = [end for *_, end in boxes(result)]
    assert result["end"] == max(ends)
    assert result["outputs_at"] == [found["postprocess", i][2] for i in range(n)]
    if not mode.endswith("async"):
        assert result["lanes"]["worker"] == []
        order = [(b[1], PHASES.index(b[0])) for b in result["lanes"]["host"]]
        assert order == sorted(order)                     # step by step, phases in turn
        spans = [b[3] - b[2] for b in result["lanes"]["host"]]
        assert result["end"] == pytest.approx(math.fsum(spans), rel=REL, abs=1e-12)
        for a, b in zip(result["lanes"]["host"], result["lanes"]["host"][1:]):
            assert b[2] == a[3]                           # no gap: the thread never waits
        return
    for (phase, i), (lane, start, end) in found.items():
        assert lane == ("worker" if phase in ("prepare", "forward") else "host")
    for i in range(n):
        assert found["sample", i][1] >= found["forward", i][2]          # logits first
        assert found["postprocess", i][1] >= found["sample", i][2]
        assert found["schedule", i][2] <= found["prepare", i][1]        # planned, then launched
        assert found["prepare", i][2] <= found["forward", i][1]
        if i + 1 < n:
            assert found["prepare", i + 1][1] >= found["sample", i][2]  # needs step i's tokens
            assert found["forward", i + 1][1] >= found["sample", i][2]
        if i >= 2:              # step i is planned after step i - 2's update, in the loop
            assert found["schedule", i][1] >= found["update", i - 2][2]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("lengths", [(0.1, 0.2, 3.0, 0.3, 0.4, 0.1),    # device-bound
                                     (0.5, 0.1, 0.6, 0.2, 0.9, 0.3),    # host-bound
                                     (2.0, 0.1, 0.5, 0.2, 0.3, 0.1),    # a slow plan
                                     (0.0, 0.0, 1.0, 0.0, 0.0, 0.0),    # forward only
                                     (0.2, 0.1, 0.0, 0.3, 0.4, 0.1)])   # a free forward
def test_every_step_alike_matches_the_closed_forms(n, lengths):
    steps = [step(*lengths)] * n
    s, p, f, a, o, u = lengths
    g = 0.25
    eager = so.schedule("eager", steps)
    assert eager["end"] == pytest.approx(n * sum(lengths), rel=REL)
    graph = so.schedule("graph", steps, g)
    assert graph["end"] == pytest.approx(n * (sum(lengths) - f + g), rel=REL)
    got = so.schedule("async", steps)
    assert got["end"] == pytest.approx(async_closed_form(n, *lengths), rel=REL, abs=1e-12)
    both = so.schedule("graph+async", steps, g)
    assert both["end"] == pytest.approx(async_closed_form(n, s, p, g, a, o, u), rel=REL,
                                        abs=1e-12)
    for mode, result in (("eager", eager), ("graph", graph), ("async", got),
                         ("graph+async", both)):
        check_rules(steps, mode, result, g)
    summary = so.summary(got, n)
    assert summary["per_step"] == pytest.approx(got["end"] / n, rel=REL)
    assert summary["host_busy"] == pytest.approx(n * (s + a + o + u), rel=REL, abs=1e-12)
    assert summary["worker_busy"] == pytest.approx(n * (p + f), rel=REL, abs=1e-12)


def test_random_steps_keep_the_rules():
    rng = random.Random(16)
    for n in itertools.chain(range(1, 6), (9, 16)):
        for _ in range(12):
            steps = random_steps(rng, n)
            g = rng.uniform(0.0, 2.0)
            results = {m: so.schedule(m, steps, g) for m in so.MODES}
            for mode, result in results.items():
                check_rules(steps, mode, result, g)
            bound_checks(steps, results, g)


def bound_checks(steps, results, g) -> None:
    """Async against eager, its host lane and its critical path (plan 0, then prepare, forward
    and sample of every step in line, then the last step's postprocess and update)."""
    for mode, forward in (("async", None), ("graph+async", g)):
        sync = results["eager" if forward is None else "graph"]
        result = results[mode]
        fwd = [s["forward_ms"] if forward is None else forward for s in steps]
        assert result["end"] <= sync["end"] * (1 + REL) + 1e-12
        host = math.fsum(s[f"{p}_ms"] for s in steps
                         for p in ("schedule", "sample", "postprocess", "update"))
        assert result["end"] >= host * (1 - REL) - 1e-12
        line = (steps[0]["schedule_ms"] + math.fsum(s["prepare_ms"] + f + s["sample_ms"]
                                                    for s, f in zip(steps, fwd))
                + steps[-1]["postprocess_ms"] + steps[-1]["update_ms"])
        assert result["end"] >= line * (1 - REL) - 1e-12


@pytest.mark.parametrize("args", [("lazy", [step(1, 1, 1, 1, 1, 1)]), ("eager", []),
                                  ("graph", [step(1, 1, 1, 1, 1, 1)]),
                                  ("graph+async", [step(1, 1, 1, 1, 1, 1)], -1.0),
                                  ("async", [step(1, 1, math.nan, 1, 1, 1)]),
                                  ("eager", [step(1, 1, 1, math.inf, 1, 1)]),
                                  ("eager", [step(1, -0.5, 1, 1, 1, 1)]),
                                  ("eager", [{"schedule_ms": 1.0}])])
def test_bad_input_is_refused(args):
    with pytest.raises(ValueError, match="must|needs") as error:
        so.schedule(*args)
    assert error.value.parameter == ("mode" if args[0] == "lazy" else "graph_forward_ms"
                                     if args[0].startswith("graph") else "steps")


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------

def test_reference_schedules_keep_the_rules(data):
    assert data["modes"] == list(so.MODES) and data["phases"] == list(PHASES)
    assert [r["batch_size"] for r in data["runs"]] == [1, 8, 16, 64]
    for run in data["runs"]:
        steps, g = run["steps"], run["graph"]["forward_ms"]
        results = run["reference"]
        assert set(results) == set(so.MODES)
        for mode, result in results.items():
            assert len(result["outputs_at"]) == len(steps) == so.STEPS
            check_rules(steps, mode, result, g)
            assert result == so.schedule(mode, steps, g)      # the JSON round trip kept it
        bound_checks(steps, results, g)
        forward_gain = math.fsum(s["forward_ms"] - g for s in steps)
        assert results["graph"]["end"] == pytest.approx(results["eager"]["end"] - forward_gain,
                                                        rel=1e-9)
    assert data["runs"][data["defaults"]["run"]]["batch_size"] == 16
    assert 1 <= data["defaults"]["steps"] <= so.STEPS


def test_recorded_steps_are_the_profilers(data):
    for run in data["runs"]:
        numbers = [s["step"] for s in run["steps"]]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))   # consecutive
        assert numbers[0] > so.WARMUP_STEPS                 # prefill and warm-up before them
        for s in run["steps"]:
            assert s["num_seqs"] == run["batch_size"]
            lengths = [s[f"{p}_ms"] for p in PHASES]
            assert all(x > 0 for x in lengths), s           # every phase ran
            assert s["other_ms"] == pytest.approx(s["step_ms"] - math.fsum(lengths), abs=1e-9)
            assert 0 <= s["other_ms"] < 0.25 * s["step_ms"]
            assert s["host_fraction"] == pytest.approx(1 - s["forward_ms"] / s["step_ms"],
                                                       rel=1e-9)
            assert s["wall_ms"] >= s["step_ms"] - 1e-9      # step() wraps the step
            # the profiler's own timeline: the phases in turn, each as long as its field
            assert [seg[0] for seg in s["segments"]] == list(PHASES)
            previous = 0.0
            for (phase, start, end), length in zip(s["segments"], lengths):
                assert start >= previous - 1e-9 and end == pytest.approx(start + length,
                                                                         abs=1e-9)
                previous = end
            assert s["segments"][-1][2] <= s["step_ms"] + 1e-9
        for how in ("eager", "static", "async"):
            assert run["measured"][how]["step_ms"] > 0 and run["measured"][how]["forward_ms"] > 0


def test_the_graph_forward_is_the_record_or_the_static_step_labelled(data):
    record = so.read_record()
    assert data["record"]["present"] == (record is not None)
    for run in data["runs"]:
        b, graph = run["batch_size"], run["graph"]
        if graph["source"] == "record":
            # the benchmark's compiled variant, read here from the record as it is
            rows = [record.get("host", {}).get("models", {}).get("bundled", {})
                    .get("batches", {}).get(str(b), {}).get("compiled")]
            if record.get("async", {}).get("batch") == b:
                rows.append(record["async"]["rows"].get("compiled"))
            assert graph["forward_ms"] in [r["forward_ms"] for r in rows if r], b
            assert "s16_host.json" in graph["label"] and f"B = {b}" in graph["label"]
        else:
            assert graph["source"] == "static-eager"
            assert graph["forward_ms"] == run["static_forward_ms"] > 0
            assert "not compiled" in graph["label"]
    assert data["record"]["used"] == any(r["graph"]["source"] == "record" for r in data["runs"])


def bench_record(host_batches: dict, async_batch=None, async_rows=None) -> dict:
    """A record shaped as benchmarks/bench_s16_host.py writes it (the parts read here)."""
    record = {"host": {"models": {"bundled": {"batches": host_batches},
                                  "mid": {"batches": {"16": {"compiled": {"forward_ms": 9.0}}}}}}}
    if async_batch is not None:
        record["async"] = {"batch": async_batch, "rows": async_rows}
    return record


@pytest.mark.parametrize("record,expected", [
    (None, None), ({}, None), ({"host": "no"}, None),
    (bench_record({"16": {"eager": {"forward_ms": 2.0}, "compiled": {"forward_ms": 0.75}}}), 0.75),
    (bench_record({"8": {"compiled": {"forward_ms": 0.5}}}), None),          # another B
    (bench_record({}, 16, {"async compiled": {"forward_ms": 0.4, "step_ms": 1.0},
                           "compiled": {"forward_ms": 0.6, "step_ms": 1.2}}), 0.6),
    (bench_record({}, 8, {"compiled": {"forward_ms": 0.6}}), None),
    (bench_record({"16": {"compiled": {"step_ms": 1.0}}}), None),            # no forward
    (bench_record({"16": {"compiled": {"forward_ms": -1.0}}}), None),
    (bench_record({"16": {"compiled": {"forward_ms": 0.0}}}), None),
])
def test_the_record_reader(record, expected):
    got = so.compiled_forward_from_record(record, 16)
    if expected is None:
        assert got is None
    else:
        assert got[0] == expected and "B = 16" in got[1] and "s16_host.json" in got[1]
    rows = {k: v["step_ms"] for k, v in (record or {}).get("async", {}).get("rows", {}).items()
            if "step_ms" in v}
    expected_async = {"batch": record["async"]["batch"], "rows": rows} if rows else None
    assert so.async_from_record(record) == expected_async


def test_the_engines_outputs_are_s06_alone(data):
    import s04_sampling as s04
    import s06_torch as s06
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    alone = s06.Engine(model, tokenizer, max_context=so.MAX_CONTEXT)
    for run in data["runs"]:
        first = run["first_request"]
        want = alone.generate(first["prompt"], s04.SamplingParams(
            temperature=0.0, max_tokens=first["max_tokens"], ignore_eos=True))
        assert first["output_ids"] == want.token_ids, run["id"]
        assert first["text"] == want.text, run["id"]
        # the static and async runs of the same requests said the same, request by request
        assert run["texts_equal"] == {"static": True, "async": True}, run["id"]
        assert run["outputs_equal"] == {"static": True, "async": True}, run["id"]
