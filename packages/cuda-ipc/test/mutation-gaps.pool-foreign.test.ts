/**
 * Tests written to kill surviving Stryker mutants of the pool's foreign-mapping table and
 * deferred frees (src/pool.ts: #mappingFor, #viewRelease, #import, #dropForeign, #settle,
 * #releaseDevice, close; see the package README, "Mutation testing"): a mapping the owner
 * freed is dropped and not served again, a retired mapping is not taken back once the owner
 * freed it, a reader's view count, an import refused / failed / outrun by the owner's free,
 * a free during an import that fails, a second life of a pool id in this process closing its
 * own import, a failed cuIpcCloseMemHandle, and close() on the owner's side.
 * CUDA calls are FAKE here (as in test/bookkeeping.test.ts): shared memory, headers and
 * importer counts are real; the GPU suite covers the hardware path.
 */
import { describe, expect, it } from 'vitest';
import { ClosedError, InvalidInputError, type Logger, type TensorwireError } from '@tensorwire/core';
import { TensorPool } from '../src/index.js';
import { uniqueOwner } from './helpers.js';
import { failure, nativeFakes, trackedPools, within } from './pool-fixtures.js';

const pool = trackedPools();

const fake = nativeFakes();

/** Fake CUDA: every call recorded in `events`; cudaImport may wait on `importGate`. */
function fakeCuda(events: string[], importGate?: () => Promise<void>): void {
  fake('cudaAlloc', async () => 0x1000n);
  fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(7), base: 0x1000n, offset: 0, allocSize: 4096 }));
  fake('cudaImport', async () => {
    events.push('import');
    if (importGate) await importGate();
    return 0x2000n;
  });
  fake('cudaCloseImport', async () => {
    events.push('closeImport');
  });
  fake('cudaFree', async () => {
    events.push('free');
  });
}

function gate(): { wait: () => Promise<void>; open: () => void; fail: (e: Error) => void } {
  let open = (): void => undefined;
  let fail = (_e: Error): void => undefined;
  const p = new Promise<void>((resolve, reject) => {
    open = resolve;
    fail = reject;
  });
  return { wait: () => p, open, fail };
}

function recorder(): Logger & { warns: { message: string; fields: Record<string, unknown> | undefined }[] } {
  const warns: { message: string; fields: Record<string, unknown> | undefined }[] = [];
  return { warns, debug: () => undefined, info: () => undefined, error: () => undefined, warn: (message, fields) => void warns.push({ message, fields }) };
}

const tick = (ms = 0): Promise<void> => new Promise((r) => setTimeout(r, ms));

describe("the foreign-mapping table: a slot its owner freed is not served again", () => {
  it('a cached mapping of a slot the owner freed is dropped on the next read (ClosedError: does not exist, with the ENOENT cause)', async () => {
    const a = pool('fa');
    const b = pool('fb');
    const id = await a.register({ byteLength: 64 });
    b.readSync(id).dispose();
    expect(b.mapped()).toEqual([id]);
    await a.free(id);
    const e = await failure(() => b.readSync(id));
    expect(e).toBeInstanceOf(ClosedError);
    expect(e.message).toContain(`pool ${id} does not exist`);
    expect(e.details).toMatchObject({ field: 'id' });
    expect((e.cause as TensorwireError).details['errnoName']).toBe('ENOENT');
    expect(b.mapped()).toEqual([]);
  });

  it('a mapping retired by free() while its view lives is not taken back once the owner freed the slot', async () => {
    const a = pool('ra');
    const b = pool('rb');
    const id = await a.register({ byteLength: 64 });
    const view = b.readSync(id);
    const mine = await b.free(id);
    expect(mine.deferred).toBe(true);
    await a.free(id);
    const e = await failure(() => b.readSync(id));
    expect(e).toBeInstanceOf(ClosedError);
    expect(e.message).toContain('does not exist');
    expect(b.mapped()).toEqual([]);
    view.dispose();
    expect(await within(mine.released, 5_000)).toBe('settled');
  });

  it('a second read of a cached CUDA mapping reuses its import; nothing is closed while the slot lives', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const a = pool('ca');
    const b = pool('cb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    (await b.read(id)).dispose();
    (await b.read(id)).dispose();
    (await b.read(id)).dispose();
    expect(events).toEqual(['import']);
    expect(a.importers(id)).toBe(1);
    expect(b.mapped()).toEqual([id]);
    await b.free(id);
    expect(events).toEqual(['import', 'closeImport']);
    expect(a.importers(id)).toBe(0);
  });

  it('two views: the mapping stays until the second is disposed, however often the first is', async () => {
    const a = pool('va');
    const b = pool('vb');
    const id = await a.register({ byteLength: 64 });
    const v1 = b.readSync(id);
    const v2 = b.readSync(id);
    const mine = await b.free(id);
    expect(mine.deferred).toBe(true);
    v1.dispose();
    v1.dispose();
    expect(await within(mine.released, 100)).toBe('pending');
    expect(v2.buffer?.byteLength).toBe(64);
    v2.dispose();
    expect(await within(mine.released, 5_000)).toBe('settled');
  });

  it('after a deferred free settled, reading the id again maps it afresh and a second free closes that import too', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const a = pool('sa');
    const b = pool('sb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const v1 = await b.read(id);
    const first = await b.free(id);
    expect(first.deferred).toBe(true);
    v1.dispose();
    await first.released;
    expect(events).toEqual(['import', 'closeImport']);
    expect(a.importers(id)).toBe(0);
    const v2 = await b.read(id);
    expect(a.importers(id)).toBe(1);
    v2.dispose();
    const second = await b.free(id);
    expect(second.deferred).toBe(false);
    await second.released;
    expect(events).toEqual(['import', 'closeImport', 'import', 'closeImport']);
    expect(a.importers(id)).toBe(0);
  });
});

describe('views of a slot the owner freed, and a second life of a pool id', () => {
  it('the owner freed a CUDA slot with two live views here: it stays mapped until the last is disposed, then the import is closed', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const a = pool('ta', { deferredFreeTimeoutMs: 60_000 });
    const b = pool('tb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const v1 = await b.read(id);
    const v2 = await b.read(id);
    const owner = await a.free(id);
    expect(owner.deferred).toBe(true);
    v1.dispose();
    expect(b.mapped()).toEqual([id]);
    expect(events).toEqual(['import']);
    v2.dispose();
    await owner.released;
    expect(b.mapped()).toEqual([]);
    expect(events).toEqual(['import', 'closeImport', 'free']);
  });

  it("an owner that restarted under the same name reuses a pool id: the old entry's last view does not forget the new one", async () => {
    const events: string[] = [];
    fakeCuda(events);
    const owner = uniqueOwner('re');
    const a = new TensorPool({ owner });
    const b = pool('rf');
    const id = await a.register({ byteLength: 64 });
    const old = b.readSync(id); // a view of the first life (host)
    await a.close();
    const a2 = new TensorPool({ owner, deferredFreeTimeoutMs: 60_000 });
    pool.track(a2);
    expect(await a2.register({ byteLength: 4096, device: 'cuda:0' })).toBe(id); // the same id, a second life
    const v = await b.read(id);
    expect(events).toEqual(['import']);
    const mine = await b.free(id); // deferred: v is live; the entry is kept to be taken back
    expect(mine.deferred).toBe(true);
    old.dispose(); // the first life's last view
    const again = await b.read(id); // takes the second life's entry back: no second import of its handle
    expect(events).toEqual(['import']);
    expect(a2.importers(id)).toBe(1);
    v.dispose();
    again.dispose();
    await b.free(id);
    expect(events).toEqual(['import', 'closeImport']);
    expect(a2.importers(id)).toBe(0);
  });
});

describe('#import: refused, failed, or outrun by the owner', () => {
  it('an importer registration the owner refuses (slot freed) fails the read with ClosedError naming the pool', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const a = pool('ia');
    const b = pool('ib');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    fake('importerAdd', () => false);
    const e = await failure(b.read(id));
    expect(e).toBeInstanceOf(ClosedError);
    expect(e.message).toBe(`pool ${id} was freed by its owner`);
    expect(events).toEqual([]);
  });

  it('a failed cudaImport gives the importer count back', async () => {
    const events: string[] = [];
    fakeCuda(events);
    fake('cudaImport', async () => {
      throw new InvalidInputError('fake: cuIpcOpenMemHandle failed');
    });
    const a = pool('ja');
    const b = pool('jb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const e = await failure(b.read(id));
    expect(e.message).toContain('cuIpcOpenMemHandle failed');
    expect(a.importers(id)).toBe(0);
  });

  it("the owner frees the slot while the import is in flight: the read fails, the import is closed and the owner's free completes", async () => {
    const events: string[] = [];
    const g = gate();
    fakeCuda(events, g.wait);
    const a = pool('oa', { deferredFreeTimeoutMs: 60_000 });
    const b = pool('ob');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const reading = failure(b.read(id));
    while (!events.includes('import')) await tick(1);
    expect(a.importers(id)).toBe(1);
    const owner = await a.free(id);
    expect(owner.deferred).toBe(true);
    g.open();
    const e = await reading;
    expect(e).toBeInstanceOf(ClosedError);
    expect(e.message).toBe(`pool ${id} was freed by its owner`);
    expect(e.details).toMatchObject({ field: 'id' });
    expect(await within(owner.released, 5_000)).toBe('settled');
    expect(events).toEqual(['import', 'closeImport', 'free']);
    expect(b.mapped()).toEqual([]);
  });

  it('free() by this process during the import: the read fails naming the pool and the operation', async () => {
    const events: string[] = [];
    const g = gate();
    fakeCuda(events, g.wait);
    const a = pool('pa', { deferredFreeTimeoutMs: 60_000 });
    const b = pool('pb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const reading = failure(b.read(id));
    while (!events.includes('import')) await tick(1);
    const freeing = b.free(id);
    g.open();
    const e = await reading;
    expect(e).toBeInstanceOf(ClosedError);
    expect(e.message).toBe(`pool ${id} was released by this process (free() or close()) while it was being imported`);
    expect(e.details).toMatchObject({ field: 'id' });
    await freeing;
    expect(a.importers(id)).toBe(0);
  });

  it('free() by this process during an import that then fails: the free still completes', async () => {
    const events: string[] = [];
    const g = gate();
    fakeCuda(events, g.wait);
    const a = pool('qa');
    const b = pool('qb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const reading = failure(b.read(id));
    while (!events.includes('import')) await tick(1);
    const freeing = b.free(id);
    g.fail(new InvalidInputError('fake: cuIpcOpenMemHandle failed'));
    expect((await reading).message).toContain('cuIpcOpenMemHandle failed');
    expect(await within(freeing, 5_000)).toBe('settled');
    expect(a.importers(id)).toBe(0);
    expect(events).toEqual(['import']);
  });

  it('a failed cuIpcCloseMemHandle is logged, and the importer count is still given back', async () => {
    const events: string[] = [];
    fakeCuda(events);
    fake('cudaCloseImport', async () => {
      throw new InvalidInputError('fake: close failed');
    });
    const log = recorder();
    const a = pool('la');
    const b = pool('lb', { logger: log });
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    (await b.read(id)).dispose();
    expect(a.importers(id)).toBe(1);
    const r = await b.free(id);
    await r.released;
    expect(a.importers(id)).toBe(0);
    expect(log.warns).toEqual([{ message: 'cuIpcCloseMemHandle failed', fields: { id, error: expect.stringContaining('close failed') as unknown } }]);
  });
});

describe("the owner's deferred free and close()", () => {
  it('forceAfterMs past: the owner frees anyway and logs who still held it', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const log = recorder();
    const a = pool('wa', { logger: log });
    const b = pool('wb');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const view = await b.read(id);
    const r = await a.free(id, { forceAfterMs: 20 });
    expect(r.deferred).toBe(true);
    await r.released;
    expect(events).toEqual(['import', 'free']);
    expect(log.warns).toEqual([{ message: 'freeing a cuda slot that importers still hold (deadline passed)', fields: { id, importers: 1 } }]);
    view.dispose();
  });

  it('close() frees the CUDA slots (device 0 included) and only those, marks every slot freed and forgets it', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const log = recorder();
    const a = pool('xa', { logger: log });
    const b = pool('xb');
    const host = await a.register({ byteLength: 64 });
    const cuda = await a.register({ byteLength: 4096, device: 'cuda:0' });
    b.readSync(host).dispose(); // b keeps a cached mapping of the host slot
    expect(a.owned().sort()).toEqual([host, cuda].sort());
    fake('cudaFree', async (device: number) => {
      events.push(`free:${device}`);
    });
    await a.close();
    expect(events).toEqual(['free:0']);
    expect(log.warns).toEqual([]);
    expect(a.owned()).toEqual([]);
    // Marked freed: a reader that already mapped the slot cannot read it any more.
    expect(await failure(() => b.readSync(host))).toBeInstanceOf(ClosedError);
    // The pool remembers it freed them (ClosedError, not "not registered").
    expect(await failure(() => a.importers(cuda))).toBeInstanceOf(ClosedError);
  });
});
