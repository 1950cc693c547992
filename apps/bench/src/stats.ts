import type { SessionStats } from '@tensorwire/lock-client';

/** Percentile by nearest rank on a copy of the samples. */
export function percentile(samples: readonly number[], p: number): number {
  if (samples.length === 0) return Number.NaN;
  const sorted = [...samples].sort((a, b) => a - b);
  const rank = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[rank] as number;
}

export function summarize(samplesMs: readonly number[], keep = 2000): { count: number; p50Ms: number; p99Ms: number; samplesMs: number[] } {
  const step = Math.max(1, Math.floor(samplesMs.length / keep));
  const kept: number[] = [];
  for (let i = 0; i < samplesMs.length; i += step) kept.push(samplesMs[i] as number);
  return { count: samplesMs.length, p50Ms: percentile(samplesMs, 50), p99Ms: percentile(samplesMs, 99), samplesMs: kept };
}

/** Decimal GB/s. */
export function gbps(bytes: number, ms: number): number {
  return ms <= 0 ? 0 : bytes / (ms / 1000) / 1e9;
}

export function nowMs(): number {
  return Number(process.hrtime.bigint()) / 1e6;
}

/**
 * Untimed warm-up calls in a window of 100 at each end, as notes print them: `median of the
 * first 100 X ms, of the last 100 Y ms` (how far V8 took the path before anything was timed).
 */
export function warmupTrend(timesMs: readonly number[]): string {
  return `median of the first 100 ${median(timesMs.slice(0, 100)).toFixed(3)} ms, of the last 100 ${median(timesMs.slice(-100)).toFixed(3)} ms`;
}

/** Whether a LockClient's Session to a holder ever opened the holder's local lane (its `sessionStats()` entry). */
export function usedLocalLane(session: SessionStats): boolean {
  return session.lanesOpened > 0;
}

/**
 * Which path a LockClient's lease calls to a holder took, for a note: `over the holder's local
 * lane (n of m streams opened)` or `over the gRPC Session stream …`; undefined when the client
 * made no Session call to it.
 */
export function leaseCallPath(session: SessionStats | undefined): string | undefined {
  if (session === undefined) return undefined;
  return usedLocalLane(session)
    ? `over the holder's local lane (${session.lanesOpened} of ${session.opened} streams opened)`
    : 'over the gRPC Session stream (the holder offered no local lane, or it could not be reached)';
}

/**
 * Untimed one-block leased fetches that bring the lease path to steady state before a scenario
 * times it (kv per lane, run per round's fresh requester). V8 compiles @grpc/grpc-js, the lock
 * client and the holder's lease code over thousands of calls: an acquire of 1,024 blocks took
 * about 1.0 ms over its first 500 calls and about 0.25 ms after 3,000 on this project's test host.
 */
export const LEASE_PATH_WARMUP = 3000;

/** Median (mean of the two middle values for an even count); 0 for no samples. */
export function median(xs: readonly number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const n = s.length;
  if (n === 0) return 0;
  return n % 2 === 1 ? (s[(n - 1) / 2] as number) : ((s[n / 2 - 1] as number) + (s[n / 2] as number)) / 2;
}

/**
 * Runs each op `warmups` times (in order), then `rounds` rounds of all of them, the order
 * rotating by one each round so none always goes first; returns each op's per-call times in ns.
 */
export async function interleavedNs(ops: readonly (() => Promise<unknown>)[], rounds: number, warmups: number): Promise<number[][]> {
  for (let i = 0; i < warmups; i++) for (const op of ops) await op();
  const times = ops.map((): number[] => []);
  for (let i = 0; i < rounds; i++) {
    for (let k = 0; k < ops.length; k++) {
      const j = (i + k) % ops.length;
      const t = process.hrtime.bigint();
      await (ops[j] as () => Promise<unknown>)();
      (times[j] as number[]).push(Number(process.hrtime.bigint() - t));
    }
  }
  return times;
}
