/**
 * One holder's outgoing lease traffic from one client: the release queue and the
 * auto-renew schedule, sent in batches with a bound on calls in flight.
 *
 * - **Releases coalesce.** `release()` puts the lease in a FIFO; on the next turn of the
 *   event loop the lane sends what is queued as one `ReleaseMany` per batch (at most
 *   `maxBatch` entries), at most `maxInFlight` calls at a time. A burst of 100,000 releases
 *   is ~100 calls, not 100,000.
 * - **Retries go through the same queue.** A failed call does not retry on its own timer:
 *   its entries go to the back of a retry FIFO, the whole lane pauses for a jittered,
 *   doubling delay, and every retry call spends a token from a per-holder budget (a token
 *   bucket refilled per second and per successful call). So the load on a failing holder
 *   is bounded by `maxInFlight` calls per pause and by the budget, never by the number of
 *   failures.
 * - **Renews coalesce.** Auto-renewed leases share ONE timer per lane: each tick sends every
 *   lease due within a quarter of its period as `RenewMany` batches, through the same
 *   in-flight bound and pause.
 * - **Version fallback.** A holder that answers UNIMPLEMENTED to the batched calls (an older
 *   version) is served with the unary `Release` / `Renew`, at most `unaryConcurrency` per
 *   in-flight slot.
 * - **Overload.** RESOURCE_EXHAUSTED with the holder's retry-after trailer means nothing was
 *   done: the entries are queued again and the lane waits at least that long.
 * - **Every entry ends once**: confirmed (`released`), given up after attempts
 *   (`failed`, reported), or never sent because its lease ran out while it waited in the
 *   queue (`expired`: the holder's GC ends it; a lease released after its deadline is still
 *   sent once, since the holder's deadline is never earlier than ours). `close()` stops within its limit: calls in flight are cancelled
 *   and what is queued fails with ClosedError.
 *
 * The lane knows nothing of gRPC channels: it talks to a {@link LaneTransport}, so the
 * property test drives it against a lease table with injected failures and fake time.
 */
import { status } from '@grpc/grpc-js';
import { ClosedError, RemoteRejectedError, type TensorwireError } from '@tensorwire/core';
import { isPermanentReleaseFailure } from './errors.js';
import type { EntryErrorMsg, ReleaseManyResponseMsg, RenewManyResponseMsg, RenewResponseMsg } from './proto.js';

/** How a release ended. Never thrown: read it, or listen to `releaseFailed`. */
export interface ReleaseResult {
  /** The holder answered (`blocksReleased` is then its count; 0 if the lease was already gone). */
  readonly confirmed: boolean;
  readonly blocksReleased: number;
  /** Release RPC attempts that carried this lease (one batched call counts once per lease). */
  readonly attempts: number;
  /** The last error, when not confirmed. */
  readonly error?: TensorwireError;
  /**
   * True when the lease ran out before its release could be sent (attempts 0): the holder's
   * expiry GC ends it. Counted as `expired`, not as a failure.
   */
  readonly expired?: boolean;
}

/** The calls a lane makes. Each rejects with a typed error carrying `details.grpcCode` (and `retryAfterMs` on overload). */
export interface LaneTransport {
  releaseMany(sessionIds: string[], acquireIds: string[], timeoutMs: number, signal: AbortSignal): Promise<ReleaseManyResponseMsg>;
  /** Unary Release by session id or acquire id (the other ''); resolves to the blocks released. */
  release(sessionId: string, acquireId: string, timeoutMs: number, signal: AbortSignal): Promise<number>;
  renewMany(sessionIds: string[], leaseMs: number[], timeoutMs: number, signal: AbortSignal): Promise<RenewManyResponseMsg>;
  renew(sessionId: string, leaseMs: number, timeoutMs: number, signal: AbortSignal): Promise<RenewResponseMsg>;
}

/** A lease the lane renews automatically. The lane owns the `renew*` fields. */
export interface RenewEntry {
  readonly sessionId: string;
  /** The lease to ask for (ms): the one granted last. */
  readonly leaseMs: number;
  /** Lease end on this process's clock; renew retries stop at `deadline - marginMs`. */
  readonly deadline: number;
  readonly marginMs: number;
  renewEveryMs: number;
  renewNextAt: number;
  /** 0 idle, 1 queued, 2 in flight. */
  renewState: 0 | 1 | 2;
}

/** What an entry of the release queue identifies, for events. */
export interface ReleaseInfo {
  readonly sessionId: string | undefined;
  readonly acquireId: string | undefined;
  readonly attempts: number;
}

export interface LaneHooks<R extends RenewEntry> {
  /** An entry will be retried after `delayMs` (at least). */
  releaseRetry(info: ReleaseInfo, error: TensorwireError, delayMs: number): void;
  /** An entry was given up (reported; the holder's GC is the backstop). */
  releaseFailed(info: ReleaseInfo, error: TensorwireError): void;
  /** An entry ended (confirmed, failed, expired or closed): called exactly once per `release()`. */
  ended?(info: ReleaseInfo, result: ReleaseResult): void;
  /** A batch left (metrics). */
  batch(kind: 'release' | 'renew', entries: number): void;
  /** A renew succeeded: the holder granted `leaseMs` from (at latest) `sentAt`. */
  renewed(entry: R, sentAt: number, leaseMs: number): void;
  /** The holder no longer knows the lease (NOT_FOUND / PERMISSION_DENIED): it is lost. */
  renewLost(entry: R, error: TensorwireError): void;
  /** A renew failed transiently; `retryAt` is when it is tried again, undefined when its budget is gone. */
  renewFailed(entry: R, error: TensorwireError, retryAt: number | undefined): void;
}

export interface RetryBudget {
  /** Tokens at most (each retry call spends one; default 20). */
  readonly burst?: number;
  /** Tokens added per second (default 10). */
  readonly perSecond?: number;
  /** Tokens added per successful call (default 1). */
  readonly perSuccess?: number;
}

export interface LaneTimers {
  now(): number;
  set(fn: () => void, ms: number): unknown;
  clear(handle: unknown): void;
}

export interface LaneOptions {
  /** Calls in flight to the holder at most (default 4). */
  readonly maxInFlight?: number;
  /** Entries per batched call at most (default 1024). */
  readonly maxBatch?: number;
  /** Unary calls per in-flight slot when the holder has no batched calls (default 16). */
  readonly unaryConcurrency?: number;
  /** Deadline of one release call (ms, default 5000). */
  readonly releaseTimeoutMs?: number;
  /** Deadline of one renew call (ms, default 10000). */
  readonly renewTimeoutMs?: number;
  /** First pause after a failed call (ms, default 50). */
  readonly initialDelayMs?: number;
  /** Longest pause (ms, default 2000). */
  readonly maxDelayMs?: number;
  readonly retryBudget?: RetryBudget;
  readonly timers?: LaneTimers;
  /** [0, 1) for jitter (tests). */
  readonly random?: () => number;
}

export interface LaneStats {
  /** Releases waiting to be sent (fresh + retries). */
  readonly releaseQueued: number;
  /** Renews waiting to be sent. */
  readonly renewQueued: number;
  /** Leases on the auto-renew schedule. */
  readonly autoRenewed: number;
  readonly inFlight: number;
  readonly releaseBatches: number;
  readonly renewBatches: number;
  /** Release entries re-sent after a failure. */
  readonly releaseRetries: number;
  /** Renew entries re-sent after a failure. */
  readonly renewRetries: number;
  /** Times a retry had to wait because the retry budget was empty. */
  readonly budgetExhausted: number;
  /** Calls the holder refused for overload (RESOURCE_EXHAUSTED with retry-after). */
  readonly overloaded: number;
  /** True once the holder answered UNIMPLEMENTED to a batched call. */
  readonly unary: boolean;
}

interface ReleaseItem {
  readonly sessionId: string;
  readonly acquireId: string;
  readonly giveUpAt: number;
  /** When it was queued: an entry whose lease ran out while it waited is not sent (expired). */
  readonly queuedAt: number;
  attempts: number;
  lastError: TensorwireError | undefined;
  readonly resolve: (r: ReleaseResult) => void;
}

/** A FIFO on an array with a moving head (no per-entry node, O(1) amortized). */
class Fifo<T> {
  #a: (T | undefined)[] = [];
  #head = 0;
  get length(): number {
    return this.#a.length - this.#head;
  }
  push(v: T): void {
    this.#a.push(v);
  }
  unshiftAll(vs: readonly T[]): void {
    const rest = this.#a.slice(this.#head);
    this.#a = [...vs, ...rest];
    this.#head = 0;
  }
  shift(): T | undefined {
    if (this.#head >= this.#a.length) return undefined;
    const v = this.#a[this.#head];
    this.#a[this.#head++] = undefined;
    if (this.#head > 1024 && this.#head * 2 > this.#a.length) {
      this.#a = this.#a.slice(this.#head);
      this.#head = 0;
    }
    return v;
  }
  drain(): T[] {
    const out = this.#a.slice(this.#head) as T[];
    this.#a = [];
    this.#head = 0;
    return out;
  }
}

const systemTimers: LaneTimers = {
  now: () => performance.timeOrigin + performance.now(),
  set: (fn, ms) => {
    const t = setTimeout(fn, ms);
    t.unref();
    return t;
  },
  clear: (h) => clearTimeout(h as NodeJS.Timeout),
};

function codeOf(e: TensorwireError): number | undefined {
  const c = e.details['grpcCode'];
  return typeof c === 'number' ? c : undefined;
}

function entryError(e: EntryErrorMsg, what: string): TensorwireError {
  const name = (status as unknown as Record<number, string>)[e.code] ?? `STATUS_${e.code}`;
  return new RemoteRejectedError(`${what}: ${name}: ${e.message}`, { details: { remoteCode: name, grpcCode: e.code } });
}

export class HolderLane<R extends RenewEntry> {
  readonly holder: string;
  readonly #t: LaneTransport;
  readonly #hooks: LaneHooks<R>;
  readonly #timers: LaneTimers;
  readonly #random: () => number;
  readonly #maxInFlight: number;
  readonly #unaryConcurrency: number;
  readonly #releaseTimeoutMs: number;
  readonly #renewTimeoutMs: number;
  readonly #initialDelay: number;
  readonly #maxDelay: number;
  readonly #burst: number;
  readonly #perSecond: number;
  readonly #perSuccess: number;
  readonly #abort = new AbortController();
  readonly #fresh = new Fifo<ReleaseItem>();
  readonly #retry = new Fifo<ReleaseItem>();
  readonly #renewQ = new Fifo<R>();
  readonly #renewSet = new Set<R>();
  readonly #idleWaiters: (() => void)[] = [];
  #batchSize: number;
  #unary = false;
  #inFlight = 0;
  #pumpQueued = false;
  #pausedUntil = 0;
  #delay: number;
  #wakeTimer: unknown;
  #wakeAt = Number.POSITIVE_INFINITY;
  #tickTimer: unknown;
  #tickAt = Number.POSITIVE_INFINITY;
  #tokens: number;
  #tokensAt: number;
  /** Set by close(): failures after this time are final. */
  #retryUntil = Number.POSITIVE_INFINITY;
  #stopped = false;
  #closing = false;
  #releaseBatches = 0;
  #renewBatches = 0;
  #releaseRetries = 0;
  #renewRetries = 0;
  #budgetExhausted = 0;
  #overloaded = 0;

  constructor(holder: string, transport: LaneTransport, hooks: LaneHooks<R>, options: LaneOptions = {}) {
    this.holder = holder;
    this.#t = transport;
    this.#hooks = hooks;
    this.#timers = options.timers ?? systemTimers;
    this.#random = options.random ?? Math.random;
    this.#maxInFlight = Math.max(1, Math.floor(options.maxInFlight ?? 4));
    this.#batchSize = Math.max(1, Math.floor(options.maxBatch ?? 1024));
    this.#unaryConcurrency = Math.max(1, Math.floor(options.unaryConcurrency ?? 16));
    this.#releaseTimeoutMs = options.releaseTimeoutMs ?? 5000;
    this.#renewTimeoutMs = options.renewTimeoutMs ?? 10_000;
    this.#initialDelay = options.initialDelayMs ?? 50;
    this.#maxDelay = options.maxDelayMs ?? 2000;
    this.#delay = this.#initialDelay;
    const b = options.retryBudget ?? {};
    this.#burst = Math.max(1, b.burst ?? 20);
    this.#perSecond = Math.max(0, b.perSecond ?? 10);
    this.#perSuccess = Math.max(0, b.perSuccess ?? 1);
    this.#tokens = this.#burst;
    this.#tokensAt = this.#timers.now();
  }

  stats(): LaneStats {
    return {
      releaseQueued: this.#fresh.length + this.#retry.length,
      renewQueued: this.#renewQ.length,
      autoRenewed: this.#renewSet.size,
      inFlight: this.#inFlight,
      releaseBatches: this.#releaseBatches,
      renewBatches: this.#renewBatches,
      releaseRetries: this.#releaseRetries,
      renewRetries: this.#renewRetries,
      budgetExhausted: this.#budgetExhausted,
      overloaded: this.#overloaded,
      unary: this.#unary,
    };
  }

  /** Whether close() has given up on this lane (nothing more is sent). */
  get stopped(): boolean {
    return this.#stopped;
  }

  /**
   * Queue the release of a lease (by session id) or of an acquire (by acquire id). Retried
   * until `giveUpAt` (the lease would have ended anyway). Resolves once, never rejects.
   */
  release(target: { sessionId?: string; acquireId?: string }, giveUpAt: number): Promise<ReleaseResult> {
    return new Promise<ReleaseResult>((resolve) => {
      const item: ReleaseItem = {
        sessionId: target.sessionId ?? '',
        acquireId: target.acquireId ?? '',
        giveUpAt,
        queuedAt: this.#timers.now(),
        attempts: 0,
        lastError: undefined,
        resolve,
      };
      if (this.#stopped) {
        this.#giveUp(item, new ClosedError('lock client closed'));
        return;
      }
      this.#fresh.push(item);
      this.#schedulePump();
    });
  }

  /** Put a lease on the auto-renew schedule (first renew `entry.renewEveryMs` from now). */
  addAutoRenew(entry: R): void {
    // Closing: nothing is renewed any more (the client releases every lease now).
    if (this.#closing) return;
    entry.renewNextAt = this.#timers.now() + entry.renewEveryMs;
    entry.renewState = 0;
    this.#renewSet.add(entry);
    this.#armTick(entry.renewNextAt - entry.renewEveryMs / 4);
  }

  /** Take a lease off the schedule (released, lost, dropped). A renew in flight is ignored when it returns. */
  removeAutoRenew(entry: R): void {
    this.#renewSet.delete(entry);
  }

  /**
   * Stop: keep sending what is queued for up to `limitMs` (retrying failures only during the
   * first second of it), then cancel calls in flight and fail what is left with ClosedError.
   * Resolves when every queued entry has ended.
   */
  async close(limitMs: number): Promise<void> {
    const now = this.#timers.now();
    this.#closing = true;
    this.#retryUntil = Math.min(this.#retryUntil, now + Math.min(limitMs, 1000));
    this.#renewSet.clear();
    if (this.#tickTimer !== undefined) this.#timers.clear(this.#tickTimer);
    this.#tickTimer = undefined;
    this.#tickAt = Number.POSITIVE_INFINITY;
    for (const e of this.#renewQ.drain()) e.renewState = 0;
    if (!this.#idle()) {
      let timer: unknown;
      await Promise.race([
        new Promise<void>((resolve) => this.#idleWaiters.push(resolve)),
        new Promise<void>((resolve) => {
          timer = this.#timers.set(resolve, limitMs);
        }),
      ]);
      this.#timers.clear(timer);
    }
    this.#stop();
    if (!this.#idle()) await new Promise<void>((resolve) => this.#idleWaiters.push(resolve));
  }

  /** Cancel calls in flight and fail everything queued. */
  #stop(): void {
    if (this.#stopped) return;
    this.#stopped = true;
    if (this.#wakeTimer !== undefined) this.#timers.clear(this.#wakeTimer);
    this.#wakeTimer = undefined;
    if (this.#tickTimer !== undefined) this.#timers.clear(this.#tickTimer);
    this.#tickTimer = undefined;
    this.#renewSet.clear();
    const closed = new ClosedError('lock client closed before the release was confirmed');
    for (const q of [this.#fresh, this.#retry]) {
      for (const it of q.drain()) this.#giveUp(it, it.lastError ?? closed);
    }
    this.#abort.abort(closed);
    this.#checkIdle();
  }

  #idle(): boolean {
    return this.#inFlight === 0 && this.#fresh.length === 0 && this.#retry.length === 0;
  }

  #checkIdle(): void {
    if (this.#idleWaiters.length > 0 && this.#idle()) for (const w of this.#idleWaiters.splice(0)) w();
  }

  #schedulePump(): void {
    if (this.#pumpQueued) return;
    this.#pumpQueued = true;
    // The next turn of the event loop: releases issued in this turn (a burst) leave as one
    // batch, and after whatever else this turn sends. A fetch loop disposes a fetch and
    // acquires the next in one turn: the holder gets that Acquire before the Release and
    // answers it first, so the release is never on the next fetch's path.
    setImmediate(() => {
      this.#pumpQueued = false;
      this.#pump();
    });
  }

  #armWake(at: number): void {
    if (this.#stopped || at >= this.#wakeAt) return;
    if (this.#wakeTimer !== undefined) this.#timers.clear(this.#wakeTimer);
    this.#wakeAt = at;
    this.#wakeTimer = this.#timers.set(
      () => {
        this.#wakeTimer = undefined;
        this.#wakeAt = Number.POSITIVE_INFINITY;
        this.#pump();
      },
      Math.max(0, at - this.#timers.now()),
    );
  }

  #armTick(at: number): void {
    if (this.#stopped || at >= this.#tickAt) return;
    if (this.#tickTimer !== undefined) this.#timers.clear(this.#tickTimer);
    this.#tickAt = at;
    this.#tickTimer = this.#timers.set(() => this.#tick(), Math.max(0, at - this.#timers.now()));
  }

  /** The one renew timer: queue every lease due within a quarter of its period. */
  #tick(): void {
    this.#tickTimer = undefined;
    this.#tickAt = Number.POSITIVE_INFINITY;
    const now = this.#timers.now();
    let next = Number.POSITIVE_INFINITY;
    for (const e of this.#renewSet) {
      if (e.renewState !== 0) continue;
      const at = e.renewNextAt - e.renewEveryMs / 4;
      if (at <= now) {
        e.renewState = 1;
        this.#renewQ.push(e);
      } else if (at < next) next = at;
    }
    if (next !== Number.POSITIVE_INFINITY) this.#armTick(next);
    this.#pump();
  }

  #takeToken(now: number): boolean {
    this.#tokens = Math.min(this.#burst, this.#tokens + ((now - this.#tokensAt) / 1000) * this.#perSecond);
    this.#tokensAt = now;
    if (this.#tokens >= 1) {
      this.#tokens -= 1;
      return true;
    }
    return false;
  }

  #pump(): void {
    if (this.#stopped) return;
    const now = this.#timers.now();
    if (now < this.#pausedUntil) {
      this.#armWake(this.#pausedUntil);
      return;
    }
    while (this.#inFlight < this.#maxInFlight) {
      // Renews first: a late renew loses a lease, a late release only delays its end.
      if (this.#renewQ.length > 0) {
        this.#sendRenews(now);
        continue;
      }
      if (this.#fresh.length > 0) {
        this.#sendReleases(this.#fresh, now);
        continue;
      }
      if (this.#retry.length > 0) {
        if (!this.#takeToken(now)) {
          this.#budgetExhausted++;
          const wait = this.#perSecond > 0 ? ((1 - this.#tokens) / this.#perSecond) * 1000 : this.#maxDelay;
          this.#armWake(now + Math.max(1, wait));
          break;
        }
        this.#sendReleases(this.#retry, now);
        continue;
      }
      break;
    }
    this.#checkIdle();
  }

  /** Every entry ends here, once. */
  #end(it: ReleaseItem, result: ReleaseResult): void {
    this.#hooks.ended?.(it, result);
    it.resolve(result);
  }

  /** End an entry that will not be sent again. */
  #giveUp(it: ReleaseItem, error: TensorwireError | undefined): void {
    if (it.attempts === 0 && error === undefined) {
      this.#end(it, { confirmed: false, blocksReleased: 0, attempts: 0, expired: true });
      return;
    }
    const e = error ?? new ClosedError('release given up');
    this.#hooks.releaseFailed(it, e);
    this.#end(it, { confirmed: false, blocksReleased: 0, attempts: it.attempts, error: e });
  }

  #sendReleases(q: Fifo<ReleaseItem>, now: number): void {
    const max = this.#unary ? this.#unaryConcurrency : this.#batchSize;
    const items: ReleaseItem[] = [];
    while (items.length < max) {
      const it = q.shift();
      if (it === undefined) break;
      // Its lease ran out while it waited: never sent (expired), or failed until now (failed).
      // A lease released after its deadline is still sent once: the holder's deadline is later.
      if (now >= it.giveUpAt && (it.attempts > 0 || it.queuedAt < it.giveUpAt)) this.#giveUp(it, it.lastError);
      else items.push(it);
    }
    if (items.length === 0) return;
    for (const it of items) {
      if (it.attempts > 0) this.#releaseRetries++;
      it.attempts++;
    }
    this.#inFlight++;
    this.#releaseBatches++;
    this.#hooks.batch('release', items.length);
    const signal = this.#abort.signal;
    if (this.#unary) {
      void Promise.allSettled(items.map((it) => this.#t.release(it.sessionId, it.acquireId, this.#releaseTimeoutMs, signal))).then((results) => {
        let failed: TensorwireError | undefined;
        for (let i = 0; i < items.length; i++) {
          const r = results[i] as PromiseSettledResult<number>;
          const it = items[i] as ReleaseItem;
          if (r.status === 'fulfilled') this.#end(it, { confirmed: true, blocksReleased: r.value, attempts: it.attempts });
          else {
            const e = r.reason as TensorwireError;
            if (!isPermanentReleaseFailure(e)) failed = e;
            this.#retryOrFail(it, e);
          }
        }
        this.#callDone(failed);
      });
      return;
    }
    let sessionIds: string[] = [];
    let acquireIds: string[] = [];
    let byAcquire = false;
    for (const it of items) if (it.acquireId !== '') byAcquire = true;
    if (!byAcquire) sessionIds = items.map((it) => it.sessionId);
    else {
      // Session ids first, then acquire ids: reorder the items the same way.
      const s: ReleaseItem[] = [];
      const a: ReleaseItem[] = [];
      for (const it of items) (it.acquireId !== '' ? a : s).push(it);
      items.length = 0;
      items.push(...s, ...a);
      sessionIds = s.map((it) => it.sessionId);
      acquireIds = a.map((it) => it.acquireId);
    }
    this.#t.releaseMany(sessionIds, acquireIds, this.#releaseTimeoutMs, signal).then(
      (res) => {
        if (res.released.length !== items.length) {
          const e = new RemoteRejectedError(`holder answered ${res.released.length} entries for ${items.length}`, { details: { remoteCode: 'INTERNAL', grpcCode: status.INTERNAL } });
          for (const it of items) this.#retryOrFail(it, e);
          this.#callDone(e);
          return;
        }
        let errors: Map<number, EntryErrorMsg> | undefined;
        if (res.errors.length > 0) {
          errors = new Map();
          for (const e of res.errors) errors.set(e.index, e);
        }
        for (let i = 0; i < items.length; i++) {
          const it = items[i] as ReleaseItem;
          const ee = errors?.get(i);
          if (ee === undefined) this.#end(it, { confirmed: true, blocksReleased: res.released[i] as number, attempts: it.attempts });
          else this.#retryOrFail(it, entryError(ee, 'release'));
        }
        this.#callDone(undefined);
      },
      (e: unknown) => {
        const error = e as TensorwireError;
        const code = codeOf(error);
        if (code === status.UNIMPLEMENTED && !this.#unary) {
          // An older holder: unary calls from now on; these entries were not attempted.
          this.#unary = true;
          for (const it of items) it.attempts--;
          this.#fresh.unshiftAll(items);
          this.#callDone(undefined);
          return;
        }
        if (code === status.RESOURCE_EXHAUSTED && typeof error.details['retryAfterMs'] !== 'number' && this.#batchSize > 1) {
          // The holder takes smaller batches: halve ours.
          this.#batchSize = Math.max(1, this.#batchSize >> 1);
        }
        for (const it of items) this.#retryOrFail(it, error);
        this.#callDone(error);
      },
    );
  }

  /** After a failure: queue the entry for a retry, or give it up (permanent, closing, lease over). */
  #retryOrFail(it: ReleaseItem, error: TensorwireError): void {
    it.lastError = error;
    const now = this.#timers.now();
    const wait = Math.max(this.#pausedUntil - now, this.#jitter(this.#delay));
    if (this.#stopped || isPermanentReleaseFailure(error) || now >= this.#retryUntil || now + wait >= it.giveUpAt) {
      this.#giveUp(it, error);
      return;
    }
    this.#hooks.releaseRetry(it, error, wait);
    this.#retry.push(it);
  }

  #jitter(ms: number): number {
    return ms * (0.75 + this.#random() * 0.5);
  }

  /** A call ended: pause the lane after a transient failure, reset the backoff after a success. */
  #callDone(failure: TensorwireError | undefined): void {
    this.#inFlight--;
    const now = this.#timers.now();
    if (failure === undefined) {
      this.#delay = this.#initialDelay;
      this.#tokens = Math.min(this.#burst, this.#tokens + this.#perSuccess);
    } else if (!isPermanentReleaseFailure(failure)) {
      const retryAfter = failure.details['retryAfterMs'];
      if (typeof retryAfter === 'number') this.#overloaded++;
      const pause = Math.max(typeof retryAfter === 'number' ? retryAfter : 0, this.#jitter(this.#delay));
      this.#pausedUntil = Math.max(this.#pausedUntil, now + pause);
      this.#delay = Math.min(this.#maxDelay, this.#delay * 2);
    }
    if (this.#stopped) this.#checkIdle();
    else this.#pump();
  }

  #sendRenews(now: number): void {
    const max = this.#unary ? this.#unaryConcurrency : this.#batchSize;
    const entries: R[] = [];
    while (entries.length < max) {
      const e = this.#renewQ.shift();
      if (e === undefined) break;
      if (!this.#renewSet.has(e)) {
        e.renewState = 0;
        continue;
      }
      e.renewState = 2;
      entries.push(e);
    }
    if (entries.length === 0) return;
    this.#inFlight++;
    this.#renewBatches++;
    this.#hooks.batch('renew', entries.length);
    const signal = this.#abort.signal;
    const sentAt = now;
    if (this.#unary) {
      void Promise.allSettled(entries.map((e) => this.#t.renew(e.sessionId, e.leaseMs, this.#renewTimeoutMs, signal))).then((results) => {
        let failed: TensorwireError | undefined;
        for (let i = 0; i < entries.length; i++) {
          const r = results[i] as PromiseSettledResult<RenewResponseMsg>;
          const e = entries[i] as R;
          if (r.status === 'fulfilled') this.#renewOk(e, sentAt, r.value.leaseMs);
          else {
            const err = r.reason as TensorwireError;
            if (!this.#renewErr(e, err)) failed = err;
          }
        }
        this.#callDone(failed);
      });
      return;
    }
    const ids = entries.map((e) => e.sessionId);
    const leaseMs = entries.map((e) => Math.floor(e.leaseMs));
    this.#t.renewMany(ids, leaseMs, this.#renewTimeoutMs, signal).then(
      (res) => {
        if (res.leaseMs.length !== entries.length) {
          const err = new RemoteRejectedError(`holder answered ${res.leaseMs.length} entries for ${entries.length}`, { details: { remoteCode: 'INTERNAL', grpcCode: status.INTERNAL } });
          for (const e of entries) this.#renewErr(e, err);
          this.#callDone(err);
          return;
        }
        let errors: Map<number, EntryErrorMsg> | undefined;
        if (res.errors.length > 0) {
          errors = new Map();
          for (const x of res.errors) errors.set(x.index, x);
        }
        for (let i = 0; i < entries.length; i++) {
          const e = entries[i] as R;
          const ee = errors?.get(i);
          if (ee === undefined) this.#renewOk(e, sentAt, res.leaseMs[i] as number);
          else this.#renewErr(e, entryError(ee, 'renew'));
        }
        this.#callDone(undefined);
      },
      (err: unknown) => {
        const error = err as TensorwireError;
        if (codeOf(error) === status.UNIMPLEMENTED && !this.#unary) {
          this.#unary = true;
          for (const e of entries) e.renewState = 1;
          this.#renewQ.unshiftAll(entries);
          this.#callDone(undefined);
          return;
        }
        for (const e of entries) this.#renewErr(e, error);
        this.#callDone(error);
      },
    );
  }

  #renewOk(e: R, sentAt: number, leaseMs: number): void {
    e.renewState = 0;
    if (!this.#renewSet.has(e)) return;
    this.#hooks.renewed(e, sentAt, leaseMs);
    if (!this.#renewSet.has(e)) return;
    e.renewNextAt = this.#timers.now() + e.renewEveryMs;
    this.#armTick(e.renewNextAt - e.renewEveryMs / 4);
  }

  /** Returns true when the failure is final for the entry (the lease is lost). */
  #renewErr(e: R, error: TensorwireError): boolean {
    e.renewState = 0;
    if (!this.#renewSet.has(e)) return true;
    const code = codeOf(error);
    if (code === status.NOT_FOUND || code === status.PERMISSION_DENIED) {
      this.#renewSet.delete(e);
      this.#hooks.renewLost(e, error);
      return true;
    }
    const now = this.#timers.now();
    const left = e.deadline - e.marginMs - now;
    if (left <= 0 || this.#stopped) {
      this.#renewSet.delete(e);
      this.#hooks.renewFailed(e, error, undefined);
      return false;
    }
    this.#renewRetries++;
    // Try again soon while the budget lasts: within a quarter of what is left, at most 1 s.
    const at = now + Math.max(1, Math.min(1000, left / 4, this.#jitter(this.#delay)));
    this.#hooks.renewFailed(e, error, at);
    // The tick queues it a quarter period early; aim it so it leaves at `at`.
    e.renewNextAt = at + e.renewEveryMs / 4;
    this.#armTick(at);
    return false;
  }
}
