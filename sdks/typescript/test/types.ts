// Compiled by `npm run typecheck` only (never run): the declarations used
// as a TypeScript kind would use them.
import { App, Ctx, Fail, Found, NOT_FOUND, Retry, ToolError, Unavailable, type Reconcile, type ToolCall, serve } from "leasehold";

interface Input {
  email: { body: string };
  approval_over?: number;
}

const app = new App({ version: "2" });

app.kind<Input>("invoice", async (ctx: Ctx<Input>) => {
  const parsed = await ctx.step("parse", () => ({ number: "F-17", amount: ctx.input.email.body.length }));
  const n: number = parsed.amount;
  if (ctx.job.attempt > 3) throw new Retry("later", 1000);
  const inv = await ctx.effect<{ id: string }>("create_invoice", { number: parsed.number }, { businessKey: `invoice:${parsed.number}`, timeoutMs: 3000 });
  const out = await ctx.generate<{ ok: boolean }>("Summarise", { system: "short", schema: { type: "object" } });
  const ok: boolean | undefined = out.json?.ok;
  const answer = await ctx.park<{ approve: boolean }>("approval", "ok?");
  if (!answer.approve) throw new Fail("refused");
  const kids: string[] = await ctx.spawnMany("echo", [{ i: 0 }], { detach: false });
  const outcomes = await ctx.join<{ i: number }>(kids);
  const first: number | undefined = outcomes[0].result?.i;
  const one = await ctx.spawnAndWait("echo", { i: 1 });
  if (one.error) throw new Fail(`${first} ${one.error.class}: ${one.error.message}`);
  return { id: inv.id, n, ok, calls: out.model_calls };
});

app
  .tool<{ number: string }>("create_invoice", async (args, call: ToolCall) => {
    if (!call.idempotencyKey) throw new ToolError("no key", "terminal");
    return { id: args.number };
  })
  .findExisting(async (args): Promise<Reconcile> => (args.number ? new Found({ id: args.number }) : Math.random() > 0.5 ? NOT_FOUND : new Unavailable("down")));

const server = await serve(app, { port: 0, handleSignals: false, quiet: true, hmacSecret: "s", maxBody: 1 << 20 });
const unfinished: number = await server.stop(1);
export { unfinished };
