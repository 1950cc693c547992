/**
 * The pipeline that broke in a comparable runtime: A, B and C each own a pool with the
 * same counter (all `…:1`). B reads and frees A's pool. That free must release only B's
 * mapping of A's pool: C still reads B's pool intact, B's next write succeeds, and A's
 * pool is untouched.
 */
import { afterAll, describe, expect, it } from 'vitest';
import { killChildren, spawnNode, uniqueOwner } from './helpers.js';

afterAll(killChildren);

const bytes = (n: number, seed: number): number[] => Array.from({ length: n }, (_, i) => (i * 31 + seed) & 0xff);

describe('A → B → C pipeline across processes (invariant 1)', () => {
  it("B freeing A's pool leaves B's own pool (same counter) intact for C and for B's next write", async () => {
    const [ownA, ownB, ownC] = [uniqueOwner('pa'), uniqueOwner('pb'), uniqueOwner('pc')];
    const [A, B, C] = await Promise.all([spawnNode(ownA), spawnNode(ownB), spawnNode(ownC)]);
    const idA = await A.call<string>('register', { byteLength: 4096 });
    const idB = await B.call<string>('register', { byteLength: 4096 });
    const idC = await C.call<string>('register', { byteLength: 4096 });
    // Same counter everywhere: only the owner differs.
    expect([idA, idB, idC]).toEqual([`pool:${ownA}:1`, `pool:${ownB}:1`, `pool:${ownC}:1`]);

    await A.call('write', idA, bytes(4096, 1));
    await B.call('write', idB, bytes(4096, 2));

    const seenByB = await B.call<{ bytes: number[] }>('read', idA);
    expect(seenByB.bytes).toEqual(bytes(4096, 1));
    expect(await B.call('mapped')).toEqual([idA]);

    // B frees A's pool: a non-owner free releases only B's mapping of it.
    await B.call('free', idA);
    expect(await B.call('mapped')).toEqual([]);
    expect(await B.call('owned')).toEqual([idB]);

    // C reads B's pool intact.
    const seenByC = await C.call<{ bytes: number[]; consistent: boolean }>('read', idB);
    expect(seenByC.bytes).toEqual(bytes(4096, 2));
    expect(seenByC.consistent).toBe(true);

    // B's next write succeeds and C sees it.
    await B.call('write', idB, bytes(4096, 3));
    expect((await C.call<{ bytes: number[] }>('read', idB)).bytes).toEqual(bytes(4096, 3));

    // A's pool was not touched by B's free: A and C can still read it.
    expect((await C.call<{ bytes: number[] }>('read', idA)).bytes).toEqual(bytes(4096, 1));
    expect(await A.call('owned')).toEqual([idA]);

    // Only the owner's free removes a pool; then readers get a typed error.
    await A.call('free', idA);
    const err = await C.fail('read', idA);
    expect(err.code).toBe('TW_CLOSED');

    // B cannot write into (or free the storage of) C's pool.
    const wrong = await B.fail('write', idC, bytes(16, 0));
    expect(wrong.code).toBe('TW_INVALID_INPUT');
    expect(wrong.message).toMatch(/belongs to/);

    await Promise.all([A.call('close'), B.call('close'), C.call('close')]);
  });
});
