"""S19's second measurement: where does the server's time go?

    python benchmarks/bench_s19_split.py --quick     # about 20 s on 2 cores
    python benchmarks/bench_s19_split.py --json chapters/figures/s19_split.json
                                                     # the chapter's record (under a minute)

`bench_s19_server.py` measures that the server costs something (TTFT, ITL and throughput
against the same engine in process); this script splits that cost into parts. A benchmark,
not a test: it prints, never asserts speed.

What runs (float32, the CPU unless --device cuda, torch threads pinned by --threads, default
1, in both processes): --requests corpus prompts (S07's "chat" workload), greedy,
--max-tokens tokens each (ignore_eos), kept C at a time in flight, for each --concurrency C:
  - in process: the engine built by `s19_server.make_engine`, driven by
    `bench_s19_server.run_in_process`;
  - server: this script started again as its own process (`--serve PORT`), which builds the
    same engine and `s19_server.build_app` and runs it on uvicorn, read over loopback HTTP
    by `bench_s19_server.run_server_async` (httpx, SSE chunks parsed as they arrive).

The instruments sit outside the step, on public seams only:
  - `StepTimer`, an engine observer (`engine.observers`, as S09's tracer): from `on_plan`,
    `on_step` and the `StepResult` it splits each step into the model call (`model_s`),
    scheduling (before `on_plan`) and the rest (sampling, then S01/S02's `postprocess`:
    detokenize and stop rules); the time between two steps (the engine thread's commands,
    `to_delta`, the hand-over to the event loop, waits for the GIL); and the engine
    thread's CPU time (`time.thread_time()`, read inside on_step).
  - In the server process, one extra route, `GET /bench/counters`, added to the app
    `build_app` returned: an async handler, so it runs on the event loop's thread and reads
    that thread's CPU time (`time.thread_time()`). The parent reads it before and after a
    run; the differences are the run's.
  - Replays, off the step and off the server, on the same token streams, each timed with
    perf_counter: `engine.processor.postprocess` on every generated token (detokenize and
    stop rules; once without stop strings, as the runs, once with 4 that never match),
    `StreamWriter.feed` on every delta (the chunk's JSON and SSE framing), and
    `parse_request` on every request body (JSON checks, tokenizing the prompt).
  - The client (this process) is charged with its own CPU time over the run
    (`time.process_time()`).
Event-loop CPU minus the parse and SSE replays is what the rest of the event loop's work
cost: uvicorn's HTTP parsing and writing, Starlette and FastAPI, asyncio's own loop.

Machine load is printed before and after (`/proc/loadavg`, through `uptime`) and kept in
the JSON written to --json (default a scratch file in the temp directory).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402
import torch  # noqa: E402

import bench_s19_server as bench  # noqa: E402
import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s08_cli  # noqa: E402
import s19_protocol as proto  # noqa: E402
import s19_server as srv  # noqa: E402
from bench_s10_scheduler import uptime  # noqa: E402

DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s19_split.json"
MODEL_NAME = "bench"
NEVER_MATCHED_STOPS = ("\x00a", "\x00b", "\x00c", "\x00d")   # 4 stop strings, OpenAI's most


class StepTimer:
    """An engine observer that adds up where each step's time goes (seconds): `steps`,
    `step_s` (whole steps), `model_s` (the runner's model call), `schedule_s` (before
    on_plan: the scheduler), `after_model_s` (after the model call until on_step: sampling,
    detokenizing, stop rules), `between_s` (from the end of one step to the start of the
    next, when the last step left requests unfinished: the engine thread's other work and
    its waits), `tokens` (generated)
    and `thread_cpu_s` (the engine thread's CPU clock at the last step). keep=True also
    keeps every step's outputs (for the replays)."""

    def __init__(self, keep: bool = False):
        self.keep, self.outputs = keep, []
        self.steps = self.tokens = 0
        self.step_s = self.model_s = self.schedule_s = self.after_model_s = 0.0
        self.between_s = 0.0
        self.thread_cpu_s = 0.0
        self._plan_at = self._last_end = None
        self._busy = False           # requests were left unfinished at the end of the last step

    def on_plan(self, engine, plan) -> None:
        self._plan_at = time.perf_counter()

    def on_step(self, engine, result) -> None:
        now = time.perf_counter()
        start = now - result.step_s
        since_plan = now - self._plan_at
        if self._busy:               # an idle engine's wait is not a cost
            self.between_s += max(0.0, start - self._last_end)
        self._last_end, self._busy = now, engine.has_unfinished_requests()
        self.steps += 1
        self.step_s += result.step_s
        self.model_s += result.model_s
        self.schedule_s += max(0.0, result.step_s - since_plan)
        self.after_model_s += max(0.0, since_plan - result.model_s)
        self.tokens += sum(len(o.new_token_ids) for o in result.outputs)
        self.thread_cpu_s = time.thread_time()
        if self.keep:
            self.outputs.extend(result.outputs)

    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in ("steps", "tokens", "step_s", "model_s",
                                               "schedule_s", "after_model_s", "between_s",
                                               "thread_cpu_s")}


def diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


# --- the server process ----------------------------------------------------------------------

def serve(args) -> None:
    """The instrumented server: the same engine and app as `s19_server.main`, plus
    StepTimer and GET /bench/counters."""
    import uvicorn
    torch.set_num_threads(args.threads)
    model, tokenizer = s06.load(args.model, args.device)
    engine = srv.make_engine(model, tokenizer, args.max_num_seqs)
    timer = StepTimer()
    engine.observers.append(timer)
    app = srv.build_app(engine, tokenizer, MODEL_NAME)

    async def counters():            # async: it runs on the event loop's own thread
        return dict(timer.snapshot(), event_loop_cpu_s=time.thread_time(),
                    process_cpu_s=time.process_time())

    app.add_api_route("/bench/counters", counters, methods=["GET"])
    uvicorn.run(app, host="127.0.0.1", port=args.serve, log_level="warning")


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = bench.free_port()
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port),
               "--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads),
               "--model", args.model] + (["--device", args.device] if args.device else [])
    return bench.launch_server(command, port)


# --- the replays -----------------------------------------------------------------------------

def replay(engine, tokenizer, prompts, outputs, max_tokens) -> dict:
    """Seconds spent, off the step, in postprocess (without and with 4 stop strings),
    StreamWriter.feed and parse_request on the run's own token streams and bodies."""
    streams: dict[str, list] = {}
    for out in outputs:
        streams.setdefault(out.request_id, []).append(out)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    out = {"tokens": 0, "chunks": 0, "requests": len(streams)}
    for name, stop in (("postprocess_s", ()), ("postprocess_4_stops_s", NEVER_MATCHED_STOPS)):
        params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    stop=stop)
        total = 0.0
        for k, (rid, outs) in enumerate(streams.items()):
            seq = engine.processor.make_sequence(f"replay{k}", prompt_ids[k % len(prompts)],
                                                 params)
            tokens = [t for o in outs for t in o.new_token_ids]
            start = time.perf_counter()
            for t in tokens:
                engine.processor.postprocess(seq, t)
            total += time.perf_counter() - start
            out["tokens"] += len(tokens) if not stop else 0
        out[name] = total
    feed = parse = 0.0
    for k, (rid, outs) in enumerate(streams.items()):
        body = {"model": MODEL_NAME, "prompt": prompts[k % len(prompts)],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        raw = json.dumps(body).encode()
        start = time.perf_counter()
        parsed = proto.parse_request(proto.COMPLETION, proto.parse_json_body(raw), MODEL_NAME,
                                     tokenizer, engine.max_context)
        parse += time.perf_counter() - start
        writer = proto.StreamWriter(proto.ResponseMeta("cmpl-0", 0, MODEL_NAME, parsed,
                                                       tokenizer))
        deltas = [srv.to_delta(o, 0) for o in outs]
        start = time.perf_counter()
        writer.start()
        for d in deltas:
            writer.feed(d)
        writer.finish()
        feed += time.perf_counter() - start
        out["chunks"] += len(deltas)
    out["sse_encode_s"], out["parse_request_s"] = feed, parse
    return out


# --- main ------------------------------------------------------------------------------------

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Chapter 19's split: where the server's time goes (engine step, "
                    "detokenize and stop rules, JSON/SSE, HTTP), against the engine in process.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests, concurrency 8 only, one repeat")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests per run, 1 to {bench.MAX_REQUESTS} (default: 128, "
                             "--quick 32)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens per request (default: %(default)s)")
    parser.add_argument("--concurrency", default=None,
                        help=f"comma-separated requests in flight, each 1 to "
                             f"{bench.MAX_CONCURRENCY} (default: 8,64, --quick 8)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs of each way per concurrency, medians reported, 1 to "
                             f"{bench.MAX_REPEATS} (default: 3, --quick 1)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="the engine's seats, both ways (default: %(default)s)")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in each process (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="which corpus prompts are drawn (default: %(default)s)")
    parser.add_argument("--json", default=str(DEFAULT_JSON),
                        help="where to write the figures (default: %(default)s)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)
    if args.serve is not None:
        return serve(args)
    requests = args.requests if args.requests is not None else (32 if args.quick else 128)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    try:
        levels = [int(c) for c in (args.concurrency if args.concurrency is not None else
                                   ("8" if args.quick else "8,64")).split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers (got {args.concurrency!r})")
    for flag, value, high in (("--requests", requests, bench.MAX_REQUESTS),
                              ("--max-tokens", args.max_tokens, None),
                              ("--repeats", repeats, bench.MAX_REPEATS),
                              ("--max-num-seqs", args.max_num_seqs, None),
                              *(("--concurrency", c, bench.MAX_CONCURRENCY) for c in levels)):
        s07.check_count(parser, flag, value, 1, high)
    before = uptime()
    torch.set_num_threads(args.threads)
    model, tokenizer = s06.load(args.model, args.device)
    prompts = s08_cli.corpus_prompts(tokenizer, requests, args.seed,
                                     model.config.max_position_embeddings)
    params = s04.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"{model.device}; {requests} requests x {args.max_tokens} tokens, max_num_seqs "
          f"{args.max_num_seqs}, concurrency {levels}, {repeats} repeat(s)", flush=True)
    process, base = start_server(args)
    rows = []
    try:
        asyncio.run(bench.run_server_async(base, MODEL_NAME, prompts[:2], 2, 2, 60))
        for repeat in range(repeats):
            for c in levels:
                engine = srv.make_engine(model, tokenizer, args.max_num_seqs)
                timer = StepTimer(keep=True)
                engine.observers.append(timer)
                cpu0 = time.thread_time()
                local = bench.run_in_process(engine, prompts, params, c, 600)
                timer.thread_cpu_s -= cpu0      # this thread's CPU over the run
                first = httpx.get(base + "/bench/counters").json()
                cpu0 = time.process_time()
                remote = asyncio.run(bench.run_server_async(base, MODEL_NAME, prompts,
                                                            args.max_tokens, c, 600))
                client_cpu = time.process_time() - cpu0
                served = diff(httpx.get(base + "/bench/counters").json(), first)
                replays = replay(engine, tokenizer, prompts, timer.outputs, args.max_tokens)
                rows.append({"repeat": repeat, "concurrency": c,
                             "in_process": dict(timer.snapshot(), wall_s=local["wall_s"],
                                                tokens_per_s=local["output_tokens_per_s"]),
                             "server": dict(served, wall_s=remote["wall_s"],
                                            client_cpu_s=client_cpu,
                                            tokens_per_s=remote["output_tokens_per_s"]),
                             "replay": replays, "load_average_1min": os.getloadavg()[0]})
                report(rows[-1])
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
    after = uptime()
    print(f"after: {after}")
    summary = [median_row([r for r in rows if r["concurrency"] == c]) for c in levels]
    if repeats > 1:
        print(f"median of {repeats} repeats:")
        for row in summary:
            report(row)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {"requests": requests, "max_tokens": args.max_tokens,
                                          "max_num_seqs": args.max_num_seqs,
                                          "threads": args.threads, "device": str(model.device),
                                          "engine": srv.builder_name(),
                                          "torch": torch.__version__, "repeats": repeats},
                               "rows": rows, "summary": summary,
                               "uptime_before": before, "uptime_after": after}, indent=1))
    print(f"wrote {out}")


def median_row(rows: list[dict]) -> dict:
    """The median over repeats of every number of one concurrency."""
    def med(part):
        return {k: statistics.median(r[part][k] for r in rows) for k in rows[0][part]}
    return {"repeat": "median", "concurrency": rows[0]["concurrency"],
            "in_process": med("in_process"), "server": med("server"),
            "replay": med("replay"),
            "load_average_1min": statistics.median(r["load_average_1min"] for r in rows)}


def report(row: dict) -> None:
    """Milliseconds per generated token, each way, and the server's split."""
    local, served, rep = row["in_process"], row["server"], row["replay"]
    per = 1e3 / max(1, local["tokens"])
    sper = 1e3 / max(1, served["tokens"])
    rper = 1e3 / max(1, rep["tokens"])
    loop_rest = (served["event_loop_cpu_s"] - rep["sse_encode_s"] - rep["parse_request_s"])
    print(f"#{row['repeat']} C={row['concurrency']}, load {row['load_average_1min']:.2f}; "
          f"ms per generated token:\n"
          f"  wall                 in process {local['wall_s'] * per:6.3f}   server "
          f"{served['wall_s'] * sper:6.3f}   ({local['tokens_per_s']:.0f} vs "
          f"{served['tokens_per_s']:.0f} tok/s)\n"
          f"  steps                in process {local['steps']:6d}   server {served['steps']:6d}\n"
          f"  engine step          in process {local['step_s'] * per:6.3f}   server "
          f"{served['step_s'] * sper:6.3f}\n"
          f"    model call         in process {local['model_s'] * per:6.3f}   server "
          f"{served['model_s'] * sper:6.3f}\n"
          f"    scheduling         in process {local['schedule_s'] * per:6.3f}   server "
          f"{served['schedule_s'] * sper:6.3f}\n"
          f"    sample+detok+stop  in process {local['after_model_s'] * per:6.3f}   server "
          f"{served['after_model_s'] * sper:6.3f}\n"
          f"  between steps        in process {local['between_s'] * per:6.3f}   server "
          f"{served['between_s'] * sper:6.3f}\n"
          f"  engine thread CPU    in process {local['thread_cpu_s'] * per:6.3f}   server "
          f"{served['thread_cpu_s'] * sper:6.3f}\n"
          f"  event loop CPU                             server "
          f"{served['event_loop_cpu_s'] * sper:6.3f}\n"
          f"    parse_request (replay)                          "
          f"{rep['parse_request_s'] * rper:6.3f}\n"
          f"    SSE/JSON encode (replay)                        "
          f"{rep['sse_encode_s'] * rper:6.3f}\n"
          f"    the rest: HTTP, ASGI, asyncio                   {loop_rest * sper:6.3f}\n"
          f"  detokenize + stop rules (replay)                  "
          f"{rep['postprocess_s'] * rper:6.3f}   with 4 stop strings "
          f"{rep['postprocess_4_stops_s'] * rper:6.3f}\n"
          f"  client CPU (httpx, SSE parsing)                   "
          f"{served['client_cpu_s'] * sper:6.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
