import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory } from '@tensorwire/cuda-ipc';
const engine = new TransferEngine({ nodeId: 'h', transports: [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const S = 65536, REGION = 256 * 1024 * 1024;
const reg = await engine.register({ kind: 'host', buffer: allocateSharedMemory(REGION) });
const blocks = Uint32Array.from({ length: 1024 }, (_, i) => (i * 7919) % (REGION / S));
const cfgs = { both: {}, cuda: { transports: ['cuda-ipc'] }, tcp: { transports: ['tcp'] } };
const t = Object.fromEntries(Object.keys(cfgs).map((k) => [k, { g: [], r: [] }]));
for (let round = 0; round < 3000; round++) for (const [k, how] of Object.entries(cfgs)) {
  let a = performance.now(); const g = await engine.grant({ registration: reg, blockBytes: S, base: 0, blocks }, how); const gt = performance.now() - a;
  a = performance.now(); await g.revoke(); const rt = performance.now() - a;
  if (round > 1000) { t[k].g.push(gt); t[k].r.push(rt); }
}
const q = (x) => x.slice().sort((a, b) => a - b)[x.length >> 1].toFixed(4);
for (const k of Object.keys(t)) console.log(k.padEnd(5), 'grant p50 ms', q(t[k].g), 'revoke p50 ms', q(t[k].r));
await engine.close();
