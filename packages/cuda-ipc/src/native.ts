/**
 * The one typed facade over the native addon. The loader tries every known build path
 * and keeps every error, so `capabilities()` can say exactly why something is missing.
 * Every call converts native errors (which carry a `code` such as `TW_INVALID_INPUT`)
 * into the typed errors of @tensorwire/core.
 */
import { ADDON_SPEC } from './addon-spec.js';
import { addonPaths, loadAddon, loadFailureMessage, sourceBuildHint, type PlatformInfo } from '@tensorwire/core/addon';
import { BackendUnavailableError, errorFromCode, isErrorCode, type TensorwireError } from '@tensorwire/core';

/** Segment kinds in the header's `kind` field. */
export const SegmentKind = { Pool: 1, Grant: 2, Node: 3, GrantTable: 4 } as const;
/** Segment states in the header's `state` field. */
export const SegmentState = { Init: 0, Live: 1, Dead: 2 } as const;
/** States of a range-grant record in a grant table (native/layout.h). */
export const RecordState = { Free: 0, Live: 1, Revoked: 2 } as const;
/** Results of {@link NativeAddon.grantEnter} and {@link NativeAddon.recordEnter}. */
export const GrantResult = { Ok: 0, Revoked: 1, BadToken: 2, NotGrant: 3 } as const;

export interface SegmentMeta {
  readonly kind: number;
  readonly version: number;
  readonly headerSize: number;
  readonly dataOffset: number;
  readonly capacity: number;
  readonly ownerPid: number;
  readonly device: number;
  readonly ownerStart: bigint;
  readonly ipcOffset: number;
  readonly ipcHandle: Uint8Array;
  readonly generation: bigint;
  readonly state: number;
  readonly importers: number;
  readonly byteLength: number;
  readonly dtype: number;
  readonly shape: readonly number[];
  readonly id: string;
}

/** A segment's locator file (see native/shm.h): where readers find the creator's sealed memfd. */
export interface SegmentLocator {
  readonly pid: number;
  readonly fd: number;
  readonly kind: number;
  readonly ownerStart: bigint;
  readonly size: number;
}

export interface SegmentInit {
  readonly kind: number;
  readonly id: string;
  readonly dataOffset?: number;
  readonly capacity?: number;
  readonly ownerPid: number;
  readonly ownerStart?: bigint;
  readonly device?: number;
  readonly ipcHandle?: Uint8Array;
  readonly ipcOffset?: number;
  readonly byteLength?: number;
  readonly dtype?: number;
  readonly shape?: readonly number[];
}

export interface NativeLayout {
  readonly headerSize: number;
  readonly dataOffset: number;
  readonly maxNdim: number;
  readonly maxNameLength: number;
  readonly maxSegmentBytes: number;
  readonly tokenBytes: number;
  readonly offsets: Readonly<Record<string, number>>;
  /** Grant table geometry (native/layout.h): record, directory entry and range entry sizes, record field offsets, reader limits. */
  readonly table: Readonly<Record<string, number>>;
}

export interface CudaProbe {
  readonly available: boolean;
  readonly reason: string;
  readonly driverVersion: number;
  readonly deviceCount: number;
  readonly devices: readonly string[];
}

export interface CudaExport {
  readonly handle: Uint8Array;
  readonly base: bigint;
  readonly offset: number;
  readonly allocSize: number;
}

/** An opaque native plan of {@link NativeAddon.planBatch} (a type-tagged external). */
export type BatchPlanHandle = { readonly __batchPlan: unique symbol };

/** The addon's exports, exactly as native/addon.cc defines them. */
export interface NativeAddon {
  layout(): NativeLayout;
  nameProblem(name: string): string | undefined;
  shmCreate(name: string, size: number, init: SegmentInit): ArrayBuffer;
  shmOpen(name: string, maxSize: number): ArrayBuffer;
  shmUnlink(name: string): boolean;
  shmUnlinkAll(): number;
  shmCreated(): string[];
  /**
   * The locator of segment `name` (`/dev/shm<name>`), read without opening the segment: which
   * process created it (pid and start time), its memfd descriptor there, kind and size.
   * sweep() and create collisions judge leftovers of dead owners by it.
   */
  shmLocate(name: string): SegmentLocator;
  headerDecode(segment: ArrayBuffer, kind?: number, expectId?: string): SegmentMeta;
  /**
   * headerDecode(segment, pool, expectId) for the id -> view hot path: fills `out`
   * (state, device, byteLength, capacity, dtype, ndim, shape[0..7]) and returns the generation.
   */
  viewMeta(segment: ArrayBuffer, expectId: string, out: Float64Array): bigint;
  seqWrite(segment: ArrayBuffer, capacity: number, src: Uint8Array, dtype: number, shape: readonly number[]): bigint;
  seqCheck(segment: ArrayBuffer, generation: bigint): boolean;
  seqCopy(segment: ArrayBuffer, expectId: string, dst: Uint8Array, maxAttempts?: number): SegmentMeta;
  /**
   * A seqlock-consistent copy of bytes [offset, offset + length) of a host pool slot's
   * mapping (offsets from the start of the mapping, so >= the data offset) into `dst`
   * (which must hold `length` bytes). Returns the generation the copy is consistent with;
   * TimedOutError when no consistent copy could be made.
   */
  seqCopyRange(segment: ArrayBuffer, offset: number, length: number, dst: Uint8Array, maxAttempts?: number): bigint;
  /**
   * One stream batch of host copies in one call (see native/addon.cc, CopyBatchJs). `op` 0
   * reads (segment → local), 1 writes. `ranges` holds `count` ranges of `stride` numbers, the
   * first seven in core's RangeField order; `locals` the local buffers by RangeField.Local;
   * `remotes` 3 numbers per RangeField.Remote (grant index, first span, span count: one span
   * for a whole registration, one per granted range for a range grant, picked by
   * RangeField.RemoteRange); `spans` 3 numbers per span (segment index, offset of the granted
   * bytes in the segment mapping, bytes granted); `segments` the data segment mappings with
   * `segmentFlags` (1: seqlocked pool slot); `grants` the grant segment or grant table mappings
   * with `grantInfo` (2 numbers each: byte offset of the range-grant record, 0 for a grant
   * segment; the record's generation) and 16 bytes each of `tokens`. Validates everything
   * against the real lengths before any grant is entered or any byte moves (a range against
   * its granted range, never the whole region); enters each grant once; copies all of a pool
   * slot's ranges as one seqlock snapshot (retried at most `maxAttempts` times, bounded by
   * `deadlineMs`), writing its generation to `generations`. Errors carry `details.range`,
   * `details.grant` or `details.segment` (indices) where they are about one, and
   * `details.remoteCode` for RemoteRejectedError. `threads` (default 1) copies a group of at
   * least 1 MiB (a slot's ranges, or other segments' ranges) in pieces of >= 256 KiB that up
   * to that many threads claim (the caller and a persistent pool), the seqlock still loaded
   * once per slot per batch and re-checked after every piece; all have ended before the call
   * returns.
   */
  copyBatch(
    op: 0 | 1,
    ranges: Float64Array,
    count: number,
    stride: number,
    locals: readonly Uint8Array[],
    remotes: Float64Array,
    spans: Float64Array,
    segments: readonly ArrayBuffer[],
    segmentFlags: Uint8Array,
    grants: readonly ArrayBuffer[],
    grantInfo: Float64Array,
    tokens: Uint8Array,
    deadlineMs: number,
    maxAttempts: number,
    generations: BigUint64Array,
    threads?: number,
  ): void;
  /**
   * The tables of {@link NativeAddon.copyBatch} (same meaning, same checks) kept natively for
   * batches that reuse them: numbers copied, buffers and mappings referenced (kept alive by
   * the plan). An opaque plan for {@link NativeAddon.copyPlanned}.
   */
  planBatch(
    op: 0 | 1,
    locals: readonly Uint8Array[],
    remotes: Float64Array,
    spans: Float64Array,
    segments: readonly ArrayBuffer[],
    segmentFlags: Uint8Array,
    grants: readonly ArrayBuffer[],
    grantInfo: Float64Array,
    tokens: Uint8Array,
    generations: BigUint64Array,
  ): BatchPlanHandle;
  /**
   * {@link NativeAddon.copyBatch} over a plan of {@link NativeAddon.planBatch}: every buffer's
   * pointer and length read again, everything validated as copyBatch does.
   */
  copyPlanned(plan: BatchPlanHandle, ranges: Float64Array, count: number, stride: number, deadlineMs: number, maxAttempts: number, threads?: number): void;
  /**
   * {@link NativeAddon.copyPlanned} with the bytes moved off the JavaScript thread (a thread of
   * libuv's pool). Everything is checked before it returns (a bad range or table throws, in
   * the call, and nothing is queued); the promise settles when the copy has ended, with the error copyPlanned
   * would have thrown. `generations` (one value per segment of the plan) receives the
   * generation each seqlocked segment was copied at, before the promise settles. The plan
   * and the buffers it references stay alive until then. `control` (one element, at
   * `CopyControl.Queued`; never detached) stops the copy: the pool thread that starts it swaps
   * Queued for Running and leaves it untouched if it finds Cancelled; the caller stores
   * Cancelled to stop it, and a copy already running stops at its next check (a range, a 4 MiB
   * step of a larger one on one thread, a piece of the copy pool, a seqlock wait), then rejects
   * with AbortedError. Addons that take it have
   * `copyControl: true`; an older one ignores it.
   */
  copyPlannedAsync(
    plan: BatchPlanHandle,
    ranges: Float64Array,
    count: number,
    stride: number,
    deadlineMs: number,
    maxAttempts: number,
    threads: number,
    generations: BigUint64Array,
    control?: Int32Array,
  ): Promise<void>;
  setState(segment: ArrayBuffer, state: number): void;
  loadState(segment: ArrayBuffer): number;
  importerAdd(segment: ArrayBuffer): boolean;
  importerRemove(segment: ArrayBuffer): number;
  importers(segment: ArrayBuffer): number;
  grantEnter(segment: ArrayBuffer, token: Uint8Array): number;
  grantLeave(segment: ArrayBuffer): void;
  grantActive(segment: ArrayBuffer): number;
  grantRevoke(segment: ArrayBuffer): void;
  /**
   * Range-grant records of a grant table (`offset`: the record's byte offset in the table
   * mapping; the table's header and geometry are checked against the mapping on every call).
   * Enter: in-flight counter++, then state live, generation and token checked (seq_cst), or
   * backs out and says why ({@link GrantResult}).
   */
  recordEnter(table: ArrayBuffer, offset: number, generation: number, token: Uint8Array): number;
  recordLeave(table: ArrayBuffer, offset: number): void;
  recordActive(table: ArrayBuffer, offset: number): number;
  /** Owner: store the generation, then publish the record live (seq_cst). */
  recordPublish(table: ArrayBuffer, offset: number, generation: number): void;
  /** Owner: mark revoked, zero the token, set the next generation; returns the in-flight count seen after. */
  recordRevoke(table: ArrayBuffer, offset: number, nextGeneration: number): number;
  /** Owner: the record is free for reuse (after its in-flight count drained). */
  recordFree(table: ArrayBuffer, offset: number): void;
  /**
   * Owner, before publishing a record: check a grant's ranges (`count` ranges of 3 numbers:
   * registration index, offset, length) against `regs` (3 numbers per registration: directory
   * index, base in its segment mapping, byte length) and write the range table at `arenaOffset`
   * of the table's arena, in one pass. Returns the sum of the lengths, or -(k + 1) for the
   * first bad range k (empty, fractional, outside its registration, or naming none).
   */
  writeRangeTable(table: ArrayBuffer, arenaOffset: number, ranges: Float64Array, count: number, regs: Float64Array): number;
  cudaProbe(): CudaProbe;
  cudaAlloc(device: number, bytes: number): Promise<bigint>;
  cudaExport(device: number, pointer: bigint): Promise<CudaExport>;
  cudaFree(device: number, pointer: bigint): Promise<void>;
  cudaImport(device: number, handle: Uint8Array): Promise<bigint>;
  cudaCloseImport(device: number, pointer: bigint): Promise<void>;
  cudaCopy(op: 'h2d', device: number, dst: bigint, src: Uint8Array, length: number): Promise<void>;
  cudaCopy(op: 'd2h', device: number, dst: Uint8Array, src: bigint, length: number): Promise<void>;
  cudaCopy(op: 'd2d', device: number, dst: bigint, src: bigint, length: number): Promise<void>;
  /**
   * `count` device-to-device copies on `device`'s stream in one call: `table` holds (dst
   * address, src address, length) triples as whole numbers below 2^53 (the table is copied);
   * one stream sync at the end. An addon built before this entry lacks it.
   */
  cudaCopyRanges(device: number, table: Float64Array, count: number): Promise<void>;
  cudaHostRegister(memory: Uint8Array): Promise<void>;
  cudaHostUnregister(memory: Uint8Array): Promise<void>;
}

interface LoadResult {
  readonly addon: NativeAddon | undefined;
  readonly path: string | undefined;
  readonly errors: readonly string[];
  readonly failure: string | undefined;
  readonly platform: PlatformInfo;
  readonly prebuilds: readonly string[];
}

let loaded: LoadResult | undefined;

/** Where the loader looks, in order (see `@tensorwire/core/addon`). `TENSORWIRE_CUDA_IPC_ADDON` overrides. */
export function addonCandidates(): string[] {
  return addonPaths(ADDON_SPEC);
}

function load(): LoadResult {
  if (loaded) return loaded;
  const r = loadAddon<NativeAddon>(ADDON_SPEC);
  loaded = { addon: r.addon, path: r.path, errors: r.errors, failure: r.addon ? undefined : loadFailureMessage(ADDON_SPEC, r), platform: r.platform, prebuilds: r.prebuilds };
  return loaded;
}

/** Turn anything the addon threw into a typed error. */
export function toTypedError(e: unknown): TensorwireError | unknown {
  if (e instanceof Error) {
    const code = (e as { code?: unknown }).code;
    if (isErrorCode(code)) {
      const details: Record<string, unknown> = {};
      for (const k of ['errno', 'errnoName', 'syscall', 'cuResult', 'cuCall', 'remoteCode', 'range', 'grant', 'segment'] as const) {
        const v = (e as unknown as Record<string, unknown>)[k];
        if (v !== undefined && v !== '') details[k] = v;
      }
      return errorFromCode(code, e.message, { cause: e, details });
    }
  }
  return e;
}

function addon(): NativeAddon {
  const r = load();
  if (!r.addon) {
    throw new BackendUnavailableError(r.failure ?? 'the @tensorwire/cuda-ipc native addon could not be loaded', {
      details: { errors: r.errors, platform: r.platform, prebuilds: r.prebuilds, install: sourceBuildHint(ADDON_SPEC) },
    });
  }
  return r.addon;
}

function wrap<K extends keyof NativeAddon>(key: K): NativeAddon[K] {
  const fn = (...args: unknown[]): unknown => {
    const a = addon();
    try {
      const result = (a[key] as (...x: unknown[]) => unknown).apply(a, args);
      if (result instanceof Promise) {
        return result.catch((e: unknown) => {
          throw toTypedError(e);
        });
      }
      return result;
    } catch (e) {
      throw toTypedError(e);
    }
  };
  return fn as NativeAddon[K];
}

/**
 * Hot-path entries, called once per stream batch: a direct call with fixed arguments (no rest
 * parameters, no `apply`), the same error conversion as {@link wrap}.
 */
function copyBatch(
  op: 0 | 1,
  ranges: Float64Array,
  count: number,
  stride: number,
  locals: readonly Uint8Array[],
  remotes: Float64Array,
  spans: Float64Array,
  segments: readonly ArrayBuffer[],
  segmentFlags: Uint8Array,
  grants: readonly ArrayBuffer[],
  grantInfo: Float64Array,
  tokens: Uint8Array,
  deadlineMs: number,
  maxAttempts: number,
  generations: BigUint64Array,
  threads = 1,
): void {
  const a = loaded?.addon ?? addon();
  try {
    a.copyBatch(op, ranges, count, stride, locals, remotes, spans, segments, segmentFlags, grants, grantInfo, tokens, deadlineMs, maxAttempts, generations, threads);
  } catch (e) {
    throw toTypedError(e);
  }
}

function copyPlanned(plan: BatchPlanHandle, ranges: Float64Array, count: number, stride: number, deadlineMs: number, maxAttempts: number, threads = 1): void {
  const a = loaded?.addon ?? addon();
  try {
    a.copyPlanned(plan, ranges, count, stride, deadlineMs, maxAttempts, threads);
  } catch (e) {
    throw toTypedError(e);
  }
}

function loadState(segment: ArrayBuffer): number {
  const a = loaded?.addon ?? addon();
  try {
    return a.loadState(segment);
  } catch (e) {
    throw toTypedError(e);
  }
}

/** The states of {@link NativeAddon.copyPlannedAsync}'s control word. */
export const CopyControl = { Queued: 0, Running: 1, Cancelled: 2 } as const;

/** Whether the loaded addon exports the flag `name` as true (one built before it was added does not). Loads it. */
export function nativeFlag(name: string): boolean {
  return (addon() as unknown as Record<string, unknown>)[name] === true;
}

/** Whether the loaded addon has `name` (an addon built before an export was added lacks it). Loads it. */
export function nativeHas(name: string): boolean {
  return typeof (addon() as unknown as Record<string, unknown>)[name] === 'function';
}

/** The addon, with every native error converted to a typed error. Loads lazily. */
export const native: NativeAddon = {
  layout: wrap('layout'),
  nameProblem: wrap('nameProblem'),
  shmCreate: wrap('shmCreate'),
  shmOpen: wrap('shmOpen'),
  shmUnlink: wrap('shmUnlink'),
  shmUnlinkAll: wrap('shmUnlinkAll'),
  shmCreated: wrap('shmCreated'),
  shmLocate: wrap('shmLocate'),
  headerDecode: wrap('headerDecode'),
  viewMeta: wrap('viewMeta'),
  seqWrite: wrap('seqWrite'),
  seqCheck: wrap('seqCheck'),
  seqCopy: wrap('seqCopy'),
  seqCopyRange: wrap('seqCopyRange'),
  copyBatch,
  planBatch: wrap('planBatch'),
  copyPlanned,
  // Large batches only: wrap's rest parameters cost nothing against the copy.
  copyPlannedAsync: wrap('copyPlannedAsync'),
  setState: wrap('setState'),
  loadState,
  importerAdd: wrap('importerAdd'),
  importerRemove: wrap('importerRemove'),
  importers: wrap('importers'),
  grantEnter: wrap('grantEnter'),
  grantLeave: wrap('grantLeave'),
  grantActive: wrap('grantActive'),
  grantRevoke: wrap('grantRevoke'),
  recordEnter: wrap('recordEnter'),
  recordLeave: wrap('recordLeave'),
  recordActive: wrap('recordActive'),
  recordPublish: wrap('recordPublish'),
  recordRevoke: wrap('recordRevoke'),
  recordFree: wrap('recordFree'),
  writeRangeTable: wrap('writeRangeTable'),
  cudaProbe: wrap('cudaProbe'),
  cudaAlloc: wrap('cudaAlloc'),
  cudaExport: wrap('cudaExport'),
  cudaFree: wrap('cudaFree'),
  cudaImport: wrap('cudaImport'),
  cudaCloseImport: wrap('cudaCloseImport'),
  cudaCopy: wrap('cudaCopy'),
  cudaCopyRanges: wrap('cudaCopyRanges'),
  cudaHostRegister: wrap('cudaHostRegister'),
  cudaHostUnregister: wrap('cudaHostUnregister'),
};

export interface Capabilities {
  readonly addon: { readonly loaded: boolean; readonly path: string | undefined; readonly errors: readonly string[] };
  /** POSIX shared memory (host slots): needs the addon and /dev/shm. */
  readonly sharedMemory: { readonly available: boolean; readonly reason: string | undefined };
  /** CUDA IPC: needs the addon, libcuda.so.1 and at least one device. */
  readonly cuda: {
    readonly available: boolean;
    readonly reason: string | undefined;
    readonly driverVersion: number;
    readonly deviceCount: number;
    readonly devices: readonly string[];
  };
}

/** What works on this machine, and exactly why not where something does not. */
export function capabilities(): Capabilities {
  const r = load();
  const addonInfo = { loaded: r.addon !== undefined, path: r.path, errors: r.errors };
  if (!r.addon) {
    const why = `native addon not loaded: ${r.errors.join('; ')}`;
    return {
      addon: addonInfo,
      sharedMemory: { available: false, reason: why },
      cuda: { available: false, reason: why, driverVersion: 0, deviceCount: 0, devices: [] },
    };
  }
  let cuda: CudaProbe;
  try {
    cuda = r.addon.cudaProbe();
  } catch (e) {
    cuda = { available: false, reason: `CUDA probe failed: ${e instanceof Error ? e.message : String(e)}`, driverVersion: 0, deviceCount: 0, devices: [] };
  }
  return {
    addon: addonInfo,
    sharedMemory: { available: true, reason: undefined },
    cuda: {
      available: cuda.available,
      reason: cuda.available ? undefined : cuda.reason,
      driverVersion: cuda.driverVersion,
      deviceCount: cuda.deviceCount,
      devices: cuda.devices,
    },
  };
}

/** True when `what` works here: 'shm' (default) needs only the addon, 'cuda' a GPU too. */
export function isAvailable(what: 'shm' | 'cuda' = 'shm'): boolean {
  const c = capabilities();
  return what === 'cuda' ? c.cuda.available : c.sharedMemory.available;
}
