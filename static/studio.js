/* Fast-dLLM v2 studio: the denoising view (live and replay share this renderer).
 *
 * Input is the engine's trace format (engine/events.py): a header, then one event per forward with
 * `committed` and `masked` lists of [pos, id, text, conf] (pos answer-relative). The live view gets only
 * the events new since the last frame; the replay player walks a stored trace. Model text is untrusted:
 * the DOM is built with textContent only, never innerHTML. Everything shown is numbered from 1 (blocks,
 * sub-blocks, answer tokens, forwards); the trace itself keeps the engine's 0-based positions.
 */
(() => {
  "use strict";
  if (window.FDStudio) return;

  const SPEEDS = [0.1, 0.25, 0.5, 1, 2, 4];
  const STAT_HELP = {
    NFE: "forwards so far (network function evaluations), prefill and block commits included",
    steps: "decoding forwards (prefill + sub-block steps; block-commit forwards not counted)",
    block: "active block, counted from 1 on the block grid (which starts at the prompt's first token)",
    "sub-block": "active sub-block inside the block / sub-blocks per block",
    tokens: "answer tokens so far (the committed prefix, as the chat shows it: a token committed after a still-masked one counts once the gap fills) / max new tokens",
    "tok/forward": "committed tokens per forward so far",
    engine: "engine time since decoding started (UI excluded)",
  };
  const GROUP_HUES = [210, 32, 280, 175, 330, 95];

  // viridis (colour-blind safe, as the heatmap in app/plots.py): dark purple = low confidence, yellow = high
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const confColour = (c, a) => {
    const x = Math.max(0, Math.min(1, Number(c) || 0)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(x)), f = x - i;
    const [r, g, b] = VIRIDIS[i].map((v, k) => Math.round(v + (VIRIDIS[i + 1][k] - v) * f));
    return `rgba(${r}, ${g}, ${b}, ${a})`;
  };
  const visible = (s) => (s === "" ? "∅" : s.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍"));
  const fmt = (x, d = 2) => (Number.isFinite(x) ? x.toFixed(d) : "–");

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function legend() {
    // each item is a swatch followed by its own words, kept together, so no label reads as another's value
    const box = el("div", "fd-legend");
    const item = (...parts) => { const i = el("span", "fd-legend-item"); i.append(...parts); box.append(i); };
    const bar = el("span", "fd-legend-bar");
    const stops = [];
    for (let i = 0; i <= 10; i++) stops.push(`${confColour(i / 10, 0.9)} ${i * 10}%`);
    bar.style.background = `linear-gradient(90deg, ${stops.join(", ")})`;
    item(el("span", "fd-legend-k", "confidence"), el("span", "fd-legend-n", "0"), bar, el("span", "fd-legend-n", "1"));
    const m = el("span", "fd-cell fd-masked fd-legend-cell");
    m.append(el("span", "fd-tok", "▒▒"));
    item(m, el("span", "fd-legend-k", "masked"));
    const p = el("span", "fd-cell fd-prompt fd-legend-cell");
    p.append(el("span", "fd-tok", "·"));
    item(p, el("span", "fd-legend-k", "prompt"));
    const c = el("span", "fd-cell fd-legend-cell fd-legend-tok");
    c.style.background = confColour(0.95, 0.35);
    c.append(el("span", "fd-tok", "sea"), el("span", "fd-step", "3"));
    item(c, el("span", "fd-legend-k", "committed at forward 3"));
    item(el("span", "fd-legend-k fd-legend-hint", "same outline = same forward · click a token for details · Esc closes"));
    item(el("span", "fd-legend-k fd-legend-wrap", "narrow screen: a block's sub-blocks wrap onto several lines"));
    return box;
  }

  /* ------------------------------------------------------------------ renderer */
  class Renderer {
    constructor(root, opts = {}) {
      this.root = root;
      root.classList.add("fd-renderer");
      root.replaceChildren();
      this.status = el("div", "fd-status");
      this.stats = el("div", "fd-stats");
      const head = el("div", "fd-head");
      head.append(this.status, this.stats);
      this.grid = el("div", "fd-grid");
      this.card = el("div", "fd-card-pop");
      this.card.hidden = true;
      this.empty = el("div", "fd-empty", opts.empty || "Send a message to watch the blocks denoise.");
      root.append(head, legend(), this.grid, this.empty, this.card);
      this.pinned = null;
      this.grid.setAttribute("role", "group");
      this.grid.setAttribute("aria-label", "denoising view: one row per block; Tab to a token, Enter pins its card, Escape closes it");
      this.card.setAttribute("role", "dialog");
      this.card.setAttribute("aria-live", "polite");
      const cellOf = (e) => { const c = e.target.closest && e.target.closest(".fd-cell[data-pos]"); return c && this.grid.contains(c) ? c : null; };
      this.grid.addEventListener("mouseover", (e) => { const c = cellOf(e); if (c && !this.pinned) this.show(c); });
      this.grid.addEventListener("mouseleave", () => { if (!this.pinned) this.hide(); });
      this.grid.addEventListener("focusin", (e) => { const c = cellOf(e); if (c && !this.pinned) this.show(c); });
      this.grid.addEventListener("focusout", () => { if (!this.pinned) this.hide(); });
      this.grid.addEventListener("click", (e) => this.toggle(cellOf(e)));
      this.grid.addEventListener("keydown", (e) => {
        const c = cellOf(e);
        if (c && (e.key === "Enter" || e.key === " ")) { e.preventDefault(); this.toggle(c); }
      });
      // a pinned card closes with Escape or a click anywhere outside it and its cell
      document.addEventListener("keydown", (e) => { if (e.key === "Escape" && this.pinned) { const c = this.pinned; this.unpin(); c.focus(); } });
      document.addEventListener("pointerdown", (e) => {
        if (this.pinned && !this.card.contains(e.target) && !this.pinned.contains(e.target)) this.unpin();
      });
      this.clear(opts.empty);
    }

    toggle(c) {
      if (!c || this.pinned === c) { this.unpin(); return; }
      this.unpin();
      this.show(c);
      this.pinned = c;
      c.setAttribute("aria-expanded", "true");
      this.card.classList.add("fd-pinned");
    }

    unpin() {
      if (this.pinned) this.pinned.setAttribute("aria-expanded", "false");
      this.pinned = null;
      this.card.classList.remove("fd-pinned");
      this.hide();
    }

    clear(message) {
      this.head = null;
      this.cells = new Map();
      this.blocks = new Map();
      this.grid.replaceChildren();
      this.empty.hidden = false;
      if (message) this.empty.textContent = message;
      this.unpin();
      this.applied = 0;
      this.setStatus("idle", "");
      this.stats.replaceChildren();
      this.statKey = null;
    }

    reset(head) {
      this.clear();
      const cfg = head.config || {};
      this.head = head;
      this.bs = Math.max(1, cfg.block_size | 0);
      this.sbs = Math.max(1, cfg.sub_block_size | 0);
      this.plen = Math.max(0, head.prompt_len | 0);
      this.maxNew = Math.max(1, cfg.max_new_tokens | 0);
      this.mode = cfg.mode === "ar" ? "ar" : "diffusion";
      this.nfe = 0; this.steps = 0; this.commits = 0; this.tokens = 0; this.t = 0; this.stopSeen = false;
      this.stops = new Set((cfg.stop_token_ids || []).map(Number));
      this.block = -1; this.sub = -1; this.activeEl = null; this.fresh = [];
      this.done = null;
      this.empty.hidden = true;
      this.root.classList.toggle("fd-ar", this.mode === "ar");
      this.root.classList.remove("fd-is-stopped", "fd-is-unfinished");
      // nothing arrives until the prompt's forward (prefill) ends: a long prompt takes a while on a CPU, so say so
      this.setStatus("running", `prefilling ${this.plen.toLocaleString("en-US")} prompt tokens… (the first forward reads the whole prompt)`, "prefill");
      this.renderStats();
    }

    runningText() {
      return this.mode === "ar" ? "AR baseline · one token per forward" : "block diffusion";
    }

    advancePrefix() {
      // the tokens stat is the answer so far: the contiguous committed prefix through the first stop token, as the
      // engine's summary counts it, so it never goes down when the run ends (or is stopped) with gaps still masked
      while (!this.stopSeen) {
        const c = this.cells.get(this.tokens);
        if (!c || !c.committed) break;
        this.tokens += 1;
        if (this.stops.has(Number(c.id))) this.stopSeen = true;
      }
    }

    setStatus(state, text, badge) {
      const b = el("span", `fd-badge fd-badge-${state}`, badge || state);
      if (badge) b.classList.add(`fd-badge-${badge}`);
      this.status.replaceChildren(b, el("span", "fd-status-t", text));
    }

    renderStats() {
      const items = [["NFE", String(this.nfe)], ["steps", String(this.steps)]];
      if (this.mode === "diffusion") {
        items.push(["block", this.block >= 0 ? String(this.block + 1) : "–"]);
        items.push(["sub-block", this.sub >= 0 ? `${this.sub + 1}/${Math.round(this.bs / this.sbs)}` : "–"]);
      }
      items.push(["tokens", `${this.tokens}/${this.maxNew}`]);
      items.push(["tok/forward", fmt(this.tokens / Math.max(1, this.nfe))]);
      items.push(["engine", `${fmt(this.t, 2)} s`]);
      const key = items.map(([k]) => k).join("|");
      if (this.statKey !== key) {  // build the stat spans once per layout; later only their numbers change
        this.statKey = key;
        this.statEls = items.map(([k]) => {
          const s = el("span", "fd-stat");
          s.title = STAT_HELP[k] || "";
          const b = el("b");
          s.append(el("span", null, k), b);
          return b;
        });
        this.stats.replaceChildren(...this.statEls.map((b) => b.parentNode));
      }
      items.forEach(([, v], i) => { if (this.statEls[i].textContent !== v) this.statEls[i].textContent = v; });
    }

    ensureBlock(b) {
      if (this.blocks.has(b)) return this.blocks.get(b);
      // only blocks that hold answer positions get a row (also bounds the DOM for hostile traces)
      if (b < 0 || (b + 1) * this.bs <= this.plen || b * this.bs >= this.plen + this.maxNew) return undefined;
      const row = el("div", "fd-block");
      const label = el("div", "fd-block-label", `block ${b + 1}`);
      const body = el("div", "fd-block-body");
      row.append(label, body);
      const subs = [];
      const nSub = Math.max(1, Math.round(this.bs / this.sbs));
      for (let k = 0; k < nSub; k++) {
        const g = el("div", "fd-sub");
        g.dataset.sub = String(k);
        subs.push(g);
        body.append(g);
      }
      for (let col = 0; col < this.bs; col++) {
        const abs = b * this.bs + col;
        const pos = abs - this.plen;
        const cell = el("span", "fd-cell");
        const tok = el("span", "fd-tok");
        cell.append(tok);
        if (pos < 0) {
          cell.classList.add("fd-prompt");
          tok.textContent = "·";
          cell.title = "prompt";
        } else if (pos >= this.maxNew) {
          cell.classList.add("fd-beyond");
        } else {
          cell.classList.add("fd-masked");
          tok.textContent = "▒▒";
          cell.dataset.pos = String(pos);
          cell.tabIndex = 0;
          cell.setAttribute("role", "button");
          cell.setAttribute("aria-expanded", "false");
          cell.setAttribute("aria-label", `answer token ${pos + 1}: masked`);
          const bar = el("span", "fd-bar");
          cell.append(bar);
          this.cells.set(pos, { el: cell, tok, bar, pos, block: b, col, committed: false, cands: new Map(), best: null });
        }
        subs[Math.min(nSub - 1, Math.floor(col / this.sbs))].append(cell);
      }
      // blocks arrive in order in a live run; insert in order anyway (replay seeks rebuild from scratch)
      let before = null;
      for (const [k, r] of this.blocks) if (k > b && (!before || k < before[0])) before = [k, r];
      const g = this.grid;
      const follow = g.scrollHeight - g.scrollTop - g.clientHeight < 48;  // keep following the newest block
      g.insertBefore(row, before ? before[1].row : null);
      if (follow && !before) g.scrollTop = g.scrollHeight;
      const rec = { row, subs };
      this.blocks.set(b, rec);
      return rec;
    }

    setActive(block, sub) {
      if (this.activeEl) this.activeEl.classList.remove("fd-active");
      this.activeEl = null;
      const rec = this.blocks.get(block);
      if (rec && sub >= 0 && rec.subs[sub]) {
        this.activeEl = rec.subs[sub];
        this.activeEl.classList.add("fd-active");
      }
      for (const [k, r] of this.blocks) r.row.classList.toggle("fd-current", k === block && !this.done);
    }

    apply(ev) {
      if (!this.head) return;
      this.applied += 1;
      if (ev.kind === "done") { this.t = ev.t; this.finish(null); return; }
      if (this.nfe === 0 && !this.done) this.setStatus("running", this.runningText());
      this.nfe = ev.nfe; this.t = ev.t;
      if (ev.kind === "commit") this.commits += 1; else this.steps += 1;
      for (const c of this.fresh) c.classList.remove("fd-fresh");
      this.fresh = [];
      const blockOf = (pos) => Math.floor((this.plen + pos) / this.bs);
      if (this.mode === "diffusion") this.ensureBlock(ev.block);
      for (const [pos] of ev.masked) this.ensureBlock(blockOf(pos));
      for (const [pos] of ev.committed) this.ensureBlock(blockOf(pos));
      const group = this.steps + this.commits;
      const hue = GROUP_HUES[group % GROUP_HUES.length];
      for (const [pos, id, text, conf] of ev.masked) {
        const c = this.cells.get(pos);
        if (!c || c.committed) continue;
        const prev = c.cands.get(id);
        if (prev) { prev.conf = Math.max(prev.conf, conf); prev.last = ev.nfe; prev.n += 1; }
        else c.cands.set(id, { id, text, conf, first: ev.nfe, last: ev.nfe, n: 1 });
        c.best = { id, text, conf };
        c.el.setAttribute("aria-label", `answer token ${pos + 1}: masked, best guess ${visible(text)} (${fmt(conf)})`);
        c.bar.style.width = `${Math.round(conf * 100)}%`;
        c.bar.style.background = confColour(conf, 0.9);
      }
      for (const [pos, id, text, conf] of ev.committed) {
        const c = this.cells.get(pos);
        if (!c || c.committed) continue;
        Object.assign(c, { committed: true, id, text, conf, nfe: ev.nfe, t: ev.t, group, size: ev.committed.length, kind: ev.kind });
        const e = c.el;
        e.classList.remove("fd-masked");
        e.classList.add("fd-done", "fd-fresh");
        c.tok.textContent = visible(text);
        e.setAttribute("aria-label", `answer token ${pos + 1}: ${visible(text)}, confidence ${fmt(conf)}, committed at forward ${ev.nfe}`);
        c.bar.remove();
        e.style.background = confColour(conf, 0.32);
        e.style.setProperty("--fd-group", `hsl(${hue}, 70%, 55%)`);
        e.dataset.group = String(group);
        const badge = el("span", "fd-step", String(ev.nfe));
        e.append(badge);
        this.fresh.push(e);
      }
      this.advancePrefix();
      this.block = ev.block;
      this.sub = ev.sub_block;
      this.setActive(this.mode === "diffusion" ? ev.block : -1, ev.sub_block);
      if (this.pinned) this.show(this.pinned);
      this.renderStats();
    }

    finish(summary) {
      // the answer ends at the stop token: tokens committed after it (same step or later) are discarded
      const stops = new Set(((this.head && this.head.config && this.head.config.stop_token_ids) || []).map(Number));
      let cut = summary && Number.isFinite(summary.answer_tokens) ? summary.answer_tokens : Infinity;
      if (!summary) for (const c of this.cells.values()) if (c.committed && stops.has(c.id)) cut = Math.min(cut, c.pos + 1);
      let kept = 0;
      for (const c of this.cells.values()) {
        if (!c.committed) {  // never decoded: the answer ended (or was stopped) first
          c.el.classList.remove("fd-masked");
          c.el.classList.add("fd-unused");
          c.tok.textContent = "";
          continue;
        }
        const gone = c.pos >= cut;
        c.el.classList.toggle("fd-discarded", gone);
        c.el.title = gone ? "committed after the stop token: not part of the answer" : "";
        if (!gone) kept += 1;
      }
      this.tokens = kept;
      if (summary) {
        this.done = summary;
        const stopped = summary.stop_reason === "cancelled";
        // the server judges the answer (engine/finish.py); a trace file's summary has no verdict: plain "done"
        const fin = summary.finish && typeof summary.finish === "object" ? summary.finish : null;
        const unfinished = !stopped && fin !== null && fin.complete === false;
        this.root.classList.toggle("fd-is-stopped", stopped);
        this.root.classList.toggle("fd-is-unfinished", unfinished);
        const label = stopped ? "stopped" : unfinished ? (fin.label === "looping" ? "looping" : "unfinished") : "done";
        const speed = `${fmt(summary.tokens_per_second, 1)} tok/s engine · ${summary.nfe} forwards · ${fmt(summary.tokens_per_forward)} tokens/forward`;
        this.setStatus(label, stopped ? `Stop pressed: the answer was cut off · ${speed}` :
          unfinished ? `did not finish: ${String(fin.why || fin.label)} · ${speed} (not a speed-up)` :
          `${String(summary.stop_reason).replace(/_/g, " ")} · ${speed}`);
      } else if (!this.done) {
        this.done = { stop_reason: "done" };
        this.setStatus("done", "finished");
      }
      this.setActive(-1, -1);
      this.renderStats();
    }

    /* hover / click card: token, confidence, commit step, candidates seen while masked */
    show(cellEl) {
      for (const x of this.grid.querySelectorAll(".fd-same")) x.classList.remove("fd-same");
      const c = this.cells.get(Number(cellEl.dataset.pos));
      if (!c) { this.hide(); return; }
      const card = this.card;
      card.replaceChildren();
      const title = el("div", "fd-pop-title");
      if (c.committed) {
        title.append(el("span", "fd-pop-tok", visible(c.text)), el("span", "fd-pop-id", `id ${c.id}`));
        card.append(title);
        card.append(el("div", null, `confidence ${fmt(c.conf, 3)}`));
        card.append(el("div", null, `committed at forward ${c.nfe}${c.kind === "commit" ? " (block commit)" : ""} · ${fmt(c.t, 3)} s` +
          (c.size > 1 ? ` · with ${c.size - 1} other token${c.size > 2 ? "s" : ""}` : "")));
        for (const x of this.grid.querySelectorAll(`[data-group="${c.group}"]`)) x.classList.add("fd-same");
      } else {
        title.append(el("span", "fd-pop-tok", "▒▒ masked"));
        card.append(title);
        if (c.best) card.append(el("div", null, `best guess so far: ${visible(c.best.text)} (${fmt(c.best.conf, 3)})`));
      }
      card.append(el("div", "fd-pop-dim", `answer token ${c.pos + 1} · sequence position ${this.plen + c.pos + 1} · block ${c.block + 1}, ` +
        `sub-block ${Math.floor(c.col / this.sbs) + 1}, column ${c.col + 1}`));
      const cands = [...c.cands.values()].sort((a, b) => b.conf - a.conf).slice(0, 8);
      if (cands.length) {
        card.append(el("div", "fd-pop-sub", "candidates seen while masked (best confidence · forwards)"));
        const list = el("div", "fd-pop-cands");
        for (const k of cands) {
          const row = el("div", "fd-pop-cand");
          const sw = el("span", "fd-pop-sw");
          sw.style.background = confColour(k.conf, 0.85);
          row.append(sw, el("span", "fd-pop-tok", visible(k.text)),
            el("span", "fd-pop-dim", `${fmt(k.conf, 3)} · ${k.first === k.last ? k.first : `${k.first}–${k.last}`}`));
          list.append(row);
        }
        card.append(list);
      } else if (c.committed) {
        card.append(el("div", "fd-pop-dim", "no earlier candidates (committed at its first forward)"));
      }
      card.hidden = false;
      const r = this.root.getBoundingClientRect();
      const b = cellEl.getBoundingClientRect();
      let x = b.left - r.left;
      const maxX = Math.max(0, this.root.clientWidth - 320);
      card.style.left = `${Math.min(x, maxX)}px`;
      card.style.top = `${b.bottom - r.top + 6}px`;
    }

    hide() {
      this.card.hidden = true;
      this.card.classList.remove("fd-pinned");
      for (const x of this.grid.querySelectorAll(".fd-same")) x.classList.remove("fd-same");
    }
  }

  /* ------------------------------------------------------------------ live view: frames of new events */
  class Live {
    constructor(root, server, emptyText) {
      this.r = new Renderer(root, { empty: emptyText });
      this.server = server;
      this.emptyText = emptyText;
      this.run = null;
      this.lastFrame = null;
      this.fetching = false;
    }

    feed(value) {
      // frames are applied strictly in order, even while one waits for a missed-events fetch
      this.chain = (this.chain || Promise.resolve()).then(() => this._feed(value)).catch((e) => console.warn("fd-live", e));
      return this.chain;
    }

    async _feed(value) {
      if (!value) return;
      let d;
      try { d = JSON.parse(value); } catch (e) { return; }
      if (!d || typeof d !== "object") return;
      if (d.clear) { this.run = null; this.r.clear(d.msg || this.emptyText); return; }
      if (d.head && d.run !== this.run) { this.run = d.run; this.r.reset(d.head); }
      if (d.run !== this.run) return;
      const seq = d.seq | 0;
      if (seq > this.r.applied && this.server && this.server.live_events) {
        // a frame was missed (frames coalesced in transit): fetch the gap from the server's copy
        const have = this.r.applied;
        try {
          const gap = await this.server.live_events({ run: this.run, start: have, end: seq });
          if (d.run === this.run && this.r.applied === have && Array.isArray(gap)) for (const ev of gap) this.r.apply(ev);
        } catch (e) { console.warn("fd-live: could not fetch missed events", e); }
      }
      const skip = Math.max(0, this.r.applied - seq);
      for (const ev of (d.ev || []).slice(skip)) this.r.apply(ev);
      if (d.sum) this.r.finish(d.sum);
    }
  }

  /* ------------------------------------------------------------------ replay player */
  class Player {
    constructor(root) {
      root.replaceChildren();
      root.classList.add("fd-player");
      const bar = el("div", "fd-controls");
      const btn = (label, title, fn) => {  // glyphs on screen; their words for screen readers
        const b = el("button", "fd-btn", label); b.type = "button"; b.title = title; b.setAttribute("aria-label", title);
        b.addEventListener("click", fn); bar.append(b); return b;
      };
      btn("⇤", "to the start", () => { this.pause(); this.seek(0); });
      btn("◀", "step back one forward", () => { this.pause(); this.seek(this.i - 1); });
      this.playBtn = btn("▶", "play / pause", () => (this.playing ? this.pause() : this.play()));
      this.playBtn.classList.add("fd-play");
      btn("▶|", "step forward one forward", () => { this.pause(); this.seek(this.i + 1); });
      btn("⇥", "to the end", () => { this.pause(); this.seek(this.events.length); });
      const sp = el("label", "fd-speed", "speed ");
      this.speedSel = el("select", "fd-speed-sel");
      for (const s of SPEEDS) { const o = el("option", null, `${s}×`); o.value = String(s); if (s === 1) o.selected = true; this.speedSel.append(o); }
      this.speedSel.setAttribute("aria-label", "replay speed");
      sp.append(this.speedSel);
      bar.append(sp);
      this.scrub = el("input", "fd-scrub");
      Object.assign(this.scrub, { type: "range", min: "0", max: "0", step: "1", value: "0" });
      this.scrub.title = "scrub through the forwards";
      this.scrub.setAttribute("aria-label", "replay position (forwards)");
      this.scrub.addEventListener("input", () => {  // drags fire many inputs: seek once per frame
        this.want = Number(this.scrub.value);
        this.pause(false);  // leave the thumb where the user drags it
        if (!this.seekRaf) this.seekRaf = requestAnimationFrame(() => { this.seekRaf = null; this.seek(this.want); });
      });
      this.pos = el("span", "fd-pos", "");
      bar.append(this.scrub, this.pos);
      const view = el("div", "fd-player-view");
      root.append(bar, view);
      this.r = new Renderer(view, { empty: "No trace loaded: answer a message in the chat, pick an answer above, or upload a trace JSON." });
      this.events = [];
      this.i = 0;
      this.playing = false;
      this.trace = null;
      this.note = el("div", "fd-pop-dim fd-player-note", "1× = the recorded engine speed; 0.1× plays ten times slower, every pause included");
      root.append(this.note);
    }

    load(value) {
      this.pause();
      let t = null;
      if (value) { try { t = JSON.parse(value); } catch (e) { t = null; } }
      if (!t || !t.header || !Array.isArray(t.events)) { this.trace = null; this.events = []; this.r.clear(); this.sync(); return; }
      this.trace = t;
      this.events = t.events;
      this.scrub.max = String(this.events.length);
      this.r.reset(t.header);  // a new trace starts at the beginning: never the previous one's position
      this.i = 0;
      this.seek(0);
      this.r.setStatus("ready", `${this.events.length} events · press ▶ to replay, or step with ▶|`);
    }

    seek(k) {
      if (!this.trace) return;
      k = Math.max(0, Math.min(this.events.length, k | 0));
      if (k < this.i || !this.r.head) { this.r.reset(this.trace.header); this.i = 0; }
      while (this.i < k) this.r.apply(this.events[this.i++]);
      if (this.i === this.events.length && this.trace.summary) this.r.finish(this.trace.summary);
      else if (this.i < this.events.length) this.r.setStatus(this.playing ? "playing" : "paused", "replay");
      this.sync();
    }

    sync() {
      this.scrub.value = String(this.i);
      const n = this.events.length;
      const ev = this.events[this.i - 1];
      this.pos.textContent = n ? `${this.i}/${n} events · ${ev ? fmt(ev.t, 3) : "0.000"} s` : "";
      this.playBtn.textContent = this.playing ? "❚❚" : "▶";
      this.playBtn.setAttribute("aria-label", this.playing ? "pause" : "play");
      this.playBtn.setAttribute("aria-pressed", String(this.playing));
    }

    play() {
      if (!this.trace || !this.events.length) return;
      if (this.i >= this.events.length) this.seek(0);
      this.playing = true;
      this.clock = this.i > 0 ? this.events[this.i - 1].t : 0;
      this.last = performance.now();
      const tick = (now) => {
        if (!this.playing) return;
        const speed = Number(this.speedSel.value) || 1;
        this.clock += ((now - this.last) / 1000) * speed;
        this.last = now;
        let k = this.i;
        while (k < this.events.length && this.events[k].t <= this.clock) k++;  // real time × speed, no skipping
        if (k !== this.i) this.seek(k);
        if (this.i >= this.events.length) { this.pause(); return; }
        this.raf = requestAnimationFrame(tick);
      };
      this.sync();
      this.r.setStatus("playing", "replay");
      this.raf = requestAnimationFrame(tick);
    }

    pause(sync = true) {
      this.playing = false;
      if (this.raf) cancelAnimationFrame(this.raf);
      this.raf = null;
      if (this.trace && this.i < this.events.length) this.r.setStatus("paused", "replay");
      if (sync) this.sync();
    }
  }

  /* ------------------------------------------------------------------ plots in tabs
   * A plotly figure drawn inside a hidden tab gets plotly's default width (~700 px) and keeps it until the window
   * resizes. When a plot's box changes size (its tab is shown, a new figure arrives), tell plotly to refit. */
  const fitPlots = () => window.dispatchEvent(new Event("resize"));
  let fitTimer = null;
  const plotBoxes = new ResizeObserver(() => { clearTimeout(fitTimer); fitTimer = setTimeout(fitPlots, 60); });
  const watchPlots = () => {
    for (const box of document.querySelectorAll("#fd-heatmap, #fd-sweep-plot, .js-plotly-plot")) {
      if (!box.dataset.fdWatched) { box.dataset.fdWatched = "1"; plotBoxes.observe(box); }
    }
  };
  new MutationObserver(watchPlots).observe(document.documentElement, { childList: true, subtree: true });
  document.addEventListener("click", (e) => {
    if (e.target.closest && e.target.closest("[role=tab]")) for (const ms of [50, 300]) setTimeout(fitPlots, ms);
  });

  /* ------------------------------------------------------------------ page chores Gradio leaves to us
   * - chat messages: Gradio names each bubble "<role>'s message: " + its markdown source, which is HTML-escaped for
   *   display (app/render.py escape_chat), so a screen reader read "&amp;lt;"; name it by the text as shown instead.
   * - preset buttons: aria-pressed follows the preset the note says is active (data-preset).
   * - the message box: focused on load without scrolling, where a keyboard is likely (not on phones). */
  const ARIA_MSG = /^(.*?'s message: )/s;
  const fixChatLabels = () => {
    for (const m of document.querySelectorAll("#fd-chat [aria-label]")) {
      const label = m.getAttribute("aria-label"), hit = ARIA_MSG.exec(label || "");
      if (!hit) continue;
      const want = hit[1] + (m.innerText || m.textContent || "").replace(/\s+/g, " ").trim();
      if (label !== want) m.setAttribute("aria-label", want);
    }
  };
  const fixPresets = () => {
    const note = document.querySelector("#fd-presets .fd-presets");
    const on = note ? note.dataset.preset || "" : "";
    for (const b of document.querySelectorAll(".fd-preset-btn")) {
      const id = (b.id || "").replace(/^fd-preset-/, "");
      const want = String(id === on);
      if (b.getAttribute("aria-pressed") !== want) b.setAttribute("aria-pressed", want);
    }
  };
  let choresQueued = false;
  const chores = () => {
    if (choresQueued) return;
    choresQueued = true;
    requestAnimationFrame(() => { choresQueued = false; fixChatLabels(); fixPresets(); });
  };
  new MutationObserver(chores).observe(document.documentElement,
    { childList: true, subtree: true, characterData: true, attributes: true, attributeFilter: ["aria-label", "data-preset"] });
  const focusBox = (tries = 0) => {
    const box = document.querySelector("#fd-msg textarea");
    if (!box) { if (tries < 100) setTimeout(() => focusBox(tries + 1), 100); return; }
    const keyboard = window.matchMedia("(pointer: fine)").matches && window.innerWidth > 720;
    if (keyboard && document.activeElement === document.body) box.focus({ preventScroll: true });
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", () => focusBox());
  else focusBox();

  window.FDStudio = { Renderer, Live, Player, confColour, visible, fitPlots };
})();
