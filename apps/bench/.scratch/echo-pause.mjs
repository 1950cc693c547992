// raw unix-socket echo and raw TCP echo: b2b vs after 5 ms spin vs after 5 ms sleep
import { fork } from 'node:child_process';
import net from 'node:net';
if (process.argv[2] === 'server') {
  const path = process.argv[3];
  const srv = net.createServer((s) => { s.setNoDelay(true); s.on('data', (d) => s.write(d)); });
  srv.listen(path === 'tcp' ? 0 : path, () => process.send({ port: path === 'tcp' ? srv.address().port : path }));
} else {
  const res = {};
  for (const kind of ['unix', 'tcp']) {
    const path = kind === 'unix' ? `/tmp/echo-${process.pid}.sock` : 'tcp';
    const child = fork(new URL(import.meta.url), ['server', path]);
    const { port } = await new Promise((r) => child.once('message', r));
    const s = net.connect(typeof port === 'number' ? { port, host: '127.0.0.1' } : port); s.setNoDelay(true);
    await new Promise((r) => s.once('connect', r));
    const msg = Buffer.alloc(200, 1);
    let waiting; s.on('data', () => { const w = waiting; waiting = undefined; w?.(); });
    const rt = () => new Promise((r) => { waiting = r; s.write(msg); });
    for (let i = 0; i < 5000; i++) await rt();
    const ops = { b2b: async () => {}, spin5: async () => { const t = performance.now(); while (performance.now() - t < 5); }, sleep5: () => new Promise((r) => setTimeout(r, 5)) };
    const t = { b2b: [], spin5: [], sleep5: [] };
    for (let r = 0; r < 300; r++) for (const k of Object.keys(ops)) { await ops[k](); const a = performance.now(); await rt(); t[k].push(performance.now() - a); }
    const q = (x, f) => x.slice().sort((a, b) => a - b)[Math.floor(x.length * f)].toFixed(3);
    for (const k of Object.keys(t)) console.log(kind, k.padEnd(7), 'rt ms p10', q(t[k], .1), 'p50', q(t[k], .5), 'p90', q(t[k], .9));
    s.destroy(); child.kill();
  }
}
