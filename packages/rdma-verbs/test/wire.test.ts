import fc from 'fast-check';
import { InvalidInputError } from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import {
  DESCRIPTOR_PAYLOAD_BYTES,
  FrameReader,
  WINDOW_DESCRIPTOR_PAYLOAD_BYTES,
  MAX_FRAME,
  decodeEndpoint,
  decodeGrant,
  decodeMessage,
  encodeEndpoint,
  encodeFrame,
  encodeGrant,
  type ControlMessage,
  type QpSetup,
  type RdmaEndpoint,
} from '../src/wire.js';

const hex32 = fc.uint8Array({ minLength: 16, maxLength: 16 }).map((b) => Buffer.from(b).toString('hex'));
const token = fc.stringMatching(/^[A-Za-z0-9_-]{1,64}$/);
const owner = fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/);
const u24 = fc.integer({ min: 0, max: 0xffffff });
const u32 = fc.integer({ min: 0, max: 0xffffffff });
const grantToken = fc.uint8Array({ minLength: 16, maxLength: 16 });
const text = fc.string({ maxLength: 20 }).filter((s) => Buffer.byteLength(s) <= 64);

const endpointArb: fc.Arbitrary<RdmaEndpoint> = fc.record({
  host: fc.string({ minLength: 1, maxLength: 60 }),
  port: fc.integer({ min: 1, max: 0xffff }),
  device: fc.string({ maxLength: 40 }),
  linkLayer: fc.constantFrom(1, 2),
  lid: fc.integer({ min: 0, max: 0xffff }),
  gid: hex32,
  activeMtu: fc.integer({ min: 1, max: 5 }),
});

const setupArb: fc.Arbitrary<QpSetup> = fc.record({
  identity: fc.record({ nodeId: owner, incarnation: token, hostId: token }),
  linkLayer: fc.constantFrom(1, 2),
  lid: fc.integer({ min: 0, max: 0xffff }),
  gid: hex32,
  activeMtu: fc.integer({ min: 1, max: 5 }),
  initiatorDepth: fc.integer({ min: 1, max: 255 }),
  responderResources: fc.integer({ min: 1, max: 255 }),
  qps: fc.array(fc.record({ qpn: u24, psn: u24 }), { minLength: 1, maxLength: 16 }),
});

const messageArb: fc.Arbitrary<ControlMessage> = fc.oneof(
  fc.record({ type: fc.constant('hello' as const), setup: setupArb, target: fc.record({ nodeId: owner, incarnation: token }) }),
  fc.record({ type: fc.constant('accept' as const), setup: setupArb }),
  fc.record({ type: fc.constant('reject' as const), code: fc.string({ maxLength: 20 }).filter((s) => Buffer.byteLength(s) <= 64), message: fc.string({ maxLength: 200 }) }),
  fc.constant({ type: 'ready' as const }),
  fc.constant({ type: 'retire' as const }),
  fc.constant({ type: 'close' as const }),
  fc.record({ type: fc.constant('bind' as const), requestId: u32, token: grantToken }),
  fc.record({ type: fc.constant('bound' as const), requestId: u32, rkeys: fc.array(u32, { minLength: 1, maxLength: 16 }) }),
  fc.record({ type: fc.constant('refuse' as const), requestId: u32, code: text, message: fc.string({ maxLength: 200 }) }),
  fc.record({ type: fc.constant('unbind' as const), token: grantToken }),
);

const grantArb = fc
  .record({ addr: fc.bigInt({ min: 0n, max: (1n << 56n) - 1n }), length: fc.integer({ min: 1, max: Number.MAX_SAFE_INTEGER }), rkey: fc.integer({ min: 0, max: 0xffffffff }) })
  .map((g) => ({ grant: 'mr' as const, ...g }));

const windowGrantArb = fc
  .record({ addr: fc.bigInt({ min: 0n, max: (1n << 56n) - 1n }), length: fc.integer({ min: 1, max: Number.MAX_SAFE_INTEGER }), token: grantToken })
  .map((g) => ({ grant: 'window' as const, ...g }));

/** Only typed InvalidInputError may escape a decoder fed hostile bytes. */
function decodesOrRejects(fn: () => unknown): void {
  try {
    fn();
  } catch (e) {
    expect(e).toBeInstanceOf(InvalidInputError);
  }
}

function mutations(valid: Uint8Array): fc.Arbitrary<Uint8Array> {
  return fc.oneof(
    fc.integer({ min: 0, max: Math.max(0, valid.length - 1) }).map((n) => valid.slice(0, n)), // truncated
    fc.tuple(fc.nat(valid.length - 1), fc.integer({ min: 0, max: 255 })).map(([i, b]) => {
      const c = valid.slice();
      c[i] = b;
      return c;
    }), // one byte flipped
    fc.uint8Array({ minLength: 1, maxLength: 8 }).map((extra) => Uint8Array.from([...valid, ...extra])), // trailing bytes
  );
}

describe('endpoint blob', () => {
  it('round-trips', () => {
    fc.assert(fc.property(endpointArb, (e) => {
        expect(decodeEndpoint(encodeEndpoint(e))).toEqual(e);
      }));
  });
  it('rejects truncated, corrupted and padded blobs with InvalidInputError only', () => {
    fc.assert(fc.property(endpointArb.chain((e) => mutations(encodeEndpoint(e))), (b) => void decodesOrRejects(() => decodeEndpoint(b))));
  });
  it('survives arbitrary bytes', () => {
    fc.assert(fc.property(fc.uint8Array({ maxLength: 200 }), (b) => void decodesOrRejects(() => decodeEndpoint(b))));
  });
  it('names the field of a truncated blob', () => {
    const b = encodeEndpoint({ host: '10.0.0.21', port: 4791, device: 'mlx5_0', linkLayer: 2, lid: 0, gid: '00000000000000000000ffff0a000015', activeMtu: 3 });
    expect(() => decodeEndpoint(b.subarray(0, b.length - 1))).toThrow(/truncated: activeMtu/);
    expect(() => decodeEndpoint(Uint8Array.from([...b, 0]))).toThrow(/trailing/);
  });
  it('refuses to encode nonsense', () => {
    const ok = { host: 'h', port: 1, device: 'd', linkLayer: 2, lid: 0, gid: '0'.repeat(32), activeMtu: 3 };
    expect(() => encodeEndpoint({ ...ok, port: 0 })).toThrow(InvalidInputError);
    expect(() => encodeEndpoint({ ...ok, linkLayer: 3 })).toThrow(InvalidInputError);
    expect(() => encodeEndpoint({ ...ok, activeMtu: 6 })).toThrow(InvalidInputError);
    expect(() => encodeEndpoint({ ...ok, gid: 'zz' })).toThrow(InvalidInputError);
  });
});

describe('descriptor payload', () => {
  it('round-trips and has a fixed size', () => {
    fc.assert(
      fc.property(grantArb, (g) => {
        const b = encodeGrant(g);
        expect(b.length).toBe(DESCRIPTOR_PAYLOAD_BYTES);
        expect(decodeGrant(b, g.length)).toEqual(g);
      }),
    );
  });
  it('round-trips memory-window grants, which carry a token and no rkey', () => {
    fc.assert(
      fc.property(windowGrantArb, (g) => {
        const b = encodeGrant(g);
        expect(b.length).toBe(WINDOW_DESCRIPTOR_PAYLOAD_BYTES);
        expect(decodeGrant(b, g.length)).toEqual(g);
      }),
    );
    expect(() => encodeGrant({ grant: 'window', addr: 0n, length: 1, token: new Uint8Array(15) })).toThrow(/16 bytes/);
    // A window grant cut to the size of an MR grant is truncated, not misread as one.
    const w = encodeGrant({ grant: 'window', addr: 0n, length: 1, token: new Uint8Array(16) });
    expect(() => decodeGrant(w.subarray(0, DESCRIPTOR_PAYLOAD_BYTES))).toThrow(/truncated: token/);
  });
  it('rejects a payload whose length disagrees with the envelope', () => {
    const b = encodeGrant({ grant: 'mr', addr: 0x7f0000000000n, length: 4096, rkey: 0x1234 });
    expect(() => decodeGrant(b, 8192)).toThrow(/registration covers 4096 bytes but the descriptor claims 8192/);
  });
  it('rejects zero length, unknown grant kinds and 64-bit overflow', () => {
    const b = encodeGrant({ grant: 'mr', addr: 1n, length: 1, rkey: 1 });
    const zero = b.slice();
    zero.fill(0, 13, 21);
    expect(() => decodeGrant(zero)).toThrow(/length is 0/);
    const kind = b.slice();
    kind[4] = 2;
    expect(() => decodeGrant(kind)).toThrow(/grant kind 2/);
    const over = b.slice();
    over.fill(0xff, 5, 13);
    expect(() => decodeGrant(over)).toThrow(/exceeds 64 bits/);
  });
  it('survives truncation, corruption, padding and arbitrary bytes', () => {
    fc.assert(fc.property(fc.oneof(grantArb, windowGrantArb).chain((g) => mutations(encodeGrant(g))), (b) => void decodesOrRejects(() => decodeGrant(b))));
    fc.assert(fc.property(fc.uint8Array({ maxLength: 64 }), fc.option(fc.nat()), (b, n) => void decodesOrRejects(() => decodeGrant(b, n ?? undefined))));
  });
});

describe('handshake frames', () => {
  it('round-trip through the frame reader, also when split at every byte', () => {
    fc.assert(
      fc.property(fc.array(messageArb, { minLength: 1, maxLength: 4 }), fc.integer({ min: 1, max: 64 }), (msgs, step) => {
        const bytes = Buffer.concat(msgs.map((m) => encodeFrame(m)));
        const r = new FrameReader();
        const out: ControlMessage[] = [];
        for (let i = 0; i < bytes.length; i += step) out.push(...r.push(bytes.subarray(i, i + step)));
        expect(out).toEqual(msgs);
        expect(r.buffered).toBe(0);
      }),
    );
  });
  it('carries every QP number and PSN, the LID and the GID', () => {
    const setup: QpSetup = {
      identity: { nodeId: 'holder-a', incarnation: 'inc1', hostId: 'h1' },
      linkLayer: 1,
      lid: 17,
      gid: 'fe80000000000000a088c20300456e70',
      activeMtu: 5,
      initiatorDepth: 16,
      responderResources: 16,
      qps: [
        { qpn: 0x1a2b, psn: 0xabcdef },
        { qpn: 0x1a2c, psn: 0x123456 },
      ],
    };
    const m = decodeMessage(encodeFrame({ type: 'accept', setup }).subarray(4));
    expect(m).toEqual({ type: 'accept', setup });
  });
  it('rejects malformed bodies with InvalidInputError only', () => {
    fc.assert(fc.property(messageArb.chain((m) => mutations(encodeFrame(m).subarray(4))), (b) => void decodesOrRejects(() => decodeMessage(b))));
    fc.assert(fc.property(fc.uint8Array({ maxLength: 300 }), (b) => void decodesOrRejects(() => decodeMessage(b))));
  });
  it('rejects 25-bit QPNs/PSNs, zero and oversized QP counts', () => {
    const setup: QpSetup = {
      identity: { nodeId: 'n', incarnation: 'i', hostId: 'h' },
      linkLayer: 2,
      lid: 0,
      gid: '0'.repeat(32),
      activeMtu: 3,
      initiatorDepth: 1,
      responderResources: 1,
      qps: [{ qpn: 1, psn: 1 }],
    };
    expect(() => encodeFrame({ type: 'accept', setup: { ...setup, qps: [{ qpn: 0x1000000, psn: 0 }] } })).toThrow(/24-bit/);
    expect(() => encodeFrame({ type: 'accept', setup: { ...setup, qps: [] } })).toThrow(/1\.\.16 queue pairs/);
    const body = encodeFrame({ type: 'accept', setup }).subarray(4);
    const qpnAt = body.length - 8;
    const bad = body.slice();
    bad[qpnAt] = 1; // qpn 0x01000001
    expect(() => decodeMessage(bad)).toThrow(/24-bit/);
    const count = body.slice();
    count[qpnAt - 1] = 17;
    expect(() => decodeMessage(count)).toThrow(/1\.\.16 queue pairs, got 17/);
  });
  it('window messages: BOUND carries 1..16 rkeys; BIND and UNBIND carry exactly a 16-byte token', () => {
    expect(() => encodeFrame({ type: 'bound', requestId: 1, rkeys: [] })).toThrow(/1\.\.16 rkeys/);
    expect(() => encodeFrame({ type: 'bound', requestId: 1, rkeys: new Array<number>(17).fill(1) })).toThrow(/1\.\.16 rkeys/);
    expect(() => encodeFrame({ type: 'bound', requestId: 1, rkeys: [2 ** 32] })).toThrow(/32-bit/);
    expect(() => encodeFrame({ type: 'bind', requestId: -1, token: new Uint8Array(16) })).toThrow(/request id/);
    expect(() => encodeFrame({ type: 'unbind', token: new Uint8Array(17) })).toThrow(/16 bytes/);
    const bound = encodeFrame({ type: 'bound', requestId: 7, rkeys: [1, 2] }).subarray(4);
    const zero = bound.slice();
    zero[5] = 0; // count
    expect(() => decodeMessage(zero)).toThrow(/1\.\.16 rkeys, got 0/);
    const bind = encodeFrame({ type: 'bind', requestId: 7, token: new Uint8Array(16) }).subarray(4);
    expect(() => decodeMessage(bind.subarray(0, bind.length - 1))).toThrow(/truncated: token/);
    expect(() => decodeMessage(Uint8Array.from([...bind, 0]))).toThrow(/trailing/);
  });
  it('refuses oversized and empty frames before buffering them', () => {
    const r = new FrameReader();
    const header = Buffer.alloc(4);
    header.writeUInt32BE(MAX_FRAME + 1);
    expect(() => r.push(header)).toThrow(InvalidInputError);
    const r2 = new FrameReader();
    expect(() => r2.push(Buffer.alloc(4))).toThrow(/frame of 0 bytes/);
  });
  it('survives arbitrary byte streams', () => {
    fc.assert(fc.property(fc.uint8Array({ maxLength: 400 }), (b) => void decodesOrRejects(() => new FrameReader().push(b))));
  });
});
