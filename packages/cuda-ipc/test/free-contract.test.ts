/**
 * The free() contract across processes (issue 13, item 7; README "free()"): a non-owner's
 * free() of a host slot returns at once, with `deferred: true` while one of its views is live
 * in that process; its mapping goes when the last view is disposed (`released` settles then,
 * and the mapping leaves the process once nothing references it). The owner's slot is not
 * touched by it (invariant 1).
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { afterAll, describe, expect, it } from 'vitest';
import { fixture, killChildren, spawnNode, uniqueOwner } from './helpers.js';

afterAll(killChildren);

async function consume(id: string, mode: 'live-view' | 'no-view'): Promise<Record<string, unknown>> {
  const proc = fork(fixture('free-consumer.mjs'), [id, uniqueOwner('fc'), mode], { execArgv: ['--expose-gc'], stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  const exited = once(proc, 'exit');
  const [report] = (await once(proc, 'message')) as [Record<string, unknown>];
  expect(await exited).toEqual([0, null]);
  return report;
}

describe('free() by a non-owner of a host slot (issue 13, item 7)', () => {
  it('with a live view: returns at once with deferred: true; the mapping goes when the view is disposed', async () => {
    const owner = await spawnNode(uniqueOwner('fo'));
    const id = await owner.call<string>('register', { dtype: 'float32', shape: [2, 3] });
    await owner.call('write', id, Array.from(new Uint8Array(new Float32Array([1, 2, 3, 4, 5, 6]).buffer)));
    const r = await consume(id, 'live-view');
    expect(r).toEqual({
      sum: 21,
      mappedBefore: true,
      freeReturned: true,
      deferred: true,
      settledBeforeDispose: false,
      listedAfterFree: false,
      viewValidAfterFree: true,
      unmapped: true,
    });
    // The owner's slot is untouched by the consumer's free.
    expect(await owner.call<string[]>('owned')).toContain(id);
    expect((await owner.call<{ bytes: number[] }>('read', id)).bytes).toHaveLength(24);
    await owner.call('close');
  });

  it('with no live view: returns deferred: false with the mapping already released', async () => {
    const owner = await spawnNode(uniqueOwner('fp'));
    const id = await owner.call<string>('register', { dtype: 'uint8', shape: [8] });
    await owner.call('write', id, [1, 1, 1, 1, 1, 1, 1, 1]);
    const r = await consume(id, 'no-view');
    expect(r).toMatchObject({ sum: 8, mappedBefore: true, freeReturned: true, deferred: false, settledBeforeDispose: true, listedAfterFree: false, unmapped: true });
    await owner.call('close');
  });
});
