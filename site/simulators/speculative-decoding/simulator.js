/* S15 "Try it": speculative decoding. Two parts.
 *
 * 1. The replay. export.py (beside this file) ran code/s15_speculative.py's engine at build time
 *    on the bundled model (a 1-layer draft model, the target's int4 copy, or n-gram prompt
 *    lookup; k = 4; two greedy requests and one sampled with a seed) and recorded every step:
 *    each request's drafts, how many the rejection sampler accepted, and the tokens it emitted.
 *    The page shows one step at a time: accepted drafts (green, a check mark), the first
 *    rejected draft (red, struck through, a cross), the drafts after it that the target scored
 *    but nobody keeps (grey, dashed), and the target's own token: a correction at the rejected
 *    position (blue, a circle arrow) or a bonus after k accepted drafts (gold, a star). On load
 *    it checks every step (emitted = the accepted drafts + one token; the request's output = its
 *    steps joined) and recomputes the engine's SpecDecodingStats from the steps (a banner and a
 *    console error if anything differs).
 *
 * 2. The rule on a toy. Six words, a target distribution p and a draft distribution q (presets
 *    or the reader's weights, p = w / sum w). "Run" makes N verification steps of k drafts with
 *    a seeded PRNG (mulberry32; 2k + 1 uniforms per step, in this order: k to draw the drafts
 *    from q, k for the accept tests, one for the final draw), with code/s15_rejection.py's rule
 *    (rejection_sample): draft x is accepted iff u * q(x) < p(x); at the first rejection the
 *    final token is drawn from max(p - q, 0) normalised, after k accepts a bonus from p; every
 *    draw is S06's inverse CDF (sample_from: the first id whose float64 cumulative sum exceeds
 *    u x total). The wrong rule uses the same uniforms and draws the final token from p after a
 *    rejection too. The histogram of each step's first emitted token is drawn against p, with
 *    the chi-square statistic (df = the words with p > 0, minus 1) and its 0.1% critical value.
 *    On load the page checks its alpha = sum min(p, q), (1 - alpha^(k+1)) / (1 - alpha), the
 *    residual and the wrong rule's distribution against the values export.py computed with
 *    code/s15_rejection.py, for every preset.
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count, show = CourseSim.breaks;
  var STYLE = [
    ".sd-sim select, .sd-sim button, .sd-sim input { font: inherit; font-size: 0.9em; }",
    ".sd-sim select, .sd-sim button, .sd-sim input[type=number] { padding: 0.15rem 0.45rem; border: 1px solid var(--color-background-border, #ccc);",
    "  border-radius: 4px; background: var(--color-background-primary, #fff); color: var(--color-foreground-primary, #222); }",
    ".sd-sim select { max-width: 100%; }",
    ".sd-sim button { cursor: pointer; border-color: var(--color-brand-primary, #2b6cb0); }",
    ".sd-sim button:hover:not(:disabled) { background: var(--color-brand-primary, #2b6cb0); color: var(--color-background-primary, #fff); }",
    ".sd-sim button:disabled { opacity: 0.45; cursor: default; }",
    ".sd-sim h4 { margin: 0.6rem 0 0.3rem 0; font-size: 1em; }",
    ".sd-row, .sd-toy-controls { display: flex; flex-wrap: wrap; gap: 0.4rem 0.8rem; align-items: center; margin: 0.4rem 0; }",
    ".sd-field { display: inline-flex; gap: 0.3rem; align-items: center; font-size: 0.9em; }",
    ".sd-slider { flex: 1 1 8rem; min-width: 6rem; }",
    ".sd-step-label { font-weight: 600; font-variant-numeric: tabular-nums; }",
    ".sd-banner { color: #b00020; font-weight: 600; }",
    ".sd-config, .sd-note, .sd-stats, .sd-toy-summary, .sd-legend, .sd-toy-note { font-size: 0.88em; margin: 0.3rem 0; }",
    ".sd-note { min-height: 2.6em; }",
    ".sd-legend { display: flex; flex-wrap: wrap; gap: 0.3rem 0.9rem; }",
    ".sd-legend-item { display: inline-flex; gap: 0.3rem; align-items: center; }",
    ".sd-swatch { display: inline-block; width: 1.1rem; height: 0.9rem; border-radius: 3px; border: 1px solid #888; }",
    ".sd-reqs { max-width: 100%; overflow-x: auto; }",
    "table.sd-table, table.sd-toy-table, table.sd-result-table { border-collapse: collapse; font-size: 0.82em; margin: 0.3rem 0; }",
    "table.sd-table { width: 100%; }",
    ".sd-sim th, .sd-sim td { border: 1px solid var(--color-background-border, #ccc); padding: 2px 6px; vertical-align: top; }",
    ".sd-sim th { text-align: left; }",
    "td.sd-sofar { font-family: var(--font-stack--monospace, monospace); white-space: pre-wrap; overflow-wrap: anywhere; max-width: 22rem; }",
    ".sd-prev { opacity: 0.6; }",
    ".sd-chips { display: flex; flex-wrap: wrap; gap: 3px; }",
    ".sd-chip { display: inline-block; font-family: var(--font-stack--monospace, monospace); white-space: pre; padding: 0 4px;",
    "  border: 1px solid #888; border-radius: 3px; line-height: 1.5; }",
    ".sd-chip .sd-mark { font-family: var(--font-stack, sans-serif); font-weight: 700; margin-right: 2px; }",
    ".sd-accepted { background: rgba(46, 125, 50, 0.22); border-color: #2e7d32; }",
    ".sd-rejected { background: rgba(198, 40, 40, 0.18); border-color: #c62828; }",
    ".sd-rejected .sd-text { text-decoration: line-through; text-decoration-thickness: 2px; }",
    ".sd-unchecked { opacity: 0.55; border-style: dashed; }", ".sd-unchecked .sd-text { text-decoration: line-through; }",
    ".sd-dropped { opacity: 0.55; border-style: dotted; }",
    ".sd-correction { background: rgba(21, 101, 192, 0.2); border-color: #1565c0; border-width: 2px; }",
    ".sd-bonus { background: rgba(236, 201, 75, 0.4); border-color: #b7791f; border-width: 2px; }",
    ".sd-plain { background: rgba(128, 128, 128, 0.15); }",
    ".sd-verdict { font-size: 0.95em; white-space: nowrap; }",
    ".sd-toy-table input[type=range] { width: 7rem; }",
    ".sd-num { text-align: right; font-variant-numeric: tabular-nums; }",
    ".sd-trials { width: 6.5rem; } .sd-seed { width: 5rem; }",
    ".sd-hist { width: 100%; max-width: 44rem; height: auto; display: block; margin: 0.3rem 0; }",
    ".sd-hist text { fill: var(--color-foreground-primary, #222); font-size: 12px; }",
    ".sd-ok { color: #2e7d32; font-weight: 600; } .sd-bad { color: #c62828; font-weight: 600; }"
  ].join("\n");
  var MARKS = {accepted: "\u2713", rejected: "\u2717", unchecked: "\u2013", dropped: "\u2026",
               correction: "\u21ba", bonus: "\u2605", plain: ""};
  var WORDS = {accepted: "accepted draft", rejected: "rejected draft",
               unchecked: "draft after a rejection, thrown away",
               dropped: "accepted draft after the request ended, dropped",
               correction: "correction: the target's token at the rejected position",
               bonus: "bonus: the target's token after k accepted drafts",
               plain: "a token from the target without drafts"};
  var SVG = "http://www.w3.org/2000/svg";

  // ---------------------------------------------------------------------------------------------
  // Part 1: the replay
  // ---------------------------------------------------------------------------------------------

  // A row's tokens with their status: [[token, status]], drafts first, then the final token.
  function statuses(row) {
    var out = [];
    if (row.kind !== "verify") {
      row.emitted.forEach(function (t) { out.push([t, "plain"]); });
      return out;
    }
    var a = row.accepted, e = row.emitted;
    row.drafts.forEach(function (t, j) {
      if (j < a) out.push([t, j < e.length ? "accepted" : "dropped"]);
      else if (j === a) out.push([t, "rejected"]);
      else out.push([t, "unchecked"]);
    });
    if (e.length === a + 1) out.push([e[a], a < row.drafts.length ? "correction" : "bonus"]);
    return out;
  }

  // SpecDecodingStats recomputed from the steps (code/s15_speculative.py's rules).
  function recount(run, upTo) {
    var st = {num_drafts: 0, num_draft_tokens: 0, num_accepted_tokens: 0,
              num_accepted_tokens_per_pos: [], num_offered_per_pos: [],
              num_request_forwards: 0, num_emitted_tokens: 0};
    run.steps.forEach(function (step, s) {
      if (upTo !== undefined && s > upTo) return;
      step.rows.forEach(function (row) {
        if (row.kind === "verify") {
          var k = row.drafts.length;
          st.num_drafts += 1;
          st.num_draft_tokens += k;
          st.num_accepted_tokens += row.accepted;
          while (st.num_offered_per_pos.length < k) {
            st.num_offered_per_pos.push(0);
            st.num_accepted_tokens_per_pos.push(0);
          }
          for (var j = 0; j < k; j++) {
            st.num_offered_per_pos[j] += 1;
            st.num_accepted_tokens_per_pos[j] += j < row.accepted ? 1 : 0;
          }
        }
        if (row.emitted.length) {
          st.num_request_forwards += 1;
          st.num_emitted_tokens += row.emitted.length;
        }
      });
    });
    st.acceptance_rate = st.num_draft_tokens ? st.num_accepted_tokens / st.num_draft_tokens : 0;
    st.acceptance_per_position = st.num_accepted_tokens_per_pos.map(function (a, j) {
      return st.num_offered_per_pos[j] ? a / st.num_offered_per_pos[j] : 0; });
    st.tokens_per_forward = st.num_request_forwards ? st.num_emitted_tokens / st.num_request_forwards : 0;
    st.forwards_saved = st.num_emitted_tokens - st.num_request_forwards;
    return st;
  }

  function checkRun(run) {
    var problems = [], made = {};
    run.requests.forEach(function (r) { made[r.id] = []; });
    run.steps.forEach(function (step) {
      step.rows.forEach(function (row) {
        var at = run.id + " step " + step.step + " request " + row.id + ": ";
        made[row.id] = made[row.id].concat(row.emitted);
        if (row.kind !== "verify") {
          if (row.emitted.length > 1) problems.push(at + "more than one token without drafts");
          return;
        }
        var a = row.accepted, e = row.emitted;
        if (a < 0 || a > row.drafts.length) problems.push(at + "accepted out of range");
        if (e.length > a + 1 || (e.length < a + 1 && !row.finished)) problems.push(at + "emitted count");
        for (var j = 0; j < Math.min(a, e.length); j++) {
          if (e[j] !== row.drafts[j]) problems.push(at + "an accepted token is not its draft");
        }
      });
    });
    run.requests.forEach(function (r) {
      if (!CourseSim.same(made[r.id], r.output_ids)) problems.push(run.id + " request " + r.id + ": output");
    });
    var got = recount(run), want = run.stats;
    ["num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
     "num_offered_per_pos", "num_request_forwards", "num_emitted_tokens", "forwards_saved"].forEach(function (f) {
      if (!CourseSim.same(got[f], want[f])) problems.push(run.id + " stats " + f);
    });
    ["acceptance_rate", "tokens_per_forward"].forEach(function (f) {
      if (Math.abs(got[f] - want[f]) > 1e-12) problems.push(run.id + " stats " + f);
    });
    return problems;
  }

  function pct(x) { return (100 * x).toFixed(1) + "%"; }

  function mountReplay(wrap, data, problems) {
    wrap.appendChild(el("h4", "sd-title", "Replay: the engine's steps, drafts verified"));
    var run = null, step = 0;
    var controls = CourseSim.stepControls("sd-", {
      choices: data.runs.map(function (r) { return r.title; }), pickLabel: "run ",
      onChoose: choose, onStep: function (s) { step = s; render(); }
    });
    wrap.appendChild(controls.row);
    var config = el("p", "sd-config");
    wrap.appendChild(config);
    var legend = el("p", "sd-legend");
    ["accepted", "rejected", "unchecked", "correction", "bonus", "dropped", "plain"].forEach(function (k) {
      var item = el("span", "sd-legend-item");
      item.dataset.kind = k;
      var sw = el("span", "sd-chip sd-" + k);
      sw.appendChild(el("span", "sd-mark", MARKS[k] || "\u00a0"));
      item.appendChild(sw);
      item.appendChild(document.createTextNode(WORDS[k]));
      legend.appendChild(item);
    });
    wrap.appendChild(legend);
    var note = el("p", "sd-note");
    note.setAttribute("aria-live", "polite");
    wrap.appendChild(note);
    var reqBox = el("div", "sd-reqs");
    wrap.appendChild(reqBox);
    var stats = el("p", "sd-stats");
    wrap.appendChild(stats);

    function piece(t) { return data.pieces[String(t)]; }

    function chip(token, status, position) {
      var c = el("span", "sd-chip sd-" + status);
      c.dataset.token = String(token);
      c.dataset.status = status;
      var words = (position === null ? "" : "draft " + (position + 1) + ", ") + WORDS[status];
      c.title = JSON.stringify(piece(token)) + " (id " + token + "): " + words;
      c.setAttribute("aria-label", c.title);
      if (MARKS[status]) c.appendChild(el("span", "sd-mark", MARKS[status]));
      c.appendChild(el("span", "sd-text", show(piece(token))));
      return c;
    }

    function summary(row) {
      if (row.kind !== "verify") return "no drafts: 1 token from the target" + (row.finished ? " (finished: " + row.finish_reason + ")" : "");
      var a = row.accepted, n = row.drafts.length, e = row.emitted.length;
      var words = a + " of " + n + " accepted";
      if (e === a + 1) words += a < n ? " + a correction" : " + a bonus";
      words += ": " + count(e, "token");
      if (row.finished) words += " (finished: " + row.finish_reason + (e < a + 1 ? ", inside the accepted run" : "") + ")";
      return words;
    }

    function render() {
      var s = run.steps[step];
      var verify = s.rows.filter(function (r) { return r.kind === "verify"; }).length;
      var made = s.rows.reduce(function (n, r) { return n + r.emitted.length; }, 0);
      note.textContent = "Step " + step + ": one forward of the target computed " + count(s.num_tokens, "position") +
        " for " + count(s.rows.length, "request") + " (" + verify + " verifying drafts) and emitted " +
        count(made, "token") + (s.rows.length ? " (" + (made / s.rows.length).toFixed(2) + " per request)." : ".");
      reqBox.textContent = "";
      var table = el("table", "sd-table"), head = el("tr");
      ["request", "text so far (this step's tokens last)", "this step: drafts, then the target's token", "outcome"].forEach(function (h) {
        head.appendChild(el("th", null, h)); });
      table.appendChild(head);
      run.requests.forEach(function (rq) {
        var tr = el("tr", "sd-req");
        tr.dataset.request = rq.id;
        var before = [];
        for (var k = 0; k < step; k++) {
          run.steps[k].rows.forEach(function (r) { if (r.id === rq.id) before = before.concat(r.emitted); });
        }
        var row = s.rows.filter(function (r) { return r.id === rq.id; })[0];
        tr.appendChild(el("td", null, rq.id + (rq.greedy ? " (greedy)" : " (T = " + rq.temperature + ", seed " + rq.seed + ")")));
        var sofar = el("td", "sd-sofar");
        sofar.appendChild(el("span", "sd-prev", show(rq.prompt.slice(-40))));
        sofar.appendChild(document.createTextNode(show(before.map(piece).join(""))));
        if (row && row.emitted.length) {
          var now = el("mark", "sd-now", show(row.emitted.map(piece).join("")));
          sofar.appendChild(now);
        }
        tr.appendChild(sofar);
        var cell = el("td", "sd-chips-cell"), box = el("div", "sd-chips");
        if (row) {
          statuses(row).forEach(function (pair, j) {
            box.appendChild(chip(pair[0], pair[1], row.kind === "verify" && j < row.drafts.length ? j : null));
          });
        }
        cell.appendChild(box);
        tr.appendChild(cell);
        var done = before.length === rq.output_ids.length;
        tr.appendChild(el("td", "sd-outcome", row ? summary(row) : (done ? "finished (" + rq.finish_reason + ")" : "not in this step")));
        if (row) {
          tr.dataset.accepted = String(row.accepted);
          tr.dataset.emitted = JSON.stringify(row.emitted);
          tr.dataset.drafts = JSON.stringify(row.drafts);
        }
        table.appendChild(tr);
      });
      reqBox.appendChild(table);
      var st = recount(run, step);
      stats.textContent = "Up to this step: " + st.num_accepted_tokens + " of " + count(st.num_draft_tokens, "draft token") +
        " accepted (" + pct(st.acceptance_rate) + "); by draft position: " +
        (st.acceptance_per_position.map(pct).join(", ") || "none yet") + "; " +
        st.tokens_per_forward.toFixed(2) + " tokens per request per target forward, " +
        count(st.forwards_saved, "forward") + " saved (" + st.num_emitted_tokens + " tokens in " +
        st.num_request_forwards + ").";
      stats.dataset.acceptance = String(st.acceptance_rate);
    }

    function choose(index) {
      run = data.runs[index];
      var how = run.speculative === "ngram" ? "n-gram prompt lookup (drafts copied from earlier in the request's own text)"
        : run.draft_model === "int4" ? "the target's int4 copy as the draft model" : "the 1-layer draft model";
      config.textContent = "The bundled model (6 layers) verifies up to k = " + run.k + " drafts per request and step from " +
        how + ". Requests a and b are greedy (the output is the target's own, token for token), c samples at temperature " +
        run.requests[2].temperature + " with seed " + run.requests[2].seed + "; at most " +
        count(run.requests[0].max_tokens, "token") + " each. " + count(run.steps.length, "step") + " for " +
        count(run.stats.num_emitted_tokens, "token") + ".";
      controls.setLast(run.steps.length - 1);
      controls.go(0);
    }

    data.runs.forEach(function (r) { Array.prototype.push.apply(problems, checkRun(r)); });
    choose(0);
  }

  // ---------------------------------------------------------------------------------------------
  // Part 2: the toy
  // ---------------------------------------------------------------------------------------------

  function mulberry32(seed) {
    var a = seed >>> 0;
    return function () {
      a = (a + 0x6D2B79F5) | 0;
      var t = Math.imul(a ^ (a >>> 15), 1 | a);
      t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  function normalise(weights) {
    var total = weights.reduce(function (s, w) { return s + w; }, 0);
    return weights.map(function (w) { return w / total; });
  }

  // s15_rejection.sample_from: the first id whose cumulative sum exceeds u x total, never an id
  // without mass.
  function cdfOf(probs) {
    var c = [], s = 0;
    probs.forEach(function (x) { s += x; c.push(s); });
    return c;
  }
  function drawFrom(cdf, u) {
    var total = cdf[cdf.length - 1], value = u * total, idx = 0, last = 0;
    for (var i = 0; i < cdf.length; i++) {
      if (cdf[i] <= value) idx += 1;
      if (cdf[i] < total) last += 1;
    }
    return Math.min(idx, last);
  }
  // s15_rejection.residual: max(p - q, 0) normalised, p itself when that has no mass.
  function residual(p, q) {
    var res = p.map(function (x, i) { return Math.max(x - q[i], 0); });
    var mass = res.reduce(function (s, x) { return s + x; }, 0);
    if (!(mass > 0)) {
      res = p.slice();
      mass = res.reduce(function (s, x) { return s + x; }, 0);
    }
    return res.map(function (x) { return x / mass; });
  }
  function alphaOf(p, q) { return p.reduce(function (s, x, i) { return s + Math.min(x, q[i]); }, 0); }
  function expectedTokens(alpha, k) { return alpha >= 1 ? k + 1 : (1 - Math.pow(alpha, k + 1)) / (1 - alpha); }
  function wrongOf(p, q, alpha) { return p.map(function (x, i) { return Math.min(x, q[i]) + (1 - alpha) * x; }); }

  // N steps of k drafts, both rules on the same uniforms.
  function simulate(p, q, k, trials, seed) {
    var rand = mulberry32(seed), v = p.length;
    var cq = cdfOf(q), cp = cdfOf(p), cr = cdfOf(residual(p, q));
    function fresh() {
      return {first: new Array(v).fill(0), all: new Array(v).fill(0), firstAccepted: 0,
              accepted: 0, tests: 0, tokens: 0};
    }
    var right = fresh(), wrong = fresh(), xs = new Array(k), us = new Array(2 * k + 1);
    for (var n = 0; n < trials; n++) {
      for (var i = 0; i < 2 * k + 1; i++) us[i] = rand();
      for (var j = 0; j < k; j++) xs[j] = drawFrom(cq, us[j]);
      var a = 0;
      while (a < k && us[k + a] * q[xs[a]] < p[xs[a]]) a += 1;
      var tests = Math.min(a + 1, k);
      var bonus = drawFrom(cp, us[2 * k]);
      var finals = a === k ? [bonus, bonus] : [drawFrom(cr, us[2 * k]), bonus];
      [right, wrong].forEach(function (r, w) {
        var emitted = xs.slice(0, a).concat([finals[w]]);
        r.first[emitted[0]] += 1;
        emitted.forEach(function (t) { r.all[t] += 1; });
        r.firstAccepted += a > 0 ? 1 : 0;
        r.accepted += a;
        r.tests += tests;
        r.tokens += emitted.length;
      });
    }
    return {right: right, wrong: wrong};
  }

  // Pearson's chi-square of the first tokens against N x p (words with p > 0; a first token
  // where p = 0 makes it infinite).
  function chiSquare(counts, p, trials) {
    var stat = 0, df = -1;
    for (var i = 0; i < p.length; i++) {
      if (p[i] > 0) {
        var e = trials * p[i];
        stat += (counts[i] - e) * (counts[i] - e) / e;
        df += 1;
      } else if (counts[i] > 0) {
        stat = Infinity;
      }
    }
    return {stat: stat, df: df};
  }

  function checkToy(toy) {
    var problems = [];
    toy.presets.forEach(function (pr) {
      var p = normalise(pr.p_weights), q = normalise(pr.q_weights), at = "toy " + pr.id + ": ";
      function close(a, b, tol) {
        return a.length === b.length && a.every(function (x, i) { return Math.abs(x - b[i]) <= tol; });
      }
      if (!close(p, pr.p, 0) || !close(q, pr.q, 0)) problems.push(at + "p or q");
      var alpha = alphaOf(p, q);
      if (Math.abs(alpha - pr.alpha) > 1e-12) problems.push(at + "alpha");
      var exp = pr.expected_tokens.map(function (_, k) { return expectedTokens(pr.alpha, k); });
      if (!close(exp, pr.expected_tokens, 1e-9)) problems.push(at + "expected tokens per step");
      if (!close(residual(p, q), pr.residual, 1e-12)) problems.push(at + "residual");
      if (!close(wrongOf(p, q, alpha), pr.wrong, 1e-12)) problems.push(at + "wrong rule's distribution");
    });
    return problems;
  }

  function fmt(x, d) { return x === Infinity ? "\u221e" : x.toFixed(d); }

  function mountToy(wrap, toy, problems) {
    Array.prototype.push.apply(problems, checkToy(toy));
    wrap.appendChild(el("h4", "sd-title", "The rule on a toy: do the emitted tokens follow p?"));
    wrap.appendChild(el("p", "sd-toy-note",
      "Six words. The target's distribution p and the draft's q (drag the weights, or pick a preset). " +
      "Each trial is one verification step of k drafts drawn from q: draft x is accepted with probability " +
      "min(1, p(x) / q(x)); at the first rejection the target's token is drawn from max(p \u2212 q, 0), " +
      "normalised; after k accepts, a bonus from p. The wrong rule draws from p again after a rejection. " +
      "Same random numbers for both."));
    var controls = el("div", "sd-toy-controls");
    wrap.appendChild(controls);
    function field(label, node) {
      var box = el("label", "sd-field");
      box.appendChild(el("span", null, label));
      box.appendChild(node);
      controls.appendChild(box);
      return node;
    }
    var presetPick = field("preset", el("select", "sd-preset"));
    toy.presets.forEach(function (pr, i) { presetPick.appendChild(el("option", {value: String(i)}, pr.title)); });
    presetPick.appendChild(el("option", {value: "custom"}, "your own weights"));
    var kPick = field("k drafts", el("select", "sd-k"));
    for (var k = 1; k <= toy.k_max; k++) kPick.appendChild(el("option", {value: String(k)}, String(k)));
    var trialsIn = field("trials N", el("input", {type: "number", "class": "sd-trials", min: "100", max: "50000", step: "100"}));
    var seedIn = field("seed", el("input", {type: "number", "class": "sd-seed", min: "0", max: "4294967295", step: "1"}));
    var wrongBox = field("show the wrong rule", el("input", {type: "checkbox", "class": "sd-show-wrong"}));
    var runBtn = el("button", {type: "button", "class": "sd-run"}, "run the trials");
    controls.appendChild(runBtn);
    kPick.value = String(toy.defaults.k);
    trialsIn.value = String(toy.defaults.trials);
    seedIn.value = String(toy.defaults.seed);
    presetPick.value = String(toy.defaults.preset);

    var weights = el("table", "sd-toy-table");
    wrap.appendChild(weights);
    var summary = el("p", "sd-toy-summary");
    wrap.appendChild(summary);
    var hist = document.createElementNS(SVG, "svg");
    hist.setAttribute("class", "sd-hist");
    hist.setAttribute("viewBox", "0 0 640 230");
    hist.setAttribute("role", "img");
    wrap.appendChild(hist);
    var histLegend = el("p", "sd-legend");
    wrap.appendChild(histLegend);
    var results = el("table", "sd-result-table");
    wrap.appendChild(results);

    var pw = toy.presets[toy.defaults.preset].p_weights.slice();
    var qw = toy.presets[toy.defaults.preset].q_weights.slice();
    var last = null;

    function buildWeights() {
      weights.textContent = "";
      var head = el("tr");
      ["word", "p weight", "q weight", "p", "q", "min(p, q)", "residual"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      weights.appendChild(head);
      toy.vocab.forEach(function (word, i) {
        var tr = el("tr", "sd-word");
        tr.appendChild(el("td", null, JSON.stringify(word)));
        [[pw, "p"], [qw, "q"]].forEach(function (pair) {
          var td = el("td");
          var slider = el("input", {type: "range", min: "0", max: "100", step: "1", "class": "sd-w sd-w-" + pair[1],
                                    "aria-label": pair[1] + " weight of " + JSON.stringify(word)});
          slider.value = String(pair[0][i]);
          slider.dataset.index = String(i);
          slider.addEventListener("input", function () {
            var w = pair[0].slice();
            w[i] = Number(slider.value);
            if (!w.some(function (x) { return x > 0; })) { slider.value = String(pair[0][i]); return; }
            pair[0][i] = w[i];
            presetPick.value = "custom";
            update();
          });
          td.appendChild(slider);
          td.appendChild(el("span", "sd-wval", " " + pair[0][i]));
          tr.appendChild(td);
        });
        ["p", "q", "min", "res"].forEach(function (c) { tr.appendChild(el("td", "sd-num sd-" + c)); });
        weights.appendChild(tr);
      });
    }

    function update() {
      var p = normalise(pw), q = normalise(qw), alpha = alphaOf(p, q), res = residual(p, q);
      var rows = weights.querySelectorAll("tr.sd-word");
      Array.prototype.forEach.call(rows, function (tr, i) {
        tr.querySelectorAll(".sd-wval")[0].textContent = " " + pw[i];
        tr.querySelectorAll(".sd-wval")[1].textContent = " " + qw[i];
        tr.querySelector(".sd-p").textContent = p[i].toFixed(3);
        tr.querySelector(".sd-q").textContent = q[i].toFixed(3);
        tr.querySelector(".sd-min").textContent = Math.min(p[i], q[i]).toFixed(3);
        tr.querySelector(".sd-res").textContent = alpha < 1 ? res[i].toFixed(3) : "\u2013";
      });
      var kk = Number(kPick.value);
      summary.textContent = "\u03b1 = \u03a3 min(p, q) = " + alpha.toFixed(4) + " (the chance a draft is accepted). With k = " +
        kk + ", a step emits on average (1 \u2212 \u03b1^(k+1)) / (1 \u2212 \u03b1) = " + expectedTokens(alpha, kk).toFixed(4) +
        " tokens; accepted / proposed drafts: " + ((expectedTokens(alpha, kk) - 1) / kk).toFixed(4) + ".";
      summary.dataset.alpha = String(alpha);
      summary.dataset.expected = String(expectedTokens(alpha, kk));
      simulateAndDraw();
    }

    function simulateAndDraw() {
      var p = normalise(pw), q = normalise(qw), kk = Number(kPick.value);
      var trials = Math.max(1, Math.min(50000, Math.floor(Number(trialsIn.value) || 0)));
      var seed = Math.max(0, Math.floor(Number(seedIn.value) || 0)) >>> 0;
      var sim = simulate(p, q, kk, trials, seed);
      last = {p: p, q: q, k: kk, trials: trials, seed: seed, sim: sim};
      draw();
      tabulate();
    }

    function draw() {
      while (hist.firstChild) hist.removeChild(hist.firstChild);
      var p = last.p, n = last.trials, v = p.length, showWrong = wrongBox.checked;
      var series = [["p", p, "sd-bar-p"], ["the rule", last.sim.right.first.map(function (c) { return c / n; }), "sd-bar-right"]];
      if (showWrong) series.push(["the wrong rule", last.sim.wrong.first.map(function (c) { return c / n; }), "sd-bar-wrong"]);
      var colours = {"sd-bar-p": "rgba(120,120,120,0.55)", "sd-bar-right": "#2e7d32", "sd-bar-wrong": "#e65100"};
      var top = 0;
      series.forEach(function (s) { s[1].forEach(function (x) { top = Math.max(top, x); }); });
      top = Math.max(0.05, Math.ceil(top * 10 + 0.5) / 10);
      var x0 = 44, y0 = 200, h = 185, groupW = (640 - x0 - 8) / v, barW = groupW * 0.8 / series.length;
      function line(x1, y1, x2, y2, colour) {
        var l = document.createElementNS(SVG, "line");
        l.setAttribute("x1", x1); l.setAttribute("y1", y1); l.setAttribute("x2", x2); l.setAttribute("y2", y2);
        l.setAttribute("stroke", colour); l.setAttribute("stroke-width", 1);
        hist.appendChild(l);
      }
      function text(x, y, s, anchor) {
        var t = document.createElementNS(SVG, "text");
        t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("text-anchor", anchor || "middle");
        t.textContent = s;
        hist.appendChild(t);
      }
      for (var g = 0; g <= 4; g++) {
        var yv = top * g / 4, yy = y0 - h * yv / top;
        line(x0, yy, 636, yy, "rgba(128,128,128,0.35)");
        text(x0 - 4, yy + 4, yv.toFixed(2), "end");
      }
      series.forEach(function (s, si) {
        s[1].forEach(function (x, i) {
          var r = document.createElementNS(SVG, "rect");
          var bx = x0 + i * groupW + groupW * 0.1 + si * barW;
          r.setAttribute("x", bx); r.setAttribute("width", barW - 1);
          r.setAttribute("y", y0 - h * x / top); r.setAttribute("height", h * x / top);
          r.setAttribute("fill", colours[s[2]]);
          r.setAttribute("class", s[2]);
          r.dataset.word = String(i);
          r.dataset.value = String(x);
          var tip = document.createElementNS(SVG, "title");
          tip.textContent = s[0] + ", " + JSON.stringify(toy.vocab[i]) + ": " + x.toFixed(4);
          r.appendChild(tip);
          hist.appendChild(r);
        });
      });
      toy.vocab.forEach(function (w, i) { text(x0 + (i + 0.5) * groupW, y0 + 18, w.trim()); });
      hist.setAttribute("aria-label", "Histogram of the first emitted token over " + n + " trials: " +
        series.map(function (s) { return s[0] + " " + s[1].map(function (x) { return x.toFixed(3); }).join(" "); }).join("; "));
      histLegend.textContent = "";
      series.forEach(function (s) {
        var item = el("span", "sd-legend-item");
        var sw = el("span", "sd-swatch");
        sw.style.background = colours[s[2]];
        item.appendChild(sw);
        item.appendChild(document.createTextNode(s[0] === "p" ? "p, the target (what the output must follow)"
          : "first emitted token, " + s[0] + " (share of " + n + " trials)"));
        histLegend.appendChild(item);
      });
    }

    function tabulate() {
      results.textContent = "";
      var head = el("tr");
      ["after a rejection, draw from", "draft 1 accepted", "accepted / proposed", "tests passed / made",
       "tokens per step", "chi-square of the first token vs p", "at 0.1%"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      results.appendChild(head);
      var alpha = alphaOf(last.p, last.q), n = last.trials, kk = last.k;
      [["right", "max(p \u2212 q, 0): the rule"], ["wrong", "p again: wrong"]].forEach(function (pair) {
        var r = last.sim[pair[0]], chi = chiSquare(r.first, last.p, n);
        var crit = chi.df >= 1 ? toy.chi2_critical_0_001[chi.df - 1] : null;
        var tr = el("tr", "sd-result sd-result-" + pair[0]);
        tr.dataset.first = JSON.stringify(r.first);
        tr.dataset.all = JSON.stringify(r.all);
        tr.dataset.firstAccepted = String(r.firstAccepted);
        tr.dataset.accepted = String(r.accepted);
        tr.dataset.tests = String(r.tests);
        tr.dataset.tokens = String(r.tokens);
        tr.dataset.chi2 = String(chi.stat);
        tr.dataset.df = String(chi.df);
        tr.dataset.trials = String(n);
        tr.dataset.k = String(kk);
        tr.dataset.seed = String(last.seed);
        tr.appendChild(el("td", null, pair[1]));
        tr.appendChild(el("td", "sd-num", pct(r.firstAccepted / n) + " (\u03b1 " + pct(alpha) + ")"));
        tr.appendChild(el("td", "sd-num", pct(r.accepted / (n * kk))));
        tr.appendChild(el("td", "sd-num", pct(r.tests ? r.accepted / r.tests : 0)));
        tr.appendChild(el("td", "sd-num", (r.tokens / n).toFixed(3) + " (expected " + expectedTokens(alpha, kk).toFixed(3) + ")"));
        tr.appendChild(el("td", "sd-num", fmt(chi.stat, 1) + " (df " + chi.df + ")"));
        var verdict = el("td", "sd-verdict");
        if (crit === null) verdict.textContent = "one word: nothing to test";
        else if (chi.stat > crit) verdict.appendChild(el("span", "sd-bad", "\u2717 not p (> " + crit + ")"));
        else verdict.appendChild(el("span", "sd-ok", "\u2713 consistent with p (\u2264 " + crit + ")"));
        tr.appendChild(verdict);
        results.appendChild(tr);
      });
    }

    presetPick.addEventListener("change", function () {
      if (presetPick.value === "custom") return;
      var pr = toy.presets[Number(presetPick.value)];
      pw = pr.p_weights.slice();
      qw = pr.q_weights.slice();
      buildWeights();
      update();
    });
    kPick.addEventListener("change", update);
    runBtn.addEventListener("click", simulateAndDraw);
    trialsIn.addEventListener("change", simulateAndDraw);
    seedIn.addEventListener("change", simulateAndDraw);
    wrongBox.addEventListener("change", draw);
    buildWeights();
    update();
  }

  function mount(root, data) {
    if (!document.getElementById("sd-style")) {
      var style = el("style", {id: "sd-style"});
      style.textContent = STYLE;
      document.head.appendChild(style);
    }
    var wrap = el("div", "sd-sim");
    root.appendChild(wrap);
    var banner = el("p", "sd-banner");
    banner.hidden = true;
    wrap.appendChild(banner);
    var problems = [];
    mountReplay(wrap, data, problems);
    mountToy(wrap, data.toy, problems);
    CourseSim.report(banner, "speculative-decoding",
                     "The page disagrees with the engine's run or with code/s15_rejection.py: ", problems, 5);
  }

  CourseSim.register("speculative-decoding", mount);
})();
