/** prom-client metrics for a requester, read from the client's counters at scrape time. */
import type { Registry } from 'prom-client';
import { pullMetrics } from './prom.js';

export const DEFAULT_CLIENT_METRICS_PREFIX = 'tensorwire_lock_client_';

/** Requester-side counters. `acquired = released + releaseFailures + dropped + active`, always. */
export interface LockClientCounters {
  /** Guards handed out. */
  readonly acquired: number;
  /** Guards whose release the holder confirmed (including "already gone": released = 0). */
  readonly released: number;
  /** Guards whose release was given up (the holder's GC expires the lease). */
  readonly releaseFailures: number;
  /** Guards dropped without a release because their holder's incarnation ended (`dropLeases`). */
  readonly dropped: number;
  /** Guards not yet released (live, or release in flight). */
  readonly active: number;
  /** Release attempts repeated after a failure. */
  readonly releaseRetries: number;
  /** Acquires given up in flight (abort, timeout, broken connection, close) whose possible grant was released by acquire id. */
  readonly abandonedAcquires: number;
  /** Guards garbage-collected without being released (then released by the finalizer). */
  readonly leakedGuards: number;
}

export function registerClientMetrics(registry: Registry, prefix: string, read: () => LockClientCounters): () => void {
  const m = pullMetrics(registry, prefix, read);
  const counter = m.counter;
  m.gauge('guards_active', 'Lock guards not yet released', (c) => c.active);
  counter('acquired_total', 'Lock guards acquired', (c) => c.acquired);
  counter('released_total', 'Lock guards released (confirmed by the holder)', (c) => c.released);
  counter('release_failures_total', 'Releases given up after retrying until the lease would have expired', (c) => c.releaseFailures);
  counter('leases_dropped_total', 'Guards dropped without release because their holder restarted or vanished', (c) => c.dropped);
  counter('release_retries_total', 'Release attempts repeated after a failure', (c) => c.releaseRetries);
  counter('acquires_abandoned_total', 'In-flight acquires given up and released by acquire id', (c) => c.abandonedAcquires);
  counter('guards_leaked_total', 'Guards garbage-collected without release (released by the finalizer)', (c) => c.leakedGuards);
  return () => m.unregister();
}
