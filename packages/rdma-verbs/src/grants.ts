/**
 * Range grants ("register once, grant per lease"): the bookkeeping on both sides, without a
 * device.
 *
 * A range grant is one 128-bit token over ranges of registrations. Its descriptor payload holds
 * the token, the range count and the mode, never an address per range: the engine carries the
 * range lengths, and the requester learns where the ranges are by presenting the token on its
 * connection once (GRANT_BIND). The holder answers with a table (GRANT_HEAD and its parts, see
 * wire.ts): per region (registration) its base address, per key the rkeys that open it, per
 * range its key and its offset in its region.
 *
 * - memory-region mode: a key is a registration and its rkey is the MR's (one for every queue
 *   pair). The NIC would let such an rkey reach the whole MR: bounds are the requester's check
 *   against the range lengths, before it posts (so the holder trusts the requester's code).
 * - memory-window mode: a key is a contiguous run of granted ranges (ranges that touch in
 *   their registration, in any order, share one), with a type-2 window per queue pair of the
 *   requester's connection bound over exactly that run, so the NIC itself refuses bytes outside
 *   the granted ranges.
 *
 * {@link layoutGrant} is the holder's layout (computed once per grant); {@link GrantTableCache}
 * is the requester's per-connection cache of tables, with one GRANT_BIND in flight per grant
 * however many transfers want it, and the drain that answers GRANT_UNBIND.
 */
import { ConnectionBrokenError, InvalidInputError, RemoteRejectedError, ResourceExhaustedError, type TensorwireError } from '@tensorwire/core';
import { MAX_BINDS_IN_FLIGHT, refusal } from './windows.js';
import { GRANT_TOKEN_BYTES, MAX_RANGE_GRANT_RANGES, type ControlMessage, type GrantTableData } from './wire.js';

/** Ranges a requester keeps tables for on one connection at most (idle tables are evicted first). */
export const MAX_CACHED_GRANT_RANGES = 1 << 22;

/** The holder's layout of a range grant: which keys cover which ranges. */
export interface GrantLayout {
  /** Region r is registration `regionHandle[r]` (an index into the grant's handles). */
  readonly regionHandle: Uint32Array;
  /** Per key: its region, and the extent it opens in that region (a window's range). */
  readonly keyRegion: Uint32Array;
  readonly keyOffset: Float64Array;
  readonly keyLength: Float64Array;
  /** Per range: its key, its offset inside its region, and its length. */
  readonly rangeKey: Uint32Array;
  readonly rangeOffset: Float64Array;
  readonly rangeLength: Float64Array;
}

/** Positions of a range's numbers in a grant's Float64Array (core's GrantField). */
export interface GrantFields {
  readonly Handle: number;
  readonly Offset: number;
  readonly Length: number;
}

/**
 * Lay a grant out as keys. Range k's numbers are at `k * stride + fields.X` (core's
 * GrantRanges layout). Per registration: one key for all of it (`runs` false), or one key per
 * run of ranges that touch or overlap in it (`runs` true), found by sorting the ranges by
 * position when they are not in order already. Cost: O(n log n) once per grant, no object per
 * range.
 */
export function layoutGrant(ranges: Float64Array, count: number, stride: number, fields: GrantFields, regionLengths: (handle: number) => number, runs: boolean): GrantLayout {
  const rangeOffset = new Float64Array(count);
  const rangeLength = new Float64Array(count);
  const rangeKey = new Uint32Array(count);
  // Regions: distinct handles in order of first use.
  const regionOf = new Map<number, number>();
  const handles: number[] = [];
  const rangeRegion = new Uint32Array(count);
  for (let k = 0; k < count; k++) {
    const h = ranges[k * stride + fields.Handle] as number;
    let r = regionOf.get(h);
    if (r === undefined) regionOf.set(h, (r = handles.push(h) - 1));
    rangeRegion[k] = r;
    rangeOffset[k] = ranges[k * stride + fields.Offset] as number;
    rangeLength[k] = ranges[k * stride + fields.Length] as number;
  }
  const regionHandle = Uint32Array.from(handles);
  if (!runs) {
    const n = handles.length;
    const keyOffset = new Float64Array(n);
    const keyLength = new Float64Array(n);
    for (let r = 0; r < n; r++) keyLength[r] = regionLengths(handles[r] as number);
    rangeKey.set(rangeRegion);
    return { regionHandle, keyRegion: Uint32Array.from(handles.keys()), keyOffset, keyLength, rangeKey, rangeOffset, rangeLength };
  }
  // Ranges by (region, offset): sorted already in the common case, else sort an index.
  const order = new Uint32Array(count);
  for (let k = 0; k < count; k++) order[k] = k;
  let sorted = true;
  for (let k = 1; k < count && sorted; k++) {
    const a = rangeRegion[k - 1] as number;
    const b = rangeRegion[k] as number;
    sorted = a < b || (a === b && (rangeOffset[k - 1] as number) <= (rangeOffset[k] as number));
  }
  if (!sorted) order.sort((a, b) => (rangeRegion[a] as number) - (rangeRegion[b] as number) || (rangeOffset[a] as number) - (rangeOffset[b] as number));
  const keyRegion: number[] = [];
  const keyOffset: number[] = [];
  const keyEnd: number[] = [];
  let key = -1;
  for (let i = 0; i < count; i++) {
    const k = order[i] as number;
    const region = rangeRegion[k] as number;
    const off = rangeOffset[k] as number;
    const end = off + (rangeLength[k] as number);
    if (key >= 0 && keyRegion[key] === region && off <= (keyEnd[key] as number)) {
      if (end > (keyEnd[key] as number)) keyEnd[key] = end;
    } else {
      key = keyRegion.push(region) - 1;
      keyOffset.push(off);
      keyEnd.push(end);
    }
    rangeKey[k] = key;
  }
  const n = keyRegion.length;
  const length = new Float64Array(n);
  for (let j = 0; j < n; j++) length[j] = (keyEnd[j] as number) - (keyOffset[j] as number);
  return { regionHandle, keyRegion: Uint32Array.from(keyRegion), keyOffset: Float64Array.from(keyOffset), keyLength: length, rangeKey, rangeOffset, rangeLength };
}

/**
 * A holder's table for one grant on one connection, as the requester keeps it: where each
 * range is and which rkeys open it (see {@link GrantTableData}).
 */
export interface GrantTable extends GrantTableData {
  readonly count: number;
  /** Set by GRANT_UNBIND (or the connection failing): transfers holding it must not post. */
  revoked: boolean;
  /** Transfers holding this table, from getting it until they settle (a table in use is never evicted). */
  users: number;
  /** Of those, the ones that have posted work under it (from their first post until they settle). */
  posting: number;
  /** Set on GRANT_UNBIND while posting > 0: called once the last of them has settled. */
  onIdle: (() => void) | undefined;
}

interface Assembly {
  readonly requestId: number;
  readonly key: string;
  readonly count: number;
  readonly resolve: (t: GrantTable) => void;
  readonly reject: (e: TensorwireError) => void;
  /** 0: waiting for the head; 1 regions; 2 keys; 3 ranges. */
  stage: number;
  filled: number;
  revoked: boolean;
  regionHi?: Uint32Array;
  regionLo?: Uint32Array;
  keyRegion?: Uint32Array;
  rkeys?: Uint32Array;
  rkeysPerKey?: number;
  rangeKey?: Uint32Array;
  rangeOffset?: Float64Array;
  rangeLength?: Float64Array;
}

/** What a requester presents in GRANT_BIND: the fields of the grant's descriptor payload. */
export interface GrantTerms {
  readonly token: Uint8Array;
  readonly count: number;
  /** The payload's mode: memory windows (else whole-MR rkeys). */
  readonly windows: boolean;
  /** The payload's byte total. */
  readonly length: number;
}

/**
 * The cache key of a grant: every field of its payload (token in hex, range count, mode, byte
 * total). The holder refuses a GRANT_BIND whose fields are not the grant's, so a descriptor
 * with any of them changed never meets the real grant's table.
 */
export function grantKey(hex: string, g: Omit<GrantTerms, 'token'>): string {
  return `${hex}:${g.count}:${g.windows ? 1 : 0}:${g.length}`;
}

/**
 * The requester's side on one connection: a table per range grant, one GRANT_BIND in flight
 * per grant however many transfers want it, at most `maxInFlight` in flight at all (the rest
 * wait their turn), and at most `maxRanges` ranges cached (idle tables are evicted, else new
 * grants get backpressure).
 */
export class GrantTableCache {
  readonly #send: (m: ControlMessage) => void;
  readonly #queuePairs: number;
  readonly #maxInFlight: number;
  readonly #maxRanges: number;
  readonly #tables = new Map<string, GrantTable>();
  readonly #inflight = new Map<string, Promise<GrantTable>>();
  readonly #waiting = new Map<number, Assembly>();
  readonly #queued: { readonly requestId: number; readonly terms: GrantTerms }[] = [];
  #inFlight = 0;
  #ranges = 0;
  #nextRequest = 1;
  #sent = 0;
  #failed: TensorwireError | undefined;

  constructor(queuePairs: number, send: (m: ControlMessage) => void, maxInFlight = MAX_BINDS_IN_FLIGHT, maxRanges = MAX_CACHED_GRANT_RANGES) {
    this.#queuePairs = queuePairs;
    this.#send = send;
    this.#maxInFlight = maxInFlight;
    this.#maxRanges = maxRanges;
  }

  /** Grants with a table cached. */
  get size(): number {
    return this.#tables.size;
  }

  /** GRANT_BINDs sent so far (for tests and diagnostics). */
  get binds(): number {
    return this.#sent;
  }

  /** GRANT_BINDs sent and not answered yet. */
  get inFlight(): number {
    return this.#inFlight;
  }

  /** Ranges of the cached tables and of those being fetched. */
  get ranges(): number {
    return this.#ranges;
  }

  /** The table for a grant (as its payload says, `hex` its token in hex): cached, or one GRANT_BIND shared by every caller. */
  get(g: GrantTerms, hex: string): GrantTable | Promise<GrantTable> {
    const { token, count, windows, length } = g;
    if (
      token.length !== GRANT_TOKEN_BYTES ||
      !Number.isInteger(count) ||
      count < 1 ||
      count > MAX_RANGE_GRANT_RANGES ||
      typeof windows !== 'boolean' ||
      !Number.isSafeInteger(length) ||
      length < count
    ) {
      return Promise.reject(new InvalidInputError('malformed range grant'));
    }
    const key = grantKey(hex, g);
    const hit = this.#tables.get(key);
    if (hit) {
      // Most recently used last: eviction takes the oldest idle table first.
      this.#tables.delete(key);
      this.#tables.set(key, hit);
      return hit;
    }
    if (this.#failed) return Promise.reject(this.#failed);
    let p = this.#inflight.get(key);
    if (p) return p;
    if (this.#ranges + count > this.#maxRanges) {
      for (const [k, t] of this.#tables) {
        if (this.#ranges + count <= this.#maxRanges) break;
        if (t.users > 0) continue;
        this.#tables.delete(k);
        this.#ranges -= t.count;
      }
      if (this.#ranges + count > this.#maxRanges) {
        return Promise.reject(new ResourceExhaustedError(`the tables of the grants in use on this connection already cover ${this.#ranges} ranges (at most ${this.#maxRanges})`));
      }
    }
    const requestId = this.#nextRequest;
    this.#nextRequest = this.#nextRequest >= 0xffffffff ? 1 : this.#nextRequest + 1;
    this.#ranges += count;
    p = new Promise<GrantTable>((resolve, reject) => this.#waiting.set(requestId, { requestId, key, count, resolve, reject, stage: 0, filled: 0, revoked: false }));
    p.catch(() => undefined); // observed by whoever awaits it
    this.#inflight.set(key, p);
    this.#queued.push({ requestId, terms: { token: new Uint8Array(token), count, windows, length } });
    this.#dispatch();
    return p;
  }

  #dispatch(): void {
    while (this.#inFlight < this.#maxInFlight && this.#queued.length > 0) {
      const q = this.#queued.shift() as { requestId: number; terms: GrantTerms };
      this.#inFlight++;
      this.#sent++;
      this.#send({ type: 'grant-bind', requestId: q.requestId, ...q.terms });
    }
  }

  /** The BIND an answer is for; undefined when none was sent under that id. */
  #assembly(requestId: number): Assembly | undefined {
    const a = this.#waiting.get(requestId);
    if (!a || this.#queued.some((q) => q.requestId === requestId)) return undefined;
    return a;
  }

  /** The request is answered (table or refusal): the next BIND may go. */
  #done(a: Assembly): void {
    this.#waiting.delete(a.requestId);
    this.#inflight.delete(a.key);
    this.#inFlight--;
    this.#dispatch();
  }

  #protocol(a: Assembly, message: string): TensorwireError {
    const e = new ConnectionBrokenError(`the holder's grant table is malformed: ${message}`);
    this.#done(a);
    this.#ranges -= a.count;
    a.reject(e);
    return e;
  }

  /**
   * A GRANT_HEAD, table part or GRANT_REFUSE arrived. Returns a protocol error to break the
   * connection with, or undefined.
   */
  onMessage(m: ControlMessage): TensorwireError | undefined {
    if (m.type !== 'grant-head' && m.type !== 'grant-regions' && m.type !== 'grant-keys' && m.type !== 'grant-ranges' && m.type !== 'grant-refuse') return undefined;
    const a = this.#assembly(m.requestId);
    if (!a) return new ConnectionBrokenError(`the holder answered GRANT_BIND request ${m.requestId}, which is not pending`);
    if (m.type === 'grant-refuse') {
      if (a.stage !== 0) return this.#protocol(a, 'a refusal in the middle of a table');
      this.#done(a);
      this.#ranges -= a.count;
      a.reject(refusal(m.code, m.message));
      return undefined;
    }
    if (m.type === 'grant-head') {
      if (a.stage !== 0) return this.#protocol(a, 'a second head');
      if (m.ranges !== a.count) return this.#protocol(a, `${m.ranges} ranges for a grant of ${a.count}`);
      if (m.rkeysPerKey !== 1 && m.rkeysPerKey !== this.#queuePairs) return this.#protocol(a, `${m.rkeysPerKey} rkeys per key on a connection of ${this.#queuePairs} queue pairs`);
      a.regionHi = new Uint32Array(m.regions);
      a.regionLo = new Uint32Array(m.regions);
      a.keyRegion = new Uint32Array(m.keys);
      a.rkeysPerKey = m.rkeysPerKey;
      a.rkeys = new Uint32Array(m.keys * m.rkeysPerKey);
      a.rangeKey = new Uint32Array(m.ranges);
      a.rangeOffset = new Float64Array(m.ranges);
      a.rangeLength = new Float64Array(m.ranges);
      a.stage = 1;
      a.filled = 0;
      return undefined;
    }
    const want = m.type === 'grant-regions' ? 1 : m.type === 'grant-keys' ? 2 : 3;
    if (a.stage !== want || m.first !== a.filled) return this.#protocol(a, `${m.type} part at ${m.first} out of order`);
    if (m.type === 'grant-regions') {
      const hi = a.regionHi as Uint32Array;
      if (m.first + m.hi.length > hi.length) return this.#protocol(a, 'more regions than announced');
      hi.set(m.hi, m.first);
      (a.regionLo as Uint32Array).set(m.lo, m.first);
      a.filled += m.hi.length;
      if (a.filled === hi.length) [a.stage, a.filled] = [2, 0];
      return undefined;
    }
    if (m.type === 'grant-keys') {
      const region = a.keyRegion as Uint32Array;
      const regions = (a.regionHi as Uint32Array).length;
      if (m.rkeysPerKey !== a.rkeysPerKey) return this.#protocol(a, 'rkeys per key changed');
      if (m.first + m.region.length > region.length) return this.#protocol(a, 'more keys than announced');
      for (let i = 0; i < m.region.length; i++) if ((m.region[i] as number) >= regions) return this.#protocol(a, `key ${m.first + i} names region ${m.region[i]} of ${regions}`);
      region.set(m.region, m.first);
      (a.rkeys as Uint32Array).set(m.rkeys, m.first * m.rkeysPerKey);
      a.filled += m.region.length;
      if (a.filled === region.length) [a.stage, a.filled] = [3, 0];
      return undefined;
    }
    const key = a.rangeKey as Uint32Array;
    const keys = (a.keyRegion as Uint32Array).length;
    if (m.first + m.key.length > key.length) return this.#protocol(a, 'more ranges than announced');
    for (let i = 0; i < m.key.length; i++) if ((m.key[i] as number) >= keys) return this.#protocol(a, `range ${m.first + i} names key ${m.key[i]} of ${keys}`);
    key.set(m.key, m.first);
    (a.rangeOffset as Float64Array).set(m.offset, m.first);
    (a.rangeLength as Float64Array).set(m.length, m.first);
    a.filled += m.key.length;
    if (a.filled < key.length) return undefined;
    const table: GrantTable = {
      count: a.count,
      regionHi: a.regionHi as Uint32Array,
      regionLo: a.regionLo as Uint32Array,
      keyRegion: a.keyRegion as Uint32Array,
      rkeysPerKey: a.rkeysPerKey as number,
      rkeys: a.rkeys as Uint32Array,
      rangeKey: key,
      rangeOffset: a.rangeOffset as Float64Array,
      rangeLength: a.rangeLength as Float64Array,
      revoked: a.revoked,
      users: 0,
      posting: 0,
      onIdle: undefined,
    };
    this.#done(a);
    if (a.revoked) this.#ranges -= a.count;
    else this.#tables.set(a.key, table);
    a.resolve(table);
    return undefined;
  }

  /**
   * GRANT_UNBIND arrived: the grant's tables are revoked and dropped (transfers that hold them
   * must not post). Returns them, for the caller to answer GRANT_UNBOUND once no transfer that
   * posted under them is still unsettled.
   */
  onUnbind(hex: string): GrantTable[] {
    const found: GrantTable[] = [];
    const prefix = `${hex}:`;
    for (const [k, t] of this.#tables) {
      if (!k.startsWith(prefix)) continue;
      t.revoked = true;
      this.#tables.delete(k);
      this.#ranges -= t.count;
      found.push(t);
    }
    // A table still arriving (a holder that revokes in the middle of its answer) arrives revoked.
    for (const a of this.#waiting.values()) if (a.key.startsWith(prefix)) a.revoked = true;
    return found;
  }

  /** The connection is gone: every waiting BIND fails, and nothing is cached any more. */
  failAll(error: TensorwireError): void {
    this.#failed ??= error;
    for (const a of this.#waiting.values()) a.reject(error);
    this.#waiting.clear();
    this.#queued.length = 0;
    this.#inFlight = 0;
    this.#inflight.clear();
    for (const t of this.#tables.values()) t.revoked = true;
    this.#tables.clear();
    this.#ranges = 0;
  }
}

/** The error for a transfer that meets a revoked grant before all of it was posted. */
export function grantRevoked(peer: string, what: string): RemoteRejectedError {
  return new RemoteRejectedError(`${peer} revoked the grant before ${what}`, { details: { remoteCode: 'grant-revoked' } });
}
