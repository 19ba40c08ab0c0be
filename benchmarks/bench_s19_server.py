"""S19's measurement: what does the HTTP server cost on top of the engine it serves?

    python benchmarks/bench_s19_server.py --quick      # about 10 s on 2 cores
    python benchmarks/bench_s19_server.py              # the chapter's figure's data (scratch)
    python benchmarks/bench_s19_server.py --out chapters/figures/s19_server.json   # commit it

A benchmark, not a test: it prints, never asserts speed. What runs (float32, the CPU unless
--device cuda, torch threads pinned by --threads, default 1, in both processes):
  The same requests two ways, at each --concurrency C (default 1, 8, 32, 64):
  - server: code/s19_server.py started as its own process (as a user starts it) on a free
    loopback port, with --max-num-seqs S; a load generator in this process keeps C streaming
    /v1/completions requests in flight (closed loop: a client sends its next request when its
    last one ends) over httpx, and stamps each SSE chunk as it arrives;
  - in-process: the same engine, built the same way (s19_server.make_engine, the same S),
    driven directly in this process with C requests in flight (add_request / step / a new
    request when one finishes), each output stamped when step() returns it.
  The requests: --requests prompts cut from the corpus (S07's "chat" workload, 8 to 32
  tokens), greedy, --max-tokens tokens each (ignore_eos, so every request does the same work
  both ways). Bounded: at most MAX_REQUESTS requests and MAX_REPEATS repeats, and
  --time-limit seconds per run (a run past it stops, keeps what finished and says so); a run
  of PROGRESS_FROM requests or more prints its progress as it goes. The two ways alternate (server first at C = 1,
  in-process first at the next C, and so on), one run each: a change of load on the shared
  machine falls on both; --repeats times (default 3), the order turning each time, and the
  median of each figure over the repeats reported.
  Reported per run: TTFT (from sending / add_request to the first token's arrival), ITL (every
  gap between two tokens of one request), end-to-end latency, each as p50 / p90 / p99 / mean
  (S07's `Distribution`), output tokens/s and requests/s over the run (wall clock from the
  first request sent to the last token received), the share of ITL gaps under BURST_S (tokens
  that reached the client together, in one read: the server's ITL is what a client sees,
  and a server that falls behind sends a step's backlog at once); and per C the ratios
  server / in-process (TTFT p50, ITL p50, output tokens/s), taken within each repeat (its
  two runs ran back to back) and their median over repeats: the server's own overhead.
  What the server pays that the in-process loop does not: HTTP and JSON parsing, request
  validation, the hand-over between the event loop and the engine thread (one Python
  interpreter: they share the GIL), SSE encoding, the socket, and the client's parsing here.

Flags are checked before any model loads (a usage error, exit status 2, naming the rule):
--threads, --seed and --device as every Part II script (`s08_cli.check_common_arguments`),
every count in the range its help gives (--requests 0 is an error, not the default).

The CPU is shared with other jobs: `uptime` is printed before and after and kept in the JSON,
with each run's 1-minute load average. Writes JSON to --json (default a scratch file in the
system's temp directory) or --out (the committed file); scripts/s19_figure.py draws
chapters/figures/s19_server.png from chapters/figures/s19_server.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
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

import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s07_measuring as s07  # noqa: E402
import s08_cli  # noqa: E402
import s19_server as srv  # noqa: E402
from bench_s10_scheduler import uptime  # noqa: E402

DEFAULT_JSON = Path(tempfile.gettempdir()) / "bench_s19_server.json"
SERVER, IN_PROCESS = "server", "in-process"
# A gap this short between two tokens of one stream means they arrived together (one read of
# the socket: the event loop sent them back to back), not that a step took 0.5 ms.
BURST_S = 0.0005
MAX_REQUESTS = s08_cli.MAX_NUM_PROMPTS   # per run (4096): past it, use S20's load tests
MAX_REPEATS = 20
MAX_CONCURRENCY = 1024
PROGRESS_FROM = 256                      # a run this long prints its progress


class Progress:
    """Prints "way C=c: k/total requests" about every tenth of a run of PROGRESS_FROM
    requests or more (a long run shows it is alive); silent for shorter runs."""

    def __init__(self, way: str, concurrency: int, total: int):
        self.label, self.total = f"{way} C={concurrency}", total
        self.every = max(1, total // 10) if total >= PROGRESS_FROM else 0

    def done(self, k: int) -> None:
        if self.every and (k % self.every == 0 or k == self.total):
            print(f"  {self.label}: {k}/{self.total} requests", flush=True)


def dist_ms(values) -> dict | None:
    if not values:
        return None
    d = s07.Distribution.of(values)
    return {"p50_ms": d.p50 * 1e3, "p90_ms": d.p90 * 1e3, "p99_ms": d.p99 * 1e3,
            "mean_ms": d.mean * 1e3, "count": d.count}


def summarize(way: str, concurrency: int, records: list[dict], wall_s: float,
              timed_out: bool) -> dict:
    """records: one per finished request, {"start", "tokens": [arrival times]} (seconds)."""
    ttft = [r["tokens"][0] - r["start"] for r in records if r["tokens"]]
    itl = [b - a for r in records for a, b in zip(r["tokens"], r["tokens"][1:])]
    e2e = [r["tokens"][-1] - r["start"] for r in records if r["tokens"]]
    made = sum(len(r["tokens"]) for r in records)
    return {"way": way, "concurrency": concurrency, "requests": len(records),
            "output_tokens": made, "wall_s": wall_s, "timed_out": timed_out,
            "output_tokens_per_s": made / wall_s if wall_s > 0 else 0.0,
            "requests_per_s": len(records) / wall_s if wall_s > 0 else 0.0,
            "ttft": dist_ms(ttft), "itl": dist_ms(itl), "e2e": dist_ms(e2e),
            "itl_burst_share": sum(g < BURST_S for g in itl) / len(itl) if itl else 0.0,
            "load_average_1min": os.getloadavg()[0]}


def summarize_repeats(runs: list[dict]) -> dict:
    """The median over repeats of each figure of one (way, concurrency), and the values of
    the repeats for the throughput."""
    def median(get):
        return statistics.median(get(r) for r in runs)
    out = {"way": runs[0]["way"], "concurrency": runs[0]["concurrency"], "repeats": len(runs),
           "output_tokens_per_s": median(lambda r: r["output_tokens_per_s"]),
           "output_tokens_per_s_of_repeats": [r["output_tokens_per_s"] for r in runs],
           "requests_per_s": median(lambda r: r["requests_per_s"]),
           "itl_burst_share": median(lambda r: r["itl_burst_share"]),
           "timed_out": any(r["timed_out"] for r in runs)}
    for name in ("ttft", "itl", "e2e"):
        out[name] = {key: median(lambda r: r[name][key])
                     for key in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")}
    return out


RATIO_FIGURES = {"ttft_p50": lambda r: r["ttft"]["p50_ms"],
                 "itl_p50": lambda r: r["itl"]["p50_ms"],
                 "output_tokens_per_s": lambda r: r["output_tokens_per_s"]}


def paired_ratios(runs: list[dict], concurrency: int) -> dict:
    """Server / in-process at one concurrency: the ratio within each repeat (the two runs of a
    repeat ran back to back, so they saw nearly the same load), then the median over repeats;
    each repeat's ratio is kept too."""
    out = {"concurrency": concurrency}
    pairs = {}
    for r in runs:
        if r["concurrency"] == concurrency:
            pairs.setdefault(r["repeat"], {})[r["way"]] = r
    for name, get in RATIO_FIGURES.items():
        each = [get(p[SERVER]) / get(p[IN_PROCESS]) for _, p in sorted(pairs.items())]
        out[name], out[f"{name}_of_repeats"] = statistics.median(each), each
    return out


# --- in process ------------------------------------------------------------------------------

def run_in_process(engine, prompts: list[str], params, concurrency: int,
                   time_limit: float) -> dict:
    """C requests in flight on the engine itself, a new one added as each finishes."""
    pending = list(prompts)
    live: dict[str, dict] = {}
    done: list[dict] = []
    progress = Progress(IN_PROCESS, concurrency, len(prompts))
    start = time.perf_counter()
    timed_out = False
    while pending or live:
        while pending and len(live) < concurrency:
            t = time.perf_counter()
            live[engine.add_request(pending.pop(0), params)] = {"start": t, "tokens": []}
        if time.perf_counter() - start > time_limit:
            timed_out = True
            for rid in list(live):
                engine.abort(rid)
            while engine.has_unfinished_requests():
                engine.step()
            break
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            record = live.get(out.request_id)
            if record is None:
                continue
            record["tokens"].extend([now] * len(out.new_token_ids))
            if out.finished:
                done.append(live.pop(out.request_id))
                progress.done(len(done))
    end = max((r["tokens"][-1] for r in done if r["tokens"]), default=time.perf_counter())
    return summarize(IN_PROCESS, concurrency, done, end - start, timed_out)


# --- over HTTP -------------------------------------------------------------------------------

async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    record = {"start": time.perf_counter(), "tokens": []}
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: "
                               f"{(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']['message']}")
            record["tokens"].append(now)      # one chunk per generated token
    return record


async def run_server_async(base: str, model_name: str, prompts: list[str], max_tokens: int,
                           concurrency: int, time_limit: float) -> dict:
    queue = list(prompts)
    done: list[dict] = []
    progress = Progress(SERVER, concurrency, len(prompts))
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)

    async def client(http):
        while queue:
            prompt = queue.pop(0)
            done.append(await one_request(http, url, {
                "model": model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}))
            progress.done(len(done))

    start = time.perf_counter()
    timed_out = False
    async with httpx.AsyncClient(limits=limits, timeout=time_limit + 30) as http:
        workers = [asyncio.ensure_future(client(http)) for _ in range(concurrency)]
        finished, unfinished = await asyncio.wait(workers, timeout=time_limit)
        if unfinished:
            timed_out = True
            for w in unfinished:
                w.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
        for w in finished:
            w.result()                         # a failed request fails the benchmark, loudly
    end = max((r["tokens"][-1] for r in done if r["tokens"]), default=time.perf_counter())
    return summarize(SERVER, concurrency, done, end - start, timed_out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, str(ROOT / "code" / "s19_server.py"), "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads),
               "--model", args.model, "--served-model-name", "bench"]
    if args.device:
        command += ["--device", args.device]
    return launch_server(command, port)


def launch_server(command: list[str], port: int) -> tuple[subprocess.Popen, str]:
    """Start `command` (a server listening on 127.0.0.1:`port`) and wait, up to 120 s, until
    GET /health answers 200; returns the process and the base URL."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not answer /health within 120 s")


def main(argv=None) -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(
        description="Chapter 19's benchmark: TTFT, ITL and throughput through the HTTP server "
                    "against the same engine in process.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests, shorter answers, concurrency 1 and 8 only")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests per run, 1 to {MAX_REQUESTS} (default: 128, "
                             "--quick 24)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per request (default: 32, --quick 16)")
    parser.add_argument("--concurrency", default=None,
                        help=f"comma-separated requests in flight, each 1 to "
                             f"{MAX_CONCURRENCY} (default: 1,8,32,64, --quick 1,8)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="the engine's seats, both ways (default: %(default)s)")
    parser.add_argument("--time-limit", type=float, default=120.0,
                        help="seconds per run before it stops (default: %(default)s)")
    parser.add_argument("--model", default=str(s03.BUNDLED_MODEL_DIR),
                        help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in each process (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs of each way at each concurrency, medians reported, 1 "
                             f"to {MAX_REPEATS} (default: 3, --quick 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="which corpus prompts are drawn (default: %(default)s)")
    parser.add_argument("--json", default=str(DEFAULT_JSON),
                        help="where to write the figures (default: %(default)s)")
    parser.add_argument("--out", default=None,
                        help="write here instead of --json, e.g. the committed "
                             "chapters/figures/s19_server.json (default: none)")
    args = parser.parse_args(argv)
    s08_cli.check_common_arguments(parser, args)          # --threads, --seed, --device
    # A flag given as 0 is an error, not "use the default" (None is "not given").
    requests = args.requests if args.requests is not None else (24 if args.quick else 128)
    max_tokens = args.max_tokens if args.max_tokens is not None else (16 if args.quick else 32)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    try:
        levels = [int(c) for c in (args.concurrency if args.concurrency is not None else
                                   ("1,8" if args.quick else "1,8,32,64")).split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers (got {args.concurrency!r})")
    for flag, value, high in (("--requests", requests, MAX_REQUESTS),
                              ("--max-tokens", max_tokens, None),
                              ("--repeats", repeats, MAX_REPEATS),
                              ("--max-num-seqs", args.max_num_seqs, None),
                              *(("--concurrency", c, MAX_CONCURRENCY) for c in levels)):
        s07.check_count(parser, flag, value, 1, high)
    if not args.time_limit > 0 or args.time_limit == float("inf"):
        parser.error(f"--time-limit must be a number of seconds > 0 (got {args.time_limit})")
    out = Path(args.out or args.json)
    before = uptime()
    torch.set_num_threads(args.threads)
    model, tokenizer = s06.load(args.model, args.device)
    prompts = s08_cli.corpus_prompts(tokenizer, requests, args.seed,
                                     model.config.max_position_embeddings)
    context = min(model.config.max_position_embeddings, srv.DEFAULT_MAX_CONTEXT)
    longest = max(len(tokenizer.encode(p)) for p in prompts)
    if longest + max_tokens > context:      # the server would refuse them (a 400 each)
        parser.error(f"--max-tokens {max_tokens} does not fit: the longest prompt is "
                     f"{longest} tokens and the context {context}; use at most "
                     f"{context - longest}")
    params = s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    print(f"before: {before}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"{model.device}; {requests} requests x {max_tokens} tokens, max_num_seqs "
          f"{args.max_num_seqs}, concurrency {levels}", flush=True)
    process, base = start_server(args)
    runs = []
    try:
        # One-off costs (first calls, allocations) outside the runs, both ways.
        asyncio.run(run_server_async(base, "bench", prompts[:2], 2, 2, args.time_limit))
        warm = srv.make_engine(model, tokenizer, args.max_num_seqs)
        run_in_process(warm, prompts[:2], s04.SamplingParams(temperature=0.0, max_tokens=2,
                                                             ignore_eos=True), 2,
                       args.time_limit)
        for repeat in range(repeats):
            for k, c in enumerate(levels):
                order = [SERVER, IN_PROCESS] if (k + repeat) % 2 == 0 else [IN_PROCESS, SERVER]
                for way in order:
                    if way == SERVER:
                        run = asyncio.run(run_server_async(base, "bench", prompts, max_tokens,
                                                           c, args.time_limit))
                    else:
                        engine = srv.make_engine(model, tokenizer, args.max_num_seqs)
                        run = run_in_process(engine, prompts, params, c, args.time_limit)
                    run["repeat"] = repeat
                    runs.append(run)
                    print(f"#{repeat} C={c:>3} {way:>10}: TTFT p50 {run['ttft']['p50_ms']:7.1f} "
                          f"ms  p99 {run['ttft']['p99_ms']:7.1f}  ITL p50 "
                          f"{run['itl']['p50_ms']:6.2f} ms  p99 {run['itl']['p99_ms']:6.2f}  "
                          f"{run['output_tokens_per_s']:7.0f} tok/s  {run['requests']} req"
                          f"{'  TIMED OUT' if run['timed_out'] else ''}", flush=True)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
    summary = [summarize_repeats([r for r in runs if (r["way"], r["concurrency"]) == (w, c)])
               for c in levels for w in (SERVER, IN_PROCESS)]
    ratios = [paired_ratios(runs, c) for c in levels]
    for r in ratios:
        print(f"C={r['concurrency']:>3} server / in-process, median of {repeats} pairs: TTFT "
              f"p50 x{r['ttft_p50']:.2f}, ITL p50 x{r['itl_p50']:.2f}, throughput "
              f"x{r['output_tokens_per_s']:.2f}")
    after = uptime()
    print(f"after: {after}")
    cfg = model.config
    bundled = Path(args.model).resolve() == Path(s03.BUNDLED_MODEL_DIR).resolve()
    figures = {"config": {"model": "the bundled model" if bundled else args.model,
                          "model_type": cfg.model_type, "burst_s": BURST_S,
                          "parameters": s03.parameter_count(cfg), "requests": requests,
                          "max_tokens": max_tokens, "max_num_seqs": args.max_num_seqs,
                          "concurrency": levels, "time_limit_s": args.time_limit,
                          "engine": srv.builder_name(),
                          "device": str(model.device), "threads": args.threads,
                          "seed": args.seed, "repeats": repeats, "quick": args.quick,
                          "torch": torch.__version__, "cpu_count": cores,
                          "prompt_tokens": [len(tokenizer.encode(p)) for p in prompts]},
               "summary": summary, "ratios": ratios, "runs": runs,
               "uptime_before": before, "uptime_after": after}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
