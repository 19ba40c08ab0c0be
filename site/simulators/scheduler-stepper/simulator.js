/* S10 "Try it": the scheduler, step by step: the waiting and running queues, the token budget
 * and the KV capacity used in each step, each preemption and each resume.
 *
 * The runs are real: export.py (beside this file) ran each workload at build time through
 * code/s10_scheduler.py's build_engine (S09's LLMEngine with S10's Scheduler) on the bundled
 * model, and recorded every request's tokens and the engine's trace (S09's StepTracer, one
 * StepRecord per step). The page recomputes every step from the request lengths, arrival
 * steps and priorities alone with S10's scheduler model (CourseSim.Scheduler, in
 * site/static/course.js: code/s10_scheduler.py's rules, written again), whose rules are:
 *   - requests arrive before their step and join the waiting queue: FCFS at the back;
 *     priority at their place in (priority, arrival) order;
 *   - first the running requests, in admission order, each its uncomputed tokens (1 when
 *     decoding) while the token budget lasts; one whose token ids outgrew the whole capacity
 *     is ended ("length"); when KV cannot be had, the victim (FCFS: the last admitted;
 *     priority: the largest (priority, arrival)) is preempted: KV freed, computed tokens 0,
 *     back into the waiting queue (FCFS: at the front); if the victim is the request itself it
 *     waits, and the running requests after it go on;
 *   - then, only if nobody was preempted, waiting requests from the head while a seat, the
 *     budget and KV allow, stopping at the first that does not fit; a preempted request
 *     recomputes its prompt and every output it had;
 *   - every scheduled request makes one token; a request that has made its tokens leaves.
 * On load it checks each step against the exported trace (console error and a visible banner
 * if they disagree). Each workload's settings line names its context (a KV slot's positions)
 * and shows the command line of code/s10_scheduler.py that makes the same run; the grid scrolls
 * sideways to keep the current step's column in view.
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count, same = CourseSim.same, show = CourseSim.breaks;

  function Workload(spec) {
    this.spec = spec;
    var sched = new CourseSim.Scheduler({
      maxNumSeqs: spec.max_num_seqs, budget: spec.max_num_batched_tokens,
      capacity: spec.kv_capacity, slotSize: spec.max_context, policy: spec.policy});
    this.records = sched.run(spec.requests.map(function (r) {
      return {id: r.id, at: r.arrival, tokens: r.prompt_len, target: r.generated.length,
              priority: r.priority, endsByCapacity: r.ended_by_capacity};
    }));
    this.reqs = sched.requests;
    this.steps = this.records.length;
  }

  Workload.prototype.check = function () {
    var problems = [], self = this;
    if (this.spec.trace.length !== this.steps) problems.push("step count " + this.steps + " != " + this.spec.trace.length);
    this.spec.trace.forEach(function (t, i) {
      var mine = self.records[i];
      if (!mine) return;
      var at = "step " + i + " ";
      if (!same(mine.scheduled.map(function (x) { return x.id; }), t.running)) problems.push(at + "order");
      if (!same(mine.scheduled.map(function (x) { return x.n; }), t.num_scheduled_tokens)) problems.push(at + "scheduled tokens");
      if (!same(mine.scheduled.map(function (x) { return x.slot; }), t.slots)) problems.push(at + "slots");
      ["joined", "resumed", "preempted", "ended", "left"].forEach(function (f) {
        if (!same(mine[f], t[f])) problems.push(at + f);
      });
      if (mine.tokens !== t.num_tokens) problems.push(at + "tokens");
      if (mine.waiting.length !== t.waiting) problems.push(at + "waiting");
      if (mine.kvUsed !== t.kv_used_tokens) problems.push(at + "KV used");
    });
    this.spec.requests.forEach(function (r, k) {
      if (!same(self.reqs[k].madeAt, r.generated.map(function (g) { return g[0]; }))) problems.push("request " + r.id + " token steps");
      if (self.reqs[k].preemptions !== r.num_preemptions) problems.push("request " + r.id + " preemptions");
    });
    return problems;
  };

  // The kind of request k's cell at step s (0-based), for the grid.
  Workload.prototype.cell = function (k, s) {
    var r = this.reqs[k], rec = this.records[s], id = r.id;
    if (s < r.at) return "absent";
    if (rec.preempted.indexOf(id) >= 0) return "preempt";
    if (rec.ended.indexOf(id) >= 0) return "ended";
    if (rec.joined.indexOf(id) >= 0) return "prefill";
    if (rec.resumed.indexOf(id) >= 0) return "resume";
    if (rec.scheduled.some(function (x) { return x.id === id; })) return "decode";
    if (rec.stalled.indexOf(id) >= 0) return "stall";
    if (r.leftAt !== null && r.leftAt < s) return "done";
    return "wait";
  };

  function bar(cls, parts, total) {
    var box = el("div", "ss-bar " + cls);
    parts.forEach(function (p) {
      var seg = el("span", "ss-seg ss-" + p.kind, p.label);
      seg.style.width = (100 * p.n / total).toFixed(3) + "%";
      seg.title = p.label + ": " + p.n + " tokens";
      seg.dataset.req = p.id;
      seg.dataset.n = String(p.n);
      box.appendChild(seg);
    });
    return box;
  }

  function mount(root, data) {
    var wrap = el("div", "ss-sim");
    root.appendChild(wrap);
    var banner = el("p", "ss-banner");
    banner.hidden = true;
    wrap.appendChild(banner);

    var controls = CourseSim.stepControls("ss-", {
      choices: data.workloads.map(function (w) { return w.title; }),
      extra: [["next-preempt", "next preemption"]],
      onChoose: choose,
      onStep: function (s) { step = s; render(); }
    });
    wrap.appendChild(controls.row);

    var config = el("p", "ss-config");
    wrap.appendChild(config);
    var cmd = el("p", "ss-command");
    wrap.appendChild(cmd);
    var budgetBox = el("div", "ss-meter ss-meter-budget");
    var kvBox = el("div", "ss-meter ss-meter-kv");
    wrap.appendChild(budgetBox);
    wrap.appendChild(kvBox);
    var queues = el("div", "ss-queues");
    var waitBox = el("div", "ss-queue ss-queue-waiting");
    var runBox = el("div", "ss-queue ss-queue-running");
    queues.appendChild(waitBox);
    queues.appendChild(runBox);
    wrap.appendChild(queues);
    var note = el("p", "ss-note");
    wrap.appendChild(note);

    wrap.appendChild(CourseSim.legend("ss-", [
      ["ss-prefill", "joins: computes its prompt"], ["ss-resume", "resumes: recomputes prompt + outputs"],
      ["ss-decode", "decodes one token"], ["ss-preempt", "preempted (KV freed)"], ["ss-wait", "waiting"],
      ["ss-stall", "running, not scheduled"], ["ss-ended", "ended by the KV capacity"],
      ["ss-done", "finished"], ["ss-future", "not yet"]]));
    var gridBox = el("div", "ss-grid-box");
    wrap.appendChild(gridBox);
    var reqBox = el("div", "ss-requests");
    wrap.appendChild(reqBox);

    var work = null, step = 0;

    function chips(box, title, list, classOf, textOf) {
      box.textContent = "";
      box.appendChild(el("span", "ss-queue-title", title));
      if (!list.length) box.appendChild(el("span", "ss-empty", "empty"));
      list.forEach(function (id) {
        var chip = el("span", "ss-chip " + classOf(id), textOf(id));
        chip.dataset.req = id;
        box.appendChild(chip);
      });
    }

    function render() {
      var rec = work.records[step], spec = work.spec, t = spec.trace[step];
      var tokensOf = {};
      rec.scheduled.forEach(function (s) { tokensOf[s.id] = s.n; });
      var kindOf = function (id) {
        return rec.joined.indexOf(id) >= 0 ? "prefill" : rec.resumed.indexOf(id) >= 0 ? "resume" : "decode";
      };
      budgetBox.textContent = "";
      budgetBox.appendChild(el("span", "ss-meter-label", "token budget: " + rec.tokens + " of " +
        spec.max_num_batched_tokens + " tokens scheduled"));
      budgetBox.appendChild(bar("ss-bar-budget", rec.scheduled.map(function (s) {
        return {id: s.id, n: s.n, kind: kindOf(s.id), label: s.id}; }), spec.max_num_batched_tokens));
      kvBox.textContent = "";
      kvBox.appendChild(el("span", "ss-meter-label", "KV: " + rec.kvUsed + " of " + spec.kv_capacity +
        " tokens held, " + (spec.kv_capacity - rec.kvUsed) + " free"));
      kvBox.appendChild(bar("ss-bar-kv", rec.running.map(function (id) {
        return {id: id, n: rec.held[id], kind: tokensOf[id] ? kindOf(id) : "stall", label: id}; }),
        spec.kv_capacity));
      chips(waitBox, "waiting (head first):", rec.waiting,
            function (id) { return rec.preempted.indexOf(id) >= 0 ? "ss-preempt" : "ss-wait"; },
            function (id) { return id + " (" + rec.waitTokens[rec.waiting.indexOf(id)] + ")"; });
      chips(runBox, "running (admission order):", rec.running,
            function (id) { return "ss-" + (tokensOf[id] ? kindOf(id) : "stall"); },
            function (id) { return id + (tokensOf[id] ? " +" + tokensOf[id] : ""); });
      var parts = ["Step " + step + ": " + count(rec.tokens, "token") + " for " +
        count(rec.scheduled.length, "request")];
      if (rec.preempted.length) parts.push("preempted " + rec.preempted.join(", ") +
        " (" + (rec.preempted.length === 1 ? "its" : "their") +
        " KV freed; no one joins in a step with a preemption)");
      if (rec.joined.length) parts.push("joined " + rec.joined.join(", "));
      if (rec.resumed.length) parts.push("resumed " + rec.resumed.map(function (id) {
        return id + " (recomputes " + count(tokensOf[id], "token") + ")"; }).join(", "));
      if (rec.ended.length) parts.push("ended by the KV capacity " + rec.ended.join(", "));
      if (rec.left.length) parts.push("left " + rec.left.join(", "));
      parts.push("waiting " + t.waiting);
      note.textContent = parts.join("; ") + ".";

      var keep = gridBox.scrollLeft;                     // the rebuild below resets it
      gridBox.textContent = "";
      var table = el("table", "ss-grid");
      var head = el("tr");
      head.appendChild(el("th", "ss-rid", "req"));
      for (var s = 0; s < work.steps; s++) {
        head.appendChild(el("th", s === step ? "ss-col ss-col-now" : "ss-col",
                            s % 5 === 0 || s === step ? String(s) : ""));
      }
      table.appendChild(head);
      work.reqs.forEach(function (q, k) {
        var tr = el("tr", "ss-grid-row");
        tr.appendChild(el("th", "ss-rid", q.id));
        for (var s2 = 0; s2 < work.steps; s2++) {
          var kind = s2 <= step ? work.cell(k, s2) : "future";
          var text = "";
          if (s2 <= step && (kind === "prefill" || kind === "resume")) {
            var sch = work.records[s2].scheduled.find(function (x) { return x.id === q.id; });
            text = String(sch.n);
          } else if (kind === "preempt") text = "\u00d7";
          tr.appendChild(el("td", "ss-cell ss-" + kind, text));
        }
        table.appendChild(tr);
      });
      gridBox.appendChild(table);
      gridBox.scrollLeft = keep;
      CourseSim.scrollToColumn(gridBox, head.children[step + 1]);

      reqBox.textContent = "";
      var rt = el("table", "ss-req-table");
      var rh = el("tr");
      ["request", "prompt", "priority", "arrives", "preempted", "made", "completion so far"].forEach(function (h) {
        rh.appendChild(el("th", null, h)); });
      rt.appendChild(rh);
      spec.requests.forEach(function (r, k) {
        var n = work.reqs[k].madeAt.filter(function (s3) { return s3 <= step; }).length;
        var pre = 0;
        for (var s4 = 0; s4 <= step; s4++) if (work.records[s4].preempted.indexOf(r.id) >= 0) pre += 1;
        var tr = el("tr", "ss-req");
        tr.appendChild(el("td", null, r.id));
        tr.appendChild(el("td", null, count(r.prompt_len, "token")));
        tr.appendChild(el("td", null, String(r.priority)));
        tr.appendChild(el("td", null, "step " + r.arrival));
        tr.appendChild(el("td", "ss-pre", String(pre)));
        tr.appendChild(el("td", "ss-status", count(n, "token") +
          (isDone(k) ? ", finished (" + r.finish_reason + ")" : "")));
        tr.appendChild(el("td", "ss-text", show(r.generated.slice(0, n).map(function (g) { return g[2]; }).join(""))));
        rt.appendChild(tr);
      });
      reqBox.appendChild(rt);
    }

    function isDone(k) {
      var at = work.reqs[k].leftAt;
      return at !== null && at <= step;
    }

    function choose(index) {
      work = new Workload(data.workloads[index]);
      CourseSim.report(banner, "scheduler-stepper",
                       "The page's schedule disagrees with the engine's trace: ", work.check());
      var s = work.spec;
      config.textContent = "policy " + s.policy + "; at most " + s.max_num_seqs + " running; " +
        "context " + s.max_context + " tokens (one KV slot); " + s.max_num_batched_tokens +
        " tokens per step; KV for " + s.kv_capacity + " tokens; " + count(s.requests.length, "request") +
        ", " + count(s.num_preemptions, "preemption") + " in the run.";
      cmd.textContent = "";
      cmd.appendChild(document.createTextNode("The same run on your machine: "));
      cmd.appendChild(el("code", null, s.command));
      controls.setLast(work.steps - 1);
      controls.go(0);
    }

    controls.buttons["next-preempt"].addEventListener("click", function () {
      for (var s = step + 1; s < work.steps; s++) {
        if (work.records[s].preempted.length) { controls.go(s); return; }
      }
      controls.go(work.steps - 1);
    });
    choose(0);
  }

  CourseSim.register("scheduler-stepper", mount);
})();
