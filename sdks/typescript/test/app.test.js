// The protocol's logic without HTTP: replay, ids, answers, errors.
import assert from "node:assert/strict";
import { test } from "node:test";

// The SDK under test: the installed package LEASEHOLD_SDK names, else the checkout's.
const sdk = await import(new URL("src/index.js", process.env.LEASEHOLD_SDK ? `file://${process.env.LEASEHOLD_SDK}/` : new URL("../", import.meta.url)).href);

const { App, Fail, Found, NOT_FOUND, Retry, ToolError, Unavailable, Unknowable } = sdk;

const job = (over = {}) => ({ id: "j-1", kind: "k", input: { n: 2 }, epoch: 1, attempt: 1, deadline: null, ...over });
const call = (entries = [], over = {}) => ({
  protocol: 1,
  type: "invoke",
  job: job(over.job),
  journal: { from: over.from ?? 0, total: over.total ?? (over.from ?? 0) + entries.length, entries, next_cursor: null },
});

function counter() {
  const app = new App({ version: "7" });
  const ran = [];
  app.kind("k", async (ctx) => {
    let sum = 0;
    for (let i = 0; i < ctx.input.n; i++) {
      sum += await ctx.step("count", () => {
        ran.push(i);
        return i;
      });
    }
    return { sum };
  });
  return { app, ran };
}

test("a step past the journal is the answer; recorded steps replay without running", async () => {
  const { app, ran } = counter();
  let [status, op] = await app.invoke(call());
  assert.equal(status, 200);
  assert.deepEqual(op, { op: "step", index: 0, id: "count#0", result: 0, protocol: 1, version: "7" });
  [, op] = await app.invoke(call([{ index: 0, id: "count#0", result: 0 }], { job: { id: "j-2" } }));
  assert.deepEqual([op.op, op.id, op.index], ["step", "count#1", 1]);
  [, op] = await app.invoke(
    call(
      [
        { index: 0, id: "count#0", result: 10 },
        { index: 1, id: "count#1", result: 20 },
      ],
      { job: { id: "j-3" } },
    ),
  );
  assert.deepEqual(op, { op: "complete", output: { sum: 30 }, protocol: 1, version: "7" });
  assert.deepEqual(ran, [0, 1], "recorded steps never ran");
});

test("the same call twice gets the same answer", async () => {
  const { app } = counter();
  const c = call([{ index: 0, id: "count#0", result: 0 }]);
  assert.deepEqual(await app.invoke(structuredClone(c)), await app.invoke(structuredClone(c)));
});

test("a page past what the cache has asks for the journal from there; a later page completes it", async () => {
  const { app } = counter();
  let [, op] = await app.invoke(call([{ index: 1, id: "count#1", result: 1 }], { from: 1 }));
  assert.deepEqual(op, { protocol: 1, op: "journal", from: 0 });
  [, op] = await app.invoke(call([{ index: 0, id: "count#0", result: 0 }], { total: 2 }));
  assert.deepEqual(op, { protocol: 1, op: "journal", from: 1 }, "the total is 2: one more entry wanted");
  [, op] = await app.invoke(call([{ index: 1, id: "count#1", result: 1 }], { from: 1 }));
  assert.equal(op.op, "complete");
  assert.deepEqual(op.output, { sum: 1 });
  // Another epoch is another cache entry.
  [, op] = await app.invoke(call([{ index: 1, id: "count#1", result: 1 }], { from: 1, job: { epoch: 2 } }));
  assert.deepEqual(op, { protocol: 1, op: "journal", from: 0 });
});

test("a recorded step asked for under another id is a journal mismatch naming both", async () => {
  const app = new App({ version: "2" });
  app.kind("k", async (ctx) => {
    await ctx.step("a", () => 1);
    await ctx.step("renamed", () => 2);
    return null;
  });
  const [, op] = await app.invoke(
    call([
      { index: 0, id: "a#0", result: 1 },
      { index: 1, id: "b#0", result: 2 },
    ]),
  );
  assert.equal(op.op, "journal_mismatch");
  assert.equal(op.index, 1);
  assert.equal(op.recorded, "b#0");
  assert.equal(op.requested, "renamed#0");
  assert.match(op.message, /b#0.*renamed#0/);
});

test("effect, generate and park ops carry their fields; recorded ones return their results", async () => {
  const app = new App();
  app.kind("k", async (ctx) => {
    const r = await ctx.effect("create", { x: 1 }, { businessKey: "bk-1", timeoutMs: 3000, dedupesByKey: true });
    const g = await ctx.generate("hi", { system: "s", schema: { type: "object" } });
    const a = await ctx.park("approval", "ok?");
    return { r, g, a };
  });
  let [, op] = await app.invoke(call());
  assert.deepEqual(op, {
    op: "effect",
    index: 0,
    id: "effect:create#0",
    tool: "create",
    args: { x: 1 },
    business_key: "bk-1",
    dedupes_by_key: true,
    timeout_ms: 3000,
    protocol: 1,
    version: "1",
  });
  const e0 = { index: 0, id: "effect:create#0", result: { id: 9 } };
  [, op] = await app.invoke(call([e0], { job: { id: "j-g" } }));
  assert.deepEqual(op, {
    op: "generate",
    index: 1,
    id: "generate:generate#0",
    prompt: "hi",
    system: "s",
    model: "main",
    schema: { type: "object" },
    protocol: 1,
    version: "1",
  });
  const g0 = { index: 1, id: "generate:generate#0", result: { text: "t", json: null, model_calls: 1 } };
  [, op] = await app.invoke(call([e0, g0], { job: { id: "j-p" } }));
  assert.deepEqual([op.op, op.id, op.reason, op.question], ["park", "park#0", "approval", "ok?"]);
  [, op] = await app.invoke(call([e0, g0, { index: 2, id: "park#0", result: { approve: true } }], { job: { id: "j-c" } }));
  assert.deepEqual(op.output, { r: { id: 9 }, g: g0.result, a: { approve: true } });
});

test("sleep asks the worker for a durable timer once, and returns once it is recorded", async () => {
  const app = new App();
  app.kind("k", async (ctx) => {
    await ctx.sleep(1500);
    await ctx.sleepUntil(new Date("2030-01-02T03:04:05.006Z"));
    return { done: true };
  });
  let [, op] = await app.invoke(call());
  assert.deepEqual(op, { op: "sleep", index: 0, id: "sleep#0", ms: 1500, protocol: 1, version: "1" });
  const s0 = { index: 0, id: "sleep#0", result: "2026-12-06T10:00:00.000Z" };
  [, op] = await app.invoke(call([s0], { job: { id: "j-s" } }));
  assert.deepEqual([op.op, op.id, op.until], ["sleep", "sleep#1", "2030-01-02T03:04:05.006Z"]);
  [, op] = await app.invoke(call([s0, { index: 1, id: "sleep#1", result: "2030-01-02T03:04:05.006Z" }], { job: { id: "j-s2" } }));
  assert.deepEqual(op.output, { done: true });
  const bad = new App();
  bad.kind("k", (ctx) => ctx.sleep(-1));
  [, op] = await bad.invoke(call());
  // A bug in the kind's code, like any thrown error: retried, with its message.
  assert.equal(op.op, "retry");
  assert.match(op.message, /sleep: ms must be a number >= 0/);
});

test("waitFor asks the worker for a signal once, and returns what was recorded", async () => {
  const app = new App();
  app.kind("k", async (ctx) => {
    const first = await ctx.waitFor("confirmation");
    const second = await ctx.waitFor("confirmation", 2500);
    return { first, second };
  });
  let [, op] = await app.invoke(call());
  assert.deepEqual(op, { op: "wait_for", name: "confirmation", index: 0, id: "wait:confirmation#0", protocol: 1, version: "1" });
  const got = { name: "confirmation", data: { ok: true }, seq: 7, sent_at: "2026-12-06T10:00:00.000Z" };
  const w0 = { index: 0, id: "wait:confirmation#0", result: got };
  [, op] = await app.invoke(call([w0], { job: { id: "j-w" } }));
  assert.deepEqual([op.op, op.id, op.timeout_ms], ["wait_for", "wait:confirmation#1", 2500]);
  [, op] = await app.invoke(call([w0, { index: 1, id: "wait:confirmation#1", result: null }], { job: { id: "j-w2" } }));
  assert.deepEqual(op.output, { first: got, second: null });
  const bad = new App();
  bad.kind("k", (ctx) => ctx.waitFor("no.dots"));
  [, op] = await bad.invoke(call());
  assert.equal(op.op, "retry");
  assert.match(op.message, /waitFor: a signal name/);
});

test("spawnMany and join ask the worker once, and return what was recorded", async () => {
  const app = new App();
  app.kind("k", async (ctx) => {
    const kids = await ctx.spawnMany("echo", [{ i: 0 }, { i: 1 }], { detach: true });
    return { outcomes: await ctx.join(kids) };
  });
  let [, op] = await app.invoke(call());
  assert.deepEqual(op, { op: "spawn", index: 0, id: "spawn:echo#0", kind: "echo", inputs: [{ i: 0 }, { i: 1 }], on_cancel: "detach", protocol: 1, version: "1" });
  const s0 = { index: 0, id: "spawn:echo#0", result: { children: ["b_x_0", "b_x_1"], on_cancel: "detach" } };
  [, op] = await app.invoke(call([s0], { job: { id: "j-s" } }));
  assert.deepEqual([op.op, op.id, op.children], ["join", "join#0", ["b_x_0", "b_x_1"]]);
  const outcomes = [
    { id: "b_x_0", kind: "echo", status: "completed", result: { i: 0 } },
    { id: "b_x_1", kind: "echo", status: "failed", error: { class: "terminal", message: "no" } },
  ];
  [, op] = await app.invoke(call([s0, { index: 1, id: "join#0", result: outcomes }], { job: { id: "j-s2" } }));
  assert.deepEqual(op.output, { outcomes });
  const bad = new App();
  bad.kind("k", (ctx) => ctx.join([]));
  [, op] = await bad.invoke(call());
  assert.equal(op.op, "retry");
  assert.match(op.message, /join: children/);
});

test("an effect without options sends a null business key and nothing else", async () => {
  const app = new App();
  app.kind("k", (ctx) => ctx.effect("w", [1]));
  const [, op] = await app.invoke(call());
  assert.deepEqual(op, { op: "effect", index: 0, id: "effect:w#0", tool: "w", args: [1], business_key: null, protocol: 1, version: "1" });
});

test("steps side by side (Promise.all) answer with the first; the second never runs", async () => {
  const app = new App();
  const ran = [];
  app.kind("k", async (ctx) => {
    const [a, b] = await Promise.all([ctx.step("a", () => (ran.push("a"), 1)), ctx.step("b", () => (ran.push("b"), 2))]);
    return a + b;
  });
  const [, op] = await app.invoke(call());
  assert.deepEqual([op.op, op.id], ["step", "a#0"]);
  assert.deepEqual(ran, ["a"]);
});

test("Fail fails, Retry retries with its delay, a bug retries with its trace", async () => {
  const app = new App();
  app.kind("fail", () => {
    throw new Fail("no such supplier");
  });
  app.kind("retry", async (ctx) => ctx.step("s", () => Promise.reject(new Retry("later", 1500))));
  app.kind("bug", () => null.x);
  let [, op] = await app.invoke(call([], { job: { kind: "fail" } }));
  assert.deepEqual([op.op, op.message], ["fail", "no such supplier"]);
  [, op] = await app.invoke(call([], { job: { kind: "retry" } }));
  assert.deepEqual([op.op, op.message, op.delay_ms], ["retry", "later", 1500]);
  [, op] = await app.invoke(call([], { job: { kind: "bug" } }));
  assert.equal(op.op, "retry");
  assert.match(op.message, /TypeError/);
  assert.equal(op.delay_ms, 0);
});

test("a result JSON cannot carry is the kind's error, not a broken answer", async () => {
  const app = new App();
  app.kind("k", (ctx) => ctx.step("s", () => 10n));
  app.kind("undef", (ctx) => ctx.step("s", () => undefined));
  let [, op] = await app.invoke(call());
  assert.equal(op.op, "retry");
  assert.match(op.message, /not JSON/);
  [, op] = await app.invoke(call([], { job: { kind: "undef" } }));
  assert.deepEqual([op.op, op.result], ["step", null]);
});

test("bad invoke requests get a clear 400; an unknown kind a 404", async () => {
  const { app } = counter();
  for (const [body, why] of [
    [{ protocol: 1, type: "tool" }, /takes a `invoke` request/],
    [{ protocol: 1, type: "invoke" }, /no `job` object/],
    [{ ...call(), job: { ...job(), epoch: "1" } }, /job.epoch/],
    [{ ...call(), journal: { from: 0, entries: [{ result: 1 }] } }, /journal entry/],
    [{ ...call(), journal: { from: -1, entries: [] } }, /journal.from/],
  ]) {
    const [status, out] = await app.invoke(body);
    assert.equal(status, 400, JSON.stringify(out));
    assert.equal(out.error.code, "bad_request");
    assert.match(out.error.message, why);
  }
  const [status, out] = await app.invoke(call([], { job: { kind: "nope" } }));
  assert.equal(status, 404);
  assert.equal(out.error.code, "unknown_kind");
  assert.match(out.error.message, /nope.*k/);
});

test("tools: results, ToolError codes, a thrown bug is retryable, the body must be for the endpoint", async () => {
  const app = new App();
  const seen = [];
  app.tool("t", async (args, c) => {
    seen.push(c);
    if (args.terminal) throw new ToolError("refused", "terminal");
    if (args.bug) throw new Error("boom");
    return { ok: args.x };
  });
  const body = (args) => ({
    protocol: 1,
    type: "tool",
    tool: "t",
    job: { id: "j", epoch: 3 },
    step: "effect:t#0",
    args,
    business_key: "bk",
    idempotency_key: "a".repeat(64),
  });
  assert.deepEqual(await app.runTool("t", body({ x: 1 })), [200, { protocol: 1, result: { ok: 1 } }]);
  assert.deepEqual(seen[0], { jobId: "j", epoch: 3, step: "effect:t#0", idempotencyKey: "a".repeat(64), businessKey: "bk" });
  assert.deepEqual((await app.runTool("t", body({ terminal: true })))[1].error, { code: "terminal", message: "refused" });
  assert.equal((await app.runTool("t", body({ bug: true })))[1].error.code, "retryable");
  const [status, out] = await app.runTool("other", { ...body({}), tool: "other" });
  assert.deepEqual([status, out.error.code], [404, "terminal"]);
  const [s2, o2] = await app.runTool("t", { ...body({}), type: "find_existing" });
  assert.deepEqual([s2, o2.error.code], [400, "bad_request"]);
  const [s3, o3] = await app.runTool("t", { ...body({}), tool: "u" });
  assert.deepEqual([s3, o3.error.code], [400, "bad_request"]);
});

test("findExisting: each outcome, a throw is unavailable, none registered is unknowable", async () => {
  const app = new App();
  const outcomes = {
    found: new Found({ id: 1 }),
    none: NOT_FOUND,
    later: new Unavailable("down"),
    never: new Unknowable("lost"),
    odd: 42,
  };
  app.tool("t", () => null).findExisting((args) => {
    if (args === "throw") throw new Error("down hard");
    return outcomes[args];
  });
  app.tool("bare", () => null);
  const body = (tool, args) => ({ protocol: 1, type: "find_existing", tool, job: { id: "j", epoch: 1 }, step: "s", args, business_key: null, idempotency_key: "k" });
  const ask = async (args) => (await app.findExisting("t", body("t", args)))[1];
  assert.deepEqual(await ask("found"), { protocol: 1, status: "found", result: { id: 1 } });
  assert.deepEqual(await ask("none"), { protocol: 1, status: "not_found" });
  assert.deepEqual(await ask("later"), { protocol: 1, status: "unavailable", message: "down" });
  assert.deepEqual(await ask("never"), { protocol: 1, status: "unknowable", message: "lost" });
  assert.equal((await ask("odd")).status, "unknowable");
  assert.equal((await ask("throw")).status, "unavailable");
  assert.equal((await app.findExisting("bare", body("bare", 1)))[1].status, "unknowable");
  assert.equal((await app.findExisting("t", { ...body("t", 1), type: "tool" }))[0], 400);
});

test("a catch around the answering operation changes nothing: the call's answer is decided", async () => {
  const app = new App();
  const after = [];
  app.kind("k", async (ctx) => {
    try {
      await ctx.step("a", () => 1);
    } catch (e) {
      after.push(e instanceof Error);
    }
    await ctx.step("b", () => after.push("b ran"));
    return "done";
  });
  const [, op] = await app.invoke(call());
  assert.deepEqual([op.op, op.id, op.result], ["step", "a#0", 1]);
  assert.deepEqual(after, [false], "the unwinding is not an Error, and the later step never ran");
});

test("generate offers the named tools with what the model and the worker need; an unknown one is the kind's bug", async () => {
  const app = new App();
  app.tool("lookup", (args) => args, { read: true, description: "Find it.", schema: { type: "object", required: ["q"] } });
  app.tool("file", () => null, { timeoutMs: 2000, dedupesByKey: true });
  app.kind("k", (ctx) => ctx.generate("go", { tools: ["lookup", "file"] }));
  app.kind("bad", (ctx) => ctx.generate("go", { tools: ["nope"] }));
  let [, op] = await app.invoke(call());
  assert.equal(op.op, "generate");
  assert.deepEqual(op.tools, [
    { name: "lookup", kind: "read", description: "Find it.", schema: { type: "object", required: ["q"] } },
    { name: "file", kind: "write", timeout_ms: 2000, dedupes_by_key: true },
  ]);
  [, op] = await app.invoke(call([{ index: 0, id: "generate:generate#0", result: { text: "t", json: null, model_calls: 2 } }], { job: { id: "j-r" } }));
  assert.deepEqual(op.output, { text: "t", json: null, model_calls: 2 });
  [, op] = await app.invoke(call([], { job: { kind: "bad" } }));
  assert.equal(op.op, "retry");
  assert.match(op.message, /no tool `nope`/);
});
