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
def test_bench_s06_fallback_shape_is_the_bundled_models():
    # bench_s06_torch.py builds a random model of this shape when data/model is missing; it
    # must be the shape the bundled model really has (it once was an older, larger one).
    shape = load_benchmark("bench_s06_torch").BUNDLED_SHAPE
    config = json.loads(CONFIG.read_text())
    config["rope_theta"] = config.get("rope_theta", config["rope_parameters"]["rope_theta"])
    assert {key: config[key] for key in shape} == shape
