import { fork } from 'node:child_process';
import { LockClient } from '@tensorwire/lock-client';
import { silentLogger } from '@tensorwire/core';
import { scatter, rng, kvSpace } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024, S = 65536, N = 1024;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', String(S)]);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const offsets = scatter({ blockBytes: S, layers: 32, blocks: N / 32 }, REGION, rng(1));
const blocks = { owner: kvSpace(S), numbers: Uint32Array.from(offsets, (o) => o / S) };
const big = Buffer.alloc(128 << 20, 1), dst = Buffer.alloc(64 << 20);
const small = Buffer.alloc(4 << 20, 2), sdst = Buffer.alloc(4 << 20);
const ops = {
  none: () => {},
  copy64: () => { big.copy(dst, 0, 0, 64 << 20); },
  pages: () => { let s = 0; for (let i = 0; i < big.length; i += 4096) s += big[i]; for (let i = 0; i < dst.length; i += 4096) dst[i] = s & 1; },
  copy4x16: () => { for (let k = 0; k < 16; k++) small.copy(sdst); },
};
const t = Object.fromEntries(Object.keys(ops).map((k) => [k, []]));
const rel = [];
const keys = process.env.OPS ? process.env.OPS.split(',') : Object.keys(ops);
for (let r = 0; r < 230; r++) for (const k of keys) {
  ops[k]();
  const a = performance.now(); const g = await client.acquire(hello.lockAddress, blocks, { timeoutMs: 10000 }); const d = performance.now() - a;
  if (process.env.NOREL) rel.push(g); else rel.push(g.release()); if (process.env.SLEEP) await new Promise((r) => setTimeout(r, +process.env.SLEEP)); else await new Promise((r) => setImmediate(r));
  if (r >= 30) t[k].push(d);
}
await Promise.all(rel.map((x) => (typeof x.release === "function" ? x.release() : x)));
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(3);
for (const k of keys) console.log(k.padEnd(9), 'acquire ms p10', q(t[k], .1), 'p50', q(t[k], .5), 'p90', q(t[k], .9));
await client.close(); h.disconnect();
