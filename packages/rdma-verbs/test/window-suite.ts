/**
 * The memory-window grant suite, written once and run twice: on a real device by
 * hardware.test.ts (where one with type-2 windows exists) and on simulated verbs by
 * sim.test.ts. Each run says which it is; only the hardware run is evidence about a NIC.
 */
import {
  ConnectionBrokenError,
  RemoteRejectedError,
  ResourceExhaustedError,
  createTransferBatch,
  silentLogger,
  type NodeIdentity,
  type TransferBatch,
  type TransferRangeInit,
  type TransportHost,
} from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import type { RdmaConnection, RdmaTransport, RdmaTransportOptions } from '../src/transport.js';
import { tokenHex } from '../src/windows.js';
import { decodeGrant, encodeGrant } from '../src/wire.js';

export interface ResourceCounts {
  readonly mrs: number;
  readonly mws: number;
  readonly qps: number;
  readonly cqs: number;
  readonly postedWrs: number;
}

export interface WindowSuiteOptions {
  readonly name: string;
  /** When set, the suite is skipped (the caller prints why). */
  readonly skip?: string;
  /** A new, unstarted transport in memory-window mode with these options added. */
  readonly transport: (options: Partial<RdmaTransportOptions>) => RdmaTransport;
  readonly counters: () => ResourceCounts;
}

export interface TestNode {
  readonly t: RdmaTransport;
  readonly host: TransportHost;
  readonly inbound: RdmaConnection[];
}

/** A batch (createTransferBatch) from range objects that each name their op; all must agree. */
export function batchOf(list: readonly (TransferRangeInit & { readonly op: 'read' | 'write' })[]): TransferBatch {
  const op = list[0]?.op ?? 'read';
  if (list.some((r) => r.op !== op)) throw new Error('one batch has one op');
  return createTransferBatch(op, list);
}

export function opts(ms = 10_000): { signal: AbortSignal; deadline: number } {
  return { signal: new AbortController().signal, deadline: Date.now() + ms };
}

export async function until(check: () => boolean): Promise<void> {
  for (let i = 0; i < 500 && !check(); i++) await new Promise((r) => setTimeout(r, 10));
  expect(check()).toBe(true);
}

/** The rejection of `p`, or undefined when it resolved. */
export function failure(p: Promise<unknown>): Promise<unknown> {
  return p.then(
    () => undefined,
    (e: unknown) => e,
  );
}

let nodeN = 0;
function identity(prefix: string): NodeIdentity {
  nodeN++;
  return { nodeId: `${prefix}-${nodeN}`, incarnation: `inc${nodeN}`, hostId: prefix };
}

/** Start nodes (closed after each test) and connect pairs of them. */
export function testNodes(prefix: string, make: (options: Partial<RdmaTransportOptions>) => RdmaTransport) {
  const started: RdmaTransport[] = [];
  afterEach(async () => {
    await Promise.all(started.splice(0).map((t) => t.close()));
  });
  const node = async (qps = 2, extra: Partial<RdmaTransportOptions> = {}): Promise<TestNode> => {
    const inbound: RdmaConnection[] = [];
    const host: TransportHost = { identity: identity(prefix), logger: silentLogger, inbound: (c) => inbound.push(c as RdmaConnection) };
    const t = make({ queuePairsPerPeer: qps, listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', ...extra });
    await t.start(host);
    started.push(t);
    return { t, host, inbound };
  };
  const pair = async (qps = 2, extra: Partial<RdmaTransportOptions> = {}): Promise<{ a: TestNode; b: TestNode; conn: RdmaConnection }> => {
    const a = await node(qps, extra);
    const b = await node(qps, extra);
    const conn = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: qps })) as RdmaConnection;
    return { a, b, conn };
  };
  const closeAll = (): Promise<unknown> => Promise.all(started.splice(0).map((t) => t.close()));
  return { node, pair, closeAll };
}

export function describeWindowGrants(o: WindowSuiteOptions): void {
  describe.skipIf(o.skip !== undefined)(o.name, () => {
    const { node, pair, closeAll } = testNodes('rdma-mw', (extra) => o.transport({ grants: 'memory-window', ...extra }));

    it('descriptors carry a token, not an rkey; each requester gets one window per queue pair, bound once', async () => {
      const { a, b, conn } = await pair(2);
      expect(b.t.grantMode).toBe('memory-window');
      const size = 1 << 20;
      const src = new Uint8Array(size).map((_, i) => (i * 31 + 7) & 0xff);
      const rr = await b.t.register({ kind: 'host', buffer: src });
      expect(decodeGrant(rr.payload).grant).toBe('window');
      const dst = new Uint8Array(size);
      const lr = await a.t.register({ kind: 'host', buffer: dst });
      const remote = a.t.decodeRemote(rr.payload, 'host', size);
      const part = size / 8;
      await Promise.all(
        Array.from({ length: 8 }, (_, i) => conn.execute(i % 2, batchOf([{ op: 'read', local: lr.handle, localOffset: i * part, remote, remoteOffset: i * part, length: part }]), opts())),
      );
      expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
      expect(b.inbound[0]?.windows).toBe(2);
      expect(conn.cachedGrants).toBe(1);
      dst.fill(0x42);
      await conn.execute(1, batchOf([{ op: 'write', local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: size }]), opts());
      expect(src.every((x) => x === 0x42)).toBe(true);
      expect(b.inbound[0]?.windows).toBe(2);
    });

    it("the MR's own rkey and another connection's window rkey open nothing", async () => {
      const { a, b, conn } = await pair(1);
      const c = await node(1);
      const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096).fill(9) });
      const g = decodeGrant(rr.payload);
      if (g.grant !== 'window') throw new Error('expected a window grant');
      const la = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
      const read = { op: 'read' as const, local: la.handle, localOffset: 0, remoteOffset: 0, length: 4096 };
      await conn.execute(0, batchOf([{ ...read, remote: a.t.decodeRemote(rr.payload, 'host', 4096) }]), opts());
      const existing = b.t.windowLedger?.request(b.inbound[0] as RdmaConnection, tokenHex(g.token));
      if (existing?.kind !== 'existing' || existing.binding.rkeys === undefined) throw new Error('expected the binding made for A');
      const lc = await c.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
      for (const rkey of [(rr.handle as { rkey: number }).rkey, existing.binding.rkeys[0] as number]) {
        const cconn = await c.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 });
        const forged = c.t.decodeRemote(encodeGrant({ grant: 'mr', addr: g.addr, length: g.length, rkey }), 'host', 4096);
        expect(await failure(cconn.execute(0, batchOf([{ ...read, local: lc.handle, remote: forged }]), opts()))).toBeInstanceOf(RemoteRejectedError);
        expect(cconn.isOpen).toBe(false); // an access violation breaks an RC connection
      }
      await conn.execute(0, batchOf([{ ...read, remote: a.t.decodeRemote(rr.payload, 'host', 4096) }]), opts()); // A's windows still work
    });

    it('revoke deallocates the windows and sends UNBIND; later transfers are refused without posting, and the connection stays', async () => {
      const { a, b, conn } = await pair(2);
      const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(8192).fill(1) });
      const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(8192) });
      const chunk = { op: 'read' as const, local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 8192), remoteOffset: 0, length: 8192 };
      await conn.execute(0, batchOf([chunk]), opts());
      const mws = o.counters().mws;
      await b.t.revoke(rr.handle);
      expect(o.counters().mws).toBe(mws - 2);
      expect(b.inbound[0]?.windows).toBe(0);
      await until(() => conn.cachedGrants === 0); // UNBIND arrived
      const posted = o.counters().postedWrs;
      const err = await failure(conn.execute(1, batchOf([chunk]), opts()));
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('unknown-grant');
      expect(o.counters().postedWrs).toBe(posted);
      expect(conn.isOpen).toBe(true);
    });

    it('a peer over its window budget gets backpressure, on any of its connections; revoking a grant frees room', async () => {
      const { a, b, conn } = await pair(1, { maxWindowGrantsPerPeer: 1 });
      const r1 = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
      const r2 = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
      const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
      const read = (c: RdmaConnection, payload: Uint8Array): Promise<void> =>
        c.execute(0, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(payload, 'host', 4096), remoteOffset: 0, length: 4096 }]), opts());
      await read(conn, r1.payload);
      expect(await failure(read(conn, r2.payload))).toBeInstanceOf(ResourceExhaustedError);
      const second = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 })) as RdmaConnection;
      expect(await failure(read(second, r2.payload))).toBeInstanceOf(ResourceExhaustedError);
      expect(conn.isOpen && second.isOpen).toBe(true);
      await b.t.revoke(r1.handle);
      await read(conn, r2.payload);
    });

    it('churn with windows: MWs, MRs, QPs and CQs return to their starting counts', async () => {
      const base = o.counters();
      for (let i = 0; i < 10; i++) {
        const { a, b, conn } = await pair(2);
        const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(65536).fill(i) });
        const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(65536) });
        await conn.execute(i % 2, batchOf([{ op: 'read', local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', 65536), remoteOffset: 0, length: 65536 }]), opts());
        if (i % 2 === 0) await b.t.revoke(rr.handle);
        if (i % 3 === 0) await conn.close(new ConnectionBrokenError('churn'));
        await closeAll();
        expect(o.counters()).toMatchObject({ mrs: base.mrs, mws: base.mws, qps: base.qps, cqs: base.cqs });
      }
    });
  });
}
