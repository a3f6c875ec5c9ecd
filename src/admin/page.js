"use strict";
// All API data reaches the page through textContent / setAttribute only,
// so header values like "<script>" show up as the characters they are.

const $ = (sel) => document.querySelector(sel);
const TOKEN_KEY = "tollgate.token";
const SVG_NS = "http://www.w3.org/2000/svg";

// Small element builder: text is always set as text.
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
// Only touch the DOM when the text really changed (keeps selections, no flicker).
function setText(e, text) {
  const t = text === null || text === undefined ? "" : String(text);
  if (e.textContent !== t) e.textContent = t;
}
// Replace the children of e with one div per line, but only when they changed.
function setLines(e, lines, cls) {
  const sig = JSON.stringify(lines);
  if (e.dataset.sig === sig) return;
  e.dataset.sig = sig;
  e.replaceChildren(...lines.map((l) => el("div", cls || "line", l)));
}

// Characters that hide or disguise a caller's value (controls, zero-width
// and bidi overrides, line separators) are shown as <U+XXXX>, so two
// different values never look alike.
// Also marks (combining, variation selectors), spaces other than the plain
// one, and the blank-looking fillers, so "k1" and "k1" + a mark differ.
const DISGUISE = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{M}\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000\u115f\u1160\u2800\u3164\uffa0\u180e]/gu;
function visible(s) {
  return String(s).replace(DISGUISE,
    (c) => "\u27e8U+" + c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0") + "\u27e9");
}
// A value stored as a hash (long, or not UTF-8) comes as an object: shown
// in a style of its own, so text that merely looks like a hash differs.
function valueChip(v) {
  if (v && typeof v === "object") {
    const what = "hashed" + (v.text ? "" : ", not UTF-8") + ", " + v.bytes + " bytes: " + String(v.sha256).slice(0, 12) + "\u2026";
    return el("span", "chip hashed", (v.key ? visible(v.key) + "=" : "") + what);
  }
  return el("span", "chip", visible(v));
}
// A counter's values, each in its own box, so "a, b" is never taken for two
// values; the key itself when it has none.
function setValues(e, values, counter) {
  const list = values && values.length ? values : [counter];
  const sig = JSON.stringify(list);
  if (e.dataset.sig === sig) return;
  e.dataset.sig = sig;
  e.replaceChildren(...list.map(valueChip));
}

// ---------- formatting ----------
const pad2 = (n) => String(n).padStart(2, "0");
function fmtUptime(s) {
  s = Math.max(0, Math.floor(Number(s) || 0));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + pad2(s % 60) + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h " + pad2(Math.floor(s / 60) % 60) + "m";
  return Math.floor(s / 86400) + "d " + pad2(Math.floor(s / 3600) % 24) + "h";
}
function fmtMs(ms) {
  if (ms === null || ms === undefined) return "now";
  ms = Number(ms);
  if (ms < 1000) return Math.round(ms) + " ms";
  if (ms < 60000) return (Math.round(ms / 100) / 10) + " s";
  return fmtUptime(ms / 1000);
}
function fmtSecs(ms) { return (Math.round(Number(ms) / 10) / 100) + "s"; }
function fmtRate(v) {
  if (v === null || v === undefined || isNaN(v)) return "–";
  return String(Math.round(Number(v) * 10) / 10);
}
function fmtShare(v) {
  if (v === null || v === undefined || isNaN(v)) return "–";
  return (Math.round(Number(v) * 1000) / 10) + "%";
}
function fmtTime(iso) {
  const d = new Date(iso);
  return isNaN(d) ? String(iso) : d.toLocaleString();
}
function fmtNum(v, digits) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(digits);
}

// ---------- API access (token, relative URLs, no cache) ----------
function getToken() {
  try { return sessionStorage.getItem(TOKEN_KEY) || ""; } catch (e) { return ""; }
}
async function api(path, opts) {
  opts = opts || {};
  const headers = Object.assign({}, opts.headers);
  const token = getToken();
  if (token) headers["Authorization"] = "Bearer " + token;
  // A hung connection must not stall polling forever.
  const ctl = new AbortController();
  const t = setTimeout(() => ctl.abort(), 5000);
  try {
    return await fetch(path, Object.assign({}, opts, { headers, cache: "no-store", signal: ctl.signal }));
  } finally {
    clearTimeout(t);
  }
}
function needToken() {
  $("#auth").hidden = false;
  setText($("#token-msg"), getToken() ? "token rejected" : "");
}
function tokenAccepted() { $("#auth").hidden = true; }
function saveToken() {
  const v = $("#token").value.trim();
  try { sessionStorage.setItem(TOKEN_KEY, v); } catch (e) { /* private mode: nothing we can do */ }
  $("#token").value = "";
  setText($("#token-msg"), "");
  pollNow();
}
$("#token-save").addEventListener("click", saveToken);
$("#token").addEventListener("keydown", (ev) => { if (ev.key === "Enter") { ev.preventDefault(); saveToken(); } });

function setConn(msg) {
  const c = $("#conn");
  setText(c, msg);
  c.hidden = !msg;
}

// ---------- status bar ----------
function renderStatus(s) {
  setText($("#version"), s.version);
  setText($("#header-version"), s.version ? "v" + s.version : "");
  const up = $("#uptime");
  setText(up, fmtUptime(s.uptime_s));
  if (s.started_at) up.setAttribute("title", "started " + s.started_at);
  setText($("#updated"), new Date().toLocaleTimeString());
  renderStore(s.store || {});
  renderFiles(s.files || [], s.refused || []);
}

function renderStore(st) {
  const box = $("#store");
  const sig = JSON.stringify(st);
  if (box.dataset.sig === sig) return;
  box.dataset.sig = sig;
  box.setAttribute("data-up", st.up ? "true" : "false");
  const parts = [el("span", "label", "store"), el("span", "store-kind", st.kind)];
  if (st.address) parts.push(el("span", "store-address mono", st.address));
  // Colour AND a word, so it reads without colour too.
  parts.push(el("span", "state " + (st.up ? "up" : "down"), st.up ? "up" : "down"));
  if (st.last_error) parts.push(el("span", "store-error", st.last_error));
  const rt = st.round_trip;
  if (rt) {
    parts.push(el("span", "store-rt",
      "p50 " + fmtNum(rt.p50_ms, 2) + " ms · p99 " + fmtNum(rt.p99_ms, 2) + " ms · " + rt.calls + " calls/min"));
  }
  box.replaceChildren(...parts);
}

function renderFiles(files, refused) {
  const box = $("#files");
  const sig = JSON.stringify([files, refused]);
  if (box.dataset.sig === sig) return; // unchanged: leave the DOM alone
  box.dataset.sig = sig;
  const nodes = [];
  for (const f of files) {
    const d = el("div", "file" + (f.last_error ? " has-error" : ""));
    d.setAttribute("data-file", f.file);
    d.append(el("span", "file-name mono", f.file), el("span", "meta", "domain " + f.domain));
    const v = el("span", "meta mono", "version " + String(f.version || "–").slice(0, 12));
    if (f.version) v.setAttribute("title", f.version);
    d.append(v, el("span", "meta", "loaded " + (f.loaded_at ? fmtTime(f.loaded_at) : "–")));
    if (f.reloads_ok !== undefined) {
      d.append(el("span", "meta", "reloads " + f.reloads_ok + " ok / " + (f.reloads_failed || 0) + " failed"));
    }
    if (f.file_present === false) d.append(el("span", "badge unlimited", "file missing"));
    if (f.last_error) {
      const e = el("div", "file-error");
      e.append(el("span", "what", "not applied"), document.createTextNode(f.last_error));
      d.append(e);
    }
    nodes.push(d);
  }
  // Refused files of a config directory: not ".file" (they are not loaded), same red box.
  for (const r of refused) {
    const d = el("div", "refused-file");
    d.setAttribute("data-file", r.file);
    d.append(el("span", "file-name mono", r.file), el("span", "badge refuse", "refused"));
    const e = el("div", "file-error");
    e.append(el("span", "what", "refused"), document.createTextNode(r.last_error || "refused"));
    d.append(e);
    nodes.push(d);
  }
  box.replaceChildren(...nodes);
}

// ---------- rules table (rows reused, keyed by domain+name+id) ----------
const ruleRows = new Map();

function makeChart() {
  const W = 120, H = 26;
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("width", W);
  svg.setAttribute("height", H);
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  const title = document.createElementNS(SVG_NS, "title");
  const line = (color) => {
    const p = document.createElementNS(SVG_NS, "polyline");
    p.setAttribute("fill", "none");
    p.setAttribute("stroke", color);
    p.setAttribute("stroke-width", "1.5");
    p.setAttribute("stroke-linejoin", "round");
    return p;
  };
  const allowed = line("#2f6fb3"), limited = line("#c62828");
  svg.append(title, allowed, limited); // limited drawn last so it stays visible
  return { svg, title, allowed, limited, W, H };
}

function updateChart(c, history) {
  const h = history || {};
  const a = (h.allowed || []).map(Number);
  const l = (h.limited || []).map((v, i) => Number(v) + Number((h.shadow_limited || [])[i] || 0));
  const n = Math.max(a.length, l.length);
  const max = Math.max(1, ...a, ...l); // one scale for both lines
  const pts = (arr) => {
    if (n < 2) return "";
    const out = [];
    for (let i = 0; i < n; i++) {
      const x = (i * (c.W - 2)) / (n - 1) + 1;
      const y = c.H - 1 - ((Number(arr[i]) || 0) / max) * (c.H - 3);
      out.push(x.toFixed(1) + "," + y.toFixed(1));
    }
    return out.join(" ");
  };
  c.allowed.setAttribute("points", pts(a));
  c.limited.setAttribute("points", pts(l));
  const sum = (arr) => arr.reduce((s, v) => s + (Number(v) || 0), 0);
  setText(c.title, "last 15 min: " + sum(a) + " allowed, " + sum(l) + " limited (incl. shadow)");
}

function makeRuleRow() {
  const tr = document.createElement("tr");
  const td = (cls) => { const c = el("td", cls); tr.append(c); return c; };
  const r = { tr };
  r.nameCell = td("name");
  r.name = el("span", "rule-name");
  r.badges = el("span", "badges");
  r.sub = el("div", "sub");
  r.nameCell.append(r.name, r.badges, r.sub);
  r.match = td("match");
  r.by = td("by");
  r.windows = td("windows");
  r.allowed = td("num rate-allowed");
  r.limited = td("num rate-limited");
  r.shadow = td("num rate-shadow");
  r.failed = td("num rate-failed");
  r.share = td("num share");
  r.chartCell = td("chart");
  r.chart = makeChart();
  r.chartCell.append(r.chart.svg);
  return r;
}

function fillRuleRow(row, r) {
  row.tr.setAttribute("data-rule", r.name);
  row.tr.setAttribute("data-domain", r.domain);
  setText(row.name, r.name);
  const sub = [];
  if (r.id && r.id !== r.name) sub.push("id " + r.id);
  sub.push(r.domain, r.file);
  setText(row.sub, sub.filter(Boolean).join(" · "));
  // Badges rebuilt only when the set changes.
  const badges = [];
  if (r.changed) badges.push(["changed", "changed"]);
  if (r.shadow) badges.push(["shadow", "shadow"]);
  if (r.quota) badges.push(["quota", "quota"]);
  if (r.unlimited) badges.push(["unlimited", "unlimited"]);
  if (r.status && r.status !== 429) badges.push(["status", "status " + r.status]);
  const sig = JSON.stringify(badges);
  if (row.badges.dataset.sig !== sig) {
    row.badges.dataset.sig = sig;
    row.badges.replaceChildren(...badges.map(([c, t]) => el("span", "badge " + c, t)));
  }
  setText(row.match, r.match);
  setText(row.by, (r.by && r.by.length) ? r.by.join(", ") : "one shared counter");
  setLines(row.windows, (r.windows && r.windows.length) ? r.windows : [r.unlimited ? "unlimited" : "–"]);
  const rate = r.rate || {};
  const num = (cell, v) => { setText(cell, fmtRate(v)); cell.classList.toggle("zero", !Number(v)); };
  num(row.allowed, rate.allowed);
  num(row.limited, rate.limited);
  num(row.shadow, rate.shadow_limited);
  num(row.failed, rate.failed);
  setText(row.share, fmtShare(r.limited_share));
  row.share.classList.toggle("hot", Number(r.limited_share) > 0);
  updateChart(row.chart, r.history);
}

function renderRules(rules) {
  const tbody = $("#rules tbody");
  const seen = new Set();
  rules.forEach((r, i) => {
    let key = [r.domain, r.name, r.id].join("\u0001");
    while (seen.has(key)) key += "\u0001dup"; // defensive: never share a row
    seen.add(key);
    let row = ruleRows.get(key);
    if (!row) { row = makeRuleRow(); ruleRows.set(key, row); }
    fillRuleRow(row, r);
    // Move only when out of place, so rows do not re-render.
    if (tbody.children[i] !== row.tr) tbody.insertBefore(row.tr, tbody.children[i] || null);
  });
  for (const [key, row] of ruleRows) {
    if (!seen.has(key)) { row.tr.remove(); ruleRows.delete(key); }
  }
  $("#rules-empty").hidden = rules.length > 0;
}

// ---------- top limited callers (rows reused by position) ----------
function renderTop(list) {
  const tbody = $("#top tbody");
  list.forEach((t, i) => {
    let tr = tbody.children[i];
    if (!tr) {
      tr = el("tr", "top-row");
      for (const cls of ["rule", "domain", "who", "num refusals", "num ago", "num retry"]) tr.append(el("td", cls));
      tbody.append(tr);
    }
    tr.setAttribute("data-rule", t.rule);
    tr.setAttribute("data-domain", t.domain);
    const c = tr.children;
    setText(c[0], t.rule);
    setText(c[1], t.domain);
    setValues(c[2], t.values, t.counter);
    setText(c[3], t.refusals);
    setText(c[4], t.last_refused_s_ago === null || t.last_refused_s_ago === undefined
      ? "–" : (t.last_refused_s_ago < 60 ? (Math.round(t.last_refused_s_ago * 10) / 10) + "s ago"
        : fmtUptime(t.last_refused_s_ago) + " ago"));
    setText(c[5], fmtMs(t.retry_in_ms));
  });
  while (tbody.children.length > list.length) tbody.lastElementChild.remove();
  $("#top-empty").hidden = list.length > 0;
}

// ---------- polling ----------
let updates = 0, timer = 0, inFlight = false;

async function poll() {
  clearTimeout(timer);
  if (inFlight) return;
  inFlight = true;
  try {
    let state = null;
    // With thousands of rules the server sends the busiest 500 (or those
    // the filter names), so polling stays light.
    const filter = $("#rules-filter").value.trim();
    try {
      const res = await api("api/state" + (filter ? "?filter=" + encodeURIComponent(filter) : ""));
      if (res.status === 401) { needToken(); setConn(""); }
      else if (!res.ok) setConn("tollgate answered HTTP " + res.status);
      else state = await res.json();
    } catch (e) {
      setConn("tollgate unreachable");
    }
    if (state) {
      tokenAccepted();
      try {
        renderStatus(state);
        renderRules(state.rules || []);
        const shown = (state.rules || []).length, matched = state.rules_matched, total = state.rules_total;
        let note = "";
        if (typeof total === "number") {
          note = filter ? matched + " of " + total + " rules match" : total + " rules";
          if (typeof matched === "number" && shown < matched) note += "; showing the " + shown + " busiest of the last 15 minutes";
        }
        setText($("#rules-note"), note);
        renderTop(state.top_limited || []);
        setConn("");
        updates++;
        document.body.dataset.updates = String(updates);
      } catch (e) {
        // A rendering bug should be visible, not look like a dead server.
        console.error(e);
        setConn("page error: " + e.message);
      }
    }
  } finally {
    inFlight = false;
    timer = setTimeout(poll, 1000); // 1 s after the last answer: no pile-up on a slow server
  }
}
function pollNow() { if (!inFlight) poll(); }
$("#rules-filter").addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(pollNow, 150); });

// ---------- explain ----------
const form = $("#explain-form");
function mode() { return form.querySelector('input[name="mode"]:checked').value; }
function showMode() {
  const rls = mode() === "rls";
  $("#x-http").hidden = rls;
  $("#x-rls").hidden = !rls;
}
form.querySelectorAll('input[name="mode"]').forEach((r) => r.addEventListener("change", showMode));
showMode();

// "Name: value" per line -> [[name, value], ...]
function parseHeaders(text) {
  const out = [];
  text.split(/\r?\n/).forEach((line, i) => {
    if (!line.trim()) return;
    const at = line.indexOf(":");
    if (at <= 0) throw new Error("headers line " + (i + 1) + ": expected “Name: value”");
    out.push([line.slice(0, at).trim(), line.slice(at + 1).trim()]);
  });
  return out;
}
// "k=v, k=v *N" per line -> [{entries: [[k, v]...], hits_addend: N}]
function parseDescriptors(text) {
  const out = [];
  text.split(/\r?\n/).forEach((line, i) => {
    if (!line.trim()) return;
    let hits = 1;
    const m = line.match(/\s\*(\d+)\s*$/);
    if (m) { hits = Number(m[1]); line = line.slice(0, m.index); }
    const entries = line.split(",").map((part) => {
      const p = part.trim();
      const at = p.indexOf("=");
      if (at <= 0) throw new Error("descriptor line " + (i + 1) + ": expected key=value, got “" + p + "”");
      return [p.slice(0, at).trim(), p.slice(at + 1).trim()];
    });
    out.push({ entries, hits_addend: hits });
  });
  if (!out.length) throw new Error("give at least one descriptor");
  return out;
}

function explainBody() {
  if (mode() === "rls") {
    return { domain: $("#x-domain").value.trim(), descriptors: parseDescriptors($("#x-descriptors").value) };
  }
  const body = {
    method: $("#x-method").value.trim(),
    path: $("#x-path").value,
    headers: parseHeaders($("#x-headers").value),
    client: $("#x-client").value.trim(),
  };
  const host = $("#x-host").value.trim();
  if (host) body.host = host; // no host given: leave it out rather than send ""
  return body;
}

function showExplainError(msg) {
  const v = el("p", "error", msg);
  v.id = "explain-verdict";
  $("#explain-result").replaceChildren(v);
}

function windowLine(w) {
  let retry;
  if (w.never) retry = "never fits (cost above limit)";
  else if (w.retry_ms) retry = "retry in " + fmtSecs(w.retry_ms);
  else retry = "retry now";
  // A refusal the denial cache answers does not know the count, only what is left.
  const used = w.used === null || w.used === undefined ? "" : w.used + "/" + w.limit + ", ";
  return w.window + ": " + used + "remaining " + w.remaining +
    ", resets in " + fmtSecs(w.reset_ms) + ", " + retry;
}

function renderExplain(a) {
  const box = $("#explain-result");
  const v = el("p", "v-" + a.verdict);
  v.id = "explain-verdict";
  let text = a.verdict + " — status " + a.status;
  if (a.retry_after_ms !== null && a.retry_after_ms !== undefined) {
    text += " — retry after " + fmtMs(a.retry_after_ms) + " (" + a.retry_after_ms + " ms)";
  }
  if (a.from_denial_cache) text += " — as the denial cache answers it now";
  v.textContent = text;
  const parts = [v];
  if (a.store_error) parts.push(el("p", "store-error", "store error: " + a.store_error));
  const rules = a.rules || [];
  if (!rules.length) {
    parts.push(el("p", "empty", "no rule applies to this request"));
  } else {
    const table = el("table", "explain-table");
    const head = el("tr");
    for (const h of ["rule", "counter", "cost", "windows", "verdict"]) head.append(el("th", h === "cost" ? "num" : "", h));
    table.append(el("thead"));
    table.tHead.append(head);
    const tbody = el("tbody");
    for (const r of rules) {
      const tr = el("tr", "explain-row" + (r.would_refuse ? " refuses" : ""));
      tr.setAttribute("data-rule", r.rule);
      const name = el("td");
      name.append(el("span", "rule-name", r.rule));
      if (r.shadow) name.append(el("span", "badge shadow", "shadow"));
      if (r.quota) name.append(el("span", "badge quota", "quota"));
      name.append(el("div", "sub", [r.id && r.id !== r.rule ? "id " + r.id : "", r.domain].filter(Boolean).join(" · ")));
      const hasValues = r.values && r.values.length;
      const counter = el("td", "who");
      setValues(counter, hasValues ? r.values : [], r.counter);
      const wins = el("td", "windows");
      const lines = (r.windows || []).map(windowLine);
      // No windows: the store did not answer (the failure mode decides), or
      // the rule counts nothing.
      const none = r.failure_mode ? "store unavailable: fails " + r.failure_mode : "unlimited";
      wins.append(...(lines.length ? lines : [none]).map((l) => el("div", "line", l)));
      const verdict = el("td");
      if (r.would_refuse) verdict.append(el("span", "badge refuse", r.shadow ? "would refuse (shadow)" : "would refuse"));
      else verdict.append(el("span", "sub", r.failure_mode ? "passes (fails open)" : "passes"));
      tr.append(name, counter, el("td", "num", r.cost), wins, verdict);
      tbody.append(tr);
    }
    table.append(tbody);
    const wrap = el("div", "table-wrap");
    wrap.append(table);
    parts.push(wrap);
  }
  parts.push(el("p", "note", "Dry run: nothing is charged."));
  box.replaceChildren(...parts);
}

form.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  let body;
  try { body = explainBody(); } catch (e) { showExplainError(e.message); return; }
  const btn = $("#x-submit");
  btn.disabled = true;
  $("#explain-result").replaceChildren(); // an old answer must not pass for the new one
  try {
    const res = await api("api/explain", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (res.status === 401) { needToken(); showExplainError("admin token required"); return; }
    let data = null;
    try { data = await res.json(); } catch (e) { /* not JSON: reported below */ }
    if (res.ok && data) renderExplain(data);
    else if (data && data.error) showExplainError((res.status === 400 ? "" : "HTTP " + res.status + ": ") + data.error);
    else showExplainError("tollgate answered HTTP " + res.status);
  } catch (e) {
    showExplainError("tollgate unreachable");
  } finally {
    btn.disabled = false;
  }
});

poll();
