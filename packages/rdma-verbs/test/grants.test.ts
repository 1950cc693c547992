/**
 * Range grants over simulated verbs (test/sim/verbs.ts): the shared suite in both grant modes,
 * then races and limits that need the simulator's knobs, and the bookkeeping without a device.
 * This tests the transport's TypeScript over real control sockets, not libibverbs or a NIC.
 */
import {
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  ResourceExhaustedError,
  TransferEngine,
  createTransferBatch,
  silentLogger,
  type TransferRangeInit,
} from '@tensorwire/core';
import { beforeEach, describe, expect, it } from 'vitest';
import { GrantTableCache, layoutGrant, type GrantTable } from '../src/grants.js';
import { RdmaTransport, type RdmaConnection, type RdmaTransportOptions } from '../src/transport.js';
import { decodeGrant, encodeGrant, encodeGrantTable, FrameReader, type ControlMessage } from '../src/wire.js';
import { blocks, describeRangeGrants, pattern } from './grant-suite.js';
import { SimFabric } from './sim/verbs.js';
import { failure, opts, testNodes, until } from './window-suite.js';

for (const grants of ['memory-window', 'memory-region'] as const) {
  const suiteFabric = new SimFabric();
  describeRangeGrants({
    name: `range grants on simulated verbs, ${grants}`,
    grants,
    transport: (extra) => new RdmaTransport({ backend: suiteFabric.backend(grants === 'memory-window'), quiesceTimeoutMs: 2_000, ...extra }),
    counters: () => suiteFabric.counters,
  });
}

// Races and limits that need the simulator's knobs: each test gets its own fabric.
let fabric = new SimFabric();
beforeEach(() => {
  fabric = new SimFabric();
});
const { pair } = testNodes('rdma-grants', (extra: Partial<RdmaTransportOptions>) =>
  new RdmaTransport({ backend: fabric.backend(extra.grants !== 'memory-region'), quiesceTimeoutMs: 2_000, ...extra }),
);

/** What `f` throws (undefined if it returns). */
function failureOf(f: () => unknown): unknown {
  try {
    f();
  } catch (e) {
    return e;
  }
  return undefined;
}

/** A holder region's bytes: never 0xff, which marks what the holder writes after a revoke. */
const source = (n: number): Uint8Array => pattern(n, 7).map((x) => (x === 0xff ? 0 : x));

/** A pair, a holder region of `n` 1 KiB blocks granted at even slots (no two touch), and the requester's view of the grant. */
async function granted(grants: 'memory-window' | 'memory-region', n: number, extra: Partial<RdmaTransportOptions> = {}, qps = 1) {
  const { a, b, conn } = await pair(qps, { grants, ...extra });
  const piece = 1024;
  const src = source(2 * n * piece);
  const rr = await b.t.register({ kind: 'host', buffer: src });
  const slots = Array.from({ length: n }, (_, k) => 2 * k);
  const gr = b.t.grant(blocks(rr.handle, slots, piece));
  const dst = new Uint8Array(n * piece);
  const lr = await a.t.register({ kind: 'host', buffer: dst });
  const remote = a.t.decodeRemote(gr.payload, 'host', n * piece, new Float64Array(n).fill(piece));
  // Range k into local slot k, in reverse order: no two work requests merge.
  const ranges: TransferRangeInit[] = Array.from({ length: n }, (_, i) => {
    const k = n - 1 - i;
    return { local: lr.handle, localOffset: k * piece, remote, remoteRange: k, remoteOffset: 0, length: piece };
  });
  return { a, b, conn, src, rr, gr, dst, lr, remote, ranges, piece, slots };
}

describe('range grants over simulated verbs: revocation races', () => {
  for (const grants of ['memory-region', 'memory-window'] as const) {
    it(`revoke racing reads on the NIC: no byte lands after the revoke resolved, the rest fails as revoked (${grants})`, async () => {
      const n = 64;
      const { b, conn, src, gr, dst, ranges, piece, slots } = await granted(grants, n, { maxSendWr: 8 });
      await conn.execute(0, createTransferBatch('read', [ranges[n - 1] as TransferRangeInit]), opts()); // the table first
      dst.fill(0);
      const posted = fabric.counters.postedWrs;
      fabric.executionGate.close(); // what is posted stays on the "NIC", not executed yet
      const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts()));
      expect(fabric.counters.postedWrs - posted).toBe(8); // a send queue's worth; the rest waits for slots
      let revoked = false;
      const revoking = b.t.revokeGrant(gr.handle).then(() => (revoked = true));
      await until(() => conn.cachedGrantTables === 0); // GRANT_UNBIND arrived
      await new Promise((r) => setTimeout(r, 20));
      expect(revoked).toBe(false); // eight reads under the grant are still on the NIC
      fabric.executionGate.open();
      await revoking;
      src.fill(0xff); // the holder reuses the memory the moment the revoke resolved
      const err = await p;
      await new Promise((r) => setTimeout(r, 20));
      expect(dst.includes(0xff)).toBe(false);
      const expected = source(2 * n * piece);
      const landed = slots.filter((slot, k) => Buffer.compare(dst.subarray(k * piece, (k + 1) * piece), expected.subarray(slot * piece, (slot + 1) * piece)) === 0).length;
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect(fabric.counters.postedWrs - posted).toBe(8); // the queued rest never reached the NIC
      if (grants === 'memory-region') {
        // The NIC cannot stop an MR rkey: the revoke waited for the eight, then the rest failed as revoked.
        expect(landed).toBe(8);
        expect((err as RemoteRejectedError).remoteCode).toBe('grant-revoked');
        expect(conn.isOpen).toBe(true);
      } else {
        // The windows went first: the NIC refused the eight (an access error breaks the RC connection).
        expect(landed).toBe(0);
        expect((err as RemoteRejectedError).remoteCode).toBe('remote-access');
        expect(conn.isOpen).toBe(false);
      }
    });

    it(`revoke waits for the requester's work on the NIC under the grant, then resolves (${grants})`, async () => {
      const { b, conn, gr, dst, ranges, piece, src } = await granted(grants, 8, {}, 2);
      await conn.execute(0, createTransferBatch('read', [ranges[0] as TransferRangeInit]), opts());
      dst.fill(0);
      fabric.completionGate.close();
      const executed = fabric.executed;
      const p = failure(conn.execute(1, createTransferBatch('read', ranges), opts()));
      await until(() => fabric.executed === executed + 8); // every read ran; its completions are held
      const served = b.inbound[0] as RdmaConnection;
      let revoked = false;
      const revoking = b.t.revokeGrant(gr.handle).then(() => (revoked = true));
      await until(() => conn.cachedGrantTables === 0); // GRANT_UNBIND arrived
      await new Promise((r) => setTimeout(r, 30));
      expect(revoked).toBe(false); // the requester has not confirmed: its reads are still on the NIC
      expect(served.grantUnbindsPending).toBe(1);
      fabric.completionGate.open();
      await revoking;
      expect(await p).toBeUndefined(); // everything was posted before the revoke: it completes
      expect(Buffer.compare(dst, Buffer.concat(Array.from({ length: 8 }, (_, k) => src.subarray(2 * k * piece, (2 * k + 1) * piece))))).toBe(0);
      expect(served.grantUnbindsPending).toBe(0);
      expect(conn.isOpen).toBe(true);
    });
  }

  it('revoke does not wait for a transfer that holds the grant but has posted nothing (it waits for another grant\'s keys); that one then fails unposted', async () => {
    const { a, b, conn, gr, ranges, lr } = await granted('memory-window', 4, {}, 2);
    await conn.execute(0, createTransferBatch('read', [ranges[0] as TransferRangeInit]), opts()); // table of the first grant cached
    const rr2 = await b.t.register({ kind: 'host', buffer: source(8192) });
    const g2 = b.t.grant(blocks(rr2.handle, [0], 1024));
    const other = a.t.decodeRemote(g2.payload, 'host', 1024, Float64Array.of(1024));
    fabric.bindGate.close(); // the second grant's windows are not bound yet
    const posted = fabric.counters.postedWrs;
    const binds = fabric.binds;
    const p = failure(
      conn.execute(
        0,
        createTransferBatch('read', [ranges[1] as TransferRangeInit, { local: lr.handle, localOffset: 3072, remote: other, remoteRange: 0, remoteOffset: 0, length: 1024 }]),
        opts(),
      ),
    );
    await until(() => fabric.binds > binds);
    await b.t.revokeGrant(gr.handle); // resolves with the other grant's bind still held
    fabric.bindGate.open();
    const err = await p;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('grant-revoked');
    expect(fabric.counters.postedWrs - posted).toBe(2); // the second grant's two binds, no READ
    expect(conn.isOpen).toBe(true);
  });

  it('a requester that never confirms a revocation loses its connection after grantRevokeTimeoutMs; the revoke then resolves', async () => {
    const { b, conn, gr, ranges } = await granted('memory-region', 4, { grantRevokeTimeoutMs: 100 });
    await conn.execute(0, createTransferBatch('read', [ranges[0] as TransferRangeInit]), opts());
    fabric.completionGate.close(); // its reads never complete, so it never confirms
    const executed = fabric.executed;
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts()));
    await until(() => fabric.executed === executed + 4);
    const served = b.inbound[0] as RdmaConnection;
    await b.t.revokeGrant(gr.handle);
    expect(served.isOpen).toBe(false);
    fabric.completionGate.open();
    expect(await p).toBeInstanceOf(ConnectionBrokenError);
  });

  it('after revoke the NIC refuses the grant\'s old window rkeys: a requester ignoring the revocation reads nothing (memory-window)', async () => {
    const { a, b, conn, gr, ranges, rr, lr } = await granted('memory-window', 4);
    await conn.execute(0, createTransferBatch('read', [ranges[0] as TransferRangeInit]), opts());
    const served = b.inbound[0] as RdmaConnection;
    const g = decodeGrant(gr.payload);
    if (g.grant !== 'ranges') throw new Error('expected a range grant');
    const binding = b.t.grantLedger?.request(served, Buffer.from(g.token).toString('hex'));
    if (binding?.kind !== 'existing' || binding.binding.rkeys === undefined) throw new Error('expected the binding made for A');
    const rkey = binding.binding.rkeys[3] as number; // key 3 (slot 6), queue pair 0
    const whole = decodeGrant(rr.payload);
    if (whole.grant !== 'window') throw new Error('expected a window registration');
    const addr = whole.addr + BigInt(6 * 1024);
    await b.t.revokeGrant(gr.handle);
    const forged = a.t.decodeRemote(encodeGrant({ grant: 'mr', addr, length: 1024, rkey }), 'host', 1024);
    const err = await failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: forged, remoteOffset: 0, length: 1024 }]), opts()));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('remote-access');
  });

  it('GRANT_UNBIND reaching work queued behind a full send queue: nothing more is posted, it fails as revoked, the connection stays', async () => {
    const { b, conn, gr, ranges } = await granted('memory-window', 16, { maxSendWr: 2 });
    await conn.execute(0, createTransferBatch('read', [ranges[0] as TransferRangeInit]), opts());
    fabric.completionGate.close();
    const posted = fabric.counters.postedWrs;
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts()));
    expect(fabric.counters.postedWrs).toBe(posted + 2);
    const executed = fabric.executed;
    await until(() => fabric.executed === executed + 2);
    let revoked = false;
    const revoking = b.t.revokeGrant(gr.handle).then(() => (revoked = true));
    await until(() => conn.cachedGrantTables === 0);
    expect(revoked).toBe(false);
    fabric.completionGate.open();
    const err = await p;
    await revoking;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('grant-revoked');
    expect(fabric.counters.postedWrs).toBe(posted + 2);
    expect(conn.isOpen).toBe(true);
    expect(conn.outstanding).toBe(0);
  });

  it('revoke while the grant\'s windows are still being bound: the binder deallocates, the requester is refused, nothing leaks', async () => {
    const { a, b, conn, gr, ranges } = await granted('memory-window', 4, {}, 2);
    const mws = fabric.counters.mws;
    fabric.bindGate.close();
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts()));
    await until(() => fabric.binds >= 2);
    let revoked = false;
    const revoking = b.t.revokeGrant(gr.handle).then(() => (revoked = true));
    await new Promise((r) => setTimeout(r, 20));
    expect(revoked).toBe(false); // a bind is on the NIC
    fabric.bindGate.open();
    await revoking;
    const err = await p;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('unknown-grant');
    expect(fabric.counters.mws).toBe(mws);
    expect(b.t.grantWindowsOf(a.host.identity)).toBe(0);
    expect(conn.isOpen).toBe(true);
  });

  it('the connection closing while grant windows are being bound: every party settles, windows and budget come back', async () => {
    const { a, b, conn, gr, ranges, remote, lr } = await granted('memory-window', 4, {}, 2);
    const mws = fabric.counters.mws;
    fabric.bindGate.close();
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts()));
    await until(() => fabric.binds >= 2);
    const served = b.inbound[0] as RdmaConnection;
    await served.close(new ConnectionBrokenError('holder gave up'));
    expect(await p).toBeInstanceOf(Error);
    fabric.bindGate.open();
    await until(() => !conn.isOpen);
    expect(fabric.counters.mws).toBe(mws);
    expect(b.t.grantWindowsOf(a.host.identity)).toBe(0);
    // The grant survives its requester's connection: a new connection binds afresh.
    const again = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 })) as RdmaConnection;
    await again.execute(1, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteRange: 2, remoteOffset: 0, length: 1024 }]), opts());
    expect(b.t.grantWindowsOf(a.host.identity)).toBe(8); // 4 runs × 2 queue pairs
    await b.t.revokeGrant(gr.handle);
    expect(fabric.counters.mws).toBe(mws);
    expect(b.t.grantWindowsOf(a.host.identity)).toBe(0);
  });
});

describe('range grants over simulated verbs: limits and hostile peers', () => {
  it('a grant whose windows alone exceed the per-peer budget is refused at grant(); over the budget a GRANT_BIND is backpressure', async () => {
    const { a, b, conn } = await pair(2, { grants: 'memory-window', maxGrantWindowsPerPeer: 8 });
    const rr = await b.t.register({ kind: 'host', buffer: pattern(64 * 1024, 8) });
    expect(() => b.t.grant(blocks(rr.handle, [0, 2, 4, 6, 8], 1024))).toThrow(ResourceExhaustedError); // 5 runs × 2 queue pairs
    const g1 = b.t.grant(blocks(rr.handle, [0, 2, 4], 1024)); // 6 windows
    const g2 = b.t.grant(blocks(rr.handle, [10, 11, 12, 20], 1024)); // 2 runs: 4 windows
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const read = (c: RdmaConnection, payload: Uint8Array, lengths: number[]): Promise<void> =>
      c.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(payload, 'host', lengths.reduce((x, y) => x + y), Float64Array.from(lengths)), remoteRange: 0, remoteOffset: 0, length: 1024 }]), opts());
    await read(conn, g1.payload, [1024, 1024, 1024]);
    expect(b.t.grantWindowsOf(a.host.identity)).toBe(6);
    const err = await failure(read(conn, g2.payload, [1024, 1024, 1024, 1024]));
    expect(err).toBeInstanceOf(ResourceExhaustedError);
    expect((err as ResourceExhaustedError).details['remoteCode']).toBe('window-limit');
    // Per peer, not per connection: a second connection of the same peer gets no more.
    const second = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 })) as RdmaConnection;
    expect(await failure(read(second, g2.payload, [1024, 1024, 1024, 1024]))).toBeInstanceOf(ResourceExhaustedError);
    expect(conn.isOpen && second.isOpen).toBe(true);
    await b.t.revokeGrant(g1.handle);
    expect(b.t.grantWindowsOf(a.host.identity)).toBe(0);
    await read(conn, g2.payload, [1024, 1024, 1024, 1024]);
    expect(b.t.grantWindowsOf(a.host.identity)).toBe(4);
  });

  it('a GRANT_BIND for an unknown token, the wrong range count, mode or byte total is refused; the connection stays and holds nothing', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: pattern(8192, 9) });
    const gr = b.t.grant(blocks(rr.handle, [0, 2], 1024));
    const g = decodeGrant(gr.payload);
    if (g.grant !== 'ranges') throw new Error('expected a range grant');
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const posted = fabric.counters.postedWrs;
    for (const forged of [
      encodeGrant({ ...g, token: new Uint8Array(16).fill(0xaa) }),
      encodeGrant({ ...g, count: 3, length: 3072 }),
      encodeGrant({ ...g, windows: !g.windows }),
      encodeGrant({ ...g, length: g.length + 1 }),
      encodeGrant({ ...g, length: g.length - 1 }),
    ]) {
      const n = decodeGrant(forged).grant === 'ranges' ? (decodeGrant(forged) as { count: number }).count : 0;
      const remote = a.t.decodeRemote(forged, 'host', n * 1024, new Float64Array(n).fill(1024));
      const err = await failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteRange: 0, remoteOffset: 0, length: 1024 }]), opts()));
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('unknown-grant');
    }
    expect(fabric.counters.postedWrs).toBe(posted);
    expect(conn.isOpen).toBe(true);
    expect(b.t.grantLedger?.bindingCount(b.inbound[0] as RdmaConnection)).toBe(0);
    expect(fabric.binds).toBe(0);
  });

  it('decodeRemote refuses a range grant without lengths or with bad ones, and ranges on a registration payload', async () => {
    const { a, b } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(8192) });
    const gr = b.t.grant(blocks(rr.handle, [0, 2], 1024));
    expect(() => a.t.decodeRemote(gr.payload, 'host', 2048)).toThrow(/needs their lengths/);
    expect(() => a.t.decodeRemote(gr.payload, 'host', 2048, new Float64Array(0))).toThrow(/needs their lengths/);
    expect(() => a.t.decodeRemote(gr.payload, 'host', 2048, Float64Array.of(0, 2048))).toThrow(/length 0/);
    expect(() => a.t.decodeRemote(gr.payload, 'host', 2048, Float64Array.of(1.5, 1024))).toThrow(/length 1.5/);
    // The payload's range count must be the number of the descriptor's range lengths.
    for (const lengths of [Float64Array.of(2048), Float64Array.of(1024, 512, 512)]) {
      const e = failureOf(() => a.t.decodeRemote(gr.payload, 'host', 2048, lengths));
      expect(e).toBeInstanceOf(InvalidInputError);
      expect((e as InvalidInputError).details).toMatchObject({ field: 'count' });
    }
    // Its byte total is the holder's to check (GRANT_BIND): a descriptor claiming more bytes around a genuine payload decodes.
    expect(a.t.decodeRemote(gr.payload, 'host', 4096, Float64Array.of(3072, 1024))).toBeDefined();
    expect(() => a.t.decodeRemote(rr.payload, 'host', 4096)).toThrow(/registration covers 8192 bytes but the descriptor claims 4096/);
    expect(() => a.t.decodeRemote(rr.payload, 'host', 8192, Float64Array.of(4096, 4096))).toThrow(/not a range grant/);
    expect(a.t.decodeRemote(rr.payload, 'host', 8192, Float64Array.of(8192))).toBeDefined();
    expect(() => b.t.grant({ handles: [{}], count: 1, ranges: Float64Array.of(0, 0, 1), bytes: 1 })).toThrow(InvalidInputError);
    expect(() => b.t.grant({ handles: [rr.handle], count: 1, ranges: Float64Array.of(0, 8000, 1000), bytes: 1000 })).toThrow(/outside its registration/);
  });

  it('a prepared transfer through a grant is refused on its next post once the grant is revoked', async () => {
    const ta = new RdmaTransport({ backend: fabric.backend(), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1' });
    const tb = new RdmaTransport({ backend: fabric.backend(), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1' });
    const a = new TransferEngine({ nodeId: 'rg-prep-a', transports: [ta], logger: silentLogger });
    const b = new TransferEngine({ nodeId: 'rg-prep-b', transports: [tb], logger: silentLogger });
    try {
      await a.start();
      await b.start();
      const region = pattern(64 * 1024, 10);
      const reg = await b.register({ kind: 'host', buffer: region });
      const g = await b.grant(Array.from({ length: 16 }, (_, k) => ({ registration: reg, offset: k * 4096, length: 2048 })));
      const dst = new Uint8Array(16 * 2048);
      const ra = await a.register({ kind: 'host', buffer: dst });
      const prepared = await a.prepare(b.endpoint(), Array.from({ length: 16 }, (_, k) => ({ local: ra, localOffset: k * 2048, remote: g.descriptor, range: k, length: 2048 })), { op: 'read' });
      await prepared.run();
      await prepared.run();
      expect(ta.grantBindsSent).toBe(1);
      for (let k = 0; k < 16; k++) expect(Buffer.compare(dst.subarray(k * 2048, (k + 1) * 2048), region.subarray(k * 4096, k * 4096 + 2048))).toBe(0);
      await g.revoke();
      expect(await failure(prepared.run())).toBeInstanceOf(RemoteRejectedError);
    } finally {
      await a.close();
      await b.close();
    }
  });

  it('churn: grants bound, read, revoked and connections closed return every count to its start', async () => {
    const base = { ...fabric.counters };
    for (let i = 0; i < 12; i++) {
      const grants = i % 2 === 0 ? 'memory-window' : 'memory-region';
      const { a, b, conn, gr, ranges } = await granted(grants, 8, {}, 2);
      await conn.execute(i % 2, createTransferBatch('read', ranges), opts());
      if (i % 3 === 0) await b.t.revokeGrant(gr.handle);
      if (i % 4 === 1) await conn.close(new ConnectionBrokenError('churn'));
      void a;
      await Promise.all([a.t.close(), b.t.close()]);
      expect(fabric.counters).toMatchObject({ mrs: base.mrs, mws: base.mws, qps: base.qps, cqs: base.cqs });
    }
  });
});

describe('range grant bookkeeping (no device)', () => {
  const F = { Handle: 0, Offset: 1, Length: 2 };
  it('layout: memory-window keys are runs of touching ranges per registration, in any order; memory-region keys are registrations', () => {
    // Registration 0: blocks at 0-10, 10-20 (touch), 30-40; registration 1: 0-5. Out of order.
    const ranges = Float64Array.of(0, 30, 10, 1, 0, 5, 0, 10, 10, 0, 0, 10);
    const runs = layoutGrant(ranges, 4, 3, F, () => 100, true);
    expect([...runs.regionHandle]).toEqual([0, 1]);
    expect([...runs.keyRegion]).toEqual([0, 0, 1]);
    expect([...runs.keyOffset]).toEqual([0, 30, 0]);
    expect([...runs.keyLength]).toEqual([20, 10, 5]);
    expect([...runs.rangeKey]).toEqual([1, 2, 0, 0]);
    expect([...runs.rangeOffset]).toEqual([30, 0, 10, 0]);
    const whole = layoutGrant(ranges, 4, 3, F, (h) => (h + 1) * 100, false);
    expect([...whole.keyRegion]).toEqual([0, 1]);
    expect([...whole.keyLength]).toEqual([100, 200]);
    expect([...whole.rangeKey]).toEqual([0, 1, 0, 0]);
  });

  function table(count: number, per = 1): Uint8Array[] {
    return [
      ...encodeGrantTable(1, {
        regionHi: Uint32Array.of(0x7f),
        regionLo: Uint32Array.of(0),
        keyRegion: new Uint32Array(count),
        rkeysPerKey: per,
        rkeys: new Uint32Array(count * per).fill(9),
        rangeKey: Uint32Array.from({ length: count }, (_, i) => i),
        rangeOffset: Float64Array.from({ length: count }, (_, i) => i * 4096),
        rangeLength: new Float64Array(count).fill(4096),
      }),
    ];
  }
  const tok = new Uint8Array(16).fill(3);
  const hex = Buffer.from(tok).toString('hex');
  const messages = (frames: Uint8Array[]): ControlMessage[] => new FrameReader().push(Buffer.concat(frames));

  it('one GRANT_BIND per grant however many transfers want it; the table assembles from its parts', async () => {
    const sent: ControlMessage[] = [];
    const c = new GrantTableCache(2, (m) => sent.push(m));
    const p1 = c.get({ token: tok, count: 1000, windows: true, length: 1000 * 4096 }, hex);
    const p2 = c.get({ token: tok, count: 1000, windows: true, length: 1000 * 4096 }, hex);
    expect(p2).toBe(p1);
    expect(sent).toEqual([{ type: 'grant-bind', requestId: 1, count: 1000, windows: true, length: 1000 * 4096, token: tok }]);
    for (const m of messages(table(1000, 2))) expect(c.onMessage(m)).toBeUndefined();
    const t = (await p1) as GrantTable;
    expect(t.count).toBe(1000);
    expect(t.rangeOffset[999]).toBe(999 * 4096);
    expect(c.get({ token: tok, count: 1000, windows: true, length: 1000 * 4096 }, hex)).toBe(t);
    expect(c.binds).toBe(1);
  });

  it('parts out of order, a head for another count, or answers not asked for break the connection', async () => {
    const c = new GrantTableCache(1, () => undefined);
    expect(c.onMessage({ type: 'grant-refuse', requestId: 5, code: 'x', message: 'y' })).toBeInstanceOf(ConnectionBrokenError);
    const p = c.get({ token: tok, count: 1000, windows: true, length: 1000 * 4096 }, hex) as Promise<GrantTable>;
    const [head, regions, keys, ...ranges] = messages(table(1000));
    expect(c.onMessage(head as ControlMessage)).toBeUndefined();
    expect(c.onMessage(regions as ControlMessage)).toBeUndefined();
    expect(c.onMessage(keys as ControlMessage)).toBeUndefined();
    expect(c.onMessage(ranges[1] as ControlMessage)).toBeInstanceOf(ConnectionBrokenError);
    await expect(p).rejects.toBeInstanceOf(ConnectionBrokenError);
    const q = c.get({ token: tok, count: 999, windows: true, length: 999 * 4096 }, hex) as Promise<GrantTable>;
    const [head2] = messages(table(1000)).map((m) => ({ ...m, requestId: 2 }));
    expect(c.onMessage(head2 as ControlMessage)).toBeInstanceOf(ConnectionBrokenError);
    await expect(q).rejects.toBeInstanceOf(ConnectionBrokenError);
    expect(c.ranges).toBe(0);
  });

  it('refusals are typed; GRANT_UNBIND revokes and drops the table; idle tables are evicted for room, busy ones are not', async () => {
    const sent: ControlMessage[] = [];
    const c = new GrantTableCache(1, (m) => sent.push(m), 64, 2000);
    const limited = c.get({ token: tok, count: 10, windows: true, length: 10 * 4096 }, hex) as Promise<GrantTable>;
    c.onMessage({ type: 'grant-refuse', requestId: 1, code: 'window-limit', message: 'full' });
    await expect(limited).rejects.toBeInstanceOf(ResourceExhaustedError);
    const p = c.get({ token: tok, count: 1000, windows: true, length: 1000 * 4096 }, hex) as Promise<GrantTable>;
    for (const m of messages(table(1000)).map((x) => ({ ...x, requestId: 2 }))) c.onMessage(m);
    const t = await p;
    t.users = 1;
    const other = new Uint8Array(16).fill(4);
    const otherHex = Buffer.from(other).toString('hex');
    await expect(c.get({ token: other, count: 1500, windows: true, length: 1500 * 4096 }, otherHex)).rejects.toBeInstanceOf(ResourceExhaustedError); // the busy one stays
    t.users = 0;
    expect(c.get({ token: other, count: 1500, windows: true, length: 1500 * 4096 }, otherHex)).toBeInstanceOf(Promise); // the idle one is evicted
    expect(c.size).toBe(0);
    expect(c.onUnbind(hex)).toEqual([]);
    c.failAll(new ConnectionBrokenError('gone'));
    expect(c.ranges).toBe(0);
  });
});
