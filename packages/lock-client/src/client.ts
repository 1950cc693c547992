/**
 * The requester side: {@link LockClient.acquire} resolves to a {@link LockGuard} that is
 * released exactly once on every exit path:
 *
 * - `await using` scope ends (completion or a thrown error) → `[Symbol.asyncDispose]`;
 * - explicit `release()` (later disposal is a no-op);
 * - an acquire aborted, timed out or broken while in flight → one release by acquire id,
 *   which frees the grant even if the response never arrived (and makes a late-arriving
 *   acquire fail at the holder);
 * - a guard dropped without disposal → released by a finalizer when it is collected;
 * - `client.close()` → every live guard is released.
 *
 * Releases (and auto-renews) go through one queue per holder ({@link HolderLane}): sent in
 * batches (`ReleaseMany` / `RenewMany`, unary calls against an older holder), with a bound
 * on calls in flight, and retried through the same queue with jittered backoff and a
 * per-holder retry budget, so a burst of releases or a failing holder turns into
 * backpressure rather than a retry storm. A release that cannot be confirmed before the
 * lease would have expired anyway is reported through the `releaseFailed` event and the
 * `release_failures_total` metric. Release never throws.
 */
import { randomBytes } from 'node:crypto';
import { EventEmitter } from 'node:events';
import * as grpc from '@grpc/grpc-js';
import {
  AbortedError,
  ClosedError,
  InvalidInputError,
  RemoteRejectedError,
  TimedOutError,
  errorFromSignal,
  ownerProblem,
  silentLogger,
  type Logger,
  type TensorwireError,
  type TransferEngine,
} from '@tensorwire/core';
import { joinSignals } from './signals.js';
import { transportsProblem } from './hints.js';
import { fetchBlocks, fetchLeased, type FetchDestination, type FetchGuard, type FetchLeaseOptions, type FetchOptions } from './fetch.js';
import { Registry } from 'prom-client';
import { fromGrpcError } from './errors.js';
import { HolderLane, type LaneHooks, type LaneStats, type LaneTransport, type ReleaseResult, type RetryBudget } from './holder-lane.js';
import { blockIdsProblem, numberedBlockIds, type NumberedBlocks } from './ids.js';
import { LANE_SUPPORTED, LaneDuplex, probeLane } from './lane.js';
import { DEFAULT_CLIENT_METRICS_PREFIX, registerClientMetrics, type ClientMetrics, type LockClientCounters } from './metrics.js';
import {
  AUTH_METADATA_KEY,
  loadLockProtocol,
  retryAfterOf,
  type AcquireResponseMsg,
  type BlockGrantMsg,
  type HealthResponseMsg,
  type LockMethod,
  type LockServiceClient,
  type ReleaseManyResponseMsg,
  type ReleaseResponseMsg,
  type RenewManyResponseMsg,
  type RenewResponseMsg,
  type Unary,
} from './proto.js';
import { SessionStream, type SessionStats } from './session.js';

/** After a local lane is lost, how long until the client looks for one again (ms). */
const LANE_RETRY_MS = 1000;
/**
 * After a search that found no lane this process can use (the holder offers none, it is on
 * another host, Health failed), the wait before the next search: doubling from
 * {@link LANE_RETRY_MS} up to this (ms).
 */
const LANE_RETRY_MAX_MS = 300_000;
/** The deadline of the Health call that looks for a holder's local lane (ms). */
const LANE_HEALTH_TIMEOUT_MS = 5000;

/** Where a holder's local lane search stands: one in flight, when the next may start, and how many found none in a row. */
interface LaneSearch {
  searching: boolean;
  retryAt: number;
  misses: number;
}

/** Default {@link LockClientOptions.sessionIdleMs}. */
const DEFAULT_SESSION_IDLE_MS = 1000;

export type { ReleaseResult, RetryBudget } from './holder-lane.js';

export interface ReleaseRetryOptions {
  /** First pause after a failed release, renew or overloaded acquire (ms, default 50). */
  readonly initialDelayMs?: number;
  /** Longest pause between attempts (ms, default 2000). */
  readonly maxDelayMs?: number;
}

export interface LockClientOptions {
  /** This requester's id (an owner name, `[A-Za-z0-9][A-Za-z0-9_-]{0,63}`). Default: random per client. */
  readonly requesterId?: string;
  /** Shared token sent as `authorization: Bearer <token>`. */
  readonly token?: string;
  /** Channel credentials, e.g. `grpc.credentials.createSsl(ca)`. Default: insecure. */
  readonly credentials?: grpc.ChannelCredentials;
  readonly channelOptions?: grpc.ChannelOptions;
  /**
   * Make the calls to each holder as messages of one long-lived `Session` stream (default
   * true): the same calls, answers and deadlines as unary calls, without a gRPC call per
   * request. A holder without Session is detected on first use and called unary. False: every
   * call unary.
   */
  readonly session?: boolean;
  /** End a holder's Session stream after this long with no call in flight (ms, default 1000). */
  readonly sessionIdleMs?: number;
  /**
   * Send the Session messages to a holder on this host over its local lane (Linux, default
   * true): on the first call to a holder the client asks its `Health`; when the holder offers
   * a lane (an abstract Unix socket, see `LockServerOptions.localLane`) and this process can
   * reach it (the same host and network namespace: checked by a greeting of its own before any
   * call goes there; otherwise the search backs off, 1 s doubling to 5 min), the next calls go over it instead of
   * gRPC: the same messages, answers, deadlines and errors, about half the round trip. A lane
   * that ends sends the calls back to gRPC (the calls in flight on it fail UNAVAILABLE, as on a
   * lost stream) and the client looks for a lane again a second later. Needs `session`.
   */
  readonly localLane?: boolean;
  /** Where to register metrics (default: a private Registry, see `registry`). */
  readonly registry?: Registry;
  /** Metric name prefix (default `tensorwire_lock_client_`). */
  readonly metricsPrefix?: string;
  readonly logger?: Logger;
  /** Deadline for acquire, renew and health calls without their own `timeoutMs` (ms, default 10000). */
  readonly defaultTimeoutMs?: number;
  /** Deadline of one release attempt (ms, default 5000). */
  readonly releaseTimeoutMs?: number;
  readonly releaseRetry?: ReleaseRetryOptions;
  /**
   * How much of the lease to keep in reserve: the transfer budget is the lease minus this.
   * A number (ms) or a function of the lease (ms). Default: 10% of the lease, at least
   * 100 ms, at most half the lease.
   */
  readonly safetyMarginMs?: number | ((leaseMs: number) => number);
  /** Lease length assumed for a holder whose lock timeout is not known yet, to bound release retries (ms, default 30000). */
  readonly assumedLockTimeoutMs?: number;
  /** How long `close()` waits for releases in flight (ms, default 5000). */
  readonly closeTimeoutMs?: number;
  /** Release/renew calls in flight to one holder at most (default 4). */
  readonly maxCallsInFlightPerHolder?: number;
  /** Entries in one ReleaseMany / RenewMany at most (default 1024). */
  readonly maxBatch?: number;
  /**
   * Per-holder budget for release retries: a token bucket, one token per retry call
   * (default `{ burst: 20, perSecond: 10, perSuccess: 1 }`). When it is empty, retries wait.
   */
  readonly retryBudget?: RetryBudget;
}

export interface CallOptions {
  readonly signal?: AbortSignal;
  /** Deadline for the call (ms). */
  readonly timeoutMs?: number;
}

export interface AutoRenewOptions {
  /** Renew this often (ms). Default: half the lease. */
  readonly everyMs?: number;
}

export interface AcquireOptions extends CallOptions {
  /** Lease to ask for (ms); the holder caps it at its lock timeout. Default: the lock timeout. */
  readonly leaseMs?: number;
  /** Renew automatically while the guard is live (for long transfers). */
  readonly autoRenew?: boolean | AutoRenewOptions;
  /**
   * The transports the blocks will be read through (the engine's names: `cuda-ipc`, `tcp`;
   * at most 8, no duplicates). A holder serving with `engineGrants` then grants the lease over
   * those of them that can grant its blocks only (no capability the requester does not use);
   * it grants its usual set when none can. Default: the holder's
   * usual set. `client.fetch` names, after its first fetch from a holder, the transport its
   * engine read that holder's blocks through (see there).
   */
  readonly transports?: readonly string[];
}

export interface RenewOptions extends CallOptions {
  /** New lease from now (ms). Default: the lease granted last time. */
  readonly leaseMs?: number;
}

/** Payload of the `releaseFailed` and `releaseRetry` events. */
export interface ReleaseFailure {
  readonly holder: string;
  /** The session, or undefined for an acquire released by its acquire id. */
  readonly sessionId: string | undefined;
  readonly acquireId: string | undefined;
  readonly attempts: number;
  readonly error: TensorwireError;
  /** For `releaseRetry`: the wait before the next attempt (ms). */
  readonly delayMs?: number;
}

export interface LeaseLost {
  readonly holder: string;
  readonly sessionId: string;
  readonly error: TensorwireError;
}

export interface LockClientEvents {
  releaseFailed: [ReleaseFailure];
  releaseRetry: [ReleaseFailure];
  leaseLost: [LeaseLost];
  guardLeaked: [{ readonly holder: string; readonly sessionId: string }];
}

export type GuardState = 'active' | 'expired' | 'lost' | 'releasing' | 'released';

export type { LockClientCounters } from './metrics.js';

const TIME_ORIGIN = performance.timeOrigin;
/** Unix-epoch milliseconds from a monotonic source. */
function now(): number {
  return TIME_ORIGIN + performance.now();
}

const TOKEN_BYTES = 12;
let tokenPool = Buffer.alloc(0);
let tokenOffset = 0;
/** 96 random bits, base64url; drawn from a pooled buffer to keep the hot path cheap. */
function randomToken(): string {
  if (tokenOffset + TOKEN_BYTES > tokenPool.length) {
    tokenPool = randomBytes(TOKEN_BYTES * 256);
    tokenOffset = 0;
  }
  const s = tokenPool.toString('base64url', tokenOffset, tokenOffset + TOKEN_BYTES);
  tokenOffset += TOKEN_BYTES;
  return s;
}

function defaultMargin(leaseMs: number): number {
  return Math.min(leaseMs / 2, Math.max(100, leaseMs * 0.1));
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal.aborted) return resolve();
    const t = setTimeout(done, ms);
    t.unref();
    function done(): void {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    }
    signal.addEventListener('abort', done, { once: true });
  });
}

/**
 * The blocks of an acquire, checked: ids (each well formed, none twice), or numbered blocks
 * (`{ owner, numbers: Uint32Array }`, non-empty; returned as a frozen copy). Repeated numbers are
 * left to the holder, which refuses them INVALID_ARGUMENT with one pass over its pin table.
 */
function checkBlocks(blocks: readonly string[] | NumberedBlocks): NumberedBlocks | undefined {
  if (Array.isArray(blocks)) {
    const blockIds = blocks as readonly string[];
    if (blockIds.length === 0) throw new InvalidInputError('block list is empty', { details: { field: 'blockIds' } });
    const problem = blockIdsProblem(blockIds);
    if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'blockIds' } });
    return undefined;
  }
  const b = blocks as Partial<NumberedBlocks> | null | undefined;
  if (b === null || typeof b !== 'object' || !(b.numbers instanceof Uint32Array)) {
    throw new InvalidInputError('blocks must be a list of block ids or { owner, numbers: Uint32Array }', { details: { field: 'blocks' } });
  }
  const problem = ownerProblem(b.owner);
  if (problem !== undefined) throw new InvalidInputError(`blocks.owner: ${problem}`, { details: { field: 'blocks.owner' } });
  if (b.numbers.length === 0) throw new InvalidInputError('block list is empty', { details: { field: 'blocks.numbers' } });
  return Object.freeze({ owner: b.owner as string, numbers: b.numbers.slice() });
}

/** Failures after which the holder may still have granted the acquire. */
function mayHaveGranted(error: TensorwireError): boolean {
  const code = error.details['grpcCode'];
  if (typeof code !== 'number') return true; // our abort, a close, a transport failure
  return (
    code === grpc.status.DEADLINE_EXCEEDED ||
    code === grpc.status.UNAVAILABLE ||
    code === grpc.status.CANCELLED ||
    code === grpc.status.UNKNOWN ||
    code === grpc.status.INTERNAL ||
    // An answer over a message-size limit (the client's receive limit, or the holder's send
    // limit): grpc-js reports it as RESOURCE_EXHAUSTED, but the holder granted the lease.
    (code === grpc.status.RESOURCE_EXHAUSTED && MESSAGE_TOO_LARGE.test(error.message))
  );
}
/** grpc-js's words for a message over `grpc.max_receive_message_length` / `grpc.max_send_message_length`. */
const MESSAGE_TOO_LARGE = /message larger than max/i;

/** Everything about a lease, held by the client; deliberately holds no reference to its guard. */
interface LeaseRecord {
  readonly holder: string;
  readonly holderId: string;
  readonly sessionId: string;
  /** The ids as given, or (a lease by number) formatted on first use. */
  blockIds: readonly string[] | undefined;
  /** A lease by number: the owner and the numbers (the client's copy). */
  readonly blocks: NumberedBlocks | undefined;
  readonly blockCount: number;
  readonly lockTimeoutMs: number;
  /** The response's per-block entries: only blocks with descriptors (a holder that honours omit_empty_blocks), or every block. */
  readonly blockGrants: readonly BlockGrantMsg[];
  /** `descriptors` of the guard, made on first use (a fetch never looks at it). */
  descriptorMap: ReadonlyMap<string, readonly Uint8Array[]> | undefined;
  readonly leaseDescriptors: readonly Uint8Array[];
  /** Created on first use of `guard.signal` (most cycles never look at it). */
  controller: AbortController | undefined;
  /** Why the lease ended, once it has: the reason `signal` carries. */
  endReason: (() => unknown) | undefined;
  leaseMs: number;
  marginMs: number;
  deadline: number;
  state: 'active' | 'lost' | 'releasing' | 'released';
  budgetTimer: NodeJS.Timeout | undefined;
  /** On its holder lane's auto-renew schedule. */
  autoRenew: boolean;
  renewEveryMs: number;
  renewNextAt: number;
  renewState: 0 | 1 | 2;
  releasing: Promise<ReleaseResult> | undefined;
  /** Dropped by `dropLeases` (the holder's incarnation ended): never released by RPC. */
  dropped?: boolean;
}

const NO_DESCRIPTORS: readonly Uint8Array[] = Object.freeze([]);

/** The lease's block ids (a lease by number: formatted once, on first use). */
function recordIds(r: LeaseRecord): readonly string[] {
  return (r.blockIds ??= numberedBlockIds(r.blocks as NumberedBlocks));
}

/**
 * The lease's descriptors per block, made once: every block of the lease, with what the holder
 * listed for it (a holder that honours omit_empty_blocks lists only blocks that have some).
 */
function descriptorMap(r: LeaseRecord): ReadonlyMap<string, readonly Uint8Array[]> {
  if (r.descriptorMap === undefined) {
    const m = new Map<string, readonly Uint8Array[]>();
    for (const id of recordIds(r)) m.set(id, NO_DESCRIPTORS);
    for (const b of r.blockGrants) m.set(b.blockId, b.descriptors);
    r.descriptorMap = m;
  }
  return r.descriptorMap;
}

/**
 * A live lease on a holder's blocks. Dispose it (`await using`) or call `release()`; both
 * release exactly once and never throw.
 */
export class LockGuard implements AsyncDisposable {
  readonly #r: LeaseRecord;
  readonly #client: LockClient;
  readonly #ops: ClientOps;

  /** @internal Created by {@link LockClient.acquire}. */
  constructor(record: LeaseRecord, client: LockClient, ops: ClientOps) {
    this.#r = record;
    this.#client = client;
    this.#ops = ops;
  }

  /** `session:<holderId>:<random>`. */
  get sessionId(): string {
    return this.#r.sessionId;
  }
  /** The holder's address. */
  get holder(): string {
    return this.#r.holder;
  }
  /** The holder's id (owner of the session id). */
  get holderId(): string {
    return this.#r.holderId;
  }
  /** The lease's block ids, in request order (a lease by number: `block:<owner>:<n>`, formatted on first use). */
  get blockIds(): readonly string[] {
    return recordIds(this.#r);
  }
  /** A lease by number: the owner and the numbers, in request order (read it, do not write it). Undefined for a lease by id. */
  get blocks(): NumberedBlocks | undefined {
    return this.#r.blocks;
  }
  /** How many blocks the lease holds. */
  get blockCount(): number {
    return this.#r.blockCount;
  }
  /** The holder's lock timeout: the longest lease it grants (ms). */
  get lockTimeoutMs(): number {
    return this.#r.lockTimeoutMs;
  }
  /** The lease granted last (ms). */
  get leaseMs(): number {
    return this.#r.leaseMs;
  }
  /**
   * When the lease ends unless renewed: Unix-epoch ms on this process's clock, counted
   * from when the request was sent (so never later than the holder's own deadline).
   */
  get deadline(): number {
    return this.#r.deadline;
  }
  /** The reserve kept between the end of transfers and the end of the lease (ms). */
  get safetyMarginMs(): number {
    return this.#r.marginMs;
  }
  /** Transfers must be done by this time (deadline minus the safety margin). */
  get transferDeadline(): number {
    return this.#r.deadline - this.#r.marginMs;
  }
  /** The transfer budget left now (ms, ≥ 0): time until `transferDeadline`. */
  get budgetMs(): number {
    return Math.max(0, this.transferDeadline - now());
  }
  /** Per block of the lease, the holder's opaque transfer descriptors for this lease (empty lists for blocks without). */
  get descriptors(): ReadonlyMap<string, readonly Uint8Array[]> {
    return descriptorMap(this.#r);
  }
  /** The holder's opaque descriptors for the whole lease (e.g. one range grant; empty when none). */
  get leaseDescriptors(): readonly Uint8Array[] {
    return this.#r.leaseDescriptors;
  }
  /** The descriptors of one block (empty when the holder has none). */
  descriptorsFor(blockId: string): readonly Uint8Array[] {
    // Most leases (one range grant) have no per-block descriptors at all: no map needed.
    if (this.#r.blockGrants.length === 0) return NO_DESCRIPTORS;
    return descriptorMap(this.#r).get(blockId) ?? NO_DESCRIPTORS;
  }
  /**
   * Fires when transfers under this lease must stop: the transfer budget ran out
   * (TimedOutError), the lease was lost (RemoteRejectedError), or it was released or its
   * client closed (AbortedError / ClosedError). Pass it to every transfer.
   */
  get signal(): AbortSignal {
    return this.#ops.signal(this.#r);
  }
  get state(): GuardState {
    const s = this.#r.state;
    if (s === 'active' && now() >= this.#r.deadline) return 'expired';
    return s;
  }
  /** Whether `release()` (or disposal) has started. */
  get released(): boolean {
    return this.#r.state === 'releasing' || this.#r.state === 'released';
  }

  /**
   * Extend the lease to now + `leaseMs` (default: the lease granted last). Resolves to the
   * new deadline. A renew the holder refuses as NOT_FOUND marks the lease lost and fires
   * `signal`. Once `signal` has fired it stays fired; renew before the budget runs out.
   */
  renew(options: RenewOptions = {}): Promise<number> {
    return this.#ops.renew(this.#r, options);
  }

  /** Release the lease (idempotent: every call returns the same result). Never rejects. */
  release(): Promise<ReleaseResult> {
    return this.#ops.release(this.#r);
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.release();
  }

  /** The client this guard came from. */
  get client(): LockClient {
    return this.#client;
  }
}

/** Internal operations the guard calls on its client. */
interface ClientOps {
  signal(record: LeaseRecord): AbortSignal;
  renew(record: LeaseRecord, options: RenewOptions): Promise<number>;
  release(record: LeaseRecord): Promise<ReleaseResult>;
}

/**
 * Acquires transfer locks on holders over gRPC. One client per process is typical; it
 * keeps one channel per holder address.
 */
export class LockClient extends EventEmitter<LockClientEvents> implements AsyncDisposable {
  readonly requesterId: string;
  /** The registry the metrics are on (the one passed in, or a private one). */
  readonly registry: Registry;
  readonly #opts: LockClientOptions;
  readonly #logger: Logger;
  readonly #credentials: grpc.ChannelCredentials;
  readonly #metadata: grpc.Metadata;
  readonly #channels = new Map<string, LockServiceClient>();
  readonly #sessions = new Map<string, SessionStream>();
  /** Per holder: the local lane search (see {@link LockClientOptions.localLane}). */
  readonly #laneSearch = new Map<string, LaneSearch>();
  readonly #records = new Set<LeaseRecord>();
  readonly #pending = new Set<Promise<unknown>>();
  /** Cancels for acquires in flight (close abandons them). */
  readonly #inflight = new Set<(error: TensorwireError) => void>();
  readonly #lockTimeouts = new Map<string, number>();
  readonly #lanes = new Map<string, HolderLane<LeaseRecord>>();
  readonly #laneHooks: (holder: string) => LaneHooks<LeaseRecord>;
  readonly #closeController = new AbortController();
  readonly #finalizer: FinalizationRegistry<LeaseRecord>;
  readonly #metrics: ClientMetrics;
  readonly #ops: ClientOps;
  #closing: Promise<void> | undefined;
  #closeDeadline: number | undefined;
  #isClosing = false;
  #acquired = 0;
  #released = 0;
  #releaseFailures = 0;
  #expired = 0;
  #acquireRetries = 0;
  #dropped = 0;
  #releaseRetries = 0;
  #abandoned = 0;
  #leaked = 0;

  constructor(options: LockClientOptions = {}) {
    super();
    this.#opts = options;
    this.#logger = options.logger ?? silentLogger;
    const requesterId = options.requesterId ?? `r${process.pid}-${randomBytes(6).toString('base64url')}`;
    const problem = ownerProblem(requesterId);
    if (problem !== undefined) throw new InvalidInputError(`requesterId: ${problem}`, { details: { field: 'requesterId' } });
    const idle = options.sessionIdleMs;
    if (idle !== undefined && !(Number.isFinite(idle) && idle >= 0 && idle <= 0x7fffffff)) {
      throw new InvalidInputError(`sessionIdleMs must be a number of ms from 0 to 2^31-1, got ${idle}`, { details: { field: 'sessionIdleMs' } });
    }
    this.requesterId = requesterId;
    if (options.token !== undefined && options.token.length === 0) throw new InvalidInputError('token must not be empty');
    this.#credentials = options.credentials ?? grpc.credentials.createInsecure();
    this.#metadata = new grpc.Metadata();
    if (options.token !== undefined) this.#metadata.set(AUTH_METADATA_KEY, `Bearer ${options.token}`);
    this.registry = options.registry ?? new Registry();
    this.#metrics = registerClientMetrics(this.registry, options.metricsPrefix ?? DEFAULT_CLIENT_METRICS_PREFIX, () => this.counters(), () => this.#laneStats());
    this.#laneHooks = (holder) => ({
      releaseRetry: (info, error, delayMs) => {
        this.#releaseRetries++;
        this.emit('releaseRetry', { holder, sessionId: info.sessionId || undefined, acquireId: info.acquireId || undefined, attempts: info.attempts, error, delayMs });
      },
      releaseFailed: (info, error) => {
        this.#logger.warn('lock: release failed; the holder will expire the lease', {
          holder,
          sessionId: info.sessionId || undefined,
          acquireId: info.acquireId || undefined,
          attempts: info.attempts,
          error: error.message,
        });
        this.emit('releaseFailed', { holder, sessionId: info.sessionId || undefined, acquireId: info.acquireId || undefined, attempts: info.attempts, error });
      },
      batch: (kind, entries) => this.#metrics.observeBatch(holder, kind, entries),
      renewed: (r, sentAt, leaseMs) => {
        if (r.state !== 'active') return;
        r.leaseMs = leaseMs;
        r.deadline = Math.max(r.deadline, sentAt + leaseMs);
        this.#armBudget(r);
      },
      renewLost: (r, error) => this.#lose(r, error),
      renewFailed: (r, error, retryAt) => {
        this.#logger.warn('lock: auto-renew failed', { sessionId: r.sessionId, error: error.message, retryInMs: retryAt === undefined ? undefined : Math.round(retryAt - now()) });
        if (retryAt === undefined) r.autoRenew = false;
      },
    });
    this.#finalizer = new FinalizationRegistry((record) => this.#onGuardCollected(record));
    this.#ops = {
      signal: (r) => this.#signal(r),
      renew: (r, o) => this.#renew(r, o),
      release: (r) => this.#release(r),
    };
  }

  /** Requester-side counters: `acquired = released + releaseFailures + expired + dropped + active`. */
  counters(): LockClientCounters {
    let releaseBatches = 0;
    let renewBatches = 0;
    let budgetExhausted = 0;
    let overloaded = 0;
    let releaseQueued = 0;
    for (const lane of this.#lanes.values()) {
      const st = lane.stats();
      releaseBatches += st.releaseBatches;
      renewBatches += st.renewBatches;
      budgetExhausted += st.budgetExhausted;
      overloaded += st.overloaded;
      releaseQueued += st.releaseQueued;
    }
    return {
      acquired: this.#acquired,
      released: this.#released,
      releaseFailures: this.#releaseFailures,
      expired: this.#expired,
      dropped: this.#dropped,
      active: this.#acquired - this.#released - this.#releaseFailures - this.#expired - this.#dropped,
      releaseRetries: this.#releaseRetries,
      abandonedAcquires: this.#abandoned,
      leakedGuards: this.#leaked,
      acquireRetries: this.#acquireRetries,
      releaseBatches,
      renewBatches,
      budgetExhausted,
      overloaded,
      releaseQueued,
    };
  }

  /** Per holder: its release queue, renew schedule, batches, retries and budget. */
  holderStats(): Map<string, LaneStats> {
    return new Map(this.#laneStats());
  }

  /** Per holder called so far with sessions on: its Session stream (see {@link LockClientOptions.session}). */
  sessionStats(): Map<string, SessionStats> {
    const out = new Map<string, SessionStats>();
    for (const [holder, s] of this.#sessions) out.set(holder, s.stats());
    return out;
  }

  *#laneStats(): IterableIterator<[string, LaneStats]> {
    for (const [holder, lane] of this.#lanes) yield [holder, lane.stats()];
  }

  #lane(holder: string): HolderLane<LeaseRecord> {
    let lane = this.#lanes.get(holder);
    if (lane === undefined) {
      const retry = this.#opts.releaseRetry ?? {};
      lane = new HolderLane<LeaseRecord>(holder, this.#laneTransport(holder), this.#laneHooks(holder), {
        ...(this.#opts.maxCallsInFlightPerHolder !== undefined ? { maxInFlight: this.#opts.maxCallsInFlightPerHolder } : {}),
        ...(this.#opts.maxBatch !== undefined ? { maxBatch: this.#opts.maxBatch } : {}),
        ...(this.#opts.retryBudget !== undefined ? { retryBudget: this.#opts.retryBudget } : {}),
        releaseTimeoutMs: this.#opts.releaseTimeoutMs ?? 5000,
        renewTimeoutMs: this.#opts.defaultTimeoutMs ?? 10_000,
        initialDelayMs: retry.initialDelayMs ?? 50,
        maxDelayMs: retry.maxDelayMs ?? 2000,
      });
      this.#lanes.set(holder, lane);
      // A lane made while closing (a holder first released during close) gets what is left of the limit.
      // Started after the caller has queued its release (a microtask later), or the lane would stop empty.
      const closeBy = this.#closeDeadline;
      const made = lane;
      if (closeBy !== undefined) this.#track(Promise.resolve().then(() => made.close(Math.max(0, closeBy - now()))));
    }
    return lane;
  }

  #laneTransport(holder: string): LaneTransport {
    const requesterId = this.requesterId;
    return {
      releaseMany: (sessionIds, acquireIds, timeoutMs, signal) =>
        this.#call<ReleaseManyResponseMsg>(holder, 'release', 'ReleaseMany', { requesterId, sessionIds, acquireIds }, timeoutMs, signal),
      release: (sessionId, acquireId, timeoutMs, signal) =>
        this.#call<ReleaseResponseMsg>(holder, 'release', 'Release', { requesterId, sessionId, acquireId }, timeoutMs, signal).then((r) => r.released),
      renewMany: (sessionIds, leaseMs, timeoutMs, signal) =>
        this.#call<RenewManyResponseMsg>(holder, 'renew', 'RenewMany', { requesterId, sessionIds, leaseMs }, timeoutMs, signal),
      renew: (sessionId, leaseMs, timeoutMs, signal) =>
        this.#call<RenewResponseMsg>(holder, 'renew', 'Renew', { requesterId, sessionId, leaseMs }, timeoutMs, signal),
    };
  }

  get closed(): boolean {
    return this.#isClosing;
  }

  #channel(holder: string): LockServiceClient {
    let c = this.#channels.get(holder);
    if (c === undefined) {
      const { Client } = loadLockProtocol();
      c = new Client(holder, this.#credentials, this.#opts.channelOptions);
      this.#channels.set(holder, c);
    }
    return c;
  }

  #timeout(options: CallOptions): number {
    const t = options.timeoutMs ?? this.#opts.defaultTimeoutMs ?? 10_000;
    if (!Number.isFinite(t) || t <= 0) throw new InvalidInputError(`timeoutMs must be a positive number, got ${t}`, { details: { field: 'timeoutMs' } });
    return t;
  }

  /**
   * One call: deadline, abort, typed errors. Sent on the holder's Session stream (one message
   * each way, see session.ts) unless the client was made with `session: false` or the holder
   * has no Session; then unary, with the deadline as the grpc-js `deadline` call option. Either
   * way the holder receives the deadline and can honour it, and failures map the same way.
   */
  #call<Res>(holder: string, what: string, method: LockMethod, request: object, timeoutMs: number, signal: AbortSignal | undefined, cancelOnClose = false): Promise<Res> {
    return new Promise<Res>((resolve, reject) => {
      let settled = false;
      let stop: () => void = () => undefined;
      const cancel = (error: TensorwireError): void => {
        if (settled) return;
        settled = true;
        signal?.removeEventListener('abort', onAbort);
        if (cancelOnClose) this.#inflight.delete(cancel);
        stop();
        reject(error);
      };
      const onAbort = (): void => cancel(errorFromSignal(signal as AbortSignal, what));
      const done = (err: grpc.ServiceError | null, res?: unknown): void => {
        if (settled) return;
        settled = true;
        signal?.removeEventListener('abort', onAbort);
        if (cancelOnClose) this.#inflight.delete(cancel);
        if (err || res === undefined) {
          // An overloaded holder says when to come back (and that it did nothing).
          const retryAfterMs = retryAfterOf(err);
          reject(fromGrpcError(err, what, retryAfterMs !== undefined ? { holder, retryAfterMs } : { holder }));
        } else resolve(res as Res);
      };
      const until = Date.now() + timeoutMs;
      const unary = (): void => {
        const c = this.#channel(holder);
        const invoke = c[method] as Unary<object, unknown>;
        const call = invoke.call(c, request, this.#metadata.clone(), { deadline: Math.max(Date.now() + 1, until) }, done);
        stop = () => call.cancel();
      };
      const session = this.#session(holder);
      if (session === undefined) unary();
      else {
        stop = session.call(method, request, timeoutMs, done, () => {
          if (!settled) unary();
        });
      }
      if (settled) return;
      signal?.addEventListener('abort', onAbort, { once: true });
      if (cancelOnClose) this.#inflight.add(cancel);
    });
  }

  /** The holder's Session stream, or undefined when calls to it go unary. */
  #session(holder: string): SessionStream | undefined {
    if (this.#opts.session === false) return undefined;
    let s = this.#sessions.get(holder);
    if (s === undefined) {
      const c = this.#channel(holder);
      const search: LaneSearch = { searching: false, retryAt: 0, misses: 0 };
      s = new SessionStream(() => c.Session(this.#metadata.clone()), loadLockProtocol().codec, this.#opts.sessionIdleMs ?? DEFAULT_SESSION_IDLE_MS, () => {
        search.retryAt = now() + LANE_RETRY_MS;
      });
      this.#sessions.set(holder, s);
      this.#laneSearch.set(holder, search);
    }
    if (s.unsupported) return undefined;
    const search = this.#laneSearch.get(holder);
    // On every call: the clock is read only while a search may be due (never with the lane off,
    // nor once a lane was found).
    if (search !== undefined && this.#opts.localLane !== false && LANE_SUPPORTED && !search.searching && search.retryAt !== Number.POSITIVE_INFINITY && search.retryAt <= now() && !this.#isClosing) {
      search.searching = true;
      search.retryAt = Number.POSITIVE_INFINITY; // until the lane is lost
      this.#findLane(holder, s, search);
    }
    return s;
  }

  /**
   * Ask the holder's Health for its local lane (over the Session stream), check that this
   * process reaches it (a lane connection greeted by the holder: a holder on another host names
   * a lane that does not exist here), and only then make the session use it, so no call is
   * ever sent to a lane that cannot work. When there is none to use, the next search waits
   * longer each time (1 s doubling to 5 min). Nothing waits for this.
   */
  #findLane(holder: string, s: SessionStream, search: LaneSearch): void {
    const value = this.#metadata.get(AUTH_METADATA_KEY)[0];
    const authorization = typeof value === 'string' ? value : '';
    const codec = loadLockProtocol().codec;
    const miss = (): void => {
      search.searching = false;
      search.retryAt = now() + Math.min(LANE_RETRY_MAX_MS, LANE_RETRY_MS * 2 ** search.misses);
      search.misses = Math.min(search.misses + 1, 30);
    };
    this.#call<HealthResponseMsg>(holder, 'health', 'Health', {}, LANE_HEALTH_TIMEOUT_MS, this.#closeController.signal).then(async (h) => {
      const name = h.localLane;
      if (name === undefined || name === '' || !/^[A-Za-z0-9._-]{1,100}$/.test(name) || this.#isClosing) return miss();
      if (!(await probeLane(name, h.holderId, authorization, codec, LANE_HEALTH_TIMEOUT_MS)) || this.#isClosing) return miss();
      search.searching = false;
      search.misses = 0;
      s.useLane(() => new LaneDuplex(name, h.holderId, authorization, codec));
    }).catch(miss);
  }

  /**
   * The remote fetch flow in one call: lease `blocks` on `holder` (ids, or numbers of one of its
   * numbered block spaces: `{ owner, numbers }`), read block i into
   * `destinations[i]` through `engine` (one batch, over the transport the engine chooses for
   * the holder: the same-host one on one host), check every block's length, and return a
   * guard that holds the lease until disposed. On any failure the lease is released before
   * the error is rethrown; the guard releases exactly once. The holder serves its leases with
   * `engineGrants` from `@tensorwire/lock-client/server`.
   *
   * `await using fetch = await client.fetch(engine, holder, blockIds, destinations, { deadline, signal })`
   */
  fetch(engine: TransferEngine, holder: string, blocks: readonly string[] | NumberedBlocks, destinations: readonly FetchDestination[], options: FetchOptions = {}): Promise<FetchGuard> {
    const acquire = (h: string, b: readonly string[] | NumberedBlocks, o: AcquireOptions): Promise<LockGuard> => this.acquire(h, b, o);
    const closing = this.#closeController.signal;
    if (options.transports !== undefined) return fetchBlocks(acquire, engine, holder, blocks, destinations, options, closing);
    // Least privilege, learned: a fetch names the transport the last fetch of this engine from
    // this holder read through, so the holder grants over it alone. Should the engine now read
    // through another (its choice for the holder changed), the read fails for want of that
    // grant: the name is forgotten and the fetch made once more with the holder's usual grant.
    let known = this.#fetchTransport.get(engine);
    if (known === undefined) this.#fetchTransport.set(engine, (known = new Map()));
    const byHolder = known;
    const named = byHolder.get(holder);
    const learn = (g: FetchGuard): FetchGuard => {
      if (named?.[0] !== g.transport) byHolder.set(holder, Object.freeze([g.transport]));
      return g;
    };
    if (named === undefined) return fetchBlocks(acquire, engine, holder, blocks, destinations, options, closing).then(learn);
    // The second try's acquire gets what is left of the first one's timeoutMs, not a fresh one:
    // the timeout bounds the fetch's acquiring as a whole (an absolute `deadline` bounds both anyway).
    const until = now() + (options.timeoutMs ?? this.#opts.defaultTimeoutMs ?? 10_000);
    return fetchBlocks(acquire, engine, holder, blocks, destinations, { ...options, transports: named }, closing).then(learn, (e: unknown) => {
      byHolder.delete(holder);
      if (!(e instanceof InvalidInputError && e.details['field'] === 'remote') || this.#isClosing) throw e;
      const left = until - now();
      if (!(left > 0)) throw new TimedOutError(`fetch from ${holder}: its timeoutMs ran out before the acquire with the holder's usual grant`, { cause: e });
      return fetchBlocks(acquire, engine, holder, blocks, destinations, { ...options, timeoutMs: left }, closing).then(learn);
    });
  }

  /** Per engine and holder: the transport `fetch` read the holder's blocks through last (named in the next fetch's acquire). */
  readonly #fetchTransport = new WeakMap<TransferEngine, Map<string, readonly string[]>>();

  /**
   * Read the blocks of a lease this client acquired into `destinations` through `engine`, as
   * {@link fetch} does after its acquire (block i into `destinations[i]`, one batch, lengths
   * checked), and return a guard that owns the lease from here on: disposing it, or any
   * failure here (bad destinations included), releases the lease exactly once.
   *
   * For pipelined fetches: acquire the next fetch's blocks before reading this one's, so the
   * holder grants the next lease while this one copies, and the next fetch starts with its
   * lease in hand (`batches`, `destinations`: yours):
   *
   * ```ts
   * let next = client.acquire(holder, batches[0]);
   * for (let i = 0; i < batches.length; i++) {
   *   const lease = await next;
   *   if (i + 1 < batches.length) {
   *     next = client.acquire(holder, batches[i + 1]);
   *     next.catch(() => {}); // awaited next time round; not an unhandled rejection meanwhile
   *   }
   *   await using fetch = await client.fetchLease(engine, lease, destinations[i]);
   * }
   * ```
   *
   * (Stopping early: release the lease still in `next`.) A lease of another client or one
   * released already is refused (InvalidInputError) and left as it is. While an acquire of this
   * client is in flight, the read waits for one turn of the event loop first: HTTP/2 sends
   * queued frames on the next turn, and a same-host read copies on this thread, so without it
   * the next acquire would leave only after the copy.
   */
  fetchLease(engine: TransferEngine, lease: LockGuard, destinations: readonly FetchDestination[], options: FetchLeaseOptions = {}): Promise<FetchGuard> {
    if (!(lease instanceof LockGuard) || lease.client !== this) {
      return Promise.reject(new InvalidInputError('fetchLease needs a lease acquired by this client', { details: { field: 'lease' } }));
    }
    if (lease.released) return Promise.reject(new InvalidInputError(`lease ${lease.sessionId} was released`, { details: { field: 'lease' } }));
    return fetchLeased(engine, lease, destinations, options, this.#acquiring > 0);
  }

  /** Acquires of this client in flight (fetchLease lets their requests out before it reads). */
  #acquiring = 0;

  /**
   * Pin `blocks` on `holder` (`host:port`) under a lease: block ids, or blocks of one of the
   * holder's numbered spaces by number (`{ owner, numbers: Uint32Array }`: block n is
   * `block:<owner>:<n>`; the owner once and the numbers packed on the wire, no string per block
   * on either side). Resolves to a guard; use it as
   * `await using lock = await client.acquire(holder, blocks)`. Rejects with typed errors
   * (InvalidInputError, ResourceExhaustedError, RemoteRejectedError, ConnectionBrokenError,
   * TimedOutError, AbortedError, ClosedError). If the call is abandoned after it may have
   * reached the holder, the possible grant is released at once.
   */
  async acquire(holder: string, blocks: readonly string[] | NumberedBlocks, options: AcquireOptions = {}): Promise<LockGuard> {
    this.#acquiring++;
    try {
      return await this.#acquire(holder, blocks, options);
    } finally {
      this.#acquiring--;
    }
  }

  async #acquire(holder: string, blocks: readonly string[] | NumberedBlocks, options: AcquireOptions): Promise<LockGuard> {
    if (this.#isClosing) throw new ClosedError('lock client is closed');
    if (typeof holder !== 'string' || holder.length === 0) throw new InvalidInputError('holder address is empty', { details: { field: 'holder' } });
    const numbered = checkBlocks(blocks);
    const leaseMs = options.leaseMs ?? 0;
    if (!Number.isFinite(leaseMs) || leaseMs < 0 || leaseMs > 0xffffffff) {
      throw new InvalidInputError(`leaseMs must be between 0 and 2^32-1, got ${leaseMs}`, { details: { field: 'leaseMs' } });
    }
    const timeoutMs = this.#timeout(options);
    const signal = options.signal;
    if (signal?.aborted) throw errorFromSignal(signal, 'acquire');
    const transports = options.transports;
    if (transports !== undefined) {
      const problem = Array.isArray(transports) ? transportsProblem(transports) : 'transports must be an array of transport names';
      if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'transports' } });
    }

    const named = transports !== undefined && transports.length > 0 ? { transports: transports as string[] } : undefined;

    // One frozen copy serves the request (the codec only reads it) and the guard; numbers: one copy.
    const ids = numbered === undefined ? Object.freeze([...(blocks as readonly string[])]) : undefined;
    const acquireId = randomToken();
    const until = now() + timeoutMs;
    const retry = this.#opts.releaseRetry ?? {};
    let delay = retry.initialDelayMs ?? 50;
    let sentAt = now();
    let res: AcquireResponseMsg;
    for (;;) {
      sentAt = now();
      try {
        res = await this.#call<AcquireResponseMsg>(
          holder,
          'acquire',
          'Acquire',
          numbered === undefined
            ? { requesterId: this.requesterId, blockIds: ids as string[], leaseMs: Math.floor(leaseMs), acquireId, omitEmptyBlocks: true, ...named }
            : { requesterId: this.requesterId, blockIds: [], blockOwner: numbered.owner, blockNumbers: numbered.numbers, leaseMs: Math.floor(leaseMs), acquireId, omitEmptyBlocks: true, ...named },
          Math.max(1, until - sentAt),
          signal,
          true,
        );
        break;
      } catch (e) {
        const error = e as TensorwireError;
        const retryAfter = error.details['retryAfterMs'];
        if (typeof retryAfter === 'number' && !this.#isClosing) {
          // The holder was past its concurrency limit and did nothing: back off, try again.
          const wait = Math.max(retryAfter, delay * (0.75 + Math.random() * 0.5));
          delay = Math.min(retry.maxDelayMs ?? 2000, delay * 2);
          if (now() + wait < until) {
            this.#acquireRetries++;
            const joined = signal === undefined ? undefined : joinSignals(signal, this.#closeController.signal);
            try {
              await sleep(wait, joined?.signal ?? this.#closeController.signal);
            } finally {
              joined?.release();
            }
            if (signal?.aborted) throw errorFromSignal(signal, 'acquire');
            if (this.#isClosing) throw new ClosedError('lock client closed during acquire');
            continue;
          }
        }
        if (mayHaveGranted(error)) {
          this.#abandoned++;
          const giveUpAt = sentAt + (leaseMs || this.#lockTimeouts.get(holder) || this.#opts.assumedLockTimeoutMs || 30_000);
          this.#track(this.#lane(holder).release({ acquireId }, giveUpAt));
        }
        throw error;
      }
    }

    this.#lockTimeouts.set(holder, res.lockTimeoutMs);
    const marginOpt = this.#opts.safetyMarginMs;
    const record: LeaseRecord = {
      holder,
      holderId: res.holderId,
      sessionId: res.sessionId,
      blockIds: ids,
      blocks: numbered,
      blockCount: numbered === undefined ? (ids as readonly string[]).length : numbered.numbers.length,
      lockTimeoutMs: res.lockTimeoutMs,
      blockGrants: res.blocks,
      descriptorMap: undefined,
      leaseDescriptors: res.leaseDescriptors ?? [],
      controller: undefined,
      endReason: undefined,
      leaseMs: res.leaseMs,
      marginMs: 0,
      deadline: sentAt + res.leaseMs,
      state: 'active',
      budgetTimer: undefined,
      autoRenew: false,
      renewEveryMs: 0,
      renewNextAt: 0,
      renewState: 0,
      releasing: undefined,
    };
    this.#acquired++;
    this.#records.add(record);
    const guard = new LockGuard(record, this, this.#ops);
    this.#finalizer.register(guard, record, record);
    if (this.#isClosing) {
      // Closed while the response was on its way: hand back nothing live.
      void this.#release(record);
      throw new ClosedError('lock client closed during acquire');
    }
    record.marginMs = this.#margin(marginOpt, record.leaseMs);
    this.#armBudget(record);
    if (options.autoRenew) {
      const every = typeof options.autoRenew === 'object' ? options.autoRenew.everyMs : undefined;
      record.renewEveryMs = Math.max(1, every ?? Math.floor(record.leaseMs / 2));
      record.autoRenew = true;
      // One timer per holder, not per lease: the holder's lane renews due leases in batches.
      this.#lane(holder).addAutoRenew(record);
    }
    return guard;
  }

  #margin(opt: LockClientOptions['safetyMarginMs'], leaseMs: number): number {
    const m = typeof opt === 'function' ? opt(leaseMs) : (opt ?? defaultMargin(leaseMs));
    return Math.min(leaseMs, Math.max(0, Number.isFinite(m) ? m : 0));
  }

  /** The guard's signal: made on first use, aborted at once if the lease already ended. */
  #signal(r: LeaseRecord): AbortSignal {
    if (r.controller === undefined) {
      r.controller = new AbortController();
      if (r.endReason !== undefined) r.controller.abort(r.endReason());
      else this.#armBudget(r);
    }
    return r.controller.signal;
  }

  /** End the guard's signal (now, or when it is first read). */
  #endSignal(r: LeaseRecord, reason: () => unknown): void {
    if (r.endReason !== undefined) return;
    r.endReason = reason;
    if (r.controller !== undefined && !r.controller.signal.aborted) r.controller.abort(reason());
  }

  #armBudget(r: LeaseRecord): void {
    if (r.budgetTimer) clearTimeout(r.budgetTimer);
    r.budgetTimer = undefined;
    if (r.controller === undefined || r.endReason !== undefined) return;
    const ms = r.deadline - r.marginMs - now();
    const fire = (): void => {
      r.budgetTimer = undefined;
      // Fire only if a renew did not move the deadline meanwhile.
      if (now() >= r.deadline - r.marginMs) {
        const sessionId = r.sessionId;
        r.controller?.abort(new TimedOutError(`transfer budget of lease ${sessionId} is used up`));
      } else this.#armBudget(r);
    };
    if (ms <= 0) fire();
    else {
      r.budgetTimer = setTimeout(fire, ms);
      r.budgetTimer.unref();
    }
  }

  /** The holder no longer knows the lease: mark it lost and fire its signal. */
  #lose(r: LeaseRecord, error: TensorwireError): void {
    if (r.state !== 'active') return;
    r.state = 'lost';
    this.#stopTimers(r);
    this.#endSignal(r, () => error);
    this.emit('leaseLost', { holder: r.holder, sessionId: r.sessionId, error });
  }

  async #renew(r: LeaseRecord, options: RenewOptions): Promise<number> {
    if (r.state === 'releasing' || r.state === 'released') throw new ClosedError(`lease ${r.sessionId} was released`);
    if (r.state === 'lost') throw new RemoteRejectedError(`lease ${r.sessionId} was lost`, { details: { remoteCode: 'NOT_FOUND' } });
    const leaseMs = options.leaseMs ?? r.leaseMs;
    if (!Number.isFinite(leaseMs) || leaseMs < 0 || leaseMs > 0xffffffff) throw new InvalidInputError(`leaseMs out of range: ${leaseMs}`);
    const sentAt = now();
    try {
      const res = await this.#call<{ deadlineUnixMs: number; leaseMs: number }>(
        r.holder,
        'renew',
        'Renew',
        { requesterId: this.requesterId, sessionId: r.sessionId, leaseMs: Math.floor(leaseMs) },
        this.#timeout(options),
        options.signal,
      );
      if (r.state === 'active') {
        r.leaseMs = res.leaseMs;
        r.deadline = Math.max(r.deadline, sentAt + res.leaseMs);
        this.#armBudget(r);
      }
      return r.deadline;
    } catch (e) {
      const error = e as TensorwireError;
      const code = error.details['grpcCode'];
      if (code === grpc.status.NOT_FOUND || code === grpc.status.PERMISSION_DENIED) this.#lose(r, error);
      throw error;
    }
  }

  #stopTimers(r: LeaseRecord): void {
    if (r.budgetTimer) clearTimeout(r.budgetTimer);
    r.budgetTimer = undefined;
    if (r.autoRenew) {
      r.autoRenew = false;
      this.#lanes.get(r.holder)?.removeAutoRenew(r);
    }
  }

  /**
   * The holder at `holder` is gone for good: discovery saw it restart (a new incarnation) or
   * disappear. Its leases died with it and the new incarnation never granted them, so every
   * live guard there is dropped without a release call: it turns `lost`, its `signal` aborts
   * with `reason`, `leaseLost` is emitted, and a later `release()` / dispose sends nothing.
   * Returns how many guards were dropped.
   */
  dropLeases(holder: string, reason: TensorwireError): number {
    let n = 0;
    for (const r of [...this.#records]) {
      if (r.holder !== holder || r.releasing || r.state === 'released') continue;
      r.state = 'lost';
      r.dropped = true;
      this.#stopTimers(r);
      this.#finalizer.unregister(r);
      this.#endSignal(r, () => reason);
      this.#records.delete(r);
      this.#dropped++;
      n++;
      this.emit('leaseLost', { holder, sessionId: r.sessionId, error: reason });
    }
    return n;
  }

  #release(r: LeaseRecord): Promise<ReleaseResult> {
    if (r.releasing) return r.releasing;
    if (r.dropped) {
      r.releasing = Promise.resolve({ confirmed: false, blocksReleased: 0, attempts: 0, error: r.endReason?.() as TensorwireError });
      return r.releasing;
    }
    r.state = 'releasing';
    this.#stopTimers(r);
    this.#finalizer.unregister(r);
    const closing = this.#isClosing;
    // The reason of an ordinary end carries no stack: capturing one cost tens of µs per lease
    // (measured on the fetch path), and where the lease was released from tells nothing.
    this.#endSignal(r, () => withoutStack(() => (closing ? new ClosedError('lock client closed') : new AbortedError(`lease ${r.sessionId} released`))));
    // Retry until the lease would have expired at the holder anyway (its deadline there is
    // never earlier than ours), and at least once.
    const p = this.#releaseLease(r);
    r.releasing = p;
    this.#pending.add(p);
    return p;
  }

  /** The release of one lease, with its bookkeeping; leaves `#pending` when done. */
  async #releaseLease(r: LeaseRecord): Promise<ReleaseResult> {
    try {
      const result = await this.#lane(r.holder).release({ sessionId: r.sessionId }, r.deadline);
      r.state = 'released';
      this.#records.delete(r);
      if (result.confirmed) this.#released++;
      else if (result.expired === true) this.#expired++;
      else this.#releaseFailures++;
      return result;
    } finally {
      // Runs after at least one await, so `#release` has stored the promise by now.
      this.#pending.delete(r.releasing as Promise<ReleaseResult>);
    }
  }

  #track(p: Promise<unknown>): void {
    this.#pending.add(p);
    void p.finally(() => this.#pending.delete(p));
  }

  #onGuardCollected(r: LeaseRecord): void {
    if (r.releasing || r.state === 'released') return;
    this.#leaked++;
    this.#logger.warn('lock: guard collected without release; releasing it now', { sessionId: r.sessionId, holder: r.holder });
    this.emit('guardLeaked', { holder: r.holder, sessionId: r.sessionId });
    void this.#release(r);
  }

  /** The holder's health. */
  health(holder: string, options: CallOptions = {}): Promise<HealthResponseMsg> {
    if (this.#isClosing) return Promise.reject(new ClosedError('lock client is closed'));
    return this.#call<HealthResponseMsg>(holder, 'health', 'Health', {}, this.#timeout(options), options.signal);
  }

  /**
   * Release every live guard, abandon acquires in flight (releasing their possible
   * grants), wait up to `closeTimeoutMs` for releases in flight, then close the channels.
   * Idempotent; never rejects.
   */
  close(): Promise<void> {
    this.#closing ??= this.#close();
    return this.#closing;
  }

  async #close(): Promise<void> {
    this.#isClosing = true;
    for (const cancel of [...this.#inflight]) cancel(new ClosedError('lock client closed'));
    // Let the cancelled acquires' handlers run: each registers the release of a grant that may
    // have happened, and close must wait for those too.
    await new Promise<void>((resolve) => setImmediate(resolve));
    this.#closeController.abort(new ClosedError('lock client closed'));
    const limit = this.#opts.closeTimeoutMs ?? 5000;
    this.#closeDeadline = now() + limit;
    const lanes = [...this.#lanes.values()];
    for (const r of this.#records) void this.#release(r);
    // Each lane sends what is queued (retrying failures during its first second), and at the
    // limit cancels its calls in flight and fails what is left: every release then resolves.
    await Promise.all(lanes.map((lane) => lane.close(limit)));
    while (this.#pending.size > 0) await Promise.allSettled([...this.#pending]);
    for (const s of this.#sessions.values()) s.close();
    this.#sessions.clear();
    for (const c of this.#channels.values()) c.close();
    this.#channels.clear();
    this.#metrics.unregister();
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

/** `make()` with stack capture off: for errors that only say why a signal ended. */
function withoutStack<T>(make: () => T): T {
  const limit = Error.stackTraceLimit;
  Error.stackTraceLimit = 0;
  try {
    return make();
  } finally {
    Error.stackTraceLimit = limit;
  }
}
