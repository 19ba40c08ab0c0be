/* S04 "Try it": the sampler playground, S04's pipeline on real logits rows, one stage at a time.
 *
 * What runs here is a transcription of code/s04_sampling.py's `process_logits`, in its order:
 *   1. min_tokens   EOS set to -inf while fewer than min_tokens tokens exist (apply_min_tokens),
 *   2. penalties    repetition over prompt + output, then presence and frequency over the output
 *                   (apply_repetition_penalty, apply_presence_frequency_penalties),
 *   -- temperature 0 stops here: greedy is the argmax of these logits, lowest id on a tie --
 *   3. temperature  (z - max) / T in float64, rounded to float32 (apply_temperature),
 *   4. min_p        drop z - max < log(min_p) (apply_min_p),
 *   5. top_k        drop z below the k-th largest value, ties kept (apply_top_k),
 *   6. top_p        HF's ascending rule with S04's float32 steps (apply_top_p).
 * Logits are float32 as in S04: every float32 operation of the Python is done here in float64
 * and rounded with Math.fround, which gives the same bits for +, -, *, / of float32 numbers;
 * the one float32 sum (top_p's normaliser) follows NumPy's pairwise summation. So each stage's
 * row equals S04's bit for bit (exp() of float64 may differ from NumPy's in the last bit, which
 * moves a float32 result only on a rounding tie). The probabilities shown are softmax in
 * float64 of those rows; S04's `softmax` works in float32, so they agree to PROB_TOLERANCE.
 * Settings are checked with SamplingParams' rules and messages (max_tokens is its default, 16,
 * so min_tokens lies in [0, 16]). A field is read as Python reads typed text: integer text is an
 * int, a plain decimal (or nan, inf, infinity) a float; any other text reaches the rules as the
 * string itself, so the message quotes what was typed. On load the page replays the
 * reference results that export.py computed with S04's own functions and says if any differs.
 */
(function () {
  "use strict";

  var f32 = Math.fround;
  var STAGES = ["min_tokens", "penalties", "temperature", "min_p", "top_k", "top_p"];
  var TITLES = {raw: "model", min_tokens: "1 min_tokens", penalties: "2 penalties",
                temperature: "3 temperature", min_p: "4 min-p", top_k: "5 top-k",
                top_p: "6 top-p"};
  var SHOWN = 16;           // table rows
  var MIN_TOKENS_RULED_OUT = "min_tokens ruled out every token: the model gave only EOS or " +
                             "stop ids a finite logit";
  var PENALTY_OVERFLOW = "repetition_penalty pushed a logit past float32's range (to +inf): " +
                         "use a penalty nearer 1";
  var PENALTY_RULED_OUT = "repetition_penalty pushed every logit to -inf (past float32's " +
                          "range): use a penalty nearer 1";
  var FIELDS = [   // name, kind, min, max, step of the controls
    ["temperature", "float", 0, 2, 0.05], ["top_k", "int", -1, 100, 1],
    ["top_p", "float", 0, 1, 0.01], ["min_p", "float", 0, 1, 0.01],
    ["repetition_penalty", "float", 0.5, 2, 0.05], ["presence_penalty", "float", -2, 2, 0.1],
    ["frequency_penalty", "float", -2, 2, 0.1], ["min_tokens", "int", 0, 16, 1]
  ];
  var MAX_TOKENS = 16;      // SamplingParams' default max_tokens (export.py sends it too)

  // ---- Python's repr of a float and format(x, "g"), for SamplingParams' messages -----------
  function pyFloat(x) {
    if (isNaN(x)) return "nan";
    if (x === Infinity) return "inf";
    if (x === -Infinity) return "-inf";
    if (x === 0) return 1 / x < 0 ? "-0.0" : "0.0";
    var m = /^(-?)(\d)(?:\.(\d+))?e([+-]\d+)$/.exec(x.toExponential());  // shortest digits
    var sign = m[1], digits = m[2] + (m[3] || ""), exp = parseInt(m[4], 10);
    if (exp < -4 || exp >= 16) {
      var a = Math.abs(exp);
      return sign + digits[0] + (digits.length > 1 ? "." + digits.slice(1) : "") + "e" +
             (exp < 0 ? "-" : "+") + (a < 10 ? "0" : "") + a;
    }
    if (exp < 0) return sign + "0." + "0".repeat(-exp - 1) + digits;
    if (digits.length <= exp + 1) return sign + digits + "0".repeat(exp + 1 - digits.length) + ".0";
    return sign + digits.slice(0, exp + 1) + "." + digits.slice(exp + 1);
  }
  function pyStr(text) {            // Python's repr of a str (ASCII controls escaped)
    var q = text.indexOf("'") >= 0 && text.indexOf('"') < 0 ? '"' : "'";
    return q + text.replace(/\\/g, "\\\\").replace(q === "'" ? /'/g : /(?!)/g, "\\'")
      .replace(/[\x00-\x1f\x7f]/g, function (c) {
        return {"\t": "\\t", "\n": "\\n", "\r": "\\r"}[c] ||
               "\\x" + ("0" + c.charCodeAt(0).toString(16)).slice(-2);
      }) + q;
  }
  function pyRepr(v) {
    if (v.text !== undefined) return pyStr(v.text);
    return v.isInt ? v.digits : pyFloat(v.value);
  }

  // A typed field as Python would receive it: int(text) for integer text, float(text) for a
  // plain decimal number (or nan / inf / infinity, any case), else the text itself, which
  // every rule refuses (SamplingParams(temperature="0x10") names '0x10').
  function parseValue(text) {
    var raw = String(text), t = raw.trim();
    if (/^[+-]?\d+$/.test(t)) {
      return {isInt: true, value: Number(t), digits: BigInt(t).toString()};
    }
    if (/^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(t)) return {isInt: false, value: Number(t)};
    var special = /^([+-]?)(nan|inf|infinity)$/i.exec(t);
    if (special) {
      var x = special[2].toLowerCase() === "nan" ? NaN : Infinity;
      return {isInt: false, value: special[1] === "-" ? -x : x};
    }
    return {isInt: false, value: NaN, text: raw};
  }
  function isNumber(v) { return v.text === undefined; }

  // SamplingParams.__post_init__'s rules for these fields, in its order, with its messages.
  function checkParams(raw) {
    function real(name, lo, hi, loOpen) {
      var v = raw[name].value;
      var lowOk = isNumber(raw[name]) && !isNaN(v) && (loOpen ? v > lo : v >= lo);
      if (!(lowOk && isFinite(v) && v <= hi)) {
        return name + " must be a number in " + (loOpen ? "(" : "[") + String(lo) + ", " +
               (hi === Infinity ? "inf)" : String(hi) + "]") + " (got " + pyRepr(raw[name]) + ")";
      }
      return null;
    }
    var err = real("temperature", 0, 100) || real("top_p", 0, 1) || real("min_p", 0, 1) ||
              real("repetition_penalty", 0, Infinity, true) ||
              real("presence_penalty", -2, 2) || real("frequency_penalty", -2, 2);
    if (err) return err;
    if (!raw.top_k.isInt || raw.top_k.value < -1) {
      return "top_k must be an int >= -1 (0 or -1 disables; got " + pyRepr(raw.top_k) + ")";
    }
    var mt = raw.min_tokens;
    if (!mt.isInt || mt.value < 0 || mt.value > MAX_TOKENS) {
      return "min_tokens must be an int in [0, max_tokens=" + MAX_TOKENS + "] (got " +
             pyRepr(mt) + ")";
    }
    return null;
  }

  // ---- the processors ------------------------------------------------------------------
  function maxOf(z) {
    var m = -Infinity;
    for (var i = 0; i < z.length; i++) if (z[i] > m) m = z[i];
    return m;
  }

  function counts(ids) {
    var c = new Map();
    ids.forEach(function (i) { c.set(i, (c.get(i) || 0) + 1); });
    return c;
  }

  function applyMinTokens(z, nOut, minTokens, stopIds) {
    var out = z.slice();
    if (nOut < minTokens) stopIds.forEach(function (i) { out[i] = -Infinity; });
    return out;
  }

  function applyRepetition(z, seen, penalty) {
    var out = z.slice();
    if (penalty === 1 || seen.length === 0) return out;
    var p = f32(penalty);
    counts(seen).forEach(function (_, i) {
      out[i] = z[i] > 0 ? f32(z[i] / p) : f32(z[i] * p);
    });
    return out;
  }

  function applyPresenceFrequency(z, outputIds, presence, frequency) {
    var out = z.slice();
    if (outputIds.length === 0 || (presence === 0 && frequency === 0)) return out;
    var fp = f32(frequency), pp = f32(presence);
    counts(outputIds).forEach(function (n, i) {
      out[i] = f32(z[i] - f32(f32(fp * f32(n)) + pp));
    });
    return out;
  }

  function applyTemperature(z, T) {
    var m = maxOf(z);
    return z.map(function (v) { return f32((v - m) / T); });
  }

  function applyMinP(z, minP) {
    if (minP === 0) return z.slice();
    var m = maxOf(z), bar = Math.log(minP);
    return z.map(function (v) { return v - m < bar ? -Infinity : v; });
  }

  function applyTopK(z, k) {
    if (k <= 0 || k >= z.length) return z.slice();
    var sorted = Float64Array.from(z).sort();           // ascending, -Infinity first
    var kth = sorted[z.length - k];
    return z.map(function (v) { return v < kth ? -Infinity : v; });
  }

  // NumPy's float32 add.reduce (pairwise_sum, blocks of 128 with 8 accumulators).
  function pairwiseSum(a, start, n) {
    var i, res;
    if (n < 8) {
      res = 0;
      for (i = 0; i < n; i++) res = f32(res + a[start + i]);
      return res;
    }
    if (n <= 128) {
      var r = a.slice(start, start + 8);
      for (i = 8; i < n - (n % 8); i += 8) {
        for (var j = 0; j < 8; j++) r[j] = f32(r[j] + a[start + i + j]);
      }
      res = f32(f32(f32(r[0] + r[1]) + f32(r[2] + r[3])) + f32(f32(r[4] + r[5]) + f32(r[6] + r[7])));
      for (; i < n; i++) res = f32(res + a[start + i]);
      return res;
    }
    var n2 = Math.floor(n / 2);
    n2 -= n2 % 8;
    return f32(pairwiseSum(a, start, n2) + pairwiseSum(a, start + n2, n - n2));
  }

  function byLikelihood(z) {    // ids, most likely first, equal logits by lowest id
    return z.map(function (_, i) { return i; }).sort(function (a, b) {
      return z[a] > z[b] ? -1 : z[a] < z[b] ? 1 : a - b;
    });
  }

  function applyTopP(z, topP) {
    var out = z.slice();
    if (topP >= 1) return out;
    var order = byLikelihood(z).reverse();                 // least likely first
    var m = maxOf(z), V = z.length;
    var e = order.map(function (i) { return f32(Math.exp(f32(z[i] - m))); });
    var inv = f32(1 / pairwiseSum(e, 0, V));
    var cut = f32(1 - topP), mass = 0;
    for (var j = 0; j < V - 1; j++) {                      // never the most likely token
      mass += f32(e[j] * inv);                             // float64 running sum
      if (f32(mass) <= cut) out[order[j]] = -Infinity;
    }
    return out;
  }

  function softmax(z) {           // float64
    var m = maxOf(z), s = 0;
    var e = z.map(function (v) { var x = Math.exp(v - m); s += x; return x; });
    return e.map(function (x) { return x / s; });
  }

  function keptIds(z) {
    var ids = [];
    for (var i = 0; i < z.length; i++) if (z[i] > -Infinity) ids.push(i);
    return ids;
  }

  function argmax(z) {
    var best = 0;
    for (var i = 1; i < z.length; i++) if (z[i] > z[best]) best = i;
    return best;
  }

  // The whole pipeline on one row: every stage's row, kept set and probabilities.
  function compute(row, raw) {
    var result = {error: checkParams(raw), stages: [], greedy: null};
    var z0 = row.logits;
    result.raw = {name: "raw", logits: z0, kept: keptIds(z0), probs: softmax(z0)};
    if (result.error) return result;
    var v = {};
    Object.keys(raw).forEach(function (k) { v[k] = raw[k].value; });
    function push(name, z, off) {
      result.stages.push({name: name, logits: z, kept: keptIds(z), probs: softmax(z), off: off,
                          skipped: false});
    }
    var z = applyMinTokens(z0, row.output_ids.length, v.min_tokens, row.eos_ids);
    push("min_tokens", z, !(row.output_ids.length < v.min_tokens && row.eos_ids.length));
    z = applyRepetition(z, row.prompt_ids.concat(row.output_ids), v.repetition_penalty);
    z = applyPresenceFrequency(z, row.output_ids, v.presence_penalty, v.frequency_penalty);
    var finite = 0;
    for (var i = 0; i < z.length; i++) {
      if (isNaN(z[i]) || z[i] === Infinity) { result.error = PENALTY_OVERFLOW; return result; }
      if (z[i] > -Infinity) finite++;
    }
    if (finite === 0) {
      result.error = row.output_ids.length < v.min_tokens ? MIN_TOKENS_RULED_OUT : PENALTY_RULED_OUT;
      return result;
    }
    push("penalties", z, v.repetition_penalty === 1 && v.presence_penalty === 0 &&
                         v.frequency_penalty === 0);
    if (v.temperature === 0) {
      result.greedy = argmax(z);
      STAGES.slice(2).forEach(function (name) {
        result.stages.push({name: name, logits: null, kept: [result.greedy], probs: null,
                            off: false, skipped: true});
      });
      return result;
    }
    push("temperature", z = applyTemperature(z, v.temperature), v.temperature === 1);
    push("min_p", z = applyMinP(z, v.min_p), v.min_p === 0);
    push("top_k", z = applyTopK(z, v.top_k), v.top_k <= 0 || v.top_k >= z.length);
    push("top_p", z = applyTopP(z, v.top_p), v.top_p >= 1);
    return result;
  }

  // ---- reference replay --------------------------------------------------------------------
  function fingerprint(z) {
    var n = 0, ids = 0, sum = 0;
    for (var i = 0; i < z.length; i++) {
      if (z[i] > -Infinity) { n++; ids += i; sum += z[i]; }
    }
    return [n, ids, sum];
  }

  function settingsToRaw(defaults, settings) {
    var raw = {};
    FIELDS.forEach(function (f) {
      var name = f[0];
      var value = name in settings ? settings[name] : defaults[name];
      raw[name] = {isInt: f[1] === "int" && Number.isInteger(value), value: value,
                   digits: String(value)};
    });
    return raw;
  }

  function checkReference(data, rows, tolerance) {
    var bad = [];
    data.reference.forEach(function (c) {
      var r = compute(rows[c.row], settingsToRaw(data.defaults, c.settings));
      var ok;
      if ("error" in c) {
        ok = r.error === c.error;
      } else {
        ok = r.error === null && r.stages.every(function (s, k) {
          return c.stages[k] === null ? s.skipped
            : JSON.stringify(fingerprint(s.logits)) === JSON.stringify(c.stages[k]);
        });
        if ("greedy" in c) ok = ok && r.greedy === c.greedy;
        if ("top" in c) {
          var p = r.stages[r.stages.length - 1].probs;
          ok = ok && c.top.every(function (t) { return Math.abs(p[t[0]] - t[1]) <= tolerance; });
        }
      }
      if (!ok) bad.push({reference: c, page: r.error || r.stages.map(function (s) {
        return s.skipped ? null : fingerprint(s.logits); })});
    });
    return bad;
  }

  // ---- the page -------------------------------------------------------------------------
  var make = CourseSim.el;

  function show(token) {
    return token.replace(/\n/g, "\u21b5").replace(/ /g, "\u2423");
  }

  function mount(root, data) {
    if (data.max_tokens !== undefined) MAX_TOKENS = data.max_tokens;
    var rows = data.rows.map(function (r) {
      return {label: r.label, kind: r.kind, prompt: r.prompt, prompt_ids: r.prompt_ids,
              output_ids: r.output_ids, eos_ids: r.eos_ids,
              logits: r.logits.map(function (x) { return f32(x); }),
              tokens: r.tokens || data.model.vocab};
    });
    var tolerance = data.prob_tolerance;
    var ui = make("div", "sp-sim");
    root.appendChild(ui);
    var bad = checkReference(data, rows, tolerance);
    if (bad.length) {
      var msg = "sampler-playground disagrees with S04's functions on " + bad.length +
                " of " + data.reference.length + " reference cases";
      console.error(msg, bad);
      ui.appendChild(make("p", "course-error", msg));
    }
    if (!data.model.available) {
      ui.appendChild(make("p", "sp-note", "This build has no bundled model, so only the " +
                                          "hand-made rows are here: " + data.model.reason));
    }

    // --- controls ------------------------------------------------------------------------
    var rowSel = make("select", "sp-row-select");
    rowSel.setAttribute("aria-label", "Logits row");
    rows.forEach(function (r, i) {
      var o = make("option", null, r.label);
      o.value = String(i);
      rowSel.appendChild(o);
    });
    var top = make("div", "sp-controls");
    var rowField = make("label", "sp-field sp-field-row");
    rowField.appendChild(make("span", "sp-label", "Logits row"));
    rowField.appendChild(rowSel);
    top.appendChild(rowField);
    ui.appendChild(top);
    var context = make("div", "sp-context");
    ui.appendChild(context);

    var knobs = make("div", "sp-controls");
    var inputs = {};
    FIELDS.forEach(function (f) {
      var name = f[0];
      var wrap = make("label", "sp-field");
      wrap.appendChild(make("span", "sp-label", name));
      var pair = make("span", "sp-pair");
      var range = make("input", "sp-range sp-range-" + name);
      range.type = "range"; range.min = f[2]; range.step = f[4];
      range.max = name === "min_tokens" ? MAX_TOKENS : f[3];
      range.setAttribute("aria-label", name);
      var number = make("input", "sp-number sp-" + name);
      number.type = "text"; number.inputMode = "decimal"; number.size = 6;
      number.setAttribute("aria-label", name + " value");
      number.value = String(data.defaults[name]);
      range.value = number.value;
      range.addEventListener("input", function () { number.value = range.value; render(); });
      number.addEventListener("input", function () {
        var typed = parseValue(number.value);
        if (isNumber(typed) && isFinite(typed.value)) range.value = String(typed.value);
        render();
      });
      pair.appendChild(range); pair.appendChild(number);
      wrap.appendChild(pair);
      knobs.appendChild(wrap);
      inputs[name] = number;
    });
    ui.appendChild(knobs);
    var buttons = make("div", "sp-controls sp-buttons");
    var back = make("button", "sp-step-back", "\u2190 one stage");
    var next = make("button", "sp-step-next", "one stage \u2192");
    var all = make("button", "sp-step-all", "all stages");
    var reset = make("button", "sp-reset", "vLLM defaults");
    [back, next, all, reset].forEach(function (b) { b.type = "button"; buttons.appendChild(b); });
    ui.appendChild(buttons);

    var error = make("p", "course-error sp-error");
    error.hidden = true;
    var pipeline = make("div", "sp-pipeline");
    var summary = make("p", "sp-summary");
    summary.setAttribute("aria-live", "polite");
    var table = make("table", "sp-table");
    var snippet = make("pre", "sp-snippet");
    [error, pipeline, summary, table, snippet].forEach(function (n) { ui.appendChild(n); });

    var state = {row: 0, upto: STAGES.length};
    var api = {compute: compute, rows: rows, state: state, last: null,
               mismatches: bad.length, tolerance: tolerance};
    root.spSim = api;

    function rawSettings() {
      var raw = {};
      FIELDS.forEach(function (f) { raw[f[0]] = parseValue(inputs[f[0]].value); });
      return raw;
    }

    function renderContext(row) {
      context.textContent = "";
      if (row.kind === "hand") {
        context.appendChild(make("span", "sp-note", "A hand-made row of " + row.logits.length +
          " tokens" + (row.output_ids.length ? "; output so far: [" + row.output_ids.join(", ") +
          "]" : "") + "."));
        return;
      }
      row.prompt_ids.forEach(function (id) {
        context.appendChild(make("span", "sp-tok sp-tok-prompt", show(row.tokens[id])));
      });
      row.output_ids.forEach(function (id) {
        context.appendChild(make("span", "sp-tok sp-tok-output", show(row.tokens[id])));
      });
      context.appendChild(make("span", "sp-tok sp-tok-next", "?"));
      context.appendChild(make("span", "sp-note", " prompt, output so far (" +
        row.output_ids.length + " tokens: what presence and frequency count), next token"));
    }

    function fmt(p) { return p.toFixed(4); }

    function render() {
      var row = rows[state.row];
      var raw = rawSettings();
      var r = compute(row, raw);
      api.last = r;
      renderContext(row);
      error.hidden = !r.error;
      error.textContent = r.error ? "ValueError: " + r.error : "";
      pipeline.textContent = "";
      table.textContent = "";
      summary.textContent = "";
      snippet.textContent = "";
      if (r.error) return;
      var V = row.logits.length;
      var columns = [r.raw].concat(r.stages.slice(0, state.upto));
      var prev = r.raw;
      r.stages.forEach(function (s, k) {
        var card = make("button", "sp-stage" + (k < state.upto ? "" : " sp-stage-hidden") +
                        (s.off ? " sp-stage-off" : "") + (s.skipped ? " sp-stage-skipped" : ""));
        card.type = "button";
        card.dataset.stage = s.name;
        card.appendChild(make("span", "sp-stage-name", TITLES[s.name]));
        var note;
        if (s.skipped) note = "skipped: greedy";
        else if (s.off) note = "off";
        else if (k < 3) {
          var removed = prev.kept.length - s.kept.length;   // what this stage set to -inf
          note = removed === 0 ? "reshapes" : k === 0 ? "rules out EOS" :
            "removes " + removed + (k === 1 ? " seen" : "") + " token" + (removed === 1 ? "" : "s");
        }
        else {
          var mass = 0;
          s.kept.forEach(function (i) { mass += prev.probs[i]; });
          note = "keeps " + fmt(mass) + " of the mass";
        }
        card.appendChild(make("span", "sp-kept", s.kept.length + " of " + V));
        card.appendChild(make("span", "sp-stage-note", note));
        card.addEventListener("click", function () { state.upto = k + 1; render(); });
        pipeline.appendChild(card);
        if (!s.skipped) prev = s;
      });

      // Table: the most likely tokens after the penalties (the order every filter uses).
      var order = byLikelihood(r.stages[1].logits);
      var inPrompt = counts(row.prompt_ids), inOut = counts(row.output_ids);
      var shownIds = order.slice(0, Math.min(SHOWN, V));
      row.eos_ids.forEach(function (id) {           // EOS stays in view when min_tokens drops it
        if (shownIds.indexOf(id) < 0 && r.stages[0].kept.indexOf(id) < 0) shownIds.push(id);
      });
      var head = make("tr");
      head.appendChild(make("th", null, "token"));
      head.appendChild(make("th", null, "seen"));
      columns.forEach(function (c) { head.appendChild(make("th", "sp-col-" + c.name, TITLES[c.name])); });
      table.appendChild(head);
      shownIds.forEach(function (id) {
        var tr = make("tr", "sp-token-row");
        tr.dataset.id = String(id);
        tr.appendChild(make("td", "sp-token", show(row.tokens[id])));
        var mark = [];                               // repetition: either; the others: output
        if (inPrompt.has(id)) mark.push("prompt \u00d7" + inPrompt.get(id));
        if (inOut.has(id)) mark.push("output \u00d7" + inOut.get(id));
        mark = mark.join(", ");
        tr.appendChild(make("td", "sp-seen", mark));
        columns.forEach(function (c) {
          var td = make("td", "sp-p sp-col-" + c.name);
          if (c.skipped) {
            td.textContent = id === r.greedy ? "argmax" : "";
            td.className += id === r.greedy ? " sp-greedy" : "";
          } else if (c.logits[id] === -Infinity) {
            td.textContent = "\u00d7";
            td.className += " sp-removed";
          } else {
            var p = c.probs[id];
            td.textContent = fmt(p);
            td.style.backgroundSize = (100 * p).toFixed(1) + "% 100%";
          }
          tr.appendChild(td);
        });
        table.appendChild(tr);
      });
      if (V > shownIds.length) {
        var more = make("tr");
        more.appendChild(make("td", "sp-note", "\u2026 " + (V - shownIds.length) + " more"));
        table.appendChild(more);
      }

      var last = r.stages[state.upto - 1];
      if (r.greedy !== null && state.upto > 2) {
        summary.textContent = "Temperature 0: the token is the argmax after the penalties, " +
          show(row.tokens[r.greedy]) + " (id " + r.greedy + "); the filters cannot change it.";
      } else {
        var modelMass = 0;
        last.kept.forEach(function (i) { modelMass += r.raw.probs[i]; });
        summary.textContent = "After " + TITLES[last.name] + ": " + last.kept.length + " of " +
          V + " tokens can be drawn, holding " + fmt(modelMass) + " of the model's probability.";
      }
      var parts = [];
      FIELDS.forEach(function (f) {
        var val = raw[f[0]];
        if (val.value !== data.defaults[f[0]]) parts.push(f[0] + "=" + pyRepr(val));
      });
      snippet.textContent = "params = SamplingParams(" + parts.join(", ") + ")\n" +
        "row = process_logits(logits, params, prompt_ids, output_ids, eos_ids)";
      back.disabled = state.upto <= 1;
      next.disabled = state.upto >= STAGES.length;
    }

    rowSel.addEventListener("change", function () { state.row = Number(rowSel.value); render(); });
    back.addEventListener("click", function () { state.upto = Math.max(1, state.upto - 1); render(); });
    next.addEventListener("click", function () {
      state.upto = Math.min(STAGES.length, state.upto + 1); render();
    });
    all.addEventListener("click", function () { state.upto = STAGES.length; render(); });
    reset.addEventListener("click", function () {
      FIELDS.forEach(function (f) {
        inputs[f[0]].value = String(data.defaults[f[0]]);
        ui.querySelector(".sp-range-" + f[0]).value = inputs[f[0]].value;
      });
      render();
    });
    api.render = render;
    render();
  }

  window.CourseSim.register("sampler-playground", mount);
})();
