/* Course site runtime: the simulator registry and the "Check yourself" quiz widget.
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
    var p = document.createElement("p");
    p.className = "course-error";
    p.textContent = message;
    root.appendChild(p);
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
    stepControls: stepControls
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
    function make(tag, name, content) {
      var node = document.createElement(tag);
      node.className = prefix + name;
      if (content !== undefined) node.textContent = content;
      return node;
    }
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

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

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
