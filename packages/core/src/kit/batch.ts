/**
 * What a kit transport derives once from a {@link TransferBatch}: every range checked, and the
 * request frames encoded (READV_REQ or WRITEV_REQ heads, cut at {@link BatchLimits.frameTargetBytes}
 * of data, the protocol's range and token limits). The engine posts the same batch object again
 * for prepared transfers, so plans are cached per batch (and per chunk limit) in a WeakMap; a
 * post only patches request ids. What can change between posts (a registration revoked, the
 * connection's state) is re-checked by the stream on every post.
 */
import { InvalidInputError } from '../errors.js';
import { RANGE_STRIDE, RangeField, type TransferBatch } from '../transport.js';
import { FrameType, HEADER_BYTES, MAX_RANGES_PER_FRAME, MAX_TOKENS_PER_FRAME, allocVecFrame, putRange, putToken, vecHeadBytes, type ScatterList } from './frames.js';
import { LocalRegistration, RemoteGrant, type GrantTable } from './grants.js';

/** One request frame of a batch: ranges [start, start+count), encoded once. */
export interface FramePlan {
  readonly start: number;
  readonly count: number;
  readonly bytes: number;
  /** Header and head; for a write, followed by room for the frame's small ranges' data. */
  readonly wire: Buffer;
  /** Header + head bytes. */
  readonly headEnd: number;
  /** The wire buffer is queued in a socket (a concurrent post of the same batch must use a copy). */
  busy: boolean;
  /** Reads: where READV_DATA lands, in order (locally contiguous ranges merged: {@link receiveList}). */
  readonly scatter: ScatterList | undefined;
}

export interface BatchPlan {
  /** The connection chunk limit it was checked against. */
  readonly cap: number;
  readonly table: GrantTable;
  readonly write: boolean;
  readonly locals: readonly LocalRegistration[];
  /** Per local: its memory as a Buffer (for sending). */
  readonly buffers: readonly Buffer[];
  readonly frames: readonly FramePlan[];
}

export interface BatchLimits {
  /** The connection's agreed chunk limit: the most one range, and one frame's data, may be. */
  readonly cap: number;
  /** A frame carries at most this much data (a larger single range is a frame of its own). */
  readonly frameTargetBytes: number;
  /** Write ranges below this are copied behind the head; larger ones are sent from the memory itself. */
  readonly zeroCopyMinBytes: number;
}

const plans = new WeakMap<TransferBatch, BatchPlan>();

function badRange(batch: TransferBatch, i: number, message: string): InvalidInputError {
  const request = batch.ranges[i * RANGE_STRIDE + RangeField.Request];
  return new InvalidInputError(`range ${i} (request ${request}): ${message}`, { details: { request, range: i } });
}

function isIndex(v: number, n: number): boolean {
  return Number.isInteger(v) && v >= 0 && v < n;
}

function isOffset(v: number): boolean {
  return Number.isSafeInteger(v) && v >= 0;
}

/**
 * Where a read frame's data lands: its ranges in order, with ranges that follow each other in
 * one local buffer (the next starts where the one before ends) merged into one entry. The
 * response carries the ranges back to back, so a run of locally contiguous destinations (a KV
 * fetch into consecutive blocks of one buffer, however scattered the remote blocks) is one
 * destination: received straight into it when large enough, where each range alone would be
 * staged and copied.
 */
export function receiveList(buffers: readonly Buffer[], r: Float64Array, start: number, end: number): ScatterList {
  const m = receiveEntries(r, start, end);
  const table = new Float64Array(m * 3);
  let e = -1;
  let lastBuf = -1;
  let lastEnd = -1;
  for (let i = start; i < end; i++) {
    const at = i * RANGE_STRIDE;
    const l = r[at + RangeField.Local] as number;
    const lo = r[at + RangeField.LocalOffset] as number;
    const len = r[at + RangeField.Length] as number;
    if (l === lastBuf && lo === lastEnd) table[e * 3 + 2] = (table[e * 3 + 2] as number) + len;
    else {
      e++;
      table[e * 3] = l;
      table[e * 3 + 1] = lo;
      table[e * 3 + 2] = len;
      lastBuf = l;
    }
    lastEnd = lo + len;
  }
  return { buffers, table, stride: 3, bufferField: 0, offsetField: 1, lengthField: 2, first: 0, count: m };
}

/** How many entries {@link receiveList} makes of ranges [start, end): one per run of locally contiguous ranges. */
function receiveEntries(r: Float64Array, start: number, end: number): number {
  let m = 0;
  let lastBuf = -1;
  let lastEnd = -1;
  for (let i = start; i < end; i++) {
    const at = i * RANGE_STRIDE;
    const l = r[at + RangeField.Local] as number;
    const lo = r[at + RangeField.LocalOffset] as number;
    if (l !== lastBuf || lo !== lastEnd) m++;
    lastBuf = l;
    lastEnd = lo + (r[at + RangeField.Length] as number);
  }
  return m;
}

/** The cached plan of `batch` for this table and chunk limit, or a fresh one. Throws InvalidInputError naming the range. */
export function planFor(batch: TransferBatch, table: GrantTable, limits: BatchLimits): BatchPlan {
  const cached = plans.get(batch);
  if (cached !== undefined && cached.cap === limits.cap && cached.table === table) return cached;
  const plan = planBatch(batch, table, limits);
  plans.set(batch, plan);
  return plan;
}

/** Check a batch once and encode its request frames. Throws InvalidInputError naming the range. */
export function planBatch(batch: TransferBatch, table: GrantTable, limits: BatchLimits): BatchPlan {
  const { cap, zeroCopyMinBytes } = limits;
  const write = batch.op === 'write';
  if (!write && batch.op !== 'read') throw new InvalidInputError(`batch op ${String(batch.op)} is neither read nor write`);
  const n = batch.count;
  const r = batch.ranges;
  if (!Number.isSafeInteger(n) || n < 0 || !(r instanceof Float64Array) || r.length < n * RANGE_STRIDE) throw new InvalidInputError('batch range table is malformed');
  const locals = batch.locals.map((l) => {
    if (!(l instanceof LocalRegistration) || l.table !== table) throw new InvalidInputError(`local registration is not a ${table.transport} registration of this transport`);
    return l;
  });
  const remotes = batch.remotes.map((x) => {
    if (!(x instanceof RemoteGrant)) throw new InvalidInputError(`remote is not a decoded ${table.transport} descriptor`);
    return x;
  });
  const buffers = locals.map((g) => g.bytes);
  for (let i = 0; i < n; i++) {
    const at = i * RANGE_STRIDE;
    const l = r[at + RangeField.Local] as number;
    const lo = r[at + RangeField.LocalOffset] as number;
    const m = r[at + RangeField.Remote] as number;
    const ro = r[at + RangeField.RemoteOffset] as number;
    const len = r[at + RangeField.Length] as number;
    const k = r[at + RangeField.RemoteRange] as number;
    if (!isIndex(l, locals.length) || !isIndex(m, remotes.length)) throw badRange(batch, i, 'local or remote index is out of the batch tables');
    if (!Number.isInteger(len) || len < 1 || len > cap) throw badRange(batch, i, `length ${len} is not 1..${cap} (the connection's chunk limit)`);
    if (!isOffset(lo) || lo + len > (buffers[l] as Uint8Array).length) throw badRange(batch, i, `${lo}+${len} does not fit the local registration`);
    const lens = (remotes[m] as RemoteGrant).rangeLengths;
    if (!isIndex(k, lens.length)) throw badRange(batch, i, `remote range ${k} does not exist (the remote has ${lens.length})`);
    if (!isOffset(ro) || !(ro + len <= (lens[k] as number))) {
      throw badRange(batch, i, `${ro}+${len} does not fit ${(remotes[m] as RemoteGrant).granted ? `remote granted range ${k} of ${lens[k]} bytes` : 'the remote registration'}`);
    }
  }
  // Cut into frames: at most frameTargetBytes of data (one larger range stands alone), and the
  // protocol's range and token limits. Tokens are per frame, deduplicated.
  const target = Math.min(limits.frameTargetBytes, cap);
  const tokenOf = new Int32Array(remotes.length).fill(-1);
  const used: number[] = [];
  const frames: FramePlan[] = [];
  const close = (start: number, end: number, bytes: number): void => {
    const count = end - start;
    let small = 0;
    if (write) {
      for (let i = start; i < end; i++) {
        const len = r[i * RANGE_STRIDE + RangeField.Length] as number;
        if (len < zeroCopyMinBytes) small += len;
      }
    }
    const wire = allocVecFrame(write ? FrameType.WritevReq : FrameType.ReadvReq, 0, used.length, count, write ? bytes : 0, small);
    used.forEach((m, t) => putToken(wire, t, (remotes[m] as RemoteGrant).token));
    for (let i = start; i < end; i++) {
      const at = i * RANGE_STRIDE;
      putRange(wire, used.length, i - start, tokenOf[r[at + RangeField.Remote] as number] as number, r[at + RangeField.RemoteRange] as number, r[at + RangeField.RemoteOffset] as number, r[at + RangeField.Length] as number);
    }
    const scatter: ScatterList | undefined = write ? undefined : receiveList(buffers, r, start, end);
    frames.push({ start, count, bytes, wire, headEnd: HEADER_BYTES + vecHeadBytes(used.length, count), busy: false, scatter });
    for (const m of used) tokenOf[m] = -1;
    used.length = 0;
  };
  let start = 0;
  let bytes = 0;
  for (let i = 0; i < n; i++) {
    const at = i * RANGE_STRIDE;
    const len = r[at + RangeField.Length] as number;
    const m = r[at + RangeField.Remote] as number;
    if (i > start && (i - start >= MAX_RANGES_PER_FRAME || bytes + len > target || (tokenOf[m] === -1 && used.length >= MAX_TOKENS_PER_FRAME))) {
      close(start, i, bytes);
      start = i;
      bytes = 0;
    }
    if (tokenOf[m] === -1) tokenOf[m] = used.push(m) - 1;
    bytes += len;
  }
  if (n > start) close(start, n, bytes);
  return { cap, table, write, locals, buffers, frames };
}
