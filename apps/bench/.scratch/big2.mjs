import { fork } from 'node:child_process';
import { TransferEngine, TcpTransport, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport } from '@tensorwire/cuda-ipc';
const REGION = 256 * 1024 * 1024;
const h = fork(new URL('../dist/workers/kv-holder.js', import.meta.url), [String(REGION), '7', '1', '4096,65536']);
const hello = await new Promise((r) => h.on('message', (m) => { if (m.endpoint) r(m); }));
const endpoint = new Uint8Array(Buffer.from(hello.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(hello.descriptor, 'base64'));
const engine = new TransferEngine({ nodeId: 'req', transports: [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const S = +(process.env.S ?? 4194304);
const dest = Buffer.alloc(S);
const reg = await engine.register({ kind: 'host', buffer: dest });
const off = 37 * S;
const p = await engine.prepare(endpoint, [{ local: reg, localOffset: 0, remote: descriptor, remoteOffset: off, length: S }], { op: 'read' });
const pre = [], nat = [], post = [];
for (let r = 0; r < 3000; r++) {
  const t0 = process.hrtime.bigint(); await p.run(); const t3 = process.hrtime.bigint();
  if (r >= 500) { pre.push(Number(globalThis.__a - t0) / 1e3); nat.push(Number(globalThis.__b - globalThis.__a) / 1e3); post.push(Number(t3 - globalThis.__b) / 1e3); }
}
const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(2);
for (const [k, x] of Object.entries({ pre, nat, post })) console.log(k.padEnd(5), 'p10', q(x, .1), 'p50', q(x, .5), 'p90', q(x, .9));
await p.close(); await engine.close(); h.disconnect();
