/**
 * Bench worker: the requester for `locks --burst`. Holds leases and releases them all at
 * once, or sends the same number of plain grpc-js unary echoes at once (the baseline), and
 * reports how long each took.
 *
 * argv: holder echoAddress [clientModule]
 *   clientModule: path of another build's `index.js` to use instead of
 *   `@tensorwire/lock-client` (to compare builds in one run); '' for the default.
 * {type:'acquire', n, concurrency, leaseMs} → {type:'acquired', n, ms}
 * {type:'release'} → {type:'released', n, ms, confirmed, failed, blocksReleased, attempts}
 * {type:'echo', n} → {type:'echoed', n, ms, failed}
 * {type:'close'} → {type:'closed', counters}
 */
import * as grpc from '@grpc/grpc-js';
import type * as LockClientModule from '@tensorwire/lock-client';
import { ECHO_SERVICE } from '../echo.js';
import { workerInit } from '../proc.js';
import { nowMs } from '../stats.js';

interface EchoClient extends grpc.Client {
  Echo(req: Buffer, cb: (e: grpc.ServiceError | null, r?: Buffer) => void): grpc.ClientUnaryCall;
}

const io = workerInit();
const [holder = '', echoAddress = '', moduleArg = ''] = process.argv.slice(2);
const mod = (moduleArg === '' ? await import('@tensorwire/lock-client') : await import(moduleArg)) as typeof LockClientModule;
const client = new mod.LockClient({ requesterId: 'burst', closeTimeoutMs: 30_000 });
const Echo = grpc.makeGenericClientConstructor(ECHO_SERVICE, 'Echo') as unknown as new (a: string, c: grpc.ChannelCredentials) => EchoClient;
const echo = new Echo(echoAddress, grpc.credentials.createInsecure());
const payload = Buffer.alloc(64, 7);
let guards: LockClientModule.LockGuard[] = [];
let blockSeq = 0;

async function acquire(n: number, concurrency: number, leaseMs: number): Promise<void> {
  const out: LockClientModule.LockGuard[] = new Array<LockClientModule.LockGuard>(n);
  let next = 0;
  const lane = async (): Promise<void> => {
    while (next < n) {
      const i = next++;
      out[i] = await client.acquire(holder, [`block:burstholder:${blockSeq++}`], { leaseMs, timeoutMs: 60_000 });
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, n) }, lane));
  guards = out;
}

function echoOnce(): Promise<boolean> {
  return new Promise((resolve) => echo.Echo(payload, (e, r) => resolve(!e && r !== undefined && r.equals(payload))));
}

io.onMessage((m) => {
  void (async () => {
    if (m['type'] === 'acquire') {
      const t0 = nowMs();
      await acquire(Number(m['n']), Number(m['concurrency']), Number(m['leaseMs']));
      io.send({ type: 'acquired', n: guards.length, ms: nowMs() - t0 });
    } else if (m['type'] === 'release') {
      const t0 = nowMs();
      // All at once: every release is issued before any of them is awaited.
      const results = await Promise.all(guards.map((g) => g.release()));
      const ms = nowMs() - t0;
      let confirmed = 0;
      let blocksReleased = 0;
      let attempts = 0;
      for (const r of results) {
        if (r.confirmed) confirmed++;
        blocksReleased += r.blocksReleased;
        attempts += r.attempts;
      }
      io.send({ type: 'released', n: results.length, ms, confirmed, failed: results.length - confirmed, blocksReleased, attempts });
      guards = [];
    } else if (m['type'] === 'echo') {
      const n = Number(m['n']);
      const t0 = nowMs();
      const oks = await Promise.all(Array.from({ length: n }, echoOnce));
      io.send({ type: 'echoed', n, ms: nowMs() - t0, failed: oks.filter((x) => !x).length });
    } else if (m['type'] === 'close') {
      echo.close();
      await client.close();
      io.send({ type: 'closed', counters: client.counters() });
    }
  })().catch((e: unknown) => io.send({ type: 'error', message: e instanceof Error ? e.message : String(e) }));
});
io.send({ type: 'ready' });
