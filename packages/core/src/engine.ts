/**
 * The transfer engine: everything above the device layer.
 *
 * - transports register with it; it picks one per peer and memory kind and can explain why;
 * - it keeps one connection table keyed by peer identity (node id + transport); each entry
 *   owns its per-connection state (round-robin counter, in-flight count); concurrent callers
 *   share one handshake; a simultaneous open from both sides settles on the connection opened
 *   by the node with the smaller id, on both sides, without a protocol round trip;
 *   invalidation is one `Map.delete` followed by an abortive close;
 * - it validates every request before anything reaches a transport, splits it into chunks of
 *   min(remaining, chunkBytes), spreads them over the connection's streams, backs off on
 *   local exhaustion, enforces deadlines and AbortSignals, and settles each call exactly once
 *   after every chunk has quiesced.
 */
import { randomBytes } from 'node:crypto';
import { getEventListeners } from 'node:events';
import { deferred, raceSignal, sleep, type Deferred } from './deferred.js';
import {
  MAX_GRANT_RANGES,
  decodeDescriptor,
  decodeEndpoint,
  encodeDescriptor,
  encodeGrantDescriptor,
  encodeEndpoint,
  type MemoryDescriptor,
  type PeerEndpoint,
} from './descriptor.js';
import {
  AbortedError,
  BackendUnavailableError,
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  ResourceExhaustedError,
  SessionInvalidatedError,
  TensorwireError,
  TimedOutError,
  errorFromSignal,
  toTensorwireError,
} from './errors.js';
import { checkGrantBlocks, checkGrantRanges, expandGrantBlocks, markCheckedBlocks, RangePool } from './grant-check.js';
import { IdAllocator, IdRegistry, assertOwner } from './ids.js';
import { consoleLogger, type Logger } from './logger.js';
import { EngineMetrics, type MetricsOptions, type PostTally } from './metrics.js';
import { defaultHostId } from './host-id.js';
import {
  GRANT_STRIDE,
  GrantField,
  RANGE_STRIDE,
  RangeField,
  TRANSPORT_SPECIFICATION_VERSION,
  memoryByteLength,
  type GrantBlocks,
  type GrantRanges,
  type Memory,
  type MemoryKind,
  type NodeIdentity,
  type TransferBatch,
  type Transport,
  type TransportConnection,
  type TransportHost,
} from './transport.js';
import { appendMerged, findOverlap, splitIntoBatches } from './plan.js';


/**
 * Decoded values of byte blobs, by blob object; a blob whose bytes changed since is decoded again.
 * A new blob object with the bytes of one decoded lately (a holder's endpoint, which every fetch
 * descriptor carries afresh) gets that decode's value: the same PeerEndpoint object, so the
 * transport choice and the connection found for it are found again, not made again.
 */
class DecodeCache<T> {
  readonly #entries = new WeakMap<Uint8Array, DecodeEntry<T>>();
  /** The latest distinct decodes, newest first, matched by content when the blob object is new. */
  readonly #recent: DecodeEntry<T>[] = [];
  readonly #decode: (bytes: Uint8Array) => T;
  constructor(decode: (bytes: Uint8Array) => T) {
    this.#decode = decode;
  }
  get(bytes: Uint8Array): T {
    const hit = this.#entries.get(bytes);
    if (hit !== undefined && sameBytes(hit.copy, bytes)) return hit.value;
    for (const e of this.#recent) {
      if (sameBytes(e.copy, bytes)) {
        this.#entries.set(bytes, e);
        return e.value;
      }
    }
    // Decode the private copy (its own exact-size buffer, not a slab of Node's pool): a blob in
    // shared memory may change while it is read, and the copy is what later calls compare to.
    const copy = new Uint8Array(bytes);
    const entry = { copy, value: this.#decode(copy) };
    this.#entries.set(bytes, entry);
    if (this.#recent.unshift(entry) > RECENT_DECODES) this.#recent.pop();
    return entry.value;
  }
}

interface DecodeEntry<T> {
  readonly copy: Uint8Array;
  readonly value: T;
}

/** How many distinct blobs {@link DecodeCache} matches by content (one compare each on a miss). */
const RECENT_DECODES = 8;

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  return a.length === b.length && Buffer.compare(a, b) === 0;
}

export interface TransferEngineOptions {
  /** This node's id: an owner name (letters, digits, `_`, `-`). Stable across restarts. */
  nodeId: string;
  transports: readonly Transport[];
  /** Random per start by default; a restarted node is a new incarnation. */
  incarnation?: string;
  /** Machine id; processes with equal host ids can use same-host transports. */
  hostId?: string;
  /** Parallel streams (sockets, queue pairs) per peer connection. Default 2. */
  streamsPerPeer?: number;
  /** Largest chunk a transfer is split into. Default 1 MiB; capped by each transport's maxChunkBytes. */
  chunkBytes?: number;
  /** Deadline for a transfer when the call gives none. Default 30 s. */
  defaultTimeoutMs?: number;
  /** Deadline for a connection handshake. Default 10 s. */
  connectTimeoutMs?: number;
  /** Most ranges one {@link TransferEngine.grant} may cover. Default 65,536. */
  maxGrantRanges?: number;
  /** Metrics options, or false to disable. */
  metrics?: MetricsOptions | false;
  logger?: Logger;
}

export interface TransferRequest {
  /** A registration of this engine. */
  local: Registration;
  localOffset?: number;
  /** The peer's exported descriptor (bytes from `registration.descriptor` or `grant.descriptor`) or its decoded form. */
  remote: Uint8Array | MemoryDescriptor;
  /** For a range grant: which granted range (default 0); `remoteOffset` is inside it. */
  range?: number;
  remoteOffset?: number;
  /** Bytes to move. Default: what is left of the local registration after `localOffset`. */
  length?: number;
}

export interface InvalidateOptions {
  /**
   * Drop only the connections to this incarnation of the node (one that ended, as a
   * discovery reports it), leaving those to any other, such as its successor, alone.
   */
  incarnation?: string;
}

export interface TransferOptions {
  signal?: AbortSignal;
  /** Relative deadline. Default: the engine's defaultTimeoutMs. */
  timeoutMs?: number;
  /** Absolute deadline (Date.now() ms); the earlier of this and timeoutMs wins. */
  deadline?: number;
}

export interface TransferReport {
  readonly transport: string;
  readonly bytes: number;
  /** Pieces of at most the chunk size the transfer was split into. */
  readonly chunks: number;
  /** Requests in the call. */
  readonly requests: number;
  /** Ranges after adjacent requests were merged. */
  readonly ranges: number;
}

export interface PrepareOptions {
  /** The direction every post of the prepared transfer moves bytes in. */
  op: 'read' | 'write';
}

/**
 * A transfer validated, decoded and planned once ({@link TransferEngine.prepare}), to post as
 * many times as the caller likes with {@link PreparedTransfer.run}. Disposable: `close()`
 * waits for posts in flight, and later posts fail with ClosedError.
 */
export class PreparedTransfer {
  readonly transport: string;
  readonly op: 'read' | 'write';
  /** Bytes every post moves. */
  readonly bytes: number;
  /** Requests it was prepared from. */
  readonly requests: number;
  /** Ranges after adjacent requests were merged. */
  readonly ranges: number;
  readonly #post: (self: PreparedTransfer, options: TransferOptions) => Promise<TransferReport>;
  /** Posts in flight, and what close() waits on once they are. */
  #inFlight = 0;
  #drained: Deferred<void> | undefined;
  #closed: Promise<void> | undefined;
  readonly #settled = (): void => {
    if (--this.#inFlight === 0) this.#drained?.resolve();
  };

  /** @internal */
  constructor(
    transport: string,
    op: 'read' | 'write',
    bytes: number,
    requests: number,
    ranges: number,
    post: (self: PreparedTransfer, options: TransferOptions) => Promise<TransferReport>,
  ) {
    this.transport = transport;
    this.op = op;
    this.bytes = bytes;
    this.requests = requests;
    this.ranges = ranges;
    this.#post = post;
  }

  get closed(): boolean {
    return this.#closed !== undefined;
  }

  /** Post the transfer once. Same options and errors as {@link TransferEngine.read}. */
  run(options: TransferOptions = {}): Promise<TransferReport> {
    if (this.#closed) return Promise.reject(new ClosedError('prepared transfer was disposed'));
    const p = this.#post(this, options);
    this.#inFlight++;
    p.then(this.#settled, this.#settled);
    return p;
  }

  /** Dispose: later posts fail with ClosedError; resolves once posts in flight settled. Idempotent. */
  close(): Promise<void> {
    if (this.#closed) return this.#closed;
    if (this.#inFlight === 0) this.#closed = Promise.resolve();
    else this.#closed = (this.#drained = deferred<void>()).promise;
    return this.#closed;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

export interface CandidateExplanation {
  readonly transport: string;
  readonly rank: number;
  readonly usable: boolean;
  /** Why it is usable or not. */
  readonly reason: string;
}

export interface Explanation {
  readonly peer: string;
  readonly memoryKind: MemoryKind;
  /** The transport that will be used, or undefined when none can. */
  readonly chosen: string | undefined;
  readonly reason: string;
  /** True when a faster transport this node has could not be used for this peer. */
  readonly slowerPath: boolean;
  /** Every transport considered, fastest first. */
  readonly candidates: readonly CandidateExplanation[];
}

export interface ConnectionInfo {
  readonly peer: NodeIdentity;
  readonly transport: string;
  readonly state: 'connecting' | 'open';
  readonly initiator: string | undefined;
  readonly streams: number;
  readonly inFlight: number;
}

interface RegistrationEntry {
  readonly transport: Transport;
  readonly handle: object;
  readonly payload: Uint8Array;
}

/**
 * Memory registered with the engine. Its `descriptor` can be sent to peers (it carries one
 * payload per transport that registered it, each with its own unguessable grant where the
 * transport scopes grants). `revoke()` ends remote access; idempotent.
 */
export class Registration {
  readonly id: string;
  readonly memory: Memory;
  readonly memoryKind: MemoryKind;
  readonly byteLength: number;
  readonly descriptor: Uint8Array;
  /** Transports that could not register this memory, and why. */
  readonly skipped: ReadonlyMap<string, string>;
  readonly #entries: ReadonlyMap<string, RegistrationEntry>;
  readonly #onRevoke: (r: Registration) => Promise<void>;
  #revoked: Promise<void> | undefined;

  /** @internal */
  constructor(
    id: string,
    memory: Memory,
    descriptor: Uint8Array,
    entries: ReadonlyMap<string, RegistrationEntry>,
    skipped: ReadonlyMap<string, string>,
    onRevoke: (r: Registration) => Promise<void>,
  ) {
    this.id = id;
    this.memory = memory;
    this.memoryKind = memory.kind;
    this.byteLength = memoryByteLength(memory);
    this.descriptor = descriptor;
    this.#entries = entries;
    this.skipped = skipped;
    this.#onRevoke = onRevoke;
  }
  get revoked(): boolean {
    return this.#revoked !== undefined;
  }
  get transports(): readonly string[] {
    return [...this.#entries.keys()];
  }
  /** @internal */
  handleFor(transport: string): object | undefined {
    return this.#entries.get(transport)?.handle;
  }
  /** Revoke every transport's grant; resolves once no transport can touch the memory. */
  revoke(): Promise<void> {
    if (this.#revoked) return this.#revoked;
    // Range grants over this registration go first: nothing may reach it through them after.
    this.#revoked = this.#onRevoke(this).then(() => Promise.allSettled([...this.#entries.values()].map((e) => e.transport.revoke(e.handle)))).then(() => undefined);
    return this.#revoked;
  }
  [Symbol.asyncDispose](): Promise<void> {
    return this.revoke();
  }
}

/**
 * Whether a failed post may run again on a fresh connection: the connection was retired in an
 * orderly way under it (GOAWAY, the idle rule, a simultaneous open settled: it was no longer
 * open when the streams settled) and refused work only with SessionInvalidatedError, and the
 * caller still has time. A session that dies on an open connection is not retried: its
 * SessionInvalidatedError reaches the caller (invariant 4). Every stream has
 * quiesced before the post rejects, and a read or write of the same ranges again is
 * idempotent, so the caller never sees the retirement. At most two retries.
 */
function retiredUnderUs(e: unknown, conn: TransportConnection, attempt: number, signal: AbortSignal, deadline: number): boolean {
  return e instanceof SessionInvalidatedError && retiredUnder.has(e) && attempt < 2 && !conn.isOpen && !signal.aborted && Date.now() < deadline;
}

/** Errors of posts whose connection retired under them (see {@link retiredUnderUs}). */
const retiredUnder = new WeakSet<TensorwireError>();

/** Revoke the transports' grants of one engine grant; never rejects. */
function revokeGrantEntries(entries: Iterable<RegistrationEntry>): Promise<PromiseSettledResult<void>[]> {
  return Promise.allSettled([...entries].map((e) => (e.transport.revokeGrant as (h: object) => Promise<void>).call(e.transport, e.handle)));
}

/** A range of a registration, for {@link TransferEngine.grant}. */
export interface GrantRange {
  registration: Registration;
  /** Default 0. */
  offset?: number;
  /** Default: the rest of the registration after `offset`. */
  length?: number;
}

/**
 * What {@link TransferEngine.grant} takes: a list of ranges, blocks of one registration by index
 * ({@link GrantBlocksSpec}), or ranges as typed arrays
 * (`ranges` holds `GRANT_STRIDE` numbers per range: index into `registrations`, offset,
 * length), which costs no object per range. The engine keeps a private copy of `ranges`,
 * made before `grant()` returns its promise (so the caller may refill the same array for the
 * next grant at once; the copies are pooled and reused after revocation); with `transfer: true` it takes the array's ArrayBuffer instead (detached, as a transfer list
 * of `postMessage` does: no copy however many ranges), when `ranges` spans a whole, non-shared
 * ArrayBuffer; otherwise it copies as usual. Do not use `ranges` after a call with `transfer`.
 */
export type GrantSpec =
  | readonly GrantRange[]
  | { readonly registrations: readonly Registration[]; readonly ranges: Float64Array; readonly transfer?: boolean }
  | GrantBlocksSpec;

/**
 * A block grant: blocks of one size in one registration (a KV arena, a pool of equal slots),
 * named by index. Range `k` of the grant is block `blocks[k]`, the bytes
 * `[base + blocks[k] × blockBytes, + blockBytes)` of `registration`. Every block must fit the
 * registration and none may be listed twice. Four bytes per range and no offset arithmetic to
 * check: a grant over 10,000 blocks costs little more than one over 10. The engine keeps a
 * private copy of `blocks` (or takes its ArrayBuffer with `transfer: true`, as for ranges).
 */
export interface GrantBlocksSpec {
  readonly registration: Registration;
  /** Bytes per block: a positive integer. */
  readonly blockBytes: number;
  /** Block indices, 1 to `maxGrantRanges` of them. */
  readonly blocks: Uint32Array;
  /** Where block 0 starts in the registration (default 0). */
  readonly base?: number;
  readonly transfer?: boolean;
}

/**
 * A range grant: one capability over ranges of registered memory. Its `descriptor` is one
 * token per transport plus the range lengths (run-length encoded), whatever the number of
 * ranges. A peer reads range `k` with `{ remote: grant.descriptor, range: k, remoteOffset,
 * length }`. `revoke()` ends access through it (O(1) in its ranges) and resolves once no
 * transport still uses it; idempotent. Revoking a registration revokes its grants first.
 */
export class Grant {
  readonly id: string;
  readonly memoryKind: MemoryKind;
  /** Sum of the ranges. */
  readonly byteLength: number;
  readonly rangeCount: number;
  readonly descriptor: Uint8Array;
  /** Transports that could not grant these ranges, and why. */
  readonly skipped: ReadonlyMap<string, string>;
  readonly #entries: ReadonlyMap<string, RegistrationEntry>;
  readonly #onRevoke: (g: Grant) => void;
  /** Hands the engine's copy of the ranges back once no transport can use it. */
  readonly #recycle: (() => void) | undefined;
  #revoked: Promise<void> | undefined;

  /** @internal */
  constructor(
    id: string,
    memoryKind: MemoryKind,
    byteLength: number,
    rangeCount: number,
    descriptor: Uint8Array,
    entries: ReadonlyMap<string, RegistrationEntry>,
    skipped: ReadonlyMap<string, string>,
    onRevoke: (g: Grant) => void,
    recycle?: () => void,
  ) {
    this.id = id;
    this.memoryKind = memoryKind;
    this.byteLength = byteLength;
    this.rangeCount = rangeCount;
    this.descriptor = descriptor;
    this.#entries = entries;
    this.skipped = skipped;
    this.#onRevoke = onRevoke;
    this.#recycle = recycle;
  }
  get revoked(): boolean {
    return this.#revoked !== undefined;
  }
  get transports(): readonly string[] {
    return [...this.#entries.keys()];
  }
  revoke(): Promise<void> {
    if (this.#revoked) return this.#revoked;
    this.#onRevoke(this);
    const recycle = this.#recycle;
    this.#revoked = revokeGrantEntries(this.#entries.values()).then((settled) => {
      // Every transport let go of the range table (a failed revoke may not have): it can be reused.
      if (recycle !== undefined && settled.every((r) => r.status === 'fulfilled')) recycle();
    });
    return this.#revoked;
  }
  [Symbol.asyncDispose](): Promise<void> {
    return this.revoke();
  }
}

/** One entry of the connection table: the engine's state for one peer on one transport. */
class PeerConnection {
  readonly key: string;
  readonly peer: NodeIdentity;
  readonly transport: Transport;
  readonly ready: Deferred<TransportConnection>;
  conn: TransportConnection | undefined;
  /** Round-robin cursor over the connection's streams; belongs to this connection only. */
  nextStream = 0;
  inFlight = 0;
  /** Set when this connection was torn down by an error (prepared transfers on it are invalid). */
  brokenBy: TensorwireError | undefined;
  /** The engine's metric tallies for posts on this entry, by direction (looked up on first use). */
  hotRead: PostTally | undefined;
  hotWrite: PostTally | undefined;
  constructor(key: string, peer: NodeIdentity, transport: Transport) {
    this.key = key;
    this.peer = peer;
    this.transport = transport;
    this.ready = deferred<TransportConnection>();
  }
}

/** What a grant's spec became before any await: its registrations and the engine's private copy. */
interface GrantCopy {
  readonly regs: readonly Registration[];
  readonly count: number;
  /** A range grant's ranges (GRANT_STRIDE numbers each). */
  readonly ranges: Float64Array | undefined;
  /** A block grant's blocks. */
  readonly blocks: GrantBlocks | undefined;
  /** The grant was not made: hand the copy back at once. */
  readonly unused: () => void;
  /** Hand the copy back once every transport let go of it (undefined: not pooled). */
  readonly recycle: (() => void) | undefined;
}

function noop(): void {}

/** A request list validated and decoded once: what every post of it needs. */
interface Plan {
  readonly op: 'read' | 'write';
  readonly ep: PeerEndpoint;
  readonly transport: Transport;
  readonly locals: readonly object[];
  readonly remotes: readonly unknown[];
  /** The local registrations behind `locals`, and the first request using each. */
  readonly localRegs: readonly Registration[];
  readonly localFirst: readonly number[];
  /** Merged ranges (RANGE_STRIDE layout, lengths not yet chunked). */
  readonly ranges: Float64Array;
  readonly count: number;
  readonly bytes: number;
  readonly requests: number;
}

/** A plan split for one connection. */
interface Split {
  readonly conn: TransportConnection;
  readonly batches: readonly (TransferBatch | undefined)[];
  readonly chunks: number;
  /** The one stream with work when only one has (the common small post), else -1. */
  readonly only: number;
}

const EMPTY_LENGTHS = new Float64Array(0);
/** A group array of zeros (one destination region), shared and grown as needed. */
let zeroGroups = new Uint32Array(1024);
function ZERO_GROUPS(n: number): Uint32Array {
  if (zeroGroups.length < n) zeroGroups = new Uint32Array(Math.max(n, zeroGroups.length * 2));
  return zeroGroups;
}

/** Check a request's numeric field fast: a safe integer >= min. */
function requestInt(value: unknown, i: number, field: string, min: number): number {
  if (typeof value === 'number' && Number.isSafeInteger(value) && value >= min) return value;
  throw new InvalidInputError(`requests[${i}].${field} must be an integer >= ${min}, got ${String(value)}`, { details: { field, request: i } });
}

/** The same error with the request index added to its details (and message). */
function withRequest(e: TensorwireError, i: number, prefix: string): TensorwireError {
  if (e.details['request'] !== undefined) return e;
  const Ctor = e.constructor as new (message: string, options?: { cause?: unknown; details?: Record<string, unknown> }) => TensorwireError;
  return new Ctor(`${prefix}${e.message}`, { cause: e, details: { ...e.details, request: i } });
}

/**
 * The caller's ranges, taken over (their ArrayBuffer detached from the caller's view), when
 * they span a whole ArrayBuffer that can be transferred; otherwise undefined (then copied).
 */
function takeRanges<T extends Float64Array | Uint32Array>(ranges: T): T | undefined {
  const ab = ranges.buffer;
  if (!(ab instanceof ArrayBuffer) || ranges.byteOffset !== 0 || ranges.byteLength !== ab.byteLength) return undefined;
  try {
    const taken = structuredClone(ab, { transfer: [ab] });
    return (ranges instanceof Uint32Array ? new Uint32Array(taken) : new Float64Array(taken)) as T;
  } catch {
    return undefined; // not transferable (Node's Buffer pool, for one)
  }
}

/** A block grant spec checked for shape (the indices are checked by the engine, on its copy). */
interface NormalizedBlocks {
  readonly reg: Registration;
  readonly blockBytes: number;
  readonly base: number;
  readonly blocks: Uint32Array;
  readonly count: number;
  /** `blocks` is the engine's already (taken over with `transfer`). */
  readonly owned: boolean;
}

function isBlocksSpec(spec: GrantSpec): spec is GrantBlocksSpec {
  return !Array.isArray(spec) && typeof spec === 'object' && spec !== null && 'blocks' in spec;
}

function normalizeBlocksSpec(spec: GrantBlocksSpec, max: number): NormalizedBlocks {
  const { registration: reg, blockBytes, blocks } = spec;
  const base = spec.base ?? 0;
  if (!(reg instanceof Registration)) throw new InvalidInputError('a block grant needs registration: a Registration of this engine', { details: { field: 'registration' } });
  if (!(blocks instanceof Uint32Array)) throw new InvalidInputError('a block grant needs blocks: a Uint32Array of block indices', { details: { field: 'blocks' } });
  if (!Number.isSafeInteger(blockBytes) || blockBytes < 1) throw new InvalidInputError(`blockBytes must be a positive integer, got ${String(blockBytes)}`, { details: { field: 'blockBytes' } });
  if (!Number.isSafeInteger(base) || base < 0) throw new InvalidInputError(`base must be an integer >= 0, got ${String(base)}`, { details: { field: 'base' } });
  const count = blocks.length;
  if (count === 0 || count > max) throw new InvalidInputError(`a grant covers 1 to ${max} ranges, got ${count}`, { details: { field: 'blocks' } });
  const taken = spec.transfer === true ? takeRanges(blocks) : undefined;
  return { reg, blockBytes, base, blocks: taken ?? blocks, count, owned: taken !== undefined };
}

/**
 * A grant spec as typed arrays, checked for shape (bounds are checked by the engine). `owned`
 * says whether `ranges` is the engine's already (built here from a list) or the caller's
 * (the engine copies it in its checking pass).
 */
function normalizeGrantSpec(spec: GrantSpec, max: number): { regs: readonly Registration[]; ranges: Float64Array; count: number; owned: boolean } {
  if (Array.isArray(spec)) {
    const list = spec as readonly GrantRange[];
    if (list.length === 0 || list.length > max) throw new InvalidInputError(`a grant covers 1 to ${max} ranges, got ${list.length}`, { details: { field: 'ranges' } });
    const regs: Registration[] = [];
    const index = new Map<Registration, number>();
    const ranges = new Float64Array(list.length * GRANT_STRIDE);
    for (let i = 0; i < list.length; i++) {
      const r = list[i] as GrantRange;
      const reg = (r as GrantRange | undefined)?.registration;
      if (!(reg instanceof Registration)) throw new InvalidInputError(`ranges[${i}].registration must be a Registration of this engine`, { details: { field: 'ranges', range: i } });
      let k = index.get(reg);
      if (k === undefined) index.set(reg, (k = regs.push(reg) - 1));
      const offset = r.offset ?? 0;
      const at = i * GRANT_STRIDE;
      ranges[at + GrantField.Handle] = k;
      ranges[at + GrantField.Offset] = typeof offset === 'number' ? offset : Number.NaN;
      const length = r.length ?? reg.byteLength - (typeof offset === 'number' ? offset : 0);
      ranges[at + GrantField.Length] = typeof length === 'number' ? length : Number.NaN;
    }
    return { regs, ranges, count: list.length, owned: true };
  }
  const s = spec as { registrations?: unknown; ranges?: unknown };
  if (typeof s !== 'object' || s === null || !Array.isArray(s.registrations) || !(s.ranges instanceof Float64Array)) {
    throw new InvalidInputError('a grant needs a list of ranges, or { registrations, ranges: Float64Array }', { details: { field: 'ranges' } });
  }
  // A private copy: the caller may reuse its arrays. Each registration once, so that ranges
  // of one registration can be checked against each other (overlap) by index.
  const regs = [...(s.registrations as readonly unknown[])];
  const seen = new Set<unknown>();
  for (const [k, r] of regs.entries()) {
    if (!(r instanceof Registration)) throw new InvalidInputError(`registrations[${k}] must be a Registration`, { details: { field: 'registrations' } });
    if (seen.has(r)) throw new InvalidInputError(`registrations[${k}] (${r.id}) is listed twice`, { details: { field: 'registrations' } });
    seen.add(r);
  }
  if (s.ranges.length % GRANT_STRIDE !== 0) throw new InvalidInputError(`ranges must hold ${GRANT_STRIDE} numbers per range`, { details: { field: 'ranges' } });
  const count = s.ranges.length / GRANT_STRIDE;
  if (count === 0 || count > max) throw new InvalidInputError(`a grant covers 1 to ${max} ranges, got ${count}`, { details: { field: 'ranges' } });
  const taken = (s as { transfer?: unknown }).transfer === true ? takeRanges(s.ranges) : undefined;
  if (taken) return { regs: regs as readonly Registration[], ranges: taken, count, owned: true };
  // The ranges are copied by the engine's checking pass (transports keep the copy).
  return { regs: regs as readonly Registration[], ranges: s.ranges, count, owned: false };
}


const DEFAULT_CHUNK = 1024 * 1024;
const MAX_TIMER_MS = 0x7fffffff;

/**
 * The deadline and abort state of one call in flight: the AbortSignal its transports see
 * (fires on the caller's abort, the deadline or engine close), its place in the engine's
 * deadline heap, and itself as the listener on the caller's signal (no closure per call).
 */
class Deadline {
  ac: AbortController;
  deadline = 0;
  started = 0;
  user: AbortSignal | undefined = undefined;
  /** Position in the engine's deadline heap; -1 when not in it. */
  index = -1;
  constructor(ac: AbortController) {
    this.ac = ac;
  }
  get signal(): AbortSignal {
    return this.ac.signal;
  }
  expire(): void {
    this.ac.abort(new TimedOutError(`deadline passed (${Math.max(0, Math.round(this.deadline - this.started))} ms after the call)`));
  }
  /** The caller's signal fired. */
  handleEvent(): void {
    this.ac.abort(errorFromSignal(this.user as AbortSignal, 'transfer'));
  }
}

/** Idle Deadline records kept for reuse (their signals never fired and have no listeners). */
const DEADLINE_POOL = 64;

/**
 * Every call's deadline on one timer: a binary min-heap of the calls in flight by deadline,
 * and one Node timer armed for the earliest. A call that ends is taken out of the heap
 * (O(log n)); the timer is left armed (Node timers are costly to create and clear) but
 * unreferenced once no call is in flight, so it never keeps the process alive for nothing;
 * when it fires it expires what is due and re-arms for the next deadline, or ends when
 * nothing is in flight. `close()` clears it.
 */
class DeadlineHeap {
  readonly #heap: Deadline[] = [];
  readonly #pool: Deadline[] = [];
  #timer: NodeJS.Timeout | undefined;
  /** When the armed timer fires (Date.now() ms); +Infinity when none is armed. */
  #timerAt = Number.POSITIVE_INFINITY;
  readonly #onTimer = (): void => this.#fire();

  /** Calls in flight (not yet expired). */
  get size(): number {
    return this.#heap.length;
  }
  /** Whether an engine timer exists (armed, referenced only while calls are in flight). */
  get timerArmed(): boolean {
    return this.#timer !== undefined;
  }
  /** Idle records ready for reuse. */
  get pooled(): number {
    return this.#pool.length;
  }

  begin(deadline: number, now: number, user: AbortSignal | undefined): Deadline {
    const d = this.#pool.pop() ?? new Deadline(new AbortController());
    d.deadline = deadline;
    d.started = now;
    if (deadline <= now) d.expire();
    else this.#push(d, now);
    if (user) {
      d.user = user;
      if (user.aborted) d.handleEvent();
      else user.addEventListener('abort', d, { once: true });
    }
    return d;
  }

  end(d: Deadline): void {
    if (d.index >= 0) this.#remove(d.index);
    const user = d.user;
    if (user) {
      user.removeEventListener('abort', d);
      d.user = undefined;
    }
    if (this.#heap.length === 0) this.#timer?.unref();
    // Reuse the record and its AbortController only when nothing can tell: its signal never
    // fired and no listener (the engine's or a transport's) is left on it.
    const signal = d.ac.signal;
    if (!signal.aborted && getEventListeners(signal, 'abort').length === 0 && this.#pool.length < DEADLINE_POOL) this.#pool.push(d);
  }

  /** Abort every call in flight with `reason` and drop the timer. */
  abortAll(reason: TensorwireError): void {
    for (const d of this.#heap.splice(0)) {
      d.index = -1;
      d.ac.abort(reason);
    }
    this.#clearTimer();
  }

  #clearTimer(): void {
    if (this.#timer) clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#timerAt = Number.POSITIVE_INFINITY;
  }

  #arm(now: number): void {
    const first = this.#heap[0];
    if (!first) {
      this.#clearTimer();
      return;
    }
    if (this.#timer && this.#timerAt <= first.deadline) {
      // Armed early enough already (it re-arms when it fires).
      this.#timer.ref();
      return;
    }
    if (this.#timer) clearTimeout(this.#timer);
    // setTimeout holds at most 2^31-1 ms: a longer deadline re-arms when this one fires.
    const ms = Math.min(first.deadline - now, MAX_TIMER_MS);
    this.#timer = setTimeout(this.#onTimer, ms);
    this.#timerAt = now + ms;
  }

  #fire(): void {
    this.#timer = undefined;
    this.#timerAt = Number.POSITIVE_INFINITY;
    const now = Date.now();
    // Earliest first: calls time out in deadline order.
    for (let d = this.#heap[0]; d !== undefined && d.deadline <= now; d = this.#heap[0]) {
      this.#remove(0);
      d.expire();
    }
    this.#arm(now);
  }

  #push(d: Deadline, now: number): void {
    const heap = this.#heap;
    d.index = heap.length;
    heap.push(d);
    this.#up(d.index);
    if (heap[0] === d || this.#timer === undefined || heap.length === 1) this.#arm(now);
  }

  #remove(i: number): void {
    const heap = this.#heap;
    const d = heap[i] as Deadline;
    const last = heap.pop() as Deadline;
    d.index = -1;
    if (last !== d) {
      heap[i] = last;
      last.index = i;
      this.#up(i);
      this.#down(last.index);
    }
  }

  #up(i: number): void {
    const heap = this.#heap;
    const d = heap[i] as Deadline;
    while (i > 0) {
      const p = (i - 1) >> 1;
      const parent = heap[p] as Deadline;
      if (parent.deadline <= d.deadline) break;
      heap[i] = parent;
      parent.index = i;
      i = p;
    }
    heap[i] = d;
    d.index = i;
  }

  #down(i: number): void {
    const heap = this.#heap;
    const n = heap.length;
    const d = heap[i] as Deadline;
    for (;;) {
      const l = 2 * i + 1;
      if (l >= n) break;
      const r = l + 1;
      const c = r < n && (heap[r] as Deadline).deadline < (heap[l] as Deadline).deadline ? r : l;
      const child = heap[c] as Deadline;
      if (child.deadline >= d.deadline) break;
      heap[i] = child;
      child.index = i;
      i = c;
    }
    heap[i] = d;
    d.index = i;
  }
}

function connectionKey(peer: NodeIdentity, transport: string): string {
  // Neither a nodeId nor an incarnation (a token) can contain '/', so the key is unambiguous.
  return `${peer.nodeId}/${peer.incarnation}/${transport}`;
}

function checkInteger(value: unknown, field: string, min: number): number {
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < min) {
    throw new InvalidInputError(`${field} must be an integer >= ${min}, got ${String(value)}`, { details: { field } });
  }
  return value;
}

export class TransferEngine {
  readonly identity: NodeIdentity;
  readonly metrics: EngineMetrics | undefined;
  readonly streamsPerPeer: number;
  readonly chunkBytes: number;
  readonly defaultTimeoutMs: number;
  readonly connectTimeoutMs: number;
  readonly maxGrantRanges: number;
  readonly #transports = new Map<string, Transport>();
  /** Live range grants, and the grants over each registration (revoked with it). */
  readonly #grants = new Set<Grant>();
  /** Free copies of grants' range tables, reused by later grants (grant-check.ts). */
  readonly #rangePool = new RangePool();
  /** Free copies of block grants' indices. */
  readonly #blockPool = new RangePool<Uint32Array>({ make: (n) => new Uint32Array(n) });
  readonly #grantsOf = new Map<Registration, Set<Grant>>();
  readonly #logger: Logger;
  /**
   * The connection table, keyed by the peer's whole identity: node, incarnation and transport
   * (invariant 1). Each incarnation of a node is its own peer: a read goes to the incarnation
   * its endpoint names, whose handshake proves it, so the bytes always come from the process
   * that issued the descriptor. A new incarnation's connection is opened beside the old one's
   * and disturbs nothing; the old one ends when its process goes away (closed, idle), or, for
   * connections the node opened, when it dials in as another incarnation (#inbound).
   */
  readonly #table = new Map<string, PeerConnection>();
  readonly #registrations = new IdRegistry<Registration, 'block'>('block');
  readonly #ids: IdAllocator;
  readonly #inflight = new Set<AbortController>();
  readonly #warned = new Set<string>();
  #started: Promise<void> | undefined;
  #closed: Promise<void> | undefined;
  #endpoint: Uint8Array | undefined;

  constructor(options: TransferEngineOptions) {
    assertOwner(options.nodeId);
    if (!Array.isArray(options.transports) || options.transports.length === 0) {
      throw new InvalidInputError('at least one transport is required', { details: { field: 'transports' } });
    }
    for (const t of options.transports) {
      if (t.specificationVersion !== TRANSPORT_SPECIFICATION_VERSION) {
        throw new InvalidInputError(
          `transport ${t.name} implements specification ${String(t.specificationVersion)}, this engine speaks ${TRANSPORT_SPECIFICATION_VERSION}`,
          { details: { field: 'transports' } },
        );
      }
      if (this.#transports.has(t.name)) throw new InvalidInputError(`transport ${t.name} given twice`, { details: { field: 'transports' } });
      this.#transports.set(t.name, t);
    }
    this.streamsPerPeer = checkInteger(options.streamsPerPeer ?? 2, 'streamsPerPeer', 1);
    this.chunkBytes = checkInteger(options.chunkBytes ?? DEFAULT_CHUNK, 'chunkBytes', 1);
    this.defaultTimeoutMs = checkInteger(options.defaultTimeoutMs ?? 30_000, 'defaultTimeoutMs', 1);
    this.connectTimeoutMs = checkInteger(options.connectTimeoutMs ?? 10_000, 'connectTimeoutMs', 1);
    this.maxGrantRanges = checkInteger(options.maxGrantRanges ?? 65_536, 'maxGrantRanges', 1);
    if (this.maxGrantRanges > MAX_GRANT_RANGES) throw new InvalidInputError(`maxGrantRanges must be at most ${MAX_GRANT_RANGES}`, { details: { field: 'maxGrantRanges' } });
    if (this.connectTimeoutMs > MAX_TIMER_MS) throw new InvalidInputError(`connectTimeoutMs must be at most ${MAX_TIMER_MS}`, { details: { field: 'connectTimeoutMs' } });
    const incarnation = options.incarnation ?? randomBytes(12).toString('base64url');
    const hostId = options.hostId ?? defaultHostId();
    this.identity = Object.freeze({ nodeId: options.nodeId, incarnation, hostId });
    this.#ids = new IdAllocator(options.nodeId);
    this.#logger = options.logger ?? consoleLogger();
    this.metrics = options.metrics === false ? undefined : new EngineMetrics(options.metrics ?? {});
  }

  get transports(): readonly Transport[] {
    return [...this.#transports.values()];
  }

  get closed(): boolean {
    return this.#closed !== undefined;
  }

  /** Start every transport (listen, open devices). Idempotent. */
  start(): Promise<void> {
    this.#started ??= this.#start();
    return this.#started;
  }

  async #start(): Promise<void> {
    this.#assertOpen();
    const host = (t: Transport): TransportHost => ({
      identity: this.identity,
      logger: this.#logger,
      inbound: (conn) => this.#inbound(t, conn),
    });
    const started: Transport[] = [];
    try {
      for (const t of this.#transports.values()) {
        await t.start(host(t));
        started.push(t);
      }
    } catch (e) {
      await Promise.allSettled(started.map((t) => t.close()));
      throw toTensorwireError(e, BackendUnavailableError);
    }
    const blobs = new Map<string, Uint8Array>();
    for (const t of this.#transports.values()) blobs.set(t.name, t.endpoint());
    this.#endpoint = encodeEndpoint({ identity: this.identity, transports: blobs });
    this.#logger.info('engine started', { nodeId: this.identity.nodeId, transports: [...blobs.keys()] });
  }

  /** This node's endpoint blob: give it to peers (any channel) so they can connect. */
  endpoint(): Uint8Array {
    if (!this.#endpoint) throw new ClosedError('engine not started: call start() first');
    return this.#endpoint;
  }

  /** Register memory with every transport that supports its kind (or the ones named). */
  async register(memory: Memory, options: { transports?: readonly string[] } = {}): Promise<Registration> {
    this.#assertOpen();
    await this.start();
    // close() may have run while start() was awaited (a first call racing close()).
    this.#assertOpen();
    this.#validateMemory(memory);
    const wanted = options.transports ?? [...this.#transports.keys()];
    const entries = new Map<string, RegistrationEntry>();
    const skipped = new Map<string, string>();
    for (const name of wanted) {
      const t = this.#transports.get(name);
      if (!t) throw new InvalidInputError(`transport ${JSON.stringify(name)} is not registered with this engine`, { details: { field: 'transports' } });
      if (!t.capabilities.memoryKinds.includes(memory.kind)) {
        skipped.set(name, `does not support ${memory.kind} memory`);
        continue;
      }
      try {
        const r = await t.register(memory);
        if (!(r.payload instanceof Uint8Array) || typeof r.handle !== 'object' || r.handle === null) {
          throw new InvalidInputError(`transport ${name} returned a malformed registration`);
        }
        entries.set(name, { transport: t, handle: r.handle, payload: r.payload });
      } catch (e) {
        if (options.transports) {
          await Promise.allSettled([...entries.values()].map((x) => x.transport.revoke(x.handle)));
          throw toTensorwireError(e, InvalidInputError);
        }
        skipped.set(name, e instanceof Error ? e.message : String(e));
      }
    }
    if (entries.size === 0) {
      throw new InvalidInputError(`no transport could register this ${memory.kind} memory: ${[...skipped].map(([n, r]) => `${n}: ${r}`).join('; ')}`, {
        details: { field: 'memory' },
      });
    }
    const id = this.#ids.next('block');
    const payloads = new Map<string, Uint8Array>();
    for (const [name, e] of entries) payloads.set(name, e.payload);
    const descriptor = encodeDescriptor({
      owner: { nodeId: this.identity.nodeId, incarnation: this.identity.incarnation },
      registrationId: id,
      memoryKind: memory.kind,
      byteLength: memoryByteLength(memory),
      transports: payloads,
    });
    const reg = new Registration(id, memory, descriptor, entries, skipped, (r) => {
      this.#registrations.delete(r.id);
      const dependent = this.#grantsOf.get(r);
      this.#grantsOf.delete(r);
      return dependent ? Promise.allSettled([...dependent].map((g) => g.revoke())).then(() => undefined) : Promise.resolve();
    });
    this.#registrations.set(id, reg);
    return reg;
  }

  /** Live range grants made by {@link TransferEngine.grant}. */
  get liveGrants(): number {
    return this.#grants.size;
  }

  /**
   * Grant access to ranges of registered memory as one capability: one token per transport
   * covers all the ranges, the descriptor carries their lengths compactly, and `revoke()` is
   * O(1) in the number of ranges. Registrations stay registered; grant per lease. Ranges must
   * lie inside their registrations, be non-empty, not overlap, and all be of one memory kind.
   * Memory laid out as blocks of one size is granted cheapest by index ({@link GrantBlocksSpec}):
   * four bytes and one compare per block, so 10,000 blocks cost about what 10 do.
   * By default every transport that registered all the memory and supports range grants
   * grants it; `transports` names them (then each must succeed).
   */
  async grant(spec: GrantSpec, options: { transports?: readonly string[] } = {}): Promise<Grant> {
    this.#assertOpen();
    // The shape and the engine's private copy first, before anything awaits: the caller may
    // reuse its arrays as soon as grant() has returned its promise.
    const made = isBlocksSpec(spec) ? this.#copyBlocks(spec) : this.#copyRanges(spec);
    const { regs, count } = made;
    try {
      await this.start();
    } catch (e) {
      made.unused();
      throw e;
    }
    let kind: MemoryKind | undefined;
    let bytes: number;
    let runs: number[];
    try {
      for (let k = 0; k < regs.length; k++) {
        const reg = regs[k] as Registration;
        if (reg.revoked || this.#registrations.get(reg.id) !== reg) {
          throw new InvalidInputError(`registrations[${k}] (${reg.id}) is revoked or not registered with this engine`, { details: { field: 'registration', registration: k } });
        }
        if (kind !== undefined && reg.memoryKind !== kind) throw new InvalidInputError('a grant covers memory of one kind', { details: { field: 'registration', registration: k } });
        kind = reg.memoryKind;
      }
      if (made.blocks !== undefined) {
        const { blockBytes, base } = made.blocks;
        const length = (regs[0] as Registration).byteLength;
        const nBlocks = base < length ? Math.floor((length - base) / blockBytes) : 0;
        if (nBlocks === 0) {
          throw new InvalidInputError(`no block of ${blockBytes} bytes fits the registration (${length} bytes) from base ${base}`, { details: { field: base < length ? 'blockBytes' : 'base' } });
        }
        checkGrantBlocks(made.blocks.indices, count, nBlocks);
        markCheckedBlocks(made.blocks);
        bytes = count * blockBytes;
        runs = [blockBytes, count];
      } else {
        const limits = new Float64Array(regs.length);
        for (let k = 0; k < regs.length; k++) limits[k] = (regs[k] as Registration).byteLength;
        const ranges = made.ranges as Float64Array;
        ({ bytes, runs } = checkGrantRanges(ranges, ranges, count, limits));
      }
    } catch (e) {
      made.unused();
      throw e;
    }
    // What each transport gets. For a block grant the ranges are built from the blocks only if
    // a transport that does not handle blocks reads them (once, then shared by the others).
    const blocks = made.blocks;
    let expanded: Float64Array | undefined;
    const transportSpec = (handles: object[]): GrantRanges => {
      if (blocks === undefined) return Object.freeze({ handles, count, ranges: made.ranges as Float64Array, bytes });
      return Object.freeze({
        handles,
        count,
        bytes,
        blocks,
        get ranges(): Float64Array {
          return (expanded ??= expandGrantBlocks(blocks.indices, count, blocks.base, blocks.blockBytes));
        },
      });
    };
    const wanted = options.transports ?? [...this.#transports.keys()];
    const entries = new Map<string, RegistrationEntry>();
    const skipped = new Map<string, string>();
    const undo = (): Promise<unknown> => revokeGrantEntries(entries.values());
    for (const name of wanted) {
      const t = this.#transports.get(name);
      if (!t) throw new InvalidInputError(`transport ${JSON.stringify(name)} is not registered with this engine`, { details: { field: 'transports' } });
      let why: string | undefined;
      const handles: object[] = [];
      if (typeof t.grant !== 'function' || typeof t.revokeGrant !== 'function') why = 'does not support range grants';
      else {
        for (const reg of regs) {
          const h = reg.handleFor(name);
          if (!h) {
            why = `${reg.id} is not registered with ${name}: ${reg.skipped.get(name) ?? 'not requested'}`;
            break;
          }
          handles.push(h);
        }
      }
      if (why === undefined) {
        try {
          const g = await (t.grant as NonNullable<Transport['grant']>).call(t, transportSpec(handles));
          if (!(g.payload instanceof Uint8Array) || typeof g.handle !== 'object' || g.handle === null) throw new InvalidInputError(`transport ${name} returned a malformed grant`);
          entries.set(name, { transport: t, handle: g.handle, payload: g.payload });
          continue;
        } catch (e) {
          why = e instanceof Error ? e.message : String(e);
          if (options.transports) {
            await undo();
            throw toTensorwireError(e, InvalidInputError);
          }
        }
      }
      if (options.transports) {
        await undo();
        throw new InvalidInputError(`transport ${name} cannot grant these ranges: ${why}`, { details: { field: 'transports' } });
      }
      skipped.set(name, why);
    }
    if (entries.size === 0) {
      throw new InvalidInputError(`no transport could grant these ranges: ${[...skipped].map(([n, r]) => `${n}: ${r}`).join('; ')}`, { details: { field: 'ranges' } });
    }
    // The transports' grant calls may have awaited: a registration revoked or an engine closed
    // meanwhile must not end up with a grant nobody will revoke.
    if (this.#closed || regs.some((reg) => reg.revoked || this.#registrations.get(reg.id) !== reg)) {
      await undo();
      if (this.#closed) throw new ClosedError('engine closed while the grant was being made');
      throw new InvalidInputError('a registration of the grant was revoked while the grant was being made', { details: { field: 'registration' } });
    }
    const id = this.#ids.next('block');
    const payloads = new Map<string, Uint8Array>();
    for (const [name, e] of entries) payloads.set(name, e.payload);
    let descriptor: Uint8Array;
    try {
      descriptor = encodeGrantDescriptor(
        {
          owner: { nodeId: this.identity.nodeId, incarnation: this.identity.incarnation },
          registrationId: id,
          memoryKind: kind as MemoryKind,
          byteLength: bytes,
          transports: payloads,
        },
        count,
        runs,
      );
    } catch (e) {
      await undo();
      throw e;
    }
    const g = new Grant(id, kind as MemoryKind, bytes, count, descriptor, entries, skipped, (x) => {
      this.#grants.delete(x);
      for (const reg of regs) this.#grantsOf.get(reg)?.delete(x);
    }, made.recycle);
    this.#grants.add(g);
    for (const reg of regs) {
      let set = this.#grantsOf.get(reg);
      if (!set) this.#grantsOf.set(reg, (set = new Set()));
      set.add(g);
    }
    return g;
  }

  /** A range grant's registrations and the engine's copy of its ranges (pooled unless built or taken). */
  #copyRanges(spec: GrantSpec): GrantCopy {
    const { regs, ranges: source, count, owned } = normalizeGrantSpec(spec, this.maxGrantRanges);
    const { view, give } = this.#rangePool.privateCopy(source, count * GRANT_STRIDE, owned);
    return { regs, count, ranges: view, blocks: undefined, unused: give ?? noop, recycle: give };
  }

  /** A block grant's registration and the engine's copy of its block indices (pooled unless taken). */
  #copyBlocks(spec: GrantBlocksSpec): GrantCopy {
    const b = normalizeBlocksSpec(spec, this.maxGrantRanges);
    const { view, give } = this.#blockPool.privateCopy(b.blocks, b.count, b.owned);
    return { regs: [b.reg], count: b.count, ranges: undefined, blocks: { base: b.base, blockBytes: b.blockBytes, indices: view }, unused: give ?? noop, recycle: give };
  }

  #validateMemory(memory: Memory): void {
    if (typeof memory !== 'object' || memory === null) throw new InvalidInputError('memory must be an object', { details: { field: 'memory' } });
    if (memory.kind === 'host') {
      if (!(memory.buffer instanceof Uint8Array)) throw new InvalidInputError('host memory needs a Uint8Array buffer', { details: { field: 'memory.buffer' } });
      if (memory.buffer.byteLength === 0) throw new InvalidInputError('cannot register 0 bytes', { details: { field: 'memory.buffer' } });
    } else if (memory.kind === 'cuda') {
      checkInteger(memory.device, 'memory.device', 0);
      checkInteger(memory.byteLength, 'memory.byteLength', 1);
      if (typeof memory.pointer !== 'bigint' || memory.pointer <= 0n) throw new InvalidInputError('cuda memory needs a non-zero bigint pointer', { details: { field: 'memory.pointer' } });
    } else {
      throw new InvalidInputError(`unknown memory kind ${JSON.stringify((memory as { kind: unknown }).kind)}`, { details: { field: 'memory.kind' } });
    }
  }

  /** READ: bytes move from the peer's registered memory into local registrations. */
  read(peer: Uint8Array | PeerEndpoint, requests: readonly TransferRequest[], options: TransferOptions = {}): Promise<TransferReport> {
    return this.#transfer('read', peer, requests, options);
  }

  /** WRITE: bytes move from local registrations into the peer's registered memory. */
  write(peer: Uint8Array | PeerEndpoint, requests: readonly TransferRequest[], options: TransferOptions = {}): Promise<TransferReport> {
    return this.#transfer('write', peer, requests, options);
  }

  /** Which transport this engine would use for `peer` and `memoryKind`, and why. */
  explain(peer: Uint8Array | PeerEndpoint, memoryKind: MemoryKind = 'host'): Explanation {
    return this.#explain(this.#peer(peer), [memoryKind]);
  }

  /** Open (or reuse) the connection to `peer` for `memoryKind` ahead of the first transfer. */
  async connect(peer: Uint8Array | PeerEndpoint, options: TransferOptions & { memoryKind?: MemoryKind } = {}): Promise<ConnectionInfo> {
    this.#assertOpen();
    await this.start();
    // close() may have run while start() was awaited (a first call racing close()).
    this.#assertOpen();
    const ep = this.#peer(peer);
    const ex = this.#explain(ep, [options.memoryKind ?? 'host']);
    if (!ex.chosen) throw new BackendUnavailableError(ex.reason, { details: { peer: ep.identity.nodeId } });
    const t = this.#transports.get(ex.chosen) as Transport;
    const dl = this.#deadlineSignal(options);
    try {
      const pc = await this.#connection(ep, t, dl.signal);
      return this.#info(pc);
    } finally {
      this.#deadlines.end(dl);
    }
  }

  /** The connection table, for diagnostics. */
  connections(): ConnectionInfo[] {
    return [...this.#table.values()].map((pc) => this.#info(pc));
  }

  /**
   * Drop every connection to `nodeId` (all transports; all incarnations, or only
   * `options.incarnation`) in one step each; in-flight work fails with `reason`.
   */
  async invalidate(nodeId: string, reason = 'invalidated by caller', options: InvalidateOptions = {}): Promise<void> {
    const only = options.incarnation;
    this.#choiceCache = new WeakMap();
    const victims = this.#takeEntries((pc) => pc.peer.nodeId === nodeId && (only === undefined || pc.peer.incarnation === only));
    await Promise.allSettled(victims.map((pc) => this.#dispose(pc, new ConnectionBrokenError(reason, { details: { peer: nodeId } }), 'invalidated')));
  }

  /** Close: abort in-flight transfers, close connections and transports, revoke registrations. Idempotent. */
  close(): Promise<void> {
    this.#closed ??= this.#close();
    return this.#closed;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }

  async #close(): Promise<void> {
    for (const ac of this.#inflight) ac.abort(new ClosedError('engine closed'));
    this.#deadlines.abortAll(new ClosedError('engine closed'));
    const entries = [...this.#table.values()];
    this.#table.clear();
    await Promise.allSettled(entries.map((pc) => this.#dispose(pc, new ClosedError('engine closed'), 'closed')));
    await Promise.allSettled([...this.#grants].map((g) => g.revoke()));
    await Promise.allSettled([...this.#registrations.values()].map((r) => r.revoke()));
    await Promise.allSettled([...this.#transports.values()].map((t) => t.close()));
    this.#rangePool.clear();
    this.#blockPool.clear();
    // What the posts tallied goes into the metrics now; a post still finishing is recorded at once.
    this.metrics?.detach();
  }

  #assertOpen(): void {
    if (this.#closed) throw new ClosedError('engine is closed');
  }

  #info(pc: PeerConnection): ConnectionInfo {
    return {
      peer: pc.peer,
      transport: pc.transport.name,
      state: pc.conn ? 'open' : 'connecting',
      initiator: pc.conn?.initiator,
      streams: pc.conn?.streams ?? 0,
      inFlight: pc.inFlight,
    };
  }

  readonly #peerCache = new DecodeCache(decodeEndpoint);
  readonly #descriptorCache = new DecodeCache(decodeDescriptor);
  /**
   * Per endpoint the engine decoded and memory kinds: the transport choice for transfers
   * (transports are fixed at construction, and a changed endpoint blob decodes to a new object).
   */
  #choiceCache = new WeakMap<PeerEndpoint, Map<string, Explanation>>();
  #peer(peer: Uint8Array | PeerEndpoint): PeerEndpoint {
    if (peer instanceof Uint8Array) {
      return this.#peerCache.get(peer);
    }
    if (typeof peer !== 'object' || peer === null || !(peer.transports instanceof Map)) {
      throw new InvalidInputError('peer must be an endpoint blob or a decoded PeerEndpoint', { details: { field: 'peer' } });
    }
    assertOwner(peer.identity?.nodeId);
    return peer;
  }

  /** The transport for a transfer: #explain, remembered per endpoint object and memory kinds. */
  #choice(ep: PeerEndpoint, kinds: ReadonlySet<MemoryKind>): Explanation {
    const key = [...kinds].join('+');
    let byKinds = this.#choiceCache.get(ep);
    if (!byKinds) this.#choiceCache.set(ep, (byKinds = new Map()));
    let ex = byKinds.get(key);
    if (!ex) byKinds.set(key, (ex = this.#explain(ep, [...kinds])));
    return ex;
  }

  #explain(ep: PeerEndpoint, kinds: readonly MemoryKind[]): Explanation {
    const candidates: CandidateExplanation[] = [];
    const sorted = [...this.#transports.values()].sort((a, b) => b.capabilities.rank - a.capabilities.rank);
    for (const t of sorted) {
      const reason = this.#unusable(t, ep, kinds);
      candidates.push({ transport: t.name, rank: t.capabilities.rank, usable: reason === undefined, reason: reason ?? 'usable' });
    }
    const chosen = candidates.find((c) => c.usable);
    const kind = kinds[0] ?? 'host';
    const peerName = ep.identity.nodeId;
    if (!chosen) {
      return {
        peer: peerName,
        memoryKind: kind,
        chosen: undefined,
        reason: `no transport can reach ${peerName} for ${kinds.join('+')} memory: ${candidates.map((c) => `${c.transport}: ${c.reason}`).join('; ')}`,
        slowerPath: false,
        candidates,
      };
    }
    const better = candidates.filter((c) => c.rank > chosen.rank);
    const slowerPath = better.length > 0;
    const sameHost = ep.identity.hostId === this.identity.hostId;
    const reason = slowerPath
      ? `${chosen.transport} chosen for ${kinds.join('+')} memory on ${peerName} (${sameHost ? 'same host' : 'other host'}); faster transports unusable: ${better
          .map((c) => `${c.transport}: ${c.reason}`)
          .join('; ')}`
      : `${chosen.transport} is the fastest transport both sides have for ${kinds.join('+')} memory on ${peerName} (${sameHost ? 'same host' : 'other host'})`;
    return { peer: peerName, memoryKind: kind, chosen: chosen.transport, reason, slowerPath, candidates };
  }

  #unusable(t: Transport, ep: PeerEndpoint, kinds: readonly MemoryKind[]): string | undefined {
    for (const k of kinds) if (!t.capabilities.memoryKinds.includes(k)) return `does not support ${k} memory`;
    const blob = ep.transports.get(t.name);
    if (!blob) return `peer does not offer ${t.name}`;
    const sameHost = ep.identity.hostId === this.identity.hostId;
    if (sameHost && !t.capabilities.local) return 'not usable between processes on one host';
    if (!sameHost && !t.capabilities.remote) return 'works only on the same host; peer is on another host';
    try {
      return t.unreachableReason(ep.identity, blob);
    } catch (e) {
      return `cannot parse peer endpoint: ${e instanceof Error ? e.message : String(e)}`;
    }
  }

  /** Calls in flight by deadline, on one engine timer. */
  readonly #deadlines = new DeadlineHeap();

  /**
   * Start a call's deadline: its signal fires on the caller's abort (AbortedError), the
   * deadline (TimedOutError) or engine close (ClosedError). End it with `#deadlines.end()`.
   */
  #deadlineSignal(options: TransferOptions, defaultMs = this.defaultTimeoutMs): Deadline {
    const timeoutMs = options.timeoutMs ?? defaultMs;
    if (!(typeof timeoutMs === 'number' && timeoutMs > 0 && Number.isFinite(timeoutMs))) {
      throw new InvalidInputError(`timeoutMs must be a positive finite number, got ${String(timeoutMs)}`, { details: { field: 'timeoutMs' } });
    }
    const now = Date.now();
    let deadline = now + timeoutMs;
    if (options.deadline !== undefined) {
      if (typeof options.deadline !== 'number' || !Number.isFinite(options.deadline)) {
        throw new InvalidInputError('deadline must be a finite Date.now() timestamp', { details: { field: 'deadline' } });
      }
      deadline = Math.min(deadline, options.deadline);
    }
    return this.#deadlines.begin(deadline, now, options.signal);
  }

  /** @internal For tests: calls in flight on the deadline heap, whether the engine timer exists, idle records pooled. */
  get deadlineState(): { readonly inFlight: number; readonly timer: boolean; readonly pooled: number } {
    return { inFlight: this.#deadlines.size, timer: this.#deadlines.timerArmed, pooled: this.#deadlines.pooled };
  }

  async #transfer(
    op: 'read' | 'write',
    peerArg: Uint8Array | PeerEndpoint,
    requests: readonly TransferRequest[],
    options: TransferOptions,
  ): Promise<TransferReport> {
    this.#assertOpen();
    // No start() here: every request names a registration of this engine (#plan refuses any
    // other), and register() starts the engine, so an engine with a valid request has started.
    const plan = this.#plan(op, peerArg, requests);
    const dl = this.#deadlineSignal(options);
    const signal = dl.signal;
    const deadline = dl.deadline;
    try {
      for (let attempt = 0; ; attempt++) {
        // The common case, an established connection, without an await (#connection does the rest).
        const known = this.#table.get(connectionKey(plan.ep.identity, plan.transport.name));
        let pc = known?.conn?.isOpen === true && !signal.aborted ? known : await this.#connection(plan.ep, plan.transport, signal);
        if (!pc.conn?.isOpen) pc = await this.#connection(plan.ep, plan.transport, signal); // retired between handshake and use
        const conn = pc.conn as TransportConnection;
        const first = pc.nextStream;
        const split = this.#split(plan, conn, first);
        pc.nextStream = (first + split.chunks) % Math.max(1, conn.streams);
        try {
          return await this.#post(plan, pc, conn, split, signal, deadline);
        } catch (e) {
          if (!retiredUnderUs(e, conn, attempt, signal, deadline)) throw e;
        }
      }
    } finally {
      this.#deadlines.end(dl);
    }
  }

  /**
   * Prepare a transfer to post many times: the requests are validated and decoded once, the
   * transport is chosen once, adjacent requests are merged and the chunk plan is computed
   * once. `run()` posts it. Each post re-checks what can change between posts: a revoked local
   * registration is InvalidInputError; a connection that broke under it (the peer's process
   * went away, it restarted and dialled in as its new incarnation, invalidate()) invalidates
   * the prepared transfer (ConnectionBrokenError, on this post and every later one); a grant
   * the peer revoked is refused by the peer (RemoteRejectedError). A connection retired in
   * order (GOAWAY, idle) is dialled again on the next post, which then fails with the dial's
   * own error if the incarnation is gone. Bytes are never stale.
   */
  async prepare(peer: Uint8Array | PeerEndpoint, requests: readonly TransferRequest[], options: PrepareOptions): Promise<PreparedTransfer> {
    this.#assertOpen();
    await this.start();
    // close() may have run while start() was awaited (a first call racing close()).
    this.#assertOpen();
    const op = options?.op;
    if (op !== 'read' && op !== 'write') throw new InvalidInputError(`options.op must be 'read' or 'write', got ${String(op)}`, { details: { field: 'op' } });
    const plan = this.#plan(op, peer, requests);
    return new PreparedTransfer(plan.transport.name, op, plan.bytes, requests.length, plan.count, (self, o) => this.#runPrepared(self, plan, o));
  }

  #preparedCounter = 0;
  readonly #preparedState = new WeakMap<PreparedTransfer, { pc: PeerConnection | undefined; split: Split | undefined; first: number; broken: TensorwireError | undefined }>();

  async #runPrepared(self: PreparedTransfer, plan: Plan, options: TransferOptions): Promise<TransferReport> {
    this.#assertOpen();
    let state = this.#preparedState.get(self);
    if (!state) this.#preparedState.set(self, (state = { pc: undefined, split: undefined, first: this.#preparedCounter++ % 64, broken: undefined }));
    if (state.broken) throw new ConnectionBrokenError(`prepared transfer is invalidated: ${state.broken.message}`, { cause: state.broken, details: { peer: plan.ep.identity.nodeId } });
    // What can change between posts, checked per distinct registration, not per range.
    for (let i = 0; i < plan.localRegs.length; i++) {
      const reg = plan.localRegs[i] as Registration;
      if (reg.revoked || this.#registrations.get(reg.id) !== reg) {
        throw new InvalidInputError(`requests[${plan.localFirst[i] as number}].local (${reg.id}) was revoked`, { details: { field: 'local', request: plan.localFirst[i] } });
      }
    }
    const old = state.pc;
    if (old?.brokenBy) {
      state.broken = old.brokenBy;
      throw new ConnectionBrokenError(`prepared transfer is invalidated: its connection broke (${old.brokenBy.message})`, { cause: old.brokenBy, details: { peer: plan.ep.identity.nodeId } });
    }
    const dl = this.#deadlineSignal(options);
    const signal = dl.signal;
    const deadline = dl.deadline;
    try {
      // A signal that fired already: nothing is posted (as for a read, whose connection lookup refuses it).
      if (signal.aborted) throw errorFromSignal(signal, `${plan.op} from ${plan.ep.identity.nodeId}`);
      for (let attempt = 0; ; attempt++) {
        const prev = state.pc;
        let pc = prev && this.#table.get(prev.key) === prev && prev.conn?.isOpen === true ? prev : await this.#connection(plan.ep, plan.transport, signal);
        if (!pc.conn?.isOpen) pc = await this.#connection(plan.ep, plan.transport, signal);
        const conn = pc.conn as TransportConnection;
        if (state.pc !== pc || !state.split || state.split.conn !== conn) {
          // First post, or the old connection was retired in an orderly way: plan for this one.
          state.pc = pc;
          state.split = this.#split(plan, conn, state.first);
        }
        try {
          return await this.#post(plan, pc, conn, state.split, signal, deadline);
        } catch (e) {
          if (!retiredUnderUs(e, conn, attempt, signal, deadline)) throw e;
        }
      }
    } catch (e) {
      if (e instanceof TensorwireError && e.breaksConnection && state.pc?.brokenBy) state.broken = state.pc.brokenBy;
      throw e;
    } finally {
      this.#deadlines.end(dl);
    }
  }

  /** Validate and decode a request list once: the transport, tables, merged ranges. */
  #plan(op: 'read' | 'write', peerArg: Uint8Array | PeerEndpoint, requests: readonly TransferRequest[]): Plan {
    const ep = this.#peer(peerArg);
    if (!Array.isArray(requests) || requests.length === 0) {
      throw new InvalidInputError('a transfer needs at least one request', { details: { field: 'requests' } });
    }
    const n = requests.length;
    // One pass over the requests: distinct local registrations and remote descriptors by
    // identity (usually a few per batch, however many requests), numbers and bounds, merged
    // with the previous request where contiguous. No object per request.
    const localRegs: Registration[] = [];
    const localFirst: number[] = [];
    const localIndex = new Map<Registration, number>();
    const descs: MemoryDescriptor[] = [];
    const remoteFirst: number[] = [];
    const remoteIndex = new Map<unknown, number>();
    const remoteLens: Float64Array[] = [];
    let lastLocal: unknown;
    let li = 0;
    let localLength = 0;
    let lastRemote: unknown;
    let ri = 0;
    let lens: Float64Array = EMPTY_LENGTHS;
    const ranges = new Float64Array(n * RANGE_STRIDE);
    let count = 0;
    let bytes = 0;
    for (let i = 0; i < n; i++) {
      const r = requests[i];
      if (typeof r !== 'object' || r === null) throw new InvalidInputError(`requests[${i}] must be an object`, { details: { field: 'requests', request: i } });
      const local = r.local;
      if (local !== lastLocal) {
        let at = localIndex.get(local);
        if (at === undefined) {
          if (!(local instanceof Registration)) throw new InvalidInputError(`requests[${i}].local must be a Registration of this engine`, { details: { field: 'local', request: i } });
          at = localRegs.push(local) - 1;
          localFirst.push(i);
          localIndex.set(local, at);
        }
        lastLocal = local;
        li = at;
        localLength = (localRegs[at] as Registration).byteLength;
      }
      const remote = r.remote;
      if (remote !== lastRemote) {
        let at = remoteIndex.get(remote);
        if (at === undefined) {
          let d: MemoryDescriptor;
          try {
            d = remote instanceof Uint8Array ? this.#descriptorCache.get(remote) : remote;
          } catch (e) {
            throw withRequest(toTensorwireError(e, InvalidInputError), i, `requests[${i}].remote: `);
          }
          if (typeof d !== 'object' || d === null || !(d.transports instanceof Map)) {
            throw new InvalidInputError(`requests[${i}].remote must be a descriptor`, { details: { field: 'remote', request: i } });
          }
          at = descs.push(d) - 1;
          remoteFirst.push(i);
          remoteIndex.set(remote, at);
          remoteLens.push(d.rangeLengths ?? Float64Array.of(d.byteLength));
        }
        lastRemote = remote;
        ri = at;
        lens = remoteLens[at] as Float64Array;
      }
      const lo = r.localOffset;
      const localOffset = lo === undefined ? 0 : typeof lo === 'number' && Number.isSafeInteger(lo) && lo >= 0 ? lo : requestInt(lo, i, 'localOffset', 0);
      const ro = r.remoteOffset;
      const remoteOffset = ro === undefined ? 0 : typeof ro === 'number' && Number.isSafeInteger(ro) && ro >= 0 ? ro : requestInt(ro, i, 'remoteOffset', 0);
      const ln = r.length;
      const length = ln === undefined ? requestInt(localLength - localOffset, i, 'length', 1) : typeof ln === 'number' && Number.isSafeInteger(ln) && ln >= 1 ? ln : requestInt(ln, i, 'length', 1);
      if (localOffset + length > localLength) {
        throw new InvalidInputError(`requests[${i}]: local range ${localOffset}+${length} exceeds registration of ${localLength} bytes`, {
          details: { field: 'localOffset', request: i },
        });
      }
      const rg = r.range;
      const range = rg === undefined ? 0 : requestInt(rg, i, 'range', 0);
      if (range >= lens.length) {
        throw new InvalidInputError(`requests[${i}]: range ${range} does not exist (the remote has ${lens.length})`, { details: { field: 'range', request: i } });
      }
      const rlen = lens[range] as number;
      if (remoteOffset + length > rlen) {
        throw new InvalidInputError(`requests[${i}]: remote range ${remoteOffset}+${length} exceeds ${lens.length > 1 || range > 0 ? `granted range ${range} of ${rlen}` : `registration of ${rlen}`} bytes`, {
          details: { field: 'remoteOffset', request: i },
        });
      }
      bytes += length;
      count = appendMerged(ranges, count, i, li, localOffset, ri, remoteOffset, length, range);
    }
    // The transport for the whole batch, from the memory kinds involved.
    const kinds = new Set<MemoryKind>();
    for (const l of localRegs) kinds.add(l.memoryKind);
    for (const d of descs) kinds.add(d.memoryKind);
    // Endpoints decoded here are the engine's own objects; a caller's PeerEndpoint may change.
    const ex = peerArg instanceof Uint8Array ? this.#choice(ep, kinds) : this.#explain(ep, [...kinds]);
    if (!ex.chosen) throw new BackendUnavailableError(ex.reason, { details: { peer: ep.identity.nodeId } });
    const t = this.#transports.get(ex.chosen) as Transport;
    // Per distinct local and remote: ownership, liveness, the transport's handle / decoded form.
    const locals: object[] = [];
    for (let k = 0; k < localRegs.length; k++) locals.push(this.#localHandle(t, localRegs[k] as Registration, localFirst[k] as number));
    const remotes: unknown[] = [];
    for (let k = 0; k < descs.length; k++) remotes.push(this.#remoteFor(t, ep, descs[k] as MemoryDescriptor, remoteFirst[k] as number));
    // Destinations must not overlap: the bytes of such a batch would depend on ordering.
    // Two descriptor objects may name one registration: group by registration id and range.
    let overlap: [number, number] | undefined;
    if (op === 'read') {
      if (localRegs.length === 1) overlap = findOverlap(ranges, count, 'local', ZERO_GROUPS(count), 1);
      else {
        const groupOf = new Uint32Array(count);
        for (let i = 0; i < count; i++) groupOf[i] = ranges[i * RANGE_STRIDE + RangeField.Local] as number;
        overlap = findOverlap(ranges, count, 'local', groupOf, localRegs.length);
      }
    } else {
      const remoteBase = new Float64Array(descs.length);
      const baseOf = new Map<string, number>();
      let groups = 0;
      for (let k = 0; k < descs.length; k++) {
        const id = (descs[k] as MemoryDescriptor).registrationId;
        let base = baseOf.get(id);
        if (base === undefined) {
          baseOf.set(id, (base = groups));
          groups += (remoteLens[k] as Float64Array).length;
        }
        remoteBase[k] = base;
      }
      const groupOf = new Uint32Array(count);
      for (let i = 0; i < count; i++) {
        const at = i * RANGE_STRIDE;
        groupOf[i] = (remoteBase[ranges[at + RangeField.Remote] as number] as number) + (ranges[at + RangeField.RemoteRange] as number);
      }
      overlap = findOverlap(ranges, count, 'remote', groupOf, groups);
    }
    if (overlap) {
      const a = ranges[overlap[0] * RANGE_STRIDE + RangeField.Request] as number;
      const b = ranges[overlap[1] * RANGE_STRIDE + RangeField.Request] as number;
      const [later, earlier] = a > b ? [a, b] : [b, a];
      throw new InvalidInputError(`requests[${later}]: its ${op === 'read' ? 'local' : 'remote'} destination overlaps requests[${earlier}]`, {
        details: { field: op === 'read' ? 'localOffset' : 'remoteOffset', request: later },
      });
    }
    return { op, ep, transport: t, locals, remotes, localRegs, localFirst, ranges, count, bytes, requests: n };
  }

  #localHandle(t: Transport, local: Registration, i: number): object {
    if (local.revoked) throw new InvalidInputError(`requests[${i}].local (${local.id}) was revoked`, { details: { field: 'local', request: i } });
    if (this.#registrations.get(local.id) !== local) {
      throw new InvalidInputError(`requests[${i}].local (${local.id}) is not registered with this engine`, { details: { field: 'local', request: i } });
    }
    const handle = local.handleFor(t.name);
    if (!handle) {
      throw new InvalidInputError(`requests[${i}].local (${local.id}) is not registered with ${t.name}: ${local.skipped.get(t.name) ?? 'not requested'}`, {
        details: { field: 'local', request: i },
      });
    }
    return handle;
  }

  #remoteFor(t: Transport, ep: PeerEndpoint, remote: MemoryDescriptor, i: number): unknown {
    if (remote.owner.nodeId !== ep.identity.nodeId) {
      throw new InvalidInputError(`requests[${i}].remote belongs to ${remote.owner.nodeId}, not to peer ${ep.identity.nodeId}`, { details: { field: 'remote', request: i } });
    }
    if (remote.owner.incarnation !== ep.identity.incarnation) {
      throw new InvalidInputError(
        `requests[${i}].remote was issued by an earlier incarnation of ${remote.owner.nodeId} (${remote.owner.incarnation}, peer is now ${ep.identity.incarnation})`,
        { details: { field: 'remote', request: i } },
      );
    }
    const payload = remote.transports.get(t.name);
    if (!payload) throw new InvalidInputError(`requests[${i}].remote has no ${t.name} grant`, { details: { field: 'remote', request: i } });
    try {
      return remote.rangeLengths === undefined ? t.decodeRemote(payload, remote.memoryKind, remote.byteLength) : t.decodeRemote(payload, remote.memoryKind, remote.byteLength, remote.rangeLengths);
    } catch (e) {
      throw withRequest(toTensorwireError(e, InvalidInputError), i, `requests[${i}].remote: `);
    }
  }

  /** The chunk plan of `plan` for one connection (its streams and chunk limit). */
  #split(plan: Plan, conn: TransportConnection, first: number): Split {
    const streams = Math.max(1, conn.streams);
    const cap = Math.min(this.chunkBytes, plan.transport.capabilities.maxChunkBytes, conn.maxChunkBytes ?? Number.POSITIVE_INFINITY);
    const { batches, chunks } = splitIntoBatches(plan.op, plan.locals, plan.remotes, plan.ranges, plan.count, cap, streams, first % streams);
    let only = -1;
    for (let s = 0; s < batches.length; s++) {
      if (batches[s] === undefined) continue;
      if (only !== -1) {
        only = -1;
        break;
      }
      only = s;
    }
    return { conn, batches, chunks, only };
  }

  /** Post a split on its connection: one execute per stream; settles after every stream has. */
  async #post(plan: Plan, pc: PeerConnection, conn: TransportConnection, split: Split, signal: AbortSignal, deadline: number): Promise<TransferReport> {
    const transport = plan.transport;
    const op = plan.op;
    const hot = this.#hot(pc, op);
    const started = hot ? performance.now() : 0;
    const transfer = {}; // this post's identity for the transport (ExecuteOptions.transfer)
    pc.inFlight++;
    try {
      let failures: TensorwireError[] | undefined;
      if (split.only >= 0) {
        // One stream has all the work: no per-stream promises to gather.
        const batch = split.batches[split.only] as TransferBatch;
        try {
          await conn.execute(split.only, batch, { signal, deadline, transfer });
        } catch (e) {
          try {
            if (!(e instanceof ResourceExhaustedError)) throw e;
            await this.#execute(pc, conn, split.only, batch, signal, deadline, transfer, e);
          } catch (e2) {
            failures = [toTensorwireError(e2)];
          }
        }
      } else {
        const running: Promise<void>[] = [];
        for (let s = 0; s < split.batches.length; s++) {
          const batch = split.batches[s];
          if (batch) running.push(this.#execute(pc, conn, s, batch, signal, deadline, transfer));
        }
        const results = await Promise.allSettled(running);
        // Every stream has settled (quiesced) before we report anything.
        for (const r of results) if (r.status === 'rejected') (failures ??= []).push(toTensorwireError(r.reason));
      }
      if (failures) {
        // The connection retired in an orderly way under this post (it was not open when the
        // streams settled, and they refused work only as invalidated): not a broken connection.
        const retired = !conn.isOpen && failures.every((f) => f instanceof SessionInvalidatedError);
        const broken = retired ? undefined : failures.find((f) => f.breaksConnection);
        if (broken) this.#invalidateEntry(pc, conn, broken);
        const err = broken ?? failures.find((f) => !(f instanceof TimedOutError || f instanceof AbortedError)) ?? (failures[0] as TensorwireError);
        if (retired) retiredUnder.add(err);
        throw err;
      }
      hot?.done(plan.bytes, plan.requests);
      return { transport: transport.name, bytes: plan.bytes, chunks: split.chunks, requests: plan.requests, ranges: plan.count };
    } catch (e) {
      const err = signal.aborted && !(e instanceof TensorwireError && e.breaksConnection) ? errorFromSignal(signal, `${op} from ${plan.ep.identity.nodeId}`) : toTensorwireError(e);
      this.metrics?.errors.inc({ transport: transport.name, code: err.code });
      this.metrics?.operations.inc({ transport: transport.name, direction: op, outcome: err.code }, plan.requests);
      throw err;
    } finally {
      pc.inFlight--;
      hot?.observe((performance.now() - started) / 1e3);
    }
  }

  /** The metric tally of the per-post path, looked up once per connection entry and direction. */
  #hot(pc: PeerConnection, op: 'read' | 'write'): PostTally | undefined {
    const metrics = this.metrics;
    if (!metrics) return undefined;
    const cached = op === 'read' ? pc.hotRead : pc.hotWrite;
    if (cached) return cached;
    const t = metrics.tally(pc.transport.name, op);
    if (op === 'read') pc.hotRead = t;
    else pc.hotWrite = t;
    return t;
  }

  /** One stream's batch, backing off on local exhaustion; `failed`: the first attempt already failed so. */
  async #execute(
    pc: PeerConnection,
    conn: TransportConnection,
    stream: number,
    batch: TransferBatch,
    signal: AbortSignal,
    deadline: number,
    transfer: object,
    failed?: ResourceExhaustedError,
  ): Promise<void> {
    let backoff = 1;
    let first = failed;
    for (;;) {
      try {
        if (first) {
          const f = first;
          first = undefined;
          throw f;
        }
        await conn.execute(stream, batch, { signal, deadline, transfer });
        return;
      } catch (e) {
        // Invariant 5: local exhaustion backs off and keeps the connection.
        if (e instanceof ResourceExhaustedError && !signal.aborted && Date.now() + backoff < deadline) {
          this.metrics?.errors.inc({ transport: pc.transport.name, code: e.code });
          await sleep(backoff, signal);
          backoff = Math.min(backoff * 2, 50);
          // Retired while we backed off (GOAWAY, idle, a simultaneous open settled): nothing of
          // this batch was posted, so the post is retried on the connection that replaces it.
          if (!signal.aborted && !conn.isOpen) throw new SessionInvalidatedError(`connection to ${pc.peer.nodeId} retired while a post backed off; nothing of it was posted`);
          if (!signal.aborted) continue;
        }
        throw e;
      }
    }
  }

  /** Get or open the connection for (peer, transport); concurrent callers share one handshake. */
  async #connection(ep: PeerEndpoint, t: Transport, signal: AbortSignal): Promise<PeerConnection> {
    const key = connectionKey(ep.identity, t.name);
    let pc = this.#table.get(key);
    if (pc?.conn && !pc.conn.isOpen) {
      this.#invalidateEntry(pc, pc.conn, new ConnectionBrokenError('connection closed'));
      pc = undefined;
    }
    // The common case: an established connection, nothing to wait for.
    if (pc?.ready.fulfilled === true && !signal.aborted) return pc;
    if (!pc) {
      pc = new PeerConnection(key, ep.identity, t);
      this.#table.set(key, pc);
      this.#open(pc, ep);
    }
    await raceSignal(pc.ready.promise, signal, () => errorFromSignal(signal, `connect to ${ep.identity.nodeId}`));
    return pc;
  }

  #open(pc: PeerConnection, ep: PeerEndpoint): void {
    const t = pc.transport;
    const blob = ep.transports.get(t.name) as Uint8Array;
    const ac = new AbortController();
    const timer = setTimeout(() => {
      const err = new TimedOutError(`handshake with ${pc.peer.nodeId} over ${t.name} timed out`);
      ac.abort(err);
      // Do not depend on the transport settling: the entry must not stay "connecting".
      if (this.#table.get(pc.key) === pc && !pc.ready.settled) {
        this.#table.delete(pc.key);
        pc.ready.reject(err);
      }
    }, this.connectTimeoutMs);
    this.#inflight.add(ac);
    const first = this.#explain(ep, [pc.transport.capabilities.memoryKinds[0] ?? 'host']);
    t.connect(ep.identity, blob, { signal: ac.signal, deadline: Date.now() + this.connectTimeoutMs, streams: Math.min(this.streamsPerPeer, t.capabilities.maxStreams) })
      .then(
        (conn) => {
          if (this.#table.get(pc.key) === pc && !pc.ready.settled && !this.#closed && !conn.isOpen) {
            // The peer already asked to retire it: it settled a simultaneous open in favour of
            // its own connection, which will arrive as an inbound one and resolve this entry.
            this.metrics?.connectionEvents.inc({ transport: t.name, event: 'retired' });
            void conn.retire().catch(() => undefined);
            const wait = setTimeout(() => {
              if (this.#table.get(pc.key) === pc && !pc.ready.settled) {
                this.#table.delete(pc.key);
                pc.ready.reject(new ConnectionBrokenError(`${pc.peer.nodeId} retired our connection and did not open its own`));
              }
            }, this.connectTimeoutMs);
            wait.unref();
            void pc.ready.promise.finally(() => clearTimeout(wait)).catch(() => undefined);
          } else if (this.#table.get(pc.key) === pc && !pc.ready.settled && !this.#closed) {
            this.#adopt(pc, conn, 'opened');
            if (first.slowerPath) this.#warnSlow(first, t.name);
            this.metrics?.selections.inc({ transport: t.name, memory_kind: first.memoryKind, slower_path: String(first.slowerPath) });
          } else {
            // Lost a simultaneous open (an inbound connection won) or the entry was invalidated meanwhile.
            this.metrics?.connectionEvents.inc({ transport: t.name, event: 'retired' });
            void conn.retire().catch(() => undefined);
          }
        },
        (e: unknown) => {
          const err = ac.signal.aborted ? errorFromSignal(ac.signal, `connect to ${pc.peer.nodeId}`) : toTensorwireError(e);
          if (this.#table.get(pc.key) === pc && !pc.ready.settled) this.#table.delete(pc.key);
          this.metrics?.errors.inc({ transport: t.name, code: err.code });
          pc.ready.reject(err);
        },
      )
      .finally(() => {
        clearTimeout(timer);
        this.#inflight.delete(ac);
      });
  }

  #adopt(pc: PeerConnection, conn: TransportConnection, event: 'opened' | 'adopted'): void {
    pc.conn = conn;
    this.metrics?.connections.inc({ transport: pc.transport.name });
    this.metrics?.connectionEvents.inc({ transport: pc.transport.name, event });
    conn.onClose((error) => {
      if (error && pc.conn === conn) pc.brokenBy ??= error;
      this.metrics?.connections.dec({ transport: pc.transport.name });
      if (this.#table.get(pc.key) === pc && pc.conn === conn) {
        this.#table.delete(pc.key);
        this.metrics?.connectionEvents.inc({ transport: pc.transport.name, event: 'closed' });
        if (error) this.#logger.info('connection closed', { peer: pc.peer.nodeId, transport: pc.transport.name, error: error.message });
      }
    });
    conn.onRetire(() => {
      if (this.#table.get(pc.key) === pc && pc.conn === conn) this.#table.delete(pc.key);
    });
    pc.ready.resolve(conn);
  }

  #warnSlow(ex: Explanation, chosen: string): void {
    const key = `${ex.peer}/${ex.memoryKind}/${chosen}`;
    if (this.#warned.has(key)) return;
    this.#warned.add(key);
    this.#logger.warn(`slower transport path: ${ex.reason}`, { peer: ex.peer, transport: chosen, memoryKind: ex.memoryKind });
  }

  /**
   * A transport accepted a connection the peer opened. Simultaneous-open rule: of two
   * connections between the same pair of nodes on one transport, the one opened by the
   * node with the smaller nodeId wins. Both sides apply the rule, so both keep the same one.
   */
  #inbound(t: Transport, conn: TransportConnection): void {
    if (this.#closed) {
      void conn.close(new ClosedError('engine closed'));
      return;
    }
    const peer = conn.peer;
    if (peer.nodeId === this.identity.nodeId) return; // a loopback connection to ourselves: it only serves
    // The node dialled us as another incarnation than it opened its other connections here
    // with: those go now, not when their sockets close (a hung old process would otherwise
    // keep the per-node budgets of the transport, e.g. the kit's send ledger, that its
    // successor shares). Only connections the node opened: incarnations carry no order, so an
    // old process dialling in late must not take down the connections we opened to its
    // successor, and endpoints we dial never end anything.
    this.#disposeOtherIncarnations(peer);
    const key = connectionKey(peer, t.name);
    let pc = this.#table.get(key);
    if (!pc) {
      pc = new PeerConnection(key, peer, t);
      this.#table.set(key, pc);
      this.#adopt(pc, conn, 'adopted');
      return;
    }
    const inboundWins = peer.nodeId < this.identity.nodeId; // it was opened by the peer
    if (pc.conn && !pc.conn.isOpen) {
      // The existing connection is already going away: the peer's new one replaces it.
      const old = pc.conn;
      const next = new PeerConnection(key, peer, t);
      this.#table.set(key, next);
      this.#adopt(next, conn, 'adopted');
      void old.close(new ConnectionBrokenError('replaced by a newer connection from the peer')).catch(() => undefined);
      return;
    }
    if (!pc.conn) {
      // Our own open is still in flight.
      if (inboundWins) {
        this.metrics?.connectionEvents.inc({ transport: t.name, event: 'simultaneous_open' });
        this.#adopt(pc, conn, 'adopted'); // our outbound will be retired when it completes
      } else {
        this.metrics?.connectionEvents.inc({ transport: t.name, event: 'retired' });
        void conn.retire().catch(() => undefined);
      }
      return;
    }
    // An existing connection we opened wins only if we have the smaller id. One the peer
    // opened earlier loses to the peer's newer one: the peer only reopens after dropping it.
    const existingWins = pc.conn.initiator === this.identity.nodeId && !inboundWins;
    if (existingWins) {
      this.metrics?.connectionEvents.inc({ transport: t.name, event: 'retired' });
      void conn.retire().catch(() => undefined);
      return;
    }
    // Swap in one step: the new entry replaces the old; the old drains gracefully.
    const old = pc;
    const next = new PeerConnection(key, peer, t);
    this.#table.set(key, next);
    this.metrics?.connectionEvents.inc({ transport: t.name, event: 'simultaneous_open' });
    this.#adopt(next, conn, 'adopted');
    if (old.conn) {
      this.metrics?.connectionEvents.inc({ transport: t.name, event: 'retired' });
      void old.conn.retire().catch(() => undefined);
    }
  }

  #disposeOtherIncarnations(peer: NodeIdentity): void {
    const victims = this.#takeEntries((pc) => pc.peer.nodeId === peer.nodeId && pc.peer.incarnation !== peer.incarnation && pc.conn?.initiator === peer.nodeId);
    for (const pc of victims) void this.#dispose(pc, new ConnectionBrokenError(`peer ${peer.nodeId} restarted (incarnation changed)`), 'invalidated');
  }

  /** Remove the entries `match` selects from the table, in one step each, and return them. */
  #takeEntries(match: (pc: PeerConnection) => boolean): PeerConnection[] {
    const taken: PeerConnection[] = [];
    for (const [key, pc] of this.#table) {
      if (match(pc)) {
        this.#table.delete(key);
        taken.push(pc);
      }
    }
    return taken;
  }

  #invalidateEntry(pc: PeerConnection, conn: TransportConnection, error: TensorwireError): void {
    pc.brokenBy ??= error;
    if (this.#table.get(pc.key) === pc && pc.conn === conn) this.#table.delete(pc.key);
    // A broken connection may mean reachability changed: choose transports afresh.
    this.#choiceCache = new WeakMap();
    this.metrics?.connectionEvents.inc({ transport: pc.transport.name, event: 'invalidated' });
    void conn.close(error).catch(() => undefined);
  }

  async #dispose(pc: PeerConnection, error: TensorwireError, event: 'invalidated' | 'closed'): Promise<void> {
    pc.brokenBy ??= error;
    this.metrics?.connectionEvents.inc({ transport: pc.transport.name, event });
    pc.ready.reject(error);
    if (pc.conn) await pc.conn.close(error).catch(() => undefined);
  }
}
