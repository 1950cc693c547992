import { AbortedError, ClosedError, RemoteRejectedError, TimedOutError } from '@tensorwire/core';
import { Registry } from 'prom-client';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient, type LockGuard, type ReleaseFailure } from '../src/index.js';
import { LockServer } from '../src/server/index.js';
import { blocks, harness, waitFor, type Harness } from './helpers.js';

let h: Harness | undefined;
afterEach(async () => {
  await h?.close();
  h = undefined;
});

/** A resolver that holds every acquire until `open()` is called. */
function gate(): { resolve: () => Promise<Uint8Array[]>; open: () => void } {
  let release!: () => void;
  const opened = new Promise<void>((r) => (release = r));
  return {
    resolve: async () => {
      await opened;
      return [];
    },
    open: () => release(),
  };
}

describe('LockGuard releases exactly once on every exit path', () => {
  it('completion of an `await using` scope', async () => {
    h = await harness();
    const { client, holder } = h;
    {
      await using lock = await client.acquire(holder, ['block:holder1:1', 'block:holder1:2']);
      expect(lock.sessionId).toMatch(/^session:holder1:/);
      expect(h.server.counters().active).toBe(1);
    }
    expect(h.releases()).toBe(1);
    expect(h.server.counters()).toMatchObject({ acquired: 1, released: 1, active: 0 });
    expect(client.counters()).toMatchObject({ acquired: 1, released: 1, active: 0, releaseFailures: 0 });
  });

  it('a thrown error inside the scope', async () => {
    h = await harness();
    const { client, holder } = h;
    let seen: LockGuard | undefined;
    const work = async (): Promise<void> => {
      await using lock = await client.acquire(holder, ['block:holder1:1']);
      seen = lock;
      throw new Error('transfer failed');
    };
    await expect(work()).rejects.toThrow('transfer failed');
    expect(h.releases()).toBe(1);
    expect(seen?.state).toBe('released');
    expect(seen?.signal.aborted).toBe(true);
    expect(h.server.counters().active).toBe(0);
  });

  it('an abort while the lease is held (the transfer honours lock.signal and the caller\'s signal)', async () => {
    h = await harness();
    const { client, holder } = h;
    const ac = new AbortController();
    const work = async (): Promise<void> => {
      await using lock = await client.acquire(holder, ['block:holder1:1'], { signal: ac.signal });
      const both = AbortSignal.any([ac.signal, lock.signal]);
      await new Promise<void>((_, reject) => both.addEventListener('abort', () => reject(new AbortedError('transfer aborted')), { once: true }));
    };
    const running = work();
    // Held: the holder granted it and the client has the guard (not an acquire still in flight).
    await waitFor(() => h?.server.counters().active === 1 && h.client.counters().acquired === 1, 'grant');
    ac.abort();
    await expect(running).rejects.toBeInstanceOf(AbortedError);
    expect(h.releases()).toBe(1);
    expect(h.server.counters()).toMatchObject({ released: 1, active: 0 });
  });

  it('explicit release, then disposal is a no-op', async () => {
    h = await harness();
    const { client, holder } = h;
    {
      await using lock = await client.acquire(holder, ['block:holder1:1', 'block:holder1:2']);
      const [a, b] = await Promise.all([lock.release(), lock.release()]);
      expect(a).toEqual({ confirmed: true, blocksReleased: 2, attempts: 1 });
      expect(b).toBe(a);
      await expect(lock.renew()).rejects.toBeInstanceOf(ClosedError);
    }
    expect(h.releases()).toBe(1);
  });

  it('an acquire aborted after the holder granted it releases that session at once', async () => {
    const g = gate();
    h = await harness({ resolve: g.resolve });
    const { client, holder } = h;
    const ac = new AbortController();
    const pending = client.acquire(holder, ['block:holder1:1'], { signal: ac.signal });
    await waitFor(() => h?.server.counters().acquired === 1, 'grant on the holder');
    ac.abort();
    await expect(pending).rejects.toBeInstanceOf(AbortedError);
    await waitFor(() => h?.releases() === 1, 'release by acquire id');
    g.open();
    await waitFor(() => h?.server.counters().active === 0, 'lease ended');
    expect(h.releases()).toBe(1);
    expect(h.server.counters()).toMatchObject({ acquired: 1, released: 1, expired: 0, active: 0, pinnedBlocks: 0 });
    expect(client.counters()).toMatchObject({ acquired: 0, abandonedAcquires: 1 });
  });

  it('an acquire that times out after the grant releases it too', async () => {
    const g = gate();
    h = await harness({ resolve: g.resolve });
    const { client, holder } = h;
    const pending = client.acquire(holder, ['block:holder1:1'], { timeoutMs: 300 });
    await expect(pending).rejects.toBeInstanceOf(TimedOutError);
    await waitFor(() => h?.releases() === 1, 'release by acquire id');
    g.open();
    await waitFor(() => h?.server.counters().active === 0, 'lease ended');
    expect(h.server.counters()).toMatchObject({ acquired: 1, released: 1, active: 0 });
    expect(h.releases()).toBe(1);
  });

  it('an abort before the acquire starts sends nothing', async () => {
    h = await harness();
    const err = await h.client.acquire(h.holder, ['block:holder1:1'], { signal: AbortSignal.abort() }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(AbortedError);
    expect(h.server.counters().requests).toEqual({ acquire: 0, release: 0, renew: 0, health: 0, releaseMany: 0, renewMany: 0 });
  });

  it('a dropped promise: the guard is released when it is garbage-collected', async (ctx) => {
    const gc = (globalThis as { gc?: () => void }).gc;
    if (gc === undefined) {
      console.log('skipping dropped-guard test: run node with --expose-gc (vitest.config.ts sets it)');
      ctx.skip();
      return;
    }
    h = await harness();
    const { client, holder } = h;
    const leaked: string[] = [];
    client.on('guardLeaked', (e) => leaked.push(e.sessionId));
    void client.acquire(holder, ['block:holder1:1']);
    await waitFor(() => client.counters().acquired === 1, 'grant');
    await waitFor(() => {
      gc();
      return h?.releases() === 1;
    }, 'finalizer release');
    await waitFor(() => h?.server.counters().active === 0, 'lease ended');
    // The holder has the release; the client counts it once the answer is back.
    await waitFor(() => client.counters().released === 1, 'release confirmed');
    expect(leaked).toHaveLength(1);
    expect(h.releases()).toBe(1);
    expect(client.counters()).toMatchObject({ acquired: 1, released: 1, leakedGuards: 1, active: 0 });
  });

  it('closing the client releases every live guard once and refuses new acquires', async () => {
    h = await harness();
    const { client, holder } = h;
    const guards = await Promise.all([1, 2, 3].map((i) => client.acquire(holder, [`block:holder1:${i}`])));
    await client.close();
    await client.close();
    expect(h.releases()).toBe(3);
    for (const g of guards) {
      expect(g.state).toBe('released');
      expect(g.signal.reason).toBeInstanceOf(ClosedError);
      await g[Symbol.asyncDispose]();
    }
    expect(h.releases()).toBe(3);
    await expect(client.acquire(holder, ['block:holder1:9'])).rejects.toBeInstanceOf(ClosedError);
    expect(h.server.counters()).toMatchObject({ acquired: 3, released: 3, active: 0 });
  });

  it('closing the client abandons an acquire in flight and releases its grant', async () => {
    const g = gate();
    h = await harness({ resolve: g.resolve });
    const { client, holder } = h;
    const pending = client.acquire(holder, ['block:holder1:1']);
    await waitFor(() => h?.server.counters().acquired === 1, 'grant on the holder');
    const closing = client.close();
    await expect(pending).rejects.toBeInstanceOf(ClosedError);
    await closing;
    g.open();
    await waitFor(() => h?.server.counters().active === 0, 'lease ended');
    expect(h.releases()).toBe(1);
  });
});

describe('release failures', () => {
  it('retries with backoff, reports through an event and a metric, never throws; a restarted holder answers harmlessly', async () => {
    const server = new LockServer({ holderId: 'holder1', lockTimeoutMs: 30_000 });
    const port = await server.listen();
    const holder = `127.0.0.1:${port}`;
    const registry = new Registry();
    const client = new LockClient({ registry, releaseTimeoutMs: 500, releaseRetry: { initialDelayMs: 20, maxDelayMs: 100 } });
    const retries: ReleaseFailure[] = [];
    client.on('releaseRetry', (e) => retries.push(e));
    const guard = await client.acquire(holder, ['block:holder1:1']);
    await server.abort();
    const releasing = guard.release();
    await waitFor(() => retries.length >= 2, 'retries');
    // The holder comes back (a new incarnation on the same port) while we retry.
    const again = new LockServer({ holderId: 'holder1', lockTimeoutMs: 30_000 });
    await again.listen(holder);
    const result = await releasing;
    expect(result.confirmed).toBe(true);
    expect(result.blocksReleased).toBe(0);
    expect(result.attempts).toBeGreaterThan(1);
    // One batched release call carrying the lease (the new holder has ReleaseMany).
    expect(again.counters()).toMatchObject({ acquired: 0, released: 0, active: 0, requests: { release: 0, releaseMany: 1 }, releaseEntries: 1 });
    expect(client.counters().releaseRetries).toBe(result.attempts - 1);
    expect(await registry.metrics()).toMatch(new RegExp(`tensorwire_lock_client_release_retries_total ${result.attempts - 1}`));
    await client.close();
    await again.close({ graceMs: 0 });
  });

  it('gives up once the lease would have expired anyway, and disposal still resolves', async () => {
    const server = new LockServer({ holderId: 'holder1', lockTimeoutMs: 300, minLeaseMs: 300 });
    const port = await server.listen();
    const registry = new Registry();
    const client = new LockClient({ registry, releaseTimeoutMs: 200, releaseRetry: { initialDelayMs: 10, maxDelayMs: 40 } });
    const failures: ReleaseFailure[] = [];
    client.on('releaseFailed', (e) => failures.push(e));
    const guard = await client.acquire(`127.0.0.1:${port}`, ['block:holder1:1']);
    await server.abort();
    await guard[Symbol.asyncDispose]();
    await waitFor(() => failures.length === 1, 'releaseFailed event');
    expect(failures[0]?.sessionId).toBe(guard.sessionId);
    expect(failures[0]?.error.code).toBe('TW_CONNECTION_BROKEN');
    expect(client.counters()).toMatchObject({ acquired: 1, released: 0, releaseFailures: 1, active: 0 });
    expect(await registry.metrics()).toMatch(/tensorwire_lock_client_release_failures_total 1/);
    await client.close();
  });

  it('does not retry a release the holder refuses permanently', async () => {
    h = await harness();
    const failures: ReleaseFailure[] = [];
    // The holder restarts requiring a token this client does not have: UNAUTHENTICATED is final.
    const guard = await h.client.acquire(h.holder, ['block:holder1:1']);
    const port = h.server.port;
    await h.server.abort();
    const strict = new LockServer({ holderId: 'holder1', lockTimeoutMs: 30_000, token: 'now-required' });
    await strict.listen(`127.0.0.1:${port}`);
    h.client.on('releaseFailed', (e) => failures.push(e));
    const result = await guard.release();
    expect(result.confirmed).toBe(false);
    expect(result.error).toBeInstanceOf(RemoteRejectedError);
    expect((result.error as RemoteRejectedError).remoteCode).toBe('UNAUTHENTICATED');
    // Attempts before the holder was back failed to connect; once refused, no further attempt.
    expect(strict.counters().requests.releaseMany).toBe(1);
    expect(failures).toHaveLength(1);
    expect(h.client.counters()).toMatchObject({ releaseFailures: 1, active: 0 });
    await strict.close({ graceMs: 0 });
  });
});

describe('renewal, budget and lease loss', () => {
  it('exposes deadline, transfer budget and descriptors; renew extends the deadline', async () => {
    h = await harness({ lockTimeoutMs: 10_000, resolve: (ids) => ids.map(() => Buffer.from([1, 2, 3])) }, { safetyMarginMs: 1000 });
    await using lock = await h.client.acquire(h.holder, ['block:holder1:1'], { leaseMs: 5000 });
    expect(lock.leaseMs).toBe(5000);
    expect(lock.lockTimeoutMs).toBe(10_000);
    expect(lock.safetyMarginMs).toBe(1000);
    expect(lock.transferDeadline).toBe(lock.deadline - 1000);
    expect(lock.budgetMs).toBeLessThanOrEqual(4000);
    expect(lock.budgetMs).toBeGreaterThan(0);
    expect([...lock.descriptorsFor('block:holder1:1')[0] ?? []]).toEqual([1, 2, 3]);
    const before = lock.deadline;
    const serverBefore = h.server.table.get(lock.sessionId)?.deadline ?? 0;
    const after = await lock.renew({ leaseMs: 10_000 });
    expect(after).toBe(lock.deadline);
    expect(after).toBeGreaterThan(before);
    expect(lock.leaseMs).toBe(10_000);
    expect(h.server.table.get(lock.sessionId)?.deadline).toBeGreaterThan(serverBefore);
    // Our deadline never runs past the holder's.
    expect(lock.deadline).toBeLessThanOrEqual(h.server.table.get(lock.sessionId)?.deadline ?? 0);
  });

  it('auto-renew keeps a lease alive past several lease lengths', async () => {
    // A 1 s lease renewed every 100 ms: survives event-loop stalls of most of a second.
    h = await harness({ lockTimeoutMs: 1000, minLeaseMs: 1000 }, { safetyMarginMs: 50 });
    await using lock = await h.client.acquire(h.holder, ['block:holder1:1'], { autoRenew: { everyMs: 100 } });
    const first = lock.deadline;
    await waitFor(() => (h?.server.counters().renewEntries ?? 0) >= 30, 'renewals');
    expect(h.server.table.get(lock.sessionId)).toBeDefined();
    expect(lock.deadline).toBeGreaterThan(first);
    expect(lock.state).toBe('active');
    expect(h.server.counters().expired).toBe(0);
  });

  it('fires the guard signal when the transfer budget runs out, and a renew after expiry marks the lease lost', async () => {
    h = await harness({ lockTimeoutMs: 200, minLeaseMs: 200 }, { safetyMarginMs: 50 });
    const lost: string[] = [];
    h.client.on('leaseLost', (e) => lost.push(e.sessionId));
    const lock = await h.client.acquire(h.holder, ['block:holder1:1']);
    await new Promise<void>((resolve) => lock.signal.addEventListener('abort', () => resolve(), { once: true }));
    expect(lock.signal.reason).toBeInstanceOf(TimedOutError);
    await waitFor(() => h?.server.counters().expired === 1, 'holder GC');
    const err = await lock.renew().catch((e: unknown) => e);
    expect((err as RemoteRejectedError).remoteCode).toBe('NOT_FOUND');
    expect(lock.state).toBe('lost');
    expect(lost).toEqual([lock.sessionId]);
    const r = await lock.release();
    expect(r).toMatchObject({ confirmed: true, blocksReleased: 0 });
    expect(h.releases()).toBe(1);
    const c = h.server.counters();
    expect(c).toMatchObject({ acquired: 1, released: 0, expired: 1, active: 0 });
  });
});

describe('scale', () => {
  it('1,000 concurrent sessions, each released exactly once, counters balanced', async () => {
    const pinned = new Map<string, number>();
    h = await harness({
      pin: (b) => pinned.set(b, (pinned.get(b) ?? 0) + 1),
      unpin: (b) => pinned.delete(b),
      resolve: (ids) => ids.map((id) => Buffer.from(id)),
    });
    const { client, holder } = h;
    const N = 1000;
    // Overlapping block sets so many sessions pin the same block.
    const guards = await Promise.all(Array.from({ length: N }, (_, i) => client.acquire(holder, blocks('holder1', 3, i % 50))));
    expect(new Set(guards.map((g) => g.sessionId)).size).toBe(N);
    expect(h.server.counters()).toMatchObject({ acquired: N, active: N, activeBlocks: 3 * N, pinnedBlocks: 52 });
    expect([...pinned.values()].every((v) => v === 1)).toBe(true);
    await Promise.all(guards.map(async (g) => {
      await using _lock = g;
    }));
    expect(h.releases()).toBe(N);
    const c = h.server.counters();
    expect(c).toMatchObject({ acquired: N, released: N, expired: 0, active: 0, activeBlocks: 0, pinnedBlocks: 0 });
    expect(pinned.size).toBe(0);
    expect(client.counters()).toMatchObject({ acquired: N, released: N, active: 0 });
  });
});
