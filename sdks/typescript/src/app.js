// The protocol's logic, without HTTP: kinds, tools, the replay of a journal.
// Types: ../index.d.ts.

export const PROTOCOL = 1;

/** A brand shared by every copy of this package (an app loaded with one
 * copy and served by another is still an App). */
const APP = Symbol.for("leasehold.App");

/** Ends the job as failed (terminal: never retried). */
export class Fail extends Error {
  constructor(message) {
    super(message);
    this.name = "Fail";
  }
}

/** Ends this attempt at once; the worker retries the job after `delayMs` at
 * least (the job waits queued, holding no slot, however long), or after the
 * job's backoff when that is longer. */
export class Retry extends Error {
  constructor(message, delayMs = 0) {
    super(message);
    this.name = "Retry";
    this.delayMs = delayMs;
  }
}

/** A tool's failure: `code` is `retryable` (the default: the worker
 * reconciles with `find_existing` and tries again), `terminal` (the effect
 * did not and will not happen) or `conflict`. */
export class ToolError extends Error {
  constructor(message, code = "retryable") {
    super(message);
    this.name = "ToolError";
    this.code = code;
  }
}

/** `findExisting`: the effect happened; this is its result. */
export class Found {
  constructor(result) {
    this.result = result;
  }
}

/** `findExisting`: the destination cannot be asked now (ask later). */
export class Unavailable {
  constructor(message) {
    this.message = message;
  }
}

/** `findExisting`: nobody can tell; the job parks for a person. */
export class Unknowable {
  constructor(message) {
    this.message = message;
  }
}

/** `findExisting`: the destination has no such effect. */
export const NOT_FOUND = Object.freeze({ status: "not_found" });

/** The body of an error answer. */
export function error(code, message) {
  return { protocol: PROTOCOL, error: { code, message } };
}

/** Unwinds the kind's function once its call's answer is decided. Not an
 * Error: a `catch (e) { if (e instanceof Error) ... }` lets it through. */
class Answered {
  constructor(op) {
    this.op = op;
  }
}

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isCount = (v) => Number.isSafeInteger(v) && v >= 0;

/** A value as it is recorded (JSON): `undefined` is `null`; something
 * JSON cannot carry is the kind's bug. */
function jsonValue(v, what) {
  if (v === undefined) return null;
  let text;
  try {
    text = JSON.stringify(v);
  } catch (e) {
    throw new TypeError(`${what} is not JSON: ${e.message}`);
  }
  if (text === undefined) throw new TypeError(`${what} is not JSON (a ${typeof v})`);
  return JSON.parse(text);
}

/** What an exception of the kind makes of the call. */
function opOfError(e) {
  if (e instanceof Fail) return { op: "fail", message: e.message };
  if (e instanceof Retry) return { op: "retry", message: e.message, delay_ms: Math.max(0, Math.floor(e.delayMs || 0)) };
  const trace = e instanceof Error ? (e.stack || `${e.name}: ${e.message}`).split("\n").slice(0, 6).join("\n") : String(e);
  return { op: "retry", message: trace, delay_ms: 0 };
}

/** One replay of one job: its input, and the durable operations.
 *
 * The function runs again on every call; `step`, `effect`, `generate` and
 * `park` return what the journal recorded, and the first one that is not
 * recorded decides the call's answer. */
export class Ctx {
  constructor(job, entries, version, tools = new Map()) {
    this.job = job;
    this._tools = tools;
    this._entries = entries;
    this._pos = 0;
    this._occurrences = new Map();
    this._version = version;
    /** The call's answer, once decided (the first operation past the journal). */
    this._op = null;
    this._past = false;
    let decide;
    this._decided = new Promise((resolve) => (decide = resolve));
    this._decide = (op) => {
      if (this._op === null) {
        this._op = op;
        decide(op);
      }
    };
  }

  /** The submission's input. */
  get input() {
    return this.job.input;
  }

  _id(name) {
    const n = this._occurrences.get(name) ?? 0;
    this._occurrences.set(name, n + 1);
    return `${name}#${n}`;
  }

  /** The recorded entry for `sid`, or where the call's answer goes. */
  _replay(sid) {
    if (this._past || this._op !== null) {
      // An operation started after the one that answers the call (side by
      // side, `Promise.all`): it never runs nor records.
      return { wait: true };
    }
    const i = this._pos;
    if (i < this._entries.length) {
      const e = this._entries[i];
      if (e.id !== sid) {
        this._decide({
          op: "journal_mismatch",
          index: i,
          recorded: e.id,
          requested: sid,
          message:
            `journal mismatch at step ${i}: the recorded run has \`${e.id}\`, the code now asks for ` +
            `\`${sid}\` (kind version ${JSON.stringify(this._version)}): the service's code changed while ` +
            "the job ran; restore the code and `leasehold review resume` the job, or end it with " +
            "`leasehold review fail`",
        });
        return { wait: true };
      }
      this._pos += 1;
      return { hit: true, value: e.result ?? null, index: i };
    }
    // The first operation past the journal answers the call.
    this._past = true;
    return { hit: false, index: i };
  }

  /** Answers the call with `op` and unwinds the function. */
  _answer(op) {
    this._decide(op);
    throw new Answered(op);
  }

  /** A durable step: `fn()` runs until its result is recorded, then never
   * again for this job (the recorded result is returned). */
  async step(name, fn) {
    const sid = this._id(String(name));
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return r.value;
    let result;
    try {
      result = jsonValue(await fn(), `the result of step \`${sid}\``);
    } catch (e) {
      this._answer(opOfError(e));
    }
    return this._answer({ op: "step", index: r.index, id: sid, result });
  }

  /** A write through the worker's effects ledger, at most once ever. */
  async effect(tool, args, opts = {}) {
    const sid = this._id(`effect:${tool}`);
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return r.value;
    const op = {
      op: "effect",
      index: r.index,
      id: sid,
      tool: String(tool),
      args: jsonValue(args, `the arguments of \`${sid}\``),
      business_key: opts.businessKey ?? null,
    };
    if (opts.dedupesByKey) op.dedupes_by_key = true;
    if (opts.timeoutMs !== undefined && opts.timeoutMs !== null) op.timeout_ms = opts.timeoutMs;
    return this._answer(op);
  }

  /** A model call run by the worker with its agent runtime, recorded as the
   * step `generate:<name>#n`. Resolves to `{text, json, model_calls}`. */
  async generate(prompt, opts = {}) {
    const sid = this._id(`generate:${opts.name ?? "generate"}`);
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return r.value;
    const op = {
      op: "generate",
      index: r.index,
      id: sid,
      prompt: String(prompt),
      system: opts.system ?? "",
      model: opts.model ?? "main",
    };
    if (opts.schema !== undefined && opts.schema !== null) op.schema = opts.schema;
    if (opts.tools && opts.tools.length) op.tools = opts.tools.map((t) => this._toolSpec(t));
    return this._answer(op);
  }

  /** What a `generate` tells the worker of the app's tool `name`. */
  _toolSpec(name) {
    const t = this._tools.get(name);
    if (!t) {
      this._answer(opOfError(new TypeError(`generate: no tool \`${name}\` on this app (it has ${[...this._tools.keys()].sort().join(", ") || "none"})`)));
    }
    const spec = { name: t.name, kind: t.read ? "read" : "write" };
    if (t.description) spec.description = t.description;
    if (t.schema !== undefined && t.schema !== null) spec.schema = t.schema;
    if (t.timeoutMs !== undefined && t.timeoutMs !== null) spec.timeout_ms = t.timeoutMs;
    if (t.dedupesByKey) spec.dedupes_by_key = true;
    return spec;
  }

  /** Stops for a person; resolves to their answer once the job is resumed
   * (`leasehold review resume ID --answer JSON`). */
  async park(reason, question) {
    const sid = this._id("park");
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return r.value;
    return this._answer({ op: "park", index: r.index, id: sid, reason: String(reason), question: String(question) });
  }

  /** A durable timer: waits `ms` holding no worker. The first time, the
   * attempt ends and the job is `waiting` (no slot, no attempt spent); at
   * its time any worker calls the service again and this `sleep` resolves
   * (recorded as step `sleep#n`). The wait starts when the worker records it. */
  async sleep(ms) {
    if (typeof ms !== "number" || !Number.isFinite(ms) || ms < 0) {
      throw new TypeError(`sleep: ms must be a number >= 0, not ${JSON.stringify(ms)}`);
    }
    return this._sleep({ ms: Math.floor(ms) });
  }

  /** `sleep` until the time `at` (a Date); a time already past resolves at once. */
  async sleepUntil(at) {
    if (!(at instanceof Date) || Number.isNaN(at.getTime())) {
      throw new TypeError(`sleepUntil: a valid Date, not ${String(at)}`);
    }
    return this._sleep({ until: at.toISOString() });
  }

  /** Waits for the signal `name`, holding no worker, at most `timeoutMs`
   * (omitted: for as long as it takes). A signal is sent with
   * `leasehold signal ID NAME --data JSON`, from the console, or published
   * on `lh.signal.<job>.<name>`; one sent before the wait is kept for it,
   * and two of one name are two waits' answers, in the order sent.
   * Resolves to the signal (`{name, data, seq, sent_at, sender?}`), or
   * `null` after the timeout; recorded as step `wait:<name>#n`. */
  async waitFor(name, timeoutMs) {
    if (typeof name !== "string" || !/^(?!lh-)[A-Za-z0-9_-]{1,64}$/.test(name)) {
      throw new TypeError(`waitFor: a signal name is 1-64 letters, digits, '-' or '_', not starting with 'lh-', not ${JSON.stringify(name)}`);
    }
    const op = { op: "wait_for", name };
    if (timeoutMs !== undefined && timeoutMs !== null) {
      if (typeof timeoutMs !== "number" || !Number.isFinite(timeoutMs) || timeoutMs < 0) {
        throw new TypeError(`waitFor: timeoutMs must be a number >= 0, not ${JSON.stringify(timeoutMs)}`);
      }
      op.timeout_ms = Math.floor(timeoutMs);
    }
    const sid = this._id(`wait:${name}`);
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return r.value;
    return this._answer({ ...op, index: r.index, id: sid });
  }

  /** Starts one child job of `kind` with `input`: see `spawnMany`. Resolves
   * to the child's id. */
  async spawn(kind, input, opts = {}) {
    const ids = await this.spawnMany(kind, [input], opts);
    return ids[0];
  }

  /** Starts one child job of `kind` per input, as one durable step
   * (`spawn:<kind>#n`), and resolves to their ids. Each child is a job of
   * its own, of this job's tenant and priority; its id is derived from this
   * job, its incarnation and the step, so a resumed job never starts a
   * second set. A cancel of this job cancels them, unless `{detach: true}`. */
  async spawnMany(kind, inputs, opts = {}) {
    if (typeof kind !== "string" || !/^[A-Za-z0-9_-]+$/.test(kind)) {
      throw new TypeError(`spawn: a kind is letters, digits, '-' or '_', not ${JSON.stringify(kind)}`);
    }
    if (!Array.isArray(inputs) || !inputs.every((i) => i !== null && typeof i === "object" && !Array.isArray(i))) {
      throw new TypeError("spawn: inputs is an array of objects, one per child");
    }
    const sid = this._id(`spawn:${kind}`);
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return r.value.children;
    const op = { op: "spawn", index: r.index, id: sid, kind, inputs };
    if (opts && opts.detach) op.on_cancel = "detach";
    return this._answer(op);
  }

  /** Waits for `children` (ids `spawnMany` resolved to) to end, holding no
   * worker, as a durable step (`join#n`); resolves to each one's outcome in
   * their order (`{id, kind, status, result?, error?}`): a child's failure
   * is an outcome, not a rejection. The last child's end wakes the job once. */
  async join(children) {
    if (!Array.isArray(children) || children.length === 0 || !children.every((c) => typeof c === "string")) {
      throw new TypeError("join: children is a non-empty array of child ids");
    }
    const sid = this._id("join");
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return r.value;
    return this._answer({ op: "join", index: r.index, id: sid, children });
  }

  /** Starts one child and waits for its end: its outcome. */
  async spawnAndWait(kind, input) {
    const id = await this.spawn(kind, input);
    const outcomes = await this.join([id]);
    return outcomes[0];
  }

  _sleep(when) {
    const sid = this._id("sleep");
    const r = this._replay(sid);
    if (r.wait) return never();
    if (r.hit) return undefined;
    return this._answer({ op: "sleep", index: r.index, id: sid, ...when });
  }
}

/** A promise that never settles: an operation whose call is answered. */
function never() {
  return new Promise(() => {});
}

/** A write tool the worker calls through its ledger. */
export class Tool {
  constructor(name, fn, opts = {}) {
    this.name = name;
    this.fn = fn;
    this.find = null;
    /** A read (changes nothing: called directly, maybe more than once)
     * rather than a write (through the ledger, once ever). */
    this.read = Boolean(opts.read);
    /** What a `generate` offering the tool tells the model and the worker. */
    this.description = opts.description ?? "";
    this.schema = opts.schema ?? null;
    this.timeoutMs = opts.timeoutMs ?? null;
    this.dedupesByKey = Boolean(opts.dedupesByKey);
  }

  /** Registers the lookup asked before any retry of an effect whose
   * outcome is unknown: `new Found(result)`, `NOT_FOUND`,
   * `new Unavailable(msg)` or `new Unknowable(msg)`. Returns the tool. */
  findExisting(fn) {
    this.find = fn;
    return this;
  }
}

function toolCall(body) {
  const j = isObject(body.job) ? body.job : {};
  return {
    jobId: String(j.id ?? ""),
    epoch: Number.isSafeInteger(j.epoch) ? j.epoch : 0,
    step: String(body.step ?? ""),
    idempotencyKey: String(body.idempotency_key ?? ""),
    businessKey: typeof body.business_key === "string" ? body.business_key : null,
  };
}

/** The kinds and tools one service serves. */
export class App {
  constructor(opts = {}) {
    this[APP] = true;
    this.version = String(opts.version ?? "1");
    this.cacheJobs = opts.cacheJobs ?? 1024;
    this.kinds = new Map();
    this.tools = new Map();
    this._cache = new Map();
  }

  /** Whether `v` is an App (of any copy of this package). */
  static isApp(v) {
    return v !== null && typeof v === "object" && v[APP] === true;
  }

  /** Registers a kind: `app.kind("invoice", async (ctx) => ...)`. */
  kind(name, fn) {
    if (typeof fn !== "function") throw new TypeError(`kind \`${name}\`: a function of a Ctx is required`);
    this.kinds.set(String(name), fn);
    return this;
  }

  /** Registers a write tool; the function gets the arguments and a
   * ToolCall (send its `idempotencyKey` to the destination). Returns the
   * Tool (`.findExisting(fn)` registers its lookup). */
  tool(name, fn, opts = {}) {
    if (typeof fn !== "function") throw new TypeError(`tool \`${name}\`: a function is required`);
    const t = new Tool(String(name), fn, opts);
    if (opts.findExisting) t.findExisting(opts.findExisting);
    this.tools.set(t.name, t);
    return t;
  }

  /** The whole journal from this call's page and the cache, or the first
   * index to ask for. */
  _journal(job, journal) {
    const key = `${job.id}\u0000${job.epoch}`;
    const start = journal.from;
    const page = journal.entries;
    const total = journal.total ?? start + page.length;
    const have = this._cache.get(key) ?? [];
    if (start > have.length) return { entries: have, cursor: have.length };
    const entries = have.slice(0, start).concat(page);
    this._cache.delete(key);
    this._cache.set(key, entries);
    while (this._cache.size > this.cacheJobs) this._cache.delete(this._cache.keys().next().value);
    return { entries, cursor: entries.length < total ? entries.length : null };
  }

  /** One `invoke` call: `[status, answer]`. */
  async invoke(body) {
    const bad = mismatch(body, "invoke");
    if (bad) return bad;
    const job = parseJob(body.job);
    if (typeof job === "string") return [400, error("bad_request", `not an invoke request: ${job}`)];
    const journal = parseJournal(body.journal);
    if (typeof journal === "string") return [400, error("bad_request", `not an invoke request: ${journal}`)];
    const fn = this.kinds.get(job.kind);
    if (!fn) {
      const have = [...this.kinds.keys()].sort().join(", ");
      return [404, error("unknown_kind", `this service has no kind \`${job.kind}\` (it has ${have || "none"})`)];
    }
    const { entries, cursor } = this._journal(job, journal);
    if (cursor !== null) return [200, { protocol: PROTOCOL, op: "journal", from: cursor }];
    const ctx = new Ctx(job, entries, this.version, this.tools);
    const run = (async () => fn(ctx))().then(
      (output) => ({ output }),
      (err) => ({ err }),
    );
    const out = await Promise.race([run, ctx._decided.then(() => ({}))]);
    let op;
    if (ctx._op !== null) op = ctx._op;
    else if ("err" in out) op = opOfError(out.err);
    else {
      try {
        op = { op: "complete", output: jsonValue(out.output, "the kind's output") };
      } catch (e) {
        op = opOfError(e);
      }
    }
    return [200, { ...op, protocol: PROTOCOL, version: this.version }];
  }

  /** One `tool` call: `[status, answer]`. */
  async runTool(name, body) {
    const bad = mismatch(body, "tool", name);
    if (bad) return bad;
    const t = this.tools.get(name);
    if (!t) return [404, error("terminal", `this service has no tool \`${name}\``)];
    let result;
    try {
      result = jsonValue(await t.fn(body.args ?? null, toolCall(body)), `the result of tool \`${name}\``);
    } catch (e) {
      if (e instanceof ToolError) return [200, error(e.code, e.message)];
      return [200, error("retryable", e instanceof Error ? `${e.name}: ${e.message}` : String(e))];
    }
    return [200, { protocol: PROTOCOL, result }];
  }

  /** One `find_existing` call: `[status, answer]`. */
  async findExisting(name, body) {
    const bad = mismatch(body, "find_existing", name);
    if (bad) return bad;
    const t = this.tools.get(name);
    if (!t) return [404, error("terminal", `this service has no tool \`${name}\``)];
    if (!t.find) return [200, { protocol: PROTOCOL, status: "unknowable", message: `\`${name}\` has no findExisting` }];
    let r;
    try {
      r = await t.find(body.args ?? null, toolCall(body));
    } catch (e) {
      const m = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
      return [200, { protocol: PROTOCOL, status: "unavailable", message: m }];
    }
    if (r instanceof Found) {
      try {
        return [200, { protocol: PROTOCOL, status: "found", result: jsonValue(r.result, "a found result") }];
      } catch (e) {
        return [200, { protocol: PROTOCOL, status: "unavailable", message: e.message }];
      }
    }
    if (r instanceof Unavailable)
      return [200, { protocol: PROTOCOL, status: "unavailable", message: String(r.message) }];
    if (r instanceof Unknowable)
      return [200, { protocol: PROTOCOL, status: "unknowable", message: String(r.message) }];
    if (r === NOT_FOUND) return [200, { protocol: PROTOCOL, status: "not_found" }];
    return [
      200,
      {
        protocol: PROTOCOL,
        status: "unknowable",
        message: `findExisting of \`${name}\` returned neither Found, NOT_FOUND, Unavailable nor Unknowable`,
      },
    ];
  }
}

/** A request whose `type` (and `tool`) is not the endpoint's: a body sent
 * to another endpoint than the one it was made for. */
function mismatch(body, type, tool) {
  if (body.type !== type || (tool !== undefined && body.tool !== tool)) {
    const what = `\`${type}\` request` + (tool !== undefined ? ` for tool \`${tool}\`` : "");
    const got = `a \`${body.type}\` request` + (body.tool !== undefined ? ` for ${JSON.stringify(body.tool)}` : "");
    return [400, error("bad_request", `this endpoint takes a ${what}; the body is ${got}`)];
  }
  return null;
}

function parseJob(j) {
  if (!isObject(j)) return "no `job` object";
  if (typeof j.id !== "string" || j.id === "") return "`job.id` is not a string";
  if (typeof j.kind !== "string") return "`job.kind` is not a string";
  if (!isCount(j.epoch)) return "`job.epoch` is not a count";
  const attempt = j.attempt ?? 1;
  if (!isCount(attempt)) return "`job.attempt` is not a count";
  const deadline = j.deadline ?? null;
  if (deadline !== null && typeof deadline !== "string") return "`job.deadline` is not a string";
  return { id: j.id, kind: j.kind, input: j.input ?? null, epoch: j.epoch, attempt, deadline };
}

function parseJournal(j) {
  if (j === undefined || j === null) return { from: 0, entries: [], total: 0 };
  if (!isObject(j)) return "`journal` is not an object";
  const from = j.from ?? 0;
  if (!isCount(from)) return "`journal.from` is not a count";
  const entries = j.entries ?? [];
  if (!Array.isArray(entries)) return "`journal.entries` is not a list";
  for (const e of entries) {
    if (!isObject(e) || typeof e.id !== "string") return "a journal entry without a string `id`";
  }
  const total = j.total ?? from + entries.length;
  if (!isCount(total)) return "`journal.total` is not a count";
  return { from, entries, total };
}
