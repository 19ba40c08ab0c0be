/* S17 "Try it": attention one tile at a time, and a decode query's walk over a block table.
 *
 * export.py (beside this file) ran code/s17_flash.py at build time on small inputs (multiples of
 * 1/8, head_dim 4, scale 1/2, one head) and exported what the torch reference did:
 *
 * 1. Tiles. For three cases (a prompt, T = S = 12; a chunk of 6 queries after 10 cached keys; the
 *    prompt with queries x 32) and every (block_m, block_n) setting: the scaled scores (T x S,
 *    unmasked), the values, the tiles `attend_tiles` visited in order, after each the running max
 *    m, sum l and unnormalised output acc of every row of the query tile (m and l from
 *    `tile_trace`), the outputs, and the reference torch.softmax(masked scores) @ v.
 *    The grid draws the T x S score matrix cut into tiles: visited whole ("full"), crossing the
 *    diagonal ("partial": visited, some pairs masked) or wholly above it ("skipped": never
 *    loaded). Stepping visits one tile at a time; for the chosen query row the table shows, after
 *    each of its tiles, m, the rescale exp(m_old - m_new) applied to the old l and acc, l, and the
 *    output so far acc / l, which after the last tile is the row's softmax(scores) @ v.
 * 2. The paged walk. One decode query (position 13, seq_len 14) of a request whose block table is
 *    [7, 2, 9, 4] in a pool of 12 blocks of 4 (block 0 the null block; another request's blocks
 *    and stale free ones beside). The kernel reads table entry j, loads block table[j], uses its
 *    first min(block_size, seq_len - j block_size) offsets, and folds them into m, l, acc.
 *
 * `tileStates`, `replayTiles` and `replayPaged` below are line-by-line transcriptions of
 * export.py's `tile_states`, `replay_tiles` and `replay_paged` (Python floats there, doubles
 * here). On load the page replays every visit of every setting and the walk, from the exported
 * scores, values, query and pool, and checks them against the exported float32 trace within
 * data.tolerance (|a - b| <= tol (1 + |b|)), the visited tiles against the grid's states, and each
 * row's final output against the reference: a banner and a console error name any that differ.
 * Tiles carry data-i0, data-j0, data-state and data-status; trace rows their numbers at full
 * precision in data- attributes (read by tests/test_s17_simulator_browser.py).
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count;
  var SVG = "http://www.w3.org/2000/svg";
  var STYLE = [
    ".fa-sim select, .fa-sim button, .fa-sim input { font: inherit; font-size: 0.9em; }",
    ".fa-sim select, .fa-sim button { padding: 0.15rem 0.45rem; border: 1px solid var(--color-background-border, #ccc);",
    "  border-radius: 4px; background: var(--color-background-primary, #fff); color: var(--color-foreground-primary, #222); }",
    ".fa-sim button { cursor: pointer; }",
    ".fa-sim button:disabled { opacity: 0.45; cursor: default; }",
    ".fa-heading { font-weight: 700; margin: 0.9rem 0 0.3rem 0; }",
    ".fa-fields, .fa-row, .pw-row { display: flex; flex-wrap: wrap; gap: 0.4rem 0.8rem; align-items: center; margin: 0.4rem 0; }",
    ".fa-field { display: inline-flex; gap: 0.3rem; align-items: center; font-size: 0.9em; }",
    ".fa-slider, .pw-slider { flex: 1 1 8rem; min-width: 6rem; }",
    ".fa-step-label, .pw-step-label { font-weight: 600; font-variant-numeric: tabular-nums; }",
    ".fa-banner { color: #b00020; font-weight: 600; }",
    ".fa-note, .fa-check, .fa-final, .fa-legend, .pw-note, .pw-final, .fa-source { font-size: 0.88em; margin: 0.3rem 0; }",
    ".fa-note, .pw-note { min-height: 2.6em; }",
    ".fa-legend { display: flex; flex-wrap: wrap; gap: 0.3rem 0.9rem; }",
    ".fa-legend-item { display: inline-flex; gap: 0.3rem; align-items: center; }",
    ".fa-swatch { display: inline-block; width: 1.1rem; height: 0.8rem; border: 1px solid #888; border-radius: 2px; }",
    ".fa-svg-wrap { width: 100%; overflow-x: auto; }",
    ".fa-svg-wrap svg { display: block; }",
    ".fa-svg-wrap text { fill: var(--color-foreground-primary, #222); font-size: 10px; }",
    ".fa-cell { stroke: rgba(128, 128, 128, 0.35); stroke-width: 0.5; }",
    ".fa-table-wrap { max-width: 100%; overflow-x: auto; }",
    "table.fa-table { border-collapse: collapse; font-size: 0.82em; margin: 0.3rem 0; }",
    ".fa-table th, .fa-table td { border: 1px solid var(--color-background-border, #ccc); padding: 2px 6px; }",
    ".fa-table th { text-align: left; }",
    ".fa-table td.fa-num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }",
    ".fa-table tr.fa-now td { background: rgba(230, 145, 56, 0.18); }",
    ".fa-ok { color: #2e7d32; font-weight: 600; } .fa-bad { color: #c62828; font-weight: 600; }"
  ].join("\n");
  var FILL = {visible: "rgba(128, 128, 128, 0.06)", masked: "rgba(128, 128, 128, 0.42)",
              done: "rgba(58, 120, 194, 0.42)", current: "rgba(230, 145, 56, 0.85)",
              mine: "rgba(58, 120, 194, 0.22)", other: "rgba(46, 158, 106, 0.30)",
              free: "rgba(128, 128, 128, 0.10)", "null": "rgba(128, 128, 128, 0.55)",
              unused: "rgba(255, 255, 255, 0)"};
  var TILE_STROKE = {full: "#3a78c2", partial: "#c95c5c", skipped: "#999"};

  // ---------------------------------------------------------------------------------------------
  // The replay (export.py's tile_states, replay_tiles and replay_paged)
  // ---------------------------------------------------------------------------------------------

  function tileStates(tLen, sLen, blockM, blockN) {
    var offset = sLen - tLen, grid = [];
    for (var i0 = 0; i0 < tLen; i0 += blockM) {
      var i1 = Math.min(i0 + blockM, tLen), row = [];
      for (var j0 = 0; j0 < sLen; j0 += blockN) {
        var j1 = Math.min(j0 + blockN, sLen);
        if (j0 > offset + i1 - 1) row.push("skipped");
        else if (j1 - 1 > offset + i0) row.push("partial");
        else row.push("full");
      }
      grid.push(row);
    }
    return grid;
  }

  function replayTiles(scores, values, blockM, blockN) {
    var tLen = scores.length, sLen = scores[0].length, dim = values[0].length;
    var offset = sLen - tLen, visits = [];
    for (var i0 = 0; i0 < tLen; i0 += blockM) {
      var i1 = Math.min(i0 + blockM, tLen), state = [], r, c;
      for (r = 0; r < i1 - i0; r++) state.push({m: -Infinity, l: 0.0, acc: zeros(dim)});
      var j0 = 0;
      while (j0 < offset + i1) {
        var j1 = Math.min(j0 + blockN, sLen), rows = [];
        for (r = 0; r < i1 - i0; r++) {
          var i = i0 + r, m = state[r].m, l = state[r].l, acc = state[r].acc.slice(), j;
          var last = Math.min(j1, offset + i + 1);      // keys j0 .. last - 1 are visible
          var mNew = m;
          for (j = j0; j < last; j++) mNew = Math.max(mNew, scores[i][j]);
          var base = mNew === -Infinity ? 0.0 : mNew;
          var alpha = Math.exp(m - base);               // 0 before the first key
          l = l * alpha;
          for (c = 0; c < dim; c++) acc[c] = acc[c] * alpha;
          for (j = j0; j < last; j++) {
            var p = Math.exp(scores[i][j] - base);
            l = l + p;
            for (c = 0; c < dim; c++) acc[c] = acc[c] + p * values[j][c];
          }
          state[r] = {m: mNew, l: l, acc: acc};
          rows.push({m: mNew, l: l, alpha: alpha, acc: acc, seen: Math.max(0, last - j0)});
        }
        visits.push({i0: i0, j0: j0, j1: j1, rows: rows});
        j0 += blockN;
      }
    }
    return visits;
  }

  function replayPaged(q, kPool, vPool, blockTable, seqLen, blockSize, scale) {
    var m = -Infinity, l = 0.0, acc = zeros(q.length), walk = [], c, o;
    for (var j = 0; j < Math.ceil(seqLen / blockSize); j++) {
      var block = blockTable[j], n = Math.min(blockSize, seqLen - j * blockSize), scores = [];
      for (o = 0; o < n; o++) {
        var dot = 0.0;
        for (c = 0; c < q.length; c++) dot = dot + q[c] * kPool[block][o][c];
        scores.push(dot * scale);
      }
      var mNew = m;
      for (o = 0; o < n; o++) mNew = Math.max(mNew, scores[o]);
      var base = mNew === -Infinity ? 0.0 : mNew;
      var alpha = Math.exp(m - base);
      l = l * alpha;
      acc = acc.map(function (a) { return a * alpha; });
      for (o = 0; o < n; o++) {
        var p = Math.exp(scores[o] - base);
        l = l + p;
        for (c = 0; c < q.length; c++) acc[c] = acc[c] + p * vPool[block][o][c];
      }
      m = mNew;
      var slots = [];
      for (o = 0; o < n; o++) slots.push(block * blockSize + o);
      walk.push({j: j, block: block, n: n, slots: slots, scores: scores, m: m, l: l,
                 alpha: alpha, acc: acc.slice()});
    }
    return walk;
  }

  function zeros(n) { var z = []; for (var k = 0; k < n; k++) z.push(0.0); return z; }

  // ---------------------------------------------------------------------------------------------
  // The check against the torch trace
  // ---------------------------------------------------------------------------------------------

  function near(a, b, tol) { return isFinite(a) && isFinite(b) && Math.abs(a - b) <= tol * (1 + Math.abs(b)); }

  function nearAll(a, b, tol) {
    if (a.length !== b.length) return false;
    for (var k = 0; k < a.length; k++) if (!near(a[k], b[k], tol)) return false;
    return true;
  }

  function divide(acc, l) { return acc.map(function (a) { return a / l; }); }

  // The final output of every row from a replay: acc / l after the row's last visit.
  function finals(visits, tLen) {
    var out = [];
    visits.forEach(function (v) {
      v.rows.forEach(function (row, r) { out[v.i0 + r] = divide(row.acc, row.l); });
    });
    return out.length === tLen ? out : null;
  }

  function checkAll(data) {
    var problems = [], tol = data.tolerance, visitCount = 0;
    data.cases.forEach(function (cs) {
      cs.settings.forEach(function (st) {
        var name = cs.id + " " + st.block_m + "x" + st.block_n;
        var got = replayTiles(cs.scores, cs.values, st.block_m, st.block_n);
        var grid = tileStates(cs.t_len, cs.s_len, st.block_m, st.block_n), want = [];
        grid.forEach(function (row, a) {
          row.forEach(function (s, b) { if (s !== "skipped") want.push([a * st.block_m, b * st.block_n]); });
        });
        if (got.length !== st.visits.length || want.length !== got.length) {
          problems.push(name + ": " + got.length + " visits, torch " + st.visits.length);
          return;
        }
        got.forEach(function (v, k) {
          var ref = st.visits[k];
          visitCount += 1;
          if (v.i0 !== ref.i0 || v.j0 !== ref.j0 || v.i0 !== want[k][0] || v.j0 !== want[k][1]) {
            problems.push(name + " visit " + k + ": tile (" + v.i0 + ", " + v.j0 + ")");
            return;
          }
          v.rows.forEach(function (row, r) {
            if (!near(row.m, ref.m[r], tol) || !near(row.l, ref.l[r], tol) || !nearAll(row.acc, ref.acc[r], tol)) {
              problems.push(name + " tile (" + v.i0 + ", " + v.j0 + ") row " + (v.i0 + r));
            }
          });
        });
        var out = finals(got, cs.t_len);
        for (var i = 0; out && i < cs.t_len; i++) {
          if (!nearAll(out[i], st.out[i], tol) || !nearAll(out[i], cs.reference[i], tol)) {
            problems.push(name + " row " + i + ": output");
          }
        }
      });
    });
    var pg = data.paged;
    var walk = replayPaged(pg.q, pg.k_pool, pg.v_pool, pg.block_table, pg.seq_len, pg.block_size, data.scale);
    if (walk.length !== pg.walk.length) {
      problems.push("paged walk: " + walk.length + " blocks, torch " + pg.walk.length);
    }
    if (walk.length === pg.walk.length) {
      walk.forEach(function (w, j) {
        var ref = pg.walk[j];
        if (w.block !== ref.block || w.n !== ref.n || !nearAll(w.scores, ref.scores, tol) ||
            !near(w.m, ref.m, tol) || !near(w.l, ref.l, tol) || !nearAll(w.acc, ref.acc, tol)) {
          problems.push("paged walk block " + j);
        }
      });
      var last = walk[walk.length - 1], out = divide(last.acc, last.l);
      if (!nearAll(out, pg.out, tol) || !nearAll(out, pg.reference, tol)) problems.push("paged walk: output");
    }
    return {problems: problems, visits: visitCount, walk: walk};
  }

  // ---------------------------------------------------------------------------------------------
  // Text
  // ---------------------------------------------------------------------------------------------

  function num(x) {
    if (!isFinite(x)) return "\u2013";
    if (Math.abs(x) >= 1e4 || (x !== 0 && Math.abs(x) < 1e-4)) return x.toExponential(2).replace("-", "\u2212");
    return x.toFixed(4).replace(/^-/, "\u2212");
  }

  function vec(xs) { return "[" + xs.map(num).join(", ") + "]"; }

  function keys(a, b) { return a === b - 1 ? "key " + a : "keys " + a + "\u2013" + (b - 1); }

  function maxDiff(a, b) {
    var d = 0;
    for (var k = 0; k < a.length; k++) d = Math.max(d, Math.abs(a[k] - b[k]));
    return d;
  }

  // A select's value as an index in 0 .. n - 1, or fallback when it is none.
  function pick(select, n, fallback) {
    var k = Number(select.value);
    return select.value !== "" && k >= 0 && k < n && Math.floor(k) === k ? k : fallback;
  }

  function svgNode(tag, attrs, parent) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function legend(pairs) {
    var box = el("p", "fa-legend");
    pairs.forEach(function (pair) {
      var item = el("span", "fa-legend-item");
      item.dataset.kind = pair[0];
      var sw = el("span", "fa-swatch");
      sw.style.background = pair[1];
      if (pair[3]) sw.style.borderColor = pair[3];
      item.appendChild(sw);
      item.appendChild(document.createTextNode(pair[2]));
      box.appendChild(item);
    });
    return box;
  }

  // ---------------------------------------------------------------------------------------------
  // The page
  // ---------------------------------------------------------------------------------------------

  function mount(root, data) {
    if (!document.getElementById("fa-style")) {
      var style = el("style", {id: "fa-style"});
      style.textContent = STYLE;
      document.head.appendChild(style);
    }
    var ui = el("div", "fa-sim");
    root.appendChild(ui);
    var banner = el("p", "fa-banner");
    banner.hidden = true;
    ui.appendChild(banner);
    var checked = checkAll(data);
    CourseSim.report(banner, "tiled-attention", "The page's replay differs from the torch trace " +
                     "(code/s17_flash.py) in: ", checked.problems, 6);
    mountTiles(ui, data);
    mountPaged(ui, data, checked.walk);
    var check = el("p", "fa-check");
    var settings = data.cases.reduce(function (a, c) { return a + c.settings.length; }, 0);
    check.textContent = checked.problems.length ? "" : "This page recomputed all " +
      checked.visits + " tile visits of the " + settings + " settings and the " + data.paged.walk.length +
      " blocks of the walk from the exported scores, values, query and pool: every running max, sum " +
      "and output agrees with the torch reference " +
      "(code/s17_flash.py, float32) within " + data.tolerance + " (relative), and every final output " +
      "with torch.softmax(scores) @ v and with the gather + SDPA.";
    ui.appendChild(check);
    ui.appendChild(el("p", "fa-source", "Exported at build time by site/simulators/tiled-attention/export.py: " +
                      data.source + ". Inputs are multiples of 1/8 (seed " + data.seed + "), head_dim " +
                      data.head_dim + ", scale " + data.scale + ", one head."));
  }

  // View 1 ---------------------------------------------------------------------------------------

  function mountTiles(ui, data) {
    ui.appendChild(el("p", "fa-heading", "Causal attention in tiles: the running max, sum and output of one row"));
    var fields = el("div", "fa-fields");
    ui.appendChild(fields);
    function field(label, cls) {
      var box = el("label", "fa-field");
      box.appendChild(el("span", null, label));
      var select = el("select", cls);
      box.appendChild(select);
      fields.appendChild(box);
      return select;
    }
    function options(select, labels, values) {
      select.textContent = "";
      labels.forEach(function (text, k) {
        select.appendChild(el("option", {value: String(values ? values[k] : k)}, text));
      });
    }
    // a tile size select's value is the size; its index in sizes, or 0 when it is none
    function size(select, sizes) { return Math.max(0, sizes.indexOf(Number(select.value))); }
    var casePick = field("case ", "fa-case"), bmPick = field("query tile block_m ", "fa-bm");
    var bnPick = field("key tile block_n ", "fa-bn"), rowPick = field("query row ", "fa-qrow");
    options(casePick, data.cases.map(function (c) { return c.title; }));
    options(bmPick, data.block_ms.map(String), data.block_ms);
    options(bnPick, data.block_ns.map(String), data.block_ns);

    var controls = CourseSim.stepControls("fa-", {
      labels: {reset: "before any tile", next: "next tile \u25b6", back: "\u25c0 tile"},
      text: function (s, last) { return "tile " + s + " of " + last; },
      onStep: function () { render(); }
    });
    ui.appendChild(controls.row);
    var note = el("p", "fa-note");
    ui.appendChild(note);
    ui.appendChild(legend([
      ["visible", FILL.visible, "a score the query sees"], ["masked", FILL.masked, "masked (key after the query)"],
      ["done", FILL.done, "in a tile already folded in"], ["current", FILL.current, "the tile being folded in"],
      ["full", "transparent", "tile: no mask", TILE_STROKE.full],
      ["partial", "transparent", "tile crossing the diagonal", TILE_STROKE.partial],
      ["skipped", "transparent", "tile skipped (never loaded)", TILE_STROKE.skipped]]));
    var svgWrap = el("div", "fa-svg-wrap");
    ui.appendChild(svgWrap);
    var tableWrap = el("div", "fa-table-wrap");
    ui.appendChild(tableWrap);
    var final = el("p", "fa-final");
    ui.appendChild(final);

    var cs = null, st = null, replay = null, grid = null;

    function choose() {
      var c = pick(casePick, data.cases.length, 0);
      casePick.value = String(c);
      var bm = size(bmPick, data.block_ms), bn = size(bnPick, data.block_ns);
      bmPick.value = String(data.block_ms[bm]);
      bnPick.value = String(data.block_ns[bn]);
      var keepRow = rowPick.value === "" ? data.defaults.row : Number(rowPick.value);
      cs = data.cases[c];
      st = cs.settings.filter(function (s) {
        return s.block_m === data.block_ms[bm] && s.block_n === data.block_ns[bn];
      })[0];
      replay = replayTiles(cs.scores, cs.values, st.block_m, st.block_n);
      grid = tileStates(cs.t_len, cs.s_len, st.block_m, st.block_n);
      options(rowPick, cs.scores.map(function (_, i) { return i + " (position " + (cs.offset + i) + ")"; }));
      var valid = keepRow >= 0 && keepRow < cs.t_len && Math.floor(keepRow) === keepRow;
      rowPick.value = String(valid ? keepRow : cs.t_len - 1);
      controls.setLast(replay.length);
      controls.go(Math.min(controls.step, replay.length));
    }

    function render() {
      if (!cs) return;
      var step = controls.step, row = pick(rowPick, cs.t_len, cs.t_len - 1);
      rowPick.value = String(row);
      var current = step > 0 ? replay[step - 1] : null;
      var bm = st.block_m, tileI0 = Math.floor(row / bm) * bm, r = row - tileI0;
      var mine = [];
      replay.forEach(function (v, k) { if (v.i0 === tileI0) mine.push(k); });
      draw(step, row);

      var words;
      if (!current) {
        words = "Before any tile: every row starts with m = \u2212\u221e, l = 0, acc = 0. " +
          count(replay.length, "tile") + " of " + count(grid.length * grid[0].length, "tile") +
          " will be visited; the others lie wholly above the diagonal and are never loaded.";
      } else {
        var i1 = Math.min(current.i0 + bm, cs.t_len);
        var state = grid[current.i0 / bm][current.j0 / st.block_n];
        words = "Tile " + step + ": query rows " + current.i0 + "\u2013" + (i1 - 1) + " against " +
          keys(current.j0, current.j1) +
          (state === "partial" ? " (it crosses the diagonal: the pairs above it are masked)" : " (no pair masked)") +
          ". One " + (i1 - current.i0) + " x " + (current.j1 - current.j0) + " tile of scores is all that exists at a time. ";
        if (current.i0 === tileI0) words += "Row " + row + " sees " + count(current.rows[r].seen, "key") + " of it.";
        else if (current.i0 < tileI0) words += "Row " + row + "'s query tile (rows " + tileI0 + "\u2013" +
          (Math.min(tileI0 + bm, cs.t_len) - 1) + ") comes later.";
        else words += "Row " + row + "'s query tile is done.";
      }
      note.textContent = words;

      var table = el("table", "fa-table"), head = el("tr");
      ["tile of keys", "row sees", "max score in tile", "m (running max)", "rescale e^(m_old \u2212 m_new)",
       "l (running sum)", "output so far acc / l"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      table.appendChild(head);
      var done = mine.filter(function (k) { return k < step; });
      done.forEach(function (k) {
        var v = replay[k], s = v.rows[r], tr = el("tr", "fa-visit" + (k === step - 1 ? " fa-now" : ""));
        var top = -Infinity;
        for (var j = v.j0; j < v.j0 + s.seen; j++) top = Math.max(top, cs.scores[row][j]);
        var out = divide(s.acc, s.l);
        tr.dataset.j0 = String(v.j0);
        tr.dataset.j1 = String(v.j1);
        tr.dataset.seen = String(s.seen);
        tr.dataset.m = String(s.m);
        tr.dataset.l = String(s.l);
        tr.dataset.alpha = String(s.alpha);
        tr.dataset.out = JSON.stringify(out);
        tr.appendChild(el("td", null, keys(v.j0, v.j1)));
        tr.appendChild(el("td", "fa-num", String(s.seen)));
        tr.appendChild(el("td", "fa-num", s.seen ? num(top) : "(all masked)"));
        tr.appendChild(el("td", "fa-num", num(s.m)));
        tr.appendChild(el("td", "fa-num", k === mine[0] ? "0 (nothing yet)" : num(s.alpha)));
        tr.appendChild(el("td", "fa-num", num(s.l)));
        tr.appendChild(el("td", "fa-num", vec(out)));
        table.appendChild(tr);
      });
      if (!done.length) {
        var empty = el("tr");
        var td = el("td", null, "Row " + row + " has folded in no tile yet (its first tile is tile " +
                    (mine[0] + 1) + ").");
        td.colSpan = 7;
        empty.appendChild(td);
        table.appendChild(empty);
      }
      tableWrap.textContent = "";
      tableWrap.appendChild(table);

      var finished = done.length === mine.length;
      var ref = cs.reference[row], scoreMax = -Infinity;
      for (var j = 0; j <= cs.offset + row; j++) scoreMax = Math.max(scoreMax, cs.scores[row][j]);
      var overflow = scoreMax > 88.72 ? " Its largest score is " + num(scoreMax) + ": e^score alone would " +
        "overflow float32 (largest float32 3.4e38 = e^88.72); here every exponent is score \u2212 m \u2264 0." :
        " Its largest score is " + num(scoreMax) + ".";
      final.textContent = "";
      final.dataset.finished = String(finished);
      if (finished) {
        var last = replay[mine[mine.length - 1]].rows[r], out = divide(last.acc, last.l);
        final.dataset.out = JSON.stringify(out);
        final.dataset.reference = JSON.stringify(ref);
        final.dataset.diff = String(maxDiff(out, ref));
        final.appendChild(document.createTextNode("After its last tile, row " + row + " (keys 0\u2013" +
          (cs.offset + row) + "): acc / l = " + vec(out) + "; torch.softmax(scores) @ v = " + vec(ref) +
          " (exported); largest difference " + maxDiff(out, ref).toExponential(1) + " "));
        final.appendChild(el("span", maxDiff(out, ref) <= data.tolerance ? "fa-ok" : "fa-bad",
                             maxDiff(out, ref) <= data.tolerance ? "\u2713 equal" : "\u2717 differs"));
        final.appendChild(document.createTextNode("." + overflow));
      } else {
        delete final.dataset.out;
        final.textContent = "Row " + row + " is done after " + count(mine.length, "tile") +
          " (tile " + (mine[mine.length - 1] + 1) + "); then acc / l is its softmax(scores) @ v, " +
          vec(ref) + "." + overflow;
      }
    }

    function draw(step, row) {
      var cell = 20, left = 64, top = 30;
      var width = left + cs.s_len * cell + 8, height = top + cs.t_len * cell + 8;
      var svg = svgNode("svg", {"class": "fa-grid", width: width, height: height,
                                viewBox: "0 0 " + width + " " + height, role: "img",
                                "aria-label": "The " + cs.t_len + " x " + cs.s_len + " scores cut into tiles"});
      var visitOf = {};
      replay.forEach(function (v, k) { visitOf[v.i0 + "," + v.j0] = k; });
      var text = function (x, y, words, anchor) {
        var t = svgNode("text", {x: x, y: y, "text-anchor": anchor || "start"}, svg);
        t.textContent = words;
      };
      text(left, 10, "keys j \u2192 (query i sees j \u2264 " + cs.offset + " + i)");
      for (var j = 0; j < cs.s_len; j++) text(left + j * cell + cell / 2, top - 5, String(j), "middle");
      for (var i = 0; i < cs.t_len; i++) {
        text(left - 6, top + i * cell + 14, (i === row ? "\u25b6 " : "") + "q" + i, "end");
        for (j = 0; j < cs.s_len; j++) {
          var k = visitOf[Math.floor(i / st.block_m) * st.block_m + "," + Math.floor(j / st.block_n) * st.block_n];
          var masked = j > cs.offset + i, kind = masked ? "masked" : "visible";
          if (!masked && k !== undefined && k < step) kind = k === step - 1 ? "current" : "done";
          svgNode("rect", {"class": "fa-cell", x: left + j * cell, y: top + i * cell, width: cell, height: cell,
                           fill: FILL[kind], "data-i": i, "data-j": j, "data-kind": kind}, svg);
        }
      }
      svgNode("rect", {x: left - 1, y: top + row * cell, width: cs.s_len * cell + 2, height: cell,
                       fill: "none", stroke: "#222", "stroke-width": 1.5, "class": "fa-row-mark"}, svg);
      grid.forEach(function (tiles, a) {
        tiles.forEach(function (state, b) {
          var i0 = a * st.block_m, j0 = b * st.block_n;
          var i1 = Math.min(i0 + st.block_m, cs.t_len), j1 = Math.min(j0 + st.block_n, cs.s_len);
          var k = visitOf[i0 + "," + j0];
          var status = state === "skipped" ? "skipped" : k < step - 1 ? "done" : k === step - 1 ? "current" : "todo";
          var rect = svgNode("rect", {"class": "fa-tile", x: left + j0 * cell + 1.5, y: top + i0 * cell + 1.5,
            width: (j1 - j0) * cell - 3, height: (i1 - i0) * cell - 3, fill: "none",
            stroke: TILE_STROKE[state], "stroke-width": status === "current" ? 3 : 1.5,
            "stroke-dasharray": state === "skipped" ? "3 3" : "none", "data-i0": i0, "data-j0": j0,
            "data-state": state, "data-status": status, "data-order": k === undefined ? 0 : k + 1}, svg);
          var tip = svgNode("title", {}, rect);
          tip.textContent = "rows " + i0 + "\u2013" + (i1 - 1) + ", " + keys(j0, j1) + ": " + state +
            (k === undefined ? "" : ", visited " + (k + 1) + " of " + replay.length);
        });
      });
      svgWrap.textContent = "";
      svgWrap.appendChild(svg);
    }

    [casePick, bmPick, bnPick].forEach(function (s) { s.addEventListener("change", choose); });
    rowPick.addEventListener("change", render);
    var first = data.cases[data.defaults.case].settings[data.defaults.setting];
    casePick.value = String(data.defaults.case);
    bmPick.value = String(first.block_m);
    bnPick.value = String(first.block_n);
    choose();
  }

  // View 2 ---------------------------------------------------------------------------------------

  function mountPaged(ui, data, walk) {
    var pg = data.paged, bs = pg.block_size, nBlocks = walk.length;
    ui.appendChild(el("p", "fa-heading", "The paged walk: one decode query reads its blocks through the table"));
    var owner = {};
    pg.block_table.forEach(function (b, j) { owner[b] = ["mine", j]; });
    pg.other.block_table.forEach(function (b, j) { owner[b] = ["other", j]; });
    owner[pg.null_block] = ["null", 0];
    var free = [];
    for (var b = 0; b < pg.num_blocks; b++) if (!owner[b]) { owner[b] = ["free", 0]; free.push(b); }
    var intro = el("p", "pw-note");
    intro.textContent = "Request A decodes position " + (pg.seq_len - 1) + " (seq_len " + pg.seq_len +
      ") with block table [" + pg.block_table.join(", ") + "], blocks of " + bs + " positions: position p lives in " +
      "block table[p // " + bs + "] at offset p % " + bs + ", slot block \u00d7 " + bs + " + offset. " +
      "Its last block holds " +
      count(pg.seq_len - (pg.block_table.length - 1) * bs, "position") + ". Request B holds blocks [" +
      pg.other.block_table.join(", ") + "]; blocks " + free.join(", ") + " are free (stale values); block " +
      pg.null_block + " is the null block. The kernel reads the table entry, loads that block in place, " +
      "and folds its valid offsets into m, l and acc: no copy of A's keys is ever made.";
    ui.appendChild(intro);
    var controls = CourseSim.stepControls("pw-", {
      labels: {reset: "before any block", next: "next block \u25b6", back: "\u25c0 block"},
      text: function (s, last) { return "block " + s + " of " + last; },
      onStep: function () { render(); }
    });
    ui.appendChild(controls.row);
    var note = el("p", "pw-note pw-now");
    ui.appendChild(note);
    ui.appendChild(legend([
      ["mine", FILL.mine, "request A's blocks"], ["current", FILL.current, "the block read now (valid offsets)"],
      ["done", FILL.done, "read already"], ["other", FILL.other, "request B's"], ["free", FILL.free, "free (stale)"],
      ["null", FILL["null"], "null block"], ["unused", FILL.unused, "offset past seq_len: never read", "#c95c5c"]]));
    var svgWrap = el("div", "fa-svg-wrap");
    ui.appendChild(svgWrap);
    var tableWrap = el("div", "fa-table-wrap");
    ui.appendChild(tableWrap);
    var final = el("p", "pw-final");
    ui.appendChild(final);

    function render() {
      var step = controls.step, w = step > 0 ? walk[step - 1] : null;
      if (!w) {
        note.textContent = "Before any block: m = \u2212\u221e, l = 0, acc = 0. The walk reads " +
          nBlocks + " table entries, " + pg.seq_len + " positions.";
      } else {
        note.textContent = "Block " + step + ": table[" + w.j + "] = " + w.block + "; positions " + (w.j * bs) +
          "\u2013" + (w.j * bs + w.n - 1) + " at slots " + w.slots[0] + "\u2013" + w.slots[w.slots.length - 1] +
          " (" + w.n + " of " + bs + " offsets valid" + (w.n < bs ? ": seq_len ends here, the rest is masked" : "") +
          "); the running max " +
          (w.j > 0 && w.alpha < 1 ? "rises, so the old l and acc are rescaled by " + num(w.alpha) :
           w.j > 0 ? "stays, rescale 1" : "starts here") + ".";
      }
      drawPool(step);
      var table = el("table", "fa-table"), head = el("tr");
      ["j", "block = table[j]", "positions", "slots", "valid", "scores q\u00b7k / \u221aD", "m",
       "rescale", "l", "output so far acc / l"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      table.appendChild(head);
      walk.slice(0, step).forEach(function (x, k) {
        var tr = el("tr", "pw-block" + (k === step - 1 ? " fa-now" : "")), out = divide(x.acc, x.l);
        tr.dataset.j = String(x.j);
        tr.dataset.block = String(x.block);
        tr.dataset.n = String(x.n);
        tr.dataset.m = String(x.m);
        tr.dataset.l = String(x.l);
        tr.dataset.alpha = String(x.alpha);
        tr.dataset.out = JSON.stringify(out);
        [String(x.j), String(x.block), x.j * bs + "\u2013" + (x.j * bs + x.n - 1),
         x.slots[0] + "\u2013" + x.slots[x.slots.length - 1],
         x.n + " of " + bs, x.scores.map(num).join(", "), num(x.m), k === 0 ? "0 (nothing yet)" : num(x.alpha),
         num(x.l), vec(out)].forEach(function (v, c) { tr.appendChild(el("td", c < 2 ? null : "fa-num", v)); });
        table.appendChild(tr);
      });
      tableWrap.textContent = "";
      tableWrap.appendChild(table);
      final.textContent = "";
      final.dataset.finished = String(step === nBlocks);
      if (step === nBlocks) {
        var last = walk[nBlocks - 1], out = divide(last.acc, last.l), d = maxDiff(out, pg.reference);
        final.dataset.out = JSON.stringify(out);
        final.dataset.reference = JSON.stringify(pg.reference);
        final.dataset.diff = String(d);
        final.appendChild(document.createTextNode("After the last block: acc / l = " + vec(out) +
          "; S12's gather of blocks [" + pg.block_table.join(", ") + "] then torch's SDPA = " + vec(pg.reference) +
          " (exported); largest difference " + d.toExponential(1) + " "));
        final.appendChild(el("span", d <= data.tolerance ? "fa-ok" : "fa-bad",
                             d <= data.tolerance ? "\u2713 equal" : "\u2717 differs"));
        final.appendChild(document.createTextNode(". s17_flash.paged_attention gave " + vec(pg.out) + "."));
      } else {
        delete final.dataset.out;
        final.textContent = "After all " + count(nBlocks, "block") + ", acc / l will be the gather + SDPA's " +
          vec(pg.reference) + ".";
      }
    }

    function drawPool(step) {
      var cw = 38, ch = 20, gap = 6, left = 52, top = 18;
      var width = left + pg.num_blocks * (cw + gap), height = top + bs * ch + 34;
      var svg = svgNode("svg", {"class": "pw-pool", width: width, height: height,
                                viewBox: "0 0 " + width + " " + height, role: "img",
                                "aria-label": "The KV pool: " + pg.num_blocks + " blocks of " + bs});
      var text = function (x, y, words, anchor, cls) {
        var t = svgNode("text", {x: x, y: y, "text-anchor": anchor || "middle"}, svg);
        if (cls) t.setAttribute("class", cls);
        t.textContent = words;
      };
      text(4, top - 6, "block", "start");
      for (var o = 0; o < bs; o++) text(left - 6, top + o * ch + 14, "off " + o, "end");
      for (var b = 0; b < pg.num_blocks; b++) {
        var x = left + b * (cw + gap), who = owner[b][0], j = owner[b][1];
        text(x + cw / 2, top - 6, String(b));
        var label = who === "mine" ? "A[" + j + "]" : who === "other" ? "B[" + j + "]" : who;
        text(x + cw / 2, top + bs * ch + 14, label);
        for (o = 0; o < bs; o++) {
          var kind = who, pos = null;
          if (who === "mine") {
            pos = j * bs + o;
            if (pos >= pg.seq_len) kind = "unused";
            else if (j < step - 1) kind = "done";
            else if (j === step - 1) kind = "current";
          } else if (who === "other" && j * bs + o >= pg.other.seq_len) {
            kind = "unused";
          }
          var rect = svgNode("rect", {"class": "pw-slot", x: x, y: top + o * ch, width: cw, height: ch - 1,
                                      fill: FILL[kind],
                                      stroke: kind === "unused" ? "#c95c5c" : "rgba(128,128,128,0.5)",
                                      "stroke-dasharray": kind === "unused" ? "2 2" : "none",
                                      "data-block": b, "data-offset": o, "data-kind": kind}, svg);
          var tip = svgNode("title", {}, rect);
          tip.textContent = "block " + b + ", offset " + o + ", slot " + (b * bs + o) +
            (pos === null ? "" : ": request A's position " + pos +
             (pos >= pg.seq_len ? " (not written yet, never read)" : ""));
          if (pos !== null && pos < pg.seq_len) text(x + cw / 2, top + o * ch + 14, "p" + pos);
        }
      }
      text(4, height - 4, "table of A: [" + pg.block_table.join(", ") + "]" +
           (step > 0 ? "; reading entry " + (step - 1) + " \u2192 block " + walk[step - 1].block : ""),
           "start", "pw-table");
      svgWrap.textContent = "";
      svgWrap.appendChild(svg);
    }

    controls.setLast(nBlocks);
    controls.go(0);
  }

  CourseSim.register("tiled-attention", mount);
}());
