"""The S10 stepper's exported runs are what the engine does, held against independent oracles.

site/simulators/scheduler-stepper/export.py serves a few workloads of corpus prompts with S10's
engine and a KV capacity small enough to force preemptions, and records every request's tokens
and the engine's trace, which the page replays (tests/test_s10_simulator_browser.py). Here:

- every request's generated ids, text and finish reason equal S06's single-request engine run on
  that prompt alone with the same parameters: neither the schedule nor the preemptions (the
  recompute) changed a token;
- the trace keeps the scheduler's rules, checked step by step from the trace alone: seats, the
  token budget and the KV capacity never exceeded; a request computes its prompt when it joins,
  its prompt and every output it had when it resumes, one token otherwise; the running ones are
  scheduled first, in admission order; nobody joins in a step with a preemption; KV held equals
  the context of every running request; the victim of a preemption is the last admitted (FCFS)
  or the lowest priority, latest arrival (priority); first admissions in arrival order (FCFS)
  or priority order (priority); each request makes one token in each step it is scheduled;
  every preemption is counted;
- the workloads show what they are there to show: preemptions in each, and in "budget" steps
  where requests wait by a free seat because the token budget or KV is spent.
- the command line the page shows for each workload, run through code/s10_scheduler.py's
  main, makes the same run (steps, tokens, preemptions, every completion and finish reason).
"""
from __future__ import annotations

import pytest

import s03_transformer as s03
import s04_sampling as s04
import s06_torch as s06
import s08_cli
from sim_browser import load_exporter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
                                 reason="data/model has no bundled model")]


@pytest.fixture(scope="module")
def data():
    return load_exporter("scheduler-stepper", "s10_sim_export_data").export()


def test_each_request_equals_its_prompt_run_alone(data):
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    for work in data["workloads"]:
        single = s06.Engine(model, tokenizer, work["max_context"])
        prompts = s08_cli.corpus_prompts(tokenizer, len(work["requests"]), work["seed"], 256)
        for req, prompt in zip(work["requests"], prompts):
            assert len(tokenizer.encode(prompt)) == req["prompt_len"]
            alone = single.generate(prompt, s04.SamplingParams(temperature=0.0,
                                                               max_tokens=work["max_tokens"]))
            ids = [g[1] for g in req["generated"]]
            if req["ended_by_capacity"]:      # the capacity was its context limit
                assert ids == alone.token_ids[:len(ids)] and req["finish_reason"] == "length"
                continue
            assert ids == alone.token_ids, (work["id"], req["id"])
            assert req["text"] == alone.text and req["finish_reason"] == alone.finish_reason
            assert [g[2] for g in req["generated"]] == [tokenizer.decode([t])
                                                        for t in alone.token_ids]


def key_of(work, req):
    return (req["priority"], int(req["id"])) if work["policy"] == "priority" else (0, int(req["id"]))


def test_the_trace_keeps_the_schedulers_rules(data):
    for work in data["workloads"]:
        reqs = {r["id"]: r for r in work["requests"]}
        made = {rid: 0 for rid in reqs}                # outputs before the current step
        order: list[str] = []                          # running, in admission order
        first_joins, preempted_count, done = [], {rid: 0 for rid in reqs}, set()
        cap, budget = work["kv_capacity"], work["max_num_batched_tokens"]
        for k, rec in enumerate(work["trace"]):
            assert rec["step"] == k and rec["token_budget"] == budget
            assert rec["num_tokens"] == sum(rec["num_scheduled_tokens"]) <= budget
            assert rec["kv_used_tokens"] + rec["kv_free_tokens"] == rec["kv_capacity"] == cap
            tokens = dict(zip(rec["running"], rec["num_scheduled_tokens"]))
            for rid, n in tokens.items():
                r = reqs[rid]
                want = (r["prompt_len"] if rid in rec["joined"] else
                        r["prompt_len"] + made[rid] if rid in rec["resumed"] else 1)
                assert n == want, (work["id"], k, rid)
                assert r["arrival"] <= k and rid not in done
            assert rec["prefill_tokens"] == sum(tokens[r] for r in rec["joined"] + rec["resumed"])
            # Preemption: the victims, taken from the running order at the start of the step.
            for victim in rec["preempted"]:
                assert victim in order
                rest = [r for r in order if r != victim]
                if work["policy"] == "fcfs":
                    assert order[-1] == victim, (work["id"], k)
                else:
                    assert all(key_of(work, reqs[victim]) > key_of(work, reqs[r]) for r in rest)
                order = rest
                preempted_count[victim] += 1
            if rec["preempted"]:
                assert not rec["joined"] and not rec["resumed"]      # no one joins this step
            order = [r for r in order if r not in rec["ended"]]
            admitted = rec["resumed"] + rec["joined"]
            # schedule order: the running ones first, in admission order, then those admitted
            assert rec["running"] == [r for r in order if r in tokens] + [
                r for r in rec["running"] if r in admitted], (work["id"], k)
            if work["policy"] == "priority":
                admitted = sorted(admitted, key=lambda r: key_of(work, reqs[r]))
                waiting = [r for r in reqs if reqs[r]["arrival"] <= k and r not in done
                           and r not in tokens and r not in order]
                if admitted and waiting:                             # strict priority order
                    assert max(key_of(work, reqs[r]) for r in admitted) < min(
                        key_of(work, reqs[r]) for r in waiting)
            order += admitted
            first_joins += rec["joined"]
            assert len(order) <= work["max_num_seqs"] and set(tokens) <= set(order)
            if not rec["preempted"]:                  # everyone running was scheduled
                assert set(tokens) == set(order)
                assert rec["kv_used_tokens"] == sum(reqs[r]["prompt_len"] + made[r]
                                                    for r in order)
            assert rec["kv_used_tokens"] <= cap
            for rid in tokens:
                made[rid] += 1
            done |= set(rec["left"])
            order = [r for r in order if r not in rec["left"]]
        if work["policy"] == "fcfs":
            assert first_joins == sorted(first_joins, key=int)
        assert done == set(reqs) and order == []
        for rid, r in reqs.items():
            assert made[rid] == len(r["generated"])
            assert r["num_preemptions"] == preempted_count[rid]
            steps = [k for k, rec in enumerate(work["trace"]) if rid in rec["running"]]
            assert [g[0] for g in r["generated"]] == steps      # one token per scheduled step
        assert work["num_preemptions"] == sum(preempted_count.values())


def test_the_workloads_show_preemption_and_the_token_budget(data):
    works = {w["id"]: w for w in data["workloads"]}
    assert set(works) == {"fcfs", "priority", "budget"}
    for work in works.values():
        assert work["num_preemptions"] > 0, work["id"]
        assert any(rec["resumed"] for rec in work["trace"]), work["id"]
    budget = works["budget"]
    assert budget["max_num_batched_tokens"] < budget["max_num_seqs"] * budget["max_context"]
    assert any(rec["waiting"] and not rec["preempted"]
               and len(rec["running"]) < budget["max_num_seqs"] for rec in budget["trace"])
    assert max(rec["num_tokens"] for rec in budget["trace"]) > budget["max_num_batched_tokens"] // 2


def test_each_workloads_command_makes_the_same_run(data, capsys):
    """The command the page shows for a workload, run through code/s10_scheduler.py's main,
    makes the exported run: the same number of steps, tokens and preemptions, and every
    request's prompt length, preemption count, completion text and finish reason."""
    import re
    import shlex

    import s10_scheduler

    for work in data["workloads"]:
        words = shlex.split(work["command"])
        assert words[:2] == ["python", "code/s10_scheduler.py"], work["command"]
        assert ("--max-context" in words) == (work["max_context"] != 256)
        capsys.readouterr()
        s10_scheduler.main(words[2:])
        out = capsys.readouterr().out
        summary = re.search(r"^--- (\d+) tokens in (\d+) steps, [\d.]+ s ", out, re.MULTILINE)
        assert summary, out[-2000:]
        header = out.splitlines()[0]
        preemptions = re.search(r"; (\d+) preemptions?$", header)
        assert preemptions, header
        made = sum(len(r["generated"]) for r in work["requests"])
        assert tuple(map(int, summary.groups() + preemptions.groups())) == (
            made, len(work["trace"]), work["num_preemptions"]), work["id"]
        assert f"context {work['max_context']};" in header
        for req in work["requests"]:
            head = re.search(rf"^--- request {req['id']}: prompt \((\d+) tokens?\), "
                             rf"(not preempted|preempted once|preempted (\d+) times) ---$",
                             out, re.MULTILINE)
            assert head, (req["id"], out[-2000:])
            times = {"not preempted": 0, "preempted once": 1}.get(head.group(2))
            times = int(head.group(3)) if times is None else times
            assert (int(head.group(1)), times) == (req["prompt_len"], req["num_preemptions"])
            assert (f"--- completion ({len(req['generated'])} tokens, "
                    f"finish_reason={req['finish_reason']}) ---\n"
                    f"{req['text']}\n") in out[head.end():], (work["id"], req["id"])
