"""Shared test set-up: chapter modules live in code/ and import each other by name."""
import os
import sys

# The tests run many tiny matmuls; multi-threaded OpenBLAS spends more time waking threads than
# computing on them (S05's test file: 65 s with the default, 33 s with one thread on 2 cores).
# Set before numpy is imported; an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
from pathlib import Path

import pytest

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
