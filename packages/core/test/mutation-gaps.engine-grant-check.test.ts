/**
 * Tests written to kill surviving Stryker mutants of the engine's grant range check
 * (src/grant-check.ts; see the package README, "Mutation testing"): malformed values in every
 * field (registration index, offset, length) placed where each fast loop is running (in order,
 * after the first range out of order, over one or several registrations, across the 4096-range
 * chunk boundary), against a model; the exact refusal (message with the range's values,
 * `details.field` and `details.range`), and the runs and byte sum of what is accepted.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { GRANT_STRIDE, InvalidInputError } from '../src/index.js';
import { checkGrantRanges } from '../src/grant-check.js';

type R = readonly [number, number, number];

const valid = ([r, off, len]: R, limits: readonly number[]): boolean =>
  Number.isInteger(r) && r >= 0 && r < limits.length && Number.isInteger(off) && off >= 0 && Number.isInteger(len) && len >= 1 && off + len <= (limits[r] as number);
const overlaps = (a: R, b: R): boolean => a[0] === b[0] && a[1] < b[1] + b[2] && b[1] < a[1] + a[2];

function flat(list: readonly R[]): Float64Array {
  const f = new Float64Array(list.length * GRANT_STRIDE);
  list.forEach((x, k) => f.set(x, k * GRANT_STRIDE));
  return f;
}

/** The check against the model: the lowest malformed range (exact message), else an overlap, else runs and bytes. */
function agree(list: readonly R[], limits: readonly number[]): 'bad' | 'overlap' | 'ok' {
  const source = flat(list);
  const copy = new Float64Array(source.length);
  let got: unknown;
  try {
    got = checkGrantRanges(source, copy, list.length, Float64Array.from(limits));
  } catch (e) {
    got = e;
  }
  const bad = list.findIndex((x) => !valid(x, limits));
  if (bad >= 0) {
    const [r, off, len] = list[bad] as R;
    expect(got, `range ${bad} of ${JSON.stringify(list)}`).toBeInstanceOf(InvalidInputError);
    expect((got as Error).message).toBe(`ranges[${bad}] (${String(off)}+${String(len)} of registration ${String(r)}) is empty or outside its registration`);
    expect((got as InvalidInputError).details).toEqual({ field: 'ranges', range: bad });
    return 'bad';
  }
  let overlap = false;
  for (let j = 0; j < list.length && !overlap; j++) for (let i = 0; i < j; i++) if (overlaps(list[i] as R, list[j] as R)) overlap = true;
  if (overlap) {
    expect(got, JSON.stringify(list)).toBeInstanceOf(InvalidInputError);
    const m = /^ranges\[(\d+)\] overlaps ranges\[(\d+)\]$/.exec((got as Error).message);
    expect(m).not.toBeNull();
    const [later, earlier] = [Number(m?.[1]), Number(m?.[2])];
    expect((got as InvalidInputError).details).toEqual({ field: 'ranges', range: later });
    expect(earlier).toBeLessThan(later);
    expect(overlaps(list[later] as R, list[earlier] as R)).toBe(true);
    return 'overlap';
  }
  const runs: number[] = [];
  for (const [, , len] of list) {
    if (runs.length > 0 && runs[runs.length - 2] === len) runs[runs.length - 1] = (runs[runs.length - 1] as number) + 1;
    else runs.push(len, 1);
  }
  expect(got, JSON.stringify(list)).toEqual({ runs, bytes: list.reduce((s, [, , len]) => s + len, 0) });
  expect([...copy]).toEqual([...source]);
  return 'ok';
}

/** A malformed value for field 0 (registration), 1 (offset) or 2 (length), given the number of registrations and a limit. */
function junk(field: number, pick: number, nregs: number, limit: number): number {
  const values = [
    [-1, nregs, 0.5, Number.NaN, 1e9, -0.5],
    [-1, -7, 0.5, Number.NaN, Number.POSITIVE_INFINITY, limit, 2 ** 53, Number.NEGATIVE_INFINITY],
    [0, -1, 0.5, Number.NaN, Number.POSITIVE_INFINITY, limit + 1, -0, 1.5, 2.5],
  ][field] as number[];
  return values[pick % values.length] as number;
}

describe('grant range check: malformed values wherever the fast loops run', () => {
  it('property: one or several registrations, in order, touching, or out of order before the malformed range; exact refusals, runs and bytes', () => {
    const seen = new Set<string>();
    const range = fc.tuple(fc.nat({ max: 2 }), fc.nat({ max: 120 }), fc.integer({ min: 1, max: 12 }));
    fc.assert(
      fc.property(
        fc.array(range, { minLength: 1, maxLength: 30 }),
        fc.integer({ min: 1, max: 3 }),
        fc.constantFrom('as is', 'sorted', 'touching', 'one swap'),
        fc.array(fc.tuple(fc.nat(), fc.nat({ max: 2 }), fc.nat()), { maxLength: 2 }),
        (raw, nregs, shape, bad) => {
          const limits = [160, 200, 140].slice(0, nregs);
          let list: R[] = raw.map(([r, o, l]) => [r % nregs, o, l]);
          if (shape !== 'as is') {
            // Back to back per registration (touching) or disjoint in order (sorted, one swap).
            const at = [0, 0, 0];
            list = list.map(([r, o, l]) => {
              const off = (at[r] as number) + (shape === 'touching' ? 0 : o % 5);
              at[r] = off + l;
              return [r, off, l] as R;
            });
            if (shape === 'one swap' && list.length > 2) {
              const k = Math.floor(list.length / 3);
              [list[k], list[k + 1]] = [list[k + 1] as R, list[k] as R];
            }
          }
          for (const [where, field, pick] of bad) {
            const k = where % list.length;
            const x = [...(list[k] as R)] as [number, number, number];
            x[field] = junk(field, pick, nregs, limits[Number.isInteger(x[0]) && x[0] >= 0 && x[0] < nregs ? x[0] : 0] as number);
            list[k] = x;
          }
          seen.add(agree(list, limits));
        },
      ),
      { numRuns: 1500 },
    );
    expect(seen).toEqual(new Set(['ok', 'overlap', 'bad']));
  });

  it('property: in order, one range moved back into its predecessor (equal or new length) is an overlap; ending exactly at the limit is fine', () => {
    const seen = new Set<string>();
    fc.assert(
      fc.property(
        fc.array(fc.tuple(fc.nat({ max: 2 }), fc.constantFrom(4, 8), fc.nat({ max: 3 })), { minLength: 2, maxLength: 30 }),
        fc.integer({ min: 1, max: 3 }),
        fc.nat(),
        fc.integer({ min: 1, max: 7 }),
        fc.boolean(),
        (raw, nregs, which, back, toLimit) => {
          const at = [0, 0, 0];
          const list: [number, number, number][] = raw.map(([r0, len, gap]) => {
            const r = r0 % nregs;
            const off = (at[r] as number) + gap;
            at[r] = off + len;
            return [r, off, len];
          });
          // The registrations end exactly where their last range does (or with room to spare).
          const limits = [0, 1, 2].slice(0, nregs).map((r) => (toLimit ? Math.max(1, at[r] as number) : (at[r] as number) + 16));
          expect(agree(list, limits)).toBe('ok');
          // Move range k back into the range before it of the same registration (if any).
          const k = 1 + (which % (list.length - 1));
          const x = list[k] as [number, number, number];
          const prev = list.slice(0, k).filter((y) => y[0] === x[0]).pop();
          if (prev) {
            const moved = list.map((y) => [...y] as [number, number, number]);
            (moved[k] as [number, number, number])[1] = Math.max(prev[1], prev[1] + prev[2] - Math.min(back, prev[2]));
            seen.add(agree(moved, limits));
          }
        },
      ),
      { numRuns: 1500 },
    );
    expect(seen).toEqual(new Set(['overlap']));
  });

  it('a fractional offset past the previous end, in a run of one length (the in-order loop), is refused by its index', () => {
    for (const n of [3, 4100]) {
      const list: R[] = Array.from({ length: n }, (_, k) => [0, k * 8, 4]);
      for (const at of n > 3 ? [4095, 4096, n - 1] : [1, 2]) {
        const bad = [...list];
        bad[at] = [0, (list[at] as R)[1] + 0.5, 4];
        expect(agree(bad, [n * 8])).toBe('bad');
      }
    }
  });

  it('across the 4096-range chunk boundary: in order, after an out-of-order range, one and two registrations', () => {
    const n = 4096 + 40;
    const len = 8;
    for (const nregs of [1, 2]) {
      const limits = Array.from({ length: nregs }, () => n * len * 2);
      const sorted: R[] = Array.from({ length: n }, (_, k) => [k % nregs, Math.floor(k / nregs) * len * 2, len]);
      expect(agree(sorted, limits)).toBe('ok');
      // A second length from the boundary on: two runs.
      expect(agree(sorted.map(([r, o, l], k) => [r, o, k >= 4096 ? l + 1 : l] as R), limits)).toBe('ok');
      const swapped = [...sorted];
      [swapped[10], swapped[10 + nregs]] = [swapped[10 + nregs] as R, swapped[10] as R];
      expect(agree(swapped, limits)).toBe('ok');
      for (const base of [sorted, swapped]) {
        for (const at of [4094, 4095, 4096, 4097, n - 1]) {
          for (const field of [0, 1, 2]) {
            for (const pick of [0, 1, 3, 5]) {
              const list = [...base];
              const x = [...(list[at] as R)] as [number, number, number];
              x[field] = junk(field, pick, nregs, limits[0] as number);
              list[at] = x;
              agree(list, limits);
            }
          }
          // An overlap at the boundary: a copy of an earlier range.
          const dup = [...base];
          dup[at] = dup[at - 2 * nregs] as R;
          expect(agree(dup, limits)).toBe('overlap');
        }
      }
    }
  });
});
