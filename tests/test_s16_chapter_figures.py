"""Chapter S16's figures against what they are computed from.

What is new here: the chapter's measured numbers (chapters/s16-host.md) checked against the
committed benchmark record chapters/figures/s16_host.json (written by
`python benchmarks/bench_s16_host.py --record`). The chapter marks each paragraph that quotes
the record with an inline comment `<!-- record: key, key -->` naming the record's keys; the
tests below take the chapter's phrases as it writes them and compute every number in them from
the record here, rounded as the chapter rounds it (ratios as "2.40x" are eager step / other
step, shares as "18%", milliseconds to two places, and so on). Nothing is re-measured and no
model runs.

Kinds of figure checked:

- every `<!-- record: ... -->` marker names keys that are in the record, and every marker is
  one this module checks (a new marker fails `test_every_record_marker_is_checked_here`);
- the measured numbers of each marked paragraph (the decode step at B = 1 and 8, the compile
  times, the compiled and static ratios, the mid-size model's bandwidth, async scheduling at
  B = 16, the batch-1 table of section E) and of the figure's caption (torch, threads, cores,
  load);
- the worked example's arithmetic, recomputed from the record: the cost per op calibrated at
  B = 1 (the forward over the model call's ops), the prediction for B = 8 (the ops at that
  cost plus B = 1's engine phases) against the step measured, the tiny add's floor
  (ops per step x `per_op_overhead_s`) as a share of the step, the forward's slope per row
  (a least-squares line over B = 1, 8, 32, 64), Horace He's 3.6 us an op;
- figures carried from S06 (344 ATen ops, 621 kernels, 0.36 ms) and the arithmetic the
  Motivation does with them;
- the quiz's numbers (site/quizzes/s16-host.json) that come from the record or from arithmetic;
- the excerpts: every literalinclude marker (`:pyobject:`, `:start-after:`, `:end-before:`)
  names an object or text that is in its code file (a dotted `:pyobject:` is resolved class by
  class with `ast`);
- the figure chapters/figures/s16_host.png: `scripts/s16_figure.py --check` (run in this
  process through its `main`, so matplotlib is imported once) and no legend covering data.

What it does not check: numbers the chapter marks `<!-- probe, not in the record -->` (the
GIL convoy probe, the KV-write probe, the fused-attention probe) and the prose that says it is
not the record (the "separate probe" of async scheduling's Deep dive, "an earlier full run"'s
1.56x, which is only checked to differ from the record); figures from outside sources (gpt-fast,
vLLM's blogs and pull requests, Horace He's 280 thousand ops per second are quoted, not
recomputed, beyond their arithmetic).

Run it: `.venv/bin/pytest -q tests/test_s16_chapter_figures.py` (about 1.5 s of tests, 3.5 s
with pytest's start; the figure's test, matplotlib's import and two drawings, is most of it).

References: tests/test_s15_chapter_figures.py (the same checks for S15), benchmarks/
bench_s16_host.py (what writes the record and what each key means), scripts/s16_figure.py and
scripts/figure_io.py (the drawing and its --check), tests/legend_check.py.
"""
from __future__ import annotations

import ast
import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from bench_testing import record_markers, resolve

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "s16-host.md"
S06_CHAPTER = ROOT / "chapters" / "s06-torch.md"
QUIZ = ROOT / "site" / "quizzes" / "s16-host.json"
RECORD = ROOT / "chapters" / "figures" / "s16_host.json"
FIGURE = ROOT / "chapters" / "figures" / "s16_host.png"

# The markers this module checks, as the chapter writes them (one test or more each).
MARKERS = {
    'host.models.bundled.batches["1"].eager',
    'host.models.bundled.batches["8"].eager',
    "machine.per_op_overhead_s",
    "compile",
    "compiled.short.bundled, compiled.checks",
    "host.models.bundled.batches[*].static",
    "compiled.long.bundled",
    "compiled.short.mid",
    "compiled.bandwidth",
    "async",
    "int4.rows",
    "compile.in_process.mid, int4.int4_compile_times_s",
}


def text(path: Path | None = None) -> str:
    return " ".join((path or CHAPTER).read_text().split())       # line breaks as spaces


def assert_in_chapter(*phrases: str) -> None:
    t = text()
    for phrase in phrases:
        assert phrase in t, f"the chapter should say {phrase!r}"


WORDS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}


def ms(v: float) -> str:
    return f"{v:.2f}"


def x(v: float) -> str:
    return f"{v:.2f}x"


def pct(v: float) -> str:
    return f"{v:.0%}"


@pytest.fixture(scope="module")
def rec() -> dict:
    assert RECORD.exists(), ("the chapter quotes chapters/figures/s16_host.json: "
                             "python benchmarks/bench_s16_host.py --record")
    return json.loads(RECORD.read_text())


def bundled(rec) -> dict:
    return rec["host"]["models"]["bundled"]["batches"]


def eager(rec, batch: int) -> dict:
    return bundled(rec)[str(batch)]["eager"]


# --- the markers ------------------------------------------------------------------------------

def test_every_record_marker_names_keys_in_the_record(rec):
    markers = record_markers(CHAPTER.read_text())
    assert markers
    for marker in markers:
        for key in marker.split(", "):
            assert resolve(rec, key), key


def test_every_record_marker_is_checked_here():
    """A paragraph marked with a key this module does not know is a figure nobody checks."""
    assert set(record_markers(CHAPTER.read_text())) == MARKERS


def test_the_record_is_a_full_run_on_one_thread(rec):
    config = rec["config"]
    assert not config["quick"], "the committed record is a full run, not --quick"
    assert config["threads"] == 1 and config["device"] == "cpu"
    assert config["batches"] == [1, 8, 32, 64] and config["async_batch"] == 16


def test_the_caption(rec):
    config = rec["config"]
    loads = [rec["load_average"]["start"][0], rec["load_average"]["end"][0]]
    loads += [v for part in rec.values() if isinstance(part, dict)
              for v in part.get("load_average_1min", [])]
    assert_in_chapter(f"(torch {config['torch']}, {config['threads']} thread, "
                      f"{config['logical_cores']} shared cores, one-minute load "
                      f"{min(loads):.1f} to {max(loads):.1f})")


# --- the worked example: a step is a few hundred tiny ops -------------------------------------

def test_the_decode_step_at_b1(rec):
    e = eager(rec, 1)
    times = e["step_ms_all"]
    assert len(times) == e["steps"]
    assert statistics.median(times) == pytest.approx(e["step_ms"])
    assert e["forward_ms"] + e["host_ms"] == pytest.approx(e["step_ms"])
    assert_in_chapter(
        f"It dispatches {e['ops']} ops, {e['model_ops']} of them inside the model call "
        f"({e['ops'] - e['model_ops']} sample the token), and the benchmark's record times it "
        f"at {ms(e['step_ms'])} ms, the forward {ms(e['forward_ms'])} ms (medians of "
        f"{e['steps']} steps, which spread from {min(times):.1f} to {max(times):.1f} ms on "
        "this shared machine)")


def test_the_worked_example(rec):
    """Calibrate at B = 1, predict B = 8, compare with the step the record measures there."""
    one, eight = eager(rec, 1), eager(rec, 8)
    per_op = one["forward_ms"] / one["model_ops"]                 # ms an op
    assert eight["ops"] == one["ops"] and eight["model_ops"] == one["model_ops"]
    forward = eight["model_ops"] * per_op
    predicted = forward + one["host_ms"]
    assert_in_chapter(
        f"Calibrate the cost per op on this step: {ms(one['forward_ms'])} ms / "
        f"{one['model_ops']} ops = {per_op * 1e3:.1f} µs",
        f"A decode step of eight requests dispatches the same {eight['ops']} ops",
        f"so the formula predicts the same step: {ms(forward)} ms of forward "
        f"({eight['model_ops']} ops at {per_op * 1e3:.1f} µs) plus {ms(one['host_ms'])} ms of "
        f"the engine's phases, {ms(predicted)} ms.",
        f"The record measures {ms(eight['step_ms'])} ms, {ms(eight['forward_ms'])} of them the "
        "forward.")
    assert 0.5 < predicted / eight["step_ms"] < 1            # "the ops price most of it"


def test_what_grows_with_the_rows(rec):
    batches = [1, 8, 32, 64]
    forwards = [eager(rec, b)["forward_ms"] for b in batches]
    mean_b, mean_f = statistics.fmean(batches), statistics.fmean(forwards)
    slope = (sum((b - mean_b) * (f - mean_f) for b, f in zip(batches, forwards))
             / sum((b - mean_b) ** 2 for b in batches))          # least squares, ms a row
    one, eight = eager(rec, 1), eager(rec, 8)
    assert_in_chapter(
        "the forward is " + ", ".join(ms(f) for f in forwards[:-1]) + f" and {ms(forwards[-1])}"
        f" ms at B = 1, 8, 32 and 64, {slope:.2f} ms more a row",
        f"the engine's phases ({ms(one['host_ms'])} ms at B = 1, {ms(eight['host_ms'])} at "
        "B = 8: more rows to sample and detokenize)",
        f"eight times the rows cost {eight['step_ms'] / one['step_ms']:.1f} times the step")


def test_the_tiny_op_floor_and_the_cost_per_op(rec):
    one = eager(rec, 1)
    tiny = rec["machine"]["per_op_overhead_s"]
    assert rec["host"]["per_op_overhead_s"] == tiny
    floor_ms = one["ops"] * tiny * 1e3
    per_op_us = one["forward_ms"] / one["model_ops"] * 1e3
    he_ms = one["model_ops"] * 3.6e-3                              # 3.6 µs an op
    assert round(1 / 280e3 * 1e6, 1) == 3.6                        # 280 thousand ops a second
    assert_in_chapter(
        f"{one['model_ops']} × 3.6 µs = {he_ms:.1f} ms, near the {ms(one['forward_ms'])} ms "
        "measured here",
        f"an add of two one-element tensors: {tiny * 1e6:.2f} µs, and {one['ops']} × "
        f"{tiny * 1e6:.2f} µs = {floor_ms:.2f} ms, {pct(floor_ms / one['step_ms'])} of the step",
        "An op in a model costs more than four times as much")
    assert 4 < per_op_us / (tiny * 1e6) < 5


def test_figures_carried_from_s06(rec):
    """The Motivation's numbers are S06's; the 2.9 million is 2 x the record's parameters."""
    s06 = text(S06_CHAPTER)
    for phrase in ("dispatches 344 ATen operations", "621 with SDPA attention", "0.36 ms"):
        assert phrase in s06, phrase
    params = rec["host"]["models"]["bundled"]["parameters"]
    assert f"2 \\times {params:,}".replace(",", "{,}") in s06
    host_ms = 621 * 5e-3
    assert round(host_ms) == 3 and round(host_ms / 0.36) == 9
    assert_in_chapter(
        f"344 ATen operations (PyTorch's internal operator calls), for about "
        f"{2 * params / 1e6:.1f} million floating-point operations",
        "launches 621 kernels, about 3 ms of host time at 5 µs per launch, some nine times the "
        "0.36 ms")


# --- compiling: what it costs -----------------------------------------------------------------

def test_what_a_compile_costs(rec):
    c = rec["compile"]
    cold, warm = c["cold"]["compile_times_s"], c["warm"]["compile_times_s"]
    order = [str(s) for s in sorted(c["sizes"], reverse=True)]         # largest first
    assert list(cold) == order and list(warm) == order
    assert c["cold"]["cache_dir"] == c["warm"]["cache_dir"]            # "the same cache"
    first, rest = order[0], order[1:]
    assert sum(cold.values()) <= c["cold"]["compile_s"] + 1e-6
    assert_in_chapter(
        f"The benchmark compiles the bundled model's {WORDS[len(order)]} buckets, largest first",
        "| bucket | " + " | ".join(order) + " | all |",
        "| cold, s | " + " | ".join(f"{cold[b]:.2f}" for b in order)
        + f" | {c['cold']['compile_s']:.2f} |",
        "| warm, s | " + " | ".join(f"{warm[b]:.2f}" for b in order)
        + f" | {c['warm']['compile_s']:.2f} |",
        f"The processes took {c['cold']['process_s']:.1f} s and {c['warm']['process_s']:.1f} s "
        "in all")
    # Core idea's summary of the same table
    cold_rest = [cold[b] for b in rest]
    mid = [v for k, v in c["in_process"]["mid"]["compiled"].items()]
    assert all(warm[b] < 0.5 for b in rest) and warm[first] > 0.5   # "(the first bucket more)"
    assert_in_chapter(
        f"in the record {min(cold_rest):.0f} to {max(cold_rest):.0f} s for a bucket of the "
        "bundled model with inductor's on-disk cache cold and under half a second warm (the "
        f"first bucket more), {min(mid):.0f} to {max(mid):.0f} s cold for the mid-size model")
    int4 = rec["int4"]["int4_compile_times_s"]
    assert list(int4) == ["1"]                                       # batch 1: one bucket
    assert_in_chapter(f"took {min(mid):.1f} to {max(mid):.1f} s each, and its int4 step "
                      f"{int4['1']:.1f} s")


# --- the compiled and static steps ------------------------------------------------------------

def ratio(rec, batch: int, variant: str) -> float:
    rows = bundled(rec)[str(batch)]
    return rows["eager"]["step_ms"] / rows[variant]["step_ms"]


def test_the_compiled_step_on_the_bundled_model(rec):
    short, long = rec["compiled"]["short"]["bundled"], rec["compiled"]["long"]["bundled"]
    for b in (1, 8, 32, 64):                      # the section's ratios are the host section's
        assert short[str(b)]["ratio"] == pytest.approx(ratio(rec, b, "compiled"))
        assert long[str(b)]["ratio"] == pytest.approx(
            long[str(b)]["eager_ms"] / long[str(b)]["compiled_ms"])
    one = bundled(rec)["1"]
    target = rec["compiled"]["target"]
    context = long["1"]["context"]
    assert abs(context - 208) <= 1
    assert_in_chapter(
        f"At B = 1 a decode step took {ms(one['compiled']['step_ms'])} ms compiled against "
        f"{ms(one['eager']['step_ms'])} ms eager, {x(ratio(rec, 1, 'compiled'))} "
        f"({x(long['1']['ratio'])} with contexts of about 208 tokens): the benchmark's "
        f"{target:g}x target is met there.",
        "At B = 8, 32 and 64 the ratio is " + ", ".join(
            x(ratio(rec, b, "compiled")) for b in (8, 32)) + f" and "
        f"{x(ratio(rec, 64, 'compiled'))}, short of it")
    checks = {(c["context"], c["batch"]): c for c in rec["compiled"]["checks"]}
    for (ctx, b), c in checks.items():
        assert c["pass"] == (c["ratio"] >= target) == (b == 1), (ctx, b)
    assert rec["compiled"]["holds_at"] == {"short": [1], "long": [1]}


def test_the_earlier_run_is_not_the_record(rec):
    """"an earlier full run ... measured 1.56x at B = 8" is quoted as another run's."""
    assert_in_chapter("an earlier full run by the benchmark's author, at a load of about 1.2, "
                      "measured 1.56x at B = 8")
    assert x(ratio(rec, 8, "compiled")) != "1.56x"


def test_the_price_of_static_shapes(rec):
    part = rec["host"]["models"]["bundled"]
    context = eager(rec, 1)["context"]
    assert abs(context - 40) <= 1 and part["max_context"] == 256
    assert all(rows["static"]["context"] == context for rows in part["batches"].values())
    assert_in_chapter(
        f"with contexts of about 40 tokens every static row attends over all "
        f"{part['max_context']} positions of its block table, where the eager runner attends "
        "over 40",
        "Run eagerly, the static step shows that price alone: " + ", ".join(
            x(ratio(rec, b, "static")) for b in (8, 32)) + f" and "
        f"{x(ratio(rec, 64, 'static'))} of the eager runner at B = 8, 32 and 64.")


def test_the_compiled_step_with_long_contexts(rec):
    long = rec["compiled"]["long"]["bundled"]
    assert_in_chapter(f"the compiled ratio at B = 32 and 64 is {x(long['32']['ratio'])} and "
                      f"{x(long['64']['ratio'])}")


def test_the_mid_size_model(rec):
    mid = rec["host"]["models"]["mid"]
    shape = rec["config"]["mid_shape"]
    ratios = [r["eager"]["step_ms"] / r["compiled"]["step_ms"] for r in mid["batches"].values()]
    for b, r in mid["batches"].items():
        assert rec["compiled"]["short"]["mid"][b]["ratio"] == pytest.approx(
            r["eager"]["step_ms"] / r["compiled"]["step_ms"])
    assert_in_chapter(
        f"On a random model of the Qwen3 layout with {mid['parameters'] / 1e6:.1f}M parameters "
        f"(hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers) the compiled step "
        f"is {x(min(ratios))} to {x(max(ratios))} the eager one at every batch size.")


def test_the_bandwidth_contrast(rec):
    bw = rec["machine"]["bandwidth_bytes_per_s"]
    m, b = rec["compiled"]["bandwidth"]["mid"]["1"], rec["compiled"]["bandwidth"]["bundled"]["1"]
    mid_step = rec["host"]["models"]["mid"]["batches"]["1"]["eager"]
    bun_step = eager(rec, 1)
    m_rate = m["bytes_per_step"] / (mid_step["step_ms"] / 1e3)
    b_rate = b["bytes_per_step"] / (bun_step["step_ms"] / 1e3)
    assert m_rate == pytest.approx(m["eager_bytes_per_s"])
    assert b_rate == pytest.approx(b["eager_bytes_per_s"])
    host = pct(mid_step["profiler_host_fraction"])
    assert host == pct(mid_step["host_fraction"])          # either measure of the host: 2%
    assert_in_chapter(
        f"Its eager step at B = 1 already moves its {m['bytes_per_step'] / 1e6:.0f} MB at "
        f"{m_rate / 1e9:.1f} GB/s, {pct(m_rate / bw)} of the {bw / 1e9:.1f} GB/s this CPU's "
        f"copy measured (S07's method, in this run), against {pct(b_rate / bw)} for the "
        f"bundled model's {b['bytes_per_step'] / 1e6:.1f} MB, and its host work is {host} of "
        f"the step.")


# --- async scheduling -------------------------------------------------------------------------

def test_async_scheduling_at_b16(rec):
    part = rec["async"]
    rows = part["rows"]
    assert part["batch"] == 16

    def pair(sync: str, asyn: str) -> tuple[float, float, float]:
        """(bound, speed-up, host share), recomputed from the rows: the bound saves half the
        synchronous step's host share."""
        share = rows[sync]["profiler_host_fraction"]
        bound = rows[sync]["step_ms"] * (1 - share / 2)
        return bound, rows[sync]["step_ms"] / rows[asyn]["step_ms"], share

    for c in part["checks"]:                                  # the record's own sums agree
        bound, speedup, share = pair(c["sync"], c["async"])
        assert (c["bound_ms"], c["speedup"], c["host_fraction"]) == pytest.approx(
            (bound, speedup, share))
        assert not c["pass"] and rows[c["async"]]["step_ms"] > bound   # "all three short"
    bound, eager_x, share = pair("eager", "async eager")
    _, compiled_x, _ = pair("compiled", "async compiled")
    _, mp_x, _ = pair("eager", "async mp")
    for t in part["tokens"]:
        assert t["requests"] == t["identical_tokens"] == t["identical_finish_reasons"] == 16
    assert len(part["tokens"]) == 3
    assert_in_chapter(
        f"At B = {part['batch']} on the bundled model the synchronous step's host share is "
        f"{pct(share)}, so the bound, half of it saved, is {ms(bound)} ms against the eager "
        f"{ms(rows['eager']['step_ms'])}.",
        f"With the forward on a worker thread the async step took "
        f"{ms(rows['async eager']['step_ms'])} ms ({x(eager_x)}), the compiled pair "
        f"{ms(rows['async compiled']['step_ms'])} against {ms(rows['compiled']['step_ms'])} ms "
        f"({x(compiled_x)}); in a worker process, {ms(rows['async mp']['step_ms'])} ms against "
        f"the in-process eager {ms(rows['eager']['step_ms'])} ({x(mp_x)}): all three short of "
        "the bound, with identical tokens and finish reasons in all 16 requests of each pair.",
        f"{pct(share)} is all that overlap could hide",
        f"At B = 16 the synchronous step's host share is {pct(share)}",
        f"(16 of 16 requests at B = {part['batch']}, Measured)")


# --- one request, every technique (section E) -------------------------------------------------

ENGINES = {"S06 fp32": "S06's engine, float32",
           "S13 fp32 eager": "S13's engine, float32, eager",
           "S13 int4 eager": "S13's engine, S14's int4, eager",
           "compiled fp32": "S16's compiled step, float32",
           "compiled int4": "S16's compiled step, int4",
           "HF generate fp32": "Hugging Face `generate`, float32"}


def test_the_batch_1_table(rec):
    part = rec["int4"]
    rows = part["rows"]
    assert list(rows) == list(ENGINES) and part["skipped"] == {}
    assert part["model"] == "mid" and part["bandwidth_bytes_per_s"] == \
        rec["machine"]["bandwidth_bytes_per_s"]
    s06 = rows["S06 fp32"]["tokens_per_s"]
    for key, r in rows.items():
        floor_ms = r["bytes_per_token"] / part["bandwidth_bytes_per_s"] * 1e3
        assert r["floor_ms"] == pytest.approx(floor_ms)
        assert r["tokens_per_s"] == pytest.approx(1e3 / r["decode_ms"])
        assert r["fraction_of_floor"] == pytest.approx(floor_ms / r["decode_ms"])
        assert_in_chapter(
            f"| {ENGINES[key]} | {r['tokens_per_s']:.1f} | {x(r['tokens_per_s'] / s06)} | "
            f"{pct(r['fraction_of_floor'])} | {r['same_tokens_as_s06']} of {part['tokens']} |")
    assert_in_chapter(
        f"Batch 1 on the random mid-size model, a {part['prompt_tokens']}-token prompt and "
        f"{part['tokens']} tokens, greedy; the median time between two tokens over "
        f"{part['repeats']} alternating rounds",
        f"the bandwidth S07's copy measured on this CPU, "
        f"{part['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")


def test_what_the_batch_1_table_says(rec):
    rows = rec["int4"]["rows"]
    tokens = rec["int4"]["tokens"]
    s06 = rows["S06 fp32"]["tokens_per_s"]
    speed = {k: r["tokens_per_s"] / s06 for k, r in rows.items()}
    best = max(rows, key=lambda k: rows[k]["tokens_per_s"])
    assert best == "compiled int4"                                  # "the fastest"
    ci4 = rows["compiled int4"]
    assert_in_chapter(
        f"int4 reads {ci4['bytes_per_token'] / 1e6:.0f} MB a token instead of "
        f"{rows['S06 fp32']['bytes_per_token'] / 1e6:.0f}",
        f"the compiled int4 step is the fastest, {speed['compiled int4']:.2f} times S06's "
        f"engine, at {pct(ci4['fraction_of_floor'])} of its floor of {ci4['floor_ms']:.1f} ms "
        "a token",
        f"Its tokens equal S06's at {ci4['same_tokens_as_s06']} of {tokens} positions",
        f"Compiling gains more on int4 ({x(speed['S13 int4 eager'])} to "
        f"{x(speed['compiled int4'])}) than on float32 ({x(speed['S13 fp32 eager'])} to "
        f"{x(speed['compiled fp32'])})")
    assert rows["S13 int4 eager"]["same_tokens_as_s06"] == ci4["same_tokens_as_s06"]
    assert speed["compiled int4"] / speed["S13 int4 eager"] > \
        speed["compiled fp32"] / speed["S13 fp32 eager"]


# --- the quiz ---------------------------------------------------------------------------------

def quiz() -> dict:
    return {q["id"]: q for q in json.loads(QUIZ.read_text())["questions"]}


def answer(q: dict) -> str:
    return q["choices"][q["answer"]]


def test_the_quizs_numbers_recompute(rec):
    qs = quiz()
    # q1: round numbers near the record's (433 ops, 1.95 ms, 4.5 µs, 0.97 µs), and their sum
    q1 = qs["q1-per-op-cost"]["question"]
    assert ("400 torch ops and takes 2.0 ms" in q1 and "each op costs 5 microseconds" in q1
            and "costs 1 microsecond" in q1)
    assert 2.0e-3 / 400 == pytest.approx(5e-6)
    one = eager(rec, 1)
    assert round(one["model_ops"], -2) == 400 and round(one["forward_ms"]) == 2
    assert round(rec["machine"]["per_op_overhead_s"] * 1e6) == 1
    # q4: the record's ratios at B = 32, short and long contexts
    q4 = qs["q4-long-contexts-gain-more"]["question"]
    short = rec["compiled"]["short"]["bundled"]["32"]["ratio"]
    long = rec["compiled"]["long"]["bundled"]["32"]
    assert (f"at batch 32, the compiled static decode step was {x(short)} the eager runner "
            f"with contexts of "
            f"about 40 tokens and {x(long['ratio'])} with contexts of about 208 (of "
            f"{rec['host']['models']['bundled']['max_context']})") in q4
    assert answer(qs["q4-long-contexts-gain-more"]).startswith(
        f"Every static row attends over all {rec['host']['models']['bundled']['max_context']}")
    # q5: the placeholder books, kept by hand
    tokens, computed, placeholders = 40, 39, 0
    for _ in range(2):                                  # plan N, then plan N + 1
        computed += 1                                   # one token scheduled
        if computed == tokens + placeholders:           # reaches the end: a placeholder
            placeholders += 1
    assert answer(qs["q5-placeholders"]).startswith(f"{computed} and {placeholders}:")
    # q7: Python's default switch interval, as the chapter and the quiz say
    assert "5 ms switch interval" in qs["q7-worker-process"]["explanation"]
    assert_in_chapter("Python's switch interval, 5 ms by default")


# --- the excerpts -----------------------------------------------------------------------------

def has_object(code: str, dotted: str) -> bool:
    """Whether code defines dotted (Class.method or a top-level name), class by class."""
    body = ast.parse(code).body
    for name in dotted.split("."):
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.ClassDef)) and n.name == name]
        if not found:
            return False
        body = found[0].body
    return True


def test_every_excerpt_marker_is_in_its_code_file():
    md = CHAPTER.read_text()
    blocks = list(re.finditer(r"```\{literalinclude\} (\S+)\n((?::\S+:.*\n)*)", md))
    assert len(blocks) == md.count("{literalinclude}")
    for m in blocks:
        code = (CHAPTER.parent / m.group(1)).resolve().read_text()
        options = dict(re.findall(r":(\S+):\s*(.*)", m.group(2)))
        assert {"pyobject", "start-after", "end-before"} & set(options), m.group(0)
        if "pyobject" in options:
            assert has_object(code, options["pyobject"]), (m.group(1), options["pyobject"])
        if "start-after" in options:
            start = code.find(options["start-after"])
            assert start >= 0, (m.group(1), options["start-after"])
            code = code[start + len(options["start-after"]):]
        if "end-before" in options:
            end = code.find(options["end-before"])
            assert end > 0, (m.group(1), options["end-before"])   # after the start, not empty
            assert code[:end].strip(), m.group(0)


# --- the figure -------------------------------------------------------------------------------

def test_the_figure_is_the_records_drawing_with_its_legends_off_the_data(rec, capsys):
    """chapters/figures/s16_host.png is scripts/s16_figure.py's drawing of the record (its
    --check, run in this process), the chapter embeds it, and no legend covers a point."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import matplotlib.pyplot as plt
    import s16_figure
    from legend_check import covered_by_legends, describe
    assert s16_figure.DATA == RECORD and s16_figure.OUT == FIGURE
    assert "```{figure} figures/s16_host.png" in CHAPTER.read_text()
    fig = s16_figure.build_figure(rec)
    try:
        found = covered_by_legends(fig)
    finally:
        plt.close(fig)
    assert not found, describe(found)
    assert s16_figure.main(["--check"]) == 0, capsys.readouterr().out
