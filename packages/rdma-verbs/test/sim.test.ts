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
  ResourceExhaustedError,
  silentLogger,
  type NodeIdentity,
  type TransportConnection,
  type TransportHost,
} from '@tensorwire/core';
import { describeTransportConformance } from '@tensorwire/core/testing';
import { afterEach, describe, expect, it } from 'vitest';
import { RdmaTransport, type RdmaConnection, type RdmaTransportOptions } from '../src/transport.js';
import { tokenHex } from '../src/windows.js';
import { decodeGrant, encodeGrant } from '../src/wire.js';
import { SimFabric } from './sim/verbs.js';

for (const windows of [true, false]) {
  const fabric = new SimFabric();
  describeTransportConformance({
    name: `rdma on simulated verbs, ${windows ? 'memory-window' : 'memory-region'} grants`,
    createTransport: () => new RdmaTransport({ backend: fabric.backend(windows), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', quiesceTimeoutMs: 2_000 }),
    churnCycles: 200,
  });
}

let nodeN = 0;
function identity(): NodeIdentity {
  nodeN++;
  return { nodeId: `rdma-sim-${nodeN}`, incarnation: `inc${nodeN}`, hostId: 'sim' };
}

interface Node {
  readonly t: RdmaTransport;
  readonly host: TransportHost;
  readonly inbound: RdmaConnection[];
}

const started: RdmaTransport[] = [];
afterEach(async () => {
  await Promise.all(started.splice(0).map((t) => t.close()));
});

async function node(fabric: SimFabric, qps = 2, extra: Partial<RdmaTransportOptions> = {}): Promise<Node> {
  const inbound: RdmaConnection[] = [];
  const host: TransportHost = { identity: identity(), logger: silentLogger, inbound: (c) => inbound.push(c as RdmaConnection) };
  const t = new RdmaTransport({ backend: fabric.backend(), queuePairsPerPeer: qps, listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', quiesceTimeoutMs: 2_000, ...extra });
  await t.start(host);
  started.push(t);
  return { t, host, inbound };
}

function opts(ms = 10_000): { signal: AbortSignal; deadline: number } {
  return { signal: new AbortController().signal, deadline: Date.now() + ms };
}

async function pair(fabric: SimFabric, qps = 2, extra: Partial<RdmaTransportOptions> = {}): Promise<{ a: Node; b: Node; conn: RdmaConnection }> {
  const a = await node(fabric, qps, extra);
  const b = await node(fabric, qps, extra);
  const conn = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: qps })) as RdmaConnection;
  return { a, b, conn };
}

async function until(check: () => boolean): Promise<void> {
  for (let i = 0; i < 500 && !check(); i++) await new Promise((r) => setTimeout(r, 5));
  expect(check()).toBe(true);
}

const failure = (p: Promise<unknown>): Promise<unknown> =>
  p.then(
    () => undefined,
    (e: unknown) => e,
  );

describe('memory-window grants over simulated verbs', () => {
  it('one BIND per grant and connection, however many transfers ask; one window per queue pair; each stream uses its own', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 2);
    expect(b.t.grantMode).toBe('memory-window');
    const size = 64 * 1024;
    const src = new Uint8Array(size).map((_, i) => (i * 31 + 7) & 0xff);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    expect(decodeGrant(rr.payload).grant).toBe('window');
    const dst = new Uint8Array(size);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    const part = size / 8;
    await Promise.all(
      Array.from({ length: 8 }, (_, i) => conn.execute(i % 2, [{ op: 'read', local: lr.handle, localOffset: i * part, remote, remoteOffset: i * part, length: part }], opts())),
    );
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    expect(fabric.binds).toBe(2);
    expect(b.inbound[0]?.windows).toBe(2);
    expect(conn.cachedGrants).toBe(1);
    // WRITE through the same windows.
    dst.fill(0x42);
    await conn.execute(1, [{ op: 'write', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: size }], opts());
    expect(src.every((x) => x === 0x42)).toBe(true);
    expect(fabric.binds).toBe(2);
  });

  it("the MR's own rkey and another connection's window rkey open nothing", async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 1);
    const c = await node(fabric, 1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096).fill(9) });
    const g = decodeGrant(rr.payload);
    if (g.grant !== 'window') throw new Error('expected a window grant');
    const la = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const read = { op: 'read' as const, local: la.handle, localOffset: 0, remoteOffset: 0, length: 4096 };
    await conn.execute(0, [{ ...read, remote: a.t.decodeRemote(rr.payload, 'host', 4096) }], opts());
    const existing = b.t.windowLedger?.request(b.inbound[0] as RdmaConnection, tokenHex(g.token));
    if (existing?.kind !== 'existing' || existing.binding.rkeys === undefined) throw new Error('expected the binding made for A');
    const lc = await c.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    for (const rkey of [(rr.handle as { rkey: number }).rkey, existing.binding.rkeys[0] as number]) {
      const cconn = await c.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 });
      const forged = c.t.decodeRemote(encodeGrant({ grant: 'mr', addr: g.addr, length: g.length, rkey }), 'host', 4096);
      const err = await failure(cconn.execute(0, [{ ...read, local: lc.handle, remote: forged }], opts()));
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect(cconn.isOpen).toBe(false); // an access violation breaks an RC connection
    }
    // A's windows still work.
    await conn.execute(0, [{ ...read, remote: a.t.decodeRemote(rr.payload, 'host', 4096) }], opts());
  });

  it('revoke deallocates the windows and sends UNBIND; later transfers are refused without posting, and the connection stays', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 2);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(8192).fill(1) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(8192) });
    const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 8192), remoteOffset: 0, length: 8192 };
    await conn.execute(0, [chunk], opts());
    const mws = fabric.counters.mws;
    await b.t.revoke(rr.handle);
    expect(fabric.counters.mws).toBe(mws - 2);
    expect(b.inbound[0]?.windows).toBe(0);
    await until(() => conn.cachedGrants === 0);
    const posted = fabric.counters.postedWrs;
    const err = await failure(conn.execute(1, [chunk], opts()));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('unknown-grant');
    expect(fabric.counters.postedWrs).toBe(posted);
    expect(conn.isOpen).toBe(true);
  });

  it('work queued behind a full send queue when UNBIND arrives fails as revoked instead of reaching the NIC', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 1, { maxSendWr: 2 });
    const size = 64 * 1024;
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(size) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(size) });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    await conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }], opts()); // keys cached
    // Two reads execute on the "NIC" but their completions wait; fourteen wait for credits.
    fabric.holdCompletions = true;
    const posted = fabric.counters.postedWrs;
    const chunks = Array.from({ length: 16 }, (_, i) => ({ op: 'read' as const, local: lr.handle, localOffset: i * 4096, remote, remoteOffset: i * 4096, length: 4096 }));
    const p = failure(conn.execute(0, chunks, opts()));
    expect(fabric.counters.postedWrs).toBe(posted + 2);
    const executed = fabric.executed;
    await until(() => fabric.executed === executed + 2); // both read their bytes through the windows
    await b.t.revoke(rr.handle);
    await until(() => conn.cachedGrants === 0); // UNBIND arrived
    fabric.releaseCompletions(); // credits free up: the queued chunks must not be posted
    const err = await p;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('grant-revoked');
    expect(fabric.counters.postedWrs).toBe(posted + 2);
    expect(conn.isOpen).toBe(true);
    expect(conn.outstanding).toBe(0);
  });

  it('a connection over its window budget gets backpressure; revoking a grant frees room', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 1, { maxWindowGrantsPerPeer: 1 });
    const r1 = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const r2 = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const read = (payload: Uint8Array): Promise<void> =>
      conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts());
    await read(r1.payload);
    expect(await failure(read(r2.payload))).toBeInstanceOf(ResourceExhaustedError);
    expect(conn.isOpen).toBe(true);
    await b.t.revoke(r1.handle);
    await read(r2.payload);
  });

  it('revoke while the connection holding windows for it is still quiescing waits for those windows before deregistering', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts());
    // The holder has its own READ on the same connection, whose completion is held: closing
    // the connection must wait for its flush before the windows go.
    const served = b.inbound[0] as RdmaConnection;
    const mine = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const back = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const backRead = { op: 'read' as const, local: mine.handle, localOffset: 0, remote: b.t.decodeRemote(back.payload, 'host', 4096), remoteOffset: 0, length: 4096 };
    await served.execute(0, [backRead], opts()); // B's keys for A's memory are cached
    fabric.holdCompletions = true;
    const holderRead = failure(served.execute(0, [backRead], opts()));
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
    fabric.releaseCompletions();
    await closing;
    await revoking;
    expect(revoked).toBeUndefined();
    expect(served.windows).toBe(0);
    expect(fabric.counters.mrs).toBe(mrs - 1);
    await holderRead;
  });

  it('a transfer over a hundred grants at once binds them all, a bounded number of BINDs at a time', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 2);
    const n = 100;
    const regs = await Promise.all(Array.from({ length: n }, (_, i) => b.t.register({ kind: 'host', buffer: new Uint8Array(1024).fill(i) })));
    const dst = new Uint8Array(n * 1024);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const chunks = regs.map((r, i) => ({ op: 'read' as const, local: lr.handle, localOffset: i * 1024, remote: a.t.decodeRemote(r.payload, 'host', 1024), remoteOffset: 0, length: 1024 }));
    await conn.execute(0, chunks, opts());
    for (let i = 0; i < n; i++) expect(dst[i * 1024]).toBe(i);
    expect(conn.cachedGrants).toBe(n);
    expect(b.inbound[0]?.windows).toBe(2 * n);
    expect(conn.isOpen).toBe(true);
  });

  it('revoke while the bind is still on the NIC: the binder deallocates, the requester is refused, the MR is deregistered after', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 2);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const mrs = fabric.counters.mrs;
    const mws = fabric.counters.mws;
    fabric.holdBinds = true;
    const p = failure(conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts()));
    await until(() => fabric.binds === 2);
    let revoked = false;
    const revoking = b.t.revoke(rr.handle).then(() => (revoked = true));
    await new Promise((r) => setTimeout(r, 20));
    expect(revoked).toBe(false); // waits for the binds on the NIC
    fabric.releaseBinds();
    await revoking;
    const err = await p;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect(fabric.counters.mws).toBe(mws);
    expect(fabric.counters.mrs).toBe(mrs - 1);
    expect(conn.isOpen).toBe(true);
  });

  it('the connection closing while a bind is on the NIC and a transfer waits for keys: every party settles, nothing leaks', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 2);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const base = { ...fabric.counters };
    fabric.holdBinds = true;
    const p = failure(conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts()));
    await until(() => fabric.binds === 2);
    const served = b.inbound[0] as RdmaConnection;
    await served.close(new ConnectionBrokenError('holder gave up'));
    expect(await p).toBeInstanceOf(Error);
    fabric.releaseBinds();
    await until(() => !conn.isOpen);
    expect(served.windows).toBe(0);
    expect(fabric.counters.mws).toBe(base.mws);
    // The grant survives its requester's connection: a new connection binds afresh.
    const again = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 })) as RdmaConnection;
    await again.execute(1, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts());
    await b.t.revoke(rr.handle);
    expect(fabric.counters.mws).toBe(base.mws);
  });

  it('a deadline while waiting for keys rejects the transfer without posting; the keys still arrive for the next one', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096).fill(5) });
    const dst = new Uint8Array(4096);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 };
    fabric.holdBinds = true;
    const posted = fabric.counters.postedWrs;
    const ac = new AbortController();
    const p = failure(conn.execute(0, [chunk], { signal: ac.signal, deadline: Date.now() + 60_000 }));
    await until(() => fabric.binds === 1);
    ac.abort();
    expect(await p).toBeInstanceOf(Error);
    expect(fabric.counters.postedWrs).toBe(posted + 1); // the bind only
    fabric.releaseBinds();
    await until(() => conn.cachedGrants === 1);
    await conn.execute(0, [chunk], opts());
    expect(dst.every((x) => x === 5)).toBe(true);
  });

  it('a hostile peer: BIND for unknown tokens is refused, and unsolicited BOUND/REFUSE break only its own connection', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const g = decodeGrant(rr.payload);
    if (g.grant !== 'window') throw new Error('expected a window grant');
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const guessed = a.t.decodeRemote(encodeGrant({ ...g, token: new Uint8Array(16).fill(0xaa) }), 'host', 4096);
    const err = await failure(conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote: guessed, remoteOffset: 0, length: 4096 }], opts()));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect(conn.isOpen).toBe(true);
    expect(b.t.windowLedger?.bindingCount(b.inbound[0] as RdmaConnection)).toBe(0);
  });

  it('churn with windows: MWs, MRs, QPs and CQs return to their starting counts', async () => {
    const fabric = new SimFabric();
    const base = { ...fabric.counters };
    for (let i = 0; i < 12; i++) {
      const { a, b, conn } = await pair(fabric, 2);
      const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(8192).fill(i) });
      const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(8192) });
      await conn.execute(i % 2, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 8192), remoteOffset: 0, length: 8192 }], opts());
      if (i % 2 === 0) await b.t.revoke(rr.handle);
      if (i % 3 === 0) await conn.close(new ConnectionBrokenError('churn'));
      await Promise.all(started.splice(0).map((t) => t.close()));
      expect(fabric.counters).toMatchObject({ mrs: base.mrs, mws: base.mws, qps: base.qps, cqs: base.cqs, devices: base.devices });
    }
  });
});

describe('memory-region grants over simulated verbs', () => {
  it('the descriptor carries the MR rkey; revoke deregisters it and later reads are refused', async () => {
    const fabric = new SimFabric();
    const { a, b, conn } = await pair(fabric, 1, { grants: 'memory-region' });
    expect(b.t.grantMode).toBe('memory-region');
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096).fill(3) });
    expect(decodeGrant(rr.payload).grant).toBe('mr');
    const dst = new Uint8Array(4096);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 };
    await conn.execute(0, [chunk], opts());
    expect(dst.every((x) => x === 3)).toBe(true);
    expect(fabric.binds).toBe(0);
    await b.t.revoke(rr.handle);
    expect(await failure(conn.execute(0, [chunk], opts()))).toBeInstanceOf(RemoteRejectedError);
  });

  it('grants: memory-window on a device without type-2 windows refuses to start, saying why', async () => {
    const fabric = new SimFabric();
    const t = new RdmaTransport({ backend: fabric.backend(false), grants: 'memory-window' });
    const host: TransportHost = { identity: identity(), logger: silentLogger, inbound: () => undefined };
    await expect(t.start(host)).rejects.toThrow(/does not support type-2 memory windows/);
    await t.close();
  });
});

export type { TransportConnection };
