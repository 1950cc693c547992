/**
 * The contract every bench scenario implements. A scenario runs its subject and its
 * baselines in the same process tree at the same time, verifies every byte it moves,
 * and returns figures; the CLI renders them as a table, JSON (schema in schema.ts) or HTML.
 */

export interface LatencySummary {
  readonly count: number;
  readonly p50Ms: number;
  readonly p99Ms: number;
  /** Every sample (ms), for the HTML report's distribution chart; may be down-sampled. */
  readonly samplesMs?: readonly number[];
}

export interface Measurement {
  /** What was measured, e.g. "tcp read (engine)", "raw node:net stream", "memcpy". */
  readonly name: string;
  readonly role: 'subject' | 'baseline' | 'external';
  readonly blockBytes?: number;
  readonly totalBytes?: number;
  /** Decimal gigabytes per second (1e9 B/s). */
  readonly gbps?: number;
  readonly opsPerSec?: number;
  readonly latency?: LatencySummary;
  /** Descriptors (ranges) per operation, where an operation moves a list of them (the `kv` scenario). */
  readonly descriptors?: number;
  /** Descriptors moved per second. */
  readonly descriptorsPerSec?: number;
  /** The transport the engine used for this measurement, where an engine moved the bytes. */
  readonly transport?: string;
  readonly extra?: Readonly<Record<string, number | string | boolean>>;
}

export interface Ratio {
  readonly name: string;
  readonly subject: string;
  readonly baseline: string;
  readonly blockBytes?: number;
  /** Descriptors per operation of both sides, where it matters (the `kv` scenario). */
  readonly descriptors?: number;
  readonly value: number;
  /** Where `value` is the median of per-round ratios (subject and baseline measured in the same round): those ratios, in round order. */
  readonly rounds?: readonly number[];
  /** The goal from the issue (e.g. 0.9); `pass` is value >= goal. */
  readonly goal?: number;
  readonly pass?: boolean;
}

export interface ScenarioResult {
  readonly scenario: string;
  /** Set when the scenario could not run on this machine; says exactly why. */
  readonly skipped?: string;
  readonly measurements: readonly Measurement[];
  readonly ratios: readonly Ratio[];
  /** Bytes or tensors that failed verification. Must be 0. */
  readonly verificationFailures: number;
  /** Scenario-specific counters, e.g. the holder's lease counters. */
  readonly counters?: Readonly<Record<string, number>>;
  /** Human-readable facts: the transport chosen and why, tool versions, what was not installed. */
  readonly notes: readonly string[];
}

export interface ScenarioContext {
  readonly signal: AbortSignal;
  /** Tiny sizes and few iterations, for CI smoke tests. */
  readonly quick: boolean;
  /** Block sizes to sweep, when the user gave them. */
  readonly sizes?: readonly number[];
  /** Total bytes per measurement, when the user gave it. */
  readonly totalBytes?: number;
  /** `--compare`: a scenario that runs external tools itself (kv) runs them at its own sizes. */
  readonly compare?: boolean;
  progress(label: string, done: number, total: number): void;
  log(line: string): void;
}

export type Scenario = (ctx: ScenarioContext) => Promise<ScenarioResult>;

/** A failure the CLI prints as one line, without a stack trace. */
export class BenchError extends Error {
  override readonly name = 'BenchError';
}
