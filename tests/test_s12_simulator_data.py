"""The S12 block allocator's exported runs are what the engine does, held against independent
oracles.

site/simulators/block-allocator/export.py serves two workloads of corpus prompts with S12's
engine (a tight pool that preempts, a roomy one that does not) and records every request's
tokens and, per step, the block tables, slot mappings, pool changes and free queue, which the
page replays (tests/test_s12_simulator_browser.py). Here:

- every request's generated ids, text and finish reason equal S06's single-request engine run
  on that prompt alone with the same parameters: neither the blocks nor the requests beside
  them, nor a preemption, changed a token;
- a model of the pool written here (a deque: allocation from the front, a request's blocks
  given back last block first to the back, block 0 never handed out), fed only the kinds,
  requests and block counts of the exported changes, hands out and takes back exactly the
  exported block ids and ends each step with the exported free queue;
- the accounting holds after every step: free + held == usable; a scheduled request with t
  tokens after the plan holds ceil(t / block_size) blocks; no block in two tables, in a table
  and the free queue, or the null block anywhere; every slot written is the block-table
  arithmetic and no slot is written twice in a step; everything is free at the end;
- every preemption's cause (which the exporter works out from the trace's pool changes and
  schedule) agrees with the trace and S10's rule: the request that asked held fewer blocks
  than its tokens need, more than were free; the victim is the last admitted of those running
  (admission order rebuilt from the trace's joins and resumes); when the victim is another
  request, the asker's allocation is the pool's next change, and when it is the asker itself
  (a self-preemption) it is not scheduled in the step;
- the workloads show what they are there to show: in "tight" requests are preempted, each
  preemption gives back every block of the victim, and a block given back is later handed to
  another request; in "roomy" nobody is preempted and blocks freed by a finish are reused.
"""
from __future__ import annotations

import math
from collections import deque

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
    return load_exporter("block-allocator", "s12_sim_export_data")


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


def test_each_request_equals_its_prompt_run_alone(data, exporter):
    import s08_cli
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    single = s06.Engine(model, tokenizer, data["max_context"])
    chats = s08_cli.corpus_prompts(tokenizer, 6, 0, exporter.MAX_CONTEXT)
    for work, spec in zip(data["workloads"], exporter.WORKLOADS):
        assert work["id"] == spec[0]
        for req, corpus_index in zip(work["requests"], spec[2]):
            prompt = chats[corpus_index]
            assert len(tokenizer.encode(prompt)) == req["prompt_len"]
            alone = single.generate(prompt, s04.SamplingParams(
                temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True))
            assert req["made"] == alone.token_ids, (work["id"], req["id"])
            assert req["text"] == alone.text
            assert req["finish_reason"] == alone.finish_reason


def test_a_model_of_the_pool_replays_every_change(data):
    for work in data["workloads"]:
        queue = deque(range(1, work["num_blocks"]))
        tables: dict[str, list[int]] = {}
        for st in work["steps"]:
            for kind, rid, ids in st["events"]:
                if kind == "allocated":
                    got = [queue.popleft() for _ in ids]
                    tables.setdefault(rid, []).extend(got)
                else:
                    table = tables[rid]
                    got = table[len(table) - len(ids):][::-1]
                    del table[len(table) - len(ids):]
                    queue.extend(got)
                    if not table:
                        del tables[rid]
                assert got == ids, (work["id"], st["step"], kind, rid)
            assert list(queue) == st["free_queue"], (work["id"], st["step"])


def test_the_accounting_holds_after_every_step(data):
    null = data["null_block"]
    for work in data["workloads"]:
        bs, usable = work["block_size"], work["num_blocks"] - 1
        for st in work["steps"]:
            held = {rid: t for rid, t in st["block_tables"].items() if rid not in st["left"]}
            blocks = [b for t in held.values() for b in t]
            assert len(blocks) == len(set(blocks)), st["step"]           # no block shared
            assert not set(blocks) & set(st["free_queue"])
            assert null not in blocks and null not in st["free_queue"]
            assert len(blocks) + st["free_blocks"] == usable == len(blocks) + len(st["free_queue"])
            written = []
            for rid, start, n in st["scheduled"]:
                table = st["block_tables"][rid]
                assert len(table) == math.ceil((start + n) / bs), (work["id"], st["step"], rid)
                want = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                assert st["slot_mapping"][rid] == want[:len(st["slot_mapping"][rid])]
                assert len(st["slot_mapping"][rid]) == min(n, 64)
                written += want
            assert len(written) == len(set(written)), st["step"]         # no slot written twice
        last = work["steps"][-1]
        assert sorted(last["free_queue"]) == list(range(1, work["num_blocks"]))


def test_each_preemption_says_who_asked_and_follows_s10s_rule(data):
    selves = 0
    for work in data["workloads"]:
        bs, admitted = work["block_size"], []           # running requests, admission order
        for st in work["steps"]:
            causes = st["preemptions"]
            assert [c["victim"] for c in causes] == st["preempted"], (work["id"], st["step"])
            events = [tuple(e[:2]) for e in st["events"]]
            for c in causes:
                at = (work["id"], st["step"], c)
                assert c["needed"] == math.ceil(c["tokens"] / bs) > c["held"]
                assert c["needed"] - c["held"] > c["free"] >= 0
                assert admitted[-1] == c["victim"], at            # the last admitted goes
                admitted.remove(c["victim"])
                where = events.index(("freed", c["victim"]))
                scheduled = [r[0] for r in st["scheduled"]]
                if c["by"] == c["victim"]:
                    selves += 1
                    assert c["by"] not in scheduled, at
                else:
                    assert c["by"] in scheduled and events[where + 1] == ("allocated", c["by"]), at
            admitted += [rid for rid, _, _ in st["scheduled"]          # in schedule order
                         if rid in st["joined"] or rid in st["resumed"]]
            for rid in st["left"]:
                admitted.remove(rid)
    assert selves >= 1          # the tight run shows a request preempting itself


def test_the_workloads_show_preemption_finishes_and_reuse(data):
    works = {w["id"]: w for w in data["workloads"]}
    for key in ("tight", "roomy"):
        work, given_back, reused = works[key], {}, 0
        tables: dict[str, list[int]] = {}
        for st in work["steps"]:
            for kind, rid, ids in st["events"]:
                if kind == "allocated":
                    reused += sum(1 for b in ids if given_back.get(b, rid) != rid)
                    tables.setdefault(rid, []).extend(ids)
                else:
                    for b in ids:
                        given_back[b] = rid
                    if rid in st["preempted"]:
                        assert sorted(ids) == sorted(tables[rid])       # every block of it
                    tables[rid] = [b for b in tables[rid] if b not in ids]
        preemptions = sum(len(st["preempted"]) for st in work["steps"])
        finishes = sum(len(st["left"]) for st in work["steps"])
        assert finishes == len(work["requests"]) and reused > 0, key
        if key == "tight":
            assert preemptions == work["num_preemptions"] >= 1
        else:
            assert preemptions == work["num_preemptions"] == 0
