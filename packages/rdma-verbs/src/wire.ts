/**
 * Wire formats of the rdma transport (all integers big-endian, through core's
 * bounds-checked ByteReader/ByteWriter; every decoder rejects trailing bytes):
 *
 * Endpoint blob (in the engine's endpoint, tells a peer how to reach us out of band):
 *   "RVE" u8 version=1 | str8 host | u16 tcpPort | str8 device | u8 linkLayer (1 IB, 2 Ethernet)
 *   | u16 lid | 16 bytes gid | u8 activeMtu (ibv_mtu)
 *
 * Descriptor payload (the rdma part of a memory descriptor):
 *   "RVD" u8 version=1 | u8 grant | grant body
 *     grant 0, whole-MR rkey:   u64 addr | u64 length | u32 rkey
 *     grant 1, memory window:   u64 addr | u64 length | 16 bytes grant token (the requester
 *                               asks the holder to bind type-2 windows for it on its
 *                               connection: BIND below)
 *     grant 2, range grant:     u64 length (sum of the ranges) | u8 mode (0 whole-MR rkeys,
 *                               1 memory windows) | u32 rangeCount | 16 bytes grant token. No
 *                               address: the requester learns where each range is with one
 *                               GRANT_BIND per grant and connection (the range lengths travel
 *                               in core's descriptor envelope, not here)
 *
 * Control frames on the out-of-band TCP socket: u32 length (≤ MAX_FRAME) | u8 type | body
 *   HELLO  (1): "RVH" u8 version=1 | setup | str8 targetNodeId | str8 targetIncarnation
 *   ACCEPT (2): "RVH" u8 version=1 | setup
 *   READY  (3), RETIRE (5), CLOSE (6): empty
 *   REJECT (4): str8 code | blob16 utf-8 message
 *   BIND   (7): u32 requestId | 16 bytes grant token      — requester → holder
 *   BOUND  (8): u32 requestId | u8 count | count × u32 rkey — one window per queue pair, in order
 *   REFUSE (9): u32 requestId | str8 code | blob16 utf-8 message
 *   UNBIND (10): 16 bytes grant token                      — holder → requester: revoked
 *   Range grants (requester → holder: GRANT_BIND, GRANT_UNBOUND; the rest holder → requester).
 *   The answer to one GRANT_BIND is GRANT_HEAD, then the regions, keys and ranges tables in
 *   parts of at most MAX_FRAME bytes each, in order (part `first` = entries sent so far), or
 *   GRANT_REFUSE. Range k is at region_base[key_region[range_key[k]]] + range_offset[k], opened
 *   by the key's rkeys (one for all queue pairs, or one per queue pair in order):
 *   GRANT_BIND    (11): u32 requestId | u32 rangeCount | u8 mode | u64 length | 16 bytes grant token
 *                       — the descriptor payload's fields: the holder refuses a count, mode or
 *                       length that is not the grant's, as it refuses an unknown token
 *   GRANT_HEAD    (12): u32 requestId | u32 ranges | u32 keys | u32 regions | u8 rkeysPerKey
 *   GRANT_REGIONS (13): u32 requestId | u32 first | u16 n | n × u64 base address
 *   GRANT_KEYS    (14): u32 requestId | u32 first | u16 n | u8 rkeysPerKey
 *                       | n × (u32 region | rkeysPerKey × u32 rkey)
 *   GRANT_RANGES  (15): u32 requestId | u32 first | u16 n | n × (u32 key | u48 offset in its region
 *                       | u48 length) — the lengths the holder granted: the requester checks
 *                       against these, not only against the (forgeable) descriptor's
 *   GRANT_REFUSE  (16): u32 requestId | str8 code | blob16 utf-8 message
 *   GRANT_UNBIND  (17): 16 bytes grant token   — revoked; answer GRANT_UNBOUND once drained
 *   GRANT_UNBOUND (18): 16 bytes grant token   — nothing of this side uses the grant any more
 *   setup: str8 nodeId | str8 incarnation | str8 hostId | u8 linkLayer | u16 lid | 16 bytes gid
 *          | u8 activeMtu | u8 initiatorDepth | u8 responderResources | u8 qpCount
 *          | qpCount × (u32 qpn, u32 psn)      — qpn and psn are 24-bit
 */
import { assertOwner, ByteReader, ByteWriter, InvalidInputError, isToken, type NodeIdentity } from '@tensorwire/core';
import { isU24 } from './attributes.js';

export const WIRE_VERSION = 1;
export const MAX_FRAME = 4096;
export const MAX_QPS_PER_PEER = 16;

export interface RdmaEndpoint {
  readonly host: string;
  readonly port: number;
  readonly device: string;
  readonly linkLayer: number;
  readonly lid: number;
  /** 32 hex characters. */
  readonly gid: string;
  readonly activeMtu: number;
}

/** Size of a memory-window grant token: 128 random bits. */
export const GRANT_TOKEN_BYTES = 16;

/** A whole-MR grant: the rkey opens the registration on any queue pair. */
export interface MrGrant {
  readonly grant: 'mr';
  readonly addr: bigint;
  readonly length: number;
  readonly rkey: number;
}

/**
 * A memory-window grant: no rkey travels in the descriptor. The requester presents the token
 * on its own connection and the holder binds type-2 windows to that connection's queue pairs.
 */
export interface WindowGrant {
  readonly grant: 'window';
  readonly addr: bigint;
  readonly length: number;
  readonly token: Uint8Array;
}

/**
 * A range grant: one token over ranges of registrations, whatever their number. The payload
 * carries no address and no rkey: the requester presents the token (GRANT_BIND) and the holder
 * answers with where each range is and the keys that open it on that connection.
 */
export interface RangeGrant {
  readonly grant: 'ranges';
  /** Sum of the range lengths. */
  readonly length: number;
  /** The holder binds type-2 windows over the ranges (else whole-MR rkeys, requester-checked). */
  readonly windows: boolean;
  readonly count: number;
  readonly token: Uint8Array;
}

export type RemoteGrant = MrGrant | WindowGrant | RangeGrant;

export interface QpAddress {
  readonly qpn: number;
  readonly psn: number;
}

export interface QpSetup {
  readonly identity: NodeIdentity;
  readonly linkLayer: number;
  readonly lid: number;
  readonly gid: string;
  readonly activeMtu: number;
  readonly initiatorDepth: number;
  readonly responderResources: number;
  readonly qps: readonly QpAddress[];
}

export type ControlMessage =
  | { readonly type: 'hello'; readonly setup: QpSetup; readonly target: { readonly nodeId: string; readonly incarnation: string } }
  | { readonly type: 'accept'; readonly setup: QpSetup }
  | { readonly type: 'ready' }
  | { readonly type: 'reject'; readonly code: string; readonly message: string }
  | { readonly type: 'retire' }
  | { readonly type: 'close' }
  | { readonly type: 'bind'; readonly requestId: number; readonly token: Uint8Array }
  | { readonly type: 'bound'; readonly requestId: number; readonly rkeys: readonly number[] }
  | { readonly type: 'refuse'; readonly requestId: number; readonly code: string; readonly message: string }
  | { readonly type: 'unbind'; readonly token: Uint8Array }
  | { readonly type: 'grant-bind'; readonly requestId: number; readonly count: number; readonly windows: boolean; readonly length: number; readonly token: Uint8Array }
  | { readonly type: 'grant-head'; readonly requestId: number; readonly ranges: number; readonly keys: number; readonly regions: number; readonly rkeysPerKey: number }
  | { readonly type: 'grant-regions'; readonly requestId: number; readonly first: number; readonly hi: Uint32Array; readonly lo: Uint32Array }
  | { readonly type: 'grant-keys'; readonly requestId: number; readonly first: number; readonly rkeysPerKey: number; readonly region: Uint32Array; readonly rkeys: Uint32Array }
  | { readonly type: 'grant-ranges'; readonly requestId: number; readonly first: number; readonly key: Uint32Array; readonly offset: Float64Array; readonly length: Float64Array }
  | { readonly type: 'grant-refuse'; readonly requestId: number; readonly code: string; readonly message: string }
  | { readonly type: 'grant-unbind'; readonly token: Uint8Array }
  | { readonly type: 'grant-unbound'; readonly token: Uint8Array };

const TYPE_CODES = {
  hello: 1,
  accept: 2,
  ready: 3,
  reject: 4,
  retire: 5,
  close: 6,
  bind: 7,
  bound: 8,
  refuse: 9,
  unbind: 10,
  'grant-bind': 11,
  'grant-head': 12,
  'grant-regions': 13,
  'grant-keys': 14,
  'grant-ranges': 15,
  'grant-refuse': 16,
  'grant-unbind': 17,
  'grant-unbound': 18,
} as const;

/** Ranges one grant may have (core's MAX_GRANT_RANGES). */
export const MAX_RANGE_GRANT_RANGES = 1 << 20;
/** Table entries per GRANT_REGIONS / GRANT_KEYS / GRANT_RANGES part: each frame stays within MAX_FRAME. */
export const GRANT_PART_ENTRIES = { regions: 500, ranges: 250 } as const;
/** Keys per GRANT_KEYS part with `rkeysPerKey` rkeys each. */
export function grantKeysPerPart(rkeysPerKey: number): number {
  return Math.floor((MAX_FRAME - 16) / (4 + 4 * rkeysPerKey));
}

function bad(what: string, field: string, message: string): never {
  throw new InvalidInputError(`${what}: ${message}`, { details: { field } });
}

function magic(r: ByteReader, m: string, what: string): void {
  for (let i = 0; i < m.length; i++) if (r.u8('magic') !== m.charCodeAt(i)) bad(what, 'magic', 'bad magic');
  const v = r.u8('version');
  if (v !== WIRE_VERSION) bad(what, 'version', `version ${v} is not supported (expected ${WIRE_VERSION})`);
}

function writeMagic(w: ByteWriter, m: string): void {
  for (let i = 0; i < m.length; i++) w.u8(m.charCodeAt(i));
  w.u8(WIRE_VERSION);
}

function gidBytes(gid: string, what: string): Uint8Array {
  if (!/^[0-9a-f]{32}$/.test(gid)) bad(what, 'gid', 'GID must be 32 lowercase hex characters');
  return new Uint8Array(Buffer.from(gid, 'hex'));
}

function readGid(r: ByteReader): string {
  return Buffer.from(r.bytes(16, 'gid')).toString('hex');
}

function checkLinkLayer(v: number, what: string): void {
  if (v !== 1 && v !== 2) bad(what, 'linkLayer', `link layer ${v} is neither InfiniBand (1) nor Ethernet (2)`);
}

function checkMtu(v: number, what: string): void {
  if (!Number.isInteger(v) || v < 1 || v > 5) bad(what, 'activeMtu', `MTU ${v} is not an ibv_mtu (1..5)`);
}

function checkToken(v: string, field: string, what: string): void {
  if (!isToken(v)) bad(what, field, `${field} must be 1-64 characters of [A-Za-z0-9_-]`);
}

// ---------------------------------------------------------------------------- endpoint

export function encodeEndpoint(e: RdmaEndpoint): Uint8Array {
  const what = 'rdma endpoint';
  if (e.host.length === 0) bad(what, 'host', 'host is empty');
  if (!Number.isInteger(e.port) || e.port < 1 || e.port > 0xffff) bad(what, 'port', `port ${e.port} out of range`);
  checkLinkLayer(e.linkLayer, what);
  checkMtu(e.activeMtu, what);
  if (!Number.isInteger(e.lid) || e.lid < 0 || e.lid > 0xffff) bad(what, 'lid', 'LID must be 16-bit');
  const w = new ByteWriter(64);
  writeMagic(w, 'RVE');
  w.str8(e.host).u16(e.port).str8(e.device).u8(e.linkLayer).u16(e.lid).bytes(gidBytes(e.gid, what)).u8(e.activeMtu);
  return w.finish();
}

export function decodeEndpoint(bytes: Uint8Array): RdmaEndpoint {
  const what = 'rdma endpoint';
  const r = new ByteReader(bytes, what);
  magic(r, 'RVE', what);
  const host = r.str8('host');
  if (host.length === 0) bad(what, 'host', 'host is empty');
  const port = r.u16('port');
  if (port === 0) bad(what, 'port', 'port 0');
  const device = r.str8('device');
  const linkLayer = r.u8('linkLayer');
  checkLinkLayer(linkLayer, what);
  const lid = r.u16('lid');
  const gid = readGid(r);
  const activeMtu = r.u8('activeMtu');
  checkMtu(activeMtu, what);
  r.end();
  return { host, port, device, linkLayer, lid, gid, activeMtu };
}

// ---------------------------------------------------------------------------- descriptor

/** Payload size of a whole-MR grant. */
export const DESCRIPTOR_PAYLOAD_BYTES = 25;
/** Payload size of a memory-window grant. */
export const WINDOW_DESCRIPTOR_PAYLOAD_BYTES = 37;
/** Payload size of a range grant, whatever its number of ranges. */
export const RANGE_DESCRIPTOR_PAYLOAD_BYTES = 34;

function checkGrantToken(t: Uint8Array, what: string): void {
  if (!(t instanceof Uint8Array) || t.length !== GRANT_TOKEN_BYTES) bad(what, 'token', `grant token must be ${GRANT_TOKEN_BYTES} bytes`);
}

export function encodeGrant(g: RemoteGrant): Uint8Array {
  const what = 'rdma descriptor';
  if (!Number.isSafeInteger(g.length) || g.length <= 0) bad(what, 'length', 'length must be a positive safe integer');
  if (g.grant === 'ranges') {
    if (!Number.isInteger(g.count) || g.count < 1 || g.count > MAX_RANGE_GRANT_RANGES) bad(what, 'count', `a range grant has 1 to ${MAX_RANGE_GRANT_RANGES} ranges`);
    if (g.count > g.length) bad(what, 'count', 'more ranges than bytes');
    checkGrantToken(g.token, what);
    const w = new ByteWriter(RANGE_DESCRIPTOR_PAYLOAD_BYTES);
    writeMagic(w, 'RVD');
    w.u8(2).u64(g.length).u8(g.windows ? 1 : 0).u32(g.count).bytes(g.token);
    return w.finish();
  }
  if (g.addr < 0n || g.addr + BigInt(g.length) > 0xffffffffffffffffn) bad(what, 'addr', 'address range exceeds 64 bits');
  if (g.grant === 'mr') {
    if (!Number.isInteger(g.rkey) || g.rkey < 0 || g.rkey > 0xffffffff) bad(what, 'rkey', 'rkey must be 32-bit');
    const w = new ByteWriter(DESCRIPTOR_PAYLOAD_BYTES);
    writeMagic(w, 'RVD');
    w.u8(0).u64(g.addr).u64(g.length).u32(g.rkey);
    return w.finish();
  }
  if (g.grant !== 'window') bad(what, 'grant', `unknown grant ${String((g as { grant: unknown }).grant)}`);
  checkGrantToken(g.token, what);
  const w = new ByteWriter(WINDOW_DESCRIPTOR_PAYLOAD_BYTES);
  writeMagic(w, 'RVD');
  w.u8(1).u64(g.addr).u64(g.length).bytes(g.token);
  return w.finish();
}

/** Decode a peer's payload; `byteLength` is what the engine's envelope says and must match. */
export function decodeGrant(bytes: Uint8Array, byteLength?: number): RemoteGrant {
  const what = 'rdma descriptor';
  const r = new ByteReader(bytes, what);
  magic(r, 'RVD', what);
  const kind = r.u8('grant');
  if (kind !== 0 && kind !== 1 && kind !== 2) bad(what, 'grant', `grant kind ${kind} is not supported`);
  let g: RemoteGrant;
  if (kind === 2) {
    const length = r.safeU64('length');
    if (length === 0) bad(what, 'length', 'length is 0');
    const mode = r.u8('mode');
    if (mode !== 0 && mode !== 1) bad(what, 'mode', `range grant mode ${mode} is not supported`);
    const count = r.u32('count');
    if (count < 1 || count > MAX_RANGE_GRANT_RANGES) bad(what, 'count', `a range grant has 1 to ${MAX_RANGE_GRANT_RANGES} ranges, got ${count}`);
    if (count > length) bad(what, 'count', `${count} ranges cannot cover ${length} bytes`);
    g = { grant: 'ranges', length, windows: mode === 1, count, token: new Uint8Array(r.bytes(GRANT_TOKEN_BYTES, 'token')) };
  } else {
    const addr = r.u64('addr');
    const length = r.safeU64('length');
    if (length === 0) bad(what, 'length', 'length is 0');
    if (addr + BigInt(length) > 0xffffffffffffffffn) bad(what, 'addr', 'address range exceeds 64 bits');
    if (kind === 0) {
      g = { grant: 'mr', addr, length, rkey: r.u32('rkey') };
    } else {
      g = { grant: 'window', addr, length, token: new Uint8Array(r.bytes(GRANT_TOKEN_BYTES, 'token')) };
    }
  }
  r.end();
  if (byteLength !== undefined && byteLength !== g.length) {
    bad(what, 'length', `${g.grant === 'ranges' ? 'the granted ranges cover' : 'registration covers'} ${g.length} bytes but the descriptor claims ${byteLength}`);
  }
  return g;
}

// ---------------------------------------------------------------------------- control frames

function writeSetup(w: ByteWriter, s: QpSetup, what: string): void {
  assertOwner(s.identity.nodeId);
  checkToken(s.identity.incarnation, 'incarnation', what);
  checkToken(s.identity.hostId, 'hostId', what);
  checkLinkLayer(s.linkLayer, what);
  checkMtu(s.activeMtu, what);
  if (s.qps.length < 1 || s.qps.length > MAX_QPS_PER_PEER) bad(what, 'qpCount', `1..${MAX_QPS_PER_PEER} queue pairs, got ${s.qps.length}`);
  for (const [name, v] of [
    ['initiatorDepth', s.initiatorDepth],
    ['responderResources', s.responderResources],
  ] as const) {
    if (!Number.isInteger(v) || v < 1 || v > 255) bad(what, name, `${name} must be 1..255`);
  }
  w.str8(s.identity.nodeId).str8(s.identity.incarnation).str8(s.identity.hostId);
  w.u8(s.linkLayer).u16(s.lid).bytes(gidBytes(s.gid, what)).u8(s.activeMtu).u8(s.initiatorDepth).u8(s.responderResources);
  w.u8(s.qps.length);
  for (const q of s.qps) {
    if (!isU24(q.qpn) || !isU24(q.psn)) bad(what, 'qp', 'QPN and PSN are 24-bit');
    w.u32(q.qpn).u32(q.psn);
  }
}

function readOwner(r: ByteReader, field: string, what: string, label: string): string {
  const v = r.str8(field);
  try {
    assertOwner(v);
  } catch {
    bad(what, field, `${label} is not a valid owner name`);
  }
  return v;
}

function readSetup(r: ByteReader, what: string): QpSetup {
  const nodeId = readOwner(r, 'nodeId', what, 'node id');
  const incarnation = r.str8('incarnation');
  checkToken(incarnation, 'incarnation', what);
  const hostId = r.str8('hostId');
  checkToken(hostId, 'hostId', what);
  const linkLayer = r.u8('linkLayer');
  checkLinkLayer(linkLayer, what);
  const lid = r.u16('lid');
  const gid = readGid(r);
  const activeMtu = r.u8('activeMtu');
  checkMtu(activeMtu, what);
  const initiatorDepth = r.u8('initiatorDepth');
  const responderResources = r.u8('responderResources');
  if (initiatorDepth === 0 || responderResources === 0) bad(what, 'rdAtomic', 'READ depths must be at least 1');
  const count = r.u8('qpCount');
  if (count < 1 || count > MAX_QPS_PER_PEER) bad(what, 'qpCount', `1..${MAX_QPS_PER_PEER} queue pairs, got ${count}`);
  const qps: QpAddress[] = [];
  for (let i = 0; i < count; i++) {
    const qpn = r.u32('qpn');
    const psn = r.u32('psn');
    if (!isU24(qpn) || !isU24(psn)) bad(what, 'qp', 'QPN and PSN are 24-bit');
    qps.push({ qpn, psn });
  }
  return { identity: { nodeId, incarnation, hostId }, linkLayer, lid, gid, activeMtu, initiatorDepth, responderResources, qps };
}

/** Encode one message as a complete frame (length prefix included). */
export function encodeFrame(m: ControlMessage): Uint8Array {
  const what = `rdma ${m.type} message`;
  const w = new ByteWriter(128);
  w.u8(TYPE_CODES[m.type]);
  switch (m.type) {
    case 'hello':
      writeMagic(w, 'RVH');
      writeSetup(w, m.setup, what);
      assertOwner(m.target.nodeId);
      checkToken(m.target.incarnation, 'targetIncarnation', what);
      w.str8(m.target.nodeId).str8(m.target.incarnation);
      break;
    case 'accept':
      writeMagic(w, 'RVH');
      writeSetup(w, m.setup, what);
      break;
    case 'reject':
      w.str8(m.code.slice(0, 64)).blob16(new TextEncoder().encode(m.message.slice(0, 1000)));
      break;
    case 'bind':
      checkRequestId(m.requestId, what);
      checkGrantToken(m.token, what);
      w.u32(m.requestId).bytes(m.token);
      break;
    case 'bound':
      checkRequestId(m.requestId, what);
      if (m.rkeys.length < 1 || m.rkeys.length > MAX_QPS_PER_PEER) bad(what, 'rkeys', `1..${MAX_QPS_PER_PEER} rkeys, got ${m.rkeys.length}`);
      w.u32(m.requestId).u8(m.rkeys.length);
      for (const k of m.rkeys) {
        if (!Number.isInteger(k) || k < 0 || k > 0xffffffff) bad(what, 'rkeys', 'rkey must be 32-bit');
        w.u32(k);
      }
      break;
    case 'refuse':
      checkRequestId(m.requestId, what);
      w.u32(m.requestId).str8(m.code.slice(0, 64)).blob16(new TextEncoder().encode(m.message.slice(0, 1000)));
      break;
    case 'unbind':
    case 'grant-unbind':
    case 'grant-unbound':
      checkGrantToken(m.token, what);
      w.bytes(m.token);
      break;
    case 'grant-bind':
      checkRequestId(m.requestId, what);
      checkCount(m.count, 1, MAX_RANGE_GRANT_RANGES, 'count', what);
      if (typeof m.windows !== 'boolean') bad(what, 'mode', 'mode must be a boolean');
      if (!Number.isSafeInteger(m.length) || m.length < m.count) bad(what, 'length', 'length must be a safe integer of at least one byte per range');
      checkGrantToken(m.token, what);
      w.u32(m.requestId).u32(m.count).u8(m.windows ? 1 : 0).u64(m.length).bytes(m.token);
      break;
    case 'grant-head':
      checkRequestId(m.requestId, what);
      checkCount(m.ranges, 1, MAX_RANGE_GRANT_RANGES, 'ranges', what);
      checkCount(m.keys, 1, m.ranges, 'keys', what);
      checkCount(m.regions, 1, m.keys, 'regions', what);
      checkCount(m.rkeysPerKey, 1, MAX_QPS_PER_PEER, 'rkeysPerKey', what);
      w.u32(m.requestId).u32(m.ranges).u32(m.keys).u32(m.regions).u8(m.rkeysPerKey);
      break;
    case 'grant-regions': {
      const n = m.hi.length;
      checkRequestId(m.requestId, what);
      checkRequestId(m.first, what);
      checkCount(n, 1, GRANT_PART_ENTRIES.regions, 'regions', what);
      if (m.lo.length !== n) bad(what, 'regions', 'hi and lo differ in length');
      w.u32(m.requestId).u32(m.first).u16(n);
      for (let i = 0; i < n; i++) w.u32(m.hi[i] as number).u32(m.lo[i] as number);
      break;
    }
    case 'grant-keys': {
      const n = m.region.length;
      const per = m.rkeysPerKey;
      checkRequestId(m.requestId, what);
      checkRequestId(m.first, what);
      checkCount(per, 1, MAX_QPS_PER_PEER, 'rkeysPerKey', what);
      checkCount(n, 1, grantKeysPerPart(per), 'keys', what);
      if (m.rkeys.length !== n * per) bad(what, 'rkeys', `${n} keys need ${n * per} rkeys, got ${m.rkeys.length}`);
      w.u32(m.requestId).u32(m.first).u16(n).u8(per);
      for (let i = 0; i < n; i++) {
        w.u32(m.region[i] as number);
        for (let q = 0; q < per; q++) w.u32(m.rkeys[i * per + q] as number);
      }
      break;
    }
    case 'grant-ranges': {
      const n = m.key.length;
      checkRequestId(m.requestId, what);
      checkRequestId(m.first, what);
      checkCount(n, 1, GRANT_PART_ENTRIES.ranges, 'ranges', what);
      if (m.offset.length !== n || m.length.length !== n) bad(what, 'ranges', 'key, offset and length differ in length');
      w.u32(m.requestId).u32(m.first).u16(n);
      for (let i = 0; i < n; i++) {
        const off = m.offset[i] as number;
        const len = m.length[i] as number;
        if (!Number.isInteger(off) || off < 0 || off >= 2 ** 48) bad(what, 'offset', 'a range offset is a 48-bit integer');
        if (!Number.isInteger(len) || len < 1 || len >= 2 ** 48) bad(what, 'length', 'a range length is a positive 48-bit integer');
        w.u32(m.key[i] as number);
        u48(w, off);
        u48(w, len);
      }
      break;
    }
    case 'grant-refuse':
      checkRequestId(m.requestId, what);
      w.u32(m.requestId).str8(m.code.slice(0, 64)).blob16(new TextEncoder().encode(m.message.slice(0, 1000)));
      break;
    default:
      break;
  }
  const body = w.finish();
  if (body.length > MAX_FRAME) bad(what, 'length', 'message exceeds the frame limit');
  return new ByteWriter(body.length + 4).blob32(body).finish();
}

function checkRequestId(id: number, what: string): void {
  if (!Number.isInteger(id) || id < 0 || id > 0xffffffff) bad(what, 'requestId', 'request id must be 32-bit');
}

function u48(w: ByteWriter, v: number): void {
  const hi = Math.floor(v / 0x100000000);
  w.u16(hi).u32(v - hi * 0x100000000);
}

function readU48(r: ByteReader, field: string): number {
  const hi = r.u16(field);
  return hi * 0x100000000 + r.u32(field);
}

function checkCount(v: number, min: number, max: number, field: string, what: string): void {
  if (!Number.isInteger(v) || v < min || v > max) bad(what, field, `${field} must be ${min}..${max}, got ${v}`);
}

function readText(r: ByteReader, what: string): string {
  const bytes = r.blob16('message');
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    return bad(what, 'message', 'message is not UTF-8');
  }
}

/** Decode a frame body (without its length prefix). */
export function decodeMessage(body: Uint8Array): ControlMessage {
  const r = new ByteReader(body, 'rdma control message');
  const type = r.u8('type');
  let m: ControlMessage;
  switch (type) {
    case 1: {
      const what = 'rdma hello message';
      magic(r, 'RVH', what);
      const setup = readSetup(r, what);
      const nodeId = readOwner(r, 'targetNodeId', what, 'target node id');
      const incarnation = r.str8('targetIncarnation');
      checkToken(incarnation, 'targetIncarnation', what);
      m = { type: 'hello', setup, target: { nodeId, incarnation } };
      break;
    }
    case 2:
      magic(r, 'RVH', 'rdma accept message');
      m = { type: 'accept', setup: readSetup(r, 'rdma accept message') };
      break;
    case 3:
      m = { type: 'ready' };
      break;
    case 4: {
      const code = r.str8('code');
      m = { type: 'reject', code, message: readText(r, 'rdma reject message') };
      break;
    }
    case 5:
      m = { type: 'retire' };
      break;
    case 6:
      m = { type: 'close' };
      break;
    case 7:
      m = { type: 'bind', requestId: r.u32('requestId'), token: new Uint8Array(r.bytes(GRANT_TOKEN_BYTES, 'token')) };
      break;
    case 8: {
      const requestId = r.u32('requestId');
      const count = r.u8('count');
      if (count < 1 || count > MAX_QPS_PER_PEER) bad('rdma bound message', 'rkeys', `1..${MAX_QPS_PER_PEER} rkeys, got ${count}`);
      const rkeys: number[] = [];
      for (let i = 0; i < count; i++) rkeys.push(r.u32('rkey'));
      m = { type: 'bound', requestId, rkeys };
      break;
    }
    case 9: {
      const requestId = r.u32('requestId');
      const code = r.str8('code');
      m = { type: 'refuse', requestId, code, message: readText(r, 'rdma refuse message') };
      break;
    }
    case 10:
      m = { type: 'unbind', token: new Uint8Array(r.bytes(GRANT_TOKEN_BYTES, 'token')) };
      break;
    case 11: {
      const what = 'rdma grant-bind message';
      const requestId = r.u32('requestId');
      const count = r.u32('count');
      checkCount(count, 1, MAX_RANGE_GRANT_RANGES, 'count', what);
      const mode = r.u8('mode');
      if (mode !== 0 && mode !== 1) bad(what, 'mode', `range grant mode ${mode} is not supported`);
      const length = r.safeU64('length');
      if (length < count) bad(what, 'length', `${count} ranges cannot cover ${length} bytes`);
      m = { type: 'grant-bind', requestId, count, windows: mode === 1, length, token: new Uint8Array(r.bytes(GRANT_TOKEN_BYTES, 'token')) };
      break;
    }
    case 12: {
      const what = 'rdma grant-head message';
      const requestId = r.u32('requestId');
      const ranges = r.u32('ranges');
      const keys = r.u32('keys');
      const regions = r.u32('regions');
      const rkeysPerKey = r.u8('rkeysPerKey');
      checkCount(ranges, 1, MAX_RANGE_GRANT_RANGES, 'ranges', what);
      checkCount(keys, 1, ranges, 'keys', what);
      checkCount(regions, 1, keys, 'regions', what);
      checkCount(rkeysPerKey, 1, MAX_QPS_PER_PEER, 'rkeysPerKey', what);
      m = { type: 'grant-head', requestId, ranges, keys, regions, rkeysPerKey };
      break;
    }
    case 13: {
      const what = 'rdma grant-regions message';
      const requestId = r.u32('requestId');
      const first = r.u32('first');
      const n = r.u16('n');
      checkCount(n, 1, GRANT_PART_ENTRIES.regions, 'regions', what);
      const hi = new Uint32Array(n);
      const lo = new Uint32Array(n);
      for (let i = 0; i < n; i++) {
        hi[i] = r.u32('addr');
        lo[i] = r.u32('addr');
      }
      m = { type: 'grant-regions', requestId, first, hi, lo };
      break;
    }
    case 14: {
      const what = 'rdma grant-keys message';
      const requestId = r.u32('requestId');
      const first = r.u32('first');
      const n = r.u16('n');
      const per = r.u8('rkeysPerKey');
      checkCount(per, 1, MAX_QPS_PER_PEER, 'rkeysPerKey', what);
      checkCount(n, 1, grantKeysPerPart(per), 'keys', what);
      const region = new Uint32Array(n);
      const rkeys = new Uint32Array(n * per);
      for (let i = 0; i < n; i++) {
        region[i] = r.u32('region');
        for (let q = 0; q < per; q++) rkeys[i * per + q] = r.u32('rkey');
      }
      m = { type: 'grant-keys', requestId, first, rkeysPerKey: per, region, rkeys };
      break;
    }
    case 15: {
      const what = 'rdma grant-ranges message';
      const requestId = r.u32('requestId');
      const first = r.u32('first');
      const n = r.u16('n');
      checkCount(n, 1, GRANT_PART_ENTRIES.ranges, 'ranges', what);
      const key = new Uint32Array(n);
      const offset = new Float64Array(n);
      const length = new Float64Array(n);
      for (let i = 0; i < n; i++) {
        key[i] = r.u32('key');
        offset[i] = readU48(r, 'offset');
        const len = readU48(r, 'length');
        if (len === 0) bad(what, 'length', `range ${first + i} has length 0`);
        length[i] = len;
      }
      m = { type: 'grant-ranges', requestId, first, key, offset, length };
      break;
    }
    case 16: {
      const requestId = r.u32('requestId');
      const code = r.str8('code');
      m = { type: 'grant-refuse', requestId, code, message: readText(r, 'rdma grant-refuse message') };
      break;
    }
    case 17:
      m = { type: 'grant-unbind', token: new Uint8Array(r.bytes(GRANT_TOKEN_BYTES, 'token')) };
      break;
    case 18:
      m = { type: 'grant-unbound', token: new Uint8Array(r.bytes(GRANT_TOKEN_BYTES, 'token')) };
      break;
    default:
      bad('rdma control message', 'type', `unknown message type ${type}`);
  }
  r.end();
  return m;
}

/**
 * Where a range grant's ranges are, as the holder sends it (GRANT_HEAD and the three tables):
 * range k is `rangeLength[k]` bytes at `regionHi/regionLo[keyRegion[rangeKey[k]]] + rangeOffset[k]`,
 * opened by `rkeys[key * rkeysPerKey + (rkeysPerKey > 1 ? queuePair : 0)]`.
 */
export interface GrantTableData {
  readonly regionHi: Uint32Array;
  readonly regionLo: Uint32Array;
  readonly keyRegion: Uint32Array;
  readonly rkeysPerKey: number;
  readonly rkeys: Uint32Array;
  readonly rangeKey: Uint32Array;
  readonly rangeOffset: Float64Array;
  readonly rangeLength: Float64Array;
}

/**
 * The frames answering one GRANT_BIND, produced lazily (the caller writes them as the socket
 * drains): GRANT_HEAD, then the regions, keys and ranges in parts within MAX_FRAME.
 */
export function* encodeGrantTable(requestId: number, t: GrantTableData): Generator<Uint8Array> {
  const ranges = t.rangeKey.length;
  const keys = t.keyRegion.length;
  const regions = t.regionHi.length;
  const per = t.rkeysPerKey;
  yield encodeFrame({ type: 'grant-head', requestId, ranges, keys, regions, rkeysPerKey: per });
  for (let first = 0; first < regions; first += GRANT_PART_ENTRIES.regions) {
    const end = Math.min(regions, first + GRANT_PART_ENTRIES.regions);
    yield encodeFrame({ type: 'grant-regions', requestId, first, hi: t.regionHi.subarray(first, end), lo: t.regionLo.subarray(first, end) });
  }
  const keysPerPart = grantKeysPerPart(per);
  for (let first = 0; first < keys; first += keysPerPart) {
    const end = Math.min(keys, first + keysPerPart);
    yield encodeFrame({ type: 'grant-keys', requestId, first, rkeysPerKey: per, region: t.keyRegion.subarray(first, end), rkeys: t.rkeys.subarray(first * per, end * per) });
  }
  for (let first = 0; first < ranges; first += GRANT_PART_ENTRIES.ranges) {
    const end = Math.min(ranges, first + GRANT_PART_ENTRIES.ranges);
    yield encodeFrame({
      type: 'grant-ranges',
      requestId,
      first,
      key: t.rangeKey.subarray(first, end),
      offset: t.rangeOffset.subarray(first, end),
      length: t.rangeLength.subarray(first, end),
    });
  }
}

/**
 * Splits a byte stream into frames. `push` returns the complete messages so far and throws
 * InvalidInputError on an oversized or malformed frame (the caller drops the socket).
 */
export class FrameReader {
  #buf: Buffer = Buffer.alloc(0);
  push(chunk: Uint8Array): ControlMessage[] {
    this.#buf = this.#buf.length === 0 ? Buffer.from(chunk) : Buffer.concat([this.#buf, chunk]);
    const out: ControlMessage[] = [];
    for (;;) {
      if (this.#buf.length < 4) break;
      const len = this.#buf.readUInt32BE(0);
      if (len === 0 || len > MAX_FRAME) bad('rdma control frame', 'length', `frame of ${len} bytes (limit ${MAX_FRAME})`);
      if (this.#buf.length < 4 + len) break;
      const body = new Uint8Array(this.#buf.subarray(4, 4 + len));
      this.#buf = this.#buf.subarray(4 + len);
      out.push(decodeMessage(body));
    }
    return out;
  }
  get buffered(): number {
    return this.#buf.length;
  }
}
