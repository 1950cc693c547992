/**
 * prom-client metrics for a holder, read from the lease table at scrape time, so one
 * scrape sees one consistent snapshot and `acquired = released + expired + active` holds
 * in every scrape.
 */
import { Counter, Histogram, type Registry } from 'prom-client';
import { pullMetrics } from '../prom.js';
import type { LeaseCounters } from './lease-table.js';

export const DEFAULT_SERVER_METRICS_PREFIX = 'tensorwire_lock_';

export interface ServerMetricSources {
  counters(): LeaseCounters;
  requests(): ReadonlyMap<string, number>;
  rejections(): ReadonlyMap<string, number>;
  /** Admission counters (concurrency limit, calls dropped past their deadline). */
  load(): { readonly inFlight: number; readonly overloaded: number; readonly droppedExpired: number; readonly releaseEntries: number; readonly renewEntries: number };
}

export interface ServerMetrics {
  /** Record the entries of one batched call (`batch_entries{op}`). */
  observeBatch(op: 'releaseMany' | 'renewMany', entries: number): void;
  unregister(): void;
}

/** Entries per batched call: powers of 4 up to the largest batch a holder accepts by default. */
export const BATCH_BUCKETS: readonly number[] = [1, 4, 16, 64, 256, 1024, 4096, 8192];

/** Register the holder's metrics on `registry`. */
export function registerServerMetrics(registry: Registry, prefix: string, src: ServerMetricSources): ServerMetrics {
  const m = pullMetrics(registry, prefix, () => src.counters());
  const { names } = m;
  const gauge = m.gauge;
  const counter = m.counter;
  const labelled = (name: string, help: string, labels: string[], read: () => ReadonlyMap<string, number>): void => {
    names.push(prefix + name);
    const last = new Map<string, number>();
    new Counter({
      name: prefix + name,
      help,
      labelNames: labels,
      registers: [registry],
      collect() {
        for (const [key, v] of read()) {
          const prev = last.get(key) ?? 0;
          if (v <= prev) continue;
          const values = key.split('/');
          const lv: Record<string, string> = {};
          labels.forEach((l, i) => (lv[l] = values[i] ?? ''));
          this.inc(lv, v - prev);
          last.set(key, v);
        }
      },
    });
  };
  gauge('sessions_active', 'Leases live now', (c) => c.active);
  gauge('blocks_active', 'Blocks under live leases (summed over sessions)', (c) => c.activeBlocks);
  gauge('blocks_pinned', 'Distinct blocks pinned now', (c) => c.pinnedBlocks);
  counter('sessions_acquired_total', 'Leases granted', (c) => c.acquired);
  counter('sessions_released_total', 'Leases ended by release', (c) => c.released);
  counter('sessions_expired_total', 'Leases ended by the expiry GC or shutdown', (c) => c.expired);
  counter('blocks_acquired_total', 'Blocks granted', (c) => c.blocksAcquired);
  counter('blocks_released_total', 'Blocks released', (c) => c.blocksReleased);
  counter('blocks_expired_total', 'Blocks expired', (c) => c.blocksExpired);
  labelled('requests_total', 'RPCs received', ['op'], src.requests);
  labelled('requests_rejected_total', 'RPCs refused, by gRPC status (per entry for batched calls)', ['op', 'status'], src.rejections);
  const load = pullMetrics(registry, prefix, () => src.load());
  load.gauge('calls_in_flight', 'Calls being worked on now (the queue the concurrency limit bounds)', (c) => c.inFlight);
  load.counter('requests_overloaded_total', 'Calls refused RESOURCE_EXHAUSTED at once: past maxConcurrentCalls', (c) => c.overloaded);
  load.counter('requests_dropped_expired_total', "Calls dropped before any work: the caller's deadline had passed or it cancelled", (c) => c.droppedExpired);
  load.counter('release_entries_total', 'Entries received in ReleaseMany calls', (c) => c.releaseEntries);
  load.counter('renew_entries_total', 'Entries received in RenewMany calls', (c) => c.renewEntries);
  names.push(...load.names);
  const batch = new Histogram({
    name: `${prefix}batch_entries`,
    help: 'Entries per batched call (ReleaseMany, RenewMany)',
    labelNames: ['op'],
    buckets: [...BATCH_BUCKETS],
    registers: [registry],
  });
  names.push(`${prefix}batch_entries`);
  const release = batch.labels({ op: 'releaseMany' });
  const renew = batch.labels({ op: 'renewMany' });
  return {
    observeBatch: (op, entries) => (op === 'releaseMany' ? release : renew).observe(entries),
    unregister: () => {
      for (const n of names) registry.removeSingleMetric(n);
    },
  };
}
