/**
 * The one typed facade over the native addon. Everything else in this package talks to
 * the addon through these types; nothing else calls `require` on a `.node` file.
 *
 * The loader tries every known build location (and `TENSORWIRE_RDMA_ADDON` first, when
 * set) and keeps every error, so "cannot load" says what was tried and why each failed.
 */
import { ADDON_SPEC } from './addon-spec.js';
import { addonPaths, loadAddon, loadFailureMessage, sourceBuildHint, type PlatformInfo } from '@tensorwire/core/addon';
import { BackendUnavailableError, ErrorCode, errorFromCode, isErrorCode, type TensorwireError } from '@tensorwire/core';

/** What `probe()` reports: how far the addon gets on this machine. */
export interface NativeProbe {
  /** False for the stub built without infiniband/verbs.h. */
  readonly built: boolean;
  readonly buildReason?: string;
  readonly library?: { readonly loaded: boolean; readonly error?: string };
  /** libibverbs exports ibv_reg_dmabuf_mr (rdma-core v34+). */
  readonly dmabuf: boolean;
  /**
   * Fork safety, decided once per process when libibverbs is first loaded (present
   * whenever it loaded). Node forks to spawn children; without copy-on-fork for pinned
   * pages in the kernel, a parent write to a registered page after a fork lands on a
   * copy while the NIC keeps DMAing to the original.
   * - `unneeded`: the kernel copies DMA pages on fork (ibv_is_fork_initialized said so).
   * - `enabled`: ibv_fork_init() succeeded (or was already in effect, e.g. RDMAV_FORK_SAFE).
   * - `disabled`: opted out with TENSORWIRE_RDMA_FORK_INIT=0 (or `off`); `error` says so.
   *   RDMAV_FORK_SAFE / IBV_FORK_SAFE override the opt-out, since libibverbs would enable it anyway.
   * - `failed`: ibv_fork_init() failed or is missing; `error` says why.
   */
  readonly fork?: { readonly status: 'unneeded' | 'enabled' | 'disabled' | 'failed'; readonly error?: string };
  readonly deviceList?: { readonly ok: boolean; readonly count: number; readonly error?: string; readonly names?: readonly string[] };
}

export interface NativeGid {
  readonly index: number;
  /** 32 hex characters. */
  readonly gid: string;
}

/** One port as `ibv_query_port` reports it (enums as numbers, see attributes.ts). */
export interface NativePort {
  readonly port: number;
  readonly error?: string;
  readonly state?: number;
  readonly maxMtu?: number;
  readonly activeMtu?: number;
  readonly lid?: number;
  readonly smLid?: number;
  readonly linkLayer?: number;
  readonly gidTblLen?: number;
  readonly activeSpeed?: number;
  readonly activeWidth?: number;
  readonly portCapFlags?: number;
  readonly gids?: readonly NativeGid[];
}

export interface NativeDeviceInfo {
  readonly name?: string;
  readonly guid?: string;
  readonly error?: string;
  readonly fwVer?: string;
  readonly vendorId?: number;
  readonly vendorPartId?: number;
  readonly maxQp?: number;
  readonly maxQpWr?: number;
  /** SGEs per work request (send, RDMA WRITE). */
  readonly maxSge?: number;
  /** SGEs per RDMA READ work request; 0 or absent when the provider does not say (then maxSge). */
  readonly maxSgeRd?: number;
  readonly maxCq?: number;
  readonly maxCqe?: number;
  readonly maxMr?: number;
  readonly maxMrSize?: number;
  readonly maxPd?: number;
  readonly maxQpRdAtom?: number;
  readonly maxQpInitRdAtom?: number;
  readonly maxMw?: number;
  readonly memoryWindowType2?: boolean;
  readonly physPortCnt?: number;
  readonly ports?: readonly NativePort[];
}

export interface NativeMr {
  readonly id: number;
  readonly lkey: number;
  readonly rkey: number;
  readonly addr: bigint;
  readonly length: number;
}

/** A type-2 memory window: an id (never reused, never the rkey) and its current rkey. */
export interface NativeMw {
  readonly id: number;
  readonly rkey: number;
}

/** What `bindMw` returns. A failed post is reported here, not thrown. */
export interface BindResult {
  /** The NIC accepted the bind work request; its completion (WcOpcode.BindMw) comes later. */
  readonly posted: boolean;
  /** The window's key after this call: the new key when posted, else the unchanged one. */
  readonly rkey: number;
  /** ibv_post_send's errno value, 0 when posted (ENOMEM: the send queue is full). */
  readonly errno: number;
  readonly error?: string;
}

export interface NativeQp {
  readonly id: number;
  readonly qpn: number;
  readonly maxSendWr: number;
  /** SGEs one work request on this QP may carry (at least what createQp asked for). */
  readonly maxSendSge: number;
}

export interface RtrAttributes {
  readonly destQpn: number;
  readonly rqPsn: number;
  readonly dlid: number;
  readonly mtu: number;
  readonly port: number;
  readonly sl: number;
  readonly maxDestRdAtomic: number;
  readonly minRnrTimer: number;
  readonly isGlobal: boolean;
  readonly dgid?: Uint8Array;
  readonly sgidIndex: number;
  readonly hopLimit: number;
  readonly trafficClass: number;
}

export interface RtsAttributes {
  readonly sqPsn: number;
  readonly timeout: number;
  readonly retryCnt: number;
  readonly rnrRetry: number;
  readonly maxRdAtomic: number;
}

/**
 * Layout of one work request in the `wrs` Float64Array of {@link NativeDevice.post}:
 * {@link WR_STRIDE} numbers per WR at these positions.
 */
export const WrField = {
  /** 0 RDMA READ, 1 RDMA WRITE. */
  Op: 0,
  /** Remote address, high and low 32 bits (a 64-bit address does not fit a double exactly). */
  RemoteHi: 1,
  RemoteLo: 2,
  /** Index into the `rkeys` Uint32Array of the post. */
  Rkey: 3,
  /** Index of the WR's first SGE in `sges`; its SGEs are consecutive there. */
  FirstSge: 4,
  SgeCount: 5,
} as const;
export const WR_STRIDE = 6;

/** Layout of one scatter-gather element in the `sges` Float64Array: {@link SGE_STRIDE} numbers. */
export const SgeField = {
  /** NativeMr.id of the local registration. */
  Mr: 0,
  /** Byte offset inside that registration. */
  Offset: 1,
  Length: 2,
} as const;
export const SGE_STRIDE = 3;

export interface PostResult {
  /**
   * How many work requests of the chain the NIC accepted: all, unless ibv_post_send failed;
   * then those before the one it refused, the last of which is not signaled.
   */
  readonly posted: number;
  readonly errno: number;
  readonly error?: string;
}

/** An open device: context, PD, completion channel, and one poller thread. */
export interface NativeDevice {
  readonly name: string;
  readonly isOpen: boolean;
  info(): NativeDeviceInfo;
  regHost(view: Uint8Array, access: number): NativeMr;
  regDmabuf(fd: number, offset: number, length: number, iova: bigint, access: number): NativeMr;
  deregMr(id: number): boolean;
  createCq(cqe: number): number;
  destroyCq(id: number): boolean;
  /** An RC QP on `cqId` (send and receive CQ) with room for `maxSendWr` WRs of up to `maxSendSge` (default 1) SGEs each. */
  createQp(cqId: number, maxSendWr: number, maxSendSge?: number): NativeQp;
  destroyQp(id: number): boolean;
  qpInit(id: number, port: number, access: number): void;
  qpRtr(id: number, attrs: RtrAttributes): void;
  qpRts(id: number, attrs: RtsAttributes): void;
  qpError(id: number): void;
  /**
   * Post work requests `[firstWr, firstWr + count)` of `wrs` ({@link WrField}) as one chain in
   * one ibv_post_send. A WR's remote side is one contiguous range (its address, the sum of its
   * SGE lengths) opened by `rkeys[wr.Rkey]`; its local side is its SGE list ({@link SgeField}),
   * scattered (READ) or gathered (WRITE) in order. WR `i` of the chain gets wr_id
   * `wrIdBase + i`, and only the last is signaled: a chain that succeeds completes once, with
   * `wrIdBase + count - 1`. A WR that fails completes in error even when unsignaled, and every
   * later WR on the QP flushes with an error completion. Unsignaled WRs keep their send-queue
   * slots until a later signaled completion retires them, so the caller counts a chain's
   * `count` slots as used until its last WR completes. Everything is validated (MR ids, local
   * bounds, SGE counts against the QP's maxSendSge, `count` against its maxSendWr: a longer
   * chain throws TW_RESOURCE_EXHAUSTED) before anything is posted; bad input throws
   * TW_INVALID_INPUT. A failed ibv_post_send is returned, not thrown.
   */
  post(qpId: number, wrs: Float64Array, sges: Float64Array, rkeys: Uint32Array, firstWr: number, count: number, wrIdBase: number): PostResult;
  /**
   * Allocate an unbound type-2 memory window on the device's PD. Throws TW_RESOURCE_EXHAUSTED
   * (ENOMEM) or TW_BACKEND_UNAVAILABLE (e.g. EOPNOTSUPP: the provider has no memory windows).
   */
  allocMw(): NativeMw;
  /**
   * Post one signaled bind work request on `qpId` that binds window `mwId` to
   * [offset, offset + length) of registration `mrId` (registered with Access.MwBind),
   * with `access` a combination of LocalWrite, RemoteWrite, RemoteRead and RemoteAtomic,
   * under a fresh rkey (the 8 low bits of the previous key, incremented). The previous key
   * stops working when the bind executes. Bad ids or ranges throw TW_INVALID_INPUT; a
   * failed post does not throw (see BindResult).
   */
  bindMw(qpId: number, mwId: number, mrId: number, offset: number, length: number, access: number, wrId: bigint): BindResult;
  /**
   * Deallocate a window, invalidating its rkey if bound. False when the id is unknown or
   * the device is closed; throws TW_BACKEND_UNAVAILABLE if ibv_dealloc_mw fails. Deallocate
   * the windows bound to a registration before deregistering it (the verbs refuse an MR
   * that windows are bound to). close() deallocates every window first.
   */
  deallocMw(id: number): boolean;
  close(): void;
}

/** Live native resources in this environment; the churn test checks they return to start. */
export interface NativeCounters {
  readonly devices: number;
  readonly pds: number;
  readonly mrs: number;
  readonly mws: number;
  readonly cqs: number;
  readonly qps: number;
  readonly channels: number;
  readonly threads: number;
  readonly postedWrs: number;
  readonly completions: number;
}

/**
 * The device's completion callback gets a Float64Array of (cqId, wrId, status, opcode,
 * vendorErr) tuples. A tuple with cqId 0 and status -1 means the completion channel
 * failed (device removed).
 */
export type CompletionListener = (tuples: Float64Array) => void;

export interface NativeAddon {
  readonly builtWithVerbs: boolean;
  readonly napiVersion: number;
  probe(): NativeProbe;
  counters(): NativeCounters;
  listDevices(): NativeDeviceInfo[];
  wcStatusString(status: number): string;
  readonly Device: new (name: string, onCompletions: CompletionListener) => NativeDevice;
}

export const ADDON_FILE = 'tensorwire_rdma_verbs.node';

/** Where the loader looks, in order (see `@tensorwire/core/addon`). `TENSORWIRE_RDMA_ADDON` overrides. */
export function addonCandidates(): string[] {
  return addonPaths(ADDON_SPEC);
}

export type LoadResult =
  | { readonly addon: NativeAddon; readonly path: string }
  | { readonly errors: readonly string[]; readonly message: string; readonly platform: PlatformInfo; readonly prebuilds: readonly string[] };

let cached: LoadResult | undefined;

/** Try every candidate; never throws. The result is cached per process. */
export function tryLoadNative(): LoadResult {
  if (cached !== undefined) return cached;
  const r = loadAddon<NativeAddon>(ADDON_SPEC);
  cached =
    r.addon !== undefined && r.path !== undefined
      ? { addon: r.addon, path: r.path }
      : { errors: r.errors, message: loadFailureMessage(ADDON_SPEC, r), platform: r.platform, prebuilds: r.prebuilds };
  return cached;
}

/** The addon, or BackendUnavailableError naming the platform, the prebuilds, what to install and every path tried. */
export function loadNative(): NativeAddon {
  const r = tryLoadNative();
  if ('addon' in r) return r.addon;
  throw new BackendUnavailableError(r.message, {
    details: { tried: r.errors, platform: r.platform, prebuilds: r.prebuilds, install: sourceBuildHint(ADDON_SPEC) },
  });
}

/** Turn an error thrown by the addon (which carries a TW_* code) into the typed error. */
export function nativeError(e: unknown, what: string): TensorwireError {
  const code = (e as { code?: unknown } | null)?.code;
  const message = e instanceof Error ? e.message : String(e);
  if (isErrorCode(code)) return errorFromCode(code, `${what}: ${message}`, { cause: e });
  return errorFromCode(ErrorCode.BackendUnavailable, `${what}: ${message}`, { cause: e });
}

/** ibv_access_flags. */
export const Access = {
  LocalWrite: 1,
  RemoteWrite: 2,
  RemoteRead: 4,
  /** Needed on a registration that memory windows are bound to. */
  MwBind: 16,
} as const;

/** ibv_wc_opcode values of the send-side completions this package posts. */
export const WcOpcode = {
  RdmaWrite: 1,
  RdmaRead: 2,
  BindMw: 5,
} as const;

/** ibv_wc_status values this package treats specially. */
export const WcStatus = {
  Success: 0,
  LocLenErr: 1,
  LocQpOpErr: 2,
  LocProtErr: 4,
  WrFlushErr: 5,
  RemInvReqErr: 9,
  RemAccessErr: 10,
  RemOpErr: 11,
  RetryExcErr: 12,
  RnrRetryExcErr: 13,
} as const;
