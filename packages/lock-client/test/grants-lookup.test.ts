/**
 * engineGrants asks its block map once per block per pin: the lease table pins a block when
 * its first live lease takes it, and the grant made for the lease uses what the pin looked up
 * (a KV holder's lookup parses a block id: doing it twice per block per lease showed in the
 * acquire profile). After the last lease on a block ends, the next pin looks it up again.
 */
import { describe, expect, it } from 'vitest';
import { TcpTransport, TransferEngine, silentLogger, type GrantRange } from '@tensorwire/core';
import { LockClient } from '../src/index.js';
import { LockServer, engineGrants } from '../src/server/index.js';

const BLOCK = 4096;

describe('engineGrants block lookups', () => {
  it('one lookup per block per pin, the grant reads the looked-up ranges, unpin forgets them', async () => {
    const holder = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
    const region = new Uint8Array(64 * BLOCK).map((_, i) => (i * 131 + (i >> 12)) & 255);
    const registration = await holder.register({ kind: 'host', buffer: region });
    const lookups = new Map<string, number>();
    const blocks = (id: string): GrantRange | undefined => {
      lookups.set(id, (lookups.get(id) ?? 0) + 1);
      const m = /^block:kv:(\d+)$/.exec(id);
      const i = m ? Number(m[1]) : -1;
      return i >= 0 && i < 64 ? { registration, offset: ((i * 5) % 64) * BLOCK, length: BLOCK } : undefined;
    };
    const grants = engineGrants({ engine: holder, blocks });
    const server = new LockServer({ holderId: 'holder', lockTimeoutMs: 30_000, ...grants.lockServerOptions, logger: silentLogger });
    const port = await server.listen('127.0.0.1:0');
    const engine = new TransferEngine({ nodeId: 'req', transports: [new TcpTransport()], logger: silentLogger });
    const client = new LockClient({ requesterId: 'req', logger: silentLogger });
    const dst = new Uint8Array(16 * BLOCK);
    const local = await engine.register({ kind: 'host', buffer: dst });
    try {
      const ids = Array.from({ length: 16 }, (_, i) => `block:kv:${i * 3}`);
      const destinations = ids.map((_, i) => ({ local, offset: i * BLOCK, length: BLOCK }));
      const total = (): number => [...lookups.values()].reduce((a, b) => a + b, 0);
      const a = await client.fetch(engine, `127.0.0.1:${port}`, ids, destinations, { timeoutMs: 10_000 });
      expect(total()).toBe(16); // the pins; the grant looked up nothing again
      for (let i = 0; i < 16; i++) {
        const s = (((i * 3) * 5) % 64) * BLOCK;
        expect(Buffer.compare(dst.subarray(i * BLOCK, (i + 1) * BLOCK), region.subarray(s, s + BLOCK))).toBe(0);
      }
      // A second lease on the same blocks while the first is live: no pin, no lookup.
      const b = await client.fetch(engine, `127.0.0.1:${port}`, ids, destinations, { timeoutMs: 10_000 });
      expect(total()).toBe(16);
      await a.release();
      await b.release();
      // Last lease ended: unpinned, so the next lease looks every block up again.
      const c = await client.fetch(engine, `127.0.0.1:${port}`, ids, destinations, { timeoutMs: 10_000 });
      expect(total()).toBe(32);
      await c.release();
      await grants.settled();
      expect(grants.counters()).toEqual({ issued: 3, revoked: 3, live: 0, failed: 0 });
    } finally {
      await client.close();
      await server.close({ graceMs: 0 });
      await grants.settled();
      await engine.close();
      await holder.close();
    }
  });
});
