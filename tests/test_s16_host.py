"""Tests for chapter S16's script (code/s16_host.py): its main with --async-scheduling,
--static-decode, --compile and --profile, its usage errors, its --help, and the helpers that
put the run into words.

Oracles: S13's engine (the builder the script wraps, untouched by S16) run in process through
S09's `LLM` on the same prompts, greedy: every technique changes only the cost, so each
request's completion text, token count and finish_reason printed by the script must be what
S13's engine makes (the static, compiled and async steps are held to the eager runner's
logits by tests/test_s16_static.py and tests/test_s16_async.py; here the whole script is).
The engine's own counters, read from the script's header line, must say the technique ran
(static steps by bucket, a compile time per bucket). Hand-made `StepProfile`s with round
numbers for the step table and the choice of the timeline's step. Timings are never asserted.
One torch.compile in the module (one bucket, ~5 s on the course's CPU); the other runs are
eager and take about a second each.
"""
import argparse
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import s06_torch as s06
import s13_prefix_caching as s13
import s16_async
import s16_host
import s16_profile
import s16_static
from engine_testing import greedy
from s09_llm import LLM
from test_cli_help import options as help_options

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING HENRY.\nOnce more unto the breach"]
MAX_TOKENS = 12
BASE = ["--max-tokens", str(MAX_TOKENS), "--device", "cpu", "--threads", "1"]
for prompt in PROMPTS:
    BASE += ["--prompt", prompt]
COMPLETION = re.compile(r"--- completion \((\d+) tokens, finish_reason=(\w+)\) ---\n(.*?)"
                        r"(?=\n\n--- (?:request|\d+ tokens in))", re.DOTALL)


@pytest.fixture(scope="module")
def want():
    """S13's engine as the script builds it (4 seats, its 16-token budget), greedy."""
    model, tok = s06.load(device="cpu")
    engine = s13.build_engine(model, tok, max_num_seqs=4, max_num_batched_tokens=16)
    done = LLM(engine).generate(PROMPTS, greedy(MAX_TOKENS))
    return [(len(c.token_ids), c.finish_reason, c.text) for c in done]


def run_main(capsys, *flags) -> str:
    s16_host.main([*flags, *BASE])
    return capsys.readouterr().out


def completions(out: str) -> list[tuple[int, str, str]]:
    return [(int(n), reason, text) for n, reason, text in COMPLETION.findall(out)]


def forward_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("s16-forward")]


# --- main -----------------------------------------------------------------------------------

def test_main_plain_is_s13s_engine(capsys, want):
    out = run_main(capsys)
    assert completions(out) == want
    header = out.splitlines()[0]
    assert header.endswith("16 tokens per step; eager steps; synchronous")


def test_main_async_scheduling_with_profile_prints_the_same_and_stops_its_thread(capsys,
                                                                                 want):
    before = set(forward_threads())
    out = run_main(capsys, "--async-scheduling", "--profile")
    assert completions(out) == want
    assert "; eager steps; async scheduling" in out.splitlines()[0]
    steps = int(re.search(r"\n--- (\d+) tokens in (\d+) steps", out).group(2))
    made = int(re.search(r"\n--- (\d+) tokens in", out).group(1))
    assert made == sum(n for n, _, _ in want)
    table = out[out.index(" step kind"):]
    assert len(re.findall(r"^ +\d+ (?:decode|prefill|mixed) ", table, re.MULTILINE)) == steps
    medians = out[out.index("--- medians by kind and batch size"):]
    assert medians.splitlines()[1].split()[:4] == ["kind", "B", "steps", "step"]
    # one row per (kind, B), their step counts adding up to the run's
    rows = [line.split() for line in medians.splitlines()[2:]
            if re.match(r"(decode|prefill|mixed) ", line)]
    assert sum(int(r[2]) for r in rows) == steps
    timeline = out[out.index("--- one decode step"):]
    head = timeline.splitlines()[1]
    widest = max(int(r[1]) for r in rows if r[0] == "decode")
    assert re.match(rf"step \d+  decode  B={widest}  T={widest}  ", head)
    for phase in ("prepare", "forward", "sample", "postprocess", "update"):
        assert re.search(rf"^  {phase} +[\d.]+ +[\d.]+ ms \|[ #]+\|$", timeline, re.MULTILINE)
    # the engine's worker thread is gone: main shut the AsyncLLMEngine down
    assert set(forward_threads()) <= before


def test_main_static_decode_runs_static_steps_in_the_buckets_given(capsys, want):
    out = run_main(capsys, "--static-decode", "--cudagraph-capture-sizes", "1", "2")
    assert completions(out) == want
    header = out.splitlines()[0]
    assert "decode steps static in buckets 1, 2, eager; synchronous" in header
    found = re.search(r"(\d+) static decode steps \(by bucket ([^)]*)\), (\d+) eager", header)
    by_bucket = dict(map(int, item.split(": ")) for item in found.group(2).split(", "))
    assert int(found.group(1)) == sum(by_bucket.values()) > 0
    assert set(by_bucket) <= {1, 2} and 1 in by_bucket     # the last request decodes alone
    assert "compile included" not in header


@pytest.mark.slow   # one torch.compile of one bucket: ~5 s on the course's CPU
@pytest.mark.skipif(s16_static.find_cxx() is None, reason="inductor needs a C++ compiler")
def test_main_compiled_prints_what_s13s_engine_makes_and_the_compile_time(capsys, want):
    out = run_main(capsys, "--compile", "--cudagraph-capture-sizes", "4")
    assert completions(out) == want
    header = out.splitlines()[0]
    assert "decode steps static in buckets 4, compiled; synchronous" in header
    found = re.search(r"(\d+) static decode steps \(by bucket 4: (\d+)\), (\d+) eager", header)
    assert found and int(found.group(1)) == int(found.group(2)) > 0    # 3 requests: bucket 4
    seconds = float(re.search(r"compile included: bucket 4 ([\d.]+) s", header).group(1))
    assert seconds > 0


# --- usage errors, before a model loads -----------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--cuda-graphs"], "--cuda-graphs needs a CUDA device (the model would run on cpu)"),
    (["--cudagraph-capture-sizes", "4"],
     "--cudagraph-capture-sizes needs --compile, --cuda-graphs or --static-decode"),
    (["--static-decode", "--cudagraph-capture-sizes", "2", "0"],
     "--cudagraph-capture-sizes must be integers in [1, 512] (got 0)"),
    (["--static-decode", "--cudagraph-capture-sizes", "513"],
     "--cudagraph-capture-sizes must be integers in [1, 512] (got 513)"),
    (["--static-decode", "--cudagraph-capture-sizes", "x"],
     "argument --cudagraph-capture-sizes: invalid int value: 'x'"),
    (["--static-decode", "--batch-invariant"],
     "--compile, --cuda-graphs and --static-decode need the fast mode"),
])
def test_bad_flags_are_usage_errors_before_a_model_loads(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(s06, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        s16_host.main([*flags, "--device", "cpu"])
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_an_engine_rule_is_a_usage_error_after_the_model_loads(capsys):
    with pytest.raises(SystemExit) as stop:
        s16_host.main(["--async-scheduling", "--max-num-batched-tokens", "2", *BASE])
    assert stop.value.code == 2
    assert "max_num_batched_tokens (2) must be >= max_num_seqs (4)" in capsys.readouterr().err


def test_compile_without_a_compiler_is_a_usage_error_naming_the_flag(capsys, monkeypatch):
    monkeypatch.setattr(s16_static, "find_cxx", lambda: None)
    monkeypatch.setattr(s06, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        s16_host.main(["--compile", "--device", "cpu"])
    assert stop.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--compile: compile on the CPU needs a C++ compiler" in err
    assert "Traceback" not in err


def test_help_gives_every_flag_a_help_text_and_its_default():
    done = subprocess.run([sys.executable, str(ROOT / "code" / "s16_host.py"), "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="100"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\n\nChapter 16: \S", done.stdout)
    found = help_options(done.stdout)
    for flag in ("--compile", "--cuda-graphs", "--static-decode",
                 "--cudagraph-capture-sizes N [N ...]", "--async-scheduling", "--profile",
                 "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS", "--block-size BLOCK_SIZE",
                 "--num-blocks NUM_BLOCKS", "--max-num-seqs MAX_NUM_SEQS"):
        assert flag in found, flag
    for invocation, text in found.items():
        assert text.strip(), f"{invocation} has no help text"
        if " " in invocation.split(",")[-1].strip():             # it takes a value
            assert "(default: " in text, f"{invocation} does not give its default"


# --- the helpers ----------------------------------------------------------------------------

def profile(step, kind, b, step_ms, forward_ms=1.0):
    return s16_profile.StepProfile(
        step=step, num_seqs=b, num_tokens=b if kind == "decode" else 16, kind=kind,
        step_s=step_ms / 1e3, propose_s=0.0, schedule_s=0.0, prepare_s=0.0,
        forward_s=forward_ms / 1e3, sample_s=0.0, postprocess_s=0.0, update_s=0.0,
        other_s=(step_ms - forward_ms) / 1e3, ops=None, model_ops=None, segments=())


def test_timeline_step_is_the_median_decode_step_of_the_largest_batch():
    profiles = [profile(0, "prefill", 4, 9.0), profile(1, "decode", 4, 500.0),   # compiling
                profile(2, "decode", 4, 2.0), profile(3, "decode", 4, 3.0),
                profile(4, "decode", 2, 1.0), profile(5, "mixed", 8, 4.0)]
    assert s16_host.timeline_step(profiles).step == 3
    assert s16_host.timeline_step(profiles[:1]) is None
    assert s16_host.timeline_step([profiles[1], profiles[4]]).step == 1    # alone in its B


def test_step_table_lines_carry_each_profile():
    text = s16_host.format_step_table([profile(7, "decode", 4, 2.0, 1.5),
                                       profile(8, "prefill", 1, 10.0, 9.0)])
    lines = text.splitlines()
    assert lines[0].split() == ["step", "kind", "B", "T", "step", "ms", "fwd", "ms", "host",
                                "%"]
    assert lines[1].split() == ["7", "decode", "4", "4", "2.000", "1.500", "25.0"]
    assert lines[2].split() == ["8", "prefill", "1", "16", "10.000", "9.000", "10.0"]


def test_the_first_tracer_keeps_the_profiles_as_its_records():
    tracer = s16_host.StepProfiles()
    tracer.profiles.append(profile(0, "decode", 1, 1.0))
    assert tracer.records is tracer.profiles and len(tracer.records) == 1


def test_describe_and_shutdown_of_each_engine():
    model, tok = s06.load(device="cpu")
    plain = s16_host.build_engine(model, tok, max_num_seqs=2)
    assert s16_host.describe_techniques(plain) == "eager steps; synchronous"
    assert s16_host.describe_runs(plain) == ""
    s16_host.shutdown_engine(plain)                             # nothing to stop: no error
    engine = s16_host.build_engine(model, tok, max_num_seqs=2, async_scheduling=True,
                                   builder=s16_host.static_builder(sizes=[2]))
    assert isinstance(engine, s16_async.AsyncLLMEngine)
    assert s16_host.inner_engine(engine) is engine.engine
    assert s16_host.describe_techniques(engine) == \
        "decode steps static in buckets 2, eager; async scheduling"
    LLM(engine).generate(PROMPTS[:1], greedy(4))
    worker = engine.worker.submit(threading.current_thread).result()
    assert worker.is_alive()
    # 1 prefill, then 3 decode steps (async: maybe one more, computed for a request that
    # ended and dropped), each in bucket 2
    found = re.match(r"(\d+) static decode steps \(by bucket 2: (\d+)\), (\d+) eager",
                     s16_host.describe_runs(engine))
    assert 3 <= int(found.group(1)) == int(found.group(2)) <= 4 and found.group(3) == "1"
    s16_host.shutdown_engine(engine)
    s16_host.shutdown_engine(engine)                            # twice: no error
    assert not worker.is_alive()


def test_technique_options_follow_the_flags():
    parser = argparse.ArgumentParser()
    s16_host.add_technique_arguments(parser)
    options = s16_host.technique_options(parser.parse_args(["--async-scheduling"]))
    assert options == dict(compile=False, cuda_graphs=False, async_scheduling=True,
                           cudagraph_capture_sizes=None, executor_backend="uni")
    options = s16_host.technique_options(parser.parse_args(
        ["--async-scheduling", "--executor-backend", "mp"]))
    assert options["executor_backend"] == "mp"
    options = s16_host.technique_options(parser.parse_args(
        ["--static-decode", "--cudagraph-capture-sizes", "8", "2"]))
    assert callable(options.pop("builder")) and "cudagraph_capture_sizes" not in options
    options = s16_host.technique_options(parser.parse_args(
        ["--static-decode", "--compile", "--cudagraph-capture-sizes", "8"]))
    assert "builder" not in options and options["cudagraph_capture_sizes"] == [8]
    server = argparse.ArgumentParser()
    s16_host.add_technique_arguments(server, static_decode=False)
    assert not hasattr(server.parse_args([]), "static_decode")
