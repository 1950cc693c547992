/**
 * Engine metrics on prom-client. Pass your own Registry to expose them next to your
 * service's metrics; by default each engine gets a private Registry (so two engines in one
 * process never clash). Engines that share a registry share the metric objects.
 */
import { Counter, Gauge, Histogram, Registry } from 'prom-client';

export interface MetricsOptions {
  /** Where to register. Default: a new private Registry, readable through `engine.metrics.registry`. */
  registry?: Registry;
  /** Metric name prefix. Default `tensorwire_`. */
  prefix?: string;
}

function getOrCreate<T>(registry: Registry, name: string, make: () => T): T {
  const existing = registry.getSingleMetric(name);
  return (existing as T | undefined) ?? make();
}

export class EngineMetrics {
  readonly registry: Registry;
  readonly bytes: Counter<'transport' | 'direction'>;
  readonly operations: Counter<'transport' | 'direction' | 'outcome'>;
  readonly duration: Histogram<'transport' | 'direction'>;
  readonly connections: Gauge<'transport'>;
  readonly errors: Counter<'transport' | 'code'>;
  readonly selections: Counter<'transport' | 'memory_kind' | 'slower_path'>;
  readonly connectionEvents: Counter<'transport' | 'event'>;

  constructor(options: MetricsOptions = {}) {
    const registry = options.registry ?? new Registry();
    const p = options.prefix ?? 'tensorwire_';
    this.registry = registry;
    const reg = [registry];
    this.bytes = getOrCreate(registry, `${p}transfer_bytes_total`, () =>
      new Counter({ name: `${p}transfer_bytes_total`, help: 'Bytes moved, by transport and direction (read|write)', labelNames: ['transport', 'direction'], registers: reg }),
    );
    this.operations = getOrCreate(registry, `${p}transfer_operations_total`, () =>
      new Counter({
        name: `${p}transfer_operations_total`,
        help: 'Transfer operations (one per request in a batch), by transport, direction and outcome (ok|error code)',
        labelNames: ['transport', 'direction', 'outcome'],
        registers: reg,
      }),
    );
    this.duration = getOrCreate(registry, `${p}transfer_duration_seconds`, () =>
      new Histogram({
        name: `${p}transfer_duration_seconds`,
        help: 'Duration of a transfer batch from call to completion',
        labelNames: ['transport', 'direction'],
        buckets: [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
        registers: reg,
      }),
    );
    this.connections = getOrCreate(registry, `${p}connections`, () =>
      new Gauge({ name: `${p}connections`, help: 'Live connections in the engine table, by transport', labelNames: ['transport'], registers: reg }),
    );
    this.errors = getOrCreate(registry, `${p}errors_total`, () =>
      new Counter({ name: `${p}errors_total`, help: 'Errors by transport and stable error code', labelNames: ['transport', 'code'], registers: reg }),
    );
    this.selections = getOrCreate(registry, `${p}transport_selections_total`, () =>
      new Counter({
        name: `${p}transport_selections_total`,
        help: 'Transport choices per peer connection; slower_path="true" when a faster local transport could not be used',
        labelNames: ['transport', 'memory_kind', 'slower_path'],
        registers: reg,
      }),
    );
    this.connectionEvents = getOrCreate(registry, `${p}connection_events_total`, () =>
      new Counter({
        name: `${p}connection_events_total`,
        help: 'Connection lifecycle: opened, adopted (inbound), retired (simultaneous open), invalidated, closed',
        labelNames: ['transport', 'event'],
        registers: reg,
      }),
    );
  }
}
