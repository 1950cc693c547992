import { idProblem } from '@tensorwire/core';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { blockIdProblem, occursBefore, sessionIdProblem } from '../src/ids.js';

const part = fc.string({ unit: fc.constantFrom('a', 'Z', '0', '_', '-', ':', ' ', 'é'), maxLength: 70 });
const idLike = fc.oneof(
  fc.tuple(fc.constantFrom('block', 'session', 'pool', 'blk', ''), part, part).map(([k, o, l]) => `${k}:${o}:${l}`),
  fc.string({ maxLength: 160 }),
  fc.constantFrom('block:a:1', 'block:a:1\n', 'session:h:x', 'block:-a:1', `block:${'a'.repeat(64)}:${'b'.repeat(64)}`, `block:${'a'.repeat(65)}:b`),
);

describe('fast id checks', () => {
  it('agree with the core on every input, messages included', () => {
    fc.assert(
      fc.property(fc.oneof(idLike, fc.anything()), (v) => {
        expect(blockIdProblem(v)).toBe(idProblem(v, 'block'));
        expect(sessionIdProblem(v)).toBe(idProblem(v, 'session'));
      }),
      { numRuns: 3000 },
    );
  });

  it('finds repeats of earlier entries only', () => {
    const ids = ['a', 'b', 'a', 'c', 'b'];
    expect(ids.map((_, i) => occursBefore(ids, i))).toEqual([false, false, true, false, true]);
  });
});
