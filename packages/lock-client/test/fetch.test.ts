/**
 * The fetch flow as a library: engineGrants (holder) and LockClient.fetch (requester), over
 * real TCP engines and a real lock service on loopback.
 */
import { getEventListeners, once } from 'node:events';
import net from 'node:net';
import { describe, expect, it } from 'vitest';
import { AbortedError, ClosedError, InvalidInputError, RemoteRejectedError, TcpTransport, TransferEngine, decodeEndpoint, decodeTcpEndpoint, encodeEndpoint, encodeTcpEndpoint, silentLogger, type Registration } from '@tensorwire/core';
import { createStreamRelay, type StreamRelay } from '@tensorwire/core/testing';
import { decodeFetchDescriptor } from '../src/index.js';
import { LockServer, engineGrants, type EngineGrants } from '../src/server/index.js';
import { forkFixture, killChildrenAfterEach } from './children.js';
import { dependants, fetchRequester, namingEndpoint, serveFetchHolder, waitFor, type FetchHolder, type FetchRequester } from './helpers.js';

const BLOCK = 4096;

type Holder = FetchHolder;

async function holder(blocks: number, lockTimeoutMs = 30_000): Promise<Holder> {
  const engine = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
  const region = new Uint8Array(blocks * BLOCK).map((_, i) => (i * 131 + (i >> 12)) & 255);
  const registration = await engine.register({ kind: 'host', buffer: region });
  // Block i lives at slot (i * 7) % blocks of the region: not in order, as a KV arena is.
  const map = new Map(Array.from({ length: blocks }, (_, i) => [`block:kv:${i}`, { registration, offset: ((i * 7) % blocks) * BLOCK, length: BLOCK }] as const));
  // And the same region as a numbered space (block n at slot n), for leases by number.
  const grants = engineGrants({ engine, blocks: map, spaces: { arena: { registration, blockBytes: BLOCK } } });
  return serveFetchHolder(engine, region, grants, { lockTimeoutMs, minLeaseMs: Math.min(lockTimeoutMs, 1000) });
}

/**
 * A holder whose lease descriptors name its engine behind a relay the test controls: stalling
 * the relay stalls every read of a fetch (the lease is granted, its bytes never come).
 */
async function relayedHolder(blocks: number): Promise<Holder & { relay: StreamRelay }> {
  const engine = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
  const region = new Uint8Array(blocks * BLOCK);
  const registration = await engine.register({ kind: 'host', buffer: region });
  const grants = engineGrants({ engine, spaces: { arena: { registration, blockBytes: BLOCK } } });
  const ep = decodeEndpoint(engine.endpoint());
  const relay = await createStreamRelay(decodeTcpEndpoint(ep.transports.get('tcp') as Uint8Array));
  const address = relay.address as { host: string; port: number };
  const relayed = encodeEndpoint({ identity: ep.identity, transports: new Map([['tcp', encodeTcpEndpoint(address.host, address.port)]]) });
  const h = await serveFetchHolder(engine, region, grants, { resolveLease: namingEndpoint(grants.lockServerOptions.resolveLease, () => relayed) }, () => relay.close());
  return { ...h, relay };
}

function slotOf(region: Uint8Array, i: number, blocks: number): Uint8Array {
  const s = ((i * 7) % blocks) * BLOCK;
  return region.subarray(s, s + BLOCK);
}

function requester(name = 'req', localLane = true): Promise<FetchRequester> {
  return fetchRequester({ name, localLane, blocks: 1000, blockBytes: BLOCK });
}

const ids = (n: number): string[] => Array.from({ length: n }, (_, i) => `block:kv:${i}`);

function balanced(h: Holder): void {
  const c = h.server.counters();
  expect(c.acquired).toBe(c.released + c.expired + c.active);
  const g = h.grants.counters();
  expect(g.issued).toBe(g.revoked + g.live);
}

/** Every lease of `h` released and its `grants` grants revoked (waited for), and the books balanced. */
async function allReleased(h: Holder, grants: number): Promise<void> {
  await waitFor(() => h.server.counters().active === 0, 'leases released');
  await h.grants.settled();
  expect(h.grants.counters()).toMatchObject({ issued: grants, revoked: grants, live: 0 });
  balanced(h);
}

describe('fetch: lease + grant + read + release as one call', () => {
  it('1,000 blocks: one range grant per lease, bytes verified, grant revoked exactly once on dispose', async () => {
    const h = await holder(1000);
    const r = await requester();
    const destinations = ids(1000).map((_, i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    for (let round = 0; round < 3; round++) {
      r.dst.fill(0);
      {
        const fetch = await r.client.fetch(r.engine, h.address, ids(1000), destinations, { timeoutMs: 10_000 });
        expect(fetch.transport).toBe('tcp');
        expect(fetch.report.bytes).toBe(1000 * BLOCK);
        expect(fetch.lease.leaseDescriptors).toHaveLength(1);
        expect(h.grants.counters().live).toBe(1);
        // One grant descriptor for the lease, whatever the number of blocks.
        expect(decodeFetchDescriptor(fetch.lease.leaseDescriptors[0] as Uint8Array).grant.length).toBeLessThan(120);
        await fetch[Symbol.asyncDispose]();
        await fetch.release(); // exactly once: a second release sends nothing more
      }
      for (let i = 0; i < 1000; i++) expect(Buffer.compare(r.dst.subarray(i * BLOCK, (i + 1) * BLOCK), slotOf(h.region, i, 1000))).toBe(0);
    }
    await allReleased(h, 3);
    expect(h.server.counters()).toMatchObject({ acquired: 3, released: 3, active: 0 });
    expect(h.engine.liveGrants).toBe(0);
    await r.close();
    await h.close();
  });

  it('one destinations array used with two holders in turn, then by another engine: each fetch lands its own holder\'s bytes; the other engine is refused and its lease released', async () => {
    const h1 = await holder(16);
    const h2 = await holder(16);
    h2.region.reverse();
    const r = await requester();
    const other = await requester('other');
    const dests = Array.from({ length: 4 }, (_, i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    for (const h of [h1, h1, h2, h1]) {
      r.dst.fill(0);
      await using fetch = await r.client.fetch(r.engine, h.address, ids(4), dests, { timeoutMs: 10_000 });
      expect(fetch.report.bytes).toBe(4 * BLOCK);
      for (let i = 0; i < 4; i++) expect(Buffer.compare(r.dst.subarray(i * BLOCK, (i + 1) * BLOCK), slotOf(h.region, i, 16))).toBe(0);
    }
    // The destinations are registrations of r's engine: another engine refuses them, the lease is released.
    await expect(other.client.fetch(other.engine, h1.address, ids(4), dests, { timeoutMs: 10_000 })).rejects.toBeInstanceOf(InvalidInputError);
    for (const h of [h1, h2]) {
      await waitFor(() => h.server.counters().active === 0, 'leases released');
      balanced(h);
    }
    await Promise.all([r.close(), other.close()]);
    await Promise.all([h1.close(), h2.close()]);
  });

  it('one destinations array reused across fetches (its entries changed in between) and by two fetches at once: every block lands where its destination says now', async () => {
    const h = await holder(64);
    const r = await requester();
    const dests = Array.from({ length: 8 }, (_, i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    const check = (blockIds: number[], at: (k: number) => number): void => {
      for (const [k, b] of blockIds.entries()) expect(Buffer.compare(r.dst.subarray(at(k), at(k) + BLOCK), slotOf(h.region, b, 64))).toBe(0);
    };
    const some = (from: number): number[] => Array.from({ length: 8 }, (_, k) => from + 3 * k);
    for (const [round, from] of [0, 1, 2].entries()) {
      r.dst.fill(0);
      const chosen = some(from);
      await using fetch = await r.client.fetch(r.engine, h.address, chosen.map((b) => `block:kv:${b}`), dests, { timeoutMs: 10_000 });
      expect(fetch.report.requests).toBe(8);
      check(chosen, (k) => (round * 8 + k) * BLOCK);
      // The caller moves its destinations: the next fetch must follow them.
      for (const [k, d] of dests.entries()) d.offset = ((round + 1) * 8 + k) * BLOCK;
    }
    // Two fetches at once through the same array (the same blocks, so the same bytes land twice).
    const shared = dests.slice(0, 4).map((d, k) => ({ ...d, offset: k * BLOCK }));
    const four = some(40).slice(0, 4);
    r.dst.fill(0);
    const [a, b] = await Promise.all([0, 1].map(() => r.client.fetch(r.engine, h.address, four.map((x) => `block:kv:${x}`), shared, { timeoutMs: 10_000 })));
    expect(a?.lease.sessionId).not.toBe(b?.lease.sessionId);
    check(four, (k) => k * BLOCK);
    await Promise.all([a?.release(), b?.release()]);
    await allReleased(h, 5);
    await r.close();
    await h.close();
  });

  it('a grant is usable only under its live lease: after release, another requester holding its descriptor is refused', async () => {
    const h = await holder(16);
    const r = await requester('r1');
    const thief = await requester('r2');
    const fetch = await r.client.fetch(r.engine, h.address, ids(4), ids(4).map((_, i) => ({ local: r.local, offset: i * BLOCK })), { timeoutMs: 10_000 });
    const { endpoint, grant } = decodeFetchDescriptor(fetch.lease.leaseDescriptors[0] as Uint8Array);
    // While the lease is live, its descriptor reads exactly its ranges and no byte outside them.
    await thief.engine.read(endpoint, [{ local: thief.local, remote: grant, range: 2, length: BLOCK }]);
    await expect(thief.engine.read(endpoint, [{ local: thief.local, remote: grant, range: 2, remoteOffset: 1, length: BLOCK }])).rejects.toBeInstanceOf(InvalidInputError);
    await fetch.release();
    await waitFor(() => h.grants.counters().live === 0, 'grant revoked');
    await h.grants.settled();
    await expect(thief.engine.read(endpoint, [{ local: thief.local, remote: grant, range: 2, length: BLOCK }])).rejects.toBeInstanceOf(RemoteRejectedError);
    balanced(h);
    await thief.close();
    await r.close();
    await h.close();
  });

  it('a length the caller does not expect fails the fetch and releases the lease; unknown blocks are NOT_FOUND before anything is granted', async () => {
    const h = await holder(8);
    const r = await requester();
    const err = await r.client
      .fetch(r.engine, h.address, ids(2), [{ local: r.local, length: BLOCK }, { local: r.local, offset: BLOCK, length: BLOCK + 1 }], { timeoutMs: 10_000 })
      .catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidInputError);
    // Released before the error reached us (not later by the client's finalizer backstop).
    expect(h.server.counters()).toMatchObject({ acquired: 1, released: 1, active: 0 });
    expect(r.client.counters()).toMatchObject({ released: 1, dropped: 0, active: 0 });
    await h.grants.settled();
    expect(h.grants.counters()).toMatchObject({ issued: 1, revoked: 1, live: 0 });
    await expect(r.client.fetch(r.engine, h.address, ['block:kv:99'], [{ local: r.local }], { timeoutMs: 10_000 })).rejects.toMatchObject({ remoteCode: 'NOT_FOUND' });
    await expect(r.client.fetch(r.engine, h.address, ids(2), [{ local: r.local }], { timeoutMs: 10_000 })).rejects.toBeInstanceOf(InvalidInputError);
    expect(h.grants.counters().issued).toBe(1);
    balanced(h);
    await r.close();
    await h.close();
  });

  it('a destination that is not a registration fails the fetch with InvalidInputError naming it, and releases the lease; the destinations array serves the next fetch', async () => {
    const h = await holder(8);
    const r = await requester();
    const destinations: { local: Registration; offset: number; length: number }[] = ids(3).map((_, i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    const good = destinations[1] as { local: Registration; offset: number; length: number };
    destinations[1] = { ...good, local: {} as Registration };
    const err = await r.client.fetch(r.engine, h.address, ids(3), destinations, { timeoutMs: 10_000 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidInputError);
    expect((err as InvalidInputError).details).toMatchObject({ field: 'destinations', request: 1 });
    // Checked while the acquire was out: the lease was taken, and released before the error came back.
    expect(h.server.counters()).toMatchObject({ acquired: 1, released: 1, active: 0 });
    destinations[1] = good;
    r.dst.fill(0);
    {
      await using fetch = await r.client.fetch(r.engine, h.address, ids(3), destinations, { timeoutMs: 10_000 });
      expect(fetch.report.bytes).toBe(3 * BLOCK);
    }
    for (let i = 0; i < 3; i++) expect(Buffer.compare(r.dst.subarray(i * BLOCK, (i + 1) * BLOCK), slotOf(h.region, i, 8))).toBe(0);
    await allReleased(h, 2);
    await r.close();
    await h.close();
  });

  it("a read that stalls stops for the caller's signal (AbortedError) and for client.close() (ClosedError); each lease is released", async () => {
    const h = await relayedHolder(8);
    const r = await requester();
    const blocks = { owner: 'arena', numbers: Uint32Array.of(1, 2) };
    const destinations = [0, 1].map((i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    h.relay.stall();
    // Reading: the lease is in the client's hands, and the read's connection waits in the relay.
    const reading = (): Promise<void> => waitFor(() => r.client.counters().active === 1 && h.relay.connections > 0, 'the read under way');
    const ac = new AbortController();
    const aborted = r.client.fetch(r.engine, h.address, blocks, destinations, { timeoutMs: 30_000, signal: ac.signal }).catch((e: unknown) => e);
    await reading();
    ac.abort();
    expect(await aborted).toBeInstanceOf(AbortedError);
    await waitFor(() => h.server.counters().active === 0 && r.client.counters().active === 0, 'the aborted fetch released its lease');
    const closed = r.client.fetch(r.engine, h.address, blocks, destinations, { timeoutMs: 30_000 }).catch((e: unknown) => e);
    await reading();
    await r.client.close();
    expect(await closed).toBeInstanceOf(ClosedError);
    expect(h.server.counters()).toMatchObject({ acquired: 2, released: 2, active: 0 });
    h.relay.resume();
    await h.grants.settled();
    expect(h.grants.counters()).toMatchObject({ issued: 2, revoked: 2, live: 0 });
    await r.close();
    await h.close();
  });

  it('one long-lived signal passed to many fetches is left as it was: no listener and no composite stays on it', async () => {
    const h = await holder(8);
    const r = await requester();
    const shutdown = new AbortController();
    const destinations = ids(2).map((_, i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    for (let i = 0; i < 30; i++) {
      const fetch = await r.client.fetch(r.engine, h.address, ids(2), destinations, { timeoutMs: 10_000, signal: shutdown.signal });
      await fetch.release();
    }
    // The lease's signal joined the caller's for each read; an AbortSignal.any composite would
    // stay listed on the long-lived signal (30 entries on Node 20), a listener left would leak too.
    expect(getEventListeners(shutdown.signal, 'abort')).toHaveLength(0);
    expect(dependants(shutdown.signal) ?? 0).toBe(0);
    expect(h.server.counters()).toMatchObject({ acquired: 30, released: 30, active: 0 });
    await r.close();
    await h.close();
  });

  it('the lease expires (GC): its grant is revoked and a late read is refused', async () => {
    const h = await holder(8, 400);
    const r = await requester();
    const fetch = await r.client.fetch(r.engine, h.address, ids(3), ids(3).map((_, i) => ({ local: r.local, offset: i * BLOCK })), { timeoutMs: 10_000, leaseMs: 400 });
    const { endpoint, grant } = decodeFetchDescriptor(fetch.lease.leaseDescriptors[0] as Uint8Array);
    await waitFor(() => h.server.counters().expired === 1, 'lease expired');
    await h.grants.settled();
    expect(h.grants.counters()).toMatchObject({ issued: 1, revoked: 1, live: 0 });
    await expect(r.engine.read(endpoint, [{ local: r.local, remote: grant, range: 0, length: BLOCK }])).rejects.toBeInstanceOf(RemoteRejectedError);
    await fetch.release();
    balanced(h);
    await r.close();
    await h.close();
  });

  it('a lease that ends while its grant is being made never leaves the grant live', async () => {
    const engine = new TransferEngine({ nodeId: 'h2', transports: [new TcpTransport()], logger: silentLogger });
    const registration = await engine.register({ kind: 'host', buffer: new Uint8Array(BLOCK) });
    const grants = engineGrants({ engine, blocks: () => ({ registration, offset: 0, length: BLOCK }) });
    const lease = { sessionId: 'session:h2:abc', requesterId: 'r', blockIds: ['block:kv:0'] } as unknown as Parameters<EngineGrants['resolve']>[1];
    const pending = grants.resolve(['block:kv:0'], lease);
    grants.revoke(lease, 'released');
    await expect(pending).rejects.toMatchObject({ status: 'ABORTED' });
    await grants.settled();
    expect(grants.counters()).toMatchObject({ issued: 1, revoked: 1, live: 0 });
    expect(engine.liveGrants).toBe(0);
    await engine.close();
  });

  it("a lease that ended before engineGrants was asked (a holder's resolver that awaited first) gets no grant; one that ends while it is made has its grant revoked", async () => {
    const engine = new TransferEngine({ nodeId: 'h3', transports: [new TcpTransport()], logger: silentLogger });
    const registration = await engine.register({ kind: 'host', buffer: new Uint8Array(BLOCK) });
    const grants = engineGrants({ engine, blocks: () => ({ registration, offset: 0, length: BLOCK }) });
    type Lease = Parameters<EngineGrants['resolve']>[1];
    // What the lease table does when a lease ends: `live` turns false, then the revoke hook runs,
    // here before the grant was asked for, so engineGrants has nothing of the lease yet.
    const early = { sessionId: 'session:h3:early', requesterId: 'r', blockIds: ['block:kv:0'], live: true } as unknown as Lease & { live: boolean };
    early.live = false;
    grants.revoke(early, 'released');
    await expect(grants.resolve(['block:kv:0'], early)).rejects.toMatchObject({ status: 'ABORTED' });
    expect(grants.counters()).toMatchObject({ issued: 0, live: 0 });
    // Ended while the grant is being made, its revoke hook gone by before (not pending there).
    const during = { sessionId: 'session:h3:during', requesterId: 'r', blockIds: ['block:kv:0'], live: true } as unknown as Lease & { live: boolean };
    const pending = grants.resolve(['block:kv:0'], during);
    during.live = false;
    await expect(pending).rejects.toMatchObject({ status: 'ABORTED' });
    await grants.settled();
    expect(grants.counters()).toMatchObject({ issued: 1, revoked: 1, live: 0 });
    expect(engine.liveGrants).toBe(0);
    await engine.close();
  });
});

/** A TCP relay to `target` that can hold back what the far side sends (the holder's answers) and let it through later. */
async function relay(target: string): Promise<{ address: string; hold(on: boolean): void; close(): Promise<void> }> {
  const [host, port] = [target.slice(0, target.lastIndexOf(':')), Number(target.slice(target.lastIndexOf(':') + 1))];
  const sockets = new Set<net.Socket>();
  const held: { to: net.Socket; data: Buffer }[] = [];
  let holding = false;
  const server = net.createServer((client) => {
    const up = net.connect(port, host);
    for (const s of [client, up]) {
      sockets.add(s);
      s.on('error', () => undefined);
      s.on('close', () => (s === client ? up : client).destroy());
    }
    client.on('data', (d: Buffer) => up.write(d));
    up.on('data', (d: Buffer) => (holding ? held.push({ to: client, data: d }) : client.write(d)));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    address: `127.0.0.1:${(server.address() as net.AddressInfo).port}`,
    hold(on: boolean) {
      holding = on;
      if (!on) for (const h of held.splice(0)) h.to.write(h.data);
    },
    async close() {
      for (const s of sockets) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

const sleep = (ms: number): Promise<'waited'> => new Promise((r) => setTimeout(() => r('waited'), ms));

describe('fetchLease: read a lease already held (pipelined fetches)', () => {
  it('a pipeline of fetches: each lease acquired during the previous read, read by fetchLease; bytes verified, every lease released and its grant revoked exactly once', async () => {
    const h = await holder(64);
    const r = await requester();
    const batches = [0, 1, 2, 3, 4].map((k) => Uint32Array.from({ length: 16 }, (_, i) => (k * 16 + i * 3) % 64));
    const destinations = Array.from({ length: 16 }, (_, i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    let next = r.client.acquire(h.address, { owner: 'arena', numbers: batches[0]! }, { timeoutMs: 10_000 });
    for (let k = 0; k < batches.length; k++) {
      const lease = await next;
      if (k + 1 < batches.length) {
        next = r.client.acquire(h.address, { owner: 'arena', numbers: batches[k + 1]! }, { timeoutMs: 10_000 });
        next.catch(() => undefined);
      }
      r.dst.fill(0);
      const fetch = await r.client.fetchLease(r.engine, lease, destinations);
      expect(fetch.lease).toBe(lease);
      expect(fetch.report.bytes).toBe(16 * BLOCK);
      // Numbered block n lives at slot n of the region.
      for (let i = 0; i < 16; i++) {
        const n = batches[k]![i]!;
        expect(Buffer.compare(r.dst.subarray(i * BLOCK, (i + 1) * BLOCK), h.region.subarray(n * BLOCK, (n + 1) * BLOCK))).toBe(0);
      }
      await fetch[Symbol.asyncDispose]();
      expect((await fetch.release()).confirmed).toBe(true);
    }
    await allReleased(h, 5);
    expect(h.server.counters()).toMatchObject({ acquired: 5, released: 5, active: 0 });
    expect(r.client.counters()).toMatchObject({ acquired: 5, released: 5, active: 0 });
    await r.close();
    await h.close();
  });

  it('lets an acquire in flight out before it reads (one turn of the event loop), and adds no turn when none is in flight', async () => {
    const h = await holder(8);
    const r = await requester();
    const destinations = [{ local: r.local, length: BLOCK }];
    const read = r.engine.read.bind(r.engine);
    let turned = false;
    const seen: boolean[] = [];
    r.engine.read = (...a: Parameters<TransferEngine['read']>) => {
      seen.push(turned);
      return read(...a);
    };
    // No acquire in flight: the read starts in the same turn.
    const first = await r.client.acquire(h.address, ['block:kv:0'], { timeoutMs: 10_000 });
    turned = false;
    setImmediate(() => (turned = true));
    const f1 = await r.client.fetchLease(r.engine, first, destinations);
    // The next lease's acquire in flight: the read waits one turn, so its request leaves first.
    const second = await r.client.acquire(h.address, ['block:kv:1'], { timeoutMs: 10_000 });
    const third = r.client.acquire(h.address, ['block:kv:2'], { timeoutMs: 10_000 });
    turned = false;
    setImmediate(() => (turned = true));
    const f2 = await r.client.fetchLease(r.engine, second, destinations);
    expect(seen).toEqual([false, true]);
    for (const g of [f1, f2, await third]) await g.release();
    await waitFor(() => h.server.counters().active === 0, 'leases released');
    balanced(h);
    await r.close();
    await h.close();
  });

  it("refuses another client's lease and a released one, leaving them as they are; bad destinations release the lease (it is the fetch's from then on)", async () => {
    const h = await holder(8);
    const r = await requester();
    const other = await requester('other');
    const destinations = [{ local: r.local, length: BLOCK }];
    const foreign = await other.client.acquire(h.address, ['block:kv:0'], { timeoutMs: 10_000 });
    await expect(r.client.fetchLease(r.engine, foreign, destinations)).rejects.toBeInstanceOf(InvalidInputError);
    expect(foreign.released).toBe(false);
    expect(h.server.counters().active).toBe(1);
    await expect(r.client.fetchLease(r.engine, {} as never, destinations)).rejects.toBeInstanceOf(InvalidInputError);
    const mine = await r.client.acquire(h.address, ['block:kv:1'], { timeoutMs: 10_000 });
    await mine.release();
    await expect(r.client.fetchLease(r.engine, mine, destinations)).rejects.toThrow(/was released/);
    // Two blocks, one destination: refused, and the lease released before the error came back.
    const two = await r.client.acquire(h.address, ids(2), { timeoutMs: 10_000 });
    await expect(r.client.fetchLease(r.engine, two, destinations)).rejects.toBeInstanceOf(InvalidInputError);
    expect(two.released).toBe(true);
    expect(h.server.counters()).toMatchObject({ acquired: 3, released: 2, active: 1 });
    await foreign.release();
    await h.grants.settled();
    expect(h.grants.counters()).toMatchObject({ issued: 3, revoked: 3, live: 0 });
    balanced(h);
    await other.close();
    await r.close();
    await h.close();
  });
});

describe('fetch: release never blocks', () => {
  it("disposal queues the release and returns while the holder's answer is held back; the release reaches the holder once and is confirmed later; close() waits for it", async () => {
    const h = await holder(16);
    const rl = await relay(h.address);
    // Through the relay only: a local lane would go around it.
    const r = await requester('req', false);
    const dests = ids(4).map((_, i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    const fetch = await r.client.fetch(r.engine, rl.address, ids(4), dests, { timeoutMs: 10_000 });
    rl.hold(true);
    // The holder cannot answer now: a disposal that waited for it would still be waiting.
    expect(await Promise.race([fetch[Symbol.asyncDispose]().then(() => 'returned' as const), sleep(3000)])).toBe('returned');
    expect(fetch.lease.released).toBe(true);
    expect(fetch.lease.signal.reason).toBeInstanceOf(AbortedError);
    // The lease's end reason is made without a stack, and stack capture is back on after it.
    expect(new Error('after the release').stack?.split('\n').length).toBeGreaterThan(1);
    // The release itself went out: the holder ended the lease and revoked its grant.
    await waitFor(() => h.server.counters().released === 1, 'the release at the holder');
    expect(h.grants.counters()).toMatchObject({ issued: 1, revoked: 1, live: 0 });
    const answer = fetch.release();
    expect(fetch.release()).toBe(answer); // one release, whoever asks
    expect(await Promise.race([answer.then(() => 'answered' as const), sleep(200)])).toBe('waited');
    rl.hold(false);
    expect(await answer).toMatchObject({ confirmed: true, blocksReleased: 4 });

    // close() waits for a release whose answer is still held back.
    const second = await r.client.fetch(r.engine, rl.address, ids(4), dests, { timeoutMs: 10_000 });
    rl.hold(true);
    await second[Symbol.asyncDispose]();
    let closed = false;
    const closing = r.client.close().then(() => (closed = true));
    await waitFor(() => h.server.counters().released === 2, 'the second release at the holder');
    await sleep(100);
    expect(closed).toBe(false);
    rl.hold(false);
    await closing;
    expect(await second.release()).toMatchObject({ confirmed: true, blocksReleased: 4 });
    expect(r.client.counters()).toMatchObject({ acquired: 2, released: 2, releaseFailures: 0, active: 0 });
    expect(h.server.counters()).toMatchObject({ acquired: 2, released: 2, expired: 0, active: 0 });
    balanced(h);
    await r.close();
    await rl.close();
    await h.close();
  });
});

describe('fetch: the next Acquire before the last Release', () => {
  it('a fetch disposed and the next one started in the same turn: the holder grants the next lease before it revokes the last', async () => {
    const engine = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
    const region = new Uint8Array(16 * BLOCK);
    const registration = await engine.register({ kind: 'host', buffer: region });
    const grants = engineGrants({ engine, spaces: { arena: { registration, blockBytes: BLOCK } } });
    const seen: string[] = [];
    const { resolveLease, revoke, ...rest } = grants.lockServerOptions;
    const server = new LockServer({
      holderId: 'holder',
      lockTimeoutMs: 30_000,
      ...rest,
      resolveLease: (lease) => {
        seen.push(`grant ${lease.sessionId}`);
        return resolveLease(lease);
      },
      revoke: (lease, reason) => {
        seen.push(`revoke ${lease.sessionId}`);
        revoke(lease, reason);
      },
      logger: silentLogger,
    });
    const address = `127.0.0.1:${await server.listen('127.0.0.1:0')}`;
    const r = await requester();
    const numbers = Uint32Array.of(1, 2, 3);
    const dests = [0, 1, 2].map((i) => ({ local: r.local, offset: i * BLOCK, length: BLOCK }));
    const first = await r.client.fetch(r.engine, address, { owner: 'arena', numbers }, dests, { timeoutMs: 10_000 });
    // What a fetch loop does: dispose, then the next fetch, in one turn of the event loop.
    await first[Symbol.asyncDispose]();
    const second = await r.client.fetch(r.engine, address, { owner: 'arena', numbers }, dests, { timeoutMs: 10_000 });
    await first.release();
    await second.release();
    const [a, b] = [first.lease.sessionId, second.lease.sessionId];
    expect(seen).toEqual([`grant ${a}`, `grant ${b}`, `revoke ${a}`, `revoke ${b}`]);
    await r.close();
    await server.close({ graceMs: 0 });
    await grants.settled();
    await engine.close();
  });
});

describe('fetch across processes', () => {
  killChildrenAfterEach();

  it.each(['by id', 'by number'])('requesters SIGKILLed mid-fetch (blocks %s): the GC expires their leases and revokes each grant exactly once; counters balance; nothing stays pinned', async (form) => {
    // Leases of 3 s: long enough for a fetch on a loaded machine, short enough for the GC to
    // expire the killed requesters' leases within the test.
    const h = await holder(256, 3000);
    const kids = [0, 1, 2].map(() => forkFixture('fetcher.mjs', [h.address, '256', String(BLOCK), form === 'by number' ? 'numbered' : 'ids']));
    // Each child reports once it holds its lease; one that dies first fails the test at once.
    await Promise.all(
      kids.map((c) =>
        Promise.race([
          once(c, 'message'),
          once(c, 'exit').then(([code, signal]) => {
            throw new Error(`fetcher ${c.pid} exited (${String(code ?? signal)}) before it held its lease`);
          }),
        ]),
      ),
    );
    expect(h.server.counters().active).toBe(3);
    for (const c of kids) {
      const exited = once(c, 'exit');
      c.kill('SIGKILL');
      await exited;
    }
    await waitFor(() => h.server.counters().active === 0, 'every lease released or expired');
    await h.grants.settled();
    const g = h.grants.counters();
    const c = h.server.counters();
    expect(g.live).toBe(0);
    expect(g.issued).toBe(g.revoked);
    expect(g.issued).toBe(18);
    expect(c.acquired).toBe(18);
    expect(c.released).toBe(15);
    expect(c.expired).toBe(3);
    expect(c.pinnedBlocks).toBe(0);
    expect(c.blocksAcquired).toBe(c.blocksReleased + c.blocksExpired);
    expect(h.server.table.pinCount(form === 'by number' ? 'block:arena:7' : 'block:kv:7')).toBe(0);
    expect(h.engine.liveGrants).toBe(0);
    await h.close();
  });
});
