// radixlm's live cache dashboard: plain JS, no dependencies. It reads GET /dashboard/state once, then the
// server-sent events of GET /dashboard/events (fetch with the key as a Bearer header: EventSource cannot
// send one). Every text from the server goes into the page as text, never as markup.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const KEY_STORE = "radixlm.dashboard.key";
let apiKey = null;
let stream = null; // the AbortController of the open events stream
let lastState = null;

function $(id) { return document.getElementById(id); }

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (parent) parent.appendChild(el);
  return el;
}

function html(tag, text, cls, parent) {
  const el = document.createElement(tag);
  if (text !== undefined && text !== null) el.textContent = String(text);
  if (cls) el.className = cls;
  if (parent) parent.appendChild(el);
  return el;
}

function fmt(n) {
  if (n === null || n === undefined) return "–";
  if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (n >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return String(n);
}

function pct(x) { return (100 * x).toFixed(1) + "%"; }

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = "status " + (cls || "");
}

function headers() {
  return apiKey ? { Authorization: "Bearer " + apiKey } : {};
}

// ---- connecting ------------------------------------------------------------------------------------------
async function connect(key) {
  apiKey = key;
  $("login-error").textContent = "";
  let resp;
  try {
    resp = await fetch("/dashboard/state", { headers: headers(), cache: "no-store" });
  } catch (e) {
    $("login-error").textContent = "cannot reach the server";
    return;
  }
  if (resp.status === 401) {
    $("login-error").textContent = "the server refused this key (401)";
    sessionStorage.removeItem(KEY_STORE);
    return;
  }
  if (!resp.ok) {
    $("login-error").textContent = "the server answered " + resp.status;
    return;
  }
  sessionStorage.setItem(KEY_STORE, key);
  $("login").hidden = true;
  $("main").hidden = false;
  render(await resp.json());
  openStream();
}

async function openStream() {
  if (stream) stream.abort();
  const ctl = new AbortController();
  stream = ctl;
  try {
    const resp = await fetch("/dashboard/events", { headers: headers(), signal: ctl.signal, cache: "no-store" });
    if (!resp.ok || !resp.body) throw new Error("events: HTTP " + resp.status);
    setStatus("live", "live");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        handleEvent(buf.slice(0, end));
        buf = buf.slice(end + 2);
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
  }
  if (stream !== ctl) return;
  setStatus("disconnected: retrying", "down");
  setTimeout(openStream, 2000);
}

function handleEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length) return;
  const payload = JSON.parse(data.join("\n"));
  if (name === "state") render(payload);
  else if (name === "error") setStatus("server: " + payload.message, "down");
}

// ---- rendering ---------------------------------------------------------------------------------------------
function render(state) {
  if (state.error) {
    setStatus("server: " + state.error, "down");
    return;
  }
  lastState = state;
  document.body.dataset.updated = String(state.time);
  renderCards(state);
  renderTree(state.trees);
  renderUsage(state.history);
  renderHits(state.history);
  renderRequests(state.requests);
  renderMisses(state.misses);
}

function renderCards(s) {
  const p = s.pool;
  $("hit-rate").textContent = pct(s.cache.hit_rate);
  $("tokens-saved").textContent = fmt(s.cache.tokens_saved);
  $("pool-used").textContent = pct((p.total - p.free - p.evictable) / Math.max(1, p.total)) + " of " + fmt(p.total);
  $("radix-nodes").textContent = fmt(s.cache.radix_nodes);
  $("pins").textContent = s.cache.sessions_pinned + " / " + fmt(s.cache.session_pinned_tokens) + " tok";
  const c = s.request_counts;
  $("req-counts").textContent = (c.running + c.prefill) + " run, " + (c.waiting + c.grammar) + " wait";
  const g = s.grammar;
  $("grammar").textContent = g.waiting_requests + " req, " + g.queued + " queued, " + g.running + " compiling";
  const sp = s.speculative;
  $("spec").textContent = sp ? sp.algorithm + ": " + fmt(sp.accepted_tokens) + " acc" : "off";
}

// An icicle: one column per depth, each node's height its subtree's tokens.
function renderTree(trees) {
  const el = $("tree");
  while (el.firstChild) el.removeChild(el.firstChild);
  const width = Math.max(el.parentNode.clientWidth || 900, 600);
  const height = 360;
  const parts = [["device", trees.device]];
  if (trees.host && trees.host.nodes.length) parts.push(["host", trees.host]);
  let maxDepth = 1;
  const laid = parts.map(([tier, tree]) => {
    const kids = new Map();
    for (const n of tree.nodes) {
      if (!kids.has(n.parent)) kids.set(n.parent, []);
      kids.get(n.parent).push(n);
    }
    const depth = new Map([[0, 0]]);
    for (const n of tree.nodes) { // parents come before their children
      depth.set(n.id, (depth.get(n.parent) || 0) + 1);
      maxDepth = Math.max(maxDepth, depth.get(n.id));
    }
    return { tier, tree, kids, depth };
  });
  const colW = Math.max(130, Math.floor(width / maxDepth));
  el.setAttribute("width", colW * maxDepth);
  el.setAttribute("height", height);
  let shown = 0;
  const bandH = parts.length > 1 ? [height * 0.68, height * 0.32] : [height];
  let y0 = 0;
  laid.forEach((part, i) => {
    const top = part.kids.get(0) || [];
    const total = top.reduce((a, n) => a + n.subtree_tokens, 0);
    if (i > 0) svg("line", { x1: 0, x2: colW * maxDepth, y1: y0, y2: y0, class: "tier-split" }, el);
    if (!top.length) {
      const t = svg("text", { x: 8, y: y0 + 20, class: "empty" }, el);
      t.textContent = part.tier === "device" ? "the cache holds no prefix you may see" : "";
    }
    const place = (nodes, parentTotal, yA, yB) => {
      let y = yA;
      for (const n of nodes) {
        const h = parentTotal > 0 ? ((yB - yA) * n.subtree_tokens) / parentTotal : 0;
        drawNode(el, n, part, colW, y, h);
        shown++;
        const sub = part.kids.get(n.id);
        if (sub && h >= 1) place(sub, n.subtree_tokens, y, y + h);
        y += h;
      }
    };
    place(top, total, y0, y0 + bandH[i]);
    y0 += bandH[i];
  });
  const d = trees.device;
  const v = lastState.viewer;
  $("tree").dataset.nodes = String(shown);
  $("tree-note").textContent = (v.admin ? "(all tenants)" : "(tenant " + (v.tenant === null ? "default" : v.tenant) + ")") +
    " " + fmt(d.tokens) + " tokens, " + d.visited_nodes + " nodes walked" + (d.complete ? "" : " (the walk stopped at its budget)");
}

function drawNode(el, n, part, colW, y, h) {
  const x = (part.depth.get(n.id) - 1) * colW;
  const cls = [n.aggregate ? "aggregate" : n.pinned ? "pinned" : part.tier];
  if (n.locked) cls.push("locked");
  const r = svg("rect", { x: x + 1, y, width: colW - 2, height: Math.max(h, 0.5), class: cls.join(" ") }, el);
  const label = n.aggregate ? n.aggregate + " smaller subtrees" : n.text;
  r.dataset.node = String(n.id);
  r.dataset.hits = String(n.hits);
  r.dataset.tokens = String(n.tokens);
  r.dataset.subtreeTokens = String(n.subtree_tokens);
  r.dataset.tier = part.tier;
  r.dataset.pinned = String(!!n.pinned);
  r.dataset.text = label;
  const title = svg("title", {}, r);
  title.textContent = label + "\n" + n.tokens + " tokens (subtree " + n.subtree_tokens + " in " +
    n.subtree_nodes + " nodes), " + n.hits + " hits" + (n.pinned ? ", pinned" : "") + (n.locked ? ", in use" : "");
  r.addEventListener("mouseenter", () => { $("tree-detail").textContent = title.textContent; });
  if (h >= 13) {
    const t = svg("text", { x: x + 5, y: y + Math.min(h / 2 + 4, 14) }, el);
    const room = Math.max(4, Math.floor((colW - 12) / 6.5));
    const s = n.hits + "× " + label.replace(/\s+/g, " ");
    t.textContent = s.length > room ? s.slice(0, room - 1) + "…" : s;
  }
}

function renderUsage(history) {
  const el = $("usage-chart");
  while (el.firstChild) el.removeChild(el.firstChild);
  el.dataset.points = String(history.length);
  if (!history.length) return;
  const W = 600, H = 180;
  const n = history.length;
  const xAt = (i) => (n === 1 ? W : (i * W) / (n - 1));
  const keys = ["used", "pinned", "evictable", "free"];
  // the y axis reaches a little past the most the pool held (free fills the rest): a 2% fill stays visible
  const held = Math.max(...history.map((p) => 1 - p.free / Math.max(1, p.total)));
  const top = Math.min(1, Math.max(0.02, held * 1.25));
  const base = new Array(n).fill(0);
  const yAt = (f) => H - (Math.min(f, top) / top) * H;
  for (const key of keys) {
    const lower = base.slice();
    const upper = history.map((p, i) => base[i] + p[key] / Math.max(1, p.total));
    const pts = [];
    upper.forEach((u, i) => pts.push(xAt(i) + "," + yAt(u)));
    for (let i = n - 1; i >= 0; i--) pts.push(xAt(i) + "," + yAt(lower[i]));
    if (n === 1) { pts.unshift("0," + yAt(upper[0])); pts.push("0," + yAt(lower[0])); }
    svg("polygon", { points: pts.join(" "), class: "series " + key, "data-series": key }, el);
    upper.forEach((u, i) => { base[i] = u; });
  }
  const last = history[n - 1];
  const t = svg("text", { x: 4, y: 12, class: "axis" }, el);
  t.textContent = "0–" + pct(top) + " of " + fmt(last.total) + " slots; " + n + " points, one a second";
}

function renderHits(history) {
  const el = $("hit-chart");
  while (el.firstChild) el.removeChild(el.firstChild);
  el.dataset.points = String(history.length);
  if (!history.length) return;
  const W = 600, H = 180;
  const n = history.length;
  const xAt = (i) => (n === 1 ? W : (i * W) / (n - 1));
  const maxSaved = Math.max(1, ...history.map((p) => p.tokens_saved));
  let rate = history[0].hit_rate;
  const ratePts = history.map((p, i) => {
    if (p.hit_rate_recent !== null) rate = p.hit_rate_recent;
    return xAt(i) + "," + (H - rate * (H - 16));
  });
  const savedPts = history.map((p, i) => xAt(i) + "," + (H - (p.tokens_saved / maxSaved) * (H - 16)));
  svg("polyline", { points: savedPts.join(" "), class: "line saved", "data-series": "tokens_saved" }, el);
  svg("polyline", { points: ratePts.join(" "), class: "line hit", "data-series": "hit_rate" }, el);
  const t = svg("text", { x: 4, y: 12, class: "axis" }, el);
  t.textContent = "hit rate 0–100%; tokens saved up to " + fmt(maxSaved);
}

function renderRequests(rows) {
  const body = $("requests").tBodies[0];
  while (body.firstChild) body.removeChild(body.firstChild);
  if (!rows.length) {
    const tr = html("tr", null, null, body);
    const td = html("td", "no request is running or waiting", "muted", tr);
    td.colSpan = 9;
    return;
  }
  for (const r of rows) {
    const tr = html("tr", null, null, body);
    tr.dataset.rid = r.rid;
    tr.dataset.state = r.state;
    html("td", r.rid, "rid", tr);
    html("td", r.state, null, tr);
    html("td", r.tenant === null ? "–" : r.tenant, null, tr);
    const prog = html("td", null, null, tr);
    const bar = html("span", null, "bar", prog);
    const fill = html("span", null, null, bar);
    fill.style.width = Math.min(100, (100 * r.output_tokens) / Math.max(1, r.max_tokens)) + "%";
    html("span", r.output_tokens + " / " + r.max_tokens, null, prog);
    html("td", r.prompt_tokens, null, tr);
    html("td", r.cached_tokens, null, tr);
    html("td", r.grammar ? r.grammar + (r.grammar_closing ? " (closing)" : "") : "–", null, tr);
    html("td", r.spec ? r.spec.accepted + " acc / " + r.spec.verify_steps + " steps" : "–", null, tr);
    html("td", r.age_s.toFixed(1) + " s", null, tr);
  }
}

function renderMisses(misses) {
  const ul = $("misses");
  while (ul.firstChild) ul.removeChild(ul.firstChild);
  if (!misses.length) {
    html("li", "no cache miss yet", "muted", ul);
    return;
  }
  for (const m of misses) {
    const li = html("li", null, null, ul);
    li.dataset.rid = m.rid;
    li.dataset.reason = m.reason;
    html("span", m.reason, "reason", li);
    html("span", new Date(m.time * 1000).toLocaleTimeString() + "  " + m.rid + (m.session_id ? "  session " + m.session_id : "") +
      "  cached " + m.cached_tokens + " of " + m.prompt_tokens, null, li);
    const e = m.explanation;
    if (e) {
      html("div", "expected " + e.expected_cached_tokens + " cached; at token " + e.index + ": was " +
        JSON.stringify(e.previous_text) + ", now " + JSON.stringify(e.new_text), "diff", li);
    }
  }
}

// ---- start -------------------------------------------------------------------------------------------------
window.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    connect($("api-key").value.trim());
  });
  window.addEventListener("resize", () => { if (lastState) renderTree(lastState.trees); });
  const saved = sessionStorage.getItem(KEY_STORE);
  if (saved !== null) connect(saved);
});
