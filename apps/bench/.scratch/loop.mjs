// leased fetch loop (b2b) of 1024 x 64 KiB for profiling
import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
import { LockClient } from '@tensorwire/lock-client';
import { scatter, rng, kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = +(process.env.S ?? 65536), N = +(process.env.N ?? 1024);
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)], { execArgv: process.env.HPROF ? ['--cpu-prof', '--cpu-prof-dir=/tmp/prof-h'] : [] });
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const engine = new TransferEngine({ nodeId: 'req', transports: [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const dest = Buffer.alloc(S * N); const reg = await engine.register({ kind: 'host', buffer: dest });
const offsets = scatter({ blockBytes: S, layers: 32, blocks: N / 32 }, REGION, rng(1));
const blocks = { owner: kvSpace(S), numbers: Uint32Array.from(offsets, (o) => o / S) };
const destinations = Array.from(offsets, (_, i) => ({ local: reg, offset: i * S, length: S }));
const rel = [];
const n = +(process.env.R ?? 2000);
const a = performance.now();
for (let r = 0; r < n; r++) { const f = await client.fetch(engine, hello.lockAddress, blocks, destinations, { timeoutMs: 10000 }); await f[Symbol.asyncDispose](); rel.push(f.release()); if (rel.length > 32) await Promise.all(rel.splice(0)); }
await Promise.all(rel);
console.log('per fetch ms', ((performance.now() - a) / n).toFixed(3));
await client.close(); await engine.close(); h.disconnect();
