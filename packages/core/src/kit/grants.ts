/**
 * The grant table of a kit transport: what peers may read and write, by unguessable token.
 *
 * - Every registration gets its own 128-bit random token; its one range (index 0) is the whole
 *   registration. Every range grant gets one too: one token and one table entry however many
 *   ranges it has, its range table kept by reference as the engine made it (GrantRanges.ranges,
 *   or for a block grant the engine's block indices, GrantRanges.blocks: nothing per range).
 * - A request names a token, a granted range index and an offset inside that range; the check
 *   ({@link GrantTable.check}) is O(1) per range against that granted range, never merely the
 *   registration, and covers a whole frame before any byte moves.
 * - Revoking takes a token out of the table at once (O(1) for a grant; a registration's
 *   revocation ends its grants too) and remembers it, bounded, so peers get `REVOKED` rather than
 *   `UNKNOWN_GRANT`. It resolves once no user (a stream) still sends from or receives into that
 *   entry's memory: only that entry's in-flight use is waited for; a user that stalls past the
 *   grace is aborted ({@link GrantUser.abortForRevoke}), which quiesces it.
 * - Handles belong to one table: a handle of another transport instance is refused.
 */
import { randomFillSync } from 'node:crypto';
import { toHex } from '../codec.js';
import { deferred, type Deferred } from '../deferred.js';
import { ClosedError, InvalidInputError } from '../errors.js';
import { engineCheckedBlocks } from '../grant-check.js';
import { GRANT_STRIDE, GrantField, type GrantBlocks, type GrantRanges, type Memory, type MemoryKind, type TransportRegistration } from '../transport.js';
import { NO_RANGE, RANGE_ENTRY_BYTES, TOKEN_BYTES, headRangeAt, headRangeCount, headTokenAt, headTokenCount, rangeGrantIndex, rangeLength, rangeOffset, rangeTokenIndex } from './frames.js';

/** Something that holds an entry's memory while it works (a stream); aborted when a revocation's grace ends. */
export interface GrantUser {
  abortForRevoke(): void;
}

/** Codes a responder answers a refused range with (ERROR's code; `details.remoteCode` on the requester). */
export const GrantRefusalCode = {
  Unknown: 'UNKNOWN_GRANT',
  Revoked: 'REVOKED',
  NoSuchRange: 'NO_SUCH_RANGE',
  OutOfBounds: 'OUT_OF_BOUNDS',
  TooLarge: 'TOO_LARGE',
  BadRequest: 'BAD_REQUEST',
} as const;

/** Why a request (or one of its ranges, by index in the frame; NO_RANGE for none) is refused. */
export interface RangeRefusal {
  readonly code: string;
  readonly message: string;
  readonly range: number;
}

const REFUSED_REVOKED: RangeRefusal = { code: GrantRefusalCode.Revoked, message: 'the grant was revoked', range: NO_RANGE };
/** A copy of `b` as a plain Uint8Array (`Buffer#slice` would be a view of the same memory). */
function copyBytes(b: Uint8Array): Uint8Array {
  return Uint8Array.prototype.slice.call(b);
}

/** Random bytes for tokens, drawn in 4 KiB refills (one getrandom call per 256 tokens, not one per grant). */
const tokenPool = new Uint8Array(4096);
let tokenAt = tokenPool.length;

/** A fresh 128-bit token; its bytes are wiped from the pool as they are handed out. */
function freshToken(): Uint8Array {
  if (tokenAt + TOKEN_BYTES > tokenPool.length) {
    randomFillSync(tokenPool);
    tokenAt = 0;
  }
  const t = tokenPool.slice(tokenAt, tokenAt + TOKEN_BYTES);
  tokenPool.fill(0, tokenAt, tokenAt + TOKEN_BYTES);
  tokenAt += TOKEN_BYTES;
  return t;
}

const REFUSED_UNKNOWN: RangeRefusal = { code: GrantRefusalCode.Unknown, message: 'no registration or grant has this token', range: NO_RANGE };

/**
 * What a token names: `count` ranges, range `k` at `ranges[k * GRANT_STRIDE + GrantField.X]`
 * (Handle: index into `buffers`, Offset: where it starts there, Length), so a range check is
 * `k < count && offset + length <= length of k`, and its bytes are `buffers[handle]` from
 * `offset of k + offset`. It counts which users still touch its memory, so revocation can wait
 * for exactly those.
 */
export abstract class GrantEntry {
  readonly table: GrantTable;
  readonly token: Uint8Array;
  readonly key: string;
  readonly count: number;
  /** The ranges (GRANT_STRIDE numbers each), unless this is a block grant. */
  readonly ranges: Float64Array;
  readonly buffers: readonly Buffer[];
  /**
   * A block grant's block indices (range `k` is `buffers[0]` from `base + blocks[k] ×
   * blockBytes`, `blockBytes` long); undefined for a registration or a range grant.
   */
  readonly blocks: Uint32Array | undefined;
  readonly base: number;
  readonly blockBytes: number;
  revoked = false;
  /** Acquisitions not yet released (by all users). */
  users = 0;
  readonly #byUser = new Map<GrantUser, number>();
  #idle: Deferred<void> | undefined;
  constructor(table: GrantTable, count: number, ranges: Float64Array, buffers: readonly Buffer[], blocks?: GrantBlocks) {
    this.table = table;
    this.token = freshToken();
    this.key = toHex(this.token);
    this.count = count;
    this.ranges = ranges;
    this.buffers = buffers;
    this.blocks = blocks?.indices;
    this.base = blocks?.base ?? 0;
    this.blockBytes = blocks?.blockBytes ?? 0;
  }
  acquire(user: GrantUser): void {
    this.users++;
    this.#byUser.set(user, (this.#byUser.get(user) ?? 0) + 1);
  }
  release(user: GrantUser): void {
    const n = this.#byUser.get(user);
    if (n === undefined) return; // not held by this user: nothing to release
    this.users--;
    if (n <= 1) this.#byUser.delete(user);
    else this.#byUser.set(user, n - 1);
    if (this.users === 0 && this.#idle) {
      this.#idle.resolve();
      this.#idle = undefined;
    }
  }
  /** Users that still read from or write into this memory. */
  get holders(): GrantUser[] {
    return [...this.#byUser.keys()];
  }
  idle(): Promise<void> {
    if (this.users === 0) return Promise.resolve();
    this.#idle ??= deferred<void>();
    return this.#idle.promise;
  }
}

/** A registration: its memory as one range (index 0, the whole of it). Also the local handle of a batch. */
export class LocalRegistration extends GrantEntry {
  readonly buffer: Uint8Array;
  /** The same memory as a Buffer: views of it go to the socket without another wrapper. */
  readonly bytes: Buffer;
  /** Live range grants over this registration: revoking it ends them. */
  readonly grants = new Set<RangeGrant>();
  /** Revoked grants over it whose users have not all let go yet: revoking the registration waits for them too. */
  readonly draining = new Set<RangeGrant>();
  constructor(table: GrantTable, buffer: Uint8Array) {
    const bytes = Buffer.from(buffer.buffer, buffer.byteOffset, buffer.byteLength);
    super(table, 1, Float64Array.of(0, 0, buffer.byteLength), [bytes]);
    this.buffer = buffer;
    this.bytes = bytes;
  }
}

/**
 * A range grant: the engine's range table (GrantRanges.ranges, validated by the engine and
 * private to it) kept as it is, over the registrations' buffers. Nothing is done per range to
 * make or revoke it.
 */
export class RangeGrant extends GrantEntry {
  readonly registrations: readonly LocalRegistration[];
  constructor(table: GrantTable, registrations: readonly LocalRegistration[], spec: GrantRanges) {
    // A block grant keeps the engine's block indices, never the ranges built from them.
    super(table, spec.count, spec.blocks === undefined ? spec.ranges : NO_RANGES, registrations.map((r) => r.bytes), spec.blocks);
    this.registrations = registrations;
  }
}

const NO_RANGES = new Float64Array(0);

/**
 * Where granted range `k` of `e` starts in its buffer ({@link grantedBuffer}): for the serving
 * paths (one branch on the grant's form, no object).
 */
export function grantedOffset(e: GrantEntry, k: number): number {
  const b = e.blocks;
  return b === undefined ? (e.ranges[k * GRANT_STRIDE + GrantField.Offset] as number) : e.base + (b[k] as number) * e.blockBytes;
}

/** The buffer granted range `k` of `e` lies in. */
export function grantedBuffer(e: GrantEntry, k: number): Buffer {
  return e.buffers[e.blocks === undefined ? (e.ranges[k * GRANT_STRIDE + GrantField.Handle] as number) : 0] as Buffer;
}

/**
 * A decoded remote descriptor: the peer's token, and the lengths its descriptor claims for its
 * ranges (one range, the whole registration, unless it is a range grant). The lengths only let
 * this side refuse early; the peer checks every range against what it granted.
 */
export class RemoteGrant {
  constructor(
    readonly token: Uint8Array,
    readonly byteLength: number,
    readonly rangeLengths: Float64Array,
    /** A range grant (its descriptor listed range lengths), not a whole registration. */
    readonly granted: boolean,
  ) {}
}

/** The wire's granted range index is a u32. */
export const MAX_GRANT_RANGES = 0x100000000;

export interface GrantTableOptions {
  /** The transport's name, for messages. */
  readonly transport: string;
  /** How long a revocation lets users still holding the memory finish before aborting them. */
  readonly revokeGraceMs: number;
  /** Revoked tokens remembered (the most recent this many). Default 4096. */
  readonly revokedMemory?: number;
}

export class GrantTable {
  readonly transport: string;
  readonly revokeGraceMs: number;
  readonly #revokedMemory: number;
  /** Each live registration and range grant, by its token (hex). */
  readonly #tokens = new Map<string, GrantEntry>();
  readonly #revokedKeys = new Set<string>();
  #rangeGrants = 0;
  #closed = false;

  constructor(options: GrantTableOptions) {
    this.transport = options.transport;
    this.revokeGraceMs = options.revokeGraceMs;
    this.#revokedMemory = options.revokedMemory ?? 4096;
  }

  /** Entries: live registrations plus live range grants (one each, whatever its size). */
  get size(): number {
    return this.#tokens.size;
  }

  /** Live range grants (each one entry of {@link size}). */
  get rangeGrantCount(): number {
    return this.#rangeGrants;
  }

  /** True when `handle` is a live registration of this table. */
  isLive(handle: unknown): handle is LocalRegistration {
    return handle instanceof LocalRegistration && handle.table === this && !handle.revoked;
  }

  /** Live range grants over a registration handle (for leak tests). */
  grantsOver(handle: object): number {
    return handle instanceof LocalRegistration && handle.table === this ? handle.grants.size : 0;
  }

  register(memory: Memory): TransportRegistration {
    if (this.#closed) throw new ClosedError(`${this.transport} transport is closed`);
    if (memory?.kind !== 'host' || !(memory.buffer instanceof Uint8Array)) {
      throw new InvalidInputError(`${this.transport} moves host memory only, not ${String(memory?.kind)}`, { details: { field: 'memory.kind' } });
    }
    const reg = new LocalRegistration(this, memory.buffer);
    this.#tokens.set(reg.key, reg);
    return { handle: reg, payload: copyBytes(reg.token) };
  }

  /**
   * Grant access to ranges of registrations: one token and one entry for all of them. The range
   * table is kept by reference (validated by the engine: ranges inside their registrations,
   * non-empty, non-overlapping); nothing is done per range. A block spec the engine did not make
   * (a direct call) has its indices checked here, and whoever made the grant, `check` refuses a
   * range outside its registration's memory when it is used. The payload is the token alone.
   */
  grant(spec: GrantRanges): TransportRegistration {
    if (this.#closed) throw new ClosedError(`${this.transport} transport is closed`);
    const { handles, count, blocks } = spec;
    const counted = Number.isSafeInteger(count) && count >= 1 && count <= MAX_GRANT_RANGES;
    if (blocks === undefined) {
      if (!counted || !(spec.ranges instanceof Float64Array) || spec.ranges.length < count * GRANT_STRIDE) {
        throw new InvalidInputError(`a ${this.transport} grant needs 1 to ${MAX_GRANT_RANGES} ranges of ${GRANT_STRIDE} numbers each`, { details: { field: 'ranges' } });
      }
    } else if (
      !counted ||
      typeof blocks !== 'object' ||
      blocks === null ||
      !(blocks.indices instanceof Uint32Array) ||
      blocks.indices.length < count ||
      !Number.isSafeInteger(blocks.base) ||
      blocks.base < 0 ||
      !Number.isSafeInteger(blocks.blockBytes) ||
      blocks.blockBytes < 1
    ) {
      throw new InvalidInputError(`a ${this.transport} block grant needs 1 to ${MAX_GRANT_RANGES} block indices, a base >= 0 and blocks of at least 1 byte`, { details: { field: 'blocks' } });
    }
    if (!Array.isArray(handles) || handles.length === 0) throw new InvalidInputError(`a ${this.transport} grant needs registration handles`, { details: { field: 'handles' } });
    if (blocks !== undefined && handles.length !== 1) throw new InvalidInputError(`a ${this.transport} block grant covers one registration`, { details: { field: 'handles' } });
    const regs = handles.map((h, k) => {
      if (!this.isLive(h)) throw new InvalidInputError(`handles[${k}] is not a live ${this.transport} registration of this transport`, { details: { field: 'handles', registration: k } });
      return h;
    });
    if (blocks !== undefined && !engineCheckedBlocks(spec)) {
      // Not the engine's checked spec (a direct call): every index must name a whole block of the registration.
      const fit = Math.floor(((regs[0] as LocalRegistration).buffer.byteLength - blocks.base) / blocks.blockBytes);
      const { indices } = blocks;
      for (let k = 0; k < count; k++) {
        if (!((indices[k] as number) < fit)) {
          throw new InvalidInputError(`block ${indices[k]} (index ${k}) is not a whole block of the registration (${Math.max(0, fit)} blocks of ${blocks.blockBytes} bytes from ${blocks.base})`, { details: { field: 'blocks', range: k } });
        }
      }
    }
    const g = new RangeGrant(this, regs, spec);
    for (const r of regs) r.grants.add(g);
    this.#tokens.set(g.key, g);
    this.#rangeGrants++;
    return { handle: g, payload: copyBytes(g.token) };
  }

  /**
   * Revoke a registration and every range grant over it: from now on their tokens are answered
   * with REVOKED. Resolves once no user still touches the registration through it or any grant
   * over it (grants revoked earlier and still in use included). Idempotent: a second call waits
   * the same way.
   */
  async revoke(handle: object): Promise<void> {
    if (!(handle instanceof LocalRegistration) || handle.table !== this) throw new InvalidInputError(`not a ${this.transport} registration handle of this transport`);
    const wasLive = this.#retire(handle);
    const waits = [this.#quiesce(handle, wasLive)];
    for (const g of [...handle.grants]) waits.push(this.revokeGrant(g));
    for (const g of handle.draining) waits.push(g.idle());
    await Promise.all(waits);
  }

  /**
   * Revoke a range grant, O(1) in its number of ranges. Resolves once no user still touches
   * memory through this grant (in-flight use of other entries is not waited for). Idempotent.
   */
  async revokeGrant(handle: object): Promise<void> {
    if (!(handle instanceof RangeGrant) || handle.table !== this) throw new InvalidInputError(`not a ${this.transport} range grant handle of this transport`);
    const wasLive = this.#retire(handle);
    if (wasLive) {
      for (const r of handle.registrations) {
        r.grants.delete(handle);
        if (handle.users > 0) {
          r.draining.add(handle);
          void handle.idle().then(() => r.draining.delete(handle));
        }
      }
      this.#rangeGrants--;
    }
    return this.#quiesce(handle, wasLive);
  }

  /** Take a token out of the table and remember it as revoked (bounded). False if it already was. */
  #retire(entry: GrantEntry): boolean {
    if (entry.revoked) return false;
    entry.revoked = true;
    this.#tokens.delete(entry.key);
    this.#revokedKeys.add(entry.key);
    if (this.#revokedKeys.size > this.#revokedMemory) {
      const oldest = this.#revokedKeys.values().next().value as string;
      this.#revokedKeys.delete(oldest);
    }
    return true;
  }

  /** Wait until no user holds the entry's memory; users that stall past the grace are aborted. */
  async #quiesce(entry: GrantEntry, wasLive: boolean): Promise<void> {
    if (!wasLive || entry.users === 0) return entry.idle();
    const timer = setTimeout(() => {
      for (const user of entry.holders) user.abortForRevoke();
    }, this.revokeGraceMs);
    try {
      await entry.idle();
    } finally {
      clearTimeout(timer);
    }
  }

  /** The live entry whose token is at `at` of `head`, or why there is none. One lookup per token per frame. */
  lookup(head: Buffer, at: number): GrantEntry | RangeRefusal {
    const key = head.toString('hex', at, at + TOKEN_BYTES);
    const e = this.#tokens.get(key);
    if (!e) return this.#revokedKeys.has(key) ? REFUSED_REVOKED : REFUSED_UNKNOWN;
    if (e.revoked) return REFUSED_REVOKED;
    return e;
  }

  /**
   * Check every range of a vector head (structure already checked by the parser): tokens known
   * and live, lengths ≥ 1, the granted range index one its token has, offset + length inside
   * that granted range, the total at most `maxTotal`, and for a WRITEV (`dataLength` ≥ 0) the
   * total equal to the data. O(1) per range. Returns the entries to pin (one per live token), or
   * the first refusal. Leaves the lookup of token `t` in `entries[t]` (reused by the caller).
   */
  check(head: Buffer, dataLength: number, maxTotal: number, entries: (GrantEntry | RangeRefusal)[]): GrantEntry[] | RangeRefusal {
    const tokens = headTokenCount(head);
    const count = headRangeCount(head);
    entries.length = tokens;
    for (let t = 0; t < tokens; t++) entries[t] = this.lookup(head, headTokenAt(t));
    let total = 0;
    let at = headRangeAt(tokens, 0);
    for (let i = 0; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const e = entries[rangeTokenIndex(head, at)] as GrantEntry | RangeRefusal;
      if (!(e instanceof GrantEntry)) return { code: e.code, message: `range ${i}: ${e.message}`, range: i };
      const k = rangeGrantIndex(head, at);
      const off = rangeOffset(head, at);
      const len = rangeLength(head, at);
      if (len === 0) return { code: GrantRefusalCode.BadRequest, message: `range ${i} has length 0`, range: i };
      if (k >= e.count) {
        const what = e instanceof LocalRegistration ? 'a whole registration has only range 0' : `the grant has ${e.count} ranges`;
        return { code: GrantRefusalCode.NoSuchRange, message: `range ${i}: granted range ${k} does not exist (${what})`, range: i };
      }
      const rangeLen = e.blocks === undefined ? (e.ranges[k * GRANT_STRIDE + GrantField.Length] as number) : e.blockBytes;
      if (off + len > rangeLen) {
        const what = e instanceof LocalRegistration ? `the registration of ${rangeLen} bytes` : `granted range ${k} of ${rangeLen} bytes`;
        return { code: GrantRefusalCode.OutOfBounds, message: `range ${i}: ${off}+${len} exceeds ${what}`, range: i };
      }
      // And inside the memory itself: a grant made by a direct call of the transport (not
      // through the engine, which checks every range against its registration) is served only
      // where its registration's bytes are, never past them.
      if (grantedOffset(e, k) + off + len > grantedBuffer(e, k).length) {
        return { code: GrantRefusalCode.OutOfBounds, message: `range ${i}: granted range ${k} lies outside its registration`, range: i };
      }
      total += len;
      if (total > maxTotal) return { code: GrantRefusalCode.TooLarge, message: `range ${i}: the frame asks for more than ${maxTotal} bytes`, range: i };
    }
    if (dataLength >= 0 && total !== dataLength) return { code: GrantRefusalCode.BadRequest, message: 'lengths do not match the data', range: NO_RANGE };
    const pin: GrantEntry[] = [];
    for (const e of entries) if (e instanceof GrantEntry) pin.push(e);
    return pin;
  }

  /**
   * Validate and decode a peer's descriptor payload (the 16-byte token). For a range grant,
   * `rangeLengths` (the engine's decoded descriptor, checked there) is kept by reference.
   */
  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths?: Float64Array): RemoteGrant {
    if (memoryKind !== 'host') throw new InvalidInputError(`${this.transport} cannot reach ${memoryKind} memory`, { details: { field: 'memoryKind' } });
    if (!(payload instanceof Uint8Array) || payload.length !== TOKEN_BYTES) {
      throw new InvalidInputError(`${this.transport} descriptor payload must be ${TOKEN_BYTES} bytes, got ${payload?.length}`, { details: { field: 'payload' } });
    }
    if (!Number.isSafeInteger(byteLength) || byteLength < 0) throw new InvalidInputError(`byte length ${byteLength} is not a safe integer`, { details: { field: 'byteLength' } });
    if (rangeLengths === undefined) return new RemoteGrant(copyBytes(payload), byteLength, Float64Array.of(byteLength), false);
    if (!(rangeLengths instanceof Float64Array) || rangeLengths.length < 1 || rangeLengths.length > MAX_GRANT_RANGES) {
      throw new InvalidInputError(`range lengths must be a Float64Array of 1 to ${MAX_GRANT_RANGES} lengths`, { details: { field: 'rangeLengths' } });
    }
    return new RemoteGrant(copyBytes(payload), byteLength, rangeLengths, true);
  }

  /** Revoke everything at once (the transport is closing; its streams are already closed). */
  close(): void {
    this.#closed = true;
    for (const e of this.#tokens.values()) e.revoked = true;
    this.#tokens.clear();
    this.#rangeGrants = 0;
  }
}
