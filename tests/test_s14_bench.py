"""The S14 benchmark (benchmarks/bench_s14_quantization.py): its command line, a reduced --quick
smoke run of every section, and the committed record (chapters/figures/s14_quantization.json)
agreeing with itself and with figures worked out here by hand.

Oracles: the stated rules of each flag; the storage formats' bits per weight written out from
their definitions (int8: 8 bits + a float32 scale per row; int4: 4 bits + a bfloat16 scale per
group, + an 8-bit zero point when asymmetric; llama.cpp's Q8_0 block 34 bytes / 32 weights,
Q4_0 18 / 32); KV bytes per token as 2 L Hkv D x bytes (+ 4-byte scales per token and head);
the parameter count of the e2e shape counted tensor by tensor; medians and ratios recomputed
from the raw times the record keeps. No measured speed is asserted.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from bench_testing import import_benchmark, usage_error

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "chapters" / "figures" / "s14_quantization.json"
BUNDLED = ROOT / "data" / "model" / "config.json"


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_s14_quantization")


# --- the command line -------------------------------------------------------------------------

BOUNDS = {"--chunks": 246, "--gemv-repeats": 1000, "--tokens": 512, "--repeats": 20,
          "--batch": 64, "--batch-steps": 256, "--kv-budget-mib": 1 << 20}


@pytest.mark.parametrize("flag", BOUNDS)
def test_every_count_is_bounded_and_its_bound_is_in_the_help(bench, flag, capsys, monkeypatch):
    bound = BOUNDS[flag]
    for value in ("0", "-1", str(bound + 1)):
        err = usage_error(bench, [flag, value], capsys, monkeypatch)
        assert f"{flag} must be an integer in [1, {bound}] (got {value})" in err
    with pytest.raises(SystemExit) as stop:
        bench.main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"1 to {bound}" in text.split(flag + " ")[-1].split(" --")[0]


def test_the_validation_split_has_246_chunks_of_the_window(bench):
    import s14_quality
    window = json.loads(BUNDLED.read_text())["max_position_embeddings"]
    assert bench.MAX_CHUNKS == s14_quality.validation_token_ids().size // window == 246


@pytest.mark.parametrize("argv, message", [
    (["--sections", "speed"], "--sections takes comma-separated names from "
                              "quality,kernels,e2e,batch,kv (got 'speed')"),
    (["--sections", ","], "--sections takes comma-separated names"),
    (["--out", "--json", "x.json"], "give --json or --out, not both"),
    (["--threads", "0"], "--threads must be an integer in [1, "),
    (["--seed", "-1"], "--seed must be an integer >= 0 (got -1)"),
    (["--device", "tpu"], "--device must be 'cpu', 'cuda' or 'cuda:N' (got 'tpu')"),
])
def test_bad_flags_are_usage_errors(bench, argv, message, capsys, monkeypatch):
    assert message in usage_error(bench, argv, capsys, monkeypatch)


def test_json_must_be_a_writable_file(bench, tmp_path, capsys, monkeypatch):
    assert "--json" in usage_error(bench, ["--json", str(tmp_path)], capsys, monkeypatch)


def test_sections_run_in_a_fixed_order(bench):
    assert bench.section_list("kv,quality") == ["quality", "kv"]


def test_kv_section_alone_writes_only_where_asked(bench, tmp_path, monkeypatch):
    """Budget 1 MiB, the bundled model (L 6, Hkv 2, D 32): float32 2*6*2*32*4 = 3,072 bytes a
    token, 1,048,576 // (3,072 * 16) = 21 blocks, less the null block: 320 tokens; int8
    2*6*2*(32 + 4) = 864 bytes, 75 blocks, 1,184 tokens. Llama-3.1-8B (L 32, Hkv 8, D 128):
    bf16 131,072 bytes, 1 MiB holds no 2 blocks: 0 tokens."""
    monkeypatch.chdir(tmp_path)
    written = []
    real_write = bench.write_json
    monkeypatch.setattr(bench, "write_json",
                        lambda path, figures, indent=2: (written.append(Path(path)),
                                                         real_write(path, figures, indent)))
    figures = bench.main(["--sections", "kv", "--kv-budget-mib", "1"])
    assert written == [] and list(tmp_path.iterdir()) == []   # no --json, no --out: no file
    rows = {r["model"]: r for r in figures["kv"]["rows"]}
    small = rows["bundled model"]
    assert small["bytes_per_token"]["float32"] == 3072 and small["tokens"]["float32"] == 320
    assert small["bytes_per_token"]["int8"] == 864 and small["tokens"]["int8"] == 1184
    assert small["bytes_per_token"]["fp8_e4m3"] == 768
    assert rows["Llama-3.1-8B"]["bytes_per_token"]["bfloat16"] == 131072
    assert rows["Llama-3.1-8B"]["tokens"]["bfloat16"] == 0
    out = tmp_path / "mine.json"
    bench.main(["--sections", "kv", "--kv-budget-mib", "1", "--json", str(out)])
    assert written == [out]
    assert json.loads(out.read_text())["kv"]["rows"][0]["tokens"]["float32"] == 320


@pytest.mark.slow
def test_a_reduced_quick_run_of_every_section(bench, tmp_path, capsys):
    """--quick with the smallest counts: every section runs and prints its targets."""
    out = tmp_path / "quick.json"
    bench.main(["--quick", "--chunks", "2", "--gemv-repeats", "1", "--tokens", "2",
                "--batch", "2", "--batch-steps", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert text.count(bench.QUICK_DISCLAIMER) == 2
    for needle in ("1. quality", "2. kernels", "3. e2e", "4. batch", "5. kv", "targets",
                   "THEIRS, not measured here", "HF generate fp32", "load average"):
        assert needle in text, needle
    figures = json.loads(out.read_text())
    assert figures["config"]["quick"] is True
    assert set(figures) >= {"quality", "kernels", "e2e", "batch", "kv", "machine"}
    assert figures["quality"]["num_tokens"] == 2 * 127


# --- the committed record ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def record():
    if not RECORD.exists():
        pytest.skip("no committed record yet")
    return json.loads(RECORD.read_text())


def test_the_record_is_a_full_run_on_one_thread(record):
    config = record["config"]
    assert config["quick"] is False and config["threads"] == 1
    assert config["sections"] == ["quality", "kernels", "e2e", "batch", "kv"]
    assert config["chunks"] == 246 and config["repeats"] >= 3
    assert "load average" in record["uptime_before"] and "load average" in record["uptime_after"]


# bits per weight of the bundled model's linear layers, from the formats' definitions. The
# weights (N, K) of one block: qkv (256, 128), o (128, 128), gate_up (768, 128), down (128, 384).
WEIGHTS = [(256, 128), (128, 128), (768, 128), (128, 384)]
NK = sum(n * k for n, k in WEIGHTS)
ROWS = sum(n for n, _ in WEIGHTS)
BITS = {"int8": 8 + 32 * ROWS / NK, "int4 g32 sym": 4 + 16 / 32, "int4 g32 asym": 4 + 24 / 32,
        "int4 g128 sym": 4 + 16 / 128, "q8_0": 34 * 8 / 32, "q4_0": 18 * 8 / 32}


def test_quality_rows_agree_with_themselves_and_the_formats(record):
    qual = record["quality"]
    assert qual["num_tokens"] == 246 * 127 == qual["weights"][0]["report"]["num_tokens"]
    assert qual["fp32"]["linear_bits_per_weight"] == 32
    for row in qual["weights"]:
        rep = row["report"]
        assert rep["ref_ppl"] == qual["ref_ppl"]
        assert math.isclose(rep["delta_ppl"], rep["ppl"] - rep["ref_ppl"], rel_tol=1e-9)
        assert math.isclose(rep["delta_ppl_pct"], 100 * (rep["ppl"] / rep["ref_ppl"] - 1),
                            rel_tol=1e-6, abs_tol=1e-9)
        assert 0 <= rep["same_top1"] <= 1 and rep["mean_kld"] >= 0
        base = row["label"].split(" +")[0].split(",")[0]
        base = {"int4 g32": "int4 g32 sym"}.get(base, base)
        assert math.isclose(row["linear_bits_per_weight"], BITS[base], rel_tol=1e-12), row
    by = {r["label"]: r["report"] for r in qual["weights"]}
    expected = {"int8 dPPL % < 0.1": abs(by["int8"]["delta_ppl_pct"]) < 0.1,
                "q4_0 dPPL % < 1": by["q4_0"]["delta_ppl_pct"] < 1,
                "int4 g32 dPPL % < 1": by["int4 g32 sym"]["delta_ppl_pct"] < 1,
                "q4_0 same top-1 >= 90 %": by["q4_0"]["same_top1"] >= 0.9,
                "int4 g32 same top-1 >= 90 %": by["int4 g32 sym"]["same_top1"] >= 0.9}
    assert qual["targets"] == expected
    ratio = by["int4 g32 +emb/head"]["mean_kld"] / by["int4 g32 sym"]["mean_kld"]
    assert math.isclose(qual["embedding_kld_ratio"]["int4 g32"], ratio)
    for row in qual["kv"]:    # 2 L Hkv D codes (+ a float32 scale per token and kv head)
        per_row = {"fp8_e4m3": 32, "fp8_per_token_head": 36, "int8": 36}[row["kv_cache_dtype"]]
        assert row["bytes_per_token"] == 2 * 6 * 2 * per_row


def test_the_llama_cpp_anchor_is_their_table(record):
    rows = {r["quantization"]: r for r in record["quality"]["llama_cpp_anchor"]["rows"]}
    # the rounded figures: Q8_0 +0.0026, Q4_0 +0.47, Q4_K_M +0.18
    assert abs(rows["q8_0"]["delta_ppl"] - 0.0026) <= 0.0001
    assert abs(rows["q4_0"]["delta_ppl"] - 0.47) <= 0.005
    assert abs(rows["q4_K_M"]["delta_ppl"] - 0.18) <= 0.005
    assert "tools/perplexity/README.md" in record["quality"]["llama_cpp_anchor"]["source"]


def test_kernel_ratios_are_the_stored_medians(record):
    for shape in record["kernels"]["shapes"]:
        t = shape["median_s"]
        for name, s in t.items():
            assert math.isclose(shape["speedup_vs_fp32"][name], t["fp32"] / s)
        assert shape["weight_bytes"]["fp32"] == 4 * shape["n"] * shape["k"]
    for check in record["kernels"]["targets"]:
        bound = {"int8 fused": 2.0, "int4 fused": 3.0}.get(check["variant"])
        assert check["pass"] == (check["speedup"] >= bound if bound else check["speedup"] < 1)


def test_e2e_figures_follow_from_the_stored_runs(record):
    shape = record["e2e_model"]["shape"]
    c, i, v, layers = (shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"],
                       shape["num_hidden_layers"])
    q_out, kv_out = shape["num_attention_heads"] * shape["head_dim"], \
        shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = c * (q_out + 2 * kv_out) + q_out * c + 3 * c * i + 2 * c + 2 * shape["head_dim"]
    assert record["e2e_model"]["parameters"] == v * c + layers * per_layer + c   # tied head
    assert 100e6 <= record["e2e_model"]["parameters"] < 110e6
    tokens = record["config"]["tokens"]
    for part in (record["e2e"], record["e2e"]["bundled"]):
        rows = part["rows"]
        for label, row in rows.items():
            assert len(row["wall_s"]) == record["config"]["repeats"]
            assert math.isclose(row["tokens_per_s"], tokens / statistics.median(row["wall_s"]))
            assert math.isclose(row["speedup_vs_fp32"],
                                row["tokens_per_s"] / rows["fp32"]["tokens_per_s"])
            if "decode_ms" in row:
                assert math.isclose(row["achieved_bytes_per_s"],
                                    row["bytes_per_token"] / row["decode_ms"] * 1e3)
                assert math.isclose(row["floor_ms"], row["bytes_per_token"] / record[
                    "machine"]["bandwidth_bytes_per_s"] * 1e3)
        assert "HF generate fp32" in rows
    rows = record["e2e"]["rows"]
    # fewer bytes per token in every quantized variant, fewest with the head quantized too
    order = ["fp32", "int8", "int4", "int8 +emb/head", "int4 +emb/head"]
    moved = [rows[k]["bytes_per_token"] for k in order]
    assert moved[0] > moved[1] > moved[2] and moved[1] > moved[3] > moved[4]
    for check in record["e2e"]["targets"]:
        assert check["pass"] == (rows[check["variant"]]["speedup_vs_fp32"] >= check["target"])


def test_batch_rows_are_medians_of_their_steps(record):
    batch = record["batch"]
    sizes = {r["batch"] for r in batch["rows"]}
    assert sizes == {1, record["config"]["batch"]}
    for row in batch["rows"]:
        assert len(row["step_ms_all"]) == batch["decode_steps"]
        assert math.isclose(row["step_ms"], statistics.median(row["step_ms_all"]))
        assert math.isclose(row["tokens_per_s"], row["batch"] / row["step_ms"] * 1e3)
        fp32 = next(r for r in batch["rows"] if r["variant"] == "fp32"
                    and r["batch"] == row["batch"])
        assert math.isclose(row["speedup_vs_fp32"], fp32["step_ms"] / row["step_ms"])


def test_kv_capacity_is_the_closed_form(record):
    budget = record["kv"]["budget_mib"] * 2**20
    for row in record["kv"]["rows"]:
        for dtype, bpt in row["bytes_per_token"].items():
            assert row["tokens"][dtype] == max(budget // (bpt * 16) - 1, 0) * 16
    llama = next(r for r in record["kv"]["rows"] if r["model"] == "Llama-3.1-8B")
    assert llama["bytes_per_token"] == {"float32": 262144, "bfloat16": 131072,
                                        "fp8_e4m3": 65536, "fp8_per_token_head": 67584,
                                        "int8": 67584}
