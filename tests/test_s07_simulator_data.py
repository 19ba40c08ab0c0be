"""The S07 "Try it" calculator's data: the course's configs, the recorded roofs, the right answers.

site/simulators/roofline-calculator/export.py exports model configs, machine roofs and Python
results for a grid of settings; the page recomputes them (tests/test_s07_simulator_browser.py).
Oracles here, none of them the exporter: the batched step's FLOPs and bytes of Qwen3-0.6B worked
out by hand from its published config (the derivation is in tests/exercises/
test_ex_s07_measuring.py), S03's `flops_per_token` / `bytes_per_token` at batch 1, the configs
and roofs as results/s07_engines*.json recorded them, a linear search for the first
compute-bound batch, and the chapter's figures (60.9 ms at B = 1, the ridge crossed from B = 15
on the course's CPU, 304 and never on the H100 in bfloat16).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import s03_checkpoint as ckpt
import s03_transformer as s03
import s07_roofline as roof

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ROOT / "site" / "simulators" / "roofline-calculator" / "export.py"
RUN1 = json.loads((ROOT / "results" / "s07_engines.json").read_text())
RUN2 = json.loads((ROOT / "results" / "s07_engines_run2.json").read_text())

QWEN_FLOPS = lambda s: 1_191_968_768 + 229_376 * s          # noqa: E731  one token at context s
QWEN_SHARED_VALUES = 596_049_920                            # read once per step
QWEN_PER_REQUEST_VALUES = lambda s: 1_024 + 57_344 * s      # noqa: E731  embedding row + K/V


def hand_qwen(batch: int, s: int, dtype_bytes: int) -> tuple[int, int]:
    values = QWEN_SHARED_VALUES + batch * QWEN_PER_REQUEST_VALUES(s)
    return batch * QWEN_FLOPS(s), values * dtype_bytes


@pytest.fixture(scope="module")
def exporter():
    spec = importlib.util.spec_from_file_location("s07_sim_export_under_test", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


def by_id(items: list[dict]) -> dict:
    return {item["id"]: item for item in items}


def test_batched_decode_cost_by_hand_and_at_batch_1():
    qwen = ckpt.config_from_hf_dict(
        {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
         "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
         "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000})
    for batch, s, b in ((1, 1, 2), (64, 1024, 4), (8, 300, 2), (1024, 512, 4), (3, 17, 4)):
        cost = roof.batched_decode_cost(qwen, batch, s, b)
        assert (cost.flops, cost.bytes) == hand_qwen(batch, s, b), (batch, s, b)
    gpt2 = s03.TransformerConfig(model_type="gpt2", vocab_size=50, hidden_size=8,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=4, intermediate_size=32,
                                 max_position_embeddings=16, norm_eps=1e-5,
                                 tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    for cfg in (qwen, ckpt.load_config(s03.BUNDLED_MODEL_DIR), gpt2):
        for s in (1, 9, 16):
            for b in (2, 4):
                assert roof.batched_decode_cost(cfg, 1, s, b) == roof.StepCost(
                    s03.flops_per_token(cfg, s), s03.bytes_per_token(cfg, s, b))
    # GPT-2 adds one position-embedding row per request as well as the token's row and K/V.
    one, two = (roof.batched_decode_cost(gpt2, n, 5, 4) for n in (1, 2))
    assert two.bytes - one.bytes == (8 + 8 + 2 * 2 * 2 * 4 * 5) * 4
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="batch_size"):
            roof.batched_decode_cost(qwen, bad, 4)


def test_configs_come_from_the_course_and_match_the_recorded_run(data):
    configs = by_id(data["configs"])
    assert list(configs) == ["bundled", "qwen3-0.6b", "llama-3-8b"]
    bundled = ckpt.load_config(s03.BUNDLED_MODEL_DIR)
    f = configs["bundled"]["fields"]
    assert (f["C"], f["I"], f["L"], f["H"], f["Hkv"], f["D"], f["V"], f["max_context"]) == (
        bundled.hidden_size, bundled.intermediate_size, bundled.num_hidden_layers,
        bundled.num_attention_heads, bundled.num_key_value_heads, bundled.head_dim,
        bundled.vocab_size, bundled.max_position_embeddings)
    assert configs["bundled"]["parameters"] == RUN1["models"]["bundled"]["parameters"]
    recorded = RUN1["models"]["qwen3-0.6b"]["config"]           # the shape the run measured
    f = configs["qwen3-0.6b"]["fields"]
    assert (f["C"], f["I"], f["L"], f["H"], f["Hkv"], f["D"], f["V"], f["tied"], f["qk_norm"]) == (
        recorded["hidden_size"], recorded["intermediate_size"], recorded["num_hidden_layers"],
        recorded["num_attention_heads"], recorded["num_key_value_heads"], recorded["head_dim"],
        recorded["vocab_size"], recorded["tie_word_embeddings"], recorded["qk_norm"])
    assert configs["qwen3-0.6b"]["parameters"] == RUN1["models"]["qwen3-0.6b"]["parameters"]
    # Meta-Llama-3-8B: 8.03 billion parameters, untied head, no q/k norms.
    f = configs["llama-3-8b"]["fields"]
    assert configs["llama-3-8b"]["parameters"] == 8_030_261_248
    assert (f["tied"], f["qk_norm"], f["D"], f["max_context"]) == (False, False, 128, 8192)


def test_cpu_roofs_are_the_recorded_ones_with_their_command_and_load(data):
    machines = by_id(data["machines"])
    for mid, run, roofs in (
            ("cpu-run1", RUN1, RUN1["roofline"]),
            ("cpu-run1-after", RUN1, RUN1["roofline_measurements"]["after, 2 thread(s)"]),
            ("cpu-run2", RUN2, RUN2["roofline"])):
        m = machines[mid]
        assert m["bandwidth"] == roofs["bandwidth_bytes_per_s"]
        assert m["flops"] == {"float32": roofs["matmul_flops_per_s"]}   # no bfloat16 roof recorded
        assert run["command"].strip() in m["source"] and run["created_utc"] in m["source"]
        assert f"load average {run['machine']['load_average_1min']:.2f} at the start, " \
               f"{run['load_average_1min_after']:.2f} at the end" in m["source"]
    h100 = machines["h100-sxm"]
    assert "datasheet" in h100["source"] and "sparsity" in h100["source"]
    assert round(h100["flops"]["bfloat16"] / h100["bandwidth"]) == 295    # the chapter's ridge


def test_chapter_figures_from_the_exported_roofs(data, exporter):
    configs = {c["id"]: c["config"] for c in exporter.configs()}
    machines = by_id(data["machines"])
    qwen = configs["qwen3-0.6b"]
    cpu = exporter.peaks(machines["cpu-run1"], "float32")
    bw, peak = RUN1["roofline"]["bandwidth_bytes_per_s"], RUN1["roofline"]["matmul_flops_per_s"]
    for batch, floor_ms, tokens in ((1, 60.9, 16.4), (8, 80.9, 98.9), (64, 443.1, 144.4)):
        step = exporter.step(qwen, batch, 512, "float32", cpu)
        flops, moved = hand_qwen(batch, 512, 4)
        assert step["floor_s"] == pytest.approx(max(moved / bw, flops / peak), rel=1e-12)
        assert (f"{step['floor_s'] * 1e3:.1f}", f"{step['tokens_per_s']:.1f}") == (
            f"{floor_ms}", f"{tokens}")
    assert exporter.compute_bound_batch(qwen, 512, 4, cpu) == 15
    h100 = exporter.peaks(machines["h100-sxm"], "bfloat16")
    assert exporter.compute_bound_batch(qwen, 1, 2, h100) == 304
    assert exporter.compute_bound_batch(qwen, 512, 2, h100) is None
    assert f"{exporter.limit_intensity(qwen, 512, 2):.1f}" == "22.3"


def test_ridge_batch_is_the_first_compute_bound_batch(data, exporter):
    """Against a linear search with the hand counts, for every Qwen3-0.6B setting of the grid."""
    machines = by_id(data["machines"])
    found = 0
    for ref in data["reference"]:
        if ref["config"] != "qwen3-0.6b":
            continue
        m, b, s = machines[ref["machine"]], data["dtypes"][ref["dtype"]], ref["context"]
        bw, peak = m["bandwidth"], m["flops"][ref["dtype"]]

        def compute_bound(batch: int) -> bool:
            flops, moved = hand_qwen(batch, s, b)
            return flops / peak >= moved / bw
        first = next((n for n in range(1, data["max_batch"] + 1) if compute_bound(n)), None)
        assert ref["ridge_batch"] == first, (ref["machine"], ref["dtype"], s)
        limit = QWEN_FLOPS(s) / (QWEN_PER_REQUEST_VALUES(s) * b)
        assert ref["limit_intensity"] == pytest.approx(limit, rel=1e-12)
        found += first is not None
        for step in ref["steps"]:
            flops, moved = hand_qwen(step["batch"], s, b)
            assert (step["flops"], step["bytes"]) == (flops, moved)
            assert step["floor_s"] == pytest.approx(max(moved / bw, flops / peak), rel=1e-12)
            assert step["bound"] == ("compute" if flops / peak >= moved / bw else "bandwidth")
    assert found >= 5      # the grid has settings on both sides of the ridge


def test_grid_covers_every_config_machine_and_dtype_and_is_exact_in_javascript(data):
    seen = {(r["config"], r["machine"], r["dtype"]) for r in data["reference"]}
    for c in data["configs"]:
        for m in data["machines"]:
            for dtype in m["flops"]:
                assert (c["id"], m["id"], dtype) in seen
    json.dumps(data, allow_nan=False)
    for c in data["configs"]:
        f = c["fields"]
        per_token = (2 * (f["L"] * (2 * f["C"] * f["H"] * f["D"] + 2 * f["C"] * f["Hkv"] * f["D"]
                                    + 3 * f["C"] * f["I"]) + f["V"] * f["C"])
                     + 4 * f["L"] * f["H"] * f["D"] * f["max_context"])
        assert data["max_batch"] * per_token < 2 ** 53, c["id"]
