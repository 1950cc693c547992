/**
 * Bad holders, for releases in bulk: one that answers every release UNAVAILABLE, one that
 * never answers, one that accepts the TCP connection and never reads. In each case the
 * calls sent stay bounded (by the in-flight bound and the retry budget, not by the number of
 * leases or failures), close() returns, and every lease is accounted for as released,
 * failed to release (reported) or expired. Also: a holder past its concurrency limit
 * refuses at once and the client backs off without losing the acquire; a call whose
 * deadline has passed is dropped at the holder before any work.
 */
import net from 'node:net';
import * as grpc from '@grpc/grpc-js';
import { silentLogger } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient, type LockGuard, type ReleaseFailure } from '../src/index.js';
import { LockServer, loadLockProtocol } from '../src/server/index.js';
import { bindLoopback } from './helpers.js';

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** A holder whose release calls are replaced: `mode` decides what a release call gets. */
async function badHolder(mode: 'unavailable' | 'hang'): Promise<{ address: string; lock: LockServer; releaseCalls: () => number }> {
  const lock = new LockServer({ holderId: 'bad', lockTimeoutMs: 60_000, logger: silentLogger });
  const handlers = lock.handlers();
  let calls = 0;
  const bad = (_call: unknown, cb: grpc.sendUnaryData<never>): void => {
    calls++;
    if (mode === 'unavailable') cb({ code: grpc.status.UNAVAILABLE, details: 'always unavailable' }, null);
    // 'hang': never answer (the client's deadline ends each call)
  };
  handlers['Release'] = bad as grpc.UntypedHandleCall;
  handlers['ReleaseMany'] = bad as grpc.UntypedHandleCall;
  const server = new grpc.Server();
  server.addService(loadLockProtocol().service, handlers);
  const port = await bindLoopback(server);
  cleanups.push(async () => {
    server.forceShutdown();
    await lock.abort();
  });
  return { address: `127.0.0.1:${port}`, lock, releaseCalls: () => calls };
}

async function acquireMany(client: LockClient, holder: string, n: number): Promise<LockGuard[]> {
  return Promise.all(Array.from({ length: n }, (_, i) => client.acquire(holder, [`block:bad:${i}`])));
}

function expectAccounted(client: LockClient, n: number, failures: readonly ReleaseFailure[]): void {
  const c = client.counters();
  expect(c.active).toBe(0);
  expect(c.acquired).toBe(n);
  expect(c.acquired).toBe(c.released + c.releaseFailures + c.expired + c.dropped + c.active);
  // Every failed guard was reported, once (acquire-id releases are reported without a session).
  const guardFailures = failures.filter((f) => f.sessionId !== undefined);
  expect(guardFailures).toHaveLength(c.releaseFailures);
  expect(new Set(guardFailures.map((f) => f.sessionId)).size).toBe(c.releaseFailures);
}

const N = 2000;
// A tight budget so the bound on calls is small and exact: one first attempt per batch,
// then at most `burst` retry calls (no refill per second, none per success: nothing succeeds).
const BUDGET = { burst: 3, perSecond: 0, perSuccess: 0 };

describe('bad holders under a burst of releases', () => {
  it('a holder that answers every release UNAVAILABLE: calls bounded by batches + budget; close returns; every lease accounted', async () => {
    const h = await badHolder('unavailable');
    const client = new LockClient({ releaseRetry: { initialDelayMs: 5, maxDelayMs: 20 }, retryBudget: BUDGET, maxBatch: 500, closeTimeoutMs: 2000, logger: silentLogger });
    const failures: ReleaseFailure[] = [];
    client.on('releaseFailed', (f) => failures.push(f));
    const guards = await acquireMany(client, h.address, N);
    const releasing = guards.map((g) => g.release());
    await client.close();
    const results = await Promise.all(releasing);
    expect(results.every((r) => !r.confirmed)).toBe(true);
    expectAccounted(client, N, failures);
    expect(client.counters().releaseFailures).toBe(N);
    // 4 first attempts (2000 / 500) and at most 3 retry calls, however many leases failed.
    expect(h.releaseCalls()).toBeGreaterThanOrEqual(N / 500);
    expect(h.releaseCalls()).toBeLessThanOrEqual(N / 500 + BUDGET.burst);
    expect(client.counters().budgetExhausted).toBeGreaterThan(0);
    // The holder still has the leases: its GC is the backstop.
    expect(h.lock.counters().active).toBe(N);
  });

  it('a holder that never answers: at most the in-flight bound of calls at a time, close cancels them and returns', async () => {
    const h = await badHolder('hang');
    const client = new LockClient({ releaseTimeoutMs: 200, retryBudget: BUDGET, maxBatch: 500, maxCallsInFlightPerHolder: 2, closeTimeoutMs: 1500, logger: silentLogger });
    const failures: ReleaseFailure[] = [];
    client.on('releaseFailed', (f) => failures.push(f));
    const guards = await acquireMany(client, h.address, N);
    const releasing = guards.map((g) => g.release());
    await client.close();
    const results = await Promise.all(releasing);
    expect(results.every((r) => !r.confirmed)).toBe(true);
    expectAccounted(client, N, failures);
    expect(h.releaseCalls()).toBeLessThanOrEqual(N / 500 + BUDGET.burst);
  });

  it('a holder that accepts the connection and never reads: acquires time out, releases fail, close returns', async () => {
    // Leases from a real holder, which then goes away; its port is taken by a listener that never reads.
    const real = new LockServer({ holderId: 'bad', lockTimeoutMs: 60_000, logger: silentLogger });
    const port = await real.listen('127.0.0.1:0');
    const address = `127.0.0.1:${port}`;
    const client = new LockClient({ releaseTimeoutMs: 200, retryBudget: BUDGET, maxBatch: 500, closeTimeoutMs: 1500, logger: silentLogger });
    const failures: ReleaseFailure[] = [];
    client.on('releaseFailed', (f) => failures.push(f));
    const guards = await acquireMany(client, address, 500);
    await real.abort();
    const sockets = new Set<net.Socket>();
    const mute = net.createServer((s) => {
      s.pause(); // accept, never read
      sockets.add(s);
    });
    await new Promise<void>((resolve) => mute.listen(port, '127.0.0.1', resolve));
    cleanups.push(
      () =>
        new Promise<void>((resolve) => {
          for (const s of sockets) s.destroy();
          mute.close(() => resolve());
        }),
    );
    // An acquire sent on the session stream to the old holder before the client saw that
    // stream end fails with it (connection broken); one sent after reaches the mute listener.
    const racing = await client.acquire(address, ['block:bad:racing'], { timeoutMs: 300 }).catch((e: unknown) => e);
    expect(['TW_TIMED_OUT', 'TW_CONNECTION_BROKEN']).toContain((racing as { code?: string }).code);
    const late = await client.acquire(address, ['block:bad:late'], { timeoutMs: 300 }).catch((e: unknown) => e);
    expect(late).toMatchObject({ code: 'TW_TIMED_OUT' });
    const releasing = guards.map((g) => g.release());
    await client.close();
    const results = await Promise.all(releasing);
    expect(results.every((r) => !r.confirmed)).toBe(true);
    expectAccounted(client, 500, failures);
    expect(client.counters().abandonedAcquires).toBe(2);
    // The failed acquires' possible grants were released by acquire id, and that failed too (reported).
    expect(failures.filter((f) => f.acquireId !== undefined)).toHaveLength(2);
  });
});

describe('a holder under pressure', () => {
  it('past its concurrency limit it refuses at once (RESOURCE_EXHAUSTED, retry-after); the client backs off and loses nothing', async () => {
    let open!: () => void;
    const gate = new Promise<void>((r) => (open = r));
    const server = new LockServer({
      holderId: 'busy',
      lockTimeoutMs: 60_000,
      maxConcurrentCalls: 2,
      retryAfterMs: 20,
      logger: silentLogger,
      resolve: async (ids) => {
        await gate;
        return ids.map(() => new Uint8Array([1]));
      },
    });
    const port = await server.listen();
    cleanups.push(() => server.close({ graceMs: 0 }));
    const client = new LockClient({ logger: silentLogger });
    cleanups.push(() => client.close());
    const holder = `127.0.0.1:${port}`;
    const first = [client.acquire(holder, ['block:busy:1']), client.acquire(holder, ['block:busy:2'])];
    while (server.counters().inFlight < 2) await new Promise((r) => setTimeout(r, 5));
    const third = client.acquire(holder, ['block:busy:3'], { timeoutMs: 30_000 });
    // Refused before any work: no lease was made for it while the two are in flight.
    while (server.counters().overloaded < 1) await new Promise((r) => setTimeout(r, 5));
    expect(server.counters()).toMatchObject({ acquired: 2, active: 2 });
    open();
    const guards = await Promise.all([...first, third]);
    expect(guards.map((g) => g.blockIds[0])).toEqual(['block:busy:1', 'block:busy:2', 'block:busy:3']);
    expect(client.counters().acquireRetries).toBeGreaterThanOrEqual(1);
    expect(server.counters()).toMatchObject({ acquired: 3, active: 3, expired: 0 });
    for (const g of guards) await g.release();
    expect(server.counters()).toMatchObject({ acquired: 3, released: 3, active: 0, inFlight: 0 });
  });

  it('drops a call whose deadline has passed before doing any work', () => {
    const server = new LockServer({ holderId: 'late', lockTimeoutMs: 60_000, logger: silentLogger });
    const handlers = server.handlers();
    const answers: (grpc.ServiceError | null)[] = [];
    const call = (deadline: number) => ({
      request: { requesterId: 'r1', blockIds: ['block:late:1'], leaseMs: 0, acquireId: '', sessionIds: ['session:late:x'], acquireIds: [] },
      metadata: new grpc.Metadata(),
      cancelled: false,
      getDeadline: () => new Date(deadline),
    });
    const cb = (e: grpc.ServiceError | null): void => {
      answers.push(e);
    };
    (handlers['Acquire'] as (c: unknown, cb: unknown) => void)(call(Date.now() - 1), cb);
    (handlers['ReleaseMany'] as (c: unknown, cb: unknown) => void)(call(Date.now() - 1), cb);
    expect(answers.map((e) => e?.code)).toEqual([grpc.status.DEADLINE_EXCEEDED, grpc.status.DEADLINE_EXCEEDED]);
    expect(server.counters()).toMatchObject({ acquired: 0, active: 0, droppedExpired: 2, releaseEntries: 0 });
    // The same call with time left is served.
    (handlers['Acquire'] as (c: unknown, cb: unknown) => void)(call(Date.now() + 60_000), cb);
    expect(answers[2]).toBeNull();
    expect(server.counters()).toMatchObject({ acquired: 1, active: 1, droppedExpired: 2 });
    server.table.revokeAll();
  });
});
