import { fork } from 'node:child_process';
import net from 'node:net';
import { silentLogger } from '@tensorwire/core';
import { LockClient } from '@tensorwire/lock-client';
import { loadLockProtocol } from '@tensorwire/lock-client/server';
const h = fork(new URL('./lane-holder.mjs', import.meta.url));
const { port, path } = await new Promise((r) => h.once('message', r));
const addr = `127.0.0.1:${port}`;
const { codec } = loadLockProtocol();
const client = new LockClient({ requesterId: 'r', logger: silentLogger });
const s = net.connect(path); await new Promise((r) => s.once('connect', r));
let buf = Buffer.alloc(0); const waiters = [];
s.on('data', (d) => { buf = buf.length ? Buffer.concat([buf, d]) : d; while (buf.length >= 5) { const len = buf.readUInt32LE(0); if (buf.length < 5 + len) break; const p = buf.subarray(5, 5 + len); const err = buf[4]; buf = buf.subarray(5 + len); waiters.shift()({ err, p }); } });
const rpc = (m, msg) => new Promise((r) => { const p = codec[['Acquire', 'ReleaseMany'][m] + 'Request'].encode(msg); const hd = Buffer.allocUnsafe(5); hd.writeUInt32LE(p.length, 0); hd[4] = m; waiters.push(r); s.write(Buffer.concat([hd, p])); });
let seq = 0;
const N = +(process.env.N ?? 1024);
const numbers = Uint32Array.from({ length: N }, (_, i) => (i * 7919) % 16384);
const laneAcquire = async () => { const r = await rpc(0, { requesterId: 'r2', blockIds: [], leaseMs: 30000, acquireId: `a${seq++}`, omitEmptyBlocks: true, blockOwner: 'kv', blockNumbers: Array.from(numbers) }); if (r.err) throw new Error('lane acquire failed'); return codec.AcquireResponse.decode(r.p); };
const laneRelease = (sid) => rpc(1, { requesterId: 'r2', sessionIds: [sid], acquireIds: [''] });
const blocks = { owner: 'kv', numbers };
const grpcAcquire = () => client.acquire(addr, blocks, { timeoutMs: 10000 });
for (let i = 0; i < 4000; i++) { const g = await grpcAcquire(); await g.release(); const a = await laneAcquire(); await laneRelease(a.sessionId); }
const spin = () => { const t = performance.now(); while (performance.now() - t < 5); };
const sleep = () => new Promise((r) => setTimeout(r, 5));
const t = {}; for (const k of ['grpc b2b', 'grpc spin5', 'grpc sleep5', 'lane b2b', 'lane spin5', 'lane sleep5']) t[k] = [];
for (let r = 0; r < 400; r++) {
  for (const pause of ['b2b', 'spin5', 'sleep5']) {
    if (pause === 'spin5') spin(); else if (pause === 'sleep5') await sleep();
    let a = performance.now(); const g = await grpcAcquire(); t[`grpc ${pause}`].push(performance.now() - a); void g.release();
    if (pause === 'spin5') spin(); else if (pause === 'sleep5') await sleep();
    a = performance.now(); const x = await laneAcquire(); t[`lane ${pause}`].push(performance.now() - a); void laneRelease(x.sessionId);
  }
}
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(3);
for (const k of Object.keys(t)) console.log(k.padEnd(12), `acquire ${N} blocks ms p10`, q(t[k], .1), 'p50', q(t[k], .5), 'p90', q(t[k], .9));
await client.close(); s.destroy(); h.disconnect();
