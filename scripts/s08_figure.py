"""Draw chapters/figures/s08-static-batch.svg from real S08 batches (the chapter's figure).

    python scripts/s08_figure.py            # writes chapters/figures/s08-static-batch.svg
    python scripts/s08_figure.py --check    # exits 1 when the committed file is not what it draws

Top: three toy prompts of 3, 5 and 2 tokens as S08's `left_pad` lays them out, with the
position ids `position_ids_from_mask` gives and, for the shortest row, the keys
`attention_allowed` lets each query see. Bottom: the batch `python code/s08_static_batching.py`
runs by default (8 corpus prompts, greedy, --max-tokens 40) on the bundled model, drawn from
its `BatchStats.timeline()`: one row per request over the cache columns the batch computed,
padding, prompt, generated tokens and finished rows still computed. Every cell comes from the
S08 code; nothing here is drawn by hand.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import s04_sampling as s04  # noqa: E402
import s06_torch as s06  # noqa: E402
import s08_cli  # noqa: E402
import s08_static_batching as s08  # noqa: E402

OUT = ROOT / "chapters" / "figures" / "s08-static-batch.svg"
TOY = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]      # ids of three toy prompts
STYLE = {".": ("pad", "padding"), "P": ("prompt", "prompt token"),
         "G": ("gen", "generated token (fed back)"), "-": ("idle", "finished row, still computed")}


def default_batch() -> s08.BatchStats:
    """The default batch of code/s08_static_batching.py's main (same prompts and params)."""
    model, tokenizer = s06.load(str(s08.s03.BUNDLED_MODEL_DIR), "cpu", "float32", "manual")
    max_context = min(model.config.max_position_embeddings, 4096)
    prompts = s08_cli.corpus_prompts(tokenizer, 8, 0, max_context)
    engine = s08.Engine(model, tokenizer, max_context)
    engine.generate(prompts, s04.SamplingParams(temperature=0.0, seed=0, max_tokens=40))
    return engine.last_batch


def draw(stats: s08.BatchStats) -> str:
    ids, mask = s08.left_pad(TOY, 0)
    pos = s08.position_ids_from_mask(mask)
    allowed = s08.attention_allowed(mask, 0, mask.shape[1])          # (B, T, S)
    lines = stats.timeline()
    rows, cols = len(lines), len(lines[0])
    cell = 12
    width = 1000
    top_h = 262
    height = top_h + 40 + rows * cell + 72
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-labelledby="s08-title s08-desc" '
           "font-family=\"system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif\">",
           '  <title id="s08-title">A static batch: left padding, position ids, the mask, and '
           'rows idling to the end</title>',
           f'  <desc id="s08-desc">Top left: three prompts of 3, 5 and 2 tokens left-padded to '
           f'one block of 3 rows by 5 columns; padding cells are grey, and under each real token '
           f'is its position id, counted from 0 at the row\'s first real token. Top right: the '
           f'attention mask of the shortest row, 5 queries by 5 keys: a real query sees only '
           f'real keys at or before it, a padding query sees only itself. Bottom: the default '
           f'batch of the S08 script, {rows} requests over {cols} cache columns: left padding, '
           f'then the prompt, then generated tokens; once a row has finished it keeps its slot '
           f'and is still computed, until the longest row ends. '
           f'{stats.idle_row_steps} of {stats.decode_row_steps} decode row-steps were spent on '
           f'finished rows.</desc>',
           "  <defs><style>",
           "    .head { font-size: 16px; font-weight: 600; fill: #1a202c; }",
           "    .label { font-size: 13px; fill: #1a202c; }",
           "    .small { font-size: 12px; fill: #4a5568; }",
           "    .num { font-size: 12px; fill: #1a202c; text-anchor: middle; }",
           "    .pad { fill: #e2e8f0; stroke: #a0aec0; stroke-width: 0.8; }",
           "    .prompt { fill: #fbd38d; stroke: #b7791f; stroke-width: 0.8; }",
           "    .gen { fill: #90cdf4; stroke: #2b6cb0; stroke-width: 0.8; }",
           "    .idle { fill: #feb2b2; stroke: #c53030; stroke-width: 0.8; }",
           "    .see { fill: #2b6cb0; }",
           "    .hide { fill: #f7fafc; stroke: #cbd5e0; stroke-width: 0.8; }",
           "  </style></defs>"]
    # --- top left: the padded block with position ids
    out.append('  <text x="30" y="30" class="head">left_pad: ids (B, T) and the mask; '
               'position ids count real tokens only</text>')
    box, x0, y0 = 44, 60, 60
    for b in range(ids.shape[0]):
        out.append(f'  <text x="{x0 - 12}" y="{y0 + b * box + 27}" class="label" '
                   f'text-anchor="end">row {b}</text>')
        for t in range(ids.shape[1]):
            real = bool(mask[b, t])
            x, y = x0 + t * box, y0 + b * box
            out.append(f'  <rect x="{x}" y="{y}" width="{box - 4}" height="{box - 4}" '
                       f'class="{"prompt" if real else "pad"}"/>')
            text = f"{int(ids[b, t])}" if real else "pad"
            out.append(f'  <text x="{x + (box - 4) / 2}" y="{y + 16}" class="num">{text}</text>')
            if real:
                out.append(f'  <text x="{x + (box - 4) / 2}" y="{y + 33}" class="num" '
                           f'fill="#c05621">p={int(pos[b, t])}</text>')
    out.append(f'  <text x="{x0}" y="{y0 + 3 * box + 18}" class="small">every row ends in the '
               f'last column: one LM-head row per request,</text>')
    out.append(f'  <text x="{x0}" y="{y0 + 3 * box + 34}" class="small">and each decode step '
               f'appends one column to all rows</text>')
    # --- top right: the mask of the shortest row
    row = min(range(len(TOY)), key=lambda i: len(TOY[i]))
    mx, my, mbox = 600, 74, 26
    out.append(f'  <text x="{mx - 50}" y="{my - 14}" class="label">attention_allowed, row {row}: '
               f'query (down) sees key (across)</text>')
    t_len = mask.shape[1]
    for q in range(t_len):
        out.append(f'  <text x="{mx - 8}" y="{my + q * mbox + 17}" class="small" '
                   f'text-anchor="end">{"pad" if not mask[row, q] else f"p={int(pos[row, q])}"}'
                   f'</text>')
        for k in range(t_len):
            cls = "see" if bool(allowed[row, q, k]) else "hide"
            out.append(f'  <rect x="{mx + k * mbox}" y="{my + q * mbox}" width="{mbox - 3}" '
                       f'height="{mbox - 3}" class="{cls}"/>')
    out.append(f'  <text x="{mx - 50}" y="{my + t_len * mbox + 18}" class="small">a padding '
               f'query sees only itself, so no softmax row is all -inf;</text>')
    out.append(f'  <text x="{mx - 50}" y="{my + t_len * mbox + 34}" class="small">a real query '
               f'sees the real keys at or before it</text>')
    # --- bottom: the timeline of the default batch
    by = top_h + 40
    out.append(f'  <text x="30" y="{by - 14}" class="head">The default batch of '
               f'code/s08_static_batching.py: {rows} rows over {cols} cache columns</text>')
    bx = 80
    for r, line in enumerate(lines):
        out.append(f'  <text x="{bx - 10}" y="{by + r * cell + 10}" class="small" '
                   f'text-anchor="end">{r}</text>')
        for c, ch in enumerate(line):
            out.append(f'  <rect x="{bx + c * cell}" y="{by + r * cell}" width="{cell - 1}" '
                       f'height="{cell - 1}" class="{STYLE[ch][0]}"/>')
    ly = by + rows * cell + 24
    lx = bx
    for ch, (cls, label) in STYLE.items():
        out.append(f'  <rect x="{lx}" y="{ly}" width="{cell}" height="{cell}" class="{cls}"/>')
        out.append(f'  <text x="{lx + cell + 6}" y="{ly + 10}" class="small">{escape(label)}'
                   f'</text>')
        lx += 40 + 8 * len(label)
    out.append(f'  <text x="{bx}" y="{ly + 34}" class="label">{stats.slots:,} token slots '
               f'computed: {stats.useful:,} useful, {stats.padding_slots:,} padding, '
               f'{stats.idle:,} finished rows idling ({stats.idle_row_steps} of '
               f'{stats.decode_row_steps} decode row-steps)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    svg = draw(default_batch())
    if args.check:
        same = OUT.exists() and OUT.read_text() == svg
        print("up to date" if same else f"{OUT} differs from what the S08 code draws")
        return 0 if same else 1
    OUT.write_text(svg)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
