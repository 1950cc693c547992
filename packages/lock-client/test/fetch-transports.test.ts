/**
 * The transports an acquire names (`AcquireOptions.transports`, `AcquireRequest.transports`):
 * a holder serving with engineGrants grants the lease over those of them that can grant its
 * blocks, and over nothing else; client.fetch names, after its first fetch from a holder, the
 * transport its engine read that holder's blocks through. Real engines (the Unix-socket and TCP
 * transports) and a real lock service on loopback.
 */
import * as grpc from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import {
  InvalidInputError,
  ResourceExhaustedError,
  TcpTransport,
  TimedOutError,
  TransferEngine,
  UdsTransport,
  decodeDescriptor,
  decodeEndpoint,
  encodeEndpoint,
  silentLogger,
  type MemoryDescriptor,
  type Registration,
  type Transport,
  type TransportRegistration,
} from '@tensorwire/core';
import { LockClient, decodeFetchDescriptor, type FetchDestination, type FetchGuard, type LockGuard } from '../src/index.js';
import type { AcquireResponseMsg, LockServiceClient } from '../src/proto.js';
import { MAX_ACQUIRE_TRANSPORTS, engineGrants, loadLockProtocol } from '../src/server/index.js';
import { fetchRequester, namingEndpoint, serveFetchHolder, waitFor, type FetchHolder, type FetchRequester } from './helpers.js';

const BLOCK = 4096;
const BLOCKS = 64;

/** A Unix-socket transport whose range grants always fail (a full grant table). */
class FullUds extends UdsTransport {
  override grant(): TransportRegistration {
    throw new ResourceExhaustedError('grant table full');
  }
}

interface Holder extends FetchHolder {
  /** The transports each acquire named, as the resolver got them. */
  named: string[][];
  /** 'tcp': lease descriptors name the holder's engine with its TCP transport only (as after a restart without the other). */
  advertise: 'all' | 'tcp';
  /** Each lease is granted this many ms after its acquire reaches the resolver (0: at once). */
  delayMs: number;
}

async function holder(options: { transports?: () => Transport[]; register?: readonly string[]; policy?: readonly string[] } = {}): Promise<Holder> {
  const engine = new TransferEngine({ nodeId: 'holder', transports: options.transports?.() ?? [new UdsTransport(), new TcpTransport()], logger: silentLogger });
  const region = new Uint8Array(BLOCKS * BLOCK).map((_, i) => (i * 131 + (i >> 12)) & 255);
  const registration = await engine.register({ kind: 'host', buffer: region }, options.register ? { transports: options.register } : {});
  const grants = engineGrants({ engine, spaces: { arena: { registration, blockBytes: BLOCK } }, ...(options.policy ? { transports: options.policy } : {}) });
  const named: string[][] = [];
  const self: { h?: Holder } = {};
  const resolveLease = namingEndpoint(grants.lockServerOptions.resolveLease, () => {
    if (self.h?.advertise !== 'tcp') return undefined;
    const ep = decodeEndpoint(engine.endpoint());
    return encodeEndpoint({ identity: ep.identity, transports: new Map([['tcp', ep.transports.get('tcp') as Uint8Array]]) });
  });
  const served = await serveFetchHolder(engine, region, grants, {
    resolveLease: async (lease, hints) => {
      named.push([...hints.transports]);
      if ((self.h?.delayMs ?? 0) > 0) await new Promise((r) => setTimeout(r, self.h?.delayMs));
      return resolveLease(lease, hints);
    },
  });
  self.h = Object.assign(served, { named, advertise: 'all' as 'all' | 'tcp', delayMs: 0 });
  return self.h;
}

function requester(): Promise<FetchRequester> {
  return fetchRequester({ blocks: BLOCKS, blockBytes: BLOCK, transports: () => [new UdsTransport(), new TcpTransport()] });
}

/** The grant descriptor a lease came with. */
function grantOf(lease: LockGuard): MemoryDescriptor {
  return decodeDescriptor(decodeFetchDescriptor(lease.leaseDescriptors[0] as Uint8Array).grant);
}

/** The transports a lease was granted over (its grant descriptor's), sorted. */
function granted(lease: LockGuard): string[] {
  return [...grantOf(lease).transports.keys()].sort();
}

/** Block i of a fetch into block i of `local`. */
function destinationsIn(local: Registration, n: number): FetchDestination[] {
  return Array.from({ length: n }, (_, i) => ({ local, offset: i * BLOCK, length: BLOCK }));
}

const numbers = (from: number, n: number): { owner: string; numbers: Uint32Array } => ({ owner: 'arena', numbers: Uint32Array.from({ length: n }, (_, i) => from + i) });

/** Block `from + i` of the holder is in destination i. */
function landed(h: Holder, r: { dst: Uint8Array }, from: number, n: number): void {
  for (let i = 0; i < n; i++) {
    const at = (from + i) * BLOCK;
    expect(Buffer.compare(r.dst.subarray(i * BLOCK, (i + 1) * BLOCK), h.region.subarray(at, at + BLOCK))).toBe(0);
  }
}

/** Every lease released and every grant revoked; `grants`: how many were issued (when the test knows). */
async function allReleased(h: Holder, grants?: number): Promise<void> {
  await waitFor(() => h.server.counters().active === 0, 'leases released');
  await h.grants.settled();
  const issued = grants ?? h.grants.counters().issued;
  expect(h.grants.counters()).toMatchObject({ issued, revoked: issued, live: 0, failed: 0 });
  const c = h.server.counters();
  expect(c.acquired).toBe(c.released + c.expired + c.active);
}

describe('fetch: the transports its acquire names', () => {
  it('after its first fetch from a holder, client.fetch names the transport it read through: later leases are granted over that one alone', async () => {
    const h = await holder();
    const r = await requester();
    try {
      const destinations = destinationsIn(r.local, 8);
      const leases: string[][] = [];
      for (let k = 0; k < 3; k++) {
        r.dst.fill(0);
        const f: FetchGuard = await r.client.fetch(r.engine, h.address, numbers(8 * k, 8), destinations);
        expect(f.transport).toBe('uds');
        leases.push(granted(f.lease));
        landed(h, r, 8 * k, 8);
        await f.release();
      }
      expect(h.named).toEqual([[], ['uds'], ['uds']]);
      expect(leases).toEqual([['tcp', 'uds'], ['uds'], ['uds']]);

      // A name the caller gives is sent as it is, and nothing is learned from it: here one the
      // engine does not read through, so the read finds no grant for its transport (InvalidInputError)
      // and the lease is released.
      const err = await r.client.fetch(r.engine, h.address, numbers(0, 8), destinations, { transports: ['tcp'] }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(InvalidInputError);
      expect((err as InvalidInputError).message).toMatch(/has no uds grant/);
      const f = await r.client.fetch(r.engine, h.address, numbers(0, 8), destinations);
      expect(granted(f.lease)).toEqual(['uds']);
      await f.release();
      expect(h.named).toEqual([[], ['uds'], ['uds'], ['tcp'], ['uds']]);
      await allReleased(h, 5);
    } finally {
      await r.close();
      await h.close();
    }
  });

  it("a name gone stale (the engine now reads the holder through another transport): the fetch is made once more with the holder's usual grant, and the next names the new one", async () => {
    const h = await holder();
    const r = await requester();
    try {
      const destinations = destinationsIn(r.local, 4);
      const first = await r.client.fetch(r.engine, h.address, numbers(0, 4), destinations);
      expect(first.transport).toBe('uds');
      await first.release();
      // The holder's lease descriptors now name its engine with TCP only: the requester's engine
      // reads through TCP, and the lease acquired naming 'uds' has no TCP grant.
      h.advertise = 'tcp';
      r.dst.fill(0);
      const second = await r.client.fetch(r.engine, h.address, numbers(4, 4), destinations);
      expect(second.transport).toBe('tcp');
      expect(granted(second.lease)).toEqual(['tcp', 'uds']);
      landed(h, r, 4, 4);
      await second.release();
      const third = await r.client.fetch(r.engine, h.address, numbers(8, 4), destinations);
      expect(granted(third.lease)).toEqual(['tcp']);
      landed(h, r, 8, 4);
      await third.release();
      expect(h.named).toEqual([[], ['uds'], [], ['tcp']]);
      // Four leases: the stale one released when its read was refused.
      expect(h.server.counters().acquired).toBe(4);
      await allReleased(h, 4);
    } finally {
      await r.close();
      await h.close();
    }
  });

  it("the fetch made once more gets what is left of its timeoutMs, not a fresh one: TimedOutError when its acquire would need more, and every lease released", async () => {
    const h = await holder();
    const r = await requester();
    try {
      const destinations = destinationsIn(r.local, 4);
      await (await r.client.fetch(r.engine, h.address, numbers(0, 4), destinations)).release();
      h.advertise = 'tcp';
      // Each grant now takes 1 s: the first try's acquire uses 1 s of the fetch's 1.5 s, its read
      // is refused (no TCP grant), and the second try's acquire has under 0.5 s left.
      h.delayMs = 1000;
      const failed = await r.client.fetch(r.engine, h.address, numbers(4, 4), destinations, { timeoutMs: 1500 }).catch((e: unknown) => e);
      expect(failed).toBeInstanceOf(TimedOutError);
      expect(h.named).toEqual([[], ['uds'], []]);
      // With time enough, the same fetch succeeds through TCP.
      r.dst.fill(0);
      const ok = await r.client.fetch(r.engine, h.address, numbers(4, 4), destinations, { timeoutMs: 5_000 });
      expect(ok.transport).toBe('tcp');
      landed(h, r, 4, 4);
      await ok.release();
      // The timed-out acquire's lease ended at the holder (the client released it by its acquire
      // id) while the holder's resolver still waited, before it asked engineGrants for the
      // grant: no grant is left live for it.
      await allReleased(h);
    } finally {
      await r.close();
      await h.close();
    }
  });

  it('the name is learned per engine: one client fetching from one holder through two engines makes one acquire per fetch, each lease granted over its engine\'s transport', async () => {
    const h = await holder();
    const r = await requester();
    // Only its engine and destination: the fetches go through r's client.
    const t = await fetchRequester({ name: 'req-tcp', blocks: 4, blockBytes: BLOCK });
    try {
      const viaBoth = destinationsIn(r.local, 4);
      const viaTcp = destinationsIn(t.local, 4);
      const seen: string[] = [];
      for (let k = 0; k < 3; k++) {
        const a = await r.client.fetch(r.engine, h.address, numbers(0, 4), viaBoth);
        const b = await r.client.fetch(t.engine, h.address, numbers(4, 4), viaTcp);
        seen.push(`${a.transport}:${granted(a.lease).join('+')}`, `${b.transport}:${granted(b.lease).join('+')}`);
        expect(Buffer.compare(t.dst, h.region.subarray(4 * BLOCK, 8 * BLOCK))).toBe(0);
        await a.release();
        await b.release();
      }
      expect(seen).toEqual(['uds:tcp+uds', 'tcp:tcp+uds', 'uds:uds', 'tcp:tcp', 'uds:uds', 'tcp:tcp']);
      expect(h.server.counters().acquired).toBe(6);
      await allReleased(h, 6);
    } finally {
      await t.close();
      await r.close();
      await h.close();
    }
  });

  it("a lease granted over one transport is readable through it alone: its grant under another transport's name is refused there, while a lease granted over both reads through either", async () => {
    const h = await holder();
    const t = await fetchRequester({ name: 'req-tcp', blocks: 2, blockBytes: BLOCK });
    try {
      const { client, dst } = t;
      const read = (lease: LockGuard, transports: Map<string, Uint8Array>): Promise<unknown> => {
        const remote = { ...grantOf(lease), transports };
        const { endpoint } = decodeFetchDescriptor(lease.leaseDescriptors[0] as Uint8Array);
        return t.engine.read(endpoint, [0, 1].map((i) => ({ local: t.local, localOffset: i * BLOCK, remote, range: i, length: BLOCK })));
      };
      const both = await client.acquire(h.address, numbers(2, 2));
      const bothGrant = grantOf(both);
      await read(both, new Map([['tcp', bothGrant.transports.get('tcp') as Uint8Array]]));
      expect(Buffer.compare(dst, h.region.subarray(2 * BLOCK, 4 * BLOCK))).toBe(0);
      // The same lease's Unix-socket grant is no TCP grant.
      await expect(read(both, new Map([['tcp', bothGrant.transports.get('uds') as Uint8Array]]))).rejects.toMatchObject({ name: 'RemoteRejectedError' });

      const udsOnly = await client.acquire(h.address, numbers(2, 2), { transports: ['uds'] });
      expect(granted(udsOnly)).toEqual(['uds']);
      const udsGrant = grantOf(udsOnly);
      dst.fill(0);
      await expect(read(udsOnly, new Map([['tcp', udsGrant.transports.get('uds') as Uint8Array]]))).rejects.toMatchObject({ name: 'RemoteRejectedError' });
      expect(dst.every((b) => b === 0)).toBe(true);
      await udsOnly.release();
      await both.release();
      await allReleased(h, 2);
    } finally {
      await t.close();
      await h.close();
    }
  });

  it('the holder grants over the named transports that can grant the blocks, never more: unknown names, names its policy leaves out and names without a handle for the blocks are dropped; with none left, or when their grant fails, it grants its usual set', async () => {
    const acquireAndSee = async (h: Holder, client: LockClient, transports: readonly string[]): Promise<string[]> => {
      const g = await client.acquire(h.address, numbers(0, 2), { transports });
      const out = granted(g);
      await g.release();
      return out;
    };
    const client = new LockClient({ requesterId: 'req', logger: silentLogger });
    const plain = await holder();
    const tcpRegistered = await holder({ register: ['tcp'] });
    const tcpPolicy = await holder({ policy: ['tcp'] });
    const full = await holder({ transports: () => [new FullUds(), new TcpTransport()] });
    try {
      expect(await acquireAndSee(plain, client, ['tcp'])).toEqual(['tcp']);
      expect(await acquireAndSee(plain, client, ['uds'])).toEqual(['uds']);
      expect(await acquireAndSee(plain, client, ['rdma', 'uds'])).toEqual(['uds']);
      expect(await acquireAndSee(plain, client, ['uds', 'tcp'])).toEqual(['tcp', 'uds']);
      expect(await acquireAndSee(plain, client, ['rdma'])).toEqual(['tcp', 'uds']);
      expect(await acquireAndSee(plain, client, [])).toEqual(['tcp', 'uds']);
      // The region is registered with TCP only: the Unix-socket transport cannot grant it.
      expect(await acquireAndSee(tcpRegistered, client, ['uds'])).toEqual(['tcp']);
      // The holder's policy (engineGrants({ transports })) bounds what a name can ask for.
      expect(await acquireAndSee(tcpPolicy, client, ['uds'])).toEqual(['tcp']);
      expect(await acquireAndSee(tcpPolicy, client, ['tcp'])).toEqual(['tcp']);
      // The named transport's grant fails: the usual set (the ones that can) grants the lease.
      expect(await acquireAndSee(full, client, ['uds'])).toEqual(['tcp']);
      for (const [h, n] of [
        [plain, 6],
        [tcpRegistered, 1],
        [tcpPolicy, 2],
        [full, 1],
      ] as const) {
        await allReleased(h, n);
      }
    } finally {
      await client.close();
      for (const h of [plain, tcpRegistered, tcpPolicy, full]) await h.close();
    }
  });

  it('names that are not transport names are refused before anything is sent (InvalidInputError); a raw request carrying them is INVALID_ARGUMENT', async () => {
    const h = await holder();
    const client = new LockClient({ requesterId: 'req', logger: silentLogger });
    try {
      const tooMany = Array.from({ length: MAX_ACQUIRE_TRANSPORTS + 1 }, (_, i) => `t${i}`);
      for (const transports of [tooMany, ['a b'], [''], ['x'.repeat(65)], ['tcp', 'tcp'], 'tcp' as unknown as string[], [7 as unknown as string]]) {
        const err = await client.acquire(h.address, numbers(0, 1), { transports }).catch((e: unknown) => e);
        expect(err).toBeInstanceOf(InvalidInputError);
        expect((err as InvalidInputError).details['field']).toBe('transports');
      }
      expect(await client.acquire(h.address, numbers(0, 1), { transports: Array.from({ length: MAX_ACQUIRE_TRANSPORTS }, (_, i) => `t${i}`) }).then((g) => g.release())).toMatchObject({ confirmed: true, blocksReleased: 1 });
      expect(h.server.counters().acquired).toBe(1);

      const { Client } = loadLockProtocol();
      const raw: LockServiceClient = new Client(h.address, grpc.credentials.createInsecure());
      try {
        for (const transports of [tooMany, ['a b'], ['tcp', 'tcp']]) {
          const code = await new Promise<number>((resolve) => {
            raw.Acquire({ requesterId: 'raw', blockIds: [], blockOwner: 'arena', blockNumbers: [0], leaseMs: 0, acquireId: '', transports }, new grpc.Metadata(), {}, (e: grpc.ServiceError | null, res?: AcquireResponseMsg) => {
              resolve(e ? e.code : res ? grpc.status.OK : -1);
            });
          });
          expect(code).toBe(grpc.status.INVALID_ARGUMENT);
        }
      } finally {
        raw.close();
      }
      expect(h.server.counters().acquired).toBe(1);
      await allReleased(h, 1);
    } finally {
      await client.close();
      await h.close();
    }
  });
});
