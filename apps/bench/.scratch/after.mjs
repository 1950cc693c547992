import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
import { LockClient } from '@tensorwire/lock-client';
import { scatter, rng, kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = 65536, N = 1024;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)]);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const engine = new TransferEngine({ nodeId: 'req', transports: [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const dest = Buffer.alloc(S * N); const reg = await engine.register({ kind: 'host', buffer: dest });
const offsets = scatter({ blockBytes: S, layers: 32, blocks: N / 32 }, REGION, rng(1));
const requests = Array.from(offsets, (o, i) => ({ local: reg, localOffset: i * S, remote: descriptor, remoteOffset: o, length: S }));
const blocks = { owner: kvSpace(S), numbers: Uint32Array.from(offsets, (o) => o / S) };
const heapSrc = Buffer.alloc(S * N, 3), heapDst = Buffer.alloc(S * N);
const one = { owner: kvSpace(S), numbers: Uint32Array.of(5) };
for (let i = 0; i < 4000; i++) { const g = await client.acquire(hello.lockAddress, one, { timeoutMs: 10000 }); await g.release(); }
const ops = {
  b2b: async () => {},
  spin5: async () => { const t = performance.now(); while (performance.now() - t < 5); },
  sleep5: () => new Promise((r) => setTimeout(r, 5)),
  read64: async () => { await engine.read(endpoint, requests); },
  copy64: async () => { heapSrc.copy(heapDst); },
};
const keys = Object.keys(ops); const t = Object.fromEntries(keys.map((k) => [k, []])); const rel = [];
for (let r = 0; r < 150; r++) for (const k of keys) {
  await ops[k]();
  const a = performance.now(); const g = await client.acquire(hello.lockAddress, blocks, { timeoutMs: 10000 }); const d = performance.now() - a;
  rel.push(g.release()); if (rel.length > 32) await Promise.all(rel.splice(0));
  if (r >= 20) t[k].push(d);
}
await Promise.all(rel);
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(3);
for (const k of keys) console.log(k.padEnd(7), 'acquire(1024 blocks) ms p10', q(t[k], .1), 'p50', q(t[k], .5), 'p90', q(t[k], .9));
await client.close(); await engine.close(); h.disconnect();
