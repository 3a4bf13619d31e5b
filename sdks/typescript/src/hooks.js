// A module resolution hook of `leasehold serve`: an app's `import ... from
// "leasehold"` that Node cannot resolve from the app's directory (the app has
// no node_modules of its own) is the serving SDK, this package.
const SELF = new URL("./index.js", import.meta.url).href;

export async function resolve(specifier, context, next) {
  try {
    return await next(specifier, context);
  } catch (e) {
    if (specifier === "leasehold" && e?.code === "ERR_MODULE_NOT_FOUND") return { url: SELF, shortCircuit: true };
    throw e;
  }
}
