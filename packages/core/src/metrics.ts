/**
 * Engine metrics on prom-client. Pass your own Registry to expose them next to your
 * service's metrics; by default each engine gets a private Registry (so two engines in one
 * process never clash). Engines that share a registry share the metric objects.
 *
 * The per-post figures (bytes, ok operations, the duration histogram) are not prom-client
 * calls per post: each post adds to a {@link PostTally} (plain numbers), and the tallies are
 * added to the prom-client metrics whenever one of those metrics is read (a scrape,
 * `registry.metrics()`, `metric.get()`: prom-client's `collect` hook) and when the engine
 * closes. What a reader sees is exactly what per-post calls would have recorded.
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

/** Upper bounds (seconds) of `tensorwire_transfer_duration_seconds`. */
export const DURATION_BUCKETS: readonly number[] = Object.freeze([0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]);

/**
 * What the posts of one transport and direction added since the last flush: plain numbers,
 * so a post costs a few additions instead of three prom-client calls (each of which hashes
 * its labels). `counts[k]` is the number of durations in bucket k (at most `bounds[k]` and
 * above `bounds[k - 1]`); the last slot counts those above every bound. Once `direct` (the
 * engine closed, or prom-client's histograms cannot take a tally), every call goes straight
 * to the prom-client metrics instead.
 */
export class PostTally {
  readonly transport: string;
  readonly direction: 'read' | 'write';
  bytes = 0;
  ok = 0;
  /** Posts that succeeded since the last flush (a series exists once one did, whatever its byte count). */
  succeeded = 0;
  observed = 0;
  sum = 0;
  readonly bounds: readonly number[];
  readonly counts: Float64Array;
  /** Set: calls are recorded at once by these metrics, not tallied. */
  direct: EngineMetrics | undefined;
  constructor(transport: string, direction: 'read' | 'write', bounds: readonly number[], direct: EngineMetrics | undefined) {
    this.transport = transport;
    this.direction = direction;
    this.bounds = bounds;
    this.counts = new Float64Array(bounds.length + 1);
    this.direct = direct;
  }
  /** One post that succeeded: its bytes and its requests (operations). */
  done(bytes: number, requests: number): void {
    this.bytes += bytes;
    this.ok += requests;
    this.succeeded++;
    if (this.direct) this.direct.flushTally(this);
  }
  /** One post's duration in seconds (every post, whatever its outcome). */
  observe(seconds: number): void {
    if (this.direct) {
      this.direct.duration.observe({ transport: this.transport, direction: this.direction }, seconds);
      return;
    }
    const b = this.bounds;
    let k = 0;
    while (k < b.length && seconds > (b[k] as number)) k++;
    this.counts[k] = (this.counts[k] as number) + 1;
    this.sum += seconds;
    this.observed++;
  }
}

/** A prom-client histogram series as prom-client 15 keeps it (checked by {@link addableSeries} before use). */
interface HistogramSeries {
  labels: Record<string, string | number>;
  bucketValues: Record<string, number>;
  sum: number;
  count: number;
}

/**
 * The series of `h` for `labels`, created at zero when absent, if `h` keeps its series as
 * prom-client 15 does (`hashMap` of `{ labels, bucketValues, sum, count }`); undefined
 * otherwise (then the tallies fall back to one `observe` per post).
 */
function addableSeries(h: Histogram<string>, labels: Record<string, string>, bounds: readonly number[]): HistogramSeries | undefined {
  const find = (): HistogramSeries | undefined => {
    const map = (h as unknown as { hashMap?: unknown }).hashMap;
    if (typeof map !== 'object' || map === null) return undefined;
    for (const v of Object.values(map as Record<string, unknown>)) {
      const e = v as Partial<HistogramSeries> | null;
      if (typeof e !== 'object' || e === null || typeof e.labels !== 'object' || e.labels === null) continue;
      const l = e.labels;
      const keys = Object.keys(l);
      if (keys.length === Object.keys(labels).length && keys.every((k) => l[k] === labels[k])) return e as HistogramSeries;
    }
    return undefined;
  };
  let e = find();
  if (!e) {
    h.zero(labels);
    e = find();
  }
  if (!e || typeof e.sum !== 'number' || typeof e.count !== 'number' || typeof e.bucketValues !== 'object' || e.bucketValues === null) return undefined;
  for (const b of bounds) if (typeof e.bucketValues[String(b)] !== 'number') return undefined;
  return e;
}

/** Whether prom-client's histograms can take a tally (probed once on a private histogram). */
let tallyable: boolean | undefined;
function histogramsTakeTallies(): boolean {
  if (tallyable === undefined) {
    const probe = new Histogram({ name: 'tensorwire_probe_seconds', help: 'probe', labelNames: ['x'], buckets: [1, 2], registers: [] });
    const e = addableSeries(probe, { x: 'y' }, [1, 2]);
    let ok = e !== undefined;
    if (e) {
      // The same numbers through observe and through the series must read the same.
      probe.observe({ x: 'y' }, 1.5);
      ok = e.count === 1 && e.sum === 1.5 && e.bucketValues['2'] === 1 && e.bucketValues['1'] === 0;
    }
    tallyable = ok;
  }
  return tallyable;
}

/**
 * Engine metrics sharing each metric object (engines on one registry), for its collect hook.
 * An engine leaves it when it closes ({@link EngineMetrics.detach}).
 */
const sharing = new WeakMap<object, Set<EngineMetrics>>();

/** Make reading `metric` first add every sharing engine's tallies to it (and keep its own collect, if any). */
function hookCollect(metric: object, m: EngineMetrics): void {
  let set = sharing.get(metric);
  if (!set) {
    const engines = new Set<EngineMetrics>();
    set = engines;
    sharing.set(metric, engines);
    const target = metric as { collect?: (() => unknown) | undefined; reset?: () => void };
    const previous = target.collect;
    target.collect = function (this: unknown): unknown {
      for (const e of engines) e.flush();
      return previous?.call(this);
    };
    // A reset drops what was recorded before it, tallied or not.
    const reset = target.reset;
    if (typeof reset === 'function') {
      target.reset = function (this: unknown): void {
        for (const e of engines) e.discard(metric);
        reset.call(this);
      };
    }
  }
  set.add(m);
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
  /** Tallies not yet added to the metrics, by transport and direction. */
  readonly #tallies = new Map<string, PostTally>();
  /** Whether tallies are added to the duration histogram in bulk (else one observe per post). */
  readonly #bulk: boolean;
  #detached = false;

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
        buckets: [...DURATION_BUCKETS],
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
    // In bulk only into a histogram of this module's prom-client (one from another copy on a
    // shared registry may keep its series otherwise) that passed the probe and has these
    // buckets (one made by someone else under this name may not): else each call goes to it.
    const upper = (this.duration as unknown as { upperBounds?: unknown }).upperBounds;
    const sameBuckets = Array.isArray(upper) && upper.length === DURATION_BUCKETS.length && upper.every((b, k) => b === DURATION_BUCKETS[k]);
    this.#bulk = this.duration instanceof Histogram && sameBuckets && histogramsTakeTallies();
    for (const metric of [this.bytes, this.operations, this.duration]) hookCollect(metric, this);
  }

  /**
   * The tally the per-post path adds to for `transport` and `direction` (one per pair; the
   * engine keeps it with the connection). Read the metrics to see what it holds: reading flushes.
   */
  tally(transport: string, direction: 'read' | 'write'): PostTally {
    const key = `${direction}/${transport}`;
    let t = this.#tallies.get(key);
    if (!t) {
      t = new PostTally(transport, direction, DURATION_BUCKETS, this.#bulk && !this.#detached ? undefined : this);
      this.#tallies.set(key, t);
    }
    return t;
  }

  /** Add every tally to the prom-client metrics and zero it. Called by the metrics' collect hooks; idempotent. */
  flush(): void {
    for (const t of this.#tallies.values()) this.flushTally(t);
  }

  /**
   * Flush, then record every later call at once (the engine closed: a post still finishing
   * is counted, never left in a tally nobody reads), and leave the shared metrics' hooks.
   */
  detach(): void {
    if (this.#detached) return;
    this.flush();
    this.#detached = true;
    for (const t of this.#tallies.values()) t.direct = this;
    for (const metric of [this.bytes, this.operations, this.duration]) sharing.get(metric)?.delete(this);
  }

  /** Drop what the tallies hold for `metric` (it is being reset). */
  discard(metric: object): void {
    for (const t of this.#tallies.values()) {
      // Both counters are flushed together: a reset of either drops what is pending for both.
      if (metric === this.bytes || metric === this.operations) {
        t.bytes = 0;
        t.ok = 0;
        t.succeeded = 0;
      }
      if (metric === this.duration) {
        t.counts.fill(0);
        t.sum = 0;
        t.observed = 0;
      }
    }
  }

  /** Add one tally to the prom-client metrics and zero it. */
  flushTally(t: PostTally): void {
    const labels = { transport: t.transport, direction: t.direction };
    if (t.succeeded !== 0) {
      this.bytes.inc(labels, t.bytes);
      this.operations.inc({ ...labels, outcome: 'ok' }, t.ok);
      t.bytes = 0;
      t.ok = 0;
      t.succeeded = 0;
    }
    if (t.observed === 0) return;
    // Only tallies made in bulk mode hold durations here (the others record them at once), and
    // bulk mode was probed; should the series still not be addable, each duration goes in at
    // its bucket's bound (counts exact, the sum approximate) rather than failing a scrape.
    const series = addableSeries(this.duration as Histogram<string>, labels, t.bounds);
    if (series) {
      for (let k = 0; k < t.bounds.length; k++) {
        const key = String(t.bounds[k]);
        series.bucketValues[key] = (series.bucketValues[key] as number) + (t.counts[k] as number);
      }
      series.sum += t.sum;
      series.count += t.observed;
    } else {
      for (let k = 0; k < t.counts.length; k++) {
        const v = k < t.bounds.length ? (t.bounds[k] as number) : 2 * (t.bounds[t.bounds.length - 1] ?? 1);
        for (let i = 0; i < (t.counts[k] as number); i++) this.duration.observe(labels, v);
      }
    }
    t.counts.fill(0);
    t.sum = 0;
    t.observed = 0;
  }
}
