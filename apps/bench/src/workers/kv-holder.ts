/**
 * Holder half of the `kv` scenario: one large host region filled with a verifiable pattern,
 * registered once with an engine that serves it through the same-host transport (the region
 * is a shared segment from `allocateSharedMemory`, so cuda-ipc grants it zero-copy) and TCP.
 * Also serves the raw baseline: on a plain node:net socket, each request `u64 bytes, u64
 * offset` is answered with region[offset, offset + bytes) in slices of at most 4 MiB.
 * argv: regionBytes seed shared(1|0)
 */
import net from 'node:net';
import { TcpTransport, TransferEngine, silentLogger } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { allocateSharedMemory } from '@tensorwire/cuda-ipc';
import { workerInit } from '../proc.js';
import { holderTransports } from '../transports.js';

const SLICE = 4 * 1024 * 1024;
const ipc = workerInit();
const regionBytes = Number(process.argv[2]);
const seed = Number(process.argv[3]);
const shared = process.argv[4] === '1';
const region = shared ? allocateSharedMemory(regionBytes, `kv-holder-${process.pid}`) : new Uint8Array(regionBytes);
region.set(pattern(regionBytes, seed));
const built = shared ? holderTransports() : { transports: [new TcpTransport()], notes: ['holder serves TCP only: its region is not in shared memory'] };
const engine = new TransferEngine({ nodeId: 'kv-holder', transports: built.transports, logger: silentLogger });
await engine.start();
const reg = await engine.register({ kind: 'host', buffer: region }); // once for the whole region (invariant 15)

const raw = net.createServer({ noDelay: true }, (socket) => {
  socket.on('error', () => undefined);
  let pending: Buffer = Buffer.alloc(0);
  let busy = false;
  const serve = async (): Promise<void> => {
    if (busy) return;
    busy = true;
    while (pending.length >= 16 && !socket.destroyed) {
      const bytes = Number(pending.readBigUInt64BE(0));
      const offset = Number(pending.readBigUInt64BE(8));
      pending = pending.subarray(16);
      if (!(bytes > 0 && offset >= 0 && offset + bytes <= regionBytes)) {
        socket.destroy();
        break;
      }
      for (let at = offset; at < offset + bytes && !socket.destroyed; at += SLICE) {
        if (!socket.write(region.subarray(at, Math.min(offset + bytes, at + SLICE)))) await new Promise((r) => socket.once('drain', r));
      }
    }
    busy = false;
  };
  socket.on('data', (d: Buffer) => {
    pending = pending.length === 0 ? d : Buffer.concat([pending, d]);
    void serve();
  });
});
await new Promise<void>((r) => raw.listen(0, '127.0.0.1', r));

ipc.send({
  type: 'ready',
  endpoint: Buffer.from(engine.endpoint()).toString('base64'),
  descriptor: Buffer.from(reg.descriptor).toString('base64'),
  rawPort: (raw.address() as net.AddressInfo).port,
  transports: reg.transports,
  notes: [...built.notes, ...[...reg.skipped].map(([t, why]) => `holder region not registered with ${t}: ${why}`)],
});
ipc.onMessage((m) => {
  if (m['type'] === 'stop') {
    raw.close();
    void engine.close().then(() => process.exit(0));
  }
});
