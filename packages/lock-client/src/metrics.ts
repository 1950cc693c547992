/**
 * prom-client metrics for a requester, read from the client's counters at scrape time; per
 * holder (label `holder`), its release queue, renew schedule, batches, retries and budget.
 */
import { Counter, Gauge, Histogram, type Registry } from 'prom-client';
import type { LaneStats } from './holder-lane.js';
import { pullMetrics } from './prom.js';

export const DEFAULT_CLIENT_METRICS_PREFIX = 'tensorwire_lock_client_';

/** Requester-side counters. `acquired = released + releaseFailures + expired + dropped + active`, always. */
export interface LockClientCounters {
  /** Guards handed out. */
  readonly acquired: number;
  /** Guards whose release the holder confirmed (including "already gone": released = 0). */
  readonly released: number;
  /** Guards whose release was given up after attempts (reported; the holder's GC expires the lease). */
  readonly releaseFailures: number;
  /** Guards whose lease ran out before their release could be sent (no RPC; the holder's GC ends it). */
  readonly expired: number;
  /** Guards dropped without a release because their holder's incarnation ended (`dropLeases`). */
  readonly dropped: number;
  /** Guards not yet released (live, or release in flight). */
  readonly active: number;
  /** Release entries re-sent after a failure. */
  readonly releaseRetries: number;
  /** Acquires given up in flight (abort, timeout, broken connection, close) whose possible grant was released by acquire id. */
  readonly abandonedAcquires: number;
  /** Guards garbage-collected without being released (then released by the finalizer). */
  readonly leakedGuards: number;
  /** Acquires sent again after the holder refused them for overload (it had done nothing). */
  readonly acquireRetries: number;
  /** Release calls sent (each a batch of leases, or one unary call per lease against an older holder). */
  readonly releaseBatches: number;
  /** Renew calls sent by auto-renew. */
  readonly renewBatches: number;
  /** Times a release retry waited because its holder's retry budget was empty. */
  readonly budgetExhausted: number;
  /** Release/renew calls a holder refused for overload (RESOURCE_EXHAUSTED with retry-after). */
  readonly overloaded: number;
  /** Releases queued now, over all holders. */
  readonly releaseQueued: number;
}

export interface ClientMetrics {
  /** Record one batch sent to `holder` (`release_batch_size` / `renew_batch_size`). */
  observeBatch(holder: string, kind: 'release' | 'renew', entries: number): void;
  unregister(): void;
}

/** Entries per batch: powers of 4 up to the default batch. */
const BATCH_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096];

export function registerClientMetrics(
  registry: Registry,
  prefix: string,
  read: () => LockClientCounters,
  lanes: () => Iterable<[string, LaneStats]>,
): ClientMetrics {
  const m = pullMetrics(registry, prefix, read);
  const counter = m.counter;
  const names = m.names;
  m.gauge('guards_active', 'Lock guards not yet released', (c) => c.active);
  counter('acquired_total', 'Lock guards acquired', (c) => c.acquired);
  counter('released_total', 'Lock guards released (confirmed by the holder)', (c) => c.released);
  counter('release_failures_total', 'Releases given up after retrying until the lease would have expired', (c) => c.releaseFailures);
  counter('releases_expired_total', 'Guards whose lease ran out before the release could be sent (the holder GC ends them)', (c) => c.expired);
  counter('leases_dropped_total', 'Guards dropped without release because their holder restarted or vanished', (c) => c.dropped);
  counter('release_retries_total', 'Release entries re-sent after a failure', (c) => c.releaseRetries);
  counter('acquires_abandoned_total', 'In-flight acquires given up and released by acquire id', (c) => c.abandonedAcquires);
  counter('guards_leaked_total', 'Guards garbage-collected without release (released by the finalizer)', (c) => c.leakedGuards);
  counter('acquire_retries_total', 'Acquires sent again after an overloaded holder refused them', (c) => c.acquireRetries);

  // Per holder, read from the lanes at scrape time.
  const perHolder = (kind: 'gauge' | 'counter', name: string, help: string, pick: (s: LaneStats) => number): void => {
    names.push(prefix + name);
    const last = new Map<string, number>();
    if (kind === 'gauge') {
      new Gauge({
        name: prefix + name,
        help,
        labelNames: ['holder'],
        registers: [registry],
        collect() {
          for (const [holder, st] of lanes()) this.set({ holder }, pick(st));
        },
      });
      return;
    }
    new Counter({
      name: prefix + name,
      help,
      labelNames: ['holder'],
      registers: [registry],
      collect() {
        for (const [holder, st] of lanes()) {
          const v = pick(st);
          const prev = last.get(holder) ?? 0;
          if (v > prev) this.inc({ holder }, v - prev);
          last.set(holder, v);
        }
      },
    });
  };
  perHolder('gauge', 'release_queue_depth', 'Releases waiting to be sent to the holder (fresh and retries)', (s) => s.releaseQueued);
  perHolder('gauge', 'renew_queue_depth', 'Auto-renews due and waiting to be sent to the holder', (s) => s.renewQueued);
  perHolder('gauge', 'auto_renewed_leases', 'Leases on the holder lane auto-renew schedule', (s) => s.autoRenewed);
  perHolder('gauge', 'calls_in_flight', 'Release/renew calls in flight to the holder', (s) => s.inFlight);
  perHolder('counter', 'holder_release_retries_total', 'Release entries re-sent to the holder after a failure', (s) => s.releaseRetries);
  perHolder('counter', 'holder_renew_retries_total', 'Auto-renew entries retried after a failure', (s) => s.renewRetries);
  perHolder('counter', 'retry_budget_exhausted_total', "Times a release retry waited for the holder's retry budget", (s) => s.budgetExhausted);
  perHolder('counter', 'holder_overloaded_total', 'Calls the holder refused for overload (RESOURCE_EXHAUSTED, retry-after)', (s) => s.overloaded);
  const hist = (name: string, help: string): Histogram => {
    names.push(prefix + name);
    return new Histogram({ name: prefix + name, help, labelNames: ['holder'], buckets: BATCH_BUCKETS, registers: [registry] });
  };
  const releaseBatch = hist('release_batch_size', 'Leases per release call sent to the holder');
  const renewBatch = hist('renew_batch_size', 'Leases per auto-renew call sent to the holder');
  return {
    observeBatch: (holder, kind, entries) => (kind === 'release' ? releaseBatch : renewBatch).observe({ holder }, entries),
    unregister: () => m.unregister(),
  };
}
