"""Chapter S18's figures against the benchmark record they are quoted from.

What is new here: the measured numbers of chapters/s18-tensor-parallel.md checked against the
committed record chapters/figures/s18_tensor_parallel.json (written by
`python benchmarks/bench_s18_tensor_parallel.py --record`). The chapter marks each paragraph
that quotes the record with an inline comment `<!-- record: key, key -->` naming the record's
keys; the tests below take the chapter's phrases as it writes them and compute every number in
them from the record here, rounded as the chapter rounds it (milliseconds to two places, a
speedup as "0.92x", an all-reduce's microseconds to the unit or to ten, weights in MiB to two
places, bytes with thousands separators). A re-record that moves a quoted figure fails here
until the prose is updated. Nothing is re-measured and no model runs.

Kinds of figure checked:

- every `<!-- record: ... -->` marker names keys that are in the record, and every marker is
  one this module checks (a new marker fails `test_every_record_marker_is_checked_here`); no
  probe figure is left (no `<!-- probe ... -->` marker, none of the lead's probe numbers);
- the caption (torch, threads per rank, cores, the one-minute load) and the record's kind (a
  full CPU run of both sections on one thread per rank, no GPU section);
- Measured: one all-reduce's cost through gloo and shared memory (the range up to 64 KiB, the
  512-byte and 1 MiB points, their ratio) and a decode step's all-reduces at those prices; the
  bundled model's decode step at TP = 2 against TP = 1 and through gloo; the mid-size model's
  shape, weights and steps; the two-thread baseline; each rank's share of the weights and of the
  KV pool; greedy tokens equal everywhere; the logits' tolerance as the tests state it;
- the record's own sums the chapter leans on: the crossover table is the points' medians and
  speedups, the plan's counts and bytes follow 1 + 2 L all-reduces of B C 4 bytes and a gather
  of B V / 2 4 bytes from each rank (the models' shapes by hand), its times are count x the
  one-all-reduce medians, the weights are float32 parameters;
- the Deep dive's two tables (every decode point; every step's all-reduce plan), row by row;
- the figures quoted elsewhere in the chapter from the record: the worked example's all-reduce
  bytes and weight bytes (with the norms counted by hand), the chapter script's MiB, the
  shared-memory section's "more than five single-rank steps", the Core idea's and the
  introduction's "more than the step", the executor's start time in the tests' Deep dive;
- the figure chapters/figures/s18_tensor_parallel.png: `scripts/s18_figure.py --check` (run in
  this process through its `main`) and no legend covering data.

What it does not check: the published figures of Motivation and In production (gpt-fast's
tokens per second, Megatron's scaling), quoted, not recomputed; the tests' own measurements
the chapter cites (the logits' differences: only that the tests state them next to a 1e-4
tolerance and that they are about 1e-5).

Run it: `.venv/bin/pytest -q tests/test_s18_chapter_figures.py` (about a second; the figure's
test, matplotlib's import and one drawing, is most of it).

References: tests/test_s17_chapter_figures.py (the same checks for S17), benchmarks/
bench_s18_tensor_parallel.py (what writes the record and what each key means), code/
s18_layers.py (`allreduce_plan`, whose formula the plan table states), scripts/s18_figure.py and
scripts/figure_io.py (the drawing and its --check), tests/legend_check.py.
"""
from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

import pytest

from bench_testing import record_markers, resolve

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "s18-tensor-parallel.md"
RECORD = ROOT / "chapters" / "figures" / "s18_tensor_parallel.json"
FIGURE = ROOT / "chapters" / "figures" / "s18_tensor_parallel.png"

# The markers this module checks, as the chapter writes them (one test or more each).
MARKERS = {
    "allreduce",
    "tp.crossover, tp.models",
    "tp",
    "allreduce.plan",
    "allreduce.plan, tp.crossover",
    "tp.models[*].executor_start_s",
}

MIB = 2 ** 20
KIB64 = 64 * 1024
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
         8: "eight", 9: "nine"}
MODEL_NAMES = {"bundled": "bundled", "mid": "mid-size"}          # the Deep dive's first column
CONFIGS = ("tp1", "tp1_2threads", "tp2_shm", "tp2_gloo")
# The bundled model's sizes, written out (not read from the record): the hand counts below.
BUNDLED = dict(num_layers=6, hidden_size=128, intermediate_size=384, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=2048)


def text(path: Path | None = None) -> str:
    return " ".join((path or CHAPTER).read_text().split())       # line breaks as spaces


def assert_in_chapter(*phrases: str) -> None:
    t = text()
    for phrase in phrases:
        assert phrase in t, f"the chapter should say {phrase!r}"


def x(v: float) -> str:
    return f"{v:.2f}x"


def ms(v: float) -> str:
    return f"{v:.2f}"


@pytest.fixture(scope="module")
def rec() -> dict:
    assert RECORD.exists(), ("the chapter quotes chapters/figures/s18_tensor_parallel.json: "
                             "python benchmarks/bench_s18_tensor_parallel.py --record")
    return json.loads(RECORD.read_text())


def crossover(rec, model: str, batch: int) -> dict:
    [row] = [r for r in rec["tp"]["crossover"] if r["model"] == model and r["batch"] == batch]
    return row


def point(rec, model: str, batch: int) -> dict:
    [p] = [p for p in rec["tp"]["models"][model]["points"] if p["batch"] == batch]
    return p


def plan(rec, model: str, batch: int) -> dict:
    [p] = [p for p in rec["allreduce"]["plan"] if p["model"] == model and p["batch"] == batch]
    return p


def allreduce_us(rec) -> dict[tuple[str, int], float]:
    return {(r["comm"], r["bytes"]): r["median_us"] for r in rec["allreduce"]["rows"]}


# --- the markers, and no probe left -----------------------------------------------------------

def test_every_record_marker_names_keys_in_the_record(rec):
    markers = record_markers(CHAPTER.read_text())
    assert markers
    for marker in markers:
        for key in marker.split(", "):
            assert resolve(rec, key), key


def test_every_record_marker_is_checked_here():
    """A paragraph marked with a key this module does not know is a figure nobody checks."""
    assert set(record_markers(CHAPTER.read_text())) == MARKERS


def test_no_probe_figure_is_left():
    """The figures of the lead's probe (before the record) are gone: the chapter quotes the
    record, or a test's measurement it names."""
    md = CHAPTER.read_text()
    assert "probe" not in md
    for old in ("1.9 ms", "12 µs", "2.3 ms", "3.4 ms", "21 ms on two ranks", "9.6 on one",
                "48.5", "26.7", "1.35x", "1.82x", "0.68x", "35 ms", "7.6e-6", "6e-8"):
        assert old not in text(), old


# --- the record's kind and the caption ----------------------------------------------------------

def test_the_record_is_a_full_cpu_run_on_one_thread_per_rank(rec):
    config = rec["config"]
    assert not config["quick"], "the committed record is a full run, not --quick"
    assert config["device"] == "cpu" and config["threads"] == 1 and config["world_size"] == 2
    assert config["sections"] == ["allreduce", "tp"] and config["batches"] == [1, 32]
    assert rec["tp"]["threads_per_rank"] == 1 and rec["tp"]["configs"] == list(CONFIGS)
    assert rec["tp"]["skipped"] == {} and rec["allreduce"]["skipped"] == {}
    # "the chapter has no multi-GPU figure of its own"
    assert "gpu" not in rec
    assert_in_chapter("so the chapter has no multi-GPU figure of its own")


def test_the_caption(rec):
    config = rec["config"]
    loads = [rec["load_average"]["start"][0], rec["load_average"]["end"][0]]
    loads += [v for part in rec.values() if isinstance(part, dict)
              for v in part.get("load_average_1min", [])]
    threads = "1 thread" if config["threads"] == 1 else f"{config['threads']} threads"
    assert_in_chapter(
        "```{figure} figures/s18_tensor_parallel.png",
        f"(torch {config['torch']}, {threads} per rank, {config['logical_cores']} shared "
        f"cores, one-minute load {min(loads):.1f} to {max(loads):.1f})")


# --- Measured: one all-reduce -----------------------------------------------------------------

def test_one_all_reduce_through_gloo_and_shared_memory(rec):
    a = rec["allreduce"]
    assert a["comms"] == ["gloo", "shm"] and a["world_size"] == 2
    assert all(r["correct"] for r in a["rows"])                        # every sum was right
    us = allreduce_us(rec)
    small = [n for n in a["bytes"] if n <= KIB64]
    assert small[0] == 512 and small[-1] == KIB64
    gloo = [us[("gloo", n)] for n in small]
    shm = [us[("shm", n)] for n in small]
    g512, s512 = us[("gloo", 512)], us[("shm", 512)]
    g1m, s1m = us[("gloo", MIB)], us[("shm", MIB)]
    # "above 64 KiB the bytes start to count": 1 MiB costs more than every size up to 64 KiB
    assert g1m > max(gloo) and s1m > max(shm)
    [ratio] = [r["gloo_over_shm"] for r in a["ratios"] if r["bytes"] == 512]
    assert ratio == pytest.approx(g512 / s512)
    assert_in_chapter(
        f"One all-reduce between two processes of one thread each took "
        f"{round(min(gloo), -1):.0f} to {round(max(gloo), -1):.0f} µs through gloo, "
        f"torch.distributed's CPU backend, at every size up to 64 KiB ({g512:.0f} µs at 512 "
        f"bytes), and {min(shm):.0f} to {max(shm):.0f} µs through shared memory ({s512:.1f} µs "
        f"at 512 bytes, {ratio:.0f} times less); above 64 KiB the bytes start to count (at "
        f"1 MiB, {g1m:.0f} and {s1m:.0f} µs).")


def test_a_steps_all_reduces_at_those_prices(rec):
    p = plan(rec, "bundled", 1)
    cost = p["all_reduce_ms_per_step"]
    us = allreduce_us(rec)
    for comm in ("gloo", "shm"):                       # count x the median at that size
        assert cost[comm] == pytest.approx(p["all_reduce_per_step"]
                                           * us[(comm, p["bytes_each"])] / 1e3)
    assert_in_chapter(
        f"A bundled-model decode step's {p['all_reduce_per_step']} all-reduces at B = 1 cost "
        f"{cost['gloo']:.1f} ms at gloo's price, {cost['shm']:.2f} ms at shared memory's.")


# --- Measured: the decode step ----------------------------------------------------------------

def test_the_crossover_is_the_points_medians_and_speedups(rec):
    for row in rec["tp"]["crossover"]:
        p = point(rec, row["model"], row["batch"])
        med = {c: p["median"][c]["step_ms"] for c in CONFIGS}
        for c in CONFIGS:
            assert row[f"{c}_ms"] == med[c]
            assert statistics.median(p["samples"][c]["step_ms"]) == pytest.approx(med[c])
        assert row["speedup_shm"] == pytest.approx(med["tp1"] / med["tp2_shm"])
        assert row["speedup_gloo"] == pytest.approx(med["tp1"] / med["tp2_gloo"])
        assert row["speedup_shm_vs_2threads"] == pytest.approx(med["tp1_2threads"]
                                                               / med["tp2_shm"])
        assert row["expected_faster"] == (row["model"] == "mid") and row["as_expected"]
    key = rec["key"]
    for model in ("bundled", "mid"):
        for b in (1, 32):
            assert key[f"{model}_B{b}_tp1_over_tp2_shm"] == \
                crossover(rec, model, b)["speedup_shm"]


def test_the_bundled_model_is_slower_on_two_ranks(rec):
    b1, b32 = crossover(rec, "bundled", 1), crossover(rec, "bundled", 32)
    assert b1["speedup_shm"] < 1 and b32["speedup_shm"] < 1            # "slower"
    gloo_ar = plan(rec, "bundled", 1)["all_reduce_ms_per_step"]["gloo"]
    extra = b1["tp2_gloo_ms"] - b1["tp2_shm_ms"]
    times = math.floor(extra / gloo_ar)                                # "over three times"
    assert_in_chapter(
        f"On the bundled model two ranks were slower, as expected: the decode step took "
        f"{ms(b1['tp2_shm_ms'])} ms against {ms(b1['tp1_ms'])} on one rank at B = 1 "
        f"({x(b1['speedup_shm'])}) and {ms(b32['tp2_shm_ms'])} against {ms(b32['tp1_ms'])} at "
        f"B = 32 ({x(b32['speedup_shm'])}).",
        f"Through gloo the step took {ms(b1['tp2_gloo_ms'])} ms at B = 1 "
        f"({x(b1['speedup_gloo'])}), {extra:.0f} ms more than through shared memory, over "
        f"{WORDS[times]} times its all-reduces' {gloo_ar:.1f} ms timed back to back")


def test_the_mid_size_model_is_faster_on_two_ranks(rec):
    m = rec["tp"]["models"]["mid"]
    shape = rec["config"]["mid_shape"]
    assert m["num_layers"] == shape["num_hidden_layers"] and m["hidden_size"] == \
        shape["hidden_size"]
    w = m["weight_bytes"]
    assert w["full"] == 4 * m["parameters"]                            # float32 weights
    assert w["executor_rank0"] == w["shard_bytes"][0]
    m1, m32 = crossover(rec, "mid", 1), crossover(rec, "mid", 32)
    assert m1["speedup_shm"] > 1 and m32["speedup_shm"] > 1            # "faster"
    assert m1["speedup_gloo"] < 1 and m32["speedup_gloo"] < 1          # "through gloo they lost"
    half = m1["tp1_ms"] / 2
    gain = m1["tp1_ms"] - m1["tp2_shm_ms"]
    assert gain < half / 2                                             # "eat most of that gain"
    [count] = point(rec, "mid", 1)["all_reduce_per_step"]
    assert count == 1 + 2 * m["num_layers"]
    assert_in_chapter(
        f"On a random model of the Qwen3 layout ({m['num_layers']} layers, hidden "
        f"{m['hidden_size']}, {m['num_attention_heads']} query and {m['num_key_value_heads']} "
        f"KV heads, {w['full'] / MIB:.2f} MiB of float32 weights, "
        f"{w['executor_rank0'] / MIB:.2f} MiB per rank) two ranks were faster: "
        f"{ms(m1['tp2_shm_ms'])} ms against {ms(m1['tp1_ms'])} at B = 1 "
        f"({x(m1['speedup_shm'])}) and {ms(m32['tp2_shm_ms'])} against {ms(m32['tp1_ms'])} at "
        f"B = 32 ({x(m32['speedup_shm'])}); through gloo they lost ({x(m1['speedup_gloo'])} and "
        f"{x(m32['speedup_gloo'])}).",
        f"half of one rank's step would be {half:.2f} ms: the fixed costs ({count} all-reduces,")


def test_against_one_process_on_two_threads(rec):
    m1, m32 = crossover(rec, "mid", 1), crossover(rec, "mid", 32)
    b1, b32 = crossover(rec, "bundled", 1), crossover(rec, "bundled", 32)
    assert m1["tp1_2threads_ms"] >= m1["tp1_ms"]                       # "gained nothing"
    threads = m32["tp1_ms"] / m32["tp1_2threads_ms"]
    # "most of the 1.63x is what any use of the second core buys": 1.63 = threads x split
    assert threads > m32["speedup_shm_vs_2threads"]
    assert m32["speedup_shm"] == pytest.approx(threads * m32["speedup_shm_vs_2threads"])
    assert_in_chapter(
        "Two ranks use two cores where one rank uses one, so these speedups compare a step's "
        "latency, not what the machine spends.",
        f"On the mid-size model those threads gained nothing at B = 1 "
        f"({ms(m1['tp1_2threads_ms'])} ms) and {x(threads)} at B = 32 "
        f"({ms(m32['tp1_2threads_ms'])} ms); two ranks were {x(m1['speedup_shm_vs_2threads'])} "
        f"and {x(m32['speedup_shm_vs_2threads'])} against them, so at B = 32 most of the "
        f"{x(m32['speedup_shm'])} is what any use of the second core buys and "
        f"{x(m32['speedup_shm_vs_2threads'])} is the split's own (on the bundled model: "
        f"{x(b1['speedup_shm_vs_2threads'])} and {x(b32['speedup_shm_vs_2threads'])}).")


def test_each_rank_holds_half_and_the_tokens_are_equal(rec):
    models = rec["tp"]["models"]
    for model in models.values():
        for p in model["points"]:
            pool = p["pool_bytes"]
            assert pool["tp1"] == pool["tp1_2threads"] == 2 * pool["tp2_shm"] \
                == 2 * pool["tp2_gloo"]                                # "half the KV pool"
            assert p["tokens_equal"] and p["requests_compared"] > 0
            assert set(p["same_tokens"]) == set(CONFIGS)               # "all four"
            assert all(n == p["requests_compared"] for n in p["same_tokens"].values())
    share = {k: m["weight_bytes"]["rank0_over_full"] for k, m in models.items()}
    for m in models.values():
        w = m["weight_bytes"]
        assert w["rank0_over_full"] == pytest.approx(w["executor_rank0"] / w["full"])
    assert_in_chapter(
        f"Each rank held half the KV pool and half the weights ({share['bundled']:.3f} of the "
        f"bundled model's, whose norms both ranks hold whole; {share['mid']:.3f} of the "
        "mid-size one's); every request's greedy tokens were the same in all four "
        "configurations.")


def test_the_logits_tolerance_is_the_tests():
    """"about 1e-5 where the tests measured it (beside their tolerance), which allows 1e-4":
    each S18 test module states its measurement in the comment above LOGITS_ATOL = 1e-4."""
    for name in ("test_s18_layers.py", "test_s18_tensor_parallel.py"):
        source = (ROOT / "tests" / name).read_text()
        comment = source[:source.index("LOGITS_ATOL = 1e-4")].rsplit("\n\n", 1)[-1]
        measured = [float(v) for v in re.findall(r"\d\.\de-\d+", comment)]
        assert "Measured" in comment and measured, name
        assert all(5e-6 <= v <= 2e-5 for v in measured), (name, measured)  # about 1e-5
    assert_in_chapter("about 1e-5 where the tests measured it (beside their tolerance), which "
                      "allows 1e-4, as in S16 and S17.")


# --- the Deep dive's tables -------------------------------------------------------------------

def table_rows(cells: int) -> list[str]:
    """The chapter's table rows of a model with `cells` cells."""
    return [line for line in CHAPTER.read_text().splitlines()
            if re.match(r"\| (bundled|mid-size) \| \d", line) and line.count("|") == cells + 1]


def test_the_deep_dives_table_of_every_decode_point(rec):
    t = rec["tp"]
    assert t["baseline_alone"] and t["builder"] == "s12_engine.build_engine"
    rows = [f"| {MODEL_NAMES[r['model']]} | {r['batch']} | {ms(r['tp1_ms'])} | "
            f"{ms(r['tp1_2threads_ms'])} | {ms(r['tp2_shm_ms'])} | {ms(r['tp2_gloo_ms'])} | "
            f"{x(r['speedup_shm'])} | {x(r['speedup_gloo'])} | "
            f"{x(r['speedup_shm_vs_2threads'])} |" for r in t["crossover"]]
    assert table_rows(9) == rows
    assert_in_chapter(
        "| model | B | TP=1 | TP=1, 2 threads | TP=2, shared memory | TP=2, gloo | TP=1 / shm "
        "| TP=1 / gloo | 2 threads / shm |",
        f"The median decode step in ms ({t['prompt_tokens']}-token prompts, S12's paged engine, "
        f"{t['rounds']} rounds of {t['warmup']} untimed and {t['steps']} timed steps per "
        "configuration, the configurations rotated every round and TP = 1 timed with no rank "
        "alive)")
    for p in (p for m in t["models"].values() for p in m["points"]):
        for c in CONFIGS:
            assert len(p["samples"][c]["step_ms"]) == t["rounds"] * t["steps"]


def test_the_deep_dives_table_of_every_steps_plan(rec):
    shapes = {"bundled": BUNDLED, "mid": rec["tp"]["models"]["mid"]}
    assert {k: rec["tp"]["models"]["bundled"][k] for k in BUNDLED} == BUNDLED
    us = allreduce_us(rec)
    rows = []
    for p in rec["allreduce"]["plan"]:
        s, b = shapes[p["model"]], p["batch"]
        count, each = 1 + 2 * s["num_layers"], b * s["hidden_size"] * 4     # by hand
        gather = b * s["vocab_size"] // 2 * 4                                # B V / N float32
        assert (p["all_reduce_per_step"], p["bytes_each"]) == (count, each)
        assert p["bytes_per_step"] == count * each and p["gather_bytes_per_rank"] == gather
        for comm, cost in p["all_reduce_ms_per_step"].items():
            assert cost == pytest.approx(count * us[(comm, each)] / 1e3)
        # the engine counted the same all-reduces and bytes on rank 0
        pt = point(rec, p["model"], b)
        assert pt["all_reduce_per_step"] == [count]
        assert pt["all_reduce_bytes_per_step"] == [count * each]
        cost = p["all_reduce_ms_per_step"]
        rows.append(f"| {MODEL_NAMES[p['model']]} | {b} | {count} | {each:,} | "
                    f"{count * each:,} | {gather:,} | {cost['gloo']:.2f} | {cost['shm']:.2f} |")
    assert table_rows(8) == rows
    assert_in_chapter("| model | B | all-reduces | bytes each | bytes a step | gathered per rank "
                      "| gloo, ms | shm, ms |")


# --- the record's figures quoted outside Measured ---------------------------------------------

def test_the_worked_examples_bytes(rec):
    p = plan(rec, "bundled", 1)
    w = rec["tp"]["models"]["bundled"]["weight_bytes"]
    c, d, L = BUNDLED["hidden_size"], BUNDLED["head_dim"], BUNDLED["num_layers"]
    norms = (L * (2 * c + 2 * d) + c) * 4       # two layer norms and q/k norms a layer, final
    assert w["shard_bytes"] == [w["executor_rank0"]] * 2
    assert w["executor_rank0"] == w["full"] // 2 + norms // 2        # the norms held whole
    assert_in_chapter(
        f"{p['all_reduce_per_step']} all-reduces of {p['bytes_each']} T bytes, "
        f"{p['bytes_per_step']:,} T bytes a step, whatever N is.",
        f"{p['gather_bytes_per_rank'] // 4:,} float32 per sampled row from each rank, "
        f"{p['gather_bytes_per_rank']:,} bytes",
        f"Each rank holds {w['executor_rank0']:,} bytes of weights, half the model's "
        f"{w['full']:,} plus {norms // 2:,}: the norms, {norms:,} bytes in all, are held whole "
        "by both ranks.",
        f"weights per rank {w['executor_rank0'] / MIB:.1f} MiB of {w['full'] / MIB:.1f} MiB")


def test_gloo_costs_more_than_the_small_models_step(rec):
    """The introduction, the Core idea and the shared-memory section: a bundled-model step's
    all-reduces at gloo's price cost more than its whole single-rank step (several times)."""
    b1 = crossover(rec, "bundled", 1)
    p = plan(rec, "bundled", 1)
    gloo = p["all_reduce_ms_per_step"]["gloo"]
    steps = math.floor(gloo / b1["tp1_ms"])
    assert steps >= 1
    assert_in_chapter(
        "the library's all-reduces cost more than a small model's whole step",
        f"on this CPU gloo's {p['all_reduce_per_step']} cost more than the step (Measured)",
        f"At gloo's {allreduce_us(rec)[('gloo', 512)]:.0f} µs for 512 bytes, the bundled "
        f"model's {p['all_reduce_per_step']} all-reduces cost {gloo:.1f} ms a step, more than "
        f"{WORDS[steps]} of its {ms(b1['tp1_ms'])} ms single-rank steps.")


def test_the_executors_start_time(rec):
    starts = [s for m in rec["tp"]["models"].values() for s in m["executor_start_s"]]
    assert_in_chapter(f"since starting one took {min(starts):.1f} to {max(starts):.1f} s in the "
                      "benchmark's record.")


# --- the figure -------------------------------------------------------------------------------

def test_the_figure_is_the_records_drawing_with_its_legends_off_the_data(rec, capsys):
    """chapters/figures/s18_tensor_parallel.png is scripts/s18_figure.py's drawing of the
    record (its --check, run in this process), and no legend covers a point."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import matplotlib.pyplot as plt
    import s18_figure
    from legend_check import covered_by_legends, describe
    assert s18_figure.DATA == RECORD and s18_figure.OUT == FIGURE
    fig = s18_figure.build_figure(rec)
    try:
        found = covered_by_legends(fig)
    finally:
        plt.close(fig)
    assert not found, describe(found)
    assert s18_figure.main(["--check"]) == 0, capsys.readouterr().out
