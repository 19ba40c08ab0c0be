"""Data for the S15 "Try it" speculative decoding simulator: real engine runs to replay, and a
toy on which the page checks the rejection rule itself.

Part 1, the replay. `record_run` runs code/s15_speculative.py's engine (`build_engine`: S14's
engine, i.e. S13's paged KV with chunked prefill and prefix caching, plus a proposer and the
`RejectionSampler`) on the bundled model (data/model, float32, CPU) and records, for every
step and every request that sampled in it: the draft tokens it verified
(`plan.scheduled_spec_decode_tokens`), how many the rejection sampler accepted
(`StepResult.num_accepted_tokens`) and the tokens the step emitted (`RequestOutput
.new_token_ids`): the accepted drafts, then the target's own token, a *correction* (at the
first rejected draft) or a *bonus* (when every draft was accepted); fewer when an EOS or
max_tokens inside the accepted run ended the request there. Token ids come with their text
pieces (`pieces`, the tokenizer's decode of each id alone). Three runs, each with two greedy
requests and one sampled with a seed (temperature 0.8), k = 4 drafts per step:

- "draft": the project's 1-layer draft model (data/draft_model);
- "int4": the target's own int4 copy (S14, groups of 32), a draft that mostly agrees;
- "ngram": prompt lookup (no model) on prompts that repeat a line.

Each run also carries the engine's `SpecDecodingStats` (acceptance by draft position, tokens
per target forward); the page recomputes them from the steps and shows a banner if they
differ. tests/test_s15_simulator_data.py runs the engine again and compares step by step, and
holds the greedy requests to the target alone.

Part 2, the toy. A vocabulary of six words, a target distribution p and a draft distribution
q (presets; the page lets the reader change them). The page runs N verification steps of k
drafts with a seeded PRNG (mulberry32), the rule of code/s15_rejection.py (accept draft x
iff u * q(x) < p(x); at the first rejection draw from max(p - q, 0) normalised; after k
accepts a bonus from p) and the wrong rule (draw from p again after a rejection), and draws
the emitted tokens' histogram against p with the chi-square statistic. Exported here, from
code/s15_rejection.py, per preset: alpha (`acceptance_rate`), the expected tokens per step
for k = 0..K_MAX (`expected_tokens_per_step`), the residual (`residual`) and the distribution
the wrong rule emits (min(p, q) + (1 - alpha) p, worked by hand). The page checks its own
numbers against them on load; tests/test_s15_simulator_browser.py checks the page's counts
against `rejection_sample` on the same uniforms, and its measured acceptance against alpha.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

import s03_transformer as s03  # noqa: E402  (code/ is not a package)
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s08_cli  # noqa: E402
import s15_rejection as rej  # noqa: E402
import s15_speculative as s15  # noqa: E402

MAX_CONTEXT = 256              # the bundled model's window
NUM_SPECULATIVE_TOKENS = 4
MAX_TOKENS = 24
TEMPERATURE, SEED = 0.8, 7     # the sampled request
REPEATING_PROMPTS = (
    "ROMEO.\nO Romeo, Romeo! wherefore art thou Romeo?\nJULIET.\nO Romeo, Romeo! wherefore "
    "art thou Romeo?\nROMEO.\n",
    "KING.\nGood night, good night! parting is such sweet sorrow,\nThat I shall say good night "
    "till it be morrow.\nQUEEN.\nGood night, good night! parting",
    "To be, or not to be, that is the question.\nTo be, or not to be, that is the question.\n",
)
# (id, title, speculative, draft_model, prompts: "corpus" or the repeating ones)
RUNS = (
    ("draft", "A 1-layer draft model (data/draft_model), k = 4", "draft", None, "corpus"),
    ("int4", "The target's own int4 copy as the draft, k = 4", "draft", "int4", "corpus"),
    ("ngram", "N-gram prompt lookup on prompts that repeat a line, k = 4", "ngram", None,
     "repeating"),
)

# The toy: six words, and (p, q) presets as integer weights (p = w / sum w).
TOY_VOCAB = [" the", " a", " cat", " dog", " sat", " ran"]
TOY_PRESETS = (
    ("close", "A good draft: q close to p",
     [30, 25, 15, 15, 10, 5], [25, 30, 15, 10, 10, 10]),
    ("overconfident", "An overconfident draft: q piles onto one word",
     [20, 20, 20, 20, 10, 10], [70, 10, 5, 5, 5, 5]),
    ("blind", "A draft blind to two words p likes (q = 0 there)",
     [10, 10, 30, 30, 10, 10], [25, 25, 0, 0, 25, 25]),
    ("same", "A perfect draft: q = p",
     [30, 25, 15, 15, 10, 5], [30, 25, 15, 15, 10, 5]),
)
TOY_K_MAX = 8
TOY_DEFAULTS = {"trials": 4000, "seed": 1, "k": 1, "preset": 0}
# Chi-square critical values at 0.1% (P[chi2_df > x] = 0.001), df = 1..9 (the test recomputes
# them with torch.special.gammaincc).
CHI2_CRITICAL_0_001 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877]


# ---------------------------------------------------------------------------------------------
# Part 1: the engine's runs
# ---------------------------------------------------------------------------------------------

class StepRecorder:
    """An engine observer: per step, for each request that sampled (batch order), its drafts,
    how many were accepted and the tokens it emitted."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_plan(self, engine, plan) -> None:
        pass

    def on_step(self, engine, result) -> None:
        outputs = {o.request_id: o for o in result.outputs}
        drafts = result.plan.scheduled_spec_decode_tokens
        rows = []
        for rid in result.req_ids:
            out = outputs.get(rid)
            verified = rid in result.num_accepted_tokens
            rows.append({
                "id": rid, "kind": "verify" if verified else "plain",
                "drafts": list(drafts.get(rid, ())) if verified else [],
                "accepted": result.num_accepted_tokens.get(rid, 0),
                "emitted": [] if out is None else list(out.new_token_ids),
                "finished": bool(out is not None and out.finished),
                "finish_reason": None if out is None else out.finish_reason})
        self.steps.append({"step": len(self.steps), "num_tokens": result.num_tokens,
                           "rows": rows})


def run_requests(model, tokenizer, speculative, draft_model, prompts, k=NUM_SPECULATIVE_TOKENS):
    """The engine with speculation over prompts (two greedy, the third sampled with a seed),
    stepped to the end: (the requests' specs, StepRecorder, SpecDecodingStats, outputs)."""
    engine = s15.build_engine(model, tokenizer, speculative=speculative,
                              num_speculative_tokens=k, draft_model=draft_model,
                              max_context=MAX_CONTEXT)
    recorder, stats = StepRecorder(), s15.SpecDecodingStats()
    engine.observers += [recorder, stats]
    specs = []
    for i, prompt in enumerate(prompts):
        rid = "abc"[i]
        sampled = i == 2
        params = (s04.SamplingParams(temperature=TEMPERATURE, seed=SEED, max_tokens=MAX_TOKENS)
                  if sampled else s04.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        engine.add_request(prompt, params, request_id=rid)
        specs.append({"id": rid, "prompt": prompt, "greedy": not sampled,
                      "temperature": TEMPERATURE if sampled else 0.0,
                      "seed": SEED if sampled else None, "max_tokens": MAX_TOKENS})
    texts = {s["id"]: [] for s in specs}
    tokens = {s["id"]: [] for s in specs}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.text_delta)
            tokens[out.request_id] += list(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for s in specs:
        s.update({"prompt_ids": tokenizer.encode(s["prompt"]), "output_ids": tokens[s["id"]],
                  "text": "".join(texts[s["id"]]), "finish_reason": reasons[s["id"]]})
    return specs, recorder, stats


def stats_dict(stats: s15.SpecDecodingStats) -> dict:
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
            "num_offered_per_pos": list(stats.num_offered_per_pos),
            "acceptance_rate": stats.acceptance_rate,
            "acceptance_per_position": stats.acceptance_per_position,
            "num_request_forwards": stats.num_request_forwards,
            "num_emitted_tokens": stats.num_emitted_tokens,
            "tokens_per_forward": stats.tokens_per_forward,
            "forwards_saved": stats.forwards_saved}


def prompts_for(kind: str, tokenizer) -> list[str]:
    if kind == "corpus":
        return s08_cli.corpus_prompts(tokenizer, 3, 0, MAX_CONTEXT)
    return list(REPEATING_PROMPTS)


def record_run(model, tokenizer, key: str) -> dict:
    """One of RUNS, recorded (see the module docstring)."""
    _, title, speculative, draft_model, prompt_kind = next(r for r in RUNS if r[0] == key)
    specs, recorder, stats = run_requests(model, tokenizer, speculative, draft_model,
                                          prompts_for(prompt_kind, tokenizer))
    return {"id": key, "title": title, "speculative": speculative,
            "draft_model": draft_model, "k": NUM_SPECULATIVE_TOKENS, "requests": specs,
            "steps": recorder.steps, "stats": stats_dict(stats)}


def pieces_of(tokenizer, runs: list[dict]) -> dict[str, str]:
    """{token id (as a string, JSON's keys): its text alone} for every id the runs show; a
    special token (EOS) by its name, which decode skips."""
    ids = set()
    for run in runs:
        for r in run["requests"]:
            ids.update(r["prompt_ids"], r["output_ids"])
        for step in run["steps"]:
            for row in step["rows"]:
                ids.update(row["drafts"], row["emitted"])
    names = {i: name for name, i in getattr(tokenizer, "special_tokens", {}).items()}
    return {str(t): names.get(t) or tokenizer.decode([t]) for t in sorted(ids)}


# ---------------------------------------------------------------------------------------------
# Part 2: the toy
# ---------------------------------------------------------------------------------------------

def normalise(weights: list[int]) -> torch.Tensor:
    """Integer weights as a float64 distribution, each w / sum(w) (the page divides the same
    way)."""
    w = torch.tensor(weights, dtype=torch.float64)
    return w / float(sum(weights))


def toy_preset(key: str, title: str, p_weights: list[int], q_weights: list[int]) -> dict:
    p, q = normalise(p_weights), normalise(q_weights)
    alpha = rej.acceptance_rate(p, q)
    wrong = torch.minimum(p, q) + (1.0 - alpha) * p        # accept min(p, q); else redraw p
    return {"id": key, "title": title, "p_weights": p_weights, "q_weights": q_weights,
            "p": p.tolist(), "q": q.tolist(), "alpha": alpha,
            "expected_tokens": [rej.expected_tokens_per_step(alpha, k)
                                for k in range(TOY_K_MAX + 1)],
            "residual": rej.residual(p, q).tolist(),
            "wrong": wrong.tolist()}


def toy() -> dict:
    return {"vocab": TOY_VOCAB, "k_max": TOY_K_MAX, "defaults": dict(TOY_DEFAULTS),
            "chi2_critical_0_001": CHI2_CRITICAL_0_001,
            "presets": [toy_preset(*preset) for preset in TOY_PRESETS]}


# ---------------------------------------------------------------------------------------------

def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError without the bundled model or the
    draft model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the speculative decoding page replays runs of the bundled model: "
                           "train it first (python scripts/train_bundled_model.py)")
    if not (s15.DRAFT_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the speculative decoding page needs the draft model "
                           "(data/draft_model)")
    torch.set_num_threads(1)
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    runs = [record_run(model, tokenizer, key) for key, *_ in RUNS]
    return {"source": "code/s15_speculative.py (build_engine: S14's engine with a proposer and "
                      "the RejectionSampler) on the bundled model, float32 on the CPU; "
                      "code/s15_rejection.py for the toy",
            "max_context": MAX_CONTEXT, "runs": runs, "pieces": pieces_of(tokenizer, runs),
            "toy": toy()}


if __name__ == "__main__":  # print the size of what the page downloads, and what happened
    import json
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes")
    for run in d["runs"]:
        st = run["stats"]
        print(run["id"], len(run["steps"]), "steps", f"acceptance {st['acceptance_rate']:.1%}",
              [round(a, 2) for a in st["acceptance_per_position"]],
              f"tokens/forward {st['tokens_per_forward']:.2f}",
              [r["finish_reason"] for r in run["requests"]])
    for p in d["toy"]["presets"]:
        print(p["id"], f"alpha {p['alpha']:.3f}",
              [round(x, 3) for x in p["expected_tokens"][:5]])
