// The HTTP side against real sockets: signatures, tokens, body limits,
// malformed requests, and the `leasehold serve` command's stop.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";

// The SDK under test: the installed package LEASEHOLD_SDK names, else the checkout's.
const ROOT = process.env.LEASEHOLD_SDK ? `file://${process.env.LEASEHOLD_SDK}/` : new URL("../", import.meta.url).href;
const sdk = await import(new URL("src/index.js", ROOT).href);
const { App, Replays, checkSignature, constantTimeEqual, serve, sign } = sdk;
const BIN = fileURLToPath(new URL("bin/leasehold.js", ROOT));

const now = () => Math.floor(Date.now() / 1000);

function demoApp() {
  const app = new App();
  app.kind("k", async (ctx) => ({ got: ctx.input }));
  app.tool("t", () => ({ ran: true })).findExisting(() => sdk.NOT_FOUND);
  return app;
}

const invokeBody = JSON.stringify({
  protocol: 1,
  type: "invoke",
  job: { id: "j", kind: "k", input: 1, epoch: 1, attempt: 1, deadline: null },
  journal: { from: 0, total: 0, entries: [], next_cursor: null },
});

/** One raw HTTP exchange on its own connection: the status and the JSON body. */
function raw(port, text) {
  return new Promise((resolve, reject) => {
    const s = net.connect(port, "127.0.0.1", () => s.write(text));
    let data = "";
    s.on("data", (c) => (data += c));
    s.on("error", reject);
    s.on("close", () => {
      const status = Number(data.split(" ")[1]);
      const body = data.slice(data.indexOf("\r\n\r\n") + 4);
      resolve({ status, body: body ? JSON.parse(body) : null, head: data.slice(0, data.indexOf("\r\n\r\n")) });
    });
  });
}

describe("signatures", () => {
  const body = Buffer.from(invokeBody);
  test("a v2 signature of this request passes once; a replay does not", () => {
    const seen = new Replays();
    const h = sign("sec", now(), "n-1", "POST", "/invoke", body);
    assert.equal(checkSignature("sec", h, body, { path: "/invoke", seen }), null);
    assert.match(checkSignature("sec", h, body, { path: "/invoke", seen }), /used before/);
  });
  test("another secret, path, method or body does not match", () => {
    const h = sign("sec", now(), "n-1", "POST", "/tools/t/find_existing", body);
    assert.match(checkSignature("other", h, body, { path: "/tools/t/find_existing" }), /does not match/);
    assert.match(checkSignature("sec", h, body, { path: "/tools/t" }), /does not match/);
    assert.match(checkSignature("sec", h, body, { method: "PUT", path: "/tools/t/find_existing" }), /does not match/);
    assert.match(checkSignature("sec", h, Buffer.from("{}"), { path: "/tools/t/find_existing" }), /does not match/);
  });
  test("a time out of the window, no time, no header, or a v1 signature is refused", () => {
    assert.match(checkSignature("sec", sign("sec", now() - 301, "n", "POST", "/invoke", body), body), /too old/);
    assert.match(checkSignature("sec", sign("sec", now() + 301, "n", "POST", "/invoke", body), body), /too new/);
    assert.match(checkSignature("sec", "t=abc,n=x,v2=00", body), /no time/);
    assert.match(checkSignature("sec", undefined, body), /no X-Leasehold-Signature/);
    assert.match(checkSignature("sec", `t=${now()},v1=00`, body), /does not bind/);
  });
  test("a nonce leaves the memory once its time is out of the window", () => {
    const seen = new Replays(10);
    assert.ok(seen.firstTime("a", 100, 100));
    assert.ok(!seen.firstTime("a", 100, 105));
    assert.ok(seen.firstTime("b", 120, 120), "a is forgotten (100 + 10 < 120)");
    assert.equal(seen._seen.has("a"), false);
  });
  test("constantTimeEqual compares strings of any lengths", () => {
    assert.ok(constantTimeEqual("Bearer x", "Bearer x"));
    assert.ok(!constantTimeEqual("Bearer x", "Bearer xy"));
    assert.ok(!constantTimeEqual("", "Bearer x"));
  });
});

describe("the server", () => {
  let server, port;
  const ran = [];
  before(async () => {
    const app = demoApp();
    app.tool("append", (args) => (ran.push(args), { ok: true }));
    server = await serve(app, { port: 0, quiet: true, handleSignals: false, token: "tok", hmacSecret: "sec", maxBody: 4096 });
    port = server.address().port;
  });
  after(() => server.stop(1));

  const post = (path, body, headers = {}) =>
    fetch(`http://127.0.0.1:${port}${path}`, { method: "POST", headers: { "content-type": "application/json", ...headers }, body }).then(async (r) => ({
      status: r.status,
      body: await r.json(),
    }));
  const signed = (path, body, extra = {}) => ({
    authorization: "Bearer tok",
    "x-leasehold-signature": sign("sec", now(), `n-${Math.random()}`, "POST", path, Buffer.from(body)),
    ...extra,
  });

  test("a signed call with the token is served", async () => {
    const r = await post("/invoke", invokeBody, signed("/invoke", invokeBody));
    assert.equal(r.status, 200, JSON.stringify(r.body));
    assert.deepEqual(r.body.output, { got: 1 });
  });
  test("no token, a wrong token, a wrong signature: 401 unauthorized", async () => {
    for (const headers of [
      { "x-leasehold-signature": signed("/invoke", invokeBody)["x-leasehold-signature"] },
      signed("/invoke", invokeBody, { authorization: "Bearer nope" }),
      signed("/invoke", invokeBody, { "x-leasehold-signature": sign("other", now(), "n-x", "POST", "/invoke", Buffer.from(invokeBody)) }),
    ]) {
      const r = await post("/invoke", invokeBody, headers);
      assert.equal(r.status, 401);
      assert.equal(r.body.error.code, "unauthorized");
    }
  });
  test("a signed call sent to another endpoint, or again, is refused and runs nothing", async () => {
    const body = JSON.stringify({ protocol: 1, type: "find_existing", tool: "append", job: { id: "j", epoch: 1 }, step: "s", args: {}, business_key: null, idempotency_key: "k" });
    const h = signed("/tools/append/find_existing", body);
    let r = await post("/tools/append", body, h);
    assert.deepEqual([r.status, r.body.error.code], [401, "unauthorized"]);
    r = await post("/tools/append/find_existing", body, h);
    assert.deepEqual([r.status, r.body.status], [200, "unknowable"]);
    r = await post("/tools/append/find_existing", body, h);
    assert.equal(r.status, 401);
    assert.match(r.body.error.message, /used before/);
    assert.deepEqual(ran, []);
  });
  test("a body over the limit is refused with 413 before it is read", async () => {
    const r = await raw(port, `POST /invoke HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{`);
    assert.equal(r.status, 413);
    assert.equal(r.body.error.code, "request_too_large");
    assert.match(r.head, /connection: close/i);
  });
  test("a missing or non-numeric Content-Length is a 400", async () => {
    let r = await raw(port, `POST /invoke HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n`);
    assert.equal(r.status, 400);
    assert.match(r.body.error.message, /Content-Length is required/);
    r = await raw(port, `POST /invoke HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n`);
    assert.equal(r.status, 400);
  });
  test("not HTTP at all is a 400 and the server lives", async () => {
    const r = await raw(port, "hello\r\n\r\n");
    assert.equal(r.status, 400);
    const ok = await post("/invoke", invokeBody, signed("/invoke", invokeBody));
    assert.equal(ok.status, 200);
  });
});

describe("malformed calls (no token, no secret)", () => {
  let server, port;
  before(async () => {
    server = await serve(demoApp(), { port: 0, quiet: true, handleSignals: false });
    port = server.address().port;
  });
  after(() => server.stop(1));
  const post = (path, body) =>
    fetch(`http://127.0.0.1:${port}${path}`, { method: "POST", body }).then(async (r) => ({ status: r.status, body: await r.json() }));

  test("not JSON, not an object, another protocol, an unknown path or method", async () => {
    let r = await post("/invoke", "not json");
    assert.deepEqual([r.status, r.body.error.code], [400, "bad_request"]);
    r = await post("/invoke", "[1]");
    assert.deepEqual([r.status, r.body.error.code], [400, "bad_request"]);
    r = await post("/invoke", JSON.stringify({ protocol: 99, type: "invoke" }));
    assert.deepEqual([r.status, r.body.error.code, r.body.error.supported], [400, "unsupported_protocol", [1]]);
    r = await post("/tools/%E0%A4%A", JSON.stringify({ protocol: 1, type: "tool" }));
    assert.deepEqual([r.status, r.body.error.code], [400, "bad_request"]);
    r = await post("/elsewhere", JSON.stringify({ protocol: 1, type: "invoke" }));
    assert.deepEqual([r.status, r.body.error.code], [404, "not_found"]);
    const d = await fetch(`http://127.0.0.1:${port}/invoke`, { method: "DELETE" });
    assert.equal(d.status, 405);
    const h = await (await fetch(`http://127.0.0.1:${port}/healthz`)).json();
    assert.deepEqual(h, { protocol: 1, kinds: ["k"], tools: ["t"] });
  });
});

// ---- the command ----------------------------------------------------------

function appFile(source) {
  const dir = mkdtempSync(join(tmpdir(), "leasehold-ts-"));
  const file = join(dir, "app.js");
  writeFileSync(file, source);
  return file;
}

/** `leasehold serve FILE` started; resolves once it listens. */
function start(file, args = [], env = {}) {
  const p = spawn(process.execPath, [BIN, "serve", file, "--port", "0", ...args], { env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "pipe"] });
  p.out = "";
  p.err = "";
  p.stderr.on("data", (c) => (p.err += c));
  p.exited = new Promise((resolve) => p.on("exit", (code, signal) => resolve({ code, signal })));
  p.listening = new Promise((resolve, reject) => {
    p.stdout.on("data", (c) => {
      p.out += c;
      const m = /listening on http:\/\/([\d.]+):(\d+)/.exec(p.out);
      if (m) resolve(Number(m[2]));
    });
    p.exited.then(() => reject(new Error(`exited: ${p.err}`)));
  });
  return p;
}

const SLOW_APP = `
import { App } from "leasehold";
export const app = new App();
app.kind("slow", async (ctx) => ctx.step("s", async () => {
  process.stdout.write("working\\n");
  await new Promise((r) => setTimeout(r, ctx.input.ms));
  return ctx.input.ms;
}));
`;

const slowCall = (port, ms) =>
  fetch(`http://127.0.0.1:${port}/invoke`, {
    method: "POST",
    body: JSON.stringify({ protocol: 1, type: "invoke", job: { id: `j${ms}`, kind: "slow", input: { ms }, epoch: 1 }, journal: { from: 0, total: 0, entries: [] } }),
  }).then((r) => r.json());

const working = (p) =>
  new Promise((resolve) => {
    const check = () => (p.out.includes("working") ? resolve() : setTimeout(check, 10));
    check();
  });

describe("leasehold serve", () => {
  test("serves an app whose `leasehold` import has no node_modules (the serving SDK's)", async () => {
    const p = start(appFile(SLOW_APP));
    const port = await p.listening;
    const v = await slowCall(port, 1);
    assert.deepEqual([v.op, v.result], ["step", 1]);
    p.kill("SIGTERM");
    assert.deepEqual(await p.exited, { code: 0, signal: null });
  });

  test("SIGTERM lets the request in flight finish, then exits 0", async () => {
    const p = start(appFile(SLOW_APP));
    const port = await p.listening;
    const answer = slowCall(port, 700);
    await working(p);
    p.kill("SIGTERM");
    const v = await answer;
    assert.equal(v.result, 700, "answered after the signal");
    assert.deepEqual(await p.exited, { code: 0, signal: null });
  });

  test("past the drain timeout it exits 1; a second signal exits at once (128 + 15)", async () => {
    let p = start(appFile(SLOW_APP), ["--drain-timeout", "0.3"]);
    let port = await p.listening;
    slowCall(port, 5000).catch(() => {});
    await working(p);
    p.kill("SIGTERM");
    assert.equal((await p.exited).code, 1);
    assert.match(p.err, /still running after the drain timeout/);

    p = start(appFile(SLOW_APP));
    port = await p.listening;
    slowCall(port, 5000).catch(() => {});
    await working(p);
    p.kill("SIGTERM");
    await new Promise((r) => setTimeout(r, 100));
    p.kill("SIGTERM");
    assert.equal((await p.exited).code, 143);
  });

  test("a file that is not there, not an App, or bad flags: exit 2 with the reason", async () => {
    const run = (args) =>
      new Promise((resolve) => {
        const p = spawn(process.execPath, [BIN, ...args], { stdio: ["ignore", "pipe", "pipe"] });
        let err = "";
        p.stderr.on("data", (c) => (err += c));
        p.on("exit", (code) => resolve({ code, err }));
      });
    let r = await run(["serve", "/nonexistent/app.js"]);
    assert.deepEqual([r.code, /no such file/.test(r.err)], [2, true]);
    r = await run(["serve", appFile("export const app = 1;")]);
    assert.deepEqual([r.code, /not a leasehold App/.test(r.err)], [2, true], r.err);
    r = await run(["serve", appFile(SLOW_APP), "--port", "http"]);
    assert.deepEqual([r.code, /--port must be a whole number/.test(r.err)], [2, true], r.err);
    r = await run(["deploy"]);
    assert.deepEqual([r.code, /unknown command/.test(r.err)], [2, true], r.err);
  });
});
