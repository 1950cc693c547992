/**
 * Multi-threaded copies of host batches (`copyThreads`): a batch whose group of ranges holds at
 * least 1 MiB is split by bytes over several native threads. They must move exactly the bytes
 * the single-threaded copy moves (ranges cut anywhere, reads and writes), keep one seqlock
 * snapshot per pool slot per batch across all the threads (a slot rewritten by its owner
 * process during the reads never shows mixed values), fail bad input before any byte moves,
 * and refuse a revoked grant.
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { availableParallelism } from 'node:os';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import fc from 'fast-check';
import {
  InvalidInputError,
  RemoteRejectedError,
  TimedOutError,
  TransferEngine,
  createTransferBatch,
  defaultHostId,
  silentLogger,
  type TransferRangeInit,
  type TransportConnection,
  type TransportHost,
} from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory, releaseSharedMemory } from '../src/index.js';
import { fixture, killChildren, uniqueOwner } from './helpers.js';

afterAll(killChildren);

const REGION = 6 * 2 ** 20;
const pattern = (x: number): number => (x * 31 + (x >> 9) + 7) & 255;
const signal = new AbortController().signal;
const opts = (): { signal: AbortSignal; deadline: number } => ({ signal, deadline: Date.now() + 20_000 });

let holder: CudaIpcTransport;
let threaded: CudaIpcTransport;
let single: CudaIpcTransport;
let conns: { threaded: TransportConnection; single: TransportConnection };
let region: Uint8Array;
let regionReg: { handle: object; payload: Uint8Array };

beforeAll(async () => {
  const hosts: TransportHost[] = ['ch', 'ct', 'cs'].map((n) => ({ identity: { nodeId: `${n}${process.pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
  holder = new CudaIpcTransport();
  threaded = new CudaIpcTransport({ copyThreads: 4 });
  single = new CudaIpcTransport({ copyThreads: 1 });
  await Promise.all([holder.start(hosts[0] as TransportHost), threaded.start(hosts[1] as TransportHost), single.start(hosts[2] as TransportHost)]);
  region = allocateSharedMemory(REGION, 'copythreads');
  for (let i = 0; i < REGION; i++) region[i] = pattern(i);
  regionReg = await holder.register({ kind: 'host', buffer: region });
  const c = (t: CudaIpcTransport): Promise<TransportConnection> => t.connect((hosts[0] as TransportHost).identity, holder.endpoint(), { ...opts(), streams: 1 });
  conns = { threaded: await c(threaded), single: await c(single) };
});

afterAll(async () => {
  await conns?.threaded.close();
  await conns?.single.close();
  if (region) releaseSharedMemory(region);
  await Promise.all([holder?.close(), threaded?.close(), single?.close()]);
});

/** A local buffer registered with `t`. */
async function local(t: CudaIpcTransport, bytes: number, fill: number): Promise<{ handle: object; buffer: Uint8Array }> {
  const buffer = new Uint8Array(bytes).fill(fill);
  return { handle: (await t.register({ kind: 'host', buffer })).handle, buffer };
}

describe('cuda-ipc copyThreads', () => {
  it('validates the option', () => {
    for (const bad of [0, 17, 1.5, Number.NaN, -1]) expect(() => new CudaIpcTransport({ copyThreads: bad })).toThrow(InvalidInputError);
    expect(new CudaIpcTransport({ copyThreads: 16 }).copyThreads).toBe(16);
    // The default: half the cores this process may use, 1 to 4.
    const half = Math.max(1, Math.min(4, Math.floor(availableParallelism() / 2)));
    expect(new CudaIpcTransport().copyThreads).toBe(half);
  });

  it('random batches of at least 1 MiB land exactly the bytes a single-threaded copy lands, and nothing else (fast-check)', async () => {
    const DST = 4 * 2 ** 20;
    const a = await local(threaded, DST, 0xee);
    const b = await local(single, DST, 0xee);
    const ra = threaded.decodeRemote(regionReg.payload, 'host', REGION);
    const rb = single.decodeRemote(regionReg.payload, 'host', REGION);
    await fc.assert(
      fc.asyncProperty(
        // 1..40 ranges, most of them large, so the shares' cuts fall inside ranges and between them.
        fc.array(fc.record({ length: fc.oneof(fc.integer({ min: 1, max: 4096 }), fc.integer({ min: 64 * 1024, max: 700 * 1024 })), remote: fc.nat(REGION - 1), gap: fc.nat(64) }), { minLength: 1, maxLength: 40 }),
        async (spec) => {
          // Disjoint destinations in order, each range from anywhere in the region.
          let at = 0;
          const ranges: { localOffset: number; remoteOffset: number; length: number }[] = [];
          for (const r of spec) {
            const length = Math.min(r.length, REGION - r.remote);
            if (at + r.gap + length > DST) break;
            ranges.push({ localOffset: at + r.gap, remoteOffset: r.remote, length });
            at += r.gap + length;
          }
          const bytes = ranges.reduce((s, r) => s + r.length, 0);
          fc.pre(bytes >= 2 ** 20);
          a.buffer.fill(0xee);
          b.buffer.fill(0xee);
          await conns.threaded.execute(0, createTransferBatch('read', ranges.map((r, i) => ({ ...r, local: a.handle, remote: ra, request: i }))), opts());
          await conns.single.execute(0, createTransferBatch('read', ranges.map((r, i) => ({ ...r, local: b.handle, remote: rb, request: i }))), opts());
          const expected = new Uint8Array(DST).fill(0xee);
          for (const r of ranges) for (let k = 0; k < r.length; k++) expected[r.localOffset + k] = pattern(r.remoteOffset + k);
          expect(Buffer.compare(a.buffer, expected)).toBe(0);
          expect(Buffer.compare(b.buffer, expected)).toBe(0);
        },
      ),
      { numRuns: 25, seed: 1101 },
    );
  });

  it('a threaded write of 3 MiB in 48 ranges lands exactly, and bytes between them stay', async () => {
    const target = allocateSharedMemory(4 * 2 ** 20, 'copythreadsw');
    try {
      target.fill(0x11);
      const reg = await holder.register({ kind: 'host', buffer: target });
      const remote = threaded.decodeRemote(reg.payload, 'host', target.byteLength);
      const src = await local(threaded, 3 * 2 ** 20, 0);
      for (let i = 0; i < src.buffer.length; i++) src.buffer[i] = pattern(i + 5);
      const block = 64 * 1024;
      // Source block i -> target block 2 * (47 - i) / 1.5, rounded to 80 KiB steps: never adjacent.
      const list: TransferRangeInit[] = Array.from({ length: 48 }, (_, i) => ({ local: src.handle, localOffset: i * block, remote, remoteOffset: (47 - i) * (80 * 1024), length: block, request: i }));
      await conns.threaded.execute(0, createTransferBatch('write', list), opts());
      const expected = new Uint8Array(target.byteLength).fill(0x11);
      for (const r of list) for (let k = 0; k < r.length; k++) expected[r.remoteOffset + k] = pattern(r.localOffset + k + 5);
      expect(Buffer.compare(target, expected)).toBe(0);
      await holder.revoke(reg.handle);
    } finally {
      releaseSharedMemory(target);
    }
  });

  it('a large threaded batch with one bad range in the middle fails as a whole, naming it, before any byte moves', async () => {
    const dst = await local(threaded, 4 * 2 ** 20, 0xee);
    const remote = threaded.decodeRemote(regionReg.payload, 'host', REGION);
    const block = 128 * 1024;
    const list: TransferRangeInit[] = Array.from({ length: 30 }, (_, i) => ({ local: dst.handle, localOffset: i * block, remote, remoteOffset: i * (block + 4096), length: block, request: i }));
    // Request 17 reads past the region (the granted range): remote rejected, bounds.
    (list[17] as { remoteOffset: number }).remoteOffset = REGION - 100;
    const e = await conns.threaded.execute(0, createTransferBatch('read', list), opts()).then(
      () => undefined,
      (err: unknown) => err,
    );
    expect(e).toBeInstanceOf(RemoteRejectedError);
    expect((e as RemoteRejectedError).remoteCode).toBe('bounds');
    expect((e as RemoteRejectedError).details['request']).toBe(17);
    expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
    // A local range past its buffer: invalid input, nothing moved either.
    (list[17] as { remoteOffset: number }).remoteOffset = 17 * (block + 4096);
    (list[29] as { localOffset: number }).localOffset = dst.buffer.byteLength - 10;
    const e2 = await conns.threaded.execute(0, createTransferBatch('read', list), opts()).then(
      () => undefined,
      (err: unknown) => err,
    );
    expect(e2).toBeInstanceOf(InvalidInputError);
    expect((e2 as InvalidInputError).details['request']).toBe(29);
    expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
  });

  it('a revoked registration refuses the next threaded batch, and no byte moves', async () => {
    const shared = allocateSharedMemory(2 * 2 ** 20, 'copythreadsr');
    try {
      shared.fill(3);
      const reg = await holder.register({ kind: 'host', buffer: shared });
      const remote = threaded.decodeRemote(reg.payload, 'host', shared.byteLength);
      const dst = await local(threaded, 2 * 2 ** 20, 0xee);
      const batch = createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote, remoteOffset: 0, length: shared.byteLength }]);
      await conns.threaded.execute(0, batch, opts());
      expect(dst.buffer.every((x) => x === 3)).toBe(true);
      dst.buffer.fill(0xee);
      await holder.revoke(reg.handle);
      const e = await conns.threaded.execute(0, batch, opts()).then(
        () => undefined,
        (err: unknown) => err,
      );
      expect(e).toBeInstanceOf(RemoteRejectedError);
      expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
    } finally {
      releaseSharedMemory(shared);
    }
  });

  it('threaded reads of a 2 MiB pool slot that its owner process keeps rewriting are never torn (one generation check per slot per batch, by every thread)', async () => {
    const elems = 512 * 1024; // 2 MiB of uint32: 4 shares of 512 KiB
    const holderNode = `cth${process.pid}`;
    const child = fork(fixture('slot-holder.mjs'), [uniqueOwner('ct'), String(elems), holderNode, '1'], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    const [ready] = (await once(child, 'message')) as [{ endpoint: string; descriptor: string }];
    const endpoint = new Uint8Array(Buffer.from(ready.endpoint, 'base64'));
    const descriptor = new Uint8Array(Buffer.from(ready.descriptor, 'base64'));
    const engine = new TransferEngine({ nodeId: `ctr${process.pid}`, transports: [new CudaIpcTransport({ copyThreads: 4 })], logger: silentLogger, metrics: false });
    try {
      await engine.start();
      const reg = await engine.register({ kind: 'host', buffer: new Uint8Array(elems * 4) });
      const view = new Uint32Array((reg.memory as { buffer: Uint8Array }).buffer.buffer, 0, elems);
      // Whole slot, and as 16 scattered blocks in one batch (local block i <- slot block 15 - i).
      const block = (elems * 4) / 16;
      const scatter = Array.from({ length: 16 }, (_, i) => ({ local: reg, localOffset: i * block, remote: descriptor, remoteOffset: (15 - i) * block, length: block }));
      let ok = 0;
      let refused = 0;
      let torn = 0;
      const seen = new Set<number>();
      for (let i = 0; i < 300; i++) {
        try {
          await engine.read(endpoint, i % 2 === 0 ? [{ local: reg, remote: descriptor }] : scatter);
        } catch (err) {
          if (err instanceof TimedOutError || (err instanceof RemoteRejectedError && err.remoteCode === 'slot-rewritten')) {
            refused++;
            continue;
          }
          throw err;
        }
        ok++;
        const v = view[0] as number;
        for (let k = 1; k < elems; k++) {
          if (view[k] !== v) {
            torn++;
            break;
          }
        }
        seen.add(v);
      }
      child.send({ op: 'stop' });
      const [{ writes }] = (await once(child, 'message')) as [{ writes: number }];
      expect(torn, `torn reads (${ok} successful, ${refused} refused, ${writes} writes)`).toBe(0);
      expect(ok + refused).toBe(300);
      expect(ok).toBeGreaterThan(30);
      expect(writes).toBeGreaterThan(30);
      expect(seen.size).toBeGreaterThan(5);
    } finally {
      child.kill('SIGKILL');
      await engine.close();
    }
  });
});
