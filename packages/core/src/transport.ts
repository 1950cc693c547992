/**
 * The transport plugin interface, specification version 1.
 *
 * A transport moves bytes between registered memory on two nodes. It implements only
 * what is device-specific; the {@link TransferEngine} above it owns the connection table,
 * transport selection, chunking, parallel streams, deadlines, retries on backpressure,
 * error policy and metrics. See the package README, "Writing a transport".
 */
import type { TensorwireError } from './errors.js';
import type { Logger } from './logger.js';

/** The version tag of this interface. A transport declares it; the engine refuses others. */
export const TRANSPORT_SPECIFICATION_VERSION = 'v1' as const;
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
  /** Opaque per-registration handle, handed back to the transport in every {@link TransferChunk}. */
  readonly handle: object;
  /**
   * The transport-specific part of the exportable descriptor (a token, an rkey and address,
   * a shared-memory name…). The engine wraps it in an envelope that names the transport, the
   * owner node and incarnation, the memory kind and the byte length.
   */
  readonly payload: Uint8Array;
}

/** One piece of a transfer, at most the engine's chunk size, already bounds-checked by the engine. */
export interface TransferChunk {
  readonly op: 'read' | 'write';
  /** The local registration's handle. */
  readonly local: object;
  readonly localOffset: number;
  /** What {@link Transport.decodeRemote} returned for the remote descriptor. */
  readonly remote: unknown;
  readonly remoteOffset: number;
  readonly length: number;
}

export interface ExecuteOptions {
  /** Fires on the caller's abort or on the deadline; its reason is the TensorwireError to raise. */
  readonly signal: AbortSignal;
  /** Absolute deadline, `Date.now()` milliseconds. */
  readonly deadline: number;
  /**
   * One object per engine transfer, the same for every `execute` call (every stream, every
   * retry) of that transfer, and never reused. A transport that must treat a transfer's chunks
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
   * Run chunks on one stream. Resolves when every chunk completed; rejects with a
   * TensorwireError. Must not settle while the hardware or socket can still touch any
   * chunk's memory: on abort or deadline, quiesce first, then reject.
   *
   * Reject with ResourceExhaustedError only when none of the chunks was started: the engine
   * then backs off and calls again with the same chunks, on the same connection. Reject
   * with an error whose `breaksConnection` is true when the connection can no longer be
   * used; the engine then removes it from its table in one step.
   */
  execute(stream: number, chunks: readonly TransferChunk[], options: ExecuteOptions): Promise<void>;
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
  /** Validate and decode a peer's descriptor payload. Throws InvalidInputError. */
  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number): unknown;
  /** Open a connection to `peer`. The handshake must prove the peer's nodeId and incarnation. */
  connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection>;
  /** Idempotent. Closes every connection and listener. */
  close(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}
