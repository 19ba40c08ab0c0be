"""The S09 simulator's exported runs are what the engines do, held against independent oracles.

site/simulators/continuous-batch/export.py serves a few workloads of corpus prompts with S08's
static batches and S09's continuous batching and records every request's tokens, the S09
engine's trace and S08's per-batch step counts, which the page replays
(tests/test_s09_simulator_browser.py). Here:

- every request's generated ids, text and finish reason equal S06's single-request engine run on
  that prompt alone with the same parameters: neither schedule changed a token;
- the trace obeys continuous batching's rules, checked step by step: each request runs in
  exactly as many consecutive steps as it makes tokens, in one slot, joining in its first and
  leaving in its last; no two requests share a slot in a step; nobody waits while a slot is
  free (the free slots are the engine's KV manager's); requests join in arrival order and are
  scheduled in admission order; the tokens of a step are its joiners' prompts plus one
  per other running request;
- the static batches follow the closed form: batch b is requests bM .. bM + M - 1 and runs
  max(n) steps, with sum(max(n) - n_i) row-steps of finished rows.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")]


@pytest.fixture(scope="module")
def data():
    spec = importlib.util.spec_from_file_location(
        "s09_sim_export_data", ROOT / "site" / "simulators" / "continuous-batch" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.export()


def test_each_request_equals_its_prompt_run_alone(data):
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    import s08_cli
    single = s06.Engine(model, tokenizer, model.config.max_position_embeddings)
    for work in data["workloads"]:
        seed = work["seed"]
        prompts = s08_cli.corpus_prompts(tokenizer, len(work["requests"]), seed,
                                     min(model.config.max_position_embeddings, 4096))
        for req, prompt in zip(work["requests"], prompts):
            assert len(tokenizer.encode(prompt)) == req["prompt_len"]
            alone = single.generate(prompt, s04.SamplingParams(
                temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=work["ignore_eos"]))
            assert [g[1] for g in req["generated"]] == alone.token_ids
            assert req["text"] == alone.text and req["finish_reason"] == alone.finish_reason
            assert [g[2] for g in req["generated"]] == [tokenizer.decode([t])
                                                        for t in alone.token_ids]


def test_the_trace_follows_the_rules_of_continuous_batching(data):
    for work in data["workloads"]:
        m, trace = work["max_batch"], work["trace"]
        outputs = {r["id"]: len(r["generated"]) for r in work["requests"]}
        prompts = {r["id"]: r["prompt_len"] for r in work["requests"]}
        steps_of = {rid: [] for rid in outputs}
        joined_order, running = [], []                # running: admission order
        for k, rec in enumerate(trace):
            assert rec["step"] == k
            assert rec["running"] == running + rec["joined"]       # schedule order
            running = [r for r in rec["running"] if r not in rec["left"]]
            assert len(set(rec["slots"])) == len(rec["slots"]) <= m
            assert rec["free_slots"] == m - len(rec["running"])
            assert rec["waiting"] == 0 or rec["free_slots"] == 0       # no idle slot while waiting
            for rid in rec["running"]:
                steps_of[rid].append((k, rec["slots"][rec["running"].index(rid)]))
            joined_order += rec["joined"]
            assert rec["num_tokens"] == sum(prompts[r] if r in rec["joined"] else 1
                                            for r in rec["running"])
            assert rec["prefill_tokens"] == sum(prompts[r] for r in rec["joined"])
        assert joined_order == [r["id"] for r in work["requests"]]             # FIFO
        for rid, seen in steps_of.items():
            first = seen[0][0]
            assert [s for s, _ in seen] == list(range(first, first + outputs[rid]))
            assert len({slot for _, slot in seen}) == 1
            assert rid in trace[first]["joined"] and rid in trace[seen[-1][0]]["left"]
            for rec in trace[seen[-1][0] + 1:]:
                assert rid not in rec["running"]
            for s, _ in seen:                            # one token per step, returned in it
                assert [g[0] for g in next(r for r in work["requests"]
                                           if r["id"] == rid)["generated"]] == [s for s, _ in seen]
        total = sum(outputs.values())
        assert len(trace) >= max(-(-total // m), max(outputs.values()))


def test_static_batches_follow_the_closed_form(data):
    for work in data["workloads"]:
        m = work["max_batch"]
        outputs = [len(r["generated"]) for r in work["requests"]]
        batches = work["static"]["batches"]
        assert len(batches) == -(-len(outputs) // m)
        for b, batch in enumerate(batches):
            members = outputs[b * m:(b + 1) * m]
            assert batch["requests"] == [str(i) for i in range(b * m, b * m + len(members))]
            assert batch["steps"] == max(members)
            assert batch["decode_row_steps"] == len(members) * (max(members) - 1)
            assert batch["idle_row_steps"] == sum(max(members) - n for n in members)


def test_the_chapter_figure_is_what_the_s09_code_draws():
    """chapters/figures/s09-continuous-batch.svg is scripts/s09_figure.py's drawing of real S08
    and S09 runs (rerun the script after changing the engines or the model)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "s09_figure.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
