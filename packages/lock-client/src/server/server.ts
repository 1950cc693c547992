/**
 * The holder side: a gRPC LockService over a {@link LeaseTable}, with the expiry GC,
 * optional shared-token authentication and TLS, prom-client metrics and graceful shutdown.
 */
import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import { createServer as createNetServer, type Server as NetServer, type Socket } from 'node:net';
import * as grpc from '@grpc/grpc-js';
import { InvalidInputError, ResourceExhaustedError, ownerProblem, silentLogger, type Logger } from '@tensorwire/core';
import { Registry } from 'prom-client';
import { transportsProblem } from '../hints.js';
import { LeaseError, type LeaseStatus } from '../errors.js';
import { LANE_MAX_FRAME_BYTES, LANE_SUPPORTED, LaneFrames, laneAddress, laneFrame } from '../lane.js';
import {
  AUTH_METADATA_KEY,
  RETRY_AFTER_METADATA_KEY,
  loadLockProtocol,
  retryAfterOf,
  type AcquireRequestMsg,
  type AcquireResponseMsg,
  type EntryErrorMsg,
  type HealthResponseMsg,
  type ReleaseManyRequestMsg,
  type ReleaseManyResponseMsg,
  type ReleaseRequestMsg,
  type ReleaseResponseMsg,
  type RenewManyRequestMsg,
  type RenewManyResponseMsg,
  type RenewRequestMsg,
  type RenewResponseMsg,
  type SessionRequestMsg,
  type SessionResponseMsg,
} from '../proto.js';
import { isLockMethod, methodCodecs } from '../session.js';
import { ExpiryScheduler, type Timers } from './expiry.js';
import { LeaseTable, type LeaseCounters, type LeaseEndReason, type LeaseInfo, type LeaseTableOptions } from './lease-table.js';
import { LaneServerStream } from './lane.js';
import { DEFAULT_SERVER_METRICS_PREFIX, registerServerMetrics } from './metrics.js';

/** One block's transfer descriptors: opaque bytes, one per transport the holder serves. */
export type BlockDescriptors = Uint8Array | readonly Uint8Array[];

/**
 * Maps the blocks of a fresh lease to their transfer descriptors, in request order. The
 * descriptors should be scoped to the lease (for example carry a token the transport
 * checks) and revoked in `revoke`. May be async; the blocks are pinned before it runs. For a
 * lease of numbered blocks, `blockIds` are their ids (`block:<owner>:<n>`) and `lease.blocks`
 * has the numbers.
 */
export type BlockResolver = (blockIds: readonly string[], lease: LeaseInfo, hints: AcquireHints) => ResolvedLease | Promise<ResolvedLease>;

/**
 * What the requester's acquire said about how it will use the lease, for a resolver to honour
 * or ignore. `transports`: the transports it will read the blocks through (checked names, at
 * most `MAX_ACQUIRE_TRANSPORTS`, no duplicates; empty when it named none): a resolver
 * that grants per lease may grant over these only (`engineGrants` does).
 */
export interface AcquireHints {
  readonly transports: readonly string[];
}

const NO_HINTS: AcquireHints = Object.freeze({ transports: Object.freeze([]) as readonly string[] });

/** The hints of an acquire request, or why they are refused. */
export function acquireHints(transports: readonly unknown[] | undefined): AcquireHints | string {
  if (transports === undefined || transports.length === 0) return NO_HINTS;
  const problem = transportsProblem(transports);
  if (problem !== undefined) return problem;
  return Object.freeze({ transports: Object.freeze([...(transports as readonly string[])]) });
}

/**
 * What a resolver returns: one entry per block (request order), or descriptors for the whole
 * lease (`lease`, e.g. one range grant over every block) with optional per-block ones.
 */
export type ResolvedLease = readonly BlockDescriptors[] | { readonly lease: readonly Uint8Array[]; readonly blocks?: readonly BlockDescriptors[] };

export interface LockServerOptions extends Omit<LeaseTableOptions, 'onEnd' | 'onReject' | 'logger'> {
  /** Block ids → descriptors. Default: no descriptors. */
  readonly resolve?: BlockResolver;
  /**
   * Instead of `resolve` (not both): the same, given only the lease. Its ids are
   * `lease.blockIds`; a lease by number (`lease.blocks`) then costs no id string unless the
   * resolver asks for them (`engineGrants` does not).
   */
  readonly resolveLease?: (lease: LeaseInfo, hints: AcquireHints) => ResolvedLease | Promise<ResolvedLease>;
  /** A lease ended (released, expired, abandoned, shutdown): revoke its grants. Runs before the unpins it causes. */
  readonly revoke?: (lease: LeaseInfo, reason: LeaseEndReason) => void;
  /** Require `authorization: Bearer <token>` on every call. */
  readonly token?: string;
  /** Where to register metrics (default: a private Registry, see `registry`). */
  readonly registry?: Registry;
  /** Metric name prefix (default `tensorwire_lock_`). */
  readonly metricsPrefix?: string;
  readonly logger?: Logger;
  /** Timers for the expiry GC (tests). */
  readonly timers?: Timers;
  /** Extra grpc-js server options. */
  readonly grpcOptions?: grpc.ServerOptions;
  /**
   * Calls being worked on at once (an acquire waiting for its resolver counts until it is
   * answered). Past it, a call is answered RESOURCE_EXHAUSTED at once, before any work, with
   * the trailer `tensorwire-retry-after-ms`, and the requester retries later. Default 1024.
   */
  readonly maxConcurrentCalls?: number;
  /** The wait suggested to a requester refused for overload (ms, default 50). */
  readonly retryAfterMs?: number;
  /** Entries in one ReleaseMany / RenewMany at most; more → RESOURCE_EXHAUSTED (default 8192). */
  readonly maxBatchEntries?: number;
  /**
   * Offer a local lane (Linux): `listen()` also binds an abstract Unix socket with a random
   * name, announced in `Health` (`localLane`), over which requesters on this host send the
   * `Session` messages without gRPC (see `LockClientOptions.localLane`). Same handlers, auth
   * (the hello carries the requester's authorization value), limits and answers. Default:
   * on when `listen()` is given insecure credentials, off with TLS (the lane has no TLS, so it
   * is never offered beside it); `false` turns it off.
   */
  readonly localLane?: boolean;
  /** Local lane connections open at once at most (default 1024); more are closed at once. */
  readonly maxLaneConnections?: number;
}

export interface CloseOptions {
  /** How long to let requesters release before revoking what is left (ms, default 5000). */
  readonly graceMs?: number;
}

export type RpcName = 'acquire' | 'release' | 'renew' | 'health' | 'releaseMany' | 'renewMany';

/** Lease counters plus the RPCs received. `rejected` counts every refused RPC (auth included). */
export interface LockServerCounters extends LeaseCounters {
  readonly requests: Readonly<Record<RpcName, number>>;
  /** Calls refused at once because `maxConcurrentCalls` were being worked on. */
  readonly overloaded: number;
  /** Calls dropped before any work because their caller's deadline had passed or they were cancelled. */
  readonly droppedExpired: number;
  /** Entries received in ReleaseMany calls. */
  readonly releaseEntries: number;
  /** Entries received in RenewMany calls. */
  readonly renewEntries: number;
  /** Calls being worked on now. */
  readonly inFlight: number;
}

const DEFAULT_MAX_CONCURRENT_CALLS = 1024;
/** How long a local lane connection may take to send its hello. */
const LANE_HELLO_MS = 5000;
const DEFAULT_MAX_BATCH_ENTRIES = 8192;

/** The caller's deadline as Unix ms (Infinity when none). */
function deadlineOf(call: grpc.ServerUnaryCall<unknown, unknown>): number {
  const d = call.getDeadline();
  return d instanceof Date ? d.getTime() : d;
}

const EMPTY: readonly Uint8Array[] = [];
const EMPTY_PAYLOAD = Buffer.alloc(0);

function digest(token: string): Buffer {
  return createHash('sha256').update(token).digest();
}

function toServiceError(code: grpc.status, details: string): Partial<grpc.ServiceError> {
  return { code, details, metadata: new grpc.Metadata() };
}

/** The status a hook's error is answered with. */
function hookStatus(error: unknown): { status: LeaseStatus; message: string } {
  if (error instanceof LeaseError) return { status: error.status, message: error.message };
  const message = error instanceof Error ? error.message : String(error);
  if (error instanceof InvalidInputError) return { status: 'INVALID_ARGUMENT', message };
  if (error instanceof ResourceExhaustedError) return { status: 'RESOURCE_EXHAUSTED', message };
  return { status: 'INTERNAL', message: `holder hook failed: ${message}` };
}

export class LockServer implements AsyncDisposable {
  readonly table: LeaseTable;
  readonly gc: ExpiryScheduler;
  /** The registry the metrics are on (the one passed in, or a private one). */
  readonly registry: Registry;
  readonly #resolve: ((lease: LeaseInfo, hints: AcquireHints) => ResolvedLease | Promise<ResolvedLease>) | undefined;
  readonly #logger: Logger;
  readonly #server: grpc.Server;
  readonly #tokenDigest: Buffer | undefined;
  readonly #requests: Record<RpcName, number> = { acquire: 0, release: 0, renew: 0, health: 0, releaseMany: 0, renewMany: 0 };
  readonly #maxConcurrent: number;
  readonly #retryAfter: grpc.Metadata;
  readonly #maxBatch: number;
  /** Entries per batched call, for the `batch_entries` histogram (observed at each call). */
  readonly #observeBatch: (op: 'releaseMany' | 'renewMany', entries: number) => void;
  #inFlight = 0;
  #overloaded = 0;
  #droppedExpired = 0;
  #releaseEntries = 0;
  #renewEntries = 0;
  readonly #rejections = new Map<string, number>();
  readonly #unregisterMetrics: () => void;
  readonly #drainWaiters: (() => void)[] = [];
  /** Open Session streams: ended at shutdown (a graceful gRPC shutdown waits for open calls). */
  readonly #sessions = new Set<() => void>();
  /** Acquires whose resolver (the grant) is still working: Session releases wait behind them. */
  #granting = 0;
  #state: 'idle' | 'serving' | 'draining' | 'closed' = 'idle';
  #port = 0;
  /** The service implementation registered on the gRPC server; the local lane dispatches to it too. */
  readonly #handlers: grpc.UntypedServiceImplementation;
  readonly #laneEnabled: boolean | undefined;
  readonly #maxLaneConnections: number;
  /** Largest lane frame read: the gRPC server's receive limit. */
  readonly #laneMaxFrame: number;
  #lane: { readonly name: string; readonly server: NetServer; readonly sockets: Set<Socket> } | undefined;
  #closing: Promise<void> | undefined;

  constructor(options: LockServerOptions) {
    this.#logger = options.logger ?? silentLogger;
    if (options.token !== undefined && options.token.length === 0) throw new InvalidInputError('token must not be empty');
    this.#tokenDigest = options.token === undefined ? undefined : digest(options.token);
    this.#maxConcurrent = options.maxConcurrentCalls ?? DEFAULT_MAX_CONCURRENT_CALLS;
    if (!(this.#maxConcurrent >= 1)) throw new InvalidInputError(`maxConcurrentCalls must be at least 1, got ${this.#maxConcurrent}`);
    this.#maxBatch = options.maxBatchEntries ?? DEFAULT_MAX_BATCH_ENTRIES;
    if (!(this.#maxBatch >= 1)) throw new InvalidInputError(`maxBatchEntries must be at least 1, got ${this.#maxBatch}`);
    this.#retryAfter = new grpc.Metadata();
    this.#retryAfter.set(RETRY_AFTER_METADATA_KEY, String(Math.max(0, Math.round(options.retryAfterMs ?? 50))));
    if (options.resolve !== undefined && options.resolveLease !== undefined) throw new LeaseError('INVALID_ARGUMENT', 'give resolve or resolveLease, not both');
    const byIds = options.resolve;
    this.#resolve = options.resolveLease ?? (byIds === undefined ? undefined : (lease, hints) => byIds(lease.blockIds, lease, hints));
    this.table = new LeaseTable({
      ...options,
      logger: this.#logger,
      onEnd: (lease, reason) => {
        options.revoke?.(lease, reason);
        if (reason === 'expired') this.#logger.info('lock: lease expired', { sessionId: lease.sessionId, requesterId: lease.requesterId });
      },
    });
    this.gc = new ExpiryScheduler(this.table, {
      ...(options.timers ? { timers: options.timers } : {}),
      onSweep: () => this.#checkDrained(),
    });
    this.registry = options.registry ?? new Registry();
    const requests = new Map<string, number>();
    const metrics = registerServerMetrics(this.registry, options.metricsPrefix ?? DEFAULT_SERVER_METRICS_PREFIX, {
      counters: () => this.table.counters(),
      requests: () => {
        for (const [k, v] of Object.entries(this.#requests)) requests.set(k, v);
        return requests;
      },
      rejections: () => this.#rejections,
      load: () => this.counters(),
    });
    this.#observeBatch = metrics.observeBatch;
    this.#unregisterMetrics = metrics.unregister;
    this.#server = new grpc.Server(options.grpcOptions);
    this.#handlers = this.handlers();
    this.#server.addService(loadLockProtocol().service, this.#handlers);
    this.#laneEnabled = options.localLane;
    this.#maxLaneConnections = options.maxLaneConnections ?? 1024;
    if (!(Number.isSafeInteger(this.#maxLaneConnections) && this.#maxLaneConnections >= 1)) {
      throw new InvalidInputError(`maxLaneConnections must be a positive integer, got ${String(options.maxLaneConnections)}`);
    }
    const maxReceive = options.grpcOptions?.['grpc.max_receive_message_length'];
    this.#laneMaxFrame = typeof maxReceive === 'number' && maxReceive > 0 ? maxReceive : LANE_MAX_FRAME_BYTES;
  }

  /** The name of the local lane's abstract socket while it is offered (see {@link LockServerOptions.localLane}). */
  get localLane(): string | undefined {
    return this.#lane?.name;
  }

  /** The bound port (after `listen`). */
  get port(): number {
    return this.#port;
  }

  get holderId(): string {
    return this.table.holderId;
  }

  /** 'idle' before listen, 'serving', 'draining' during close, 'closed'. */
  get state(): 'idle' | 'serving' | 'draining' | 'closed' {
    return this.#state;
  }

  /**
   * Bind and serve. `address` defaults to `127.0.0.1:0` (any free port); pass
   * `grpc.ServerCredentials.createSsl(...)` for TLS. Resolves to the bound port.
   */
  async listen(address = '127.0.0.1:0', credentials: grpc.ServerCredentials = grpc.ServerCredentials.createInsecure()): Promise<number> {
    if (this.#state !== 'idle') throw new InvalidInputError(`listen() on a server that is ${this.#state}`);
    this.#port = await new Promise<number>((resolve, reject) => {
      this.#server.bindAsync(address, credentials, (err, port) => (err ? reject(err) : resolve(port)));
    });
    if (this.#laneEnabled !== false && LANE_SUPPORTED && !credentials._isSecure()) await this.#listenLane();
    this.#state = 'serving';
    this.gc.start();
    return this.#port;
  }

  counters(): LockServerCounters {
    let rejected = 0;
    for (const v of this.#rejections.values()) rejected += v;
    return {
      ...this.table.counters(),
      rejected,
      requests: { ...this.#requests },
      overloaded: this.#overloaded,
      droppedExpired: this.#droppedExpired,
      releaseEntries: this.#releaseEntries,
      renewEntries: this.#renewEntries,
      inFlight: this.#inFlight,
    };
  }

  /**
   * The service implementation, for adding to a grpc.Server you own
   * (`server.addService(loadLockProtocol().service, lockServer.handlers())`). The GC then
   * runs once `listen()` is called, or call `gc.start()` yourself.
   */
  handlers(): grpc.UntypedServiceImplementation {
    // Session messages are dispatched to this object's methods when they arrive, so a method
    // replaced on it (mounted on your own server) serves its Session messages too.
    const handlers: grpc.UntypedServiceImplementation = {
      Acquire: (call: grpc.ServerUnaryCall<AcquireRequestMsg, AcquireResponseMsg>, cb: grpc.sendUnaryData<AcquireResponseMsg>) => {
        const done = this.#admit('acquire', call, cb);
        if (done !== undefined) this.#acquire(call, done);
      },
      Release: (call: grpc.ServerUnaryCall<ReleaseRequestMsg, ReleaseResponseMsg>, cb: grpc.sendUnaryData<ReleaseResponseMsg>) => {
        const done = this.#admit('release', call, cb);
        if (done !== undefined) this.#release(call, done);
      },
      Renew: (call: grpc.ServerUnaryCall<RenewRequestMsg, RenewResponseMsg>, cb: grpc.sendUnaryData<RenewResponseMsg>) => {
        const done = this.#admit('renew', call, cb);
        if (done !== undefined) this.#renew(call, done);
      },
      Health: (call: grpc.ServerUnaryCall<unknown, HealthResponseMsg>, cb: grpc.sendUnaryData<HealthResponseMsg>) => {
        // Health is never refused for load: it is how a requester sees the load.
        if (this.#authorized('health', call, cb)) this.#health(call, cb);
      },
      ReleaseMany: (call: grpc.ServerUnaryCall<ReleaseManyRequestMsg, ReleaseManyResponseMsg>, cb: grpc.sendUnaryData<ReleaseManyResponseMsg>) => {
        const done = this.#admit('releaseMany', call, cb);
        if (done !== undefined) this.#releaseMany(call, done);
      },
      RenewMany: (call: grpc.ServerUnaryCall<RenewManyRequestMsg, RenewManyResponseMsg>, cb: grpc.sendUnaryData<RenewManyResponseMsg>) => {
        const done = this.#admit('renewMany', call, cb);
        if (done !== undefined) this.#renewMany(call, done);
      },
      Session: (stream: grpc.ServerDuplexStream<SessionRequestMsg, SessionResponseMsg>) => this.#session(stream, handlers),
    };
    return handlers;
  }

  /**
   * A Session stream: each message is one call of a unary method, handled by that method's
   * handler exactly as the unary call would be (auth from the stream's metadata, admission,
   * the deadline the message carries from its arrival, `cancelled` once the stream is gone or
   * the deadline has passed) and answered once with its id and status. A handler that throws
   * is answered UNKNOWN, as grpc-js answers a unary handler that throws. Answers wait for the
   * requester to read them: when the stream's send buffer is full the stream is not read until
   * it drains, so a requester that sends without reading is held back by HTTP/2 flow control,
   * not buffered here. A requester that half-closes still gets every answer: the stream ends
   * once the last one is written. At shutdown the stream ends at once.
   */
  #session(stream: grpc.ServerDuplexStream<SessionRequestMsg, SessionResponseMsg> | LaneServerStream, handlers: grpc.UntypedServiceImplementation): void {
    const { codec } = loadLockProtocol();
    let ended = false;
    let paused = false;
    let halfClosed = false;
    let outstanding = 0; // messages dispatched and not answered yet
    const end = (): void => {
      if (ended) return;
      ended = true;
      this.#sessions.delete(end);
      try {
        stream.end();
      } catch {
        // already gone
      }
    };
    const gone = (): void => {
      ended = true;
      this.#sessions.delete(end);
    };
    this.#sessions.add(end);
    const write = (m: SessionResponseMsg): void => {
      if (ended || stream.cancelled) return;
      if (!stream.write(m) && !paused) {
        paused = true;
        stream.pause();
        stream.once('drain', () => {
          paused = false;
          if (!ended) stream.resume();
        });
      }
    };
    stream.on('data', (m: SessionRequestMsg) => {
      outstanding++;
      // A release that comes while acquires are being granted (a fetch loop's release arrives
      // with its next acquire) waits one turn of the event loop: the grant's awaits would
      // otherwise let the release's work run first and delay the acquire's answer, which the
      // requester is waiting for, while nobody waits for the release's.
      if (this.#granting > 0 && (m.method === 'ReleaseMany' || m.method === 'Release')) setImmediate(dispatch, m);
      else dispatch(m);
    });
    const dispatch = (m: SessionRequestMsg): void => {
      const id = m.id;
      let answered = false;
      const answer = (r: SessionResponseMsg): void => {
        if (answered) return;
        answered = true;
        outstanding--;
        write(r);
        if (halfClosed && outstanding === 0) end();
      };
      const fail = (code: grpc.status, details: string, retryAfterMs?: number): void =>
        answer({ id, code, details, payload: EMPTY_PAYLOAD, ...(retryAfterMs !== undefined ? { retryAfterMs } : {}) });
      if (!isLockMethod(m.method)) {
        fail(grpc.status.UNIMPLEMENTED, `no method ${JSON.stringify(m.method.slice(0, 64))} in a session`);
        return;
      }
      const handler = handlers[m.method];
      if (typeof handler !== 'function') {
        fail(grpc.status.UNIMPLEMENTED, `method ${m.method} is not served here`);
        return;
      }
      const codecs = methodCodecs(codec, m.method);
      let request: unknown;
      try {
        request = codecs.request.decode(m.payload);
      } catch (e) {
        fail(grpc.status.INTERNAL, `request does not decode: ${e instanceof Error ? e.message : String(e)}`);
        return;
      }
      const deadline = m.timeoutMs > 0 ? Date.now() + m.timeoutMs : Number.POSITIVE_INFINITY;
      // What a handler may use of a grpc-js ServerUnaryCall; the rest is the stream's.
      const call = {
        request,
        metadata: stream.metadata,
        get cancelled(): boolean {
          return ended || stream.cancelled || Date.now() > deadline;
        },
        getDeadline: (): number => deadline,
        getPeer: (): string => stream.getPeer(),
        getPath: (): string => stream.getPath(),
        getAuthContext: (): ReturnType<typeof stream.getAuthContext> => stream.getAuthContext(),
        sendMetadata: (): void => undefined,
        on(event: string, listener: () => void) {
          if (event === 'cancelled') stream.once('cancelled', listener);
          return call;
        },
      };
      const cb = (err: Partial<grpc.ServiceError> | null, value?: unknown): void => {
        if (err) {
          fail(err.code ?? grpc.status.UNKNOWN, err.details ?? err.message ?? '', retryAfterOf(err));
          return;
        }
        let payload: Buffer;
        try {
          payload = codecs.response.encode(value);
        } catch (e) {
          fail(grpc.status.INTERNAL, `response does not encode: ${e instanceof Error ? e.message : String(e)}`);
          return;
        }
        answer({ id, code: grpc.status.OK, details: '', payload });
      };
      try {
        (handler as (call: unknown, cb: unknown) => void)(call, cb);
      } catch (e) {
        this.#logger.warn('lock: a handler threw on a session message', { method: m.method, error: e instanceof Error ? e.message : String(e) });
        fail(grpc.status.UNKNOWN, `the holder's ${m.method} handler threw`);
      }
    };
    stream.on('end', () => {
      halfClosed = true;
      if (outstanding === 0) end();
    });
    stream.on('cancelled', gone);
    stream.on('error', gone);
  }

  /**
   * Admission, before any work: authentication; a call whose caller's deadline has already
   * passed (or that was cancelled) is dropped, since nobody waits for its answer; past
   * `maxConcurrentCalls` the call is refused RESOURCE_EXHAUSTED with a retry-after trailer.
   * Returns the callback to answer with (it ends the call's turn in the concurrency count),
   * or undefined when the call was answered here.
   */
  #admit<T>(op: RpcName, call: grpc.ServerUnaryCall<unknown, unknown>, cb: grpc.sendUnaryData<T>): grpc.sendUnaryData<T> | undefined {
    if (!this.#authorized(op, call, cb as grpc.sendUnaryData<never>)) return undefined;
    if (call.cancelled || deadlineOf(call) <= Date.now()) {
      this.#droppedExpired++;
      const key = `${op}/DEADLINE_EXCEEDED`;
      this.#rejections.set(key, (this.#rejections.get(key) ?? 0) + 1);
      cb(toServiceError(grpc.status.DEADLINE_EXCEEDED, 'deadline passed before the holder got to the call; nothing was done'), null);
      return undefined;
    }
    if (this.#inFlight >= this.#maxConcurrent) {
      this.#overloaded++;
      const key = `${op}/RESOURCE_EXHAUSTED`;
      this.#rejections.set(key, (this.#rejections.get(key) ?? 0) + 1);
      cb({ code: grpc.status.RESOURCE_EXHAUSTED, details: `holder ${this.holderId} is past its concurrency limit (${this.#maxConcurrent}); nothing was done`, metadata: this.#retryAfter.clone() }, null);
      return undefined;
    }
    this.#inFlight++;
    let answered = false;
    return (err, value) => {
      if (!answered) {
        answered = true;
        this.#inFlight--;
      }
      cb(err, value);
    };
  }

  #fail<T>(op: RpcName, cb: grpc.sendUnaryData<T>, statusName: LeaseStatus, message: string): void {
    const key = `${op}/${statusName}`;
    this.#rejections.set(key, (this.#rejections.get(key) ?? 0) + 1);
    cb(toServiceError(grpc.status[statusName], message), null);
  }

  #authorized(op: RpcName, call: grpc.ServerUnaryCall<unknown, unknown>, cb: grpc.sendUnaryData<never>): boolean {
    this.#requests[op]++;
    if (this.#tokenDigest === undefined) return true;
    const values = call.metadata.get(AUTH_METADATA_KEY);
    const value = values.length === 1 && typeof values[0] === 'string' ? values[0] : '';
    const token = value.startsWith('Bearer ') ? value.slice(7) : '';
    if (token !== '' && timingSafeEqual(digest(token), this.#tokenDigest)) return true;
    this.#fail(op, cb, 'UNAUTHENTICATED', token === '' ? 'missing bearer token' : 'wrong token');
    return false;
  }

  #acquire(call: grpc.ServerUnaryCall<AcquireRequestMsg, AcquireResponseMsg>, cb: grpc.sendUnaryData<AcquireResponseMsg>): void {
    // 'idle' serves too: the handlers may be mounted on the caller's own grpc.Server (handlers()).
    if (this.#state === 'draining' || this.#state === 'closed') {
      this.#fail('acquire', cb, 'UNAVAILABLE', `holder ${this.holderId} is shutting down`);
      return;
    }
    const req = call.request;
    // Blocks by id, or by number in one of the holder's numbered spaces (owner once, numbers packed).
    const byNumber = (req.blockNumbers !== undefined && req.blockNumbers.length > 0) || (req.blockOwner !== undefined && req.blockOwner !== '');
    if (byNumber && req.blockIds.length > 0) {
      this.#fail('acquire', cb, 'INVALID_ARGUMENT', 'give block ids or block numbers, not both');
      return;
    }
    const hints = acquireHints(req.transports);
    if (typeof hints === 'string') {
      this.#fail('acquire', cb, 'INVALID_ARGUMENT', hints);
      return;
    }
    let lease: LeaseInfo;
    try {
      const blocks = byNumber ? { owner: req.blockOwner ?? '', numbers: Uint32Array.from(req.blockNumbers ?? []) } : req.blockIds;
      lease = this.table.acquire(req.requesterId, blocks, { leaseMs: req.leaseMs, acquireId: req.acquireId });
    } catch (e) {
      const { status, message } = hookStatus(e);
      this.#fail('acquire', cb, status, message);
      return;
    }
    this.gc.notify();
    const resolve = this.#resolve;
    if (resolve === undefined) {
      this.#grant(call, cb, lease, undefined);
      return;
    }
    let result: ResolvedLease | Promise<ResolvedLease>;
    try {
      result = resolve(lease, hints);
    } catch (e) {
      this.#resolveFailed(cb, lease, e);
      return;
    }
    if (!(result instanceof Promise)) this.#grant(call, cb, lease, result);
    else {
      this.#granting++;
      result.then(
        (descriptors) => {
          this.#granting--;
          this.#grant(call, cb, lease, descriptors);
        },
        (e: unknown) => {
          this.#granting--;
          this.#resolveFailed(cb, lease, e);
        },
      );
    }
  }

  #resolveFailed(cb: grpc.sendUnaryData<AcquireResponseMsg>, lease: LeaseInfo, e: unknown): void {
    this.table.abandon(lease.sessionId);
    this.#checkDrained();
    const { status, message } = hookStatus(e);
    this.#fail('acquire', cb, status, message);
  }

  #grant(
    call: grpc.ServerUnaryCall<AcquireRequestMsg, AcquireResponseMsg>,
    cb: grpc.sendUnaryData<AcquireResponseMsg>,
    lease: LeaseInfo,
    resolved: ResolvedLease | undefined,
  ): void {
    if (this.table.get(lease.sessionId) !== lease) {
      // Released by acquire id (the requester gave up) or expired while resolving.
      this.#fail('acquire', cb, 'ABORTED', `lease ${lease.sessionId} ended before it was granted`);
      return;
    }
    if (call.cancelled) {
      // The requester will never see this grant: give it back now rather than at expiry.
      this.table.abandon(lease.sessionId);
      this.#checkDrained();
      this.#fail('acquire', cb, 'ABORTED', 'call cancelled');
      return;
    }
    const blocks: AcquireResponseMsg['blocks'] = [];
    let leaseDescriptors: Uint8Array[] = [];
    let descriptors: readonly BlockDescriptors[] | undefined;
    if (resolved !== undefined && !Array.isArray(resolved)) {
      const r = resolved as { lease?: unknown; blocks?: readonly BlockDescriptors[] };
      if (!Array.isArray(r.lease) || !r.lease.every((d) => d instanceof Uint8Array)) {
        this.#resolveFailed(cb, lease, new Error('resolver returned lease descriptors that are not a list of bytes'));
        return;
      }
      leaseDescriptors = r.lease as Uint8Array[];
      descriptors = r.blocks;
    } else descriptors = resolved as readonly BlockDescriptors[] | undefined;
    if (descriptors !== undefined && (!Array.isArray(descriptors) || descriptors.length !== lease.blockCount)) {
      this.#resolveFailed(cb, lease, new Error(`resolver returned ${Array.isArray(descriptors) ? descriptors.length : typeof descriptors} entries for ${lease.blockCount} blocks`));
      return;
    }
    // Bytes only: anything else would fail in the response encoder, after the lease was granted.
    const isBytes = (d: unknown): boolean => d instanceof Uint8Array || (Array.isArray(d) && d.every((x) => x instanceof Uint8Array));
    if (descriptors !== undefined && !descriptors.every((d) => d === undefined || isBytes(d))) {
      this.#resolveFailed(cb, lease, new Error('resolver returned a block descriptor that is not bytes or a list of bytes'));
      return;
    }
    // A requester that set omit_empty_blocks gets only the blocks that have descriptors: a
    // lease covered by its lease descriptors (one range grant) then answers in a few hundred
    // bytes instead of one entry per block.
    const omitEmpty = call.request.omitEmptyBlocks === true;
    if (descriptors !== undefined || !omitEmpty) {
      const ids = lease.blockIds;
      for (let i = 0; i < ids.length; i++) {
        const d = descriptors?.[i];
        const list = d === undefined ? EMPTY : d instanceof Uint8Array ? [d] : d;
        if (omitEmpty && list.length === 0) continue;
        blocks.push({ blockId: ids[i] as string, descriptors: list as Uint8Array[] });
      }
    }
    cb(null, {
      sessionId: lease.sessionId,
      deadlineUnixMs: Math.round(lease.deadline),
      leaseMs: lease.leaseMs,
      lockTimeoutMs: this.table.lockTimeoutMs,
      blocks,
      holderId: this.holderId,
      leaseDescriptors,
    });
  }

  #release(call: grpc.ServerUnaryCall<ReleaseRequestMsg, ReleaseResponseMsg>, cb: grpc.sendUnaryData<ReleaseResponseMsg>): void {
    const req = call.request;
    let released: number;
    try {
      released = this.table.release(req.requesterId, { sessionId: req.sessionId, acquireId: req.acquireId });
    } catch (e) {
      const { status, message } = hookStatus(e);
      this.#fail('release', cb, status, message);
      return;
    }
    this.#checkDrained();
    cb(null, { released });
  }

  #renew(call: grpc.ServerUnaryCall<RenewRequestMsg, RenewResponseMsg>, cb: grpc.sendUnaryData<RenewResponseMsg>): void {
    const req = call.request;
    let lease: LeaseInfo;
    try {
      lease = this.table.renew(req.requesterId, req.sessionId, req.leaseMs);
    } catch (e) {
      // The renew swept the leases past their deadline first: the last one may have ended here.
      this.#checkDrained();
      const { status, message } = hookStatus(e);
      this.#fail('renew', cb, status, message);
      return;
    }
    this.#checkDrained();
    this.gc.notify();
    cb(null, { deadlineUnixMs: Math.round(lease.deadline), leaseMs: lease.leaseMs });
  }

  #releaseMany(call: grpc.ServerUnaryCall<ReleaseManyRequestMsg, ReleaseManyResponseMsg>, cb: grpc.sendUnaryData<ReleaseManyResponseMsg>): void {
    const req = call.request;
    const sessionIds = req.sessionIds;
    const acquireIds = req.acquireIds;
    const n = sessionIds.length + acquireIds.length;
    if (n > this.#maxBatch) {
      this.#fail('releaseMany', cb, 'RESOURCE_EXHAUSTED', `${n} entries in one ReleaseMany; at most ${this.#maxBatch}`);
      return;
    }
    const problem = ownerProblem(req.requesterId);
    if (problem !== undefined) {
      this.#fail('releaseMany', cb, 'INVALID_ARGUMENT', `requester id: ${problem}`);
      return;
    }
    this.#releaseEntries += n;
    this.#observeBatch('releaseMany', n);
    const released: number[] = new Array<number>(n);
    const errors: EntryErrorMsg[] = [];
    const requesterId = req.requesterId;
    const target: { sessionId?: string; acquireId?: string } = {};
    for (let i = 0; i < n; i++) {
      if (i < sessionIds.length) {
        target.sessionId = sessionIds[i] as string;
        target.acquireId = '';
      } else {
        target.sessionId = '';
        target.acquireId = acquireIds[i - sessionIds.length] as string;
      }
      try {
        released[i] = this.table.release(requesterId, target);
      } catch (e) {
        released[i] = 0;
        const { status, message } = hookStatus(e);
        const key = `releaseMany/${status}`;
        this.#rejections.set(key, (this.#rejections.get(key) ?? 0) + 1);
        errors.push({ index: i, code: grpc.status[status], message });
      }
    }
    this.#checkDrained();
    cb(null, { released, errors });
  }

  #renewMany(call: grpc.ServerUnaryCall<RenewManyRequestMsg, RenewManyResponseMsg>, cb: grpc.sendUnaryData<RenewManyResponseMsg>): void {
    const req = call.request;
    const sessionIds = req.sessionIds;
    const n = sessionIds.length;
    if (n > this.#maxBatch) {
      this.#fail('renewMany', cb, 'RESOURCE_EXHAUSTED', `${n} entries in one RenewMany; at most ${this.#maxBatch}`);
      return;
    }
    if (req.leaseMs.length !== 0 && req.leaseMs.length !== n) {
      this.#fail('renewMany', cb, 'INVALID_ARGUMENT', `${req.leaseMs.length} lease_ms for ${n} sessions`);
      return;
    }
    const problem = ownerProblem(req.requesterId);
    if (problem !== undefined) {
      this.#fail('renewMany', cb, 'INVALID_ARGUMENT', `requester id: ${problem}`);
      return;
    }
    this.#renewEntries += n;
    this.#observeBatch('renewMany', n);
    const deadlines: number[] = new Array<number>(n);
    const leaseMs: number[] = new Array<number>(n);
    const errors: EntryErrorMsg[] = [];
    for (let i = 0; i < n; i++) {
      try {
        const lease = this.table.renew(req.requesterId, sessionIds[i] as string, req.leaseMs.length === 0 ? 0 : (req.leaseMs[i] as number));
        deadlines[i] = Math.round(lease.deadline);
        leaseMs[i] = lease.leaseMs;
      } catch (e) {
        deadlines[i] = 0;
        leaseMs[i] = 0;
        const { status, message } = hookStatus(e);
        const key = `renewMany/${status}`;
        this.#rejections.set(key, (this.#rejections.get(key) ?? 0) + 1);
        errors.push({ index: i, code: grpc.status[status], message });
      }
    }
    // Each renew swept the leases past their deadline first: the last one may have ended here.
    this.#checkDrained();
    this.gc.notify();
    cb(null, { deadlineUnixMs: deadlines, leaseMs, errors });
  }

  #health(_call: grpc.ServerUnaryCall<unknown, HealthResponseMsg>, cb: grpc.sendUnaryData<HealthResponseMsg>): void {
    const c = this.table.counters();
    cb(null, {
      status: this.#state === 'serving' ? 'SERVING' : 'DRAINING',
      holderId: this.holderId,
      lockTimeoutMs: this.table.lockTimeoutMs,
      activeSessions: c.active,
      activeBlocks: c.activeBlocks,
      localLane: this.#lane?.name ?? '',
    });
  }

  /** Bind the local lane's abstract socket (a random name) and serve it. */
  async #listenLane(): Promise<void> {
    const name = `tensorwire-lock-${randomBytes(16).toString('hex')}`;
    const sockets = new Set<Socket>();
    const server = createNetServer((socket) => this.#acceptLane(socket, sockets));
    server.maxConnections = this.#maxLaneConnections;
    server.on('error', (e) => this.#logger.warn('lock: local lane listener error', { error: String(e) }));
    try {
      await new Promise<void>((resolve, reject) => {
        server.once('error', reject);
        server.listen(laneAddress(name), () => {
          server.off('error', reject);
          resolve();
        });
      });
    } catch (e) {
      // No lane then: requesters use gRPC, as with a holder that offers none.
      this.#logger.warn('lock: the local lane could not be bound; requesters use gRPC', { error: String(e) });
      return;
    }
    server.unref();
    this.#lane = { name, server, sockets };
  }

  /**
   * One lane connection: its first frame must be the hello (id 0, no method, the
   * authorization value as payload) within 5 s; then each frame is a Session message, served
   * by {@link #session} exactly as over gRPC. Any protocol error closes the socket.
   */
  #acceptLane(socket: Socket, sockets: Set<Socket>): void {
    // While draining, as over gRPC, releases and renewals still come in.
    if (this.#state !== 'serving' && this.#state !== 'draining') {
      socket.destroy();
      return;
    }
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
    socket.on('error', () => undefined);
    const { codec } = loadLockProtocol();
    const frames = new LaneFrames(this.#laneMaxFrame);
    let stream: LaneServerStream | undefined;
    const hello = setTimeout(() => socket.destroy(), LANE_HELLO_MS);
    hello.unref();
    socket.on('close', () => clearTimeout(hello));
    socket.on('data', (chunk: Buffer) => {
      let got: Buffer[];
      try {
        got = frames.push(chunk);
      } catch {
        socket.destroy();
        return;
      }
      for (const f of got) {
        if (socket.destroyed) return;
        let m: SessionRequestMsg;
        try {
          m = codec.SessionRequest.decode(f);
        } catch {
          socket.destroy();
          return;
        }
        if (stream !== undefined) {
          stream.emit('data', m);
          continue;
        }
        if (m.id !== 0 || m.method !== '') {
          socket.destroy();
          return;
        }
        clearTimeout(hello);
        const metadata = new grpc.Metadata();
        const auth = m.payload.toString('utf8');
        try {
          // grpc-js refuses a value it could not send as a header (a protocol error here).
          if (auth !== '') metadata.set(AUTH_METADATA_KEY, auth);
        } catch {
          socket.destroy();
          return;
        }
        stream = new LaneServerStream(socket, metadata, codec, 'local-lane');
        socket.write(laneFrame(codec.SessionResponse.encode({ id: 0, code: grpc.status.OK, details: this.holderId, payload: EMPTY_PAYLOAD })));
        this.#session(stream, this.#handlers);
      }
    });
  }

  #checkDrained(): void {
    if (this.#state !== 'draining' || this.table.size > 0) return;
    for (const w of this.#drainWaiters.splice(0)) w();
  }

  /**
   * Graceful shutdown: refuse new acquires (UNAVAILABLE), keep serving release and renew
   * until every lease ended or `graceMs` passed, revoke what is left (counted as expired),
   * stop the GC, and shut the gRPC server down. Idempotent.
   */
  close(options: CloseOptions = {}): Promise<void> {
    this.#closing ??= this.#close(options.graceMs ?? 5000);
    return this.#closing;
  }

  async #close(graceMs: number): Promise<void> {
    if (this.#state === 'serving') {
      this.#state = 'draining';
      if (this.table.size > 0 && graceMs > 0) {
        await new Promise<void>((resolve) => {
          const t = setTimeout(resolve, graceMs);
          this.#drainWaiters.push(() => {
            clearTimeout(t);
            resolve();
          });
        });
      }
    }
    this.#state = 'closed';
    this.gc.stop();
    this.table.expireDue();
    const revoked = this.table.revokeAll();
    if (revoked > 0) this.#logger.warn('lock: revoked leases at shutdown', { revoked });
    for (const end of [...this.#sessions]) end();
    this.#lane?.server.close();
    await new Promise<void>((resolve) => {
      const force = setTimeout(() => {
        this.#server.forceShutdown();
        resolve();
      }, 2000);
      this.#server.tryShutdown(() => {
        clearTimeout(force);
        resolve();
      });
    });
    this.#closeLane();
    this.#unregisterMetrics();
  }

  /**
   * Stop the local lane: no new connections, and every lane socket destroyed (its session was
   * ended already by a graceful close; a requester that never closes its side, or one half-way
   * through its hello, must not keep the holder's process alive).
   */
  #closeLane(): void {
    const lane = this.#lane;
    this.#lane = undefined;
    if (lane === undefined) return;
    lane.server.close();
    for (const socket of lane.sockets) socket.destroy();
  }

  /** Stop at once: revoke every lease and drop connections. */
  async abort(): Promise<void> {
    if (this.#closing === undefined) {
      this.#closing = (async () => {
        this.#state = 'closed';
        this.gc.stop();
        this.table.revokeAll();
        this.#server.forceShutdown();
        this.#closeLane();
        this.#unregisterMetrics();
      })();
    }
    return this.#closing;
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

/** Create a server and listen; resolves once it serves. */
export async function startLockServer(
  options: LockServerOptions & { address?: string; credentials?: grpc.ServerCredentials },
): Promise<LockServer> {
  const server = new LockServer(options);
  await server.listen(options.address, options.credentials);
  return server;
}
