/**
 * Versions: a new client against an older holder without ReleaseMany/RenewMany falls back to
 * the unary calls (bounded in flight), releases every lease and keeps auto-renewing; an
 * older client (unary Release/Renew only) keeps working against the new holder.
 */
import * as grpc from '@grpc/grpc-js';
import { silentLogger } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient } from '../src/index.js';
import { LockServer, loadLockProtocol } from '../src/server/index.js';
import { bindLoopback, waitFor } from './helpers.js';

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** A holder that serves only what the first protocol version had. */
async function oldHolder(lockTimeoutMs = 30_000): Promise<{ lock: LockServer; address: string }> {
  const lock = new LockServer({ holderId: 'old', lockTimeoutMs, minLeaseMs: Math.min(1000, lockTimeoutMs), logger: silentLogger });
  const { service } = loadLockProtocol();
  const all = lock.handlers();
  const names = ['Acquire', 'Release', 'Renew', 'Health'];
  const v1: grpc.ServiceDefinition = Object.fromEntries(names.map((n) => [n, service[n] as grpc.MethodDefinition<unknown, unknown>]));
  const handlers: grpc.UntypedServiceImplementation = Object.fromEntries(names.map((n) => [n, all[n] as grpc.UntypedHandleCall]));
  const server = new grpc.Server();
  server.addService(v1, handlers);
  const port = await bindLoopback(server);
  lock.gc.start();
  cleanups.push(async () => {
    server.forceShutdown();
    await lock.abort();
  });
  return { lock, address: `127.0.0.1:${port}` };
}

describe('protocol versions', () => {
  it('new client, old holder: releases fall back to unary Release, every lease confirmed exactly once', async () => {
    const { lock, address } = await oldHolder();
    const client = new LockClient({ logger: silentLogger });
    cleanups.push(() => client.close());
    const N = 300;
    const guards = await Promise.all(Array.from({ length: N }, (_, i) => client.acquire(address, [`block:old:${i}`])));
    const results = await Promise.all(guards.map((g) => g.release()));
    expect(results.every((r) => r.confirmed && r.blocksReleased === 1)).toBe(true);
    const c = lock.counters();
    expect(c).toMatchObject({ acquired: N, released: N, active: 0 });
    expect(c.requests.release).toBe(N);
    expect(client.holderStats().get(address)?.unary).toBe(true);
    // The holder has no Session: one stream was tried, then every call went unary.
    expect(client.sessionStats().get(address)).toMatchObject({ state: 'unsupported', opened: 1 });
    expect(client.counters()).toMatchObject({ acquired: N, released: N, releaseFailures: 0, active: 0 });
  });

  it('new client, old holder: auto-renew falls back to unary Renew and keeps leases alive', async () => {
    const { lock, address } = await oldHolder(1000);
    const client = new LockClient({ logger: silentLogger, safetyMarginMs: 50 });
    cleanups.push(() => client.close());
    const guards = await Promise.all([1, 2, 3].map((i) => client.acquire(address, [`block:old:${i}`], { autoRenew: { everyMs: 100 } })));
    await waitFor(() => lock.counters().requests.renew >= 30, 'unary renewals');
    expect(lock.counters()).toMatchObject({ acquired: 3, active: 3, expired: 0 });
    for (const g of guards) expect(g.state).toBe('active');
    for (const g of guards) await g.release();
    expect(lock.counters()).toMatchObject({ released: 3, active: 0 });
  });

  it('old client, new holder: unary Release and Renew still work', async () => {
    const server = new LockServer({ holderId: 'new', lockTimeoutMs: 30_000, logger: silentLogger });
    const port = await server.listen();
    cleanups.push(() => server.close({ graceMs: 0 }));
    const { Client } = loadLockProtocol();
    const raw = new Client(`127.0.0.1:${port}`, grpc.credentials.createInsecure());
    cleanups.push(() => raw.close());
    const unary = <T>(f: (cb: (e: grpc.ServiceError | null, r?: T) => void) => void): Promise<T> =>
      new Promise((resolve, reject) => f((e, r) => (e ? reject(e) : resolve(r as T))));
    const md = new grpc.Metadata();
    const acquired = await unary<{ sessionId: string }>((cb) => raw.Acquire({ requesterId: 'oldclient', blockIds: ['block:new:1'], leaseMs: 0, acquireId: '' }, md, {}, cb));
    const renewed = await unary<{ leaseMs: number }>((cb) => raw.Renew({ requesterId: 'oldclient', sessionId: acquired.sessionId, leaseMs: 5000 }, md, {}, cb));
    expect(renewed.leaseMs).toBe(5000);
    const released = await unary<{ released: number }>((cb) => raw.Release({ requesterId: 'oldclient', sessionId: acquired.sessionId, acquireId: '' }, md, {}, cb));
    expect(released.released).toBe(1);
    expect(server.counters()).toMatchObject({ acquired: 1, released: 1, active: 0, requests: { acquire: 1, renew: 1, release: 1, releaseMany: 0, renewMany: 0 } });
  });
});
