/**
 * Tests written to kill surviving Stryker mutants of TensorPool.free() (the owner path): a
 * write after free through the write hot path's cache, free after close, the messages that
 * name the operation, a host slot's free result, `forceAfterMs`, and close() waiting for a
 * deferred CUDA free. CUDA calls are FAKE here (as in test/bookkeeping.test.ts): headers and
 * importer counts are real; the GPU suite covers the hardware path.
 */
import { describe, expect, it } from 'vitest';
import { ClosedError, InvalidInputError, formatId } from '@tensorwire/core';
import { TensorPool } from '../src/index.js';
import { uniqueOwner } from './helpers.js';
import { failure, nativeFakes, trackedPools, within } from './pool-fixtures.js';

const pool = trackedPools();

const fake = nativeFakes();
function fakeCuda(events: string[]): void {
  fake('cudaAlloc', async () => 0x1000n);
  fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(7), base: 0x1000n, offset: 0, allocSize: 4096 }));
  fake('cudaImport', async () => 0x2000n);
  fake('cudaCloseImport', async () => {
    events.push('closeImport');
  });
  fake('cudaFree', async () => {
    events.push('free');
  });
}

describe("TensorPool.free() on the owner's side", () => {
  it('a slot written last and then freed refuses the next write (the write cache forgets it); other slots still write', async () => {
    const a = pool('wf');
    const one = await a.register({ byteLength: 16 });
    const two = await a.register({ byteLength: 16 });
    a.writeSync(one, new Uint8Array(16).fill(1));
    const r = await a.free(one);
    expect(r.deferred).toBe(false);
    await r.released;
    const err = await failure(() => a.writeSync(one, new Uint8Array(16).fill(2)));
    expect(err).toBeInstanceOf(ClosedError);
    expect(err.message).toMatch(/was freed/);
    a.writeSync(two, new Uint8Array(16).fill(3));
    await failure(() => a.write(one, new Uint8Array(16)));
  });

  it('free() after close() is ClosedError naming the closed pool; a foreign id names the operation', async () => {
    const a = new TensorPool({ owner: uniqueOwner('fc') });
    const id = await a.register({ byteLength: 16 });
    await a.close();
    const err = await failure(() => a.free(id));
    expect(err).toBeInstanceOf(ClosedError);
    expect(err.message).toMatch(/is closed/);
    const b = pool('fd');
    const unknown = formatId('pool', b.owner, 99);
    const e2 = await failure(() => b.free(unknown));
    expect(e2).toBeInstanceOf(InvalidInputError);
    expect(e2.message).toMatch(/not registered/);
    // The op name is in the owner-guard message of the other owner-only calls too.
    const e3 = await failure(() => b.writeSync(id, new Uint8Array(16)));
    expect(e3.message).toMatch(/^cannot write /);
  });

  it("a host slot's free is not deferred and its released promise settles", async () => {
    const a = pool('hf');
    const id = await a.register({ byteLength: 16 });
    const r = await a.free(id);
    expect(r.deferred).toBe(false);
    expect(await within(r.released, 5000)).toBe('settled');
    expect(a.owned()).toEqual([]);
  });

  it('forceAfterMs frees a CUDA slot an importer still holds once it passes (fake CUDA)', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const a = pool('ff', { deferredFreeTimeoutMs: 120_000 });
    const b = pool('fg');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const view = await b.read(id);
    const r = await a.free(id, { forceAfterMs: 50 });
    expect(r.deferred).toBe(true);
    expect(await within(r.released, 10_000)).toBe('settled');
    expect(events).toContain('free');
    view.dispose();
  });

  it('close() waits for a deferred CUDA free until the importer let go (fake CUDA)', async () => {
    const events: string[] = [];
    fakeCuda(events);
    const a = new TensorPool({ owner: uniqueOwner('fw'), deferredFreeTimeoutMs: 120_000 });
    const b = pool('fx');
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const view = await b.read(id);
    const r = await a.free(id);
    expect(r.deferred).toBe(true);
    const closing = a.close();
    expect(await within(closing, 100)).toBe('pending');
    expect(events).not.toContain('free');
    view.dispose(); // the importer closes its import: the owner's free proceeds, then close resolves
    expect(await within(closing, 10_000)).toBe('settled');
    expect(events).toEqual(['closeImport', 'free']);
  });
});
