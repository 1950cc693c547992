/**
 * Hardware suites: run only where an RDMA device with an active port exists
 * (TENSORWIRE_RDMA_DEVICE=mlx5_0, or any active device). Elsewhere they skip and print why.
 * Nothing here fakes a device.
 */
import { createConnection } from 'node:net';
import {
  AbortedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  ResourceExhaustedError,
  TimedOutError,
  silentLogger,
  type NodeIdentity,
  type TransferChunk,
  type TransportConnection,
  type TransportHost,
} from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { describeTransportConformance } from '@tensorwire/core/testing';
import { capabilities } from '../src/capabilities.js';
import { loadNative, type NativeCounters } from '../src/native.js';
import { RdmaTransport, type RdmaConnection, type RdmaTransportOptions } from '../src/transport.js';
import { tokenHex } from '../src/windows.js';
import { decodeEndpoint, decodeGrant, encodeGrant } from '../src/wire.js';

const caps = capabilities();
const skipReason = caps.available ? undefined : `no usable RDMA device: ${caps.reason ?? 'unknown'}`;
if (skipReason) console.warn(`[rdma-verbs] skipping the hardware suites: ${skipReason}`);
const device = caps.selected?.device;

// ------------------------------------------------------------ core's conformance suite
describeTransportConformance({
  name: `rdma on ${device ?? 'no device'} (loopback)`,
  createTransport: () => new RdmaTransport({ ...(device ? { device } : {}), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1' }),
  ...(skipReason ? { skip: skipReason } : {}),
});

// ------------------------------------------------------------ transport-level hardware tests

let nodeN = 0;
function identity(): NodeIdentity {
  nodeN++;
  return { nodeId: `rdma-hw-${nodeN}`, incarnation: `inc${nodeN}`, hostId: 'hw' };
}

interface Node {
  readonly t: RdmaTransport;
  readonly host: TransportHost;
  readonly inbound: TransportConnection[];
}

const started: RdmaTransport[] = [];
async function node(qps = 2, extra: Partial<RdmaTransportOptions> = {}): Promise<Node> {
  const inbound: TransportConnection[] = [];
  const host: TransportHost = { identity: identity(), logger: silentLogger, inbound: (c) => inbound.push(c) };
  const t = new RdmaTransport({
    ...(device ? { device } : {}),
    queuePairsPerPeer: qps,
    listenHost: '127.0.0.1',
    advertiseHost: '127.0.0.1',
    quiesceTimeoutMs: 30_000,
    ...extra,
  });
  await t.start(host);
  started.push(t);
  return { t, host, inbound };
}

afterEach(async () => {
  await Promise.all(started.splice(0).map((t) => t.close()));
});

function opts(ms = 10_000): { signal: AbortSignal; deadline: number } {
  return { signal: new AbortController().signal, deadline: Date.now() + ms };
}

async function pair(qps = 2, extra: Partial<RdmaTransportOptions> = {}): Promise<{ a: Node; b: Node; conn: TransportConnection }> {
  const a = await node(qps, extra);
  const b = await node(qps, extra);
  const conn = await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: qps });
  return { a, b, conn };
}

function counters(): NativeCounters {
  return loadNative().counters();
}

describe.skipIf(skipReason !== undefined)(`rdma transport on ${device ?? 'no device'}`, () => {
  it('READ and WRITE move the right bytes on every stream', async () => {
    const { a, b, conn } = await pair(2);
    const size = 1 << 20;
    const src = new Uint8Array(size).map((_, i) => (i * 7 + 3) & 0xff);
    const dst = new Uint8Array(size);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    const half = size / 2;
    await Promise.all(
      [0, 1].map((s) => conn.execute(s, [{ op: 'read', local: lr.handle, localOffset: s * half, remote, remoteOffset: s * half, length: half }], opts())),
    );
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    dst.fill(0x5a);
    await conn.execute(1, [{ op: 'write', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: size }], opts());
    expect(src.every((x) => x === 0x5a)).toBe(true);
    expect(b.inbound).toHaveLength(1);
    expect(conn.streams).toBe(2);
    expect(conn.initiator).toBe(a.host.identity.nodeId);
    expect(b.inbound[0]?.initiator).toBe(a.host.identity.nodeId);
  });

  it('a deadline with work on the NIC quiesces (QP→ERR, every WR flushed) before rejecting', async () => {
    const { a, b, conn } = await pair(1);
    const size = 64 << 20;
    const src = new Uint8Array(size).fill(0xab);
    const dst = new Uint8Array(size);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    const chunks: TransferChunk[] = [];
    for (let off = 0; off < size; off += 1 << 20) chunks.push({ op: 'read', local: lr.handle, localOffset: off, remote, remoteOffset: off, length: 1 << 20 });
    const ac = new AbortController();
    let closedWith: unknown = 'not closed';
    conn.onClose((e) => (closedWith = e));
    const p = conn.execute(0, chunks, { signal: ac.signal, deadline: Date.now() + 60_000 });
    // Work requests are on the NIC now (posted synchronously); no completion has been seen by JS yet.
    expect((conn as RdmaConnection).outstanding).toBeGreaterThan(0);
    ac.abort(new TimedOutError('deadline passed'));
    const err = await p.then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(TimedOutError);
    // Settled only after every outstanding work request completed or flushed.
    expect((conn as RdmaConnection).outstanding).toBe(0);
    expect(conn.isOpen).toBe(false);
    expect(closedWith).toBeInstanceOf(ConnectionBrokenError);
    // The NIC no longer writes into the buffer: a snapshot stays equal after more event-loop turns.
    const snapshot = Buffer.from(dst);
    await new Promise((r) => setTimeout(r, 200));
    expect(Buffer.compare(snapshot, Buffer.from(dst))).toBe(0);
    // The registration can be revoked at once: nothing holds it.
    await a.t.revoke(lr.handle);
  });

  it('an abort before anything is posted rejects with Aborted and posts nothing', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 4096);
    const ac = new AbortController();
    ac.abort();
    const before = counters().postedWrs;
    await expect(conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }], { signal: ac.signal, deadline: Date.now() + 1000 })).rejects.toBeInstanceOf(
      AbortedError,
    );
    expect(counters().postedWrs).toBe(before);
    expect(conn.isOpen).toBe(true);
  });

  it('bad input is a typed error and nothing is posted', async () => {
    const { a, b, conn } = await pair(2);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 4096);
    const before = counters().postedWrs;
    const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 };
    await expect(conn.execute(0, [{ ...chunk, local: {} }], opts())).rejects.toBeInstanceOf(InvalidInputError); // unregistered
    await expect(conn.execute(0, [{ ...chunk, remote: { addr: 0n } }], opts())).rejects.toBeInstanceOf(InvalidInputError);
    await expect(conn.execute(0, [{ ...chunk, remoteOffset: 1 }], opts())).rejects.toBeInstanceOf(InvalidInputError); // beyond registration
    await expect(conn.execute(0, [{ ...chunk, localOffset: 4095, length: 2 }], opts())).rejects.toBeInstanceOf(InvalidInputError);
    await expect(conn.execute(5, [chunk], opts())).rejects.toBeInstanceOf(InvalidInputError);
    await a.t.revoke(lr.handle);
    await expect(conn.execute(0, [chunk], opts())).rejects.toBeInstanceOf(InvalidInputError); // revoked
    expect(counters().postedWrs).toBe(before);
    expect(conn.isOpen).toBe(true);
  });

  it('a revoked remote registration is RemoteRejected', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 4096);
    await b.t.revoke(rr.handle);
    await expect(conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }], opts())).rejects.toBeInstanceOf(
      RemoteRejectedError,
    );
  });

  it('a peer with a different queue-pair count is refused with a typed error; nothing is left behind', async () => {
    const a = await node(2);
    const b = await node(4);
    const base = counters();
    const err = await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 }).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('qp-count-mismatch');
    expect(counters()).toMatchObject({ qps: base.qps, cqs: base.cqs, postedWrs: base.postedWrs });
    expect(b.inbound).toHaveLength(0);
  });

  it('malformed and truncated handshakes are refused; no queue pair is created', async () => {
    const b = await node(2);
    const base = counters();
    const ep = decodeEndpoint(b.t.endpoint());
    for (const bytes of [Buffer.from([0, 0, 0, 5, 1, 0x52, 0x56, 0x48, 1]), Buffer.from([0, 0, 0x10, 0, 1]), Buffer.from([0, 0, 0, 2, 9, 9])]) {
      const s = createConnection({ host: ep.host, port: ep.port });
      await new Promise<void>((resolve) => {
        s.on('error', () => resolve());
        s.on('close', () => resolve());
        s.on('connect', () => s.write(bytes));
      });
    }
    expect(counters()).toMatchObject({ qps: base.qps, cqs: base.cqs });
    expect(b.inbound).toHaveLength(0);
  });

  it('retire() drains, tells the peer, and both sides close cleanly', async () => {
    const { b, conn } = await pair(2);
    const inbound = b.inbound[0] as TransportConnection;
    let retired = false;
    inbound.onRetire(() => (retired = true));
    const peerClosed = new Promise<unknown>((r) => inbound.onClose(r));
    await conn.retire();
    expect(await peerClosed).toBeUndefined();
    expect(retired).toBe(true);
    expect(conn.isOpen).toBe(false);
  });

  it('churn: QPs, CQs, MRs, devices and poller threads return to their starting counts', async () => {
    const base = counters();
    for (let i = 0; i < 20; i++) {
      const { a, b, conn } = await pair(2);
      const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(65536).fill(i) });
      const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(65536) });
      const remote = a.t.decodeRemote(rr.payload, 'host', 65536);
      await conn.execute(i % 2, [{ op: 'read', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 65536 }], opts());
      if (i % 3 === 0) await conn.close(new ConnectionBrokenError('churn'));
      await Promise.all(started.splice(0).map((t) => t.close()));
      expect(counters()).toMatchObject({ devices: base.devices, pds: base.pds, mrs: base.mrs, mws: base.mws, cqs: base.cqs, qps: base.qps, channels: base.channels, threads: base.threads });
    }
  });
});

// ------------------------------------------------------------ lease-scoped grants (type-2 memory windows)

const windowSkip = skipReason ?? (caps.memoryWindows.type2Supported ? undefined : `${device ?? 'the device'} has no type-2 memory windows (grants fall back to whole-MR rkeys)`);
if (windowSkip && !skipReason) console.warn(`[rdma-verbs] skipping the memory-window suite: ${windowSkip}`);

async function until(check: () => boolean): Promise<void> {
  for (let i = 0; i < 500 && !check(); i++) await new Promise((r) => setTimeout(r, 10));
  expect(check()).toBe(true);
}

describe.skipIf(windowSkip !== undefined)(`memory-window grants on ${device ?? 'no device'}`, () => {
  const W = { grants: 'memory-window' as const };

  it('descriptors carry a token, not an rkey; each requester gets windows bound to its own queue pairs', async () => {
    const { a, b, conn } = await pair(2, W);
    expect(a.t.grantMode).toBe('memory-window');
    const size = 1 << 20;
    const src = new Uint8Array(size).map((_, i) => (i * 13 + 1) & 0xff);
    const dst = new Uint8Array(size);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    expect(decodeGrant(rr.payload).grant).toBe('window');
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    const half = size / 2;
    await Promise.all(
      [0, 1].map((s) => conn.execute(s, [{ op: 'read', local: lr.handle, localOffset: s * half, remote, remoteOffset: s * half, length: half }], opts())),
    );
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    const served = b.inbound[0] as RdmaConnection;
    expect(served.windows).toBe(2); // one per QP, bound once for both transfers
    expect((conn as RdmaConnection).cachedGrants).toBe(1);
    dst.fill(0x33);
    await conn.execute(0, [{ op: 'write', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: size }], opts());
    expect(src.every((x) => x === 0x33)).toBe(true);
  });

  it("the MR's own rkey opens nothing, and one requester's window rkey is useless on another's connection", async () => {
    const { a, b, conn } = await pair(1, W);
    const c = await node(1, W);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096).fill(7) });
    const g = decodeGrant(rr.payload);
    if (g.grant !== 'window') throw new Error('expected a window grant');
    const la = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await conn.execute(0, [{ op: 'read', local: la.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts());
    const existing = b.t.windowLedger?.request(b.inbound[0] as RdmaConnection, tokenHex(g.token));
    if (existing?.kind !== 'existing' || existing.binding.rkeys === undefined) throw new Error('expected the binding made for A');
    const lc = await c.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    // C forges whole-MR grants: with the MR's own rkey, and with the window rkey bound for A.
    for (const rkey of [(rr.handle as { rkey: number }).rkey, existing.binding.rkeys[0] as number]) {
      const cconn = await c.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 });
      const forged = c.t.decodeRemote(encodeGrant({ grant: 'mr', addr: g.addr, length: g.length, rkey }), 'host', 4096);
      const err = await cconn.execute(0, [{ op: 'read', local: lc.handle, localOffset: 0, remote: forged, remoteOffset: 0, length: 4096 }], opts()).then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(RemoteRejectedError);
      await cconn.close();
    }
    // A's own windows still work.
    await conn.execute(0, [{ op: 'read', local: la.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts());
  });

  it('revoke deallocates the windows, tells the requester, and later transfers are refused without breaking the connection', async () => {
    const { a, b, conn } = await pair(2, W);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(8192).fill(1) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(8192) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 8192);
    const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 8192 };
    await conn.execute(0, [chunk], opts());
    const base = counters().mws;
    await b.t.revoke(rr.handle);
    expect(counters().mws).toBe(base - 2);
    expect((b.inbound[0] as RdmaConnection).windows).toBe(0);
    await until(() => (conn as RdmaConnection).cachedGrants === 0); // UNBIND arrived
    const posted = counters().postedWrs;
    const err = await conn.execute(1, [chunk], opts()).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('unknown-grant');
    expect(counters().postedWrs).toBe(posted);
    expect(conn.isOpen).toBe(true);
  });

  it('a connection over its window budget gets backpressure, not a broken connection', async () => {
    const { a, b, conn } = await pair(1, { ...W, maxWindowGrantsPerPeer: 1 });
    const r1 = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const r2 = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const read = (payload: Uint8Array): Promise<void> =>
      conn.execute(0, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(payload, 'host', 4096), remoteOffset: 0, length: 4096 }], opts());
    await read(r1.payload);
    await expect(read(r2.payload)).rejects.toBeInstanceOf(ResourceExhaustedError);
    expect(conn.isOpen).toBe(true);
    await b.t.revoke(r1.handle); // frees the budget
    await read(r2.payload);
  });

  it('churn with windows: MWs, QPs, CQs and MRs return to their starting counts', async () => {
    const base = counters();
    for (let i = 0; i < 10; i++) {
      const { a, b, conn } = await pair(2, W);
      const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(65536).fill(i) });
      const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(65536) });
      await conn.execute(i % 2, [{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 65536), remoteOffset: 0, length: 65536 }], opts());
      if (i % 2 === 0) await b.t.revoke(rr.handle);
      if (i % 3 === 0) await conn.close(new ConnectionBrokenError('churn'));
      await Promise.all(started.splice(0).map((t) => t.close()));
      expect(counters()).toMatchObject({ mrs: base.mrs, mws: base.mws, cqs: base.cqs, qps: base.qps, threads: base.threads });
    }
  });
});
