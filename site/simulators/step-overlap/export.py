"""Data for the S16 "Try it" simulator: recorded engine steps replayed eager, with a graph-replayed
forward, and with async scheduling, side by side.

The page draws a few decode steps of the real engine four ways on one time axis, each box a
phase of a step as code/s16_profile.py's `StepProfiler` timed it (schedule, prepare, forward,
sample, postprocess, update). The schedule is `schedule` below, a small pure function;
simulator.js is a line-by-line transcription of it, and the page replays the reference schedules
exported here when it loads (a banner if any differs). The modes:

- "eager" (S09's `LLMEngine.step`): one thread does every phase of a step, in turn, and the
  next step starts when the last one is done. A step costs the sum of its phases.
- "graph" (code/s16_static.py: a static decode step, compiled or replayed from a CUDA graph):
  the same, with each forward replaced by the compiled step's measured time (one figure per
  batch size, see "Where the compiled forward comes from"): the per-op dispatch gaps of the
  eager forward are gone, the host phases stay.
- "async" (code/s16_async.py's `AsyncLLMEngine`): two lanes, the host (the engine's thread) and
  the worker (the thread running the runner). Step N's prepare and forward run on the worker;
  the host waits for its logits, samples (the tokens are needed before step N + 1 can read
  them: sample N and prepare N + 1 are serial), launches step N + 1, and while its forward runs
  does step N's postprocess and update and plans step N + 2. Step 0's plan comes first, and
  step 1's is made while forward 0 runs (the loop's first call). The worker's boxes keep their
  recorded lengths: the ideal overlap, where neither lane slows the other. On a CPU they do
  (torch releases Python's GIL inside each op's kernel, but the dispatch around it holds it),
  so the page shows the real async loop's measured step beside the ideal one.
- "graph+async": async with the graph's forward (what vLLM runs by default).

Recorded (this machine, at build time, one torch thread, wall clock)
    For each batch size in BATCH_SIZES, `record_run` runs code/s13_prefix_caching.py's engine
    (`build_engine`: S13's paged KV, prefix caching, chunked prefill) on the bundled model with
    a `StepProfiler` attached, over B of S07's "chat" corpus prompts (greedy, ignore_eos). Of
    the SEARCH_STEPS decode steps of all B requests after WARMUP_STEPS of them it keeps the
    STEPS consecutive ones that took the least time (`quietest_window`: on a shared machine
    another process only ever adds time), each with its phases' milliseconds (`to_json` of
    the `StepProfile`), the step's wall time and its profiled segments. The same requests
    then run on the same engine made static (eager, not compiled: `s16_static.make_static`)
    and made async with a worker thread (`s16_async.AsyncLLMEngine`), each step() call timed:
    the medians over the decode steps of each run (SEARCH_STEPS eager, STEPS static and async)
    are `measured` (shown, never drawn). The outputs of the three runs are compared
    (`outputs_equal`, `texts_equal`; the static and async runs stop earlier, so over the
    tokens they made).

Where the compiled forward comes from
    From the benchmark record chapters/figures/s16_host.json (benchmarks/bench_s16_host.py)
    when it holds the compiled variant's median forward for the bundled model at the run's
    batch size (`compiled_forward_from_record` says where it looks; the batch sizes here are
    the benchmark's). Otherwise from the static run above: the same persistent buffers and
    bucketed decode step as the compiled one, run eagerly, labelled so on the page ("static
    step, eager (no compiled figure)"). This export never compiles (seconds per bucket, and the
    site build runs it); no time on the page is invented. The page also lists the record's
    async section (every variant's median step at its batch size) beside the async loop
    measured here.

What it does not handle
    Decode steps only (a prefill or mixed step runs eagerly in every mode, S16's static runner
    does so too). One step in flight, as code/s16_async.py. The "other" time of a step
    (observers, building outputs; a few microseconds) is in no box.

Run it
    python site/simulators/step-overlap/export.py   # per step in each mode, and the measured

Tests
    tests/test_s16_simulator_data.py (the schedule against closed forms and the loops' rules,
    the recorded steps against the profiler's own numbers, the engine against S06 alone, the
    record reader), tests/test_s16_simulator_browser.py (the page draws these schedules box
    for box).

References
    vLLM V1's async scheduling (`AsyncScheduler`, default since v0.14) and `CUDAGraphMode`;
    SGLang's overlap scheduler (v0.4, Dec 2024); S06's host-device-timeline simulator, which
    this one extends from launches to an engine's phases.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "code") not in sys.path:
    sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

import s03_transformer as s03  # noqa: E402  (code/ is not a package)
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s08_cli  # noqa: E402
import s13_prefix_caching as s13  # noqa: E402
import s16_async  # noqa: E402
import s16_profile as p16  # noqa: E402
import s16_static  # noqa: E402
from s01_generation_loop import ParameterError  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess", "update")
WORKER_PHASES = ("prepare", "forward")          # the async loop's worker runs the runner
MODES = ("eager", "graph", "async", "graph+async")
BATCH_SIZES = (1, 8, 16, 64)    # the benchmark's batches (1, 8, 64; its async section 16)
DEFAULT_BATCH_SIZE = 16
WARMUP_STEPS = 3                # decode steps of all B requests before the ones searched
SEARCH_STEPS = 20               # decode steps the window is chosen from
STEPS = 8                       # the recorded window: the quietest STEPS in a row of them
MAX_TOKENS = WARMUP_STEPS + SEARCH_STEPS + 3
SHORT_MAX_TOKENS = WARMUP_STEPS + STEPS + 3     # the static and async runs: medians over STEPS
MAX_CONTEXT = 256               # the bundled model's window
PROMPT_SEED = 16
RECORD = ROOT / "chapters" / "figures" / "s16_host.json"


# ---------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------

def schedule(mode: str, steps: list[dict], graph_forward_ms: float | None = None) -> dict:
    """The timeline of `steps` (each a dict with PHASES' lengths as "<phase>_ms", milliseconds
    >= 0) in one mode, in milliseconds from 0.

    Returns {"lanes": {"host": [[phase, step, start, end], ...], "worker": [...]}, each lane in
    time order ("worker" empty in the one-lane modes), "outputs_at": [when each step's
    postprocess ends: its outputs are ready], "end": when the last box ends}. step is the
    index in `steps`. graph_forward_ms: the forward of every step in "graph" and
    "graph+async". Raises ParameterError (a ValueError) naming the rule: an unknown mode, no
    steps, a graph mode without a forward time, a length that is not a finite number >= 0.
    """
    if mode not in MODES:
        raise ParameterError(f"mode must be one of {', '.join(MODES)} (got {mode!r})", "mode",
                             mode)
    if not steps:
        raise ParameterError("steps must hold at least one step", "steps", steps)
    graph = mode.startswith("graph")
    if graph and not _is_length(graph_forward_ms):
        raise ParameterError(f"mode {mode} needs graph_forward_ms, a finite number >= 0 "
                             f"(got {graph_forward_ms!r})", "graph_forward_ms",
                             graph_forward_ms)
    lengths = []
    for i, step in enumerate(steps):
        row = {}
        for phase in PHASES:
            value = step.get(f"{phase}_ms")
            if not _is_length(value):
                raise ParameterError(f"step {i}: {phase}_ms must be a finite number >= 0 "
                                     f"(got {value!r})", "steps", value)
            row[phase] = value
        if graph:
            row["forward"] = graph_forward_ms
        lengths.append(row)

    host, worker, outputs_at = [], [], []

    def box(lane, phase, i, start):
        end = start + lengths[i][phase]
        lane.append([phase, i, start, end])
        return end

    n = len(lengths)
    if not mode.endswith("async"):
        t = 0.0
        for i in range(n):
            for phase in PHASES:
                t = box(host, phase, i, t)
                if phase == "postprocess":
                    outputs_at.append(t)
        return {"lanes": {"host": host, "worker": worker}, "outputs_at": outputs_at, "end": t}

    h = box(host, "schedule", 0, 0.0)                 # plan step 0
    w = box(worker, "prepare", 0, h)                  # launch it
    forward_end = box(worker, "forward", 0, w)
    if n > 1:
        h = box(host, "schedule", 1, h)               # plan step 1 while forward 0 runs
    for i in range(n):
        h = box(host, "sample", i, max(h, forward_end))   # wait for step i's logits
        if i + 1 < n:                                 # launch step i + 1 with its tokens
            w = box(worker, "prepare", i + 1, h)
            forward_end = box(worker, "forward", i + 1, w)
        h = box(host, "postprocess", i, h)
        outputs_at.append(h)
        h = box(host, "update", i, h)
        if i + 2 < n:
            h = box(host, "schedule", i + 2, h)       # plan step i + 2 while i + 1 runs
    return {"lanes": {"host": host, "worker": worker}, "outputs_at": outputs_at,
            "end": max(h, forward_end)}


def _is_length(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
            and x != float("inf"))


def summary(result: dict, steps: int) -> dict:
    """What the page reports for a schedule of `steps` steps: end (ms), per_step (end / steps),
    host_busy and worker_busy (ms of boxes on each lane)."""
    busy = {lane: 0.0 for lane in ("host", "worker")}
    for lane in busy:
        for _, _, start, end in result["lanes"][lane]:
            busy[lane] += end - start
    return {"end": result["end"], "per_step": result["end"] / steps,
            "host_busy": busy["host"], "worker_busy": busy["worker"]}


# ---------------------------------------------------------------------------------------------
# Recording the engine
# ---------------------------------------------------------------------------------------------

def prompts_for(tokenizer, batch_size: int) -> list[str]:
    """batch_size prompts of S07's "chat" workload (8 to 32 tokens cut from the corpus)."""
    return s08_cli.corpus_prompts(tokenizer, batch_size, PROMPT_SEED, MAX_CONTEXT)


def drive(engine, prompts: list[str], profiler: p16.StepProfiler, max_tokens: int = MAX_TOKENS
          ) -> tuple[list, dict]:
    """Add the prompts (ids "r00", "r01", ...: greedy, max_tokens, ignore_eos) and step the
    engine to the end, timing each step() call. Returns ([(StepProfile, wall seconds of the
    call that produced it)], {request id: (output token ids, output text)}), both joined from
    the step outputs (`new_token_ids`, `text_delta`)."""
    params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{i:02d}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(prompt, params, request_id=rid)
    timed, tokens, texts = [], {rid: [] for rid in ids}, {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        made = profiler.num_profiled
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        if profiler.num_profiled > made:
            timed.append((profiler.profiles[-1], wall))
        for out in outputs:
            tokens[out.request_id] += list(out.new_token_ids)
            texts[out.request_id].append(out.text_delta)
    return timed, {rid: (tokens[rid], "".join(texts[rid])) for rid in ids}


def decode_steps(timed: list, batch_size: int, count: int = SEARCH_STEPS) -> list:
    """The `count` decode steps of all batch_size requests after WARMUP_STEPS of them.
    Raises RuntimeError when the run has fewer."""
    decodes = [(p, wall) for p, wall in timed
               if p.kind == p16.DECODE and p.num_seqs == batch_size]
    picked = decodes[WARMUP_STEPS:WARMUP_STEPS + count]
    if len(picked) < count:
        raise RuntimeError(f"B={batch_size}: {len(decodes)} decode steps of all requests, "
                           f"need {WARMUP_STEPS + count}")
    return picked


def quietest_window(steps: list) -> list:
    """The STEPS consecutive steps of `steps` ((StepProfile, wall) pairs) whose phases take
    the least time together. On a shared machine a step only gets slower (another process
    takes the core), so the quietest window is the nearest to the engine's own cost; the
    first such window when several tie."""
    totals = [sum(p.step_s - p.other_s for p, _ in steps[i:i + STEPS])
              for i in range(len(steps) - STEPS + 1)]
    best = totals.index(min(totals))
    return steps[best:best + STEPS]


def engine_for(model, tokenizer, batch_size: int, how: str = "eager"):
    engine = s13.build_engine(model, tokenizer, max_num_seqs=batch_size,
                              max_context=MAX_CONTEXT)
    if how == "static":
        return s16_static.make_static(engine)
    if how == "async":
        return s16_async.AsyncLLMEngine(engine)
    return engine


def median_ms(values) -> float:
    return statistics.median(values) * 1e3


def record_run(model, tokenizer, batch_size: int, record: dict | None) -> dict:
    """One batch size, recorded (see the module docstring)."""
    prompts = prompts_for(tokenizer, batch_size)
    runs, tokens = {}, {}
    for how in ("eager", "static", "async"):
        engine = engine_for(model, tokenizer, batch_size, how)
        profiler = p16.profile(engine)
        count = SEARCH_STEPS if how == "eager" else STEPS
        try:
            timed, tokens[how] = drive(engine, prompts, profiler,
                                       MAX_TOKENS if how == "eager" else SHORT_MAX_TOKENS)
        finally:
            if how == "async":
                engine.shutdown()
        runs[how] = decode_steps(timed, batch_size, count)
    steps = []
    for i, (profile, wall) in enumerate(quietest_window(runs["eager"])):
        item = p16.to_json([profile])[0]
        steps.append({"index": i, "step": profile.step, "num_seqs": profile.num_seqs,
                      **{f"{phase}_ms": item[f"{phase}_ms"] for phase in PHASES},
                      "other_ms": item["other_ms"], "step_ms": item["step_ms"],
                      "wall_ms": wall * 1e3, "host_fraction": item["host_fraction"],
                      "segments": item["segments"]})
    static_forward = median_ms(p.forward_s for p, _ in runs["static"])
    bucket = s16_static.pick_bucket(s16_static.bucket_sizes(batch_size), batch_size)
    from_record = compiled_forward_from_record(record, batch_size)
    if from_record is not None:
        graph = {"forward_ms": from_record[0], "source": "record", "label": from_record[1]}
    else:
        graph = {"forward_ms": static_forward, "source": "static-eager",
                 "label": f"the static decode step run eagerly (persistent buffers, bucket "
                          f"{bucket}, not compiled), measured in this build: no compiled "
                          f"figure in {RECORD.relative_to(ROOT)}"}
    first = "r00"
    return {
        "id": f"b{batch_size}", "batch_size": batch_size,
        "title": f"B = {batch_size}: {batch_size} request{'s' if batch_size > 1 else ''} "
                 "decoding",
        "steps": steps,
        "graph": graph,
        "eager_forward_ms": median_ms(p.forward_s for p, _ in runs["eager"]),
        "static_forward_ms": static_forward,
        "measured": {how: {"step_ms": median_ms(w for _, w in runs[how]),
                           "forward_ms": median_ms(p.forward_s for p, _ in runs[how])}
                     for how in runs},
        "outputs_equal": {how: all(ids == tokens["eager"][rid][0][:len(ids)]
                                   and len(ids) == SHORT_MAX_TOKENS
                                   for rid, (ids, _) in tokens[how].items())
                          for how in ("static", "async")},
        "texts_equal": {how: all(tokens["eager"][rid][1].startswith(text) and text
                                 for rid, (_, text) in tokens[how].items())
                        for how in ("static", "async")},
        "first_request": {"prompt": prompts[0], "max_tokens": MAX_TOKENS,
                          "output_ids": tokens["eager"][first][0],
                          "text": tokens["eager"][first][1]},
        "reference": {mode: schedule(mode, steps, graph["forward_ms"]) for mode in MODES},
    }


# ---------------------------------------------------------------------------------------------
# The benchmark record
# ---------------------------------------------------------------------------------------------

def read_record(path: Path = RECORD) -> dict | None:
    """The benchmark record (JSON), or None when there is none."""
    path = Path(path)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def compiled_forward_from_record(record: dict | None, batch_size: int
                                 ) -> tuple[float, str] | None:
    """(ms, label) of the compiled decode step's forward on the bundled model at batch_size,
    from the record, or None when it has none.

    benchmarks/bench_s16_host.py times every engine variant's decode steps with the
    StepProfiler and records each variant's median forward ("forward_ms": the model call less
    the batch preparation, the same split as this page's boxes): the "compiled" variant's row
    of the bundled model at B in record["host"]["models"]["bundled"]["batches"][str(B)], or,
    for the async section's batch, in record["async"]["rows"]. Only a forward is taken; the
    host phases stay the ones recorded here.
    """
    found = [dig(record, "host", "models", "bundled", "batches", str(batch_size), "compiled")]
    if dig(record, "async", "batch") == batch_size:
        found.append(dig(record, "async", "rows", "compiled"))
    for row in found:
        if isinstance(row, dict) and _is_length(row.get("forward_ms")) and row["forward_ms"] > 0:
            return (float(row["forward_ms"]),
                    f"the torch.compile'd static decode step of the bundled model at "
                    f"B = {batch_size}, its median forward in {RECORD.relative_to(ROOT)} "
                    "(the benchmark's machine)")
    return None


def async_from_record(record: dict | None) -> dict | None:
    """The record's async section in short: {"batch": B, "rows": {variant: median step ms}}
    (benchmarks/bench_s16_host.py's section D, every variant it ran), or None."""
    rows = dig(record, "async", "rows")
    if not isinstance(rows, dict):
        return None
    rows = {label: row["step_ms"] for label, row in rows.items()
            if isinstance(row, dict) and _is_length(row.get("step_ms"))}
    return {"batch": dig(record, "async", "batch"), "rows": rows} if rows else None


def dig(tree, *keys):
    """tree[k0][k1]..., or None where a level is missing or not a dict."""
    for key in keys:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------

def export() -> dict:
    """The simulator's data (JSON-able). Raises RuntimeError without the bundled model."""
    if not (s03.BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        raise RuntimeError("the step-overlap page replays runs of the bundled model: train it "
                           "first (python scripts/train_bundled_model.py)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = s06.load(s03.BUNDLED_MODEL_DIR, "cpu", "float32")
        record = read_record()
        runs = [record_run(model, tokenizer, b, record) for b in BATCH_SIZES]
    finally:
        torch.set_num_threads(threads)
    return {
        "source": "code/s13_prefix_caching.py's engine on the bundled model (float32, CPU, one "
                  "thread), timed by code/s16_profile.py's StepProfiler; static and async "
                  "runs with code/s16_static.py and code/s16_async.py",
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
                   f"{platform.python_version()}, torch {torch.__version__}, 1 thread",
        "phases": list(PHASES), "worker_phases": list(WORKER_PHASES), "modes": list(MODES),
        "warmup_steps": WARMUP_STEPS, "max_tokens": MAX_TOKENS,
        "short_max_tokens": SHORT_MAX_TOKENS, "search_steps": SEARCH_STEPS,
        "record": {"path": str(RECORD.relative_to(ROOT)), "present": record is not None,
                   "used": any(r["graph"]["source"] == "record" for r in runs),
                   "async": async_from_record(record)},
        "defaults": {"run": BATCH_SIZES.index(DEFAULT_BATCH_SIZE), "steps": 4},
        "runs": runs,
    }


if __name__ == "__main__":  # what the page gets, in short
    d = export()
    print(f"{len(json.dumps(d, separators=(',', ':'))):,} bytes of JSON")
    for r in d["runs"]:
        s = {m: summary(r["reference"][m], len(r["steps"]))["per_step"] for m in MODES}
        print(r["id"], "per step ms", {m: round(v, 3) for m, v in s.items()},
              "measured", {k: round(v["step_ms"], 3) for k, v in r["measured"].items()},
              "graph", r["graph"]["source"], round(r["graph"]["forward_ms"], 3),
              "equal", r["outputs_equal"], r["texts_equal"])
