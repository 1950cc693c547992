/**
 * `pool`: a producer process writes tensors into a host slot of @tensorwire/cuda-ipc, a
 * consumer process reads each by pool id as a zero-copy view and sums it (verified).
 * Ratios: write vs memcpy of the same size (goal ≥ 0.9, 4 MiB and up), the consumer's pass
 * over a view vs the same pass over process-local memory (goal ≥ 0.95). Latency: p50/p99
 * of id → view.
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
  const notes: string[] = [`cuda: ${caps.cuda.available ? caps.cuda.devices.join(', ') : `unavailable (${caps.cuda.reason})`}`];
  let verificationFailures = 0;
  const producer = spawnWorker('pool-producer');
  const consumer = spawnWorker('pool-consumer');
  try {
    await producer.next((m) => m['op'] === 'started', ctx.signal);
    await consumer.next((m) => m['op'] === 'started', ctx.signal);
    for (const [i, size] of sizes.entries()) {
      ctx.progress('pool', i, sizes.length);
      const total = ctx.totalBytes ?? (ctx.quick ? 16 * MiB : 2 * 1024 * MiB);
      const iters = Math.max(ctx.quick ? 3 : 10, Math.min(1000, Math.floor(total / size)));
      const { id } = (await ask(producer, { op: 'setup', size }, 'ready', ctx.signal)) as { id: string };
      const w = (await ask(producer, { op: 'measure', id, size, iters }, 'measured', ctx.signal)) as { poolMs: number; memcpyMs: number; sum: number };
      const c = (await ask(consumer, { op: 'consume', id, iters, sum: w.sum }, 'consumed', ctx.signal)) as {
        latencies: number[];
        viewMs: number;
        localMs: number;
        failures: number;
      };
      verificationFailures += c.failures;
      await ask(producer, { op: 'free', id }, 'freed', ctx.signal);
      const bytes = size * iters;
      const writeG = gbps(bytes, w.poolMs);
      const memcpyG = gbps(bytes, w.memcpyMs);
      const viewG = gbps(bytes, c.viewMs);
      const localG = gbps(bytes, c.localMs);
      measurements.push(
        { name: 'pool write (seqlocked)', role: 'subject', blockBytes: size, totalBytes: bytes, gbps: writeG },
        { name: 'memcpy (Uint8Array.set)', role: 'baseline', blockBytes: size, totalBytes: bytes, gbps: memcpyG },
        { name: 'consumer sum over view', role: 'subject', blockBytes: size, totalBytes: bytes, gbps: viewG },
        { name: 'consumer sum over local memory', role: 'baseline', blockBytes: size, totalBytes: bytes, gbps: localG },
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
      ctx.log(`pool ${size} B: write ${writeG.toFixed(2)} GB/s vs memcpy ${memcpyG.toFixed(2)} GB/s; view pass ${viewG.toFixed(2)} vs local ${localG.toFixed(2)} GB/s`);
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
