"""--threads on every command line that sets torch's thread count (issue 12).

A value outside [1, os.cpu_count()] is a usage error (exit status 2, the rule named) before
torch sees it: torch.set_num_threads(0) or (-1) raises a RuntimeError (a traceback), and after
set_num_threads(100000) the first parallel op segfaults (libgomp cannot create the threads).
Each case runs the command line in a subprocess, so a crash shows as a crash.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # 15 subprocesses that import torch: about 30 s in all

ROOT = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 1
# code/s07_measuring.py and benchmarks/bench_s07_engines.py have the same rule and message
# (S07 `check_count`); tests/test_s07_measuring.py and tests/test_s07_bench.py pin them.
CLIS = [
    "code/s06_torch.py",
    "benchmarks/bench_s06_torch.py",
    "scripts/train_bundled_model.py",
    "benchmarks/bench_s11_chunked_prefill.py",
    "code/s19_server.py", "benchmarks/bench_s19_server.py",
    "benchmarks/bench_s12_paged_attention.py",
    "benchmarks/bench_s13_prefix_caching.py",
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
