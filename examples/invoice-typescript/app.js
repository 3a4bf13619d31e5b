// @ts-check
// The invoice agent of examples/invoice, in TypeScript-checked JavaScript,
// as a remote kind (the twin of examples/invoice-python/app.py).
//
// It parses a supplier's email (a step), looks the supplier up (a step: a
// read), asks a person when the amount is above `approval_over`
// (`ctx.park`), and creates the invoice in the accounting system through the
// worker's effects ledger (`ctx.effect`, business key supplier + number,
// `findExisting` by that key): exactly one invoice, whatever crashes,
// timeouts, retries or repeated calls happen on the way.
//
// Serve it (from this directory):
//   INVOICE_ACCOUNTING_URL=http://127.0.0.1:8089 npx leasehold serve ./app.js --port 9000
// then run a worker with `--remote-kind invoice=http://127.0.0.1:9000/`.
//
// It also serves `conformance`, the kind of the conformance suite
// (tests/it/remote.rs; any SDK implements it to run the suite), `echo` and
// `writer` (one model call run by the worker).
//
// Test hooks (environment): INVOICE_AMOUNT_BIAS adds to every amount and
// CONFORMANCE_CODE_VERSION=2 renames a step: code changes between two
// attempts of one job.

import { closeSync, existsSync, fsyncSync, openSync, readFileSync, writeSync } from "node:fs";

import { App, Fail, Found, NOT_FOUND, Retry, ToolError, Unavailable, Unknowable } from "leasehold";

export const app = new App({ version: process.env.CONFORMANCE_CODE_VERSION || "1" });

const ACCOUNTING = (process.env.INVOICE_ACCOUNTING_URL || "http://127.0.0.1:8089").replace(/\/+$/, "");
const BIAS = Number(process.env.INVOICE_AMOUNT_BIAS || "0");

/** A line on stdout the tests wait for. @param {string} line */
const say = (line) => process.stdout.write(line + "\n");

/** @param {number} ms */
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * @param {string} method
 * @param {string} path
 * @param {{body?: unknown, headers?: Record<string, string>, timeoutMs?: number}} [opts]
 * @returns {Promise<[number, any]>}
 */
async function http(method, path, opts = {}) {
  const r = await fetch(ACCOUNTING + path, {
    method,
    headers: { "Content-Type": "application/json", ...(opts.headers ?? {}) },
    body: opts.body === undefined ? undefined : JSON.stringify(opts.body),
    signal: AbortSignal.timeout(opts.timeoutMs ?? 30_000),
  });
  const text = await r.text();
  return [r.status, text ? JSON.parse(text) : null];
}

/**
 * Reads "Invoice <number> from <supplier>: <amount> EUR".
 * @param {string} body
 */
export function parse(body) {
  const m = /Invoice (\S+) from ([^:]+):\s*(\S+)/.exec(body);
  if (!m) throw new Fail('no "Invoice <number> from <supplier>: <amount>" in the email');
  const amount = Number(m[3].replace(/,/g, ""));
  if (!Number.isFinite(amount)) throw new Fail("the amount is not a number");
  return { supplier: m[2].trim(), number: m[1].trim(), amount };
}

app.kind("invoice", async (ctx) => {
  const inp = ctx.input;
  const parsed = await ctx.step("parse", async () => {
    if (inp.slow_parse_s && ctx.job.epoch === 1) {
      say(`parsing ${ctx.job.id} epoch ${ctx.job.epoch}`);
      await sleep(Number(inp.slow_parse_s) * 1000);
    }
    return parse(inp.email.body);
  });
  const supplier = await ctx.step("lookup_supplier", async () => {
    const [status, v] = await http("GET", "/accounting/suppliers?" + new URLSearchParams({ name: parsed.supplier }));
    if (status !== 200) throw new Error(`supplier lookup answered ${status}`);
    return v;
  });
  const over = inp.approval_over;
  if (over !== undefined && over !== null && parsed.amount > over) {
    const answer = await ctx.park(
      "approval",
      `create invoice ${parsed.number} of ${parsed.supplier} for ${parsed.amount.toFixed(2)} EUR? ` +
        'answer {"approve": true} or false',
    );
    if (!(answer && answer.approve === true)) throw new Fail(`invoice ${parsed.number} refused by the reviewer`);
  }
  const args = {
    supplier: parsed.supplier,
    supplier_id: supplier.id,
    number: parsed.number,
    amount: parsed.amount + BIAS,
  };
  const businessKey = `invoice:${parsed.supplier}:${parsed.number}`;
  const inv = await ctx.effect("create_invoice", args, { businessKey, timeoutMs: 3000 });
  const note = await ctx.step("note", () => `invoice ${inv.id} booked`);
  /** @type {Record<string, unknown>} */
  const out = { invoice: inv, note };
  if (inp.ask_again) {
    await ctx.step("pause", () => 1);
    out.again = await ctx.effect("create_invoice", args, { businessKey, timeoutMs: 3000 });
  }
  return out;
});

app
  .tool("create_invoice", async (args, call) => {
    const [status, v] = await http("POST", "/accounting/invoices", {
      body: args,
      headers: { "Idempotency-Key": call.idempotencyKey },
    });
    if (status === 200 || status === 201) return v;
    if (status === 409) return v.invoice; // already there: that is the effect
    if (status === 429 || status >= 500) throw new ToolError(`accounting answered ${status}`);
    throw new ToolError(`accounting answered ${status}: ${JSON.stringify(v)}`, "terminal");
  })
  .findExisting(async (args) => {
    const q = new URLSearchParams({ supplier: args.supplier, number: args.number });
    let status, v;
    try {
      [status, v] = await http("GET", "/accounting/invoices?" + q, { timeoutMs: 5000 });
    } catch (e) {
      return new Unavailable(String(e));
    }
    if (status === 404) return NOT_FOUND;
    if (status !== 200) return new Unavailable(`accounting answered ${status}`);
    if (v && v.status === "ambiguous") {
      return new Unknowable(`the accounting system cannot tell whether invoice ${args.number} exists: ${v.message}`);
    }
    return new Found(v);
  });

/** The input as the output (the bench's remote echo). @param {import("leasehold").Ctx} ctx */
const echo = async (ctx) => ctx.input;
app.kind("echo", echo);
app.kind("echo-remote", echo);

// One model call through the worker's agent runtime (`ctx.generate`).
app.kind("writer", async (ctx) => {
  const topic = await ctx.step("topic", () => ctx.input?.topic ?? "leases");
  const out = await ctx.generate(`Write one sentence about ${topic}.`, { system: "You write short answers." });
  return { text: out.text, model_calls: out.model_calls };
});

const SIM_WEB = (process.env.SCOUT_WEB_URL || ACCOUNTING).replace(/\/+$/, "");
const ARCHIVE = process.env.SCOUT_ARCHIVE_FILE || "";

// A read: called directly by the worker, as often as the model asks.
app.tool(
  "search",
  async (args) => {
    say(`tool search ${JSON.stringify(args.q)}`);
    const r = await fetch(`${SIM_WEB}/search?` + new URLSearchParams({ q: String(args.q ?? ""), format: "json" }), {
      signal: AbortSignal.timeout(10_000),
    });
    const results = (await r.json()).results.slice(0, 3);
    return { results: results.map((/** @type {any} */ x) => ({ title: x.title, url: x.url, content: x.content })) };
  },
  {
    read: true,
    description: "Search the web; returns results with title, url and content.",
    schema: { type: "object", required: ["q"], properties: { q: { type: "string" } } },
  },
);

// A write (the archive's copy): run by the worker through its ledger, once
// ever, with the idempotency key recorded beside the copy.
app
  .tool(
    "fetch",
    async (args, call) => {
      const url = String(args.url ?? "");
      const text = await (await fetch(url, { signal: AbortSignal.timeout(10_000) })).text();
      const result = { url, chars: text.length, text: text.slice(0, 2000) };
      if (ARCHIVE) {
        const fd = openSync(ARCHIVE, "a");
        try {
          writeSync(fd, JSON.stringify({ key: call.idempotencyKey, result }) + "\n");
          fsyncSync(fd);
        } finally {
          closeSync(fd);
        }
      }
      say(`tool fetch ${url} key ${call.idempotencyKey}`);
      return result;
    },
    {
      description: "Fetch a page and file a copy in the archive; returns its url and length.",
      schema: { type: "object", required: ["url"], properties: { url: { type: "string" } } },
    },
  )
  .findExisting(async (_args, call) => {
    if (!ARCHIVE) return new Unknowable("no archive to look in");
    if (!existsSync(ARCHIVE)) return NOT_FOUND;
    for (const line of readFileSync(ARCHIVE, "utf8").split("\n")) {
      if (!line) continue;
      const rec = JSON.parse(line);
      if (rec.key === call.idempotencyKey) return new Found(rec.result);
    }
    return NOT_FOUND;
  });

// A model conversation offered the service's tools: `search` (a read) and
// `fetch` (a write through the worker's ledger).
app.kind("scout", async (ctx) => {
  const topic = await ctx.step("topic", () => ctx.input?.topic ?? "lease renewal");
  const out = await ctx.generate(`Research ${topic} and write one section citing your source.`, {
    system: "You research.",
    tools: ["search", "fetch"],
  });
  return { text: out.text, model_calls: out.model_calls };
});

// The conformance suite's kind. Input: `steps` (n, default 2), `slow_step`
// (index of a step that announces itself on stdout with `step <i> of <job>
// epoch <e>` and sleeps `slow_s`, in epoch `slow_epoch` only when given),
// `pad` (bytes of padding in each step's result), `fail` (a message: fail
// terminal at the end), `retry_ms` (the first attempt ends with a retry
// asking for that delay, after the steps), `sleep_ms` (a durable sleep
// after the steps), `signal` (then waits for that signal, twice, at most
// `signal_timeout_ms` each; the output's `signals` lists what each took),
// `children` (then spawns that many `echo` children with input `{i: k}`
// and joins them; the output's `children` lists their outcomes).
app.kind("conformance", async (ctx) => {
  const inp = ctx.input ?? {};
  const n = Number(inp.steps ?? 2);
  let total = 0;
  for (let i = 0; i < n; i++) {
    const name = app.version === "2" && i === 1 ? "tally" : "count";
    const r = await ctx.step(name, async () => {
      const slowEpoch = inp.slow_epoch;
      if (inp.slow_step === i && (slowEpoch === undefined || slowEpoch === null || slowEpoch === ctx.job.epoch)) {
        say(`step ${i} of ${ctx.job.id} epoch ${ctx.job.epoch}`);
        await sleep(Number(inp.slow_s ?? 5) * 1000);
      }
      /** @type {{i: number, pad?: string}} */
      const r = { i };
      if (inp.pad) r.pad = "x".repeat(Number(inp.pad));
      return r;
    });
    total += r.i;
  }
  if (inp.sleep_ms !== undefined && inp.sleep_ms !== null) await ctx.sleep(Number(inp.sleep_ms));
  const signals = [];
  if (inp.signal) {
    const t = inp.signal_timeout_ms;
    for (let k = 0; k < 2; k++) {
      signals.push(await ctx.waitFor(String(inp.signal), t === undefined || t === null ? undefined : Number(t)));
    }
  }
  let outcomes = null;
  if (inp.children) {
    const inputs = Array.from({ length: Number(inp.children) }, (_, k) => ({ i: k }));
    outcomes = await ctx.join(await ctx.spawnMany("echo", inputs));
  }
  if (inp.fail) throw new Fail(String(inp.fail));
  if (inp.retry_ms !== undefined && inp.retry_ms !== null && ctx.job.attempt === 1) {
    throw new Retry("the conformance kind asks for a retry", Number(inp.retry_ms));
  }
  /** @type {Record<string, unknown>} */
  const out = { sum: total, steps: n };
  if (inp.signal) out.signals = signals;
  if (outcomes !== null) out.children = outcomes;
  return out;
});
