"""S18's measurement: what one all-reduce costs between two processes on this machine, how
many a decode step needs and how large they are, and the decode step of TP = 2 against TP = 1
on a small model (communication-bound) and a mid-size one (compute-bound); on a GPU, NCCL at
world size 1 as a smoke test.

    python benchmarks/bench_s18_tensor_parallel.py --quick    # a smoke run, < 20 s (scratch JSON)
    python benchmarks/bench_s18_tensor_parallel.py            # the full run, 2-4 min (scratch)
    python benchmarks/bench_s18_tensor_parallel.py --record   # the committed record (quiet machine)
    python benchmarks/bench_s18_tensor_parallel.py --device cuda --json OUT.json   # the gpu section

A benchmark, not a test: it prints and records, never asserts a speed. Float32, greedy,
random prompt ids (EOS ignored), one torch thread per rank unless said. Shape legend: B batch,
T tokens in the step, C hidden size, V vocabulary, L layers, N ranks.

Sections (--sections; default allreduce,tp on the CPU, gpu with --device cuda):

1. allreduce: one all-reduce of a float32 message of 512 B to 16 MiB (powers of 2, so the
   sizes a decode step sends below are measured points) between two processes of this
   machine: this one (rank 0) and one spawned rank, each on one thread, through gloo
   (torch.distributed, `s18_allreduce.DistCommunicator`: loopback TCP) and through shared memory
   (`s18_allreduce.ShmCommunicator` over a `ShmArena`: vLLM's CPU custom all-reduce idea; x86
   only). Both ranks run the same schedule: --rounds rounds, each size in turn, the two
   communicators alternating (their order swapped every round); per (size, communicator,
   round) one call checks the sum (rank r sends r + 1: every element must be 3), then the
   message is zeroed, WARMUP_CALLS untimed calls, then --calls timed calls at sizes up to
   64 KiB (a quarter of that up to 1 MiB, a sixteenth above, at least 2). Rank 0 times each
   call (time.perf_counter); median and minimum per (size, communicator), and bytes / median.
   Beside it the plan of one decode step from the configs (`s18_layers.allreduce_plan`):
   1 + 2 L all-reduces (the embedding's, then two per layer: after the attention's output
   projection and after the MLP's down projection), each of T C 4 bytes (T = B decode tokens),
   and the logits gathered on rank 0 (T V / N 4 bytes from each rank), for the bundled model
   and the mid-size one at B = 1 and 32; with the measured latency at that size, the
   all-reduce time such a step spends (count x median).
2. tp: the decode step of four configurations on the bundled model (6 layers, C = 128) and on
   a seeded random Qwen3 (bench_s11's MID_SHAPE: 8 layers, C = 512, 8 heads, 4 KV heads;
   built as bench_s12 builds it), at B = 1 and 32 (--batches), the same prompts everywhere
   (PROMPT_TOKENS random ids each, seeded), greedy, ignore_eos:
   "tp1": S17's engine in this process, one thread (`s18_tensor_parallel.build_engine` with
   tensor_parallel_size=1); "tp1_2threads": the same with torch on two threads (the honest
   peer of two ranks: both use two cores); "tp2_shm": a `TPExecutor` of two ranks (this
   process and one spawned), one thread each, summing through shared memory; "tp2_gloo": the
   same with disable_custom_all_reduce=True (gloo's all-reduce). Every engine is S12's paged
   builder with S17's "gather" backend and SDPA attention (the same pool size for all).
   --rounds rounds; in each, per model, the four configurations in turn (their order rotated
   every round); each builds its engines (a TP = 2 configuration starts its executor, builds
   one engine per B on it, then shuts it down, so no rank process is alive while a TP = 1
   configuration is timed: the baseline runs alone), prefills every prompt in one step, takes
   WARMUP untimed decode steps, then --steps timed ones (each checked to be a pure decode step
   of B tokens; rank 0's all-reduce count and bytes read over each). Reported per (model, B):
   median ms per decode step (`engine.step()` wall time) and of its model part (S09's
   times["model"]), the speedup TP=1 / TP=2 (> 1: TP = 2 is faster), the all-reduces per step
   and their bytes (from rank 0's communicator), each rank's KV pool bytes, the greedy tokens
   of every configuration compared with tp1's; per model, the weight bytes each rank holds
   (the executor's, and `s18_layers.shard_bytes`) against the whole model's. The crossover
   table puts the speedups of both models and both B side by side.
3. gpu (--device cuda): NCCL at world size 1 on cuda:0, a smoke test: a `TPExecutor`
   (ParallelConfig(1, backend="nccl"), every tensor read from the bundled checkpoint) under
   S17's engine against the same engine without an executor, B = 1 and 32, the two stepped
   alternately (--rounds blocks of --steps): greedy tokens compared and median step time; then
   one `torch.distributed.all_reduce` on a CUDA tensor at world size 1 at each message size
   (synchronised, median of GPU_CALLS calls). One GPU cannot show scaling: at world size 1
   the layers' all-reduces (called all the same) and NCCL's call sum nothing; what
   N GPUs would show is the chapter's (gpt-fast's and Megatron's figures). With --device cpu
   the same code runs on gloo at world size 1: a rehearsal of the section (scripts/
   gpu_check.sh's GPU_CHECK_CPU=1), its figures the CPU's. --budget-s (gpu_check's part
   budget) leaves out the parts that would not fit, named in the JSON's "cut".

--quick is a smoke run (< 20 s): all-reduce at 512 B, 2 KiB, 64 KiB and 1 MiB, one round of
a few calls; the bundled model only, B = 1 and 4, 16-token prompts, one round of three steps.
Its figures are not the record's (QUICK_DISCLAIMER is printed before and after).

What it does not handle: more than two ranks (this machine has two cores: N ranks of one
thread need N cores, `check_parallel`'s rule); prefill time (only decode steps are timed);
S13's prefix caching (random prompts never hit); NCCL across GPUs (one GPU is what this
project can borrow).

The CPU is shared: `uptime` and os.getloadavg() are recorded before and after, and each
section's 1-minute load. JSON goes to --json (default a scratch file in the temp directory),
or with --record to chapters/figures/s18_tensor_parallel.json; it is rewritten after each
section (and after each part of the gpu section).

Tests: tests/test_s18_bench.py (flags, one --quick run, the record's consistency).

References: Shoeybi et al., Megatron-LM (2019), section 3 (two all-reduces per layer); vLLM's
custom all-reduce (vllm/distributed/device_communicators/: the CPU shared-memory one and the
CUDA one) and its `disable_custom_all_reduce`; PyTorch's torch.distributed (gloo, NCCL);
bench_s17_attention.py (the flags, the sections, the record) and bench_s12_paged_attention.py
(the mid-size model).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as S06, before NumPy loads

import argparse
import platform
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import s03_checkpoint  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s08_cli  # noqa: E402
import s12_engine as s12  # noqa: E402
import s18_allreduce  # noqa: E402
import s18_layers  # noqa: E402
import s18_tensor_parallel as s18  # noqa: E402
from bench_s06_torch import IdTokenizer  # noqa: E402
from bench_s10_scheduler import check_json, uptime, write_json  # noqa: E402
from bench_s17_attention import LastStep, cdiv, cpu_name, load, median  # noqa: E402
from bench_s11_chunked_prefill import MID_SHAPE  # noqa: E402

RECORD_JSON = ROOT / "chapters" / "figures" / "s18_tensor_parallel.json"
DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s18_tensor_parallel.json"
SECTIONS = ("allreduce", "tp", "gpu")
CPU_SECTIONS = ("allreduce", "tp")
QUICK_DISCLAIMER = ("--quick: a smoke run (all-reduce at 4 sizes, one round; the bundled model "
                    "only, B = 1 and 4, 16-token prompts, one round of 3 steps); its figures "
                    "are not the committed record's: chapters/figures/s18_tensor_parallel.json")
NOTES = [
    "TP=2 runs two processes of one thread each, so it uses two cores where tp1 uses one: the "
    "comparison is per-step latency; tp1_2threads (one process, torch on two threads) is the "
    "honest peer for two cores.",
    "tp1 and tp1_2threads are timed with no rank process alive (each TP=2 configuration's "
    "executor is shut down before the next configuration starts).",
    "speedup = the TP=1 configuration's median decode step / the TP=2 configuration's "
    "(> 1: TP=2 is faster).",
    "The shared-memory all-reduce spins until its peer has written: both ranks must be on a "
    "core at once. On a loaded machine a waiting rank yields and its peer runs a scheduler "
    "slice later, so its times turn bimodal (tens of microseconds, or hundreds): record on a "
    "quiet machine (see load_average).",
]
WORLD_SIZE = 2

# 1. allreduce
ALLREDUCE_BYTES = tuple(512 * 2 ** k for k in range(16))          # 512 B .. 16 MiB
QUICK_ALLREDUCE_BYTES = (512, 2048, 65536, 1 << 20)
COMMS = ("gloo", "shm")
WARMUP_CALLS = 2
PLAN_BATCHES = (1, 32)
RENDEZVOUS_TIMEOUT_S = 120.0

# 2. tp
CONFIGS = ("tp1", "tp1_2threads", "tp2_shm", "tp2_gloo")
TP2_CONFIGS = ("tp2_shm", "tp2_gloo")
BASELINES = ("tp1", "tp1_2threads")
PROMPT_TOKENS = 64
QUICK_PROMPT_TOKENS = 16
BLOCK_SIZE = 16
WARMUP = 2                 # untimed decode steps per engine, after its prefill
QUICK_WARMUP = 1
MODEL_NAMES = {"bundled": "bundled model", "mid": "mid-size random Qwen3"}
# the expectation: the bundled model is communication-bound, the mid-size compute-bound
EXPECTED_FASTER = {"bundled": False, "mid": True}
MAX_BATCH = 64
MAX_ROUNDS = 10
MAX_STEPS = 64
MAX_CALLS = 1000

# 3. gpu
GPU_CALLS = 50
GPU_NOTE = ("One GPU cannot show scaling: at world size 1 the layers' all-reduces (called all "
            "the same) and NCCL's all-reduce sum nothing; the step times show the "
            "executor's own cost on the device. What N GPUs would show is the chapter's (the "
            "Megatron-LM paper's and gpt-fast's scaling figures).")


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def mid_config() -> s03.TransformerConfig:
    """MID_SHAPE as our TransformerConfig (no model built: the plan needs only the sizes)."""
    return s03_checkpoint.config_from_hf_dict({**MID_SHAPE, "model_type": "qwen3"})


# ---------------------------------------------------------------------------------------------
# 1. allreduce: two processes, gloo against shared memory
# ---------------------------------------------------------------------------------------------

def calls_at(nbytes: int, calls: int) -> int:
    """Timed calls per (size, communicator, round): --calls up to 64 KiB, fewer above (a large
    message is long enough to time in fewer calls)."""
    if nbytes <= 64 * 1024:
        return calls
    if nbytes <= 1 << 20:
        return max(2, calls // 4)
    return max(2, calls // 16)


def allreduce_schedule(sizes, comms, rounds: int, calls: int) -> list[tuple[int, int, str, int]]:
    """[(round, bytes, communicator, timed calls)] in the order both ranks run them: each
    round every size, the communicators in turn, their order swapped every round."""
    out = []
    for r in range(rounds):
        order = list(comms) if r % 2 == 0 else list(reversed(comms))
        for nbytes in sizes:
            for name in order:
                out.append((r, nbytes, name, calls_at(nbytes, calls)))
    return out


def run_schedule(comms: dict, rank: int, schedule) -> tuple[dict, dict]:
    """Run the schedule on this rank: ({(name, bytes): [microseconds per timed call]},
    {(name, bytes): every checked sum right}). Rank r sends r + 1, so the sum of two ranks is
    3 in every element."""
    samples: dict = {}
    correct: dict = {}
    want = sum(range(1, WORLD_SIZE + 1))
    for _, nbytes, name, n in schedule:
        comm = comms[name]
        x = torch.full((nbytes // 4,), float(rank + 1))
        comm.all_reduce(x)
        key = (name, nbytes)
        correct[key] = correct.get(key, True) and bool((x == want).all())
        x.zero_()                    # timed on zeros: the values never grow to inf
        for _ in range(WARMUP_CALLS):
            comm.all_reduce(x)
        times = samples.setdefault(key, [])
        for _ in range(n):
            start = time.perf_counter()
            comm.all_reduce(x)
            times.append(round((time.perf_counter() - start) * 1e6, 3))
    return samples, correct


def _allreduce_peer(port: int, arena, schedule, parent: int, timeout_s: float) -> None:
    """Rank 1 of the allreduce section (a spawned process): join rank 0's group, run the same
    schedule untimed, leave. Exits 0, or 1 after printing its error."""
    import torch.distributed as dist
    code = 0
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        store.set("bench_s18/alive", b"1")
        dist.init_process_group("gloo", store=dist.PrefixStore("bench_s18", store), rank=1,
                                world_size=WORLD_SIZE, timeout=timedelta(seconds=timeout_s))
        comms = {"gloo": s18_allreduce.DistCommunicator()}
        if arena is not None:
            comms["shm"] = s18_allreduce.ShmCommunicator(arena, 1, lambda: os.getppid() == parent,
                                                      timeout_s)
        run_schedule(comms, 1, schedule)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as err:        # noqa: BLE001 (printed; rank 0's call then fails)
        print(f"allreduce rank 1 failed: {err!r}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)          # no interpreter teardown racing gloo's sockets (as S18's ranks)


def measure_allreduce(sizes, rounds: int, calls: int) -> dict:
    """Spawn rank 1, join a gloo group of two with it, run the schedule on both (rank 0
    timing); returns the samples, the sum checks and the start-up seconds. Leaves no process
    and no process group behind, also when it raises."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    comms = COMMS if s18.shm_supported() else ("gloo",)
    schedule = allreduce_schedule(sizes, comms, rounds, calls)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    started = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    arena = s18_allreduce.ShmArena(WORLD_SIZE) if "shm" in comms else None
    peer = mp.get_context("spawn").Process(
        target=_allreduce_peer, name="bench-s18-rank1", daemon=True,
        args=(store.port, arena, schedule, os.getpid(), RENDEZVOUS_TIMEOUT_S))
    peer.start()
    try:
        while not store.check(["bench_s18/alive"]):    # a peer that dies starting says so
            if not peer.is_alive():
                raise RuntimeError(f"the all-reduce peer did not start (exit code "
                                   f"{peer.exitcode})")
            time.sleep(0.01)
        dist.init_process_group("gloo", store=dist.PrefixStore("bench_s18", store), rank=0,
                                world_size=WORLD_SIZE,
                                timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        spawn_s = time.perf_counter() - started
        mine = {"gloo": s18_allreduce.DistCommunicator()}
        if arena is not None:
            mine["shm"] = s18_allreduce.ShmCommunicator(arena, 0, peer.is_alive,
                                                     RENDEZVOUS_TIMEOUT_S)
        samples, correct = run_schedule(mine, 0, schedule)
        dist.barrier()
        dist.destroy_process_group()
        peer.join(timeout=30)
        if peer.exitcode != 0:
            raise RuntimeError(f"the all-reduce peer exited with code {peer.exitcode}")
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        del store
    return {"comms": list(comms), "samples": samples, "correct": correct, "spawn_s": spawn_s,
            "arena_capacity_bytes": None if arena is None else arena.capacity * 4}


def step_plan(key: str, config: s03.TransformerConfig, batch: int) -> dict:
    """One decode step of B requests on N = 2 ranks (`s18_layers.allreduce_plan`)."""
    plan = s18_layers.allreduce_plan(config, batch, WORLD_SIZE)
    return {"model": key, "batch": batch, "tokens": batch,
            "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "all_reduce_per_step": plan["all_reduce"],
            "bytes_each": plan["all_reduce_bytes"],
            "bytes_per_step": plan["all_reduce"] * plan["all_reduce_bytes"],
            "gather_bytes_per_rank": batch * plan["gather_bytes_per_row"],
            "gather_bytes_per_step": batch * plan["gather_bytes_per_row"] * WORLD_SIZE}


def section_allreduce(args, configs: dict) -> dict:
    sizes = QUICK_ALLREDUCE_BYTES if args.quick else ALLREDUCE_BYTES
    before = load()
    print(f"\n1. allreduce: one float32 all-reduce between 2 processes (this one and one "
          f"spawned), 1 thread each; {args.rounds} round(s), {args.calls} timed calls per "
          f"size up to 64 KiB (fewer above), medians")
    measured = measure_allreduce(sizes, args.rounds, args.calls)
    rows, ratios = [], []
    for nbytes in sizes:
        med = {}
        for name in measured["comms"]:
            samples = measured["samples"][(name, nbytes)]
            med[name] = median(samples)
            rows.append({"comm": name, "bytes": nbytes, "samples_us": samples,
                         "median_us": med[name], "min_us": min(samples),
                         "bytes_per_s": nbytes / (med[name] / 1e6),
                         "correct": measured["correct"][(name, nbytes)]})
        if "shm" in med:
            ratios.append({"bytes": nbytes, "gloo_over_shm": med["gloo"] / med["shm"]})
    latency = {(r["comm"], r["bytes"]): r["median_us"] for r in rows}
    plan = []
    for key, config in configs.items():
        for batch in PLAN_BATCHES:
            row = step_plan(key, config, batch)
            row["all_reduce_ms_per_step"] = {
                name: (row["all_reduce_per_step"] * latency[(name, row["bytes_each"])] / 1e3
                       if (name, row["bytes_each"]) in latency else None)
                for name in measured["comms"]}
            plan.append(row)
    skipped = {} if s18.shm_supported() else {
        "shm": f"the shared-memory all-reduce needs an x86 CPU (this is {platform.machine()})"}
    part = {"world_size": WORLD_SIZE, "comms": measured["comms"], "bytes": list(sizes),
            "rounds": args.rounds, "calls": {str(n): calls_at(n, args.calls) for n in sizes},
            "warmup_calls": WARMUP_CALLS, "spawn_s": measured["spawn_s"],
            "arena_capacity_bytes": measured["arena_capacity_bytes"], "rows": rows,
            "ratios": ratios, "plan": plan, "skipped": skipped,
            "load_average_1min": [before, load()]}
    print_allreduce(part)
    return part


def print_allreduce(part: dict) -> None:
    comms = part["comms"]
    med = {(r["comm"], r["bytes"]): r for r in part["rows"]}
    head = "".join(f" {c + ' us':>11}" for c in comms)
    print(f"  {'message':>9}{head}" + (f" {'gloo/shm':>9} {'shm GB/s':>9}"
                                         if "shm" in comms else "") + "  sum right")
    for nbytes in part["bytes"]:
        cells = "".join(f" {med[(c, nbytes)]['median_us']:11.1f}" for c in comms)
        extra = ""
        if "shm" in comms:
            g, s = med[("gloo", nbytes)], med[("shm", nbytes)]
            extra = f" {g['median_us'] / s['median_us']:8.1f}x {s['bytes_per_s'] / 1e9:9.2f}"
        ok = all(med[(c, nbytes)]["correct"] for c in comms)
        print(f"  {size_label(nbytes):>9}{cells}{extra}  {'yes' if ok else 'NO'}")
    print(f"  (rank 1 joined in {part['spawn_s']:.1f} s)")
    print("\n  one decode step on 2 ranks: 1 + 2 L all-reduces of B x C x 4 bytes, and the "
          "logits gathered on rank 0")
    print(f"  {'model':>8} {'B':>3} {'L':>3} {'count':>6} {'bytes each':>11} "
          f"{'per step':>10} {'gather/rank':>12}" + "".join(f" {c + ' ms/step':>13}"
                                                           for c in comms))
    for p in part["plan"]:
        ms = [p["all_reduce_ms_per_step"][c] for c in comms]
        est = "".join(f" {'-' if m is None else format(m, '.3f'):>13}" for m in ms)
        print(f"  {p['model']:>8} {p['batch']:>3} {p['num_layers']:>3} "
              f"{p['all_reduce_per_step']:>6} {size_label(p['bytes_each']):>11} "
              f"{size_label(p['bytes_per_step']):>10} "
              f"{size_label(p['gather_bytes_per_rank']):>12}{est}")


# ---------------------------------------------------------------------------------------------
# 2. tp: TP = 2 against TP = 1, decode steps
# ---------------------------------------------------------------------------------------------

def model_weight_bytes(model) -> int:
    """Bytes of an S06 model's weights, each tensor once (a tied head once): what
    `TPTransformer.weight_bytes` counts for a rank's share."""
    seen = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def subjects(args) -> dict:
    """{key: (model, build seconds)}: the bundled model, and unless --quick the mid-size one
    (a reason string instead when transformers is missing)."""
    out = {}
    start = time.perf_counter()
    model, _ = s06.load(attention="sdpa")
    out["bundled"] = (model, time.perf_counter() - start)
    if not args.quick:
        try:
            from bench_s12_paged_attention import build
        except ImportError as err:
            out["mid"] = f"the mid-size model needs transformers ({err})"
            return out
        start = time.perf_counter()
        out["mid"] = (build(MID_SHAPE, args.seed, "cpu"), time.perf_counter() - start)
    return out


def prompts_for(seed: int, key: str, batch: int, length: int, vocab: int) -> list[list[int]]:
    """B random prompts of `length` ids in [1, V) (0 is the IdTokenizer's EOS), seeded by
    (seed, model, B): every configuration decodes the same ones."""
    rng = np.random.default_rng([seed, {"bundled": 0, "mid": 1}[key], batch])
    return [[int(t) for t in rng.integers(1, vocab, size=length)] for _ in range(batch)]


def configs_in_round(r: int) -> list[str]:
    k = r % len(CONFIGS)
    return list(CONFIGS[k:] + CONFIGS[:k])


def time_engine(engine, prompts, warmup: int, steps: int, comm=None) -> dict:
    """Prefill every prompt (one step: the token budget holds them all), `warmup` untimed
    decode steps, then `steps` timed ones, each a pure decode step of B tokens. Returns the
    samples (ms), rank 0's all-reduce count and bytes over each timed step (comm given), the
    tokens each request has, and the pool's bytes."""
    watcher = LastStep()
    engine.observers.append(watcher)
    params = s04.SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    start = time.perf_counter()
    while not all(engine.requests[i].output_ids for i in ids):
        engine.step()
    prefill_s = time.perf_counter() - start
    out = {"step_ms": [], "model_ms": [], "all_reduce": [], "all_reduce_bytes": [],
           "prefill_s": prefill_s}
    for k in range(warmup + steps):
        if comm is not None:
            comm.reset_counts()
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        result = watcher.result
        assert result.num_tokens == len(prompts), ("not a pure decode step", result.num_tokens)
        if k < warmup:
            continue
        a, e = result.times["model"]
        out["step_ms"].append(wall * 1e3)
        out["model_ms"].append((e - a) * 1e3)
        if comm is not None:
            out["all_reduce"].append(comm.num_all_reduce)
            out["all_reduce_bytes"].append(comm.all_reduce_bytes)
    out["tokens"] = [list(engine.requests[i].output_ids) for i in ids]
    out["pool_bytes"] = engine.runner.cache.nbytes
    return out


def run_config(args, key: str, model, name: str, prompts: dict, record: dict) -> dict:
    """One configuration on one model for one round: {B: time_engine's result}. A TP = 2
    configuration starts its executor first and shuts it down at the end (its processes
    checked gone); `record` collects the executor's facts (weight bytes, start seconds)."""
    executor = None
    threads = 2 if name == "tp1_2threads" else 1
    tokenizer = IdTokenizer(model.vocab_size)
    results = {}
    try:
        if name in TP2_CONFIGS:
            start = time.perf_counter()
            executor = s18.TPExecutor(model, s18.ParallelConfig(
                WORLD_SIZE, disable_custom_all_reduce=(name == "tp2_gloo")),
                str(model.device), model.dtype, model.attention_impl)
            record.setdefault("executor_start_s", []).append(time.perf_counter() - start)
            record["executor_weight_bytes"] = executor.weight_bytes
            record.setdefault("custom_all_reduce", {})[name] = executor.arena is not None
        torch.set_num_threads(threads)
        for batch, batch_prompts in prompts.items():
            length = len(batch_prompts[0])
            max_context = cdiv(length + args.warmup + args.steps + 2, BLOCK_SIZE) * BLOCK_SIZE
            options = dict(max_context=max_context, max_num_seqs=batch,
                           max_num_batched_tokens=batch * length, block_size=BLOCK_SIZE,
                           builder=s12.build_engine)
            if executor is None:
                engine = s18.build_engine(model, tokenizer, tensor_parallel_size=1, **options)
            else:
                engine = s18.build_engine(model, tokenizer, executor=executor, **options)
            results[batch] = time_engine(engine, batch_prompts, args.warmup, args.steps,
                                         None if executor is None else executor.comm)
            del engine
    finally:
        torch.set_num_threads(1)
        if executor is not None:
            executor.shutdown()
            alive = [p.pid for p in executor.processes if p.is_alive()]
            assert not alive, f"rank processes still alive after shutdown: {alive}"
    return results


def section_tp(args, models: dict) -> dict:
    before = load()
    length = QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS
    print(f"\n2. tp: decode step, TP=2 against TP=1; B = {args.batches}, {length}-token "
          f"prompts, {args.rounds} round(s) of {args.warmup} untimed + {args.steps} timed "
          f"steps per configuration, configurations rotated each round")
    skipped = {k: v for k, v in models.items() if isinstance(v, str)}
    live = {k: v for k, v in models.items() if not isinstance(v, str)}
    for k, why in skipped.items():
        print(f"  ({MODEL_NAMES[k]} skipped: {why})")
    prompts = {k: {b: prompts_for(args.seed, k, b, length, m.vocab_size)
                   for b in args.batches} for k, (m, _) in live.items()}
    raw = {k: {c: {b: [] for b in args.batches} for c in CONFIGS} for k in live}
    facts = {k: {} for k in live}
    for r in range(args.rounds):
        for k, (model, _) in live.items():
            for name in configs_in_round(r):
                mark = time.perf_counter()
                results = run_config(args, k, model, name, prompts[k], facts[k])
                for b, res in results.items():
                    raw[k][name][b].append(res)
                print(f"  round {r + 1}, {k}, {name}: {time.perf_counter() - mark:.1f} s",
                      flush=True)
    out_models = {}
    for k, (model, build_s) in live.items():
        out_models[k] = model_part(args, k, model, build_s, raw[k], facts[k])
    crossover = crossover_rows(args, out_models)
    part = {"configs": list(CONFIGS), "batches": args.batches, "prompt_tokens": length,
            "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
            "block_size": BLOCK_SIZE, "builder": "s12_engine.build_engine",
            "attention_backend": "gather", "attention": "sdpa", "threads_per_rank": 1,
            "baseline_alone": True, "models": out_models, "skipped": skipped,
            "crossover": crossover, "load_average_1min": [before, load()]}
    print_tp(part)
    return part


def model_part(args, key: str, model, build_s: float, raw: dict, facts: dict) -> dict:
    """The figures of one model from its rounds: per B the samples of each configuration
    (rounds concatenated), medians, speedups, counts, pools, tokens compared with tp1's."""
    config = model.config
    points = []
    for batch in args.batches:
        samples, tokens, pools, prefill = {}, {}, {}, {}
        counts, count_bytes = set(), set()
        for name in CONFIGS:
            runs = raw[name][batch]
            samples[name] = {"step_ms": [x for run in runs for x in run["step_ms"]],
                             "model_ms": [x for run in runs for x in run["model_ms"]]}
            tokens[name] = [run["tokens"] for run in runs]
            pools[name] = runs[0]["pool_bytes"]
            prefill[name] = median(run["prefill_s"] for run in runs)
            for run in runs:
                counts.update(run["all_reduce"])
                count_bytes.update(run["all_reduce_bytes"])
        med = {n: {m: median(v) for m, v in s.items()} for n, s in samples.items()}
        reference = tokens["tp1"][0]
        same = {n: sum(t == ref for run in tokens[n] for t, ref in zip(run, reference))
                for n in CONFIGS}
        total = args.rounds * batch
        speedup = {f"{base}_over_{tp}": med[base]["step_ms"] / med[tp]["step_ms"]
                   for base in BASELINES for tp in TP2_CONFIGS}
        points.append({
            "batch": batch, "samples": samples, "median": med, "speedup": speedup,
            "all_reduce_per_step": sorted(counts), "all_reduce_bytes_per_step":
                sorted(count_bytes), "pool_bytes": pools, "prefill_s": prefill,
            "tokens_each": len(reference[0]), "same_tokens": same, "requests_compared": total,
            "tokens_equal": all(v == total for v in same.values())})
    full = model_weight_bytes(model)
    per_rank = s18_layers.shard_bytes(config, WORLD_SIZE)
    return {"name": MODEL_NAMES[key], "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "vocab_size": config.vocab_size, "build_s": build_s,
            "parameters": s03.parameter_count(config),
            "weight_bytes": {"full": full, "shard_bytes": per_rank,
                             "executor_rank0": facts.get("executor_weight_bytes"),
                             "rank0_over_full": per_rank[0] / full},
            "custom_all_reduce": facts.get("custom_all_reduce", {}),
            "executor_start_s": facts.get("executor_start_s", []), "points": points}


def crossover_rows(args, models: dict) -> list[dict]:
    """One row per (model, B): each configuration's median step, the speedups; `as_expected`
    (full runs): the shared-memory TP = 2 faster than tp1 exactly where the issue expects it
    (the mid-size model), None in a --quick run."""
    rows = []
    for key, part in models.items():
        for p in part["points"]:
            faster = p["speedup"]["tp1_over_tp2_shm"] > 1
            rows.append({"model": key, "batch": p["batch"],
                         **{f"{n}_ms": p["median"][n]["step_ms"] for n in CONFIGS},
                         "speedup_shm": p["speedup"]["tp1_over_tp2_shm"],
                         "speedup_gloo": p["speedup"]["tp1_over_tp2_gloo"],
                         "speedup_shm_vs_2threads": p["speedup"]["tp1_2threads_over_tp2_shm"],
                         "expected_faster": EXPECTED_FASTER[key],
                         "as_expected": None if args.quick else
                         faster == EXPECTED_FASTER[key]})
    return rows


def print_tp(part: dict) -> None:
    for key, m in part["models"].items():
        w = m["weight_bytes"]
        print(f"\n  {m['name']}: L {m['num_layers']}, C {m['hidden_size']}, V "
              f"{m['vocab_size']}, {m['parameters'] / 1e6:.1f}M parameters; weights "
              f"{w['full'] / 2**20:.2f} MiB whole, {w['shard_bytes'][0] / 2**20:.2f} MiB per "
              f"rank at TP=2 ({w['rank0_over_full']:.3f} of it; rank 0's executor counts "
              f"{w['executor_rank0'] / 2**20:.2f} MiB)")
        print(f"  {'B':>3}" + "".join(f" {n + ' ms':>16}" for n in CONFIGS)
              + f" {'tp1/shm':>8} {'tp1/gloo':>9} {'2thr/shm':>9} {'AR/step':>8} "
              f"{'pool/rank':>10} tokens")
        for p in m["points"]:
            ms = "".join(f" {p['median'][n]['step_ms']:16.2f}" for n in CONFIGS)
            s = p["speedup"]
            pool = p["pool_bytes"]
            print(f"  {p['batch']:>3}{ms} {s['tp1_over_tp2_shm']:7.2f}x "
                  f"{s['tp1_over_tp2_gloo']:8.2f}x {s['tp1_2threads_over_tp2_shm']:8.2f}x "
                  f"{','.join(map(str, p['all_reduce_per_step'])):>8} "
                  f"{pool['tp2_shm'] / pool['tp1']:9.2f}x "
                  f"{'equal' if p['tokens_equal'] else 'DIFFER: ' + str(p['same_tokens'])}")
    print("\n  the crossover: speedup = TP=1 step / TP=2 step (> 1: TP=2 faster)")
    print(f"  {'model':>8} {'B':>3} {'tp1 ms':>8} {'tp2 shm ms':>11} {'speedup':>8} "
          f"{'gloo':>6} {'vs 2 threads':>13}  expected")
    for r in part["crossover"]:
        verdict = ("" if r["as_expected"] is None else
                   " (as expected)" if r["as_expected"] else " (NOT as expected)")
        print(f"  {r['model']:>8} {r['batch']:>3} {r['tp1_ms']:8.2f} {r['tp2_shm_ms']:11.2f} "
              f"{r['speedup_shm']:7.2f}x {r['speedup_gloo']:5.2f}x "
              f"{r['speedup_shm_vs_2threads']:12.2f}x  "
              f"{'faster' if r['expected_faster'] else 'slower'}{verdict}")


# ---------------------------------------------------------------------------------------------
# 3. gpu: NCCL at world size 1
# ---------------------------------------------------------------------------------------------

class Budget:
    """--budget-s for the gpu section: a part starts only when the time left is at least
    twice the longest part so far (and MIN_PART_S); what is left out is named in `cut`."""

    MIN_PART_S = 3.0

    def __init__(self, seconds: float | None, started: float):
        self.deadline = None if seconds is None else started + seconds
        self.longest, self.cut = 0.0, []

    def allows(self, what: str) -> bool:
        if self.deadline is None:
            return True
        left = self.deadline - time.perf_counter()
        if left >= max(self.MIN_PART_S, 2 * self.longest):
            return True
        self.cut.append(f"{what}: {left:.0f} s left of --budget-s")
        print(f"  (cut: {self.cut[-1]})", flush=True)
        return False

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_smoke(args, executor, model, tokenizer, batch: int) -> dict:
    """S17's engine on the world-1 executor against the same engine alone, B requests, the
    same prompts, prefilled, then stepped alternately (--rounds blocks of --steps each, after
    the warm-up): median step ms of each, tokens compared."""
    length = QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS
    prompts = prompts_for(args.seed, "bundled", batch, length, model.vocab_size)
    total = args.warmup + args.rounds * args.steps
    max_context = cdiv(length + total + 2, BLOCK_SIZE) * BLOCK_SIZE
    options = dict(max_context=max_context, max_num_seqs=batch,
                   max_num_batched_tokens=batch * length, block_size=BLOCK_SIZE,
                   builder=s12.build_engine)
    engines = {"tp1": s18.build_engine(model, tokenizer, tensor_parallel_size=1, **options),
               "world1": s18.build_engine(model, tokenizer, executor=executor, **options)}
    params = s04.SamplingParams(temperature=0.0, max_tokens=total + 2, ignore_eos=True)
    ids = {k: [e.add_request(p, params) for p in prompts] for k, e in engines.items()}
    for k, e in engines.items():
        while not all(e.requests[i].output_ids for i in ids[k]):
            e.step()
    samples = {k: [] for k in engines}
    device = executor.model.device

    def step(k: str, timed: bool) -> None:
        sync(device)
        start = time.perf_counter()
        engines[k].step()          # the sampled ids reach the host: the step has finished
        if timed:
            samples[k].append((time.perf_counter() - start) * 1e3)

    for _ in range(args.warmup):
        for k in engines:
            step(k, False)
    for r in range(args.rounds):
        for k in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            for _ in range(args.steps):
                step(k, True)
    tokens = {k: [list(e.requests[i].output_ids) for i in ids[k]] for k, e in engines.items()}
    same = sum(a == b for a, b in zip(tokens["tp1"], tokens["world1"]))
    return {"batch": batch, "prompt_tokens": length, "samples_ms": samples,
            "median_ms": {k: median(v) for k, v in samples.items()},
            "world1_over_tp1": median(samples["world1"]) / median(samples["tp1"]),
            "tokens_each": len(tokens["tp1"][0]), "same_tokens": same,
            "tokens_equal": same == batch}


def gpu_allreduce(device: torch.device, sizes, calls: int) -> list[dict]:
    """torch.distributed.all_reduce at world size 1 on `device`, each size: median
    microseconds of `calls` synchronised calls (after WARMUP_CALLS)."""
    import torch.distributed as dist
    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device)
        for _ in range(WARMUP_CALLS):
            dist.all_reduce(x)
        sync(device)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            dist.all_reduce(x)
            sync(device)
            times.append(round((time.perf_counter() - start) * 1e6, 3))
        rows.append({"bytes": nbytes, "samples_us": times, "median_us": median(times)})
    return rows


def section_gpu(args, figures: dict, write, started: float) -> dict:
    """Part 3 (see the module docstring); its figures written after each part."""
    device = torch.device("cuda", 0) if args.device.startswith("cuda") else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    gpu: dict = {"device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else f"cpu ({cpu_name()})"),
                 "backend": backend, "world_size": 1, "rehearsal": device.type != "cuda",
                 "note": GPU_NOTE, "skipped": {}}
    figures["gpu"] = gpu
    budget = Budget(args.budget_s, started)
    figures["cut"] = budget.cut                 # scripts/gpu_check_report.py reads "cut"
    print(f"\n3. gpu: {gpu['device']}, {backend} at world size 1"
          + (" (a rehearsal on the CPU: gloo, the CPU's figures)" if gpu["rehearsal"] else ""))
    print(f"  {GPU_NOTE}")
    before = load()
    model, tokenizer = s06.load(device=str(device), dtype="float32", attention="sdpa")
    tokenizer = IdTokenizer(model.vocab_size)
    start = time.perf_counter()
    executor = s18.TPExecutor(s03.BUNDLED_MODEL_DIR, s18.ParallelConfig(1, backend=backend),
                              device=str(device), dtype="float32", attention="sdpa")
    gpu["executor_start_s"] = time.perf_counter() - start
    gpu["executor_weight_bytes"] = executor.weight_bytes
    gpu["model_weight_bytes"] = model_weight_bytes(model)
    gpu["smoke"] = []
    try:
        batches = [1, 4] if args.quick else [1, 32]
        for batch in batches:
            if not budget.allows(f"smoke B {batch}"):
                continue
            mark = time.perf_counter()
            row = gpu_smoke(args, executor, model, tokenizer, batch)
            budget.took(time.perf_counter() - mark)
            gpu["smoke"].append(row)
            m = row["median_ms"]
            print(f"  B {batch}: step {m['tp1']:.2f} ms alone, {m['world1']:.2f} ms on the "
                  f"world-1 executor ({row['world1_over_tp1']:.2f}x); greedy tokens "
                  f"{'equal' if row['tokens_equal'] else 'DIFFER'} "
                  f"({row['same_tokens']}/{batch} requests, {row['tokens_each']} tokens each)")
            write()
        sizes = QUICK_ALLREDUCE_BYTES if args.quick else ALLREDUCE_BYTES
        if budget.allows("allreduce"):
            mark = time.perf_counter()
            gpu["allreduce"] = gpu_allreduce(executor.model.device, sizes,
                                             max(3, GPU_CALLS // 10) if args.quick
                                             else GPU_CALLS)
            budget.took(time.perf_counter() - mark)
            print(f"  all_reduce at world size 1 ({backend}), median us: " + ", ".join(
                f"{size_label(r['bytes'])} {r['median_us']:.1f}" for r in gpu["allreduce"]))
            write()
    finally:
        executor.shutdown()
    gpu["load_average_1min"] = [before, load()]
    return gpu


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def batch_list(text: str) -> list[int]:
    """--batches' type: comma-separated distinct integers in [1, MAX_BATCH], sorted."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or len(set(values)) != len(values) or not all(
            1 <= v <= MAX_BATCH for v in values):
        raise argparse.ArgumentTypeError(f"--batches takes distinct comma-separated integers "
                                         f"in [1, {MAX_BATCH}] (got {text!r})")
    return sorted(values)


def section_list(text: str) -> list[str]:
    """--sections' type: comma-separated names of SECTIONS, run in SECTIONS' order."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--sections takes comma-separated names from "
                                         f"{','.join(SECTIONS)} (got {text!r})")
    return [s for s in SECTIONS if s in names]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="S18 benchmark: one all-reduce's cost against "
                                     "its size (gloo and shared memory, two processes); the "
                                     "decode step of TP=2 against TP=1 on the bundled and a "
                                     "mid-size model; on a GPU, NCCL at world size 1.")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (< 20 s): 4 all-reduce sizes, the bundled model "
                             "only, B = 1 and 4, one short round (default: off)")
    parser.add_argument("--sections", type=section_list, default=None,
                        help=f"comma-separated, from {','.join(SECTIONS)} (default: "
                             f"{','.join(CPU_SECTIONS)} on the CPU, gpu with --device cuda; "
                             "gpu on the CPU is a rehearsal with gloo)")
    parser.add_argument("--batches", type=batch_list, default=None,
                        help=f"batch sizes of the tp section, each 1 to {MAX_BATCH} (default: "
                             "1,32, --quick 1,4)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds of every configuration (and of the all-reduce sizes), 1 "
                             f"to {MAX_ROUNDS} (default: 3, --quick 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed decode steps per engine per round, 1 to {MAX_STEPS} "
                             "(default: 16, --quick 3)")
    parser.add_argument("--calls", type=int, default=None,
                        help=f"timed all-reduce calls per size and round up to 64 KiB (fewer "
                             f"above), 1 to {MAX_CALLS} (default: 64, --quick 8)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole run may take; the gpu section leaves out the "
                             "parts that would not fit and names them in the JSON's \"cut\" "
                             "(scripts/gpu_check.sh gives its part's budget) (default: none)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts and the random model, >= 0 (default: "
                             "%(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N; cuda runs the gpu section on cuda:0 "
                             "(default: %(default)s)")
    parser.add_argument("--json", default=None,
                        help=f"write the figures to this JSON file (default: {DEFAULT_JSON})")
    parser.add_argument("--record", action="store_true",
                        help=f"write {RECORD_JSON.relative_to(ROOT)}, the committed record "
                             "(default: off)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)      # --seed, --device
    on_cuda = torch.device(args.device).type == "cuda"
    if args.sections is None:
        args.sections = ["gpu"] if on_cuda else list(CPU_SECTIONS)
    if on_cuda and set(args.sections) & set(CPU_SECTIONS):
        parser.error("the allreduce and tp sections measure the CPU: run them with --device "
                     "cpu (the default)")
    if args.batches is None:
        args.batches = [1, 4] if args.quick else [1, 32]
    for name, full, small, high in (("rounds", 3, 1, MAX_ROUNDS), ("steps", 16, 3, MAX_STEPS),
                                    ("calls", 64, 8, MAX_CALLS)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
        s07.check_count(parser, "--" + name, getattr(args, name), 1, high)
    args.warmup = QUICK_WARMUP if args.quick else WARMUP
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be a number of seconds > 0 (got {args.budget_s})")
    if args.record and args.json is not None:
        parser.error("--record writes the committed record; give --json or --record, not both")
    if args.record and args.quick:
        parser.error("--record takes a full run, not --quick")
    if args.record and args.sections != list(CPU_SECTIONS):
        parser.error(f"--record takes every CPU section ({','.join(CPU_SECTIONS)}) on the CPU; "
                     "a GPU run's figures go to --json (scripts/gpu_check.sh's folder)")
    if args.json is not None:
        check_json(parser, args.json)
    if not (s03.BUNDLED_MODEL_DIR / "config.json").exists() and {"tp", "gpu"} & set(
            args.sections):
        parser.error(f"the bundled model is not in {s03.BUNDLED_MODEL_DIR} yet: train it with "
                     "python scripts/train_bundled_model.py")
    length = QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS
    window = 256                            # the bundled model's context
    need = length + args.warmup + args.rounds * args.steps + 2   # the gpu section's longest
    if "gpu" in args.sections and need > window:
        parser.error(f"the gpu section's prompts ({length}) + --rounds x --steps + "
                     f"{args.warmup + 2} must fit the bundled model's {window} tokens "
                     f"(got {need})")
    cores = s18.usable_cores()
    if {"allreduce", "tp"} & set(args.sections) and cores < WORLD_SIZE:
        parser.error(f"the allreduce and tp sections run {WORLD_SIZE} ranks of one thread "
                     f"each: they need {WORLD_SIZE} cores, and this process may use {cores}")
    return args


def key_figures(figures: dict) -> dict:
    """The headline figures (scripts/gpu_check_report.py reads "key")."""
    key = {}
    for r in figures.get("allreduce", {}).get("rows", []):
        if r["bytes"] in (512, 1 << 20):
            key[f"allreduce_{r['comm']}_{size_label(r['bytes']).replace(' ', '')}_us"] = \
                r["median_us"]
    for r in figures.get("tp", {}).get("crossover", []):
        key[f"{r['model']}_B{r['batch']}_tp1_over_tp2_shm"] = r["speedup_shm"]
    gpu = figures.get("gpu", {})
    for r in gpu.get("smoke", []):
        key[f"world1_B{r['batch']}_tokens_equal"] = r["tokens_equal"]
        key[f"world1_B{r['batch']}_over_tp1"] = r["world1_over_tp1"]
    for r in gpu.get("allreduce", []):
        if r["bytes"] in (512, 1 << 20):
            key[f"world1_allreduce_{size_label(r['bytes']).replace(' ', '')}_us"] = \
                r["median_us"]
    return key


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        print(QUICK_DISCLAIMER)
    started = time.perf_counter()
    before, load_start = uptime(), list(os.getloadavg())
    print(f"before: {before}\ntorch {torch.__version__}, 1 thread per rank, device "
          f"{args.device}; {platform.machine()}, {cpu_name()}, {os.cpu_count()} logical "
          f"cores ({s18.usable_cores()} usable), Python {platform.python_version()}; "
          f"sections: {','.join(args.sections)}")
    target = RECORD_JSON if args.record else Path(args.json or DEFAULT_JSON)
    config = {"quick": args.quick, "sections": args.sections, "batches": args.batches,
              "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
              "calls": args.calls, "seed": args.seed, "device": args.device, "threads": 1,
              "world_size": WORLD_SIZE, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine(),
              "cpu": cpu_name(), "logical_cores": os.cpu_count(),
              "usable_cores": s18.usable_cores(), "mid_shape": MID_SHAPE}
    figures: dict = {"config": config, "notes": NOTES, "load_average": {"start": load_start}}
    section_s: dict = {}

    def write() -> None:
        figures["section_s"] = section_s
        figures["key"] = key_figures(figures)
        write_json(target, figures, indent=1)

    models = None
    for name in args.sections:
        mark = time.perf_counter()
        if name == "allreduce":
            plan_configs = {"bundled": s03_checkpoint.load_config(s03.BUNDLED_MODEL_DIR),
                            "mid": mid_config()}
            figures["allreduce"] = section_allreduce(args, plan_configs)
        elif name == "tp":
            models = models or subjects(args)
            figures["tp"] = section_tp(args, models)
        else:
            section_gpu(args, figures, write, started)
        section_s[name] = time.perf_counter() - mark
        write()
    after, load_end = uptime(), list(os.getloadavg())
    elapsed = time.perf_counter() - started
    summary(figures)
    print(f"\nafter: {after}\ntotal {elapsed:.0f} s")
    if args.quick:
        print(QUICK_DISCLAIMER)
    figures["load_average"]["end"] = load_end
    figures.update(uptime_before=before, uptime_after=after, elapsed_s=elapsed)
    write()
    print(f"wrote {target}")
    return figures


def summary(figures: dict) -> None:
    """The headline figures again, at the end of the output."""
    print("\nsummary")
    for k, v in key_figures(figures).items():
        print(f"  {k}: {v:.3g}" if isinstance(v, float) else f"  {k}: {v}")
    for r in figures.get("tp", {}).get("crossover", []):
        if r["as_expected"] is False:
            print(f"  NOT as expected: {r['model']} B {r['batch']}: TP=2 (shm) "
                  f"{'slower' if r['expected_faster'] else 'faster'} than TP=1")
    for k, part in figures.get("tp", {}).get("models", {}).items():
        for p in part["points"]:
            if not p["tokens_equal"]:
                print(f"  tokens differ: {k} B {p['batch']}: {p['same_tokens']} of "
                      f"{p['requests_compared']} requests equal tp1's")


if __name__ == "__main__":
    main()
