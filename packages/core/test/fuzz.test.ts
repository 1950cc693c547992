import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import {
  InvalidInputError,
  decodeDescriptor,
  decodeEndpoint,
  decodeTcpEndpoint,
  encodeDescriptor,
  encodeEndpoint,
  encodeTcpEndpoint,
  tcpFrames,
  type MemoryDescriptor,
} from '../src/index.js';

const {
  FrameParser,
  FrameType,
  HEADER_BYTES,
  MAX_VEC_HEAD_BYTES,
  NO_RANGE,
  PROTOCOL_VERSION,
  decodeError,
  decodeHello,
  decodeHelloAck,
  decodeVecHead,
  encodeError,
  encodeHello,
  encodeHelloAck,
  encodeReadvReq,
  encodeWritevReq,
  frameHeader,
  vecHeadBytes,
} = tcpFrames;

/** Feed `bytes` to the parser in pieces of the given sizes (cycled); it may only fail with InvalidInputError. */
function feedInSplits(parser: InstanceType<typeof FrameParser>, bytes: Uint8Array, splits: readonly number[]): void {
  let off = 0;
  let i = 0;
  try {
    while (off < bytes.length) {
      const n = splits[i++ % splits.length] as number;
      parser.push(bytes.subarray(off, off + n));
      off += n;
    }
  } catch (e) {
    expect(e).toBeInstanceOf(InvalidInputError);
  }
}

/** Decoders may only ever throw InvalidInputError. */
function onlyInvalidInput(fn: () => unknown): void {
  try {
    fn();
  } catch (e) {
    expect(e).toBeInstanceOf(InvalidInputError);
  }
}

const token = fc.stringMatching(/^[A-Za-z0-9_-]{1,64}$/);
const owner = fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9_-]{0,20}$/);
const transportName = fc.stringMatching(/^[a-z][a-z0-9-]{0,10}$/);
const descriptorArb: fc.Arbitrary<MemoryDescriptor> = fc
  .record({
    nodeId: owner,
    incarnation: token,
    n: fc.integer({ min: 1, max: 1_000_000 }),
    memoryKind: fc.constantFrom('host' as const, 'cuda' as const),
    byteLength: fc.integer({ min: 1, max: Number.MAX_SAFE_INTEGER }),
    transports: fc.uniqueArray(fc.tuple(transportName, fc.uint8Array({ maxLength: 64 })), { minLength: 1, maxLength: 4, selector: (t) => t[0] }),
  })
  .map((r) => ({
    owner: { nodeId: r.nodeId, incarnation: r.incarnation },
    registrationId: `block:${r.nodeId}:${r.n}`,
    memoryKind: r.memoryKind,
    byteLength: r.byteLength,
    transports: new Map(r.transports),
  }));

describe('descriptor and endpoint codecs', () => {
  it('descriptors round-trip', () => {
    fc.assert(
      fc.property(descriptorArb, (d) => {
        const back = decodeDescriptor(encodeDescriptor(d));
        expect(back.owner).toEqual(d.owner);
        expect(back.registrationId).toBe(d.registrationId);
        expect(back.byteLength).toBe(d.byteLength);
        expect([...back.transports]).toEqual([...d.transports]);
      }),
    );
  });

  it('descriptor decoding survives arbitrary bytes, truncation and bit flips', () => {
    fc.assert(fc.property(fc.uint8Array({ maxLength: 300 }), (bytes) => onlyInvalidInput(() => decodeDescriptor(bytes))), { numRuns: 3000 });
    fc.assert(
      fc.property(descriptorArb, fc.nat(), fc.nat(), (d, cut, flip) => {
        const bytes = encodeDescriptor(d);
        onlyInvalidInput(() => decodeDescriptor(bytes.subarray(0, cut % bytes.length)));
        const flipped = bytes.slice();
        const i = flip % flipped.length;
        flipped[i] = (flipped[i] as number) ^ (1 << flip % 8);
        onlyInvalidInput(() => decodeDescriptor(flipped));
      }),
      { numRuns: 2000 },
    );
  });

  it('rejects a descriptor whose registration id names another owner, or a wrong version', () => {
    const d: MemoryDescriptor = { owner: { nodeId: 'cam', incarnation: 'x' }, registrationId: 'block:cam_left:1', memoryKind: 'host', byteLength: 1, transports: new Map([['tcp', new Uint8Array(16)]]) };
    const ok = encodeDescriptor({ ...d, registrationId: 'block:cam:1' });
    const other = ok.slice();
    other[3] = 1;
    expect(() => decodeDescriptor(other)).toThrow(/version 1 is not supported/);
    // Re-encode by hand with a foreign registration id: the encoder refuses nothing about ownership, the decoder does.
    const foreign = encodeDescriptor(d);
    expect(() => decodeDescriptor(foreign)).toThrow(/does not belong to owner cam/);
  });

  it('endpoints round-trip and survive arbitrary bytes', () => {
    fc.assert(
      fc.property(owner, token, token, fc.uniqueArray(fc.tuple(transportName, fc.uint8Array({ maxLength: 40 })), { minLength: 1, maxLength: 3, selector: (t) => t[0] }), (nodeId, incarnation, hostId, ts) => {
        const e = { identity: { nodeId, incarnation, hostId }, transports: new Map(ts) };
        const back = decodeEndpoint(encodeEndpoint(e));
        expect(back.identity).toEqual(e.identity);
        expect([...back.transports]).toEqual([...e.transports]);
      }),
    );
    fc.assert(fc.property(fc.uint8Array({ maxLength: 200 }), (b) => onlyInvalidInput(() => decodeEndpoint(b))), { numRuns: 3000 });
    fc.assert(fc.property(fc.uint8Array({ maxLength: 64 }), (b) => onlyInvalidInput(() => decodeTcpEndpoint(b))), { numRuns: 2000 });
    expect(decodeTcpEndpoint(encodeTcpEndpoint('127.0.0.1', 4242))).toEqual({ host: '127.0.0.1', port: 4242 });
    expect(() => decodeTcpEndpoint(encodeTcpEndpoint('127.0.0.1', 0))).toThrow(/port is 0/);
  });
});

const tokenArb = fc.uint8Array({ minLength: 16, maxLength: 16 });
const offsetArb = fc.oneof(fc.integer({ min: 0, max: 2 ** 32 + 5 }), fc.constant(Number.MAX_SAFE_INTEGER), fc.constant(2 ** 32), fc.constant(2 ** 32 - 1));
const headArb = fc.array(tokenArb, { minLength: 1, maxLength: 5 }).chain((tokens) =>
  fc.record({
    tokens: fc.constant(tokens),
    ranges: fc.array(fc.record({ token: fc.integer({ min: 0, max: tokens.length - 1 }), offset: offsetArb, length: fc.oneof(fc.integer({ min: 0, max: 5000 }), fc.constant(0xffffffff)) }), { minLength: 1, maxLength: 60 }),
  }),
);

describe('tcp frame decoders', () => {
  it('control-frame and vector-head decoders only throw InvalidInputError', () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 300 }), (b) => {
        onlyInvalidInput(() => decodeHello(b));
        onlyInvalidInput(() => decodeHelloAck(b));
        onlyInvalidInput(() => decodeError(b));
        onlyInvalidInput(() => decodeVecHead(b));
        onlyInvalidInput(() => decodeVecHead(b, 100));
      }),
      { numRuns: 3000 },
    );
    expect(decodeError(encodeError(7, 'REVOKED', 'gone').subarray(HEADER_BYTES))).toEqual({ code: 'REVOKED', message: 'gone', range: undefined });
    expect(decodeError(encodeError(7, 'OUT_OF_BOUNDS', 'far', 4097).subarray(HEADER_BYTES))).toEqual({ code: 'OUT_OF_BOUNDS', message: 'far', range: 4097 });
    const hello = { connectionId: new Uint8Array(16).fill(1), streamIndex: 1, streamCount: 2, nodeId: 'a', incarnation: 'b', hostId: 'c', expectedNodeId: 'd', expectedIncarnation: 'e', maxChunkBytes: 1024 };
    const back = decodeHello(encodeHello(hello).subarray(HEADER_BYTES));
    expect({ ...back, connectionId: new Uint8Array(back.connectionId) }).toEqual(hello);
    expect(decodeHelloAck(encodeHelloAck('n', 'i', 'h', 77).subarray(HEADER_BYTES))).toEqual({ nodeId: 'n', incarnation: 'i', hostId: 'h', maxChunkBytes: 77 });
  });

  it('vector heads round-trip, with 53-bit offsets and without BigInt', () => {
    fc.assert(
      fc.property(headArb, fc.integer({ min: 0, max: 0xffffffff }), ({ tokens, ranges }, reqId) => {
        const frame = encodeReadvReq(reqId, tokens, ranges);
        expect(frame.readUInt8(0)).toBe(PROTOCOL_VERSION);
        expect(frame.readUInt8(1)).toBe(FrameType.ReadvReq);
        expect(frame.readUInt32BE(4)).toBe(reqId);
        expect(frame.readUInt32BE(8)).toBe(frame.length - HEADER_BYTES);
        expect(frame.length - HEADER_BYTES).toBe(vecHeadBytes(tokens.length, ranges.length));
        const back = decodeVecHead(frame.subarray(HEADER_BYTES));
        expect(back.tokens.map((t) => [...t])).toEqual(tokens.map((t) => [...t]));
        expect(back.ranges).toEqual(ranges);
      }),
      { numRuns: 1000 },
    );
    // WRITEV: the head is followed by exactly the data, whose length the ranges add up to.
    const data = Buffer.from('hello, vectored world');
    const w = encodeWritevReq(9, [new Uint8Array(16).fill(3)], [{ token: 0, offset: 2 ** 40 + 3, length: 5 }, { token: 0, offset: 0, length: data.length - 5 }], data);
    const headLen = vecHeadBytes(1, 2);
    expect(w.readUInt32BE(8)).toBe(headLen + data.length);
    expect(decodeVecHead(w.subarray(HEADER_BYTES, HEADER_BYTES + headLen), data.length).ranges[0]).toEqual({ token: 0, offset: 2 ** 40 + 3, length: 5 });
    expect(Buffer.compare(w.subarray(HEADER_BYTES + headLen), data)).toBe(0);
    expect(() => decodeVecHead(w.subarray(HEADER_BYTES, HEADER_BYTES + headLen), data.length + 1)).toThrow(/add up to/);
  });

  it('a mutated or truncated head either decodes to ranges inside its own tables or fails with InvalidInputError', () => {
    fc.assert(
      fc.property(headArb, fc.nat(), fc.nat(), ({ tokens, ranges }, cut, flip) => {
        const head = encodeReadvReq(1, tokens, ranges).subarray(HEADER_BYTES);
        onlyInvalidInput(() => decodeVecHead(head.subarray(0, cut % head.length)));
        const flipped = Buffer.from(head);
        const i = flip % flipped.length;
        flipped[i] = (flipped[i] as number) ^ (1 << flip % 8);
        try {
          const back = decodeVecHead(flipped);
          for (const r of back.ranges) expect(r.token).toBeLessThan(back.tokens.length);
        } catch (e) {
          expect(e).toBeInstanceOf(InvalidInputError);
        }
      }),
      { numRuns: 2000 },
    );
  });
});

/** Two target buffers inside one guarded buffer, and scatter lists over them. */
function targets(): {
  guard: Uint8Array;
  allowed: Uint8Array;
  readScatter: tcpFrames.ScatterList;
  writeScatter: tcpFrames.ScatterList;
  readBytes: number;
  writeBytes: number;
} {
  const guard = new Uint8Array(600).fill(0xee);
  const buffers = [guard.subarray(100, 300), guard.subarray(400, 500)];
  // [buffer, offset, length] per entry. Reads: 100 bytes over three entries; writes: 40 over two.
  const table = new Float64Array([0, 10, 50, 1, 0, 30, 0, 100, 20, 9, 9, 9, 1, 50, 15, 0, 180, 20, 1, 90, 5]);
  const allowed = new Uint8Array(600);
  for (let e = 0; e < table.length / 3; e++) {
    if (e === 3) continue; // a decoy entry outside both lists
    const base = table[e * 3] === 0 ? 100 : 400;
    allowed.fill(1, base + (table[e * 3 + 1] as number), base + (table[e * 3 + 1] as number) + (table[e * 3 + 2] as number));
  }
  const fields = { buffers, table, stride: 3, bufferField: 0, offsetField: 1, lengthField: 2 };
  return { guard, allowed, readScatter: { ...fields, first: 0, count: 3 }, writeScatter: { ...fields, first: 4, count: 3 }, readBytes: 100, writeBytes: 40 };
}

function untouchedOutside(t: ReturnType<typeof targets>): boolean {
  for (let i = 0; i < t.guard.length; i++) if (!t.allowed[i] && t.guard[i] !== 0xee) return false;
  return true;
}

type Event = [string, number, ...unknown[]];

/** A sink that records what the parser tells it and hands out the scatter lists of `t`. */
function sinkFor(t: ReturnType<typeof targets>, events: Event[] = []): tcpFrames.FrameSink {
  return {
    onControl: (type, reqId, body) => void events.push(['control', reqId, type, [...body]]),
    onReadvRequest: (reqId, head) => void events.push(['readv', reqId, [...head]]),
    readvTarget: (reqId, length) => (reqId === 1 && length === t.readBytes ? t.readScatter : undefined),
    writevTarget: (reqId, head, length) => {
      events.push(['writev', reqId, [...head], length]);
      return reqId === 2 && length === t.writeBytes ? t.writeScatter : undefined;
    },
    onDataDone: (type, reqId, discarded) => void events.push(['done', reqId, type, discarded]),
  };
}

/** Feed like an onread socket: straight into a large enough destination, else through staging (up to where one starts). */
function feedDirect(parser: InstanceType<typeof FrameParser>, bytes: Uint8Array, min: number, splits: readonly number[]): void {
  let off = 0;
  let i = 0;
  try {
    while (off < bytes.length) {
      const n = Math.min(splits[i++ % splits.length] as number, bytes.length - off);
      const direct = parser.directTarget(min);
      if (direct) {
        const k = Math.min(n, direct.length);
        direct.set(bytes.subarray(off, off + k));
        off += k;
        parser.commit(k);
      } else {
        // Staged reads stop where a large range starts, as an onread socket's do.
        const k = parser.stagingBytes(n, min);
        expect(k).toBeGreaterThanOrEqual(1);
        parser.push(bytes.subarray(off, off + k));
        off += k;
      }
    }
  } catch (e) {
    expect(e).toBeInstanceOf(InvalidInputError);
  }
}

describe('tcp frame parser', () => {
  it('fed any byte stream in any split, never writes outside the scatter lists it was given and only fails with InvalidInputError', () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 700 }), fc.array(fc.integer({ min: 1, max: 64 }), { minLength: 1, maxLength: 20 }), fc.boolean(), (bytes, splits, direct) => {
        const t = targets();
        const parser = new FrameParser(sinkFor(t), 1 << 20);
        if (direct) feedDirect(parser, bytes, 8, splits);
        else feedInSplits(parser, bytes, splits);
        expect(untouchedOutside(t)).toBe(true);
      }),
      { numRuns: 3000 },
    );
  });

  // Well-formed frames the parser must deliver exactly.
  const frameArb = fc.oneof(
    fc.record({ kind: fc.constant('data' as const), payload: fc.uint8Array({ minLength: 100, maxLength: 100 }) }),
    fc.record({ kind: fc.constant('readv' as const), reqId: fc.integer({ min: 1, max: 9 }), head: headArb }),
    fc.record({ kind: fc.constant('writev' as const), split: fc.integer({ min: 1, max: 39 }), payload: fc.uint8Array({ minLength: 40, maxLength: 40 }), offset: offsetArb }),
    fc.record({ kind: fc.constant('discard' as const), payload: fc.uint8Array({ minLength: 1, maxLength: 300 }) }),
    fc.record({ kind: fc.constant('control' as const), reqId: fc.integer({ min: 0, max: 9 }), code: fc.constantFrom('REVOKED', 'BAD_REQUEST'), range: fc.integer({ min: 0, max: NO_RANGE }) }),
    fc.record({ kind: fc.constant('empty' as const), type: fc.constantFrom(FrameType.WritevAck, FrameType.Goaway), reqId: fc.integer({ min: 0, max: 9 }) }),
  );

  it('delivers well-formed frames exactly, in any split, received directly or through staging', () => {
    let data = 0;
    fc.assert(
      fc.property(fc.array(frameArb, { minLength: 1, maxLength: 8 }), fc.array(fc.integer({ min: 1, max: 97 }), { minLength: 1, maxLength: 8 }), fc.integer({ min: 1, max: 64 }), fc.boolean(), (frames, splits, min, direct) => {
        const t = targets();
        const events: Event[] = [];
        const expected: Event[] = [];
        const want = new Uint8Array(t.guard); // what the targets must hold at the end
        const land = (scatter: tcpFrames.ScatterList, payload: Uint8Array): void => {
          let p = 0;
          for (let e = scatter.first; e < scatter.first + scatter.count; e++) {
            const base = scatter.table[e * 3] === 0 ? 100 : 400;
            const off = scatter.table[e * 3 + 1] as number;
            const len = scatter.table[e * 3 + 2] as number;
            want.set(payload.subarray(p, p + len), base + off);
            p += len;
          }
        };
        const wire = frames.map((f) => {
          switch (f.kind) {
            case 'data':
              expected.push(['done', 1, FrameType.ReadvData, false]);
              land(t.readScatter, f.payload);
              data++;
              return Buffer.concat([frameHeader(FrameType.ReadvData, 1, 100), f.payload]);
            case 'readv': {
              const b = encodeReadvReq(f.reqId, f.head.tokens, f.head.ranges);
              expected.push(['readv', f.reqId, [...b.subarray(HEADER_BYTES)]]);
              return b;
            }
            case 'writev': {
              const ranges = [{ token: 0, offset: f.offset, length: f.split }, { token: 0, offset: 0, length: 40 - f.split }];
              const b = encodeWritevReq(2, [new Uint8Array(16)], ranges, f.payload);
              expected.push(['writev', 2, [...b.subarray(HEADER_BYTES, HEADER_BYTES + vecHeadBytes(1, 2))], 40], ['done', 2, FrameType.WritevReq, false]);
              land(t.writeScatter, f.payload);
              return b;
            }
            case 'discard': {
              const b = encodeWritevReq(3, [new Uint8Array(16), new Uint8Array(16).fill(1)], [{ token: 1, offset: 5, length: f.payload.length }], f.payload);
              expected.push(['writev', 3, [...b.subarray(HEADER_BYTES, HEADER_BYTES + vecHeadBytes(2, 1))], f.payload.length], ['done', 3, FrameType.WritevReq, true]);
              return b;
            }
            case 'control': {
              const b = encodeError(f.reqId, f.code, 'm', f.range);
              expected.push(['control', f.reqId, FrameType.Error, [...b.subarray(HEADER_BYTES)]]);
              return b;
            }
            case 'empty':
              expected.push(['control', f.reqId, f.type, []]);
              return frameHeader(f.type, f.reqId, 0);
          }
        });
        const bytes = Buffer.concat(wire);
        const parser = new FrameParser(sinkFor(t, events), 4096);
        if (direct) feedDirect(parser, bytes, min, splits);
        else feedInSplits(parser, bytes, splits);
        expect(events).toEqual(expected);
        expect(Buffer.compare(t.guard, want)).toBe(0);
      }),
      { numRuns: 2000 },
    );
    expect(data).toBeGreaterThan(0);
  });

  it('a frame that lies about its counts or lengths is a protocol error, and its data goes nowhere', () => {
    const tok = new Uint8Array(16);
    const good = (): Buffer => encodeWritevReq(2, [tok], [{ token: 0, offset: 0, length: 15 }, { token: 0, offset: 0, length: 25 }], new Uint8Array(40).fill(0x77));
    const lies: [string, () => Uint8Array, RegExp][] = [
      ['READV body longer than its head', () => Buffer.concat([(() => { const b = encodeReadvReq(1, [tok], [{ token: 0, offset: 0, length: 1 }]); b.writeUInt32BE(b.length - HEADER_BYTES + 1, 8); return b; })(), Buffer.alloc(1)]), /does not match/],
      ['READV body shorter than its head', () => (() => { const b = encodeReadvReq(1, [tok], [{ token: 0, offset: 0, length: 1 }, { token: 0, offset: 0, length: 1 }]); b.writeUInt32BE(b.length - HEADER_BYTES - 16, 8); return b; })(), /does not match/],
      ['a range names a token beyond the table', () => encodeReadvReq(1, [tok], [{ token: 1, offset: 0, length: 1 }]), /names token 1 of 1/],
      ['reserved bits of a range', () => (() => { const b = encodeReadvReq(1, [tok], [{ token: 0, offset: 0, length: 1 }]); b[HEADER_BYTES + 8 + 16 + 3] = 1; return b; })(), /reserved/],
      ['reserved bits of the counts', () => (() => { const b = encodeReadvReq(1, [tok], [{ token: 0, offset: 0, length: 1 }]); b[HEADER_BYTES + 3] = 1; return b; })(), /reserved/],
      ['zero ranges', () => Buffer.concat([frameHeader(FrameType.ReadvReq, 1, 24), Buffer.from([0, 1, 0, 0, 0, 0, 0, 0]), tok]), /out of range/],
      ['too many ranges', () => Buffer.concat([frameHeader(FrameType.ReadvReq, 1, 40), Buffer.from([0, 1, 0, 0, 0, 0, 0x20, 1]), tok, Buffer.alloc(16)]), /range count 8193/],
      ['zero tokens', () => Buffer.concat([frameHeader(FrameType.ReadvReq, 1, 40), Buffer.from([0, 0, 0, 0, 0, 0, 0, 1]), Buffer.alloc(32)]), /token count 0/],
      ['too many tokens', () => Buffer.concat([frameHeader(FrameType.ReadvReq, 1, 40), Buffer.from([0x04, 0x01, 0, 0, 0, 0, 0, 1]), Buffer.alloc(32)]), /token count 1025/],
      ['WRITEV lengths add up to more than its data', () => (() => { const b = good(); b.writeUInt32BE(26, HEADER_BYTES + 8 + 16 + 16 + 12); return b; })(), /add up to 41/],
      ['WRITEV lengths add up to less than its data', () => (() => { const b = good(); b.writeUInt32BE(24, HEADER_BYTES + 8 + 16 + 16 + 12); return b; })(), /add up to 39/],
      ['WRITEV without data', () => (() => { const b = encodeReadvReq(1, [tok], [{ token: 0, offset: 0, length: 0 }]); b[1] = FrameType.WritevReq; return b; })(), /carries 0 data bytes/],
      ['WRITEV data beyond the cap', () => encodeWritevReq(2, [tok], [{ token: 0, offset: 0, length: 5000 }], new Uint8Array(5000)), /out of range|carries 5000/],
      ['READV_DATA beyond the cap', () => frameHeader(FrameType.ReadvData, 1, 4097), /out of range/],
      ['a vector head beyond the largest', () => frameHeader(FrameType.ReadvReq, 1, MAX_VEC_HEAD_BYTES + 1), /out of range/],
    ];
    for (const [what, make, message] of lies) {
      const t = targets();
      const events: Event[] = [];
      const parser = new FrameParser(sinkFor(t, events), 4096);
      expect(() => parser.push(make()), what).toThrow(InvalidInputError);
      expect(() => new FrameParser(sinkFor(targets()), 4096).push(make()), what).toThrow(message);
      expect(events.filter((e) => e[0] === 'writev' || e[0] === 'readv'), what).toEqual([]);
      expect(t.guard.every((x) => x === 0xee), what).toBe(true);
      // A failed parser takes no more input.
      parser.push(good());
      expect(events, what).toEqual([]);
    }
    // The honest frame the lies were made from is accepted.
    const t = targets();
    const parser = new FrameParser(sinkFor(t), 4096);
    parser.push(good());
    expect(t.guard.subarray(450, 465).every((x) => x === 0x77)).toBe(true);
    expect(t.guard.subarray(280, 300).every((x) => x === 0x77)).toBe(true);
    expect(t.guard.subarray(490, 495).every((x) => x === 0x77)).toBe(true);
    expect(untouchedOutside(t)).toBe(true);
  });

  it('names what is wrong with a bad header', () => {
    const sink = sinkFor(targets());
    const frame = (version: number, type: number, reserved: number, len: number): Uint8Array => {
      const b = Buffer.alloc(12);
      b.writeUInt8(version, 0);
      b.writeUInt8(type, 1);
      b.writeUInt16BE(reserved, 2);
      b.writeUInt32BE(len, 8);
      return b;
    };
    expect(() => new FrameParser(sink, 1024).push(frame(1, FrameType.ReadvReq, 0, 40))).toThrow(/version 1 is not supported/);
    expect(() => new FrameParser(sink, 1024).push(frame(PROTOCOL_VERSION, 0x7f, 0, 0))).toThrow(/unknown frame type/);
    expect(() => new FrameParser(sink, 1024).push(frame(PROTOCOL_VERSION, FrameType.ReadvReq, 1, 40))).toThrow(/reserved/);
    expect(() => new FrameParser(sink, 1024).push(frame(PROTOCOL_VERSION, FrameType.ReadvData, 0, 4096))).toThrow(/out of range/);
    expect(() => new FrameParser(sink, 1024).push(frame(PROTOCOL_VERSION, FrameType.Error, 0, 1 << 20))).toThrow(/exceeds/);
  });
});
