/**
 * engineGrants asks its block map once per block per pin: the lease table pins a block when
 * its first live lease takes it, and the grant made for the lease uses what the pin looked up
 * (a KV holder's lookup parses a block id: doing it twice per block per lease showed in the
 * acquire profile). After the last lease on a block ends, the next pin looks it up again.
 */
import { describe, expect, it } from 'vitest';
import { TcpTransport, TransferEngine, silentLogger, type GrantRange, type GrantRanges, type Registration, type TransportRegistration } from '@tensorwire/core';
import { LockClient } from '../src/index.js';
import { LockServer, engineGrants } from '../src/server/index.js';

const BLOCK = 4096;

/** A holder serving `region` through `transport` with engineGrants over `blocksFor(registration)`, and a requester with `dstBytes` registered. */
async function flow(transport: TcpTransport, region: Uint8Array, blocksFor: (registration: Registration) => (id: string) => GrantRange | undefined, dstBytes: number) {
  const holder = new TransferEngine({ nodeId: 'holder', transports: [transport], logger: silentLogger });
  const registration = await holder.register({ kind: 'host', buffer: region });
  const grants = engineGrants({ engine: holder, blocks: blocksFor(registration) });
  const server = new LockServer({ holderId: 'holder', lockTimeoutMs: 30_000, ...grants.lockServerOptions, logger: silentLogger });
  const port = await server.listen('127.0.0.1:0');
  const engine = new TransferEngine({ nodeId: 'req', transports: [new TcpTransport()], logger: silentLogger });
  const client = new LockClient({ requesterId: 'req', logger: silentLogger });
  const dst = new Uint8Array(dstBytes);
  const local = await engine.register({ kind: 'host', buffer: dst });
  const close = async (): Promise<void> => {
    await client.close();
    await server.close({ graceMs: 0 });
    await grants.settled();
    await engine.close();
    await holder.close();
  };
  return { grants, address: `127.0.0.1:${port}`, engine, client, dst, local, close };
}

describe('engineGrants block lookups', () => {
  it('one lookup per block per pin, the grant reads the looked-up ranges, unpin forgets them', async () => {
    const region = new Uint8Array(64 * BLOCK).map((_, i) => (i * 131 + (i >> 12)) & 255);
    const lookups = new Map<string, number>();
    const { grants, address, engine, client, dst, local, close } = await flow(
      new TcpTransport(),
      region,
      (registration) => (id) => {
        lookups.set(id, (lookups.get(id) ?? 0) + 1);
        const m = /^block:kv:(\d+)$/.exec(id);
        const i = m ? Number(m[1]) : -1;
        return i >= 0 && i < 64 ? { registration, offset: ((i * 5) % 64) * BLOCK, length: BLOCK } : undefined;
      },
      16 * BLOCK,
    );
    try {
      const ids = Array.from({ length: 16 }, (_, i) => `block:kv:${i * 3}`);
      const destinations = ids.map((_, i) => ({ local, offset: i * BLOCK, length: BLOCK }));
      const total = (): number => [...lookups.values()].reduce((a, b) => a + b, 0);
      const a = await client.fetch(engine, address, ids, destinations, { timeoutMs: 10_000 });
      expect(total()).toBe(16); // the pins; the grant looked up nothing again
      for (let i = 0; i < 16; i++) {
        const s = (((i * 3) * 5) % 64) * BLOCK;
        expect(Buffer.compare(dst.subarray(i * BLOCK, (i + 1) * BLOCK), region.subarray(s, s + BLOCK))).toBe(0);
      }
      // A second lease on the same blocks while the first is live: no pin, no lookup.
      const b = await client.fetch(engine, address, ids, destinations, { timeoutMs: 10_000 });
      expect(total()).toBe(16);
      await a.release();
      await b.release();
      // Last lease ended: unpinned, so the next lease looks every block up again.
      const c = await client.fetch(engine, address, ids, destinations, { timeoutMs: 10_000 });
      expect(total()).toBe(32);
      await c.release();
      await grants.settled();
      expect(grants.counters()).toEqual({ issued: 3, revoked: 3, live: 0, failed: 0 });
    } finally {
      await close();
    }
  });

  it('a lease whose blocks are one size on one grid of one registration is a block grant; any other lease is a range grant; both read the right bytes', async () => {
    /** A TCP transport that remembers how each grant came. */
    class Spy extends TcpTransport {
      readonly forms: string[] = [];
      override grant(spec: GrantRanges): TransportRegistration {
        this.forms.push(spec.blocks === undefined ? 'ranges' : `blocks@${spec.blocks.base}x${spec.blocks.blockBytes}`);
        return super.grant(spec);
      }
    }
    const spy = new Spy();
    const region = new Uint8Array(80 * BLOCK).map((_, i) => (i * 131 + (i >> 12)) & 255);
    // block:grid:i is block i of a grid that starts at 100; odd:i is one byte off that grid; big:i is twice the size.
    let where: (id: string) => GrantRange | undefined = () => undefined;
    const { grants, address, engine, client, dst, local, close } = await flow(
      spy,
      region,
      (registration) =>
        (where = (id) => {
          const m = /^block:(grid|odd|big):(\d+)$/.exec(id);
          if (!m) return undefined;
          const i = Number(m[2]);
          if (m[1] === 'grid') return { registration, offset: 100 + i * BLOCK, length: BLOCK };
          if (m[1] === 'odd') return { registration, offset: 101 + i * BLOCK, length: BLOCK };
          return { registration, offset: 60 * BLOCK + i * 2 * BLOCK, length: 2 * BLOCK };
        }),
      20 * BLOCK,
    );
    try {
      const leases: [string[], string][] = [
        [['block:grid:7', 'block:grid:0', 'block:grid:33', 'block:grid:2'], 'blocks@100x4096'],
        [['block:grid:7', 'block:odd:3', 'block:grid:9'], 'ranges'],
        [['block:grid:1', 'block:big:2'], 'ranges'],
        [['block:big:0', 'block:big:3'], `blocks@${(60 * BLOCK) % (2 * BLOCK)}x${2 * BLOCK}`],
      ];
      for (const [ids, form] of leases) {
        const sizes = ids.map((id) => (where(id) as GrantRange).length as number);
        const offsets = sizes.map((_, i) => sizes.slice(0, i).reduce((x, y) => x + y, 0));
        dst.fill(0);
        const f = await client.fetch(engine, address, ids, ids.map((_, i) => ({ local, offset: offsets[i] as number, length: sizes[i] as number })), { timeoutMs: 10_000 });
        expect(spy.forms.at(-1), ids.join()).toBe(form);
        for (const [i, id] of ids.entries()) {
          const r = where(id) as GrantRange;
          const o = offsets[i] as number;
          expect(Buffer.compare(dst.subarray(o, o + (r.length as number)), region.subarray(r.offset as number, (r.offset as number) + (r.length as number))), id).toBe(0);
        }
        await f.release();
      }
      await grants.settled();
      expect(grants.counters()).toEqual({ issued: 4, revoked: 4, live: 0, failed: 0 });
    } finally {
      await close();
    }
  });
});
