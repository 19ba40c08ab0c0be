"""--threads on every command line that sets torch's thread count (issue 12).

A value outside [1, os.cpu_count()] is a usage error (exit status 2, the rule named) before
torch sees it: torch.set_num_threads(0) or (-1) raises a RuntimeError (a traceback), and after
set_num_threads(100000) the first parallel op segfaults (libgomp cannot create the threads).
Each case runs the command line in a subprocess, so a crash shows as a crash.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # 30 subprocesses that import torch

ROOT = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 1
# code/s07_measuring.py and benchmarks/bench_s07_engines.py have the same rule and message
# (S07 `check_count`); tests/test_s07_measuring.py and tests/test_s07_bench.py pin them.
# The benchmarks are checked in this process below (`COUNTS`, with a tripwire on torch's
# thread count), with the same check function; these are the other command lines.
CLIS = [
    "code/s06_torch.py",
    "scripts/train_bundled_model.py",
    "code/s14_quantization.py",
    "code/s14_kv_cache.py",
    "code/s14_quality.py",
    "code/s19_server.py",
]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("threads", ["0", "-1", "100000", str(CORES + 1)])
@pytest.mark.parametrize("script", CLIS)
def test_threads_outside_one_to_the_cpu_count_is_a_usage_error(script, threads):
    done = run(script, "--threads", threads)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--threads must be an integer in [1, {CORES}] (got {threads})" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("script", CLIS)
def test_threads_that_is_not_an_integer_is_argparses_usage_error(script):
    done = run(script, "--threads", "1.5")
    assert done.returncode == 2
    assert "argument --threads: invalid int value: '1.5'" in done.stderr


# --- The benchmarks' flags (issue 26) ---------------------------------------------------------
# Every benchmark with --threads, --seed and --device checks them with the Part II scripts'
# rules (`s08_cli.check_common_arguments`), and every count flag against a range its --help
# states: 0 is a usage error (it once ran the default quietly), and so is a count past the
# bound (it once ran for minutes with nothing shown). Run in this process: each case must stop
# at argument parsing, before torch's threads are pinned (a tripwire here) or a model is built.
# bench_s07_engines.py has its own checks (tests/test_s07_bench.py); bench_s05_kv_cache.py
# (NumPy, no torch threads, seed or device) has counts only.

COUNTS = {   # benchmark: (one of its count flags, the upper bound it states)
    "bench_s05_kv_cache": ("--prompt-tokens", 8192),
    "bench_s06_torch": ("--bundled-tokens", 224),
    "bench_s08_static_batching": ("--max-tokens", 224),
    "bench_s09_continuous_batching": ("--num-requests", 1000),
    "bench_s10_scheduler": ("--num-requests", 1000),
    "bench_s11_chunked_prefill": ("--running", 64),
    "bench_s12_paged_attention": ("--requests", 1000),
    "bench_s13_prefix_caching": ("--turns", 64),
    "bench_s14_quantization": ("--tokens", 512),
    "bench_s16_host": ("--rounds", 20),
    "bench_s19_server": ("--requests", 4096),
    "bench_s19_split": ("--requests", 4096),
}


def load_benchmark(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def usage_error(name: str, argv: list[str], capsys, monkeypatch) -> str:
    """The benchmark's stderr for argv, which must be a usage error (exit status 2)."""
    bench = load_benchmark(name)
    import torch

    def tripwire(n):
        raise AssertionError(f"{name} {argv}: got past its argument checks")
    monkeypatch.setattr(torch, "set_num_threads", tripwire)
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    return " ".join(err.split())


@pytest.mark.parametrize("name", [name for name in COUNTS if name != "bench_s05_kv_cache"])
def test_benchmark_common_flags_are_usage_errors(name, capsys, monkeypatch):
    for argv, message in (
            (["--threads", "0"], f"--threads must be an integer in [1, {CORES}] (got 0)"),
            (["--threads", str(CORES + 1)],
             f"--threads must be an integer in [1, {CORES}] (got {CORES + 1})"),
            (["--seed", "-1"], "--seed must be an integer >= 0 (got -1)"),
            (["--device", "tpu"], "--device must be 'cpu', 'cuda' or 'cuda:N' (got 'tpu')")):
        assert message in usage_error(name, argv, capsys, monkeypatch), argv


@pytest.mark.parametrize("name", COUNTS)
def test_benchmark_counts_are_bounded_and_the_bound_is_in_its_help(name, capsys, monkeypatch):
    flag, bound = COUNTS[name]
    for value in ("0", "-1", str(bound + 1), "100000"):
        assert (f"{flag} must be an integer in [1, {bound}] (got {value})"
                in usage_error(name, [flag, value], capsys, monkeypatch))
    with pytest.raises(SystemExit) as stop:
        load_benchmark(name).main(["--help"])
    assert stop.value.code == 0
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out)   # one per option
    entry = next(e for e in entries if e.startswith(f"{flag} "))
    assert f"1 to {bound}" in " ".join(entry.split()), entry
