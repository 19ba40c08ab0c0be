"""Tests for S18's multi-process executor (code/s18_tensor_parallel.py): the bundled model split
over 2 ranks (processes) under S13's engine, and every way its ranks stop.

Oracles: S05's NumPy engine and S06's engine, each request alone (tests/engine_testing.py's
`bundled_alone`, greedy tokens, EOS ignored; HF `transformers`' greedy `generate` is compared
with a TP = 2 engine in tests/test_parity.py's chain, where HF is loaded anyway); S13's
one-process engine (TP = 1) run on the same plans for the logits; the all-reduce count of a
step worked out from the config by hand (one for the embedding, two per layer: 13, each T x C
float32); S06's engine for the chapter script's completions.

Spawning a rank costs about 1.5 s, so one executor (ranks 0 and 1, the shared-memory
all-reduce: the default on x86) serves every engine of the tests above `test_shutdown_...`,
which stops it; only one executor may live in a process, so the tests after it that need
their own come after it, in file order (the suite runs each file whole in one process:
`--dist loadfile`). Processes started in all: that executor; one that a worker's error stops;
the chapter script's, in this process, on gloo after it; and two subprocesses alive at once:
a script that gets SIGINT and the chapter script under torchrun (2 ranks). The bad-input
tests start none (each checks it); those that need an executor use the shared one.
"""
import dataclasses
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import s03_transformer as s03
import s06_torch as s06
import s13_prefix_caching as s13
import s18_tensor_parallel as tp
from engine_testing import RunnerWrapper, bundled_alone, greedy
from s01_generation_loop import ParameterError
from s09_llm import LLM

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = s03.BUNDLED_MODEL_DIR
L, C = 6, 128                          # the bundled model's layers and hidden size, by hand
# Float32 logits of TP = 2 against TP = 1 on the same plan: the row-parallel products are
# summed over the ranks (two partial dot products, then their sum), so the last bits differ.
# Measured over every step of the chunked run below: 1.1e-5 (logits of order 10); 1e-4 is the
# rule S16 and S17 use against the runner they replace.
LOGITS_ATOL = 1e-4
PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING HENRY.\nOnce more unto the breach", "O"]
MAX_TOKENS = [24, 16, 20, 12]          # contexts 29, 23, 30, 13: 8, 6, 8 and 4 blocks of 4
PREFIX = ("First Citizen.\nBefore we proceed any further, hear me speak.\n\nAll.\nSpeak, "
          "speak.\n\n")                                         # 27 tokens: 6 full blocks
SHARED = [PREFIX + "First Citizen.\nYou", PREFIX + "All.\nResolved"]
COMPLETION = re.compile(r"--- completion \((\d+) tokens, finish_reason=(\w+)\) ---\n(.*?)"
                        r"(?=\n\n--- (?:request|\d+ tokens in))", re.DOTALL)


@pytest.fixture(scope="module")
def bundled():
    return s06.load()


@pytest.fixture(scope="module")
def alone(bundled):
    return bundled_alone(*bundled)


@pytest.fixture(scope="module")
def executor():
    """Ranks 0 (this process) and 1 of the bundled model, each reading its half of the
    checkpoint; every engine below is built on it. `test_shutdown_...` stops it."""
    ex = tp.TPExecutor(MODEL_DIR, tp.ParallelConfig(2))
    yield ex
    ex.shutdown()


def build(bundled, ex, **options):
    model, tok = bundled
    return tp.build_engine(model, tok, executor=ex, **dict(dict(block_size=4, max_num_seqs=4),
                                                            **options))


def generate(engine, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    done = LLM(engine).generate(list(prompts), [greedy(n, ignore_eos=True) for n in max_tokens])
    return [c.token_ids for c in done]


def children() -> set[int]:
    """Pids of the ranks this process has running (spawned by multiprocessing; its resource
    tracker, which stays for the process's life, is not one)."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def script_env() -> dict:
    return dict(os.environ, COLUMNS="100", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def completions(out: str) -> list[tuple[int, str, str]]:
    return [(int(n), reason, text) for n, reason, text in COMPLETION.findall(out)]


class Steps(RunnerWrapper):
    """Records each plan's (tokens computed before, tokens scheduled) per request."""

    def __init__(self, runner):
        super().__init__(runner)
        self.plans: list[dict[str, tuple[int, int]]] = []

    def execute_model(self, plan, requests):
        self.plans.append({rid: (plan.num_computed_tokens[rid], n)
                           for rid, n in plan.num_scheduled_tokens.items()})
        return self.runner.execute_model(plan, requests)


# --- bad input: refused before any process starts ------------------------------------------

@pytest.mark.parametrize("case", ["divide", "nccl without cuda", "gloo on cuda", "cores",
                                  "batch invariant", "config"])
def test_refusals_come_before_any_process(bundled, monkeypatch, case):
    model, tok = bundled
    config = model.config
    before = children()
    if case == "divide":                                   # 4 query heads on 3 ranks
        with pytest.raises(ParameterError, match="the 4 query heads must divide") as err:
            tp.build_engine(model, tok, tensor_parallel_size=3)
        assert err.value.parameter == "tensor_parallel_size"
    elif case == "nccl without cuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(ParameterError, match="'nccl' needs CUDA") as err:
            tp.check_parallel(config, tp.ParallelConfig(2, backend="nccl"),
                              torch.device("cpu"))
        assert err.value.parameter == "distributed_backend"
        with pytest.raises(ParameterError, match="'nccl' needs CUDA"):
            tp.build_engine(model, tok, tensor_parallel_size=2, distributed_backend="nccl")
    elif case == "gloo on cuda":
        with pytest.raises(ParameterError, match="use 'nccl' with CUDA") as err:
            tp.check_parallel(config, tp.ParallelConfig(2, backend="gloo"),
                              torch.device("cuda"))
        assert err.value.parameter == "distributed_backend"
    elif case == "cores":                    # 2 ranks x 2 threads on a process given 3 cores
        monkeypatch.setattr(tp, "usable_cores", lambda: 3)
        parallel = tp.ParallelConfig(2, threads_per_rank=2)
        message = "needs 4 cores; this process may use 3"
        with pytest.raises(ParameterError, match=message) as err:
            tp.check_parallel(config, parallel, torch.device("cpu"))
        assert err.value.parameter == "tensor_parallel_size"
        assert tp.check_parallel(config, tp.ParallelConfig(2), torch.device("cpu")) == "gloo"
        with pytest.raises(ParameterError, match=message):
            tp.TPExecutor(MODEL_DIR, parallel)
        with pytest.raises(ParameterError, match=message):
            tp.build_engine(model, tok, tensor_parallel_size=2, threads_per_rank=2)
    elif case == "batch invariant":
        with pytest.raises(ParameterError, match="use tensor_parallel_size=1") as err:
            tp.build_engine(model, tok, tensor_parallel_size=2, batch_invariant=True)
        assert err.value.parameter == "batch_invariant"
    else:
        for fields, parameter in [(dict(tensor_parallel_size=0), "tensor_parallel_size"),
                                  (dict(tensor_parallel_size=True), "tensor_parallel_size"),
                                  (dict(threads_per_rank=0), "threads_per_rank"),
                                  (dict(backend="mpi"), "distributed_backend"),
                                  (dict(distributed_init="file"), "distributed_init"),
                                  (dict(timeout_s=0), "timeout_s")]:
            with pytest.raises(ParameterError) as err:
                tp.ParallelConfig(**fields)
            assert err.value.parameter == parameter
    assert children() == before, "a process was started"
    assert not dist.is_initialized() and not tp._ACTIVE


def share(model):
    """Rank 0's share of the model (ranks as threads: no process)."""
    import s18_layers
    return s18_layers.run_ranks(2, lambda comm: s18_layers.shard_model(model, comm))[0]


def other_model(model, case):
    """The bundled model changed one way, in memory: "weights" (its embedding + 1), "config"
    (its first layer only), "dtype" (bfloat16)."""
    import s03_checkpoint
    import s18_layers
    state = s18_layers.s06_state_dict(model)
    if case == "weights":
        return s06.TorchTransformer(model.config, dict(
            state, **{"model.embed_tokens.weight": state["model.embed_tokens.weight"] + 1}))
    if case == "config":
        config = dataclasses.replace(model.config, num_hidden_layers=1)
        return s06.TorchTransformer(config, {k: state[k] for k in
                                             s03_checkpoint.expected_tensors(config)})
    return s06.TorchTransformer(model.config, state, dtype=torch.bfloat16)


BAD_ARGUMENTS = {
    # (the call, given the bundled model, its tokenizer and a temporary directory; the
    # parameter its ParameterError names; the environment variables set, others of torchrun's
    # unset). Before the fix, in order: an S17 engine (True == 1); silently ignored; silently
    # ignored; AttributeError; AttributeError; an engine on one rank's share alone (its first
    # all-reduce waits for the other ranks forever: a hang); AttributeError; the checkpoint's
    # model run in place of `model`; ParallelConfig accepted inf (then OverflowError inside
    # torch), nan was refused already, 1e18 (OverflowError), 0.5 and True (1 s: rank 1 "did
    # not start" that soon), "yes"; AttributeError; TypeError inside pathlib; StopIteration; a
    # ValueError after the ranks were spawned; KeyError 'MASTER_ADDR' (torchrun's RANK and
    # WORLD_SIZE without the rest).
    "tp True": (lambda m, t, d: tp.build_engine(m, t, tensor_parallel_size=True),
                "tensor_parallel_size"),
    "tp 1, mpi": (lambda m, t, d: tp.build_engine(m, t, distributed_backend="mpi"),
                  "distributed_backend"),
    "tp 1, 0 threads": (lambda m, t, d: tp.build_engine(m, t, threads_per_rank=0),
                        "threads_per_rank"),
    "executor str": (lambda m, t, d: tp.build_engine(m, t, executor="ranks"), "executor"),
    "model None": (lambda m, t, d: tp.build_engine(None, t, tensor_parallel_size=2), "model"),
    "model a rank's share": (lambda m, t, d: tp.build_engine(share(m), t), "model"),
    "source a rank's share": (lambda m, t, d: tp.TPExecutor(share(m), tp.ParallelConfig(2)),
                              "source"),
    "checkpoint of another config": (
        lambda m, t, d: tp.build_engine(m, t, tensor_parallel_size=2, checkpoint=d),
        "checkpoint"),
    **{f"timeout {v!r}": (lambda m, t, d, v=v: tp.ParallelConfig(2, timeout_s=v), "timeout_s")
       for v in (float("inf"), float("nan"), 1e18, 0.5, True)},
    "custom all-reduce 'yes'": (
        lambda m, t, d: tp.ParallelConfig(2, disable_custom_all_reduce="yes"),
        "disable_custom_all_reduce"),
    "parallel 2": (lambda m, t, d: tp.TPExecutor(MODEL_DIR, 2), "parallel"),
    "source int": (lambda m, t, d: tp.TPExecutor(5, tp.ParallelConfig(2)), "source"),
    "dtype int8": (lambda m, t, d: tp.TPExecutor(MODEL_DIR, tp.ParallelConfig(2),
                                                 dtype=torch.int8), "dtype"),
    "attention": (lambda m, t, d: tp.TPExecutor(MODEL_DIR, tp.ParallelConfig(2),
                                                attention="flash"), "attention"),
    "env without torchrun": (lambda m, t, d: tp.TPExecutor(
        MODEL_DIR, tp.ParallelConfig(2, distributed_init="env")), "distributed_init",
        dict(RANK="0", WORLD_SIZE="2")),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_are_parameter_errors_naming_them(bundled, tmp_path, monkeypatch, case):
    """Each bad argument is a ParameterError naming it, before any process starts."""
    import json
    model, tok = bundled
    config = json.loads((MODEL_DIR / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=5)))
    call, parameter, *env = BAD_ARGUMENTS[case]
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env[0] if env else {}).items():
        monkeypatch.setenv(name, value)
    before = children()
    with pytest.raises(ParameterError) as err:
        call(model, tok, tmp_path)
    assert err.value.parameter == parameter
    assert children() == before and not dist.is_initialized() and not tp._ACTIVE


def test_a_checkpoint_s03_refuses_is_refused_before_any_process(bundled, tmp_path):
    """A down projection of 400 columns where the config says 384 (each rank's slice of it
    would fit: before the fix, loaded silently): S03's CheckpointError from its header, in
    this process, no rank spawned. (tests/test_s18_layers.py checks each rule.)"""
    import shutil
    from safetensors.torch import load_file, save_file
    import s03_checkpoint
    tensors = load_file(str(MODEL_DIR / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(C, 400)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(MODEL_DIR / "config.json", tmp_path / "config.json")
    before = children()
    with pytest.raises(s03_checkpoint.CheckpointError, match=r"down_proj.weight has shape "
                                                             r"\[128, 400\]"):
        tp.TPExecutor(tmp_path, tp.ParallelConfig(2))
    with pytest.raises(s03_checkpoint.CheckpointError, match="down_proj"):
        tp.build_engine(bundled[0], bundled[1], tensor_parallel_size=2, checkpoint=tmp_path)
    assert children() == before and not dist.is_initialized() and not tp._ACTIVE


# --- one executor of 2 ranks, shared by the engines below -----------------------------------

def test_greedy_tokens_equal_s05s_alone(bundled, alone, executor):
    """4 requests together on 2 ranks (the shared-memory all-reduce where it runs: x86):
    each one's tokens are S05's alone; request 0 alone on the engine, the same. (HF's greedy
    tokens: tests/test_parity.py runs a TP = 2 engine in its chain, beside HF.)"""
    import platform
    assert len(executor.processes) == 1 and executor.processes[0].is_alive()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert executor.arena is not None
    engine = build(bundled, executor)
    assert isinstance(engine.runner, tp.TPRunner) and engine.runner.tensor_parallel_size == 2
    got = generate(engine)
    assert got == [alone(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert generate(engine, PROMPTS[:1], MAX_TOKENS[:1]) == got[:1]


def test_logits_within_the_tolerance_of_tp1_on_the_same_plans(bundled, alone, executor):
    """Every step of a chunked run (decodes alone, and beside prompt chunks): S13's
    one-process runner, with a pool of the same blocks, computes the plan first, then the 2
    ranks; the logits of the same rows within LOGITS_ATOL."""
    model, tok = bundled

    class Probe(RunnerWrapper):
        max_diff, steps = 0.0, 0

        def execute_model(self, plan, requests):
            want = reference.execute_model(plan, requests)
            got = self.runner.execute_model(plan, requests)
            assert got.req_ids == want.req_ids and got.logits.shape == want.logits.shape
            self.max_diff = max(self.max_diff, (got.logits - want.logits).abs().max().item())
            self.steps += 1
            return got

    options = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    engine = build(bundled, executor, **options)
    reference = s13.build_engine(model, tok, **options).runner
    assert reference.cache.num_blocks == engine.runner.cache.num_blocks
    engine.runner = probe = Probe(engine.runner)
    assert generate(engine) == [alone(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert probe.steps > 10
    assert 0 < probe.max_diff <= LOGITS_ATOL      # 0 would mean the ranks did not split


SCENARIOS = {
    # a budget of 8 tokens a step: prompts cut in chunks, beside decodes
    "chunked prefill": dict(max_num_batched_tokens=8),
    # 11 usable blocks for 26 blocks of work: requests are preempted and recomputed
    "preemption": dict(num_blocks=12, max_num_batched_tokens=8),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chunked_prefill_and_preemption_give_s05s_tokens(bundled, alone, executor, scenario):
    engine = build(bundled, executor, **SCENARIOS[scenario])
    engine.runner = steps = Steps(engine.runner)
    assert generate(engine) == [alone(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert any(done > 0 and n > 1 for p in steps.plans for done, n in p.values())  # chunks
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0, "nothing was preempted"


def test_a_prefix_cache_hit_gives_s05s_tokens(bundled, alone, executor):
    """The second prompt shares 27 tokens with the first, which has finished: its prefill on
    both ranks starts after the cached blocks (each rank's pool kept its half of them)."""
    engine = build(bundled, executor)
    engine.runner = steps = Steps(engine.runner)
    first = generate(engine, SHARED[:1], [8])
    before = len(steps.plans)
    second = generate(engine, SHARED[1:], [8])
    assert engine.scheduler.kv.stats.hits >= 16                  # at least 4 blocks of 4
    assert [first[0], second[0]] == [alone(p, 8) for p in SHARED]
    (start, n), = steps.plans[before].values()
    assert start >= 16 and n > 1


def test_one_step_does_one_plus_two_l_all_reduces_of_t_by_c(bundled, executor):
    """A prefill step of T tokens, then a decode step of 2: 13 all-reduces each (one for the
    embedding, two per layer), each of the (T, C) float32 hidden states."""
    engine = build(bundled, executor)
    engine.runner = steps = Steps(engine.runner)
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, greedy(4))
    for _ in range(2):
        executor.comm.reset_counts()
        engine.step()
        t_len = sum(n for _, n in steps.plans[-1].values())
        assert executor.comm.num_all_reduce == 1 + 2 * L
        assert executor.comm.all_reduce_bytes == (1 + 2 * L) * t_len * C * 4
    assert t_len == 2                                              # the decode step


def test_each_rank_holds_half_the_weights_and_a_pool_of_its_kv_heads(bundled, executor):
    """Rank 0's share: 2,891,776 weight bytes (every matrix halved, norms whole: counted by
    hand in tests/test_s18_layers.py); its pool holds 1 of the 2 KV heads (block 4, D 32), so
    it is half the one-process engine's of the same blocks."""
    model, tok = bundled
    assert executor.weight_bytes == 2_891_776
    engine = build(bundled, executor)
    cache = engine.runner.cache
    assert engine.runner.model.config.num_key_value_heads == 1
    assert tuple(cache.k.shape) == (L, cache.num_blocks, 4, 1, 32)
    whole = s13.build_engine(model, tok, block_size=4, max_num_seqs=4).runner.cache
    assert whole.num_blocks == cache.num_blocks and whole.nbytes == 2 * cache.nbytes


def test_an_executors_rules(bundled, alone, executor):
    """One executor per process; an engine on it runs its rank count; an engine attached later
    retires the earlier one."""
    model, tok = bundled
    before = children()
    with pytest.raises(ParameterError, match="one tensor-parallel executor per process"):
        tp.TPExecutor(MODEL_DIR, tp.ParallelConfig(2))
    with pytest.raises(ParameterError, match="the executor runs 2 ranks") as err:
        tp.build_engine(model, tok, executor=executor, tensor_parallel_size=4)
    assert err.value.parameter == "tensor_parallel_size"
    with pytest.raises(ParameterError, match="use tensor_parallel_size=1"):
        tp.build_engine(model, tok, executor=executor, batch_invariant=True)
    assert children() == before
    old, new = build(bundled, executor), build(bundled, executor)
    with pytest.raises(tp.WorkerError, match="a newer engine was attached"):
        generate(old, PROMPTS[:1], [2])
    assert generate(new, PROMPTS[3:], [4]) == [alone(PROMPTS[3], 4)]


def test_an_engine_runs_the_model_its_executor_holds(bundled, alone, executor):
    """build_engine(model, executor=ex) runs ex's model: a `model` of other weights, another
    config or dtype is refused (before: the executor's model ran in its place, silently), and
    so are the arguments that set up a new executor's ranks; attaching an engine twice is
    refused and leaves it running (its tokens S05's alone), as do a token id outside the
    vocabulary and a prompt longer than the context, refused at add_request as at N = 1."""
    model, tok = bundled
    before = children()
    for case, match in (("weights", "other weights"), ("config", "num_hidden_layers 6, "
                                                                 "model's 1"),
                        ("dtype", "bfloat16")):
        with pytest.raises(ParameterError, match=match) as err:
            tp.build_engine(other_model(model, case), tok, executor=executor)
        assert err.value.parameter == "executor"
    for name, value in (("checkpoint", MODEL_DIR), ("distributed_backend", "nccl"),
                        ("threads_per_rank", 2)):
        with pytest.raises(ParameterError, match="sets up a new executor's ranks") as err:
            tp.build_engine(model, tok, executor=executor, **{name: value})
        assert err.value.parameter == name
    engine = build(bundled, executor)
    with pytest.raises(ParameterError, match="already runs on a tensor-parallel executor"):
        executor.attach(engine)
    for prompt in ([1, 2, 2048], [-1], [7] * 257):         # V = 2048, context 256
        with pytest.raises(ParameterError) as err:
            engine.add_request(prompt, greedy(4))
        assert err.value.parameter == "prompt"
    assert generate(engine, PROMPTS[3:], [4]) == [alone(PROMPTS[3], 4)]
    assert children() == before


def test_shutdown_leaves_no_process_and_no_process_group(bundled, executor):
    engine = build(bundled, executor)
    processes = list(executor.processes)
    executor.shutdown()
    assert [(p.is_alive(), p.exitcode) for p in processes] == [(False, 0)]   # stopped, not killed
    assert not dist.is_initialized() and not tp._ACTIVE
    engine.add_request("O", greedy(2))
    with pytest.raises(tp.WorkerError, match="has stopped"):
        engine.step()
    executor.shutdown()                                              # idempotent


# --- executors of their own, after the shared one has stopped --------------------------------

def test_a_worker_error_names_its_rank_and_stops_every_rank(bundled):
    """Rank 1 gets no requests for a plan (so it raises KeyError): the caller gets WorkerError
    naming rank 1 with its error at once, every rank has exited, the process group is gone,
    and the engine's next step raises WorkerError too."""
    ex = tp.TPExecutor(MODEL_DIR, tp.ParallelConfig(2))
    try:
        engine = build(bundled, ex)
        engine.add_request(PROMPTS[0], greedy(4))
        plan = engine.scheduler.schedule()
        start = time.monotonic()
        with pytest.raises(tp.WorkerError, match=r"rank 1 raised KeyError"):
            ex.collective_rpc("execute_model", plan, {}, local_args=(plan, engine.requests))
        assert time.monotonic() - start < 10                       # noticed, not timed out
        assert all(not p.is_alive() and p.exitcode not in (None, 0) for p in ex.processes)
        assert not dist.is_initialized() and not tp._ACTIVE
        with pytest.raises(tp.WorkerError, match="rank 1"):
            engine.step()
    finally:
        ex.shutdown()


def test_main_on_gloo_ranks_prints_tp1s_completions(bundled, capsys):
    """The chapter script in this process after the failure above (a new executor starts):
    --tensor-parallel-size 2 with torch.distributed's gloo all-reduce prints S06's
    completions (TP = 1); when it returns, no rank is left."""
    model, tok = bundled
    prompts = PROMPTS[:2]
    before = children()
    argv = ["--tensor-parallel-size", "2", "--disable-custom-all-reduce", "--max-tokens", "8",
            "--device", "cpu"]
    for p in prompts:
        argv += ["--prompt", p]
    tp.main(argv)
    out = capsys.readouterr().out
    assert "tensor parallel: 2 ranks (gloo, all-reduce by gloo)" in out.splitlines()[0]
    assert "weights per rank 2.8 MiB of 5.5 MiB" in out.splitlines()[0]
    single = s06.Engine(model, tok)
    assert completions(out) == [(len(c.token_ids), c.finish_reason, c.text) for c in
                                (single.generate(p, greedy(8)) for p in prompts)]
    assert children() == before                    # main stopped the ranks it started
    assert not dist.is_initialized() and not tp._ACTIVE


def test_an_engines_own_ranks_go_with_the_engine(bundled):
    """An engine that made its executor (build_engine with tensor_parallel_size=2) takes its
    ranks with it when it is collected: no process, no process group, and a new one can
    start."""
    model, tok = bundled
    before = children()
    engine = tp.build_engine(model, tok, tensor_parallel_size=2, max_num_seqs=2)
    processes = list(engine.runner.executor.processes)
    assert children() - before
    del engine
    gc.collect()
    assert [p.exitcode for p in processes] == [0]  # stopped, not killed
    assert children() == before and not dist.is_initialized() and not tp._ACTIVE


@pytest.mark.gpu
def test_nccl_with_one_rank_gives_tp1s_tokens(bundled):
    """The smoke test a single GPU allows: NCCL with world size 1 (every collective a no-op
    on one rank) under S13's engine: the tokens of the one-process engine on the same GPU."""
    tok = bundled[1]
    model = s06.load(device="cuda", dtype="float32")[0]
    ex = tp.TPExecutor(MODEL_DIR, tp.ParallelConfig(1, backend="nccl"), "cuda", torch.float32)
    try:
        assert ex.backend == "nccl" and ex.model.device.type == "cuda"
        got = generate(build((model, tok), ex))
    finally:
        ex.shutdown()
    assert not dist.is_initialized()
    assert got == generate(tp.build_engine(model, tok, block_size=4, max_num_seqs=4))


# --- the chapter script, and processes outside this one --------------------------------------

LOOP = textwrap.dedent("""
    import sys
    sys.path.insert(0, {code!r})
    import torch
    import s06_torch as s06
    import s18_tensor_parallel as tp
    from s04_sampling import SamplingParams
    from s09_llm import LLM

    if __name__ == "__main__":
        torch.set_num_threads(1)
        model, tok = s06.load()
        engine = tp.build_engine(model, tok, tensor_parallel_size=2, block_size=16)
        llm = LLM(engine)
        llm.generate(["O"], SamplingParams(temperature=0.0, max_tokens=2))
        print("ready", *[p.pid for p in engine.runner.executor.processes], flush=True)
        sys.stdin.readline()                    # idle until told to go (ranks wait, no spin)
        while True:
            llm.generate(["To be"], SamplingParams(temperature=0.0, max_tokens=64,
                                                   ignore_eos=True))
""")


def test_torchrun_beside_a_spawned_run_then_ctrl_c(bundled, tmp_path):
    """Two runs of 2 ranks on one machine at the same time, each with its own rendezvous (no
    port in common): a script holds an engine on spawned ranks while the chapter script runs
    under torchrun (env://, gloo) and prints S06's completion (TP = 1); then the first script
    loops generating and gets SIGINT (Ctrl-C) mid-run: it exits, and its rank-1 process (the
    pid it printed) is gone."""
    model, tok = bundled
    prompt = "Ham.\nTo be"
    script = str(ROOT / "code" / "s18_tensor_parallel.py")
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
                "--nproc-per-node", "2", script, "--distributed-init", "env",
                "--max-tokens", "8", "--prompt", prompt, "--device", "cpu"]
    path = tmp_path / "loop.py"
    path.write_text(LOOP.format(code=str(ROOT / "code")))

    def start(argv):
        return subprocess.Popen(argv, cwd=ROOT, env=script_env(), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)

    runs = [start([sys.executable, str(path)])]
    loop = runs[0]
    try:
        line = loop.stdout.readline()
        assert line.startswith("ready "), (line, loop.stderr.read() if loop.poll() else "")
        workers = [int(pid) for pid in line.split()[1:]]
        assert len(workers) == 1 and not gone(workers[0])
        runs.append(start(torchrun))         # while the loop's store and ranks hold theirs
        run = runs[1]
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-3000:]
        single = s06.Engine(model, tok).generate(prompt, greedy(8))
        assert completions(out) == [(len(single.token_ids), single.finish_reason, single.text)]
        assert "tensor parallel: 2 ranks (gloo, all-reduce by gloo)" in out
        assert loop.poll() is None, "the looping run stopped on its own"
        loop.stdin.write("go\n")
        loop.stdin.flush()
        time.sleep(0.5)                                    # inside the loop's steps
        assert loop.poll() is None
        loop.send_signal(signal.SIGINT)
        loop.wait(timeout=30)
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert loop.returncode != 0                            # interrupted, not finished
    assert "KeyboardInterrupt" in loop.stderr.read()
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in workers), "a rank outlived Ctrl-C"


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1 (got 0)"),
    (["-tp", "3"], "--tensor-parallel-size: tensor_parallel_size=3: the 4 query heads must "
                   "divide by the rank count"),
    (["--threads-per-rank", "0"], "--threads-per-rank must be >= 1 (got 0)"),
    (["-tp", "2", "--batch-invariant"], "--batch-invariant runs each request alone every step"),
    (["-tp", "2", "--distributed-backend", "nccl"],
     "--distributed-backend: distributed_backend='nccl' needs CUDA"),
    (["-tp", "2", "--threads-per-rank", "2"],
     "--tensor-parallel-size: tensor_parallel_size=2 x threads_per_rank=2 needs 4 cores; this "
     "process may use 3"),
    (["--distributed-backend", "mpi"], "argument --distributed-backend: invalid choice: 'mpi'"),
    # flags that set up ranks, with one process (before: ignored silently; S19's rule)
    (["--distributed-backend", "gloo"], "--distributed-backend sets up the ranks of"),
    (["--threads-per-rank", "2"], "--threads-per-rank sets up the ranks of"),
    (["--disable-custom-all-reduce"], "--disable-custom-all-reduce sets up the ranks of"),
    # before: rank 0 ran 1 thread (--threads-per-rank's default), --threads ignored silently
    (["-tp", "2", "--threads", "2"], "--threads 2: with --tensor-parallel-size every rank"),
])
def test_bad_flags_are_usage_errors_before_a_model_loads(flags, message, capsys, monkeypatch):
    """Exit code 2 and a message naming the flag, before a model loads or a rank starts (a
    process given 3 cores, no CUDA)."""
    monkeypatch.setattr(s06, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(tp, "TPExecutor", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.setattr(tp, "usable_cores", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        tp.main([*flags, "--device", "cpu"])
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("env, flags, message", [
    # not under torchrun (before: KeyError 'MASTER_ADDR', a traceback)
    ({}, [], "--distributed-init env reads torchrun's RANK, WORLD_SIZE, MASTER_ADDR and "
             "MASTER_PORT, and RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="x"), [], "MASTER_ADDR, MASTER_PORT are not set"),
    # torchrun started 2 ranks (before: refused by build_engine after the executor started)
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"), ["-tp", "4"],
     "--tensor-parallel-size 4: torchrun started 2 ranks (WORLD_SIZE)"),
])
def test_distributed_init_env_needs_torchruns_variables(env, flags, message, capsys,
                                                        monkeypatch):
    """--distributed-init env: a usage error naming the flag and the variables, before a
    model loads or a rank starts."""
    monkeypatch.setattr(s06, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(tp, "TPExecutor", lambda *a, **k: pytest.fail("a rank was started"))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        tp.main(["--distributed-init", "env", *flags, "--device", "cpu"])
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flags", [["--distributed-backend", "nccl"], ["--threads-per-rank", "0"],
                                   ["--threads-per-rank", "x"]])
def test_a_torchrun_rank_refuses_bad_flags_in_one_line(flags, capsys, monkeypatch):
    """A rank > 0 under torchrun given a flag rank 0 refuses: exit code 2 and the rule in one
    line, before it joins (before: a ParameterError's traceback from every such rank)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tp, "run_worker", lambda *a, **k: pytest.fail("the rank joined"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tp._torchrun_worker([*flags, "--device", "cpu"], 1) == 2
    err = capsys.readouterr().err
    assert "rank 1: error:" in err and "Traceback" not in err and len(err.splitlines()) == 1
