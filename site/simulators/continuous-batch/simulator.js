/* S09 "Try it": the same requests served by static batches (S08) and by continuous batching
 * (S09), step by step, slots by steps.
 *
 * The runs are real: export.py (beside this file) ran each workload at build time through
 * code/s08_static_batching.py's Engine (static batches of max_batch requests in order) and
 * code/s09_continuous_batching.py's LLMEngine (max_num_seqs = max_batch), on the bundled model,
 * and recorded every request's tokens and the S09 engine's trace (one StepRecord per step).
 * The page recomputes both schedules from the output lengths alone, with the chapters' rules:
 *   - static: batch b holds requests b*M .. b*M + M - 1 in slots 0 .. M - 1 and runs max(n)
 *     steps (step 1 the prefill, which makes every row's first token); a row that has made its
 *     n tokens keeps its slot, computed for nothing, until the batch ends;
 *   - continuous: S10's scheduler model (CourseSim.Scheduler, site/static/course.js) with
 *     S09's settings: no token budget, no KV limit, max_batch seats. Before every step,
 *     waiting requests take free slots, oldest first, lowest slot first; every running request
 *     makes one token per step; a request that has made its n tokens leaves at the end of that
 *     step and its slot is free for the next; the running requests are kept in admission
 *     order, as the engine's FIFO scheduler keeps them.
 * On load it checks its continuous schedule against the exported trace and its static step
 * counts against S08's BatchStats (console error and a visible banner if they disagree).
 */
(function () {
  "use strict";

  var el = CourseSim.el, sum = CourseSim.sum, same = CourseSim.same, show = CourseSim.breaks;

  // Static: cells[slot][step - 1] = {req, kind} with kind "prefill" | "run" | "idle" | "free".
  function staticSchedule(outputs, M) {
    var cells = [], batches = [], s;
    for (s = 0; s < M; s++) cells.push([]);
    for (var lo = 0; lo < outputs.length; lo += M) {
      var members = [];
      for (var i = lo; i < Math.min(lo + M, outputs.length); i++) members.push(i);
      var steps = Math.max.apply(null, members.map(function (r) { return outputs[r]; }));
      batches.push({members: members, steps: steps});
      for (var k = 1; k <= steps; k++) {
        for (s = 0; s < M; s++) {
          var r = members[s];
          if (r === undefined) cells[s].push({req: null, kind: "free"});
          else cells[s].push({req: r, kind: k === 1 ? "prefill" : (k <= outputs[r] ? "run" : "idle")});
        }
      }
    }
    return {cells: cells, batches: batches, steps: cells[0].length};
  }

  // Continuous: cells[slot][step] = {req, kind}, and the scheduler model's records.
  function continuousSchedule(requests, M) {
    var sched = new CourseSim.Scheduler({maxNumSeqs: M});
    var records = sched.run(requests.map(function (r) {
      return {id: r.id, at: 0, tokens: r.prompt_len, target: r.generated.length};
    }));
    var cells = [], s;
    for (s = 0; s < M; s++) cells.push([]);
    records.forEach(function (rec) {
      for (s = 0; s < M; s++) cells[s].push({req: null, kind: "free"});
      rec.scheduled.forEach(function (x) {
        cells[x.slot][rec.step] = {req: Number(x.id), kind: x.kind === "prefill" ? "prefill" : "run"};
      });
    });
    return {cells: cells, records: records, steps: records.length};
  }

  function Workload(spec) {
    this.spec = spec;
    this.M = spec.max_batch;
    this.outputs = spec.requests.map(function (r) { return r.generated.length; });
    this.st = staticSchedule(this.outputs, this.M);
    this.cb = continuousSchedule(spec.requests, this.M);
    this.steps = Math.max(this.st.steps, this.cb.steps);
  }

  Workload.prototype.check = function () {
    var problems = [], self = this;
    if (this.spec.trace.length !== this.cb.steps) problems.push("continuous step count");
    this.spec.trace.forEach(function (t, i) {
      var mine = self.cb.records[i];
      if (!mine) return;
      var at = "step " + (i + 1) + " ";
      var ids = mine.scheduled.map(function (x) { return x.id; });
      var slots = mine.scheduled.map(function (x) { return x.slot; });
      if (!same(ids, t.running)) problems.push(at + "running");
      if (!same(slots, t.slots)) problems.push(at + "slots");
      if (!same(mine.joined, t.joined)) problems.push(at + "joined");
      if (!same(mine.left, t.left)) problems.push(at + "left");
      if (mine.waiting.length !== t.waiting || mine.freeSlots !== t.free_slots) problems.push(at + "queue");
    });
    var batches = this.spec.static.batches;
    if (batches.length !== this.st.batches.length) problems.push("static batch count");
    batches.forEach(function (b, i) {
      var mine = self.st.batches[i];
      if (mine && mine.steps !== b.steps) problems.push("static batch " + i + " steps");
    });
    return problems;
  };

  // Counters after step t (1-based) of one schedule.
  function counts(cells, outputs, t) {
    var tokens = 0, idle = 0, free = 0, done = 0, seen = {};
    cells.forEach(function (row) {
      row.slice(0, t).forEach(function (c) {
        if (c.kind === "prefill" || c.kind === "run") {
          tokens += 1;
          seen[c.req] = (seen[c.req] || 0) + 1;
        } else if (c.kind === "idle") idle += 1;
        else free += 1;
      });
    });
    Object.keys(seen).forEach(function (r) { if (seen[r] >= outputs[r]) done += 1; });
    return {step: Math.min(t, cells[0].length), finished: done, tokens: tokens, idle: idle,
            free: free};
  }

  function mount(root, data) {
    var wrap = el("div", "cb-sim");
    root.appendChild(wrap);
    var banner = el("p", "cb-banner");
    banner.hidden = true;
    wrap.appendChild(banner);

    var controls = CourseSim.stepControls("cb-", {
      min: 1,
      choices: data.workloads.map(function (w) { return w.title; }),
      onChoose: choose,
      onStep: function (s) { step = s; render(); }
    });
    wrap.appendChild(controls.row);

    wrap.appendChild(CourseSim.legend("cb-", [
      ["cb-prefill", "joins: prompt computed, first token"], ["cb-run", "running: one token"],
      ["cb-idle", "finished, slot still computed (static)"], ["cb-free", "slot empty"],
      ["cb-future", "not yet"]]));

    var panels = {};
    [["static", "Static batches (S08)"], ["cont", "Continuous batching (S09)"]].forEach(function (p) {
      var box = el("div", "cb-panel cb-panel-" + p[0]);
      box.appendChild(el("h4", "cb-panel-title", p[1]));
      var gridBox = el("div", "cb-grid-box");
      box.appendChild(gridBox);
      var stats = el("table", "cb-stats cb-stats-" + p[0]);
      var head = el("tr"), body = el("tr");
      ["step", "finished", "tokens", "idle", "free"].forEach(function (f) {
        head.appendChild(el("th", null, f === "idle" ? "finished rows computed" :
                                         f === "free" ? "empty slot-steps" : f));
        var td = el("td");
        td.dataset.field = f;
        body.appendChild(td);
      });
      stats.appendChild(head);
      stats.appendChild(body);
      box.appendChild(stats);
      wrap.appendChild(box);
      panels[p[0]] = {grid: gridBox, stats: stats};
    });
    var note = el("p", "cb-note");
    wrap.appendChild(note);
    var reqBox = el("div", "cb-requests");
    wrap.appendChild(reqBox);

    var work = null, step = 1;

    function drawGrid(panel, cells, cls) {
      panel.grid.textContent = "";
      var table = el("table", "cb-grid " + cls);
      cells.forEach(function (row, s) {
        var tr = el("tr", "cb-grid-row");
        tr.appendChild(el("th", "cb-slot", "slot " + s));
        row.forEach(function (c, k) {
          var kind = k < step ? "cb-" + c.kind : "cb-future";
          var td = el("td", "cb-cell " + kind, k < step && c.req !== null ? String(c.req) : "");
          tr.appendChild(td);
        });
        table.appendChild(tr);
      });
      panel.grid.appendChild(table);
    }

    function fill(panel, values, total) {
      panel.stats.querySelectorAll("td[data-field]").forEach(function (td) {
        var f = td.dataset.field;
        td.textContent = f === "step" ? values.step + " of " + total : String(values[f]);
      });
    }

    function render() {
      drawGrid(panels.static, work.st.cells, "cb-grid-static");
      drawGrid(panels.cont, work.cb.cells, "cb-grid-cont");
      fill(panels.static, counts(work.st.cells, work.outputs, step), work.st.steps);
      fill(panels.cont, counts(work.cb.cells, work.outputs, step), work.cb.steps);
      var rec = work.spec.trace[Math.min(step, work.cb.steps) - 1];
      var msg = step <= work.cb.steps
        ? "Continuous, step " + step + ": " + rec.num_tokens + " tokens in the ragged batch (" +
          rec.prefill_tokens + " of them prompt tokens); joined: " + (rec.joined.join(", ") || "none") +
          "; left: " + (rec.left.join(", ") || "none") + "; waiting: " + rec.waiting + "."
        : "Continuous batching is done after " + work.cb.steps + " steps; the static batches need " +
          work.st.steps + ".";
      if (step >= work.steps) msg += " Both are done: " + work.st.steps + " static steps against " +
          work.cb.steps + " continuous steps for the same " + sum(work.outputs) + " tokens.";
      note.textContent = msg;
      reqBox.textContent = "";
      var table = el("table", "cb-req-table");
      var head = el("tr");
      ["request", "prompt", "max_tokens", "made (continuous)", "completion so far (continuous)"].forEach(function (h) {
        head.appendChild(el("th", null, h));
      });
      table.appendChild(head);
      work.spec.requests.forEach(function (r, i) {
        var tr = el("tr", "cb-req");
        var n = 0;
        work.cb.cells.forEach(function (row) {
          row.slice(0, step).forEach(function (c) { if (c.req === i && c.kind !== "free") n += 1; });
        });
        var status = n + " token" + (n === 1 ? "" : "s") + (n >= work.outputs[i] ? ", finished (" + r.finish_reason + ")" : "");
        tr.appendChild(el("td", null, r.id));
        tr.appendChild(el("td", null, r.prompt_len + " tokens"));
        tr.appendChild(el("td", null, String(r.max_tokens)));
        tr.appendChild(el("td", "cb-status", status));
        tr.appendChild(el("td", "cb-text", show(r.generated.slice(0, n).map(function (g) { return g[2]; }).join(""))));
        table.appendChild(tr);
      });
      reqBox.appendChild(table);
    }

    function choose(index) {
      work = new Workload(data.workloads[index]);
      CourseSim.report(banner, "continuous-batch",
                       "The page's schedule disagrees with the engine's trace: ", work.check());
      controls.setLast(work.steps);
      controls.go(1);
    }

    choose(0);
  }

  CourseSim.register("continuous-batch", mount);
})();
