/**
 * Bench worker: the holder for the `locks` scenario. Serves the lock service and, in the
 * same process, a plain @grpc/grpc-js unary echo (the baseline). Descriptors are the block
 * id's bytes so the requester can verify them.
 *
 * argv: lockTimeoutMs
 * → {type:'listening', lockPort, echoPort}; {type:'counters'} → {type:'counters', counters}
 */
import * as grpc from '@grpc/grpc-js';
import { LockServer } from '@tensorwire/lock-client/server';
import { ECHO_SERVICE } from '../echo.js';
import { workerInit } from '../proc.js';

const io = workerInit();
const lockTimeoutMs = Number(process.argv[2] ?? '2000');


const pinned = new Set<string>();
const server = new LockServer({
  holderId: 'benchholder',
  lockTimeoutMs,
  minLeaseMs: Math.min(lockTimeoutMs, 500),
  pin: (b) => pinned.add(b),
  unpin: (b) => pinned.delete(b),
  resolve: (ids) => ids.map((id) => Buffer.from(id)),
});
const lockPort = await server.listen('127.0.0.1:0');

const echo = new grpc.Server();
echo.addService(ECHO_SERVICE, {
  Echo: (call: grpc.ServerUnaryCall<Buffer, Buffer>, cb: grpc.sendUnaryData<Buffer>) => cb(null, call.request),
});
const echoPort = await new Promise<number>((resolve, reject) =>
  echo.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
);

io.onMessage((m) => {
  if (m['type'] === 'counters') io.send({ type: 'counters', counters: { ...server.counters(), requests: undefined, pinnedByHook: pinned.size } });
});
io.send({ type: 'listening', lockPort, echoPort });
