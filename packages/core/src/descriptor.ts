/**
 * Wire formats the engine owns: the exportable memory descriptor and the peer endpoint.
 *
 * Descriptor v2 (all integers big-endian):
 *   "TWD" u8 version=2 | str8 ownerNodeId | str8 ownerIncarnation | str8 registrationId
 *   | u8 memoryKind (0 host, 1 cuda) | u64 byteLength | u8 flags (bit 0: range grant)
 *   | [range grant: u32 rangeCount | runs of (varint length, varint repeat) adding up to rangeCount]
 *   | u8 count | count × (str8 transport, u16 length, payload)
 *
 * Endpoint v1:
 *   "TWE" u8 version=1 | str8 nodeId | str8 incarnation | str8 hostId | u8 count
 *   | count × (str8 transport, u16 length, endpoint blob)
 *
 * Both decoders validate every field (lengths, ids, kinds, duplicates) and reject trailing
 * bytes, so a descriptor or endpoint from an untrusted peer fails with InvalidInputError.
 */
import { ByteReader, ByteWriter } from './codec.js';
import { InvalidInputError } from './errors.js';
import { assertOwner, idProblem, isToken } from './ids.js';
import type { MemoryKind, NodeIdentity } from './transport.js';

export const DESCRIPTOR_VERSION = 2;
/** Most ranges one range grant's descriptor may carry. */
export const MAX_GRANT_RANGES = 1 << 20;
export const ENDPOINT_VERSION = 1;
export const MAX_TRANSPORTS_PER_BLOB = 16;
const DESCRIPTOR_MAGIC = [0x54, 0x57, 0x44]; // TWD
const ENDPOINT_MAGIC = [0x54, 0x57, 0x45]; // TWE
const TRANSPORT_NAME_RE = /^[a-z][a-z0-9-]{0,31}$/;

export interface MemoryDescriptor {
  readonly owner: Pick<NodeIdentity, 'nodeId' | 'incarnation'>;
  /** Owner-namespaced block id, `block:<ownerNodeId>:<n>`. */
  readonly registrationId: string;
  readonly memoryKind: MemoryKind;
  /** Bytes addressable through it: the registration's length, or the sum of a grant's ranges. */
  readonly byteLength: number;
  /**
   * For a range grant: the length of each granted range, in order (peers name ranges by
   * index, offsets are inside the range). Absent for a whole registration.
   */
  readonly rangeLengths?: Float64Array;
  /** Transport name → that transport's payload. */
  readonly transports: ReadonlyMap<string, Uint8Array>;
}

export interface PeerEndpoint {
  readonly identity: NodeIdentity;
  /** Transport name → that transport's endpoint blob. */
  readonly transports: ReadonlyMap<string, Uint8Array>;
}

export function assertTransportName(name: unknown): asserts name is string {
  if (typeof name !== 'string' || !TRANSPORT_NAME_RE.test(name)) {
    throw new InvalidInputError(`transport name ${JSON.stringify(name)} must match ${TRANSPORT_NAME_RE}`, {
      details: { field: 'transport' },
    });
  }
}

function assertToken(value: unknown, field: string): void {
  if (!isToken(value)) {
    throw new InvalidInputError(`${field} ${JSON.stringify(String(value).slice(0, 80))} must be 1-64 characters of [A-Za-z0-9_-]`, {
      details: { field },
    });
  }
}

function kindToByte(kind: MemoryKind): number {
  if (kind === 'host') return 0;
  if (kind === 'cuda') return 1;
  throw new InvalidInputError(`unknown memory kind ${JSON.stringify(kind)}`, { details: { field: 'memoryKind' } });
}

function byteToKind(b: number): MemoryKind {
  if (b === 0) return 'host';
  if (b === 1) return 'cuda';
  throw new InvalidInputError(`unknown memory kind byte ${b}`, { details: { field: 'memoryKind' } });
}

function writeTransports(w: ByteWriter, transports: ReadonlyMap<string, Uint8Array>): void {
  if (transports.size === 0 || transports.size > MAX_TRANSPORTS_PER_BLOB) {
    throw new InvalidInputError(`between 1 and ${MAX_TRANSPORTS_PER_BLOB} transports required, got ${transports.size}`);
  }
  w.u8(transports.size);
  for (const [name, payload] of transports) {
    assertTransportName(name);
    w.str8(name).blob16(payload);
  }
}

function readTransports(r: ByteReader): Map<string, Uint8Array> {
  const count = r.u8('transport count');
  if (count === 0 || count > MAX_TRANSPORTS_PER_BLOB) {
    throw new InvalidInputError(`transport count ${count} is not between 1 and ${MAX_TRANSPORTS_PER_BLOB}`, {
      details: { field: 'transport count' },
    });
  }
  const out = new Map<string, Uint8Array>();
  for (let i = 0; i < count; i++) {
    const name = r.str8('transport name');
    assertTransportName(name);
    if (out.has(name)) throw new InvalidInputError(`transport ${name} listed twice`, { details: { field: 'transport' } });
    out.set(name, r.blob16('transport payload').slice());
  }
  return out;
}

function readMagic(r: ByteReader, magic: number[], version: number, what: string): void {
  for (let i = 0; i < magic.length; i++) {
    if (r.u8('magic') !== magic[i]) throw new InvalidInputError(`not a tensorwire ${what} (bad magic)`, { details: { field: 'magic' } });
  }
  const v = r.u8('version');
  if (v !== version) {
    throw new InvalidInputError(`${what} version ${v} is not supported (expected ${version})`, { details: { field: 'version' } });
  }
}

export function encodeDescriptor(d: MemoryDescriptor): Uint8Array {
  return encodeDescriptorWith(d, d.rangeLengths === undefined ? undefined : (w) => writeRangeLengths(w, d.rangeLengths as Float64Array, d.byteLength));
}

/**
 * A range grant's descriptor from its range lengths already run-length encoded (what
 * {@link TransferEngine.grant} computes in its one pass over the ranges): `runs` holds
 * (length, repeat) pairs adding up to `count` ranges and `byteLength` bytes. Checked like
 * {@link encodeDescriptor}; costs O(runs), not O(ranges).
 * @internal
 */
export function encodeGrantDescriptor(d: Omit<MemoryDescriptor, 'rangeLengths'>, count: number, runs: readonly number[]): Uint8Array {
  return encodeDescriptorWith(d, (w) => writeRangeRuns(w, count, runs, d.byteLength));
}

function encodeDescriptorWith(d: Omit<MemoryDescriptor, 'rangeLengths'>, writeRanges: ((w: ByteWriter) => void) | undefined): Uint8Array {
  assertOwner(d.owner.nodeId);
  assertToken(d.owner.incarnation, 'incarnation');
  const problem = idProblem(d.registrationId, 'block');
  if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'registrationId' } });
  if (!Number.isSafeInteger(d.byteLength) || d.byteLength <= 0) {
    throw new InvalidInputError(`byteLength ${d.byteLength} must be a positive safe integer`, { details: { field: 'byteLength' } });
  }
  const w = new ByteWriter(128);
  for (const b of DESCRIPTOR_MAGIC) w.u8(b);
  w.u8(DESCRIPTOR_VERSION).str8(d.owner.nodeId).str8(d.owner.incarnation).str8(d.registrationId);
  w.u8(kindToByte(d.memoryKind)).u64(d.byteLength);
  if (writeRanges === undefined) w.u8(0);
  else {
    w.u8(1);
    writeRanges(w);
  }
  writeTransports(w, d.transports);
  return w.finish();
}

/** Unsigned LEB128 of a safe integer. */
function writeVarint(w: ByteWriter, v: number): void {
  while (v >= 0x80) {
    w.u8((v % 0x80) | 0x80);
    v = Math.floor(v / 0x80);
  }
  w.u8(v);
}

function readVarint(r: ByteReader, field: string): number {
  let v = 0;
  let scale = 1;
  for (let i = 0; i < 8; i++) {
    const b = r.u8(field);
    v += (b & 0x7f) * scale;
    if ((b & 0x80) === 0) {
      if (!Number.isSafeInteger(v)) break;
      return v;
    }
    scale *= 0x80;
  }
  throw new InvalidInputError(`${field} is not a valid varint`, { details: { field } });
}

/**
 * Range lengths, run-length encoded: u32 count, then (varint length, varint repeat) runs.
 * A grant over 1,000 equal KV blocks is a handful of bytes.
 */
function writeRangeLengths(w: ByteWriter, lengths: Float64Array, byteLength: number): void {
  const n = lengths.length;
  if (n === 0 || n > MAX_GRANT_RANGES) throw new InvalidInputError(`a grant has 1 to ${MAX_GRANT_RANGES} ranges, got ${n}`, { details: { field: 'rangeLengths' } });
  w.u32(n);
  let sum = 0;
  for (let i = 0; i < n; ) {
    const len = lengths[i] as number;
    if (!Number.isSafeInteger(len) || len <= 0) throw new InvalidInputError(`range ${i} length ${len} must be a positive safe integer`, { details: { field: 'rangeLengths' } });
    let j = i + 1;
    while (j < n && lengths[j] === len) j++;
    writeVarint(w, len);
    writeVarint(w, j - i);
    sum += len * (j - i);
    i = j;
  }
  if (sum !== byteLength) throw new InvalidInputError(`range lengths sum to ${sum}, not byteLength ${byteLength}`, { details: { field: 'byteLength' } });
}

/** The same wire form from (length, repeat) runs: `count` ranges in all. */
function writeRangeRuns(w: ByteWriter, count: number, runs: readonly number[], byteLength: number): void {
  if (!Number.isSafeInteger(count) || count <= 0 || count > MAX_GRANT_RANGES) throw new InvalidInputError(`a grant has 1 to ${MAX_GRANT_RANGES} ranges, got ${count}`, { details: { field: 'rangeLengths' } });
  if (runs.length === 0 || runs.length % 2 !== 0) throw new InvalidInputError('range runs must be (length, repeat) pairs', { details: { field: 'rangeLengths' } });
  w.u32(count);
  let sum = 0;
  let n = 0;
  for (let k = 0; k < runs.length; k += 2) {
    const len = runs[k] as number;
    const repeat = runs[k + 1] as number;
    if (!Number.isSafeInteger(len) || len <= 0 || !Number.isSafeInteger(repeat) || repeat <= 0) {
      throw new InvalidInputError(`range run ${k / 2} (${len} × ${repeat}) must be positive safe integers`, { details: { field: 'rangeLengths' } });
    }
    writeVarint(w, len);
    writeVarint(w, repeat);
    sum += len * repeat;
    n += repeat;
  }
  if (n !== count) throw new InvalidInputError(`range runs cover ${n} ranges, not ${count}`, { details: { field: 'rangeLengths' } });
  if (sum !== byteLength) throw new InvalidInputError(`range lengths sum to ${sum}, not byteLength ${byteLength}`, { details: { field: 'byteLength' } });
}

function readRangeLengths(r: ByteReader, byteLength: number): Float64Array {
  const n = r.u32('range count');
  if (n === 0 || n > MAX_GRANT_RANGES) throw new InvalidInputError(`range count ${n} is not between 1 and ${MAX_GRANT_RANGES}`, { details: { field: 'range count' } });
  // The count is bounded (MAX_GRANT_RANGES); the runs must then add up to it exactly.
  const out = new Float64Array(n);
  let i = 0;
  let sum = 0;
  while (i < n) {
    const len = readVarint(r, 'range length');
    const repeat = readVarint(r, 'range repeat');
    if (len === 0 || repeat === 0 || repeat > n - i) throw new InvalidInputError('range list run is empty or runs past the range count', { details: { field: 'rangeLengths' } });
    sum += len * repeat;
    if (!Number.isSafeInteger(sum) || sum > byteLength) throw new InvalidInputError('range lengths exceed the byte length', { details: { field: 'rangeLengths' } });
    out.fill(len, i, i + repeat);
    i += repeat;
  }
  if (sum !== byteLength) throw new InvalidInputError(`range lengths sum to ${sum}, not byteLength ${byteLength}`, { details: { field: 'byteLength' } });
  return out;
}

export function decodeDescriptor(bytes: Uint8Array): MemoryDescriptor {
  const r = new ByteReader(bytes, 'memory descriptor');
  readMagic(r, DESCRIPTOR_MAGIC, DESCRIPTOR_VERSION, 'memory descriptor');
  const nodeId = r.str8('owner node id');
  assertOwner(nodeId);
  const incarnation = r.str8('owner incarnation');
  assertToken(incarnation, 'incarnation');
  const registrationId = r.str8('registration id');
  const problem = idProblem(registrationId, 'block');
  if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'registrationId' } });
  if (registrationId.split(':')[1] !== nodeId) {
    throw new InvalidInputError(`registration id ${registrationId} does not belong to owner ${nodeId}`, {
      details: { field: 'registrationId' },
    });
  }
  const memoryKind = byteToKind(r.u8('memory kind'));
  const byteLength = r.safeU64('byte length');
  if (byteLength === 0) throw new InvalidInputError('byte length is 0', { details: { field: 'byteLength' } });
  const flags = r.u8('flags');
  if (flags > 1) throw new InvalidInputError(`unknown descriptor flags ${flags}`, { details: { field: 'flags' } });
  const rangeLengths = flags === 1 ? readRangeLengths(r, byteLength) : undefined;
  const transports = readTransports(r);
  r.end();
  return rangeLengths === undefined
    ? { owner: { nodeId, incarnation }, registrationId, memoryKind, byteLength, transports }
    : { owner: { nodeId, incarnation }, registrationId, memoryKind, byteLength, rangeLengths, transports };
}

export function encodeEndpoint(e: PeerEndpoint): Uint8Array {
  assertOwner(e.identity.nodeId);
  assertToken(e.identity.incarnation, 'incarnation');
  assertToken(e.identity.hostId, 'hostId');
  const w = new ByteWriter(128);
  for (const b of ENDPOINT_MAGIC) w.u8(b);
  w.u8(ENDPOINT_VERSION).str8(e.identity.nodeId).str8(e.identity.incarnation).str8(e.identity.hostId);
  writeTransports(w, e.transports);
  return w.finish();
}

export function decodeEndpoint(bytes: Uint8Array): PeerEndpoint {
  const r = new ByteReader(bytes, 'peer endpoint');
  readMagic(r, ENDPOINT_MAGIC, ENDPOINT_VERSION, 'peer endpoint');
  const nodeId = r.str8('node id');
  assertOwner(nodeId);
  const incarnation = r.str8('incarnation');
  assertToken(incarnation, 'incarnation');
  const hostId = r.str8('host id');
  assertToken(hostId, 'hostId');
  const transports = readTransports(r);
  r.end();
  return { identity: { nodeId, incarnation, hostId }, transports };
}

/** Endpoint blobs travel in JSON and environment variables as base64url. */
export function endpointToString(bytes: Uint8Array): string {
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('base64url');
}
export function endpointFromString(text: string): Uint8Array {
  if (typeof text !== 'string' || !/^[A-Za-z0-9_-]*$/.test(text)) {
    throw new InvalidInputError('endpoint string is not base64url', { details: { field: 'endpoint' } });
  }
  return new Uint8Array(Buffer.from(text, 'base64url'));
}
