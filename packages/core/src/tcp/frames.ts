/**
 * The TCP transport's wire protocol, version 1. All integers big-endian.
 *
 * Every frame: a 12-byte header
 *   u8 version (1) | u8 type | u16 reserved (0) | u32 request id | u32 body length
 * followed by the body.
 *
 *   HELLO      0x10  body: "TWH1" | 16-byte connection id | u8 stream index | u8 stream count
 *                    | str8 nodeId | str8 incarnation | str8 hostId
 *                    | str8 expected peer nodeId | str8 expected peer incarnation | u32 max chunk bytes
 *   HELLO_ACK  0x11  body: str8 nodeId | str8 incarnation | str8 hostId | u32 max chunk bytes
 *   READ_REQ   0x01  body: 16-byte grant token | u64 offset | u32 length
 *   WRITE_REQ  0x02  body: 16-byte grant token | u64 offset | data (body length - 24 bytes)
 *   READ_DATA  0x03  body: exactly the requested bytes
 *   WRITE_ACK  0x04  body: empty
 *   ERROR      0x05  body: str8 code | u16 length | UTF-8 message
 *   GOAWAY     0x06  body: empty; the sender will issue no more requests on this socket
 *
 * Identity fields are validated (owner names, incarnation tokens). The dialer must name the
 * exact node and incarnation it expects, as published in its endpoint. TCP itself proves no
 * identity: run it on a trusted network, as with NIXL's or UCX's TCP paths.
 *
 * The parser never reads past the frame it is in, so the bytes of READ_DATA and WRITE_REQ
 * can be received straight into their destination (`nextBuffer()` / `commit()`).
 */
import { ByteReader, ByteWriter } from '../codec.js';
import { InvalidInputError } from '../errors.js';
import { isToken, ownerProblem } from '../ids.js';

function checkIdentity(what: string, nodeId: string, incarnation: string, hostId?: string): void {
  const problem = ownerProblem(nodeId);
  if (problem !== undefined) throw new InvalidInputError(`${what}: ${problem}`, { details: { field: 'nodeId' } });
  if (!isToken(incarnation)) throw new InvalidInputError(`${what}: malformed incarnation`, { details: { field: 'incarnation' } });
  if (hostId !== undefined && !isToken(hostId)) throw new InvalidInputError(`${what}: malformed host id`, { details: { field: 'hostId' } });
}

export const PROTOCOL_VERSION = 1;
export const HEADER_BYTES = 12;
export const TOKEN_BYTES = 16;
export const WRITE_HEAD_BYTES = TOKEN_BYTES + 8;
export const READ_REQ_BYTES = TOKEN_BYTES + 8 + 4;
/** Control frames (everything but READ_DATA and WRITE_REQ data) are small. */
export const MAX_CONTROL_BODY = 4096;

export const FrameType = {
  ReadReq: 0x01,
  WriteReq: 0x02,
  ReadData: 0x03,
  WriteAck: 0x04,
  Error: 0x05,
  Goaway: 0x06,
  Hello: 0x10,
  HelloAck: 0x11,
} as const;
export type FrameType = (typeof FrameType)[keyof typeof FrameType];
const KNOWN_TYPES: ReadonlySet<number> = new Set(Object.values(FrameType));

export function frameHeader(type: FrameType, reqId: number, bodyLength: number): Buffer {
  const b = Buffer.allocUnsafe(HEADER_BYTES);
  b.writeUInt8(PROTOCOL_VERSION, 0);
  b.writeUInt8(type, 1);
  b.writeUInt16BE(0, 2);
  b.writeUInt32BE(reqId >>> 0, 4);
  b.writeUInt32BE(bodyLength >>> 0, 8);
  return b;
}

export function encodeReadReq(reqId: number, token: Uint8Array, offset: number, length: number): Buffer {
  const b = Buffer.allocUnsafe(HEADER_BYTES + READ_REQ_BYTES);
  frameHeader(FrameType.ReadReq, reqId, READ_REQ_BYTES).copy(b, 0);
  b.set(token, HEADER_BYTES);
  b.writeBigUInt64BE(BigInt(offset), HEADER_BYTES + TOKEN_BYTES);
  b.writeUInt32BE(length, HEADER_BYTES + TOKEN_BYTES + 8);
  return b;
}

/** Header and the 24-byte write head; the data follows as a separate write (no copy). */
export function encodeWriteHead(reqId: number, token: Uint8Array, offset: number, length: number): Buffer {
  const b = Buffer.allocUnsafe(HEADER_BYTES + WRITE_HEAD_BYTES);
  frameHeader(FrameType.WriteReq, reqId, WRITE_HEAD_BYTES + length).copy(b, 0);
  b.set(token, HEADER_BYTES);
  b.writeBigUInt64BE(BigInt(offset), HEADER_BYTES + TOKEN_BYTES);
  return b;
}

export function encodeError(reqId: number, code: string, message: string): Buffer {
  const msg = Buffer.from(message.slice(0, 1000), 'utf8');
  const body = new ByteWriter(32 + msg.length).str8(code).blob16(msg).finish();
  return Buffer.concat([frameHeader(FrameType.Error, reqId, body.length), body]);
}

export function decodeError(body: Uint8Array): { code: string; message: string } {
  const r = new ByteReader(body, 'ERROR frame');
  const code = r.str8('code');
  const message = Buffer.from(r.blob16('message')).toString('utf8');
  r.end();
  return { code, message };
}

export interface Hello {
  readonly connectionId: Uint8Array;
  readonly streamIndex: number;
  readonly streamCount: number;
  readonly nodeId: string;
  readonly incarnation: string;
  readonly hostId: string;
  readonly expectedNodeId: string;
  readonly expectedIncarnation: string;
  readonly maxChunkBytes: number;
}

const HELLO_MAGIC = [0x54, 0x57, 0x48, 0x31]; // TWH1

export function encodeHello(h: Hello): Buffer {
  const w = new ByteWriter(128);
  for (const m of HELLO_MAGIC) w.u8(m);
  w.bytes(h.connectionId).u8(h.streamIndex).u8(h.streamCount);
  w.str8(h.nodeId).str8(h.incarnation).str8(h.hostId).str8(h.expectedNodeId).str8(h.expectedIncarnation).u32(h.maxChunkBytes);
  const body = w.finish();
  return Buffer.concat([frameHeader(FrameType.Hello, 0, body.length), body]);
}

export function decodeHello(body: Uint8Array): Hello {
  const r = new ByteReader(body, 'HELLO frame');
  for (const m of HELLO_MAGIC) if (r.u8('magic') !== m) throw new InvalidInputError('HELLO frame has a bad magic', { details: { field: 'magic' } });
  const connectionId = r.bytes(16, 'connection id').slice();
  const streamIndex = r.u8('stream index');
  const streamCount = r.u8('stream count');
  if (streamCount === 0 || streamIndex >= streamCount) {
    throw new InvalidInputError(`HELLO stream ${streamIndex} of ${streamCount} is impossible`, { details: { field: 'stream' } });
  }
  const h = {
    connectionId,
    streamIndex,
    streamCount,
    nodeId: r.str8('node id'),
    incarnation: r.str8('incarnation'),
    hostId: r.str8('host id'),
    expectedNodeId: r.str8('expected node id'),
    expectedIncarnation: r.str8('expected incarnation'),
    maxChunkBytes: r.u32('max chunk bytes'),
  };
  r.end();
  checkIdentity('HELLO', h.nodeId, h.incarnation, h.hostId);
  checkIdentity('HELLO (expected peer)', h.expectedNodeId, h.expectedIncarnation);
  if (h.maxChunkBytes === 0) throw new InvalidInputError('HELLO max chunk bytes is 0', { details: { field: 'maxChunkBytes' } });
  return h;
}

export function encodeHelloAck(nodeId: string, incarnation: string, hostId: string, maxChunkBytes: number): Buffer {
  const body = new ByteWriter(64).str8(nodeId).str8(incarnation).str8(hostId).u32(maxChunkBytes).finish();
  return Buffer.concat([frameHeader(FrameType.HelloAck, 0, body.length), body]);
}

export function decodeHelloAck(body: Uint8Array): { nodeId: string; incarnation: string; hostId: string; maxChunkBytes: number } {
  const r = new ByteReader(body, 'HELLO_ACK frame');
  const v = { nodeId: r.str8('node id'), incarnation: r.str8('incarnation'), hostId: r.str8('host id'), maxChunkBytes: r.u32('max chunk bytes') };
  r.end();
  checkIdentity('HELLO_ACK', v.nodeId, v.incarnation, v.hostId);
  if (v.maxChunkBytes === 0) throw new InvalidInputError('HELLO_ACK max chunk bytes is 0', { details: { field: 'maxChunkBytes' } });
  return v;
}

export function decodeReadReq(body: Uint8Array): { token: Uint8Array; offset: number; length: number } {
  const r = new ByteReader(body, 'READ_REQ frame');
  const token = r.bytes(TOKEN_BYTES, 'token');
  const offset = r.safeU64('offset');
  const length = r.u32('length');
  r.end();
  return { token, offset, length };
}

export function decodeWriteHead(head: Uint8Array): { token: Uint8Array; offset: number } {
  const r = new ByteReader(head, 'WRITE_REQ head');
  const token = r.bytes(TOKEN_BYTES, 'token');
  const offset = r.safeU64('offset');
  r.end();
  return { token, offset };
}

/** What the parser asks its owner. */
export interface FrameSink {
  /** A complete control frame (or READ_REQ). */
  onControl(type: FrameType, reqId: number, body: Uint8Array): void;
  /** Where the `length` data bytes of a READ_DATA frame go, or undefined to discard them. */
  readTarget(reqId: number, length: number): Uint8Array | undefined;
  /** Where the data of a WRITE_REQ goes, or undefined to discard it (the sink answers with ERROR later). */
  writeTarget(reqId: number, head: Uint8Array, length: number): Uint8Array | undefined;
  /** The data of a READ_DATA or WRITE_REQ frame has fully arrived (`discarded` if it went nowhere). */
  onDataDone(type: FrameType, reqId: number, discarded: boolean): void;
}

const enum State {
  Header,
  Body,
  WriteHead,
  Data,
  Failed,
}

/**
 * Incremental frame parser. `nextBuffer()` returns exactly the bytes the current state still
 * needs (never more), so a socket can `recv` straight into destination memory.
 * Throws InvalidInputError on any malformed header (the connection must then be dropped).
 */
export class FrameParser {
  #sink: FrameSink | undefined;
  readonly #maxData: number;
  readonly #header = Buffer.alloc(HEADER_BYTES);
  readonly #writeHead = Buffer.alloc(WRITE_HEAD_BYTES);
  readonly #scratch: Buffer;
  #state: State = State.Header;
  #have = 0;
  #type: FrameType = FrameType.ReadReq;
  #reqId = 0;
  #bodyLength = 0;
  #body: Buffer = Buffer.alloc(0);
  #target: Uint8Array | undefined;
  #dataLength = 0;

  constructor(sink: FrameSink | undefined, maxDataBytes: number) {
    this.#sink = sink;
    this.#maxData = maxDataBytes;
    this.#scratch = Buffer.allocUnsafe(64 * 1024);
  }

  /** Attach the sink when it could not exist yet at construction (a socket reading into this parser). */
  set sink(sink: FrameSink) {
    this.#sink = sink;
  }

  get #s(): FrameSink {
    if (!this.#sink) throw new InvalidInputError('frame parser has no sink');
    return this.#sink;
  }

  /** True while the parser is writing data into a caller-provided target. */
  get receivingInto(): Uint8Array | undefined {
    return this.#state === State.Data ? this.#target : undefined;
  }

  nextBuffer(): Uint8Array {
    switch (this.#state) {
      case State.Header:
        return this.#header.subarray(this.#have);
      case State.Body:
        return this.#body.subarray(this.#have);
      case State.WriteHead:
        return this.#writeHead.subarray(this.#have);
      case State.Data: {
        const left = this.#dataLength - this.#have;
        if (this.#target) return this.#target.subarray(this.#have);
        return this.#scratch.subarray(0, Math.min(left, this.#scratch.length));
      }
      default:
        return this.#scratch.subarray(0, 1);
    }
  }

  /**
   * The caller's target, from where the next byte goes, when at least `min` bytes of it are
   * still to come: large payloads are received straight into it; small frames are better read
   * many at a time into a staging buffer and copied (`push`).
   */
  directTarget(min: number): Uint8Array | undefined {
    if (this.#state !== State.Data || !this.#target) return undefined;
    return this.#dataLength - this.#have >= min ? this.#target.subarray(this.#have) : undefined;
  }

  /** Stop discarding into the caller's target: the rest of the current frame goes to scratch. */
  detachTarget(): void {
    if (this.#state === State.Data) this.#target = undefined;
  }

  commit(n: number): void {
    if (this.#state === State.Failed || n <= 0) return;
    this.#have += n;
    switch (this.#state) {
      case State.Header:
        if (this.#have === HEADER_BYTES) this.#onHeader();
        return;
      case State.Body:
        if (this.#have === this.#bodyLength) {
          const body = this.#body;
          this.#reset();
          this.#s.onControl(this.#type, this.#reqId, body);
        }
        return;
      case State.WriteHead:
        if (this.#have === WRITE_HEAD_BYTES) {
          this.#dataLength = this.#bodyLength - WRITE_HEAD_BYTES;
          this.#target = this.#s.writeTarget(this.#reqId, this.#writeHead, this.#dataLength);
          this.#enterData();
        }
        return;
      case State.Data:
        if (this.#have === this.#dataLength) {
          const discarded = this.#target === undefined;
          const { type, reqId } = { type: this.#type, reqId: this.#reqId };
          this.#reset();
          this.#s.onDataDone(type, reqId, discarded);
        }
        return;
      default:
        return;
    }
  }

  /** Copy-mode input: feed a received chunk. */
  push(chunk: Uint8Array): void {
    let off = 0;
    while (off < chunk.length && this.#state !== State.Failed) {
      const dst = this.nextBuffer();
      const n = Math.min(dst.length, chunk.length - off);
      dst.set(chunk.subarray(off, off + n));
      off += n;
      this.commit(n);
    }
  }

  #fail(message: string): never {
    this.#state = State.Failed;
    throw new InvalidInputError(message, { details: { field: 'frame' } });
  }

  #onHeader(): void {
    const h = this.#header;
    const version = h.readUInt8(0);
    if (version !== PROTOCOL_VERSION) this.#fail(`frame version ${version} is not supported (expected ${PROTOCOL_VERSION})`);
    const type = h.readUInt8(1);
    if (!KNOWN_TYPES.has(type)) this.#fail(`unknown frame type 0x${type.toString(16)}`);
    if (h.readUInt16BE(2) !== 0) this.#fail('reserved header bits are set');
    this.#type = type as FrameType;
    this.#reqId = h.readUInt32BE(4);
    this.#bodyLength = h.readUInt32BE(8);
    this.#have = 0;
    if (type === FrameType.ReadData) {
      if (this.#bodyLength === 0 || this.#bodyLength > this.#maxData) this.#fail(`READ_DATA of ${this.#bodyLength} bytes is out of range`);
      this.#dataLength = this.#bodyLength;
      this.#target = this.#s.readTarget(this.#reqId, this.#dataLength);
      this.#enterData();
    } else if (type === FrameType.WriteReq) {
      if (this.#bodyLength <= WRITE_HEAD_BYTES || this.#bodyLength - WRITE_HEAD_BYTES > this.#maxData) {
        this.#fail(`WRITE_REQ of ${this.#bodyLength} bytes is out of range`);
      }
      this.#state = State.WriteHead;
    } else {
      if (this.#bodyLength > MAX_CONTROL_BODY) this.#fail(`control frame of ${this.#bodyLength} bytes exceeds ${MAX_CONTROL_BODY}`);
      if (this.#bodyLength === 0) {
        const { type: t, reqId } = { type: this.#type, reqId: this.#reqId };
        this.#reset();
        this.#s.onControl(t, reqId, new Uint8Array(0));
        return;
      }
      this.#body = Buffer.allocUnsafe(this.#bodyLength);
      this.#state = State.Body;
    }
  }

  #enterData(): void {
    if (this.#target && this.#target.length !== this.#dataLength) {
      this.#fail(`internal: data target of ${this.#target.length} bytes for ${this.#dataLength}`);
    }
    this.#have = 0;
    this.#state = State.Data;
  }

  #reset(): void {
    this.#state = State.Header;
    this.#have = 0;
    this.#target = undefined;
  }
}
