/**
 * Process-wide bookkeeping for shared memory: which ArrayBuffers are mappings of which
 * segment (so the transport can grant them zero-copy), the exit hook that unlinks every
 * segment this process created (and the transport's listening socket file), `sweep()` for
 * segments and socket files of dead owners, and {@link allocateSharedMemory} for transport
 * registrations.
 */
import { lstatSync, readdirSync, statSync, unlinkSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
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

/** Socket files this process listens on (cuda-ipc transports not closed yet): unlinked at exit with the segments. */
const exitSockets = new Set<string>();

function unlinkAll(): void {
  try {
    native.shmUnlinkAll();
  } catch {
    // nothing left to do at exit
  }
  for (const path of exitSockets) {
    try {
      unlinkSync(path);
    } catch {
      // already gone
    }
  }
  exitSockets.clear();
}

/**
 * The file name of a transport's listening socket: `tw-s<pid>-<start time>-<random>.sock`, so
 * that {@link sweep} can tell a dead listener's file (SIGKILL runs no exit hook) from a live
 * one's without connecting to it.
 */
const SOCKET_FILE = /^tw-s([1-9][0-9]{0,9})-([0-9]{1,20})-[0-9a-f]{16}\.sock$/;

/** A fresh path for this process's next listening socket, in the OS temporary directory. */
export function newSocketPath(): string {
  return join(tmpdir(), `tw-s${process.pid}-${selfStartTime()}-${randomBytes(8).toString('hex')}.sock`);
}

/** Unlink `path` when this process exits (until {@link forgetSocketAtExit}), like its segments. */
export function unlinkSocketAtExit(path: string): void {
  hookExit();
  exitSockets.add(path);
}

/** The transport unlinked `path` itself (its close()). */
export function forgetSocketAtExit(path: string): void {
  exitSockets.delete(path);
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
  /** Listening socket files (full paths) removed because the transport that made them is dead. */
  readonly removedSockets: readonly string[];
}

/**
 * Remove tensorwire segment names left behind by owners that died: the creator pid recorded
 * in the locator is gone (ESRCH), or it was reused by another process (start time differs).
 * The memory itself went with the owner (a memfd lives as long as its creator's descriptor
 * and any mapping); only the name is left. Locators that never became valid are removed
 * once older than `staleInitMs`.
 *
 * Also removes, from `socketDir` (default the OS temporary directory), the listening socket
 * files of cuda-ipc transports whose process is dead or was replaced (the pid and start time
 * are in the file name): only sockets of this uid, never a live process's.
 */
export function sweep(options: { dir?: string; staleInitMs?: number; socketDir?: string } = {}): SweepReport {
  const dir = options.dir ?? '/dev/shm';
  const staleInitMs = options.staleInitMs ?? 60_000;
  const removed: string[] = [];
  const skipped: { name: string; reason: string }[] = [];
  const removedSockets = sweepSockets(options.socketDir ?? tmpdir(), skipped);
  let kept = 0;
  let entries: string[];
  try {
    entries = readdirSync(dir);
  } catch (e) {
    return { removed, kept, skipped: [...skipped, { name: dir, reason: e instanceof Error ? e.message : String(e) }], removedSockets };
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
  return { removed, kept, skipped, removedSockets };
}

/** The socket files of dead transports in `dir`, unlinked; what could not be read goes to `skipped`. */
function sweepSockets(dir: string, skipped: { name: string; reason: string }[]): string[] {
  const removed: string[] = [];
  let entries: string[];
  try {
    entries = readdirSync(dir);
  } catch (e) {
    skipped.push({ name: dir, reason: e instanceof Error ? e.message : String(e) });
    return removed;
  }
  const uid = process.getuid?.();
  for (const entry of entries) {
    const m = SOCKET_FILE.exec(entry);
    if (m === null) continue;
    const path = join(dir, entry);
    try {
      const st = lstatSync(path);
      // A socket of this user only: anything else under that name is not a transport's.
      if (!st.isSocket() || (uid !== undefined && st.uid !== uid)) continue;
      if (isProcessAlive(Number(m[1]), BigInt(m[2] as string))) continue;
      unlinkSync(path);
      removed.push(path);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'ENOENT') skipped.push({ name: path, reason: e instanceof Error ? e.message : String(e) });
    }
  }
  return removed;
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
