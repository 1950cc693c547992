/**
 * The TCP transport: one-sided READ and WRITE against memory the other side registered,
 * over the vectored protocol in frames.ts on `node:net`.
 *
 * - Every registration gets its own unguessable 128-bit token (its one range is the whole
 *   registration), and so does every range grant (register once, grant per lease): one token
 *   and one table entry however many ranges it has, its range table kept as the engine made it.
 *   A request names a token, a granted range index and an offset inside that range; the
 *   responder checks it against that range in O(1), never against the whole registration.
 *   Revoking a token (O(1) for a grant; a registration's revocation ends its grants too) makes
 *   further requests fail with `REVOKED`, and waits until no socket still uses that memory.
 * - A stream batch becomes a few frames (at most {@link FRAME_TARGET_BYTES} of data, 8192
 *   ranges and 1024 tokens each, so frames pipeline), each one READV_REQ or WRITEV_REQ carrying
 *   many ranges. Encoded frames are cached per batch object (the engine posts the same batch
 *   again for prepared transfers) and only their request ids are patched. One pending entry
 *   per frame, one promise per `execute()` call, settled by counting frames.
 * - Outbound sockets receive with `onread`: a destination range with at least
 *   {@link DIRECT_MIN_BYTES} still to come is handed to libuv itself; small ranges are read
 *   many at a time into a staging buffer and copied out (a staged read stops where a large
 *   range starts). Inbound sockets copy once from Node's buffers, straight into each range.
 *   The parser walks the batch's own range table by index: no object per range.
 * - The responder checks every range of a frame before sending or accepting any byte, answers
 *   with one READV_DATA (ranges under {@link ZERO_COPY_MIN_BYTES} coalesced into one send
 *   buffer, larger ones handed to the socket from the registered memory itself, pinned until
 *   written) or one ERROR naming the failing range. A WRITEV's data is scattered straight into
 *   the granted memory, or skipped when the head was refused.
 * - The responder queues requests while its socket's send queue is above the high-water mark;
 *   that queue is bounded per socket ({@link TcpTransportOptions.maxQueuedRequests},
 *   {@link TcpTransportOptions.maxQueuedRequestBytes}): a peer that keeps asking without reading
 *   the replies is disconnected, with a logged reason. Other peers are unaffected.
 * - A connection is `streams` sockets; the engine spreads work over them. Both sides can
 *   issue requests on every socket, which makes simultaneous open a real case the engine
 *   settles (see TransportHost.inbound).
 * - On abort or deadline, a batch whose bytes the socket may still be writing into memory
 *   (or reading from memory) is quiesced first: a write not yet flushed has its socket
 *   destroyed; a read libuv may still receive into settles after that read, or its socket is
 *   destroyed. The promise settles only after nothing can touch the memory (invariant 6). Late
 *   replies to the rest are discarded.
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
  TimedOutError,
  type TensorwireError,
  errorFromSignal,
  toTensorwireError,
} from '../errors.js';
import type { Logger } from '../logger.js';
import {
  GRANT_STRIDE,
  GrantField,
  RANGE_STRIDE,
  RangeField,
  TRANSPORT_SPECIFICATION_VERSION,
  type ConnectOptions,
  type GrantRanges,
  type ExecuteOptions,
  type Memory,
  type MemoryKind,
  type NodeIdentity,
  type TransferBatch,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
} from '../transport.js';
import {
  FrameParser,
  FrameType,
  HEADER_BYTES,
  MAX_RANGES_PER_FRAME,
  MAX_TOKENS_PER_FRAME,
  NO_RANGE,
  RANGE_ENTRY_BYTES,
  TOKEN_BYTES,
  allocVecFrame,
  decodeError,
  decodeHello,
  decodeHelloAck,
  encodeError,
  encodeHello,
  encodeHelloAck,
  frameHeader,
  headRangeAt,
  headRangeCount,
  headTokenAt,
  headTokenCount,
  patchRequestId,
  putHeader,
  putRange,
  putToken,
  rangeGrantIndex,
  rangeLength,
  rangeOffset,
  rangeTokenIndex,
  vecHeadBytes,
  type FrameSink,
  type ScatterList,
} from './frames.js';

export interface TcpTransportOptions {
  /** Address to listen on. Default 127.0.0.1. */
  host?: string;
  /** Port to listen on. Default 0 (any free port). */
  port?: number;
  /** Address peers should dial, when it differs from `host` (e.g. listening on 0.0.0.0). */
  advertiseHost?: string;
  /** Largest chunk accepted on the wire, and the most data one frame may carry. Default 16 MiB. */
  maxChunkBytes?: number;
  /** Responder queues requests while more than this many bytes wait to be sent. Default 8 MiB. */
  sendHighWaterMark?: number;
  /**
   * Most request frames one socket may have waiting in the responder's queue (while the send
   * queue is over the high-water mark). A peer past it is disconnected. Default 65536.
   */
  maxQueuedRequests?: number;
  /** Most bytes of request heads one socket may have waiting in that queue. Default 64 MiB. */
  maxQueuedRequestBytes?: number;
  /** A peer must finish its handshake within this. Default 10 s. */
  handshakeTimeoutMs?: number;
  /** How long a retiring connection may go without progress before it is closed abortively. Default 10 s. */
  retireTimeoutMs?: number;
  /** How long revoke() lets sockets still using a registration finish before closing them. Default 2 s. */
  revokeGraceMs?: number;
}

const ENDPOINT_MAGIC = [0x54, 0x57, 0x54, 0x01]; // TWT v1
/** Revoked tokens remembered (so peers get REVOKED rather than UNKNOWN_GRANT): the most recent this many. */
const REVOKED_MEMORY = 4096;
/** The wire's granted range index is a u32. */
const MAX_WIRE_RANGE_INDEX = 0xffffffff;
/** Destination ranges with at least this much still to come are received straight into their memory. */
export const DIRECT_MIN_BYTES = 64 * 1024;
/**
 * Reply and WRITEV data ranges of at least this size are handed to the socket as they are (the
 * kernel copies them once, straight from the registered memory); smaller ones are coalesced into
 * one send buffer. Measured on loopback with ranges scattered over 64 MiB: from about 1 KiB up,
 * one copy by the kernel beats a user-space gather copy plus the kernel's copy of that.
 */
export const ZERO_COPY_MIN_BYTES = 1024;
/** A stream batch is cut into frames of at most this much data (a larger single range is a frame of its own). */
export const FRAME_TARGET_BYTES = 1024 * 1024;
/** Staging buffer for small ranges and control frames on outbound sockets. */
const STAGING_BYTES = 64 * 1024;
/** How long a cancelled read may wait for the one read libuv can still do into its buffer. */
const CANCEL_GRACE_MS = 200;
/** Bookkeeping counted per queued request, on top of its head. */
const QUEUED_REQUEST_OVERHEAD = 64;


/**
 * Reply buffers for coalesced small ranges, reused: a fresh large buffer costs a page fault per
 * 4 KiB on first touch, more than the copy itself. Shared by a transport's sockets (one thread).
 */
class SendBufferPool {
  static readonly SIZE = HEADER_BYTES + FRAME_TARGET_BYTES;
  static readonly KEEP = 8;
  readonly #free: Buffer[] = [];
  /** A buffer of at least `n` bytes (pooled when `n` is large but fits the pool's size). */
  take(n: number): Buffer {
    if (n <= 4096 || n > SendBufferPool.SIZE) return Buffer.allocUnsafe(n);
    return this.#free.pop() ?? Buffer.allocUnsafeSlow(SendBufferPool.SIZE);
  }
  /** The socket has written it (or dropped it): it may be reused. */
  give(b: Buffer): void {
    if (b.length === SendBufferPool.SIZE && this.#free.length < SendBufferPool.KEEP) this.#free.push(b);
  }
}

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

/**
 * What a token names in the responder's table: a whole registration or a range grant. Both are
 * the same to the responder: `count` ranges, range `k` at `ranges[k * GRANT_STRIDE + GrantField.X]`
 * (Handle: index into `buffers`, Offset: where it starts in that buffer, Length), so a range
 * check is `k < count && offset + length <= length of k`, O(1), and its bytes are
 * `buffers[handle]` from `offset of k + offset`. The entry also counts which sockets still
 * send from or receive into its memory, so revocation can wait for exactly those.
 */
abstract class TokenEntry {
  readonly token: Uint8Array;
  readonly key: string;
  readonly count: number;
  readonly ranges: Float64Array;
  readonly buffers: readonly Buffer[];
  revoked = false;
  users = 0;
  readonly #byStream = new Map<TcpStream, number>();
  #idle: Deferred<void> | undefined;
  constructor(count: number, ranges: Float64Array, buffers: readonly Buffer[]) {
    this.token = randomBytes(TOKEN_BYTES);
    this.key = toHex(this.token);
    this.count = count;
    this.ranges = ranges;
    this.buffers = buffers;
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

/** A registration: its memory as one range (index 0, the whole of it). Also the local handle of a batch. */
class TcpRegistration extends TokenEntry {
  readonly buffer: Uint8Array;
  /** The same memory as a Buffer: views of it go to the socket without another wrapper. */
  readonly bytes: Buffer;
  /** Live range grants over this registration: revoking it ends them. */
  readonly grants = new Set<TcpRangeGrant>();
  constructor(buffer: Uint8Array) {
    const bytes = Buffer.from(buffer.buffer, buffer.byteOffset, buffer.byteLength);
    super(1, Float64Array.of(0, 0, buffer.byteLength), [bytes]);
    this.buffer = buffer;
    this.bytes = bytes;
  }
}

/**
 * A range grant: the engine's range table (GrantRanges.ranges, validated by the engine and
 * private to it) kept as it is, over the registrations' buffers. One token, one table entry,
 * whatever the number of ranges; nothing is done per range to make or revoke it.
 */
class TcpRangeGrant extends TokenEntry {
  readonly registrations: readonly TcpRegistration[];
  constructor(registrations: readonly TcpRegistration[], count: number, ranges: Float64Array) {
    super(count, ranges, registrations.map((r) => r.bytes));
    this.registrations = registrations;
  }
}

/**
 * A decoded remote descriptor: the peer's token, and the lengths its descriptor claims for its
 * ranges (one range, the whole registration, unless it is a range grant). The lengths only let
 * this side refuse early; the peer checks every range against what it granted.
 */
class RemoteGrant {
  constructor(
    readonly token: Uint8Array,
    readonly byteLength: number,
    readonly rangeLengths: Float64Array,
    /** A range grant (its descriptor listed range lengths), not a whole registration. */
    readonly granted: boolean,
  ) {}
}

// --- batch plans -------------------------------------------------------------------------

/** One request frame of a batch: ranges [start, start+count), encoded once. */
interface FramePlan {
  readonly start: number;
  readonly count: number;
  readonly bytes: number;
  /** Header and head; for a write, followed by room for the frame's small ranges' data. */
  readonly wire: Buffer;
  /** Header + head bytes. */
  readonly headEnd: number;
  /** The wire buffer is queued in a socket (a concurrent post of the same batch must use a copy). */
  busy: boolean;
  /** Reads: where READV_DATA lands (indices into the batch's own range table). */
  readonly scatter: ScatterList | undefined;
}

/** What a transport derives once from a batch object. */
interface BatchPlan {
  /** The connection chunk limit it was checked against. */
  readonly cap: number;
  readonly write: boolean;
  readonly grants: readonly TcpRegistration[];
  /** Per local: its memory as a Buffer (for sending). */
  readonly buffers: readonly Buffer[];
  readonly frames: readonly FramePlan[];
}

const plans = new WeakMap<TransferBatch, BatchPlan>();

function badRange(batch: TransferBatch, i: number, message: string): InvalidInputError {
  const request = batch.ranges[i * RANGE_STRIDE + RangeField.Request];
  return new InvalidInputError(`range ${i} (request ${request}): ${message}`, { details: { request, range: i } });
}

function isIndex(v: number, n: number): boolean {
  return Number.isInteger(v) && v >= 0 && v < n;
}

function isOffset(v: number): boolean {
  return Number.isSafeInteger(v) && v >= 0;
}

/** Check a batch once and encode its request frames. Throws InvalidInputError naming the range. */
function planBatch(batch: TransferBatch, cap: number): BatchPlan {
  const write = batch.op === 'write';
  if (!write && batch.op !== 'read') throw new InvalidInputError(`batch op ${String(batch.op)} is neither read nor write`);
  const n = batch.count;
  const r = batch.ranges;
  if (!Number.isSafeInteger(n) || n < 0 || !(r instanceof Float64Array) || r.length < n * RANGE_STRIDE) throw new InvalidInputError('batch range table is malformed');
  const grants = batch.locals.map((l) => {
    if (!(l instanceof TcpRegistration)) throw new InvalidInputError('local registration is not a tcp registration');
    return l;
  });
  const remotes = batch.remotes.map((x) => {
    if (!(x instanceof RemoteGrant)) throw new InvalidInputError('remote is not a decoded tcp descriptor');
    return x;
  });
  const buffers = grants.map((g) => g.bytes);
  for (let i = 0; i < n; i++) {
    const at = i * RANGE_STRIDE;
    const l = r[at + RangeField.Local] as number;
    const lo = r[at + RangeField.LocalOffset] as number;
    const m = r[at + RangeField.Remote] as number;
    const ro = r[at + RangeField.RemoteOffset] as number;
    const len = r[at + RangeField.Length] as number;
    const k = r[at + RangeField.RemoteRange] as number;
    if (!isIndex(l, grants.length) || !isIndex(m, remotes.length)) throw badRange(batch, i, 'local or remote index is out of the batch tables');
    if (!Number.isInteger(len) || len < 1 || len > cap) throw badRange(batch, i, `length ${len} is not 1..${cap} (the connection's chunk limit)`);
    if (!isOffset(lo) || lo + len > (buffers[l] as Uint8Array).length) throw badRange(batch, i, `${lo}+${len} does not fit the local registration`);
    const lens = (remotes[m] as RemoteGrant).rangeLengths;
    if (!isIndex(k, lens.length)) throw badRange(batch, i, `remote range ${k} does not exist (the remote has ${lens.length})`);
    if (!isOffset(ro) || !(ro + len <= (lens[k] as number))) {
      throw badRange(batch, i, `${ro}+${len} does not fit ${(remotes[m] as RemoteGrant).granted ? `remote granted range ${k} of ${lens[k]} bytes` : 'the remote registration'}`);
    }
  }
  // Cut into frames: at most FRAME_TARGET_BYTES of data (one larger range stands alone), and the
  // protocol's range and token limits. Tokens are per frame, deduplicated.
  const target = Math.min(FRAME_TARGET_BYTES, cap);
  const tokenOf = new Int32Array(remotes.length).fill(-1);
  const used: number[] = [];
  const frames: FramePlan[] = [];
  const close = (start: number, end: number, bytes: number): void => {
    const count = end - start;
    let small = 0;
    if (write) {
      for (let i = start; i < end; i++) {
        const len = r[i * RANGE_STRIDE + RangeField.Length] as number;
        if (len < ZERO_COPY_MIN_BYTES) small += len;
      }
    }
    const wire = allocVecFrame(write ? FrameType.WritevReq : FrameType.ReadvReq, 0, used.length, count, write ? bytes : 0, small);
    used.forEach((m, t) => putToken(wire, t, (remotes[m] as RemoteGrant).token));
    for (let i = start; i < end; i++) {
      const at = i * RANGE_STRIDE;
      putRange(wire, used.length, i - start, tokenOf[r[at + RangeField.Remote] as number] as number, r[at + RangeField.RemoteRange] as number, r[at + RangeField.RemoteOffset] as number, r[at + RangeField.Length] as number);
    }
    const scatter: ScatterList | undefined = write
      ? undefined
      : { buffers, table: r, stride: RANGE_STRIDE, bufferField: RangeField.Local, offsetField: RangeField.LocalOffset, lengthField: RangeField.Length, first: start, count };
    frames.push({ start, count, bytes, wire, headEnd: HEADER_BYTES + vecHeadBytes(used.length, count), busy: false, scatter });
    for (const m of used) tokenOf[m] = -1;
    used.length = 0;
  };
  let start = 0;
  let bytes = 0;
  for (let i = 0; i < n; i++) {
    const at = i * RANGE_STRIDE;
    const len = r[at + RangeField.Length] as number;
    const m = r[at + RangeField.Remote] as number;
    if (i > start && (i - start >= MAX_RANGES_PER_FRAME || bytes + len > target || (tokenOf[m] === -1 && used.length >= MAX_TOKENS_PER_FRAME))) {
      close(start, i, bytes);
      start = i;
      bytes = 0;
    }
    if (tokenOf[m] === -1) tokenOf[m] = used.push(m) - 1;
    bytes += len;
  }
  if (n > start) close(start, n, bytes);
  return { cap, write, grants, buffers, frames };
}

/** One `execute()` call: its frames are answered, counted, and the call settles once. */
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
  /** The local grants are pinned for this call. */
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

/** An incoming WRITEV: the token entries it writes into, or why it was refused. */
interface IncomingWrite {
  readonly pinned: TokenEntry[] | undefined;
  readonly code: string;
  readonly message: string;
  readonly range: number;
}

type Refusal = { readonly code: string; readonly message: string; readonly range: number };

/** One socket of a connection: a parser, the requests it issued, and the requests it serves. */
class TcpStream implements FrameSink {
  readonly socket: net.Socket;
  readonly parser: FrameParser;
  readonly #owner: TcpConnection;
  readonly #transport: TcpTransport;
  readonly #pending = new Map<number, FramePending>();
  /** Calls in progress that pin local grants. */
  readonly #ops = new Set<Op>();
  #nextId = 1;
  /** READV_REQs waiting while the send queue is above the high-water mark (heads copied). */
  #serveQueue: { reqId: number; head: Buffer }[] = [];
  #serveHead = 0;
  #queuedBytes = 0;
  #sentGoaway = false;
  #receivedGoaway = false;
  #ended = false;
  readonly closed: Promise<void>;
  /** Set by the owning connection once the handshake is complete. */
  established = false;
  /** onread sockets: where small ranges and control frames land (many per read); large ranges go direct. */
  readonly #staging: Buffer | undefined;
  /** The caller's memory libuv holds for the next read, when it holds any, and whose call it is. */
  #handedDirect: Uint8Array | undefined;
  #handedOp: Op | undefined;
  /** The frame whose READV_DATA is arriving. */
  #receiving: FramePending | undefined;
  #incomingWrite: IncomingWrite | undefined;
  // Reused per frame by the responder (one frame is served at a time; writes keep their own).
  readonly #tokenEntries: (TokenEntry | Refusal)[] = [];
  /** Incoming WRITEV: the destination buffer of each range (table entry i names buffer i). */
  readonly #writeBuffers: Uint8Array[] = [];
  #writeTable = new Float64Array(0);
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

  /**
   * onread: the buffer for the next read — the destination itself for a large range, else
   * staging (only up to where a large range starts, so that range then goes direct).
   */
  nextReadBuffer(): Uint8Array {
    const direct = this.parser.directTarget(DIRECT_MIN_BYTES);
    this.#handedDirect = direct;
    this.#handedOp = direct === undefined ? undefined : this.#receiving?.op;
    if (direct) return direct;
    const staging = this.#staging as Buffer;
    const n = this.parser.stagingBytes(staging.length, DIRECT_MIN_BYTES);
    return n < staging.length ? staging.subarray(0, n) : staging;
  }

  /** onread: `n` bytes arrived in the buffer `nextReadBuffer()` handed out. */
  onRead(n: number): void {
    this.#owner.progress();
    const direct = this.#handedDirect;
    this.#handedDirect = undefined;
    this.#handedOp = undefined;
    try {
      if (direct) this.parser.commit(n);
      else this.parser.push((this.#staging as Buffer).subarray(0, n));
    } catch (e) {
      this.#protocolError(e);
    }
    this.afterRead();
  }

  #protocolError(e: unknown): void {
    const err = toTensorwireError(e, InvalidInputError);
    this.#owner.streamFailed(this, new ConnectionBrokenError(`protocol violation from peer: ${err.message}`, { cause: err }), true);
  }

  #live(what: string): boolean {
    if (this.onHandshakeFrame || !this.established) {
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
        this.#owner.peerRetiring();
        this.maybeEnd();
        return;
      default:
        this.#protocolError(new InvalidInputError(`unexpected frame type 0x${type.toString(16)}`));
    }
  }

  onReadvRequest(reqId: number, head: Buffer): void {
    if (!this.#live('READV_REQ')) return;
    if (this.#serveHead < this.#serveQueue.length || this.#overHighWater()) this.#enqueue(reqId, head);
    else this.#serveReadv(reqId, head);
  }

  readvTarget(reqId: number, length: number): ScatterList | undefined {
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
    const checked = this.#check(head, length);
    if (!Array.isArray(checked)) {
      this.#incomingWrite = { pinned: undefined, ...checked };
      return undefined;
    }
    // Where each range goes: [i, offset in its buffer, length] per range, and buffer i per range.
    const tokens = headTokenCount(head);
    const count = headRangeCount(head);
    const entries = this.#tokenEntries as TokenEntry[]; // every range's token is live: checked
    const buffers = this.#writeBuffers;
    buffers.length = count;
    if (this.#writeTable.length < count * 3) this.#writeTable = new Float64Array(Math.max(count, 64) * 3);
    const table = this.#writeTable;
    let at = headRangeAt(tokens, 0);
    for (let i = 0; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const e = entries[rangeTokenIndex(head, at)] as TokenEntry;
      const k = rangeGrantIndex(head, at) * GRANT_STRIDE;
      buffers[i] = e.buffers[e.ranges[k + GrantField.Handle] as number] as Buffer;
      table[3 * i] = i;
      table[3 * i + 1] = (e.ranges[k + GrantField.Offset] as number) + rangeOffset(head, at);
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
    if (w.pinned) {
      for (const g of w.pinned) g.release(this);
      this.#send([frameHeader(FrameType.WritevAck, reqId, 0)]);
    } else {
      this.#send([encodeError(reqId, w.code, w.message, w.range)]);
    }
  }

  // --- serving -------------------------------------------------------------------------

  /**
   * Check every range of a vector head: tokens known and live, lengths ≥ 1, the granted range
   * index one its token has, offset + length inside that granted range (never merely inside the
   * registration), the total within the chunk limit. Returns the entries to pin (one per token),
   * or the first refusal. Leaves the token lookups in #tokenEntries.
   */
  #check(head: Buffer, dataLength: number): TokenEntry[] | Refusal {
    const tokens = headTokenCount(head);
    const count = headRangeCount(head);
    const entries = this.#tokenEntries;
    entries.length = tokens;
    for (let t = 0; t < tokens; t++) entries[t] = this.#transport.lookupToken(head, headTokenAt(t));
    const max = this.#transport.maxChunkBytes;
    let total = 0;
    let at = headRangeAt(tokens, 0);
    for (let i = 0; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const e = entries[rangeTokenIndex(head, at)] as TokenEntry | Refusal;
      if (!(e instanceof TokenEntry)) return { code: e.code, message: `range ${i}: ${e.message}`, range: i };
      const k = rangeGrantIndex(head, at);
      const off = rangeOffset(head, at);
      const len = rangeLength(head, at);
      if (len === 0) return { code: 'BAD_REQUEST', message: `range ${i} has length 0`, range: i };
      if (k >= e.count) {
        const what = e instanceof TcpRegistration ? 'a whole registration has only range 0' : `the grant has ${e.count} ranges`;
        return { code: 'NO_SUCH_RANGE', message: `range ${i}: granted range ${k} does not exist (${what})`, range: i };
      }
      const rangeLen = e.ranges[k * GRANT_STRIDE + GrantField.Length] as number;
      if (off + len > rangeLen) {
        const what = e instanceof TcpRegistration ? `the registration of ${rangeLen} bytes` : `granted range ${k} of ${rangeLen} bytes`;
        return { code: 'OUT_OF_BOUNDS', message: `range ${i}: ${off}+${len} exceeds ${what}`, range: i };
      }
      total += len;
      if (total > max) return { code: 'TOO_LARGE', message: `range ${i}: the frame asks for more than ${max} bytes`, range: i };
    }
    if (dataLength >= 0 && total !== dataLength) return { code: 'BAD_REQUEST', message: 'lengths do not match the data', range: NO_RANGE };
    const pin: TokenEntry[] = [];
    for (const e of entries) if (e instanceof TokenEntry) pin.push(e);
    return pin;
  }

  #serveReadv(reqId: number, head: Buffer): void {
    const checked = this.#check(head, -1);
    if (!Array.isArray(checked)) {
      this.#send([encodeError(reqId, checked.code, checked.message, checked.range)]);
      return;
    }
    const tokens = headTokenCount(head);
    const count = headRangeCount(head);
    const entries = this.#tokenEntries as TokenEntry[]; // every range's token is live: checked
    let total = 0;
    let small = 0;
    const first = headRangeAt(tokens, 0);
    for (let i = 0, at = first; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const len = rangeLength(head, at);
      total += len;
      if (len < ZERO_COPY_MIN_BYTES) small += len;
    }
    // Small ranges are copied into one send buffer (behind the header); large ones are sent
    // from the registered memory itself, pinned until the socket has written them.
    const pool = this.#transport.sendBuffers;
    const out = pool.take(HEADER_BYTES + small);
    putHeader(out, 0, FrameType.ReadvData, reqId, total);
    const parts: Uint8Array[] = [];
    let pos = HEADER_BYTES;
    let piece = 0;
    for (let i = 0, at = first; i < count; i++, at += RANGE_ENTRY_BYTES) {
      const e = entries[rangeTokenIndex(head, at)] as TokenEntry;
      const k = rangeGrantIndex(head, at) * GRANT_STRIDE;
      const src = e.buffers[e.ranges[k + GrantField.Handle] as number] as Buffer;
      const off = (e.ranges[k + GrantField.Offset] as number) + rangeOffset(head, at);
      const len = rangeLength(head, at);
      if (len >= ZERO_COPY_MIN_BYTES) {
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
    this.#send(parts, () => {
      for (const g of checked) g.release(this);
      pool.give(out);
    });
  }

  #overHighWater(): boolean {
    return this.socket.writableLength > this.#transport.sendHighWaterMark;
  }

  #enqueue(reqId: number, head: Buffer): void {
    const t = this.#transport;
    const queued = this.#serveQueue.length - this.#serveHead;
    const bytes = this.#queuedBytes + head.length + QUEUED_REQUEST_OVERHEAD;
    if (queued + 1 > t.maxQueuedRequests || bytes > t.maxQueuedRequestBytes) {
      const reason = `peer queued ${queued + 1} requests (${bytes} bytes) without reading the replies, over the limit of ${t.maxQueuedRequests} requests or ${t.maxQueuedRequestBytes} bytes`;
      t.logger?.warn('tcp peer disconnected: request queue over its bound', { peer: this.#owner.peer.nodeId, reason });
      this.#owner.streamFailed(this, new ConnectionBrokenError(reason), true);
      return;
    }
    this.#queuedBytes = bytes;
    this.#serveQueue.push({ reqId, head: Buffer.from(head) });
  }

  #serveQueued(): void {
    const q = this.#serveQueue;
    while (this.#serveHead < q.length && !this.#overHighWater() && !this.socket.destroyed) {
      const next = q[this.#serveHead] as { reqId: number; head: Buffer };
      q[this.#serveHead++] = undefined as never;
      this.#queuedBytes -= next.head.length + QUEUED_REQUEST_OVERHEAD;
      this.#serveReadv(next.reqId, next.head);
    }
    if (this.#serveHead >= q.length) {
      this.#serveQueue = [];
      this.#serveHead = 0;
      this.#queuedBytes = 0;
      this.maybeEnd();
    } else if (this.#serveHead > 1024 && this.#serveHead * 2 > q.length) {
      this.#serveQueue = q.slice(this.#serveHead);
      this.#serveHead = 0;
    }
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

  #corked = false;

  // --- requesting ----------------------------------------------------------------------

  /** Issue every frame of the batch; settles once all are answered (or quiesced), rejecting with the first error. */
  run(batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    if (this.#sentGoaway || this.#receivedGoaway || this.socket.destroyed) {
      return Promise.reject(new SessionInvalidatedError('connection is retiring or closed; no new requests accepted'));
    }
    const signal = options.signal;
    if (signal.aborted) return Promise.reject(errorFromSignal(signal, 'transfer'));
    let plan: BatchPlan;
    const cap = this.#owner.maxChunkBytes;
    try {
      const cached = plans.get(batch);
      plan = cached !== undefined && cached.cap === cap ? cached : planBatch(batch, cap);
      if (plan !== cached) plans.set(batch, plan);
    } catch (e) {
      return Promise.reject(toTensorwireError(e, InvalidInputError));
    }
    // Re-checked on every post: a registration may have been revoked since the last one.
    for (const g of plan.grants) {
      if (g.revoked) return Promise.reject(new InvalidInputError('local registration is not a live tcp registration'));
    }
    if (plan.frames.length === 0) return Promise.resolve();
    const op: Op = { plan, batch, frames: [], remaining: plan.frames.length, unflushed: 0, error: undefined, cancelError: undefined, settled: false, pinned: true, done: deferred<void>(), signal, onAbort: undefined };
    for (const g of plan.grants) g.acquire(this);
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
      if (len >= ZERO_COPY_MIN_BYTES) {
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

  /** Release a call's local grants once it has settled and the socket no longer reads its memory. */
  #unpin(op: Op, force = false): void {
    if (!op.pinned || (!force && (!op.settled || op.unflushed > 0))) return;
    op.pinned = false;
    this.#ops.delete(op);
    for (const g of op.plan.grants) g.release(this);
  }

  /**
   * Cancel a call: quiesce first. If the socket may still read from its memory (a write not yet
   * flushed), the socket is destroyed and the call settles when it has closed. If libuv holds one
   * of its destinations for the next read, the call settles after that read (or the socket is
   * destroyed if none comes). Otherwise it settles now and late replies are discarded.
   */
  #cancel(op: Op, error: TensorwireError): void {
    if (op.settled || op.cancelError) return;
    op.cancelError = error;
    if (op.plan.write && op.unflushed > 0) {
      // The socket still holds data that reads from the caller's memory: only destroying it
      // stops that. destroy() closes the fd synchronously (uv_close); nothing moves after.
      this.#owner.streamFailed(this, new ConnectionBrokenError(`stream closed to quiesce a cancelled write (${error.message})`), true);
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
    // within the grace period, destroy the socket to take the buffer back.
    this.#armed = op;
    this.#armedTimer = setTimeout(() => {
      if (this.#armed === op) {
        this.#armed = undefined;
        this.#owner.streamFailed(this, new ConnectionBrokenError(`stream closed to quiesce a cancelled read (${error.message})`), true);
      }
    }, CANCEL_GRACE_MS);
  }

  #armed: Op | undefined;
  #armedTimer: NodeJS.Timeout | undefined;

  /** revoke() or revokeGrant() gave up waiting for this socket to stop using a registration or grant. */
  abortForRevoke(): void {
    this.#owner.streamFailed(this, new ConnectionBrokenError('a registration or grant this connection was using was revoked and the transfer did not finish in time'), true);
  }

  /** Called after every read on an onread socket: the buffer libuv held has been used. */
  afterRead(): void {
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
      // A transfer whose own signal already fired (abort, deadline) reports that, not the
      // socket's fate: its other stream may be the one closed to quiesce it.
      this.#settle(op, op.cancelError ?? (op.signal.aborted ? errorFromSignal(op.signal, 'transfer') : error));
      this.#unpin(op, true);
    }
    const w = this.#incomingWrite;
    this.#incomingWrite = undefined;
    if (w?.pinned) for (const g of w.pinned) g.release(this);
    this.#serveQueue = [];
    this.#serveHead = 0;
    this.#queuedBytes = 0;
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
    if (this.#pending.size > 0 || this.#serveHead < this.#serveQueue.length) return;
    this.#ended = true;
    this.socket.end();
  }
}

const REFUSED_REVOKED: Refusal = { code: 'REVOKED', message: 'the grant was revoked', range: NO_RANGE };
const REFUSED_UNKNOWN: Refusal = { code: 'UNKNOWN_GRANT', message: 'no registration or grant has this token', range: NO_RANGE };

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

  execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    if (this.#state === 'closing' || this.#state === 'closed') {
      return Promise.reject(new SessionInvalidatedError(`connection to ${this.peer.nodeId} is closed`, { cause: this.#closeError }));
    }
    const s = this.#streams[stream];
    if (!s) return Promise.reject(new InvalidInputError(`stream ${stream} does not exist (connection has ${this.streams})`));
    if (options.deadline <= Date.now()) return Promise.reject(new TimedOutError('transfer timed out before it started'));
    return s.run(batch, options);
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
  readonly maxQueuedRequests: number;
  readonly maxQueuedRequestBytes: number;
  /** @internal */
  readonly sendBuffers = new SendBufferPool();
  readonly #options: Required<Omit<TcpTransportOptions, 'advertiseHost'>> & { advertiseHost: string | undefined };
  /** Token table: each live registration and range grant, by its token (hex). */
  readonly #tokens = new Map<string, TokenEntry>();
  #rangeGrants = 0;
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
      maxQueuedRequests: options.maxQueuedRequests ?? 65_536,
      maxQueuedRequestBytes: options.maxQueuedRequestBytes ?? 64 * 1024 * 1024,
    };
    for (const f of ['sendHighWaterMark', 'handshakeTimeoutMs', 'retireTimeoutMs', 'revokeGraceMs', 'maxQueuedRequests', 'maxQueuedRequestBytes'] as const) {
      const v = this.#options[f];
      if (!Number.isSafeInteger(v) || v < 1 || v > 0x7fffffff) throw new InvalidInputError(`${f} must be an integer from 1 to 2^31-1, got ${v}`, { details: { field: f } });
    }
    this.maxChunkBytes = maxChunkBytes;
    this.retireTimeoutMs = this.#options.retireTimeoutMs;
    this.sendHighWaterMark = this.#options.sendHighWaterMark;
    this.revokeGraceMs = this.#options.revokeGraceMs;
    this.maxQueuedRequests = this.#options.maxQueuedRequests;
    this.maxQueuedRequestBytes = this.#options.maxQueuedRequestBytes;
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

  /** Entries in the token table: live registrations plus live range grants (one each, whatever its size). */
  get grantCount(): number {
    return this.#tokens.size;
  }

  /** Live range grants (each one entry of {@link grantCount}). */
  get rangeGrantCount(): number {
    return this.#rangeGrants;
  }

  /** @internal for leak tests: live range grants over a registration handle. */
  rangeGrantsOver(handle: object): number {
    return handle instanceof TcpRegistration ? handle.grants.size : 0;
  }

  /** @internal the engine's logger, once started. */
  get logger(): Logger | undefined {
    return this.#logger;
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
    const reg = new TcpRegistration(memory.buffer);
    this.#tokens.set(reg.key, reg);
    return { handle: reg, payload: reg.token.slice() };
  }

  /**
   * Revoke a registration, and every range grant over it: from now on their tokens are
   * answered with REVOKED. Resolves once no socket still sends from or receives into the
   * registration through any of them (see {@link TcpTransportOptions.revokeGraceMs}).
   */
  async revoke(handle: object): Promise<void> {
    if (!(handle instanceof TcpRegistration)) throw new InvalidInputError('not a tcp registration handle');
    const wasLive = this.#retire(handle);
    const dependents: Promise<void>[] = [];
    if (wasLive) for (const g of [...handle.grants]) dependents.push(this.revokeGrant(g));
    await Promise.all([this.#quiesce(handle, wasLive), ...dependents]);
  }

  /**
   * Grant access to ranges of registrations: one 128-bit token and one table entry for all of
   * them. The range table is kept by reference (the engine's private copy, validated by it:
   * ranges inside their registrations, non-empty, non-overlapping); nothing is done per range.
   * The payload is the token alone; peers name a range by its index.
   */
  grant(spec: GrantRanges): TransportRegistration {
    if (this.#closed) throw new ClosedError('tcp transport is closed');
    const { handles, count, ranges } = spec;
    if (!Number.isSafeInteger(count) || count < 1 || count > MAX_WIRE_RANGE_INDEX + 1 || !(ranges instanceof Float64Array) || ranges.length < count * GRANT_STRIDE) {
      throw new InvalidInputError(`a tcp grant needs 1 to ${MAX_WIRE_RANGE_INDEX + 1} ranges of ${GRANT_STRIDE} numbers each`, { details: { field: 'ranges' } });
    }
    if (!Array.isArray(handles) || handles.length === 0) throw new InvalidInputError('a tcp grant needs registration handles', { details: { field: 'handles' } });
    const regs = handles.map((h, k) => {
      if (!(h instanceof TcpRegistration) || h.revoked) throw new InvalidInputError(`handles[${k}] is not a live tcp registration`, { details: { field: 'handles', registration: k } });
      return h;
    });
    const g = new TcpRangeGrant(regs, count, ranges);
    for (const r of regs) r.grants.add(g);
    this.#tokens.set(g.key, g);
    this.#rangeGrants++;
    return { handle: g, payload: g.token.slice() };
  }

  /**
   * Revoke a range grant, O(1) in its number of ranges: its token leaves the table at once (and
   * is answered with REVOKED from then on); resolves once no socket still sends from or
   * receives into memory through this grant, with the same grace as {@link revoke}. Idempotent.
   */
  async revokeGrant(handle: object): Promise<void> {
    if (!(handle instanceof TcpRangeGrant)) throw new InvalidInputError('not a tcp range grant handle');
    const wasLive = this.#retire(handle);
    if (wasLive) {
      for (const r of handle.registrations) r.grants.delete(handle);
      this.#rangeGrants--;
    }
    return this.#quiesce(handle, wasLive);
  }

  /** Take a token out of the table and remember it as revoked (bounded). False if it already was. */
  #retire(entry: TokenEntry): boolean {
    if (entry.revoked) return false;
    entry.revoked = true;
    this.#tokens.delete(entry.key);
    this.#revokedKeys.add(entry.key);
    if (this.#revokedKeys.size > REVOKED_MEMORY) {
      const oldest = this.#revokedKeys.values().next().value as string;
      this.#revokedKeys.delete(oldest);
    }
    return true;
  }

  /** Wait until no socket uses the entry's memory any more; sockets that stall past the grace are closed. */
  async #quiesce(entry: TokenEntry, wasLive: boolean): Promise<void> {
    if (!wasLive || entry.users === 0) return entry.idle();
    // Let sends and receives in progress finish; a peer that stalls them (stops reading, or
    // stops mid-payload) must not hold the memory forever: its sockets are closed.
    const timer = setTimeout(() => {
      for (const stream of entry.streams) stream.abortForRevoke();
    }, this.revokeGraceMs);
    try {
      await entry.idle();
    } finally {
      clearTimeout(timer);
    }
  }

  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths?: Float64Array): unknown {
    if (memoryKind !== 'host') throw new InvalidInputError(`tcp cannot reach ${memoryKind} memory`, { details: { field: 'memoryKind' } });
    if (!(payload instanceof Uint8Array) || payload.length !== TOKEN_BYTES) {
      throw new InvalidInputError(`tcp descriptor payload must be ${TOKEN_BYTES} bytes, got ${payload?.length}`, { details: { field: 'payload' } });
    }
    if (!Number.isSafeInteger(byteLength) || byteLength < 0) throw new InvalidInputError(`byte length ${byteLength} is not a safe integer`, { details: { field: 'byteLength' } });
    if (rangeLengths === undefined) return new RemoteGrant(payload.slice(), byteLength, Float64Array.of(byteLength), false);
    // Kept by reference (the engine's decoded descriptor, checked there); not walked per range.
    if (!(rangeLengths instanceof Float64Array) || rangeLengths.length < 1 || rangeLengths.length > MAX_WIRE_RANGE_INDEX + 1) {
      throw new InvalidInputError(`range lengths must be a Float64Array of 1 to ${MAX_WIRE_RANGE_INDEX + 1} lengths`, { details: { field: 'rangeLengths' } });
    }
    return new RemoteGrant(payload.slice(), byteLength, rangeLengths, true);
  }

  /** @internal responder side: the live entry whose token is at `at` of `head`, or why there is none. One lookup per token per frame. */
  lookupToken(head: Buffer, at: number): TokenEntry | Refusal {
    const key = head.toString('hex', at, at + TOKEN_BYTES);
    const e = this.#tokens.get(key);
    if (!e) return this.#revokedKeys.has(key) ? REFUSED_REVOKED : REFUSED_UNKNOWN;
    if (e.revoked) return REFUSED_REVOKED;
    return e;
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
    for (const e of this.#tokens.values()) e.revoked = true;
    this.#tokens.clear();
    this.#rangeGrants = 0;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
