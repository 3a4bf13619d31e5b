// The HTTP side: a node:http server speaking the worker protocol.

import { createHash, createHmac, timingSafeEqual } from "node:crypto";
import http from "node:http";
import { constants } from "node:os";

import { App, PROTOCOL, error } from "./app.js";

/** Requests older or newer than this (by their signature's time) are refused. */
export const SIGNATURE_TOLERANCE_S = 300;

/** Default of `serve`'s `drainTimeoutS` (the worker's --remote-timeout
 * bounds one call to 30 s by default). */
export const DRAIN_TIMEOUT_S = 30;

/** Exit code of a stop cut short: the drain timeout passed with requests
 * in flight. A second signal exits with 128 + its number. */
export const EXIT_DRAIN_TIMEOUT = 1;

/** What the worker signs: `<t>.<nonce>.<METHOD>.<path>.<body>`, so a
 * signature binds the endpoint and, with its nonce, one request. */
export function signedMessage(t, nonce, method, path, body) {
  return Buffer.concat([Buffer.from(`${t}.${nonce}.${method}.${path}.`), Buffer.from(body)]);
}

/** `X-Leasehold-Signature` of a request, as a worker signs it. */
export function sign(secret, t, nonce, method, path, body) {
  const mac = createHmac("sha256", secret).update(signedMessage(t, nonce, method, path, body)).digest("hex");
  return `t=${t},n=${nonce},v2=${mac}`;
}

/** Whether two strings are equal, in a time that depends on neither
 * (both are hashed first: not even their lengths show). */
export function constantTimeEqual(a, b) {
  const x = createHash("sha256").update(String(a)).digest();
  const y = createHash("sha256").update(String(b)).digest();
  return timingSafeEqual(x, y);
}

/** The nonces of signatures accepted within the tolerance window: a
 * request signed once is served once (this process's memory; entries leave
 * when their time is out of the window). */
export class Replays {
  constructor(toleranceS = SIGNATURE_TOLERANCE_S) {
    this.toleranceS = toleranceS;
    this._seen = new Map();
  }

  /** Records `nonce`; false when it was seen already. */
  firstTime(nonce, t, now) {
    for (const [n, until] of this._seen) {
      if (until >= now) break;
      this._seen.delete(n);
    }
    if (this._seen.has(nonce)) return false;
    this._seen.set(nonce, t + this.toleranceS);
    return true;
  }
}

/** Why the signature header (`t=<unix>,n=<nonce>,v2=<hex>`) does not sign
 * this request, or null when it does: HMAC-SHA256 of `signedMessage`, `t`
 * within 5 minutes, and (with `seen`) a nonce not served before. */
export function checkSignature(secret, header, body, opts = {}) {
  const { method = "POST", path = "/invoke", now = Date.now() / 1000, seen = null } = opts;
  if (!header) return "no X-Leasehold-Signature header";
  const parts = new Map();
  for (const p of String(header).split(",")) {
    const at = p.indexOf("=");
    if (at > 0) parts.set(p.slice(0, at).trim(), p.slice(at + 1).trim());
  }
  const ts = parts.get("t") ?? "";
  if (!/^[0-9]{1,15}$/.test(ts)) return "the signature has no time";
  const t = Number(ts);
  if (Math.abs(now - t) > SIGNATURE_TOLERANCE_S) return "the signature is too old or too new";
  const nonce = parts.get("n") ?? "";
  if (!nonce || !parts.has("v2")) {
    return "the signature does not bind the request (no n= and v2=): the worker is older than this service";
  }
  const want = createHmac("sha256", secret).update(signedMessage(ts, nonce, method, path, body)).digest("hex");
  if (!constantTimeEqual(want, parts.get("v2"))) return "the signature does not match the request (method, path and body)";
  if (seen && !seen.firstTime(nonce, t, now)) return "the signature was used before (a replayed request)";
  return null;
}

/** The request handler of `app` (for `http.createServer`, or a server of
 * yours): the worker protocol's endpoints and `GET /healthz`. */
export function handler(app, opts = {}) {
  if (!App.isApp(app)) throw new TypeError("handler: not a leasehold App");
  const token = opts.token || null;
  const secret = opts.hmacSecret || null;
  const maxBody = opts.maxBody ?? 1 << 20;
  const replays = opts.replays ?? new Replays();
  const stopping = opts.stopping ?? (() => false);
  const log = opts.logRequests ? (m) => process.stderr.write(m + "\n") : null;

  const send = (req, res, status, body, close = false) => {
    const data = Buffer.from(JSON.stringify(body));
    const headers = { "Content-Type": "application/json", "Content-Length": data.length };
    if (close || stopping()) headers.Connection = "close";
    res.writeHead(status, headers);
    res.end(data);
    if (log) log(`${req.method} ${req.url} ${status}`);
  };

  return (req, res) => {
    serveOne(req, res).catch((e) => {
      if (!res.headersSent) send(req, res, 500, error("internal", `the service failed: ${e?.message ?? e}`), true);
      else res.destroy();
    });
  };

  async function serveOne(req, res) {
    const path = req.url ?? "/";
    if (req.method === "GET") {
      if (path === "/healthz") {
        const kinds = [...app.kinds.keys()].sort();
        const tools = [...app.tools.keys()].sort();
        return send(req, res, 200, { protocol: PROTOCOL, kinds, tools });
      }
      return send(req, res, 404, error("not_found", path));
    }
    if (req.method !== "POST") return send(req, res, 405, error("method_not_allowed", `${req.method} ${path}`), true);
    const length = req.headers["content-length"];
    if (length === undefined || !/^[0-9]{1,15}$/.test(length)) {
      const why = length === undefined ? "a Content-Length is required" : "Content-Length must be a byte count";
      return send(req, res, 400, error("bad_request", why), true);
    }
    const n = Number(length);
    if (n > maxBody) return send(req, res, 413, error("request_too_large", `${n} bytes, the limit is ${maxBody}`), true);
    const raw = await readBody(req, n);
    if (raw === null) return send(req, res, 400, error("bad_request", "the body is not Content-Length bytes"), true);
    if (token !== null && !constantTimeEqual(req.headers.authorization ?? "", `Bearer ${token}`)) {
      return send(req, res, 401, error("unauthorized", "a bearer token is required"));
    }
    if (secret !== null) {
      const why = checkSignature(secret, req.headers["x-leasehold-signature"], raw, { method: "POST", path, seen: replays });
      if (why !== null) return send(req, res, 401, error("unauthorized", why));
    }
    let body;
    try {
      body = JSON.parse(raw.toString("utf8"));
    } catch (e) {
      return send(req, res, 400, error("bad_request", `not JSON: ${e.message}`));
    }
    if (body === null || typeof body !== "object" || Array.isArray(body)) {
      return send(req, res, 400, error("bad_request", "not JSON: the body is not an object"));
    }
    if (body.protocol !== PROTOCOL) {
      const out = error("unsupported_protocol", `this service speaks protocol ${PROTOCOL}, the request ${JSON.stringify(body.protocol ?? null)}`);
      out.error.supported = [PROTOCOL];
      return send(req, res, 400, out);
    }
    const [status, out] = await route(app, path, body);
    return send(req, res, status, out);
  }
}

async function route(app, rawPath, body) {
  const path = rawPath.split("?")[0].replace(/\/+$/, "");
  if (path === "/invoke") return app.invoke(body);
  if (path.startsWith("/tools/")) {
    let rest;
    try {
      rest = decodeURIComponent(path.slice("/tools/".length));
    } catch {
      return [400, error("bad_request", `not a tool's path: ${rawPath}`)];
    }
    if (rest.endsWith("/find_existing")) return app.findExisting(rest.slice(0, -"/find_existing".length), body);
    return app.runTool(rest, body);
  }
  return [404, error("not_found", rawPath)];
}

/** The body, `n` bytes; null when the request ends with another count. */
function readBody(req, n) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let got = 0;
    req.on("data", (c) => {
      got += c.length;
      if (got > n) {
        req.destroy();
        resolve(null);
        return;
      }
      chunks.push(c);
    });
    req.on("end", () => resolve(got === n ? Buffer.concat(chunks, got) : null));
    req.on("error", reject);
  });
}

/** An `http.Server` serving `app` (not listening yet). `server.inflight()`
 * says how many requests are being answered; `server.stopping` is set by a
 * stop (answers then close their connection). */
export function createServer(app, opts = {}) {
  let stopping = false;
  let inflight = 0;
  const waiting = new Set();
  const server = http.createServer(
    // Keep-alive connections are held for as long as the worker keeps them:
    // a server closing an idle one while the worker sends on it would turn
    // a call into one whose outcome is unknown.
    { keepAlive: true, noDelay: true, requestTimeout: 0 },
    handler(app, { ...opts, stopping: () => stopping }),
  );
  server.keepAliveTimeout = 0;
  server.headersTimeout = 60_000;
  server.on("request", (req, res) => {
    inflight += 1;
    res.on("close", () => {
      inflight -= 1;
      if (inflight === 0) for (const w of waiting) w();
    });
  });
  server.on("connection", (socket) => socket.setNoDelay(true));
  server.on("clientError", (err, socket) => {
    if (socket.writable && !socket.writableEnded) {
      const data = JSON.stringify(error("bad_request", `not an HTTP request: ${err.code ?? err.message}`));
      socket.end(`HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(data)}\r\nConnection: close\r\n\r\n${data}`);
    } else socket.destroy();
  });
  server.inflight = () => inflight;
  server.stop = (drainTimeoutS = DRAIN_TIMEOUT_S) => {
    // No new connection from here on; the requests in flight may finish.
    stopping = true;
    server.close();
    server.closeIdleConnections?.();
    return new Promise((resolve) => {
      if (inflight === 0) return resolve(0);
      const timer = setTimeout(() => {
        waiting.delete(done);
        resolve(inflight);
      }, drainTimeoutS * 1000);
      const done = () => {
        clearTimeout(timer);
        waiting.delete(done);
        resolve(0);
      };
      waiting.add(done);
    });
  };
  return server;
}

/** Serves `app` until SIGTERM or SIGINT. Prints `listening on http://ADDR`
 * once it accepts calls; resolves to the listening server.
 *
 * A stop: the first SIGTERM or SIGINT stops accepting and lets the requests
 * in flight finish for up to `drainTimeoutS` seconds, then exits 0 (or 1
 * if some are still running); a second signal exits at once (128 + its
 * number). `handleSignals: false` leaves the signals alone (stop with
 * `server.stop()`). */
export async function serve(app, opts = {}) {
  const { host = "127.0.0.1", port = 9000, drainTimeoutS = DRAIN_TIMEOUT_S, handleSignals = true, quiet = false } = opts;
  const server = createServer(app, opts);
  await new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, host, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const a = server.address();
  const addr = a.family === "IPv6" ? `[${a.address}]:${a.port}` : `${a.address}:${a.port}`;
  server.url = `http://${addr}`;
  if (!quiet) process.stdout.write(`listening on http://${addr}\n`);
  if (handleSignals) {
    let stopped = false;
    const onSignal = (signal) => {
      if (stopped) process.exit(128 + (constants.signals[signal] ?? 15));
      stopped = true;
      server.stop(drainTimeoutS).then((unfinished) => {
        if (unfinished) {
          process.stderr.write(
            `leasehold: shutdown: ${unfinished} request(s) still running after the drain timeout ` +
              `(${drainTimeoutS}s); exiting (the worker retries them)\n`,
          );
          process.exit(EXIT_DRAIN_TIMEOUT);
        }
        process.exit(0);
      });
    };
    process.on("SIGTERM", onSignal);
    process.on("SIGINT", onSignal);
  }
  return server;
}
