#!/usr/bin/env node
// The stream-capacity load generator (benchmarks/streams.py): N chat clients, each holding one
// streamed /v1/chat/completions request open on its own connection.
//
//   node benchmarks/sse_client.js --url http://127.0.0.1:PORT --model M [--key K]
//        [--streams 1000] [--ramp 2] [--events 400] [--rate 20] [--grace 60]
//
// The streams are opened evenly over --ramp seconds. Each SSE event (`\n\n`-terminated) is
// stamped when the socket read that completed it returns. The upstream (sse_upstream.js) numbers
// its events ("tok<seq> "), so every stream is checked: all --events events, in order, none
// twice, then "data: [DONE]". Prints one line, `SSEJSON {...}`: streams intact, lost and
// out-of-order events, reads that completed more than one event, time to first event, gaps
// between events, and events delivered per second while every stream should be open.
// Node (one process, no per-event allocation beyond the socket's own buffers) keeps the load
// generator's CPU small next to the proxies it measures.
"use strict";

const http = require("http");
const { performance } = require("perf_hooks");

function arg(name, dflt) {
  const i = process.argv.indexOf(name);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : dflt;
}

const url = new URL(arg("--url", "http://127.0.0.1:8080"));
const MODEL = arg("--model", "sse");
const KEY = arg("--key", "");
const N = Number(arg("--streams", "100"));
const RAMP = Number(arg("--ramp", "2"));
const EVENTS = Number(arg("--events", "400"));
const RATE = Number(arg("--rate", "20"));
const GRACE = Number(arg("--grace", "60"));
const DURATION = EVENTS / RATE;

const body = JSON.stringify({
  model: MODEL,
  messages: [{ role: "user", content: "Tell me a long story" }],
  stream: true,
  max_tokens: EVENTS,
});
const headers = { "content-type": "application/json", "content-length": Buffer.byteLength(body) };
if (KEY) headers.authorization = `Bearer ${KEY}`;
const agent = new http.Agent({ keepAlive: false, maxSockets: Infinity });
const SEQ = /"content":"tok(\d+) "/;

const streams = [];
let finished = 0;
let t0 = 0;

function open(i) {
  const s = {
    sent: performance.now(), status: 0, times: new Float64Array(EVENTS), got: 0, expect: 0,
    disorder: 0, merged: 0, reads: 0, done: false, error: null, pending: "", closed: false,
  };
  streams[i] = s;
  const req = http.request({
    agent, host: url.hostname, port: url.port, path: "/v1/chat/completions", method: "POST",
    headers,
  });
  req.on("response", (res) => {
    s.status = res.statusCode;
    res.on("data", (chunk) => {
      const now = performance.now();
      s.reads += 1;
      let buf = s.pending + chunk.toString("latin1");
      let numbered = 0;
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, at);
        buf = buf.slice(at + 2);
        if (ev === "data: [DONE]") {
          s.done = true;
          continue;
        }
        const m = SEQ.exec(ev);
        if (m === null || s.status !== 200) {
          if (s.status === 200) s.disorder += 1;
          continue;
        }
        const seq = Number(m[1]);
        if (seq !== s.expect) s.disorder += 1;
        s.expect = seq + 1;
        if (s.got < EVENTS) s.times[s.got] = now;
        s.got += 1;
        numbered += 1;
      }
      s.pending = buf;
      if (numbered > 1) s.merged += 1;
    });
    res.on("end", () => finish(s));
    res.on("error", (e) => finish(s, e));
  });
  req.on("error", (e) => finish(s, e));
  req.end(body);
}

function finish(s, err) {
  if (s.closed) return;
  s.closed = true;
  if (err && !s.error) s.error = err.code || err.message;
  finished += 1;
  if (finished === N) report();
}

function pct(sorted, p) {
  if (sorted.length === 0) return null;
  const k = Math.max(0, Math.min(sorted.length - 1, Math.round((p / 100) * (sorted.length - 1))));
  return sorted[k];
}

let reported = false;
function report() {
  if (reported) return;
  reported = true;
  const end = performance.now();
  let total = 0;
  for (const s of streams) total += s ? Math.min(s.got, EVENTS) : 0;
  const gaps = new Float64Array(total);
  const ttfe = [];
  let g = 0;
  let intact = 0, lost = 0, disorder = 0, merged = 0, reads = 0, extra = 0;
  const errors = {};
  // Events delivered while every stream should be open: from the end of the ramp (+0.5 s)
  // until the first stream would have ended (-0.5 s).
  const w0 = t0 + RAMP * 1000 + 500;
  const w1 = t0 + DURATION * 1000 - 500;
  let inWindow = 0;
  const perSecond = new Array(Math.ceil(RAMP + DURATION + GRACE)).fill(0);
  for (const s of streams) {
    if (!s) continue;
    const got = Math.min(s.got, EVENTS);
    extra += s.got - got;
    lost += EVENTS - got;
    disorder += s.disorder;
    merged += s.merged;
    reads += s.reads;
    if (s.status === 200 && s.got === EVENTS && s.done && s.disorder === 0 && !s.error) intact += 1;
    if (s.error || s.status !== 200) {
      const kind = s.error || `HTTP ${s.status}`;
      errors[kind] = (errors[kind] || 0) + 1;
    }
    if (got > 0) ttfe.push(s.times[0] - s.sent);
    for (let j = 0; j < got; j++) {
      const t = s.times[j];
      if (j > 0 && g < gaps.length) gaps[g++] = t - s.times[j - 1];
      if (t >= w0 && t < w1) inWindow += 1;
      const sec = Math.floor((t - t0) / 1000);
      if (sec >= 0 && sec < perSecond.length) perSecond[sec] += 1;
    }
  }
  // The slowest first event among the streams opened in each tenth of the ramp.
  const ttfeByRamp = new Array(10).fill(0);
  for (const s of streams) {
    if (!s || s.got === 0) continue;
    const slot = Math.min(9, Math.floor(((s.sent - t0) / (RAMP * 1000)) * 10));
    ttfeByRamp[slot] = Math.max(ttfeByRamp[slot], s.times[0] - s.sent);
  }
  ttfe.sort((a, b) => a - b);
  const gs = gaps.subarray(0, g).sort();
  const windowS = Math.max(0.001, (w1 - w0) / 1000);
  const out = {
    streams: N, ramp_s: RAMP, events_per_stream: EVENTS, rate: RATE,
    intact, lost, extra, disorder, merged_reads: merged, reads, events: total,
    errors,
    ttfe_p50_ms: pct(ttfe, 50), ttfe_p99_ms: pct(ttfe, 99), ttfe_max_ms: pct(ttfe, 100),
    gap_p50_ms: pct(gs, 50), gap_p99_ms: pct(gs, 99), gap_max_ms: pct(gs, 100),
    offered_eps: N * RATE, delivered_eps: inWindow / windowS, window_s: windowS,
    per_second: perSecond.slice(0, Math.ceil((end - t0) / 1000)),
    ttfe_max_by_ramp_tenth_ms: ttfeByRamp.map((x) => Math.round(x)),
    wall_s: (end - t0) / 1000,
  };
  process.stdout.write(`SSEJSON ${JSON.stringify(out)}\n`);
  process.exit(0);
}

t0 = performance.now();
for (let i = 0; i < N; i++) {
  setTimeout(() => open(i), (i * RAMP * 1000) / N);
}
setTimeout(() => {
  for (const s of streams) if (s && !s.closed) { s.error = s.error || "timeout"; }
  report();
}, (RAMP + DURATION + GRACE) * 1000).unref();
