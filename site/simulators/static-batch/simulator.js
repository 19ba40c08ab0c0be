/* S08 "Try it": one static batch, replayed step by step, rows by cache columns.
 *
 * The batches are real: export.py (beside this file) ran them at build time through
 * code/s08_static_batching.py's Engine on the bundled model and recorded, per request, its
 * prompt, its padding and every generated token with the step that made it, and the engine's
 * own waste counters (one StepWaste per step). What the page draws and counts is computed here
 * from the prompt and output lengths alone, with the chapter's rules:
 *   - the block is padded on the left to T = the longest prompt; step 1 is the prefill, B x T
 *     slots, the prompts' tokens useful and the rest padding; it yields every row's first token;
 *   - each later step s is one decode column for every row: row i is useful while it still has
 *     tokens to make (output_i >= s) and idle otherwise, a finished row keeping its slot until the
 *     longest row is done; the step also reads every row's padding keys and masks them out;
 *   - cache column c >= T holds the token that decode step c - T + 2 fed back: generated token
 *     c - T of the row while it is not the row's last, else a column computed for nothing.
 * On load the page checks its counts against the exported StepWastes and its grid against the
 * exported BatchStats.timeline() (console error and a visible banner if they disagree).
 */
(function () {
  "use strict";

  var KINDS = {".": "sb-pad", "P": "sb-prompt", "G": "sb-gen", "-": "sb-idle"};
  var FIELDS = ["kind", "rows", "columns", "useful", "padding", "idle", "masked_keys"];

  var el = CourseSim.el;

  var show = CourseSim.breaks;

  function Batch(spec, eosId) {
    this.spec = spec;
    this.eos = eosId;
    this.B = spec.rows.length;
    this.prompts = spec.rows.map(function (r) { return r.prompt_ids.length; });
    this.outputs = spec.rows.map(function (r) { return r.generated.length; });
    this.T = Math.max.apply(null, this.prompts);
    this.longest = Math.max.apply(null, this.outputs);
    this.steps = this.longest;                     // one prefill, then longest - 1 decodes
    this.columns = this.T + this.steps - 1;
  }

  Batch.prototype.stepWaste = function (s) {       // s = 1 .. steps, as the engine counts it
    var self = this, sum = function (xs) { return xs.reduce(function (a, b) { return a + b; }, 0); };
    var pads = this.prompts.map(function (p) { return self.T - p; });
    if (s === 1) {
      return {kind: "prefill", rows: this.B, columns: this.T, useful: sum(this.prompts),
              padding: sum(pads), idle: 0, masked_keys: 0};
    }
    var busy = this.outputs.filter(function (n) { return n >= s; }).length;
    return {kind: "decode", rows: this.B, columns: 1, useful: busy, padding: 0,
            idle: this.B - busy, masked_keys: sum(pads)};
  };

  Batch.prototype.cell = function (row, col) {     // the timeline character of a cache column
    var pad = this.T - this.prompts[row];
    if (col < pad) return ".";
    if (col < this.T) return "P";
    return col - this.T < this.outputs[row] - 1 ? "G" : "-";
  };

  Batch.prototype.computedAt = function (col) {    // the step that computes column col
    return col < this.T ? 1 : col - this.T + 2;
  };

  Batch.prototype.check = function () {            // against the engine's own counters
    var problems = [], self = this;
    if (this.spec.steps.length !== this.steps) problems.push("step count");
    this.spec.steps.forEach(function (exported, i) {
      var mine = self.stepWaste(i + 1);
      FIELDS.forEach(function (f) {
        if (mine[f] !== exported[f]) problems.push("step " + (i + 1) + " " + f);
      });
    });
    this.spec.timeline.forEach(function (line, r) {
      var mine = "";
      for (var c = 0; c < self.columns; c++) mine += self.cell(r, c);
      if (mine !== line) problems.push("timeline row " + r);
    });
    return problems;
  };

  function mount(root, data) {
    var wrap = el("div", "sb-sim");
    root.appendChild(wrap);
    var banner = el("p", "sb-banner");
    banner.hidden = true;
    wrap.appendChild(banner);

    var controls = window.CourseSim.stepControls("sb-", {
      min: 1,
      choices: data.batches.map(function (b) { return b.title; }),
      pickLabel: "batch",
      labels: {reset: "back to the prefill"},
      text: function (s, last) { return "step " + s + " of " + last + " (" + (s === 1 ? "prefill" : "decode") + ")"; },
      onChoose: choose,
      onStep: function (s) { step = s; render(); }
    });
    wrap.appendChild(controls.row);

    var gridBox = el("div", "sb-grid-box");
    wrap.appendChild(gridBox);
    var legend = el("p", "sb-legend");
    [["sb-pad", "padding"], ["sb-prompt", "prompt token"], ["sb-gen", "generated token, fed back"],
     ["sb-idle", "finished row, still computed"], ["sb-future", "not computed yet"]]
      .forEach(function (item) {
        var key = el("span", "sb-key");
        key.appendChild(el("span", "sb-cell " + item[0]));
        key.appendChild(document.createTextNode(" " + item[1]));
        legend.appendChild(key);
      });
    wrap.appendChild(legend);
    var counters = el("table", "sb-counters");
    wrap.appendChild(counters);
    var note = el("p", "sb-note");
    wrap.appendChild(note);

    var batch = null, step = 1;
    var problems = [];
    data.batches.forEach(function (spec) {
      var b = new Batch(spec, data.eos_id);
      b.check().forEach(function (p) { problems.push(spec.id + ": " + p); });
    });
    if (problems.length) {
      var message = "static-batch: the page's counts differ from the S08 engine's: " +
                    problems.slice(0, 5).join("; ");
      console.error(message);
      banner.textContent = message;
      banner.hidden = false;
    }

    function textSoFar(row, s) {
      var r = batch.spec.rows[row];
      if (Math.min(s, batch.outputs[row]) === batch.outputs[row]) return r.text;
      return r.generated.filter(function (g) { return g[0] <= s && g[1] !== batch.eos; })
        .map(function (g) { return g[2]; }).join("");
    }

    function drawGrid() {
      gridBox.textContent = "";
      var table = el("table", "sb-grid");
      for (var r = 0; r < batch.B; r++) {
        var tr = el("tr", "sb-grid-row");
        tr.setAttribute("data-row", String(r));
        tr.appendChild(el("th", "sb-row-name", "row " + r));
        var cells = el("td", "sb-cells");
        for (var c = 0; c < batch.columns; c++) {
          var at = batch.computedAt(c);
          var cls = at <= step ? KINDS[batch.cell(r, c)] : "sb-future";
          var span = el("span", "sb-cell " + cls + (at === step ? " sb-now" : ""));
          span.setAttribute("data-col", String(c));
          var rowSpec = batch.spec.rows[r], pad = batch.T - batch.prompts[r];
          if (c >= pad && c < batch.T) span.title = show(rowSpec.prompt_pieces[c - pad]);
          else if (c >= batch.T && c - batch.T < rowSpec.generated.length)
            span.title = show(rowSpec.generated[c - batch.T][2]);
          cells.appendChild(span);
        }
        tr.appendChild(cells);
        var made = Math.min(step, batch.outputs[r]);
        var done = made === batch.outputs[r];
        var status = el("td", "sb-status" + (done ? " sb-done" : ""),
                        made + " token" + (made === 1 ? "" : "s") +
                        (done ? ", finished (" + batch.spec.rows[r].finish_reason + ")" : ", running"));
        tr.appendChild(status);
        var text = el("td", "sb-text", show(textSoFar(r, step)));
        tr.appendChild(text);
        table.appendChild(tr);
      }
      gridBox.appendChild(table);
    }

    function drawCounters() {
      var now = batch.stepWaste(step);
      var total = {slots: 0, useful: 0, padding: 0, idle: 0};
      for (var s = 1; s <= step; s++) {
        var w = batch.stepWaste(s);
        total.slots += w.rows * w.columns;
        total.useful += w.useful;
        total.padding += w.padding;
        total.idle += w.idle;
      }
      counters.textContent = "";
      var head = el("tr");
      ["", "kind", "rows", "columns", "slots", "useful", "padding", "idle", "masked keys"]
        .forEach(function (h) { head.appendChild(el("th", null, h)); });
      counters.appendChild(head);
      var row1 = el("tr", "sb-this-step");
      [["", "this step"], ["kind", now.kind], ["rows", now.rows], ["columns", now.columns],
       ["slots", now.rows * now.columns], ["useful", now.useful], ["padding", now.padding],
       ["idle", now.idle], ["masked_keys", now.masked_keys]].forEach(function (kv) {
        var td = el("td", kv[0] ? "sb-num" : "sb-name", String(kv[1]));
        if (kv[0]) td.setAttribute("data-field", kv[0]);
        row1.appendChild(td);
      });
      counters.appendChild(row1);
      var row2 = el("tr", "sb-so-far");
      [["", "steps 1.." + step], ["kind", ""], ["rows", ""], ["columns", ""],
       ["slots", total.slots], ["useful", total.useful], ["padding", total.padding],
       ["idle", total.idle], ["masked_keys", ""]].forEach(function (kv) {
        var td = el("td", kv[0] ? "sb-num" : "sb-name", String(kv[1]));
        if (kv[0]) td.setAttribute("data-field", kv[0]);
        row2.appendChild(td);
      });
      counters.appendChild(row2);
      var share = total.slots ? (100 * total.useful / total.slots).toFixed(1) : "100.0";
      note.textContent = "So far " + total.slots + " token slots computed, " + share +
        "% useful. " + (step === batch.steps ?
          "The batch is done: " + total.idle + " of " + (batch.B * (batch.steps - 1)) +
          " decode row-steps went to rows that had already finished (S09's continuous " +
          "batching gives those slots to waiting requests)." :
          "The batch ends when its longest row does, at step " + batch.steps + ".");
    }

    function render() {
      drawGrid();
      drawCounters();
    }

    function choose(i) {
      batch = new Batch(data.batches[i], data.eos_id);
      controls.setLast(batch.steps);
      controls.go(1);
    }

    choose(0);
  }

  window.CourseSim.register("static-batch", mount);
})();
