/**
 * Pool producer: owns a host slot, writes tensors into it on request, and measures the
 * write against a plain memcpy (Uint8Array.set) of the same size into process-local memory.
 */
import { TensorPool } from '@tensorwire/cuda-ipc';
import { workerInit } from '../proc.js';

const io = workerInit();
const pool = new TensorPool({ owner: `bench-producer-${process.pid}` });

io.onMessage((m) => {
  void (async () => {
    try {
      if (m['op'] === 'setup') {
        const size = m['size'] as number;
        const id = await pool.register({ dtype: 'uint8', byteLength: size });
        io.send({ op: 'ready', id });
      } else if (m['op'] === 'measure') {
        const id = m['id'] as string;
        const size = m['size'] as number;
        const iters = m['iters'] as number;
        const src = new Uint8Array(size);
        for (let i = 0; i < size; i++) src[i] = (i * 7 + 3) & 0xff;
        const local = new Uint8Array(size);
        // Warm both paths (page faults, caches).
        pool.writeSync(id, src);
        local.set(src);
        let poolNs = 0n;
        let memcpyNs = 0n;
        for (let i = 0; i < iters; i++) {
          // Alternate so both see the same machine state.
          let t = process.hrtime.bigint();
          local.set(src);
          memcpyNs += process.hrtime.bigint() - t;
          t = process.hrtime.bigint();
          pool.writeSync(id, src);
          poolNs += process.hrtime.bigint() - t;
        }
        let sum = 0;
        for (let i = 0; i < size; i++) sum += src[i] as number;
        io.send({ op: 'measured', poolMs: Number(poolNs) / 1e6, memcpyMs: Number(memcpyNs) / 1e6, sum });
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
io.send({ op: 'started' });
