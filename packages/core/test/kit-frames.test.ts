/**
 * The kit's frame codecs and scatter receiver: every decoder fuzzed (arbitrary and mutated
 * bytes may only give InvalidInputError, never read past the frame or allocate what a peer
 * claims), exact landing of data in destinations however the bytes are split, and byte-for-byte
 * agreement with the TCP transport's wire format.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { InvalidInputError } from '../src/errors.js';
import * as tcpFrames from '../src/tcp/frames.js';
import {
  FrameParser,
  FrameType,
  HEADER_BYTES,
  MAX_CONTROL_BODY,
  MAX_VEC_HEAD_BYTES,
  NO_RANGE,
  PROTOCOL_VERSION,
  checkVecHead,
  decodeError,
  decodeHeader,
  decodeVecHead,
  encodeError,
  encodeGoaway,
  encodeReadvReq,
  encodeWritevReq,
  frameHeader,
  headerProblem,
  vecHeadBytes,
  type FrameSink,
  type ScatterList,
} from '../src/kit/frames.js';
import { HandshakeCodec } from '../src/kit/handshake.js';

function onlyInvalidInput(fn: () => unknown): void {
  try {
    fn();
  } catch (e) {
    expect(e).toBeInstanceOf(InvalidInputError);
  }
}

/** A sink that records everything, and lands READV_DATA / WRITEV data per the given scatter lists. */
function recorder(targets: { readv?: (reqId: number, length: number) => ScatterList | undefined; writev?: (reqId: number, length: number) => ScatterList | undefined } = {}) {
  const events: string[] = [];
  const sink: FrameSink = {
    onControl: (type, reqId, body) => void events.push(`control ${type} ${reqId} ${body.length}`),
    onReadvRequest: (reqId, head) => void events.push(`readv ${reqId} ${head.length}`),
    readvTarget: (reqId, length) => targets.readv?.(reqId, length),
    writevTarget: (reqId, _head, length) => targets.writev?.(reqId, length),
    onDataDone: (type, reqId, discarded) => void events.push(`data ${type} ${reqId} ${discarded}`),
  };
  return { sink, events };
}

function feed(parser: FrameParser, bytes: Uint8Array, splits: readonly number[]): void {
  let off = 0;
  let i = 0;
  while (off < bytes.length) {
    const n = Math.max(1, splits[i++ % splits.length] as number);
    parser.push(bytes.subarray(off, off + n));
    off += n;
  }
}

const token16 = fc.uint8Array({ minLength: 16, maxLength: 16 });
const vecRange = (tokens: number) =>
  fc.record({
    token: fc.integer({ min: 0, max: tokens - 1 }),
    range: fc.integer({ min: 0, max: 0xffffffff }),
    offset: fc.integer({ min: 0, max: Number.MAX_SAFE_INTEGER }),
    length: fc.integer({ min: 0, max: 0xffffffff }),
  });
const vecArb = fc.integer({ min: 1, max: 4 }).chain((t) => fc.record({ tokens: fc.array(token16, { minLength: t, maxLength: t }), ranges: fc.array(vecRange(t), { minLength: 1, maxLength: 16 }) }));

describe('kit frame codecs are the TCP wire format', () => {
  it('vector requests, ERROR, GOAWAY and headers encode byte for byte as tcp/frames.ts does', () => {
    fc.assert(
      fc.property(vecArb, fc.integer({ min: 0, max: 0xffffffff }), fc.uint8Array({ minLength: 1, maxLength: 64 }), (v, reqId, data) => {
        expect(Buffer.compare(encodeReadvReq(reqId, v.tokens, v.ranges), tcpFrames.encodeReadvReq(reqId, v.tokens, v.ranges))).toBe(0);
        expect(Buffer.compare(encodeWritevReq(reqId, v.tokens, v.ranges, data), tcpFrames.encodeWritevReq(reqId, v.tokens, v.ranges, data))).toBe(0);
        expect(Buffer.compare(encodeError(reqId, 'OUT_OF_BOUNDS', 'msg', reqId % 7), tcpFrames.encodeError(reqId, 'OUT_OF_BOUNDS', 'msg', reqId % 7))).toBe(0);
      }),
    );
    expect(Buffer.compare(encodeGoaway(), tcpFrames.frameHeader(tcpFrames.FrameType.Goaway, 0, 0))).toBe(0);
    expect(FrameType).toEqual(tcpFrames.FrameType);
  });

  it("with TCP's magic, HELLO and HELLO_ACK are TCP's frames", () => {
    const codec = new HandshakeCodec('TWH2');
    const hello = { connectionId: new Uint8Array(16).fill(3), streamIndex: 1, streamCount: 4, nodeId: 'a-1', incarnation: 'inc', hostId: 'h_1', expectedNodeId: 'b', expectedIncarnation: 'x', maxChunkBytes: 65536 };
    expect(Buffer.compare(codec.encodeHello(hello), tcpFrames.encodeHello(hello))).toBe(0);
    expect(Buffer.compare(codec.encodeHelloAck({ nodeId: 'b', incarnation: 'x', hostId: 'h', maxChunkBytes: 7 }), tcpFrames.encodeHelloAck('b', 'x', 'h', 7))).toBe(0);
    const back = codec.decodeHello(tcpFrames.encodeHello(hello).subarray(HEADER_BYTES));
    expect({ ...back, connectionId: new Uint8Array(back.connectionId) }).toEqual(hello);
  });
});

describe('kit decoders are bounded (fuzz)', () => {
  it('decodeHeader accepts exactly the headers headerProblem accepts, and only throws InvalidInputError', () => {
    fc.assert(
      fc.property(fc.uint8Array({ minLength: 0, maxLength: 16 }), fc.integer({ min: 1, max: 1 << 24 }), fc.boolean(), (b, max, handshaking) => {
        onlyInvalidInput(() => {
          const h = decodeHeader(b, max, handshaking);
          expect(b[0]).toBe(PROTOCOL_VERSION);
          expect(Object.values(FrameType)).toContain(h.type);
          if (handshaking) expect([FrameType.Hello, FrameType.HelloAck, FrameType.Error]).toContain(h.type);
          if (h.type === FrameType.ReadvData) expect(h.bodyLength).toBeLessThanOrEqual(max);
          if (h.type === FrameType.WritevReq) expect(h.bodyLength).toBeLessThanOrEqual(MAX_VEC_HEAD_BYTES + max);
          if (h.type === FrameType.ReadvReq) expect(h.bodyLength).toBeLessThanOrEqual(MAX_VEC_HEAD_BYTES);
          if (h.type === FrameType.Error || h.type === FrameType.Hello || h.type === FrameType.HelloAck) expect(h.bodyLength).toBeLessThanOrEqual(MAX_CONTROL_BODY);
          if (h.type === FrameType.WritevAck || h.type === FrameType.Goaway) expect(h.bodyLength).toBe(0);
        });
      }),
      { numRuns: 2000 },
    );
  });

  it('header bounds per type: oversize control frames, non-empty ACK/GOAWAY, empty or oversize data, vector frames during the handshake', () => {
    const max = 4096;
    expect(headerProblem(frameHeader(FrameType.Error, 0, MAX_CONTROL_BODY + 1), 0, max)).toMatch(/exceeds/);
    expect(headerProblem(frameHeader(FrameType.Hello, 0, MAX_CONTROL_BODY + 1), 0, max, true)).toMatch(/exceeds/);
    expect(headerProblem(frameHeader(FrameType.Error, 0, MAX_CONTROL_BODY), 0, max)).toBeUndefined();
    expect(headerProblem(frameHeader(FrameType.WritevAck, 0, 1), 0, max)).toMatch(/empty body/);
    expect(headerProblem(frameHeader(FrameType.Goaway, 0, 1), 0, max)).toMatch(/empty body/);
    expect(headerProblem(frameHeader(FrameType.ReadvData, 0, 0), 0, max)).toMatch(/out of range/);
    expect(headerProblem(frameHeader(FrameType.ReadvData, 0, max + 1), 0, max)).toMatch(/out of range/);
    expect(headerProblem(frameHeader(FrameType.ReadvData, 0, max), 0, max)).toBeUndefined();
    expect(headerProblem(frameHeader(FrameType.ReadvReq, 0, MAX_VEC_HEAD_BYTES + 1), 0, max)).toMatch(/out of range/);
    expect(headerProblem(frameHeader(FrameType.WritevReq, 0, MAX_VEC_HEAD_BYTES + max + 1), 0, max)).toMatch(/out of range/);
    for (const t of [FrameType.ReadvReq, FrameType.WritevReq, FrameType.ReadvData, FrameType.WritevAck, FrameType.Goaway]) {
      expect(headerProblem(frameHeader(t, 0, t === FrameType.ReadvData ? 1 : t === FrameType.WritevAck || t === FrameType.Goaway ? 0 : 64), 0, max, true)).toMatch(/before the handshake/);
    }
    const reserved = frameHeader(FrameType.Error, 0, 0);
    reserved[3] = 1;
    expect(headerProblem(reserved, 0, max)).toMatch(/reserved/);
  });

  it('decodeVecHead: mutated or truncated heads decode to ranges inside their own tables, or fail with InvalidInputError', () => {
    fc.assert(
      fc.property(vecArb, fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 6 }), fc.nat(), (v, flips, cut) => {
        const frame = encodeReadvReq(1, v.tokens, v.ranges);
        const head = new Uint8Array(frame.subarray(HEADER_BYTES));
        for (const [at, value] of flips) head[at % head.length] = value;
        const truncated = flips.length % 2 === 1 ? head.subarray(0, cut % (head.length + 1)) : head;
        onlyInvalidInput(() => {
          const d = decodeVecHead(truncated);
          expect(truncated.length).toBe(vecHeadBytes(d.tokens.length, d.ranges.length));
          for (const r of d.ranges) expect(r.token).toBeLessThan(d.tokens.length);
        });
      }),
      { numRuns: 1000 },
    );
  });

  it('checkVecHead: a WRITEV whose lengths do not add up to its data is refused', () => {
    const frame = encodeWritevReq(1, [new Uint8Array(16)], [{ token: 0, offset: 0, length: 3 }, { token: 0, offset: 8, length: 4 }], new Uint8Array(7));
    const head = frame.subarray(HEADER_BYTES, HEADER_BYTES + vecHeadBytes(1, 2));
    expect(() => checkVecHead(head, 7)).not.toThrow();
    expect(() => checkVecHead(head, 6)).toThrow(InvalidInputError);
    expect(() => checkVecHead(head, 8)).toThrow(InvalidInputError);
  });

  it('decodeError: round-trips code, message and range index; arbitrary bodies only give InvalidInputError', () => {
    fc.assert(
      fc.property(fc.stringMatching(/^[A-Z_]{0,40}$/), fc.string({ maxLength: 1200 }), fc.option(fc.integer({ min: 0, max: 0xfffffffe }), { nil: undefined }), (code, message, range) => {
        const e = decodeError(encodeError(1, code, message, range).subarray(HEADER_BYTES));
        expect(e.code).toBe(code);
        expect(e.range).toBe(range);
        expect(Buffer.from(e.message).length).toBeLessThanOrEqual(4 * 1000);
      }),
    );
    expect(decodeError(encodeError(1, 'X', 'm').subarray(HEADER_BYTES)).range).toBe(undefined);
    expect(decodeError(encodeError(1, 'X', 'm', NO_RANGE).subarray(HEADER_BYTES)).range).toBe(undefined);
    fc.assert(fc.property(fc.uint8Array({ maxLength: 80 }), (b) => onlyInvalidInput(() => decodeError(b))));
  });

  it('the parser, fed arbitrary bytes in arbitrary splits, only throws InvalidInputError and then accepts nothing more', () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 600 }), fc.array(fc.integer({ min: 1, max: 64 }), { minLength: 1, maxLength: 8 }), fc.boolean(), (bytes, splits, handshaking) => {
        const { sink, events } = recorder();
        const p = new FrameParser(sink, 1024, { handshaking });
        let threw = false;
        try {
          feed(p, bytes, splits);
        } catch (e) {
          expect(e).toBeInstanceOf(InvalidInputError);
          threw = true;
        }
        if (threw) {
          expect(p.failed).toBe(true);
          const before = events.length;
          p.push(new Uint8Array(64));
          expect(events.length).toBe(before);
        }
        if (handshaking) for (const e of events) expect(e).toMatch(/^control (16|17|5) /);
      }),
      { numRuns: 1500 },
    );
  });

  it('valid frames with mutations: every event the parser reports is a frame inside its bounds', () => {
    const frames = [
      encodeReadvReq(1, [new Uint8Array(16).fill(1)], [{ token: 0, offset: 5, length: 100 }]),
      encodeWritevReq(2, [new Uint8Array(16).fill(2)], [{ token: 0, offset: 0, length: 10 }], new Uint8Array(10).fill(9)),
      encodeError(3, 'REVOKED', 'gone', 0),
      encodeGoaway(),
      Buffer.concat([frameHeader(FrameType.ReadvData, 4, 32), Buffer.alloc(32, 7)]),
    ];
    const stream = Buffer.concat(frames);
    fc.assert(
      fc.property(fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 4 }), fc.array(fc.integer({ min: 1, max: 40 }), { minLength: 1, maxLength: 5 }), (flips, splits) => {
        const bytes = Buffer.from(stream);
        for (const [at, value] of flips) bytes[at % bytes.length] = value;
        const { sink, events } = recorder();
        const p = new FrameParser(sink, 64);
        try {
          feed(p, bytes, splits);
        } catch (e) {
          expect(e).toBeInstanceOf(InvalidInputError);
        }
        for (const e of events) {
          const parts = e.split(' ');
          if (parts[0] === 'control') expect(Number(parts[3])).toBeLessThanOrEqual(MAX_CONTROL_BODY);
          if (parts[0] === 'readv') expect(Number(parts[2])).toBeLessThanOrEqual(MAX_VEC_HEAD_BYTES);
        }
      }),
      { numRuns: 1000 },
    );
  });

  it('a vector head larger than the cap, or READV_DATA beyond the data cap, is refused before its body is read', () => {
    const { sink } = recorder();
    const p = new FrameParser(sink, 1024);
    expect(() => p.push(frameHeader(FrameType.ReadvReq, 1, MAX_VEC_HEAD_BYTES + 8))).toThrow(InvalidInputError);
    const q = new FrameParser(recorder().sink, 1024);
    expect(() => q.push(frameHeader(FrameType.ReadvData, 1, 1025))).toThrow(/out of range/);
    // Counts that claim more than the frame holds are refused at the 8-byte prefix.
    const r = new FrameParser(recorder().sink, 1024);
    const prefix = Buffer.alloc(8);
    prefix.writeUInt16BE(1024, 0);
    prefix.writeUInt32BE(8192, 4);
    expect(() => r.push(Buffer.concat([frameHeader(FrameType.ReadvReq, 1, 64), prefix]))).toThrow(/does not match/);
  });
});

describe('kit scatter receiver', () => {
  // Destination ranges over two buffers, in any order; the data frame is their concatenation.
  const scatterArb = fc
    .array(fc.record({ buffer: fc.integer({ min: 0, max: 1 }), length: fc.integer({ min: 0, max: 300 }), gap: fc.integer({ min: 0, max: 5 }) }), { minLength: 1, maxLength: 30 })
    .filter((rs) => rs.some((r) => r.length > 0));

  function build(rs: { buffer: number; length: number; gap: number }[]) {
    const ends = [0, 0];
    const table = new Float64Array(rs.length * 3);
    rs.forEach((r, i) => {
      const at = ends[r.buffer] as number;
      table[3 * i] = r.buffer;
      table[3 * i + 1] = at + r.gap;
      table[3 * i + 2] = r.length;
      ends[r.buffer] = at + r.gap + r.length;
    });
    const buffers = [new Uint8Array((ends[0] as number) + 7), new Uint8Array((ends[1] as number) + 7)];
    const total = rs.reduce((s, r) => s + r.length, 0);
    const data = Uint8Array.from({ length: total }, (_, i) => (i * 31 + 7) & 0xff || 1);
    const list: ScatterList = { buffers, table, stride: 3, bufferField: 0, offsetField: 1, lengthField: 2, first: 0, count: rs.length };
    return { buffers, table, data, total, list };
  }

  function expected(rs: { buffer: number; length: number; gap: number }[], built: ReturnType<typeof build>): Uint8Array[] {
    const want = built.buffers.map((b) => new Uint8Array(b.length));
    let pos = 0;
    rs.forEach((r, i) => {
      want[r.buffer]?.set(built.data.subarray(pos, pos + r.length), built.table[3 * i + 1] as number);
      pos += r.length;
    });
    return want;
  }

  it('push(): READV_DATA lands exactly in its ranges, nothing else written, however the bytes are split', () => {
    fc.assert(
      fc.property(scatterArb, fc.array(fc.integer({ min: 1, max: 97 }), { minLength: 1, maxLength: 6 }), (rs, splits) => {
        const built = build(rs);
        const { sink, events } = recorder({ readv: (_id, len) => (len === built.total ? built.list : undefined) });
        const p = new FrameParser(sink, 1 << 20);
        feed(p, Buffer.concat([frameHeader(FrameType.ReadvData, 9, built.total), built.data, encodeGoaway()]), splits);
        const want = expected(rs, built);
        for (const [k, b] of built.buffers.entries()) expect(Buffer.compare(b, want[k] as Uint8Array)).toBe(0);
        expect(events).toEqual([`data ${FrameType.ReadvData} 9 false`, `control ${FrameType.Goaway} 0 0`]);
      }),
      { numRuns: 300 },
    );
  });

  it('nextBuffer()/directTarget() + commit(): receiving straight into the destination gives the same bytes', () => {
    fc.assert(
      fc.property(scatterArb, fc.integer({ min: 1, max: 64 }), fc.integer({ min: 1, max: 200 }), (rs, min, chunk) => {
        const built = build(rs);
        const { sink } = recorder({ readv: () => built.list });
        const p = new FrameParser(sink, 1 << 20);
        const wire = Buffer.concat([frameHeader(FrameType.ReadvData, 1, built.total), built.data]);
        let off = 0;
        while (off < wire.length) {
          const direct = p.directTarget(min);
          const dst = direct ?? p.nextBuffer();
          // A direct target is caller memory: the parser must never hand out more than the range still takes.
          const n = Math.min(dst.length, wire.length - off, direct ? dst.length : chunk);
          dst.set(wire.subarray(off, off + n));
          off += n;
          p.commit(n);
        }
        const want = expected(rs, built);
        for (const [k, b] of built.buffers.entries()) expect(Buffer.compare(b, want[k] as Uint8Array)).toBe(0);
      }),
      { numRuns: 300 },
    );
  });

  it('a WRITEV refused by the sink is discarded whole: nothing lands, the next frame parses', () => {
    const { sink, events } = recorder({ writev: () => undefined });
    const p = new FrameParser(sink, 1024);
    p.push(Buffer.concat([encodeWritevReq(5, [new Uint8Array(16)], [{ token: 0, offset: 0, length: 100 }], new Uint8Array(100).fill(1)), encodeGoaway()]));
    expect(events).toEqual([`data ${FrameType.WritevReq} 5 true`, `control ${FrameType.Goaway} 0 0`]);
  });

  it('a scatter list that does not fit its buffers is an internal error, not a write out of bounds', () => {
    const buffers = [new Uint8Array(10)];
    const list: ScatterList = { buffers, table: Float64Array.of(0, 5, 8), stride: 3, bufferField: 0, offsetField: 1, lengthField: 2, first: 0, count: 1 };
    const { sink } = recorder({ readv: () => list });
    const p = new FrameParser(sink, 1024);
    expect(() => p.push(Buffer.concat([frameHeader(FrameType.ReadvData, 1, 8), Buffer.alloc(8, 1)]))).toThrow(/does not fit/);
    expect(buffers[0]?.every((x) => x === 0)).toBe(true);
  });
});
