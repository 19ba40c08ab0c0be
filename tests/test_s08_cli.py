"""Tests for code/s08_cli.py, the command line every Part II script shares.

Oracles: the rules and messages as stated in the module (each broken rule is argparse's usage
error, exit status 2, naming the flag), and table rows worked out by hand.
"""
import argparse
import os

import pytest
import torch

from s08_cli import MAX_NUM_PROMPTS, check_common_arguments, elide, fit_ids

CORES = os.cpu_count() or 1


def usage_error(capsys, **flags) -> str:
    """check_common_arguments on a namespace of these flags; the usage error it prints."""
    with pytest.raises(SystemExit) as exit_info:
        check_common_arguments(argparse.ArgumentParser(prog="s"), argparse.Namespace(**flags))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (dict(threads=0), f"--threads must be an integer in [1, {CORES}] (got 0)"),
    (dict(threads=CORES + 1), f"--threads must be an integer in [1, {CORES}] (got {CORES + 1})"),
    (dict(seed=-1), "--seed must be an integer >= 0 (got -1)"),
    (dict(device="tpu"), "--device must be 'cpu', 'cuda' or 'cuda:N' (got 'tpu')"),
    (dict(device="cuda:x"), "--device must be 'cpu', 'cuda' or 'cuda:N' (got 'cuda:x')"),
    (dict(num_prompts=0), f"--num-prompts must be an integer in [1, {MAX_NUM_PROMPTS}] (got 0)"),
    (dict(num_prompts=MAX_NUM_PROMPTS + 1),
     f"--num-prompts must be an integer in [1, {MAX_NUM_PROMPTS}] (got {MAX_NUM_PROMPTS + 1})"),
])
def test_each_broken_rule_is_a_usage_error_naming_it(capsys, flags, message):
    assert message in usage_error(capsys, **flags)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_cuda_device_is_a_usage_error(capsys, monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = usage_error(capsys, device=device)
    assert f"--device '{device}' needs a CUDA device, and torch finds none" in err


def test_a_cuda_index_past_the_devices_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ("--device cuda:2 names CUDA device 2, and torch finds 2 (cuda:0 to cuda:1)"
            in usage_error(capsys, device="cuda:2"))
    check_common_arguments(argparse.ArgumentParser(), argparse.Namespace(device="cuda:1"))


def test_valid_flags_and_absent_flags_pass():
    parser = argparse.ArgumentParser()
    check_common_arguments(parser, argparse.Namespace(
        threads=1, seed=0, device="cpu", num_prompts=MAX_NUM_PROMPTS))
    check_common_arguments(parser, argparse.Namespace(threads=CORES, device=None))
    check_common_arguments(parser, argparse.Namespace())    # a benchmark without these flags


def test_elide_keeps_short_tables_and_cuts_the_middle_of_long_ones():
    assert elide([1, 2, 3], 3) == [1, 2, 3] and elide([], 2) == []
    assert elide(list(range(10)), 4) == [0, 1, None, 8, 9]
    assert elide(list(range(10)), 5) == [0, 1, None, 8, 9]       # max_rows // 2 on each side
    assert elide(range(5), 2) == [0, None, 4]


@pytest.mark.parametrize("max_rows", [1, 0, -3, 2.5, True, "4"])
def test_elide_refuses_max_rows_that_cannot_show_both_ends(max_rows):
    with pytest.raises(ValueError, match=r"max_rows must be an integer >= 2 \(got .*\): the "
                                         "table shows the first and the last steps"):
        elide([1, 2, 3], max_rows)


def test_fit_ids_cuts_to_the_width_and_says_how_many():
    ids = [str(i) for i in range(12)]
    assert fit_ids(ids[:3], 8) == "0,1,2"
    assert fit_ids(ids, 12) == "12: 0,1,2,…"
    assert fit_ids(["123456789"], 8) == "1: …"
    assert all(len(fit_ids(ids, width)) <= width for width in range(8, 30))
