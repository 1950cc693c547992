// A/B in one process: client.fetch (rebound prepared transfer) vs the old read path (acquire, decode, engine.read), beside engine.read alone
import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger, decodeDescriptor } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
import { LockClient, decodeFetchDescriptor } from '@tensorwire/lock-client';
import { scatter, rng, kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = +(process.env.S ?? 65536), N = +(process.env.N ?? 1024);
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)]);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const engine = new TransferEngine({ nodeId: 'req', transports: process.env.TCP ? [new TcpTransport()] : [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const dest = Buffer.alloc(S * N); const reg = await engine.register({ kind: 'host', buffer: dest });
const offsets = scatter({ blockBytes: S, layers: 32, blocks: N / 32 }, REGION, rng(1));
const requests = Array.from(offsets, (o, i) => ({ local: reg, localOffset: i * S, remote: descriptor, remoteOffset: o, length: S }));
const blocks = { owner: kvSpace(S), numbers: Uint32Array.from(offsets, (o) => o / S) };
const destinations = Array.from(offsets, (_, i) => ({ local: reg, offset: i * S, length: S }));
const oldReqs = Array.from(offsets, (_, i) => ({ local: reg, localOffset: i * S, remote: null, range: i, length: S }));
const rel = [];
const A = async () => { const f = await client.fetch(engine, hello.lockAddress, blocks, destinations, { timeoutMs: 10000 }); rel.push(f.release()); };
const B = async () => {
  const g = await client.acquire(hello.lockAddress, blocks, { timeoutMs: 10000 });
  const fd = decodeFetchDescriptor(g.leaseDescriptors[0]); const d = decodeDescriptor(fd.grant);
  for (let i = 0; i < N; i++) oldReqs[i].remote = d;
  await engine.read(fd.endpoint, oldReqs, { deadline: g.transferDeadline, signal: g.signal });
  rel.push(g.release());
};
const R = () => engine.read(endpoint, requests);
for (let i = 0; i < 3000; i++) { const g = await client.acquire(hello.lockAddress, { owner: kvSpace(S), numbers: Uint32Array.of(5) }, { timeoutMs: 10000 }); await g.release(); }
for (let i = 0; i < 200; i++) { await A(); await B(); await R(); if (rel.length > 32) await Promise.all(rel.splice(0)); }
const rounds = +(process.env.ROUNDS ?? 8), per = +(process.env.PER ?? 24);
const med = (x) => { const y = x.slice().sort((a, b) => a - b); return y[y.length >> 1]; };
const ra = [], rb = [], ta = [], tb = [], tr = [];
for (let r = 0; r < rounds; r++) {
  const t = { A: [], B: [], R: [] };
  const order = r % 2 ? ['A', 'B', 'R'] : ['B', 'A', 'R'];
  for (let k = 0; k < per; k++) for (const m of order) { const a = performance.now(); await ({ A, B, R })[m](); t[m].push(performance.now() - a); if (rel.length > 32) await Promise.all(rel.splice(0)); }
  ra.push(med(t.R) / med(t.A)); rb.push(med(t.R) / med(t.B)); ta.push(med(t.A)); tb.push(med(t.B)); tr.push(med(t.R));
}
await Promise.all(rel);
console.log(`S=${S} N=${N} ${process.env.TCP ? 'tcp' : 'same-host'}: read/fetch(new) median of rounds ${med(ra).toFixed(3)} [${ra.map((x) => x.toFixed(2)).join(' ')}]`);
console.log(`  read/fetch(old path) ${med(rb).toFixed(3)} [${rb.map((x) => x.toFixed(2)).join(' ')}]`);
console.log(`  ms p50: new ${med(ta).toFixed(3)} old ${med(tb).toFixed(3)} read ${med(tr).toFixed(3)}`);
await client.close(); await engine.close(); h.disconnect();
