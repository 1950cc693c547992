import { fork } from 'node:child_process';
import { LockClient } from '@tensorwire/lock-client';
import { silentLogger } from '@tensorwire/core';
import { kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = 65536;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)]);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const client = new LockClient({ requesterId: 'r', logger: silentLogger, ...(process.env.UNARY ? { session: false } : {}), ...(process.env.CHO ? { channelOptions: JSON.parse(process.env.CHO) } : {}) });
for (const n of (process.env.NS ?? '1,64,1024').split(',').map(Number)) {
  const blocks = { owner: kvSpace(S), numbers: Uint32Array.from({ length: n }, (_, i) => i * 3) };
  const t = [];
  for (let r = 0; r < +(process.env.R ?? 400); r++) {
    const a = performance.now(); const g = await client.acquire(hello.lockAddress, blocks, { timeoutMs: 10000 }); const d = performance.now() - a;
    const b = performance.now(); await g.release(); const e = performance.now() - b;
    if (r >= 100) t.push([d, e]);
  }
  const q = (i, f) => t.map((x) => x[i]).sort((a, b) => a - b)[Math.floor(t.length * f)].toFixed(3);
  console.log('blocks', n, 'acquire p50', q(0, .5), 'p10', q(0, .1), ' release(awaited) p50', q(1, .5));
}
await client.close(); h.disconnect();
