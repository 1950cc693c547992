import { fork } from 'node:child_process';
import net from 'node:net';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { scatter, rng } from '../dist/kv-shape.js';
const REGION = 256 * 1024 * 1024;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', '4096']);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const S = +(process.env.S ?? 4194304), L = +(process.env.L ?? 1), N = +(process.env.N ?? 1);
const dest = Buffer.alloc(S * N);
const variants = (process.env.V ?? '2:1048576,1:1048576,1:4194304,2:4194304').split(',');
const engines = [];
for (const v of variants) {
  const [st, ch] = v.split(':').map(Number);
  const e = new TransferEngine({ nodeId: 'req-' + v.replace(':', '-'), transports: [new TcpTransport()], logger: silentLogger, streamsPerPeer: st, chunkBytes: ch });
  await e.start();
  const reg = await e.register({ kind: 'host', buffer: dest });
  const offsets = scatter({ blockBytes: S, layers: L, blocks: N / L }, REGION, rng(1));
  const p = await e.prepare(endpoint, Array.from(offsets, (o, i) => ({ local: reg, localOffset: i * S, remote: descriptor, remoteOffset: o, length: S })), { op: 'read' });
  engines.push({ v, e, p });
}
// raw: 16-byte request (u64 bytes, u64 offset), reply straight into dest
let want = 0, got = 0, done;
const sock = net.connect({ port: hello.rawPort, host: '127.0.0.1', noDelay: true, onread: { buffer: () => (got < dest.length ? dest.subarray(got) : dest), callback: (n) => { got += n; if (got >= want) done(); } } });
await new Promise((r) => sock.once('connect', r));
const raw = () => new Promise((r) => { want = S * N; got = 0; done = r; const q = Buffer.alloc(16); q.writeBigUInt64BE(BigInt(S * N), 0); q.writeBigUInt64BE(BigInt(S * 3), 8); sock.write(q); });
const t = { raw: [] }; for (const x of engines) t[x.v] = [];
for (let r = 0; r < +(process.env.R ?? 300); r++) {
  let a = performance.now(); await raw(); if (r > 20) t.raw.push(performance.now() - a);
  for (const x of engines) { a = performance.now(); await x.p.run(); if (r > 20) t[x.v].push(performance.now() - a); }
}
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)];
const mean = (x) => x.reduce((a, b) => a + b, 0) / x.length;
for (const k in t) console.log(k.padEnd(16), 'p50', q(t[k], .5).toFixed(3), 'mean', mean(t[k]).toFixed(3), 'raw/this p50', (q(t.raw, .5) / q(t[k], .5)).toFixed(3), 'mean', (mean(t.raw) / mean(t[k])).toFixed(3));
for (const x of engines) { await x.p.close(); await x.e.close(); } sock.destroy(); h.disconnect();
