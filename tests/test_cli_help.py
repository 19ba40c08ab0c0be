"""`--help` of every chapter script: a description, a help text for every option, and its
default (issue 13). Each script runs in a subprocess, as a learner types it."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # six subprocesses, some import torch: a few seconds each

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["s01_generation_loop", "s02_tokenizer", "s03_transformer", "s04_sampling",
           "s05_kv_cache", "s06_torch", "s07_measuring", "s08_static_batching",
           "s09_continuous_batching", "s10_scheduler", "s11_chunked_prefill",
           "s12_paged_attention", "s12_kv_budget", "s13_prefix_caching", "s14_quantization",
           "s14_kv_cache", "s14_quality", "s15_speculative", "s16_host", "s17_attention",
           "s18_tensor_parallel", "s19_server"]


def options(help_text: str) -> dict[str, str]:
    """{option invocation: its help text} from argparse's --help output."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2) or ""
        elif current and re.match(r"^\s{6,}\S", line):   # a continuation of the help text
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_every_option_and_its_default(script):
    done = subprocess.run([sys.executable, str(ROOT / "code" / f"{script}.py"), "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="100"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\n\nChapter \d+: \S", done.stdout), "no description"
    found = options(done.stdout)
    assert "-h, --help" in found and len(found) > 3
    for invocation, text in found.items():
        assert text.strip(), f"{script}: {invocation} has no help text"
        takes_a_value = " " in invocation.split(",")[-1].strip()   # "--seed SEED", not a flag
        if takes_a_value:
            assert "(default: " in text, f"{script}: {invocation} does not give its default"


def test_s06_defaults_to_one_thread_as_s07_does():
    done = subprocess.run([sys.executable, str(ROOT / "code" / "s06_torch.py"), "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="100"))
    assert "(default: 1, as S07" in " ".join(options(done.stdout)["--threads THREADS"].split())
