/**
 * Holder half of the `tcp` scenario: serves a pattern-filled region through the engine's TCP
 * transport, and the same bytes over a raw node:net stream for the baseline.
 * argv: regionBytes
 */
import net from 'node:net';
import { TcpTransport, TransferEngine, silentLogger } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { workerInit } from '../proc.js';

const ipc = workerInit();
const regionBytes = Number(process.argv[2]);
const region = pattern(regionBytes, 1234);
const engine = new TransferEngine({ nodeId: 'bench-holder', transports: [new TcpTransport()], logger: silentLogger });
await engine.start();
const reg = await engine.register({ kind: 'host', buffer: region });

// Raw baseline: the client sends u64 total + u32 block; we stream region slices until total.
const raw = net.createServer({ noDelay: true }, (socket) => {
  socket.on('error', () => undefined);
  socket.once('data', async (req: Buffer) => {
    const total = Number(req.readBigUInt64BE(0));
    const block = req.readUInt32BE(8);
    const blocks = Math.max(1, Math.floor(regionBytes / block));
    let sent = 0;
    let i = 0;
    while (sent < total) {
      const n = Math.min(block, total - sent);
      const off = (i++ % blocks) * block;
      if (!socket.write(region.subarray(off, off + n))) await new Promise((r) => socket.once('drain', r));
      sent += n;
    }
  });
});
await new Promise<void>((r) => raw.listen(0, '127.0.0.1', r));

ipc.send({
  type: 'ready',
  endpoint: Buffer.from(engine.endpoint()).toString('base64'),
  descriptor: Buffer.from(reg.descriptor).toString('base64'),
  rawPort: (raw.address() as net.AddressInfo).port,
});
ipc.onMessage((m) => {
  if (m['type'] === 'stop') {
    raw.close();
    void engine.close().then(() => process.exit(0));
  }
});
