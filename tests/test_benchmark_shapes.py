"""The benchmarks' stand-in shapes agree with what they stand in for."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "data" / "model" / "config.json"


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not CONFIG.exists(), reason="bundled model not trained")
@pytest.mark.parametrize("name", ["bench_s06_torch", "bench_s08_static_batching"])
def test_bench_fallback_shape_is_the_bundled_models(name):
    # bench_s06_torch.py and bench_s08_static_batching.py build a random model of this shape
    # when data/model is missing; it must be the shape the bundled model really has (it once
    # was an older, larger one).
    bench = load_benchmark(name)
    config = json.loads(CONFIG.read_text())
    config["rope_theta"] = config.get("rope_theta", config["rope_parameters"]["rope_theta"])
    assert {key: config[key] for key in bench.BUNDLED_SHAPE} == bench.BUNDLED_SHAPE
    # Their bound on tokens per request is the window less 32 prompt tokens (bench_s08 runs
    # S07's chat prompts, at most 32 tokens; bench_s06 one of 17, or 24 random ids), so no
    # request outgrows the bundled model's window.
    assert bench.MAX_BUNDLED_TOKENS == config["max_position_embeddings"] - 32
