"""Data for the S06 "Try it" simulator: a host/device timeline of a few decode steps.

The page draws two lanes, the host (Python, launching kernels) and the device (running them in
order), for a few decode steps of the S06 engine, and shows where the host waits. The schedule
is `timeline` below, a small pure function; simulator.js is a line-by-line transcription of it,
and the page replays the reference schedules exported here when it loads. Its inputs come from
the course's code, each labelled with where it comes from:

Counted (exact, from the S06 engine on the bundled model, at build time)
    `count_launches` runs `Engine.generate` under `torch.profiler` on the CPU, with the engine's
    own seams (`model_step`, `sample`, `postprocess`) wrapped in `record_function` ranges by a
    subclass, and counts the ATen operations the Python code dispatches in one decode step:
    all of them, and those that make the device do something (`does_device_work`: every op
    except views, allocations and casts to the dtype a tensor already has; the `.item()` copy
    counts). On CUDA each of the latter is at least one kernel launch (or copy) put in the
    device's queue. Counted for float32 (the CPU default) and bfloat16 (the CUDA default, in
    which the float32 reductions add real casts). The Qwen3-0.6B shape's count is extrapolated:
    launches are `fixed + per_layer * L`, with `fixed` and `per_layer` counted on random models
    of the bundled shape with one and two layers, and the rule checked against the bundled
    model's six before it is used.

Measured (this machine's CPU, at build time, one torch thread, CPU time of this process)
    `measure_host_costs`: a one-element `torch.add` (the smallest torch call), a decode step of
    the bundled model (`CachedTransformer.decode`, float32), S04's NumPy sampler on one logits
    row (what the "host-side sampler" policy runs instead of the device sampler), and the host
    work after a token id is known (`Engine.postprocess`: stop rules, detokenizer). The first
    three are the minimum over repeats of a mean over many calls, the last the median over
    five 48-token requests, so a busy machine inflates them less. There is no GPU here: these
    are host costs without a CUDA driver.

Illustrative (not measured here)
    A CUDA launch of about 5 µs of host time (the chapter's order of magnitude for eager
    PyTorch), and device times from the roofline: a decode step reads every weight once, so
    its floor is weight bytes / HBM bandwidth (bfloat16, H100 SXM's specified 3.35 TB/s),
    spread evenly over its launches. Real kernels are not equal (the matmuls dominate) and a
    real kernel rarely finishes in under a microsecond or two; the page says so.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))
# The profiler's library (kineto) prints two trace lines per profile to stderr, at its highest
# log level; read when the process first profiles. Set KINETO_LOG_LEVEL to see them.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import s03_checkpoint  # noqa: E402  (code/ is not a package)
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402

BUNDLED_MODEL_DIR = s03.BUNDLED_MODEL_DIR
POLICIES = ("step", "kernel", "host-sampler", "overlap")
HBM_BYTES_PER_S = 3.35e12          # NVIDIA H100 SXM, specified (the chapter's figure)
ILLUSTRATIVE_LAUNCH_US = 5.0       # host time of one eager CUDA launch: an order of magnitude
QWEN3_0_6B_LAYERS = 28
# Qwen/Qwen3-0.6B config.json (published values), as benchmarks/bench_s06_torch.py uses them.
QWEN3_0_6B = s03.TransformerConfig(
    model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=QWEN3_0_6B_LAYERS,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
    max_position_embeddings=40960, norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6,
    qk_norm=True)
PROMPT = "ROMEO.\nBut soft, what light"
COUNTED_STEPS = 3                  # decode steps profiled (they must all count the same)
# The reference grid the page replays on load and the browser test drives.
GRID_STEPS = 3
GRID_MODEL_LAUNCHES = (3, 8)
GRID_LAUNCH_US = (1.0, 4.5)
GRID_KERNEL_US = (0.5, 6.25)
GRID_POST_US = 7.5
GRID_SAMPLER_LAUNCHES = 2
GRID_HOST_SAMPLER_US = 12.0
# What the page accepts (the inputs' min/max; timeline() refuses the same). The maxes keep the
# biggest schedule small enough to compute at once (6 steps x 20,016 launches); a time that is
# not 0 must be at least MIN_NONZERO_US (1 ps), so no ratio on the page can overflow.
LIMITS = {"steps": 6, "model_launches": 20_000, "sampler_launches": 1_000, "launch_us": 10_000.0,
          "kernel_us": 100_000.0, "post_us": 100_000.0, "host_sampler_us": 100_000.0}
MIN_NONZERO_US = 1e-6

# ATen ops that give the device nothing to do: views and other metadata-only results,
# allocations (the caching allocator, no kernel), and dtype queries. `aten::to` and
# `aten::_to_copy` are here because a real cast shows up as their `copy_` child.
NO_DEVICE_WORK = frozenset(
    "aten::" + name for name in (
        "empty", "empty_strided", "empty_like", "as_strided", "view", "_unsafe_view", "alias",
        "_reshape_alias", "reshape", "slice", "select", "transpose", "t", "permute", "expand",
        "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "narrow",
        "flatten", "unflatten", "detach", "lift_fresh", "resolve_conj", "resolve_neg",
        "result_type", "to", "_to_copy", "contiguous", "linear", "matmul", "softmax",
        "broadcast_tensors"))


# ---------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------

def timeline(policy: str, steps: int, model_launches: int, sampler_launches: int,
             launch_us: float, kernel_us: float, post_us: float, host_sampler_us: float) -> dict:
    """The host/device schedule of `steps` decode steps, in microseconds from 0.

    The host issues launches one after another, each taking it `launch_us`; a kernel joins the
    device's queue when its launch ends and runs for `kernel_us` as soon as the device has
    finished the kernel before it (in order, one at a time). A sync makes the host wait until a
    given kernel has finished; `post_us` is the host's work once a token id is known (stop
    rules, detokenizer). The policies:

    - "step" (S06): per step the model's and the device sampler's launches (the last is the
      `.item()` copy), then one sync (the queue drains), then the post work.
    - "kernel": a sync after every launch (a `.item()` or `print` after each op, or
      CUDA_LAUNCH_BLOCKING=1).
    - "host-sampler" (S04's NumPy sampler): one launch to copy the token id to the device, the
      model's launches, one to copy the logits row back; a sync; `host_sampler_us` of sampling
      on the host, then the post work.
    - "overlap" (one step late, like vLLM's async scheduling or TensorRT-LLM's overlap
      scheduler): step k+1 is launched before the host waits for step k's token.

    Returns {"host": [[kind, step, start, end], ...] with kind "launch" | "wait" | "sampler" |
    "post" (zero-length waits and works are left out), "device": [[step, start, end], ...] in
    queue order, "token_at": [when the host has finished with each step's token], "end"}.
    Raises ValueError for an unknown policy or a count or time out of range (LIMITS; a time
    that is not 0 must be at least MIN_NONZERO_US).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    for name, value in (("steps", steps), ("model_launches", model_launches),
                        ("sampler_launches", sampler_launches)):
        low = 0 if name == "sampler_launches" else 1
        if not isinstance(value, int) or not low <= value <= LIMITS[name]:
            raise ValueError(f"{name} must be an integer from {low} to {LIMITS[name]}"
                             f" (got {value!r})")
    for name, value in (("launch_us", launch_us), ("kernel_us", kernel_us), ("post_us", post_us),
                        ("host_sampler_us", host_sampler_us)):
        if not (isinstance(value, (int, float)) and 0 <= value <= LIMITS[name]
                and (value == 0 or value >= MIN_NONZERO_US)):
            raise ValueError(f"{name} must be 0 or a number from {MIN_NONZERO_US} to "
                             f"{LIMITS[name]} (got {value!r})")

    host, device, token_at = [], [], []
    clock = {"host": 0.0, "device": 0.0}      # host's time; when the device's queue empties

    def launch(step):
        start = clock["host"]
        clock["host"] = start + launch_us
        begin = max(clock["host"], clock["device"])
        clock["device"] = begin + kernel_us
        host.append(["launch", step, start, clock["host"]])
        device.append([step, begin, clock["device"]])
        return clock["device"]                 # when this kernel will have finished

    def wait(step, until):
        if until > clock["host"]:
            host.append(["wait", step, clock["host"], until])
            clock["host"] = until

    def work(kind, step, us):
        if us > 0:
            start = clock["host"]
            clock["host"] = start + us
            host.append([kind, step, start, clock["host"]])

    per_step = model_launches + sampler_launches
    last_kernel_end = []
    for step in range(steps):
        if policy == "step":
            for _ in range(per_step):
                done = launch(step)
            wait(step, done)
        elif policy == "kernel":
            for _ in range(per_step):
                wait(step, launch(step))
        elif policy == "host-sampler":
            for _ in range(model_launches + 2):
                done = launch(step)
            wait(step, done)
            work("sampler", step, host_sampler_us)
        else:                                  # overlap
            for _ in range(per_step):
                done = launch(step)
            last_kernel_end.append(done)
            if step == 0:
                continue
            wait(step - 1, last_kernel_end[step - 1])
            work("post", step - 1, post_us)
            token_at.append(clock["host"])
            continue
        work("post", step, post_us)
        token_at.append(clock["host"])
    if policy == "overlap":
        wait(steps - 1, last_kernel_end[steps - 1])
        work("post", steps - 1, post_us)
        token_at.append(clock["host"])
    return {"host": host, "device": device, "token_at": token_at, "end": clock["host"]}


def summary(schedule: dict) -> dict:
    """What the page reports: total time, time per token (the total time divided by the number
    of tokens, one per step: the overlap policy reads its last two tokens back to back, so a gap
    between two reads is not a token's cost), device busy time and idle fraction, host wait."""
    end, token_at = schedule["end"], schedule["token_at"]
    busy = 0.0
    for _, start, stop in schedule["device"]:
        busy += stop - start
    waited = 0.0
    for kind, _, start, stop in schedule["host"]:
        if kind == "wait":
            waited += stop - start
    per_token = end / len(token_at)
    return {"end": end, "per_token": per_token, "device_busy": busy,
            "device_idle_fraction": 1.0 - busy / end if end > 0 else 0.0, "host_wait": waited}


# ---------------------------------------------------------------------------------------------
# Counting the launches of one decode step
# ---------------------------------------------------------------------------------------------

class MarkedEngine(s06.Engine):
    """S06's engine with its seams wrapped in profiler ranges (behaviour unchanged)."""

    def model_step(self, seq):
        with record_function("course::model_step"):
            return super().model_step(seq)

    def sample(self, logits, seq):
        with record_function("course::sample"):
            return super().sample(logits, seq)

    def postprocess(self, seq, token):
        with record_function("course::postprocess"):
            return super().postprocess(seq, token)


def does_device_work(event) -> bool:
    """Whether a profiled ATen op (a FunctionEvent) gives the device something to do: it, or an
    op it calls, is an ATen op outside NO_DEVICE_WORK."""
    if any(does_device_work(child) for child in event.cpu_children):
        return True
    return event.name.startswith("aten::") and event.name not in NO_DEVICE_WORK


def count_launches(model, tokenizer) -> dict:
    """ATen ops dispatched by one greedy decode step of the S06 engine (profiled on `model`'s
    device), split by seam: {"model": launches, "sampler": launches, "postprocess": launches,
    "model_ops": all ops, "sampler_ops": all ops}. Raises RuntimeError if the profiled decode
    steps do not all count the same."""
    engine = MarkedEngine(model, tokenizer, max_context=model.config.max_position_embeddings)
    params = s04.SamplingParams(max_tokens=COUNTED_STEPS + 1, temperature=0.0, ignore_eos=True)
    engine.generate(PROMPT, params)            # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(PROMPT, params)
    ranges = [e for e in prof.events() if e.name.startswith("course::")]
    ranges.sort(key=lambda e: e.time_range.start)
    per_seam: dict[str, list[tuple[int, int]]] = {}
    for event in ranges:
        ops = [c for c in event.cpu_children if c.name.startswith("aten::")]
        per_seam.setdefault(event.name.removeprefix("course::"), []).append(
            (sum(does_device_work(c) for c in ops), len(ops)))
    decode = {seam: counts[1:] for seam, counts in per_seam.items()}   # step 0 is the prefill
    for seam, counts in decode.items():
        if len(counts) != COUNTED_STEPS or len(set(counts)) != 1:
            raise RuntimeError(f"decode steps count differently in {seam}: {counts}")
    return {"model": decode["model_step"][0][0], "model_ops": decode["model_step"][0][1],
            "sampler": decode["sample"][0][0], "sampler_ops": decode["sample"][0][1],
            "postprocess": decode["postprocess"][0][0]}


def random_model(config: s03.TransformerConfig, dtype: torch.dtype) -> s06.TorchTransformer:
    rng = np.random.default_rng(0)
    weights = {name: (np.ones(shape, np.float32) if "norm" in name
                      else rng.normal(0, 0.02, shape).astype(np.float32))
               for name, shape in s03_checkpoint.expected_tensors(config).items()}
    return s06.TorchTransformer(config, weights, torch.device("cpu"), dtype)


def per_layer_rule(config: s03.TransformerConfig, tokenizer, dtype: torch.dtype) -> tuple[int, int]:
    """(fixed, per_layer) model launches of a decode step: counted with 1 and 2 layers."""
    one, two = (count_launches(random_model(dataclasses.replace(config, num_hidden_layers=n),
                                            dtype), tokenizer)["model"] for n in (1, 2))
    return one - (two - one), two - one


# ---------------------------------------------------------------------------------------------
# Host costs, measured here
# ---------------------------------------------------------------------------------------------

def cpu_time_per_call(fn, calls: int, repeats: int = 5) -> float:
    """Minimum over `repeats` of the mean CPU time (seconds, time.process_time) of fn()."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return best


def measure_host_costs(model, tokenizer) -> dict:
    """Microseconds of CPU time on this machine (see the module docstring for the method)."""
    a, b, c = torch.ones(1), torch.ones(1), torch.empty(1)
    for _ in range(500):
        torch.add(a, b, out=c)
    tiny = cpu_time_per_call(lambda: torch.add(a, b, out=c), 20_000)

    runner = s06.CachedTransformer(model, model.config.max_position_embeddings)
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        token = torch.argmax(runner.prefill(ids)).view(1)

        runner.decode(token)                            # warm-up
        decode = float("inf")
        for _ in range(5):                              # from the same position every time
            runner.prefill(ids)
            start = time.process_time()
            for _ in range(40):
                runner.decode(token)
            decode = min(decode, (time.process_time() - start) / 40)
        row = runner.prefill(ids).numpy()

    params = s04.SamplingParams(max_tokens=16, temperature=0.0)
    rng = np.random.default_rng(0)
    host_sampler = cpu_time_per_call(
        lambda: s04.sample(row, params, rng, ids, (), (tokenizer.eos_id,)), 2_000)

    post = []

    class Timed(s06.Engine):
        def postprocess(self, seq, token):
            start = time.process_time()
            out = super().postprocess(seq, token)
            post.append(time.process_time() - start)
            return out
    timed = Timed(model, tokenizer, max_context=model.config.max_position_embeddings)
    for _ in range(5):
        timed.generate(PROMPT, s04.SamplingParams(max_tokens=48, temperature=0.0,
                                                  ignore_eos=True))
    post_s = float(np.median(post))
    return {"tiny_op_us": tiny * 1e6, "decode_step_us": decode * 1e6,
            "host_sampler_us": host_sampler * 1e6, "post_us": post_s * 1e6}


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------

def reference_grid(sampler_launches: int = GRID_SAMPLER_LAUNCHES) -> list[dict]:
    """Settings and their schedules, for the page's self-check and the browser test."""
    runs = []
    for policy in POLICIES:
        for n in GRID_MODEL_LAUNCHES:
            for launch_us in GRID_LAUNCH_US:
                for kernel_us in GRID_KERNEL_US:
                    setting = {"policy": policy, "steps": GRID_STEPS, "model_launches": n,
                               "sampler_launches": sampler_launches, "launch_us": launch_us,
                               "kernel_us": kernel_us, "post_us": GRID_POST_US,
                               "host_sampler_us": GRID_HOST_SAMPLER_US}
                    schedule = timeline(**setting)
                    runs.append({"setting": setting, "schedule": schedule,
                                 "summary": summary(schedule)})
    return runs


def export() -> dict:
    """The simulator's data (JSON-able): counts, measured host costs, illustrative device times,
    defaults and reference schedules. {"available": false, ...} without data/model/."""
    if not (Path(BUNDLED_MODEL_DIR) / "model.safetensors").exists():
        return {"available": False, "reason": f"no bundled model in {BUNDLED_MODEL_DIR}",
                "policies": list(POLICIES), "reference": reference_grid()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        counts, models = {}, {}
        for name in ("float32", "bfloat16"):
            models[name] = s06.load(BUNDLED_MODEL_DIR, device="cpu", dtype=name)
            counts[name] = count_launches(*models[name])
        model, tokenizer = models["float32"]
        config = model.config
        fixed, per_layer = per_layer_rule(config, tokenizer, torch.bfloat16)
        if fixed + per_layer * config.num_hidden_layers != counts["bfloat16"]["model"]:
            raise RuntimeError("model launches are not fixed + per_layer * L on the bundled model")
        measured = measure_host_costs(model, tokenizer)
    finally:
        torch.set_num_threads(threads)

    bf16 = counts["bfloat16"]
    measured["per_launch_us"] = measured["decode_step_us"] / counts["float32"]["model"]
    shapes = {}
    for key, label, cfg, launches in (
            ("bundled", f"the bundled model ({config.num_hidden_layers} layers)", config,
             bf16["model"]),
            ("qwen3-0.6b", f"Qwen3-0.6B's shape ({QWEN3_0_6B_LAYERS} layers)", QWEN3_0_6B,
             fixed + per_layer * QWEN3_0_6B_LAYERS)):
        weight_bytes = 2 * s03.parameter_count(cfg)
        floor_us = weight_bytes / HBM_BYTES_PER_S * 1e6
        shapes[key] = {"label": label, "parameters": s03.parameter_count(cfg),
                       "weight_bytes": weight_bytes, "model_launches": launches,
                       "floor_us": floor_us,
                       "roofline_kernel_us": floor_us / (launches + bf16["sampler"])}
    return {
        "available": True,
        "source": "site/simulators/host-device-timeline/export.py over code/s06_torch.py",
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
                   f"{platform.python_version()}, torch {torch.__version__}, 1 thread",
        "counts": counts,
        "per_layer": {"fixed": fixed, "per_layer": per_layer},
        "measured": measured,
        "illustrative": {"launch_us": ILLUSTRATIVE_LAUNCH_US, "hbm_bytes_per_s": HBM_BYTES_PER_S},
        "shapes": shapes,
        "policies": list(POLICIES),
        "limits": LIMITS,
        "min_nonzero_us": MIN_NONZERO_US,
        "defaults": {"policy": "step", "steps": 3, "shape": "bundled",
                     "launch_us": ILLUSTRATIVE_LAUNCH_US},
        "reference": reference_grid(bf16["sampler"]),
    }


if __name__ == "__main__":  # print what the page gets, without the reference schedules
    import json
    data = export()
    print(json.dumps({k: v for k, v in data.items() if k != "reference"}, indent=1))
    print(f"{len(json.dumps(data, separators=(',', ':'))):,} bytes of JSON")
