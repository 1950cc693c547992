/**
 * The engine's check of a grant's ranges (`count` of them, GRANT_STRIDE numbers each: index of
 * the registration, offset, length), kept out of engine.ts so the fast paths can be tested
 * against the general ones. Nothing here allocates per range.
 *
 * - One registration (a lease's blocks in one KV arena, the common case): one tight loop while
 *   the ranges come in increasing order (then they cannot overlap, and only the last end needs
 *   a bound check); from the first range out of order, a loop that checks each range's bounds.
 *   Lengths are run-length encoded in the same pass (the descriptor carries the runs).
 * - Out of order over one registration, all of one length L, offsets on one grid of L (the same
 *   remainder mod L): two ranges overlap exactly when they have the same block index, so a
 *   bitmap over block indices decides in O(n) ({@link gridRangesOverlap}).
 * - Otherwise: per registration, sorted starts against sorted ends (native typed-array sorts,
 *   {@link sortedRangesOverlap}).
 *
 * A range that is not a non-empty integer range inside its registration fails with its index
 * (the lowest such); only then is overlap looked at, and an overlap names a pair
 * ({@link findGrantOverlap}).
 */
import { InvalidInputError } from './errors.js';
import { GRANT_STRIDE, GrantField, type GrantBlocks, type GrantRanges } from './transport.js';

/** What the check learnt: the sum of the lengths and the lengths as (length, repeat) runs. */
export interface GrantCheck {
  readonly bytes: number;
  readonly runs: number[];
}

/**
 * A Float64Array of `n` numbers for the engine's private copy of a grant's ranges. A plain
 * typed array: large ones are calloc'd pages that need no fill, measured faster than an
 * unfilled Buffer (Buffer.allocUnsafeSlow) plus a view.
 */
export function rangeArray(n: number): Float64Array {
  return new Float64Array(n);
}

/** Range copies of at least this many numbers come from a {@link RangePool}; smaller ones are plain arrays. */
export const POOLED_MIN_NUMBERS = 1024;

/** A range copy: the view the grant uses (exactly the numbers asked for) and its pooled backing, if any. */
export interface PooledRanges<T extends Float64Array | Uint32Array = Float64Array> {
  readonly view: T;
  readonly backing: T | undefined;
}

/**
 * The engine's free range copies, by power-of-two capacity, so a holder granting lease after
 * lease reuses warm memory instead of allocating (and page-faulting, then garbage-collecting)
 * a new array per grant: at 10,000 ranges that was a third of a grant's time. A copy goes back
 * only when every transport's revokeGrant resolved (none of them may touch it after). Bounded:
 * `perClass` arrays per capacity and `maxBytes` in all; beyond that, copies are left to the GC.
 * One pool holds one element type: Float64Array range tables by default, or (with `make`) the
 * Uint32Array block indices of block grants.
 */
export class RangePool<T extends Float64Array | Uint32Array = Float64Array> {
  readonly #free = new Map<number, T[]>();
  readonly #perClass: number;
  readonly #maxBytes: number;
  readonly #make: (n: number) => T;
  #bytes = 0;
  constructor(options: { perClass?: number; maxBytes?: number; make?: (n: number) => T } = {}) {
    this.#perClass = options.perClass ?? 16;
    this.#maxBytes = options.maxBytes ?? 16 * 1024 * 1024;
    this.#make = options.make ?? (rangeArray as unknown as (n: number) => T);
  }
  /** Bytes held free now. */
  get bytes(): number {
    return this.#bytes;
  }
  /** A copy of `n` numbers (contents unspecified: the caller overwrites all `n`). */
  take(n: number): PooledRanges<T> {
    if (n < POOLED_MIN_NUMBERS) return { view: this.#make(n), backing: undefined };
    const cap = 2 ** Math.ceil(Math.log2(n));
    const backing = this.#free.get(cap)?.pop();
    if (backing !== undefined) this.#bytes -= backing.byteLength;
    const b = backing ?? this.#make(cap);
    return { view: n === cap ? b : (b.subarray(0, n) as T), backing: b };
  }
  /**
   * The engine's private copy of the first `n` numbers of `source` (`source` itself when it is
   * the engine's already: `owned`), and what hands a pooled copy back once nothing uses it
   * (undefined when there is nothing to hand back).
   */
  privateCopy(source: T, n: number, owned: boolean): { view: T; give: (() => void) | undefined } {
    if (owned) return { view: source, give: undefined };
    const copy = this.take(n);
    copy.view.set(source.length === n ? source : source.subarray(0, n));
    const backing = copy.backing;
    return { view: copy.view, give: backing === undefined ? undefined : () => this.give(backing) };
  }
  /** Hand a backing from {@link take} back, once nothing uses it. */
  give(backing: T): void {
    const cap = backing.length;
    if (this.#bytes + backing.byteLength > this.#maxBytes) return;
    let list = this.#free.get(cap);
    if (!list) this.#free.set(cap, (list = []));
    if (list.length >= this.#perClass) return;
    list.push(backing);
    this.#bytes += backing.byteLength;
  }
  /** Drop every free copy. */
  clear(): void {
    this.#free.clear();
    this.#bytes = 0;
  }
}

function shapeError(i: number, r: number, off: number, len: number): InvalidInputError {
  return new InvalidInputError(`ranges[${i}] (${String(off)}+${String(len)} of registration ${String(r)}) is empty or outside its registration`, {
    details: { field: 'ranges', range: i },
  });
}

function overlapError(ranges: Float64Array, count: number): InvalidInputError {
  const overlap = findGrantOverlap(ranges, count) as [number, number];
  return new InvalidInputError(`ranges[${overlap[0]}] overlaps ranges[${overlap[1]}]`, { details: { field: 'ranges', range: overlap[0] } });
}

function sumRuns(runs: readonly number[]): number {
  let bytes = 0;
  for (let k = 0; k < runs.length; k += 2) bytes += (runs[k] as number) * (runs[k + 1] as number);
  return bytes;
}

/**
 * Check a grant's ranges: `source` (the caller's) is first copied into the engine's private
 * `ranges` with one memcpy (the transports keep that copy; `ranges === source` when the engine
 * built it), then the copy (what is kept, so what is checked) is checked. `limits[k]` is the
 * byte length of registration `k`. Throws InvalidInputError naming the range.
 */
export function checkGrantRanges(source: Float64Array, ranges: Float64Array, count: number, limits: Float64Array): GrantCheck {
  if (ranges !== source) ranges.set(source.length === count * GRANT_STRIDE ? source : source.subarray(0, count * GRANT_STRIDE));
  return limits.length === 1 ? checkOne(ranges, count, limits[0] as number, limits) : checkMany(ranges, count, limits);
}

/*
 * Every loop over the ranges is a leaf function that only scans [from, to) and returns where it
 * stopped (nothing after its loop but the return), called per chunk of at most CHUNK ranges by
 * a caller that handles what is rare (a new length, a range out of order, an error). A long
 * loop with code after it gets optimized on stack (OSR) before that code has ever run; V8 then
 * deoptimizes on reaching it and, the OSR code being cached, did so again on every later grant:
 * that made a grant over 10,000 ranges ten times slower per range than one over 1,000.
 */
const CHUNK = 4096;

/** From `from`, the ranges of registration 0 in increasing order (each at or after `prevEnd`, then the previous end) with integer offsets and length `len`. */
function sortedRun(ranges: Float64Array, from: number, to: number, prevEnd: number, len: number): number {
  let i = from;
  for (let at = from * GRANT_STRIDE; i < to; i++, at += GRANT_STRIDE) {
    const off = ranges[at + GrantField.Offset] as number;
    if (ranges[at] !== 0 || !(off >= prevEnd) || Math.trunc(off) !== off || ranges[at + GrantField.Length] !== len) break;
    prevEnd = off + len;
  }
  return i;
}

/** From `from`, the ranges of registration 0 inside `limit`, with integer offsets and length `len` (any order). */
function boundedRun(ranges: Float64Array, from: number, to: number, limit: number, len: number): number {
  let i = from;
  for (let at = from * GRANT_STRIDE; i < to; i++, at += GRANT_STRIDE) {
    const off = ranges[at + GrantField.Offset] as number;
    if (ranges[at] !== 0 || !(off >= 0 && off + len <= limit) || Math.trunc(off) !== off || ranges[at + GrantField.Length] !== len) break;
  }
  return i;
}

/** Whether range `i` (of registration `r` of `limit` bytes) is a non-empty integer range inside it. */
function wellFormed(ranges: Float64Array, i: number, nregs: number, limits: Float64Array): boolean {
  const at = i * GRANT_STRIDE;
  const r = ranges[at] as number;
  const off = ranges[at + GrantField.Offset] as number;
  const len = ranges[at + GrantField.Length] as number;
  // NaN fails every comparison; trunc refuses fractions; off + len <= limit keeps it safe.
  return (
    r >= 0 && r < nregs && Math.trunc(r) === r && off >= 0 && Math.trunc(off) === off && len >= 1 && Math.trunc(len) === len && off + len <= (limits[r] as number)
  );
}

function shapeErrorAt(ranges: Float64Array, i: number): InvalidInputError {
  const at = i * GRANT_STRIDE;
  return shapeError(i, ranges[at] as number, ranges[at + GrantField.Offset] as number, ranges[at + GrantField.Length] as number);
}

/** All ranges of registration 0, of `limit` bytes. */
function checkOne(ranges: Float64Array, count: number, limit: number, limits: Float64Array): GrantCheck {
  const runs: number[] = [];
  let runLen = Number.NaN; // the first range always starts a run, and is checked then
  let runStart = 0;
  let prevEnd = 0;
  let i = 0;
  // In increasing order: off >= the previous end (>= 0; NaN fails) and len >= 1 make every end
  // larger than the one before, so the ranges are disjoint and the last end bounds them all.
  while (i < count) {
    const to = Math.min(count, i + CHUNK);
    const j = sortedRun(ranges, i, to, prevEnd, runLen);
    if (j > i) prevEnd = (ranges[(j - 1) * GRANT_STRIDE + GrantField.Offset] as number) + runLen;
    i = j;
    if (i === to) continue;
    // A new length, still in order, or the end of the sorted prefix.
    const at = i * GRANT_STRIDE;
    const off = ranges[at + GrantField.Offset] as number;
    const len = ranges[at + GrantField.Length] as number;
    if (!(ranges[at] === 0 && off >= prevEnd && Math.trunc(off) === off && len >= 1 && Math.trunc(len) === len)) break;
    if (i > 0) runs.push(runLen, i - runStart);
    runLen = len;
    runStart = i;
    prevEnd = off + len;
    i++;
  }
  if (prevEnd > limit) {
    // The first range whose end is past the registration (ends only grow in this prefix).
    for (let k = 0; k < i; k++) if (!wellFormed(ranges, k, 1, limits)) throw shapeErrorAt(ranges, k);
  }
  if (i === count) {
    runs.push(runLen, count - runStart);
    return { bytes: sumRuns(runs), runs };
  }
  // From the first range out of order (or malformed): each range's bounds on its own.
  while (i < count) {
    const to = Math.min(count, i + CHUNK);
    i = boundedRun(ranges, i, to, limit, runLen);
    if (i === to) continue;
    if (!wellFormed(ranges, i, 1, limits)) throw shapeErrorAt(ranges, i);
    if (i > 0) runs.push(runLen, i - runStart);
    runLen = ranges[i * GRANT_STRIDE + GrantField.Length] as number;
    runStart = i;
    i++;
  }
  runs.push(runLen, count - runStart);
  // Out of order somewhere (a malformed range would have been thrown): overlap decides.
  const grid = runs.length === 2 ? gridRangesOverlap(ranges, count, limit, runLen) : undefined;
  if (grid ?? sortedRangesOverlap(ranges, count, 1)) throw overlapError(ranges, count);
  return { bytes: sumRuns(runs), runs };
}

/** From `from`, ranges of any of the registrations inside it, of length `len`, in increasing order per registration (`lastEnd`, updated). */
function manyRun(ranges: Float64Array, from: number, to: number, limits: Float64Array, lastEnd: Float64Array | undefined, len: number): number {
  const nregs = limits.length;
  let i = from;
  for (let at = from * GRANT_STRIDE; i < to; i++, at += GRANT_STRIDE) {
    const r = ranges[at] as number;
    const off = ranges[at + GrantField.Offset] as number;
    if (!(r >= 0 && r < nregs && Math.trunc(r) === r && off >= 0 && off + len <= (limits[r] as number)) || Math.trunc(off) !== off || ranges[at + GrantField.Length] !== len) break;
    if (lastEnd !== undefined) {
      if (off < (lastEnd[r] as number)) break;
      lastEnd[r] = off + len;
    }
  }
  return i;
}

/** Ranges over several registrations: bounds per range, order per registration. */
function checkMany(ranges: Float64Array, count: number, limits: Float64Array): GrantCheck {
  const nregs = limits.length;
  let lastEnd: Float64Array | undefined = new Float64Array(nregs);
  const runs: number[] = [];
  let runLen = Number.NaN;
  let runStart = 0;
  let i = 0;
  while (i < count) {
    const to = Math.min(count, i + CHUNK);
    i = manyRun(ranges, i, to, limits, lastEnd, runLen);
    if (i === to) continue;
    if (!wellFormed(ranges, i, nregs, limits)) throw shapeErrorAt(ranges, i);
    const at = i * GRANT_STRIDE;
    const len = ranges[at + GrantField.Length] as number;
    if (len !== runLen) {
      if (i > 0) runs.push(runLen, i - runStart);
      runLen = len;
      runStart = i;
    }
    const r = ranges[at] as number;
    const off = ranges[at + GrantField.Offset] as number;
    if (lastEnd !== undefined) {
      if (off < (lastEnd[r] as number)) lastEnd = undefined; // out of order: the overlap check decides
      else lastEnd[r] = off + len;
    }
    i++;
  }
  runs.push(runLen, count - runStart);
  if (lastEnd === undefined && sortedRangesOverlap(ranges, count, nregs)) throw overlapError(ranges, count);
  return { bytes: sumRuns(runs), runs };
}

/** Bitmap words allowed for `count` ranges: the bitmap is not worth it over a huge, sparsely granted region. */
export function gridBitmapWords(count: number): number {
  return 1024 + 8 * count;
}

/** From `from`, ranges on the grid (offset - phase a multiple of `len`) whose block is not yet in `seen` (marked). */
function gridRun(ranges: Float64Array, from: number, to: number, phase: number, len: number, seen: Uint32Array): number {
  let i = from;
  for (let at = from * GRANT_STRIDE + GrantField.Offset; i < to; i++, at += GRANT_STRIDE) {
    const rel = (ranges[at] as number) - phase;
    const b = rel / len;
    if (Math.trunc(b) !== b || b * len !== rel) break;
    const w = b >>> 5;
    const bit = 1 << (b & 31);
    const was = seen[w] as number;
    if ((was & bit) !== 0) break;
    seen[w] = was | bit;
  }
  return i;
}

/**
 * Whether two of the ranges (all of registration 0, all `len` bytes, each valid and inside
 * `limit`) share a byte, when they lie on one grid of `len` (every offset ≡ the first's mod
 * `len`): then ranges overlap exactly when their block indices are equal, found with a bitmap
 * over block indices in one pass. `undefined` when the ranges are not on one grid or the
 * bitmap would be large against `count` (the caller falls back to {@link sortedRangesOverlap}).
 */
export function gridRangesOverlap(ranges: Float64Array, count: number, limit: number, len: number): boolean | undefined {
  const phase = (ranges[GrantField.Offset] as number) % len;
  const blocks = Math.ceil((limit - phase) / len);
  const words = Math.ceil(blocks / 32);
  if (!(words <= gridBitmapWords(count))) return undefined;
  const seen = new Uint32Array(words);
  for (let i = 0; i < count; ) {
    const to = Math.min(count, i + CHUNK);
    i = gridRun(ranges, i, to, phase, len, seen);
    if (i === to) continue;
    const rel = (ranges[i * GRANT_STRIDE + GrantField.Offset] as number) - phase;
    const b = rel / len;
    // Off the grid: the sort decides. On it: the block was seen before.
    return Math.trunc(b) !== b || b * len !== rel ? undefined : true;
  }
  return false;
}

/** Sorted starts and ends, per registration bucket (bucket k is [first[k], first[k + 1])). */
function fillStartsEnds(ranges: Float64Array, count: number, nregs: number, fill: Uint32Array, starts: Float64Array, ends: Float64Array): number {
  for (let i = 0, at = 0; i < count; i++, at += GRANT_STRIDE) {
    const k = nregs > 1 ? (ranges[at] as number) : 0;
    const j = fill[k] as number;
    fill[k] = j + 1;
    const off = ranges[at + GrantField.Offset] as number;
    starts[j] = off;
    ends[j] = off + (ranges[at + GrantField.Length] as number);
  }
  return count;
}

/** The first j in (a, b) where a start comes before the end before it, or b. */
function interleaveBreak(starts: Float64Array, ends: Float64Array, a: number, b: number): number {
  let j = a + 1;
  for (; j < b; j++) if ((starts[j] as number) < (ends[j - 1] as number)) break;
  return j;
}

/** Ranges per registration (index k + 1 of `first`), for the counting sort. */
function countPerRegistration(ranges: Float64Array, count: number, first: Uint32Array): number {
  for (let i = 0; i < count; i++) {
    const k = (ranges[i * GRANT_STRIDE] as number) + 1;
    first[k] = (first[k] as number) + 1;
  }
  return count;
}

/**
 * Whether two granted ranges of one registration share a byte, with no object or closure per
 * range: per registration, the sorted starts and the sorted ends (native typed-array sorts)
 * of disjoint half-open ranges interleave (start k+1 >= end k); any overlap breaks that.
 */
export function sortedRangesOverlap(ranges: Float64Array, count: number, nregs: number): boolean {
  const starts = new Float64Array(count);
  const ends = new Float64Array(count);
  // Bucket by registration (counting sort on the handle index), then sort each bucket.
  const first = new Uint32Array(nregs + 1);
  if (nregs > 1) {
    countPerRegistration(ranges, count, first);
    for (let k = 0; k < nregs; k++) first[k + 1] = (first[k + 1] as number) + (first[k] as number);
  } else first[1] = count;
  fillStartsEnds(ranges, count, nregs, first.slice(0, nregs), starts, ends);
  for (let k = 0; k < nregs; k++) {
    const a = first[k] as number;
    const b = first[k + 1] as number;
    if (b - a < 2) continue;
    starts.subarray(a, b).sort();
    ends.subarray(a, b).sort();
    if (interleaveBreak(starts, ends, a, b) < b) return true;
  }
  return false;
}

/** Two granted ranges of one registration sharing a byte, as [later, earlier], or undefined (the error path: objects and closures are fine here). */
export function findGrantOverlap(ranges: Float64Array, count: number): [number, number] | undefined {
  const order = Array.from({ length: count }, (_, i) => i);
  const key = (i: number, f: number): number => ranges[i * GRANT_STRIDE + f] as number;
  order.sort((a, b) => key(a, GrantField.Handle) - key(b, GrantField.Handle) || key(a, GrantField.Offset) - key(b, GrantField.Offset) || a - b);
  let best: [number, number] | undefined;
  for (let k = 1; k < count; k++) {
    const a = order[k - 1] as number;
    const b = order[k] as number;
    if (key(a, GrantField.Handle) === key(b, GrantField.Handle) && key(b, GrantField.Offset) < key(a, GrantField.Offset) + key(a, GrantField.Length)) {
      const pair: [number, number] = [Math.max(a, b), Math.min(a, b)];
      if (best === undefined || pair[0] < best[0]) best = pair;
    }
  }
  return best;
}

// --- block grants ------------------------------------------------------------------------

/** From `from`, block indices in strictly increasing order after `prev` (then distinct). */
function increasingRun(blocks: Uint32Array, from: number, to: number, prev: number): number {
  let i = from;
  for (; i < to; i++) {
    const b = blocks[i] as number;
    if (!(b > prev)) break;
    prev = b;
  }
  return i;
}

/** From `from`, block indices below `limit`. */
function belowRun(blocks: Uint32Array, from: number, to: number, limit: number): number {
  let i = from;
  for (; i < to; i++) if (!((blocks[i] as number) < limit)) break;
  return i;
}

/** From `from`, block indices below `limit` and not yet marked in `seen` (a bitmap; each marked as it passes). */
function unseenRun(blocks: Uint32Array, from: number, to: number, limit: number, seen: Uint32Array): number {
  let i = from;
  for (; i < to; i++) {
    const b = blocks[i] as number;
    if (!(b < limit)) break;
    const w = b >>> 5;
    const bit = 1 << (b & 31);
    const was = seen[w] as number;
    if ((was & bit) !== 0) break;
    seen[w] = was | bit;
  }
  return i;
}

/** From `from`, block indices below `limit` whose entry in `stamps` is not yet `stamp` (each set as it passes). */
function unstampedRun(blocks: Uint32Array, from: number, to: number, limit: number, stamps: Uint32Array, stamp: number): number {
  let i = from;
  for (; i < to; i++) {
    const b = blocks[i] as number;
    if (!(b < limit) || stamps[b] === stamp) break;
    stamps[b] = stamp;
  }
  return i;
}

/**
 * Registrations of at most this many blocks check repeats against {@link stampTable}: one
 * entry per block, marked with a number fresh for each check, so nothing is cleared or
 * allocated per grant (a bitmap made per grant cost about 3 ns a block; this about 1). At most
 * 4 MiB, kept for the process once a grant needed it.
 */
export const STAMP_MAX_BLOCKS = 1 << 20;
let stampTable = new Uint32Array(0);
let stampNow = 0;

/** The stamp table for `nBlocks` blocks and a stamp no entry holds. */
function freshStamp(nBlocks: number): { stamps: Uint32Array; stamp: number } {
  if (stampTable.length < nBlocks) {
    stampTable = new Uint32Array(2 ** Math.ceil(Math.log2(nBlocks)));
    stampNow = 0;
  }
  if (stampNow === 0xffffffff) {
    stampTable.fill(0);
    stampNow = 0;
  }
  return { stamps: stampTable, stamp: ++stampNow };
}

function blockBoundsError(blocks: Uint32Array, i: number, nBlocks: number): InvalidInputError {
  return new InvalidInputError(`blocks[${i}] (block ${String(blocks[i])}) is outside the registration, which holds blocks 0 to ${nBlocks - 1}`, {
    details: { field: 'blocks', range: i },
  });
}

/** The lowest index whose block appeared earlier, with that earlier index (the error path). */
function findRepeatedBlock(blocks: Uint32Array, count: number): [number, number] {
  const first = new Map<number, number>();
  for (let i = 0; i < count; i++) {
    const b = blocks[i] as number;
    const at = first.get(b);
    if (at !== undefined) return [i, at];
    first.set(b, i);
  }
  throw new Error('findRepeatedBlock: no block repeats'); // unreachable: called after a repeat was seen
}

/**
 * Check the block indices of a block grant: `count` indices of `blocks` (the engine's private
 * copy), each below `nBlocks` (the blocks that fit the registration), none twice (two ranges of
 * one block would overlap). Nothing is allocated per block. In increasing order (a lease's
 * blocks sorted) that is one compare per block and one bound at the end; otherwise (a lease in
 * layer-major order, the common case) one pass that bounds each index and marks it in the
 * stamp table ({@link STAMP_MAX_BLOCKS}), or in a bitmap over a larger registration, or (over a
 * huge, sparsely granted one) a bounds pass and a sorted copy. Throws InvalidInputError naming
 * the lowest index out of bounds, else the lowest repeat (`details.range`), field `blocks`.
 */
export function checkGrantBlocks(blocks: Uint32Array, count: number, nBlocks: number): void {
  let i = 0;
  let prev = -1;
  while (i < count) {
    const to = Math.min(count, i + CHUNK);
    const j = increasingRun(blocks, i, to, prev);
    if (j > i) prev = blocks[j - 1] as number;
    i = j;
    if (i < to) break;
  }
  if (prev >= nBlocks) throw blockBoundsError(blocks, belowRun(blocks, 0, count, nBlocks), nBlocks);
  if (i === count) return;
  // Out of order from `i`: one pass over all of them, each against the bound and for a repeat
  // (a stamp table, a bitmap over a larger registration, or a sorted copy over a huge one).
  let clean = true;
  if (nBlocks <= STAMP_MAX_BLOCKS) {
    const { stamps, stamp } = freshStamp(nBlocks);
    for (let k = 0; k < count && clean; ) {
      const to = Math.min(count, k + CHUNK);
      k = unstampedRun(blocks, k, to, nBlocks, stamps, stamp);
      clean = k === to;
    }
  } else if (Math.ceil(nBlocks / 32) <= gridBitmapWords(count)) {
    const seen = new Uint32Array(Math.ceil(nBlocks / 32));
    for (let k = 0; k < count && clean; ) {
      const to = Math.min(count, k + CHUNK);
      k = unseenRun(blocks, k, to, nBlocks, seen);
      clean = k === to;
    }
  } else {
    for (let k = i; k < count && clean; ) {
      const to = Math.min(count, k + CHUNK);
      k = belowRun(blocks, k, to, nBlocks);
      clean = k === to;
    }
    if (clean) {
      const sorted = blocks.slice(0, count).sort();
      clean = increasingRun(sorted, 0, count, -1) === count;
    }
  }
  if (clean) return;
  // The error path: bounds first (the lowest index out of them), then the lowest repeat.
  const out = belowRun(blocks, 0, count, nBlocks);
  if (out < count) throw blockBoundsError(blocks, out, nBlocks);
  const [later, earlier] = findRepeatedBlock(blocks, count);
  throw new InvalidInputError(`blocks[${later}] repeats blocks[${earlier}] (block ${String(blocks[later])}): its ranges would overlap`, {
    details: { field: 'blocks', range: later },
  });
}

/**
 * The ranges of a block grant as GRANT_STRIDE numbers each (registration 0), for transports
 * that do not handle {@link GrantRanges.blocks} themselves.
 */
export function expandGrantBlocks(blocks: Uint32Array, count: number, base: number, blockBytes: number): Float64Array {
  const out = new Float64Array(count * GRANT_STRIDE);
  for (let k = 0, at = 0; k < count; k++, at += GRANT_STRIDE) {
    out[at + GrantField.Offset] = base + (blocks[k] as number) * blockBytes;
    out[at + GrantField.Length] = blockBytes;
  }
  return out;
}

/** The block specs the engine made and checked (only it adds to this: the set is not exported). */
const checkedBlocks = new WeakSet<GrantBlocks>();

/** @internal The engine's: `blocks` (frozen, its own indices copy) passed {@link checkGrantBlocks}. */
export function markCheckedBlocks(blocks: GrantBlocks): GrantBlocks {
  checkedBlocks.add(Object.freeze(blocks));
  return blocks;
}

/**
 * Whether `spec.blocks` is a block spec the engine made and checked (every index inside the
 * registration, none twice) and handed to this transport: then a transport may skip a bound
 * of its own per index, keeping a block grant's cost flat. False for a spec built by anyone
 * else (a direct call of `Transport.grant`), which a transport must check itself.
 */
export function engineCheckedBlocks(spec: GrantRanges): boolean {
  const b: unknown = spec.blocks;
  return typeof b === 'object' && b !== null && checkedBlocks.has(b as GrantBlocks);
}
