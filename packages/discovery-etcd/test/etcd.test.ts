/**
 * EtcdDiscovery against a real etcd on loopback: publishing, watching, lease expiry, the
 * conflict rule, malformed values, and an etcd outage with resynchronisation.
 */
import net from 'node:net';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Etcd3 } from 'etcd3';
import {
  BackendUnavailableError,
  ClosedError,
  RemoteRejectedError,
  StaticDiscovery,
  TimedOutError,
  encodeEndpoint,
  encodeNodeRecord,
  type DiscoveryEvent,
  type NodeRecord,
} from '@tensorwire/core';
import { EtcdDiscovery, parseEtcdUrl } from '../src/index.js';
import { TestEtcd, etcdMissing, writeOwnedRecord } from './helpers/etcd.js';

const missing = etcdMissing();
if (missing) console.warn(`[discovery-etcd] skipping real-etcd tests: ${missing}`);

function record(nodeId: string, incarnation: string, extra: Partial<NodeRecord> = {}): NodeRecord {
  const endpoint = encodeEndpoint({ identity: { nodeId, incarnation, hostId: 'h1' }, transports: new Map([['tcp', new Uint8Array([1, 2, 3, 4])]]) });
  return { nodeId, incarnation, hostId: 'h1', endpoint, ...extra };
}

let prefixCounter = 0;

/** A TCP relay to 127.0.0.1:`target`: `cut()` drops every connection and refuses new ones until `restore()`. */
async function cuttableRelay(target: number): Promise<{ port: number; cut(): void; restore(): void; close(): Promise<void> }> {
  const sockets = new Set<net.Socket>();
  let blocked = false;
  const server = net.createServer((client) => {
    if (blocked) {
      client.destroy();
      return;
    }
    const up = net.connect(target, '127.0.0.1');
    sockets.add(client);
    sockets.add(up);
    client.pipe(up);
    up.pipe(client);
    const end = (): void => {
      client.destroy();
      up.destroy();
      sockets.delete(client);
      sockets.delete(up);
    };
    for (const s of [client, up]) {
      s.on('error', end);
      s.on('close', end);
    }
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const dropAll = (): void => {
    for (const s of sockets) s.destroy();
    sockets.clear();
  };
  return {
    port: (server.address() as net.AddressInfo).port,
    cut() {
      blocked = true;
      dropAll();
    },
    restore() {
      blocked = false;
    },
    close() {
      blocked = true;
      dropAll();
      return new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

describe('parseEtcdUrl', () => {
  it('accepts etcd://, http:// and bare host:port and names the store etcd://host:port', () => {
    expect(parseEtcdUrl('etcd://10.231.0.1:2379')).toEqual({ store: 'etcd://10.231.0.1:2379', host: 'http://10.231.0.1:2379', tls: false });
    expect(parseEtcdUrl('etcds://10.231.0.1:2379')).toEqual({ store: 'etcds://10.231.0.1:2379', host: 'https://10.231.0.1:2379', tls: true });
    expect(parseEtcdUrl('https://h:1').store).toBe('etcds://h:1');
    expect(parseEtcdUrl('http://localhost:1').store).toBe('etcd://localhost:1');
    expect(parseEtcdUrl('example.com:2379').store).toBe('etcd://example.com:2379');
    for (const bad of ['etcd://h', 'etcd://h:0', 'etcd://h:70000', 'ftp://h:1', '', 'h:1/x']) expect(() => parseEtcdUrl(bad)).toThrow();
  });
});

describe.skipIf(missing !== undefined)('EtcdDiscovery on a real etcd (loopback)', () => {
  let etcd: TestEtcd;
  const closers: (() => Promise<unknown>)[] = [];
  let prefix = '';

  beforeAll(async () => {
    etcd = new TestEtcd();
    await etcd.start();
  });
  afterAll(async () => {
    await etcd?.destroy();
  });
  afterEach(async () => {
    for (const c of closers.splice(0).reverse()) await c().catch(() => undefined);
    if (!etcd.running) await etcd.start();
  });

  async function open(extra: { ttlSeconds?: number } = {}): Promise<EtcdDiscovery> {
    const d = await EtcdDiscovery.open({ url: etcd.url(), prefix, ttlSeconds: extra.ttlSeconds ?? 2, callTimeoutMs: 1000, maxBackoffMs: 300 });
    closers.push(() => d.close());
    return d;
  }
  function raw(): Etcd3 {
    const c = new Etcd3({ hosts: `http://127.0.0.1:${etcd.port}` });
    closers.push(async () => c.close());
    return c;
  }
  function nextPrefix(): void {
    prefix = `/tw-test-${process.pid}-${++prefixCounter}/`;
  }

  it('publishes, looks up, finds holders and follows updates and withdrawals', async () => {
    nextPrefix();
    const holder = await open();
    const requester = await open();
    const events: DiscoveryEvent[] = [];
    requester.on((e) => events.push(e));
    await holder.publish(record('holder-a', 'i1', { lockAddress: '127.0.0.1:7070', blockIds: ['block:kv:1', 'block:kv:2'] }));
    const got = await requester.waitFor('holder-a', { timeoutMs: 10_000 });
    expect(got.lockAddress).toBe('127.0.0.1:7070');
    expect((await requester.holdersOf('block:kv:2')).map((r) => r.nodeId)).toEqual(['holder-a']);
    expect((await requester.list()).map((r) => r.nodeId)).toEqual(['holder-a']);
    expect(await requester.lookup('nobody')).toBeUndefined();

    await holder.publish(record('holder-a', 'i1', { lockAddress: '127.0.0.1:7070', blockIds: ['block:kv:3'] }));
    await requester.waitFor('holder-a', { timeoutMs: 10_000, until: (r) => r.blockIds?.includes('block:kv:3') === true });
    expect(await requester.holdersOf('block:kv:1')).toEqual([]);
    await expect(holder.publish(record('other', 'i1'))).rejects.toThrow(/cannot also publish/);
    await expect(holder.publish(record('holder-a', 'i2'))).rejects.toThrow(/new discovery/);

    await holder.close();
    await holder.close();
    await expect(holder.lookup('holder-a')).rejects.toBeInstanceOf(ClosedError);
    await waitUntil(() => requester.peek('holder-a') === undefined);
    expect(events.map((e) => e.type)).toEqual(['added', 'updated', 'removed']);
  });

  it('a node whose lease lapses disappears; a new incarnation takes the id only after that', async () => {
    nextPrefix();
    const requester = await open();
    const c = raw();
    // A "crashed" node: its record under a lease nobody keeps alive.
    const lease = c.lease(2, { autoKeepAlive: false });
    await writeOwnedRecord(c, prefix, 'holder-b', encodeNodeRecord(record('holder-b', 'old')), await lease.grant());
    await requester.waitFor('holder-b', { timeoutMs: 10_000 });

    const restarted = await open();
    const events: DiscoveryEvent[] = [];
    requester.on((e) => events.push(e));
    const published = restarted.publish(record('holder-b', 'new'), { timeoutMs: 20_000 });
    // While the old lease lives, the new incarnation's claim does not replace it.
    expect(requester.peek('holder-b')?.incarnation).toBe('old');
    await published;
    const now = await requester.waitFor('holder-b', { timeoutMs: 10_000, until: (r) => r.incarnation === 'new' });
    expect(now.incarnation).toBe('new');
    expect(events.map((e) => e.type)).toEqual(['removed', 'added']);
  });

  it('publish gives up with a typed error while another live incarnation holds the id', async () => {
    nextPrefix();
    const live = await open({ ttlSeconds: 10 });
    await live.publish(record('holder-c', 'alive'));
    const usurper = await open();
    const err = await usurper.publish(record('holder-c', 'usurper'), { timeoutMs: 1500 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).details['reason']).toBe('conflicting-claim');
    expect(usurper.peek('holder-c')?.incarnation).toBe('alive');
    // After a graceful close the id is free at once.
    await live.close();
    await usurper.publish(record('holder-c', 'usurper'), { timeoutMs: 10_000 });
    expect((await usurper.waitFor('holder-c', { timeoutMs: 5000, until: (r) => r.incarnation === 'usurper' })).incarnation).toBe('usurper');
  });

  it('ignores malformed, oversized, unleased, mismatched and conflicting values with typed reasons, and keeps watching', async () => {
    nextPrefix();
    const holder = await open({ ttlSeconds: 10 });
    await holder.publish(record('holder-d', 'live'));
    const rejected: string[] = [];
    const requester = await EtcdDiscovery.open({ url: etcd.url(), prefix, ttlSeconds: 2, onRejected: (r) => rejected.push(r.reason) });
    closers.push(() => requester.close());
    await requester.waitFor('holder-d', { timeoutMs: 10_000 });
    const c = raw();
    const otherLease = c.lease(30, { autoKeepAlive: false });
    await otherLease.grant();
    await c.put(`${prefix}nodes/junk`).value('{not json');
    await c.put(`${prefix}nodes/big`).value(Buffer.alloc(300 * 1024, 0x20));
    await c.put(`${prefix}nodes/unleased`).value(Buffer.from(encodeNodeRecord(record('unleased', 'x'))));
    await otherLease.put(`${prefix}nodes/wrong-key`).value(Buffer.from(encodeNodeRecord(record('holder-d', 'x'))));
    await otherLease.put(`${prefix}nodes/holder-d`).value(Buffer.from(encodeNodeRecord(record('holder-d', 'forged')))); // hand-written takeover
    await otherLease.put(`${prefix}nodes/bad:key`).value('x');
    // The takeover of its key does not stick: the owner puts its record back (and updates it).
    await holder.publish(record('holder-d', 'live', { blockIds: ['block:kv:9'] }), { timeoutMs: 5000 });
    await requester.waitFor('holder-d', { timeoutMs: 10_000, until: (r) => r.blockIds?.includes('block:kv:9') === true });
    // The watcher survived all of it: a new, valid node still shows up.
    const fresh = await open();
    await fresh.publish(record('fresh', 'f1'));
    await requester.waitFor('fresh', { timeoutMs: 10_000 });
    expect(requester.peek('holder-d')?.incarnation).toBe('live');
    expect(requester.peek('junk')).toBeUndefined();
    expect(requester.peek('big')).toBeUndefined();
    expect(requester.peek('unleased')).toBeUndefined();
    expect(requester.peek('wrong-key')).toBeUndefined();
    for (const reason of ['malformed', 'oversized', 'unleased', 'key-mismatch', 'conflicting-claim']) expect(rejected).toContain(reason);
    expect(requester.stats().rejected['conflicting-claim']).toBeGreaterThanOrEqual(1);
    // A fresh requester (re-list path) applies the same rules to what it finds.
    const late = await open();
    expect(late.peek('junk')).toBeUndefined();
    expect(late.peek('unleased')).toBeUndefined();
    expect(late.stats().rejected['malformed']).toBe(1);
  });

  it('survives etcd going away: known peers from the cache, unknown ones fail naming the store; resynchronises and re-publishes when it returns', async () => {
    nextPrefix();
    const holder = await open();
    await holder.publish(record('holder-e', 'i1', { blockIds: ['block:kv:1'] }));
    const requester = await open();
    await requester.waitFor('holder-e', { timeoutMs: 10_000 });

    await etcd.stop();
    await waitUntil(() => !requester.available);
    expect((await requester.lookup('holder-e'))?.incarnation).toBe('i1');
    expect((await requester.holdersOf('block:kv:1')).length).toBe(1);
    const err = await requester.lookup('unknown-node').catch((e: unknown) => e);
    expect(err).toBeInstanceOf(BackendUnavailableError);
    expect((err as Error).message).toContain(etcd.url());
    await expect(requester.holdersOf('block:kv:404')).rejects.toBeInstanceOf(BackendUnavailableError);
    await expect(requester.waitFor('unknown-node', { timeoutMs: 200 })).rejects.toBeInstanceOf(TimedOutError);
    const down = new EtcdDiscovery({ url: etcd.url(), prefix, callTimeoutMs: 300 });
    closers.push(() => down.close());
    await expect(down.start({ timeoutMs: 1000 })).rejects.toBeInstanceOf(BackendUnavailableError);
    // Outlive the holder's lease TTL (2 s) so its client declares the lease lost.
    await waitUntil(() => !holder.stats().published, 15_000);

    await etcd.start();
    await waitUntil(() => requester.available && holder.available && holder.stats().published, 30_000);
    // The holder kept its lease through the outage (etcd renews leases when it restarts) or,
    // if etcd ended it meanwhile, published again under a new one; either way one live record.
    expect(holder.stats().leasesGranted).toBeGreaterThanOrEqual(1);
    expect(requester.stats().syncs).toBeGreaterThanOrEqual(2);
    // The cache follows etcd again: changes made after the outage arrive.
    await holder.publish(record('holder-e', 'i1', { blockIds: ['block:kv:2'] }));
    await requester.waitFor('holder-e', { timeoutMs: 10_000, until: (r) => r.blockIds?.includes('block:kv:2') === true });
    // And a client that first synchronised during or right after the outage (it kept
    // retrying in the background, so it may have listed the record under the holder's old
    // lease) converges to the one live record with the latest content. Its sync and watch
    // are eventually consistent: wait (bounded) for the content, then check it holds.
    await down.start({ timeoutMs: 10_000 });
    await down.waitFor('holder-e', { timeoutMs: 10_000, until: (r) => r.blockIds?.includes('block:kv:2') === true });
    expect((await down.lookup('holder-e'))?.blockIds).toEqual(['block:kv:2']);
    // The owner moving its record to a new lease is not a conflicting claim, for any client.
    for (const d of [holder, requester, down]) expect(d.stats().rejected['conflicting-claim'] ?? 0).toBe(0);
    // etcd holds exactly one record key for the node, with the latest content, under a live lease.
    const c = raw();
    const keys = await c.getAll().prefix(`${prefix}nodes/`).exec();
    expect(Number((await c.leaseClient.leaseTimeToLive({ ID: keys.kvs[0]?.lease ?? '0', keys: false })).TTL)).toBeGreaterThan(0);
    expect(keys.kvs.map((kv) => kv.key.toString())).toEqual([`${prefix}nodes/holder-e`]);
    expect(JSON.parse(keys.kvs[0]?.value.toString() ?? '{}').blockIds).toEqual(['block:kv:2']);
    // A brand-new client's first list sees the same.
    const fresh = await open();
    expect((await fresh.lookup('holder-e'))?.blockIds).toEqual(['block:kv:2']);
    // The old lease of the holder (kept alive by etcd across its restart) was replaced, so
    // closing the holder removes the record for everyone.
    await holder.close();
    await waitUntil(() => requester.peek('holder-e') === undefined && down.peek('holder-e') === undefined && fresh.peek('holder-e') === undefined, 10_000);
    expect((await c.getAll().prefix(prefix).keys()).length).toBe(0);
  });

  it('a watcher cut off while etcd compacted past its revision re-lists and keeps following the records (etcd cancelled its watch)', async () => {
    nextPrefix();
    // The watcher reaches etcd through a relay the test can cut; the holders go direct.
    const relay = await cuttableRelay(etcd.port);
    closers.push(() => relay.close());
    const watcher = await EtcdDiscovery.open({ url: `etcd://127.0.0.1:${relay.port}`, prefix, callTimeoutMs: 1000, maxBackoffMs: 300 });
    closers.push(() => watcher.close());
    const h1 = await open();
    await h1.publish(record('node-w', 'i1'));
    await watcher.waitFor('node-w', { timeoutMs: 10_000, until: (r) => r.incarnation === 'i1' });
    relay.cut();
    await waitUntil(() => !watcher.available, 10_000);
    // While it is away: the node restarts (i2), and etcd compacts past the watcher's revision.
    await h1.close();
    const h2 = await open();
    await h2.publish(record('node-w', 'i2'));
    const c = raw();
    const revision = (await c.getAll().prefix(prefix).exec()).header.revision;
    await c.kv.compact({ revision, physical: true });
    relay.restore();
    await watcher.waitFor('node-w', { timeoutMs: 15_000, until: (r) => r.incarnation === 'i2' });
    // It still follows etcd: the next restart arrives, and it is available again.
    await h2.close();
    const h3 = await open();
    await h3.publish(record('node-w', 'i3'));
    await watcher.waitFor('node-w', { timeoutMs: 15_000, until: (r) => r.incarnation === 'i3' });
    await waitUntil(() => watcher.available, 10_000);
    expect(watcher.peek('node-w')?.incarnation).toBe('i3');
  });

  it('implements the same interface as StaticDiscovery (close is idempotent; disposal works)', async () => {
    nextPrefix();
    const d = await open();
    const s = new StaticDiscovery();
    for (const x of [d, s]) {
      expect(x.specificationVersion).toBe('v1');
      await x[Symbol.asyncDispose]();
      await x.close();
      await expect(x.list()).rejects.toBeInstanceOf(ClosedError);
    }
  });
});

async function waitUntil(cond: () => boolean, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error('condition not reached');
    await new Promise((r) => setTimeout(r, 50));
  }
}
