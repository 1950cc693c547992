/**
 * The kit's grant table: tokens, O(1) bounds per range against the granted range (a property
 * against a model), handles owned by one table, revoked-token memory, and revocation that waits
 * only for that entry's in-flight use, aborting its users after the grace (races included).
 */
import fc from 'fast-check';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { ClosedError, InvalidInputError } from '../src/errors.js';
import { planBatch } from '../src/kit/batch.js';
import { HEADER_BYTES, NO_RANGE, encodeReadvReq, encodeWritevReq, vecHeadBytes } from '../src/kit/frames.js';
import type { GrantEntry, RangeGrant } from '../src/kit/grants.js';
import { GrantRefusalCode, GrantTable, LocalRegistration, type GrantUser, type RangeRefusal } from '../src/kit/grants.js';
import { DEFAULT_TUNING } from '../src/kit/stream.js';
import { GRANT_STRIDE, createTransferBatch, type GrantRanges } from '../src/transport.js';

afterEach(() => {
  vi.useRealTimers();
});

function table(revokeGraceMs = 10_000, revokedMemory?: number): GrantTable {
  return new GrantTable({ transport: 'test', revokeGraceMs, ...(revokedMemory === undefined ? {} : { revokedMemory }) });
}

function ranges(handles: object[], list: [number, number, number][]): GrantRanges {
  const r = new Float64Array(list.length * GRANT_STRIDE);
  list.forEach((x, k) => r.set(x, k * GRANT_STRIDE));
  return { handles, count: list.length, ranges: r, bytes: list.reduce((s, x) => s + x[2], 0) };
}

function user(): GrantUser & { aborted: number } {
  const u = { aborted: 0, abortForRevoke: () => void u.aborted++ };
  return u;
}

/** The head of a READV_REQ (what the responder checks). */
function head(tokens: Uint8Array[], rs: { token: number; range?: number; offset: number; length: number }[]): Buffer {
  return encodeReadvReq(1, tokens, rs).subarray(HEADER_BYTES);
}

async function flush(): Promise<void> {
  for (let i = 0; i < 10; i++) await Promise.resolve();
}

function settledFlag(p: Promise<unknown>): { done: boolean } {
  const f = { done: false };
  void p.then(() => (f.done = true));
  return f;
}

describe('kit grant table: tokens and cost', () => {
  it('one 128-bit token and one entry per registration or grant, whatever its ranges; the range table kept by reference', () => {
    const t = table();
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(1 << 20) });
    expect(reg.payload).toHaveLength(16);
    expect(t.size).toBe(1);
    for (const n of [10, 10_000]) {
      const spec = ranges([reg.handle], Array.from({ length: n }, (_, k) => [0, k * 64, 64] as [number, number, number]));
      const g = t.grant(spec);
      expect(g.payload).toHaveLength(16);
      expect((g.handle as RangeGrant).ranges).toBe(spec.ranges);
    }
    expect(t.size).toBe(3);
    expect(t.rangeGrantCount).toBe(2);
    const tokens = new Set([reg.payload, ...[1, 2, 3].map(() => t.register({ kind: 'host', buffer: new Uint8Array(1) }).payload)].map((p) => Buffer.from(p).toString('hex')));
    expect(tokens.size).toBe(4);
  });

  it('handles belong to their table: another table\'s registration cannot be granted, revoked, or used as a batch local', async () => {
    const t = table();
    const other = table();
    const foreign = other.register({ kind: 'host', buffer: new Uint8Array(64) });
    expect(() => t.grant(ranges([foreign.handle], [[0, 0, 8]]))).toThrow(InvalidInputError);
    await expect(t.revoke(foreign.handle)).rejects.toThrow(InvalidInputError);
    const g = other.grant(ranges([foreign.handle], [[0, 0, 8]]));
    await expect(t.revokeGrant(g.handle)).rejects.toThrow(InvalidInputError);
    const remote = t.decodeRemote(t.register({ kind: 'host', buffer: new Uint8Array(64) }).payload, 'host', 64);
    const batch = createTransferBatch('read', [{ local: foreign.handle, localOffset: 0, remote, remoteOffset: 0, length: 8 }]);
    expect(() => planBatch(batch, t, { cap: 1024, frameTargetBytes: DEFAULT_TUNING.frameTargetBytes, zeroCopyMinBytes: DEFAULT_TUNING.zeroCopyMinBytes })).toThrow(/of this transport/);
  });

  it('only host memory; a closed table registers and grants nothing', () => {
    const t = table();
    expect(() => t.register({ kind: 'cuda', device: 0, pointer: 1n, byteLength: 8 })).toThrow(InvalidInputError);
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(8) });
    t.close();
    expect(t.size).toBe(0);
    expect(() => t.register({ kind: 'host', buffer: new Uint8Array(8) })).toThrow(ClosedError);
    expect(() => t.grant(ranges([reg.handle], [[0, 0, 8]]))).toThrow(ClosedError);
  });

  it('decodeRemote: a 16-byte token, host memory, a safe length, range lengths kept by reference', () => {
    const t = table();
    expect(() => t.decodeRemote(new Uint8Array(15), 'host', 8)).toThrow(InvalidInputError);
    expect(() => t.decodeRemote(new Uint8Array(16), 'cuda', 8)).toThrow(InvalidInputError);
    expect(() => t.decodeRemote(new Uint8Array(16), 'host', -1)).toThrow(InvalidInputError);
    expect(() => t.decodeRemote(new Uint8Array(16), 'host', 8, new Float64Array(0))).toThrow(InvalidInputError);
    const lens = Float64Array.of(4, 4);
    expect(t.decodeRemote(new Uint8Array(16), 'host', 8, lens).rangeLengths).toBe(lens);
  });
});

describe('kit grant table: the range check', () => {
  it('property: check() refuses exactly what a model refuses (first bad range, its code), and pins one entry per live token', () => {
    const layout = fc.array(fc.record({ offset: fc.integer({ min: 0, max: 900 }), length: fc.integer({ min: 1, max: 100 }) }), { minLength: 1, maxLength: 6 });
    const req = fc.record({
      which: fc.integer({ min: 0, max: 3 }), // 0: registration, 1: grant, 2: revoked grant, 3: unknown token
      range: fc.oneof({ arbitrary: fc.integer({ min: 0, max: 6 }), weight: 5 }, fc.constant(0xffffffff)),
      offset: fc.oneof({ arbitrary: fc.integer({ min: 0, max: 120 }), weight: 5 }, fc.constant(2 ** 53 - 1), fc.constant(2 ** 32 + 5)),
      length: fc.oneof({ arbitrary: fc.integer({ min: 1, max: 120 }), weight: 5 }, fc.constant(0), fc.constant(0xffffffff)),
    });
    fc.assert(
      fc.property(layout, fc.array(req, { minLength: 1, maxLength: 12 }), fc.integer({ min: 50, max: 2000 }), (lay, reqs, maxTotal) => {
        const t = table();
        const reg = t.register({ kind: 'host', buffer: new Uint8Array(1024) });
        const g = t.grant(ranges([reg.handle], lay.map((l) => [0, l.offset, l.length])));
        const gone = t.grant(ranges([reg.handle], [[0, 0, 8]]));
        void t.revokeGrant(gone.handle);
        const tokens = [reg.payload, g.payload, gone.payload, new Uint8Array(16).fill(0xee)];
        const model = (): { range: number; code: string } | undefined => {
          let total = 0;
          for (const [i, r] of reqs.entries()) {
            if (r.which === 2) return { range: i, code: GrantRefusalCode.Revoked };
            if (r.which === 3) return { range: i, code: GrantRefusalCode.Unknown };
            if (r.length === 0) return { range: i, code: GrantRefusalCode.BadRequest };
            const lens = r.which === 0 ? [1024] : lay.map((l) => l.length);
            if (r.range >= lens.length) return { range: i, code: GrantRefusalCode.NoSuchRange };
            if (r.offset + r.length > (lens[r.range] as number)) return { range: i, code: GrantRefusalCode.OutOfBounds };
            total += r.length;
            if (total > maxTotal) return { range: i, code: GrantRefusalCode.TooLarge };
          }
          return undefined;
        };
        const entries: (GrantEntry | RangeRefusal)[] = [];
        const got = t.check(head(tokens, reqs.map((r) => ({ token: r.which, range: r.range, offset: r.offset, length: r.length }))), -1, maxTotal, entries);
        const want = model();
        if (want === undefined) {
          expect(Array.isArray(got)).toBe(true);
          expect((got as GrantEntry[]).length).toBe(2); // the registration and the live grant
        } else {
          expect(got).toMatchObject({ range: want.range, code: want.code });
        }
      }),
      { numRuns: 600 },
    );
  });

  it('a grant range is checked against its own length, never the registration: one byte past it is OUT_OF_BOUNDS', () => {
    const t = table();
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(64 * 1024) });
    const g = t.grant(ranges([reg.handle], [[0, 4096, 1024], [0, 16384, 1024]]));
    const check = (rs: { range: number; offset: number; length: number }[]) => t.check(head([g.payload], rs.map((r) => ({ token: 0, ...r }))), -1, 1 << 20, []);
    expect(Array.isArray(check([{ range: 0, offset: 0, length: 1024 }, { range: 1, offset: 1023, length: 1 }]))).toBe(true);
    expect(check([{ range: 0, offset: 0, length: 1025 }])).toMatchObject({ code: 'OUT_OF_BOUNDS', range: 0 });
    expect(check([{ range: 0, offset: 1, length: 1024 }])).toMatchObject({ code: 'OUT_OF_BOUNDS', range: 0 });
    expect(check([{ range: 1, offset: 0, length: 8 }, { range: 2, offset: 0, length: 1 }])).toMatchObject({ code: 'NO_SUCH_RANGE', range: 1 });
  });

  it('a WRITEV whose ranges do not add up to its data is BAD_REQUEST naming no range', () => {
    const t = table();
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(64) });
    const frame = encodeWritevReq(1, [reg.payload], [{ token: 0, offset: 0, length: 8 }], new Uint8Array(8));
    const h = frame.subarray(HEADER_BYTES, HEADER_BYTES + vecHeadBytes(1, 1));
    expect(Array.isArray(t.check(h, 8, 1024, []))).toBe(true);
    expect(t.check(h, 9, 1024, [])).toMatchObject({ code: 'BAD_REQUEST', range: NO_RANGE });
  });

  it('revoked tokens are answered REVOKED, unknown ones UNKNOWN_GRANT; the memory of revoked tokens is bounded', async () => {
    const t = table(10_000, 3);
    const regs = Array.from({ length: 5 }, () => t.register({ kind: 'host', buffer: new Uint8Array(8) }));
    for (const r of regs) await t.revoke(r.handle);
    const code = (token: Uint8Array) => (t.lookup(head([token], [{ token: 0, offset: 0, length: 1 }]), 8) as RangeRefusal).code;
    expect(regs.map((r) => code(r.payload))).toEqual(['UNKNOWN_GRANT', 'UNKNOWN_GRANT', 'REVOKED', 'REVOKED', 'REVOKED']);
    expect(code(new Uint8Array(16))).toBe('UNKNOWN_GRANT');
  });
});

describe('kit grant table: revocation', () => {
  it('revokeGrant waits for in-flight use of that grant only; other entries\' users neither delay it nor get aborted', async () => {
    vi.useFakeTimers();
    const t = table(500);
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(1024) });
    const g1 = t.grant(ranges([reg.handle], [[0, 0, 100]]));
    const g2 = t.grant(ranges([reg.handle], [[0, 200, 100]]));
    const u1 = user();
    (g1.handle as GrantEntry).acquire(u1);
    (reg.handle as GrantEntry).acquire(u1);
    const r2 = settledFlag(t.revokeGrant(g2.handle));
    await flush();
    expect(r2.done).toBe(true);
    await vi.advanceTimersByTimeAsync(10_000);
    expect(u1.aborted).toBe(0);
  });

  it('revoke resolves once the last in-flight use is released, and not before; the token is REVOKED at once', async () => {
    const t = table();
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(1024) });
    const g1 = t.grant(ranges([reg.handle], [[0, 0, 100]]));
    const g2 = t.grant(ranges([reg.handle], [[0, 200, 100]]));
    const [u1, u2] = [user(), user()];
    const e1 = g1.handle as GrantEntry;
    e1.acquire(u1);
    e1.acquire(u1);
    (g2.handle as GrantEntry).acquire(u2);
    const r1 = settledFlag(t.revokeGrant(g1.handle));
    expect((t.lookup(head([g1.payload], [{ token: 0, offset: 0, length: 1 }]), 8) as RangeRefusal).code).toBe('REVOKED');
    await flush();
    expect(r1.done).toBe(false);
    e1.release(u2); // not a holder of g1: changes nothing
    e1.release(u1);
    await flush();
    expect(r1.done).toBe(false);
    e1.release(u1);
    await flush();
    expect(r1.done).toBe(true);
    expect(u1.aborted + u2.aborted).toBe(0);
    // g2 is still in use and live.
    expect(t.lookup(head([g2.payload], [{ token: 0, offset: 0, length: 1 }]), 8)).toBe(g2.handle);
  });

  it('grace, then abort: a user that stalls past revokeGraceMs is aborted (only that entry\'s users), and the revoke resolves once it let go', async () => {
    vi.useFakeTimers();
    const t = table(500);
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(1024) });
    const g1 = t.grant(ranges([reg.handle], [[0, 0, 100]]));
    const g2 = t.grant(ranges([reg.handle], [[0, 200, 100]]));
    const stalled = user();
    const bystander = user();
    const e1 = g1.handle as GrantEntry;
    e1.acquire(stalled);
    (g2.handle as GrantEntry).acquire(bystander);
    stalled.abortForRevoke = () => {
      stalled.aborted++;
      e1.release(stalled); // aborting a stream releases what it held
    };
    const r = settledFlag(t.revokeGrant(g1.handle));
    await vi.advanceTimersByTimeAsync(499);
    expect(stalled.aborted).toBe(0);
    expect(r.done).toBe(false);
    await vi.advanceTimersByTimeAsync(1);
    expect(stalled.aborted).toBe(1);
    expect(bystander.aborted).toBe(0);
    await flush();
    expect(r.done).toBe(true);
    expect(vi.getTimerCount()).toBe(0);
  });

  it('revoking a registration ends its grants and waits for their users too; revoking again is idempotent', async () => {
    const t = table();
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(1024) });
    const g = t.grant(ranges([reg.handle], [[0, 0, 100]]));
    const u = user();
    (g.handle as GrantEntry).acquire(u);
    const r = settledFlag(t.revoke(reg.handle));
    await flush();
    expect((g.handle as GrantEntry).revoked).toBe(true);
    expect(t.rangeGrantCount).toBe(0);
    expect(t.grantsOver(reg.handle)).toBe(0);
    expect(r.done).toBe(false);
    (g.handle as GrantEntry).release(u);
    await flush();
    expect(r.done).toBe(true);
    await t.revoke(reg.handle);
    await t.revokeGrant(g.handle);
    expect(t.size).toBe(0);
    expect(() => t.grant(ranges([reg.handle], [[0, 0, 8]]))).toThrow(InvalidInputError);
  });

  it('property (races): with acquisitions, releases and revocations interleaved, a revoke resolves exactly when its entry has no user left', async () => {
    const step = fc.oneof(
      fc.record({ kind: fc.constant('acquire' as const), entry: fc.integer({ min: 0, max: 2 }), user: fc.integer({ min: 0, max: 2 }) }),
      fc.record({ kind: fc.constant('release' as const), entry: fc.integer({ min: 0, max: 2 }), user: fc.integer({ min: 0, max: 2 }) }),
      fc.record({ kind: fc.constant('revoke' as const), entry: fc.integer({ min: 0, max: 2 }), user: fc.constant(0) }),
    );
    await fc.assert(
      fc.asyncProperty(fc.array(step, { minLength: 1, maxLength: 40 }), async (steps) => {
        const t = table();
        const reg = t.register({ kind: 'host', buffer: new Uint8Array(1024) });
        const handles = [reg.handle, t.grant(ranges([reg.handle], [[0, 0, 10]])).handle, t.grant(ranges([reg.handle], [[0, 100, 10]])).handle];
        const entries = handles as GrantEntry[];
        const users = [user(), user(), user()];
        const held = entries.map(() => users.map(() => 0)); // model: acquisitions per entry per user
        const revokes: { entry: number; flag: { done: boolean } }[] = [];
        for (const s of steps) {
          const e = entries[s.entry] as GrantEntry;
          const row = held[s.entry] as number[];
          if (s.kind === 'acquire' && !e.revoked) {
            e.acquire(users[s.user] as GrantUser);
            row[s.user] = (row[s.user] as number) + 1;
          } else if (s.kind === 'release') {
            e.release(users[s.user] as GrantUser);
            if ((row[s.user] as number) > 0) row[s.user] = (row[s.user] as number) - 1;
          } else if (s.kind === 'revoke') {
            const p = s.entry === 0 ? t.revoke(reg.handle) : t.revokeGrant(handles[s.entry] as object);
            revokes.push({ entry: s.entry, flag: settledFlag(p) });
          }
          await flush();
          const busy = (k: number): boolean => (held[k] as number[]).some((x) => x > 0);
          for (const r of revokes) {
            // Revoking the registration also waits for its grants (it revokes them).
            const waitsFor = r.entry === 0 ? [0, 1, 2] : [r.entry];
            expect(r.flag.done).toBe(!waitsFor.some(busy));
          }
          for (const [k, e2] of entries.entries()) expect(e2.users).toBe((held[k] as number[]).reduce((a, b) => a + b, 0));
        }
        expect(users.every((u) => u.aborted === 0)).toBe(true);
      }),
      { numRuns: 200 },
    );
  });

  it('LocalRegistration and RangeGrant are entries of their table', () => {
    const t = table();
    const reg = t.register({ kind: 'host', buffer: new Uint8Array(8) });
    expect(reg.handle).toBeInstanceOf(LocalRegistration);
    expect(t.isLive(reg.handle)).toBe(true);
    expect(table().isLive(reg.handle)).toBe(false);
  });
});
