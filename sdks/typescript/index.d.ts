// Types of the leasehold TypeScript SDK (the worker protocol v1,
// docs/protocol.md). The package is plain ESM JavaScript (src/): nothing is
// built at install time; these declarations describe it.

import type { IncomingMessage, Server, ServerResponse } from "node:http";

/** The protocol version this SDK speaks. */
export declare const PROTOCOL: 1;

/** Any JSON value (what a step records, what the journal replays). */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** The job of one call, as the worker sent it. */
export interface Job<I = any> {
  readonly id: string;
  readonly kind: string;
  readonly input: I;
  /** The claim: one more per claim of the job. */
  readonly epoch: number;
  /** Failed attempts + 1. */
  readonly attempt: number;
  /** When the worker stops this attempt (RFC 3339), if it said. */
  readonly deadline: string | null;
}

export interface EffectOptions {
  /** A later effect of this tool with the same key (another step, another
   * job of this kind) gets the first one's result and calls nothing. */
  businessKey?: string | null;
  /** The tool call's timeout (default 10 s, at most the worker's call timeout). */
  timeoutMs?: number;
  /** The destination deduplicates by the idempotency key: after
   * `findExisting` says NOT_FOUND the worker may call the tool again;
   * otherwise such an outcome parks the job (`uncertain_effect`). */
  dedupesByKey?: boolean;
}

export interface GenerateOptions {
  system?: string;
  /** A model the worker registered (default `main`). */
  model?: string;
  /** A JSON Schema the answer must match (one repair round). */
  schema?: { [key: string]: Json };
  /** The step's name: its id is `generate:<name>#n` (default `generate`). */
  name?: string;
  /** Names of this app's tools the model may call: the worker runs a read
   * tool (`app.tool(name, fn, {read: true})`) by calling this service's
   * `/tools/{name}`, a write tool through its effects ledger exactly as
   * `ctx.effect` (once ever, reconciled with its `findExisting`). */
  tools?: string[];
}

/** What a `generate` records and returns. */
export interface Generated<T = any> {
  text: string;
  /** With a schema: the validated answer. */
  json: T | null;
  model_calls: number;
}

/** One replay of one job: its input, and the durable operations. The kind's
 * function runs again from the start on every call; each operation returns
 * what the journal recorded, and the first one past the journal decides the
 * call's answer (the function is then never resumed: keep code outside
 * operations deterministic and free of side effects). */
export declare class Ctx<I = any> {
  readonly job: Job<I>;
  /** The submission's input. */
  readonly input: I;
  /** A durable step: `fn()` runs until its result is recorded, then never
   * again for this job. Its id is `name#occurrence`. `fn` may run more than
   * once if a process dies before the record lands: keep writes to the
   * world in `effect`. The result must be JSON (`undefined` is `null`). */
  step<T>(name: string, fn: () => T | Promise<T>): Promise<T>;
  /** A write through the worker's effects ledger, at most once ever: the
   * worker calls this service's tool with a stable idempotency key and
   * reconciles an unknown outcome with its `findExisting`. */
  effect<T = any>(tool: string, args: Json | object, opts?: EffectOptions): Promise<T>;
  /** A model conversation run by the worker with its agent runtime,
   * recorded as the step `generate:<name>#n`. */
  generate<T = any>(prompt: string, opts?: GenerateOptions): Promise<Generated<T>>;
  /** Stops for a person; resolves to their answer once the job is resumed
   * (`leasehold review resume ID --answer JSON`). A second park of the run
   * asks again: it never gets the first one's answer. */
  park<T = any>(reason: string, question: string): Promise<T>;
  /** A durable timer: waits `ms` holding no worker (the job is `waiting`;
   * any worker resumes it at its time), recorded as the step `sleep#n`. */
  sleep(ms: number): Promise<void>;
  /** `sleep` until the time `at`; a time already past resolves at once. */
  sleepUntil(at: Date): Promise<void>;
  /** Waits for the signal `name` holding no worker (the job is `waiting`),
   * at most `timeoutMs` (omitted: for as long as it takes); a signal sent
   * before the wait is kept for it. Resolves to the signal, or `null`
   * after the timeout; recorded as the step `wait:<name>#n`. */
  waitFor<T = any>(name: string, timeoutMs?: number): Promise<Signal<T> | null>;
  /** Starts one child job of `kind` (see `spawnMany`); resolves to its id. */
  spawn(kind: string, input: Json | object, opts?: SpawnOptions): Promise<string>;
  /** Starts one child job of `kind` per input as one durable step
   * (`spawn:<kind>#n`): jobs of their own, of this job's tenant and
   * priority, never started twice; a cancel of this job cancels them
   * unless detached. Resolves to their ids. */
  spawnMany(kind: string, inputs: (Json | object)[], opts?: SpawnOptions): Promise<string[]>;
  /** Waits for the children to end holding no worker (the job is
   * `waiting`), recorded as the step `join#n`; resolves to each one's
   * outcome in their order. A child's failure is an outcome. */
  join<T = any>(children: string[]): Promise<Outcome<T>[]>;
  /** `spawn` then `join`: one child's outcome. */
  spawnAndWait<T = any>(kind: string, input: Json | object): Promise<Outcome<T>>;
}

/** Options of a spawn. */
export interface SpawnOptions {
  /** A cancel of the parent leaves these children running. */
  detach?: boolean;
}

/** How a child job ended, as its parent's join sees it. */
export interface Outcome<T = any> {
  id: string;
  kind: string;
  /** `completed`, `failed`, `cancelled`, `dead` or `rejected`. */
  status: string;
  /** Its result (`completed`). */
  result?: T;
  /** Why it did not complete. */
  error?: { class: string; message: string };
}

/** A signal a wait took (`leasehold signal ID NAME --data JSON`). */
export interface Signal<T = any> {
  name: string;
  data: T;
  /** Its sequence in the signal stream: the order signals are taken in. */
  seq: number;
  /** When it was sent (RFC 3339). */
  sent_at: string;
  /** Who sent it, when the sender said (`ana via console`). */
  sender?: string;
}

/** Ends the job as failed (terminal: never retried). */
export declare class Fail extends Error {
  constructor(message: string);
}

/** Ends this attempt at once; the worker retries the job after `delayMs` at
 * least (the job waits queued, holding no slot, however long), or after the
 * job's backoff when that is longer. */
export declare class Retry extends Error {
  readonly delayMs: number;
  constructor(message: string, delayMs?: number);
}

export type ToolErrorCode = "retryable" | "terminal" | "conflict";

/** A tool's failure: `retryable` (the default: reconciled, then retried),
 * `terminal` (did not and will not happen: the job fails) or `conflict`. */
export declare class ToolError extends Error {
  readonly code: ToolErrorCode;
  constructor(message: string, code?: ToolErrorCode);
}

/** `findExisting`: the effect happened; this is its result. */
export declare class Found<T = any> {
  readonly result: T;
  constructor(result: T);
}

/** `findExisting`: the destination cannot be asked now (ask later). */
export declare class Unavailable {
  readonly message: string;
  constructor(message: string);
}

/** `findExisting`: nobody can tell; the job parks for a person. */
export declare class Unknowable {
  readonly message: string;
  constructor(message: string);
}

/** `findExisting`: the destination has no such effect. */
export declare const NOT_FOUND: { readonly status: "not_found" };

export type Reconcile<T = any> = Found<T> | typeof NOT_FOUND | Unavailable | Unknowable;

/** What a tool execution knows of its call. */
export interface ToolCall {
  readonly jobId: string;
  readonly epoch: number;
  /** The effect's step id (`effect:<tool>#n`). */
  readonly step: string;
  /** Stable across attempts and workers: send it to the destination. */
  readonly idempotencyKey: string;
  readonly businessKey: string | null;
}

export type KindFn<I = any> = (ctx: Ctx<I>) => unknown | Promise<unknown>;
export type ToolFn<A = any> = (args: A, call: ToolCall) => unknown | Promise<unknown>;
export type FindFn<A = any> = (args: A, call: ToolCall) => Reconcile | Promise<Reconcile>;

export interface ToolOptions<A = any> {
  /** The lookup of an effect whose outcome is unknown (as `.findExisting`). */
  findExisting?: FindFn<A>;
  /** A read: changes nothing, so a model's call runs directly (maybe more
   * than once). Otherwise a write, through the ledger, once ever. */
  read?: boolean;
  /** What a `generate` offering the tool tells the model. */
  description?: string;
  /** JSON Schema of the arguments the model gives it (default: an object). */
  schema?: { [key: string]: Json };
  /** One call's timeout when a model calls it (default 10 s). */
  timeoutMs?: number;
  /** The destination deduplicates by the idempotency key (writes). */
  dedupesByKey?: boolean;
}

/** A tool of the service: a write the worker calls through its ledger
 * (`ctx.effect`, or a model's call in `ctx.generate`), or a read. */
export declare class Tool<A = any> {
  readonly name: string;
  readonly fn: ToolFn<A>;
  readonly find: FindFn<A> | null;
  readonly read: boolean;
  readonly description: string;
  readonly schema: { [key: string]: Json } | null;
  readonly timeoutMs: number | null;
  readonly dedupesByKey: boolean;
  /** Registers the lookup asked before any retry of an effect whose outcome
   * is unknown. Returns the tool. */
  findExisting(fn: FindFn<A>): this;
}

/** An answer of the protocol: the HTTP status and the body. */
export type Answer = [status: number, body: { [key: string]: Json }];

export interface AppOptions {
  /** The service's code version, recorded with each step (default "1"). */
  version?: string;
  /** Jobs whose journal is cached between calls (default 1024; only a cache). */
  cacheJobs?: number;
}

/** The kinds and tools one service serves. */
export declare class App {
  constructor(opts?: AppOptions);
  readonly version: string;
  readonly kinds: Map<string, KindFn>;
  readonly tools: Map<string, Tool>;
  /** Whether `v` is an App (of any copy of this package). */
  static isApp(v: unknown): v is App;
  /** Registers a kind. Returns the app. */
  kind<I = any>(name: string, fn: KindFn<I>): this;
  /** Registers a write tool; `.findExisting(fn)` on the result (or
   * `opts.findExisting`) registers its lookup. */
  tool<A = any>(name: string, fn: ToolFn<A>, opts?: ToolOptions<A>): Tool<A>;
  /** One `invoke` call (no HTTP). */
  invoke(body: { [key: string]: any }): Promise<Answer>;
  /** One `tool` call (no HTTP). */
  runTool(name: string, body: { [key: string]: any }): Promise<Answer>;
  /** One `find_existing` call (no HTTP). */
  findExisting(name: string, body: { [key: string]: any }): Promise<Answer>;
}

/** The body of an error answer. */
export declare function error(code: string, message: string): { protocol: 1; error: { code: string; message: string } };

export interface HandlerOptions {
  /** A bearer token every request must carry (compared in constant time). */
  token?: string | null;
  /** Every request must be signed (v2: method, path, time, nonce, body). */
  hmacSecret?: string | null;
  /** The largest request body in bytes (default 1 MiB): larger is a 413 before it is read. */
  maxBody?: number;
  /** The nonces served (default: a new memory per handler). */
  replays?: Replays;
  /** A line per request on stderr. */
  logRequests?: boolean;
}

export interface ServeOptions extends HandlerOptions {
  host?: string;
  /** 0: any free port (the printed address says which). */
  port?: number;
  /** Seconds the requests in flight may finish in after SIGTERM/SIGINT (default 30). */
  drainTimeoutS?: number;
  /** Stop on SIGTERM/SIGINT and exit (default true). */
  handleSignals?: boolean;
  /** Do not print `listening on http://ADDR`. */
  quiet?: boolean;
}

export interface LeaseholdServer extends Server {
  /** `http://ADDR` once listening (serve). */
  url?: string;
  /** Requests being answered now. */
  inflight(): number;
  /** Stops accepting, lets the requests in flight finish for up to
   * `drainTimeoutS`; resolves to how many were still running (0: all done). */
  stop(drainTimeoutS?: number): Promise<number>;
}

/** The request handler of `app`, for a server of yours. */
export declare function handler(app: App, opts?: HandlerOptions): (req: IncomingMessage, res: ServerResponse) => void;
/** An http.Server serving `app`, not listening yet. */
export declare function createServer(app: App, opts?: HandlerOptions): LeaseholdServer;
/** Serves `app` (prints `listening on http://ADDR`); resolves once it listens. */
export declare function serve(app: App, opts?: ServeOptions): Promise<LeaseholdServer>;

/** The nonces of signatures accepted within the tolerance window. */
export declare class Replays {
  constructor(toleranceS?: number);
  /** Records `nonce`; false when it was seen already. */
  firstTime(nonce: string, t: number, now: number): boolean;
}

export declare const SIGNATURE_TOLERANCE_S: number;
export declare const DRAIN_TIMEOUT_S: number;
export declare const EXIT_DRAIN_TIMEOUT: number;

/** What the worker signs: `<t>.<nonce>.<METHOD>.<path>.<body>`. */
export declare function signedMessage(t: number | string, nonce: string, method: string, path: string, body: Uint8Array | string): Buffer;
/** The `X-Leasehold-Signature` header of a request, as a worker signs it. */
export declare function sign(secret: string, t: number, nonce: string, method: string, path: string, body: Uint8Array | string): string;
/** Why the header does not sign this request, or null when it does. */
export declare function checkSignature(
  secret: string,
  header: string | undefined | null,
  body: Uint8Array,
  opts?: { method?: string; path?: string; now?: number; seen?: Replays | null },
): string | null;
/** String equality in a time that depends on neither string. */
export declare function constantTimeEqual(a: string, b: string): boolean;
