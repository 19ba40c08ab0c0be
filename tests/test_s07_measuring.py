"""Tests for chapter S07's harness (code/s07_measuring.py): timestamps from the public stream.

Oracles: hand-computed values (latencies of fake engines on a fake clock, with one token per
output and with 2-3 tokens per output, percentiles of short lists), HF `transformers` greedy
`generate()` (the tokens every engine run through the harness must produce), and the
command line's stated rules (exit status 2, a message naming the rule, nothing loaded or
run first). No test asserts a timing of this machine.
"""
import json
import math

import numpy as np
import pytest
import torch

import s01_generation_loop as s01
import s03_transformer as s03
import s05_kv_cache as s05
import s06_torch as s06
import s07_measuring as s07
import s07_roofline
from s03_checkpoint import CheckpointTokenizer, config_from_hf_dict
from s07_measuring import (Distribution, HFGenerateClient, RequestResult, Stamp, StampStreamer,
                           StreamClient, TimedRequest, results_json, run_benchmark,
                           stamp_stream, write_results)
from s07_roofline import MachinePeaks, attach_floor
from s07_workloads import Request, Workload, make_workload

TOKENIZER_JSON = s07.ROOT / "data" / "tokenizer.json"
EOS = 2047   # <|endoftext|> in data/tokenizer.json


@pytest.fixture(scope="module")
def tokenizer():
    return CheckpointTokenizer(TOKENIZER_JSON, [EOS])


# ---------------------------------------------------------------------------------------------
# Fake engines on a fake clock: every latency is known by hand
# ---------------------------------------------------------------------------------------------

class FakeClock:
    """Seconds that pass only when the fake engine says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# Costs of the fake engine, in seconds (powers of two: every sum below is exact in binary).
TOKENIZE_S = 2.0 ** -10
PREFILL_PER_TOKEN_S = 2.0 ** -8
SAMPLE_S = 2.0 ** -9
DECODE_S = 2.0 ** -6
FINISH_S = 2.0 ** -7     # work after the last output (building the result, freeing state)
STEP_S = DECODE_S + SAMPLE_S


class FakeStream:
    """The course's CompletionStream shape: iterate for RequestOutputs, then `.result`."""

    def __init__(self, outputs, finish):
        self._outputs, self._finish = outputs, finish
        self.completion = None

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._outputs)

    @property
    def result(self) -> s01.Completion:
        if self.completion is None:
            raise ValueError("the stream is not finished")
        return self.completion


class FakeEngine:
    """The course's engine interface, `stream(prompt, max_tokens, temperature, seed, **options)`,
    on a fake clock. The prompt has one token per character. Encoding happens in `stream` (as
    S01's add_request checks the prompt there); the first `next` runs the prefill and samples;
    every later `next` runs one decode step and samples. Step k carries sizes[k % len(sizes)]
    tokens (fewer at the end): 1 is Part I's engines, more is what speculative decoding yields.
    After the last token, FINISH_S of work; with `empty_last` a last output without a token."""

    def __init__(self, clock: FakeClock, sizes=(1,), empty_last: bool = False,
                 corrupt_result: bool = False):
        self.clock, self.sizes = clock, tuple(sizes)
        self.empty_last, self.corrupt_result = empty_last, corrupt_result
        self.calls = []

    def stream(self, prompt, max_tokens=16, temperature=None, seed=None, **options):
        self.calls.append({"prompt": prompt, "max_tokens": max_tokens,
                           "temperature": temperature, "seed": seed, **options})
        self.clock.advance(TOKENIZE_S)
        stream = FakeStream(None, None)
        stream._outputs = self._run(len(prompt), max_tokens, stream)
        return stream

    def _run(self, prompt_tokens, max_tokens, stream):
        stats = s01.Stats(prompt_tokens=prompt_tokens)
        self.clock.advance(PREFILL_PER_TOKEN_S * prompt_tokens)
        stats.pass_times_s.append(PREFILL_PER_TOKEN_S * prompt_tokens)
        ids, step = [], 0
        while len(ids) < max_tokens:
            if step:
                self.clock.advance(DECODE_S)
                stats.pass_times_s.append(DECODE_S)
            self.clock.advance(SAMPLE_S)
            size = min(self.sizes[step % len(self.sizes)], max_tokens - len(ids))
            new = [7 + len(ids) + i for i in range(size)]
            ids += new
            step += 1
            done = len(ids) == max_tokens and not self.empty_last
            yield s01.RequestOutput("0", new, "x", done, "length" if done else None)
        self.clock.advance(FINISH_S)
        if self.empty_last:
            yield s01.RequestOutput("0", [], "", True, "length")
        result_ids = ids[:-1] + [0] if self.corrupt_result else ids
        stream.completion = s01.Completion("0", "", result_ids, "length", None, None, stats)


FAKE_WORKLOAD = Workload("fake", 0, (Request(0, "aaaa", 4, 3), Request(1, "bbbbbbbb", 8, 1),
                                     Request(2, "c" * 16, 16, 5)))


def one(request: Request) -> Workload:
    return Workload("one", 0, (request,))


def test_latencies_of_one_request_by_hand():
    clock = FakeClock()
    engine = FakeEngine(clock)
    run = run_benchmark(StreamClient("fake", engine), one(Request(0, "aaaa", 4, 3)),
                        clock=clock, warmup=False, progress=False)
    (r,) = run.requests
    # TTFT: tokenize, prefill of 4 tokens, sample token 0; the stamp is taken when `next`
    # hands the output over.
    assert r.ttft_s == TOKENIZE_S + 4 * PREFILL_PER_TOKEN_S + SAMPLE_S
    # Each later token: one decode step and one sample.
    assert r.itl_s == [STEP_S, STEP_S]
    # e2e ends at the last output (vLLM's latency): the work after it (FINISH_S) is not in it,
    # but it is in the run's wall time.
    assert r.e2e_s == r.ttft_s + 2 * STEP_S
    assert run.wall_s == r.e2e_s + FINISH_S
    assert r.tpot_s == STEP_S
    assert r.tokens_per_s == 3 / r.e2e_s
    assert r.output_tokens == 3 and r.token_ids == [7, 8, 9] and r.tokens_per_output == [1, 1, 1]
    assert r.model_step_s == [DECODE_S, DECODE_S]
    # Greedy, EOS ignored, exactly max_tokens: what every engine of the course is asked.
    assert engine.calls == [{"prompt": "aaaa", "max_tokens": 3, "temperature": 0.0,
                             "seed": None, "ignore_eos": True}]


def test_several_tokens_per_output_itl_is_per_output_tpot_per_token():
    clock = FakeClock()
    client = StreamClient("spec", FakeEngine(clock, sizes=(2, 3)))
    timed = client.measure(Request(0, "aa", 2, 6), clock)
    # Outputs of 2, 3 and 1 tokens (the last one capped at max_tokens), one step apart.
    t0 = 100.0 + TOKENIZE_S + 2 * PREFILL_PER_TOKEN_S + SAMPLE_S
    t1, t2 = t0 + STEP_S, t0 + 2 * STEP_S
    assert timed.stamps == [Stamp(t0, (7, 8)), Stamp(t1, (9, 10, 11)), Stamp(t2, (12,))]
    assert timed.token_times_s == [t0, t0, t1, t1, t1, t2]   # k tokens share their output's time
    r = RequestResult.from_timed(Request(0, "aa", 2, 6), timed)
    assert r.ttft_s == t0 - 100.0
    assert r.itl_s == [STEP_S, STEP_S]        # one gap per output after the first, not per token
    assert r.e2e_s == t2 - 100.0
    assert r.tpot_s == 2 * STEP_S / 5         # per token: (e2e - TTFT) / (n - 1)
    assert r.output_tokens == 6 and r.tokens_per_output == [2, 3, 1]
    assert r.token_ids == list(range(7, 13))
    assert r.tokens_per_s == 6 / r.e2e_s


def test_three_tokens_per_output_over_a_run():
    clock = FakeClock()
    workload = Workload("w", 0, (Request(0, "aaaa", 4, 6), Request(1, "bb", 2, 3)))
    run = run_benchmark(StreamClient("spec3", FakeEngine(clock, sizes=(3,))), workload,
                        clock=clock, warmup=False, progress=False)
    first, second = run.requests
    assert first.tokens_per_output == [3, 3] and first.itl_s == [STEP_S]
    assert second.tokens_per_output == [3] and second.itl_s == [] and second.tpot_s == 0.0
    assert first.tpot_s == STEP_S / 5
    assert run.itl_s.count == 1 and run.itl_s.p50 == STEP_S     # pooled gaps: outputs
    assert run.tpot_s.count == 2                                # one per request with n >= 2
    assert run.output_tokens == 9
    e2e = [TOKENIZE_S + 4 * PREFILL_PER_TOKEN_S + SAMPLE_S + STEP_S,
           TOKENIZE_S + 2 * PREFILL_PER_TOKEN_S + SAMPLE_S]
    assert [r.e2e_s for r in run.requests] == e2e
    assert run.wall_s == pytest.approx(sum(e2e) + 2 * FINISH_S)
    assert run.output_tokens_per_s == pytest.approx(9 / run.wall_s)


def test_an_output_without_a_token_is_not_stamped():
    clock = FakeClock()
    timed = StreamClient("f", FakeEngine(clock, empty_last=True)).measure(
        Request(0, "aa", 2, 2), clock)
    assert [s.token_ids for s in timed.stamps] == [(7,), (8,)]
    r = RequestResult.from_timed(Request(0, "aa", 2, 2), timed)
    assert r.e2e_s == TOKENIZE_S + 2 * PREFILL_PER_TOKEN_S + SAMPLE_S + STEP_S  # not FINISH_S


def test_stamp_stream_reads_the_clock_after_each_next():
    clock = FakeClock()

    def outputs():
        for k in range(3):
            clock.advance(2.0 ** -k)
            yield s01.RequestOutput("r", [k] * (k + 1), "", k == 2)

    timed = TimedRequest(5, clock())
    stamp_stream(timed, outputs(), clock)
    assert timed.stamps == [Stamp(101.0, (0,)), Stamp(101.5, (1, 1)), Stamp(101.75, (2, 2, 2))]


def test_stream_client_checks_the_stream_against_the_result():
    clock = FakeClock()
    with pytest.raises(RuntimeError, match="streamed tokens are not the result's"):
        StreamClient("bad", FakeEngine(clock, corrupt_result=True)).measure(
            Request(0, "aa", 2, 3), clock)


def test_run_summary_percentiles_and_throughput_by_hand():
    clock = FakeClock()
    run = run_benchmark(StreamClient("fake", FakeEngine(clock)), FAKE_WORKLOAD, model="m",
                        clock=clock, warmup=True, progress=False)
    assert [r.request_id for r in run.requests] == [0, 1, 2]     # the warm-up is not recorded
    ttft = [TOKENIZE_S + p * PREFILL_PER_TOKEN_S + SAMPLE_S for p in (4, 8, 16)]
    assert [r.ttft_s for r in run.requests] == ttft
    t = run.ttft_s
    # Sorted ttft = a < b < c; linear percentiles: p at index p/100 * 2.
    a, b, c = ttft
    assert t.mean == pytest.approx((a + b + c) / 3)
    assert t.p50 == b
    assert t.p90 == pytest.approx(b + 0.8 * (c - b))
    assert t.p99 == pytest.approx(b + 0.98 * (c - b))
    # ITL: 2 gaps + 0 gaps + 4 gaps, all one step.
    assert run.itl_s.count == 6
    assert run.itl_s.p50 == STEP_S and run.itl_s.p99 == STEP_S and run.itl_s.mean == STEP_S
    # TPOT only for requests with >= 2 tokens.
    assert run.tpot_s.count == 2 and run.tpot_s.mean == STEP_S
    e2e = [tt + (n - 1) * STEP_S for tt, n in zip(ttft, (3, 1, 5))]
    assert [r.e2e_s for r in run.requests] == e2e
    # One request after another on a clock only the engine moves: wall = e2e + finishing work.
    assert run.wall_s == pytest.approx(sum(e2e) + 3 * FINISH_S)
    assert run.output_tokens == 9
    assert run.output_tokens_per_s == pytest.approx(9 / run.wall_s)
    assert run.model_step_s.count == 6 and run.model_step_s.mean == DECODE_S


def test_request_result_rejects_bad_stamps():
    request = Request(0, "a", 1, 2)
    with pytest.raises(ValueError, match="generated no token"):
        RequestResult.from_timed(request, TimedRequest(0, 0.0))
    with pytest.raises(ValueError, match="generated 1 tokens; the harness asks for exactly "
                                         "max_tokens = 2"):
        RequestResult.from_timed(request, TimedRequest(0, 0.0, [Stamp(0.5, (5,))]))
    with pytest.raises(ValueError, match="generated 3 tokens"):
        RequestResult.from_timed(request, TimedRequest(0, 0.0, [Stamp(0.5, (5, 6, 7))]))
    with pytest.raises(ValueError, match="timestamps must be in order"):
        RequestResult.from_timed(request, TimedRequest(0, 0.0, [Stamp(0.6, (5,)),
                                                                Stamp(0.5, (6,))]))
    with pytest.raises(ValueError, match="timestamps must be in order"):
        RequestResult.from_timed(request, TimedRequest(0, 1.0, [Stamp(0.5, (5, 6))]))


def test_stamp_streamer_skips_the_prompt_and_stamps_each_put():
    clock = FakeClock()
    timed = TimedRequest(3, clock())
    streamer = StampStreamer(timed, clock)
    streamer.put(torch.tensor([[1, 2, 3]]))     # the prompt
    clock.advance(0.5)
    streamer.put(torch.tensor([9]))
    clock.advance(0.25)
    streamer.put(torch.tensor([4]))
    streamer.end()
    assert timed.stamps == [Stamp(100.5, (9,)), Stamp(100.75, (4,))]


def test_distribution_hand_values_and_errors():
    d = Distribution.of([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (d.mean, d.p50, d.count) == (3.0, 3.0, 5)
    assert d.p90 == pytest.approx(4.6)    # index 3.6: 4 + 0.6 * (5 - 4)
    assert d.p99 == pytest.approx(4.96)   # index 3.96
    single = Distribution.of([0.25])
    assert (single.mean, single.p50, single.p90, single.p99) == (0.25,) * 4
    with pytest.raises(ValueError, match="at least one value"):
        Distribution.of([])
    with pytest.raises(ValueError, match="must be finite"):
        Distribution.of([1.0, math.nan])


# ---------------------------------------------------------------------------------------------
# Real engines through the harness: the same tokens as HF, nothing patched
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3():
    """A random tiny Qwen3 with the project tokenizer's vocabulary (HF's own init)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=EOS, pad_token_id=EOS, bos_token_id=None)
    config._attn_implementation = "eager"
    hf = Qwen3ForCausalLM(config).eval()
    cfg = config_from_hf_dict(hf.config.to_dict())
    weights = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    return hf, cfg, weights


def callables_of(*objects) -> list[tuple[dict, dict]]:
    """Every callable an object holds itself, and every one its class defines: what patching a
    method by name would change (it sets a callable on the object, or on its class)."""
    return [({k: v for k, v in vars(obj).items() if callable(v)},
             {k: v for k, v in vars(type(obj)).items() if callable(v)}) for obj in objects]


def same_objects(a: list[tuple[dict, dict]], b: list[tuple[dict, dict]]) -> bool:
    return all(x.keys() == y.keys() and all(x[k] is y[k] for k in x)
               for pair_a, pair_b in zip(a, b) for x, y in zip(pair_a, pair_b))


def test_engines_through_the_harness_give_hf_greedy_tokens(tiny_qwen3, tokenizer):
    hf, cfg, weights = tiny_qwen3
    workload = make_workload("chat", tokenizer, 2, seed=1, max_context=128, max_output_tokens=6)
    expected = []
    for r in workload.requests:
        ids = torch.tensor([tokenizer.encode(r.prompt)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=r.max_tokens, min_new_tokens=r.max_tokens,
                          pad_token_id=EOS)
        expected.append(out[0, ids.shape[1]:].tolist())
        # min_new_tokens forbids EOS where the harness's engines ignore it; the two give the
        # same tokens exactly when EOS is never the argmax, which this checks.
        assert EOS not in expected[-1]
    numpy_model = s03.Transformer(cfg, weights)
    engines = [s01.Engine(numpy_model, tokenizer, 128), s05.Engine(numpy_model, tokenizer, 128),
               s06.Engine(s06.TorchTransformer(cfg, weights), tokenizer, 128)]
    watched = [numpy_model, *engines, *(e.runner for e in engines[1:]), engines[2].model]
    before = callables_of(*watched)
    clients = [StreamClient(name, e) for name, e in zip(("S01", "S05", "S06"), engines)]
    clients.append(HFGenerateClient("HF", hf, tokenizer, pad_token_id=EOS))
    for client in clients:
        run = run_benchmark(client, workload, clock=s07.time.perf_counter, progress=False)
        for r, want in zip(run.requests, expected):
            assert r.token_ids == want, client.name
            assert r.tokens_per_output == [1] * len(want), client.name
            assert r.output_tokens == len(r.itl_s) + 1
            assert 0 <= r.ttft_s <= r.e2e_s
        if client.name != "HF":
            assert run.model_step_s.count == sum(len(w) - 1 for w in expected)
    # Nothing was patched: no method of the engines, runners or models was replaced.
    assert same_objects(callables_of(*watched), before)


# ---------------------------------------------------------------------------------------------
# The results file
# ---------------------------------------------------------------------------------------------

def test_results_json_schema(tmp_path):
    clock = FakeClock()
    run = run_benchmark(StreamClient("fake", FakeEngine(clock, sizes=(1, 2))), FAKE_WORKLOAD,
                        model="fake-model", clock=clock, progress=False)
    from roofline_testing import HAND
    attach_floor(run, HAND, MachinePeaks(100.0, 1000.0, "hand bw", "hand mm"))
    machine = s07.machine_facts()
    path = write_results(tmp_path / "out" / "r.json",
                         results_json([run], machine, MachinePeaks(100.0, 1000.0, "a", "b"),
                                      extra={"note": "test"}))
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["schema"] == s07.RESULTS_SCHEMA == "s07-benchmark/2" and data["note"] == "test"
    assert set(data) >= {"created_utc", "machine", "roofline", "runs"}
    for key in ("cpu_model", "logical_cores", "torch_threads", "torch", "numpy",
                "transformers", "device", "python"):
        assert key in data["machine"]
    assert data["machine"]["numpy"] == np.__version__
    assert data["machine"]["torch"] == torch.__version__
    assert data["roofline"]["ridge_intensity_flop_per_byte"] == 10.0
    (r,) = data["runs"]
    assert (r["engine"], r["model"], r["workload"], r["seed"]) == ("fake", "fake-model", "fake", 0)
    summary = r["summary"]
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "model_step_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99", "count"}
    assert summary["requests"] == 3 and summary["output_tokens"] == 9
    assert summary["output_tokens_per_s"] == pytest.approx(9 / summary["wall_s"])
    assert summary["decode_vs_floor"] == pytest.approx(summary["itl_s"]["p50"]
                                                       / summary["decode_floor_s"])
    assert r["peak_memory"]["max_rss_bytes"] > 0
    assert "load_average_1min" in r
    per = r["per_request"]
    assert [q["output_tokens"] for q in per] == [3, 1, 5]
    assert [q["tokens_per_output"] for q in per] == [[1, 2], [1], [1, 2, 1, 1]]
    assert per[1]["tpot_s"] is None and per[1]["itl_s"] == []
    assert per[0]["tokens_per_s"] == pytest.approx(3 / per[0]["e2e_s"])
    table = s07.format_table([run])
    assert "fake-model" in table and "ITL/floor" in table
    assert f"{summary['decode_vs_floor']:.1f}x" in table


def test_format_table_drops_the_floor_for_the_bundled_model():
    # The bundled model's weights fit in the CPU's cache, so a DRAM-bandwidth floor does not
    # apply: no ITL/floor column in a table of its runs, "n/a" in its rows beside a model that
    # streams its weights from memory.
    def run(model):
        result = RequestResult(request_id=0, prompt_tokens=4, output_tokens=3,
                               token_ids=[1, 2, 3], ttft_s=0.01, itl_s=[0.002, 0.004], e2e_s=0.016)
        return s07.BenchmarkRun(engine="e", model=model, workload="w", seed=0,
                                requests=[result], wall_s=0.02, decode_floor_s=0.001)
    alone = s07.format_table([run(s07.BUNDLED_LABEL)]).splitlines()
    assert "ITL/floor" not in alone[0] and "x" not in alone[1].split()[-1]
    assert "no ITL/floor: the bundled model fits in the CPU's cache" in alone[-1]
    mixed = s07.format_table([run(s07.BUNDLED_LABEL), run("qwen3-0.6b")]).splitlines()
    assert "ITL/floor" in mixed[0]
    assert mixed[1].split()[-1] == "n/a" and mixed[2].split()[-1] == "3.0x"   # ITL p50 3 ms


# ---------------------------------------------------------------------------------------------
# The command line: every bad input is a usage error naming its rule, before anything runs
# ---------------------------------------------------------------------------------------------

def usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        s07.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "parameters" not in captured.out            # nothing was loaded or measured
    return captured.err


@pytest.mark.parametrize("argv, message", [
    (["--requests", "100000000"], f"--requests must be an integer in [1, {s07.MAX_REQUESTS}]"),
    (["--requests", "0"], f"--requests must be an integer in [1, {s07.MAX_REQUESTS}]"),
    (["--seed", "-1"], "--seed must be an integer >= 0 (got -1)"),
    (["--threads", "0"], "--threads must be an integer in [1, "),
    (["--threads", "-1"], "--threads must be an integer in [1, "),
    (["--threads", "100000"], "--threads must be an integer in [1, "),
    (["--model", "/no/such/checkpoint"], "--model: no such directory: /no/such/checkpoint"),
])
def test_cli_rules(argv, message, capsys):
    assert message in usage_error(argv, capsys)


def test_cli_threads_bound_is_the_logical_core_count(capsys):
    import os
    cores = os.cpu_count()
    assert f"--threads must be an integer in [1, {cores}] (got {cores + 1})" in usage_error(
        ["--threads", str(cores + 1)], capsys)


def test_cli_json_must_be_a_writable_file(tmp_path, capsys):
    err = usage_error(["--json", str(tmp_path)], capsys)
    assert f"--json: {tmp_path} is a directory" in err
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    err = usage_error(["--json", str(blocker / "sub" / "out.json")], capsys)
    assert f"{blocker} is a file, not a directory" in err
    with pytest.raises(ValueError, match="no permission to write"):
        import os
        real_access = os.access
        try:
            os.access = lambda path, mode: False
            s07.check_output_file(tmp_path / "new.json")
        finally:
            os.access = real_access
    assert s07.check_output_file(tmp_path / "new" / "deeper" / "r.json").name == "r.json"
    assert not (tmp_path / "new").exists()             # checking creates nothing


def test_cli_hint_only_when_the_bundled_model_is_missing(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    err = usage_error(["--model", str(empty)], capsys)
    assert "config.json" in err and "train_bundled_model" not in err
    monkeypatch.setattr(s03, "BUNDLED_MODEL_DIR", empty)   # the bundled model, not trained yet
    err = usage_error([], capsys)
    assert "scripts/train_bundled_model.py" in err


def test_main_runs_the_bundled_model_end_to_end(tmp_path, monkeypatch, capsys):
    # The roofs are measured elsewhere (test_s07_roofline); here they are fixed, so the run
    # is quick.
    monkeypatch.setattr(s07_roofline, "measure_peaks",
                        lambda **kw: MachinePeaks(1e10, 1e11, "fixed bw", "fixed mm"))
    out = tmp_path / "run.json"
    s07.main(["--requests", "1", "--workload", "chat", "--json", str(out)])
    text = capsys.readouterr().out
    assert "S05 NumPy + KV cache" in text and "S06 torch" in text
    header = next(line for line in text.splitlines() if line.startswith("model "))
    assert "ITL/floor" not in header and "fits in the CPU's cache" in text   # bundled: no floor
    data = json.loads(out.read_text())
    assert data["schema"] == s07.RESULTS_SCHEMA
    s05_run, s06_run = data["runs"]
    assert s05_run["per_request"][0]["token_ids"] == s06_run["per_request"][0]["token_ids"]
    assert s05_run["model"] == "bundled"
    assert s05_run["summary"]["output_tokens"] == s05_run["per_request"][0]["output_tokens"]
