/* S16 "Try it": recorded decode steps of the engine, replayed eager, with a graph-replayed
 * forward, with async scheduling, and with both, on one time axis.
 *
 * export.py (beside this file) ran code/s13_prefix_caching.py's engine on the bundled model at
 * build time with code/s16_profile.py's StepProfiler attached and kept a window of decode steps
 * per batch size: each phase's milliseconds (schedule, prepare, forward, sample, postprocess,
 * update). `schedule` and `summary` below are line-by-line transcriptions of the functions of
 * the same names in export.py (same operations in the same order, so the same doubles):
 * - eager: one lane; every phase of a step in turn, then the next step;
 * - graph: the same, each forward replaced by the compiled step's time (from the benchmark
 *   record, or the static step run eagerly when there is none: the page says which);
 * - async: two lanes. The worker runs step N's prepare and forward; the host waits for its
 *   logits, samples, launches step N + 1, then does step N's postprocess and update and plans
 *   step N + 2 while forward N + 1 runs (step 1 is planned while forward 0 runs);
 * - graph+async: async with the graph's forward.
 * On load the page recomputes every exported reference schedule and shows a banner (and a
 * console error) if one differs. Every box is an SVG rect carrying data-mode, data-lane,
 * data-phase, data-step, data-start and data-end (milliseconds, shortest round-trip text); a
 * box that takes any time is drawn at least 1 px wide.
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count;
  var SVG = "http://www.w3.org/2000/svg";
  var PHASES = ["schedule", "prepare", "forward", "sample", "postprocess", "update"];
  var MODES = ["eager", "graph", "async", "graph+async"];
  var COLOURS = {schedule: "#8e6cc0", prepare: "#d08c2f", forward: "#3a78c2", sample: "#2e9e6a",
                 postprocess: "#c95c5c", update: "#7a7a7a"};
  var WORDS = {schedule: "schedule (plan the step)", prepare: "prepare (the batch's inputs)",
               forward: "forward (the model)", sample: "sample",
               postprocess: "postprocess (text, stop rules)", update: "update (the scheduler told)"};
  var STYLE = [
    ".so-sim select, .so-sim button { font: inherit; font-size: 0.9em; padding: 0.15rem 0.45rem;",
    "  border: 1px solid var(--color-background-border, #ccc); border-radius: 4px;",
    "  background: var(--color-background-primary, #fff); color: var(--color-foreground-primary, #222); }",
    ".so-sim select { max-width: 100%; }",
    ".so-row { display: flex; flex-wrap: wrap; gap: 0.4rem 0.9rem; align-items: center; margin: 0.4rem 0; }",
    ".so-field { display: inline-flex; gap: 0.3rem; align-items: center; font-size: 0.9em; }",
    ".so-banner { color: #b00020; font-weight: 600; }",
    ".so-note, .so-legend, .so-source, .so-check, .so-measured, .so-verdict { font-size: 0.88em; margin: 0.3rem 0; }",
    ".so-legend { display: flex; flex-wrap: wrap; gap: 0.3rem 0.9rem; }",
    ".so-legend-item { display: inline-flex; gap: 0.3rem; align-items: center; }",
    ".so-swatch { display: inline-block; width: 1.1rem; height: 0.8rem; border-radius: 2px; }",
    ".so-svg-wrap { width: 100%; overflow: hidden; }",
    ".so-svg-wrap svg { display: block; }",
    ".so-svg-wrap text { fill: var(--color-foreground-primary, #222); font-size: 12px; }",
    ".so-lane { fill: rgba(128, 128, 128, 0.08); stroke: rgba(128, 128, 128, 0.35); stroke-width: 0.5; }",
    ".so-odd { fill-opacity: 0.62; }",
    ".so-out { stroke: var(--color-foreground-primary, #222); stroke-width: 1; }",
    ".so-table-wrap { max-width: 100%; overflow-x: auto; }",
    "table.so-table { border-collapse: collapse; font-size: 0.84em; margin: 0.3rem 0; }",
    ".so-table th, .so-table td { border: 1px solid var(--color-background-border, #ccc); padding: 2px 6px; }",
    ".so-table td.so-num { text-align: right; font-variant-numeric: tabular-nums; }"
  ].join("\n");

  // ---------------------------------------------------------------------------------------------
  // The schedule (export.py's `schedule` and `summary`)
  // ---------------------------------------------------------------------------------------------

  function schedule(mode, steps, graphForwardMs) {
    var graph = mode.indexOf("graph") === 0;
    var lengths = steps.map(function (step) {
      var row = {};
      PHASES.forEach(function (phase) { row[phase] = step[phase + "_ms"]; });
      if (graph) row.forward = graphForwardMs;
      return row;
    });
    var host = [], worker = [], outputsAt = [];

    function box(lane, phase, i, start) {
      var end = start + lengths[i][phase];
      lane.push([phase, i, start, end]);
      return end;
    }

    var n = lengths.length, i;
    if (mode.slice(-5) !== "async") {
      var t = 0.0;
      for (i = 0; i < n; i++) {
        for (var p = 0; p < PHASES.length; p++) {
          t = box(host, PHASES[p], i, t);
          if (PHASES[p] === "postprocess") outputsAt.push(t);
        }
      }
      return {lanes: {host: host, worker: worker}, outputs_at: outputsAt, end: t};
    }

    var h = box(host, "schedule", 0, 0.0);            // plan step 0
    var w = box(worker, "prepare", 0, h);             // launch it
    var forwardEnd = box(worker, "forward", 0, w);
    if (n > 1) h = box(host, "schedule", 1, h);       // plan step 1 while forward 0 runs
    for (i = 0; i < n; i++) {
      h = box(host, "sample", i, Math.max(h, forwardEnd));   // wait for step i's logits
      if (i + 1 < n) {                                // launch step i + 1 with its tokens
        w = box(worker, "prepare", i + 1, h);
        forwardEnd = box(worker, "forward", i + 1, w);
      }
      h = box(host, "postprocess", i, h);
      outputsAt.push(h);
      h = box(host, "update", i, h);
      if (i + 2 < n) h = box(host, "schedule", i + 2, h);   // plan step i + 2 while i + 1 runs
    }
    return {lanes: {host: host, worker: worker}, outputs_at: outputsAt, end: Math.max(h, forwardEnd)};
  }

  function summary(result, steps) {
    var busy = {host: 0.0, worker: 0.0};
    ["host", "worker"].forEach(function (lane) {
      result.lanes[lane].forEach(function (b) { busy[lane] += b[3] - b[2]; });
    });
    return {end: result.end, per_step: result.end / steps, host_busy: busy.host,
            worker_busy: busy.worker};
  }

  function close(a, b) {
    if (typeof a === "string" || typeof b === "string") return a === b;
    return Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b), 1e-300);
  }

  function sameSchedule(a, b) {
    if (!close(a.end, b.end) || a.outputs_at.length !== b.outputs_at.length) return false;
    for (var k = 0; k < a.outputs_at.length; k++) if (!close(a.outputs_at[k], b.outputs_at[k])) return false;
    var lanes = ["host", "worker"];
    for (var l = 0; l < lanes.length; l++) {
      var x = a.lanes[lanes[l]], y = b.lanes[lanes[l]];
      if (x.length !== y.length) return false;
      for (var i = 0; i < x.length; i++) {
        for (var j = 0; j < 4; j++) if (!close(x[i][j], y[i][j])) return false;
      }
    }
    return true;
  }

  function checkAll(data) {
    var problems = [];
    data.runs.forEach(function (run) {
      MODES.forEach(function (mode) {
        if (!sameSchedule(schedule(mode, run.steps, run.graph.forward_ms), run.reference[mode])) {
          problems.push(run.id + " " + mode);
        }
      });
    });
    return problems;
  }

  // ---------------------------------------------------------------------------------------------
  // Text
  // ---------------------------------------------------------------------------------------------

  function ms(x) {
    if (x >= 100) return x.toFixed(1) + " ms";
    if (x >= 1) return x.toFixed(2) + " ms";
    return (x * 1000).toFixed(0) + " µs";
  }

  function modeLabel(mode, run) {
    var graphName = run.graph.source === "record" ? "graph replay (compiled forward)"
                                                  : "static step, eager (no compiled figure)";
    return {eager: "eager: one thread, every phase in turn (S09's step)",
            graph: graphName + ": the forward replaced, host phases as recorded",
            async: "async scheduling: the next step planned while the forward runs",
            "graph+async": (run.graph.source === "record" ? "graph replay" : "static step") +
                           " + async scheduling"}[mode];
  }

  // ---------------------------------------------------------------------------------------------
  // The page
  // ---------------------------------------------------------------------------------------------

  function mount(root, data) {
    if (!document.getElementById("so-style")) {
      var style = el("style", {id: "so-style"});
      style.textContent = STYLE;
      document.head.appendChild(style);
    }
    var ui = el("div", "so-sim");
    root.appendChild(ui);
    var banner = el("p", "so-banner");
    banner.hidden = true;
    ui.appendChild(banner);
    var problems = checkAll(data);
    CourseSim.report(banner, "step-overlap", "The page's schedules differ from export.py's " +
                     "schedule() for: ", problems);

    var row = el("div", "so-row");
    ui.appendChild(row);
    function field(label, node) {
      var box = el("label", "so-field");
      box.appendChild(el("span", null, label));
      box.appendChild(node);
      row.appendChild(box);
      return node;
    }
    var runPick = field("run ", el("select", "so-run"));
    data.runs.forEach(function (r, i) { runPick.appendChild(el("option", {value: String(i)}, r.title)); });
    var stepsPick = field("steps shown ", el("select", "so-steps"));
    runPick.value = String(data.defaults.run);

    var note = el("p", "so-note");
    ui.appendChild(note);
    var legend = el("p", "so-legend");
    PHASES.forEach(function (phase) {
      var item = el("span", "so-legend-item");
      item.dataset.kind = phase;
      var sw = el("span", "so-swatch");
      sw.style.background = COLOURS[phase];
      item.appendChild(sw);
      item.appendChild(document.createTextNode(WORDS[phase]));
      legend.appendChild(item);
    });
    var tick = el("span", "so-legend-item");
    tick.appendChild(el("span", null, "|"));
    tick.appendChild(document.createTextNode("a step's outputs ready (its postprocess ends); odd steps paler"));
    legend.appendChild(tick);
    ui.appendChild(legend);
    var svgWrap = el("div", "so-svg-wrap");
    ui.appendChild(svgWrap);
    var tableWrap = el("div", "so-table-wrap");
    ui.appendChild(tableWrap);
    var verdict = el("p", "so-verdict");
    ui.appendChild(verdict);
    var measured = el("p", "so-measured");
    ui.appendChild(measured);
    var sources = el("div", "so-sources");
    ui.appendChild(sources);
    var checked = el("p", "so-check");
    checked.textContent = problems.length ? "" : "This page reproduces all " +
      data.runs.length * MODES.length + " reference schedules computed by export.py's schedule() (within 1e-9).";
    ui.appendChild(checked);

    var run = null;

    function choose(index) {
      run = data.runs[index];
      var keep = Number(stepsPick.value) || data.defaults.steps;
      stepsPick.textContent = "";
      for (var k = 1; k <= run.steps.length; k++) stepsPick.appendChild(el("option", {value: String(k)}, String(k)));
      stepsPick.value = String(Math.min(keep, run.steps.length));
      render();
    }

    function render() {
      var n = Number(stepsPick.value), steps = run.steps.slice(0, n);
      var results = {}, sums = {};
      MODES.forEach(function (mode) {
        results[mode] = schedule(mode, steps, run.graph.forward_ms);
        sums[mode] = summary(results[mode], n);
      });
      var hostMs = 0, fwdMs = 0;
      steps.forEach(function (s) {
        PHASES.forEach(function (p) { if (p === "forward") fwdMs += s[p + "_ms"]; else hostMs += s[p + "_ms"]; });
      });
      note.textContent = "The engine's decode steps " + run.steps[0].step + " to " + run.steps[n - 1].step +
        " (the quietest " + run.steps.length + " in a row of the " + data.search_steps + " after " +
        count(data.warmup_steps, "warm-up step") + ") with " + count(run.batch_size, "request") +
        ", as the StepProfiler timed them: " + ms(fwdMs / n) + " of forward and " + ms(hostMs / n) +
        " of host phases per step (" + (100 * hostMs / (hostMs + fwdMs)).toFixed(1) + "% host). " +
        "Every row below replays the same steps.";
      draw(results, n);
      tabulate(sums, n);
      var e = sums.eager.per_step, a = sums.async.per_step, g = sums.graph.per_step, ga = sums["graph+async"].per_step;
      var med = function (phase) {
        var xs = steps.map(function (s) { return s[phase + "_ms"]; }).sort(function (x, y) { return x - y; });
        return xs.length % 2 ? xs[(xs.length - 1) / 2] : (xs[xs.length / 2 - 1] + xs[xs.length / 2]) / 2;
      };
      var hiddenWork = med("postprocess") + med("update") + med("schedule");
      var workerWork = med("prepare") + run.graph.forward_ms;
      verdict.textContent = "Async scheduling takes " + ms(e - a) + " off an eager step of " + ms(e) +
        " (" + (100 * (e - a) / e).toFixed(1) + "%): postprocess, update and the next plan run while the " +
        "forward does; sample and the next step's prepare stay in line, since the next step needs the " +
        "tokens. " + (run.graph.source === "record"
          ? "The compiled forward takes " + ms(e - g) + " off a step; with both, a step is " + ms(ga) + ": " +
            (workerWork < hiddenWork
              ? "the compiled forward is now shorter than the host work it hides, so the host lane sets the pace."
              : "the worker lane still sets the pace.")
          : "Without a compiled figure the graph rows use the static step run eagerly (" +
            ms(run.graph.forward_ms) + " against the engine's " + ms(med("forward")) + " median forward): " +
            "the same ops one at a time, over the whole block table every step, so those rows show what " +
            "static shapes alone do; the gain comes from compiling the step, which the page takes from " +
            "the benchmark record when there is one.");
      verdict.dataset.hiddenWork = String(hiddenWork);
      var m = run.measured;
      measured.textContent = "Measured in the same build, the median step() of each run's decode " +
        "steps: the engine " + ms(m.eager.step_ms) + " (the replay's eager step: " + ms(e) + ", its " +
        "phases without the observers' few µs); the static step, eager, " + ms(m.static.step_ms) +
        "; the async loop with its forward on a worker thread " + ms(m.async.step_ms) + ", against " +
        "the ideal " + ms(a) + ". The ideal assumes the two lanes never slow each other. A thread " +
        "does: torch releases Python's GIL inside each op, but the Python that dispatches the next " +
        "op takes it back, so the host's phases and the forward take turns. The forward needs its " +
        "own process on a CPU (executor_backend=\"mp\", measured by the benchmark), and on a GPU " +
        "its kernels run on the device anyway.";
      measured.dataset.eager = String(m.eager.step_ms);
      measured.dataset.async = String(m.async.step_ms);
      measured.dataset.idealAsync = String(a);
    }

    function draw(results, n) {
      var width = Math.max(320, Math.min(svgWrap.clientWidth || 720, 1100));
      var left = 58, right = 8, laneH = 20, titleH = 16, gap = 12, plot = width - left - right;
      var view = 0;
      MODES.forEach(function (mode) { view = Math.max(view, results[mode].end); });
      var y = 4, layout = [];
      MODES.forEach(function (mode) {
        var lanes = mode.slice(-5) === "async" ? ["host", "worker"] : ["host"];
        layout.push({mode: mode, title: y, lanes: lanes, top: y + titleH});
        y += titleH + lanes.length * (laneH + 2) + gap;
      });
      var height = y + 14;
      var svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("class", "so-timeline");
      svg.setAttribute("width", String(width));
      svg.setAttribute("height", String(height));
      svg.setAttribute("viewBox", "0 0 " + width + " " + height);
      svg.setAttribute("data-view", String(view));
      svg.setAttribute("role", "img");
      svg.setAttribute("aria-label", "Timelines of " + count(n, "step") + " in four modes");
      function px(t) { return left + t / view * plot; }
      function text(x, yy, words, cls) {
        var t = document.createElementNS(SVG, "text");
        t.setAttribute("x", String(x));
        t.setAttribute("y", String(yy));
        if (cls) t.setAttribute("class", cls);
        t.textContent = words;
        svg.appendChild(t);
        return t;
      }
      layout.forEach(function (g) {
        var result = results[g.mode];
        var title = text(4, g.title + 12, modeLabel(g.mode, run) + ": " + ms(result.end), "so-mode-title");
        title.setAttribute("data-mode", g.mode);
        g.lanes.forEach(function (lane, li) {
          var top = g.top + li * (laneH + 2);
          text(4, top + laneH * 0.7, lane, "so-lane-label");
          var bg = document.createElementNS(SVG, "rect");
          bg.setAttribute("x", String(left));
          bg.setAttribute("y", String(top));
          bg.setAttribute("width", String(plot));
          bg.setAttribute("height", String(laneH));
          bg.setAttribute("class", "so-lane");
          svg.appendChild(bg);
          result.lanes[lane].forEach(function (b) {
            var x = px(b[2]), wdt = px(b[3]) - x;
            if (b[3] > b[2] && wdt < 1) wdt = 1;
            var r = document.createElementNS(SVG, "rect");
            r.setAttribute("x", String(x));
            r.setAttribute("y", String(top + 1));
            r.setAttribute("width", String(wdt));
            r.setAttribute("height", String(laneH - 2));
            r.setAttribute("fill", COLOURS[b[0]]);
            r.setAttribute("class", "so-box so-" + b[0] + (b[1] % 2 ? " so-odd" : ""));
            r.setAttribute("data-mode", g.mode);
            r.setAttribute("data-lane", lane);
            r.setAttribute("data-phase", b[0]);
            r.setAttribute("data-step", String(b[1]));
            r.setAttribute("data-start", String(b[2]));
            r.setAttribute("data-end", String(b[3]));
            var tip = document.createElementNS(SVG, "title");
            tip.textContent = b[0] + ", step " + run.steps[b[1]].step + ": " + ms(b[2]) + " to " + ms(b[3]) +
              " (" + ms(b[3] - b[2]) + ")";
            r.appendChild(tip);
            svg.appendChild(r);
          });
        });
        var bottom = g.top + g.lanes.length * (laneH + 2);
        result.outputs_at.forEach(function (t, i) {
          var line = document.createElementNS(SVG, "line");
          line.setAttribute("x1", String(px(t)));
          line.setAttribute("x2", String(px(t)));
          line.setAttribute("y1", String(g.top - 3));
          line.setAttribute("y2", String(bottom));
          line.setAttribute("class", "so-out");
          line.setAttribute("data-mode", g.mode);
          line.setAttribute("data-step", String(i));
          line.setAttribute("data-at", String(t));
          svg.appendChild(line);
        });
      });
      text(left, height - 3, "time: 0 to " + ms(view) + " (the same scale for every mode)", "so-axis");
      svgWrap.textContent = "";
      svgWrap.appendChild(svg);
    }

    function tabulate(sums, n) {
      var table = el("table", "so-table"), head = el("tr");
      ["mode", count(n, "step") + " take", "per step", "against eager", "host lane busy", "worker lane busy"]
        .forEach(function (h) { head.appendChild(el("th", null, h)); });
      table.appendChild(head);
      MODES.forEach(function (mode) {
        var s = sums[mode], tr = el("tr", "so-total");
        tr.dataset.mode = mode;
        tr.dataset.end = String(s.end);
        tr.dataset.perStep = String(s.per_step);
        tr.dataset.hostBusy = String(s.host_busy);
        tr.dataset.workerBusy = String(s.worker_busy);
        tr.appendChild(el("td", null, mode));
        tr.appendChild(el("td", "so-num", ms(s.end)));
        tr.appendChild(el("td", "so-num", ms(s.per_step)));
        tr.appendChild(el("td", "so-num", (sums.eager.end / s.end).toFixed(2) + "x"));
        tr.appendChild(el("td", "so-num", ms(s.host_busy)));
        tr.appendChild(el("td", "so-num", s.worker_busy ? ms(s.worker_busy) : "\u2013"));
        table.appendChild(tr);
      });
      tableWrap.textContent = "";
      tableWrap.appendChild(table);
    }

    function sourceLine(words) { sources.appendChild(el("p", "so-source", words)); }
    sourceLine("Recorded at build time (" + data.machine + "): " + data.source + ". Each run is B of S07's " +
      "chat prompts, greedy, " + data.max_tokens + " tokens each; the window is the " + data.runs[0].steps.length +
      " consecutive decode steps of all B requests, of the " + data.search_steps + " after the warm-up, " +
      "that took the least time (on a shared machine another process only ever adds time).");
    sourceLine("The graph rows' forward per batch size: " + data.runs.map(function (r) {
      return "B = " + r.batch_size + ": " + ms(r.graph.forward_ms) + " (" + r.graph.label + ")";
    }).join("; ") + ". The benchmark record " + data.record.path + " is " +
      (data.record.present ? "present" + (data.record.used ? " and used." : ", without a compiled figure for these runs.")
                           : "absent in this build."));
    if (data.record.async) {
      var ra = data.record.async;
      sourceLine("The benchmark record's async section (B = " + ra.batch + ", its machine, median " +
        "step): " + Object.keys(ra.rows).map(function (k) { return k + " " + ms(ra.rows[k]); }).join(", ") + ".");
    }
    sourceLine("The static and async runs (" + data.short_max_tokens + " tokens each) against the eager " +
      "run's first " + data.short_max_tokens + ", request by request: " + data.runs.map(function (r) {
      return "B = " + r.batch_size + " " + (r.texts_equal.static && r.texts_equal.async ? "the same text" : "DIFFERENT text");
    }).join(", ") + ".");

    runPick.addEventListener("change", function () { choose(Number(runPick.value)); });
    stepsPick.addEventListener("change", render);
    choose(data.defaults.run);
  }

  CourseSim.register("step-overlap", mount);
}());
