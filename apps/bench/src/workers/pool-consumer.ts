/**
 * Pool consumer: opens the producer's slot by id as a zero-copy view, sums it, and compares
 * the same summing pass over a process-local copy of the same bytes. Also measures
 * id-to-view latency.
 *
 * Fairness: one `sum` function (same JIT code) runs over both; both get the same untimed
 * warm-up passes; every round does one pass over each, alternating which goes first; each
 * is summarised by its median pass time.
 */
import { TensorPool } from '@tensorwire/cuda-ipc';
import { workerInit } from '../proc.js';
import { median } from '../stats.js';

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
      } else if (m['op'] === 'close') {
        await pool.close();
        io.send({ op: 'closed' });
      }
    } catch (e) {
      io.send({ op: 'error', message: e instanceof Error ? e.message : String(e) });
    }
  })();
});
io.send({ op: 'started' });
