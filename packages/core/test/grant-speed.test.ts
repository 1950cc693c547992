/**
 * The fast paths of engine.grant's range check (src/grant-check.ts) against a model: the
 * sorted single-registration loop (one bound check at the end), the grid bitmap for unsorted
 * ranges of one length on one grid, the sort fallback, and `transfer: true` (the engine takes
 * the caller's ArrayBuffer instead of copying it). Errors still name the range.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { GRANT_STRIDE, InvalidInputError, TcpTransport, TransferEngine, decodeDescriptor, silentLogger, type GrantRanges } from '../src/index.js';
import { checkGrantRanges, gridBitmapWords, gridRangesOverlap, sortedRangesOverlap } from '../src/grant-check.js';

type R = readonly [number, number, number];

const valid = ([r, off, len]: R, limits: readonly number[]): boolean =>
  Number.isInteger(r) && r >= 0 && r < limits.length && Number.isInteger(off) && off >= 0 && Number.isInteger(len) && len >= 1 && off + len <= (limits[r] as number);
const overlaps = (a: R, b: R): boolean => a[0] === b[0] && a[1] < b[1] + b[2] && b[1] < a[1] + a[2];

/** What the check must do: the lowest malformed range, else an overlap, else the runs and the sum. */
function model(list: readonly R[], limits: readonly number[]): { bad: number } | { overlap: true } | { runs: number[]; bytes: number } {
  const bad = list.findIndex((x) => !valid(x, limits));
  if (bad >= 0) return { bad };
  if (list.length <= 200) {
    for (let j = 0; j < list.length; j++) for (let i = 0; i < j; i++) if (overlaps(list[i] as R, list[j] as R)) return { overlap: true };
  } else {
    // Long lists: by start per registration, each start against the furthest end before it.
    const byStart = [...list].sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    for (let k = 1, far = (byStart[0] as R)[1] + (byStart[0] as R)[2]; k < byStart.length; k++) {
      const [r, off, len] = byStart[k] as R;
      if (r === (byStart[k - 1] as R)[0] && off < far) return { overlap: true };
      far = r === (byStart[k - 1] as R)[0] ? Math.max(far, off + len) : off + len;
    }
  }
  const runs: number[] = [];
  for (const [, , len] of list) {
    if (runs.length > 0 && runs[runs.length - 2] === len) runs[runs.length - 1] = (runs[runs.length - 1] as number) + 1;
    else runs.push(len, 1);
  }
  return { runs, bytes: list.reduce((s, [, , len]) => s + len, 0) };
}

const flat = (list: readonly R[]): Float64Array => {
  const f = new Float64Array(list.length * GRANT_STRIDE);
  list.forEach((x, k) => f.set(x, k * GRANT_STRIDE));
  return f;
};

/** Run the check and compare with the model; returns which outcome it was. */
function agree(list: readonly R[], limits: readonly number[]): string {
  const want = model(list, limits);
  const source = flat(list);
  const copy = new Float64Array(source.length);
  let got: ReturnType<typeof checkGrantRanges> | unknown;
  try {
    got = checkGrantRanges(source, copy, list.length, Float64Array.from(limits));
  } catch (e) {
    got = e;
  }
  if ('bad' in want) {
    expect(got).toBeInstanceOf(InvalidInputError);
    expect((got as InvalidInputError).details['range']).toBe(want.bad);
    expect((got as Error).message).toMatch(new RegExp(`^ranges\\[${want.bad}\\] \\(.* is empty or outside its registration$`));
    return 'bad';
  }
  if ('overlap' in want) {
    expect(got).toBeInstanceOf(InvalidInputError);
    const m = /^ranges\[(\d+)\] overlaps ranges\[(\d+)\]$/.exec((got as Error).message);
    expect(m).not.toBeNull();
    const [later, earlier] = [Number(m?.[1]), Number(m?.[2])];
    expect((got as InvalidInputError).details['range']).toBe(later);
    expect(earlier).toBeLessThan(later);
    expect(overlaps(list[later] as R, list[earlier] as R)).toBe(true);
    return 'overlap';
  }
  expect(got).not.toBeInstanceOf(Error);
  expect(got).toEqual({ runs: want.runs, bytes: want.bytes });
  expect([...copy]).toEqual([...source]); // the copy is what was checked, and what is kept
  return 'ok';
}

/** Ranges of one length on one grid (block indices from a small set, so duplicates are common). */
const gridList = fc
  .record({
    len: fc.constantFrom(1, 3, 4096),
    phase: fc.integer({ min: 0, max: 2 }),
    blocks: fc.array(fc.integer({ min: 0, max: 40 }), { minLength: 1, maxLength: 60 }),
    sorted: fc.boolean(),
  })
  .map(({ len, phase, blocks, sorted }) => {
    const b = sorted ? [...new Set(blocks)].sort((x, y) => x - y) : blocks;
    const ph = phase % len;
    return { list: b.map((k) => [0, ph + k * len, len] as R), limits: [ph + 41 * len] };
  });

/** Values the check must refuse, mixed in at a random place. */
const junk = fc.constantFrom(Number.NaN, -1, 0.5, Number.POSITIVE_INFINITY, -0, 2 ** 60);

describe('grant range check fast paths', () => {
  it('property: ranges on one grid (sorted or not, with duplicates) are accepted exactly when the model says, and overlaps name an overlapping pair', () => {
    const seen = new Set<string>();
    fc.assert(
      fc.property(gridList, ({ list, limits }) => {
        seen.add(agree(list, limits));
      }),
      { numRuns: 400 },
    );
    expect(seen).toEqual(new Set(['ok', 'overlap']));
  });

  it('property: mixed lengths, off-grid, touching and overlapping ranges over one or several registrations agree with the model', () => {
    const seen = new Set<string>();
    const range = fc.tuple(fc.integer({ min: 0, max: 2 }), fc.integer({ min: 0, max: 200 }), fc.integer({ min: 1, max: 24 }));
    fc.assert(
      fc.property(
        fc.array(range, { minLength: 1, maxLength: 50 }),
        fc.integer({ min: 1, max: 3 }),
        fc.constantFrom('as is', 'sorted', 'touching'),
        fc.option(fc.tuple(fc.nat(), fc.nat({ max: 2 }), junk), { freq: 3 }),
        (raw, nregs, shape, bad) => {
          let list: R[] = raw.map(([r, o, l]) => [r % nregs, o, l]);
          if (shape === 'sorted') list.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
          if (shape === 'touching') {
            // Back to back per registration: every range starts where the one before ended.
            const at = [0, 0, 0];
            list = list.map(([r, , l]) => {
              const off = at[r] as number;
              at[r] = off + l;
              return [r, off, l];
            });
          }
          if (bad) {
            const [where, field, value] = bad;
            const k = where % list.length;
            const x = [...(list[k] as R)] as [number, number, number];
            x[field] = value;
            list[k] = x;
          }
          seen.add(agree(list, [1000, 1200, 800].slice(0, nregs)));
        },
      ),
      { numRuns: 600 },
    );
    expect(seen).toEqual(new Set(['ok', 'overlap', 'bad']));
  });

  it('property: the grid bitmap agrees with the sort whenever it decides, and decides for ranges on one grid', () => {
    fc.assert(
      fc.property(
        gridList,
        fc.array(fc.tuple(fc.nat({ max: 60 }), fc.integer({ min: 0, max: 5000 })), { maxLength: 3 }),
        ({ list, limits }, moves) => {
          const len = (list[0] as R)[2];
          const onGrid = flat(list);
          const decided = gridRangesOverlap(onGrid, list.length, limits[0] as number, len);
          expect(decided).toBe(sortedRangesOverlap(onGrid, list.length, 1));
          // Moving some ranges to arbitrary (maybe off-grid) offsets inside the region: the bitmap
          // either still agrees with the sort or leaves it to the sort.
          const moved = flat(list);
          for (const [k, off] of moves) moved[(k % list.length) * GRANT_STRIDE + 1] = off % ((limits[0] as number) - len + 1);
          const d = gridRangesOverlap(moved, list.length, limits[0] as number, len);
          if (d !== undefined) expect(d).toBe(sortedRangesOverlap(moved, list.length, 1));
        },
      ),
      { numRuns: 400 },
    );
  });

  it('the bitmap leaves a huge sparse region to the sort, and still finds the overlap there', () => {
    const len = 4096;
    const limit = 2 ** 40;
    const list: R[] = [[0, 8 * len, len], [0, 2 * len, len], [0, 8 * len, len]];
    expect(Math.ceil(limit / len / 32)).toBeGreaterThan(gridBitmapWords(list.length));
    expect(gridRangesOverlap(flat(list), list.length, limit, len)).toBeUndefined();
    expect(agree(list, [limit])).toBe('overlap');
  });

  it('10,000 scattered ranges (sorted, unsorted, layer-major): one bad entry anywhere is named by its index; a duplicate is named as an overlap', () => {
    const n = 10_000;
    const len = 4096;
    const slots = 65_536;
    const limits = [slots * len];
    const scattered = Array.from({ length: n }, (_, k) => ((k * 7919) % slots) * len);
    const orders = {
      sorted: [...scattered].sort((a, b) => a - b),
      unsorted: scattered,
      layerMajor: Array.from({ length: n }, (_, k) => ((k % 32) * 2048 + ((Math.floor(k / 32) * 31) % 2048)) * len),
    };
    for (const offs of Object.values(orders)) {
      const list: R[] = offs.map((o) => [0, o, len]);
      expect(agree(list, limits)).toBe('ok');
      for (const [where, field, value] of [[7777, 1, Number.NaN], [0, 2, 0], [9999, 1, limits[0] as number], [5000, 1, 100.5], [1234, 0, 1], [4321, 2, 2 * len]] as const) {
        const bad = [...list];
        const x = [...(bad[where] as R)] as [number, number, number];
        x[field] = value;
        bad[where] = x;
        const got = agree(bad, limits);
        // A doubled length is well formed (off the grid: the sort decides); the rest are malformed.
        if (!(field === 2 && value === 2 * len)) expect(got).toBe('bad');
      }
      const dup = [...list];
      dup[8000] = dup[3000] as R;
      expect(agree(dup, limits)).toBe('overlap');
    }
  });
});

/** A TcpTransport that remembers the GrantRanges the engine handed it. */
class SpyTcp extends TcpTransport {
  last: GrantRanges | undefined;
  override grant(spec: GrantRanges) {
    this.last = spec;
    return super.grant(spec);
  }
}

describe('engine.grant with transfer: true', () => {
  it('takes a whole ArrayBuffer without copying (the caller’s view is detached); a partial view is copied and left intact', async () => {
    const t = new SpyTcp();
    const e = new TransferEngine({ nodeId: 'h', transports: [t], logger: silentLogger });
    try {
      await e.start();
      const reg = await e.register({ kind: 'host', buffer: new Uint8Array(1 << 24) });
      const list: R[] = Array.from({ length: 1000 }, (_, k) => [0, ((k * 37) % 4096) * 4096, 4096]);
      const ranges = flat(list);
      const g = await e.grant({ registrations: [reg], ranges, transfer: true });
      expect(ranges.length).toBe(0); // detached: the caller can no longer change what was checked
      expect([...(t.last?.ranges ?? [])]).toEqual([...flat(list)]);
      expect(g.rangeCount).toBe(1000);
      expect([...(decodeDescriptor(g.descriptor).rangeLengths ?? [])]).toEqual(list.map(() => 4096));
      await g.revoke();

      // Part of a larger buffer: the engine copies, the caller's array stays as it was.
      const big = new Float64Array(list.length * GRANT_STRIDE + 3);
      big.set(flat(list), 3);
      const part = big.subarray(3);
      const g2 = await e.grant({ registrations: [reg], ranges: part, transfer: true });
      expect(part.length).toBe(list.length * GRANT_STRIDE);
      expect(t.last?.ranges).not.toBe(part);
      part[1] = 12345; // the grant is not affected
      expect(t.last?.ranges[1]).toBe(0);
      await g2.revoke();

      // Still checked: a bad range taken over is refused with its index.
      const bad = flat(list);
      bad[500 * GRANT_STRIDE + 1] = 1 << 24;
      const err = await e.grant({ registrations: [reg], ranges: bad, transfer: true }).catch((x: unknown) => x);
      expect(err).toBeInstanceOf(InvalidInputError);
      expect((err as InvalidInputError).details['range']).toBe(500);
      expect(e.liveGrants).toBe(0);
    } finally {
      await e.close();
    }
  });
});
