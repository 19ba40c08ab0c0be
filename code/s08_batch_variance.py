"""S08, batch variance: the fast batched mode against the batch-invariant reference, measured.

What is here
    A row computed in a batch of B and the same request computed alone differ in the last bits:
    a matrix product's summation order depends on how many rows it has (BLAS picks its
    blocking and kernels by shape), and floating-point addition is not associative. S08's
    engine has two modes (`s08_static_batching.py`): the fast one runs the whole block through
    every product; `batch_invariant=True` computes each row alone, with exactly the shapes the
    single-request S06 engine uses, so its logits are bitwise those of the request run alone.
    This module states how far the fast mode may drift from that reference, and measures it.

    - The rule (`follows_batch_rule`): a greedy request's tokens equal the reference's up to
      the first step where the reference's top-2 logit gap (`top2_gaps`, `first_close_call`)
      is under `BATCH_TOLERANCE`; from that step on a near-tie may flip. Later chapters hold
      their fast modes to the same rule (S09 to S13).
    - The measurement (`measure_batch_variance`): the same greedy requests in both modes, their
      raw logits compared step by step while the rows' tokens agree, one `VarianceRow` per B
      (largest logit difference, smallest top-2 gap, flips). The logits are recorded by
      `RecordingRunner`, a `BatchRunner` that keeps a host copy of each step's logits, plugged
      into an engine through its `runner_class` seam (`record_logits`): the engine is not
      subclassed and none of its methods is replaced.

What it does not handle
    Sampled requests: the rule is about greedy tokens (a seeded draw can land on the other side
    of a boundary too, but there is no gap to state a tolerance with). Kernels that make the
    fast mode itself batch-invariant (He et al.'s fix): the reference here is slow on purpose.
    The bfloat16 and float16 tolerances are S06's per-logit tolerances doubled, not measured
    for batches (see `BATCH_TOLERANCE`).

Run it
    python benchmarks/bench_s08_static_batching.py --quick      # its variance table, per B
    The notebook notebooks/s08_static_batching.ipynb measures B = 1 to 32 and plots it.

Tests
    tests/test_s08_static_batching.py: the rule by hand (gaps, a near-tie, a wide gap), the
    batch-invariant logits bitwise those of the request alone and cached logits equal to a full
    recompute (both read through `record_logits`), the fast mode following the rule on the tiny
    random models (CPU, and CUDA in float32 and bfloat16 where there is a GPU), and the
    measured table on the bundled model within the rule. tests/test_s08_properties.py:
    hypothesis over batch compositions, held to the rule.

References
    Thinking Machines, "Defeating Nondeterminism in LLM Inference" (He et al., 2025): the
    run-to-run differences of inference servers come mostly from batch variance, and
    batch-invariant kernels (matmul, RMSNorm, attention) remove it. Goldberg, "What Every
    Computer Scientist Should Know About Floating-Point Arithmetic" (1991) on why the
    summation order matters.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

import s01_generation_loop as s01
import s04_sampling as s04
import s06_torch as s06
from s08_static_batching import BatchRunner, Engine

# The fast mode's rule against the batch-invariant reference (`follows_batch_rule`): a greedy
# token may differ only from the first step where the reference's top-2 logit gap is below
# this. float32, measured on the CPU with `measure_batch_variance` (greedy, 12-16 tokens per
# request): the largest fast-vs-reference logit difference was 1.7e-5 on the bundled model
# (B = 8 to 64, logits up to about 20 in size) and 2.0e-6 on the tiny random models of the
# tests (B = 8 and 25, both attentions), so 1e-3 is over 50 times the most a logit moved.
# bfloat16 / float16: S06's stated per-logit tolerances against float32, doubled (not
# measured for batches here: no GPU on the machine this was written on).
BATCH_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.04}


# ---------------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------------

def top2_gaps(completion: s01.Completion) -> list[float]:
    """Per generated token, the gap between the two most likely tokens' logprobs, which is the
    gap between their logits (log-softmax subtracts the same number from both). Needs a
    request made with logprobs >= 2. Raises ValueError otherwise."""
    if completion.logprobs is None or any(len(lp.top_logprobs) < 2 for lp in completion.logprobs):
        raise ValueError("top2_gaps needs a completion made with logprobs >= 2")
    return [lp.top_logprobs[0][1] - lp.top_logprobs[1][1] for lp in completion.logprobs]


def first_close_call(gaps: Sequence[float], tolerance: float) -> int:
    """The first step whose top-2 gap is below tolerance (len(gaps) if none is)."""
    return next((i for i, gap in enumerate(gaps) if gap < tolerance), len(gaps))


def follows_batch_rule(fast: s01.Completion, reference: s01.Completion,
                       tolerance: float = BATCH_TOLERANCE[torch.float32],
                       reference_gaps: Sequence[float] | None = None) -> bool:
    """The rule the fast mode is held to against the batch-invariant reference, for a greedy
    request: its tokens equal the reference's up to (not including) the first step k where
    the reference's top-2 logit gap is below `tolerance`; from step k on they may differ (a
    near-tie can flip when logits move by rounding). With no such step, the whole completions
    are equal (ids, text, finish_reason, stop_reason).

    reference_gaps: the reference's gaps per step (default `top2_gaps(reference)`, which needs
    logprobs >= 2). For greedy with penalties, take gaps of the processed logits
    (logprobs_mode="processed_logprobs"), the row whose argmax was taken.
    """
    gaps = top2_gaps(reference) if reference_gaps is None else list(reference_gaps)
    k = first_close_call(gaps, tolerance)
    if k == len(gaps):
        return (fast.token_ids, fast.text, fast.finish_reason, fast.stop_reason) == (
            reference.token_ids, reference.text, reference.finish_reason, reference.stop_reason)
    return fast.token_ids[:k] == reference.token_ids[:k]


# ---------------------------------------------------------------------------------------------
# Recording the logits: a runner, plugged in through the engine's runner_class seam
# ---------------------------------------------------------------------------------------------

class RecordingRunner(BatchRunner):
    """A `BatchRunner` that appends a host copy of every step's raw logits, float32 (B, V), to
    `recorded` (a list it is given, so the copies outlive the batch's runner): for measuring
    batch variance, never for serving."""

    def __init__(self, *args, recorded: list[torch.Tensor], **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded = recorded

    def step(self, ids: torch.Tensor, positions: torch.Tensor,
             active: Sequence[bool] | None) -> torch.Tensor:
        logits = super().step(ids, positions, active)                       # (B, V)
        self.recorded.append(logits.detach().float().cpu().clone())
        return logits


def record_logits(engine: Engine) -> list[torch.Tensor]:
    """From now on, every batch `engine` runs keeps a host copy of each step's raw logits,
    float32 (B, V), in the returned list, in step order (the prefill first). Sets the engine's
    `runner_class` seam on this instance (its class and methods are untouched)."""
    recorded: list[torch.Tensor] = []
    engine.runner_class = functools.partial(RecordingRunner, recorded=recorded)
    return recorded


# ---------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VarianceRow:
    """Fast vs batch-invariant reference on one batch of B greedy requests.

    max_abs_diff: the largest |logit difference| over every row and step compared (a row's
    steps are compared while its tokens so far agree, so both saw the same inputs);
    min_gap: the smallest top-2 logit gap of the reference over the same steps; flips:
    compared steps whose argmax differs; rows_equal: rows whose whole token lists agree;
    rule_holds: every row follows `follows_batch_rule` at `tolerance`.
    """

    batch_size: int
    steps_compared: int
    max_abs_diff: float
    min_gap: float
    flips: int
    rows_equal: int
    rule_holds: bool
    tolerance: float

    @property
    def can_flip(self) -> bool:
        """A flip needs two logits to cross: possible once a gap is under twice the largest
        difference seen."""
        return self.min_gap < 2 * self.max_abs_diff


def measure_batch_variance(model: s06.TorchTransformer, tokenizer, prompts: Sequence[str],
                           batch_sizes: Sequence[int], max_tokens: int = 16,
                           tolerance: float | None = None) -> list[VarianceRow]:
    """For each B, the first B prompts (cycled when there are fewer) run greedily (EOS ignored,
    so every row makes max_tokens tokens) in the fast mode and in the batch-invariant mode on
    the same model; their logits compared step by step (see `VarianceRow`)."""
    tolerance = BATCH_TOLERANCE.get(model.dtype, 0.2) if tolerance is None else tolerance
    params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=2)
    table = []
    for batch_size in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        results = {}
        for invariant in (False, True):
            engine = Engine(model, tokenizer, max_batch_size=batch_size,
                            batch_invariant=invariant)
            recorded = record_logits(engine)
            results[invariant] = (engine.generate(batch, params), recorded)
        (fast, fast_logits), (ref, ref_logits) = results[False], results[True]
        diff, gap, flips, compared = 0.0, float("inf"), 0, 0
        for row, (f, r) in enumerate(zip(fast, ref)):
            for step in range(min(len(f.token_ids), len(r.token_ids))):
                if f.token_ids[:step] != r.token_ids[:step]:
                    break
                a, b = fast_logits[step][row], ref_logits[step][row]
                diff = max(diff, float((a - b).abs().max()))
                top2 = torch.topk(b, 2).values
                gap = min(gap, float(top2[0] - top2[1]))
                flips += int(a.argmax() != b.argmax())
                compared += 1
        table.append(VarianceRow(batch_size, compared, diff, gap, flips,
                                 sum(f.token_ids == r.token_ids for f, r in zip(fast, ref)),
                                 all(follows_batch_rule(f, r, tolerance)
                                     for f, r in zip(fast, ref)), tolerance))
    return table


def format_variance_table(table: Sequence[VarianceRow]) -> str:
    """The `VarianceRow`s as aligned text, one line per B."""
    lines = [f"{'B':>4} {'steps':>6} {'max |dlogit|':>13} {'min top-2 gap':>14} {'flips':>6} "
             f"{'rows equal':>11} {'rule holds':>11}"]
    for r in table:
        lines.append(f"{r.batch_size:>4} {r.steps_compared:>6} {r.max_abs_diff:>13.2e} "
                     f"{r.min_gap:>14.2e} {r.flips:>6} {r.rows_equal:>5}/{r.batch_size:<5} "
                     f"{str(r.rule_holds):>11}")
    return "\n".join(lines)
