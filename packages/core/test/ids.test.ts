import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { IdAllocator, IdRegistry, InvalidInputError, formatId, idProblem, isOwnedBy, isValidId, parseId } from '../src/index.js';

const ownerArb = fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/);
const localArb = fc.stringMatching(/^[A-Za-z0-9_-]{1,64}$/);
const kindArb = fc.constantFrom('pool', 'block', 'session', 'node', 'conn') as fc.Arbitrary<'pool' | 'block' | 'session' | 'node' | 'conn'>;

describe('owner-namespaced ids', () => {
  it('format and parse round-trip for every valid owner and local part', () => {
    fc.assert(
      fc.property(kindArb, ownerArb, localArb, (kind, owner, local) => {
        const id = formatId(kind, owner, local);
        const parsed = parseId(id, kind);
        expect(parsed).toEqual({ kind, owner, local, id });
        expect(isOwnedBy(id, owner)).toBe(true);
      }),
    );
  });

  it('an owner is never confused with another owner that extends it (cam vs cam_left)', () => {
    fc.assert(
      fc.property(ownerArb, fc.stringMatching(/^[A-Za-z0-9_-]{1,8}$/), localArb, (owner, suffix, local) => {
        fc.pre(owner.length + suffix.length <= 64);
        const longer = owner + suffix;
        const id = formatId('pool', longer, local);
        expect(isOwnedBy(id, owner)).toBe(false);
        expect(parseId(id).owner).toBe(longer);
        const short = formatId('pool', owner, local);
        expect(isOwnedBy(short, longer)).toBe(false);
        expect(short).not.toBe(id);
      }),
    );
    expect(isOwnedBy('pool:cam_left:1', 'cam')).toBe(false);
    expect(parseId('pool:cam_left:1').owner).toBe('cam_left');
    expect(parseId('pool:cam-left_2:1').owner).toBe('cam-left_2');
  });

  it('rejects malformed ids with a message naming the problem', () => {
    const bad: [unknown, RegExp][] = [
      [42, /must be a string/],
      ['', /form/],
      ['pool:cam', /form/],
      ['pool:cam:1:2', /form/],
      ['frob:cam:1', /unknown kind/],
      ['pool::1', /owner is empty/],
      ['pool:-cam:1', /must start with a letter or digit/],
      ['pool:c/am:1', /may contain only/],
      ['pool:c..am:1', /may contain only/],
      ['pool:cam:', /local id/],
      ['pool:cam:1 2', /local id/],
      [`pool:${'x'.repeat(65)}:1`, /longer than 64/],
    ];
    for (const [value, re] of bad) {
      expect(idProblem(value)).toMatch(re);
      expect(() => parseId(value)).toThrow(InvalidInputError);
    }
    expect(idProblem('block:cam:1', 'pool')).toMatch(/expected a pool id/);
  });

  it('no arbitrary string that parses is ambiguous: re-formatting gives the same id', () => {
    fc.assert(
      fc.property(fc.string({ maxLength: 200 }), (s) => {
        if (!isValidId(s)) return;
        const p = parseId(s);
        expect(formatId(p.kind, p.owner, p.local)).toBe(s);
      }),
      { numRuns: 2000 },
    );
  });

  it('allocators of different owners with equal counters produce distinct ids', () => {
    const a = new IdAllocator('a');
    const b = new IdAllocator('a_b');
    const ids = new Set<string>();
    for (let i = 0; i < 100; i++) {
      ids.add(a.next('pool'));
      ids.add(b.next('pool'));
    }
    expect(ids.size).toBe(200);
    expect(a.next('block')).toBe('block:a:1');
  });

  it('registries are keyed by the whole id and scoped by exact owner', () => {
    fc.assert(
      fc.property(fc.uniqueArray(ownerArb, { minLength: 2, maxLength: 6 }), fc.integer({ min: 1, max: 20 }), (owners, n) => {
        const reg = new IdRegistry<string, 'pool'>('pool');
        for (const o of owners) for (let i = 1; i <= n; i++) reg.set(formatId('pool', o, i), o);
        expect(reg.size).toBe(owners.length * n);
        // Deleting one owner's entries leaves every other owner's entries, whatever the counters.
        const victim = owners[0] as string;
        for (const [id] of [...reg.ownedBy(victim)]) reg.delete(id);
        expect(reg.size).toBe((owners.length - 1) * n);
        for (const [, owner] of reg) expect(owner).not.toBe(victim);
      }),
    );
    const reg = new IdRegistry<number, 'pool'>('pool');
    expect(() => reg.set('1', 1)).toThrow(InvalidInputError);
    expect(() => reg.set('block:a:1', 1)).toThrow(/expected a pool id/);
    expect(reg.get('1')).toBeUndefined();
  });
});
