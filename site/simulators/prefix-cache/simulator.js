/* S13 "Try it": the prefix cache. Requests that share a prefix find its full blocks by name,
 * hold them together (reference counts), and leave them cached in the free queue when they
 * finish, until an allocation takes them from the front and evicts their names.
 *
 * The runs are real: export.py (beside this file) ran each workload at build time through
 * code/s13_prefix_caching.py's engine (build_engine: the prefix-caching block manager) on the
 * bundled model and recorded every request's tokens, the names of its full blocks and the
 * engine's trace (its step, block and cache tracers' records). The page takes the schedule
 * from the trace (who runs in each step with how many tokens, who finishes) and recomputes the
 * cache itself, on S12's pool model with names (CourseSim.BlockPool, site/static/course.js),
 * with S13's rules:
 *   - a request admitted looks up its first block names in the cache map and takes the longest
 *     run found, at most (its tokens - 1) // block size blocks (its last token is computed);
 *     each block hit gets ref_cnt + 1 and, if nobody held it, leaves the free queue;
 *   - new blocks come from the front of the free queue, ref_cnt 1; a block taken that had a
 *     name loses it (an eviction);
 *   - after the model step, each scheduled request's full blocks among its computed tokens get
 *     their names, unless a block with that name is cached already (a twin stays unnamed);
 *   - a request that finishes gives its blocks back last first: ref_cnt - 1, and at 0 to the
 *     back of the free queue, keeping its name (still a hit until it is taken).
 * The pool's colours: held (light blue, one request; purple, several), with a green bar when
 * the block has a name (so a held block a new request can hit looks different from one still
 * filling), free and cached (green), free (white); a dark-green dot marks the blocks named in
 * the step, a yellow frame the hits, a dashed red one the evictions.
 * On load it checks each step's events, block tables, ref counts, cached blocks and free queue
 * against the exported trace (console error and a visible banner if they disagree).
 */
(function () {
  "use strict";

  var el = CourseSim.el, count = CourseSim.count, same = CourseSim.same, show = CourseSim.breaks;

  // The cache, replayed from the schedule and the block names. One snapshot per step.
  function replay(work) {
    var bs = work.block_size, pool = new CourseSim.BlockPool(work.num_blocks);
    var reqs = {}, tables = {}, held = {}, named = {};
    work.requests.forEach(function (r) { reqs[r.id] = r; });
    var stats = {admissions: 0, hitRequests: 0, queries: 0, hits: 0};
    var snaps = [];

    work.trace.forEach(function (t) {
      var events = [], hitsNow = [], cachedNow = [], evictedNow = [], hitsOf = {};
      t.running.forEach(function (rid, k) {
        var num = t.num_scheduled_tokens[k], total = t.request_num_tokens[k];
        var hashes = reqs[rid].hashes, got;
        if (!(rid in tables)) {                          // admitted: the lookup
          var run = [], most = Math.floor((total - 1) / bs);
          for (var i = 0; i < most && i < hashes.length && pool.lookup(hashes[i]) !== undefined; i++) {
            run.push(pool.lookup(hashes[i]));
          }
          pool.touch(run);
          var start = run.length * bs;
          got = pool.allocate(Math.ceil((start + num) / bs) - run.length);
          if (run.length) events.push(["hit", rid, run.slice()]);
          tables[rid] = run.concat(got.blocks);
          held[rid] = start + num;
          named[rid] = 0;
          hitsOf[rid] = [start, total];
          hitsNow = hitsNow.concat(run);
          stats.admissions += 1;
          stats.hitRequests += start > 0 ? 1 : 0;
          stats.queries += total;
          stats.hits += start;
        } else {                                         // running: blocks for its new tokens
          got = pool.allocate(Math.ceil((held[rid] + num) / bs) - tables[rid].length);
          tables[rid] = tables[rid].concat(got.blocks);
          held[rid] += num;
        }
        if (got.evicted.length) events.push(["evicted", rid, got.evicted]);
        if (got.blocks.length) events.push(["allocated", rid, got.blocks]);
        evictedNow = evictedNow.concat(got.evicted);
      });
      var scheduled = t.running.map(function (rid) {
        return {id: rid, table: tables[rid].slice(),
                refs: tables[rid].map(function (blk) { return pool.ref[blk]; })};
      });
      t.running.forEach(function (rid, k) {             // after the model step: names
        var hashes = reqs[rid].hashes;
        var full = Math.floor(Math.min(t.num_computed_tokens[k] + t.num_scheduled_tokens[k],
                                       held[rid], t.request_num_tokens[k]) / bs);
        var mine = [];
        for (var i = named[rid]; i < full; i++) {
          if (pool.cache(tables[rid][i], hashes[i])) mine.push(tables[rid][i]);
        }
        named[rid] = Math.max(named[rid], full);
        if (mine.length) events.push(["cached", rid, mine]);
        cachedNow = cachedNow.concat(mine);
      });
      var freedNow = [];
      t.left.forEach(function (rid) {                   // finished: last block first
        var back = tables[rid].slice().reverse();
        pool.free(back);
        events.push(["freed", rid, back]);
        freedNow = freedNow.concat(back);
        delete tables[rid];
      });
      var cached = Object.keys(pool.name).map(Number).sort(function (a, c) { return a - c; })
        .map(function (blk) { return [blk, pool.name[blk]]; });
      var holders = {};
      Object.keys(tables).forEach(function (rid) {
        tables[rid].forEach(function (blk) { holders[blk] = (holders[blk] || 0) + 1; });
      });
      snaps.push({step: t.step, events: events, scheduled: scheduled, hitsOf: hitsOf,
                  hitsNow: hitsNow, cachedNow: cachedNow, evictedNow: evictedNow,
                  freedNow: freedNow, left: t.left.slice(), joined: t.joined.slice(),
                  free: pool.queue.slice(), cached: cached, ref: pool.ref.slice(),
                  name: Object.assign({}, pool.name), holders: holders,
                  tables: JSON.parse(JSON.stringify(tables)),
                  stats: Object.assign({}, stats)});
    });
    return snaps;
  }

  // The page's replay against the engine's trace, step by step.
  function check(work, snaps) {
    var problems = [];
    work.trace.forEach(function (t, i) {
      var s = snaps[i], at = "step " + t.step + ": ";
      if (!same(s.events, t.block_events)) problems.push(at + "events");
      if (!same(s.free, t.free_queue)) problems.push(at + "free queue");
      if (!same(s.cached, t.cached_blocks)) problems.push(at + "cached blocks");
      s.scheduled.forEach(function (x, k) {
        if (!same(x.table, t.block_tables[k])) problems.push(at + "block table of " + x.id);
        if (!same(x.refs, t.ref_cnts[k])) problems.push(at + "ref counts of " + x.id);
      });
      var hits = {};
      t.cache_hits.forEach(function (h) { hits[h[0]] = [h[1], h[2]]; });
      if (!same(s.hitsOf, hits)) problems.push(at + "hits");
      var st = s.stats;
      if (!same([st.admissions, st.hitRequests, st.queries, st.hits], t.cache_stats)) problems.push(at + "counters");
    });
    return problems;
  }

  function mount(root, data) {
    var wrap = el("div", "pc-sim");
    root.appendChild(wrap);
    var banner = el("p", "pc-banner");
    banner.hidden = true;
    wrap.appendChild(banner);

    var controls = CourseSim.stepControls("pc-", {
      choices: data.workloads.map(function (w) { return w.title; }),
      onChoose: choose,
      onStep: function (s) { step = s; render(); }
    });
    wrap.appendChild(controls.row);

    var config = el("p", "pc-config");
    wrap.appendChild(config);
    wrap.appendChild(CourseSim.legend("pc-", [
      ["pc-held", "held by one request, no name yet (number: ref_cnt)"],
      ["pc-held pc-named", "held and named (green bar): a new request can hit it"],
      ["pc-shared pc-named", "held by several (a hit)"],
      ["pc-cached-free", "free, still cached (a hit takes it back)"], ["pc-free", "free, no name"],
      ["pc-null", "block 0, the null block"], ["pc-hit-now", "hit in this step"],
      ["pc-evicted-now", "name evicted in this step"],
      ["pc-cached-now", "named in this step (dark-green dot)"]]));
    var body = el("div", "pc-body");
    wrap.appendChild(body);

    var work = null, snaps = null, step = 0;

    function blockCell(s, blk) {
      var refc = s.ref[blk], cls = "pc-block";
      if (blk === 0) cls += " pc-null";
      else if (refc > 1) cls += " pc-shared";
      else if (refc === 1) cls += " pc-held";
      else if (s.name[blk] !== undefined) cls += " pc-cached-free";
      else cls += " pc-free";
      if (blk !== 0 && refc > 0 && s.name[blk] !== undefined) cls += " pc-named";
      if (s.hitsNow.indexOf(blk) >= 0) cls += " pc-hit-now";
      if (s.evictedNow.indexOf(blk) >= 0) cls += " pc-evicted-now";
      if (s.cachedNow.indexOf(blk) >= 0) cls += " pc-cached-now";
      var cell = el("span", cls);
      cell.dataset.block = String(blk);
      cell.dataset.ref = String(blk === 0 ? 0 : refc);
      cell.dataset.name = s.name[blk] || "";
      cell.appendChild(el("span", "pc-block-id", String(blk)));
      cell.appendChild(el("span", "pc-block-ref", blk === 0 || refc === 0 ? "" : String(refc)));
      cell.title = "block " + blk + (blk === 0 ? " (null block)" : ": ref_cnt " + refc +
        (s.name[blk] !== undefined ? ", cached as " + s.name[blk] : ", no name"));
      return cell;
    }

    function render() {
      var s = snaps[step], t = work.trace[step];
      body.textContent = "";

      var note = el("p", "pc-note");
      var parts = ["Step " + step + ": " + count(t.num_tokens, "token") + " computed"];
      Object.keys(s.hitsOf).forEach(function (rid) {
        var h = s.hitsOf[rid];
        parts.push("request " + rid + " admitted: " + h[0] + " of " + count(h[1], "token") +
          " found cached" + (h[0] ? " (" + count(h[0] / work.block_size, "block") + ")" : ""));
      });
      if (s.evictedNow.length) parts.push((s.evictedNow.length === 1 ? "block " : "blocks ") +
        s.evictedNow.join(", ") + " evicted (taken from the front of the free queue)");
      if (s.cachedNow.length) parts.push((s.cachedNow.length === 1 ? "block " : "blocks ") +
        s.cachedNow.join(", ") + " now cached");
      s.left.forEach(function (rid) {
        var freed = s.events.filter(function (e) { return e[0] === "freed" && e[1] === rid; })[0][2];
        parts.push("request " + rid + " finished: gives back " + freed.join(", ") + " (last block first)");
      });
      note.textContent = parts.join("; ") + ".";
      body.appendChild(note);

      body.appendChild(el("h4", "pc-title", "The pool: " + count(work.num_blocks, "block") + " of " +
        count(work.block_size, "token") + " after step " + step));
      var grid = el("div", "pc-grid");
      for (var b = 0; b < work.num_blocks; b++) grid.appendChild(blockCell(s, b));
      body.appendChild(grid);

      var queue = el("div", "pc-queue");
      queue.appendChild(el("span", "pc-queue-title", "free queue, front first (taken first): "));
      if (!s.free.length) queue.appendChild(el("span", "pc-empty", "empty"));
      s.free.forEach(function (blk) {
        var chip = el("span", "pc-chip" + (s.name[blk] !== undefined ? " pc-cached-free" : " pc-free"), String(blk));
        chip.dataset.block = String(blk);
        queue.appendChild(chip);
      });
      body.appendChild(queue);

      var st = s.stats;
      body.appendChild(el("p", "pc-stats", "Prefix cache so far: " + st.hits + " of " +
        count(st.queries, "prompt token") + " found cached (" +
        (st.queries ? (100 * st.hits / st.queries).toFixed(1) : "0.0") + "%), " + st.hitRequests +
        " of " + count(st.admissions, "admission") + " with a hit; " + count(s.cached.length, "block") +
        " cached, " + count(Object.keys(s.holders).length, "block") + " held."));

      var rt = el("table", "pc-req-table");
      var rh = el("tr");
      ["request", "arrives", "prompt", "found cached", "block table (x ref_cnt)", "made", "completion so far"].forEach(function (h) {
        rh.appendChild(el("th", null, h)); });
      rt.appendChild(rh);
      work.requests.forEach(function (rq) {
        var tr = el("tr", "pc-req");
        var made = rq.generated.filter(function (g) { return g[0] <= step; }).length;
        var admitted = null;
        for (var k = 0; k <= step; k++) if (snaps[k].hitsOf[rq.id]) admitted = snaps[k].hitsOf[rq.id];
        tr.appendChild(el("td", null, rq.id));
        tr.appendChild(el("td", null, "step " + rq.arrival));
        tr.appendChild(el("td", null, count(rq.prompt_len, "token")));
        tr.appendChild(el("td", "pc-found", admitted ? admitted[0] + " of " + admitted[1] : "not yet"));
        var tableCell = el("td", "pc-table");
        var tab = s.tables[rq.id];
        if (tab) {
          tab.forEach(function (blk) {
            var c = s.ref[blk];
            tableCell.appendChild(el("span", "pc-chip " + (c > 1 ? "pc-shared" : "pc-held"),
                                     c > 1 ? blk + "\u00d7" + c : String(blk)));
          });
        } else {
          tableCell.textContent = admitted ? "finished: holds none" : "";
        }
        tr.appendChild(tableCell);
        var doneNow = made === rq.generated.length;
        tr.appendChild(el("td", "pc-status", count(made, "token") + (doneNow ? ", finished (" + rq.finish_reason + ")" : "")));
        tr.appendChild(el("td", "pc-text", show(rq.generated.filter(function (g) { return g[0] <= step; })
          .map(function (g) { return g[2]; }).join(""))));
        rt.appendChild(tr);
      });
      var reqBox = el("div", "pc-requests");
      reqBox.appendChild(rt);
      body.appendChild(reqBox);
    }

    function choose(index) {
      work = data.workloads[index];
      snaps = replay(work);
      var problems = check(work, snaps);
      CourseSim.report(banner, "prefix-cache", "The page's cache disagrees with the engine's trace: ",
                       problems);
      config.textContent = "The same bundled model, greedy; blocks of " + count(work.block_size, "token") +
        ", a pool of " + count(work.num_blocks, "block") + " (block 0 is the null block), at most " +
        work.max_num_seqs + " running. A block is named once it is full and its KV written; its name is the first " +
        data.hash_digits + " hex digits of its SHA-256 chain hash.";
      controls.setLast(snaps.length - 1);
      controls.go(0);
    }

    choose(0);
  }

  CourseSim.register("prefix-cache", mount);
})();
