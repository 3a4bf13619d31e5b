#!/usr/bin/env node
// `npx leasehold serve ./app.js`: see src/cli.js.
import { main } from "../src/cli.js";

main().then(
  (code) => {
    if (code !== null) process.exitCode = code;
  },
  (e) => {
    process.stderr.write(`leasehold: ${e?.stack ?? e}\n`);
    process.exit(1);
  },
);
