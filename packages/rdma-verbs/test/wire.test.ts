import fc from 'fast-check';
import { InvalidInputError } from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import {
  DESCRIPTOR_PAYLOAD_BYTES,
  FrameReader,
  GRANT_PART_ENTRIES,
  RANGE_DESCRIPTOR_PAYLOAD_BYTES,
  encodeGrantTable,
  grantKeysPerPart,
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
  fc.record({ type: fc.constant('grant-bind' as const), requestId: u32, count: fc.integer({ min: 1, max: 1 << 20 }), windows: fc.boolean(), length: fc.integer({ min: 1 << 20, max: Number.MAX_SAFE_INTEGER }), token: grantToken }),
  fc
    .record({ ranges: fc.integer({ min: 1, max: 1 << 20 }), a: fc.nat(), b: fc.nat(), per: fc.integer({ min: 1, max: 16 }), requestId: u32 })
    .map(({ ranges, a, b, per, requestId }) => {
      const keys = 1 + (a % ranges);
      return { type: 'grant-head' as const, requestId, ranges, keys, regions: 1 + (b % keys), rkeysPerKey: per };
    }),
  fc
    .record({ requestId: u32, first: u32, addrs: fc.array(fc.tuple(u32, u32), { minLength: 1, maxLength: GRANT_PART_ENTRIES.regions }) })
    .map(({ requestId, first, addrs }) => ({ type: 'grant-regions' as const, requestId, first, hi: Uint32Array.from(addrs, (x) => x[0]), lo: Uint32Array.from(addrs, (x) => x[1]) })),
  fc
    .record({ requestId: u32, first: u32, per: fc.integer({ min: 1, max: 16 }), n: fc.integer({ min: 1, max: 60 }), seed: u32 })
    .map(({ requestId, first, per, n, seed }) => ({
      type: 'grant-keys' as const,
      requestId,
      first,
      rkeysPerKey: per,
      region: Uint32Array.from({ length: n }, (_, i) => (seed + i) >>> 0),
      rkeys: Uint32Array.from({ length: n * per }, (_, i) => (seed * 7 + i) >>> 0),
    })),
  fc
    .record({
      requestId: u32,
      first: u32,
      list: fc.array(fc.tuple(u32, fc.integer({ min: 0, max: 2 ** 48 - 1 }), fc.integer({ min: 1, max: 2 ** 48 - 1 })), { minLength: 1, maxLength: GRANT_PART_ENTRIES.ranges }),
    })
    .map(({ requestId, first, list }) => ({
      type: 'grant-ranges' as const,
      requestId,
      first,
      key: Uint32Array.from(list, (x) => x[0]),
      offset: Float64Array.from(list, (x) => x[1]),
      length: Float64Array.from(list, (x) => x[2]),
    })),
  fc.record({ type: fc.constant('grant-refuse' as const), requestId: u32, code: text, message: fc.string({ maxLength: 200 }) }),
  fc.record({ type: fc.constant('grant-unbind' as const), token: grantToken }),
  fc.record({ type: fc.constant('grant-unbound' as const), token: grantToken }),
);

const grantArb = fc
  .record({ addr: fc.bigInt({ min: 0n, max: (1n << 56n) - 1n }), length: fc.integer({ min: 1, max: Number.MAX_SAFE_INTEGER }), rkey: fc.integer({ min: 0, max: 0xffffffff }) })
  .map((g) => ({ grant: 'mr' as const, ...g }));

const windowGrantArb = fc
  .record({ addr: fc.bigInt({ min: 0n, max: (1n << 56n) - 1n }), length: fc.integer({ min: 1, max: Number.MAX_SAFE_INTEGER }), token: grantToken })
  .map((g) => ({ grant: 'window' as const, ...g }));

const rangeGrantArb = fc
  .record({ length: fc.integer({ min: 1 << 20, max: Number.MAX_SAFE_INTEGER }), windows: fc.boolean(), count: fc.integer({ min: 1, max: 1 << 20 }), token: grantToken })
  .map((g) => ({ grant: 'ranges' as const, ...g }));

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
    kind[4] = 3;
    expect(() => decodeGrant(kind)).toThrow(/grant kind 3/);
    const over = b.slice();
    over.fill(0xff, 5, 13);
    expect(() => decodeGrant(over)).toThrow(/exceeds 64 bits/);
  });
  it('round-trips range grants: the same 34 bytes for one range or a million, no address, no rkey', () => {
    fc.assert(
      fc.property(rangeGrantArb, (g) => {
        const b = encodeGrant(g);
        expect(b.length).toBe(RANGE_DESCRIPTOR_PAYLOAD_BYTES);
        expect(decodeGrant(b, g.length)).toEqual(g);
      }),
    );
    const g = { grant: 'ranges' as const, length: 4096, windows: true, count: 10, token: new Uint8Array(16) };
    expect(() => encodeGrant({ ...g, count: 0 })).toThrow(InvalidInputError);
    expect(() => encodeGrant({ ...g, count: 5000 })).toThrow(/more ranges than bytes/);
    const b = encodeGrant(g);
    const mode = b.slice();
    mode[13] = 2;
    expect(() => decodeGrant(mode)).toThrow(/mode 2/);
    const count = b.slice();
    count.fill(0, 14, 18);
    expect(() => decodeGrant(count)).toThrow(/1 to 1048576 ranges, got 0/);
    expect(() => decodeGrant(b, 8192)).toThrow(/the granted ranges cover 4096 bytes but the descriptor claims 8192/);
  });
  it('survives truncation, corruption, padding and arbitrary bytes', () => {
    fc.assert(fc.property(fc.oneof(grantArb, windowGrantArb, rangeGrantArb).chain((g) => mutations(encodeGrant(g))), (b) => void decodesOrRejects(() => decodeGrant(b))));
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
  it('a grant table of any size goes as frames within MAX_FRAME that decode back to it', () => {
    fc.assert(
      fc.property(
        fc.record({ ranges: fc.integer({ min: 1, max: 3000 }), keys: fc.integer({ min: 1, max: 3000 }), regions: fc.integer({ min: 1, max: 1200 }), per: fc.constantFrom(1, 2, 16), seed: u32 }),
        ({ ranges, keys: k, regions: g, per, seed }) => {
          const keys = Math.min(k, ranges);
          const regions = Math.min(g, keys);
          const t = {
            regionHi: Uint32Array.from({ length: regions }, (_, i) => (seed + i) >>> 0),
            regionLo: Uint32Array.from({ length: regions }, (_, i) => (seed ^ (i * 2654435761)) >>> 0),
            keyRegion: Uint32Array.from({ length: keys }, (_, i) => i % regions),
            rkeysPerKey: per,
            rkeys: Uint32Array.from({ length: keys * per }, (_, i) => (seed + i * 31) >>> 0),
            rangeKey: Uint32Array.from({ length: ranges }, (_, i) => (i * 7) % keys),
            rangeOffset: Float64Array.from({ length: ranges }, (_, i) => (i * 4099 + seed) % 2 ** 48),
            rangeLength: Float64Array.from({ length: ranges }, (_, i) => 1 + ((i * 977 + seed) % 2 ** 40)),
          };
          const frames = [...encodeGrantTable(9, t)];
          for (const f of frames) expect(f.length - 4).toBeLessThanOrEqual(MAX_FRAME);
          const msgs = new FrameReader().push(Buffer.concat(frames));
          const back = { regionHi: [] as number[], regionLo: [] as number[], keyRegion: [] as number[], rkeys: [] as number[], rangeKey: [] as number[], rangeOffset: [] as number[], rangeLength: [] as number[] };
          expect(msgs[0]).toEqual({ type: 'grant-head', requestId: 9, ranges, keys, regions, rkeysPerKey: per });
          for (const m of msgs.slice(1)) {
            if (m.type === 'grant-regions') {
              back.regionHi.push(...m.hi);
              back.regionLo.push(...m.lo);
            } else if (m.type === 'grant-keys') {
              back.keyRegion.push(...m.region);
              back.rkeys.push(...m.rkeys);
            } else if (m.type === 'grant-ranges') {
              back.rangeKey.push(...m.key);
              back.rangeOffset.push(...m.offset);
              back.rangeLength.push(...m.length);
            } else throw new Error(`unexpected ${m.type}`);
          }
          expect(back).toEqual({
            regionHi: [...t.regionHi],
            regionLo: [...t.regionLo],
            keyRegion: [...t.keyRegion],
            rkeys: [...t.rkeys],
            rangeKey: [...t.rangeKey],
            rangeOffset: [...t.rangeOffset],
            rangeLength: [...t.rangeLength],
          });
        },
      ),
      { numRuns: 30 },
    );
    // 10,000 ranges of one region: 40 range parts of 250, one frame each for the regions and keys.
    const one = { regionHi: Uint32Array.of(0x7f), regionLo: Uint32Array.of(0), keyRegion: Uint32Array.of(0), rkeysPerKey: 1, rkeys: Uint32Array.of(5) };
    const frames = [
      ...encodeGrantTable(1, { ...one, rangeKey: new Uint32Array(10_000), rangeOffset: Float64Array.from({ length: 10_000 }, (_, i) => i * 8192), rangeLength: new Float64Array(10_000).fill(4096) }),
    ];
    expect(frames).toHaveLength(1 + 1 + 1 + 40);
    expect(grantKeysPerPart(16)).toBe(60);
  });
  it('range grant messages refuse out-of-range counts and offsets', () => {
    expect(() => encodeFrame({ type: 'grant-head', requestId: 1, ranges: 10, keys: 11, regions: 1, rkeysPerKey: 1 })).toThrow(/keys must be 1\.\.10/);
    expect(() => encodeFrame({ type: 'grant-head', requestId: 1, ranges: 10, keys: 2, regions: 3, rkeysPerKey: 1 })).toThrow(/regions must be 1\.\.2/);
    expect(() => encodeFrame({ type: 'grant-head', requestId: 1, ranges: 10, keys: 2, regions: 1, rkeysPerKey: 17 })).toThrow(/rkeysPerKey/);
    expect(() => encodeFrame({ type: 'grant-bind', requestId: 1, count: 0, windows: false, length: 1, token: new Uint8Array(16) })).toThrow(/count/);
    expect(() => encodeFrame({ type: 'grant-ranges', requestId: 1, first: 0, key: Uint32Array.of(0), offset: Float64Array.of(2 ** 48), length: Float64Array.of(1) })).toThrow(/48-bit/);
    expect(() => encodeFrame({ type: 'grant-ranges', requestId: 1, first: 0, key: Uint32Array.of(0), offset: Float64Array.of(0), length: Float64Array.of(0) })).toThrow(/positive 48-bit/);
    expect(() => encodeFrame({ type: 'grant-keys', requestId: 1, first: 0, rkeysPerKey: 2, region: Uint32Array.of(0), rkeys: Uint32Array.of(1) })).toThrow(/need 2 rkeys/);
    expect(() => encodeFrame({ type: 'grant-regions', requestId: 1, first: 0, hi: new Uint32Array(501), lo: new Uint32Array(501) })).toThrow(/regions must be 1\.\.500/);
    const head = encodeFrame({ type: 'grant-head', requestId: 1, ranges: 10, keys: 2, regions: 1, rkeysPerKey: 1 }).subarray(4);
    const bad = head.slice();
    bad[9] = 0xff; // keys > ranges
    expect(() => decodeMessage(bad)).toThrow(InvalidInputError);
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
