/**
 * The TCP transport: one-sided READ and WRITE against memory the other side registered,
 * over the length-prefixed protocol in frames.ts on `node:net`.
 *
 * - Every registration gets its own unguessable 128-bit grant token; revoking it makes
 *   further requests fail with `REVOKED`, and waits until no socket still references it.
 * - Outbound sockets receive with `onread`: the kernel copies READ_DATA straight into the
 *   destination registration, with no intermediate buffer. Payloads are sent from the
 *   registered memory itself (no copy). Inbound sockets copy once from Node's buffers.
 * - The responder pauses reading requests while its socket's send queue is full.
 * - A connection is `streams` sockets; the engine spreads chunks over them. Both sides can
 *   issue requests on every socket, which makes simultaneous open a real case the engine
 *   settles (see TransportHost.inbound).
 * - On abort or deadline, a chunk whose bytes the socket may still be writing into memory
 *   (or reading from memory) has its socket destroyed first: the promise settles only after
 *   nothing can touch the memory (invariant 6). Other chunks are simply forgotten and their
 *   late replies discarded.
 */
import { randomBytes } from 'node:crypto';
import net from 'node:net';
import { ByteReader, ByteWriter, toHex } from '../codec.js';
import { deferred, type Deferred } from '../deferred.js';
import {
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  SessionInvalidatedError,
  type TensorwireError,
  errorFromSignal,
  toTensorwireError,
} from '../errors.js';
import type { Logger } from '../logger.js';
import {
  TRANSPORT_SPECIFICATION_VERSION,
  type ConnectOptions,
  type ExecuteOptions,
  type Memory,
  type MemoryKind,
  type NodeIdentity,
  type TransferChunk,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
} from '../transport.js';
import {
  FrameParser,
  FrameType,
  TOKEN_BYTES,
  decodeError,
  decodeHello,
  decodeHelloAck,
  decodeReadReq,
  decodeWriteHead,
  encodeError,
  encodeHello,
  encodeHelloAck,
  encodeReadReq,
  encodeWriteHead,
  frameHeader,
  type FrameSink,
} from './frames.js';

export interface TcpTransportOptions {
  /** Address to listen on. Default 127.0.0.1. */
  host?: string;
  /** Port to listen on. Default 0 (any free port). */
  port?: number;
  /** Address peers should dial, when it differs from `host` (e.g. listening on 0.0.0.0). */
  advertiseHost?: string;
  /** Largest chunk accepted on the wire. Default 16 MiB. */
  maxChunkBytes?: number;
  /** Responder pauses reading requests while more than this many bytes wait to be sent. Default 8 MiB. */
  sendHighWaterMark?: number;
  /** A peer must finish its handshake within this. Default 10 s. */
  handshakeTimeoutMs?: number;
  /** How long a retiring connection may go without progress before it is closed abortively. Default 10 s. */
  retireTimeoutMs?: number;
  /** How long revoke() lets sockets still using a registration finish before closing them. Default 2 s. */
  revokeGraceMs?: number;
}

const ENDPOINT_MAGIC = [0x54, 0x57, 0x54, 0x01]; // TWT v1
const REVOKED_MEMORY = 4096;
/** Payloads with at least this much left are received straight into their destination. */
const DIRECT_MIN_BYTES = 64 * 1024;
/** Staging buffer for small frames on outbound sockets. */
const STAGING_BYTES = 64 * 1024;
/** How long a cancelled read may wait for the one read libuv can still do into its buffer. */
const CANCEL_GRACE_MS = 200;

/** The TCP endpoint blob: where to dial. */
export function encodeTcpEndpoint(host: string, port: number): Uint8Array {
  const w = new ByteWriter(32);
  for (const m of ENDPOINT_MAGIC) w.u8(m);
  return w.str8(host).u16(port).finish();
}

export function decodeTcpEndpoint(blob: Uint8Array): { host: string; port: number } {
  const r = new ByteReader(blob, 'tcp endpoint');
  for (const m of ENDPOINT_MAGIC) if (r.u8('magic') !== m) throw new InvalidInputError('not a tcp endpoint (bad magic or version)', { details: { field: 'magic' } });
  const host = r.str8('host');
  const port = r.u16('port');
  r.end();
  if (host.length === 0 || net.isIP(host) === 0 && !/^[A-Za-z0-9.-]{1,253}$/.test(host)) {
    throw new InvalidInputError(`tcp endpoint host ${JSON.stringify(host)} is not an address or host name`, { details: { field: 'host' } });
  }
  if (port === 0) throw new InvalidInputError('tcp endpoint port is 0', { details: { field: 'port' } });
  return { host, port };
}

/** A registration: the memory, its grant token, and which sockets still use it (and how often). */
class TcpGrant {
  readonly token: Uint8Array;
  readonly key: string;
  readonly buffer: Uint8Array;
  revoked = false;
  users = 0;
  readonly #byStream = new Map<TcpStream, number>();
  #idle: Deferred<void> | undefined;
  constructor(buffer: Uint8Array) {
    this.token = randomBytes(TOKEN_BYTES);
    this.key = toHex(this.token);
    this.buffer = buffer;
  }
  acquire(stream: TcpStream): void {
    this.users++;
    this.#byStream.set(stream, (this.#byStream.get(stream) ?? 0) + 1);
  }
  release(stream: TcpStream): void {
    this.users--;
    const n = (this.#byStream.get(stream) ?? 1) - 1;
    if (n <= 0) this.#byStream.delete(stream);
    else this.#byStream.set(stream, n);
    if (this.users === 0 && this.#idle) this.#idle.resolve();
  }
  /** Sockets that still read from or write into this memory. */
  get streams(): TcpStream[] {
    return [...this.#byStream.keys()];
  }
  idle(): Promise<void> {
    if (this.users === 0) return Promise.resolve();
    this.#idle ??= deferred<void>();
    return this.#idle.promise;
  }
}

interface RemoteGrant {
  readonly token: Uint8Array;
  readonly byteLength: number;
}

type PendingKind = 'read' | 'write';

/** One request this side issued and awaits. */
interface Pending {
  readonly id: number;
  readonly kind: PendingKind;
  readonly dest: Uint8Array | undefined; // read destination
  readonly source: Uint8Array | undefined; // write source
  grant: TcpGrant | undefined; // local grant pinned while the socket touches it
  flushed: boolean; // write: the payload left Node's buffers
  cancelled: boolean;
  cancelError?: TensorwireError; // the caller's abort/timeout, reported instead of the socket error
  readonly done: Deferred<void>;
}

/** One socket of a connection: a parser, the requests it issued, and the requests it serves. */
class TcpStream implements FrameSink {
  readonly socket: net.Socket;
  readonly parser: FrameParser;
  readonly #owner: TcpConnection;
  readonly #transport: TcpTransport;
  readonly #pending = new Map<number, Pending>();
  #nextId = 1;
  /** READ_REQs waiting while the send queue is above the high-water mark (about 40 bytes each). */
  readonly #serveQueue: { reqId: number; body: Uint8Array }[] = [];
  #sentGoaway = false;
  #receivedGoaway = false;
  #ended = false;
  readonly closed: Promise<void>;
  /** Set by the owning connection once the handshake is complete. */
  established = false;
  /** onread sockets: where small frames land (many per read); large payloads go direct. */
  readonly #staging: Buffer | undefined;
  /** The caller's memory libuv holds for the next read, when it holds any. */
  #handedDirect: Uint8Array | undefined;
  /** For handshakes: the next control frame goes here. */
  onHandshakeFrame: ((type: FrameType, body: Uint8Array) => void) | undefined;

  constructor(socket: net.Socket, parser: FrameParser | undefined, owner: TcpConnection, transport: TcpTransport, staging?: Buffer) {
    this.socket = socket;
    this.#staging = staging;
    this.#owner = owner;
    this.#transport = transport;
    this.parser = parser ?? new FrameParser(this, transport.maxChunkBytes);
    this.parser.sink = this;
    this.closed = new Promise((resolve) => socket.once('close', () => resolve()));
    socket.on('error', (e) => owner.streamFailed(this, new ConnectionBrokenError(`socket error: ${e.message}`, { cause: e }), true));
    socket.on('close', () => owner.streamFailed(this, new ConnectionBrokenError('the peer closed the connection'), false));
    // Backpressure without pausing the socket: pausing would also stop replies to our own
    // requests, and two peers reading from each other would deadlock. Requests queue instead.
    socket.on('drain', () => this.#serveQueued());
  }

  get pendingCount(): number {
    return this.#pending.size;
  }

  /** Feed from the parser in copy mode (inbound sockets). */
  attachCopyReader(): void {
    this.socket.on('data', (chunk: Buffer) => this.feed(chunk));
  }

  feed(chunk: Uint8Array): void {
    this.#owner.progress();
    try {
      this.parser.push(chunk);
    } catch (e) {
      this.#protocolError(e);
    }
  }

  /** onread: the buffer for the next read — the destination itself for a large payload, else staging. */
  nextReadBuffer(): Uint8Array {
    const direct = this.parser.directTarget(DIRECT_MIN_BYTES);
    this.#handedDirect = direct;
    return direct ?? (this.#staging as Buffer);
  }

  /** onread: `n` bytes arrived in the buffer `nextReadBuffer()` handed out. */
  onRead(n: number): void {
    this.#owner.progress();
    const direct = this.#handedDirect;
    this.#handedDirect = undefined;
    try {
      if (direct) this.parser.commit(n);
      else this.parser.push((this.#staging as Buffer).subarray(0, n));
    } catch (e) {
      this.#protocolError(e);
    }
    this.afterRead();
  }

  /** True when libuv holds (part of) `dest` as the buffer of its next read. */
  #holds(dest: Uint8Array | undefined): boolean {
    const h = this.#handedDirect;
    return h !== undefined && dest !== undefined && h.buffer === dest.buffer && h.byteOffset >= dest.byteOffset && h.byteOffset < dest.byteOffset + dest.byteLength;
  }

  #protocolError(e: unknown): void {
    const err = toTensorwireError(e, InvalidInputError);
    this.#owner.streamFailed(this, new ConnectionBrokenError(`protocol violation from peer: ${err.message}`, { cause: err }), true);
  }

  // --- FrameSink -----------------------------------------------------------------------

  onControl(type: FrameType, reqId: number, body: Uint8Array): void {
    if (this.onHandshakeFrame) {
      this.onHandshakeFrame(type, body);
      return;
    }
    if (!this.established) {
      this.#protocolError(new InvalidInputError(`frame type 0x${type.toString(16)} before the handshake finished`));
      return;
    }
    switch (type) {
      case FrameType.ReadReq:
        if (this.#serveQueue.length > 0 || this.#overHighWater()) this.#serveQueue.push({ reqId, body });
        else this.#serveRead(reqId, body);
        return;
      case FrameType.WriteAck: {
        const p = this.#pending.get(reqId);
        if (p && p.kind === 'write') this.#settle(p);
        return;
      }
      case FrameType.Error: {
        let info: { code: string; message: string };
        try {
          info = decodeError(body);
        } catch (e) {
          this.#protocolError(e);
          return;
        }
        const p = this.#pending.get(reqId);
        if (p) this.#settle(p, new RemoteRejectedError(`peer rejected the ${p.kind}: ${info.message}`, { details: { remoteCode: info.code } }));
        return;
      }
      case FrameType.Goaway:
        this.#receivedGoaway = true;
        this.#owner.peerRetiring();
        this.maybeEnd();
        return;
      default:
        this.#protocolError(new InvalidInputError(`unexpected frame type 0x${type.toString(16)}`));
    }
  }

  readTarget(reqId: number, length: number): Uint8Array | undefined {
    const p = this.#pending.get(reqId);
    if (!p || p.kind !== 'read' || p.cancelled || !p.dest) return undefined;
    if (p.dest.length !== length) {
      this.#protocolError(new InvalidInputError(`READ_DATA of ${length} bytes for a request of ${p.dest.length}`));
      return undefined;
    }
    return p.dest;
  }

  onDataDone(type: FrameType, reqId: number, discarded: boolean): void {
    if (type === FrameType.ReadData) {
      const p = this.#pending.get(reqId);
      if (p && !discarded) this.#settle(p);
      else if (p && p.cancelled) this.#forget(p);
      return;
    }
    // WRITE_REQ data fully received.
    const w = this.#incomingWrite;
    this.#incomingWrite = undefined;
    if (!w) return;
    if (w.grant) {
      w.grant.release(this);
      this.#send([frameHeader(FrameType.WriteAck, reqId, 0)]);
    } else {
      this.#send([encodeError(reqId, w.code, w.message)]);
    }
  }

  #incomingWrite: { grant: TcpGrant | undefined; code: string; message: string } | undefined;

  writeTarget(reqId: number, head: Uint8Array, length: number): Uint8Array | undefined {
    void reqId;
    if (!this.established || this.onHandshakeFrame) {
      this.#protocolError(new InvalidInputError('WRITE_REQ before the handshake finished'));
      return undefined;
    }
    let parsed: { token: Uint8Array; offset: number };
    try {
      parsed = decodeWriteHead(head);
    } catch (e) {
      this.#incomingWrite = { grant: undefined, code: 'BAD_REQUEST', message: e instanceof Error ? e.message : String(e) };
      return undefined;
    }
    const check = this.#transport.checkGrant(parsed.token, parsed.offset, length);
    if (typeof check === 'string') {
      this.#incomingWrite = { grant: undefined, code: check.split(':')[0] as string, message: check };
      return undefined;
    }
    check.acquire(this);
    this.#incomingWrite = { grant: check, code: '', message: '' };
    return check.buffer.subarray(parsed.offset, parsed.offset + length);
  }

  // --- serving -------------------------------------------------------------------------

  #serveRead(reqId: number, body: Uint8Array): void {
    let req: { token: Uint8Array; offset: number; length: number };
    try {
      req = decodeReadReq(body);
    } catch (e) {
      this.#send([encodeError(reqId, 'BAD_REQUEST', e instanceof Error ? e.message : String(e))]);
      return;
    }
    const check = this.#transport.checkGrant(req.token, req.offset, req.length);
    if (typeof check === 'string') {
      this.#send([encodeError(reqId, check.split(':')[0] as string, check)]);
      return;
    }
    check.acquire(this);
    const data = check.buffer.subarray(req.offset, req.offset + req.length);
    // The memory is referenced (not copied) by the socket until the write callback.
    this.#send([frameHeader(FrameType.ReadData, reqId, req.length), data], () => check.release(this));
  }

  #overHighWater(): boolean {
    return this.socket.writableLength > this.#transport.sendHighWaterMark;
  }

  #serveQueued(): void {
    while (this.#serveQueue.length > 0 && !this.#overHighWater() && !this.socket.destroyed) {
      const next = this.#serveQueue.shift() as { reqId: number; body: Uint8Array };
      this.#serveRead(next.reqId, next.body);
    }
    if (this.#serveQueue.length === 0) this.maybeEnd();
  }

  #send(parts: Uint8Array[], done?: () => void): void {
    const s = this.socket;
    if (s.destroyed || this.#ended) {
      done?.();
      return;
    }
    // Everything sent in one tick leaves in one writev: many small requests or replies cost
    // one syscall, not one each.
    if (!this.#corked) {
      this.#corked = true;
      s.cork();
      process.nextTick(() => {
        this.#corked = false;
        s.uncork();
      });
    }
    for (let i = 0; i < parts.length; i++) {
      const last = i === parts.length - 1;
      s.write(parts[i] as Uint8Array, last && done ? () => done() : undefined);
    }
  }

  #corked = false;

  // --- requesting ----------------------------------------------------------------------

  /** Issue every chunk; resolves when all settled; rejects with the first error after all settled. */
  async run(chunks: readonly TransferChunk[], options: ExecuteOptions): Promise<void> {
    if (this.#sentGoaway || this.#receivedGoaway || this.socket.destroyed) {
      throw new SessionInvalidatedError('connection is retiring or closed; no new requests accepted');
    }
    const pendings: Pending[] = [];
    const signal = options.signal;
    if (signal.aborted) throw errorFromSignal(signal, 'transfer');
    // Check everything before issuing anything: a batch never fails half-sent.
    for (const c of chunks) {
      const grant = c.local as TcpGrant;
      if (!(grant instanceof TcpGrant) || grant.revoked) throw new InvalidInputError('local registration is not a live tcp registration');
      if (c.localOffset + c.length > grant.buffer.length || c.length > this.#owner.maxChunkBytes) {
        throw new InvalidInputError(`chunk ${c.localOffset}+${c.length} does not fit the local registration or the connection's chunk limit`);
      }
    }
    for (const c of chunks) {
      const grant = c.local as TcpGrant;
      const remote = c.remote as RemoteGrant;
      const id = this.#allocId();
      if (c.op === 'read') {
        const dest = grant.buffer.subarray(c.localOffset, c.localOffset + c.length);
        grant.acquire(this);
        const p: Pending = { id, kind: 'read', dest, source: undefined, grant, flushed: true, cancelled: false, done: deferred<void>() };
        this.#pending.set(id, p);
        pendings.push(p);
        this.#send([encodeReadReq(id, remote.token, c.remoteOffset, c.length)]);
      } else {
        const source = grant.buffer.subarray(c.localOffset, c.localOffset + c.length);
        grant.acquire(this);
        const p: Pending = { id, kind: 'write', dest: undefined, source, grant, flushed: false, cancelled: false, done: deferred<void>() };
        this.#pending.set(id, p);
        pendings.push(p);
        this.#send([encodeWriteHead(id, remote.token, c.remoteOffset, c.length), source], () => this.#flushed(p));
      }
    }
    const onAbort = (): void => this.#cancel(pendings, errorFromSignal(signal, 'transfer'));
    signal.addEventListener('abort', onAbort, { once: true });
    try {
      const results = await Promise.allSettled(pendings.map((p) => p.done.promise));
      const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
      if (failed) throw failed.reason;
    } finally {
      signal.removeEventListener('abort', onAbort);
      this.maybeEnd();
    }
  }

  #allocId(): number {
    const id = this.#nextId;
    this.#nextId = this.#nextId >= 0xfffffff0 ? 1 : this.#nextId + 1;
    return id;
  }

  #flushed(p: Pending): void {
    p.flushed = true;
    if (p.grant && p.kind === 'write') {
      p.grant.release(this);
      p.grant = undefined;
    }
  }

  #settle(p: Pending, error?: TensorwireError): void {
    this.#pending.delete(p.id);
    if (p.kind === 'read' && p.grant) {
      p.grant.release(this);
      p.grant = undefined;
    }
    if (error) p.done.reject(error);
    else p.done.resolve();
  }

  /** A cancelled request whose late reply has now been discarded. */
  #forget(p: Pending): void {
    this.#pending.delete(p.id);
    this.maybeEnd();
  }

  /**
   * Cancel requests: quiesce first. If the socket may still touch one of their buffers (a
   * read being received into, a write not yet flushed), the socket is destroyed and the
   * requests settle when it has closed. Otherwise they settle now and late replies are
   * discarded by the parser.
   */
  #cancel(pendings: readonly Pending[], error: TensorwireError): void {
    const live = pendings.filter((p) => this.#pending.get(p.id) === p && !p.cancelled);
    if (live.length === 0) return;
    for (const p of live) p.cancelError = error;
    if (live.some((p) => p.kind === 'write' && !p.flushed)) {
      // The socket still holds payload that reads from the caller's memory: only destroying
      // it stops that. destroy() closes the fd synchronously (uv_close); nothing moves after.
      this.#owner.streamFailed(this, new ConnectionBrokenError(`stream closed to quiesce a cancelled write (${error.message})`), true);
      return;
    }
    const receiving = this.parser.receivingInto;
    const inFlight = receiving === undefined ? undefined : live.find((p) => p.kind === 'read' && p.dest === receiving);
    if (inFlight) this.parser.detachTarget(); // the rest of this frame is counted, not stored
    const held = inFlight !== undefined && this.#holds(inFlight.dest) ? inFlight : undefined;
    for (const p of live) {
      if (p === held) continue;
      this.#settleCancelled(p, error);
    }
    if (held) {
      const inFlight = held;
      // With onread, libuv was already handed this destination for its next read: one more
      // read may land there. Settle after that read, or, if the peer sends nothing more
      // within the grace period, destroy the socket to take the buffer back.
      this.#armed = inFlight;
      this.#armedTimer = setTimeout(() => {
        if (this.#armed === inFlight) {
          this.#armed = undefined;
          this.#owner.streamFailed(this, new ConnectionBrokenError(`stream closed to quiesce a cancelled read (${error.message})`), true);
        }
      }, CANCEL_GRACE_MS);
    }
  }

  #armed: Pending | undefined;
  #armedTimer: NodeJS.Timeout | undefined;

  /** revoke() gave up waiting for this socket to stop using a registration. */
  abortForRevoke(): void {
    this.#owner.streamFailed(this, new ConnectionBrokenError('a registration this connection was using was revoked and the transfer did not finish in time'), true);
  }

  /** Called after every read on an onread socket: the buffer libuv held has been used. */
  afterRead(): void {
    const p = this.#armed;
    if (!p) return;
    this.#armed = undefined;
    clearTimeout(this.#armedTimer);
    this.#settleCancelled(p, p.cancelError as TensorwireError);
  }

  #settleCancelled(p: Pending, error: TensorwireError): void {
    p.cancelled = true;
    if (p.kind === 'read' && p.grant) {
      p.grant.release(this);
      p.grant = undefined;
    }
    p.done.reject(error);
  }

  /** Fail every request (the socket is gone or going). Called after the socket is destroyed. */
  failAll(error: TensorwireError): void {
    if (this.#armedTimer) clearTimeout(this.#armedTimer);
    this.#armed = undefined;
    for (const p of [...this.#pending.values()]) {
      if (p.grant) {
        p.grant.release(this);
        p.grant = undefined;
      }
      this.#pending.delete(p.id);
      if (!p.cancelled) p.done.reject(p.cancelError ?? error);
    }
    const w = this.#incomingWrite;
    this.#incomingWrite = undefined;
    w?.grant?.release(this);
  }

  // --- retiring ------------------------------------------------------------------------

  sendGoaway(): void {
    if (this.#sentGoaway || this.socket.destroyed) return;
    this.#sentGoaway = true;
    this.#send([frameHeader(FrameType.Goaway, 0, 0)]);
    this.maybeEnd();
  }

  get retiring(): boolean {
    return this.#sentGoaway || this.#receivedGoaway;
  }

  /** Both sides said GOAWAY, every request is answered, and the peer ended the socket. */
  get endedOrderly(): boolean {
    return this.#sentGoaway && this.#receivedGoaway && this.#pending.size === 0 && this.socket.readableEnded;
  }

  /** End the socket once neither side will send another request and ours are all answered. */
  maybeEnd(): void {
    if (!this.#receivedGoaway || this.#ended) return;
    if (!this.#sentGoaway) {
      this.#sentGoaway = true;
      this.#send([frameHeader(FrameType.Goaway, 0, 0)]);
    }
    if (this.#pending.size > 0 || this.#serveQueue.length > 0) return;
    this.#ended = true;
    this.socket.end();
  }
}

/** A connection to one peer: `streams` sockets. It owns all per-peer state. */
export class TcpConnection implements TransportConnection {
  readonly transport = 'tcp';
  readonly peer: NodeIdentity;
  readonly initiator: string;
  readonly streams: number;
  /** The smaller of the two sides' chunk limits, agreed in the handshake. */
  maxChunkBytes: number;
  readonly #streams: TcpStream[] = [];
  #lastProgress = Date.now();
  readonly #closeListeners: ((e: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  readonly #owner: TcpTransport;
  #state: 'open' | 'retiring' | 'closing' | 'closed' = 'open';
  #closeError: TensorwireError | undefined;
  #closed: Promise<void> | undefined;
  #retired: Promise<void> | undefined;

  constructor(owner: TcpTransport, peer: NodeIdentity, initiator: string, streams: number, maxChunkBytes: number) {
    this.#owner = owner;
    this.peer = peer;
    this.initiator = initiator;
    this.streams = streams;
    this.maxChunkBytes = maxChunkBytes;
  }

  /** @internal bytes arrived: a retiring connection that still moves data is not stuck. */
  progress(): void {
    this.#lastProgress = Date.now();
  }

  get isOpen(): boolean {
    return this.#state === 'open';
  }

  /** @internal */
  addStream(stream: TcpStream, index: number): void {
    this.#streams[index] = stream;
  }

  /** @internal */
  get allStreams(): readonly TcpStream[] {
    return this.#streams;
  }

  execute(stream: number, chunks: readonly TransferChunk[], options: ExecuteOptions): Promise<void> {
    if (this.#state === 'closing' || this.#state === 'closed') {
      return Promise.reject(new SessionInvalidatedError(`connection to ${this.peer.nodeId} is closed`, { cause: this.#closeError }));
    }
    const s = this.#streams[stream];
    if (!s) return Promise.reject(new InvalidInputError(`stream ${stream} does not exist (connection has ${this.streams})`));
    return s.run(chunks, options);
  }

  onClose(listener: (error: TensorwireError | undefined) => void): void {
    if (this.#state === 'closed') queueMicrotask(() => listener(this.#closeError));
    else this.#closeListeners.push(listener);
  }

  onRetire(listener: () => void): void {
    this.#retireListeners.push(listener);
  }

  /** @internal a stream got GOAWAY */
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

  #retireTimer: NodeJS.Timeout | undefined;
  #armRetireTimer(): void {
    if (this.#retireTimer) return;
    const check = (): void => {
      // Only a retirement that has stopped making progress is cut short.
      const idle = Date.now() - this.#lastProgress;
      if (idle >= this.#owner.retireTimeoutMs) {
        void this.close(new ConnectionBrokenError('peer did not finish retiring the connection in time'));
        return;
      }
      this.#retireTimer = setTimeout(check, this.#owner.retireTimeoutMs - idle);
      this.#retireTimer.unref();
    };
    this.#retireTimer = setTimeout(check, this.#owner.retireTimeoutMs);
    this.#retireTimer.unref();
  }

  readonly #doneStreams = new Set<TcpStream>();

  /** @internal a socket failed or closed: the whole connection goes, unless it ended orderly after GOAWAY. */
  streamFailed(stream: TcpStream, error: TensorwireError, hadError: boolean): void {
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
    for (const s of this.#streams) s?.socket.destroy();
    // Destroying the socket stops all reads into and sends from user memory; only now fail requests.
    const failWith = error ?? new SessionInvalidatedError(`connection to ${this.peer.nodeId} was retired`);
    for (const s of this.#streams) s?.failAll(failWith);
    this.#closed = Promise.all(this.#streams.map((s) => s?.closed)).then(() => {
      this.#state = 'closed';
      this.#owner.forget(this);
      for (const l of this.#closeListeners.splice(0)) l(error);
    });
    return this.#closed;
  }
}

export class TcpTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name = 'tcp';
  readonly capabilities: TransportCapabilities;
  readonly maxChunkBytes: number;
  readonly retireTimeoutMs: number;
  readonly sendHighWaterMark: number;
  readonly revokeGraceMs: number;
  readonly #options: Required<Omit<TcpTransportOptions, 'advertiseHost'>> & { advertiseHost: string | undefined };
  readonly #grants = new Map<string, TcpGrant>();
  readonly #revokedKeys = new Set<string>();
  readonly #connections = new Set<TcpConnection>();
  readonly #pendingInbound = new Map<string, { conn: TcpConnection; arrived: number; timer: NodeJS.Timeout }>();
  readonly #sockets = new Set<net.Socket>();
  #server: net.Server | undefined;
  #host: TransportHost | undefined;
  #logger: Logger | undefined;
  #endpoint: Uint8Array | undefined;
  #closed: Promise<void> | undefined;

  constructor(options: TcpTransportOptions = {}) {
    const maxChunkBytes = options.maxChunkBytes ?? 16 * 1024 * 1024;
    if (!Number.isSafeInteger(maxChunkBytes) || maxChunkBytes < 1 || maxChunkBytes > 0x7fffffff) {
      throw new InvalidInputError(`maxChunkBytes must be 1..2^31-1, got ${maxChunkBytes}`, { details: { field: 'maxChunkBytes' } });
    }
    const port = options.port ?? 0;
    if (!Number.isInteger(port) || port < 0 || port > 65535) throw new InvalidInputError(`port ${port} is out of range`, { details: { field: 'port' } });
    this.#options = {
      host: options.host ?? '127.0.0.1',
      port,
      advertiseHost: options.advertiseHost,
      maxChunkBytes,
      sendHighWaterMark: options.sendHighWaterMark ?? 8 * 1024 * 1024,
      handshakeTimeoutMs: options.handshakeTimeoutMs ?? 10_000,
      retireTimeoutMs: options.retireTimeoutMs ?? 10_000,
      revokeGraceMs: options.revokeGraceMs ?? 2_000,
    };
    for (const f of ['sendHighWaterMark', 'handshakeTimeoutMs', 'retireTimeoutMs', 'revokeGraceMs'] as const) {
      const v = this.#options[f];
      if (!Number.isSafeInteger(v) || v < 1 || v > 0x7fffffff) throw new InvalidInputError(`${f} must be an integer from 1 to 2^31-1, got ${v}`, { details: { field: f } });
    }
    this.maxChunkBytes = maxChunkBytes;
    this.retireTimeoutMs = this.#options.retireTimeoutMs;
    this.sendHighWaterMark = this.#options.sendHighWaterMark;
    this.revokeGraceMs = this.#options.revokeGraceMs;
    this.capabilities = Object.freeze({
      local: true,
      remote: true,
      memoryKinds: Object.freeze(['host'] as MemoryKind[]),
      oneSidedRead: true,
      oneSidedWrite: true,
      cpuBypass: false,
      scopedGrants: true,
      rank: 10,
      maxStreams: 64,
      maxChunkBytes,
    });
  }

  /** Open sockets (for leak tests and diagnostics). */
  get socketCount(): number {
    return this.#sockets.size;
  }

  get connectionCount(): number {
    return this.#connections.size;
  }

  get grantCount(): number {
    return this.#grants.size;
  }

  async start(host: TransportHost): Promise<void> {
    if (this.#closed) throw new ClosedError('tcp transport is closed');
    if (this.#server) throw new InvalidInputError('tcp transport already started');
    this.#host = host;
    this.#logger = host.logger;
    const server = net.createServer({ noDelay: true, keepAlive: true, keepAliveInitialDelay: 10_000 }, (socket) => this.#accept(socket));
    this.#server = server;
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen({ host: this.#options.host, port: this.#options.port }, () => {
        server.off('error', reject);
        resolve();
      });
    }).catch((e: unknown) => {
      this.#server = undefined;
      const err = e as NodeJS.ErrnoException;
      throw new InvalidInputError(`tcp transport cannot listen on ${this.#options.host}:${this.#options.port}: ${err.code ?? err.message}`, { cause: e });
    });
    server.on('error', (e) => this.#logger?.error('tcp listener error', { error: e.message }));
    const addr = server.address() as net.AddressInfo;
    const advertise = this.#options.advertiseHost ?? (addr.address === '0.0.0.0' || addr.address === '::' ? '127.0.0.1' : addr.address);
    this.#endpoint = encodeTcpEndpoint(advertise, addr.port);
  }

  /** The port actually listened on. */
  get port(): number {
    return this.#endpoint ? decodeTcpEndpoint(this.#endpoint).port : 0;
  }

  endpoint(): Uint8Array {
    if (!this.#endpoint) throw new ClosedError('tcp transport not started');
    return this.#endpoint;
  }

  unreachableReason(_peer: NodeIdentity, endpoint: Uint8Array): string | undefined {
    try {
      decodeTcpEndpoint(endpoint);
      return undefined;
    } catch (e) {
      return e instanceof Error ? e.message : String(e);
    }
  }

  async register(memory: Memory): Promise<TransportRegistration> {
    if (this.#closed) throw new ClosedError('tcp transport is closed');
    if (memory.kind !== 'host') throw new InvalidInputError(`tcp moves host memory only, not ${memory.kind}`, { details: { field: 'memory.kind' } });
    const grant = new TcpGrant(memory.buffer);
    this.#grants.set(grant.key, grant);
    return { handle: grant, payload: grant.token.slice() };
  }

  async revoke(handle: object): Promise<void> {
    if (!(handle instanceof TcpGrant)) throw new InvalidInputError('not a tcp registration handle');
    const wasLive = !handle.revoked;
    if (!handle.revoked) {
      handle.revoked = true;
      this.#grants.delete(handle.key);
      this.#revokedKeys.add(handle.key);
      if (this.#revokedKeys.size > REVOKED_MEMORY) {
        const oldest = this.#revokedKeys.values().next().value as string;
        this.#revokedKeys.delete(oldest);
      }
    }
    if (!wasLive || handle.users === 0) return handle.idle();
    // Let sends and receives in progress finish; a peer that stalls them (stops reading, or
    // stops mid-payload) must not hold the memory forever: its sockets are closed.
    const timer = setTimeout(() => {
      for (const stream of handle.streams) stream.abortForRevoke();
    }, this.revokeGraceMs);
    try {
      await handle.idle();
    } finally {
      clearTimeout(timer);
    }
  }

  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number): unknown {
    if (memoryKind !== 'host') throw new InvalidInputError(`tcp cannot reach ${memoryKind} memory`, { details: { field: 'memoryKind' } });
    if (!(payload instanceof Uint8Array) || payload.length !== TOKEN_BYTES) {
      throw new InvalidInputError(`tcp descriptor payload must be ${TOKEN_BYTES} bytes, got ${payload?.length}`, { details: { field: 'payload' } });
    }
    const grant: RemoteGrant = { token: payload.slice(), byteLength };
    return grant;
  }

  /** @internal responder-side check: the grant or `CODE: message`. */
  checkGrant(token: Uint8Array, offset: number, length: number): TcpGrant | string {
    const key = toHex(token);
    const g = this.#grants.get(key);
    if (!g) {
      return this.#revokedKeys.has(key) ? 'REVOKED: the grant was revoked' : 'UNKNOWN_GRANT: no registration has this token';
    }
    if (g.revoked) return 'REVOKED: the grant was revoked';
    if (length === 0 || length > this.maxChunkBytes) return `BAD_REQUEST: length ${length} is out of range`;
    if (offset + length > g.buffer.byteLength) {
      return `OUT_OF_BOUNDS: range ${offset}+${length} exceeds the registration of ${g.buffer.byteLength} bytes`;
    }
    return g;
  }

  /** @internal */
  forget(conn: TcpConnection): void {
    this.#connections.delete(conn);
  }

  #track(socket: net.Socket): void {
    this.#sockets.add(socket);
    socket.once('close', () => this.#sockets.delete(socket));
  }

  async connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    if (this.#closed || !this.#host) throw new ClosedError('tcp transport is closed or not started');
    const host = this.#host;
    const { host: addr, port } = decodeTcpEndpoint(endpoint);
    const streams = Math.max(1, Math.min(options.streams, this.capabilities.maxStreams));
    const connectionId = randomBytes(16);
    const conn = new TcpConnection(this, peer, host.identity.nodeId, streams, this.maxChunkBytes);
    const signal = options.signal;
    if (signal.aborted) throw errorFromSignal(signal, `connect to ${peer.nodeId}`);
    const opened: TcpStream[] = [];
    const onAbort = (): void => {
      for (const s of opened) s.socket.destroy();
    };
    signal.addEventListener('abort', onAbort, { once: true });
    try {
      await Promise.all(
        Array.from({ length: streams }, async (_, index) => {
          const stream = await this.#dial(conn, addr, port, opened);
          conn.addStream(stream, index);
          const ack = await this.#handshake(stream, {
            connectionId,
            streamIndex: index,
            streamCount: streams,
            nodeId: host.identity.nodeId,
            incarnation: host.identity.incarnation,
            hostId: host.identity.hostId,
            expectedNodeId: peer.nodeId,
            expectedIncarnation: peer.incarnation,
            maxChunkBytes: this.maxChunkBytes,
          }, signal);
          conn.maxChunkBytes = Math.min(conn.maxChunkBytes, ack.maxChunkBytes);
          if (ack.nodeId !== peer.nodeId || ack.incarnation !== peer.incarnation) {
            throw new ConnectionBrokenError(
              `${addr}:${port} is ${ack.nodeId} incarnation ${ack.incarnation}, expected ${peer.nodeId} incarnation ${peer.incarnation}`,
            );
          }
        }),
      );
    } catch (e) {
      for (const s of opened) s.socket.destroy();
      await Promise.all(opened.map((s) => s.closed));
      if (signal.aborted) throw errorFromSignal(signal, `connect to ${peer.nodeId}`);
      throw toTensorwireError(e);
    } finally {
      signal.removeEventListener('abort', onAbort);
    }
    for (const s of conn.allStreams) s.established = true;
    this.#connections.add(conn);
    if (this.#closed) {
      await conn.close(new ClosedError('tcp transport closed'));
      throw new ClosedError('tcp transport closed');
    }
    return conn;
  }

  #dial(conn: TcpConnection, host: string, port: number, opened: TcpStream[]): Promise<TcpStream> {
    return new Promise<TcpStream>((resolve, reject) => {
      const ref: { stream?: TcpStream } = {};
      // The parser exists before the socket: Node asks for the first receive buffer inside net.connect().
      const parser = new FrameParser(undefined, this.maxChunkBytes);
      const staging = Buffer.allocUnsafe(STAGING_BYTES);
      const socket = net.connect({
        host,
        port,
        noDelay: true,
        keepAlive: true,
        keepAliveInitialDelay: 10_000,
        onread: {
          // Receive straight into whatever the parser needs next (for READ_DATA: the destination).
          buffer: () => ref.stream?.nextReadBuffer() ?? staging,
          callback: (n: number) => {
            ref.stream?.onRead(n);
            return true;
          },
        },
      });
      this.#track(socket);
      const stream = new TcpStream(socket, parser, conn, this, staging);
      ref.stream = stream;
      opened.push(stream);
      const onError = (e: Error): void => reject(new ConnectionBrokenError(`cannot connect to ${host}:${port}: ${(e as NodeJS.ErrnoException).code ?? e.message}`, { cause: e }));
      // A socket destroyed while still connecting (abort, deadline) emits no 'error': settle on 'close' too.
      const onClose = (): void => reject(new ConnectionBrokenError(`connection to ${host}:${port} closed before it was established`));
      socket.once('error', onError);
      socket.once('close', onClose);
      socket.once('connect', () => {
        socket.off('error', onError);
        socket.off('close', onClose);
        resolve(stream);
      });
    });
  }

  #handshake(stream: TcpStream, hello: Parameters<typeof encodeHello>[0], signal: AbortSignal): Promise<ReturnType<typeof decodeHelloAck>> {
    return new Promise((resolve, reject) => {
      const fail = (e: TensorwireError): void => {
        cleanup();
        reject(e);
      };
      const onClose = (): void => fail(new ConnectionBrokenError('the peer closed the connection during the handshake'));
      const onAbort = (): void => fail(errorFromSignal(signal, 'handshake'));
      const cleanup = (): void => {
        stream.onHandshakeFrame = undefined;
        stream.socket.off('close', onClose);
        signal.removeEventListener('abort', onAbort);
      };
      stream.socket.once('close', onClose);
      signal.addEventListener('abort', onAbort, { once: true });
      stream.onHandshakeFrame = (type, body) => {
        try {
          if (type === FrameType.HelloAck) {
            const ack = decodeHelloAck(body);
            cleanup();
            // Frames may follow the ACK in the same tick (e.g. a GOAWAY when the peer settled a
            // simultaneous open the other way): the stream is live from here on.
            stream.established = true;
            resolve(ack);
          } else if (type === FrameType.Error) {
            const info = decodeError(body);
            fail(new RemoteRejectedError(`peer refused the connection: ${info.message}`, { details: { remoteCode: info.code } }));
          } else {
            fail(new ConnectionBrokenError(`unexpected frame 0x${type.toString(16)} during the handshake`));
          }
        } catch (e) {
          fail(toTensorwireError(e, ConnectionBrokenError));
        }
      };
      stream.socket.write(encodeHello(hello));
    });
  }

  #accept(socket: net.Socket): void {
    this.#track(socket);
    if (this.#closed || !this.#host) {
      socket.destroy();
      return;
    }
    const host = this.#host;
    // A placeholder connection until HELLO tells us which one this socket belongs to.
    const timer = setTimeout(() => socket.destroy(), this.#options.handshakeTimeoutMs);
    timer.unref();
    const provisional = new TcpConnection(this, { nodeId: 'unknown', incarnation: 'unknown', hostId: 'unknown' }, 'unknown', 1, this.maxChunkBytes);
    const stream = new TcpStream(socket, undefined, provisional, this);
    provisional.addStream(stream, 0); // so a protocol error before HELLO closes this socket
    const refuse = (code: string, message: string): void => {
      this.#logger?.warn('tcp handshake refused', { code, message, remote: socket.remoteAddress });
      clearTimeout(timer);
      socket.end(encodeError(0, code, message));
      setTimeout(() => socket.destroy(), 1000).unref();
    };
    stream.onHandshakeFrame = (type, body) => {
      if (type !== FrameType.Hello) {
        refuse('BAD_HANDSHAKE', `expected HELLO, got frame 0x${type.toString(16)}`);
        return;
      }
      let hello: ReturnType<typeof decodeHello>;
      try {
        hello = decodeHello(body);
      } catch (e) {
        refuse('BAD_HANDSHAKE', e instanceof Error ? e.message : String(e));
        return;
      }
      const me = host.identity;
      if (hello.expectedNodeId !== me.nodeId || hello.expectedIncarnation !== me.incarnation) {
        refuse('WRONG_PEER', `this is ${me.nodeId} incarnation ${me.incarnation}, not ${hello.expectedNodeId} incarnation ${hello.expectedIncarnation}`);
        return;
      }
      if (hello.streamCount > this.capabilities.maxStreams) {
        refuse('BAD_HANDSHAKE', `stream count ${hello.streamCount} exceeds ${this.capabilities.maxStreams}`);
        return;
      }
      clearTimeout(timer);
      const key = toHex(hello.connectionId);
      let group = this.#pendingInbound.get(key);
      if (!group) {
        const peer: NodeIdentity = { nodeId: hello.nodeId, incarnation: hello.incarnation, hostId: hello.hostId };
        const conn = new TcpConnection(this, peer, hello.nodeId, hello.streamCount, Math.min(this.maxChunkBytes, hello.maxChunkBytes));
        const gtimer = setTimeout(() => {
          this.#pendingInbound.delete(key);
          void conn.close(new ConnectionBrokenError('peer did not open all streams of its connection in time'));
        }, this.#options.handshakeTimeoutMs);
        gtimer.unref();
        group = { conn, arrived: 0, timer: gtimer };
        this.#pendingInbound.set(key, group);
      }
      const conn = group.conn;
      if (hello.streamCount !== conn.streams || conn.allStreams[hello.streamIndex] !== undefined || hello.nodeId !== conn.peer.nodeId) {
        refuse('BAD_HANDSHAKE', 'stream does not match its connection');
        return;
      }
      // Re-home the socket onto the real connection.
      socket.removeAllListeners('data');
      socket.removeAllListeners('error');
      socket.removeAllListeners('close');
      socket.removeAllListeners('drain');
      socket.once('close', () => this.#sockets.delete(socket));
      // The same parser carries on: bytes that followed HELLO in this chunk go to the real stream.
      const real = new TcpStream(socket, stream.parser, conn, this);
      real.established = true;
      real.attachCopyReader();
      conn.addStream(real, hello.streamIndex);
      socket.write(encodeHelloAck(me.nodeId, me.incarnation, me.hostId, this.maxChunkBytes));
      group.arrived++;
      if (group.arrived === conn.streams) {
        clearTimeout(group.timer);
        this.#pendingInbound.delete(key);
        this.#connections.add(conn);
        host.inbound(conn);
      }
    };
    stream.attachCopyReader();
  }

  close(): Promise<void> {
    this.#closed ??= this.#close();
    return this.#closed;
  }

  async #close(): Promise<void> {
    const server = this.#server;
    for (const g of this.#pendingInbound.values()) clearTimeout(g.timer);
    const conns = [...this.#connections, ...[...this.#pendingInbound.values()].map((g) => g.conn)];
    this.#pendingInbound.clear();
    await Promise.allSettled(conns.map((c) => c.close(new ClosedError('tcp transport closed'))));
    for (const s of this.#sockets) s.destroy();
    if (server) await new Promise<void>((resolve) => server.close(() => resolve()));
    for (const g of this.#grants.values()) g.revoked = true;
    this.#grants.clear();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
