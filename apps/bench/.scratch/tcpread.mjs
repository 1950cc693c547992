import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
import { scatter, rng } from '../dist/kv-shape.js';
const which = process.env.T ?? 'tcp';
const REGION = 256 * 1024 * 1024;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', '4096,65536'], process.env.HPROF ? { execArgv: ['--cpu-prof', '--cpu-prof-dir=' + process.env.HPROF, '--cpu-prof-interval=50'] } : {});
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const engine = new TransferEngine({ nodeId: 'req', transports: which === 'tcp' ? [new TcpTransport()] : [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const S = +(process.env.S ?? 4096), N = +(process.env.N ?? 1024);
const dest = new Uint8Array(S * N);
const reg = await engine.register({ kind: 'host', buffer: dest });
const offsets = scatter({ blockBytes: S, layers: 32, blocks: N / 32 }, REGION, rng(1));
const requests = Array.from(offsets, (o, i) => ({ local: reg, localOffset: i * S, remote: descriptor, remoteOffset: o, length: S }));
const p = await engine.prepare(endpoint, requests, { op: 'read' });
const t = { read: [], prep: [] };
const now = () => Number(process.hrtime.bigint()) / 1e6;
for (let i = 0; i < 50; i++) { await engine.read(endpoint, requests); await p.run(); }
const { Session } = await import('node:inspector/promises');
const s = new Session(); s.connect();
if (process.env.PROF) { await s.post('Profiler.enable'); await s.post('Profiler.setSamplingInterval', { interval: 50 }); await s.post('Profiler.start'); }
for (let r = 0; r < +(process.env.R ?? 400); r++) {
  let a = now(); if (!process.env.ONLYP) { await engine.read(endpoint, requests); } t.read.push(now() - a);
  a = now(); await p.run(); t.prep.push(now() - a);
}
if (process.env.PROF) { const { profile } = await s.post('Profiler.stop'); (await import('node:fs')).writeFileSync(process.env.PROF, JSON.stringify(profile)); }
const med = (x) => x.slice().sort((a, b) => a - b)[x.length >> 1];
console.log(which, S, N, 'read p50', med(t.read).toFixed(3), 'prepared p50', med(t.prep).toFixed(3), 'diff/desc µs', ((med(t.read) - med(t.prep)) * 1000 / N).toFixed(3));
await p.close(); await engine.close(); h.disconnect();
