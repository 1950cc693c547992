import { fork } from 'node:child_process';
import { LockClient } from '@tensorwire/lock-client';
import { silentLogger } from '@tensorwire/core';
import { kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = 65536;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)]);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const blocks = { owner: kvSpace(S), numbers: Uint32Array.from({ length: 1024 }, (_, i) => i * 3) };
const one = { owner: kvSpace(S), numbers: Uint32Array.of(7) };
const line = [];
for (let w = 0; w < 12; w++) {
  const t = [];
  for (let r = 0; r < 500; r++) { const a = performance.now(); const g = await client.acquire(hello.lockAddress, process.env.ONE ? one : blocks, { timeoutMs: 10000 }); t.push(performance.now() - a); await g.release(); }
  t.sort((a, b) => a - b); line.push(t[250].toFixed(2));
}
console.log('acquire p50 per 500-cycle window:', line.join(' '));
await client.close(); h.disconnect();
