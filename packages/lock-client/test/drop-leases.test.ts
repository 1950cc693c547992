import { ConnectionBrokenError, silentLogger } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient } from '../src/index.js';
import { startLockServer, type LockServer } from '../src/server/index.js';

const servers: LockServer[] = [];
const clients: LockClient[] = [];
afterEach(async () => {
  await Promise.allSettled(clients.splice(0).map((c) => c.close()));
  await Promise.allSettled(servers.splice(0).map((s) => s.close({ graceMs: 0 })));
});

describe('dropLeases: a holder incarnation ended', () => {
  it('drops its live guards without any release RPC; other holders are untouched; counters balance', async () => {
    const a = await startLockServer({ holderId: 'holder-a', lockTimeoutMs: 10_000, logger: silentLogger });
    const b = await startLockServer({ holderId: 'holder-b', lockTimeoutMs: 10_000, logger: silentLogger });
    servers.push(a, b);
    const client = new LockClient({ logger: silentLogger });
    clients.push(client);
    const addrA = `127.0.0.1:${a.port}`;
    const addrB = `127.0.0.1:${b.port}`;
    const g1 = await client.acquire(addrA, ['block:kv:1', 'block:kv:2']);
    const g2 = await client.acquire(addrA, ['block:kv:3']);
    const g3 = await client.acquire(addrB, ['block:kv:1']);
    const lost: string[] = [];
    client.on('leaseLost', (e) => lost.push(e.sessionId));
    const reason = new ConnectionBrokenError('holder-a restarted (new incarnation)');
    expect(client.dropLeases(addrA, reason)).toBe(2);
    expect(lost.sort()).toEqual([g1.sessionId, g2.sessionId].sort());
    expect(g1.state).toBe('lost');
    expect(g1.signal.aborted).toBe(true);
    expect(g1.signal.reason).toBe(reason);
    // Disposing a dropped guard sends nothing, and says so.
    const r1 = await g1.release();
    await g2[Symbol.asyncDispose]();
    expect(r1).toMatchObject({ confirmed: false, attempts: 0 });
    expect((a.counters().requests['release'] ?? 0) + (a.counters().requests['releaseMany'] ?? 0)).toBe(0);
    // The other holder's guard is live and releases normally, exactly once.
    expect(g3.state).toBe('active');
    const r3 = await g3.release();
    expect(r3.confirmed).toBe(true);
    expect(b.counters().requests['releaseMany']).toBe(1);
    // Dropping again is a no-op.
    expect(client.dropLeases(addrA, reason)).toBe(0);
    const c = client.counters();
    expect(c.dropped).toBe(2);
    expect(c.acquired).toBe(c.released + c.releaseFailures + c.dropped + c.active);
    expect(c.active).toBe(0);
  });
});
