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

const { FrameParser, FrameType, decodeHello, encodeHello, decodeReadReq, decodeWriteHead, decodeError, encodeError, frameHeader, HEADER_BYTES } = tcpFrames;

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
    other[3] = 2;
    expect(() => decodeDescriptor(other)).toThrow(/version 2 is not supported/);
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

describe('tcp frame decoders', () => {
  it('control-frame body decoders only throw InvalidInputError', () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 200 }), (b) => {
        onlyInvalidInput(() => decodeHello(b));
        onlyInvalidInput(() => decodeReadReq(b));
        onlyInvalidInput(() => decodeWriteHead(b));
        onlyInvalidInput(() => decodeError(b));
      }),
      { numRuns: 3000 },
    );
    const err = encodeError(7, 'REVOKED', 'gone');
    expect(decodeError(err.subarray(HEADER_BYTES))).toEqual({ code: 'REVOKED', message: 'gone' });
    const hello = { connectionId: new Uint8Array(16).fill(1), streamIndex: 1, streamCount: 2, nodeId: 'a', incarnation: 'b', hostId: 'c', expectedNodeId: 'd', expectedIncarnation: 'e', maxChunkBytes: 1024 };
    const back = decodeHello(encodeHello(hello).subarray(HEADER_BYTES));
    expect({ ...back, connectionId: new Uint8Array(back.connectionId) }).toEqual(hello);
  });

  it('the frame parser, fed any byte stream in any split, never writes outside the targets it handed out and only fails with InvalidInputError', () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 600 }), fc.array(fc.integer({ min: 1, max: 64 }), { minLength: 1, maxLength: 20 }), (bytes, splits) => {
        const guard = new Uint8Array(300).fill(0xee);
        const target = guard.subarray(100, 200); // reads of exactly 100 bytes for request 1 land here
        const sink = {
          onControl: () => undefined,
          readTarget: (reqId: number, length: number) => (reqId === 1 && length === 100 ? target : undefined),
          writeTarget: () => undefined,
          onDataDone: () => undefined,
        };
        const parser = new FrameParser(sink, 1 << 20);
        feedInSplits(parser, bytes, splits);
        expect(guard.subarray(0, 100).every((x) => x === 0xee)).toBe(true);
        expect(guard.subarray(200).every((x) => x === 0xee)).toBe(true);
      }),
      { numRuns: 3000 },
    );
  });

  it('structured frames (valid headers, boundary lengths, random splits) never write outside the targets handed out', () => {
    const types = [FrameType.ReadReq, FrameType.WriteReq, FrameType.ReadData, FrameType.WriteAck, FrameType.Error, FrameType.Goaway, FrameType.Hello, FrameType.HelloAck];
    const frame = fc.record({
      type: fc.constantFrom(...types),
      reqId: fc.constantFrom(1, 2, 3),
      length: fc.oneof(fc.constantFrom(0, 1, 23, 24, 25, 28, 99, 100, 101, 4096, 4097), fc.integer({ min: 0, max: 300 })),
      fill: fc.integer({ min: 0, max: 255 }),
    });
    let sawData = 0;
    fc.assert(
      fc.property(fc.array(frame, { minLength: 1, maxLength: 8 }), fc.array(fc.integer({ min: 1, max: 97 }), { minLength: 1, maxLength: 8 }), (frames, splits) => {
        const guard = new Uint8Array(400).fill(0xee);
        const readTarget = guard.subarray(100, 200); // READ_DATA of exactly 100 bytes for request 1
        const writeTarget = guard.subarray(250, 275); // WRITE_REQ data of exactly 25 bytes for request 2
        const sink = {
          onControl: () => undefined,
          readTarget: (reqId: number, length: number) => (reqId === 1 && length === 100 ? readTarget : undefined),
          writeTarget: (reqId: number, _head: Uint8Array, length: number) => (reqId === 2 && length === 25 ? writeTarget : undefined),
          onDataDone: (_t: number, _r: number, discarded: boolean) => {
            if (!discarded) sawData++;
          },
        };
        const bytes = Buffer.concat(frames.map((f) => Buffer.concat([frameHeader(f.type, f.reqId, f.length), Buffer.alloc(f.length, f.fill)])));
        const parser = new FrameParser(sink, 4096);
        feedInSplits(parser, bytes, splits);
        expect(guard.subarray(0, 100).every((x) => x === 0xee)).toBe(true);
        expect(guard.subarray(200, 250).every((x) => x === 0xee)).toBe(true);
        expect(guard.subarray(275).every((x) => x === 0xee)).toBe(true);
      }),
      { numRuns: 3000 },
    );
    // The generator does reach the data paths (this property is not vacuous).
    expect(sawData).toBeGreaterThan(0);
  });

  it('names what is wrong with a bad header', () => {
    const sink = { onControl: () => undefined, readTarget: () => undefined, writeTarget: () => undefined, onDataDone: () => undefined };
    const frame = (version: number, type: number, reserved: number, len: number): Uint8Array => {
      const b = Buffer.alloc(12);
      b.writeUInt8(version, 0);
      b.writeUInt8(type, 1);
      b.writeUInt16BE(reserved, 2);
      b.writeUInt32BE(len, 8);
      return b;
    };
    expect(() => new FrameParser(sink, 1024).push(frame(2, FrameType.ReadReq, 0, 28))).toThrow(/version 2/);
    expect(() => new FrameParser(sink, 1024).push(frame(1, 0x7f, 0, 0))).toThrow(/unknown frame type/);
    expect(() => new FrameParser(sink, 1024).push(frame(1, FrameType.ReadReq, 1, 28))).toThrow(/reserved/);
    expect(() => new FrameParser(sink, 1024).push(frame(1, FrameType.ReadData, 0, 4096))).toThrow(/out of range/);
    expect(() => new FrameParser(sink, 1024).push(frame(1, FrameType.Error, 0, 1 << 20))).toThrow(/exceeds/);
  });
});
