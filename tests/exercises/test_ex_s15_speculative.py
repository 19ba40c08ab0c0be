"""Graded tests for the S15 exercises (see exercises/s15_speculative.py).

Oracles, none of them the solution:
- Exercise 1 (several candidates at one position): the target distribution itself (Pearson's
  chi-square, the emitted tokens against p, and which candidate was taken against the chain of
  the chapter's `acceptance_rate` and `residual`), and the chapter's one-draft rule
  (code/s15_rejection.py's `rejection_sample` with K = 1, then `residual` for the next
  candidate) decision for decision, token for token, on random rows.
- Exercise 2 (the greedy step): rows worked out by hand, and the chapter's engine
  (code/s15_speculative.py on S12's engine, the bundled model) step by step: for every request
  and step, your tokens from the raw logits the runner produced and the drafts the scheduler
  verified must be the tokens the engine's `RejectionSampler` and stop rules gave that request
  in that step. The drafts come from a proposer that knows the target's own greedy output
  (run first without speculation) and spoils some drafts on purpose, EOS among them.
- Exercise 3 (the KV of rejected drafts): S12's real `KVCacheManager` (allocate_slots, trim,
  its event log), and the same engine's `scheduler.kv` observed around every real step.
- Exercise 4 (how many drafts): Monte-Carlo runs of the chapter's `rejection_sample` on toy
  targets and drafts whose acceptance falls with the position (not i.i.d.): what you predict
  from the per-position rates measured with K drafts must match what runs with k drafts
  measure, and the k you choose must be (nearly) the best of the measured speedups; and the
  engine's own `SpecDecodingStats` against the tokens the engine emitted per verification.

Chi-square thresholds: `threshold(df)` is the 1 - 1e-6 quantile of chi-square(df), computed
exactly (the closed form of tests/test_s15_rejection.py, checked there against tables;
threshold(5) = 35.9, threshold(2) = 27.6). Every cell has
an expected count >= 20 (asserted). A correct solution fails a statistic with probability
about 1e-6; this file computes 6, so with a freshly chosen seed a correct solution would fail
with probability below 1e-5 (the seeds are fixed: the outcome is deterministic). The power is
asserted, not assumed: the two classic mistakes (testing every candidate against p itself;
redrawing from p after the last rejection) have exact output distributions written below, and
N is such that their expected statistic is over 20 times the threshold.
"""
from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from stats_testing import chi2_threshold, chi_square

from exercise_loader import load_exercise

ex = load_exercise("s15_speculative")

import s03_transformer as s03  # noqa: E402  (code/ is on the path once the loader ran)
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s12_engine as s12  # noqa: E402
import s12_paged_attention as s12p  # noqa: E402
import s15_rejection as rej  # noqa: E402
import s15_speculative as s15  # noqa: E402

F64 = torch.float64
BUNDLED = s03.BUNDLED_MODEL_DIR
needs_model = pytest.mark.skipif(not (BUNDLED / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")


def threshold(df: int, alpha: float = 1e-6) -> float:
    """The 1 - alpha quantile of chi-square(df) (tests/stats_testing.py)."""
    return chi2_threshold(df, alpha)


# Exercise 1 ----------------------------------------------------------------------------------

def random_row(gen: torch.Generator, v: int) -> torch.Tensor:
    """A distribution over v ids, some of them 0 now and then (float64)."""
    row = -torch.log(torch.rand(v, dtype=F64, generator=gen))        # Dirichlet(1)
    row = row * (torch.rand(v, dtype=F64, generator=gen) > 0.2)
    if float(row.sum()) == 0:
        row[0] = 1.0
    return row / row.sum()


def chapter_chain(p: torch.Tensor, q: torch.Tensor, candidates: list[int],
                  uniforms: list[float]) -> tuple[int, int]:
    """The chapter's one-draft step (`rejection_sample`, K = 1) for candidate i against p_i,
    p_{i+1} = the chapter's `residual(p_i, q)`; the last step's final token is the draw from
    the last residual with uniforms[m]."""
    target, m = p, len(candidates)
    for i, x in enumerate(candidates):
        u = torch.tensor([[uniforms[i], uniforms[m] if i == m - 1 else 0.5]], dtype=F64)
        out, accepted = rej.rejection_sample(
            torch.stack([target, target])[None], q[None, None], torch.tensor([[x]]),
            torch.tensor([1]), u)
        if int(accepted[0]) == 1:
            return i, x
        if i == m - 1:
            return -1, int(out[0, 0])
        target = rej.residual(target, q)
    raise AssertionError("unreachable")


def random_cases(seed: int, n: int, m_choices: tuple[int, ...]):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        v = int(torch.randint(2, 11, (1,), generator=gen))
        m = m_choices[int(torch.randint(len(m_choices), (1,), generator=gen))]
        p, q = random_row(gen, v), random_row(gen, v)
        candidates = torch.multinomial(q, m, replacement=True, generator=gen).tolist()
        uniforms = torch.rand(m + 1, dtype=F64, generator=gen).tolist()
        yield p, q, candidates, uniforms


def check_against_the_chapter(cases) -> None:
    taken = set()
    for p, q, candidates, uniforms in cases:
        got = ex.verify_candidates(p.clone(), q.clone(), list(candidates), list(uniforms))
        want = chapter_chain(p, q, candidates, uniforms)
        assert (int(got[0]), int(got[1])) == want, (
            f"p={p.tolist()}, q={q.tolist()}, candidates={candidates}, uniforms={uniforms}: "
            f"got {tuple(got)}, the chapter's rule gives {want}")
        taken.add(want[0])
    return taken


@pytest.mark.points(1)
def test_one_candidate_is_the_chapters_rejection_step():
    # By hand: p(x) >= q(x) accepts whatever u; p(x) = 0 rejects whatever u; a rejection draws
    # from max(p - q, 0) normalised: here (0.4, 0, 0) -> token 0 whatever u.
    p = torch.tensor([0.6, 0.3, 0.1], dtype=F64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    assert tuple(ex.verify_candidates(p, q, [1], [0.999, 0.5])) == (0, 1)
    assert tuple(ex.verify_candidates(p, q, [2], [0.19, 0.9])) == (0, 2)    # 0.19 < 0.1 / 0.5
    assert tuple(ex.verify_candidates(p, q, [2], [0.21, 0.9])) == (-1, 0)
    zero = torch.tensor([0.7, 0.3, 0.0], dtype=F64)
    assert tuple(ex.verify_candidates(zero, q, [2], [0.0, 0.99])) == (-1, 0)
    taken = check_against_the_chapter(random_cases(1501, 1000, (1,)))
    assert taken == {0, -1}


@pytest.mark.points(1)
def test_several_candidates_match_the_chained_rejection_steps():
    taken = check_against_the_chapter(random_cases(1502, 800, (2, 3, 4)))
    assert taken == {-1, 0, 1, 2, 3}


# Toy rows (tests/test_s15_rejection.py's): alpha = sum min(p, q) = 0.45 by hand.
P_TOY = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=F64)
Q_TOY = torch.tensor([0.05, 0.1, 0.1, 0.15, 0.3, 0.3], dtype=F64)
N_TOY = 8_000


def wrong_distributions(p: torch.Tensor, q: torch.Tensor, m: int) -> list[torch.Tensor]:
    """The exact output distributions of two classic mistakes with m candidates: every
    candidate tested against p itself (the last rejection drawing from residual(p, q)), and
    the right tests but a last draw from p instead of the last residual."""
    overlap = torch.minimum(p, q)
    alpha = float(overlap.sum())
    res = rej.residual(p, q)
    same_p = sum((1 - alpha) ** i * overlap for i in range(m)) + (1 - alpha) ** m * res
    target, accepted, none = p, torch.zeros_like(p), 1.0
    for _ in range(m):
        accepted += none * torch.minimum(target, q)
        none *= 1 - float(torch.minimum(target, q).sum())
        target = rej.residual(target, q)
    return [same_p, accepted + none * p]


@pytest.mark.points(1)
def test_emitted_tokens_follow_the_target_chi_square():
    gen = torch.Generator().manual_seed(1503)
    for m, p, q in ((1, P_TOY, Q_TOY), (2, P_TOY, Q_TOY), (3, P_TOY, Q_TOY),
                    (2, P_TOY.roll(2), Q_TOY)):
        # With one candidate the first mistake is no mistake (it is the chapter's rule).
        for wrong in wrong_distributions(p, q, m)[1 if m == 1 else 0:]:
            power = N_TOY * float(((wrong - p) ** 2 / p).sum())     # expected statistic
            assert power > 20 * threshold(p.numel() - 1), (m, power)
        candidates = torch.multinomial(q, N_TOY * m, replacement=True,
                                       generator=gen).view(N_TOY, m).tolist()
        uniforms = torch.rand((N_TOY, m + 1), dtype=F64, generator=gen).tolist()
        tokens, which = [], []
        for cands, us in zip(candidates, uniforms):
            i, t = ex.verify_candidates(p, q, cands, us)
            assert (i == -1 or t == cands[i]), "an accepted candidate is emitted as it is"
            tokens.append(int(t))
            which.append(int(i))
        stat, df = chi_square(torch.bincount(torch.tensor(tokens), minlength=p.numel()), p)
        assert stat < threshold(df), (
            f"m={m}: the emitted tokens do not follow p: chi-square {stat:.1f} >= "
            f"{threshold(df):.1f} (df {df})")
        # Which candidate was taken: P(i) = (prod_{j<i} (1 - a_j)) a_i, a_j the chapter's
        # acceptance_rate of p_j (the chapter's residual chain) and q; -1 the rest.
        target, none, cells = p, 1.0, []
        for _ in range(m):
            a = rej.acceptance_rate(target, q)
            cells.append(none * a)
            none *= 1 - a
            target = rej.residual(target, q)
        cells.append(none)
        counts = torch.bincount(torch.tensor(which) % (m + 1), minlength=m + 1)
        stat, df = chi_square(counts, torch.tensor(cells, dtype=F64))
        assert stat < threshold(df), (
            f"m={m}: candidate i should be taken with probability {cells} (index m: none); "
            f"got counts {counts.tolist()}, chi-square {stat:.1f}")


# The engine, for exercises 2 to 4 ------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def bundled():
    torch.set_num_threads(1)
    return s06.load(BUNDLED, "cpu", "float32")


# (request id, prompt, SamplingParams fields): an EOS inside a run of drafts, min_tokens that
# rules EOS out where the target would pick it ("b"; "e" just before the boundary: alone, the
# target ends with EOS as its 9th token; "g" at it: min_tokens 8 lets that EOS through), a stop
# token id in the middle of a run, and long runs without EOS.
REQUESTS = [
    ("a", "ROMEO:\n", dict(max_tokens=40)),
    ("b", "ROMEO:\n", dict(max_tokens=40, min_tokens=20)),
    ("c", "Friends, Romans, countrymen", dict(max_tokens=40, stop_token_ids=[1321])),
    ("d", "KING HENRY:\n", dict(max_tokens=40, ignore_eos=True)),
    ("e", "Now is the winter of our discontent", dict(max_tokens=40, min_tokens=9)),
    ("g", "Now is the winter of our discontent", dict(max_tokens=40, min_tokens=8)),
    ("f", "To be, or not to be", dict(max_tokens=30, ignore_eos=True)),
]


def params_of(fields: dict) -> s04.SamplingParams:
    return s04.SamplingParams(temperature=0.0, **fields)


LONG_REQUESTS = [(rid, prompt, dict(max_tokens=48, ignore_eos=True))
                 for rid, prompt, _ in REQUESTS]
REQUEST_SETS = {"stops": REQUESTS, "long": LONG_REQUESTS}


def run_engine(engine, requests) -> dict[str, list[int]]:
    for rid, prompt, fields in requests:
        engine.add_request(prompt, params_of(fields), request_id=rid)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@functools.lru_cache(maxsize=None)
def references(which: str) -> dict[str, list[int]]:
    """Each request's greedy output with the target alone (S12's engine, no speculation)."""
    model, tokenizer = bundled()
    return run_engine(s12.build_engine(model, tokenizer), REQUEST_SETS[which])


class SpoilingProposer(s15.Proposer):
    """Drafts the target's own next tokens (refs: each request's output with the target
    alone), each spoiled with probability 1 - keep[j] at draft position j (replaced by EOS
    when eos is set and a coin says so, else by the next id): so draft j is accepted with
    probability keep[j] once the drafts before it were. full_only: propose nothing unless all
    k drafts fit (every verification then offers exactly k)."""

    def __init__(self, refs: dict[str, list[int]], k: int, keep: list[float], seed: int,
                 eos: int | None = None, full_only: bool = False):
        self.refs, self.num_speculative_tokens, self.keep = refs, k, keep
        self.rng, self.eos, self.full_only = random.Random(seed), eos, full_only

    def propose(self, requests, caps, live_ids):
        result = []
        for request, cap in zip(requests, caps):
            ref = self.refs[request.request_id]
            n = len(request.output_ids)
            d = min(cap, len(ref) - n)
            if self.full_only and d < self.num_speculative_tokens:
                d = 0
            drafts = []
            for j in range(d):
                token = ref[n + j]
                if self.rng.random() >= self.keep[j]:
                    use_eos = self.eos is not None and self.rng.random() < 0.5
                    token = self.eos if use_eos and self.eos != token else (token + 1) % 2048
                drafts.append(token)
            result.append((drafts, None))
        return result


class StepRecorder:
    """A runner wrapper and an observer in one: for each request that sampled in a step, its
    raw logits rows, the drafts verified, its output length and num_computed_tokens before,
    the tokens the step gave it, and the KV manager's books after the step (the blocks its
    event log shows allocated and freed during the step)."""

    def __init__(self, engine):
        self.runner, engine.runner = engine.runner, self
        self.rows: dict[str, torch.Tensor] = {}
        self.steps: list[dict] = []
        engine.observers.append(self)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute_model(self, plan, requests):
        out = self.runner.execute_model(plan, requests)
        drafts = out.num_draft_tokens or [0] * len(out.req_ids)
        start, self.rows = 0, {}
        for rid, d in zip(out.req_ids, drafts):
            self.rows[rid] = out.logits[start:start + 1 + d].clone()
            start += 1 + d
        return out

    def on_plan(self, engine, plan):
        self.before = {rid: (r.num_computed_tokens, len(r.output_ids),
                             r.seq.eos_ids | r.seq.stop_token_ids, r.params.min_tokens,
                             r.num_computed_tokens == r.num_tokens - 1)
                       for rid, r in engine.requests.items()}

    def on_step(self, engine, result):
        kv = engine.scheduler.kv
        events = kv.take_events()       # allocated by this step's plan, freed after it
        emitted = {o.request_id: (list(o.new_token_ids), o.finished) for o in result.outputs}
        for rid, rows in self.rows.items():
            c, n, stop_ids, min_tokens, decoding = self.before[rid]
            tokens, finished = emitted[rid]
            request = engine.requests.get(rid)
            self.steps.append(dict(
                rid=rid, rows=rows, drafts=list(result.plan.scheduled_spec_decode_tokens.get(
                    rid, ())), n=n, stop_ids=stop_ids, min_tokens=min_tokens, tokens=tokens,
                finished=finished, c=c, decoding=decoding,
                accepted=result.num_accepted_tokens.get(rid, 0),
                block_size=kv.block_size,
                computed_after=None if request is None else request.num_computed_tokens,
                held_after=len(kv.block_table(rid)),
                allocated=sum(len(b) for kind, r, b in events
                              if r == rid and kind == "allocated"),
                freed=sum(len(b) for kind, r, b in events if r == rid and kind == "freed")))
        self.rows = {}


def recorded_run(which: str, block_size: int, k: int, keep: list[float], seed: int,
                 full_only: bool = False):
    """The S15 engine on S12's (blocks of block_size, the pool's event log on) with a
    `SpoilingProposer`; returns (the recorded steps, its SpecDecodingStats, the outputs)."""
    model, tokenizer = bundled()
    base = s12.build_engine(model, tokenizer, block_size=block_size,
                            enable_kv_cache_events=True)
    engine = s15.speculate(base, SpoilingProposer(references(which), k, keep, seed, eos=2047,
                                                  full_only=full_only))
    recorder = StepRecorder(engine)
    stats = s15.SpecDecodingStats()
    engine.observers.append(stats)
    outputs = run_engine(engine, REQUEST_SETS[which])
    assert outputs == references(which)   # the engine's own guarantee, before it is an oracle
    return recorder.steps, stats, outputs


@functools.lru_cache(maxsize=1)
def engine_steps() -> list[dict]:
    """Two runs (k = 4, blocks of 4 tokens; k = 3, blocks of 16) with drafts spoiled by
    position."""
    return (recorded_run("stops", 4, 4, [0.9, 0.75, 0.6, 0.5], 1504)[0]
            + recorded_run("stops", 16, 3, [0.7, 0.7, 0.7], 1505)[0])


# Exercise 2 ----------------------------------------------------------------------------------

def logits_row(v: int, ranking: list[int]) -> torch.Tensor:
    """Logits over v ids whose order from the top is `ranking` (the rest below)."""
    row = torch.zeros(v)
    for place, token in enumerate(ranking):
        row[token] = float(len(ranking) - place)
    return row


@pytest.mark.points(1)
def test_greedy_step_by_hand():
    v = 8
    rows = torch.stack([logits_row(v, r) for r in ([3, 1], [5, 2], [7, 0], [4, 6])])
    none = frozenset()
    assert list(ex.greedy_step(rows, [3, 5, 7], 0, 0, none)) == [3, 5, 7, 4]     # + bonus
    assert list(ex.greedy_step(rows, [3, 2, 7], 0, 0, none)) == [3, 5]          # correction
    assert list(ex.greedy_step(rows, [1, 5, 7], 0, 0, none)) == [3]
    assert list(ex.greedy_step(rows[:1], [], 0, 0, none)) == [3]                 # no drafts
    # A stop id inside the accepted run ends the step there, itself included.
    assert list(ex.greedy_step(rows, [3, 5, 7], 0, 0, frozenset({5}))) == [3, 5]
    assert list(ex.greedy_step(rows, [3, 5, 7], 0, 0, frozenset({4}))) == [3, 5, 7, 4]
    # min_tokens: row j is the (n + j + 1)-th output token; stop ids are ruled out while fewer
    # than min_tokens tokens precede it. n = 3, min_tokens = 5: rows 0 and 1 rule 5 out.
    banned = frozenset({5, 7})
    assert list(ex.greedy_step(rows, [3, 5, 7], 3, 5, banned)) == [3, 2]
    assert list(ex.greedy_step(rows, [3, 2, 7], 3, 5, banned)) == [3, 2, 7]      # 7 at n + 2
    assert list(ex.greedy_step(rows, [3, 2, 0], 3, 6, banned)) == [3, 2, 0, 4]
    # n = 4: only row 0 rules them out; row 1's choice is 5 again, a stop id: it ends the step.
    assert list(ex.greedy_step(rows, [3, 2, 0], 4, 5, banned)) == [3, 5]


@needs_model
@pytest.mark.points(1)
def test_greedy_step_is_what_the_engine_emits_step_by_step():
    steps = engine_steps()
    seen = {"stop inside a run": 0, "min_tokens ruled a stop id out": 0, "rejection": 0}
    for s in steps:
        got = list(ex.greedy_step(s["rows"], list(s["drafts"]), s["n"], s["min_tokens"],
                                  frozenset(s["stop_ids"])))
        assert got == s["tokens"], (
            f"request {s['rid']}, {s['n']} tokens out, drafts {s['drafts']}, min_tokens "
            f"{s['min_tokens']}, stop ids {sorted(s['stop_ids'])}: you emit {got}, the engine "
            f"emitted {s['tokens']}")
        seen["stop inside a run"] += s["finished"] and len(s["tokens"]) < len(s["drafts"]) + 1 \
            and s["tokens"][-1] in s["stop_ids"]
        seen["rejection"] += len(s["tokens"]) < len(s["drafts"]) + 1
        raw = [int(r.argmax()) for r in s["rows"][:len(s["tokens"])]]
        seen["min_tokens ruled a stop id out"] += any(
            t in s["stop_ids"] and s["n"] + j < s["min_tokens"] for j, t in enumerate(raw))
    assert all(seen.values()), seen       # the runs exercise every rule


# Exercise 3 ----------------------------------------------------------------------------------

class _Request:
    def __init__(self, request_id: str):
        self.request_id = request_id


def manager_oracle(c: int, d: int, a: int, block_size: int) -> tuple[int, int, int, int]:
    """S12's KVCacheManager: hold c tokens, allocate the step's 1 + d, trim to c + 1 + a."""
    kv = s12p.KVCacheManager(128, block_size, enable_kv_cache_events=True)
    request = _Request("r")
    assert kv.allocate_slots(request, c)
    kv.take_events()
    assert kv.allocate_slots(request, 1 + d)
    kv.trim(request, c + 1 + a)
    events = kv.take_events()
    kv.check()
    return (kv.num_tokens("r"), len(kv.block_table("r")),
            sum(len(b) for kind, _, b in events if kind == "allocated"),
            sum(len(b) for kind, _, b in events if kind == "freed"))


@pytest.mark.points(1)
def test_kv_after_step_matches_the_block_manager():
    rng = random.Random(1506)
    cases = [(0, 0, 0, 4), (3, 4, 0, 4), (3, 4, 4, 4), (7, 8, 0, 4), (8, 7, 7, 4),
             (15, 1, 0, 16), (16, 3, 1, 16), (5, 9, 2, 1), (0, 5, 5, 2)]
    cases += [(rng.randrange(0, 60), d, rng.randrange(0, d + 1), rng.choice([1, 2, 3, 4, 16]))
              for d in (rng.randrange(0, 12) for _ in range(300))]
    for c, d, a, bs in cases:
        want = manager_oracle(c, d, a, bs)
        got = tuple(int(x) for x in ex.kv_after_step(c, d, a, bs))
        assert got == want, (f"num_computed_tokens {c}, {d} drafts, {a} accepted, blocks of "
                             f"{bs}: you say {got}, S12's KVCacheManager {want} (tokens after, "
                             "blocks held, allocated, freed)")


@needs_model
@pytest.mark.points(1)
def test_kv_after_step_matches_the_engine_after_real_steps():
    checked = {"some freed": 0, "none freed": 0}
    for s in engine_steps():
        if s["finished"] or not s["decoding"]:
            continue           # a request that ended gives all its blocks back; a prefill
        got = tuple(int(x) for x in ex.kv_after_step(s["c"], len(s["drafts"]), s["accepted"],
                                                     s["block_size"]))
        want = (s["computed_after"], s["held_after"], s["allocated"], s["freed"])
        assert got == want, (f"request {s['rid']}: num_computed_tokens {s['c']}, "
                             f"{len(s['drafts'])} drafts, {s['accepted']} accepted, blocks of "
                             f"{s['block_size']}: the engine's books say {want} (tokens after, "
                             f"blocks held, allocated, freed); you say {got}")
        checked["some freed" if want[3] else "none freed"] += 1
    assert all(checked.values()), checked


# Exercise 4 ----------------------------------------------------------------------------------
# Toy rows whose acceptance falls with the position: q_j is p_j mixed with a point mass on a
# token p_j gives 0.05, in proportion LAMBDAS[j]; alpha_j = 1 - 0.95 LAMBDAS[j] (0.95 ... 0.19).

P_FALL = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=F64)
LAMBDAS = [0.05, 0.15, 0.45, 0.7, 0.85]
K_FALL, N_FALL = 5, 100_000
COSTS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.6, 1.0)


def fall_rows(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = P_FALL.roll(j)
    point = torch.zeros(6, dtype=F64)
    point[(5 + j) % 6] = 1.0
    return p, (1 - LAMBDAS[j]) * p + LAMBDAS[j] * point


def simulate(k: int, seed: int) -> torch.Tensor:
    """num_accepted (N,) of N_FALL verifications with k drafts (the chapter's sampler)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [fall_rows(j) for j in range(k)]
    target = torch.stack([p for p, _ in rows] + [P_FALL])                       # (k + 1, V)
    if k:
        drafts = torch.stack([torch.multinomial(q, N_FALL, replacement=True, generator=gen)
                              for _, q in rows], dim=1)
        draft_probs = torch.stack([q for _, q in rows]).expand(N_FALL, k, -1)
    else:
        drafts, draft_probs = torch.zeros((N_FALL, 0), dtype=torch.long), None
    uniforms = torch.rand((N_FALL, k + 1), dtype=F64, generator=gen)
    _, accepted = rej.rejection_sample(target.expand(N_FALL, k + 1, -1), draft_probs, drafts,
                                       torch.full((N_FALL,), k), uniforms)
    return accepted


@functools.lru_cache(maxsize=1)
def monte_carlo():
    """(per-position rates measured with K drafts, as SpecDecodingStats counts them; the
    K-draft run; for each k, the mean and variance of tokens per verification run with k)."""
    measured_run = simulate(K_FALL, 1507)
    rates = [float((measured_run > j).double().mean()) for j in range(K_FALL)]
    runs = {k: (simulate(k, 1600 + k) + 1).double() for k in range(K_FALL + 1)}
    return rates, measured_run, {k: (float(t.mean()), float(t.var())) for k, t in runs.items()}


def tolerance(measured_run: torch.Tensor, k: int, var_k: float) -> float:
    """Six standard deviations of (prediction from the K run) - (mean of the k run)."""
    var_pred = float((measured_run.clamp(max=k) + 1).double().var())
    return 6 * math.sqrt((var_pred + var_k) / N_FALL)


@pytest.mark.points(1)
def test_expected_tokens_match_runs_with_fewer_drafts():
    rates, measured_run, runs = monte_carlo()
    alpha = float(measured_run.double().sum()) / (K_FALL * N_FALL)   # the i.i.d. reading
    for k in range(K_FALL + 1):
        mean, var = runs[k]
        tol = tolerance(measured_run, k, var)
        got = float(ex.expected_tokens_per_forward(list(rates), k))
        assert abs(got - mean) <= tol, (
            f"k={k}: you predict {got:.4f} tokens per target forward from the rates {rates}; "
            f"runs with {k} drafts measure {mean:.4f} (tolerance {tol:.4f})")
    # The test's power: Leviathan's i.i.d. formula with the overall rate is far off here.
    iid = rej.expected_tokens_per_step(alpha, K_FALL)
    assert abs(iid - runs[K_FALL][0]) > 10 * tolerance(measured_run, K_FALL, runs[K_FALL][1])
    with pytest.raises(ValueError):
        ex.expected_tokens_per_forward(list(rates), K_FALL + 1)


@pytest.mark.points(1)
def test_chosen_k_is_the_best_measured_speedup():
    rates, measured_run, runs = monte_carlo()
    alpha = float(measured_run.double().sum()) / (K_FALL * N_FALL)
    iid_worse = 0
    for c in COSTS:
        speedup = {k: runs[k][0] / (1 + k * c) for k in runs}
        tol = {k: tolerance(measured_run, k, runs[k][1]) / (1 + k * c) for k in runs}
        best = max(speedup.values())
        k, s = ex.choose_num_drafts(list(rates), c)
        k = int(k)
        assert 0 <= k <= K_FALL, k
        assert speedup[k] >= best - 2 * tol[k], (
            f"c={c}: you choose k={k}, measured speedup {speedup[k]:.3f}; the best measured is "
            f"{best:.3f} ({ {j: round(x, 3) for j, x in speedup.items()} })")
        assert abs(float(s) - speedup[k]) <= tol[k], (
            f"c={c}: k={k}: you expect a speedup of {float(s):.3f}, runs measure "
            f"{speedup[k]:.3f}")
        k_iid = rej.optimal_k(alpha, c, K_FALL)
        iid_worse += speedup[k_iid] < best - 10 * max(tol.values())
    assert iid_worse >= 2      # the i.i.d. chooser loses clearly at some costs
    # Speculation off when a draft costs as much as the target: k = 0, speedup 1.
    assert tuple(ex.choose_num_drafts(list(rates), 1.0)) == (0, 1.0)


@needs_model
@pytest.mark.points(1)
def test_expected_tokens_from_the_engines_statistics():
    steps, stats, _ = recorded_run("long", 4, 4, [0.9, 0.7, 0.5, 0.3], 1508, full_only=True)
    verifications = [s for s in steps if s["drafts"]]
    assert verifications and all(len(s["drafts"]) == 4 for s in verifications)
    rates = list(stats.acceptance_per_position)
    for k in range(5):
        # What the engine would have emitted with k drafts: the first k drafts are accepted
        # or not as they were (drafts after them play no part), then one more token.
        measured = sum(min(s["accepted"], k) + 1 for s in verifications) / len(verifications)
        got = float(ex.expected_tokens_per_forward(rates, k))
        assert got == pytest.approx(measured, abs=1e-9), (
            f"k={k}: from the engine's acceptance_per_position {rates} you predict {got:.4f} "
            f"tokens per verification; the engine's steps give {measured:.4f}")
