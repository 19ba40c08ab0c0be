"""Chapter S17's figures against what they are computed from.

What is new here: the chapter's measured numbers (chapters/s17-attention.md) checked against the
committed benchmark record chapters/figures/s17_attention.json (written by
`python benchmarks/bench_s17_attention.py --record`). The chapter marks each paragraph that
quotes the record with an inline comment `<!-- record: key, key -->` naming the record's keys;
the tests below take the chapter's phrases as it writes them and compute every number in them
from the record here, rounded as the chapter rounds it (a decode step as a share of the
contiguous one as "0.80x", peak memory in whole MiB with thousands separators, bytes in KiB and
times in µs rounded to integers, and so on). Nothing is re-measured and no model runs.

Kinds of figure checked:

- every `<!-- record: ... -->` marker names keys that are in the record, and every marker is
  one this module checks (a new marker fails `test_every_record_marker_is_checked_here`);
- the measured numbers of each marked paragraph (the peak memory of naive, SDPA and tiled
  attention; the paged decode step against the contiguous one and the target's verdicts; one
  layer's attention alone, its bytes and times; the bundled model's point at B = 8), the Deep
  dive's table of every decode point, and the figure's caption (torch, threads, cores, load);
- the record's own sums that the chapter leans on: the targets are the decode points'
  verdicts, "key" is their extremes, each kernel's bytes follow the traffic table's formulas
  (key and value positions per backend) from the context lengths in the record;
- the worked example's arithmetic (one query, scores 2, 1 | 3, 0, values 4, 2 | 6, 8, two tiles
  of two): every digit recomputed twice, with `s17_flash`'s `online_softmax_update`, `finish`,
  `merge_attn_states`, `attend_tiles` and `split_k_decode`, and with plain `math`; the merge of
  the two halves likewise;
- the Motivation's and Core idea's arithmetic (the score matrices' bytes, 64 operations a byte)
  and the figures they carry from S07, S12 and S16 (the ridge of 295, 1.29, 256 and 40);
- the quiz's numbers (site/quizzes/s17-attention.json) that come from arithmetic (q1's
  rescaled sums, q2's merge, q3's visible keys) and the exercises' points;
- the excerpts: every literalinclude marker (`:pyobject:`, `:start-after:`, `:end-before:`)
  names an object or text that is in its code file, the C file included (a dotted
  `:pyobject:` is resolved class by class with `ast`);
- the figure chapters/figures/s17_attention.png: `scripts/s17_figure.py --check` (run in this
  process through its `main`, so matplotlib is imported once) and no legend covering data.

What it does not check: numbers the chapter marks `<!-- probe, not in the record -->` (the C
kernel's two-to-four-times speed-up over its first version, the flush-to-zero probe, an
earlier record's B = 1 misses and the per-layer call's ~17 -> ~8 µs); figures
from outside sources (FlashAttention's 7.6 times and the other published figures of In
production, the H100's 132 multiprocessors) are quoted, not recomputed; the GPU section, which
this record does not have (checked: no "gpu" key, and the chapter quotes no GPU figure).

Run it: `.venv/bin/pytest -q tests/test_s17_chapter_figures.py` (a few seconds; the figure's
test, matplotlib's import and two drawings, is most of it).

References: tests/test_s16_chapter_figures.py (the same checks for S16), benchmarks/
bench_s17_attention.py (what writes the record and what each key means), code/s17_attention.py
(`attention_traffic`, whose formulas the chapter's traffic table states), scripts/s17_figure.py
and scripts/figure_io.py (the drawing and its --check), tests/legend_check.py.
"""
from __future__ import annotations

import ast
import json
import math
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

import s17_flash
from bench_testing import record_markers, resolve

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "chapters" / "s17-attention.md"
QUIZ = ROOT / "site" / "quizzes" / "s17-attention.json"
RECORD = ROOT / "chapters" / "figures" / "s17_attention.json"
FIGURE = ROOT / "chapters" / "figures" / "s17_attention.png"
S16_RECORD = ROOT / "chapters" / "figures" / "s16_host.json"

# The markers this module checks, as the chapter writes them (one test or more each).
MARKERS = {
    "memory.rows",
    "decode.models, key, targets",
    "traffic",
    "decode.models",
    "traffic.models.bundled.points",
}

MIB = 2 ** 20
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
         8: "eight", 9: "nine"}
MODEL_NAMES = {"bundled": "bundled", "mid": "mid-size"}          # the Deep dive's first column


def text(path: Path | None = None) -> str:
    return " ".join((path or CHAPTER).read_text().split())       # line breaks as spaces


def assert_in_chapter(*phrases: str) -> None:
    t = text()
    for phrase in phrases:
        assert phrase in t, f"the chapter should say {phrase!r}"


def x(v: float) -> str:
    return f"{v:.2f}x"


def listing(items: list[str]) -> str:
    """"a", "a and b", "a, b and c", as the chapter lists numbers."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def up(v: float, digits: int = 2) -> str:
    """v rounded up to `digits` significant digits, as "6.3e-7": a bound the chapter quotes
    ("within 6.3e-7") must not be below the value."""
    exponent = math.floor(math.log10(v)) - (digits - 1)
    mantissa = math.ceil(v / 10 ** exponent - 1e-9) * 10 ** (1 - digits)
    if mantissa >= 10:
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.{digits - 1}f}e{exponent + digits - 1}"


@pytest.fixture(scope="module")
def rec() -> dict:
    assert RECORD.exists(), ("the chapter quotes chapters/figures/s17_attention.json: "
                             "python benchmarks/bench_s17_attention.py --record")
    return json.loads(RECORD.read_text())


def points(rec, model: str) -> list[dict]:
    return rec["decode"]["models"][model]["points"]


def step_ratios(rec, model: str, backend: str) -> list[float]:
    return [p["ratios"][backend]["step"] for p in points(rec, model)]


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


def test_the_record_is_a_full_cpu_run_on_one_thread(rec):
    config = rec["config"]
    assert not config["quick"], "the committed record is a full run, not --quick"
    assert config["threads"] == 1 and config["device"] == "cpu"
    assert config["sections"] == ["memory", "decode", "traffic"]
    assert config["batches"] == [1, 8, 32, 64]
    # "No GPU was available to this course's runs so far, and this chapter quotes no GPU figure"
    assert "gpu" not in rec
    assert_in_chapter("this chapter quotes no GPU figure of its own")


def test_the_caption(rec):
    config = rec["config"]
    loads = [rec["load_average"]["start"][0], rec["load_average"]["end"][0]]
    loads += [v for part in rec.values() if isinstance(part, dict)
              for v in part.get("load_average_1min", [])]
    threads = "1 thread" if config["threads"] == 1 else f"{config['threads']} threads"
    assert_in_chapter(f"(torch {config['torch']}, {threads}, {config['logical_cores']} shared "
                      f"cores, one-minute load {min(loads):.1f} to {max(loads):.1f})")


# --- the worked example: two tiles by hand, and the merge of the halves ------------------------

SCORES, VALUES = [2.0, 1.0, 3.0, 0.0], [4.0, 2.0, 6.0, 8.0]      # one query, D = 1


def by_hand() -> dict:
    """The worked example in plain math, in the chapter's order."""
    e = math.exp
    l1, acc1 = e(0) + e(-1), 4 * e(0) + 2 * e(-1)                 # tile 1: m = 2
    alpha = e(2 - 3)                                              # tile 2: the max rises to 3
    l2 = alpha * l1 + e(0) + e(-3)
    acc2 = alpha * acc1 + 6 * e(0) + 8 * e(-3)
    out, lse = acc2 / l2, 3 + math.log(l2)
    top = max(SCORES)
    weights = [e(s - top) / sum(e(t - top) for t in SCORES) for s in SCORES]
    # the halves, each finished alone, then merged against the larger lse
    out_a, lse_a = acc1 / l1, 2 + math.log(l1)
    l_b = 1 + e(-3)
    out_b, lse_b = (6 + 8 * e(-3)) / l_b, 3 + math.log(l_b)
    w_a = e(lse_a - lse_b)
    merged = (w_a * out_a + out_b) / (w_a + 1)
    merged_lse = lse_b + math.log(w_a + 1)
    return dict(l1=l1, acc1=acc1, alpha=alpha, l2=l2, acc2=acc2, out=out, lse=lse,
                weights=weights, weighted=sum(w * v for w, v in zip(weights, VALUES)),
                out_a=out_a, lse_a=lse_a, l_b=l_b, out_b=out_b, lse_b=lse_b, w_a=w_a,
                merged=merged, merged_lse=merged_lse)


def by_s17_flash() -> dict:
    """The same numbers from s17_flash's functions (float32)."""
    m = torch.full((1,), -math.inf)
    l = torch.zeros(1)
    acc = torch.zeros(1, 1)
    scores, values = torch.tensor([SCORES]), torch.tensor(VALUES)[:, None]
    m, l1, acc1 = s17_flash.online_softmax_update(m, l, acc, scores[:, :2], values[:2])
    assert float(m) == 2.0
    m, l2, acc2 = s17_flash.online_softmax_update(m, l1, acc1, scores[:, 2:], values[2:])
    assert float(m) == 3.0
    out, lse = s17_flash.finish(m, l2, acc2)
    # the same query through attend_tiles (tiles of two keys) and split-K (two halves); q = 1
    # and keys equal to the scores give those scores with scale 1
    q = torch.ones(1, 1, 1)
    k, v = torch.tensor(SCORES)[:, None, None], torch.tensor(VALUES)[:, None, None]
    tiled, tiled_lse = s17_flash.attend_tiles(q, k, v, 1.0, 1, 2)
    split, outs, lses = s17_flash.split_k_decode(q[0], k, v, 1.0, 2, return_partials=True)
    merged, merged_lse = s17_flash.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    weights = torch.softmax(torch.tensor(SCORES), dim=0)
    return dict(l1=float(l1), acc1=float(acc1), l2=float(l2), acc2=float(acc2), out=float(out),
                lse=float(lse), tiled=float(tiled), tiled_lse=float(tiled_lse),
                split=float(split), weights=weights.tolist(),
                out_a=float(outs[0]), lse_a=float(lses[0]), out_b=float(outs[1]),
                lse_b=float(lses[1]), merged=float(merged), merged_lse=float(merged_lse))


def f4(v: float) -> str:
    return f"{v:.4f}"


def test_the_worked_example_two_tiles():
    h, t = by_hand(), by_s17_flash()
    for key in ("l1", "acc1", "l2", "acc2", "out", "lse", "out_a", "lse_a", "out_b", "lse_b",
                "merged", "merged_lse"):
        assert f4(t[key]) == f4(h[key]), key                  # the same four places both ways
    for key in ("tiled", "split"):
        assert f4(t[key]) == f4(h["out"]), key
    assert f4(t["tiled_lse"]) == f4(h["lse"])
    assert [f4(w) for w in t["weights"]] == [f4(w) for w in h["weights"]]
    assert_in_chapter(
        "scores 2 1 | 3 0 values 4 2 | 6 8",
        f"tile 1 m = 2 l = e^0 + e^-1 = {f4(h['l1'])} acc = 4 e^0 + 2 e^-1 = {f4(h['acc1'])}",
        f"tile 2 the max rises to 3: alpha = e^(2-3) = {f4(h['alpha'])}",
        f"m = 3 l = {f4(h['alpha'])} × {f4(h['l1'])} + e^0 + e^-3 = {f4(h['l2'])}",
        f"acc = {f4(h['alpha'])} × {f4(h['acc1'])} + 6 e^0 + 8 e^-3 = {f4(h['acc2'])}",
        f"finish out = {f4(h['acc2'])} / {f4(h['l2'])} = {f4(h['out'])} "
        f"lse = 3 + ln {f4(h['l2'])} = {f4(h['lse'])}",
        "The softmax of the whole row is " + listing([f4(w) for w in h["weights"]])
        + f", and its weighted sum of the values is {f4(h['weighted'])}: the same number")
    assert f4(h["weighted"]) == f4(h["out"])
    assert_in_chapter("one query, four keys in two tiles of two, D = 1")


def test_the_merge_of_the_halves():
    h = by_hand()
    assert_in_chapter(
        f"keys 0, 1 out_a = {f4(h['acc1'])} / {f4(h['l1'])} = {f4(h['out_a'])} "
        f"lse_a = 2 + ln {f4(h['l1'])} = {f4(h['lse_a'])}",
        f"keys 2, 3 out_b = (6 + 8 e^-3) / (1 + e^-3) = {f4(h['out_b'])} "
        f"lse_b = 3 + ln {f4(h['l_b'])} = {f4(h['lse_b'])}",
        f"weights w_a = e^({f4(h['lse_a'])} - {f4(h['lse_b'])}) = {f4(h['w_a'])}, w_b = 1",
        f"merged out = ({f4(h['w_a'])} × {f4(h['out_a'])} + {f4(h['out_b'])}) / "
        f"{f4(1 + h['w_a'])} = {f4(h['merged'])} "
        f"lse = {f4(h['lse_b'])} + ln {f4(1 + h['w_a'])} = {f4(h['merged_lse'])}")
    # "the merge is exact": the merged halves are the two-tile pass's numbers
    assert f4(h["merged"]) == f4(h["out"]) and f4(h["merged_lse"]) == f4(h["lse"])


# --- the Motivation's and Core idea's arithmetic ----------------------------------------------

def test_the_score_matrices_bytes(rec):
    heads = rec["memory"]["heads"]                       # the bundled model's head shape
    h, d = heads["num_heads"], heads["head_dim"]
    t_len = 8192
    scores = h * t_len ** 2 * 4
    output = t_len * h * d * 4
    llama = 32 * 32768 ** 2 * 2
    assert llama / 80e9 > 0.5                                   # "most of an 80 GB GPU"
    assert_in_chapter(
        f"The bundled model's {h} heads, run alone at T = S = {t_len:,}",
        f"hold {h} × {t_len:,}² float32 scores: {scores / 1e9:.2f} GB for one layer, to "
        f"produce an output of {output / 1e6:.1f} MB",
        f"32 × 32,768² × 2 bytes = {llama / 1e9:.1f} GB per layer, most of an 80 GB GPU")


def test_operations_a_byte_and_the_ridge():
    d, crossings, bytes_each = 128, 4, 2                  # bfloat16, four passes over memory
    ops = 4 * d
    assert_in_chapter(
        "Each score costs 4D floating-point operations (2D to compute it, 2D to use it) and "
        "crosses memory four times",
        f"In bfloat16 with D = {d} that is {ops} operations for {crossings * bytes_each} bytes, "
        f"{ops // (crossings * bytes_each)} a byte, far left of the ridge near 295 operations "
        "a byte that S07 computed for an H100")
    assert "a ridge near 295 FLOP/byte" in text(ROOT / "chapters" / "s07-measuring.md")


def test_figures_carried_from_s12_and_s16():
    assert "a decode step 1.29 times as long as S11's" in text(
        ROOT / "chapters" / "s12-paged-attention.md")
    assert_in_chapter("its decode step took 1.29 times as long as S11's contiguous one")
    s16 = json.loads(S16_RECORD.read_text())["host"]["models"]["bundled"]
    context = s16["batches"]["1"]["eager"]["context"]
    assert abs(context - 40) <= 1
    assert_in_chapter(f"attending over all {s16['max_context']} positions of every block table, "
                      "where a request held about 40")


# --- Measured: memory -------------------------------------------------------------------------

def memory_rows(rec) -> dict[str, dict[int, dict]]:
    rows: dict[str, dict[int, dict]] = {}
    for r in rec["memory"]["rows"]:
        assert "error" not in r, r
        rows.setdefault(r["method"], {})[r["T"]] = r
    return rows


def test_tiling_removes_the_matrix(rec):
    part = rec["memory"]
    rows = memory_rows(rec)
    ts = part["T"]
    assert ts == [2048, 4096, 8192]
    assert list(rows) == part["methods"] == ["naive", "sdpa math", "sdpa", "tiled"]
    heads = part["heads"]
    naive = [rows["naive"][t]["peak_bytes"] for t in ts]
    scores = [rows["naive"][t]["scores_bytes"] for t in ts]
    assert scores == [heads["num_heads"] * t * t * 4 for t in ts]      # H T^2 float32
    times = [f"{n / s:.1f}" for n, s in zip(naive, scores)]
    assert len(set(times)) == 1, times                                 # "about 2.1 times"
    math_ = [rows["sdpa math"][t]["peak_bytes"] for t in ts]
    assert all(m > n for m, n in zip(math_, naive))                    # "peaked higher"
    fused = [rows["sdpa"][t]["peak_bytes"] / MIB for t in ts]
    tiled = [rows["tiled"][t]["peak_bytes"] / MIB for t in ts]
    worst = max(r.get("max_abs_diff_vs_naive", 0.0) for r in part["rows"])
    assert all(r["peak_reset"] for r in part["rows"])
    assert_in_chapter(
        "One causal prefill with the bundled model's heads peaked at "
        + listing([f"{n / MIB:,.0f}" for n in naive]) + " MiB in S06's naive attention at "
        "T = " + listing([f"{t:,}" for t in ts]) + f": about {times[0]} times one float32 "
        "score matrix (" + listing([f"{s / MIB:,.0f}" for s in scores]) + " MiB)",
        f"SDPA held to its math backend peaked higher, {math_[-1] / MIB:,.0f} MiB at "
        f"{ts[-1]:,}.",
        "The tiled reference peaked at " + listing([f"{v:.1f}" for v in tiled]) + " MiB, and "
        f"torch's default SDPA, a fused kernel on this CPU, at {min(fused):.1f} to "
        f"{max(fused):.1f} MiB; every output was within {up(worst)} of the naive one.")


# --- Measured: the decode step ----------------------------------------------------------------

def test_the_targets_are_the_decode_points_verdicts(rec):
    target = [p for m in rec["decode"]["models"] for p in points(rec, m)]
    assert len(rec["targets"]) == len(target)
    for t, p in zip(rec["targets"], target):
        assert t["value"] == p["ratios"]["paged"]["step"] and t["bound"] == p["target"] == 1.0
        assert t["pass"] == p["pass"] == (p["ratios"]["paged"]["step"] <= 1.0)
        assert f"B {p['batch']}, context {p['context']}" in t["name"]
    for model in rec["decode"]["models"]:
        paged = step_ratios(rec, model, "paged")
        assert rec["key"][f"{model}_paged_over_contiguous_step_max"] == max(paged)
        assert rec["key"][f"{model}_paged_over_contiguous_step_min"] == min(paged)
        for p in points(rec, model):
            med = p["median"]
            for name, r in p["ratios"].items():
                assert r["step"] == pytest.approx(med[name]["step_ms"]
                                                  / med["contiguous"]["step_ms"])
            assert statistics.median(p["samples"]["contiguous"]["step_ms"]) == \
                pytest.approx(med["contiguous"]["step_ms"])


def b1_parity_sentence(rec) -> str:
    """The sentence on the bundled model's points at B = 1, from the record: every one met the
    target, its paged step within 5% of the contiguous one ("at parity"), and the spread of both
    engines' steps there far more than the gap between their medians ("within this shared
    machine's noise")."""
    b1 = [p for p in points(rec, "bundled") if p["batch"] == 1]
    assert b1 and all(p["pass"] for p in b1)
    ratios = [p["ratios"]["paged"]["step"] for p in b1]
    assert all(abs(r - 1.0) <= 0.05 for r in ratios), ratios                # "at parity"
    steps = [t for p in b1 for name in ("paged", "contiguous")
             for t in p["samples"][name]["step_ms"]]
    for p in b1:                              # "far more than the gap" between the medians
        med = p["median"]
        assert max(steps) - min(steps) > 5 * abs(med["paged"]["step_ms"]
                                                 - med["contiguous"]["step_ms"])
    contexts = listing([str(p["context"]) for p in b1])
    return (f"At B = 1 on the bundled model (contexts {contexts}) the paged step took "
            f"{x(min(ratios))} to {x(max(ratios))}: the two engines are at parity there, within "
            f"this shared machine's noise, since the attention is a sliver of the step and the "
            f"steps of both engines spread from {min(steps):.2f} to {max(steps):.2f} ms, far "
            "more than the gap.")


def test_the_paged_decode_step(rec):
    models = rec["decode"]["models"]
    mid = models["mid"]
    met = sum(t["pass"] for t in rec["targets"])
    assert met == len(rec["targets"])                                 # "at all 22 points"
    b_paged, b_gather = step_ratios(rec, "bundled", "paged"), step_ratios(rec, "bundled", "gather")
    m_paged, m_gather = step_ratios(rec, "mid", "paged"), step_ratios(rec, "mid", "gather")
    assert mid["heads"]["head_dim"] == rec["config"]["mid_shape"]["head_dim"]
    assert_in_chapter(
        f"The paged decode step met this chapter's target, at most S11's contiguous step, at "
        f"all {len(rec['targets'])} points measured.",
        f"On the bundled model it took {x(min(b_paged))} to {x(max(b_paged))} of the "
        f"contiguous step, where S12's gather took {x(min(b_gather))} to {x(max(b_gather))}; "
        f"on a random model of Qwen3's layout ({mid['num_layers']} layers, "
        f"D = {mid['heads']['head_dim']}, contexts to {max(mid['contexts']):,} of its "
        f"{mid['limit']:,}) {x(min(m_paged))} to {x(max(m_paged))}, where the gather took "
        f"{x(min(m_gather))} to {x(max(m_gather))}.",
        b1_parity_sentence(rec))
    # "Every request's tokens were the same in both engines"
    for m in models:
        for p in points(rec, m):
            assert p["same_tokens"] == p["batch"], (m, p["batch"], p["context"])
    assert_in_chapter("Every request's tokens were the same in both engines (Deep dive).")
    # an earlier record's B = 1 misses and the probe's timings are not in this record: the
    # paragraph that quotes them says so, and its marker closes it
    para = text()[text().index("An earlier record of this benchmark"):]
    para = para[:para.index("<!-- probe, not in the record -->")]
    assert "<!--" not in para and "in a probe." in para, para


def test_the_deep_dives_table_of_every_decode_point(rec):
    config = rec["config"]
    decode = rec["decode"]
    assert decode["block_size"] == config["block_size"] == 16 and config["jitter"] == 0.25
    assert decode["backends"] == ["gather", "sdpa", "paged"]
    rows = []
    for model, part in decode["models"].items():
        for p in part["points"]:
            r = p["ratios"]
            rows.append(f"| {MODEL_NAMES[model]} | {p['batch']} | {p['context']} | "
                        f"{p['median']['contiguous']['step_ms']:.2f} | "
                        f"{x(r['gather']['step'])} | {x(r['sdpa']['step'])} | "
                        f"{x(r['paged']['step'])} | {p['same_tokens']} of {p['batch']} |")
            # "prompts the context ±25%": the prompt lengths drawn
            lens = p["context_lens"]
            assert len(lens) == p["batch"]
            assert p["context"] * (1 - config["jitter"]) - 1 <= min(lens)
            assert max(lens) <= p["context"] * (1 + config["jitter"])
    md = CHAPTER.read_text()
    table = [line for line in md.splitlines()
             if re.match(r"\| (bundled|mid-size) \| \d", line)]
    assert table == rows
    assert_in_chapter(
        "| model | B | context | contiguous step, ms | gather | sdpa | paged | tokens equal |",
        f"(blocks of {config['block_size']}; prompts the context ±{config['jitter']:.0%}, so "
        "the longest reach about 5/4 of it)")
    skipped = decode["models"]["mid"]["skipped"]
    assert decode["models"]["bundled"]["skipped"] == []
    contexts = {s["context"] for s in skipped}
    assert len(contexts) == 1
    cap = decode["models"]["mid"]["token_cap"]
    assert all(s["batch"] * s["context"] > cap for s in skipped)
    assert_in_chapter(
        "The mid-size model skipped B = " + listing([str(s["batch"]) for s in skipped])
        + f" at context {contexts.pop():,} (their prefill alone would take minutes here).")


# --- Measured: one layer's attention alone ----------------------------------------------------

def traffic_points(rec) -> list[dict]:
    return [p for part in rec["traffic"]["models"].values() for p in part["points"]]


def over_contiguous(rec, kernel: str, what: str) -> list[float]:
    """Each traffic point's kernel over the contiguous read: "bytes" or "time"."""
    def value(k: dict) -> float:
        return k["traffic"]["total"] if what == "bytes" else k["ms"]
    return [value(p["kernels"][kernel]) / value(p["kernels"]["contiguous"])
            for p in traffic_points(rec)]


def test_the_traffic_follows_the_tables_formulas(rec):
    """The chapter's table: key and value positions per backend, from the record's lengths."""
    block = rec["decode"]["block_size"]
    for part in rec["traffic"]["models"].values():
        heads = part["heads"]
        per_position = 2 * heads["num_kv_heads"] * heads["head_dim"] * 4
        for p in part["points"]:
            lens = p["context_lens"]
            b, s_max = len(lens), max(lens)
            assert b == p["batch"]
            s_up = -(-s_max // block) * block                       # S_max rounded up to a block
            k = {n: v["traffic"] for n, v in p["kernels"].items()}
            assert k["contiguous"]["kv_read"] == b * s_max * per_position
            for name in ("gather", "sdpa"):
                assert k[name]["kv_read"] + k[name]["kv_copy"] == \
                    (2 * b * s_up + b * s_max) * per_position
            assert k["gather"]["scores"] == 4 * b * heads["num_heads"] * s_max * 4
            assert k["sdpa"]["scores"] == 0 and k["contiguous"]["scores"] == 0
            assert k["paged"]["kv_read"] == sum(lens) * per_position
            assert k["paged"]["tables"] == sum(-(-n // block) for n in lens) * 8
            assert p["paged_over_contiguous"] == \
                p["kernels"]["paged"]["ms"] / p["kernels"]["contiguous"]["ms"]
    for model, part in rec["traffic"]["models"].items():
        assert rec["key"][f"{model}_paged_attention_over_contiguous_max"] == \
            max(p["paged_over_contiguous"] for p in part["points"])


def test_one_layers_attention_alone(rec):
    t = rec["traffic"]
    copies = over_contiguous(rec, "gather", "bytes") + over_contiguous(rec, "sdpa", "bytes")
    gather, sdpa = over_contiguous(rec, "gather", "time"), over_contiguous(rec, "sdpa", "time")
    paged_bytes, paged = over_contiguous(rec, "paged", "bytes"), over_contiguous(rec, "paged",
                                                                                 "time")
    assert t["max_abs_diff"] < 1e-5                                  # the outputs agree
    assert_in_chapter(
        f"The gather and the SDPA backend moved {min(copies):.1f} to {max(copies):.1f} times "
        f"the contiguous read's bytes; the gather took {min(gather):.1f} to {max(gather):.1f} "
        f"times its time (median {statistics.median(gather):.1f}), the SDPA backend "
        f"{min(sdpa):.1f} to {max(sdpa):.1f} times (median {statistics.median(sdpa):.1f}).",
        f"The paged kernel moved {min(paged_bytes):.2f} to {max(paged_bytes):.2f} times the "
        f"bytes and took {x(min(paged))} to {x(max(paged))} the time (median "
        f"{x(statistics.median(paged))}).")
    assert max(paged_bytes) < 1.01            # its own positions plus the table: at most ~1x


def test_no_kernel_near_the_copy_at_the_large_points(rec):
    """"Where every kernel moved more than 16 MiB (six points, all of the mid-size model) none
    passed 12.0 GB/s, less than half the copy's 26.6 GB/s"."""
    bw = rec["traffic"]["bandwidth_bytes_per_s"]
    assert "copy_" in rec["traffic"]["bandwidth_method"]
    large = {model: [p for p in part["points"]
                     if min(k["traffic"]["total"] for k in p["kernels"].values()) > 16 * MIB]
             for model, part in rec["traffic"]["models"].items()}
    count = sum(len(v) for v in large.values())
    assert large["bundled"] == [] and count == len(large["mid"])      # "all of the mid-size"
    fastest = max(k["bytes_per_s"] for p in large["mid"] for k in p["kernels"].values())
    assert fastest < bw / 2                                           # "less than half"
    assert_in_chapter(
        f"Where every kernel moved more than 16 MiB ({WORDS[count]} points, all of the mid-size "
        f"model) none passed {fastest / 1e9:.1f} GB/s, less than half the copy's "
        f"{bw / 1e9:.1f} GB/s")


def test_the_bundled_point_at_b8(rec):
    """The traffic table's example: the bundled model at B = 8, contexts of about 160."""
    [p] = [p for p in rec["traffic"]["models"]["bundled"]["points"]
           if p["batch"] == 8 and p["context"] == 160]
    k = p["kernels"]
    kib = {n: f"{round(k[n]['traffic']['total'] / 1024):,}" for n in k}
    us = {n: f"{round(k[n]['ms'] * 1e3):,}" for n in k}
    assert_in_chapter(
        f"For the bundled model at B = 8 and contexts of about 160, the record counts "
        f"{kib['contiguous']} KiB for the contiguous read, {kib['gather']} KiB for the gather, "
        f"{kib['sdpa']} for the SDPA backend and {kib['paged']} for the paged kernel, which took "
        f"{us['contiguous']}, {us['gather']}, {us['sdpa']} and {us['paged']} µs alone.")


# --- the quiz and the exercises ---------------------------------------------------------------

def quiz() -> dict:
    return {q["id"]: q for q in json.loads(QUIZ.read_text())["questions"]}


def answer(q: dict) -> str:
    return q["choices"][q["answer"]]


def test_the_quizs_numbers_recompute():
    qs = quiz()
    # q1: m = 2, l = 1.5 after tile 1; the second tile brings 4 and 0
    q1 = qs["q1-online-rescale"]
    assert "m = 2 and l = 1.5" in q1["question"] and "the scores 4 and 0" in q1["question"]
    m, l, acc = s17_flash.online_softmax_update(
        torch.tensor([2.0]), torch.tensor([1.5]), torch.zeros(1, 1), torch.tensor([[4.0, 0.0]]),
        torch.zeros(2, 1))
    rescaled = 1.5 * math.exp(2 - 4) + 1 + math.exp(-4)
    assert float(m) == 4.0 and float(l) == pytest.approx(rescaled, rel=1e-6)
    assert answer(q1) == f"m = 4 and l = 1.5 e^-2 + 1 + e^-4, about {rescaled:.2f}"
    assert f"about {1.5 + 1 + math.exp(-4):.2f}" in q1["choices"][1]     # the old sum kept
    # q2: equal lses of 5, outputs 1.0 and 3.0
    out, lse = s17_flash.merge_attn_states(torch.tensor([[1.0]]), torch.tensor([5.0]),
                                           torch.tensor([[3.0]]), torch.tensor([5.0]))
    assert float(out) == pytest.approx(2.0) and float(lse) == pytest.approx(5 + math.log(2))
    assert answer(qs["q2-merge"]) == "2.0 and 5 + ln 2"
    # q3: 10 cached, a chunk of 4, the chunk's second query (i = 1) sees keys 0 .. 11
    s_len, t_len, i = 14, 4, 1
    visible = [j for j in range(s_len) if j <= s_len - t_len + i]
    assert visible == list(range(12))
    assert answer(qs["q3-bottom-right"]) == f"Keys 0 to {visible[-1]}"
    assert f"{s_len} - {t_len} + {i} = {visible[-1]}" in qs["q3-bottom-right"]["explanation"]
    # q5: one request of a model with 8 KV heads is 8 programs
    assert "8 programs for one request of a model with 8 KV heads" in \
        qs["q5-why-split-k"]["explanation"]
    assert_in_chapter("One request of a model with 8 KV heads makes 8 programs")


def test_the_exercises_points():
    points_ = [int(n) for n in re.findall(r"\((\d+) points?\), `", text())]
    assert points_ == [4, 3, 3]
    assert_in_chapter(f"prints a table of points per test ({sum(points_)} in all)")


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
    assert any(m.group(1).endswith(".c") for m in blocks)            # the C kernel's excerpts
    for m in blocks:
        path = (CHAPTER.parent / m.group(1)).resolve()
        code = path.read_text()
        options = dict(re.findall(r":(\S+):\s*(.*)", m.group(2)))
        assert {"pyobject", "start-after", "end-before"} & set(options), m.group(0)
        if "pyobject" in options:
            assert path.suffix == ".py", m.group(0)
            assert has_object(code, options["pyobject"]), (m.group(1), options["pyobject"])
        if "start-after" in options:
            start = code.find(options["start-after"])
            assert start >= 0, (m.group(1), options["start-after"])
            assert code.count(options["start-after"]) == 1, options["start-after"]  # that one
            code = code[start + len(options["start-after"]):]
        if "end-before" in options:
            end = code.find(options["end-before"])
            assert end > 0, (m.group(1), options["end-before"])   # after the start, not empty
            code = code[:end]
        assert code.strip(), m.group(0)


# --- the figure -------------------------------------------------------------------------------

def test_the_figure_is_the_records_drawing_with_its_legends_off_the_data(rec, capsys):
    """chapters/figures/s17_attention.png is scripts/s17_figure.py's drawing of the record (its
    --check, run in this process), the chapter embeds it, and no legend covers a point."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import matplotlib.pyplot as plt
    import s17_figure
    from legend_check import covered_by_legends, describe
    assert s17_figure.DATA == RECORD and s17_figure.OUT == FIGURE
    assert "```{figure} figures/s17_attention.png" in CHAPTER.read_text()
    fig = s17_figure.build_figure(rec)
    try:
        found = covered_by_legends(fig)
    finally:
        plt.close(fig)
    assert not found, describe(found)
    assert s17_figure.main(["--check"]) == 0, capsys.readouterr().out
