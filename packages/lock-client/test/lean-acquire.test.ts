/**
 * The per-block costs of a lease, cut without changing what a lease means:
 *
 * - `omit_empty_blocks`: a requester that sets it gets an AcquireResponse that lists only the
 *   blocks with descriptors (a lease covered by one range grant answers with no per-block
 *   entries); a requester that does not set it (an older one) still gets every block, and the
 *   guard's `descriptors` is the same map either way.
 * - The AcquireRequest encoder's ASCII path writes what protobufjs would decode to the same
 *   message, and falls back to protobufjs for anything else.
 * - The lease table keeps what the `pin` hook returned with the pin and hands it to every lease
 *   that takes the block (`pinValues`); engineGrants grants from it without looking up again,
 *   and from a lookup when another pin hook kept something else.
 */
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import { TcpTransport, TransferEngine, decodeDescriptor, silentLogger, type GrantRange } from '@tensorwire/core';
import fc from 'fast-check';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient, decodeFetchDescriptor } from '../src/index.js';
import type { AcquireResponseMsg, LockServiceClient } from '../src/proto.js';
import { LOCK_PROTO_PATH, LeaseError, LockServer, engineGrants, loadLockProtocol } from '../src/server/index.js';
import { bindLoopback, harness, table, type Harness } from './helpers.js';

let h: Harness | undefined;
afterEach(async () => {
  await h?.close();
  h = undefined;
});

function acquireRaw(holder: string, omitEmptyBlocks: boolean | undefined, blockIds: string[]): Promise<AcquireResponseMsg> {
  const { Client } = loadLockProtocol();
  const raw: LockServiceClient = new Client(holder, grpc.credentials.createInsecure());
  return new Promise<AcquireResponseMsg>((resolve, reject) => {
    const req = { requesterId: 'raw', blockIds, leaseMs: 0, acquireId: '', ...(omitEmptyBlocks === undefined ? {} : { omitEmptyBlocks }) };
    raw.Acquire(req, new grpc.Metadata(), {}, (e, r) => {
      raw.close();
      if (e || r === undefined) reject(e ?? new Error('no response'));
      else resolve(r);
    });
  });
}

describe('omit_empty_blocks', () => {
  it('lists only blocks with descriptors for a requester that asks; every block for one that does not', async () => {
    // Descriptors for odd blocks only, one lease descriptor for all.
    h = await harness({
      resolve: (ids) => ({ lease: [Buffer.from('grant')], blocks: ids.map((id) => (Number(id.split(':')[2]) % 2 === 1 ? [Buffer.from(`d${id}`)] : [])) }),
    });
    const ids = Array.from({ length: 6 }, (_, i) => `block:holder1:${i}`);
    const lean = await acquireRaw(h.holder, true, ids);
    expect(lean.blocks.map((b) => b.blockId)).toEqual(['block:holder1:1', 'block:holder1:3', 'block:holder1:5']);
    expect((lean.leaseDescriptors ?? []).map((d) => Buffer.from(d).toString())).toEqual(['grant']);
    const full = await acquireRaw(h.holder, undefined, ids.map((id) => id.replace('holder1:', 'holder1:1')));
    expect(full.blocks).toHaveLength(6);
    expect(full.blocks.filter((b) => b.descriptors.length > 0)).toHaveLength(3);

    // The guard reads the same either way: every block, empty lists for those left out.
    await using g = await h.client.acquire(h.holder, ids.map((id) => id.replace('holder1:', 'holder1:2')));
    expect([...g.descriptors.keys()]).toEqual(ids.map((id) => id.replace('holder1:', 'holder1:2')));
    for (const [id, ds] of g.descriptors) {
      const n = Number(id.split(':')[2]);
      expect(ds.map((d) => Buffer.from(d).toString())).toEqual(n % 2 === 1 ? [`d${id}`] : []);
      expect(g.descriptorsFor(id)).toBe(ds);
    }
    expect(g.descriptorsFor('block:holder1:999')).toEqual([]);
    expect(h.server.counters()).toMatchObject({ acquired: 3, active: 3 });
  });

  it('a lease whose resolver gives only lease descriptors answers with no per-block entries', async () => {
    h = await harness({ resolve: () => ({ lease: [Buffer.from('g')] }) });
    const ids = Array.from({ length: 1000 }, (_, i) => `block:holder1:${i}`);
    const lean = await acquireRaw(h.holder, true, ids);
    expect(lean.blocks).toEqual([]);
    const full = await acquireRaw(h.holder, false, ids.map((id) => `${id}x`));
    expect(full.blocks.map((b) => b.blockId)).toEqual(ids.map((id) => `${id}x`));
    await using g = await h.client.acquire(h.holder, ids.map((id) => `${id}y`));
    expect(g.descriptorsFor('block:holder1:7y')).toEqual([]);
    expect(g.descriptors.size).toBe(1000);
    expect(g.leaseDescriptors.map((d) => Buffer.from(d).toString())).toEqual(['g']);
  });

  it('a holder that ignores the field (every block listed) is read the same', async () => {
    // A holder of the version before the field: same proto without field 5, so it never sees it.
    const server = new LockServer({ holderId: 'holder1', lockTimeoutMs: 30_000, resolve: (ids) => ids.map((id) => (id.endsWith(':1') ? Buffer.from('one') : [])) });
    const old = new grpc.Server();
    const handlers = server.handlers();
    const acquire = handlers['Acquire'] as grpc.handleUnaryCall<{ omitEmptyBlocks?: boolean }, unknown>;
    old.addService(loadLockProtocol().service, {
      ...handlers,
      Acquire: (call: grpc.ServerUnaryCall<{ omitEmptyBlocks?: boolean }, unknown>, cb: grpc.sendUnaryData<unknown>) => {
        call.request.omitEmptyBlocks = false;
        acquire(call, cb);
      },
    });
    const port = await bindLoopback(old);
    const client = new LockClient({ requesterId: 'req1', logger: silentLogger });
    try {
      const g = await client.acquire(`127.0.0.1:${port}`, ['block:holder1:0', 'block:holder1:1', 'block:holder1:2']);
      expect([...g.descriptors.keys()]).toEqual(['block:holder1:0', 'block:holder1:1', 'block:holder1:2']);
      expect(g.descriptorsFor('block:holder1:1').map((d) => Buffer.from(d).toString())).toEqual(['one']);
      expect(g.descriptorsFor('block:holder1:0')).toEqual([]);
      expect((await g.release()).confirmed).toBe(true);
      expect(server.counters()).toMatchObject({ acquired: 1, released: 1, active: 0 });
    } finally {
      await client.close();
      await new Promise<void>((resolve) => old.tryShutdown(() => resolve()));
      await server.close({ graceMs: 0 });
    }
  });
});

describe('AcquireRequest encoder', () => {
  const reference = protoLoader.loadSync(LOCK_PROTO_PATH, { keepCase: false, longs: Number, enums: String, bytes: Buffer, defaults: true, arrays: true, oneofs: false });
  const ref = (reference['tensorwire.lock.v1.LockService'] as unknown as grpc.ServiceDefinition)['Acquire'] as grpc.MethodDefinition<unknown, unknown>;
  const ours = loadLockProtocol().service['Acquire'] as grpc.MethodDefinition<unknown, unknown>;
  const ascii = fc.string({ unit: fc.integer({ min: 0, max: 0x7f }).map((c) => String.fromCharCode(c)), maxLength: 140 });
  const any = fc.oneof(ascii, fc.string({ unit: 'binary', maxLength: 20 }), fc.string({ maxLength: 130 }));

  it('decodes, with the reference decoder, to the message it was given: ASCII ids of every length around 127/128, and anything else', () => {
    fc.assert(
      fc.property(
        fc.record({ requesterId: any, blockIds: fc.array(fc.oneof(ascii, ascii, any), { maxLength: 40 }), leaseMs: fc.oneof(fc.constant(0), fc.integer({ min: 0, max: 0xffffffff })), acquireId: any }),
        fc.option(fc.boolean(), { nil: undefined }),
        (m, omit) => {
          const msg = omit === undefined ? m : { ...m, omitEmptyBlocks: omit };
          const decoded = ref.requestDeserialize(ours.requestSerialize(msg)) as Record<string, unknown>;
          expect(decoded).toEqual(ref.requestDeserialize(ref.requestSerialize(msg)));
          expect(decoded['omitEmptyBlocks']).toBe(omit ?? false);
          expect(decoded['blockIds']).toHaveLength(m.blockIds.length);
          // And our decoder agrees with the reference encoder.
          expect(ours.requestDeserialize(ref.requestSerialize(msg))).toEqual(decoded);
        },
      ),
      { numRuns: 400 },
    );
  });

  it('ids at the 1-byte length limit and past it, and a non-ASCII id among ASCII ones', () => {
    for (const ids of [['a'.repeat(127)], ['a'.repeat(128)], ['b'.repeat(127), 'c'.repeat(200), 'd'], ['block:x:1', 'block:x:é', 'block:x:2'], ['\u{1F600}'], ['\ud800'], []]) {
      const m = { requesterId: 'r', blockIds: ids, leaseMs: 30_000, acquireId: 'a', omitEmptyBlocks: true };
      const decoded = ref.requestDeserialize(ours.requestSerialize(m)) as { blockIds: string[] };
      expect(decoded.blockIds).toEqual((ref.requestDeserialize(ref.requestSerialize(m)) as { blockIds: string[] }).blockIds);
      expect(decoded).toEqual(ours.requestDeserialize(ours.requestSerialize(m)));
    }
  });
});

describe('pin values', () => {
  it('the pin hook runs once per pin; its value goes to every lease holding the block, and a fresh pin after the last unpin asks again', () => {
    let calls = 0;
    const unpinned: string[] = [];
    const { t } = table({ pin: (b) => ({ b, n: ++calls }), unpin: (b) => unpinned.push(b) });
    const a = t.acquire('r', ['block:h:1', 'block:h:2']);
    const b = t.acquire('r', ['block:h:2', 'block:h:3']);
    expect(a.pinValues).toEqual([{ b: 'block:h:1', n: 1 }, { b: 'block:h:2', n: 2 }]);
    expect(b.pinValues).toEqual([{ b: 'block:h:2', n: 2 }, { b: 'block:h:3', n: 3 }]);
    expect(b.pinValues?.[0]).toBe(a.pinValues?.[1]);
    t.release('r', { sessionId: a.sessionId });
    expect(unpinned).toEqual(['block:h:1']);
    expect(t.pinCount('block:h:2')).toBe(1);
    t.release('r', { sessionId: b.sessionId });
    expect(unpinned).toEqual(['block:h:1', 'block:h:2', 'block:h:3']);
    const c = t.acquire('r', ['block:h:2']);
    expect(c.pinValues).toEqual([{ b: 'block:h:2', n: 4 }]);
    expect(t.counters()).toMatchObject({ acquired: 3, released: 2, active: 1, pinnedBlocks: 1 });
  });

  it('a refused pin rolls back exactly the pins taken so far, shared ones included', () => {
    const unpinned: string[] = [];
    const { t } = table({
      pin: (b) => {
        if (b === 'block:h:bad') throw new LeaseError('NOT_FOUND', 'no');
        return b;
      },
      unpin: (b) => unpinned.push(b),
    });
    const live = t.acquire('r', ['block:h:1']);
    expect(() => t.acquire('r', ['block:h:1', 'block:h:2', 'block:h:bad', 'block:h:3'])).toThrow(LeaseError);
    expect(unpinned).toEqual(['block:h:2']);
    expect(t.pinCount('block:h:1')).toBe(1);
    expect(t.pinCount('block:h:2')).toBe(0);
    expect(t.pinCount('block:h:3')).toBe(0);
    expect(t.counters()).toMatchObject({ acquired: 1, active: 1, pinnedBlocks: 1 });
    expect(t.get(live.sessionId)?.pinValues).toEqual(['block:h:1']);
  });

  it('engineGrants grants from the pins, and from a lookup when another pin hook kept something else', async () => {
    const engine = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
    const requester = new TransferEngine({ nodeId: 'requester', transports: [new TcpTransport()], logger: silentLogger });
    const region = new Uint8Array(16 * 4096).map((_, i) => (i * 7 + (i >> 12) * 13) & 255);
    const registration = await engine.register({ kind: 'host', buffer: region });
    const dst = new Uint8Array(3 * 4096);
    const local = await requester.register({ kind: 'host', buffer: dst });
    let lookups = 0;
    const blocks = (id: string): GrantRange | undefined => {
      lookups++;
      const i = Number(id.split(':')[2]);
      return i >= 0 && i < 16 ? { registration, offset: ((i * 3) % 16) * 4096, length: 4096 } : undefined;
    };
    try {
      for (const foreignPin of [false, true]) {
        lookups = 0;
        const grants = engineGrants({ engine, blocks });
        const { t } = table({ ...grants.lockServerOptions, ...(foreignPin ? { pin: () => 'something else' } : {}) });
        const lease = t.acquire('r', ['block:h:1', 'block:h:5', 'block:h:2']);
        expect(lookups).toBe(foreignPin ? 0 : 3); // our pins look the blocks up
        const resolved = await grants.resolve(lease.blockIds, lease);
        expect(lookups).toBe(3); // ... and the grant uses them; after a foreign pin it looks them up itself
        const f = decodeFetchDescriptor((resolved as { lease: readonly Uint8Array[] }).lease[0] as Uint8Array);
        const remote = decodeDescriptor(f.grant);
        dst.fill(0);
        await requester.read(f.endpoint, [0, 1, 2].map((i) => ({ local, localOffset: i * 4096, remote, range: i, length: 4096 })));
        for (const [i, b] of [1, 5, 2].entries()) {
          const at = ((b * 3) % 16) * 4096;
          expect(Buffer.compare(dst.subarray(i * 4096, (i + 1) * 4096), region.subarray(at, at + 4096))).toBe(0);
        }
        t.release('r', { sessionId: lease.sessionId });
        grants.revoke(lease, 'released');
        await grants.settled();
        expect(grants.counters()).toEqual({ issued: 1, revoked: 1, live: 0, failed: 0 });
      }
    } finally {
      await requester.close();
      await engine.close();
    }
  });
});
