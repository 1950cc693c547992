/**
 * The engine's pool of range copies (grant-check.ts RangePool): a grant's private copy of its
 * ranges is made before grant() returns its promise (the caller may refill its array at once),
 * comes from warm memory of an earlier, revoked grant, and goes back only once every
 * transport's revokeGrant resolved. Never while a grant is live: a live grant always serves the
 * ranges it was made over, whatever is granted and revoked around it.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { GRANT_STRIDE, RemoteRejectedError, TcpTransport, TransferEngine, silentLogger, type Grant, type GrantRanges, type Registration } from '../src/index.js';
import { POOLED_MIN_NUMBERS, RangePool } from '../src/grant-check.js';

/** A TCP transport that remembers the range arrays it was handed, and can be told to fail revokes. */
class SpyTcp extends TcpTransport {
  readonly seen: Float64Array[] = [];
  failRevokes = 0;
  override grant(spec: GrantRanges): ReturnType<TcpTransport['grant']> {
    this.seen.push(spec.ranges);
    return super.grant(spec);
  }
  override async revokeGrant(handle: object): Promise<void> {
    await super.revokeGrant(handle);
    if (this.failRevokes > 0) {
      this.failRevokes--;
      throw new Error('revokeGrant failed (test)');
    }
  }
}

const BLOCK = 64;
const SLOTS = 4096;

async function pair() {
  const spy = new SpyTcp();
  const holder = new TransferEngine({ nodeId: 'pool-holder', transports: [spy], logger: silentLogger });
  const requester = new TransferEngine({ nodeId: 'pool-requester', transports: [new TcpTransport()], logger: silentLogger });
  await holder.start();
  await requester.start();
  const region = new Uint8Array(SLOTS * BLOCK);
  for (let i = 0; i < region.length; i++) region[i] = (i * 131 + (i >>> 8)) & 255;
  const reg = await holder.register({ kind: 'host', buffer: region });
  return { spy, holder, requester, region, reg };
}

/** Ranges over slots `slots` of registration 0, BLOCK bytes each. */
function rangesOver(slots: readonly number[]): Float64Array {
  const r = new Float64Array(slots.length * GRANT_STRIDE);
  slots.forEach((s, k) => {
    r[k * GRANT_STRIDE + 1] = s * BLOCK;
    r[k * GRANT_STRIDE + 2] = BLOCK;
  });
  return r;
}

/** Read every range of `g` (made over `slots`) and compare with the region. */
async function expectServes(requester: TransferEngine, holder: TransferEngine, local: Registration, dst: Uint8Array, region: Uint8Array, g: Grant, slots: readonly number[]): Promise<void> {
  await requester.read(
    holder.endpoint(),
    slots.map((_, k) => ({ local, localOffset: k * BLOCK, remote: g.descriptor, range: k, length: BLOCK })),
  );
  for (const [k, s] of slots.entries()) {
    if (Buffer.compare(dst.subarray(k * BLOCK, (k + 1) * BLOCK), region.subarray(s * BLOCK, (s + 1) * BLOCK)) !== 0) {
      throw new Error(`range ${k} of a live grant does not hold slot ${s}`);
    }
  }
}

describe('RangePool', () => {
  it('hands out plain arrays below the pooled size, power-of-two backings above, and reuses what is given back', () => {
    const pool = new RangePool({ perClass: 2, maxBytes: 1 << 20 });
    const small = pool.take(POOLED_MIN_NUMBERS - 1);
    expect(small.backing).toBeUndefined();
    expect(small.view.length).toBe(POOLED_MIN_NUMBERS - 1);
    const a = pool.take(3000);
    expect(a.view.length).toBe(3000);
    expect(a.backing?.length).toBe(4096);
    expect(a.view.buffer).toBe(a.backing?.buffer);
    pool.give(a.backing as Float64Array);
    expect(pool.bytes).toBe(4096 * 8);
    const b = pool.take(2049); // same class
    expect(b.backing).toBe(a.backing);
    expect(pool.bytes).toBe(0);
    const c = pool.take(4097); // next class: a new backing
    expect(c.backing?.length).toBe(8192);
    expect(c.backing).not.toBe(a.backing);
  });

  it('is bounded per class and in bytes, and clear() drops everything', () => {
    const pool = new RangePool({ perClass: 2, maxBytes: 3 * 4096 * 8 });
    const got = [pool.take(4096), pool.take(4096), pool.take(4096)].map((x) => x.backing as Float64Array);
    for (const b of got) pool.give(b);
    expect(pool.bytes).toBe(2 * 4096 * 8); // the third is over perClass
    const big = pool.take(8192).backing as Float64Array;
    pool.give(big); // 2 * 32 KiB + 64 KiB is over maxBytes: left to the GC
    expect(pool.bytes).toBe(2 * 4096 * 8);
    pool.clear();
    expect(pool.bytes).toBe(0);
    expect(got).not.toContain(pool.take(4096).backing);
  });
});

describe('range copies in the engine', () => {
  it('the copy is made before grant() returns its promise: the caller may refill its array at once', async () => {
    const { holder, requester, region, reg } = await pair();
    const dst = new Uint8Array(SLOTS * BLOCK);
    const local = await requester.register({ kind: 'host', buffer: dst });
    for (const n of [10, 2000]) {
      const slots = Array.from({ length: n }, (_, k) => (k * 7 + 3) % SLOTS);
      const ranges = rangesOver(slots);
      const pending = holder.grant({ registrations: [reg], ranges });
      ranges.fill(0); // the caller's next lease, before the grant resolved
      const g = await pending;
      await expectServes(requester, holder, local, dst, region, g, slots);
      await g.revoke();
    }
    await requester.close();
    await holder.close();
  });

  it('a revoked grant’s copy serves the next grant of its size; a failed grant’s too; a failed revoke’s never', async () => {
    const { spy, holder, requester, region, reg } = await pair();
    const dst = new Uint8Array(SLOTS * BLOCK);
    const local = await requester.register({ kind: 'host', buffer: dst });
    const slotsA = Array.from({ length: 1500 }, (_, k) => k * 2);
    const slotsB = Array.from({ length: 1500 }, (_, k) => k * 2 + 1);
    const a = await holder.grant({ registrations: [reg], ranges: rangesOver(slotsA) });
    const backingA = (spy.seen.at(-1) as Float64Array).buffer;
    await a.revoke();
    const b = await holder.grant({ registrations: [reg], ranges: rangesOver(slotsB) });
    expect((spy.seen.at(-1) as Float64Array).buffer).toBe(backingA);
    // The old grant is refused, not served from the new grant's ranges.
    await expect(requester.read(holder.endpoint(), [{ local, remote: a.descriptor, range: 0, length: BLOCK }])).rejects.toBeInstanceOf(RemoteRejectedError);
    await expectServes(requester, holder, local, dst, region, b, slotsB);
    // A grant refused by the engine's check gives its copy back.
    const bad = rangesOver(slotsA);
    bad[bad.length - 2] = SLOTS * BLOCK; // the last range past the registration
    await expect(holder.grant({ registrations: [reg], ranges: bad })).rejects.toThrow(/outside its registration/);
    await b.revoke();
    const c = await holder.grant({ registrations: [reg], ranges: rangesOver(slotsA) });
    expect((spy.seen.at(-1) as Float64Array).buffer).toBe(backingA);
    // A transport whose revoke failed may still use the copy: it is not reused.
    spy.failRevokes = 1;
    await c.revoke();
    const d = await holder.grant({ registrations: [reg], ranges: rangesOver(slotsB) });
    expect((spy.seen.at(-1) as Float64Array).buffer).not.toBe(backingA);
    await expectServes(requester, holder, local, dst, region, d, slotsB);
    await requester.close();
    await holder.close();
  });

  it('property: live grants always serve their own ranges while others of any size are granted and revoked', async () => {
    const { holder, requester, region, reg } = await pair();
    const dst = new Uint8Array(SLOTS * BLOCK);
    const local = await requester.register({ kind: 'host', buffer: dst });
    // Steps: grant n distinct slots (from a seed), or revoke the k-th live grant; each step checks every live grant.
    const step = fc.oneof(
      fc.record({ op: fc.constant('grant' as const), n: fc.oneof(fc.integer({ min: 1, max: 40 }), fc.integer({ min: 340, max: 1400 })), seed: fc.integer({ min: 0, max: SLOTS - 1 }) }),
      fc.record({ op: fc.constant('revoke' as const), k: fc.nat() }),
    );
    await fc.assert(
      fc.asyncProperty(fc.array(step, { minLength: 1, maxLength: 12 }), async (steps) => {
        const live: { g: Grant; slots: number[] }[] = [];
        const ranges = new Float64Array(1400 * GRANT_STRIDE); // one array for every grant, as engineGrants does
        try {
          for (const s of steps) {
            if (s.op === 'grant') {
              const slots = Array.from({ length: s.n }, (_, k) => (s.seed + k * 3) % SLOTS).sort((x, y) => x - y);
              ranges.set(rangesOver(slots));
              const g = await holder.grant({ registrations: [reg], ranges: ranges.subarray(0, s.n * GRANT_STRIDE) });
              live.push({ g, slots });
            } else if (live.length > 0) {
              const [gone] = live.splice(s.k % live.length, 1);
              await gone?.g.revoke();
            }
            for (const x of live) await expectServes(requester, holder, local, dst, region, x.g, x.slots);
          }
        } finally {
          for (const x of live) await x.g.revoke();
        }
      }),
      { numRuns: 40 },
    );
    await requester.close();
    await holder.close();
  });
});
