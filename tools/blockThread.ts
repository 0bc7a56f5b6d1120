/**
 * Blocks this thread for `millis` without spending CPU, and answers `performance.now()` at its end.
 *
 * To the event loop it is a GC pause or a CPU-throttled container: nothing else in the thread
 * runs, no timer fires and no socket is read until it returns. `Atomics.wait` parks the thread
 * instead of spinning, so a stall in a test or a chaos worker leaves the machine's cores to the
 * work beside it (a busy loop burned a whole core for every stalled second of the suite).
 */
const cell = new Int32Array(new SharedArrayBuffer(4))

export const blockThread = (millis: number): number => {
  const end = performance.now() + millis
  // Nobody notifies `cell`: each wait runs to its timeout; looped in case one returns a little early.
  for (let left = millis; left > 0; left = end - performance.now()) Atomics.wait(cell, 0, 0, left)
  return performance.now()
}
