// where a same-host leased fetch of 1024 x 64 KiB goes: read alone, acquire after a read, read of a fresh lease
import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
import { LockClient } from '@tensorwire/lock-client';
import { scatter, rng, kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = +(process.env.S ?? 65536), N = +(process.env.N ?? 1024);
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)], { execArgv: process.env.HPROF ? ['--cpu-prof', '--cpu-prof-dir=/tmp/prof-h'] : [] });
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
const destinations = Array.from(offsets, (_, i) => ({ local: reg, offset: i * S, length: S }));
const one = { owner: kvSpace(S), numbers: Uint32Array.of(5) };
const rel = [];
for (let i = 0; i < 4000; i++) { const g = await client.acquire(hello.lockAddress, one, { timeoutMs: 10000 }); await g.release(); }
for (let i = 0; i < 300; i++) { const f = await client.fetch(engine, hello.lockAddress, blocks, destinations, { timeoutMs: 10000 }); rel.push(f.release()); await engine.read(endpoint, requests); }
await Promise.all(rel.splice(0));
const t = { read: [], acqAfterRead: [], leaseRead: [], fetch: [], fetchAfterRead: [] };
for (let r = 0; r < 200; r++) {
  let a = performance.now(); await engine.read(endpoint, requests); t.read.push(performance.now() - a);
  a = performance.now(); const g = await client.acquire(hello.lockAddress, blocks, { timeoutMs: 10000 }); t.acqAfterRead.push(performance.now() - a);
  a = performance.now(); const f = await client.fetchLease(engine, g, destinations, {}); t.leaseRead.push(performance.now() - a);
  await f[Symbol.asyncDispose]();
  a = performance.now(); const f2 = await client.fetch(engine, hello.lockAddress, blocks, destinations, { timeoutMs: 10000 }); t.fetch.push(performance.now() - a);
  await f2[Symbol.asyncDispose]();
  rel.push(f.release(), f2.release()); if (rel.length > 32) await Promise.all(rel.splice(0));
}
await Promise.all(rel);
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(3);
for (const k of Object.keys(t)) console.log(k.padEnd(15), 'ms p10', q(t[k], .1), 'p50', q(t[k], .5), 'p90', q(t[k], .9));
await client.close(); await engine.close(); h.disconnect();
