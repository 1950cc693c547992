/**
 * `pool`: a producer process writes tensors into a host slot of @tensorwire/cuda-ipc, a
 * consumer process reads each by pool id as a zero-copy view and sums it (verified).
 * Ratios: write vs memcpy of the same size (goal ≥ 0.9, 4 MiB and up), the consumer's pass
 * over a view vs the same pass over process-local memory (goal ≥ 0.95), each from per-op
 * medians over interleaved rounds (see the notes in the output). Latency: p50/p99 of id → view.
 */
import { capabilities } from '@tensorwire/cuda-ipc';
import { spawnWorker, type Worker } from '../proc.js';
import { gbps, summarize } from '../stats.js';
import type { Measurement, Ratio, Scenario, ScenarioResult } from '../types.js';

const MiB = 1024 * 1024;

async function ask(w: Worker, msg: Record<string, unknown>, reply: string, signal: AbortSignal): Promise<Record<string, unknown>> {
  w.send(msg);
  const m = await w.next((x) => x['op'] === reply || x['op'] === 'error', signal);
  if (m['op'] === 'error') throw new Error(String(m['message']));
  return m;
}

export const pool: Scenario = async (ctx) => {
  const caps = capabilities();
  if (!caps.sharedMemory.available) {
    return { scenario: 'pool', skipped: caps.sharedMemory.reason ?? 'shared memory unavailable', measurements: [], ratios: [], verificationFailures: 0, notes: [] };
  }
  const sizes = ctx.sizes ?? (ctx.quick ? [64 * 1024, 4 * MiB] : [4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]);
  const measurements: Measurement[] = [];
  const ratios: Ratio[] = [];
  const notes: string[] = [
    `cuda: ${caps.cuda.available ? caps.cuda.devices.join(', ') : `unavailable (${caps.cuda.reason})`}`,
    'write vs memcpy: GB/s from the median per-copy time over interleaved rounds (order alternates each round) after 3 warm-up rounds of each; ' +
      'both copies read the same source buffer and both destinations (the slot, a local Uint8Array of the same size) are written every round, so neither is warmer. ' +
      'Means over all rounds and the first (cold) copy are in each measurement\'s extra.',
    'view pass vs local pass: the same sum() over the view and over a process-local copy of the same bytes, interleaved (order alternates each round) after 2 warm-up passes of each; GB/s from the median pass time.',
  ];
  let verificationFailures = 0;
  const producer = spawnWorker('pool-producer');
  const consumer = spawnWorker('pool-consumer');
  try {
    await producer.next((m) => m['op'] === 'started', ctx.signal);
    await consumer.next((m) => m['op'] === 'started', ctx.signal);
    for (const [i, size] of sizes.entries()) {
      ctx.progress('pool', i, sizes.length);
      const total = ctx.totalBytes ?? (ctx.quick ? 16 * MiB : 2 * 1024 * MiB);
      const byTotal = Math.min(1000, Math.floor(total / size));
      // Medians need rounds: the producer's copies are cheap, the consumer's JS pass is not.
      const writeRounds = Math.max(ctx.quick ? 25 : 31, byTotal);
      const readRounds = Math.max(ctx.quick ? 9 : 11, byTotal);
      const { id } = (await ask(producer, { op: 'setup', size }, 'ready', ctx.signal)) as { id: string };
      const w = (await ask(producer, { op: 'measure', id, size, rounds: writeRounds }, 'measured', ctx.signal)) as {
        poolMedianMs: number;
        memcpyMedianMs: number;
        poolMs: number;
        memcpyMs: number;
        firstWriteMs: number;
        firstMemcpyMs: number;
        sum: number;
      };
      const c = (await ask(consumer, { op: 'consume', id, rounds: readRounds, sum: w.sum }, 'consumed', ctx.signal)) as {
        latencies: number[];
        viewMedianMs: number;
        localMedianMs: number;
        viewMs: number;
        localMs: number;
        firstPassMs: number;
        failures: number;
      };
      verificationFailures += c.failures;
      await ask(producer, { op: 'free', id }, 'freed', ctx.signal);
      // Figures are per-op medians over interleaved rounds (see the notes); the means over
      // all rounds and the first (cold) op are kept in `extra`.
      const writeG = gbps(size, w.poolMedianMs);
      const memcpyG = gbps(size, w.memcpyMedianMs);
      const viewG = gbps(size, c.viewMedianMs);
      const localG = gbps(size, c.localMedianMs);
      const wBytes = size * writeRounds;
      const rBytes = size * readRounds;
      measurements.push(
        {
          name: 'pool write (seqlocked)',
          role: 'subject',
          blockBytes: size,
          totalBytes: wBytes,
          gbps: writeG,
          extra: { rounds: writeRounds, statistic: 'median', meanGbps: gbps(wBytes, w.poolMs), firstWriteMs: w.firstWriteMs },
        },
        {
          name: 'memcpy (Uint8Array.set)',
          role: 'baseline',
          blockBytes: size,
          totalBytes: wBytes,
          gbps: memcpyG,
          extra: { rounds: writeRounds, statistic: 'median', meanGbps: gbps(wBytes, w.memcpyMs), firstCopyMs: w.firstMemcpyMs },
        },
        {
          name: 'consumer sum over view',
          role: 'subject',
          blockBytes: size,
          totalBytes: rBytes,
          gbps: viewG,
          extra: { rounds: readRounds, statistic: 'median', meanGbps: gbps(rBytes, c.viewMs), firstPassMs: c.firstPassMs },
        },
        {
          name: 'consumer sum over local memory',
          role: 'baseline',
          blockBytes: size,
          totalBytes: rBytes,
          gbps: localG,
          extra: { rounds: readRounds, statistic: 'median', meanGbps: gbps(rBytes, c.localMs) },
        },
        { name: 'id → view', role: 'subject', blockBytes: size, latency: summarize(c.latencies) },
      );
      const writeRatio = memcpyG > 0 ? writeG / memcpyG : 0;
      const readRatio = localG > 0 ? viewG / localG : 0;
      ratios.push(
        size >= 4 * MiB
          ? { name: 'write / memcpy', subject: 'pool write (seqlocked)', baseline: 'memcpy (Uint8Array.set)', blockBytes: size, value: writeRatio, goal: 0.9, pass: writeRatio >= 0.9 }
          : { name: 'write / memcpy', subject: 'pool write (seqlocked)', baseline: 'memcpy (Uint8Array.set)', blockBytes: size, value: writeRatio },
        { name: 'view pass / local pass', subject: 'consumer sum over view', baseline: 'consumer sum over local memory', blockBytes: size, value: readRatio, goal: 0.95, pass: readRatio >= 0.95 },
      );
      ctx.log(
        `pool ${size} B: write ${writeG.toFixed(2)} GB/s vs memcpy ${memcpyG.toFixed(2)} GB/s (median of ${writeRounds}; first write ${w.firstWriteMs.toFixed(3)} ms); ` +
          `view pass ${viewG.toFixed(2)} vs local ${localG.toFixed(2)} GB/s (median of ${readRounds}; first pass ${gbps(size, c.firstPassMs).toFixed(2)} GB/s)`,
      );
    }
    ctx.progress('pool', sizes.length, sizes.length);
    await ask(producer, { op: 'close' }, 'closed', ctx.signal);
    await ask(consumer, { op: 'close' }, 'closed', ctx.signal);
  } finally {
    producer.kill();
    consumer.kill();
  }
  const result: ScenarioResult = { scenario: 'pool', measurements, ratios, verificationFailures, notes };
  return result;
};
