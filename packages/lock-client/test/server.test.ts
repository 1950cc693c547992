import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import * as grpc from '@grpc/grpc-js';
import { ConnectionBrokenError, InvalidInputError, RemoteRejectedError, ResourceExhaustedError } from '@tensorwire/core';
import { Registry } from 'prom-client';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient } from '../src/index.js';
import { LockServer, loadLockProtocol, LeaseError } from '../src/server/index.js';
import type { LockServiceClient } from '../src/proto.js';
import { blocks, harness, type Harness } from './helpers.js';

type Raw = LockServiceClient;

function rawClient(holder: string, token?: string): { raw: Raw; md: () => grpc.Metadata } {
  const { Client } = loadLockProtocol();
  const raw = new Client(holder, grpc.credentials.createInsecure());
  return {
    raw,
    md: () => {
      const m = new grpc.Metadata();
      if (token !== undefined) m.set('authorization', `Bearer ${token}`);
      return m;
    },
  };
}

function unary<Res>(fn: (cb: (e: grpc.ServiceError | null, r?: Res) => void) => void): Promise<{ code: number; details: string; res?: Res }> {
  return new Promise((resolve) => {
    fn((e, r) => resolve(e ? { code: e.code, details: e.details } : { code: grpc.status.OK, details: '', ...(r !== undefined ? { res: r } : {}) }));
  });
}

let h: Harness | undefined;
afterEach(async () => {
  await h?.close();
  h = undefined;
});

describe('LockServer over gRPC', () => {
  it('answers bad input with specific statuses and never touches another requester\'s lease', async () => {
    h = await harness({ maxBlocksPerSession: 4 });
    const { raw, md } = rawClient(h.holder);
    const acquire = (requesterId: string, blockIds: string[]) =>
      unary<{ sessionId: string }>((cb) => raw.Acquire({ requesterId, blockIds, leaseMs: 0, acquireId: '' }, md(), {}, cb));
    const ok = await acquire('alice', ['block:holder1:1']);
    expect(ok.code).toBe(grpc.status.OK);
    const sessionId = ok.res?.sessionId as string;

    expect((await acquire('alice', [])).code).toBe(grpc.status.INVALID_ARGUMENT);
    expect((await acquire('alice', ['block:holder1:1', 'block:holder1:1'])).code).toBe(grpc.status.INVALID_ARGUMENT);
    expect((await acquire('alice', ['block::1'])).code).toBe(grpc.status.INVALID_ARGUMENT);
    expect((await acquire('', ['block:holder1:1'])).code).toBe(grpc.status.INVALID_ARGUMENT);
    expect((await acquire('alice', blocks('holder1', 5))).code).toBe(grpc.status.RESOURCE_EXHAUSTED);

    const release = (requesterId: string, sid: string) =>
      unary<{ released: number }>((cb) => raw.Release({ requesterId, sessionId: sid, acquireId: '' }, md(), {}, cb));
    const renew = (requesterId: string, sid: string) =>
      unary<{ deadlineUnixMs: number }>((cb) => raw.Renew({ requesterId, sessionId: sid, leaseMs: 0 }, md(), {}, cb));
    const denied = await release('mallory', sessionId);
    expect(denied.code).toBe(grpc.status.PERMISSION_DENIED);
    expect(denied.details).toMatch(/another requester/);
    expect((await renew('mallory', sessionId)).code).toBe(grpc.status.PERMISSION_DENIED);
    expect((await release('alice', 'session:holder1')).code).toBe(grpc.status.INVALID_ARGUMENT);
    expect((await renew('alice', 'block:holder1:1')).code).toBe(grpc.status.INVALID_ARGUMENT);
    expect((await renew('alice', 'session:holder1:unknown')).code).toBe(grpc.status.NOT_FOUND);
    const unknown = await release('alice', 'session:holder1:unknown');
    expect(unknown).toMatchObject({ code: grpc.status.OK, res: { released: 0 } });

    // Alice's lease survived all of it.
    expect(h.server.table.get(sessionId)?.requesterId).toBe('alice');
    expect((await renew('alice', sessionId)).code).toBe(grpc.status.OK);
    expect(await release('alice', sessionId)).toMatchObject({ code: grpc.status.OK, res: { released: 1 } });
    const c = h.server.counters();
    expect(c).toMatchObject({ acquired: 1, released: 1, expired: 0, active: 0 });
    expect(c.rejected).toBe(10);
    raw.close();
  });

  it('requires the token when one is set', async () => {
    h = await harness({ token: 's3cret' }, { token: 's3cret' });
    const none = rawClient(h.holder);
    const wrong = rawClient(h.holder, 'guess');
    const req = { requesterId: 'x', blockIds: ['block:holder1:1'], leaseMs: 0, acquireId: '' };
    const a = await unary((cb) => none.raw.Acquire(req, none.md(), {}, cb));
    const b = await unary((cb) => wrong.raw.Acquire(req, wrong.md(), {}, cb));
    const c = await unary((cb) => wrong.raw.Health({}, wrong.md(), {}, cb));
    expect([a.code, b.code, c.code]).toEqual([grpc.status.UNAUTHENTICATED, grpc.status.UNAUTHENTICATED, grpc.status.UNAUTHENTICATED]);
    expect(a.details).toMatch(/missing/);
    expect(b.details).toMatch(/wrong token/);
    expect(h.server.counters().acquired).toBe(0);
    // The typed client with the right token works; with a wrong one it gets a typed rejection.
    const g = await h.client.acquire(h.holder, ['block:holder1:1']);
    await g.release();
    const bad = new LockClient({ token: 'nope' });
    const err = await bad.acquire(h.holder, ['block:holder1:1']).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('UNAUTHENTICATED');
    await bad.close();
    none.raw.close();
    wrong.raw.close();
  });

  it('maps statuses to typed errors on the client', async () => {
    h = await harness({ maxSessions: 1 });
    const g = await h.client.acquire(h.holder, ['block:holder1:1']);
    await expect(h.client.acquire(h.holder, ['block:holder1:2'])).rejects.toBeInstanceOf(ResourceExhaustedError);
    await expect(h.client.acquire(h.holder, ['nonsense'])).rejects.toBeInstanceOf(InvalidInputError);
    await expect(h.client.acquire(h.holder, [])).rejects.toBeInstanceOf(InvalidInputError);
    await g.release();
    const other = new LockClient({ defaultTimeoutMs: 2000, releaseRetry: { initialDelayMs: 1, maxDelayMs: 5 }, assumedLockTimeoutMs: 50 });
    const port = h.server.port;
    await h.close();
    h = undefined;
    const err = await other.acquire(`127.0.0.1:${port}`, ['block:holder1:1']).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ConnectionBrokenError);
    await other.close();
  });

  it('hands out resolver descriptors, revokes grants before unpinning, and maps hook errors', async () => {
    const log: string[] = [];
    h = await harness({
      pin: (b) => {
        if (b.endsWith(':404')) throw new LeaseError('NOT_FOUND', `no ${b}`);
        log.push(`pin ${b}`);
      },
      unpin: (b) => log.push(`unpin ${b}`),
      revoke: (lease, why) => log.push(`revoke ${why} ${lease.sessionId === undefined ? '' : 'session'}`),
      resolve: async (ids, lease) => {
        if (ids.includes('block:holder1:500')) throw new Error('disk on fire');
        return ids.map((id) => [Buffer.from(`tcp:${id}:${lease.sessionId}`), Buffer.from('rdma')]);
      },
    });
    const g = await h.client.acquire(h.holder, ['block:holder1:1']);
    const d = g.descriptorsFor('block:holder1:1');
    expect(d.map((x) => Buffer.from(x).toString())).toEqual([`tcp:block:holder1:1:${g.sessionId}`, 'rdma']);
    await g.release();
    expect(log).toEqual(['pin block:holder1:1', 'revoke released session', 'unpin block:holder1:1']);

    const nf = await h.client.acquire(h.holder, ['block:holder1:404']).catch((e: unknown) => e);
    expect((nf as RemoteRejectedError).remoteCode).toBe('NOT_FOUND');
    const internal = await h.client.acquire(h.holder, ['block:holder1:500']).catch((e: unknown) => e);
    expect((internal as RemoteRejectedError).remoteCode).toBe('INTERNAL');
    // A failed resolve gives the lease back (counted as released), still balanced.
    const c = h.server.counters();
    expect(c).toMatchObject({ acquired: 2, released: 2, active: 0, pinnedBlocks: 0 });
  });

  it('exposes balanced prom-client metrics on the registry passed in, and health', async () => {
    const registry = new Registry();
    h = await harness({ registry });
    const held = await h.client.acquire(h.holder, blocks('holder1', 3));
    const g2 = await h.client.acquire(h.holder, blocks('holder1', 2, 10));
    await g2.release();
    const health = await h.client.health(h.holder);
    expect(health).toMatchObject({ status: 'SERVING', holderId: 'holder1', activeSessions: 1, activeBlocks: 3, lockTimeoutMs: 30_000 });
    const text = await registry.metrics();
    const value = (name: string): number => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(text)?.[1]);
    expect(value('tensorwire_lock_sessions_acquired_total')).toBe(2);
    expect(value('tensorwire_lock_sessions_released_total')).toBe(1);
    expect(value('tensorwire_lock_sessions_expired_total')).toBe(0);
    expect(value('tensorwire_lock_sessions_active')).toBe(1);
    expect(value('tensorwire_lock_blocks_active')).toBe(3);
    expect(text).toMatch(/tensorwire_lock_requests_total\{op="acquire"\} 2/);
    await held.release();
  });

  it('shuts down gracefully: refuses new acquires, lets live leases release, revokes the rest', async () => {
    h = await harness({}, {});
    const g = await h.client.acquire(h.holder, ['block:holder1:1']);
    const stuck = await h.client.acquire(h.holder, ['block:holder1:2']);
    const closing = h.server.close({ graceMs: 60_000 });
    expect(h.server.state).toBe('draining');
    const refused = await h.client.acquire(h.holder, ['block:holder1:3']).catch((e: unknown) => e);
    expect(refused).toBeInstanceOf(ConnectionBrokenError);
    expect((await g.release()).blocksReleased).toBe(1);
    expect(h.server.state).toBe('draining');
    expect((await stuck.release()).blocksReleased).toBe(1);
    await closing;
    expect(h.server.state).toBe('closed');
    expect(h.server.counters()).toMatchObject({ acquired: 2, released: 2, expired: 0, active: 0 });

    const s2 = new LockServer({ holderId: 'holder2', lockTimeoutMs: 30_000 });
    const port = await s2.listen();
    const left = await h.client.acquire(`127.0.0.1:${port}`, ['block:holder2:1']);
    await s2.close({ graceMs: 0 });
    // Revoked at shutdown: counted as expired.
    expect(s2.counters()).toMatchObject({ acquired: 1, released: 0, expired: 1, active: 0 });
    expect(left.sessionId).toMatch(/^session:holder2:/);
  });

  it('serves over TLS', async (ctx) => {
    const dir = mkdtempSync(join(tmpdir(), 'lock-tls-'));
    try {
      try {
        execFileSync('openssl', ['req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-days', '1', '-subj', '/CN=localhost',
          '-addext', 'subjectAltName=DNS:localhost,IP:127.0.0.1', '-keyout', join(dir, 'key.pem'), '-out', join(dir, 'cert.pem')], { stdio: 'ignore' });
      } catch (e) {
        console.log(`skipping TLS test: openssl could not make a certificate (${String(e)})`);
        ctx.skip();
        return;
      }
      const cert = readFileSync(join(dir, 'cert.pem'));
      const key = readFileSync(join(dir, 'key.pem'));
      const server = new LockServer({ holderId: 'tls', lockTimeoutMs: 10_000 });
      const port = await server.listen('127.0.0.1:0', grpc.ServerCredentials.createSsl(null, [{ private_key: key, cert_chain: cert }], false));
      const client = new LockClient({ credentials: grpc.credentials.createSsl(cert) });
      const g = await client.acquire(`localhost:${port}`, ['block:tls:1']);
      expect((await g.release()).confirmed).toBe(true);
      const plain = new LockClient({ defaultTimeoutMs: 3000, assumedLockTimeoutMs: 10 });
      await expect(plain.acquire(`127.0.0.1:${port}`, ['block:tls:1'])).rejects.toBeInstanceOf(ConnectionBrokenError);
      await plain.close();
      await client.close();
      await server.close({ graceMs: 0 });
      expect(server.counters()).toMatchObject({ acquired: 1, released: 1, active: 0 });
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
