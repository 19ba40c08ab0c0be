"""The S15 speculative decoding simulator's exported data, held against fresh engine runs, the
target alone and the formulas worked by hand.

site/simulators/speculative-decoding/export.py records three runs of code/s15_speculative.py's
engine on the bundled model (a 1-layer draft model, the target's int4 copy, n-gram lookup;
k = 4; two greedy requests and one sampled with a seed) step by step, and exports a toy's
exact values from code/s15_rejection.py; tests/test_s15_simulator_browser.py compares the page
with them. Here:

- each run equals a fresh run of the engine, recorded here by an observer written again
  (per step and request: the drafts verified, the number accepted, the tokens emitted);
- the greedy requests' outputs equal the target alone (S14's engine without speculation), token
  for token; the sampled request's output is the same in a second speculative run (its seed);
- every step keeps the rule: the emitted tokens are the accepted drafts and one more (fewer
  only when the request ended inside the run); the steps joined are the request's output; the
  engine's `SpecDecodingStats` equal the counts recomputed from the steps;
- n-gram drafts are tokens that followed an earlier occurrence of the request's last tokens;
- the runs show what the page is for: accepted and rejected drafts, corrections and bonuses;
- the token pieces are the tokenizer's (EOS by its name);
- the toy: alpha = sum min(p, q) of the normalised weights, tokens per step as the sum
  alpha^0 + ... + alpha^k, the residual and the wrong rule's distribution by hand; the
  wrong rule's differs from p unless q = p; the chi-square critical values are the 0.1%
  quantiles (torch.special.gammaincc).
"""
from __future__ import annotations

import math

import pytest
import torch

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s15_speculative as s15
from sim_browser import load_exporter

pytestmark = pytest.mark.skipif(
    not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file()
    or not (s15.DRAFT_MODEL_DIR / "model.safetensors").is_file(),
    reason="data/model or data/draft_model has no model")


@pytest.fixture(scope="module")
def exporter():
    return load_exporter("speculative-decoding", "s15_sim_export_data")


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")


class Recorder:
    """Per step, per request that emitted tokens: (id, drafts verified, accepted, emitted)."""

    def __init__(self):
        self.steps = []

    def on_plan(self, engine, plan):
        pass

    def on_step(self, engine, result):
        rows = []
        for out in result.outputs:
            if out.request_id not in result.req_ids:
                continue
            verified = out.request_id in result.num_accepted_tokens
            drafts = (list(result.plan.scheduled_spec_decode_tokens[out.request_id])
                      if verified else [])
            rows.append((out.request_id, drafts,
                         result.num_accepted_tokens.get(out.request_id, 0),
                         list(out.new_token_ids)))
        self.steps.append(rows)


def fresh_run(exporter, model, tokenizer, run: dict, speculative: bool = True):
    engine = (s15.build_engine(model, tokenizer, speculative=run["speculative"],
                               num_speculative_tokens=run["k"], draft_model=run["draft_model"],
                               max_context=exporter.MAX_CONTEXT) if speculative
              else s15.build_engine(model, tokenizer, speculative=None,
                                    max_context=exporter.MAX_CONTEXT))
    recorder = Recorder()
    engine.observers.append(recorder)
    for r in run["requests"]:
        params = s04.SamplingParams(temperature=r["temperature"], seed=r["seed"],
                                    max_tokens=r["max_tokens"])
        engine.add_request(r["prompt"], params, request_id=r["id"])
    outputs = {r["id"]: [] for r in run["requests"]}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += list(out.new_token_ids)
    return recorder.steps, outputs


def test_each_run_equals_a_fresh_engine_run(exporter, data, loaded):
    model, tokenizer = loaded
    assert [r["id"] for r in data["runs"]] == ["draft", "int4", "ngram"]
    for run in data["runs"]:
        steps, outputs = fresh_run(exporter, model, tokenizer, run)
        exported = [[(row["id"], row["drafts"], row["accepted"], row["emitted"])
                     for row in step["rows"] if row["emitted"]] for step in run["steps"]]
        assert exported == steps, run["id"]
        assert [s["step"] for s in run["steps"]] == list(range(len(steps)))
        for r in run["requests"]:
            assert r["output_ids"] == outputs[r["id"]], (run["id"], r["id"])
            assert r["prompt_ids"] == tokenizer.encode(r["prompt"])


def test_greedy_requests_equal_the_target_alone(exporter, data, loaded):
    model, tokenizer = loaded
    for run in data["runs"]:
        _, alone = fresh_run(exporter, model, tokenizer, run, speculative=False)
        greedy = [r for r in run["requests"] if r["greedy"]]
        assert len(greedy) == 2 and len(run["requests"]) == 3
        for r in greedy:
            assert r["output_ids"] == alone[r["id"]], (run["id"], r["id"])
        sampled = run["requests"][2]
        assert not sampled["greedy"] and sampled["seed"] is not None
        assert sampled["temperature"] > 0


def test_every_step_keeps_the_rule_and_the_stats_add_up(data):
    for run in data["runs"]:
        made = {r["id"]: [] for r in run["requests"]}
        per_pos_offered, per_pos_accepted = [0] * run["k"], [0] * run["k"]
        drafts = accepted = forwards = emitted = verifications = 0
        for step in run["steps"]:
            for row in step["rows"]:
                a, e, d = row["accepted"], row["emitted"], row["drafts"]
                made[row["id"]] += e
                if row["kind"] == "plain":
                    assert d == [] and a == 0 and len(e) == 1
                else:
                    assert 1 <= len(d) <= run["k"] and 0 <= a <= len(d)
                    assert e[:a] == d[:len(e[:a])]
                    assert len(e) == a + 1 or (row["finished"] and len(e) < a + 1)
                    verifications += 1
                    drafts += len(d)
                    accepted += a
                    for j in range(len(d)):
                        per_pos_offered[j] += 1
                        per_pos_accepted[j] += j < a
                if e:
                    forwards += 1
                    emitted += len(e)
        for r in run["requests"]:
            assert made[r["id"]] == r["output_ids"]
            assert r["finish_reason"] in ("stop", "length")
            assert len(r["output_ids"]) <= r["max_tokens"]
        st = run["stats"]
        assert (st["num_drafts"], st["num_draft_tokens"], st["num_accepted_tokens"]) == (
            verifications, drafts, accepted)
        assert st["num_offered_per_pos"] == per_pos_offered
        assert st["num_accepted_tokens_per_pos"] == per_pos_accepted
        assert (st["num_request_forwards"], st["num_emitted_tokens"]) == (forwards, emitted)
        assert st["acceptance_rate"] == pytest.approx(accepted / drafts)
        assert st["tokens_per_forward"] == pytest.approx(emitted / forwards)
        assert st["forwards_saved"] == emitted - forwards


def test_ngram_drafts_follow_an_earlier_occurrence(data):
    run = next(r for r in data["runs"] if r["id"] == "ngram")
    context = {r["id"]: list(r["prompt_ids"]) for r in run["requests"]}
    checked = 0
    for step in run["steps"]:
        for row in step["rows"]:
            ids, d = context[row["id"]], row["drafts"]
            if d:
                # some n >= 1: the last n tokens occur earlier, and the drafts followed them
                found = any(ids[i:i + n] == ids[-n:] and ids[i + n:i + n + len(d)] == d
                            for n in range(1, 5) for i in range(len(ids) - n))
                assert found, (step["step"], row["id"])
                checked += 1
            context[row["id"]] += row["emitted"]
    assert checked >= 5


def test_the_runs_show_what_the_page_is_for(data):
    kinds = {}
    for run in data["runs"]:
        seen = set()
        for step in run["steps"]:
            for row in step["rows"]:
                if row["kind"] != "verify":
                    continue
                a, n = row["accepted"], len(row["drafts"])
                seen.add("accepted" if a else "none accepted")
                if a < n:
                    seen.add("rejected")
                    if len(row["emitted"]) == a + 1:
                        seen.add("correction")
                elif len(row["emitted"]) == a + 1:
                    seen.add("bonus")
        kinds[run["id"]] = seen
    assert {"accepted", "rejected", "correction"} <= kinds["draft"]
    assert "bonus" in kinds["int4"]
    assert {"accepted", "rejected"} <= kinds["ngram"]
    rates = {run["id"]: run["stats"]["acceptance_rate"] for run in data["runs"]}
    assert rates["int4"] > rates["draft"] > 0 and rates["int4"] > rates["ngram"] > 0


def test_pieces_are_the_tokenizers(data, loaded):
    _, tokenizer = loaded
    specials = {i: name for name, i in tokenizer.special_tokens.items()}
    for key, piece in data["pieces"].items():
        t = int(key)
        assert piece == specials.get(t, tokenizer.decode([t]))


def test_the_toy_by_hand(data):
    toy = data["toy"]
    assert len(toy["vocab"]) == 6 and toy["k_max"] >= 4
    ids = [p["id"] for p in toy["presets"]]
    assert ids == ["close", "overconfident", "blind", "same"]
    for pr in toy["presets"]:
        pw, qw = pr["p_weights"], pr["q_weights"]
        p = [w / sum(pw) for w in pw]
        q = [w / sum(qw) for w in qw]
        assert pr["p"] == p and pr["q"] == q
        alpha = sum(min(a, b) for a, b in zip(p, q))
        assert pr["alpha"] == pytest.approx(alpha, abs=1e-12)
        for k, tokens in enumerate(pr["expected_tokens"]):
            assert tokens == pytest.approx(sum(alpha ** j for j in range(k + 1)), rel=1e-9)
        res = [max(a - b, 0.0) for a, b in zip(p, q)]
        res = [x / sum(res) for x in res] if sum(res) > 1e-15 else p
        assert pr["residual"] == pytest.approx(res, abs=1e-12)
        wrong = [min(a, b) + (1 - alpha) * a for a, b in zip(p, q)]
        assert pr["wrong"] == pytest.approx(wrong, abs=1e-12)
        assert sum(pr["wrong"]) == pytest.approx(1.0)
        # the rule: accepted drafts min(p, q) plus a rejection's residual (1 - alpha) r = p
        rebuilt = [min(a, b) + (1 - alpha) * r for a, b, r in zip(p, q, pr["residual"])]
        assert rebuilt == pytest.approx(p, abs=1e-12)
        if pr["id"] == "same":
            assert pr["alpha"] == pytest.approx(1.0) and pr["wrong"] == pytest.approx(p)
        else:
            assert max(abs(a - b) for a, b in zip(pr["wrong"], p)) > 0.01
    by_id = {p["id"]: p for p in toy["presets"]}
    assert by_id["blind"]["q"][2] == by_id["blind"]["q"][3] == 0.0
    assert by_id["close"]["alpha"] > 0.8 and by_id["overconfident"]["alpha"] <= 0.5


def test_chi_square_critical_values(data):
    for df, crit in enumerate(data["toy"]["chi2_critical_0_001"], start=1):
        tail = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                             torch.tensor(crit / 2, dtype=torch.float64)))
        assert tail == pytest.approx(0.001, rel=2e-3), df
    assert len(data["toy"]["chi2_critical_0_001"]) >= len(data["toy"]["vocab"]) - 1
    assert math.isfinite(sum(data["toy"]["chi2_critical_0_001"]))
