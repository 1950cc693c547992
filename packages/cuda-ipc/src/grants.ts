/**
 * Range grants of the cuda-ipc transport ("register once, grant per lease"): the grant table
 * segment, its records, its directory of data segments and the arena holding each grant's
 * range table. Layout in native/layout.h; design in the README ("Range grants").
 *
 * Owner side: {@link GrantTable} (one per transport, a few more when it fills up) hands out
 * records and arena space; writing a grant is O(ranges) plain stores into the table and one
 * native publish; revoking it is O(1) (one native call, then the record and its arena space
 * go back to the free lists once the peers' in-flight counter drained).
 *
 * Reader side: {@link openTableView} validates a peer's table (header, geometry against the
 * mapping size), and {@link readRangeTable} reads one grant's range table while the grant is
 * entered, checking every value against what the reader learned itself.
 */
import { randomFillSync } from 'node:crypto';
import { GRANT_STRIDE, InvalidInputError, RemoteRejectedError, ResourceExhaustedError, formatId } from '@tensorwire/core';
import { GrantResult, SegmentKind, SegmentState, native } from './native.js';
import { randomSegmentName, segmentNameProblem } from './names.js';
import { selfStartTime } from './proc.js';
import { HEADER_SIZE } from './shared.js';

export const RECORD_BYTES = 64;
export const DIR_BYTES = 256;
export const RANGE_BYTES = 24;
export const TOKEN_BYTES = 16;
// Record fields.
const R_TOKEN = 16;
const R_ARENA = 32;
const R_COUNT = 40;
const R_FORM = 44;
/** Record forms (native/layout.h RecordForm): how the record's table in the arena reads. */
export const RecordForm = { Ranges: 0, Blocks: 1 } as const;
/** Arena bytes of a block grant's table: one range entry (segment, block 0, block bytes), then a u32 per block, 8-aligned. */
export function blockTableBytes(count: number): number {
  return RANGE_BYTES + Math.ceil((count * 4) / 8) * 8;
}
// Directory entry fields.
const D_STATE = 0;
const D_FLAGS = 4;
const D_BYTES = 8;
const D_NAME_LEN = 16;
const D_NAME = 17;
const MAX_NAME = 200;
/** Directory flag: the segment is a seqlocked pool slot (read-only to peers). */
export const DIR_SEQLOCKED = 1;
// Table ext fields.
const T_RECORDS = 1024;
const T_DIR = 1028;
const T_ARENA = 1032;
// What a reader accepts (native/layout.h).
const MAX_RECORDS = 2 ** 20;
const MAX_DIR = 2 ** 18;
const MAX_ARENA = 2 ** 32;
/** Largest table mapping a reader opens. */
export const MAX_TABLE_BYTES = HEADER_SIZE + MAX_RECORDS * RECORD_BYTES + MAX_DIR * DIR_BYTES + MAX_ARENA;
const TWO32 = 2 ** 32;

let layoutChecked = false;
/** The addon's layout must be this module's (a stale build would read other offsets). */
function checkLayout(): void {
  if (layoutChecked) return;
  const t = native.layout().table;
  if (
    !t ||
    t['recordBytes'] !== RECORD_BYTES ||
    t['dirEntryBytes'] !== DIR_BYTES ||
    t['rangeEntryBytes'] !== RANGE_BYTES ||
    t['recordToken'] !== R_TOKEN ||
    t['recordArenaOffset'] !== R_ARENA ||
    t['recordCount'] !== R_COUNT ||
    t['recordForm'] !== R_FORM ||
    t['maxRecords'] !== MAX_RECORDS ||
    t['maxDir'] !== MAX_DIR ||
    t['maxArena'] !== MAX_ARENA
  ) {
    throw new InvalidInputError('the cuda-ipc addon was built for another grant table layout (rebuild it: npm run build -w @tensorwire/cuda-ipc)');
  }
  layoutChecked = true;
}

/** How big a grant table is: records, directory entries (data segments), arena bytes. */
export interface TableGeometry {
  readonly records: number;
  readonly dir: number;
  readonly arena: number;
}

export function tableBytes(g: TableGeometry): number {
  return HEADER_SIZE + g.records * RECORD_BYTES + g.dir * DIR_BYTES + g.arena;
}

/** Check a geometry against the reader's limits (throws InvalidInputError). */
export function checkGeometry(g: TableGeometry, what = 'grant table'): void {
  const ok =
    Number.isSafeInteger(g.records) &&
    g.records >= 1 &&
    g.records <= MAX_RECORDS &&
    Number.isSafeInteger(g.dir) &&
    g.dir >= 1 &&
    g.dir <= MAX_DIR &&
    Number.isSafeInteger(g.arena) &&
    g.arena >= RANGE_BYTES &&
    g.arena <= MAX_ARENA &&
    g.arena % 8 === 0;
  if (!ok) {
    throw new InvalidInputError(`${what}: records 1..${MAX_RECORDS}, segments 1..${MAX_DIR}, range bytes ${RANGE_BYTES}..${MAX_ARENA} (a multiple of 8)`, {
      details: { field: 'grantTable' },
    });
  }
}

/**
 * First-fit allocator over [0, size): free blocks sorted by offset, coalesced on free. A
 * free that overlaps a free block throws (a double free is a bug, never silent reuse).
 */
export class ArenaAllocator {
  readonly #off: number[] = [];
  readonly #len: number[] = [];
  #free = 0;
  constructor(readonly size: number) {
    if (size > 0) {
      this.#off.push(0);
      this.#len.push(size);
      this.#free = size;
    }
  }
  get freeBytes(): number {
    return this.#free;
  }
  /** Offset of `n` free bytes (n > 0), or undefined. */
  alloc(n: number): number | undefined {
    const off = this.#off;
    const len = this.#len;
    for (let i = 0; i < off.length; i++) {
      const l = len[i] as number;
      if (l < n) continue;
      const at = off[i] as number;
      if (l === n) {
        off.splice(i, 1);
        len.splice(i, 1);
      } else {
        off[i] = at + n;
        len[i] = l - n;
      }
      this.#free -= n;
      return at;
    }
    return undefined;
  }
  free(at: number, n: number): void {
    const off = this.#off;
    const len = this.#len;
    let lo = 0;
    let hi = off.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if ((off[mid] as number) < at) lo = mid + 1;
      else hi = mid;
    }
    const prevEnd = lo > 0 ? (off[lo - 1] as number) + (len[lo - 1] as number) : -1;
    if (at < 0 || n <= 0 || at + n > this.size || prevEnd > at || (lo < off.length && (off[lo] as number) < at + n)) {
      throw new Error(`cuda-ipc grant arena: free of ${at}+${n} overlaps free space (double free)`);
    }
    const mergePrev = lo > 0 && prevEnd === at;
    const mergeNext = lo < off.length && off[lo] === at + n;
    if (mergePrev && mergeNext) {
      len[lo - 1] = (len[lo - 1] as number) + n + (len[lo] as number);
      off.splice(lo, 1);
      len.splice(lo, 1);
    } else if (mergePrev) len[lo - 1] = (len[lo - 1] as number) + n;
    else if (mergeNext) {
      off[lo] = at;
      len[lo] = (len[lo] as number) + n;
    } else {
      off.splice(lo, 0, at);
      len.splice(lo, 0, n);
    }
    this.#free += n;
  }
}

/** A data segment a registration lies in: what a directory entry says about it. */
export interface GrantedSegment {
  /** Segment name (`/tw-p.…`). */
  readonly name: string;
  /** Bytes of its data area (informational for readers; they check against fstat). */
  readonly dataBytes: number;
  readonly seqlocked: boolean;
}

interface DirEntry {
  readonly index: number;
  refs: number;
}

/** 16 random bytes per grant, drawn from a pooled buffer (one getrandom call per 256 tokens). */
const tokenPool = new Uint8Array(4096);
let tokenAt = tokenPool.length;
export function freshToken(into: Uint8Array, at: number): void {
  if (tokenAt + TOKEN_BYTES > tokenPool.length) {
    randomFillSync(tokenPool);
    tokenAt = 0;
  }
  into.set(tokenPool.subarray(tokenAt, tokenAt + TOKEN_BYTES), at);
  // Used bytes are wiped: a token exists only in its record and its payload.
  tokenPool.fill(0, tokenAt, tokenAt + TOKEN_BYTES);
  tokenAt += TOKEN_BYTES;
}

/**
 * One grant table segment `/tw-t.<node>.<random>` (mode 0600, like every segment), owned by
 * one transport. Records and arena space come from free lists; a record's generation goes up
 * by one at every revoke, so a payload naming an earlier grant on a reused record is refused.
 */
export class GrantTable {
  readonly name: string;
  readonly mapping: ArrayBuffer;
  readonly geometry: TableGeometry;
  readonly u8: Uint8Array;
  readonly u32: Uint32Array;
  readonly dirAt: number;
  readonly arenaAt: number;
  readonly arena: ArenaAllocator;
  /** Free record indices (a stack). */
  readonly #freeRecords: number[] = [];
  /** Per record: 1 while it is handed out (a grant's, or retired after a drain that timed out). */
  readonly #used: Uint8Array;
  /** Per record: the generation its next (or current) grant carries. */
  readonly #gens: Float64Array;
  readonly #freeDir: number[] = [];
  readonly #dir = new Map<string, DirEntry>();
  /** Grants handed out and not yet freed. */
  live = 0;
  #closed = false;

  private constructor(name: string, mapping: ArrayBuffer, geometry: TableGeometry) {
    this.name = name;
    this.mapping = mapping;
    this.geometry = geometry;
    this.u8 = new Uint8Array(mapping);
    this.u32 = new Uint32Array(mapping);
    this.dirAt = HEADER_SIZE + geometry.records * RECORD_BYTES;
    this.arenaAt = this.dirAt + geometry.dir * DIR_BYTES;
    this.arena = new ArenaAllocator(geometry.arena);
    this.#used = new Uint8Array(geometry.records);
    this.#gens = new Float64Array(geometry.records).fill(1);
    for (let i = geometry.records - 1; i >= 0; i--) this.#freeRecords.push(i);
    for (let i = geometry.dir - 1; i >= 0; i--) this.#freeDir.push(i);
  }

  /** Create, size and publish a table for `nodeId` (the caller unlinks it on close; the exit hook too). */
  static create(nodeId: string, geometry: TableGeometry): GrantTable {
    checkLayout();
    checkGeometry(geometry);
    const name = randomSegmentName('t', nodeId);
    const mapping = native.shmCreate(name, tableBytes(geometry), {
      kind: SegmentKind.GrantTable,
      id: formatId('block', nodeId, `t${name.slice(-32)}`),
      ownerPid: process.pid,
      ownerStart: selfStartTime(),
    });
    const dv = new DataView(mapping);
    dv.setUint32(T_RECORDS, geometry.records, true);
    dv.setUint32(T_DIR, geometry.dir, true);
    dv.setBigUint64(T_ARENA, BigInt(geometry.arena), true);
    native.setState(mapping, SegmentState.Live);
    return new GrantTable(name, mapping, geometry);
  }

  get closed(): boolean {
    return this.#closed;
  }
  get freeRecords(): number {
    return this.#freeRecords.length;
  }

  recordOffset(index: number): number {
    return HEADER_SIZE + index * RECORD_BYTES;
  }

  /**
   * Directory entries the registrations `hs` still need here: the distinct segments of those
   * that hold no reference in this table yet and are not in its directory. Registrations
   * already attached (every later grant over them) cost one short array scan each.
   */
  missing(hs: readonly { readonly tables: readonly GrantTable[] | undefined; readonly segment: GrantedSegment | undefined }[]): number {
    let fresh: Set<string> | undefined;
    for (const h of hs) {
      if (h.tables !== undefined && h.tables.includes(this)) continue;
      const name = (h.segment as GrantedSegment).name;
      if (!this.#dir.has(name)) (fresh ??= new Set()).add(name);
    }
    return fresh === undefined ? 0 : fresh.size;
  }
  get freeDir(): number {
    return this.#freeDir.length;
  }

  /** The directory index of `segment`, taking one reference (entries are written once, on first use). */
  attach(segment: GrantedSegment): number {
    let e = this.#dir.get(segment.name);
    if (!e) {
      const index = this.#freeDir.pop();
      if (index === undefined) throw new ResourceExhaustedError(`cuda-ipc grant table ${this.name}: no free directory entry`);
      const at = this.dirAt + index * DIR_BYTES;
      const nb = Buffer.from(segment.name, 'latin1');
      if (nb.length > MAX_NAME) throw new InvalidInputError(`segment name ${segment.name} is too long for a grant table`);
      this.u32[(at + D_FLAGS) / 4] = segment.seqlocked ? DIR_SEQLOCKED : 0;
      this.u32[(at + D_BYTES) / 4] = segment.dataBytes % TWO32;
      this.u32[(at + D_BYTES) / 4 + 1] = Math.floor(segment.dataBytes / TWO32);
      this.u8[at + D_NAME_LEN] = nb.length;
      this.u8.set(nb, at + D_NAME);
      // Written before any record that names it is published (RecordPublish is seq_cst).
      this.u32[(at + D_STATE) / 4] = 1;
      e = { index, refs: 0 };
      this.#dir.set(segment.name, e);
    }
    e.refs++;
    return e.index;
  }

  /** Drop one reference to `segment`'s entry; the last one frees it. */
  detach(segment: GrantedSegment): void {
    const e = this.#dir.get(segment.name);
    if (!e || this.#closed) return;
    if (--e.refs > 0) return;
    this.#dir.delete(segment.name);
    const at = this.dirAt + e.index * DIR_BYTES;
    this.u32[(at + D_STATE) / 4] = 0;
    this.u8.fill(0, at, at + DIR_BYTES);
    this.#freeDir.push(e.index);
  }

  /** A free record: its index and the generation its grant will carry. */
  takeRecord(): { index: number; generation: number } | undefined {
    const index = this.#freeRecords.pop();
    if (index === undefined) return undefined;
    this.#used[index] = 1;
    this.live++;
    return { index, generation: this.#gens[index] as number };
  }

  /** Give back a record taken and never published (a failed grant). */
  untakeRecord(index: number): void {
    this.#release(index);
  }

  /** The record's grant was revoked and drained: it may carry a new grant (at the next generation). */
  freeRecord(index: number, nextGeneration: number): void {
    this.#gens[index] = nextGeneration;
    this.#release(index);
  }

  /** The record's drain timed out: a peer may still be inside; never reuse it (bounded loss). */
  retireRecord(): void {
    this.live--;
  }

  #release(index: number): void {
    if (this.#used[index] !== 1) throw new Error(`cuda-ipc grant table ${this.name}: record ${index} freed twice`);
    this.#used[index] = 0;
    this.live--;
    this.#freeRecords.push(index);
  }

  /** Write record `index`'s token, range table location, count and form (before publishing it). */
  writeRecord(index: number, token: Uint8Array, arenaOffset: number, count: number, form: number = RecordForm.Ranges): void {
    const at = this.recordOffset(index);
    this.u8.set(token, at + R_TOKEN);
    this.u32[(at + R_ARENA) / 4] = arenaOffset % TWO32;
    this.u32[(at + R_ARENA) / 4 + 1] = Math.floor(arenaOffset / TWO32);
    this.u32[(at + R_COUNT) / 4] = count;
    this.u32[(at + R_FORM) / 4] = form;
  }

  /**
   * Write a block grant's table at `arenaOffset` ({@link blockTableBytes}(count) bytes): the
   * segment's directory index, where block 0 lies in the segment mapping, the block size, then
   * the block indices (one copy), and unless `fit` is undefined (indices the engine checked)
   * check what was written: every index below `fit`, the blocks that fit the registration
   * (InvalidInputError naming the first that does not; nothing is published then). Only
   * before the record is published. Returns the bytes of all ranges.
   */
  writeBlocks(arenaOffset: number, dir: number, base: number, blockBytes: number, indices: Uint32Array, count: number, fit: number | undefined): number {
    if (!(Number.isSafeInteger(arenaOffset) && arenaOffset % 8 === 0 && arenaOffset >= 0 && arenaOffset + blockTableBytes(count) <= this.geometry.arena && indices.length >= count)) {
      throw new InvalidInputError(`cuda-ipc grant table ${this.name}: block table of ${count} blocks does not fit at ${arenaOffset}`, { details: { field: 'blocks' } });
    }
    const w = (this.arenaAt + arenaOffset) / 4;
    const u32 = this.u32;
    u32[w] = dir;
    u32[w + 1] = 0;
    u32[w + 2] = base % TWO32;
    u32[w + 3] = Math.floor(base / TWO32);
    u32[w + 4] = blockBytes % TWO32;
    u32[w + 5] = Math.floor(blockBytes / TWO32);
    const first = w + RANGE_BYTES / 4;
    u32.set(indices.length === count ? indices : indices.subarray(0, count), first);
    for (let k = 0; fit !== undefined && k < count; ) {
      const to = Math.min(count, k + 4096);
      k = belowFrom(u32, first, k, to, fit);
      if (k < to) throw new InvalidInputError(`grant: blocks[${k}] (block ${String(u32[first + k])}) is outside its registration, which holds ${fit} blocks`, { details: { field: 'blocks', range: k } });
    }
    return count * blockBytes;
  }

  /**
   * Check a grant's ranges and write its range table at `arenaOffset` of the arena, in one
   * native pass with no object per range: range `k` (GRANT_STRIDE numbers of `ranges`:
   * registration index, offset, length) must name one of `regs`, be non-empty and lie inside
   * that registration's buffer; it is written as (directory index `dirOf[j]`, offset in the
   * segment mapping = `regs[j].base` + offset, length), 24 bytes, little-endian u64s. Returns
   * the bytes of all ranges; throws InvalidInputError naming the first bad range (nothing is
   * published: the caller gives the record and the arena space back). Writing a record's range
   * table is only done before it is published, so no peer reads it meanwhile.
   */
  writeRanges(arenaOffset: number, ranges: Float64Array, count: number, regs: readonly { readonly base: number; readonly buffer: Uint8Array }[], dirOf: Uint32Array): number {
    if (!(Number.isSafeInteger(arenaOffset) && arenaOffset >= 0 && Number.isSafeInteger(count) && count >= 1 && ranges.length >= count * GRANT_STRIDE)) {
      throw new InvalidInputError(`cuda-ipc grant table ${this.name}: range table of ${count} ranges does not fit at ${arenaOffset}`, { details: { field: 'ranges' } });
    }
    const info = new Float64Array(regs.length * 3);
    for (let j = 0; j < regs.length; j++) {
      const r = regs[j] as { base: number; buffer: Uint8Array };
      info[j * 3] = dirOf[j] as number;
      info[j * 3 + 1] = r.base;
      info[j * 3 + 2] = r.buffer.byteLength;
    }
    let got: number;
    try {
      got = native.writeRangeTable(this.mapping, arenaOffset, ranges, count, info);
    } catch (e) {
      throw new InvalidInputError(`cuda-ipc grant table ${this.name}: range table of ${count} ranges does not fit at ${arenaOffset}`, { cause: e, details: { field: 'ranges' } });
    }
    if (got < 0) {
      const k = -got - 1;
      const at = k * GRANT_STRIDE;
      throw new InvalidInputError(`grant: range ${k} (${ranges[at + 1]}+${ranges[at + 2]} of registration ${ranges[at]}) is empty or outside its registration`, { details: { field: 'ranges', range: k } });
    }
    return got;
  }

  /** Set the table dead and unlink it (records are revoked first by the transport). Idempotent. */
  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    try {
      native.setState(this.mapping, SegmentState.Dead);
    } finally {
      native.shmUnlink(this.name);
    }
  }
}

/** A peer's grant table as this reader validated it (per connection). */
export interface TableView {
  readonly name: string;
  readonly mapping: ArrayBuffer;
  readonly geometry: TableGeometry;
  readonly u8: Uint8Array;
  readonly u32: Uint32Array;
  readonly dirAt: number;
  readonly arenaAt: number;
}

function rejected(message: string, remoteCode: string, cause?: unknown): RemoteRejectedError {
  return new RemoteRejectedError(message, { ...(cause !== undefined ? { cause } : {}), details: { remoteCode } });
}

/**
 * Open and validate a peer's grant table `name`: a grant table header (kind, owner node and
 * pid as the connection knows them, live), and a geometry that adds up to exactly the
 * mapping size from fstat. Everything is RemoteRejectedError (`unknown-grant`,
 * `foreign-grant`, `bad-grant`, `revoked`).
 */
export function openTableView(name: string, peerNodeId: string, peerPid: number): TableView {
  checkLayout();
  let mapping: ArrayBuffer;
  try {
    mapping = native.shmOpen(name, MAX_TABLE_BYTES);
  } catch (e) {
    throw rejected(`grant table ${name} is gone or unknown`, 'unknown-grant', e);
  }
  let meta;
  try {
    meta = native.headerDecode(mapping, SegmentKind.GrantTable);
  } catch (e) {
    throw rejected(`grant table ${name} has an invalid header`, 'bad-grant', e);
  }
  if (meta.id.split(':')[1] !== peerNodeId || meta.ownerPid !== peerPid) {
    throw rejected(`grant table ${name} was not issued by ${peerNodeId}`, 'foreign-grant');
  }
  if (meta.state !== SegmentState.Live) throw rejected(`grant table ${name} is closed`, 'revoked');
  const dv = new DataView(mapping);
  const geometry: TableGeometry = { records: dv.getUint32(T_RECORDS, true), dir: dv.getUint32(T_DIR, true), arena: Number(dv.getBigUint64(T_ARENA, true)) };
  try {
    checkGeometry(geometry);
  } catch (e) {
    throw rejected(`grant table ${name}: geometry out of range`, 'bad-grant', e);
  }
  // Sizes learned from fstat (the mapping), never from the header alone.
  if (tableBytes(geometry) !== mapping.byteLength) throw rejected(`grant table ${name}: geometry does not match its size ${mapping.byteLength}`, 'bad-grant');
  const dirAt = HEADER_SIZE + geometry.records * RECORD_BYTES;
  return { name, mapping, geometry, u8: new Uint8Array(mapping), u32: new Uint32Array(mapping), dirAt, arenaAt: dirAt + geometry.dir * DIR_BYTES };
}

/** From `from`, the u32s at `w + k` below `limit`; where it stopped. */
function belowFrom(u32: Uint32Array, w: number, from: number, to: number, limit: number): number {
  let k = from;
  for (; k < to; k++) if (!((u32[w + k] as number) < limit)) break;
  return k;
}

/** A u64 at byte `at` (8-aligned) of `u32` as a number; NaN beyond 2^53. */
function u64(u32: Uint32Array, at: number): number {
  const hi = u32[at / 4 + 1] as number;
  return hi >= 2 ** 21 ? Number.NaN : hi * TWO32 + (u32[at / 4] as number);
}

/** A data segment named by a peer's directory entry. */
export interface DirSegment {
  readonly name: string;
  readonly seqlocked: boolean;
}

/**
 * Read grant `record` (generation, token) of table `t`: enter it, read its range table and
 * the directory entries it names, leave. `count` and `bytes` are the number of ranges and the
 * byte total the payload names; the table must say the same (else RemoteRejectedError
 * `bad-grant`: the payload was changed). The descriptor's range lengths play no part: the table is the
 * truth, and every range is bounded by it (natively, per batch). `mapSegment` maps a data segment (per connection) and returns
 * its mapping. Returns the spans (3 numbers per range: index into `segments`, offset of the
 * range in the segment mapping, length), each checked against the mapping size. While the
 * grant stays live at this generation with this token (every batch re-checks that natively),
 * its range table cannot change: the owner rewrites a record only after revoking it.
 */
export function readRangeTable(
  t: TableView,
  record: number,
  generation: number,
  token: Uint8Array,
  expectCount: number,
  expectBytes: number,
  mapSegment: (name: string) => ArrayBuffer,
  expectForm: number = RecordForm.Ranges,
): { spans: Float64Array; segments: DirSegment[]; mappings: ArrayBuffer[] } {
  if (!Number.isSafeInteger(record) || record < 0 || record >= t.geometry.records) throw rejected(`grant table ${t.name} has no record ${record}`, 'bad-grant');
  const off = HEADER_SIZE + record * RECORD_BYTES;
  const r = native.recordEnter(t.mapping, off, generation, token);
  if (r !== GrantResult.Ok) {
    const code = r === GrantResult.Revoked ? 'revoked' : r === GrantResult.BadToken ? 'bad-token' : 'bad-grant';
    const why = r === GrantResult.Revoked ? 'was revoked' : r === GrantResult.BadToken ? 'rejected the token' : 'is not a grant';
    throw rejected(`grant ${t.name}#${record} ${why}`, code);
  }
  try {
    const count = t.u32[(off + R_COUNT) / 4] as number;
    const arenaOffset = u64(t.u32, off + R_ARENA);
    // The form the payload names (a block grant's mode) must be the record's.
    const form = t.u32[(off + R_FORM) / 4] as number;
    if (form !== expectForm) throw rejected(`grant ${t.name}#${record}: its table form ${form} is not the payload's (${expectForm})`, 'bad-grant');
    if (form === RecordForm.Blocks) return readBlockTable(t, record, count, arenaOffset, expectCount, expectBytes, mapSegment);
    if (count === 0 || count !== expectCount || !(arenaOffset % 8 === 0) || arenaOffset + count * RANGE_BYTES > t.geometry.arena) {
      throw rejected(`grant ${t.name}#${record}: its range table (${count} ranges at ${arenaOffset}) does not match the payload (${expectCount} ranges) or the arena`, 'bad-grant');
    }
    const spans = new Float64Array(count * 3);
    const segments: DirSegment[] = [];
    const mappings: ArrayBuffer[] = [];
    const segOfDir = new Map<number, number>();
    let total = 0;
    const u32 = t.u32;
    // The segment of the previous range: a grant's ranges mostly lie in one or a few segments
    // in runs, so the map is looked up only when the directory entry changes.
    let lastDir = -1;
    let lastSeg = -1;
    let size = 0;
    for (let k = 0, w = (t.arenaAt + arenaOffset) / 4; k < count; k++, w += RANGE_BYTES / 4) {
      const dir = u32[w] as number;
      // u64s (8-aligned u32 pairs) as numbers; NaN beyond 2^53, which the bounds check refuses.
      const bh = u32[w + 3] as number;
      const base = bh >= 2 ** 21 ? Number.NaN : bh * TWO32 + (u32[w + 2] as number);
      const lh = u32[w + 5] as number;
      const length = lh >= 2 ** 21 ? Number.NaN : lh * TWO32 + (u32[w + 4] as number);
      let s = dir === lastDir ? lastSeg : segOfDir.get(dir);
      if (s === undefined) {
        const seg = dirSegment(t, record, k, dir);
        const mapping = mapSegment(seg.name);
        s = segments.push(seg) - 1;
        mappings.push(mapping);
        segOfDir.set(dir, s);
      }
      if (s !== lastSeg) {
        // Bounds from fstat (the mapping length), never from the table alone: data area only.
        size = (mappings[s] as ArrayBuffer).byteLength;
        lastSeg = s;
      }
      lastDir = dir;
      if (!Number.isSafeInteger(base) || base < HEADER_SIZE || base > size || length > size - base) {
        throw rejected(`grant ${t.name}#${record}: range ${k} (${base}+${length}) lies outside the data of ${(segments[s] as DirSegment).name} (${size} bytes)`, 'bounds');
      }
      spans[k * 3] = s;
      spans[k * 3 + 1] = base;
      spans[k * 3 + 2] = length;
      total += length;
    }
    if (total !== expectBytes) {
      throw rejected(`grant ${t.name}#${record}: its ranges cover ${total} bytes, the payload says ${expectBytes}`, 'bad-grant');
    }
    return { spans, segments, mappings };
  } finally {
    native.recordLeave(t.mapping, off);
  }
}

/** The data segment directory entry `dir` of `t` names (for range `k` of grant `record`), validated. */
function dirSegment(t: TableView, record: number, k: number, dir: number): DirSegment {
  if (dir >= t.geometry.dir) throw rejected(`grant ${t.name}#${record}: range ${k} names directory entry ${dir} of ${t.geometry.dir}`, 'bad-grant');
  const d = t.dirAt + dir * DIR_BYTES;
  const nameLen = t.u8[d + D_NAME_LEN] as number;
  const name = Buffer.from(t.mapping, d + D_NAME, Math.min(nameLen, MAX_NAME)).toString('latin1');
  if (t.u32[(d + D_STATE) / 4] !== 1 || segmentNameProblem(name) !== undefined || !name.startsWith('/tw-p.')) {
    throw rejected(`grant ${t.name}#${record}: range ${k} names an invalid data segment`, 'bad-grant');
  }
  return { name, seqlocked: ((t.u32[(d + D_FLAGS) / 4] as number) & DIR_SEQLOCKED) !== 0 };
}

/**
 * From `from`, the spans of a block table (segment 0, block `indices[k]` at `base + indices[k] ×
 * blockBytes`), each index read once and bounded by `limit` (the blocks that fit the mapping)
 * before it is used; returns where it stopped.
 */
function blockSpans(u32: Uint32Array, w: number, from: number, to: number, base: number, blockBytes: number, limit: number, spans: Float64Array): number {
  let k = from;
  for (let at = from * 3; k < to; k++, at += 3) {
    const b = u32[w + k] as number;
    if (!(b < limit)) break;
    spans[at] = 0;
    spans[at + 1] = base + b * blockBytes;
    spans[at + 2] = blockBytes;
  }
  return k;
}

/**
 * A block grant's table (the record is entered by the caller): one range entry (directory
 * index, block 0's offset in the segment mapping, block bytes) then `count` u32 block indices.
 * Every index is bounded by the segment's mapping size learned from fstat (the blocks that fit
 * between block 0 and the end of the mapping), never by anything the owner wrote.
 */
function readBlockTable(
  t: TableView,
  record: number,
  count: number,
  arenaOffset: number,
  expectCount: number,
  expectBytes: number,
  mapSegment: (name: string) => ArrayBuffer,
): { spans: Float64Array; segments: DirSegment[]; mappings: ArrayBuffer[] } {
  if (count === 0 || count !== expectCount || !(arenaOffset % 8 === 0) || arenaOffset + blockTableBytes(count) > t.geometry.arena) {
    throw rejected(`grant ${t.name}#${record}: its block table (${count} blocks at ${arenaOffset}) does not match the payload (${expectCount} ranges) or the arena`, 'bad-grant');
  }
  const w = (t.arenaAt + arenaOffset) / 4;
  const u32 = t.u32;
  const dir = u32[w] as number;
  const base = u64(u32, t.arenaAt + arenaOffset + 8);
  const blockBytes = u64(u32, t.arenaAt + arenaOffset + 16);
  const seg = dirSegment(t, record, 0, dir);
  const mapping = mapSegment(seg.name);
  const size = mapping.byteLength;
  if (!Number.isSafeInteger(base) || base < HEADER_SIZE || base > size || !Number.isSafeInteger(blockBytes) || blockBytes < 1) {
    throw rejected(`grant ${t.name}#${record}: block 0 at ${base} of ${blockBytes} bytes lies outside the data of ${seg.name} (${size} bytes)`, 'bounds');
  }
  if (count * blockBytes !== expectBytes) {
    throw rejected(`grant ${t.name}#${record}: its ranges cover ${count * blockBytes} bytes, the payload says ${expectBytes}`, 'bad-grant');
  }
  const limit = Math.floor((size - base) / blockBytes);
  const first = w + RANGE_BYTES / 4;
  const spans = new Float64Array(count * 3);
  for (let k = 0; k < count; ) {
    const to = Math.min(count, k + 4096);
    k = blockSpans(u32, first, k, to, base, blockBytes, limit, spans);
    if (k < to) throw rejected(`grant ${t.name}#${record}: range ${k} lies outside the data of ${seg.name} (${size} bytes)`, 'bounds');
  }
  return { spans, segments: [seg], mappings: [mapping] };
}

/** Geometry of the `n`th table (0-based) from the first one: twice as large each time, at most 8×. */
export function grownGeometry(first: TableGeometry, n: number, need: { records: number; dir: number; arena: number }): TableGeometry {
  const f = 2 ** Math.min(n, 3);
  const g = {
    records: Math.min(MAX_RECORDS, Math.max(first.records * f, need.records)),
    dir: Math.min(MAX_DIR, Math.max(first.dir * f, need.dir)),
    arena: Math.min(MAX_ARENA, Math.max(first.arena * f, Math.ceil(need.arena / 8) * 8)),
  };
  return g;
}

