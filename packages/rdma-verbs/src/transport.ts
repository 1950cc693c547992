/**
 * The `rdma` transport: core's Transport v2 over libibverbs RC queue pairs, one-sided READ
 * and WRITE.
 *
 * - A connection owns everything per peer: its control socket, one CQ, N queue pairs
 *   (streams), the chains of work requests in flight and the batches waiting for send slots.
 *   The transport finds connections by peer identity; a CQ id only routes completions to
 *   the connection that owns the CQ.
 * - A batch becomes a plan once (cached per batch): ranges back to back on the remote side
 *   of one grant become ONE work request with an SGE list (up to the device's max_sge, and at
 *   most maxChunkBytes per request), the others one request each. Requests are posted in
 *   chains (one ibv_post_send each) with only the last one signaled, so a chain completes
 *   once; a chain holds its send-queue slots until that completion, and a queue pair never
 *   has more than its send-queue depth posted; the rest waits.
 * - Range grants (`grant()`): one token over ranges of registrations; a requester gets the
 *   ranges' addresses and keys with one GRANT_BIND per grant and connection, checks every range
 *   against the lengths the holder granted before posting, and in memory-window mode the NIC
 *   refuses anything outside the windows bound over exactly the granted runs. Revoking waits for
 *   the requesters' own work under the grant to leave the NIC (GRANT_UNBIND / GRANT_UNBOUND).
 * - A post refused for lack of room (ENOMEM/EAGAIN, or a chain accepted only in part) is local
 *   exhaustion: it never closes the connection; the batch waits for room, or, when nothing of it
 *   is posted and the queue pair is idle, is handed back as backpressure.
 * - On a failed completion, an abort or a deadline with work on the NIC, the connection is
 *   quiesced (every QP to ERR, then every outstanding work request is waited for until it has
 *   flushed) before anything is rejected, so memory is never reused while the NIC can still
 *   DMA into it. If flushes do not arrive in time the QPs are destroyed, which also stops DMA.
 */
import { randomBytes, randomInt } from 'node:crypto';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { networkInterfaces } from 'node:os';
import {
  BackendUnavailableError,
  GRANT_STRIDE,
  GrantField,
  RANGE_STRIDE,
  RangeField,
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  ResourceExhaustedError,
  SessionInvalidatedError,
  TimedOutError,
  TRANSPORT_SPECIFICATION_VERSION,
  errorFromSignal,
  kit,
  silentLogger,
  toTensorwireError,
  type CudaMemory,
  type ConnectOptions,
  type ExecuteOptions,
  type GrantRanges,
  type Logger,
  type Memory,
  type MemoryKind,
  type MetricsOptions,
  type NodeIdentity,
  type TensorwireError,
  type TransferBatch,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
} from '@tensorwire/core';
import {
  addressVector,
  chooseMtu,
  chooseSgeLimits,
  chooseRdAtomic,
  grantMode,
  isIpv4MappedGid,
  lidProblem,
  linkLayerName,
  qpCountProblem,
  type DeviceRecord,
} from './attributes.js';
import { capabilities as probeCapabilities, type RdmaCapabilities } from './capabilities.js';
import {
  Access,
  SGE_STRIDE,
  SgeField,
  WR_STRIDE,
  WcStatus,
  WrField,
  loadNative,
  nativeError,
  tryLoadNative,
  type NativeAddon,
  type NativeDevice,
} from './native.js';
import { MAX_BINDS_IN_FLIGHT, tokenHex, WindowKeyCache, WindowLedger, type Binding, type WindowKeys } from './windows.js';
import { GrantTableCache, grantRevoked, layoutGrant, type GrantLayout, type GrantTable } from './grants.js';
import {
  FrameReader,
  MAX_QPS_PER_PEER,
  decodeEndpoint,
  decodeGrant,
  encodeEndpoint,
  encodeFrame,
  encodeGrant,
  encodeGrantTable,
  GRANT_TOKEN_BYTES,
  MAX_RANGE_GRANT_RANGES,
  type ControlMessage,
  type GrantTableData,
  type MrGrant,
  type QpSetup,
  type RangeGrant,
  type RdmaEndpoint,
  type WindowGrant,
} from './wire.js';

type GrantBindMessage = Extract<ControlMessage, { type: 'grant-bind' }>;

export interface CudaDmabufExport {
  /** A dma-buf file descriptor covering the allocation (cuMemGetHandleForAddressRange). */
  readonly fd: number;
  /** Offset of `pointer` inside the dma-buf. */
  readonly offset: number;
  /** Called after the MR is deregistered (close the fd). */
  release?(): void;
}

/**
 * The verbs layer under the transport: the addon and what discovery found. The default is
 * the native addon and `capabilities()`. Tests replace it with simulated verbs to exercise the
 * transport's own logic; that proves nothing about libibverbs or a NIC.
 */
export interface RdmaBackend {
  readonly native: NativeAddon;
  readonly capabilities: RdmaCapabilities;
}

export interface RdmaTransportOptions {
  /** RDMA device; default TENSORWIRE_RDMA_DEVICE, else the first device with an active port. */
  device?: string;
  /** Port number on the device; default the first ACTIVE one. */
  port?: number;
  /** GID index; default chosen by `selectGid` (RoCE v2, non-link-local first). */
  gidIndex?: number;
  /** Queue pairs per peer per NIC (= streams). Both sides must agree. Default 2. */
  queuePairsPerPeer?: number;
  /** Send-queue depth per QP (work requests in flight). Default 128, capped by the device. */
  maxSendWr?: number;
  /**
   * Most scatter-gather elements per work request (ranges back to back on the remote side
   * become one request with one SGE per local piece). Default and cap: the device's max_sge
   * (max_sge_rd for READs, when the provider reports it), at most 64.
   */
  maxSge?: number;
  /** Address the out-of-band TCP listener binds. Default 0.0.0.0. */
  listenHost?: string;
  listenPort?: number;
  /** Address peers dial; default the GID's IPv4 (RoCE), else the first non-internal IPv4, else 127.0.0.1. */
  advertiseHost?: string;
  /** Largest chunk; default 64 MiB (capped at 1 GiB, ConnectX's max_msg_sz). */
  maxChunkBytes?: number;
  /** Preference among transports (TCP is 10). Default 100. */
  rank?: number;
  trafficClass?: number;
  serviceLevel?: number;
  /** How long to wait for flushed completions before destroying the QPs. Default 10 s. */
  quiesceTimeoutMs?: number;
  /** After retire() has drained this side, how long to wait for the peer to drain. Default 30 s. */
  retireTimeoutMs?: number;
  /** Accept-side handshake deadline. Default 10 s. */
  handshakeTimeoutMs?: number;
  /**
   * How remote access is granted (README "Grants"):
   * - `memory-window`: each registration is an MR without remote access; a requester gets
   *   type-2 windows bound to its own connection's queue pairs, deallocated on revoke.
   * - `memory-region`: each registration is its own MR whose rkey opens it on any queue pair;
   *   revoke deregisters it.
   * - `auto` (default): `memory-window` where the device supports type-2 windows.
   */
  grants?: 'auto' | 'memory-window' | 'memory-region';
  /**
   * Most grants one peer may have bound at once, over all its connections: registrations'
   * window grants (memory-window mode), and range grants (their tables, in both modes).
   * Default 1024.
   */
  maxWindowGrantsPerPeer?: number;
  /**
   * Most memory windows the range grants one peer uses may hold at once, over all its
   * connections (memory-window mode): a range grant takes one per run of its ranges and queue
   * pair. Beyond it a GRANT_BIND is refused with `window-limit` (backpressure). Default 65,536.
   */
  maxGrantWindowsPerPeer?: number;
  /**
   * How long revoking a range grant waits for each requester that uses it to confirm that
   * nothing of its own still uses it (GRANT_UNBOUND) before closing that connection. Default 10 s.
   */
  grantRevokeTimeoutMs?: number;
  /** Bounds of the control channel per peer (see {@link RdmaControlLimits}; each defaults separately). */
  limits?: Partial<RdmaControlLimits>;
  /** Replace the addon and device discovery (tests only; see {@link RdmaBackend}). */
  backend?: RdmaBackend;
  /** Export CUDA memory as a dma-buf; enables `cuda` memory when libibverbs has ibv_reg_dmabuf_mr. */
  cudaDmabuf?: (memory: CudaMemory) => CudaDmabufExport;
  logger?: Logger;
  /**
   * Where to count peer events, or false: `tensorwire_transport_peer_events_total{transport="rdma",event}`
   * (the counter the TCP, Unix-socket and cuda-ipc transports use), `event` being the
   * {@link BoundReason} of a dropped connection or the code of a refused handshake. Default: a
   * private Registry (`transport.metrics.registry`).
   */
  metrics?: MetricsOptions | false;
}

const ACCESS = Access.LocalWrite | Access.RemoteRead | Access.RemoteWrite;
/**
 * Largest work request. The IB spec allows 2 GiB, but ConnectX (mlx5) ports report
 * max_msg_sz = 1 GiB and fail a longer READ/WRITE with a local length error, which takes the
 * queue pair to ERR. 1 GiB is safe on every HCA we know of.
 */
const MAX_WR_BYTES = 0x40000000;
/** SGEs per work request asked for at most, whatever the device reports. */
const MAX_SGE = 64;
/** Work requests per chain (one ibv_post_send, one completion) at most. */
const MAX_CHAIN_WRS = 64;
const ENOMEM = 12;
const EAGAIN = 11;
/** Send-queue slots per QP kept for BIND_MW work requests (so binds never wait behind data). */
const BIND_SLOTS = 4;
/**
 * The bounds of the control channel (RdmaTransportOptions.limits), with their defaults. Every
 * per-peer queue and table a peer can grow is bounded (DESIGN invariant 16); past a bound the
 * peer gets backpressure (a typed refusal) or loses the connection with a logged reason counted
 * in `RdmaTransport.peerDisconnects`.
 */
export interface RdmaControlLimits {
  /** Control bytes queued to a peer that does not read them; past it the connection is dropped (`control-backlog`). Default 1 MiB. */
  readonly maxControlBacklogBytes: number;
  /** Grant-table answers queued to a peer that does not read them; past it the connection is dropped (`grant-tables-queued`). Default 128. */
  readonly maxQueuedGrantTables: number;
  /**
   * BINDs (and, separately, GRANT_BINDs) one connection may have being served at once; past it
   * the connection is dropped (`pending-binds`, `pending-grant-binds`). At least 64: a requester
   * of this package keeps up to 64 in flight. Default 64.
   */
  readonly maxPendingBinds: number;
  /** Control frames parsed and not yet taken (before a handshake step reads them); past it the connection is dropped (`unread-frames`). Default 64. */
  readonly maxUnreadFrames: number;
  /** Inbound handshakes past HELLO at once, all peers (each holds a CQ and its QPs until READY or its deadline); past it a HELLO is refused `busy` (backpressure). Default 64. */
  readonly maxInboundHandshakes: number;
  /**
   * Connections one peer incarnation may have open or opening to this node; past it a HELLO is
   * refused `too-many-connections`. The engine keeps one per peer incarnation (two for a moment while a
   * simultaneous open settles). Default 8.
   */
  readonly maxConnectionsPerPeer: number;
}

/** The default bounds of the control channel (each documented on {@link RdmaControlLimits}). */
export const DEFAULT_CONTROL_LIMITS: RdmaControlLimits = Object.freeze({
  maxControlBacklogBytes: 1 << 20,
  maxQueuedGrantTables: 2 * MAX_BINDS_IN_FLIGHT,
  maxPendingBinds: MAX_BINDS_IN_FLIGHT,
  maxUnreadFrames: 64,
  maxInboundHandshakes: 64,
  maxConnectionsPerPeer: 8,
});

/** Why a peer lost its connection over a bound (the keys of `RdmaTransport.peerDisconnects`). */
export type BoundReason = 'control-backlog' | 'grant-tables-queued' | 'pending-binds' | 'pending-grant-binds' | 'unread-frames' | 'malformed-frame';

function controlLimits(o: Partial<RdmaControlLimits> | undefined): RdmaControlLimits {
  const l = { ...DEFAULT_CONTROL_LIMITS, ...o };
  for (const [k, v] of Object.entries(l)) {
    if (!Number.isSafeInteger(v) || v < 1) throw new InvalidInputError(`limits.${k} must be a positive integer`, { details: { field: `limits.${k}` } });
  }
  if (l.maxPendingBinds < MAX_BINDS_IN_FLIGHT) {
    throw new InvalidInputError(`limits.maxPendingBinds must be at least ${MAX_BINDS_IN_FLIGHT} (what a requester keeps in flight)`, { details: { field: 'limits.maxPendingBinds' } });
  }
  return l;
}

/** A registration's handle: opaque to the engine. */
class RdmaRegistration {
  readonly owner: RdmaTransport;
  readonly mrId: number;
  readonly length: number;
  readonly addr: bigint;
  readonly rkey: number;
  readonly release: (() => void) | undefined;
  /** memory-window mode: the grant token peers present to get windows (hex for tables). */
  token: Uint8Array | undefined;
  tokenHex: string | undefined;
  revoked = false;
  /** Memory windows allocated over this MR and not yet deallocated (any connection, any grant). */
  windows = 0;
  windowsGone: (() => void)[] = [];
  /** Work requests on the NIC that use this memory. */
  posted = 0;
  idle: (() => void)[] = [];
  /** Live range grants over this registration (revoked before it is). */
  readonly grants = new Set<RdmaGrant>();
  constructor(owner: RdmaTransport, mrId: number, length: number, addr: bigint, rkey: number, release?: () => void) {
    this.owner = owner;
    this.mrId = mrId;
    this.length = length;
    this.addr = addr;
    this.rkey = rkey;
    this.release = release;
  }
}

/**
 * A range grant's handle (holder side): one token over ranges of registrations, laid out once
 * as keys (see grants.ts). What it costs per connection that uses it is one table answer, plus
 * one window per key and queue pair in memory-window mode.
 */
class RdmaGrant {
  readonly owner: RdmaTransport;
  readonly token: Uint8Array;
  readonly tokenHex: string;
  readonly count: number;
  readonly bytes: number;
  /** Windows over the ranges (memory-window mode), else whole-MR rkeys. */
  readonly windows: boolean;
  /** The registrations the ranges lie in, by region index. */
  readonly regions: readonly RdmaRegistration[];
  readonly layout: GrantLayout;
  readonly regionHi: Uint32Array;
  readonly regionLo: Uint32Array;
  /** memory-region mode: each key's rkey (its region's MR). */
  readonly mrRkeys: Uint32Array;
  revoked = false;
  revoking: Promise<void> | undefined;
  constructor(owner: RdmaTransport, token: Uint8Array, count: number, bytes: number, windows: boolean, regions: readonly RdmaRegistration[], layout: GrantLayout) {
    this.owner = owner;
    this.token = token;
    this.tokenHex = tokenHex(token);
    this.count = count;
    this.bytes = bytes;
    this.windows = windows;
    this.regions = regions;
    this.layout = layout;
    this.regionHi = new Uint32Array(regions.length);
    this.regionLo = new Uint32Array(regions.length);
    regions.forEach((r, i) => {
      this.regionHi[i] = Number(r.addr >> 32n);
      this.regionLo[i] = Number(r.addr & 0xffffffffn);
    });
    this.mrRkeys = new Uint32Array(layout.keyRegion.length);
    for (let k = 0; k < layout.keyRegion.length; k++) this.mrRkeys[k] = (regions[layout.keyRegion[k] as number] as RdmaRegistration).rkey;
  }
  get keyCount(): number {
    return this.layout.keyRegion.length;
  }
  /** The table a requester gets: `rkeys` holds `rkeysPerKey` per key. */
  table(rkeys: Uint32Array, rkeysPerKey: number): GrantTableData {
    const l = this.layout;
    return { regionHi: this.regionHi, regionLo: this.regionLo, keyRegion: l.keyRegion, rkeysPerKey, rkeys, rangeKey: l.rangeKey, rangeOffset: l.rangeOffset, rangeLength: l.rangeLength };
  }
}

/** A whole registration's descriptor, decoded; only this class and {@link RemoteRanges} are accepted by execute(). */
class RemoteRegion {
  readonly grant: MrGrant | WindowGrant;
  /** A memory-window grant's token in hex (the key of every window table), once per decode. */
  readonly windowToken: string | undefined;
  /** Its one range: the registration. */
  readonly lengths: Float64Array;
  constructor(grant: MrGrant | WindowGrant) {
    this.grant = grant;
    this.windowToken = grant.grant === 'window' ? tokenHex(grant.token) : undefined;
    this.lengths = Float64Array.of(grant.length);
  }
}

/** A range grant's descriptor, decoded: the token and each range's length (from the descriptor). */
class RemoteRanges {
  readonly grant: RangeGrant;
  readonly tokenHex: string;
  readonly lengths: Float64Array;
  constructor(grant: RangeGrant, lengths: Float64Array) {
    this.grant = grant;
    this.tokenHex = tokenHex(grant.token);
    this.lengths = lengths;
  }
}

type Remote = RemoteRegion | RemoteRanges;
/** What a remote's rkeys come from: its descriptor (0), a window grant's keys (1), a range grant's table (2). */
const KIND_MR = 0;
const KIND_WINDOW = 1;
const KIND_RANGES = 2;

/**
 * A batch checked once (cached per batch; batches are immutable): its locals are this
 * transport's registrations, its remotes rdma descriptors, and every range lies inside its local
 * registration and inside its remote range (the registration, or the granted range it names,
 * whose length the descriptor gave). Nothing here depends on a connection.
 */
interface Checked {
  readonly batch: TransferBatch;
  readonly op: 'read' | 'write';
  readonly regs: readonly RdmaRegistration[];
  readonly remotes: readonly Remote[];
  /** Per remote: KIND_MR, KIND_WINDOW or KIND_RANGES. */
  readonly kinds: Uint8Array;
  readonly localMr: Float64Array;
  /** The last layout made of it (reused while its range tables are the ones in use). */
  plan: Plan | undefined;
}

/**
 * What a batch becomes on this transport: its work requests and SGEs in the layouts of
 * NativeDevice.post, derived once per batch and shared by every post of it. A work request's
 * WrField.Rkey is a key slot: one per remote and key (a whole registration has one key; a range
 * grant one per region or window run of its table), whose rkey for the posting queue pair is
 * filled in per post. A layout depends on the range tables it was made with (`tables`).
 */
interface Plan {
  readonly checked: Checked;
  /** Per remote: the range grant table the addresses came from (undefined for whole registrations). */
  readonly tables: readonly (GrantTable | undefined)[];
  /** WR_STRIDE numbers per work request; WrField.Rkey is a key slot. */
  readonly wrs: Float64Array;
  readonly sges: Float64Array;
  readonly wrCount: number;
  /** Per key slot: its remote and its key in that remote. */
  readonly slotRemote: Uint32Array;
  readonly slotKey: Uint32Array;
}

/** What opens a remote on a connection: its descriptor's rkey, a window grant's keys or a range grant's table. */
type Keys = WindowKeys | GrantTable | undefined;

/** One execute() call: one batch on one stream. */
interface Job {
  readonly checked: Checked;
  /** Laid out once every key is here. */
  plan: Plan | undefined;
  readonly stream: Stream;
  /** The transfer it belongs to (ExecuteOptions.transfer, else its signal): its streams fail together. */
  readonly group: object;
  readonly signal: AbortSignal;
  /** Per remote: what opens it on this connection. */
  readonly keysOf: Keys[];
  /** rkeys[key slot] for this stream's queue pair; filled before the job is queued. */
  rkeys: Uint32Array;
  /** memory-window grants: the keys it uses; UNBIND marks them revoked. */
  readonly windows: WindowKeys[];
  /** range grants: the tables it holds (counted in their `users` until it settles). */
  readonly tables: GrantTable[];
  /** Next work request of the plan to post. */
  next: number;
  /** Its chains on the NIC. */
  chains: number;
  /** Counted in its registrations' `posted` (from its first post until it settles). */
  holding: boolean;
  /** In its stream's queue. */
  queued: boolean;
  error: TensorwireError | undefined;
  settled: boolean;
  resolve(): void;
  reject(e: TensorwireError): void;
  cleanup(): void;
}

/**
 * Work requests posted in one ibv_post_send; wr_ids base..base+count-1, the last one signaled.
 * A fragment is the part of a chain the send queue accepted before refusing the rest: its last
 * work request is not signaled, so it completes only in error (a flush); otherwise the next
 * signaled completion on its queue pair retires it (RC completes in order).
 */
interface Chain {
  readonly job: Job;
  readonly base: number;
  readonly count: number;
  readonly fragment: boolean;
}

interface BindWait {
  /** The window this bind work request binds. */
  readonly mwId: number;
  resolve(): void;
  reject(e: TensorwireError): void;
}

interface Stream {
  readonly qpId: number;
  readonly qpn: number;
  /** Data work requests this QP may hold (its send queue less the bind slots). */
  readonly maxSendWr: number;
  /** Work requests per chain at most. */
  readonly chainWrs: number;
  /** Send-queue slots held by chains on the NIC (every WR of a chain, until its completion). */
  used: number;
  /** Jobs waiting for slots, in order; the head may be part posted. */
  queue: Job[];
  /** Fragments on the NIC (chains the send queue accepted only part of), oldest first. */
  fragments: Chain[];
  /** Set while posting backs off after the send queue refused work (ENOMEM/EAGAIN) with nothing signaled in flight. */
  retry: ReturnType<typeof setTimeout> | undefined;
  /** The next back-off delay (ms). */
  backoffMs: number;
}

/** The caller's request index of the first range whose `field` is `index` (for error details). */
function requestOf(batch: TransferBatch, field: number, index: number): number | undefined {
  const r = batch.ranges;
  for (let at = 0; at < batch.count * RANGE_STRIDE; at += RANGE_STRIDE) if (r[at + field] === index) return r[at + RangeField.Request];
  return undefined;
}

/**
 * Check a batch: its locals and remotes, and every range against both sides: the local
 * registration, and the remote range it names (RangeField.RemoteRange: the granted range of a
 * range grant, whose length came with the descriptor, or 0 for a whole registration). This is
 * the first of the requester's two bound checks; the second, in {@link layoutPlan}, is against
 * the lengths the holder itself sent with a range grant's table (a descriptor can be forged). In
 * memory-region mode nothing else stops a READ or WRITE past a granted range. Cost per range: a
 * few comparisons on the Float64Array.
 */
function checkBatch(batch: TransferBatch, owner: RdmaTransport, maxWrBytes: number): Checked {
  const { op, locals, remotes, count, ranges } = batch;
  if (op !== 'read' && op !== 'write') throw new InvalidInputError(`unknown op ${String(op)}`, { details: { field: 'op' } });
  if (!Number.isSafeInteger(count) || count < 0 || !(ranges instanceof Float64Array) || ranges.length < count * RANGE_STRIDE) {
    throw new InvalidInputError('malformed transfer batch: ranges do not hold count ranges', { details: { field: 'ranges' } });
  }
  const regs: RdmaRegistration[] = [];
  const localLen = new Float64Array(locals.length);
  const localMr = new Float64Array(locals.length);
  for (let i = 0; i < locals.length; i++) {
    const reg = locals[i];
    if (!(reg instanceof RdmaRegistration) || reg.owner !== owner) {
      const request = requestOf(batch, RangeField.Local, i);
      throw new InvalidInputError(`request ${String(request)}: local memory is not registered with this rdma transport`, { details: { field: 'local', request } });
    }
    regs.push(reg);
    localLen[i] = reg.length;
    localMr[i] = reg.mrId;
  }
  const list: Remote[] = [];
  const kinds = new Uint8Array(remotes.length);
  const remoteLens: Float64Array[] = [];
  for (let i = 0; i < remotes.length; i++) {
    const r = remotes[i];
    if (!(r instanceof RemoteRegion) && !(r instanceof RemoteRanges)) {
      const request = requestOf(batch, RangeField.Remote, i);
      throw new InvalidInputError(`request ${String(request)}: remote is not an rdma descriptor`, { details: { field: 'remote', request } });
    }
    list.push(r);
    kinds[i] = r instanceof RemoteRanges ? KIND_RANGES : r.grant.grant === 'window' ? KIND_WINDOW : KIND_MR;
    remoteLens.push(r.lengths);
  }
  const RS = RANGE_STRIDE;
  const [rLocal, rLocalOffset, rRemote, rRemoteOffset, rLength, rRange] = [
    RangeField.Local,
    RangeField.LocalOffset,
    RangeField.Remote,
    RangeField.RemoteOffset,
    RangeField.Length,
    RangeField.RemoteRange,
  ];
  for (let i = 0, at = 0; i < count; i++, at += RS) {
    const l = ranges[at + rLocal] as number;
    const lo = ranges[at + rLocalOffset] as number;
    const ro = ranges[at + rRemoteOffset] as number;
    const len = ranges[at + rLength] as number;
    // An index out of range (or not an integer) reads undefined, and every comparison with it is false.
    const lens = remoteLens[ranges[at + rRemote] as number];
    const size = lens === undefined ? undefined : lens[ranges[at + rRange] as number];
    if (
      !(len >= 1 && len <= maxWrBytes && lo >= 0 && lo + len <= (localLen[l] as number) && ro >= 0 && ro + len <= (size as number)) ||
      Math.floor(lo) !== lo ||
      Math.floor(ro) !== ro ||
      Math.floor(len) !== len
    ) {
      throw rangeError(batch, i, localLen, remoteLens, maxWrBytes);
    }
  }
  return { batch, op, regs, remotes: list, kinds, localMr, plan: undefined };
}

/**
 * Lay a checked batch out as work requests. Ranges in order that are back to back on the remote
 * side under the same key (the same remote registration, or the same region or window run of a
 * range grant) become one work request (an SGE per local piece, pieces back to back in one
 * registration merged into one SGE) while it has fewer than `maxSge` SGEs and at most
 * `maxWrBytes` bytes. `keys` holds each range grant's table. Cost per range: a few comparisons
 * and typed-array reads and writes.
 */
function layoutPlan(c: Checked, keys: readonly Keys[], sge: { readonly read: number; readonly write: number }, maxWrBytes: number): Plan {
  const { batch, op, remotes, kinds, localMr } = c;
  const { count, ranges } = batch;
  const n = remotes.length;
  const baseHi = new Float64Array(n);
  const baseLo = new Float64Array(n);
  const tables: (GrantTable | undefined)[] = new Array<GrantTable | undefined>(n);
  const slotOf: Int32Array[] = [];
  for (let m = 0; m < n; m++) {
    const r = remotes[m] as Remote;
    if (r instanceof RemoteRanges) {
      const t = keys[m] as GrantTable | undefined;
      if (t === undefined || t.count !== r.grant.count) throw new InvalidInputError('internal: a range grant is laid out without its table');
      tables[m] = t;
      slotOf.push(new Int32Array(t.keyRegion.length).fill(-1));
    } else {
      baseHi[m] = Number(r.grant.addr >> 32n);
      baseLo[m] = Number(r.grant.addr & 0xffffffffn);
      slotOf.push(Int32Array.of(-1));
    }
  }
  const maxSge = op === 'read' ? sge.read : sge.write;
  // Layout positions as locals: the loop reads registers, not properties of imported objects.
  const RS = RANGE_STRIDE;
  const [rLocal, rLocalOffset, rRemote, rRemoteOffset, rLength, rRange] = [
    RangeField.Local,
    RangeField.LocalOffset,
    RangeField.Remote,
    RangeField.RemoteOffset,
    RangeField.Length,
    RangeField.RemoteRange,
  ];
  const WS = WR_STRIDE;
  const [wOp, wHi, wLo, wRkey, wFirst, wCount] = [WrField.Op, WrField.RemoteHi, WrField.RemoteLo, WrField.Rkey, WrField.FirstSge, WrField.SgeCount];
  const SS = SGE_STRIDE;
  const [sMr, sOffset, sLength] = [SgeField.Mr, SgeField.Offset, SgeField.Length];
  const wrs = new Float64Array(count * WS);
  const sges = new Float64Array(count * SS);
  const slotRemote = new Uint32Array(count);
  const slotKey = new Uint32Array(count);
  let slots = 0;
  let w = -1; // current work request
  let wrSlot = -1;
  let wrEnd = -1; // remote offset (in the key's region) just past the current work request
  let wrBytes = 0;
  let wrSges = 0;
  let e = -1; // current SGE
  let sgeLocal = -1;
  let sgeStart = 0; // local offset of the current SGE
  let sgeEnd = -1; // local offset just past it
  const opCode = op === 'read' ? 0 : 1;
  for (let i = 0, at = 0; i < count; i++, at += RS) {
    const l = ranges[at + rLocal] as number;
    const lo = ranges[at + rLocalOffset] as number;
    const m = ranges[at + rRemote] as number;
    const len = ranges[at + rLength] as number;
    // Where the range is: an offset under one key, and the base address of the key's region.
    let key = 0;
    let off = ranges[at + rRemoteOffset] as number;
    let hi = baseHi[m] as number;
    let lo32 = baseLo[m] as number;
    if (kinds[m] === KIND_RANGES) {
      const t = tables[m] as GrantTable;
      const k = ranges[at + rRange] as number;
      // Against the lengths the holder granted, not only the descriptor's (which can be forged;
      // a range past the holder's count reads undefined, and the comparison is false).
      if (!(off + len <= (t.rangeLength[k] as number))) {
        const request = ranges[at + RangeField.Request];
        const granted = k < t.count ? `granted range ${k} of ${t.rangeLength[k] as number} bytes` : `granted range ${k} (the grant has ${t.count})`;
        throw new InvalidInputError(`request ${String(request)}: remote range ${off}+${len} is outside ${granted} (as the holder granted it)`, {
          details: { field: 'remoteOffset', request },
        });
      }
      key = t.rangeKey[k] as number;
      off += t.rangeOffset[k] as number;
      const region = t.keyRegion[key] as number;
      hi = t.regionHi[region] as number;
      lo32 = t.regionLo[region] as number;
    }
    const map = slotOf[m] as Int32Array;
    let slot = map[key] as number;
    if (slot < 0) {
      slot = slots++;
      map[key] = slot;
      slotRemote[slot] = m;
      slotKey[slot] = key;
    }
    if (slot === wrSlot && off === wrEnd && wrBytes + len <= maxWrBytes) {
      if (l === sgeLocal && lo === sgeEnd) {
        // Back to back locally too: the same SGE grows.
        sgeEnd += len;
        sges[e * SS + sLength] = sgeEnd - sgeStart;
        wrEnd += len;
        wrBytes += len;
        continue;
      }
      if (wrSges < maxSge) {
        e++;
        sges[e * SS + sMr] = localMr[l] as number;
        sges[e * SS + sOffset] = lo;
        sges[e * SS + sLength] = len;
        sgeLocal = l;
        sgeStart = lo;
        sgeEnd = lo + len;
        wrSges++;
        wrs[w * WS + wCount] = wrSges;
        wrEnd += len;
        wrBytes += len;
        continue;
      }
    }
    w++;
    e++;
    const sum = lo32 + off; // exact: both below 2^53
    const carry = Math.floor(sum / 0x100000000);
    const base = w * WS;
    if (hi + carry > 0xffffffff || !(sum + len <= Number.MAX_SAFE_INTEGER)) {
      const request = ranges[at + RangeField.Request];
      throw new InvalidInputError(`request ${String(request)}: the holder's grant table puts this range beyond 64-bit addresses`, { details: { field: 'remote', request } });
    }
    wrs[base + wOp] = opCode;
    wrs[base + wHi] = hi + carry;
    wrs[base + wLo] = sum - carry * 0x100000000;
    wrs[base + wRkey] = slot;
    wrs[base + wFirst] = e;
    wrs[base + wCount] = 1;
    sges[e * SS + sMr] = localMr[l] as number;
    sges[e * SS + sOffset] = lo;
    sges[e * SS + sLength] = len;
    wrSlot = slot;
    wrEnd = off + len;
    wrBytes = len;
    wrSges = 1;
    sgeLocal = l;
    sgeStart = lo;
    sgeEnd = lo + len;
  }
  return {
    checked: c,
    tables,
    wrs: wrs.slice(0, (w + 1) * WS),
    sges: sges.slice(0, (e + 1) * SS),
    wrCount: w + 1,
    slotRemote: slotRemote.slice(0, slots),
    slotKey: slotKey.slice(0, slots),
  };
}

/** The rkey of every key slot of `plan` for the queue pair of `stream`. */
function rkeysFor(plan: Plan, keys: readonly Keys[], stream: number): Uint32Array {
  const { checked, slotRemote, slotKey, tables } = plan;
  const out = new Uint32Array(slotRemote.length);
  for (let s = 0; s < out.length; s++) {
    const m = slotRemote[s] as number;
    const kind = checked.kinds[m];
    if (kind === KIND_RANGES) {
      const t = tables[m] as GrantTable;
      const per = t.rkeysPerKey;
      out[s] = t.rkeys[(slotKey[s] as number) * per + (per > 1 ? stream : 0)] as number;
    } else if (kind === KIND_WINDOW) {
      out[s] = (keys[m] as WindowKeys).rkeys[stream] as number;
    } else {
      out[s] = ((checked.remotes[m] as RemoteRegion).grant as MrGrant).rkey;
    }
  }
  return out;
}

/** The error for range `i` that failed the bounds check: which bound, named by its request. */
function rangeError(batch: TransferBatch, i: number, localLen: Float64Array, remoteLens: readonly Float64Array[], maxWrBytes: number): InvalidInputError {
  const at = i * RANGE_STRIDE;
  const r = batch.ranges;
  const request = r[at + RangeField.Request];
  const [l, lo, m, ro, len, k] = [RangeField.Local, RangeField.LocalOffset, RangeField.Remote, RangeField.RemoteOffset, RangeField.Length, RangeField.RemoteRange].map(
    (f) => r[at + f] as number,
  ) as [number, number, number, number, number, number];
  const index = (n: number, x: number): boolean => Number.isInteger(x) && x >= 0 && x < n;
  const whole = (x: number): boolean => Number.isSafeInteger(x) && x >= 0;
  const details = (field: string): { details: Record<string, unknown> } => ({ details: { field, request } });
  if (!index(localLen.length, l)) return new InvalidInputError(`request ${request}: range ${i} names local ${l}, not one of the batch's ${localLen.length}`, details('local'));
  if (!index(remoteLens.length, m)) return new InvalidInputError(`request ${request}: range ${i} names remote ${m}, not one of the batch's ${remoteLens.length}`, details('remote'));
  const ls = localLen[l] as number;
  const lens = remoteLens[m] as Float64Array;
  if (!whole(len) || len < 1) return new InvalidInputError(`request ${request}: length ${len} is not a positive integer`, details('length'));
  if (len > maxWrBytes) return new InvalidInputError(`request ${request}: ${len} bytes exceeds one work request (${maxWrBytes})`, details('length'));
  if (!whole(lo) || lo + len > ls) return new InvalidInputError(`request ${request}: local range ${lo}+${len} is outside its registration of ${ls} bytes`, details('localOffset'));
  if (!index(lens.length, k)) return new InvalidInputError(`request ${request}: range ${k} does not exist (the remote has ${lens.length})`, details('range'));
  const what = lens.length > 1 || k > 0 ? `granted range ${k} of ${lens[k] as number} bytes` : `its registration of ${lens[k] as number} bytes`;
  return new InvalidInputError(`request ${request}: remote range ${ro}+${len} is outside ${what}`, details('remoteOffset'));
}

function wcError(status: number, vendorErr: number, native: NativeAddon, peer: string): TensorwireError {
  const text = `${native.wcStatusString(status)} (status ${status}, vendor error 0x${vendorErr.toString(16)})`;
  if (status === WcStatus.RemAccessErr || status === WcStatus.RemInvReqErr) {
    return new RemoteRejectedError(`peer ${peer} refused the RDMA access: ${text}`, { details: { remoteCode: 'remote-access', status } });
  }
  if (status === WcStatus.LocProtErr || status === WcStatus.LocLenErr) {
    return new InvalidInputError(`local RDMA error: ${text}`, { details: { status } });
  }
  return new ConnectionBrokenError(`RDMA work request to ${peer} failed: ${text}`, { details: { status } });
}

// -------------------------------------------------------------------------------------
// Control socket helpers

/** What a control channel reports a bound it enforced to (the transport logs and counts it). */
type BoundHook = (reason: BoundReason, message: string) => void;

class Control {
  readonly socket: Socket;
  readonly #reader = new FrameReader();
  readonly #limits: RdmaControlLimits;
  readonly #onBound: BoundHook;
  #listener: ((m: ControlMessage) => void) | undefined;
  #backlog: ControlMessage[] = [];
  #failure: ((e: TensorwireError) => void) | undefined;
  #failed: TensorwireError | undefined;
  constructor(socket: Socket, limits: RdmaControlLimits, onBound: BoundHook) {
    this.socket = socket;
    this.#limits = limits;
    this.#onBound = onBound;
    socket.setNoDelay(true);
    socket.setKeepAlive(true, 5_000);
    socket.on('data', (d: Buffer) => {
      let msgs: ControlMessage[];
      try {
        msgs = this.#reader.push(d);
      } catch (e) {
        const err = toTensorwireError(e, InvalidInputError);
        this.#onBound('malformed-frame', `a malformed control frame: ${err.message}`);
        this.#fail(err);
        socket.destroy();
        return;
      }
      for (const m of msgs) {
        if (m.type === 'hello') this.onIdentity?.(m.setup.identity); // as claimed: for the logs
        if (this.#listener) this.#listener(m);
        else if (this.#backlog.length >= this.#limits.maxUnreadFrames) {
          this.#drop('unread-frames', `the peer sent more than ${this.#limits.maxUnreadFrames} control frames ahead of the handshake`);
          return;
        } else this.#backlog.push(m);
      }
    });
    socket.on('error', (e) => this.#fail(new ConnectionBrokenError(`control socket: ${e.message}`, { cause: e })));
    socket.on('close', () => this.#fail(new ConnectionBrokenError('control socket closed')));
  }
  /** Drop the connection over a bound: logged and counted by the transport, then the socket goes. */
  #drop(reason: BoundReason, message: string): void {
    if (this.socket.destroyed) return;
    this.#onBound(reason, message);
    this.#backlog.length = 0;
    this.socket.destroy(new Error(message));
  }

  #fail(e: TensorwireError): void {
    if (this.#failed) return;
    this.#failed = e;
    this.#failure?.(e);
  }
  onMessage(listener: (m: ControlMessage) => void): void {
    this.#listener = listener;
    // A one-shot listener (next()) unsets itself: leave the rest for the next listener.
    while (this.#backlog.length > 0 && this.#listener === listener) listener(this.#backlog.shift() as ControlMessage);
  }
  /** Set by the acceptor: told the peer's identity once its HELLO is read (for the bound hook's logs). */
  onIdentity: ((id: NodeIdentity) => void) | undefined;

  onFailure(listener: (e: TensorwireError) => void): void {
    this.#failure = listener;
    if (this.#failed) listener(this.#failed);
  }
  /**
   * Frames waiting for the socket, in order: encoded frames, or a lazy answer (a grant table,
   * produced frame by frame as the socket drains, so that a big table neither sits in memory
   * encoded nor jumps ahead of what is sent after it).
   */
  readonly #out: (Uint8Array | Iterator<Uint8Array>)[] = [];
  #outBytes = 0;
  #outLazy = 0;
  #blocked = false;
  #ending = false;

  #writable(): boolean {
    return !this.socket.destroyed && this.socket.writable && !this.#ending;
  }

  send(m: ControlMessage): void {
    if (!this.#writable()) return;
    const frame = encodeFrame(m);
    if (this.socket.writableLength + this.#outBytes + frame.length > this.#limits.maxControlBacklogBytes) {
      // The peer asks (BIND) faster than it reads the answers: drop it rather than buffer forever.
      this.#drop('control-backlog', `the peer does not read its control messages (${this.socket.writableLength + this.#outBytes} bytes queued, limit ${this.#limits.maxControlBacklogBytes})`);
      return;
    }
    this.#out.push(frame);
    this.#outBytes += frame.length;
    this.#flush();
  }

  /** Queue frames produced lazily (a grant table): written in order with everything else, as the socket drains. */
  sendFrames(frames: Iterator<Uint8Array>): void {
    if (!this.#writable()) return;
    if (this.#outLazy >= this.#limits.maxQueuedGrantTables) {
      this.#drop('grant-tables-queued', `the peer does not read its control messages (${this.#outLazy} grant tables queued, limit ${this.#limits.maxQueuedGrantTables})`);
      return;
    }
    this.#out.push(frames);
    this.#outLazy++;
    this.#flush();
  }

  /** End the socket once what is queued is written (grant tables still queued are dropped). */
  end(): void {
    if (this.#ending) return;
    for (let i = this.#out.length - 1; i >= 0; i--) {
      if (!(this.#out[i] instanceof Uint8Array)) {
        this.#out.splice(i, 1);
        this.#outLazy--;
      }
    }
    this.#ending = true;
    if (this.#out.length === 0 && !this.#blocked) this.socket.end();
  }

  #flush(): void {
    while (!this.#blocked && this.#out.length > 0) {
      if (this.socket.destroyed || !this.socket.writable) {
        this.#out.length = 0;
        return;
      }
      const head = this.#out[0] as Uint8Array | Iterator<Uint8Array>;
      let frame: Uint8Array;
      if (head instanceof Uint8Array) {
        this.#out.shift();
        this.#outBytes -= head.length;
        frame = head;
      } else {
        let next: IteratorResult<Uint8Array>;
        try {
          next = head.next();
        } catch (e) {
          this.socket.destroy(e instanceof Error ? e : new Error(String(e)));
          return;
        }
        if (next.done === true) {
          this.#out.shift();
          this.#outLazy--;
          continue;
        }
        frame = next.value;
      }
      if (!this.socket.write(frame)) {
        this.#blocked = true;
        this.socket.once('drain', () => {
          this.#blocked = false;
          this.#flush();
        });
      }
    }
    if (this.#ending && this.#out.length === 0 && !this.#blocked && !this.socket.destroyed) this.socket.end();
  }
  /** The next message, or a typed error on failure, abort or deadline. */
  next(signal: AbortSignal | undefined, deadline: number, what: string): Promise<ControlMessage> {
    return new Promise<ControlMessage>((resolve, reject) => {
      const done = (): void => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        this.#listener = undefined;
        this.#failure = undefined;
      };
      const onAbort = (): void => {
        done();
        reject(errorFromSignal(signal as AbortSignal, what));
      };
      const timer = setTimeout(() => {
        done();
        reject(new TimedOutError(`${what} timed out`));
      }, Math.max(0, deadline - Date.now()));
      if (signal?.aborted) return onAbort();
      signal?.addEventListener('abort', onAbort, { once: true });
      this.onFailure((e) => {
        done();
        reject(e);
      });
      this.onMessage((m) => {
        done();
        resolve(m);
      });
    });
  }
}

// -------------------------------------------------------------------------------------

interface Queues {
  readonly cqId: number;
  readonly qps: { id: number; qpn: number; maxSendWr: number; psn: number }[];
}

export class RdmaConnection implements TransportConnection {
  readonly transport = 'rdma';
  readonly peer: NodeIdentity;
  readonly initiator: string;
  readonly streams: number;
  readonly #owner: RdmaTransport;
  readonly #device: NativeDevice;
  readonly #native: NativeAddon;
  readonly #control: Control;
  readonly #cqId: number;
  readonly #streams: Stream[];
  /** Chains on the NIC, by the wr_id of their last (signaled) work request. */
  readonly #chains = new Map<number, Chain>();
  readonly #ops = new Set<Job>();
  readonly #closeListeners: ((e: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  #nextWrId = 1;
  #state: 'open' | 'retiring' | 'closing' | 'closed' = 'open';
  #closing: Promise<void> | undefined;
  #retiring: Promise<void> | undefined;
  #closeError: TensorwireError | undefined;
  #peerClosed = false;
  #peerRetiring = false;
  #drained: (() => void) | undefined;
  /** Set while retire() waits for the peer's 'close'. */
  #peerDrained: (() => void) | undefined;
  /** Requester side: rkeys of the peer's memory-window grants on this connection. */
  readonly #keys: WindowKeyCache;
  /** Holder side: BIND_MW work requests on the NIC, by wrId. */
  readonly #binds = new Map<number, BindWait>();
  /** Holder side: every window allocated for this connection and not yet deallocated, with its MR. */
  readonly #windowIds = new Map<number, RdmaRegistration>();
  /** Holder side: BINDs being served (waiting for a slot, binding, or waiting for another's bind). */
  #pendingBinds = 0;
  /** Holder side: BINDs served at once (each takes one send-queue slot per QP). */
  #bindSlots = BIND_SLOTS;
  readonly #bindWaiters: (() => void)[] = [];
  /** Requester side: the tables of the peer's range grants on this connection. */
  readonly #tables: GrantTableCache;
  /** Holder side: GRANT_BINDs being served. */
  #pendingGrantBinds = 0;
  /** Holder side: revoked range grants whose GRANT_UNBOUND this side waits for, by token hex. */
  readonly #grantAcks = new Map<string, () => void>();

  /** @internal */
  constructor(owner: RdmaTransport, device: NativeDevice, native: NativeAddon, control: Control, peer: NodeIdentity, initiator: string, q: Queues) {
    this.#owner = owner;
    this.#device = device;
    this.#native = native;
    this.#control = control;
    this.peer = peer;
    this.initiator = initiator;
    this.streams = q.qps.length;
    this.#cqId = q.cqId;
    this.#streams = q.qps.map((x) => ({
      qpId: x.id,
      qpn: x.qpn,
      maxSendWr: x.maxSendWr,
      // Several chains in flight per QP, so the send queue refills while one completes.
      chainWrs: Math.max(1, Math.min(MAX_CHAIN_WRS, Math.ceil(x.maxSendWr / 4))),
      used: 0,
      queue: [],
      fragments: [],
      retry: undefined,
      backoffMs: 1,
    }));
    this.#keys = new WindowKeyCache(this.streams, (requestId, token) => control.send({ type: 'bind', requestId, token }));
    this.#tables = new GrantTableCache(this.streams, (m) => {
      owner.grantBindsSent++;
      control.send(m);
    });
    control.onMessage((m) => this.#onControl(m));
    control.onFailure((e) => {
      if (this.#state === 'open' || this.#state === 'retiring') {
        void this.#shutdown(this.#peerClosed && this.#chains.size === 0 ? undefined : e, e);
      }
    });
  }

  get isOpen(): boolean {
    return this.#state === 'open';
  }

  /** Chains of work requests on the NIC right now (all streams), window binds included. */
  get outstanding(): number {
    return this.#chains.size + this.#binds.size;
  }

  /** Send-queue slots held by data work requests on `stream`'s queue pair (for tests and diagnostics). */
  slotsInUse(stream: number): number {
    return this.#streams[stream]?.used ?? 0;
  }

  /** Memory windows this side holds for the peer (holder side, memory-window grants). */
  get windows(): number {
    return this.#windowIds.size;
  }

  /** Grants of the peer whose window rkeys this side has cached (requester side). */
  get cachedGrants(): number {
    return this.#keys.size;
  }

  /** Range grants of the peer whose tables this side has cached (requester side). */
  get cachedGrantTables(): number {
    return this.#tables.size;
  }

  /** GRANT_BINDs this side has sent on this connection (requester side; one per range grant used). */
  get grantBindsSent(): number {
    return this.#tables.binds;
  }

  /** Revoked range grants this side still waits to hear GRANT_UNBOUND for (holder side). */
  get grantUnbindsPending(): number {
    return this.#grantAcks.size;
  }

  onClose(listener: (error: TensorwireError | undefined) => void): void {
    if (this.#state === 'closed') queueMicrotask(() => listener(this.#closeError));
    else this.#closeListeners.push(listener);
  }

  onRetire(listener: () => void): void {
    this.#retireListeners.push(listener);
  }

  execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    if (this.#state !== 'open') {
      return Promise.reject(this.#closeError ?? new ClosedError(`rdma connection to ${this.peer.nodeId} is ${this.#state}`));
    }
    if (!Number.isInteger(stream) || stream < 0 || stream >= this.streams) {
      return Promise.reject(new InvalidInputError(`stream ${stream} is not in 0..${this.streams - 1}`, { details: { field: 'stream' } }));
    }
    let checked: Checked;
    try {
      checked = this.#owner.check(batch);
    } catch (e) {
      return Promise.reject(toTensorwireError(e, InvalidInputError));
    }
    // What can change between posts of the same batch is checked on every post.
    for (let i = 0; i < checked.regs.length; i++) {
      if ((checked.regs[i] as RdmaRegistration).revoked) {
        const request = requestOf(batch, RangeField.Local, i);
        return Promise.reject(new InvalidInputError(`request ${String(request)}: local registration was revoked`, { details: { field: 'local', request } }));
      }
    }
    if (options.signal.aborted) return Promise.reject(errorFromSignal(options.signal, 'rdma transfer'));
    if (batch.count === 0) return Promise.resolve();
    const s = this.#streams[stream] as Stream;
    return new Promise<void>((resolve, reject) => {
      const onAbort = (): void => this.#abortJob(job, errorFromSignal(options.signal, 'rdma transfer'));
      const timer = setTimeout(() => this.#abortJob(job, new TimedOutError(`rdma transfer to ${this.peer.nodeId} passed its deadline`)), Math.max(0, options.deadline - Date.now()));
      const job: Job = {
        checked,
        plan: undefined,
        stream: s,
        group: options.transfer ?? options.signal,
        signal: options.signal,
        keysOf: new Array<Keys>(checked.remotes.length),
        rkeys: new Uint32Array(0),
        windows: [],
        tables: [],
        next: 0,
        chains: 0,
        holding: false,
        queued: false,
        error: undefined,
        settled: false,
        resolve,
        reject,
        cleanup: () => {
          clearTimeout(timer);
          options.signal.removeEventListener('abort', onAbort);
        },
      };
      options.signal.addEventListener('abort', onAbort, { once: true });
      this.#ops.add(job);
      const start = (): void => {
        if (job.settled) return;
        if (job.error !== undefined || (this.#state !== 'open' && this.#state !== 'retiring')) {
          job.error ??= this.#closeError ?? new SessionInvalidatedError(`rdma connection to ${this.peer.nodeId} closed before the transfer started`);
          this.#maybeSettle(job);
          return;
        }
        // Every key is here: lay the batch out (once per batch and set of tables) and fill in
        // this queue pair's rkeys.
        try {
          const plan = this.#owner.layout(checked, job.keysOf);
          job.plan = plan;
          job.rkeys = rkeysFor(plan, job.keysOf, stream);
        } catch (e) {
          job.error ??= toTensorwireError(e, InvalidInputError);
          this.#maybeSettle(job);
          return;
        }
        if (job.error === undefined) job.error = this.#stale(job);
        if (job.error !== undefined) {
          this.#maybeSettle(job);
          return;
        }
        s.queue.push(job);
        job.queued = true;
        this.#pump(s);
      };
      // What opens each remote on this connection: an MR grant's own rkey, this connection's
      // windows for a memory-window grant (one BIND per grant, cached), or a range grant's table
      // (one GRANT_BIND per grant, cached). Nothing is posted until every key is here, so a
      // refusal fails the transfer cleanly.
      let waits: Promise<void>[] | undefined;
      const hold = (m: number, k: WindowKeys | GrantTable): void => {
        if (job.settled) return;
        job.keysOf[m] = k;
        if ('users' in k) {
          k.users++;
          job.tables.push(k);
        } else job.windows.push(k);
      };
      for (let m = 0; m < checked.remotes.length; m++) {
        const kind = checked.kinds[m];
        if (kind === KIND_MR) continue;
        const r = checked.remotes[m] as Remote;
        const k =
          r instanceof RemoteRanges ? this.#tables.get(r.grant, r.tokenHex) : this.#keys.get((r.grant as WindowGrant).token, r.windowToken);
        if (k instanceof Promise) (waits ??= []).push((k as Promise<WindowKeys | GrantTable>).then((v) => hold(m, v)));
        else hold(m, k);
      }
      if (waits === undefined) start();
      else {
        Promise.all(waits).then(start, (e: unknown) => {
          if (job.settled) return;
          job.error ??= toTensorwireError(e);
          this.#maybeSettle(job);
        });
      }
    });
  }

  /**
   * Why a job must not post more: a registration revoked, or a grant revoked by the holder
   * (UNBIND, GRANT_UNBIND).
   */
  #stale(job: Job): TensorwireError | undefined {
    const what = job.next === 0 ? 'its transfer started' : 'all of its transfer was posted';
    const { regs, batch } = job.checked;
    for (let i = 0; i < regs.length; i++) {
      if ((regs[i] as RdmaRegistration).revoked) {
        const request = requestOf(batch, RangeField.Local, i);
        return new InvalidInputError(`request ${String(request)}: local registration was revoked before ${what}`, { details: { field: 'local', request } });
      }
    }
    // Its windows are gone (a READ or WRITE through them would fail on the NIC), or the holder
    // asked for the grant back: nothing more may use it.
    for (const k of job.windows) if (k.revoked) return grantRevoked(this.peer.nodeId, what);
    for (const t of job.tables) if (t.revoked) return grantRevoked(this.peer.nodeId, what);
    return undefined;
  }

  /**
   * Post chains from the stream's queue while its send queue has room: at most `chainWrs`
   * work requests per chain, one ibv_post_send each, every WR of a chain holding its slot
   * until the chain's (last, signaled) completion. A post the provider refuses (ENOMEM, EAGAIN)
   * or accepts only in part is local exhaustion, never a reason to close the connection
   * (invariant 5): with nothing of the batch posted and the queue pair idle it is backpressure
   * (ResourceExhaustedError, the engine backs off); otherwise the batch waits at the head of the
   * queue for room (see #backOff), the part accepted tracked as a fragment.
   */
  #pump(s: Stream): void {
    if (s.retry !== undefined) {
      clearTimeout(s.retry);
      s.retry = undefined;
    }
    while (this.#state !== 'closing' && this.#state !== 'closed' && s.queue.length > 0) {
      const room = s.maxSendWr - s.used;
      if (room <= 0) return;
      const job = s.queue[0] as Job;
      if (job.error === undefined) job.error = this.#stale(job);
      if (job.error !== undefined) {
        s.queue.shift();
        job.queued = false;
        this.#maybeSettle(job);
        continue;
      }
      const plan = job.plan as Plan;
      const regs = job.checked.regs;
      const n = Math.min(room, s.chainWrs, plan.wrCount - job.next);
      const base = this.#nextWrId;
      let posted = 0;
      let errno = 0;
      let text: string | undefined;
      let thrown: TensorwireError | undefined;
      try {
        const r = this.#device.post(s.qpId, plan.wrs, plan.sges, job.rkeys, job.next, n, base);
        posted = r.posted;
        errno = r.errno;
        text = r.error;
      } catch (e) {
        thrown = nativeError(e, 'ibv_post_send');
      }
      const exhausted = thrown instanceof ResourceExhaustedError || (thrown === undefined && (errno === ENOMEM || errno === EAGAIN));
      if (posted > 0) {
        this.#nextWrId = base + posted;
        // A chain cut short (the send queue was fuller than our count) has no signaled work request.
        const c: Chain = { job, base, count: posted, fragment: posted < n };
        this.#chains.set(base + posted - 1, c);
        if (c.fragment) s.fragments.push(c);
        s.used += posted;
        job.chains++;
        job.next += posted;
        if (!job.holding) {
          job.holding = true;
          for (const r of regs) r.posted++;
          for (const t of job.tables) t.posting++;
        }
      }
      if (thrown === undefined && errno === 0) {
        s.backoffMs = 1;
        if (job.next === plan.wrCount) {
          s.queue.shift();
          job.queued = false;
        }
        continue;
      }
      if (exhausted && thrown === undefined && (job.holding || this.#state === 'retiring' || this.#signaledInFlight(s))) {
        // Local exhaustion (invariant 5): the send queue is full for now. Nothing is torn down;
        // the batch stays at the head of its queue and posts (the rest) once the queue pair has
        // room again: when part of it is on the NIC already (it cannot be handed back as
        // backpressure), when the connection is retiring (the engine cannot post it again here),
        // or when a completion on this queue pair will free room soon anyway.
        this.#backOff(s);
        return;
      }
      // The post failed with nothing of this batch on the NIC: backpressure (the engine backs off
      // and posts the batch again, on this connection), or bad input.
      let failure: TensorwireError;
      if (exhausted && !job.holding) failure = thrown ?? new ResourceExhaustedError(`the send queue to ${this.peer.nodeId} is full: ${text ?? `errno ${errno}`}`);
      else if (thrown !== undefined && !exhausted) failure = thrown; // bad input: the job fails after what it posted completes
      else failure = new ConnectionBrokenError(`posting to ${this.peer.nodeId} failed: ${thrown?.message ?? text ?? `errno ${errno}`}`, thrown ? { cause: thrown } : {});
      job.error ??= failure;
      s.queue.shift();
      job.queued = false;
      this.#maybeSettle(job);
      if (failure.breaksConnection) {
        void this.#shutdown(failure, undefined);
        return;
      }
      // The connection stays: the jobs behind this one get their turn now.
    }
  }

  /**
   * The send queue of `s` refused work for now. A signaled chain still on it will complete and
   * pump again; with none (only fragments, or nothing), try again after a back-off that doubles
   * up to 64 ms. The head job's deadline and signal still apply.
   */
  #backOff(s: Stream): void {
    if (this.#signaledInFlight(s)) return;
    const ms = s.backoffMs;
    s.backoffMs = Math.min(64, ms * 2);
    s.retry = setTimeout(() => {
      s.retry = undefined;
      if (this.#state === 'open' || this.#state === 'retiring') this.#pump(s);
    }, ms);
    s.retry.unref();
  }

  /** Whether a chain with a signaled work request is on `s`'s queue pair (its completion will pump `s`). */
  #signaledInFlight(s: Stream): boolean {
    let fragmentSlots = 0;
    for (const f of s.fragments) fragmentSlots += f.count;
    return s.used > fragmentSlots;
  }

  /** A signaled completion of `wrId` on `s` retires every fragment posted before it (RC completes in order). */
  #retireFragments(s: Stream, wrId: number): void {
    while (s.fragments.length > 0) {
      const f = s.fragments[0] as Chain;
      const last = f.base + f.count - 1;
      if (last > wrId) return;
      s.fragments.shift();
      if (this.#chains.get(last) !== f) continue;
      this.#chains.delete(last);
      s.used -= f.count;
      f.job.chains--;
      this.#maybeSettle(f.job);
    }
  }

  /** Fail a job and take it off its stream's queue; it settles once its chains are off the NIC. */
  #failJob(job: Job, error: TensorwireError): void {
    job.error ??= error;
    if (job.queued) {
      const q = job.stream.queue;
      q.splice(q.indexOf(job), 1);
      job.queued = false;
    }
  }

  /** The device's poller delivered a completion for this connection's CQ. */
  onCompletion(wrId: number, status: number, vendorErr: number): void {
    const bind = this.#binds.get(wrId);
    if (bind) {
      this.#binds.delete(wrId);
      if (status === WcStatus.Success) bind.resolve();
      else {
        const err =
          status === WcStatus.WrFlushErr
            ? (this.#closeError ?? new ConnectionBrokenError(`window bind flushed: the queue pair to ${this.peer.nodeId} is in error`))
            : wcError(status, vendorErr, this.#native, this.peer.nodeId);
        bind.reject(err);
        // A failed work request leaves the RC QP in ERR: the connection is done.
        if (this.#state === 'open' || this.#state === 'retiring') {
          void this.#shutdown(new ConnectionBrokenError(`binding a memory window for ${this.peer.nodeId} failed: ${err.message}`, { cause: err }), undefined);
        }
      }
      if (this.outstanding === 0) this.#drained?.();
      return;
    }
    const c = this.#chains.get(wrId);
    if (c === undefined) {
      // Not the last work request of a chain: unsignaled ones complete only in error (a
      // failure, or a flush after one). Its chain completes when its last one flushes.
      if (status !== WcStatus.Success) {
        for (const x of this.#chains.values()) {
          if (wrId >= x.base && wrId < x.base + x.count) {
            this.#chainFailed(x.job, status, vendorErr);
            break;
          }
        }
      }
      return;
    }
    this.#chains.delete(wrId);
    const job = c.job;
    const s = job.stream;
    if (c.fragment) {
      const i = s.fragments.indexOf(c);
      if (i >= 0) s.fragments.splice(i, 1);
    }
    // A signaled completion retires every work request of its chain (and the fragments posted
    // before it on the queue pair): their slots are free.
    s.used -= c.count;
    job.chains--;
    if (status === WcStatus.Success) this.#retireFragments(s, wrId);
    else this.#chainFailed(job, status, vendorErr);
    this.#maybeSettle(job);
    if (this.outstanding === 0) this.#drained?.();
    if (this.#state === 'open' || this.#state === 'retiring') this.#pump(s);
  }

  /** A work request of `job` completed in error. */
  #chainFailed(job: Job, status: number, vendorErr: number): void {
    if (status === WcStatus.WrFlushErr) {
      this.#failJob(job, this.#closeError ?? new ConnectionBrokenError(`work request flushed: the queue pair to ${this.peer.nodeId} is in error`));
      // A flush we did not cause (we move QPs to ERR only in #shutdown) means the QP went to
      // ERR on its own (a fatal/async error, the responder's QP failing): every later work
      // request would flush too, so the connection is broken. Quiesce it.
      if (this.#state === 'open' || this.#state === 'retiring') {
        void this.#shutdown(new ConnectionBrokenError(`queue pair to ${this.peer.nodeId} is in error: its work requests are flushed`), undefined);
      }
      return;
    }
    const err = wcError(status, vendorErr, this.#native, this.peer.nodeId);
    this.#failJob(job, err);
    // The other streams of the same transfer report the cause, not the flush it leads to.
    for (const o of this.#ops) if (o.group === job.group) o.error ??= err;
    // An RC QP that completed in error is in ERR: the connection is done. Quiesce it.
    void this.#shutdown(new ConnectionBrokenError(`queue pair to ${this.peer.nodeId} failed: ${err.message}`, { cause: err }), undefined);
  }

  #maybeSettle(job: Job): void {
    if (job.settled || job.chains > 0 || job.queued) return;
    if (job.error === undefined && (job.plan === undefined || job.next < job.plan.wrCount)) return;
    job.settled = true;
    job.cleanup();
    this.#ops.delete(job);
    const posted = job.holding;
    if (job.holding) {
      job.holding = false;
      for (const r of job.checked.regs) {
        r.posted--;
        if (r.posted === 0) for (const f of r.idle.splice(0)) f();
      }
    }
    // Nothing of it is on the NIC: the range grants it posted under may be given back (GRANT_UNBOUND).
    for (const t of job.tables) {
      t.users--;
      if (!posted) continue;
      t.posting--;
      if (t.posting === 0 && t.onIdle) {
        const f = t.onIdle;
        t.onIdle = undefined;
        f();
      }
    }
    if (job.error !== undefined) job.reject(job.error);
    else job.resolve();
    if (this.#ops.size === 0) this.#idle?.();
  }

  #idle: (() => void) | undefined;

  #abortJob(job: Job, error: TensorwireError): void {
    if (job.settled) return;
    this.#failJob(job, error);
    if (job.chains === 0) {
      this.#maybeSettle(job);
      return;
    }
    // Work is on the NIC and an RC work request cannot be recalled: quiesce the connection.
    void this.#shutdown(new ConnectionBrokenError(`rdma connection to ${this.peer.nodeId} quiesced after: ${error.message}`, { cause: error }), undefined);
  }

  #onControl(m: ControlMessage): void {
    if (m.type === 'bind') {
      void this.#serveBind(m.requestId, m.token);
      return;
    }
    if (m.type === 'bound' || m.type === 'refuse') {
      const problem = m.type === 'bound' ? this.#keys.onBound(m.requestId, m.rkeys) : this.#keys.onRefused(m.requestId, m.code, m.message);
      if (problem) void this.#shutdown(problem, undefined);
      return;
    }
    if (m.type === 'unbind') {
      this.#keys.onUnbind(m.token);
      return;
    }
    if (m.type === 'grant-bind') {
      void this.#serveGrantBind(m);
      return;
    }
    if (m.type === 'grant-head' || m.type === 'grant-regions' || m.type === 'grant-keys' || m.type === 'grant-ranges' || m.type === 'grant-refuse') {
      const problem = this.#tables.onMessage(m);
      if (problem) void this.#shutdown(problem, undefined);
      return;
    }
    if (m.type === 'grant-unbind') {
      // The holder revoked a range grant: nothing more is posted under it, and once the work
      // already on the NIC under it has completed this side says so (GRANT_UNBOUND); the
      // holder's revoke waits for that.
      const token = m.token;
      // Transfers holding a table that have posted nothing never will (it is revoked now).
      const held = this.#tables.onUnbind(tokenHex(token)).filter((t) => t.posting > 0);
      const ack = (): void => this.#control.send({ type: 'grant-unbound', token });
      if (held.length === 0) ack();
      else {
        let left = held.length;
        for (const t of held) {
          t.onIdle = () => {
            if (--left === 0) ack();
          };
        }
      }
      return;
    }
    if (m.type === 'grant-unbound') {
      const hex = tokenHex(m.token);
      const done = this.#grantAcks.get(hex);
      if (done) {
        this.#grantAcks.delete(hex);
        done();
      }
      return;
    }
    if (m.type === 'retire') {
      this.#peerRetiring = true;
      for (const l of this.#retireListeners.splice(0)) l();
      // The peer is retiring the connection: this side retires it too (no new work; what is
      // in flight finishes), and both close once each has told the other it is drained.
      void this.retire().catch(() => undefined);
    } else if (m.type === 'close') {
      this.#peerClosed = true;
      if (this.#state === 'retiring') {
        // Orderly: the peer has nothing in flight and posts nothing more. Its QPs stay up until
        // our own 'close'; an abortive close follows with the control socket ending.
        this.#peerDrained?.();
        return;
      }
      void this.#shutdown(this.#chains.size === 0 && this.#ops.size === 0 ? undefined : new ConnectionBrokenError(`peer ${this.peer.nodeId} closed the connection`), undefined);
    } else {
      void this.#shutdown(new ConnectionBrokenError(`unexpected ${m.type} message from ${this.peer.nodeId}`), undefined);
    }
  }

  /**
   * Holder side of BIND: bind one type-2 window per queue pair of this connection to the
   * registration behind `token`, and answer with their rkeys, or refuse with a reason.
   */
  async #serveBind(requestId: number, token: Uint8Array): Promise<void> {
    const max = this.#owner.limits.maxPendingBinds;
    if (this.#pendingBinds >= max) {
      // A requester asks once per grant and waits; this many at once is not a requester.
      const message = `${this.peer.nodeId} sent more than ${max} BINDs at once`;
      // Once per connection: what it sends while it is torn down is dropped.
      if (this.#state === 'open' || this.#state === 'retiring') this.#owner.overBound(this.peer, 'pending-binds', message);
      void this.#shutdown(new ConnectionBrokenError(message), undefined);
      return;
    }
    this.#pendingBinds++;
    try {
      await this.#serveBindNow(requestId, token);
    } finally {
      this.#pendingBinds--;
    }
  }

  async #serveBindNow(requestId: number, token: Uint8Array): Promise<void> {
    const refuse = (code: string, message: string): void => this.#control.send({ type: 'refuse', requestId, code, message });
    if (this.#state !== 'open' && this.#state !== 'retiring') return refuse('closing', 'the connection is closing');
    const ledger = this.#owner.windowLedger;
    if (!ledger) return refuse('unknown-grant', 'this node does not grant memory windows');
    const r = ledger.request(this, tokenHex(token));
    if (r.kind === 'refused') return refuse(r.code, r.message);
    const b = r.binding;
    if (r.kind === 'existing') {
      await b.settled;
      if (b.state === 'bound' && b.rkeys) this.#control.send({ type: 'bound', requestId, rkeys: Array.from(b.rkeys) });
      else refuse('unknown-grant', 'the grant was revoked');
      return;
    }
    const reg = r.grant as RdmaRegistration;
    // A slot is taken here, or handed over by the bind that frees it (never both).
    if (this.#bindSlots > 0) this.#bindSlots--;
    else await new Promise<void>((resolve) => this.#bindWaiters.push(resolve));
    try {
      const rkeys = await this.#bindWindows(b, reg);
      if (ledger.complete(b, rkeys)) {
        this.#control.send({ type: 'bound', requestId, rkeys });
      } else {
        this.#deallocWindows(b.windows);
        b.finish();
        refuse('unknown-grant', 'the grant was revoked while its windows were being bound');
      }
    } catch (e) {
      this.#deallocWindows(b.windows);
      ledger.fail(b);
      const err = toTensorwireError(e);
      refuse(reg.revoked ? 'unknown-grant' : err instanceof ResourceExhaustedError ? 'no-windows' : 'bind-failed', err.message);
    } finally {
      const next = this.#bindWaiters.shift();
      if (next) next();
      else this.#bindSlots++;
    }
  }

  /** Allocate and bind one window per QP; resolves with their rkeys once every bind completed. */
  async #bindWindows(b: Binding<RdmaConnection>, reg: RdmaRegistration): Promise<number[]> {
    if (this.#state !== 'open' && this.#state !== 'retiring') throw new ClosedError('the connection is closing');
    if (reg.revoked) throw new RemoteRejectedError('the grant was revoked');
    const rkeys: number[] = [];
    const waits: Promise<void>[] = [];
    let failure: TensorwireError | undefined;
    for (const s of this.#streams) {
      try {
        const mw = this.#device.allocMw();
        this.#windowIds.set(mw.id, reg);
        reg.windows++;
        b.windows.push(mw.id);
        const wrId = this.#nextWrId++;
        const r = this.#device.bindMw(s.qpId, mw.id, reg.mrId, 0, reg.length, Access.RemoteRead | Access.RemoteWrite, BigInt(wrId));
        if (!r.posted) {
          failure =
            r.errno === 12
              ? new ResourceExhaustedError(`send queue full while binding a window: ${r.error ?? ''}`)
              : new ConnectionBrokenError(`binding a window for ${this.peer.nodeId} failed: ${r.error ?? `errno ${r.errno}`}`);
          break;
        }
        // Completions arrive on a later turn of the event loop: registering it now is in time.
        const done = new Promise<void>((resolve, reject) => this.#binds.set(wrId, { mwId: mw.id, resolve, reject }));
        done.catch(() => undefined); // observed below through allSettled
        rkeys.push(r.rkey);
        waits.push(done);
      } catch (e) {
        failure = nativeError(e, 'binding a memory window');
        break;
      }
    }
    // Binds already on the NIC finish (or flush) before their windows may be deallocated.
    const settled = await Promise.allSettled(waits);
    const rejected = settled.find((x): x is PromiseRejectedResult => x.status === 'rejected');
    if (failure) throw failure;
    if (rejected) throw toTensorwireError(rejected.reason);
    return rkeys;
  }

  /** Deallocate windows this connection holds (idempotent per id): their rkeys stop working. */
  #deallocWindows(ids: readonly number[]): void {
    for (const id of ids) {
      const reg = this.#windowIds.get(id);
      if (!reg) continue;
      this.#windowIds.delete(id);
      try {
        this.#device.deallocMw(id);
      } catch (e) {
        this.#owner.logger.warn('rdma: ibv_dealloc_mw failed', { error: String(e) });
      }
      reg.windows--;
      // revoke() deregisters the MR only once no window is bound over it.
      if (reg.windows === 0) for (const f of reg.windowsGone.splice(0)) f();
    }
  }

  /** @internal The holder revoked a grant this connection had windows for. */
  releaseBinding(b: Binding<RdmaConnection>): void {
    this.#deallocWindows(b.windows);
    this.#control.send({ type: 'unbind', token: new Uint8Array(Buffer.from(b.token, 'hex')) });
  }

  /**
   * Holder side of GRANT_BIND: answer with the grant's table (where each range is, and the
   * rkeys that open it on this connection), or refuse with a reason. In memory-window mode this
   * first binds one type-2 window per key (a run of granted ranges) and queue pair of this
   * connection, within the peer's window budget. A range count, mode or byte total that is not
   * the grant's is refused like an unknown token: the requester's descriptor payload was changed.
   */
  async #serveGrantBind(m: GrantBindMessage): Promise<void> {
    const max = this.#owner.limits.maxPendingBinds;
    if (this.#pendingGrantBinds >= max) {
      const message = `${this.peer.nodeId} sent more than ${max} GRANT_BINDs at once`;
      // Once per connection: what it sends while it is torn down is dropped.
      if (this.#state === 'open' || this.#state === 'retiring') this.#owner.overBound(this.peer, 'pending-grant-binds', message);
      void this.#shutdown(new ConnectionBrokenError(message), undefined);
      return;
    }
    this.#pendingGrantBinds++;
    try {
      await this.#serveGrantBindNow(m);
    } finally {
      this.#pendingGrantBinds--;
    }
  }

  async #serveGrantBindNow(m: GrantBindMessage): Promise<void> {
    const { requestId, token } = m;
    const refuse = (code: string, message: string): void => this.#control.send({ type: 'grant-refuse', requestId, code, message });
    if (this.#state !== 'open' && this.#state !== 'retiring') return refuse('closing', 'the connection is closing');
    const ledger = this.#owner.grantLedger;
    const hex = tokenHex(token);
    const g = ledger?.grant(hex);
    // A token that was never issued, was revoked, or comes with another number of ranges, mode or byte total: the same answer.
    if (!ledger || !g || g.count !== m.count || g.windows !== m.windows || g.bytes !== m.length || g.revoked) return refuse('unknown-grant', 'no such grant: it was never issued here or has been revoked');
    const send = (b: Binding<RdmaConnection>): void =>
      this.#control.sendFrames(encodeGrantTable(requestId, g.table(b.rkeys as Uint32Array, g.windows ? this.streams : 1)));
    const r = ledger.request(this, hex);
    if (r.kind === 'refused') return refuse(r.code, r.message);
    const b = r.binding;
    if (r.kind === 'existing') {
      await b.settled;
      if (b.state === 'bound' && b.rkeys) send(b);
      else refuse('unknown-grant', 'the grant was revoked');
      return;
    }
    if (!g.windows) {
      // memory-region mode: the MRs' own rkeys; nothing to bind.
      ledger.complete(b, g.mrRkeys);
      send(b);
      return;
    }
    const need = g.keyCount * this.streams;
    if (!this.#owner.reserveWindows(this, b, need)) {
      ledger.fail(b);
      return refuse('window-limit', `this peer's windows would exceed ${this.#owner.maxGrantWindowsPerPeer} (the grant needs ${need})`);
    }
    if (this.#bindSlots > 0) this.#bindSlots--;
    else await new Promise<void>((resolve) => this.#bindWaiters.push(resolve));
    try {
      const rkeys = await this.#bindGrantWindows(b, g);
      if (ledger.complete(b, rkeys)) send(b);
      else {
        this.#deallocWindows(b.windows);
        this.#owner.releaseWindows(this, b);
        b.finish();
        refuse('unknown-grant', 'the grant was revoked while its windows were being bound');
      }
    } catch (e) {
      this.#deallocWindows(b.windows);
      this.#owner.releaseWindows(this, b);
      ledger.fail(b);
      const err = toTensorwireError(e);
      refuse(g.revoked ? 'unknown-grant' : err instanceof ResourceExhaustedError ? 'no-windows' : 'bind-failed', err.message);
    } finally {
      const next = this.#bindWaiters.shift();
      if (next) next();
      else this.#bindSlots++;
    }
  }

  /**
   * Allocate and bind one window per key of `g` and queue pair, each over exactly its run of
   * granted ranges. One bind at a time per queue pair (one bind slot), the queue pairs in
   * parallel. Resolves with the rkeys, key-major (`rkeys[key * streams + qp]`).
   */
  async #bindGrantWindows(b: Binding<RdmaConnection>, g: RdmaGrant): Promise<Uint32Array> {
    const qps = this.#streams.length;
    const keys = g.keyCount;
    const { keyRegion, keyOffset, keyLength } = g.layout;
    const rkeys = new Uint32Array(keys * qps);
    let failure: TensorwireError | undefined;
    const access = Access.RemoteRead | Access.RemoteWrite;
    await Promise.all(
      this.#streams.map(async (s, q) => {
        for (let key = 0; key < keys && failure === undefined; key++) {
          if (this.#state !== 'open' && this.#state !== 'retiring') failure ??= new ClosedError('the connection is closing');
          else if (g.revoked || b.state !== 'binding') failure ??= new RemoteRejectedError('the grant was revoked');
          if (failure !== undefined) break;
          const reg = g.regions[keyRegion[key] as number] as RdmaRegistration;
          let wrId: number;
          let mwId: number;
          try {
            const mw = this.#device.allocMw();
            mwId = mw.id;
            this.#windowIds.set(mw.id, reg);
            reg.windows++;
            b.windows.push(mw.id);
            wrId = this.#nextWrId++;
            const r = this.#device.bindMw(s.qpId, mw.id, reg.mrId, keyOffset[key] as number, keyLength[key] as number, access, BigInt(wrId));
            if (!r.posted) {
              failure ??=
                r.errno === ENOMEM
                  ? new ResourceExhaustedError(`send queue full while binding a window: ${r.error ?? ''}`)
                  : new ConnectionBrokenError(`binding a window for ${this.peer.nodeId} failed: ${r.error ?? `errno ${r.errno}`}`);
              break;
            }
            rkeys[key * qps + q] = r.rkey;
          } catch (e) {
            failure ??= nativeError(e, 'binding a memory window');
            break;
          }
          // Completions arrive on a later turn of the event loop: registering it now is in time.
          try {
            await new Promise<void>((resolve, reject) => this.#binds.set(wrId, { mwId, resolve, reject }));
          } catch (e) {
            failure ??= toTensorwireError(e);
          }
        }
      }),
    );
    if (failure) throw failure;
    return rkeys;
  }

  /**
   * @internal The holder revoked a range grant this connection has bound: its windows go now
   * (the NIC refuses them from here on), the requester hears GRANT_UNBIND, and this resolves
   * once it answers GRANT_UNBOUND (nothing of it uses the grant any more) or the connection is
   * closed. A requester that does not answer within `grantRevokeTimeoutMs` loses the connection.
   */
  unbindGrant(b: Binding<RdmaConnection>): Promise<void> {
    this.#deallocWindows(b.windows);
    this.#owner.releaseWindows(this, b);
    if (this.#state !== 'open' && this.#state !== 'retiring') return this.#closing ?? Promise.resolve();
    const hex = b.token;
    return new Promise<void>((resolve) => {
      const waiter = (): void => {
        clearTimeout(timer);
        resolve();
      };
      const timer = setTimeout(() => {
        if (this.#grantAcks.get(hex) !== waiter) return;
        this.#grantAcks.delete(hex);
        const ms = this.#owner.grantRevokeTimeoutMs;
        void this.#shutdown(new ConnectionBrokenError(`${this.peer.nodeId} did not confirm the revocation of a grant within ${ms} ms`), undefined).then(resolve);
      }, this.#owner.grantRevokeTimeoutMs);
      timer.unref();
      this.#grantAcks.set(hex, waiter);
      this.#control.send({ type: 'grant-unbind', token: new Uint8Array(Buffer.from(hex, 'hex')) });
    });
  }

  /**
   * Graceful close. Both sides retire (a 'retire' from the peer makes this side retire too);
   * each waits for its own operations, then sends 'close' ("drained: nothing of mine is on
   * the NIC, nothing more will be posted"), and destroys its queue pairs only after the
   * peer's 'close' too, so READs and WRITEs the peer still has in flight against this side
   * are served to the end instead of failing on a destroyed queue pair.
   */
  retire(): Promise<void> {
    if (this.#retiring) return this.#retiring;
    if (this.#state !== 'open') return (this.#retiring = this.#closing ?? Promise.resolve());
    this.#state = 'retiring';
    if (!this.#peerRetiring) this.#control.send({ type: 'retire' });
    this.#retiring = (async () => {
      if (this.#ops.size > 0) await new Promise<void>((r) => (this.#idle = r));
      if (this.#state === 'retiring') {
        this.#control.send({ type: 'close' });
        if (!this.#peerClosed) {
          const timedOut = await new Promise<boolean>((resolve) => {
            const timer = setTimeout(() => resolve(true), this.#owner.retireTimeoutMs);
            timer.unref();
            this.#peerDrained = () => {
              clearTimeout(timer);
              resolve(false);
            };
          });
          this.#peerDrained = undefined;
          if (timedOut) {
            await this.#shutdown(new ConnectionBrokenError(`peer ${this.peer.nodeId} did not finish retiring the connection in time`), undefined);
            return;
          }
        }
      }
      await this.#shutdown(undefined, undefined);
    })();
    return this.#retiring;
  }

  close(error?: TensorwireError): Promise<void> {
    return this.#shutdown(error, error ?? new ClosedError(`rdma connection to ${this.peer.nodeId} closed`));
  }

  /**
   * Quiesce and release, once. `reported` goes to onClose listeners; ops that have not
   * failed yet fail with `opError` (or the right error for their state).
   */
  #shutdown(reported: TensorwireError | undefined, opError: TensorwireError | undefined): Promise<void> {
    if (this.#closing) return this.#closing;
    this.#state = 'closing';
    this.#closeError = reported;
    this.#peerDrained?.();
    const failWith = opError ?? reported ?? new ClosedError(`rdma connection to ${this.peer.nodeId} closed`);
    this.#closing = (async () => {
      for (const job of [...this.#ops]) {
        this.#failJob(
          job,
          job.signal.aborted
            ? errorFromSignal(job.signal, 'rdma transfer')
            : !job.holding
              ? new SessionInvalidatedError(`rdma connection to ${this.peer.nodeId} closed before the transfer started: ${failWith.message}`, { cause: failWith })
              : failWith,
        );
      }
      for (const s of this.#streams) {
        for (const job of s.queue) job.queued = false;
        s.queue = [];
        if (s.retry !== undefined) clearTimeout(s.retry);
        s.retry = undefined;
      }
      this.#keys.failAll(failWith);
      this.#tables.failAll(failWith);
      // Bindings this connection had are gone with it; their windows are deallocated below.
      this.#owner.windowLedger?.dropConnection(this);
      for (const b of this.#owner.grantLedger?.dropConnection(this) ?? []) this.#owner.releaseWindows(this, b);
      if (this.outstanding > 0) {
        // Invariant 6: move every QP to ERR and wait until each outstanding WR has flushed.
        for (const s of this.#streams) {
          try {
            this.#device.qpError(s.qpId);
          } catch {
            // already in error or device gone; destroying the QP below still stops DMA
          }
        }
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, this.#owner.quiesceTimeoutMs);
          this.#drained = () => {
            clearTimeout(timer);
            resolve();
          };
          if (this.outstanding === 0) this.#drained();
        });
        if (this.outstanding > 0) {
          this.#owner.logger.warn('rdma: flushes did not all arrive; destroying the queue pairs stops DMA', { peer: this.peer.nodeId, outstanding: this.outstanding });
        }
      }
      // Windows bound to these QPs go before the QPs; one whose bind is still on the NIC (the
      // flush did not come) goes after, when destroying its QP has ended the bind.
      const binding = new Set([...this.#binds.values()].map((w) => w.mwId));
      this.#deallocWindows([...this.#windowIds.keys()].filter((id) => !binding.has(id)));
      // Destroying the QPs guarantees the NIC no longer touches any buffer they referenced.
      for (const s of this.#streams) {
        try {
          this.#device.destroyQp(s.qpId);
        } catch (e) {
          this.#owner.logger.warn('rdma: ibv_destroy_qp failed', { error: String(e) });
        }
      }
      const closed = new ConnectionBrokenError(`rdma connection to ${this.peer.nodeId} closed before the window bind completed`);
      for (const w of this.#binds.values()) w.reject(closed);
      this.#binds.clear();
      this.#deallocWindows([...this.#windowIds.keys()]);
      // The QPs are gone: so are their chains (flushed or not).
      for (const c of this.#chains.values()) {
        c.job.chains--;
        c.job.error ??= failWith;
      }
      this.#chains.clear();
      for (const s of this.#streams) {
        s.used = 0;
        s.fragments = [];
      }
      this.#owner.releaseCq(this.#cqId, this);
      this.#control.send({ type: 'close' });
      this.#control.end();
      setTimeout(() => this.#control.socket.destroy(), 1_000).unref();
      for (const job of [...this.#ops]) this.#maybeSettle(job);
      this.#state = 'closed';
      this.#owner.forget(this);
      // The QPs are destroyed: nothing of the peer's reaches memory through this connection any
      // more, so revokes waiting for its GRANT_UNBOUND are done.
      for (const done of [...this.#grantAcks.values()]) done();
      this.#grantAcks.clear();
      for (const l of this.#closeListeners.splice(0)) {
        try {
          l(reported);
        } catch {
          // a listener's failure is its own
        }
      }
    })();
    return this.#closing;
  }
}

interface LocalPort {
  readonly port: number;
  readonly linkLayer: number;
  readonly lid: number;
  readonly gid: string;
  readonly gidIndex: number;
  readonly activeMtu: number;
}

// -------------------------------------------------------------------------------------

export class RdmaTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name = 'rdma';
  readonly capabilities: TransportCapabilities;
  readonly queuePairsPerPeer: number;
  readonly quiesceTimeoutMs: number;
  readonly retireTimeoutMs: number;
  logger: Logger;
  readonly #options: RdmaTransportOptions;
  #host: TransportHost | undefined;
  #native: NativeAddon | undefined;
  #device: NativeDevice | undefined;
  #record: DeviceRecord | undefined;
  #caps: RdmaCapabilities | undefined;
  #local: LocalPort | undefined;
  #server: Server | undefined;
  #endpoint: Uint8Array | undefined;
  #maxSendWr = 128;
  /** SGEs per work request (READ, WRITE), decided at start. */
  #sge = { read: 1, write: 1 };
  #grantMode: 'memory-window' | 'memory-region' | undefined;
  #ledger: WindowLedger<RdmaConnection, RdmaRegistration> | undefined;
  /** Range grants that peers may bind (by token), and their bindings per connection. */
  #grantLedger: WindowLedger<RdmaConnection, RdmaGrant> | undefined;
  readonly #rangeGrants = new Set<RdmaGrant>();
  /** Windows bound for range grants, per peer (all its connections). */
  readonly #grantWindows = new Map<string, number>();
  /** Checked batches (a batch is immutable; see Checked). */
  readonly #checked = new WeakMap<TransferBatch, Checked>();
  readonly maxGrantWindowsPerPeer: number;
  readonly grantRevokeTimeoutMs: number;
  /** The control channel's bounds (options.limits over DEFAULT_CONTROL_LIMITS). */
  readonly limits: RdmaControlLimits;
  /** Where peer events are counted in prom-client ({@link RdmaTransportOptions.metrics}); undefined when off. */
  readonly metrics: kit.KitMetrics | undefined;
  /** Connections dropped over a bound, and handshakes refused: counted, logged at most once a second per kind. */
  readonly #peerDisconnects: kit.PeerEvents<BoundReason>;
  readonly #handshakeRefusals: kit.PeerEvents<string>;
  /** GRANT_BINDs this transport has sent, over all its connections (one per range grant and connection; for tests and diagnostics). */
  grantBindsSent = 0;
  readonly #registrations = new Set<RdmaRegistration>();
  readonly #connections = new Map<string, Set<RdmaConnection>>(); // by peer identity
  readonly #cqRoutes = new Map<number, RdmaConnection>();
  readonly #handshakes = new Set<Socket>();
  #closing: Promise<void> | undefined;
  #starting: Promise<void> | undefined;

  constructor(options: RdmaTransportOptions = {}) {
    this.#options = options;
    this.logger = options.logger ?? silentLogger;
    this.metrics = kit.kitMetrics(options.metrics);
    const counter = this.metrics?.peerEvents;
    this.#peerDisconnects = new kit.PeerEvents<BoundReason>({ transport: this.name, counter, texts: (reason) => ({ level: 'warn', text: `rdma peer disconnected: ${reason}` }) });
    // `busy` is backpressure (the peer retries); the other refusals say something is wrong.
    this.#handshakeRefusals = new kit.PeerEvents<string>({ transport: this.name, counter, texts: (code) => ({ level: code === 'busy' ? 'info' : 'warn', text: `rdma handshake refused: ${code}` }) });
    const qps = options.queuePairsPerPeer ?? 2;
    if (!Number.isInteger(qps) || qps < 1 || qps > MAX_QPS_PER_PEER) {
      throw new InvalidInputError(`queuePairsPerPeer must be 1..${MAX_QPS_PER_PEER}`, { details: { field: 'queuePairsPerPeer' } });
    }
    this.queuePairsPerPeer = qps;
    const grants = options.grants ?? 'auto';
    if (grants !== 'auto' && grants !== 'memory-window' && grants !== 'memory-region') {
      throw new InvalidInputError(`grants must be auto, memory-window or memory-region, not ${JSON.stringify(grants)}`, { details: { field: 'grants' } });
    }
    const limit = options.maxWindowGrantsPerPeer ?? 1024;
    if (!Number.isInteger(limit) || limit < 1) {
      throw new InvalidInputError('maxWindowGrantsPerPeer must be a positive integer', { details: { field: 'maxWindowGrantsPerPeer' } });
    }
    const windows = options.maxGrantWindowsPerPeer ?? 65_536;
    if (!Number.isInteger(windows) || windows < 1) {
      throw new InvalidInputError('maxGrantWindowsPerPeer must be a positive integer', { details: { field: 'maxGrantWindowsPerPeer' } });
    }
    this.maxGrantWindowsPerPeer = windows;
    const revokeMs = options.grantRevokeTimeoutMs ?? 10_000;
    if (!(revokeMs >= 0)) throw new InvalidInputError('grantRevokeTimeoutMs must be >= 0', { details: { field: 'grantRevokeTimeoutMs' } });
    this.grantRevokeTimeoutMs = revokeMs;
    this.limits = controlLimits(options.limits);
    this.quiesceTimeoutMs = options.quiesceTimeoutMs ?? 10_000;
    this.retireTimeoutMs = options.retireTimeoutMs ?? 30_000;
    const load = options.backend ? { addon: options.backend.native } : tryLoadNative();
    const dmabuf = 'addon' in load && options.cudaDmabuf !== undefined && load.addon.probe().dmabuf;
    const kinds: MemoryKind[] = dmabuf ? ['host', 'cuda'] : ['host'];
    this.capabilities = {
      local: true,
      remote: true,
      memoryKinds: kinds,
      oneSidedRead: true,
      oneSidedWrite: true,
      scopedGrants: true,
      rank: options.rank ?? 100,
      maxStreams: qps,
      maxChunkBytes: Math.min(options.maxChunkBytes ?? 64 * 1024 * 1024, MAX_WR_BYTES),
    };
  }

  /**
   * How this transport grants remote access, decided at start (undefined before):
   * `memory-window` (type-2 windows bound per connection) or `memory-region` (whole-MR rkeys).
   */
  get grantMode(): 'memory-window' | 'memory-region' | undefined {
    return this.#grantMode;
  }

  /** @internal The holder's window table (memory-window mode only). */
  get windowLedger(): WindowLedger<RdmaConnection, RdmaRegistration> | undefined {
    return this.#ledger;
  }

  /** @internal The holder's table of range grants and their bindings (both modes, after start). */
  get grantLedger(): WindowLedger<RdmaConnection, RdmaGrant> | undefined {
    return this.#grantLedger;
  }

  /** Live range grants (holder side; for tests and diagnostics). */
  get liveGrants(): number {
    return this.#rangeGrants.size;
  }

  /** @internal Count `n` windows of binding `b` against its peer's budget; false when they do not fit. */
  reserveWindows(conn: RdmaConnection, b: Binding<RdmaConnection>, n: number): boolean {
    const peer = `${conn.peer.nodeId}/${conn.peer.incarnation}`;
    const used = this.#grantWindows.get(peer) ?? 0;
    if (used + n > this.maxGrantWindowsPerPeer) return false;
    this.#grantWindows.set(peer, used + n);
    b.reserved = n;
    return true;
  }

  /** @internal Give back what `b` reserved (idempotent). */
  releaseWindows(conn: RdmaConnection, b: Binding<RdmaConnection>): void {
    if (b.reserved === 0) return;
    const peer = `${conn.peer.nodeId}/${conn.peer.incarnation}`;
    const left = (this.#grantWindows.get(peer) ?? b.reserved) - b.reserved;
    b.reserved = 0;
    if (left > 0) this.#grantWindows.set(peer, left);
    else this.#grantWindows.delete(peer);
  }

  /** Windows the range grants of `peer` hold (holder side; for tests and diagnostics). */
  grantWindowsOf(peer: NodeIdentity): number {
    return this.#grantWindows.get(`${peer.nodeId}/${peer.incarnation}`) ?? 0;
  }

  /**
   * Connections dropped because a peer went past a bound of the control channel, by reason
   * ({@link BoundReason}); each is also logged (warn, at most once a second per reason, with
   * the number left out since the last line) with the peer and the numbers, and counted in
   * {@link metrics}.
   */
  get peerDisconnects(): Readonly<Record<string, number>> {
    return this.#peerDisconnects.counts();
  }

  /**
   * Inbound handshakes refused, by the code sent to the peer (`busy`, `too-many-connections`,
   * `bad-lid`, …); each is also logged (`busy` at info, the others warn; at most once a second
   * per code) and counted in {@link metrics}.
   */
  get handshakeRefusals(): Readonly<Record<string, number>> {
    return this.#handshakeRefusals.counts();
  }

  /** @internal A peer went past a bound: log it and count it. */
  overBound(peer: NodeIdentity | undefined, reason: BoundReason, message: string): void {
    this.#peerDisconnects.record(reason, peer === undefined ? undefined : `${peer.nodeId}/${peer.incarnation}`, message, this.logger);
  }

  /** @internal Completion routes (CQ id → connection) this transport holds (for tests and diagnostics). */
  get routes(): number {
    return this.#cqRoutes.size;
  }

  /** What discovery found when the transport started (undefined before start). */
  get discovery(): RdmaCapabilities | undefined {
    return this.#caps;
  }

  start(host: TransportHost): Promise<void> {
    this.#starting ??= this.#start(host);
    return this.#starting;
  }

  async #start(host: TransportHost): Promise<void> {
    if (this.#closing) throw new ClosedError('rdma transport is closed');
    this.#host = host;
    if (this.#options.logger === undefined) this.logger = host.logger;
    const caps =
      this.#options.backend?.capabilities ??
      probeCapabilities({
        ...(this.#options.device !== undefined ? { device: this.#options.device } : {}),
        ...(this.#options.port !== undefined ? { port: this.#options.port } : {}),
        ...(this.#options.gidIndex !== undefined ? { gidIndex: this.#options.gidIndex } : {}),
      });
    this.#caps = caps;
    const sel = caps.selected;
    if (!caps.available || sel === undefined) throw new BackendUnavailableError(`rdma is unavailable: ${caps.reason ?? 'no usable device'}`);
    const record = caps.devices.find((d) => d.name === sel.device) as DeviceRecord;
    const port = record.ports.find((p) => p.port === sel.port);
    if (!port) throw new BackendUnavailableError(`rdma: port ${sel.port} vanished from ${sel.device}`);
    this.#record = record;
    const mode = grantMode(this.#options.grants ?? 'auto', record.memoryWindowType2);
    if ('error' in mode) throw new BackendUnavailableError(`rdma on ${sel.device}: ${mode.error}`);
    this.#grantMode = mode.mode;
    if (mode.mode === 'memory-window') {
      this.#ledger = new WindowLedger<RdmaConnection, RdmaRegistration>(this.#options.maxWindowGrantsPerPeer ?? 1024, (c) => `${c.peer.nodeId}/${c.peer.incarnation}`);
    }
    this.#grantLedger = new WindowLedger<RdmaConnection, RdmaGrant>(this.#options.maxWindowGrantsPerPeer ?? 1024, (c) => `${c.peer.nodeId}/${c.peer.incarnation}`);
    if (caps.fork !== undefined && (caps.fork.status === 'failed' || caps.fork.status === 'disabled')) {
      this.logger.warn('rdma: libibverbs fork support is off: a fork() while memory is registered can corrupt it (see README "Fork safety")', {
        status: caps.fork.status,
        reason: caps.fork.error,
      });
    }
    this.#native = this.#options.backend?.native ?? loadNative();
    try {
      this.#device = new this.#native.Device(sel.device, (t) => this.#onCompletions(t));
    } catch (e) {
      throw nativeError(e, `open ${sel.device}`);
    }
    // BIND_SLOTS more are asked for at QP creation, for window binds.
    this.#maxSendWr = Math.max(1, Math.min(this.#options.maxSendWr ?? 128, (record.maxQpWr || 128 + BIND_SLOTS) - BIND_SLOTS));
    const sgeCap = this.#options.maxSge ?? MAX_SGE;
    if (!Number.isInteger(sgeCap) || sgeCap < 1) throw new InvalidInputError('maxSge must be a positive integer', { details: { field: 'maxSge' } });
    this.#sge = chooseSgeLimits(record.maxSge, record.maxSgeRd, Math.min(sgeCap, MAX_SGE));
    this.#local = { port: port.port, linkLayer: port.linkLayer, lid: port.lid, gid: sel.gid, gidIndex: sel.gidIndex, activeMtu: port.activeMtu };
    const server = createServer((socket) => this.#accept(socket));
    this.#server = server;
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(this.#options.listenPort ?? 0, this.#options.listenHost ?? '0.0.0.0', () => {
        server.off('error', reject);
        resolve();
      });
    });
    server.unref();
    const addr = server.address();
    const tcpPort = typeof addr === 'object' && addr !== null ? addr.port : 0;
    this.#endpoint = encodeEndpoint({
      host: this.#advertiseHost(sel.gid),
      port: tcpPort,
      device: sel.device,
      linkLayer: port.linkLayer === 2 ? 2 : 1,
      lid: port.lid,
      gid: sel.gid,
      activeMtu: port.activeMtu,
    });
    this.logger.info('rdma transport started', {
      device: sel.device,
      port: sel.port,
      gidIndex: sel.gidIndex,
      linkLayer: sel.linkLayer,
      numaNode: sel.numaNode,
      grants: mode.mode,
      grantsWhy: mode.reason,
    });
  }

  #advertiseHost(gid: string): string {
    if (this.#options.advertiseHost) return this.#options.advertiseHost;
    const listen = this.#options.listenHost;
    if (listen && listen !== '0.0.0.0' && listen !== '::') return listen;
    if (isIpv4MappedGid(gid)) {
      const b = Buffer.from(gid.slice(24), 'hex');
      return `${b[0]}.${b[1]}.${b[2]}.${b[3]}`;
    }
    for (const list of Object.values(networkInterfaces())) {
      for (const a of list ?? []) if (a.family === 'IPv4' && !a.internal) return a.address;
    }
    return '127.0.0.1';
  }

  #requireStarted(): { device: NativeDevice; native: NativeAddon; host: TransportHost; local: LocalPort } {
    if (this.#closing) throw new ClosedError('rdma transport is closed');
    if (!this.#device || !this.#native || !this.#host || !this.#local) throw new ClosedError('rdma transport is not started');
    return { device: this.#device, native: this.#native, host: this.#host, local: this.#local };
  }

  endpoint(): Uint8Array {
    if (!this.#endpoint) throw new ClosedError('rdma transport is not started');
    return this.#endpoint;
  }

  unreachableReason(_peer: NodeIdentity, endpoint: Uint8Array): string | undefined {
    let ep: RdmaEndpoint;
    try {
      ep = decodeEndpoint(endpoint);
    } catch (e) {
      return `malformed rdma endpoint: ${e instanceof Error ? e.message : String(e)}`;
    }
    if (!this.#local) return 'rdma transport is not started';
    if ((ep.linkLayer === 2) !== (this.#local.linkLayer === 2)) {
      return `link layers differ: this node is ${linkLayerName(this.#local.linkLayer)}, the peer is ${linkLayerName(ep.linkLayer)}`;
    }
    const lid = lidProblem(ep.linkLayer, ep.lid);
    if (lid !== undefined) return `peer port: ${lid}`;
    return undefined;
  }

  async register(memory: Memory): Promise<TransportRegistration> {
    const { device } = this.#requireStarted();
    let reg: RdmaRegistration;
    if (memory.kind === 'host') {
      if (!(memory.buffer instanceof Uint8Array) || memory.buffer.byteLength === 0) {
        throw new InvalidInputError('host memory must be a non-empty Uint8Array', { details: { field: 'buffer' } });
      }
      try {
        const mr = device.regHost(memory.buffer, this.#mrAccess());
        reg = new RdmaRegistration(this, mr.id, mr.length, mr.addr, mr.rkey);
      } catch (e) {
        throw nativeError(e, 'ibv_reg_mr');
      }
    } else if (memory.kind === 'cuda') {
      if (!this.capabilities.memoryKinds.includes('cuda') || !this.#options.cudaDmabuf) {
        throw new InvalidInputError('cuda memory needs ibv_reg_dmabuf_mr and a cudaDmabuf exporter (RdmaTransportOptions.cudaDmabuf)', {
          details: { field: 'kind' },
        });
      }
      const exp = this.#options.cudaDmabuf(memory);
      try {
        const mr = device.regDmabuf(exp.fd, exp.offset, memory.byteLength, memory.pointer, this.#mrAccess());
        reg = new RdmaRegistration(this, mr.id, mr.length, mr.addr, mr.rkey, exp.release?.bind(exp));
      } catch (e) {
        exp.release?.();
        throw nativeError(e, 'ibv_reg_dmabuf_mr');
      }
    } else {
      throw new InvalidInputError(`unsupported memory kind ${JSON.stringify((memory as { kind: unknown }).kind)}`, { details: { field: 'kind' } });
    }
    this.#registrations.add(reg);
    if (this.#ledger) {
      const token = new Uint8Array(randomBytes(GRANT_TOKEN_BYTES));
      reg.token = token;
      reg.tokenHex = tokenHex(token);
      this.#ledger.addGrant(reg.tokenHex, reg);
      return { handle: reg, payload: encodeGrant({ grant: 'window', addr: reg.addr, length: reg.length, token }) };
    }
    return { handle: reg, payload: encodeGrant({ grant: 'mr', addr: reg.addr, length: reg.length, rkey: reg.rkey }) };
  }

  /**
   * MR access flags. In memory-window mode the MR itself has no remote access (its rkey opens
   * nothing); windows bound on it carry the remote rights.
   */
  #mrAccess(): number {
    return this.#grantMode === 'memory-window' ? Access.LocalWrite | Access.MwBind : ACCESS;
  }

  /** QP access flags: remote READ/WRITE (through the MR or a window), and window binds. */
  #qpAccess(): number {
    return this.#grantMode === 'memory-window' ? ACCESS | Access.MwBind : ACCESS;
  }

  async revoke(handle: object): Promise<void> {
    if (!(handle instanceof RdmaRegistration) || handle.owner !== this) {
      throw new InvalidInputError('not a registration of this rdma transport', { details: { field: 'handle' } });
    }
    if (handle.revoked) return;
    handle.revoked = true;
    // Range grants over it go first (the engine revokes them before, too): nothing may reach
    // it through them after.
    if (handle.grants.size > 0) await Promise.all([...handle.grants].map((g) => this.revokeGrant(g)));
    if (this.#ledger && handle.tokenHex !== undefined) {
      // No new windows for it; deallocate the bound ones (remote access fails from here on,
      // and each requester hears UNBIND); wait for binds still on the NIC to settle.
      const pending: Promise<void>[] = [];
      for (const b of this.#ledger.revokeGrant(handle.tokenHex)) {
        if (b.state === 'bound') b.conn.releaseBinding(b);
        else pending.push(b.settled);
      }
      await Promise.all(pending);
      // Windows of connections that are closing are deallocated after their quiesce; the
      // MR cannot be deregistered while any is bound over it.
      if (handle.windows > 0) await new Promise<void>((r) => handle.windowsGone.push(r));
    }
    // Nothing new is posted for it (queued work fails); wait for what is on the NIC.
    if (handle.posted > 0) await new Promise<void>((r) => handle.idle.push(r));
    this.#deregister(handle);
  }

  #deregister(reg: RdmaRegistration): void {
    if (!this.#registrations.has(reg)) return;
    // Deregistering invalidates the rkey: remote access fails from here on. If it fails the
    // registration stays listed (close() tries again) and its memory is not released.
    this.#device?.deregMr(reg.mrId);
    this.#registrations.delete(reg);
    reg.release?.();
  }

  /**
   * Grant access to ranges of registrations (register once, grant per lease): one 128-bit
   * token over all of them. The payload is the token, the count and the mode (34 bytes,
   * whatever the number of ranges); a requester gets the ranges' addresses and keys with one
   * GRANT_BIND per connection. Memory-window mode: the requester's connection gets one type-2
   * window per run of touching ranges and queue pair, over exactly those bytes. Memory-region
   * mode: the MRs' own rkeys, and the requester checks offsets against the range lengths (the
   * NIC would not stop a requester that skips the check). Refused with ResourceExhaustedError
   * when its windows alone exceed `maxGrantWindowsPerPeer`.
   */
  grant(ranges: GrantRanges): TransportRegistration {
    this.#requireStarted();
    const { handles, count, ranges: list } = ranges;
    if (!Number.isSafeInteger(count) || count < 1 || count > MAX_RANGE_GRANT_RANGES || !(list instanceof Float64Array) || list.length < count * GRANT_STRIDE) {
      throw new InvalidInputError(`a range grant covers 1 to ${MAX_RANGE_GRANT_RANGES} ranges in a Float64Array of ${GRANT_STRIDE} numbers each`, { details: { field: 'ranges' } });
    }
    const regs: RdmaRegistration[] = [];
    for (const h of handles) {
      if (!(h instanceof RdmaRegistration) || h.owner !== this) throw new InvalidInputError('not a registration of this rdma transport', { details: { field: 'handles' } });
      if (h.revoked) throw new InvalidInputError('a registration of this grant was revoked', { details: { field: 'handles' } });
      regs.push(h);
    }
    let bytes = 0;
    for (let k = 0, at = 0; k < count; k++, at += GRANT_STRIDE) {
      const reg = regs[list[at + GrantField.Handle] as number];
      const off = list[at + GrantField.Offset] as number;
      const len = list[at + GrantField.Length] as number;
      if (reg === undefined || !Number.isSafeInteger(off) || off < 0 || !Number.isSafeInteger(len) || len < 1 || off + len > reg.length) {
        throw new InvalidInputError(`range ${k} is empty or outside its registration`, { details: { field: 'ranges', range: k } });
      }
      bytes += len;
    }
    const windows = this.#grantMode === 'memory-window';
    const layout = layoutGrant(list, count, GRANT_STRIDE, GrantField, (h: number) => (regs[h] as RdmaRegistration).length, windows);
    const need = layout.keyRegion.length * this.queuePairsPerPeer;
    if (windows && need > this.maxGrantWindowsPerPeer) {
      throw new ResourceExhaustedError(`these ranges need ${need} memory windows per requester (${layout.keyRegion.length} runs × ${this.queuePairsPerPeer} queue pairs), more than maxGrantWindowsPerPeer (${this.maxGrantWindowsPerPeer})`);
    }
    const token = new Uint8Array(randomBytes(GRANT_TOKEN_BYTES));
    const regions = Array.from(layout.regionHandle, (h) => regs[h] as RdmaRegistration);
    const g = new RdmaGrant(this, token, count, bytes, windows, regions, layout);
    (this.#grantLedger as WindowLedger<RdmaConnection, RdmaGrant>).addGrant(g.tokenHex, g);
    this.#rangeGrants.add(g);
    for (const reg of regions) reg.grants.add(g);
    return { handle: g, payload: encodeGrant({ grant: 'ranges', length: bytes, windows, count, token }) };
  }

  /**
   * Revoke a range grant, once (later calls return the same promise): no new GRANT_BIND
   * succeeds; on every connection that has its table the windows are deallocated (the NIC
   * refuses them from then on) and the requester hears GRANT_UNBIND, after which its queued work
   * under the grant fails as `grant-revoked` without reaching the NIC. Resolves once each such
   * requester has confirmed that nothing it posted under the grant is still on the NIC
   * (GRANT_UNBOUND), or its connection is closed (after `grantRevokeTimeoutMs` at most). O(1) in
   * the number of ranges in memory-region mode; one ibv_dealloc_mw per window otherwise. The
   * registrations stay registered.
   */
  revokeGrant(handle: object): Promise<void> {
    if (!(handle instanceof RdmaGrant) || handle.owner !== this) {
      return Promise.reject(new InvalidInputError('not a grant of this rdma transport', { details: { field: 'handle' } }));
    }
    handle.revoking ??= this.#revokeGrant(handle);
    return handle.revoking;
  }

  async #revokeGrant(g: RdmaGrant): Promise<void> {
    g.revoked = true;
    this.#rangeGrants.delete(g);
    for (const reg of g.regions) reg.grants.delete(g);
    const waits: Promise<void>[] = [];
    for (const b of this.#grantLedger?.revokeGrant(g.tokenHex) ?? []) {
      // Bound: unbind it on its connection. Still binding: its binder deallocates and refuses.
      waits.push(b.state === 'bound' ? b.conn.unbindGrant(b) : b.settled);
    }
    await Promise.all(waits);
  }

  /** @internal A batch checked once (see Checked). */
  check(batch: TransferBatch): Checked {
    let c = this.#checked.get(batch);
    if (c === undefined) {
      c = checkBatch(batch, this, this.capabilities.maxChunkBytes);
      this.#checked.set(batch, c);
    }
    return c;
  }

  /** @internal The layout of a checked batch with these keys: the last one while its range tables are the same. */
  layout(c: Checked, keys: readonly Keys[]): Plan {
    const last = c.plan;
    if (last !== undefined) {
      let same = true;
      for (let m = 0; m < c.kinds.length && same; m++) if (c.kinds[m] === KIND_RANGES && last.tables[m] !== keys[m]) same = false;
      if (same) return last;
    }
    const p = layoutPlan(c, keys, this.#sge, this.capabilities.maxChunkBytes);
    c.plan = p;
    return p;
  }

  /** SGEs per work request this transport uses, READ and WRITE (after start). */
  get sgeLimits(): { readonly read: number; readonly write: number } {
    return this.#sge;
  }

  /**
   * Decode a peer's descriptor payload. A registration's length must be the envelope's
   * `byteLength`, and a range grant's range count the number of `rangeLengths` (refused with
   * InvalidInputError otherwise). A range grant's byte total is not compared with the
   * envelope's, which may be forged longer while the payload is genuine (and must still reach
   * what was granted): it is presented, with the token, count and mode, in GRANT_BIND, and the
   * holder refuses any that is not the grant's, so no payload byte goes unchecked. For a range
   * grant, `rangeLengths` are what transfers are checked against first; they are not trusted:
   * every transfer is checked again against the lengths the holder itself sends with the
   * grant's table, so a descriptor forged to claim longer (or more) ranges reaches nothing
   * outside the granted ones, and still reaches what was granted.
   */
  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths?: Float64Array): unknown {
    if (!this.capabilities.memoryKinds.includes(memoryKind) && memoryKind !== 'cuda' && memoryKind !== 'host') {
      throw new InvalidInputError(`memory kind ${String(memoryKind)} is not supported`, { details: { field: 'memoryKind' } });
    }
    const g = decodeGrant(payload);
    if (g.grant !== 'ranges') {
      if (byteLength !== g.length) {
        throw new InvalidInputError(`rdma descriptor: registration covers ${g.length} bytes but the descriptor claims ${byteLength}`, { details: { field: 'length' } });
      }
      if (rangeLengths !== undefined && !(rangeLengths.length === 1 && rangeLengths[0] === g.length)) {
        throw new InvalidInputError('a registration descriptor names ranges, but its payload is not a range grant', { details: { field: 'rangeLengths' } });
      }
      return new RemoteRegion(g);
    }
    if (!(rangeLengths instanceof Float64Array) || rangeLengths.length === 0) {
      throw new InvalidInputError(`a range grant of ${g.count} ranges needs their lengths`, { details: { field: 'rangeLengths' } });
    }
    if (rangeLengths.length !== g.count) {
      throw new InvalidInputError(`rdma descriptor: the payload grants ${g.count} ranges but the descriptor names ${rangeLengths.length}`, { details: { field: 'count' } });
    }
    for (let k = 0; k < rangeLengths.length; k++) {
      const len = rangeLengths[k] as number;
      if (!Number.isSafeInteger(len) || len < 1) throw new InvalidInputError(`range ${k} has length ${len}`, { details: { field: 'rangeLengths' } });
    }
    return new RemoteRanges(g, Float64Array.from(rangeLengths));
  }

  #setup(q: Queues): QpSetup {
    const { host, local } = this.#requireStarted();
    const rec = this.#record as DeviceRecord;
    return {
      identity: host.identity,
      linkLayer: local.linkLayer === 2 ? 2 : 1,
      lid: local.lid,
      gid: local.gid,
      activeMtu: local.activeMtu,
      initiatorDepth: Math.max(1, Math.min(16, rec.maxQpInitRdAtom)),
      responderResources: Math.max(1, Math.min(16, rec.maxQpRdAtom)),
      qps: q.qps.map((x) => ({ qpn: x.qpn, psn: x.psn })),
    };
  }

  /** Create a CQ and `count` RC QPs in INIT. Cleans up after itself on failure. */
  #createQueues(count: number): Queues {
    const { device, local } = this.#requireStarted();
    let cqId = 0;
    const qps: Queues['qps'] = [];
    try {
      cqId = device.createCq(count * (this.#maxSendWr + BIND_SLOTS) + 16);
      for (let i = 0; i < count; i++) {
        const qp = device.createQp(cqId, this.#maxSendWr + BIND_SLOTS, this.#sge.write);
        // Data work requests get what the QP holds less the bind slots.
        const room = Math.max(1, Math.min(qp.maxSendWr - BIND_SLOTS, this.#maxSendWr));
        qps.push({ id: qp.id, qpn: qp.qpn, maxSendWr: room, psn: randomInt(0, 0x1000000) });
        device.qpInit(qp.id, local.port, this.#qpAccess());
      }
      return { cqId, qps };
    } catch (e) {
      this.#destroyQueues({ cqId, qps });
      throw nativeError(e, 'creating queue pairs');
    }
  }

  #destroyQueues(q: Queues): void {
    const device = this.#device;
    if (!device) return;
    for (const qp of q.qps) {
      try {
        device.destroyQp(qp.id);
      } catch {
        // best effort on a failed handshake
      }
    }
    if (q.cqId !== 0) {
      this.#cqRoutes.delete(q.cqId);
      try {
        device.destroyCq(q.cqId);
      } catch {
        // best effort
      }
    }
  }

  /** Take every QP through RTR and RTS against the peer's setup. */
  #connectQueues(q: Queues, remote: QpSetup): void {
    const { device, local } = this.#requireStarted();
    const rec = this.#record as DeviceRecord;
    const mtu = chooseMtu(local.activeMtu, remote.activeMtu);
    const av = addressVector({
      linkLayer: local.linkLayer,
      localPort: local.port,
      localGidIndex: local.gidIndex,
      localGid: local.gid,
      remoteLid: remote.lid,
      remoteGid: remote.gid,
      ...(this.#options.trafficClass !== undefined ? { trafficClass: this.#options.trafficClass } : {}),
      ...(this.#options.serviceLevel !== undefined ? { serviceLevel: this.#options.serviceLevel } : {}),
    });
    const initiatorDepth = chooseRdAtomic(Math.min(16, rec.maxQpInitRdAtom), remote.responderResources);
    const responder = chooseRdAtomic(remote.initiatorDepth, Math.min(16, rec.maxQpRdAtom));
    q.qps.forEach((qp, i) => {
      const r = remote.qps[i] as { qpn: number; psn: number };
      try {
        device.qpRtr(qp.id, {
          destQpn: r.qpn,
          rqPsn: r.psn,
          dlid: av.dlid,
          mtu,
          port: av.port,
          sl: av.sl,
          maxDestRdAtomic: responder,
          minRnrTimer: 12,
          isGlobal: av.isGlobal,
          dgid: av.dgid,
          sgidIndex: av.sgidIndex,
          hopLimit: av.hopLimit,
          trafficClass: av.trafficClass,
        });
        device.qpRts(qp.id, { sqPsn: qp.psn, timeout: 14, retryCnt: 7, rnrRetry: 7, maxRdAtomic: initiatorDepth });
      } catch (e) {
        throw nativeError(e, `bringing queue pair ${i} to RTS`);
      }
    });
  }

  #checkRemoteSetup(remote: QpSetup, expectedQps: number): TensorwireError | undefined {
    const local = this.#local;
    if (!local) return new ClosedError('rdma transport is not started');
    const qp = qpCountProblem(expectedQps, remote.qps.length, MAX_QPS_PER_PEER);
    if (qp !== undefined) return new InvalidInputError(qp, { details: { field: 'qpCount', remoteCode: 'qp-count-mismatch' } });
    if ((remote.linkLayer === 2) !== (local.linkLayer === 2)) {
      return new InvalidInputError(`link layers differ: ${linkLayerName(local.linkLayer)} here, ${linkLayerName(remote.linkLayer)} at the peer`, {
        details: { field: 'linkLayer', remoteCode: 'link-layer-mismatch' },
      });
    }
    const lid = lidProblem(remote.linkLayer, remote.lid);
    if (lid !== undefined) return new InvalidInputError(`peer port: ${lid}`, { details: { field: 'lid', remoteCode: 'bad-lid' } });
    return undefined;
  }

  async connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    const { device, native, host } = this.#requireStarted();
    const ep = decodeEndpoint(endpoint);
    const unreachable = this.unreachableReason(peer, endpoint);
    if (unreachable !== undefined) throw new InvalidInputError(`cannot reach ${peer.nodeId} over rdma: ${unreachable}`);
    // Queue pairs per peer is this transport's setting, and the acceptor insists on its own
    // count: opening fewer because the engine asked for fewer streams would be refused by
    // every peer. The engine round-robins over `conn.streams`, so more streams are harmless.
    const streams = this.queuePairsPerPeer;
    if (options.signal.aborted) throw errorFromSignal(options.signal, `rdma connect to ${peer.nodeId}`);
    const socket = createConnection({ host: ep.host, port: ep.port });
    const control = new Control(socket, this.limits, (reason, message) => this.overBound(peer, reason, message));
    this.#handshakes.add(socket);
    let q: Queues | undefined;
    try {
      await new Promise<void>((resolve, reject) => {
        const onAbort = (): void => reject(errorFromSignal(options.signal, `rdma connect to ${peer.nodeId}`));
        const timer = setTimeout(() => reject(new TimedOutError(`rdma connect to ${peer.nodeId} timed out`)), Math.max(0, options.deadline - Date.now()));
        options.signal.addEventListener('abort', onAbort, { once: true });
        const done = (): void => {
          clearTimeout(timer);
          options.signal.removeEventListener('abort', onAbort);
        };
        socket.once('connect', () => {
          done();
          resolve();
        });
        socket.once('error', (e) => {
          done();
          reject(new ConnectionBrokenError(`rdma control connection to ${ep.host}:${ep.port} failed: ${e.message}`, { cause: e }));
        });
      });
      q = this.#createQueues(streams);
      control.send({ type: 'hello', setup: this.#setup(q), target: { nodeId: peer.nodeId, incarnation: peer.incarnation } });
      const reply = await control.next(options.signal, options.deadline, `rdma handshake with ${peer.nodeId}`);
      if (reply.type === 'reject') {
        const message = `${peer.nodeId} rejected the rdma connection: ${reply.message}`;
        // 'busy' is backpressure (too many handshakes at the peer right now): try again later.
        if (reply.code === 'busy') throw new ResourceExhaustedError(message, { details: { remoteCode: reply.code } });
        throw new RemoteRejectedError(message, { details: { remoteCode: reply.code } });
      }
      if (reply.type !== 'accept') throw new ConnectionBrokenError(`rdma handshake: expected accept, got ${reply.type}`);
      const remote = reply.setup;
      if (remote.identity.nodeId !== peer.nodeId || remote.identity.incarnation !== peer.incarnation) {
        throw new ConnectionBrokenError(
          `the node at ${ep.host}:${ep.port} is ${remote.identity.nodeId}/${remote.identity.incarnation}, expected ${peer.nodeId}/${peer.incarnation}`,
        );
      }
      const problem = this.#checkRemoteSetup(remote, streams);
      if (problem) throw problem;
      this.#connectQueues(q, remote);
      control.send({ type: 'ready' });
      const conn = new RdmaConnection(this, device, native, control, remote.identity, host.identity.nodeId, q);
      this.#adopt(conn, q.cqId);
      this.#handshakes.delete(socket);
      return conn;
    } catch (e) {
      this.#handshakes.delete(socket);
      socket.destroy();
      if (q) this.#destroyQueues(q);
      throw toTensorwireError(e);
    }
  }

  #accept(socket: Socket): void {
    if (this.#closing || !this.#device) {
      socket.destroy();
      return;
    }
    this.#handshakes.add(socket);
    let who: NodeIdentity | undefined;
    const control = new Control(socket, this.limits, (reason, message) => this.overBound(who, reason, message));
    control.onIdentity = (id) => (who = id);
    void this.#acceptHandshake(control).finally(() => this.#handshakes.delete(socket));
  }

  /** Inbound handshakes past HELLO (queues exist), in all and per peer incarnation. */
  #admitted = 0;
  readonly #admittedByPeer = new Map<string, number>();

  async #acceptHandshake(control: Control): Promise<void> {
    const deadline = Date.now() + (this.#options.handshakeTimeoutMs ?? 10_000);
    let q: Queues | undefined;
    let admitted: string | undefined;
    let from: string | undefined;
    const reject = (code: string, message: string): void => {
      this.#handshakeRefusals.record(code, from, message, this.logger);
      control.send({ type: 'reject', code, message });
      control.end();
      setTimeout(() => control.socket.destroy(), 1_000).unref();
    };
    try {
      const hello = await control.next(undefined, deadline, 'rdma accept handshake');
      if (hello.type !== 'hello') return reject('protocol', `expected hello, got ${hello.type}`);
      from = `${hello.setup.identity.nodeId}/${hello.setup.identity.incarnation}`;
      const { device, native, host } = this.#requireStarted();
      if (hello.target.nodeId !== host.identity.nodeId || hello.target.incarnation !== host.identity.incarnation) {
        return reject('stale-endpoint', `this is ${host.identity.nodeId}/${host.identity.incarnation}, not ${hello.target.nodeId}/${hello.target.incarnation}`);
      }
      // Admission, before any queue exists: connections a peer has plus those it is opening.
      const peerKey = `${hello.setup.identity.nodeId}/${hello.setup.identity.incarnation}`;
      const open = (this.#connections.get(peerKey)?.size ?? 0) + (this.#admittedByPeer.get(peerKey) ?? 0);
      if (open >= this.limits.maxConnectionsPerPeer) {
        return reject('too-many-connections', `${hello.setup.identity.nodeId} already has ${open} connections to this node (open or opening)`);
      }
      if (this.#admitted >= this.limits.maxInboundHandshakes) {
        return reject('busy', `${this.limits.maxInboundHandshakes} handshakes are in progress here; try again shortly`);
      }
      this.#admitted++;
      this.#admittedByPeer.set(peerKey, (this.#admittedByPeer.get(peerKey) ?? 0) + 1);
      admitted = peerKey;
      const problem = this.#checkRemoteSetup(hello.setup, this.queuePairsPerPeer);
      if (problem) return reject(String(problem.details['remoteCode'] ?? problem.code), problem.message);
      q = this.#createQueues(hello.setup.qps.length);
      this.#connectQueues(q, hello.setup);
      control.send({ type: 'accept', setup: this.#setup(q) });
      const ready = await control.next(undefined, deadline, 'rdma accept handshake');
      if (ready.type !== 'ready') throw new ConnectionBrokenError(`expected ready, got ${ready.type}`);
      if (this.#closing) throw new ClosedError('rdma transport closed');
      const conn = new RdmaConnection(this, device, native, control, hello.setup.identity, hello.setup.identity.nodeId, q);
      this.#adopt(conn, q.cqId);
      q = undefined;
      host.inbound(conn);
    } catch (e) {
      const err = toTensorwireError(e);
      if (err instanceof InvalidInputError) reject('invalid-input', err.message);
      else control.socket.destroy();
      if (q) this.#destroyQueues(q);
      this.logger.debug('rdma: inbound handshake failed', { error: err.message });
    } finally {
      if (admitted !== undefined) {
        this.#admitted--;
        const left = (this.#admittedByPeer.get(admitted) ?? 1) - 1;
        if (left > 0) this.#admittedByPeer.set(admitted, left);
        else this.#admittedByPeer.delete(admitted);
      }
    }
  }

  #adopt(conn: RdmaConnection, cqId: number): void {
    this.#cqRoutes.set(cqId, conn);
    const key = `${conn.peer.nodeId}/${conn.peer.incarnation}`;
    let set = this.#connections.get(key);
    if (!set) this.#connections.set(key, (set = new Set()));
    set.add(conn);
  }

  /** @internal a connection finished closing: drop it from the table in one step. */
  forget(conn: RdmaConnection): void {
    const key = `${conn.peer.nodeId}/${conn.peer.incarnation}`;
    const set = this.#connections.get(key);
    if (set?.delete(conn) && set.size === 0) this.#connections.delete(key);
  }

  /** @internal */
  releaseCq(cqId: number, conn: RdmaConnection): void {
    if (this.#cqRoutes.get(cqId) === conn) this.#cqRoutes.delete(cqId);
    try {
      this.#device?.destroyCq(cqId);
    } catch (e) {
      this.logger.warn('rdma: ibv_destroy_cq failed', { error: String(e) });
    }
  }

  #onCompletions(t: Float64Array): void {
    for (let i = 0; i + 4 < t.length; i += 5) {
      const cqId = t[i] as number;
      if (cqId === 0) {
        const err = new ConnectionBrokenError('the RDMA device reported a fatal event (completion channel failed)');
        for (const set of this.#connections.values()) for (const c of set) void c.close(err);
        continue;
      }
      this.#cqRoutes.get(cqId)?.onCompletion(t[i + 1] as number, t[i + 2] as number, t[i + 4] as number);
    }
  }

  /** Connections currently open or closing, per peer (for tests and diagnostics). */
  connectionCount(): number {
    let n = 0;
    for (const s of this.#connections.values()) n += s.size;
    return n;
  }

  close(): Promise<void> {
    this.#closing ??= (async () => {
      await this.#starting?.catch(() => undefined);
      this.#server?.close();
      for (const s of this.#handshakes) s.destroy();
      this.#handshakes.clear();
      const conns = [...this.#connections.values()].flatMap((s) => [...s]);
      await Promise.allSettled(conns.map((c) => c.close(new ClosedError('rdma transport closed'))));
      // The connections are closed (their windows deallocated): range grants simply end.
      for (const g of this.#rangeGrants) {
        g.revoked = true;
        g.revoking ??= Promise.resolve();
        this.#grantLedger?.revokeGrant(g.tokenHex);
        for (const reg of g.regions) reg.grants.delete(g);
      }
      this.#rangeGrants.clear();
      for (const reg of [...this.#registrations]) {
        reg.revoked = true;
        if (reg.tokenHex !== undefined) this.#ledger?.revokeGrant(reg.tokenHex);
        try {
          this.#deregister(reg);
        } catch (e) {
          this.logger.warn('rdma: ibv_dereg_mr failed; closing the device releases it', { error: String(e) });
        }
      }
      this.#device?.close(); // deallocates windows, destroys QPs and deregisters what is left
      for (const reg of this.#registrations) reg.release?.();
      this.#registrations.clear();
      this.#device = undefined;
    })();
    return this.#closing;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
