/* S11 "Try it": the step timeline. Prompt chunks and decodes share each step's token budget;
 * the same requests run twice, one run above the other, so the stall that chunking removes
 * (or the wait that a per-request limit removes) shows side by side.
 *
 * The runs are real: export.py (beside this file) ran each workload at build time through
 * code/s11_chunked_prefill.py's build_engine (S09's LLMEngine with the ChunkedScheduler) on the
 * bundled model, and recorded every request's tokens and the engine's trace (S09's StepTracer,
 * one StepRecord per step). The page recomputes every step from the request lengths, arrival
 * steps and output counts alone with S10's scheduler model (CourseSim.Scheduler, in
 * site/static/course.js) grown as the Python grows it: ChunkedScheduler below changes one rule,
 * numNewTokens, and keeps every other:
 *   - requests arrive before their step and join the back of the waiting queue;
 *   - first the running requests, in admission order, while budget is left: each computes
 *     min(tokens left, budget left, the per-request limit if there is one). Nothing is kept
 *     back for those after it: a request joins only with budget left, and those ahead of it
 *     never take more in a later step, so every running request advances in every step;
 *   - then waiting requests from the head while a seat is free: each computes min(tokens left,
 *     budget left, the limit); admission stops when that is 0 (the budget is spent);
 *   - a request samples a token only when its new tokens reach the end of its token ids (its
 *     prompt is complete); a chunk that stops inside the prompt samples nothing;
 *   - a request that has made its tokens leaves.
 * On load it checks each step against the exported trace (console error and a visible banner
 * if they disagree). Each step's column in the work chart is as tall as the tokens the step
 * computed, on one scale for both runs: a step with a whole long prompt in it is the tall one,
 * and every request decoding in it waited for all of it before its next token.
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count, sum = CourseSim.sum, same = CourseSim.same;
  var show = CourseSim.breaks;

  // S11's scheduler: S10's with one rule changed (code/s11_chunked_prefill.py's
  // ChunkedScheduler): a request computes min(what it has not computed, the budget left, the
  // per-request limit when there is one). config: S10's, and threshold (0: no limit).
  function ChunkedScheduler(config) {
    CourseSim.Scheduler.call(this, config);
    this.threshold = config.threshold || 0;
  }
  ChunkedScheduler.prototype = Object.create(CourseSim.Scheduler.prototype);
  ChunkedScheduler.prototype.numNewTokens = function (request, computed, budget) {
    var n = Math.min(request.tokens - computed, budget);
    return this.threshold ? Math.min(n, this.threshold) : n;
  };

  // One run of the chunked scheduler; one record per step (CourseSim.Scheduler's).
  function replay(run, seats, maxContext) {
    var sched = new ChunkedScheduler({
      maxNumSeqs: seats, budget: run.max_num_batched_tokens, capacity: run.kv_capacity,
      slotSize: maxContext, threshold: run.long_prefill_token_threshold});
    var records = sched.run(run.requests.map(function (r) {
      return {id: r.id, at: r.arrival, tokens: r.prompt_len, target: r.generated.length};
    }));
    return {records: records, reqs: sched.requests};
  }

  // The worst gap (tokens computed between two consecutive tokens of one request) and each
  // request's first-token step, from the page's own replay.
  function summarize(run) {
    var work = run.records.map(function (r) { return r.tokens; });
    var first = {}, worst = {tokens: 0, step: null, request: null};
    run.reqs.forEach(function (q) {
      first[q.id] = q.madeAt[0];
      for (var k = 1; k < q.madeAt.length; k++) {
        var gap = sum(work.slice(q.madeAt[k - 1] + 1, q.madeAt[k] + 1));
        if (gap > worst.tokens) worst = {tokens: gap, step: q.madeAt[k], request: q.id};
      }
    });
    return {first_token_step: first, worst_gap: worst, steps: work.length, tokens_computed: sum(work)};
  }

  function Run(spec, seats, maxContext) {
    this.spec = spec;
    var run = replay(spec, seats, maxContext);
    this.records = run.records;
    this.reqs = run.reqs;
    this.steps = run.records.length;
    this.summary = summarize(this);
  }

  Run.prototype.check = function () {
    var problems = [], self = this, label = this.spec.label.split(":")[0];
    if (this.spec.trace.length !== this.steps) problems.push(label + ": step count " + this.steps + " != " + this.spec.trace.length);
    this.spec.trace.forEach(function (t, i) {
      var mine = self.records[i];
      if (!mine) return;
      var at = label + " step " + i + " ";
      var want = t.running.map(function (rid, k) {
        return [rid, t.num_scheduled_tokens[k], t.kinds[k], t.num_computed_tokens[k],
                t.request_num_tokens[k], t.slots[k]];
      });
      var got = mine.scheduled.map(function (x) { return [x.id, x.n, x.kind, x.start, x.total, x.slot]; });
      if (!same(want, got)) problems.push(at + "scheduled tokens");
      ["sampled", "joined", "left", "preempted", "resumed", "ended"].forEach(function (f) {
        if (!same(mine[f], t[f])) problems.push(at + f);
      });
      if (mine.tokens !== t.num_tokens) problems.push(at + "tokens");
      if (mine.waiting.length !== t.waiting) problems.push(at + "waiting");
    });
    this.spec.requests.forEach(function (r, k) {
      if (!same(self.reqs[k].madeAt, r.generated.map(function (g) { return g[0]; }))) problems.push(label + " request " + r.id + " token steps");
    });
    if (!same(this.summary, this.spec.summary)) problems.push(label + " summary");
    return problems;
  };

  // What request k shows at step s: its kind, and the text of the cell.
  Run.prototype.cell = function (k, s) {
    var q = this.reqs[k], rec = this.records[s];
    if (s >= this.steps) return ["after", ""];
    if (s < q.at) return ["absent", ""];
    var mine = rec.scheduled.find(function (x) { return x.id === q.id; });
    if (mine) {
      if (mine.kind === "decode") return ["decode", ""];
      return [mine.sampled ? "last-chunk" : "chunk", String(mine.n)];
    }
    return [q.leftAt !== null && q.leftAt < s ? "done" : "wait", ""];
  };

  function mount(root, data) {
    var wrap = el("div", "st-sim");
    root.appendChild(wrap);
    var banner = el("p", "st-banner");
    banner.hidden = true;
    wrap.appendChild(banner);

    var controls = CourseSim.stepControls("st-", {
      choices: data.workloads.map(function (w) { return w.title; }),
      onChoose: choose,
      onStep: function (s) { step = s; render(); }
    });
    wrap.appendChild(controls.row);

    var config = el("p", "st-config");
    wrap.appendChild(config);
    wrap.appendChild(CourseSim.legend("st-", [
      ["st-decode", "decodes one token"], ["st-chunk", "prompt chunk (its tokens), nothing sampled"],
      ["st-last-chunk", "last chunk: samples the first token"], ["st-wait", "waiting"],
      ["st-done", "finished"], ["st-future", "not yet"]]));
    var panels = el("div", "st-panels");
    wrap.appendChild(panels);

    var work = null, step = 0, maxSteps = 1, maxTokens = 1;

    function panel(run, index) {
      var box = el("div", "st-panel st-panel-" + index);
      var spec = run.spec, sm = run.summary, longId = work.long_id;
      box.appendChild(el("h4", "st-title", spec.label));
      box.appendChild(el("p", "st-settings", spec.max_num_batched_tokens + " tokens per step; " +
        (spec.long_prefill_token_threshold ? "at most " + count(spec.long_prefill_token_threshold, "token") +
         " per request" : "no per-request limit") + "; " + count(run.steps, "step") + ", " +
        count(sm.tokens_computed, "token") + " computed in all."));
      var longReq = spec.requests.find(function (r) { return r.id === longId; });
      var stats = el("p", "st-summary");
      stats.appendChild(el("span", "st-worst", "Worst gap between two tokens of one request: " +
        count(sm.worst_gap.tokens, "token") + " computed (request " + sm.worst_gap.request +
        ", step " + sm.worst_gap.step + ")."));
      stats.appendChild(document.createTextNode(" "));
      stats.appendChild(el("span", "st-long", "Long prompt (request " + longId + ", " +
        count(longReq.prompt_len, "token") + "): first token in step " + sm.first_token_step[longId] +
        ", " + count(sm.first_token_step[longId] - longReq.arrival, "step") + " after it arrived."));
      box.appendChild(stats);

      var gridBox = el("div", "st-grid-box");
      var table = el("table", "st-grid");
      var head = el("tr");
      head.appendChild(el("th", "st-rid", "req"));
      for (var c = 0; c < maxSteps; c++) {
        head.appendChild(el("th", c === step ? "st-colh st-col-now" : "st-colh",
                            c % 5 === 0 || c === step ? String(c) : ""));
      }
      table.appendChild(head);
      // The work chart, the grid's first row: one column per step, as tall as the tokens it
      // computed (prompt tokens below, decodes above), with the budget dashed.
      var chart = el("tr", "st-chart");
      chart.appendChild(el("th", "st-rid st-chart-label", "work"));
      var budgetAt = (100 * Math.min(spec.max_num_batched_tokens, maxTokens) / maxTokens).toFixed(3) + "%";
      for (var s = 0; s < maxSteps; s++) {
        var col = el("td", "st-col" + (s === step ? " st-col-now" : ""));
        var barBox = el("div", "st-bar");
        col.appendChild(barBox);
        if (spec.max_num_batched_tokens <= maxTokens && s < run.steps) {
          var mark = el("span", "st-budget-mark");
          mark.style.bottom = budgetAt;
          barBox.appendChild(mark);
        }
        if (s < run.steps && s <= step) {
          var rec = run.records[s];
          var dec = sum(rec.scheduled.filter(function (x) { return x.kind === "decode"; }).map(function (x) { return x.n; }));
          var pre = rec.tokens - dec;
          col.title = "step " + s + ": " + count(rec.tokens, "token") + " (" + dec + " decode, " + pre + " prompt)";
          col.dataset.tokens = String(rec.tokens);
          var decSeg = el("span", "st-seg st-seg-decode");
          decSeg.style.height = (100 * dec / maxTokens).toFixed(3) + "%";
          var preSeg = el("span", "st-seg st-seg-prefill");
          preSeg.style.height = (100 * pre / maxTokens).toFixed(3) + "%";
          barBox.appendChild(decSeg);
          barBox.appendChild(preSeg);
        }
        chart.appendChild(col);
      }
      table.appendChild(chart);
      run.reqs.forEach(function (q, k) {
        var tr = el("tr", "st-grid-row");
        tr.appendChild(el("th", "st-rid", q.id));
        for (var s2 = 0; s2 < maxSteps; s2++) {
          var kind = s2 <= step ? run.cell(k, s2) : ["future", ""];
          tr.appendChild(el("td", "st-cell st-" + kind[0], kind[1]));
        }
        table.appendChild(tr);
      });
      gridBox.appendChild(table);
      box.appendChild(el("p", "st-chart-caption", "work: the tokens each step computed, on one scale for both runs (tallest " +
        count(maxTokens, "token") + "; dashed: the budget, " + count(spec.max_num_batched_tokens, "token") +
        (spec.max_num_batched_tokens > maxTokens ? ", above the top of the chart" : "") + ")."));
      box.appendChild(gridBox);

      var note = el("p", "st-note");
      if (step < run.steps) {
        var r = run.records[step];
        var decs = r.scheduled.filter(function (x) { return x.kind === "decode"; });
        var chunks = r.scheduled.filter(function (x) { return x.kind === "prefill"; });
        var parts = ["Step " + step + ": " + r.tokens + " of " + spec.max_num_batched_tokens + " tokens"];
        if (decs.length) parts.push(count(decs.length, "decode") + " (" + decs.map(function (x) { return x.id; }).join(", ") + ")");
        chunks.forEach(function (x) {
          parts.push("request " + x.id + " computes " + count(x.n, "prompt token") + ", " +
            (x.start + x.n) + " of " + x.total + (x.sampled ? ", complete: samples its first token" : ", samples nothing"));
        });
        var who = function (ids) { return (ids.length === 1 ? "request " : "requests ") + ids.join(", "); };
        if (r.joined.length) parts.push("joined: " + who(r.joined));
        if (r.left.length) parts.push("finished: " + who(r.left));
        parts.push(count(r.waiting.length, "request") + " waiting");
        note.textContent = parts.join("; ") + ".";
      } else {
        note.textContent = "This run ended after step " + (run.steps - 1) + ".";
      }
      box.appendChild(note);

      var rt = el("table", "st-req-table");
      var rh = el("tr");
      ["request", "prompt", "arrives", "first token", "made", "completion so far"].forEach(function (h) {
        rh.appendChild(el("th", null, h)); });
      rt.appendChild(rh);
      spec.requests.forEach(function (rq, k) {
        var q = run.reqs[k];
        var n = q.madeAt.filter(function (s3) { return s3 <= step; }).length;
        var doneNow = n === q.target;
        var tr = el("tr", "st-req");
        tr.appendChild(el("td", null, rq.id));
        tr.appendChild(el("td", null, count(rq.prompt_len, "token")));
        tr.appendChild(el("td", null, "step " + rq.arrival));
        tr.appendChild(el("td", "st-first", n ? "step " + q.madeAt[0] : "not yet"));
        tr.appendChild(el("td", "st-status", count(n, "token") + (doneNow ? ", finished (" + rq.finish_reason + ")" : "")));
        tr.appendChild(el("td", "st-text", show(rq.generated.slice(0, n).map(function (g) { return g[2]; }).join(""))));
        rt.appendChild(tr);
      });
      var reqBox = el("div", "st-requests");
      reqBox.appendChild(rt);
      box.appendChild(reqBox);
      return {box: box, gridBox: gridBox, head: head};
    }

    function render() {
      var keep = Array.prototype.map.call(panels.querySelectorAll(".st-grid-box"), function (g) { return g.scrollLeft; });
      panels.textContent = "";
      work.runs.forEach(function (run, i) {
        var p = panel(run, i);
        panels.appendChild(p.box);
        if (keep[i] !== undefined) p.gridBox.scrollLeft = keep[i];
        CourseSim.scrollToColumn(p.gridBox, p.head.children[step + 1]);
      });
    }

    function choose(index) {
      var spec = data.workloads[index];
      work = {long_id: spec.long_id, runs: spec.runs.map(function (r) {
        return new Run(r, data.max_num_seqs, data.max_context); })};
      var problems = [];
      work.runs.forEach(function (run) { problems = problems.concat(run.check()); });
      CourseSim.report(banner, "step-timeline",
                       "The page's schedule disagrees with the engine's trace: ", problems);
      maxSteps = Math.max.apply(null, work.runs.map(function (r) { return r.steps; }));
      maxTokens = Math.max.apply(null, work.runs.map(function (r) {
        return Math.max.apply(null, r.records.map(function (x) { return x.tokens; })); }));
      config.textContent = "The same " + count(spec.runs[0].requests.length, "request") +
        " in both runs, greedy on the bundled model; at most " + data.max_num_seqs +
        " running; context " + data.max_context + " tokens. Every running request makes a token in every step once its prompt is in.";
      controls.setLast(maxSteps - 1);
      controls.go(0);
    }

    choose(0);
  }

  CourseSim.register("step-timeline", mount);
})();
