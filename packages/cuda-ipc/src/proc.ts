import { readFileSync } from 'node:fs';

/** The start time of `pid` (clock ticks since boot, /proc/<pid>/stat field 22), or 0n if unknown. */
export function processStartTime(pid: number): bigint {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const rest = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    const v = rest[19];
    return v !== undefined && /^\d+$/.test(v) ? BigInt(v) : 0n;
  } catch {
    return 0n;
  }
}

let selfStart: bigint | undefined;
export function selfStartTime(): bigint {
  selfStart ??= processStartTime(process.pid);
  return selfStart;
}

/**
 * True when `pid` is alive and (when `startTime` is known) is still the same process, so a
 * recycled pid does not keep a dead owner's segments alive.
 */
export function isProcessAlive(pid: number, startTime = 0n): boolean {
  if (!Number.isSafeInteger(pid) || pid <= 0) return false;
  try {
    process.kill(pid, 0);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === 'ESRCH') return false;
    if (code !== 'EPERM') return false;
  }
  if (startTime !== 0n) {
    const now = processStartTime(pid);
    if (now !== 0n && now !== startTime) return false;
  }
  return true;
}
