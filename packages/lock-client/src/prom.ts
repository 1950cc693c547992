/**
 * Metrics read from counters at scrape time (prom-client `collect`), so every scrape sees one
 * consistent snapshot. Shared by the requester's and the holder's metrics.
 */
import { Counter, Gauge, type Registry } from 'prom-client';

export interface PullMetrics<C> {
  /** A gauge set to `pick(read())` at each scrape. */
  gauge(name: string, help: string, pick: (c: C) => number): void;
  /** A counter advanced to `pick(read())` at each scrape (monotonic source). */
  counter(name: string, help: string, pick: (c: C) => number): void;
  /** Names registered so far, for unregistering. */
  readonly names: string[];
  /** Unregister everything registered through this object. */
  unregister(): void;
}

export function pullMetrics<C>(registry: Registry, prefix: string, read: () => C): PullMetrics<C> {
  const names: string[] = [];
  return {
    names,
    gauge(name, help, pick) {
      names.push(prefix + name);
      new Gauge({
        name: prefix + name,
        help,
        registers: [registry],
        collect() {
          this.set(pick(read()));
        },
      });
    },
    counter(name, help, pick) {
      names.push(prefix + name);
      let last = 0;
      new Counter({
        name: prefix + name,
        help,
        registers: [registry],
        collect() {
          const v = pick(read());
          if (v > last) this.inc(v - last);
          last = v;
        },
      });
    },
    unregister() {
      for (const n of names) registry.removeSingleMetric(n);
    },
  };
}
