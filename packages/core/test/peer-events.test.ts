/**
 * PeerEvents (kit/peer-events.ts): every event counted, each kind logged at most once per
 * interval with the number left out since its last line, the prom-client counter incremented
 * with the transport and event labels, none when metrics are off. Fake clock throughout.
 */
import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { Registry } from 'prom-client';
import { TcpTransport, kit, type Logger } from '../src/index.js';

const { PeerEvents, KitMetrics, kitMetrics } = kit;
type Kind = 'refused' | 'idle' | 'violation';
const TEXTS: Record<Kind, kit.PeerEventText> = {
  refused: { level: 'warn', text: 'x connection refused' },
  idle: { level: 'info', text: 'x idle connection retired' },
  violation: { level: 'warn', text: 'x peer disconnected: protocol violation' },
};

interface Line {
  level: string;
  message: string;
  fields: Record<string, unknown>;
}
function recorder(): { logger: Logger; lines: Line[] } {
  const lines: Line[] = [];
  const push = (level: string) => (message: string, fields?: Record<string, unknown>) => lines.push({ level, message, fields: fields ?? {} });
  return { logger: { debug: push('debug'), info: push('info'), warn: push('warn'), error: push('error') }, lines };
}
function clock(): { now: () => number; advance: (ms: number) => void } {
  let t = 1_000_000;
  return { now: () => t, advance: (ms) => (t += ms) };
}
async function counterValues(registry: Registry): Promise<Record<string, number>> {
  const m = registry.getSingleMetric('tensorwire_transport_peer_events_total');
  if (!m) return {};
  const out: Record<string, number> = {};
  for (const v of (await m.get()).values) out[`${v.labels['transport']}/${v.labels['event']}`] = v.value;
  return out;
}

describe('PeerEvents', () => {
  it('counts every event per kind; a table starts every kind at 0; counts() is a snapshot', () => {
    const c = clock();
    const pe = new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, now: c.now });
    expect(pe.counts()).toEqual({ refused: 0, idle: 0, violation: 0 });
    const { logger } = recorder();
    for (let i = 0; i < 5; i++) pe.record('refused', 'p', 'why', logger);
    pe.record('idle', undefined, 'why', undefined); // no logger: still counted
    const snap = pe.counts();
    expect(snap).toEqual({ refused: 5, idle: 1, violation: 0 });
    pe.record('violation', 'p', 'why', logger);
    expect(snap.violation).toBe(0);
    expect(pe.count('violation')).toBe(1);
  });

  it('an open set of kinds (texts as a function) lists only kinds that happened', () => {
    const pe = new PeerEvents<string>({ transport: 'rdma', texts: (e) => ({ level: 'warn', text: `rdma peer disconnected: ${e}` }) });
    expect(pe.counts()).toEqual({});
    const { logger, lines } = recorder();
    pe.record('busy', 'n/1', 'full', logger);
    expect(pe.counts()).toEqual({ busy: 1 });
    expect(pe.counts()['other']).toBeUndefined();
    expect(lines).toEqual([{ level: 'warn', message: 'rdma peer disconnected: busy', fields: { event: 'busy', peer: 'n/1', reason: 'full', count: 1 } }]);
  });

  it('logs each kind at most once a second, the next line with the number suppressed since the last', () => {
    const c = clock();
    const pe = new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, now: c.now });
    const { logger, lines } = recorder();
    expect(pe.record('refused', 'p1', 'r1', logger)).toBe(true);
    for (let i = 0; i < 9; i++) {
      c.advance(100);
      expect(pe.record('refused', 'p2', 'r2', logger)).toBe(false);
    }
    // Another kind has its own interval.
    expect(pe.record('idle', 'p3', 'r3', logger)).toBe(true);
    expect(lines.map((l) => l.message)).toEqual(['x connection refused', 'x idle connection retired']);
    expect(lines[0]).toEqual({ level: 'warn', message: 'x connection refused', fields: { event: 'refused', peer: 'p1', reason: 'r1', count: 1 } });
    expect(lines[1]?.level).toBe('info');
    c.advance(99); // 999 ms after the first line
    expect(pe.record('refused', 'p4', 'r4', logger)).toBe(false);
    c.advance(1); // 1000 ms: a new line, saying 10 were left out
    expect(pe.record('refused', 'p5', 'r5', logger)).toBe(true);
    expect(lines[2]).toEqual({ level: 'warn', message: 'x connection refused', fields: { event: 'refused', peer: 'p5', reason: 'r5', count: 12, suppressed: 10 } });
    // The suppressed count starts again from 0 after a line.
    c.advance(1000);
    pe.record('refused', 'p6', 'r6', logger);
    expect(lines[3]?.fields).toEqual({ event: 'refused', peer: 'p6', reason: 'r6', count: 13 });
    expect(pe.counts()).toEqual({ refused: 13, idle: 1, violation: 0 });
  });

  it('property: matches a model of the throttle (which events are logged, their count and suppressed fields)', () => {
    fc.assert(
      fc.property(fc.array(fc.tuple(fc.constantFrom<Kind>('refused', 'idle', 'violation'), fc.integer({ min: 0, max: 1500 })), { maxLength: 200 }), (steps) => {
        const c = clock();
        const pe = new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, now: c.now });
        const { logger, lines } = recorder();
        const last = new Map<Kind, number>();
        const left = new Map<Kind, number>();
        const counts = { refused: 0, idle: 0, violation: 0 };
        const expected: Record<string, unknown>[] = [];
        for (const [i, [kind, dt]] of steps.entries()) {
          c.advance(dt);
          counts[kind]++;
          const l = last.get(kind);
          const logs = l === undefined || c.now() - l >= 1000;
          if (logs) {
            last.set(kind, c.now());
            const s = left.get(kind) ?? 0;
            left.set(kind, 0);
            expected.push({ event: kind, peer: undefined, reason: String(i), count: counts[kind], ...(s > 0 ? { suppressed: s } : {}) });
          } else {
            left.set(kind, (left.get(kind) ?? 0) + 1);
          }
          expect(pe.record(kind, undefined, String(i), logger)).toBe(logs);
        }
        expect(lines.map((x) => x.fields)).toEqual(expected);
        expect(pe.counts()).toEqual(counts);
      }),
      { numRuns: 200 },
    );
  });

  it('with no logger an event is counted but starts no interval', () => {
    const c = clock();
    const pe = new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, now: c.now });
    pe.record('refused', undefined, '', undefined);
    const { logger, lines } = recorder();
    expect(pe.record('refused', undefined, '', logger)).toBe(true);
    expect(lines).toHaveLength(1);
    expect(pe.count('refused')).toBe(2);
  });

  it('increments the prom-client counter with the transport and event labels; transports sharing a registry share it', async () => {
    const registry = new Registry();
    const a = new PeerEvents<Kind>({ transport: 'cuda-ipc', texts: TEXTS, counter: new KitMetrics({ registry }).peerEvents });
    const b = new PeerEvents<Kind>({ transport: 'tcp', texts: TEXTS, counter: kitMetrics({ registry })?.peerEvents });
    const { logger } = recorder();
    for (let i = 0; i < 3; i++) a.record('refused', undefined, '', logger); // throttled logs, all counted
    a.record('idle', undefined, '', undefined);
    b.record('refused', undefined, '', logger);
    expect(await counterValues(registry)).toEqual({ 'cuda-ipc/refused': 3, 'cuda-ipc/idle': 1, 'tcp/refused': 1 });
  });

  it('honours the metric prefix', async () => {
    const registry = new Registry();
    const m = new KitMetrics({ registry, prefix: 'svc_' });
    new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, counter: m.peerEvents }).record('idle', undefined, '', undefined);
    expect(registry.getSingleMetric('svc_transport_peer_events_total')).toBeDefined();
    expect(registry.getSingleMetric('tensorwire_transport_peer_events_total')).toBeUndefined();
  });

  it('metrics false: no KitMetrics, no counter; default: a private registry per transport', async () => {
    expect(kitMetrics(false)).toBeUndefined();
    const pe = new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, counter: kitMetrics(false)?.peerEvents });
    pe.record('refused', undefined, '', undefined);
    expect(pe.count('refused')).toBe(1);
    const m1 = kitMetrics(undefined);
    const m2 = kitMetrics({});
    expect(m1?.registry).toBeInstanceOf(Registry);
    expect(m1?.registry).not.toBe(m2?.registry);
    expect(await counterValues(m1!.registry)).toEqual({});
  });

  it('rejects a bad interval', () => {
    expect(() => new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, intervalMs: -1 })).toThrow(RangeError);
    expect(() => new PeerEvents<Kind>({ transport: 'x', texts: TEXTS, intervalMs: Number.NaN })).toThrow(RangeError);
  });

  it('StreamTransport (TCP): peer events reach peerEventCounts and the counter with transport="tcp"; metrics false: no counter', async () => {
    const registry = new Registry();
    const t = new TcpTransport({ metrics: { registry } });
    const off = new TcpTransport({ metrics: false });
    try {
      t.peerEvent('idle', 'p', 'retired');
      t.peerEvent('idle', 'p', 'retired');
      t.peerEvent('connections', undefined, 'full');
      expect(t.peerEventCounts).toEqual({ request_queue: 0, protocol_violation: 0, connections: 1, peer_connections: 0, pending_handshakes: 0, handshake_timeout: 0, idle: 2 });
      expect(await counterValues(registry)).toEqual({ 'tcp/idle': 2, 'tcp/connections': 1 });
      expect(off.metrics).toBeUndefined();
      off.peerEvent('idle', 'p', 'retired');
      expect(off.peerEventCounts.idle).toBe(1);
    } finally {
      await t.close();
      await off.close();
    }
  });
});
