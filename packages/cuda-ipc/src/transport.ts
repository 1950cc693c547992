/**
 * The `cuda-ipc` transport: same-host, one-sided transfers through shared memory and CUDA
 * IPC, implementing @tensorwire/core's transport interface v1.
 *
 * Design (see README, "Transport"):
 * - Connectionless. `start()` creates a presence segment `/tw-n.<node>.<random>` whose
 *   header names the node and incarnation (`node:<nodeId>:<incarnation>`); the endpoint blob
 *   carries the host id and that segment's name. `connect()` opens it and checks the id,
 *   the state and the pid, which proves the peer's nodeId and incarnation to a process of
 *   the same user on the same host. Every `execute()` re-checks the presence segment, so
 *   a closed or dead peer gives ConnectionBrokenError.
 * - Grants. Registering host memory that lives in one of this package's shared segments
 *   (a pool slot, or {@link allocateSharedMemory}) or CUDA memory creates a grant segment
 *   `/tw-g.<node>.<random>` with a random 128-bit token, the target (segment name + range,
 *   or CUDA IPC handle + offset) and an in-flight counter. The descriptor payload carries
 *   the grant name and token. A peer's copy enters the grant (counter++, then state and
 *   token checked, seq_cst), copies, and leaves. `revoke()` marks the grant dead, zeroes the
 *   token, waits for the counter to reach 0, then unlinks it: after that every access fails
 *   with RemoteRejectedError, even through mappings the peer has cached. A grant over a pool
 *   slot is read-only to peers, and a peer reads it under the slot's seqlock (never torn).
 * - Other host memory (a plain Uint8Array) registers as local-only: it can be the local
 *   side of any transfer, and a peer that tries to use it remotely gets a clear
 *   InvalidInputError from decodeRemote.
 */
import { randomBytes } from 'node:crypto';
import { chmodSync, unlinkSync } from 'node:fs';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import {
  ByteReader,
  ByteWriter,
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  SessionInvalidatedError,
  TRANSPORT_SPECIFICATION_VERSION,
  type TensorwireError,

  errorFromSignal,
  formatId,
  silentLogger,
  type ConnectOptions,
  type ExecuteOptions,
  type Logger,
  type Memory,
  type MemoryKind,
  type NodeIdentity,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
  type TransferChunk,
  isToken,
} from '@tensorwire/core';
import { GrantResult, SegmentKind, SegmentState, capabilities as nativeCapabilities, native } from './native.js';
import { randomSegmentName, segmentNameProblem } from './names.js';
import { isProcessAlive, selfStartTime } from './proc.js';
import { HEADER_SIZE, MAX_SEGMENT_BYTES, hookExit, regionOf } from './shared.js';

const ENDPOINT_MAGIC = [0x54, 0x57, 0x43, 0x45]; // TWCE
const PAYLOAD_MAGIC = [0x54, 0x57, 0x43, 0x47]; // TWCG
const WIRE_VERSION = 1;
const TOKEN_BYTES = 16;

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
  /** How long revoke() waits for a peer's copy in flight before unlinking anyway (default 10 s). */
  readonly revokeTimeoutMs?: number;
  readonly logger?: Logger;
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
  constructor(
    readonly buffer: Uint8Array,
    readonly grant: Grant | undefined,
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

interface EndpointInfo {
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
  w.u8(WIRE_VERSION).u8(kind === 'host' ? 0 : 1).u8(grant ? 1 : 0);
  if (grant) w.str8(grant.name).bytes(grant.token);
  return w.u64(length).finish();
}

/** Decode and validate a cuda-ipc descriptor payload (throws InvalidInputError). */
export function decodePayload(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number): RemoteGrant {
  const r = new ByteReader(payload, 'cuda-ipc payload');
  for (const b of PAYLOAD_MAGIC) if (r.u8('magic') !== b) throw new InvalidInputError('not a cuda-ipc payload (bad magic)', { details: { field: 'magic' } });
  const v = r.u8('version');
  if (v !== WIRE_VERSION) throw new InvalidInputError(`cuda-ipc payload version ${v} is not supported`, { details: { field: 'version' } });
  const kb = r.u8('memory kind');
  if (kb > 1) throw new InvalidInputError(`cuda-ipc payload: memory kind ${kb} is unknown`, { details: { field: 'memoryKind' } });
  const kind: MemoryKind = kb === 0 ? 'host' : 'cuda';
  if (kind !== memoryKind) throw new InvalidInputError(`cuda-ipc payload is for ${kind} memory, descriptor says ${memoryKind}`, { details: { field: 'memoryKind' } });
  const shared = r.u8('mode');
  if (shared > 1) throw new InvalidInputError(`cuda-ipc payload: mode ${shared} is unknown`, { details: { field: 'mode' } });
  if (shared === 0) {
    r.u64('length');
    r.end();
    throw new InvalidInputError(
      'the peer registered this memory for local use only: it is not in shared memory (allocate it with allocateSharedMemory() or use a pool slot)',
      { details: { field: 'remote' } },
    );
  }
  const grantName = r.str8('grant name');
  const p = segmentNameProblem(grantName);
  if (p !== undefined || !grantName.startsWith('/tw-g.')) throw new InvalidInputError(`cuda-ipc payload: ${p ?? 'not a grant segment'}`, { details: { field: 'grant' } });
  const token = r.bytes(TOKEN_BYTES, 'token').slice();
  const length = r.safeU64('length');
  r.end();
  if (length !== byteLength) throw new InvalidInputError(`cuda-ipc payload grants ${length} bytes, descriptor says ${byteLength}`, { details: { field: 'byteLength' } });
  return { kind, grantName, token, length };
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
}

const MAX_LINE = 4096;

/** Newline-delimited JSON messages over a Unix socket (handshake and control only; no data). */
function onLines(socket: Socket, handler: (msg: Record<string, unknown>) => void): void {
  let buf = '';
  socket.setEncoding('utf8');
  socket.on('data', (chunk: string) => {
    buf += chunk;
    if (buf.length > MAX_LINE * 4) {
      socket.destroy(new InvalidInputError('cuda-ipc control line too long'));
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
        socket.destroy(new InvalidInputError('cuda-ipc control message is not JSON'));
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
  /** One import per grant; the promise is cached so concurrent chunks share it. */
  readonly #imports = new Map<string, Promise<{ device: number; base: bigint }>>();
  readonly #closeListeners: ((error: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  readonly #socket: Socket;
  #retiring = false;
  #inflight = 0;
  #idle: (() => void)[] = [];
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
    onLines(socket, (msg) => {
      if (msg['t'] === 'retire') this.#peerRetired();
    });
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
    return this.#inflight === 0 ? Promise.resolve() : new Promise<void>((r) => this.#idle.push(r));
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

  #peerAlive(): boolean {
    return native.loadState(this.#presence) === SegmentState.Live && isProcessAlive(this.#peerPid, this.#peerStart);
  }

  async execute(stream: number, chunks: readonly TransferChunk[], options: ExecuteOptions): Promise<void> {
    if (this.#closed || this.#retiring) throw new SessionInvalidatedError(`connection to ${this.peer.nodeId} is closed or retiring`, { cause: this.#closeError });
    if (!Number.isInteger(stream) || stream < 0 || stream >= this.streams) throw new InvalidInputError(`stream ${stream} does not exist`);
    if (!this.#peerAlive()) {
      const err = new ConnectionBrokenError(`peer ${this.peer.nodeId} closed its cuda-ipc transport or exited`);
      void this.close(err);
      throw err;
    }
    this.#inflight++;
    // The engine names the transfer (shared by its streams and retries); a direct caller's
    // execute() call is a transfer of its own.
    const transfer = options.transfer ?? {};
    try {
      for (const chunk of chunks) {
        if (options.signal.aborted) throw errorFromSignal(options.signal, 'cuda-ipc transfer');
        try {
          await this.#run(chunk, transfer);
        } catch (e) {
          // A grant that vanished because its owner is closing or died is a broken connection.
          // A peer that is shutting down closes its connections before it revokes its
          // grants; give that close a moment to arrive before calling this a rejection.
          if (e instanceof RemoteRejectedError && e.remoteCode !== 'slot-rewritten' && !this.#closed && this.#peerAlive()) await new Promise((r) => setTimeout(r, 5));
          if (e instanceof RemoteRejectedError && (this.#closed !== undefined || !this.#peerAlive())) {
            const err = new ConnectionBrokenError(`peer ${this.peer.nodeId} closed its cuda-ipc transport or exited`, { cause: e });
            void this.close(err);
            throw err;
          }
          throw e;
        }
      }
    } finally {
      this.#inflight--;
      if (this.#inflight === 0) for (const f of this.#idle.splice(0)) f();
    }
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
    const t: GrantTarget = { mapping, target: targetCode === 0 ? 'host' : 'cuda', offset, length, dataName, device: meta.device, ipcHandle: meta.ipcHandle, flags };
    this.#grants.set(remote.grantName, t);
    return t;
  }

  #dataMapping(g: GrantTarget): ArrayBuffer {
    const name = g.dataName as string;
    let m = this.#data.get(name);
    if (!m) {
      try {
        m = native.shmOpen(name, MAX_SEGMENT_BYTES);
      } catch (e) {
        throw new RemoteRejectedError(`granted segment ${name} is gone`, { cause: e, details: { remoteCode: 'gone' } });
      }
      this.#data.set(name, m);
    }
    // Sizes from fstat (the mapping length), never from the grant alone.
    if (g.offset + g.length > m.byteLength) {
      throw new RemoteRejectedError(`grant range ${g.offset}+${g.length} exceeds segment ${name} (${m.byteLength} bytes)`, { details: { remoteCode: 'bounds' } });
    }
    return m;
  }

  async #importBase(name: string, g: GrantTarget): Promise<bigint> {
    let p = this.#imports.get(name);
    if (!p) {
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

  /**
   * Per transfer and per grant: the pool-slot generation each byte range was last copied at.
   * Every chunk copies under the seqlock on its own, so the transfer's bytes of one slot are
   * one snapshot only if all its ranges were copied at one generation. A range copied again
   * (the engine retrying chunks) replaces its earlier copy.
   */
  readonly #generations = new WeakMap<object, Map<string, Map<string, bigint>>>();

  async #run(chunk: TransferChunk, transfer: object): Promise<void> {
    const remote = chunk.remote as RemoteGrant;
    const local = chunk.local;
    if (!(local instanceof HostHandle || local instanceof CudaHandle)) throw new InvalidInputError('local handle is not a cuda-ipc registration');
    const { localOffset, remoteOffset, length } = chunk;
    const localLength = local instanceof HostHandle ? local.buffer.byteLength : local.byteLength;
    if (localOffset < 0 || length <= 0 || localOffset + length > localLength) throw new InvalidInputError(`local range ${localOffset}+${length} is out of bounds`);
    const g = this.#grant(remote);
    if (remoteOffset < 0 || remoteOffset + length > remote.length || remoteOffset + length > g.length) {
      throw new RemoteRejectedError(`remote range ${remoteOffset}+${length} exceeds the grant of ${g.length} bytes`, { details: { remoteCode: 'bounds' } });
    }
    if (chunk.op === 'write' && (g.flags & FLAG_SEQLOCKED) !== 0) {
      // A plain copy into a pool slot would bypass its seqlock: readers would see changed
      // bytes while isConsistent() stayed true. Only the slot's owner writes it.
      throw new RemoteRejectedError(`grant ${remote.grantName} is a pool slot: peers may read it, only its owner writes it (pool.write)`, {
        details: { remoteCode: 'read-only' },
      });
    }
    const base = g.target === 'host' ? this.#dataMapping(g) : undefined;
    const importBase = g.target === 'cuda' ? await this.#importBase(remote.grantName, g) : undefined;
    const entered = native.grantEnter(g.mapping, remote.token);
    if (entered !== GrantResult.Ok) {
      const why = entered === GrantResult.Revoked ? 'was revoked' : entered === GrantResult.BadToken ? 'rejected the token' : 'is not a grant';
      throw new RemoteRejectedError(`grant ${remote.grantName} ${why}`, { details: { remoteCode: entered === GrantResult.Revoked ? 'revoked' : 'bad-token' } });
    }
    try {
      if (base && chunk.op === 'read' && (g.flags & FLAG_SEQLOCKED) !== 0) {
        // A pool slot: its owner writes it under the slot's seqlock, so a plain copy could
        // catch a write half done. Copy under the seqlock (invariant 11); into a staging
        // buffer first when the local side is device memory.
        const at = g.offset + remoteOffset;
        const staging = local instanceof HostHandle ? undefined : new Uint8Array(length);
        const generation = native.seqCopyRange(base, at, length, staging ?? (local as HostHandle).buffer.subarray(localOffset, localOffset + length));
        this.#sameGeneration(transfer, remote.grantName, `${remoteOffset}+${length}`, generation);
        if (staging) await native.cudaCopy('h2d', (local as CudaHandle).device, (local as CudaHandle).pointer + BigInt(localOffset), staging, length);
      } else if (base) {
        // Shared memory without a seqlock (allocateSharedMemory): plain copies.
        const remoteView = new Uint8Array(base, g.offset + remoteOffset, length);
        if (local instanceof HostHandle) {
          const localView = local.buffer.subarray(localOffset, localOffset + length);
          if (chunk.op === 'read') localView.set(remoteView);
          else remoteView.set(localView);
        } else {
          const ptr = local.pointer + BigInt(localOffset);
          if (chunk.op === 'read') await native.cudaCopy('h2d', local.device, ptr, remoteView, length);
          else await native.cudaCopy('d2h', local.device, remoteView, ptr, length);
        }
      } else {
        const rptr = (importBase as bigint) + BigInt(g.offset + remoteOffset);
        if (local instanceof HostHandle) {
          const localView = local.buffer.subarray(localOffset, localOffset + length);
          if (chunk.op === 'read') await native.cudaCopy('d2h', g.device, localView, rptr, length);
          else await native.cudaCopy('h2d', g.device, rptr, localView, length);
        } else {
          const lptr = local.pointer + BigInt(localOffset);
          if (chunk.op === 'read') await native.cudaCopy('d2d', local.device, lptr, rptr, length);
          else await native.cudaCopy('d2d', local.device, rptr, lptr, length);
        }
      }
    } finally {
      native.grantLeave(g.mapping);
    }
  }

  /** Throws when this transfer holds ranges of the slot copied at different generations. */
  #sameGeneration(transfer: object, grant: string, range: string, generation: bigint): void {
    let byGrant = this.#generations.get(transfer);
    if (!byGrant) this.#generations.set(transfer, (byGrant = new Map()));
    let ranges = byGrant.get(grant);
    if (!ranges) byGrant.set(grant, (ranges = new Map()));
    ranges.set(range, generation);
    for (const other of ranges.values()) {
      if (other !== generation) {
        throw new RemoteRejectedError(
          `the pool slot was rewritten while this transfer read it in parts (generations ${other} and ${generation}): the bytes would mix two versions; read again`,
          { details: { remoteCode: 'slot-rewritten' } },
        );
      }
    }
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
  readonly #grants = new Set<Grant>();
  readonly #connections = new Set<CudaIpcConnection>();
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
    this.capabilities = Object.freeze({
      local: true,
      remote: false,
      memoryKinds: caps.cuda.available ? (['host', 'cuda'] as const) : (['host'] as const),
      oneSidedRead: true,
      oneSidedWrite: true,
      cpuBypass: true,
      scopedGrants: true,
      rank: 50,
      maxStreams: 4,
      maxChunkBytes: maxChunk,
    });
  }

  #assertOpen(): void {
    if (this.#closed) throw new ClosedError('cuda-ipc transport is closed');
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
    const socketPath = join(tmpdir(), `tw-${randomBytes(12).toString('hex')}.sock`);
    const server = createServer((socket) => this.#accept(socket));
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(socketPath, () => {
        server.off('error', reject);
        resolve();
      });
    });
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
    this.#pending.add(socket);
    socket.on('error', () => undefined);
    const timer = setTimeout(() => socket.destroy(), 10_000);
    let done = false;
    const finish = (): void => {
      done = true;
      clearTimeout(timer);
      this.#pending.delete(socket);
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
        finish();
        const conn = new CudaIpcConnection({ nodeId, incarnation, hostId }, nodeId, this.capabilities.maxStreams, this, p.mapping, p.pid, p.start, socket);
        this.#connections.add(conn);
        // Hand it to the engine first: a closing engine closes it, and then no welcome is sent.
        this.#host?.inbound(conn);
        if (conn.isOpen) sendLine(socket, { t: 'welcome', nodeId: me.nodeId, incarnation: me.incarnation });
      } catch (e) {
        finish();
        sendLine(socket, { t: 'reject', reason: e instanceof Error ? e.message : String(e) });
        socket.end();
      }
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
        return { handle: new HostHandle(memory.buffer, undefined), payload: encodePayload('host', undefined, memory.buffer.byteLength) };
      }
      const token = new Uint8Array(randomBytes(TOKEN_BYTES));
      const flags = r.region.seqlocked ? FLAG_SEQLOCKED : 0;
      const grant = this.#createGrant(id, 'host', r.region.dataOffset + r.offset, memory.buffer.byteLength, r.region.name, token, -1, undefined, 0, flags);
      return { handle: new HostHandle(memory.buffer, grant), payload: encodePayload('host', { name: grant.name, token }, memory.buffer.byteLength) };
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
      const grant = this.#createGrant(id, 'cuda', exp.offset, memory.byteLength, undefined, token, memory.device, exp.handle, exp.offset, 0);
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
    const grant = handle.grant;
    if (!grant) return Promise.resolve();
    return this.#revokeGrant(grant);
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

  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number): unknown {
    return decodePayload(payload, memoryKind, byteLength);
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
      try {
        if (this.#socketPath) unlinkSync(this.#socketPath);
      } catch {
        // already gone
      }
      // Same drain as revoke(): a peer's copy in flight finishes before the grant goes
      // (the registered memory may be reused the moment close() resolves, invariant 6).
      await Promise.allSettled([...this.#grants].map((g) => this.#revokeGrant(g)));
    })();
    return this.#closed;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
