/**
 * The gallery's reference transport: a complete v2 transport on `node:net` (TCP loopback), kept
 * small so that each of its deliberately broken variants ({@link BUGS}) is one line away from it.
 * The reference passes the conformance suite; every variant must fail it (gallery.test.ts).
 *
 * - Wire: frames `u32 bodyLength | u8 type | u32 id | body`. Handshake frames carry JSON; READ and
 *   WRITE carry a range table (`u32 count`, then per range `u32 slot | 16-byte token | u32 range |
 *   u48 offset | u32 length`), a WRITE followed by the data; DATA carries a READ's bytes in range
 *   order, OK acknowledges a WRITE, ERROR names the refused range, GOAWAY retires a socket.
 * - Handshake with identity proof: every socket sends HELLO (who it is, whom it expects, which
 *   connection and stream it is); the acceptor refuses a HELLO that expects someone else, groups
 *   the sockets of one connection and answers HELLO_OK with its own identity, which the connector
 *   checks against the identity it expected.
 * - Registrations and range grants are entries in a slot table, each with a random 128-bit token;
 *   the payload is `u32 slot | token`. The serving side compares the token (constant time) and
 *   checks every range against the granted range before it sends or accepts a byte.
 * - Replies are sent from the registered memory itself (zero copy, for large ranges): the entry is
 *   pinned until the socket has written them, and revocation waits for that (closing sockets that
 *   stall past a grace). A local revocation waits for the transfers that use the registration.
 * - Abort and deadline: late replies are dropped; a write whose data the socket has not yet taken
 *   has its socket destroyed, and the call settles only after the socket closed (quiesced).
 * - Retire: GOAWAY on every socket; each side ends a socket once both said GOAWAY and its own
 *   requests on it are answered; the peer's in-flight requests are served until then.
 */
import { randomBytes, timingSafeEqual } from 'node:crypto';
import net from 'node:net';
import {
  ClosedError,
  ConnectionBrokenError,
  GRANT_STRIDE,
  GrantField,
  InvalidInputError,
  RANGE_STRIDE,
  RangeField,
  RemoteRejectedError,
  ResourceExhaustedError,
  SessionInvalidatedError,
  TRANSPORT_SPECIFICATION_VERSION,
  errorFromSignal,
  type ConnectOptions,
  type ExecuteOptions,
  type GrantRanges,
  type Memory,
  type MemoryKind,
  type NodeIdentity,
  type TensorwireError,
  type TransferBatch,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
} from '../../src/index.js';

/** The bug classes of the gallery: each variant is the reference with exactly one of them. */
export const BUGS = {
  'no-token-compare': 'the serving side finds a grant by its slot and never compares the token',
  'no-bounds-check': 'the serving side does not check ranges against the granted range',
  'off-by-one': 'the serving side lets a range end one byte past the granted range',
  'no-local-bounds-check': 'execute() trusts the batch\'s local ranges to fit the local registration',
  'ignores-abort': 'execute() never looks at its signal',
  'ignores-deadline-when-stalled': 'execute() notices its signal only when a reply arrives',
  'settles-before-quiesce': 'on abort, execute() rejects but leaves its requests outstanding: late replies land',
  'write-settles-before-flush': 'on abort, execute() rejects while the socket still sends from the caller\'s memory',
  'no-identity-proof': 'the handshake checks neither whom the connector expected nor who answered',
  'abortive-retire': 'retire() is an abortive close()',
  'revoke-does-not-revoke': 'revoke() leaves the token in the table',
  'revoke-does-not-wait': 'revoke() resolves while the socket still sends from the memory',
  'local-revoke-lets-replies-land': 'revoking a local registration does not wait for transfers into it',
  'leaks-socket': 'close() destroys only its first stream\'s socket; the others stay open, idle, forever',
  'leaks-timer': 'the acceptor\'s handshake timer (ref\'d) is not cleared when the handshake completes',
  'leaks-unref-timer': 'the per-connection watchdog (an unref\'d interval) is not cleared on close',
  'drops-queued-work-on-close': 'close() forgets outstanding requests without settling their calls',
  'partial-success-on-peer-death': 'a call with some frames answered resolves when the peer dies',
  'exhausted-after-start': 'ResourceExhaustedError is raised after some frames of the batch were sent',
  'wrong-error-for-dead-peer': 'connect() to a peer that is gone raises InvalidInputError',
} as const;
export type Bug = keyof typeof BUGS;

export interface ReferenceOptions {
  bug?: Bug | undefined;
  /** Default 1 MiB. */
  maxChunkBytes?: number;
  /** Default 4. */
  maxStreams?: number;
  /** Capabilities (default both true). */
  local?: boolean;
  remote?: boolean;
  /** Request frames one socket may have outstanding before execute() answers ResourceExhausted. Default 64. */
  maxFramesInFlight?: number;
  handshakeTimeoutMs?: number;
  retireTimeoutMs?: number;
  revokeGraceMs?: number;
}

const Frame = { Hello: 1, HelloOk: 2, HelloNo: 3, Read: 4, Write: 5, Data: 6, Ok: 7, Error: 8, Goaway: 9 } as const;
const HEADER = 9;
const ENTRY = 34; // slot 4, token 16, range 4, offset 6, length 4
const TOKEN = 16;
const FRAME_DATA = 256 * 1024;
const FRAME_RANGES = 4096;
const ZERO_COPY = 16 * 1024;
const NO_RANGE = 0xffffffff;

function header(type: number, id: number, bodyLength: number): Buffer {
  const h = Buffer.allocUnsafe(HEADER);
  h.writeUInt32LE(bodyLength, 0);
  h.writeUInt8(type, 4);
  h.writeUInt32LE(id, 5);
  return h;
}

function jsonFrame(type: number, value: unknown): Buffer {
  const body = Buffer.from(JSON.stringify(value));
  return Buffer.concat([header(type, 0, body.length), body]);
}

function view(memory: Uint8Array, offset: number, length: number): Uint8Array {
  // Pointer arithmetic, as a native transport does: bounds are the caller's job.
  return new Uint8Array(memory.buffer, memory.byteOffset + offset, length);
}

/** A slot-table entry: a registration (one range, the whole of it) or a range grant. */
class Entry {
  readonly token = randomBytes(TOKEN);
  revoked = false;
  /** Replies being sent from this memory, per socket. */
  readonly senders = new Map<Stream, number>();
  #idle: (() => void)[] = [];
  constructor(
    readonly owner: ReferenceTransport,
    readonly slot: number,
    readonly regs: readonly Registration[],
    readonly count: number,
    readonly ranges: Float64Array,
  ) {}
  get payload(): Uint8Array {
    const p = Buffer.allocUnsafe(4 + TOKEN);
    p.writeUInt32LE(this.slot, 0);
    this.token.copy(p, 4);
    return p;
  }
  pin(s: Stream): void {
    this.senders.set(s, (this.senders.get(s) ?? 0) + 1);
  }
  unpin(s: Stream): void {
    const n = (this.senders.get(s) ?? 1) - 1;
    if (n > 0) this.senders.set(s, n);
    else this.senders.delete(s);
    if (this.senders.size === 0) for (const f of this.#idle.splice(0)) f();
  }
  idle(): Promise<void> {
    return this.senders.size === 0 ? Promise.resolve() : new Promise((r) => this.#idle.push(r));
  }
}

class Registration extends Entry {
  readonly grants = new Set<Entry>();
  /** Calls of this node that move bytes into or out of this memory. */
  readonly ops = new Set<Op>();
  #opsIdle: (() => void)[] = [];
  constructor(owner: ReferenceTransport, slot: number, readonly memory: Uint8Array) {
    super(owner, slot, [], 1, Float64Array.of(0, 0, memory.byteLength));
    (this.regs as Registration[]).push(this);
  }
  opDone(op: Op): void {
    if (this.ops.delete(op) && this.ops.size === 0) for (const f of this.#opsIdle.splice(0)) f();
  }
  opsIdle(): Promise<void> {
    return this.ops.size === 0 ? Promise.resolve() : new Promise((r) => this.#opsIdle.push(r));
  }
}

class Remote {
  constructor(
    readonly slot: number,
    readonly token: Buffer,
  ) {}
}

interface FramePlan {
  readonly start: number;
  readonly end: number;
  readonly bytes: number;
  /** u32 count + range entries. */
  readonly table: Buffer;
}

interface Plan {
  readonly cap: number;
  readonly locals: readonly Registration[];
  readonly frames: readonly FramePlan[];
}

interface Op {
  readonly batch: TransferBatch;
  readonly plan: Plan;
  readonly ids: number[];
  remaining: number;
  answered: number;
  /** Write data the socket has not yet taken. */
  unflushed: number;
  error: TensorwireError | undefined;
  settled: boolean;
  readonly signal: AbortSignal;
  onAbort: (() => void) | undefined;
  resolve(): void;
  reject(e: unknown): void;
}

type Refusal = { code: string; message: string };

/** One socket: a frame parser, the requests this side issued on it, and the peer's it serves. */
class Stream {
  conn: ReferenceConnection | undefined;
  readonly pending = new Map<number, { op: Op; frame: FramePlan }>();
  readonly ops = new Set<Op>();
  #nextId = 1;
  #chunks: Buffer[] = [];
  #have = 0;
  sentGoaway = false;
  gotGoaway = false;
  #ended = false;
  readonly closed: Promise<void>;
  /** Handshake frames go here until the stream belongs to an established connection. */
  onHandshake: ((type: number, body: Buffer) => void) | undefined;

  constructor(
    readonly t: ReferenceTransport,
    readonly socket: net.Socket,
  ) {
    this.closed = new Promise((r) => socket.once('close', () => r()));
    socket.on('data', (c: Buffer) => this.#feed(c));
    socket.on('error', () => undefined); // 'close' follows and reports it
    socket.on('close', (hadError) => this.conn?.streamClosed(this, !hadError && this.sentGoaway && this.gotGoaway && this.pending.size === 0));
  }

  #feed(chunk: Buffer): void {
    this.#chunks.push(chunk);
    this.#have += chunk.length;
    while (this.#have >= HEADER) {
      if ((this.#chunks[0] as Buffer).length < HEADER) this.#chunks = [Buffer.concat(this.#chunks, this.#have)];
      const first = this.#chunks[0] as Buffer;
      const length = first.readUInt32LE(0);
      if (length > this.t.maxFrameBytes) return this.#protocolError(`frame of ${length} bytes is over the limit`);
      if (this.#have < HEADER + length) return;
      const all = this.#chunks.length === 1 ? first : Buffer.concat(this.#chunks, this.#have);
      const rest = all.subarray(HEADER + length);
      this.#chunks = rest.length > 0 ? [rest] : [];
      this.#have = rest.length;
      this.conn?.progress();
      try {
        this.#frame(all.readUInt8(4), all.readUInt32LE(5), all.subarray(HEADER, HEADER + length));
      } catch (e) {
        return this.#protocolError(e instanceof Error ? e.message : String(e));
      }
      if (this.socket.destroyed) return;
    }
  }

  #protocolError(message: string): void {
    if (this.conn) void this.conn.fail(new ConnectionBrokenError(`protocol error from ${this.conn.peer.nodeId}: ${message}`));
    else this.socket.destroy();
  }

  #frame(type: number, id: number, body: Buffer): void {
    if (this.onHandshake) return this.onHandshake(type, body);
    if (!this.conn) throw new Error(`frame ${type} before the handshake`);
    switch (type) {
      case Frame.Read:
        return this.#serveRead(id, body);
      case Frame.Write:
        return this.#serveWrite(id, body);
      case Frame.Data:
      case Frame.Ok:
      case Frame.Error:
        return this.#reply(type, id, body);
      case Frame.Goaway:
        this.gotGoaway = true;
        this.conn.peerRetiring();
        this.sendGoaway();
        return;
      default:
        throw new Error(`unexpected frame type ${type}`);
    }
  }

  // --- serving the peer's requests ---------------------------------------------------------

  /** Check every range of a request table; the views to move, or why not. */
  #resolve(body: Buffer): { views: Uint8Array[]; entries: Set<Entry>; bytes: number } | (Refusal & { range: number }) {
    const n = body.readUInt32LE(0);
    if (n > FRAME_RANGES || body.length < 4 + n * ENTRY) throw new Error('bad range table');
    const views: Uint8Array[] = [];
    const entries = new Set<Entry>();
    let bytes = 0;
    for (let i = 0; i < n; i++) {
      const at = 4 + i * ENTRY;
      const r = this.t.resolve(body.readUInt32LE(at), body.subarray(at + 4, at + 4 + TOKEN), body.readUInt32LE(at + 20), body.readUIntLE(at + 24, 6), body.readUInt32LE(at + 30));
      if (!(r instanceof Uint8Array)) return { ...r, range: i };
      views.push(r);
      bytes += r.length;
    }
    for (let i = 0; i < n; i++) entries.add(this.t.entryAt(body.readUInt32LE(4 + i * ENTRY)) as Entry);
    return { views, entries, bytes };
  }

  #refuse(id: number, r: Refusal & { range: number }): void {
    const json = Buffer.from(JSON.stringify({ code: r.code, message: r.message }));
    const body = Buffer.allocUnsafe(4 + json.length);
    body.writeUInt32LE(r.range, 0);
    json.copy(body, 4);
    this.#send([header(Frame.Error, id, body.length), body]);
  }

  #serveRead(id: number, body: Buffer): void {
    const r = this.#resolve(body);
    if ('code' in r) return this.#refuse(id, r);
    for (const e of r.entries) e.pin(this);
    this.#send([header(Frame.Data, id, r.bytes), ...r.views], () => {
      for (const e of r.entries) e.unpin(this);
    });
  }

  #serveWrite(id: number, body: Buffer): void {
    const r = this.#resolve(body);
    if ('code' in r) return this.#refuse(id, r);
    let at = 4 + body.readUInt32LE(0) * ENTRY;
    if (body.length !== at + r.bytes) throw new Error('write data does not match its range table');
    for (const v of r.views) {
      v.set(body.subarray(at, at + v.length));
      at += v.length;
    }
    this.#send([header(Frame.Ok, id, 0)]);
  }

  /** Write buffers in order; small ones are copied together, large ones go to the socket as they are. */
  #send(parts: Uint8Array[], done?: () => void): void {
    if (this.socket.destroyed) {
      done?.();
      return;
    }
    const out: Uint8Array[] = [];
    let small: Uint8Array[] = [];
    for (const p of parts) {
      if (p.length < ZERO_COPY) {
        small.push(p);
        continue;
      }
      if (small.length > 0) out.push(Buffer.concat(small));
      small = [];
      out.push(p);
    }
    if (small.length > 0) out.push(Buffer.concat(small));
    this.socket.cork();
    // The last write's callback runs once the socket took every byte (or failed).
    out.forEach((b, i) => this.socket.write(b, i === out.length - 1 ? () => done?.() : undefined));
    this.socket.uncork();
  }

  // --- this side's requests ----------------------------------------------------------------

  run(batch: TransferBatch, plan: Plan, options: ExecuteOptions): Promise<void> {
    const bug = this.t.bug;
    return new Promise<void>((resolve, reject) => {
      const op: Op = { batch, plan, ids: [], remaining: plan.frames.length, answered: 0, unflushed: 0, error: undefined, settled: false, signal: options.signal, onAbort: undefined, resolve, reject };
      this.ops.add(op);
      for (const l of plan.locals) l.ops.add(op);
      const write = batch.op === 'write';
      for (const frame of plan.frames) {
        if (bug === 'exhausted-after-start' && this.pending.size >= this.t.maxFramesInFlight) {
          this.ops.delete(op);
          reject(new ResourceExhaustedError('too many requests in flight'));
          return;
        }
        const id = this.#nextId++;
        this.pending.set(id, { op, frame });
        op.ids.push(id);
        if (!write) {
          this.#send([header(Frame.Read, id, frame.table.length), frame.table]);
          continue;
        }
        const parts: Uint8Array[] = [header(Frame.Write, id, frame.table.length + frame.bytes), frame.table];
        const r = batch.ranges;
        for (let i = frame.start; i < frame.end; i++) {
          const at = i * RANGE_STRIDE;
          parts.push(view((plan.locals[r[at + RangeField.Local] as number] as Registration).memory, r[at + RangeField.LocalOffset] as number, r[at + RangeField.Length] as number));
        }
        op.unflushed++;
        this.#send(parts, () => {
          op.unflushed--;
        });
      }
      if (bug !== 'ignores-abort' && bug !== 'ignores-deadline-when-stalled') {
        op.onAbort = () => this.cancel(op, errorFromSignal(op.signal, 'transfer'));
        op.signal.addEventListener('abort', op.onAbort, { once: true });
      }
    });
  }

  /** Give up on a call: its late replies are dropped; a write still being sent costs the socket. */
  cancel(op: Op, error: TensorwireError): void {
    if (op.settled) return;
    if (this.t.bug === 'settles-before-quiesce') return this.settle(op, error);
    for (const id of op.ids) this.pending.delete(id);
    op.error = error;
    if (op.unflushed > 0 && this.t.bug !== 'write-settles-before-flush') {
      // The socket still reads the caller's memory: destroy it; the op settles once it closed.
      (op as { cancelled?: boolean }).cancelled = true;
      void this.conn?.fail(new ConnectionBrokenError('a cancelled write was still being sent; its connection was closed to stop it'));
      return;
    }
    this.settle(op, error);
  }

  settle(op: Op, error: TensorwireError | undefined): void {
    if (op.settled) return;
    op.settled = true;
    this.ops.delete(op);
    if (op.onAbort) op.signal.removeEventListener('abort', op.onAbort);
    for (const l of op.plan.locals) l.opDone(op);
    if (error) op.reject(error);
    else op.resolve();
    this.maybeEnd();
  }

  #reply(type: number, id: number, body: Buffer): void {
    const p = this.pending.get(id);
    if (!p) return; // a late reply to a call that gave up on it
    const { op, frame } = p;
    if (this.t.bug === 'ignores-deadline-when-stalled' && op.signal.aborted) return this.cancel(op, errorFromSignal(op.signal, 'transfer'));
    this.pending.delete(id);
    if (type === Frame.Data) {
      if (body.length !== frame.bytes) throw new Error(`DATA of ${body.length} bytes for a request of ${frame.bytes}`);
      const r = op.batch.ranges;
      let at = 0;
      for (let i = frame.start; i < frame.end; i++) {
        const k = i * RANGE_STRIDE;
        const len = r[k + RangeField.Length] as number;
        view((op.plan.locals[r[k + RangeField.Local] as number] as Registration).memory, r[k + RangeField.LocalOffset] as number, len).set(body.subarray(at, at + len));
        at += len;
      }
    } else if (type === Frame.Error) {
      const range = body.readUInt32LE(0);
      const info = JSON.parse(body.subarray(4).toString()) as Refusal;
      const i = range === NO_RANGE ? undefined : frame.start + range;
      const request = i === undefined ? undefined : op.batch.ranges[i * RANGE_STRIDE + RangeField.Request];
      op.error ??= new RemoteRejectedError(`${this.conn?.peer.nodeId} refused range ${i ?? '?'}: ${info.message}`, { details: { remoteCode: info.code, request } });
    }
    op.answered++;
    if (--op.remaining === 0 && !op.settled) this.settle(op, op.error);
  }

  sendGoaway(): void {
    if (this.sentGoaway || this.socket.destroyed) return;
    this.sentGoaway = true;
    this.#send([header(Frame.Goaway, 0, 0)]);
    this.maybeEnd();
  }

  /** Both sides said GOAWAY and our requests are answered: end our side (the peer's requests were served). */
  maybeEnd(): void {
    if (!this.sentGoaway || !this.gotGoaway || this.#ended || this.pending.size > 0 || this.ops.size > 0) return;
    this.#ended = true;
    this.socket.end();
  }

  send(frame: Buffer): void {
    this.#send([frame]);
  }
}

export class ReferenceConnection implements TransportConnection {
  readonly transport = 'ref';
  maxChunkBytes: number;
  readonly streamList: Stream[] = [];
  #state: 'open' | 'retiring' | 'closing' | 'closed' = 'open';
  #error: TensorwireError | undefined;
  #closed: Promise<void> | undefined;
  #retired: Promise<void> | undefined;
  readonly #closeListeners: ((e: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  readonly #done = new Set<Stream>();
  #lastProgress = Date.now();
  #watchdog: NodeJS.Timeout;

  constructor(
    readonly t: ReferenceTransport,
    readonly peer: NodeIdentity,
    readonly initiator: string,
    readonly streams: number,
    maxChunkBytes: number,
  ) {
    this.maxChunkBytes = maxChunkBytes;
    // A retiring connection that stops making progress is closed abortively.
    this.#watchdog = setInterval(() => {
      if (this.#state === 'retiring' && Date.now() - this.#lastProgress > t.retireTimeoutMs) void this.fail(new ConnectionBrokenError('retirement made no progress'));
    }, Math.max(10, t.retireTimeoutMs / 2));
    this.#watchdog.unref();
  }

  get isOpen(): boolean {
    return this.#state === 'open';
  }

  progress(): void {
    this.#lastProgress = Date.now();
  }

  execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    if (this.#state === 'closing' || this.#state === 'closed') return Promise.reject(new SessionInvalidatedError(`connection to ${this.peer.nodeId} is closed`, { cause: this.#error }));
    const s = this.streamList[stream];
    if (!s) return Promise.reject(new InvalidInputError(`stream ${stream} does not exist (connection has ${this.streams})`));
    if (s.sentGoaway || s.gotGoaway) return Promise.reject(new SessionInvalidatedError(`connection to ${this.peer.nodeId} is retiring; no new requests`));
    if (this.t.bug !== 'ignores-abort' && options.signal.aborted) return Promise.reject(errorFromSignal(options.signal, 'transfer'));
    let plan: Plan;
    try {
      plan = this.t.plan(batch, this.maxChunkBytes);
    } catch (e) {
      return Promise.reject(e);
    }
    for (const l of plan.locals) if (l.revoked) return Promise.reject(new InvalidInputError('a local registration of the batch was revoked'));
    if (this.t.bug !== 'exhausted-after-start' && s.pending.size >= this.t.maxFramesInFlight) {
      return Promise.reject(new ResourceExhaustedError(`${s.pending.size} requests in flight on stream ${stream}`));
    }
    return s.run(batch, plan, options);
  }

  onClose(listener: (error: TensorwireError | undefined) => void): void {
    if (this.#state === 'closed') queueMicrotask(() => listener(this.#error));
    else this.#closeListeners.push(listener);
  }

  onRetire(listener: () => void): void {
    this.#retireListeners.push(listener);
  }

  peerRetiring(): void {
    if (this.#state !== 'open') return;
    this.#state = 'retiring';
    for (const l of this.#retireListeners.splice(0)) l();
  }

  retire(): Promise<void> {
    if (this.t.bug === 'abortive-retire') return this.close(new ClosedError('retired'));
    if (this.#retired) return this.#retired;
    if (this.#state === 'open') this.#state = 'retiring';
    this.#retired = new Promise<void>((r) => this.onClose(() => r()));
    for (const s of this.streamList) s.sendGoaway();
    return this.#retired;
  }

  streamClosed(s: Stream, orderly: boolean): void {
    if (!orderly) return void this.fail(new ConnectionBrokenError(`connection to ${this.peer.nodeId} broke (a socket closed)`));
    this.#done.add(s);
    if (this.streamList.every((x) => this.#done.has(x))) void this.#finish(undefined);
  }

  close(error?: TensorwireError): Promise<void> {
    return this.#finish(error ?? new ClosedError(`connection to ${this.peer.nodeId} closed`), true);
  }

  fail(error: TensorwireError): Promise<void> {
    return this.#finish(error);
  }

  /** Stop every socket, wait until they closed (nothing touches memory any more), then settle every call. */
  #finish(error: TensorwireError | undefined, byClose = false): Promise<void> {
    if (this.#closed) return this.#closed;
    const bug = this.t.bug;
    this.#state = 'closing';
    this.#error = error;
    if (bug !== 'leaks-unref-timer') clearInterval(this.#watchdog);
    const stopping = bug === 'leaks-socket' ? this.streamList.slice(0, 1) : this.streamList;
    for (const s of stopping) s.socket.destroy();
    const closed = Promise.all(stopping.map((s) => s.closed));
    this.#closed = closed.then(() => {
      this.#state = 'closed';
      const failWith = error ?? new SessionInvalidatedError(`connection to ${this.peer.nodeId} was retired`);
      for (const s of this.streamList) {
        if (bug === 'drops-queued-work-on-close' && byClose) {
          s.pending.clear();
          s.ops.clear();
          continue;
        }
        for (const op of [...s.ops]) {
          if (bug === 'partial-success-on-peer-death' && op.answered > 0 && !(op as { cancelled?: boolean }).cancelled) s.settle(op, undefined);
          else s.settle(op, op.error ?? failWith);
        }
        s.pending.clear();
      }
      this.t.forget(this);
      for (const l of this.#closeListeners.splice(0)) l(error);
    });
    return this.#closed;
  }
}

interface Hello {
  node: string;
  inc: string;
  hostId: string;
  expectNode: string;
  expectInc: string;
  conn: string;
  index: number;
  count: number;
  maxChunk: number;
}

export function encodeReferenceEndpoint(host: string, port: number): Uint8Array {
  return Buffer.from(JSON.stringify({ ref: 1, host, port }));
}

export function decodeReferenceEndpoint(blob: Uint8Array): { host: string; port: number } {
  let v: unknown;
  try {
    v = JSON.parse(Buffer.from(blob).toString());
  } catch {
    throw new InvalidInputError('not a ref endpoint');
  }
  const e = v as { ref?: unknown; host?: unknown; port?: unknown };
  if (e.ref !== 1 || typeof e.host !== 'string' || net.isIP(e.host) === 0 || !Number.isInteger(e.port) || (e.port as number) < 1 || (e.port as number) > 65535) {
    throw new InvalidInputError('not a ref endpoint');
  }
  return { host: e.host, port: e.port as number };
}

export class ReferenceTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name = 'ref';
  readonly capabilities: TransportCapabilities;
  readonly bug: Bug | undefined;
  readonly maxChunkBytes: number;
  readonly maxFrameBytes: number;
  readonly maxFramesInFlight: number;
  readonly retireTimeoutMs: number;
  readonly #opts: ReferenceOptions;
  readonly #slots = new Map<number, Entry>();
  #nextSlot = 1;
  readonly #connections = new Set<ReferenceConnection>();
  readonly #handshaking = new Map<string, { peer: NodeIdentity; count: number; streams: Stream[]; arrived: number; maxChunk: number; timer: NodeJS.Timeout }>();
  readonly #sockets = new Set<net.Socket>();
  readonly #plans = new WeakMap<TransferBatch, Plan>();
  #server: net.Server | undefined;
  #host: TransportHost | undefined;
  #endpoint: Uint8Array | undefined;
  #closed: Promise<void> | undefined;

  constructor(options: ReferenceOptions = {}) {
    this.#opts = options;
    this.bug = options.bug;
    this.maxChunkBytes = options.maxChunkBytes ?? 1024 * 1024;
    this.maxFrameBytes = 4 + FRAME_RANGES * ENTRY + Math.max(FRAME_DATA, this.maxChunkBytes) + 1024;
    this.maxFramesInFlight = options.maxFramesInFlight ?? 64;
    this.retireTimeoutMs = options.retireTimeoutMs ?? 5000;
    this.capabilities = {
      local: options.local ?? true,
      remote: options.remote ?? true,
      memoryKinds: ['host'],
      oneSidedRead: true,
      oneSidedWrite: true,
      scopedGrants: true,
      rank: 1,
      maxStreams: options.maxStreams ?? 4,
      maxChunkBytes: this.maxChunkBytes,
    };
  }

  async start(host: TransportHost): Promise<void> {
    this.#host = host;
    const server = net.createServer({ noDelay: true }, (socket) => this.#accept(socket));
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(0, '127.0.0.1', () => resolve());
    });
    this.#server = server;
    this.#endpoint = encodeReferenceEndpoint('127.0.0.1', (server.address() as net.AddressInfo).port);
  }

  endpoint(): Uint8Array {
    if (!this.#endpoint) throw new ClosedError('ref transport is not started');
    return this.#endpoint;
  }

  unreachableReason(_peer: NodeIdentity, endpoint: Uint8Array): string | undefined {
    try {
      decodeReferenceEndpoint(endpoint);
      return undefined;
    } catch (e) {
      return (e as Error).message;
    }
  }

  async register(memory: Memory): Promise<TransportRegistration> {
    if (this.#closed) throw new ClosedError('ref transport is closed');
    if (memory.kind !== 'host') throw new InvalidInputError(`ref moves host memory only, not ${memory.kind}`);
    const reg = new Registration(this, this.#nextSlot++, memory.buffer);
    this.#slots.set(reg.slot, reg);
    return { handle: reg, payload: reg.payload };
  }

  async revoke(handle: object): Promise<void> {
    if (!(handle instanceof Registration) || handle.owner !== this) throw new InvalidInputError('not a ref registration');
    await Promise.all([...handle.grants].map((g) => this.revokeGrant(g)));
    // A local revocation waits for this node's transfers into or out of the memory.
    const local = this.bug === 'local-revoke-lets-replies-land' ? Promise.resolve() : handle.opsIdle();
    await Promise.all([this.#revokeEntry(handle), local]);
  }

  grant(spec: GrantRanges): TransportRegistration {
    if (this.#closed) throw new ClosedError('ref transport is closed');
    const regs = spec.handles.map((h) => {
      if (!(h instanceof Registration) || h.owner !== this || h.revoked) throw new InvalidInputError('grant over something that is not a live ref registration');
      return h;
    });
    const g = new Entry(this, this.#nextSlot++, regs, spec.count, spec.ranges);
    for (const r of regs) r.grants.add(g);
    this.#slots.set(g.slot, g);
    return { handle: g, payload: g.payload };
  }

  async revokeGrant(handle: object): Promise<void> {
    if (!(handle instanceof Entry) || handle instanceof Registration || handle.owner !== this) throw new InvalidInputError('not a ref grant');
    for (const r of handle.regs) r.grants.delete(handle);
    return this.#revokeEntry(handle);
  }

  /** Out of the table at once; resolves when no socket still sends from the memory (a stalled one is closed after the grace). */
  async #revokeEntry(e: Entry): Promise<void> {
    if (this.bug !== 'revoke-does-not-revoke') {
      e.revoked = true;
      this.#slots.delete(e.slot);
    }
    if (this.bug === 'revoke-does-not-wait' || e.senders.size === 0) return;
    const timer = setTimeout(() => {
      for (const s of e.senders.keys()) void s.conn?.fail(new ConnectionBrokenError('revoked memory was still being sent after the grace'));
    }, this.#opts.revokeGraceMs ?? 1000);
    await e.idle();
    clearTimeout(timer);
  }

  entryAt(slot: number): Entry | undefined {
    return this.#slots.get(slot);
  }

  /** Serving side: the memory a peer's range names, or why it may not have it. */
  resolve(slot: number, token: Buffer, k: number, offset: number, length: number): Uint8Array | Refusal {
    const e = this.#slots.get(slot);
    if (!e || (this.bug !== 'no-token-compare' && !timingSafeEqual(e.token, token))) return { code: 'UNKNOWN_GRANT', message: 'no grant has this token' };
    if (e.revoked) return { code: 'REVOKED', message: 'the grant was revoked' };
    const at = k * GRANT_STRIDE;
    const rangeLength = e.ranges[at + GrantField.Length] as number;
    const slack = this.bug === 'off-by-one' ? 1 : 0;
    if (this.bug !== 'no-bounds-check' && (k >= e.count + slack || offset + length > rangeLength + slack)) {
      return { code: 'OUT_OF_RANGE', message: `${offset}+${length} is outside granted range ${k}` };
    }
    const reg = e.regs[e.ranges[at + GrantField.Handle] as number];
    try {
      return view((reg as Registration).memory, (e.ranges[at + GrantField.Offset] as number) + offset, length);
    } catch {
      return { code: 'OUT_OF_RANGE', message: 'outside the memory' };
    }
  }

  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, _byteLength: number): unknown {
    if (memoryKind !== 'host') throw new InvalidInputError(`ref cannot reach ${memoryKind} memory`);
    if (!(payload instanceof Uint8Array) || payload.length !== 4 + TOKEN) throw new InvalidInputError('a ref payload is 20 bytes');
    const b = Buffer.from(payload);
    return new Remote(b.readUInt32LE(0), Buffer.from(b.subarray(4)));
  }

  /** Check a batch (tables, lengths, local bounds) and encode its request tables, once per batch. */
  plan(batch: TransferBatch, cap: number): Plan {
    const cached = this.#plans.get(batch);
    if (cached && cached.cap === cap) return cached;
    const locals = batch.locals.map((l) => {
      if (!(l instanceof Registration) || l.owner !== this) throw new InvalidInputError('local is not a registration of this ref transport');
      return l;
    });
    const remotes = batch.remotes.map((m) => {
      if (!(m instanceof Remote)) throw new InvalidInputError('remote is not a decoded ref descriptor');
      return m;
    });
    const r = batch.ranges;
    const frames: FramePlan[] = [];
    let start = 0;
    let bytes = 0;
    const close = (end: number): void => {
      const table = Buffer.allocUnsafe(4 + (end - start) * ENTRY);
      table.writeUInt32LE(end - start, 0);
      for (let i = start; i < end; i++) {
        const at = i * RANGE_STRIDE;
        const e = 4 + (i - start) * ENTRY;
        const m = remotes[r[at + RangeField.Remote] as number] as Remote;
        table.writeUInt32LE(m.slot, e);
        m.token.copy(table, e + 4);
        table.writeUInt32LE(r[at + RangeField.RemoteRange] as number, e + 20);
        table.writeUIntLE(r[at + RangeField.RemoteOffset] as number, e + 24, 6);
        table.writeUInt32LE(r[at + RangeField.Length] as number, e + 30);
      }
      frames.push({ start, end, bytes, table });
      start = end;
      bytes = 0;
    };
    for (let i = 0; i < batch.count; i++) {
      const at = i * RANGE_STRIDE;
      const l = r[at + RangeField.Local] as number;
      const lo = r[at + RangeField.LocalOffset] as number;
      const len = r[at + RangeField.Length] as number;
      const local = locals[l];
      if (!local || !remotes[r[at + RangeField.Remote] as number]) throw new InvalidInputError(`range ${i}: local or remote index out of the batch tables`, { details: { request: r[at + RangeField.Request] } });
      if (!Number.isInteger(len) || len < 1 || len > cap) throw new InvalidInputError(`range ${i}: length ${len} is not 1..${cap}`, { details: { request: r[at + RangeField.Request] } });
      if (this.bug !== 'no-local-bounds-check' && !(Number.isSafeInteger(lo) && lo >= 0 && lo + len <= local.memory.byteLength)) {
        throw new InvalidInputError(`range ${i}: ${lo}+${len} does not fit the local registration`, { details: { request: r[at + RangeField.Request] } });
      }
      if (i > start && (i - start >= FRAME_RANGES || bytes + len > FRAME_DATA)) close(i);
      bytes += len;
    }
    if (batch.count > start) close(batch.count);
    const plan = { cap, locals, frames };
    this.#plans.set(batch, plan);
    return plan;
  }

  async connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    const host = this.#host;
    if (this.#closed || !host) throw new ClosedError('ref transport is closed or not started');
    const { host: address, port } = decodeReferenceEndpoint(endpoint);
    const { signal } = options;
    if (signal.aborted) throw errorFromSignal(signal, `connect to ${peer.nodeId}`);
    const count = Math.max(1, Math.min(options.streams, this.capabilities.maxStreams));
    const connId = randomBytes(16).toString('hex');
    const me = host.identity;
    const conn = new ReferenceConnection(this, peer, me.nodeId, count, this.maxChunkBytes);
    const streams: Stream[] = [];
    let onAbort: (() => void) | undefined;
    try {
      await new Promise<void>((resolve, reject) => {
        onAbort = () => reject(errorFromSignal(signal, `connect to ${peer.nodeId}`));
        signal.addEventListener('abort', onAbort, { once: true });
        let ok = 0;
        for (let index = 0; index < count; index++) {
          const socket = net.connect({ host: address, port, noDelay: true });
          this.#track(socket);
          const s = new Stream(this, socket);
          streams.push(s);
          socket.once('error', (e: NodeJS.ErrnoException) => {
            if (this.bug === 'wrong-error-for-dead-peer') reject(new InvalidInputError(`cannot reach ${address}:${port}: ${e.code ?? e.message}`));
            else reject(new ConnectionBrokenError(`cannot connect to ${address}:${port}: ${e.code ?? e.message}`, { cause: e }));
          });
          socket.once('close', () => reject(new ConnectionBrokenError(`connection to ${address}:${port} closed during the handshake`)));
          socket.once('connect', () => {
            const hello: Hello = { node: me.nodeId, inc: me.incarnation, hostId: me.hostId, expectNode: peer.nodeId, expectInc: peer.incarnation, conn: connId, index, count, maxChunk: this.maxChunkBytes };
            s.send(jsonFrame(Frame.Hello, hello));
          });
          s.onHandshake = (type, body) => {
            const info = JSON.parse(body.toString()) as { node?: string; inc?: string; maxChunk?: number; code?: string; message?: string };
            if (type === Frame.HelloNo) return reject(new ConnectionBrokenError(`${address}:${port} refused the connection: ${info.message}`, { details: { remoteCode: info.code } }));
            if (type !== Frame.HelloOk) return reject(new ConnectionBrokenError(`unexpected frame ${type} in the handshake`));
            if (this.bug !== 'no-identity-proof' && (info.node !== peer.nodeId || info.inc !== peer.incarnation)) {
              return reject(new ConnectionBrokenError(`${address}:${port} is ${info.node} incarnation ${info.inc}, not ${peer.nodeId} incarnation ${peer.incarnation}`));
            }
            conn.maxChunkBytes = Math.min(conn.maxChunkBytes, Number(info.maxChunk) || conn.maxChunkBytes);
            // Frames after HELLO_OK (a GOAWAY, the peer's first requests) belong to the connection.
            s.onHandshake = undefined;
            s.conn = conn;
            conn.streamList[index] = s;
            if (++ok === count) resolve();
          };
        }
      });
    } catch (e) {
      for (const s of streams) s.socket.destroy();
      await Promise.all([conn.close(new ConnectionBrokenError('handshake failed')), ...streams.map((s) => s.closed)]);
      throw e;
    } finally {
      if (onAbort) signal.removeEventListener('abort', onAbort);
    }
    this.#connections.add(conn);
    return conn;
  }

  #accept(socket: net.Socket): void {
    this.#track(socket);
    const host = this.#host;
    if (this.#closed || !host) return void socket.destroy();
    const s = new Stream(this, socket);
    const timer = setTimeout(() => socket.destroy(), this.#opts.handshakeTimeoutMs ?? 5000);
    socket.once('close', () => clearTimeout(timer));
    const refuse = (code: string, message: string): void => {
      s.onHandshake = () => undefined;
      socket.end(jsonFrame(Frame.HelloNo, { code, message }));
    };
    s.onHandshake = (type, body) => {
      clearTimeout(timer);
      if (type !== Frame.Hello) return refuse('BAD_HELLO', 'expected HELLO');
      const h = JSON.parse(body.toString()) as Hello;
      const me = host.identity;
      if (typeof h.node !== 'string' || typeof h.inc !== 'string' || typeof h.hostId !== 'string' || typeof h.conn !== 'string' || !Number.isInteger(h.index) || !Number.isInteger(h.count) || h.count < 1 || h.count > this.capabilities.maxStreams || h.index < 0 || h.index >= h.count) {
        return refuse('BAD_HELLO', 'malformed HELLO');
      }
      if (this.bug !== 'no-identity-proof' && (h.expectNode !== me.nodeId || h.expectInc !== me.incarnation)) {
        return refuse('WRONG_PEER', `this is ${me.nodeId} incarnation ${me.incarnation}, not ${h.expectNode} incarnation ${h.expectInc}`);
      }
      let g = this.#handshaking.get(h.conn);
      if (!g) {
        const key = h.conn;
        g = {
          peer: { nodeId: h.node, incarnation: h.inc, hostId: h.hostId },
          count: h.count,
          streams: [],
          arrived: 0,
          maxChunk: Math.min(this.maxChunkBytes, Number(h.maxChunk) || this.maxChunkBytes),
          timer: setTimeout(() => {
            const late = this.#handshaking.get(key);
            if (late === undefined || late !== g) return;
            this.#handshaking.delete(key);
            for (const x of late.streams) x.socket.destroy();
          }, this.#opts.handshakeTimeoutMs ?? 5000),
        };
        this.#handshaking.set(key, g);
      } else if (g.peer.nodeId !== h.node || g.peer.incarnation !== h.inc || g.count !== h.count || g.streams[h.index]) {
        return refuse('BAD_HELLO', 'HELLO does not match its connection');
      }
      g.streams[h.index] = s;
      s.onHandshake = () => refuse('BAD_HELLO', 'frame before the connection was complete');
      if (++g.arrived < g.count) return;
      this.#handshaking.delete(h.conn);
      if (this.bug !== 'leaks-timer') clearTimeout(g.timer);
      const conn = new ReferenceConnection(this, g.peer, g.peer.nodeId, g.count, g.maxChunk);
      for (const [i, x] of g.streams.entries()) {
        x.onHandshake = undefined;
        x.conn = conn;
        conn.streamList[i] = x;
        x.send(jsonFrame(Frame.HelloOk, { node: me.nodeId, inc: me.incarnation, hostId: me.hostId, maxChunk: this.maxChunkBytes }));
      }
      this.#connections.add(conn);
      host.inbound(conn);
    };
  }

  #track(socket: net.Socket): void {
    this.#sockets.add(socket);
    socket.once('close', () => this.#sockets.delete(socket));
  }

  forget(conn: ReferenceConnection): void {
    this.#connections.delete(conn);
  }

  close(): Promise<void> {
    this.#closed ??= (async () => {
      this.#server?.close();
      for (const g of this.#handshaking.values()) clearTimeout(g.timer);
      this.#handshaking.clear();
      await Promise.all([...this.#connections].map((c) => c.close(new ClosedError('ref transport closed'))));
      for (const s of this.#sockets) s.destroy();
    })();
    return this.#closed;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

/** For the suite's relay cases: a ref endpoint names a TCP address. */
export const referenceSocketAddress = {
  decode: (blob: Uint8Array): { host: string; port: number } => decodeReferenceEndpoint(blob),
  encode(address: { host: string; port: number } | { path: string }): Uint8Array {
    if (!('host' in address)) throw new InvalidInputError('ref listens on TCP');
    return encodeReferenceEndpoint(address.host, address.port);
  },
};
