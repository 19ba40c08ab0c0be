"""The S11 step timeline's exported runs are what the engine does, held against independent
oracles.

site/simulators/step-timeline/export.py serves two workloads of corpus prompts and one long
prompt with S11's engine, each twice (chunking off and on; no per-request limit and one), and
records every request's tokens and the engine's trace, which the page replays
(tests/test_s11_simulator_browser.py). Here:

- every request's generated ids, text and finish reason equal S06's single-request engine run
  on that prompt alone with the same parameters: neither the chunks nor the requests beside
  them changed a token;
- the trace keeps the chunking rules, checked step by step from the trace alone: the budget
  and the per-request limit never exceeded; every admitted request scheduled in every step
  until it leaves (decodes never stall); each request's pieces contiguous (a piece starts
  where the last one ended) and its length when scheduled its prompt plus the tokens it had
  made; a request samples exactly when its new tokens reach that length, so never before its
  prompt is complete, and a decode is one token after the prompt; running requests before
  those admitted, in admission order;
- the summary (first-token steps and the worst gap between two tokens of one request) equals
  the one worked out here from the token timestamps of the outputs and the trace's step sizes;
- the workloads show what they are there to show: in "stall" the long prompt runs whole in one
  step without chunking and in chunks with it, and the worst gap falls at least fivefold (the
  issue's target) to at most the budget, for a later first token of the long prompt; in
  "threshold" the limit lets the short prompts' first tokens come sooner, and the long
  prompt's later.
"""
from __future__ import annotations

import pytest

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
from sim_browser import load_exporter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")]


@pytest.fixture(scope="module")
def exporter():
    return load_exporter("step-timeline", "s11_sim_export_data")


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


def prompts_of(exporter, tokenizer, work: dict) -> list[str]:
    import s07_workloads
    import s08_cli
    order = next(w[2] for w in exporter.WORKLOADS if w[0] == work["id"])
    chats = s08_cli.corpus_prompts(tokenizer, 4, 0, exporter.MAX_CONTEXT)
    long_prompt = s07_workloads.make_workload("long", tokenizer, 1, exporter.LONG_SEED,
                                              exporter.MAX_CONTEXT).requests[0].prompt
    return [long_prompt if o == "L" else chats[o] for o in order]


def test_each_request_equals_its_prompt_run_alone(data, exporter):
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    single = s06.Engine(model, tokenizer, data["max_context"])
    for work in data["workloads"]:
        prompts = prompts_of(exporter, tokenizer, work)
        for run in work["runs"]:
            for req, prompt in zip(run["requests"], prompts):
                assert len(tokenizer.encode(prompt)) == req["prompt_len"]
                alone = single.generate(prompt, s04.SamplingParams(
                    temperature=0.0, max_tokens=req["max_tokens"]))
                assert [g[1] for g in req["generated"]] == alone.token_ids, (
                    work["id"], run["label"], req["id"])
                assert req["text"] == alone.text
                assert req["finish_reason"] == alone.finish_reason


def test_the_trace_keeps_the_chunking_rules(data):
    for work in data["workloads"]:
        for run in work["runs"]:
            reqs = {r["id"]: r for r in run["requests"]}
            budget, limit = run["max_num_batched_tokens"], run["long_prefill_token_threshold"]
            computed = {rid: 0 for rid in reqs}       # tokens in the cache before the step
            made = {rid: 0 for rid in reqs}
            order, done, where = [], set(), (work["id"], run["label"])
            for k, rec in enumerate(run["trace"]):
                assert rec["step"] == k and rec["token_budget"] == budget
                assert rec["num_tokens"] == sum(rec["num_scheduled_tokens"]) <= budget
                assert rec["preempted"] == rec["resumed"] == rec["ended"] == []
                # running ones first, in admission order, then those admitted in this step
                assert rec["running"] == order + rec["joined"], (where, k)
                order += rec["joined"]
                assert set(rec["running"]) == set(order)          # nobody stalls
                pieces = zip(rec["running"], rec["num_scheduled_tokens"], rec["kinds"],
                             rec["num_computed_tokens"], rec["request_num_tokens"])
                for rid, n, kind, start, total in pieces:
                    r = reqs[rid]
                    assert r["arrival"] <= k and rid not in done
                    assert start == computed[rid] and total == r["prompt_len"] + made[rid]
                    assert 1 <= n and start + n <= total
                    assert (rid in rec["sampled"]) == (start + n == total), (where, k, rid)
                    is_decode = start >= r["prompt_len"] and total - start == 1
                    assert kind == ("decode" if is_decode else "prefill")
                    if kind == "prefill" and limit:
                        assert n <= limit
                    computed[rid] = start + n
                    if rid in rec["sampled"]:
                        made[rid] += 1
                        computed[rid] = total         # the sampled token is not in the cache
                done |= set(rec["left"])
                order = [rid for rid in order if rid not in rec["left"]]
            assert done == set(reqs) and order == []
            for rid, r in reqs.items():
                steps = [k for k, rec in enumerate(run["trace"]) if rid in rec["sampled"]]
                assert [g[0] for g in r["generated"]] == steps     # one token per sampling step
                assert made[rid] == len(r["generated"])


def worst_gap_and_firsts(run: dict) -> tuple[int, dict]:
    """From the outputs' token steps and the trace's step sizes only."""
    work = [rec["num_tokens"] for rec in run["trace"]]
    worst, firsts = 0, {}
    for req in run["requests"]:
        steps = [g[0] for g in req["generated"]]
        firsts[req["id"]] = steps[0]
        for a, b in zip(steps, steps[1:]):
            worst = max(worst, sum(work[a + 1:b + 1]))
    return worst, firsts


def test_the_summary_is_what_the_outputs_and_trace_say(data):
    for work in data["workloads"]:
        for run in work["runs"]:
            worst, firsts = worst_gap_and_firsts(run)
            summary = run["summary"]
            assert summary["worst_gap"]["tokens"] == worst
            assert summary["first_token_step"] == firsts
            assert summary["steps"] == len(run["trace"])
            assert summary["tokens_computed"] == sum(r["num_tokens"] for r in run["trace"])


def test_the_workloads_show_the_stall_and_the_limit(data):
    works = {w["id"]: w for w in data["workloads"]}
    assert set(works) == {"stall", "threshold"}

    def long_pieces(work, run):
        return [n for rec in run["trace"] for rid, n, kind in zip(
            rec["running"], rec["num_scheduled_tokens"], rec["kinds"])
            if rid == work["long_id"] and kind == "prefill"]

    stall = works["stall"]
    off, on = stall["runs"]
    long_len = next(r["prompt_len"] for r in off["requests"] if r["id"] == stall["long_id"])
    assert long_len > on["max_num_batched_tokens"]
    assert long_pieces(stall, off) == [long_len]                  # whole, in one step
    assert len(long_pieces(stall, on)) > 1 and sum(long_pieces(stall, on)) == long_len
    gap_off, gap_on = off["summary"]["worst_gap"]["tokens"], on["summary"]["worst_gap"]["tokens"]
    assert gap_on <= on["max_num_batched_tokens"] and gap_off >= 5 * gap_on
    first = lambda run, rid: run["summary"]["first_token_step"][rid]   # noqa: E731
    assert first(on, stall["long_id"]) > first(off, stall["long_id"])

    limit = works["threshold"]
    free, capped = limit["runs"]
    assert free["long_prefill_token_threshold"] == 0 < capped["long_prefill_token_threshold"]
    shorts = [r for r in free["requests"] if r["id"] != limit["long_id"]]
    ttft = lambda run: sum(first(run, r["id"]) - r["arrival"] for r in shorts)  # noqa: E731
    assert ttft(capped) < ttft(free)
    assert first(capped, limit["long_id"]) > first(free, limit["long_id"])
    assert max(long_pieces(limit, capped)) == capped["long_prefill_token_threshold"]
