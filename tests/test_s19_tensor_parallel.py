"""Tests for S19's server with S18's flags (--tensor-parallel-size, --distributed-backend,
--threads-per-rank, --disable-custom-all-reduce), over real HTTP with the official `openai`
client.

One server, started by `s19_server.main` itself with --tensor-parallel-size 2 (flags parsed,
the bundled model's checkpoint read by each rank for its own slices, one rank spawned, the
engine built by S18's `build_engine` over S13's), with uvicorn's `run` replaced by a catch of
the app, which a `ServerThread` then serves on a free loopback port (as
tests/test_s19_host_flags.py does). Oracle: S05's NumPy engine on each request alone, checked
against S06's alone (tests/engine_testing.bundled_alone), greedy with EOS ignored: the split
changes where the sums run, not the greedy tokens, so completions and chat, streamed and not,
must decode to its text. When the server stops, no rank process is left and this process's
torch.distributed group is gone (a next executor could start). Every combination S18 does not
run is a usage error (exit status 2) naming its flags, before a model loads or a process
starts: those cost no model and no process.
"""
import multiprocessing

import openai
import pytest
import torch

import s06_torch as s06
import s18_tensor_parallel as s18
import s19_server as srv
from engine_testing import bundled_alone

MODEL = "bundled"
PROMPT = "ROMEO.\n"
MESSAGES = [{"role": "user", "content": "Who art thou?"}]
CHAT_PROMPT = "User.\nWho art thou?\n\nAssistant.\n"      # the course's chat template
MAX_TOKENS = 16
from test_s19_host_flags import WAIT_S, start   # the server's main, uvicorn.run caught


@pytest.mark.slow   # one rank spawned, four requests of 16 tokens: a few seconds
def test_a_two_rank_server_answers_as_s05_alone_and_leaves_no_rank_behind():
    model, tok = s06.load(device="cpu")
    alone = bundled_alone(model, tok)
    want = {p: tok.decode(alone(p, MAX_TOKENS)) for p in (PROMPT, CHAT_PROMPT)}
    app, printed = start(["--tensor-parallel-size", "2", "--threads", "1", "--device", "cpu",
                          "--max-num-seqs", "4"])
    assert "tensor parallel 2 ranks (gloo" in printed
    assert "s18_tensor_parallel.build_engine over s13_prefix_caching.build_engine" in printed
    loop = app.state.engine_loop
    with srv.ServerThread(app) as running:
        runner = loop.call(lambda e: e.runner).result(WAIT_S)
        assert isinstance(runner, s18.TPRunner) and runner.tensor_parallel_size == 2
        # rank 0 holds half the query heads and one of the two KV heads
        assert (runner.model.config.num_attention_heads,
                runner.model.config.num_key_value_heads) == (2, 1)
        processes = list(runner.executor.processes)
        assert len(processes) == 1 and processes[0].is_alive()
        client = openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0,
                               timeout=WAIT_S)
        greedy = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                      extra_body={"ignore_eos": True})
        whole = client.completions.create(prompt=PROMPT, **greedy)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want[PROMPT],
                                                                           "length")
        assert whole.usage.completion_tokens == MAX_TOKENS
        streamed = client.completions.create(prompt=PROMPT, stream=True, **greedy)
        assert "".join(c.choices[0].text for c in streamed) == want[PROMPT]
        chat = client.chat.completions.create(messages=MESSAGES, **greedy)
        assert chat.choices[0].message.content == want[CHAT_PROMPT]
        chunks = client.chat.completions.create(messages=MESSAGES, stream=True, **greedy)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            want[CHAT_PROMPT]
    assert not loop.alive
    assert [(p.is_alive(), p.exitcode) for p in processes] == [(False, 0)]   # stopped, not killed
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("s18-rank")]
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("argv, message", [
    (["-tp", "2", "--async-scheduling"], "--tensor-parallel-size runs its own ranks, step by "
                                         "step: use it without --executor-backend mp and "
                                         "--async-scheduling"),
    (["-tp", "2", "--executor-backend", "mp"], "use it without --executor-backend mp"),
    (["-tp", "2", "--compile"], "--compile and --cuda-graphs run S16's static step, which is "
                                "not split over ranks"),
    (["-tp", "2", "--quantize", "int8"], "--quantize and --kv-cache-dtype (S14's quantized "
                                         "weights and 8-bit KV pool) are not split over ranks"),
    (["-tp", "2", "--kv-cache-dtype", "int8"], "--quantize and --kv-cache-dtype (S14's"),
    (["-tp", "2", "--speculative", "draft"], "--speculative draft (S15's draft model) is not "
                                             "split over ranks: use --speculative ngram"),
    (["-tp", "3"], "tensor_parallel_size=3: the 4 query heads must divide by the rank count"),
    (["-tp", "0"], "--tensor-parallel-size must be >= 1 (got 0)"),
    (["-tp", "2", "--threads-per-rank", "0"], "--threads-per-rank must be >= 1 (got 0)"),
    (["--distributed-backend", "gloo"], "--distributed-backend sets up the ranks of "
                                        "--tensor-parallel-size N > 1"),
    (["--threads-per-rank", "2"], "--threads-per-rank sets up the ranks of"),
    (["--disable-custom-all-reduce"], "--disable-custom-all-reduce sets up the ranks of"),
    (["-tp", "2", "--distributed-backend", "mpi"],
     "argument --distributed-backend: invalid choice: 'mpi'"),
])
def test_what_s18_does_not_run_is_a_usage_error_before_a_model_or_a_rank(argv, message, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(srv, "load_served", lambda *a: pytest.fail("a model was loaded"))
    monkeypatch.setattr(s18, "TPExecutor", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as stop:
        srv.main([*argv, "--device", "cpu"])
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("argv, patch, message", [
    (["-tp", "2"], ("usable_cores", lambda: 1),
     "tensor_parallel_size=2 x threads_per_rank=1 needs 2 cores; this process may use 1"),
    (["-tp", "2", "--distributed-backend", "nccl"], ("torch.cuda.is_available", lambda: False),
     "distributed_backend='nccl' needs CUDA, and torch finds none"),
])
def test_ranks_the_machine_cannot_run_are_a_usage_error_before_a_model_or_a_rank(
        argv, patch, message, capsys, monkeypatch):
    """One core (S18 gives each rank its own), NCCL where torch finds no CUDA."""
    name, fake = patch
    if name.startswith("torch."):
        monkeypatch.setattr(torch.cuda, "is_available", fake)
    else:
        monkeypatch.setattr(s18, name, fake)
    monkeypatch.setattr(srv, "load_served", lambda *a: pytest.fail("a model was loaded"))
    monkeypatch.setattr(s18, "TPExecutor", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as stop:
        srv.main([*argv, "--device", "cpu"])
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())
