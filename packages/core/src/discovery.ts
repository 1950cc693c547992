/**
 * Discovery: how nodes find each other, which blocks they advertise, and when a peer
 * restarted.
 *
 * A node publishes one {@link NodeRecord}: its node id, the random incarnation it chose at
 * start (the engine's), its host id, its engine endpoint blob (which carries one endpoint
 * blob per transport), and, for holders, its lock-service address and the block ids it
 * advertises. Requesters keep a local cache of every record and are told of changes:
 * `added`, `updated`, `incarnation-changed`, `removed`.
 *
 * Backends: {@link StaticDiscovery} (here; peers given as records or endpoint blobs, no
 * store) and `@tensorwire/discovery-etcd` (records under kept-alive etcd leases).
 *
 * {@link attachDiscovery} ties a discovery to a {@link TransferEngine}: when a peer's
 * incarnation changes or it disappears, the engine's connections to it are invalidated
 * synchronously, in the same turn in which the cache changes, so no transfer can start
 * against the new incarnation over a connection (or with descriptors) of the old one.
 *
 * ## Ownership of a node id (the conflict rule)
 *
 * A node id belongs to the live record that holds it. A record claiming a node id held by
 * a live record with another incarnation never overrides it: the claim is ignored (and
 * logged with the typed reason `conflicting-claim`) until the holder's record is gone:
 * withdrawn by its node (graceful shutdown) or, in a store with leases, deleted by the store
 * when the holder's lease lapsed (a crash). A restarted node therefore takes its id back
 * immediately after a graceful shutdown and within one lease TTL after a crash. Within one
 * record's life only its owner (the same incarnation) may update it; in etcd the owner
 * writes under its lease, and after an outage that cost it its lease it moves its record to
 * a new lease of its own (revoking the old one), which every client follows, so the node
 * converges to exactly one live record with its latest content.
 */
import { Buffer } from 'node:buffer';
import { decodeEndpoint, endpointFromString, endpointToString, type PeerEndpoint } from './descriptor.js';
import { ClosedError, ConnectionBrokenError, InvalidInputError, TimedOutError, errorFromSignal, type TensorwireErrorOptions } from './errors.js';
import { idProblem, isToken, ownerProblem } from './ids.js';
import { silentLogger, type Logger } from './logger.js';
import type { ConnectionInfo } from './engine.js';
import type { NodeIdentity } from './transport.js';

export const DISCOVERY_SPECIFICATION_VERSION = 'v1' as const;
export const NODE_RECORD_VERSION = 1;
/** Largest encoded record accepted (bytes). */
export const MAX_NODE_RECORD_BYTES = 256 * 1024;
/** Largest engine endpoint blob in a record (bytes, decoded). */
export const MAX_RECORD_ENDPOINT_BYTES = 16 * 1024;
/** Most block ids one record advertises. */
export const MAX_ADVERTISED_BLOCKS = 4096;
/** Longest lock-service address (`host:port`). */
export const MAX_LOCK_ADDRESS_LENGTH = 261;

/** What one node publishes about itself. */
export interface NodeRecord {
  /** Owner-style node id (the engine's). */
  readonly nodeId: string;
  /** Random per process start; a restart is a new incarnation. */
  readonly incarnation: string;
  /** Machine id; equal host ids can use same-host transports. */
  readonly hostId: string;
  /** The engine's endpoint blob (`engine.endpoint()`): one endpoint per transport; its identity equals the fields above. */
  readonly endpoint: Uint8Array;
  /** The holder's lock service, `host:port` (holders only). */
  readonly lockAddress?: string;
  /** Block ids this node advertises (holders only), `block:<owner>:<n>`. */
  readonly blockIds?: readonly string[];
}

/** Why a record was refused. Stable strings, for logs and metrics. */
export type RecordRejection =
  | 'oversized'
  | 'malformed'
  | 'unsupported-version'
  | 'unknown-field'
  | 'invalid-field'
  | 'identity-mismatch'
  | 'key-mismatch'
  | 'conflicting-claim'
  | 'unleased';

/** A record that cannot be accepted. `reason` is typed; `details.field` names the field when there is one. */
export class InvalidRecordError extends InvalidInputError {
  constructor(reason: RecordRejection, message: string, options: TensorwireErrorOptions = {}) {
    super(message, { ...options, details: { ...options.details, reason } });
  }
  get reason(): RecordRejection {
    return this.details['reason'] as RecordRejection;
  }
}

/** A rejected record as backends report it (also the payload of `rejected` notifications). */
export interface RecordRejected {
  readonly reason: RecordRejection;
  readonly message: string;
  /** Where it came from (an etcd key, `static`…). */
  readonly source: string;
  /** The node id it claimed, when it could be read. */
  readonly nodeId?: string;
}

const HOST_RE = /^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*|\[[0-9A-Fa-f:.]{2,45}\])$/;
const RECORD_KEYS: ReadonlySet<string> = new Set(['v', 'nodeId', 'incarnation', 'hostId', 'endpoint', 'lockAddress', 'blockIds']);

/** Why `address` is not a `host:port` lock address, or undefined. */
export function lockAddressProblem(address: unknown): string | undefined {
  if (typeof address !== 'string') return `lock address must be a string, got ${typeof address}`;
  if (address.length === 0 || address.length > MAX_LOCK_ADDRESS_LENGTH) return `lock address must be 1-${MAX_LOCK_ADDRESS_LENGTH} characters`;
  const m = /^(.*):(\d{1,5})$/.exec(address);
  if (!m) return `lock address ${JSON.stringify(address.slice(0, 80))} must be host:port`;
  const port = Number(m[2]);
  if (!(port >= 1 && port <= 65535)) return `lock address port ${m[2]} is not 1-65535`;
  if (!HOST_RE.test(m[1] as string)) return `lock address host ${JSON.stringify((m[1] as string).slice(0, 80))} is not a host name or IP address`;
  return undefined;
}

function fieldError(field: string, message: string, reason: RecordRejection = 'invalid-field'): InvalidRecordError {
  return new InvalidRecordError(reason, `node record ${field}: ${message}`, { details: { field } });
}

/** Validate a record (as built by a caller or decoded); throws InvalidRecordError. Returns a frozen, normalised copy. */
export function validateNodeRecord(record: NodeRecord): NodeRecord {
  if (typeof record !== 'object' || record === null) throw new InvalidRecordError('malformed', 'node record must be an object');
  const nodeProblem = ownerProblem(record.nodeId);
  if (nodeProblem !== undefined) throw fieldError('nodeId', nodeProblem);
  if (!isToken(record.incarnation)) throw fieldError('incarnation', 'must be 1-64 characters of [A-Za-z0-9_-]');
  if (!isToken(record.hostId)) throw fieldError('hostId', 'must be 1-64 characters of [A-Za-z0-9_-]');
  if (!(record.endpoint instanceof Uint8Array)) throw fieldError('endpoint', 'must be bytes');
  if (record.endpoint.byteLength === 0 || record.endpoint.byteLength > MAX_RECORD_ENDPOINT_BYTES) {
    throw fieldError('endpoint', `must be 1-${MAX_RECORD_ENDPOINT_BYTES} bytes, got ${record.endpoint.byteLength}`, record.endpoint.byteLength > 0 ? 'oversized' : 'invalid-field');
  }
  let ep: PeerEndpoint;
  try {
    ep = decodeEndpoint(record.endpoint);
  } catch (e) {
    throw fieldError('endpoint', `not an engine endpoint: ${e instanceof Error ? e.message : String(e)}`);
  }
  if (ep.identity.nodeId !== record.nodeId || ep.identity.incarnation !== record.incarnation || ep.identity.hostId !== record.hostId) {
    throw new InvalidRecordError(
      'identity-mismatch',
      `node record for ${record.nodeId}/${record.incarnation} carries the endpoint of ${ep.identity.nodeId}/${ep.identity.incarnation}`,
      { details: { field: 'endpoint' } },
    );
  }
  const out: { -readonly [K in keyof NodeRecord]: NodeRecord[K] } = {
    nodeId: record.nodeId,
    incarnation: record.incarnation,
    hostId: record.hostId,
    endpoint: new Uint8Array(record.endpoint),
  };
  if (record.lockAddress !== undefined) {
    const problem = lockAddressProblem(record.lockAddress);
    if (problem !== undefined) throw fieldError('lockAddress', problem);
    out.lockAddress = record.lockAddress;
  }
  if (record.blockIds !== undefined) {
    if (!Array.isArray(record.blockIds)) throw fieldError('blockIds', 'must be an array');
    if (record.blockIds.length > MAX_ADVERTISED_BLOCKS) {
      throw fieldError('blockIds', `${record.blockIds.length} block ids exceed ${MAX_ADVERTISED_BLOCKS}`, 'oversized');
    }
    const seen = new Set<string>();
    for (const id of record.blockIds as unknown[]) {
      const problem = idProblem(id, 'block');
      if (problem !== undefined) throw fieldError('blockIds', problem);
      if (seen.has(id as string)) throw fieldError('blockIds', `${JSON.stringify(id)} listed twice`);
      seen.add(id as string);
    }
    out.blockIds = Object.freeze([...seen]);
  }
  return Object.freeze(out);
}

const encoder = new TextEncoder();
const decoder = new TextDecoder('utf-8', { fatal: true });

/**
 * Encode a record as UTF-8 JSON (readable with `etcdctl get`):
 * `{"v":1,"nodeId","incarnation","hostId","endpoint":<base64url>,"lockAddress"?,"blockIds"?}`.
 * Validates first; throws InvalidRecordError.
 */
export function encodeNodeRecord(record: NodeRecord): Uint8Array {
  const r = validateNodeRecord(record);
  const json: Record<string, unknown> = { v: NODE_RECORD_VERSION, nodeId: r.nodeId, incarnation: r.incarnation, hostId: r.hostId, endpoint: endpointToString(r.endpoint) };
  if (r.lockAddress !== undefined) json['lockAddress'] = r.lockAddress;
  if (r.blockIds !== undefined) json['blockIds'] = r.blockIds;
  const bytes = encoder.encode(JSON.stringify(json));
  if (bytes.byteLength > MAX_NODE_RECORD_BYTES) throw new InvalidRecordError('oversized', `node record of ${bytes.byteLength} bytes exceeds ${MAX_NODE_RECORD_BYTES}`);
  return bytes;
}

/**
 * Decode and validate a record from untrusted bytes (a store, a file, a peer). The size is
 * checked before anything is parsed; unknown fields, wrong types, invalid ids, an endpoint
 * whose identity differs from the record's: all throw InvalidRecordError with a typed reason.
 */
export function decodeNodeRecord(bytes: Uint8Array | string): NodeRecord {
  const size = typeof bytes === 'string' ? Buffer.byteLength(bytes) : bytes.byteLength;
  if (size > MAX_NODE_RECORD_BYTES) throw new InvalidRecordError('oversized', `node record of ${size} bytes exceeds ${MAX_NODE_RECORD_BYTES}`);
  let text: string;
  try {
    text = typeof bytes === 'string' ? bytes : decoder.decode(bytes);
  } catch {
    throw new InvalidRecordError('malformed', 'node record is not UTF-8');
  }
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch {
    throw new InvalidRecordError('malformed', 'node record is not JSON');
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) throw new InvalidRecordError('malformed', 'node record is not a JSON object');
  const o = json as Record<string, unknown>;
  for (const k of Object.keys(o)) {
    if (!RECORD_KEYS.has(k)) throw new InvalidRecordError('unknown-field', `node record has unknown field ${JSON.stringify(k.slice(0, 40))}`, { details: { field: k.slice(0, 40) } });
  }
  if (o['v'] !== NODE_RECORD_VERSION) {
    throw new InvalidRecordError('unsupported-version', `node record version ${JSON.stringify(o['v'])} is not supported (expected ${NODE_RECORD_VERSION})`, { details: { field: 'v' } });
  }
  for (const k of ['nodeId', 'incarnation', 'hostId', 'endpoint'] as const) {
    if (typeof o[k] !== 'string') throw fieldError(k, 'must be a string');
  }
  const endpointText = o['endpoint'] as string;
  if (endpointText.length > Math.ceil((MAX_RECORD_ENDPOINT_BYTES * 4) / 3) + 4) throw fieldError('endpoint', 'is too long', 'oversized');
  let endpoint: Uint8Array;
  try {
    endpoint = endpointFromString(endpointText);
  } catch {
    throw fieldError('endpoint', 'is not base64url');
  }
  if (o['lockAddress'] !== undefined && typeof o['lockAddress'] !== 'string') throw fieldError('lockAddress', 'must be a string');
  if (o['blockIds'] !== undefined && !Array.isArray(o['blockIds'])) throw fieldError('blockIds', 'must be an array');
  return validateNodeRecord({
    nodeId: o['nodeId'] as string,
    incarnation: o['incarnation'] as string,
    hostId: o['hostId'] as string,
    endpoint,
    ...(o['lockAddress'] !== undefined ? { lockAddress: o['lockAddress'] as string } : {}),
    ...(o['blockIds'] !== undefined ? { blockIds: o['blockIds'] as string[] } : {}),
  });
}

/** Decode without throwing: the record, or the typed reason it was refused. */
export function tryDecodeNodeRecord(bytes: Uint8Array | string): { ok: true; record: NodeRecord } | { ok: false; reason: RecordRejection; message: string } {
  try {
    return { ok: true, record: decodeNodeRecord(bytes) };
  } catch (e) {
    if (e instanceof InvalidRecordError) return { ok: false, reason: e.reason, message: e.message };
    return { ok: false, reason: 'malformed', message: e instanceof Error ? e.message : String(e) };
  }
}

/** The record for a started engine (its identity and endpoint), plus holder fields. */
export function nodeRecordFor(
  engine: { readonly identity: NodeIdentity; endpoint(): Uint8Array },
  extra: { lockAddress?: string; blockIds?: readonly string[] } = {},
): NodeRecord {
  return validateNodeRecord({
    nodeId: engine.identity.nodeId,
    incarnation: engine.identity.incarnation,
    hostId: engine.identity.hostId,
    endpoint: engine.endpoint(),
    ...(extra.lockAddress !== undefined ? { lockAddress: extra.lockAddress } : {}),
    ...(extra.blockIds !== undefined ? { blockIds: extra.blockIds } : {}),
  });
}

/** A record made from a bare engine endpoint blob (no lock address, no blocks). */
export function nodeRecordFromEndpoint(endpoint: Uint8Array): NodeRecord {
  let ep: PeerEndpoint;
  try {
    ep = decodeEndpoint(endpoint);
  } catch (e) {
    throw fieldError('endpoint', `not an engine endpoint: ${e instanceof Error ? e.message : String(e)}`);
  }
  return validateNodeRecord({ ...ep.identity, endpoint });
}

function sameRecord(a: NodeRecord, b: NodeRecord): boolean {
  if (a.incarnation !== b.incarnation || a.hostId !== b.hostId || a.lockAddress !== b.lockAddress) return false;
  if (Buffer.compare(a.endpoint, b.endpoint) !== 0) return false;
  const ab = a.blockIds ?? [];
  const bb = b.blockIds ?? [];
  return ab.length === bb.length && ab.every((x, i) => x === bb[i]);
}

// ---------------------------------------------------------------------------------------
// Events and the interface

export type RemovalReason = 'withdrawn' | 'lease-expired' | 'deleted' | 'resync' | 'replaced';

export type DiscoveryEvent =
  | { readonly type: 'added'; readonly nodeId: string; readonly record: NodeRecord }
  | { readonly type: 'updated'; readonly nodeId: string; readonly record: NodeRecord; readonly previous: NodeRecord }
  | { readonly type: 'incarnation-changed'; readonly nodeId: string; readonly record: NodeRecord; readonly previous: NodeRecord }
  | { readonly type: 'removed'; readonly nodeId: string; readonly previous: NodeRecord; readonly reason: RemovalReason };

export type DiscoveryListener = (event: DiscoveryEvent) => void;

/** Every call that can wait takes these. */
export interface DiscoveryWaitOptions {
  readonly signal?: AbortSignal;
  /** Relative deadline (ms). */
  readonly timeoutMs?: number;
}

export interface WaitForNodeOptions extends DiscoveryWaitOptions {
  /** Resolve only for a record this predicate accepts (e.g. a new incarnation). */
  readonly until?: (record: NodeRecord) => boolean;
}

/**
 * A discovery backend. Every method that waits takes an AbortSignal and a timeout. Calls
 * after `close()` reject with ClosedError; `close()` and `[Symbol.asyncDispose]` are
 * idempotent and withdraw this node's record.
 */
export interface Discovery extends AsyncDisposable {
  readonly specificationVersion: typeof DISCOVERY_SPECIFICATION_VERSION;
  /** The store, for messages: `static`, `etcd://host:port`. */
  readonly store: string;
  /** False while the store is unreachable (the cache still answers for known peers). */
  readonly available: boolean;
  /** Publish (or update) this node's record. One node per discovery; updates keep the incarnation. */
  publish(record: NodeRecord, options?: DiscoveryWaitOptions): Promise<void>;
  /** Remove this node's record (graceful shutdown). Idempotent. */
  withdraw(options?: DiscoveryWaitOptions): Promise<void>;
  /**
   * The live record of `nodeId`, or undefined when there is none. While the store is
   * unreachable, known peers are answered from the cache and unknown ones reject with
   * BackendUnavailableError naming the store.
   */
  lookup(nodeId: string, options?: DiscoveryWaitOptions): Promise<NodeRecord | undefined>;
  /** Wait until `nodeId` has a (matching) record. Rejects with TimedOutError / AbortedError / ClosedError. */
  waitFor(nodeId: string, options?: WaitForNodeOptions): Promise<NodeRecord>;
  /** Live records advertising `blockId`. */
  holdersOf(blockId: string, options?: DiscoveryWaitOptions): Promise<NodeRecord[]>;
  /** Every live record. */
  list(options?: DiscoveryWaitOptions): Promise<NodeRecord[]>;
  /** The cached record of `nodeId`, synchronously; never waits, never throws. */
  peek(nodeId: string): NodeRecord | undefined;
  /** Listen to changes; returns the unsubscribe function. Listener errors are logged, never propagated. */
  on(listener: DiscoveryListener): () => void;
  close(): Promise<void>;
}

/** Combine a caller's signal and timeout into one signal (and a disposer). */
export function waitSignal(options: DiscoveryWaitOptions | undefined, what: string): { signal: AbortSignal | undefined; dispose(): void } {
  const timeoutMs = options?.timeoutMs;
  if (timeoutMs !== undefined && !(typeof timeoutMs === 'number' && timeoutMs > 0 && Number.isFinite(timeoutMs))) {
    throw new InvalidInputError(`timeoutMs must be a positive finite number, got ${String(timeoutMs)}`, { details: { field: 'timeoutMs' } });
  }
  if (timeoutMs === undefined) return { signal: options?.signal, dispose() {} };
  const ac = new AbortController();
  const timer = setTimeout(() => ac.abort(new TimedOutError(`${what} timed out after ${timeoutMs} ms`)), timeoutMs);
  const user = options?.signal;
  const onUser = (): void => ac.abort(errorFromSignal(user as AbortSignal, what));
  if (user?.aborted) onUser();
  else user?.addEventListener('abort', onUser, { once: true });
  return {
    signal: ac.signal,
    dispose() {
      clearTimeout(timer);
      user?.removeEventListener('abort', onUser);
    },
  };
}

interface Waiter {
  readonly nodeId: string;
  readonly until: (r: NodeRecord) => boolean;
  readonly resolve: (r: NodeRecord) => void;
  readonly reject: (e: unknown) => void;
}

/**
 * The cache every backend keeps: records by node id, an index by block id, listeners and
 * waiters. Backends decide what to accept; the cache turns accepted changes into events.
 * Listeners run synchronously, in the same turn as the change.
 */
export class DiscoveryCache {
  readonly #records = new Map<string, NodeRecord>();
  readonly #byBlock = new Map<string, Set<string>>();
  readonly #listeners = new Set<DiscoveryListener>();
  readonly #waiters = new Set<Waiter>();
  readonly #logger: Logger;
  #closed = false;

  constructor(logger: Logger = silentLogger) {
    this.#logger = logger;
  }
  get size(): number {
    return this.#records.size;
  }
  get(nodeId: string): NodeRecord | undefined {
    return this.#records.get(nodeId);
  }
  has(nodeId: string): boolean {
    return this.#records.has(nodeId);
  }
  nodeIds(): string[] {
    return [...this.#records.keys()];
  }
  values(): NodeRecord[] {
    return [...this.#records.values()];
  }
  holdersOf(blockId: string): NodeRecord[] {
    const ids = this.#byBlock.get(blockId);
    return ids ? [...ids].map((id) => this.#records.get(id) as NodeRecord) : [];
  }

  /** Store a validated record; emits added / updated / incarnation-changed (nothing if unchanged). */
  put(record: NodeRecord): DiscoveryEvent | undefined {
    if (this.#closed) return undefined;
    const previous = this.#records.get(record.nodeId);
    if (previous && sameRecord(previous, record)) return undefined;
    if (previous) this.#unindex(previous);
    this.#records.set(record.nodeId, record);
    for (const b of record.blockIds ?? []) {
      let s = this.#byBlock.get(b);
      if (!s) this.#byBlock.set(b, (s = new Set()));
      s.add(record.nodeId);
    }
    const event: DiscoveryEvent = !previous
      ? { type: 'added', nodeId: record.nodeId, record }
      : previous.incarnation !== record.incarnation
        ? { type: 'incarnation-changed', nodeId: record.nodeId, record, previous }
        : { type: 'updated', nodeId: record.nodeId, record, previous };
    this.#emit(event);
    for (const w of [...this.#waiters]) {
      if (w.nodeId === record.nodeId && w.until(record)) {
        this.#waiters.delete(w);
        w.resolve(record);
      }
    }
    return event;
  }

  /** Drop a record; emits removed. */
  remove(nodeId: string, reason: RemovalReason): DiscoveryEvent | undefined {
    if (this.#closed) return undefined;
    const previous = this.#records.get(nodeId);
    if (!previous) return undefined;
    this.#records.delete(nodeId);
    this.#unindex(previous);
    const event: DiscoveryEvent = { type: 'removed', nodeId, previous, reason };
    this.#emit(event);
    return event;
  }

  #unindex(r: NodeRecord): void {
    for (const b of r.blockIds ?? []) {
      const s = this.#byBlock.get(b);
      s?.delete(r.nodeId);
      if (s?.size === 0) this.#byBlock.delete(b);
    }
  }

  #emit(event: DiscoveryEvent): void {
    for (const l of [...this.#listeners]) {
      try {
        l(event);
      } catch (e) {
        this.#logger.error('discovery: a listener threw', { event: event.type, nodeId: event.nodeId, error: e instanceof Error ? e.message : String(e) });
      }
    }
  }

  on(listener: DiscoveryListener): () => void {
    if (typeof listener !== 'function') throw new InvalidInputError('listener must be a function', { details: { field: 'listener' } });
    this.#listeners.add(listener);
    return () => {
      this.#listeners.delete(listener);
    };
  }

  waitFor(nodeId: string, options: WaitForNodeOptions = {}): Promise<NodeRecord> {
    if (this.#closed) return Promise.reject(new ClosedError('discovery is closed'));
    const until = options.until ?? (() => true);
    const current = this.#records.get(nodeId);
    if (current && until(current)) return Promise.resolve(current);
    let ws: ReturnType<typeof waitSignal>;
    try {
      ws = waitSignal(options, `wait for node ${nodeId}`);
    } catch (e) {
      return Promise.reject(e);
    }
    const { signal, dispose } = ws;
    return new Promise<NodeRecord>((resolve, reject) => {
      const w: Waiter = {
        nodeId,
        until,
        resolve: (r) => {
          cleanup();
          resolve(r);
        },
        reject: (e) => {
          cleanup();
          reject(e);
        },
      };
      const onAbort = (): void => {
        this.#waiters.delete(w);
        w.reject(errorFromSignal(signal as AbortSignal, `wait for node ${nodeId}`));
      };
      const cleanup = (): void => {
        dispose();
        signal?.removeEventListener('abort', onAbort);
      };
      if (signal?.aborted) return onAbort();
      signal?.addEventListener('abort', onAbort, { once: true });
      this.#waiters.add(w);
    });
  }

  /** Reject every waiter with ClosedError and drop the listeners. Idempotent. */
  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    for (const w of [...this.#waiters]) w.reject(new ClosedError('discovery closed'));
    this.#waiters.clear();
    this.#listeners.clear();
  }
}

function assertNodeId(nodeId: unknown): asserts nodeId is string {
  const p = ownerProblem(nodeId);
  if (p !== undefined) throw new InvalidInputError(`node id: ${p}`, { details: { field: 'nodeId' } });
}

function assertBlockId(blockId: unknown): asserts blockId is string {
  const p = idProblem(blockId, 'block');
  if (p !== undefined) throw new InvalidInputError(`block id: ${p}`, { details: { field: 'blockId' } });
}

/** Argument checks shared by backends. */
export const discoveryChecks = { assertNodeId, assertBlockId } as const;

// ---------------------------------------------------------------------------------------
// StaticDiscovery

/** A static peer: a record, an encoded record (JSON bytes or text), or a bare engine endpoint (bytes or base64url). */
export type StaticPeer = NodeRecord | Uint8Array | string;

export interface StaticDiscoveryOptions {
  readonly peers?: readonly StaticPeer[];
  readonly logger?: Logger;
}

/** Turn a static peer into a validated record. Throws InvalidRecordError. */
export function staticPeerRecord(peer: StaticPeer): NodeRecord {
  if (peer instanceof Uint8Array) {
    if (peer[0] === 0x7b) return decodeNodeRecord(peer); // '{'
    return nodeRecordFromEndpoint(peer);
  }
  if (typeof peer === 'string') {
    if (peer.trimStart().startsWith('{')) return decodeNodeRecord(peer);
    let bytes: Uint8Array;
    try {
      bytes = endpointFromString(peer.trim());
    } catch {
      throw new InvalidRecordError('malformed', 'static peer is neither a JSON record nor a base64url endpoint');
    }
    return nodeRecordFromEndpoint(bytes);
  }
  return validateNodeRecord(peer);
}

/**
 * The embedded default: peers are given (records or endpoint blobs); nothing is stored
 * anywhere. `set()` / `remove()` change them (a peer restarted: `set()` its new record and
 * attached engines invalidate the old incarnation). `publish()` makes this node's own record
 * visible to lookups in this process; it may not take a node id another record holds with
 * another incarnation (`conflicting-claim`).
 */
export class StaticDiscovery implements Discovery {
  readonly specificationVersion = DISCOVERY_SPECIFICATION_VERSION;
  readonly store = 'static';
  readonly #cache: DiscoveryCache;
  readonly #logger: Logger;
  #own: string | undefined;
  #closed = false;

  constructor(options: StaticDiscoveryOptions = {}) {
    this.#logger = options.logger ?? silentLogger;
    this.#cache = new DiscoveryCache(this.#logger);
    for (const p of options.peers ?? []) this.set(p);
  }

  get available(): boolean {
    return !this.#closed;
  }

  #assertOpen(): void {
    if (this.#closed) throw new ClosedError('discovery is closed');
  }

  /** Add or replace a peer (an operator's statement: it replaces any incarnation). */
  set(peer: StaticPeer): NodeRecord {
    this.#assertOpen();
    const record = staticPeerRecord(peer);
    if (record.nodeId === this.#own) throw new InvalidRecordError('conflicting-claim', `node id ${record.nodeId} is this node's own`);
    this.#cache.put(record);
    return record;
  }

  /** Remove a peer. */
  remove(nodeId: string): boolean {
    this.#assertOpen();
    if (nodeId === this.#own) return false;
    return this.#cache.remove(nodeId, 'deleted') !== undefined;
  }

  async publish(record: NodeRecord): Promise<void> {
    this.#assertOpen();
    const r = validateNodeRecord(record);
    if (this.#own !== undefined && this.#own !== r.nodeId) {
      throw new InvalidInputError(`this discovery publishes ${this.#own}; it cannot also publish ${r.nodeId}`, { details: { field: 'nodeId' } });
    }
    const live = this.#cache.get(r.nodeId);
    if (live && this.#own === undefined && live.incarnation !== r.incarnation) {
      throw new InvalidRecordError('conflicting-claim', `node id ${r.nodeId} is held by incarnation ${live.incarnation}; ${r.incarnation} cannot take it over`);
    }
    this.#own = r.nodeId;
    this.#cache.put(r);
  }

  async withdraw(): Promise<void> {
    if (this.#own === undefined || this.#closed) return;
    this.#cache.remove(this.#own, 'withdrawn');
    this.#own = undefined;
  }

  async lookup(nodeId: string): Promise<NodeRecord | undefined> {
    this.#assertOpen();
    assertNodeId(nodeId);
    return this.#cache.get(nodeId);
  }

  waitFor(nodeId: string, options?: WaitForNodeOptions): Promise<NodeRecord> {
    try {
      this.#assertOpen();
      assertNodeId(nodeId);
    } catch (e) {
      return Promise.reject(e);
    }
    return this.#cache.waitFor(nodeId, options);
  }

  async holdersOf(blockId: string): Promise<NodeRecord[]> {
    this.#assertOpen();
    assertBlockId(blockId);
    return this.#cache.holdersOf(blockId);
  }

  async list(): Promise<NodeRecord[]> {
    this.#assertOpen();
    return this.#cache.values();
  }

  peek(nodeId: string): NodeRecord | undefined {
    return this.#cache.get(nodeId);
  }

  on(listener: DiscoveryListener): () => void {
    this.#assertOpen();
    return this.#cache.on(listener);
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    await this.withdraw();
    this.#closed = true;
    this.#cache.close();
    this.#logger.debug('static discovery closed');
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

// ---------------------------------------------------------------------------------------
// attachDiscovery

/** What attachDiscovery needs of an engine (a TransferEngine fits). */
export interface DiscoveryEngine {
  readonly identity: NodeIdentity;
  /** Drop the connections to `nodeId`: all of them, or only those to `options.incarnation`. */
  invalidate(nodeId: string, reason?: string, options?: { incarnation?: string }): Promise<void>;
  connections(): ConnectionInfo[];
}

export interface AttachDiscoveryOptions {
  readonly logger?: Logger;
  /** Called (synchronously, after the engine invalidated) when a peer's incarnation ended: restarted or gone. */
  readonly onPeerEnded?: (nodeId: string, ended: NodeRecord, next: NodeRecord | undefined) => void;
}

export interface DiscoveryAttachment extends Disposable {
  /**
   * A signal that aborts (with ConnectionBrokenError) when `incarnation` of `nodeId` ends:
   * the node restarted or disappeared. Pass it to transfers and lock acquisitions made
   * against that incarnation, so work on a dead incarnation stops at once. Already aborted
   * when the cache knows a different incarnation or none.
   */
  signalFor(nodeId: string, incarnation: string): AbortSignal;
  /** Stop following the discovery. Idempotent. */
  detach(): void;
}

/**
 * Follow `discovery` on behalf of `engine`: when a peer's incarnation changes or it is
 * removed, the engine's connections to that incarnation are invalidated (one step per
 * connection, inside the discovery's change notification, so before any new transfer can
 * start; a successor's connections, which a lease may have opened first, stay), and the
 * signals handed out by `signalFor` for the ended incarnation abort. Connections already
 * open to an incarnation the discovery no longer lists are invalidated when attaching.
 */
export function attachDiscovery(engine: DiscoveryEngine, discovery: Discovery, options: AttachDiscoveryOptions = {}): DiscoveryAttachment {
  const logger = options.logger ?? silentLogger;
  const self = engine.identity.nodeId;
  const signals = new Map<string, Map<string, AbortController>>(); // nodeId -> incarnation -> controller
  let detached = false;

  const end = (nodeId: string, ended: NodeRecord, next: NodeRecord | undefined, why: string): void => {
    const reason = `peer ${nodeId} ${why}`;
    // Only the incarnation that ended: a successor's connections (a lease may name it before
    // discovery lists it; etcd reports a restart as removed, then added) stay.
    void engine.invalidate(nodeId, reason, { incarnation: ended.incarnation }).catch((e: unknown) => logger.warn('discovery: invalidate failed', { nodeId, error: String(e) }));
    const byInc = signals.get(nodeId);
    if (byInc) {
      for (const [inc, ac] of [...byInc]) {
        if (next === undefined || inc !== next.incarnation) {
          byInc.delete(inc);
          ac.abort(new ConnectionBrokenError(reason, { details: { peer: nodeId, incarnation: inc } }));
        }
      }
      if (byInc.size === 0) signals.delete(nodeId);
    }
    logger.info('discovery: peer incarnation ended', { nodeId, incarnation: ended.incarnation, next: next?.incarnation });
    try {
      options.onPeerEnded?.(nodeId, ended, next);
    } catch (e) {
      logger.error('discovery: onPeerEnded threw', { nodeId, error: e instanceof Error ? e.message : String(e) });
    }
  };

  const off = discovery.on((e) => {
    if (detached || e.nodeId === self) return;
    if (e.type === 'incarnation-changed') end(e.nodeId, e.previous, e.record, `restarted (incarnation ${e.previous.incarnation} -> ${e.record.incarnation})`);
    else if (e.type === 'removed') end(e.nodeId, e.previous, undefined, `left discovery (${e.reason})`);
  });

  // Connections opened before attaching, to incarnations discovery no longer has.
  for (const c of engine.connections()) {
    const current = discovery.peek(c.peer.nodeId);
    if (c.peer.nodeId !== self && current !== undefined && current.incarnation !== c.peer.incarnation) {
      void engine.invalidate(c.peer.nodeId, `peer ${c.peer.nodeId} restarted (incarnation ${c.peer.incarnation} -> ${current.incarnation})`, { incarnation: c.peer.incarnation }).catch(() => undefined);
    }
  }

  const detach = (): void => {
    if (detached) return;
    detached = true;
    off();
    signals.clear();
  };

  return {
    signalFor(nodeId: string, incarnation: string): AbortSignal {
      assertNodeId(nodeId);
      const current = discovery.peek(nodeId);
      if (detached) return AbortSignal.abort(new ClosedError('discovery attachment detached'));
      if (current?.incarnation !== incarnation) {
        return AbortSignal.abort(
          new ConnectionBrokenError(`peer ${nodeId} incarnation ${incarnation} is not live (${current ? `now ${current.incarnation}` : 'not listed'})`, {
            details: { peer: nodeId, incarnation },
          }),
        );
      }
      let byInc = signals.get(nodeId);
      if (!byInc) signals.set(nodeId, (byInc = new Map()));
      let ac = byInc.get(incarnation);
      if (!ac) byInc.set(incarnation, (ac = new AbortController()));
      return ac.signal;
    },
    detach,
    [Symbol.dispose]: detach,
  };
}
