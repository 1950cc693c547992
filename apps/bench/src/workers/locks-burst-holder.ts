/**
 * Bench worker: the holder for `locks --burst`. Serves the lock service and, in the same
 * process, the plain @grpc/grpc-js unary echo of `../echo.ts` (the baseline), and reports
 * its own CPU time so the parent can charge it per 1,000 releases or echoes.
 *
 * argv: lockTimeoutMs maxSessions [serverModule]
 *   serverModule: path of another build's `server/index.js` to serve instead of
 *   `@tensorwire/lock-client/server` (to compare builds in one run); '' for the default.
 * → {type:'listening', lockPort, echoPort}
 * {type:'cpu'} → {type:'cpu', userMicros, systemMicros}
 * {type:'counters'} → {type:'counters', counters}
 */
import * as grpc from '@grpc/grpc-js';
import type * as LockServerModule from '@tensorwire/lock-client/server';
import { ECHO_SERVICE } from '../echo.js';
import { workerInit } from '../proc.js';

const io = workerInit();
const lockTimeoutMs = Number(process.argv[2] ?? '30000');
const maxSessions = Number(process.argv[3] ?? '200000');
const moduleArg = process.argv[4] ?? '';
const mod = (moduleArg === '' ? await import('@tensorwire/lock-client/server') : await import(moduleArg)) as typeof LockServerModule;

const server = new mod.LockServer({ holderId: 'burstholder', lockTimeoutMs, maxSessions });
const lockPort = await server.listen('127.0.0.1:0');

const echo = new grpc.Server();
echo.addService(ECHO_SERVICE, {
  Echo: (call: grpc.ServerUnaryCall<Buffer, Buffer>, cb: grpc.sendUnaryData<Buffer>) => cb(null, call.request),
});
const echoPort = await new Promise<number>((resolve, reject) =>
  echo.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
);

io.onMessage((m) => {
  if (m['type'] === 'cpu') {
    const u = process.cpuUsage();
    io.send({ type: 'cpu', userMicros: u.user, systemMicros: u.system });
  } else if (m['type'] === 'counters') {
    const { requests: _requests, ...counters } = server.counters();
    io.send({ type: 'counters', counters });
  }
});
io.send({ type: 'listening', lockPort, echoPort });
