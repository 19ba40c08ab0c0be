"""The S15 benchmark (benchmarks/bench_s15_speculative.py): its command line, one --quick run
written to a temporary path (never the committed record), and the record's shape and internal
consistency, for that quick run and for the committed record
(chapters/figures/s15_speculative.json) when it exists.

Oracles: Leviathan's closed forms, written out here ((1 - a^(k+1)) / (1 - a) tokens per step,
that over (k c + 1) for the speedup); medians, speedups and tokens/s recomputed from the raw
seconds the record keeps; acceptance recomputed from the accepted and drafted counts; the
PASS / MISSED verdicts (two per workload) recomputed from the raw seconds, and the copy-heavy
workload from the stored copy shares; a --quick run prints and stores no verdict. No measured
speed is asserted.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from bench_testing import import_benchmark, quick_run, usage_error

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "chapters" / "figures" / "s15_speculative.json"
PROPOSERS = ("ngram", "draft", "int4")
WORKLOADS = ("corpus", "copy", "loop")
OURS = ["ours plain", "ours ngram", "ours draft", "ours int4"]
HF = ["HF plain", "HF assisted (draft)", "HF prompt lookup"]


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_s15_speculative")


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "--tokens must be an integer in [1, 64] (got 0)"),
    (["--k-max", "9"], "--k-max must be an integer in [1, 8] (got 9)"),
    (["--repeats", "21"], "--repeats must be an integer in [1, 20] (got 21)"),
    (["--sections", "speed"], "--sections takes comma-separated names from "
                              "acceptance,wallclock,random (got 'speed')"),
    (["--record", "--json", "x.json"], "give --json or --record, not both"),
    (["--record", "--quick"], "--record takes a full run, not --quick"),
    (["--threads", "0"], "--threads must be an integer in [1, "),
    (["--seed", "-1"], "--seed must be an integer >= 0 (got -1)"),
])
def test_bad_flags_are_usage_errors(bench, argv, message, capsys, monkeypatch):
    assert message in usage_error(bench, argv, capsys, monkeypatch)


def test_json_must_be_a_writable_file(bench, tmp_path, capsys, monkeypatch):
    assert "--json" in usage_error(bench, ["--json", str(tmp_path)], capsys, monkeypatch)


def test_iid_alpha_counts_the_tests_a_verification_made(bench):
    """Drafts (3 offered, 3 accepted): 3 tests; (3, 1): 2 tests; (2, 0): 1 test -> 4 / 6."""
    assert bench.iid_alpha([(3, 3), (3, 1), (2, 0)]) == pytest.approx(4 / 6)
    assert bench.iid_alpha([]) == 0.0


def test_copy_shares_counts_prompt_and_self_repeats(bench):
    """Prompt 1 2 3 4 5, output 3 4 5 9 3 4 5 9: the 4-grams ending at the 8 output tokens are
    3453, 4534, 5345, 3459, 4593, 5934, 9345, 3459; none is a prompt 4-gram (1234, 2345), and
    the last repeats 3459, the first one lying wholly in the output."""
    assert bench.copy_shares([1, 2, 3, 4, 5], [3, 4, 5, 9, 3, 4, 5, 9]) == (8, 0, 1, 1)
    # prompt 1..6, output 3 4 5 6: 4563, 5634, 6345, 3456; only 3456 is in the prompt
    assert bench.copy_shares([1, 2, 3, 4, 5, 6], [3, 4, 5, 6]) == (4, 1, 0, 1)
    # prompt 1 2 3, output 4 1 2 3 4: 1234 straddles prompt and output, then comes again:
    # not a prompt 4-gram, not wholly in the output, but earlier in prompt + output
    assert bench.copy_shares([1, 2, 3], [4, 1, 2, 3, 4]) == (5, 0, 0, 1)


def test_shares_of_sums_over_requests(bench):
    shares = bench.shares_of([[1, 2, 3, 4, 5], [1, 2, 3]], [[3, 4, 5, 9, 3, 4, 5, 9],
                                                             [4, 1, 2, 3, 4]])
    assert shares == {"n": 4, "output_ngrams": 13, "in_prompt": 0.0,
                      "repeating_output": 1 / 13, "earlier_in_prompt_or_output": 2 / 13}


# --- one --quick run into a temporary file ----------------------------------------------------

@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("s15_bench") / "quick.json"
    return (*quick_run(bench, out, RECORD), bench)


def test_quick_run_prints_every_section_and_no_verdict(quick):
    figures, returned, text, bench = quick
    assert text.count(bench.QUICK_DISCLAIMER) == 2
    for needle in ("A. acceptance", "B. wall clock", "C. random", "HF prompt lookup",
                   "HF assisted (draft)", "load average", "why:", "workload loop",
                   "copy-heavy by measurement"):
        assert needle in text, needle
    assert "PASS" not in text and "MISSED" not in text
    assert text.count("(quick run: no verdicts)") == 2              # in B and in the summary
    assert figures["wallclock"]["targets"] == []
    assert figures == json.loads(json.dumps(returned))
    assert figures["config"]["quick"] is True and figures["config"]["threads"] == 1


def test_quick_record_is_consistent(quick):
    check_record(quick[0])


# --- the committed record ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def record():
    if not RECORD.exists():
        pytest.skip("no committed record yet")
    return json.loads(RECORD.read_text())


def test_the_record_is_a_full_run_on_one_thread(record):
    config = record["config"]
    assert config["quick"] is False and config["threads"] == 1
    assert config["sections"] == ["acceptance", "wallclock", "random"]
    assert config["repeats"] >= 3 and config["random_repeats"] >= 3 and config["k_max"] == 8
    assert config["loop_tokens"] >= 200 and config["tokens"] == 64
    assert record["random"]["parameters"] >= 100e6
    assert record["elapsed_s"] <= 12 * 60


def test_the_record_is_consistent(record):
    check_record(record)


def test_the_record_has_two_verdicts_per_workload(record):
    wall = record["wallclock"]
    assert [(t["workload"], t["check"]) for t in wall["targets"]] == [
        (w, c) for w in WORKLOADS for c in ("beats plain", "matches HF prompt lookup")]


# --- the checks -------------------------------------------------------------------------------

def tokens_per_step(a: float, k: int) -> float:
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def check_stats(row: dict, k: int, tokens: int) -> None:
    """One proposer's figures against each other and Leviathan's formulas."""
    assert row["k"] == k
    assert row["num_emitted_tokens"] == tokens
    assert 1 <= row["tokens_per_forward"] <= k + 1
    assert math.isclose(row["tokens_per_forward"],
                        row["num_emitted_tokens"] / row["num_request_forwards"])
    assert row["forwards_saved"] == row["num_emitted_tokens"] - row["num_request_forwards"]
    if row["num_draft_tokens"]:
        assert math.isclose(row["acceptance_rate"],
                            row["num_accepted_tokens"] / row["num_draft_tokens"])
    assert row["num_draft_tokens"] <= k * row["num_drafts"]
    per_pos = row["acceptance_per_position"]
    assert len(per_pos) <= k and all(0 <= a <= 1 for a in per_pos)
    assert row["alpha_position_1"] == (per_pos[0] if per_pos else 0.0)
    assert 0 <= row["alpha_iid"] <= 1
    assert math.isclose(row["predicted_tokens_per_forward"],
                        tokens_per_step(row["alpha_position_1"], k), rel_tol=1e-9)
    assert math.isclose(row["predicted_tokens_per_forward_iid"],
                        tokens_per_step(row["alpha_iid"], k), rel_tol=1e-9)
    # every request forward emits 1 + its accepted drafts
    assert row["num_emitted_tokens"] == row["num_request_forwards"] + row["num_accepted_tokens"]


def check_timed(rows: dict, base_of, repeats: int) -> None:
    for label, row in rows.items():
        assert len(row["seconds"]) == repeats
        assert math.isclose(row["median_s"], statistics.median(row["seconds"]))
        assert math.isclose(row["tokens_per_s"], row["tokens"] / row["median_s"])
        assert math.isclose(row["speedup"], rows[base_of(label)]["median_s"] / row["median_s"])


def check_costs(row: dict, k: int, plain_step_s: float, plain_model_s: float) -> None:
    assert math.isclose(row["c"], row["draft_s_per_token"] / plain_step_s)
    assert math.isclose(row["verify_ratio"], row["verify_step_s"] / plain_step_s)
    a, c = row["alpha_position_1"], row["c"]
    assert math.isclose(row["predicted_speedup"], tokens_per_step(a, k) / (k * c + 1),
                        rel_tol=1e-9)
    assert math.isclose(row["predicted_speedup_measured_verify"],
                        tokens_per_step(a, k) / (k * c + row["verify_ratio"]), rel_tol=1e-9)
    assert 1 <= row["optimal_k"] <= 8
    assert math.isclose(row["verify_model_ratio"], row["verify_model_s"] / plain_model_s)
    assert math.isclose(row["plain_rest_s"], plain_step_s - plain_model_s)


def check_shares(part: dict) -> None:
    shares = part["copy_shares"]
    assert shares["n"] == 4
    assert shares["output_ngrams"] == part["requests"] * part["tokens_per_request"]
    for key in ("in_prompt", "repeating_output", "earlier_in_prompt_or_output"):
        assert 0 <= shares[key] <= 1
    # a prompt n-gram and a repeat of the output's own both occurred earlier
    assert shares["earlier_in_prompt_or_output"] >= max(shares["in_prompt"],
                                                         shares["repeating_output"])


def check_workload_sizes(part: dict, config: dict, workload: str) -> None:
    prompts, n = ((config["loop_prompts"], config["loop_tokens"]) if workload == "loop"
                  else (config["prompts"], config["tokens"]))
    assert part["requests"] == len(part["prompt_tokens"]) == prompts
    assert part["tokens_per_request"] <= n
    if workload != "loop":
        assert part["tokens_per_request"] == n
    if workload != "copy":
        size = 16 if workload == "loop" else config["prompt_tokens"]
        assert set(part["prompt_tokens"]) == {size}


def expected_targets(workloads: dict, tolerance: float) -> list[tuple]:
    """The verdicts from the raw seconds: medians, then speedups against the peer's plain."""
    out = []
    for workload, part in workloads.items():
        med = {label: statistics.median(row["seconds"]) for label, row in part["rows"].items()}
        ngram = med["ours plain"] / med["ours ngram"]
        pld = med["HF plain"] / med["HF prompt lookup"]
        out += [(workload, "beats plain", ngram, 1.0, ngram > 1.0),
                (workload, "matches HF prompt lookup", ngram, pld,
                 ngram >= pld * (1 - tolerance))]
    return out


def check_record(r: dict) -> None:
    config = r["config"]
    for when in ("start", "end"):
        assert len(r["load_average"][when]) == 3 and min(r["load_average"][when]) >= 0
    assert "load average" in r["uptime_before"] and "load average" in r["uptime_after"]
    assert config["engine_options"] == {"max_num_seqs": 1, "enable_prefix_caching": False}

    acc = r["acceptance"]
    assert acc["k"] == list(range(1, config["k_max"] + 1))
    assert list(acc["workloads"]) == list(WORKLOADS)
    for workload in WORKLOADS:
        part = acc["workloads"][workload]
        check_workload_sizes(part, config, workload)
        check_shares(part)
        n, prompts = part["tokens_per_request"], part["requests"]
        assert [(row["proposer"], row["k"]) for row in part["rows"]] == [
            (p, k) for p in PROPOSERS for k in acc["k"]]
        for row in part["rows"]:
            check_stats(row, row["k"], n * prompts)
            assert math.isclose(row["c"], row["draft_s_per_token"] / part["plain_decode_step_s"])
            assert math.isclose(row["verify_model_ratio"],
                                row["verify_model_s"] / part["plain_model_s"])
            assert row["same_tokens_as_plain"]["requests"] == prompts

    wall = r["wallclock"]
    assert wall["k"] == {"ngram": config["ngram_k"], "draft": config["draft_k"],
                         "int4": config["int4_k"]}
    assert wall["hf"]["prompt_lookup_num_tokens"] == config["ngram_k"]
    assert wall["ngram_k_why"]
    assert list(wall["workloads"]) == list(WORKLOADS)
    for workload in WORKLOADS:
        part = wall["workloads"][workload]
        check_workload_sizes(part, config, workload)
        check_shares(part)
        n, prompts = part["tokens_per_request"], part["requests"]
        rows = part["rows"]
        assert list(rows) == OURS + HF
        check_timed(rows, lambda label: "ours plain" if label.startswith("ours") else "HF plain",
                    config["repeats"])
        assert rows["ours plain"]["decode_step_s"] == part["plain_decode_step_s"] > 0
        for label, row in rows.items():
            assert row["tokens"] == n * prompts
            assert row["same_tokens_as_ours_plain"]["requests"] == prompts
        for p in PROPOSERS:                 # counted over the timed rounds
            row, k = rows[f"ours {p}"], wall["k"][p]
            check_stats(row, k, n * prompts * config["repeats"])
            check_costs(row, k, part["plain_decode_step_s"], part["plain_model_s"])
    shares = {w: wall["workloads"][w]["copy_shares"]["earlier_in_prompt_or_output"]
              for w in WORKLOADS}
    heavy = wall["copy_heavy"]
    assert heavy["shares"] == shares
    assert heavy["workload"] == (max(shares, key=shares.get) if max(shares.values()) > 0
                                 else None)
    if config["quick"]:
        assert wall["targets"] == []                  # a smoke run states no verdict
    else:
        expected = expected_targets(wall["workloads"], 0.05)
        got = [(t["workload"], t["check"], t["speedup"], t["against"], t["pass"])
               for t in wall["targets"]]
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        for g, e in zip(got, expected):
            assert math.isclose(g[2], e[2]) and math.isclose(g[3], e[3]), (g, e)
            assert g[4] == e[4], (g, e)
    draft = wall["draft_model_on_bundled"]
    corpus_draft = wall["workloads"]["corpus"]["rows"]["ours draft"]
    assert draft["measured_speedup"] == corpus_draft["speedup"]
    assert draft["predicted_speedup"] == corpus_draft["predicted_speedup"]
    assert draft["outcome"] == ("loses" if draft["measured_speedup"] < 1 else "wins")
    cost = wall["k"]["draft"] * corpus_draft["c"] + corpus_draft["verify_ratio"]
    assert math.isclose(draft["step_cost_in_plain_steps"], cost)
    # the "why" is worded from this run's figures: its ledger is in the text
    assert f"= {cost:.2f} plain steps" in draft["why"]
    assert f"gains {corpus_draft['tokens_per_forward']:.2f} tokens" in draft["why"]

    rnd = r["random"]
    k = rnd["k"]
    assert list(rnd["rows"]) == ["plain", "int4 draft", "int8 draft"]
    assert rnd["repeats"] == config["random_repeats"]
    check_timed(rnd["rows"], lambda label: "plain", config["random_repeats"])
    for draft in ("int4", "int8"):
        row = rnd["rows"][f"{draft} draft"]
        check_stats(row, k, rnd["tokens_per_request"] * rnd["requests"] * rnd["repeats"])
        check_costs(row, k, rnd["plain_decode_step_s"], rnd["plain_model_s"])
    for row in rnd["sweep"]:
        check_stats(row, row["k"], rnd["tokens_per_request"] * rnd["requests"])
    near_zero = rnd["rows"]["int4 draft"]["alpha_position_1"] < 0.2
    assert rnd["int4_acceptance_near_zero"] == near_zero
    assert ("near zero" in rnd["note"]) == near_zero
    for part in [wall["workloads"][w]["rows"] for w in WORKLOADS] + [rnd["rows"]]:
        assert all(row["repeats"] == len(row["seconds"]) for row in part.values())
