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

  it('refuses a string of more than 255 UTF-8 bytes, ASCII or not', () => {
    for (const s of ['a'.repeat(256), 'é'.repeat(128), `${'a'.repeat(254)}é`]) {
      expect(() => new ByteWriter().str8(s)).toThrow(InvalidInputError);
    }
    expect(new ByteWriter().str8('a'.repeat(255)).finish().length).toBe(256);
    expect(new ByteWriter().str8(`${'a'.repeat(253)}é`).finish().length).toBe(256);
  });
});
