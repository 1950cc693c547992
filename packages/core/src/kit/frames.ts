/**
 * Frame codecs for transports on byte streams, with bounded decoders, and a parser that lands
 * data straight in its destinations. This is the wire protocol, version 2, of every transport
 * built on the kit (TCP, Unix domain sockets): only the handshake's magic differs per transport
 * (see handshake.ts). WRITEV_ACK and GOAWAY are empty, and nothing but handshake frames may
 * come before the handshake finished. All integers big-endian.
 *
 * Every frame: a 12-byte header
 *   u8 version (2) | u8 type | u16 reserved (0) | u32 request id | u32 body length
 * followed by the body.
 *
 *   READV_REQ   0x01  body: vector head (below), nothing else
 *   WRITEV_REQ  0x02  body: vector head, then the ranges' data back to back, in range order
 *   READV_DATA  0x03  body: the requested ranges' bytes back to back, in range order
 *   WRITEV_ACK  0x04  body: empty
 *   ERROR       0x05  body: u32 range index (0xffffffff: none) | str8 code | u16 length | UTF-8 message
 *   GOAWAY      0x06  body: empty; the sender will issue no more requests on this stream
 *   HELLO       0x10  body: see handshake.ts
 *   HELLO_ACK   0x11  body: see handshake.ts
 *
 * Vector head ({@link VEC_PREFIX_BYTES} + 16 per token + {@link RANGE_ENTRY_BYTES} (20) per range):
 *   u16 token count T (1..MAX_TOKENS_PER_FRAME) | u16 reserved (0) | u32 range count R (1..MAX_RANGES_PER_FRAME)
 *   T × 16-byte token (deduplicated by the sender)
 *   R × range: u16 token index (< T) | u16 reserved (0) | u32 granted range index | u32 length
 *              | u32 offset high | u32 offset low
 *
 * Bounds, all checked before anything is allocated or stored: a control frame's body is at most
 * {@link MAX_CONTROL_BODY} bytes (WRITEV_ACK and GOAWAY exactly 0); a READV_DATA carries 1 to
 * `maxDataBytes` bytes (the connection's agreed chunk limit); a vector head at most
 * {@link MAX_VEC_HEAD_BYTES}; before the handshake only HELLO, HELLO_ACK and ERROR are accepted.
 * A frame that lies about itself (counts beyond the body, a token index beyond the token table,
 * reserved bits set, WRITEV lengths that do not add up to its data) is a protocol error: the
 * parser throws InvalidInputError and the stream must be dropped.
 *
 * The parser never reads past the frame it is in, so the data of READV_DATA and WRITEV_REQ can
 * be received straight into their destinations (`directTarget()` / `commit()`), or staged many
 * frames at a time and scattered (`push()`), following a {@link ScatterList} given by the sink:
 * indices into a typed table, no object per range.
 */
import { ByteReader, ByteWriter } from '../codec.js';
import { InvalidInputError } from '../errors.js';

export const PROTOCOL_VERSION = 2;
export const HEADER_BYTES = 12;
export const TOKEN_BYTES = 16;
/** Control frames (everything but the vector frames and READV_DATA) are small. */
export const MAX_CONTROL_BODY = 4096;
/** Counts at the start of a vector head. */
export const VEC_PREFIX_BYTES = 8;
/** One range of a vector head: token index, reserved, granted range index, length, offset (hi, lo). */
export const RANGE_ENTRY_BYTES = 20;
/** Positions of a range entry's fields, from its start. */
export const RangeEntry = {
  Token: 0,
  Reserved: 2,
  Range: 4,
  Length: 8,
  OffsetHigh: 12,
  OffsetLow: 16,
} as const;
export const MAX_RANGES_PER_FRAME = 8192;
export const MAX_TOKENS_PER_FRAME = 1024;
/** The largest vector head: about 176 KiB. */
export const MAX_VEC_HEAD_BYTES = VEC_PREFIX_BYTES + TOKEN_BYTES * MAX_TOKENS_PER_FRAME + RANGE_ENTRY_BYTES * MAX_RANGES_PER_FRAME;
/** ERROR's range index when the error is about no range in particular. */
export const NO_RANGE = 0xffffffff;
const TWO_32 = 4294967296;

export const FrameType = {
  ReadvReq: 0x01,
  WritevReq: 0x02,
  ReadvData: 0x03,
  WritevAck: 0x04,
  Error: 0x05,
  Goaway: 0x06,
  Hello: 0x10,
  HelloAck: 0x11,
} as const;
export type FrameType = (typeof FrameType)[keyof typeof FrameType];
const KNOWN_TYPES: ReadonlySet<number> = new Set(Object.values(FrameType));

/** Frame types a stream accepts before its handshake finished. */
export function isHandshakeFrame(type: number): boolean {
  return type === FrameType.Hello || type === FrameType.HelloAck || type === FrameType.Error;
}

// --- header -----------------------------------------------------------------------------

/** Write a frame header at `at` of `b`. */
export function putHeader(b: Buffer, at: number, type: FrameType, reqId: number, bodyLength: number): void {
  b[at] = PROTOCOL_VERSION;
  b[at + 1] = type;
  b[at + 2] = 0;
  b[at + 3] = 0;
  b.writeUInt32BE(reqId >>> 0, at + 4);
  b.writeUInt32BE(bodyLength >>> 0, at + 8);
}

export function frameHeader(type: FrameType, reqId: number, bodyLength: number): Buffer {
  const b = Buffer.allocUnsafe(HEADER_BYTES);
  putHeader(b, 0, type, reqId, bodyLength);
  return b;
}

/** Replace the request id of an encoded frame (for frames cached and sent again). */
export function patchRequestId(frame: Buffer, reqId: number): void {
  frame.writeUInt32BE(reqId >>> 0, 4);
}

/** A GOAWAY frame. */
export function encodeGoaway(): Buffer {
  return frameHeader(FrameType.Goaway, 0, 0);
}

/**
 * Why a header is not acceptable, or undefined: version, known type, reserved bits, and the
 * body length inside its type's bound (`maxDataBytes` is the most data a frame may carry).
 * `handshaking`: only handshake frames are accepted. Reads 12 bytes at `at`; allocates nothing.
 */
export function headerProblem(b: Uint8Array, at: number, maxDataBytes: number, handshaking = false): string | undefined {
  const version = b[at] as number;
  if (version !== PROTOCOL_VERSION) return `frame version ${version} is not supported (expected ${PROTOCOL_VERSION})`;
  const type = b[at + 1] as number;
  if (!KNOWN_TYPES.has(type)) return `unknown frame type 0x${type.toString(16)}`;
  if ((b[at + 2] as number) !== 0 || (b[at + 3] as number) !== 0) return 'reserved header bits are set';
  if (handshaking && !isHandshakeFrame(type)) return `frame type 0x${type.toString(16)} before the handshake finished`;
  const len = ((b[at + 8] as number) * 16777216) + (((b[at + 9] as number) << 16) | ((b[at + 10] as number) << 8) | (b[at + 11] as number));
  switch (type) {
    case FrameType.ReadvData:
      return len === 0 || len > maxDataBytes ? `READV_DATA of ${len} bytes is out of range (1..${maxDataBytes})` : undefined;
    case FrameType.ReadvReq:
      return len < VEC_PREFIX_BYTES || len > MAX_VEC_HEAD_BYTES ? `READV_REQ of ${len} bytes is out of range` : undefined;
    case FrameType.WritevReq:
      return len < VEC_PREFIX_BYTES || len > MAX_VEC_HEAD_BYTES + maxDataBytes ? `WRITEV_REQ of ${len} bytes is out of range` : undefined;
    case FrameType.WritevAck:
    case FrameType.Goaway:
      return len !== 0 ? `frame type 0x${type.toString(16)} must have an empty body, got ${len} bytes` : undefined;
    default:
      return len > MAX_CONTROL_BODY ? `control frame of ${len} bytes exceeds ${MAX_CONTROL_BODY}` : undefined;
  }
}

export interface FrameHeader {
  readonly type: FrameType;
  readonly reqId: number;
  readonly bodyLength: number;
}

/** Decode and check a 12-byte header ({@link headerProblem}). Throws InvalidInputError. */
export function decodeHeader(b: Uint8Array, maxDataBytes: number, handshaking = false): FrameHeader {
  if (!(b instanceof Uint8Array) || b.length < HEADER_BYTES) throw new InvalidInputError(`a frame header is ${HEADER_BYTES} bytes`, { details: { field: 'frame' } });
  const problem = headerProblem(b, 0, maxDataBytes, handshaking);
  if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'frame' } });
  const v = new DataView(b.buffer, b.byteOffset, HEADER_BYTES);
  return { type: b[1] as FrameType, reqId: v.getUint32(4), bodyLength: v.getUint32(8) };
}

// --- vector heads -----------------------------------------------------------------------

export function vecHeadBytes(tokenCount: number, rangeCount: number): number {
  return VEC_PREFIX_BYTES + TOKEN_BYTES * tokenCount + RANGE_ENTRY_BYTES * rangeCount;
}

/**
 * Allocate a vector request frame (header and head, plus `extra` bytes of capacity after the
 * head) and write its header and counts. Fill it with {@link putToken} and {@link putRange}.
 * `dataLength` is the data that follows the head on the wire (0 for READV_REQ).
 */
export function allocVecFrame(type: typeof FrameType.ReadvReq | typeof FrameType.WritevReq, reqId: number, tokenCount: number, rangeCount: number, dataLength: number, extra = 0): Buffer {
  const head = vecHeadBytes(tokenCount, rangeCount);
  const b = Buffer.allocUnsafe(HEADER_BYTES + head + extra);
  putHeader(b, 0, type, reqId, head + dataLength);
  b.writeUInt16BE(tokenCount, HEADER_BYTES);
  b.writeUInt16BE(0, HEADER_BYTES + 2);
  b.writeUInt32BE(rangeCount, HEADER_BYTES + 4);
  return b;
}

/** Token `i` of a frame from {@link allocVecFrame}. */
export function putToken(frame: Buffer, i: number, token: Uint8Array): void {
  frame.set(token, HEADER_BYTES + VEC_PREFIX_BYTES + TOKEN_BYTES * i);
}

/**
 * Range `i` of a frame from {@link allocVecFrame} with `tokenCount` tokens: `length` bytes at
 * `offset` (a safe integer) inside granted range `rangeIndex` (a u32) of token `tokenIndex`.
 */
export function putRange(frame: Buffer, tokenCount: number, i: number, tokenIndex: number, rangeIndex: number, offset: number, length: number): void {
  const at = HEADER_BYTES + VEC_PREFIX_BYTES + TOKEN_BYTES * tokenCount + RANGE_ENTRY_BYTES * i;
  const high = Math.floor(offset / TWO_32);
  // Byte stores, not Buffer#writeUInt*BE (argument validation per field): this runs per range.
  put16(frame, at + RangeEntry.Token, tokenIndex);
  put16(frame, at + RangeEntry.Reserved, 0);
  put32(frame, at + RangeEntry.Range, rangeIndex >>> 0);
  put32(frame, at + RangeEntry.Length, length >>> 0);
  put32(frame, at + RangeEntry.OffsetHigh, high >>> 0);
  put32(frame, at + RangeEntry.OffsetLow, (offset - high * TWO_32) >>> 0);
}

/** Big-endian u16 / u32 at `at` (inside `b`: the callers' frames and heads are sized or checked first). */
function put16(b: Uint8Array, at: number, v: number): void {
  b[at] = v >>> 8;
  b[at + 1] = v;
}
function put32(b: Uint8Array, at: number, v: number): void {
  b[at] = v >>> 24;
  b[at + 1] = v >>> 16;
  b[at + 2] = v >>> 8;
  b[at + 3] = v;
}
function get16(b: Uint8Array, at: number): number {
  return ((b[at] as number) << 8) | (b[at + 1] as number);
}
function get32(b: Uint8Array, at: number): number {
  return (b[at] as number) * 0x1000000 + (((b[at + 1] as number) << 16) | ((b[at + 2] as number) << 8) | (b[at + 3] as number));
}

// Readers of a head (the body of a vector frame, from the counts on). The parser has checked
// its structure (checkVecHead) before a sink sees it, so every field read is inside the head.
export function headTokenCount(head: Buffer): number {
  return head.readUInt16BE(0);
}
export function headRangeCount(head: Buffer): number {
  return head.readUInt32BE(4);
}
/** Byte position of token `i` in the head. */
export function headTokenAt(i: number): number {
  return VEC_PREFIX_BYTES + TOKEN_BYTES * i;
}
/** Byte position of range `i` in a head with `tokenCount` tokens. */
export function headRangeAt(tokenCount: number, i: number): number {
  return VEC_PREFIX_BYTES + TOKEN_BYTES * tokenCount + RANGE_ENTRY_BYTES * i;
}
export function rangeTokenIndex(head: Buffer, at: number): number {
  return get16(head, at + RangeEntry.Token);
}
/** Which of its token's granted ranges the range is in (0 for a whole registration). */
export function rangeGrantIndex(head: Buffer, at: number): number {
  return get32(head, at + RangeEntry.Range);
}
/** The range's offset inside its granted range; may exceed 2^53 (then it is beyond every range anyway). */
export function rangeOffset(head: Buffer, at: number): number {
  return get32(head, at + RangeEntry.OffsetHigh) * TWO_32 + get32(head, at + RangeEntry.OffsetLow);
}
export function rangeLength(head: Buffer, at: number): number {
  return get32(head, at + RangeEntry.Length);
}

/** Why the counts at the start of a head are not acceptable for a body of `bodyLength` bytes, or undefined. */
export function vecPrefixProblem(prefix: Buffer, type: FrameType, bodyLength: number, maxDataBytes: number): string | undefined {
  const tokens = prefix.readUInt16BE(0);
  const ranges = prefix.readUInt32BE(4);
  if (prefix.readUInt16BE(2) !== 0) return 'vector head has reserved bits set';
  if (tokens < 1 || tokens > MAX_TOKENS_PER_FRAME) return `token count ${tokens} is out of range (1..${MAX_TOKENS_PER_FRAME})`;
  if (ranges < 1 || ranges > MAX_RANGES_PER_FRAME) return `range count ${ranges} is out of range (1..${MAX_RANGES_PER_FRAME})`;
  const head = vecHeadBytes(tokens, ranges);
  if (type === FrameType.ReadvReq) {
    if (head !== bodyLength) return `READV_REQ of ${bodyLength} bytes does not match ${tokens} tokens and ${ranges} ranges`;
  } else {
    const data = bodyLength - head;
    if (data < 1 || data > maxDataBytes) return `WRITEV_REQ with ${tokens} tokens and ${ranges} ranges carries ${data} data bytes`;
  }
  return undefined;
}

/**
 * Check a complete head's structure: token indices inside the table, reserved bits clear, and
 * for a WRITEV (`dataLength` ≥ 0) the lengths adding up to the data. Throws InvalidInputError.
 */
export function checkVecHead(head: Buffer, dataLength: number): void {
  const t = head.readUInt16BE(0);
  const r = head.readUInt32BE(4);
  if (head.readUInt16BE(2) !== 0) throw new InvalidInputError('vector head has reserved bits set', { details: { field: 'frame' } });
  if (head.length !== vecHeadBytes(t, r)) throw new InvalidInputError(`vector head of ${head.length} bytes does not match ${t} tokens and ${r} ranges`, { details: { field: 'frame' } });
  let sum = 0;
  let at = VEC_PREFIX_BYTES + TOKEN_BYTES * t;
  for (let i = 0; i < r; i++, at += RANGE_ENTRY_BYTES) {
    // The length check above keeps every read inside the head.
    if (get16(head, at + RangeEntry.Token) >= t) throw new InvalidInputError(`range ${i} names token ${get16(head, at + RangeEntry.Token)} of ${t}`, { details: { field: 'frame', range: i } });
    if (get16(head, at + RangeEntry.Reserved) !== 0) throw new InvalidInputError(`range ${i} has reserved bits set`, { details: { field: 'frame', range: i } });
    sum += get32(head, at + RangeEntry.Length);
  }
  if (dataLength >= 0 && sum !== dataLength) {
    throw new InvalidInputError(`WRITEV ranges add up to ${sum} bytes but the frame carries ${dataLength}`, { details: { field: 'frame' } });
  }
}

export interface VecRange {
  /** Index into the frame's token table. */
  readonly token: number;
  /** Granted range index; absent means 0 (a whole registration's one range). */
  readonly range?: number;
  /** Offset inside that granted range. */
  readonly offset: number;
  readonly length: number;
}

/** Object-per-range encoder of a READV_REQ, for tests and tools (hot paths use allocVecFrame). */
export function encodeReadvReq(reqId: number, tokens: readonly Uint8Array[], ranges: readonly VecRange[]): Buffer {
  const b = allocVecFrame(FrameType.ReadvReq, reqId, tokens.length, ranges.length, 0);
  tokens.forEach((t, i) => putToken(b, i, t));
  ranges.forEach((r, i) => putRange(b, tokens.length, i, r.token, r.range ?? 0, r.offset, r.length));
  return b;
}

/** Object-per-range encoder of a WRITEV_REQ with its data, for tests and tools. */
export function encodeWritevReq(reqId: number, tokens: readonly Uint8Array[], ranges: readonly VecRange[], data: Uint8Array): Buffer {
  const b = allocVecFrame(FrameType.WritevReq, reqId, tokens.length, ranges.length, data.length, data.length);
  tokens.forEach((t, i) => putToken(b, i, t));
  ranges.forEach((r, i) => putRange(b, tokens.length, i, r.token, r.range ?? 0, r.offset, r.length));
  b.set(data, b.length - data.length);
  return b;
}

/**
 * Object decoder of a head (the body of a vector frame up to its data), checking everything the
 * parser checks. For tests and tools. `dataLength` as in {@link checkVecHead}. A range's `range`
 * is present only when it is not 0, as {@link encodeReadvReq} takes it.
 */
export function decodeVecHead(head: Uint8Array, dataLength = -1): { tokens: Uint8Array[]; ranges: VecRange[] } {
  const r = new ByteReader(head, 'vector head');
  const t = r.u16('token count');
  if (r.u16('reserved') !== 0) throw new InvalidInputError('vector head has reserved bits set', { details: { field: 'frame' } });
  const n = r.u32('range count');
  if (t < 1 || t > MAX_TOKENS_PER_FRAME) throw new InvalidInputError(`token count ${t} is out of range`, { details: { field: 'frame' } });
  if (n < 1 || n > MAX_RANGES_PER_FRAME) throw new InvalidInputError(`range count ${n} is out of range`, { details: { field: 'frame' } });
  if (head.length !== vecHeadBytes(t, n)) throw new InvalidInputError(`vector head of ${head.length} bytes does not match ${t} tokens and ${n} ranges`, { details: { field: 'frame' } });
  const b = Buffer.from(head.buffer, head.byteOffset, head.byteLength);
  checkVecHead(b, dataLength);
  const tokens = Array.from({ length: t }, (_, i) => head.slice(headTokenAt(i), headTokenAt(i) + TOKEN_BYTES));
  const ranges = Array.from({ length: n }, (_, i) => {
    const at = headRangeAt(t, i);
    const range = rangeGrantIndex(b, at);
    const token = rangeTokenIndex(b, at);
    const offset = rangeOffset(b, at);
    const length = rangeLength(b, at);
    return range === 0 ? { token, offset, length } : { token, range, offset, length };
  });
  return { tokens, ranges };
}

// --- ERROR ------------------------------------------------------------------------------

/** Longest message an ERROR carries (in characters, before encoding). */
export const MAX_ERROR_MESSAGE = 1000;

export function encodeError(reqId: number, code: string, message: string, range: number = NO_RANGE): Buffer {
  const msg = Buffer.from(message.slice(0, MAX_ERROR_MESSAGE), 'utf8');
  const body = new ByteWriter(40 + msg.length).u32(range >>> 0).str8(code).blob16(msg).finish();
  return Buffer.concat([frameHeader(FrameType.Error, reqId, body.length), body]);
}

/** `range` is undefined when the error names no range. Throws InvalidInputError for a malformed body. */
export function decodeError(body: Uint8Array): { code: string; message: string; range: number | undefined } {
  const r = new ByteReader(body, 'ERROR frame');
  const index = r.u32('range index');
  const code = r.str8('code');
  const message = Buffer.from(r.blob16('message')).toString('utf8');
  r.end();
  return { code, message, range: index === NO_RANGE ? undefined : index };
}

// --- parser -----------------------------------------------------------------------------

/**
 * Where the data of one frame goes, described by indices so that no object exists per range:
 * entry `e` (for `first <= e < first + count`) lands `table[e*stride + lengthField]` bytes at
 * `table[e*stride + offsetField]` of `buffers[table[e*stride + bufferField]]`, entries back to
 * back in order. Their lengths must add up to the frame's data length, and each must fit its
 * buffer (the parser checks the latter as it goes).
 */
export interface ScatterList {
  readonly buffers: readonly Uint8Array[];
  readonly table: Float64Array;
  readonly stride: number;
  readonly bufferField: number;
  readonly offsetField: number;
  readonly lengthField: number;
  readonly first: number;
  readonly count: number;
}

/** What the parser asks its owner. */
export interface FrameSink {
  /** A complete control frame. */
  onControl(type: FrameType, reqId: number, body: Uint8Array): void;
  /**
   * A complete READV_REQ, its structure checked ({@link checkVecHead}). `head` is the parser's
   * buffer: valid only during the call (copy it to keep it).
   */
  onReadvRequest(reqId: number, head: Buffer): void;
  /** Where the `length` data bytes of a READV_DATA frame go, or undefined to discard them. */
  readvTarget(reqId: number, length: number): ScatterList | undefined;
  /**
   * Where the data of a WRITEV_REQ goes, or undefined to discard it (the sink answers with ERROR
   * later). `head` as in onReadvRequest; the lengths add up to `length`.
   */
  writevTarget(reqId: number, head: Buffer, length: number): ScatterList | undefined;
  /** The data of a READV_DATA or WRITEV_REQ frame has fully arrived (`discarded` if it went nowhere). */
  onDataDone(type: FrameType, reqId: number, discarded: boolean): void;
}

const enum State {
  Header,
  Body,
  VecPrefix,
  VecHead,
  Data,
  Failed,
}

const copy = Buffer.prototype.copy;

/**
 * Incremental frame parser (the scatter receiver). `nextBuffer()` returns exactly the bytes the
 * current state still needs (never more), so a socket can `recv` straight into destination
 * memory. Throws InvalidInputError on any malformed frame (the stream must then be dropped);
 * after that it accepts nothing more.
 */
export class FrameParser {
  #sink: FrameSink | undefined;
  readonly #maxData: number;
  readonly #header = Buffer.alloc(HEADER_BYTES);
  /** Vector heads: grown on demand up to MAX_VEC_HEAD_BYTES, reused. */
  #head: Buffer = Buffer.alloc(256);
  #scratch: Buffer | undefined;
  #state: State = State.Header;
  #have = 0;
  #type: FrameType = FrameType.ReadvReq;
  #reqId = 0;
  #bodyLength = 0;
  #body: Buffer = Buffer.alloc(0);
  #headBytes = 0;
  // Data phase: bytes left in the frame, and the scatter walk (entry index, its buffer, where the
  // next byte goes in it, how many bytes the entry still takes).
  #dataLeft = 0;
  #dataLength = 0;
  #scatter: ScatterList | undefined;
  #entry = 0;
  #entryBuf: Uint8Array = new Uint8Array(0);
  #entryPos = 0;
  #entryLeft = 0;
  /**
   * While true, only handshake frames (HELLO, HELLO_ACK, ERROR) are accepted: a peer that has
   * not finished its handshake cannot make this side read a vector head or data. The owner
   * clears it (possibly from inside `onControl`, which takes effect for the very next frame).
   */
  handshaking: boolean;

  constructor(sink: FrameSink | undefined, maxDataBytes: number, options: { handshaking?: boolean } = {}) {
    this.#sink = sink;
    this.#maxData = maxDataBytes;
    this.handshaking = options.handshaking ?? false;
  }

  /** Attach the sink when it could not exist yet at construction (a socket reading into this parser). */
  set sink(sink: FrameSink) {
    this.#sink = sink;
  }

  get #s(): FrameSink {
    if (!this.#sink) throw new InvalidInputError('frame parser has no sink');
    return this.#sink;
  }

  /** True once the parser threw: the stream must be dropped. */
  get failed(): boolean {
    return this.#state === State.Failed;
  }

  #scratchBuf(): Buffer {
    this.#scratch ??= Buffer.allocUnsafe(64 * 1024);
    return this.#scratch;
  }

  nextBuffer(): Uint8Array {
    switch (this.#state) {
      case State.Header:
        return this.#header.subarray(this.#have);
      case State.Body:
        return this.#body.subarray(this.#have);
      case State.VecPrefix:
        return this.#head.subarray(this.#have, VEC_PREFIX_BYTES);
      case State.VecHead:
        return this.#head.subarray(this.#have, this.#headBytes);
      case State.Data: {
        if (this.#scatter) return this.#entryBuf.subarray(this.#entryPos, this.#entryPos + this.#entryLeft);
        const s = this.#scratchBuf();
        return s.subarray(0, Math.min(this.#dataLeft, s.length));
      }
      default:
        return this.#scratchBuf().subarray(0, 1);
    }
  }

  /**
   * The current destination range, from where the next byte goes, when at least `min` bytes of
   * it are still to come: large ranges are received straight into it; small ones are better
   * read many at a time into a staging buffer and copied out (`push`).
   */
  directTarget(min: number): Uint8Array | undefined {
    if (this.#state !== State.Data || !this.#scatter || this.#entryLeft < min) return undefined;
    return this.#entryBuf.subarray(this.#entryPos, this.#entryPos + this.#entryLeft);
  }

  /**
   * How many bytes (at most `max`) to read into a staging buffer next: normally `max`, but when a
   * destination range of at least `min` bytes starts soon in the current frame, only up to its
   * start, so that the range itself is then received directly. Looks a bounded number of ranges ahead.
   */
  stagingBytes(max: number, min: number): number {
    const s = this.#scatter;
    if (this.#state !== State.Data || !s) return max;
    let ahead = this.#entryLeft;
    const end = s.first + s.count;
    for (let e = this.#entry + 1, steps = 0; ahead < max && e < end && steps < 32; e++, steps++) {
      const len = s.table[e * s.stride + s.lengthField] as number;
      if (len >= min) return ahead;
      ahead += len;
    }
    return max;
  }

  /** Stop storing into the sink's scatter list: the rest of the current frame is discarded. */
  detachTarget(): void {
    if (this.#state === State.Data) this.#scatter = undefined;
  }

  /** `n` bytes were written into the buffer `nextBuffer()` (or `directTarget()`) returned. */
  commit(n: number): void {
    if (this.#state === State.Failed || n <= 0) return;
    if (this.#state === State.Data) {
      this.#dataLeft -= n;
      if (this.#scatter) {
        this.#entryPos += n;
        this.#entryLeft -= n;
        if (this.#entryLeft === 0 && this.#dataLeft > 0) this.#nextEntry();
      }
      if (this.#dataLeft === 0) this.#dataDone();
      return;
    }
    this.#have += n;
    this.#stepped();
  }

  /** Copy-mode input: feed a received chunk; data is copied straight to its destination ranges. */
  push(chunk: Uint8Array): void {
    let off = 0;
    const len = chunk.length;
    while (off < len) {
      switch (this.#state) {
        case State.Data: {
          const n = Math.min(len - off, this.#scatter ? this.#entryLeft : this.#dataLeft);
          if (this.#scatter) copy.call(chunk, this.#entryBuf, this.#entryPos, off, off + n);
          off += n;
          this.commit(n);
          break;
        }
        case State.Failed:
          return;
        default: {
          const dst = this.nextBuffer();
          const n = Math.min(dst.length, len - off);
          copy.call(chunk, dst, 0, off, off + n);
          off += n;
          this.commit(n);
        }
      }
    }
  }

  #fail(message: string): never {
    this.#state = State.Failed;
    throw new InvalidInputError(message, { details: { field: 'frame' } });
  }

  /** A non-data state received bytes: act when its buffer is complete. */
  #stepped(): void {
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
      case State.VecPrefix:
        if (this.#have === VEC_PREFIX_BYTES) this.#onVecPrefix();
        return;
      case State.VecHead:
        if (this.#have === this.#headBytes) this.#onVecHead();
        return;
      default:
        return;
    }
  }

  #onHeader(): void {
    const h = this.#header;
    const problem = headerProblem(h, 0, this.#maxData, this.handshaking);
    if (problem !== undefined) this.#fail(problem);
    const type = h[1] as FrameType;
    this.#type = type;
    this.#reqId = h.readUInt32BE(4);
    this.#bodyLength = h.readUInt32BE(8);
    this.#have = 0;
    const len = this.#bodyLength;
    if (type === FrameType.ReadvData) {
      this.#enterData(len, this.#s.readvTarget(this.#reqId, len));
    } else if (type === FrameType.ReadvReq || type === FrameType.WritevReq) {
      // Only the counts need to be inside the frame here; they are checked against its length next.
      this.#state = State.VecPrefix;
    } else if (len === 0) {
      this.#reset();
      this.#s.onControl(type, this.#reqId, new Uint8Array(0));
    } else {
      this.#body = Buffer.allocUnsafe(len);
      this.#state = State.Body;
    }
  }

  #onVecPrefix(): void {
    const problem = vecPrefixProblem(this.#head, this.#type, this.#bodyLength, this.#maxData);
    if (problem !== undefined) this.#fail(problem);
    const head = vecHeadBytes(this.#head.readUInt16BE(0), this.#head.readUInt32BE(4));
    if (this.#head.length < head) {
      const grown = Buffer.allocUnsafe(Math.min(MAX_VEC_HEAD_BYTES, Math.max(head, 2 * this.#head.length)));
      this.#head.copy(grown, 0, 0, VEC_PREFIX_BYTES);
      this.#head = grown;
    }
    this.#headBytes = head;
    this.#state = State.VecHead;
  }

  #onVecHead(): void {
    const head = this.#head.subarray(0, this.#headBytes);
    const write = this.#type === FrameType.WritevReq;
    const data = this.#bodyLength - this.#headBytes;
    try {
      checkVecHead(head, write ? data : -1);
    } catch (e) {
      this.#fail(e instanceof Error ? e.message : String(e));
    }
    if (!write) {
      this.#reset();
      this.#s.onReadvRequest(this.#reqId, head);
      return;
    }
    this.#enterData(data, this.#s.writevTarget(this.#reqId, head, data));
  }

  #enterData(length: number, scatter: ScatterList | undefined): void {
    this.#have = 0;
    this.#dataLength = length;
    this.#dataLeft = length;
    this.#scatter = scatter;
    this.#state = State.Data;
    if (scatter) {
      if (scatter.count < 1) this.#fail('internal: empty scatter list');
      this.#entry = scatter.first - 1;
      this.#nextEntry();
    }
  }

  /** Move to the next entry of the scatter list (skipping empty ones). */
  #nextEntry(): void {
    const s = this.#scatter as ScatterList;
    const end = s.first + s.count;
    for (;;) {
      const e = ++this.#entry;
      if (e >= end) this.#fail(`internal: scatter list of ${s.count} ranges ends before the ${this.#dataLength} data bytes do`);
      const at = e * s.stride;
      const buf = s.buffers[s.table[at + s.bufferField] as number];
      const off = s.table[at + s.offsetField] as number;
      const len = s.table[at + s.lengthField] as number;
      if (buf === undefined || !(off >= 0) || !(len >= 0) || off + len > buf.length) this.#fail(`internal: scatter range ${e} does not fit its buffer`);
      if (len === 0) continue;
      if (len > this.#dataLeft) this.#fail(`internal: scatter range ${e} extends past the frame's data`);
      this.#entryBuf = buf;
      this.#entryPos = off;
      this.#entryLeft = len;
      return;
    }
  }

  #dataDone(): void {
    const discarded = this.#scatter === undefined;
    const type = this.#type;
    this.#reset();
    this.#s.onDataDone(type, this.#reqId, discarded);
  }

  #reset(): void {
    this.#state = State.Header;
    this.#have = 0;
    this.#scatter = undefined;
    this.#entryLeft = 0;
  }
}
