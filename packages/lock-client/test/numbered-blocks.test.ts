/**
 * Blocks by number: a holder's numbered block space (`block:<owner>:<n>`), leased as the owner
 * once and the numbers packed, pinned as counts in a typed array, granted as the block grant of
 * the numbers. The table's promises hold for them as for ids: counts balance, a block is unpinned
 * only when its last live lease ends, a refused acquire leaves nothing pinned, bad input is a
 * typed error naming what is wrong.
 */
import * as grpc from '@grpc/grpc-js';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import {
  InvalidInputError,
  RemoteRejectedError,
  TcpTransport,
  TransferEngine,
  silentLogger,
  type GrantRanges,
  type TransportRegistration,
} from '@tensorwire/core';
import { LockClient, loadLockProtocol } from '../src/index.js';
import { LeaseError, LeaseTable, LockServer, engineGrants } from '../src/server/index.js';

const COUNT = 12;
const REQUESTERS = ['r0', 'r1'];

function statusOf(f: () => unknown): string {
  try {
    f();
  } catch (e) {
    return e instanceof LeaseError ? `${e.status}: ${e.message}` : `threw ${String(e)}`;
  }
  return 'ok';
}

describe('numbered block spaces: the lease table', () => {
  it('counts pins per block like ids do: the hooks see exactly the blocks that go 0 → 1 and 1 → 0, counters balance, refusals leave nothing', () => {
    type Op =
      | { kind: 'acquire'; requester: number; numbers: number[]; refuse: boolean }
      | { kind: 'release'; requester: number; session: number }
      | { kind: 'step'; ms: number };
    const op: fc.Arbitrary<Op> = fc.oneof(
      {
        weight: 4,
        arbitrary: fc.record({
          kind: fc.constant('acquire' as const),
          requester: fc.nat(REQUESTERS.length - 1),
          // Mostly distinct numbers inside the space; sometimes a repeat or one past its end.
          numbers: fc.array(fc.nat(COUNT), { minLength: 1, maxLength: 6 }),
          refuse: fc.boolean(),
        }),
      },
      { weight: 3, arbitrary: fc.record({ kind: fc.constant('release' as const), requester: fc.nat(REQUESTERS.length - 1), session: fc.nat(30) }) },
      { weight: 2, arbitrary: fc.record({ kind: fc.constant('step' as const), ms: fc.integer({ min: 0, max: 600 }) }) },
    );
    fc.assert(
      fc.property(fc.array(op, { maxLength: 80 }), (ops) => {
        let t = 1_000_000;
        let refuseNext = false;
        const pinned = new Set<number>();
        const live = new Map<string, { requester: string; numbers: number[]; deadline: number }>();
        const sessions: string[] = [];
        const problems: string[] = [];
        const table = new LeaseTable({
          holderId: 'h',
          lockTimeoutMs: 1000,
          minLeaseMs: 100,
          clock: { now: () => t },
          spaces: {
            kv: {
              count: COUNT,
              pin: (numbers) => {
                if (refuseNext) throw new LeaseError('NOT_FOUND', 'evicted');
                for (const k of numbers) {
                  if (pinned.has(k)) problems.push(`pin of pinned ${k}`);
                  pinned.add(k);
                }
              },
              unpin: (numbers) => {
                for (const k of numbers) {
                  if (!pinned.has(k)) problems.push(`unpin of unpinned ${k}`);
                  for (const l of live.values()) if (l.deadline > t && l.numbers.includes(k)) problems.push(`unpin of ${k} under a live lease`);
                  pinned.delete(k);
                }
              },
            },
          },
        });
        const expire = (): void => {
          for (const [id, l] of live) if (l.deadline <= t) live.delete(id);
        };
        for (const o of ops) {
          if (o.kind === 'step') {
            t += o.ms;
            continue;
          }
          if (o.kind === 'acquire') {
            expire();
            const requester = REQUESTERS[o.requester] as string;
            table.expireDue(); // what the acquire would expire first, so that `before` is what it pins on
            const before = Array.from({ length: COUNT }, (_, k) => table.pinCount(`block:kv:${k}`));
            const outside = o.numbers.findIndex((k) => k >= COUNT);
            const repeat = o.numbers.findIndex((k, i) => o.numbers.indexOf(k) < i);
            const fresh = o.numbers.some((k) => !before[k]);
            refuseNext = o.refuse && fresh;
            const got = statusOf(() => {
              const lease = table.acquire(requester, { owner: 'kv', numbers: Uint32Array.from(o.numbers) });
              live.set(lease.sessionId, { requester, numbers: o.numbers, deadline: lease.deadline });
              sessions.push(lease.sessionId);
            });
            // Checked in order: each number inside the space, then not a repeat.
            const firstBad = [outside, repeat].filter((i) => i >= 0).sort((a, b) => a - b)[0];
            if (firstBad === undefined && !refuseNext) expect(got).toBe('ok');
            else if (firstBad === undefined) expect(got).toBe('NOT_FOUND: evicted');
            else if (firstBad === outside) expect(got).toMatch(new RegExp(`^NOT_FOUND: no block block:kv:${o.numbers[outside]} .*blocks\\[${outside}\\]`));
            else expect(got).toMatch(new RegExp(`^INVALID_ARGUMENT: block block:kv:${o.numbers[repeat]} appears twice \\(blocks\\[${repeat}\\]\\)`));
            if (got !== 'ok') expect(Array.from({ length: COUNT }, (_, k) => table.pinCount(`block:kv:${k}`))).toEqual(before);
            refuseNext = false;
          } else {
            expire();
            const requester = REQUESTERS[o.requester] as string;
            const sessionId = sessions[o.session] ?? 'session:h:none';
            const l = live.get(sessionId);
            const mine = l !== undefined && l.requester === requester;
            if (mine) live.delete(sessionId); // ended by this call: its blocks may be unpinned during it
            const got = statusOf(() => expect(table.release(requester, { sessionId })).toBe(mine ? l.numbers.length : 0));
            if (l !== undefined && !mine) expect(got).toMatch(/^PERMISSION_DENIED/);
            else expect(got).toBe('ok');
          }
          table.expireDue();
          expire();
          for (let k = 0; k < COUNT; k++) {
            const want = [...live.values()].filter((l) => l.numbers.includes(k)).length;
            expect(table.pinCount(`block:kv:${k}`), `block ${k}`).toBe(want);
            expect(pinned.has(k), `hook view of block ${k}`).toBe(want > 0);
          }
          const c = table.counters();
          expect(c.acquired).toBe(c.released + c.expired + c.active);
          expect(c.blocksAcquired).toBe(c.blocksReleased + c.blocksExpired + c.activeBlocks);
          expect(c.pinnedBlocks).toBe(pinned.size);
          expect(problems).toEqual([]);
        }
      }),
      { numRuns: 300 },
    );
  });

  it('refuses bad input with the status and the entry; ids inside a numbered space are refused so each block has one name', () => {
    const table = new LeaseTable({ holderId: 'h', lockTimeoutMs: 1000, maxBlocksPerSession: 8, spaces: { kv: { count: 100 } } });
    const acquire = (blocks: unknown): string => statusOf(() => table.acquire('r', blocks as readonly string[]));
    expect(acquire({ owner: 'kv', numbers: new Uint32Array(0) })).toBe('INVALID_ARGUMENT: block list is empty');
    expect(acquire({ owner: 'kv', numbers: [1, 2] })).toMatch(/^INVALID_ARGUMENT: blocks must be a list of block ids or \{ owner, numbers: Uint32Array \}/);
    expect(acquire(null)).toMatch(/^INVALID_ARGUMENT: blocks must be/);
    expect(acquire({ owner: 'nope', numbers: Uint32Array.of(1) })).toBe('NOT_FOUND: no numbered blocks of owner nope on this holder');
    expect(acquire({ owner: 'bad:owner', numbers: Uint32Array.of(1) })).toMatch(/^INVALID_ARGUMENT: block owner: /);
    expect(acquire({ owner: 'kv', numbers: Uint32Array.of(3, 100, 5) })).toMatch(/^NOT_FOUND: no block block:kv:100 on this holder \(blocks\[1\]; the space has 100 blocks\)/);
    expect(acquire({ owner: 'kv', numbers: Uint32Array.of(3, 0xffffffff) })).toMatch(/^NOT_FOUND: no block block:kv:4294967295 .*blocks\[1\]/);
    expect(acquire({ owner: 'kv', numbers: Uint32Array.of(3, 4, 3) })).toBe('INVALID_ARGUMENT: block block:kv:3 appears twice (blocks[2])');
    expect(acquire({ owner: 'kv', numbers: new Uint32Array(9) })).toMatch(/^RESOURCE_EXHAUSTED: 9 blocks requested/);
    expect(acquire(['block:other:1', 'block:kv:7'])).toBe('INVALID_ARGUMENT: block id block:kv:7 is in numbered space kv: acquire its blocks by number');
    expect(acquire(['block:kvx:7'])).toBe('ok'); // another owner that only starts like it
    const c = table.counters();
    expect(c.rejected).toBe(10);
    expect(c.pinnedBlocks).toBe(1);
    expect(table.pinCount('block:kv:3')).toBe(0);
    for (const count of [0, 1.5, 2 ** 28 + 1, Number.NaN]) {
      expect(statusOf(() => new LeaseTable({ holderId: 'h', lockTimeoutMs: 1000, spaces: { kv: { count } } }))).toMatch(/^INVALID_ARGUMENT: spaces\.kv\.count must be an integer from 1 to 2\^28/);
    }
    expect(statusOf(() => new LeaseTable({ holderId: 'h', lockTimeoutMs: 1000, spaces: { 'a:b': { count: 1 } } }))).toMatch(/^INVALID_ARGUMENT: spaces: owner "a:b"/);
  });

  it("keeps its own copy of the numbers, formats the ids only when asked, and hands the space's unpin hook each freed block once", () => {
    const freed: number[][] = [];
    const table = new LeaseTable({ holderId: 'h', lockTimeoutMs: 1000, spaces: { kv: { count: 10, unpin: (ns) => freed.push([...ns]) } } });
    const numbers = Uint32Array.of(4, 1, 9);
    const a = table.acquire('r', { owner: 'kv', numbers });
    const b = table.acquire('r', { owner: 'kv', numbers: Uint32Array.of(9, 2) });
    numbers[0] = 7; // the caller's array changes after the acquire: the lease does not
    expect([...(a.blocks?.numbers ?? [])]).toEqual([4, 1, 9]);
    expect(a.blockCount).toBe(3);
    expect(a.blockIds).toEqual(['block:kv:4', 'block:kv:1', 'block:kv:9']);
    expect(a.blockIds).toBe(a.blockIds); // formatted once
    expect(Object.isFrozen(a.blockIds)).toBe(true);
    expect(table.pinCount('block:kv:9')).toBe(2);
    expect(table.pinCount('block:kv:09')).toBe(0); // not the id of block 9
    expect(table.release('r', { sessionId: a.sessionId })).toBe(3);
    expect(freed).toEqual([[4, 1]]); // 9 is still held by b
    expect(table.release('r', { sessionId: b.sessionId })).toBe(2);
    expect(freed).toEqual([[4, 1], [9, 2]]);
    expect(table.counters().pinnedBlocks).toBe(0);
  });
});

/** A TCP transport that remembers the indices of each block grant it is asked for. */
class Spy extends TcpTransport {
  readonly forms: string[] = [];
  override grant(spec: GrantRanges): TransportRegistration {
    this.forms.push(spec.blocks === undefined ? 'ranges' : `blocks base ${spec.blocks.base} × ${spec.blocks.blockBytes}: ${[...spec.blocks.indices].join(',')}`);
    return super.grant(spec);
  }
}

describe('numbered block spaces: leased and fetched over gRPC', () => {
  const BLOCK = 4096;

  async function holder(spaces: (reg: Awaited<ReturnType<TransferEngine['register']>>) => Parameters<typeof engineGrants>[0]['spaces']) {
    const spy = new Spy();
    const region = new Uint8Array(64 * BLOCK).map((_, i) => (i * 131 + (i >> 12)) & 255);
    const engine = new TransferEngine({ nodeId: 'holder', transports: [spy], logger: silentLogger });
    const registration = await engine.register({ kind: 'host', buffer: region });
    const grants = engineGrants({ engine, spaces: spaces(registration) });
    const server = new LockServer({ holderId: 'holder', lockTimeoutMs: 30_000, ...grants.lockServerOptions, logger: silentLogger });
    const address = `127.0.0.1:${await server.listen('127.0.0.1:0')}`;
    return { spy, region, engine, registration, grants, server, address };
  }

  it('a fetch by number reads block n of the grid into destination i, as one block grant of the numbers as given; release revokes it', async () => {
    const h = await holder((registration) => ({ kv: { registration, blockBytes: BLOCK, base: 3 * BLOCK, count: 60 } }));
    const engine = new TransferEngine({ nodeId: 'req', transports: [new TcpTransport()], logger: silentLogger });
    const dst = new Uint8Array(8 * BLOCK);
    const local = await engine.register({ kind: 'host', buffer: dst });
    for (const session of [true, false]) {
      const client = new LockClient({ requesterId: 'req', session, logger: silentLogger });
      try {
        const numbers = Uint32Array.of(59, 0, 17, 3, 40, 41, 8, 2);
        const destinations = Array.from({ length: 8 }, (_, i) => ({ local, offset: i * BLOCK, length: BLOCK }));
        dst.fill(0);
        const f = await client.fetch(engine, h.address, { owner: 'kv', numbers }, destinations, { timeoutMs: 10_000 });
        expect(h.spy.forms.at(-1)).toBe(`blocks base ${3 * BLOCK} × ${BLOCK}: 59,0,17,3,40,41,8,2`);
        for (const [i, n] of numbers.entries()) {
          const at = (3 + n) * BLOCK;
          expect(Buffer.compare(dst.subarray(i * BLOCK, (i + 1) * BLOCK), h.region.subarray(at, at + BLOCK)), `block ${n}`).toBe(0);
        }
        expect(f.lease.blockCount).toBe(8);
        expect([...(f.lease.blocks?.numbers ?? [])]).toEqual([...numbers]);
        expect(f.lease.blockIds[0]).toBe('block:kv:59');
        expect(h.server.table.pinCount('block:kv:17')).toBe(1);
        await f.release();
        expect(h.server.table.pinCount('block:kv:17')).toBe(0);
      } finally {
        await client.close();
      }
    }
    await h.grants.settled();
    expect(h.grants.counters()).toEqual({ issued: 2, revoked: 2, live: 0, failed: 0 });
    const c = h.server.table.counters();
    expect(c.acquired).toBe(c.released + c.expired + c.active);
    expect(c.active).toBe(0);
    await h.server.close({ graceMs: 0 });
    await engine.close();
    await h.engine.close();
  });

  it('bad numbered acquires are typed errors on the requester; nothing is pinned or granted', async () => {
    const h = await holder((registration) => ({ kv: { registration, blockBytes: BLOCK } }));
    const client = new LockClient({ requesterId: 'req', logger: silentLogger });
    try {
      const err = async (blocks: unknown): Promise<unknown> => client.acquire(h.address, blocks as readonly string[], { timeoutMs: 5000 }).then(() => 'granted', (e: unknown) => e);
      const past = await err({ owner: 'kv', numbers: Uint32Array.of(1, 64) });
      expect(past).toBeInstanceOf(RemoteRejectedError);
      expect((past as Error).message).toMatch(/no block block:kv:64 on this holder \(blocks\[1\]; the space has 64 blocks\)/);
      const twice = await err({ owner: 'kv', numbers: Uint32Array.of(5, 5) });
      expect(twice).toBeInstanceOf(InvalidInputError);
      expect((twice as Error).message).toMatch(/block:kv:5 appears twice/);
      expect(await err({ owner: 'other', numbers: Uint32Array.of(1) })).toBeInstanceOf(RemoteRejectedError);
      // Checked before anything is sent.
      for (const bad of [{ owner: 'kv', numbers: [1] }, { owner: 'k:v', numbers: Uint32Array.of(1) }, { owner: 'kv', numbers: new Uint32Array(0) }, 'block:kv:1']) {
        const e = await err(bad);
        expect(e, JSON.stringify(bad)).toBeInstanceOf(InvalidInputError);
      }
      // Ids and numbers in one request (a raw message: the client never sends both).
      const { Client } = loadLockProtocol();
      const raw = new Client(h.address, grpc.credentials.createInsecure());
      const both = await new Promise<{ code?: number; details?: string }>((resolve) =>
        raw.Acquire({ requesterId: 'req', blockIds: ['block:x:1'], blockOwner: 'kv', blockNumbers: [1], leaseMs: 0, acquireId: '' }, new grpc.Metadata(), {}, (e) => resolve(e ?? {})),
      );
      raw.close();
      expect(both.details).toBe('give block ids or block numbers, not both');
      expect(h.server.table.counters().pinnedBlocks).toBe(0);
      expect(h.grants.counters()).toEqual({ issued: 0, revoked: 0, live: 0, failed: 0 });
      expect(h.spy.forms).toEqual([]);
    } finally {
      await client.close();
      await h.server.close({ graceMs: 0 });
      await h.engine.close();
    }
  });

  it('engineGrants refuses a space that is not a grid inside its registration', async () => {
    const engine = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
    const registration = await engine.register({ kind: 'host', buffer: new Uint8Array(10 * BLOCK) });
    const bad = (space: object, owner = 'kv'): unknown => {
      try {
        engineGrants({ engine, spaces: { [owner]: space as never } });
        return 'made';
      } catch (e) {
        return e instanceof InvalidInputError ? `${String(e.details['field'])}: ${e.message}` : e;
      }
    };
    expect(bad({ registration: {}, blockBytes: BLOCK })).toMatch(/^spaces\.kv: .*registration must be a Registration/);
    expect(bad({ registration, blockBytes: 0 })).toMatch(/blockBytes must be a positive integer, got 0/);
    expect(bad({ registration, blockBytes: BLOCK, base: 10 * BLOCK })).toMatch(/base must be an integer offset inside the registration/);
    expect(bad({ registration, blockBytes: BLOCK, base: 1, count: 10 })).toMatch(/10 blocks of 4096 bytes from offset 1 do not fit/);
    expect(bad({ registration, blockBytes: BLOCK, count: 2 ** 28 + 1 })).toMatch(/count must be an integer from 1 to 2\^28/);
    expect(bad({ registration, blockBytes: BLOCK }, 'a:b')).toMatch(/the owner "a:b"/);
    expect(bad({ registration, blockBytes: BLOCK, base: 1 })).toBe('made'); // 9 whole blocks from offset 1
    const g = engineGrants({ engine, spaces: { kv: { registration, blockBytes: BLOCK, base: 1 } } });
    expect(g.lockServerOptions.spaces).toEqual({ kv: { count: 9 } });
    await engine.close();
  });

  it("the lock server's resolver for a lease by number never formats its ids; resolve and resolveLease are exclusive", async () => {
    const engine = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
    const registration = await engine.register({ kind: 'host', buffer: new Uint8Array(10 * BLOCK) });
    const g = engineGrants({ engine, spaces: { kv: { registration, blockBytes: BLOCK } } });
    const lease = {
      sessionId: 'session:h:x',
      requesterId: 'r',
      get blockIds(): readonly string[] {
        throw new Error('formatted the ids of a lease by number');
      },
      blockCount: 2,
      blocks: { owner: 'kv', numbers: Uint32Array.of(9, 4) },
      acquireId: undefined,
      acquiredAt: 0,
      deadline: 1e15,
      leaseMs: 1000,
      live: true,
    };
    const resolved = await g.lockServerOptions.resolveLease(lease);
    expect((resolved as { lease: readonly Uint8Array[] }).lease).toHaveLength(1);
    g.revoke(lease, 'released');
    await g.settled();
    expect(g.counters()).toEqual({ issued: 1, revoked: 1, live: 0, failed: 0 });
    expect(() => new LockServer({ holderId: 'h', lockTimeoutMs: 1000, resolve: () => [], resolveLease: () => [] })).toThrow(/give resolve or resolveLease, not both/);
    await engine.close();
  });
});
