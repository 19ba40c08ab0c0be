r"""S15, speculative decoding: a draft proposes, the target verifies in one pass.

What is new since S14
    A decode step reads every weight of the model to make one token per request. When that
    read is the cost (decode is bandwidth-bound, S07), the target can check several tokens in
    the same pass: a cheap *proposer* guesses the next k tokens, the target runs once over
    [last token] + k drafts (S11's chunk path: several tokens at an offset) and returns logits
    for every position, and a *rejection sampler* keeps the drafts the target agrees with plus
    one token of its own. Greedy output is the target's exactly; sampled output follows the
    target's distribution exactly (Leviathan et al. 2023, Chen et al. 2023;
    code/s15_rejection.py holds the rule and its proof-by-test).

    - Proposers (the `Proposer` interface: `num_speculative_tokens`, `propose(requests, caps,
      live_ids)`): `NgramProposer`, prompt lookup with no model at all (the longest suffix of
      the request's tokens, prompt_lookup_min..prompt_lookup_max long, found earlier in them;
      the tokens that followed it are the drafts, vLLM's `NgramProposer` rule), and
      `DraftModelProposer`, a small model run ahead k tokens on its own KV slots (S09's
      `RaggedRunner` and `SlotKVManager`, reused): the project's 1-layer draft trained on the
      corpus (data/draft_model/), or the target's own int4 / int8 copy (S14).
    - `RejectionSampler`: the engine's sampler when it speculates. For each request, its
      target logits at the 1 + k positions go through Part I's processors (penalties,
      temperature, top-k/p, min-p, min_tokens), with the drafts before each position counted
      as output; greedy requests accept a draft while it equals the target's argmax, sampled
      ones by s15_rejection's `rejection_sample` with k + 1 uniforms from the request's own
      seeded generator (reproducible, independent of its neighbours).
    - The engine itself (S09's `LLMEngine`, not subclassed) calls the proposer before each
      step (`request.spec_token_ids`), the scheduler schedules 1 + k tokens per decoding
      request inside its token budget and KV (S10/S11: drafts are cut first when either runs
      short), the runner computes logits at the drafts' positions, and after the step each
      request's num_computed_tokens advances by what was accepted only, its KV trimmed (S12's
      blocks go back); EOS, stop strings and max_tokens inside an accepted run end the request
      at that token (`LLMEngine._finish_rows`).
    - `SpecDecodingStats`, an observer: acceptance per draft position, tokens per target
      forward, target forwards saved.

What it does not handle
    One draft chain per request (no tree of candidates: Medusa, EAGLE-2's dynamic trees), no
    draft heads on the target's hidden states (EAGLE, MTP), and the draft model runs its k
    steps one after the other on the host (vLLM captures them in CUDA graphs, S16). A seeded
    request's sampled output is reproducible and independent of its neighbours while the token
    budget holds its 1 + k tokens; a budget that cuts its drafts, or a preemption, changes how
    many random numbers it draws (the output still follows the target's distribution).

Run it
    python code/s15_speculative.py --speculative ngram --num-speculative-tokens 4
    python code/s15_speculative.py --speculative draft --num-speculative-tokens 3
    python code/s15_speculative.py --speculative draft --draft-model int4
    python benchmarks/bench_s15_speculative.py --quick

Tests
    tests/test_s15_speculative.py: greedy output equals the target alone for k in 1, 2, 4, 8,
    both proposers, in the slot, chunked, paged and prefix-caching engines; a rejection at the
    first, a middle and the last draft; full acceptance with the bonus; EOS, max_tokens and a
    stop string inside an accepted run; KV trimmed, no block held when idle; seeded sampling
    reproducible and independent of neighbours; every bad option.
    tests/test_s15_rejection.py: the sampler keeps the target's distribution (chi-square), the
    measured acceptance and tokens per step equal Leviathan's formulas.

References
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding"
    (ICML 2023); Chen et al., "Accelerating Large Language Model Decoding with Speculative
    Sampling" (DeepMind, 2023); Saxena, "Prompt Lookup Decoding" (2023), as HF's
    `prompt_lookup_num_tokens`. vLLM V1: `SpeculativeConfig` (num_speculative_tokens,
    prompt_lookup_min/max), vllm/v1/spec_decode/ngram_proposer.py,
    vllm/v1/sample/rejection_sampler.py, `Request.spec_token_ids`,
    `SchedulerOutput.scheduled_spec_decode_tokens`, the scheduler's rejected-token rollback in
    `update_from_output`.

Shape legend (the whole course): B batch, T tokens in this step, S key/value length, H query
heads, Hkv key/value heads, D head dim, V vocabulary, L layers; k draft tokens.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import copy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import s01_generation_loop as s01
import s06_sampler
import s06_torch as s06
import s08_static_batching as s08
import s09_continuous_batching as s09
import s15_rejection as rej
from s01_generation_loop import ParameterError
from s09_ragged import RaggedRunner, SlotKVCache
from s09_scheduler import SchedulerOutput, SlotKVManager

ROOT = Path(__file__).resolve().parents[1]
DRAFT_MODEL_DIR = ROOT / "data" / "draft_model"
METHODS = ("ngram", "draft")
QUANTIZED_DRAFTS = ("int4", "int8")    # draft_model: the target's own copy in this format


# ---------------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------------

def ngram_propose(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: the longest n in max_n .. min_n whose last n tokens occur earlier in
    token_ids (the earliest such occurrence, as vLLM's `NgramProposer`), and the up to k tokens
    that followed it there; [] when no suffix of min_n tokens or more recurs. token_ids: the
    request's prompt and output ids. Cost: O(len(token_ids) x n) per n tried, on the host."""
    if k <= 0 or len(token_ids) < 2:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    last = len(ids) - 1
    # Earlier places where the last token occurs (ends of candidate matches), then how far
    # back each match goes, up to max_n: one vector op, and a short loop over the candidates.
    ends = np.flatnonzero(ids[:last] == ids[last])
    best_n, best_end = 0, -1
    for end in ends.tolist():
        n = 1
        while n < max_n and end - n >= 0 and ids[end - n] == ids[last - n]:
            n += 1
        if n > best_n:                        # longer wins; the earliest of equal length
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return ids[best_end + 1:best_end + 1 + k].tolist()


class Proposer:
    """What the engine asks of a proposer (S09's `LLMEngine._propose`).

    num_speculative_tokens: the most drafts per request and step (vLLM's name).
    `propose(requests, caps, live_ids)`: for each decoding request (its prompt computed, its
    last token not), (draft token ids, at most caps[i] of them; their draft distributions
    float32 (len, V) on the device, or None when they were chosen deterministically).
    live_ids: every unfinished request's id: state kept for any other may be dropped.
    `release(live_ids)`: drop the state of every request not in live_ids (the engine calls it
    after each step, so nothing is held once every request has finished or been aborted).
    """

    num_speculative_tokens: int

    def propose(self, requests: Sequence, caps: Sequence[int], live_ids: set[str]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        raise NotImplementedError

    def release(self, live_ids: set[str]) -> None:
        """Nothing is kept per request here."""


class NgramProposer(Proposer):
    """Drafts copied from the request's own context (`ngram_propose`): no model, no state.
    prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried (vLLM's names)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 4):
        config = SpeculativeConfig("ngram", num_speculative_tokens, prompt_lookup_min,
                                   prompt_lookup_max)          # its rules (ParameterError)
        self.num_speculative_tokens = config.num_speculative_tokens
        self.prompt_lookup_min = config.prompt_lookup_min
        self.prompt_lookup_max = config.prompt_lookup_max

    def propose(self, requests, caps, live_ids):
        return [(ngram_propose(r.token_ids, self.prompt_lookup_min, self.prompt_lookup_max, k),
                 None) for r, k in zip(requests, caps)]


@dataclass
class _DraftView:
    """What S09's runner reads of a request (`token_ids`, `prompt_ids`): here the request's
    context and the drafts proposed so far."""

    request_id: str
    token_ids: list[int]
    prompt_ids: list[int]


class DraftModelProposer(Proposer):
    """A small model that runs k tokens ahead of the target.

    model: S06's model with the target's vocabulary (the 1-layer draft in data/draft_model,
    or the target's quantized copy). It keeps its own KV in max_num_seqs slots of
    max_context positions (S09's `SlotKVCache` and `RaggedRunner`, `SlotKVManager` for the
    books), and for each request the tokens that KV holds: at each `propose`, the tokens the
    target accepted since (or all of them, for a new request) are computed in one ragged
    chunk with the first draft, then each further draft is one decode step of every request
    still drafting. A greedy request takes the draft's argmax (q is then deterministic:
    None); a sampled one draws from the draft's processed distribution q (Part I's
    temperature, min-p, top-k, top-p, no penalties: any q keeps the rule exact) with the
    request's own generator, and q is kept for the rejection sampler.
    """

    def __init__(self, model: s06.TorchTransformer, num_speculative_tokens: int,
                 max_num_seqs: int, max_context: int, batch_invariant: bool = False,
                 attention: str = "masked"):
        self.model, self.num_speculative_tokens = model, num_speculative_tokens
        cache = SlotKVCache.for_model(model, max_num_seqs, max_context)
        self.runner = RaggedRunner(model, cache, batch_invariant, attention)
        self.slots = SlotKVManager(max_num_seqs, max_context)
        self.computed: dict[str, list[int]] = {}   # request id -> the tokens its KV holds
        self.num_forwards = 0                      # draft model calls, in all

    @property
    def num_held_slots(self) -> int:
        return len(self.slots.slots)

    def release(self, live_ids: set[str]) -> None:
        """Free the slot of every request not in live_ids."""
        for rid in [rid for rid in self.slots.slots if rid not in live_ids]:
            self.slots.free(_DraftView(rid, [], []))
            self.computed.pop(rid, None)

    @torch.inference_mode()
    def propose(self, requests, caps, live_ids):
        work = [(r, k) for r, k in zip(requests, caps) if k > 0]
        self.release({r.request_id for r, _ in work})
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in work}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in work}
        views, new, starts = {}, {}, {}
        for r, k in work:
            rid, context = r.request_id, r.token_ids
            held = self.computed.get(rid, [])
            valid = next((i for i, (a, b) in enumerate(zip(held, context)) if a != b),
                         min(len(held), len(context)))
            valid = min(valid, len(context) - 1)          # at least one token to run
            view = _DraftView(rid, list(context), r.prompt_ids)
            self.slots.trim(view, valid)
            fits = self.slots.allocate_slots(view, len(context) + k - 1 - valid)
            assert fits, "caps keep context + drafts inside max_context; slots >= max_num_seqs"
            views[rid], new[rid], starts[rid] = view, len(context) - valid, valid
        work_ids = {r.request_id: (r, k) for r, k in work}
        todo = dict(work_ids)
        step = 0
        while todo:
            plan = SchedulerOutput(step, {rid: new[rid] for rid in todo},
                                   {rid: starts[rid] for rid in todo},
                                   {rid: self.slots.block_table(rid) for rid in todo})
            out = self.runner.execute_model(plan, views)
            self.num_forwards += 1
            tokens, rows = self._choose(out.logits, [todo[rid][0] for rid in out.req_ids],
                                        [len(views[rid].token_ids) for rid in out.req_ids])
            for rid, token, row in zip(out.req_ids, tokens, rows):
                if token is None:              # its row ran: its KV holds that position
                    starts[rid] += new[rid]
                    del todo[rid]
                    continue
                drafts[rid].append(token)
                if row is not None:
                    probs[rid].append(row)
                starts[rid] += new[rid]
                new[rid] = 1
                views[rid].token_ids.append(token)
                if len(drafts[rid]) == todo[rid][1]:
                    del todo[rid]
            step += 1
        for rid, view in views.items():     # up to the last draft, which was never run
            self.computed[rid] = view.token_ids[:starts[rid]]
        result = []
        for r, k in zip(requests, caps):
            rid = r.request_id
            if rid not in work_ids:
                result.append(([], None))
                continue
            q = torch.stack(probs[rid]) if probs[rid] else None
            result.append((drafts[rid], q))
        return result

    def _choose(self, logits: torch.Tensor, requests: list, positions: list[int]
                ) -> tuple[list[int | None], list]:
        """One draft token per row of logits (B, V), for the position positions[i] of request
        i: the argmax for a greedy request (its q row None), else a draw from q = the
        processed row's softmax (q float32 (V,) kept; `_uniform`). None: the request stops
        drafting (its row has no probability mass)."""
        greedy = [r.params.greedy for r in requests]
        tokens: list = [None] * len(requests)
        rows: list = [None] * len(requests)
        if any(greedy):
            argmax = logits.argmax(dim=-1).tolist()
            for i, g in enumerate(greedy):
                if g:
                    tokens[i] = argmax[i]
        for i, (r, position) in enumerate(zip(requests, positions)):
            if greedy[i]:
                continue
            p = r.params
            row = s06_sampler.apply_temperature(logits[i].float(), p.temperature)
            row = s06_sampler.apply_top_p(s06_sampler.apply_top_k(
                s06_sampler.apply_min_p(row, p.min_p), p.top_k), p.top_p)
            q = torch.nan_to_num(torch.softmax(row, dim=-1), nan=0.0)
            if not bool(q.sum() > 0):              # a bad draft row: this request stops
                continue                           # drafting (the drafts so far stand)
            tokens[i] = int(rej.sample_from(q[None], self._uniform(r, position, q.device))[0])
            rows[i] = q
        return tokens, rows

    @staticmethod
    def _uniform(request, position: int, device) -> torch.Tensor:
        """The uniform (float64 (1,)) that draws a sampled request's draft for this position:
        from a generator seeded by the request's own seed and the position, so the draft
        consumes nothing of the request's stream (the rejection sampler's), and a step that is
        retried, or whose drafts a budget cut, drafts the same tokens again."""
        seed = request.seq.sampler.generator.initial_seed()
        generator = torch.Generator(device=device)
        generator.manual_seed((seed * 1_000_003 + position) % (2 ** 63))
        return torch.rand((1,), generator=generator, device=device, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# The rejection sampler: the engine's sampler when it speculates
# ---------------------------------------------------------------------------------------------

class RejectionSampler:
    """The tokens of each sampling row of a step with drafts (the engine's `_sample` seam).

    processor: the engine's S08 processor (`plain_greedy`, `logprobs_mode`). `sample(run,
    requests, active)`: run.logits hold 1 + d rows per request (d = run.num_draft_tokens[i],
    its drafts `requests[i].spec_token_ids[:d]`); returns per request its accepted drafts and
    one more token (None for a row not active). Plain greedy rows (S08's `plain_greedy`) are
    decided together by one argmax; every other row runs Part I's processors position by
    position on its own `DeviceSampler` (the drafts before a position counted as output for
    the penalties and min_tokens), then `s15_rejection` decides: `greedy_verify`, or
    `rejection_sample` with d + 1 uniforms from the request's generator (d accept tests, the
    last for the final draw, so a row without drafts draws exactly what S08 would). Logprobs
    (when asked) come from the target's row at each emitted token's position.
    Raises S08's `RowsRefused` naming every row whose logits S04 refuses at a position it
    reached, after putting every random stream and history back (all or nothing).
    """

    def __init__(self, processor: s08.Engine):
        self.processor = processor

    @torch.inference_mode()
    def sample(self, run, requests: list, active: list[bool]) -> list[list[int] | None]:
        logits = run.logits
        num_drafts = run.num_draft_tokens or [0] * len(requests)
        starts = np.cumsum([0] + [1 + d for d in num_drafts]).tolist()
        plain = [i for i, r in enumerate(requests)
                 if active[i] and self.processor.plain_greedy(r.seq)]
        own = [i for i, r in enumerate(requests)
               if active[i] and not self.processor.plain_greedy(r.seq)]
        result: list = [None] * len(requests)
        errors: dict[int, ParameterError] = {}
        emitted: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        if plain:
            top, argmax = logits.max(dim=-1)
            flags = torch.where(torch.isnan(top) | (top == float("inf")), -2,
                                torch.where(top == float("-inf"), -3, argmax)).tolist()
            verdicts = self._greedy(plain, requests, num_drafts, starts, flags)
            for i, (tokens, flag) in verdicts.items():
                if flag is not None:
                    errors[i] = self._error(flag)
                else:                  # its rows: the raw logits, read only for logprobs
                    emitted[i] = (tokens, None)
        saved = []
        try:
            for i in own:
                seq = requests[i].seq
                if seq.sampler.generator is not None:
                    saved.append((seq.sampler.generator, seq.sampler.generator.get_state()))
                tokens, rows, flag = self._verify(seq, logits[starts[i]:starts[i + 1]],
                                                  requests[i].spec_token_ids[:num_drafts[i]],
                                                  requests[i].spec_draft_probs)
                if flag is not None:
                    errors[i] = self._error(flag)
                else:
                    emitted[i] = (tokens, rows)
            if errors:
                raise s08.RowsRefused(errors)
        except BaseException:
            for generator, state in saved:
                generator.set_state(state)
            raise
        for i, (tokens, rows) in emitted.items():       # commit: histories and logprobs
            seq = requests[i].seq
            for j, token in enumerate(tokens):
                if rows is None:                          # plain greedy: no history to keep
                    source = logits[starts[i] + j]
                else:
                    raw, processed = rows[j]
                    source = raw if self.processor.logprobs_mode == "raw_logprobs" else processed
                    seq.sampler.update(torch.tensor([token], device=logits.device))
                if seq.logprobs is not None:
                    seq.logprobs.append(s06_sampler.compute_logprobs(source, token,
                                                                     seq.params.logprobs))
            result[i] = tokens
        return result

    @staticmethod
    def _error(flag: int) -> ParameterError:
        return ParameterError(s06_sampler.BAD_ROW_ERRORS[flag],
                              s06_sampler.BAD_ROW_PARAMETERS.get(flag))

    @staticmethod
    def _greedy(rows: list[int], requests, num_drafts, starts, flags
                ) -> dict[int, tuple[list[int], int | None]]:
        """The plain greedy rows at once (`s15_rejection.greedy_verify`): for each, (its
        tokens, the first bad flag at a position it reached or None)."""
        width = max(num_drafts[i] for i in rows)
        target, drafts = [], []                      # padded host lists, one tensor each
        for i in rows:
            d = num_drafts[i]
            target.append([max(f, 0) for f in flags[starts[i]:starts[i] + d + 1]]
                          + [0] * (width - d))
            drafts.append(requests[i].spec_token_ids[:d] + [0] * (width - d))
        out, accepted = rej._greedy_verify(      # greedy_verify's rule; inputs built here
            torch.tensor(target, dtype=torch.int64), torch.tensor(drafts, dtype=torch.int64),
            torch.tensor([num_drafts[i] for i in rows], dtype=torch.int64))
        out, accepted = out.tolist(), accepted.tolist()
        verdicts = {}
        for b, i in enumerate(rows):
            a = accepted[b]
            reached = flags[starts[i]:starts[i] + a + 1]
            bad = next((f for f in reached if f < 0), None)
            verdicts[i] = (out[b][:a + 1], bad)
        return verdicts

    def _verify(self, seq, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None):
        """One request's 1 + d rows (float32 (1 + d, V)) through its processors with the
        drafts counted as output, then the rule: (tokens, [(raw row, processed row)] per
        token, the first bad flag at a position it reached or None)."""
        sampler, params = seq.sampler, seq.params
        n, d = len(seq.output_ids), len(drafts)
        kept = [(t, t.clone()) for t in (sampler.seen, sampler.counts) if t is not None]
        processed, flags = [], []
        try:
            for j in range(d + 1):
                row = sampler.process(logits[j], n + j)
                processed.append(row)
                flags.append(sampler.flag(torch.zeros(1, dtype=torch.int64,
                                                      device=logits.device), row, n + j,
                                          logits[j]))
                if j < d and kept:                    # the draft counts as output after it
                    sampler.update(torch.tensor([drafts[j]], device=logits.device))
        finally:
            for tensor, original in kept:
                tensor.copy_(original)
        rows = torch.stack(processed)                                     # (1 + d, V)
        flags = torch.cat(flags).tolist()
        draft_ids = torch.tensor([drafts], dtype=torch.int64, device=logits.device)
        num = torch.tensor([d], dtype=torch.int64, device=logits.device)
        if params.greedy:
            out, accepted = rej.greedy_verify(rows.argmax(dim=-1)[None], draft_ids, num)
        else:
            p = torch.nan_to_num(torch.softmax(rows, dim=-1), nan=0.0)           # (1 + d, V)
            # A row S04 refuses (flagged above) has no mass: give it a harmless one, so the
            # rule runs and the flag, not the rule's own check, ends this request alone.
            p = torch.where(p.sum(dim=-1, keepdim=True) > 0, p,
                            torch.full_like(p, 1.0 / p.shape[-1]))[None]      # (1, 1 + d, V)
            u = torch.rand((d + 1,), generator=sampler.generator, device=logits.device,
                           dtype=torch.float64)
            uniforms = torch.zeros((1, d + 1), dtype=torch.float64, device=logits.device)
            uniforms[0, :d], uniforms[0, d] = u[:d], u[d]
            qd = None if q is None else q[:d][None].to(p.dtype)
            out, accepted = rej.rejection_sample(p, qd, draft_ids, num, uniforms)
        a = int(accepted[0])
        bad = next((f for f in flags[:a + 1] if f < 0), None)
        tokens = out[0, :a + 1].tolist()
        return tokens, [(logits[j], rows[j]) for j in range(a + 1)], bad


# ---------------------------------------------------------------------------------------------
# Statistics: an observer
# ---------------------------------------------------------------------------------------------

@dataclass
class SpecDecodingStats:
    """Speculation's numbers over the steps it observed (vLLM's `SpecDecodingStats` names):
    num_drafts, verifications (a request's step with drafts); num_draft_tokens and
    num_accepted_tokens in all; num_accepted_tokens_per_pos[j] and num_offered_per_pos[j],
    draft j's acceptances and appearances; num_request_forwards, a request's rows in the
    target's steps that sampled; num_emitted_tokens, the tokens they produced."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_offered_per_pos: list[int] = field(default_factory=list)
    num_request_forwards: int = 0
    num_emitted_tokens: int = 0

    def on_plan(self, engine, plan) -> None:
        pass

    def on_step(self, engine, result) -> None:
        drafts = result.plan.scheduled_spec_decode_tokens
        for rid, accepted in result.num_accepted_tokens.items():
            k = len(drafts[rid])
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            while len(self.num_offered_per_pos) < k:
                self.num_offered_per_pos.append(0)
                self.num_accepted_tokens_per_pos.append(0)
            for j in range(k):
                self.num_offered_per_pos[j] += 1
                self.num_accepted_tokens_per_pos[j] += j < accepted
        sampled = set(result.req_ids)
        for out in result.outputs:
            if out.request_id in sampled and out.new_token_ids:
                self.num_request_forwards += 1
                self.num_emitted_tokens += len(out.new_token_ids)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.num_accepted_tokens_per_pos,
                                                    self.num_offered_per_pos)]

    @property
    def tokens_per_forward(self) -> float:
        """Tokens each request gained per target forward it took part in."""
        return (self.num_emitted_tokens / self.num_request_forwards
                if self.num_request_forwards else 0.0)

    @property
    def forwards_saved(self) -> int:
        """Target forwards the requests did not need: a token each without speculation."""
        return self.num_emitted_tokens - self.num_request_forwards


# ---------------------------------------------------------------------------------------------
# Configuration and the engine
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings (vLLM's `SpeculativeConfig` names), checked once.

    method: "ngram" or "draft". num_speculative_tokens: k, the most drafts per request and
    step, 1 .. max_context - 2 (a prompt token and the bonus must fit). prompt_lookup_min /
    prompt_lookup_max: the n-gram lengths ("ngram" only), 1 <= min <= max. draft_model
    ("draft" only): None for the project's draft (data/draft_model), "int4" / "int8" for the
    target's own copy quantized by S14, a checkpoint directory, or S06's model. Raises
    ParameterError naming the field.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_model: object = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ParameterError(f"speculative must be one of {METHODS} or None (got "
                                 f"{self.method!r})", "speculative", self.method)
        k = self.num_speculative_tokens
        if not s01.is_int(k) or k < 1:
            raise ParameterError(f"num_speculative_tokens must be an integer >= 1 (got {k!r})",
                                 "num_speculative_tokens", k)
        if self.method == "ngram":
            if self.draft_model is not None:
                raise ParameterError("draft_model is for speculative='draft'; n-gram lookup "
                                     "uses no model", "draft_model")
            lo = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            hi = max(lo, 4) if self.prompt_lookup_max is None else self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not s01.is_int(value) or value < 1:
                    raise ParameterError(f"{name} must be an integer >= 1 (got {value!r})",
                                         name, value)
            if lo > hi:
                raise ParameterError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                                     f"({hi})", "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_min", int(lo))
            object.__setattr__(self, "prompt_lookup_max", int(hi))
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ParameterError(f"{name} is for speculative='ngram' (got "
                                         f"{getattr(self, name)!r} with a draft model)", name)

    def check_context(self, max_context: int) -> None:
        """k must leave room in the context for a prompt token and the bonus token."""
        if self.num_speculative_tokens > max_context - 2:
            raise ParameterError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) must be <= "
                f"max_context - 2 ({max_context - 2}): a step verifies the last token and k "
                "drafts and adds one more, inside the context", "num_speculative_tokens")


def load_draft_model(draft_model, target: s06.TorchTransformer, tokenizer
                     ) -> s06.TorchTransformer:
    """The draft as S06's model on the target's device and dtype: the project's draft (None),
    the target's quantized copy ("int4": S14's int4 in groups of 32; "int8"), a checkpoint
    directory, or an S06 model as it is. Raises ParameterError ("draft_model") for a draft
    whose vocabulary or tokenizer differs from the target's, or whose window is shorter, or a
    draft_model of another type; ParameterError ("model") for a target that is not S06's."""
    if not isinstance(target, s06.TorchTransformer):
        raise ParameterError(f"the target must be S06's TorchTransformer (got "
                             f"{type(target).__name__})", "model")
    if not (draft_model is None or isinstance(draft_model, (str, Path, s06.TorchTransformer))):
        raise ParameterError(f"draft_model must be None, 'int4', 'int8', a checkpoint "
                             f"directory or S06's model (got {type(draft_model).__name__})",
                             "draft_model")
    if isinstance(draft_model, str) and draft_model in QUANTIZED_DRAFTS:
        import s14_quantization as s14
        try:
            twin = copy.deepcopy(target)
        except (TypeError, RuntimeError) as e:
            raise ParameterError(f"draft_model={draft_model!r} copies the target before it is "
                                 f"quantized, and this target cannot be copied ({e}): pass "
                                 "the model unquantized (build_engine's quantize= quantizes "
                                 "it after the copy)", "draft_model") from e
        draft = s14.quantize_model(twin, draft_model,
                                   group_size=32 if draft_model == "int4" else None)
    elif isinstance(draft_model, s06.TorchTransformer):
        draft = draft_model
    else:
        path = DRAFT_MODEL_DIR if draft_model is None else draft_model
        try:
            draft, draft_tokenizer = s06.load(path, str(target.device),
                                              str(target.dtype).removeprefix("torch."))
        except (ValueError, OSError) as e:
            raise ParameterError(f"draft_model {str(path)!r} could not be loaded: {e}",
                                 "draft_model") from e
        probe = "O Romeo, Romeo! wherefore art thou Romeo?\n"
        if (tokenizer is not None and hasattr(tokenizer, "encode")
                and draft_tokenizer.encode(probe) != tokenizer.encode(probe)):
            raise ParameterError("draft_model's tokenizer encodes text differently from the "
                                 "target's: its token ids would mean other words",
                                 "draft_model")
    if draft.vocab_size != target.vocab_size:
        raise ParameterError(f"draft_model's vocabulary ({draft.vocab_size} ids) must equal "
                             f"the target's ({target.vocab_size}): the rejection sampler "
                             "compares their distributions id by id", "draft_model")
    if draft.device != target.device:
        raise ParameterError(f"draft_model is on {draft.device}, the target on "
                             f"{target.device}", "draft_model")
    return draft


def check_draft_window(draft: s06.TorchTransformer, max_context: int) -> None:
    """The draft must hold as long a context as the engine (ParameterError, draft_model)."""
    if draft.config.max_position_embeddings < max_context:
        raise ParameterError(f"draft_model's window ({draft.config.max_position_embeddings} "
                             f"tokens) is shorter than max_context ({max_context})",
                             "draft_model")


def speculate(engine: s09.LLMEngine, proposer: Proposer) -> s09.LLMEngine:
    """S09's engine from the components of `engine` (which must not have run), with the
    proposer and a `RejectionSampler`: how every earlier chapter's engine gains speculation
    (its observers carried over). Raises ParameterError for an engine that is not S09's or
    has run, a proposer that is not a `Proposer`, and a `DraftModelProposer` with fewer slots
    than the engine's max_num_seqs or a shorter context than its max_context."""
    if not isinstance(engine, s09.LLMEngine):
        raise ParameterError(f"speculate takes S09's LLMEngine (got {type(engine).__name__})",
                             "engine")
    if engine.requests or engine.scheduler.num_steps or engine.has_unfinished_requests():
        raise ParameterError("speculate takes an engine that has not run yet", "engine")
    if not isinstance(proposer, Proposer):
        raise ParameterError(f"proposer must be an s15 Proposer (got "
                             f"{type(proposer).__name__})", "proposer")
    if isinstance(proposer, DraftModelProposer) and (
            proposer.slots.num_slots < engine.config.max_num_seqs
            or proposer.slots.slot_size < engine.max_context):
        raise ParameterError(
            f"the draft proposer holds {proposer.slots.num_slots} slots of "
            f"{proposer.slots.slot_size} positions but the engine runs up to "
            f"{engine.config.max_num_seqs} requests of {engine.max_context}: it needs a slot "
            "per running request, as long as the context", "proposer")
    speculating = s09.LLMEngine(engine.config, engine.processor, engine.scheduler,
                                engine.runner, proposer, RejectionSampler(engine.processor))
    speculating.observers = list(engine.observers)
    return speculating


def build_engine(model: s06.TorchTransformer, tokenizer, *, speculative: str | None = "ngram",
                 num_speculative_tokens: int = 4, prompt_lookup_min: int | None = None,
                 prompt_lookup_max: int | None = None, draft_model=None,
                 builder: Callable | None = None, **options) -> s09.LLMEngine:
    """S14's engine (S13's paged KV, chunked prefill, prefix caching; quantize and
    kv_cache_dtype as S14) with speculative decoding: speculative "ngram" (`NgramProposer`) or
    "draft" (`DraftModelProposer` over `load_draft_model(draft_model)`), None for none (the
    base engine exactly). builder: another chapter's `build_engine` to speculate on (S09 to
    S14; default S14's); options go to it. Raises ParameterError naming the option: a
    `SpeculativeConfig` rule, a draft that does not match the target, k too large for the
    context, and the base builder's."""
    import s14_quantization as s14
    builder = s14.build_engine if builder is None else builder
    if isinstance(model, (str, Path)):                    # as S14's builder takes it
        model, loaded = s06.load(model, options.pop("device", None),
                                 options.pop("dtype", None))
        tokenizer = loaded if tokenizer is None else tokenizer
    if not isinstance(model, s06.TorchTransformer):
        raise ParameterError(f"model must be S06's TorchTransformer or a checkpoint directory "
                             f"(got {type(model).__name__})", "model")
    if speculative is None:
        for name, value in (("num_speculative_tokens", num_speculative_tokens != 4),
                            ("prompt_lookup_min", prompt_lookup_min is not None),
                            ("prompt_lookup_max", prompt_lookup_max is not None),
                            ("draft_model", draft_model is not None)):
            if value:
                raise ParameterError(f"{name} needs speculative decoding on (speculative="
                                     "'ngram' or 'draft')", name)
        return builder(model, tokenizer, **options)
    config = SpeculativeConfig(speculative, num_speculative_tokens, prompt_lookup_min,
                               prompt_lookup_max, draft_model)
    max_context = options.get("max_context") or model.config.max_position_embeddings
    if s01.is_int(max_context):          # checked before the builder touches the model
        config.check_context(int(max_context))     # (S14 quantizes it in place)
    draft = (load_draft_model(draft_model, model, tokenizer) if config.method == "draft"
             else None)
    if draft is not None and s01.is_int(max_context):
        check_draft_window(draft, int(max_context))
    engine = builder(model, tokenizer, **options)
    config.check_context(engine.max_context)
    if draft is None:
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                 config.prompt_lookup_max)
    else:
        check_draft_window(draft, engine.max_context)
        proposer = DraftModelProposer(draft, config.num_speculative_tokens,
                                      engine.config.max_num_seqs, engine.max_context,
                                      engine.config.batch_invariant, engine.config.attention)
    return speculate(engine, proposer)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def add_speculative_arguments(parser, default: str | None = None) -> None:
    """--speculative (default: default, None for off), --num-speculative-tokens,
    --prompt-lookup-min/max, --draft-model: the chapter script's and S19's server's flags."""
    parser.add_argument("--speculative", default=default, choices=METHODS,
                        help="speculative decoding: ngram (prompt lookup, no model) or draft "
                             "(a small model; see --draft-model) (default: "
                             f"{default or 'off'})")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                        help="draft tokens per request and step (default: 4)")
    parser.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                        help="ngram: shortest n-gram to match (default: 1)")
    parser.add_argument("--prompt-lookup-max", type=int, default=None, metavar="N",
                        help="ngram: longest n-gram to match (default: 4)")
    parser.add_argument("--draft-model", default=None,
                        help="draft: a checkpoint directory, or int4 / int8 for the target's "
                             "own quantized copy (default: data/draft_model, 1 layer)")


def speculative_options(args) -> dict:
    """`build_engine`'s speculative options from the flags (none when --speculative is off)."""
    if args.speculative is None:
        return {}
    k = 4 if args.num_speculative_tokens is None else args.num_speculative_tokens
    return dict(speculative=args.speculative, num_speculative_tokens=k,
                prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max, draft_model=args.draft_model)


def check_speculative_arguments(parser, args) -> None:
    """Usage errors before any model loads: the speculative rules that need no model."""
    if args.speculative is None:
        for flag, value in (("--num-speculative-tokens", args.num_speculative_tokens),
                            ("--prompt-lookup-min", args.prompt_lookup_min),
                            ("--prompt-lookup-max", args.prompt_lookup_max),
                            ("--draft-model", args.draft_model)):
            if value is not None:
                parser.error(f"{flag} needs --speculative")
        return
    options = speculative_options(args)
    try:
        SpeculativeConfig(args.speculative, options["num_speculative_tokens"],
                          args.prompt_lookup_min, args.prompt_lookup_max,
                          args.draft_model if args.speculative == "draft" else None)
    except ParameterError as e:
        flag = "--" + (e.parameter or "speculative").replace("_", "-")
        parser.error(f"{flag}: {e}")
    if args.speculative == "ngram" and args.draft_model is not None:
        parser.error("--draft-model is for --speculative draft")


def format_stats(stats: SpecDecodingStats) -> str:
    """The statistics as the chapter script prints them."""
    per_pos = "  ".join(f"{a:.2f}" for a in stats.acceptance_per_position)
    return (f"verify steps (a request's step with drafts): {stats.num_drafts}, draft tokens "
            f"{stats.num_draft_tokens}, accepted by the rejection sampler "
            f"{stats.num_accepted_tokens} ({stats.acceptance_rate:.1%}, counted before the "
            "stop rules, which drop any after a stop)\n"
            f"acceptance by draft position: {per_pos or '-'}\n"
            f"tokens per target forward: {stats.tokens_per_forward:.2f}; target forwards "
            f"saved: {stats.forwards_saved} of {stats.num_emitted_tokens} tokens")


def main(argv: Sequence[str] | None = None) -> None:
    import s08_cli
    import s09_trace

    def add_arguments(parser) -> None:
        add_speculative_arguments(parser, default="ngram")

    def describe(engine, tracers) -> str:
        proposer = engine.proposer
        kind = ("n-gram prompt lookup" if isinstance(proposer, NgramProposer)
                else "a draft model")
        return f"speculative decoding, {kind}, k = {proposer.num_speculative_tokens}"

    s08_cli.chapter_main(s08_cli.Chapter(
        "Chapter 15: speculative decoding, a draft proposes and the target verifies "
        "k tokens in one pass (default: --speculative ngram).",
        build_engine, add_arguments=add_arguments, options=speculative_options,
        tracers=lambda engine: [s09_trace.StepTracer(), SpecDecodingStats()],
        describe=describe, table=lambda run, tracers: format_stats(tracers[1]),
        check=check_speculative_arguments, arrival_every=0), argv)


if __name__ == "__main__":
    sys.exit(main())
