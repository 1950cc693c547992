/**
 * Seqlock stress across two processes: a writer process rewrites a tensor whose elements
 * all equal the write's sequence number; this process reads it concurrently, both through
 * snapshot() (copy + re-check) and through zero-copy views checked with isConsistent().
 * No accepted read may ever show mixed values.
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { afterAll, describe, expect, it } from 'vitest';
import { TensorPool } from '../src/index.js';
import { fixture, killChildren, uniqueOwner } from './helpers.js';

afterAll(killChildren);

function uniform(a: Uint32Array): boolean {
  const v = a[0];
  for (let i = 1; i < a.length; i++) if (a[i] !== v) return false;
  return true;
}

describe('seqlock across processes (invariant 11)', () => {
  it('never observes a torn tensor', async () => {
    const elems = 64 * 1024; // 256 KiB: a copy takes long enough to overlap writes often
    const writer = fork(fixture('seqlock-writer.mjs'), [uniqueOwner('sw'), String(elems)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    const [{ id }] = (await once(writer, 'message')) as [{ id: string }];
    const reader = new TensorPool({ owner: uniqueOwner('sr') });
    const dst = new Uint8Array(elems * 4);
    let accepted = 0;
    let rejectedViews = 0;
    let torn = 0;
    const seen = new Set<number>();
    for (let i = 0; i < 3000; i++) {
      const { data } = reader.snapshot(id, dst);
      const a = new Uint32Array(data.buffer, data.byteOffset, data.byteLength / 4);
      if (!uniform(a)) torn++;
      seen.add(a[0] as number);
      accepted++;
      using view = reader.readSync(id);
      const va = view.array() as Uint32Array;
      const copy = va.slice();
      if (view.isConsistent()) {
        if (!uniform(copy)) torn++;
        accepted++;
      } else {
        rejectedViews++;
      }
      if (i % 100 === 0) await new Promise((r) => setImmediate(r));
    }
    // Back-to-back snapshots, each checked at 33 evenly spaced elements (a copy that overlapped
    // a write holds two generations, the older one past the point where the write had got to):
    // many more reads per write than the loop above, so a reader that skipped its re-check
    // would accept torn copies within a few thousand reads whatever the scheduling.
    let tight = 0;
    const started = Date.now();
    while (tight < 20_000 && Date.now() - started < 1500) {
      const { data } = reader.snapshot(id, dst);
      const a = new Uint32Array(data.buffer, data.byteOffset, data.byteLength / 4);
      const v = a[0];
      let mixed = false;
      for (let k = 1; k <= 32; k++) if (a[Math.min(a.length - 1, (k * a.length) >> 5)] !== v) mixed = true;
      if (mixed) torn++;
      seen.add(v as number);
      tight++;
      if (tight % 500 === 0) await new Promise((r) => setImmediate(r));
    }
    writer.send({ op: 'stop' });
    const [{ writes }] = (await once(writer, 'message')) as [{ writes: number }];
    await once(writer, 'exit');
    await reader.close();
    expect(torn, `torn reads (accepted ${accepted}, views rejected ${rejectedViews})`).toBe(0);
    expect(accepted).toBeGreaterThanOrEqual(3000); // every snapshot is accepted; views only when consistent
    // The reads really did overlap many different writes (otherwise the test proves nothing).
    expect(writes).toBeGreaterThan(10);
    expect(seen.size).toBeGreaterThan(2);
    console.info(`seqlock: ${accepted} consistent reads and ${tight} back-to-back snapshots, ${rejectedViews} views rejected by the re-check, ${seen.size} generations seen, ${writes} writes`);
  });
});
