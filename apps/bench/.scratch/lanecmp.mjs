import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
import { LockClient } from '@tensorwire/lock-client';
import { scatter, rng, kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = +(process.env.S ?? 65536), N = +(process.env.N ?? 1024);
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)]);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const engine = new TransferEngine({ nodeId: 'req', transports: [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const lane = new LockClient({ requesterId: 'r1', logger: silentLogger });
const grpcc = new LockClient({ requesterId: 'r2', logger: silentLogger, localLane: false });
const dest = Buffer.alloc(S * N); const reg = await engine.register({ kind: 'host', buffer: dest });
const offsets = scatter({ blockBytes: S, layers: 32, blocks: N / 32 }, REGION, rng(1));
const requests = Array.from(offsets, (o, i) => ({ local: reg, localOffset: i * S, remote: descriptor, remoteOffset: o, length: S }));
const blocks = { owner: kvSpace(S), numbers: Uint32Array.from(offsets, (o) => o / S) };
const destinations = Array.from(offsets, (_, i) => ({ local: reg, offset: i * S, length: S }));
const one = { owner: kvSpace(S), numbers: Uint32Array.of(5) };
const rel = [];
for (const c of [lane, grpcc]) for (let i = 0; i < 3000; i++) { const g = await c.acquire(hello.lockAddress, one, { timeoutMs: 10000 }); await g.release(); }
console.log('lane stats', JSON.stringify(lane.sessionStats().get(hello.lockAddress)), 'grpc stats', JSON.stringify(grpcc.sessionStats().get(hello.lockAddress)));
const t = { read: [], 'acq lane': [], 'acq grpc': [], 'fetch lane': [], 'fetch grpc': [], 'acq1 b2b lane': [], 'acq1 b2b grpc': [] };
for (let r = 0; r < 300; r++) {
  for (const [name, c] of [['lane', lane], ['grpc', grpcc]]) {
    let a = performance.now(); await engine.read(endpoint, requests); t.read.push(performance.now() - a);
    a = performance.now(); const g = await c.acquire(hello.lockAddress, blocks, { timeoutMs: 10000 }); t[`acq ${name}`].push(performance.now() - a); rel.push(g.release());
    a = performance.now(); const f = await c.fetch(engine, hello.lockAddress, blocks, destinations, { timeoutMs: 10000 }); t[`fetch ${name}`].push(performance.now() - a); rel.push(f.release());
    a = performance.now(); const g1 = await c.acquire(hello.lockAddress, one, { timeoutMs: 10000 }); t[`acq1 b2b ${name}`].push(performance.now() - a); rel.push(g1.release());
    if (rel.length > 30) await Promise.all(rel.splice(0));
  }
}
await Promise.all(rel);
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(3);
for (const k of Object.keys(t)) console.log(k.padEnd(14), 'ms p10', q(t[k], .1), 'p50', q(t[k], .5), 'p90', q(t[k], .9));
await lane.close(); await grpcc.close(); await engine.close(); h.disconnect();
