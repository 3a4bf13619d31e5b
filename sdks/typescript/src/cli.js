// `leasehold serve ./app.js [--host H] [--port P] [--max-body N] [--drain-timeout S]`.

import { existsSync } from "node:fs";
import * as nodeModule from "node:module";
import { resolve as resolvePath } from "node:path";
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";

import { App } from "./app.js";
import { serve } from "./server.js";

const USAGE = `usage: leasehold serve ./app.js [--export NAME] [--host H] [--port P] [--max-body BYTES] [--drain-timeout S]

Serves the leasehold App that app.js exports (as \`app\`, or its default export)
over the worker protocol v1. Environment: LEASEHOLD_HOST, LEASEHOLD_PORT,
LEASEHOLD_MAX_BODY, LEASEHOLD_DRAIN_TIMEOUT (the flags' defaults),
LEASEHOLD_TOKEN (a bearer token required), LEASEHOLD_HMAC_SECRET (every request
signed), LEASEHOLD_LOG_REQUESTS=1 (a line per request on stderr).`;

class Usage extends Error {}

function count(name, text) {
  if (!/^[0-9]+$/.test(String(text))) throw new Usage(`${name} must be a whole number, not ${JSON.stringify(text)}`);
  return Number(text);
}

function seconds(name, text) {
  const n = Number(text);
  if (String(text).trim() === "" || !Number.isFinite(n) || n < 0) throw new Usage(`${name} must be seconds, not ${JSON.stringify(text)}`);
  return n;
}

/** Loads the App that `file` exports. */
export async function load(file, exportName) {
  const path = resolvePath(process.cwd(), file);
  if (!existsSync(path)) throw new Usage(`${file}: no such file`);
  // The app's `import "leasehold"` may be this package (hooks.js).
  nodeModule.register?.("./hooks.js", import.meta.url);
  const mod = await import(pathToFileURL(path).href);
  const app = exportName ? mod[exportName] : (mod.app ?? mod.default);
  if (!App.isApp(app)) {
    const what = exportName ? `its export \`${exportName}\`` : "its export `app` (or its default export)";
    throw new Usage(`${file}: ${what} is not a leasehold App`);
  }
  return app;
}

export async function main(argv = process.argv.slice(2)) {
  let args;
  try {
    args = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        export: { type: "string" },
        host: { type: "string", default: process.env.LEASEHOLD_HOST || "127.0.0.1" },
        port: { type: "string", default: process.env.LEASEHOLD_PORT || "9000" },
        "max-body": { type: "string", default: process.env.LEASEHOLD_MAX_BODY || String(1 << 20) },
        "drain-timeout": { type: "string", default: process.env.LEASEHOLD_DRAIN_TIMEOUT || "30" },
        help: { type: "boolean", short: "h" },
      },
    });
  } catch (e) {
    return fail(e.message);
  }
  const [cmd, file, ...rest] = args.positionals;
  if (args.values.help) {
    process.stdout.write(USAGE + "\n");
    return 0;
  }
  if (cmd !== "serve" || !file || rest.length) return fail(cmd && cmd !== "serve" ? `unknown command ${JSON.stringify(cmd)}` : "serve what?");
  try {
    const port = count("--port", args.values.port);
    if (port > 65535) throw new Usage(`--port must be at most 65535, not ${port}`);
    const maxBody = count("--max-body", args.values["max-body"]);
    const drainTimeoutS = seconds("--drain-timeout", args.values["drain-timeout"]);
    const app = await load(file, args.values.export);
    await serve(app, {
      host: args.values.host,
      port,
      maxBody,
      drainTimeoutS,
      token: process.env.LEASEHOLD_TOKEN || null,
      hmacSecret: process.env.LEASEHOLD_HMAC_SECRET || null,
      logRequests: Boolean(process.env.LEASEHOLD_LOG_REQUESTS),
    });
    return null; // serving until a signal
  } catch (e) {
    if (e instanceof Usage) return fail(e.message);
    throw e;
  }
}

function fail(message) {
  process.stderr.write(`leasehold: ${message}\n${USAGE}\n`);
  return 2;
}
