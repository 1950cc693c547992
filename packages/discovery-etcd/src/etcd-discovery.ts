/**
 * Discovery on etcd.
 *
 * Layout: one key per node, `<prefix>nodes/<nodeId>`, whose value is the node's record
 * (core's JSON record codec) and which is attached to the publishing node's etcd lease, kept
 * alive while the node runs. The key is created with a transaction (`create_revision == 0`),
 * so it is owned by the lease that created it; only that lease's holder updates it (compare
 * `lease == ours`). A node whose lease lapses (crash, partition longer than the TTL) loses
 * the key: etcd deletes it, every watcher drops the record.
 *
 * Conflict rule: a node with the same id but another incarnation (a restart after a
 * crash, or a misconfigured duplicate) cannot take the key while the old lease lives; its
 * `publish()` waits for the key to go away (at most one TTL after a crash, at once after a
 * graceful `close()`). A watcher never lets a value of another incarnation override a live
 * record unless the key was deleted and re-created: a put that keeps the key's create
 * revision but carries another lease and another incarnation (a hand-written `etcdctl put`,
 * a broken node) is ignored as `conflicting-claim`. The same incarnation under another
 * lease is the owner re-attaching its key to a new lease after it lost the old one (etcd
 * restarts renew leases, so the key may outlive the client's view of its lease): the owner
 * moves the key with a transaction that compares the old lease, then revokes the old lease,
 * and every client, old or new, follows the key to the new lease and its latest content.
 * Also ignored: unleased values (`unleased`, they would never lapse), values whose record
 * names another node than the key (`key-mismatch`) and malformed or oversized values (the
 * codec's reasons). Ignored values are logged with their typed reason and counted in
 * `stats()`; the watcher keeps running. When the lease of a record
 * that was contested that way lapses, the record is dropped.
 *
 * Outages: while etcd is unreachable, `available` is false; lookups of known nodes answer
 * from the cache, lookups of unknown ones reject with BackendUnavailableError naming the
 * store (`etcd://host:port`). When etcd returns, the cache resynchronises: a full re-list
 * (reconciled by revision, so records that vanished meanwhile are removed), the watch
 * resumes, and this node's record is published again under a new lease if its lease was
 * lost.
 */
import { Etcd3, type IKeyValue, type IOptions, type Lease, type Watcher } from 'etcd3';
import {
  BackendUnavailableError,
  ClosedError,
  DISCOVERY_SPECIFICATION_VERSION,
  DiscoveryCache,
  InvalidInputError,
  MAX_NODE_RECORD_BYTES,
  RemoteRejectedError,
  TimedOutError,
  discoveryChecks,
  encodeNodeRecord,
  errorFromSignal,
  isValidOwner,
  silentLogger,
  tryDecodeNodeRecord,
  validateNodeRecord,
  waitSignal,
  type Discovery,
  type DiscoveryListener,
  type DiscoveryWaitOptions,
  type Logger,
  type NodeRecord,
  type RecordRejected,
  type RecordRejection,
  type WaitForNodeOptions,
} from '@tensorwire/core';

export interface EtcdDiscoveryOptions {
  /** The store: `etcd://host:port` (also `http://host:port`, or `host:port`). */
  readonly url: string;
  /** Key prefix shared by a cluster (default `/tensorwire/v1/`). */
  readonly prefix?: string;
  /** TTL of this node's lease, seconds (default 10, at least 2). A crashed node disappears within it. */
  readonly ttlSeconds?: number;
  /** Deadline of one etcd request (ms, default 2000). */
  readonly callTimeoutMs?: number;
  /** Longest wait between reconnection attempts (ms, default 2000). */
  readonly maxBackoffMs?: number;
  readonly logger?: Logger;
  /** Called for every ignored value, after it was logged. */
  readonly onRejected?: (rejected: RecordRejected) => void;
}

export interface EtcdDiscoveryStats {
  /** Values ignored, by reason. */
  readonly rejected: Readonly<Partial<Record<RecordRejection, number>>>;
  /** Completed synchronisations (the first, and one per return of etcd). */
  readonly syncs: number;
  /** Leases granted for this node's record (more than one: it was re-published after a loss). */
  readonly leasesGranted: number;
  /** Whether this node's record is in etcd under a live lease, as far as this client knows. */
  readonly published: boolean;
}

interface OwnState {
  record: NodeRecord;
  bytes: Uint8Array;
  lease: Lease | undefined;
  leaseId: string | undefined;
  published: boolean;
}

interface KeyMeta {
  readonly createRevision: bigint;
  readonly modRevision: bigint;
  readonly lease: string;
}

const DEFAULT_PREFIX = '/tensorwire/v1/';

/** Parse `etcd://host:port` into the store name and the gRPC host. */
export function parseEtcdUrl(url: string): { store: string; host: string } {
  if (typeof url !== 'string') throw new InvalidInputError('etcd url must be a string', { details: { field: 'url' } });
  const m = /^(?:(etcd|http):\/\/)?([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})\/?$/.exec(url.trim());
  const port = m ? Number(m[3]) : 0;
  if (!m || !(port >= 1 && port <= 65535)) {
    throw new InvalidInputError(`etcd url ${JSON.stringify(url)} must be etcd://host:port`, { details: { field: 'url' } });
  }
  return { store: `etcd://${m[2]}:${port}`, host: `http://${m[2]}:${port}` };
}

/** A cockatiel-compatible policy that only runs the call: we handle retries ourselves. */
const passThrough = {
  execute: <T>(fn: (ctx: { signal: AbortSignal; attempt: number }) => PromiseLike<T> | T): Promise<T> =>
    Promise.resolve().then(() => fn({ signal: new AbortController().signal, attempt: 0 })),
  onSuccess: () => ({ dispose() {} }),
  onFailure: () => ({ dispose() {} }),
};

function backoff(ms: number, max: number): { duration: number; next(): ReturnType<typeof backoff> } {
  return { duration: ms, next: () => backoff(Math.min(max, ms * 2), max) };
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal.aborted) return resolve();
    const t = setTimeout(done, ms);
    function done(): void {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    }
    signal.addEventListener('abort', done, { once: true });
  });
}

function describe(e: unknown): string {
  return e instanceof Error ? `${e.name}: ${e.message}` : String(e);
}

/**
 * Discovery backed by etcd. `await EtcdDiscovery.open({ url })` (or `new` + `start()`),
 * then use it as any core `Discovery`.
 */
export class EtcdDiscovery implements Discovery {
  readonly specificationVersion = DISCOVERY_SPECIFICATION_VERSION;
  readonly store: string;
  readonly prefix: string;
  readonly ttlSeconds: number;
  readonly #nodes: string;
  readonly #client: Etcd3;
  readonly #cache: DiscoveryCache;
  readonly #meta = new Map<string, KeyMeta>();
  /** Records whose key was overwritten by a foreign lease: node id -> the record owner's lease, checked until it lapses. */
  readonly #contested = new Map<string, string>();
  readonly #logger: Logger;
  readonly #opts: EtcdDiscoveryOptions;
  readonly #callTimeoutMs: number;
  readonly #maxBackoffMs: number;
  readonly #closing = new AbortController();
  readonly #rejected: Partial<Record<RecordRejection, number>> = {};
  readonly #myLeases = new Set<string>();
  #watcher: Watcher | undefined;
  #available = false;
  #lastError: unknown;
  #syncing: Promise<void> | undefined;
  #syncs = 0;
  #leasesGranted = 0;
  #own: OwnState | undefined;
  #publishing: Promise<void> | undefined;
  #contestTimer: NodeJS.Timeout | undefined;
  #closed: Promise<void> | undefined;
  #started: Promise<void> | undefined;

  constructor(options: EtcdDiscoveryOptions) {
    const { store, host } = parseEtcdUrl(options.url);
    this.store = store;
    this.prefix = options.prefix ?? DEFAULT_PREFIX;
    if (typeof this.prefix !== 'string' || this.prefix.length === 0 || this.prefix.length > 200) {
      throw new InvalidInputError('prefix must be 1-200 characters', { details: { field: 'prefix' } });
    }
    this.#nodes = `${this.prefix}nodes/`;
    const ttl = options.ttlSeconds ?? 10;
    if (!Number.isInteger(ttl) || ttl < 2 || ttl > 3600) throw new InvalidInputError(`ttlSeconds must be an integer 2-3600, got ${ttl}`, { details: { field: 'ttlSeconds' } });
    this.ttlSeconds = ttl;
    this.#callTimeoutMs = options.callTimeoutMs ?? 2000;
    this.#maxBackoffMs = options.maxBackoffMs ?? 2000;
    this.#opts = options;
    this.#logger = options.logger ?? silentLogger;
    this.#cache = new DiscoveryCache(this.#logger);
    const callTimeoutMs = this.#callTimeoutMs;
    const etcdOptions: IOptions = {
      hosts: host,
      dialTimeout: callTimeoutMs,
      defaultCallOptions: (ctx) => (ctx.isStream ? {} : { deadline: Date.now() + callTimeoutMs }),
      grpcOptions: { 'grpc.keepalive_time_ms': 10_000, 'grpc.keepalive_timeout_ms': 5_000, 'grpc.keepalive_permit_without_calls': 1 },
      faultHandling: {
        host: () => passThrough as unknown as NonNullable<ReturnType<NonNullable<NonNullable<IOptions['faultHandling']>['host']>>>,
        global: passThrough as unknown as NonNullable<NonNullable<IOptions['faultHandling']>['global']>,
        watchBackoff: backoff(100, this.#maxBackoffMs) as unknown as NonNullable<NonNullable<IOptions['faultHandling']>['watchBackoff']>,
      },
    };
    this.#client = new Etcd3(etcdOptions);
  }

  /** Create and start: resolves once the first synchronisation is done (or rejects, see `start`). */
  static async open(options: EtcdDiscoveryOptions & DiscoveryWaitOptions): Promise<EtcdDiscovery> {
    const d = new EtcdDiscovery(options);
    try {
      await d.start(options);
      return d;
    } catch (e) {
      await d.close();
      throw e;
    }
  }

  get available(): boolean {
    return this.#available && !this.#closed;
  }

  stats(): EtcdDiscoveryStats {
    return { rejected: { ...this.#rejected }, syncs: this.#syncs, leasesGranted: this.#leasesGranted, published: this.#own?.published === true };
  }

  /**
   * Load every record and start watching. Resolves after the first full sync; rejects with
   * BackendUnavailableError if etcd cannot be reached before the timeout (default: 5 call
   * timeouts), in which case it keeps trying in the background until `close()`.
   */
  async start(options: DiscoveryWaitOptions = {}): Promise<void> {
    this.#assertOpen();
    if (!this.#started) {
      this.#started = this.#syncing ??= this.#syncLoop();
      this.#started.catch(() => undefined);
    }
    const { signal, dispose } = waitSignal({ timeoutMs: options.timeoutMs ?? 5 * this.#callTimeoutMs, ...(options.signal ? { signal: options.signal } : {}) }, `connect to ${this.store}`);
    try {
      await new Promise<void>((resolve, reject) => {
        const onAbort = (): void => {
          const err = errorFromSignal(signal as AbortSignal, `connect to ${this.store}`);
          reject(err instanceof TimedOutError ? this.#unavailable(`cannot reach ${this.store}`) : err);
        };
        if (signal?.aborted) return onAbort();
        signal?.addEventListener('abort', onAbort, { once: true });
        void (this.#started as Promise<void>).then(
          () => {
            signal?.removeEventListener('abort', onAbort);
            resolve();
          },
          (e: unknown) => {
            signal?.removeEventListener('abort', onAbort);
            reject(e);
          },
        );
      });
    } finally {
      dispose();
    }
  }

  #assertOpen(): void {
    if (this.#closed) throw new ClosedError(`discovery on ${this.store} is closed`);
  }

  #unavailable(what: string): BackendUnavailableError {
    const why = this.#lastError === undefined ? 'not connected yet' : describe(this.#lastError);
    return new BackendUnavailableError(`${what}: ${this.store} is unreachable (${why})`, { details: { store: this.store } });
  }

  #markUnavailable(error: unknown): void {
    this.#lastError = error;
    if (this.#available) this.#logger.warn('discovery: etcd unreachable; answering known peers from the cache', { store: this.store, error: describe(error) });
    this.#available = false;
  }

  #resync(): void {
    if (this.#closed || this.#syncing) return;
    this.#syncing = this.#syncLoop();
  }

  /** Until one sync succeeds (or close): re-list, reconcile, (re)watch, re-publish. */
  async #syncLoop(): Promise<void> {
    let delay = 100;
    try {
      while (!this.#closing.signal.aborted) {
        try {
          await this.#syncOnce();
          return;
        } catch (e) {
          this.#markUnavailable(e);
          await sleep(delay, this.#closing.signal);
          delay = Math.min(this.#maxBackoffMs, delay * 2);
        }
      }
      throw new ClosedError(`discovery on ${this.store} closed`);
    } finally {
      this.#syncing = undefined;
    }
  }

  async #syncOnce(): Promise<void> {
    const res = await this.#client.getAll().prefix(this.#nodes).exec();
    if (this.#closing.signal.aborted) return;
    const revision = BigInt(res.header.revision);
    const seen = new Set<string>();
    for (const kv of res.kvs) {
      const nodeId = kv.key.toString('utf8').slice(this.#nodes.length);
      seen.add(nodeId);
      this.#applyPut(kv, 'list');
    }
    for (const nodeId of this.#cache.nodeIds()) {
      const m = this.#meta.get(nodeId);
      if (!seen.has(nodeId) && (m === undefined || m.modRevision < revision)) this.#drop(nodeId, 'resync');
    }
    if (!this.#watcher) await this.#watch(revision + 1n);
    this.#available = true;
    this.#lastError = undefined;
    this.#syncs++;
    this.#logger.info('discovery: synchronised with etcd', { store: this.store, revision: String(revision), nodes: this.#cache.size });
    if (this.#own && !this.#own.published) this.#republish();
  }

  async #watch(fromRevision: bigint): Promise<void> {
    const watcher = await this.#client.watch().prefix(this.#nodes).startRevision(String(fromRevision)).create();
    if (this.#closing.signal.aborted) {
      await watcher.cancel().catch(() => undefined);
      return;
    }
    this.#watcher = watcher;
    let disconnected = false;
    watcher.on('put', (kv) => this.#safe(() => this.#applyPut(kv, 'watch')));
    watcher.on('delete', (kv) => this.#safe(() => this.#applyDelete(kv)));
    watcher.on('disconnected', (err) => {
      disconnected = true;
      this.#markUnavailable(err);
    });
    watcher.on('error', (err) => this.#markUnavailable(err));
    watcher.on('connected', () => {
      if (!disconnected) return;
      disconnected = false;
      this.#resync(); // re-list: the watch resumed, but events may be lost to compaction
    });
  }

  #safe(fn: () => void): void {
    try {
      fn();
    } catch (e) {
      this.#logger.error('discovery: watch handler failed', { store: this.store, error: describe(e) });
    }
  }

  #reject(reason: RecordRejection, message: string, key: string, nodeId?: string): void {
    this.#rejected[reason] = (this.#rejected[reason] ?? 0) + 1;
    const r: RecordRejected = { reason, message, source: `${this.store}${key}`, ...(nodeId !== undefined ? { nodeId } : {}) };
    this.#logger.warn(`discovery: ignored record (${reason}): ${message}`, { store: this.store, key: key.slice(0, 300), reason });
    try {
      this.#opts.onRejected?.(r);
    } catch (e) {
      this.#logger.error('discovery: onRejected threw', { error: describe(e) });
    }
  }

  #applyPut(kv: IKeyValue, source: 'list' | 'watch'): void {
    const key = kv.key.toString('utf8');
    const nodeId = key.slice(this.#nodes.length);
    if (!isValidOwner(nodeId)) return this.#reject('key-mismatch', `key ${JSON.stringify(key.slice(0, 200))} does not end in a node id`, key);
    const mod = BigInt(kv.mod_revision);
    const create = BigInt(kv.create_revision);
    const m = this.#meta.get(nodeId);
    if (m && mod <= m.modRevision) return; // already applied (a re-list racing the watch)
    if (kv.value.byteLength > MAX_NODE_RECORD_BYTES) return this.#reject('oversized', `value of ${kv.value.byteLength} bytes exceeds ${MAX_NODE_RECORD_BYTES}`, key, nodeId);
    const decoded = tryDecodeNodeRecord(new Uint8Array(kv.value.buffer, kv.value.byteOffset, kv.value.byteLength));
    if (!decoded.ok) return this.#reject(decoded.reason, decoded.message, key, nodeId);
    const record = decoded.record;
    if (record.nodeId !== nodeId) return this.#reject('key-mismatch', `record of ${record.nodeId} stored under the key of ${nodeId}`, key, nodeId);
    if (kv.lease === '0' || kv.lease === '') return this.#reject('unleased', `record of ${nodeId} is not attached to a lease, so it would never lapse`, key, nodeId);
    const live = this.#cache.get(nodeId);
    if (live && m && create === m.createRevision && kv.lease !== m.lease && record.incarnation !== live.incarnation) {
      // Same key life, another writer (another incarnation): never let it override the live
      // record. The same incarnation under a new lease is the owner itself, which moved its
      // key to a fresh lease after losing the old one (an etcd outage; the old lease is
      // revoked): that is accepted, or every client that saw the old lease would keep the
      // stale content (and a lease that no longer holds the key) until a contest check.
      this.#contested.set(nodeId, m.lease);
      this.#armContestCheck();
      return this.#reject(
        'conflicting-claim',
        `record of ${nodeId}/${record.incarnation} under lease ${kv.lease} claims the key of live ${nodeId}/${live.incarnation} (lease ${m.lease})`,
        key,
        nodeId,
      );
    }
    this.#contested.delete(nodeId);
    this.#meta.set(nodeId, { createRevision: create, modRevision: mod, lease: kv.lease });
    this.#cache.put(record);
    if (source === 'watch' && this.#own && this.#own.record.nodeId === nodeId && !this.#myLeases.has(kv.lease)) {
      this.#logger.error('discovery: another process published this node id', { nodeId, incarnation: record.incarnation });
    }
  }

  #applyDelete(kv: IKeyValue): void {
    const key = kv.key.toString('utf8');
    const nodeId = key.slice(this.#nodes.length);
    const m = this.#meta.get(nodeId);
    if (m && BigInt(kv.mod_revision) <= m.modRevision) return;
    this.#drop(nodeId, 'deleted');
    this.#meta.set(nodeId, { createRevision: 0n, modRevision: BigInt(kv.mod_revision), lease: '0' });
    // Our own key vanished (lease lost, or deleted by hand): publish again.
    if (this.#own && this.#own.record.nodeId === nodeId && this.#own.published) {
      this.#own.published = false;
      this.#republish();
    }
    if (this.#pendingClaim) this.#pendingClaim();
  }

  #drop(nodeId: string, why: 'deleted' | 'resync' | 'lease-expired'): void {
    this.#contested.delete(nodeId);
    this.#meta.delete(nodeId);
    this.#cache.remove(nodeId, why);
  }

  #armContestCheck(): void {
    if (this.#contestTimer || this.#closed) return;
    this.#contestTimer = setTimeout(() => {
      this.#contestTimer = undefined;
      void this.#checkContested().finally(() => {
        if (this.#contested.size > 0) this.#armContestCheck();
      });
    }, Math.max(500, (this.ttlSeconds * 1000) / 2));
    this.#contestTimer.unref();
  }

  /** A contested record whose owner's lease lapsed is gone: drop it, then take what the key holds now. */
  async #checkContested(): Promise<void> {
    for (const [nodeId, lease] of [...this.#contested]) {
      try {
        const res = await this.#client.leaseClient.leaseTimeToLive({ ID: lease, keys: false });
        if (Number(res.TTL) > 0) continue;
        this.#drop(nodeId, 'lease-expired');
        const cur = await this.#client.getAll().prefix(`${this.#nodes}${nodeId}`).exec();
        for (const kv of cur.kvs) if (kv.key.toString('utf8') === `${this.#nodes}${nodeId}`) this.#applyPut(kv, 'list');
      } catch (e) {
        this.#markUnavailable(e);
        this.#resync();
        return;
      }
    }
  }

  // -------------------------------------------------------------------------------------
  // Publishing

  #pendingClaim: (() => void) | undefined;

  /**
   * Publish (or update) this node's record under this client's lease. If the node id is
   * held by another live lease (another incarnation), waits until it is released or lapses;
   * rejects with RemoteRejectedError (`reason: 'conflicting-claim'`) if that does not happen
   * before the timeout (default: two TTLs). With etcd unreachable it rejects with
   * BackendUnavailableError, and the record is published as soon as etcd returns.
   */
  async publish(record: NodeRecord, options: DiscoveryWaitOptions = {}): Promise<void> {
    this.#assertOpen();
    const r = validateNodeRecord(record);
    if (this.#own && this.#own.record.nodeId !== r.nodeId) {
      throw new InvalidInputError(`this discovery publishes ${this.#own.record.nodeId}; it cannot also publish ${r.nodeId}`, { details: { field: 'nodeId' } });
    }
    if (this.#own && this.#own.record.incarnation !== r.incarnation) {
      throw new InvalidInputError(`incarnation ${this.#own.record.incarnation} is published here; a new incarnation needs a new discovery`, { details: { field: 'incarnation' } });
    }
    const bytes = encodeNodeRecord(r);
    if (this.#own) {
      this.#own.record = r;
      this.#own.bytes = bytes;
      this.#own.published = false;
    } else this.#own = { record: r, bytes, lease: undefined, leaseId: undefined, published: false };
    await this.start(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs, ...(options.signal ? { signal: options.signal } : {}) } : options).catch((e: unknown) => {
      throw e instanceof BackendUnavailableError ? this.#unavailable(`cannot publish ${r.nodeId}`) : e;
    });
    const { signal, dispose } = waitSignal({ timeoutMs: options.timeoutMs ?? 2 * this.ttlSeconds * 1000 + this.#callTimeoutMs, ...(options.signal ? { signal: options.signal } : {}) }, `publish ${r.nodeId}`);
    try {
      await this.#publishUntil(signal as AbortSignal);
    } finally {
      dispose();
    }
  }

  async #publishUntil(signal: AbortSignal): Promise<void> {
    for (;;) {
      if (this.#closed) throw new ClosedError(`discovery on ${this.store} is closed`);
      if (signal.aborted) {
        const own = this.#own;
        const err = errorFromSignal(signal, `publish ${own?.record.nodeId}`);
        if (err instanceof TimedOutError && own) {
          this.#republish(); // keep trying in the background
          const holder = this.#cache.get(own.record.nodeId);
          throw new RemoteRejectedError(
            `node id ${own.record.nodeId} is still held by incarnation ${holder?.incarnation ?? '(unknown)'} under a live lease in ${this.store}`,
            { details: { reason: 'conflicting-claim', remoteCode: 'NODE_ID_HELD', store: this.store } },
          );
        }
        throw err;
      }
      let outcome: 'published' | 'held';
      try {
        outcome = await this.#publishOnce();
      } catch (e) {
        this.#markUnavailable(e);
        this.#resync();
        throw this.#unavailable(`cannot publish ${this.#own?.record.nodeId}`);
      }
      if (outcome === 'published') return;
      // Held by another live lease: wait for its key to be deleted (or poll every half TTL).
      await new Promise<void>((resolve) => {
        const t = setTimeout(done, (this.ttlSeconds * 1000) / 2);
        function done(): void {
          clearTimeout(t);
          signal.removeEventListener('abort', done);
          resolve();
        }
        this.#pendingClaim = done;
        signal.addEventListener('abort', done, { once: true });
      });
      this.#pendingClaim = undefined;
    }
  }

  /** One attempt: make sure we have a lease, then create the key or update our own. */
  async #publishOnce(): Promise<'published' | 'held'> {
    const own = this.#own;
    if (!own) return 'published';
    const key = `${this.#nodes}${own.record.nodeId}`;
    if (!own.lease || own.leaseId === undefined) {
      const lease = this.#client.lease(this.ttlSeconds, { autoKeepAlive: true });
      const leaseId = await lease.grant();
      this.#leasesGranted++;
      this.#myLeases.add(leaseId);
      own.lease = lease;
      own.leaseId = leaseId;
      lease.on('lost', (err) => {
        if (own.lease !== lease) return;
        this.#logger.warn('discovery: lease of this node lost; will publish again under a new lease', { store: this.store, leaseId, error: describe(err) });
        own.lease = undefined;
        own.leaseId = undefined;
        own.published = false;
        this.#republish();
      });
    }
    const leaseId = own.leaseId as string;
    const created = await this.#client
      .if(key, 'Create', '==', 0)
      .then(this.#client.put(key).value(Buffer.from(own.bytes)).lease(leaseId))
      .else(this.#client.get(key))
      .commit();
    if (created.succeeded) return this.#published(own, leaseId);
    const existing = created.responses[0]?.response_range?.kvs[0];
    const existingLease = existing?.lease ?? '0';
    if (existing && this.#myLeases.has(existingLease)) {
      // Ours: the current lease, or an earlier one of this process (etcd kept it through an outage).
      const updated = await this.#client
        .if(key, 'Lease', '==', existingLease)
        .then(this.#client.put(key).value(Buffer.from(own.bytes)).lease(leaseId))
        .commit();
      if (updated.succeeded) {
        if (existingLease !== leaseId) this.#revokeQuietly(existingLease);
        return this.#published(own, leaseId);
      }
    }
    own.published = false;
    this.#logger.warn('discovery: node id held by another live lease; waiting for it to lapse', { store: this.store, nodeId: own.record.nodeId, lease: existingLease });
    return 'held';
  }

  #published(own: OwnState, leaseId: string): 'published' {
    own.published = true;
    this.#logger.info('discovery: published', { store: this.store, nodeId: own.record.nodeId, incarnation: own.record.incarnation, leaseId });
    return 'published';
  }

  #revokeQuietly(leaseId: string): void {
    this.#myLeases.delete(leaseId);
    void this.#client.leaseClient.leaseRevoke({ ID: leaseId }).catch(() => undefined);
  }

  /** Publish in the background until it sticks (after a lost lease, a deleted key, a resync). */
  #republish(): void {
    if (this.#publishing || this.#closed || !this.#own) return;
    this.#publishing = (async () => {
      let delay = 100;
      while (!this.#closing.signal.aborted && this.#own && !this.#own.published) {
        try {
          if ((await this.#publishOnce()) === 'published') break;
        } catch (e) {
          this.#markUnavailable(e);
          this.#resync();
        }
        await sleep(delay, this.#closing.signal);
        delay = Math.min(this.#maxBackoffMs, delay * 2);
      }
    })().finally(() => {
      this.#publishing = undefined;
    });
  }

  /** Remove this node's record and end its lease. Idempotent. */
  async withdraw(options: DiscoveryWaitOptions = {}): Promise<void> {
    const own = this.#own;
    if (!own) return;
    this.#own = undefined;
    const lease = own.lease;
    const { signal, dispose } = waitSignal({ timeoutMs: options.timeoutMs ?? this.#callTimeoutMs, ...(options.signal ? { signal: options.signal } : {}) }, `withdraw ${own.record.nodeId}`);
    try {
      if (lease) {
        lease.removeAllListeners('lost');
        // Revoking the lease deletes the key; a failure leaves it to lapse within the TTL.
        await Promise.race([lease.revoke().catch(() => undefined), new Promise((r) => signal?.addEventListener('abort', r, { once: true }))]);
        lease.release();
      }
      for (const id of [...this.#myLeases]) if (id !== own.leaseId) this.#revokeQuietly(id);
    } finally {
      dispose();
    }
  }

  // -------------------------------------------------------------------------------------
  // Reads

  #readable(what: string, nodeKnown: boolean): void {
    this.#assertOpen();
    if (!this.available && !nodeKnown) throw this.#unavailable(what);
  }

  async lookup(nodeId: string): Promise<NodeRecord | undefined> {
    discoveryChecks.assertNodeId(nodeId);
    const cached = this.#cache.get(nodeId);
    this.#readable(`cannot look up ${nodeId}`, cached !== undefined);
    return cached;
  }

  waitFor(nodeId: string, options?: WaitForNodeOptions): Promise<NodeRecord> {
    try {
      this.#assertOpen();
      discoveryChecks.assertNodeId(nodeId);
    } catch (e) {
      return Promise.reject(e);
    }
    return this.#cache.waitFor(nodeId, options);
  }

  /** Records advertising `blockId`. While etcd is unreachable: the cached ones, if any; otherwise BackendUnavailableError. */
  async holdersOf(blockId: string): Promise<NodeRecord[]> {
    discoveryChecks.assertBlockId(blockId);
    const cached = this.#cache.holdersOf(blockId);
    this.#readable(`cannot find holders of ${blockId}`, cached.length > 0);
    return cached;
  }

  /** Every record. While etcd is unreachable: the cache, if it has anything; otherwise BackendUnavailableError. */
  async list(): Promise<NodeRecord[]> {
    const all = this.#cache.values();
    this.#readable('cannot list nodes', all.length > 0);
    return all;
  }

  peek(nodeId: string): NodeRecord | undefined {
    return this.#cache.get(nodeId);
  }

  on(listener: DiscoveryListener): () => void {
    this.#assertOpen();
    return this.#cache.on(listener);
  }

  /** Withdraw this node's record, stop watching, close the client. Idempotent. */
  close(): Promise<void> {
    this.#closed ??= this.#close();
    return this.#closed;
  }

  async #close(): Promise<void> {
    await this.withdraw().catch(() => undefined);
    this.#closing.abort();
    if (this.#contestTimer) clearTimeout(this.#contestTimer);
    this.#pendingClaim?.();
    const w = this.#watcher;
    this.#watcher = undefined;
    if (w) await Promise.race([w.cancel().catch(() => undefined), new Promise((r) => setTimeout(r, this.#callTimeoutMs).unref())]);
    this.#cache.close();
    this.#client.close();
    this.#available = false;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
