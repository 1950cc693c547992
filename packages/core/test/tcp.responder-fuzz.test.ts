import net from 'node:net';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TcpTransport, TransferEngine, decodeDescriptor, decodeEndpoint, decodeTcpEndpoint, silentLogger, tcpFrames, type Registration } from '../src/index.js';

const { FrameType, encodeHello, frameHeader } = tcpFrames;

/**
 * A hostile peer: it completes a real handshake, then sends arbitrary frames, including
 * well-formed READ/WRITE requests with the right token and out-of-range offsets. The responder
 * must never touch memory outside the registration, never crash, and keep serving others.
 */
describe('tcp responder against a hostile peer', () => {
  let holder: TransferEngine;
  let reg: Registration;
  let guard: Uint8Array;
  let inner: Uint8Array;
  let token: Uint8Array;
  let port: number;
  const SIZE = 4096;

  beforeAll(async () => {
    holder = new TransferEngine({ nodeId: 'victim', transports: [new TcpTransport()], logger: silentLogger });
    await holder.start();
    // The registration is the middle of a larger buffer: the guard bands must never change.
    guard = new Uint8Array(SIZE * 3).fill(0x5a);
    inner = guard.subarray(SIZE, 2 * SIZE);
    reg = await holder.register({ kind: 'host', buffer: inner });
    token = decodeDescriptor(reg.descriptor).transports.get('tcp') as Uint8Array;
    port = decodeTcpEndpoint(decodeEndpoint(holder.endpoint()).transports.get('tcp') as Uint8Array).port;
  });
  afterAll(async () => {
    await holder.close();
  });

  function hostile(frames: Uint8Array[]): Promise<void> {
    return new Promise((resolve) => {
      const s = net.connect({ port, host: '127.0.0.1' });
      s.on('error', () => undefined);
      s.on('data', () => undefined);
      s.on('close', () => resolve());
      s.on('connect', () => {
        const id = holder.identity;
        s.write(encodeHello({ connectionId: new Uint8Array(16).map(() => Math.floor(Math.random() * 256)), streamIndex: 0, streamCount: 1, nodeId: 'mallory', incarnation: 'm1', hostId: 'h', expectedNodeId: id.nodeId, expectedIncarnation: id.incarnation, maxChunkBytes: 1 << 24 }));
        for (const f of frames) s.write(f);
        setTimeout(() => s.destroy(), 30);
      });
    });
  }

  const request = fc.record({
    type: fc.constantFrom(FrameType.ReadReq, FrameType.WriteReq),
    offset: fc.oneof(fc.integer({ min: 0, max: SIZE * 2 }), fc.constant(2 ** 53 - 1), fc.constant(SIZE - 1)),
    length: fc.oneof(fc.integer({ min: 0, max: SIZE * 2 }), fc.constant(0xffffffff), fc.constant(1)),
    goodToken: fc.boolean(),
  });

  it('well-formed requests with hostile ranges never touch memory outside the registration', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(request, { minLength: 1, maxLength: 6 }), async (reqs) => {
        const frames = reqs.map((r, i) => {
          const tok = r.goodToken ? token : new Uint8Array(16).fill(7);
          if (r.type === FrameType.ReadReq) {
            const body = Buffer.alloc(28);
            body.set(tok, 0);
            body.writeBigUInt64BE(BigInt(r.offset), 16);
            body.writeUInt32BE(r.length >>> 0, 24);
            return Buffer.concat([frameHeader(FrameType.ReadReq, i + 1, 28), body]);
          }
          const len = Math.min(r.length, SIZE * 2);
          const body = Buffer.alloc(24 + len, 0xc3);
          body.set(tok, 0);
          body.writeBigUInt64BE(BigInt(r.offset), 16);
          return Buffer.concat([frameHeader(FrameType.WriteReq, i + 1, 24 + len), body]);
        });
        await hostile(frames);
        expect(guard.subarray(0, SIZE).every((x) => x === 0x5a)).toBe(true);
        expect(guard.subarray(2 * SIZE).every((x) => x === 0x5a)).toBe(true);
      }),
      { numRuns: 60 },
    );
  });

  it('arbitrary bytes after the handshake never crash the responder', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(fc.uint8Array({ minLength: 1, maxLength: 64 }), { minLength: 1, maxLength: 5 }), async (chunks) => {
        await hostile(chunks);
      }),
      { numRuns: 60 },
    );
    // Headers that claim huge bodies are refused, not allocated.
    await hostile([frameHeader(FrameType.Error, 1, 0xffffffff), frameHeader(FrameType.ReadData, 1, 0xffffffff)]);
    expect(guard.subarray(0, SIZE).every((x) => x === 0x5a)).toBe(true);
    expect(guard.subarray(2 * SIZE).every((x) => x === 0x5a)).toBe(true);
    // And the holder still serves an honest requester.
    const requester = new TransferEngine({ nodeId: 'honest', transports: [new TcpTransport()], logger: silentLogger });
    await requester.start();
    const dst = new Uint8Array(SIZE);
    const local = await requester.register({ kind: 'host', buffer: dst });
    await requester.read(holder.endpoint(), [{ local, remote: reg.descriptor }]);
    expect(Buffer.compare(dst, inner)).toBe(0);
    await requester.close();
  });
});
