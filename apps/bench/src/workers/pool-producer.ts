/**
 * Pool producer: owns a host slot, writes tensors into it on request, and measures the
 * write against a plain memcpy (Uint8Array.set) of the same size into process-local memory.
 *
 * Fairness of the baseline: both copies read the same source buffer and write a
 * destination of the same size that was written one copy earlier (every round writes
 * both), so neither destination is warmer; the order alternates every round so neither
 * copy always runs right after the other; both get the same warm-up rounds (page faults,
 * JIT); and both are summarised the same way (median per-copy time over the rounds).
 */
import { TensorPool, allocateSharedMemory, native, releaseSharedMemory, type Device } from '@tensorwire/cuda-ipc';
import { workerInit } from '../proc.js';
import { interleavedNs, median } from '../stats.js';

const io = workerInit();
const pool = new TensorPool({ owner: `bench-producer-${process.pid}` });

/** Untimed rounds of each copy before measuring (first-touch faults, JIT, caches). */
const WARMUP_ROUNDS = 3;


io.onMessage((m) => {
  void (async () => {
    try {
      if (m['op'] === 'setup') {
        const size = m['size'] as number;
        const device = (m['device'] as Device | undefined) ?? 'cpu';
        const id = await pool.register({ dtype: 'uint8', byteLength: size, device });
        io.send({ op: 'ready', id });
      } else if (m['op'] === 'measure') {
        const id = m['id'] as string;
        const size = m['size'] as number;
        const rounds = m['rounds'] as number;
        const src = new Uint8Array(size);
        for (let i = 0; i < size; i++) src[i] = (i * 7 + 3) & 0xff;
        const local = new Uint8Array(size);
        // The first write into the fresh slot, timed on its own (no fault expected: the slot
        // was prefaulted when it was created), beside the first copy into fresh local memory.
        let t = process.hrtime.bigint();
        pool.writeSync(id, src);
        const firstWriteNs = Number(process.hrtime.bigint() - t);
        t = process.hrtime.bigint();
        local.set(src);
        const firstMemcpyNs = Number(process.hrtime.bigint() - t);
        for (let i = 0; i < WARMUP_ROUNDS; i++) {
          if (i % 2 === 0) {
            pool.writeSync(id, src);
            local.set(src);
          } else {
            local.set(src);
            pool.writeSync(id, src);
          }
        }
        const poolNs: number[] = [];
        const memcpyNs: number[] = [];
        for (let i = 0; i < rounds; i++) {
          // Alternate the order so both see the same machine state on average.
          if (i % 2 === 0) {
            t = process.hrtime.bigint();
            local.set(src);
            memcpyNs.push(Number(process.hrtime.bigint() - t));
            t = process.hrtime.bigint();
            pool.writeSync(id, src);
            poolNs.push(Number(process.hrtime.bigint() - t));
          } else {
            t = process.hrtime.bigint();
            pool.writeSync(id, src);
            poolNs.push(Number(process.hrtime.bigint() - t));
            t = process.hrtime.bigint();
            local.set(src);
            memcpyNs.push(Number(process.hrtime.bigint() - t));
          }
        }
        let sum = 0;
        for (let i = 0; i < size; i++) sum += src[i] as number;
        const total = (xs: number[]): number => xs.reduce((a, b) => a + b, 0) / 1e6;
        io.send({
          op: 'measured',
          // Per-copy medians (ms) and totals (ms) over the measured rounds.
          poolMedianMs: median(poolNs) / 1e6,
          memcpyMedianMs: median(memcpyNs) / 1e6,
          poolMs: total(poolNs),
          memcpyMs: total(memcpyNs),
          firstWriteMs: firstWriteNs / 1e6,
          firstMemcpyMs: firstMemcpyNs / 1e6,
          sum,
        });
      } else if (m['op'] === 'measure-cuda') {
        io.send({ op: 'measured', ...(await measureCuda(m['id'] as string, m['device'] as number, m['size'] as number, m['rounds'] as number)) });
      } else if (m['op'] === 'free') {
        await pool.free(m['id'] as string);
        io.send({ op: 'freed' });
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
 * A CUDA slot: `pool.write` of pageable host bytes (what a caller hands it) against
 * cuMemcpyHtoD of the same bytes from pinned host memory into a process-local device buffer,
 * and from the same pageable source (extra). Interleaved, order alternating, same warm-up,
 * medians. The slot is read back (D2H) and compared once at the end.
 */
async function measureCuda(id: string, device: number, size: number, rounds: number): Promise<Record<string, number>> {
  const src = new Uint8Array(size);
  for (let i = 0; i < size; i++) src[i] = (i * 7 + 3) & 0xff;
  const pinned = allocateSharedMemory(size, `bench-pinned-${process.pid}`);
  pinned.set(src);
  const local = await native.cudaAlloc(device, size);
  await native.cudaHostRegister(pinned);
  try {
    const poolWrite = (): Promise<void> => pool.write(id, src);
    const pinnedCopy = (): Promise<void> => native.cudaCopy('h2d', device, local, pinned, size);
    const pageableCopy = (): Promise<void> => native.cudaCopy('h2d', device, local, src, size);
    const t = process.hrtime.bigint();
    await poolWrite();
    const firstWriteNs = Number(process.hrtime.bigint() - t);
    const [poolNs, pinnedNs, pageableNs] = (await interleavedNs([poolWrite, pinnedCopy, pageableCopy], rounds, WARMUP_ROUNDS)) as [number[], number[], number[]];
    const back = new Uint8Array(size);
    await native.cudaCopy('d2h', device, back, await slotPointer(id), size);
    let sum = 0;
    let failures = 0;
    for (let i = 0; i < size; i++) {
      sum += src[i] as number;
      if (back[i] !== src[i]) failures++;
    }
    return {
      poolMedianMs: median(poolNs) / 1e6,
      pinnedMedianMs: median(pinnedNs) / 1e6,
      pageableMedianMs: median(pageableNs) / 1e6,
      firstWriteMs: firstWriteNs / 1e6,
      sum,
      failures: failures > 0 ? 1 : 0,
    };
  } finally {
    await native.cudaHostUnregister(pinned).catch(() => undefined);
    await native.cudaFree(device, local).catch(() => undefined);
    releaseSharedMemory(pinned);
  }
}

/** The owner's own device pointer of a CUDA slot (an owner's read is not an import). */
async function slotPointer(id: string): Promise<bigint> {
  const view = await pool.read(id);
  try {
    return view.devicePointer as bigint;
  } finally {
    view.dispose();
  }
}

io.send({ op: 'started' });
