/**
 * GPU suite: export, import in a second process, device-to-device copy, deferred free.
 * Runs only where libcuda.so.1 and a device exist; otherwise skips and prints why.
 * Nothing here fakes a GPU.
 */
import { afterAll, describe, expect, it } from 'vitest';
import { TensorPool, capabilities, native } from '../src/index.js';
import { killChildren, spawnNode, uniqueOwner } from './helpers.js';

const cuda = capabilities().cuda;
if (!cuda.available) console.warn(`[cuda-ipc] GPU suite skipped: ${cuda.reason}`);

afterAll(killChildren);

describe.skipIf(!cuda.available)(`CUDA IPC on ${cuda.devices[0] ?? 'no device'}`, () => {
  it('exports a slot, imports it in another process, copies device-to-device, defers the free', async () => {
    const owner = new TensorPool({ owner: uniqueOwner('gpu'), deferredFreeTimeoutMs: 20_000 });
    const n = 1 << 20;
    const id = await owner.register({ byteLength: n, device: 'cuda:0' });
    const src = new Uint8Array(n).map((_, i) => (i * 13) & 0xff);
    await owner.write(id, src);

    const reader = await spawnNode(uniqueOwner('gpur'));
    const imported = await reader.call<{ device: string; pointer: string; byteLength: number }>('readCuda', id);
    expect(imported.device).toBe('cuda:0');
    expect(imported.byteLength).toBe(n);
    expect(owner.importers(id)).toBe(1);

    // Device-to-device copy out of the slot, then back to host to check the bytes.
    const dst = await native.cudaAlloc(0, n);
    using v = await owner.read(id);
    await native.cudaCopy('d2d', 0, dst, v.devicePointer as bigint, n);
    const back = new Uint8Array(n);
    await native.cudaCopy('d2h', 0, back, dst, n);
    expect(Buffer.compare(back, src)).toBe(0);
    await native.cudaFree(0, dst);

    // The owner frees while the reader still holds the import: deferred.
    const freed = await owner.free(id);
    expect(freed.deferred).toBe(true);
    let released = false;
    void freed.released.then(() => (released = true));
    await new Promise((r) => setTimeout(r, 50));
    expect(released).toBe(false);
    // The reader closes its import (its own free of a foreign id): the owner's free completes.
    await reader.call('free', id);
    await freed.released;
    expect(released).toBe(true);
    await reader.call('close');
    await owner.close();
  });
});
