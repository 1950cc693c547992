/**
 * The package's protobufjs codec (generated encode/decode, no `fromObject`/`toObject` per
 * call) against @grpc/proto-loader with the options the package has always used: same wire
 * format both ways, same objects.
 */
import type * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { LOCK_PROTO_PATH, loadLockProtocol } from '../src/proto.js';

const reference = protoLoader.loadSync(LOCK_PROTO_PATH, {
  keepCase: false,
  longs: Number,
  enums: String,
  bytes: Buffer,
  defaults: true,
  arrays: true,
  oneofs: false,
});
const refService = reference['tensorwire.lock.v1.LockService'] as unknown as grpc.ServiceDefinition;

type Codec = { encode: (m: never) => Buffer; decode: (b: Buffer) => unknown };
interface Pair {
  ref: Codec;
  ours: Codec;
}

function pairs(name: 'Acquire' | 'Release' | 'Renew' | 'Health' | 'ReleaseMany' | 'RenewMany' | 'Session'): { req: Pair; res: Pair } {
  const ref = refService[name] as unknown as grpc.MethodDefinition<never, never>;
  const ours = loadLockProtocol().service[name] as unknown as grpc.MethodDefinition<never, never>;
  return {
    req: {
      ref: { encode: ref.requestSerialize, decode: ref.requestDeserialize },
      ours: { encode: ours.requestSerialize, decode: ours.requestDeserialize },
    },
    res: {
      ref: { encode: ref.responseSerialize, decode: ref.responseDeserialize },
      ours: { encode: ours.responseSerialize, decode: ours.responseDeserialize },
    },
  };
}

/** Plain data for comparison (Buffers as byte arrays). */
function plain(v: unknown): unknown {
  if (v instanceof Uint8Array) return { bytes: [...v] };
  if (Array.isArray(v)) return v.map(plain);
  if (v !== null && typeof v === 'object') return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, plain(x)]));
  return v;
}

/** Unknown fields of every wire type, numbered past the schema's. */
const unknownFields = fc.array(
  fc.oneof(
    fc.record({ wire: fc.constant(0), field: fc.integer({ min: 9, max: 2000 }), value: fc.nat() }),
    fc.record({ wire: fc.constant(1), field: fc.integer({ min: 9, max: 2000 }), value: fc.nat() }),
    fc.record({ wire: fc.constant(2), field: fc.integer({ min: 9, max: 2000 }), value: fc.nat(40) }),
    fc.record({ wire: fc.constant(5), field: fc.integer({ min: 9, max: 2000 }), value: fc.nat() }),
  ),
  { maxLength: 4 },
);

function varint(v: number): number[] {
  const out: number[] = [];
  while (v >= 0x80) {
    out.push((v % 128) | 0x80);
    v = Math.floor(v / 128);
  }
  out.push(v);
  return out;
}

function fieldBytes(f: { wire: number; field: number; value: number }): number[] {
  const out = varint(f.field * 8 + f.wire);
  if (f.wire === 0) out.push(...varint(f.value));
  else if (f.wire === 1) out.push(...new Array<number>(8).fill(f.value & 0xff));
  else if (f.wire === 5) out.push(...new Array<number>(4).fill(f.value & 0xff));
  else out.push(...varint(f.value), ...new Array<number>(f.value).fill(0x61));
  return out;
}

/** The message with unknown fields before and after it (fields may come in any order). */
function withUnknown(buf: Buffer, fields: { wire: number; field: number; value: number }[]): Buffer {
  const half = fields.length >> 1;
  return Buffer.concat([Buffer.from(fields.slice(0, half).flatMap(fieldBytes)), buf, Buffer.from(fields.slice(half).flatMap(fieldBytes))]);
}

/** Both ways: ours → reference and reference → ours decode to what the reference decodes. */
function agree(p: Pair, m: unknown, unknown: { wire: number; field: number; value: number }[] = []): void {
  const expected = plain(p.ref.decode(p.ref.encode(m as never)));
  expect(plain(p.ref.decode(withUnknown(p.ours.encode(m as never), unknown)))).toEqual(expected);
  expect(plain(p.ours.decode(withUnknown(p.ref.encode(m as never), unknown)))).toEqual(expected);
  expect(plain(p.ours.decode(p.ours.encode(m as never)))).toEqual(expected);
}

const text = fc.oneof(fc.string({ maxLength: 80 }), fc.string({ unit: 'binary', maxLength: 20 }), fc.constant(''));
const u32 = fc.oneof(fc.constant(0), fc.nat(), fc.integer({ min: 0, max: 0xffffffff }));
const u64 = fc.oneof(fc.constant(0), fc.nat(), fc.integer({ min: 0, max: Number.MAX_SAFE_INTEGER }), fc.constant(1_700_000_000_000));
const bytes = fc.uint8Array({ maxLength: 64 }).map((b) => Buffer.from(b));

describe('lock protocol codec', () => {
  it('AcquireRequest / AcquireResponse match protobufjs', () => {
    const { req, res } = pairs('Acquire');
    fc.assert(
      fc.property(
        fc.record({ requesterId: text, blockIds: fc.array(text, { maxLength: 6 }), leaseMs: u32, acquireId: text }),
        unknownFields,
        (m, u) => agree(req, m, u),
      ),
      { numRuns: 300 },
    );
    fc.assert(
      fc.property(
        fc.record({
          sessionId: text,
          deadlineUnixMs: u64,
          leaseMs: u32,
          lockTimeoutMs: u32,
          blocks: fc.array(fc.record({ blockId: text, descriptors: fc.array(bytes, { maxLength: 3 }) }), { maxLength: 5 }),
          holderId: text,
          leaseDescriptors: fc.array(bytes, { maxLength: 2 }),
        }),
        unknownFields,
        (m, u) => agree(res, m, u),
      ),
      { numRuns: 300 },
    );
  });

  it('AcquireRequest by number: the packed block numbers from a Uint32Array, and the transports named, are the bytes protobufjs writes', () => {
    const { req } = pairs('Acquire');
    fc.assert(
      fc.property(
        fc.record({
          requesterId: text,
          blockIds: fc.array(text, { maxLength: 2 }),
          leaseMs: u32,
          acquireId: text,
          omitEmptyBlocks: fc.boolean(),
          blockOwner: text,
          blockNumbers: fc.array(u32, { maxLength: 40 }),
          transports: fc.array(text, { maxLength: 3 }),
        }),
        unknownFields,
        (m, u) => {
          agree(req, m, u);
          // The fast path (a Uint32Array) writes exactly what the reference writes from the list.
          const fast = req.ours.encode({ ...m, blockNumbers: Uint32Array.from(m.blockNumbers) } as never);
          expect([...fast]).toEqual([...req.ref.encode(m as never)]);
          expect((req.ours.decode(fast) as { blockNumbers: number[] }).blockNumbers).toEqual(m.blockNumbers);
          expect((req.ours.decode(fast) as { transports: string[] }).transports).toEqual(m.transports);
        },
      ),
      { numRuns: 300 },
    );
  });

  it('Release, Renew and Health match protobufjs', () => {
    const rel = pairs('Release');
    const ren = pairs('Renew');
    const hea = pairs('Health');
    fc.assert(
      fc.property(fc.record({ requesterId: text, sessionId: text, acquireId: text }), fc.record({ released: u32 }), unknownFields, (a, b, u) => {
        agree(rel.req, a, u);
        agree(rel.res, b, u);
      }),
      { numRuns: 200 },
    );
    fc.assert(
      fc.property(fc.record({ requesterId: text, sessionId: text, leaseMs: u32 }), fc.record({ deadlineUnixMs: u64, leaseMs: u32 }), unknownFields, (a, b, u) => {
        agree(ren.req, a, u);
        agree(ren.res, b, u);
      }),
      { numRuns: 200 },
    );
    fc.assert(
      fc.property(
        fc.record({
          status: fc.constantFrom('UNKNOWN', 'SERVING', 'DRAINING'),
          holderId: text,
          lockTimeoutMs: u32,
          activeSessions: u64,
          activeBlocks: u64,
        }),
        unknownFields,
        (m, u) => {
          agree(hea.req, {}, u);
          agree(hea.res, m, u);
        },
      ),
      { numRuns: 200 },
    );
  });

  it('ReleaseMany and RenewMany match protobufjs', () => {
    const rel = pairs('ReleaseMany');
    const ren = pairs('RenewMany');
    const entryError = fc.record({ index: u32, code: fc.nat(16), message: text });
    fc.assert(
      fc.property(
        fc.record({ requesterId: text, sessionIds: fc.array(text, { maxLength: 6 }), acquireIds: fc.array(text, { maxLength: 4 }) }),
        fc.record({ released: fc.array(u32, { maxLength: 6 }), errors: fc.array(entryError, { maxLength: 3 }) }),
        fc.record({ requesterId: text, sessionIds: fc.array(text, { maxLength: 6 }), leaseMs: fc.array(u32, { maxLength: 6 }) }),
        fc.record({ deadlineUnixMs: fc.array(u64, { maxLength: 6 }), leaseMs: fc.array(u32, { maxLength: 6 }), errors: fc.array(entryError, { maxLength: 3 }) }),
        unknownFields,
        (a, b, c, d, u) => {
          agree(rel.req, a, u);
          agree(rel.res, b, u);
          agree(ren.req, c, u);
          agree(ren.res, d, u);
        },
      ),
      { numRuns: 200 },
    );
  });

  it('SessionRequest / SessionResponse match protobufjs (retry_after_ms present only when set)', () => {
    const { req, res } = pairs('Session');
    fc.assert(
      fc.property(
        fc.record({ id: u64, method: text, payload: bytes, timeoutMs: u32 }),
        fc.record({ id: u64, code: fc.nat(16), details: text, payload: bytes, retryAfterMs: fc.option(u32, { nil: undefined }) }, { requiredKeys: ['id', 'code', 'details', 'payload'] }),
        unknownFields,
        (a, b, u) => {
          agree(req, a, u);
          agree(res, b, u);
        },
      ),
      { numRuns: 200 },
    );
    expect(loadLockProtocol().codec.SessionResponse.decode(loadLockProtocol().codec.SessionResponse.encode({ id: 1, code: 8, details: '', payload: Buffer.alloc(0), retryAfterMs: 0 }))).toMatchObject({ retryAfterMs: 0 });
    expect('retryAfterMs' in loadLockProtocol().codec.SessionResponse.decode(loadLockProtocol().codec.SessionResponse.encode({ id: 1, code: 0, details: '', payload: Buffer.alloc(0) }))).toBe(false);
  });

  it('reads what protobufjs writes for defaults set explicitly, and numeric enums', () => {
    const { res } = pairs('Health');
    agree(res, { status: 0, holderId: '', lockTimeoutMs: 0, activeSessions: 0, activeBlocks: 0 });
    agree(res, { status: 2, holderId: 'h', lockTimeoutMs: 1, activeSessions: 2 ** 40, activeBlocks: 3 });
    // An enum value this schema does not name stays a number, as with proto-loader.
    const buf = Buffer.from([0x08, 0x07]);
    expect(res.ours.decode(buf)).toEqual(res.ref.decode(buf));
    const neg = Buffer.from([0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
    expect(res.ours.decode(neg)).toEqual(res.ref.decode(neg));
    expect(res.ref.decode(res.ours.encode({ status: -1 } as never))).toEqual(res.ref.decode(neg));
  });

  it('refuses malformed messages', () => {
    const rel = pairs('Release');
    const hea = pairs('Health');
    const acq = pairs('Acquire');
    // Truncated string, truncated varint, invalid wire type.
    for (const bad of [[0x0a, 0x05, 0x61], [0x08, 0x80], [0x0f]]) {
      expect(() => rel.req.ours.decode(Buffer.from(bad))).toThrow();
      expect(() => rel.res.ours.decode(Buffer.from(bad))).toThrow();
      expect(() => hea.req.ours.decode(Buffer.from(bad))).toThrow();
    }
    // A known field's varint past 10 bytes.
    const long = Buffer.from([0x08, ...new Array<number>(10).fill(0xff), 0x01]);
    expect(() => rel.req.ours.decode(long)).toThrow();
    expect(() => rel.res.ours.decode(long)).toThrow();
    // A nested message whose length runs past its parent.
    expect(() => acq.res.ours.decode(Buffer.from([0x2a, 0x05, 0x0a, 0x09, 0x61]))).toThrow();
    expect(() => acq.req.ours.encode({ requesterId: 'a', blockIds: 'x', leaseMs: 0, acquireId: '' } as never)).toThrow(TypeError);
    expect(() => acq.res.ours.encode({ blocks: [{ blockId: 'b', descriptors: [42] }] } as never)).toThrow(TypeError);
    expect(() => hea.res.ours.encode({ status: 'NOPE' } as never)).toThrow(TypeError);
  });

  it('decodes empty repeated fields as fresh arrays', () => {
    const { req } = pairs('Acquire');
    const a = req.ours.decode(Buffer.alloc(0)) as { blockIds: string[] };
    const b = req.ours.decode(Buffer.alloc(0)) as { blockIds: string[] };
    expect(a.blockIds).toEqual([]);
    expect(a.blockIds).not.toBe(b.blockIds);
    a.blockIds.push('x');
    expect(b.blockIds).toEqual([]);
  });
});
