/* S03 "Try it": the bundled transformer's attention patterns and next-token distributions.
 *
 * Nothing is computed here but colours and layout: the attention weights of every layer and
 * head, and the next-token distributions at a few temperatures, were computed at build time by
 * code/s03_transformer.py on the bundled model (site/simulators/transformer-attention/export.py).
 * Rows of the heat map are query positions, columns key positions; the upper triangle is empty
 * because of the causal mask. Clicking a row shows where that position looks and what the model
 * predicts after it.
 */
(function () {
  "use strict";

  var CSS = [
    ".ta-row { display: flex; flex-wrap: wrap; gap: 0.6rem 1.2rem; align-items: flex-end; margin-bottom: 0.6rem; }",
    ".ta-field { display: flex; flex-direction: column; font-size: 0.85em; }",
    ".ta-field span { font-weight: 600; margin-bottom: 0.15rem; }",
    ".ta-main { display: flex; flex-wrap: wrap; gap: 1.2rem; align-items: flex-start; }",
    ".ta-map { border-collapse: collapse; font-family: var(--font-stack--monospace, monospace); font-size: 0.72em; }",
    ".ta-map td, .ta-map th { padding: 0; }",
    ".ta-cell { width: 1.15rem; height: 1.15rem; border: 1px solid rgba(127,127,127,0.15); }",
    ".ta-qlabel { text-align: right; padding-right: 0.3rem !important; white-space: pre; cursor: pointer; }",
    ".ta-klabel { height: 4.2rem; vertical-align: bottom; }",
    ".ta-klabel div { writing-mode: vertical-rl; transform: rotate(180deg); white-space: pre; }",
    ".ta-selected .ta-qlabel { font-weight: 700; color: #b45309; }",
    ".ta-selected .ta-cell { outline: 1px solid #f59e0b; }",
    ".ta-side { flex: 1 1 16rem; min-width: 14rem; max-width: 28rem; font-size: 0.9em; }",
    ".ta-h { font-weight: 600; margin: 0.2rem 0 0.3rem 0; }",
    ".ta-bar-row { display: grid; grid-template-columns: 6.5rem 1fr 3.6rem; gap: 0.4rem; align-items: center; margin: 1px 0; }",
    ".ta-bar-label { font-family: var(--font-stack--monospace, monospace); text-align: right; white-space: pre; overflow: hidden; }",
    ".ta-bar-track { background: rgba(127,127,127,0.15); height: 0.8rem; border-radius: 3px; }",
    ".ta-bar { display: block; height: 100%; border-radius: 3px; background: #60a5fa; }",
    ".ta-attn .ta-bar { background: #f59e0b; }",
    ".ta-bar-value { font-variant-numeric: tabular-nums; text-align: right; }",
    ".ta-note { font-size: 0.88em; margin: 0.4rem 0; }"
  ].join("\n");

  var el = CourseSim.el;

  function show(token) {   // make whitespace visible in labels
    return token.replace(/\n/g, "\u21b5").replace(/ /g, "\u2423");
  }

  function field(label, control) {
    var f = el("label", "ta-field");
    f.appendChild(el("span", "", label));
    f.appendChild(control);
    return f;
  }

  function select(options, value) {
    var s = el("select");
    options.forEach(function (o) {
      var opt = el("option", "", o[1]);
      opt.value = String(o[0]);
      s.appendChild(opt);
    });
    s.value = String(value);
    return s;
  }

  function bar(label, value, cls) {
    var row = el("div", "ta-bar-row" + (cls ? " " + cls : ""));
    row.appendChild(el("span", "ta-bar-label", label));
    var track = el("span", "ta-bar-track");
    var fill = el("span", "ta-bar");
    fill.style.width = (100 * Math.max(0, Math.min(1, value))).toFixed(1) + "%";
    track.appendChild(fill);
    row.appendChild(track);
    row.appendChild(el("span", "ta-bar-value", value.toFixed(4)));
    return row;
  }

  function mount(root, data) {
    if (!document.getElementById("ta-style")) {
      var style = el("style");
      style.id = "ta-style";
      style.textContent = CSS;
      document.head.appendChild(style);
    }
    if (!data.available) {
      root.appendChild(el("p", "ta-note", "This build has no bundled model, so there is nothing " +
                                          "to show: " + data.reason));
      root.taSim = {available: false};
      return;
    }
    var m = data.model;
    var state = {prompt: 0, layer: 0, head: 0, query: null, temperature: "1.0"};

    var promptSel = select(data.prompts.map(function (p, i) {
      return [i, p.text.replace(/\n/g, " / ")];
    }), 0);
    var layerSel = select(Array.from({length: m.L}, function (_, i) { return [i, "layer " + i]; }), 0);
    var headSel = select(Array.from({length: m.H}, function (_, h) {
      return [h, "head " + h + " (K/V head " + Math.floor(h / (m.H / m.Hkv)) + ")"];
    }), 0);
    var tempSel = select([["greedy", "0 (greedy)"]].concat(data.temperatures.map(function (t) {
      return [t.toFixed(1), t.toFixed(1)];
    })), "1.0");

    var controls = el("div", "ta-row");
    controls.appendChild(field("prompt", promptSel));
    controls.appendChild(field("layer", layerSel));
    controls.appendChild(field("query head", headSel));
    controls.appendChild(field("temperature", tempSel));
    root.appendChild(controls);
    root.appendChild(el("p", "ta-note", "Bundled model: " + m.parameters.toLocaleString("en-US") +
      " parameters, L = " + m.L + ", H = " + m.H + " query heads sharing Hkv = " + m.Hkv +
      " key/value heads, D = " + m.D + ", V = " + m.V + ". Click a row (a query position)."));

    var main = el("div", "ta-main");
    var mapBox = el("div");
    var side = el("div", "ta-side");
    main.appendChild(mapBox);
    main.appendChild(side);
    root.appendChild(main);

    function weights(prompt, layer, head, t) {   // attention row t: t + 1 weights
      var flat = prompt.attn[layer][head];
      var start = t * (t + 1) / 2;
      return flat.slice(start, start + t + 1);
    }

    function tempKey(t) { return t; }   // export.py keys distributions by "%.1f" % T

    function render() {
      var p = data.prompts[state.prompt];
      var T = p.tokens.length;
      if (state.query === null || state.query >= T) state.query = T - 1;
      mapBox.textContent = "";
      var table = el("table", "ta-map");
      var head = el("tr");
      head.appendChild(el("th"));
      p.tokens.forEach(function (tok) {
        var th = el("th", "ta-klabel");
        th.appendChild(el("div", "", show(tok)));
        head.appendChild(th);
      });
      table.appendChild(head);
      for (var t = 0; t < T; t++) {
        var tr = el("tr", t === state.query ? "ta-selected" : "");
        tr.setAttribute("data-query", String(t));
        tr.appendChild(el("th", "ta-qlabel", show(p.tokens[t])));
        var w = weights(p, state.layer, state.head, t);
        for (var s = 0; s < T; s++) {
          var td = el("td", "ta-cell");
          if (s <= t) {
            td.style.background = "rgba(37, 99, 235, " + Math.sqrt(w[s]).toFixed(3) + ")";
            td.title = show(p.tokens[t]) + " \u2192 " + show(p.tokens[s]) + ": " + w[s].toFixed(4);
          }
          tr.appendChild(td);
        }
        tr.addEventListener("click", (function (q) {
          return function () { state.query = q; render(); };
        })(t));
        table.appendChild(tr);
      }
      mapBox.appendChild(table);
      mapBox.appendChild(el("p", "ta-note", "colour: square root of the weight, so small " +
                                            "weights stay visible"));

      side.textContent = "";
      var q = state.query;
      side.appendChild(el("div", "ta-h", "Position " + q + " (" + show(p.tokens[q]) +
        "), layer " + state.layer + ", head " + state.head + ": where it looks"));
      var w = weights(p, state.layer, state.head, q);
      var order = w.map(function (_, i) { return i; }).sort(function (a, b) { return w[b] - w[a]; });
      var attnBox = el("div", "ta-attn");
      order.slice(0, 6).forEach(function (s) {
        attnBox.appendChild(bar(s + " " + show(p.tokens[s]), w[s]));
      });
      side.appendChild(attnBox);

      var next = p.next[q];
      side.appendChild(el("div", "ta-h", "The model's next token after position " + q));
      if (state.temperature === "greedy") {
        side.appendChild(el("p", "ta-note", "Temperature 0 picks the argmax: " +
                                            show(next.greedy)));
      } else {
        next[tempKey(state.temperature)].forEach(function (pair) {
          side.appendChild(bar(show(pair[0]), pair[1]));
        });
        side.appendChild(el("p", "ta-note", "top " + next[tempKey(state.temperature)].length +
          " of " + m.V + " tokens, softmax(logits / " + state.temperature + ")"));
      }
    }

    promptSel.addEventListener("change", function () { state.prompt = +promptSel.value; state.query = null; render(); });
    layerSel.addEventListener("change", function () { state.layer = +layerSel.value; render(); });
    headSel.addEventListener("change", function () { state.head = +headSel.value; render(); });
    tempSel.addEventListener("change", function () { state.temperature = tempSel.value; render(); });
    render();
    root.taSim = {available: true, state: state, render: render, weights: weights};
  }

  window.CourseSim.register("transformer-attention", mount);
})();
