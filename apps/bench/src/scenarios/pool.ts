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
import { BenchError, type Measurement, type Ratio, type Scenario, type ScenarioContext, type ScenarioResult } from '../types.js';

const MiB = 1024 * 1024;

async function ask(w: Worker, msg: Record<string, unknown>, reply: string, signal: AbortSignal): Promise<Record<string, unknown>> {
  w.send(msg);
  const m = await w.next((x) => x['op'] === reply || x['op'] === 'error', signal);
  if (m['op'] === 'error') throw new Error(String(m['message']));
  return m;
}

/** `cpu` (host slots, the default) or `cuda:N` (device slots exported by CUDA IPC handle). */
export interface PoolSettings {
  readonly device: 'cpu' | `cuda:${number}`;
}

/** Parse `--device`: `cpu` or `cuda:N`. */
export function poolDevice(text: string | undefined): PoolSettings['device'] {
  if (text === undefined || text === 'cpu') return 'cpu';
  if (/^cuda:\d{1,4}$/.test(text)) return text as `cuda:${number}`;
  throw new BenchError(`--device ${JSON.stringify(text)} must be cpu or cuda:N`);
}

export const pool: Scenario = (ctx) => poolScenario(ctx, { device: 'cpu' });

/**
 * Starts the producer and consumer workers, runs `each` for every size (with progress), then
 * closes both; they are killed whatever happens.
 */
async function withPoolWorkers(ctx: ScenarioContext, sizes: readonly number[], each: (producer: Worker, consumer: Worker, size: number) => Promise<void>): Promise<void> {
  const producer = spawnWorker('pool-producer');
  const consumer = spawnWorker('pool-consumer');
  try {
    await producer.next((m) => m['op'] === 'started', ctx.signal);
    await consumer.next((m) => m['op'] === 'started', ctx.signal);
    for (const [i, size] of sizes.entries()) {
      ctx.progress('pool', i, sizes.length);
      await each(producer, consumer, size);
    }
    ctx.progress('pool', sizes.length, sizes.length);
    await ask(producer, { op: 'close' }, 'closed', ctx.signal);
    await ask(consumer, { op: 'close' }, 'closed', ctx.signal);
  } finally {
    producer.kill();
    consumer.kill();
  }
}

export async function poolScenario(ctx: ScenarioContext, settings: PoolSettings): Promise<ScenarioResult> {
  const caps = capabilities();
  if (settings.device !== 'cpu') return poolCuda(ctx, Number(settings.device.slice(5)));
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
  await withPoolWorkers(ctx, sizes, async (producer, consumer, size) => {
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
  });
  const result: ScenarioResult = { scenario: 'pool', measurements, ratios, verificationFailures, notes };
  return result;
}

/**
 * `pool --device cuda:N`: the producer registers a device slot and writes host bytes into it
 * (against cuMemcpyHtoD from pinned memory); the consumer imports it by id (first import and
 * cached reads timed) and copies out of the imported pointer device-to-device (against
 * cuMemcpyDtoD between two local device buffers, goal ≥ 0.9) and device-to-host into pinned
 * memory (against the same from a local device buffer). Every copy is checked by byte sum.
 */
async function poolCuda(ctx: ScenarioContext, device: number): Promise<ScenarioResult> {
  const caps = capabilities();
  const name = `cuda:${device}`;
  if (!caps.cuda.available) return { scenario: 'pool', skipped: `${name}: ${caps.cuda.reason ?? 'CUDA unavailable'}`, measurements: [], ratios: [], verificationFailures: 0, notes: [] };
  if (device >= caps.cuda.devices.length) {
    return { scenario: 'pool', skipped: `${name} does not exist (devices: ${caps.cuda.devices.join(', ')})`, measurements: [], ratios: [], verificationFailures: 0, notes: [] };
  }
  const sizes = ctx.sizes ?? (ctx.quick ? [64 * 1024, 4 * MiB] : [4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]);
  const measurements: Measurement[] = [];
  const ratios: Ratio[] = [];
  const notes = [
    `device ${name}: ${caps.cuda.devices[device] ?? ''}`,
    'every copy is one driver call (cuMemcpy*Async on the addon\'s stream, then a stream sync) issued from JS; GB/s from the median per-copy time over interleaved rounds (order rotates each round) after untimed warm-ups of each',
    'pool write: pool.write() of pageable host bytes into the slot; baselines: cuMemcpyHtoD of the same bytes from pinned memory, and from the same pageable array, into a local device buffer',
    'imported d2d: cuMemcpyDtoD out of the pointer imported from the producer (cuIpcOpenMemHandle) into a local buffer; baseline: the same copy between two local device buffers of this process',
    'id → view: the first read imports the IPC handle; later reads hit the per-id import cache',
  ];
  let verificationFailures = 0;
  await withPoolWorkers(ctx, sizes, async (producer, consumer, size) => {
    const total = ctx.totalBytes ?? (ctx.quick ? 16 * MiB : 2 * 1024 * MiB);
    const rounds = Math.max(ctx.quick ? 9 : 21, Math.min(200, Math.floor(total / size)));
    const { id } = (await ask(producer, { op: 'setup', size, device: name }, 'ready', ctx.signal)) as { id: string };
    const w = (await ask(producer, { op: 'measure-cuda', id, device, size, rounds }, 'measured', ctx.signal)) as {
      poolMedianMs: number;
      pinnedMedianMs: number;
      pageableMedianMs: number;
      firstWriteMs: number;
      sum: number;
      failures: number;
    };
    const c = (await ask(consumer, { op: 'consume-cuda', id, device, rounds, sum: w.sum }, 'consumed', ctx.signal)) as {
      firstImportMs: number;
      cachedLatencies: number[];
      d2dImportMedianMs: number;
      d2dLocalMedianMs: number;
      d2hImportMedianMs: number;
      d2hLocalMedianMs: number;
      failures: number;
    };
    verificationFailures += w.failures + c.failures;
    await ask(producer, { op: 'free', id }, 'freed', ctx.signal);
    const g = (ms: number): number => gbps(size, ms);
    const extra = { rounds, statistic: 'median' } as const;
    measurements.push(
      { name: 'pool write (h2d, pageable source)', role: 'subject', blockBytes: size, gbps: g(w.poolMedianMs), extra: { ...extra, firstWriteMs: w.firstWriteMs } },
      { name: 'cuMemcpyHtoD from pinned', role: 'baseline', blockBytes: size, gbps: g(w.pinnedMedianMs), extra },
      { name: 'cuMemcpyHtoD from pageable', role: 'baseline', blockBytes: size, gbps: g(w.pageableMedianMs), extra },
      { name: 'imported d2d', role: 'subject', blockBytes: size, gbps: g(c.d2dImportMedianMs), extra },
      { name: 'local cuMemcpyDtoD', role: 'baseline', blockBytes: size, gbps: g(c.d2dLocalMedianMs), extra },
      { name: 'imported d2h to pinned', role: 'subject', blockBytes: size, gbps: g(c.d2hImportMedianMs), extra },
      { name: 'local cuMemcpyDtoH to pinned', role: 'baseline', blockBytes: size, gbps: g(c.d2hLocalMedianMs), extra },
      { name: 'id → view, first (imports)', role: 'subject', blockBytes: size, latency: summarize([c.firstImportMs]) },
      { name: 'id → view, cached import', role: 'subject', blockBytes: size, latency: summarize(c.cachedLatencies) },
    );
    const d2d = c.d2dImportMedianMs > 0 ? c.d2dLocalMedianMs / c.d2dImportMedianMs : 0;
    const cachedUs = summarize(c.cachedLatencies).p50Ms * 1000;
    ratios.push(
      { name: 'imported d2d / local d2d', subject: 'imported d2d', baseline: 'local cuMemcpyDtoD', blockBytes: size, value: d2d, goal: 0.9, pass: d2d >= 0.9 },
      { name: 'pool write / h2d from pinned', subject: 'pool write (h2d, pageable source)', baseline: 'cuMemcpyHtoD from pinned', blockBytes: size, value: w.poolMedianMs > 0 ? w.pinnedMedianMs / w.poolMedianMs : 0 },
      { name: 'imported d2h / local d2h (pinned)', subject: 'imported d2h to pinned', baseline: 'local cuMemcpyDtoH to pinned', blockBytes: size, value: c.d2hImportMedianMs > 0 ? c.d2hLocalMedianMs / c.d2hImportMedianMs : 0 },
    );
    ctx.log(
      `pool ${name} ${size} B: write ${g(w.poolMedianMs).toFixed(2)} GB/s vs h2d pinned ${g(w.pinnedMedianMs).toFixed(2)}; imported d2d ${g(c.d2dImportMedianMs).toFixed(1)} vs local ${g(c.d2dLocalMedianMs).toFixed(1)} GB/s; ` +
        `first import ${(c.firstImportMs * 1000).toFixed(0)} µs, cached p50 ${cachedUs.toFixed(1)} µs`,
    );
  });
  return { scenario: 'pool', measurements, ratios, verificationFailures, notes };
}
