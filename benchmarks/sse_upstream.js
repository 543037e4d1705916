#!/usr/bin/env node
// An efficient streaming "engine" for the stream-capacity benchmark (benchmarks/streams.py).
//
// vllm-proxy only forwards to engines it starts, so the benchmark configures this script as the
// engine command of one model; the proxy runs it like vLLM (--model M --served-model-name N
// --host H --port P). nginx proxy_pass is then pointed at the very same process.
//
//   GET  /health                 200 (the proxy's readiness probe)
//   GET  /v1/models              the one served model
//   POST /v1/chat/completions    "stream": true  -> SSE, `max_tokens` chunk events (default 400)
//                                                   on one shared ticker (SSE_RATE per second,
//                                                   default 20), then "data: [DONE]";
//                                otherwise       -> one small chat.completion
//
// Every stream is written by one setInterval ticker for the whole process, so N streams cost N
// socket writes per tick and nothing else. Each event carries its sequence number in its
// content ("tok<seq> "), which lets the client check that none was lost, duplicated or merged.
// A request body over 1 MB is read to its end but not parsed (the large-body benchmark times
// the proxy, not this server's JSON parser): it gets the small non-streamed answer.
"use strict";

const http = require("http");

function arg(name, dflt) {
  const i = process.argv.indexOf(name);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : dflt;
}

const HOST = arg("--host", "127.0.0.1");
const PORT = Number(arg("--port", "0"));
const MODEL = arg("--served-model-name", arg("--model", "sse"));
const RATE = Number(process.env.SSE_RATE || "20");
const DEFAULT_EVENTS = Number(process.env.SSE_EVENTS || "400");
const PARSE_LIMIT = 1 << 20;

let seq = 0;
const streams = new Set();
let ticker = null;

function head(id, created) {
  return `data: {"id":"chatcmpl-${id}","object":"chat.completion.chunk","created":${created},` +
    `"model":${JSON.stringify(MODEL)},"choices":[{"index":0,`;
}

function event(s) {
  const n = s.sent;
  const last = n === s.total - 1;
  const delta = n === 0
    ? `"delta":{"role":"assistant","content":"tok0 "}`
    : `"delta":{"content":"tok${n} "}`;
  const reason = last ? '"stop","stop_reason":null' : "null";
  let tail = "}]";
  if (last) {
    tail += `,"usage":{"prompt_tokens":7,"total_tokens":${7 + s.total},` +
      `"completion_tokens":${s.total}}`;
  }
  return `${s.head}${delta},"logprobs":null,"finish_reason":${reason}${tail}}\n\n`;
}

function tick() {
  for (const s of streams) {
    if (s.res.destroyed) {
      streams.delete(s);
      continue;
    }
    s.res.write(event(s));
    s.sent += 1;
    if (s.sent >= s.total) {
      s.res.end("data: [DONE]\n\n");
      streams.delete(s);
    }
  }
  if (streams.size === 0 && ticker !== null) {
    clearInterval(ticker);
    ticker = null;
  }
}

function startStream(res, total) {
  seq += 1;
  res.writeHead(200, { "content-type": "text/event-stream; charset=utf-8" });
  const s = { res, total, sent: 0, head: head(seq.toString(16), Math.floor(Date.now() / 1000)) };
  streams.add(s);
  res.on("close", () => streams.delete(s));
  if (ticker === null) ticker = setInterval(tick, 1000 / RATE);
}

function completion(res, promptBytes) {
  seq += 1;
  const body = JSON.stringify({
    id: `chatcmpl-${seq.toString(16)}`,
    object: "chat.completion",
    created: Math.floor(Date.now() / 1000),
    model: MODEL,
    choices: [{
      index: 0,
      message: { role: "assistant", content: "ok" },
      finish_reason: "stop",
    }],
    usage: { prompt_tokens: promptBytes, completion_tokens: 1, total_tokens: promptBytes + 1 },
  });
  res.writeHead(200, { "content-type": "application/json", "content-length": Buffer.byteLength(body) });
  res.end(body);
}

const server = http.createServer({ keepAliveTimeout: 60000, noDelay: true }, (req, res) => {
  if (req.method === "GET") {
    if (req.url === "/health") {
      res.writeHead(200);
      res.end();
    } else if (req.url === "/v1/models") {
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ object: "list", data: [{ id: MODEL, object: "model" }] }));
    } else {
      res.writeHead(404);
      res.end();
    }
    return;
  }
  const parts = [];
  let size = 0;
  req.on("data", (c) => {
    size += c.length;
    if (size <= PARSE_LIMIT) parts.push(c);
  });
  req.on("end", () => {
    let body = {};
    if (size <= PARSE_LIMIT) {
      try {
        body = JSON.parse(Buffer.concat(parts).toString("utf8"));
      } catch (e) {
        res.writeHead(400, { "content-type": "application/json" });
        res.end(JSON.stringify({ error: { message: `bad JSON: ${e.message}` } }));
        return;
      }
    }
    if (body && body.stream === true) {
      startStream(res, Number(body.max_tokens) > 0 ? Number(body.max_tokens) : DEFAULT_EVENTS);
    } else {
      completion(res, size);
    }
  });
});
server.headersTimeout = 60000;
server.requestTimeout = 0;
server.maxHeadersCount = 0;
server.listen({ host: HOST, port: PORT, backlog: 4096 }, () => {
  console.log(`sse_upstream: ${MODEL} on ${HOST}:${server.address().port}, ${RATE} events/s`);
});
for (const sig of ["SIGTERM", "SIGINT"]) {
  process.on(sig, () => process.exit(0));
}
