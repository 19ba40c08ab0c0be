/* S07 "Try it": a decode step of a model config on a machine's roofline, at any batch size.
 *
 * The arithmetic is code/s07_roofline.py's, rewritten here: `batched_decode_cost` (S03's
 * `cost_breakdown` for one token, then every weight read once for the whole batch and each
 * request's embedding row and K/V its own), `roofline_floor_s` (the larger of bytes /
 * bandwidth and FLOPs / matmul FLOP/s), and the smallest batch whose step is compute-bound,
 * found by the same bisection as site/simulators/roofline-calculator/export.py. The configs,
 * the roofs and a grid of Python results come from that export; the page recomputes the grid
 * when it loads and says so (console error and a visible line) if one value differs.
 * All counts are integers below 2^53 (the export checks), so doubles hold them exactly.
 */
(function () {
  "use strict";

  var CSS = [
    ".rl-row { display: flex; flex-wrap: wrap; gap: 0.6rem 1.2rem; align-items: flex-end; margin-bottom: 0.5rem; }",
    ".rl-field { display: flex; flex-direction: column; font-size: 0.85em; }",
    ".rl-field span { font-weight: 600; margin-bottom: 0.15rem; }",
    ".rl-field input { width: 6.5rem; }",
    ".rl-field input, .rl-field select { font: inherit; background: var(--color-background-primary); color: var(--color-foreground-primary); border: 1px solid var(--color-background-border); border-radius: 4px; padding: 0.15rem 0.3rem; }",
    ".rl-note { font-size: 0.85em; margin: 0.3rem 0; opacity: 0.9; }",
    ".rl-error { color: #b00020; font-weight: 600; font-size: 0.9em; margin: 0.3rem 0; }",
    ".rl-main { display: flex; flex-wrap: wrap; gap: 1rem 1.5rem; align-items: flex-start; }",
    ".rl-results { border-collapse: collapse; font-size: 0.88em; flex: 1 1 20rem; }",
    ".rl-results th { text-align: left; font-weight: 600; padding: 2px 0.8rem 2px 0; vertical-align: top; }",
    ".rl-results td { font-variant-numeric: tabular-nums; padding: 2px 0; }",
    ".rl-sub { display: block; font-size: 0.85em; opacity: 0.8; }",
    ".rl-bound-bandwidth { color: #1d4ed8; font-weight: 700; }",
    ".rl-bound-compute { color: #b45309; font-weight: 700; }",
    ".rl-plot { flex: 0 1 26rem; min-width: 16rem; max-width: 100%; }",
    ".rl-plot svg { width: 100%; height: auto; display: block; }",
    ".rl-plot text { font-size: 10px; fill: currentColor; }",
    ".rl-sweep { border-collapse: collapse; font-size: 0.82em; margin-top: 0.6rem; }",
    ".rl-sweep th, .rl-sweep td { border: 1px solid var(--color-background-border); padding: 1px 8px; text-align: right; font-variant-numeric: tabular-nums; }",
    ".rl-sweep tr.rl-current td { background: rgba(245, 158, 11, 0.18); font-weight: 700; }",
    ".rl-stale { opacity: 0.35; }"
  ].join("\n");

  var SVG = "http://www.w3.org/2000/svg";

  var el = CourseSim.el;

  function svg(tag, attrs, text) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function field(label, control) {
    var f = el("label", "rl-field");
    f.appendChild(el("span", "", label));
    f.appendChild(control);
    return f;
  }

  function select(cls, options) {
    var s = el("select", cls);
    options.forEach(function (o) {
      var opt = el("option", "", o[1]);
      opt.value = o[0];
      s.appendChild(opt);
    });
    return s;
  }

  // ---- the arithmetic (code/s07_roofline.py and code/s03_transformer.py) ----------------------

  // One decode step of B requests at context S, b bytes per value: {flops, bytes, perRequest}.
  function stepCost(f, B, S, b) {
    var c = f.C, d = f.D, hd = f.H * d, kvd = f.Hkv * d;
    var projW = c * hd + 2 * c * kvd + hd * c;
    var projP = projW + (f.attention_bias ? hd + 2 * kvd + c : 0);
    var mlpW = 3 * c * f.I;
    var mlpP = mlpW + (f.mlp_bias ? 2 * f.I + c : 0);
    var normP = 2 * c + (f.qk_norm ? 2 * d : 0);
    var kvBytes = 2 * kvd * (S - 1) * b + 2 * kvd * b;          // K, V read and the new ones written
    var layerFlops = 2 * projW + 4 * hd * S + 2 * mlpW;
    var layerBytes = projP * b + kvBytes + mlpP * b + normP * b;
    var flops1 = f.L * layerFlops + 2 * c * f.V;                // + the LM head
    var bytes1 = c * b + f.L * layerBytes + c * b + f.V * c * b; // embedding row, layers, norm, head
    var perRequest = c * b + f.L * kvBytes;                      // its embedding row and its K/V
    return {flops: B * flops1, bytes: bytes1 + (B - 1) * perRequest, flops1: flops1,
            perRequest: perRequest};
  }

  function isComputeBound(cost, bw, peak) { return cost.flops / peak >= cost.bytes / bw; }

  function step(f, B, S, b, bw, peak) {
    var cost = stepCost(f, B, S, b);
    var bytesS = cost.bytes / bw, flopsS = cost.flops / peak;
    var floor = Math.max(bytesS, flopsS);
    return {batch: B, flops: cost.flops, bytes: cost.bytes, intensity: cost.flops / cost.bytes,
            bytes_s: bytesS, flops_s: flopsS, floor_s: floor, tokens_per_s: B / floor,
            bound: isComputeBound(cost, bw, peak) ? "compute" : "bandwidth"};
  }

  function ridgeBatch(f, S, b, bw, peak, maxBatch) {
    function bound(B) { return isComputeBound(stepCost(f, B, S, b), bw, peak); }
    if (!bound(maxBatch)) return null;
    var lo = 1, hi = maxBatch;
    while (lo < hi) {
      var mid = Math.floor((lo + hi) / 2);
      if (bound(mid)) hi = mid; else lo = mid + 1;
    }
    return lo;
  }

  function makeCompute(data) {
    var configs = {}, machines = {};
    data.configs.forEach(function (c) { configs[c.id] = c; });
    data.machines.forEach(function (m) { machines[m.id] = m; });
    return function compute(s) {   // s: {config, machine, dtype, context, batch (optional)}
      var f = configs[s.config].fields, m = machines[s.machine];
      var b = data.dtypes[s.dtype], bw = m.bandwidth, peak = m.flops[s.dtype];
      var one = stepCost(f, 1, s.context, b);
      var out = {ridge: peak / bw, limit_intensity: one.flops1 / one.perRequest,
                 ridge_batch: ridgeBatch(f, s.context, b, bw, peak, data.max_batch),
                 weight_bytes: one.bytes - one.perRequest, per_request_bytes: one.perRequest,
                 flops_per_request: one.flops1};
      out.steps = (s.batches || []).map(function (B) { return step(f, B, s.context, b, bw, peak); });
      if (s.batch !== undefined) out.step = step(f, s.batch, s.context, b, bw, peak);
      return out;
    };
  }

  // ---- formatting ------------------------------------------------------------------------------

  function int(n) { return n.toLocaleString("en-US"); }
  function fixed(x, digits) {
    return x.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
  }
  // A time in seconds, 3 significant digits in the unit that keeps them in [1, 1000): 1.20 µs,
  // 60.9 ms, 443 ms, 1.23 s (from 1,000 s on, whole seconds).
  var TIME_UNITS = [[1, "s"], [1e-3, "ms"], [1e-6, "\u00b5s"], [1e-9, "ns"]];
  function duration(s) {
    var r = Number(s.toPrecision(3));           // rounded first: 999.96 µs reads 1.00 ms
    var i = 0;
    while (i < TIME_UNITS.length - 1 && r < TIME_UNITS[i][0]) i++;
    var v = r / TIME_UNITS[i][0];
    return fixed(s / TIME_UNITS[i][0], v >= 100 ? 0 : v >= 10 ? 1 : 2) + " " + TIME_UNITS[i][1];
  }
  function sig(x) {   // 3 significant digits, plain notation
    if (x >= 1000) return int(Math.round(x));
    var digits = x >= 100 ? 0 : x >= 10 ? 1 : x >= 1 ? 2 : 3;
    return fixed(x, digits);
  }
  function bytesText(n) {
    var units = [[1e12, "TB"], [1e9, "GB"], [1e6, "MB"], [1e3, "kB"]];
    for (var i = 0; i < units.length; i++) {
      if (n >= units[i][0]) return int(n) + " bytes (" + fixed(n / units[i][0], 2) + " " + units[i][1] + ")";
    }
    return int(n) + " bytes";
  }
  function rate(x, unit) {
    var units = [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"]];
    for (var i = 0; i < units.length; i++) {
      if (x >= units[i][0]) {
        var v = x / units[i][0];
        return fixed(v, v >= 10 ? 1 : 2) + " " + units[i][1] + unit;
      }
    }
    return fixed(x, 0) + " " + unit;
  }

  function tick(k) {   // 10^k FLOP/s as "100 G"
    var prefixes = ["", "k", "M", "G", "T", "P", "E"];
    var p = Math.floor(k / 3);
    return p >= 0 && p < prefixes.length ? String(Math.pow(10, k - 3 * p)) + " " + prefixes[p] : "1e" + k;
  }

  // ---- the roofline plot -------------------------------------------------------------------------

  function drawRoofline(box, bw, peak, points, current) {
    box.textContent = "";
    var ridge = peak / bw;
    var xs = points.map(function (p) { return p.intensity; }).concat([current.intensity, ridge]);
    var x0 = Math.floor(Math.log10(Math.min.apply(null, xs) / 2));
    var x1 = Math.ceil(Math.log10(Math.max.apply(null, xs) * 2));
    var y1 = Math.ceil(Math.log10(peak * 2));
    var y0 = Math.floor(Math.log10(bw * Math.pow(10, x0)));
    var W = 420, H = 270, L = 52, R = 12, T = 14, B = 34;
    function px(x) { return L + (Math.log10(x) - x0) / (x1 - x0) * (W - L - R); }
    function py(y) { return T + (y1 - Math.log10(y)) / (y1 - y0) * (H - T - B); }
    var s = svg("svg", {viewBox: "0 0 " + W + " " + H, role: "img",
                        "aria-label": "roofline: attainable FLOP/s against arithmetic intensity"});
    for (var k = x0; k <= x1; k++) {
      var x = px(Math.pow(10, k));
      s.appendChild(svg("line", {x1: x, x2: x, y1: T, y2: H - B, stroke: "currentColor",
                                 "stroke-opacity": 0.12}));
      s.appendChild(svg("text", {x: x, y: H - B + 13, "text-anchor": "middle"},
                        k >= 0 && k <= 3 ? String(Math.pow(10, k)) : k < 0 ? String(Math.pow(10, k).toFixed(-k)) : "1e" + k));
    }
    for (var j = y0; j <= y1; j++) {
      var y = py(Math.pow(10, j));
      s.appendChild(svg("line", {x1: L, x2: W - R, y1: y, y2: y, stroke: "currentColor",
                                 "stroke-opacity": 0.12}));
      s.appendChild(svg("text", {x: L - 4, y: y + 3, "text-anchor": "end"}, tick(j)));
    }
    s.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"},
                      "arithmetic intensity (FLOP per byte)"));
    s.appendChild(svg("text", {x: 10, y: (T + H - B) / 2, "text-anchor": "middle",
                               transform: "rotate(-90 10 " + ((T + H - B) / 2) + ")"}, "FLOP/s"));
    var xl = Math.pow(10, x0), xr = Math.pow(10, x1);
    s.appendChild(svg("path", {d: "M" + px(xl) + "," + py(bw * xl) + " L" + px(ridge) + "," + py(peak) +
                                  " L" + px(xr) + "," + py(peak),
                               fill: "none", stroke: "currentColor", "stroke-width": 2,
                               "class": "rl-roof"}));
    s.appendChild(svg("line", {x1: px(ridge), x2: px(ridge), y1: T, y2: H - B, stroke: "currentColor",
                               "stroke-dasharray": "3,3", "stroke-opacity": 0.6}));
    s.appendChild(svg("text", {x: px(ridge) + 3, y: T + 10}, "ridge " + sig(ridge)));
    points.forEach(function (p) {
      var c = svg("circle", {cx: px(p.intensity), cy: py(p.flops / p.floor_s), r: 3, fill: "none",
                             stroke: "#2563eb", "class": "rl-sweep-point"});
      c.appendChild(svg("title", {}, "B = " + p.batch + ": " + sig(p.intensity) + " FLOP/byte"));
      s.appendChild(c);
    });
    s.appendChild(svg("circle", {cx: px(current.intensity), cy: py(current.flops / current.floor_s),
                                 r: 5, fill: "#f59e0b", stroke: "#b45309", "class": "rl-point"}));
    s.appendChild(svg("text", {x: px(current.intensity) + 7, y: py(current.flops / current.floor_s) + 14},
                      "B = " + current.batch));
    box.appendChild(s);
    box.appendChild(el("p", "rl-note", "Points sit on the roof: a prediction, not a measurement. " +
      "Hollow: the batch sizes of the table; filled: your batch."));
  }

  // ---- the page ------------------------------------------------------------------------------------

  function mount(root, data) {
    if (!document.getElementById("rl-style")) {
      var style = el("style");
      style.id = "rl-style";
      style.textContent = CSS;
      document.head.appendChild(style);
    }
    var compute = makeCompute(data);
    var configs = {}, machines = {};
    data.configs.forEach(function (c) { configs[c.id] = c; });
    data.machines.forEach(function (m) { machines[m.id] = m; });
    var state = JSON.parse(JSON.stringify(data.defaults));

    var configSel = select("rl-config", data.configs.map(function (c) { return [c.id, c.label]; }));
    var machineSel = select("rl-machine", data.machines.map(function (m) { return [m.id, m.label]; }));
    var dtypeSel = select("rl-dtype", Object.keys(data.dtypes).map(function (d) {
      return [d, d + " (" + data.dtypes[d] + " bytes)"];
    }));
    var contextIn = el("input", "rl-context");
    contextIn.type = "number"; contextIn.min = "1"; contextIn.step = "1";
    var batchIn = el("input", "rl-batch");
    batchIn.type = "number"; batchIn.min = "1"; batchIn.max = String(data.max_batch); batchIn.step = "1";
    configSel.value = state.config; machineSel.value = state.machine; dtypeSel.value = state.dtype;
    contextIn.value = String(state.context); batchIn.value = String(state.batch);

    var controls = el("div", "rl-row");
    controls.appendChild(field("model", configSel));
    controls.appendChild(field("machine", machineSel));
    controls.appendChild(field("dtype", dtypeSel));
    controls.appendChild(field("context length S", contextIn));
    controls.appendChild(field("batch size B", batchIn));
    root.appendChild(controls);
    var configNote = el("p", "rl-note rl-config-note");
    var machineNote = el("p", "rl-note rl-machine-note");
    var error = el("p", "rl-error");
    root.appendChild(configNote);
    root.appendChild(machineNote);
    var method = el("details", "rl-note");
    method.appendChild(el("summary", "", "how these roofs were obtained"));
    var methodNote = el("span", "rl-method");
    method.appendChild(methodNote);
    root.appendChild(method);
    root.appendChild(error);
    var main = el("div", "rl-main");
    var results = el("table", "rl-results");
    var plot = el("div", "rl-plot");
    main.appendChild(results);
    main.appendChild(plot);
    root.appendChild(main);
    var sweepBox = el("div");
    root.appendChild(sweepBox);
    var checkLine = el("p", "rl-note rl-check");
    root.appendChild(checkLine);

    function row(label, key, value, text, sub) {
      var tr = el("tr");
      tr.appendChild(el("th", "", label));
      var td = el("td");
      var span = el("span", "rl-value", text);
      span.setAttribute("data-key", key);
      span.setAttribute("data-value", value === null ? "null" : String(value));
      td.appendChild(span);
      if (sub) td.appendChild(el("span", "rl-sub", sub));
      tr.appendChild(td);
      results.appendChild(tr);
      return span;
    }

    function syncDtypes() {   // a machine offers only the dtypes it has a compute roof for
      var m = machines[machineSel.value];
      Array.prototype.forEach.call(dtypeSel.options, function (o) {
        o.disabled = !(o.value in m.flops);
      });
      if (!(dtypeSel.value in m.flops)) dtypeSel.value = Object.keys(m.flops)[0];
    }

    function readInt(input, lo, hi, name) {
      var text = input.value.trim();
      if (!/^[0-9]+$/.test(text) || +text < lo || +text > hi) {
        throw new Error(name + " must be a whole number from " + int(lo) + " to " + int(hi) +
                        " (got \u201c" + text + "\u201d)");
      }
      return +text;
    }

    function render() {
      syncDtypes();
      var c = configs[configSel.value], m = machines[machineSel.value], f = c.fields;
      state.config = c.id; state.machine = m.id; state.dtype = dtypeSel.value;
      contextIn.max = String(f.max_context);
      configNote.textContent = c.label + ": " + int(c.parameters) + " parameters; L = " + f.L +
        ", H = " + f.H + ", Hkv = " + f.Hkv + ", D = " + f.D + ", C = " + f.C + ", I = " + f.I +
        ", V = " + int(f.V) + (f.tied ? ", tied LM head" : "") + ", contexts up to " +
        int(f.max_context) + ". Source: " + c.source + ".";
      var roofs = Object.keys(m.flops).map(function (d) { return d + " " + rate(m.flops[d], "FLOP/s"); });
      machineNote.textContent = m.label + ": " + rate(m.bandwidth, "B/s") + ", " + roofs.join(", ") +
        ". " + m.source + "." +
        (m.kind === "cpu" && c.id === "bundled" ? " The bundled model's weights fit in this " +
         "CPU's L3 cache, so a DRAM floor is not its yardstick (see the chapter's table)." : "");
      methodNote.textContent = "How: " + m.method + ".";
      try {
        state.context = readInt(contextIn, 1, f.max_context, "the context length");
        state.batch = readInt(batchIn, 1, data.max_batch, "the batch size");
      } catch (e) {
        error.textContent = e.message;
        main.classList.add("rl-stale");
        sweepBox.classList.add("rl-stale");
        root.setAttribute("data-valid", "false");
        return;
      }
      error.textContent = "";
      main.classList.remove("rl-stale");
      sweepBox.classList.remove("rl-stale");
      root.setAttribute("data-valid", "true");
      var r = compute({config: state.config, machine: state.machine, dtype: state.dtype,
                       context: state.context, batch: state.batch, batches: data.sweep});
      var s = r.step, B = state.batch;
      results.textContent = "";
      row("FLOPs per step", "flops", s.flops, int(s.flops),
          "B \u00d7 " + int(r.flops_per_request) + " per request");
      row("bytes per step", "bytes", s.bytes, bytesText(s.bytes),
          "weights read once: " + int(r.weight_bytes) + "; each request's embedding row and K/V: " +
          int(r.per_request_bytes) + " \u00d7 B");
      row("arithmetic intensity", "intensity", s.intensity, sig(s.intensity) + " FLOP/byte",
          "the machine's ridge: " + sig(r.ridge) + " FLOP/byte");
      row("bytes / bandwidth", "bytes_s", s.bytes_s, duration(s.bytes_s));
      row("FLOPs / peak", "flops_s", s.flops_s, duration(s.flops_s));
      var bound = row("the step is", "bound", s.bound, s.bound + "-bound",
                      s.bound === "bandwidth" ? "faster arithmetic would not help" :
                                                "more bandwidth would not help");
      bound.className += " rl-bound-" + s.bound;
      row("ITL floor (the step)", "floor_s", s.floor_s, duration(s.floor_s),
          "every request in the batch waits one step per token");
      row("tokens/s (all requests)", "tokens_per_s", s.tokens_per_s, fixed(s.tokens_per_s, 1),
          "B / step");
      var ridgeText, ridgeSub;
      if (r.ridge_batch !== null) {
        ridgeText = "B = " + int(r.ridge_batch);
        ridgeSub = "the smallest batch whose FLOPs take as long as its bytes";
      } else if (r.limit_intensity <= r.ridge) {
        ridgeText = "never at this context";
        ridgeSub = "as B grows the intensity only tends to " + sig(r.limit_intensity) +
                   " FLOP/byte (a request's FLOPs over its own bytes), below the ridge";
      } else {
        ridgeText = "beyond B = " + int(data.max_batch);
        ridgeSub = "the intensity tends to " + sig(r.limit_intensity) + " FLOP/byte, just above the ridge";
      }
      row("compute-bound from", "ridge_batch", r.ridge_batch, ridgeText, ridgeSub);

      drawRoofline(plot, m.bandwidth, m.flops[state.dtype], r.steps, s);

      sweepBox.textContent = "";
      var table = el("table", "rl-sweep");
      var head = el("tr");
      ["B", "step (ITL floor)", "tokens/s", "bound"].forEach(function (h) { head.appendChild(el("th", "", h)); });
      table.appendChild(head);
      r.steps.forEach(function (p) {
        var tr = el("tr", p.batch === B ? "rl-current" : "");
        tr.setAttribute("data-batch", String(p.batch));
        tr.appendChild(el("td", "", int(p.batch)));
        [["floor_s", duration(p.floor_s)], ["tokens_per_s", fixed(p.tokens_per_s, 1)], ["bound", p.bound]]
          .forEach(function (cell) {
            var td = el("td", "", cell[1]);
            td.setAttribute("data-key", cell[0]);
            td.setAttribute("data-value", String(p[cell[0]]));
            tr.appendChild(td);
          });
        table.appendChild(tr);
      });
      sweepBox.appendChild(el("p", "rl-note", "Batch sizes against the same roofs (" + c.label +
        ", S = " + int(state.context) + ", " + state.dtype + "):"));
      sweepBox.appendChild(table);
    }

    // The Python answers for the exported grid, recomputed here.
    function selfCheck() {
      var bad = [], n = 0;
      function same(a, b) {
        if (typeof b === "number") return Math.abs(a - b) <= 1e-9 * Math.abs(b);
        return a === b;
      }
      data.reference.forEach(function (ref) {
        var got = compute({config: ref.config, machine: ref.machine, dtype: ref.dtype,
                           context: ref.context,
                           batches: ref.steps.map(function (p) { return p.batch; })});
        ["ridge", "ridge_batch", "limit_intensity"].forEach(function (k) {
          n++;
          if (!same(got[k], ref[k])) bad.push(ref.config + "/" + ref.machine + "/" + ref.dtype + "/S=" + ref.context + " " + k);
        });
        ref.steps.forEach(function (p, i) {
          Object.keys(p).forEach(function (k) {
            n++;
            if (!same(got.steps[i][k], p[k])) bad.push(ref.config + "/" + ref.machine + "/B=" + p.batch + " " + k);
          });
        });
      });
      if (bad.length) {
        console.error("roofline-calculator: the page differs from Python on " + bad.length +
                      " values, first " + bad[0]);
        checkLine.className = "rl-error rl-check";
        checkLine.textContent = "This page's arithmetic differs from the course's Python on " +
          bad.length + " values (first: " + bad[0] + ").";
      } else {
        checkLine.textContent = "Checked on load: the page reproduces all " + int(n) +
          " values the course's Python computed for " + data.reference.length + " settings.";
      }
      return {checked: n, bad: bad};
    }

    configSel.addEventListener("change", function () {   // keep S inside the new model's window
      var max = configs[configSel.value].fields.max_context;
      if (+contextIn.value > max) contextIn.value = String(max);
      render();
    });
    [machineSel, dtypeSel].forEach(function (s) { s.addEventListener("change", render); });
    [contextIn, batchIn].forEach(function (i) { i.addEventListener("input", render); });
    render();
    var check = selfCheck();
    root.rlSim = {compute: compute, state: state, render: render, check: check};
  }

  window.CourseSim.register("roofline-calculator", mount);
})();
