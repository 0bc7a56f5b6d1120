import { describe, expect, it } from "@effect/vitest"
import { readdirSync, readFileSync } from "node:fs"
import { fileURLToPath } from "node:url"

const root = fileURLToPath(new URL("..", import.meta.url))
const readme = readFileSync(`${root}/README.md`, "utf8")
const blocks = Array.from(readme.matchAll(/```ts\n([\s\S]*?)```/g), (match) => match[1]!)
const examples = readdirSync(`${root}/examples`)
  .filter((file) => file.endsWith(".ts"))
  .map((file) => ({ file, text: readFileSync(`${root}/examples/${file}`, "utf8") }))

describe("README", () => {
  it("has TypeScript examples", () => {
    expect(blocks.length).toBeGreaterThan(0)
  })

  // `npm test` type-checks examples/; a README block found verbatim in an example is checked too.
  it.each(blocks.map((block, index) => [index, block] as const))("code block %i is taken from an example", (_, block) => {
    const match = examples.find((example) => example.text.includes(block.trimEnd()))
    expect(match, `README block not found verbatim under examples/:\n${block}`).toBeDefined()
  })

  it("the ten-line example is a whole example file", () => {
    expect(examples.some((example) => example.text.trim() === blocks[0]!.trim())).toBe(true)
  })
})
