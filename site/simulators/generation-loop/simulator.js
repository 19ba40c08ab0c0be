/* S01 "Try it": the generation loop over a bigram model, one pass per click.
 *
 * What runs here is a transcription of code/s01_generation_loop.py, not a model of it:
 *   - split/encode/decode follow WordTokenizer (same split pattern, same spacing rules),
 *   - a pass reads the logits row of the last token (BigramModel.forward(ids)[-1]),
 *   - sampleIndex is the arithmetic of `sample`: greedy argmax at temperature 0, otherwise
 *     the weights exp((logits - max) / T) (the max subtracted before dividing, so nothing
 *     overflows; a gap that the division pushes past -Infinity has weight 0; tied maxima share
 *     the probability) by inverse CDF with one uniform draw per token,
 *   - Run checks a request like GenerationParams and Engine.check_prompt, in their order and
 *     with their messages,
 *   - the stop rules and their order are `stop_rule`'s: eos, then max_tokens, then a full
 *     context (finish_reason "stop" for the first, "length" for the others).
 * The model (V = 512 bigram logits, float32), the uniforms of np.random.default_rng(seed) and
 * reference traces come from export.py beside this file at build time, so for a seed and a
 * temperature the page picks the tokens the Python engine picks. On load the page replays the
 * exported reference traces and says so if it disagrees with them.
 */
(function () {
  "use strict";

  // Python's str.isspace() set, so the split matches `re` on str patterns character for character.
  var WS = "\\t\\n\\x0b\\x0c\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029" +
           "\\u202f\\u205f\\u3000";
  var TOKEN_RE = new RegExp("[A-Za-z0-9]+(?:'[A-Za-z0-9]+)*|\\n|[^" + WS + "A-Za-z0-9]", "gu");
  var NO_SPACE_BEFORE = ".,;:!?)]'-";
  var NO_SPACE_AFTER = "([-";
  var TOP_K = 10;

  function Model(data) {
    this.vocab = data.vocab;
    this.V = data.vocab.length;
    this.eos = data.eos_id;
    this.unk = data.unk_id;
    this.rows = data.rows;
    this.cache = {};
    this.toId = new Map();
    for (var i = 0; i < this.V; i++) this.toId.set(this.vocab[i], i);
  }

  Model.prototype.row = function (r) {         // float32 logits of the token after r, as doubles
    if (this.cache[r]) return this.cache[r];
    var spec = this.rows[r];
    var out = new Float64Array(this.V).fill(Math.fround(Number(spec.d)));
    spec.ninf.forEach(function (c) { out[c] = -Infinity; });
    spec.v.forEach(function (group) {
      var value = Math.fround(Number(group[0]));
      group[1].forEach(function (c) { out[c] = value; });
    });
    this.cache[r] = out;
    return out;
  };

  Model.prototype.split = function (text) { return text.match(TOKEN_RE) || []; };

  Model.prototype.encode = function (text) {
    var self = this;
    return this.split(text).map(function (piece) {
      var id = self.toId.get(piece);
      return (id === undefined || id < 2) ? self.unk : id;
    });
  };

  Model.prototype.decode = function (ids) {
    var out = [];
    for (var k = 0; k < ids.length; k++) {
      if (ids[k] === this.eos) continue;
      var piece = this.vocab[ids[k]];
      if (out.length && out[out.length - 1] !== "\n" && piece !== "\n" &&
          NO_SPACE_BEFORE.indexOf(piece[0]) < 0 &&
          NO_SPACE_AFTER.indexOf(out[out.length - 1].slice(-1)) < 0) {
        out.push(" ");
      }
      out.push(piece);
    }
    return out.join("");
  };

  function rowMax(row) {
    var max = -Infinity;
    for (var i = 0; i < row.length; i++) if (row[i] > max) max = row[i];
    return max;
  }

  /* `sample`'s weights exp((row - max) / T) for T > 0, in float64 like numpy: every exponent
   * is <= 0 (the max's is exactly 0), and a gap that overflows the division is -Infinity,
   * weight 0. */
  function weights(row, T) {
    var V = row.length, max = rowMax(row), w = new Float64Array(V);
    for (var i = 0; i < V; i++) w[i] = Math.exp((row[i] - max) / T);
    return w;
  }

  /* softmax(row / T) as probabilities (T > 0): `sample`'s weights over their sum. */
  function probs(row, T) {
    var w = weights(row, T), total = 0, i;
    for (i = 0; i < w.length; i++) total += w[i];
    for (i = 0; i < w.length; i++) w[i] /= total;
    return w;
  }

  function argmax(row) {                         // lowest id on a tie, like np.argmax
    var best = 0;
    for (var i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;
    return best;
  }

  /* `sample` for T > 0: the first id whose cumulative weight exceeds u * total. */
  function sampleIndex(row, T, u) {
    var V = row.length, w = weights(row, T), i;
    var cdf = new Float64Array(V), acc = 0;     // np.cumsum: a running sum, left to right
    for (i = 0; i < V; i++) { acc += w[i]; cdf[i] = acc; }
    var target = u * cdf[V - 1];
    var lo = 0, hi = V;                          // np.searchsorted(cdf, target, side="right")
    while (lo < hi) { var mid = (lo + hi) >> 1; if (cdf[mid] <= target) lo = mid + 1; else hi = mid; }
    return Math.min(lo, V - 1);
  }

  function finishOf(rule) {                       // the rule that fired -> finish_reason
    return rule === "eos" ? "stop" : "length";
  }

  function checkTemperature(T, text) {            // `check_temperature`; text: what was typed
    if (typeof T !== "number" || !isFinite(T) || T < 0) {
      throw new Error("temperature must be a finite number >= 0 (got " + text + ")");
    }
  }

  /* One request: GenerationParams' checks, then Engine.check_prompt (same order, same
   * messages) + the state of the Sequence between passes. T is checked here as the params
   * check it; each step takes its own temperature, so the page can change it between passes. */
  function Run(model, uniforms, prompt, maxTokens, maxContext, seed, T, tText) {
    if (!Number.isInteger(maxTokens) || maxTokens < 1) {
      throw new Error("max_tokens must be an integer >= 1 (got " + maxTokens + ")");
    }
    checkTemperature(T, tText === undefined ? String(T) : tText);
    if (typeof prompt !== "string" || !prompt) {
      throw new Error("prompt must be a non-empty string or a non-empty list of token ids (got " +
                      (typeof prompt === "string" ? "''" : "a " + typeof prompt) + ")");
    }
    this.model = model;
    this.ids = model.encode(prompt);
    if (this.ids.length === 0) {                  // "   " has no token; "\n" is one
      throw new Error("prompt must contain at least one token (the tokenizer encodes it to none)");
    }
    if (this.ids.length > maxContext) {
      throw new Error("prompt is " + this.ids.length + " tokens but max_context is " + maxContext +
                      "; shorten the prompt (it is never truncated silently)");
    }
    this.promptTokens = this.ids.length;
    this.maxTokens = maxTokens;
    this.maxContext = maxContext;
    this.uniforms = uniforms;
    this.seed = seed;
    this.draws = 0;                               // rng.random() calls so far
    this.out = [];
    this.contextLens = [];
    this.temps = [];
    this.last = null;                             // what the latest pass did
    this.stop = null;
    this.checkContext();
  }

  Run.prototype.checkContext = function () {
    if (this.stop === null && this.ids.length >= this.maxContext) this.stop = "context_full";
  };

  Run.prototype.step = function (T) {
    if (this.stop !== null) return false;
    var n = this.ids.length;
    var row = this.model.row(this.ids[n - 1]);   // forward(ids)[-1]: only the last row matters
    var next, u = null;
    if (T === 0) {
      next = argmax(row);
    } else {
      if (this.draws >= this.uniforms.length) throw new Error("ran out of exported uniforms");
      u = this.uniforms[this.draws++];
      next = sampleIndex(row, T, u);
    }
    this.contextLens.push(n);
    this.temps.push(T);
    this.ids.push(next);
    this.out.push(next);
    var p = T === 0 ? null : probs(row, T)[next];
    this.last = {n: n, token: next, u: u, p: p, T: T};
    if (next === this.model.eos) this.stop = "eos";
    else if (this.out.length >= this.maxTokens) this.stop = "max_tokens";
    this.checkContext();
    return true;
  };

  Run.prototype.text = function () { return this.model.decode(this.out); };

  function fmtInt(x) { return x.toLocaleString("en-US"); }

  function percent(p) {                          // 12.3%, 0.42%, 0.0031%: small ones stay visible
    var v = 100 * p;
    return (v >= 10 ? v.toFixed(1) : Number(v.toPrecision(2)).toString()) + "%";
  }

  function shown(piece) {
    if (piece === "\n") return "\u21b5";
    return piece;
  }

  function pyString(s) {                          // a Python literal for the snippet
    return JSON.stringify(s);
  }

  var make = CourseSim.el;

  function mount(root, data) {
    var model = new Model(data);

    // Re-run the engine's reference traces (exported at build time) before showing anything.
    var mismatches = [];
    data.traces.forEach(function (t) {
      var run = new Run(model, data.uniforms[String(t.seed)], t.prompt, t.max_tokens,
                        data.max_context, t.seed, t.temperature);
      while (run.step(t.temperature)) { /* run to the end */ }
      var same = JSON.stringify(run.out) === JSON.stringify(t.token_ids) &&
                 finishOf(run.stop) === t.finish_reason &&
                 JSON.stringify(run.contextLens) === JSON.stringify(t.context_lens);
      if (!same) mismatches.push(t);
    });

    var ui = make("div", "gl-sim");
    root.appendChild(ui);
    if (mismatches.length) {
      var msg = "generation-loop simulator disagrees with the Python engine on " +
                mismatches.length + " reference run(s)";
      console.error(msg, mismatches);
      ui.appendChild(make("p", "course-error", msg));
    }

    // --- controls ------------------------------------------------------------------------
    var controls = make("div", "gl-controls");
    var promptBox = make("textarea", "gl-prompt");
    promptBox.rows = 2;
    promptBox.value = data.prompts[0];
    promptBox.setAttribute("aria-label", "Prompt");
    var presets = make("select", "gl-presets");
    presets.setAttribute("aria-label", "Example prompts");
    data.prompts.forEach(function (p, i) {
      var o = make("option", null, p.replace(/\n/g, " \u21b5 "));
      o.value = String(i);
      presets.appendChild(o);
    });

    function field(label, input) {
      var wrap = make("label", "gl-field");
      wrap.appendChild(make("span", "gl-label", label));
      wrap.appendChild(input);
      return wrap;
    }
    function numberInput(cls, min, max, step, value) {
      var i = make("input", cls);
      i.type = "number"; i.min = min; i.max = max; i.step = step; i.value = value;
      return i;
    }
    var tRange = make("input", "gl-temperature-range");
    tRange.type = "range"; tRange.min = "0"; tRange.max = "2"; tRange.step = "0.05";
    tRange.value = "0.8";
    tRange.setAttribute("aria-label", "Temperature");
    var tNumber = numberInput("gl-temperature", "0", "5", "0.05", "0.8");
    var seedSel = make("select", "gl-seed");
    data.seeds.forEach(function (s) {
      var o = make("option", null, String(s)); o.value = String(s); seedSel.appendChild(o);
    });
    var maxTok = numberInput("gl-max-tokens", "1", String(data.max_context - 1), "1", "40");
    var maxCtx = numberInput("gl-max-context", "1", String(data.max_context), "1",
                             String(data.max_context));

    var row1 = make("div", "gl-row");
    var promptField = field("Prompt", promptBox);
    promptField.className += " gl-field-prompt";
    row1.appendChild(promptField);
    row1.appendChild(field("Examples", presets));
    var row2 = make("div", "gl-row");
    var tWrap = make("span", "gl-temp-wrap");
    tWrap.appendChild(tRange); tWrap.appendChild(tNumber);
    row2.appendChild(field("Temperature", tWrap));
    row2.appendChild(field("Seed", seedSel));
    row2.appendChild(field("max_tokens", maxTok));
    row2.appendChild(field("max_context", maxCtx));
    var buttons = make("div", "gl-row gl-buttons");
    var stepBtn = make("button", "gl-step", "Step one pass");
    var runBtn = make("button", "gl-run", "Run to the end");
    var resetBtn = make("button", "gl-reset", "Reset");
    [stepBtn, runBtn, resetBtn].forEach(function (b) { b.type = "button"; buttons.appendChild(b); });
    controls.appendChild(row1); controls.appendChild(row2); controls.appendChild(buttons);
    ui.appendChild(controls);

    // --- views ---------------------------------------------------------------------------
    var status = make("p", "gl-status");
    status.setAttribute("aria-live", "polite");
    var error = make("p", "course-error gl-error");
    error.hidden = true;
    var ctxTitle = make("h4", "gl-h", "Context (what the model reads on the next pass)");
    var context = make("div", "gl-context");
    var completion = make("pre", "gl-completion");
    var distTitle = make("h4", "gl-h", "Next-token distribution");
    var dist = make("div", "gl-dist");
    var lastPick = make("p", "gl-last");
    var costTitle = make("h4", "gl-h", "Work per pass, in token pairs (one attention score each)");
    var cost = make("div", "gl-cost");
    var costLegend = make("p", "gl-cost-legend");
    var snippet = make("pre", "gl-snippet");
    [status, lastPick, error, ctxTitle, context, completion, distTitle, dist, costTitle, cost,
     costLegend, snippet].forEach(function (n) { ui.appendChild(n); });

    var run = null, timer = null;

    function temperature() {
      var T = Number(tNumber.value);
      checkTemperature(T, tNumber.value);
      return T;
    }

    function reset() {
      stop();
      error.hidden = true;
      try {
        var mt = Number(maxTok.value), mc = Number(maxCtx.value);
        if (!Number.isInteger(mc) || mc < 1 || mc > data.max_context) {
          throw new Error("max_context must be an integer in [1, " + data.max_context + "] here");
        }
        run = new Run(model, data.uniforms[seedSel.value], promptBox.value, mt, mc,
                      Number(seedSel.value), Number(tNumber.value), tNumber.value);
      } catch (err) {
        run = null;
        error.textContent = err.message;
        error.hidden = false;
      }
      render();
    }

    function step() {
      if (!run) return false;
      var moved;
      try { moved = run.step(temperature()); } catch (err) {
        error.textContent = err.message; error.hidden = false; stop(); return false;
      }
      render();
      return moved;
    }

    function stop() {
      if (timer !== null) { clearInterval(timer); timer = null; }
      runBtn.textContent = "Run to the end";
    }

    function renderContext() {
      context.textContent = "";
      if (!run) return;
      run.ids.forEach(function (id, i) {
        var cls = "gl-tok" + (i < run.promptTokens ? " gl-tok-prompt" : " gl-tok-gen") +
                  (i === run.ids.length - 1 && i >= run.promptTokens ? " gl-tok-new" : "") +
                  (id === model.eos ? " gl-tok-eos" : "") + (id === model.unk ? " gl-tok-unk" : "");
        var chip = make("span", cls, shown(model.vocab[id]));
        chip.setAttribute("data-id", String(id));
        chip.title = "id " + id;
        context.appendChild(chip);
        if (model.vocab[id] === "\n") context.appendChild(make("br"));
      });
      completion.textContent = run.out.length ? run.text() : "";
      completion.hidden = run.out.length === 0;
    }

    function renderDist() {
      dist.textContent = "";
      if (!run || run.stop !== null) {
        distTitle.textContent = "Next-token distribution";
        if (run) dist.appendChild(make("p", "gl-note", "The loop has stopped: no next pass."));
        return;
      }
      var T;
      try { T = temperature(); } catch (err) { return; }
      var row = model.row(run.ids[run.ids.length - 1]);
      var p = probs(row, T === 0 ? 1 : T);
      var order = Array.prototype.slice.call(p).map(function (_, i) { return i; });
      order.sort(function (a, b) { return p[b] - p[a] || a - b; });
      var greedy = argmax(row);
      distTitle.textContent = T === 0
        ? "Next-token distribution (temperature 0 is greedy: the top token is taken; bars show T = 1)"
        : "Next-token distribution at temperature " + T + " (top " + TOP_K + " of " + model.V + ")";
      order.slice(0, TOP_K).forEach(function (id) {
        var line = make("div", "gl-bar-row" + (id === greedy ? " gl-argmax" : ""));
        line.setAttribute("data-id", String(id));
        line.setAttribute("data-p", String(p[id]));
        line.appendChild(make("span", "gl-bar-label", shown(model.vocab[id])));
        var track = make("span", "gl-bar-track");
        var bar = make("span", "gl-bar");
        bar.style.width = (100 * p[id] / p[order[0]]).toFixed(2) + "%";
        track.appendChild(bar);
        line.appendChild(track);
        line.appendChild(make("span", "gl-bar-value", percent(p[id])));
        dist.appendChild(line);
      });
    }

    function renderCost() {
      cost.textContent = "";
      if (!run || run.contextLens.length === 0) {
        costLegend.textContent = "Step the loop to see what each pass costs.";
        return;
      }
      var lens = run.contextLens, maxSq = 0, sumSq = 0, sum = 0;
      lens.forEach(function (n) { maxSq = Math.max(maxSq, n * n); sumSq += n * n; sum += n; });
      lens.forEach(function (n, i) {
        var pair = make("div", "gl-cost-pass");
        pair.setAttribute("data-pass", String(i + 1));
        pair.setAttribute("data-n", String(n));
        pair.title = "pass " + (i + 1) + ": context n = " + n + ", without cache n\u00b2 = " +
                     fmtInt(n * n) + ", with cache n = " + n;
        var a = make("span", "gl-cost-uncached");
        a.style.height = (100 * n * n / maxSq).toFixed(3) + "%";
        a.setAttribute("data-work", String(n * n));
        var b = make("span", "gl-cost-cached");
        b.style.height = (100 * n / maxSq).toFixed(3) + "%";
        b.setAttribute("data-work", String(n));
        pair.appendChild(a); pair.appendChild(b);
        cost.appendChild(pair);
      });
      costLegend.textContent = "";
      var sw1 = make("span", "gl-swatch gl-cost-uncached"); costLegend.appendChild(sw1);
      costLegend.appendChild(document.createTextNode(" without a cache, n\u00b2 per pass: total "));
      costLegend.appendChild(make("strong", "gl-total-uncached", fmtInt(sumSq)));
      costLegend.appendChild(document.createTextNode("   "));
      var sw2 = make("span", "gl-swatch gl-cost-cached"); costLegend.appendChild(sw2);
      costLegend.appendChild(document.createTextNode(" with a cache (S05), n per pass: total "));
      costLegend.appendChild(make("strong", "gl-total-cached", fmtInt(sum)));
      costLegend.appendChild(document.createTextNode("   ratio "));
      costLegend.appendChild(make("strong", "gl-ratio", (sumSq / sum).toFixed(1) + "\u00d7"));
      costLegend.appendChild(document.createTextNode(" (same scale; bars of " + lens.length +
                                                     " passes)"));
    }

    function renderStatus() {
      if (!run) { status.textContent = ""; snippet.textContent = ""; lastPick.textContent = ""; return; }
      var finish = run.stop === null ? "\u2014" : finishOf(run.stop);
      status.textContent = "";
      var parts = [["passes", run.contextLens.length], ["prompt tokens", run.promptTokens],
                   ["tokens out", run.out.length], ["context", run.ids.length + " / " + run.maxContext],
                   ["stopped by", run.stop === null ? "\u2014" : run.stop], ["finish_reason", finish]];
      parts.forEach(function (kv, i) {
        if (i) status.appendChild(document.createTextNode(" \u00b7 "));
        status.appendChild(document.createTextNode(kv[0] + " "));
        var v = make("strong", "gl-stat-" + kv[0].replace(/ /g, "-"), String(kv[1]));
        status.appendChild(v);
      });
      lastPick.textContent = "";
      if (run.last) {
        var L = run.last, tok = shown(model.vocab[L.token]);
        lastPick.textContent = L.T === 0
          ? "Pass " + run.contextLens.length + " read " + L.n + " tokens and took the argmax: \u201c" +
            tok + "\u201d."
          : "Pass " + run.contextLens.length + " read " + L.n + " tokens, drew u = " + L.u.toFixed(4) +
            " and picked \u201c" + tok + "\u201d (p = " + percent(L.p) + " at T = " + L.T + ").";
      }
      var temps = run.temps.filter(function (t, i, a) { return a.indexOf(t) === i; });
      var T = temps.length ? temps[0] : Number(tNumber.value);
      snippet.textContent = temps.length > 1
        ? "# The temperature changed during this run, so no single generate() call matches it.\n" +
          "# Press Reset to start a run with one temperature."
        : "# The same run in Python (the page uses a V = 512 model built by the chapter's code):\n" +
          "from s01_generation_loop import Engine, build_default\n" +
          "tokenizer, model = build_default(max_vocab=" + model.V + ")\n" +
          "engine = Engine(model, tokenizer, max_context=" + run.maxContext + ")\n" +
          "engine.generate(" + pyString(promptBox.value) + ", max_tokens=" + run.maxTokens +
          ", temperature=" + T + ", seed=" + run.seed + ")";
    }

    function render() {
      renderStatus();
      renderContext();
      renderDist();
      renderCost();
      var done = !run || run.stop !== null;
      stepBtn.disabled = done;
      runBtn.disabled = done && timer === null;
    }

    stepBtn.addEventListener("click", function () { stop(); step(); });
    runBtn.addEventListener("click", function () {
      if (timer !== null) { stop(); render(); return; }
      runBtn.textContent = "Pause";
      timer = setInterval(function () {
        if (!step() || run.stop !== null) { stop(); render(); }
      }, 60);
    });
    resetBtn.addEventListener("click", reset);
    presets.addEventListener("change", function () {
      promptBox.value = data.prompts[Number(presets.value)];
      reset();
    });
    [promptBox, seedSel, maxTok, maxCtx].forEach(function (input) {
      input.addEventListener("change", reset);
    });
    tRange.addEventListener("input", function () { tNumber.value = tRange.value; render(); });
    tNumber.addEventListener("input", function () {
      if (isFinite(Number(tNumber.value))) tRange.value = tNumber.value;
      error.hidden = true;
      render();
    });

    // Tests and curious readers can drive the same objects the buttons drive.
    root.glSim = {model: model, reset: reset, step: step, run: function () { return run; },
                  mismatches: mismatches.length};
    reset();
  }

  window.CourseSim.register("generation-loop", mount);
})();
