/* S18 "Try it": one layer's forward split over N ranks, ranks side by side.
 *
 * export.py (beside this file) ran code/s18_layers.py at build time: a tiny Qwen3 (hidden 8,
 * 4 query heads and 2 key/value heads of 4, MLP 8, vocabulary 16, one layer, weights multiples
 * of 1/8) split over N = 1, 2 and 4 ranks as threads (`shard_model`, `run_ranks`), forward of
 * the token ids 2, 7, 13. Per N and rank it exported the weight shards, the rank's q, k, v and
 * attention of its heads, its slice of the MLP, its partial sums before each all-reduce and its
 * logits before the gather; per all-reduce the sum; the bytes each rank holds and each
 * all-reduce carries; and S06's unsplit model's logits.
 *
 * The learner picks N and steps through the forward: the split, the vocabulary-parallel
 * embedding and its all-reduce, the column-parallel q/k/v (no communication), attention head
 * by head, the row-parallel output projection's partial sums and their all-reduce, the MLP's
 * column-parallel gate/up and row-parallel down with its all-reduce, the vocabulary-parallel
 * head and the gather on rank 0. The all-reduce steps and the gather are highlighted when
 * N > 1; at N = 1 nothing is communicated (0 all-reduces, 0 bytes: exercise 2's (0, 0)), and the
 * page says so at those steps instead. The all-reduce is described as the course's own
 * (code/s18_allreduce.py's ShmCommunicator): each rank publishes its partial, every rank adds all N
 * in rank order.
 *
 * `replayWorld` and the helpers above it are line-by-line transcriptions of export.py's
 * `replay_world` and its helpers (Python floats there, doubles here). On load the page
 * recomputes every rank's products for every N from the exported weights and token ids and
 * checks them against the exported torch run within data.tolerance (|a - b| <= tol (1 + |b|)),
 * the gathered logits against S06's, and each rank's bytes against the shard shapes: a banner
 * and a console error name any that differ. The last step's comparison of the gathered logits
 * with S06's uses the same relative measure. Every matrix shown carries its numbers at full
 * precision in data-values, with data-name and data-rank (read by
 * tests/test_s18_simulator_browser.py). The split diagram is laid out after it is in the page,
 * from its labels' measured widths, so no label runs into the next one at any width.
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count;
  var SVG = "http://www.w3.org/2000/svg";
  var RANK_COLOURS = ["#3a78c2", "#e69138", "#2e9e6a", "#a64ca6"];
  var STYLE = [
    ".tp-sim select, .tp-sim button, .tp-sim input { font: inherit; font-size: 0.9em; }",
    ".tp-sim select, .tp-sim button { padding: 0.15rem 0.45rem; border: 1px solid var(--color-background-border, #ccc);",
    "  border-radius: 4px; background: var(--color-background-primary, #fff); color: var(--color-foreground-primary, #222); }",
    ".tp-sim button { cursor: pointer; }",
    ".tp-sim button:disabled { opacity: 0.45; cursor: default; }",
    ".tp-fields, .tp-row { display: flex; flex-wrap: wrap; gap: 0.4rem 0.8rem; align-items: center; margin: 0.4rem 0; }",
    ".tp-field { display: inline-flex; gap: 0.3rem; align-items: center; font-size: 0.9em; }",
    ".tp-slider { flex: 1 1 8rem; min-width: 6rem; }",
    ".tp-step-label { font-weight: 600; font-variant-numeric: tabular-nums; }",
    ".tp-banner { color: #b00020; font-weight: 600; }",
    ".tp-note, .tp-check, .tp-final, .tp-source, .tp-comm, .tp-bytes { font-size: 0.88em; margin: 0.3rem 0; }",
    ".tp-note { min-height: 2.6em; }",
    ".tp-comm { padding: 0.3rem 0.5rem; border: 1px dashed rgba(128, 128, 128, 0.6); border-radius: 4px; }",
    ".tp-comm.tp-hot { border: 2px solid #c62828; background: rgba(198, 40, 40, 0.08); font-weight: 600; }",
    ".tp-ranks { display: flex; flex-wrap: wrap; gap: 0.5rem; margin: 0.4rem 0; }",
    ".tp-rank { flex: 1 1 16rem; min-width: 0; border: 2px solid #999; border-radius: 6px; padding: 0.3rem 0.4rem; }",
    ".tp-rank-title { font-weight: 700; font-size: 0.9em; margin: 0 0 0.2rem 0; }",
    ".tp-rank-note { font-size: 0.8em; margin: 0.15rem 0; }",
    ".tp-shared, .tp-sum { border: 1px solid rgba(128, 128, 128, 0.5); border-radius: 6px; padding: 0.3rem 0.4rem; margin: 0.4rem 0; }",
    ".tp-sum.tp-hot { border: 2px solid #c62828; background: rgba(198, 40, 40, 0.06); }",
    ".tp-sum-title { font-weight: 700; font-size: 0.88em; margin: 0 0 0.2rem 0; }",
    ".tp-mat { margin: 0.2rem 0; max-width: 100%; overflow-x: auto; }",
    ".tp-mat-caption { font-size: 0.78em; margin: 0.1rem 0; }",
    "table.tp-table { border-collapse: collapse; font-size: 0.72em; }",
    ".tp-table td { border: 1px solid rgba(128, 128, 128, 0.35); padding: 1px 3px; text-align: right;",
    "  font-variant-numeric: tabular-nums; white-space: nowrap; min-width: 2.2rem; }",
    ".tp-table th { font-weight: 400; padding: 1px 4px; text-align: left; white-space: nowrap; }",
    ".tp-heads { display: flex; flex-wrap: wrap; gap: 0.2rem 0.6rem; }",
    "table.tp-shards { border-collapse: collapse; font-size: 0.78em; margin: 0.2rem 0; }",
    ".tp-shards th, .tp-shards td { border: 1px solid var(--color-background-border, #ccc); padding: 1px 5px; white-space: nowrap; }",
    ".tp-shards td.tp-num { text-align: right; font-variant-numeric: tabular-nums; }",
    ".tp-svg-wrap { width: 100%; overflow-x: auto; }",
    ".tp-svg-wrap svg { display: block; }",
    ".tp-svg-wrap text { fill: var(--color-foreground-primary, #222); font-size: 10px; }",
    ".tp-ok { color: #2e7d32; font-weight: 600; } .tp-bad { color: #c62828; font-weight: 600; }"
  ].join("\n");

  // ---------------------------------------------------------------------------------------------
  // The replay (export.py's matmul_t, rms_norm, rope, silu, add, heads_of, attention,
  // sum_parts, replay_rank_embed and replay_world)
  // ---------------------------------------------------------------------------------------------

  function matmulT(x, w) {
    return x.map(function (row) {
      return w.map(function (wrow) {
        var acc = 0.0;
        for (var c = 0; c < row.length; c++) acc = acc + row[c] * wrow[c];
        return acc;
      });
    });
  }

  function rmsNorm(row, weight, eps) {
    var mean = 0.0;
    for (var c = 0; c < row.length; c++) mean = mean + row[c] * row[c];
    var inv = 1.0 / Math.sqrt(mean / row.length + eps);
    return row.map(function (a, c) { return a * inv * weight[c]; });
  }

  function rope(vec, cos, sin) {
    var half = vec.length / 2;
    var rotated = vec.slice(half).map(function (a) { return -a; }).concat(vec.slice(0, half));
    return vec.map(function (a, c) { return a * cos[c] + rotated[c] * sin[c]; });
  }

  function silu(a) { return a / (1.0 + Math.exp(-a)); }

  function add(a, b) {
    return a.map(function (ra, t) { return ra.map(function (x, c) { return x + b[t][c]; }); });
  }

  function headsOf(flat, first, n, dim) {
    var out = [];
    for (var h = 0; h < n; h++) {
      out.push(flat.map(function (row) { return row.slice((first + h) * dim, (first + h + 1) * dim); }));
    }
    return out;
  }

  function attention(q, k, v, scale) {
    var group = q.length / k.length;
    return q.map(function (qHead, i) {
      var keys = k[Math.floor(i / group)], values = v[Math.floor(i / group)];
      return qHead.map(function (qRow, t) {
        var scores = [], s, c;
        for (s = 0; s <= t; s++) {                       // causal: keys 0 .. t
          var dot = 0.0;
          for (c = 0; c < qRow.length; c++) dot = dot + qRow[c] * keys[s][c];
          scores.push(dot * scale);
        }
        var top = Math.max.apply(null, scores);
        var probs = scores.map(function (x) { return Math.exp(x - top); });
        var total = 0.0;
        probs.forEach(function (p) { total = total + p; });
        var row = zeros(qRow.length);
        probs.forEach(function (p, s2) {
          row = row.map(function (a, c2) { return a + p / total * values[s2][c2]; });
        });
        return row;
      });
    });
  }

  function sumParts(parts) {
    var total = parts[0].map(function (row) { return row.slice(); });
    for (var r = 1; r < parts.length; r++) total = add(total, parts[r]);
    return total;
  }

  function replayRankEmbed(rank, ids, hidden) {
    var lo = rank.vocab[0], hi = rank.vocab[1];
    return ids.map(function (t) {
      return lo <= t && t < hi ? rank.weights.embed_tokens[t - lo].slice() : zeros(hidden);
    });
  }

  function replayWorld(data, world) {
    var cfg = data.config, rep = data.replicated, eps = cfg.norm_eps, dim = cfg.head_dim;
    var scale = 1.0 / Math.sqrt(dim), ids = data.token_ids, cos = data.cos, sin = data.sin;
    var ranks = world.ranks.map(function (rank) { return {embed: replayRankEmbed(rank, ids, cfg.hidden_size)}; });
    var x = sumParts(ranks.map(function (m) { return m.embed; }));             // all-reduce 1
    world.ranks.forEach(function (rank, r) {
      var w = rank.weights, mine = ranks[r];
      var hNorm = x.map(function (row) { return rmsNorm(row, rep.input_layernorm, eps); });
      var q = headsOf(matmulT(hNorm, w.q_proj), 0, rank.num_heads, dim);
      var k = headsOf(matmulT(hNorm, w.k_proj), 0, rank.num_kv_heads, dim);
      var v = headsOf(matmulT(hNorm, w.v_proj), 0, rank.num_kv_heads, dim);
      q = q.map(function (head) {
        return head.map(function (row, t) { return rope(rmsNorm(row, rep.q_norm, eps), cos[t], sin[t]); });
      });
      k = k.map(function (head) {
        return head.map(function (row, t) { return rope(rmsNorm(row, rep.k_norm, eps), cos[t], sin[t]); });
      });
      var attn = attention(q, k, v, scale);
      var flat = ids.map(function (_, t) {
        var row = [];
        attn.forEach(function (head) { row = row.concat(head[t]); });
        return row;
      });
      mine.h_norm = hNorm; mine.q = q; mine.k = k; mine.v = v; mine.attn = attn;
      mine.o_partial = matmulT(flat, w.o_proj);
    });
    var attnSum = sumParts(ranks.map(function (m) { return m.o_partial; }));   // all-reduce 2
    var h = add(x, attnSum);
    var mNorm = h.map(function (row) { return rmsNorm(row, rep.post_attention_layernorm, eps); });
    world.ranks.forEach(function (rank, r) {
      var w = rank.weights, mine = ranks[r];
      var gate = matmulT(mNorm, w.gate_proj), up = matmulT(mNorm, w.up_proj);
      var act = gate.map(function (gr, t) { return gr.map(function (g, c) { return silu(g) * up[t][c]; }); });
      mine.gate = gate; mine.up = up; mine.act = act; mine.down_partial = matmulT(act, w.down_proj);
    });
    var mlpSum = sumParts(ranks.map(function (m) { return m.down_partial; }));  // all-reduce 3
    var out = add(h, mlpSum);
    var fin = out.map(function (row) { return rmsNorm(row, rep.norm, eps); });
    world.ranks.forEach(function (rank, r) { ranks[r].logits_partial = matmulT(fin, rank.weights.embed_tokens); });
    var logits = ids.map(function (_, t) {                                      // the gather
      var row = [];
      ranks.forEach(function (m) { row = row.concat(m.logits_partial[t]); });
      return row;
    });
    return {ranks: ranks, x: x, attn_sum: attnSum, h: h, m_norm: mNorm, mlp_sum: mlpSum,
            out: out, final_norm: fin, logits: logits};
  }

  function zeros(n) { var z = []; for (var k = 0; k < n; k++) z.push(0.0); return z; }

  // ---------------------------------------------------------------------------------------------
  // The check against the torch run
  // ---------------------------------------------------------------------------------------------

  function flatten(a) {
    return Array.isArray(a) ? a.reduce(function (acc, b) { return acc.concat(flatten(b)); }, []) : [a];
  }

  // [compared, worst ok?]: every number of a within tol of b's (same nesting)
  function near(a, b, tol) {
    var fa = flatten(a), fb = flatten(b);
    if (fa.length !== fb.length) return [0, false];
    for (var k = 0; k < fa.length; k++) {
      if (!isFinite(fa[k]) || !isFinite(fb[k]) || Math.abs(fa[k] - fb[k]) > tol * (1 + Math.abs(fb[k]))) {
        return [fa.length, false];
      }
    }
    return [fa.length, true];
  }

  // The largest |a - b| / (1 + |b|): near's measure, so "within tol" means the same at load and
  // on the last step.
  function maxRelDiff(a, b) {
    var fa = flatten(a), fb = flatten(b), d = 0;
    for (var k = 0; k < fa.length; k++) d = Math.max(d, Math.abs(fa[k] - fb[k]) / (1 + Math.abs(fb[k])));
    return d;
  }

  function prod(shape) { return shape.reduce(function (a, b) { return a * b; }, 1); }

  // The bytes of a rank's shards, from their shapes (each tensor once; a tied head is the
  // embedding).
  function rankBytes(rank, dtypeBytes) {
    var total = 0;
    Object.keys(rank.shapes).forEach(function (n) { total += prod(rank.shapes[n]); });
    return total * dtypeBytes;
  }

  var PAIRS = [["embed", "embed_partial"], ["q", "q"], ["k", "k"], ["v", "v"], ["attn", "attn"],
               ["o_partial", "o_partial"], ["gate", "gate"], ["up", "up"], ["act", "act"],
               ["down_partial", "down_partial"], ["logits_partial", "logits_partial"]];

  function checkAll(data) {
    var problems = [], numbers = 0, tol = data.tolerance, replays = [];
    data.worlds.forEach(function (world) {
      var name = "N = " + world.world_size, got = replayWorld(data, world);
      replays.push(got);
      function compare(what, a, b) {
        var res = near(a, b, tol);
        numbers += res[0];
        if (!res[1]) problems.push(name + ": " + what);
      }
      world.ranks.forEach(function (rank, r) {
        PAIRS.forEach(function (pair) { compare("rank " + r + " " + pair[0], got.ranks[r][pair[0]], rank[pair[1]]); });
        var bytes = rankBytes(rank, data.dtype_bytes);
        if (bytes !== world.shard_bytes[r] || bytes !== rank.weight_bytes) {
          problems.push(name + ": rank " + r + " holds " + bytes + " bytes by its shapes, " +
                        world.shard_bytes[r] + " by shard_bytes");
        }
      });
      compare("all-reduce 1", got.x, world.all_reduces[0].sum);
      compare("all-reduce 2", got.attn_sum, world.all_reduces[1].sum);
      compare("all-reduce 3", got.mlp_sum, world.all_reduces[2].sum);
      compare("the residual after attention", got.h, world.h);
      compare("the layer's output", got.out, world.out);
      compare("the gathered logits", got.logits, world.logits);
      compare("the logits against S06's unsplit model", got.logits, data.reference_logits);
    });
    return {problems: problems, numbers: numbers, replays: replays};
  }

  // ---------------------------------------------------------------------------------------------
  // Text and drawing
  // ---------------------------------------------------------------------------------------------

  function num(x) {
    if (!isFinite(x)) return "\u2013";
    return (Math.abs(x) < 0.005 ? 0 : x).toFixed(2).replace(/^-/, "\u2212");
  }

  function cellColour(x, scale) {
    var a = Math.min(1, Math.abs(x) / scale) * 0.55;
    return x >= 0 ? "rgba(58, 120, 194, " + a.toFixed(3) + ")" : "rgba(201, 92, 92, " + a.toFixed(3) + ")";
  }

  function range(a, b) { return b - a === 1 ? String(a) : a + "\u2013" + (b - 1); }

  // div.tp-mat: a caption and a T x n table of values (rows labelled by token), the numbers at
  // full precision in data-values. values: (rows, cols).
  function matrix(name, rank, caption, values, rowLabels, colStart) {
    var box = el("div", "tp-mat");
    box.dataset.name = name;
    box.dataset.rank = rank === null ? "" : String(rank);
    box.dataset.values = JSON.stringify(values);
    box.appendChild(el("p", "tp-mat-caption", caption));
    var scale = 0;
    flatten(values).forEach(function (x) { scale = Math.max(scale, Math.abs(x)); });
    var table = el("table", "tp-table");
    values.forEach(function (row, t) {
      var tr = el("tr");
      tr.appendChild(el("th", null, rowLabels[t]));
      row.forEach(function (x, c) {
        var td = el("td", null, num(x));
        td.style.background = cellColour(x, scale || 1);
        td.title = (colStart === undefined ? "" : "column " + (colStart + c) + ": ") + String(x);
        tr.appendChild(td);
      });
      table.appendChild(tr);
    });
    box.appendChild(table);
    return box;
  }

  // One matrix per head: values (heads, T, D), as a row of small tables.
  function heads(name, rank, label, values, firstHead, rowLabels) {
    var box = el("div", "tp-heads");
    box.dataset.name = name;
    box.dataset.rank = String(rank);
    values.forEach(function (head, h) {
      var m = matrix(name + "-head", rank, label + " head " + (firstHead + h), head, rowLabels);
      m.dataset.head = String(firstHead + h);
      box.appendChild(m);
    });
    box.dataset.values = JSON.stringify(values);
    box.classList.add("tp-mat-group");
    return box;
  }

  function svgNode(tag, attrs, parent) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    if (parent) parent.appendChild(node);
    return node;
  }

  // ---------------------------------------------------------------------------------------------
  // The page
  // ---------------------------------------------------------------------------------------------

  var SHORT = {"model.embed_tokens.weight": "embed_tokens (= head)",
               "model.layers.0.self_attn.q_proj.weight": "q_proj",
               "model.layers.0.self_attn.k_proj.weight": "k_proj",
               "model.layers.0.self_attn.v_proj.weight": "v_proj",
               "model.layers.0.self_attn.o_proj.weight": "o_proj",
               "model.layers.0.mlp.gate_proj.weight": "gate_proj",
               "model.layers.0.mlp.up_proj.weight": "up_proj",
               "model.layers.0.mlp.down_proj.weight": "down_proj"};

  function mount(root, data) {
    if (!document.getElementById("tp-style")) {
      var style = el("style", {id: "tp-style"});
      style.textContent = STYLE;
      document.head.appendChild(style);
    }
    var ui = el("div", "tp-sim");
    root.appendChild(ui);
    var banner = el("p", "tp-banner");
    banner.hidden = true;
    ui.appendChild(banner);
    var checked = checkAll(data);
    CourseSim.report(banner, "tensor-parallel", "The page's recomputation differs from the torch run " +
                     "(code/s18_layers.py) in: ", checked.problems, 6);

    var cfg = data.config, ids = data.token_ids, T = ids.length, stages = data.stages;
    var rowLabels = ids.map(function (t, i) { return "t" + i + " (id " + t + ")"; });
    var fields = el("div", "tp-fields");
    ui.appendChild(fields);
    var box = el("label", "tp-field");
    box.appendChild(el("span", null, "ranks N "));
    var worldPick = el("select", "tp-world");
    var sizes = data.worlds.map(function (w) { return w.world_size; });
    sizes.forEach(function (n) { worldPick.appendChild(el("option", {value: String(n)}, String(n))); });
    box.appendChild(worldPick);
    fields.appendChild(box);

    var controls = CourseSim.stepControls("tp-", {
      labels: {reset: "back to the split", next: "next step \u25b6", back: "\u25c0 step"},
      text: function (s, last) {
        return "step " + s + " of " + last + ": " + stages[s].title + (alone() && communicates(s) ?
          " (none at N = 1)" : "");
      },
      onStep: function () { render(); }
    });
    ui.appendChild(controls.row);
    var note = el("p", "tp-note");
    ui.appendChild(note);
    var comm = el("p", "tp-comm");
    ui.appendChild(comm);
    var stage = el("div", "tp-stage");
    ui.appendChild(stage);
    var final = el("p", "tp-final");
    ui.appendChild(final);
    var check = el("p", "tp-check");
    check.textContent = checked.problems.length ? "" : "This page recomputed every rank's products for N = " +
      data.worlds.map(function (w) { return w.world_size; }).join(", ") + " (" + checked.numbers +
      " numbers) from the exported weight shards and token ids: every one agrees with the torch run of " +
      "code/s18_layers.py's layers (float32) within " + data.tolerance + " (relative), the gathered logits " +
      "with S06's unsplit model, and each rank's bytes with shard_bytes.";
    ui.appendChild(check);
    ui.appendChild(el("p", "tp-source", "Exported at build time by site/simulators/tensor-parallel/export.py: " +
                      data.source + ". Weights are multiples of 1/8 (seed " + data.seed + "); hidden " +
                      cfg.hidden_size + ", " + cfg.num_attention_heads + " query heads and " +
                      cfg.num_key_value_heads + " key/value heads of " + cfg.head_dim + ", MLP " +
                      cfg.intermediate_size + ", vocabulary " + cfg.vocab_size + ", one layer; the ranks " +
                      "ran as threads, each summing through code/s18_layers.py's ThreadCommunicator."));

    var world = null, replay = null;

    // One rank: every collective is a no-op, nothing is sent.
    function alone() { return world !== null && world.world_size === 1; }
    function communicates(s) { return stages[s].kind === "all_reduce" || stages[s].kind === "gather"; }

    function choose() {
      var k = sizes.indexOf(Number(worldPick.value));         // a value no option offers: the default
      if (worldPick.value === "" || k < 0) k = data.defaults.world;
      worldPick.value = String(sizes[k]);
      world = data.worlds[k];
      replay = checked.replays[k];
      controls.setLast(stages.length - 1);
      controls.go(controls.step);
    }

    // The collectives done up to and including step s: [all-reduces, gathers]; none at N = 1
    // (exercise 2: (0, 0)).
    function collectivesUpTo(s) {
      var ar = 0, ga = 0;
      if (alone()) return [0, 0];
      for (var k = 0; k <= s; k++) {
        if (stages[k].kind === "all_reduce") ar += 1;
        if (stages[k].kind === "gather") ga += 1;
      }
      return [ar, ga];
    }

    function rankBox(r) {
      var rank = world.ranks[r], b = el("div", "tp-rank");
      b.dataset.rank = String(r);
      b.style.borderColor = RANK_COLOURS[r % RANK_COLOURS.length];
      b.appendChild(el("p", "tp-rank-title", "rank " + r + (r === 0 ? " (runs the sampler)" : "")));
      b.appendChild(el("p", "tp-rank-note", "query heads " + range(rank.q_heads[0], rank.q_heads[1]) +
        ", key/value head" + (rank.kv_heads[1] - rank.kv_heads[0] > 1 ? "s " : " ") +
        range(rank.kv_heads[0], rank.kv_heads[1]) + (world.kv_replicated ? " (replicated)" : "") +
        ", MLP columns " + range(rank.intermediate[0], rank.intermediate[1]) + ", tokens " +
        range(rank.vocab[0], rank.vocab[1])));
      return b;
    }

    function sumBox(name, title, values, hot, colStart) {
      var b = el("div", "tp-sum" + (hot && !alone() ? " tp-hot" : ""));
      b.dataset.name = name;
      b.appendChild(el("p", "tp-sum-title", title));
      b.appendChild(matrix(name, null, "", values, rowLabels, colStart));
      return b;
    }

    function sharedBox(name, title, values) {
      var b = el("div", "tp-shared");
      b.appendChild(el("p", "tp-sum-title", title));
      b.appendChild(matrix(name, null, "", values, rowLabels));
      return b;
    }

    function render() {
      if (!world) return;
      var s = controls.step, st = stages[s], n = world.world_size, msg = world.plan.all_reduce_bytes;
      var done = collectivesUpTo(s), hot = communicates(s) && n > 1;
      comm.className = "tp-comm" + (hot ? " tp-hot" : "");
      comm.dataset.allReduces = String(done[0]);
      comm.dataset.gathers = String(done[1]);
      comm.dataset.bytes = String(done[0] * msg);
      comm.dataset.hot = String(hot);
      var now;
      if (n === 1) {
        now = st.kind === "all_reduce" ? "No communication: with one rank there is no all-reduce. Its product is " +
          "already the whole sum, so nothing is sent." :
          st.kind === "gather" ? "No communication: rank 0 computed every logit itself, so there is nothing to " +
          "gather." : "No communication in this step: the one rank holds everything.";
        comm.textContent = now + " So far: nothing sent (0 all-reduces, 0 bytes, no gather); at N = 1 a step " +
          "communicates nothing.";
      } else {
        now = st.kind === "all_reduce" ? "Communication now: each rank publishes its " + msg + "-byte partial (" + T +
          " tokens \u00d7 " + cfg.hidden_size + " \u00d7 " + data.dtype_bytes + " bytes), then every rank adds " +
          "all " + n + " partials in rank order, so each gets the same sum, bit for bit." :
          st.kind === "gather" ? "Communication now: " + (n === 2 ? "rank 1 sends its " : "ranks 1\u2013" + (n - 1) +
          " each send their ") + T + " \u00d7 " + cfg.vocab_size / n + " logits to rank 0 (" +
          world.plan.gather_bytes_per_row + " bytes per row, " + T * world.plan.gather_bytes_per_row + " bytes)." :
          "No communication in this step: each rank works on what it holds.";
        comm.textContent = now + " So far: " + done[0] + " of " + world.plan.all_reduce + " all-reduces (each " +
          "rank's partials in them: " + done[0] * msg + " bytes), " + done[1] + " of 1 gather.";
      }
      stage.textContent = "";
      final.textContent = "";
      final.dataset.finished = String(st.id === "gather");
      delete final.dataset.diff;
      delete final.dataset.ok;
      delete final.dataset.out;
      var ranks = el("div", "tp-ranks");
      var draw = DRAW[st.id];
      note.textContent = draw.note(n);
      draw.body(ranks, n);
      stage.appendChild(ranks);
      if (draw.after) draw.after(stage, n);
    }

    function eachRank(ranks, fill) {
      world.ranks.forEach(function (rank, r) {
        var b = rankBox(r);
        fill(b, rank, r, replay.ranks[r]);
        ranks.appendChild(b);
      });
    }

    function split(ranks, n) {
      var diagram = drawSplit(n);
      stage.appendChild(diagram);
      layoutSplit(diagram.querySelector("svg"));
      eachRank(ranks, function (b, rank, r) {
        var table = el("table", "tp-shards"), head = el("tr");
        ["weight", "shape", "its slice", "bytes"].forEach(function (h) { head.appendChild(el("th", null, h)); });
        table.appendChild(head);
        Object.keys(SHORT).forEach(function (name) {
          var shape = rank.shapes[name], sl = rank.slices[name], full = data.full_shapes[name];
          var tr = el("tr", "tp-shard");
          tr.dataset.rank = String(r);
          tr.dataset.name = name;
          tr.dataset.shape = JSON.stringify(shape);
          tr.dataset.bytes = String(prod(shape) * data.dtype_bytes);
          var where = sl.dim === null ? "whole" : (sl.dim === 0 ? "rows " : "cols ") +
            range(sl.range[0], sl.range[1]) + " of " + full[sl.dim];
          [SHORT[name], shape.join(" \u00d7 "), where, String(prod(shape) * data.dtype_bytes)].forEach(function (v, c) {
            tr.appendChild(el("td", c === 3 ? "tp-num" : null, v));
          });
          table.appendChild(tr);
        });
        var wrap = el("div", "tp-mat");
        wrap.appendChild(table);
        b.appendChild(wrap);
        var bytes = el("p", "tp-bytes");
        bytes.dataset.rank = String(r);
        bytes.dataset.bytes = String(world.shard_bytes[r]);
        bytes.textContent = "Holds " + world.shard_bytes[r] + " bytes of weights (norms whole on every rank), " +
          "of the unsplit " + data.full_bytes + " (" + (100 * world.shard_bytes[r] / data.full_bytes).toFixed(0) +
          "%); its KV cache: " + world.kv_bytes_per_token[r] + " bytes per token.";
        b.appendChild(bytes);
      });
    }

    // The full matrices, each band coloured by the rank that holds it. Each matrix is a group
    // drawn at x = 0; layoutSplit places the groups once the labels can be measured.
    function drawSplit(n) {
      var names = Object.keys(SHORT), unit = 5, top = 16, height = 0;
      names.forEach(function (name) { height = Math.max(height, data.full_shapes[name][0] * unit); });
      var svg = svgNode("svg", {"class": "tp-split", height: top + height + 18, role: "img",
                                "aria-label": "The full weights, coloured by the rank holding each slice"});
      names.forEach(function (name) {
        var shape = data.full_shapes[name], w = shape[1] * unit, hgt = shape[0] * unit;
        var col = svgNode("g", {"class": "tp-split-col", "data-name": name, "data-width": w}, svg);
        var label = svgNode("text", {x: 0, y: 11, "class": "tp-split-label"}, col);
        label.textContent = SHORT[name].split(" ")[0];
        world.ranks.forEach(function (rank, r) {
          var sl = rank.slices[name], a = sl.range[0] * unit, b = sl.range[1] * unit;
          var holders = world.ranks.filter(function (o) {
            return o.slices[name].range[0] === sl.range[0] && o.slices[name].range[1] === sl.range[1];
          }).map(function (o) { return o.rank; });
          var rect = sl.dim === 0 ? {x: 0, y: top + a, width: w, height: b - a} :
                     {x: a, y: top, width: b - a, height: hgt};
          var first = holders[0] === r;
          var node = svgNode("rect", {x: rect.x, y: rect.y, width: rect.width, height: rect.height,
                                      fill: RANK_COLOURS[holders[0] % RANK_COLOURS.length],
                                      "fill-opacity": first ? 0.55 : 0, stroke: "#555", "stroke-width": 0.5,
                                      "class": "tp-band", "data-rank": r, "data-name": name}, col);
          var tip = svgNode("title", {}, node);
          tip.textContent = SHORT[name] + ": " + (sl.dim === 0 ? "rows " : "columns ") +
            range(sl.range[0], sl.range[1]) + " on rank" + (holders.length > 1 ? "s " : " ") + holders.join(" and ");
          if (first && holders.length > 1) {
            var t = svgNode("text", {x: rect.x + 2, y: rect.y + Math.min(rect.height, 12) - 2,
                                     "class": "tp-split-holders"}, col);
            t.textContent = holders.join("+");
          }
        });
        var dims = svgNode("text", {x: 0, y: top + height + 13, "class": "tp-split-dims"}, col);
        dims.textContent = shape[0] + "\u00d7" + shape[1];
      });
      var wrap = el("div", "tp-svg-wrap");
      wrap.appendChild(svg);
      var kvPer = n / cfg.num_key_value_heads;
      var legendBox = el("p", "tp-rank-note", "Each full weight (rows \u00d7 columns, drawn to scale), coloured by " +
        "the rank that holds each slice: column-parallel weights (q, k, v, gate, up) and the vocabulary are cut " +
        "by rows, row-parallel ones (o, down) by columns." + (world.kv_replicated ? " With " + n + " ranks and " +
        cfg.num_key_value_heads + " key/value heads, each key/value head is held by " + kvPer + " ranks (labelled)." :
        ""));
      var holder = el("div");
      holder.appendChild(legendBox);
      holder.appendChild(wrap);
      return holder;
    }

    // Place the split diagram's columns side by side, each as wide as its matrix or its widest
    // text (measured in the page's font; a fixed gap between), and size the drawing to fit.
    function layoutSplit(svg) {
      var gap = 14, x = 4;
      Array.prototype.forEach.call(svg.querySelectorAll(".tp-split-col"), function (col) {
        var width = Number(col.getAttribute("data-width"));
        Array.prototype.forEach.call(col.querySelectorAll(".tp-split-label, .tp-split-dims"), function (t) {
          var len = 0;
          try { len = t.getComputedTextLength(); } catch (e) { len = 0; }
          if (!(len > 0)) len = t.textContent.length * 7;     // not rendered: a generous guess
          width = Math.max(width, Math.ceil(len));
        });
        col.setAttribute("transform", "translate(" + x + ", 0)");
        x += width + gap;
      });
      var height = Number(svg.getAttribute("height"));
      svg.setAttribute("width", String(x));
      svg.setAttribute("viewBox", "0 0 " + x + " " + height);
    }

    // The ranks that hold the same key/value head, "(0, 1)" per head (replicated KV heads only).
    function kvGroups() {
      var groups = {};
      world.ranks.forEach(function (rank) {
        (groups[rank.kv_heads[0]] = groups[rank.kv_heads[0]] || []).push(rank.rank);
      });
      return Object.keys(groups).map(function (h) { return "(" + groups[h].join(", ") + ")"; });
    }

    // What a rank does with its partial at an all-reduce step (nothing at N = 1).
    function sends(what) { return alone() ? "its " + what + ": already the whole sum, not sent" : "publishes its " + what; }

    var DRAW = {
      split: {
        note: function (n) {
          if (n === 1) return "One rank holds every weight: the model as S06 runs it. Pick N = 2 or 4 to split it.";
          var hkv = cfg.num_key_value_heads, parts = "its query heads, its columns of the MLP, its range of the " +
            "vocabulary (embedding and tied head)";
          if (!world.kv_replicated) {
            return "Each of the " + n + " ranks holds 1/" + n + " of every matrix: " + parts + ", and the key/value " +
              "heads its query heads use. The norms, small vectors, are held whole by every rank.";
          }
          return "Each of the " + n + " ranks holds 1/" + n + " of every matrix except k_proj and v_proj, and the " +
            "norms: " + parts + ". The model has only " + hkv + " key/value heads for " + n + " ranks, so each " +
            "key/value head is replicated on " + n + "/" + hkv + " = " + n / hkv + " ranks: a rank holds 1/" + hkv +
            " of k_proj and v_proj (the key/value head its query heads use). The norms, small vectors, are held " +
            "whole by every rank.";
        },
        body: split
      },
      embed: {
        note: function () {
          var idle = world.ranks.filter(function (rank) {
            return !ids.some(function (t) { return rank.vocab[0] <= t && t < rank.vocab[1]; });
          }).map(function (rank) { return rank.rank; });
          return "Each rank looks up only the tokens in its range of the vocabulary; a token outside it becomes a row of " +
            "zeros. Token ids: " + ids.join(", ") + "." + (idle.length ? " Rank" + (idle.length > 1 ? "s " : " ") +
            idle.join(" and ") + " hold" + (idle.length > 1 ? "" : "s") + " none of them: all zeros." : "");
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("embed", r, "embedding partial (T \u00d7 C), tokens " + range(rank.vocab[0], rank.vocab[1]),
                                 mine.embed, rowLabels));
          });
        }
      },
      allreduce_embed: {
        note: function (n) {
          return n === 1 ? "No all-reduce at N = 1: the one rank looked up every token, so its embedding is already " +
            "x; nothing is sent." :
            "All-reduce 1: the partial embeddings are added, so every rank has the whole embedding x of every token.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("embed", r, sends("embedding"), mine.embed, rowLabels));
          });
        },
        after: function (box) {
          box.appendChild(sumBox("x", alone() ? "x: the one rank's embedding, nothing summed" :
                                 "\u03a3 over ranks = x, on every rank", replay.x, true));
        }
      },
      qkv: {
        note: function (n) {
          return "Every rank normalises the same x (the norm's weight is whole on every rank), then multiplies by its own " +
            "rows of q_proj, k_proj and v_proj: its heads' queries, keys and values, with the q/k norm and RoPE applied " +
            "per head. Column parallel: each output column lives on one rank, nothing to send." +
            (world.kv_replicated ? " Ranks " + kvGroups().join(" and ") + " compute the same key/value head: the " +
             "price of having more ranks than key/value heads." : "");
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(heads("q", r, "q", mine.q, rank.q_heads[0], rowLabels));
            b.appendChild(heads("k", r, "k", mine.k, rank.kv_heads[0], rowLabels));
            b.appendChild(heads("v", r, "v", mine.v, rank.kv_heads[0], rowLabels));
          });
        },
        after: function (box) {
          box.insertBefore(sharedBox("h_norm", "input norm of x (the same on every rank)", replay.ranks[0].h_norm),
                           box.firstChild);
        }
      },
      attention: {
        note: function () {
          return "Attention is per head: each rank attends its query heads against its key/value heads (causal: token t " +
            "sees tokens 0..t). No head needs another rank's, so nothing is sent; each rank's KV cache holds only its " +
            "key/value heads.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(heads("attn", r, "attention output", mine.attn, rank.q_heads[0], rowLabels));
          });
        }
      },
      o_proj: {
        note: function (n) {
          return "Row parallel: rank r's attention output (its heads, T \u00d7 " + (world.ranks[0].num_heads * cfg.head_dim) +
            ") times its columns of o_proj gives a full-width T \u00d7 C matrix that is only a partial sum: the " +
            "contributions of its heads." + (n === 1 ? " With one rank it is the whole product." : "");
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("o_partial", r, "o_proj partial sum (T \u00d7 C)", mine.o_partial, rowLabels));
          });
        }
      },
      allreduce_attn: {
        note: function (n) {
          return n === 1 ? "No all-reduce at N = 1: the one rank's o_proj product is the whole attention output; it " +
            "adds it to its residual stream x. Nothing is sent." :
            "All-reduce 2: the partial sums are added; every rank adds the sum to its residual stream x.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("o_partial", r, sends("o_proj product"), mine.o_partial, rowLabels));
          });
        },
        after: function (box) {
          box.appendChild(sumBox("attn_sum", alone() ? "the attention block's output (one rank, nothing summed)" :
                                 "\u03a3 over ranks: the attention block's output", replay.attn_sum, true));
          box.appendChild(sumBox("h", alone() ? "h = x + the attention output (the residual)" :
                                 "h = x + \u03a3 (the residual), on every rank", replay.h, false));
        }
      },
      gate_up: {
        note: function () {
          return "The MLP's first product is column parallel: each rank's rows of gate_proj and up_proj give its " +
            cfg.intermediate_size / world.world_size + " of the " + cfg.intermediate_size + " intermediate columns, " +
            "and SiLU(gate) \u00d7 up needs nothing from another rank.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            var c0 = rank.intermediate[0];
            b.appendChild(matrix("gate", r, "gate (columns " + range(c0, rank.intermediate[1]) + ")", mine.gate, rowLabels, c0));
            b.appendChild(matrix("up", r, "up", mine.up, rowLabels, c0));
            b.appendChild(matrix("act", r, "SiLU(gate) \u00d7 up", mine.act, rowLabels, c0));
          });
        },
        after: function (box) {
          box.insertBefore(sharedBox("m_norm", "post-attention norm of h (the same on every rank)", replay.m_norm),
                           box.firstChild);
        }
      },
      down_proj: {
        note: function () {
          return "The second product is row parallel: each rank's slice of the intermediate times its columns of " +
            "down_proj is a full-width partial sum.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("down_partial", r, "down_proj partial sum (T \u00d7 C)", mine.down_partial, rowLabels));
          });
        }
      },
      allreduce_mlp: {
        note: function (n) {
          return n === 1 ? "No all-reduce at N = 1: the one rank's down_proj product is the whole MLP output, and the " +
            "residual gives the layer's output. Nothing is sent: split over N > 1 ranks, a model of L layers does " +
            "2L all-reduces per step, plus one for the embedding." :
            "All-reduce 3: the MLP's partial sums are added and the residual gives the layer's output, the same on " +
            "every rank. Two all-reduces per layer; a model of L layers does 2L of them per step, plus one for the " +
            "embedding.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("down_partial", r, sends("down_proj product"), mine.down_partial, rowLabels));
          });
        },
        after: function (box) {
          box.appendChild(sumBox("mlp_sum", alone() ? "the MLP's output (one rank, nothing summed)" :
                                 "\u03a3 over ranks: the MLP's output", replay.mlp_sum, true));
          box.appendChild(sumBox("out", alone() ? "the layer's output h + the MLP output" :
                                 "the layer's output h + \u03a3, on every rank", replay.out, false));
        }
      },
      head: {
        note: function () {
          return "The final norm runs on every rank; the head (tied to the embedding) is cut by vocabulary: each rank " +
            "computes the logits of its own " + cfg.vocab_size / world.world_size + " tokens.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("logits_partial", r, "logits of tokens " + range(rank.vocab[0], rank.vocab[1]),
                                 mine.logits_partial, rowLabels, rank.vocab[0]));
          });
        },
        after: function (box) {
          box.insertBefore(sharedBox("final_norm", "final norm of the output (the same on every rank)", replay.final_norm),
                           box.firstChild);
        }
      },
      gather: {
        note: function (n) {
          return n === 1 ? "Nothing to gather at N = 1: rank 0 computed every logit itself; it samples." :
            "The sampler runs on rank 0 only, so the logits are gathered there (concatenated in rank order = vocabulary " +
            "order), not all-reduced: the other ranks wait for the next step.";
        },
        body: function (ranks) {
          eachRank(ranks, function (b, rank, r, mine) {
            b.appendChild(matrix("logits_partial", r, r === 0 ? "its own logits" : "sends its logits to rank 0",
                                 mine.logits_partial, rowLabels, rank.vocab[0]));
          });
        },
        after: function (box) {
          box.appendChild(sumBox("logits", alone() ? "rank 0: its logits (T \u00d7 V), nothing gathered" :
                                 "rank 0: the gathered logits (T \u00d7 V)", replay.logits, true, 0));
          // The load-time check's measure and tolerance: |a - b| <= tol (1 + |b|).
          var d = maxRelDiff(replay.logits, data.reference_logits);
          var ok = near(replay.logits, data.reference_logits, data.tolerance)[1];
          final.dataset.diff = String(d);
          final.dataset.ok = String(ok);
          final.dataset.out = JSON.stringify(replay.logits);
          final.textContent = "Against S06's unsplit model's logits: largest difference " + d.toExponential(1) +
            " relative to 1 + |logit| (the measure of the check at load), tolerance " + data.tolerance + " ";
          final.appendChild(el("span", ok ? "tp-ok" : "tp-bad", ok ? "\u2713 equal" : "\u2717 differs"));
          var argmax = replay.logits.map(function (row) { return row.indexOf(Math.max.apply(null, row)); });
          final.appendChild(document.createTextNode(" (the order of the sums differs, so the last bits may). " +
            "Greedy next tokens: " + argmax.join(", ") + "."));
        }
      }
    };

    worldPick.addEventListener("change", choose);
    worldPick.value = String(sizes[data.defaults.world]);
    choose();
  }

  CourseSim.register("tensor-parallel", mount);
}());
