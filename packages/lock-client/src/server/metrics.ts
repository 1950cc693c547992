/**
 * prom-client metrics for a holder, read from the lease table at scrape time, so one
 * scrape sees one consistent snapshot and `acquired = released + expired + active` holds
 * in every scrape.
 */
import { Counter, type Registry } from 'prom-client';
import { pullMetrics } from '../prom.js';
import type { LeaseCounters } from './lease-table.js';

export const DEFAULT_SERVER_METRICS_PREFIX = 'tensorwire_lock_';

export interface ServerMetricSources {
  counters(): LeaseCounters;
  requests(): ReadonlyMap<string, number>;
  rejections(): ReadonlyMap<string, number>;
}

/** Register the holder's metrics on `registry`. Returns a function that unregisters them. */
export function registerServerMetrics(registry: Registry, prefix: string, src: ServerMetricSources): () => void {
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
  labelled('requests_rejected_total', 'RPCs refused, by gRPC status', ['op', 'status'], src.rejections);
  return () => {
    for (const n of names) registry.removeSingleMetric(n);
  };
}
