/* Course site runtime: the simulator registry, what the simulators share, and the "Check
 * yourself" quiz widget.
 *
 * Simulators. A page with ```{simulator} NAME``` holds <div class="course-sim" data-sim="NAME">.
 * The build adds three scripts to that page, in this order: this file, the simulator's own file
 * (site/simulators/NAME/simulator.js, which calls CourseSim.register(NAME, mount)) and its data
 * file (written at build time by site/simulators/NAME/export.py, which calls
 * CourseSim.setData(NAME, data)). When the page has loaded, every placeholder is mounted with
 * mount(element, data). Data travels as a script, not as fetched JSON, so the site also works
 * when opened straight from disk (file:// pages cannot fetch).
 * Simulators that step through a run build their row of controls (choice, buttons, slider,
 * label) with CourseSim.stepControls(prefix, options), below.
 * What several simulators need is written once here, on CourseSim: small DOM and text helpers
 * (el, count, sum, same, cdiv, breaks, legend, report, scrollToColumn), the Part II scheduler
 * model (CourseSim.Scheduler: S10's rules, which S09's page runs with no budget and S11's page
 * grows by its one rule, as the Python does) and the KV block pool model (CourseSim.BlockPool:
 * S12's free queue and reference counts, with S13's names), each described where it is defined.
 *
 * Quizzes. ```{quiz} NAME``` becomes <div class="course-quiz"> holding the quiz JSON (schema:
 * site/ext/course_quiz.py) in a <script type="application/json">; renderQuiz turns it into radio
 * choices, a check button, a score and an explanation that links back to its section.
 * Each question's choices are shown in a shuffled order (choiceOrder): a Fisher-Yates shuffle
 * driven by mulberry32, seeded with the FNV-1a hash of "<seed>:<chapter>:<question id>". The seed
 * is the page's `quiz-seed` query parameter when it is an integer (page.html?quiz-seed=7, which
 * works from file:// too; the tests use it), otherwise a fresh random number per page load, so a
 * reload may reorder the choices; the seed in use is written to the quiz's data-quiz-seed
 * attribute. A choice keeps its JSON index as its identity whatever its position: it is the
 * radio's value and the end of its id (CHAPTER-QID-INDEX), and scoring and the feedback ("The
 * answer is ...") read only that index, so no position ever decides a score.
 */
(function () {
  "use strict";

  var mounts = {};
  var datasets = {};

  function fail(root, message) {
    console.error(message);
    root.appendChild(el("p", "course-error", message));
  }

  window.CourseSim = {
    register: function (name, mount) { mounts[name] = mount; },
    setData: function (name, data) { datasets[name] = data; },
    mountAll: function () {
      var roots = document.querySelectorAll(".course-sim[data-sim]");
      Array.prototype.forEach.call(roots, function (root) {
        var name = root.getAttribute("data-sim");
        var loading = root.querySelector(".course-sim-loading");
        if (loading) loading.remove();
        if (!mounts[name] || !datasets[name]) {
          fail(root, "simulator '" + name + "' is missing its script or its data");
          return;
        }
        mounts[name](root, datasets[name]);
      });
    },
    stepControls: stepControls,
    el: el,
    count: count,
    sum: sum,
    same: same,
    cdiv: cdiv,
    breaks: breaks,
    legend: legend,
    report: report,
    scrollToColumn: scrollToColumn,
    Scheduler: Scheduler,
    BlockPool: BlockPool
  };

  // The row of step controls the stepping simulators share. With prefix "pc-": an optional
  // select.pc-pick of options.choices (titles; its value is the index, options.onChoose(index)
  // on change; with options.pickLabel it sits in label.pc-field after span.pc-label), buttons
  // .pc-reset .pc-back .pc-next (then one button per [name, text] in options.extra, class
  // prefix + name, none wired) .pc-end, a range input.pc-slider and span.pc-step-label
  // (options.labelClass renames it), all in div.pc-row, which the caller places. options.labels
  // may rename the buttons ({reset, back, next, end}). Steps run from options.min (default 0)
  // to the last, set by setLast(n). go(s) clamps s to the range, shows it (slider, label text
  // options.text(step, last), default "step S of LAST"; reset and back disabled at the first
  // step, next and end at the last), then calls options.onStep(step). The buttons and the
  // slider call go; the returned object holds the elements, buttons (by name), step, go and
  // setLast.
  function stepControls(prefix, options) {
    options = options || {};
    var min = options.min || 0;
    var names = Object.assign({reset: "back to step " + min, back: "\u25c0 step",
                               next: "step \u25b6", end: "to the end"}, options.labels || {});
    var text = options.text || function (step, last) { return "step " + step + " of " + last; };
    function make(tag, name, content) { return el(tag, prefix + name, content); }
    var ctl = {row: make("div", "row"), buttons: {}, step: min, last: min, pick: null};
    if (options.choices) {
      ctl.pick = make("select", "pick");
      options.choices.forEach(function (title, i) {
        var opt = document.createElement("option");
        opt.textContent = title;
        opt.value = String(i);
        ctl.pick.appendChild(opt);
      });
      ctl.pick.addEventListener("change", function () { options.onChoose(Number(ctl.pick.value)); });
      var holder = ctl.row;
      if (options.pickLabel) {
        holder = make("label", "field");
        holder.appendChild(make("span", "label", options.pickLabel));
        ctl.row.appendChild(holder);
      }
      holder.appendChild(ctl.pick);
    }
    var order = [["reset", names.reset], ["back", names.back], ["next", names.next]]
      .concat(options.extra || [], [["end", names.end]]);
    order.forEach(function (pair) {
      var b = make("button", pair[0], pair[1]);
      b.type = "button";
      ctl.row.appendChild(b);
      ctl.buttons[pair[0]] = b;
    });
    ["reset", "back", "next", "end"].forEach(function (name) { ctl[name] = ctl.buttons[name]; });
    ctl.slider = make("input", "slider");
    ctl.slider.type = "range";
    ctl.slider.min = String(min);
    ctl.row.appendChild(ctl.slider);
    ctl.label = make("span", options.labelClass || "step-label");
    ctl.row.appendChild(ctl.label);

    ctl.setLast = function (last) { ctl.last = last; ctl.slider.max = String(last); };
    ctl.go = function (s) {
      var step = ctl.step = Math.max(min, Math.min(ctl.last, s));
      ctl.slider.value = String(step);
      ctl.label.textContent = text(step, ctl.last);
      ctl.back.disabled = ctl.reset.disabled = step <= min;
      ctl.next.disabled = ctl.end.disabled = step >= ctl.last;
      if (options.onStep) options.onStep(step);
    };
    ctl.reset.addEventListener("click", function () { ctl.go(min); });
    ctl.back.addEventListener("click", function () { ctl.go(ctl.step - 1); });
    ctl.next.addEventListener("click", function () { ctl.go(ctl.step + 1); });
    ctl.end.addEventListener("click", function () { ctl.go(ctl.last); });
    ctl.slider.addEventListener("input", function () { ctl.go(Number(ctl.slider.value)); });
    return ctl;
  }

  // ---------------------------------------------------------------------------------------------
  // Small helpers
  // ---------------------------------------------------------------------------------------------

  // A new element: tag, then its class name (a string; "" or null for none) or an object of
  // attributes, then its text (optional).
  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls && typeof cls === "object") {
      Object.keys(cls).forEach(function (k) { node.setAttribute(k, cls[k]); });
    } else if (cls) {
      node.className = cls;
    }
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // "1 token", "2 tokens": a count and its noun, singular for exactly one.
  function count(n, noun) { return n + " " + noun + (n === 1 ? "" : "s"); }

  function sum(xs) { return xs.reduce(function (a, b) { return a + b; }, 0); }

  // Equal as JSON (arrays and plain objects of numbers and strings, in order).
  function same(a, b) { return JSON.stringify(a) === JSON.stringify(b); }

  // ceil(a / b) for integers a >= 0, b >= 1 (code/s12_paged_attention.py's cdiv).
  function cdiv(a, b) { return Math.floor((a + b - 1) / b); }

  // A text piece with its line breaks shown as the return sign, so a cell keeps one line.
  function breaks(text) { return text.replace(/\n/g, "\u21b5"); }

  // The colour key: p.PREFIXlegend holding, per [classes, words] pair, a
  // span.PREFIXlegend-item (data-kind: the classes) with a span.PREFIXswatch of those classes
  // and the words.
  function legend(prefix, pairs) {
    var box = el("p", prefix + "legend");
    pairs.forEach(function (pair) {
      var item = el("span", prefix + "legend-item");
      item.dataset.kind = pair[0];
      item.appendChild(el("span", prefix + "swatch " + pair[0]));
      item.appendChild(document.createTextNode(pair[1]));
      box.appendChild(item);
    });
    return box;
  }

  // The outcome of a simulator's check against the exported run: with problems, the banner
  // shows intro and the first `shown` of them (all by default) and the console gets every one,
  // named by the simulator; without, the banner hides.
  function report(banner, name, intro, problems, shown) {
    banner.hidden = !problems.length;
    banner.textContent = problems.length
      ? intro + problems.slice(0, shown === undefined ? problems.length : shown).join("; ") : "";
    if (problems.length) console.error(name + ": " + problems.join("; "));
  }

  // Scroll box sideways, only as far as needed, so that the column of the cell `th` (a cell of
  // a table inside box) shows with three cells' width to spare.
  function scrollToColumn(box, th) {
    var outer = box.getBoundingClientRect(), cell = th.getBoundingClientRect();
    var left = cell.left - outer.left + box.scrollLeft, margin = 3 * cell.width;
    if (left - margin < box.scrollLeft) {
      box.scrollLeft = Math.max(0, left - margin);
    } else if (left + cell.width + margin > box.scrollLeft + box.clientWidth) {
      box.scrollLeft = left + cell.width + margin - box.clientWidth;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // The Part II scheduler, model-free
  // ---------------------------------------------------------------------------------------------
  //
  // code/s10_scheduler.py's Scheduler over its TokenKVPool (S09's SlotKVManager, lowest free
  // slot first, with a KV capacity counted in tokens), written again step for step (its
  // rules: site/simulators/scheduler-stepper/simulator.js lists them), and the engine's side of
  // each step (code/s09_continuous_batching.py's LLMEngine.step): a scheduled request whose new
  // tokens reach the end of its token ids samples one token, and one that has made all its
  // tokens finishes. The pages of S09 to S11 replay the engine's runs with it from the
  // requests' lengths, arrival steps and priorities alone and check each step against the
  // trace. S09's page runs it with no budget and no KV limit (S09's FIFO scheduler is that
  // case); S11's page overrides numNewTokens, the one rule S11's ChunkedScheduler changes.
  //
  // config: maxNumSeqs; budget, the tokens of a step (max_num_batched_tokens); capacity, KV
  // token positions in all; slotSize, a slot's positions (max_context); policy, "fcfs"
  // (default) or "priority". The sizes default to Infinity (no limit).
  // run(specs) takes the requests in arrival order, each {id, at (the step it arrives before),
  // tokens (its prompt's length), target (the tokens it makes), priority (default 0),
  // endsByCapacity (true when the scheduler ends it, so its own count never does)}, steps
  // until all have finished and returns one record per step: step; scheduled, [{id, n, start,
  // total, kind ("prefill" from its admission up to the step it samples, else "decode"),
  // sampled, slot}] in schedule order; the ids joined, resumed, preempted, ended, left (ended,
  // then finished in slot order), sampled (slot order) and stalled (running, not scheduled);
  // waiting (ids, head first) with waitTokens (what each has not computed); running (ids after
  // the plan, admission order) with held ({id: KV tokens}); kvUsed, freeSlots, and tokens (all
  // scheduled). Then `requests` (arrival order) hold madeAt (the step of each token),
  // preemptions and leftAt (the step it left).
  function Scheduler(config) {
    this.maxNumSeqs = config.maxNumSeqs;
    this.budget = config.budget === undefined ? Infinity : config.budget;
    this.capacity = config.capacity === undefined ? Infinity : config.capacity;
    this.slotSize = config.slotSize === undefined ? Infinity : config.slotSize;
    this.policy = config.policy || "fcfs";
    this.waiting = [];
    this.running = [];
    this.requests = [];
    this.freeSlots = [];
    for (var s = 0; s < this.maxNumSeqs; s++) this.freeSlots.push(s);
    this.numSteps = 0;
  }

  // Tokens a request computes when scheduled with `budget` tokens left, starting after
  // `computed`: all it has not computed (the caller checks that they fit the budget).
  Scheduler.prototype.numNewTokens = function (request, computed, budget) {
    return request.tokens - computed;
  };

  Scheduler.prototype.add = function (spec) {
    var r = {id: spec.id, at: spec.at, arrival: this.requests.length, priority: spec.priority || 0,
             tokens: spec.tokens, target: spec.target, endsByCapacity: !!spec.endsByCapacity,
             computed: 0, held: 0, slot: null, made: 0, status: "waiting", preemptions: 0,
             catchingUp: false, madeAt: [], leftAt: null};
    this.requests.push(r);
    this.toWaiting(r, false);
    return r;
  };

  Scheduler.prototype.later = function (a, b) {           // a goes after b in the waiting order
    if (this.policy === "fcfs") return a.arrival > b.arrival;
    return a.priority > b.priority || (a.priority === b.priority && a.arrival > b.arrival);
  };

  Scheduler.prototype.toWaiting = function (r, front) {
    var self = this;
    if (this.policy === "fcfs") {
      if (front) this.waiting.unshift(r); else this.waiting.push(r);
      return;
    }
    var at = this.waiting.findIndex(function (w) { return self.later(w, r); });
    this.waiting.splice(at < 0 ? this.waiting.length : at, 0, r);
  };

  Scheduler.prototype.victim = function () {
    var self = this;
    if (this.policy === "fcfs") return this.running[this.running.length - 1];
    return this.running.reduce(function (a, b) { return self.later(b, a) ? b : a; });
  };

  Scheduler.prototype.kvUsed = function () {
    return sum(this.running.map(function (r) { return r.held; }));
  };

  // TokenKVPool.allocate_slots: n more tokens, all or nothing.
  Scheduler.prototype.allocate = function (r, n) {
    if (n > this.capacity - this.kvUsed() || r.held + n > this.slotSize) return false;
    if (r.slot === null) {
      if (!this.freeSlots.length) return false;
      r.slot = this.freeSlots.shift();
    }
    r.held += n;
    return true;
  };

  Scheduler.prototype.free = function (r) {
    if (r.slot !== null) {
      this.freeSlots.push(r.slot);
      this.freeSlots.sort(function (a, b) { return a - b; });
    }
    r.slot = null;
    r.held = 0;
  };

  // One step: the plan, then the model step; returns its record (see above).
  Scheduler.prototype.step = function () {
    var self = this, budget = this.budget, scheduled = [], rec = {step: this.numSteps,
      joined: [], resumed: [], preempted: [], ended: [], left: [], sampled: [], stalled: []};
    function drop(id) {
      var k = scheduled.findIndex(function (x) { return x.id === id; });
      if (k >= 0) { budget += scheduled[k].n; scheduled.splice(k, 1); }
      [rec.joined, rec.resumed].forEach(function (ids) {
        if (ids.indexOf(id) >= 0) ids.splice(ids.indexOf(id), 1);
      });
    }
    function end(r) {
      self.free(r);
      r.status = "finished";
      rec.ended.push(r.id);
    }
    function schedule(r, n) {
      scheduled.push({id: r.id, n: n, start: r.computed, total: r.tokens, request: r});
      budget -= n;
    }
    var i = 0;
    while (i < this.running.length && budget > 0) {
      var r = this.running[i], n = this.numNewTokens(r, r.computed, budget);
      if (n > budget) break;
      if (r.tokens > this.capacity) {                 // it can never run again: "length"
        this.running.splice(i, 1);
        end(r);
        continue;
      }
      while (!this.allocate(r, n)) {
        var victim = this.victim(), at = this.running.indexOf(victim);
        this.running.splice(at, 1);
        drop(victim.id);
        this.free(victim);
        victim.computed = 0;
        victim.preemptions += 1;
        victim.status = "preempted";
        this.toWaiting(victim, true);
        rec.preempted.push(victim.id);
        if (victim === r) break;                      // it was the one to go: it waits
        if (at < i) i -= 1;
      }
      if (r.status === "preempted") continue;         // the next running request goes on
      schedule(r, n);
      i += 1;
    }
    while (!rec.preempted.length && this.waiting.length && this.running.length < this.maxNumSeqs) {
      var w = this.waiting[0];
      if (w.tokens > this.capacity) { this.waiting.shift(); end(w); continue; }
      var m = this.numNewTokens(w, 0, budget);
      if (m === 0 || m > budget || !this.allocate(w, m)) break;   // nobody overtakes the head
      this.waiting.shift();
      (w.status === "preempted" ? rec.resumed : rec.joined).push(w.id);
      w.status = "running";
      w.computed = 0;
      w.catchingUp = true;
      this.running.push(w);
      schedule(w, m);
    }
    this.numSteps += 1;
    rec.waiting = this.waiting.map(function (q) { return q.id; });
    rec.waitTokens = this.waiting.map(function (q) { return q.tokens - q.computed; });
    rec.running = this.running.map(function (q) { return q.id; });
    rec.held = {};
    this.running.forEach(function (q) { rec.held[q.id] = q.held; });
    rec.kvUsed = this.kvUsed();
    rec.freeSlots = this.freeSlots.length;
    rec.tokens = sum(scheduled.map(function (x) { return x.n; }));
    var ids = scheduled.map(function (x) { return x.id; });
    rec.stalled = rec.running.filter(function (id) { return ids.indexOf(id) < 0; });
    rec.left = rec.ended.slice();
    // The model step, over the batch's rows in slot order (the runner's order, which the
    // sampled and finished ids follow).
    var batch = scheduled.slice().sort(function (a, b) { return a.request.slot - b.request.slot; });
    batch.forEach(function (x) {
      var q = x.request;
      x.kind = q.catchingUp ? "prefill" : "decode";
      x.slot = q.slot;
      q.computed = x.start + x.n;
      x.sampled = q.computed === q.tokens;            // its new tokens reach its end
      if (x.sampled) {
        rec.sampled.push(q.id);
        q.catchingUp = false;
        q.made += 1;
        q.tokens += 1;
        q.madeAt.push(rec.step);
      }
    });
    batch.forEach(function (x) {                      // then the finished ones leave
      var q = x.request;
      delete x.request;
      if (q.made >= q.target && !q.endsByCapacity) {
        self.running.splice(self.running.indexOf(q), 1);
        self.free(q);
        q.status = "finished";
        q.leftAt = rec.step;
        rec.left.push(q.id);
      }
    });
    this.requests.forEach(function (q) { if (rec.ended.indexOf(q.id) >= 0) q.leftAt = rec.step; });
    rec.scheduled = scheduled;
    return rec;
  };

  Scheduler.prototype.run = function (specs) {
    var records = [], k = 0;
    while (k < specs.length || this.waiting.length || this.running.length) {
      while (k < specs.length && specs[k].at <= records.length) this.add(specs[k++]);
      if (records.length > 100000) throw new Error("the replay does not end");
      records.push(this.step());
    }
    return records;
  };

  // ---------------------------------------------------------------------------------------------
  // The KV block pool, model-free
  // ---------------------------------------------------------------------------------------------
  //
  // code/s12_paged_attention.py's BlockPool: blocks 1 .. numBlocks - 1 start in the free queue,
  // in order (block 0 is the null block: never handed out, never freed); allocate(k) takes the
  // k at the front, ref_cnt 1; free(blocks) lowers each ref_cnt, and a block that reaches 0
  // goes to the back of the queue (so the front is the block freed longest ago); touch(blocks)
  // raises each ref_cnt, taking a block nobody held out of the queue (S13's hit). With S13's
  // names (code/s13_prefix_caching.py's PrefixCachingBlockPool): cache(block, name) names a
  // block unless a block with that name is cached already (then false); lookup(name) finds a
  // cached block; a free block keeps its name until allocate takes it, which evicts it.
  // allocate returns {blocks, evicted}. State: queue (front first), ref (by block), name ({block:
  // name}).
  function BlockPool(numBlocks) {
    this.numBlocks = numBlocks;
    this.queue = [];
    this.ref = [0];
    this.name = {};
    this.byName = {};
    for (var b = 1; b < numBlocks; b++) { this.queue.push(b); this.ref.push(0); }
  }

  BlockPool.prototype.allocate = function (k) {
    var self = this, blocks = this.queue.splice(0, k), evicted = [];
    blocks.forEach(function (b) {
      self.ref[b] = 1;
      if (self.name[b] !== undefined) {
        evicted.push(b);
        delete self.byName[self.name[b]];
        delete self.name[b];
      }
    });
    return {blocks: blocks, evicted: evicted};
  };

  BlockPool.prototype.free = function (blocks) {
    var self = this;
    blocks.forEach(function (b) {
      self.ref[b] -= 1;
      if (self.ref[b] === 0) self.queue.push(b);
    });
  };

  BlockPool.prototype.touch = function (blocks) {
    var self = this;
    blocks.forEach(function (b) {
      if (self.ref[b] === 0) self.queue.splice(self.queue.indexOf(b), 1);
      self.ref[b] += 1;
    });
  };

  BlockPool.prototype.cache = function (block, name) {
    if (this.byName[name] !== undefined) return false;
    this.byName[name] = block;
    this.name[block] = name;
    return true;
  };

  BlockPool.prototype.lookup = function (name) { return this.byName[name]; };

  // ---------------------------------------------------------------------------------------------
  // Quizzes
  // ---------------------------------------------------------------------------------------------

  function sectionTitle(anchor) {
    var target = document.getElementById(anchor);
    if (!target) return anchor;
    var heading = target.matches("h1,h2,h3,h4") ? target : target.querySelector("h1,h2,h3,h4");
    if (!heading) return anchor;
    // Sphinx appends a pilcrow link to headings; keep only the heading's own text.
    var copy = heading.cloneNode(true);
    Array.prototype.forEach.call(copy.querySelectorAll(".headerlink"), function (a) { a.remove(); });
    return copy.textContent.trim();
  }

  // FNV-1a, 32 bits: a string to a seed.
  function hash32(text) {
    var h = 0x811c9dc5;
    for (var i = 0; i < text.length; i++) {
      h ^= text.charCodeAt(i);
      h = Math.imul(h, 0x01000193) >>> 0;
    }
    return h;
  }

  // mulberry32: a small seeded generator of floats in [0, 1).
  function mulberry32(seed) {
    var a = seed >>> 0;
    return function () {
      a = (a + 0x6d2b79f5) >>> 0;
      var t = Math.imul(a ^ (a >>> 15), a | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  // The JSON indices 0..n-1 in the order they are shown (a permutation, fixed by seed and key).
  function choiceOrder(n, seed, key) {
    var order = [], random = mulberry32(hash32(seed + ":" + key));
    for (var i = 0; i < n; i++) order.push(i);
    for (var j = n - 1; j > 0; j--) {
      var k = Math.floor(random() * (j + 1));
      var swap = order[j]; order[j] = order[k]; order[k] = swap;
    }
    return order;
  }

  // One seed per page load: ?quiz-seed=N when given, else random.
  var pageQuizSeed = (function () {
    var match = /[?&]quiz-seed=(-?\d+)(?:&|$)/.exec(window.location.search);
    if (match) return Number(match[1]) >>> 0;
    if (window.crypto && window.crypto.getRandomValues) {
      return window.crypto.getRandomValues(new Uint32Array(1))[0];
    }
    return Math.floor(Math.random() * 4294967296);
  })();

  function renderQuiz(root) {
    var quiz = JSON.parse(root.querySelector("script.course-quiz-data").textContent);
    root.setAttribute("data-quiz-seed", String(pageQuizSeed));
    var form = el("form", {"class": "course-quiz-form"});
    form.addEventListener("submit", function (e) { e.preventDefault(); });
    quiz.questions.forEach(function (q, qi) {
      var fs = el("fieldset", {"class": "course-quiz-question", "data-qid": q.id});
      fs.appendChild(el("legend", {}, (qi + 1) + ". " + q.question));
      choiceOrder(q.choices.length, pageQuizSeed, quiz.chapter + ":" + q.id).forEach(function (ci) {
        var choice = q.choices[ci];
        var id = quiz.chapter + "-" + q.id + "-" + ci;
        var label = el("label", {"for": id, "class": "course-quiz-choice"});
        var input = el("input", {"type": "radio", "name": quiz.chapter + "-" + q.id, "id": id,
                                 "value": String(ci)});
        label.appendChild(input);
        label.appendChild(document.createTextNode(" " + choice));
        fs.appendChild(label);
      });
      var feedback = el("div", {"class": "course-quiz-feedback", "hidden": "hidden",
                                "aria-live": "polite"});
      fs.appendChild(feedback);
      form.appendChild(fs);
    });
    var check = el("button", {"type": "button", "class": "course-quiz-check"}, "Check answers");
    var again = el("button", {"type": "button", "class": "course-quiz-reset"}, "Start again");
    var score = el("p", {"class": "course-quiz-score", "aria-live": "polite"});
    var bar = el("div", {"class": "course-quiz-actions"});
    bar.appendChild(check);
    bar.appendChild(again);
    bar.appendChild(score);
    form.appendChild(bar);

    check.addEventListener("click", function () {
      var right = 0;
      quiz.questions.forEach(function (q) {
        var fs = form.querySelector('fieldset[data-qid="' + q.id + '"]');
        var picked = fs.querySelector("input:checked");
        var fb = fs.querySelector(".course-quiz-feedback");
        var ok = picked !== null && Number(picked.value) === q.answer;
        if (ok) right += 1;
        fs.classList.toggle("is-right", ok);
        fs.classList.toggle("is-wrong", !ok);
        fb.textContent = "";
        var verdict = picked === null ? "Not answered. " : (ok ? "Right. " : "Not quite. ");
        fb.appendChild(el("strong", {}, verdict));
        if (!ok) {
          fb.appendChild(document.createTextNode("The answer is \u201c" + q.choices[q.answer] +
                                                 "\u201d. "));
        }
        fb.appendChild(document.createTextNode(q.explanation + " "));
        var back = el("a", {"href": "#" + q.section, "class": "course-quiz-back"},
                      "Back to \u201c" + sectionTitle(q.section) + "\u201d");
        fb.appendChild(back);
        fb.hidden = false;
      });
      score.textContent = "Score: " + right + " of " + quiz.questions.length;
      score.setAttribute("data-right", String(right));
    });
    again.addEventListener("click", function () {
      form.reset();
      Array.prototype.forEach.call(form.querySelectorAll("fieldset"), function (fs) {
        fs.classList.remove("is-right", "is-wrong");
        var fb = fs.querySelector(".course-quiz-feedback");
        fb.hidden = true;
        fb.textContent = "";
      });
      score.textContent = "";
      score.removeAttribute("data-right");
    });
    var noscript = root.querySelector(".course-quiz-nojs");
    if (noscript) noscript.remove();
    root.appendChild(form);
  }

  document.addEventListener("DOMContentLoaded", function () {
    Array.prototype.forEach.call(document.querySelectorAll(".course-quiz"), function (root) {
      try { renderQuiz(root); } catch (err) { fail(root, "quiz failed to load: " + err); }
    });
    window.CourseSim.mountAll();
  });
})();
