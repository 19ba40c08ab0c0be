/* S06 "Try it": a host/device timeline of a few decode steps of the S06 engine.
 *
 * `timeline` and `summary` below are line-by-line transcriptions of the functions of the same
 * names in export.py beside this file (same operations in the same order, so the same doubles):
 * the host issues launches one after another, each costing it launch_us; a kernel joins the
 * device's queue when its launch ends and runs for kernel_us once the kernel before it is done;
 * a sync makes the host wait for a given kernel; post_us is the host's work once it has a
 * token id. Policies: "step" (S06: one .item() per step), "kernel" (a sync after every launch),
 * "host-sampler" (S04's NumPy sampler: the logits row comes to the host, the id goes back) and
 * "overlap" (step k+1 launched before the host waits for step k's token).
 * The counts (launches of one decode step, counted with torch.profiler on the CPU), the
 * measured host costs and the roofline device times come from export.py at build time. On load
 * the page replays the exported reference schedules and says so if it disagrees with them.
 * Drawing stays bounded: segments narrower than MERGE_PX are drawn in runs (one block per run of
 * one step, at most MERGE_PX wide); every block carries data-first / data-count (its segments'
 * indices in the lane's list), data-start / data-end (microseconds, shortest round-trip text)
 * and data-busy (the time its segments take). Kernels that take any time are drawn at least
 * 1 px wide.
 */
(function () {
  "use strict";

  var POLICY_LABELS = {
    "step": "one .item() per step (S06)",
    "kernel": "a sync after every launch",
    "host-sampler": "sampler on the host (S04's NumPy)",
    "overlap": "read the token one step late (overlap)"
  };
  var KIND_LABELS = {launch: "launch", wait: "waits for the device", sampler: "samples on the host",
                     post: "stop rules, detokenizer"};
  var SVG = "http://www.w3.org/2000/svg";
  var MERGE_PX = 3;

  function timeline(policy, steps, modelLaunches, samplerLaunches, launchUs, kernelUs, postUs,
                    hostSamplerUs) {
    var host = [], device = [], tokenAt = [];
    var clock = {host: 0.0, device: 0.0};

    function launch(step) {
      var start = clock.host;
      clock.host = start + launchUs;
      var begin = Math.max(clock.host, clock.device);
      clock.device = begin + kernelUs;
      host.push(["launch", step, start, clock.host]);
      device.push([step, begin, clock.device]);
      return clock.device;
    }
    function wait(step, until) {
      if (until > clock.host) {
        host.push(["wait", step, clock.host, until]);
        clock.host = until;
      }
    }
    function work(kind, step, us) {
      if (us > 0) {
        var start = clock.host;
        clock.host = start + us;
        host.push([kind, step, start, clock.host]);
      }
    }

    var perStep = modelLaunches + samplerLaunches, lastKernelEnd = [], done = 0, i;
    for (var step = 0; step < steps; step++) {
      if (policy === "step") {
        for (i = 0; i < perStep; i++) done = launch(step);
        wait(step, done);
      } else if (policy === "kernel") {
        for (i = 0; i < perStep; i++) wait(step, launch(step));
      } else if (policy === "host-sampler") {
        for (i = 0; i < modelLaunches + 2; i++) done = launch(step);
        wait(step, done);
        work("sampler", step, hostSamplerUs);
      } else {                                  // overlap
        for (i = 0; i < perStep; i++) done = launch(step);
        lastKernelEnd.push(done);
        if (step === 0) continue;
        wait(step - 1, lastKernelEnd[step - 1]);
        work("post", step - 1, postUs);
        tokenAt.push(clock.host);
        continue;
      }
      work("post", step, postUs);
      tokenAt.push(clock.host);
    }
    if (policy === "overlap") {
      wait(steps - 1, lastKernelEnd[steps - 1]);
      work("post", steps - 1, postUs);
      tokenAt.push(clock.host);
    }
    return {host: host, device: device, token_at: tokenAt, end: clock.host};
  }

  function summary(s) {
    var end = s.end, tokenAt = s.token_at, busy = 0.0, waited = 0.0, i;
    for (i = 0; i < s.device.length; i++) busy += s.device[i][2] - s.device[i][1];
    for (i = 0; i < s.host.length; i++) {
      if (s.host[i][0] === "wait") waited += s.host[i][3] - s.host[i][2];
    }
    var perToken = end / tokenAt.length;
    return {end: end, per_token: perToken, device_busy: busy,
            device_idle_fraction: end > 0 ? 1.0 - busy / end : 0.0, host_wait: waited};
  }

  function run(setting) {
    return timeline(setting.policy, setting.steps, setting.model_launches,
                    setting.sampler_launches, setting.launch_us, setting.kernel_us,
                    setting.post_us, setting.host_sampler_us);
  }

  function close(a, b) {
    if (typeof a === "string" || typeof b === "string") return a === b;
    return Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b), 1e-300);
  }

  function sameSchedule(a, b) {
    if (a.host.length !== b.host.length || a.device.length !== b.device.length ||
        a.token_at.length !== b.token_at.length || !close(a.end, b.end)) return false;
    var lists = [[a.host, b.host], [a.device, b.device]];
    for (var l = 0; l < lists.length; l++) {
      for (var i = 0; i < lists[l][0].length; i++) {
        for (var j = 0; j < lists[l][0][i].length; j++) {
          if (!close(lists[l][0][i][j], lists[l][1][i][j])) return false;
        }
      }
    }
    for (var k = 0; k < a.token_at.length; k++) if (!close(a.token_at[k], b.token_at[k])) return false;
    return true;
  }

  function us(x) {                               // microseconds as text a learner reads
    if (x >= 1e6) return group(x / 1e6, x >= 1e7 ? 1 : 2) + " s";
    if (x >= 1000) return (x / 1000).toFixed(x >= 10000 ? 1 : 2) + " ms";
    if (x >= 10) return x.toFixed(1) + " µs";
    if (x >= 0.01) return x.toFixed(2) + " µs";
    return x.toPrecision(2) + " µs";
  }

  function group(x, digits) {                    // 12345.6 -> "12,345.6"
    return x.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
  }

  function rateText(perSecond) {                 // tokens per second
    return perSecond >= 10 ? group(perSecond, 0) : String(Number(perSecond.toPrecision(2)));
  }

  function shown(x) {                            // a number as a field shows it: 4 significant digits
    return String(Number(x.toPrecision(4)));
  }

  var plural = CourseSim.count;

  var make = CourseSim.el;

  function field(label, control, cls) {
    var wrap = make("label", "hd-field" + (cls ? " " + cls : ""));
    wrap.appendChild(make("span", "hd-label", label));
    wrap.appendChild(control);
    return wrap;
  }

  function numberInput(cls, value, min, max, step) {
    var input = make("input", cls);
    input.type = "number";
    input.min = String(min);
    if (max !== null) input.max = String(max);
    input.step = String(step);
    setField(input, value);
    return input;
  }

  // A field shows its value to 4 significant digits and keeps the exact value for the
  // computation, until the learner types something else.
  function setField(input, x) {
    input.value = shown(x);
    input.setAttribute("data-shown", input.value);
    input.setAttribute("data-exact", String(x));
  }

  function select(cls, options, value) {
    var sel = make("select", cls);
    options.forEach(function (o) {
      var opt = make("option", null, o[1]);
      opt.value = o[0];
      sel.appendChild(opt);
    });
    sel.value = value;
    return sel;
  }

  function presetButton(text, onClick) {
    var b = make("button", "hd-preset", text);
    b.type = "button";
    b.addEventListener("click", onClick);
    return b;
  }

  function selfCheck(data) {
    var bad = 0;
    data.reference.forEach(function (ref) {
      if (!sameSchedule(run(ref.setting), ref.schedule)) bad += 1;
    });
    return bad;
  }

  function mount(root, data) {
    var ui = make("div", "hd-sim");
    root.appendChild(ui);
    var checked = make("p", "hd-check");
    var bad = selfCheck(data);
    if (bad) {
      console.error("host-device-timeline: " + bad + " of " + data.reference.length +
                    " reference schedules differ from export.py's timeline()");
      checked.className += " course-error";
      checked.textContent = bad + " of " + data.reference.length + " reference schedules " +
        "differ from the Python timeline: the numbers below are not the course's.";
    } else {
      checked.textContent = "This page reproduces all " + data.reference.length +
        " reference schedules computed by export.py's timeline() (within 1e-9).";
    }
    if (!data.available) {
      ui.appendChild(make("p", "course-error", "The S06 timeline needs the bundled model (" +
                          data.reason + "); train or restore data/model and rebuild."));
      ui.appendChild(checked);
      return;
    }
    var shapes = data.shapes, m = data.measured, counts = data.counts.bfloat16;

    // ---- controls ---------------------------------------------------------------------------
    var row1 = make("div", "hd-row"), row2 = make("div", "hd-row"), row3 = make("div", "hd-row");
    var shapeSel = select("hd-shape", Object.keys(shapes).map(function (k) {
      return [k, shapes[k].label];
    }), data.defaults.shape);
    var policySel = select("hd-policy", data.policies.map(function (p) {
      return [p, POLICY_LABELS[p] || p];
    }), data.defaults.policy);
    var stepsSel = select("hd-steps", [1, 2, 3, 4, 5, 6].map(function (n) {
      return [String(n), String(n)];
    }), String(data.defaults.steps));
    var zoomSel = select("hd-zoom", [["all", "every step"], ["step", "the first step"],
                                     ["launches", "the first 12 launches"]], "all");
    row1.appendChild(field("Model", shapeSel));
    row1.appendChild(field("Sync policy", policySel));
    row1.appendChild(field("Decode steps", stepsSel));
    row1.appendChild(field("Show", zoomSel));

    var lim = data.limits;
    var kernels = numberInput("hd-kernels", shapes[data.defaults.shape].model_launches, 1,
                              lim.model_launches, 1);
    var launchIn = numberInput("hd-launch", data.defaults.launch_us, 0, lim.launch_us, 0.1);
    var kernelIn = numberInput("hd-kernel", shapes[data.defaults.shape].roofline_kernel_us, 0,
                               lim.kernel_us, "any");
    var postIn = numberInput("hd-post", m.post_us, 0, lim.post_us, "any");
    var samplerIn = numberInput("hd-host-sampler", m.host_sampler_us, 0, lim.host_sampler_us, "any");
    row2.appendChild(field("Model launches per step", kernels));
    row2.appendChild(field("Host µs per launch", launchIn));
    row2.appendChild(field("Device µs per kernel", kernelIn));
    row2.appendChild(field("Host µs per token (stop rules, text)", postIn));
    var samplerField = field("Host sampler µs (host-side policy only)", samplerIn);
    row2.appendChild(samplerField);

    row3.appendChild(make("span", "hd-label", "Launch cost: "));
    row3.appendChild(presetButton("measured tiny op, " + us(m.tiny_op_us), function () {
      setField(launchIn, m.tiny_op_us); update();
    }));
    row3.appendChild(presetButton("measured S06 step ÷ launches, " + us(m.per_launch_us), function () {
      setField(launchIn, m.per_launch_us); update();
    }));
    row3.appendChild(presetButton("illustrative CUDA, " + us(data.illustrative.launch_us), function () {
      setField(launchIn, data.illustrative.launch_us); update();
    }));
    row3.appendChild(make("span", "hd-label", " Kernel time: "));
    row3.appendChild(presetButton("roofline", function () {
      setField(kernelIn, shapes[shapeSel.value].roofline_kernel_us); update();
    }));
    row3.appendChild(presetButton("illustrative 2 µs", function () {
      setField(kernelIn, 2); update();
    }));
    row3.appendChild(presetButton("illustrative 20 µs", function () {
      setField(kernelIn, 20); update();
    }));
    ui.appendChild(row1);
    ui.appendChild(row2);
    ui.appendChild(row3);

    var error = make("p", "hd-error course-error");
    var metrics = make("p", "hd-metrics");
    var verdict = make("p", "hd-verdict");
    var svgWrap = make("div", "hd-svg-wrap");
    var caption = make("p", "hd-caption");
    var legend = make("p", "hd-legend");
    var sources = make("div", "hd-sources");
    var results = [metrics, verdict, svgWrap, caption, legend];
    ui.appendChild(error);
    ui.appendChild(metrics);
    ui.appendChild(verdict);
    ui.appendChild(svgWrap);
    ui.appendChild(caption);
    ui.appendChild(legend);
    ui.appendChild(sources);
    ui.appendChild(checked);

    [["hd-launch", "launch"], ["hd-kernel", "kernel"], ["hd-wait", "wait"],
     ["hd-sampler", "sampler on the host"], ["hd-post", "stop rules, detokenizer"]]
      .forEach(function (k) {
        var sw = make("span", "hd-swatch " + k[0]);
        legend.appendChild(sw);
        legend.appendChild(document.createTextNode(" " + k[1] + "   "));
      });

    function sourceLine(text) { sources.appendChild(make("p", "hd-source", text)); }
    sourceLine("Counted (torch.profiler, one greedy decode step of the S06 engine on the CPU, " +
      "bfloat16): " + counts.model + " of the model's " + counts.model_ops + " ATen ops give the " +
      "device work, and " + counts.sampler + " of the sampler's " + counts.sampler_ops +
      " (the last is the .item() copy); in float32 the model's count is " +
      data.counts.float32.model + " (no casts). Qwen3-0.6B's shape: " + data.per_layer.fixed +
      " + " + data.per_layer.per_layer + " per layer × 28 = " + shapes["qwen3-0.6b"].model_launches +
      ", the per-layer rule counted on 1- and 2-layer models and checked on the bundled 6.");
    sourceLine("Measured on this site's build machine (" + data.machine + ", CPU time, no GPU, " +
      "no CUDA driver): a 1-element torch.add " + us(m.tiny_op_us) + "; a decode step of the " +
      "bundled model " + us(m.decode_step_us) + ", " + us(m.per_launch_us) + " per launch " +
      "(the CPU also does the arithmetic there); S04's NumPy sampler on one row " +
      us(m.host_sampler_us) + "; the engine's postprocess (stop rules, detokenizer) " +
      us(m.post_us) + " per token (median).");
    sourceLine("Illustrative, not measured: " + us(data.illustrative.launch_us) + " of host time " +
      "per CUDA launch, and the roofline device time: weight bytes (bfloat16) ÷ " +
      (data.illustrative.hbm_bytes_per_s / 1e12) + " TB/s (H100 SXM, specified), spread evenly " +
      "over a step's launches: " + us(shapes.bundled.floor_us) + " per step for the bundled " +
      "model, " + us(shapes["qwen3-0.6b"].floor_us) + " for Qwen3-0.6B's shape. Real kernels " +
      "are unequal (the matmuls dominate) and rarely finish in under a microsecond or two.");

    shapeSel.addEventListener("change", function () {
      setField(kernels, shapes[shapeSel.value].model_launches);
      setField(kernelIn, shapes[shapeSel.value].roofline_kernel_us);
      update();
    });
    [policySel, stepsSel, zoomSel].forEach(function (c) { c.addEventListener("change", update); });
    [kernels, launchIn, kernelIn, postIn, samplerIn].forEach(function (c) {
      c.addEventListener("input", update);
    });

    var FIELDS = [[kernels, "model_launches", "Model launches per step"],
                  [launchIn, "launch_us", "Host µs per launch"],
                  [kernelIn, "kernel_us", "Device µs per kernel"],
                  [postIn, "post_us", "Host µs per token"],
                  [samplerIn, "host_sampler_us", "Host sampler µs"]];

    // The field's value, or an error message (the limits are export.py's LIMITS).
    function read(input, key, name) {
      var text = input.value.trim(), max = lim[key];
      var x = text !== "" && text === input.getAttribute("data-shown")
        ? Number(input.getAttribute("data-exact")) : Number(text);
      var got = " (got " + (text === "" ? "nothing, or not a number" : "\u201c" + text + "\u201d") + ").";
      if (key === "model_launches") {
        if (text === "" || !isFinite(x) || Math.floor(x) !== x || x < 1 || x > max) {
          return {error: name + " must be a whole number from 1 to " + group(max, 0) + got};
        }
      } else if (text === "" || !isFinite(x) || x < 0 || x > max ||
                 (x !== 0 && x < data.min_nonzero_us)) {
        return {error: name + " must be 0 or a number from " + data.min_nonzero_us + " to " +
                       group(max, 0) + got};
      }
      input.setAttribute("data-value", String(x));
      return {value: x};
    }

    function stale(message) {
      error.textContent = message;
      results.forEach(function (node) { node.classList.add("hd-stale"); });
      ui.setAttribute("data-valid", "false");
    }

    function update() {
      var setting = {policy: policySel.value, steps: Number(stepsSel.value),
                     sampler_launches: counts.sampler}, problems = [];
      FIELDS.forEach(function (f) {
        var r = read(f[0], f[1], f[2]);
        if (r.error) problems.push(r.error); else setting[f[1]] = r.value;
      });
      samplerField.classList.toggle("hd-off", setting.policy !== "host-sampler");
      if (problems.length) {
        stale(problems.join(" ") + " The results below are for the last valid setting.");
        return;
      }
      var s = run(setting), sum = summary(s);
      if (!(s.end > 0)) {
        stale("With these settings nothing takes any time (launches, kernels and the host's " +
              "work are all 0 µs): there is nothing to measure. Give one of them some time. " +
              "The results below are for the last valid setting.");
        return;
      }
      error.textContent = "";
      results.forEach(function (node) { node.classList.remove("hd-stale"); });
      ui.setAttribute("data-valid", "true");
      draw(s, setting);
      metrics.textContent = "Per token (the total ÷ " + plural(setting.steps, "step") + "): " +
        us(sum.per_token) + " (" + rateText(1e6 / sum.per_token) + " tokens/s) · " +
        plural(setting.steps, "step") + ": " + us(sum.end) + " · device idle " +
        (100 * sum.device_idle_fraction).toFixed(2) + "% · host waits " +
        us(sum.host_wait / setting.steps) + " per step";
      metrics.setAttribute("data-per-token", String(sum.per_token));
      metrics.setAttribute("data-end", String(sum.end));
      metrics.setAttribute("data-idle", String(sum.device_idle_fraction));
      metrics.setAttribute("data-wait", String(sum.host_wait));
      var perStep = setting.policy === "host-sampler" ? setting.model_launches + 2
                                                      : setting.model_launches + setting.sampler_launches;
      var launchTotal = perStep * setting.launch_us, deviceTotal = perStep * setting.kernel_us;
      if (setting.policy === "kernel") {
        verdict.textContent = "Every launch waits for its kernel: host and device take turns, " +
          "a step costs the sum of both, and neither is ever busy while the other is.";
      } else if (setting.launch_us > setting.kernel_us) {
        verdict.textContent = "Host-bound: launching a step takes " + us(launchTotal) +
          ", running it " + us(deviceTotal) + ". The device finishes each kernel before the " +
          "next one arrives, so it idles between launches; the sync costs almost nothing. " +
          "Fewer launches (fusion, CUDA graphs in S16) is what helps.";
      } else if (deviceTotal === 0) {
        verdict.textContent = "Launches and kernels take no time here: a step is the host's " +
          "own work after each token, and the device has nothing to do.";
      } else {
        verdict.textContent = "Device-bound: the device needs " + us(deviceTotal) + " per step, " +
          "the host " + us(launchTotal) + " to launch it. The host runs ahead, then waits at " +
          "the sync while the queue drains" + (setting.policy === "overlap"
            ? "; reading the token one step late keeps the queue full, so the device never idles."
            : ", and the device idles while the host checks the token and launches again.");
      }
    }

    // Runs of one step's segments narrower than MERGE_PX become one block at most MERGE_PX
    // wide; with zoom, only the segments that start inside the view are drawn. get(i) gives
    // [kind, step, start, end].
    function blocks(n, get, view, plot, all) {
      var out = [], g = null;
      for (var i = 0; i < n; i++) {
        var seg = get(i), kind = seg[0], step = seg[1], a = seg[2], b = seg[3];
        if (!all && !(a < view)) break;               // lanes are in time order
        var narrow = (b - a) / view * plot < MERGE_PX;
        if (g && narrow && g.narrow && step === g.step &&
            (Math.min(b, view) - g.start) / view * plot <= MERGE_PX) {
          g.count += 1;
          g.end = b;
          g.busy += b - a;
        } else {
          g = {first: i, count: 1, step: step, start: a, end: b, busy: b - a, narrow: narrow,
               time: {}, number: {}, order: []};
          out.push(g);
        }
        if (!(kind in g.time)) { g.time[kind] = 0; g.number[kind] = 0; g.order.push(kind); }
        g.time[kind] += b - a;
        g.number[kind] += 1;
      }
      return out;
    }

    function draw(s, setting) {
      var width = Math.max(320, Math.min(svgWrap.clientWidth || 720, 1100));
      var left = 64, right = 8, laneH = 26, top = 18, gap = 14, plot = width - left - right;
      var view = s.end, note = "", all = zoomSel.value === "all";
      if (zoomSel.value === "step") view = s.token_at[0];
      if (zoomSel.value === "launches") {
        view = s.device[Math.min(11, s.device.length - 1)][2];
        if (!(view > 0)) {
          view = s.token_at[0];
          note = " (the first 12 launches take no time: the first step is shown)";
        }
      }
      if (!(view > 0)) { view = s.end; all = true; }
      function px(t) { return left + Math.min(t, view) / view * plot; }   // never above the plot
      var height = top + 2 * laneH + gap + 20;
      var svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("class", "hd-timeline");
      svg.setAttribute("width", String(width));
      svg.setAttribute("height", String(height));
      svg.setAttribute("viewBox", "0 0 " + width + " " + height);
      svg.setAttribute("data-view", String(view));
      var clip = document.createElementNS(SVG, "clipPath");
      clip.setAttribute("id", "hd-clip");
      var clipRect = document.createElementNS(SVG, "rect");
      clipRect.setAttribute("x", String(left));
      clipRect.setAttribute("y", "0");
      clipRect.setAttribute("width", String(plot));
      clipRect.setAttribute("height", String(height));
      clip.appendChild(clipRect);
      svg.appendChild(clip);
      var lanes = [["host", "host", top], ["device", "device", top + laneH + gap]];
      lanes.forEach(function (lane) {
        var label = document.createElementNS(SVG, "text");
        label.setAttribute("x", "4");
        label.setAttribute("y", String(lane[2] + laneH * 0.68));
        label.setAttribute("class", "hd-lane-label");
        label.textContent = lane[1];
        svg.appendChild(label);
        var bg = document.createElementNS(SVG, "rect");
        bg.setAttribute("x", String(left));
        bg.setAttribute("y", String(lane[2]));
        bg.setAttribute("width", String(plot));
        bg.setAttribute("height", String(laneH));
        bg.setAttribute("class", "hd-lane");
        svg.appendChild(bg);
      });
      var layer = document.createElementNS(SVG, "g");
      layer.setAttribute("clip-path", "url(#hd-clip)");
      svg.appendChild(layer);

      var drawn = 0, merged = 0;
      function block(lane, g, y) {
        var kind = g.order[0];
        g.order.forEach(function (k) { if (g.time[k] > g.time[kind]) kind = k; });
        var x = px(g.start), w = px(g.end) - x;
        if (lane === "device" && g.busy > 0 && w < 1) w = 1;          // kernels at least 1 px
        var r = document.createElementNS(SVG, "rect");
        r.setAttribute("x", String(x));
        r.setAttribute("y", String(y + 2));
        r.setAttribute("width", String(w));
        r.setAttribute("height", String(laneH - 4));
        r.setAttribute("class", "hd-seg hd-" + kind + (g.step % 2 ? " hd-odd" : "") +
                                (g.count > 1 ? " hd-agg" : ""));
        if (lane === "device" && g.count > 1 && g.end > g.start) {
          r.setAttribute("fill-opacity", String(0.3 + 0.7 * Math.min(1, g.busy / (g.end - g.start))));
        }
        r.setAttribute("data-lane", lane);
        r.setAttribute("data-kind", kind);
        r.setAttribute("data-step", String(g.step));
        r.setAttribute("data-first", String(g.first));
        r.setAttribute("data-count", String(g.count));
        r.setAttribute("data-start", String(g.start));
        r.setAttribute("data-end", String(g.end));
        r.setAttribute("data-busy", String(g.busy));
        var t = document.createElementNS(SVG, "title");
        var what = g.count === 1 ? (lane === "device" ? "kernel" : KIND_LABELS[kind])
          : g.order.map(function (k) { return (lane === "device" ? "kernel" : k) + " ×" + g.number[k]; })
                   .join(", ");
        t.textContent = what + ", step " + (g.step + 1) + ": " + us(g.start) + " to " + us(g.end) +
          (g.count > 1 ? ", busy " + us(g.busy) : "");
        r.appendChild(t);
        layer.appendChild(r);
        drawn += 1;
        merged += g.count;
      }
      blocks(s.host.length, function (i) { return s.host[i]; }, view, plot, all)
        .forEach(function (g) { block("host", g, lanes[0][2]); });
      blocks(s.device.length, function (i) {
        var k = s.device[i];
        return ["kernel", k[0], k[1], k[2]];
      }, view, plot, all).forEach(function (g) { block("device", g, lanes[1][2]); });
      s.token_at.forEach(function (t, i) {
        if (t > view) return;
        var x = px(t);
        var line = document.createElementNS(SVG, "line");
        line.setAttribute("x1", String(x));
        line.setAttribute("x2", String(x));
        line.setAttribute("y1", String(top));
        line.setAttribute("y2", String(top + 2 * laneH + gap));
        line.setAttribute("class", "hd-token");
        svg.appendChild(line);
        var label = document.createElementNS(SVG, "text");
        label.setAttribute("x", String(Math.min(x, width - 60)));
        label.setAttribute("y", "12");
        label.setAttribute("class", "hd-token-label");
        label.textContent = "token " + (i + 1);
        svg.appendChild(label);
      });
      var axis = document.createElementNS(SVG, "text");
      axis.setAttribute("x", String(left));
      axis.setAttribute("y", String(height - 4));
      axis.setAttribute("class", "hd-axis");
      axis.textContent = "time: 0 to " + us(view) + note + " (the vertical lines: the host has the token)";
      svg.appendChild(axis);
      svgWrap.textContent = "";
      svgWrap.appendChild(svg);
      caption.setAttribute("data-blocks", String(drawn));
      caption.setAttribute("data-segments", String(merged));
      caption.textContent = "Drawn: " + group(drawn, 0) + " blocks for " + group(merged, 0) +
        " segments. Kernels that take any time are drawn at least 1 px wide; a run of one " +
        "step's segments narrower than " + MERGE_PX + " px is drawn as one block (hover for " +
        "what it holds), a run of kernels paler the more of it the device is idle.";
    }

    update();
  }

  CourseSim.register("host-device-timeline", mount);
}());
