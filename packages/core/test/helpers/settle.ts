/** How a promise settled, for tests that assert on outcomes rather than on timing. */

/** `{ ok: value }` when `p` fulfils, the rejection reason when it rejects. */
export async function outcome(p: Promise<unknown>): Promise<unknown> {
  try {
    return { ok: await p };
  } catch (e) {
    return e;
  }
}

/** One turn of the event loop (after pending I/O callbacks). */
export const tick = (): Promise<void> => new Promise((r) => setImmediate(r));

/** The outcome of `p`, or 'never settled' after a liveness guard far above every deadline in these tests. */
export function bounded(p: Promise<unknown>, ms = 10_000): Promise<unknown> {
  let timer: NodeJS.Timeout | undefined;
  const guard = new Promise<string>((r) => (timer = setTimeout(() => r('never settled'), ms)));
  return Promise.race([outcome(p), guard]).finally(() => clearTimeout(timer));
}
