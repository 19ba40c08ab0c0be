"""Tests for chapter S16's static decode steps (code/s16_static.py): buckets, persistent
buffers, the compiled step and CUDA graphs.

Oracles: S05's NumPy engine and S06's engine, each request alone (greedy tokens); S12's eager
`PagedRunner` (the runner the static one wraps) run on the same plan from the same KV state
(logits within ATOL, and the KV it writes); the same engine without static steps (S13's,
S15's); bucket lists written out by hand; dynamo's own counters and its error_on_recompile
switch. HF generate is left out here: S05 and S06 are compared with it on this model in
tests/test_s09_continuous_batching.py, and loading it costs some 4 s on this machine.

`Probe` is the workhorse: a runner wrapper (composition, as tests/engine_testing.py's) that
checks every static step as the engine runs it: its logits against the eager runner's, the
pool positions it changed, and the same bucket run again with other values in the padded
rows.

Time: one compiled engine per module (buckets 1 and 4, compiled by its first run), the rest
eager. Measured on the 2-core CPU (one torch thread, other jobs running): the compile takes
28-71 s cold and 6-13 s with inductor's on-disk cache warm; everything else about 12 s.
"""
import types

import pytest
import torch
from torch._dynamo.utils import counters

import s06_torch
import s09_continuous_batching as s09
import s10_scheduler as s10
import s13_prefix_caching as s13
import s14_kv_cache as s14kv
import s15_speculative as s15
import s16_host
import s16_static as s16
from engine_testing import RunnerWrapper, bundled_alone, drive, greedy, tokens_of
from s01_generation_loop import ParameterError
from s09_llm import LLM
from s12_engine import PagedRunner

# Float32 logits, the static step against S12's eager runner on the same plan and KV, the
# largest |difference| over every row of every step (the 64-token decode of PROMPTS),
# measured on this 2-core CPU with torch 2.13: 1.6e-5 eager "gather", 1.1e-5 eager "fused",
# 1.3e-5 compiled ("fused"); the logits themselves are of order 10. The two sum in other
# orders (the static step attends over the whole block table, masked). 1e-4: the module
# docstring's figure, 6x the largest measured.
ATOL = 1e-4
KV_ATOL = 3e-5          # keys and values written at the real slots (measured: 3.2e-6)

CITIZENS = ("First Citizen.\nBefore we proceed any further, hear me speak.\n\nAll.\nSpeak, "
            "speak.\n\nFirst Citizen.\nYou are all resolved rather to die than to famish?\n\n"
            "All.\nResolved. resolved.\n\nFirst Citizen.\nFirst, you know Caius Marcius is "
            "chief enemy to the people.\n")
LONG = CITIZENS * 2 + ("\nAll.\nWe know't, we know't.\n\nFirst Citizen.\nLet us kill him, and "
                       "we'll have corn at our own price.\n")      # 220 tokens: ends at 256
ROMEO = "Rom.\nBut soft! what light through yonder window breaks?"   # 17 tokens: 16 + 1
PROMPTS = ["Ham.\nTo be, or not to be, that is the question:", "O", ROMEO, LONG,
           "Hello world,"]
# staggered lengths: the batch shrinks 5 -> 4 -> 3 -> 2 -> 1 (LONG stops at the context)
MAX_TOKENS = [64, 24, 48, 64, 8]
SIZES = [1, 4]          # the compiled engine's buckets: 2 and 3 rows are padded to 4


@pytest.fixture(scope="module")
def bundled():
    return s06_torch.load()


@pytest.fixture(scope="module")
def alone(bundled):
    """alone(prompt, max_tokens): S05's greedy tokens for the request alone, checked against
    S06's (tests/engine_testing.py's `bundled_alone`)."""
    return bundled_alone(*bundled)


def generate(engine, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    done = LLM(engine).generate(list(prompts), [greedy(n, ignore_eos=True) for n in max_tokens])
    return [c.token_ids for c in done]


def expected(alone, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    return [alone(p, n) for p, n in zip(prompts, max_tokens)]


def real_slots(plan, block_size):
    """The pool slot each request of a decode plan writes (its position's): the test's own
    arithmetic from the plan's block tables."""
    slots = {}
    for rid, position in plan.num_computed_tokens.items():
        table = plan.block_tables[rid]
        slots[rid] = table[position // block_size] * block_size + position % block_size
    return slots


class Probe(RunnerWrapper):
    """Around a `StaticDecodeRunner` (`engine.runner = Probe(engine.runner)`). Logs every
    plan with whether the static step ran it (`log`: (plan, static)), and checks every
    static step:

    - logits: S12's eager runner (the static runner's `inner`) runs the same plan first,
      from the same KV; the KV is put back and the static step runs: every row within ATOL
      of the eager one (largest difference kept in `max_diff`);
    - the pool: every position the static step changed is a real row's slot or in the null
      block (block 0); each real row's slot changed in every layer, to within KV_ATOL of what
      the eager runner wrote there;
    - padding, when the bucket has padded rows: the bucket run again from the same KV with
      other values in the padded rows (other tokens, positions, slots and context lengths,
      all still in the null block): the real rows' logits and every block but the null one
      bitwise the same (`num_padded` counts these).
    """

    def __init__(self, runner):
        super().__init__(runner)
        self.log: list[tuple] = []
        self.max_diff = self.max_kv_diff = 0.0
        self.num_padded = 0

    def execute_model(self, plan, requests):
        static = self.runner
        counts = (static.num_static_steps, static.num_eager_steps)
        by_bucket = dict(static.steps_by_bucket)
        rows = static.static_rows(plan, requests) if plan.num_scheduled_tokens else None
        if rows is None:
            out = static.execute_model(plan, requests)
            assert (static.num_static_steps, static.num_eager_steps) == (counts[0],
                                                                         counts[1] + 1)
            assert static.steps_by_bucket == by_bucket
            self.log.append((plan, False))
            return out
        cache = static.cache
        with torch.inference_mode():
            if plan.new_block_ids:      # both runners zero them first: not the step's change
                cache.zero_blocks(plan.new_block_ids)
            k0, v0 = cache.k.clone(), cache.v.clone()
            eager = static.inner.execute_model(plan, requests)
            eager_logits = {rid: eager.logits[i].clone() for i, rid in enumerate(eager.req_ids)}
            k_eager, v_eager = cache.k.clone(), cache.v.clone()
            cache.k.copy_(k0)
            cache.v.copy_(v0)
        out = static.execute_model(plan, requests)
        self.log.append((plan, True))
        assert (static.num_static_steps, static.num_eager_steps) == (counts[0] + 1, counts[1])
        grown = {b: n - by_bucket.get(b, 0) for b, n in static.steps_by_bucket.items()
                 if n != by_bucket.get(b, 0)}
        bucket = min(s for s in static.sizes if s >= len(rows))      # the smallest that holds
        assert grown == {bucket: 1}, (grown, len(rows))
        assert out.req_ids == rows == list(plan.num_scheduled_tokens)
        assert sorted(eager_logits) == sorted(rows)
        assert out.logits.dtype == torch.float32
        assert out.logits.shape == (len(rows), static.vocab_size)
        assert out.num_draft_tokens == [0] * len(rows)
        diff = max((out.logits[i] - eager_logits[rid]).abs().max().item()
                   for i, rid in enumerate(rows))
        assert diff <= ATOL, diff
        self.max_diff = max(self.max_diff, diff)
        self.check_pool(plan, k0, v0, k_eager, v_eager)
        if bucket > len(rows):
            self.check_padding(len(rows), bucket, out.logits.clone(), k0, v0)
        return out

    def check_pool(self, plan, k0, v0, k_eager, v_eager):
        cache = self.runner.cache
        size = cache.block_size
        slots = set(real_slots(plan, size).values())
        assert all(s >= size for s in slots), "a real request holds block 0"
        changed = ((cache.k != k0) | (cache.v != v0)).flatten(3).any(-1)   # (L, blocks, bs)
        _, blocks, offsets = changed.nonzero(as_tuple=True)
        where = set((blocks * size + offsets).tolist())
        assert where <= slots | set(range(size)), sorted(where - slots)
        index = torch.tensor(sorted(slots), device=cache.k.device)
        assert changed.flatten(1, 2)[:, index].all()          # every layer wrote every row
        for pool, eager in ((cache.k, k_eager), (cache.v, v_eager)):
            diff = (pool.flatten(1, 2)[:, index] - eager.flatten(1, 2)[:, index]).abs().max()
            assert diff.item() <= KV_ATOL, diff
            self.max_kv_diff = max(self.max_kv_diff, diff.item())

    def check_padding(self, batch, bucket, logits, k0, v0):
        static = self.runner
        cache = static.cache
        size = cache.block_size
        # padding as prepared: in the null block
        assert static.block_tables[batch:bucket].eq(0).all()
        assert static.slot_mapping[batch:bucket].lt(size).all()
        assert static.context_lens[batch:bucket].ge(1).all()
        k1, v1 = cache.k.clone(), cache.v.clone()
        n = bucket - batch
        gen = torch.Generator().manual_seed(self.num_padded)
        other = dict(input_ids=torch.randint(static.vocab_size, (n,), generator=gen),
                     positions=torch.randint(cache.max_seq_len, (n,), generator=gen),
                     slot_mapping=torch.randint(size, (n,), generator=gen),
                     context_lens=torch.randint(1, size + 1, (n,), generator=gen))
        with torch.inference_mode():
            cache.k.copy_(k0)
            cache.v.copy_(v0)
            for name, values in other.items():
                getattr(static, name)[batch:bucket].copy_(values)
            again = static.run_bucket(bucket)
            assert torch.equal(again[:batch], logits)
            assert torch.equal(cache.k[:, 1:], k1[:, 1:])
            assert torch.equal(cache.v[:, 1:], v1[:, 1:])
            cache.k.copy_(k1)            # the state the engine's own step left
            cache.v.copy_(v1)
        self.num_padded += 1

    def ran(self, static: bool):
        return [plan for plan, was_static in self.log if was_static == static]


def probed(engine, **options):
    """engine with a `StaticDecodeRunner` (options) inside a `Probe`: (engine, probe)."""
    s16.make_static(engine, **options)
    probe = Probe(engine.runner)
    engine.runner = probe
    return engine, probe


def is_pure_decode(plan):
    """Every scheduled request computes one token and verifies no draft (the test's own
    rule; the runner's also asks that the token be the request's last)."""
    return all(n == 1 for n in plan.num_scheduled_tokens.values()) and not any(
        plan.scheduled_spec_decode_tokens.values())


# --- buckets ----------------------------------------------------------------------------------

SMALL = [1, 2, 4, 8]


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (8, SMALL), (9, SMALL + [16]), (16, SMALL + [16]),
    (17, SMALL + [16, 32]), (20, SMALL + [16, 32]), (48, SMALL + [16, 32, 48]),
    (100, SMALL + [16, 32, 48, 64, 80, 96, 112]),
    (512, SMALL + list(range(16, 513, 16))), (1000, SMALL + list(range(16, 513, 16)))])
def test_bucket_sizes_are_powers_of_two_then_multiples_of_16_up_to_the_first_that_holds(
        max_num_seqs, sizes):
    assert s16.bucket_sizes(max_num_seqs) == sizes
    assert s16.bucket_sizes(max_num_seqs)[-1] <= 512


def test_bucket_sizes_stop_at_largest():
    assert s16.bucket_sizes(100, largest=64) == SMALL + [16, 32, 48, 64]
    assert s16.bucket_sizes(5, largest=4) == [1, 2, 4]


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4", None])
def test_bucket_sizes_refuse_a_bad_max_num_seqs(bad):
    with pytest.raises(ParameterError) as err:
        s16.bucket_sizes(bad)
    assert err.value.parameter == "max_num_seqs"


@pytest.mark.parametrize("n, bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8),
                                       (9, None), (100, None)])
def test_pick_bucket_is_the_smallest_that_holds_n(n, bucket):
    assert s16.pick_bucket(SMALL, n) == bucket


def test_check_bucket_sizes_sorts_and_drops_repeats():
    assert s16.check_bucket_sizes([8, 1, 4, 8]) == [1, 4, 8]
    assert s16.check_bucket_sizes((512,)) == [512]
    assert s16.check_bucket_sizes(range(1, 4)) == [1, 2, 3]


@pytest.mark.parametrize("bad", [[], [0], [513], [1, 513], [-1], [True], [1, False], ["4"],
                                 [2.0], "124", b"1", 4, None, {}],
                         ids=lambda v: repr(v))
def test_check_bucket_sizes_refuses_and_names_cudagraph_capture_sizes(bad):
    with pytest.raises(ParameterError) as err:
        s16.check_bucket_sizes(bad)
    assert err.value.parameter == "cudagraph_capture_sizes"
    assert "cudagraph_capture_sizes" in str(err.value)


def test_check_bucket_sizes_of_an_iterator_is_its_sizes_or_an_error_never_empty():
    """An iterator is read once: the sizes it yields, or a ParameterError, never an empty
    list (a runner with no bucket fails later, at sizes[-1])."""
    try:
        sizes = s16.check_bucket_sizes(iter([4, 1, 4]))
    except ParameterError as err:
        assert err.parameter == "cudagraph_capture_sizes"
    else:
        assert sizes == [1, 4]


# --- the static step, eager -------------------------------------------------------------------

@pytest.mark.parametrize("form", s16.ATTENTION_FORMS)
def test_eager_static_steps_give_the_tokens_alone_and_the_eager_runners_logits(bundled, alone,
                                                                               form):
    """Five requests of 1 to 220 prompt tokens (one reaching the context's end), finishing at
    different steps: tokens equal S05 / S06 alone and S13's engine; decode steps static (each
    bucket it passed through), prefill eager; logits within ATOL of the eager runner's on the
    same plan and KV; padded rows inert; buffers updated in place."""
    model, tok = bundled
    assert max(len(tok.encode(p)) + n for p, n in zip(PROMPTS, MAX_TOKENS)) > 256
    plain = generate(s13.build_engine(model, tok, max_num_seqs=5))
    engine, probe = probed(s13.build_engine(model, tok, max_num_seqs=5), form=form)
    static = probe.runner
    assert isinstance(static, s16.StaticDecodeRunner) and isinstance(static.inner, PagedRunner)
    assert static.form == form and not static.compile and static.sizes == [1, 2, 4, 8]
    addresses = [t.data_ptr() for t in (static.input_ids, static.positions,
                                        static.slot_mapping, static.context_lens,
                                        static.block_tables)]
    got = generate(engine)
    assert got == expected(alone) == plain
    assert static.num_static_steps == len(probe.ran(True)) > 0
    assert static.num_eager_steps == len(probe.ran(False)) > 0
    assert all(is_pure_decode(plan) for plan in probe.ran(True))
    assert all(not is_pure_decode(plan) for plan in probe.ran(False))   # the prefill
    assert sum(static.steps_by_bucket.values()) == static.num_static_steps
    assert set(static.steps_by_bucket) == {1, 2, 4, 8}
    assert probe.num_padded > 0 and probe.max_diff <= ATOL
    assert [t.data_ptr() for t in (static.input_ids, static.positions, static.slot_mapping,
                                   static.context_lens, static.block_tables)] == addresses
    assert static.compile_times_s == {} and static.graphs == {}


@pytest.mark.parametrize("form", s16.ATTENTION_FORMS)
def test_padded_rows_are_inert_in_a_mostly_padded_bucket(bundled, alone, form):
    """Three requests in one bucket of 8 (five rows padding, then six, then seven): the
    Probe reruns each step with other padding; tokens equal those alone."""
    model, tok = bundled
    prompts, max_tokens = PROMPTS[:3], [12, 6, 9]
    engine = s13.build_engine(model, tok, max_num_seqs=3)
    engine.runner = Probe(s16.StaticDecodeRunner(engine.runner, [8], form=form))
    assert generate(engine, prompts, max_tokens) == expected(alone, prompts, max_tokens)
    assert engine.runner.steps_by_bucket == {8: engine.runner.num_padded} != {8: 0}


def test_static_decode_runner_reads_through_to_the_inner_runner(bundled):
    model, tok = bundled
    engine = s13.build_engine(model, tok, max_num_seqs=4)
    inner = engine.runner
    static = s16.make_static(engine).runner
    assert engine.runner is static and static.inner is inner
    assert (static.model, static.cache, static.vocab_size, static.batch_invariant,
            static.attention) == (inner.model, inner.cache, inner.vocab_size,
                                  inner.batch_invariant, inner.attention)
    assert static.sizes == [1, 2, 4] and static.form == "gather"     # eager default
    m = -(-inner.cache.max_seq_len // inner.cache.block_size)
    assert static.block_tables.shape == (4, m) and static.input_ids.shape == (4,)
    assert all(t.dtype == torch.int64 for t in (static.input_ids, static.positions,
                                                static.slot_mapping, static.context_lens,
                                                static.block_tables))


# --- fallbacks to the eager runner -------------------------------------------------------------

def test_a_batch_larger_than_the_largest_bucket_runs_eagerly(bundled, alone):
    model, tok = bundled
    prompts, max_tokens = PROMPTS[:4], [6, 10, 14, 18]
    engine = s13.build_engine(model, tok, max_num_seqs=4)
    engine.runner = probe = Probe(s16.StaticDecodeRunner(engine.runner, [1, 2]))
    assert generate(engine, prompts, max_tokens) == expected(alone, prompts, max_tokens)
    oversized = [p for p in probe.ran(False) if len(p.num_scheduled_tokens) > 2]
    assert len(oversized) >= 5 and all(is_pure_decode(p) for p in oversized[1:])
    assert all(len(p.num_scheduled_tokens) <= 2 for p in probe.ran(True))
    assert set(probe.runner.steps_by_bucket) == {1, 2}


def test_batch_invariant_mode_never_takes_the_static_path(bundled, alone):
    model, tok = bundled
    prompts, max_tokens = PROMPTS[:3], [10, 6, 8]
    engine, probe = probed(s13.build_engine(model, tok, max_num_seqs=3, batch_invariant=True))
    assert generate(engine, prompts, max_tokens) == expected(alone, prompts, max_tokens)
    assert probe.runner.num_static_steps == 0 and probe.runner.steps_by_bucket == {}
    assert probe.runner.num_eager_steps == len(probe.log) >= max(max_tokens)


def test_chunked_prefill_steps_run_eagerly_and_decode_steps_statically(bundled, alone):
    """A 220-token prompt arrives while two requests decode and is prefilled 16 tokens a
    step beside them: those mixed steps run eagerly, the pure decode steps statically."""
    model, tok = bundled
    prompts, max_tokens = [PROMPTS[0], PROMPTS[1], LONG], [40, 30, 12]
    engine, probe = probed(s13.build_engine(model, tok, max_num_seqs=3,
                                            max_num_batched_tokens=16))
    outputs, _ = drive(engine, [(p, greedy(n, ignore_eos=True))
                                for p, n in zip(prompts, max_tokens)], [0, 0, 3])
    assert [tokens_of(outputs[i]) for i in range(3)] == expected(alone, prompts, max_tokens)
    mixed = [p for p in probe.ran(False)
             if sorted(p.num_scheduled_tokens.values())[:2] == [1, 1]
             and max(p.num_scheduled_tokens.values()) > 1]
    assert len(mixed) >= 220 // 16
    assert probe.runner.num_static_steps > 0
    assert all(is_pure_decode(p) for p in probe.ran(True))


def test_a_prompt_found_in_the_prefix_cache_takes_its_first_step_statically(bundled, alone):
    """ROMEO is 16 + 1 tokens: asked again, its first block comes from the prefix cache and
    its one remaining prompt token is a decode-shaped step, run statically."""
    model, tok = bundled
    assert len(tok.encode(ROMEO)) % 16 == 1
    engine, probe = probed(s13.build_engine(model, tok, max_num_seqs=2))
    outputs, ids = drive(engine, [(ROMEO, greedy(10, ignore_eos=True))] * 2, [0, 3])
    assert [tokens_of(outputs[i]) for i in (0, 1)] == [alone(ROMEO, 10)] * 2
    assert any(ids[1] in p.scheduled_new_ids for p in probe.ran(True))


def test_speculative_steps_run_eagerly_with_the_same_tokens(bundled):
    """make_static on S15's n-gram engine: a step that verifies drafts runs the inner
    runner (the module docstring: "S15's draft verification run eagerly"); steps with
    nothing drafted run statically; the tokens are those of S15's engine without it."""
    model, tok = bundled
    prompts = ["All.\nSpeak, speak. Speak, speak. Speak, speak. Speak,", CITIZENS,
               "O Romeo, Romeo, O Romeo, Romeo, O Romeo,"]
    max_tokens = [30, 30, 30]

    def build():
        return s15.build_engine(model, tok, speculative="ngram", num_speculative_tokens=3,
                                max_num_seqs=3)

    plain = generate(build(), prompts, max_tokens)
    engine, probe = probed(build())
    assert generate(engine, prompts, max_tokens) == plain
    drafted = [p for p, _ in probe.log if any(p.scheduled_spec_decode_tokens.values())]
    assert drafted and all(not static for p, static in probe.log
                           if any(p.scheduled_spec_decode_tokens.values()))
    assert all(is_pure_decode(p) for p in probe.ran(True))
    assert probe.runner.num_static_steps > 0        # here: the steps no n-gram matched in


# --- bad input ---------------------------------------------------------------------------------

def never_built(*args, **options):
    raise AssertionError("the builder ran: the option should have been refused first")


def test_cuda_graphs_on_the_cpu_is_refused_before_anything_is_built(bundled):
    model, tok = bundled
    assert model.device.type == "cpu"
    with pytest.raises(ParameterError) as err:
        s16_host.build_engine(model, tok, cuda_graphs=True, builder=never_built)
    assert err.value.parameter == "cuda_graphs" and "CUDA" in str(err.value)
    engine = s13.build_engine(model, tok, max_num_seqs=2)
    runner = engine.runner
    with pytest.raises(ParameterError) as err:
        s16.make_static(engine, cuda_graphs=True)
    assert err.value.parameter == "cuda_graphs" and engine.runner is runner
    with pytest.raises(ParameterError) as err:
        s16.check_cuda_graphs_available(torch.device("cpu"))
    assert err.value.parameter == "cuda_graphs"


def test_compile_without_a_cxx_compiler_is_refused_before_anything_is_built(bundled,
                                                                            monkeypatch):
    model, tok = bundled
    engine = s13.build_engine(model, tok, max_num_seqs=2)
    runner = engine.runner
    monkeypatch.setattr(s16, "find_cxx", lambda: None)
    with pytest.raises(ParameterError) as err:
        s16_host.build_engine(model, tok, compile=True, builder=never_built)
    assert err.value.parameter == "compile" and "C++ compiler" in str(err.value)
    with pytest.raises(ParameterError) as err:
        s16.make_static(engine, compile=True)
    assert err.value.parameter == "compile" and engine.runner is runner


def test_find_cxx_looks_at_cxx_then_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))          # nothing on it
    monkeypatch.delenv("CXX", raising=False)
    assert s16.find_cxx() is None
    with pytest.raises(ParameterError) as err:
        s16.check_compile_available(torch.device("cpu"))
    assert err.value.parameter == "compile"
    fake = tmp_path / "my-c++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", "my-c++")
    assert s16.find_cxx() == str(fake)
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert s16.find_cxx() is None                      # $CXX named: PATH's g++ not tried


def test_compile_on_cuda_without_triton_is_refused(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "triton", None)   # import triton raises ImportError
    with pytest.raises(ParameterError) as err:
        s16.check_compile_available(torch.device("cuda"))
    assert err.value.parameter == "compile" and "Triton" in str(err.value)


def test_a_runner_that_is_not_paged_is_refused(bundled, monkeypatch):
    model, tok = bundled
    monkeypatch.setattr(s16, "find_cxx", lambda: "/usr/bin/c++")   # refused before compiling
    for build in (s09.build_engine, s10.build_engine):
        engine = build(model, tok, max_num_seqs=2)
        runner = engine.runner
        with pytest.raises(ParameterError) as err:
            s16.make_static(engine)
        assert err.value.parameter == "runner" and engine.runner is runner
    with pytest.raises(ParameterError) as err:
        s16_host.build_engine(model, tok, compile=True, builder=s09.build_engine,
                              max_num_seqs=2)
    assert err.value.parameter == "runner"


def test_s14s_8_bit_kv_pool_is_refused(bundled, monkeypatch):
    model, tok = bundled
    monkeypatch.setattr(s16, "find_cxx", lambda: "/usr/bin/c++")   # refused before compiling
    engine = s14kv.build_engine(model, tok, kv_cache_dtype="int8", max_num_seqs=2)
    with pytest.raises(ParameterError) as err:
        s16.make_static(engine)
    assert err.value.parameter == "kv_cache_dtype"
    with pytest.raises(ParameterError) as err:
        s16_host.build_engine(model, tok, compile=True, builder=s14kv.build_engine,
                              kv_cache_dtype="int8", max_num_seqs=2)
    assert err.value.parameter == "kv_cache_dtype"


@pytest.mark.parametrize("name, value", [("compile", "yes"), ("cuda_graphs", 1),
                                         ("async_scheduling", None)])
def test_build_engine_flags_must_be_bools(bundled, name, value):
    model, tok = bundled
    with pytest.raises(ParameterError) as err:
        s16_host.build_engine(model, tok, builder=never_built, **{name: value})
    assert err.value.parameter == name


def test_bad_sizes_and_form_are_refused(bundled):
    model, tok = bundled
    with pytest.raises(ParameterError) as err:
        s16_host.build_engine(model, tok, compile=True, cudagraph_capture_sizes=[0],
                              builder=never_built)
    assert err.value.parameter == "cudagraph_capture_sizes"
    engine = s13.build_engine(model, tok, max_num_seqs=2)
    with pytest.raises(ParameterError) as err:
        s16.make_static(engine, form="flash")
    assert err.value.parameter == "form"
    with pytest.raises(ParameterError) as err:
        s16.make_static(engine, sizes=[])
    assert err.value.parameter == "cudagraph_capture_sizes"
    assert isinstance(engine.runner, PagedRunner)


# --- compiled: one engine for the module ---------------------------------------------------------

needs_cxx = pytest.mark.skipif(s16.find_cxx() is None,
                               reason="torch.compile on the CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def compiled(bundled):
    """S16's build_engine with compile=True, buckets 1 and 4, max_num_seqs 5 (a batch of 5
    runs eagerly); its first run compiles the two buckets it uses. What dynamo's counters
    said before and after."""
    model, tok = bundled
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    # num_blocks: a pool shape of this module's own (enough for PROMPTS), so that no graph
    # another module compiled in the same process serves it and the count below is ours
    engine = s16_host.build_engine(model, tok, compile=True, cudagraph_capture_sizes=[4, 1],
                                   max_num_seqs=5, num_blocks=83)
    static = engine.runner
    # 4 rows (bucket 4), then 1 (bucket 1)
    generate(engine, PROMPTS[:4], [2, 2, 2, 4])
    return types.SimpleNamespace(engine=engine, static=static, breaks=breaks, graphs=graphs,
                                 warm_graphs=counters["stats"]["unique_graphs"],
                                 warm_times=dict(static.compile_times_s))


@needs_cxx
def test_compiled_runner_compiles_one_graph_per_bucket_on_first_use(compiled):
    static = compiled.static
    assert isinstance(static, s16.StaticDecodeRunner)
    assert static.compile and static.form == "fused" and static.sizes == SIZES
    assert set(compiled.warm_times) == {1, 4} and all(t > 0 for t in compiled.warm_times.values())
    assert compiled.warm_graphs - compiled.graphs == 2
    assert sum(counters["graph_break"].values()) == compiled.breaks


@needs_cxx
def test_compiled_tokens_equal_eager_and_alone_and_logits_within_atol(compiled, bundled,
                                                                      alone):
    """A 64-token decode of five requests: the batch of 5 (over the largest bucket) runs
    eagerly, then 4 and 3 rows in bucket 4 (padded), 2 in bucket 4, 1 in bucket 1; the
    Probe checks each static step against the eager runner and reruns padded buckets."""
    model, tok = bundled
    engine, static = compiled.engine, compiled.static
    plain = generate(s13.build_engine(model, tok, max_num_seqs=5))
    engine.runner = probe = Probe(static)
    try:
        got = generate(engine)
    finally:
        engine.runner = static
    assert got == plain == expected(alone)
    assert probe.max_diff <= ATOL and probe.num_padded > 0
    oversized = [p for p in probe.ran(False) if len(p.num_scheduled_tokens) == 5]
    assert len(oversized) == MAX_TOKENS[-1]         # the prefill, then 7 decode steps of 5
    assert {len(p.num_scheduled_tokens) for p in probe.ran(True)} == {1, 2, 3, 4}
    assert set(static.compile_times_s) == {1, 4}


@needs_cxx
def test_compiled_decode_of_64_tokens_never_recompiles_nor_breaks(compiled, alone):
    """With dynamo's error_on_recompile on: a 64-token decode passing through both buckets
    with every batch size and position, and warmup() of every bucket, raise nothing and add
    no graph; the compile times are those of the first use."""
    engine, static = compiled.engine, compiled.static
    steps = static.num_static_steps
    with torch._dynamo.config.patch(error_on_recompile=True):
        with torch.inference_mode(), pytest.raises(torch._dynamo.exc.RecompileError):
            static.prepare_padding(2)         # the switch is live: a new shape raises
            static.step_fn(*static.inputs(2))
        got = generate(engine)
        k, v = static.cache.k.clone(), static.cache.v.clone()
        assert static.warmup() == compiled.warm_times
    # warmup ran padding rows only: nothing but the null block changed
    assert torch.equal(static.cache.k[:, 1:], k[:, 1:])
    assert torch.equal(static.cache.v[:, 1:], v[:, 1:])
    assert got == expected(alone)
    assert static.num_static_steps - steps >= 64 - MAX_TOKENS[-1]
    assert counters["stats"]["unique_graphs"] == compiled.warm_graphs
    assert sum(counters["graph_break"].values()) == compiled.breaks
    assert static.compile_times_s == compiled.warm_times


# --- CUDA graphs (gpu) -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_cuda_graphs_replay_gives_the_eager_tokens_and_logits(compile):
    """On CUDA (float32): each bucket captured at construction (largest first), every
    static step a replay; tokens equal the eager engine's on the same device, logits
    within ATOL of the eager runner's, padded rows inert (the Probe)."""
    if compile:
        pytest.importorskip("triton")
    model, tok = s06_torch.load(device="cuda", dtype="float32")
    prompts, max_tokens = PROMPTS[:4], MAX_TOKENS[:4]
    plain = generate(s13.build_engine(model, tok, max_num_seqs=4), prompts, max_tokens)
    engine = s16_host.build_engine(model, tok, compile=compile, cuda_graphs=True,
                                   cudagraph_capture_sizes=[1, 2, 4], max_num_seqs=4)
    static = engine.runner
    assert set(static.graphs) == {1, 2, 4} and static.graph_pool is not None
    assert set(static.compile_times_s) == ({1, 2, 4} if compile else set())
    assert static.form == "gather"
    engine.runner = probe = Probe(static)
    assert generate(engine, prompts, max_tokens) == plain
    assert static.num_static_steps == len(probe.ran(True)) > 0
    assert set(static.steps_by_bucket) == {1, 2, 4} and probe.num_padded > 0
    assert probe.max_diff <= ATOL
