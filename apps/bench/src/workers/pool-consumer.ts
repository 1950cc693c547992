/**
 * Pool consumer: opens the producer's slot by id as a zero-copy view, sums it, and compares
 * the same summing pass over a process-local copy of the same bytes. Also measures
 * id-to-view latency.
 *
 * Fairness: one `sum` function (same JIT code) runs over both; both get the same untimed
 * warm-up passes; every round does one pass over each, alternating which goes first; each
 * is summarised by its median pass time.
 */
import { TensorPool, allocateSharedMemory, native, releaseSharedMemory } from '@tensorwire/cuda-ipc';
import { workerInit } from '../proc.js';
import { interleavedNs, median } from '../stats.js';

const io = workerInit();
const pool = new TensorPool({ owner: `bench-consumer-${process.pid}` });

/** Untimed passes over each buffer before measuring. */
const WARMUP_PASSES = 2;

function sum(a: Uint8Array): number {
  let s = 0;
  for (let i = 0; i < a.length; i++) s += a[i] as number;
  return s;
}


io.onMessage((m) => {
  void (async () => {
    try {
      if (m['op'] === 'consume') {
        const id = m['id'] as string;
        const rounds = m['rounds'] as number;
        const expected = m['sum'] as number;
        const latencies: number[] = [];
        const viewNs: number[] = [];
        const localNs: number[] = [];
        let failures = 0;
        // The first read maps the segment (prefaulted); later ones hit the per-id cache.
        // Both are id → view and both are in the latency samples.
        let t = process.hrtime.bigint();
        const first = pool.readSync(id);
        latencies.push(Number(process.hrtime.bigint() - t) / 1e6);
        const firstBuf = first.buffer as Uint8Array;
        // The first pass over the freshly mapped view, timed on its own.
        t = process.hrtime.bigint();
        const s0 = sum(firstBuf);
        const firstPassNs = Number(process.hrtime.bigint() - t);
        if (s0 !== expected || !first.isConsistent()) failures++;
        // Process-local memory holding the same bytes (a consistent snapshot).
        const local = new Uint8Array(firstBuf.byteLength);
        pool.snapshot(id, local);
        if (sum(local) !== expected) failures++;
        for (let i = 0; i < WARMUP_PASSES; i++) {
          sum(firstBuf);
          sum(local);
        }
        first.dispose();
        for (let i = 0; i < rounds; i++) {
          t = process.hrtime.bigint();
          const view = pool.readSync(id);
          latencies.push(Number(process.hrtime.bigint() - t) / 1e6);
          const buf = view.buffer as Uint8Array;
          let sv: number;
          let sl: number;
          if (i % 2 === 0) {
            t = process.hrtime.bigint();
            sv = sum(buf);
            viewNs.push(Number(process.hrtime.bigint() - t));
            t = process.hrtime.bigint();
            sl = sum(local);
            localNs.push(Number(process.hrtime.bigint() - t));
          } else {
            t = process.hrtime.bigint();
            sl = sum(local);
            localNs.push(Number(process.hrtime.bigint() - t));
            t = process.hrtime.bigint();
            sv = sum(buf);
            viewNs.push(Number(process.hrtime.bigint() - t));
          }
          if (sv !== expected || !view.isConsistent()) failures++;
          if (sl !== expected) failures++;
          view.dispose();
        }
        await pool.free(id); // a consumer's free releases only its own mapping
        const total = (xs: number[]): number => xs.reduce((a, b) => a + b, 0) / 1e6;
        io.send({
          op: 'consumed',
          latencies,
          viewMedianMs: median(viewNs) / 1e6,
          localMedianMs: median(localNs) / 1e6,
          viewMs: total(viewNs),
          localMs: total(localNs),
          firstPassMs: firstPassNs / 1e6,
          failures,
        });
      } else if (m['op'] === 'consume-cuda') {
        io.send({ op: 'consumed', ...(await consumeCuda(m['id'] as string, m['device'] as number, m['rounds'] as number, m['sum'] as number)) });
      } else if (m['op'] === 'close') {
        await pool.close();
        io.send({ op: 'closed' });
      }
    } catch (e) {
      io.send({ op: 'error', message: e instanceof Error ? e.message : String(e) });
    }
  })();
});
/**
 * A CUDA slot: id → view latency (the first read imports the IPC handle, later ones hit the
 * per-id cache), then device-to-device copies out of the imported pointer into a local device
 * buffer against cuMemcpyDtoD between two local device buffers holding the same bytes, and
 * device-to-host copies into pinned memory from the imported pointer against the same from the
 * local copy. Interleaved, order alternating, same warm-up, medians; every destination checked.
 */
async function consumeCuda(id: string, device: number, rounds: number, expected: number): Promise<Record<string, unknown>> {
  let t = process.hrtime.bigint();
  const first = await pool.read(id);
  const firstImportMs = Number(process.hrtime.bigint() - t) / 1e6;
  const size = first.byteLength;
  const imported = first.devicePointer as bigint;
  first.dispose();
  const cached: number[] = [];
  for (let i = 0; i < Math.max(rounds, 100); i++) {
    t = process.hrtime.bigint();
    const v = await pool.read(id);
    cached.push(Number(process.hrtime.bigint() - t) / 1e6);
    if (v.devicePointer !== imported) throw new Error('a cached read returned another device pointer');
    v.dispose();
  }
  const view = await pool.read(id); // held while copying: the import stays
  const a = await native.cudaAlloc(device, size);
  const b = await native.cudaAlloc(device, size);
  const pinned = allocateSharedMemory(size, `bench-pinned-${process.pid}`);
  await native.cudaHostRegister(pinned);
  let failures = 0;
  try {
    await native.cudaCopy('d2d', device, b, imported, size); // the local copy of the slot's bytes
    const fromImport = (): Promise<void> => native.cudaCopy('d2d', device, a, imported, size);
    const local = (): Promise<void> => native.cudaCopy('d2d', device, a, b, size);
    const importToHost = (): Promise<void> => native.cudaCopy('d2h', device, pinned, imported, size);
    const localToHost = (): Promise<void> => native.cudaCopy('d2h', device, pinned, b, size);
    // Alternating order (a rotation of two), the same warm-up for both.
    const timedPair = async (x: () => Promise<void>, y: () => Promise<void>): Promise<[number[], number[]]> => (await interleavedNs([x, y], rounds, WARMUP_PASSES + 1)) as [number[], number[]];
    const [d2dImport, d2dLocal] = await timedPair(fromImport, local);
    const check = new Uint8Array(size);
    await native.cudaCopy('d2h', device, check, a, size);
    if (sum(check) !== expected) failures++;
    const [d2hImport, d2hLocal] = await timedPair(importToHost, localToHost);
    await importToHost();
    if (sum(pinned) !== expected) failures++;
    return {
      firstImportMs,
      cachedLatencies: cached,
      d2dImportMedianMs: median(d2dImport) / 1e6,
      d2dLocalMedianMs: median(d2dLocal) / 1e6,
      d2hImportMedianMs: median(d2hImport) / 1e6,
      d2hLocalMedianMs: median(d2hLocal) / 1e6,
      failures,
    };
  } finally {
    view.dispose();
    await native.cudaHostUnregister(pinned).catch(() => undefined);
    releaseSharedMemory(pinned);
    await native.cudaFree(device, a).catch(() => undefined);
    await native.cudaFree(device, b).catch(() => undefined);
    await pool.free(id); // a consumer's free closes only its own import
  }
}

io.send({ op: 'started' });
