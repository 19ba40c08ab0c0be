"""Shared test set-up: chapter modules live in code/ and import each other by name."""
import json
import os
import sys

# The tests run many tiny matmuls; multi-threaded OpenBLAS spends more time waking threads than
# computing on them (S05's test file: 65 s with the default, 33 s with one thread on 2 cores).
# Set before numpy is imported; an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# S17's Triton kernels run in Triton's interpreter on a machine without CUDA. Triton reads the
# setting when it decorates a kernel, its own helpers included (`import triton`), and importing
# torch._dynamo (S16's tests) imports triton: so it is set here, before any test module loads.
if "TRITON_INTERPRET" not in os.environ:
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
from pathlib import Path

import pytest

# Notebook kernels (tests/notebook_testing.py) run in the environment as it is here, before any
# test module loads: one that a library changes on import (torch._dynamo sets
# TORCHINDUCTOR_CACHE_DIR) or a test leaves changed would give each pytest-xdist worker process
# its own, and each would run the same notebook again.
os.environ["COURSE_TEST_KERNEL_ENV"] = json.dumps(dict(os.environ))

ROOT = Path(__file__).resolve().parents[1]
for sub in ("code", "tests", "tests/exercises"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One torch thread for the whole run: on ops this small, threads wait for each other
    (two threads on two shared cores were 2-4x slower in every engine measured), and pytest
    may run two workers side by side."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def run_dir(tmp_path_factory):
    """A folder shared by every process of this test run, named in COURSE_TEST_RUN_DIR: pytest's
    base temporary folder, of which pytest-xdist's workers get subfolders (pytest removes all
    but the last few). Notebooks are executed once per run and kept there
    (tests/notebook_testing.py)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    os.environ["COURSE_TEST_RUN_DIR"] = str(base)
    yield base


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is in requirements.txt
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
