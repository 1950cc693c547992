import { silentLogger } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient } from '../src/index.js';
import { startLockServer, type LockServer } from '../src/server/index.js';

const servers: LockServer[] = [];
afterEach(async () => {
  await Promise.allSettled(servers.splice(0).map((s) => s.close({ graceMs: 0 })));
});

describe('close() with an acquire in flight', () => {
  it('waits for the release of a grant that may have happened before it resolves', async () => {
    // A slow resolver keeps the acquire in flight at the holder while the client closes.
    const server = await startLockServer({
      holderId: 'slow-holder',
      lockTimeoutMs: 30_000,
      logger: silentLogger,
      resolve: async (ids) => {
        await new Promise((r) => setTimeout(r, 300));
        return ids.map(() => new Uint8Array([1]));
      },
    });
    servers.push(server);
    const client = new LockClient({ logger: silentLogger });
    const addr = `127.0.0.1:${server.port}`;
    const pending = client.acquire(addr, ['block:kv:1']).catch((e: unknown) => e);
    // Make sure the acquire reached the holder before closing.
    while (server.counters().requests.acquire === 0) await new Promise((r) => setTimeout(r, 5));
    await client.close();
    expect(await pending).toMatchObject({ code: 'TW_CLOSED' });
    // Once close() has resolved, the possible grant has been released (by acquire id): nothing is left pinned.
    expect(server.counters().requests.releaseMany).toBe(1);
    expect(server.counters().releaseEntries).toBe(1);
    const c = server.counters();
    expect(c.acquired).toBe(c.released + c.expired + c.active);
    expect(c.active).toBe(0);
  });
});
