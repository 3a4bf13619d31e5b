// Write leasehold kinds in JavaScript or TypeScript: durable steps, effects
// through the worker's ledger, people in the loop, served over the worker
// protocol v1 (docs/protocol.md). Types: ../index.d.ts.
export { App, Ctx, Fail, Found, NOT_FOUND, PROTOCOL, Retry, Tool, ToolError, Unavailable, Unknowable, error } from "./app.js";
export {
  DRAIN_TIMEOUT_S,
  EXIT_DRAIN_TIMEOUT,
  Replays,
  SIGNATURE_TOLERANCE_S,
  checkSignature,
  constantTimeEqual,
  createServer,
  handler,
  serve,
  sign,
  signedMessage,
} from "./server.js";
