/**
 * The transport plugin interface, specification version 2.
 *
 * v2 makes batches the unit of work: `execute()` takes one {@link TransferBatch} per stream
 * (typed arrays of ranges over small tables of handles), not one object per chunk.
 *
 * A transport moves bytes between registered memory on two nodes. It implements only
 * what is device-specific; the {@link TransferEngine} above it owns the connection table,
 * transport selection, chunking, parallel streams, deadlines, retries on backpressure,
 * error policy and metrics. See the package README, "Writing a transport".
 */
import type { TensorwireError } from './errors.js';
import type { Logger } from './logger.js';

/** The version tag of this interface. A transport declares it; the engine refuses others. */
export const TRANSPORT_SPECIFICATION_VERSION = 'v2' as const;
export type TransportSpecificationVersion = typeof TRANSPORT_SPECIFICATION_VERSION;

export type MemoryKind = 'host' | 'cuda';
export const MEMORY_KINDS: readonly MemoryKind[] = ['host', 'cuda'];

/** Host memory: any Uint8Array (ArrayBuffer, SharedArrayBuffer, or an addon's external buffer). */
export interface HostMemory {
  readonly kind: 'host';
  readonly buffer: Uint8Array;
}

/** Device memory on one CUDA device, by address. The engine never dereferences it. */
export interface CudaMemory {
  readonly kind: 'cuda';
  readonly device: number;
  readonly pointer: bigint;
  readonly byteLength: number;
}

export type Memory = HostMemory | CudaMemory;

export function memoryByteLength(memory: Memory): number {
  return memory.kind === 'host' ? memory.buffer.byteLength : memory.byteLength;
}

/**
 * Who a node is. `nodeId` is stable across restarts (an owner name, see ids.ts);
 * `incarnation` is random per process start, so a restarted peer is a different peer;
 * `hostId` says which machine it runs on, so same-host transports can tell.
 */
export interface NodeIdentity {
  readonly nodeId: string;
  readonly incarnation: string;
  readonly hostId: string;
}

export interface TransportCapabilities {
  /** Works between processes on the same host. */
  readonly local: boolean;
  /** Works between hosts. */
  readonly remote: boolean;
  /** Memory kinds it can register and move. */
  readonly memoryKinds: readonly MemoryKind[];
  /** A READ needs no action from the remote application: the transport (or the NIC) serves it. */
  readonly oneSidedRead: boolean;
  /** Likewise for WRITE. */
  readonly oneSidedWrite: boolean;
  /** The remote CPU does not touch the bytes at all (RDMA, CUDA IPC). False for TCP. */
  readonly cpuBypass?: boolean;
  /** Each registration is granted separately and can be revoked, after which remote access fails. */
  readonly scopedGrants: boolean;
  /** Preference when several transports can serve a peer: higher is faster. TCP is 10. */
  readonly rank: number;
  /** Most parallel streams one connection can have (queue pairs, sockets). */
  readonly maxStreams: number;
  /** Largest single chunk it accepts; the engine caps its chunk size to this. */
  readonly maxChunkBytes: number;
}

/** What {@link Transport.register} returns. */
export interface TransportRegistration {
  /** Opaque per-registration handle, handed back to the transport in {@link TransferBatch.locals}. */
  readonly handle: object;
  /**
   * The transport-specific part of the exportable descriptor (a token, an rkey and address,
   * a shared-memory name…). The engine wraps it in an envelope that names the transport, the
   * owner node and incarnation, the memory kind and the byte length.
   */
  readonly payload: Uint8Array;
}

/**
 * Layout of one range in {@link TransferBatch.ranges}: {@link RANGE_STRIDE} numbers per range,
 * at these positions. Every value is a non-negative safe integer.
 */
export const RangeField = {
  /** Index of the request this range came from, in the caller's request list (for errors). */
  Request: 0,
  /** Index into {@link TransferBatch.locals}. */
  Local: 1,
  LocalOffset: 2,
  /** Index into {@link TransferBatch.remotes}. */
  Remote: 3,
  /** Offset inside the remote's range {@link RangeField.RemoteRange}. */
  RemoteOffset: 4,
  /** Bytes; at least 1, at most the engine's chunk size for this connection. */
  Length: 5,
  /**
   * Which of the remote's ranges `RemoteOffset` is relative to: for a range grant
   * ({@link Transport.grant}) the index of the granted range; for a whole registration 0
   * (its one range is the registration, so `RemoteOffset` is an offset into it).
   */
  RemoteRange: 6,
} as const;
export const RANGE_STRIDE = 7;

/**
 * The ranges one stream of a transfer moves, in a compact form: no object per range.
 *
 * Range `i` is `ranges[i * RANGE_STRIDE + RangeField.X]`. Ranges are already validated by the
 * engine (registrations live, bounds inside both registrations, destinations not overlapping)
 * and are at most the chunk size; adjacent requests were merged. A batch is immutable, and the
 * engine hands the same object on every post of a {@link PreparedTransfer}, so a transport may
 * cache what it derives from a batch (encoded request frames, work-request templates) in a
 * `WeakMap` keyed by it. It must still re-check on every post whatever can change between posts
 * (grant revoked, registration revoked, connection state).
 */
export interface TransferBatch {
  readonly op: 'read' | 'write';
  /**
   * Distinct local registration handles ({@link TransportRegistration.handle}). The streams of
   * one transfer share these tables, so an entry may be one that no range of this batch uses.
   */
  readonly locals: readonly object[];
  /** Distinct decoded remotes (what {@link Transport.decodeRemote} returned); shared likewise. */
  readonly remotes: readonly unknown[];
  /** Number of ranges. */
  readonly count: number;
  /** `count * RANGE_STRIDE` numbers, see {@link RangeField}. */
  readonly ranges: Float64Array;
  /** Total bytes of all ranges. */
  readonly bytes: number;
}

export interface ExecuteOptions {
  /**
   * Fires on the caller's abort or on the deadline; its reason is the TensorwireError to raise.
   * The engine may pass the same signal to a later `execute` once this one has settled, if it
   * never fired and no listener is left on it: remove your listeners, and do not keep or act on
   * the signal after settling.
   */
  readonly signal: AbortSignal;
  /** Absolute deadline, `Date.now()` milliseconds. */
  readonly deadline: number;
  /**
   * One object per engine transfer (one post of a prepared transfer), the same for every
   * `execute` call (every stream, every retry) of that transfer, and never reused. A transport that must treat a transfer's chunks
   * as a whole (one snapshot of a seqlocked source, say) keys on it. Absent when the caller is
   * not the engine: then each `execute` call is its own transfer.
   */
  readonly transfer?: object;
}

export interface ConnectOptions extends ExecuteOptions {
  /** How many parallel streams (sockets, queue pairs) the engine wants. */
  readonly streams: number;
}

/**
 * A connection to one peer on one transport. It owns all per-peer, per-device state
 * (sockets, queue pairs, the peer's memory snapshot). The engine holds it in its table.
 */
export interface TransportConnection {
  readonly transport: string;
  /** The remote node, as it proved itself in the handshake. */
  readonly peer: NodeIdentity;
  /** nodeId of the side that opened it; the engine uses it to settle simultaneous opens. */
  readonly initiator: string;
  readonly streams: number;
  /** Largest chunk this connection accepts (agreed with the peer), when it is below the transport's. */
  readonly maxChunkBytes?: number;
  /** False once closing or closed. */
  readonly isOpen: boolean;
  /**
   * Run one batch of ranges on one stream. Resolves when every range completed; rejects with
   * a TensorwireError. Must not settle while the hardware or socket can still touch any
   * range's memory: on abort or deadline, quiesce first, then reject. Never reports partial
   * success: if any range failed, the call rejects.
   *
   * An error about one range names it: `details.request` is the range's
   * {@link RangeField.Request} value (the index into the caller's request list).
   *
   * Reject with ResourceExhaustedError only when none of the ranges was started: the engine
   * then backs off and calls again with the same batch, on the same connection. Reject
   * with an error whose `breaksConnection` is true when the connection can no longer be
   * used; the engine then removes it from its table in one step.
   */
  execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void>;
  /** Called exactly once when the connection stops being usable (error undefined on an orderly close). */
  onClose(listener: (error: TensorwireError | undefined) => void): void;
  /**
   * Called when the peer asks to retire this connection (it settled a simultaneous open the
   * other way). The engine stops choosing it; the transport lets in-flight work on both sides
   * finish and then closes it by itself.
   */
  onRetire(listener: () => void): void;
  /**
   * Graceful close: tell the peer, stop accepting new `execute` calls once in-flight ones are
   * done, keep serving the peer's in-flight requests, then close. Resolves when closed.
   */
  retire(): Promise<void>;
  /** Abortive close: fail in-flight work with `error` (default ClosedError), quiesce, release. Idempotent. */
  close(error?: TensorwireError): Promise<void>;
}

/** What the engine gives a transport when it starts it. */
export interface TransportHost {
  readonly identity: NodeIdentity;
  readonly logger: Logger;
  /**
   * The transport accepted a connection a peer opened. The engine adopts it, or retires it
   * when it already has one that wins the simultaneous-open rule.
   */
  inbound(connection: TransportConnection): void;
}

export interface Transport {
  readonly specificationVersion: TransportSpecificationVersion;
  /** Unique, lowercase: `tcp`, `rdma`, `cuda-ipc`… It tags descriptors and endpoints. */
  readonly name: string;
  readonly capabilities: TransportCapabilities;
  /** Start listening, open devices. Called once by the engine. */
  start(host: TransportHost): Promise<void>;
  /** The blob a peer needs to connect to this node over this transport (address, port, GID…). */
  endpoint(): Uint8Array;
  /**
   * Why this transport cannot reach `peer` at `endpoint` (e.g. "different host"), or undefined.
   * It should depend only on the peer, the endpoint and the transport's configuration: the
   * engine remembers the answer per endpoint until a connection breaks or the peer is invalidated.
   */
  unreachableReason(peer: NodeIdentity, endpoint: Uint8Array): string | undefined;
  /** Register local memory for remote access. Throws InvalidInputError for an unsupported kind. */
  register(memory: Memory): Promise<TransportRegistration>;
  /**
   * Revoke a registration: from now on remote access to it fails. Resolves once nothing
   * the transport started can still touch the memory.
   */
  revoke(handle: object): Promise<void>;
  /**
   * Grant access to ranges of registrations (register once, grant per lease): one
   * capability (one unguessable token) over all of them, whatever their number. The payload
   * should stay small (a token and what peers need to find the grant), not grow per range:
   * the engine carries the range lengths in the descriptor. A peer's transfer names a range
   * by index ({@link RangeField.RemoteRange}) and an offset inside it; the serving side checks
   * it against that range, never the whole registration. Transports without range grants
   * leave this out; the engine then reports them as unable to grant.
   */
  grant?(ranges: GrantRanges): TransportRegistration | Promise<TransportRegistration>;
  /**
   * Revoke a grant: O(1) in its number of ranges; from now on access through it fails.
   * Resolves once nothing the transport started under the grant can still touch the memory.
   */
  revokeGrant?(handle: object): Promise<void>;
  /**
   * Validate and decode a peer's descriptor payload. Throws InvalidInputError. For a range
   * grant, `rangeLengths` holds the length of each granted range (from the descriptor).
   */
  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths?: Float64Array): unknown;
  /** Open a connection to `peer`. The handshake must prove the peer's nodeId and incarnation. */
  connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection>;
  /** Idempotent. Closes every connection and listener. */
  close(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}

/** Numbers per range in {@link GrantRanges.ranges}. */
export const GRANT_STRIDE = 3;
/** Layout of one range in {@link GrantRanges.ranges}. */
export const GrantField = {
  /** Index into {@link GrantRanges.handles}. */
  Handle: 0,
  /** Offset inside that registration. */
  Offset: 1,
  /** Bytes, at least 1. */
  Length: 2,
} as const;

/**
 * The ranges of a range grant ({@link Transport.grant}), validated by the engine: every
 * range lies inside its registration, has at least one byte, and no two ranges overlap.
 * Range `k` is `ranges[k * GRANT_STRIDE + GrantField.X]`; peers name it by `k`. `ranges` is
 * the engine's private copy: a transport may keep it (by reference) while the grant lives,
 * and must not read it after its {@link Transport.revokeGrant} has resolved: the engine then
 * reuses that memory for a later grant's ranges.
 */
export interface GrantRanges {
  /** Registration handles this transport returned from {@link Transport.register}. */
  readonly handles: readonly object[];
  readonly count: number;
  /**
   * The ranges as GRANT_STRIDE numbers each. For a block grant ({@link GrantRanges.blocks}
   * set) this is built from the blocks on first read, O(count), and is not the engine's pooled
   * copy: a transport that handles `blocks` itself should not read it.
   */
  readonly ranges: Float64Array;
  /** Sum of the range lengths. */
  readonly bytes: number;
  /**
   * Set for a grant over blocks of one size in one registration (`handles` has one entry):
   * range `k` is `[base + indices[k] × blockBytes, + blockBytes)` of it. The engine checked
   * every index (inside the registration, none twice); `indices` is its private copy, under the
   * same rules as `ranges`. Four bytes per range instead of GRANT_STRIDE numbers, and nothing
   * to check per range: what lets a grant cost about the same for 10 blocks as for 10,000.
   */
  readonly blocks?: GrantBlocks;
}

/** The blocks of a block grant ({@link GrantRanges.blocks}). */
export interface GrantBlocks {
  /** Where block 0 starts in the registration. */
  readonly base: number;
  /** Bytes of every block, at least 1. */
  readonly blockBytes: number;
  /** Block index of each range (`count` of them; range `k` is block `indices[k]`). */
  readonly indices: Uint32Array;
}

/** One range as an object, for {@link createTransferBatch}. */
export interface TransferRangeInit {
  readonly local: object;
  readonly localOffset: number;
  readonly remote: unknown;
  readonly remoteOffset: number;
  readonly length: number;
  /** Defaults to the range's position in the list. */
  readonly request?: number;
  /** Defaults to 0 (see {@link RangeField.RemoteRange}). */
  readonly remoteRange?: number;
}

/**
 * Build a {@link TransferBatch} from range objects: for tests and for callers that drive a
 * connection directly. The engine builds batches without objects per range; so should hot paths.
 * Handles and remotes are deduplicated by identity. Values are not validated here.
 */
export function createTransferBatch(op: 'read' | 'write', list: readonly TransferRangeInit[]): TransferBatch {
  const locals: object[] = [];
  const remotes: unknown[] = [];
  const localIndex = new Map<object, number>();
  const remoteIndex = new Map<unknown, number>();
  const ranges = new Float64Array(list.length * RANGE_STRIDE);
  let bytes = 0;
  list.forEach((r, i) => {
    let l = localIndex.get(r.local);
    if (l === undefined) localIndex.set(r.local, (l = locals.push(r.local) - 1));
    let m = remoteIndex.get(r.remote);
    if (m === undefined) remoteIndex.set(r.remote, (m = remotes.push(r.remote) - 1));
    const at = i * RANGE_STRIDE;
    ranges[at + RangeField.Request] = r.request ?? i;
    ranges[at + RangeField.Local] = l;
    ranges[at + RangeField.LocalOffset] = r.localOffset;
    ranges[at + RangeField.Remote] = m;
    ranges[at + RangeField.RemoteOffset] = r.remoteOffset;
    ranges[at + RangeField.Length] = r.length;
    ranges[at + RangeField.RemoteRange] = r.remoteRange ?? 0;
    bytes += r.length;
  });
  return { op, locals, remotes, count: list.length, ranges, bytes };
}
