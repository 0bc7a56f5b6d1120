/**
 * Module hooks of `built.mjs`: a module of `src/` resolves to its compiled twin in the bench build,
 * whoever imports it (the bench's own files, through tsx, import `../src/X.js`).
 */
let src = ""
let out = ""

export const initialize = (data) => {
  src = data.src
  out = data.out
}

export const resolve = async (specifier, context, nextResolve) => {
  const resolved = await nextResolve(specifier, context)
  if (!resolved.url.startsWith(src) || !resolved.url.endsWith(".ts")) return resolved
  return { ...resolved, url: `${out}${resolved.url.slice(src.length, -".ts".length)}.js`, format: "module" }
}
