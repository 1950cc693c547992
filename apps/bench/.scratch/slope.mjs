import { fork } from 'node:child_process';
import { silentLogger } from '@tensorwire/core';
import { LockClient } from '@tensorwire/lock-client';
import { kvSpace } from '../dist/kv-shape.js';
const REGION = 64 * 1024 * 1024, S = 4096;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)]);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const sizes = [1, 64, 256, 1024, 4096];
const sets = Object.fromEntries(sizes.map((n) => [n, { owner: kvSpace(S), numbers: Uint32Array.from({ length: n }, (_, i) => (i * 7919) % (REGION / S)) }]));
const one = sets[1];
for (let i = 0; i < 4000; i++) { const g = await client.acquire(hello.lockAddress, one, { timeoutMs: 10000 }); await g.release(); }
for (const n of sizes) for (let i = 0; i < 300; i++) { const g = await client.acquire(hello.lockAddress, sets[n], { timeoutMs: 10000 }); await g.release(); }
const t = Object.fromEntries(sizes.map((n) => [n, []]));
const rel = [];
for (let r = 0; r < 400; r++) for (const n of sizes) {
  const a = performance.now(); const g = await client.acquire(hello.lockAddress, sets[n], { timeoutMs: 10000 }); t[n].push(performance.now() - a);
  rel.push(g.release()); if (rel.length > 16) await Promise.all(rel.splice(0));
}
await Promise.all(rel);
const q = (x) => x.slice().sort((a, b) => a - b)[x.length >> 1].toFixed(3);
for (const n of sizes) console.log(String(n).padStart(5), 'blocks: acquire p50 ms', q(t[n]));
await client.close(); h.disconnect();
