/**
 * Discovery on etcd.
 *
 * Layout: two keys per node, both attached to the publishing node's etcd lease (kept alive
 * while the node runs):
 *
 * - `<prefix>nodes/<nodeId>`: the node's record (core's JSON record codec);
 * - `<prefix>owners/<nodeId>`: the owner anchor, whose value is the lease id.
 *
 * Ownership rule: both keys are created in one transaction (`create_revision == 0` on each),
 * so a key life of the record key is owned by lease L exactly when the anchor is attached to
 * L and the anchor's `mod_revision` equals the record key's `create_revision`. The anchor is
 * never written again; a later write to it changes its `mod_revision` and breaks the proof,
 * and forging the proof needs a new key life (a delete, which every watcher sees). Anyone
 * who can read the records can copy them, but a copy under another lease (or none) is not
 * the owner's: a watcher serves a record only if it was written under its key life's owner
 * lease. Anything else in the key (a copy of the live incarnation under the writer's own
 * lease, an unleased or malformed value) is ignored with a typed reason (`conflicting-claim`,
 * `unleased`, the codec's reasons), and the owner's last good record is kept while the owner
 * lease lives. When the owner lease ends (revoked, lapsed), etcd deletes the anchor, so every
 * watcher drops the record at once whatever the record key still holds, and a new
 * publisher of the same node id deletes such leftovers instead of waiting for them. A key
 * whose anchor proves a live owner other than this process (a restart whose predecessor's
 * lease still runs, a duplicate) blocks `publish()` until that lease ends.
 *
 * The owner watches its own keys: any change it did not make (checked against etcd with one
 * compare-only transaction) is logged, counted (`stats().restores`) and undone: the record
 * is rewritten under the owner lease, or the key life is re-created if the anchor was
 * touched.
 *
 * Leases: this client keeps its lease alive itself and never gives it up while etcd may
 * still hold it: through an outage it keeps trying, and only when etcd answers that the
 * lease is gone does it grant a new one and publish again. So the record never moves between
 * leases (etcd restarts renew leases; the record stays under the same one).
 *
 * What the rule cannot stop without etcd authentication: a client that may write anything
 * can delete keys, revoke any lease, attach its writes to the owner's lease, or take a node
 * id that is free. With etcd auth and one role per node (see the README), etcd itself refuses
 * writes to another node's keys and to leases that hold them.
 *
 * Outages: while etcd is unreachable, `available` is false; lookups of known nodes answer
 * from the cache, lookups of unknown ones reject with BackendUnavailableError naming the
 * store (`etcd://host:port`). When etcd returns, the cache resynchronises: a full re-list
 * (reconciled by revision, so records that vanished meanwhile are removed), the watch
 * resumes, and this node's record is checked and published again if it was lost.
 */
import { Etcd3, EtcdPermissionDeniedError, type IKeyValue, type IOptions, type IWatchResponse, type Watcher } from 'etcd3';
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

/** PEM text or bytes. */
export type PemInput = string | Uint8Array;

export interface EtcdTlsOptions {
  /** CA certificate(s) that sign etcd's server certificate (PEM). Default: the system's roots. */
  readonly ca?: PemInput;
  /** Client certificate chain (PEM), for etcd's `--client-cert-auth`. With etcd auth enabled and no `auth`, etcd takes the user name from its common name. */
  readonly cert?: PemInput;
  /** Private key of `cert` (PEM). */
  readonly key?: PemInput;
}

export interface EtcdDiscoveryOptions {
  /** The store: `etcd://host:port` (also `http://host:port`, or `host:port`); `etcds://host:port` or `https://host:port` for TLS. */
  readonly url: string;
  /** Key prefix shared by a cluster (default `/tensorwire/v1/`). */
  readonly prefix?: string;
  /** TTL of this node's lease, seconds (default 10, at least 2). A crashed node disappears within it. */
  readonly ttlSeconds?: number;
  /** Deadline of one etcd request (ms, default 2000). */
  readonly callTimeoutMs?: number;
  /** Longest wait between reconnection attempts (ms, default 2000). */
  readonly maxBackoffMs?: number;
  /** etcd user name and password (etcd auth). */
  readonly auth?: { readonly username: string; readonly password: string };
  /** TLS settings; implies TLS (also implied by an `etcds://` or `https://` url). */
  readonly tls?: EtcdTlsOptions;
  readonly logger?: Logger;
  /** Called for every ignored value, after it was logged. */
  readonly onRejected?: (rejected: RecordRejected) => void;
}

export interface EtcdDiscoveryStats {
  /** Values ignored, by reason. */
  readonly rejected: Readonly<Partial<Record<RecordRejection, number>>>;
  /** Completed synchronisations (the first, and one per return of etcd). */
  readonly syncs: number;
  /** Leases granted for this node's record (more than one: etcd ended an earlier one and the record was published again). */
  readonly leasesGranted: number;
  /** Whether this node's record is in etcd under a live lease, as far as this client knows. */
  readonly published: boolean;
  /** Times this node found its own keys changed by someone else and put its record back. */
  readonly restores: number;
}

/** What a watcher knows of one key: its life (create revision, 0 once deleted), last change and lease. */
interface KeyState {
  readonly create: bigint;
  readonly mod: bigint;
  readonly lease: string;
}

interface NodeState {
  node: KeyState | undefined;
  owner: KeyState | undefined;
  /** Create revision of the key life whose record is in the cache. */
  served: bigint | undefined;
}

interface OwnState {
  record: NodeRecord;
  bytes: Buffer;
  keeper: LeaseKeeper | undefined;
  /** Create revision of the record key's life this process created (both keys), while it holds. */
  life: bigint | undefined;
  published: boolean;
}

const DEFAULT_PREFIX = '/tensorwire/v1/';

/** Parse `etcd://host:port` (or `etcds://`/`https://` for TLS) into the store name and the gRPC host. */
export function parseEtcdUrl(url: string): { store: string; host: string; tls: boolean } {
  if (typeof url !== 'string') throw new InvalidInputError('etcd url must be a string', { details: { field: 'url' } });
  const m = /^(?:(etcd|etcds|http|https):\/\/)?([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})\/?$/.exec(url.trim());
  const port = m ? Number(m[3]) : 0;
  if (!m || !(port >= 1 && port <= 65535)) {
    throw new InvalidInputError(`etcd url ${JSON.stringify(url)} must be etcd://host:port or etcds://host:port`, { details: { field: 'url' } });
  }
  const tls = m[1] === 'etcds' || m[1] === 'https';
  return { store: `${tls ? 'etcds' : 'etcd'}://${m[2]}:${port}`, host: `${tls ? 'https' : 'http'}://${m[2]}:${port}`, tls };
}

function pem(x: PemInput | undefined, field: string): Buffer | undefined {
  if (x === undefined) return undefined;
  if (typeof x === 'string') return Buffer.from(x, 'utf8');
  if (x instanceof Uint8Array) return Buffer.from(x.buffer, x.byteOffset, x.byteLength);
  throw new InvalidInputError(`${field} must be PEM text or bytes`, { details: { field } });
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

function keyState(kv: IKeyValue): KeyState {
  return { create: BigInt(kv.create_revision), mod: BigInt(kv.mod_revision), lease: kv.lease === '' ? '0' : kv.lease };
}

function live(k: KeyState | undefined): k is KeyState {
  return k !== undefined && k.create !== 0n;
}

/** The lease that owns the record key's current life, or undefined (see the ownership rule). */
function ownerLease(node: KeyState | undefined, owner: KeyState | undefined): string | undefined {
  return live(node) && live(owner) && owner.mod === node.create && owner.lease !== '0' ? owner.lease : undefined;
}

type KeepAliveStream = Awaited<ReturnType<Etcd3['leaseClient']['leaseKeepAlive']>>;

/**
 * Keeps one etcd lease alive over a keep-alive stream, through outages: it gives the lease
 * up only when etcd answers that it is gone (`onExpired`). `onStale` fires when no
 * keep-alive was acknowledged for a TTL (this client can no longer vouch for the lease),
 * `onFresh` when one is acknowledged again after that.
 */
class LeaseKeeper {
  readonly id: string;
  readonly #client: Etcd3;
  readonly #ttlMs: number;
  readonly #events: { onExpired(): void; onStale(): void; onFresh(): void };
  #stream: KeepAliveStream | undefined;
  #timer: NodeJS.Timeout | undefined;
  #lastOk = Date.now();
  #stale = false;
  #stopped = false;
  #opening = false;

  constructor(client: Etcd3, id: string, ttlSeconds: number, events: { onExpired(): void; onStale(): void; onFresh(): void }) {
    this.#client = client;
    this.id = id;
    this.#ttlMs = ttlSeconds * 1000;
    this.#events = events;
    this.#timer = setInterval(() => this.#tick(), Math.max(200, Math.floor(this.#ttlMs / 3)));
    this.#timer.unref();
    this.#open();
  }

  #tick(): void {
    if (this.#stopped) return;
    if (!this.#stale && Date.now() - this.#lastOk > this.#ttlMs) {
      this.#stale = true;
      this.#events.onStale();
    }
    if (this.#stream) this.#send(this.#stream);
    else this.#open();
  }

  #send(stream: KeepAliveStream): void {
    try {
      stream.write({ ID: this.id });
    } catch {
      this.#drop(stream);
    }
  }

  #open(): void {
    if (this.#stopped || this.#opening || this.#stream) return;
    this.#opening = true;
    this.#client.leaseClient.leaseKeepAlive().then(
      (stream) => {
        this.#opening = false;
        if (this.#stopped) {
          stream.end();
          return;
        }
        this.#stream = stream;
        stream.on('data', (res: { TTL: string }) => {
          if (this.#stopped) return;
          if (!(Number(res.TTL) > 0)) {
            this.stop();
            this.#events.onExpired();
            return;
          }
          this.#lastOk = Date.now();
          if (this.#stale) {
            this.#stale = false;
            this.#events.onFresh();
          }
        });
        stream.on('error', () => this.#drop(stream));
        stream.on('end', () => this.#drop(stream));
        this.#send(stream);
      },
      () => {
        this.#opening = false;
      },
    );
  }

  #drop(stream: KeepAliveStream): void {
    if (this.#stream !== stream) return;
    this.#stream = undefined;
    try {
      stream.end();
    } catch {
      // already broken
    }
  }

  /** Stop keeping the lease alive (it lapses within its TTL unless revoked). Idempotent. */
  stop(): void {
    if (this.#stopped) return;
    this.#stopped = true;
    if (this.#timer) clearInterval(this.#timer);
    const s = this.#stream;
    this.#stream = undefined;
    if (s) {
      try {
        s.end();
      } catch {
        // already broken
      }
    }
  }
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
  readonly #owners: string;
  readonly #client: Etcd3;
  readonly #cache: DiscoveryCache;
  readonly #state = new Map<string, NodeState>();
  readonly #logger: Logger;
  readonly #opts: EtcdDiscoveryOptions;
  readonly #callTimeoutMs: number;
  readonly #maxBackoffMs: number;
  readonly #closing = new AbortController();
  readonly #rejected: Partial<Record<RecordRejection, number>> = {};
  #watcher: Watcher | undefined;
  #available = false;
  #lastError: unknown;
  #syncing: Promise<void> | undefined;
  #syncs = 0;
  #leasesGranted = 0;
  #restores = 0;
  #own: OwnState | undefined;
  /** Writes of this node's keys run one at a time, in order. */
  #ownChain: Promise<unknown> = Promise.resolve();
  #publishing: Promise<void> | undefined;
  #checking = false;
  #checkAgain = false;
  #closed: Promise<void> | undefined;
  #started: Promise<void> | undefined;

  constructor(options: EtcdDiscoveryOptions) {
    const { store, host, tls } = parseEtcdUrl(options.url);
    if (options.tls !== undefined && !tls && /^(?:etcd|http):\/\//.test(options.url.trim())) {
      throw new InvalidInputError(`tls options given for the plain-text url ${options.url}; use etcds://`, { details: { field: 'tls' } });
    }
    const useTls = tls || options.tls !== undefined;
    this.store = useTls && !tls ? store.replace(/^etcd:/, 'etcds:') : store;
    const grpcHost = useTls ? host.replace(/^http:/, 'https:') : host;
    this.prefix = options.prefix ?? DEFAULT_PREFIX;
    if (typeof this.prefix !== 'string' || this.prefix.length === 0 || this.prefix.length > 200) {
      throw new InvalidInputError('prefix must be 1-200 characters', { details: { field: 'prefix' } });
    }
    this.#nodes = `${this.prefix}nodes/`;
    this.#owners = `${this.prefix}owners/`;
    const ttl = options.ttlSeconds ?? 10;
    if (!Number.isInteger(ttl) || ttl < 2 || ttl > 3600) throw new InvalidInputError(`ttlSeconds must be an integer 2-3600, got ${ttl}`, { details: { field: 'ttlSeconds' } });
    this.ttlSeconds = ttl;
    this.#callTimeoutMs = options.callTimeoutMs ?? 2000;
    this.#maxBackoffMs = options.maxBackoffMs ?? 2000;
    this.#opts = options;
    this.#logger = options.logger ?? silentLogger;
    this.#cache = new DiscoveryCache(this.#logger);
    const auth = options.auth;
    if (auth !== undefined && (typeof auth.username !== 'string' || auth.username.length === 0 || typeof auth.password !== 'string')) {
      throw new InvalidInputError('auth needs a user name and a password', { details: { field: 'auth' } });
    }
    const t = options.tls ?? {};
    const ca = pem(t.ca, 'tls.ca');
    const cert = pem(t.cert, 'tls.cert');
    const key = pem(t.key, 'tls.key');
    if ((cert === undefined) !== (key === undefined)) throw new InvalidInputError('tls.cert and tls.key go together', { details: { field: 'tls' } });
    const callTimeoutMs = this.#callTimeoutMs;
    const etcdOptions: IOptions = {
      hosts: grpcHost,
      dialTimeout: callTimeoutMs,
      defaultCallOptions: (ctx) => (ctx.isStream ? {} : { deadline: Date.now() + callTimeoutMs }),
      grpcOptions: {
        'grpc.keepalive_time_ms': 10_000,
        'grpc.keepalive_timeout_ms': 5_000,
        'grpc.keepalive_permit_without_calls': 1,
        'grpc.initial_reconnect_backoff_ms': 100,
        'grpc.max_reconnect_backoff_ms': this.#maxBackoffMs,
      },
      ...(auth ? { auth: { username: auth.username, password: auth.password } } : {}),
      // grpc-js wants a root certificate buffer; an empty one is not valid, so without `ca`
      // only a client certificate pair is passed and the system roots are used.
      ...(useTls && (ca || cert) ? { credentials: { rootCertificate: ca as Buffer, ...(cert ? { certChain: cert, privateKey: key as Buffer } : {}) } } : {}),
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
    return { rejected: { ...this.#rejected }, syncs: this.#syncs, leasesGranted: this.#leasesGranted, published: this.#own?.published === true, restores: this.#restores };
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

  /**
   * Re-list and re-watch unless a sync is running; `again`: also after the running one (which
   * may have looked for a watcher before the one it saw was dropped).
   */
  #resync(again = false): void {
    if (this.#closed) return;
    if (this.#syncing) {
      if (again) this.#resyncAgain = true;
      return;
    }
    this.#syncing = this.#syncLoop();
  }
  #resyncAgain = false;

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
      if (this.#resyncAgain) {
        this.#resyncAgain = false;
        this.#resync();
      }
    }
  }

  /** `nodes` or `owners` and the node id of a key under the prefix, or undefined for other keys. */
  #classify(key: string): { kind: 'node' | 'owner'; nodeId: string } | undefined {
    if (key.startsWith(this.#nodes)) return { kind: 'node', nodeId: key.slice(this.#nodes.length) };
    if (key.startsWith(this.#owners)) return { kind: 'owner', nodeId: key.slice(this.#owners.length) };
    return undefined;
  }

  #stateOf(nodeId: string): NodeState {
    let s = this.#state.get(nodeId);
    if (!s) {
      s = { node: undefined, owner: undefined, served: undefined };
      this.#state.set(nodeId, s);
    }
    return s;
  }

  async #syncOnce(): Promise<void> {
    const res = await this.#client.getAll().prefix(this.prefix).exec();
    if (this.#closing.signal.aborted) return;
    const revision = BigInt(res.header.revision);
    const listed = new Map<string, { node?: IKeyValue; owner?: IKeyValue }>();
    for (const kv of res.kvs) {
      const k = this.#classify(kv.key.toString('utf8'));
      if (!k) continue;
      const e = listed.get(k.nodeId) ?? {};
      e[k.kind] = kv;
      listed.set(k.nodeId, e);
    }
    for (const nodeId of new Set([...this.#state.keys(), ...listed.keys()])) {
      const s = this.#stateOf(nodeId);
      const l = listed.get(nodeId) ?? {};
      let changed = false;
      let nodeKv: IKeyValue | undefined;
      for (const kind of ['node', 'owner'] as const) {
        const kv = l[kind];
        const cur = s[kind];
        if (kv) {
          if (cur === undefined || BigInt(kv.mod_revision) > cur.mod) {
            s[kind] = keyState(kv);
            changed = true;
            if (kind === 'node') nodeKv = kv;
          }
        } else if (cur !== undefined && cur.mod <= revision) {
          // Gone at the listed revision (deleted, or a tombstone the list now covers).
          if (live(cur)) changed = true;
          s[kind] = undefined;
        }
      }
      if (changed) this.#evaluate(nodeId, s, nodeKv, 'resync');
      if (s.node === undefined && s.owner === undefined && s.served === undefined) this.#state.delete(nodeId);
    }
    if (!this.#watcher) await this.#watch(revision + 1n);
    this.#available = true;
    this.#lastError = undefined;
    this.#syncs++;
    this.#logger.info('discovery: synchronised with etcd', { store: this.store, revision: String(revision), nodes: this.#cache.size });
    if (this.#own && !this.#own.published) this.#republish();
    else if (this.#own) this.#checkOwn();
  }

  async #watch(fromRevision: bigint): Promise<void> {
    const watcher = await this.#client.watch().prefix(this.prefix).startRevision(String(fromRevision)).create();
    if (this.#closing.signal.aborted) {
      await watcher.cancel().catch(() => undefined);
      return;
    }
    this.#watcher = watcher;
    let disconnected = false;
    watcher.on('data', (res: IWatchResponse) => this.#safe(() => this.#applyEvents(res)));
    watcher.on('disconnected', (err) => {
      disconnected = true;
      this.#markUnavailable(err);
    });
    watcher.on('error', (err) => {
      this.#markUnavailable(err);
      // etcd3 emits 'error' when etcd cancelled the watch (its revision compacted away while the
      // watch was resuming, say): the library has dropped the watcher and will not resume it.
      // Forget it, then re-list and watch anew from the listed revision.
      if (this.#watcher !== watcher) return;
      this.#watcher = undefined;
      void watcher.cancel().catch(() => undefined);
      this.#resync(true);
    });
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

  /** One watch response: update what is known of each key, then judge each node touched (the two keys of a creation arrive together). */
  #applyEvents(res: IWatchResponse): void {
    const touched = new Map<string, IKeyValue | undefined>();
    for (const ev of res.events) {
      const kv = ev.kv;
      const k = this.#classify(kv.key.toString('utf8'));
      if (!k) continue;
      const s = this.#stateOf(k.nodeId);
      const cur = s[k.kind];
      const mod = BigInt(kv.mod_revision);
      if (cur !== undefined && mod <= cur.mod) continue; // already applied (a re-list racing the watch)
      if (ev.type === 'Put') {
        s[k.kind] = keyState(kv);
        if (k.kind === 'node') touched.set(k.nodeId, kv);
        else if (!touched.has(k.nodeId)) touched.set(k.nodeId, undefined);
      } else {
        s[k.kind] = { create: 0n, mod, lease: '0' }; // tombstone, until a re-list covers it
        if (k.kind === 'node') touched.set(k.nodeId, undefined);
        else if (!touched.has(k.nodeId)) touched.set(k.nodeId, undefined);
      }
    }
    for (const [nodeId, nodeKv] of touched) this.#evaluate(nodeId, this.#stateOf(nodeId), nodeKv, 'deleted');
  }

  /**
   * Decide what the cache holds for `nodeId` after its keys changed: the record written by
   * the owner of the record key's current life, else the owner's last good record while
   * that owner lives, else nothing. `nodeKv` is the record key's new value, when it changed.
   */
  #evaluate(nodeId: string, s: NodeState, nodeKv: IKeyValue | undefined, why: 'deleted' | 'resync'): void {
    const own = this.#own;
    const mine = own !== undefined && own.record.nodeId === nodeId;
    if (mine) this.#onOwnKeysChanged(s);
    const node = s.node;
    if (!live(node)) {
      if (s.served !== undefined) this.#drop(nodeId, s, why);
      return;
    }
    const owner = ownerLease(node, s.owner);
    if (nodeKv !== undefined && this.#accept(nodeId, nodeKv, owner, s)) return;
    if (s.served !== undefined && (owner === undefined || s.served !== node.create)) {
      // The owner of the served record is gone (its anchor was deleted with its lease) or the
      // key lives another life: whatever the key holds now is not that owner's record.
      this.#drop(nodeId, s, owner === undefined && s.owner !== undefined && !live(s.owner) ? 'lease-expired' : why);
    }
  }

  /** Judge a value of a record key; true if it is now the served record. */
  #accept(nodeId: string, kv: IKeyValue, owner: string | undefined, s: NodeState): boolean {
    const key = kv.key.toString('utf8');
    if (!isValidOwner(nodeId)) {
      this.#reject('key-mismatch', `key ${JSON.stringify(key.slice(0, 200))} does not end in a node id`, key);
      return false;
    }
    if (kv.value.byteLength > MAX_NODE_RECORD_BYTES) {
      this.#reject('oversized', `value of ${kv.value.byteLength} bytes exceeds ${MAX_NODE_RECORD_BYTES}`, key, nodeId);
      return false;
    }
    const decoded = tryDecodeNodeRecord(new Uint8Array(kv.value.buffer, kv.value.byteOffset, kv.value.byteLength));
    if (!decoded.ok) {
      this.#reject(decoded.reason, decoded.message, key, nodeId);
      return false;
    }
    const record = decoded.record;
    if (record.nodeId !== nodeId) {
      this.#reject('key-mismatch', `record of ${record.nodeId} stored under the key of ${nodeId}`, key, nodeId);
      return false;
    }
    const lease = kv.lease === '' ? '0' : kv.lease;
    if (lease === '0') {
      this.#reject('unleased', `record of ${nodeId}/${record.incarnation} is not attached to a lease, so it would never lapse; its owner did not write it`, key, nodeId);
      return false;
    }
    if (owner === undefined) {
      const served = this.#cache.get(nodeId);
      this.#reject(
        'conflicting-claim',
        `record of ${nodeId}/${record.incarnation} under lease ${lease} has no owner: its key was not created together with ${this.#owners}${nodeId} under one lease${served ? ` (keeping ${served.incarnation})` : ''}`,
        key,
        nodeId,
      );
      return false;
    }
    if (lease !== owner) {
      const served = this.#cache.get(nodeId);
      this.#reject(
        'conflicting-claim',
        `record of ${nodeId}/${record.incarnation} written under lease ${lease}, not by the owner of the key (lease ${owner})${served ? `; keeping ${served.nodeId}/${served.incarnation}` : ''}`,
        key,
        nodeId,
      );
      return false;
    }
    s.served = (s.node as KeyState).create;
    this.#cache.put(record);
    return true;
  }

  #drop(nodeId: string, s: NodeState, why: 'deleted' | 'resync' | 'lease-expired'): void {
    s.served = undefined;
    this.#cache.remove(nodeId, why);
  }

  // -------------------------------------------------------------------------------------
  // Publishing

  #pendingClaim: (() => void) | undefined;

  /** Our node's keys changed (anyone, us included): wake a waiting claim, check our record. */
  #onOwnKeysChanged(s: NodeState): void {
    if (this.#pendingClaim && (!live(s.node) || ownerLease(s.node, s.owner) === undefined)) this.#pendingClaim();
    if (this.#own?.published) this.#checkOwn();
  }

  /** Run a write of this node's keys after the ones before it. */
  #serial<T>(fn: () => Promise<T>): Promise<T> {
    const p = this.#ownChain.then(fn, fn);
    this.#ownChain = p.catch(() => undefined);
    return p;
  }

  /**
   * Check, with one compare-only transaction, that our keys are exactly what we wrote; if
   * not, someone else wrote them: log, count, and put our record back. Coalesced: one check
   * at a time, and one more if something changed meanwhile.
   */
  #checkOwn(): void {
    if (this.#checking) {
      this.#checkAgain = true;
      return;
    }
    this.#checking = true;
    void (async () => {
      try {
        do {
          this.#checkAgain = false;
          const intact = await this.#serial(() => this.#ownIntact());
          if (intact !== false) continue;
          const own = this.#own;
          if (!own || this.#closed) break;
          this.#restores++;
          this.#logger.error('discovery: this node\'s record was changed by another writer; restoring it', { store: this.store, nodeId: own.record.nodeId });
          own.published = false;
          this.#republish();
        } while (this.#checkAgain && !this.#closed);
      } catch (e) {
        this.#markUnavailable(e);
        this.#resync();
      } finally {
        this.#checking = false;
      }
    })();
  }

  /** True if our keys hold what we wrote; false if not; undefined if there is nothing to check. */
  async #ownIntact(): Promise<boolean | undefined> {
    const own = this.#own;
    if (!own || !own.published || own.life === undefined || !own.keeper || this.#closed) return undefined;
    const nodeKey = `${this.#nodes}${own.record.nodeId}`;
    const ownerKey = `${this.#owners}${own.record.nodeId}`;
    const life = String(own.life);
    const lease = own.keeper.id;
    const res = await this.#client
      .if(nodeKey, 'Create', '==', life)
      .and(nodeKey, 'Lease', '==', lease)
      .and(nodeKey, 'Value', '==', own.bytes)
      .and(ownerKey, 'Mod', '==', life)
      .and(ownerKey, 'Lease', '==', lease)
      .commit();
    return res.succeeded;
  }

  /**
   * Publish (or update) this node's record under this client's lease. If the node id is
   * held by another live owner (another incarnation's lease), waits until it is released or
   * lapses; rejects with RemoteRejectedError (`reason: 'conflicting-claim'`) if that does not
   * happen before the timeout (default: two TTLs). Leftovers that no live owner wrote
   * (unleased values, copies under other leases, keys whose owner's lease ended) do not
   * block: they are deleted. With etcd unreachable it rejects with BackendUnavailableError,
   * and the record is published as soon as etcd returns.
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
    const bytes = Buffer.from(encodeNodeRecord(r));
    if (this.#own) {
      this.#own.record = r;
      this.#own.bytes = bytes;
      this.#own.published = false;
    } else this.#own = { record: r, bytes, keeper: undefined, life: undefined, published: false };
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
        outcome = await this.#serial(() => this.#publishOnce());
      } catch (e) {
        if (e instanceof EtcdPermissionDeniedError) {
          // etcd auth: this user may not write this node id's keys (see the README's role layout).
          throw new RemoteRejectedError(`${this.store} refused to let this client write the keys of ${this.#own?.record.nodeId}: ${e.message}`, {
            details: { reason: 'permission-denied', remoteCode: 'PERMISSION_DENIED', store: this.store },
          });
        }
        this.#markUnavailable(e);
        this.#resync();
        throw this.#unavailable(`cannot publish ${this.#own?.record.nodeId}`);
      }
      if (outcome === 'published') return;
      // Held by another live owner: wait for its keys to change (or poll every half TTL).
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

  async #grant(own: OwnState): Promise<LeaseKeeper> {
    const res = await this.#client.leaseClient.leaseGrant({ TTL: this.ttlSeconds, ID: 0 });
    const leaseId = res.ID;
    this.#leasesGranted++;
    if (this.#closed || this.#own !== own) {
      void this.#client.leaseClient.leaseRevoke({ ID: leaseId }).catch(() => undefined);
      throw new ClosedError(`discovery on ${this.store} is closed`);
    }
    const keeper: LeaseKeeper = new LeaseKeeper(this.#client, leaseId, this.ttlSeconds, {
      onExpired: () => {
        if (own.keeper !== keeper) return;
        this.#logger.warn('discovery: etcd ended the lease of this node; publishing again under a new lease', { store: this.store, leaseId });
        own.keeper = undefined;
        own.life = undefined;
        own.published = false;
        this.#republish();
      },
      onStale: () => {
        if (own.keeper !== keeper) return;
        this.#logger.warn('discovery: no keep-alive acknowledged for a TTL; the record may have lapsed', { store: this.store, leaseId });
        own.published = false;
      },
      onFresh: () => {
        if (own.keeper === keeper) this.#republish();
      },
    });
    own.keeper = keeper;
    return keeper;
  }

  /**
   * One attempt, serialised with every other write of our keys: make sure we have a lease,
   * then update our key life, or create both keys, or clear leftovers no live owner holds.
   */
  async #publishOnce(): Promise<'published' | 'held'> {
    const own = this.#own;
    if (!own || this.#closed) return 'published';
    const nodeKey = `${this.#nodes}${own.record.nodeId}`;
    const ownerKey = `${this.#owners}${own.record.nodeId}`;
    for (let attempt = 0; attempt < 4; attempt++) {
      if (this.#own !== own || this.#closed) return 'published';
      const keeper = own.keeper ?? (await this.#grant(own));
      const lease = keeper.id;
      if (own.life !== undefined) {
        const life = String(own.life);
        const updated = await this.#client
          .if(nodeKey, 'Create', '==', life)
          .and(ownerKey, 'Mod', '==', life)
          .and(ownerKey, 'Lease', '==', lease)
          .then(this.#client.put(nodeKey).value(own.bytes).lease(lease))
          .commit();
        if (updated.succeeded) return this.#published(own, lease);
        own.life = undefined;
      }
      const created = await this.#client
        .if(nodeKey, 'Create', '==', 0)
        .and(ownerKey, 'Create', '==', 0)
        .then(this.#client.put(ownerKey).value(lease).lease(lease), this.#client.put(nodeKey).value(own.bytes).lease(lease))
        .else(this.#client.get(nodeKey), this.#client.get(ownerKey))
        .commit();
      if (created.succeeded) {
        own.life = BigInt(created.header.revision);
        return this.#published(own, lease);
      }
      const n = created.responses[0]?.response_range?.kvs[0];
      const o = created.responses[1]?.response_range?.kvs[0];
      const holder = ownerLease(n ? keyState(n) : undefined, o ? keyState(o) : undefined);
      if (holder === lease) {
        own.life = BigInt((n as IKeyValue).create_revision); // ours, created by an attempt whose reply was lost
        continue;
      }
      if (holder !== undefined) {
        // A live owner: its anchor is attached to its lease, so it exists only while that lease does.
        own.published = false;
        this.#logger.warn('discovery: node id held by another live lease; waiting for it to end', { store: this.store, nodeId: own.record.nodeId, lease: holder });
        return 'held';
      }
      // No live owner proves the key: leftovers (an unleased or foreign value that outlived
      // its owner's lease, a stray anchor). Delete exactly what we saw, then create.
      this.#logger.warn('discovery: clearing keys of this node id that no live owner holds', {
        store: this.store,
        nodeId: own.record.nodeId,
        recordLease: n?.lease ?? '-',
        anchorLease: o?.lease ?? '-',
      });
      const cleared = await this.#client
        .if(nodeKey, 'Mod', '==', n ? n.mod_revision : 0)
        .and(ownerKey, 'Mod', '==', o ? o.mod_revision : 0)
        .then(...(n ? [this.#client.delete().key(nodeKey)] : []), ...(o ? [this.#client.delete().key(ownerKey)] : []))
        .commit();
      if (!cleared.succeeded) continue; // changed meanwhile: look again
    }
    own.published = false;
    return 'held';
  }

  #published(own: OwnState, leaseId: string): 'published' {
    own.published = true;
    this.#logger.info('discovery: published', { store: this.store, nodeId: own.record.nodeId, incarnation: own.record.incarnation, leaseId });
    return 'published';
  }

  /** Publish in the background until it sticks (after a lost lease, a changed or deleted key, a resync). */
  #republish(): void {
    if (this.#publishing || this.#closed || !this.#own) return;
    this.#publishing = (async () => {
      let delay = 100;
      while (!this.#closing.signal.aborted && this.#own && !this.#own.published) {
        try {
          if ((await this.#serial(() => this.#publishOnce())) === 'published') break;
        } catch (e) {
          if (this.#closed) break;
          if (e instanceof EtcdPermissionDeniedError) {
            this.#logger.error('discovery: etcd refused to let this client write its own keys; check its role', { store: this.store, error: describe(e) });
          } else this.#markUnavailable(e);
          this.#resync();
        }
        await sleep(delay, this.#closing.signal);
        delay = Math.min(this.#maxBackoffMs, delay * 2);
      }
    })().finally(() => {
      this.#publishing = undefined;
    });
  }

  /** Remove this node's record (both keys, whatever the record key holds) and end its lease. Idempotent. */
  async withdraw(options: DiscoveryWaitOptions = {}): Promise<void> {
    const own = this.#own;
    if (!own) return;
    this.#own = undefined;
    const { signal, dispose } = waitSignal({ timeoutMs: options.timeoutMs ?? this.#callTimeoutMs, ...(options.signal ? { signal: options.signal } : {}) }, `withdraw ${own.record.nodeId}`);
    const nodeKey = `${this.#nodes}${own.record.nodeId}`;
    const ownerKey = `${this.#owners}${own.record.nodeId}`;
    // After any write in flight: delete both keys of our key life in one revision (so a value
    // someone else left in the record key goes too), then revoke the lease (a failure leaves
    // it to lapse within the TTL).
    const work = this.#serial(async () => {
      const keeper = own.keeper;
      own.keeper = undefined;
      own.published = false;
      if (!keeper) return;
      keeper.stop();
      if (own.life !== undefined) {
        await this.#client
          .if(nodeKey, 'Create', '==', String(own.life))
          .and(ownerKey, 'Mod', '==', String(own.life))
          .and(ownerKey, 'Lease', '==', keeper.id)
          .then(this.#client.delete().key(nodeKey), this.#client.delete().key(ownerKey))
          .commit()
          .catch(() => undefined);
      }
      await this.#client.leaseClient.leaseRevoke({ ID: keeper.id }).catch(() => undefined);
    });
    try {
      await Promise.race([work, new Promise((r) => signal?.addEventListener('abort', r, { once: true }))]);
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
