/**
 * What an acquire may say about how its lease will be used: the transports its requester
 * reads the blocks through (`AcquireOptions.transports`, `AcquireRequest.transports`).
 */

/** Most transport names one acquire may carry. */
export const MAX_ACQUIRE_TRANSPORTS = 8;

/** A transport name an acquire may carry: 1 to 64 of `[A-Za-z0-9._-]` (the engines' names: `cuda-ipc`, `tcp`, `rdma`). */
const TRANSPORT_NAME = /^[A-Za-z0-9._-]{1,64}$/;

/** Why `transports` cannot go in an acquire (too many, a bad name, a name twice), or undefined. */
export function transportsProblem(transports: readonly unknown[]): string | undefined {
  if (transports.length > MAX_ACQUIRE_TRANSPORTS) return `${transports.length} transports named, at most ${MAX_ACQUIRE_TRANSPORTS}`;
  for (let i = 0; i < transports.length; i++) {
    const t = transports[i];
    if (typeof t !== 'string' || !TRANSPORT_NAME.test(t)) return `transports[${i}] is not a transport name (1 to 64 of [A-Za-z0-9._-])`;
    if (transports.indexOf(t) !== i) return `transports[${i}] (${t}) is named twice`;
  }
  return undefined;
}
