/**
 * engine.grant's one pass over a typed range spec: the overlap check for unsorted ranges
 * (sorted starts and ends per registration, no sort with a comparator), the private copy the
 * transports keep, and the run-length encoded lengths in the descriptor, against a model.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { GRANT_STRIDE, InvalidInputError, TransferEngine, decodeDescriptor, silentLogger } from '../src/index.js';
import { SpyTransport } from './helpers/mem-transport.js';

type R = readonly [number, number, number];
/** Whether ranges i and j (i !== j) are of one registration and share a byte. */
const overlaps = (a: R, b: R): boolean => a[0] === b[0] && a[1] < b[1] + b[2] && b[1] < a[1] + a[2];
/** Whether any two ranges overlap (the model: every pair). */
function modelOverlap(ranges: readonly R[]): boolean {
  for (let j = 0; j < ranges.length; j++) for (let i = 0; i < j; i++) if (overlaps(ranges[i] as R, ranges[j] as R)) return true;
  return false;
}

describe('engine.grant over typed ranges', () => {
  it('property: unsorted ranges over several registrations are refused exactly when two of one registration overlap, naming an overlapping pair', async () => {
    const t = new SpyTransport();
    const e = new TransferEngine({ nodeId: 'h', transports: [t], logger: silentLogger });
    await e.start();
    const regs = await Promise.all([0, 1, 2].map(() => e.register({ kind: 'host', buffer: new Uint8Array(4096) })));
    try {
      const range = fc.tuple(fc.integer({ min: 0, max: 2 }), fc.integer({ min: 0, max: 4000 }), fc.integer({ min: 1, max: 96 }));
      await fc.assert(
        fc.asyncProperty(fc.array(range, { minLength: 1, maxLength: 60 }), fc.integer({ min: 1, max: 3 }), async (list, nregs) => {
          const ranges = list.map(([r, o, l]) => [r % nregs, o, l] as const);
          const flat = new Float64Array(ranges.length * GRANT_STRIDE);
          ranges.forEach(([r, o, l], k) => flat.set([r, o, l], k * GRANT_STRIDE));
          const want = modelOverlap(ranges);
          const got = await e.grant({ registrations: regs.slice(0, nregs), ranges: flat }).catch((x: unknown) => x);
          if (!want) {
            expect(got).not.toBeInstanceOf(Error);
            const g = got as Awaited<ReturnType<TransferEngine['grant']>>;
            // The transport got a private copy with exactly the caller's ranges.
            expect(t.last?.ranges).not.toBe(flat);
            expect([...(t.last?.ranges ?? [])]).toEqual([...flat]);
            // The descriptor's run-length encoded lengths decode to the ranges' lengths, in order.
            expect([...(decodeDescriptor(g.descriptor).rangeLengths ?? [])]).toEqual(ranges.map(([, , l]) => l));
            await g.revoke();
          } else {
            expect(got).toBeInstanceOf(InvalidInputError);
            // The error names two ranges that do overlap: `ranges[later] overlaps ranges[earlier]`.
            const m = /^ranges\[(\d+)\] overlaps ranges\[(\d+)\]$/.exec((got as Error).message);
            expect(m).not.toBeNull();
            const [later, earlier] = [Number(m?.[1]), Number(m?.[2])];
            expect((got as InvalidInputError).details['range']).toBe(later);
            expect(earlier).toBeLessThan(later);
            expect(overlaps(ranges[later] as R, ranges[earlier] as R)).toBe(true);
          }
        }),
        { numRuns: 300 },
      );
      expect(e.liveGrants).toBe(0);
    } finally {
      await e.close();
    }
  });

  it('a caller changing its array after grant() cannot change what was granted', async () => {
    const t = new SpyTransport();
    const e = new TransferEngine({ nodeId: 'h', transports: [t], logger: silentLogger });
    await e.start();
    try {
      const reg = await e.register({ kind: 'host', buffer: new Uint8Array(8192) });
      const flat = Float64Array.of(0, 0, 4096, 0, 4096, 4096);
      const g = await e.grant({ registrations: [reg], ranges: flat });
      flat.set([0, 0, 8192, 0, 0, 8192]);
      expect([...(t.last?.ranges ?? [])]).toEqual([0, 0, 4096, 0, 4096, 4096]);
      await g.revoke();
    } finally {
      await e.close();
    }
  });
});
