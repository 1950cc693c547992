/**
 * Batches as chains of work requests, over simulated verbs (test/sim/verbs.ts): ranges back to
 * back on the remote side become one work request with an SGE list, work requests are posted in
 * chains with only the last one signaled, and the send queue is never overfilled. The simulator
 * executes SGE lists and unsignaled chains like an RC QP (completions only for signaled or failed
 * requests, slots retired only by a polled completion); this tests the transport's TypeScript,
 * not libibverbs or a NIC.
 */
import {
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  ResourceExhaustedError,
  createTransferBatch,
  type TransferRangeInit,
} from '@tensorwire/core';
import fc from 'fast-check';
import { beforeEach, describe, expect, it } from 'vitest';
import { RdmaTransport, type RdmaTransportOptions } from '../src/transport.js';
import { SimFabric, WC, type PostRecord } from './sim/verbs.js';
import { failure, opts, testNodes, until } from './window-suite.js';

let fabric = new SimFabric();
beforeEach(() => {
  fabric = new SimFabric();
});
const { pair } = testNodes('rdma-chains', (extra: Partial<RdmaTransportOptions>) =>
  new RdmaTransport({ backend: fabric.backend(extra.grants !== 'memory-region'), quiesceTimeoutMs: 2_000, ...extra }),
);

const sum = (xs: readonly number[]): number => xs.reduce((a, b) => a + b, 0);
const pattern = (n: number, seed: number): Uint8Array => new Uint8Array(n).map((_, i) => (i * 131 + seed * 17 + (i >> 8)) & 0xff);
/** Posts recorded from now on. */
function record(): () => PostRecord[] {
  const from = fabric.postLog.length;
  fabric.recordPosts = true;
  return () => fabric.postLog.slice(from);
}

/** A registered pair of buffers and 1,024 ranges of 1 KiB: back to back remotely, scattered locally. */
async function scattered(grants: 'memory-window' | 'memory-region', extra: Partial<RdmaTransportOptions> = {}, n = 1024, piece = 1024) {
  const { a, b, conn } = await pair(1, { grants, ...extra });
  const src = pattern(n * piece, 1);
  const dst = new Uint8Array(2 * n * piece).fill(0xee);
  const rr = await b.t.register({ kind: 'host', buffer: src });
  const lr = await a.t.register({ kind: 'host', buffer: dst });
  const remote = a.t.decodeRemote(rr.payload, 'host', src.length);
  // Local slot of range i: an odd permutation of every other piece, so no two neighbours touch.
  const slot = (i: number): number => ((i * 389) % n) * 2;
  const ranges: TransferRangeInit[] = Array.from({ length: n }, (_, i) => ({ local: lr.handle, localOffset: slot(i) * piece, remote, remoteOffset: i * piece, length: piece }));
  return { a, b, conn, src, dst, rr, lr, remote, ranges, slot, piece, n };
}

describe('batches become chains of work requests with SGE lists (simulated verbs)', () => {
  for (const grants of ['memory-region', 'memory-window'] as const) {
    it(`1,024 small ranges back to back remotely move as few chains of SGE lists, exactly the right bytes (${grants})`, async () => {
      const { conn, src, dst, ranges, slot, piece, n } = await scattered(grants);
      if (grants === 'memory-window') await conn.execute(0, createTransferBatch('read', [ranges[0] as TransferRangeInit]), opts()); // bind the windows first
      const posts = record();
      const completions = fabric.counters.completions;
      await conn.execute(0, createTransferBatch('read', ranges), opts());
      const log = posts();
      const wrs = log.flatMap((p) => p.sges);
      // 30 SGEs per work request (the device's max_sge), 32 work requests per chain (a quarter of the send queue).
      expect(wrs).toEqual([...Array<number>(34).fill(30), 4]);
      expect(log.map((p) => p.sges.length)).toEqual([32, 3]);
      expect(sum(log.flatMap((p) => p.bytes))).toBe(n * piece);
      // One completion per chain: only the last work request of each is signaled.
      expect(fabric.counters.completions - completions).toBe(log.length);
      for (let i = 0; i < n; i++) {
        const at = slot(i) * piece;
        expect(Buffer.compare(dst.subarray(at, at + piece), src.subarray(i * piece, (i + 1) * piece))).toBe(0);
        expect(dst.subarray(at + piece, at + 2 * piece).every((x) => x === 0xee)).toBe(true); // the gaps are untouched
      }
      expect(conn.outstanding).toBe(0);
      expect(conn.slotsInUse(0)).toBe(0);
    });
  }

  it('WRITE gathers the scattered local pieces into the contiguous remote range', async () => {
    const { conn, src, dst, ranges, slot, piece, n } = await scattered('memory-region');
    const local = pattern(dst.length, 7);
    dst.set(local);
    const posts = record();
    await conn.execute(0, createTransferBatch('write', ranges), opts());
    expect(posts().flatMap((p) => p.sges)).toEqual([...Array<number>(34).fill(30), 4]);
    // `src` is the remote registration: it now holds the local pieces, in range order.
    for (let i = 0; i < n; i++) expect(Buffer.compare(src.subarray(i * piece, (i + 1) * piece), local.subarray(slot(i) * piece, (slot(i) + 1) * piece))).toBe(0);
  });

  it('ranges back to back on both sides become one SGE; the per-request byte cap (maxChunkBytes) starts a new request', async () => {
    const { a, b, conn } = await pair(1, { grants: 'memory-region', maxChunkBytes: 64 * 1024 });
    const src = pattern(1 << 20, 3);
    const dst = new Uint8Array(1 << 20);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', src.length);
    // 256 ranges of 4 KiB, back to back on both sides: one SGE per 64 KiB work request.
    const ranges = Array.from({ length: 256 }, (_, i) => ({ local: lr.handle, localOffset: i * 4096, remote, remoteOffset: i * 4096, length: 4096 }));
    const posts = record();
    await conn.execute(0, createTransferBatch('read', ranges), opts());
    const log = posts();
    expect(log.flatMap((p) => p.sges)).toEqual(Array<number>(16).fill(1));
    expect(log.flatMap((p) => p.bytes)).toEqual(Array<number>(16).fill(64 * 1024));
    expect(Buffer.compare(dst, src)).toBe(0);
  });

  it('chains respect max_sge (max_sge_rd for READ) and never hold more than maxSendWr slots', async () => {
    fabric = new SimFabric({ maxSge: 4, maxSgeRd: 3 });
    const { conn, src, dst, ranges, slot, piece, n, a } = await scattered('memory-region', { maxSendWr: 8 }, 200, 512);
    expect(a.t.sgeLimits).toEqual({ read: 3, write: 4 });
    const posts = record();
    const completions = fabric.counters.completions;
    await conn.execute(0, createTransferBatch('read', ranges), opts());
    let log = posts();
    expect(log.flatMap((p) => p.sges)).toEqual([...Array<number>(66).fill(3), 2]);
    for (const p of log) {
      expect(p.sges.length).toBeLessThanOrEqual(2); // a quarter of 8, rounded up
      expect(p.slotsHeld).toBeLessThanOrEqual(8);
    }
    expect(fabric.counters.completions - completions).toBe(log.length);
    expect(fabric.postsRefused).toBe(0);
    expect(fabric.peakSlotsHeld).toBeLessThanOrEqual(8);
    for (let i = 0; i < n; i++) expect(Buffer.compare(dst.subarray(slot(i) * piece, slot(i) * piece + piece), src.subarray(i * piece, (i + 1) * piece))).toBe(0);
    const writes = record();
    await conn.execute(0, createTransferBatch('write', ranges), opts());
    log = writes();
    expect(log.flatMap((p) => p.sges)).toEqual(Array<number>(50).fill(4));
    expect(fabric.postsRefused).toBe(0);
    expect(fabric.peakSlotsHeld).toBeLessThanOrEqual(8);
  });

  it('several batches on one stream share its send queue: slots come back only with their chain\'s completion', async () => {
    fabric = new SimFabric({ maxSge: 2 });
    const { conn, src, dst, ranges, slot, piece, n } = await scattered('memory-region', { maxSendWr: 6 }, 120, 256);
    fabric.completionGate.close();
    const posts = record();
    const runs = [0, 1, 2].map((k) => conn.execute(0, createTransferBatch('read', ranges.slice(k * 40, (k + 1) * 40)), opts()));
    // 60 work requests wait behind a send queue of 6, in chains of 2: three chains posted.
    await new Promise((r) => setTimeout(r, 20));
    expect(posts().length).toBe(3);
    expect(conn.slotsInUse(0)).toBe(6);
    fabric.completionGate.open();
    await Promise.all(runs);
    expect(fabric.postsRefused).toBe(0);
    expect(fabric.peakSlotsHeld).toBe(6);
    expect(conn.slotsInUse(0)).toBe(0);
    for (let i = 0; i < n; i++) expect(Buffer.compare(dst.subarray(slot(i) * piece, slot(i) * piece + piece), src.subarray(i * piece, (i + 1) * piece))).toBe(0);
  });

  it('any batch reads exactly its ranges: fast-check over lengths, contiguity and SGE limits', async () => {
    // The remote registration straddles a 4 GiB boundary: remote addresses carry into the high word.
    fabric = new SimFabric({ maxSge: 3, firstAddress: 0x7f00ffff8000n });
    const { a, b, conn } = await pair(1, { grants: 'memory-region', maxSendWr: 8, maxChunkBytes: 4096 });
    const size = 1 << 16;
    const src = pattern(size, 9);
    const dst = new Uint8Array(size);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    expect((rr.handle as { addr: bigint }).addr).toBe(0x7f00ffff8000n);
    const piece = fc.record({ len: fc.integer({ min: 1, max: 3000 }), gap: fc.integer({ min: 0, max: 2 }), follow: fc.boolean(), at: fc.nat() });
    await fc.assert(
      fc.asyncProperty(fc.array(piece, { minLength: 1, maxLength: 40 }), async (pieces) => {
        dst.fill(0);
        const ranges: TransferRangeInit[] = [];
        let local = 0;
        let remoteEnd = -1;
        for (const p of pieces) {
          if (local + p.len > size) break;
          // Back to back with the previous range remotely when asked and it fits, else anywhere.
          const ro = p.follow && remoteEnd >= 0 && remoteEnd + p.len <= size ? remoteEnd : p.at % (size - p.len + 1);
          ranges.push({ local: lr.handle, localOffset: local, remote, remoteOffset: ro, length: p.len });
          remoteEnd = ro + p.len;
          local += p.len + p.gap; // a gap of 0 makes the local sides back to back too
        }
        const posts = record();
        await conn.execute(0, createTransferBatch('read', ranges), opts());
        const expected = new Uint8Array(size);
        for (const r of ranges) expected.set(src.subarray(r.remoteOffset, r.remoteOffset + r.length), r.localOffset);
        expect(Buffer.compare(dst, expected)).toBe(0);
        for (const p of posts()) {
          for (const s of p.sges) expect(s).toBeLessThanOrEqual(3);
          for (const x of p.bytes) expect(x).toBeLessThanOrEqual(4096);
          expect(p.slotsHeld).toBeLessThanOrEqual(8);
        }
        expect(sum(posts().flatMap((p) => p.bytes))).toBe(sum(ranges.map((r) => r.length)));
      }),
      { numRuns: 60 },
    );
    expect(fabric.postsRefused).toBe(0);
  });
});

describe('failures of chained batches (simulated verbs)', () => {
  it('an error completion in the middle of a chain fails the batch as a whole, only after every chain has drained', async () => {
    const { conn, dst, ranges } = await scattered('memory-region');
    let closedWith: unknown = 'open';
    conn.onClose((e) => (closedWith = e));
    const completions = fabric.counters.completions;
    const posts = record();
    // The fifth work request of the first chain (unsignaled) fails; the rest of that chain and
    // the whole second chain flush.
    fabric.failExecution(4, WC.RemOpErr);
    let settledWith: unknown = 'pending';
    let outstandingAtSettle = -1;
    const p = conn.execute(0, createTransferBatch('read', ranges), opts()).then(
      () => (settledWith = undefined),
      (e: unknown) => {
        outstandingAtSettle = conn.outstanding;
        settledWith = e;
      },
    );
    await p;
    expect(posts().map((x) => x.sges.length)).toEqual([32, 3]);
    expect(settledWith).toBeInstanceOf(ConnectionBrokenError);
    // The cause, from the failed request, not the flushes it led to.
    expect((settledWith as Error).message).toMatch(/remote operation error \(status 11/);
    expect(outstandingAtSettle).toBe(0);
    // Errors complete whether signaled or not: the failed one, 27 flushes in its chain, 3 in the next.
    expect(fabric.counters.completions - completions).toBe(1 + 27 + 3);
    expect(conn.isOpen).toBe(false);
    expect(closedWith).toBeInstanceOf(ConnectionBrokenError);
    const snapshot = Buffer.from(dst);
    await new Promise((r) => setTimeout(r, 20));
    expect(Buffer.compare(snapshot, Buffer.from(dst))).toBe(0); // nothing lands after the settle
  });

  it('a remote access error in a chain is RemoteRejected for the batch and fails the other streams of the transfer with the cause', async () => {
    const { a, b, conn } = await pair(2, { grants: 'memory-region' });
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(64 * 1024) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(64 * 1024) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 64 * 1024);
    const half = (s: number) =>
      createTransferBatch(
        'read',
        Array.from({ length: 16 }, (_, i) => ({ local: lr.handle, localOffset: s * 32768 + (15 - i) * 2048, remote, remoteOffset: s * 32768 + (15 - i) * 2048, length: 2048 })),
      );
    fabric.completionGate.close(); // both streams' chains are on the NIC before the failure is seen
    fabric.failExecution(1, WC.RemAccessErr);
    const transfer = {};
    const o = { ...opts(), transfer };
    const both = [failure(conn.execute(0, half(0), o)), failure(conn.execute(1, half(1), o))];
    await until(() => fabric.executed >= 2);
    fabric.completionGate.open();
    const [e0, e1] = await Promise.all(both);
    for (const e of [e0, e1]) {
      expect(e).toBeInstanceOf(RemoteRejectedError);
      expect((e as RemoteRejectedError).remoteCode).toBe('remote-access');
    }
    expect(conn.outstanding).toBe(0);
  });

  it('a refused post with nothing of the batch started is ResourceExhausted; the connection stays and the same batch then runs', async () => {
    const { conn, src, dst, ranges, slot, piece, n } = await scattered('memory-region');
    const batch = createTransferBatch('read', ranges);
    const posted = fabric.counters.postedWrs;
    fabric.failPost(0, 11); // EAGAIN
    const err = await failure(conn.execute(0, batch, opts()));
    expect(err).toBeInstanceOf(ResourceExhaustedError);
    expect(fabric.counters.postedWrs).toBe(posted);
    expect(conn.isOpen).toBe(true);
    expect(conn.outstanding).toBe(0);
    await conn.execute(0, batch, opts());
    for (let i = 0; i < n; i++) expect(Buffer.compare(dst.subarray(slot(i) * piece, slot(i) * piece + piece), src.subarray(i * piece, (i + 1) * piece))).toBe(0);
  });

  it('a batch refused at its post does not hold up the batches queued behind it', async () => {
    const { a, b, conn } = await pair(1, { grants: 'memory-region', maxSendWr: 1 });
    const rr = await b.t.register({ kind: 'host', buffer: pattern(3 * 4096, 4) });
    const dst = new Uint8Array(3 * 4096);
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', 3 * 4096);
    const one = (i: number) => createTransferBatch('read', [{ local: lr.handle, localOffset: i * 4096, remote, remoteOffset: i * 4096, length: 4096 }]);
    fabric.completionGate.close();
    const first = conn.execute(0, one(0), opts()); // takes the only slot
    const second = failure(conn.execute(0, one(1), opts()));
    const third = conn.execute(0, one(2), opts());
    fabric.failPost(0); // the second batch's post
    fabric.completionGate.open();
    await first;
    expect(await second).toBeInstanceOf(ResourceExhaustedError);
    await third;
    expect(dst.subarray(8192).every((x, i) => x === (pattern(3 * 4096, 4)[8192 + i] as number))).toBe(true);
    expect(conn.isOpen).toBe(true);
  });

  it('a refused post after part of the batch was posted is local exhaustion: the rest waits for room and the batch completes, the connection stays', async () => {
    const { conn, ranges, dst, src, slot, piece, n } = await scattered('memory-region');
    fabric.completionGate.close();
    fabric.failPost(1); // the second chain: ENOMEM
    let settled = false;
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts())).finally(() => (settled = true));
    await new Promise((r) => setTimeout(r, 20));
    expect(settled).toBe(false); // the first chain is still on the NIC
    fabric.completionGate.open();
    expect(await p).toBeUndefined(); // before the fix: ConnectionBroken, and the connection torn down
    for (let i = 0; i < n; i++) expect(Buffer.compare(dst.subarray(slot(i) * piece, (slot(i) + 1) * piece), src.subarray(i * piece, (i + 1) * piece))).toBe(0);
    expect(conn.isOpen).toBe(true);
    expect(conn.outstanding).toBe(0);
  });

  it('an abort with chains on the NIC quiesces (QP to ERR, every chain flushed) before rejecting', async () => {
    const { conn, ranges } = await scattered('memory-region', { maxSendWr: 16 });
    fabric.completionGate.close();
    const ac = new AbortController();
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), { signal: ac.signal, deadline: Date.now() + 60_000 }));
    await until(() => conn.outstanding === 4); // 16 slots in chains of 4; 31 work requests wait
    ac.abort();
    await new Promise((r) => setTimeout(r, 20));
    expect(conn.outstanding).toBe(4); // not settled: the held completions have not arrived
    fabric.completionGate.open();
    expect((await p) as Error).toHaveProperty('code', 'TW_ABORTED');
    expect(conn.outstanding).toBe(0);
    expect(conn.isOpen).toBe(false);
  });

  it('UNBIND racing queued chains: the rest of the batch fails as grant-revoked and is never posted', async () => {
    const { b, conn, rr, ranges } = await scattered('memory-window', { maxSendWr: 8 });
    await conn.execute(0, createTransferBatch('read', [ranges[0] as TransferRangeInit]), opts()); // windows bound, keys cached
    fabric.completionGate.close();
    const posted = fabric.counters.postedWrs;
    const posts = record();
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts()));
    // 35 work requests in chains of 2: four chains (8 slots) on the NIC, the rest queued.
    expect(posts().map((x) => x.sges.length)).toEqual([2, 2, 2, 2]);
    const executed = fabric.executed;
    await until(() => fabric.executed === executed + 8);
    await b.t.revoke(rr.handle);
    await until(() => conn.cachedGrants === 0); // UNBIND arrived
    fabric.completionGate.open();
    const err = await p;
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('grant-revoked');
    expect(fabric.counters.postedWrs).toBe(posted + 8);
    expect(conn.isOpen).toBe(true);
    expect(conn.outstanding).toBe(0);
  });

  it('revoking the local registration while chains are queued: nothing more is posted, revoke waits for the chains on the NIC', async () => {
    const { a, conn, lr, ranges } = await scattered('memory-region', { maxSendWr: 8 });
    fabric.completionGate.close();
    const posted = fabric.counters.postedWrs;
    const mrs = fabric.counters.mrs;
    const p = failure(conn.execute(0, createTransferBatch('read', ranges), opts()));
    let revoked = false;
    const revoking = a.t.revoke(lr.handle).then(() => (revoked = true));
    await new Promise((r) => setTimeout(r, 20));
    expect(revoked).toBe(false); // four chains still hold the memory
    expect(fabric.counters.mrs).toBe(mrs);
    fabric.completionGate.open();
    await revoking;
    expect(await p).toBeInstanceOf(InvalidInputError);
    expect(fabric.counters.postedWrs).toBe(posted + 8);
    expect(fabric.counters.mrs).toBe(mrs - 1);
    expect(conn.isOpen).toBe(true);
  });

  it('the same batch posted again is checked again: a revoked local fails it, naming the request', async () => {
    const { a, b, conn } = await pair(1, { grants: 'memory-region' });
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(8192) });
    const l1 = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const l2 = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 8192);
    const batch = createTransferBatch('read', [
      { local: l1.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096, request: 3 },
      { local: l2.handle, localOffset: 0, remote, remoteOffset: 4096, length: 4096, request: 5 },
    ]);
    await conn.execute(0, batch, opts());
    await a.t.revoke(l2.handle);
    const posted = fabric.counters.postedWrs;
    const err = await failure(conn.execute(0, batch, opts()));
    expect(err).toBeInstanceOf(InvalidInputError);
    expect((err as InvalidInputError).details).toMatchObject({ field: 'local', request: 5 });
    expect(fabric.counters.postedWrs).toBe(posted);
  });

  it('bad ranges are InvalidInput naming the request, and nothing is posted', async () => {
    const { a, b, conn } = await pair(1, { grants: 'memory-region' });
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 4096);
    const ok = { local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 1024 };
    const posted = fabric.counters.postedWrs;
    const cases: [Partial<TransferRangeInit>, string][] = [
      [{ localOffset: 3500 }, 'localOffset'],
      [{ remoteOffset: 3073 }, 'remoteOffset'],
      [{ length: 0 }, 'length'],
      [{ localOffset: 0.5 }, 'localOffset'],
      [{ local: {} }, 'local'],
      [{ remote: {} }, 'remote'],
    ];
    for (const [bad, field] of cases) {
      const err = await failure(conn.execute(0, createTransferBatch('read', [ok, { ...ok, ...bad, request: 9 }]), opts()));
      expect(err).toBeInstanceOf(InvalidInputError);
      expect((err as InvalidInputError).details).toMatchObject({ field, request: 9 });
    }
    const batch = createTransferBatch('read', [ok]);
    batch.ranges[1] = 4; // a local index the batch does not have
    expect(((await failure(conn.execute(0, batch, opts()))) as InvalidInputError).details).toMatchObject({ field: 'local' });
    expect(fabric.counters.postedWrs).toBe(posted);
    expect(conn.isOpen).toBe(true);
  });
});
