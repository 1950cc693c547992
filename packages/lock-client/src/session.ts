/**
 * The requester's side of the `Session` stream: the service's unary calls to one holder as
 * messages of one long-lived bidirectional gRPC stream.
 *
 * A unary gRPC call is an HTTP/2 stream of its own (headers, data, trailers, a call object and
 * its deadline timer on both sides); on a loopback connection between two processes that is
 * most of what an acquire or a release costs. On an open stream a call is one message each
 * way. Everything else is the unary call's:
 *
 * - **Same answers.** Each message is answered with the status the unary call would have
 *   had, decoded into the same kind of `grpc.ServiceError` (with the retry-after trailer of an
 *   overloaded holder as metadata), so the caller maps errors, retries and abandons exactly
 *   as for a unary call.
 * - **Deadline.** The caller's remaining time travels with the message (the holder drops a
 *   call it gets to too late, as it drops a late unary call) and a timer here answers
 *   DEADLINE_EXCEEDED when it runs out; a late answer is then ignored.
 * - **Cancel** forgets the call: its answer, if any, is ignored. (A unary cancel reaches the
 *   holder; the callers here only cancel what they release by acquire id anyway.)
 * - **The stream ends** (holder gone, restarted, shut down, network, a message over the size
 *   limit): every call in flight on it fails UNAVAILABLE, as on a broken connection (each may
 *   or may not have been done; an acquire's possible grant is then released by acquire id),
 *   and the next call opens a new stream.
 * - **Old holders.** A holder without `Session` ends the stream UNIMPLEMENTED before reading a
 *   message; the calls in flight on it are then made unary (nothing was done with them), and so
 *   is every later call to that holder.
 * - **Idle.** With no call in flight for `idleMs` the stream is cancelled, so an idle client
 *   holds no open call (and no reference that keeps the process running).
 */
import * as grpc from '@grpc/grpc-js';
import type { LockCodec, MessageCodec } from './codec.js';
import type { LockMethod, SessionRequestMsg, SessionResponseMsg } from './proto.js';
import { RETRY_AFTER_METADATA_KEY } from './proto.js';

/** How a call ends: the unary callback's shape. */
export type SessionCallback = (error: grpc.ServiceError | null, response?: unknown) => void;

/**
 * What a session uses of its stream: a gRPC `Session` call, or a local lane (lane.ts). Events:
 * 'data' (an answer), 'status' (the end, with its code), 'error'.
 */
export interface SessionDuplex {
  write(m: SessionRequestMsg): unknown;
  cancel(): void;
  on(event: 'data', listener: (m: SessionResponseMsg) => void): unknown;
  on(event: 'status', listener: (s: { code: grpc.status; details: string }) => void): unknown;
  on(event: 'error', listener: (e: unknown) => void): unknown;
}
type Duplex = SessionDuplex;

const MAX_TIMER_MS = 0x7fffffff;

interface Entry {
  readonly method: LockMethod;
  readonly cb: SessionCallback;
  readonly fallback: () => void;
  timer: ReturnType<typeof setTimeout> | undefined;
}

/** One opened stream and the calls in flight on it. */
interface Conn {
  readonly stream: Duplex;
  readonly pending: Map<number, Entry>;
  ended: boolean;
  /** The stream is the holder's local lane (not a gRPC call). */
  readonly lane: boolean;
}

/** A `grpc.ServiceError` for a status (what grpc-js hands a unary callback). */
export function serviceError(code: grpc.status, details: string, metadata: grpc.Metadata = new grpc.Metadata()): grpc.ServiceError {
  return Object.assign(new Error(`${code} ${grpc.status[code] ?? 'UNKNOWN'}: ${details}`), { code, details, metadata });
}

const RESPONSE_CODEC: Record<LockMethod, keyof LockCodec> = {
  Acquire: 'AcquireResponse',
  Release: 'ReleaseResponse',
  Renew: 'RenewResponse',
  Health: 'HealthResponse',
  ReleaseMany: 'ReleaseManyResponse',
  RenewMany: 'RenewManyResponse',
};
const REQUEST_CODEC: Record<LockMethod, keyof LockCodec> = {
  Acquire: 'AcquireRequest',
  Release: 'ReleaseRequest',
  Renew: 'RenewRequest',
  Health: 'HealthRequest',
  ReleaseMany: 'ReleaseManyRequest',
  RenewMany: 'RenewManyRequest',
};

/** The codecs of one method's request and response. */
export function methodCodecs(codec: LockCodec, method: LockMethod): { request: MessageCodec<unknown>; response: MessageCodec<unknown> } {
  return { request: codec[REQUEST_CODEC[method]] as MessageCodec<unknown>, response: codec[RESPONSE_CODEC[method]] as MessageCodec<unknown> };
}

/** Whether `name` is one of the unary methods a Session message may stand for. */
export function isLockMethod(name: string): name is LockMethod {
  return Object.prototype.hasOwnProperty.call(REQUEST_CODEC, name);
}

/** What {@link LockClient.sessionStats} says of one holder's Session stream. */
export interface SessionStats {
  /** `open`: a stream is open; `idle`: none now (one opens on the next call); `unsupported`: the holder has no Session, calls are unary. */
  readonly state: 'open' | 'idle' | 'unsupported';
  /** Calls in flight on the open stream. */
  readonly inFlight: number;
  /** Streams opened so far (a new one after an idle end or a lost stream), local lanes included. */
  readonly opened: number;
  /** The open stream is the holder's local lane rather than a gRPC call. */
  readonly lane: boolean;
  /** Of `opened`, the local lanes. */
  readonly lanesOpened: number;
}

export class SessionStream {
  /** True once the holder answered UNIMPLEMENTED to `Session`: every call is unary from then on. */
  unsupported = false;
  readonly #open: () => Duplex;
  readonly #codec: LockCodec;
  readonly #idleMs: number;
  #conn: Conn | undefined;
  #nextId = 1;
  #idleTimer: ReturnType<typeof setTimeout> | undefined;
  #closed = false;
  #opened = 0;
  #lanesOpened = 0;
  /** Opens the holder's local lane, once one was found; dropped when a lane is lost. */
  #lane: (() => Duplex) | undefined;
  readonly #onLaneLost: () => void;

  /**
   * `open` starts a `Session` call (on the holder's channel, with the client's metadata).
   * `onLaneLost` hears that a local lane ended other than by this side (the calls go to gRPC
   * again until {@link useLane} is called anew).
   */
  constructor(open: () => Duplex, codec: LockCodec, idleMs: number, onLaneLost: () => void = () => undefined) {
    this.#open = open;
    this.#codec = codec;
    this.#idleMs = idleMs;
    this.#onLaneLost = onLaneLost;
  }

  stats(): SessionStats {
    return { state: this.unsupported ? 'unsupported' : this.#conn !== undefined ? 'open' : 'idle', inFlight: this.#conn?.pending.size ?? 0, opened: this.#opened, lane: this.#conn?.lane === true, lanesOpened: this.#lanesOpened };
  }

  /**
   * From now on, open the holder's local lane instead of a gRPC stream: at once when the open
   * gRPC stream has no call in flight (it is ended), else when it next has none.
   */
  useLane(open: () => Duplex): void {
    if (this.#closed) return;
    this.#lane = open;
  }

  /**
   * Send one call. `cb` gets its answer (once); `fallback` is run instead when the holder turns
   * out not to have `Session` (then nothing was done with the call: make it unary). Returns
   * the call's cancel.
   */
  call(method: LockMethod, request: unknown, timeoutMs: number, cb: SessionCallback, fallback: () => void): () => void {
    if (this.#closed) {
      cb(serviceError(grpc.status.CANCELLED, 'lock client closed'));
      return () => undefined;
    }
    let payload: Buffer;
    try {
      payload = methodCodecs(this.#codec, method).request.encode(request);
    } catch (e) {
      // What grpc-js answers for a unary request that does not serialize.
      cb(serviceError(grpc.status.INTERNAL, `Request message serialization failure: ${e instanceof Error ? e.message : String(e)}`));
      return () => undefined;
    }
    const conn = this.#connection();
    const id = this.#nextId++;
    const entry: Entry = { method, cb, fallback, timer: undefined };
    // A timer holds at most 2^31-1 ms (Node fires a longer one after 1 ms): beyond that the
    // call waits for its answer or the end of the stream.
    if (timeoutMs <= MAX_TIMER_MS) {
      entry.timer = setTimeout(() => {
        entry.timer = undefined;
        if (conn.pending.get(id) !== entry) return;
        conn.pending.delete(id);
        this.#idleCheck(conn);
        cb(serviceError(grpc.status.DEADLINE_EXCEEDED, 'Deadline exceeded'));
      }, timeoutMs);
      entry.timer.unref?.();
    }
    conn.pending.set(id, entry);
    const ms = Math.min(0xffffffff, Math.max(1, Math.ceil(timeoutMs)));
    conn.stream.write({ id, method, payload, timeoutMs: ms });
    return () => {
      if (conn.pending.get(id) !== entry) return;
      conn.pending.delete(id);
      if (entry.timer) clearTimeout(entry.timer);
      this.#idleCheck(conn);
    };
  }

  /** End the stream; calls in flight fail CANCELLED. Idempotent. */
  close(): void {
    this.#closed = true;
    this.#lane = undefined;
    if (this.#idleTimer) clearTimeout(this.#idleTimer);
    this.#idleTimer = undefined;
    const conn = this.#conn;
    if (conn === undefined) return;
    this.#conn = undefined;
    conn.stream.cancel();
    this.#fail(conn, grpc.status.CANCELLED, 'lock client closed');
  }

  #connection(): Conn {
    if (this.#idleTimer) clearTimeout(this.#idleTimer);
    this.#idleTimer = undefined;
    const current = this.#conn;
    if (current !== undefined) {
      if (current.lane || this.#lane === undefined || current.pending.size > 0) return current;
      // A lane was found and the gRPC stream is idle: end it, the lane takes over.
      this.#conn = undefined;
      current.ended = true;
      current.stream.cancel();
    }
    const lane = this.#lane !== undefined;
    const stream = lane ? (this.#lane as () => Duplex)() : this.#open();
    this.#opened++;
    if (lane) this.#lanesOpened++;
    const conn: Conn = { stream, pending: new Map(), ended: false, lane };
    this.#conn = conn;
    stream.on('data', (m: SessionResponseMsg) => this.#answer(conn, m));
    // The status ends the call, whatever it is ('error' comes with a failure status first).
    stream.on('status', (s: { code: grpc.status; details: string }) => this.#ended(conn, s.code, s.details));
    stream.on('error', (e: unknown) => {
      const code = typeof (e as { code?: unknown }).code === 'number' ? ((e as { code: number }).code as grpc.status) : grpc.status.UNAVAILABLE;
      this.#ended(conn, code, e instanceof Error ? e.message : String(e));
    });
    return conn;
  }

  #answer(conn: Conn, m: SessionResponseMsg): void {
    const entry = conn.pending.get(m.id);
    if (entry === undefined) return; // cancelled or timed out: the caller has moved on
    conn.pending.delete(m.id);
    if (entry.timer) clearTimeout(entry.timer);
    this.#idleCheck(conn);
    if (m.code !== grpc.status.OK) {
      const md = new grpc.Metadata();
      if (m.retryAfterMs !== undefined) md.set(RETRY_AFTER_METADATA_KEY, String(m.retryAfterMs));
      entry.cb(serviceError(m.code, m.details, md));
      return;
    }
    let res: unknown;
    try {
      res = methodCodecs(this.#codec, entry.method).response.decode(m.payload);
    } catch (e) {
      // What grpc-js answers for a unary response that does not parse.
      entry.cb(serviceError(grpc.status.INTERNAL, `Response message parsing error: ${e instanceof Error ? e.message : String(e)}`));
      return;
    }
    entry.cb(null, res);
  }

  #ended(conn: Conn, code: grpc.status, details: string): void {
    if (conn.ended) return;
    conn.ended = true;
    if (this.#conn === conn) this.#conn = undefined;
    if (conn.lane && !this.#closed) {
      // The lane is gone (the holder closed or restarted, or it broke the protocol): gRPC
      // again, and the client may look for a lane anew.
      this.#lane = undefined;
      this.#onLaneLost();
    }
    if (code === grpc.status.UNIMPLEMENTED && !conn.lane && !this.#closed) {
      // A holder without Session: it read nothing. Everything goes unary from now on.
      this.unsupported = true;
      const entries = [...conn.pending.values()];
      conn.pending.clear();
      for (const e of entries) {
        if (e.timer) clearTimeout(e.timer);
        e.fallback();
      }
      return;
    }
    // Whatever ended the stream (a too-large message, a reset, a shutdown), it was not these
    // calls' own answer: each may or may not have been done, as on a broken connection.
    this.#fail(conn, grpc.status.UNAVAILABLE, `session stream ended (${grpc.status[code] ?? code}): ${details || 'no details'}`);
  }

  #fail(conn: Conn, code: grpc.status, details: string): void {
    const entries = [...conn.pending.values()];
    conn.pending.clear();
    for (const e of entries) {
      if (e.timer) clearTimeout(e.timer);
      e.cb(serviceError(code, details));
    }
  }

  /** Nothing in flight on the open stream: end it after `idleMs` unless a call comes. */
  #idleCheck(conn: Conn): void {
    if (conn !== this.#conn || conn.pending.size > 0 || this.#idleTimer !== undefined) return;
    this.#idleTimer = setTimeout(() => {
      this.#idleTimer = undefined;
      // A call since then cleared this timer (#connection); a stream that ended meanwhile is gone.
      if (this.#conn !== conn) return;
      this.#conn = undefined;
      conn.ended = true;
      // Nothing is in flight: cancel rather than half-close, so the call ends here whatever the
      // holder does with a half-closed stream.
      conn.stream.cancel();
    }, this.#idleMs);
    this.#idleTimer.unref?.();
  }
}
