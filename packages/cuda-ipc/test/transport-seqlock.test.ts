/**
 * A peer's one-sided read of a pool slot through the cuda-ipc transport copies under the
 * slot's seqlock (invariant 11): an owner process rewrites the slot continuously, every write
 * one value repeated, and this process reads it through the transport, whole and in part,
 * many times. No successful read may ever show mixed values.
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { afterAll, describe, expect, it } from 'vitest';
import { InvalidInputError, RemoteRejectedError, TimedOutError, TransferEngine, createTransferBatch, defaultHostId, silentLogger, type TransferBatch, type TransportHost } from '@tensorwire/core';
import { CudaIpcTransport, TensorPool, allocateSharedMemory } from '../src/index.js';
import { native } from '../src/native.js';
import { fixture, killChildren, uniqueOwner } from './helpers.js';

afterAll(killChildren);

const DATA_OFFSET = 4096;

function uniform(a: Uint32Array): boolean {
  const v = a[0];
  for (let i = 1; i < a.length; i++) if (a[i] !== v) return false;
  return true;
}

describe('cuda-ipc transport reads of a pool slot (invariant 11)', () => {
  it.each([
    ['in one chunk', undefined, false],
    ['in 64 KiB chunks (every chunk of a read must see one generation)', 64 * 1024, false],
    ['as 64 scattered 4 KiB requests in one batch (every range of a batch must see one generation)', undefined, true],
  ])('never returns a torn copy while the owner process writes the slot, %s', async (_label, chunkBytes, scattered) => {
    const elems = 64 * 1024; // 256 KiB: a copy takes long enough to overlap writes often
    const holderNode = `sh${process.pid}`;
    // Chunked reads are made of several copies: against a writer that never pauses almost every
    // one is refused, so there the writer rests 1 ms between writes and some reads get through.
    const pauseMs = chunkBytes === undefined && !scattered ? 0 : 1;
    const holder = fork(fixture('slot-holder.mjs'), [uniqueOwner('sh'), String(elems), holderNode, String(pauseMs)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    const [ready] = (await once(holder, 'message')) as [{ endpoint: string; descriptor: string }];
    const endpoint = new Uint8Array(Buffer.from(ready.endpoint, 'base64'));
    const descriptor = new Uint8Array(Buffer.from(ready.descriptor, 'base64'));
    // Two requester engines (two connections to the holder), one whole-slot and one sub-range reader.
    const engines = [0, 1].map(
      (i) =>
        new TransferEngine({
          nodeId: `sr${i}${chunkBytes ?? 0}${scattered ? 's' : ''}${process.pid}`,
          transports: [new CudaIpcTransport()],
          logger: silentLogger,
          metrics: false,
          ...(chunkBytes !== undefined ? { chunkBytes, streamsPerPeer: 2 } : {}),
        }),
    );
    try {
      await Promise.all(engines.map((e) => e.start()));
      const [ea, eb] = engines as [TransferEngine, TransferEngine];
      const whole = await ea.register({ kind: 'host', buffer: new Uint8Array(elems * 4) });
      const part = await eb.register({ kind: 'host', buffer: new Uint8Array(elems * 2) });
      const wholeView = new Uint32Array((whole.memory as { buffer: Uint8Array }).buffer.buffer, 0, elems);
      // Bytes [4 + 4·1000, +elems·2 - 8) of the slot into part at offset 4: an unaligned-to-the-page range.
      const partLen = elems * 2 - 8;
      const partView = new Uint32Array((part.memory as { buffer: Uint8Array }).buffer.buffer, 4, partLen / 4);
      // Scattered: local block i <- slot block 63 - i, so no two requests merge; the engine puts
      // them into one batch (the transport has one stream), and the transport copies the batch's
      // ranges of the slot under one seqlock read.
      const block = (elems * 4) / 64;
      const scatter = Array.from({ length: 64 }, (_, i) => ({ local: whole, localOffset: i * block, remote: descriptor, remoteOffset: (63 - i) * block, length: block }));
      let ok = 0;
      let timedOut = 0;
      let rewritten = 0;
      let torn = 0;
      const seen = new Set<number>();
      for (let i = 0; i < 2000; i++) {
        for (const [e, reqs, view] of [
          [ea, scattered ? scatter : [{ local: whole, remote: descriptor }], wholeView],
          [eb, [{ local: part, localOffset: 4, remote: descriptor, remoteOffset: 4 + 4 * 1000, length: partLen }], partView],
        ] as const) {
          try {
            const report = await e.read(endpoint, reqs);
            if (scattered && e === ea) expect(report.ranges).toBe(64);
            expect(report.transport).toBe('cuda-ipc');
          } catch (err) {
            if (err instanceof TimedOutError) {
              timedOut++;
              continue;
            }
            // A read split into chunks that saw two generations is refused, never returned.
            if ((chunkBytes !== undefined || scattered) && err instanceof RemoteRejectedError && err.remoteCode === 'slot-rewritten') {
              rewritten++;
              continue;
            }
            throw err;
          }
          ok++;
          if (!uniform(view)) torn++;
          seen.add(view[0] as number);
        }
      }
      holder.send({ op: 'stop' });
      const [{ writes }] = (await once(holder, 'message')) as [{ writes: number }];
      await once(holder, 'exit');
      expect(torn, `torn reads (${ok} successful, ${timedOut} timed out, ${rewritten} refused as rewritten, ${writes} writes)`).toBe(0);
      expect(ok + timedOut + rewritten).toBe(4000);
      if (chunkBytes === undefined && !scattered) expect(ok).toBeGreaterThan(3000);
      else expect(ok).toBeGreaterThan(100); // chunked and scattered reads did succeed, and were checked
      // The reads really overlapped many different writes (otherwise the test proves nothing).
      expect(writes).toBeGreaterThan(100);
      if (chunkBytes === undefined) expect(seen.size).toBeGreaterThan(10);
      console.info(`transport seqlock ${scattered ? 'scattered' : (chunkBytes ?? 'whole')}: ${ok} reads, ${timedOut} timed out, ${rewritten} refused as rewritten, ${seen.size} values seen, ${writes} writes`);
    } finally {
      holder.kill('SIGKILL');
      await Promise.all(engines.map((e) => e.close()));
    }
  });

  it('a transfer whose batches copied a slot at two generations is refused; re-posted batches, new transfers and direct calls are not', async () => {
    const pool = new TensorPool({ owner: uniqueOwner('sg') });
    const hosts: TransportHost[] = ['ga', 'gb'].map((n) => ({ identity: { nodeId: `${n}${process.pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
    const [ta, tb] = [new CudaIpcTransport(), new CudaIpcTransport()];
    try {
      await ta.start(hosts[0] as TransportHost);
      await tb.start(hosts[1] as TransportHost);
      const id = await pool.register({ dtype: 'uint8', shape: [8192] });
      pool.writeSync(id, new Uint8Array(8192).fill(1));
      const view = pool.readSync(id);
      const reg = await tb.register({ kind: 'host', buffer: view.buffer as Uint8Array });
      const dst = new Uint8Array(8192);
      const local = await ta.register({ kind: 'host', buffer: dst });
      const remote = ta.decodeRemote(reg.payload, 'host', 8192);
      const deadline = Date.now() + 10_000;
      // The transport has one stream (capabilities.maxStreams), but a transfer may still be posted
      // as several batches: the generation check is per transfer object, not per stream.
      const conn = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { signal: new AbortController().signal, deadline, streams: 2 });
      expect(conn.streams).toBe(1);
      const half = (at: number, r: unknown = remote): TransferBatch => createTransferBatch('read', [{ local: local.handle, localOffset: at, remote: r, remoteOffset: at, length: 4096 }]);
      const signal = new AbortController().signal; // one signal for everything: it does not name transfers
      const rejection = (p: Promise<void>): Promise<unknown> =>
        p.then(
          () => undefined,
          (e: unknown) => e,
        );
      // One transfer (one ExecuteOptions.transfer) of two batches: first half, the owner
      // rewrites the slot, second half. The halves would mix two versions: refused.
      const one = {};
      await conn.execute(0, half(0), { signal, deadline, transfer: one });
      pool.writeSync(id, new Uint8Array(8192).fill(2));
      const err = await rejection(conn.execute(0, half(4096), { signal, deadline, transfer: one }));
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('slot-rewritten');
      // The same slot reached through a grant of its own (a second registration of the same
      // view, another descriptor) is the same slot.
      const two = {};
      const reg2 = await tb.register({ kind: 'host', buffer: view.buffer as Uint8Array });
      const other = ta.decodeRemote(reg2.payload, 'host', 8192);
      await conn.execute(0, half(0), { signal, deadline, transfer: two });
      pool.writeSync(id, new Uint8Array(8192).fill(3));
      const err2 = await rejection(conn.execute(0, half(4096, other), { signal, deadline, transfer: two }));
      expect((err2 as RemoteRejectedError).remoteCode).toBe('slot-rewritten');
      // A batch posted again (the engine retrying it) replaces its earlier copy.
      const three = {};
      const first = half(0);
      await conn.execute(0, first, { signal, deadline, transfer: three });
      pool.writeSync(id, new Uint8Array(8192).fill(4));
      await conn.execute(0, first, { signal, deadline, transfer: three });
      await conn.execute(0, half(4096), { signal, deadline, transfer: three });
      expect(dst.every((x) => x === 4)).toBe(true);
      // Without a transfer object (a direct caller), each execute() call stands alone: the same
      // signal, batch and decoded remote keep working across rewrites, and one batch of both
      // halves (two ranges of one slot) is one snapshot.
      await conn.execute(0, first, { signal, deadline });
      pool.writeSync(id, new Uint8Array(8192).fill(5));
      const both = createTransferBatch('read', [
        { local: local.handle, localOffset: 4096, remote, remoteOffset: 4096, length: 4096 },
        { local: local.handle, localOffset: 0, remote: other, remoteOffset: 0, length: 4096 },
      ]);
      await conn.execute(0, both, { signal, deadline });
      expect(dst.every((x) => x === 5)).toBe(true);
      await conn.close();
      await tb.revoke(reg.handle);
      await tb.revoke(reg2.handle);
      view.dispose();
    } finally {
      await Promise.all([ta.close(), tb.close()]);
      await pool.close();
    }
  });

  it('seqCopyRange checks the range against the mapping and the segment kind', async () => {
    const pool = new TensorPool({ owner: uniqueOwner('sc') });
    try {
      const id = await pool.register({ dtype: 'uint8', shape: [100] });
      pool.writeSync(id, new Uint8Array(100).fill(7));
      const view = pool.readSync(id);
      const mapping = (view.buffer as Uint8Array).buffer as ArrayBuffer;
      const dst = new Uint8Array(100);
      const gen = native.seqCopyRange(mapping, DATA_OFFSET + 10, 90, dst);
      expect(gen).toBe(view.generation);
      expect(dst.subarray(0, 90).every((x) => x === 7)).toBe(true);
      const bad: [number, number, Uint8Array][] = [
        [DATA_OFFSET - 1, 1, dst], // inside the header
        [0, 10, dst],
        [DATA_OFFSET + 1, 100, dst], // one past the end
        [DATA_OFFSET + 101, 0, dst],
        [DATA_OFFSET, 2 ** 53 - 1, dst], // would overflow
        [2 ** 53 - 1, 1, dst],
        [DATA_OFFSET, 100, new Uint8Array(99)], // destination too small
      ];
      for (const [offset, length, into] of bad) {
        expect(() => native.seqCopyRange(mapping, offset, length, into), `${offset}+${length}`).toThrow(InvalidInputError);
      }
      expect(() => native.seqCopyRange(new ArrayBuffer(8192), DATA_OFFSET, 1, dst)).toThrow(InvalidInputError);
      view.dispose();
      // A shared region without a seqlock is a pool-kind segment too; its generation stays even.
      const shared = allocateSharedMemory(64, 'scr');
      shared.fill(3);
      expect(native.seqCopyRange(shared.buffer as ArrayBuffer, DATA_OFFSET, 64, dst)).toBe(0n);
      expect(dst.subarray(0, 64).every((x) => x === 3)).toBe(true);
    } finally {
      await pool.close();
    }
  });

  it('seqCopyRange times out on a slot whose writer died mid-write', async () => {
    const pool = new TensorPool({ owner: uniqueOwner('st') });
    try {
      const id = await pool.register({ dtype: 'uint8', shape: [16] });
      const view = pool.readSync(id);
      const mapping = (view.buffer as Uint8Array).buffer as ArrayBuffer;
      const gen = new BigUint64Array(mapping, 128, 1);
      gen[0] = (gen[0] as bigint) | 1n; // a writer that took the lock and died
      const t0 = Date.now();
      expect(() => native.seqCopyRange(mapping, DATA_OFFSET, 16, new Uint8Array(16))).toThrow(TimedOutError);
      expect(Date.now() - t0).toBeLessThan(15_000);
      gen[0] = (gen[0] as bigint) + 1n;
      view.dispose();
    } finally {
      await pool.close();
    }
  });
});
