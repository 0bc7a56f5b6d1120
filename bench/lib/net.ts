import * as Net from "node:net"

/** Sends one line to 127.0.0.1:port and resolves with the first chunk of the answer, or undefined. */
export const ask = (port: number, line: string, timeoutMs: number): Promise<string | undefined> =>
  new Promise((resolve) => {
    const socket = Net.connect({ host: "127.0.0.1", port })
    const done = (answer: string | undefined) => {
      clearTimeout(timer)
      socket.destroy()
      resolve(answer)
    }
    const timer = setTimeout(() => done(undefined), timeoutMs)
    socket.once("connect", () => socket.write(line))
    socket.once("data", (data) => done(data.toString("utf8")))
    socket.once("error", () => done(undefined))
  })
