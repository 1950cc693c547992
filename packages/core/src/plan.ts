/**
 * Batch planning: merge adjacent ranges, find overlapping destinations, split into chunks
 * spread over streams. Pure functions over the {@link TransferBatch} range layout
 * (`RANGE_STRIDE` numbers per range, see {@link RangeField}); no object per range.
 */
import { RANGE_STRIDE, RangeField, type TransferBatch } from './transport.js';

const S = RANGE_STRIDE;
const REQ = RangeField.Request;
const LOC = RangeField.Local;
const LOFF = RangeField.LocalOffset;
const REM = RangeField.Remote;
const ROFF = RangeField.RemoteOffset;
const LEN = RangeField.Length;
const RR = RangeField.RemoteRange;

/**
 * Append range (request, local, localOffset, remote, remoteOffset, length, remoteRange) to
 * `ranges` holding `count` ranges, merging it into the last one when it continues it on both
 * sides (same local, same remote and remote range, contiguous offsets). Returns the new count.
 * `ranges` must have room.
 */
export function appendMerged(
  ranges: Float64Array,
  count: number,
  request: number,
  local: number,
  localOffset: number,
  remote: number,
  remoteOffset: number,
  length: number,
  remoteRange = 0,
): number {
  if (count > 0) {
    const p = (count - 1) * S;
    const plen = ranges[p + LEN] as number;
    if (
      ranges[p + LOC] === local &&
      ranges[p + REM] === remote &&
      ranges[p + RR] === remoteRange &&
      (ranges[p + LOFF] as number) + plen === localOffset &&
      (ranges[p + ROFF] as number) + plen === remoteOffset
    ) {
      ranges[p + LEN] = plen + length;
      return count;
    }
  }
  const at = count * S;
  ranges[at + REQ] = request;
  ranges[at + LOC] = local;
  ranges[at + LOFF] = localOffset;
  ranges[at + REM] = remote;
  ranges[at + ROFF] = remoteOffset;
  ranges[at + LEN] = length;
  ranges[at + RR] = remoteRange;
  return count + 1;
}

/**
 * The first range (by position) whose destination overlaps another range's destination, as
 * `[i, j]` range positions (i later, j the one it overlaps), or undefined. The destination of
 * range i is `(groupOf[i], offset(i), length(i))`: `side` says which side is written (its
 * offset field), and `groupOf[i]` (one of `groups`) names the destination region of range i
 * (two table entries may name one region). O(n) when destinations come in increasing order
 * per region, O(n log n) otherwise.
 */
export function findOverlap(ranges: Float64Array, count: number, side: 'local' | 'remote', groupOf: ArrayLike<number>, groups: number): [number, number] | undefined {
  const O = side === 'local' ? LOFF : ROFF;
  const lastEnd = new Float64Array(groups).fill(-1);
  let monotone = true;
  for (let i = 0; i < count; i++) {
    const at = i * S;
    const g = groupOf[i] as number;
    const start = ranges[at + O] as number;
    if (start < (lastEnd[g] as number)) {
      monotone = false;
      break;
    }
    lastEnd[g] = start + (ranges[at + LEN] as number);
  }
  if (monotone) return undefined;
  const order = new Uint32Array(count);
  for (let i = 0; i < count; i++) order[i] = i;
  order.sort((a, b) => {
    const ga = groupOf[a] as number;
    const gb = groupOf[b] as number;
    if (ga !== gb) return ga - gb;
    const d = (ranges[a * S + O] as number) - (ranges[b * S + O] as number);
    return d !== 0 ? d : a - b;
  });
  let best: [number, number] | undefined;
  let prev = -1;
  let prevEnd = -1;
  let prevGroup = -1;
  for (let k = 0; k < count; k++) {
    const i = order[k] as number;
    const at = i * S;
    const g = groupOf[i] as number;
    const start = ranges[at + O] as number;
    const end = start + (ranges[at + LEN] as number);
    if (g === prevGroup && start < prevEnd) {
      const later = Math.max(i, prev);
      const earlier = Math.min(i, prev);
      if (best === undefined || later < best[0]) best = [later, earlier];
    }
    if (g !== prevGroup || end > prevEnd) {
      prevGroup = g;
      prevEnd = end;
      prev = i;
    }
  }
  return best;
}

/** Number of chunks of at most `cap` bytes the ranges split into. */
export function chunkCount(ranges: Float64Array, count: number, cap: number): number {
  let n = 0;
  for (let i = 0; i < count; i++) n += Math.ceil((ranges[i * S + LEN] as number) / cap);
  return n;
}

/**
 * Split ranges into chunks of min(remaining, cap) bytes (invariant 8) and deal them to
 * `streams` streams, starting at stream `first`. Returns one batch per stream (undefined for
 * a stream that gets nothing) sharing the `locals` and `remotes` tables.
 *
 * When no range exceeds the cap (the common KV-cache case) nothing is copied: each stream
 * gets a contiguous run of the ranges, cut where the bytes balance, as a view of `ranges`.
 * Otherwise chunks are dealt round-robin into fresh arrays.
 */
export function splitIntoBatches(
  op: 'read' | 'write',
  locals: readonly object[],
  remotes: readonly unknown[],
  ranges: Float64Array,
  count: number,
  cap: number,
  streams: number,
  first: number,
): { batches: (TransferBatch | undefined)[]; chunks: number } {
  let fits = true;
  let totalBytes = 0;
  for (let i = 0; i < count; i++) {
    const len = ranges[i * S + LEN] as number;
    totalBytes += len;
    if (len > cap) fits = false;
  }
  if (fits) {
    const batches: (TransferBatch | undefined)[] = new Array<TransferBatch | undefined>(streams).fill(undefined);
    const parts = Math.min(streams, count);
    let start = 0;
    let acc = 0;
    for (let j = 0; j < parts; j++) {
      // Cut after the range where the running byte count reaches this part's share, leaving
      // at least one range for each later part.
      const target = (totalBytes * (j + 1)) / parts;
      let end = start;
      let bytes = 0;
      while (end < count - (parts - 1 - j) && (end === start || acc < target || j === parts - 1)) {
        const len = ranges[end * S + LEN] as number;
        acc += len;
        bytes += len;
        end++;
        if (acc >= target && j !== parts - 1) break;
      }
      batches[(first + j) % streams] = Object.freeze({ op, locals, remotes, count: end - start, ranges: ranges.subarray(start * S, end * S), bytes });
      start = end;
    }
    return { batches, chunks: count };
  }
  const total = chunkCount(ranges, count, cap);
  const perStream = new Uint32Array(streams);
  for (let k = 0; k < total; k++) {
    const s = (first + k) % streams;
    perStream[s] = (perStream[s] as number) + 1;
  }
  const out: Float64Array[] = [];
  for (let s = 0; s < streams; s++) out.push(new Float64Array((perStream[s] as number) * S));
  const fill = new Uint32Array(streams);
  const bytes = new Float64Array(streams);
  let stream = first % streams;
  for (let i = 0; i < count; i++) {
    const at = i * S;
    const length = ranges[at + LEN] as number;
    for (let done = 0; done < length; ) {
      const n = Math.min(length - done, cap);
      const dst = out[stream] as Float64Array;
      const o = (fill[stream] as number) * S;
      dst[o + REQ] = ranges[at + REQ] as number;
      dst[o + LOC] = ranges[at + LOC] as number;
      dst[o + LOFF] = (ranges[at + LOFF] as number) + done;
      dst[o + REM] = ranges[at + REM] as number;
      dst[o + ROFF] = (ranges[at + ROFF] as number) + done;
      dst[o + LEN] = n;
      dst[o + RR] = ranges[at + RR] as number;
      fill[stream] = (fill[stream] as number) + 1;
      bytes[stream] = (bytes[stream] as number) + n;
      done += n;
      stream = stream + 1 === streams ? 0 : stream + 1;
    }
  }
  const batches: (TransferBatch | undefined)[] = [];
  for (let s = 0; s < streams; s++) {
    const c = perStream[s] as number;
    batches.push(c === 0 ? undefined : Object.freeze({ op, locals, remotes, count: c, ranges: out[s] as Float64Array, bytes: bytes[s] as number }));
  }
  return { batches, chunks: total };
}
