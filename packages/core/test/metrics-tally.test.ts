/**
 * The per-post metrics are tallied as plain numbers and added to prom-client when a metric is
 * read (issue 11, fixed cost per post: the three prom-client calls per post, each hashing its
 * labels, were a fifth of a small post). What a reader sees must be exactly what one
 * prom-client call per post would have recorded: same bucket for a duration equal to a bound,
 * same +Inf bucket past the last bound, same sums, across reads, resets, shared registries
 * and an engine that closed while a post was finishing.
 */
import fc from 'fast-check';
import { Counter, Histogram, Registry } from 'prom-client';
import { describe, expect, it } from 'vitest';
import { DURATION_BUCKETS, EngineMetrics, TcpTransport, TransferEngine, silentLogger } from '../src/index.js';

type Post = { transport: 'tcp' | 'uds'; direction: 'read' | 'write'; bytes: number; requests: number; seconds: number; ok: boolean };

/** The way before tallies: one prom-client call per figure per post, on metrics defined as the engine's. */
function direct(registry: Registry): { record(p: Post): void } {
  const bytes = new Counter({ name: 'tensorwire_transfer_bytes_total', help: 'Bytes moved, by transport and direction (read|write)', labelNames: ['transport', 'direction'], registers: [registry] });
  const ops = new Counter({
    name: 'tensorwire_transfer_operations_total',
    help: 'Transfer operations (one per request in a batch), by transport, direction and outcome (ok|error code)',
    labelNames: ['transport', 'direction', 'outcome'],
    registers: [registry],
  });
  const duration = new Histogram({
    name: 'tensorwire_transfer_duration_seconds',
    help: 'Duration of a transfer batch from call to completion',
    labelNames: ['transport', 'direction'],
    buckets: [...DURATION_BUCKETS],
    registers: [registry],
  });
  return {
    record(p) {
      const labels = { transport: p.transport, direction: p.direction };
      if (p.ok) {
        bytes.labels(labels).inc(p.bytes);
        ops.labels({ ...labels, outcome: 'ok' }).inc(p.requests);
      }
      duration.labels(labels).observe(p.seconds);
    },
  };
}

function tallied(m: EngineMetrics, p: Post): void {
  const t = m.tally(p.transport, p.direction);
  if (p.ok) t.done(p.bytes, p.requests);
  t.observe(p.seconds);
}

const names = ['tensorwire_transfer_bytes_total', 'tensorwire_transfer_operations_total', 'tensorwire_transfer_duration_seconds'];

/** The exposition text of the three metrics as series → value (series order is first-use order, which Prometheus ignores). */
async function text(registry: Registry): Promise<Map<string, number>> {
  const out = new Map<string, number>();
  for (const n of names) {
    for (const line of (await registry.getSingleMetricAsString(n)).split('\n')) {
      if (line === '' || line.startsWith('#')) continue;
      const at = line.lastIndexOf(' ');
      out.set(line.slice(0, at), Number(line.slice(at + 1)));
    }
  }
  return out;
}

/** Same series, same values; a _sum may differ in its last bits (the tally adds durations in another order). */
async function same(a: Registry, b: Registry): Promise<void> {
  const x = await text(a);
  const y = await text(b);
  expect([...x.keys()].sort()).toEqual([...y.keys()].sort());
  for (const [k, v] of x) {
    const w = y.get(k) as number;
    if (k.includes('_sum')) expect(Math.abs(v - w)).toBeLessThanOrEqual(1e-12 * Math.max(1, Math.abs(w)));
    else expect(v).toBe(w);
  }
}

const post: fc.Arbitrary<Post> = fc.record({
  transport: fc.constantFrom('tcp' as const, 'uds' as const),
  direction: fc.constantFrom('read' as const, 'write' as const),
  bytes: fc.integer({ min: 0, max: 1 << 30 }),
  requests: fc.integer({ min: 1, max: 10_000 }),
  // Exactly on a bound (goes in that bucket), between bounds, 0, and past the last bound (+Inf only).
  seconds: fc.oneof(fc.constantFrom(...DURATION_BUCKETS, 0, 31, 1e-9), fc.double({ min: 0, max: 40, noNaN: true })),
  ok: fc.boolean(),
});

describe('EngineMetrics tallies', () => {
  it('read between posts at random points, the metrics text equals one prom-client call per post (property)', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(fc.tuple(post, fc.boolean()), { minLength: 1, maxLength: 60 }), async (steps) => {
        const a = new Registry();
        const b = new Registry();
        const m = new EngineMetrics({ registry: a });
        const d = direct(b);
        for (const [p, read] of steps) {
          tallied(m, p);
          d.record(p);
          if (read) await same(a, b);
        }
        await same(a, b);
        // A second read adds nothing (the tallies were zeroed by the first).
        await same(a, b);
      }),
      { numRuns: 150 },
    );
  });

  it('engines sharing a registry: reading any of the three metrics adds every engine’s tallies', async () => {
    const registry = new Registry();
    const one = new EngineMetrics({ registry });
    const two = new EngineMetrics({ registry });
    expect(two.bytes).toBe(one.bytes); // shared metric objects
    one.tally('tcp', 'read').done(100, 2);
    two.tally('tcp', 'read').done(50, 1);
    two.tally('tcp', 'write').observe(0.002);
    const bytes = await one.bytes.get();
    expect(bytes.values).toEqual([{ value: 150, labels: { transport: 'tcp', direction: 'read' } }]);
    const ops = await two.operations.get();
    expect(ops.values).toEqual([{ value: 3, labels: { transport: 'tcp', direction: 'read', outcome: 'ok' } }]);
    const count = (await one.duration.get()).values.find((v) => v.metricName === 'tensorwire_transfer_duration_seconds_count');
    expect(count?.value).toBe(1);
  });

  it('a reset drops what was tallied before it, as it drops what was recorded', async () => {
    const registry = new Registry();
    const m = new EngineMetrics({ registry });
    m.tally('tcp', 'read').done(100, 1);
    m.tally('tcp', 'read').observe(0.5);
    registry.resetMetrics();
    m.tally('tcp', 'read').done(7, 1);
    expect((await m.bytes.get()).values).toEqual([{ value: 7, labels: { transport: 'tcp', direction: 'read' } }]);
    expect((await m.duration.get()).values).toEqual([]);
  });

  it('detach flushes, then records each later call at once (nothing lost, nothing twice) and leaves the shared hooks', async () => {
    const registry = new Registry();
    const m = new EngineMetrics({ registry });
    const t = m.tally('tcp', 'write');
    t.done(10, 1);
    t.observe(0.0001);
    m.detach();
    expect(t.bytes).toBe(0); // flushed by detach, before any read
    t.done(5, 1); // a post that finished after the engine closed
    t.observe(2);
    m.detach(); // idempotent
    expect((await m.bytes.get()).values).toEqual([{ value: 15, labels: { transport: 'tcp', direction: 'write' } }]);
    const values = (await m.duration.get()).values;
    expect(values.find((v) => v.metricName?.endsWith('_count'))?.value).toBe(2);
    expect(values.find((v) => v.metricName?.endsWith('_sum'))?.value).toBe(2.0001);
    expect(values.find((v) => (v.labels as Record<string, unknown>)['le'] === 0.0001)?.value).toBe(1);
    expect(values.find((v) => (v.labels as Record<string, unknown>)['le'] === 2.5)?.value).toBe(2);
    // A later engine on the same registry is flushed alone: the detached one holds nothing.
    const next = new EngineMetrics({ registry });
    next.tally('tcp', 'write').done(1, 1);
    expect((await m.bytes.get()).values).toEqual([{ value: 16, labels: { transport: 'tcp', direction: 'write' } }]);
  });

  it('a duration histogram registered under the name with other buckets gets one observe per post (no bulk add)', async () => {
    const registry = new Registry();
    const other = new Histogram({ name: 'tensorwire_transfer_duration_seconds', help: 'theirs', labelNames: ['transport', 'direction'], buckets: [1, 2], registers: [registry] });
    const m = new EngineMetrics({ registry });
    expect(m.duration).toBe(other);
    const t = m.tally('tcp', 'read');
    expect(t.direct).toBe(m);
    t.observe(1.5);
    t.observe(3);
    const values = (await other.get()).values;
    expect(values.find((v) => (v.labels as Record<string, unknown>)['le'] === 2)?.value).toBe(1);
    expect(values.find((v) => v.metricName?.endsWith('_sum'))?.value).toBe(4.5);
    expect(values.find((v) => v.metricName?.endsWith('_count'))?.value).toBe(2);
  });

  it('an engine counts its posts through tallies, over a real transport, and after close()', async () => {
    const registry = new Registry();
    const a = new TransferEngine({ nodeId: 'tally-a', transports: [new TcpTransport()], logger: silentLogger, metrics: { registry } });
    const b = new TransferEngine({ nodeId: 'tally-b', transports: [new TcpTransport()], logger: silentLogger, metrics: false });
    try {
      await Promise.all([a.start(), b.start()]);
      const src = new Uint8Array(4096).fill(7);
      const dst = new Uint8Array(4096);
      const remote = await b.register({ kind: 'host', buffer: src });
      const local = await a.register({ kind: 'host', buffer: dst });
      const requests = [
        { local, localOffset: 0, remote: remote.descriptor, remoteOffset: 0, length: 1024 },
        { local, localOffset: 2048, remote: remote.descriptor, remoteOffset: 2048, length: 2048 },
      ];
      await a.read(b.endpoint(), requests);
      const p = await a.prepare(b.endpoint(), requests, { op: 'read' });
      await p.run();
      await p.run();
      const bytes = () => a.metrics?.bytes.get().then((x) => x.values);
      expect(await bytes()).toEqual([{ value: 3 * 3072, labels: { transport: 'tcp', direction: 'read' } }]);
      await p.run();
      await p.close();
      await a.close();
      // The last post was tallied, never read before close: close added it.
      expect(await bytes()).toEqual([{ value: 4 * 3072, labels: { transport: 'tcp', direction: 'read' } }]);
      const ops = (await a.metrics?.operations.get())?.values;
      expect(ops).toEqual([{ value: 8, labels: { transport: 'tcp', direction: 'read', outcome: 'ok' } }]);
      const count = (await a.metrics?.duration.get())?.values.find((v) => v.metricName?.endsWith('_count'));
      expect(count?.value).toBe(4);
      expect(dst[0]).toBe(7);
    } finally {
      await Promise.all([a.close(), b.close()]);
    }
  });
});
