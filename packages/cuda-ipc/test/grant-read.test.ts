/**
 * Reads through range grants whose blocks lie back to back (the KV-cache case): the addon copies
 * a run of ranges that are adjacent in both memories as one copy, after checking each range on
 * its own. Whatever the layout (adjacent or not on either side, partial ranges, several
 * registrations), every destination byte is the granted source byte it names, no other byte of
 * the destination changes, and a read past a granted range is still refused.
 */
import fc from 'fast-check';
import { afterAll, describe, expect, it } from 'vitest';
import { InvalidInputError, RemoteRejectedError, TransferEngine, silentLogger, type Registration } from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory } from '../src/index.js';

const BLOCK = 256;
const BLOCKS = 64;
const pid = process.pid;
const engines: TransferEngine[] = [];
afterAll(async () => {
  await Promise.all(engines.map((e) => e.close()));
});
let nodes = 0;
async function engine(): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId: `gr${++nodes}x${pid}`, transports: [new CudaIpcTransport()], logger: silentLogger, metrics: false });
  await e.start();
  engines.push(e);
  return e;
}
const source = (r: number, i: number): number => (i * 13 + r * 101 + (i >> 8)) & 255;

describe('cuda-ipc range-grant reads over adjacent blocks', () => {
  it('random grants and request layouts: each byte lands where its request says, nothing else moves', async () => {
    const a = await engine();
    const b = await engine();
    const regions = [0, 1].map((r) => {
      const m = allocateSharedMemory(BLOCKS * BLOCK, `grant-read-${r}`);
      for (let i = 0; i < m.length; i++) m[i] = source(r, i);
      return m;
    });
    const regs: Registration[] = await Promise.all(regions.map((buffer) => b.register({ kind: 'host', buffer })));
    const dst = new Uint8Array(4 * BLOCKS * BLOCK);
    const local = await a.register({ kind: 'host', buffer: dst });
    const block = fc.record({ region: fc.integer({ min: 0, max: 1 }), slot: fc.integer({ min: 0, max: BLOCKS - 1 }) });
    await fc.assert(
      fc.asyncProperty(
        // Granted blocks: runs of adjacent slots (the common case) and scattered ones.
        fc.array(fc.record({ start: block, run: fc.integer({ min: 1, max: 6 }) }), { minLength: 1, maxLength: 6 }),
        fc.array(fc.record({ gap: fc.integer({ min: 0, max: 2 }), head: fc.integer({ min: 0, max: 3 }), tail: fc.integer({ min: 0, max: 3 }) }), { minLength: 1, maxLength: 40 }),
        fc.boolean(),
        async (runs, shapes, reverse) => {
          const seen = new Set<string>();
          const granted: { region: number; slot: number }[] = [];
          for (const { start, run } of runs) {
            for (let k = 0; k < run && start.slot + k < BLOCKS; k++) {
              const key = `${start.region}:${start.slot + k}`;
              if (!seen.has(key)) granted.push({ region: start.region, slot: start.slot + k });
              seen.add(key);
            }
          }
          const g = await b.grant(granted.map((x) => ({ registration: regs[x.region] as Registration, offset: x.slot * BLOCK, length: BLOCK })));
          try {
            // Requests in range order (or reversed), each a part of its range, placed one after
            // another in the destination with or without a gap: adjacent on both sides, on one, or none.
            const order = granted.map((_, k) => k);
            if (reverse) order.reverse();
            const requests = [];
            const expected = new Uint8Array(dst.length).fill(0xee);
            let at = 0;
            for (let q = 0; q < order.length; q++) {
              const k = order[q] as number;
              const s = shapes[q % shapes.length] as { gap: number; head: number; tail: number };
              const remoteOffset = s.head === 0 ? 0 : s.head * 16;
              const length = BLOCK - remoteOffset - (s.tail === 0 ? 0 : s.tail * 16);
              at += s.gap * 8;
              requests.push({ local, localOffset: at, remote: g.descriptor, range: k, remoteOffset, length });
              const x = granted[k] as { region: number; slot: number };
              for (let i = 0; i < length; i++) expected[at + i] = source(x.region, x.slot * BLOCK + remoteOffset + i);
              at += length;
            }
            dst.fill(0xee);
            await a.read(b.endpoint(), requests);
            expect(Buffer.compare(Buffer.from(dst), Buffer.from(expected))).toBe(0);
            // A second read of the same grant (its range table cached on the connection): the same bytes.
            dst.fill(0xee);
            await a.read(b.endpoint(), requests);
            expect(Buffer.compare(Buffer.from(dst), Buffer.from(expected))).toBe(0);
          } finally {
            await g.revoke();
          }
        },
      ),
      { numRuns: 60 },
    );
  });

  it('one read through two grants over different segments: each grant reads its own segment', async () => {
    const a = await engine();
    const b = await engine();
    const regions = [0, 1].map((r) => {
      const m = allocateSharedMemory(4 * BLOCK, `grant-read-two-${r}`);
      for (let i = 0; i < m.length; i++) m[i] = source(r, i);
      return m;
    });
    const regs = await Promise.all(regions.map((buffer) => b.register({ kind: 'host', buffer })));
    const g0 = await b.grant([0, 1].map((k) => ({ registration: regs[0] as Registration, offset: k * BLOCK, length: BLOCK })));
    const g1 = await b.grant([2, 3].map((k) => ({ registration: regs[1] as Registration, offset: k * BLOCK, length: BLOCK })));
    const dst = new Uint8Array(4 * BLOCK);
    const local = await a.register({ kind: 'host', buffer: dst });
    await a.read(b.endpoint(), [
      { local, localOffset: 0, remote: g0.descriptor, range: 0, length: BLOCK },
      { local, localOffset: BLOCK, remote: g1.descriptor, range: 1, length: BLOCK },
      { local, localOffset: 2 * BLOCK, remote: g0.descriptor, range: 1, length: BLOCK },
      { local, localOffset: 3 * BLOCK, remote: g1.descriptor, range: 0, length: BLOCK },
    ]);
    const want = (r: number, slot: number, at: number): boolean => dst.subarray(at, at + BLOCK).every((x, i) => x === source(r, slot * BLOCK + i));
    expect([want(0, 0, 0), want(1, 3, BLOCK), want(0, 1, 2 * BLOCK), want(1, 2, 3 * BLOCK)]).toEqual([true, true, true, true]);
    await Promise.all([g0.revoke(), g1.revoke()]);
  });

  it('adjacent blocks granted as separate ranges: a read past the first one is refused, and nothing moves', async () => {
    const a = await engine();
    const b = await engine();
    const region = allocateSharedMemory(8 * BLOCK, 'grant-read-bounds');
    region.fill(9);
    const reg = await b.register({ kind: 'host', buffer: region });
    const g = await b.grant([0, 1, 2].map((k) => ({ registration: reg, offset: k * BLOCK, length: BLOCK })));
    const dst = new Uint8Array(4 * BLOCK);
    const local = await a.register({ kind: 'host', buffer: dst });
    const err = await a
      .read(b.endpoint(), [
        { local, localOffset: 0, remote: g.descriptor, range: 0, length: BLOCK },
        { local, localOffset: BLOCK, remote: g.descriptor, range: 1, remoteOffset: 1, length: BLOCK },
      ])
      .catch((e: unknown) => e);
    expect(err instanceof InvalidInputError || err instanceof RemoteRejectedError).toBe(true);
    expect(dst.every((x) => x === 0)).toBe(true);
    // The three adjacent ranges read whole, back to back: all their bytes, and only theirs.
    await a.read(
      b.endpoint(),
      [0, 1, 2].map((k) => ({ local, localOffset: k * BLOCK, remote: g.descriptor, range: k, length: BLOCK })),
    );
    expect(dst.subarray(0, 3 * BLOCK).every((x) => x === 9)).toBe(true);
    expect(dst.subarray(3 * BLOCK).every((x) => x === 0)).toBe(true);
    await g.revoke();
  });
});
