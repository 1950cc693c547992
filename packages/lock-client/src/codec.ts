/**
 * Serialization of the messages of `lock.proto` with protobufjs, for the gRPC service
 * definition in `proto.ts`.
 *
 * The JavaScript shapes are the ones `@grpc/proto-loader` yields with the options the
 * package has always used (`keepCase: false, longs: Number, enums: String, bytes: Buffer,
 * defaults: true, arrays: true`): camelCase names, every field present with its default,
 * uint64 as Number, enums as their names, bytes as Buffer. What differs is the route:
 *
 * - encoding hands the plain object straight to the generated `Type.encode` (no
 *   `fromObject`/`verify` per call). Objects come from this package, already in that
 *   shape; the few inputs that can come from users (a resolver's descriptors, an enum
 *   name) are checked here or by the caller (client.ts validates ids and numbers);
 * - decoding reads the fields of the decoded message into a plain object, converting
 *   only uint64 (`Long` → Number), the enum (number → name) and empty repeated fields
 *   (the shared frozen default → a fresh array), instead of `toObject` with defaults.
 *
 * A malformed message (truncated, bad length, bad wire type) throws, which grpc-js
 * answers as INTERNAL; see {@link StrictReader} for the one check added to protobufjs's.
 * Unknown fields are skipped.
 */
import protobuf from 'protobufjs';
import type {
  AcquireRequestMsg,
  AcquireResponseMsg,
  BlockGrantMsg,
  HealthRequestMsg,
  HealthResponseMsg,
  ReleaseRequestMsg,
  ReleaseResponseMsg,
  EntryErrorMsg,
  ReleaseManyRequestMsg,
  ReleaseManyResponseMsg,
  RenewManyRequestMsg,
  RenewManyResponseMsg,
  RenewRequestMsg,
  RenewResponseMsg,
  SessionRequestMsg,
  SessionResponseMsg,
} from './proto.js';

const PACKAGE = 'tensorwire.lock.v1';

/** A uint64 as protobufjs decodes it: a `Long` (or a Number without the long package). */
type U64 = number | { readonly low: number; readonly high: number };

/** uint64 → Number, as proto-loader's `longs: Number` (exact below 2^53). */
function u64(v: U64): number {
  return typeof v === 'number' ? v : (v.high >>> 0) * 0x1_0000_0000 + (v.low >>> 0);
}

// What protobufjs's own reader uses when Node has it: Buffer's utf8Slice, without toString's argument checks.
type Utf8SliceBuffer = Buffer & { utf8Slice(start: number, end: number): string };
const HAS_UTF8_SLICE = typeof (Buffer.prototype as Partial<Utf8SliceBuffer>).utf8Slice === 'function';

/**
 * protobufjs's Node reader, except that a string field whose length runs past the end of
 * the message throws (RangeError) like every other field, instead of being cut short.
 */
class StrictReader extends protobuf.BufferReader {
  override string(): string {
    const len = this.uint32();
    const start = this.pos;
    const end = start + len;
    if (end > this.len) throw new RangeError(`index out of range: ${start} + ${len} > ${this.len}`);
    this.pos = end;
    const buf = this.buf as Utf8SliceBuffer;
    return HAS_UTF8_SLICE ? buf.utf8Slice(start, end) : buf.toString('utf8', start, end);
  }
}

/** A repeated field: decoded arrays as they are, the shared frozen default as a fresh one. */
function list<T>(v: T[]): T[] {
  return v.length === 0 ? [] : v;
}

// What `Type.decode` returns, field by field (defaults come from the prototype).
interface RawSessionRequest {
  id: U64;
  method: string;
  payload: Buffer;
  timeoutMs: number;
}
interface RawSessionResponse {
  id: U64;
  code: number;
  details: string;
  retryAfterMs: number | null;
  payload: Buffer;
}
interface RawAcquireRequest {
  requesterId: string;
  blockIds: string[];
  leaseMs: number;
  acquireId: string;
  omitEmptyBlocks: boolean;
  blockOwner: string;
  blockNumbers: number[];
  transports: string[];
}
interface RawBlockGrant {
  blockId: string;
  descriptors: Buffer[];
}
interface RawAcquireResponse {
  sessionId: string;
  deadlineUnixMs: U64;
  leaseMs: number;
  lockTimeoutMs: number;
  blocks: RawBlockGrant[];
  holderId: string;
  leaseDescriptors: Buffer[];
}
interface RawRenewResponse {
  deadlineUnixMs: U64;
  leaseMs: number;
}
interface RawRenewManyResponse {
  deadlineUnixMs: U64[];
  leaseMs: number[];
  errors: EntryErrorMsg[];
}
interface RawHealthResponse {
  status: number;
  holderId: string;
  lockTimeoutMs: number;
  activeSessions: U64;
  activeBlocks: U64;
  localLane: string;
}

/** Bytes of `v` as a protobuf varint. */
function varintSize(v: number): number {
  let n = 1;
  while (v >= 0x80) {
    v = Math.floor(v / 128);
    n++;
  }
  return n;
}

function writeVarint(buf: Buffer, pos: number, v: number): number {
  while (v >= 0x80) {
    buf[pos++] = (v % 128) | 0x80;
    v = Math.floor(v / 128);
  }
  buf[pos++] = v;
  return pos;
}

/** Bytes of a length-delimited field of `bytes` bytes: its key byte, the length varint, the bytes. */
function fieldSize(bytes: number): number {
  return 1 + varintSize(bytes) + bytes;
}

/** Key byte of AcquireRequest.block_ids (field 2, length-delimited) and a 1-byte length, per length < 128. */
const BLOCK_ID_FRAMES: readonly string[] = Array.from({ length: 0x80 }, (_, n) => String.fromCharCode(0x12, n));
const utf8 = new TextEncoder();

/**
 * AcquireRequest without protobufjs's per-string work, for block ids of ASCII shorter than
 * 128 characters (valid block ids nearly always are): the ids and their framing (key byte,
 * 1-byte length) are concatenated into ONE string and written in one call, which also proves
 * them ASCII (as many bytes written as characters read). Fields and presence as protobufjs's
 * generated encoder writes them (a field that is set is written, defaults included). Returns
 * undefined when the message does not fit this path (an id of 128 characters or more, a
 * non-ASCII id, a field of an unexpected type): the caller then uses protobufjs. Block numbers
 * (from a Uint32Array) are written packed, as protobufjs writes them.
 */
function encodeAcquireRequestAscii(m: AcquireRequestMsg): Buffer | undefined {
  const ids = m.blockIds;
  const { requesterId, leaseMs, acquireId, omitEmptyBlocks, blockOwner, blockNumbers, transports } = m;
  if (!Array.isArray(ids) || typeof requesterId !== 'string' || typeof acquireId !== 'string') return undefined;
  if (typeof leaseMs !== 'number' || !Number.isInteger(leaseMs) || leaseMs < 0 || leaseMs > 0xffffffff) return undefined;
  if (omitEmptyBlocks !== undefined && typeof omitEmptyBlocks !== 'boolean') return undefined;
  if (blockOwner !== undefined && typeof blockOwner !== 'string') return undefined;
  // Numbers only from a Uint32Array here (every element a uint32 by construction).
  if (blockNumbers !== undefined && !(blockNumbers instanceof Uint32Array)) return undefined;
  if (transports !== undefined && !Array.isArray(transports)) return undefined;
  let transportBytes = 0;
  if (transports !== undefined) {
    for (const t of transports) {
      if (typeof t !== 'string') return undefined;
      transportBytes += fieldSize(Buffer.byteLength(t, 'utf8'));
    }
  }
  const ownerBytes = blockOwner === undefined ? -1 : Buffer.byteLength(blockOwner, 'utf8');
  let packed = 0;
  if (blockNumbers !== undefined) for (let i = 0; i < blockNumbers.length; i++) packed += varintSize(blockNumbers[i] as number);
  let framed = '';
  for (let i = 0; i < ids.length; i++) {
    const id = ids[i];
    if (typeof id !== 'string' || id.length >= 0x80) return undefined;
    framed += (BLOCK_ID_FRAMES[id.length] as string) + id;
  }
  const requesterBytes = Buffer.byteLength(requesterId, 'utf8');
  const acquireBytes = Buffer.byteLength(acquireId, 'utf8');
  const size =
    fieldSize(requesterBytes) +
    framed.length +
    1 +
    varintSize(leaseMs) +
    fieldSize(acquireBytes) +
    (omitEmptyBlocks === undefined ? 0 : 2) +
    (ownerBytes < 0 ? 0 : fieldSize(ownerBytes)) +
    (packed === 0 ? 0 : fieldSize(packed)) +
    transportBytes;
  const buf = Buffer.allocUnsafe(size);
  let pos = 0;
  buf[pos++] = 0x0a; // 1: requester_id
  pos = writeVarint(buf, pos, requesterBytes);
  pos += buf.write(requesterId, pos, 'utf8');
  // 2: block_ids, every one. Framing characters are < 0x80, so the UTF-8 bytes are exactly the
  // characters when every id is ASCII; otherwise more bytes than characters (or fewer read).
  const { read, written } = utf8.encodeInto(framed, buf.subarray(pos, pos + framed.length));
  if (read !== framed.length || written !== framed.length) return undefined;
  pos += written;
  buf[pos++] = 0x18; // 3: lease_ms
  pos = writeVarint(buf, pos, leaseMs);
  buf[pos++] = 0x22; // 4: acquire_id
  pos = writeVarint(buf, pos, acquireBytes);
  pos += buf.write(acquireId, pos, 'utf8');
  if (omitEmptyBlocks !== undefined) {
    buf[pos++] = 0x28; // 5: omit_empty_blocks
    buf[pos++] = omitEmptyBlocks ? 1 : 0;
  }
  if (blockOwner !== undefined) {
    buf[pos++] = 0x32; // 6: block_owner
    pos = writeVarint(buf, pos, ownerBytes);
    pos += buf.write(blockOwner, pos, 'utf8');
  }
  if (packed > 0) {
    buf[pos++] = 0x3a; // 7: block_numbers, packed (as protobufjs writes a non-empty repeated uint32)
    pos = writeVarint(buf, pos, packed);
    const ns = blockNumbers as Uint32Array;
    for (let i = 0; i < ns.length; i++) pos = writeVarint(buf, pos, ns[i] as number);
  }
  if (transports !== undefined) {
    for (const t of transports) {
      buf[pos++] = 0x42; // 8: transports, one entry each
      pos = writeVarint(buf, pos, Buffer.byteLength(t, 'utf8'));
      pos += buf.write(t, pos, 'utf8');
    }
  }
  if (pos !== size) throw new Error(`AcquireRequest encoder wrote ${pos} bytes, expected ${size}`);
  return buf;
}

export interface MessageCodec<T> {
  encode(m: T): Buffer;
  decode(b: Buffer): T;
}

export interface LockCodec {
  AcquireRequest: MessageCodec<AcquireRequestMsg>;
  AcquireResponse: MessageCodec<AcquireResponseMsg>;
  ReleaseRequest: MessageCodec<ReleaseRequestMsg>;
  ReleaseResponse: MessageCodec<ReleaseResponseMsg>;
  RenewRequest: MessageCodec<RenewRequestMsg>;
  RenewResponse: MessageCodec<RenewResponseMsg>;
  HealthRequest: MessageCodec<HealthRequestMsg>;
  HealthResponse: MessageCodec<HealthResponseMsg>;
  ReleaseManyRequest: MessageCodec<ReleaseManyRequestMsg>;
  ReleaseManyResponse: MessageCodec<ReleaseManyResponseMsg>;
  RenewManyRequest: MessageCodec<RenewManyRequestMsg>;
  RenewManyResponse: MessageCodec<RenewManyResponseMsg>;
  SessionRequest: MessageCodec<SessionRequestMsg>;
  SessionResponse: MessageCodec<SessionResponseMsg>;
}

function entryErrors(v: EntryErrorMsg[]): EntryErrorMsg[] {
  if (v.length === 0) return [];
  const out: EntryErrorMsg[] = [];
  for (const e of v) out.push({ index: e.index, code: e.code, message: e.message });
  return out;
}

function checkStrings(v: unknown, field: string): void {
  if (v != null && !Array.isArray(v)) throw new TypeError(`${field}: array expected`);
}

/** Descriptors must be bytes (protobufjs would write anything else as an empty field). */
function checkDescriptors(blocks: readonly BlockGrantMsg[]): void {
  if (!Array.isArray(blocks)) throw new TypeError('blocks: array expected');
  for (const g of blocks) {
    if (g === null || typeof g !== 'object') throw new TypeError('blocks: object expected');
    const ds = g.descriptors as unknown;
    if (ds == null) continue;
    if (!Array.isArray(ds)) throw new TypeError('blocks.descriptors: array expected');
    for (const d of ds as unknown[]) {
      if (!(d instanceof Uint8Array) && typeof d !== 'string') throw new TypeError('blocks.descriptors: Uint8Array or base64 string expected');
    }
  }
}

/**
 * Load `lock.proto` (once; the caller caches the result) and build the codecs of its
 * messages on protobufjs's generated encoders and decoders.
 */
export function createLockCodec(protoPath: string): LockCodec {
  const root = protobuf.loadSync(protoPath);
  root.resolveAll();
  const type = (name: string): protobuf.Type => {
    const t = root.lookupType(`${PACKAGE}.${name}`);
    t.setup(); // generate the encoder and decoder now rather than on the first call
    return t;
  };
  const tAcquireReq = type('AcquireRequest');
  const tAcquireRes = type('AcquireResponse');
  const tReleaseReq = type('ReleaseRequest');
  const tReleaseRes = type('ReleaseResponse');
  const tRenewReq = type('RenewRequest');
  const tRenewRes = type('RenewResponse');
  const tHealthReq = type('HealthRequest');
  const tHealthRes = type('HealthResponse');
  const tReleaseManyReq = type('ReleaseManyRequest');
  const tReleaseManyRes = type('ReleaseManyResponse');
  const tRenewManyReq = type('RenewManyRequest');
  const tRenewManyRes = type('RenewManyResponse');
  const tSessionReq = type('SessionRequest');
  const tSessionRes = type('SessionResponse');
  const statusEnum = root.lookupEnum(`${PACKAGE}.HealthResponse.Status`);
  const statusNumber = new Map<string, number>(Object.entries(statusEnum.values));
  const statusName: (string | undefined)[] = [];
  for (const [n, name] of Object.entries(statusEnum.valuesById)) statusName[Number(n)] = name;

  // Plain objects in the right shape go straight to the generated encoder.
  const enc = (t: protobuf.Type, m: object): Buffer => t.encode(m).finish() as Buffer;
  const dec = <R>(t: protobuf.Type, b: Buffer): R => t.decode(new StrictReader(b)) as unknown as R;

  return {
    AcquireRequest: {
      encode: (m) => {
        if (m.blockIds != null && !Array.isArray(m.blockIds)) throw new TypeError('blockIds: array expected');
        return encodeAcquireRequestAscii(m) ?? enc(tAcquireReq, m);
      },
      decode: (b) => {
        const r = dec<RawAcquireRequest>(tAcquireReq, b);
        return {
          requesterId: r.requesterId,
          blockIds: list(r.blockIds),
          leaseMs: r.leaseMs,
          acquireId: r.acquireId,
          omitEmptyBlocks: r.omitEmptyBlocks,
          blockOwner: r.blockOwner,
          blockNumbers: list(r.blockNumbers),
          transports: list(r.transports),
        };
      },
    },
    AcquireResponse: {
      encode: (m) => {
        if (m.blocks != null) checkDescriptors(m.blocks);
        if (m.leaseDescriptors != null) checkDescriptors([{ blockId: '', descriptors: m.leaseDescriptors }]);
        return enc(tAcquireRes, m);
      },
      decode: (b) => {
        const r = dec<RawAcquireResponse>(tAcquireRes, b);
        const blocks: BlockGrantMsg[] = [];
        for (const g of r.blocks) blocks.push({ blockId: g.blockId, descriptors: list(g.descriptors) });
        return {
          sessionId: r.sessionId,
          deadlineUnixMs: u64(r.deadlineUnixMs),
          leaseMs: r.leaseMs,
          lockTimeoutMs: r.lockTimeoutMs,
          blocks,
          holderId: r.holderId,
          leaseDescriptors: list(r.leaseDescriptors),
        };
      },
    },
    ReleaseRequest: {
      encode: (m) => enc(tReleaseReq, m),
      decode: (b) => {
        const r = dec<ReleaseRequestMsg>(tReleaseReq, b);
        return { requesterId: r.requesterId, sessionId: r.sessionId, acquireId: r.acquireId };
      },
    },
    ReleaseResponse: {
      encode: (m) => enc(tReleaseRes, m),
      decode: (b) => ({ released: dec<ReleaseResponseMsg>(tReleaseRes, b).released }),
    },
    RenewRequest: {
      encode: (m) => enc(tRenewReq, m),
      decode: (b) => {
        const r = dec<RenewRequestMsg>(tRenewReq, b);
        return { requesterId: r.requesterId, sessionId: r.sessionId, leaseMs: r.leaseMs };
      },
    },
    RenewResponse: {
      encode: (m) => enc(tRenewRes, m),
      decode: (b) => {
        const r = dec<RawRenewResponse>(tRenewRes, b);
        return { deadlineUnixMs: u64(r.deadlineUnixMs), leaseMs: r.leaseMs };
      },
    },
    HealthRequest: {
      encode: (m) => enc(tHealthReq, m),
      decode: (b) => {
        dec(tHealthReq, b); // still refuse a malformed message
        return {};
      },
    },
    ReleaseManyRequest: {
      encode: (m) => {
        checkStrings(m.sessionIds, 'sessionIds');
        checkStrings(m.acquireIds, 'acquireIds');
        return enc(tReleaseManyReq, m);
      },
      decode: (b) => {
        const r = dec<ReleaseManyRequestMsg>(tReleaseManyReq, b);
        return { requesterId: r.requesterId, sessionIds: list(r.sessionIds), acquireIds: list(r.acquireIds) };
      },
    },
    ReleaseManyResponse: {
      encode: (m) => enc(tReleaseManyRes, m),
      decode: (b) => {
        const r = dec<ReleaseManyResponseMsg>(tReleaseManyRes, b);
        return { released: list(r.released), errors: entryErrors(r.errors) };
      },
    },
    RenewManyRequest: {
      encode: (m) => {
        checkStrings(m.sessionIds, 'sessionIds');
        checkStrings(m.leaseMs, 'leaseMs');
        return enc(tRenewManyReq, m);
      },
      decode: (b) => {
        const r = dec<RenewManyRequestMsg>(tRenewManyReq, b);
        return { requesterId: r.requesterId, sessionIds: list(r.sessionIds), leaseMs: list(r.leaseMs) };
      },
    },
    RenewManyResponse: {
      encode: (m) => enc(tRenewManyRes, m),
      decode: (b) => {
        const r = dec<RawRenewManyResponse>(tRenewManyRes, b);
        const deadlines: number[] = new Array<number>(r.deadlineUnixMs.length);
        for (let i = 0; i < deadlines.length; i++) deadlines[i] = u64(r.deadlineUnixMs[i] as U64);
        return { deadlineUnixMs: deadlines, leaseMs: list(r.leaseMs), errors: entryErrors(r.errors) };
      },
    },
    SessionRequest: {
      encode: (m) => enc(tSessionReq, m),
      decode: (b) => {
        const r = dec<RawSessionRequest>(tSessionReq, b);
        return { id: u64(r.id), method: r.method, payload: r.payload, timeoutMs: r.timeoutMs };
      },
    },
    SessionResponse: {
      encode: (m) => enc(tSessionRes, m),
      decode: (b) => {
        const r = dec<RawSessionResponse>(tSessionRes, b);
        const out: SessionResponseMsg = { id: u64(r.id), code: r.code, details: r.details, payload: r.payload };
        if (r.retryAfterMs != null) out.retryAfterMs = r.retryAfterMs;
        return out;
      },
    },
    HealthResponse: {
      encode: (m) => {
        const raw = m.status as unknown;
        let status: number | undefined;
        if (raw == null) status = 0;
        else if (typeof raw === 'number') status = raw;
        else status = statusNumber.get(String(raw));
        if (status === undefined) throw new TypeError(`status: unknown enum value ${String(raw)}`);
        return enc(tHealthRes, { ...m, status });
      },
      decode: (b) => {
        const r = dec<RawHealthResponse>(tHealthRes, b);
        return {
          // A value this schema does not name stays a number, as with proto-loader.
          status: (statusName[r.status] ?? r.status) as HealthResponseMsg['status'],
          holderId: r.holderId,
          lockTimeoutMs: r.lockTimeoutMs,
          activeSessions: u64(r.activeSessions),
          activeBlocks: u64(r.activeBlocks),
          localLane: r.localLane,
        };
      },
    },
  };
}
