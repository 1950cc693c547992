/**
 * The `cuda-ipc` transport: same-host, one-sided transfers through shared memory and CUDA
 * IPC, implementing @tensorwire/core's transport interface v2 (one {@link TransferBatch} per
 * stream: typed-array ranges over small tables of handles).
 *
 * Design (see README, "Transport"):
 * - Connectionless. `start()` creates a presence segment `/tw-n.<node>.<random>` whose
 *   header names the node and incarnation (`node:<nodeId>:<incarnation>`); the endpoint blob
 *   carries the host id and that segment's name. `connect()` opens it and checks the id,
 *   the state and the pid, which proves the peer's nodeId and incarnation to a process of
 *   the same user on the same host. Every `execute()` re-checks the presence segment and the
 *   peer's pid, so a closed or dead peer gives ConnectionBrokenError.
 * - Grants. Registering host memory that lives in one of this package's shared segments
 *   (a pool slot, or {@link allocateSharedMemory}) or CUDA memory creates a grant segment
 *   `/tw-g.<node>.<random>` with a random 128-bit token, the target (segment name + range,
 *   or CUDA IPC handle + offset) and an in-flight counter. The descriptor payload carries
 *   the grant name and token. A peer's batch enters each of its grants once (counter++, then
 *   state and token checked, seq_cst), copies, and leaves. `revoke()` marks the grant dead, zeroes the
 *   token, waits for the counter to reach 0, then unlinks it: after that every access fails
 *   with RemoteRejectedError, even through mappings the peer has cached. A grant over a pool
 *   slot is read-only to peers, and a peer reads it under the slot's seqlock (never torn).
 * - Range grants (`grant()`, register once, grant per lease): one record in a grant table
 *   segment `/tw-t.<node>.<random>` (one per transport, a few more when it fills up) holds the
 *   state, a 128-bit token, an in-flight counter, a generation and where the grant's range
 *   table lies in the table's arena; the table's directory names the data segments the ranges
 *   lie in. No segment per grant: granting is O(ranges) stores and one publish, `revokeGrant()`
 *   is O(1) (mark revoked, zero the token, bump the generation, wait for the counter to drain,
 *   free the record). The payload is table name + record + generation + token. A peer maps the
 *   table once per connection, reads a grant's range table once (entered, so it cannot change
 *   under it), and each batch enters the record (generation and token checked) and copies each
 *   range only inside its granted range. See src/grants.ts.
 * - Batches. A batch of host memory on both sides is one native call (`copyBatch`): the
 *   transport resolves each distinct grant, data segment and local handle of the batch once
 *   (cached per batch), and the addon validates every range against its granted range and the
 *   real buffer and mapping lengths, enters each grant once, copies every range, and leaves;
 *   all of a pool slot's ranges in a batch are one seqlock snapshot. Batches with CUDA memory
 *   on either side take a per-range path (one driver copy per range); range grants are served
 *   between host memory only.
 * - One stream. Every host batch is one native copy (on the calling thread, or off it from
 *   `asyncCopyBytes` up), and the copy pool already spreads a large one over threads; splitting
 *   a transfer over streams would split one slot's ranges into several snapshots:
 *   `capabilities.maxStreams` is 1.
 * - Other host memory (a plain Uint8Array) registers as local-only: it can be the local
 *   side of any transfer, and a peer that tries to use it remotely gets a clear
 *   InvalidInputError from decodeRemote.
 */
import { randomBytes } from 'node:crypto';
import { chmodSync, unlinkSync } from 'node:fs';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { availableParallelism } from 'node:os';
import {
  AbortedError,
  BackendUnavailableError,
  engineCheckedBlocks,
  ByteReader,
  ByteWriter,
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  SessionInvalidatedError,
  TRANSPORT_SPECIFICATION_VERSION,
  TensorwireError,
  errorFromSignal,
  formatId,
  silentLogger,
  kit,
  type ConnectOptions,
  type ExecuteOptions,
  type Logger,
  type MetricsOptions,
  type Memory,
  type MemoryKind,
  type NodeIdentity,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
  type TransferBatch,
  type GrantBlocks,
  type GrantRanges,
  GRANT_STRIDE,
  RANGE_STRIDE,
  RangeField,
  ResourceExhaustedError,
  errorFromCode,
  isToken,
} from '@tensorwire/core';
import { CopyControl, GrantResult, SegmentKind, SegmentState, capabilities as nativeCapabilities, native, nativeFlag, nativeHas, type BatchPlanHandle } from './native.js';
import {
  GrantTable,
  RANGE_BYTES,
  RECORD_BYTES,
  RecordForm,
  blockTableBytes,
  checkGeometry,
  freshToken,
  grownGeometry,
  openTableView,
  readRangeTable,
  type DirSegment,
  type GrantedSegment,
  type TableGeometry,
  type TableView,
} from './grants.js';
import { randomSegmentName, segmentNameProblem } from './names.js';
import { isProcessAlive, selfStartTime } from './proc.js';
import { HEADER_SIZE, MAX_SEGMENT_BYTES, forgetSocketAtExit, hookExit, newSocketPath, regionOf, unlinkSocketAtExit } from './shared.js';

const ENDPOINT_MAGIC = [0x54, 0x57, 0x43, 0x45]; // TWCE
const PAYLOAD_MAGIC = [0x54, 0x57, 0x43, 0x47]; // TWCG
const WIRE_VERSION = 1;
const TOKEN_BYTES = 16;
/** Payload modes: local only, a whole registration (grant segment), a range grant (table record). */
const MODE_LOCAL = 0;
const MODE_REGISTRATION = 1;
const MODE_RANGES = 2;
/** A block grant: the same fields as MODE_RANGES, its record's table in the blocks form. */
const MODE_BLOCKS = 3;

// Grant ext offsets (native/layout.h).
const EXT = 1024;
const G_TOKEN = EXT;
const G_TARGET = EXT + 16;
const G_OFFSET = EXT + 24;
const G_LENGTH = EXT + 32;
const G_NAME_LEN = EXT + 40;
const G_NAME = EXT + 41;
/** u32 grant flags (after the 200-byte name); immutable once the grant is live. */
const G_FLAGS = EXT + 248;
/** u64: a CUDA grant's allocation base in its owner's address space. */
const G_OWNER_POINTER = EXT + 256;
/** 16 bytes: the owner process's {@link PROCESS_ID}. */
const G_OWNER_PROCESS = EXT + 264;
/**
 * A random id of this process, one for every copy of this package loaded in it. A peer in the
 * same process (two engines in one process) finds it in a CUDA grant and uses the owner's
 * device pointer directly: CUDA refuses cuIpcOpenMemHandle on a handle exported by the same
 * process.
 */
const PROCESS_ID: Uint8Array = ((globalThis as Record<symbol, unknown>)[Symbol.for('@tensorwire/cuda-ipc.process-id')] ??= new Uint8Array(randomBytes(16))) as Uint8Array;
/**
 * The target is a seqlocked pool slot: peers may read it (under the slot's seqlock) but not
 * write it one-sided.
 */
const FLAG_SEQLOCKED = 1;
const N_HOST_LEN = EXT;
const N_HOST = EXT + 1;

export interface CudaIpcTransportOptions {
  /** Largest chunk per copy (default 64 MiB). */
  readonly maxChunkBytes?: number;
  /** How long revoke() and revokeGrant() wait for a peer's copy in flight (default 10 s). */
  readonly revokeTimeoutMs?: number;
  /**
   * Capacity of the grant tables behind {@link CudaIpcTransport.grant}: the first table has
   * `records` grants (default 4096), `segments` directory entries (distinct data segments
   * its grants cover, default 4096) and `rangeBytes` of range tables (24 bytes per granted
   * range, default 4 MiB); when one is full another table is created, twice the size each
   * time (at most 8×), at most `maxTables` (default 8). Beyond that grant() fails with
   * ResourceExhaustedError.
   */
  readonly grantTable?: { readonly records?: number; readonly segments?: number; readonly rangeBytes?: number; readonly maxTables?: number };
  /**
   * Threads that copy the bytes of a host batch (default: half of `os.availableParallelism()`,
   * 1 to 4, since the peer of a same-host transport runs on this host too; 1 is the calling
   * thread only). With more, a batch's group of ranges (those of one pool
   * slot, or those of its other segments) holding at least 1 MiB is cut by bytes into pieces of
   * at least 256 KiB (64 at most) that the calling thread and up to `copyThreads - 1` threads
   * of a small persistent native pool claim one at a time: the calling thread starts at once
   * and never waits for a piece nobody has started, so a pool thread slow to get a core (a busy
   * host) costs nothing but its wake-up; smaller groups are copied on the calling thread.
   * Integer 1 to 16. Every guarantee of a batch holds whatever the count: all-or-nothing
   * validation before any byte moves, each grant entered once and left only after every piece
   * has ended (no byte after revoke), one seqlock generation check per pool slot per batch
   * (loaded once before any piece starts, re-checked after each piece's copies), the deadline.
   */
  readonly copyThreads?: number;
  /**
   * Host batches of at least this many bytes are copied off the JavaScript thread (on a thread
   * of libuv's pool; default 8 MiB; `Infinity`: never). Everything is still checked on the
   * calling thread before any byte moves, with the same errors; the post's promise settles when
   * the copy has ended. A copy of 8 MiB holds the event loop for about 1 ms at memory speed
   * (64 MiB for 7 to 11 ms here): off the thread, other calls, timers and sockets go on
   * meanwhile, and two concurrent posts copy on two cores. Smaller batches are copied on the
   * calling thread, where the hand-off would cost more than the copy, and so are batches with a
   * local buffer over a resizable ArrayBuffer. The post's signal stops a copy: one still queued
   * for a pool thread settles at once and never runs, a running one stops at its next check (a
   * range, a 4 MiB step of a larger one, a piece of the copy pool, a seqlock wait) and settles
   * once nothing touches the memory. Revoking a local registration waits for the copies into
   * or out of it. A registered buffer must not be transferred (detached) while a transfer into
   * or out of it is in flight: the copy could write memory the buffer no longer owns (one that
   * did is reported as InvalidInputError when it ends).
   */
  readonly asyncCopyBytes?: number;
  /**
   * Bounds on what peers can make this transport hold on its control channel (invariant 16).
   * Past each, the peer's new connection is refused (or the offending socket closed) with a
   * logged reason, counted in {@link CudaIpcTransport.peerEvents}; other peers are unaffected.
   */
  readonly limits?: CudaIpcLimits;
  readonly logger?: Logger;
  /**
   * Where to count peer events (`tensorwire_transport_peer_events_total{transport="cuda-ipc",event}`,
   * the counter the TCP and Unix-socket transports use), or false. Default: a private Registry
   * (`transport.metrics.registry`).
   */
  readonly metrics?: MetricsOptions | false;
}

/** Control-channel bounds of {@link CudaIpcTransportOptions.limits}. */
export interface CudaIpcLimits {
  /** An accepted socket must finish its handshake (say hello, pass the presence check) within this (default 10 s). */
  readonly handshakeTimeoutMs?: number;
  /** Accepted sockets that have not finished their handshake, at most (default 64); more are closed at once. */
  readonly maxPendingHandshakes?: number;
  /** Inbound connections at most, from all peers (default 1024); past it a hello is refused. */
  readonly maxConnections?: number;
  /** Inbound connections from one node id at most (default 8); past it that peer's hello is refused. */
  readonly maxConnectionsPerPeer?: number;
  /**
   * Mappings of one peer's segments (its grants, grant tables and data segments) a connection
   * caches, each kind at most this many (default 1024); past it the oldest is dropped (mapped
   * again when next used), and a new CUDA import is refused with ResourceExhaustedError.
   */
  readonly maxCachedSegments?: number;
}

/** Why the transport refused or cut a peer's control connection (the keys of {@link CudaIpcTransport.peerEvents}). */
export type CudaIpcPeerEvent = 'pending_handshakes' | 'connections' | 'peer_connections' | 'handshake_timeout' | 'protocol_violation' | 'cache_evictions' | 'import_refused';

const PEER_EVENT_TEXT: Record<CudaIpcPeerEvent, kit.PeerEventText> = {
  pending_handshakes: { level: 'warn', text: 'cuda-ipc: connection closed: too many connections half-way through their handshakes' },
  connections: { level: 'warn', text: 'cuda-ipc: connection refused: too many inbound connections' },
  peer_connections: { level: 'warn', text: 'cuda-ipc: connection refused: too many inbound connections from this peer' },
  handshake_timeout: { level: 'warn', text: 'cuda-ipc: connection closed: handshake not finished in time' },
  protocol_violation: { level: 'warn', text: 'cuda-ipc: connection closed: control protocol violation' },
  cache_evictions: { level: 'info', text: "cuda-ipc: a peer's cached segment mapping was dropped (cache full)" },
  import_refused: { level: 'warn', text: "cuda-ipc: a peer's CUDA grant was not imported (import cache full)" },
};

function limit(name: string, value: number | undefined, dflt: number, max: number): number {
  const v = value ?? dflt;
  if (!Number.isSafeInteger(v) || v < 1 || v > max) {
    throw new InvalidInputError(`limits.${name} must be an integer from 1 to ${max}`, { details: { field: `limits.${name}` } });
  }
  return v;
}

class Grant {
  revoked: Promise<void> | undefined;
  constructor(
    readonly name: string,
    readonly mapping: ArrayBuffer,
  ) {}
}

/** The opaque per-registration handle. */
class HostHandle {
  revoked = false;
  /** Set by the first revoke(): its range grants revoked, then its directory references dropped. */
  revokedRanges: Promise<void> | undefined;
  /** Grant tables whose directory holds a reference for this registration's segment, and its index there. */
  tables: GrantTable[] | undefined;
  dirs: number[] | undefined;
  /** Copies off the JavaScript thread into or out of this buffer that have not ended (asyncCopyBytes). */
  readonly copies = new InFlight();
  constructor(
    readonly buffer: Uint8Array,
    readonly grant: Grant | undefined,
    /** The shared segment the buffer lies in (undefined: local only). */
    readonly segment: GrantedSegment | undefined,
    /** Where the buffer starts in the segment mapping. */
    readonly base: number,
  ) {}
}

/** Operations in flight, and who waits for there to be none. */
class InFlight {
  count = 0;
  #idle: (() => void)[] = [];
  enter(): void {
    this.count++;
  }
  leave(): void {
    if (--this.count === 0) for (const f of this.#idle.splice(0)) f();
  }
  /** Resolves once none is in flight. */
  idle(): Promise<void> {
    return this.count === 0 ? Promise.resolve() : new Promise<void>((r) => this.#idle.push(r));
  }
}

/** Whether an off-thread copy may use these buffers: a resizable one could shrink under it. */
function fixedLength(buffers: readonly Uint8Array[]): boolean {
  for (let i = 0; i < buffers.length; i++) if ((buffers[i]?.buffer as { resizable?: boolean } | undefined)?.resizable === true) return false;
  return true;
}

/** The opaque handle of a range grant: one record of a grant table. */
class RangeGrant {
  revoked: Promise<void> | undefined;
  constructor(
    readonly owner: CudaIpcTransport,
    readonly table: GrantTable,
    readonly record: number,
    readonly generation: number,
    readonly arenaOffset: number,
    readonly arenaBytes: number,
    /** The registrations it covers (revoking one revokes this grant first). */
    readonly handles: readonly HostHandle[],
  ) {}
}
class CudaHandle {
  constructor(
    readonly device: number,
    readonly pointer: bigint,
    readonly byteLength: number,
    readonly grant: Grant,
  ) {}
}

/** A peer's grant as decoded from its descriptor payload. */
export interface RemoteGrant {
  readonly kind: MemoryKind;
  readonly grantName: string;
  readonly token: Uint8Array;
  readonly length: number;
}

/** A peer's range grant as decoded from its descriptor payload (and the descriptor's range lengths). */
export interface RemoteRangeGrant {
  readonly kind: 'host';
  /** The grant table segment (`/tw-t.…`). */
  readonly tableName: string;
  readonly record: number;
  readonly generation: number;
  readonly token: Uint8Array;
  /** Ranges, and bytes of all ranges, as the payload says (the grant's range table must agree). */
  readonly count: number;
  readonly length: number;
  /** Length of each granted range as the descriptor says: the engine's to check requests; never trusted here. */
  readonly rangeLengths: Float64Array;
  /** How the grant's record table reads (the record must say the same). */
  readonly form: 'ranges' | 'blocks';
}

export interface EndpointInfo {
  readonly hostId: string;
  readonly presence: string;
  readonly pid: number;
  /** Unix domain socket for the handshake and the connection's liveness. */
  readonly socketPath: string;
}

function encodeEndpointBlob(e: EndpointInfo): Uint8Array {
  const w = new ByteWriter(128);
  for (const b of ENDPOINT_MAGIC) w.u8(b);
  return w.u8(WIRE_VERSION).str8(e.hostId).str8(e.presence).u32(e.pid).str8(e.socketPath).finish();
}

export function decodeEndpointBlob(bytes: Uint8Array): EndpointInfo {
  const r = new ByteReader(bytes, 'cuda-ipc endpoint');
  for (const b of ENDPOINT_MAGIC) if (r.u8('magic') !== b) throw new InvalidInputError('not a cuda-ipc endpoint (bad magic)', { details: { field: 'magic' } });
  const v = r.u8('version');
  if (v !== WIRE_VERSION) throw new InvalidInputError(`cuda-ipc endpoint version ${v} is not supported`, { details: { field: 'version' } });
  const hostId = r.str8('host id');
  if (!isToken(hostId)) throw new InvalidInputError('cuda-ipc endpoint: bad host id', { details: { field: 'hostId' } });
  const presence = r.str8('presence segment');
  const p = segmentNameProblem(presence);
  if (p !== undefined || !presence.startsWith('/tw-n.')) throw new InvalidInputError(`cuda-ipc endpoint: ${p ?? 'not a presence segment'}`, { details: { field: 'presence' } });
  const pid = r.u32('pid');
  if (pid === 0) throw new InvalidInputError('cuda-ipc endpoint: pid 0', { details: { field: 'pid' } });
  const socketPath = r.str8('socket path');
  if (!/^\/[A-Za-z0-9._/-]{1,100}\.sock$/.test(socketPath) || socketPath.includes('..')) {
    throw new InvalidInputError('cuda-ipc endpoint: bad socket path', { details: { field: 'socketPath' } });
  }
  r.end();
  return { hostId, presence, pid, socketPath };
}

function encodePayload(kind: MemoryKind, grant: { name: string; token: Uint8Array } | undefined, length: number): Uint8Array {
  const w = new ByteWriter(96);
  for (const b of PAYLOAD_MAGIC) w.u8(b);
  w.u8(WIRE_VERSION).u8(kind === 'host' ? 0 : 1).u8(grant ? MODE_REGISTRATION : MODE_LOCAL);
  if (grant) w.str8(grant.name).bytes(grant.token);
  return w.u64(length).finish();
}

/** A range grant's payload: what a peer needs to find and enter the record, whatever the number of ranges. */
function encodeRangePayload(table: string, record: number, generation: number, token: Uint8Array, count: number, length: number, blocks: boolean): Uint8Array {
  const w = new ByteWriter(128);
  for (const b of PAYLOAD_MAGIC) w.u8(b);
  return w.u8(WIRE_VERSION).u8(0).u8(blocks ? MODE_BLOCKS : MODE_RANGES).str8(table).u32(record).u64(generation).bytes(token).u32(count).u64(length).finish();
}

/**
 * Decode and validate a cuda-ipc descriptor payload (throws InvalidInputError). A descriptor
 * of a range grant carries `rangeLengths`, and its payload must be a range grant's; a
 * registration's descriptor carries none.
 */
export function decodePayload(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number): RemoteGrant;
export function decodePayload(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths: Float64Array | undefined): RemoteGrant | RemoteRangeGrant;
export function decodePayload(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths?: Float64Array): RemoteGrant | RemoteRangeGrant {
  const r = new ByteReader(payload, 'cuda-ipc payload');
  for (const b of PAYLOAD_MAGIC) if (r.u8('magic') !== b) throw new InvalidInputError('not a cuda-ipc payload (bad magic)', { details: { field: 'magic' } });
  const v = r.u8('version');
  if (v !== WIRE_VERSION) throw new InvalidInputError(`cuda-ipc payload version ${v} is not supported`, { details: { field: 'version' } });
  const kb = r.u8('memory kind');
  if (kb > 1) throw new InvalidInputError(`cuda-ipc payload: memory kind ${kb} is unknown`, { details: { field: 'memoryKind' } });
  const kind: MemoryKind = kb === 0 ? 'host' : 'cuda';
  if (kind !== memoryKind) throw new InvalidInputError(`cuda-ipc payload is for ${kind} memory, descriptor says ${memoryKind}`, { details: { field: 'memoryKind' } });
  const mode = r.u8('mode');
  if (mode > MODE_BLOCKS) throw new InvalidInputError(`cuda-ipc payload: mode ${mode} is unknown`, { details: { field: 'mode' } });
  if (mode === MODE_LOCAL) {
    r.u64('length');
    r.end();
    throw new InvalidInputError(
      'the peer registered this memory for local use only: it is not in shared memory (allocate it with allocateSharedMemory() or use a pool slot)',
      { details: { field: 'remote' } },
    );
  }
  if (mode === MODE_RANGES || mode === MODE_BLOCKS) {
    if (kind !== 'host') throw new InvalidInputError('cuda-ipc payload: range grants are of host memory', { details: { field: 'memoryKind' } });
    const tableName = r.str8('grant table');
    const p = segmentNameProblem(tableName);
    if (p !== undefined || !tableName.startsWith('/tw-t.')) throw new InvalidInputError(`cuda-ipc payload: ${p ?? 'not a grant table'}`, { details: { field: 'grant' } });
    const record = r.u32('record');
    const generation = r.safeU64('generation');
    const token = r.bytes(TOKEN_BYTES, 'token').slice();
    const count = r.u32('range count');
    const length = r.safeU64('length');
    r.end();
    if (rangeLengths === undefined) throw new InvalidInputError('cuda-ipc payload is a range grant, but the descriptor has no range lengths', { details: { field: 'rangeLengths' } });
    if (!(rangeLengths instanceof Float64Array)) throw new InvalidInputError('cuda-ipc: range lengths must be a Float64Array', { details: { field: 'rangeLengths' } });
    if (count === 0) throw new InvalidInputError('cuda-ipc payload grants no range', { details: { field: 'count' } });
    if (count !== rangeLengths.length) {
      throw new InvalidInputError(`cuda-ipc payload grants ${count} ranges, the descriptor lists ${rangeLengths.length}`, { details: { field: 'count' } });
    }
    if (length < count) throw new InvalidInputError(`cuda-ipc payload: ${count} ranges cannot cover ${length} bytes`, { details: { field: 'length' } });
    // The descriptor's lengths and byte length are the engine's to check requests against; the
    // serving side trusts neither: every range is bounded by the grant's own range table. The
    // payload's byte total is not compared with `byteLength` (a descriptor may claim more bytes
    // around a genuine payload, and must still reach what was granted): the grant's range table
    // must agree with it, and with `count` (readRangeTable), so no payload field goes unchecked.
    const form = mode === MODE_BLOCKS ? ('blocks' as const) : ('ranges' as const);
    return Object.freeze({ kind: 'host' as const, tableName, record, generation, token, count, length, rangeLengths: Float64Array.from(rangeLengths), form });
  }
  if (rangeLengths !== undefined) {
    throw new InvalidInputError('cuda-ipc payload grants a whole registration, but the descriptor lists granted ranges', { details: { field: 'rangeLengths' } });
  }
  const grantName = r.str8('grant name');
  const p = segmentNameProblem(grantName);
  if (p !== undefined || !grantName.startsWith('/tw-g.')) throw new InvalidInputError(`cuda-ipc payload: ${p ?? 'not a grant segment'}`, { details: { field: 'grant' } });
  const token = r.bytes(TOKEN_BYTES, 'token').slice();
  const length = r.safeU64('length');
  r.end();
  if (length !== byteLength) throw new InvalidInputError(`cuda-ipc payload grants ${length} bytes, descriptor says ${byteLength}`, { details: { field: 'byteLength' } });
  return Object.freeze({ kind, grantName, token, length });
}

/** What a grant segment says, validated. */
interface GrantTarget {
  readonly mapping: ArrayBuffer;
  readonly target: 'host' | 'cuda';
  readonly offset: number;
  readonly length: number;
  readonly dataName: string | undefined;
  readonly device: number;
  readonly ipcHandle: Uint8Array;
  readonly flags: number;
  /** Set when the grant's owner is this process: its device pointer (allocation base), used instead of an import. */
  readonly ownerPointer: bigint | undefined;
}

/**
 * The addon reads ranges in core's layout as it was built for: the first seven RangeField
 * positions in this order. Checked here, so a changed layout fails loudly instead of copying wrong bytes.
 */
const LAYOUT_PROBLEM =
  RangeField.Request === 0 &&
  RangeField.Local === 1 &&
  RangeField.LocalOffset === 2 &&
  RangeField.Remote === 3 &&
  RangeField.RemoteOffset === 4 &&
  RangeField.Length === 5 &&
  RangeField.RemoteRange === 6 &&
  RANGE_STRIDE >= 7
    ? undefined
    : `@tensorwire/cuda-ipc was built for another range layout than this @tensorwire/core's (RANGE_STRIDE ${RANGE_STRIDE})`;

/** Whether the loaded addon keeps batch tables natively (planBatch; an older build does not), asked once, on the first host copy. */
let plannedCopies: boolean | undefined;

/**
 * A copy off the JavaScript thread that `signal` stops through its control word: aborted while
 * the copy still waits for a pool thread, it will never start, so the post settles at once;
 * aborted while it runs, the copy stops at its next check and its own rejection (once nothing
 * touches the memory) settles the post. Either way the rejection is an AbortedError, which the
 * caller turns into the signal's error. The listener is removed when the post settles (the
 * engine's signals outlive a post).
 */
function stoppable(copy: Promise<void>, control: Int32Array, signal: AbortSignal): Promise<void> {
  return new Promise<void>((resolve, reject) => {
    const onAbort = (): void => {
      if (Atomics.exchange(control, 0, CopyControl.Cancelled) === CopyControl.Queued) reject(new AbortedError('the copy was cancelled before it started'));
    };
    signal.addEventListener('abort', onAbort, { once: true });
    copy.then(
      () => {
        signal.removeEventListener('abort', onAbort);
        resolve();
      },
      (e: unknown) => {
        signal.removeEventListener('abort', onAbort);
        reject(e);
      },
    );
  });
}

/** Whether the loaded addon's copies off the JavaScript thread take a control word (an older build's do not). */
let cancellableCopies: boolean | undefined;

/** Whether the loaded addon copies off the JavaScript thread (copyPlannedAsync; an older build may not). */
let asyncCopies: boolean | undefined;

/** Whether the loaded addon has cudaCopyRanges (one call per device-to-device batch), asked once. */
let cudaRanges: boolean | undefined;

/** Numbers per remote in {@link HostPlan.remotes}: grant index, first span, span count. */
const REMOTE_STRIDE = 3;
/** Numbers per span in {@link HostPlan.spans}: segment index, base, limit. */
const SPAN_STRIDE = 3;
/**
 * Copies of one pool slot's ranges (in one batch) that overlapped the owner's write and were
 * retried, at most, before the batch is refused as `slot-rewritten`. Bounded in time as well:
 * the transfer's deadline, 10 s in all, 2 s on one write in progress.
 */
const SLOT_ATTEMPTS = 10_000;
/** Bounds of {@link CudaIpcTransportOptions.copyThreads} (the addon's pool: the caller + 15). */
const MAX_COPY_THREADS = 16;
/**
 * {@link CudaIpcTransportOptions.copyThreads} when not given: half the cores this process may
 * use (the peer process of a same-host transport is on this host too), 1 to 4.
 */
function defaultCopyThreads(): number {
  return Math.max(1, Math.min(4, Math.floor(availableParallelism() / 2)));
}
/** {@link CudaIpcTransportOptions.asyncCopyBytes} when not given. */
const DEFAULT_ASYNC_COPY_BYTES = 8 * 1024 * 1024;
/** How often (ms) a connection confirms that the peer's pid is still the same process. */
const PID_RECHECK_MS = 250;
/** RemoteRejectedError codes about the request itself, never caused by a peer going away. */
const REQUEST_CODES: ReadonlySet<string> = new Set(['slot-rewritten', 'bounds', 'read-only']);

/**
 * What a connection derives from a host-only batch once: the tables of
 * {@link native.copyBatch}. Indices in `remotes` are into `segments` and `grants`.
 */
interface HostPlan {
  readonly op: 0 | 1;
  /** The local buffers, by the batch's local index. */
  readonly locals: Uint8Array[];
  /** Per batch remote: grant index, first span, span count (1 for a registration, its ranges for a range grant). */
  readonly remotes: Float64Array;
  /** Per granted range of the batch's remotes: segment index, offset of its bytes in the segment mapping, its bytes. */
  readonly spans: Float64Array;
  /** Distinct data segments (mappings) and their names. */
  readonly segments: ArrayBuffer[];
  readonly segmentNames: string[];
  /** Per segment: 1 when it is a seqlocked pool slot. */
  readonly segmentFlags: Uint8Array;
  readonly seqlocked: boolean;
  /** Distinct grants (grant segment or grant table mapping + token) and their names. */
  readonly grants: ArrayBuffer[];
  readonly grantNames: string[];
  /** Per grant: byte offset of its record in the grant table (0: a grant segment), generation. */
  readonly grantInfo: Float64Array;
  /** 16 bytes per grant. */
  readonly tokens: Uint8Array;
  /** Filled by each copy: the generation each seqlocked segment was copied at. */
  readonly generations: BigUint64Array;
  /** The same tables kept natively (planBatch), made on the plan's first copy; null where the addon has no planBatch. */
  native: BatchPlanHandle | null | undefined;
}

/** One batch's copy of a pool slot in a transfer (a short list: one entry per stream batch). */
interface SlotCopy {
  readonly batch: TransferBatch;
  generation: bigint;
  readonly next: SlotCopy | undefined;
}

/** A decoded remote as one connection resolved it. */
interface ResolvedRemote {
  readonly g: GrantTarget;
  /** The data segment mapping of a host grant (undefined: a CUDA grant). */
  readonly data: ArrayBuffer | undefined;
  /** A pool slot: read under its seqlock, never written by peers. */
  readonly seqlocked: boolean;
}

/** A decoded range grant as one connection resolved it: its record and range table, read once. */
interface ResolvedRanges {
  readonly table: TableView;
  /** Byte offset of the record in the table mapping. */
  readonly recordOffset: number;
  /** Per granted range: index into `segments`, offset of its bytes in the segment mapping, its bytes. */
  readonly spans: Float64Array;
  readonly segments: readonly DirSegment[];
  readonly mappings: readonly ArrayBuffer[];
}

/** Whether two byte arrays hold the same bytes (one native compare: a JS loop over a payload was 7% of an unprepared read). */
function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  return a.byteLength === b.byteLength && Buffer.compare(a, b) === 0;
}

function isRemoteGrant(r: unknown): r is RemoteGrant {
  if (typeof r !== 'object' || r === null) return false;
  const g = r as Partial<RemoteGrant>;
  return (g.kind === 'host' || g.kind === 'cuda') && typeof g.grantName === 'string' && g.token instanceof Uint8Array && g.token.byteLength === TOKEN_BYTES && Number.isSafeInteger(g.length);
}

function isRemoteRangeGrant(r: unknown): r is RemoteRangeGrant {
  if (typeof r !== 'object' || r === null) return false;
  const g = r as Partial<RemoteRangeGrant>;
  return (
    g.kind === 'host' &&
    typeof g.tableName === 'string' &&
    Number.isSafeInteger(g.record) &&
    Number.isSafeInteger(g.generation) &&
    g.token instanceof Uint8Array &&
    g.token.byteLength === TOKEN_BYTES &&
    Number.isSafeInteger(g.count)
  );
}

/** The request of the first range that uses table entry `index` of `field` (Local or Remote). */
function firstRequest(batch: TransferBatch, field: number, index: number): number | undefined {
  const r = batch.ranges;
  for (let i = 0; i < batch.count; i++) if (r[i * RANGE_STRIDE + field] === index) return r[i * RANGE_STRIDE + RangeField.Request];
  return undefined;
}

/** `e` with `details.request` set (a typed error of the same class), or `e` unchanged. */
function withRequest(e: unknown, request: number | undefined): unknown {
  if (!(e instanceof TensorwireError) || request === undefined || e.details['request'] !== undefined) return e;
  return errorFromCode(e.code, e.message, { cause: e.cause, details: { ...e.details, request } });
}

const MAX_LINE = 4096;

/**
 * Newline-delimited JSON messages over a Unix socket (handshake and control only; no data).
 * What is buffered is bounded: a line longer than {@link MAX_LINE} bytes (or more than 4 of
 * them in parse) or one that is not JSON closes the socket, reported through `onViolation`.
 */
function onLines(socket: Socket, handler: (msg: Record<string, unknown>) => void, onViolation?: (why: string) => void): void {
  let buf = '';
  socket.setEncoding('utf8');
  const violate = (why: string): void => {
    buf = '';
    socket.destroy(new InvalidInputError(why));
    onViolation?.(why);
  };
  socket.on('data', (chunk: string) => {
    if (socket.destroyed) return;
    buf += chunk;
    if (buf.length > MAX_LINE * 4) {
      violate('cuda-ipc control line too long');
      return;
    }
    let i: number;
    while ((i = buf.indexOf('\n')) >= 0) {
      const line = buf.slice(0, i);
      buf = buf.slice(i + 1);
      let msg: unknown;
      try {
        msg = JSON.parse(line);
      } catch {
        violate('cuda-ipc control message is not JSON');
        return;
      }
      if (typeof msg === 'object' && msg !== null && !Array.isArray(msg)) handler(msg as Record<string, unknown>);
    }
  });
}

function sendLine(socket: Socket, msg: Record<string, unknown>): void {
  if (!socket.destroyed && socket.writable) socket.write(JSON.stringify(msg) + '\n');
}

class CudaIpcConnection implements TransportConnection {
  readonly transport = 'cuda-ipc';
  readonly streams: number;
  readonly #owner: CudaIpcTransport;
  readonly #presence: ArrayBuffer;
  readonly #peerPid: number;
  readonly #peerStart: bigint;
  // Per-connection state (invariant 2): the peer's grants, data mappings and imports.
  readonly #grants = new Map<string, GrantTarget>();
  readonly #data = new Map<string, ArrayBuffer>();
  /** The peer's grant tables, mapped and validated once. */
  readonly #tables = new Map<string, TableView>();
  /** One import per grant; the promise is cached so concurrent chunks share it. */
  readonly #imports = new Map<string, Promise<{ device: number; base: bigint }>>();
  readonly #closeListeners: ((error: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  readonly #socket: Socket;
  /** What {@link #hostPlan} derived per batch (null: the batch has CUDA memory). */
  readonly #plans = new WeakMap<TransferBatch, HostPlan | null>();
  /**
   * The same by what a plan is made of, for batches of one local and one remote (most reads
   * and writes: the engine makes a new batch per unprepared call, with the same handle and the
   * same decoded remote): by op, local handle, then remote. A plan holds nothing of the batch
   * but those (its ranges are passed per call), and what can change between calls (a revoked
   * local, grant or peer) is checked per call as for a prepared transfer's reused plan.
   */
  readonly #plansByTables = [new WeakMap<object, WeakMap<object, HostPlan | null>>(), new WeakMap<object, WeakMap<object, HostPlan | null>>()] as const;
  /** Per decoded remote: its grant and data segment on this connection. */
  readonly #resolved = new WeakMap<RemoteGrant, ResolvedRemote>();
  /** Per decoded range grant: its record and range table on this connection. */
  readonly #rangesResolved = new WeakMap<RemoteRangeGrant, ResolvedRanges>();
  /** Scratch (dst, src, length) table of {@link #deviceRanges}; the addon copies it per call. */
  #cudaTable = new Float64Array(0);
  /** When the peer's pid was last confirmed to be the same process (Date.now()). */
  #aliveCheckedAt = 0;
  /** The Date.now() millisecond the pid was last probed alive. */
  #probedAt = -1;
  #retiring = false;
  readonly #inflight = new InFlight();
  #closed: Promise<void> | undefined;
  #closeError: TensorwireError | undefined;

  constructor(
    readonly peer: NodeIdentity,
    readonly initiator: string,
    streams: number,
    owner: CudaIpcTransport,
    presence: ArrayBuffer,
    peerPid: number,
    peerStart: bigint,
    socket: Socket,
  ) {
    this.streams = streams;
    this.#owner = owner;
    this.#presence = presence;
    this.#peerPid = peerPid;
    this.#peerStart = peerStart;
    this.#socket = socket;
    onLines(
      socket,
      (msg) => {
        if (msg['t'] === 'retire') this.#peerRetired();
      },
      (why) => owner.peerEvent('protocol_violation', peer.nodeId, why),
    );
    socket.on('error', () => undefined);
    socket.on('close', () => {
      void this.close(this.#retiring ? undefined : new ConnectionBrokenError(`peer ${peer.nodeId} closed the cuda-ipc connection`));
    });
  }

  #peerRetired(): void {
    if (this.#retiring || this.#closed) return;
    this.#retiring = true;
    for (const l of this.#retireListeners.splice(0)) {
      try {
        l();
      } catch {
        // not ours
      }
    }
    void this.#whenIdle().then(() => this.close());
  }

  #whenIdle(): Promise<void> {
    return this.#inflight.idle();
  }

  get isOpen(): boolean {
    return this.#closed === undefined && !this.#retiring;
  }

  onClose(listener: (error: TensorwireError | undefined) => void): void {
    if (this.#closed) queueMicrotask(() => listener(this.#closeError));
    else this.#closeListeners.push(listener);
  }

  onRetire(listener: () => void): void {
    this.#retireListeners.push(listener);
  }

  /**
   * Cache a mapping of one of the peer's segments, bounded (invariant 16): past
   * `limits.maxCachedSegments` the oldest entry is dropped (its mapping goes with its last
   * user; it is mapped again when next needed), so a peer that keeps issuing new grants
   * cannot grow this process's mappings without end.
   */
  #remember<V>(map: Map<string, V>, key: string, value: V): void {
    if (map.size >= this.#owner.maxCachedSegments) {
      const oldest = map.keys().next();
      if (!oldest.done) map.delete(oldest.value);
      this.#owner.peerEvent('cache_evictions', this.peer.nodeId, `more than ${this.#owner.maxCachedSegments} cached mappings`);
    }
    map.set(key, value);
  }

  /**
   * The peer closed its transport (its presence segment is no longer live: checked on every
   * call, one atomic load) or exited. The pid is probed at most once per millisecond of
   * Date.now() (kill 0 is a syscall, the largest self-time frame of a prepared 4 KiB read in
   * a profile when it ran on every call; dropping it took 0.45–0.87 µs off a read of about
   * 5 µs in an A/B here); whether it is still the same process (its
   * start time, a /proc read of about 10 µs) at most every {@link PID_RECHECK_MS}: a recycled
   * pid needs the peer to have died first. A peer found dead is never cached as alive. A
   * batch that starts within the millisecond after the peer died may still copy what the
   * peer's memory held when it died (as one that started just before its death does); a dead
   * peer's socket closes this connection anyway.
   */
  #peerAlive(): boolean {
    if (native.loadState(this.#presence) !== SegmentState.Live) return false;
    const now = Date.now();
    if (now === this.#probedAt) return true;
    const alive = now - this.#aliveCheckedAt < PID_RECHECK_MS ? isProcessAlive(this.#peerPid) : isProcessAlive(this.#peerPid, this.#peerStart);
    if (!alive) return false;
    if (now - this.#aliveCheckedAt >= PID_RECHECK_MS) this.#aliveCheckedAt = now;
    this.#probedAt = now;
    return true;
  }

  async execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    if (this.#closed || this.#retiring) throw new SessionInvalidatedError(`connection to ${this.peer.nodeId} is closed or retiring`, { cause: this.#closeError });
    if (!Number.isInteger(stream) || stream < 0 || stream >= this.streams) throw new InvalidInputError(`stream ${stream} does not exist`);
    if (LAYOUT_PROBLEM) throw new BackendUnavailableError(LAYOUT_PROBLEM);
    if (!this.#peerAlive()) {
      const err = new ConnectionBrokenError(`peer ${this.peer.nodeId} closed its cuda-ipc transport or exited`);
      void this.close(err);
      throw err;
    }
    this.#inflight.enter();
    try {
      if (options.signal.aborted) throw errorFromSignal(options.signal, 'cuda-ipc transfer');
      this.#liveLocals(batch);
      try {
        const plan = this.#hostPlan(batch);
        if (plan) {
          const copying = this.#copyHost(batch, plan, options);
          if (copying) await copying;
        } else await this.#executeRanges(batch, options);
      } catch (e) {
        // A grant that vanished because its owner is closing or died is a broken connection.
        // A peer that is shutting down closes its connections before it revokes its
        // grants; give that close a moment to arrive before calling this a rejection.
        if (e instanceof RemoteRejectedError && !REQUEST_CODES.has(e.remoteCode ?? '') && !this.#closed && this.#peerAlive()) await new Promise((r) => setTimeout(r, 5));
        if (e instanceof RemoteRejectedError && (this.#closed !== undefined || !this.#peerAlive())) {
          const err = new ConnectionBrokenError(`peer ${this.peer.nodeId} closed its cuda-ipc transport or exited`, { cause: e });
          void this.close(err);
          throw err;
        }
        throw e;
      }
    } finally {
      this.#inflight.leave();
    }
  }

  /**
   * Refuses the batch (InvalidInputError naming the first request that uses it) when one of
   * its local handles was revoked: checked on every post, before any byte moves, since a
   * handle can be revoked between posts of the same batch. Once per distinct local, not per
   * range. Handles that are not this transport's are left to {@link #hostPlan}.
   */
  #liveLocals(batch: TransferBatch): void {
    const locals = batch.locals;
    for (let i = 0; i < locals.length; i++) {
      const h = locals[i];
      const revoked = h instanceof HostHandle ? h.revoked : h instanceof CudaHandle ? h.grant.revoked !== undefined : false;
      if (revoked) {
        throw new InvalidInputError(`local ${i} of the batch is a revoked registration`, { details: { field: 'local', request: firstRequest(batch, RangeField.Local, i) } });
      }
    }
  }

  /**
   * The tables {@link native.copyBatch} takes for `batch`, or null when CUDA memory is on
   * either side (then {@link #executeRanges} runs it). Derived once per batch: the engine posts
   * the same batch object again on retries and prepared transfers, and nothing here can change
   * between posts (a grant's revocation, which can, is checked by the addon on every post; a
   * local registration's by {@link #liveLocals}, before this).
   */
  #hostPlan(batch: TransferBatch): HostPlan | null {
    const cached = this.#plans.get(batch);
    if (cached !== undefined) return cached;
    const op = batch.op;
    if (op !== 'read' && op !== 'write') throw new InvalidInputError(`batch op ${String(op)} is not read or write`, { details: { field: 'op' } });
    const local0: unknown = batch.locals.length === 1 ? batch.locals[0] : undefined;
    const remote0: unknown = batch.remotes.length === 1 ? batch.remotes[0] : undefined;
    const byTables = typeof local0 === 'object' && local0 !== null && typeof remote0 === 'object' && remote0 !== null ? this.#plansByTables[op === 'read' ? 0 : 1] : undefined;
    if (byTables) {
      const known = byTables.get(local0 as object)?.get(remote0 as object);
      if (known !== undefined) {
        this.#plans.set(batch, known);
        return known;
      }
    }
    const plan = this.#makeHostPlan(batch, op);
    if (byTables) {
      let byRemote = byTables.get(local0 as object);
      if (!byRemote) byTables.set(local0 as object, (byRemote = new WeakMap()));
      byRemote.set(remote0 as object, plan);
    }
    return plan;
  }

  /** {@link #hostPlan} for a batch seen under no other batch's tables. */
  #makeHostPlan(batch: TransferBatch, op: 'read' | 'write'): HostPlan | null {
    const locals: Uint8Array[] = [];
    let cuda = false;
    for (const h of batch.locals) {
      if (h instanceof HostHandle) locals.push(h.buffer);
      else if (h instanceof CudaHandle) cuda = true;
      else throw new InvalidInputError('a local handle of the batch is not a cuda-ipc registration', { details: { field: 'local' } });
    }
    const nRemotes = batch.remotes.length;
    // Pass 1: every remote resolved (and checked), also when the batch has CUDA memory: a bad
    // remote fails the same way on both paths.
    const resolved: (ResolvedRemote | ResolvedRanges)[] = [];
    let spanCount = 0;
    let ranged = -1;
    for (let i = 0; i < nRemotes; i++) {
      const remote = batch.remotes[i];
      if (isRemoteRangeGrant(remote)) {
        const r = this.#resolveRanges(batch, remote, i);
        resolved.push(r);
        spanCount += r.spans.length / SPAN_STRIDE;
        if (ranged < 0) ranged = i;
      } else {
        const r = this.#resolve(batch, remote, i);
        if (r.data === undefined) cuda = true;
        resolved.push(r);
        spanCount += 1;
      }
    }
    if (cuda) {
      if (ranged >= 0) {
        throw new InvalidInputError('cuda-ipc serves range grants between host memory only: this batch has CUDA memory', {
          details: { field: 'remote', request: firstRequest(batch, RangeField.Remote, ranged) },
        });
      }
      this.#plans.set(batch, null);
      return null;
    }
    // Pass 2: the tables of the native call. Segments are distinct by name (one seqlock
    // snapshot per slot per batch, whichever remotes reach it), grants by what is entered.
    const remotes = new Float64Array(nRemotes * REMOTE_STRIDE);
    const spans = new Float64Array(spanCount * SPAN_STRIDE);
    const segments: ArrayBuffer[] = [];
    const segmentNames: string[] = [];
    const flags: number[] = [];
    const grants: ArrayBuffer[] = [];
    const grantNames: string[] = [];
    const grantInfo: number[] = [];
    const tokens: Uint8Array[] = [];
    const segmentIndex = new Map<string, number>();
    const segment = (name: string, mapping: ArrayBuffer, seqlocked: boolean): number => {
      let x = segmentIndex.get(name);
      if (x === undefined) {
        x = segments.push(mapping) - 1;
        segmentNames.push(name);
        flags.push(0);
        segmentIndex.set(name, x);
      }
      if (seqlocked) flags[x] = 1;
      return x;
    };
    /** Per grant segment: the table entries made for it, one per distinct token. */
    const grantIndex = new Map<GrantTarget, number[]>();
    /** Range grants by table, record, generation and token. */
    const recordIndex = new Map<string, number>();
    let sp = 0;
    for (let i = 0; i < nRemotes; i++) {
      const remote = batch.remotes[i];
      const r = resolved[i] as ResolvedRemote | ResolvedRanges;
      let k: number | undefined;
      if ('spans' in r) {
        const rg = remote as RemoteRangeGrant;
        const key = `${rg.tableName}#${rg.record}#${rg.generation}#${Buffer.from(rg.token.buffer, rg.token.byteOffset, TOKEN_BYTES).toString('hex')}`;
        k = recordIndex.get(key);
        if (k === undefined) {
          k = grants.push(r.table.mapping) - 1;
          grantNames.push(`${rg.tableName}#${rg.record}`);
          grantInfo.push(r.recordOffset, rg.generation);
          tokens.push(rg.token);
          recordIndex.set(key, k);
        }
        const map = r.segments.map((seg, x) => segment(seg.name, r.mappings[x] as ArrayBuffer, seg.seqlocked));
        const n = r.spans.length / SPAN_STRIDE;
        remotes[i * REMOTE_STRIDE] = k;
        remotes[i * REMOTE_STRIDE + 1] = sp;
        remotes[i * REMOTE_STRIDE + 2] = n;
        const src = r.spans;
        // The grant's segments keep their indices in the batch (always so for the batch's first
        // range grant): its spans go in as they are, one copy.
        let same = true;
        for (let x = 0; x < map.length; x++) if (map[x] !== x) same = false;
        if (same) {
          spans.set(src, sp * SPAN_STRIDE);
          sp += n;
          continue;
        }
        for (let q = 0; q < n; q++, sp++) {
          spans[sp * SPAN_STRIDE] = map[src[q * SPAN_STRIDE] as number] as number;
          spans[sp * SPAN_STRIDE + 1] = src[q * SPAN_STRIDE + 1] as number;
          spans[sp * SPAN_STRIDE + 2] = src[q * SPAN_STRIDE + 2] as number;
        }
        continue;
      }
      const s = segment(r.g.dataName as string, r.data as ArrayBuffer, r.seqlocked);
      const token = (remote as RemoteGrant).token;
      // One entry per grant and token (the same grant under a wrong token must still fail).
      let entries = grantIndex.get(r.g);
      if (!entries) grantIndex.set(r.g, (entries = []));
      k = entries.find((j) => sameBytes(tokens[j] as Uint8Array, token));
      if (k === undefined) {
        k = grants.push(r.g.mapping) - 1;
        grantNames.push((remote as RemoteGrant).grantName);
        grantInfo.push(0, 0);
        tokens.push(token);
        entries.push(k);
      }
      remotes[i * REMOTE_STRIDE] = k;
      remotes[i * REMOTE_STRIDE + 1] = sp;
      remotes[i * REMOTE_STRIDE + 2] = 1;
      spans[sp * SPAN_STRIDE] = s;
      spans[sp * SPAN_STRIDE + 1] = r.g.offset;
      spans[sp * SPAN_STRIDE + 2] = (remote as RemoteGrant).length;
      sp++;
    }
    const tokenBytes = new Uint8Array(tokens.length * TOKEN_BYTES);
    for (let j = 0; j < tokens.length; j++) tokenBytes.set(tokens[j] as Uint8Array, j * TOKEN_BYTES);
    const plan: HostPlan = {
      op: op === 'read' ? 0 : 1,
      locals,
      remotes,
      spans,
      segments,
      segmentNames,
      segmentFlags: Uint8Array.from(flags),
      seqlocked: flags.includes(1),
      grants,
      grantNames,
      grantInfo: Float64Array.from(grantInfo),
      tokens: tokenBytes,
      generations: new BigUint64Array(segments.length),
      native: undefined,
    };
    this.#plans.set(batch, plan);
    return plan;
  }

  /**
   * A range grant of the batch (`index` in `batch.remotes`): its table mapped and validated
   * (once per connection), its range table read while entered (once per decoded remote on this
   * connection) and every range checked against the data segment it lies in. Later batches
   * re-enter the record natively, so a revoked or reused record is refused even though its
   * range table was cached here.
   */
  #resolveRanges(batch: TransferBatch, remote: RemoteRangeGrant, index: number): ResolvedRanges {
    let r = this.#rangesResolved.get(remote);
    if (r) return r;
    try {
      let t = this.#tables.get(remote.tableName);
      if (!t) {
        t = openTableView(remote.tableName, this.peer.nodeId, this.#peerPid);
        this.#remember(this.#tables, remote.tableName, t);
      }
      const read = readRangeTable(t, remote.record, remote.generation, remote.token, remote.count, remote.length, (name) => this.#mapData(name), remote.form === 'blocks' ? RecordForm.Blocks : RecordForm.Ranges);
      r = { table: t, recordOffset: HEADER_SIZE + remote.record * RECORD_BYTES, ...read };
    } catch (e) {
      throw withRequest(e, firstRequest(batch, RangeField.Remote, index));
    }
    this.#rangesResolved.set(remote, r);
    return r;
  }

  /**
   * A remote of the batch (`index` in `batch.remotes`): decoded by cuda-ipc, its grant opened
   * and its data segment mapped (once per decoded remote on this connection), and allowed
   * for `batch.op`.
   */
  #resolve(batch: TransferBatch, remote: unknown, index: number): ResolvedRemote {
    if (!isRemoteGrant(remote)) {
      throw new InvalidInputError('a remote of the batch was not decoded by the cuda-ipc transport', { details: { field: 'remote', request: firstRequest(batch, RangeField.Remote, index) } });
    }
    let r = this.#resolved.get(remote);
    if (!r) {
      let g: GrantTarget;
      try {
        g = this.#grant(remote);
      } catch (e) {
        throw withRequest(e, firstRequest(batch, RangeField.Remote, index));
      }
      r = { g, data: g.target === 'host' ? this.#dataMapping(g, batch, index) : undefined, seqlocked: (g.flags & FLAG_SEQLOCKED) !== 0 };
      this.#resolved.set(remote, r);
    }
    if (batch.op === 'write' && r.seqlocked) {
      // A plain copy into a pool slot would bypass its seqlock: readers would see changed
      // bytes while isConsistent() stayed true. Only the slot's owner writes it.
      throw new RemoteRejectedError(`grant ${remote.grantName} is a pool slot: peers may read it, only its owner writes it (pool.write)`, {
        details: { remoteCode: 'read-only', request: firstRequest(batch, RangeField.Remote, index) },
      });
    }
    return r;
  }

  /**
   * Host memory on both sides: the whole batch in one native call. A batch of at least
   * {@link CudaIpcTransportOptions.asyncCopyBytes} is checked here and copied off this thread:
   * the returned promise settles when it has been (undefined: copied already).
   */
  #copyHost(batch: TransferBatch, plan: HostPlan, options: ExecuteOptions): Promise<void> | undefined {
    let copying: Promise<void> | undefined;
    let generations = plan.generations;
    try {
      // A plan is copied through many times (every post of a prepared transfer, every batch over
      // the same local and remote): its tables go to the addon once (planBatch), and each copy
      // passes only the ranges (copyPlanned), instead of sixteen arguments read again per call.
      let planned = plan.native;
      if (planned === undefined) {
        plannedCopies ??= nativeHas('planBatch');
        planned = plannedCopies
          ? native.planBatch(plan.op, plan.locals, plan.remotes, plan.spans, plan.segments, plan.segmentFlags, plan.grants, plan.grantInfo, plan.tokens, plan.generations)
          : null;
        plan.native = planned;
      }
      if (planned !== null && batch.bytes >= this.#owner.asyncCopyBytes && (asyncCopies ??= nativeHas('copyPlannedAsync')) && fixedLength(plan.locals)) {
        // Posts of one plan may overlap now: each has its own generations.
        generations = new BigUint64Array(plan.generations.length);
        // The caller's signal stops the copy (a queued one at once, a running one at its next check).
        cancellableCopies ??= nativeFlag('copyControl');
        const control = cancellableCopies ? new Int32Array(1) : undefined;
        copying = native.copyPlannedAsync(planned, batch.ranges, batch.count, RANGE_STRIDE, options.deadline, SLOT_ATTEMPTS, this.#owner.copyThreads, generations, control);
        if (control) copying = stoppable(copying, control, options.signal);
        // A revoke of a local waits for the copy (it resolves once nothing touches the memory).
        const locals = batch.locals as readonly HostHandle[];
        for (let i = 0; i < locals.length; i++) (locals[i] as HostHandle).copies.enter();
        copying = copying.finally(() => {
          for (let i = 0; i < locals.length; i++) (locals[i] as HostHandle).copies.leave();
        });
      } else if (planned !== null) native.copyPlanned(planned, batch.ranges, batch.count, RANGE_STRIDE, options.deadline, SLOT_ATTEMPTS, this.#owner.copyThreads);
      else {
        native.copyBatch(
          plan.op,
          batch.ranges,
          batch.count,
          RANGE_STRIDE,
          plan.locals,
          plan.remotes,
          plan.spans,
          plan.segments,
          plan.segmentFlags,
          plan.grants,
          plan.grantInfo,
          plan.tokens,
          options.deadline,
          SLOT_ATTEMPTS,
          plan.generations,
          this.#owner.copyThreads,
        );
      }
    } catch (e) {
      throw this.#batchError(e, batch, plan);
    }
    if (copying) {
      return copying.then(
        () => this.#copiedGenerations(batch, plan, options, generations),
        (e: unknown) => {
          // Stopped by the signal (queued or running): its reason (TimedOutError for the engine's deadline).
          if (e instanceof AbortedError && options.signal.aborted) throw errorFromSignal(options.signal, 'cuda-ipc transfer');
          throw this.#batchError(e, batch, plan);
        },
      );
    }
    this.#copiedGenerations(batch, plan, options, generations);
    return undefined;
  }

  /** The generations the batch copied its pool slots at, checked against the transfer's other batches. */
  #copiedGenerations(batch: TransferBatch, plan: HostPlan, options: ExecuteOptions, generations: BigUint64Array): void {
    if (!plan.seqlocked) return;
    for (let s = 0; s < plan.segments.length; s++) {
      if (plan.segmentFlags[s] === 1) this.#sameGeneration(options.transfer, batch, plan.segmentNames[s] as string, generations[s] as bigint);
    }
  }

  /** The addon's error, with the caller's request index and the grant or segment by name. */
  #batchError(e: unknown, batch: TransferBatch, plan: HostPlan): unknown {
    if (!(e instanceof TensorwireError)) return e;
    const d = e.details;
    const details: Record<string, unknown> = { ...d };
    let message = e.message;
    if (typeof d['range'] === 'number') details['request'] = batch.ranges[(d['range'] as number) * RANGE_STRIDE + RangeField.Request];
    if (typeof d['grant'] === 'number') {
      const name = plan.grantNames[d['grant'] as number];
      details['grant'] = name;
      message = message.replace(/^grant \d+/, `grant ${name}`);
    }
    if (typeof d['segment'] === 'number') details['segment'] = plan.segmentNames[d['segment'] as number];
    return errorFromCode(e.code, message, { cause: e.cause ?? e, details });
  }

  /**
   * Per engine transfer (`ExecuteOptions.transfer`) and pool slot: the generation each batch of
   * the transfer last copied the slot at. A batch copies all of a slot's ranges as one snapshot
   * (natively, under one seqlock read); a transfer split over several streams is several batches,
   * and its bytes of one slot are one snapshot only if all its batches copied the slot at one
   * generation. A batch posted again (the engine retrying it) replaces its earlier copy.
   */
  readonly #generations = new WeakMap<object, Map<string, SlotCopy>>();

  /** Throws when the transfer now holds copies of the slot made at different generations. */
  #sameGeneration(transfer: object | undefined, batch: TransferBatch, segment: string, generation: bigint): void {
    // A direct caller's execute() call is a transfer of its own, and one batch is one snapshot.
    if (transfer === undefined) return;
    let bySegment = this.#generations.get(transfer);
    if (!bySegment) this.#generations.set(transfer, (bySegment = new Map()));
    let head = bySegment.get(segment);
    let c = head;
    while (c && c.batch !== batch) c = c.next;
    if (c) c.generation = generation;
    else bySegment.set(segment, (head = { batch, generation, next: head }));
    for (c = head; c; c = c.next) {
      if (c.generation !== generation) {
        throw new RemoteRejectedError(
          `the pool slot was rewritten while this transfer read it in parts (generations ${c.generation} and ${generation}): the bytes would mix two versions; read again`,
          { details: { remoteCode: 'slot-rewritten' } },
        );
      }
    }
  }

  /**
   * A batch with CUDA memory on either side: every range is checked first, each grant entered
   * once, then one driver copy (or host copy) per range, in order.
   */
  async #executeRanges(batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    const { op, ranges, count } = batch;
    const resolved = batch.remotes.map((r, i) => this.#resolve(batch, r, i));
    const targets = resolved.map((r) => r.g);
    const bases: (ArrayBuffer | bigint)[] = [];
    for (let i = 0; i < resolved.length; i++) {
      const r = resolved[i] as ResolvedRemote;
      bases.push(r.data ?? (await this.#importBase((batch.remotes[i] as RemoteGrant).grantName, r.g)));
    }
    for (let i = 0; i < count; i++) {
      const at = i * RANGE_STRIDE;
      const request = ranges[at + RangeField.Request] as number;
      const li = ranges[at + RangeField.Local] as number;
      const ri = ranges[at + RangeField.Remote] as number;
      const localOffset = ranges[at + RangeField.LocalOffset] as number;
      const remoteOffset = ranges[at + RangeField.RemoteOffset] as number;
      const length = ranges[at + RangeField.Length] as number;
      if (ranges[at + RangeField.RemoteRange] !== 0) throw new InvalidInputError(`range ${i}: remote range ${ranges[at + RangeField.RemoteRange]} does not exist (a cuda-ipc grant is one range)`, { details: { request } });
      const local = batch.locals[li];
      if (!(local instanceof HostHandle || local instanceof CudaHandle)) throw new InvalidInputError(`range ${i}: local ${li} is not a cuda-ipc registration`, { details: { request } });
      const remote = batch.remotes[ri] as RemoteGrant | undefined;
      const g = targets[ri];
      if (!remote || !g) throw new InvalidInputError(`range ${i}: remote ${ri} is not in the batch`, { details: { request } });
      const localLength = local instanceof HostHandle ? local.buffer.byteLength : local.byteLength;
      if (![localOffset, remoteOffset, length].every(Number.isSafeInteger) || localOffset < 0 || length <= 0 || localOffset + length > localLength) {
        throw new InvalidInputError(`range ${i}: local bytes ${localOffset}+${length} are out of bounds`, { details: { request } });
      }
      if (remoteOffset < 0 || remoteOffset + length > remote.length || remoteOffset + length > g.length) {
        throw new RemoteRejectedError(`range ${i}: remote bytes ${remoteOffset}+${length} exceed the grant of ${g.length} bytes`, { details: { remoteCode: 'bounds', request } });
      }
    }
    // Each distinct grant once (the same grant through two decoded remotes is entered twice,
    // harmlessly: the counter is a count).
    const entered: GrantTarget[] = [];
    try {
      for (let i = 0; i < targets.length; i++) {
        const g = targets[i] as GrantTarget;
        const remote = batch.remotes[i] as RemoteGrant;
        const r = native.grantEnter(g.mapping, remote.token);
        if (r !== GrantResult.Ok) {
          const why = r === GrantResult.Revoked ? 'was revoked' : r === GrantResult.BadToken ? 'rejected the token' : 'is not a grant';
          throw new RemoteRejectedError(`grant ${remote.grantName} ${why}`, { details: { remoteCode: r === GrantResult.Revoked ? 'revoked' : r === GrantResult.BadToken ? 'bad-token' : 'bad-grant' } });
        }
        entered.push(g);
      }
      if (options.signal.aborted) throw errorFromSignal(options.signal, 'cuda-ipc transfer');
      if (await this.#deviceRanges(batch, targets, bases)) return;
      const generations = new Map<string, bigint>();
      for (let i = 0; i < count; i++) {
        if (options.signal.aborted) throw errorFromSignal(options.signal, 'cuda-ipc transfer');
        const at = i * RANGE_STRIDE;
        const ri = ranges[at + RangeField.Remote] as number;
        const g = targets[ri] as GrantTarget;
        const generation = await this.#copyRange(
          op,
          batch.locals[ranges[at + RangeField.Local] as number] as HostHandle | CudaHandle,
          ranges[at + RangeField.LocalOffset] as number,
          g,
          bases[ri] as ArrayBuffer | bigint,
          ranges[at + RangeField.RemoteOffset] as number,
          ranges[at + RangeField.Length] as number,
        );
        if (generation !== undefined) {
          const name = g.dataName as string;
          const seen = generations.get(name);
          if (seen !== undefined && seen !== generation) {
            throw new RemoteRejectedError(`the pool slot was rewritten while this batch read it (generations ${seen} and ${generation}): read again`, { details: { remoteCode: 'slot-rewritten' } });
          }
          generations.set(name, generation);
        }
      }
      for (const [name, generation] of generations) this.#sameGeneration(options.transfer, batch, name, generation);
    } finally {
      for (const g of entered) native.grantLeave(g.mapping);
    }
  }

  /**
   * A batch whose every range is device memory on both sides, on one device: all its copies
   * in one native call (one driver copy per range on the device's stream, one sync), instead
   * of one awaited call per range. Returns false (nothing copied) where the batch does not
   * qualify or the addon predates `cudaCopyRanges`; the caller then copies range by range.
   */
  async #deviceRanges(batch: TransferBatch, targets: readonly GrantTarget[], bases: readonly (ArrayBuffer | bigint)[]): Promise<boolean> {
    cudaRanges ??= nativeHas('cudaCopyRanges');
    if (!cudaRanges) return false;
    let device = -1;
    const localAt: number[] = [];
    for (const h of batch.locals) {
      if (!(h instanceof CudaHandle)) return false;
      if (device === -1) device = h.device;
      if (h.device !== device) return false;
      localAt.push(Number(h.pointer));
    }
    const remoteAt: number[] = [];
    for (let i = 0; i < targets.length; i++) {
      const base = bases[i];
      const g = targets[i] as GrantTarget;
      if (typeof base !== 'bigint' || g.device !== device) return false;
      remoteAt.push(Number(base + BigInt(g.offset)));
    }
    // Addresses travel as doubles: every one (and its end) must be exact.
    for (const a of [...localAt, ...remoteAt]) if (!(a + batch.bytes < 2 ** 53)) return false;
    const { op, ranges, count } = batch;
    const need = count * 3;
    if (this.#cudaTable.length < need) this.#cudaTable = new Float64Array(Math.max(need, this.#cudaTable.length * 2));
    const table = this.#cudaTable;
    for (let i = 0; i < count; i++) {
      const at = i * RANGE_STRIDE;
      const local = (localAt[ranges[at + RangeField.Local] as number] as number) + (ranges[at + RangeField.LocalOffset] as number);
      const remote = (remoteAt[ranges[at + RangeField.Remote] as number] as number) + (ranges[at + RangeField.RemoteOffset] as number);
      table[i * 3] = op === 'read' ? local : remote;
      table[i * 3 + 1] = op === 'read' ? remote : local;
      table[i * 3 + 2] = ranges[at + RangeField.Length] as number;
    }
    await native.cudaCopyRanges(device, table, count);
    return true;
  }

  /** One range of {@link #executeRanges}; returns the slot generation when it read a pool slot. */
  async #copyRange(op: 'read' | 'write', local: HostHandle | CudaHandle, localOffset: number, g: GrantTarget, base: ArrayBuffer | bigint, remoteOffset: number, length: number): Promise<bigint | undefined> {
    if (base instanceof ArrayBuffer) {
      const at = g.offset + remoteOffset;
      if (op === 'read' && (g.flags & FLAG_SEQLOCKED) !== 0) {
        // A pool slot: copy under its seqlock (invariant 11); through a staging buffer when
        // the local side is device memory.
        const staging = local instanceof HostHandle ? local.buffer.subarray(localOffset, localOffset + length) : new Uint8Array(length);
        const generation = native.seqCopyRange(base, at, length, staging);
        if (local instanceof CudaHandle) await native.cudaCopy('h2d', local.device, local.pointer + BigInt(localOffset), staging, length);
        return generation;
      }
      // Shared memory without a seqlock (allocateSharedMemory): plain copies.
      const remoteView = new Uint8Array(base, at, length);
      if (local instanceof HostHandle) {
        const localView = local.buffer.subarray(localOffset, localOffset + length);
        if (op === 'read') localView.set(remoteView);
        else remoteView.set(localView);
      } else {
        const ptr = local.pointer + BigInt(localOffset);
        if (op === 'read') await native.cudaCopy('h2d', local.device, ptr, remoteView, length);
        else await native.cudaCopy('d2h', local.device, remoteView, ptr, length);
      }
      return undefined;
    }
    const rptr = base + BigInt(g.offset + remoteOffset);
    if (local instanceof HostHandle) {
      const localView = local.buffer.subarray(localOffset, localOffset + length);
      if (op === 'read') await native.cudaCopy('d2h', g.device, localView, rptr, length);
      else await native.cudaCopy('h2d', g.device, rptr, localView, length);
    } else {
      const lptr = local.pointer + BigInt(localOffset);
      if (op === 'read') await native.cudaCopy('d2d', local.device, lptr, rptr, length);
      else await native.cudaCopy('d2d', local.device, rptr, lptr, length);
    }
    return undefined;
  }

  #grant(remote: RemoteGrant): GrantTarget {
    const cached = this.#grants.get(remote.grantName);
    if (cached) return cached;
    let mapping: ArrayBuffer;
    try {
      mapping = native.shmOpen(remote.grantName, HEADER_SIZE);
    } catch (e) {
      throw new RemoteRejectedError(`grant ${remote.grantName} is revoked or unknown`, { cause: e, details: { remoteCode: 'unknown-grant' } });
    }
    const meta = native.headerDecode(mapping, SegmentKind.Grant);
    if (meta.id.split(':')[1] !== this.peer.nodeId || meta.ownerPid !== this.#peerPid) {
      throw new RemoteRejectedError(`grant ${remote.grantName} was not issued by ${this.peer.nodeId}`, { details: { remoteCode: 'foreign-grant' } });
    }
    const dv = new DataView(mapping);
    const targetCode = dv.getUint32(G_TARGET, true);
    const offset = Number(dv.getBigUint64(G_OFFSET, true));
    const length = Number(dv.getBigUint64(G_LENGTH, true));
    const nameLen = dv.getUint8(G_NAME_LEN);
    if (targetCode > 1 || !Number.isSafeInteger(offset) || !Number.isSafeInteger(length) || length < remote.length || offset + length > MAX_SEGMENT_BYTES) {
      throw new RemoteRejectedError(`grant ${remote.grantName} has an invalid target`, { details: { remoteCode: 'bad-grant' } });
    }
    let dataName: string | undefined;
    if (targetCode === 0) {
      dataName = Buffer.from(mapping, G_NAME, Math.min(nameLen, 200)).toString('latin1');
      if (segmentNameProblem(dataName) !== undefined) {
        throw new RemoteRejectedError(`grant ${remote.grantName} names an invalid segment`, { details: { remoteCode: 'bad-grant' } });
      }
    } else if (meta.device < 0) {
      throw new RemoteRejectedError(`grant ${remote.grantName} has no device`, { details: { remoteCode: 'bad-grant' } });
    }
    const flags = dv.getUint32(G_FLAGS, true);
    const sameProcess = targetCode === 1 && Buffer.compare(new Uint8Array(mapping, G_OWNER_PROCESS, PROCESS_ID.byteLength), PROCESS_ID) === 0;
    const ownerPointer = sameProcess ? dv.getBigUint64(G_OWNER_POINTER, true) : undefined;
    const t: GrantTarget = { mapping, target: targetCode === 0 ? 'host' : 'cuda', offset, length, dataName, device: meta.device, ipcHandle: meta.ipcHandle, flags, ownerPointer };
    this.#remember(this.#grants, remote.grantName, t);
    return t;
  }

  /** A data segment of the peer, mapped once per connection (RemoteRejectedError `gone`). */
  #mapData(name: string): ArrayBuffer {
    let m = this.#data.get(name);
    if (m !== undefined && native.loadState(m) !== SegmentState.Live) {
      // Its owner freed the segment since it was mapped: the name may stand for a new one now
      // (a pool made again under the same owner numbers its slots from 1 again). Map it again.
      this.#data.delete(name);
      m = undefined;
    }
    if (!m) {
      try {
        m = native.shmOpen(name, MAX_SEGMENT_BYTES);
      } catch (e) {
        throw new RemoteRejectedError(`granted segment ${name} is gone`, { cause: e, details: { remoteCode: 'gone' } });
      }
      this.#remember(this.#data, name, m);
    }
    return m;
  }

  /** The data segment of a host grant, mapped once per connection; `index` is the batch's remote. */
  #dataMapping(g: GrantTarget, batch: TransferBatch, index: number): ArrayBuffer {
    const name = g.dataName as string;
    let m: ArrayBuffer;
    try {
      m = this.#mapData(name);
    } catch (e) {
      throw withRequest(e, firstRequest(batch, RangeField.Remote, index));
    }
    // Sizes from fstat (the mapping length), never from the grant alone.
    if (g.offset + g.length > m.byteLength) {
      throw new RemoteRejectedError(`grant range ${g.offset}+${g.length} exceeds segment ${name} (${m.byteLength} bytes)`, {
        details: { remoteCode: 'bounds', request: firstRequest(batch, RangeField.Remote, index) },
      });
    }
    return m;
  }

  async #importBase(name: string, g: GrantTarget): Promise<bigint> {
    // The owner is this process: its own pointer (nothing imported, nothing to close).
    if (g.ownerPointer !== undefined) return g.ownerPointer;
    let p = this.#imports.get(name);
    if (!p) {
      // Imports are closed only with the connection (a copy may be using one), so past the
      // bound a new one is refused rather than an old one evicted.
      if (this.#imports.size >= this.#owner.maxCachedSegments) {
        this.#owner.peerEvent('import_refused', this.peer.nodeId, `${this.#imports.size} CUDA grants imported`);
        throw new ResourceExhaustedError(`cuda-ipc: ${this.#imports.size} CUDA grants of ${this.peer.nodeId} are imported on this connection (limits.maxCachedSegments)`);
      }
      const device = g.device;
      p = native.cudaImport(device, g.ipcHandle).then((base) => ({ device, base }));
      this.#imports.set(name, p);
      // A failed import is not cached: a later chunk may try again.
      p.catch(() => {
        if (this.#imports.get(name) === p) this.#imports.delete(name);
      });
    }
    const { base } = await p;
    // close() waits for chunks in flight and then closes every import in the map, this one included.
    if (this.#closed) throw new SessionInvalidatedError('connection closed during import');
    return base;
  }

  async retire(): Promise<void> {
    if (this.#closed) return this.#closed;
    if (!this.#retiring) {
      this.#retiring = true;
      sendLine(this.#socket, { t: 'retire' });
    }
    await this.#whenIdle();
    return this.close();
  }

  close(error?: TensorwireError): Promise<void> {
    this.#closed ??= (async () => {
      this.#closeError = error;
      await this.#whenIdle();
      this.#socket.destroy();
      const imports = await Promise.allSettled([...this.#imports.values()]);
      this.#imports.clear();
      this.#grants.clear();
      this.#data.clear();
      this.#tables.clear();
      await Promise.allSettled(imports.map((r) => (r.status === 'fulfilled' ? native.cudaCloseImport(r.value.device, r.value.base) : undefined)));
      this.#owner.forget(this);
      for (const l of this.#closeListeners.splice(0)) {
        try {
          l(error);
        } catch {
          // a listener's failure is not ours
        }
      }
    })();
    return this.#closed;
  }
}

/** The same-host transport plugin. */
export class CudaIpcTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name = 'cuda-ipc';
  readonly capabilities: TransportCapabilities;
  readonly #revokeTimeoutMs: number;
  #logger: Logger;
  #host: TransportHost | undefined;
  #presence: { name: string; mapping: ArrayBuffer } | undefined;
  #server: Server | undefined;
  #socketPath: string | undefined;
  readonly #pending = new Set<Socket>();
  /** Accepted sockets that have not finished their handshake (bounded by maxPendingHandshakes). */
  readonly #handshaking = new Set<Socket>();
  readonly #grants = new Set<Grant>();
  readonly #connections = new Set<CudaIpcConnection>();
  /** Connections peers opened to this transport (bounded in all and per peer). */
  readonly #inbound = new Set<CudaIpcConnection>();
  readonly #handshakeTimeoutMs: number;
  readonly #maxPendingHandshakes: number;
  readonly #maxConnections: number;
  readonly #maxConnectionsPerPeer: number;
  /** Per-connection bound on cached mappings of a peer's segments, per kind (see {@link CudaIpcLimits}). */
  readonly maxCachedSegments: number;
  /** Where peer events are counted in prom-client ({@link CudaIpcTransportOptions.metrics}); undefined when off. */
  readonly metrics: kit.KitMetrics | undefined;
  /** Peer events: counted, logged at most once a second per kind, counted in {@link metrics}. */
  readonly #events: kit.PeerEvents<CudaIpcPeerEvent>;
  /** Grant tables (range grants), in creation order, and the first one's geometry. */
  readonly #tables: GrantTable[] = [];
  readonly #tableGeometry: TableGeometry;
  readonly #maxTables: number;
  /** Threads that copy a host batch's bytes ({@link CudaIpcTransportOptions.copyThreads}). */
  readonly copyThreads: number;
  /** Host batches of at least this many bytes are copied off the JavaScript thread ({@link CudaIpcTransportOptions.asyncCopyBytes}). */
  readonly asyncCopyBytes: number;
  /** Live range grants (not yet revoked). */
  readonly #rangeGrants = new Set<RangeGrant>();
  /** Range grants revoked while a peer batch was inside them, until it left (or the wait timed out): `revoked` is that wait. */
  readonly #drainingGrants = new Set<RangeGrant>();
  #closed: Promise<void> | undefined;

  constructor(options: CudaIpcTransportOptions = {}) {
    const caps = nativeCapabilities();
    if (!caps.sharedMemory.available) {
      throw new InvalidInputError(`cuda-ipc transport unavailable: ${caps.sharedMemory.reason ?? 'unknown'}`);
    }
    const maxChunk = options.maxChunkBytes ?? 64 * 2 ** 20;
    if (!Number.isSafeInteger(maxChunk) || maxChunk < 1) throw new InvalidInputError('maxChunkBytes must be a positive integer', { details: { field: 'maxChunkBytes' } });
    this.#revokeTimeoutMs = options.revokeTimeoutMs ?? 10_000;
    this.#logger = options.logger ?? silentLogger;
    this.metrics = kit.kitMetrics(options.metrics);
    this.#events = new kit.PeerEvents({ transport: this.name, texts: PEER_EVENT_TEXT, counter: this.metrics?.peerEvents });
    const gt = options.grantTable ?? {};
    this.#tableGeometry = { records: gt.records ?? 4096, dir: gt.segments ?? 4096, arena: gt.rangeBytes ?? 4 * 2 ** 20 };
    checkGeometry(this.#tableGeometry, 'grantTable');
    this.#maxTables = gt.maxTables ?? 8;
    this.copyThreads = options.copyThreads ?? defaultCopyThreads();
    if (!Number.isSafeInteger(this.copyThreads) || this.copyThreads < 1 || this.copyThreads > MAX_COPY_THREADS) {
      throw new InvalidInputError(`copyThreads must be an integer from 1 to ${MAX_COPY_THREADS}`, { details: { field: 'copyThreads' } });
    }
    this.asyncCopyBytes = options.asyncCopyBytes ?? DEFAULT_ASYNC_COPY_BYTES;
    if (!(this.asyncCopyBytes === Number.POSITIVE_INFINITY || (Number.isSafeInteger(this.asyncCopyBytes) && this.asyncCopyBytes >= 1))) {
      throw new InvalidInputError(`asyncCopyBytes must be a positive integer or Infinity, got ${String(options.asyncCopyBytes)}`, { details: { field: 'asyncCopyBytes' } });
    }
    const lim = options.limits ?? {};
    this.#handshakeTimeoutMs = limit('handshakeTimeoutMs', lim.handshakeTimeoutMs, 10_000, 3_600_000);
    this.#maxPendingHandshakes = limit('maxPendingHandshakes', lim.maxPendingHandshakes, 64, 1 << 20);
    this.#maxConnections = limit('maxConnections', lim.maxConnections, 1024, 1 << 20);
    this.#maxConnectionsPerPeer = limit('maxConnectionsPerPeer', lim.maxConnectionsPerPeer, 8, 1 << 20);
    this.maxCachedSegments = limit('maxCachedSegments', lim.maxCachedSegments, 1024, 1 << 20);
    if (!Number.isSafeInteger(this.#maxTables) || this.#maxTables < 1 || this.#maxTables > 64) {
      throw new InvalidInputError('grantTable.maxTables must be an integer from 1 to 64', { details: { field: 'grantTable.maxTables' } });
    }
    this.capabilities = Object.freeze({
      local: true,
      remote: false,
      memoryKinds: caps.cuda.available ? (['host', 'cuda'] as const) : (['host'] as const),
      oneSidedRead: true,
      oneSidedWrite: true,
      cpuBypass: true,
      scopedGrants: true,
      rank: 50,
      // Host batches are one native copy each (the copy pool spreads a large one over threads):
      // several streams would add calls, not parallelism, and split a transfer's ranges of a slot
      // into several seqlock snapshots. One stream, one batch per transfer post.
      maxStreams: 1,
      maxChunkBytes: maxChunk,
    });
  }

  #assertOpen(): void {
    if (this.#closed) throw new ClosedError('cuda-ipc transport is closed');
  }

  /**
   * How often each bound was applied to a peer since this transport was created: connections
   * refused or closed, cached mappings dropped, imports refused. Each is also logged (at most
   * once a second per kind, with the number left out since the last line) and counted in
   * {@link metrics} (`tensorwire_transport_peer_events_total{transport="cuda-ipc",event}`).
   */
  peerEvents(): Readonly<Record<CudaIpcPeerEvent, number>> {
    return this.#events.counts();
  }

  /** @internal Count (and log, rate-limited) a bound applied to a peer. */
  peerEvent(event: CudaIpcPeerEvent, peer: string | undefined, message: string): void {
    this.#events.record(event, peer, message, this.#logger);
  }

  #identity(): NodeIdentity {
    if (!this.#host) throw new ClosedError('cuda-ipc transport not started');
    return this.#host.identity;
  }

  async start(host: TransportHost): Promise<void> {
    this.#assertOpen();
    if (this.#host) throw new InvalidInputError('cuda-ipc transport already started');
    this.#host = host;
    this.#logger = host.logger ?? this.#logger;
    hookExit();
    const { nodeId, incarnation, hostId } = host.identity;
    const name = randomSegmentName('n', nodeId);
    const mapping = native.shmCreate(name, HEADER_SIZE, {
      kind: SegmentKind.Node,
      id: formatId('node', nodeId, incarnation),
      ownerPid: process.pid,
      ownerStart: selfStartTime(),
    });
    const hb = Buffer.from(hostId, 'latin1');
    new Uint8Array(mapping, N_HOST_LEN, 1)[0] = hb.length;
    new Uint8Array(mapping, N_HOST, hb.length).set(hb);
    native.setState(mapping, SegmentState.Live);
    this.#presence = { name, mapping };
    // The pid and start time in the name let sweep() remove the file of a process that was
    // SIGKILLed (no exit hook ran); a normal exit without close() unlinks it in the exit hook.
    const socketPath = newSocketPath();
    const server = createServer((socket) => this.#accept(socket));
    unlinkSocketAtExit(socketPath);
    try {
      await new Promise<void>((resolve, reject) => {
        server.once('error', reject);
        server.listen(socketPath, () => {
          server.off('error', reject);
          resolve();
        });
      });
    } catch (e) {
      forgetSocketAtExit(socketPath);
      throw e;
    }
    server.on('error', (e) => this.#logger.warn('cuda-ipc listener error', { error: String(e) }));
    chmodSync(socketPath, 0o600);
    this.#server = server;
    this.#socketPath = socketPath;
  }

  /** Presence segment of a peer, checked against the identity it claims. */
  #checkPresence(nodeId: string, incarnation: string, hostId: string, presenceName: string): { mapping: ArrayBuffer; pid: number; start: bigint } {
    const mapping = native.shmOpen(presenceName, HEADER_SIZE);
    const meta = native.headerDecode(mapping, SegmentKind.Node, formatId('node', nodeId, incarnation));
    const hostLen = new Uint8Array(mapping, N_HOST_LEN, 1)[0] as number;
    const segHost = Buffer.from(mapping, N_HOST, Math.min(hostLen, 64)).toString('latin1');
    if (meta.state !== SegmentState.Live || !isProcessAlive(meta.ownerPid, meta.ownerStart) || segHost !== hostId) {
      throw new ConnectionBrokenError(`presence segment of ${nodeId} is not live or does not match`);
    }
    return { mapping, pid: meta.ownerPid, start: meta.ownerStart };
  }

  /** An inbound handshake: the peer proves its identity through its presence segment. */
  #accept(socket: Socket): void {
    if (this.#closed || !this.#host) {
      socket.destroy();
      return;
    }
    socket.on('error', () => undefined);
    if (this.#handshaking.size >= this.#maxPendingHandshakes) {
      socket.destroy();
      this.peerEvent('pending_handshakes', undefined, `${this.#handshaking.size} connections are already half-way through their handshakes`);
      return;
    }
    this.#pending.add(socket);
    this.#handshaking.add(socket);
    const timer = setTimeout(() => {
      socket.destroy();
      this.peerEvent('handshake_timeout', undefined, `no handshake within ${this.#handshakeTimeoutMs} ms`);
    }, this.#handshakeTimeoutMs);
    let done = false;
    const finish = (): void => {
      done = true;
      clearTimeout(timer);
      this.#pending.delete(socket);
      this.#handshaking.delete(socket);
      socket.removeAllListeners('data');
    };
    socket.once('close', () => {
      if (!done) finish();
    });
    onLines(socket, (msg) => {
      if (done) return;
      const me = this.#host?.identity;
      const { nodeId, incarnation, hostId, presence } = msg;
      try {
        if (msg['t'] !== 'hello' || !me || !isToken(nodeId) || !isToken(incarnation) || !isToken(hostId) || typeof presence !== 'string') {
          throw new InvalidInputError('bad hello');
        }
        if (hostId !== me.hostId) throw new InvalidInputError('different host');
        if (segmentNameProblem(presence) !== undefined || !presence.startsWith('/tw-n.')) throw new InvalidInputError('bad presence name');
        const p = this.#checkPresence(nodeId, incarnation, hostId, presence);
        if (this.#inbound.size >= this.#maxConnections) {
          this.peerEvent('connections', nodeId, `${this.#inbound.size} inbound connections are open`);
          throw new ResourceExhaustedError(`busy: ${this.#inbound.size} inbound connections are open`);
        }
        let fromPeer = 0;
        for (const c of this.#inbound) if (c.peer.nodeId === nodeId) fromPeer++;
        if (fromPeer >= this.#maxConnectionsPerPeer) {
          this.peerEvent('peer_connections', nodeId, `${fromPeer} inbound connections from ${nodeId} are open`);
          throw new ResourceExhaustedError(`busy: ${fromPeer} inbound connections from ${nodeId} are open`);
        }
        finish();
        const conn = new CudaIpcConnection({ nodeId, incarnation, hostId }, nodeId, this.capabilities.maxStreams, this, p.mapping, p.pid, p.start, socket);
        this.#connections.add(conn);
        this.#inbound.add(conn);
        // Hand it to the engine first: a closing engine closes it, and then no welcome is sent.
        this.#host?.inbound(conn);
        if (conn.isOpen) sendLine(socket, { t: 'welcome', nodeId: me.nodeId, incarnation: me.incarnation });
      } catch (e) {
        finish();
        sendLine(socket, { t: 'reject', reason: e instanceof Error ? e.message : String(e) });
        socket.end();
      }
    }, (why) => {
      finish();
      this.peerEvent('protocol_violation', undefined, why);
    });
  }

  endpoint(): Uint8Array {
    const id = this.#identity();
    if (!this.#presence) throw new ClosedError('cuda-ipc transport not started');
    return encodeEndpointBlob({ hostId: id.hostId, presence: this.#presence.name, pid: process.pid, socketPath: this.#socketPath as string });
  }

  unreachableReason(peer: NodeIdentity, endpoint: Uint8Array): string | undefined {
    const me = this.#host?.identity;
    let ep: EndpointInfo;
    try {
      ep = decodeEndpointBlob(endpoint);
    } catch (e) {
      return `bad cuda-ipc endpoint: ${e instanceof Error ? e.message : String(e)}`;
    }
    if (me && (peer.hostId !== me.hostId || ep.hostId !== me.hostId)) return 'different host';
    return undefined;
  }

  async register(memory: Memory): Promise<TransportRegistration> {
    this.#assertOpen();
    const id = this.#identity();
    if (memory.kind === 'host') {
      if (!(memory.buffer instanceof Uint8Array) || memory.buffer.byteLength === 0) throw new InvalidInputError('host memory needs a non-empty Uint8Array');
      const r = regionOf(memory.buffer);
      if (!r) {
        return { handle: new HostHandle(memory.buffer, undefined, undefined, 0), payload: encodePayload('host', undefined, memory.buffer.byteLength) };
      }
      const token = new Uint8Array(randomBytes(TOKEN_BYTES));
      const flags = r.region.seqlocked ? FLAG_SEQLOCKED : 0;
      const base = r.region.dataOffset + r.offset;
      const grant = this.#createGrant(id, 'host', base, memory.buffer.byteLength, r.region.name, token, -1, undefined, 0, flags);
      const segment: GrantedSegment = { name: r.region.name, dataBytes: r.region.dataBytes, seqlocked: r.region.seqlocked === true };
      return { handle: new HostHandle(memory.buffer, grant, segment, base), payload: encodePayload('host', { name: grant.name, token }, memory.buffer.byteLength) };
    }
    if (memory.kind === 'cuda') {
      if (!this.capabilities.memoryKinds.includes('cuda')) {
        throw new InvalidInputError(`cuda memory is not available here: ${nativeCapabilities().cuda.reason ?? 'unknown'}`, { details: { field: 'memory.kind' } });
      }
      if (!Number.isSafeInteger(memory.byteLength) || memory.byteLength < 1) throw new InvalidInputError('cuda memory needs a positive byteLength');
      const exp = await native.cudaExport(memory.device, memory.pointer);
      if (exp.offset + memory.byteLength > exp.allocSize) {
        throw new InvalidInputError(`cuda range of ${memory.byteLength} bytes at offset ${exp.offset} exceeds its allocation of ${exp.allocSize} bytes`);
      }
      const token = new Uint8Array(randomBytes(TOKEN_BYTES));
      const grant = this.#createGrant(id, 'cuda', exp.offset, memory.byteLength, undefined, token, memory.device, exp.handle, exp.offset, 0, exp.base);
      return {
        handle: new CudaHandle(memory.device, memory.pointer, memory.byteLength, grant),
        payload: encodePayload('cuda', { name: grant.name, token }, memory.byteLength),
      };
    }
    throw new InvalidInputError(`unknown memory kind ${JSON.stringify((memory as { kind: unknown }).kind)}`, { details: { field: 'memory.kind' } });
  }

  #createGrant(
    id: NodeIdentity,
    target: 'host' | 'cuda',
    offset: number,
    length: number,
    dataName: string | undefined,
    token: Uint8Array,
    device: number,
    ipcHandle: Uint8Array | undefined,
    ipcOffset: number,
    flags: number,
    ownerPointer = 0n,
  ): Grant {
    const name = randomSegmentName('g', id.nodeId);
    const mapping = native.shmCreate(name, HEADER_SIZE, {
      kind: SegmentKind.Grant,
      id: formatId('block', id.nodeId, `g${name.slice(-32)}`),
      capacity: length,
      ownerPid: process.pid,
      ownerStart: selfStartTime(),
      device,
      ...(ipcHandle ? { ipcHandle } : {}),
      ipcOffset,
    });
    const dv = new DataView(mapping);
    new Uint8Array(mapping, G_TOKEN, TOKEN_BYTES).set(token);
    dv.setUint32(G_TARGET, target === 'host' ? 0 : 1, true);
    dv.setBigUint64(G_OFFSET, BigInt(offset), true);
    dv.setBigUint64(G_LENGTH, BigInt(length), true);
    if (dataName) {
      const nb = Buffer.from(dataName, 'latin1');
      dv.setUint8(G_NAME_LEN, nb.length);
      new Uint8Array(mapping, G_NAME, nb.length).set(nb);
    }
    dv.setUint32(G_FLAGS, flags, true);
    if (target === 'cuda') {
      dv.setBigUint64(G_OWNER_POINTER, ownerPointer, true);
      new Uint8Array(mapping, G_OWNER_PROCESS, PROCESS_ID.byteLength).set(PROCESS_ID);
    }
    // Publish (seq_cst store): the ext written above is visible to anyone who sees it live.
    native.setState(mapping, SegmentState.Live);
    const grant = new Grant(name, mapping);
    this.#grants.add(grant);
    return grant;
  }

  revoke(handle: object): Promise<void> {
    if (!(handle instanceof HostHandle || handle instanceof CudaHandle)) {
      return Promise.reject(new InvalidInputError('not a cuda-ipc registration handle'));
    }
    if (handle instanceof CudaHandle) return this.#revokeGrant(handle.grant);
    if (!handle.revoked) {
      handle.revoked = true;
      // Range grants over it go first (the engine revokes them before, a direct caller may not):
      // nothing may reach the memory through them afterwards.
      const dependents: Promise<void>[] = [];
      for (const g of this.#rangeGrants) if (g.handles.includes(handle)) dependents.push(this.revokeGrant(g));
      // And those revoked before whose peer batches are still inside: they may still copy the memory.
      for (const g of this.#drainingGrants) if (g.handles.includes(handle)) dependents.push(g.revoked as Promise<void>);
      // And copies off the JavaScript thread into or out of it that are still running.
      dependents.push(handle.copies.idle());
      handle.revokedRanges = Promise.all(dependents).then(() => {
        for (const t of handle.tables ?? []) t.detach(handle.segment as GrantedSegment);
        handle.tables = undefined;
        handle.dirs = undefined;
      });
    }
    const grant = handle.grant;
    return grant ? Promise.all([handle.revokedRanges, this.#revokeGrant(grant)]).then(() => undefined) : (handle.revokedRanges as Promise<void>);
  }

  /**
   * Grant peers access to `ranges` of host registrations of this transport that lie in shared
   * memory (pool slots, allocateSharedMemory): one record in a grant table, its range table in
   * the table's arena, no segment per grant. Payload: table name, record, generation, token.
   * CUDA registrations and local-only host memory are refused (InvalidInputError); full tables
   * beyond `grantTable.maxTables` give ResourceExhaustedError.
   */
  grant(spec: GrantRanges): TransportRegistration {
    this.#assertOpen();
    const id = this.#identity();
    const { handles, count, blocks } = spec;
    if (blocks === undefined) {
      if (!Number.isSafeInteger(count) || count < 1 || !(spec.ranges instanceof Float64Array) || spec.ranges.length < count * GRANT_STRIDE || !Array.isArray(handles)) {
        throw new InvalidInputError('grant: ranges are malformed', { details: { field: 'ranges' } });
      }
    } else {
      const b = blocks as Partial<GrantBlocks> | null;
      if (
        !Number.isSafeInteger(count) ||
        count < 1 ||
        typeof b !== 'object' ||
        b === null ||
        !(b.indices instanceof Uint32Array) ||
        b.indices.length < count ||
        !Number.isSafeInteger(b.base) ||
        (b.base as number) < 0 ||
        !Number.isSafeInteger(b.blockBytes) ||
        (b.blockBytes as number) < 1
      ) {
        throw new InvalidInputError('grant: blocks are malformed (indices for every range, a base >= 0, blocks of at least 1 byte)', { details: { field: 'blocks' } });
      }
      if (!Array.isArray(handles) || handles.length !== 1) throw new InvalidInputError('grant: a block grant covers one registration', { details: { field: 'handles' } });
    }
    const n = handles.length;
    const hs: HostHandle[] = new Array<HostHandle>(n);
    for (let j = 0; j < n; j++) {
      const h: unknown = handles[j];
      if (h instanceof CudaHandle) {
        throw new InvalidInputError('cuda-ipc range grants cover host shared memory only; CUDA memory is granted per registration (register it)', {
          details: { field: 'registration', registration: j },
        });
      }
      if (!(h instanceof HostHandle)) throw new InvalidInputError(`grant: handle ${j} is not a cuda-ipc registration`, { details: { field: 'registration', registration: j } });
      if (h.revoked) throw new InvalidInputError(`grant: registration ${j} was revoked`, { details: { field: 'registration', registration: j } });
      if (!h.segment) {
        throw new InvalidInputError(`grant: registration ${j} is for local use only (not in shared memory: allocate it with allocateSharedMemory() or use a pool slot)`, {
          details: { field: 'registration', registration: j },
        });
      }
      hs[j] = h;
    }
    const arenaBytes = blocks === undefined ? count * RANGE_BYTES : blockTableBytes(count);
    const { table, arenaOffset, record, generation } = this.#reserve(id.nodeId, arenaBytes, hs);
    // Directory references: once per registration and table (released when it is revoked);
    // a registration remembers its index, so later grants over it look up nothing by name.
    const dirOf = new Uint32Array(n);
    let bytes: number;
    try {
      for (let j = 0; j < n; j++) {
        const h = hs[j] as HostHandle;
        const ti = h.tables === undefined ? -1 : h.tables.indexOf(table);
        if (ti >= 0) dirOf[j] = (h.dirs as number[])[ti] as number;
        else {
          const d = table.attach(h.segment as GrantedSegment);
          (h.tables ??= []).push(table);
          (h.dirs ??= []).push(d);
          dirOf[j] = d;
        }
      }
      if (blocks === undefined) {
        // Every range checked (the engine did too; this is our own bound) and the range table
        // written, in one pass (src/grants.ts); a bad range leaves nothing published.
        bytes = table.writeRanges(arenaOffset, spec.ranges, count, hs, dirOf);
      } else {
        // A block grant: the indices copied as they are (one copy). Indices the engine checked
        // (engineCheckedBlocks: it made this spec) need nothing more; any other caller's are
        // bounded here, on what was written, against the blocks that fit the registration.
        // Every reader also bounds each index against the mapping size it learned itself.
        const h = hs[0] as HostHandle;
        const fit = blocks.base < h.buffer.byteLength ? Math.floor((h.buffer.byteLength - blocks.base) / blocks.blockBytes) : 0;
        bytes = table.writeBlocks(arenaOffset, dirOf[0] as number, h.base + blocks.base, blocks.blockBytes, blocks.indices, count, engineCheckedBlocks(spec) ? undefined : fit);
      }
    } catch (e) {
      // Nothing was published: the record and its range table go back (references taken stay with their registrations).
      table.untakeRecord(record);
      table.arena.free(arenaOffset, arenaBytes);
      throw e;
    }
    const token = new Uint8Array(TOKEN_BYTES);
    freshToken(token, 0);
    table.writeRecord(record, token, arenaOffset, count, blocks === undefined ? RecordForm.Ranges : RecordForm.Blocks);
    native.recordPublish(table.mapping, table.recordOffset(record), generation);
    const g = new RangeGrant(this, table, record, generation, arenaOffset, arenaBytes, hs);
    this.#rangeGrants.add(g);
    return { handle: g, payload: encodeRangePayload(table.name, record, generation, token, count, bytes, blocks !== undefined) };
  }

  /** A record and `bytes` of arena in a table with directory room for the segments of `hs`; a new table when none fits. */
  #reserve(nodeId: string, bytes: number, hs: readonly HostHandle[]): { table: GrantTable; arenaOffset: number; record: number; generation: number } {
    const take = (t: GrantTable): { table: GrantTable; arenaOffset: number; record: number; generation: number } | undefined => {
      if (t.freeRecords === 0 || t.missing(hs) > t.freeDir) return undefined;
      const arenaOffset = t.arena.alloc(bytes);
      if (arenaOffset === undefined) return undefined;
      const rec = t.takeRecord() as { index: number; generation: number };
      return { table: t, arenaOffset, record: rec.index, generation: rec.generation };
    };
    // Newest first: older tables drain as their grants are revoked.
    for (let i = this.#tables.length - 1; i >= 0; i--) {
      const got = take(this.#tables[i] as GrantTable);
      if (got) return got;
    }
    if (this.#tables.length >= this.#maxTables) {
      throw new ResourceExhaustedError(`cuda-ipc: all ${this.#maxTables} grant tables are full (revoke grants, or raise grantTable limits)`, { details: { field: 'grantTable' } });
    }
    const segments = new Set(hs.map((h) => (h.segment as GrantedSegment).name)).size;
    const geometry = grownGeometry(this.#tableGeometry, this.#tables.length, { records: 1, dir: segments, arena: bytes });
    if (geometry.dir < segments || geometry.arena < bytes) {
      throw new InvalidInputError(`cuda-ipc: a grant over ${segments} segments and ${bytes} bytes of range table does not fit the largest grant table`, { details: { field: 'ranges' } });
    }
    const t = GrantTable.create(nodeId, geometry);
    this.#tables.push(t);
    return take(t) as { table: GrantTable; arenaOffset: number; record: number; generation: number };
  }

  /**
   * Revoke a range grant: O(1). Mark the record revoked, zero its token and bump its
   * generation (one native call: from now on every peer batch is refused), then wait (bounded
   * by `revokeTimeoutMs`) for the batches already inside to leave, then free the record and its
   * range table for reuse. A record whose drain timed out is retired, never reused. Idempotent.
   */
  revokeGrant(handle: object): Promise<void> {
    if (!(handle instanceof RangeGrant) || handle.owner !== this) return Promise.reject(new InvalidInputError('not a cuda-ipc range grant of this transport'));
    return (handle.revoked ??= this.#revokeRange(handle));
  }

  #revokeRange(g: RangeGrant): Promise<void> {
    const t = g.table;
    const off = t.recordOffset(g.record);
    this.#rangeGrants.delete(g);
    const active = native.recordRevoke(t.mapping, off, g.generation + 1);
    if (active === 0) {
      this.#freeRange(g);
      return Promise.resolve();
    }
    const p = (async () => {
      const until = Date.now() + this.#revokeTimeoutMs;
      let delay = 1;
      while (native.recordActive(t.mapping, off) > 0 && Date.now() < until) {
        await new Promise((r) => setTimeout(r, delay));
        delay = Math.min(delay * 2, 20);
      }
      if (native.recordActive(t.mapping, off) > 0) {
        this.#logger.warn('cuda-ipc: a peer batch was still inside a range grant when revoke timed out; its record is retired', { table: t.name, record: g.record });
        t.retireRecord();
        t.arena.free(g.arenaOffset, g.arenaBytes);
        return;
      }
      this.#freeRange(g);
    })();
    this.#drainingGrants.add(g);
    void p.finally(() => this.#drainingGrants.delete(g));
    return p;
  }

  #freeRange(g: RangeGrant): void {
    const t = g.table;
    native.recordFree(t.mapping, t.recordOffset(g.record));
    t.freeRecord(g.record, g.generation + 1);
    t.arena.free(g.arenaOffset, g.arenaBytes);
  }

  /** Grant tables of this transport (diagnostics and tests): name, geometry, live grants, free records. */
  grantTables(): { name: string; geometry: TableGeometry; live: number; freeRecords: number; freeRangeBytes: number }[] {
    return this.#tables.map((t) => ({ name: t.name, geometry: t.geometry, live: t.live, freeRecords: t.freeRecords, freeRangeBytes: t.arena.freeBytes }));
  }

  /** Mark dead, zero the token, wait (bounded) for peer copies in flight to leave, unlink. Idempotent. */
  #revokeGrant(grant: Grant): Promise<void> {
    grant.revoked ??= (async () => {
      native.grantRevoke(grant.mapping);
      const until = Date.now() + this.#revokeTimeoutMs;
      let delay = 1;
      while (native.grantActive(grant.mapping) > 0 && Date.now() < until) {
        await new Promise((r) => setTimeout(r, delay));
        delay = Math.min(delay * 2, 20);
      }
      if (native.grantActive(grant.mapping) > 0) {
        this.#logger.warn('cuda-ipc: a peer copy was still in flight when revoke timed out', { grant: grant.name });
      }
      native.shmUnlink(grant.name);
      this.#grants.delete(grant);
    })();
    return grant.revoked;
  }

  /**
   * Decoded payloads by payload object, with a copy of the bytes they were decoded from: the
   * engine hands the same payload of a descriptor it decoded once on every transfer, and a
   * payload whose bytes changed is decoded again.
   */
  readonly #decoded = new WeakMap<
    Uint8Array,
    { readonly bytes: Uint8Array; readonly kind: MemoryKind; readonly length: number; readonly lengths: Float64Array | undefined; readonly remote: RemoteGrant | RemoteRangeGrant }
  >();

  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths?: Float64Array): unknown {
    const c = payload instanceof Uint8Array ? this.#decoded.get(payload) : undefined;
    // The same range lengths object (the engine's decoded descriptor): it is the one decoded.
    if (c && c.kind === memoryKind && c.length === byteLength && c.lengths === rangeLengths && sameBytes(c.bytes, payload)) return c.remote;
    const remote = decodePayload(payload, memoryKind, byteLength, rangeLengths);
    this.#decoded.set(payload, { bytes: payload.slice(), kind: memoryKind, length: byteLength, lengths: rangeLengths, remote });
    return remote;
  }

  async connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    this.#assertOpen();
    const me = this.#identity();
    if (options.signal.aborted) throw errorFromSignal(options.signal, `cuda-ipc connect to ${peer.nodeId}`);
    const ep = decodeEndpointBlob(endpoint);
    if (peer.hostId !== me.hostId || ep.hostId !== me.hostId) {
      throw new ConnectionBrokenError(`cuda-ipc cannot reach ${peer.nodeId}: different host`);
    }
    let p: { mapping: ArrayBuffer; pid: number; start: bigint };
    try {
      p = this.#checkPresence(peer.nodeId, peer.incarnation, peer.hostId, ep.presence);
    } catch (e) {
      throw new ConnectionBrokenError(`cuda-ipc handshake with ${peer.nodeId} failed: ${e instanceof Error ? e.message : String(e)}`, { cause: e });
    }
    if (p.pid !== ep.pid) throw new ConnectionBrokenError(`cuda-ipc handshake with ${peer.nodeId} failed: pid mismatch`);
    const socket = createConnection(ep.socketPath);
    this.#pending.add(socket);
    try {
      await new Promise<void>((resolve, reject) => {
        const fail = (e: TensorwireError): void => {
          cleanup();
          socket.destroy();
          reject(e);
        };
        const onAbort = (): void => fail(errorFromSignal(options.signal, `cuda-ipc connect to ${peer.nodeId}`));
        const timer = setTimeout(() => fail(new ConnectionBrokenError(`cuda-ipc handshake with ${peer.nodeId} timed out`)), Math.max(1, options.deadline - Date.now()));
        const onClose = (): void => fail(new ConnectionBrokenError(`cuda-ipc: ${peer.nodeId} closed the socket during the handshake`));
        const cleanup = (): void => {
          clearTimeout(timer);
          options.signal.removeEventListener('abort', onAbort);
          socket.off('close', onClose);
          socket.removeAllListeners('data');
        };
        options.signal.addEventListener('abort', onAbort, { once: true });
        socket.on('error', () => undefined);
        socket.once('close', onClose);
        socket.once('connect', () => sendLine(socket, { t: 'hello', nodeId: me.nodeId, incarnation: me.incarnation, hostId: me.hostId, presence: this.#presence?.name }));
        onLines(socket, (msg) => {
          if (msg['t'] === 'welcome' && msg['nodeId'] === peer.nodeId && msg['incarnation'] === peer.incarnation) {
            cleanup();
            resolve();
          } else {
            fail(new ConnectionBrokenError(`cuda-ipc handshake with ${peer.nodeId} refused: ${String(msg['reason'] ?? 'identity mismatch')}`));
          }
        });
      });
    } finally {
      this.#pending.delete(socket);
    }
    if (this.#closed) {
      socket.destroy();
      throw new ClosedError('cuda-ipc transport is closed');
    }
    const conn = new CudaIpcConnection(peer, me.nodeId, Math.max(1, Math.min(options.streams, this.capabilities.maxStreams)), this, p.mapping, p.pid, p.start, socket);
    this.#connections.add(conn);
    return conn;
  }

  /** @internal */
  forget(conn: CudaIpcConnection): void {
    this.#connections.delete(conn);
    this.#inbound.delete(conn);
  }

  close(): Promise<void> {
    this.#closed ??= (async () => {
      if (this.#presence) {
        native.setState(this.#presence.mapping, SegmentState.Dead);
        native.shmUnlink(this.#presence.name);
      }
      const server = this.#server;
      const serverClosed = server ? new Promise<void>((r) => server.close(() => r())) : Promise.resolve();
      for (const s of this.#pending) s.destroy();
      await Promise.allSettled([...this.#connections].map((c) => c.close(new ClosedError('cuda-ipc transport closed'))));
      await serverClosed;
      if (this.#socketPath) {
        forgetSocketAtExit(this.#socketPath);
        try {
          unlinkSync(this.#socketPath);
        } catch {
          // already gone
        }
      }
      // Same drain as revoke(): a peer's copy in flight finishes before the grant goes
      // (the registered memory may be reused the moment close() resolves, invariant 6).
      await Promise.allSettled([...[...this.#rangeGrants].map((g) => this.revokeGrant(g)), ...[...this.#drainingGrants].map((g) => g.revoked)]);
      for (const t of this.#tables.splice(0)) {
        try {
          t.close();
        } catch (e) {
          this.#logger.warn('cuda-ipc: closing a grant table failed', { table: t.name, error: String(e) });
        }
      }
      await Promise.allSettled([...this.#grants].map((g) => this.#revokeGrant(g)));
    })();
    return this.#closed;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
