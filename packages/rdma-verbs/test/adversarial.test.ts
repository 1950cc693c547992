/**
 * The transport against the adversarial simulator (test/sim/verbs.ts, `adversary`): the bugs of
 * the pegaflow incident, each with a test that fails when it comes back. Every fabric is seeded;
 * a failing test prints its seed, and TW_SIM_SEED=<seed> reproduces it.
 *
 * After every failing, aborted or timed-out transfer the hardware suite's check runs here too:
 * when the operation rejects, nothing of its connection is still on the (simulated) NIC, and
 * nothing writes into its memory afterwards (the audit).
 */
import {
  AbortedError,
  ConnectionBrokenError,
  ResourceExhaustedError,
  TimedOutError,
  createTransferBatch,
  type TransferRangeInit,
} from '@tensorwire/core';
import { beforeEach, describe, expect, it, onTestFailed } from 'vitest';
import { RdmaTransport, type RdmaConnection, type RdmaTransportOptions } from '../src/transport.js';
import { SimFabric, WC, testSeed, type AdversaryOptions } from './sim/verbs.js';
import { batchOf, opts, testNodes, until } from './window-suite.js';

let seed = testSeed();
let fabric = new SimFabric({ adversary: { seed } });
/** A fresh seeded fabric for this test with these adversary options. */
function adversary(o: Partial<AdversaryOptions> = {}): SimFabric {
  fabric = new SimFabric({ adversary: { seed, ...o } });
  return fabric;
}
beforeEach(() => {
  seed = testSeed();
  adversary();
  onTestFailed(() => console.error(`[rdma-verbs] adversarial simulator seed ${seed}; rerun with TW_SIM_SEED=${seed}`));
});
const { node, pair } = testNodes('rdma-adv', (extra: Partial<RdmaTransportOptions>) =>
  new RdmaTransport({ backend: fabric.backend(extra.grants !== 'memory-region'), quiesceTimeoutMs: 2_000, ...extra }),
);

const pattern = (n: number, s: number): Uint8Array => new Uint8Array(n).map((_, i) => (i * 131 + s * 17 + (i >> 8)) & 0xff);
const turns = async (n: number): Promise<void> => {
  for (let i = 0; i < n; i++) await new Promise((r) => setImmediate(r));
};

/**
 * The outcome of `p`, checked the moment it settles: a rejection finds nothing of `conn` on the
 * NIC (the hardware suite's check), and from then on `released` (the memory the call used) is
 * released: the audit fails the test on any later write into it.
 */
async function settledQuiesced(p: Promise<void>, conn: RdmaConnection, released: readonly Uint8Array[]): Promise<{ error: unknown; outstanding: number }> {
  let error: unknown;
  try {
    await p;
  } catch (e) {
    error = e;
  }
  const outstanding = conn.outstanding;
  for (const v of released) fabric.audit.release(v, 'the transfer settled');
  return { error, outstanding };
}

/** `n` ranges of `piece` bytes in reverse order (no two back to back remotely: one work request each). */
function reversed(local: object, remote: unknown, n: number, piece: number): TransferRangeInit[] {
  return Array.from({ length: n }, (_, i) => ({ local, localOffset: (n - 1 - i) * piece, remote, remoteOffset: (n - 1 - i) * piece, length: piece }));
}

async function readPair(grants: 'memory-window' | 'memory-region', size: number, extra: Partial<RdmaTransportOptions> = {}) {
  const { a, b, conn } = await pair(1, { grants, ...extra });
  const src = pattern(size, 1);
  const dst = new Uint8Array(size);
  const rr = await b.t.register({ kind: 'host', buffer: src });
  const lr = await a.t.register({ kind: 'host', buffer: dst });
  const remote = a.t.decodeRemote(rr.payload, 'host', size);
  // Keys cached (memory-window mode binds here), so later work goes straight to the NIC.
  await conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 64 }]), opts());
  dst.fill(0);
  return { a, b, conn, src, dst, rr, lr, remote };
}

describe('queue-pair numbers collide across devices booted alike', () => {
  it('two peers whose QPNs are the same connect to one holder: each connection moves its own bytes, closing one leaves the other', async () => {
    const b = await node(2);
    const a1 = await node(2);
    const a2 = await node(2);
    const c1 = (await a1.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 })) as RdmaConnection;
    const c2 = (await a2.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 })) as RdmaConnection;
    // The collision is real: both peers' devices handed out the same QPNs.
    const qpnsOf = (gid: string | undefined): number[] => [...fabric.qps.keys()].filter((k) => k.startsWith(`${gid}/`)).map((k) => Number(k.split('/')[1])).sort();
    const q1 = qpnsOf(a1.t.discovery?.selected?.gid);
    expect(q1.length).toBe(2);
    expect(qpnsOf(a2.t.discovery?.selected?.gid)).toEqual(q1);
    expect(qpnsOf(b.t.discovery?.selected?.gid).some((q) => q1.includes(q))).toBe(true);
    await until(() => b.t.connectionCount() === 2);
    const src = pattern(8192, 3);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    const run = async (t: RdmaTransport, c: RdmaConnection): Promise<Uint8Array> => {
      const dst = new Uint8Array(8192);
      const lr = await t.register({ kind: 'host', buffer: dst });
      await Promise.all([0, 1].map((s) => c.execute(s, batchOf([{ op: 'read', local: lr.handle, localOffset: s * 4096, remote: t.decodeRemote(rr.payload, 'host', 8192), remoteOffset: s * 4096, length: 4096 }]), opts())));
      return dst;
    };
    const [d1, d2] = await Promise.all([run(a1.t, c1), run(a2.t, c2)]);
    expect(Buffer.compare(Buffer.from(d1), Buffer.from(src))).toBe(0);
    expect(Buffer.compare(Buffer.from(d2), Buffer.from(src))).toBe(0);
    await c1.close();
    await until(() => b.t.connectionCount() === 1);
    expect(b.t.routes).toBe(1);
    expect(c2.isOpen).toBe(true);
    const d3 = await run(a2.t, c2);
    expect(Buffer.compare(Buffer.from(d3), Buffer.from(src))).toBe(0);
    fabric.assertClean();
  });
});

describe('quiesce: settle only after the drain (late writes until the flush)', () => {
  for (const grants of ['memory-window', 'memory-region'] as const) {
    for (const how of ['abort', 'deadline', 'failed completion'] as const) {
      it(`${how} with work on the NIC (${grants}): every late write lands before the rejection, none after; nothing outstanding when it rejects`, async () => {
        adversary({ lateWrites: 1 });
        const size = 32 * 4096;
        const { conn, dst, lr, remote } = await readPair(grants, size);
        fabric.executionGate.close(); // every work request stays posted ("on the wire")
        const ac = new AbortController();
        if (how === 'failed completion') fabric.failExecution(0, WC.RemOpErr);
        const p = conn.execute(0, createTransferBatch('read', reversed(lr.handle, remote, 32, 4096)), {
          signal: ac.signal,
          deadline: Date.now() + (how === 'deadline' ? 50 : 60_000),
        });
        expect(conn.outstanding).toBeGreaterThan(0);
        if (how === 'abort') ac.abort();
        if (how === 'failed completion') fabric.executionGate.open();
        const r = await settledQuiesced(p, conn, [dst]);
        expect(r.error).toBeInstanceOf(how === 'abort' ? AbortedError : how === 'deadline' ? TimedOutError : ConnectionBrokenError);
        expect(r.outstanding).toBe(0);
        expect(conn.isOpen).toBe(false);
        fabric.executionGate.open();
        await turns(30);
        if (how !== 'failed completion') expect(fabric.lateWrites).toBeGreaterThan(0); // the adversary did write late
        fabric.assertClean();
      });
    }
  }

  it('a port going down fails every transfer with ConnectionBroken only after its flushes; a new connection works once it is up', async () => {
    adversary({ lateWrites: 0.5 });
    const size = 32 * 4096;
    const { a, b, conn, dst, lr, remote, src } = await readPair('memory-window', size);
    const base = { ...fabric.counters };
    fabric.executionGate.close();
    const p = conn.execute(0, createTransferBatch('read', reversed(lr.handle, remote, 32, 4096)), opts());
    fabric.portDown(b.t.discovery?.selected?.gid as string);
    fabric.executionGate.open();
    const r = await settledQuiesced(p, conn, [dst]);
    expect(r.error).toBeInstanceOf(ConnectionBrokenError);
    expect(r.outstanding).toBe(0);
    await turns(30);
    fabric.assertClean();
    fabric.portUp(b.t.discovery?.selected?.gid as string);
    fabric.audit.reclaim(dst);
    await until(() => b.t.connectionCount() === 0);
    const again = (await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 1 })) as RdmaConnection;
    await again.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: size }]), opts());
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    await again.close();
    await until(() => b.t.connectionCount() === 0);
    expect(fabric.counters).toMatchObject({ qps: base.qps - 2, cqs: base.cqs - 2 }); // the first connection's queues are gone on both sides
  });

  it('a CQ overrun loses the flushes: the deadline rejects only after the queue pairs are destroyed; nothing writes after', async () => {
    adversary({ lateWrites: 0.5 });
    const size = 16 * 4096;
    const { conn, dst, lr, remote } = await readPair('memory-region', size, { quiesceTimeoutMs: 100 });
    fabric.executionGate.close();
    const p = conn.execute(0, createTransferBatch('read', reversed(lr.handle, remote, 16, 4096)), { signal: new AbortController().signal, deadline: Date.now() + 100 });
    fabric.overrunNextCompletion();
    fabric.failExecution(0, WC.RemOpErr); // the first one fails: its completion overruns the CQ
    fabric.executionGate.open();
    const r = await settledQuiesced(p, conn, [dst]);
    expect(r.error).toBeInstanceOf(TimedOutError);
    expect(r.outstanding).toBe(0);
    expect(conn.isOpen).toBe(false);
    await turns(30);
    fabric.assertClean();
  });
});

describe('local exhaustion never tears down the connection (ENOMEM / EAGAIN / full send queue)', () => {
  for (const grants of ['memory-window', 'memory-region'] as const) {
    it(`SGE chains through injected ENOMEM/EAGAIN and part-accepted posts land exactly; the connection stays (${grants})`, async () => {
      adversary({ postFailures: 0.3, partialPosts: 0.5 });
      const n = 1024;
      const piece = 1024;
      const { a, b, conn } = await pair(1, { grants, maxSendWr: 8 });
      const src = pattern(n * piece, 5);
      const dst = new Uint8Array(2 * n * piece);
      const rr = await b.t.register({ kind: 'host', buffer: src });
      const lr = await a.t.register({ kind: 'host', buffer: dst });
      const remote = a.t.decodeRemote(rr.payload, 'host', src.length);
      const slot = (i: number): number => ((i * 389) % n) * 2; // scattered locally, back to back remotely: SGE lists
      const ranges = Array.from({ length: n }, (_, i) => ({ local: lr.handle, localOffset: slot(i) * piece, remote, remoteOffset: i * piece, length: piece }));
      let backpressure = 0;
      for (let round = 0; round < 4; round++) {
        dst.fill(0xee);
        for (;;) {
          const r = await settledQuiesced(conn.execute(0, createTransferBatch(round % 2 === 0 ? 'read' : 'write', ranges), opts()), conn, []);
          if (r.error === undefined) break;
          // Backpressure only when nothing of the batch started (nothing of it moved).
          expect(r.error).toBeInstanceOf(ResourceExhaustedError);
          backpressure++;
          expect(conn.isOpen).toBe(true);
        }
        if (round % 2 === 0) {
          for (let i = 0; i < n; i++) expect(Buffer.compare(dst.subarray(slot(i) * piece, (slot(i) + 1) * piece), src.subarray(i * piece, (i + 1) * piece))).toBe(0);
        } else {
          expect(src.every((x) => x === 0xee)).toBe(true);
          src.set(pattern(n * piece, 5));
        }
      }
      expect(conn.isOpen).toBe(true);
      expect(conn.outstanding).toBe(0);
      expect(conn.slotsInUse(0)).toBe(0);
      expect(fabric.postsInjected).toBeGreaterThan(0);
      expect(fabric.postsCut).toBeGreaterThan(0);
      expect(backpressure).toBeLessThan(fabric.postsInjected + 1);
      fabric.assertClean();
    });
  }

  it('a batch partly on the NIC whose next post is refused waits for room instead of failing', async () => {
    const { conn, dst, lr, remote, src } = await readPair('memory-region', 64 * 4096, { maxSendWr: 4 });
    fabric.completionGate.close();
    const p = conn.execute(0, createTransferBatch('read', reversed(lr.handle, remote, 64, 4096)), opts());
    expect(conn.slotsInUse(0)).toBe(4);
    fabric.failPost(0, 12); // the next post (after the first completion) is refused
    fabric.completionGate.open();
    await p;
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    expect(conn.isOpen).toBe(true);
  });
});

describe('memory handed back while work requests are in flight', () => {
  for (const dereg of ['refuse', 'sloppy'] as const) {
    it(`revoking a local registration with READs posted waits for them before deregistering (NIC: ${dereg})`, async () => {
      adversary({ dereg });
      const { a, conn, dst, lr, remote } = await readPair('memory-region', 16 * 4096);
      fabric.executionGate.close();
      const p = conn.execute(0, createTransferBatch('read', reversed(lr.handle, remote, 16, 4096)), opts());
      let revoked = false;
      const revoking = a.t.revoke(lr.handle).then(() => (revoked = true));
      await turns(10);
      expect(revoked).toBe(false);
      fabric.executionGate.open();
      await p;
      await revoking;
      expect(fabric.deregRefused).toBe(0);
      await turns(30);
      fabric.assertClean();
      expect(dst.some((x) => x !== 0)).toBe(true);
    });
  }
});
