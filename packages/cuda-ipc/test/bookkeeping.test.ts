/**
 * Bookkeeping tests with FAKE CUDA calls. These run without a GPU by swapping the CUDA
 * functions of the exported `native` facade (cudaAlloc / cudaExport / cudaImport /
 * cudaCloseImport / cudaFree / cudaCopy) for recorders; shared memory, headers and
 * importer / grant counters are the real ones. They pin the JavaScript bookkeeping
 * (who closes which import when, what the owner may free, which grants peers may write);
 * they do NOT test the CUDA path on hardware (test/gpu.test.ts does, where a GPU exists).
 */
import { existsSync, mkdirSync, rmSync, utimesSync, writeFileSync } from 'node:fs';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { ClosedError, RemoteRejectedError, decodeDescriptor, ResourceExhaustedError, TransferEngine, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport, TensorPool, allocateSharedMemory, decodePayload, native, poolSegmentName, releaseSharedMemory } from '../src/index.js';
import { regionOf } from '../src/shared.js';
import { uniqueOwner } from './helpers.js';

type Native = typeof native;
const saved = new Map<keyof Native, unknown>();
function fake<K extends keyof Native>(key: K, fn: Native[K]): void {
  if (!saved.has(key)) saved.set(key, native[key]);
  (native as unknown as Record<string, unknown>)[key] = fn;
}
afterEach(() => {
  for (const [k, v] of saved) (native as unknown as Record<string, unknown>)[k] = v;
  saved.clear();
});

const pools: TensorPool[] = [];
function pool(prefix: string, opts: { deferredFreeTimeoutMs?: number } = {}): TensorPool {
  const p = new TensorPool({ owner: uniqueOwner(prefix), ...opts });
  pools.push(p);
  return p;
}
const engines: TransferEngine[] = [];
afterAll(async () => {
  await Promise.all(engines.map((e) => e.close()));
  await Promise.all(pools.map((p) => p.close()));
});

/** A gate a fake CUDA call waits on, so a test can hold it "in flight". */
function gate(): { wait: Promise<void>; open: () => void } {
  let open = (): void => undefined;
  const wait = new Promise<void>((r) => (open = r));
  return { wait, open };
}

/** Fake CUDA for the pool: one allocation at 0x1000, imports at 0x2000; every call recorded in `events`. */
function fakePoolCuda(events: string[], importGate?: Promise<void>): void {
  fake('cudaAlloc', async () => 0x1000n);
  fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(7), base: 0x1000n, offset: 0, allocSize: 4096 }));
  fake('cudaImport', async () => {
    events.push('import');
    if (importGate) await importGate;
    return 0x2000n;
  });
  fake('cudaCloseImport', async () => {
    events.push('closeImport');
  });
  fake('cudaFree', async () => {
    events.push('free');
  });
}

const tick = (ms = 0): Promise<void> => new Promise((r) => setTimeout(r, ms));

async function caught(p: Promise<unknown>): Promise<unknown> {
  try {
    await p;
  } catch (e) {
    return e;
  }
  return undefined;
}

describe('bookkeeping (fake CUDA): a read racing free()/close() of its import (defect 1, invariant 9)', () => {
  it("a non-owner's free() during read()'s import closes the import and gives back the importer count", async () => {
    const events: string[] = [];
    const g = gate();
    fakePoolCuda(events, g.wait);
    const a = pool('ia', { deferredFreeTimeoutMs: 60_000 });
    const b = pool('ib');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const reading = b.read(id);
    await tick();
    expect(events).toEqual(['import']);
    expect(a.importers(id)).toBe(1);
    const freed = b.free(id);
    g.open();
    const err = await caught(reading);
    expect(err).toBeInstanceOf(ClosedError);
    await freed;
    expect(events).toEqual(['import', 'closeImport']);
    expect(a.importers(id)).toBe(0);
    expect(b.mapped()).toEqual([]);
    const r = await a.free(id);
    expect(r.deferred).toBe(false);
    await r.released;
    expect(events).toEqual(['import', 'closeImport', 'free']);
  });

  it('close() during read() waits for the import and closes it', async () => {
    const events: string[] = [];
    const g = gate();
    fakePoolCuda(events, g.wait);
    const a = pool('ca', { deferredFreeTimeoutMs: 60_000 });
    const b = new TensorPool({ owner: uniqueOwner('cb') });
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const reading = b.read(id);
    await tick();
    let closed = false;
    const closing = b.close().then(() => (closed = true));
    await tick(5);
    expect(closed).toBe(false); // still waiting for the import in flight
    g.open();
    expect(await caught(reading)).toBeInstanceOf(ClosedError);
    await closing;
    expect(events).toEqual(['import', 'closeImport']);
    expect(a.importers(id)).toBe(0);
  });
});

describe('bookkeeping (fake CUDA): live views keep the import (defect 2, invariant 9)', () => {
  it("the owner's deferred free waits for the importer's live view, even when the importer reads again", async () => {
    const events: string[] = [];
    fakePoolCuda(events);
    const a = pool('va', { deferredFreeTimeoutMs: 60_000 });
    const b = pool('vb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const view = await b.read(id);
    expect(view.devicePointer).toBe(0x2000n);
    const r = await a.free(id);
    expect(r.deferred).toBe(true);
    expect(await caught(b.read(id))).toBeInstanceOf(ClosedError);
    await tick(5);
    // The view is live: its import stays open, so the owner has not freed the memory.
    expect(events).toEqual(['import']);
    view.dispose();
    await r.released;
    expect(events).toEqual(['import', 'closeImport', 'free']);
  });

  it('disposing the last view of a slot the owner freed gives the import back at once', async () => {
    const events: string[] = [];
    fakePoolCuda(events);
    const a = pool('da', { deferredFreeTimeoutMs: 5_000 });
    const b = pool('db');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const view = await b.read(id);
    const r = await a.free(id);
    expect(r.deferred).toBe(true);
    view.dispose();
    await r.released;
    expect(events).toEqual(['import', 'closeImport', 'free']);
    expect(b.mapped()).toEqual([]);
  });

  it("a non-owner's free() with a live view is deferred until the view is disposed; a re-read reuses the import", async () => {
    const events: string[] = [];
    fakePoolCuda(events);
    const a = pool('na', { deferredFreeTimeoutMs: 60_000 });
    const b = pool('nb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const v1 = await b.read(id);
    const f1 = await b.free(id);
    expect(f1.deferred).toBe(true);
    expect(b.mapped()).toEqual([]);
    expect(a.importers(id)).toBe(1);
    expect(events).toEqual(['import']);
    // Reading again takes the retired entry back rather than opening the same handle twice.
    const v2 = await b.read(id);
    expect(events).toEqual(['import']);
    v1.dispose();
    v2.dispose();
    await tick(5);
    expect(events).toEqual(['import']); // not dropped any more: still cached
    await b.free(id);
    await f1.released;
    expect(events).toEqual(['import', 'closeImport']);
    expect(a.importers(id)).toBe(0);
  });

  it('close() does not close an import a live view still uses; disposing the view does', async () => {
    const events: string[] = [];
    fakePoolCuda(events);
    const a = pool('la', { deferredFreeTimeoutMs: 60_000 });
    const b = new TensorPool({ owner: uniqueOwner('lb') });
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const view = await b.read(id);
    await b.close();
    expect(events).toEqual(['import']);
    expect(a.importers(id)).toBe(1);
    view.dispose();
    await tick(5);
    expect(events).toEqual(['import', 'closeImport']);
    expect(a.importers(id)).toBe(0);
  });
});

async function engine(nodeId: string, opts: { cuda?: boolean; revokeTimeoutMs?: number; chunkBytes?: number; streams?: number } = {}): Promise<TransferEngine> {
  const t = new CudaIpcTransport({ revokeTimeoutMs: opts.revokeTimeoutMs ?? 30_000 });
  if (opts.cuda) {
    // Pretend this machine has CUDA, for the bookkeeping below (every CUDA call is faked).
    Object.defineProperty(t, 'capabilities', { value: Object.freeze({ ...t.capabilities, memoryKinds: ['host', 'cuda'] }) });
  }
  const e = new TransferEngine({
    nodeId,
    transports: [t],
    logger: silentLogger,
    ...(opts.chunkBytes ? { chunkBytes: opts.chunkBytes } : {}),
    ...(opts.streams ? { streamsPerPeer: opts.streams } : {}),
  });
  await e.start();
  engines.push(e);
  return e;
}

describe('grants over pool slots (defect 3, invariants 11 and 13)', () => {
  it("a non-owner's view of a slot is not a grantable region", async () => {
    const a = pool('ra');
    const b = pool('rb');
    const id = await a.register({ byteLength: 4096 });
    a.writeSync(id, new Uint8Array(4096).fill(1));
    using own = a.readSync(id);
    using other = b.readSync(id);
    expect(regionOf(own.buffer as Uint8Array)).toBeDefined();
    expect(regionOf(other.buffer as Uint8Array)).toBeUndefined();
    // Registered with a transport, the non-owner's view is local-only: no grant, nothing to write through.
    const e = await engine(`rg${process.pid}`);
    const reg = await e.register({ kind: 'host', buffer: other.buffer as Uint8Array });
    const payload = decodeDescriptor(reg.descriptor).transports.get('cuda-ipc') as Uint8Array;
    expect(() => decodePayload(payload, 'host', 4096)).toThrow(/local use only/);
  });

  it("a peer's one-sided write into a pool slot is refused (it would bypass the seqlock); reads work", async () => {
    const a = pool('wa');
    const reader = pool('wr');
    const id = await a.register({ byteLength: 4096 });
    a.writeSync(id, new Uint8Array(4096).fill(1));
    const holder = await engine(`wh${process.pid}`);
    const peer = await engine(`wp${process.pid}`);
    using own = a.readSync(id);
    const granted = await holder.register({ kind: 'host', buffer: own.buffer as Uint8Array });
    using view = reader.readSync(id);
    const local = await peer.register({ kind: 'host', buffer: new Uint8Array(4096).fill(9) });
    const err = await caught(peer.write(holder.endpoint(), [{ local, remote: granted.descriptor }]));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).message).toMatch(/only its owner writes/);
    expect((view.buffer as Uint8Array).every((x) => x === 1)).toBe(true);
    expect(view.isConsistent()).toBe(true);
    // Reading the slot through the grant still works.
    const into = await peer.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await peer.read(holder.endpoint(), [{ local: into, remote: granted.descriptor }]);
    expect(into.memory.kind === 'host' && into.memory.buffer.every((x) => x === 1)).toBe(true);
    // Plain shared memory (not seqlocked) still takes one-sided writes.
    const shared = allocateSharedMemory(4096, 'bk');
    const sharedReg = await holder.register({ kind: 'host', buffer: shared });
    await peer.write(holder.endpoint(), [{ local, remote: sharedReg.descriptor }]);
    expect(shared.every((x) => x === 9)).toBe(true);
    expect(releaseSharedMemory(shared)).toBe(true);
  });
});

/** The grant segment behind a registration's cuda-ipc descriptor. */
function grantOf(descriptor: Uint8Array, kind: 'host' | 'cuda', byteLength: number): string {
  return decodePayload(decodeDescriptor(descriptor).transports.get('cuda-ipc') as Uint8Array, kind, byteLength).grantName;
}
/**
 * Make a CUDA grant look issued by another process: overwrite the owner-process id the grant
 * segment records (ext + 264, 16 bytes), so a peer in this process takes the import path.
 */
function asIfAnotherProcess(grantName: string): void {
  new Uint8Array(native.shmOpen(grantName, 4096), 1024 + 264, 16).fill(0);
}

describe('bookkeeping (fake CUDA): transport imports and close (defects 4 and 5)', () => {
  it('concurrent chunks for one grant import its handle once, and close() closes it once', async () => {
    const imports: bigint[] = [];
    const closed: bigint[] = [];
    let next = 0x10000n;
    fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(3), base: 0x1000n, offset: 0, allocSize: 1 << 20 }));
    fake('cudaImport', async () => {
      const base = (next += 0x10000n);
      imports.push(base);
      await tick(10);
      return base;
    });
    fake('cudaCloseImport', async (_d, p) => {
      closed.push(p);
    });
    fake('cudaCopy', (async () => undefined) as Native['cudaCopy']);
    const holder = await engine(`ih${process.pid}`, { cuda: true });
    const peer = await engine(`ip${process.pid}`, { cuda: true, chunkBytes: 1024, streams: 4 });
    const remote = await holder.register({ kind: 'cuda', device: 0, pointer: 0x1000n, byteLength: 4096 });
    asIfAnotherProcess(grantOf(remote.descriptor, 'cuda', 4096));
    const local = await peer.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await peer.read(holder.endpoint(), [{ local, remote: remote.descriptor }]);
    expect(imports).toHaveLength(1);
    await peer.close();
    expect(closed).toEqual(imports);
  });

  it("a peer in the owner's own process uses the owner's device pointer: no import (CUDA refuses one within a process)", async () => {
    const imports: bigint[] = [];
    const copies: [string, bigint, number][] = [];
    fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(5), base: 0x40000n, offset: 0x800, allocSize: 1 << 20 }));
    fake('cudaImport', async () => {
      imports.push(0n);
      return 0x90000n;
    });
    fake('cudaCopy', (async (op: string, _d: number, dst: unknown, src: unknown, n: number) => {
      copies.push([op, (op === 'd2h' ? src : dst) as bigint, n]);
    }) as Native['cudaCopy']);
    const holder = await engine(`sh${process.pid}`, { cuda: true });
    const peer = await engine(`sp${process.pid}`, { cuda: true });
    const remote = await holder.register({ kind: 'cuda', device: 0, pointer: 0x40800n, byteLength: 4096 });
    const local = await peer.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await peer.read(holder.endpoint(), [{ local, remote: remote.descriptor, remoteOffset: 16, length: 64 }]);
    expect(imports).toEqual([]);
    expect(copies).toEqual([['d2h', 0x40800n + 16n, 64]]);
  });

  it('a batch of device memory on both sides is one cudaCopyRanges call: (dst, src, length) per range, in order', async () => {
    const calls: [number, number[], number][] = [];
    fake('cudaExport', async (_d, p) => ({ handle: new Uint8Array(64).fill(6), base: p, offset: 0, allocSize: 1 << 20 }));
    fake('cudaCopy', (async () => {
      throw new Error('a device-to-device batch must not copy range by range');
    }) as Native['cudaCopy']);
    fake('cudaCopyRanges', async (device, table, count) => {
      calls.push([device, [...table.subarray(0, count * 3)], count]);
    });
    const holder = await engine(`dh${process.pid}`, { cuda: true });
    const peer = await engine(`dp${process.pid}`, { cuda: true });
    const remote = await holder.register({ kind: 'cuda', device: 0, pointer: 0x100000n, byteLength: 1 << 16 });
    const local = await peer.register({ kind: 'cuda', device: 0, pointer: 0x200000n, byteLength: 1 << 16 });
    const requests = [
      { local, localOffset: 0, remote: remote.descriptor, remoteOffset: 8192, length: 100 },
      { local, localOffset: 4096, remote: remote.descriptor, remoteOffset: 0, length: 50 },
      { local, localOffset: 9000, remote: remote.descriptor, remoteOffset: 20000, length: 7 },
    ];
    await peer.read(holder.endpoint(), requests);
    await peer.write(holder.endpoint(), requests);
    expect(calls).toEqual([
      [0, [0x200000, 0x100000 + 8192, 100, 0x200000 + 4096, 0x100000, 50, 0x200000 + 9000, 0x100000 + 20000, 7], 3],
      [0, [0x100000 + 8192, 0x200000, 100, 0x100000, 0x200000 + 4096, 50, 0x100000 + 20000, 0x200000 + 9000, 7], 3],
    ]);
  });

  it('close() waits for a peer copy in flight before unlinking the grant (like revoke)', async () => {
    const copy = gate();
    let copying = false;
    fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(4), base: 0x1000n, offset: 0, allocSize: 1 << 20 }));
    fake('cudaCopy', (async () => {
      copying = true;
      await copy.wait;
    }) as Native['cudaCopy']);
    const holderT = new CudaIpcTransport({ revokeTimeoutMs: 30_000 });
    const holder = new TransferEngine({ nodeId: `ch${process.pid}`, transports: [holderT], logger: silentLogger });
    await holder.start();
    const peer = await engine(`cp${process.pid}`, { cuda: true });
    const shared = allocateSharedMemory(4096, 'bkc');
    const remote = await holder.register({ kind: 'host', buffer: shared });
    const grantName = decodePayload(decodeDescriptor(remote.descriptor).transports.get('cuda-ipc') as Uint8Array, 'host', 4096).grantName;
    const grantPath = `/dev/shm${grantName}`;
    // The peer's local side is (fake) CUDA memory, so its copy from the grant is an awaited cudaCopy.
    const local = await peer.register({ kind: 'cuda', device: 0, pointer: 0x5000n, byteLength: 4096 });
    const reading = peer.read(holder.endpoint(), [{ local, remote: remote.descriptor }]);
    while (!copying) await tick(1);
    let holderClosed = false;
    const closing = holderT.close().then(() => (holderClosed = true));
    await tick(20);
    expect(holderClosed).toBe(false);
    expect(existsSync(grantPath)).toBe(true); // not unlinked under the peer's copy
    copy.open();
    await closing;
    expect(existsSync(grantPath)).toBe(false);
    await caught(reading);
    await holder.close();
    releaseSharedMemory(shared);
  });
});

describe('segment create collisions (defect 7, invariant 10)', () => {
  it('an undecodable segment is left alone while it may still be being created, removed once stale', async () => {
    const owner = uniqueOwner('st');
    const name = poolSegmentName(`pool:${owner}:1`);
    const path = `/dev/shm${name}`;
    mkdirSync('/dev/shm', { recursive: true });
    writeFileSync(path, new Uint8Array(8192), { mode: 0o600 }); // no magic yet: "being created"
    try {
      const p = new TensorPool({ owner });
      pools.push(p);
      const err = await caught(p.register({ byteLength: 16 }));
      expect(err).toBeInstanceOf(ResourceExhaustedError);
      expect((err as Error).message).toMatch(/another process may be creating it/);
      expect(existsSync(path)).toBe(true);
      // Still undecodable long after creation: stale, removed and replaced.
      const old = new Date(Date.now() - 60_000);
      utimesSync(path, old, old);
      const p2 = new TensorPool({ owner });
      pools.push(p2);
      const id = await p2.register({ byteLength: 16 });
      expect(poolSegmentName(id)).toBe(name);
      await p2.free(id);
    } finally {
      rmSync(path, { force: true });
    }
  });
});
