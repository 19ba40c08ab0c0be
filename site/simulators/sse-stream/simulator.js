/* S19 "Try it": one streaming request, chunk by chunk, beside the engine steps that made it.
 *
 * The data is real: export.py (beside this file) ran each request at build time through
 * code/s19_server.py's record_stream, the server's own request parser and StreamWriter over
 * its engine (s19_server.ENGINE_CLASS, S13's LLMEngine) on the bundled model, with another
 * request ("other") running beside it at 16 tokens per step. For every engine step it recorded what the step scheduled (from the
 * engine's trace) and the server-sent-event lines the step produced for this request; the
 * lines are byte for byte what the server sends.
 *
 * The page does the client's work itself: it splits the lines it has "received" so far into
 * events (an event ends at a blank line; "data: " starts its data), stops at "[DONE]", parses
 * each chunk's JSON and joins each choice's text (chat: the delta contents) by its index, and
 * shows the finish reason and the usage when they arrive. On load it checks, for every
 * scenario, that its reading of all the lines is what the official client read at build time
 * ("expected"), that each step sent exactly one chunk for each of the request's choices that
 * sampled a token in it and none otherwise, and that each choice has exactly one chunk with a
 * finish_reason, its last (a console error and a visible banner if not; the banner shows only
 * then). The wire pane scrolls to its newest line at every position, so the usage chunk and
 * [DONE] are in view at the end.
 */
(function () {
  "use strict";

  var el = CourseSim.el;

  var count = CourseSim.count;

  function show(text) { return JSON.stringify(text); }

  // The events of an SSE text: data of each event (lines "data: x", joined with "\n").
  function events(text) {
    var out = [], data = [];
    text.split(/\r\n|\r|\n/).forEach(function (line) {
      if (line === "") {
        if (data.length) out.push(data.join("\n"));
        data = [];
        return;
      }
      if (line.charAt(0) === ":") return;
      var colon = line.indexOf(":");
      var name = colon < 0 ? line : line.slice(0, colon);
      var value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.charAt(0) === " ") value = value.slice(1);
      if (name === "data") data.push(value);
    });
    return out;
  }

  // What a client has read from the lines so far.
  function read(lines, n) {
    var choices = [], usage = null, done = false, chunks = [];
    for (var i = 0; i < n; i++) choices.push({index: i, text: "", finish_reason: null});
    events(lines.join("")).forEach(function (data) {
      if (done) throw new Error("an event after [DONE]");
      if (data === "[DONE]") { done = true; return; }
      var chunk = JSON.parse(data);
      chunks.push(chunk);
      if (chunk.usage) usage = chunk.usage;
      chunk.choices.forEach(function (c) {
        var piece = c.delta ? (c.delta.content || "") : (c.text || "");
        choices[c.index].text += piece;
        if (c.finish_reason !== null) choices[c.index].finish_reason = c.finish_reason;
      });
    });
    return {choices: choices, usage: usage, done: done, chunks: chunks};
  }

  // The stream's positions: before any step, after each engine step, after the last one.
  function positions(sc) {
    var out = [{label: "request accepted", lines: sc.start, step: null}];
    sc.steps.forEach(function (s) { out.push({label: "step " + s.step, lines: s.lines, step: s}); });
    out.push({label: "after the last step", lines: sc.end, step: null});
    return out;
  }

  function check(sc) {
    var problems = [], n = sc.choice_ids.length, id = sc.id;
    var all = [].concat(sc.start, [].concat.apply([], sc.steps.map(function (s) { return s.lines; })), sc.end);
    var got = read(all, n);
    var mine = {choices: got.choices, usage: got.usage};
    if (JSON.stringify(mine) !== JSON.stringify(sc.expected)) problems.push(id + ": the joined stream differs from the client's reading");
    if (!got.done) problems.push(id + ": no [DONE]");
    sc.steps.forEach(function (s) {
      var want = s.scheduled.filter(function (x) { return x.sampled && sc.choice_ids.indexOf(x.id) >= 0; })
        .map(function (x) { return sc.choice_ids.indexOf(x.id); }).sort();
      var sent = s.lines.map(function (line) { return JSON.parse(events(line)[0]).choices[0].index; }).sort();
      if (JSON.stringify(want) !== JSON.stringify(sent)) problems.push(id + " step " + s.step + ": chunks do not match the rows that sampled");
    });
    for (var i = 0; i < n; i++) {
      var mineI = got.chunks.filter(function (c) { return c.choices.length && c.choices[0].index === i; });
      var finals = mineI.filter(function (c) { return c.choices[0].finish_reason !== null; });
      if (finals.length !== 1 || mineI[mineI.length - 1] !== finals[0]) problems.push(id + " choice " + i + ": finish_reason not on exactly its last chunk");
    }
    return problems;
  }

  function mount(root, data) {
    var wrap = el("div", "sse-sim");
    root.appendChild(wrap);
    var banner = el("p", "sse-banner");
    banner.hidden = true;
    wrap.appendChild(banner);
    var problems = [];
    data.scenarios.forEach(function (sc) { problems = problems.concat(check(sc)); });
    CourseSim.report(banner, "sse-stream",
                     "The page's reading of the stream disagrees with the recorded run: ", problems);

    var controls = window.CourseSim.stepControls("sse-", {
      choices: data.scenarios.map(function (s) { return s.title; }),
      labels: {reset: "back to the start", back: "\u25c0 back", next: "next \u25b6"},
      labelClass: "label",
      text: function (k, last) { return pos[k].label + " (" + (k + 1) + " of " + (last + 1) + ")"; },
      onChoose: choose,
      onStep: function (k) { at = k; render(); }
    });
    wrap.appendChild(controls.row);

    var request = el("pre", "sse-request");
    wrap.appendChild(request);
    var note = el("p", "sse-note");
    wrap.appendChild(note);
    var panes = el("div", "sse-panes");
    var left = el("div", "sse-pane sse-engine");
    left.appendChild(el("h4", "sse-title", "The engine's steps"));
    left.appendChild(el("p", "sse-legend", "Each row lists what the step computed, as id:tokens. " +
      "choice0, choice1, ... are this request's choices (bold); other is another request " +
      "running beside it, whose chunks go to its own client and are not shown here. " +
      "choice0:10p 10/13 = 10 prompt tokens computed, reaching token 10 of 13; " +
      "*: the row sampled a token."));
    var stepsBox = el("div", "sse-steps");
    left.appendChild(stepsBox);
    var right = el("div", "sse-pane sse-wire");
    right.appendChild(el("h4", "sse-title", "What the server sent (text/event-stream)"));
    var linesBox = el("div", "sse-lines");
    right.appendChild(linesBox);
    panes.appendChild(left);
    panes.appendChild(right);
    wrap.appendChild(panes);
    var client = el("div", "sse-client");
    wrap.appendChild(client);

    var sc = null, pos = [], at = 0;

    function describe(p) {
      if (p.step === null && at === 0) {
        return sc.start.length ? "The server accepted the request and sent " + count(sc.start.length, "chunk") +
          " before any engine step: one per choice, its role (\"assistant\") and no text yet." :
          "The server accepted the request. Nothing is sent before the first token: a completion's chunks carry text.";
      }
      if (p.step === null) {
        return "After the last choice finished: " + (sc.end.length > 1 ? "the usage chunk (no choices), then " : "") +
          "the line data: [DONE], and the server closes the response.";
      }
      var s = p.step, mine = s.scheduled.filter(function (x) { return sc.choice_ids.indexOf(x.id) >= 0; });
      var parts = ["Step " + s.step + " computed " + s.num_tokens + " of " + s.token_budget + " tokens"];
      s.scheduled.forEach(function (x) {
        var who = sc.choice_ids.indexOf(x.id) >= 0 ? x.id + " (choice " + sc.choice_ids.indexOf(x.id) + ")" : "the other request";
        if (x.kind === "decode") {
          parts.push(who + " decodes one token");
        } else {
          parts.push(who + " computes prompt tokens " + x.start + " to " + x.end + " of " + x.total +
                     (x.sampled ? " and samples its first token" : ", samples nothing"));
        }
      });
      var sent = p.lines.length;
      parts.push(sent ? "the server sends " + count(sent, "chunk") + " for this request" :
                 (mine.length ? "nothing is sent: no row of this request sampled" : "this request was not in the step"));
      return parts.join("; ") + ".";
    }

    function render() {
      note.textContent = describe(pos[at]);

      stepsBox.textContent = "";
      var table = el("table", "sse-step-table");
      var head = el("tr");
      ["step", "tokens", "scheduled", "chunks"].forEach(function (h) {
        head.appendChild(el("th", null, h));
      });
      table.appendChild(head);
      sc.steps.forEach(function (s, k) {
        var tr = el("tr", "sse-step" + (k + 1 === at ? " sse-now" : "") + (k + 1 > at ? " sse-future" : ""));
        tr.appendChild(el("td", null, String(s.step)));
        tr.appendChild(el("td", null, s.num_tokens + "/" + s.token_budget));
        var cell = el("td", "sse-sched");
        s.scheduled.forEach(function (x) {
          var mine = sc.choice_ids.indexOf(x.id) >= 0;
          var text = x.id + ":" + x.tokens + (x.kind === "prefill" ? "p " + x.end + "/" + x.total : "") + (x.sampled ? "*" : "");
          cell.appendChild(el("span", "sse-item" + (mine ? " sse-mine" : ""), text));
        });
        tr.appendChild(cell);
        tr.appendChild(el("td", "sse-count", k + 1 <= at ? String(s.lines.length) : ""));
        table.appendChild(tr);
      });
      stepsBox.appendChild(table);

      linesBox.textContent = "";
      for (var q = 0; q <= at; q++) {
        pos[q].lines.forEach(function (line) {
          linesBox.appendChild(el("div", "sse-line" + (q === at ? " sse-new" : ""), line.replace(/\n+$/, "")));
        });
      }
      if (!linesBox.children.length) linesBox.appendChild(el("div", "sse-empty", "(nothing sent yet)"));
      linesBox.scrollTop = linesBox.scrollHeight;   // the newest lines in view (at the end: usage, [DONE])

      var got = read([].concat.apply([], pos.slice(0, at + 1).map(function (p) { return p.lines; })), sc.choice_ids.length);
      client.textContent = "";
      client.appendChild(el("h4", "sse-title", "What the client has read"));
      var ct = el("table", "sse-client-table");
      var ch = el("tr");
      ["choice", "text so far", "finish_reason"].forEach(function (h) { ch.appendChild(el("th", null, h)); });
      ct.appendChild(ch);
      got.choices.forEach(function (c) {
        var tr = el("tr", "sse-choice");
        tr.appendChild(el("td", null, String(c.index)));
        tr.appendChild(el("td", "sse-text", show(c.text)));
        tr.appendChild(el("td", "sse-reason", c.finish_reason === null ? "null (still streaming)" : c.finish_reason));
        ct.appendChild(tr);
      });
      client.appendChild(ct);
      var u = got.usage;
      client.appendChild(el("p", "sse-usage", u ? "usage: " + u.prompt_tokens + " prompt + " + u.completion_tokens +
        " completion = " + u.total_tokens + " tokens" : (sc.request.stream_options ? "usage: not yet (it comes last)" :
        "usage: not asked for (stream_options.include_usage)")));
      client.appendChild(el("p", "sse-done", got.done ? "[DONE] received: the stream is complete." : "[DONE] not received yet."));
    }

    function choose(index) {
      sc = data.scenarios[index];
      pos = positions(sc);
      request.textContent = "POST /v1/" + (sc.kind === "chat" ? "chat/completions" : "completions") + "\n" + JSON.stringify(sc.request);
      controls.setLast(pos.length - 1);
      controls.go(0);
    }

    choose(0);
  }

  window.CourseSim.register("sse-stream", mount);
})();
