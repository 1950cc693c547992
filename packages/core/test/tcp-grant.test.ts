/**
 * Range grants in the TCP transport (register once, grant per lease): the wire's granted range
 * index, the responder's O(1) check against the granted range (never the whole registration),
 * revocation (O(1), waiting only for the grant's own in-flight use, ended with its
 * registration), and the cost of a grant (one table entry, one token, whatever its size).
 *
 * Most cases talk to the holder over a raw socket, as a hostile peer would: it holds a grant's
 * token and forges everything else.
 */
import type net from 'node:net';
import fc from 'fast-check';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { ErrorCode, InvalidInputError, TransferEngine, silentLogger, type Grant, type TensorwireError } from '../src/index.js';
import * as tcpFrames from '../src/tcp/frames.js';
import { TcpTransport } from '../src/tcp/transport.js';
import { hostile, holderNode, type Frame } from './helpers/raw-peer.js';

let nodes = 0;
import { pattern } from '../src/testing/pattern.js';
import { GRANT_STRIDE, type GrantRanges, type NodeIdentity, type TransportRegistration } from '../src/transport.js';

const { FrameType, HEADER_BYTES, RANGE_ENTRY_BYTES, RangeEntry, decodeError, decodeVecHead, encodeReadvReq, encodeWritevReq, vecHeadBytes } = tcpFrames;
type VecRange = tcpFrames.VecRange;


/** One request frame, answered: the frames back, in order. */
async function ask(target: { id: NodeIdentity; port: number }, wire: Buffer[]): Promise<Frame[]> {
  const res = await hostile(target, wire, { ms: 5000, until: (f) => f.length >= wire.length });
  expect(res.closedByPeer).toBe(false);
  expect(res.frames.map((f) => f.reqId)).toEqual(wire.map((w) => w.readUInt32BE(4)));
  return res.frames;
}

/** GrantRanges over `handles`: [handle index, offset, length] per range. */
function grantRanges(handles: object[], list: readonly (readonly [number, number, number])[]): GrantRanges {
  const ranges = new Float64Array(list.length * GRANT_STRIDE);
  let bytes = 0;
  list.forEach((r, k) => {
    ranges.set(r, k * GRANT_STRIDE);
    bytes += r[2];
  });
  return { handles, count: list.length, ranges, bytes };
}

describe('tcp vector heads carry the granted range index', () => {
  const tokenArb = fc.uint8Array({ minLength: 16, maxLength: 16 });
  const rangeArb = (tokens: number) =>
    fc.record({
      token: fc.integer({ min: 0, max: tokens - 1 }),
      range: fc.oneof(fc.constant(0), fc.integer({ min: 1, max: 20 }), fc.constant(0xffffffff), fc.integer({ min: 0, max: 0xffffffff })),
      offset: fc.oneof(fc.integer({ min: 0, max: 2 ** 32 + 5 }), fc.constant(Number.MAX_SAFE_INTEGER), fc.constant(2 ** 32)),
      length: fc.oneof(fc.integer({ min: 0, max: 5000 }), fc.constant(0xffffffff)),
    });
  const headArb = fc.array(tokenArb, { minLength: 1, maxLength: 4 }).chain((tokens) => fc.record({ tokens: fc.constant(tokens), ranges: fc.array(rangeArb(tokens.length), { minLength: 1, maxLength: 40 }) }));
  /** What decodeVecHead gives back: `range` only when it is not 0. */
  const normal = (r: VecRange): VecRange => (r.range ? r : { token: r.token, offset: r.offset, length: r.length });

  it('a range entry is 20 bytes: u16 token | u16 0 | u32 range | u32 length | u32 offset high | u32 offset low', () => {
    const f = encodeReadvReq(1, [new Uint8Array(16)], [{ token: 0, range: 0x01020304, offset: 2 ** 40 + 0x0a0b0c0d, length: 0x11223344 }]);
    expect(RANGE_ENTRY_BYTES).toBe(20);
    expect(f.length).toBe(HEADER_BYTES + vecHeadBytes(1, 1));
    const at = HEADER_BYTES + vecHeadBytes(1, 0);
    expect([...f.subarray(at, at + RANGE_ENTRY_BYTES)]).toEqual([0, 0, 0, 0, 1, 2, 3, 4, 0x11, 0x22, 0x33, 0x44, 0, 0, 1, 0, 0x0a, 0x0b, 0x0c, 0x0d]);
    expect([RangeEntry.Token, RangeEntry.Reserved, RangeEntry.Range, RangeEntry.Length, RangeEntry.OffsetHigh, RangeEntry.OffsetLow]).toEqual([0, 2, 4, 8, 12, 16]);
  });

  it('round-trip token, any u32 range index, 53-bit offset and length; WRITEV heads too', () => {
    fc.assert(
      fc.property(headArb, fc.integer({ min: 0, max: 0xffffffff }), ({ tokens, ranges }, reqId) => {
        const frame = encodeReadvReq(reqId, tokens, ranges);
        expect(frame.length - HEADER_BYTES).toBe(vecHeadBytes(tokens.length, ranges.length));
        const back = decodeVecHead(frame.subarray(HEADER_BYTES));
        expect(back.ranges).toEqual(ranges.map(normal));
        const small = ranges.map((r) => ({ ...r, length: 1 + (r.length % 7) }));
        const data = new Uint8Array(small.reduce((s, r) => s + r.length, 0)).fill(9);
        const w = encodeWritevReq(reqId, tokens, small, data);
        const head = w.subarray(HEADER_BYTES, HEADER_BYTES + vecHeadBytes(tokens.length, small.length));
        expect(decodeVecHead(head, data.length).ranges).toEqual(small.map(normal));
        expect(Buffer.compare(w.subarray(HEADER_BYTES + head.length), data)).toBe(0);
      }),
      { numRuns: 1000 },
    );
  });

  it('a mutated or truncated head decodes to ranges inside its own tables or fails with InvalidInputError', () => {
    fc.assert(
      fc.property(headArb, fc.nat(), fc.nat(), ({ tokens, ranges }, cut, flip) => {
        const head = encodeReadvReq(1, tokens, ranges).subarray(HEADER_BYTES);
        for (const bytes of [head.subarray(0, cut % head.length), (() => { const b = Buffer.from(head); b[flip % b.length] = (b[flip % b.length] as number) ^ (1 << (flip % 8)); return b; })()]) {
          try {
            const back = decodeVecHead(bytes);
            for (const r of back.ranges) {
              expect(r.token).toBeLessThan(back.tokens.length);
              expect(r.range ?? 0).toBeLessThanOrEqual(0xffffffff);
            }
          } catch (e) {
            expect(e).toBeInstanceOf(InvalidInputError);
          }
        }
      }),
      { numRuns: 2000 },
    );
  });
});

/**
 * A holder with one registration (the middle of a guarded buffer), a second registration, and
 * grants over them. Every test checks that no byte outside the granted ranges changed.
 */
describe('tcp range grants against a hostile peer holding a token', () => {
  const SIZE = 8192;
  const MAX = 64 * 1024;
  let holder: Awaited<ReturnType<typeof holderNode>>;
  let guard: Uint8Array;
  let inner: Uint8Array;
  let other: Uint8Array;
  let initial: Uint8Array;
  let otherInitial: Uint8Array;
  let reg: TransportRegistration;
  let reg2: TransportRegistration;
  /** G1: four ranges of `inner` (one ≥ 1 KiB, served zero-copy). */
  const G1 = [[0, 100, 50], [0, 1000, 200], [0, 3000, 1], [0, 5000, 2048]] as const;
  let g1: TransportRegistration;
  /** G2: one range of `inner`, longer than G1's range 0. */
  let g2: TransportRegistration;
  /** G3: a range of the second registration, then one of the first. */
  let g3: TransportRegistration;
  const fake = new Uint8Array(16).fill(7);

  beforeAll(async () => {
    holder = await holderNode('granter', { maxChunkBytes: MAX });
    guard = new Uint8Array(SIZE * 3).fill(0x5a);
    inner = guard.subarray(SIZE, 2 * SIZE);
    inner.set(pattern(SIZE, 21));
    other = pattern(4096, 22);
    otherInitial = other.slice();
    initial = guard.slice();
    reg = await holder.t.register({ kind: 'host', buffer: inner });
    reg2 = await holder.t.register({ kind: 'host', buffer: other });
    g1 = holder.t.grant(grantRanges([reg.handle], G1));
    g2 = holder.t.grant(grantRanges([reg.handle], [[0, 500, 300]]));
    g3 = holder.t.grant(grantRanges([reg2.handle, reg.handle], [[0, 10, 100], [1, 8000, 96]]));
  });
  afterAll(async () => {
    await holder.t.close();
  });
  afterEach(() => {
    expect(Buffer.compare(guard, initial)).toBe(0);
    expect(Buffer.compare(other, otherInitial)).toBe(0);
  });

  const at = (off: number, len: number): Buffer => Buffer.from(inner.subarray(off, off + len));

  it('a grant token reads exactly its ranges, by index, offsets inside each range; the payload is the token alone', async () => {
    expect(g1.payload.length).toBe(16);
    const ranges: VecRange[] = [
      { token: 0, range: 3, offset: 7, length: 2041 },
      { token: 0, range: 0, offset: 0, length: 50 },
      { token: 0, range: 1, offset: 199, length: 1 },
      { token: 0, range: 2, offset: 0, length: 1 },
      { token: 1, range: 0, offset: 0, length: 300 },
      { token: 2, range: 0, offset: 0, length: 100 },
      { token: 2, range: 1, offset: 90, length: 6 },
      { token: 3, range: 0, offset: SIZE - 16, length: 16 },
    ];
    const [f] = await ask(holder, [encodeReadvReq(1, [g1.payload, g2.payload, g3.payload, reg.payload], ranges)]);
    expect(f?.type).toBe(FrameType.ReadvData);
    const want = Buffer.concat([at(5007, 2041), at(100, 50), at(1199, 1), at(3000, 1), at(500, 300), Buffer.from(other.subarray(10, 110)), at(8090, 6), at(SIZE - 16, 16)]);
    expect(Buffer.compare(f!.body, want)).toBe(0);
  });

  // One bad range among good ones: [what, the bad range, code, message].
  const bad: [string, VecRange, string, RegExp][] = [
    ['range index = count', { token: 0, range: 4, offset: 0, length: 1 }, 'NO_SUCH_RANGE', /granted range 4 does not exist \(the grant has 4 ranges\)/],
    ['range index 2^32-1', { token: 0, range: 0xffffffff, offset: 0, length: 1 }, 'NO_SUCH_RANGE', /granted range 4294967295 does not exist/],
    ['one byte past range 0', { token: 0, range: 0, offset: 0, length: 51 }, 'OUT_OF_BOUNDS', /exceeds granted range 0 of 50 bytes/],
    ['starting at the end of range 0', { token: 0, range: 0, offset: 50, length: 1 }, 'OUT_OF_BOUNDS', /granted range 0/],
    ['past range 1', { token: 0, range: 1, offset: 199, length: 2 }, 'OUT_OF_BOUNDS', /granted range 1 of 200/],
    ['past a one-byte range', { token: 0, range: 2, offset: 1, length: 1 }, 'OUT_OF_BOUNDS', /granted range 2 of 1/],
    ['an offset of 2^32 (high word)', { token: 0, range: 0, offset: 2 ** 32, length: 1 }, 'OUT_OF_BOUNDS', /granted range 0/],
    ['an offset of 2^53-1', { token: 0, range: 3, offset: 2 ** 53 - 1, length: 1 }, 'OUT_OF_BOUNDS', /granted range 3/],
    ['a range index into a whole registration', { token: 3, range: 1, offset: 0, length: 1 }, 'NO_SUCH_RANGE', /granted range 1 does not exist \(a whole registration has only range 0\)/],
    ['another grant\'s range index (G2 has one range)', { token: 1, range: 1, offset: 0, length: 1 }, 'NO_SUCH_RANGE', /granted range 1/],
    ['G2\'s range length, not G1\'s', { token: 1, range: 0, offset: 0, length: 301 }, 'OUT_OF_BOUNDS', /granted range 0 of 300/],
    ['past a range of the second registration', { token: 2, range: 0, offset: 1, length: 100 }, 'OUT_OF_BOUNDS', /granted range 0 of 100/],
    ['past the end of a grant\'s last range (and its registration)', { token: 2, range: 1, offset: 96, length: 1 }, 'OUT_OF_BOUNDS', /granted range 1 of 96/],
    ['an unknown token', { token: 4, range: 0, offset: 0, length: 1 }, 'UNKNOWN_GRANT', /no registration or grant/],
  ];
  const good: VecRange[] = [
    { token: 0, range: 1, offset: 0, length: 200 },
    { token: 1, range: 0, offset: 10, length: 20 },
    { token: 0, range: 3, offset: 0, length: 2048 },
    { token: 2, range: 1, offset: 0, length: 96 },
  ];

  it('not one byte outside the granted ranges: a bad range fails its READV and WRITEV whole, named by index, and nothing lands', async () => {
    const tokens = (): Uint8Array[] => [g1.payload, g2.payload, g3.payload, reg.payload, fake];
    for (const [what, r, code, message] of bad) {
      for (const place of [0, 2, good.length]) {
        const list = [...good.slice(0, place), r, ...good.slice(place)];
        const data = Buffer.alloc(list.reduce((s, x) => s + x.length, 0), 0xc3);
        const frames = await ask(holder, [encodeReadvReq(1, tokens(), list), encodeWritevReq(2, tokens(), list, data)]);
        for (const f of frames) {
          expect(f.type, what).toBe(FrameType.Error);
          const e = decodeError(f.body);
          expect(e, what).toMatchObject({ code, range: place });
          expect(e.message, what).toMatch(message);
        }
        expect(Buffer.compare(guard, initial), what).toBe(0);
        expect(Buffer.compare(other, otherInitial), what).toBe(0);
      }
    }
  });

  it('a WRITEV through a grant lands in the granted ranges only', async () => {
    const data = Buffer.from(pattern(200 + 20 + 2048 + 96 + 100, 23));
    const list = [...good, { token: 2, range: 0, offset: 0, length: 100 }];
    const [f] = await ask(holder, [encodeWritevReq(3, [g1.payload, g2.payload, g3.payload], list, data)]);
    expect(f?.type).toBe(FrameType.WritevAck);
    const want = initial.slice();
    let p = 0;
    for (const [off, len] of [[1000, 200], [510, 20], [5000, 2048], [8000, 96]] as const) {
      want.set(data.subarray(p, p + len), SIZE + off);
      p += len;
    }
    expect(Buffer.compare(guard, want)).toBe(0);
    expect(Buffer.compare(other.subarray(10, 110), data.subarray(p))).toBe(0);
    guard.set(initial);
    other.set(otherInitial);
  });

  it('a revoked grant is REVOKED while other grants and the registration keep serving; revoking a registration ends its grants', async () => {
    const g4 = holder.t.grant(grantRanges([reg.handle], [[0, 100, 50]]));
    const read = (token: Uint8Array, range = 0, length = 1): Buffer => encodeReadvReq(1, [token], [{ token: 0, range, offset: 0, length }]);
    expect((await ask(holder, [read(g4.payload)]))[0]?.type).toBe(FrameType.ReadvData);
    const liveBefore = holder.t.rangeGrantCount;
    expect(holder.t.rangeGrantsOver(reg.handle)).toBe(4); // g1, g2, g3, g4
    await holder.t.revokeGrant(g4.handle);
    await holder.t.revokeGrant(g4.handle); // idempotent
    expect(holder.t.rangeGrantCount).toBe(liveBefore - 1);
    expect(holder.t.rangeGrantsOver(reg.handle)).toBe(3); // a revoked grant is not kept with its registration
    const [r1, r2, r3] = await ask(holder, [read(g4.payload), read(g1.payload, 1), read(reg.payload)]);
    expect(decodeError(r1!.body)).toMatchObject({ code: 'REVOKED', range: 0 });
    expect(r2?.type).toBe(FrameType.ReadvData);
    expect(r3?.type).toBe(FrameType.ReadvData);
    // A registration of its own, with two grants: revoking it ends both, and grants over it are refused.
    const mem = pattern(1000, 24);
    const r = await holder.t.register({ kind: 'host', buffer: mem });
    const a = holder.t.grant(grantRanges([r.handle], [[0, 0, 10]]));
    const b = holder.t.grant(grantRanges([reg2.handle, r.handle], [[0, 0, 10], [1, 500, 10]]));
    const count = holder.t.grantCount;
    await holder.t.revoke(r.handle);
    expect(holder.t.grantCount).toBe(count - 3);
    expect(holder.t.rangeGrantsOver(r.handle)).toBe(0);
    expect(holder.t.rangeGrantsOver(reg2.handle)).toBe(1); // g3 only: b ended with r
    const answers = await ask(holder, [read(a.payload), read(b.payload), read(r.payload)]);
    for (const f of answers) expect(decodeError(f.body).code).toBe('REVOKED');
    expect(() => holder.t.grant(grantRanges([r.handle], [[0, 0, 10]]))).toThrow(InvalidInputError);
    expect(() => holder.t.grant(grantRanges([g1.handle], [[0, 0, 10]]))).toThrow(InvalidInputError);
    await expect(holder.t.revoke(g1.handle)).rejects.toBeInstanceOf(InvalidInputError);
    await expect(holder.t.revokeGrant(reg.handle)).rejects.toBeInstanceOf(InvalidInputError);
    await holder.t.revokeGrant(b.handle); // already ended with its registration: resolves
  });

  // Random grants over `inner`, random requests inside and outside them.
  const layoutArb = fc
    .array(fc.record({ gap: fc.integer({ min: 0, max: 300 }), len: fc.oneof(fc.integer({ min: 1, max: 64 }), fc.integer({ min: 65, max: 1500 })) }), { minLength: 1, maxLength: 10 })
    .map((specs) => {
      const out: [number, number][] = [];
      let pos = 0;
      for (const s of specs) {
        if (pos + s.gap + s.len > SIZE) break;
        out.push([pos + s.gap, s.len]);
        pos += s.gap + s.len;
      }
      return out.length > 0 ? out : [[0, 1] as [number, number]];
    })
    .chain((l) => fc.shuffledSubarray(l, { minLength: l.length, maxLength: l.length }));
  const specArb = fc.record({
    kind: fc.constantFrom('inside', 'inside', 'inside', 'past', 'index', 'far'),
    k: fc.double({ min: 0, max: 1, noNaN: true, maxExcluded: true }),
    a: fc.double({ min: 0, max: 1, noNaN: true, maxExcluded: true }),
    b: fc.double({ min: 0, max: 1, noNaN: true, maxExcluded: true }),
  });
  const requestArb = fc.record({ write: fc.boolean(), ranges: fc.array(specArb, { minLength: 1, maxLength: 4 }), seed: fc.nat(255) });

  it('property: inside the granted ranges every read returns the right bytes and every write lands exactly; any byte outside is refused', async () => {
    let served = 0;
    let refused = 0;
    await fc.assert(
      fc.asyncProperty(layoutArb, fc.array(requestArb, { minLength: 1, maxLength: 8 }), async (layout, requests) => {
        const g = holder.t.grant(grantRanges([reg.handle], layout.map(([off, len]) => [0, off, len] as const)));
        try {
          const model = guard.slice();
          const expected: ({ code: string; range: number } | { bytes: Buffer } | 'ack')[] = [];
          // Reads first, on a connection of their own, then writes: a READV reply's larger ranges
          // are sent from the registered memory itself, so a later write to the same bytes could
          // overtake them (a read and a write racing on the same bytes; not what this tests).
          const ordered = [...requests.filter((r) => !r.write), ...requests.filter((r) => r.write)];
          const reads = ordered.findIndex((r) => r.write);
          const wire = ordered.map((req, n) => {
            let firstBad: { code: string; range: number } | undefined;
            const where: [number, number][] = []; // absolute offset in `guard`, length
            const ranges = req.ranges.map((s, i): VecRange => {
              const k = Math.floor(s.k * layout.length);
              const [start, rlen] = layout[k] as [number, number];
              let r: VecRange;
              if (s.kind === 'inside') {
                const offset = Math.floor(s.a * rlen);
                r = { token: 0, range: k, offset, length: 1 + Math.floor(s.b * (rlen - offset)) };
              } else if (s.kind === 'past') {
                const offset = Math.floor(s.a * rlen);
                r = { token: 0, range: k, offset, length: rlen - offset + 1 + Math.floor(s.b * 64) };
              } else if (s.kind === 'index') {
                r = { token: 0, range: s.b < 0.2 ? 0xffffffff : layout.length + Math.floor(s.b * 5), offset: 0, length: 1 };
              } else {
                r = { token: 0, range: k, offset: rlen + Math.floor(s.a * 2 ** 40), length: 1 };
              }
              const inside = r.offset + r.length <= rlen && (r.range as number) < layout.length;
              if (!inside) firstBad ??= { code: (r.range as number) >= layout.length ? 'NO_SUCH_RANGE' : 'OUT_OF_BOUNDS', range: i };
              where.push([SIZE + start + r.offset, r.length]);
              return r;
            });
            if (!req.write) {
              expected.push(firstBad ?? { bytes: Buffer.concat(where.map(([o, l]) => model.subarray(o, o + l))) });
              return encodeReadvReq(n + 1, [g.payload], ranges);
            }
            const data = Buffer.alloc(ranges.reduce((s, r) => s + r.length, 0));
            for (let i = 0; i < data.length; i++) data[i] = (req.seed + i * 13) & 0xff;
            if (firstBad) expected.push(firstBad);
            else {
              expected.push('ack');
              let p = 0;
              for (const [o, l] of where) {
                model.set(data.subarray(p, p + l), o);
                p += l;
              }
            }
            return encodeWritevReq(n + 1, [g.payload], ranges, data);
          });
          const cut = reads < 0 ? wire.length : reads;
          const frames = [...(cut > 0 ? await ask(holder, wire.slice(0, cut)) : []), ...(cut < wire.length ? await ask(holder, wire.slice(cut)) : [])];
          for (const [i, want] of expected.entries()) {
            const f = frames[i] as Frame;
            if (want === 'ack') {
              served++;
              expect(f.type).toBe(FrameType.WritevAck);
            } else if ('bytes' in want) {
              served++;
              expect(f.type).toBe(FrameType.ReadvData);
              expect(Buffer.compare(f.body, want.bytes)).toBe(0);
            } else {
              refused++;
              expect(f.type).toBe(FrameType.Error);
              expect(decodeError(f.body)).toMatchObject(want);
            }
          }
          // Writes landed exactly where granted, and not one byte elsewhere changed.
          expect(Buffer.compare(guard, model)).toBe(0);
        } finally {
          guard.set(initial);
          await holder.t.revokeGrant(g.handle);
        }
      }),
      { numRuns: 60 },
    );
    expect(served).toBeGreaterThan(0);
    expect(refused).toBeGreaterThan(0);
  });
});

describe('tcp grant revocation', () => {
  it('revokeGrant waits for in-flight use of that grant only; a peer that stalls it is cut off after the grace', async () => {
    const holder = await holderNode('granter', { revokeGraceMs: 300, sendHighWaterMark: 64 * 1024 });
    try {
      const size = 32 * 1024 * 1024;
      const r = await holder.t.register({ kind: 'host', buffer: pattern(size, 25) });
      const stalled = holder.t.grant(grantRanges([r.handle], [[0, 0, 16 * 1024 * 1024]]));
      const idle = holder.t.grant(grantRanges([r.handle], [[0, 16 * 1024 * 1024, 4096]]));
      // Ask for 16 MiB through `stalled`, twice, and read nothing: the holder's socket keeps
      // sending from that grant's memory.
      let socket: net.Socket | undefined;
      const peer = hostile({ id: holder.id, port: holder.port }, [1, 2].map((id) => encodeReadvReq(id, [stalled.payload], [{ token: 0, offset: 0, length: 16 * 1024 * 1024 }])), {
        ms: 20_000,
        pauseMs: 20_000,
        socket: (s) => (socket = s),
      });
      await new Promise((res) => setTimeout(res, 100));
      expect(holder.t.connectionCount).toBe(1);
      // Revoking the other grant does not wait for the stalled socket, nor cut it off.
      await holder.t.revokeGrant(idle.handle);
      await new Promise((res) => setTimeout(res, 400)); // past the grace
      expect(holder.t.connectionCount).toBe(1);
      // Revoking the stalled grant waits, then closes the socket that holds its memory (the
      // paused peer does not see that until it reads again).
      await holder.t.revokeGrant(stalled.handle);
      await new Promise((res) => setTimeout(res, 50));
      expect(holder.t.connectionCount).toBe(0);
      socket?.destroy();
      await peer;
    } finally {
      await holder.t.close();
    }
  });

  it('revoking a registration waits for in-flight use of the grants over it too', async () => {
    const holder = await holderNode('granter', { revokeGraceMs: 300, sendHighWaterMark: 64 * 1024 });
    try {
      const r = await holder.t.register({ kind: 'host', buffer: pattern(16 * 1024 * 1024, 28) });
      const g = holder.t.grant(grantRanges([r.handle], [[0, 1024, 8 * 1024 * 1024]]));
      let socket: net.Socket | undefined;
      const peer = hostile({ id: holder.id, port: holder.port }, [encodeReadvReq(1, [g.payload], [{ token: 0, offset: 0, length: 8 * 1024 * 1024 }])], {
        ms: 20_000,
        pauseMs: 20_000,
        socket: (s) => (socket = s),
      });
      await new Promise((res) => setTimeout(res, 100));
      expect(holder.t.connectionCount).toBe(1);
      await holder.t.revoke(r.handle);
      // Resolved only once the socket still sending from the grant's memory was closed.
      await new Promise((res) => setTimeout(res, 50));
      expect(holder.t.connectionCount).toBe(0);
      expect(holder.t.rangeGrantCount).toBe(0);
      socket?.destroy();
      await peer;
    } finally {
      await holder.t.close();
    }
  });
});

describe('tcp grants through the engine, revoked while transfers are in flight', () => {
  const engines: TransferEngine[] = [];
  afterEach(async () => {
    await Promise.allSettled(engines.splice(0).map((e) => e.close()));
  });
  async function engine(): Promise<TransferEngine> {
    const e = new TransferEngine({ nodeId: `eg${++nodes}`, transports: [new TcpTransport()], logger: silentLogger });
    await e.start();
    engines.push(e);
    return e;
  }
  const tick = (): Promise<void> => new Promise((r) => setImmediate(r));
  const MiB = 1024 * 1024;
  /** 24 granted ranges of 1 MiB, every other MiB of a 48 MiB region, in a scrambled order. */
  const slots = Array.from({ length: 24 }, (_, k) => ((k * 7) % 24) * 2);

  it('writes: no byte lands in the granted memory after grant.revoke() resolved', async () => {
    const a = await engine();
    const b = await engine();
    const region = new Uint8Array(48 * MiB);
    const reg = await b.register({ kind: 'host', buffer: region });
    const src = pattern(24 * MiB, 26).map((x) => x | 1); // no zero byte: landed bytes are visible
    const local = await a.register({ kind: 'host', buffer: src });
    let raced = 0;
    for (let round = 0; round < 6; round++) {
      region.fill(0);
      const g: Grant = await b.grant(slots.map((s) => ({ registration: reg, offset: s * MiB, length: MiB })));
      const writes = [0, 1, 2].map((part) =>
        a.write(b.endpoint(), slots.slice(part * 8, part * 8 + 8).map((_, j) => ({ local, localOffset: (part * 8 + j) * MiB, remote: g.descriptor, range: part * 8 + j, length: MiB }))),
      );
      const settled = Promise.allSettled(writes);
      // Revoke as soon as the first bytes have landed.
      const firsts = slots.map((s) => s * MiB);
      while (!firsts.some((o) => region[o] !== 0)) await tick();
      await g.revoke();
      const snapshot = region.slice();
      const results = await settled;
      await new Promise((r) => setTimeout(r, 50));
      expect(Buffer.compare(region, snapshot)).toBe(0);
      if (results.some((x) => x.status === 'rejected')) raced++;
      for (const x of results) if (x.status === 'rejected') expect((x.reason as TensorwireError).code).toBe(ErrorCode.RemoteRejected);
      // Outside the granted ranges nothing was ever written.
      for (let s = 1; s < 48; s += 2) expect(region.subarray(s * MiB, (s + 1) * MiB).every((x) => x === 0)).toBe(true);
    }
    expect(raced).toBeGreaterThan(0); // the revocation did race the writes
  });

  it('reads: once grant.revoke() resolved, the holder sends nothing more from that memory', async () => {
    const a = await engine();
    const b = await engine();
    const region = pattern(48 * MiB, 27).map((x) => x & 0x7f); // before revocation: bit 7 clear
    const reg = await b.register({ kind: 'host', buffer: region });
    const dst = new Uint8Array(24 * MiB);
    const local = await a.register({ kind: 'host', buffer: dst });
    let raced = 0;
    for (let round = 0; round < 6; round++) {
      for (let i = 0; i < region.length; i++) region[i] = (region[i] as number) & 0x7f;
      dst.fill(0);
      const g = await b.grant(slots.map((s) => ({ registration: reg, offset: s * MiB, length: MiB })));
      const reads = [0, 1, 2].map((part) =>
        a.read(b.endpoint(), slots.slice(part * 8, part * 8 + 8).map((_, j) => ({ local, localOffset: (part * 8 + j) * MiB, remote: g.descriptor, range: part * 8 + j, length: MiB }))),
      );
      const settled = Promise.allSettled(reads);
      while (!dst.subarray(0, 4096).some((x) => x !== 0) && !dst.subarray(8 * MiB, 8 * MiB + 4096).some((x) => x !== 0)) await tick();
      await g.revoke();
      // The holder reuses the memory at once: every byte it might still send would have bit 7 set.
      for (let i = 0; i < region.length; i++) region[i] = (region[i] as number) | 0x80;
      const results = await settled;
      if (results.some((x) => x.status === 'rejected')) raced++;
      let stale = 0;
      for (let i = 0; i < dst.length; i++) if ((dst[i] as number) & 0x80) stale++;
      expect(stale).toBe(0);
    }
    expect(raced).toBeGreaterThan(0);
  });
});

describe('tcp grant cost', () => {
  it('a grant over 10 or over 10,000 ranges is one token-table entry and a 16-byte payload; revoking it removes that entry', async () => {
    const holder = await holderNode('granter');
    try {
      const r = await holder.t.register({ kind: 'host', buffer: new Uint8Array(10_000 * 64) });
      const base = holder.t.grantCount;
      for (const n of [10, 10_000]) {
        const g = holder.t.grant(grantRanges([r.handle], Array.from({ length: n }, (_, k) => [0, k * 64, 64] as const)));
        expect(g.payload.length).toBe(16);
        expect(holder.t.grantCount).toBe(base + 1);
        expect(holder.t.rangeGrantCount).toBe(1);
        await holder.t.revokeGrant(g.handle);
        expect(holder.t.grantCount).toBe(base);
        expect(holder.t.rangeGrantCount).toBe(0);
      }
    } finally {
      await holder.t.close();
    }
  });

  it('through the engine too: engine.grant over 10,000 ranges adds one entry to the tcp token table', async () => {
    const t = new TcpTransport();
    const e = new TransferEngine({ nodeId: `cost${++nodes}`, transports: [t], logger: silentLogger });
    await e.start();
    try {
      const reg = await e.register({ kind: 'host', buffer: new Uint8Array(10_000 * 64) });
      const base = t.grantCount;
      const ranges = new Float64Array(10_000 * GRANT_STRIDE);
      for (let k = 0; k < 10_000; k++) ranges.set([0, k * 64, 64], k * GRANT_STRIDE);
      const g = await e.grant({ registrations: [reg], ranges });
      expect(t.grantCount).toBe(base + 1);
      await g.revoke();
      expect(t.grantCount).toBe(base);
    } finally {
      await e.close();
    }
  });
});
