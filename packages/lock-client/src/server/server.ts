/**
 * The holder side: a gRPC LockService over a {@link LeaseTable}, with the expiry GC,
 * optional shared-token authentication and TLS, prom-client metrics and graceful shutdown.
 */
import { createHash, timingSafeEqual } from 'node:crypto';
import * as grpc from '@grpc/grpc-js';
import { InvalidInputError, ResourceExhaustedError, silentLogger, type Logger } from '@tensorwire/core';
import { Registry } from 'prom-client';
import { LeaseError, type LeaseStatus } from '../errors.js';
import {
  AUTH_METADATA_KEY,
  loadLockProtocol,
  type AcquireRequestMsg,
  type AcquireResponseMsg,
  type HealthResponseMsg,
  type ReleaseRequestMsg,
  type ReleaseResponseMsg,
  type RenewRequestMsg,
  type RenewResponseMsg,
} from '../proto.js';
import { ExpiryScheduler, type Timers } from './expiry.js';
import { LeaseTable, type LeaseCounters, type LeaseEndReason, type LeaseInfo, type LeaseTableOptions } from './lease-table.js';
import { DEFAULT_SERVER_METRICS_PREFIX, registerServerMetrics } from './metrics.js';

/** One block's transfer descriptors: opaque bytes, one per transport the holder serves. */
export type BlockDescriptors = Uint8Array | readonly Uint8Array[];

/**
 * Maps the blocks of a fresh lease to their transfer descriptors, in request order. The
 * descriptors should be scoped to the lease (for example carry a token the transport
 * checks) and revoked in `revoke`. May be async; the blocks are pinned before it runs.
 */
export type BlockResolver = (blockIds: readonly string[], lease: LeaseInfo) => ResolvedLease | Promise<ResolvedLease>;

/**
 * What a resolver returns: one entry per block (request order), or descriptors for the whole
 * lease (`lease`, e.g. one range grant over every block) with optional per-block ones.
 */
export type ResolvedLease = readonly BlockDescriptors[] | { readonly lease: readonly Uint8Array[]; readonly blocks?: readonly BlockDescriptors[] };

export interface LockServerOptions extends Omit<LeaseTableOptions, 'onEnd' | 'onReject' | 'logger'> {
  /** Block ids → descriptors. Default: no descriptors. */
  readonly resolve?: BlockResolver;
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
}

export interface CloseOptions {
  /** How long to let requesters release before revoking what is left (ms, default 5000). */
  readonly graceMs?: number;
}

export type RpcName = 'acquire' | 'release' | 'renew' | 'health';

/** Lease counters plus the RPCs received. `rejected` counts every refused RPC (auth included). */
export interface LockServerCounters extends LeaseCounters {
  readonly requests: Readonly<Record<RpcName, number>>;
}

const EMPTY: readonly Uint8Array[] = [];

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
  readonly #opts: LockServerOptions;
  readonly #logger: Logger;
  readonly #server: grpc.Server;
  readonly #tokenDigest: Buffer | undefined;
  readonly #requests: Record<RpcName, number> = { acquire: 0, release: 0, renew: 0, health: 0 };
  readonly #rejections = new Map<string, number>();
  readonly #unregisterMetrics: () => void;
  readonly #drainWaiters: (() => void)[] = [];
  #state: 'idle' | 'serving' | 'draining' | 'closed' = 'idle';
  #port = 0;
  #closing: Promise<void> | undefined;

  constructor(options: LockServerOptions) {
    this.#opts = options;
    this.#logger = options.logger ?? silentLogger;
    if (options.token !== undefined && options.token.length === 0) throw new InvalidInputError('token must not be empty');
    this.#tokenDigest = options.token === undefined ? undefined : digest(options.token);
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
    this.#unregisterMetrics = registerServerMetrics(this.registry, options.metricsPrefix ?? DEFAULT_SERVER_METRICS_PREFIX, {
      counters: () => this.table.counters(),
      requests: () => {
        for (const [k, v] of Object.entries(this.#requests)) requests.set(k, v);
        return requests;
      },
      rejections: () => this.#rejections,
    });
    this.#server = new grpc.Server(options.grpcOptions);
    this.#server.addService(loadLockProtocol().service, this.handlers());
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
    this.#state = 'serving';
    this.gc.start();
    return this.#port;
  }

  counters(): LockServerCounters {
    let rejected = 0;
    for (const v of this.#rejections.values()) rejected += v;
    return { ...this.table.counters(), rejected, requests: { ...this.#requests } };
  }

  /**
   * The service implementation, for adding to a grpc.Server you own
   * (`server.addService(loadLockProtocol().service, lockServer.handlers())`). The GC then
   * runs once `listen()` is called, or call `gc.start()` yourself.
   */
  handlers(): grpc.UntypedServiceImplementation {
    return {
      Acquire: (call: grpc.ServerUnaryCall<AcquireRequestMsg, AcquireResponseMsg>, cb: grpc.sendUnaryData<AcquireResponseMsg>) => {
        this.#acquire(call, cb);
      },
      Release: (call: grpc.ServerUnaryCall<ReleaseRequestMsg, ReleaseResponseMsg>, cb: grpc.sendUnaryData<ReleaseResponseMsg>) => {
        this.#release(call, cb);
      },
      Renew: (call: grpc.ServerUnaryCall<RenewRequestMsg, RenewResponseMsg>, cb: grpc.sendUnaryData<RenewResponseMsg>) => {
        this.#renew(call, cb);
      },
      Health: (call: grpc.ServerUnaryCall<unknown, HealthResponseMsg>, cb: grpc.sendUnaryData<HealthResponseMsg>) => {
        this.#health(call, cb);
      },
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
    if (!this.#authorized('acquire', call, cb)) return;
    if (this.#state !== 'serving') {
      this.#fail('acquire', cb, 'UNAVAILABLE', `holder ${this.holderId} is shutting down`);
      return;
    }
    const req = call.request;
    let lease: LeaseInfo;
    try {
      lease = this.table.acquire(req.requesterId, req.blockIds, { leaseMs: req.leaseMs, acquireId: req.acquireId });
    } catch (e) {
      const { status, message } = hookStatus(e);
      this.#fail('acquire', cb, status, message);
      return;
    }
    this.gc.notify();
    const resolve = this.#opts.resolve;
    if (resolve === undefined) {
      this.#grant(call, cb, lease, undefined);
      return;
    }
    let result: ResolvedLease | Promise<ResolvedLease>;
    try {
      result = resolve(lease.blockIds, lease);
    } catch (e) {
      this.#resolveFailed(cb, lease, e);
      return;
    }
    if (!(result instanceof Promise)) this.#grant(call, cb, lease, result);
    else
      result.then(
        (descriptors) => this.#grant(call, cb, lease, descriptors),
        (e: unknown) => this.#resolveFailed(cb, lease, e),
      );
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
    if (descriptors !== undefined && (!Array.isArray(descriptors) || descriptors.length !== lease.blockIds.length)) {
      this.#resolveFailed(cb, lease, new Error(`resolver returned ${Array.isArray(descriptors) ? descriptors.length : typeof descriptors} entries for ${lease.blockIds.length} blocks`));
      return;
    }
    // Bytes only: anything else would fail in the response encoder, after the lease was granted.
    const isBytes = (d: unknown): boolean => d instanceof Uint8Array || (Array.isArray(d) && d.every((x) => x instanceof Uint8Array));
    if (descriptors !== undefined && !descriptors.every((d) => d === undefined || isBytes(d))) {
      this.#resolveFailed(cb, lease, new Error('resolver returned a block descriptor that is not bytes or a list of bytes'));
      return;
    }
    for (let i = 0; i < lease.blockIds.length; i++) {
      const d = descriptors?.[i];
      const list = d === undefined ? EMPTY : d instanceof Uint8Array ? [d] : d;
      blocks.push({ blockId: lease.blockIds[i] as string, descriptors: list as Uint8Array[] });
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
    if (!this.#authorized('release', call, cb)) return;
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
    if (!this.#authorized('renew', call, cb)) return;
    const req = call.request;
    let lease: LeaseInfo;
    try {
      lease = this.table.renew(req.requesterId, req.sessionId, req.leaseMs);
    } catch (e) {
      const { status, message } = hookStatus(e);
      this.#fail('renew', cb, status, message);
      return;
    }
    this.gc.notify();
    cb(null, { deadlineUnixMs: Math.round(lease.deadline), leaseMs: lease.leaseMs });
  }

  #health(call: grpc.ServerUnaryCall<unknown, HealthResponseMsg>, cb: grpc.sendUnaryData<HealthResponseMsg>): void {
    if (!this.#authorized('health', call, cb)) return;
    const c = this.table.counters();
    cb(null, {
      status: this.#state === 'serving' ? 'SERVING' : 'DRAINING',
      holderId: this.holderId,
      lockTimeoutMs: this.table.lockTimeoutMs,
      activeSessions: c.active,
      activeBlocks: c.activeBlocks,
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
    this.#unregisterMetrics();
  }

  /** Stop at once: revoke every lease and drop connections. */
  async abort(): Promise<void> {
    if (this.#closing === undefined) {
      this.#closing = (async () => {
        this.#state = 'closed';
        this.gc.stop();
        this.table.revokeAll();
        this.#server.forceShutdown();
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
