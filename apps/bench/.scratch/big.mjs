import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory } from '@tensorwire/cuda-ipc';
const REGION = 256 * 1024 * 1024;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', '4096,65536']);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const engine = new TransferEngine({ nodeId: 'req', transports: [new CudaIpcTransport({ copyThreads: +(process.env.CT ?? 1) }), new TcpTransport()], logger: silentLogger });
await engine.start();
const S = +(process.env.S ?? 4194304);
const dest = Buffer.alloc(S);
const reg = await engine.register({ kind: 'host', buffer: dest });
const heap = Buffer.alloc(REGION, 1);
const shm = Buffer.from(allocateSharedMemory(REGION, 'x' + process.pid).buffer); shm.fill(2);
const off = 37 * S;
const p = await engine.prepare(endpoint, [{ local: reg, localOffset: 0, remote: descriptor, remoteOffset: off, length: S }], { op: 'read' });
const now = () => Number(process.hrtime.bigint()) / 1e3;
const t = { run: [], heap: [], shm: [] };
const fns = { run: () => p.run(), heap: () => { heap.copy(dest, 0, off, off + S); }, shm: () => { shm.copy(dest, 0, off, off + S); } };
const { minflt } = await import('./faults.mjs'); const f0 = {run:0,heap:0,shm:0};
for (let r = 0; r < +(process.env.R ?? 2000); r++) {
  for (const k of ['run', 'heap', 'shm']) { const m0 = minflt(); const a = now(); await fns[k](); t[k].push(now() - a); f0[k] += minflt() - m0; }
}
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(1);
for (const k in t) console.log(k.padEnd(5), 'p10', q(t[k], 0.1), 'p50', q(t[k], 0.5), 'p90', q(t[k], 0.9));
console.log('minor faults per call', JSON.stringify(Object.fromEntries(Object.entries(f0).map(([k,v])=>[k,v/2000]))));
{ const cp = globalThis.__cp.slice(-2000); console.log('native copyPlanned', 'p10', q(cp, .1), 'p50', q(cp, .5), 'p90', q(cp, .9)); }
console.log('ratio p50 heap/run', (q(t.heap, .5) / q(t.run, .5)).toFixed(3), 'shm/run', (q(t.shm, .5) / q(t.run, .5)).toFixed(3));
await p.close(); await engine.close(); h.disconnect();
