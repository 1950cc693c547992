/**
 * Process-wide bookkeeping for shared memory: which ArrayBuffers are mappings of which
 * segment (so the transport can grant them zero-copy), the exit hook that unlinks every
 * segment this process created, `sweep()` for segments of dead owners, and
 * {@link allocateSharedMemory} for transport registrations.
 */
import { readdirSync, statSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { assertOwner, formatId, InvalidInputError } from '@tensorwire/core';
import { native, SegmentKind, SegmentState } from './native.js';
import { isProcessAlive, selfStartTime } from './proc.js';
import { poolSegmentName, segmentNameProblem } from './names.js';

export const HEADER_SIZE = 4096;
export const DATA_OFFSET = 4096;
export const MAX_SEGMENT_BYTES = 2 ** 40;

/** A mapping of a host segment whose data area can be granted to peers. */
export interface SharedRegion {
  readonly name: string;
  /** Where the data area starts in the mapping. */
  readonly dataOffset: number;
  /** Bytes of the data area. */
  readonly dataBytes: number;
  /**
   * A pool slot: its data is published under the slot's seqlock by the owner's writer, so
   * a peer's one-sided write (a plain copy that cannot take the seqlock) is refused.
   */
  readonly seqlocked?: boolean;
}

const regions = new WeakMap<ArrayBufferLike, SharedRegion>();

/** Record a mapping this process created (never another owner's) as grantable. */
export function rememberRegion(mapping: ArrayBufferLike, region: SharedRegion): void {
  regions.set(mapping, region);
}

/** The shared segment `view` lies in, with the view's offset in its data area, or undefined. */
export function regionOf(view: Uint8Array): { region: SharedRegion; offset: number } | undefined {
  const region = regions.get(view.buffer);
  if (!region) return undefined;
  const offset = view.byteOffset - region.dataOffset;
  if (offset < 0 || offset + view.byteLength > region.dataBytes) return undefined;
  return { region, offset };
}

let exitHooked = false;
/** Signals whose default action ends the process and that a supervisor typically sends. */
const CLEANUP_SIGNALS = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const;

function unlinkAll(): void {
  try {
    native.shmUnlinkAll();
  } catch {
    // nothing left to do at exit
  }
}

/**
 * Unlink every segment this process created when it exits: on 'exit', and on SIGINT /
 * SIGTERM / SIGHUP when nothing else handles them. SIGKILL (and a crash) leaves them to
 * sweep().
 *
 * Signals follow the `signal-exit` convention, so the application's own semantics never
 * change: when the signal arrives and this hook is the only listener, it unlinks and then
 * re-raises the signal with the hook removed, so the process dies of that signal exactly
 * as it would have without us. When the application listens for the signal itself, the
 * hook does nothing: the application decides whether and when to exit (its exit runs the
 * 'exit' hook; its close() of the pool unlinks too).
 */
export function hookExit(): void {
  if (exitHooked) return;
  exitHooked = true;
  process.on('exit', unlinkAll);
  for (const sig of CLEANUP_SIGNALS) {
    const onSignal = (): void => {
      if (process.listenerCount(sig) > 1) return; // the application handles it
      unlinkAll();
      process.off(sig, onSignal);
      process.kill(process.pid, sig);
    };
    process.on(sig, onSignal);
  }
}

/**
 * Host memory in a fresh shared segment, for zero-copy registration with the cuda-ipc
 * transport. The segment is unlinked at process exit; the memory stays mapped while any
 * view of it is alive. `owner` names the segment (default `proc-<pid>`).
 */
export function allocateSharedMemory(byteLength: number, owner = `proc-${process.pid}`): Uint8Array {
  assertOwner(owner);
  if (!Number.isSafeInteger(byteLength) || byteLength < 1 || byteLength > MAX_SEGMENT_BYTES - DATA_OFFSET) {
    throw new InvalidInputError(`byteLength ${String(byteLength)} must be an integer between 1 and ${MAX_SEGMENT_BYTES - DATA_OFFSET}`, {
      details: { field: 'byteLength' },
    });
  }
  hookExit();
  const id = formatId('pool', owner, `x${randomBytes(12).toString('hex')}`);
  const name = poolSegmentName(id);
  const mapping = native.shmCreate(name, DATA_OFFSET + byteLength, {
    kind: SegmentKind.Pool,
    id,
    dataOffset: DATA_OFFSET,
    capacity: byteLength,
    ownerPid: process.pid,
    ownerStart: selfStartTime(),
    device: -1,
    byteLength,
    dtype: 1,
    shape: [byteLength],
  });
  native.setState(mapping, SegmentState.Live);
  rememberRegion(mapping, { name, dataOffset: DATA_OFFSET, dataBytes: byteLength });
  return new Uint8Array(mapping, DATA_OFFSET, byteLength);
}

/** Unlink the segment behind memory from {@link allocateSharedMemory} (the mapping stays until GC). */
export function releaseSharedMemory(view: Uint8Array): boolean {
  const r = regionOf(view);
  if (!r) return false;
  return native.shmUnlink(r.region.name);
}

export interface SweepReport {
  /** Segment names removed because their owner is dead (or they were never initialised). */
  readonly removed: readonly string[];
  /** Segments kept because their owner is alive. */
  readonly kept: number;
  /** Segments that could not be inspected, and why (other users' segments are skipped silently). */
  readonly skipped: readonly { readonly name: string; readonly reason: string }[];
}

/**
 * Remove tensorwire segment names left behind by owners that died: the creator pid recorded
 * in the locator is gone (ESRCH), or it was reused by another process (start time differs).
 * The memory itself went with the owner (a memfd lives as long as its creator's descriptor
 * and any mapping); only the name is left. Locators that never became valid are removed
 * once older than `staleInitMs`.
 */
export function sweep(options: { dir?: string; staleInitMs?: number } = {}): SweepReport {
  const dir = options.dir ?? '/dev/shm';
  const staleInitMs = options.staleInitMs ?? 60_000;
  const removed: string[] = [];
  const skipped: { name: string; reason: string }[] = [];
  let kept = 0;
  let entries: string[];
  try {
    entries = readdirSync(dir);
  } catch (e) {
    return { removed, kept, skipped: [{ name: dir, reason: e instanceof Error ? e.message : String(e) }] };
  }
  for (const entry of entries) {
    if (!entry.startsWith('tw-')) continue;
    const name = `/${entry}`;
    if (segmentNameProblem(name) !== undefined) continue;
    // The locator names the creator (pid + start time); the segment itself (a memfd of
    // that process) is gone with it, so it is never opened here.
    let pid: number;
    let start: bigint;
    try {
      const loc = native.shmLocate(name);
      pid = loc.pid;
      start = loc.ownerStart;
    } catch (e) {
      const msg = e instanceof Error ? e.message : String(e);
      if (/belongs to uid|accessible to other users/.test(msg)) continue; // not ours to judge
      // No valid locator: a creator died before writing it, or someone garbled it.
      if (/no valid locator|out of range/.test(msg) && isOld(`${dir}/${entry}`, staleInitMs)) {
        if (native.shmUnlink(name)) removed.push(name);
      } else {
        skipped.push({ name, reason: msg });
      }
      continue;
    }
    if (isProcessAlive(pid, start)) {
      kept++;
      continue;
    }
    if (native.shmUnlink(name)) removed.push(name);
  }
  return { removed, kept, skipped };
}

/** True when the segment `name` (`/tw-…`) was last modified more than `ms` ago (false when it cannot be stat'ed). */
export function segmentOlderThan(name: string, ms: number, dir = '/dev/shm'): boolean {
  return isOld(`${dir}${name}`, ms);
}

function isOld(path: string, ms: number): boolean {
  try {
    return Date.now() - statSync(path).mtimeMs > ms;
  } catch {
    return false;
  }
}
