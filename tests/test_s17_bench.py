"""The S17 benchmark (benchmarks/bench_s17_attention.py): its command line, one --quick run
written to a temporary path (never the committed record), and the record's shape and internal
consistency, for that quick run and for the committed record
(chapters/figures/s17_attention.json) when it exists.

Oracles: medians and ratios recomputed here from the raw samples the record keeps; the scores
bytes H T^2 4 and the keys and values each backend reads counted by hand; the traffic entries
against s17_attention.attention_traffic (tested on its own in tests/test_s17_attention.py);
the prompt lengths against the +-25 % rule and the skipped points against the token cap; the
outputs of the naive and tiled attention, and of the four decode kernels, compared with each
other in the run (stored differences checked here); the greedy tokens of the paged engine
(its three backends in turn) against the contiguous engine's on the bundled model. No
measured speed is asserted; memory only where the algorithm decides it (the naive call holds
at least the scores, the tiled one far less).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from bench_testing import import_benchmark, quick_run, usage_error

import s17_attention as s17a

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "chapters" / "figures" / "s17_attention.json"
KERNELS = ["contiguous", "gather", "sdpa", "paged"]
ENGINES = ["contiguous", "gather", "sdpa", "paged"]


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_s17_attention")


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be an integer in [1, 16] (got 0)"),
    (["--repeats", "21"], "--repeats must be an integer in [1, 20] (got 21)"),
    (["--gpu-repeats", "0"], "--gpu-repeats must be an integer in [1, 100] (got 0)"),
    (["--repeats", "5", "--steps", "4"], "3 x (1 + --repeats x --steps) + 1 decode steps per "
                                         "request must fit the 54 tokens the bundled model's "
                                         "longest prompts leave (got 64)"),
    (["--batches", "0,8"], "--batches takes distinct comma-separated integers in [1, 64] "
                           "(got '0,8')"),
    (["--batches", "8,8"], "--batches takes distinct comma-separated integers in [1, 64]"),
    (["--sections", "speed"], "--sections takes comma-separated names from "
                              "memory,decode,traffic,gpu (got 'speed')"),
    (["--sections", "gpu"], "the gpu section runs with --device cuda"),
    (["--budget-s", "0"], "--budget-s must be a number of seconds > 0 (got 0.0)"),
    (["--record", "--json", "x.json"], "give --json or --record, not both"),
    (["--record", "--quick"], "--record takes a full run, not --quick"),
    (["--record", "--sections", "memory"], "--record takes every CPU section"),
    (["--seed", "-1"], "--seed must be an integer >= 0 (got -1)"),
    (["--device", "tpu"], "--device must be 'cpu', 'cuda' or 'cuda:N' (got 'tpu')"),
])
def test_bad_flags_are_usage_errors(bench, argv, message, capsys, monkeypatch):
    assert message in usage_error(bench, argv, capsys, monkeypatch)


def test_json_must_be_a_writable_file(bench, tmp_path, capsys, monkeypatch):
    assert "--json" in usage_error(bench, ["--json", str(tmp_path)], capsys, monkeypatch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_a_usage_error(bench, capsys, monkeypatch):
    assert "needs a CUDA device" in usage_error(bench, ["--device", "cuda"], capsys, monkeypatch)


def test_the_paged_backend_without_a_compiler_is_a_usage_error(bench, capsys, monkeypatch):
    """No C compiler: the decode section's paged backend cannot be built, said first."""
    monkeypatch.setattr(bench.s17_cpu, "find_cc", lambda: None)
    assert "needs a C compiler" in usage_error(bench, [], capsys, monkeypatch)


def test_the_decode_and_traffic_sections_draw_the_same_prompt_lengths(bench):
    """Both sections measure one point with the same lengths: the context +- 25 %, seeded."""
    for key, batch, context in (("bundled", 8, 96), ("mid", 64, 1536)):
        lens = bench.point_lens(0, key, batch, context)
        assert lens == bench.point_lens(0, key, batch, context) and len(lens) == batch
        assert all(int(context * 0.75) <= n <= int(context * 1.25) for n in lens)
    assert bench.point_lens(0, "bundled", 8, 96) != bench.point_lens(1, "bundled", 8, 96)


# --- one --quick run into a temporary file ----------------------------------------------------

@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("s17_bench") / "quick.json"
    return (*quick_run(bench, out, RECORD), bench)


def test_quick_run_prints_every_section_and_no_verdict(quick):
    figures, returned, text, bench = quick
    assert text.count(bench.QUICK_DISCLAIMER) == 2
    for needle in ("1. memory", "2. decode step", "3. traffic", "copy bandwidth", "before:",
                   "after:", "load average", "torch ", "summary"):
        assert needle in text, needle
    assert "PASS" not in text and "MISS" not in text
    assert "(quick run: no verdicts)" in text
    assert figures["targets"] == []
    assert figures == json.loads(json.dumps(returned))
    config = figures["config"]
    assert config["quick"] is True and config["threads"] == 1 and config["batches"] == [1, 8]
    assert config["sections"] == ["memory", "decode", "traffic"] and "gpu" not in figures
    assert list(figures["decode"]["models"]) == ["bundled"]      # the bundled model only


def test_quick_record_is_consistent(quick):
    check_record(quick[0])


# --- the committed record ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def record():
    if not RECORD.exists():
        pytest.skip("no committed record yet")
    return json.loads(RECORD.read_text())


def test_the_record_is_a_full_run_on_one_thread(record):
    config = record["config"]
    assert config["quick"] is False and config["threads"] == 1 and config["device"] == "cpu"
    assert config["sections"] == ["memory", "decode", "traffic"]
    assert config["batches"] == [1, 8, 32, 64] and config["repeats"] >= 3
    assert record["memory"]["T"] == [2048, 4096, 8192]
    assert list(record["decode"]["models"]) == ["bundled", "mid"]
    assert record["elapsed_s"] <= 10 * 60


def test_the_record_is_consistent(record):
    check_record(record)


def test_the_record_has_a_verdict_per_decode_point(record):
    points = [p for m in record["decode"]["models"].values() for p in m["points"]]
    assert len(record["targets"]) == len(points) > 0


# --- the checks -------------------------------------------------------------------------------

def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def check_memory(m: dict, config: dict) -> None:
    h = m["heads"]["num_heads"]
    assert [(r["T"], r["method"]) for r in m["rows"]] == [(t, x) for t in m["T"]
                                                          for x in m["methods"]]
    for r in m["rows"]:
        assert "error" not in r, r
        assert r["scores_bytes"] == h * r["T"] ** 2 * 4          # one float32 (H, T, T)
        assert r["seconds"] > 0 and r["peak_bytes"] >= 0
        # the same seeded q, k, v: every method computes the naive output
        assert r["max_abs_diff_vs_naive"] < 1e-4
        if r["method"] in ("naive", "sdpa math"):
            assert r["peak_bytes"] >= r["scores_bytes"], r    # the scores are all in memory
        if r["method"] == "tiled":
            assert r["peak_bytes"] < r["scores_bytes"] / 2, r  # one tile of them at a time
        if r["method"] == "naive":
            assert r["max_abs_diff_vs_naive"] == 0


def check_decode(d: dict, config: dict) -> None:
    repeats, steps = config["repeats"], config["steps"]
    assert d["backends"] == ["gather", "sdpa", "paged"]
    for key, part in d["models"].items():
        cap = part["token_cap"]
        measured = [(p["batch"], p["context"]) for p in part["points"]]
        skipped = [(s["batch"], s["context"]) for s in part["skipped"]]
        grid = [(b, c) for b in config["batches"] for c in part["contexts"]]
        assert sorted(measured + skipped) == sorted(grid)
        assert all(cap is not None and b * c > cap for b, c in skipped)
        assert all(cap is None or b * c <= cap for b, c in measured)
        for p in part["points"]:
            lens = p["context_lens"]
            assert len(lens) == p["batch"]
            assert all(int(p["context"] * 0.75) <= n <= int(p["context"] * 1.25) for n in lens)
            assert p["steps_each"] == 3 * (config["warmup"] + repeats * steps)
            assert p["tokens_each"] == p["steps_each"] + 1          # the prefill's token too
            assert max(lens) + p["steps_each"] + 1 <= p["max_context"] <= part["limit"]
            s = p["samples"]
            assert list(s) == ENGINES
            for name in ENGINES:
                want = repeats * steps * (3 if name == "contiguous" else 1)
                assert len(s[name]["step_ms"]) == len(s[name]["model_ms"]) == want
                assert all(0 < m <= w for m, w in zip(s[name]["model_ms"], s[name]["step_ms"]))
                for k in ("step_ms", "model_ms"):
                    assert close(p["median"][name][k], statistics.median(s[name][k]))
            c = p["median"]["contiguous"]
            for name in ("gather", "sdpa", "paged"):
                r = p["ratios"][name]
                assert close(r["step"], p["median"][name]["step_ms"] / c["step_ms"])
                assert close(r["model"], p["median"][name]["model_ms"] / c["model_ms"])
            assert p["pass"] == (None if config["quick"] else p["ratios"]["paged"]["step"] <= 1)
            assert 0 <= p["same_tokens"] <= p["batch"]
            if key == "bundled":
                # greedy float32 on the trained model: the attention's summation order does
                # not move a top-1 here (not asserted on the random model, whose near-uniform
                # logits may flip one)
                assert p["same_tokens"] == p["batch"], p


def check_traffic(t: dict, decode: dict | None, config: dict) -> None:
    assert t["bandwidth_bytes_per_s"] > 0
    assert t["calls"] == max(3, config["repeats"] * config["steps"])
    for key, part in t["models"].items():
        heads = part["heads"]
        n_kv, d = heads["num_kv_heads"], heads["head_dim"]
        ran = {(p["batch"], p["context"])
               for p in (decode or {}).get("models", {}).get(key, {}).get("points", [])}
        for p in part["points"]:
            lens = p["context_lens"]
            assert p["in_decode_section"] == ((p["batch"], p["context"]) in ran)
            rows = p["kernels"]
            assert list(rows) == KERNELS
            for name, r in rows.items():
                assert len(r["samples_ms"]) == t["calls"]
                assert close(r["ms"], statistics.median(r["samples_ms"]))
                assert r["traffic"] == s17a.attention_traffic(name, lens, block_size=16,
                                                              **heads)
                assert close(r["bytes_per_s"], r["traffic"]["total"] / (r["ms"] / 1e3))
                assert r["max_abs_diff_vs_contiguous"] < 1e-4      # the same attention
            # by hand: a key and a value of Hkv x D float32 per position read; contiguous
            # reads every request to the longest context, paged each its own
            position = 2 * n_kv * d * 4
            assert rows["contiguous"]["traffic"]["kv_read"] == len(lens) * max(lens) * position
            assert rows["paged"]["traffic"]["kv_read"] == sum(lens) * position
            assert close(p["paged_over_contiguous"],
                         rows["paged"]["ms"] / rows["contiguous"]["ms"])


def check_record(r: dict) -> None:
    config = r["config"]
    for when in ("start", "end"):
        assert len(r["load_average"][when]) == 3 and min(r["load_average"][when]) >= 0
    assert "load average" in r["uptime_before"] and "load average" in r["uptime_after"]
    assert config["torch"] and config["machine"] and config["threads"] == 1
    for name in config["sections"]:
        assert name in r and r["section_s"][name] > 0
        assert len(r[name]["load_average_1min"]) == 2
    if "memory" in r:
        check_memory(r["memory"], config)
    if "decode" in r:
        check_decode(r["decode"], config)
    if "traffic" in r:
        check_traffic(r["traffic"], r.get("decode"), config)
    points = [(m, p) for m, part in r.get("decode", {}).get("models", {}).items()
              for p in part["points"]]
    if config["quick"]:
        assert r["targets"] == []
    else:
        assert [t["pass"] for t in r["targets"]] == [p["pass"] for _, p in points]
        assert [t["value"] for t in r["targets"]] == [p["ratios"]["paged"]["step"]
                                                      for _, p in points]
    for model in {m for m, _ in points}:
        ratios = [p["ratios"]["paged"]["step"] for m, p in points if m == model]
        assert r["key"][f"{model}_paged_over_contiguous_step_max"] == max(ratios)
        assert r["key"][f"{model}_paged_over_contiguous_step_min"] == min(ratios)
