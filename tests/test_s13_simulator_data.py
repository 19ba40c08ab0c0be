"""The S13 prefix-cache page's exported runs are what the engine does, held against independent
oracles.

site/simulators/prefix-cache/export.py serves three workloads on the bundled model with S13's
engine (a shared system prompt, a small pool that evicts, a three-turn chat) and records every
request's tokens, the names of its full blocks and the engine's trace, which the page replays
(tests/test_s13_simulator_browser.py). Here:

- every request's generated ids, text and finish reason equal S06's single-request engine run
  on that prompt alone: a prefix hit changed no token;
- every block name equals the first 8 hex digits of a SHA-256 chain written out here from the
  encoding the chapter states (parent hash, token count, int64 ids, extra-key count), over the
  prompt's ids and the generated ids;
- the trace keeps the cache's rules, checked step by step from the trace alone: a block's
  ref_cnt when scheduled is the number of scheduled block tables that hold it (every running
  request is scheduled in every step); a hit is a whole number of blocks, at most
  (tokens - 1) // block size of them, and its blocks carried exactly the request's first names
  in the cache after the step before; a request's first chunk starts after its hit; an evicted
  block never gives a hit under its old name; once the last request has finished no block is
  held (the free queue holds every usable block) while cached blocks remain in it;
- the summary equals the one worked out here from the trace;
- the workloads show what they are there to show: in "system" every later request finds the
  whole system prompt and five requests hold its blocks at once; in "evict" the unrelated
  requests evict the end of the system prompt's chain before its head, so the last request
  finds part of it; in "chat" each turn finds more than the previous turn's prompt: the
  previous answer's blocks too.
"""
from __future__ import annotations

import hashlib
import struct

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
    return load_exporter("prefix-cache", "s13_sim_export_data")


@pytest.fixture(scope="module")
def data(exporter):
    return exporter.export()


@pytest.fixture(scope="module")
def tokenizer():
    return s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")[1]


def chain(ids: list[int], size: int) -> list[str]:
    """Block names as the chapter states them, written out again: no code/ call."""
    parent, names = hashlib.sha256(b"s13 prefix cache: no parent block").digest(), []
    for i in range(len(ids) // size):
        block = ids[i * size:(i + 1) * size]
        data = parent + struct.pack("<I", len(block)) + b"".join(struct.pack("<q", t) for t in block)
        parent = hashlib.sha256(data + struct.pack("<I", 0)).digest()
        names.append(parent.hex()[:8])
    return names


def test_each_request_equals_its_prompt_run_alone(data):
    model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
    single = s06.Engine(model, tokenizer, data["max_context"])
    for work in data["workloads"]:
        for req in work["requests"]:
            assert len(tokenizer.encode(req["prompt"])) == req["prompt_len"]
            alone = single.generate(req["prompt"], s04.SamplingParams(
                temperature=0.0, max_tokens=req["max_tokens"]))
            assert [g[1] for g in req["generated"]] == alone.token_ids, (work["id"], req["id"])
            assert req["text"] == alone.text and req["finish_reason"] == alone.finish_reason


def test_block_names_are_the_sha256_chain(data, tokenizer):
    for work in data["workloads"]:
        for req in work["requests"]:
            ids = tokenizer.encode(req["prompt"]) + [g[1] for g in req["generated"]]
            assert req["hashes"] == chain(ids, work["block_size"]), (work["id"], req["id"])


def test_the_trace_keeps_the_cache_rules(data):
    for work in data["workloads"]:
        size, trace = work["block_size"], work["trace"]
        names = {r["id"]: r["hashes"] for r in work["requests"]}
        cached_before: dict[int, str] = {}
        named_at: dict[int, int] = {}                 # block -> index of its last event
        evicted_at: dict[int, int] = {}
        at = 0
        for rec in trace:
            holders: dict[int, int] = {}
            for table in rec["block_tables"]:
                for b in table:
                    holders[b] = holders.get(b, 0) + 1
            for table, refs in zip(rec["block_tables"], rec["ref_cnts"]):
                assert refs == [holders[b] for b in table], (work["id"], rec["step"])
            for rid, hit, total in rec["cache_hits"]:
                k = rec["running"].index(rid)
                assert hit % size == 0 and hit // size <= (total - 1) // size
                assert rec["num_computed_tokens"][k] == hit      # its first chunk starts there
                blocks = rec["block_tables"][k][:hit // size]
                assert [cached_before.get(b) for b in blocks] == names[rid][:hit // size]
            for kind, _, ids in rec["block_events"]:
                at += 1
                for b in ids:
                    if kind == "cached":
                        named_at[b] = at
                    elif kind == "evicted":
                        evicted_at[b] = at
                    elif kind == "hit":                  # never under an evicted name
                        assert named_at[b] > evicted_at.get(b, -1), (work["id"], b)
            cached_before = {b: h for b, h in rec["cached_blocks"]}
        last = trace[-1]
        assert sorted(last["free_queue"]) == list(range(1, work["num_blocks"]))  # none held
        assert last["cached_blocks"] and {b for b, _ in last["cached_blocks"]} <= set(
            last["free_queue"])                                  # the cache, not a leak


def test_the_summary_is_the_traces(data):
    for work in data["workloads"]:
        trace = work["trace"]
        hits = {rid: [n, total] for rec in trace for rid, n, total in rec["cache_hits"]}
        queries = sum(total for _, total in hits.values())
        s = work["summary"]
        assert s["hits"] == hits and s["query_tokens"] == queries
        assert s["hit_tokens"] == sum(n for n, _ in hits.values())
        assert s["admissions"] == len(work["requests"]) == len(hits)
        assert s["hit_requests"] == sum(n > 0 for n, _ in hits.values())
        assert s["max_ref_cnt"] == max(max(r, default=0) for rec in trace for r in rec["ref_cnts"])
        assert s["cached_after"] == len(trace[-1]["cached_blocks"]) and s["steps"] == len(trace)


def test_the_workloads_show_what_they_are_for(data, exporter):
    works = {w["id"]: w for w in data["workloads"]}
    size = exporter.BLOCK_SIZE
    system = works["system"]
    shared = exporter.SYSTEM_TOKENS // size * size
    assert [n for n, _ in system["summary"]["hits"].values()] == [0] + [shared] * 4
    assert system["summary"]["max_ref_cnt"] == 5 and not system["summary"]["evicted"]
    evict = works["evict"]
    first_table = next(rec["block_tables"][0] for rec in evict["trace"] if rec["cache_hits"])
    system_blocks = first_table[:shared // size]
    gone = [b for b in evict["summary"]["evicted"] if b in system_blocks]
    assert gone and gone == system_blocks[len(system_blocks) - len(gone):][::-1]  # tail first
    last_hit = evict["summary"]["hits"][evict["requests"][-1]["id"]][0]
    assert 0 < last_hit < shared and last_hit == (len(system_blocks) - len(gone)) * size
    chat = works["chat"]
    turns = chat["requests"]
    for before, after in zip(turns, turns[1:]):
        assert chat["summary"]["hits"][after["id"]][0] > before["prompt_len"]
