import net from 'node:net';
import * as grpc from '@grpc/grpc-js';
import { TcpTransport, TransferEngine, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory } from '@tensorwire/cuda-ipc';
import { LockServer, engineGrants, loadLockProtocol } from '@tensorwire/lock-client/server';
const S = 4096, REGION = 64 * 1024 * 1024;
const engine = new TransferEngine({ nodeId: 'h', transports: [new CudaIpcTransport(), new TcpTransport()], logger: silentLogger });
await engine.start();
const reg = await engine.register({ kind: 'host', buffer: allocateSharedMemory(REGION) });
const grants = engineGrants({ engine, spaces: { kv: { registration: reg, blockBytes: S } } });
const lock = new LockServer({ holderId: 'h', lockTimeoutMs: 30000, maxBlocksPerSession: 8192, ...grants.lockServerOptions, logger: silentLogger });
const port = await lock.listen('127.0.0.1:0');
const handlers = lock.handlers();
const { codec } = loadLockProtocol();
const M = ['Acquire', 'ReleaseMany'];
const path = `/tmp/lane-${process.pid}.sock`;
const srv = net.createServer((s) => {
  s.setNoDelay?.(true);
  let buf = Buffer.alloc(0);
  s.on('data', (d) => {
    buf = buf.length ? Buffer.concat([buf, d]) : d;
    while (buf.length >= 5) {
      const len = buf.readUInt32LE(0); if (buf.length < 5 + len) break;
      const m = M[buf[4]]; const id = 0; const payload = buf.subarray(5, 5 + len); buf = buf.subarray(5 + len);
      const request = codec[m + 'Request'].decode(payload);
      const call = { request, metadata: new grpc.Metadata(), cancelled: false, getDeadline: () => Infinity, getPeer: () => 'lane', on() { return call; } };
      handlers[m](call, (err, value) => {
        const out = err ? Buffer.alloc(0) : codec[m + 'Response'].encode(value);
        const h = Buffer.allocUnsafe(5); h.writeUInt32LE(out.length, 0); h[4] = err ? 1 : 0; s.write(Buffer.concat([h, out]));
      });
    }
  });
});
srv.listen(path, () => process.send({ port, path }));
process.on('disconnect', () => process.exit(0));
