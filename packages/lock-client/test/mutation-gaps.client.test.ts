/**
 * Tests for mutants of the client's release paths (src/client.ts) that survived the mutation
 * run of issue 14: the `expired` counter, the removal of a lease's record when it ends (by
 * release or by `dropLeases`), taking a lease off the auto-renew schedule, the finalizer of a
 * dropped lease, the leaked-guard warning, and what `close()` tears down (the close signal,
 * channels, metrics) and the errors it ends things with. Invariant 3: every lease is released
 * exactly once and `acquired = released + releaseFailures + expired + dropped + active`.
 */
import net from 'node:net';
import * as grpc from '@grpc/grpc-js';
import { ClosedError, ConnectionBrokenError, silentLogger, type Logger } from '@tensorwire/core';
import { Registry } from 'prom-client';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient, type LockGuard } from '../src/index.js';
import { RETRY_AFTER_METADATA_KEY } from '../src/proto.js';
import { LockServer, loadLockProtocol } from '../src/server/index.js';
import { bindLoopback, harness, waitFor, type Harness } from './helpers.js';

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

async function track(h: Harness): Promise<Harness> {
  cleanups.push(() => h.close());
  return h;
}

type Handler = (call: unknown, cb: grpc.sendUnaryData<unknown>) => void;

/** A LockServer's handlers on a grpc server of our own, with some of them replaced. */
async function holderWith(
  replace: (real: Record<string, Handler>) => Record<string, Handler>,
  serverOpts: Partial<ConstructorParameters<typeof LockServer>[0]> = {}
): Promise<{ address: string; lock: LockServer }> {
  const lock = new LockServer({
    holderId: 'holder1',
    lockTimeoutMs: 60_000,
    logger: silentLogger,
    ...serverOpts,
  });
  const handlers = lock.handlers() as unknown as Record<string, Handler>;
  const real = { ...handlers };
  Object.assign(handlers, replace(real));
  const server = new grpc.Server();
  server.addService(loadLockProtocol().service, handlers as unknown as grpc.UntypedServiceImplementation);
  const port = await bindLoopback(server);
  cleanups.push(async () => {
    server.forceShutdown();
    await lock.abort();
  });
  return { address: `127.0.0.1:${port}`, lock };
}

const gc = (globalThis as { gc?: () => void }).gc;

const tick = (): Promise<unknown> => new Promise((r) => setTimeout(r, 5));

/**
 * Collect until `ref` is cleared (bounded by tries, not by time). `deref()` keeps its target
 * alive until the end of the current job, so each collection runs in a later job than the
 * last `deref()`.
 */
async function collected(ref: WeakRef<object>, tries = 100): Promise<boolean> {
  for (let i = 0; i < tries; i++) {
    await tick();
    gc?.();
    await tick();
    if (ref.deref() === undefined) return true;
  }
  return false;
}

describe('the expired counter (invariant 3)', () => {
  it('a release that waited in the queue past its lease deadline is not sent and counts as expired, not as a failure', async () => {
    // The first ReleaseMany is held until we let it go; with one call in flight per holder,
    // the second lease's release waits behind it until its deadline has passed.
    const held: (() => void)[] = [];
    let hold = true;
    let releaseCalls = 0;
    const { address, lock } = await holderWith(
      (real) => ({
        ReleaseMany: (call, cb) => {
          releaseCalls++;
          if (hold) {
            hold = false;
            held.push(() => real['ReleaseMany']?.(call, cb));
          } else real['ReleaseMany']?.(call, cb);
        },
      }),
      { minLeaseMs: 100 }
    );
    const client = new LockClient({
      requesterId: 'req1',
      maxCallsInFlightPerHolder: 1,
      releaseTimeoutMs: 30_000,
      logger: silentLogger,
    });
    cleanups.push(() => client.close());
    const long = await client.acquire(address, ['block:holder1:1']);
    const short = await client.acquire(address, ['block:holder1:2'], {
      leaseMs: 200,
    });
    const first = long.release();
    await waitFor(() => held.length === 1, 'first release call held at the holder');
    const second = short.release();
    await waitFor(() => Date.now() > short.deadline + 20, 'short lease deadline passed');
    expect(client.holderStats().get(address)?.releaseQueued).toBe(1);
    held[0]?.();
    const [r1, r2] = await Promise.all([first, second]);
    expect(r1).toMatchObject({ confirmed: true, blocksReleased: 1 });
    expect(r2).toMatchObject({ confirmed: false, expired: true, attempts: 0 });
    expect(releaseCalls).toBe(1); // the expired lease was never sent
    const c = client.counters();
    expect(c).toMatchObject({
      acquired: 2,
      released: 1,
      expired: 1,
      releaseFailures: 0,
      dropped: 0,
      active: 0,
    });
    expect(c.acquired).toBe(c.released + c.releaseFailures + c.expired + c.dropped + c.active);
    // The holder's GC is the backstop for the lease that was not sent.
    await waitFor(() => lock.counters().expired === 1, 'holder GC expired the unsent lease');
    expect(lock.counters()).toMatchObject({
      acquired: 2,
      released: 1,
      expired: 1,
      active: 0,
    });
  });
});

describe('a lease that ends leaves the auto-renew schedule', () => {
  it('release() takes it off at once', async () => {
    const h = await track(await harness({ logger: silentLogger }, { logger: silentLogger }));
    const g = await h.client.acquire(h.holder, ['block:holder1:1'], {
      autoRenew: { everyMs: 60_000 },
    });
    expect(h.client.holderStats().get(h.holder)?.autoRenewed).toBe(1);
    await g.release();
    expect(h.client.holderStats().get(h.holder)?.autoRenewed).toBe(0);
  });

  it('dropLeases takes it off at once', async () => {
    const h = await track(await harness({ logger: silentLogger }, { logger: silentLogger }));
    await h.client.acquire(h.holder, ['block:holder1:1'], {
      autoRenew: { everyMs: 60_000 },
    });
    expect(h.client.holderStats().get(h.holder)?.autoRenewed).toBe(1);
    expect(h.client.dropLeases(h.holder, new ConnectionBrokenError('holder restarted'))).toBe(1);
    expect(h.client.holderStats().get(h.holder)?.autoRenewed).toBe(0);
  });
});

describe('dropLeases forgets what it dropped', () => {
  it('a second drop of the same holder, with nothing released in between, drops nothing and counts nothing', async () => {
    const h = await track(await harness({ logger: silentLogger }, { logger: silentLogger }));
    const guards = await Promise.all([1, 2].map((i) => h.client.acquire(h.holder, [`block:holder1:${i}`])));
    const lost: string[] = [];
    h.client.on('leaseLost', (e) => lost.push(e.sessionId));
    const reason = new ConnectionBrokenError('holder restarted');
    expect(h.client.dropLeases(h.holder, reason)).toBe(2);
    expect(h.client.dropLeases(h.holder, reason)).toBe(0);
    expect(lost.sort()).toEqual(guards.map((g) => g.sessionId).sort());
    const c = h.client.counters();
    expect(c).toMatchObject({ acquired: 2, dropped: 2, active: 0 });
    expect(c.acquired).toBe(c.released + c.releaseFailures + c.expired + c.dropped + c.active);
    await h.client.close();
    expect(h.releases()).toBe(0);
    expect(h.client.counters()).toMatchObject({
      acquired: 2,
      released: 0,
      releaseFailures: 0,
      dropped: 2,
      active: 0,
    });
  });
});

describe('an ended lease leaves nothing behind in the client', () => {
  // The guard's blockIds array belongs to the client's record of the lease: once the lease has
  // ended and the guard is dropped, nothing may keep that record (a client serving millions of
  // leases would otherwise grow without bound).
  for (const how of ['released', 'dropped'] as const) {
    it(`after it is ${how}, its record is collectable`, async (ctx) => {
      if (gc === undefined) {
        console.log('skipping: needs gc() (node --expose-gc; the vitest configs set it)');
        ctx.skip();
        return;
      }
      const h = await track(await harness({ logger: silentLogger }, { logger: silentLogger }));
      const ref = await (async () => {
        const g = await h.client.acquire(h.holder, ['block:holder1:1']);
        if (how === 'released') expect((await g.release()).confirmed).toBe(true);
        else expect(h.client.dropLeases(h.holder, new ConnectionBrokenError('holder restarted'))).toBe(1);
        return new WeakRef(g.blockIds as object);
      })();
      expect(await collected(ref)).toBe(true);
      expect(h.client.counters()).toMatchObject({
        acquired: 1,
        active: 0,
        leakedGuards: 0,
      });
    });
  }
});

describe('the finalizer', () => {
  it('a dropped lease whose guard is collected is not counted as leaked; a leaked guard is released, counted and logged once', async (ctx) => {
    if (gc === undefined) {
      console.log('skipping: needs gc() (node --expose-gc; the vitest configs set it)');
      ctx.skip();
      return;
    }
    const warnings: {
      message: string;
      fields: Record<string, unknown> | undefined;
    }[] = [];
    const logger: Logger = {
      ...silentLogger,
      warn: (message, fields) => warnings.push({ message, fields }),
    };
    const h = await track(await harness({ logger: silentLogger }, { logger }));
    const leaked: string[] = [];
    h.client.on('guardLeaked', (e) => leaked.push(e.sessionId));
    // A guard dropped by dropLeases, then garbage-collected.
    const droppedRef = await (async () => {
      const g = await h.client.acquire(h.holder, ['block:holder1:1']);
      expect(h.client.dropLeases(h.holder, new ConnectionBrokenError('holder restarted'))).toBe(1);
      return new WeakRef(g);
    })();
    expect(await collected(droppedRef)).toBe(true);
    // A sentinel guard, leaked after the dropped one was collected: once the (single)
    // finalization registry has run its callback, it has also run any for the dropped guard.
    let sentinelId = '';
    const sentinelRef = await (async () => {
      const g = await h.client.acquire(h.holder, ['block:holder1:2']);
      sentinelId = g.sessionId;
      return new WeakRef(g);
    })();
    expect(await collected(sentinelRef)).toBe(true);
    await waitFor(() => leaked.length >= 1, 'sentinel leaked');
    await waitFor(() => h.client.counters().released === 1, 'sentinel released');
    expect(leaked).toEqual([sentinelId]);
    expect(h.releases()).toBe(1);
    // The dropped lease is the holder's GC's to end (its incarnation "ended"; here it did not).
    expect(h.server.counters()).toMatchObject({
      acquired: 2,
      released: 1,
      active: 1,
    });
    expect(h.client.counters()).toMatchObject({
      acquired: 2,
      released: 1,
      dropped: 1,
      leakedGuards: 1,
      active: 0,
    });
    const warned = warnings.filter((w) => /collected without release/.test(w.message));
    expect(warned).toHaveLength(1);
    expect(warned[0]?.fields).toEqual({
      sessionId: sentinelId,
      holder: h.holder,
    });
  });
});

describe('close()', () => {
  it('ends live guards and acquires in flight with a ClosedError that says the client closed', async () => {
    let hanging = 0;
    const { address } = await holderWith((real) => ({
      // The second acquire never gets an answer: it is in flight when the client closes.
      Acquire: (call, cb) => {
        const ids = (call as { request: { blockIds: string[] } }).request.blockIds;
        if (ids[0] !== 'block:holder1:hang') real['Acquire']?.(call, cb);
        else hanging++;
      },
    }));
    const client = new LockClient({
      requesterId: 'req1',
      closeTimeoutMs: 2000,
      logger: silentLogger,
    });
    cleanups.push(() => client.close());
    const live = await client.acquire(address, ['block:holder1:1']);
    const signal = live.signal;
    const inFlight = client.acquire(address, ['block:holder1:hang']).catch((e: unknown) => e);
    await waitFor(() => hanging === 1, 'acquire in flight at the holder');
    await client.close();
    expect(signal.reason).toBeInstanceOf(ClosedError);
    expect((signal.reason as Error).message).toMatch(/lock client closed/);
    const err = await inFlight;
    expect(err).toBeInstanceOf(ClosedError);
    expect((err as Error).message).toMatch(/lock client closed/);
    expect(client.counters()).toMatchObject({
      acquired: 1,
      released: 1,
      abandonedAcquires: 1,
      active: 0,
    });
  });

  it('wakes an acquire that is backing off from an overloaded holder (it rejects ClosedError without another attempt)', async () => {
    let acquireCalls = 0;
    const { address } = await holderWith(() => ({
      // Always overloaded, and asks for a pause far longer than any test.
      Acquire: (_call, cb) => {
        acquireCalls++;
        const md = new grpc.Metadata();
        md.set(RETRY_AFTER_METADATA_KEY, '3600000');
        cb(
          {
            code: grpc.status.RESOURCE_EXHAUSTED,
            details: 'overloaded',
            metadata: md,
          } as grpc.ServiceError,
          null
        );
      },
    }));
    const client = new LockClient({
      requesterId: 'req1',
      logger: silentLogger,
    });
    cleanups.push(() => client.close());
    const pending = client.acquire(address, ['block:holder1:1'], { timeoutMs: 24 * 3600_000 }).catch((e: unknown) => e);
    await waitFor(() => client.counters().acquireRetries === 1, 'acquire backing off');
    await client.close();
    const err = await pending;
    expect(err).toBeInstanceOf(ClosedError);
    expect(acquireCalls).toBe(1);
    expect(client.counters()).toMatchObject({
      acquired: 0,
      acquireRetries: 1,
      active: 0,
    });
  });

  it('unregisters its metrics from a shared registry (a new client can register there again)', async () => {
    const registry = new Registry();
    const h = await track(await harness({ logger: silentLogger }, { registry, logger: silentLogger }));
    await (await h.client.acquire(h.holder, ['block:holder1:1'])).release();
    expect(registry.getSingleMetric('tensorwire_lock_client_acquired_total')).toBeDefined();
    await h.client.close();
    expect(registry.getMetricsAsArray()).toHaveLength(0);
    const next = new LockClient({ registry, logger: silentLogger });
    cleanups.push(() => next.close());
    expect(registry.getSingleMetric('tensorwire_lock_client_acquired_total')).toBeDefined();
  });

  it('closes its connections to holders', async () => {
    const server = new LockServer({
      holderId: 'holder1',
      lockTimeoutMs: 30_000,
      logger: silentLogger,
    });
    const port = await server.listen('127.0.0.1:0');
    cleanups.push(() => server.close({ graceMs: 0 }));
    // A TCP relay in front of the holder counts the client's open connections.
    const open = new Set<net.Socket>();
    const relay = net.createServer((s) => {
      open.add(s);
      const up = net.connect(port, '127.0.0.1');
      s.pipe(up).pipe(s);
      const end = (): void => {
        open.delete(s);
        s.destroy();
        up.destroy();
      };
      s.on('close', end).on('error', end);
      up.on('close', end).on('error', end);
    });
    await new Promise<void>((resolve) => relay.listen(0, '127.0.0.1', resolve));
    cleanups.push(
      () =>
        new Promise<void>((resolve) => {
          for (const s of open) s.destroy();
          relay.close(() => resolve());
        })
    );
    const address = `127.0.0.1:${(relay.address() as net.AddressInfo).port}`;
    const client = new LockClient({
      requesterId: 'req1',
      logger: silentLogger,
    });
    const guards: LockGuard[] = [await client.acquire(address, ['block:holder1:1'])];
    expect(open.size).toBe(1);
    await client.close();
    expect(guards[0]?.state).toBe('released');
    await waitFor(() => open.size === 0, 'client connection closed');
    expect(server.counters()).toMatchObject({
      acquired: 1,
      released: 1,
      active: 0,
    });
  });
});
