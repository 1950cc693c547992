/**
 * Tests written to kill surviving Stryker mutants of the same-host transport's payload decoding
 * (src/transport.ts `decodePayload`; see the package README, "Mutation testing"): every refusal
 * with its message and `details.field`, the boundaries (memory kind 1, mode 3, a byte total equal
 * to the range count), the fields read, and the decoded token and range lengths being copies.
 * Payloads are built byte by byte here (the wire layout of `encodePayload` /
 * `encodeRangePayload`), so no addon or shared memory is needed.
 */
import { ByteWriter, InvalidInputError } from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import { decodePayload } from '../src/index.js';

const MAGIC = [0x54, 0x57, 0x43, 0x47];
const TOKEN = Uint8Array.from({ length: 16 }, (_, i) => i + 1);
const TABLE = '/tw-t.owner.0123456789abcdef';
const GRANT = '/tw-g.owner.0123456789abcdef';

interface Head {
  magic?: readonly number[];
  version?: number;
  kind?: number;
  mode?: number;
}
function head(h: Head = {}): ByteWriter {
  const w = new ByteWriter(160);
  for (const b of h.magic ?? MAGIC) w.u8(b);
  return w
    .u8(h.version ?? 1)
    .u8(h.kind ?? 0)
    .u8(h.mode ?? 1);
}
/** A whole-registration grant's payload (mode 1). */
function registration(o: Head & { name?: string; length?: number; extra?: number } = {}): Uint8Array {
  const w = head(o).str8(o.name ?? GRANT).bytes(TOKEN).u64(o.length ?? 100);
  if (o.extra) for (let i = 0; i < o.extra; i++) w.u8(0);
  return w.finish();
}
/** A range grant's payload (mode 2). */
function ranges(o: Head & { table?: string; record?: number; generation?: number; count?: number; length?: number } = {}): Uint8Array {
  return head({ mode: 2, ...o })
    .str8(o.table ?? TABLE)
    .u32(o.record ?? 3)
    .u64(o.generation ?? 7)
    .bytes(TOKEN)
    .u32(o.count ?? 2)
    .u64(o.length ?? 96)
    .finish();
}
/** A local-only registration's payload (mode 0). */
function local(extra = 0): Uint8Array {
  const w = head({ mode: 0 }).u64(64);
  for (let i = 0; i < extra; i++) w.u8(0);
  return w.finish();
}

function refusal(f: () => unknown): InvalidInputError {
  let err: unknown;
  try {
    f();
  } catch (e) {
    err = e;
  }
  expect(err).toBeInstanceOf(InvalidInputError);
  return err as InvalidInputError;
}
function refused(f: () => unknown, message: string | RegExp, field: string): void {
  const e = refusal(f);
  if (typeof message === 'string') expect(e.message).toBe(message);
  else expect(e.message).toMatch(message);
  expect(e.details).toMatchObject({ field });
}

describe('decodePayload: the header', () => {
  it('refuses a bad magic byte, in any position', () => {
    for (let k = 0; k < 4; k++) {
      const magic = [...MAGIC];
      magic[k] = (magic[k] as number) ^ 1;
      refused(() => decodePayload(registration({ magic }), 'host', 100), 'not a cuda-ipc payload (bad magic)', 'magic');
    }
  });

  it('refuses another wire version, naming it', () => {
    refused(() => decodePayload(registration({ version: 2 }), 'host', 100), 'cuda-ipc payload version 2 is not supported', 'version');
  });

  it('memory kind: 0 is host, 1 is cuda, 2 is unknown; it must match the descriptor', () => {
    expect(decodePayload(registration({ kind: 0 }), 'host', 100)).toMatchObject({ kind: 'host' });
    expect(decodePayload(registration({ kind: 1 }), 'cuda', 100)).toMatchObject({ kind: 'cuda' });
    refused(() => decodePayload(registration({ kind: 2 }), 'host', 100), 'cuda-ipc payload: memory kind 2 is unknown', 'memoryKind');
    refused(() => decodePayload(registration({ kind: 0 }), 'cuda', 100), 'cuda-ipc payload is for host memory, descriptor says cuda', 'memoryKind');
    refused(() => decodePayload(registration({ kind: 1 }), 'host', 100), 'cuda-ipc payload is for cuda memory, descriptor says host', 'memoryKind');
  });

  it('mode: 4 is unknown; 0 is local-only memory, refused with the reason; its length and end are read', () => {
    refused(() => decodePayload(registration({ mode: 4 }), 'host', 100), 'cuda-ipc payload: mode 4 is unknown', 'mode');
    refused(() => decodePayload(local(), 'host', 64), /^the peer registered this memory for local use only: it is not in shared memory/, 'remote');
    // A local payload with a trailing byte is malformed before it is local-only.
    refused(() => decodePayload(local(1), 'host', 64), 'cuda-ipc payload has 1 trailing bytes', 'trailing');
    // ... and one without its length is short.
    const short = head({ mode: 0 }).finish();
    expect(refusal(() => decodePayload(short, 'host', 64)).message).not.toMatch(/local use only/);
  });
});

describe('decodePayload: a whole-registration grant (mode 1)', () => {
  it('decodes the grant name, a copy of the token, and the length', () => {
    const p = registration({ length: 100 });
    const g = decodePayload(p, 'host', 100);
    expect(g).toEqual({ kind: 'host', grantName: GRANT, token: TOKEN, length: 100 });
    expect(Object.isFrozen(g)).toBe(true);
    p.fill(0);
    expect(g.token).toEqual(TOKEN);
  });

  it('refuses range lengths, a name that is not a grant segment or not a segment name, a length other than the descriptor, trailing bytes', () => {
    refused(() => decodePayload(registration(), 'host', 100, Float64Array.of(100)), 'cuda-ipc payload grants a whole registration, but the descriptor lists granted ranges', 'rangeLengths');
    refused(() => decodePayload(registration({ name: TABLE }), 'host', 100), 'cuda-ipc payload: not a grant segment', 'grant');
    refused(() => decodePayload(registration({ name: '/tw-g.a..b' }), 'host', 100), "cuda-ipc payload: segment name may not contain '..'", 'grant');
    refused(() => decodePayload(registration({ length: 100 }), 'host', 101), 'cuda-ipc payload grants 100 bytes, descriptor says 101', 'byteLength');
    refused(() => decodePayload(registration({ extra: 2 }), 'host', 100), 'cuda-ipc payload has 2 trailing bytes', 'trailing');
  });
});

describe('decodePayload: a range grant (mode 2)', () => {
  it('decodes table, record, generation, a copy of the token, count, length, and a copy of the range lengths', () => {
    const p = ranges({ record: 3, generation: 7, count: 2, length: 96 });
    const lengths = Float64Array.of(32, 64);
    const g = decodePayload(p, 'host', 96, lengths);
    expect(g).toEqual({ kind: 'host', tableName: TABLE, record: 3, generation: 7, token: TOKEN, count: 2, length: 96, rangeLengths: Float64Array.of(32, 64), form: 'ranges' });
    // Mode 3, a block grant: the same fields; its record's table must be in the blocks form.
    expect(decodePayload(ranges({ mode: 3, record: 3, generation: 7, count: 2, length: 96 }), 'host', 96, Float64Array.of(48, 48))).toEqual({
      kind: 'host',
      tableName: TABLE,
      record: 3,
      generation: 7,
      token: TOKEN,
      count: 2,
      length: 96,
      rangeLengths: Float64Array.of(48, 48),
      form: 'blocks',
    });
    expect(Object.isFrozen(g)).toBe(true);
    p.fill(0);
    lengths.fill(0);
    expect((g as { token: Uint8Array }).token).toEqual(TOKEN);
    expect([...(g as { rangeLengths: Float64Array }).rangeLengths]).toEqual([32, 64]);
  });

  it('a byte total equal to the range count is accepted; one less is refused', () => {
    expect(decodePayload(ranges({ count: 2, length: 2 }), 'host', 2, Float64Array.of(1, 1))).toMatchObject({ count: 2, length: 2 });
    refused(() => decodePayload(ranges({ count: 2, length: 1 }), 'host', 1, Float64Array.of(1, 1)), 'cuda-ipc payload: 2 ranges cannot cover 1 bytes', 'length');
  });

  it('refuses cuda memory, a name that is not a grant table, missing or untyped range lengths, no ranges, a count that disagrees with the lengths', () => {
    refused(() => decodePayload(ranges({ kind: 1 }), 'cuda', 96, Float64Array.of(32, 64)), 'cuda-ipc payload: range grants are of host memory', 'memoryKind');
    refused(() => decodePayload(ranges({ table: GRANT }), 'host', 96, Float64Array.of(32, 64)), 'cuda-ipc payload: not a grant table', 'grant');
    refused(() => decodePayload(ranges({ table: '/tw-t.a..b' }), 'host', 96, Float64Array.of(32, 64)), "cuda-ipc payload: segment name may not contain '..'", 'grant');
    refused(() => decodePayload(ranges(), 'host', 96), 'cuda-ipc payload is a range grant, but the descriptor has no range lengths', 'rangeLengths');
    refused(() => decodePayload(ranges(), 'host', 96, [32, 64] as unknown as Float64Array), 'cuda-ipc: range lengths must be a Float64Array', 'rangeLengths');
    refused(() => decodePayload(ranges({ count: 0 }), 'host', 96, new Float64Array(0)), 'cuda-ipc payload grants no range', 'count');
    refused(() => decodePayload(ranges({ count: 2 }), 'host', 96, Float64Array.of(96)), 'cuda-ipc payload grants 2 ranges, the descriptor lists 1', 'count');
  });

  it('checks the range count before the byte total, and reads the whole payload before either', () => {
    // count 0 and length 0: "no range", not "cannot cover".
    refused(() => decodePayload(ranges({ count: 0, length: 0 }), 'host', 0, new Float64Array(0)), 'cuda-ipc payload grants no range', 'count');
    const long = new Uint8Array([...ranges(), 0]);
    refused(() => decodePayload(long, 'host', 96, Float64Array.of(32, 64)), 'cuda-ipc payload has 1 trailing bytes', 'trailing');
  });
});

describe('decodePayload: a truncated payload names the field it stopped in', () => {
  /** The fields of each payload layout, in order, with their sizes (a str8 is its length byte, then its bytes). */
  const layouts: [string, Uint8Array, [string, number][]][] = [
    ['local', local(), [['magic', 4], ['version', 1], ['memory kind', 1], ['mode', 1], ['length', 8]]],
    ['registration', registration(), [['magic', 4], ['version', 1], ['memory kind', 1], ['mode', 1], ['grant name', 1 + GRANT.length], ['token', 16], ['length', 8]]],
    ['ranges', ranges(), [['magic', 4], ['version', 1], ['memory kind', 1], ['mode', 1], ['grant table', 1 + TABLE.length], ['record', 4], ['generation', 8], ['token', 16], ['range count', 4], ['length', 8]]],
  ];
  it('each cut at a field start is "truncated" naming that field (message and details.field)', () => {
    for (const [label, whole, fields] of layouts) {
      let at = 0;
      for (const [field, size] of fields) {
        const e = refusal(() => decodePayload(whole.subarray(0, at), 'host', 96, label === 'ranges' ? Float64Array.of(32, 64) : undefined));
        expect(e.message, `${label} cut at ${at}`).toMatch(new RegExp(`^cuda-ipc payload is truncated: ${field} needs \\d+ bytes, 0 left$`));
        expect(e.details, `${label} cut at ${at}`).toMatchObject({ field });
        at += size;
      }
      expect(at, label).toBe(whole.length);
    }
  });
});
