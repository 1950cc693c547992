/**
 * The transport's own logic over simulated verbs (test/sim/verbs.ts): core's conformance suite
 * in both grant modes, and the memory-window protocol (BIND/BOUND/REFUSE/UNBIND) with its
 * races. These run on every machine and test the TypeScript state machine over real control
 * sockets. They prove nothing about libibverbs or a NIC; test/hardware.test.ts does that
 * where a device exists.
 */
import {
  ConnectionBrokenError,
  RemoteRejectedError,
  silentLogger,
  type TransportHost,
} from '@tensorwire/core';
import { describeTransportConformance } from '@tensorwire/core/testing';
import { beforeEach, describe, expect, it } from 'vitest';
import { RdmaTransport, type RdmaConnection } from '../src/transport.js';
import { decodeGrant, encodeGrant } from '../src/wire.js';
import { SimFabric } from './sim/verbs.js';
import { batchOf, describeWindowGrants, failure, opts, testNodes, until } from './window-suite.js';

for (const windows of [true, false]) {
  const conformanceFabric = new SimFabric();
  describeTransportConformance({
    name: `rdma on simulated verbs, ${windows ? 'memory-window' : 'memory-region'} grants`,
    createTransport: () => new RdmaTransport({ backend: conformanceFabric.backend(windows), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', quiesceTimeoutMs: 2_000 }),
    churnCycles: 200,
  });
}

// The shared memory-window suite, on one simulated fabric.
const suiteFabric = new SimFabric();
describeWindowGrants({
  name: 'memory-window grants on simulated verbs',
  transport: (extra) => new RdmaTransport({ backend: suiteFabric.backend(), quiesceTimeoutMs: 2_000, ...extra }),
  counters: () => suiteFabric.counters,
});

// Races and limits that need the simulator's knobs: each test gets its own fabric.
let fabric = new SimFabric();
beforeEach(() => {
  fabric = new SimFabric();
});
const { pair } = testNodes('rdma-sim', (extra) => new RdmaTransport({ backend: fabric.backend(extra.grants !== 'memory-region'), quiesceTimeoutMs: 2_000, ...extra }));

describe('memory-window grants over simulated verbs', () => {
  it('work queued behind a full send queue when UNBIND arrives fails as revoked instead of reaching the NIC', async () => {
    const { a, b, conn } = await pair(1, { maxSendWr: 2 });
    const size = 64 * 1024;
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(size) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(size) });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    await conn.execute(0, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }]), opts()); // keys cached
    // Two reads execute on the "NIC" but their completions wait; fourteen wait for slots. (In
    // reverse order, no range is back to back on the remote side with the one before it: sixteen
    // work requests, one per chain with a send queue of two.)
    fabric.completionGate.close();
    const posted = fabric.counters.postedWrs;
    const chunks = Array.from({ length: 16 }, (_, i) => ({ op: 'read' as const, local: lr.handle, localOffset: (15 - i) * 4096, remote, remoteOffset: (15 - i) * 4096, length: 4096 }));
    const p = failure(conn.execute(0, batchOf(chunks), opts()));
    expect(fabric.counters.postedWrs).toBe(posted + 2);
    const executed = fabric.executed;
    await until(() => fabric.executed === executed + 2); // both read their bytes through the windows
    await b.t.revoke(rr.handle);
    await until(() => conn.cachedGrants === 0); // UNBIND arrived
    fabric.completionGate.open(); // credits free up: the queued chunks must not be posted
    const err = await p;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('grant-revoked');
    expect(fabric.counters.postedWrs).toBe(posted + 2);
    expect(conn.isOpen).toBe(true);
    expect(conn.outstanding).toBe(0);
  });

  it('revoke while the connection holding windows for it is still quiescing waits for those windows before deregistering', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await conn.execute(0, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }]), opts());
    // The holder has its own READ on the same connection, whose completion is held: closing
    // the connection must wait for its flush before the windows go.
    const served = b.inbound[0] as RdmaConnection;
    const mine = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const back = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const backRead = { op: 'read' as const, local: mine.handle, localOffset: 0, remote: b.t.decodeRemote(back.payload, 'host', 4096), remoteOffset: 0, length: 4096 };
    await served.execute(0, batchOf([backRead]), opts()); // B's keys for A's memory are cached
    fabric.completionGate.close();
    const holderRead = failure(served.execute(0, batchOf([backRead]), opts()));
    expect(served.outstanding).toBe(1);
    const closing = served.close(new ConnectionBrokenError('holder closes'));
    const mrs = fabric.counters.mrs;
    let revoked: unknown = 'pending';
    const revoking = b.t.revoke(rr.handle).then(
      () => (revoked = undefined),
      (e: unknown) => (revoked = e),
    );
    await new Promise((r) => setTimeout(r, 20));
    expect(revoked).toBe('pending'); // the windows over the MR are still there
    expect(served.windows).toBe(1);
    fabric.completionGate.open();
    await closing;
    await revoking;
    expect(revoked).toBeUndefined();
    expect(served.windows).toBe(0);
    expect(fabric.counters.mrs).toBe(mrs - 1);
    await holderRead;
  });

  it('a transfer over a hundred grants at once binds them all, a bounded number of BINDs at a time', async () => {
    const { a, b, conn } = await pair(2);
    const n = 100;
    const regs = await Promise.all(Array.from({ length: n }, (_, i) => b.t.register({ kind: 'host', buffer: new Uint8Array(1024).fill(i) })));
    const dst = new Uint8Array(n * 1024);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const chunks = regs.map((r, i) => ({ op: 'read' as const, local: lr.handle, localOffset: i * 1024, remote: a.t.decodeRemote(r.payload, 'host', 1024), remoteOffset: 0, length: 1024 }));
    await conn.execute(0, batchOf(chunks), opts());
    for (let i = 0; i < n; i++) expect(dst[i * 1024]).toBe(i);
    expect(conn.cachedGrants).toBe(n);
    expect(b.inbound[0]?.windows).toBe(2 * n);
    expect(conn.isOpen).toBe(true);
  });

  it('revoke while the bind is still on the NIC: the binder deallocates, the requester is refused, the MR is deregistered after', async () => {
    const { a, b, conn } = await pair(2);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const mrs = fabric.counters.mrs;
    const mws = fabric.counters.mws;
    fabric.bindGate.close();
    const p = failure(conn.execute(0, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }]), opts()));
    await until(() => fabric.binds === 2);
    let revoked = false;
    const revoking = b.t.revoke(rr.handle).then(() => (revoked = true));
    await new Promise((r) => setTimeout(r, 20));
    expect(revoked).toBe(false); // waits for the binds on the NIC
    fabric.bindGate.open();
    await revoking;
    const err = await p;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect(fabric.counters.mws).toBe(mws);
    expect(fabric.counters.mrs).toBe(mrs - 1);
    expect(conn.isOpen).toBe(true);
  });

  it('the connection closing while a bind is on the NIC and a transfer waits for keys: every party settles, nothing leaks', async () => {
    const { a, b, conn } = await pair(2);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const base = { ...fabric.counters };
    fabric.bindGate.close();
    const p = failure(conn.execute(0, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }]), opts()));
    await until(() => fabric.binds === 2);
    const served = b.inbound[0] as RdmaConnection;
    await served.close(new ConnectionBrokenError('holder gave up'));
    expect(await p).toBeInstanceOf(Error);
    fabric.bindGate.open();
    await until(() => !conn.isOpen);
    expect(served.windows).toBe(0);
    expect(fabric.counters.mws).toBe(base.mws);
    // The grant survives its requester's connection: a new connection binds afresh.
    const again = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 })) as RdmaConnection;
    await again.execute(1, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }]), opts());
    await b.t.revoke(rr.handle);
    expect(fabric.counters.mws).toBe(base.mws);
  });

  it('a deadline while waiting for keys rejects the transfer without posting; the keys still arrive for the next one', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096).fill(5) });
    const dst = new Uint8Array(4096);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 };
    fabric.bindGate.close();
    const posted = fabric.counters.postedWrs;
    const ac = new AbortController();
    const p = failure(conn.execute(0, batchOf([chunk]), { signal: ac.signal, deadline: Date.now() + 60_000 }));
    await until(() => fabric.binds === 1);
    ac.abort();
    expect(await p).toBeInstanceOf(Error);
    expect(fabric.counters.postedWrs).toBe(posted + 1); // the bind only
    fabric.bindGate.open();
    await until(() => conn.cachedGrants === 1);
    await conn.execute(0, batchOf([chunk]), opts());
    expect(dst.every((x) => x === 5)).toBe(true);
  });

  it('a hostile peer: BIND for unknown tokens is refused, and unsolicited BOUND/REFUSE break only its own connection', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const g = decodeGrant(rr.payload);
    if (g.grant !== 'window') throw new Error('expected a window grant');
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const guessed = a.t.decodeRemote(encodeGrant({ ...g, token: new Uint8Array(16).fill(0xaa) }), 'host', 4096);
    const err = await failure(conn.execute(0, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote: guessed, remoteOffset: 0, length: 4096 }]), opts()));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect(conn.isOpen).toBe(true);
    expect(b.t.windowLedger?.bindingCount(b.inbound[0] as RdmaConnection)).toBe(0);
  });

});

describe('admission over simulated verbs', () => {
  it('a peer may hold at most 8 connections; the ninth is refused with a typed error and creates nothing', async () => {
    const { a, b } = await pair(1);
    const extra: RdmaConnection[] = [];
    for (let i = 0; i < 7; i++) extra.push((await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 })) as RdmaConnection);
    await until(() => b.t.connectionCount() === 8); // the acceptor adopts each after READY
    const qps = fabric.counters.qps;
    const err = await failure(a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 }));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('too-many-connections');
    expect(fabric.counters.qps).toBe(qps);
    await extra[0]?.close();
    await until(() => b.t.connectionCount() === 7);
    await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 }); // room again
  });

  it('connections opened all at once count against the limit while they are still handshaking', async () => {
    const { a, b } = await pair(1);
    const results = await Promise.allSettled(Array.from({ length: 20 }, () => a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 })));
    const refused = results.filter((r): r is PromiseRejectedResult => r.status === 'rejected');
    expect(refused.length).toBe(13); // 1 from pair() + 7 of these make 8
    for (const r of refused) expect((r.reason as RemoteRejectedError).remoteCode).toBe('too-many-connections');
    await until(() => b.t.connectionCount() === 8);
  });
});

describe('memory-region grants over simulated verbs', () => {
  it('the descriptor carries the MR rkey; revoke deregisters it and later reads are refused', async () => {
    const { a, b, conn } = await pair(1, { grants: 'memory-region' });
    expect(b.t.grantMode).toBe('memory-region');
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096).fill(3) });
    expect(decodeGrant(rr.payload).grant).toBe('mr');
    const dst = new Uint8Array(4096);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 };
    await conn.execute(0, batchOf([chunk]), opts());
    expect(dst.every((x) => x === 3)).toBe(true);
    expect(fabric.binds).toBe(0);
    await b.t.revoke(rr.handle);
    expect(await failure(conn.execute(0, batchOf([chunk]), opts()))).toBeInstanceOf(RemoteRejectedError);
  });

  it('grants: memory-window on a device without type-2 windows refuses to start, saying why', async () => {
    const t = new RdmaTransport({ backend: fabric.backend(false), grants: 'memory-window' });
    const host: TransportHost = { identity: { nodeId: 'rdma-sim-nowin', incarnation: 'i1', hostId: 'sim' }, logger: silentLogger, inbound: () => undefined };
    await expect(t.start(host)).rejects.toThrow(/does not support type-2 memory windows/);
    await t.close();
  });
});

