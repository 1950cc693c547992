/**
 * The holder's lease table: which requester pins which blocks until when.
 *
 * Pure and synchronous, with an injectable clock, so property tests can step time. It
 * keeps three promises:
 *
 * - **Counters balance**: `acquired = released + expired + active` for sessions and for
 *   blocks, after every call (a session ended by shutdown counts as expired; a grant
 *   abandoned before the requester saw it counts as released).
 * - **Refcounted pins**: a block is pinned when its first live lease takes it and
 *   unpinned only when its last live lease ends, so `unpin` never runs while a live lease
 *   holds the block. On lease end the `onEnd` hook (revoke the lease's grants) runs
 *   before any `unpin`.
 * - **Expiry costs what expires**: leases sit in a deadline-keyed min-heap; `expireDue`
 *   pops only the due ones. Every operation first expires what is due, so a lease is
 *   never usable past its deadline even if the GC timer runs late.
 */
import { randomBytes } from 'node:crypto';
import { formatId, isToken, ownerProblem, type Logger, silentLogger } from '@tensorwire/core';
import { LeaseError, type LeaseStatus } from '../errors.js';
import { blockIdsProblem, numberedBlockIds, sessionIdProblem, type NumberedBlocks } from '../ids.js';
import { DeadlineHeap, type HeapEntry } from './heap.js';

/** Milliseconds on some monotonic-enough timeline; the table only compares and adds. */
export interface Clock {
  now(): number;
}

const TIME_ORIGIN = performance.timeOrigin;
/** Unix-epoch milliseconds from a monotonic source (does not jump when the wall clock is set). */
export const systemClock: Clock = {
  now: () => TIME_ORIGIN + performance.now(),
};

/** A live lease as the hooks and callers see it. */
export interface LeaseInfo {
  readonly sessionId: string;
  readonly requesterId: string;
  /**
   * The lease's block ids, in request order. For a lease of numbered blocks (`blocks`), the ids
   * `block:<owner>:<n>` formatted on first use.
   */
  readonly blockIds: readonly string[];
  /** How many blocks the lease holds. */
  readonly blockCount: number;
  /**
   * A lease of numbered blocks: the space's owner and the numbers, in request order (a copy the
   * table owns: read it, do not write it). Undefined for a lease of blocks named by id.
   */
  readonly blocks?: NumberedBlocks;
  /** Client-chosen acquire nonce, when the requester sent one. */
  readonly acquireId: string | undefined;
  readonly acquiredAt: number;
  /** When the lease ends unless renewed (clock milliseconds). */
  readonly deadline: number;
  /** The lease length last granted (ms). */
  readonly leaseMs: number;
  /**
   * Per block, in `blockIds` order: what the `pin` hook returned when the block was pinned
   * (kept with the pin while any live lease holds the block). Set when the table has a `pin`
   * hook; filled in as the blocks are pinned.
   */
  readonly pinValues?: readonly unknown[];
  /**
   * False once the lease has ended (released, expired, abandoned, shutdown). The `revoke` hook
   * runs when it ends, possibly while a resolver is still working on it: a resolver that
   * grants after this turned false must revoke that grant itself (`engineGrants` does, and
   * grants nothing for a lease that ended before it was asked).
   */
  readonly live: boolean;
}

/** Why a lease ended. `released` and `abandoned` count as released; `expired` and `shutdown` as expired. */
export type LeaseEndReason = 'released' | 'abandoned' | 'expired' | 'shutdown';

export interface LeaseCounters {
  /** Sessions ever granted. */
  readonly acquired: number;
  /** Sessions ended by a release (or a grant abandoned before the requester saw it). */
  readonly released: number;
  /** Sessions ended by the expiry GC (or revoked at shutdown). */
  readonly expired: number;
  /** Sessions live now. */
  readonly active: number;
  readonly blocksAcquired: number;
  readonly blocksReleased: number;
  readonly blocksExpired: number;
  /** Sum of blocks over live sessions. */
  readonly activeBlocks: number;
  /** Distinct blocks pinned now (a block held by two sessions counts once). */
  readonly pinnedBlocks: number;
  /** Requests refused (any operation, any status). */
  readonly rejected: number;
}

export interface LeaseTableOptions {
  /** Owner of the session ids (`session:<holderId>:<random>`). */
  readonly holderId: string;
  /** The longest lease granted, and the default (ms). */
  readonly lockTimeoutMs: number;
  /** The shortest lease granted (ms); shorter requests are raised to it. Default min(1000, lockTimeoutMs). */
  readonly minLeaseMs?: number;
  /** Live sessions at most (default 100,000). */
  readonly maxSessions?: number;
  /** Blocks in one acquire at most (default 4096). */
  readonly maxBlocksPerSession?: number;
  /** Sum of blocks over live sessions at most (default unlimited). */
  readonly maxActiveBlocks?: number;
  readonly clock?: Clock;
  /**
   * Block goes from 0 to 1 live leases. Throw (e.g. `LeaseError('NOT_FOUND', …)`) to refuse the
   * acquire. What it returns (e.g. where the block lies) is kept with the pin until the block
   * is unpinned, and every lease that takes the block meanwhile gets it in `pinValues`.
   */
  readonly pin?: (blockId: string, lease: LeaseInfo) => unknown;
  /** Block goes from 1 to 0 live leases: its memory may be reused. */
  readonly unpin?: (blockId: string) => void;
  /** A lease ended: revoke its grants. Runs before the `unpin`s it causes. */
  readonly onEnd?: (lease: LeaseInfo, reason: LeaseEndReason) => void;
  /** A request was refused. */
  readonly onReject?: (op: 'acquire' | 'release' | 'renew', status: LeaseStatus) => void;
  /**
   * Numbered block spaces, by owner: blocks `block:<owner>:0` to `block:<owner>:<count - 1>`,
   * leased by number (`acquire(requester, { owner, numbers })`). Their pins are counts in a
   * typed array per space (8 bytes per block of the space, made up front), checked and taken
   * with no string and no object per block; the `pin`/`unpin` hooks above are not called for
   * them (each space has its own, per batch). Ids of a space's owner are refused
   * INVALID_ARGUMENT, so that each of its blocks has one name.
   */
  readonly spaces?: Readonly<Record<string, BlockSpace>>;
  /** Unguessable local part of a session id (default 128 random bits, base64url). */
  readonly newSecret?: () => string;
  readonly logger?: Logger;
}

/** A numbered block space of the lease table (see {@link LeaseTableOptions.spaces}). */
export interface BlockSpace {
  /** Blocks in the space: numbers 0 to count - 1 (at most 2^28). */
  readonly count: number;
  /**
   * Blocks of an acquire that went from 0 to 1 live leases (numbers, in request order; the array
   * is reused once this returns). Throw (e.g. `LeaseError('NOT_FOUND', …)`) to refuse the
   * acquire: nothing is then pinned.
   */
  readonly pin?: (numbers: Uint32Array, lease: LeaseInfo) => void;
  /** Blocks of an ended lease that went from 1 to 0 live leases: their memory may be reused (the array is reused once this returns). */
  readonly unpin?: (numbers: Uint32Array) => void;
}

/** The most blocks one numbered space may have (its pin table is 8 bytes per block). */
export const MAX_SPACE_BLOCKS = 2 ** 28;

/** A numbered space's pins: a count per block, and the acquire that last named each block (repeat check). */
interface SpaceState {
  readonly owner: string;
  /** `block:<owner>:`, to refuse ids in the space. */
  readonly prefix: string;
  readonly count: number;
  readonly pins: Uint32Array;
  readonly seen: Uint32Array;
  /** Stamp of the current acquire in `seen` (1, 2, …; the table is cleared when it wraps). */
  stamp: number;
  /** Blocks with a count above 0. */
  pinned: number;
  readonly pin: BlockSpace['pin'];
  readonly unpin: BlockSpace['unpin'];
}

export interface AcquireParams {
  /** Requested lease (ms); 0 or absent means the lock timeout. */
  readonly leaseMs?: number;
  /** Client nonce for release-before-response. */
  readonly acquireId?: string;
}

/** What the last `expireDue` call did: `examined` heap entries to expire `expired` leases. */
export interface SweepStats {
  readonly examined: number;
  readonly expired: number;
}

interface Lease extends LeaseInfo, HeapEntry {
  readonly space: SpaceState | undefined;
  deadline: number;
  leaseMs: number;
  heapIndex: number;
  live: boolean;
}

/** A pinned block: how many live leases hold it, and what the `pin` hook returned for it. */
interface Pin {
  n: number;
  readonly value: unknown;
}

const DEFAULT_MAX_SESSIONS = 100_000;
const NO_SWEEP: SweepStats = Object.freeze({ examined: 0, expired: 0 });
const DEFAULT_MAX_BLOCKS = 4096;

const SECRET_BYTES = 16;
let secretPool = Buffer.alloc(0);
let secretOffset = 0;
/** 128 random bits, base64url (22 characters); drawn from a pooled buffer. */
function defaultSecret(): string {
  if (secretOffset + SECRET_BYTES > secretPool.length) {
    secretPool = randomBytes(SECRET_BYTES * 256);
    secretOffset = 0;
  }
  const s = secretPool.toString('base64url', secretOffset, secretOffset + SECRET_BYTES);
  secretOffset += SECRET_BYTES;
  return s;
}

export class LeaseTable {
  readonly holderId: string;
  readonly lockTimeoutMs: number;
  readonly minLeaseMs: number;
  readonly maxSessions: number;
  readonly maxBlocksPerSession: number;
  readonly maxActiveBlocks: number;
  readonly clock: Clock;

  readonly #opts: LeaseTableOptions;
  readonly #logger: Logger;
  readonly #sessions = new Map<string, Lease>();
  readonly #byAcquire = new Map<string, Lease>();
  readonly #pins = new Map<string, Pin>();
  readonly #spaces = new Map<string, SpaceState>();
  /** Scratch for a space's pin and unpin hooks (grown as needed). */
  #changed = new Uint32Array(0);
  readonly #heap = new DeadlineHeap<Lease>();
  /** Acquire ids released before their acquire arrived: key → expiry, in expiry order. */
  readonly #tombstones = new Map<string, number>();
  #acquired = 0;
  #released = 0;
  #expired = 0;
  #blocksAcquired = 0;
  #blocksReleased = 0;
  #blocksExpired = 0;
  #activeBlocks = 0;
  #rejected = 0;
  #lastSweep: SweepStats = NO_SWEEP;

  constructor(options: LeaseTableOptions) {
    const holderProblem = ownerProblem(options.holderId);
    if (holderProblem !== undefined) throw new LeaseError('INVALID_ARGUMENT', `holderId: ${holderProblem}`);
    const positive = (v: number, name: string): number => {
      if (Number.isNaN(v) || v <= 0) throw new LeaseError('INVALID_ARGUMENT', `${name} must be a positive number, got ${v}`);
      return v;
    };
    this.#opts = options;
    this.holderId = options.holderId;
    this.lockTimeoutMs = Math.floor(positive(options.lockTimeoutMs, 'lockTimeoutMs'));
    if (this.lockTimeoutMs > 0xffffffff) throw new LeaseError('INVALID_ARGUMENT', 'lockTimeoutMs must fit in 32 bits');
    this.minLeaseMs = Math.min(this.lockTimeoutMs, Math.floor(positive(options.minLeaseMs ?? Math.min(1000, this.lockTimeoutMs), 'minLeaseMs')));
    this.maxSessions = positive(options.maxSessions ?? DEFAULT_MAX_SESSIONS, 'maxSessions');
    this.maxBlocksPerSession = positive(options.maxBlocksPerSession ?? DEFAULT_MAX_BLOCKS, 'maxBlocksPerSession');
    this.maxActiveBlocks = positive(options.maxActiveBlocks ?? Number.POSITIVE_INFINITY, 'maxActiveBlocks');
    this.clock = options.clock ?? systemClock;
    this.#logger = options.logger ?? silentLogger;
    for (const [owner, space] of Object.entries(options.spaces ?? {})) {
      const problem = ownerProblem(owner);
      if (problem !== undefined) throw new LeaseError('INVALID_ARGUMENT', `spaces: owner ${JSON.stringify(owner)}: ${problem}`);
      const count = space?.count;
      if (typeof count !== 'number' || !Number.isInteger(count) || count < 1 || count > MAX_SPACE_BLOCKS) {
        throw new LeaseError('INVALID_ARGUMENT', `spaces.${owner}.count must be an integer from 1 to 2^28, got ${String(count)}`);
      }
      this.#spaces.set(owner, {
        owner,
        prefix: `block:${owner}:`,
        count,
        pins: new Uint32Array(count),
        seen: new Uint32Array(count),
        stamp: 0,
        pinned: 0,
        pin: space.pin,
        unpin: space.unpin,
      });
    }
  }

  /** Live sessions. */
  get size(): number {
    return this.#sessions.size;
  }

  counters(): LeaseCounters {
    let spacePinned = 0;
    for (const sp of this.#spaces.values()) spacePinned += sp.pinned;
    return {
      acquired: this.#acquired,
      released: this.#released,
      expired: this.#expired,
      active: this.#sessions.size,
      blocksAcquired: this.#blocksAcquired,
      blocksReleased: this.#blocksReleased,
      blocksExpired: this.#blocksExpired,
      activeBlocks: this.#activeBlocks,
      pinnedBlocks: this.#pins.size + spacePinned,
      rejected: this.#rejected,
    };
  }

  /** The live lease for a session id, if any (does not expire anything). */
  get(sessionId: string): LeaseInfo | undefined {
    return this.#sessions.get(sessionId);
  }

  /** Live leases, in no particular order. */
  leases(): IterableIterator<LeaseInfo> {
    return this.#sessions.values();
  }

  /** How many live leases pin a block (0 when unpinned), by id (numbered blocks too). */
  pinCount(blockId: string): number {
    for (const sp of this.#spaces.values()) {
      if (!blockId.startsWith(sp.prefix)) continue;
      const local = blockId.slice(sp.prefix.length);
      const n = /^(0|[1-9][0-9]{0,9})$/.test(local) ? Number(local) : -1;
      return n >= 0 && n < sp.count ? (sp.pins[n] as number) : 0;
    }
    return this.#pins.get(blockId)?.n ?? 0;
  }

  /** The earliest deadline among live leases. */
  nextDeadline(): number | undefined {
    return this.#heap.peek()?.deadline;
  }

  /** What the last sweep cost. */
  get lastSweep(): SweepStats {
    return this.#lastSweep;
  }

  #reject(op: 'acquire' | 'release' | 'renew', statusName: LeaseStatus, message: string): never {
    this.#rejected++;
    try {
      this.#opts.onReject?.(op, statusName);
    } catch (e) {
      this.#logger.warn('lock: onReject hook threw', { error: String(e) });
    }
    throw new LeaseError(statusName, message);
  }

  #checkRequester(op: 'acquire' | 'release' | 'renew', requesterId: unknown): string {
    const problem = ownerProblem(requesterId);
    if (problem !== undefined) this.#reject(op, 'INVALID_ARGUMENT', `requester id: ${problem}`);
    return requesterId as string;
  }

  #leaseMs(op: 'acquire' | 'renew', requested: number | undefined): number {
    if (requested === undefined || requested === 0) return this.lockTimeoutMs;
    if (!Number.isFinite(requested) || requested < 0) this.#reject(op, 'INVALID_ARGUMENT', `lease_ms must be a non-negative number, got ${requested}`);
    return Math.min(this.lockTimeoutMs, Math.max(this.minLeaseMs, Math.floor(requested)));
  }

  /**
   * Pin `blocks` under a new lease for `requesterId`: block ids, or numbered blocks of one of
   * the table's spaces (`{ owner, numbers }`). Throws LeaseError: INVALID_ARGUMENT (malformed
   * ids, empty list, duplicates, an id in a numbered space), NOT_FOUND (a space the table does
   * not have, a number past its end), RESOURCE_EXHAUSTED (limits), ALREADY_EXISTS (live acquire
   * id), ABORTED (acquire id released before it arrived), or whatever a `pin` hook throws (pins
   * taken so far are rolled back).
   */
  acquire(requesterId: string, blocks: readonly string[] | NumberedBlocks, params: AcquireParams = {}): LeaseInfo {
    const now = this.clock.now();
    this.expireDue(now);
    this.#checkRequester('acquire', requesterId);
    const numbered = !Array.isArray(blocks);
    let space: SpaceState | undefined;
    let numbers: Uint32Array | undefined;
    let n: number;
    if (numbered) {
      const b = blocks as NumberedBlocks | null | undefined;
      if (b === null || typeof b !== 'object' || !(b.numbers instanceof Uint32Array)) {
        this.#reject('acquire', 'INVALID_ARGUMENT', 'blocks must be a list of block ids or { owner, numbers: Uint32Array }');
      }
      n = b.numbers.length;
      if (n === 0) this.#reject('acquire', 'INVALID_ARGUMENT', 'block list is empty');
      if (n > this.maxBlocksPerSession) this.#reject('acquire', 'RESOURCE_EXHAUSTED', `${n} blocks requested; at most ${this.maxBlocksPerSession} per session`);
      space = typeof b.owner === 'string' ? this.#spaces.get(b.owner) : undefined;
      if (space === undefined) {
        const problem = ownerProblem(b.owner);
        if (problem !== undefined) this.#reject('acquire', 'INVALID_ARGUMENT', `block owner: ${problem}`);
        this.#reject('acquire', 'NOT_FOUND', `no numbered blocks of owner ${b.owner} on this holder`);
      }
      numbers = b.numbers.slice(); // the table's own copy: the caller's array may change
      this.#checkNumbers(space, numbers);
    } else {
      const blockIds = blocks as readonly string[];
      n = blockIds.length;
      if (n === 0) this.#reject('acquire', 'INVALID_ARGUMENT', 'block list is empty');
      if (n > this.maxBlocksPerSession) this.#reject('acquire', 'RESOURCE_EXHAUSTED', `${n} blocks requested; at most ${this.maxBlocksPerSession} per session`);
      // Each id for its form, then (one name per block) outside every numbered space, then not a repeat.
      const spaces = this.#spaces.size === 0 ? undefined : this.#spaces;
      const problem = blockIdsProblem(blockIds, spaces && ((id) => this.#inSpace(spaces, id)));
      if (problem !== undefined) this.#reject('acquire', 'INVALID_ARGUMENT', problem);
    }
    const leaseMs = this.#leaseMs('acquire', params.leaseMs);
    const acquireId = params.acquireId === undefined || params.acquireId === '' ? undefined : params.acquireId;
    let acquireKey: string | undefined;
    if (acquireId !== undefined) {
      if (!isToken(acquireId)) this.#reject('acquire', 'INVALID_ARGUMENT', 'acquire id must be 1-64 characters of [A-Za-z0-9_-]');
      acquireKey = `${requesterId}/${acquireId}`;
      if (this.#byAcquire.has(acquireKey)) this.#reject('acquire', 'ALREADY_EXISTS', `acquire id ${acquireId} is already live`);
      if (this.#tombstones.has(acquireKey)) this.#reject('acquire', 'ABORTED', `acquire ${acquireId} was released before it arrived`);
    }
    if (this.#sessions.size >= this.maxSessions) {
      this.#reject('acquire', 'RESOURCE_EXHAUSTED', `holder has ${this.#sessions.size} live sessions; limit ${this.maxSessions}`);
    }
    if (this.#activeBlocks + n > this.maxActiveBlocks) {
      this.#reject('acquire', 'RESOURCE_EXHAUSTED', `holder has ${this.#activeBlocks} blocks under lease; limit ${this.maxActiveBlocks}`);
    }
    let sessionId: string;
    const newSecret = this.#opts.newSecret;
    // The default secret is always a valid local part: no need to check it again.
    do sessionId = newSecret === undefined ? `session:${this.holderId}:${defaultSecret()}` : formatId('session', this.holderId, newSecret());
    while (this.#sessions.has(sessionId));
    const lease = numbered
      ? this.#pinNumbered(sessionId, requesterId, space as SpaceState, numbers as Uint32Array, acquireId, now, leaseMs)
      : this.#pinIds(sessionId, requesterId, blocks as readonly string[], acquireId, now, leaseMs);
    this.#sessions.set(sessionId, lease);
    if (acquireKey !== undefined) this.#byAcquire.set(acquireKey, lease);
    this.#heap.push(lease);
    this.#acquired++;
    this.#blocksAcquired += n;
    this.#activeBlocks += n;
    return lease;
  }

  /** Why an id may not be acquired by id: it names a block of a numbered space. */
  #inSpace(spaces: ReadonlyMap<string, SpaceState>, id: string): string | undefined {
    for (const sp of spaces.values()) if (id.startsWith(sp.prefix)) return `block id ${id} is in numbered space ${sp.owner}: acquire its blocks by number`;
    return undefined;
  }

  /** Each number inside the space, none twice (one pass: the space's `seen` stamps). */
  #checkNumbers(space: SpaceState, numbers: Uint32Array): void {
    if (space.stamp === 0xffffffff) {
      space.seen.fill(0);
      space.stamp = 0;
    }
    const stamp = ++space.stamp;
    const { seen, count } = space;
    for (let i = 0; i < numbers.length; i++) {
      const k = numbers[i] as number;
      if (k >= count) this.#reject('acquire', 'NOT_FOUND', `no block block:${space.owner}:${k} on this holder (blocks[${i}]; the space has ${count} blocks)`);
      if (seen[k] === stamp) this.#reject('acquire', 'INVALID_ARGUMENT', `block block:${space.owner}:${k} appears twice (blocks[${i}])`);
      seen[k] = stamp;
    }
  }

  /** A lease of block ids: each id's pin taken (the `pin` hook per block), rolled back on a refusal. */
  #pinIds(sessionId: string, requesterId: string, blockIds: readonly string[], acquireId: string | undefined, now: number, leaseMs: number): Lease {
    const n = blockIds.length;
    const pin = this.#opts.pin;
    const values = pin === undefined ? undefined : new Array<unknown>(n);
    const lease: Lease = {
      sessionId,
      requesterId,
      blockIds: Object.freeze([...blockIds]),
      blockCount: n,
      acquireId,
      acquiredAt: now,
      deadline: now + leaseMs,
      leaseMs,
      pinValues: values,
      space: undefined,
      heapIndex: -1,
      live: true,
    };
    // Pin, rolling back on a refusal so a failed acquire leaves no trace.
    let pinned = 0;
    try {
      for (; pinned < n; pinned++) {
        const id = lease.blockIds[pinned] as string;
        const held = this.#pins.get(id);
        if (held === undefined) {
          const value = pin?.(id, lease);
          this.#pins.set(id, { n: 1, value });
          if (values !== undefined) values[pinned] = value;
        } else {
          held.n++;
          if (values !== undefined) values[pinned] = held.value;
        }
      }
    } catch (e) {
      lease.live = false;
      this.#unpinAll(lease.blockIds, pinned);
      this.#refused(e);
    }
    return lease;
  }

  /**
   * A lease of numbered blocks (checked): a count per block in the space's table, the blocks that
   * went from 0 to 1 handed to the space's `pin` hook at once, all rolled back if it refuses.
   */
  #pinNumbered(sessionId: string, requesterId: string, space: SpaceState, numbers: Uint32Array, acquireId: string | undefined, now: number, leaseMs: number): Lease {
    let ids: readonly string[] | undefined;
    const blocks: NumberedBlocks = Object.freeze({ owner: space.owner, numbers });
    const lease: Lease = {
      sessionId,
      requesterId,
      get blockIds(): readonly string[] {
        return (ids ??= numberedBlockIds(blocks));
      },
      blockCount: numbers.length,
      blocks,
      acquireId,
      acquiredAt: now,
      deadline: now + leaseMs,
      leaseMs,
      space,
      heapIndex: -1,
      live: true,
    };
    const pins = space.pins;
    const changed = space.pin === undefined ? undefined : this.#scratch(numbers.length);
    let fresh = 0;
    for (let i = 0; i < numbers.length; i++) {
      const k = numbers[i] as number;
      const c = pins[k] as number;
      pins[k] = c + 1;
      if (c === 0) {
        if (changed !== undefined) changed[fresh] = k;
        fresh++;
      }
    }
    if (space.pin !== undefined && fresh > 0) {
      try {
        space.pin((changed as Uint32Array).subarray(0, fresh), lease);
      } catch (e) {
        lease.live = false;
        for (let i = 0; i < numbers.length; i++) {
          const k = numbers[i] as number;
          pins[k] = (pins[k] as number) - 1;
        }
        this.#refused(e);
      }
    }
    space.pinned += fresh;
    return lease;
  }

  /** An acquire refused by a pin hook: counted, reported, rethrown. */
  #refused(e: unknown): never {
    this.#rejected++;
    if (e instanceof LeaseError) {
      try {
        this.#opts.onReject?.('acquire', e.status);
      } catch {
        // reported through the rethrow
      }
    }
    throw e;
  }

  #scratch(n: number): Uint32Array {
    if (this.#changed.length < n) this.#changed = new Uint32Array(Math.max(n, this.#changed.length * 2, 64));
    return this.#changed;
  }

  /**
   * End a lease by session id (or by the acquire id it was granted under). Returns the
   * number of blocks released: 0 for an unknown, released or expired session. Throws
   * LeaseError PERMISSION_DENIED for another requester's session, INVALID_ARGUMENT for
   * malformed ids.
   */
  release(requesterId: string, target: { sessionId?: string; acquireId?: string }): number {
    const now = this.clock.now();
    this.expireDue(now);
    this.#checkRequester('release', requesterId);
    const sessionId = target.sessionId ?? '';
    const acquireId = target.acquireId ?? '';
    if ((sessionId === '') === (acquireId === '')) this.#reject('release', 'INVALID_ARGUMENT', 'give exactly one of session id and acquire id');
    let lease: Lease | undefined;
    if (sessionId !== '') {
      const problem = sessionIdProblem(sessionId);
      if (problem !== undefined) this.#reject('release', 'INVALID_ARGUMENT', `session id: ${problem}`);
      lease = this.#sessions.get(sessionId);
    } else {
      if (!isToken(acquireId)) this.#reject('release', 'INVALID_ARGUMENT', 'acquire id must be 1-64 characters of [A-Za-z0-9_-]');
      const key = `${requesterId}/${acquireId}`;
      lease = this.#byAcquire.get(key);
      if (lease === undefined) this.#tombstone(key, now);
    }
    if (lease === undefined) return 0;
    if (lease.requesterId !== requesterId) this.#reject('release', 'PERMISSION_DENIED', `session ${lease.sessionId} belongs to another requester`);
    this.#end(lease, 'released');
    return lease.blockCount;
  }

  /** Holder-side release of a grant the requester never saw (e.g. its call was cancelled). */
  abandon(sessionId: string): number {
    const lease = this.#sessions.get(sessionId);
    if (lease === undefined) return 0;
    this.#end(lease, 'abandoned');
    return lease.blockCount;
  }

  /**
   * Extend a live lease to now + leaseMs (capped at the lock timeout). Throws LeaseError
   * NOT_FOUND for an unknown or expired session, PERMISSION_DENIED for another
   * requester's, INVALID_ARGUMENT for a malformed id.
   */
  renew(requesterId: string, sessionId: string, leaseMs?: number): LeaseInfo {
    const now = this.clock.now();
    this.expireDue(now);
    this.#checkRequester('renew', requesterId);
    const problem = sessionIdProblem(sessionId);
    if (problem !== undefined) this.#reject('renew', 'INVALID_ARGUMENT', `session id: ${problem}`);
    const ms = this.#leaseMs('renew', leaseMs);
    const lease = this.#sessions.get(sessionId);
    if (lease === undefined) this.#reject('renew', 'NOT_FOUND', `session ${sessionId} is not live (unknown, released or expired)`);
    if (lease.requesterId !== requesterId) this.#reject('renew', 'PERMISSION_DENIED', `session ${sessionId} belongs to another requester`);
    lease.leaseMs = ms;
    this.#heap.update(lease, Math.max(lease.deadline, now + ms));
    return lease;
  }

  /** Expire every lease whose deadline is at or before `now`. Cost: O(k log n) for k expiring. */
  expireDue(now: number = this.clock.now()): number {
    let examined = 0;
    let expired = 0;
    for (;;) {
      const top = this.#heap.peek();
      if (top === undefined || top.deadline > now) break;
      examined++;
      this.#end(top, 'expired');
      expired++;
    }
    this.#pruneTombstones(now);
    this.#lastSweep = examined === 0 ? NO_SWEEP : { examined, expired };
    return expired;
  }

  /** End every live lease (counted as expired), for shutdown. */
  revokeAll(): number {
    let n = 0;
    for (;;) {
      const top = this.#heap.peek();
      if (top === undefined) return n;
      this.#end(top, 'shutdown');
      n++;
    }
  }

  #end(lease: Lease, reason: LeaseEndReason): void {
    if (!lease.live) return;
    lease.live = false;
    this.#heap.remove(lease);
    this.#sessions.delete(lease.sessionId);
    if (lease.acquireId !== undefined) this.#byAcquire.delete(`${lease.requesterId}/${lease.acquireId}`);
    const n = lease.blockCount;
    this.#activeBlocks -= n;
    if (reason === 'released' || reason === 'abandoned') {
      this.#released++;
      this.#blocksReleased += n;
    } else {
      this.#expired++;
      this.#blocksExpired += n;
    }
    try {
      this.#opts.onEnd?.(lease, reason);
    } catch (e) {
      this.#logger.error('lock: onEnd hook threw; continuing', { sessionId: lease.sessionId, error: String(e) });
    }
    if (lease.space !== undefined) this.#unpinNumbered(lease.space, (lease.blocks as NumberedBlocks).numbers);
    else this.#unpinAll(lease.blockIds, n);
  }

  /** Drop one pin of each numbered block; the blocks no live lease holds any more go to the space's `unpin` hook at once. */
  #unpinNumbered(space: SpaceState, numbers: Uint32Array): void {
    const pins = space.pins;
    const changed = space.unpin === undefined ? undefined : this.#scratch(numbers.length);
    let freed = 0;
    for (let i = 0; i < numbers.length; i++) {
      const k = numbers[i] as number;
      const c = (pins[k] as number) - 1;
      pins[k] = c;
      if (c === 0) {
        if (changed !== undefined) changed[freed] = k;
        freed++;
      }
    }
    space.pinned -= freed;
    if (space.unpin === undefined || freed === 0) return;
    try {
      space.unpin((changed as Uint32Array).subarray(0, freed));
    } catch (e) {
      this.#logger.error('lock: unpin hook threw; continuing', { owner: space.owner, blocks: freed, error: String(e) });
    }
  }

  /** Drop one pin of each of the first `count` blocks; unpin those no live lease holds any more. */
  #unpinAll(blockIds: readonly string[], count: number): void {
    for (let i = 0; i < count; i++) {
      const id = blockIds[i] as string;
      const held = this.#pins.get(id);
      if (held !== undefined && held.n > 1) {
        held.n--;
        continue;
      }
      this.#pins.delete(id);
      try {
        this.#opts.unpin?.(id);
      } catch (e) {
        this.#logger.error('lock: unpin hook threw; continuing', { blockId: id, error: String(e) });
      }
    }
  }

  #tombstone(key: string, now: number): void {
    this.#tombstones.delete(key);
    this.#tombstones.set(key, now + this.lockTimeoutMs);
    const cap = Math.max(1024, Math.min(this.maxSessions, 1_000_000));
    while (this.#tombstones.size > cap) {
      const oldest = this.#tombstones.keys().next().value as string;
      this.#tombstones.delete(oldest);
    }
  }

  #pruneTombstones(now: number): void {
    if (this.#tombstones.size === 0) return;
    // Insertion order is expiry order (constant TTL), so this stops at the first live one.
    for (const [key, expiresAt] of this.#tombstones) {
      if (expiresAt > now) return;
      this.#tombstones.delete(key);
    }
  }
}
