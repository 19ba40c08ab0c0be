"""Draw chapters/figures/s09-continuous-batch.svg from real S08 and S09 runs (the chapter's figure).

    python scripts/s09_figure.py            # writes chapters/figures/s09-continuous-batch.svg
    python scripts/s09_figure.py --check    # exits 1 when the committed file is not what it draws

Top: twelve corpus requests (greedy, EOS ignored, one of 40 tokens and eleven of 4 to 12) in 4
slots, slots by steps: as S08's `Engine` serves them (static batches of 4 in order, from each
batch's `BatchStats`) and as S09's engine does (`build_engine`, its steps recorded by S09's
`StepTracer`: who ran in which slot at every step). Bottom: the ragged batch of the chapter's
example, built by S09's `RaggedBatch.build` (code/s09_ragged.py): a new request's 5-token
prompt beside two decoding requests with 9 and 2 cached positions, with its positions, query
start locations and sampled rows. Every bar and cell comes from the S08 and S09 code; nothing
here is drawn by hand.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import s03_transformer as s03  # noqa: E402
import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s08_cli  # noqa: E402
import s08_static_batching as s08  # noqa: E402
import s09_continuous_batching as s09  # noqa: E402
from s09_ragged import RaggedBatch  # noqa: E402
from s09_trace import trace  # noqa: E402

OUT = ROOT / "chapters" / "figures" / "s09-continuous-batch.svg"
SLOTS = 4
LENGTHS = [40, 6, 9, 4, 12, 5, 8, 7, 10, 4, 6, 11]     # tokens each request makes
TOY = ([[11, 12, 13, 14, 15], [27], [34]], [0, 9, 2])  # new tokens, cached positions
COLOURS = ["#90cdf4", "#fbd38d", "#9ae6b4", "#d6bcfa", "#feb2b2", "#81e6d9",
           "#f6ad55", "#a3bffa", "#fbb6ce", "#c6f6d5", "#faf089", "#bee3f8"]


def schedules():
    """(static bars, static steps, continuous bars, continuous steps); a bar is
    (request, slot, first step, steps it made tokens, steps it held the slot)."""
    model, tokenizer = s06.load(str(s03.BUNDLED_MODEL_DIR), "cpu", "float32")
    prompts = s08_cli.corpus_prompts(tokenizer, len(LENGTHS), 5, 256)
    params = [s04.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in LENGTHS]
    static = s08.Engine(model, tokenizer, 256, max_batch_size=SLOTS)
    bars, offset = [], 0
    for lo in range(0, len(prompts), SLOTS):
        done = static.generate(prompts[lo:lo + SLOTS], params[lo:lo + SLOTS])
        steps = len(static.last_batch.steps)
        bars += [(lo + s, s, offset, len(c.token_ids), steps) for s, c in enumerate(done)]
        offset += steps
    engine = s09.build_engine(model, tokenizer, max_context=256, max_num_seqs=SLOTS)
    tracer = trace(engine)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    spans: dict[str, list[int]] = {}
    for rec in tracer.records:
        for rid, slot in zip(rec.running, rec.slots):
            spans.setdefault(rid, [rec.step, slot, 0])[2] += 1
    cont = [(int(r), slot, first, n, n) for r, (first, slot, n) in spans.items()]
    return bars, offset, cont, len(tracer.records)


def gantt(out, title, bars, steps, y0, unit, x0):
    out.append(f'  <text x="30" y="{y0 - 10}" class="head">{title}: {steps} steps</text>')
    row = 24
    for s in range(SLOTS):
        out.append(f'  <text x="{x0 - 8}" y="{y0 + s * row + 16}" class="small" '
                   f'text-anchor="end">slot {s}</text>')
    for rid, slot, first, made, held in bars:
        x, y = x0 + first * unit, y0 + slot * row
        out.append(f'  <rect x="{x}" y="{y}" width="{made * unit - 1}" height="{row - 4}" '
                   f'fill="{COLOURS[rid % len(COLOURS)]}" class="bar"/>')
        out.append(f'  <text x="{x + 4}" y="{y + 15}" class="num">{rid}</text>')
        if held > made:
            out.append(f'  <rect x="{x + made * unit}" y="{y}" width="{(held - made) * unit - 1}" '
                       f'height="{row - 4}" class="idle"/>')
    return y0 + SLOTS * row


def draw(static_bars, static_steps, cont_bars, cont_steps) -> str:
    new_tokens, cached = TOY
    batch = RaggedBatch.build(new_tokens, cached, [(0,), (1,), (2,)])
    width, unit, x0 = 1000, 14, 80
    height = 460
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-labelledby="s09-title s09-desc" '
           "font-family=\"system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif\">",
           '  <title id="s09-title">Static against continuous batching on the same requests, '
           'and one ragged batch</title>',
           f'  <desc id="s09-desc">Top: {len(LENGTHS)} requests in {SLOTS} slots, slots by '
           f'steps. Static batches of {SLOTS} take {static_steps} steps: each batch runs until '
           f'its longest request is done and the finished rows are still computed (grey). '
           f'Continuous batching takes {cont_steps} steps: a request takes a slot the step '
           f'after the previous one left it. Bottom: a ragged batch of 7 tokens, a 5-token '
           f'prompt and two decode tokens, with positions 0 to 4, 9 and 2, query start '
           f'locations 0, 5, 6, 7 and the sampled rows 4, 5, 6.</desc>',
           "  <defs><style>",
           "    .head { font-size: 15px; font-weight: 600; fill: #1a202c; }",
           "    .small { font-size: 12px; fill: #4a5568; }",
           "    .num { font-size: 11px; fill: #1a202c; }",
           "    .mid { font-size: 12px; fill: #1a202c; text-anchor: middle; }",
           "    .bar { stroke: #2d3748; stroke-width: 0.6; }",
           "    .idle { fill: #e2e8f0; stroke: #a0aec0; stroke-width: 0.6; }",
           "    .tok { stroke: #2d3748; stroke-width: 0.8; }",
           "    .sample { fill: none; stroke: #c53030; stroke-width: 2.5; }",
           "  </style></defs>"]
    y = gantt(out, "S08 static batches of 4", static_bars, static_steps, 40, unit, x0)
    out.append(f'  <rect x="{x0}" y="{y + 6}" width="12" height="12" class="idle"/>')
    out.append(f'  <text x="{x0 + 18}" y="{y + 16}" class="small">finished row, still '
               f'computed until its batch ends</text>')
    y = gantt(out, "S09 continuous batching, 4 slots", cont_bars, cont_steps, y + 58, unit, x0)
    out.append(f'  <text x="{x0}" y="{y + 16}" class="small">one bar per request (its number), '
               f'one column per step; the same tokens in both runs</text>')
    # --- bottom: one ragged batch
    by, box = y + 70, 52
    out.append(f'  <text x="30" y="{by - 14}" class="head">RaggedBatch.build: a 5-token prompt '
               f'and two decodes, laid end to end (N = {batch.num_tokens})</text>')
    seq_of = [b for b, n in enumerate(batch.query_lens()) for _ in range(n)]
    sample = set(batch.sample_rows.tolist())
    labels = (("input_ids", batch.input_ids.tolist()), ("positions", batch.positions.tolist()))
    for r, (name, values) in enumerate(labels):
        out.append(f'  <text x="{x0 + 40}" y="{by + r * 30 + 20}" class="small" '
                   f'text-anchor="end">{name}</text>')
        for n, v in enumerate(values):
            x = x0 + 60 + n * box
            out.append(f'  <rect x="{x}" y="{by + r * 30}" width="{box - 4}" height="26" '
                       f'fill="{COLOURS[seq_of[n]]}" class="tok"/>')
            out.append(f'  <text x="{x + (box - 4) / 2}" y="{by + r * 30 + 18}" '
                       f'class="mid">{v}</text>')
            if r == 0 and n in sample:
                out.append(f'  <rect x="{x - 2}" y="{by - 2}" width="{box}" height="60" '
                           f'class="sample"/>')
    for b, start in enumerate(batch.query_start_loc):
        x = x0 + 60 + start * box - 2
        out.append(f'  <line x1="{x}" y1="{by - 6}" x2="{x}" y2="{by + 64}" stroke="#1a202c" '
                   f'stroke-width="1.5"/>')
        out.append(f'  <text x="{x}" y="{by + 80}" class="mid">{start}</text>')
    right = x0 + 60 + batch.num_tokens * box + 20
    out.append(f'  <text x="{right}" y="{by + 14}" class="small">query_start_loc '
               f'{batch.query_start_loc} (the marks below)</text>')
    out.append(f'  <text x="{right}" y="{by + 32}" class="small">context_lens '
               f'{batch.context_lens}</text>')
    out.append(f'  <text x="{right}" y="{by + 50}" class="small">sampled rows (red) '
               f'{batch.sample_rows.tolist()}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    svg = draw(*schedules())
    if args.check:
        same = OUT.exists() and OUT.read_text() == svg
        print("up to date" if same else f"{OUT} differs from what the S08 and S09 code draw")
        return 0 if same else 1
    OUT.write_text(svg)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
