"""Tests for S17's attention backends (code/s17_attention.py): the engine with each backend,
the analytic traffic table, bad input and the chapter script.

Oracles: S05's NumPy engine and S06's engine, each request alone (greedy tokens, EOS ignored);
S12's eager `PagedRunner` (the "gather" backend, the runner `KernelRunner` wraps) run on the
same plan (logits within 1e-4); byte counts worked out by hand in the comments. HF generate is
left out here: S05 and S06 are compared with it on this model in
tests/test_s09_continuous_batching.py.

The model is the bundled one (6 layers, 4 query heads, 2 KV heads, head_dim 32), loaded once.
Blocks of 4 tokens, so every context here spans several blocks, its last one partial. Each
engine run takes about 0.1 s; the triton backend runs once, under Triton's interpreter (about
2 s), and is skipped where code/s17_triton.py cannot run on the CPU.
"""
import re
import types

import pytest
import torch

import s06_torch as s06
import s13_prefix_caching as s13
import s14_kv_cache as s14kv
import s15_speculative as s15
import s16_async
import s16_static
import s17_attention as s17
import s17_cpu
from engine_testing import RunnerWrapper, bundled_alone, greedy
from s01_generation_loop import ParameterError
from s09_llm import LLM
from s12_engine import PagedRunner

# Float32 logits of a kernel backend against S12's gather on the same plan: they add in other
# orders (the C kernel's 2^x is a polynomial good to ~1e-7). Measured on the course's CPU over
# every step of the chunked run below: 8.6e-6 (sdpa), 9.5e-6 (paged); the logits are of order
# 10. 1e-4: the bound S16 uses for its static step against the same runner.
LOGITS_ATOL = 1e-4
PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING HENRY.\nOnce more unto the breach", "O"]
MAX_TOKENS = [24, 16, 20, 12]          # contexts 29, 23, 30, 13: 8, 6, 8 and 4 blocks of 4
PREFIX = ("First Citizen.\nBefore we proceed any further, hear me speak.\n\nAll.\nSpeak, "
          "speak.\n\n")                                         # 27 tokens: 6 full blocks
SHARED = [PREFIX + "First Citizen.\nYou", PREFIX + "All.\nResolved"]
KERNEL_BACKENDS = ("sdpa", "paged")
COMPLETION = re.compile(r"--- completion \((\d+) tokens, finish_reason=(\w+)\) ---\n(.*?)"
                        r"(?=\n\n--- (?:request|\d+ tokens in))", re.DOTALL)
needs_cc = pytest.mark.skipif(s17_cpu.find_cc() is None, reason="the paged kernel needs a C "
                                                                "compiler")


@pytest.fixture(scope="module")
def bundled():
    return s06.load()


@pytest.fixture(scope="module")
def alone(bundled):
    """alone(prompt, max_tokens): S05's greedy tokens for the request alone, checked against
    S06's (tests/engine_testing.py's `bundled_alone`)."""
    return bundled_alone(*bundled)


def build(bundled, backend, **options):
    model, tok = bundled
    options = dict(dict(block_size=4, max_num_seqs=4), **options)
    return s17.build_engine(model, tok, attention_backend=backend, **options)


def generate(engine, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    done = LLM(engine).generate(list(prompts), [greedy(n, ignore_eos=True) for n in max_tokens])
    return [c.token_ids for c in done]


def runnable(backend):
    """The backends this machine runs without Triton (paged: with a C compiler)."""
    return pytest.param(backend, marks=needs_cc) if backend == "paged" else backend


class Steps(RunnerWrapper):
    """Records each plan's (tokens computed before, tokens scheduled) per request, and how
    many draft tokens (S15) its requests verify."""

    def __init__(self, runner):
        super().__init__(runner)
        self.plans: list[dict[str, tuple[int, int]]] = []
        self.drafts = 0

    def execute_model(self, plan, requests):
        self.plans.append({rid: (plan.num_computed_tokens[rid], n)
                           for rid, n in plan.num_scheduled_tokens.items()})
        self.drafts += sum(map(len, plan.scheduled_spec_decode_tokens.values()))
        return self.runner.execute_model(plan, requests)

    def chunks_after_cached(self) -> int:
        """Rows of several tokens after cached positions (the bottom-right causal case)."""
        return sum(1 for p in self.plans for done, n in p.values() if done > 0 and n > 1)

    def mixed(self) -> int:
        """Steps with decodes and prompt chunks together."""
        return sum(1 for p in self.plans
                   if any(n == 1 for _, n in p.values()) and any(n > 1 for _, n in p.values()))


# --- greedy tokens ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [runnable(b) for b in ("gather", "sdpa", "paged")])
def test_each_backend_gives_s05s_tokens_alone_and_in_a_batch(bundled, alone, backend):
    """4 requests together, contexts to 30 tokens in blocks of 4: every request's greedy
    tokens are S05's alone; request 0 run alone on the same engine gets the same tokens as in
    the batch of 4 (independent of its neighbours)."""
    engine = build(bundled, backend)
    if backend == "gather":
        assert type(engine.runner) is PagedRunner
    else:
        assert isinstance(engine.runner, s17.KernelRunner)
        assert engine.runner.backend.name == backend
    got = generate(engine)
    assert got == [alone(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert generate(engine, PROMPTS[:1], MAX_TOKENS[:1]) == got[:1]


SCENARIOS = {
    # a budget of 8 tokens a step: the 10-token prompt is cut in chunks, beside decodes
    "chunked prefill": dict(max_num_batched_tokens=8),
    # 11 usable blocks for 26 blocks of work: requests are preempted and recomputed
    "preemption": dict(num_blocks=12, max_num_batched_tokens=8),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("backend", [runnable(b) for b in ("gather",) + KERNEL_BACKENDS])
def test_chunked_prefill_and_preemption_give_s05s_tokens(bundled, alone, backend, scenario):
    """Each backend, the gather included, gives S05's tokens alone (so all give the same),
    with chunks after cached positions beside decodes in one step; preemption happened."""
    engine = build(bundled, backend, **SCENARIOS[scenario])
    engine.runner = steps = Steps(engine.runner)
    assert generate(engine) == [alone(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert steps.chunks_after_cached() > 0 and steps.mixed() > 0
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0, "nothing was preempted"


@pytest.mark.parametrize("backend", [runnable(b) for b in ("gather",) + KERNEL_BACKENDS])
def test_a_prefix_cache_hit_gives_s05s_tokens(bundled, alone, backend):
    """S13's builder (prefix caching on by default): the second prompt shares 27 tokens with
    the first, which has finished; its prefill is a chunk after the cached blocks."""
    engine = build(bundled, backend)
    engine.runner = steps = Steps(engine.runner)
    first = generate(engine, SHARED[:1], [8])
    assert engine.scheduler.kv.stats.hits == 0
    before = len(steps.plans)
    second = generate(engine, SHARED[1:], [8])
    assert engine.scheduler.kv.stats.hits >= 16                  # at least 4 blocks of 4
    assert [first[0], second[0]] == [alone(p, 8) for p in SHARED]
    (start, n), = steps.plans[before].values()                   # the second prompt's prefill
    assert start >= 16 and n > 1 and start + n == len(bundled[1].encode(SHARED[1]))


@needs_cc
def test_s15s_drafts_are_attended_as_chunks(bundled, alone):
    """S15's builder (n-gram drafts) with the paged kernel: a verify step's rows (the token
    and its drafts) are a chunk after cached positions; greedy tokens are still S05's."""
    model, tok = bundled
    prompts = [PREFIX, "To be, or not to be, to be, or not to be"]
    engine = s17.build_engine(model, tok, attention_backend="paged", builder=s15.build_engine,
                              block_size=4, max_num_seqs=2)
    assert isinstance(engine.runner, s17.KernelRunner)
    engine.runner = steps = Steps(engine.runner)
    assert generate(engine, prompts, [16, 16]) == [alone(p, 16) for p in prompts]
    assert steps.drafts > 0, "no draft was verified"


@pytest.mark.parametrize("backend", [runnable(b) for b in KERNEL_BACKENDS])
def test_logits_equal_the_gathers_on_the_same_plan(bundled, alone, backend):
    """Every step of a chunked run (decodes alone, and decodes beside prompt chunks): S12's
    runner (`inner`) computes the plan first, then the backend; logits of the same rows within
    1e-4. (Both write the step's keys and values; the second write is the same tokens in the
    same slots.)"""

    class Probe(RunnerWrapper):
        max_diff, decode_steps, mixed_steps = 0.0, 0, 0

        def execute_model(self, plan, requests):
            want = self.runner.inner.execute_model(plan, requests)
            got = self.runner.execute_model(plan, requests)
            assert got.req_ids == want.req_ids and got.logits.shape == want.logits.shape
            self.max_diff = max(self.max_diff, (got.logits - want.logits).abs().max().item())
            lens = list(plan.num_scheduled_tokens.values())
            self.decode_steps += all(n == 1 for n in lens)
            self.mixed_steps += 1 in lens and max(lens) > 1
            return got

    engine = build(bundled, backend, max_num_batched_tokens=8)
    engine.runner = probe = Probe(engine.runner)
    assert generate(engine) == [alone(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert probe.decode_steps > 0 and probe.mixed_steps > 0
    assert probe.max_diff <= LOGITS_ATOL


def test_the_triton_backend_under_the_interpreter(bundled, alone):
    """One tiny run (2 prompts, 4 tokens; the interpreter is slow) with split-K in the
    decodes: S05's tokens."""
    try:
        import s17_triton
    except ImportError as err:               # pragma: no cover - the module is the chapter's
        pytest.skip(f"code/s17_triton.py does not import: {err}")
    if not (s17_triton.TRITON_AVAILABLE and s17_triton.interpreted()):
        pytest.skip("Triton's interpreter is not on (no Triton, or a CUDA machine)")
    engine = build(bundled, "triton", num_splits=2)
    assert engine.runner.backend.name == "triton" and engine.runner.backend.num_splits == 2
    assert generate(engine, PROMPTS[:2], [4, 4]) == [alone(p, 4) for p in PROMPTS[:2]]


# --- the traffic table --------------------------------------------------------------------------

# H = 4, Hkv = 2, D = 32, float32, blocks of 16, two decoding requests at contexts 5 and 20.
# A position's key and value: 2 x 2 heads x 32 x 4 bytes = 512 bytes.
# q and out: 2 requests x 4 heads x 32 x 4 = 1024 bytes each (q_out 2048: 1024 read, 1024
# written); the new keys and values: 2 x 512 = 1024 written (kv_write) by every backend.
#   contiguous: each request's slot read to the longest context: 2 x 20 x 512 = 20480.
#     read 20480 + 1024 = 21504, written 1024 + 1024 = 2048.
#   sdpa: the copy takes 2 blocks (32 positions) per request: 2 x 32 x 512 = 32768 read from
#     the pool and written to the copy; the attention reads the copy to 20: 20480.
#     kv_copy 32768 + 20480 = 53248; read 32768 + 20480 + 1024 = 54272,
#     written 32768 + 1024 + 1024 = 34816.
#   gather: sdpa's, plus scores through memory four times (scores written and read, the
#     probabilities written and read): 4 x 2 x 4 heads x 20 x 4 bytes = 2560, half each way.
#     read 54272 + 1280 = 55552, written 34816 + 1280 = 36096.
#   paged (and triton): each request's own positions, 5 + 20 = 25 x 512 = 12800, and its
#     block-table entries, 1 + 2 blocks x 8 bytes = 24. read 12800 + 24 + 1024 = 13848,
#     written 2048.
HAND = {
    "contiguous": dict(read=21504, written=2048, kv_read=20480, kv_copy=0, scores=0, tables=0),
    "sdpa": dict(read=54272, written=34816, kv_read=32768, kv_copy=53248, scores=0, tables=0),
    "gather": dict(read=55552, written=36096, kv_read=32768, kv_copy=53248, scores=2560,
                   tables=0),
    "paged": dict(read=13848, written=2048, kv_read=12800, kv_copy=0, scores=0, tables=24),
    "triton": dict(read=13848, written=2048, kv_read=12800, kv_copy=0, scores=0, tables=24),
}


@pytest.mark.parametrize("backend", sorted(HAND))
def test_attention_traffic_equals_the_hand_counts(backend):
    got = s17.attention_traffic(backend, [5, 20], num_heads=4, num_kv_heads=2, head_dim=32,
                                block_size=16)
    want = dict(HAND[backend], kv_write=1024, q_out=2048)
    want["total"] = want["read"] + want["written"]
    assert got == want


def test_attention_traffic_orders_the_backends_for_a_ragged_batch():
    """Ragged contexts (a GPU-sized model, bfloat16): paged reads only what each request has
    < contiguous reads every slot to the longest < sdpa adds the copy < gather adds the scores.
    Equal contexts: paged is contiguous plus its block tables."""
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    totals = {b: s17.attention_traffic(b, [100, 3000, 7, 1500], **shape)["total"]
              for b in ("paged", "contiguous", "sdpa", "gather")}
    assert totals["paged"] < totals["contiguous"] < totals["sdpa"] < totals["gather"]
    paged = s17.attention_traffic("paged", [64, 64], **shape)
    contiguous = s17.attention_traffic("contiguous", [64, 64], **shape)
    assert paged["total"] - contiguous["total"] == paged["tables"] == 2 * 4 * 8


@pytest.mark.parametrize("backend, lens, parameter", [
    ("flash", [5], "backend"), ("paged", [], "context_lens"), ("sdpa", [4, 0], "context_lens")])
def test_attention_traffic_bad_input(backend, lens, parameter):
    with pytest.raises(ParameterError) as err:
        s17.attention_traffic(backend, lens, num_heads=4, num_kv_heads=2, head_dim=32)
    assert err.value.parameter == parameter


# --- bad input ----------------------------------------------------------------------------------

def stand_in(device="cpu", dtype=torch.float32):
    """What build_engine reads of a model before building (its device and dtype)."""
    return types.SimpleNamespace(device=torch.device(device), dtype=dtype)


@pytest.mark.parametrize("model, options, parameter", [
    (None, dict(attention_backend="flash"), "attention_backend"),
    (None, dict(attention_backend="paged", num_splits=2), "num_splits"),
    (None, dict(attention_backend="sdpa", num_splits=2), "num_splits"),
    (None, dict(attention_backend="triton", num_splits=0), "num_splits"),
    (None, dict(attention_backend="triton", num_splits=True), "num_splits"),
    (None, dict(attention_backend="triton", num_splits=1.0), "num_splits"),
    (stand_in(dtype=torch.float64), dict(attention_backend="paged"), "attention_backend"),
    (stand_in("cuda"), dict(attention_backend="paged"), "attention_backend"),
])
def test_build_engine_refuses_bad_options(bundled, model, options, parameter):
    with pytest.raises(ParameterError) as err:
        s17.build_engine(bundled[0] if model is None else model, bundled[1], **options)
    assert err.value.parameter == parameter, str(err.value)


def test_paged_refuses_a_bfloat16_model_and_s14s_8bit_pool(bundled):
    model, tok = s06.load(dtype="bfloat16")
    with pytest.raises(ParameterError, match="float32") as err:
        s17.build_engine(model, tok, attention_backend="paged")
    assert err.value.parameter == "attention_backend"
    with pytest.raises(ParameterError, match="float32"):      # an engine built already
        s17.use_backend(s13.build_engine(model, tok), "paged")
    for backend in KERNEL_BACKENDS:
        with pytest.raises(ParameterError, match="8-bit") as err:
            s17.build_engine(*bundled, attention_backend=backend, builder=s14kv.build_engine,
                             kv_cache_dtype="int8")
        assert err.value.parameter == "attention_backend"


def test_use_backend_refuses_engines_without_s12s_runner(bundled):
    """Async scheduling's engine, S16's static runner, an engine already given a backend, an
    unknown name: each refused, naming attention_backend; "gather" leaves an engine as is."""
    model, tok = bundled
    engine = s16_async.make_async(s13.build_engine(model, tok))
    try:
        with pytest.raises(ParameterError) as err:
            s17.use_backend(engine, "sdpa")
        assert err.value.parameter == "attention_backend"
    finally:
        engine.shutdown()
    static = s16_static.make_static(s13.build_engine(model, tok))
    runner = static.runner
    assert s17.use_backend(static, "gather") is static and static.runner is runner
    for name in KERNEL_BACKENDS:
        with pytest.raises(ParameterError, match="static") as err:
            s17.use_backend(static, name)
        assert err.value.parameter == "attention_backend" and static.runner is runner
    with pytest.raises(ParameterError) as err:
        s17.KernelRunner(runner, None)
    assert err.value.parameter == "attention_backend"
    twice = s17.build_engine(model, tok, attention_backend="sdpa")
    for name in ("sdpa", "flash"):
        with pytest.raises(ParameterError) as err:
            s17.use_backend(twice, name)
        assert err.value.parameter == "attention_backend"


def test_a_missing_compiler_or_triton_is_an_error_naming_the_backend(bundled, monkeypatch):
    monkeypatch.setattr(s17_cpu, "find_cc", lambda: None)
    monkeypatch.setattr(s17_cpu, "_library", None)     # put back after the test
    with pytest.raises(ParameterError, match="C compiler") as err:
        s17.build_engine(*bundled, attention_backend="paged")
    assert err.value.parameter == "attention_backend"
    try:
        import s17_triton
    except ImportError:                      # pragma: no cover
        return
    monkeypatch.setattr(s17_triton, "TRITON_AVAILABLE", False)
    with pytest.raises(ParameterError, match="needs Triton") as err:
        s17.build_engine(*bundled, attention_backend="triton")
    assert err.value.parameter == "attention_backend"


# --- the chapter script -------------------------------------------------------------------------

@needs_cc
def test_main_with_the_paged_backend_prints_s06s_completions_and_the_table(bundled, capsys):
    model, tok = bundled
    prompts = PROMPTS[:2]
    argv = ["--attention-backend", "paged", "--max-tokens", "4", "--device", "cpu",
            "--threads", "1"]
    for p in prompts:
        argv += ["--prompt", p]
    s17.main(argv)
    out = capsys.readouterr().out
    assert "attention backend paged; KV pool of" in out.splitlines()[0]
    s06_engine = s06.Engine(model, tok)
    want = []
    for p in prompts:
        done = s06_engine.generate(p, greedy(4))
        want.append((len(done.token_ids), done.finish_reason, done.text))
    got = [(int(n), reason, text) for n, reason, text in COMPLETION.findall(out)]
    assert got == want
    assert re.search(r"\n--- 8 tokens in \d+ steps", out)
    assert re.search(r"^ step +tokens running", out, re.MULTILINE)


@pytest.mark.parametrize("flags, message", [
    (["--num-splits", "2"], "--num-splits is the triton backend's split-K: add "
                            "--attention-backend triton"),
    (["--attention-backend", "sdpa", "--num-splits", "3"], "--num-splits is the triton"),
    (["--num-splits", "0"], "--num-splits must be >= 1 (got 0)"),
    (["--attention-backend", "flash"], "argument --attention-backend: invalid choice: 'flash'"),
])
def test_bad_flags_are_usage_errors_before_a_model_loads(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(s06, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        s17.main([*flags, "--device", "cpu"])
    assert stop.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_paged_on_cuda_or_without_a_compiler_is_a_usage_error(capsys, monkeypatch):
    """--device cuda with the paged backend (the device check made to pass here, so the
    backend's rule is reached on a CPU-only machine), and no C compiler."""
    monkeypatch.setattr(s06, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(s06, "resolve_device_dtype",
                        lambda device=None, dtype=None: (torch.device(device or "cpu"),
                                                         torch.float32))
    with pytest.raises(SystemExit) as stop:
        s17.main(["--attention-backend", "paged", "--device", "cuda"])
    assert stop.value.code == 2
    assert "--attention-backend paged is the CPU's C kernel" in capsys.readouterr().err
    monkeypatch.setattr(s17_cpu, "find_cc", lambda: None)
    with pytest.raises(SystemExit) as stop:
        s17.main(["--attention-backend", "paged", "--device", "cpu"])
    assert stop.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--attention-backend paged builds a C kernel" in err and "Traceback" not in err


def test_paged_with_a_bfloat16_model_is_a_usage_error_after_it_loads(capsys):
    with pytest.raises(SystemExit) as stop:
        s17.main(["--attention-backend", "paged", "--dtype", "bfloat16", "--device", "cpu",
                  "--max-tokens", "2", "--prompt", "O"])
    assert stop.value.code == 2
    assert "attention_backend='paged' reads float32" in capsys.readouterr().err


def test_help_names_the_backends_and_the_defaults(capsys):
    with pytest.raises(SystemExit) as stop:
        s17.main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--attention-backend {gather,sdpa,paged,triton}" in text
    assert "--num-splits NUM_SPLITS" in text
    assert text.count("(default: ") >= 2 and "(default: gather)" in text
