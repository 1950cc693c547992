/**
 * The binary codec every descriptor and frame goes through: what ByteWriter writes is the
 * big-endian / length-prefixed UTF-8 a reference encoder writes (its in-place ASCII and
 * two-half u64 paths included), and ByteReader reads it back; out-of-range input is refused.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { ByteReader, ByteWriter, InvalidInputError } from '../src/index.js';

/** The reference: Buffer's own encoders. */
function reference(fields: readonly ({ s: string } | { n: number | bigint })[]): Buffer {
  const parts: Buffer[] = [];
  for (const f of fields) {
    if ('s' in f) {
      const b = Buffer.from(f.s, 'utf8');
      parts.push(Buffer.of(b.length), b);
    } else {
      const b = Buffer.alloc(8);
      b.writeBigUInt64BE(BigInt(f.n));
      parts.push(b);
    }
  }
  return Buffer.concat(parts);
}

const text = fc.oneof(fc.string({ maxLength: 255 }), fc.string({ minLength: 200, maxLength: 255 }), fc.string({ unit: 'grapheme', maxLength: 40 }), fc.string({ unit: 'binary', maxLength: 60 }), fc.constant(''));
const u64 = fc.oneof(
  fc.constant(0),
  fc.nat(),
  fc.integer({ min: 0, max: Number.MAX_SAFE_INTEGER }),
  fc.constant(2 ** 32),
  fc.constant(2 ** 32 - 1),
  // Either side of the largest safe integer (safeU64's bound).
  fc.constantFrom(2n ** 53n - 1n, 2n ** 53n, 2n ** 54n - 1n, 2n ** 54n),
  fc.bigInt({ min: 0n, max: 2n ** 64n - 1n }),
);

describe('ByteWriter / ByteReader', () => {
  it('write what the reference encoder writes, and read it back', () => {
    fc.assert(
      fc.property(fc.array(fc.oneof(text.map((s) => ({ s })), u64.map((n) => ({ n }))), { maxLength: 12 }), fc.integer({ min: 1, max: 64 }), (fields, capacity) => {
        const fit = fields.filter((f) => !('s' in f) || Buffer.byteLength(f.s, 'utf8') <= 255);
        const w = new ByteWriter(capacity);
        for (const f of fit) {
          if ('s' in f) w.str8(f.s);
          else w.u64(f.n);
        }
        const out = w.finish();
        expect(Buffer.from(out).equals(reference(fit))).toBe(true);
        const r = new ByteReader(out, 'test');
        for (const f of fit) {
          if ('s' in f) expect(r.str8('s')).toBe(f.s);
          else {
            expect(r.u64('n')).toBe(BigInt(f.n));
          }
        }
        r.end();
        // safeU64 reads the same bytes as a number, or refuses past 2^53 - 1.
        const r2 = new ByteReader(out, 'test');
        for (const f of fit) {
          if ('s' in f) r2.str8('s');
          else if (BigInt(f.n) <= BigInt(Number.MAX_SAFE_INTEGER)) expect(r2.safeU64('n')).toBe(Number(f.n));
          else {
            expect(() => r2.safeU64('n')).toThrow(new RegExp(`test: n ${String(f.n)} exceeds the largest safe integer`));
            return; // the reader stays before the refused field
          }
        }
      }),
      { numRuns: 1000 },
    );
  });

  it('writers used at the same time (nested encoders) never share bytes; a writer left unfinished does not break later ones', () => {
    type Op = { w: number; f: { s: string } | { n: number | bigint } } | { finish: number } | { abandon: true };
    const op: fc.Arbitrary<Op> = fc.oneof(
      { weight: 8, arbitrary: fc.record({ w: fc.nat(3), f: fc.oneof(text.filter((x) => Buffer.byteLength(x, 'utf8') <= 255).map((x) => ({ s: x })), u64.map((n) => ({ n }))) }) },
      { weight: 2, arbitrary: fc.record({ finish: fc.nat(3) }) },
      { weight: 1, arbitrary: fc.constant({ abandon: true as const }) },
    );
    fc.assert(
      fc.property(fc.array(op, { maxLength: 80 }), (ops) => {
        let writers: { w: ByteWriter; fields: ({ s: string } | { n: number | bigint })[] }[] = [0, 1, 2, 3].map(() => ({ w: new ByteWriter(), fields: [] }));
        const check = (k: number): void => {
          const x = writers[k] as { w: ByteWriter; fields: ({ s: string } | { n: number | bigint })[] };
          expect(Buffer.from(x.w.finish()).equals(reference(x.fields))).toBe(true);
          expect(() => x.w.finish()).toThrow(/finish\(\) called twice/);
          expect(() => x.w.u8(1)).toThrow(/written to after finish/);
          writers[k] = { w: new ByteWriter(), fields: [] };
        };
        for (const o of ops) {
          if ('abandon' in o) {
            // A writer dropped mid-way (its encoder threw): the next ones work all the same.
            new ByteWriter().str8('dropped').u64(7);
            writers = writers.map(() => ({ w: new ByteWriter(), fields: [] }));
          } else if ('finish' in o) check(o.finish);
          else {
            const x = writers[o.w] as { w: ByteWriter; fields: ({ s: string } | { n: number | bigint })[] };
            if ('s' in o.f) x.w.str8(o.f.s);
            else x.w.u64(o.f.n);
            x.fields.push(o.f);
          }
        }
        for (let k = 0; k < writers.length; k++) check(k);
      }),
      { numRuns: 500 },
    );
    // Many writers left unfinished in a row: later ones still encode right (the pool's buffer is remade).
    for (let i = 0; i < 100; i++) new ByteWriter().u32(i);
    for (let i = 0; i < 100; i++) expect([...new ByteWriter().u32(i).str8('x').finish()]).toEqual([0, 0, i >> 8, i & 255, 1, 0x78]);
  });

  it('refuses a string of more than 255 UTF-8 bytes, ASCII or not', () => {
    for (const s of ['a'.repeat(256), 'é'.repeat(128), `${'a'.repeat(254)}é`]) {
      expect(() => new ByteWriter().str8(s)).toThrow(InvalidInputError);
    }
    expect(new ByteWriter().str8('a'.repeat(255)).finish().length).toBe(256);
    expect(new ByteWriter().str8(`${'a'.repeat(253)}é`).finish().length).toBe(256);
  });
});
