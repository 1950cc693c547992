/**
 * Host batches of at least `asyncCopyBytes` are copied off the JavaScript thread
 * (copyPlannedAsync): checked on the calling thread first (a bad range or a revoked local fails
 * before anything is queued and before any byte moves), copied on a thread of libuv's pool,
 * settled on the JavaScript thread with the errors a copy on the calling thread gives. While
 * one is in flight the event loop runs, and the connection's close waits for it.
 *
 * "Off the thread" is shown without timing: a read of a pool slot whose owner is in the middle
 * of a write waits (natively) for the write to end. On the calling thread that wait would hold
 * the event loop, so the write, finished by this thread's JavaScript, could never end before
 * the copy's stuck-writer bound; off the thread the write ends, the copy goes on and lands the
 * new bytes.
 */
import { once } from 'node:events';
import { Worker } from 'node:worker_threads';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import {
  AbortedError,
  ClosedError,
  InvalidInputError,
  RemoteRejectedError,
  TimedOutError,
  TransferEngine,
  type TensorwireError,
  createTransferBatch,
  defaultHostId,
  silentLogger,
  type TransferBatch,
  type TransferRangeInit,
  type TransportConnection,
  type TransportHost,
} from '@tensorwire/core';
import { CudaIpcTransport, TensorPool, allocateSharedMemory, native, releaseSharedMemory, type PoolView } from '../src/index.js';
import { CopyControl } from '../src/native.js';
import { fixture, uniqueOwner } from './helpers.js';
import { failure } from './pool-fixtures.js';

const SLOT = 256 * 1024;
const REGION = 4 * 2 ** 20;
const pattern = (x: number): number => (x * 29 + (x >> 10) + 3) & 255;
const signal = new AbortController().signal;
const opts = (): { signal: AbortSignal; deadline: number } => ({ signal, deadline: Date.now() + 20_000 });
const tick = (): Promise<void> => new Promise((r) => setImmediate(r));

let pool: TensorPool;
let holder: CudaIpcTransport;
/** Copies every batch of 1 byte or more off the thread. */
let offThread: CudaIpcTransport;
let conn: TransportConnection;
let hosts: TransportHost[];
let slotView: PoolView;
let slotRemote: unknown;
let slotPayload: Uint8Array;
let region: Uint8Array;
let regionRemote: unknown;
let regionReg: { handle: object; payload: Uint8Array };

beforeAll(async () => {
  pool = new TensorPool({ owner: uniqueOwner('ac') });
  hosts = ['ah', 'ao'].map((n) => ({ identity: { nodeId: `${n}${process.pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
  holder = new CudaIpcTransport();
  offThread = new CudaIpcTransport({ asyncCopyBytes: 1, copyThreads: 2 });
  await holder.start(hosts[0] as TransportHost);
  await offThread.start(hosts[1] as TransportHost);
  const id = await pool.register({ dtype: 'uint8', shape: [SLOT] });
  pool.writeSync(id, Uint8Array.from({ length: SLOT }, (_, i) => pattern(i)));
  slotView = pool.readSync(id);
  const slotReg = await holder.register({ kind: 'host', buffer: slotView.buffer as Uint8Array });
  slotPayload = slotReg.payload;
  slotRemote = offThread.decodeRemote(slotReg.payload, 'host', SLOT);
  region = allocateSharedMemory(REGION, 'asynccopy');
  for (let i = 0; i < REGION; i++) region[i] = pattern(i + 1);
  regionReg = await holder.register({ kind: 'host', buffer: region });
  regionRemote = offThread.decodeRemote(regionReg.payload, 'host', REGION);
  conn = await offThread.connect((hosts[0] as TransportHost).identity, holder.endpoint(), { ...opts(), streams: 1 });
});

afterAll(async () => {
  await conn?.close();
  slotView?.dispose();
  if (region) releaseSharedMemory(region);
  await Promise.all([holder?.close(), offThread?.close()]);
  await pool?.close();
});

async function local(t: CudaIpcTransport, bytes: number, fill: number): Promise<{ handle: object; buffer: Uint8Array }> {
  const buffer = new Uint8Array(bytes).fill(fill);
  return { handle: (await t.register({ kind: 'host', buffer })).handle, buffer };
}

/** The slot's seqlock generation (the owner's mapping): odd while a write is in progress. */
function slotGeneration(): BigUint64Array {
  return new BigUint64Array(((slotView.buffer as Uint8Array).buffer as ArrayBuffer), 128, 1);
}

/**
 * The slot's owner takes its write lock (an odd generation) until the returned release() ends
 * the write (the next even generation). While held, the lock moves on to the next odd
 * generation every 100 ms, as a writer that keeps writing does, so a copy waiting for it never
 * meets the stuck-writer bound (2 s on one generation), however slowly this thread runs.
 */
function holdWrite(): () => void {
  const gen = slotGeneration();
  gen[0] = (gen[0] as bigint) + 1n;
  const timer = setInterval(() => {
    gen[0] = (gen[0] as bigint) + 2n;
  }, 100);
  return () => {
    clearInterval(timer);
    gen[0] = (gen[0] as bigint) + 1n;
  };
}

/**
 * Starts `copy` (a read of the slot) while the slot's write is held, then `waiter` if given.
 * While the write is held the copy cannot end, so neither may settle (the event loop runs
 * meanwhile); `during` then runs, still held; the write ends and both settle.
 */
async function whileWriteHeld(copy: () => Promise<void>, o: { waiter?: () => Promise<void>; during?: () => void } = {}): Promise<void> {
  const release = holdWrite();
  let copied = false;
  let waited = false;
  let copying: Promise<void> | undefined;
  let waiting: Promise<void> | undefined;
  try {
    copying = copy().finally(() => {
      copied = true;
    });
    waiting = o.waiter?.().then(() => {
      waited = true;
    });
    for (let i = 0; i < 5; i++) await tick();
    expect(copied).toBe(false);
    expect(waited).toBe(false);
    o.during?.();
  } finally {
    release();
  }
  await copying;
  await waiting;
  if (o.waiter) expect(waited).toBe(true);
}

/** `f` on its first call only. */
function onlyOnce(f: () => void): () => void {
  let done = false;
  return () => {
    if (!done) f();
    done = true;
  };
}

/** The control word of the `k`th copyPlannedAsync call `spy` saw. */
function controlOf(spy: { mock: { calls: unknown[][] } }, k: number): Int32Array {
  const control = spy.mock.calls[k]?.[8];
  if (!(control instanceof Int32Array)) throw new Error(`copyPlannedAsync call ${k} had no control word`);
  return control;
}

/** Resolves once a thread of the pool has started the copy of `control`. */
async function started(control: Int32Array): Promise<void> {
  while (Atomics.load(control, 0) !== CopyControl.Running) await tick();
}

describe('cuda-ipc asyncCopyBytes', () => {
  it('validates the option; the default is 8 MiB', () => {
    for (const bad of [0, -1, 1.5, Number.NaN, Number.NEGATIVE_INFINITY, 2 ** 60]) expect(() => new CudaIpcTransport({ asyncCopyBytes: bad })).toThrow(InvalidInputError);
    expect(new CudaIpcTransport().asyncCopyBytes).toBe(8 * 2 ** 20);
    expect(new CudaIpcTransport({ asyncCopyBytes: Number.POSITIVE_INFINITY }).asyncCopyBytes).toBe(Number.POSITIVE_INFINITY);
    expect(new CudaIpcTransport({ asyncCopyBytes: 1 }).asyncCopyBytes).toBe(1);
  });

  it('a copy waiting for a write in progress leaves the event loop free: the write ends, the copy lands the new bytes', async () => {
    const dst = await local(offThread, SLOT, 0xee);
    const data = slotView.buffer as Uint8Array;
    const next = Uint8Array.from({ length: SLOT }, (_, i) => pattern(i + 7));
    await whileWriteHeld(() => conn.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: SLOT }]), opts()), {
      // This thread runs: it finishes the owner's write.
      during: () => data.set(next),
    });
    expect(Buffer.compare(dst.buffer, next)).toBe(0);
    // Put the slot back for the other tests.
    const again = holdWrite();
    for (let i = 0; i < SLOT; i++) data[i] = pattern(i);
    again();
  });

  it('large scattered reads and writes land exactly their bytes, several in flight at once over one plan and over others', async () => {
    const block = 96 * 1024;
    const n = 24;
    const dsts = await Promise.all([0, 1, 2].map(() => local(offThread, n * block + 4096, 0xee)));
    // Block i of the region, from the end backwards, into block i of each destination at an offset of its own.
    const list = (d: { handle: object }, shift: number): TransferRangeInit[] =>
      Array.from({ length: n }, (_, i) => ({ local: d.handle, localOffset: i * block + shift, remote: regionRemote, remoteOffset: REGION - (i + 1) * (block + 1000), length: block, request: i }));
    const batches: TransferBatch[] = dsts.map((d, k) => createTransferBatch('read', list(d, k * 100)));
    // The first batch twice at once (one plan, two posts), the others beside it.
    await Promise.all([conn.execute(0, batches[0] as TransferBatch, opts()), conn.execute(0, batches[0] as TransferBatch, opts()), conn.execute(0, batches[1] as TransferBatch, opts()), conn.execute(0, batches[2] as TransferBatch, opts())]);
    dsts.forEach((d, k) => {
      const expected = new Uint8Array(d.buffer.byteLength).fill(0xee);
      for (const r of list(d, k * 100)) for (let x = 0; x < r.length; x++) expected[r.localOffset + x] = pattern(r.remoteOffset + x + 1);
      expect(Buffer.compare(d.buffer, expected), `destination ${k}`).toBe(0);
    });
    // A write of 1 MiB in 16 blocks, every other block of a shared target.
    const target = allocateSharedMemory(2 * 2 ** 20, 'asynccopyw');
    try {
      target.fill(0x11);
      const reg = await holder.register({ kind: 'host', buffer: target });
      const remote = offThread.decodeRemote(reg.payload, 'host', target.byteLength);
      const src = await local(offThread, 2 ** 20, 0);
      for (let i = 0; i < src.buffer.length; i++) src.buffer[i] = pattern(i + 9);
      const wb = 64 * 1024;
      const writes: TransferRangeInit[] = Array.from({ length: 16 }, (_, i) => ({ local: src.handle, localOffset: i * wb, remote, remoteOffset: (15 - i) * 2 * wb, length: wb, request: i }));
      await conn.execute(0, createTransferBatch('write', writes), opts());
      const expected = new Uint8Array(target.byteLength).fill(0x11);
      for (const r of writes) for (let x = 0; x < r.length; x++) expected[r.remoteOffset + x] = pattern(r.localOffset + x + 9);
      expect(Buffer.compare(target, expected)).toBe(0);
      await holder.revoke(reg.handle);
    } finally {
      releaseSharedMemory(target);
    }
  });

  it('a bad range in the middle fails the batch on the calling thread, naming it, before any byte moves', async () => {
    const dst = await local(offThread, 2 ** 20, 0xee);
    const list: TransferRangeInit[] = Array.from({ length: 16 }, (_, i) => ({ local: dst.handle, localOffset: i * 65536, remote: regionRemote, remoteOffset: i * 70000, length: 65536, request: i }));
    (list[9] as { remoteOffset: number }).remoteOffset = REGION - 10;
    const spy = vi.spyOn(native, 'copyPlannedAsync');
    let err: TensorwireError;
    try {
      err = await failure(conn.execute(0, createTransferBatch('read', list), opts()));
      // Refused in the call on this thread: nothing was queued.
      expect(spy.mock.results.map((r) => r.type)).toEqual(['throw']);
    } finally {
      spy.mockRestore();
    }
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('bounds');
    expect(err.details['request']).toBe(9);
    expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
  });

  it('a grant revoked before the copy runs rejects the promise with the error a copy on the calling thread gives; no byte moves', async () => {
    const shared = allocateSharedMemory(2 ** 20, 'asynccopyr');
    try {
      shared.fill(5);
      const reg = await holder.register({ kind: 'host', buffer: shared });
      const remote = offThread.decodeRemote(reg.payload, 'host', shared.byteLength);
      const dst = await local(offThread, 2 ** 20, 0xee);
      const batch = createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote, remoteOffset: 0, length: shared.byteLength }]);
      await conn.execute(0, batch, opts());
      expect(dst.buffer.every((x) => x === 5)).toBe(true);
      dst.buffer.fill(0xee);
      await holder.revoke(reg.handle);
      const err = await failure(conn.execute(0, batch, opts()));
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('revoked');
      // The grant by name, as a copy on the calling thread reports it.
      expect(err.details['grant']).toMatch(/^[\w./#-]+$/);
      expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
    } finally {
      releaseSharedMemory(shared);
    }
  });

  it("the connection's close waits for a copy in flight, which still lands its bytes", async () => {
    const c2 = await offThread.connect((hosts[0] as TransportHost).identity, holder.endpoint(), { ...opts(), streams: 1 });
    const dst = await local(offThread, SLOT, 0xee);
    await whileWriteHeld(() => c2.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: SLOT }]), opts()), { waiter: () => c2.close() });
    for (let i = 0; i < SLOT; i++) if (dst.buffer[i] !== pattern(i)) expect.fail(`byte ${i}`);
  });

  it('revoking a local registration waits for a copy into it that is still running; a later post is refused', async () => {
    const dst = await local(offThread, SLOT, 0xee);
    const batch = createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: SLOT, request: 2 }]);
    // The memory may be reused the moment revoke() resolves: not while the copy can write it.
    await whileWriteHeld(() => conn.execute(0, batch, opts()), { waiter: () => offThread.revoke(dst.handle) });
    for (let i = 0; i < SLOT; i++) if (dst.buffer[i] !== pattern(i)) expect.fail(`byte ${i}`);
    const err = await failure(conn.execute(0, batch, opts()));
    expect(err).toBeInstanceOf(InvalidInputError);
    expect(err.details['request']).toBe(2);
  });

  it('a local buffer detached while its copy ran fails the post with InvalidInputError', async () => {
    const dst = await local(offThread, SLOT, 0xee);
    const release = holdWrite();
    let read: Promise<void> | undefined;
    let moved: ArrayBuffer | undefined;
    try {
      read = conn.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: SLOT }]), opts());
      await tick();
      // Transferred away (kept alive here: the copy writes the memory the clone now owns).
      const own = dst.buffer.buffer as ArrayBuffer;
      moved = structuredClone(own, { transfer: [own] });
      expect(dst.buffer.byteLength).toBe(0);
    } finally {
      release();
    }
    const err = await failure(read as Promise<void>);
    expect(err).toBeInstanceOf(InvalidInputError);
    expect(err.message).toMatch(/detached or shrunk while the copy ran/);
    expect(moved?.byteLength).toBe(SLOT);
  });

  it('a batch with a local buffer over a resizable ArrayBuffer is copied on the calling thread', async () => {
    const Resizable = ArrayBuffer as unknown as new (n: number, o: { maxByteLength: number }) => ArrayBuffer;
    const buffer = new Uint8Array(new Resizable(2 ** 20, { maxByteLength: 2 * 2 ** 20 })).fill(0xee);
    const handle = (await offThread.register({ kind: 'host', buffer })).handle;
    const p = conn.execute(0, createTransferBatch('read', [{ local: handle, localOffset: 0, remote: regionRemote, remoteOffset: 3, length: 2 ** 20 }]), opts());
    // There when execute() returns: it never left this thread (a shrink could not race it).
    expect(buffer[2 ** 20 - 1]).toBe(pattern(2 ** 20 - 1 + 3 + 1));
    await p;
  });

  it('batches below the threshold are copied on the calling thread; a batch of exactly the threshold is not', async () => {
    const t = new CudaIpcTransport({ asyncCopyBytes: SLOT });
    await t.start({ identity: { nodeId: `as${process.pid}`, incarnation: 'ias', hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined });
    const c = await t.connect((hosts[0] as TransportHost).identity, holder.endpoint(), { ...opts(), streams: 1 });
    try {
      const remote = t.decodeRemote(regionReg.payload, 'host', REGION);
      const slot = t.decodeRemote(slotPayload, 'host', SLOT);
      const dst = await local(t, SLOT, 0xee);
      // One byte below: the bytes are there when execute() returns its promise.
      const below = c.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote, remoteOffset: 0, length: SLOT - 1 }]), opts());
      expect(dst.buffer[0]).toBe(pattern(1));
      expect(dst.buffer[SLOT - 2]).toBe(pattern(SLOT - 2 + 1));
      await below;
      // Exactly the threshold: off the thread (it waits for a write this thread ends).
      await whileWriteHeld(() => c.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slot, remoteOffset: 0, length: SLOT }]), opts()));
      for (let i = 0; i < SLOT; i++) if (dst.buffer[i] !== pattern(i)) expect.fail(`byte ${i}`);
    } finally {
      await c.close();
      await t.close();
    }
  });

  it('the batches of one transfer that copied a pool slot at different generations fail it (slot-rewritten), with the generations of copies made off the thread', async () => {
    const dst = await local(offThread, SLOT, 0xee);
    const transfer = {};
    const half = SLOT / 2;
    const first = createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: half }]);
    const second = createTransferBatch('read', [{ local: dst.handle, localOffset: half, remote: slotRemote, remoteOffset: half, length: half }]);
    await conn.execute(0, first, { ...opts(), transfer });
    // The owner rewrites the slot between the transfer's two batches.
    const gen = slotGeneration();
    const before = gen[0] as bigint;
    gen[0] = before + 2n;
    try {
      const err = await failure(conn.execute(0, second, { ...opts(), transfer }));
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('slot-rewritten');
      // Another transfer's batches at one generation are fine.
      const again = {};
      await conn.execute(0, first, { ...opts(), transfer: again });
      await conn.execute(0, second, { ...opts(), transfer: again });
      for (let i = 0; i < SLOT; i++) if (dst.buffer[i] !== pattern(i)) expect.fail(`byte ${i}`);
    } finally {
      gen[0] = before + 4n;
    }
  });

  it("an abort stops a copy that waits for a write in progress: the post rejects with the signal's error while the write is still held, and no byte moved", async () => {
    const dst = await local(offThread, SLOT, 0xee);
    const batch = createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: SLOT }]);
    for (const reason of [undefined, new TimedOutError('the caller gave up')]) {
      const ac = new AbortController();
      const release = holdWrite();
      const spy = vi.spyOn(native, 'copyPlannedAsync');
      try {
        let settled = false;
        // A deadline far enough out that only the abort can end the wait before it.
        const read = conn.execute(0, batch, { signal: ac.signal, deadline: Date.now() + 10_000 }).finally(() => {
          settled = true;
        });
        // A pool thread has started the copy (it waits for the write) before the abort.
        await started(controlOf(spy, 0));
        for (let i = 0; i < 5; i++) await tick();
        expect(settled).toBe(false);
        ac.abort(reason);
        const err = await failure(read);
        // Still held: the copy stopped waiting for it.
        if (reason) expect(err).toBe(reason);
        else expect(err).toBeInstanceOf(AbortedError);
        expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
      } finally {
        spy.mockRestore();
        release();
      }
    }
    // The connection goes on.
    await conn.execute(0, batch, opts());
    for (let i = 0; i < SLOT; i++) if (dst.buffer[i] !== pattern(i)) expect.fail(`byte ${i}`);
  });

  it("an abort of a copy still queued for a thread of the pool settles its post at once with the signal's error, and the copy never runs; a queued copy past its deadline fails before any byte moves", async () => {
    // Every thread of libuv's pool waits in a copy of the held slot; one more copy queues behind them.
    const threads = Number(process.env['UV_THREADPOOL_SIZE']) || 4;
    const blockers = await Promise.all(Array.from({ length: threads }, () => local(offThread, SLOT, 0xee)));
    const target = await local(offThread, 2 ** 20, 0xee);
    const lateTarget = await local(offThread, 2 ** 20, 0xee);
    const release = onlyOnce(holdWrite());
    const settled: boolean[] = [];
    let waiting: Promise<void>[] = [];
    const spy = vi.spyOn(native, 'copyPlannedAsync');
    try {
      waiting = blockers.map((d, k) =>
        conn.execute(0, createTransferBatch('read', [{ local: d.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: SLOT }]), opts()).finally(() => {
          settled[k] = true;
        }),
      );
      const ac = new AbortController();
      const reason = new ClosedError('the caller closed');
      const read = (d: { handle: object }, o: { signal: AbortSignal; deadline: number }): Promise<void> =>
        conn.execute(0, createTransferBatch('read', [{ local: d.handle, localOffset: 0, remote: regionRemote, remoteOffset: 0, length: 2 ** 20 }]), o);
      const queued = read(target, { signal: ac.signal, deadline: Date.now() + 10_000 });
      // The addon's own promise for it: settled by the pool thread that takes it off the queue.
      const native0 = failure(spy.mock.results[threads]?.value as Promise<void>);
      // And one more behind it whose deadline passes while it waits for a thread.
      const deadline = Date.now() + 50;
      const late = failure(read(lateTarget, { signal, deadline }));
      // Every blocker holds a pool thread, so these two are still queued.
      for (let k = 0; k < threads; k++) await started(controlOf(spy, k));
      expect(Atomics.load(controlOf(spy, threads), 0)).toBe(CopyControl.Queued);
      ac.abort(reason);
      expect(await failure(queued)).toBe(reason);
      // Settled while every copy ahead of it still waits for the write.
      expect(settled.filter(Boolean)).toEqual([]);
      while (Date.now() <= deadline) await tick();
      release();
      await Promise.all(waiting);
      // The thread that took the cancelled copy did not run it...
      expect(await native0).toBeInstanceOf(AbortedError);
      // ...and the one past its deadline failed before any byte moved.
      const err = await late;
      expect(err).toBeInstanceOf(TimedOutError);
      expect(err.message).toMatch(/waited for a thread/);
    } finally {
      spy.mockRestore();
      release();
    }
    for (const d of blockers) for (let i = 0; i < SLOT; i++) if (d.buffer[i] !== pattern(i)) expect.fail(`byte ${i}`);
    expect(target.buffer.every((x) => x === 0xee)).toBe(true);
    expect(lateTarget.buffer.every((x) => x === 0xee)).toBe(true);
  });

  it("engine.close() stops a read whose copy waits off the thread: the read fails with ClosedError and close() resolves while the write is still held", async () => {
    const hb = new TransferEngine({ nodeId: `ech${process.pid}`, transports: [new CudaIpcTransport()], logger: silentLogger });
    const ha = new TransferEngine({ nodeId: `eca${process.pid}`, transports: [new CudaIpcTransport({ asyncCopyBytes: 1 })], logger: silentLogger });
    const spy = vi.spyOn(native, 'copyPlannedAsync');
    let release: (() => void) | undefined;
    try {
      await hb.start();
      await ha.start();
      const rb = await hb.register({ kind: 'host', buffer: slotView.buffer as Uint8Array });
      const dst = new Uint8Array(SLOT).fill(0xee);
      const ra = await ha.register({ kind: 'host', buffer: dst });
      const requests = [{ local: ra, remote: rb.descriptor, remoteOffset: 0, length: SLOT }];
      await ha.read(hb.endpoint(), requests);
      expect(dst[SLOT - 1]).toBe(pattern(SLOT - 1));
      dst.fill(0xee);
      release = onlyOnce(holdWrite());
      const read = failure(ha.read(hb.endpoint(), requests, { timeoutMs: 10_000 }));
      const copy = failure(spy.mock.results[1]?.value as Promise<void>);
      await started(controlOf(spy, 1));
      await ha.close();
      expect(await read).toBeInstanceOf(ClosedError);
      // Stopped by the close, not by its deadline.
      expect(await copy).toBeInstanceOf(AbortedError);
      expect(dst.every((x) => x === 0xee)).toBe(true);
    } finally {
      spy.mockRestore();
      release?.();
      await ha.close();
      await hb.close();
    }
  });

  it.each([
    ['copies queued or running', false],
    ['copies waiting for a write in progress', true],
  ])('a worker thread terminated with %s ends cleanly (teardown waits for them; nothing escapes into the process)', async (_label, stall) => {
    const w = new Worker(fixture('async-copy-worker.mjs'), { workerData: { stall, tag: stall ? 's' : 'r' } });
    const [msg] = (await once(w, 'message')) as [string];
    expect(msg).toBe('copying');
    const code = await w.terminate();
    expect(code).toBe(1);
    // This process is alive and its own copies still work.
    const dst = await local(offThread, 2 ** 20, 0xee);
    await conn.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: regionRemote, remoteOffset: 5, length: 2 ** 20 }]), opts());
    expect(dst.buffer[0]).toBe(pattern(6));
  });
});
