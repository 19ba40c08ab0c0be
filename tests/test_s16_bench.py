"""The S16 benchmark (benchmarks/bench_s16_host.py): its command line, one --quick run written
to a temporary path (never the committed record), and the record's shape and internal
consistency, for that quick run and for the committed record (chapters/figures/s16_host.json)
when it exists.

Oracles: medians, host times, fractions, ratios, tokens/s and bandwidth floors recomputed here
from the raw figures the record keeps (every timed step, every token interval); bytes per step
from S07's `batched_decode_cost`, not the benchmark's arithmetic; greedy tokens of the fp32
engines against S06's engine and HF's generate (E, on the bundled model: a --quick run's), and
the async engines' tokens and finish reasons (a worker thread's and a worker process's)
against their synchronous twins' (D); every forward of a bucketed variant counted by the
static runner; the verdicts recomputed from the stored medians; a --quick run prints and
stores no verdict. No measured speed is asserted.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from bench_testing import import_benchmark, quick_run, usage_error

import s03_checkpoint
import s03_transformer as s03
import s07_roofline as roof

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "chapters" / "figures" / "s16_host.json"
CPU_VARIANTS = ["eager", "static", "compiled", "async eager", "async compiled", "mp",
                "async mp"]
UNBUCKETED = ("eager", "async eager", "mp", "async mp")
E_ROWS = ["S06 fp32", "S13 fp32 eager", "S13 int4 eager", "compiled fp32", "compiled int4",
          "HF generate fp32"]


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_s16_host")


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be an integer in [1, 64] (got 0)"),
    (["--steps", "65"], "--steps must be an integer in [1, 64] (got 65)"),
    (["--rounds", "21"], "--rounds must be an integer in [1, 20] (got 21)"),
    (["--tokens", "1"], "--tokens must be an integer in [2, 56] (got 1)"),
    (["--async-batch", "65"], "--async-batch must be an integer in [1, 64] (got 65)"),
    (["--rounds", "20", "--steps", "8"], "--warmup + --rounds x (--steps + 1) + 2 decode steps "
                                         "per request must fit the 64 tokens the longest "
                                         "prompts leave (got 185)"),
    (["--batches", "0,8"], "--batches takes distinct comma-separated integers in [1, 64] "
                           "(got '0,8')"),
    (["--batches", "8,8"], "--batches takes distinct comma-separated integers in [1, 64]"),
    (["--batches", "one"], "--batches takes distinct comma-separated integers in [1, 64]"),
    (["--sections", "speed"], "--sections takes comma-separated names from "
                              "host,compiled,compile,async,int4 (got 'speed')"),
    (["--record", "--json", "x.json"], "give --json or --record, not both"),
    (["--record", "--quick"], "--record takes a full run, not --quick"),
    (["--threads", "0"], "--threads must be an integer in [1, "),
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


def test_compile_without_a_compiler_is_a_usage_error(bench, capsys, monkeypatch):
    """No C++ compiler: the compiled variants cannot run, said before anything is built."""
    monkeypatch.setattr(bench.s16_static, "find_cxx", lambda: None)
    assert "need torch.compile" in usage_error(bench, [], capsys, monkeypatch)


def test_an_async_variant_is_timed_against_its_synchronous_twin(bench):
    """D pairs variants by their flags: another async engine variant needs only its entry."""
    variants = list(bench.VARIANTS)
    by = {v.label: v for v in variants}
    assert bench.sync_twin(by["async eager"], variants) is by["eager"]
    assert bench.sync_twin(by["async compiled"], variants) is by["compiled"]
    assert bench.sync_twin(by["async mp"], variants) is by["eager"]
    extra = bench.Variant("async mp compiled", "a new one",
                          {"compile": True, "async_scheduling": True, "executor_backend": "mp"})
    assert bench.sync_twin(extra, variants + [extra]) is by["compiled"]
    assert [v.label for v in bench.variants_for("cpu")] == CPU_VARIANTS
    assert [v.label for v in variants if v.counts_ops] == ["eager", "static"]


# --- one --quick run into a temporary file ----------------------------------------------------

@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("s16_bench") / "quick.json"
    return (*quick_run(bench, out, RECORD), bench)


def test_quick_run_prints_every_section_and_no_verdict(quick):
    figures, returned, text, bench = quick
    assert text.count(bench.QUICK_DISCLAIMER) == 2
    for needle in ("A. host", "B. compiled", "C. compile", "D. async", "E. int4",
                   "worked example:", "why:", "load average", "summary"):
        assert needle in text, needle
    assert "PASS" not in text and "MISS" not in text
    assert "(quick run: no verdicts)" in text
    assert figures["targets"] == []
    assert figures == json.loads(json.dumps(returned))
    config = figures["config"]
    assert config["quick"] is True and config["threads"] == 1 and config["batches"] == [1, 8]
    assert list(figures["host"]["models"]) == ["bundled"]        # the bundled model only


def test_quick_record_is_consistent(quick):
    check_record(quick[0])


def test_quick_compile_runs_no_cold_compile(quick):
    c = quick[0]["compile"]
    assert c["sizes"] == [1] and "skipped" in c["cold"]
    assert c["warm"]["compile_times_s"]["1"] > 0


# --- the committed record ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def record():
    if not RECORD.exists():
        pytest.skip("no committed record yet")
    return json.loads(RECORD.read_text())


def test_the_record_is_a_full_run_on_one_thread(record):
    config = record["config"]
    assert config["quick"] is False and config["threads"] == 1
    assert config["sections"] == ["host", "compiled", "compile", "async", "int4"]
    assert config["batches"] == [1, 8, 32, 64] and config["async_batch"] == 16
    assert config["rounds"] >= 3
    assert list(record["host"]["models"]) == ["bundled", "mid"]
    assert record["host"]["models"]["mid"]["parameters"] >= 100e6
    assert "error" not in record["compile"]["cold"] and "error" not in record["compile"]["warm"]
    assert record["elapsed_s"] <= 12 * 60


def test_the_record_is_consistent(record):
    check_record(record)


def test_the_record_has_every_verdict(record):
    names = [t["name"] for t in record["targets"]]
    assert len([n for n in names if n.startswith("compiled >=")]) == 8    # 4 B x 2 contexts
    assert len([n for n in names if "host_fraction" in n]) == 3   # async eager, compiled, mp


# --- the checks -------------------------------------------------------------------------------

def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def check_rows(rows: dict, batch: int, config: dict) -> None:
    """A table of decode steps (A, B's long contexts, D) against its raw figures."""
    for label, r in rows.items():
        assert r["steps"] == len(r["step_ms_all"]) == config["rounds"] * config["steps"]
        assert close(r["step_ms"], statistics.median(r["step_ms_all"]))
        assert close(r["host_ms"], r["step_ms"] - r["forward_ms"])
        assert close(r["host_fraction"], r["host_ms"] / r["step_ms"])
        assert r["forward_ms"] > 0 and 0 <= r["profiler_host_fraction"] <= 1
        assert r["forwards"] == config["rounds"] * (config["steps"] + 1)
        bucketed = label not in UNBUCKETED
        # every forward of a bucketed variant ran the static runner, none of the others did
        assert r["static_forwards"] == (r["forwards"] if bucketed else 0), label
        counted = label in ("eager", "static")
        assert (r["ops"] is not None) == counted and (r["model_ops"] is not None) == counted
        if counted:
            assert 0 < r["model_ops"] <= r["ops"]


def check_host(host: dict, config: dict) -> None:
    assert list(host["variants"]) == CPU_VARIANTS
    assert host["per_op_overhead_s"] > 0
    for key, part in host["models"].items():
        assert list(part["batches"]) == [str(b) for b in config["batches"]]
        for batch, rows in part["batches"].items():
            compiled = [label for label in rows if "compiled" in label]
            # a compiled variant runs only at a bucket it compiled: no padding
            assert bool(compiled) == (int(batch) in part["compiled_sizes"])
            assert list(rows)[:2] == ["eager", "static"]
            check_rows(rows, int(batch), config)
            prompt = config["short_prompt"]
            for r in rows.values():
                assert prompt < r["context"] < part["max_context"]
            # the eager and static steps of one batch size count their ops once per step
            assert rows["eager"]["ops"] > 100


def expected_ratios(by_batch: dict) -> dict:
    return {b: rows["eager"]["step_ms"] / rows["compiled"]["step_ms"]
            for b, rows in by_batch.items() if "compiled" in rows}


def check_compiled(r: dict, config: dict, models: dict) -> None:
    c = r["compiled"]
    assert c["target"] == 1.5
    if "host" in r:
        for key, rows in c["short"].items():
            want = expected_ratios(r["host"]["models"][key]["batches"])
            assert list(rows) == list(want)
            for b, row in rows.items():
                assert close(row["ratio"], want[b])
                assert close(row["ratio"], row["eager_ms"] / row["compiled_ms"])
    for b, row in c["long"]["bundled"].items():
        assert close(row["ratio"], row["eager_ms"] / row["compiled_ms"])
        # the long prompts: contexts about 200 of the bundled model's 256
        assert config["long_prompt"] < row["context"] < 256
    checks = c["checks"]
    assert [(t["context"], t["batch"]) for t in checks] == (
        [("short", int(b)) for b in c["short"]["bundled"]]
        + [("long", int(b)) for b in c["long"]["bundled"]])
    for t in checks:
        ratio = c[t["context"]]["bundled"][str(t["batch"])]["ratio"]
        assert close(t["ratio"], ratio)
        assert t["pass"] == (None if config["quick"] else ratio >= 1.5)
    for name in ("short", "long"):
        assert c["holds_at"][name] == [t["batch"] for t in checks
                                       if t["context"] == name and t["ratio"] >= 1.5]
    bandwidth = r["machine"]["bandwidth_bytes_per_s"]
    for key, rows in c["bandwidth"].items():
        config_of = models[key]
        for b, row in rows.items():
            short = c["short"][key][b]
            cost = roof.batched_decode_cost(config_of, int(b), round(short["context"]))
            assert row["bytes_per_step"] == cost.bytes
            assert close(row["eager_bytes_per_s"], cost.bytes / (short["eager_ms"] / 1e3))
            assert close(row["compiled_of_bandwidth"],
                         cost.bytes / (short["compiled_ms"] / 1e3) / bandwidth)
    assert "GB/s" in c["explanation"]


def check_compile(c: dict, config: dict) -> None:
    sizes = c["sizes"]
    assert sizes == ([1] if config["quick"] else
                     sorted(set(config["batches"]) | {config["async_batch"]}))
    for name in ("cold", "warm"):
        part = c[name]
        if "skipped" in part or "error" in part:
            continue
        assert sorted(map(int, part["compile_times_s"])) == sizes
        assert all(t > 0 for t in part["compile_times_s"].values())
        assert part["compile_s"] >= max(part["compile_times_s"].values()) * 0.999
        assert part["process_s"] > part["compile_s"]
    for key, engines in c["in_process"].items():
        for label, times in engines.items():
            assert "compiled" in label and all(t >= 0 for t in times.values())


def check_async(a: dict, config: dict) -> None:
    assert a["batch"] == config["async_batch"]
    check_rows(a["rows"], a["batch"], config)
    pairs = [(c["sync"], c["async"]) for c in a["checks"]]
    assert ("eager", "async eager") in pairs and ("eager", "async mp") in pairs
    for c in a["checks"]:
        sync, asyn = a["rows"][c["sync"]], a["rows"][c["async"]]
        assert close(c["host_fraction"], sync["profiler_host_fraction"])
        bound = sync["step_ms"] * (1 - sync["profiler_host_fraction"] / 2)
        assert close(c["bound_ms"], bound)
        assert c["pass"] == (None if config["quick"] else asyn["step_ms"] <= bound)
    assert [(t["sync"], t["async"]) for t in a["tokens"]] == pairs
    for t in a["tokens"]:
        # async scheduling changes when things happen, never what comes out
        assert t["identical_tokens"] == t["identical_finish_reasons"] == t["requests"]
        assert t["requests"] == a["batch"] and t["tokens"] > 0


def check_int4(e: dict, config: dict) -> None:
    rows = e["rows"]
    assert [label for label in E_ROWS if label in rows or label in e["skipped"]] == E_ROWS
    assert set(rows).isdisjoint(e["skipped"])
    n = e["tokens"]
    assert n == config["tokens"]
    bandwidth = e["bandwidth_bytes_per_s"]
    for label, r in rows.items():
        assert len(r["intervals_ms"]) == (n - 1) * e["repeats"]
        assert close(r["decode_ms"], statistics.median(r["intervals_ms"]))
        assert close(r["tokens_per_s"], 1e3 / r["decode_ms"])
        assert close(r["floor_ms"], r["bytes_per_token"] / bandwidth * 1e3)
        assert close(r["fraction_of_floor"], r["floor_ms"] / r["decode_ms"])
        assert close(r["speedup_vs_s06"], r["tokens_per_s"] / rows["S06 fp32"]["tokens_per_s"])
        # an int4 weight is read as codes and scales: fewer bytes than float32's
        if "int4" in label:
            assert r["bytes_per_token"] < rows["S06 fp32"]["bytes_per_token"] / 2
        else:
            assert r["bytes_per_token"] == rows["S06 fp32"]["bytes_per_token"]
    for label, r in rows.items():
        assert 0 <= r["same_tokens_as_s06"] <= n
        if e["model"] == "bundled" and "fp32" in label:
            # greedy fp32 on the trained model: the same tokens as S06's engine (the course's
            # parity chain). Not asserted on the random model, whose near-uniform logits let
            # a different summation order flip a top-1.
            assert r["same_tokens_as_s06"] == n, label


def check_record(r: dict) -> None:
    config = r["config"]
    for when in ("start", "end"):
        assert len(r["load_average"][when]) == 3 and min(r["load_average"][when]) >= 0
    assert "load average" in r["uptime_before"] and "load average" in r["uptime_after"]
    assert r["machine"]["per_op_overhead_s"] > 0 and r["machine"]["bandwidth_bytes_per_s"] > 0
    for name in config["sections"]:
        assert name in r and len(r[name]["load_average_1min"]) == 2
    models = {"bundled": s03_checkpoint.load_config(s03.BUNDLED_MODEL_DIR),
              "mid": s03_checkpoint.config_from_hf_dict({"model_type": "qwen3",
                                                         **config["mid_shape"]})}
    check_host(r["host"], config)
    check_compiled(r, config, models)
    check_compile(r["compile"], config)
    check_async(r["async"], config)
    check_int4(r["int4"], config)
    verdicts = ([t["pass"] for t in r["compiled"]["checks"]]
                + [c["pass"] for c in r["async"]["checks"]])
    if config["quick"]:
        assert all(v is None for v in verdicts) and r["targets"] == []
    else:
        assert [t["pass"] for t in r["targets"]] == verdicts
