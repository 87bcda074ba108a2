/* slotserve live view: the running batch (slot strip), queue and KV memory, latency, and a
 * replay of two runs side by side (static vs continuous batching, or any two traces: a real
 * run's and its simulated replay). Plain JS, no dependencies, no build step.
 *
 * Data: /debug/events (server-sent events: hello, iterations, stats), /debug/simulate (the
 * simulator's traces), /debug/trace (the engine's recorded trace). Trace format: see
 * slotserve/lab/simulate.py. Everything kept here is bounded (MAX_COLUMNS iterations,
 * MAX_SAMPLES stats samples, ColorMap's limit), so a page left open for hours stays light.
 */
"use strict";

const MAX_COLUMNS = 600; // live iterations kept; the strip shows the newest that fit
const MAX_SAMPLES = 600; // stats samples kept (one a second: 10 minutes)
const LIVE_CELL_W = 8; // px per iteration in the live strip
const PLAY_MS = 550; // replay speed

// Strong colors, no greys (grey means idle): the same palette as slotserve.lab.timeline.
const PALETTE = [
  "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
  "#e377c2", "#bcbd22", "#17becf", "#393b79", "#e7ba52", "#637939",
];
const IDLE = "#e6e6e6";
const STALLED = "#3d4350";
const PREEMPT = "#d92d20";
const UTIL = "#475467";
const GHOST = "#f3f4f6";
const CACHED_FREE = "#b7dfc5"; // a free block that still holds a cached prefix (hittable)
const SHARED_MARK = "#101828"; // the dot on a block held by more than one request
const DRAFT_ACCEPTED = "#ffffff"; // speculative decoding: a draft token the model accepted
const DRAFT_REJECTED = "#101828"; // ... and one it rejected (band at the foot of the cell)

const $ = (selector, root = document) => root.querySelector(selector);

// ------------------------------------------------------------------------ colors
/** A stable color per request id: the palette in first-seen order, then golden-angle hues.
 * Bounded: past `limit` ids, the oldest-seen is forgotten. */
class ColorMap {
  constructor(limit = 4096) {
    this.map = new Map();
    this.next = 0;
    this.limit = limit;
  }

  get(id) {
    let color = this.map.get(id);
    if (color === undefined) {
      if (this.map.size >= this.limit) this.map.delete(this.map.keys().next().value);
      color = colorOf(this.next++);
      this.map.set(id, color);
    }
    return color;
  }
}

function colorOf(k) {
  if (k < PALETTE.length) return PALETTE[k];
  return `hsl(${Math.round((k * 137.508) % 360)}, 62%, 46%)`;
}

const hatches = new Map(); // color -> CanvasPattern (prefill cells)

function hatch(ctx, color) {
  let pattern = hatches.get(color);
  if (pattern === undefined) {
    if (hatches.size > 512) hatches.clear();
    const tile = document.createElement("canvas");
    tile.width = tile.height = 6;
    const t = tile.getContext("2d");
    t.fillStyle = "#ffffff";
    t.fillRect(0, 0, 6, 6);
    t.globalAlpha = 0.45;
    t.fillStyle = color;
    t.fillRect(0, 0, 6, 6);
    t.globalAlpha = 1;
    t.strokeStyle = color;
    t.lineWidth = 1.6;
    t.beginPath();
    t.moveTo(-1, 7); t.lineTo(7, -1);
    t.moveTo(-1, 1); t.lineTo(1, -1);
    t.moveTo(5, 7); t.lineTo(7, 5);
    t.stroke();
    pattern = ctx.createPattern(tile, "repeat");
    hatches.set(color, pattern);
  }
  return pattern;
}

// ------------------------------------------------------------------------ helpers
/** Size a canvas to its CSS width (and the given CSS height) at the device pixel ratio. */
function sizeCanvas(canvas, height) {
  const ratio = window.devicePixelRatio || 1;
  const width = Math.max(1, canvas.clientWidth);
  canvas.style.height = `${height}px`;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

const clamp = (x, lo, hi) => Math.max(lo, Math.min(hi, x));
const isBusy = (cell) => cell !== null && cell !== undefined && cell.kind !== "stalled";
const busyCount = (column) => column.slots.reduce((n, cell) => n + (isBusy(cell) ? 1 : 0), 0);
const pct = (x) => `${Math.round(x * 100)}%`;

function fmtSeconds(v) {
  if (v === null || v === undefined) return "—";
  if (v < 0.001) return `${Math.round(v * 1e6)} µs`;
  if (v < 1) return `${(v * 1000).toFixed(v < 0.1 ? 1 : 0)} ms`;
  return `${v.toFixed(2)} s`;
}

function fmtRate(v) {
  if (v === null || v === undefined) return "—";
  return v >= 100 ? v.toFixed(0) : v.toFixed(1);
}

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

async function fetchJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && ((body.error && body.error.message) || body.detail);
    throw new Error(message || `${url}: HTTP ${response.status}`);
  }
  return body;
}

// ------------------------------------------------------------------------ the slot strip
/** Draw a slot strip: a row per slot, a column per iteration record.
 *
 * view: {columns, numSlots, cellW, rowH, colors, revealed (columns drawn; the rest are
 * outlines: replay), cursor (column to outline), labels (ids in wide cells)}.
 * Stores the geometry on the canvas for the tooltip. */
function drawStrip(canvas, view) {
  const { columns, numSlots, cellW, rowH } = view;
  const gutter = rowH >= 11 ? 48 : 0;
  const top = 9;
  const axis = 16;
  const { ctx } = sizeCanvas(canvas, top + numSlots * rowH + axis);
  const x0 = gutter;
  const revealed = view.revealed ?? columns.length;
  const gapX = cellW >= 6 ? 1 : 0;
  const gapY = rowH >= 6 ? 1 : 0;
  drawSlotLabels(ctx, numSlots, rowH, top, gutter);
  columns.forEach((column, j) => {
    const x = columnX(x0, cellW, j);
    const w = columnX(x0, cellW, j + 1) - x - gapX;
    if (j >= revealed) {
      drawGhostColumn(ctx, x, top, numSlots, w, rowH, gapY);
      return;
    }
    column.slots.forEach((cell, s) => drawCell(ctx, cell, view, x, top + s * rowH, w, rowH - gapY));
    drawMarks(ctx, column, x, w, top, numSlots * rowH);
  });
  if (view.cursor !== undefined && view.cursor >= 0 && view.cursor < columns.length) {
    const x = columnX(x0, cellW, view.cursor);
    ctx.strokeStyle = "#101828";
    ctx.lineWidth = 1.5;
    ctx.strokeRect(x - 1, top - 1, columnX(x0, cellW, view.cursor + 1) - x + 1 - gapX,
                   numSlots * rowH + 1);
  }
  drawAxis(ctx, columns, x0, cellW, top + numSlots * rowH, revealed);
  canvas.geometry = { x0, top, cellW, rowH, columns, numSlots, revealed };
}

/** Left edge of column j: whole pixels, so fractional cell widths leave no seams. */
const columnX = (x0, cellW, j) => Math.round(x0 + j * cellW);

function drawSlotLabels(ctx, numSlots, rowH, top, gutter) {
  if (!gutter) return;
  ctx.fillStyle = "#667085";
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  ctx.textAlign = "left";
  for (let s = 0; s < numSlots; s++) ctx.fillText(`slot ${s}`, 2, top + s * rowH + rowH / 2);
}

function drawCell(ctx, cell, view, x, y, w, h) {
  if (cell === null || cell === undefined) {
    ctx.fillStyle = IDLE;
    ctx.fillRect(x, y, w, h);
    return;
  }
  const color = view.colors.get(cell.request);
  if (cell.kind === "prefill") {
    ctx.fillStyle = hatch(ctx, color);
    ctx.fillRect(x, y, w, h);
  } else if (cell.kind === "stalled") {
    ctx.fillStyle = STALLED;
    ctx.fillRect(x, y, w, h);
    drawCross(ctx, color, x, y, w, h);
  } else {
    ctx.fillStyle = color;
    ctx.fillRect(x, y, w, h);
    if (cell.proposed > 0) drawDrafts(ctx, cell, x, y, w, h);
  }
  if (view.labels && w >= 24 && h >= 14) drawLabel(ctx, cell, x, y, w, h);
}

/** A decode verified with draft tokens: a band at the foot of its cell, one segment per
 * draft, accepted ones (the first `accepted`) light, rejected ones dark. */
function drawDrafts(ctx, cell, x, y, w, h) {
  if (h < 3) return;
  const band = Math.max(2, Math.round(h * 0.4));
  const accepted = Math.min(cell.accepted || 0, cell.proposed);
  const split = Math.round((w * accepted) / cell.proposed);
  ctx.fillStyle = DRAFT_ACCEPTED;
  ctx.fillRect(x, y + h - band, split, band);
  ctx.fillStyle = DRAFT_REJECTED;
  ctx.fillRect(x + split, y + h - band, w - split, band);
}

function drawCross(ctx, color, x, y, w, h) {
  if (w < 5 || h < 5) return;
  const inset = Math.min(w, h) * 0.22;
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  ctx.moveTo(x + inset, y + inset); ctx.lineTo(x + w - inset, y + h - inset);
  ctx.moveTo(x + w - inset, y + inset); ctx.lineTo(x + inset, y + h - inset);
  ctx.stroke();
}

function drawLabel(ctx, cell, x, y, w, h) {
  let text = String(cell.request);
  ctx.font = "600 11px system-ui, sans-serif";
  while (text.length > 1 && ctx.measureText(text).width > w - 4) text = text.slice(0, -1);
  ctx.fillStyle = cell.kind === "decode" || cell.kind === "stalled" ? "#ffffff" : "#101828";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  ctx.fillText(text, x + w / 2, y + h / 2 + 0.5);
}

function drawGhostColumn(ctx, x, top, numSlots, w, rowH, gapY) {
  ctx.fillStyle = GHOST;
  for (let s = 0; s < numSlots; s++) ctx.fillRect(x, top + s * rowH, w, rowH - gapY);
}

/** Preemptions (a red tick above the column) and gaps in the data (a dotted line). */
function drawMarks(ctx, column, x, cellW, top, height) {
  if (column.preempted && column.preempted.length) {
    ctx.fillStyle = PREEMPT;
    ctx.beginPath();
    ctx.moveTo(x + cellW / 2 - 4, 0); ctx.lineTo(x + cellW / 2 + 4, 0); ctx.lineTo(x + cellW / 2, top - 2);
    ctx.fill();
  }
  if (column.gapBefore) {
    ctx.strokeStyle = "#98a2b3";
    ctx.setLineDash([2, 2]);
    ctx.beginPath();
    ctx.moveTo(x - 0.5, top); ctx.lineTo(x - 0.5, top + height);
    ctx.stroke();
    ctx.setLineDash([]);
  }
}

/** Iteration numbers under the strip, every k columns (k keeps labels >= 40 px apart). */
function drawAxis(ctx, columns, x0, cellW, y, revealed) {
  const steps = [1, 2, 5, 10, 20, 25, 50, 100, 200, 500, 1000];
  const every = steps.find((k) => k * cellW >= 40) || 1000;
  ctx.font = "10.5px system-ui, sans-serif";
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  columns.forEach((column, j) => {
    if (column.index % every !== 0) return;
    ctx.fillStyle = j < revealed ? "#667085" : "#c0c5ce";
    ctx.fillText(String(column.index), columnX(x0, cellW, j) + cellW / 2, y + 3);
  });
}

/** Busy slots / slots per column, aligned with the strip above. */
function drawUtil(canvas, geometry) {
  const height = 46;
  const { ctx, width } = sizeCanvas(canvas, height);
  if (!geometry) return;
  const { x0, cellW, columns, numSlots } = geometry;
  const base = height - 4;
  const scale = height - 10;
  ctx.strokeStyle = "#d0d5dd";
  ctx.setLineDash([3, 3]);
  ctx.beginPath();
  ctx.moveTo(x0, base - scale); ctx.lineTo(width, base - scale);
  ctx.moveTo(x0, base); ctx.lineTo(width, base);
  ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = "#98a2b3";
  ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  if (x0 >= 40) {
    ctx.fillText("100%", 4, base - scale);
    ctx.fillText("0%", 4, base);
  }
  ctx.fillStyle = "rgba(71, 84, 103, 0.35)";
  ctx.strokeStyle = UTIL;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  columns.forEach((column, j) => {
    const y = base - (busyCount(column) / numSlots) * scale;
    const x = columnX(x0, cellW, j);
    const next = columnX(x0, cellW, j + 1);
    ctx.fillRect(x, y, next - x, base - y);
    if (j === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    ctx.lineTo(next, y);
  });
  ctx.stroke();
}

// ------------------------------------------------------------------------ tooltip
function attachTooltip(canvas) {
  const tip = $("#tooltip");
  canvas.addEventListener("mousemove", (event) => {
    const text = cellAt(canvas, event);
    if (!text) { tip.hidden = true; return; }
    tip.textContent = text;
    tip.style.left = `${event.clientX + 12}px`;
    tip.style.top = `${event.clientY + 12}px`;
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
}

function cellAt(canvas, event) {
  const g = canvas.geometry;
  if (!g) return null;
  const rect = canvas.getBoundingClientRect();
  const j = Math.floor((event.clientX - rect.left - g.x0) / g.cellW);
  const s = Math.floor((event.clientY - rect.top - g.top) / g.rowH);
  if (j < 0 || j >= g.revealed || s < 0 || s >= g.numSlots) return null;
  const column = g.columns[j];
  const cell = column.slots[s];
  const where = `iteration ${column.index} · slot ${s}`;
  if (!cell) return `${where}: idle`;
  const tokens = `${cell.tokens} token${cell.tokens === 1 ? "" : "s"}`;
  const drafts = cell.proposed > 0
    ? `: ${cell.proposed} draft${cell.proposed === 1 ? "" : "s"}, ${cell.accepted || 0} accepted` : "";
  return `${where}: ${cell.request} ${cell.kind} (${tokens}${drafts})`;
}

// ------------------------------------------------------------------------ live view
const live = {
  config: null,
  columns: [],
  lastIndex: -1,
  samples: [],
  stats: null,
  colors: new ColorMap(),
  tenantColors: new ColorMap(1024), // one color per tenant (the server bounds the tenants)
  paused: false,
  dirtyStrip: false,
  dirtyStats: false,
  legendKey: "",
  frame: 0,
  replicas: null, // a replica set's ingress: name -> its strip ({columns, lastIndex, numSlots, up, node})
};

function connect() {
  const source = new EventSource("/debug/events");
  source.addEventListener("open", () => setConnected(true));
  source.addEventListener("error", () => setConnected(false)); // it reconnects by itself
  source.addEventListener("hello", (e) => onHello(JSON.parse(e.data)));
  source.addEventListener("iterations", (e) => appendIterations(JSON.parse(e.data)));
  source.addEventListener("stats", (e) => onStats(JSON.parse(e.data)));
}

function setConnected(connected) {
  document.body.dataset.connected = String(connected);
  $("#conn-text").textContent = connected ? "live" : "reconnecting…";
}

function onHello(hello) {
  if (hello.replicas) {
    setReplicas(hello.replicas);
  } else if (hello.iteration < live.lastIndex + 1 ||
             (live.config && live.config.num_slots !== hello.num_slots)) { // restarted, resized
    live.columns = [];
    live.lastIndex = -1;
  }
  live.config = hello;
  showConfig(hello);
  appendIterations(hello.iterations || []);
  onStats(hello);
}

function showConfig(c) {
  const parts = [
    `model <b>${escapeHTML(c.model)}</b>`,
    `policy <b>${escapeHTML(c.policy)}</b>`,
    `scheduling <b>${escapeHTML(c.scheduling_policy ?? "fcfs")}</b>`,
    `<b>${escapeHTML(c.num_slots)}</b> slots`,
    `<b>${escapeHTML(c.kv_blocks_total)}</b> KV blocks × ${escapeHTML(c.block_size)} tokens`,
    `token budget <b>${escapeHTML(c.max_num_batched_tokens)}</b>`,
  ];
  $("#config").innerHTML = parts.join(" · ");
  $("#stat-slots").textContent = `of ${c.num_slots} slots`;
  $("#stat-kv-total").textContent = `of ${c.kv_blocks_total}`;
  const seconds = Math.round(c.window_s);
  $("#latency-hint").textContent = `Percentiles over the completions finished in the last ${seconds} s; ` +
    "solid p50, light p99. Charts keep the last 10 minutes.";
}

function escapeHTML(text) {
  const div = document.createElement("div");
  div.textContent = String(text);
  return div.innerHTML;
}

/** Append iteration records (in order; duplicates from a reconnect are skipped). */
function appendIterations(records) {
  if (live.replicas) {
    appendReplicaIterations(records);
    return;
  }
  for (const record of records) {
    if (record.index <= live.lastIndex) continue;
    if (live.lastIndex >= 0 && record.index > live.lastIndex + 1) record.gapBefore = true;
    live.columns.push(record);
    live.lastIndex = record.index;
  }
  if (live.columns.length > MAX_COLUMNS) live.columns.splice(0, live.columns.length - MAX_COLUMNS);
  live.dirtyStrip = true;
  scheduleRender();
}

function onStats(stats) {
  live.stats = stats;
  if (live.replicas && stats.replicas) showReplicaLabels(stats.replicas);
  const { blocks, ...sample } = stats; // the block map can be large: keep it only once
  live.samples.push(sample);
  if (live.samples.length > MAX_SAMPLES) live.samples.splice(0, live.samples.length - MAX_SAMPLES);
  live.dirtyStats = true;
  scheduleRender();
}

function scheduleRender() {
  if (!live.frame) live.frame = requestAnimationFrame(render);
}

function render() {
  live.frame = 0;
  if (!live.config) return;
  if (live.dirtyStrip && !live.paused) {
    live.dirtyStrip = false;
    drawLive();
  }
  if (live.dirtyStats) {
    live.dirtyStats = false;
    showStats(live.stats);
    showTenants(live.stats.tenants || []);
    drawBlockMap(live.stats);
    drawSparks();
  }
}

function drawLive() {
  if (live.replicas) {
    drawReplicaStrips();
    return;
  }
  const numSlots = live.config.num_slots;
  const canvas = $("#live-strip");
  const rowH = clamp(Math.floor(240 / numSlots), 3, 18);
  const gutter = rowH >= 11 ? 48 : 0;
  const fit = Math.max(1, Math.floor((canvas.clientWidth - gutter) / LIVE_CELL_W));
  const columns = live.columns.slice(-fit);
  drawStrip(canvas, { columns, numSlots, cellW: LIVE_CELL_W, rowH, colors: live.colors,
                      labels: false });
  drawUtil($("#live-util"), canvas.geometry);
  showUtilisation(columns, numSlots);
  showSpeculation(columns, numSlots);
  showLegend(columns);
}

/** Speculative decoding per slot over the iterations in view: draft tokens proposed and
 * accepted (hidden while no slot in view verified any). */
function showSpeculation(columns, numSlots) {
  const proposed = new Array(numSlots).fill(0);
  const accepted = new Array(numSlots).fill(0);
  for (const column of columns) {
    column.slots.forEach((cell, s) => {
      if (cell && cell.proposed > 0) {
        proposed[s] += cell.proposed;
        accepted[s] += Math.min(cell.accepted || 0, cell.proposed);
      }
    });
  }
  const total = proposed.reduce((a, b) => a + b, 0);
  const node = $("#live-spec");
  node.dataset.proposed = String(total);
  node.dataset.accepted = String(accepted.reduce((a, b) => a + b, 0));
  node.hidden = total === 0;
  $("#live-spec-key").hidden = total === 0;
  if (!total) { node.replaceChildren(); return; }
  node.replaceChildren(...proposed.flatMap((p, s) => p === 0 ? [] : [el("li", {
    "data-slot": String(s), "data-proposed": String(p), "data-accepted": String(accepted[s]),
  }, `slot ${s}: ${accepted[s]} of ${p} drafts accepted (${pct(accepted[s] / p)})`)]));
}

function showUtilisation(columns, numSlots) {
  const busy = columns.reduce((n, column) => n + busyCount(column), 0);
  const value = columns.length ? busy / (numSlots * columns.length) : 0;
  const node = $("#live-util-text");
  node.dataset.utilisation = value.toFixed(4);
  node.dataset.iterations = String(columns.length);
  const last = columns.length ? columns[columns.length - 1].index : "—";
  node.innerHTML = columns.length
    ? `utilisation <b>${pct(value)}</b> over the last ${columns.length} iterations · iteration ${escapeHTML(last)}`
    : "utilisation — (no iterations yet: send some requests)";
}

/** The requests in view, most recently seen first; the ones in the newest column bold
 * (columns from `newest` on: one newest column per replica strip). */
function showLegend(columns, newest = columns.length - 1) {
  const lastSeen = new Map();
  columns.forEach((column, j) => {
    for (const cell of column.slots) if (cell) lastSeen.set(cell.request, j);
  });
  const ids = [...lastSeen.keys()].sort((a, b) => lastSeen.get(b) - lastSeen.get(a));
  const key = ids.map((id) => `${id}:${lastSeen.get(id) >= newest}`).join("|");
  if (key === live.legendKey) return;
  live.legendKey = key;
  const legend = $("#live-legend");
  legend.dataset.count = String(ids.length);
  legend.replaceChildren(...ids.slice(0, 40).map((id) => legendItem(id, lastSeen.get(id) >= newest)));
  if (ids.length > 40) legend.append(el("li", { class: "more" }, `+${ids.length - 40} more`));
}

/** Each tenant (the most served first) with its color and share of the tokens served. */
function showTenants(tenants) {
  const list = $("#tenants");
  const total = tenants.reduce((n, t) => n + t.tokens_served, 0);
  list.dataset.count = String(tenants.length);
  list.replaceChildren(...tenants.map((t) => {
    const share = total ? t.tokens_served / total : 0;
    const item = el("li", { "data-tenant": t.name, "data-share": share.toFixed(4),
                            class: t.active > 0 ? "active" : "" });
    const swatch = el("i", { class: "sw" });
    swatch.style.background = live.tenantColors.get(t.name);
    const weight = t.weight !== 1 ? ` (weight ${t.weight})` : "";
    item.append(swatch, document.createTextNode(`${t.name}${weight} ${pct(share)}`));
    return item;
  }));
}

function legendItem(id, active) {
  const item = el("li", { "data-request": id, class: active ? "active" : "" });
  const swatch = el("i", { class: "sw" });
  swatch.style.background = live.colors.get(id);
  item.append(swatch, document.createTextNode(id));
  return item;
}

function showStats(s) {
  const set = (id, value, text) => {
    const node = $(id);
    node.dataset.value = String(value);
    node.textContent = text ?? String(value);
  };
  set("#stat-running", s.running);
  set("#stat-waiting", s.waiting);
  set("#stat-preemptions", s.preemptions);
  set("#stat-kv-used", s.kv_blocks_used);
  set("#stat-kv-free", s.kv_blocks_free);
  const total = s.kv_blocks_used + s.kv_blocks_free;
  $("#stat-kv-pct").textContent = total
    ? `${pct(s.kv_blocks_free / total)} of the pool · ${s.kv_blocks_cached_free ?? 0} cached` : "";
  const queries = s.prefix_cache_queries ?? 0;
  set("#stat-prefix-hit", (s.prefix_cache_hit_rate ?? 0).toFixed(4),
      queries ? pct(s.prefix_cache_hit_rate) : "—");
  $("#stat-prefix-detail").textContent =
    `${s.prefix_cache_hits ?? 0} of ${queries} tokens · ${s.kv_blocks_shared ?? 0} shared blocks`;
  for (const spark of SPARKS) {
    for (const node of document.querySelectorAll(`${spark.id} [data-key]`)) {
      node.textContent = spark.format(s[node.dataset.key]);
    }
  }
  if (s.dropped) {
    $("#live-util-text").title = `${s.dropped} iterations were dropped for this page (it lagged)`;
  }
}

// ------------------------------------------------------------------------ replicas
/* A replica set's ingress (`slotserve serve --replicas N`): each record says which replica
 * ran it (`replica`), with that replica's own iteration numbers; the page draws one strip per
 * replica, labelled, in place of the single strip. */

/** The replicas of a hello: keep the strips of known ones (a reconnect), unless restarted. */
function setReplicas(views) {
  const old = live.replicas || new Map();
  live.replicas = new Map();
  const wrap = $("#live .strip-wrap");
  $("#live-strip").style.display = "none";
  $("#live-util").style.display = "none";
  for (const node of wrap.querySelectorAll(".replica-strip")) node.remove();
  for (const view of views) {
    let strip = old.get(view.name);
    if (!strip || view.iteration < strip.lastIndex + 1 || strip.numSlots !== view.num_slots) {
      strip = { columns: [], lastIndex: -1 };
    }
    strip.numSlots = view.num_slots;
    strip.node = replicaNode(view.name);
    wrap.append(strip.node);
    live.replicas.set(view.name, strip);
  }
  showReplicaLabels(views);
}

function replicaNode(name) {
  const node = el("div", { class: "replica-strip", "data-replica": name });
  const canvas = el("canvas", { class: "strip", "aria-label": `slot strip of ${name}` });
  node.append(el("div", { class: "replica-label" }), canvas,
              el("canvas", { class: "util", "aria-label": `busy slots of ${name}` }));
  attachTooltip(canvas);
  return node;
}

function showReplicaLabels(views) {
  for (const view of views) {
    const strip = live.replicas.get(view.name);
    if (!strip) continue;
    strip.up = view.up;
    strip.node.dataset.up = String(view.up);
    $(".replica-label", strip.node).textContent =
      `${view.name} · ${view.num_slots} slots · ${view.up ? "up" : "down"}`;
  }
}

function appendReplicaIterations(records) {
  for (const record of records) {
    const strip = live.replicas.get(record.replica);
    if (!strip) continue;
    if (record.restarted) { // Serve restarted it: its numbering starts again
      strip.columns = [];
      strip.lastIndex = -1;
    }
    if (record.index <= strip.lastIndex) continue;
    if (strip.lastIndex >= 0 && record.index > strip.lastIndex + 1) record.gapBefore = true;
    strip.columns.push(record);
    strip.lastIndex = record.index;
  }
  for (const strip of live.replicas.values()) {
    if (strip.columns.length > MAX_COLUMNS) strip.columns.splice(0, strip.columns.length - MAX_COLUMNS);
  }
  live.dirtyStrip = true;
  scheduleRender();
}

/** Each replica's strip; the utilisation and the legend over all of them. */
function drawReplicaStrips() {
  let busy = 0, cells = 0, iterations = 0;
  const inView = [];
  for (const [name, strip] of live.replicas) {
    const canvas = $("canvas.strip", strip.node);
    const rowH = clamp(Math.floor(160 / strip.numSlots), 3, 18);
    const gutter = rowH >= 11 ? 48 : 0;
    const fit = Math.max(1, Math.floor((canvas.clientWidth - gutter) / LIVE_CELL_W));
    const columns = strip.columns.slice(-fit);
    drawStrip(canvas, { columns, numSlots: strip.numSlots, cellW: LIVE_CELL_W, rowH,
                        colors: live.colors, labels: false });
    drawUtil($("canvas.util", strip.node), canvas.geometry);
    strip.node.dataset.iterations = String(columns.length);
    strip.node.dataset.requests = [...new Set(columns.flatMap(
      (c) => c.slots.filter(Boolean).map((cell) => cell.request)))].join(" ");
    busy += columns.reduce((n, column) => n + busyCount(column), 0);
    cells += strip.numSlots * columns.length;
    iterations += columns.length;
    inView.push(...columns.map((column, j) => ({ column, age: columns.length - 1 - j, name })));
  }
  const value = cells ? busy / cells : 0;
  const node = $("#live-util-text");
  node.dataset.utilisation = value.toFixed(4);
  node.dataset.iterations = String(iterations);
  node.innerHTML = iterations
    ? `utilisation <b>${pct(value)}</b> over the last ${iterations} iterations of ${live.replicas.size} replicas`
    : "utilisation — (no iterations yet: send some requests)";
  inView.sort((a, b) => b.age - a.age); // oldest first: the legend lists the newest first
  showLegend(inView.map((item) => item.column), inView.findIndex((item) => item.age === 0));
}

// ------------------------------------------------------------------------ block map
/** One square per KV block (or per group of blocks when the pool is huge), colored by
 * the request holding it; a dark dot marks a block shared by several requests, pale green a
 * free block that still holds a cached prefix. */
function drawBlockMap(s) {
  const canvas = $("#block-map");
  const total = live.config.kv_blocks_total;
  const group = Math.max(1, Math.ceil(total / 16384));
  const squares = Math.ceil(total / group);
  const width = Math.max(1, canvas.clientWidth);
  const size = clamp(Math.floor(Math.sqrt((width * 200) / squares)), 3, 16);
  const perRow = Math.max(1, Math.floor(width / size));
  const { ctx } = sizeCanvas(canvas, Math.ceil(squares / perRow) * size);
  const owners = blockOwners(s, total);
  const shared = blockFlags(s.blocks && s.blocks.shared, total);
  const cached = blockFlags(s.blocks && s.blocks.cached_free, total);
  const gap = size >= 6 ? 1 : 0;
  const dot = Math.max(1, Math.floor((size - gap) / 3));
  for (let q = 0; q < squares; q++) {
    const from = q * group, to = Math.min(total, (q + 1) * group);
    const x = (q % perRow) * size, y = Math.floor(q / perRow) * size;
    ctx.fillStyle = squareColor(owners, cached, from, to);
    ctx.fillRect(x, y, size - gap, size - gap);
    if (anyFlag(shared, from, to)) {
      ctx.fillStyle = SHARED_MARK;
      ctx.fillRect(x + dot, y + dot, size - gap - 2 * dot, size - gap - 2 * dot);
    }
  }
  canvas.dataset.used = String(s.kv_blocks_used);
  canvas.dataset.total = String(total);
  canvas.dataset.shared = String(s.kv_blocks_shared ?? 0);
  canvas.dataset.cachedFree = String(s.kv_blocks_cached_free ?? 0);
  $("#block-hint").textContent = (group > 1 ? `Each square is ${group} KV blocks` : "Each square is one KV block") +
    ` of ${live.config.block_size} tokens, colored by the request holding it; a dark centre: ` +
    "shared by several requests (a cached prefix); pale green: free but still cached (a later " +
    "request with that prefix reuses it); grey is free.";
}

/** A flag per block from (first, count) runs (none when the map is truncated). */
function blockFlags(runs, total) {
  const flags = new Uint8Array(total);
  for (const [first, count] of runs || []) flags.fill(1, Math.min(total, first), Math.min(total, first + count));
  return flags;
}

const anyFlag = (flags, from, to) => flags.subarray(from, to).some((f) => f === 1);

/** Owner request id of each block (null: free). Without a block map, the used count. */
function blockOwners(s, total) {
  const owners = new Array(total).fill(null);
  const map = s.blocks;
  if (!map || map.runs === null) {
    for (let b = 0; b < Math.min(total, s.kv_blocks_used); b++) owners[b] = "";
    return owners;
  }
  for (const [first, count, owner] of map.runs) {
    for (let b = first; b < Math.min(total, first + count); b++) owners[b] = map.owners[owner];
  }
  return owners;
}

function squareColor(owners, cached, from, to) {
  for (let b = from; b < to; b++) {
    const owner = owners[b];
    if (owner !== null) return owner === "" ? UTIL : live.colors.get(owner);
  }
  return anyFlag(cached, from, to) ? CACHED_FREE : IDLE;
}

// ------------------------------------------------------------------------ sparklines
const fmtCount = (v) => (v === null || v === undefined ? "—" : String(v));
const SPARKS = [
  { id: "#spark-ttft", keys: ["ttft_p50", "ttft_p99"], color: "#2f6fde", format: fmtSeconds },
  { id: "#spark-tpot", keys: ["tpot_p50", "tpot_p99"], color: "#7a5af8", format: fmtSeconds },
  { id: "#spark-tps", keys: ["tokens_per_s"], color: "#12b76a", format: fmtRate },
  { id: "#spark-kv", keys: ["kv_blocks_used"], color: "#475467", format: fmtCount,
    top: () => live.config.kv_blocks_total, topLabel: (v) => `pool ${v} blocks` },
  { id: "#spark-waiting", keys: ["waiting"], color: "#f79009", format: fmtCount },
];

function drawSparks() {
  for (const spark of SPARKS) drawSpark($(`${spark.id} canvas`), spark);
}

function drawSpark(canvas, spark) {
  const { ctx, width, height } = sizeCanvas(canvas, 54);
  const samples = live.samples;
  const values = samples.flatMap((s) => spark.keys.map((k) => s[k])).filter((v) => v !== null && v !== undefined);
  if (!values.length) {
    ctx.fillStyle = "#98a2b3";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.fillText("no finished requests yet", 8, height / 2);
    return;
  }
  const peak = Math.max(...values);
  const top = spark.top ? spark.top() : peak * 1.15 || 1;
  const span = Math.max(60, samples.length);
  const x = (i) => width - ((samples.length - 1 - i) / (span - 1)) * (width - 2) - 1;
  const y = (v) => height - 3 - (v / top) * (height - 8);
  spark.keys.slice().reverse().forEach((key, k) => {
    const light = spark.keys.length > 1 && k === 0; // the p99 line, drawn first
    strokeSeries(ctx, samples.map((s) => s[key]), x, y, spark.color, light);
  });
  ctx.fillStyle = "#98a2b3";
  ctx.font = "10px system-ui, sans-serif";
  ctx.textBaseline = "top";
  ctx.fillText(spark.topLabel ? spark.topLabel(top) : `max ${spark.format(peak)}`, 5, 3);
}

function strokeSeries(ctx, series, x, y, color, light) {
  ctx.strokeStyle = color;
  ctx.globalAlpha = light ? 0.35 : 1;
  ctx.lineWidth = light ? 1.25 : 1.75;
  ctx.beginPath();
  let drawing = false;
  series.forEach((v, i) => {
    if (v === null || v === undefined) { drawing = false; return; }
    if (drawing) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
    drawing = true;
  });
  ctx.stroke();
  ctx.globalAlpha = 1;
}

// ------------------------------------------------------------------------ replay
// NOTE: the left and right panes keep the ids of the seed's comparison (#replay-static,
// #replay-continuous) whatever they show; their heading says what that is.
const PANE_IDS = ["replay-static", "replay-continuous"];
const POLICY_TITLES = { static: "Static batching", continuous: "Continuous batching" };

const replay = {
  panes: [], // [{node, trace, columns, numSlots, busyPrefix, total}]: left, right
  step: 0,
  max: 0,
  timer: 0,
  colors: new ColorMap(),
  mode: "policies", // "policies": static vs continuous; "traces": any two traces
  loaded: [null, null], // mode "traces": each pane's entry (kept while the other changes)
};

/** Show two traces side by side: entries [left, right], each {trace, title, source} or null.
 * note: HTML over the panes (mode "traces" writes its own). colors: the live strip's map for the server's own trace, so its requests keep their color. */
function setReplay(entries, note, colors = new ColorMap(), mode = "policies") {
  stopPlaying();
  replay.mode = mode;
  replay.colors = colors;
  replay.panes = entries.map((entry, side) => makePane(side, entry));
  for (const pane of replay.panes) {
    for (const request of (pane.trace && pane.trace.requests) || []) replay.colors.get(request.id);
  }
  replay.max = Math.max(0, ...replay.panes.map((p) => p.columns.length));
  replay.step = replay.max; // start on the whole run; Home steps from the start
  $("#replay-title").textContent = mode === "traces" ? "Replay: two traces side by side"
    : "Replay: static vs continuous batching";
  $("#replay-note").classList.remove("error");
  $("#replay-note").innerHTML = mode === "traces" ? twoTracesNote(entries, replay.panes)
    : note || compareNote(replay.panes);
  renderReplay();
}

/** The static and continuous entries of {static: {trace, source}, continuous: ...}. */
function policyEntries(traces) {
  return ["static", "continuous"].map((policy) => traces[policy]
    ? { ...traces[policy], title: POLICY_TITLES[policy] } : null);
}

function makePane(side, entry) {
  const node = document.getElementById(PANE_IDS[side]);
  const trace = entry ? entry.trace : null;
  const columns = trace ? trace.iterations : [];
  const busyPrefix = [0];
  for (const column of columns) busyPrefix.push(busyPrefix[busyPrefix.length - 1] + busyCount(column));
  const numSlots = trace ? trace.num_slots : 0;
  const total = columns.length ? busyPrefix[columns.length] / (numSlots * columns.length) : 0;
  node.dataset.iterations = String(columns.length);
  node.dataset.utilisation = total.toFixed(4);
  node.dataset.policy = trace ? String(trace.policy) : "";
  $("h3", node).textContent = entry ? entry.title : "(no trace)";
  $(".source", node).textContent = entry ? entry.source : "no trace";
  return { node, trace, columns, numSlots, busyPrefix, total };
}

function compareNote(panes) {
  const [a, b] = panes;
  if (!a.columns.length || !b.columns.length) return "";
  const ratio = b.columns.length / a.columns.length;
  return `Static: <b>${a.columns.length}</b> iterations at <b>${pct(a.total)}</b> utilisation · ` +
    `continuous: <b>${b.columns.length}</b> iterations at <b>${pct(b.total)}</b> — ` +
    `the same work in ${pct(ratio)} of the iterations.`;
}

function renderReplay() {
  $("#replay-step").dataset.step = String(replay.step);
  $("#replay-step").textContent = `iteration ${replay.step} / ${replay.max}`;
  $("#rp-play").textContent = replay.timer ? "pause" : "play";
  for (const pane of replay.panes) renderPane(pane);
}

function renderPane(pane) {
  const { node, columns, numSlots } = pane;
  const shown = Math.min(replay.step, columns.length);
  node.dataset.step = String(shown);
  const canvas = $(".replay-strip", node);
  if (!columns.length) {
    sizeCanvas(canvas, 40);
    canvas.geometry = null;
    $(".it", node).textContent = pane.trace ? "no iterations"
      : "no trace yet: open one above, or drop a trace file here";
    $(".util", node).textContent = "";
    $(".queue", node).replaceChildren();
    return;
  }
  const rowH = clamp(Math.floor(180 / numSlots), 3, 30);
  const gutter = rowH >= 11 ? 48 : 0;
  const avail = Math.max(1, canvas.clientWidth - gutter);
  const cellW = clamp(avail / columns.length, 2, 44);
  const visible = Math.min(columns.length, Math.floor(avail / cellW));
  const start = clamp(shown - visible, 0, columns.length - visible);
  drawStrip(canvas, { columns: columns.slice(start, start + visible), numSlots, cellW, rowH,
                      colors: replay.colors, revealed: shown - start, cursor: shown - 1 - start,
                      labels: true });
  const sofar = shown ? pane.busyPrefix[shown] / (numSlots * shown) : 0;
  $(".it", node).innerHTML = `iteration <b>${shown}</b> of ${columns.length}`;
  $(".util", node).innerHTML = `utilisation so far <b>${pct(sofar)}</b> · whole run ${pct(pane.total)}`;
  showQueue($(".queue", node), pane, shown);
}

/** Who waits for the next iteration and who is done, after `shown` iterations. */
function showQueue(node, pane, shown) {
  const columns = pane.columns;
  const current = shown ? columns[shown - 1].index : columns[0].index - 1;
  const requests = (pane.trace.requests || []);
  const waiting = requests.filter((r) => r.arrival_iteration <= current + 1 &&
    (r.first_iteration === null || r.first_iteration > current));
  const done = requests.filter((r) => r.finish_iteration !== null && r.finish_iteration <= current);
  node.replaceChildren(el("span", { class: "label" }, "waiting"), ...chips(waiting, ""),
                       el("span", { class: "label" }, "done"), ...chips(done, "done"));
}

function chips(requests, kind) {
  if (!requests.length) return [el("span", { class: "none" }, "none")];
  const shown = requests.slice(0, 24).map((r) => {
    const chip = el("span", { class: `chip ${kind}`, "data-request": r.id }, r.id);
    chip.style.background = replay.colors.get(r.id);
    return chip;
  });
  if (requests.length > 24) shown.push(el("span", { class: "none" }, `+${requests.length - 24}`));
  return shown;
}

function go(step) {
  replay.step = clamp(step, 0, replay.max);
  renderReplay();
}

function togglePlay() {
  if (replay.timer) { stopPlaying(); renderReplay(); return; }
  if (replay.step >= replay.max) replay.step = 0;
  replay.timer = setInterval(() => {
    if (replay.step >= replay.max) { stopPlaying(); renderReplay(); return; }
    go(replay.step + 1);
  }, PLAY_MS);
  renderReplay();
}

function stopPlaying() {
  clearInterval(replay.timer);
  replay.timer = 0;
}

function replayError(message) {
  const note = $("#replay-note");
  note.classList.add("error");
  note.textContent = message;
}

/** The simulator's static and continuous traces of one workload. */
async function simulatePair(lengths, slots, arrivals) {
  const query = (policy) => {
    let url = `/debug/simulate?policy=${policy}&slots=${slots}&lengths=${lengths.join(",")}`;
    if (arrivals) url += `&arrivals=${arrivals.join(",")}`;
    return url;
  };
  const [staticTrace, continuousTrace] = await Promise.all(
    [fetchJSON(query("static")), fetchJSON(query("continuous"))]);
  return { static: { trace: staticTrace, source: "simulator" },
           continuous: { trace: continuousTrace, source: "simulator" } };
}

async function simulateForm() {
  const lengths = $("#rp-lengths").value.split(",").map((s) => s.trim()).filter(Boolean).map(Number);
  const slots = Number($("#rp-slots").value);
  if (!lengths.length || !lengths.every((n) => Number.isInteger(n) && n >= 1)) {
    return replayError("output lengths: give whole numbers >= 1, separated by commas (e.g. 2,8,3,4,3,2)");
  }
  if (!Number.isInteger(slots) || slots < 1 || slots > 1024) {
    return replayError("slots: give a whole number from 1 to 1024");
  }
  try {
    setReplay(policyEntries(await simulatePair(lengths, slots, null)));
  } catch (error) {
    replayError(`simulate: ${error.message}`);
  }
}

/** Show a recorded trace beside the simulator's run of the same workload under the other
 * policy (its requests' output lengths and arrival iterations). */
async function showTrace(trace, source, colors = undefined) {
  if (!trace || !Array.isArray(trace.iterations) || !Number.isInteger(trace.num_slots)) {
    return replayError(`${source}: not a slotserve trace (version 1: num_slots, iterations, requests)`);
  }
  if (!trace.iterations.length) {
    return replayError(`${source}: the trace has no iterations yet; send the server some requests first`);
  }
  const policy = trace.policy === "static" ? "static" : "continuous";
  const other = policy === "static" ? "continuous" : "static";
  const traces = { [policy]: { trace, source: `${source} (${trace.source || "engine"})` } };
  const base = trace.iterations[0].index;
  const finished = (trace.requests || []).filter((r) => r.output_tokens >= 1 && r.finish_iteration !== null);
  // NOTE: `source` may be a trace file's name, which anyone can choose: escaped
  let note = `<b>${policy}</b>: ${escapeHTML(source)}, ${trace.iterations.length} iterations.`;
  if (finished.length && finished.length <= 1000 && trace.num_slots <= 1024) {
    try {
      const pair = await simulatePair(finished.map((r) => r.output_tokens), trace.num_slots,
                                      finished.map((r) => Math.max(0, r.arrival_iteration - base)));
      traces[other] = { trace: renamed(pair[other].trace, finished.map((r) => r.id)),
                        source: "simulator, same workload" };
      note += ` <b>${other}</b>: the simulator on the same ${finished.length} requests ` +
        "(their output lengths and arrival iterations; one token per slot per iteration, no prefill).";
    } catch (error) {
      note += ` (no simulated ${other} run: ${escapeHTML(error.message)})`;
    }
  }
  setReplay(policyEntries(traces), note, colors);
}

/** The simulator names requests R1, R2, ... in workload order: give them back their ids. */
function renamed(trace, ids) {
  const name = (id) => ids[Number(id.slice(1)) - 1] ?? id;
  for (const request of trace.requests) request.id = name(request.id);
  for (const column of trace.iterations) {
    for (const cell of column.slots) if (cell) cell.request = name(cell.request);
  }
  return trace;
}

async function loadServerTrace() {
  try {
    await showTrace(await fetchJSON("/debug/trace"), "this server's trace", live.colors);
  } catch (error) {
    replayError(`/debug/trace: ${error.message}`);
  }
}

async function loadFile(file) {
  try {
    await showTrace(JSON.parse(await file.text()), file.name);
  } catch (error) {
    replayError(`${file.name}: ${error.message}`);
  }
}

// ------------------------------------------------------------------ any two traces
/** Why `trace` is not a drawable version-1 trace (as slotserve.lab.timeline checks), or null. */
function traceProblem(trace) {
  if (!trace || typeof trace !== "object" || Array.isArray(trace)) return "not a JSON object";
  if (trace.version !== 1) {
    return `not a slotserve trace: version must be 1, got ${JSON.stringify(trace.version)}`;
  }
  const slots = trace.num_slots;
  if (!Number.isInteger(slots) || slots < 1) return "num_slots must be an integer >= 1";
  if (!Array.isArray(trace.requests)) return "requests must be a list";
  if (!Array.isArray(trace.iterations)) return "iterations must be a list";
  if (!trace.iterations.length) return "the trace has no iterations";
  const bad = trace.iterations.findIndex((it) => !it || !Number.isFinite(it.index) ||
    !Array.isArray(it.slots) || it.slots.length !== slots);
  if (bad >= 0) return `iteration record ${bad}: needs an index and num_slots=${slots} slots`;
  return null;
}

/** Where a trace comes from: a real run, the replay simulator (and its clock), or the toy. */
function traceOrigin(trace) {
  if (trace.source === "engine") return "real run (engine)";
  if (trace.source === "replay") {
    const kind = trace.cost_model && trace.cost_model.kind;
    return kind === "unit" ? "simulated (replay, unit clock)" : `simulated (replay, ${kind} cost model)`;
  }
  if (trace.source === "simulator") return "simulated (toy)";
  return `source ${trace.source}`;
}

/** Seconds for a real run or a calibrated replay; iterations of a unit clock otherwise. */
function traceUnit(trace) {
  const calibrated = trace.source === "replay" && trace.cost_model && trace.cost_model.kind !== "unit";
  return trace.source === "engine" || calibrated ? "s" : "units";
}

/** The settings a trace records: policy, slots, KV blocks, and a replay's token budget. */
function traceSettings(trace) {
  const parts = [`${trace.policy}`, `${trace.num_slots} slots`];
  if (Number.isInteger(trace.kv_blocks_total)) parts.push(`${trace.kv_blocks_total} KV blocks`);
  const settings = trace.settings || {};
  if (settings.max_num_batched_tokens) parts.push(`${settings.max_num_batched_tokens}-token budget`);
  if (settings.enable_prefix_caching !== undefined) {
    parts.push(`prefix cache ${settings.enable_prefix_caching ? "on" : "off"}`);
  }
  return parts.join(" · ");
}

/** From the first iteration's start to the last one's end, in the trace's unit; null if unknown. */
function traceSpan(trace) {
  const first = trace.iterations[0];
  const last = trace.iterations[trace.iterations.length - 1];
  const span = last.end - first.start;
  return Number.isFinite(span) ? span : null;
}

function fmtSpan(trace) {
  const span = traceSpan(trace);
  if (span === null) return "—";
  return traceUnit(trace) === "s" ? fmtSeconds(span) : `${+span.toFixed(2)} time units`;
}

function describeTrace(trace, name) {
  return { trace, title: name, source: `${traceOrigin(trace)} · ${traceSettings(trace)}` };
}

/** The note over two arbitrary traces: each one's iterations, utilisation and span, then
 * right / left when both are there. */
function twoTracesNote(entries, panes) {
  const parts = entries.map((entry, side) => entry ? `${side ? "right" : "left"} ` +
    `(${escapeHTML(entry.title)}): <b>${panes[side].columns.length}</b> iterations at ` +
    `<b>${pct(panes[side].total)}</b> utilisation, ${fmtSpan(entry.trace)}` : null);
  if (!entries[0] || !entries[1]) {
    return `${parts.find(Boolean)}. Load a second trace for the other pane: a real run's ` +
      "(<code>--trace</code>) and its replay (<code>slotserve simulate --trace real.json " +
      "--save-trace sim.json</code>) compare iteration by iteration.";
  }
  let ratio = `right / left: ${pct(panes[1].columns.length / panes[0].columns.length)} of the iterations`;
  const [a, b] = entries.map((entry) => entry.trace);
  const spans = [traceSpan(a), traceSpan(b)];
  if (traceUnit(a) === traceUnit(b) && spans[0] > 0 && spans[1] !== null) {
    ratio += `, ${pct(spans[1] / spans[0])} of the time`;
  }
  return `${parts.join(" · ")} — ${ratio}.`;
}

/** Draw `trace` in one pane (0: left, 1: right); the other pane keeps the trace loaded into
 * it this way (the static-vs-continuous pair is replaced). */
function showInPane(side, trace, name) {
  const problem = traceProblem(trace);
  if (problem) return replayError(`${name}: ${problem}`);
  if (replay.mode !== "traces") replay.loaded = [null, null];
  replay.loaded[side] = describeTrace(trace, name);
  const colors = replay.mode === "traces" ? replay.colors : new ColorMap();
  setReplay(replay.loaded.slice(), "", colors, "traces");
}

async function loadFileInto(side, file) {
  try {
    showInPane(side, JSON.parse(await file.text()), file.name);
  } catch (error) {
    replayError(`${file.name}: ${error.message}`);
  }
}

async function loadServerInto(side) {
  try {
    showInPane(side, await fetchJSON("/debug/trace"), "this server, live");
  } catch (error) {
    replayError(`/debug/trace: ${error.message}`);
  }
}

/** Dropping files on a pane: the first goes into that pane, a second into the other.
 * Elsewhere on the replay card: into the right pane if only it is free, else left then right
 * (a drop that misses a pane must not make the browser open the file instead of the page). */
function wireDrop() {
  const card = $("#replay");
  card.addEventListener("dragover", (event) => event.preventDefault());
  card.addEventListener("drop", (event) => {
    event.preventDefault();
    const pane = event.target.closest && event.target.closest(".pane");
    const side = pane ? PANE_IDS.indexOf(pane.id) : (freeSide() ?? 0);
    if (pane) pane.classList.remove("drop");
    const files = [...event.dataTransfer.files].slice(0, 2);
    files.forEach((file, k) => loadFileInto(k ? 1 - side : side, file));
  });
  for (const id of PANE_IDS) {
    const node = document.getElementById(id);
    node.addEventListener("dragover", () => node.classList.add("drop"));
    node.addEventListener("dragleave", () => node.classList.remove("drop"));
  }
}

/** The right pane when two-trace mode has only the left one filled, else null. */
function freeSide() {
  return replay.mode === "traces" && replay.loaded[0] && !replay.loaded[1] ? 1 : null;
}

function wireFileInput(selector, side) {
  $(selector).addEventListener("change", (event) => {
    const file = event.target.files[0];
    if (file) loadFileInto(side, file);
    event.target.value = "";
  });
}

function onKey(event) {
  if ((event.target.closest && event.target.closest("input, textarea, select")) || event.ctrlKey || event.metaKey || event.altKey) return;
  const actions = {
    ArrowRight: () => go(replay.step + (event.shiftKey ? 5 : 1)),
    ArrowLeft: () => go(replay.step - (event.shiftKey ? 5 : 1)),
    Home: () => go(0),
    End: () => go(replay.max),
    " ": () => togglePlay(),
  };
  const action = actions[event.key];
  if (!action || (event.key === " " && event.target.closest && event.target.closest("button"))) {
    return; // Space on a focused button presses that button
  }
  event.preventDefault();
  if (event.key !== " ") { stopPlaying(); }
  action();
}

// ------------------------------------------------------------------------ start
function wireControls() {
  $("#live-pause").addEventListener("click", (event) => {
    live.paused = !live.paused;
    event.currentTarget.classList.toggle("on", live.paused);
    event.currentTarget.textContent = live.paused ? "Resume" : "Pause";
    live.dirtyStrip = true;
    scheduleRender();
  });
  $("#rp-first").addEventListener("click", () => { stopPlaying(); go(0); });
  $("#rp-prev").addEventListener("click", () => { stopPlaying(); go(replay.step - 1); });
  $("#rp-play").addEventListener("click", togglePlay);
  $("#rp-next").addEventListener("click", () => { stopPlaying(); go(replay.step + 1); });
  $("#rp-last").addEventListener("click", () => { stopPlaying(); go(replay.max); });
  $("#rp-form").addEventListener("submit", (event) => { event.preventDefault(); simulateForm(); });
  $("#rp-server").addEventListener("click", loadServerTrace);
  wireFileInput("#rp-file-a", 0);
  wireFileInput("#rp-file-b", 1);
  $("#rp-server-a").addEventListener("click", () => loadServerInto(0));
  $("#rp-server-b").addEventListener("click", () => loadServerInto(1));
  wireDrop();
  $("#rp-file").addEventListener("change", (event) => {
    const file = event.target.files[0];
    if (file) loadFile(file);
    event.target.value = "";
  });
  document.addEventListener("keydown", onKey);
  window.addEventListener("resize", () => {
    live.dirtyStrip = live.dirtyStats = true;
    scheduleRender();
    renderReplay();
  });
  for (const canvas of document.querySelectorAll("canvas.strip")) attachTooltip(canvas);
}

wireControls();
connect();
simulateForm(); // the seed's toy: 6 requests, 3 slots
