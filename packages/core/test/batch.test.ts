/**
 * Batches through the engine: merge and chunk plans (property tests), bad entries in big
 * batches, overlapping destinations, and prepared transfers.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import {
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  RANGE_STRIDE,
  RangeField,
  TransferEngine,
  silentLogger,
  type Registration,
  type TransferRequest,
} from '../src/index.js';
import { appendMerged, findOverlap, splitIntoBatches } from '../src/plan.js';
import { MemTransport } from './helpers/mem-transport.js';

async function pair(make: () => MemTransport[], extra: Record<string, unknown> = {}) {
  const ta = make();
  const tb = make();
  const a = new TransferEngine({ nodeId: 'a', transports: ta, logger: silentLogger, ...extra });
  const b = new TransferEngine({ nodeId: 'b', transports: tb, logger: silentLogger, ...extra });
  await a.start();
  await b.start();
  return { a, b, ta, tb };
}

/** Byte-level model: which remote byte each local byte should end up holding. */
function expected(requests: readonly { localOffset: number; remoteOffset: number; length: number }[], size: number, src: Uint8Array): Uint8Array {
  const out = new Uint8Array(size);
  for (const r of requests) out.set(src.subarray(r.remoteOffset, r.remoteOffset + r.length), r.localOffset);
  return out;
}

/** Random non-overlapping destination ranges inside [0, size), in random order. */
const rangesArb = (size: number) =>
  fc
    .array(fc.record({ gap: fc.nat(40), length: fc.integer({ min: 1, max: 300 }), remoteOffset: fc.nat(size - 301), contiguous: fc.boolean() }), { minLength: 1, maxLength: 60 })
    .chain((parts) => {
      let at = 0;
      let prevRemoteEnd = 0;
      const list: { localOffset: number; remoteOffset: number; length: number }[] = [];
      for (const p of parts) {
        const localOffset = at + (p.contiguous ? 0 : p.gap);
        if (localOffset + p.length > size) break;
        // "contiguous" asks for a request that continues the previous one on both sides.
        const remoteOffset = p.contiguous && prevRemoteEnd + p.length <= size ? prevRemoteEnd : p.remoteOffset;
        list.push({ localOffset, remoteOffset, length: p.length });
        at = localOffset + p.length;
        prevRemoteEnd = remoteOffset + p.length;
      }
      return fc.constant(list.length > 0 ? list : [{ localOffset: 0, remoteOffset: 0, length: 1 }]);
    });

describe('batch planning (pure)', () => {
  it('merging then chunking moves exactly the bytes the unmerged list names, each once, chunks within the cap', () => {
    fc.assert(
      fc.property(rangesArb(4096), fc.integer({ min: 1, max: 700 }), fc.integer({ min: 1, max: 5 }), fc.nat(7), (list, cap, streams, first) => {
        const ranges = new Float64Array(list.length * RANGE_STRIDE);
        let count = 0;
        list.forEach((r, i) => {
          count = appendMerged(ranges, count, i, 0, r.localOffset, 0, r.remoteOffset, r.length);
        });
        const { batches, chunks } = splitIntoBatches('read', [{}], ['r'], ranges, count, cap, streams, first % streams);
        // Replay the chunks byte by byte: every local byte written maps to the right remote byte.
        const model = new Map<number, number>();
        for (const r of list) for (let k = 0; k < r.length; k++) model.set(r.localOffset + k, r.remoteOffset + k);
        const seen = new Map<number, number>();
        let n = 0;
        for (const b of batches) {
          if (!b) continue;
          for (let i = 0; i < b.count; i++) {
            const at = i * RANGE_STRIDE;
            const len = b.ranges[at + RangeField.Length] as number;
            expect(len).toBeGreaterThanOrEqual(1);
            expect(len).toBeLessThanOrEqual(cap);
            const lo = b.ranges[at + RangeField.LocalOffset] as number;
            const ro = b.ranges[at + RangeField.RemoteOffset] as number;
            const req = b.ranges[at + RangeField.Request] as number;
            expect(req).toBeGreaterThanOrEqual(0);
            expect(req).toBeLessThan(list.length);
            for (let k = 0; k < len; k++) {
              expect(seen.has(lo + k)).toBe(false);
              seen.set(lo + k, ro + k);
            }
            n++;
          }
        }
        expect(n).toBe(chunks);
        expect(seen).toEqual(model);
      }),
      { numRuns: 300 },
    );
  });

  it('findOverlap finds an overlap exactly when two destination ranges share a byte', () => {
    fc.assert(
      fc.property(
        fc.array(fc.record({ region: fc.nat(2), offset: fc.nat(200), length: fc.integer({ min: 1, max: 50 }) }), { minLength: 1, maxLength: 30 }),
        (list) => {
          const ranges = new Float64Array(list.length * RANGE_STRIDE);
          list.forEach((r, i) => {
            const at = i * RANGE_STRIDE;
            ranges[at + RangeField.Request] = i;
            ranges[at + RangeField.Local] = r.region;
            ranges[at + RangeField.LocalOffset] = r.offset;
            ranges[at + RangeField.Length] = r.length;
          });
          let truth = false;
          for (let i = 0; i < list.length && !truth; i++) {
            for (let j = 0; j < i && !truth; j++) {
              const x = list[i] as (typeof list)[number];
              const y = list[j] as (typeof list)[number];
              truth = x.region === y.region && x.offset < y.offset + y.length && y.offset < x.offset + x.length;
            }
          }
          const found = findOverlap(ranges, list.length, 'local', list.map((r) => r.region), 3);
          expect(found !== undefined).toBe(truth);
          if (found) {
            const x = list[found[0]] as (typeof list)[number];
            const y = list[found[1]] as (typeof list)[number];
            expect(x.region === y.region && x.offset < y.offset + y.length && y.offset < x.offset + x.length).toBe(true);
          }
        },
      ),
      { numRuns: 500 },
    );
  });
});

describe('batches through the engine', () => {
  it('random request lists: one read() lands exactly the named bytes; adjacent requests are merged', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport()], { chunkBytes: 128, streamsPerPeer: 3 });
    const src = new Uint8Array(4096).map((_, i) => (i * 7 + 3) & 255);
    const rb = await b.register({ kind: 'host', buffer: src });
    const dst = new Uint8Array(4096);
    const ra = await a.register({ kind: 'host', buffer: dst });
    await fc.assert(
      fc.asyncProperty(rangesArb(4096), async (list) => {
        dst.fill(0);
        const t = ta[0] as MemTransport;
        t.executed.length = 0;
        const report = await a.read(
          b.endpoint(),
          list.map((r) => ({ local: ra, remote: rb.descriptor, ...r })),
        );
        expect(dst).toEqual(expected(list, 4096, src));
        expect(report.bytes).toBe(list.reduce((s, r) => s + r.length, 0));
        let merged = 1;
        for (let i = 1; i < list.length; i++) {
          const p = list[i - 1] as (typeof list)[number];
          const c = list[i] as (typeof list)[number];
          if (!(p.localOffset + p.length === c.localOffset && p.remoteOffset + p.length === c.remoteOffset)) merged++;
        }
        expect(report.ranges).toBe(merged);
        // Moved bytes = named bytes, never more.
        expect(t.executed.reduce((s, e) => s + e.lengths.reduce((x, y) => x + y, 0), 0)).toBe(report.bytes);
      }),
      { numRuns: 60 },
    );
    await a.close();
    await b.close();
  });

  it('10,000 tiny requests are one batch per stream, not one call per request', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport()], { streamsPerPeer: 2 });
    const src = new Uint8Array(80_000).map((_, i) => (i * 13) & 255);
    const rb = await b.register({ kind: 'host', buffer: src });
    const dst = new Uint8Array(40_000);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const requests: TransferRequest[] = [];
    for (let i = 0; i < 10_000; i++) requests.push({ local: ra, localOffset: i * 4, remote: rb.descriptor, remoteOffset: (9_999 - i) * 8, length: 4 });
    const report = await a.read(b.endpoint(), requests);
    const t = ta[0] as MemTransport;
    expect(t.executed.length).toBe(2);
    expect(report.ranges).toBe(10_000);
    for (let i = 0; i < 10_000; i++) expect(dst.subarray(i * 4, i * 4 + 4)).toEqual(src.subarray((9_999 - i) * 8, (9_999 - i) * 8 + 4));
    await a.close();
    await b.close();
  });

  const badEntries: [string, (ra: Registration, rb: Registration, other: Registration) => Partial<TransferRequest>][] = [
    ['out-of-bounds remote range', () => ({ remoteOffset: 79_999, length: 4 })],
    ['out-of-bounds local range', () => ({ localOffset: 39_998, length: 4 })],
    ['negative offset', () => ({ localOffset: -1 })],
    ['fractional length', () => ({ length: 1.5 })],
    ['a foreign descriptor', (_ra, _rb, other) => ({ remote: other.descriptor })],
    ['a garbage descriptor', () => ({ remote: new Uint8Array(40).fill(7) })],
    ['a local registration of another engine', (_ra, _rb, other) => ({ local: other })],
  ];
  for (const [what, make] of badEntries) {
    it(`a batch of 10,000 with ${what} at index 5,000 fails as a whole, naming the index, before anything moves`, async () => {
      const { a, b, ta } = await pair(() => [new MemTransport()]);
      const c = new TransferEngine({ nodeId: 'c', transports: [new MemTransport()], logger: silentLogger });
      await c.start();
      const rb = await b.register({ kind: 'host', buffer: new Uint8Array(80_000).fill(9) });
      const dst = new Uint8Array(40_000);
      const ra = await a.register({ kind: 'host', buffer: dst });
      const other = await c.register({ kind: 'host', buffer: new Uint8Array(80_000) });
      const requests: TransferRequest[] = [];
      for (let i = 0; i < 10_000; i++) requests.push({ local: ra, localOffset: i * 4, remote: rb.descriptor, remoteOffset: i * 8, length: 4 });
      requests[5_000] = { ...(requests[5_000] as TransferRequest), ...make(ra, rb, other) };
      const err = await a.read(b.endpoint(), requests).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(InvalidInputError);
      expect((err as InvalidInputError).details['request']).toBe(5_000);
      expect((err as Error).message).toContain('requests[5000]');
      expect((ta[0] as MemTransport).executed.length).toBe(0);
      expect(dst.every((x) => x === 0)).toBe(true);
      await Promise.all([a.close(), b.close(), c.close()]);
    });
  }

  it('overlapping destinations in one batch are refused (read: local side; write: remote side); overlapping sources are fine', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport()]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(1000).fill(1) });
    const rb2 = await b.register({ kind: 'host', buffer: new Uint8Array(1000).fill(2) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(1000) });
    const ep = b.endpoint();
    const e1 = await a
      .read(ep, [
        { local: ra, localOffset: 500, remote: rb.descriptor, length: 100 },
        { local: ra, localOffset: 0, remote: rb.descriptor, length: 10 },
        { local: ra, localOffset: 590, remote: rb2.descriptor, remoteOffset: 900, length: 20 },
      ])
      .catch((e: unknown) => e);
    expect(e1).toBeInstanceOf(InvalidInputError);
    expect((e1 as InvalidInputError).details['request']).toBe(2);
    // Same sources into distinct destinations: fine.
    await a.read(ep, [
      { local: ra, localOffset: 0, remote: rb.descriptor, length: 100 },
      { local: ra, localOffset: 100, remote: rb.descriptor, length: 100 },
    ]);
    // Write: two requests into one remote range, through two copies of its descriptor.
    const e2 = await a
      .write(ep, [
        { local: ra, localOffset: 0, remote: rb.descriptor, remoteOffset: 10, length: 10 },
        { local: ra, localOffset: 100, remote: rb.descriptor.slice(), remoteOffset: 15, length: 10 },
      ])
      .catch((e: unknown) => e);
    expect(e2).toBeInstanceOf(InvalidInputError);
    expect((e2 as InvalidInputError).details['request']).toBe(1);
    const executed = (ta[0] as MemTransport).executed.length;
    expect(executed).toBeGreaterThan(0); // only the good read ran
    await a.close();
    await b.close();
  });
});

describe('prepared transfers', () => {
  it('posted many times, it gives the same bytes as fresh reads, and picks up new contents each time', async () => {
    const { a, b } = await pair(() => [new MemTransport()], { chunkBytes: 64, streamsPerPeer: 2 });
    const src = new Uint8Array(8192);
    const rb = await b.register({ kind: 'host', buffer: src });
    const dst = new Uint8Array(8192);
    const fresh = new Uint8Array(8192);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const rf = await a.register({ kind: 'host', buffer: fresh });
    await fc.assert(
      fc.asyncProperty(rangesArb(8192), fc.array(fc.integer({ min: 0, max: 255 }), { minLength: 1, maxLength: 4 }), async (list, fills) => {
        const prepared = await a.prepare(b.endpoint(), list.map((r) => ({ local: ra, remote: rb.descriptor, ...r })), { op: 'read' });
        expect(prepared.bytes).toBe(list.reduce((s, r) => s + r.length, 0));
        for (const f of fills) {
          src.fill(f);
          for (let i = 0; i < src.length; i += 97) src[i] = (i + f) & 255;
          dst.fill(0);
          fresh.fill(0);
          const report = await prepared.run();
          await a.read(b.endpoint(), list.map((r) => ({ local: rf, remote: rb.descriptor, ...r })));
          expect(dst).toEqual(fresh);
          expect(report.bytes).toBe(prepared.bytes);
        }
        await prepared.close();
      }),
      { numRuns: 40 },
    );
    await a.close();
    await b.close();
  });

  it('after its local registration is revoked: InvalidInput naming the request', async () => {
    const { a, b } = await pair(() => [new MemTransport()]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(100) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(100) });
    const ra2 = await a.register({ kind: 'host', buffer: new Uint8Array(100) });
    const p = await a.prepare(
      b.endpoint(),
      [
        { local: ra, remote: rb.descriptor, length: 10 },
        { local: ra2, remote: rb.descriptor, length: 10 },
      ],
      { op: 'read' },
    );
    await p.run();
    await ra2.revoke();
    const err = await p.run().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidInputError);
    expect((err as InvalidInputError).details['request']).toBe(1);
    // The engine's own check, before the transport sees the batch.
    expect((err as InvalidInputError).message).toBe(`requests[1].local (${ra2.id}) was revoked`);
    expect((err as InvalidInputError).details['field']).toBe('local');
    await a.close();
    await b.close();
  });

  it('after its connection broke: ConnectionBroken on this post and every later one, never a silent reconnect', async () => {
    const { a, b } = await pair(() => [new MemTransport()]);
    const src = new Uint8Array(100).fill(5);
    const rb = await b.register({ kind: 'host', buffer: src });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(100) });
    const p = await a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'read' });
    await p.run();
    await a.invalidate('b', 'test: connection dropped');
    await expect(p.run()).rejects.toBeInstanceOf(ConnectionBrokenError);
    await expect(p.run()).rejects.toBeInstanceOf(ConnectionBrokenError);
    // A fresh prepare works again.
    const q = await a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'read' });
    await q.run();
    await a.close();
    await b.close();
  });

  it('after the peer restarted (a talks to its new incarnation): ConnectionBroken, not the new peer\'s bytes', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport()]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(100).fill(1) });
    const dst = new Uint8Array(100);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const p = await a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'read' });
    await p.run();
    // b restarts: the old process goes away (its transport reports the connection broken) and
    // a learns about the new incarnation (as through discovery) and talks to it.
    await b.close();
    const t = ta[0] as MemTransport;
    await t.connections[0]?.close(new ConnectionBrokenError('mem: the peer went away'));
    const b2 = new TransferEngine({ nodeId: 'b', transports: [new MemTransport()], logger: silentLogger });
    await b2.start();
    const rb2 = await b2.register({ kind: 'host', buffer: new Uint8Array(100).fill(2) });
    await a.read(b2.endpoint(), [{ local: ra, remote: rb2.descriptor }]);
    dst.fill(0);
    await expect(p.run()).rejects.toBeInstanceOf(ConnectionBrokenError);
    await expect(p.run()).rejects.toBeInstanceOf(ConnectionBrokenError);
    expect(dst.every((x) => x === 0)).toBe(true);
    expect(a.connections().map((c) => c.peer.incarnation)).toEqual([b2.identity.incarnation]);
    expect(t.connections.filter((c) => c.isOpen).length).toBe(1);
    await Promise.all([a.close(), b2.close()]);
  });

  it('while an old incarnation still runs beside the new one, each prepared transfer reads from the incarnation that issued its descriptor', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport()]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(100).fill(1) });
    const dst = new Uint8Array(100);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const old = await a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'read' });
    await old.run(); // the old incarnation's connection is open, and stays open (b is slow to die)
    const b2 = new TransferEngine({ nodeId: 'b', transports: [new MemTransport()], logger: silentLogger });
    await b2.start();
    const rb2 = await b2.register({ kind: 'host', buffer: new Uint8Array(100).fill(2) });
    // Prepared for the new incarnation before any plain read reached it: it opens its own connection.
    const fresh = await a.prepare(b2.endpoint(), [{ local: ra, remote: rb2.descriptor }], { op: 'read' });
    await fresh.run();
    expect(dst.every((x) => x === 2)).toBe(true);
    await old.run();
    expect(dst.every((x) => x === 1)).toBe(true);
    await fresh.run();
    expect(dst.every((x) => x === 2)).toBe(true);
    // Prepared for the old incarnation and never posted: it uses the old one's connection.
    const late = await a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'read' });
    await late.run();
    expect(dst.every((x) => x === 1)).toBe(true);
    const t = ta[0] as MemTransport;
    expect(t.connectCalls).toBe(2);
    expect(t.connections.map((c) => c.isOpen)).toEqual([true, true]);
    expect(a.connections().map((c) => c.peer.incarnation).sort()).toEqual([b.identity.incarnation, b2.identity.incarnation].sort());
    await Promise.all([a.close(), b.close(), b2.close()]);
  });

  it('disposed: posts fail with Closed; close() waits for posts in flight and is idempotent', async () => {
    const { a, b } = await pair(() => [new MemTransport()]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(100).fill(3) });
    const dst = new Uint8Array(100);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const p = await a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'read' });
    let landed = false;
    const first = p.run().then(() => (landed = true));
    const closing = p.close();
    expect(p.closed).toBe(true);
    await expect(p.run()).rejects.toBeInstanceOf(ClosedError);
    await closing;
    expect(landed).toBe(true); // close() resolved only after the post in flight settled
    expect(dst.every((x) => x === 3)).toBe(true);
    await first;
    await p.close();
    await p[Symbol.asyncDispose]();
    await a.close();
    await b.close();
  });

  it('prepare() refuses a bad op and bad requests up front, and closed engines', async () => {
    const { a, b } = await pair(() => [new MemTransport()]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(100) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(100) });
    await expect(a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'copy' as 'read' })).rejects.toBeInstanceOf(InvalidInputError);
    await expect(a.prepare(b.endpoint(), [], { op: 'read' })).rejects.toBeInstanceOf(InvalidInputError);
    await expect(a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor, length: 101 }], { op: 'read' })).rejects.toBeInstanceOf(InvalidInputError);
    const p = await a.prepare(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { op: 'write' });
    await a.close();
    await expect(p.run()).rejects.toBeInstanceOf(ClosedError);
    await b.close();
  });
});
