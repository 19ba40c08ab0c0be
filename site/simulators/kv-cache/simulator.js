/* S05 "Try it": a generation with the KV cache on or off, pass by pass, as counted work.
 *
 * Everything shown is computed here, in exact integer arithmetic (BigInt: the totals of a long
 * uncached run pass 2^53), from the model's shape alone. The formulas are transcriptions of the
 * chapter's closed forms:
 *   - stepWork is S05's `step_work`: per token per layer C (H + 2 Hkv) D + H D C + 3 C I (2 C I
 *     for GPT-2) weight multiply-adds, C V per LM-head row, 2 H D per query-key pair per layer,
 *     and 2 Hkv D values of K and V read per position per layer; one multiply-add is 2 FLOPs;
 *   - passWork is S05's `generation_work`: without a cache pass i runs all n = p + i tokens and
 *     the head on n rows; with one, pass 0 is the prefill (p tokens, 1 head row) and every later
 *     pass a decode (1 token against n keys);
 *   - kvBytes is S05's `kv_cache_bytes`: 2 L Hkv D x tokens x bytes per value;
 *   - weightParts is S03's `cost_breakdown` without attention: every matrix, bias and norm read
 *     once per pass, plus one embedding row per token fed (two for GPT-2);
 *   - the number of passes is S01's stop rule for a cache of max_position_embeddings positions:
 *     min(new tokens, context - prompt), since the last sampled token is never run.
 * export.py (beside this file) gives the shapes, the Python values for a grid of settings
 * (tests/test_s05_simulator_browser.py checks the page against them) and the work S05's
 * `count_work` counted on the bundled model, which the page recomputes on load.
 */
(function () {
  "use strict";

  var KEYS = [
    ["fed", "tokens fed through the weights (T)", "tokens"],
    ["context", "context n: positions 0 … n − 1", ""],
    ["kv_computed", "K/V positions computed", ""],
    ["kv_written", "K/V positions written to the cache", ""],
    ["kv_read", "K/V positions read by attention", ""],
    ["pairs", "query-key pairs (T × n, per head and layer)", ""],
    ["head_rows", "LM-head rows", ""],
    ["weight_flops", "weight matmul FLOPs", "flop"],
    ["attention_flops", "attention matmul FLOPs (q kᵀ, p v)", "flop"],
    ["flops", "all matmul FLOPs", "flop"],
    ["weight_bytes", "weight bytes read", "byte"],
    ["kv_bytes_read", "K/V bytes read", "byte"],
    ["kv_bytes_written", "K/V bytes written", "byte"],
    ["cache_used", "cache memory in use after the pass", "byte"]
  ];
  var CUMULATIVE = ["fed", "kv_computed", "kv_written", "pairs", "weight_flops", "attention_flops",
                    "flops", "weight_bytes", "kv_bytes_read", "kv_bytes_written"];
  var MEASURED_KEYS = ["weight_flops", "attention_flops", "kv_bytes_read"];

  var el = CourseSim.el;

  function exact(x) { return BigInt(x).toLocaleString("en-US"); }

  // A readable size next to the exact integer: 3 significant digits and the SI prefix that
  // keeps them below 1,000 (so 6,253,878,615,075,717,120 FLOPs is 6.25 EFLOP).
  var PREFIXES = ["k", "M", "G", "T", "P", "E", "Z", "Y", "R", "Q"];
  function approx(x, unit) {
    var v = Number(x);
    if (!unit || v < 1000) return "";
    var k = 0, text;
    do {
      k++;
      text = (v / Math.pow(1000, k)).toPrecision(3);
    } while (Number(text) >= 1000 && k < PREFIXES.length);
    return text + " " + PREFIXES[k - 1] + (unit === "byte" ? "B" : "FLOP");
  }

  function ratio(x) {   // one decimal, thousands separated
    return x.toLocaleString("en-US", {minimumFractionDigits: 1, maximumFractionDigits: 1});
  }

  // ---- the closed forms ---------------------------------------------------------------------

  function shape(m) {
    var B = BigInt;
    return {gpt2: m.model_type === "gpt2", L: B(m.L), C: B(m.C), H: B(m.H), Hkv: B(m.Hkv),
            D: B(m.D), I: B(m.I), V: B(m.V), M: m.max_context, raw: m};
  }

  function weightParts(s, b) {       // [bytes read once per pass, bytes per token fed]
    var m = s.raw, hd = s.H * s.D, kvd = s.Hkv * s.D;
    var projW = s.C * hd + 2n * s.C * kvd + hd * s.C;
    var projP = projW + (m.attention_bias ? hd + 2n * kvd + s.C : 0n);
    var mlpP = (s.gpt2 ? 2n : 3n) * s.C * s.I +
               (s.gpt2 ? s.I + s.C : (m.mlp_bias ? 2n * s.I + s.C : 0n));
    var normP = s.gpt2 ? 4n * s.C : 2n * s.C + (m.qk_norm ? 2n * s.D : 0n);
    var finalNorm = s.gpt2 ? 2n * s.C : s.C;
    var fixed = (s.L * (projP + mlpP + normP) + finalNorm + s.V * s.C) * b;
    return [fixed, (s.gpt2 ? 2n : 1n) * s.C * b];
  }

  function kvBytes(s, tokens, b) { return 2n * s.L * s.Hkv * s.D * tokens * b; }

  function stepWork(s, T, n, rows, b) {   // S05's step_work: [weight MACs, attention MACs, K/V bytes]
    var perTokenLayer = s.C * (s.H + 2n * s.Hkv) * s.D + s.H * s.D * s.C +
                        (s.gpt2 ? 2n : 3n) * s.C * s.I;
    return [s.L * T * perTokenLayer + rows * s.C * s.V,
            s.L * 2n * s.H * s.D * T * n,
            s.L * 2n * s.Hkv * s.D * n * b];
  }

  function passCount(s, p, N) { return Math.max(0, Math.min(N, s.M - p)); }

  // Every pass of one setting: values[i] and cumulative[i], BigInt by key.
  function series(s, b, p, N, cached) {
    var passes = passCount(s, p, N), parts = weightParts(s, b);
    var values = [], cumulative = [], run = {};
    CUMULATIVE.forEach(function (k) { run[k] = 0n; });
    for (var i = 0; i < passes; i++) {
      var n = BigInt(p + i);
      var fed = cached ? (i === 0 ? BigInt(p) : 1n) : n;
      var rows = cached ? 1n : n;
      var w = stepWork(s, fed, n, rows, b);
      var v = {fed: fed, context: n, kv_computed: fed, kv_written: cached ? fed : 0n, kv_read: n,
               pairs: fed * n, head_rows: rows, weight_flops: 2n * w[0],
               attention_flops: 2n * w[1], flops: 2n * (w[0] + w[1]),
               weight_bytes: parts[0] + fed * parts[1], kv_bytes_read: w[2],
               kv_bytes_written: cached ? kvBytes(s, fed, b) : 0n,
               cache_used: cached ? kvBytes(s, n, b) : 0n};
      var c = {};
      CUMULATIVE.forEach(function (k) { run[k] += v[k]; c[k] = run[k]; });
      values.push(v);
      cumulative.push(c);
    }
    return {passes: passes, values: values, cumulative: cumulative};
  }

  function crossover(s, b) {   // smallest context whose decode reads more K/V than weight bytes
    return weightParts(s, b).reduce(function (a, x) { return a + x; }) / kvBytes(s, 1n, b) + 1n;
  }

  function texts(obj) {
    var out = {};
    Object.keys(obj).forEach(function (k) { out[k] = obj[k].toString(); });
    return out;
  }

  // ---- the page -----------------------------------------------------------------------------

  function mount(root, data) {
    root.classList.add("kv-sim");
    var byId = {};
    data.configs.forEach(function (m) { byId[m.id] = shape(m); });
    var measured = data.measured;
    var first = data.configs[0];
    var state = {config: first.id, dtype: 4, prompt: 16, tokens: 32, cached: true, pass: 0};
    if (measured) {
      state.config = measured.config; state.dtype = measured.dtype_bytes;
      state.prompt = measured.prompt_len; state.tokens = measured.new_tokens;
    }
    var memo = {key: null, value: null};

    function getSeries(cfg, b, p, N, cached) {
      var key = [cfg, b, p, N, cached].join("|");
      if (memo.key !== key) memo = {key: key, value: series(byId[cfg], BigInt(b), p, N, cached)};
      return memo.value;
    }

    // Controls.
    function field(label, control) {
      var f = el("label", "kv-field");
      f.appendChild(el("span", "kv-label", label));
      f.appendChild(control);
      return f;
    }
    var modelSel = el("select", "kv-model");
    data.configs.forEach(function (m) {
      var o = el("option", "", m.name);
      o.value = m.id;
      modelSel.appendChild(o);
    });
    var dtypeSel = el("select", "kv-dtype");
    [[4, "float32 (4 bytes)"], [2, "bfloat16 (2 bytes)"]].forEach(function (d) {
      var o = el("option", "", d[1]);
      o.value = String(d[0]);
      dtypeSel.appendChild(o);
    });
    var promptIn = el("input", "kv-prompt");
    promptIn.type = "number"; promptIn.min = "1"; promptIn.step = "1";
    var tokensIn = el("input", "kv-tokens");
    tokensIn.type = "number"; tokensIn.min = "1"; tokensIn.step = "1";
    var cacheBox = el("input", "kv-cache-toggle");
    cacheBox.type = "checkbox";
    var cacheLabel = el("label", "kv-field kv-check");
    cacheLabel.appendChild(cacheBox);
    cacheLabel.appendChild(document.createTextNode(" KV cache on"));

    var controls = el("div", "kv-row");
    controls.appendChild(field("model", modelSel));
    controls.appendChild(field("dtype", dtypeSel));
    controls.appendChild(field("prompt tokens p", promptIn));
    controls.appendChild(field("new tokens", tokensIn));
    controls.appendChild(cacheLabel);
    root.appendChild(controls);

    var shapeNote = el("p", "kv-note kv-shape");
    var status = el("p", "kv-status");
    root.appendChild(shapeNote);
    root.appendChild(status);

    var nav = el("div", "kv-row kv-nav");
    var buttons = {};
    [["first", "« first"], ["prev", "◀ pass"], ["next", "pass ▶"], ["last", "last »"]]
      .forEach(function (b) {
        buttons[b[0]] = el("button", "kv-" + b[0], b[1]);
        buttons[b[0]].type = "button";
        nav.appendChild(buttons[b[0]]);
      });
    var slider = el("input", "kv-slider");
    slider.type = "range"; slider.min = "0"; slider.step = "1";
    slider.setAttribute("aria-label", "pass");
    nav.appendChild(slider);
    var passLabel = el("span", "kv-pass-label");
    nav.appendChild(passLabel);
    root.appendChild(nav);

    var table = el("table", "kv-table");
    root.appendChild(table);
    var bars = el("div", "kv-bars");
    root.appendChild(bars);
    var compare = el("p", "kv-note kv-compare");
    root.appendChild(compare);
    var crossNote = el("p", "kv-note kv-crossover");
    root.appendChild(crossNote);
    var check = el("p", "kv-note kv-check-note");
    root.appendChild(check);

    function readInputs() {
      var s = byId[state.config];
      var p = Number(promptIn.value), N = Number(tokensIn.value);
      if (!Number.isInteger(p) || p < 1 || p > s.M) {
        return "prompt tokens must be an integer from 1 to the context, " + s.M.toLocaleString("en-US") +
               " (a longer prompt is refused, never truncated)";
      }
      if (!Number.isInteger(N) || N < 1 || N > 1000000) {
        return "new tokens must be an integer from 1 to 1,000,000";
      }
      state.prompt = p; state.tokens = N;
      return null;
    }

    function cell(tr, value, unit, key) {
      var td = el("td", "kv-num");
      if (value === null) { td.textContent = "—"; tr.appendChild(td); return; }
      var span = el("span", "kv-exact", exact(value));
      if (key) td.setAttribute("data-k", key);
      td.appendChild(span);
      var a = approx(value, unit);
      if (a) td.appendChild(el("span", "kv-approx", " (" + a + ")"));
      tr.appendChild(td);
    }

    function isMeasured() {
      return measured && state.config === measured.config && state.dtype === measured.dtype_bytes &&
             state.prompt === measured.prompt_len && state.tokens === measured.new_tokens;
    }

    function render() {
      var s = byId[state.config], m = s.raw, b = BigInt(state.dtype);
      var problem = readInputs();
      shapeNote.textContent = m.name + ": " + m.model_type + ", L = " + m.L + ", C = " + m.C +
        ", H = " + m.H + " query heads, Hkv = " + m.Hkv + " key/value heads, D = " + m.D +
        ", I = " + m.I + ", V = " + m.V.toLocaleString("en-US") + ", " +
        m.parameters.toLocaleString("en-US") + " parameters; context (the cache's size) " +
        m.max_context.toLocaleString("en-US") + " positions. K and V of one position: " +
        exact(kvBytes(s, 1n, b)) + " bytes; the whole cache reserved: " +
        exact(kvBytes(s, BigInt(s.M), b)) + " bytes (" + approx(kvBytes(s, BigInt(s.M), b), "byte") + ").";
      // Every result below belongs to one valid setting: cleared first, and navigation stays
      // off until a setting with passes is shown.
      table.textContent = ""; bars.textContent = ""; compare.textContent = "";
      crossNote.textContent = ""; passLabel.textContent = "";
      slider.disabled = true; slider.max = "0"; slider.value = "0";
      Object.keys(buttons).forEach(function (k) { buttons[k].disabled = true; });
      if (problem) {
        status.textContent = problem;
        status.className = "kv-status course-error";
        root.setAttribute("data-passes", "");
        return;
      }
      status.className = "kv-status";
      var sr = getSeries(state.config, state.dtype, state.prompt, state.tokens, state.cached);
      var P = sr.passes;
      root.setAttribute("data-passes", String(P));
      var full = P < state.tokens ? " The context fills first: after " + P.toLocaleString("en-US") +
        " of " + state.tokens.toLocaleString("en-US") + " tokens the request ends with " +
        "finish_reason \"length\" (the last token is never run)." : "";
      if (P === 0) {
        status.textContent = "The prompt fills the whole context: the request ends at once " +
          "with finish_reason \"length\", no pass is run.";
        return;
      }
      var prefill = "Cache on: pass 1 is the prefill of " + state.prompt.toLocaleString("en-US") +
        " tokens";
      status.textContent = (state.cached ?
        (P === 1 ? prefill + ", and the only pass: no decode step runs." :
         prefill + ", then " + (P - 1).toLocaleString("en-US") + " decode step" +
         (P === 2 ? "" : "s") + " of one token.") :
        (P === 1 ? "Cache off (the S01 loop): the one pass runs the whole context." :
         "Cache off (the S01 loop): every one of the " + P.toLocaleString("en-US") +
         " passes runs the whole context.")) + full;
      if (state.pass > P - 1) state.pass = P - 1;
      var i = state.pass;
      slider.disabled = false;
      slider.max = String(P - 1); slider.value = String(i);
      passLabel.textContent = "pass " + (i + 1).toLocaleString("en-US") + " of " +
        P.toLocaleString("en-US") + (state.cached ? (i === 0 ? " (prefill)" : " (decode)") : "");
      buttons.first.disabled = buttons.prev.disabled = i === 0;
      buttons.next.disabled = buttons.last.disabled = i === P - 1;

      var v = sr.values[i], c = sr.cumulative[i];
      var counted = isMeasured() ? measured.runs[state.cached ? "on" : "off"][i] : null;
      var head = el("tr");
      ["", "this pass", "passes 1 to " + (i + 1).toLocaleString("en-US")].forEach(function (h) {
        head.appendChild(el("th", "", h));
      });
      if (counted) head.appendChild(el("th", "", "counted by count_work"));
      table.appendChild(head);
      KEYS.forEach(function (k) {
        var tr = el("tr");
        tr.setAttribute("data-row", k[0]);
        tr.appendChild(el("th", "kv-name", k[1]));
        cell(tr, v[k[0]], k[2], "pass");
        cell(tr, CUMULATIVE.indexOf(k[0]) >= 0 ? c[k[0]] : null, k[2], "total");
        if (counted) {
          var j = MEASURED_KEYS.indexOf(k[0]);
          cell(tr, j >= 0 ? BigInt(counted[j]) : null, k[2], "counted");
        }
        table.appendChild(tr);
      });

      var wb = v.weight_bytes, kb = v.kv_bytes_read, top = wb > kb ? wb : kb;
      bars.appendChild(el("div", "kv-h", "Bytes read by this pass"));
      [["weights", wb, "kv-bar-w"], ["K/V", kb, "kv-bar-kv"]].forEach(function (x) {
        var row = el("div", "kv-bar-row");
        row.appendChild(el("span", "kv-bar-label", x[0]));
        var track = el("span", "kv-bar-track"), fill = el("span", "kv-bar " + x[2]);
        fill.style.width = (100 * Number(x[1]) / Number(top)).toFixed(1) + "%";
        track.appendChild(fill);
        row.appendChild(track);
        row.appendChild(el("span", "kv-bar-value", approx(x[1], "byte") || exact(x[1]) + " B"));
        bars.appendChild(row);
      });
      bars.appendChild(el("p", "kv-note kv-winner", kb > wb ?
        "K/V bytes now exceed the weight bytes: the cache decides this pass's memory traffic." :
        "The weights are most of this pass's memory traffic."));

      var other = getSeries(state.config, state.dtype, state.prompt, state.tokens, !state.cached);
      var mine = c.flops, theirs = other.cumulative[i].flops;
      var off = state.cached ? theirs : mine, on = state.cached ? mine : theirs;
      compare.textContent = "Over passes 1 to " + (i + 1).toLocaleString("en-US") +
        ": without the cache " + exact(off) + " matmul FLOPs, with it " + exact(on) + " (" +
        ratio(Number(off) / Number(on)) + " times fewer); both read the same " +
        exact(c.kv_bytes_read) + " bytes of K and V.";
      memo = {key: [state.config, state.dtype, state.prompt, state.tokens, state.cached].join("|"),
              value: sr};

      var n = crossover(s, b);
      crossNote.textContent = "A decode step reads more K/V bytes than weight bytes from " +
        "context n = " + exact(n) + " on (the same in float32 and bfloat16: both halve). " +
        (n <= BigInt(s.M) ? "That is inside this model's " + s.M.toLocaleString("en-US") +
         "-position context." : "This model's context ends at " + s.M.toLocaleString("en-US") +
         ", before that.");
    }

    function setPass(i) { state.pass = i; render(); }
    buttons.first.addEventListener("click", function () { setPass(0); });
    buttons.prev.addEventListener("click", function () { setPass(Math.max(0, state.pass - 1)); });
    buttons.next.addEventListener("click", function () { setPass(state.pass + 1); });
    buttons.last.addEventListener("click", function () { setPass(Number(slider.max)); });
    slider.addEventListener("input", function () { setPass(Number(slider.value)); });
    modelSel.addEventListener("change", function () {
      state.config = modelSel.value; state.pass = 0; render();
    });
    dtypeSel.addEventListener("change", function () { state.dtype = Number(dtypeSel.value); render(); });
    promptIn.addEventListener("change", function () { state.pass = 0; render(); });
    tokensIn.addEventListener("change", function () { render(); });
    cacheBox.addEventListener("change", function () { state.cached = cacheBox.checked; render(); });

    modelSel.value = state.config; dtypeSel.value = String(state.dtype);
    promptIn.value = String(state.prompt); tokensIn.value = String(state.tokens);
    cacheBox.checked = state.cached;

    // The work count_work counted on the bundled model, recomputed from the closed forms.
    if (measured) {
      var bad = [];
      ["off", "on"].forEach(function (mode) {
        var sr = series(byId[measured.config], BigInt(measured.dtype_bytes), measured.prompt_len,
                        measured.new_tokens, mode === "on");
        measured.runs[mode].forEach(function (row, i) {
          MEASURED_KEYS.forEach(function (k, j) {
            if (!sr.values[i] || sr.values[i][k].toString() !== row[j]) bad.push([mode, i, k]);
          });
        });
      });
      if (bad.length) {
        var msg = "kv-cache simulator: the page's closed forms differ from the work count_work " +
                  "counted on the bundled model";
        console.error(msg, bad);
        root.appendChild(el("p", "course-error", msg));
      } else {
        check.textContent = "On load the page recomputed the " + (2 * measured.new_tokens) +
          " passes (" + measured.new_tokens + " with the cache, " + measured.new_tokens +
          " without) that S05's count_work counted while the bundled model generated after a " +
          measured.prompt_len + "-token prompt: every weight FLOP, attention FLOP and K/V byte " +
          "is equal. Pick that setting to see the counted column.";
      }
    }
    render();

    root.kvSim = {
      state: state, render: render,
      // The exported reference's shape, computed here: {passes, shown: [...], totals}.
      reference: function (cfg, b, p, N, cached) {
        var sr = series(byId[cfg], BigInt(b), p, N, cached);
        var P = sr.passes, wanted = [0, 1, Math.floor(P / 2), P - 1].filter(function (i, k, a) {
          return i >= 0 && i < P && a.indexOf(i) === k;
        }).sort(function (x, y) { return x - y; });
        var totals = {};
        CUMULATIVE.forEach(function (k) { totals[k] = P ? sr.cumulative[P - 1][k].toString() : "0"; });
        return {passes: P, totals: totals, shown: wanted.map(function (i) {
          return {pass: i, values: texts(sr.values[i]), cumulative: texts(sr.cumulative[i])};
        })};
      },
      crossover: function (cfg, b) { return crossover(byId[cfg], BigInt(b)).toString(); }
    };
  }

  window.CourseSim.register("kv-cache", mount);
})();
