/**
 * etcd's own protections, on real etcd processes with authentication enabled: user and
 * password (plain text) and TLS client certificates (common name = user), with the README's
 * role layout, in which each node may write only its own two keys.
 */
import { readFileSync } from 'node:fs';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Etcd3, EtcdPermissionDeniedError, type IOptions } from 'etcd3';
import { BackendUnavailableError, RemoteRejectedError, encodeEndpoint, encodeNodeRecord, type NodeRecord } from '@tensorwire/core';
import { EtcdDiscovery, type EtcdDiscoveryOptions } from '../src/index.js';
import { TestEtcd, enableAuth, etcdMissing, makePki, opensslMissing, type TestPki } from './helpers/etcd.js';

const missing = etcdMissing() ?? opensslMissing();
if (missing) console.warn(`[discovery-etcd] skipping etcd auth tests: ${missing}`);

const PREFIX = '/tw-auth/';

function record(nodeId: string, incarnation: string, extra: Partial<NodeRecord> = {}): NodeRecord {
  const endpoint = encodeEndpoint({ identity: { nodeId, incarnation, hostId: 'h1' }, transports: new Map([['tcp', new Uint8Array([1, 2, 3, 4])]]) });
  return { nodeId, incarnation, hostId: 'h1', endpoint, ...extra };
}

/** What node A's credentials must not be able to do to node B's keys and lease. */
async function expectCannotTouch(a: Etcd3, victim: string, victimLease: string): Promise<void> {
  const denied = async (p: Promise<unknown>): Promise<void> => {
    await expect(p).rejects.toBeInstanceOf(EtcdPermissionDeniedError);
  };
  const value = Buffer.from(encodeNodeRecord(record(victim, 'forged', { lockAddress: '10.6.6.6:6666' })));
  await denied(a.put(`${PREFIX}nodes/${victim}`).value(value).exec());
  await denied(a.put(`${PREFIX}owners/${victim}`).value('1').exec());
  await denied(a.delete().key(`${PREFIX}nodes/${victim}`).exec());
  await denied(a.delete().key(`${PREFIX}owners/${victim}`).exec());
  await denied(a.put(`${PREFIX}nodes/${victim}x`).value(value).exec()); // a node id that merely starts with the victim's
  // Its own key, but attached to the victim's lease (so that revoking would take the victim's keys): refused.
  await denied(a.put(`${PREFIX}nodes/node-a`).value(value).lease(victimLease).exec());
  await denied(a.leaseClient.leaseRevoke({ ID: victimLease }));
}

async function waitUntil(cond: () => boolean, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error('condition not reached');
    await new Promise((r) => setTimeout(r, 50));
  }
}

describe.skipIf(missing !== undefined)('etcd authentication and TLS', () => {
  let pki: TestPki;
  let plain: TestEtcd;
  let tls: TestEtcd;
  const closers: (() => Promise<unknown>)[] = [];

  beforeAll(async () => {
    pki = makePki(['root', 'node-a', 'node-b', 'nobody']);
    plain = new TestEtcd();
    tls = new TestEtcd({ tls: { ca: pki.ca, cert: pki.server.cert, key: pki.server.key } });
    await Promise.all([plain.start(), tls.start()]);
    const plainAdmin = new Etcd3({ hosts: `http://127.0.0.1:${plain.port}` });
    await enableAuth(plainAdmin, PREFIX, 'root-pw', ['node-a', 'node-b']);
    plainAdmin.close();
    const tlsAdmin = new Etcd3({ hosts: `https://127.0.0.1:${tls.port}`, credentials: clientCredentials('root') });
    await enableAuth(tlsAdmin, PREFIX, 'root-pw', ['node-a', 'node-b']);
    tlsAdmin.close();
  });
  afterAll(async () => {
    await Promise.all([plain?.destroy(), tls?.destroy()]);
    pki?.destroy();
  });
  afterEach(async () => {
    for (const c of closers.splice(0).reverse()) await c().catch(() => undefined);
  });

  function clientCredentials(name: string): NonNullable<IOptions['credentials']> {
    const c = pki.client(name);
    return { rootCertificate: readFileSync(pki.ca), certChain: readFileSync(c.cert), privateKey: readFileSync(c.key) };
  }
  function rawClient(options: IOptions): Etcd3 {
    const c = new Etcd3({ ...options, defaultCallOptions: () => ({ deadline: Date.now() + 3000 }) });
    closers.push(async () => c.close());
    return c;
  }
  async function open(options: Omit<EtcdDiscoveryOptions, 'prefix'> & { timeoutMs?: number }): Promise<EtcdDiscovery> {
    const d = await EtcdDiscovery.open({ prefix: PREFIX, ttlSeconds: 5, callTimeoutMs: 1000, maxBackoffMs: 300, ...options });
    closers.push(() => d.close());
    return d;
  }
  async function leaseOf(client: Etcd3, nodeId: string): Promise<string> {
    const kvs = (await client.getAll().prefix(`${PREFIX}nodes/${nodeId}`).exec()).kvs;
    return kvs.find((kv) => kv.key.toString() === `${PREFIX}nodes/${nodeId}`)?.lease ?? '0';
  }

  it('user and password: each node publishes its own record and reads everyone\'s, and cannot write another node\'s keys', async () => {
    const url = plain.url();
    const a = await open({ url, auth: { username: 'node-a', password: 'pw-node-a' } });
    const b = await open({ url, auth: { username: 'node-b', password: 'pw-node-b' } });
    await a.publish(record('node-a', 'a1', { lockAddress: '127.0.0.1:7070' }));
    await b.publish(record('node-b', 'b1', { lockAddress: '127.0.0.1:7071' }));
    await a.waitFor('node-b', { timeoutMs: 10_000 });
    await b.waitFor('node-a', { timeoutMs: 10_000 });

    const asA = rawClient({ hosts: `http://127.0.0.1:${plain.port}`, auth: { username: 'node-a', password: 'pw-node-a' } });
    const bLease = await leaseOf(asA, 'node-b'); // reading is allowed
    expect(bLease).not.toBe('0');
    await expectCannotTouch(asA, 'node-b', bLease);
    // Node A's discovery cannot publish as node B either: a typed refusal, not an outage.
    const a2 = await open({ url, auth: { username: 'node-a', password: 'pw-node-a' } });
    const err = await a2.publish(record('node-b', 'impostor'), { timeoutMs: 3000 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).details['reason']).toBe('permission-denied');
    // Node B's record never changed, and B never had to restore it.
    expect(a.peek('node-b')?.lockAddress).toBe('127.0.0.1:7071');
    expect(await leaseOf(asA, 'node-b')).toBe(bLease);
    expect(b.stats().restores).toBe(0);
    // No credentials, or wrong ones: no access at all.
    const anon = rawClient({ hosts: `http://127.0.0.1:${plain.port}` });
    await expect(anon.put(`${PREFIX}nodes/node-b`).value('x').exec()).rejects.toThrow();
    await expect(open({ url, auth: { username: 'node-a', password: 'wrong' }, timeoutMs: 1500 })).rejects.toBeInstanceOf(BackendUnavailableError);
    // Closing revokes the lease: allowed, it holds only the node's own keys.
    await b.close();
    await waitUntil(() => a.peek('node-b') === undefined);
  });

  it('TLS client certificates: the certificate\'s common name is the etcd user, with the same limits', async () => {
    const url = tls.url();
    const creds = (name: string): EtcdDiscoveryOptions['tls'] => {
      const c = pki.client(name);
      return { ca: readFileSync(pki.ca), cert: readFileSync(c.cert, 'utf8'), key: readFileSync(c.key) };
    };
    expect(url.startsWith('etcds://')).toBe(true);
    const a = await open({ url, tls: creds('node-a') });
    const b = await open({ url, tls: creds('node-b') });
    await a.publish(record('node-a', 'a1'));
    await b.publish(record('node-b', 'b1', { lockAddress: '127.0.0.1:7071' }));
    await a.waitFor('node-b', { timeoutMs: 10_000 });
    await b.waitFor('node-a', { timeoutMs: 10_000 });
    expect(a.store).toBe(url);

    const asA = rawClient({ hosts: `https://127.0.0.1:${tls.port}`, credentials: clientCredentials('node-a') });
    const bLease = await leaseOf(asA, 'node-b');
    await expectCannotTouch(asA, 'node-b', bLease);
    const err = await (await open({ url, tls: creds('node-a') })).publish(record('node-b', 'impostor'), { timeoutMs: 3000 }).catch((e: unknown) => e);
    expect((err as RemoteRejectedError).details['reason']).toBe('permission-denied');
    // A certificate of a user without a role can read nothing; a client that does not trust the
    // server's CA, or has no client certificate, does not get in.
    const nobody = rawClient({ hosts: `https://127.0.0.1:${tls.port}`, credentials: clientCredentials('nobody') });
    await expect(nobody.get(`${PREFIX}nodes/node-b`).exec()).rejects.toThrow();
    await expect(open({ url, tls: { ...creds('node-a'), ca: readFileSync(pki.otherCa) }, timeoutMs: 1500 })).rejects.toBeInstanceOf(BackendUnavailableError);
    await expect(open({ url, tls: { ca: readFileSync(pki.ca) }, timeoutMs: 1500 })).rejects.toBeInstanceOf(BackendUnavailableError);
    expect(a.peek('node-b')?.lockAddress).toBe('127.0.0.1:7071');
    expect(b.stats().restores).toBe(0);
  });
});
