/**
 * Range grants through the engine (register once, grant per lease): bounds, overlap, limits,
 * the compact descriptor, revocation, and reads by range index. Through the in-process test
 * double; the TCP and same-host transports run the same cases in the conformance suite.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import {
  GRANT_STRIDE,
  InvalidInputError,
  RemoteRejectedError,
  TransferEngine,
  decodeDescriptor,
  encodeDescriptor,
  silentLogger,
  type MemoryDescriptor,
} from '../src/index.js';
import { MemTransport } from './helpers/mem-transport.js';

async function pair(extra: Record<string, unknown> = {}) {
  const ta = new MemTransport();
  const tb = new MemTransport();
  const a = new TransferEngine({ nodeId: 'a', transports: [ta], logger: silentLogger, ...extra });
  const b = new TransferEngine({ nodeId: 'b', transports: [tb], logger: silentLogger, ...extra });
  await a.start();
  await b.start();
  return { a, b, ta, tb };
}

describe('range grants', () => {
  it('a grant over 1,000 blocks is one small descriptor; range k reads block k and nothing else', async () => {
    const { a, b, tb } = await pair();
    const region = new Uint8Array(2000 * 4096).map((_, i) => (i * 31) & 255);
    const reg = await b.register({ kind: 'host', buffer: region });
    const picked = Array.from({ length: 1000 }, (_, k) => (k * 7) % 2000);
    const g = await b.grant(picked.map((slot) => ({ registration: reg, offset: slot * 4096, length: 4096 })));
    expect(g.rangeCount).toBe(1000);
    expect(g.byteLength).toBe(1000 * 4096);
    expect(g.descriptor.length).toBeLessThan(120); // one token, run-length encoded range lengths
    expect(tb.grants).toBe(1);
    const dst = new Uint8Array(1000 * 4096);
    const ra = await a.register({ kind: 'host', buffer: dst });
    await a.read(b.endpoint(), picked.map((_, k) => ({ local: ra, localOffset: k * 4096, remote: g.descriptor, range: k, length: 4096 })));
    for (const [k, slot] of picked.entries()) expect(Buffer.compare(dst.subarray(k * 4096, (k + 1) * 4096), region.subarray(slot * 4096, (slot + 1) * 4096))).toBe(0);
    // Offsets are inside the range: nothing past it is reachable, even in the same region.
    const err = await a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 3, remoteOffset: 4000, length: 97 }]).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidInputError);
    expect((err as InvalidInputError).details['request']).toBe(0);
    await expect(a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 1000, length: 1 }])).rejects.toBeInstanceOf(InvalidInputError);
    await g.revoke();
    await g.revoke(); // idempotent
    expect(tb.grants).toBe(0);
    expect(b.liveGrants).toBe(0);
    await expect(a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 0, length: 4096 }])).rejects.toBeInstanceOf(RemoteRejectedError);
    await a.close();
    await b.close();
  });

  it('typed-array form gives the same grant as the list form; the caller may reuse its array', async () => {
    const { a, b } = await pair();
    const r1 = await b.register({ kind: 'host', buffer: new Uint8Array(1000).fill(1) });
    const r2 = await b.register({ kind: 'host', buffer: new Uint8Array(1000).fill(2) });
    const ranges = Float64Array.of(1, 10, 20, 0, 500, 20);
    const g = await b.grant({ registrations: [r1, r2], ranges });
    ranges.fill(0);
    const dst = new Uint8Array(40);
    const ra = await a.register({ kind: 'host', buffer: dst });
    await a.read(b.endpoint(), [
      { local: ra, remote: g.descriptor, range: 0, length: 20 },
      { local: ra, localOffset: 20, remote: g.descriptor, range: 1, length: 20 },
    ]);
    expect([...dst.subarray(0, 20)].every((x) => x === 2)).toBe(true);
    expect([...dst.subarray(20)].every((x) => x === 1)).toBe(true);
    await a.close();
    await b.close();
  });

  it('bad grants are typed errors: outside a registration, empty, overlapping, too many, mixed kinds, revoked or foreign registrations', async () => {
    const { a, b } = await pair({ maxGrantRanges: 100 });
    const reg = await b.register({ kind: 'host', buffer: new Uint8Array(1000) });
    const other = await a.register({ kind: 'host', buffer: new Uint8Array(1000) });
    const bad: [string, () => Promise<unknown>][] = [
      ['outside', () => b.grant([{ registration: reg, offset: 990, length: 11 }])],
      ['empty', () => b.grant([{ registration: reg, offset: 10, length: 0 }])],
      ['negative', () => b.grant([{ registration: reg, offset: -1, length: 5 }])],
      ['overlap', () => b.grant([{ registration: reg, offset: 500, length: 10 }, { registration: reg, offset: 0, length: 10 }, { registration: reg, offset: 505, length: 10 }])],
      ['too many', () => b.grant(Array.from({ length: 101 }, (_, i) => ({ registration: reg, offset: i, length: 1 })))],
      ['none', () => b.grant([])],
      ['foreign registration', () => b.grant([{ registration: other, offset: 0, length: 1 }])],
      ['not a registration', () => b.grant([{ registration: {} as typeof reg }])],
      ['ragged typed array', () => b.grant({ registrations: [reg], ranges: new Float64Array(4) })],
      ['handle index out of table', () => b.grant({ registrations: [reg], ranges: Float64Array.of(1, 0, 1) })],
      ['NaN', () => b.grant({ registrations: [reg], ranges: Float64Array.of(0, Number.NaN, 1) })],
    ];
    for (const [what, make] of bad) {
      const e = await make().catch((x: unknown) => x);
      expect(e, what).toBeInstanceOf(InvalidInputError);
    }
    const overlap = await bad[3]?.[1]().catch((x: unknown) => x);
    expect((overlap as InvalidInputError).details['range']).toBe(2);
    await reg.revoke();
    await expect(b.grant([{ registration: reg }])).rejects.toBeInstanceOf(InvalidInputError);
    expect(b.liveGrants).toBe(0);
    await a.close();
    await b.close();
  });

  it('a typed spec that lists one registration twice is refused (its ranges could overlap unseen)', async () => {
    const { a, b } = await pair();
    const reg = await b.register({ kind: 'host', buffer: new Uint8Array(1000) });
    await expect(b.grant({ registrations: [reg, reg], ranges: Float64Array.of(0, 0, 32, 1, 16, 32) })).rejects.toBeInstanceOf(InvalidInputError);
    expect(b.liveGrants).toBe(0);
    await a.close();
    await b.close();
  });

  it('a registration revoked while its grant is being made leaves no live grant behind', async () => {
    const { a, b, tb } = await pair();
    const reg = await b.register({ kind: 'host', buffer: new Uint8Array(1000) });
    const pending = b.grant([{ registration: reg, offset: 0, length: 10 }]);
    await Promise.resolve();
    await reg.revoke();
    const outcome = await pending.then(
      (g) => g,
      (e: unknown) => e,
    );
    expect(outcome).toBeInstanceOf(InvalidInputError);
    expect(b.liveGrants).toBe(0);
    expect(tb.grants).toBe(0);
    await a.close();
    await b.close();
  });

  it('revoking a registration revokes its grants first; engine close revokes every grant', async () => {
    const { a, b, tb } = await pair();
    const reg = await b.register({ kind: 'host', buffer: new Uint8Array(1000).fill(4) });
    const keep = await b.register({ kind: 'host', buffer: new Uint8Array(1000).fill(5) });
    const g1 = await b.grant([{ registration: reg, offset: 0, length: 10 }]);
    const g2 = await b.grant([{ registration: keep, offset: 0, length: 10 }]);
    expect(tb.grants).toBe(2);
    await reg.revoke();
    expect(g1.revoked).toBe(true);
    expect(g2.revoked).toBe(false);
    expect(tb.grants).toBe(1);
    await b.close();
    expect(g2.revoked).toBe(true);
    expect(tb.grants).toBe(0);
    await a.close();
  });

  it('a write through a grant lands in the granted range only; overlapping destinations through one grant are refused', async () => {
    const { a, b } = await pair();
    const region = new Uint8Array(1000);
    const reg = await b.register({ kind: 'host', buffer: region });
    const g = await b.grant([{ registration: reg, offset: 100, length: 50 }, { registration: reg, offset: 400, length: 50 }]);
    const src = new Uint8Array(100).fill(9);
    const ra = await a.register({ kind: 'host', buffer: src });
    await a.write(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 1, remoteOffset: 10, length: 40 }]);
    expect(region.findIndex((x) => x === 9)).toBe(410);
    expect(region.lastIndexOf(9)).toBe(449);
    const e = await a
      .write(b.endpoint(), [
        { local: ra, remote: g.descriptor, range: 0, remoteOffset: 0, length: 10 },
        { local: ra, remote: g.descriptor, range: 0, remoteOffset: 5, length: 10 },
      ])
      .catch((x: unknown) => x);
    expect(e).toBeInstanceOf(InvalidInputError);
    // Same offsets in different ranges are different bytes: fine.
    await a.write(b.endpoint(), [
      { local: ra, remote: g.descriptor, range: 0, remoteOffset: 0, length: 10 },
      { local: ra, remote: g.descriptor, range: 1, remoteOffset: 0, length: 10 },
    ]);
    await a.close();
    await b.close();
  });

  it('descriptor range lists round-trip, and lying range lists never decode', () => {
    const base: MemoryDescriptor = {
      owner: { nodeId: 'n', incarnation: 'inc' },
      registrationId: 'block:n:1',
      memoryKind: 'host',
      byteLength: 0,
      transports: new Map([['tcp', new Uint8Array(16)]]),
    };
    fc.assert(
      fc.property(fc.array(fc.integer({ min: 1, max: 2 ** 40 }), { minLength: 1, maxLength: 200 }), fc.array(fc.integer({ min: 1, max: 5 }), { minLength: 1, maxLength: 200 }), (lens, reps) => {
        const lengths: number[] = [];
        lens.forEach((l, i) => {
          for (let r = 0; r < (reps[i % reps.length] as number); r++) lengths.push(l);
        });
        const rangeLengths = Float64Array.from(lengths);
        const byteLength = lengths.reduce((s, x) => s + x, 0);
        const d = decodeDescriptor(encodeDescriptor({ ...base, byteLength, rangeLengths }));
        expect(d.byteLength).toBe(byteLength);
        expect([...(d.rangeLengths ?? [])]).toEqual(lengths);
      }),
    );
    const good = encodeDescriptor({ ...base, byteLength: 3 * 4096, rangeLengths: Float64Array.of(4096, 4096, 4096) });
    fc.assert(
      fc.property(fc.nat(good.length - 1), fc.integer({ min: 0, max: 255 }), (at, value) => {
        const forged = good.slice();
        forged[at] = value;
        try {
          const d = decodeDescriptor(forged);
          // Anything that still decodes is self-consistent.
          const sum = (d.rangeLengths ?? Float64Array.of(d.byteLength)).reduce((s, x) => s + x, 0);
          expect(sum).toBe(d.byteLength);
        } catch (e) {
          expect(e).toBeInstanceOf(InvalidInputError);
        }
      }),
      { numRuns: 2000 },
    );
    expect(() => encodeDescriptor({ ...base, byteLength: 10, rangeLengths: Float64Array.of(4, 5) })).toThrow(InvalidInputError);
    expect(GRANT_STRIDE).toBe(3);
  });

  it('grant cost: 10,000 ranges are one transport call and one map entry', async () => {
    const { b, tb } = await pair();
    const reg = await b.register({ kind: 'host', buffer: new Uint8Array(10_000 * 64) });
    const ranges = new Float64Array(10_000 * GRANT_STRIDE);
    for (let k = 0; k < 10_000; k++) ranges.set([0, k * 64, 64], k * GRANT_STRIDE);
    const g = await b.grant({ registrations: [reg], ranges });
    expect(tb.grants).toBe(1);
    expect(g.rangeCount).toBe(10_000);
    expect(g.descriptor.length).toBeLessThan(120);
    await g.revoke();
    await b.close();
  });
});
