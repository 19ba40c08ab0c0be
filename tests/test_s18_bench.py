"""The S18 benchmark (benchmarks/bench_s18_tensor_parallel.py): its command line, one --quick
run written to a temporary path (never the committed record), the gpu section's rehearsal on
the CPU (gloo at world size 1), and the record's shape and internal consistency, for those
runs and for the committed record (chapters/figures/s18_tensor_parallel.json) when it exists.

Oracles: counts and bytes by hand from each model's config (the bundled checkpoint's
config.json read here, bench_s11's MID_SHAPE): 1 + 2 L all-reduces per decode step, each of
B x C x 4 bytes, the logits gathered as B x V / N x 4 bytes per rank, the weight bytes of the
whole model and of each rank's share counted tensor by tensor from the Qwen3 layout, the KV
pool halved per rank; the all-reduce sums checked in the run (rank r sends r + 1); medians,
ratios and speedups recomputed from the raw samples the record keeps; greedy tokens of TP = 2
and of the world-1 executor against TP = 1's on the bundled model. No speed is asserted.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import pytest
import torch
from bench_testing import import_benchmark, quick_run, usage_error

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "chapters" / "figures" / "s18_tensor_parallel.json"
CONFIGS = ["tp1", "tp1_2threads", "tp2_shm", "tp2_gloo"]
N = 2


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_s18_tensor_parallel")


def hf_shapes(bench) -> dict:
    """Each model's sizes as its HF config says them: the bundled checkpoint's config.json,
    and the mid-size model's MID_SHAPE."""
    bundled = json.loads((bench.s03.BUNDLED_MODEL_DIR / "config.json").read_text())
    return {"bundled": bundled, "mid": dict(bench.MID_SHAPE)}


def weight_count(cfg: dict, n: int) -> int:
    """Parameters one of n ranks holds, by hand from a Qwen3 config (n = 1: the whole model):
    the embedding's vocabulary rows (the tied head the same tensor), q/k/v/o split by heads,
    gate/up/down split by the intermediate size, the norms (two per layer, q and k norms of D,
    the final one) whole on every rank."""
    c, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    h, hkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    layer = (c * h // n * d + 2 * c * hkv // n * d + h // n * d * c + 3 * c * i // n
             + 2 * c + 2 * d)
    tied = cfg.get("tie_word_embeddings", False)
    return v // n * c * (1 if tied else 2) + cfg["num_hidden_layers"] * layer + c


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be an integer in [1, 64] (got 0)"),
    (["--rounds", "11"], "--rounds must be an integer in [1, 10] (got 11)"),
    (["--calls", "0"], "--calls must be an integer in [1, 1000] (got 0)"),
    (["--batches", "0,8"], "--batches takes distinct comma-separated integers in [1, 64] "
                           "(got '0,8')"),
    (["--batches", "8,8"], "--batches takes distinct comma-separated integers in [1, 64]"),
    (["--sections", "speed"], "--sections takes comma-separated names from allreduce,tp,gpu "
                              "(got 'speed')"),
    (["--budget-s", "0"], "--budget-s must be a number of seconds > 0 (got 0.0)"),
    (["--record", "--json", "x.json"], "give --json or --record, not both"),
    (["--record", "--quick"], "--record takes a full run, not --quick"),
    (["--record", "--sections", "tp"], "--record takes every CPU section (allreduce,tp)"),
    (["--sections", "gpu", "--rounds", "10", "--steps", "64"],
     "the gpu section's prompts (64) + --rounds x --steps + 4 must fit the bundled model's "
     "256 tokens (got 708)"),
    (["--seed", "-1"], "--seed must be an integer >= 0 (got -1)"),
    (["--device", "tpu"], "--device must be 'cpu', 'cuda' or 'cuda:N' (got 'tpu')"),
])
def test_bad_flags_are_usage_errors(bench, argv, message, capsys, monkeypatch):
    assert message in usage_error(bench, argv, capsys, monkeypatch)


def test_json_must_be_a_writable_file(bench, tmp_path, capsys, monkeypatch):
    assert "--json" in usage_error(bench, ["--json", str(tmp_path)], capsys, monkeypatch)


def test_two_ranks_need_two_cores(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench.s18, "usable_cores", lambda: 1)
    message = usage_error(bench, ["--sections", "allreduce"], capsys, monkeypatch)
    assert "they need 2 cores, and this process may use 1" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_a_usage_error(bench, capsys, monkeypatch):
    assert "needs a CUDA device" in usage_error(bench, ["--device", "cuda"], capsys, monkeypatch)


def test_the_allreduce_schedule_alternates_and_both_ranks_share_it(bench):
    """Each round every size, both communicators, the order swapped every round; fewer timed
    calls for large messages, never fewer than 2."""
    schedule = bench.allreduce_schedule((512, 1 << 20, 1 << 24), ("gloo", "shm"), 2, 64)
    assert [(r, b, c) for r, b, c, _ in schedule] == [
        (0, 512, "gloo"), (0, 512, "shm"), (0, 1 << 20, "gloo"), (0, 1 << 20, "shm"),
        (0, 1 << 24, "gloo"), (0, 1 << 24, "shm"), (1, 512, "shm"), (1, 512, "gloo"),
        (1, 1 << 20, "shm"), (1, 1 << 20, "gloo"), (1, 1 << 24, "shm"), (1, 1 << 24, "gloo")]
    assert {b: n for _, b, _, n in schedule} == {512: 64, 1 << 20: 16, 1 << 24: 4}
    assert bench.calls_at(1 << 24, 8) == 2


def test_the_budget_cuts_a_part_that_would_not_fit(bench):
    budget = bench.Budget(10.0, time.perf_counter())
    assert budget.allows("a") and budget.cut == []
    budget.took(6.0)                    # twice 6 s no longer fits in what is left of 10 s
    assert not budget.allows("b") and budget.cut[0].startswith("b: ")
    assert bench.Budget(None, 0.0).allows("c")


# --- one --quick run into a temporary file ----------------------------------------------------

@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    if bench.s18.usable_cores() < 2:
        pytest.skip("two ranks of one thread need two cores")
    out = tmp_path_factory.mktemp("s18_bench") / "quick.json"
    return (*quick_run(bench, out, RECORD), bench)


def test_quick_run_prints_every_section(quick):
    figures, returned, text, bench = quick
    assert text.count(bench.QUICK_DISCLAIMER) == 2
    for needle in ("1. allreduce", "2. tp", "the crossover", "one decode step on 2 ranks",
                   "before:", "after:", "load average", "torch ", "summary"):
        assert needle in text, needle
    assert "NOT as expected" not in text and "(as expected)" not in text   # no verdicts
    assert figures == json.loads(json.dumps(returned))
    config = figures["config"]
    assert config["quick"] is True and config["threads"] == 1 and config["batches"] == [1, 4]
    assert config["sections"] == ["allreduce", "tp"] and "gpu" not in figures
    assert list(figures["tp"]["models"]) == ["bundled"]          # the bundled model only
    assert figures["allreduce"]["bytes"] == [512, 2048, 65536, 1 << 20]


def test_quick_record_is_consistent(quick):
    check_record(quick[0], hf_shapes(quick[3]))


def test_tp2_on_the_bundled_model_gives_tp1s_tokens(quick):
    """Greedy on the trained model: reduction order changes the last bits, not a top-1 here."""
    for p in quick[0]["tp"]["models"]["bundled"]["points"]:
        assert p["tokens_equal"], p["same_tokens"]


# --- the gpu section, rehearsed on the CPU ----------------------------------------------------

@pytest.fixture(scope="module")
def rehearsal(bench, tmp_path_factory):
    """--sections gpu on the CPU: the section's code on gloo at world size 1 (no process is
    spawned, so one core will do)."""
    out = tmp_path_factory.mktemp("s18_gpu") / "gpu.json"
    return quick_run(bench, out, RECORD, "--sections", "gpu")[0]


def test_the_gpu_sections_rehearsal_runs_the_world1_executor(rehearsal, bench):
    gpu = rehearsal["gpu"]
    assert gpu["rehearsal"] is True and gpu["backend"] == "gloo" and gpu["world_size"] == 1
    assert "cannot show scaling" in gpu["note"] and rehearsal["cut"] == []
    full = 4 * weight_count(hf_shapes(bench)["bundled"], 1)
    assert gpu["executor_weight_bytes"] == gpu["model_weight_bytes"] == full
    assert [r["batch"] for r in gpu["smoke"]] == [1, 4]
    config = rehearsal["config"]
    for r in gpu["smoke"]:
        assert r["tokens_equal"] and r["same_tokens"] == r["batch"]
        assert r["tokens_each"] == 1 + config["warmup"] + config["rounds"] * config["steps"]
        for name in ("tp1", "world1"):
            assert len(r["samples_ms"][name]) == config["rounds"] * config["steps"]
            assert close(r["median_ms"][name], statistics.median(r["samples_ms"][name]))
        assert close(r["world1_over_tp1"], r["median_ms"]["world1"] / r["median_ms"]["tp1"])
    assert [r["bytes"] for r in gpu["allreduce"]] == list(bench.QUICK_ALLREDUCE_BYTES)
    for r in gpu["allreduce"]:
        assert close(r["median_us"], statistics.median(r["samples_us"]))
    assert rehearsal["key"]["world1_B1_tokens_equal"] is True


# --- the committed record ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def record():
    if not RECORD.exists():
        pytest.skip("no committed record yet")
    return json.loads(RECORD.read_text())


def test_the_record_is_a_full_run_on_one_thread(record):
    config = record["config"]
    assert config["quick"] is False and config["threads"] == 1 and config["device"] == "cpu"
    assert config["sections"] == ["allreduce", "tp"]
    assert config["batches"] == [1, 32] and config["rounds"] >= 3
    assert record["allreduce"]["bytes"] == [512 * 2 ** k for k in range(16)]
    assert list(record["tp"]["models"]) == ["bundled", "mid"]
    assert record["elapsed_s"] <= 10 * 60


def test_the_record_is_consistent(record, bench):
    check_record(record, hf_shapes(bench))


# --- the checks -------------------------------------------------------------------------------

def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def check_allreduce(a: dict, shapes: dict, config: dict) -> None:
    comms = a["comms"]
    assert comms == ["gloo", "shm"] or (comms == ["gloo"] and "shm" in a["skipped"])
    assert [(r["bytes"], r["comm"]) for r in a["rows"]] == [(b, c) for b in a["bytes"]
                                                            for c in comms]
    for r in a["rows"]:
        assert r["correct"] is True, r                      # every element summed to 3
        assert len(r["samples_us"]) == config["rounds"] * a["calls"][str(r["bytes"])]
        assert close(r["median_us"], statistics.median(r["samples_us"]))
        assert r["min_us"] == min(r["samples_us"]) > 0
        assert close(r["bytes_per_s"], r["bytes"] / (r["median_us"] / 1e6))
    med = {(r["comm"], r["bytes"]): r["median_us"] for r in a["rows"]}
    if "shm" in comms:
        assert [x["bytes"] for x in a["ratios"]] == a["bytes"]
        for x in a["ratios"]:
            assert close(x["gloo_over_shm"], med[("gloo", x["bytes"])] / med[("shm", x["bytes"])])
    assert [(p["model"], p["batch"]) for p in a["plan"]] == [
        (m, b) for m in ("bundled", "mid") for b in (1, 32)]
    for p in a["plan"]:
        cfg = shapes[p["model"]]
        layers, c, v, b = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"],
                           p["batch"])
        # by hand: the embedding's all-reduce, then one after attention and one after the MLP
        # in each layer; each carries the step's T = B hidden states in float32
        assert p["all_reduce_per_step"] == 1 + 2 * layers
        assert p["bytes_each"] == b * c * 4
        assert p["bytes_per_step"] == (1 + 2 * layers) * b * c * 4
        assert p["gather_bytes_per_rank"] == b * v // N * 4
        assert p["gather_bytes_per_step"] == b * v * 4
        for comm, ms in p["all_reduce_ms_per_step"].items():
            if b * c * 4 in a["bytes"]:
                assert close(ms, (1 + 2 * layers) * med[(comm, b * c * 4)] / 1e3)
            else:
                assert ms is None
    assert a["spawn_s"] > 0


def check_tp(t: dict, shapes: dict, config: dict) -> None:
    rounds, steps, warmup = config["rounds"], config["steps"], config["warmup"]
    assert t["configs"] == CONFIGS and t["baseline_alone"] is True
    assert t["threads_per_rank"] == 1
    rows = {(r["model"], r["batch"]): r for r in t["crossover"]}
    assert list(rows) == [(m, p["batch"]) for m, part in t["models"].items()
                          for p in part["points"]]
    for key, part in t["models"].items():
        cfg = shapes[key]
        layers, c = cfg["num_hidden_layers"], cfg["hidden_size"]
        w = part["weight_bytes"]
        assert w["full"] == 4 * weight_count(cfg, 1)
        assert w["shard_bytes"] == [4 * weight_count(cfg, N)] * N
        assert w["executor_rank0"] == w["shard_bytes"][0]
        assert close(w["rank0_over_full"], w["shard_bytes"][0] / w["full"])
        assert 0.5 < w["rank0_over_full"] < 0.51     # halved, less the replicated norms
        assert part["custom_all_reduce"] in ({"tp2_shm": True, "tp2_gloo": False},
                                             {"tp2_shm": False, "tp2_gloo": False})
        assert len(part["executor_start_s"]) == 2 * rounds   # one per TP=2 config per round
        assert [p["batch"] for p in part["points"]] == config["batches"]
        for p in part["points"]:
            b = p["batch"]
            assert list(p["samples"]) == CONFIGS
            for name, s in p["samples"].items():
                assert len(s["step_ms"]) == len(s["model_ms"]) == rounds * steps
                assert all(0 < m <= w for m, w in zip(s["model_ms"], s["step_ms"]))
                for k in ("step_ms", "model_ms"):
                    assert close(p["median"][name][k], statistics.median(s[k]))
            for base in ("tp1", "tp1_2threads"):
                for tp in ("tp2_shm", "tp2_gloo"):
                    assert close(p["speedup"][f"{base}_over_{tp}"],
                                 p["median"][base]["step_ms"] / p["median"][tp]["step_ms"])
            # rank 0's communicator over each timed TP=2 step: 1 + 2 L all-reduces of B C 4
            assert p["all_reduce_per_step"] == [1 + 2 * layers]
            assert p["all_reduce_bytes_per_step"] == [(1 + 2 * layers) * b * c * 4]
            pools = p["pool_bytes"]
            assert pools["tp1"] == pools["tp1_2threads"] > 0
            # Hkv / N key/value heads per rank (both models' Hkv divide by 2): half the pool
            assert pools["tp2_shm"] * N == pools["tp2_gloo"] * N == pools["tp1"]
            assert p["tokens_each"] == 1 + warmup + steps        # the prefill's token too
            assert p["requests_compared"] == rounds * b
            assert all(0 <= n <= rounds * b for n in p["same_tokens"].values())
            assert p["same_tokens"]["tp1"] == rounds * b         # every round decodes the same
            assert p["tokens_equal"] == all(n == rounds * b for n in p["same_tokens"].values())
            r = rows[(key, b)]
            for name in CONFIGS:
                assert r[f"{name}_ms"] == p["median"][name]["step_ms"]
            assert r["speedup_shm"] == p["speedup"]["tp1_over_tp2_shm"]
            assert r["speedup_gloo"] == p["speedup"]["tp1_over_tp2_gloo"]
            assert r["speedup_shm_vs_2threads"] == p["speedup"]["tp1_2threads_over_tp2_shm"]
            if config["quick"]:
                assert r["as_expected"] is None
            else:
                assert r["as_expected"] == ((r["speedup_shm"] > 1) == r["expected_faster"])


def check_record(r: dict, shapes: dict) -> None:
    config = r["config"]
    for when in ("start", "end"):
        assert len(r["load_average"][when]) == 3 and min(r["load_average"][when]) >= 0
    assert "load average" in r["uptime_before"] and "load average" in r["uptime_after"]
    assert config["torch"] and config["machine"] and config["threads"] == 1
    assert any("two cores" in note for note in r["notes"])
    for name in config["sections"]:
        assert name in r and r["section_s"][name] > 0
        assert len(r[name]["load_average_1min"]) == 2
    if "allreduce" in r:
        check_allreduce(r["allreduce"], shapes, config)
        for row in r["allreduce"]["rows"]:
            if row["bytes"] == 512:
                assert r["key"][f"allreduce_{row['comm']}_512B_us"] == row["median_us"]
    if "tp" in r:
        check_tp(r["tp"], shapes, config)
        for row in r["tp"]["crossover"]:
            name = f"{row['model']}_B{row['batch']}_tp1_over_tp2_shm"
            assert r["key"][name] == row["speedup_shm"]
