/**
 * One byte stream of a kit connection (a `net.Socket`: TCP, a Unix domain socket, a pipe): a
 * frame parser, the requests this side issued, the requests it serves, and GOAWAY.
 *
 * Requesting: a stream batch becomes the frames of its {@link BatchPlan} (cached per batch
 * object), one pending entry per frame, one promise per `run()` call settled by counting frames.
 * Receiving: a frame's destinations that follow each other in one local buffer are one entry of
 * its receive list (batch.ts). On sockets opened with `onread` ({@link FramedStream.nextReadBuffer}),
 * an entry with at least `directMinBytes` still to come is handed to libuv itself; small ones are
 * read many at a time into a staging buffer and copied out (a staged read stops where a large
 * range starts). Other sockets copy once from Node's buffers straight into each entry. The
 * parser walks the receive list (a typed table) by index: no object per range.
 *
 * Serving: every range of a frame is checked against the grant table before any byte is sent or
 * accepted; a READV is answered with one READV_DATA (ranges under `zeroCopyMinBytes` coalesced
 * into one send buffer, larger ones handed to the socket from the registered memory itself,
 * pinned until written) or one ERROR naming the failing range; a WRITEV's data is scattered
 * straight into the granted memory, or skipped when the head was refused. Requests queue while
 * the send queue is above the high-water mark, bounded per stream; a peer past the bound is
 * disconnected with a logged reason. The socket is never paused: pausing would also stop replies
 * to this side's own requests, and two peers reading from each other would deadlock.
 *
 * Quiescing: on abort or deadline, a call whose bytes the socket may still be writing from
 * memory has its stream destroyed first; a read libuv may still receive into settles after that
 * read, or its stream is destroyed after a short grace. A call settles only once nothing can
 * touch its memory (invariant 6); late replies to the rest are discarded.
 *
 * Everything sent in one tick is corked and leaves in one writev.
 */
import type net from 'node:net';
import { deferred, type Deferred } from '../deferred.js';
import {
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  SessionInvalidatedError,
  type TensorwireError,
  errorFromSignal,
  toTensorwireError,
} from '../errors.js';
import type { Logger } from '../logger.js';
import { RANGE_STRIDE, RangeField, type ExecuteOptions, type NodeIdentity, type TransferBatch } from '../transport.js';
import { planFor, type BatchLimits, type BatchPlan, type FramePlan } from './batch.js';
import {
  FrameParser,
  FrameType,
  HEADER_BYTES,
  NO_RANGE,
  RANGE_ENTRY_BYTES,
  decodeError,
  encodeError,
  encodeGoaway,
  frameHeader,
  headRangeAt,
  headRangeCount,
  headTokenCount,
  patchRequestId,
  putHeader,
  rangeGrantIndex,
  rangeLength,
  rangeOffset,
  rangeTokenIndex,
  type FrameSink,
  type ScatterList,
} from './frames.js';
import { grantedBuffer, grantedOffset, type GrantEntry, type GrantTable, type GrantUser, type RangeRefusal } from './grants.js';

/** Sizes that decide how bytes move. The defaults are the TCP transport's, measured on loopback. */
export interface StreamTuning {
  /** Destination ranges with at least this much still to come are received straight into their memory. Default 64 KiB. */
  readonly directMinBytes: number;
  /**
   * Reply and WRITEV data ranges of at least this size are handed to the socket as they are (the
   * kernel copies them once, straight from the registered memory); smaller ones are coalesced
   * into one send buffer. Default 1 KiB.
   */
  readonly zeroCopyMinBytes: number;
  /** A stream batch is cut into frames of at most this much data. Default 1 MiB. */
  readonly frameTargetBytes: number;
  /** Staging buffer for small ranges and control frames on `onread` sockets. Default 64 KiB. */
  readonly stagingBytes: number;
  /** How long a cancelled read may wait for the one read libuv can still do into its buffer. Default 200 ms. */
  readonly cancelGraceMs: number;
}

export const DEFAULT_TUNING: StreamTuning = Object.freeze({
  directMinBytes: 64 * 1024,
  zeroCopyMinBytes: 1024,
  frameTargetBytes: 1024 * 1024,
  stagingBytes: 64 * 1024,
  cancelGraceMs: 200,
});

/**
 * Bookkeeping counted per queued request (or queued reply), on top of its bytes: the entry, the
 * copied head's Buffer object and its slot, measured at about 190 bytes for a 44-byte head.
 */
export const QUEUED_REQUEST_OVERHEAD = 160;
/** Bookkeeping counted per buffer a reply hands to the socket (Node's write queue entry, the view). */
export const SEND_PART_OVERHEAD = 160;

/** Why the kit refused, cut or retired a peer's connection (the `event` label of `tensorwire_transport_peer_events_total`). */
export type PeerEvent =
  | 'request_queue'
  | 'protocol_violation'
  | 'connections'
  | 'peer_connections'
  | 'pending_handshakes'
  | 'handshake_timeout'
  | 'idle';

/**
 * What one peer (a node id) holds in this transport's responder, summed over every stream of
 * every connection with it, in either direction: requests and replies waiting in the serve
 * queues, and the bytes allocated for its replies that the sockets have not written yet. The
 * bounds ({@link StreamContext.maxQueuedRequests}, `maxQueuedRequestBytes`, `sendHighWaterMark`)
 * apply to these sums, so a peer cannot multiply them by opening more streams or connections.
 */
export class PeerLedger {
  readonly nodeId: string;
  /** Requests and replies waiting in this peer's serve queues. */
  queuedRequests = 0;
  /** Their bytes, bookkeeping included ({@link QUEUED_REQUEST_OVERHEAD} each). */
  queuedBytes = 0;
  /** Bytes copied or allocated for this peer's replies and not yet written, bookkeeping included. */
  sendBytes = 0;
  /** Inbound connections from this peer, established or still in their handshakes. */
  inbound = 0;
  /** Connections (either direction) that use this ledger. */
  refs = 0;
  readonly #sendLimit: number;
  /** Streams whose queue is waiting for `sendBytes` to fall under the limit. */
  readonly #waiting = new Set<FramedStream>();

  constructor(nodeId: string, sendLimit: number) {
    this.nodeId = nodeId;
    this.#sendLimit = sendLimit;
  }

  get sendHeld(): boolean {
    return this.sendBytes > this.#sendLimit;
  }

  charge(n: number): void {
    this.sendBytes += n;
  }

  /** Written (or dropped): once under the limit again, the streams waiting on it serve their queues. */
  release(n: number): void {
    const held = this.sendHeld;
    this.sendBytes -= n;
    if (held && !this.sendHeld && this.#waiting.size > 0) for (const s of [...this.#waiting]) s.serveQueued();
  }

  wait(stream: FramedStream): void {
    this.#waiting.add(stream);
  }

  unwait(stream: FramedStream): void {
    this.#waiting.delete(stream);
  }

  /** Nothing queued or unwritten. */
  get empty(): boolean {
    return this.queuedRequests === 0 && this.queuedBytes === 0 && this.sendBytes === 0;
  }
}

/**
 * Reply buffers for coalesced small ranges, reused: a fresh large buffer costs a page fault per
 * 4 KiB on first touch, more than the copy itself. Shared by a transport's streams (one thread).
 */
export class SendBufferPool {
  static readonly KEEP = 8;
  readonly size: number;
  readonly #free: Buffer[] = [];
  constructor(frameTargetBytes: number) {
    this.size = HEADER_BYTES + frameTargetBytes;
  }
  /** A buffer of at least `n` bytes (pooled when `n` is large but fits the pool's size). */
  take(n: number): Buffer {
    if (n <= 4096 || n > this.size) return Buffer.allocUnsafe(n);
    return this.#free.pop() ?? Buffer.allocUnsafeSlow(this.size);
  }
  /** The socket has written it (or dropped it): it may be reused. */
  give(b: Buffer): void {
    if (b.length === this.size && this.#free.length < SendBufferPool.KEEP) this.#free.push(b);
  }
}

/** What a stream needs from its transport. */
export interface StreamContext {
  readonly name: string;
  readonly grants: GrantTable;
  readonly sendBuffers: SendBufferPool;
  /** This side's chunk limit: the most data a frame from the peer may carry, and a request may ask for. */
  readonly maxChunkBytes: number;
  /** A stream's serve queue fills while more than this waits to be sent on it, or its peer's {@link PeerLedger.sendBytes} exceed it. */
  readonly sendHighWaterMark: number;
  /** Most requests (and replies) one peer may have waiting in the serve queues; past it the stream is disconnected. */
  readonly maxQueuedRequests: number;
  /** Most bytes of them one peer may have waiting. */
  readonly maxQueuedRequestBytes: number;
  readonly tuning: StreamTuning;
  readonly logger: Logger | undefined;
  /** A bound or policy hit a peer (logged and counted by the transport). */
  peerEvent(event: PeerEvent, peer: string | undefined, message: string): void;
}

/** What a stream needs from its connection (see connection.ts). */
export interface StreamOwner {
  readonly peer: NodeIdentity;
  /** The chunk limit agreed with the peer. */
  readonly maxChunkBytes: number;
  /** What this peer holds in the responder, shared by all its streams and connections. */
  readonly ledger: PeerLedger;
  /** Bytes arrived: a retiring connection that still moves data is not stuck. */
  progress(): void;
  /** The stream failed or closed. `hadError` false: the socket closed by itself (maybe orderly). */
  streamFailed(stream: FramedStream, error: TensorwireError, hadError: boolean): void;
  /** The peer sent GOAWAY on this stream. */
  peerRetiring(): void;
}

/** One `run()` call: its frames are answered, counted, and the call settles once. */
interface Op {
  readonly plan: BatchPlan;
  readonly batch: TransferBatch;
  readonly frames: FramePending[];
  /** Frames not yet answered. */
  remaining: number;
  /** Write frames whose data has not yet left Node's buffers. */
  unflushed: number;
  error: TensorwireError | undefined;
  /** The caller's abort/timeout, reported instead of the socket error. */
  cancelError: TensorwireError | undefined;
  settled: boolean;
  /** The local registrations are pinned for this call. */
  pinned: boolean;
  readonly done: Deferred<void>;
  readonly signal: AbortSignal;
  onAbort: (() => void) | undefined;
}

/** One request frame this side issued and awaits. */
interface FramePending {
  readonly id: number;
  readonly op: Op;
  readonly frame: FramePlan;
  /** The call gave up on it: a late reply is discarded. */
  cancelled: boolean;
}

/** An incoming WRITEV: the entries it writes into, or why it was refused. */
interface IncomingWrite {
  readonly pinned: GrantEntry[] | undefined;
  readonly code: string;
  readonly message: string;
  readonly range: number;
}

/** A request or reply waiting in a serve queue: a READV's copied head, or an encoded WRITEV reply. */
interface Queued {
  readonly reqId: number;
  readonly head: Buffer | undefined;
  readonly reply: Buffer | undefined;
  readonly cost: number;
}

export interface FramedStreamOptions {
  /** A parser created before the socket (Node asks an `onread` socket for its first buffer inside `net.connect()`). */
  readonly parser?: FrameParser;
  /** The staging buffer of an `onread` socket (the one its `buffer()` hands out by default). */
  readonly staging?: Buffer;
}

export class FramedStream implements FrameSink, GrantUser {
  readonly socket: net.Socket;
  readonly parser: FrameParser;
  readonly #ctx: StreamContext;
  #owner: StreamOwner | undefined;
  readonly #pending = new Map<number, FramePending>();
  /** Calls in progress that pin local registrations. */
  readonly #ops = new Set<Op>();
  #nextId = 1;
  /** READV_REQs (heads copied) and WRITEV replies waiting while the socket or the peer's ledger is above the high-water mark. */
  #serveQueue: Queued[] = [];
  #serveHead = 0;
  /** What this stream's queue has charged to its peer's ledger. */
  #queuedBytes = 0;
  #sentGoaway = false;
  #receivedGoaway = false;
  #ended = false;
  #established = false;
  #corked = false;
  readonly closed: Promise<void>;
  /** onread sockets: where small ranges and control frames land (many per read); large ranges go direct. */
  readonly #staging: Buffer | undefined;
  /** The caller's memory libuv holds for the next read, when it holds any, and whose call it is. */
  #handedDirect: Uint8Array | undefined;
  #handedOp: Op | undefined;
  /** The frame whose READV_DATA is arriving. */
  #receiving: FramePending | undefined;
  #incomingWrite: IncomingWrite | undefined;
  // Reused per frame by the responder (one frame is served at a time; writes keep their own).
  readonly #entries: (GrantEntry | RangeRefusal)[] = [];
  /** Incoming WRITEV: the destination buffer of each range (table entry i names buffer i). */
  readonly #writeBuffers: Uint8Array[] = [];
  #writeTable = new Float64Array(0);
  #armed: Op | undefined;
  #armedTimer: NodeJS.Timeout | undefined;
  /** Until the handshake finished: the next control frame goes here (HELLO, HELLO_ACK or ERROR). */
  onHandshakeFrame: ((type: FrameType, body: Uint8Array) => void) | undefined;

  constructor(socket: net.Socket, ctx: StreamContext, options: FramedStreamOptions = {}) {
    this.socket = socket;
    this.#ctx = ctx;
    this.#staging = options.staging;
    this.parser = options.parser ?? new FrameParser(this, ctx.maxChunkBytes, { handshaking: true });
    this.parser.handshaking = true;
    this.parser.sink = this;
    this.closed = new Promise((resolve) => socket.once('close', () => resolve()));
    socket.on('error', (e) => this.#failed(new ConnectionBrokenError(`socket error: ${e.message}`, { cause: e }), true));
    socket.on('close', () => this.#failed(new ConnectionBrokenError('the peer closed the connection'), false));
    socket.on('drain', () => this.serveQueued());
  }

  /** Join a connection (the dialer does at once; the acceptor once HELLO said which connection). */
  attach(owner: StreamOwner): void {
    this.#owner = owner;
  }

  get owner(): StreamOwner | undefined {
    return this.#owner;
  }

  /** The handshake finished: requests may flow both ways from the next frame on. */
  establish(): void {
    this.#established = true;
    this.onHandshakeFrame = undefined;
    this.parser.handshaking = false;
  }

  get established(): boolean {
    return this.#established;
  }

  get pendingCount(): number {
    return this.#pending.size;
  }

  /** Requests and replies waiting in this stream's serve queue. */
  get queuedCount(): number {
    return this.#serveQueue.length - this.#serveHead;
  }

  /**
   * Work in flight on this stream: requests this side issued and awaits, calls still pinning
   * memory, requests or replies queued or unwritten, a WRITEV being received. The idle rule
   * never retires a connection with any of it.
   */
  get busy(): boolean {
    return this.#pending.size > 0 || this.#ops.size > 0 || this.#serveHead < this.#serveQueue.length || this.socket.writableLength > 0 || this.#incomingWrite !== undefined || this.#armed !== undefined;
  }

  #failed(error: TensorwireError, hadError: boolean): void {
    if (this.#owner) {
      this.#owner.streamFailed(this, error, hadError);
      return;
    }
    // Not part of a connection yet (an accepted socket mid-handshake): nothing else to fail.
    this.socket.destroy();
    this.failAll(error);
  }

  /** Feed the parser from `'data'` events (copy mode: accepted sockets). */
  attachCopyReader(): void {
    this.socket.on('data', (chunk: Buffer) => this.feed(chunk));
  }

  feed(chunk: Uint8Array): void {
    this.#owner?.progress();
    try {
      this.parser.push(chunk);
    } catch (e) {
      this.#protocolError(e);
    }
  }

  /**
   * onread: the buffer for the next read — the destination itself for a large range, else
   * staging (only up to where a large range starts, so that range then goes direct).
   */
  nextReadBuffer(): Uint8Array {
    const direct = this.parser.directTarget(this.#ctx.tuning.directMinBytes);
    this.#handedDirect = direct;
    this.#handedOp = direct === undefined ? undefined : this.#receiving?.op;
    if (direct) return direct;
    const staging = this.#staging as Buffer;
    const n = this.parser.stagingBytes(staging.length, this.#ctx.tuning.directMinBytes);
    return n < staging.length ? staging.subarray(0, n) : staging;
  }

  /** onread: `n` bytes arrived in the buffer `nextReadBuffer()` handed out. */
  onRead(n: number): void {
    this.#owner?.progress();
    const direct = this.#handedDirect;
    this.#handedDirect = undefined;
    this.#handedOp = undefined;
    try {
      if (direct) this.parser.commit(n);
      else this.parser.push((this.#staging as Buffer).subarray(0, n));
    } catch (e) {
      this.#protocolError(e);
    }
    this.#afterRead();
  }

  #protocolError(e: unknown): void {
    const err = toTensorwireError(e, InvalidInputError);
    this.#ctx.peerEvent('protocol_violation', this.#owner?.peer.nodeId, err.message);
    this.#failed(new ConnectionBrokenError(`protocol violation from peer: ${err.message}`, { cause: err }), true);
  }

  #live(what: string): boolean {
    // The stream failed while the parser was still walking the chunk it came in (a peer over
    // its queue bound, say): the rest of that chunk is ignored. A WRITEV head taken now would
    // pin its grants for data that can never arrive, after failAll has released everything.
    if (this.socket.destroyed) return false;
    if (!this.#established || !this.#owner) {
      this.#protocolError(new InvalidInputError(`${what} before the handshake finished`));
      return false;
    }
    return true;
  }

  // --- FrameSink -----------------------------------------------------------------------

  onControl(type: FrameType, reqId: number, body: Uint8Array): void {
    if (this.onHandshakeFrame) {
      this.onHandshakeFrame(type, body);
      return;
    }
    if (!this.#live(`frame type 0x${type.toString(16)}`)) return;
    switch (type) {
      case FrameType.WritevAck: {
        const p = this.#pending.get(reqId);
        if (p && p.op.plan.write) this.#frameDone(p, undefined);
        return;
      }
      case FrameType.Error: {
        let info: ReturnType<typeof decodeError>;
        try {
          info = decodeError(body);
        } catch (e) {
          this.#protocolError(e);
          return;
        }
        const p = this.#pending.get(reqId);
        if (!p) return;
        const { frame, op } = p;
        const range = info.range !== undefined && info.range < frame.count ? frame.start + info.range : undefined;
        const details: Record<string, unknown> = { remoteCode: info.code };
        if (range !== undefined) {
          details['request'] = op.batch.ranges[range * RANGE_STRIDE + RangeField.Request];
          details['range'] = range;
        }
        const what = op.plan.write ? 'write' : 'read';
        this.#frameDone(p, new RemoteRejectedError(`peer rejected the ${what}${details['request'] !== undefined ? ` of request ${String(details['request'])}` : ''}: ${info.message}`, { details }));
        return;
      }
      case FrameType.Goaway:
        this.#receivedGoaway = true;
        this.#owner?.peerRetiring();
        this.maybeEnd();
        return;
      default:
        this.#protocolError(new InvalidInputError(`unexpected frame type 0x${type.toString(16)}`));
    }
  }

  onReadvRequest(reqId: number, head: Buffer): void {
    if (!this.#live('READV_REQ')) return;
    if (this.#serveHead < this.#serveQueue.length || this.#held()) this.#enqueue(reqId, head, undefined);
    else this.#serveReadv(reqId, head);
  }

  readvTarget(reqId: number, length: number): ScatterList | undefined {
    if (!this.#live('READV_DATA')) return undefined;
    const p = this.#pending.get(reqId);
    if (!p || p.op.plan.write) return undefined;
    if (p.frame.bytes !== length) {
      this.#protocolError(new InvalidInputError(`READV_DATA of ${length} bytes for a request of ${p.frame.bytes}`));
      return undefined;
    }
    this.#receiving = p;
    return p.cancelled ? undefined : p.frame.scatter;
  }

  writevTarget(reqId: number, head: Buffer, length: number): ScatterList | undefined {
    void reqId;
    if (!this.#live('WRITEV_REQ')) return undefined;
    const checked = this.#ctx.grants.check(head, length, this.#ctx.maxChunkBytes, this.#entries);
    if (!Array.isArray(checked)) {
      this.#incomingWrite = { pinned: undefined, ...checked };
      return undefined;
    }
    // Where each range goes: [i, offset in its buffer, length] per range, and buffer i per range.
    const tokens = headTokenCount(head);
    const count = headRangeCount(head);
    const entries = this.#entries as GrantEntry[]; // every range's token is live: checked
    const buffers = this.#writeBuffers;
    buffers.length = count;
    if (this.#writeTable.length < count * 3) this.#writeTable = new Float64Array(Math.max(count, 64) * 3);
    const table = this.#writeTable;
    let at = headRangeAt(tokens, 0);
    for (let i = 0; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const e = entries[rangeTokenIndex(head, at)] as GrantEntry;
      const k = rangeGrantIndex(head, at);
      buffers[i] = grantedBuffer(e, k);
      table[3 * i] = i;
      table[3 * i + 1] = grantedOffset(e, k) + rangeOffset(head, at);
      table[3 * i + 2] = rangeLength(head, at);
    }
    for (const g of checked) g.acquire(this);
    this.#incomingWrite = { pinned: checked, code: '', message: '', range: NO_RANGE };
    return { buffers, table, stride: 3, bufferField: 0, offsetField: 1, lengthField: 2, first: 0, count };
  }

  onDataDone(type: FrameType, reqId: number, discarded: boolean): void {
    if (type === FrameType.ReadvData) {
      const p = this.#receiving;
      this.#receiving = undefined;
      if (!p || p.id !== reqId || this.#pending.get(reqId) !== p) return;
      if (p.cancelled || discarded) this.#forget(p);
      else this.#frameDone(p, undefined);
      return;
    }
    // WRITEV_REQ data fully received (or discarded).
    const w = this.#incomingWrite;
    this.#incomingWrite = undefined;
    if (!w) return;
    if (w.pinned) for (const g of w.pinned) g.release(this);
    const reply = w.pinned ? frameHeader(FrameType.WritevAck, reqId, 0) : encodeError(reqId, w.code, w.message, w.range);
    // A peer that floods WRITEVs and never reads the replies queues them like READVs: bounded.
    if (this.#serveHead < this.#serveQueue.length || this.#held()) this.#enqueue(reqId, undefined, reply);
    else this.#sendCharged([reply], reply.length);
  }

  // --- serving -------------------------------------------------------------------------

  #serveReadv(reqId: number, head: Buffer): void {
    const checked = this.#ctx.grants.check(head, -1, this.#ctx.maxChunkBytes, this.#entries);
    if (!Array.isArray(checked)) {
      const err = encodeError(reqId, checked.code, checked.message, checked.range);
      this.#sendCharged([err], err.length);
      return;
    }
    const zeroCopy = this.#ctx.tuning.zeroCopyMinBytes;
    const tokens = headTokenCount(head);
    const count = headRangeCount(head);
    const entries = this.#entries as GrantEntry[]; // every range's token is live: checked
    let total = 0;
    let small = 0;
    const first = headRangeAt(tokens, 0);
    for (let i = 0, at = first; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const len = rangeLength(head, at);
      total += len;
      if (len < zeroCopy) small += len;
    }
    // Small ranges are copied into one send buffer (behind the header); large ones are sent
    // from the registered memory itself, pinned until the socket has written them.
    const pool = this.#ctx.sendBuffers;
    const out = pool.take(HEADER_BYTES + small);
    putHeader(out, 0, FrameType.ReadvData, reqId, total);
    const parts: Uint8Array[] = [];
    let pos = HEADER_BYTES;
    let piece = 0;
    for (let i = 0, at = first; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const e = entries[rangeTokenIndex(head, at)] as GrantEntry;
      const k = rangeGrantIndex(head, at);
      const src = grantedBuffer(e, k);
      const off = grantedOffset(e, k) + rangeOffset(head, at);
      const len = rangeLength(head, at);
      if (len >= zeroCopy) {
        if (pos > piece) parts.push(out.subarray(piece, pos));
        piece = pos;
        parts.push(src.subarray(off, off + len));
      } else {
        src.copy(out, pos, off, off + len);
        pos += len;
      }
    }
    if (pos > piece) parts.push(out.subarray(piece, pos));
    for (const g of checked) g.acquire(this);
    // The copy (header and small ranges) and the socket's bookkeeping per buffer are memory held
    // for this peer until written: charged to its ledger, so its replies in flight are bounded.
    const ledger = (this.#owner as StreamOwner).ledger;
    const cost = HEADER_BYTES + small + parts.length * SEND_PART_OVERHEAD;
    ledger.charge(cost);
    this.#send(parts, () => {
      for (const g of checked) g.release(this);
      pool.give(out);
      ledger.release(cost);
    });
  }

  /** A reply of the responder (an ERROR, a WRITEV_ACK), charged to the peer's ledger until written. */
  #sendCharged(parts: Uint8Array[], bytes: number): void {
    const ledger = (this.#owner as StreamOwner).ledger;
    const cost = bytes + parts.length * SEND_PART_OVERHEAD;
    ledger.charge(cost);
    this.#send(parts, () => ledger.release(cost));
  }

  /** Serving waits: this socket has more than the high-water mark to send, or the peer's replies in flight do. */
  #held(): boolean {
    return this.socket.writableLength > this.#ctx.sendHighWaterMark || (this.#owner as StreamOwner).ledger.sendHeld;
  }

  #enqueue(reqId: number, head: Buffer | undefined, reply: Buffer | undefined): void {
    const c = this.#ctx;
    const ledger = (this.#owner as StreamOwner).ledger;
    const cost = (head ?? (reply as Buffer)).length + QUEUED_REQUEST_OVERHEAD;
    const requests = ledger.queuedRequests + 1;
    const bytes = ledger.queuedBytes + cost;
    if (requests > c.maxQueuedRequests || bytes > c.maxQueuedRequestBytes) {
      const reason = `peer ${ledger.nodeId} queued ${requests} requests (${bytes} bytes) without reading the replies, over the limit of ${c.maxQueuedRequests} requests or ${c.maxQueuedRequestBytes} bytes`;
      c.peerEvent('request_queue', ledger.nodeId, reason);
      this.#failed(new ConnectionBrokenError(reason), true);
      return;
    }
    ledger.queuedRequests = requests;
    ledger.queuedBytes = bytes;
    this.#queuedBytes += cost;
    if (this.#serveHead === this.#serveQueue.length) ledger.wait(this);
    this.#serveQueue.push({ reqId, head: head && Buffer.from(head), reply, cost });
  }

  /** Serve what waits in the queue while neither the socket nor the peer's ledger is above the high-water mark. */
  serveQueued(): void {
    const q = this.#serveQueue;
    const owner = this.#owner;
    if (!owner || this.#serveHead >= q.length) return;
    const ledger = owner.ledger;
    while (this.#serveHead < q.length && !this.#held() && !this.socket.destroyed) {
      const next = q[this.#serveHead] as Queued;
      q[this.#serveHead++] = undefined as never;
      this.#queuedBytes -= next.cost;
      ledger.queuedBytes -= next.cost;
      ledger.queuedRequests--;
      if (next.head) this.#serveReadv(next.reqId, next.head);
      else this.#sendCharged([next.reply as Buffer], (next.reply as Buffer).length);
    }
    if (this.#serveHead >= q.length) {
      ledger.unwait(this);
      this.#serveQueue = [];
      this.#serveHead = 0;
      this.#queuedBytes = 0;
      this.maybeEnd();
    } else if (this.#serveHead > 1024 && this.#serveHead * 2 > q.length) {
      this.#serveQueue = q.slice(this.#serveHead);
      this.#serveHead = 0;
    }
  }

  /** Queue frames on the socket; `done` runs once the last is written (or dropped). */
  send(parts: Uint8Array[], done?: () => void): void {
    this.#send(parts, done);
  }

  #send(parts: Uint8Array[], done?: () => void): void {
    const s = this.socket;
    if (s.destroyed || this.#ended) {
      done?.();
      return;
    }
    this.#cork();
    const last = parts.length - 1;
    for (let i = 0; i < last; i++) s.write(parts[i] as Uint8Array);
    s.write(parts[last] as Uint8Array, done ? () => done() : undefined);
  }

  /** Everything sent in one tick leaves in one writev: many frames cost one syscall, not one each. */
  #cork(): void {
    if (this.#corked) return;
    this.#corked = true;
    const s = this.socket;
    s.cork();
    process.nextTick(() => {
      this.#corked = false;
      s.uncork();
    });
  }

  // --- requesting ----------------------------------------------------------------------

  /** Issue every frame of the batch; settles once all are answered (or quiesced), rejecting with the first error. */
  run(batch: TransferBatch, options: ExecuteOptions, limits: BatchLimits): Promise<void> {
    if (this.#sentGoaway || this.#receivedGoaway || this.socket.destroyed || !this.#established) {
      return Promise.reject(new SessionInvalidatedError('connection is retiring or closed; no new requests accepted'));
    }
    const signal = options.signal;
    if (signal.aborted) return Promise.reject(errorFromSignal(signal, 'transfer'));
    let plan: BatchPlan;
    try {
      plan = planFor(batch, this.#ctx.grants, limits);
    } catch (e) {
      return Promise.reject(toTensorwireError(e, InvalidInputError));
    }
    // Re-checked on every post: a registration may have been revoked since the last one.
    for (const g of plan.locals) {
      if (g.revoked) return Promise.reject(new InvalidInputError(`local registration is not a live ${this.#ctx.name} registration`));
    }
    if (plan.frames.length === 0) return Promise.resolve();
    const op: Op = { plan, batch, frames: [], remaining: plan.frames.length, unflushed: 0, error: undefined, cancelError: undefined, settled: false, pinned: true, done: deferred<void>(), signal, onAbort: undefined };
    for (const g of plan.locals) g.acquire(this);
    this.#ops.add(op);
    for (const frame of plan.frames) {
      const id = this.#allocId();
      const p: FramePending = { id, op, frame, cancelled: false };
      op.frames.push(p);
      this.#pending.set(id, p);
      if (plan.write) this.#sendWrite(p);
      else this.#sendRead(p);
    }
    if (!op.settled) {
      op.onAbort = (): void => this.#cancel(op, errorFromSignal(signal, 'transfer'));
      signal.addEventListener('abort', op.onAbort, { once: true });
    }
    return op.done.promise;
  }

  /** The frame's cached wire bytes with this post's request id, or a copy while the cached ones are queued. */
  #wire(p: FramePending): Buffer {
    const f = p.frame;
    let wire = f.wire;
    if (f.busy) {
      wire = Buffer.allocUnsafe(f.wire.length);
      f.wire.copy(wire, 0, 0, f.headEnd);
    } else {
      f.busy = true;
    }
    patchRequestId(wire, p.id);
    return wire;
  }

  #sendRead(p: FramePending): void {
    const f = p.frame;
    const wire = this.#wire(p);
    this.#send([wire], wire === f.wire ? () => (f.busy = false) : undefined);
  }

  #sendWrite(p: FramePending): void {
    const f = p.frame;
    const op = p.op;
    const zeroCopy = this.#ctx.tuning.zeroCopyMinBytes;
    const wire = this.#wire(p);
    const r = op.batch.ranges;
    const buffers = op.plan.buffers;
    const parts: Uint8Array[] = [];
    let pos = f.headEnd;
    let piece = 0;
    for (let i = f.start, end = f.start + f.count; i < end; i++) {
      const at = i * RANGE_STRIDE;
      const src = buffers[r[at + RangeField.Local] as number] as Buffer;
      const off = r[at + RangeField.LocalOffset] as number;
      const len = r[at + RangeField.Length] as number;
      if (len >= zeroCopy) {
        if (pos > piece) parts.push(wire.subarray(piece, pos));
        piece = pos;
        parts.push(src.subarray(off, off + len));
      } else {
        src.copy(wire, pos, off, off + len);
        pos += len;
      }
    }
    if (pos > piece) parts.push(wire.subarray(piece, pos));
    op.unflushed++;
    const own = wire === f.wire;
    this.#send(parts, () => {
      if (own) f.busy = false;
      op.unflushed--;
      this.#unpin(op);
    });
  }

  #allocId(): number {
    const id = this.#nextId;
    this.#nextId = this.#nextId >= 0xfffffff0 ? 1 : this.#nextId + 1;
    return id;
  }

  /** A frame was answered (data landed, ACK, or ERROR). */
  #frameDone(p: FramePending, error: TensorwireError | undefined): void {
    this.#pending.delete(p.id);
    const op = p.op;
    if (p.cancelled || op.settled) {
      this.maybeEnd();
      return;
    }
    if (error && !op.error) op.error = error;
    if (--op.remaining === 0) this.#settle(op, op.error);
  }

  /** A cancelled frame whose late reply has now been discarded. */
  #forget(p: FramePending): void {
    this.#pending.delete(p.id);
    this.maybeEnd();
  }

  #settle(op: Op, error: TensorwireError | undefined): void {
    if (op.settled) return;
    op.settled = true;
    if (op.onAbort) op.signal.removeEventListener('abort', op.onAbort);
    this.#unpin(op);
    if (error) op.done.reject(error);
    else op.done.resolve();
    if (!this.socket.destroyed) this.maybeEnd();
  }

  /** Release a call's local registrations once it has settled and the socket no longer reads its memory. */
  #unpin(op: Op, force = false): void {
    if (!op.pinned || (!force && (!op.settled || op.unflushed > 0))) return;
    op.pinned = false;
    this.#ops.delete(op);
    for (const g of op.plan.locals) g.release(this);
  }

  /**
   * Cancel a call: quiesce first. If the socket may still read from its memory (a write not yet
   * flushed), the stream is destroyed and the call settles when it has closed. If libuv holds one
   * of its destinations for the next read, the call settles after that read (or the stream is
   * destroyed if none comes). Otherwise it settles now and late replies are discarded.
   */
  #cancel(op: Op, error: TensorwireError): void {
    if (op.settled || op.cancelError) return;
    op.cancelError = error;
    if (op.plan.write && op.unflushed > 0) {
      // The socket still holds data that reads from the caller's memory: only destroying it
      // stops that. destroy() closes the fd synchronously (uv_close); nothing moves after.
      this.#failed(new ConnectionBrokenError(`stream closed to quiesce a cancelled write (${error.message})`), true);
      return;
    }
    for (const p of op.frames) if (this.#pending.get(p.id) === p) p.cancelled = true;
    const receiving = this.#receiving;
    if (receiving !== undefined && receiving.op === op) this.parser.detachTarget(); // the rest of this frame is counted, not stored
    if (this.#handedDirect === undefined || this.#handedOp !== op) {
      this.#settle(op, error);
      return;
    }
    // With onread, libuv was already handed one of this call's destinations for its next read:
    // one more read may land there. Settle after that read, or, if the peer sends nothing more
    // within the grace period, destroy the stream to take the buffer back.
    this.#armed = op;
    this.#armedTimer = setTimeout(() => {
      if (this.#armed === op) {
        this.#armed = undefined;
        this.#failed(new ConnectionBrokenError(`stream closed to quiesce a cancelled read (${error.message})`), true);
      }
    }, this.#ctx.tuning.cancelGraceMs);
  }

  /** A revocation gave up waiting for this stream to stop using a registration or grant. */
  abortForRevoke(): void {
    this.#failed(new ConnectionBrokenError('a registration or grant this connection was using was revoked and the transfer did not finish in time'), true);
  }

  /** After every read on an onread socket: the buffer libuv held has been used. */
  #afterRead(): void {
    const op = this.#armed;
    if (!op) return;
    this.#armed = undefined;
    clearTimeout(this.#armedTimer);
    this.#settle(op, op.cancelError);
  }

  /** Fail every call (the socket is gone or going). Called after the socket is destroyed. */
  failAll(error: TensorwireError): void {
    if (this.#armedTimer) clearTimeout(this.#armedTimer);
    this.#armed = undefined;
    this.#receiving = undefined;
    this.#handedDirect = undefined;
    this.#handedOp = undefined;
    this.#pending.clear();
    for (const op of [...this.#ops]) {
      // A call whose own signal already fired reports that (its deadline or abort), even when
      // another call's quiesce closed the connection before its abort listener ran.
      this.#settle(op, op.cancelError ?? (op.signal.aborted ? errorFromSignal(op.signal, 'transfer') : error));
      this.#unpin(op, true);
    }
    const w = this.#incomingWrite;
    this.#incomingWrite = undefined;
    if (w?.pinned) for (const g of w.pinned) g.release(this);
    const ledger = this.#owner?.ledger;
    if (ledger && this.#serveHead < this.#serveQueue.length) {
      ledger.queuedRequests -= this.#serveQueue.length - this.#serveHead;
      ledger.queuedBytes -= this.#queuedBytes;
      ledger.unwait(this);
    }
    this.#serveQueue = [];
    this.#serveHead = 0;
    this.#queuedBytes = 0;
  }

  // --- retiring ------------------------------------------------------------------------

  sendGoaway(): void {
    if (this.#sentGoaway || this.socket.destroyed) return;
    this.#sentGoaway = true;
    this.#send([encodeGoaway()]);
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
      this.#send([encodeGoaway()]);
    }
    if (this.#pending.size > 0 || this.#serveHead < this.#serveQueue.length) return;
    this.#ended = true;
    this.socket.end();
  }
}
