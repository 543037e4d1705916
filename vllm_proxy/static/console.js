// The vllm-proxy operator console. Served as a file of its own under a Content-Security-Policy
// that allows no inline script: every handler is bound here, and every name, message and log
// line reaches the page as text (textContent, or a Text node through `el`), never as HTML.
"use strict";

const KEY_STORE = "vllm-proxy-admin-key";
const RETRY_MS = 2000;
const MAX_REQUEST_ROWS = 200;
const MAX_LOG_CHARS = 200000;
const HISTORY_REFRESH_MS = 10000;
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

const ui = {
  clockOffset: 0,
  // Whether the admin API answered us: actions are offered only then.
  authorized: false,
  data: null,
  stream: null,
  retry: null,
  busy: new Set(),
  requests: [],
  log: null,
  history: null,
  historyTimer: null,
  playground: null,
  pendingConfirm: null,
};

// -- helpers ----------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v; else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function key() { return sessionStorage.getItem(KEY_STORE) || ""; }

function headers(extra) {
  const h = { ...(extra || {}) };
  if (key()) h.Authorization = `Bearer ${key()}`;
  return h;
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.max(0, Math.floor(s));
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600);
  const m = Math.floor(s % 3600 / 60), sec = s % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${sec}s`;
  return `${sec}s`;
}

function secs(v) {
  if (v === null || v === undefined) return "–";
  return v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`;
}

function ago(epoch) {
  if (!epoch) return "never";
  return `${duration((Date.now() + ui.clockOffset) / 1000 - epoch)} ago`;
}

function clock(epoch) { return new Date(epoch * 1000 - ui.clockOffset).toLocaleTimeString(); }

function mib(v) {
  if (v === null || v === undefined) return "–";
  return v >= 10240 ? `${(v / 1024).toFixed(1)} GiB` : `${Math.round(v)} MiB`;
}

function showBanner(text, cls) {
  const b = $("banner");
  b.textContent = text;
  b.className = text ? `banner ${cls || ""}` : "banner hidden";
}

function notify(text, kind) {
  const n = $("notice");
  n.textContent = text;
  n.className = text ? `notice ${kind || ""}` : "notice hidden";
  n.dataset.kind = kind || "ok";
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return body.error?.message || `HTTP ${resp.status}`;
  } catch {
    return `HTTP ${resp.status} ${resp.statusText}`;
  }
}

// -- the key ----------------------------------------------------------------------------------

function setAuthorized(ok, status) {
  ui.authorized = ok;
  for (const node of document.querySelectorAll(".admin-only")) node.classList.toggle("hidden", !ok);
  $("reload-config").classList.toggle("hidden", !ok);
  $("forget-key").classList.toggle("hidden", !key());
  $("who").textContent = ok ? (key() ? "admin key given" : "admin API open") : "";
  if (!ok) {
    $("auth-msg").textContent = key()
      ? `The admin key was refused (HTTP ${status}).`
      : "The admin API needs a key.";
    $("auth").classList.remove("hidden");
    $("models").replaceChildren();
    stopLog();
  } else {
    $("auth").classList.add("hidden");
  }
  document.body.dataset.authorized = ok ? "true" : "false";
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const v = $("key-input").value.trim();
  if (v) sessionStorage.setItem(KEY_STORE, v); else sessionStorage.removeItem(KEY_STORE);
  $("key-input").value = "";
  reconnect();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORE);
  reconnect();
});

// -- GPUs and the memory chart ----------------------------------------------------------------

function renderGpus(gpus, mode) {
  const box = $("gpus");
  box.replaceChildren();
  if (!gpus.length) {
    box.append(el("div", { class: "muted" },
      mode === "none" ? "GPU memory is not managed." : "No GPU reported."));
    return;
  }
  for (const g of gpus) {
    const pct = g.total_mb ? Math.min(100, 100 * g.used_mb / g.total_mb) : 0;
    const level = pct >= 95 ? "crit" : pct >= 80 ? "warn" : "";
    const util = g.util_percent === null || g.util_percent === undefined
      ? "" : `util ${Math.round(g.util_percent)}%`;
    const fill = el("div", {});
    fill.style.width = `${pct.toFixed(1)}%`;  // CSSOM: allowed by the policy, unlike style=""
    box.append(el("div", { class: "gpu", "data-gpu": g.id },
      el("div", { class: "gpu-label" },
        el("b", {}, `GPU ${g.id}`),
        el("span", { class: "gpu-text" },
          `${mib(g.used_mb)} / ${mib(g.total_mb)} (${pct.toFixed(0)}%)`)),
      el("div", { class: `bar ${level}`, role: "meter", "aria-valuemin": 0,
                  "aria-valuemax": g.total_mb, "aria-valuenow": g.used_mb }, fill),
      el("div", { class: "gpu-foot" }, el("span", {}, `${mib(g.free_mb)} free`),
        el("span", {}, util))));
  }
}

const colours = new Map();
function colour(name) {
  if (!colours.has(name)) colours.set(name, `c${colours.size % 8}`);
  return colours.get(name);
}

// Memory changes in steps (a start, a sleep): each sample's value holds until the next one,
// and the last one until now.
function steps(samples, value, x, y) {
  const pts = [];
  let prev = null;
  for (const s of samples) {
    const v = value(s);
    if (prev !== null) pts.push(`${x(s.t).toFixed(1)},${y(prev).toFixed(1)}`);
    pts.push(`${x(s.t).toFixed(1)},${y(v).toFixed(1)}`);
    prev = v;
  }
  if (prev !== null) pts.push(`${x(Date.now() / 1000 + ui.clockOffset / 1000).toFixed(1)},${y(prev).toFixed(1)}`);
  return pts.join(" ");
}

// Drawn here rather than with a charting library: a few polylines and markers per device are
// less code than a library's adapter, and nothing has to be vendored or kept up to date.
function renderChart() {
  const box = $("chart"), legend = $("legend");
  const h = ui.history;
  if (!h || !h.samples.length) { box.replaceChildren(); legend.replaceChildren(); return; }
  const W = 1000, H = 180, L = 44, R = 8, T = 8, B = 18;
  const now = Date.now() / 1000 + ui.clockOffset / 1000;
  const t0 = Math.max(h.samples[0].t, now - h.window_s), span = Math.max(60, now - t0);
  const x = (t) => L + (W - L - R) * (t - t0) / span;
  const devices = [...new Set(h.samples.flatMap((s) => s.gpus.map((g) => g.id)))];
  const charts = [];
  const names = new Set();
  for (const dev of devices) {
    const total = Math.max(1, ...h.samples.map((s) => s.gpus.find((g) => g.id === dev)?.total_mb || 0));
    const y = (mb) => T + (H - T - B) * (1 - mb / total);
    const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
                           role: "img", "data-chart-gpu": dev });
    g.append(svg("title", {}, `GPU ${dev}: memory per model over the last hour`));
    g.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: y(0), y2: y(0) }));
    g.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: y(total), y2: y(total) }));
    g.append(svg("text", { x: 2, y: y(total) + 10 }, mib(total)));
    g.append(svg("text", { x: 2, y: y(0) }, "0"));
    g.append(svg("text", { x: L, y: H - 4 }, clock(t0)));
    g.append(svg("text", { x: W - R - 50, y: H - 4 }, "now"));
    const used = steps(h.samples, (s) => s.gpus.find((gg) => gg.id === dev)?.used_mb || 0, x, y);
    g.append(svg("polyline", { class: "used", points: used },
      svg("title", {}, "used on the device")));
    const models = new Set(h.samples.flatMap((s) =>
      Object.keys(s.gpus.find((gg) => gg.id === dev)?.models || {})));
    for (const name of models) {
      names.add(name);
      for (const kind of ["awake", "asleep"]) {
        const pts = steps(h.samples,
          (s) => s.gpus.find((gg) => gg.id === dev)?.models?.[name]?.[kind] || 0, x, y);
        if (!h.samples.some((s) => s.gpus.find((gg) => gg.id === dev)?.models?.[name]?.[kind])) continue;
        g.append(svg("polyline", { class: `${kind} ${colour(name)}`, points: pts },
          svg("title", {}, `${name} (${kind})`)));
      }
    }
    for (const e of h.events) {
      if (e.t < t0) continue;
      const label = `${clock(e.t)} ${e.instance}: ${e.old} → ${e.new}${e.reason ? ` (${e.reason})` : ""}`;
      const mark = svg("g", { class: "event", "data-event": e.new });
      mark.append(svg("line", { class: "ev", x1: x(e.t), x2: x(e.t), y1: T, y2: H - B }));
      mark.append(svg("line", { class: "ev-hit", x1: x(e.t), x2: x(e.t), y1: T, y2: H - B }));
      mark.append(svg("title", {}, label));
      g.append(mark);
    }
    charts.push(g);
  }
  box.replaceChildren(...charts);
  legend.replaceChildren(...[...names].map((n) =>
    el("span", {}, el("i", { class: colour(n) }), n)),
    el("span", {}, "solid: awake · dashed: asleep · vertical marks: starts, sleeps, wakes, stops (hover)"));
}

async function loadHistory() {
  if (!ui.authorized) return;
  try {
    const resp = await fetch("admin/history", { headers: headers(), cache: "no-store" });
    if (resp.ok) { ui.history = await resp.json(); renderChart(); }
  } catch { /* the stream's state shows the outage */ }
}

// -- models and their actions -----------------------------------------------------------------

const COLUMNS = 12;

function badge(state, level) {
  const text = state === "sleeping" && level ? `sleeping L${level}` : state;
  return el("span", { class: `badge s-${state}` }, text);
}

function phaseNote(i) {
  if (!i.phase || i.phase === i.state || i.phase === "new") return [];
  return [el("span", { class: "unit", "data-phase": i.phase }, i.phase.replace("_", " "))];
}

// Sleep levels a model no longer uses: its wakes from them kept failing the wake check
// (cleared with POST /admin/models/{name}/wake_check/clear).
function barredNote(m) {
  const levels = (m.wake_check && m.wake_check.barred_levels) || [];
  if (!levels.length) return [];
  const text = `no sleep L${levels.join(", L")}`;
  return [el("span", { class: "unit", "data-barred": levels.join(","),
                       title: "its wakes kept failing the wake check" }, text)];
}

function errorCell(text) {
  return text ? el("td", { class: "error", title: text }, text) : el("td", { class: "muted" }, "–");
}

function copyButton(text) {
  const b = el("button", { type: "button", title: `copy ${text}` }, "copy");
  b.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      b.textContent = "copied";
    } catch {
      const range = document.createRange();
      range.selectNodeContents(b.previousElementSibling);
      getSelection().removeAllRanges();
      getSelection().addRange(range);
    }
  });
  return b;
}

// What each action needs; the reason it cannot be taken now, or "" when it can.
function why(m, action, level) {
  const live = (m.instances || []).length > 0;
  if (m.removed) return "removed from the config: its instances drain";
  if (ui.busy.has(m.name)) return "an action on this model is under way";
  if (m.draining && action !== "stop") return "an unload is under way";
  const sleeps = m.sleep_levels || [];
  switch (action) {
    case "start":
      if (m.state === "running") return "already running";
      if (m.state === "sleeping") return "asleep: wake it";
      if (m.queue > 0) return `${m.queue} request(s) wait in the queue: a start is under way`;
      if (m.state === "starting" || m.state === "waking") return `already ${m.state}`;
      return "";
    case "sleep":
      if (!sleeps.length) return "no sleep policy (set sleep: {level: 1}; the CPU build cannot sleep)";
      if (!sleeps.includes(level)) return `level ${level} needs weights it can reload (load_format)`;
      if (m.pinned) return "pinned: unpin it first";
      if (m.state === "sleeping") return "already asleep";
      if (m.state !== "running") return `not running (${m.state})`;
      if (m.queue > 0) return `${m.queue} request(s) wait in the queue for it`;
      return "";
    case "wake":
      if (m.state !== "sleeping") return "not asleep";
      return "";
    case "stop":
    case "drain":
      if (!live) return "no engine runs";
      if (m.pinned) return "pinned: unpin it first";
      if (action === "drain" && m.state !== "running") return `not serving (${m.state})`;
      return "";
    default:
      return "";
  }
}

function actionButton(m, action, label, level) {
  const reason = why(m, action, level);
  const attrs = { type: "button", "data-action": action, "data-model": m.name,
                  "data-level": level || null, disabled: !!reason,
                  title: reason || null, "data-reason": reason || null,
                  class: action === "stop" ? "danger" : null };
  return el("button", attrs, label);
}

function actionsCell(m) {
  const cell = el("td", { class: "actions-cell" });
  if (!ui.authorized || m.removed) return cell;
  const box = el("div", { class: "actions" },
    actionButton(m, "start", "start"));
  const levels = (m.sleep_levels || []).length ? m.sleep_levels : [1];
  for (const lv of levels) box.append(actionButton(m, "sleep", `sleep L${lv}`, lv));
  box.append(actionButton(m, "wake", "wake"), actionButton(m, "drain", "drain"),
    actionButton(m, "stop", "stop"),
    el("button", { type: "button", "data-action": m.pinned ? "unpin" : "pin", "data-model": m.name,
                   title: m.pinned ? "allow evicting it again" : "never evict it for memory" },
      m.pinned ? "unpin" : "pin"));
  cell.append(box);
  return cell;
}

function modelRow(m) {
  const name = el("td", {}, el("b", {}, m.name));
  if (m.removed) {
    name.append(el("span", { class: "tag removed",
      title: "removed from the config by a reload: not routable, its instances drain" },
      "removed"));
  }
  if (m.pinned) name.append(el("span", { class: "tag", title: "never evicted" }, "pinned"));
  if (m.draining) {
    name.append(el("span", { class: "tag drain", title: "unloading: no new requests" },
      "draining"));
  }
  name.append(el("span", { class: "aliases", title: m.model },
    [m.model, ...(m.aliases || [])].join(" · ")));
  const mem = m.memory;
  const memCell = mem && mem.estimate_mb !== null && mem.estimate_mb !== undefined
    ? el("td", { title: `planned ${mib(mem.planned_mb)} · source: ${mem.source ?? "–"}` },
      mib(mem.estimate_mb), el("span", { class: "unit" }, "est"))
    : el("td", { class: "muted" }, "–");
  return el("tr", { class: "model", "data-key": `m:${m.name}`, "data-model": m.name,
                    "data-state": m.state, "data-removed": m.removed ? "true" : null },
    name,
    el("td", {}, badge(m.state), ...barredNote(m)),
    el("td", {}), el("td", {}),
    memCell,
    el("td", { class: "num" }, m.leases),
    el("td", { class: "num" }, m.queue),
    el("td", {}, ago(m.last_used)),
    el("td", {}),
    el("td", { class: "num" }, m.restarts),
    errorCell(m.last_error),
    actionsCell(m));
}

function urlRow(m) {
  const urls = m.base_urls || {};
  const cell = el("td", { colspan: COLUMNS }, "OpenAI base URL ");
  for (const [k, label] of [["v1", `(model: "${m.name}")`], ["serve", ""]]) {
    if (!urls[k]) continue;
    cell.append(el("span", { class: "url", "data-url": k },
      el("code", {}, urls[k]), copyButton(urls[k]), label));
  }
  return el("tr", { class: "urls", "data-key": `u:${m.name}`, "data-urls": m.name }, cell);
}

function adapterRow(m) {
  const cell = el("td", { colspan: COLUMNS }, `LoRA adapters (max ${m.max_adapters} per engine) `);
  for (const a of m.adapters || []) {
    const held = Object.entries(a.instances || {});
    const where = held.map(([iid, st]) => (st === "loaded" ? iid : `${iid} ${st}`)).join(", ");
    cell.append(el("span", { class: "adapter", "data-adapter": a.name, title: a.path },
      el("code", {}, a.name), ` ${where ? "on " + where : "not loaded"}`,
      (a.aliases || []).length ? ` (${a.aliases.join(", ")})` : "", "; "));
  }
  if (m.adapters_dir) cell.append(el("span", { class: "muted" }, `+ folder ${m.adapters_dir}`));
  return el("tr", { class: "adapters", "data-key": `a:${m.name}`, "data-adapters": m.name }, cell);
}

function instanceRow(m, i, ended) {
  const id = el("td", {}, el("span", { class: "iid" }, i.id));
  if (ended) id.append(el("span", { class: "tag", title: "the last instance that ended" }, "ended"));
  if (i.retired && !ended) {
    id.append(el("span", { class: "tag drain",
      title: "replaced or removed by a reload: takes no new requests, stops when they finish" },
      "draining"));
  }
  const mem = i.memory;
  const memCell = mem && mem.measured_mb !== null && mem.measured_mb !== undefined
    ? el("td", { title: `measured from ${mem.measured_from ?? "–"}` },
      mib(mem.measured_mb), el("span", { class: "unit" }, "meas"))
    : el("td", { class: "muted" }, "–");
  const cls = ["instance", i.retired ? "retired" : "", ended ? "ended" : ""].join(" ").trim();
  const acts = el("td", { class: "iact" });
  if (ui.authorized) {
    acts.append(el("button", { type: "button", "data-action": "logs", "data-log": i.id,
                               title: "show this instance's log below" }, "logs"));
  }
  return el("tr", { class: cls, "data-key": `i:${i.id}`, "data-instance": i.id,
                    "data-state": i.state,
                    "data-retired": i.retired ? "true" : null },
    id,
    el("td", {}, badge(i.state, i.sleep_level), ...phaseNote(i)),
    el("td", {}, i.pid || i.port || i.socket
        ? `${i.pid ?? "–"} : ${i.port ?? (i.socket ? i.socket.split("/").pop() : "–")}` : "–"),
    el("td", {}, i.devices && i.devices.length ? i.devices.join(", ") : "–"),
    memCell,
    el("td", { class: "num" }, i.leases),
    el("td", {}),
    el("td", {}, ago(i.last_used)),
    el("td", {}, i.state === "running" ? duration(i.uptime_s) : "–"),
    el("td", {}),
    errorCell(i.last_error),
    acts);
}

function modelRows(m) {
  const rows = [modelRow(m)];
  if (!m.removed) rows.push(urlRow(m));
  if (m.max_adapters) rows.push(adapterRow(m));
  const live = m.instances || [];
  for (const i of live) rows.push(instanceRow(m, i, false));
  const last = m.last_instance;
  if (last && (!live.length || last.state === "error")) rows.push(instanceRow(m, last, true));
  if (!live.length && !last) {
    rows.push(el("tr", { class: "instance", "data-key": `n:${m.name}` },
      el("td", { colspan: COLUMNS, class: "muted" },
        "no engine yet: the first request starts one")));
  }
  rows[rows.length - 1].classList.add("end");
  return rows;
}

// Rows are keyed and only replaced when they changed, so a base URL being selected or copied
// survives the next update.
function patchRows(body, rows) {
  const keys = new Set(rows.map((r) => r.dataset.key));
  const old = new Map([...body.children].map((r) => [r.dataset.key, r]));
  let cursor = body.firstElementChild;
  for (const row of rows) {
    while (cursor && !keys.has(cursor.dataset.key)) {
      const gone = cursor;
      cursor = cursor.nextElementSibling;
      gone.remove();
    }
    if (cursor && cursor.dataset.key === row.dataset.key) {
      const next = cursor.nextElementSibling;
      if (!cursor.isEqualNode(row)) patchRow(cursor, row);
      cursor = next;
      continue;
    }
    const prev = old.get(row.dataset.key);
    body.insertBefore(prev && prev.isEqualNode(row) ? prev : row, cursor);
  }
  while (cursor) {
    const next = cursor.nextElementSibling;
    cursor.remove();
    cursor = next;
  }
}

// A changed row keeps its cells that did not change: a button under the pointer is not
// replaced by the clock ticking in another cell (a click would miss it).
function patchRow(old, row) {
  if (old.cells.length !== row.cells.length || old.className !== row.className) {
    old.replaceWith(row);
    return;
  }
  for (const a of [...old.attributes]) if (!row.hasAttribute(a.name)) old.removeAttribute(a.name);
  for (const a of [...row.attributes]) old.setAttribute(a.name, a.value);
  const fresh = [...row.cells];
  [...old.cells].forEach((cell, i) => { if (!cell.isEqualNode(fresh[i])) cell.replaceWith(fresh[i]); });
}

function renderModels(models) {
  const rows = models.flatMap(modelRows);
  if (!rows.length) {
    rows.push(el("tr", { "data-key": "none" },
      el("td", { colspan: COLUMNS, class: "muted" }, "No models configured.")));
  }
  patchRows($("models"), rows);
}

function fillSelect(select, values, keepFirst) {
  const current = select.value;
  const fixed = keepFirst ? [select.options[0]] : [];
  const wanted = values.join("\n");
  const have = [...select.options].slice(fixed.length).map((o) => o.value).join("\n");
  if (wanted === have) return;
  select.replaceChildren(...fixed, ...values.map((v) => el("option", { value: v }, v)));
  if ([...select.options].some((o) => o.value === current)) select.value = current;
}

function render(data) {
  ui.data = data;
  const p = data.proxy || {};
  $("version").textContent = p.version ?? "–";
  $("uptime").textContent = duration(p.uptime_s);
  $("memory-mode").textContent = p.memory ?? "–";
  const models = data.models || [];
  $("active").textContent = p.active_requests ?? models.reduce((n, m) => n + (m.leases || 0), 0);
  $("engines").textContent = models.reduce((n, m) => n + (m.instances || []).length, 0);
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  renderGpus(data.gpus || [], p.memory);
  renderModels(models);
  showBanner(p.closing ? "The proxy is shutting down: new requests are refused." : "", "closing");
  const names = models.filter((m) => !m.removed).map((m) => m.name);
  fillSelect($("pg-model"), names, false);
  fillSelect($("req-model"), names, true);
  const instances = models.flatMap((m) => [...(m.instances || []).map((i) => i.id),
    ...(m.last_instance && !(m.instances || []).some((i) => i.id === m.last_instance.id)
      ? [m.last_instance.id] : [])]);
  if (ui.log) instances.includes(ui.log.iid) || instances.push(ui.log.iid);
  fillSelect($("log-instance"), instances, false);
  if (ui.log) $("log-instance").value = ui.log.iid;
}

// -- actions ----------------------------------------------------------------------------------

const ROUTES = {
  start: (n) => `admin/models/${n}/load`,
  sleep: (n, lv) => `admin/models/${n}/sleep?level=${lv}`,
  wake: (n) => `admin/models/${n}/wake`,
  stop: (n) => `admin/models/${n}/stop`,
  drain: (n) => `admin/models/${n}/drain`,
  pin: (n) => `admin/models/${n}/pin`,
  unpin: (n) => `admin/models/${n}/unpin`,
};
const DOING = { start: "starting", sleep: "putting to sleep", wake: "waking", stop: "stopping",
                drain: "draining", pin: "pinning", unpin: "unpinning" };

async function act(action, name, level) {
  ui.busy.add(name);
  if (ui.data) render(ui.data);
  notify(`${name}: ${DOING[action]}…`, "busy");
  try {
    const url = ROUTES[action](encodeURIComponent(name), level);
    const resp = await fetch(url, { method: "POST", headers: headers(), cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) { setAuthorized(false, resp.status); return; }
    if (!resp.ok) { notify(`${name}: ${action} failed: ${await errorText(resp)}`, "err"); return; }
    const row = await resp.json();
    notify(`${name}: ${action} done, now ${row.state}`, "ok");
  } catch (e) {
    notify(`${name}: ${action} failed: ${e.message || e}`, "err");
  } finally {
    ui.busy.delete(name);
    if (ui.data) render(ui.data);
  }
}

function askFirst(text, then) {
  ui.pendingConfirm = then;
  $("confirm-msg").textContent = text;
  $("confirm").classList.remove("hidden");
  $("confirm-yes").focus();
}

$("confirm-yes").addEventListener("click", () => {
  const then = ui.pendingConfirm;
  ui.pendingConfirm = null;
  $("confirm").classList.add("hidden");
  if (then) then();
});
$("confirm-no").addEventListener("click", () => {
  ui.pendingConfirm = null;
  $("confirm").classList.add("hidden");
});

$("models").addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-action]");
  if (!b || b.disabled) return;
  const action = b.dataset.action;
  if (action === "logs") { openLog(b.dataset.log); return; }
  const name = b.dataset.model;
  const level = b.dataset.level ? Number(b.dataset.level) : undefined;
  const m = (ui.data?.models || []).find((x) => x.name === name);
  if (action === "stop" && m && m.state === "running") {
    const n = m.leases || 0;
    askFirst(`Stop ${name}? It serves${n ? ` ${n} request(s) now, which will be cut` : ""}.`,
      () => act(action, name, level));
    return;
  }
  act(action, name, level);
});

$("reload-config").addEventListener("click", async () => {
  notify("reloading the config…", "busy");
  try {
    const resp = await fetch("admin/reload", { method: "POST", headers: headers() });
    if (!resp.ok) { notify(`reload failed: ${await errorText(resp)}`, "err"); return; }
    const r = await resp.json();
    const parts = ["added", "removed", "restarted"].map((k) => `${k}: ${(r[k] || []).join(", ") || "none"}`);
    notify(`config reloaded; ${parts.join("; ")}`, "ok");
  } catch (e) {
    notify(`reload failed: ${e.message || e}`, "err");
  }
});

// -- the live stream --------------------------------------------------------------------------

// One fetch-read event stream (EventSource cannot send the Authorization header). A page left
// open keeps one connection and bounded state: the last snapshot, at most MAX_REQUEST_ROWS
// requests, the last hour of the chart, the log view's last MAX_LOG_CHARS.
async function connect() {
  const ctrl = new AbortController();
  ui.stream = ctrl;
  let resp;
  try {
    resp = await fetch(document.body.dataset.events, { headers: headers(), cache: "no-store",
                                                       signal: ctrl.signal });
  } catch (e) {
    if (ctrl.signal.aborted) return;
    return retryLater(`Status unavailable: ${e.message || e}. Retrying…`);
  }
  if (resp.status === 401 || resp.status === 403) { setAuthorized(false, resp.status); return; }
  if (!resp.ok) return retryLater(`Status unavailable: HTTP ${resp.status}. Retrying…`);
  const serverNow = Date.parse(resp.headers.get("Date") || "");
  ui.clockOffset = Number.isFinite(serverNow) ? serverNow - Date.now() : 0;
  setAuthorized(true);
  loadRequests();
  loadHistory();
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end + 2);
        let event = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("event: ")) event = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (data) onEvent(event, JSON.parse(data));
      }
    }
  } catch (e) {
    if (ctrl.signal.aborted) return;
  }
  if (!ctrl.signal.aborted) retryLater("The live stream ended. Reconnecting…");
}

function retryLater(text) {
  showBanner(text);
  $("updated").textContent = "disconnected";
  clearTimeout(ui.retry);
  ui.retry = setTimeout(connect, RETRY_MS);
}

function reconnect() {
  clearTimeout(ui.retry);
  if (ui.stream) ui.stream.abort();
  connect();
}

function onEvent(event, data) {
  if (event === "state") {
    if (typeof data.proxy?.now === "number") ui.clockOffset = data.proxy.now * 1000 - Date.now();
    render(data);
  } else if (event === "timeline") {
    clearTimeout(ui.historyTimer);
    ui.historyTimer = setTimeout(loadHistory, 500);
  } else if (event === "requests") {
    for (const r of data) ui.requests.unshift(r);
    ui.requests.length = Math.min(ui.requests.length, MAX_REQUEST_ROWS);
    renderRequests();
  }
}

setInterval(loadHistory, HISTORY_REFRESH_MS);

// -- recent requests --------------------------------------------------------------------------

async function loadRequests() {
  try {
    const resp = await fetch(`admin/requests?limit=${MAX_REQUEST_ROWS}`,
      { headers: headers(), cache: "no-store" });
    if (!resp.ok) return;
    const body = await resp.json();
    ui.requests = body.requests;
    renderCapture(body.capture);
    renderRequests();
  } catch { /* shown by the stream */ }
}

function matches(r) {
  const model = $("req-model").value, status = $("req-status").value;
  if (model && r.model !== model) return false;
  if (!status) return true;
  return status.endsWith("xx") ? String(r.status)[0] === status[0] : String(r.status) === status;
}

function renderRequests() {
  const rows = ui.requests.filter(matches).map((r) =>
    el("tr", { "data-rid": r.id, "data-model": r.model, "data-status": r.status },
      el("td", {}, clock(r.t)),
      el("td", { class: "rid" }, r.id),
      el("td", {}, r.model, r.captured ? el("span", { class: "tag" }, "captured") : ""),
      el("td", {}, r.key ?? "–"),
      el("td", {}, r.route),
      el("td", { class: `num st-${String(r.status)[0]}` }, r.status),
      el("td", { class: "num" }, secs(r.wait_s)),
      el("td", { class: "num" }, secs(r.ttft_s)),
      el("td", { class: "num" }, r.tokens_in ?? "–"),
      el("td", { class: "num" }, r.tokens_out ?? "–"),
      el("td", { class: "num" }, r.tokens_per_s ?? "–"),
      el("td", { class: "num" }, secs(r.duration_s))));
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: 12, class: "muted" }, "No requests yet.")));
  }
  $("requests").replaceChildren(...rows);
}

$("req-model").addEventListener("change", renderRequests);
$("req-status").addEventListener("change", renderRequests);

function renderCapture(cap) {
  const on = cap && cap.active;
  $("capture-state").replaceChildren(on
    ? el("span", { class: "capture-on", "data-capture": cap.model },
      `capturing ${cap.model}: ${cap.kept}/${cap.max_count} until ${clock(cap.until)}`)
    : "");
  $("capture-toggle").textContent = on ? "stop capture" : "capture bodies";
  $("capture-toggle").dataset.on = on ? "true" : "false";
}

$("capture-toggle").addEventListener("click", async () => {
  const on = $("capture-toggle").dataset.on === "true";
  const model = $("req-model").value;
  if (!on && !model) { notify("choose a model to capture the bodies of", "err"); return; }
  const url = on ? "admin/capture" : `admin/capture?model=${encodeURIComponent(model)}&seconds=300&count=20`;
  const resp = await fetch(url, { method: on ? "DELETE" : "POST", headers: headers() });
  if (!resp.ok) { notify(`capture: ${await errorText(resp)}`, "err"); return; }
  renderCapture((await resp.json()).capture);
});

// -- engine logs ------------------------------------------------------------------------------

function stopLog() {
  if (ui.log?.ctrl) ui.log.ctrl.abort();
  if (ui.log) ui.log.ctrl = null;
  $("log-state").textContent = "";
}

function appendLog(text) {
  const pre = $("log");
  pre.append(text);  // a Text node: a line carrying markup stays text
  if (pre.textContent.length > MAX_LOG_CHARS) pre.textContent = pre.textContent.slice(-MAX_LOG_CHARS / 2);
  pre.scrollTop = pre.scrollHeight;
}

function logUrl(iid, extra) {
  return `admin/instances/${encodeURIComponent(iid)}/log?${extra}`;
}

async function openLog(iid) {
  stopLog();
  ui.log = { iid, ctrl: null };
  fillSelect($("log-instance"), [...new Set([...[...$("log-instance").options].map((o) => o.value), iid])], false);
  $("log-instance").value = iid;
  $("log").textContent = "";
  $("log").dataset.instance = iid;
  const follow = $("log-follow").checked;
  const ctrl = new AbortController();
  ui.log.ctrl = ctrl;
  try {
    const resp = await fetch(logUrl(iid, `tail=200${follow ? "&follow=1" : ""}`),
      { headers: headers(), cache: "no-store", signal: ctrl.signal });
    if (!resp.ok) { $("log-state").textContent = await errorText(resp); return; }
    $("log-state").textContent = follow ? "following…" : "last 200 lines";
    $("log").dataset.following = follow ? "true" : "false";
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      appendLog(decoder.decode(value, { stream: true }));
    }
    if (follow) $("log-state").textContent = "the log stream ended";
  } catch (e) {
    if (!ctrl.signal.aborted) $("log-state").textContent = `log: ${e.message || e}`;
  } finally {
    $("log").dataset.following = "false";
  }
}

$("log-instance").addEventListener("change", () => openLog($("log-instance").value));
$("log-follow").addEventListener("change", () => { if ($("log-instance").value) openLog($("log-instance").value); });
$("log-refresh").addEventListener("click", () => { if ($("log-instance").value) openLog($("log-instance").value); });
$("log-download").addEventListener("click", async () => {
  const iid = $("log-instance").value;
  if (!iid) return;
  // Fetched with the key (a link could not send it), then saved from a blob URL.
  const resp = await fetch(logUrl(iid, "download=1"), { headers: headers() });
  if (!resp.ok) { notify(`download: ${await errorText(resp)}`, "err"); return; }
  const url = URL.createObjectURL(await resp.blob());
  const a = el("a", { href: url, download: `${iid.replace("#", "-")}.log` });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
});

// -- playground -------------------------------------------------------------------------------

// Through the proxy's own /v1 path with the operator's key, as any client: a model that is not
// running starts (or wakes) first, and the wait shows in the time to first token.
$("pg-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const model = $("pg-model").value;
  if (!model) return;
  const ctrl = new AbortController();
  ui.playground = ctrl;
  $("pg-send").disabled = true;
  $("pg-stop").disabled = false;
  const out = $("pg-out"), stats = $("pg-stats");
  out.textContent = "";
  out.dataset.done = "false";
  const m = (ui.data?.models || []).find((x) => x.name === model);
  const cold = m && m.state !== "running" ? ` (${m.state}: the first token waits for it)` : "";
  stats.textContent = `sending to ${model}${cold}…`;
  const t0 = performance.now();
  let first = null, chunks = 0, usage = null, loading = "";
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", signal: ctrl.signal, cache: "no-store",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model, stream: true, stream_options: { include_usage: true },
                             max_tokens: Number($("pg-max").value) || 64,
                             messages: [{ role: "user", content: $("pg-prompt").value }] }),
    });
    if (!resp.ok) { stats.textContent = `error: ${await errorText(resp)}`; return; }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, end).trim();
        buf = buf.slice(end + 2);
        if (!block.startsWith("data: ") || block === "data: [DONE]") continue;
        const chunk = JSON.parse(block.slice(6));
        if (chunk.error) { stats.textContent = `error: ${chunk.error.message}`; continue; }
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices?.[0]?.delta || {};
        if (delta.reasoning_content && String(chunk.id || "").startsWith("loading-")) {
          loading = delta.reasoning_content.trim();
          stats.textContent = loading;
          continue;
        }
        if (delta.content) {
          if (first === null) first = performance.now();
          chunks += 1;
          out.append(delta.content);
        }
      }
    }
    const end = performance.now();
    const tokens = usage?.completion_tokens ?? chunks;
    const gen = first !== null ? (end - first) / 1000 : 0;
    const tps = gen > 0 ? (tokens / gen).toFixed(1) : "–";
    stats.replaceChildren(
      el("span", {}, "TTFT ", el("b", { id: "pg-ttft" }, first !== null ? secs((first - t0) / 1000) : "–")),
      el("span", {}, " · tokens ", el("b", { id: "pg-tokens" }, tokens)),
      el("span", {}, " · ", el("b", { id: "pg-tps" }, tps), " tok/s"),
      el("span", {}, ` · total ${secs((end - t0) / 1000)}${loading ? " (cold start)" : ""}`));
    out.dataset.done = "true";
  } catch (e) {
    stats.textContent = ctrl.signal.aborted ? "stopped" : `error: ${e.message || e}`;
  } finally {
    $("pg-send").disabled = false;
    $("pg-stop").disabled = true;
    ui.playground = null;
  }
});

$("pg-stop").addEventListener("click", () => { if (ui.playground) ui.playground.abort(); });

// -- start ------------------------------------------------------------------------------------

setInterval(() => { if (ui.data) render(ui.data); }, 5000);  // "ago" and uptime columns
connect();
