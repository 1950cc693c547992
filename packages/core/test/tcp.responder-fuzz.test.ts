import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { silentLogger, type Logger } from '../src/logger.js';
import * as tcpFrames from '../src/tcp/frames.js';
import { TcpTransport } from '../src/tcp/transport.js';
import { hostile, holderNode, type Frame } from './helpers/raw-peer.js';
import { createTransferBatch } from '../src/transport.js';

const { FrameType, HEADER_BYTES, decodeError, encodeReadvReq, encodeWritevReq, frameHeader, vecHeadBytes } = tcpFrames;


/**
 * A hostile peer against a victim holder: it completes a real handshake, then sends arbitrary
 * frames, including well-formed READV/WRITEV requests with the right token and out-of-range
 * ranges. The responder must never touch memory outside the registration, answer each request
 * whole (data of every range, or one ERROR naming the first bad range), never crash, and keep
 * serving others.
 */
describe('tcp responder against a hostile peer', () => {
  let holder: Awaited<ReturnType<typeof holderNode>>;
  let guard: Uint8Array;
  let inner: Uint8Array;
  let initial: Uint8Array;
  let token: Uint8Array;
  const SIZE = 4096;
  const MAX = 64 * 1024; // the holder's chunk limit: the most one frame may ask for
  const fake = new Uint8Array(16).fill(7);

  beforeAll(async () => {
    holder = await holderNode('victim', { maxChunkBytes: MAX });
    // The registration is the middle of a larger buffer: the guard bands must never change.
    guard = new Uint8Array(SIZE * 3).fill(0x5a);
    inner = guard.subarray(SIZE, 2 * SIZE);
    for (let i = 0; i < SIZE; i++) inner[i] = (i * 7 + 3) & 0xff;
    initial = inner.slice();
    token = (await holder.t.register({ kind: 'host', buffer: inner })).payload;
  });
  afterAll(async () => {
    await holder.t.close();
  });

  function guardsIntact(): boolean {
    return guard.subarray(0, SIZE).every((x) => x === 0x5a) && guard.subarray(2 * SIZE).every((x) => x === 0x5a);
  }

  // Weighted so that whole requests of good ranges (served) are common too, not only refusals.
  const rangeArb = fc.record({
    good: fc.integer({ min: 0, max: 9 }).map((x) => x > 0),
    offset: fc.oneof(
      { arbitrary: fc.integer({ min: 0, max: SIZE / 2 }), weight: 6 },
      fc.integer({ min: 0, max: SIZE * 2 }),
      fc.constant(2 ** 53 - 1),
      fc.constant(SIZE - 1),
      fc.constant(2 ** 32 + 1),
    ),
    length: fc.oneof({ arbitrary: fc.integer({ min: 1, max: 256 }), weight: 6 }, fc.integer({ min: 0, max: SIZE * 2 }), fc.constant(1), fc.constant(MAX), fc.constant(0xffffffff)),
  });
  const requestArb = fc.record({ write: fc.boolean(), ranges: fc.array(rangeArb, { minLength: 1, maxLength: 12 }) });

  /** What the holder must answer: the first bad range and its code, or undefined when all are good. */
  function expectedRefusal(ranges: readonly { good: boolean; offset: number; length: number }[]): { range: number; code: string } | undefined {
    let total = 0;
    for (const [i, r] of ranges.entries()) {
      if (!r.good) return { range: i, code: 'UNKNOWN_GRANT' };
      if (r.length === 0) return { range: i, code: 'BAD_REQUEST' };
      if (r.offset + r.length > SIZE) return { range: i, code: 'OUT_OF_BOUNDS' };
      total += r.length;
      if (total > MAX) return { range: i, code: 'TOO_LARGE' };
    }
    return undefined;
  }

  it('well-formed requests with hostile ranges never touch memory outside the registration, and are answered whole', async () => {
    let refused = 0;
    let served = 0;
    await fc.assert(
      fc.asyncProperty(fc.array(requestArb, { minLength: 1, maxLength: 6 }), async (reqs) => {
        // A WRITEV carries data only where its lengths stay small; writes write what is there
        // already, so the registration must stay exactly as it was.
        const carried = (r: (typeof reqs)[number]): number => r.ranges.reduce((s, x) => s + x.length, 0);
        const sendable = reqs.filter((r) => !r.write || (r.ranges.every((x) => x.length <= SIZE * 2) && carried(r) >= 1 && carried(r) <= MAX));
        if (sendable.length === 0) return;
        const wire = sendable.map((r, i) => {
          const ranges = r.ranges.map((x) => ({ token: x.good ? 0 : 1, offset: x.offset, length: x.length }));
          if (!r.write) return encodeReadvReq(i + 1, [token, fake], ranges);
          const data = Buffer.concat(r.ranges.map((x) => Buffer.from(x.offset + x.length <= SIZE ? initial.subarray(x.offset, x.offset + x.length) : Buffer.alloc(x.length, 0xc3))));
          return encodeWritevReq(i + 1, [token, fake], ranges, data);
        });
        const res = await hostile(holder, wire, { ms: 2000, until: (f) => f.length >= sendable.length });
        expect(guardsIntact()).toBe(true);
        expect(Buffer.compare(inner, initial)).toBe(0);
        expect(res.closedByPeer).toBe(false);
        expect(res.frames.map((f) => f.reqId)).toEqual(sendable.map((_, i) => i + 1));
        for (const [i, r] of sendable.entries()) {
          const f = res.frames[i] as Frame;
          const refusal = expectedRefusal(r.ranges);
          if (refusal) {
            refused++;
            expect(f.type).toBe(FrameType.Error);
            expect(decodeError(f.body)).toMatchObject({ range: refusal.range, code: refusal.code });
          } else if (r.write) {
            served++;
            expect(f.type).toBe(FrameType.WritevAck);
          } else {
            served++;
            expect(f.type).toBe(FrameType.ReadvData);
            expect(Buffer.compare(f.body, Buffer.concat(r.ranges.map((x) => initial.subarray(x.offset, x.offset + x.length))))).toBe(0);
          }
        }
      }),
      { numRuns: 80 },
    );
    expect(refused).toBeGreaterThan(0);
    expect(served).toBeGreaterThan(0);
  });

  it('a READV with one bad range among many gets ERROR with that range\'s index, and no data', async () => {
    const ranges = Array.from({ length: 50 }, (_, i) => ({ token: 0, offset: (i * 61) % (SIZE - 64), length: 64 }));
    const cases: [number, { token: number; offset: number; length: number }, string][] = [
      [37, { token: 0, offset: SIZE - 10, length: 11 }, 'OUT_OF_BOUNDS'],
      [12, { token: 1, offset: 0, length: 1 }, 'UNKNOWN_GRANT'],
      [3, { token: 0, offset: 0, length: 0 }, 'BAD_REQUEST'],
      [49, { token: 0, offset: 2 ** 53 - 1, length: 1 }, 'OUT_OF_BOUNDS'],
    ];
    for (const [at, bad, code] of cases) {
      const list = ranges.map((r, i) => (i === at ? bad : r));
      const res = await hostile(holder, [encodeReadvReq(5, [token, fake], list)], { ms: 2000, until: (f) => f.length >= 1 });
      expect(res.frames).toHaveLength(1);
      const f = res.frames[0] as Frame;
      expect(f.type).toBe(FrameType.Error);
      expect(f.reqId).toBe(5);
      expect(decodeError(f.body)).toMatchObject({ code, range: at });
    }
    // Too much in total: the range that crosses the limit is named.
    const large = Array.from({ length: 20 }, () => ({ token: 0, offset: 0, length: SIZE }));
    const res = await hostile(holder, [encodeReadvReq(6, [token], large)], { ms: 2000, until: (f) => f.length >= 1 });
    expect(decodeError((res.frames[0] as Frame).body)).toMatchObject({ code: 'TOO_LARGE', range: MAX / SIZE });
    // And the same request without the bad range is served in full, ranges back to back.
    const ok = await hostile(holder, [encodeReadvReq(7, [token, fake], ranges)], { ms: 2000, until: (f) => f.length >= 1 });
    expect(ok.frames[0]?.type).toBe(FrameType.ReadvData);
    expect(Buffer.compare(ok.frames[0]!.body, Buffer.concat(ranges.map((r) => inner.subarray(r.offset, r.offset + r.length))))).toBe(0);
  });

  it('a WRITEV with one bad range writes nothing, is answered with ERROR naming it, and the connection stays', async () => {
    const ranges = Array.from({ length: 20 }, (_, i) => ({ token: 0, offset: i * 100, length: 100 }));
    const bad = ranges.map((r, i) => (i === 13 ? { ...r, offset: SIZE - 50 } : r));
    const data = Buffer.alloc(2000, 0xab);
    const res = await hostile(holder, [encodeWritevReq(8, [token], bad, data), encodeReadvReq(9, [token], [{ token: 0, offset: 0, length: 100 }])], { ms: 2000, until: (f) => f.length >= 2 });
    expect(decodeError(res.frames[0]!.body)).toMatchObject({ code: 'OUT_OF_BOUNDS', range: 13 });
    expect(res.frames[1]?.type).toBe(FrameType.ReadvData); // the data was skipped, the stream stayed in sync
    expect(Buffer.compare(inner, initial)).toBe(0);
    // A good one lands exactly, and is acknowledged.
    const good = await hostile(holder, [encodeWritevReq(10, [token], ranges, data)], { ms: 2000, until: (f) => f.length >= 1 });
    expect(good.frames[0]?.type).toBe(FrameType.WritevAck);
    expect(inner.subarray(0, 2000).every((x) => x === 0xab)).toBe(true);
    inner.set(initial);
  });

  it('a frame that lies about its counts or lengths drops the connection, and touches nothing', async () => {
    const honest = (): Buffer => encodeReadvReq(1, [token], [{ token: 0, offset: 0, length: 16 }, { token: 0, offset: 16, length: 16 }]);
    const w = (): Buffer => encodeWritevReq(2, [token], [{ token: 0, offset: 0, length: 16 }], Buffer.alloc(16, 0xee));
    const lies: [string, () => Buffer][] = [
      ['body longer than the head', () => Buffer.concat([(() => { const b = honest(); b.writeUInt32BE(b.readUInt32BE(8) + 16, 8); return b; })(), Buffer.alloc(16)])],
      ['more ranges than the body holds', () => (() => { const b = honest(); b.writeUInt32BE(3, HEADER_BYTES + 4); return b; })()],
      ['token index beyond the table', () => (() => { const b = honest(); b.writeUInt16BE(1, HEADER_BYTES + vecHeadBytes(1, 0)); return b; })()],
      ['reserved bits in a range', () => (() => { const b = honest(); b.writeUInt16BE(1, HEADER_BYTES + vecHeadBytes(1, 0) + tcpFrames.RangeEntry.Reserved); return b; })()],
      ['WRITEV lengths beyond its data', () => (() => { const b = w(); b.writeUInt32BE(17, HEADER_BYTES + vecHeadBytes(1, 0) + tcpFrames.RangeEntry.Length); return b; })()],
      ['WRITEV data beyond the chunk limit', () => Buffer.concat([frameHeader(FrameType.WritevReq, 3, vecHeadBytes(1, 1) + MAX + 1), Buffer.from([0, 1, 0, 0, 0, 0, 0, 1])])],
      ['READV_DATA nobody asked for, too large', () => frameHeader(FrameType.ReadvData, 1, 0xffffffff)],
      ['control frame claiming 4 GiB', () => frameHeader(FrameType.Error, 1, 0xffffffff)],
    ];
    for (const [what, make] of lies) {
      const res = await hostile(holder, [make(), honest()], { ms: 3000 });
      expect(res.closedByPeer, what).toBe(true);
      expect(res.frames.filter((f) => f.type === FrameType.ReadvData), what).toEqual([]);
      expect(guardsIntact(), what).toBe(true);
      expect(Buffer.compare(inner, initial), what).toBe(0);
    }
  });

  it('arbitrary bytes after the handshake never crash the responder, which keeps serving an honest requester', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(fc.uint8Array({ minLength: 1, maxLength: 64 }), { minLength: 1, maxLength: 5 }), async (chunks) => {
        await hostile(holder, chunks, { ms: 40 });
      }),
      { numRuns: 60 },
    );
    // Random bytes behind a valid vector header (counts and tables chosen by fast-check).
    await fc.assert(
      fc.asyncProperty(fc.constantFrom(FrameType.ReadvReq, FrameType.WritevReq), fc.uint8Array({ minLength: 8, maxLength: 200 }), async (type, body) => {
        await hostile(holder, [frameHeader(type, 1, body.length), body], { ms: 40 });
      }),
      { numRuns: 60 },
    );
    expect(guardsIntact()).toBe(true);
    expect(Buffer.compare(inner, initial)).toBe(0);
    const requester = new TcpTransport();
    await requester.start({ identity: { nodeId: 'honest', incarnation: 'h1', hostId: 'h1' }, logger: silentLogger, inbound: () => undefined });
    try {
      const conn = await requester.connect(holder.id, holder.t.endpoint(), { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
      const dst = new Uint8Array(SIZE);
      const local = (await requester.register({ kind: 'host', buffer: dst })).handle;
      const remote = requester.decodeRemote(token, 'host', SIZE);
      const batch = createTransferBatch('read', [
        { local, localOffset: 0, remote, remoteOffset: 2048, length: 2048 },
        { local, localOffset: 2048, remote, remoteOffset: 0, length: 2048 },
      ]);
      await conn.execute(0, batch, { signal: AbortSignal.timeout(10_000), deadline: Date.now() + 10_000 });
      expect(Buffer.compare(dst.subarray(0, 2048), inner.subarray(2048))).toBe(0);
      expect(Buffer.compare(dst.subarray(2048), inner.subarray(0, 2048))).toBe(0);
    } finally {
      await requester.close();
    }
  });
});

describe('tcp responder backpressure is bounded', () => {
  it('a peer that keeps asking without reading is disconnected with a logged reason; an honest peer is unaffected', async () => {
    for (const limits of [{ maxQueuedRequests: 8 }, { maxQueuedRequestBytes: 4096 }]) {
      const warnings: string[] = [];
      const logger: Logger = { ...silentLogger, warn: (m, f) => void warnings.push(`${m} ${JSON.stringify(f)}`) };
      const holder = await holderNode('victim', { sendHighWaterMark: 64 * 1024, ...limits }, logger);
      try {
        const mem = new Uint8Array(4 * 1024 * 1024).fill(1);
        const token = (await holder.t.register({ kind: 'host', buffer: mem })).payload;
        // 200 requests of 1 MiB each (one token, 64 ranges of 16 KiB), and never a byte read.
        const ranges = Array.from({ length: 64 }, (_, i) => ({ token: 0, offset: i * 16384, length: 16384 }));
        const flood = Array.from({ length: 200 }, (_, i) => encodeReadvReq(i + 1, [token], ranges));
        const stalled = hostile(holder, flood, { ms: 10_000, pauseMs: 1500 });
        // Meanwhile an honest requester on its own connection reads normally.
        const requester = new TcpTransport();
        await requester.start({ identity: { nodeId: 'honest', incarnation: 'h2', hostId: 'h1' }, logger: silentLogger, inbound: () => undefined });
        try {
          const conn = await requester.connect(holder.id, holder.t.endpoint(), { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
          const dst = new Uint8Array(1024 * 1024);
          const local = (await requester.register({ kind: 'host', buffer: dst })).handle;
          const remote = requester.decodeRemote(token, 'host', mem.length);
          const batch = createTransferBatch('read', ranges.map((r, i) => ({ local, localOffset: i * 16384, remote, remoteOffset: r.offset, length: r.length })));
          for (let i = 0; i < 5; i++) await conn.execute(0, batch, { signal: AbortSignal.timeout(10_000), deadline: Date.now() + 10_000 });
          expect(dst.every((x) => x === 1)).toBe(true);
          const res = await stalled;
          expect(res.closedByPeer).toBe(true);
          expect(warnings.some((w) => /request queue over its bound/.test(w) && /mallory/.test(w))).toBe(true);
          await conn.execute(0, batch, { signal: AbortSignal.timeout(10_000), deadline: Date.now() + 10_000 });
          expect(conn.isOpen).toBe(true);
        } finally {
          await requester.close();
        }
      } finally {
        await holder.t.close();
      }
    }
  });

  it('within the bound, queued requests are all served once the peer reads again', async () => {
    const holder = await holderNode('victim', { sendHighWaterMark: 64 * 1024 });
    try {
      const mem = new Uint8Array(1024 * 1024);
      for (let i = 0; i < mem.length; i++) mem[i] = i & 0xff;
      const token = (await holder.t.register({ kind: 'host', buffer: mem })).payload;
      const flood = Array.from({ length: 40 }, (_, i) => encodeReadvReq(i + 1, [token], [{ token: 0, offset: i * 1000, length: 200_000 }, { token: 0, offset: 7, length: 100 }]));
      const res = await hostile(holder, flood, { ms: 10_000, until: (f) => f.length >= 40 });
      expect(res.frames.map((f) => f.reqId)).toEqual(flood.map((_, i) => i + 1));
      for (const [i, f] of res.frames.entries()) {
        expect(f.type).toBe(FrameType.ReadvData);
        expect(Buffer.compare(f.body, Buffer.concat([mem.subarray(i * 1000, i * 1000 + 200_000), mem.subarray(7, 107)]))).toBe(0);
      }
    } finally {
      await holder.t.close();
    }
  });
});
