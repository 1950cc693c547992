/**
 * Lease-scoped grants through type-2 memory windows: the bookkeeping on both sides.
 *
 * A type-2 window is bound to one queue pair by a BIND_MW work request the holder posts, and
 * its rkey works only for requests arriving on that queue pair. A registration in window mode
 * is an MR with no remote access of its own; its descriptor carries a 128-bit grant token
 * instead of an rkey. A requester presents the token on its connection (BIND); the holder
 * binds one window per queue pair of that connection and answers with their rkeys (BOUND),
 * or says why not (REFUSE). Revoking the registration deallocates every window bound for it
 * (remote access fails from then on) and tells each requester (UNBIND).
 *
 * Nothing here touches a device: {@link WindowLedger} is the holder's table of which windows
 * exist for which grant on which connection, {@link WindowKeyCache} the requester's cache of
 * rkeys per grant on one connection. Both are keyed by the whole grant token, and both live
 * with the connection they serve (invariant 2).
 */
import { ConnectionBrokenError, RemoteRejectedError, ResourceExhaustedError, SessionInvalidatedError, type TensorwireError } from '@tensorwire/core';
import { GRANT_TOKEN_BYTES } from './wire.js';

/**
 * Why a holder refuses a BIND: `unknown-grant` (never issued or revoked), `window-limit` (the
 * peer holds windows for as many grants as it may), `no-windows` (the device is out of
 * windows), `bind-failed` (the bind itself failed), `closing` (the connection is closing).
 */
export type RefuseCode = 'unknown-grant' | 'window-limit' | 'no-windows' | 'bind-failed' | 'closing';

export function tokenHex(token: Uint8Array): string {
  return Buffer.from(token.buffer, token.byteOffset, token.byteLength).toString('hex');
}

/** The windows bound for one grant on one connection. */
export class Binding<C> {
  readonly conn: C;
  readonly token: string;
  /** Window ids allocated so far (one per queue pair once bound); the holder deallocates them. */
  readonly windows: number[] = [];
  /** Registration grants: one rkey per queue pair; range grants: keys × queue pairs (empty in memory-region mode). */
  rkeys: ArrayLike<number> | undefined;
  /** Windows counted against the peer's window budget for this binding (range grants), until released. */
  reserved = 0;
  /** binding → bound; binding → cancelled (revoked or connection gone while binding). */
  state: 'binding' | 'bound' | 'cancelled' = 'binding';
  /** Resolves once the binding is no longer 'binding' and its windows are settled. */
  readonly settled: Promise<void>;
  #resolve!: () => void;
  constructor(conn: C, token: string) {
    this.conn = conn;
    this.token = token;
    this.settled = new Promise<void>((r) => (this.#resolve = r));
  }
  /** @internal */
  finish(): void {
    this.#resolve();
  }
}

export type BindRequest<C, G> =
  | { readonly kind: 'existing'; readonly binding: Binding<C> }
  | { readonly kind: 'new'; readonly binding: Binding<C>; readonly grant: G }
  | { readonly kind: 'refused'; readonly code: RefuseCode; readonly message: string };

/**
 * The holder's table: grants that may be bound (by token) and the bindings per grant and per
 * connection. `C` is the connection, `G` the registration. The budget is per peer (all its
 * connections together), so opening more connections buys a peer no more windows.
 */
export class WindowLedger<C, G> {
  /** Most grants one peer may have windows for at once, over all its connections. */
  readonly limitPerPeer: number;
  readonly #peerOf: (conn: C) => string;
  readonly #grants = new Map<string, { readonly grant: G; readonly bindings: Map<C, Binding<C>> }>();
  readonly #byConn = new Map<C, Map<string, Binding<C>>>();
  readonly #perPeer = new Map<string, number>();

  constructor(limitPerPeer: number, peerOf: (conn: C) => string = String) {
    if (!Number.isInteger(limitPerPeer) || limitPerPeer < 1) throw new RangeError('limitPerPeer must be a positive integer');
    this.limitPerPeer = limitPerPeer;
    this.#peerOf = peerOf;
  }

  /** A registration that peers may bind windows for. */
  addGrant(token: string, grant: G): void {
    if (this.#grants.has(token)) throw new Error('grant token already in use');
    this.#grants.set(token, { grant, bindings: new Map() });
  }

  grant(token: string): G | undefined {
    return this.#grants.get(token)?.grant;
  }

  get grantCount(): number {
    return this.#grants.size;
  }

  /** Bindings (any state) a connection holds. */
  bindingCount(conn: C): number {
    return this.#byConn.get(conn)?.size ?? 0;
  }

  /** Bindings (any state) a peer holds over all its connections. */
  peerBindingCount(conn: C): number {
    return this.#perPeer.get(this.#peerOf(conn)) ?? 0;
  }

  /** A requester on `conn` presents `token`. */
  request(conn: C, token: string): BindRequest<C, G> {
    const g = this.#grants.get(token);
    if (!g) return { kind: 'refused', code: 'unknown-grant', message: 'no such grant: it was never issued here or has been revoked' };
    const existing = g.bindings.get(conn);
    if (existing) return { kind: 'existing', binding: existing };
    const peer = this.#peerOf(conn);
    const used = this.#perPeer.get(peer) ?? 0;
    if (used >= this.limitPerPeer) {
      return { kind: 'refused', code: 'window-limit', message: `this peer already has windows for ${this.limitPerPeer} grants` };
    }
    const b = new Binding(conn, token);
    g.bindings.set(conn, b);
    let mine = this.#byConn.get(conn);
    if (!mine) this.#byConn.set(conn, (mine = new Map()));
    mine.set(token, b);
    this.#perPeer.set(peer, used + 1);
    return { kind: 'new', binding: b, grant: g.grant };
  }

  /**
   * The windows of `b` are bound. False when it was cancelled meanwhile: the caller
   * deallocates its windows, then calls `b.finish()`, and refuses the request.
   */
  complete(b: Binding<C>, rkeys: ArrayLike<number>): boolean {
    if (b.state !== 'binding') return false;
    b.state = 'bound';
    b.rkeys = rkeys;
    b.finish();
    return true;
  }

  /** Binding failed: forget it. The caller deallocates its windows. */
  fail(b: Binding<C>): void {
    this.#remove(b);
    b.state = 'cancelled';
    b.finish();
  }

  /**
   * Revoke a grant: no new bindings, and every binding is removed and returned. Bound ones
   * must have their windows deallocated now; ones still binding are marked cancelled, and the
   * caller waits for `settled` (their binder deallocates).
   */
  revokeGrant(token: string): Binding<C>[] {
    const g = this.#grants.get(token);
    if (!g) return [];
    this.#grants.delete(token);
    const out = [...g.bindings.values()];
    for (const b of out) this.#detach(b);
    return out;
  }

  /** A connection is gone: every binding it had is removed and returned (see revokeGrant). */
  dropConnection(conn: C): Binding<C>[] {
    const mine = this.#byConn.get(conn);
    if (!mine) return [];
    const out = [...mine.values()];
    for (const b of out) this.#detach(b);
    return out;
  }

  #detach(b: Binding<C>): void {
    this.#remove(b);
    if (b.state === 'binding') b.state = 'cancelled';
  }

  #remove(b: Binding<C>): void {
    this.#grants.get(b.token)?.bindings.delete(b.conn);
    const mine = this.#byConn.get(b.conn);
    if (mine?.get(b.token) === b) {
      mine.delete(b.token);
      if (mine.size === 0) this.#byConn.delete(b.conn);
      const peer = this.#peerOf(b.conn);
      const left = (this.#perPeer.get(peer) ?? 1) - 1;
      if (left > 0) this.#perPeer.set(peer, left);
      else this.#perPeer.delete(peer);
    }
  }
}

/** The typed error for a REFUSE: backpressure, a closing connection, or a rejection. */
export function refusal(code: string, message: string): TensorwireError {
  const details = { remoteCode: code };
  if (code === 'window-limit' || code === 'no-windows') return new ResourceExhaustedError(`the holder has no room for more windows: ${message}`, { details });
  if (code === 'closing') return new SessionInvalidatedError(`the holder is closing the connection: ${message}`, { details });
  return new RemoteRejectedError(`the holder refused the grant: ${message}`, { details });
}

/** rkeys of one grant on one connection, one per queue pair. `revoked` is set by UNBIND. */
export interface WindowKeys {
  readonly rkeys: readonly number[];
  revoked: boolean;
}

interface Waiting {
  readonly token: string;
  readonly resolve: (k: WindowKeys) => void;
  readonly reject: (e: TensorwireError) => void;
}

/** BINDs a requester has in flight on one connection; the holder treats more as abuse. */
export const MAX_BINDS_IN_FLIGHT = 64;

/**
 * The requester's side on one connection: rkeys per grant token, with one BIND in flight per
 * token however many transfers want it, and at most `maxInFlight` BINDs in flight at all
 * (the rest wait their turn).
 */
export class WindowKeyCache {
  readonly #send: (requestId: number, token: Uint8Array) => void;
  readonly #queuePairs: number;
  readonly #maxInFlight: number;
  readonly #queued: { readonly requestId: number; readonly token: Uint8Array }[] = [];
  #inFlight = 0;
  readonly #keys = new Map<string, WindowKeys>();
  readonly #inflight = new Map<string, Promise<WindowKeys>>();
  readonly #waiting = new Map<number, Waiting>();
  #nextRequest = 1;
  #failed: TensorwireError | undefined;

  constructor(queuePairs: number, send: (requestId: number, token: Uint8Array) => void, maxInFlight = MAX_BINDS_IN_FLIGHT) {
    this.#queuePairs = queuePairs;
    this.#send = send;
    this.#maxInFlight = maxInFlight;
  }

  /** BINDs sent and not yet answered. */
  get inFlight(): number {
    return this.#inFlight;
  }

  #dispatch(): void {
    while (this.#inFlight < this.#maxInFlight && this.#queued.length > 0) {
      const q = this.#queued.shift() as { requestId: number; token: Uint8Array };
      this.#inFlight++;
      this.#send(q.requestId, q.token);
    }
  }

  #answered(): void {
    this.#inFlight--;
    this.#dispatch();
  }

  /** Grants with rkeys cached. */
  get size(): number {
    return this.#keys.size;
  }

  /** BINDs waiting for an answer. */
  get pending(): number {
    return this.#waiting.size;
  }

  /**
   * The rkeys for `token` on this connection: cached, or one BIND shared by every caller.
   * `hex` is `tokenHex(token)` when the caller has it already.
   */
  get(token: Uint8Array, hex = tokenHex(token)): WindowKeys | Promise<WindowKeys> {
    if (token.length !== GRANT_TOKEN_BYTES) return Promise.reject(new RemoteRejectedError('malformed grant token'));
    const hit = this.#keys.get(hex);
    if (hit) return hit;
    if (this.#failed) return Promise.reject(this.#failed);
    let p = this.#inflight.get(hex);
    if (!p) {
      const requestId = this.#nextRequest;
      this.#nextRequest = this.#nextRequest >= 0xffffffff ? 1 : this.#nextRequest + 1;
      p = new Promise<WindowKeys>((resolve, reject) => this.#waiting.set(requestId, { token: hex, resolve, reject }));
      this.#inflight.set(hex, p);
      // The rejection is observed by whoever awaits it; keep an unawaited one from being reported.
      p.catch(() => undefined);
      this.#queued.push({ requestId, token: new Uint8Array(token) });
      this.#dispatch();
    }
    return p;
  }

  /** The BIND an answer is for, taken off the waiting list; undefined when none was sent. */
  #take(requestId: number): Waiting | undefined {
    const w = this.#waiting.get(requestId);
    if (!w || this.#queued.some((q) => q.requestId === requestId)) return undefined;
    this.#waiting.delete(requestId);
    this.#inflight.delete(w.token);
    this.#answered();
    return w;
  }

  /** BOUND arrived. Returns a protocol error to break the connection with, or undefined. */
  onBound(requestId: number, rkeys: readonly number[]): TensorwireError | undefined {
    const w = this.#take(requestId);
    if (!w) return new ConnectionBrokenError(`the holder answered BIND request ${requestId}, which is not pending`);
    if (rkeys.length !== this.#queuePairs) {
      const e = new ConnectionBrokenError(`the holder bound ${rkeys.length} windows for ${this.#queuePairs} queue pairs`);
      w.reject(e);
      return e;
    }
    const keys: WindowKeys = { rkeys: [...rkeys], revoked: false };
    this.#keys.set(w.token, keys);
    w.resolve(keys);
    return undefined;
  }

  /** REFUSE arrived. Returns a protocol error to break the connection with, or undefined. */
  onRefused(requestId: number, code: string, message: string): TensorwireError | undefined {
    const w = this.#take(requestId);
    if (!w) return new ConnectionBrokenError(`the holder refused BIND request ${requestId}, which is not pending`);
    w.reject(refusal(code, message));
    return undefined;
  }

  /** UNBIND arrived: the grant was revoked; transfers that still hold its keys must not post. */
  onUnbind(token: Uint8Array): void {
    const hex = tokenHex(token);
    const k = this.#keys.get(hex);
    if (k) {
      k.revoked = true;
      this.#keys.delete(hex);
    }
  }

  /** The connection is gone: every waiting BIND fails, and nothing is cached any more. */
  failAll(error: TensorwireError): void {
    this.#failed ??= error;
    for (const w of this.#waiting.values()) w.reject(error);
    this.#waiting.clear();
    this.#queued.length = 0;
    this.#inFlight = 0;
    this.#inflight.clear();
    for (const k of this.#keys.values()) k.revoked = true;
    this.#keys.clear();
  }
}
