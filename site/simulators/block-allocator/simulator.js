/* S12 "Try it": the block allocator. The KV pool as a grid of blocks, each coloured by the
 * request that holds it, every request's block table, the free queue and the reference counts,
 * stepping through a run of the real engine.
 *
 * The runs are real: export.py (beside this file) ran each workload at build time through
 * code/s12_engine.py's engine (build_engine) on the bundled model and recorded, per step, from
 * its step and block tracers and its pool: the scheduled requests (tokens computed before the
 * step and in it), their block tables and slot mappings, the pool's changes in order
 * ("allocated" or "freed", request, block ids), the preempted, joined and finished requests,
 * each preemption's cause, and the free queue after the step.
 * The page recomputes the pool from the changes' kinds, requests and block COUNTS alone, with
 * the pool's rules (the free queue is CourseSim.BlockPool, site/static/course.js, which S13's
 * page shares):
 *   - the free queue starts as 1, 2, ..., num_blocks - 1 (block 0 is the null block: never
 *     handed out, never freed);
 *   - an allocation of k blocks takes the k at the front of the free queue, in order, and
 *     appends them to the request's block table;
 *   - a request gives back its blocks last block first, each to the back of the free queue;
 *   - a request that has t tokens after the step's plan holds ceil(t / block_size) blocks,
 *     and its token at position p is written at slot
 *     block_table[p // block_size] * block_size + p % block_size.
 * On load it checks every recomputed block id, block table, count, slot, free count and free
 * queue against the export (console error and a visible banner if they disagree).
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count, cdiv = CourseSim.cdiv, same = CourseSim.same;

  function list(ids) { return ids.join(", "); }
  function ordinal(n) {
    var tens = n % 100, ones = n % 10;
    var suffix = tens >= 11 && tens <= 13 ? "th" : ones === 1 ? "st" : ones === 2 ? "nd" : ones === 3 ? "rd" : "th";
    return n + suffix;
  }
  function colour(k, light) { return "hsl(" + ((k * 67) % 360) + ", 65%, " + (light ? "86%" : "62%") + ")"; }

  // One run of the pool's rules; one state (after the step) per step, and the problems found.
  function replay(spec) {
    var bs = spec.block_size, pool = new CourseSim.BlockPool(spec.num_blocks), tables = {};
    var tokens = {}, status = {}, problems = [];
    var states = [], order = spec.requests.map(function (r) { return r.id; });
    spec.steps.forEach(function (st, s) {
      var at = "step " + s + ": ", atPlan = {}, allocated = [], freed = [], log = [];
      order.forEach(function (rid, k) {
        if (spec.requests[k].arrival === s && !status[rid]) status[rid] = "waiting";
      });
      var done = {};
      st.left.forEach(function (rid) { done[rid] = true; });
      st.events.forEach(function (ev) {
        var kind = ev[0], rid = ev[1], ids = ev[2], k = ids.length;
        if (kind === "allocated") {
          if (k > pool.queue.length) { problems.push(at + rid + " takes " + k + " of " + pool.queue.length + " free"); return; }
          var got = pool.allocate(k).blocks;
          if (!same(got, ids)) problems.push(at + rid + " took " + list(got) + ", the engine " + list(ids));
          tables[rid] = (tables[rid] || []).concat(got);
          allocated.push({rid: rid, ids: got});
          log.push({kind: kind, rid: rid, ids: got});
        } else {
          var table = tables[rid] || [];
          if (done[rid]) atPlan[rid] = table.slice();
          var back = table.slice(table.length - k).reverse();
          if (!same(back, ids)) problems.push(at + rid + " gave back " + list(back) + ", the engine " + list(ids));
          pool.free(back);
          table.length = Math.max(0, table.length - k);
          if (!table.length) delete tables[rid];
          var why = st.preempted.indexOf(rid) >= 0 ? "preempted" : done[rid] ? "finished" : "gave back";
          freed.push({rid: rid, ids: back, why: why});
          log.push({kind: kind, rid: rid, ids: back, why: why});
        }
      });
      st.preempted.forEach(function (rid) { status[rid] = "preempted"; tokens[rid] = 0; });
      st.scheduled.forEach(function (row) {
        var rid = row[0], start = row[1], n = row[2];
        var table = tables[rid] || atPlan[rid] || [];
        status[rid] = "running";
        tokens[rid] = start + n;
        if (!same(table, st.block_tables[rid])) problems.push(at + rid + " table " + list(table));
        if (table.length !== cdiv(start + n, bs)) problems.push(at + rid + " holds " + table.length + " blocks for " + (start + n) + " tokens");
        var slots = [];
        for (var p = start; p < start + Math.min(n, st.slot_mapping[rid].length); p++) {
          slots.push(table[Math.floor(p / bs)] * bs + p % bs);
        }
        if (!same(slots, st.slot_mapping[rid])) problems.push(at + rid + " slots");
      });
      st.left.forEach(function (rid) { status[rid] = "finished"; tokens[rid] = 0; });
      if (pool.queue.length !== st.free_blocks) problems.push(at + "free " + pool.queue.length + " != " + st.free_blocks);
      if (!same(pool.queue, st.free_queue)) problems.push(at + "free queue");
      var snapshot = {};
      Object.keys(tables).forEach(function (rid) { snapshot[rid] = tables[rid].slice(); });
      var stat = {}, tok = {};
      order.forEach(function (rid) { stat[rid] = status[rid] || "not yet"; tok[rid] = tokens[rid] || 0; });
      states.push({tables: snapshot, queue: pool.queue.slice(), status: stat, tokens: tok,
                   allocated: allocated, freed: freed, log: log, planTables: atPlan});
    });
    var last = states[states.length - 1];
    if (Object.keys(last.tables).length || last.queue.length !== spec.num_blocks - 1) problems.push("blocks still held at the end");
    return {states: states, problems: problems};
  }

  function mount(root, data) {
    var wrap = el("div", "ba-sim");
    root.appendChild(wrap);
    var banner = el("p", "ba-banner");
    banner.hidden = true;
    wrap.appendChild(banner);

    var controls = CourseSim.stepControls("ba-", {
      choices: data.workloads.map(function (w) { return w.title; }),
      onChoose: choose,
      onStep: function (s) { step = s; render(); }
    });
    wrap.appendChild(controls.row);

    var config = el("p", "ba-config");
    wrap.appendChild(config);
    var note = el("p", "ba-note");
    wrap.appendChild(note);
    var totals = el("p", "ba-totals");
    wrap.appendChild(totals);
    var pool = el("div", "ba-pool");
    wrap.appendChild(pool);
    var queueLine = el("p", "ba-queue");
    wrap.appendChild(queueLine);
    var tableBox = el("div", "ba-tables");
    wrap.appendChild(tableBox);

    var spec = null, run = null, step = 0, index = {};

    // The grid: every block in one row when they fit at a readable width (2.4rem a cell), else
    // in rows of equal length (14 blocks as 7 + 7, never 13 + 1).
    function layoutPool() {
      if (!spec) return;
      var rem = parseFloat(getComputedStyle(document.documentElement).fontSize) || 16, gap = 3;
      var width = pool.clientWidth || wrap.clientWidth || 600;
      var fit = Math.max(1, Math.floor((width + gap) / (2.4 * rem + gap)));
      var rows = Math.ceil(spec.num_blocks / fit);
      pool.style.gridTemplateColumns = "repeat(" + Math.ceil(spec.num_blocks / rows) + ", minmax(0, 1fr))";
      pool.dataset.columns = String(Math.ceil(spec.num_blocks / rows));
    }
    window.addEventListener("resize", layoutPool);

    function render() {
      var st = spec.steps[step], state = run.states[step], bs = spec.block_size;

      // What happened in the step, in the order the pool saw it.
      var parts = ["Step " + step + ":"];
      var byRid = {}, causes = (st.preemptions || []).slice();
      st.scheduled.forEach(function (row) { byRid[row[0]] = row; });
      state.log.forEach(function (ev) {
        var blocks = (ev.ids.length === 1 ? "block " : "blocks ") + list(ev.ids);
        if (ev.kind === "allocated") {
          var row = byRid[ev.rid];
          parts.push("request " + ev.rid + " takes " + blocks +
                     (row ? " (" + (row[1] + row[2]) + " tokens need " + count(cdiv(row[1] + row[2], bs), "block") + ")" : "") + ";");
        } else if (ev.why === "preempted" && causes.length && causes[0].victim === ev.rid) {
          // Why: who needed blocks, how many were free, whom the scheduler chose (S10's rule:
          // the request admitted last, which may be the very request that asked).
          var c = causes.shift(), more = c.needed - c.held;
          var need = "request " + c.by + " needs " + (more === 1 ? "a " + ordinal(c.needed) + " block" :
                     more + " more blocks (" + c.needed + " in all)") + " for " + count(c.tokens, "token") +
                     " and " + (c.free ? "only " + c.free + " " + (c.free === 1 ? "is" : "are") : "none is") + " free";
          parts.push(need + (c.by === ev.rid ? "; it is the last admitted, so it preempts itself: " :
                     ", so request " + ev.rid + ", the last admitted, is preempted: ") + blocks + " back to the free queue;");
        } else {
          parts.push("request " + ev.rid + " " + ev.why + ": " + blocks + " back to the free queue;");
        }
      });
      if (parts.length === 1) parts.push("no block changes hands;");
      parts.push(count(st.scheduled.length, "request") + " scheduled, " +
                 count(st.scheduled.reduce(function (a, r) { return a + r[2]; }, 0), "token") + " computed.");
      note.textContent = parts.join(" ");

      // Totals after the step.
      var usable = spec.num_blocks - 1, inUse = usable - state.queue.length;
      var held = 0, positions = 0, running = 0;
      Object.keys(state.tables).forEach(function (rid) {
        held += state.tokens[rid];
        positions += state.tables[rid].length * bs;
        running += 1;
      });
      totals.textContent = "After the step: " + inUse + " of " + count(usable, "usable block") + " in use (" +
        count(positions, "position") + "), holding " + count(held, "token") + "; internal waste " +
        count(positions - held, "position") + ". A contiguous cache would reserve " + data.max_context +
        " positions for each of the " + count(running, "running request") + ": " + running * data.max_context + ".";

      // The pool, block by block.
      pool.textContent = "";
      var owner = {}, allocatedNow = {}, freedNow = {};
      Object.keys(state.tables).forEach(function (rid) {
        state.tables[rid].forEach(function (b, j) { owner[b] = [rid, j]; });
      });
      state.allocated.forEach(function (a) { a.ids.forEach(function (b) { allocatedNow[b] = true; }); });
      state.freed.forEach(function (f) { f.ids.forEach(function (b) { freedNow[b] = true; }); });
      for (var b = 0; b < spec.num_blocks; b++) {
        var cell = el("div", "ba-block");
        cell.dataset.block = String(b);
        cell.appendChild(el("span", "ba-block-id", String(b)));
        if (b === data.null_block) {
          cell.className += " ba-null";
          cell.dataset.owner = "null";
          cell.appendChild(el("span", "ba-block-owner", "null"));
          cell.title = "block " + b + ": the null block, never handed out (padding of block tables)";
        } else if (owner[b]) {
          var rid = owner[b][0], j = owner[b][1];
          var fill = Math.max(0, Math.min(bs, state.tokens[rid] - j * bs));
          cell.className += " ba-held" + (allocatedNow[b] ? " ba-new" : "");
          cell.dataset.owner = rid;
          cell.dataset.fill = String(fill);
          cell.style.background = colour(index[rid], true);
          var bar = el("span", "ba-fill");
          bar.style.width = (100 * fill / bs).toFixed(2) + "%";
          bar.style.background = colour(index[rid], false);
          cell.appendChild(bar);
          cell.appendChild(el("span", "ba-block-owner", "r" + rid));
          cell.title = "block " + b + ": request " + rid + ", entry " + j + " of its table, positions " +
            (j * bs) + ".." + (j * bs + bs - 1) + ", " + fill + " of " + bs + " used, ref_cnt 1";
        } else {
          cell.className += " ba-free" + (freedNow[b] ? " ba-freed" : "");
          cell.dataset.owner = "";
          cell.appendChild(el("span", "ba-block-owner", "free"));
          cell.title = "block " + b + ": free, position " + (state.queue.indexOf(b) + 1) + " in the free queue";
        }
        pool.appendChild(cell);
      }
      layoutPool();
      queueLine.textContent = "Free queue, front first (" + count(state.queue.length, "block") + "): " +
        (state.queue.length ? list(state.queue) : "empty");

      // Every request: its state, tokens, block table, ref counts and this step's slots.
      tableBox.textContent = "";
      var t = el("table", "ba-table");
      var head = el("tr");
      ["request", "prompt", "state", "tokens held", "block table", "ref_cnt", "waste", "slots written this step"].forEach(function (h) {
        head.appendChild(el("th", null, h)); });
      t.appendChild(head);
      spec.requests.forEach(function (rq) {
        var tr = el("tr", "ba-req");
        tr.dataset.rid = rq.id;
        var table = state.tables[rq.id] || [];
        var row = byRid[rq.id];
        var key = el("td", "ba-rid", rq.id);
        key.style.background = colour(index[rq.id], true);
        tr.appendChild(key);
        tr.appendChild(el("td", null, count(rq.prompt_len, "token")));
        tr.appendChild(el("td", "ba-state", state.status[rq.id]));
        tr.appendChild(el("td", "ba-tokens", table.length ? String(state.tokens[rq.id]) : "0"));
        tr.appendChild(el("td", "ba-table-ids", table.length ? "[" + list(table) + "]" : "[]"));
        tr.appendChild(el("td", "ba-ref", table.length ? table.map(function () { return "1"; }).join(" ") : ""));
        tr.appendChild(el("td", "ba-waste", table.length ? String(table.length * bs - state.tokens[rq.id]) : ""));
        var slots = row ? st.slot_mapping[rq.id] : [];
        var shown = slots.length > 8 ? list(slots.slice(0, 8)) + ", \u2026 (" + slots.length + ")" : list(slots);
        tr.appendChild(el("td", "ba-slots", row ? "positions " + row[1] + ".." + (row[1] + row[2] - 1) + " \u2192 " + shown : ""));
        t.appendChild(tr);
      });
      tableBox.appendChild(t);
    }

    function choose(i) {
      spec = data.workloads[i];
      index = {};
      spec.requests.forEach(function (r, k) { index[r.id] = k; });
      run = replay(spec);
      CourseSim.report(banner, "block-allocator", "The page's pool disagrees with the engine's trace: ",
                       run.problems, 5);
      config.textContent = (spec.num_blocks - 1) + " usable blocks of " + count(spec.block_size, "token") + " (" +
        (spec.num_blocks - 1) * spec.block_size + " positions; block " + data.null_block + ", the null block, makes " +
        spec.num_blocks + "), " +
        spec.max_num_seqs + " seats, " + spec.max_num_batched_tokens + " tokens per step; " +
        count(spec.requests.length, "request") + ", greedy on the bundled model; " +
        count(spec.num_preemptions, "preemption") + " in the run.";
      controls.setLast(spec.steps.length - 1);
      controls.go(0);
    }

    choose(0);
  }

  CourseSim.register("block-allocator", mount);
})();
