/**
 * Pool consumer: opens the producer's slot by id as a zero-copy view, sums it, and compares
 * the same summing pass over process-local memory. Also measures id-to-view latency.
 */
import { TensorPool } from '@tensorwire/cuda-ipc';
import { workerInit } from '../proc.js';

const io = workerInit();
const pool = new TensorPool({ owner: `bench-consumer-${process.pid}` });

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
        const iters = m['iters'] as number;
        const expected = m['sum'] as number;
        const latencies: number[] = [];
        let viewNs = 0n;
        let localNs = 0n;
        let failures = 0;
        let bytes = 0;
        for (let i = 0; i < iters; i++) {
          // The first read maps the segment; later ones hit the per-id cache (both are id → view).
          let t = process.hrtime.bigint();
          const view = pool.readSync(id);
          latencies.push(Number(process.hrtime.bigint() - t) / 1e6);
          const buf = view.buffer as Uint8Array;
          if (i === 0) bytes = buf.byteLength;
          const local = i === 0 ? buf.slice() : undefined;
          t = process.hrtime.bigint();
          const s = sum(buf);
          viewNs += process.hrtime.bigint() - t;
          if (s !== expected || !view.isConsistent()) failures++;
          view.dispose();
          if (local) sum(local); // warm
        }
        const local = new Uint8Array(bytes);
        local.set(pool.snapshot(id).data);
        for (let i = 0; i < iters; i++) {
          const t = process.hrtime.bigint();
          const s = sum(local);
          localNs += process.hrtime.bigint() - t;
          if (s !== expected) failures++;
        }
        await pool.free(id); // a consumer's free releases only its own mapping
        io.send({ op: 'consumed', latencies, viewMs: Number(viewNs) / 1e6, localMs: Number(localNs) / 1e6, failures });
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
