/**
 * Connection lifecycle and admission over simulated verbs: what happens to accepted work when a
 * connection closes or retires, restarted peers, completion routes after close, forged and
 * malformed handshakes, the global handshake limit, window bindings per connection, GIDs that
 * differ only in link-locality, and the control channel's bounds (issue 19: every per-peer queue
 * bounded, past it a logged and counted disconnect, other peers unaffected).
 */
import {
  ClosedError,
  ConnectionBrokenError,
  ResourceExhaustedError,
  SessionInvalidatedError,
  createTransferBatch,
  silentLogger,
  type Logger,
  type RemoteRejectedError,
  type TransportHost,
} from '@tensorwire/core';
import { beforeEach, describe, expect, it } from 'vitest';
import { selectGid, type PortRecord } from '../src/attributes.js';
import { DEFAULT_CONTROL_LIMITS, RdmaTransport, type RdmaConnection, type RdmaTransportOptions } from '../src/transport.js';
import { helloSetup, RawPeer } from './raw-peer.js';
import { SimFabric } from './sim/verbs.js';
import { batchOf, failure, opts, testNodes, until } from './window-suite.js';

let fabric = new SimFabric();
beforeEach(() => {
  fabric = new SimFabric();
});
const { node, pair } = testNodes('rdma-life', (extra: Partial<RdmaTransportOptions> & { ib?: boolean }) => {
  const { ib, ...rest } = extra;
  return new RdmaTransport({ backend: fabric.backend(rest.grants !== 'memory-region', { linkLayer: ib === true ? 'infiniband' : 'ethernet' }), quiesceTimeoutMs: 2_000, ...rest });
});

const reversed = (local: object, remote: unknown, n: number, piece: number) =>
  Array.from({ length: n }, (_, i) => ({ local, localOffset: (n - 1 - i) * piece, remote, remoteOffset: (n - 1 - i) * piece, length: piece }));

async function registered(a: { t: RdmaTransport }, b: { t: RdmaTransport }, size: number, fill = 7) {
  const src = new Uint8Array(size).fill(fill);
  const dst = new Uint8Array(size);
  const rr = await b.t.register({ kind: 'host', buffer: src });
  const lr = await a.t.register({ kind: 'host', buffer: dst });
  return { src, dst, rr, lr, remote: a.t.decodeRemote(rr.payload, 'host', size) };
}

describe('accepted work when a connection closes or retires', () => {
  it('work queued behind a full send queue and work waiting for keys get SessionInvalidatedError when the connection closes; work on the NIC gets the cause', async () => {
    const { a, b, conn } = await pair(1, { maxSendWr: 2 });
    const { lr, remote } = await registered(a, b, 16 * 4096);
    await conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 64 }]), opts()); // keys cached
    fabric.completionGate.close();
    const onNic = failure(conn.execute(0, createTransferBatch('read', reversed(lr.handle, remote, 2, 4096)), opts()));
    expect(conn.slotsInUse(0)).toBe(2); // the send queue is full
    const queued = failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 8 * 4096, remote, remoteOffset: 0, length: 4096 }]), opts()));
    // A second grant whose windows are not bound yet: this one waits for keys.
    const other = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    fabric.bindGate.close();
    const waitingForKeys = failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(other.payload, 'host', 4096), remoteOffset: 0, length: 4096 }]), opts()));
    await until(() => fabric.binds > 1);
    const closing = conn.close(new ConnectionBrokenError('the peer went away'));
    fabric.completionGate.open();
    fabric.bindGate.open();
    await closing;
    expect(await queued).toBeInstanceOf(SessionInvalidatedError);
    expect(await waitingForKeys).toBeInstanceOf(SessionInvalidatedError);
    const nic = await onNic;
    expect(nic).toBeInstanceOf(ConnectionBrokenError);
    expect(nic).not.toBeInstanceOf(SessionInvalidatedError);
    expect(conn.outstanding).toBe(0);
  });

  it('retire() with transfers in flight: isOpen is false at once, new work is refused unposted, what was in flight completes, both sides close in order', async () => {
    const { a, b, conn } = await pair(1);
    const { src, dst, lr, remote } = await registered(a, b, 16 * 4096, 0x3c);
    await until(() => b.inbound.length === 1);
    const served = b.inbound[0] as RdmaConnection;
    let peerClosed: unknown = 'open';
    served.onClose((e) => (peerClosed = e));
    fabric.executionGate.close();
    const inFlight = conn.execute(0, createTransferBatch('read', reversed(lr.handle, remote, 16, 4096)), opts());
    const retiring = conn.retire();
    expect(conn.isOpen).toBe(false);
    const posted = fabric.counters.postedWrs;
    expect(await failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 64 }]), opts()))).toBeInstanceOf(ClosedError);
    expect(fabric.counters.postedWrs).toBe(posted);
    await until(() => !served.isOpen); // the peer heard RETIRE
    fabric.executionGate.open();
    await inFlight;
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    await retiring;
    await until(() => peerClosed !== 'open');
    expect(peerClosed).toBeUndefined(); // an orderly close, not an error
    await until(() => b.t.connectionCount() === 0 && a.t.connectionCount() === 0);
  });
});

describe('admission and routes', () => {
  it('a restarted peer (new incarnation) is admitted while its old incarnation still holds every connection it may have', async () => {
    const b = await node(1, { limits: { maxConnectionsPerPeer: 2 } });
    const old = await node(1);
    const conns: RdmaConnection[] = [];
    for (let i = 0; i < 2; i++) conns.push((await old.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 })) as RdmaConnection);
    await until(() => b.t.connectionCount() === 2);
    const full = await failure(old.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 }));
    expect((full as RemoteRejectedError).remoteCode).toBe('too-many-connections');
    // The same node id, restarted: a new incarnation, while the old one's connections are still open.
    const t = new RdmaTransport({ backend: fabric.backend(), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', queuePairsPerPeer: 1 });
    const host: TransportHost = { identity: { ...old.host.identity, incarnation: `${old.host.identity.incarnation}-restarted` }, logger: silentLogger, inbound: () => undefined };
    await t.start(host);
    try {
      const fresh = (await t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 })) as RdmaConnection;
      await until(() => b.t.connectionCount() === 3);
      const { lr, remote, src, dst } = await registered({ t }, b, 4096, 9);
      await fresh.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }]), opts());
      expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
      expect(conns.every((c) => c.isOpen)).toBe(true);
    } finally {
      await t.close();
    }
  });

  it("a closed connection's completion route and table entry are gone on both sides, and so are its queues", async () => {
    const base = { ...fabric.counters };
    const { a, b, conn } = await pair(2);
    await until(() => b.t.connectionCount() === 1);
    expect(a.t.routes).toBe(1);
    expect(b.t.routes).toBe(1);
    await conn.close();
    await until(() => b.t.connectionCount() === 0);
    expect(a.t.connectionCount()).toBe(0);
    expect(a.t.routes).toBe(0);
    expect(b.t.routes).toBe(0);
    expect(fabric.counters).toMatchObject({ qps: base.qps, cqs: base.cqs });
  });
});

describe('forged and malformed handshakes are refused with typed reasons before any queue pair exists', () => {
  it('LID 0 on InfiniBand, a mismatched link layer, an old incarnation, a wrong queue-pair count, a malformed frame', async () => {
    const ib = await node(1, { ib: true } as Partial<RdmaTransportOptions>);
    const roce = await node(1);
    const base = { ...fabric.counters };
    const forger = { nodeId: 'forger', incarnation: 'f1', hostId: 'elsewhere' };
    const target = (n: { host: TransportHost }) => ({ nodeId: n.host.identity.nodeId, incarnation: n.host.identity.incarnation });
    const cases: [string, { t: RdmaTransport; host: TransportHost }, Parameters<RawPeer['send']>[0]][] = [
      ['bad-lid', ib, { type: 'hello', setup: helloSetup(forger, 1, { linkLayer: 1, lid: 0, gid: 'fe800000000000000000000000000abc' }), target: target(ib) }],
      ['bad-lid', ib, { type: 'hello', setup: helloSetup(forger, 1, { linkLayer: 1, lid: 0xc001, gid: 'fe800000000000000000000000000abc' }), target: target(ib) }],
      ['link-layer-mismatch', ib, { type: 'hello', setup: helloSetup(forger, 1), target: target(ib) }],
      ['link-layer-mismatch', roce, { type: 'hello', setup: helloSetup(forger, 1, { linkLayer: 1, lid: 7 }), target: target(roce) }],
      ['stale-endpoint', roce, { type: 'hello', setup: helloSetup(forger, 1), target: { ...target(roce), incarnation: 'an-old-incarnation' } }],
      ['qp-count-mismatch', roce, { type: 'hello', setup: helloSetup(forger, 3), target: target(roce) }],
      ['protocol', roce, { type: 'ready' }],
    ];
    for (const [code, n, hello] of cases) {
      const p = await RawPeer.open(n.t.endpoint());
      p.send(hello);
      const reply = await p.next();
      expect(reply !== 'closed' && reply.type === 'reject' ? reply.code : reply, `${code}: ${JSON.stringify(reply)}`).toBe(code);
      await p.closed;
    }
    // Malformed: a frame longer than the limit, a truncated one, an unknown type.
    for (const bytes of [Buffer.from([0, 0, 0x10, 0, 1]), Buffer.from([0, 0, 0, 5, 1, 0x52, 0x56, 0x48, 1]), Buffer.from([0, 0, 0, 2, 99, 9])]) {
      const p = await RawPeer.open(roce.t.endpoint());
      p.socket.write(bytes);
      p.socket.end();
      expect(await p.next()).toBe('closed');
    }
    expect(fabric.counters).toMatchObject({ qps: base.qps, cqs: base.cqs });
    expect(ib.inbound).toHaveLength(0);
    expect(roce.inbound).toHaveLength(0);
    expect(ib.t.handshakeRefusals).toMatchObject({ 'bad-lid': 2, 'link-layer-mismatch': 1 });
    expect(roce.t.handshakeRefusals).toMatchObject({ 'link-layer-mismatch': 1, 'stale-endpoint': 1, 'qp-count-mismatch': 1, protocol: 1 });
    // The control: an honest InfiniBand peer (a LID from its subnet manager) is admitted and moves bytes.
    const peer = await node(1, { ib: true } as Partial<RdmaTransportOptions>);
    const conn = (await peer.t.connect(ib.host.identity, ib.t.endpoint(), { ...opts(), streams: 1 })) as RdmaConnection;
    const { lr, remote, src, dst } = await registered(peer, ib, 4096, 4);
    await conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }]), opts());
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
  });

  it(`the global handshake limit (default ${DEFAULT_CONTROL_LIMITS.maxInboundHandshakes}): past it a HELLO gets busy (backpressure) and creates nothing; room comes back as handshakes end`, async () => {
    const b = await node(1);
    const a = await node(1);
    const limit = b.t.limits.maxInboundHandshakes;
    expect(limit).toBe(64);
    const stuck: RawPeer[] = [];
    for (let i = 0; i < limit; i++) {
      const p = await RawPeer.open(b.t.endpoint());
      // Distinct peers (the per-peer limit does not apply), each admitted, none ever READY.
      p.send({ type: 'hello', setup: helloSetup({ nodeId: `stuck-${i}`, incarnation: 's1', hostId: 'h' }, 1), target: { nodeId: b.host.identity.nodeId, incarnation: b.host.identity.incarnation } });
      const reply = await p.next();
      expect(reply !== 'closed' && reply.type).toBe('accept');
      stuck.push(p);
    }
    const qps = fabric.counters.qps;
    const err = await failure(a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 }));
    expect(err).toBeInstanceOf(ResourceExhaustedError);
    expect((err as ResourceExhaustedError).details['remoteCode']).toBe('busy');
    expect(fabric.counters.qps).toBe(qps);
    expect(b.t.handshakeRefusals['busy']).toBe(1);
    for (const p of stuck) p.destroy();
    await until(() => fabric.counters.qps === qps - limit);
    await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 });
  });
});

describe('window bindings belong to one connection', () => {
  it("a second connection of the same peer does not reuse the first one's binding: it binds its own windows", async () => {
    const { a, b, conn } = await pair(2);
    const second = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 })) as RdmaConnection;
    await until(() => b.inbound.length === 2);
    const { lr, remote, src, dst } = await registered(a, b, 8192, 0x61);
    const read = (c: RdmaConnection, s: number) => c.execute(s, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 8192 }]), opts());
    await read(conn, 0);
    const binds = fabric.binds;
    dst.fill(0);
    await read(second, 1);
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    expect(fabric.binds).toBe(binds + 2); // its own windows, one per queue pair
    const [s1, s2] = b.inbound as [RdmaConnection, RdmaConnection];
    expect(s1.windows).toBe(2);
    expect(s2.windows).toBe(2);
    expect(b.t.windowLedger?.bindingCount(s1)).toBe(1);
    expect(b.t.windowLedger?.bindingCount(s2)).toBe(1);
    expect(conn.isOpen && second.isOpen).toBe(true);
  });
});

describe('GID choice', () => {
  it('between GIDs that differ only in link-locality, the routable one is chosen, in either order', () => {
    const port = (gids: PortRecord['gids']): PortRecord => ({ port: 1, state: 4, linkLayer: 2, lid: 0, activeMtu: 5, maxMtu: 5, gids });
    const local = { gid: 'fe800000000000000000000000000001', type: 'RoCE v2' as const };
    const global = { gid: '20010db8000000000000000000000001', type: 'RoCE v2' as const };
    for (const order of [
      [{ index: 0, ...local }, { index: 1, ...global }],
      [{ index: 0, ...global }, { index: 1, ...local }],
    ]) {
      const r = selectGid(port(order));
      expect(r.ok && r.value.gid).toBe(global.gid);
    }
  });
});

/** A logger that keeps warnings. */
function recording(): { logger: Logger; warnings: string[] } {
  const warnings: string[] = [];
  const logger: Logger = { ...silentLogger, warn: (m: string, f?: Record<string, unknown>) => warnings.push(`${m} ${JSON.stringify(f ?? {})}`) };
  return { logger, warnings };
}

/** A raw peer that completes the handshake (its QPs exist only on paper) and is adopted by `b`. */
async function handshaken(b: { t: RdmaTransport; host: TransportHost }, name: string): Promise<RawPeer> {
  const p = await RawPeer.open(b.t.endpoint());
  p.send({ type: 'hello', setup: helloSetup({ nodeId: name, incarnation: 'h1', hostId: 'h' }, b.t.queuePairsPerPeer), target: { nodeId: b.host.identity.nodeId, incarnation: b.host.identity.incarnation } });
  const reply = await p.next();
  expect(reply !== 'closed' && reply.type).toBe('accept');
  p.send({ type: 'ready' });
  return p;
}

describe('the control channel is bounded per peer (issue 19)', () => {
  it('defaults are documented values', () => {
    expect(DEFAULT_CONTROL_LIMITS).toEqual({ maxControlBacklogBytes: 1 << 20, maxQueuedGrantTables: 128, maxPendingBinds: 64, maxUnreadFrames: 64, maxInboundHandshakes: 64, maxConnectionsPerPeer: 8 });
    expect(() => new RdmaTransport({ backend: fabric.backend(), limits: { maxPendingBinds: 8 } })).toThrow(/at least 64/);
    expect(() => new RdmaTransport({ backend: fabric.backend(), limits: { maxUnreadFrames: 0 } })).toThrow(/positive integer/);
  });

  for (const kind of ['unread-frames', 'pending-binds', 'control-backlog'] as const) {
    it(`a peer past the ${kind} bound is disconnected with a logged, counted reason; an honest peer keeps being served`, async () => {
      const rec = recording();
      // The control-backlog case relaxes the in-flight bound so that only the backlog one applies.
      const limits = kind === 'control-backlog' ? { maxControlBacklogBytes: 64 * 1024, maxPendingBinds: 1 << 20 } : {};
      const { a, b, conn } = await pair(1, { logger: rec.logger, limits });
      const { lr, remote, src, dst } = await registered(a, b, 4096, 0x5e);
      const token = new Uint8Array(16).fill(0x42);
      let p: RawPeer;
      if (kind === 'unread-frames') {
        // HELLO followed by frames the handshake never reads.
        p = await RawPeer.open(b.t.endpoint());
        p.send(
          { type: 'hello', setup: helloSetup({ nodeId: 'flooder', incarnation: 'h1', hostId: 'h' }, 1), target: { nodeId: b.host.identity.nodeId, incarnation: b.host.identity.incarnation } },
          ...Array.from({ length: 100 }, () => ({ type: 'retire' as const })),
        );
      } else if (kind === 'pending-binds') {
        // More BINDs at once than any requester keeps in flight.
        p = await handshaken(b, 'flooder');
        await until(() => b.t.connectionCount() === 2);
        p.send(...Array.from({ length: 200 }, (_, i) => ({ type: 'bind' as const, requestId: i + 1, token })));
      } else {
        // BINDs a few at a time (within the in-flight bound), never reading the refusals.
        p = await handshaken(b, 'flooder');
        await until(() => b.t.connectionCount() === 2);
        p.socket.pause();
        let id = 1;
        for (let round = 0; round < 20_000 && b.t.peerDisconnects[kind] === undefined; round++) {
          p.send(...Array.from({ length: 64 }, () => ({ type: 'bind' as const, requestId: id++, token })));
          await new Promise((r) => setImmediate(r));
        }
        expect(b.t.peerDisconnects['pending-binds']).toBeUndefined();
      }
      await until(() => b.t.peerDisconnects[kind] === 1);
      p.socket.resume(); // read to the end: the holder closed it
      await p.closed;
      expect(rec.warnings.filter((w) => w.includes(`rdma peer disconnected: ${kind}`) && w.includes('flooder'))).toHaveLength(1);
      await until(() => b.t.connectionCount() === 1);
      await conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }]), opts());
      expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
      expect(conn.isOpen).toBe(true);
    });
  }
});
