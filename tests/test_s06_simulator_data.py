"""The S06 "Try it" timeline: its schedule obeys the closed forms, and its counts are the engine's.

site/simulators/host-device-timeline/export.py holds `timeline` (the schedule the page draws)
and counts the launches of one S06 decode step with torch.profiler. The oracles here are
independent of that code: closed forms of a step's time derived by hand from the queue rule
(a host-bound step costs n launches + one kernel, a device-bound one one launch + n kernels,
plus the host's work), invariants every schedule must keep (in-order device, a host that is
always doing something), and a second way of counting the ops, a TorchDispatchMode that sees
every ATen op the engine's seams dispatch and calls it device work when it mutates a tensor,
returns one not sharing storage with its inputs, or returns a Python number (the `.item()`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ROOT / "site" / "simulators" / "host-device-timeline" / "export.py"


def load_exporter():
    spec = importlib.util.spec_from_file_location("s06_sim_export_under_test", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hd = load_exporter()
needs_model = pytest.mark.skipif(not (Path(hd.BUNDLED_MODEL_DIR) / "model.safetensors").exists(),
                                 reason="the bundled model (data/model) is missing")


def per_token(schedule):
    t = schedule["token_at"]
    return [t[0]] + [b - a for a, b in zip(t, t[1:])]


CASES = list(itertools.product((1, 3, 40), (0, 2), (0.5, 3.0), (0.25, 1.0, 7.0), (0.0, 11.0)))


@pytest.mark.parametrize("n,sampler,launch,kernel,post", CASES)
def test_step_policies_match_their_closed_forms(n, sampler, launch, kernel, post):
    m = n + sampler
    one_sync = max(m * launch + kernel, launch + m * kernel) + post
    s = hd.timeline("step", 4, n, sampler, launch, kernel, post, 5.0)
    assert per_token(s) == pytest.approx([one_sync] * 4, rel=1e-12)
    s = hd.timeline("kernel", 4, n, sampler, launch, kernel, post, 5.0)
    assert per_token(s) == pytest.approx([m * (launch + kernel) + post] * 4, rel=1e-12)
    h = n + 2          # the id up, the logits row down
    s = hd.timeline("host-sampler", 4, n, sampler, launch, kernel, post, 5.0)
    assert per_token(s) == pytest.approx(
        [max(h * launch + kernel, launch + h * kernel) + 5.0 + post] * 4, rel=1e-12)


@pytest.mark.parametrize("n,sampler,launch,kernel,post", CASES)
def test_overlap_never_loses_and_keeps_a_device_bound_queue_full(n, sampler, launch, kernel, post):
    m = n + sampler
    overlap = hd.timeline("overlap", 5, n, sampler, launch, kernel, post, 0.0)
    step = hd.timeline("step", 5, n, sampler, launch, kernel, post, 0.0)
    assert overlap["end"] <= step["end"] + 1e-9
    if m * kernel >= m * launch + post:            # device-bound: kernels back to back
        dev = overlap["device"]
        assert all(b[1] == pytest.approx(a[2], rel=1e-12) for a, b in zip(dev, dev[1:]))
        assert overlap["end"] == pytest.approx(launch + 5 * m * kernel + post, rel=1e-12)
    if kernel <= launch:      # host-bound: only the last kernel can be waited for, after a post
        assert overlap["end"] == pytest.approx(5 * (m * launch + post) + max(0.0, kernel - post),
                                               rel=1e-12)


@pytest.mark.parametrize("n,sampler,launch,kernel,post", CASES)
def test_time_per_token_is_the_total_over_the_tokens(n, sampler, launch, kernel, post):
    """Not the gap between the last two reads: "overlap" reads its last two tokens back to back
    (the last step's kernels are already queued), which once showed 34 µs for a 1.9 ms token."""
    m = n + sampler
    for steps in (1, 2, 6):
        one_sync = max(m * launch + kernel, launch + m * kernel) + post
        s = hd.summary(hd.timeline("step", steps, n, sampler, launch, kernel, post, 5.0))
        assert s["per_token"] == pytest.approx(one_sync, rel=1e-12)
        s = hd.summary(hd.timeline("kernel", steps, n, sampler, launch, kernel, post, 5.0))
        assert s["per_token"] == pytest.approx(m * (launch + kernel) + post, rel=1e-12)
        s = hd.summary(hd.timeline("overlap", steps, n, sampler, launch, kernel, post, 5.0))
        if kernel <= launch:
            last_wait = kernel if steps == 1 else max(0.0, kernel - post)
            assert s["per_token"] == pytest.approx(m * launch + post + last_wait / steps,
                                                   rel=1e-12)
        if m * kernel >= m * launch + post:
            assert s["per_token"] == pytest.approx(m * kernel + (launch + post) / steps,
                                                   rel=1e-12)


def test_with_free_kernels_the_host_never_waits():
    for policy in ("step", "kernel", "overlap"):
        s = hd.timeline(policy, 3, 7, 2, 1.5, 0.0, 4.0, 0.0)
        assert not [h for h in s["host"] if h[0] == "wait"]
        assert s["end"] == pytest.approx(3 * (9 * 1.5 + 4.0), rel=1e-12)


@pytest.mark.parametrize("policy", hd.POLICIES)
def test_every_schedule_keeps_the_queue_rules(policy):
    for n, launch, kernel in itertools.product((1, 5), (0.3, 2.0), (0.1, 4.0)):
        s = hd.timeline(policy, 3, n, 2, launch, kernel, 1.0, 3.0)
        launches = [h for h in s["host"] if h[0] == "launch"]
        per_step = n + 2       # host-sampler: n + 2 as well, with 2 sampler launches here
        assert len(launches) == len(s["device"]) == 3 * per_step
        assert len(s["token_at"]) == 3 and s["token_at"][-1] == s["end"]
        t = 0.0
        for kind, step, start, end in s["host"]:      # the host is never idle
            assert start == t and end > start and 0 <= step < 3
            t = end
        assert t == s["end"]
        previous_end = 0.0
        for (kind, _, _, launched), (step, start, end) in zip(launches, s["device"]):
            assert start >= launched and start >= previous_end           # in order, one at a time
            assert end - start == pytest.approx(kernel, rel=1e-12)
            assert start == max(launched, previous_end)                   # and never idle by choice
            previous_end = end
        summary = hd.summary(s)
        assert summary["device_busy"] == pytest.approx(3 * per_step * kernel, rel=1e-12)
        assert 0 <= summary["device_idle_fraction"] < 1
        waits = sum(e - b for k, _, b, e in s["host"] if k == "wait")
        assert summary["host_wait"] == pytest.approx(waits, rel=1e-12)


@pytest.mark.parametrize("kwargs", [dict(policy="sometimes"), dict(steps=0), dict(model_launches=0),
                                    dict(sampler_launches=-1), dict(launch_us=-1.0),
                                    dict(kernel_us=math.inf), dict(post_us=math.nan),
                                    dict(steps=2.0), dict(steps=7), dict(model_launches=20_001),
                                    dict(model_launches=10**6), dict(launch_us=10_000.5),
                                    dict(kernel_us=1e308), dict(post_us=100_001.0),
                                    dict(host_sampler_us=1e6), dict(launch_us=1e-7),
                                    dict(kernel_us=5e-324)])
def test_bad_settings_are_refused(kwargs):
    setting = dict(policy="step", steps=2, model_launches=3, sampler_launches=1, launch_us=1.0,
                   kernel_us=1.0, post_us=1.0, host_sampler_us=1.0) | kwargs
    with pytest.raises(ValueError):
        hd.timeline(**setting)


@pytest.mark.parametrize("policy", hd.POLICIES)
def test_the_extreme_allowed_settings_stay_finite(policy):
    lim = hd.LIMITS
    for launch, kernel, post, sampler_us in ((lim["launch_us"], lim["kernel_us"], lim["post_us"],
                                              lim["host_sampler_us"]),
                                             (hd.MIN_NONZERO_US,) * 4,
                                             (hd.MIN_NONZERO_US, lim["kernel_us"], 0.0, 0.0)):
        s = hd.timeline(policy, lim["steps"], lim["model_launches"], 16, launch, kernel, post,
                        sampler_us)
        values = [s["end"], *s["token_at"], *hd.summary(s).values()]
        values += [x for seg in s["host"] for x in seg[2:]] + [x for seg in s["device"]
                                                               for x in seg[1:]]
        assert all(math.isfinite(x) for x in values)
        assert s["end"] > 0 and math.isfinite(1e6 / hd.summary(s)["per_token"])


# ---------------------------------------------------------------------------------------------
# The counts: a second way of counting
# ---------------------------------------------------------------------------------------------

class CountWork(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.work = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if (func._schema.is_mutable or not outputs
                or any(t.untyped_storage().data_ptr() not in inputs for t in outputs)):
            self.work += 1
        return out


def oracle_counts(model, tokenizer):
    import s04_sampling as s04
    import s06_torch as s06
    seen = {"model": [], "sampler": []}

    class Counted(s06.Engine):
        def model_step(self, seq):
            with CountWork() as c:
                out = super().model_step(seq)
            seen["model"].append(c.work)
            return out

        def sample(self, logits, seq):
            with CountWork() as c:
                out = super().sample(logits, seq)
            seen["sampler"].append(c.work)
            return out

    engine = Counted(model, tokenizer, max_context=model.config.max_position_embeddings)
    engine.generate(hd.PROMPT, s04.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return {k: v[1:] for k, v in seen.items()}             # decode steps only


@needs_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profiler_counts_equal_the_dispatch_oracle(dtype):
    import s06_torch as s06
    model, tokenizer = s06.load(hd.BUNDLED_MODEL_DIR, device="cpu", dtype=dtype)
    counted = hd.count_launches(model, tokenizer)
    oracle = oracle_counts(model, tokenizer)
    assert oracle["model"] == [counted["model"]] * 3
    assert oracle["sampler"] == [counted["sampler"]] * 3
    assert counted["model"] < counted["model_ops"]          # views and no-op casts left out


@needs_model
def test_per_layer_rule_predicts_a_three_layer_model():
    import s06_torch as s06
    model, tokenizer = s06.load(hd.BUNDLED_MODEL_DIR, device="cpu", dtype="bfloat16")
    fixed, per_layer = hd.per_layer_rule(model.config, tokenizer, torch.bfloat16)
    three = hd.random_model(dataclasses.replace(model.config, num_hidden_layers=3), torch.bfloat16)
    assert oracle_counts(three, tokenizer)["model"][0] == fixed + 3 * per_layer


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data():
    return load_exporter().export()


@needs_model
def test_export_is_json_and_labels_its_numbers(data):
    json.dumps(data, allow_nan=False)
    assert data["available"] is True
    measured = data["measured"]
    for key in ("tiny_op_us", "decode_step_us", "host_sampler_us", "post_us", "per_launch_us"):
        assert 0 < measured[key] < 1e6, key
    assert measured["per_launch_us"] * data["counts"]["float32"]["model"] == pytest.approx(
        measured["decode_step_us"])
    qwen, bundled = data["shapes"]["qwen3-0.6b"], data["shapes"]["bundled"]
    assert qwen["parameters"] == 596_049_920              # the chapter's figure for the shape
    assert qwen["floor_us"] == pytest.approx(2 * 596_049_920 / 3.35e12 * 1e6)
    assert bundled["model_launches"] == data["counts"]["bfloat16"]["model"]
    rule = data["per_layer"]
    assert qwen["model_launches"] == rule["fixed"] + 28 * rule["per_layer"]
    assert data["limits"] == hd.LIMITS and data["min_nonzero_us"] == hd.MIN_NONZERO_US
    assert {r["setting"]["policy"] for r in data["reference"]} == set(hd.POLICIES)
    assert all(r["setting"]["sampler_launches"] == data["counts"]["bfloat16"]["sampler"]
               for r in data["reference"])
