/* S02 "Try it": byte-level BPE on the project tokenizer, merge by merge, then streamed.
 *
 * A transcription of code/s02_tokenizer.py, not a model of it:
 *   - preTokenize runs the chapter's split pattern (rewritten with explicit classes by export.py,
 *     which checks the rewrite against the `regex` module),
 *   - encodeOrdinary: a piece that is a token is taken whole, otherwise `bpe_merge` (lowest rank
 *     first, leftmost on a tie); encode with allowed specials splits on them first (each special
 *     token one piece, one id), and the pre-token row and the stream follow the same split,
 *   - mergeSteps is `merge_steps`, StreamingDetokenizer and StopStringMatcher are the classes of
 *     the same names (UTF-8 tails held back, stop strings cut where they first complete),
 *   - the stream feeds the ids as S02's Engine.postprocess would if the model produced them: an
 *     EOS id is not fed to the detokenizer and ends the request (both flushes follow); once a
 *     stop string completes, the request ends (s01 `stop_rule`) and nothing more is fed, not
 *     even the flushes; the ids left are listed as not fed.
 * Vocabulary and reference results come from export.py at build time; the page re-runs the
 * references on load and says so if it disagrees with the Python code.
 */
(function () {
  "use strict";

  var encoder = new TextEncoder();
  // Python's bytes.decode("utf-8", errors="replace") keeps a leading U+FEFF; so must we.
  var decoder = new TextDecoder("utf-8", {ignoreBOM: true});

  function key(bytes) { return String.fromCharCode.apply(null, bytes); }
  function keyBytes(k) {
    var out = new Uint8Array(k.length);
    for (var i = 0; i < k.length; i++) out[i] = k.charCodeAt(i);
    return out;
  }
  function concat(a, b) {
    var out = new Uint8Array(a.length + b.length);
    out.set(a, 0); out.set(b, a.length);
    return out;
  }

  function Tokenizer(data) {
    this.tokens = data.tokens.map(function (t) { return t === null ? null : new Uint8Array(t); });
    this.ranks = new Map();
    for (var i = 0; i < data.tokens.length; i++) {
      if (data.tokens[i] !== null) this.ranks.set(key(data.tokens[i]), i);
    }
    this.special = data.special_tokens;
    this.idToSpecial = {};
    var self = this;
    Object.keys(this.special).forEach(function (s) {
      self.idToSpecial[self.special[s]] = encoder.encode(s);
    });
    this.pattern = new RegExp(data.pattern, "gu");
    this.V = data.tokens.length;
  }

  Tokenizer.prototype.preTokenize = function (text) { return text.match(this.pattern) || []; };

  Tokenizer.prototype.mergeParts = function (bytes, record) {   // bpe_merge / merge_steps
    var parts = [];
    for (var i = 0; i < bytes.length; i++) parts.push(String.fromCharCode(bytes[i]));
    if (record) record.push({parts: parts.slice(), merged: null, rank: null});
    while (parts.length > 1) {
      var bestRank = -1, bestI = -1;
      for (var j = 0; j < parts.length - 1; j++) {
        var r = this.ranks.get(parts[j] + parts[j + 1]);
        if (r !== undefined && (bestRank < 0 || r < bestRank)) { bestRank = r; bestI = j; }
      }
      if (bestRank < 0) break;
      parts.splice(bestI, 2, parts[bestI] + parts[bestI + 1]);
      if (record) record.push({parts: parts.slice(), merged: bestI, rank: bestRank});
    }
    return parts;
  };

  Tokenizer.prototype.encodeOrdinary = function (text) {
    var ids = [], self = this;
    this.preTokenize(text).forEach(function (piece) {
      var bytes = encoder.encode(piece), whole = self.ranks.get(key(bytes));
      if (whole !== undefined) { ids.push(whole); return; }
      self.mergeParts(bytes, null).forEach(function (p) { ids.push(self.ranks.get(p)); });
    });
    return ids;
  };

  // encode(text, allowed_special="all") cuts the text at special tokens first (longest first):
  // odd chunks are special tokens, even ones ordinary text.
  Tokenizer.prototype.splitSpecial = function (text) {
    var names = Object.keys(this.special).sort(function (a, b) { return b.length - a.length; });
    if (!names.length) return [text];
    var esc = names.map(function (s) { return s.replace(/[\\^$.*+?()[\]{}|\/-]/g, "\\$&"); });
    return text.split(new RegExp("(" + esc.join("|") + ")", "u"));
  };

  Tokenizer.prototype.encode = function (text, allowSpecial) {
    if (!allowSpecial) return this.encodeOrdinary(text);
    var ids = [], self = this;
    this.splitSpecial(text).forEach(function (chunk, i) {
      if (i % 2) ids.push(self.special[chunk]);
      else if (chunk) Array.prototype.push.apply(ids, self.encodeOrdinary(chunk));
    });
    return ids;
  };

  // The pieces `encode` works on: the pre-tokens, and with allowed specials each special token
  // as one piece of its own (never split by the pattern, never merged).
  Tokenizer.prototype.pieces = function (text, allowSpecial) {
    if (!allowSpecial) return this.preTokenize(text);
    var out = [], self = this;
    this.splitSpecial(text).forEach(function (chunk, i) {
      if (i % 2) out.push(chunk);
      else if (chunk) Array.prototype.push.apply(out, self.preTokenize(chunk));
    });
    return out;
  };

  Tokenizer.prototype.bytesOf = function (id) {   // decode_bytes for one id
    if (this.tokens[id]) return this.tokens[id];
    if (this.idToSpecial[id]) return this.idToSpecial[id];
    return encoder.encode("\ufffd");
  };

  Tokenizer.prototype.decode = function (ids) {
    var self = this, chunks = ids.map(function (i) { return self.bytesOf(i); });
    var total = chunks.reduce(function (n, c) { return n + c.length; }, 0);
    var all = new Uint8Array(total), at = 0;
    chunks.forEach(function (c) { all.set(c, at); at += c.length; });
    return decoder.decode(all);
  };

  function incompleteUtf8Tail(data) {            // incomplete_utf8_tail
    for (var back = 1; back <= Math.min(4, data.length); back++) {
      var b = data[data.length - back];
      if (b >= 0x80 && b <= 0xBF) continue;
      var need = (b >= 0xC2 && b <= 0xDF) ? 2 : (b >= 0xE0 && b <= 0xEF) ? 3 :
                 (b >= 0xF0 && b <= 0xF4) ? 4 : 1;
      return back < need ? back : 0;
    }
    return 0;
  }

  function StreamingDetokenizer(tok) { this.tok = tok; this.pending = new Uint8Array(0); }
  StreamingDetokenizer.prototype.feed = function (id) {
    var data = concat(this.pending, this.tok.bytesOf(id));
    var cut = data.length - incompleteUtf8Tail(data);
    this.pending = data.slice(cut);
    return decoder.decode(data.slice(0, cut));
  };
  StreamingDetokenizer.prototype.flush = function () {
    var text = decoder.decode(this.pending);
    this.pending = new Uint8Array(0);
    return text;
  };

  function StopStringMatcher(stop) {
    stop.forEach(function (s) {
      if (typeof s !== "string" || !s) throw new Error("stop strings must be non-empty strings");
    });
    this.stop = stop.slice(); this.held = ""; this.stopped = false; this.matched = null;
  }
  StopStringMatcher.prototype.feed = function (text) {
    if (this.stopped) return "";
    var buffer = this.held + text, best = null;
    this.stop.forEach(function (s) {
      var i = buffer.indexOf(s);
      if (i < 0) return;
      var cand = [i + s.length, -s.length, s];
      if (best === null || cand[0] < best[0] || (cand[0] === best[0] && cand[1] < best[1])) best = cand;
    });
    if (best !== null) {
      this.stopped = true; this.held = ""; this.matched = best[2];
      return buffer.slice(0, best[0] + best[1]);
    }
    var keep = this.partialMatchLength(buffer);
    this.held = buffer.slice(buffer.length - keep);
    return buffer.slice(0, buffer.length - keep);
  };
  StopStringMatcher.prototype.partialMatchLength = function (text) {
    var longest = this.stop.reduce(function (m, s) { return Math.max(m, s.length); }, 1);
    for (var k = Math.min(text.length, longest - 1); k > 0; k--) {
      var tail = text.slice(text.length - k);
      if (this.stop.some(function (s) { return s.indexOf(tail) === 0; })) return k;
    }
    return 0;
  };
  StopStringMatcher.prototype.flush = function () {
    var text = this.stopped ? "" : this.held;
    this.held = "";
    return text;
  };

  /* What export.py's `stream` produces, Engine.postprocess step by step: a row per id fed (an
   * EOS id gets a row, fed: false, and ends the request), the two flushes unless a stop string
   * ended it, the ids never fed, and the finish_reason / stop_reason the engine would report
   * (running out of ids is max_tokens: "length"). */
  function streamRows(tok, ids, stops) {
    var detok = new StreamingDetokenizer(tok), matcher = new StopStringMatcher(stops), rows = [];
    var eos = tok.special["<|endoftext|>"], k = 0, finish = "length", reason = null;
    for (; k < ids.length; k++) {
      var id = ids[k], fed = id !== eos, delta = fed ? detok.feed(id) : "";
      rows.push({id: id, naive: tok.decode([id]), fed: fed, delta: delta,
                 shown: fed ? matcher.feed(delta) : "", held: matcher.held, stopped: matcher.stopped});
      if (!fed) { finish = "stop"; break; }
      if (matcher.stopped) { finish = "stop"; reason = matcher.matched; break; }
    }
    if (!matcher.stopped) {
      var tail = detok.flush();
      rows.push({id: null, naive: "", fed: true, delta: tail, shown: matcher.feed(tail),
                 held: matcher.held, stopped: matcher.stopped});
      rows.push({id: null, naive: "", fed: true, delta: "", shown: matcher.flush(), held: "",
                 stopped: matcher.stopped});
      if (matcher.stopped) { finish = "stop"; reason = matcher.matched; }
    }
    return {rows: rows, not_fed: ids.slice(k + 1), finish_reason: finish, stop_reason: reason};
  }

  // --- display helpers ---------------------------------------------------------------------
  function visible(s) {                          // make spaces and line breaks readable
    return s.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\r/g, "\u240d")
            .replace(/\t/g, "\u21e5");
  }
  function partLabel(k) {                         // bytes of a part as text, or hex if not UTF-8
    var bytes = keyBytes(k);
    try {
      return visible(new TextDecoder("utf-8", {fatal: true, ignoreBOM: true}).decode(bytes));
    } catch (e) {
      return Array.prototype.map.call(bytes, function (b) {
        return "\\x" + b.toString(16).padStart(2, "0");
      }).join("");
    }
  }
  var make = CourseSim.el;

  function mount(root, data) {
    var tok = new Tokenizer(data);

    // Self-check against the Python results exported at build time.
    var bad = [];
    data.references.forEach(function (ref) {
      var steps = [];
      tok.mergeParts(encoder.encode(ref.word), steps);
      var pySteps = JSON.stringify(ref.merge_steps);
      var jsSteps = JSON.stringify(steps.map(function (s) {
        return s.parts.map(function (p) { return Array.from(keyBytes(p)); });
      }));
      if (JSON.stringify(tok.encodeOrdinary(ref.text)) !== JSON.stringify(ref.ids) ||
          JSON.stringify(tok.encode(ref.text, true)) !== JSON.stringify(ref.ids_special) ||
          JSON.stringify(tok.preTokenize(ref.text)) !== JSON.stringify(ref.pre_tokens) ||
          jsSteps !== pySteps) bad.push(ref.text);
    });
    data.streams.forEach(function (s) {
      var got = streamRows(tok, tok.encode(s.text, s.allowed_special), s.stop);
      var want = {rows: s.rows, not_fed: s.not_fed, finish_reason: s.finish_reason,
                  stop_reason: s.stop_reason};
      if (JSON.stringify(got) !== JSON.stringify(want)) bad.push(s.text);
    });

    var ui = make("div", "bpe-sim");
    root.appendChild(ui);
    if (bad.length) {
      var msg = "bpe-tokenizer simulator disagrees with the Python tokenizer on " + bad.length +
                " reference text(s)";
      console.error(msg, bad);
      ui.appendChild(make("p", "course-error", msg));
    }

    // --- controls ------------------------------------------------------------------------
    var row = make("div", "gl-row");
    var textBox = make("textarea", "bpe-text");
    textBox.rows = 2; textBox.value = data.examples[1]; textBox.setAttribute("aria-label", "Text");
    var examples = make("select", "bpe-examples");
    examples.setAttribute("aria-label", "Examples");
    data.examples.forEach(function (e, i) {
      var o = make("option", null, visible(e)); o.value = String(i); examples.appendChild(o);
    });
    var special = make("input", "bpe-special"); special.type = "checkbox";
    function field(label, input, cls) {
      var w = make("label", "gl-field" + (cls ? " " + cls : ""));
      w.appendChild(make("span", "gl-label", label)); w.appendChild(input); return w;
    }
    row.appendChild(field("Text", textBox, "gl-field-prompt"));
    row.appendChild(field("Examples", examples));
    var specialWrap = make("label", "bpe-check");
    specialWrap.appendChild(special);
    specialWrap.appendChild(document.createTextNode(" allowed_special=\"all\" (read <|endoftext|> as the EOS token)"));
    ui.appendChild(row);
    ui.appendChild(specialWrap);

    var summary = make("p", "gl-status bpe-summary");
    var preTitle = make("h4", "gl-h", "1. Pre-tokens (the split pattern); click one to see its merges");
    var pre = make("div", "gl-context bpe-pre");
    var tokTitle = make("h4", "gl-h", "2. Tokens (id above, bytes below)");
    var toks = make("div", "gl-context bpe-tokens");
    var mergeTitle = make("h4", "gl-h", "3. Merges");
    var merges = make("ol", "bpe-merges");
    var streamTitle = make("h4", "gl-h", "4. Streaming the ids back to text");
    var stopRow = make("div", "gl-row");
    var stop1 = make("input", "bpe-stop1"); stop1.type = "text"; stop1.value = "café";
    var stop2 = make("input", "bpe-stop2"); stop2.type = "text"; stop2.value = "";
    stopRow.appendChild(field("Stop string (\\n = line break)", stop1));
    stopRow.appendChild(field("Another stop string", stop2));
    var feedBtn = make("button", "bpe-feed", "Feed the next id");
    var allBtn = make("button", "bpe-feed-all", "Feed them all");
    var resetBtn = make("button", "bpe-reset", "Restart the stream");
    [feedBtn, allBtn, resetBtn].forEach(function (b) { b.type = "button"; stopRow.appendChild(b); });
    var table = make("table", "bpe-stream");
    var shownBox = make("pre", "gl-completion bpe-shown");
    var streamNote = make("p", "gl-note bpe-stream-note");
    var error = make("p", "course-error bpe-error"); error.hidden = true;
    [summary, preTitle, pre, tokTitle, toks, mergeTitle, merges, streamTitle, stopRow, error,
     table, streamNote, shownBox].forEach(function (n) { ui.appendChild(n); });

    var picked = null, rows = [], notFed = [], finish = null, fed = 0;

    function ids() { return tok.encode(textBox.value, special.checked); }
    function isSpecial(p) { return special.checked && tok.special[p] !== undefined; }

    function renderTokens() {
      var pieces = tok.pieces(textBox.value, special.checked), list = ids();
      var nbytes = encoder.encode(textBox.value).length;
      summary.textContent = Array.from(textBox.value).length + " characters, " + nbytes + " bytes, " +
        pieces.length + " pre-tokens, " + list.length + " tokens" +
        (list.length ? " (" + (nbytes / list.length).toFixed(2) + " bytes per token)" : "");
      pre.textContent = "";
      if (picked === null || pieces.indexOf(picked) < 0) {
        var words = pieces.filter(function (p) { return !isSpecial(p); });
        picked = words.reduce(function (a, b) {
          return encoder.encode(b).length > encoder.encode(a).length ? b : a;
        }, words[0] || pieces[0] || null);
      }
      pieces.forEach(function (p) {
        var chip = make("button", "gl-tok bpe-piece" + (isSpecial(p) ? " gl-tok-eos bpe-piece-special" : "") +
                        (p === picked ? " gl-tok-new" : ""), visible(p));
        chip.type = "button";
        chip.setAttribute("data-piece", p);
        chip.addEventListener("click", function () { picked = p; renderTokens(); });
        pre.appendChild(chip);
      });
      toks.textContent = "";
      list.forEach(function (id, i) {
        var chip = make("span", "bpe-token bpe-token-" + (i % 2));
        chip.setAttribute("data-id", String(id));
        chip.appendChild(make("span", "bpe-token-id", String(id)));
        var b = tok.bytesOf(id);
        chip.appendChild(make("span", "bpe-token-text",
                              tok.idToSpecial[id] ? decoder.decode(b) : partLabel(key(b))));
        toks.appendChild(chip);
      });
      renderMerges();
    }

    function renderMerges() {
      merges.textContent = "";
      if (picked === null) { mergeTitle.textContent = "3. Merges"; return; }
      if (isSpecial(picked)) {
        mergeTitle.textContent = "3. Merges inside \u201c" + picked + "\u201d: none";
        merges.appendChild(make("li", "bpe-step bpe-step-end", "A special token (allowed_special): " +
          "cut out before the split pattern runs, one id (" + tok.special[picked] + "), never merged."));
        return;
      }
      var steps = [];
      tok.mergeParts(encoder.encode(picked), steps);
      mergeTitle.textContent = "3. Merges inside \u201c" + visible(picked) + "\u201d: " +
        (steps.length - 1) + " merge(s), lowest rank first";
      steps.forEach(function (s, k) {
        var li = make("li", "bpe-step");
        li.setAttribute("data-parts", JSON.stringify(s.parts.map(function (p) {
          return Array.from(keyBytes(p));
        })));
        s.parts.forEach(function (p, j) {
          var cls = "gl-tok" + (s.merged === j ? " gl-tok-new" : "");
          li.appendChild(make("span", cls, partLabel(p)));
        });
        li.appendChild(make("span", "bpe-step-note", k === 0 ? " bytes" :
          " merged into rank " + s.rank));
        merges.appendChild(li);
      });
      var last = steps[steps.length - 1];
      var li = make("li", "bpe-step bpe-step-end",
                    "No adjacent pair is a token: " + last.parts.length + " token(s).");
      merges.appendChild(li);
    }

    // A one-line input cannot hold a line break: "\n" and "\t" are typed as escapes.
    function unescape(s) {
      return s.replace(/\\(n|t|\\)/g, function (_, c) { return c === "n" ? "\n" : c === "t" ? "\t" : "\\"; });
    }
    function stops() {
      return [stop1.value, stop2.value].filter(function (s) { return s !== ""; }).map(unescape);
    }

    function resetStream() {
      error.hidden = true;
      try {
        var s = streamRows(tok, ids(), stops());
        rows = s.rows; notFed = s.not_fed; finish = s;
      } catch (e) {
        rows = []; notFed = []; finish = null; error.textContent = e.message; error.hidden = false;
      }
      fed = 0;
      renderStream();
    }

    function cell(tr, text, cls) {
      var td = make("td", cls, text); tr.appendChild(td); return td;
    }

    function renderStream() {
      table.textContent = "";
      var head = make("tr");
      ["#", "id", "decode([id]) alone", "detokenizer emits", "stop matcher shows", "held back"]
        .forEach(function (h) { head.appendChild(make("th", null, h)); });
      table.appendChild(head);
      var shown = "";
      for (var i = 0; i < fed; i++) {
        var r = rows[i], tr = make("tr", "bpe-row");
        tr.setAttribute("data-row", JSON.stringify(r));
        var label = r.id === null ? (rows[i + 1] ? "flush detokenizer" : "flush matcher")
                                  : String(i + 1);
        cell(tr, label);
        cell(tr, r.id === null ? "" : String(r.id));
        cell(tr, visible(r.naive), r.naive.indexOf("\ufffd") >= 0 ? "bpe-bad" : "");
        if (r.fed) {
          cell(tr, visible(r.delta));
          cell(tr, visible(r.shown), r.stopped && r.shown === "" ? "" : "bpe-ok");
        } else {                                   // EOS: postprocess never feeds it
          cell(tr, "not fed (EOS)").colSpan = 2;
        }
        cell(tr, visible(r.held));
        table.appendChild(tr);
        shown += r.shown;
      }
      var done = fed === rows.length && rows.length > 0;
      if (done) {
        // What the engine never sees: generation ended before these ids.
        notFed.forEach(function (id, j) {
          var tr = make("tr", "bpe-row-unfed");
          tr.setAttribute("data-id", String(id));
          tr.style.opacity = "0.45";
          cell(tr, String(fed + j + 1));
          cell(tr, String(id));
          cell(tr, visible(tok.decode([id])));
          cell(tr, "not fed: the request has ended").colSpan = 3;
          table.appendChild(tr);
        });
      }
      shownBox.textContent = shown;
      shownBox.hidden = fed === 0;
      var why = finish === null ? "" : finish.stop_reason !== null ?
        "the stop string " + JSON.stringify(finish.stop_reason) + " completed" :
        finish.finish_reason === "stop" ? "the EOS id came (its text is never shown)" : "";
      var ended = done ? (finish.finish_reason === "length" ?
          "End of the ids (max_tokens reached: finish_reason \"length\"): both flushes done." :
          "Generation ends here: " + why + " (finish_reason \"stop\"" +
          (finish.stop_reason !== null ? ", stop_reason " + JSON.stringify(finish.stop_reason) : "") +
          "). " + (finish.stop_reason !== null ? "The stop string and what follows are never shown; " : "") +
          (notFed.length ? notFed.length + " id(s) left are never fed to the detokenizer or the matcher."
                         : "No id is left.")) : "";
      streamNote.textContent = fed === 0 ? "Press \u201cFeed the next id\u201d." : ended;
      feedBtn.disabled = allBtn.disabled = fed >= rows.length;
    }

    textBox.addEventListener("input", function () { renderTokens(); resetStream(); });
    special.addEventListener("change", function () { renderTokens(); resetStream(); });
    examples.addEventListener("change", function () {
      textBox.value = data.examples[Number(examples.value)];
      picked = null; renderTokens(); resetStream();
    });
    [stop1, stop2].forEach(function (s) { s.addEventListener("input", resetStream); });
    feedBtn.addEventListener("click", function () { if (fed < rows.length) { fed += 1; renderStream(); } });
    allBtn.addEventListener("click", function () { fed = rows.length; renderStream(); });
    resetBtn.addEventListener("click", resetStream);

    root.bpeSim = {tokenizer: tok,
                   streamRows: function (t, s, allowed) { return streamRows(tok, tok.encode(t, allowed), s); },
                   mismatches: bad.length};
    examples.value = "1";
    renderTokens();
    resetStream();
  }

  window.CourseSim.register("bpe-tokenizer", mount);
})();
