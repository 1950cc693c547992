/**
 * A kit connection: `streams` byte streams to one peer, grouped by a random connection id in
 * their HELLOs, owning everything per peer (invariant 2). Both sides may issue requests on every
 * stream, which is what makes simultaneous open a real case for the engine to settle: the
 * connection says who opened it ({@link KitConnection.initiator}), and the acceptor hands it to
 * the engine's `host.inbound`.
 *
 * Lifecycle:
 * - `execute` on a closing or closed connection, or a stream that said or got GOAWAY, rejects
 *   with SessionInvalidatedError; nothing is queued behind a retiring connection.
 * - `retire()` sends GOAWAY on every stream; each stream ends once both sides said GOAWAY and its
 *   own requests are answered, serving the peer's in-flight requests meanwhile. A peer's GOAWAY
 *   calls the `onRetire` listeners once and answers it the same way. A retirement that stops
 *   making progress for `retireTimeoutMs` is cut short with ConnectionBrokenError.
 * - `close(error)` destroys every socket first (nothing moves after), then fails every call in
 *   flight with `error` (default ClosedError). Idempotent; resolves once every socket closed.
 * - `onClose` listeners run exactly once, after every socket closed: with `undefined` after an
 *   orderly retirement, otherwise with the error that ended it (the one given to `close()`, or
 *   the ConnectionBrokenError of a failed stream). A listener added after that runs once, soon.
 * - Idle rule ({@link KitConnection.startIdleTimer}): a connection on which no byte moved in
 *   either direction for `idleTimeoutMs` and nothing is in flight (no request of this side
 *   awaiting its answer, nothing queued or unwritten, no WRITEV being received) is retired as
 *   if the peer had asked: the `onRetire` listeners run (the engine drops it from its table, so
 *   the next transfer dials afresh) and GOAWAY goes out on every stream. In-flight work resets
 *   the clock, so the idle rule never cuts it; a peer that has sent only part of a frame has
 *   nothing in flight.
 */
import { ClosedError, ConnectionBrokenError, InvalidInputError, SessionInvalidatedError, TimedOutError, type TensorwireError } from '../errors.js';
import type { ExecuteOptions, NodeIdentity, TransferBatch, TransportConnection } from '../transport.js';
import type { BatchLimits } from './batch.js';
import type { FramedStream, PeerEvent, PeerLedger, StreamOwner, StreamTuning } from './stream.js';

/** What a connection needs from its transport. */
export interface ConnectionHost {
  readonly name: string;
  readonly retireTimeoutMs: number;
  readonly tuning: StreamTuning;
  /** A connection with no traffic and nothing in flight for this long is retired. */
  readonly idleTimeoutMs: number;
  /** The peer's ledger (the transport keeps one per node id while connections to it exist). */
  ledgerFor(nodeId: string): PeerLedger;
  /** Log and count a bound or policy applied to a peer. */
  peerEvent(event: PeerEvent, peer: string | undefined, message: string): void;
  /** The connection is closed: drop it from the transport's tables (and release its ledger). */
  forget(connection: KitConnection): void;
}

export class KitConnection implements TransportConnection, StreamOwner {
  readonly transport: string;
  readonly peer: NodeIdentity;
  readonly initiator: string;
  readonly streams: number;
  /** The smaller of the two sides' chunk limits, agreed in the handshake. */
  maxChunkBytes: number;
  readonly ledger: PeerLedger;
  readonly #host: ConnectionHost;
  readonly #streams: FramedStream[] = [];
  readonly #doneStreams = new Set<FramedStream>();
  readonly #closeListeners: ((e: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  #state: 'open' | 'retiring' | 'closing' | 'closed' = 'open';
  #closeError: TensorwireError | undefined;
  #closed: Promise<void> | undefined;
  #retired: Promise<void> | undefined;
  #lastProgress = Date.now();
  #retireTimer: NodeJS.Timeout | undefined;
  #idleTimer: NodeJS.Timeout | undefined;
  /** Bytes written on all streams when the idle rule last looked, and when that changed. */
  #written = 0;
  #lastActivity = Date.now();
  #limits: BatchLimits | undefined;

  constructor(host: ConnectionHost, peer: NodeIdentity, initiator: string, streams: number, maxChunkBytes: number) {
    this.#host = host;
    this.transport = host.name;
    this.peer = peer;
    this.initiator = initiator;
    this.streams = streams;
    this.maxChunkBytes = maxChunkBytes;
    this.ledger = host.ledgerFor(peer.nodeId);
  }

  get isOpen(): boolean {
    return this.#state === 'open';
  }

  /** 'open', 'retiring', 'closing' or 'closed'. */
  get state(): 'open' | 'retiring' | 'closing' | 'closed' {
    return this.#state;
  }

  progress(): void {
    this.#lastProgress = Date.now();
  }

  /** Put a stream at its index (it must be attached to this connection). */
  addStream(stream: FramedStream, index: number): void {
    this.#streams[index] = stream;
    stream.attach(this);
  }

  /** The stream at `index`, if it arrived. */
  stream(index: number): FramedStream | undefined {
    return this.#streams[index];
  }

  get allStreams(): readonly FramedStream[] {
    return this.#streams;
  }

  execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    if (this.#state === 'closing' || this.#state === 'closed') {
      return Promise.reject(new SessionInvalidatedError(`connection to ${this.peer.nodeId} is closed`, { cause: this.#closeError }));
    }
    const s = this.#streams[stream];
    if (!s) return Promise.reject(new InvalidInputError(`stream ${stream} does not exist (connection has ${this.streams})`));
    if (options.deadline <= Date.now()) return Promise.reject(new TimedOutError('transfer timed out before it started'));
    const cap = this.maxChunkBytes;
    let limits = this.#limits;
    if (limits === undefined || limits.cap !== cap) {
      const t = this.#host.tuning;
      limits = this.#limits = { cap, frameTargetBytes: t.frameTargetBytes, zeroCopyMinBytes: t.zeroCopyMinBytes };
    }
    return s.run(batch, options, limits);
  }

  onClose(listener: (error: TensorwireError | undefined) => void): void {
    if (this.#state === 'closed') queueMicrotask(() => listener(this.#closeError));
    else this.#closeListeners.push(listener);
  }

  onRetire(listener: () => void): void {
    this.#retireListeners.push(listener);
  }

  peerRetiring(): void {
    if (this.#state !== 'open') return;
    this.#state = 'retiring';
    for (const l of this.#retireListeners.splice(0)) l();
    for (const s of this.#streams) s?.maybeEnd();
    this.#armRetireTimer();
  }

  retire(): Promise<void> {
    if (this.#retired) return this.#retired;
    if (this.#state === 'open') this.#state = 'retiring';
    for (const s of this.#streams) s?.sendGoaway();
    this.#armRetireTimer();
    this.#retired = Promise.all(this.#streams.map((s) => s?.closed)).then(() => undefined);
    return this.#retired;
  }

  /** Work in flight on any stream (see the idle rule above). */
  get busy(): boolean {
    return this.#streams.some((s) => s?.busy === true);
  }

  /** Start the idle rule (the transport does, once the connection is established). */
  startIdleTimer(): void {
    if (this.#idleTimer || this.#state !== 'open') return;
    this.#lastActivity = Date.now();
    this.#written = this.#bytesWritten();
    this.#armIdle(this.#host.idleTimeoutMs);
  }

  #bytesWritten(): number {
    let n = 0;
    for (const s of this.#streams) if (s) n += s.socket.bytesWritten;
    return n;
  }

  #armIdle(ms: number): void {
    this.#idleTimer = setTimeout(() => this.#checkIdle(), ms);
    this.#idleTimer.unref();
  }

  #checkIdle(): void {
    this.#idleTimer = undefined;
    if (this.#state !== 'open') return;
    const timeout = this.#host.idleTimeoutMs;
    const now = Date.now();
    const written = this.#bytesWritten();
    // Bytes sent, or work in flight, count as activity: the idle clock starts after them.
    if (written !== this.#written || this.busy) {
      this.#written = written;
      this.#lastActivity = now;
    }
    const idle = now - Math.max(this.#lastActivity, this.#lastProgress);
    if (idle < timeout) {
      this.#armIdle(timeout - idle);
      return;
    }
    this.#host.peerEvent('idle', this.peer.nodeId, `no traffic and nothing in flight for ${idle} ms (idleTimeoutMs ${timeout}); connection retired`);
    this.#state = 'retiring';
    for (const l of this.#retireListeners.splice(0)) l();
    void this.retire();
  }

  #armRetireTimer(): void {
    if (this.#retireTimer || this.#closed) return;
    const timeout = this.#host.retireTimeoutMs;
    const check = (): void => {
      // Only a retirement that has stopped making progress is cut short.
      const idle = Date.now() - this.#lastProgress;
      if (idle >= timeout) {
        void this.close(new ConnectionBrokenError('peer did not finish retiring the connection in time'));
        return;
      }
      this.#retireTimer = setTimeout(check, timeout - idle);
      this.#retireTimer.unref();
    };
    this.#retireTimer = setTimeout(check, timeout);
    this.#retireTimer.unref();
  }

  /** A stream failed or closed: the whole connection goes, unless it ended orderly after GOAWAY. */
  streamFailed(stream: FramedStream, error: TensorwireError, hadError: boolean): void {
    if (!hadError && stream.endedOrderly) {
      this.#doneStreams.add(stream);
      if (this.#streams.every((s) => s === undefined || this.#doneStreams.has(s))) void this.#finish(undefined);
      return;
    }
    void this.#finish(error);
  }

  close(error?: TensorwireError): Promise<void> {
    return this.#finish(error ?? new ClosedError(`connection to ${this.peer.nodeId} closed`));
  }

  #finish(error: TensorwireError | undefined): Promise<void> {
    if (this.#closed) return this.#closed;
    this.#state = 'closing';
    this.#closeError = error;
    if (this.#retireTimer) clearTimeout(this.#retireTimer);
    this.#retireTimer = undefined;
    if (this.#idleTimer) clearTimeout(this.#idleTimer);
    this.#idleTimer = undefined;
    for (const s of this.#streams) s?.socket.destroy();
    // Destroying the sockets stops all reads into and sends from user memory; only now fail requests.
    const failWith = error ?? new SessionInvalidatedError(`connection to ${this.peer.nodeId} was retired`);
    for (const s of this.#streams) s?.failAll(failWith);
    this.#closed = Promise.all(this.#streams.map((s) => s?.closed)).then(() => {
      this.#state = 'closed';
      this.#host.forget(this);
      for (const l of this.#closeListeners.splice(0)) l(error);
    });
    return this.#closed;
  }
}
