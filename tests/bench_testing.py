"""What the benchmark tests share: a benchmark script imported as a module (benchmarks/ is not
a package), and its usage errors caught before any work starts."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_benchmark(name: str):
    """benchmarks/<name>.py as a module, imported once per process."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def usage_error(bench, argv, capsys, monkeypatch) -> str:
    """The message of the usage error (exit 2) bench.main(argv) raises before it sets torch's
    threads (a tripwire: getting that far fails the test)."""
    import torch

    def tripwire(n):
        raise AssertionError(f"{argv}: got past the argument checks")
    monkeypatch.setattr(torch, "set_num_threads", tripwire)
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2
    return " ".join(capsys.readouterr().err.split())
