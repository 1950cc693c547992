/**
 * Records only their owner can write, against a real etcd, with a direct etcd writer in a
 * child process: a copy of the live incarnation under the writer's own lease, an unleased
 * overwrite, and owners that crash, close and restart (also child processes).
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Etcd3 } from 'etcd3';
import { RemoteRejectedError, encodeEndpoint, type DiscoveryEvent, type NodeRecord } from '@tensorwire/core';
import { EtcdDiscovery } from '../src/index.js';
import { Child } from './helpers/child.js';
import { TestEtcd, etcdMissing } from './helpers/etcd.js';

const missing = etcdMissing();
if (missing) console.warn(`[discovery-etcd] skipping ownership tests: ${missing}`);

const FORGED_LOCK = '10.6.6.6:6666';
const FORGED_BLOCK = 'block:kv:666';

function record(nodeId: string, incarnation: string, extra: Partial<NodeRecord> = {}): NodeRecord {
  const endpoint = encodeEndpoint({ identity: { nodeId, incarnation, hostId: 'h1' }, transports: new Map([['tcp', new Uint8Array([1, 2, 3, 4])]]) });
  return { nodeId, incarnation, hostId: 'h1', endpoint, ...extra };
}

/** Every record a watcher ever served, from its events and its current cache. */
function servedLog(d: EtcdDiscovery): () => NodeRecord[] {
  const seen: NodeRecord[] = [];
  d.on((e: DiscoveryEvent) => {
    if (e.type !== 'removed') seen.push(e.record);
  });
  return () => [...seen];
}

function forged(r: NodeRecord): boolean {
  return r.lockAddress === FORGED_LOCK || r.blockIds?.includes(FORGED_BLOCK) === true;
}

async function waitUntil(cond: () => boolean | Promise<boolean>, timeoutMs = 15_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error('condition not reached');
    await new Promise((r) => setTimeout(r, 50));
  }
}

let counter = 0;

describe.skipIf(missing !== undefined)('etcd records only their owner can write', () => {
  let etcd: TestEtcd;
  let raw: Etcd3;
  const closers: (() => Promise<unknown>)[] = [];
  let prefix = '';

  beforeAll(async () => {
    etcd = new TestEtcd();
    await etcd.start();
    raw = new Etcd3({ hosts: `http://127.0.0.1:${etcd.port}` });
  });
  afterAll(async () => {
    raw?.close();
    await etcd?.destroy();
  });
  afterEach(async () => {
    for (const c of closers.splice(0).reverse()) await c().catch(() => undefined);
  });

  function nextPrefix(): void {
    prefix = `/tw-own-${process.pid}-${++counter}/`;
  }
  async function open(extra: { ttlSeconds?: number; onRejected?: (r: { reason: string }) => void } = {}): Promise<EtcdDiscovery> {
    const d = await EtcdDiscovery.open({ url: etcd.url(), prefix, ttlSeconds: extra.ttlSeconds ?? 2, callTimeoutMs: 1000, maxBackoffMs: 300, ...(extra.onRejected ? { onRejected: extra.onRejected } : {}) });
    closers.push(() => d.close());
    return d;
  }
  function writer(nodeId: string, mode: 'copy' | 'unleased'): Child {
    const c = new Child('etcd-writer.mjs', { host: `http://127.0.0.1:${etcd.port}`, prefix, nodeId, mode, lockAddress: FORGED_LOCK, extraBlock: FORGED_BLOCK });
    closers.push(() => c.kill());
    return c;
  }
  function owner(nodeId: string, incarnation: string, ttlSeconds: number, publishTimeoutMs = 10_000): Child {
    const c = new Child('owner.mjs', { url: etcd.url(), prefix, nodeId, incarnation, ttlSeconds, publishTimeoutMs, lockAddress: '127.0.0.1:7070', blockIds: ['block:kv:1'] });
    closers.push(() => c.kill());
    return c;
  }
  async function recordKey(nodeId: string): Promise<{ lease: string; value: NodeRecord & { lockAddress?: string } } | undefined> {
    const r = await raw.getAll().prefix(`${prefix}nodes/${nodeId}`).exec();
    const kv = r.kvs.find((x) => x.key.toString() === `${prefix}nodes/${nodeId}`);
    return kv ? { lease: kv.lease, value: JSON.parse(kv.value.toString()) as NodeRecord } : undefined;
  }
  async function leaseAlive(id: string): Promise<boolean> {
    return Number((await raw.leaseClient.leaseTimeToLive({ ID: id, keys: false })).TTL) > 0;
  }

  it('a copy of the live incarnation under the writer\'s own lease is never served, and the owner puts its record back', async () => {
    nextPrefix();
    const rejected: string[] = [];
    const requester = await open({ onRejected: (r) => rejected.push(r.reason) });
    const seenByRequester = servedLog(requester);
    const holder = await open({ ttlSeconds: 10 });
    await holder.publish(record('node-f', 'live', { lockAddress: '127.0.0.1:7070', blockIds: ['block:kv:1'] }));
    await requester.waitFor('node-f', { timeoutMs: 10_000 });
    const ownerLease = (await recordKey('node-f'))?.lease as string;

    const w = writer('node-f', 'copy');
    const first = await w.next('wrote');
    expect(first['incarnation']).toBe('live'); // the writer copied the live incarnation
    expect(first['lease']).not.toBe(ownerLease);
    // A watcher that starts while the forged copy may still be in etcd never serves it either.
    const late = await open();
    const seenByLate = servedLog(late);
    await waitUntil(() => holder.stats().restores >= 1);
    await waitUntil(async () => (await recordKey('node-f'))?.value.lockAddress === '127.0.0.1:7070');
    expect((await recordKey('node-f'))?.lease).toBe(ownerLease);

    // Again: every foreign write is undone.
    w.send('write');
    await w.next('wrote', 20_000, w.messages.indexOf(first) + 1);
    await waitUntil(() => holder.stats().restores >= 2);
    await waitUntil(async () => (await recordKey('node-f'))?.value.lockAddress === '127.0.0.1:7070');
    await waitUntil(() => late.peek('node-f')?.lockAddress === '127.0.0.1:7070');
    const fresh = await open();
    const seenByFresh = servedLog(fresh);

    for (const d of [requester, late, fresh]) {
      expect(d.peek('node-f')?.lockAddress).toBe('127.0.0.1:7070');
      expect(d.peek('node-f')?.blockIds).toEqual(['block:kv:1']);
      expect(await d.holdersOf(FORGED_BLOCK)).toEqual([]);
    }
    for (const seen of [seenByRequester(), seenByLate(), seenByFresh()]) expect(seen.filter(forged)).toEqual([]);
    expect(seenByRequester().length).toBeGreaterThanOrEqual(1);
    expect(rejected).toContain('conflicting-claim');
    expect(requester.stats().rejected['conflicting-claim']).toBeGreaterThanOrEqual(1);
    expect(holder.stats().published).toBe(true);
    expect(holder.stats().leasesGranted).toBe(1);
    w.send('exit');
    await w.next('exited');
  });

  it('an unleased overwrite does not outlive its crashed owner and does not block the restart', async () => {
    nextPrefix();
    const rejected: string[] = [];
    const requester = await open({ onRejected: (r) => rejected.push(r.reason) });
    const seen = servedLog(requester);
    const removed: string[] = [];
    requester.on((e) => {
      if (e.type === 'removed') removed.push(e.reason);
    });
    const first = owner('node-u', 'first', 3);
    expect((await first.next('published'))['published']).toBe(true);
    await requester.waitFor('node-u', { timeoutMs: 10_000 });
    await first.kill(); // a crash: nobody keeps its lease alive or restores its record
    const w = writer('node-u', 'unleased');
    await w.next('wrote');
    await waitUntil(() => rejected.includes('unleased'));
    // etcd still holds the garbage, attached to no lease: it will never lapse by itself...
    expect((await recordKey('node-u'))?.lease).toBe('0');
    // ...but once the owner's lease is gone, no watcher lists it.
    await waitUntil(() => requester.peek('node-u') === undefined);
    expect(removed).toEqual(['lease-expired']);
    const fresh = await open();
    expect(fresh.peek('node-u')).toBeUndefined();
    expect((await recordKey('node-u'))?.lease).toBe('0');

    // The restarted owner is not held off by the garbage (no NODE_ID_HELD).
    const second = owner('node-u', 'second', 3, 5000);
    const published = await second.next('published');
    expect(published).toMatchObject({ published: true });
    await requester.waitFor('node-u', { timeoutMs: 10_000, until: (r) => r.incarnation === 'second' });
    expect(await leaseAlive((await recordKey('node-u'))?.lease as string)).toBe(true);
    second.send('close');
    await second.next('closed');
    await waitUntil(() => requester.peek('node-u') === undefined && fresh.peek('node-u') === undefined);
    expect((await raw.getAll().prefix(prefix).keys()).length).toBe(0);
    expect(seen().filter(forged)).toEqual([]);
  });

  it('a copy under a live foreign lease is dropped with its crashed owner and does not block the restart', async () => {
    nextPrefix();
    const requester = await open();
    const seen = servedLog(requester);
    const first = owner('node-c', 'first', 3);
    expect((await first.next('published'))['published']).toBe(true);
    await requester.waitFor('node-c', { timeoutMs: 10_000 });
    await first.kill();
    const w = writer('node-c', 'copy');
    const wrote = await w.next('wrote');
    // The owner's lease lapses; the forged copy's lease lives on (the writer keeps it alive).
    await waitUntil(() => requester.peek('node-c') === undefined);
    const left = await recordKey('node-c');
    expect(left?.lease).toBe(wrote['lease']);
    expect(await leaseAlive(left?.lease as string)).toBe(true);
    expect(left?.value.lockAddress).toBe(FORGED_LOCK);
    const fresh = await open();
    expect(fresh.peek('node-c')).toBeUndefined();

    const second = owner('node-c', 'second', 3, 5000);
    expect(await second.next('published')).toMatchObject({ published: true });
    await requester.waitFor('node-c', { timeoutMs: 10_000, until: (r) => r.incarnation === 'second' });
    await fresh.waitFor('node-c', { timeoutMs: 10_000, until: (r) => r.incarnation === 'second' });
    expect(await leaseAlive(wrote['lease'] as string)).toBe(true); // published while the writer's lease still lives
    expect(requester.peek('node-c')?.lockAddress).toBe('127.0.0.1:7070');
    expect(seen().filter(forged)).toEqual([]);
    second.send('close');
    await second.next('closed');
    w.send('exit');
    await w.next('exited');
  });

  it('a live owner still blocks a new incarnation, even while garbage sits in its record key', async () => {
    nextPrefix();
    const live = await open({ ttlSeconds: 10 });
    await live.publish(record('node-l', 'alive'));
    await raw.put(`${prefix}nodes/node-l`).value('{garbage'); // unleased, malformed
    const usurper = await open();
    const err = await usurper.publish(record('node-l', 'usurper'), { timeoutMs: 1500 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('NODE_ID_HELD');
    await waitUntil(() => live.stats().restores >= 1);
    await waitUntil(() => usurper.peek('node-l')?.incarnation === 'alive');
  });

  it('a write to the owner anchor is not accepted as a new owner: the owner re-creates its keys', async () => {
    nextPrefix();
    const requester = await open();
    const seen = servedLog(requester);
    const holder = await open({ ttlSeconds: 10 });
    await holder.publish(record('node-h', 'i1', { lockAddress: '127.0.0.1:7070' }));
    await requester.waitFor('node-h', { timeoutMs: 10_000 });
    const w = writer('node-h', 'copy'); // a foreign record under the writer's lease...
    const wrote = await w.next('wrote');
    await raw.put(`${prefix}owners/node-h`).value(String(wrote['lease'])).lease(String(wrote['lease'])); // ...and an anchor naming it
    await waitUntil(() => holder.stats().restores >= 1);
    const fresh = await open();
    await fresh.waitFor('node-h', { timeoutMs: 10_000, until: (r) => r.lockAddress === '127.0.0.1:7070' });
    await waitUntil(async () => (await recordKey('node-h'))?.value.lockAddress === '127.0.0.1:7070');
    const anchor = (await raw.getAll().prefix(`${prefix}owners/node-h`).exec()).kvs[0];
    const node = (await raw.getAll().prefix(`${prefix}nodes/node-h`).exec()).kvs[0];
    expect(anchor?.mod_revision).toBe(node?.create_revision); // a fresh key life, proven by a fresh anchor
    expect(anchor?.lease).toBe(node?.lease);
    expect(anchor?.lease).not.toBe(wrote['lease']);
    await waitUntil(() => requester.peek('node-h')?.lockAddress === '127.0.0.1:7070');
    expect(seen().filter(forged)).toEqual([]);
    w.send('exit');
    await w.next('exited');
  });

  it('close removes both keys even with a foreign value in the record key', async () => {
    nextPrefix();
    const requester = await open();
    const holder = await open({ ttlSeconds: 10 });
    await holder.publish(record('node-g', 'i1', { lockAddress: '127.0.0.1:7070' }));
    await requester.waitFor('node-g', { timeoutMs: 10_000 });
    // Written in this process and closed at once, so the owner has had no time to put its record back.
    await raw.put(`${prefix}nodes/node-g`).value('{garbage');
    await holder.close();
    await waitUntil(() => requester.peek('node-g') === undefined);
    expect((await raw.getAll().prefix(prefix).keys()).length).toBe(0);
  });
});
