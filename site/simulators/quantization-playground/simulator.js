/* S14 "Try it": the quantization playground. One real weight row of the bundled model,
 * quantized as code/s14_quantization.py quantizes it, with the codes, the scales and zero
 * points, the dequantized row, its error and the bytes it takes.
 *
 * What runs here is a transcription of the chapter's round-to-nearest quantizers, in float32:
 *   int8, one scale per row (quantize_int8): scale = absmax / 127 (float32), 1 for a row of
 *     zeros; code = round(w / scale) clipped to -127..127; w ~ code * scale.
 *   int4, one scale per group of g = 32, 64 or 128 weights (quantize_int4), unsigned codes
 *     0..15, w ~ (code - zero) * scale:
 *     symmetric: scale = absmax / 7, zero = 8, code = round(w / scale) clipped to -7..7, + 8;
 *     asymmetric: lo = min(min w, 0), hi = max(max w, 0), scale = (hi - lo) / 15,
 *       zero = round(-lo / scale) clipped to 0..15, code = round(w / scale) + zero clipped to
 *       0..15.
 *     The scale is stored in bfloat16, rounded UP (round to nearest even on the float32 bit
 *     pattern, then one bfloat16 step up if that went below), so no weight lies more than
 *     scale / 2 from its level; a scale of 0 becomes 1.
 * Every float32 operation of the Python is done here in float64 and rounded with Math.fround,
 * which gives the same bits for +, -, *, / of float32 numbers; round() is half to even, as
 * torch.round. So the codes, scales, zero points and the error w - dequant of every weight
 * equal the Python's bit for bit. On load the page recomputes every exported row and setting
 * and compares with the results export.py computed with the chapter's own functions (a banner
 * and a console error if one differs). "Add an outlier" sets one weight to 8 x the row's
 * largest |w|, sign kept, to show what one large weight does to a per-row and a per-group scale.
 */
(function () {
  "use strict";

  var el = CourseSim.el, f32 = Math.fround;
  var OUTLIER_INDEX = 3, OUTLIER_TIMES = 8;
  var STYLE = [
    ".qp-sim select, .qp-sim input { font: inherit; }",
    ".qp-controls { display: flex; flex-wrap: wrap; gap: 0.4rem 1rem; align-items: center; margin-bottom: 0.5rem; }",
    ".qp-controls label { font-size: 0.9em; }",
    ".qp-banner { color: #b00020; font-weight: 600; }",
    ".qp-summary, .qp-errors { margin: 0.3rem 0; }",
    ".qp-plot { width: 100%; height: 150px; display: block; box-sizing: border-box; border: 1px solid #ddd; }",
    ".qp-scales { display: flex; flex-wrap: wrap; gap: 3px; margin: 0.4rem 0; font-size: 0.8em; }",
    ".qp-scale { border: 1px solid #bbb; padding: 1px 4px; cursor: pointer; font-variant-numeric: tabular-nums; }",
    ".qp-scale.qp-picked { outline: 2px solid #1565c0; }",
    ".qp-codes { display: grid; grid-template-columns: repeat(32, minmax(0, 1fr)); gap: 1px; font-size: 0.7em; }",
    ".qp-code { text-align: center; padding: 1px 0; font-variant-numeric: tabular-nums; overflow: hidden; }",
    ".qp-code.qp-picked { outline: 1px solid #1565c0; }",
    ".qp-detail-box { max-height: 16rem; overflow: auto; margin-top: 0.4rem; }",
    ".qp-detail { border-collapse: collapse; font-size: 0.8em; font-variant-numeric: tabular-nums; }",
    ".qp-detail td, .qp-detail th { padding: 1px 8px; text-align: right; }"
  ].join("\n");

  // ---- float32 arithmetic as torch does it ----------------------------------------------------
  var buf = new ArrayBuffer(4), asFloat = new Float32Array(buf), asBits = new Uint32Array(buf);

  function bf16Nearest(x) {              // float32 -> bfloat16, round to nearest even
    asFloat[0] = x;
    var bits = asBits[0], lsb = (bits >>> 16) & 1;
    asBits[0] = ((bits + 0x7fff + lsb) >>> 0) & 0xffff0000;
    return asFloat[0];
  }
  function bf16Up(x) {                   // s14_quantization._round_scale_up (x > 0)
    var stored = bf16Nearest(x);
    if (stored < x) {
      asFloat[0] = stored;
      asBits[0] = (asBits[0] + 0x10000) >>> 0;
      stored = asFloat[0];
    }
    return stored;
  }
  function roundEven(x) {                // torch.round: half to even
    var f = Math.floor(x), d = x - f;
    if (d < 0.5) return f;
    if (d > 0.5) return f + 1;
    return f % 2 === 0 ? f : f + 1;
  }
  function clip(x, lo, hi) { return Math.min(hi, Math.max(lo, x)); }

  // One row (float32 values) in one setting: codes, scales, zeros, error, bytes.
  function quantize(values, bits, groupSize, symmetric) {
    var k = values.length, g = bits === 8 ? k : groupSize, groups = k / g;
    var codes = [], scales = [], zeros = [], error = [];
    for (var j = 0; j < groups; j++) {
      var part = values.slice(j * g, (j + 1) * g), scale, zero;
      var absmax = 0, lo = 0, hi = 0;
      part.forEach(function (w) { absmax = Math.max(absmax, Math.abs(w)); lo = Math.min(lo, w); hi = Math.max(hi, w); });
      if (bits === 8) {
        scale = f32(absmax / 127);
        zero = 0;
      } else if (symmetric) {
        scale = bf16Up(f32(absmax / 7));
        zero = 8;
      } else {
        scale = bf16Up(f32(f32(hi - lo) / 15));
      }
      if (scale === 0) scale = 1;
      if (bits === 4 && !symmetric) zero = clip(roundEven(f32(-lo / scale)), 0, 15);
      part.forEach(function (w) {
        var q = roundEven(f32(w / scale)), code;
        if (bits === 8) code = clip(q, -127, 127);
        else if (symmetric) code = clip(q, -7, 7) + 8;
        else code = clip(q + zero, 0, 15);
        codes.push(code);
        error.push(f32(w - f32((code - zero) * scale)));
      });
      scales.push(scale);
      zeros.push(zero);
    }
    var bytes = bits === 8 ? {codes: k, scales: 4, zeros: 0}
      : {codes: k / 2, scales: 2 * groups, zeros: symmetric ? 0 : groups};
    return {codes: codes, scales: scales, zeros: zeros, error: error, bytes: bytes,
            total_bytes: bytes.codes + bytes.scales + bytes.zeros, group_size: g};
  }

  // Every exported row and setting recomputed and compared with the Python results.
  function selfCheck(data) {
    var problems = [];
    data.rows.forEach(function (row) {
      row.results.forEach(function (want) {
        var got = quantize(row.values, want.bits, want.group_size, want.symmetric);
        var at = row.name + "[" + row.row + "] " + want.id + ": ";
        ["codes", "scales", "zeros", "error", "bytes", "total_bytes"].forEach(function (field) {
          if (!CourseSim.same(got[field], want[field])) problems.push(at + field);
        });
      });
    });
    return problems;
  }

  function fmt(x, digits) { return x === 0 ? "0" : Number(x.toPrecision(digits || 4)).toString(); }

  function mount(root, data) {
    if (!document.getElementById("qp-style")) {
      var style = el("style", {id: "qp-style"});
      style.textContent = STYLE;
      document.head.appendChild(style);
    }
    var wrap = el("div", "qp-sim");
    root.appendChild(wrap);
    var banner = el("p", "qp-banner");
    banner.hidden = true;
    wrap.appendChild(banner);

    var controls = el("div", "qp-controls");
    wrap.appendChild(controls);
    function field(label, node) {
      var box = el("label", null, label + " ");
      box.appendChild(node);
      controls.appendChild(box);
      return node;
    }
    var rowPick = field("weight row", el("select", "qp-row"));
    data.rows.forEach(function (r, i) {
      rowPick.appendChild(el("option", {value: String(i)}, r.name + " row " + r.row + " (K = " + r.k + ")"));
    });
    var bitsPick = field("bits", el("select", "qp-bits"));
    [["8", "8 (per row)"], ["4", "4 (per group)"]].forEach(function (o) {
      bitsPick.appendChild(el("option", {value: o[0]}, o[1]));
    });
    bitsPick.value = "4";
    var groupPick = field("group size", el("select", "qp-group"));
    data.group_sizes.forEach(function (g) { groupPick.appendChild(el("option", {value: String(g)}, String(g))); });
    var symPick = field("", el("select", "qp-sym"));
    [["sym", "symmetric (zero point 8)"], ["asym", "asymmetric (zero point per group)"]].forEach(function (o) {
      symPick.appendChild(el("option", {value: o[0]}, o[1]));
    });
    var outlier = field("add an outlier", el("input", {type: "checkbox", "class": "qp-outlier"}));

    var summary = el("p", "qp-summary");
    var errors = el("p", "qp-errors");
    var svgNS = "http://www.w3.org/2000/svg";
    var plot = document.createElementNS(svgNS, "svg");
    plot.setAttribute("class", "qp-plot");
    plot.setAttribute("viewBox", "0 0 800 150");
    plot.setAttribute("preserveAspectRatio", "none");
    var scaleBox = el("div", "qp-scales");
    var codeBox = el("div", "qp-codes");
    var detailBox = el("div", "qp-detail-box");
    [summary, errors, plot, el("p", null, "Scales and zero points, one per group (click one to list its weights):"),
     scaleBox, el("p", null, "Codes, one cell per weight, coloured by |error| / scale (white 0, dark 0.5):"),
     codeBox, detailBox].forEach(function (n) { wrap.appendChild(n); });

    var picked = 0, current = null;

    function values() {
      var row = data.rows[Number(rowPick.value)], v = row.values.slice();
      if (outlier.checked) {
        var absmax = Math.max.apply(null, v.map(Math.abs));
        v[OUTLIER_INDEX] = f32((v[OUTLIER_INDEX] < 0 ? -1 : 1) * OUTLIER_TIMES * absmax);
      }
      return v;
    }

    function render() {
      var bits = Number(bitsPick.value), g = Number(groupPick.value), sym = symPick.value === "sym";
      groupPick.disabled = symPick.disabled = bits === 8;
      var v = values(), k = v.length;
      if (bits === 4 && k % g) { g = 32; groupPick.value = "32"; }
      var r = quantize(v, bits, g, bits === 8 || sym);
      current = {values: v, result: r};
      picked = Math.min(picked, r.scales.length - 1);
      var kind = bits === 8 ? "int8, one float32 scale per row"
        : "int4 in groups of " + r.group_size + ", " + (sym ? "symmetric" : "asymmetric") + ", bfloat16 scales";
      summary.innerHTML = "";
      summary.appendChild(document.createTextNode(kind + ": "));
      var total = el("span", "qp-bytes", String(r.total_bytes));
      total.dataset.bytes = String(r.total_bytes);
      summary.appendChild(total);
      summary.appendChild(document.createTextNode(
        " bytes = " + r.bytes.codes + " of codes + " + r.bytes.scales + " of scales" +
        (r.bytes.zeros ? " + " + r.bytes.zeros + " of zero points" : "") +
        ", " + fmt(8 * r.total_bytes / k, 4) + " bits per weight (float32: " + 4 * k +
        " bytes, bfloat16: " + 2 * k + ")."));
      var maxErr = 0, sq = 0, worst = 0;
      r.error.forEach(function (e, i) {
        var s = r.scales[Math.floor(i / r.group_size)];
        maxErr = Math.max(maxErr, Math.abs(e));
        sq += e * e;
        worst = Math.max(worst, Math.abs(e) / s);
      });
      errors.textContent = "Error w \u2212 dequant: largest |error| " + fmt(maxErr) + ", RMS " +
        fmt(Math.sqrt(sq / k)) + ", largest |error| / scale " + fmt(worst, 3) +
        " (round to nearest: at most 0.5).";
      errors.dataset.maxError = String(maxErr);
      errors.dataset.worst = String(worst);
      drawPlot(v, r);
      scaleBox.innerHTML = "";
      r.scales.forEach(function (s, j) {
        var chip = el("span", "qp-scale" + (j === picked ? " qp-picked" : ""),
                      "g" + j + ": " + fmt(s, 4) + (bits === 4 ? ", zero " + r.zeros[j] : ""));
        chip.dataset.scale = String(s);
        chip.dataset.zero = String(r.zeros[j]);
        chip.addEventListener("click", function () { picked = j; render(); });
        scaleBox.appendChild(chip);
      });
      codeBox.innerHTML = "";
      r.codes.forEach(function (c, i) {
        var j = Math.floor(i / r.group_size), e = r.error[i];
        var cell = el("span", "qp-code" + (j === picked ? " qp-picked" : ""), String(c));
        var shade = Math.round(255 - 300 * Math.min(0.5, Math.abs(e) / r.scales[j]));
        cell.style.background = "rgb(" + shade + "," + shade + ",255)";
        cell.dataset.code = String(c);
        cell.dataset.error = String(e);
        cell.title = "w[" + i + "] = " + fmt(v[i], 6) + ", code " + c + ", error " + fmt(e, 3);
        codeBox.appendChild(cell);
      });
      detail(v, r);
    }

    function detail(v, r) {
      detailBox.innerHTML = "";
      var table = el("table", "qp-detail"), head = el("tr");
      ["i", "w", "code", "code \u2212 zero", "dequant", "error", "|error| / scale"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      table.appendChild(head);
      var g = r.group_size, s = r.scales[picked], z = r.zeros[picked];
      for (var i = picked * g; i < (picked + 1) * g; i++) {
        var tr = el("tr", "qp-detail-row"), back = f32((r.codes[i] - z) * s);
        [String(i), fmt(v[i], 6), String(r.codes[i]), String(r.codes[i] - z), fmt(back, 6),
         fmt(r.error[i], 3), fmt(Math.abs(r.error[i]) / s, 3)].forEach(function (t) { tr.appendChild(el("td", null, t)); });
        table.appendChild(tr);
      }
      detailBox.appendChild(el("p", "qp-detail-title", "Group " + picked + ": weights " + picked * g + " to " +
        ((picked + 1) * g - 1) + ", scale " + fmt(s, 6) + ", zero point " + z + "."));
      detailBox.appendChild(table);
    }

    function drawPlot(v, r) {
      while (plot.firstChild) plot.removeChild(plot.firstChild);
      var k = v.length, top = 0;
      v.forEach(function (w) { top = Math.max(top, Math.abs(w)); });
      top = top || 1;
      function x(i) { return 4 + 792 * (i + 0.5) / k; }
      function y(w) { return 75 - 68 * w / top; }
      function line(x1, y1, x2, y2, colour, width) {
        var l = document.createElementNS(svgNS, "line");
        l.setAttribute("x1", x1); l.setAttribute("y1", y1); l.setAttribute("x2", x2); l.setAttribute("y2", y2);
        l.setAttribute("stroke", colour); l.setAttribute("stroke-width", width);
        plot.appendChild(l);
      }
      line(0, 75, 800, 75, "#999", 0.5);
      for (var j = 1; j < r.scales.length; j++) line(4 + 792 * j * r.group_size / k, 0, 4 + 792 * j * r.group_size / k, 150, "#bbb", 1);
      v.forEach(function (w, i) {
        var back = f32(w - r.error[i]);
        line(x(i), y(w), x(i), y(back), "#d32f2f", 1.5);       // the error, red
        var dot = document.createElementNS(svgNS, "circle");
        dot.setAttribute("cx", x(i)); dot.setAttribute("cy", y(w)); dot.setAttribute("r", 1.6);
        dot.setAttribute("fill", "#1565c0");
        plot.appendChild(dot);
      });
    }

    [rowPick, bitsPick, groupPick, symPick, outlier].forEach(function (n) { n.addEventListener("change", render); });
    CourseSim.report(banner, "quantization-playground",
                     "The page's quantizer disagrees with the Python export: ", selfCheck(data), 5);
    render();
  }

  CourseSim.register("quantization-playground", mount);
})();
