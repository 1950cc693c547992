import { fork } from 'node:child_process';
import { PerformanceObserver } from 'node:perf_hooks';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
import { LockClient } from '@tensorwire/lock-client';
import { scatter, rng, kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024;
const S = +(process.env.S ?? 65536), N = +(process.env.N ?? 1024);
const h = fork(new URL(process.env.HOLDER ?? '../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)], process.env.HGC ? { execArgv: ['--trace-gc'], stdio: ['ignore', 'pipe', 'inherit', 'ipc'] } : {}); if (process.env.HGC) { const fs = await import('node:fs'); h.stdout.pipe(fs.createWriteStream(process.env.HGC)); }
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const engine = new TransferEngine({ nodeId: 'req', transports: [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const dest = Buffer.alloc(S * N);
const reg = await engine.register({ kind: 'host', buffer: dest });
const offsets = scatter({ blockBytes: S, layers: 32, blocks: N / 32 }, REGION, rng(1));
const requests = Array.from(offsets, (o, i) => ({ local: reg, localOffset: i * S, remote: descriptor, remoteOffset: o, length: S }));
const numbers = Uint32Array.from(offsets, (o) => o / S);
const blocks = { owner: kvSpace(S), numbers };
const destinations = Array.from(offsets, (_, i) => ({ local: reg, offset: i * S, length: S }));
if (process.env.WARM) { const one = { owner: kvSpace(S), numbers: Uint32Array.of(5) }; const t0 = performance.now(); for (let i = 0; i < +process.env.WARM; i++) { const g = await client.acquire(hello.lockAddress, one, { timeoutMs: 10000 }); await g.release(); } console.log('warm-up', process.env.WARM, 'cycles in', (performance.now() - t0).toFixed(0), 'ms'); }
const gcs = []; let phase = 'x';
new PerformanceObserver((l) => { for (const e of l.getEntries()) gcs.push({ phase, kind: e.detail?.kind ?? e.kind, ms: e.duration }); }).observe({ entryTypes: ['gc'] });
const now = () => performance.now();
const t = { read: [], fetch: [] }; const rel = [];
const R = +(process.env.R ?? 300);
for (let r = 0; r < R + 30; r++) {
  phase = 'read'; const w2 = process.hrtime.bigint(); let a = now(); globalThis.__cpn = 0; await engine.read(endpoint, requests); if (globalThis.__T) { (globalThis.__T.plainNonCopy ??= []).push((now() - a) * 1000 - globalThis.__cpn); } (globalThis.__rd ??= []).push([Number(w2 / 1000n), Number(process.hrtime.bigint() / 1000n)]); const dr = now() - a;
  phase = 'fetch'; a = now(); let f;
  if (process.env.SPLIT) { const w0 = process.hrtime.bigint(); const c0 = process.cpuUsage(); const lease = await client.acquire(hello.lockAddress, blocks, { timeoutMs: 10000 }); const b = now(); (globalThis.__win ??= []).push([Number(w0 / 1000n), Number(process.hrtime.bigint() / 1000n)]); const c1 = process.cpuUsage(c0); if (r >= 30) { t.acqcpu ??= []; t.acqcpu.push((c1.user + c1.system) / 1000); t.acqsys ??= []; t.acqsys.push(c1.system / 1000); } const w1 = process.hrtime.bigint(); f = await client.fetchLease(engine, lease, destinations); (globalThis.__fl ??= []).push([Number(w1 / 1000n), Number(process.hrtime.bigint() / 1000n)]); if (r >= 30) { t.acq ??= []; t.acq.push(b - a); t.flease ??= []; t.flease.push(now() - b); } }
  else f = await client.fetch(engine, hello.lockAddress, blocks, destinations, { timeoutMs: 10000 });
  const df = now() - a;
  await f[Symbol.asyncDispose](); rel.push(f.release());
  if (r >= 30) { t.read.push(dr); t.fetch.push(df); }
}
await Promise.all(rel);
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(3);
const mean = (x) => (x.reduce((a, b) => a + b, 0) / x.length).toFixed(3);
for (const k in t) console.log(k.padEnd(6), 'p10', q(t[k], .1), 'p50', q(t[k], .5), 'p90', q(t[k], .9), 'mean', mean(t[k]));
console.log('ratio mean read/fetch', (mean(t.read) / mean(t.fetch)).toFixed(3), 'p50', (q(t.read, .5) / q(t.fetch, .5)).toFixed(3));
const by = {}; for (const g of gcs) { const k = g.phase + ':' + g.kind; (by[k] ??= { n: 0, ms: 0 }); by[k].n++; by[k].ms += g.ms; }
console.log('gc', JSON.stringify(by));
(await import('node:fs')).writeFileSync('/tmp/win.json', JSON.stringify(globalThis.__win ?? [])); (await import('node:fs')).writeFileSync('/tmp/winfl.json', JSON.stringify(globalThis.__fl ?? [])); (await import('node:fs')).writeFileSync('/tmp/winrd.json', JSON.stringify(globalThis.__rd ?? [])); await client.close(); await engine.close(); h.disconnect();
if (globalThis.__T) { const T = globalThis.__T; const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)]; for (const k in T) { const x = T[k].slice(-300); console.log('stage', k.padEnd(10), 'n', T[k].length, 'p50 µs', q(x, .5).toFixed(1), 'p90', q(x, .9).toFixed(1)); } const o = T.readTotal.slice(-300).map((v, i) => v - T.readCopy.slice(-300)[i]); console.log('stage readNonCopy p50', q(o, .5).toFixed(1), 'p90', q(o, .9).toFixed(1)); }
