/* S10 "Try it": the scheduler, step by step: the waiting and running queues, the token budget
 * and the KV capacity used in each step, each preemption and each resume.
 *
 * The runs are real: export.py (beside this file) ran each workload at build time through
 * code/s10_engine.py's LLMEngine, driven by code/s10_scheduler.py's Scheduler, on the bundled
 * model, and recorded every request's tokens and the engine's trace (one StepRecord per step).
 * The page recomputes every step from the request lengths, arrival steps and priorities alone,
 * with the scheduler's rules:
 *   - requests arrive before their step and join the waiting queue: FCFS at the back;
 *     priority at their place in (priority, arrival) order;
 *   - first the running requests, in admission order, each its uncomputed tokens (1 when
 *     decoding) while the token budget lasts; one whose KV plus its new tokens would pass the
 *     whole capacity is ended ("length"); when KV cannot be had, the victim (FCFS: the last
 *     admitted; priority: the largest (priority, arrival)) is preempted: KV freed, computed
 *     tokens 0, back into the waiting queue (FCFS: at the front); if the victim is the
 *     request itself it waits, and the running requests after it go on;
 *   - then, only if nobody was preempted, waiting requests from the head while a seat, the
 *     budget and KV allow, stopping at the first that does not fit; a preempted request
 *     recomputes its prompt and every output it had;
 *   - every scheduled request makes one token; a request that has made its tokens leaves.
 * On load it checks each step against the exported trace (console error and a visible banner
 * if they disagree). Each workload's settings line names its context (a KV slot's positions)
 * and shows the command line of code/s10_engine.py that makes the same run; the grid scrolls
 * sideways to keep the current step's column in view.
 */
(function () {
  "use strict";

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function show(piece) { return piece.replace(/\n/g, "\u21b5"); }

  function sum(xs) { return xs.reduce(function (a, b) { return a + b; }, 0); }

  // "1 token", "2 tokens": a count and its noun, singular for exactly one.
  function count(n, noun) { return n + " " + noun + (n === 1 ? "" : "s"); }

  // One run of the scheduler's rules; returns one record per step.
  function replay(spec) {
    var fcfs = spec.policy === "fcfs", cap = spec.kv_capacity;
    var reqs = spec.requests.map(function (r, i) {
      return {id: r.id, arrival: i, at: r.arrival, priority: r.priority, target: r.generated.length,
              endsByCapacity: r.ended_by_capacity, tokens: r.prompt_len, computed: 0, made: 0,
              status: "absent", preemptions: 0, madeAt: []};
    });
    var byId = {};
    reqs.forEach(function (r) { byId[r.id] = r; });
    var waiting = [], running = [], held = {}, records = [], done = 0;

    function later(a, b) {   // a goes after b in the waiting order
      if (fcfs) return a.arrival > b.arrival;
      return a.priority > b.priority || (a.priority === b.priority && a.arrival > b.arrival);
    }
    function toWaiting(r, front) {
      if (fcfs) { if (front) waiting.unshift(r); else waiting.push(r); return; }
      var at = waiting.findIndex(function (w) { return later(w, r); });
      waiting.splice(at < 0 ? waiting.length : at, 0, r);
    }
    function used() { return sum(Object.keys(held).map(function (k) { return held[k]; })); }
    function alloc(r, n) {
      if (n > cap - used()) return false;
      held[r.id] = (held[r.id] || 0) + n;
      return true;
    }
    function drop(list, id) { var k = list.indexOf(id); if (k >= 0) list.splice(k, 1); }

    for (var step = 0; done < reqs.length; step++) {
      if (step > 10000) throw new Error("the replay does not end");
      reqs.forEach(function (r) { if (r.at === step) { r.status = "waiting"; toWaiting(r, false); } });
      var budget = spec.max_num_batched_tokens, sched = [], ids = {running: [], joined: [],
        resumed: [], preempted: [], ended: [], left: []};
      var i = 0, stalled = [];
      while (i < running.length && budget > 0) {
        var r = running[i], n = r.tokens - r.computed;
        if (n > budget) break;
        if ((held[r.id] || 0) + n > cap) {                 // can never run again: "length"
          running.splice(i, 1);
          delete held[r.id];
          r.status = "finished";
          ids.ended.push(r.id);
          ids.left.push(r.id);
          done += 1;
          continue;
        }
        var self = false;
        while (!alloc(r, n)) {
          var victim = fcfs ? running[running.length - 1] : running.reduce(function (a, b) {
            return later(b, a) ? b : a; });
          var at = running.indexOf(victim);
          running.splice(at, 1);
          var k = sched.findIndex(function (s) { return s.id === victim.id; });
          if (k >= 0) { budget += sched[k].n; sched.splice(k, 1); }
          drop(ids.running, victim.id); drop(ids.joined, victim.id); drop(ids.resumed, victim.id);
          delete held[victim.id];
          victim.computed = 0;
          victim.preemptions += 1;
          victim.status = "preempted";
          toWaiting(victim, true);
          ids.preempted.push(victim.id);
          if (victim === r) { self = true; break; }
          if (at < i) i -= 1;
        }
        if (self) continue;                                  // it waits; the next takes index i
        sched.push({id: r.id, n: n});
        ids.running.push(r.id);
        budget -= n;
        i += 1;
      }
      while (!ids.preempted.length && waiting.length && running.length < spec.max_num_seqs) {
        var w = waiting[0], m = w.tokens - w.computed;
        if (m > budget || !alloc(w, m)) break;             // nobody overtakes the head
        waiting.shift();
        (w.status === "preempted" ? ids.resumed : ids.joined).push(w.id);
        w.status = "running";
        running.push(w);
        sched.push({id: w.id, n: m});
        budget -= m;
      }
      var heldNow = {};
      running.forEach(function (q) { heldNow[q.id] = held[q.id] || 0; });
      var rec = {step: step, scheduled: sched, ids: ids, stalled: stalled,
                 waiting: waiting.map(function (q) { return q.id; }),
                 waitTokens: waiting.map(function (q) { return q.tokens - q.computed; }),
                 running: running.map(function (q) { return q.id; }),
                 held: heldNow, kvUsed: used(), tokens: sum(sched.map(function (s) { return s.n; }))};
      sched.forEach(function (s) {                        // the model step: one token each
        var q = byId[s.id];
        q.made += 1;
        q.tokens += 1;
        q.computed = q.tokens - 1;
        q.madeAt.push(step);
        if (q.made >= q.target && !q.endsByCapacity) {
          running.splice(running.indexOf(q), 1);
          delete held[q.id];
          q.status = "finished";
          ids.left.push(q.id);
          done += 1;
        }
      });
      records.push(rec);
    }
    return {records: records, reqs: reqs};
  }

  function Workload(spec) {
    this.spec = spec;
    var run = replay(spec);
    this.records = run.records;
    this.reqs = run.reqs;
    this.steps = run.records.length;
  }

  Workload.prototype.check = function () {
    var problems = [], self = this, same = function (a, b) { return JSON.stringify(a) === JSON.stringify(b); };
    if (this.spec.trace.length !== this.steps) problems.push("step count " + this.steps + " != " + this.spec.trace.length);
    this.spec.trace.forEach(function (t, i) {
      var mine = self.records[i];
      if (!mine) return;
      var want = {}, got = {};
      t.running.forEach(function (rid, k) { want[rid] = t.num_scheduled_tokens[k]; });
      mine.scheduled.forEach(function (s) { got[s.id] = s.n; });
      var keys = function (o) { return Object.keys(o).sort().map(function (k) { return [k, o[k]]; }); };
      if (!same(keys(want), keys(got))) problems.push("step " + i + " scheduled tokens");
      ["joined", "resumed", "preempted", "ended"].forEach(function (f) {
        if (!same(mine.ids[f], t[f])) problems.push("step " + i + " " + f);
      });
      if (!same(mine.ids.left.slice().sort(), t.left.slice().sort())) problems.push("step " + i + " left");
      if (mine.tokens !== t.num_tokens) problems.push("step " + i + " tokens");
      if (mine.waiting.length !== t.waiting) problems.push("step " + i + " waiting");
      if (mine.kvUsed !== t.kv_used_tokens) problems.push("step " + i + " KV used");
    });
    this.spec.requests.forEach(function (r, k) {
      var made = self.reqs[k].madeAt;
      if (!same(made, r.generated.map(function (g) { return g[0]; }))) problems.push("request " + r.id + " token steps");
      if (self.reqs[k].preemptions !== r.num_preemptions) problems.push("request " + r.id + " preemptions");
    });
    return problems;
  };

  // The kind of request k's cell at step s (0-based), for the grid.
  Workload.prototype.cell = function (k, s) {
    var r = this.reqs[k], rec = this.records[s], id = r.id;
    if (s < r.at) return "absent";
    if (rec.ids.preempted.indexOf(id) >= 0) return "preempt";
    if (rec.ids.ended.indexOf(id) >= 0) return "ended";
    if (rec.ids.joined.indexOf(id) >= 0) return "prefill";
    if (rec.ids.resumed.indexOf(id) >= 0) return "resume";
    if (rec.ids.running.indexOf(id) >= 0) return "decode";
    if (rec.stalled.indexOf(id) >= 0) return "stall";
    for (var p = 0; p < s; p++) if (this.records[p].ids.left.indexOf(id) >= 0) return "done";
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

    var controls = window.CourseSim.stepControls("ss-", {
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

    var legend = el("p", "ss-legend");
    [["ss-prefill", "joins: computes its prompt"], ["ss-resume", "resumes: recomputes prompt + outputs"],
     ["ss-decode", "decodes one token"], ["ss-preempt", "preempted (KV freed)"],
     ["ss-wait", "waiting"], ["ss-stall", "running, not scheduled"], ["ss-ended", "ended by the KV capacity"],
     ["ss-done", "finished"], ["ss-future", "not yet"]].forEach(function (pair) {
      var item = el("span", "ss-legend-item");
      item.appendChild(el("span", "ss-swatch " + pair[0]));
      item.appendChild(document.createTextNode(pair[1]));
      legend.appendChild(item);
    });
    wrap.appendChild(legend);
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
        return rec.ids.joined.indexOf(id) >= 0 ? "prefill" : rec.ids.resumed.indexOf(id) >= 0 ? "resume" : "decode";
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
            function (id) { return rec.ids.preempted.indexOf(id) >= 0 ? "ss-preempt" : "ss-wait"; },
            function (id) { return id + " (" + rec.waitTokens[rec.waiting.indexOf(id)] + ")"; });
      chips(runBox, "running (admission order):", rec.running,
            function (id) { return "ss-" + (tokensOf[id] ? kindOf(id) : "stall"); },
            function (id) { return id + (tokensOf[id] ? " +" + tokensOf[id] : ""); });
      var parts = ["Step " + step + ": " + count(rec.tokens, "token") + " for " +
        count(rec.scheduled.length, "request")];
      if (rec.ids.preempted.length) parts.push("preempted " + rec.ids.preempted.join(", ") +
        " (" + (rec.ids.preempted.length === 1 ? "its" : "their") +
        " KV freed; no one joins in a step with a preemption)");
      if (rec.ids.joined.length) parts.push("joined " + rec.ids.joined.join(", "));
      if (rec.ids.resumed.length) parts.push("resumed " + rec.ids.resumed.map(function (id) {
        return id + " (recomputes " + count(tokensOf[id], "token") + ")"; }).join(", "));
      if (rec.ids.ended.length) parts.push("ended by the KV capacity " + rec.ids.ended.join(", "));
      if (rec.ids.left.length) parts.push("left " + rec.ids.left.join(", "));
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
      showColumn(head.children[step + 1]);

      reqBox.textContent = "";
      var rt = el("table", "ss-req-table");
      var rh = el("tr");
      ["request", "prompt", "priority", "arrives", "preempted", "made", "completion so far"].forEach(function (h) {
        rh.appendChild(el("th", null, h)); });
      rt.appendChild(rh);
      spec.requests.forEach(function (r, k) {
        var n = work.reqs[k].madeAt.filter(function (s3) { return s3 <= step; }).length;
        var pre = 0;
        for (var s4 = 0; s4 <= step; s4++) if (work.records[s4].ids.preempted.indexOf(r.id) >= 0) pre += 1;
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

    // Scroll the grid sideways, only as far as needed, so that the current step's column shows.
    function showColumn(th) {
      var box = gridBox.getBoundingClientRect(), cell = th.getBoundingClientRect();
      var left = cell.left - box.left + gridBox.scrollLeft, margin = 3 * cell.width;
      if (left - margin < gridBox.scrollLeft) {
        gridBox.scrollLeft = Math.max(0, left - margin);
      } else if (left + cell.width + margin > gridBox.scrollLeft + gridBox.clientWidth) {
        gridBox.scrollLeft = left + cell.width + margin - gridBox.clientWidth;
      }
    }

    function isDone(k) {
      var id = work.reqs[k].id;
      for (var s = 0; s <= step; s++) if (work.records[s].ids.left.indexOf(id) >= 0) return true;
      return false;
    }

    function choose(index) {
      work = new Workload(data.workloads[index]);
      var problems = work.check();
      if (problems.length) {
        banner.hidden = false;
        banner.textContent = "The page's schedule disagrees with the engine's trace: " + problems.join("; ");
        console.error("scheduler-stepper: " + problems.join("; "));
      } else {
        banner.hidden = true;
      }
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
        if (work.records[s].ids.preempted.length) { controls.go(s); return; }
      }
      controls.go(work.steps - 1);
    });
    choose(0);
  }

  window.CourseSim.register("scheduler-stepper", mount);
})();
