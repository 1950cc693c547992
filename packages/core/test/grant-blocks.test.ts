/**
 * Block grants (engine.grant({ registration, blockBytes, blocks })): blocks of one size in one
 * registration, named by index. The engine's check of the indices against a model (bounds,
 * repeats, which index an error names), bad input as typed errors, the private copy the
 * transports keep, the ranges built for a transport that does not handle blocks, and a TCP
 * holder answering raw frames: range k is block blocks[k], and not one byte outside the granted
 * blocks is readable or writable.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { InvalidInputError, TransferEngine, decodeDescriptor, engineCheckedBlocks, silentLogger, type GrantBlocks, type GrantRanges } from '../src/index.js';
import { STAMP_MAX_BLOCKS, checkGrantBlocks, gridBitmapWords } from '../src/grant-check.js';
import * as tcpFrames from '../src/tcp/frames.js';
import type { TcpTransport } from '../src/tcp/transport.js';
import { pattern } from '../src/testing/pattern.js';
import { hostile, holderNode } from './helpers/raw-peer.js';
import { MemTransport, SpyTransport } from './helpers/mem-transport.js';

const { FrameType, decodeError, encodeReadvReq, encodeWritevReq } = tcpFrames;

/** The model: the lowest index out of bounds, else the lowest index whose block came before, else none. */
function modelError(blocks: readonly number[], n: number): { range: number; kind: 'bounds' | 'repeat' } | undefined {
  const out = blocks.findIndex((b) => b >= n);
  if (out >= 0) return { range: out, kind: 'bounds' };
  const seen = new Set<number>();
  for (const [i, b] of blocks.entries()) {
    if (seen.has(b)) return { range: i, kind: 'repeat' };
    seen.add(b);
  }
  return undefined;
}

/** checkGrantBlocks on `list` agrees with the model: passes, or names the model's index and kind. */
function expectModel(list: readonly number[], nBlocks: number): void {
  const want = modelError(list, nBlocks);
  const blocks = Uint32Array.from(list);
  let got: unknown;
  try {
    checkGrantBlocks(blocks, blocks.length, nBlocks);
  } catch (e) {
    got = e;
  }
  if (want === undefined) {
    expect(got).toBeUndefined();
    return;
  }
  expect(got).toBeInstanceOf(InvalidInputError);
  expect((got as InvalidInputError).details).toMatchObject({ field: 'blocks', range: want.range });
  expect((got as Error).message).toMatch(want.kind === 'bounds' ? /is outside the registration/ : /repeats blocks\[\d+\]/);
}

describe('checkGrantBlocks', () => {
  it('property: refuses exactly the lists with an index out of bounds or a repeat, naming the lowest such index', () => {
    // Small registrations (the stamp table), huge ones (the sorted copy), and sorted lists (one pass).
    const n = fc.oneof(fc.integer({ min: 1, max: 80 }), fc.integer({ min: 32 * gridBitmapWords(64) + 1, max: 2 ** 32 - 1 }));
    fc.assert(
      fc.property(n, fc.array(fc.nat(100), { minLength: 1, maxLength: 64 }), fc.boolean(), fc.boolean(), (nBlocks, raw, sorted, huge) => {
        const list = huge ? raw.map((b) => (b * 0x3fffffff) % 2 ** 32) : raw;
        if (sorted) list.sort((x, y) => x - y);
        expectModel(list, nBlocks);
      }),
      { numRuns: 2000 },
    );
  });

  it('10,000 indices over registrations of every size class (stamp table, bitmap, sorted copy): clean, one repeat or one index out of bounds anywhere', () => {
    // nBlocks: within the stamp table; above it with a bitmap small against the count; huge (sorted copy).
    const sizes = [12_000, STAMP_MAX_BLOCKS + 5, 2 ** 31];
    expect(Math.ceil((STAMP_MAX_BLOCKS + 5) / 32)).toBeLessThanOrEqual(gridBitmapWords(10_000));
    expect(Math.ceil(2 ** 31 / 32)).toBeGreaterThan(gridBitmapWords(10_000));
    fc.assert(
      fc.property(fc.constantFrom(...sizes), fc.nat(9999), fc.nat(9999), fc.constantFrom('clean', 'repeat', 'bounds'), fc.nat(), (nBlocks, at, from, fault, seed) => {
        // Layer-major like a lease: 40 layers of 250 distinct blocks, the same ids in each layer.
        const stride = Math.floor(Math.min(nBlocks, 12_000) / 40);
        const list = Array.from({ length: 10_000 }, (_, k) => Math.floor(k / 250) * stride + ((k % 250) * 7 + seed) % Math.min(250, stride));
        if (fault === 'repeat' && at !== from) list[Math.max(at, from)] = list[Math.min(at, from)] as number;
        if (fault === 'bounds') list[at] = nBlocks + (seed % 3);
        expectModel(list, nBlocks);
      }),
      { numRuns: 150 },
    );
  });

  it('checks only the first `count` indices', () => {
    expect(() => checkGrantBlocks(Uint32Array.of(1, 2, 1, 99), 2, 3)).not.toThrow();
    expect(() => checkGrantBlocks(Uint32Array.of(1, 2, 1, 99), 3, 3)).toThrow(/blocks\[2\] repeats blocks\[0\]/);
  });
});

async function engineWith(t: MemTransport | TcpTransport, nodeId = 'h'): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId, transports: [t], logger: silentLogger, metrics: false });
  await e.start();
  return e;
}

describe('engine.grant over blocks', () => {
  it('bad input is a typed error naming its field (and the index), and nothing is granted', async () => {
    const t = new SpyTransport();
    const e = await engineWith(t);
    try {
      const reg = await e.register({ kind: 'host', buffer: new Uint8Array(10 * 1024 + 100) });
      const other = await e.register({ kind: 'host', buffer: new Uint8Array(64) });
      await other.revoke();
      const cases: [string, unknown, string, number | undefined][] = [
        ['blockBytes 0', { registration: reg, blockBytes: 0, blocks: Uint32Array.of(0) }, 'blockBytes', undefined],
        ['blockBytes 1.5', { registration: reg, blockBytes: 1.5, blocks: Uint32Array.of(0) }, 'blockBytes', undefined],
        ['blockBytes NaN', { registration: reg, blockBytes: Number.NaN, blocks: Uint32Array.of(0) }, 'blockBytes', undefined],
        ['a negative base', { registration: reg, blockBytes: 1024, base: -1, blocks: Uint32Array.of(0) }, 'base', undefined],
        ['a fractional base', { registration: reg, blockBytes: 1024, base: 0.5, blocks: Uint32Array.of(0) }, 'base', undefined],
        ['a base at the end of the registration', { registration: reg, blockBytes: 1024, base: 10 * 1024 + 100, blocks: Uint32Array.of(0) }, 'base', undefined],
        ['a base that leaves less than a block', { registration: reg, blockBytes: 1024, base: 10 * 1024 - 500, blocks: Uint32Array.of(0) }, 'blockBytes', undefined],
        ['a block larger than the registration', { registration: reg, blockBytes: 20 * 1024, blocks: Uint32Array.of(0) }, 'blockBytes', undefined],
        ['blocks as a plain array', { registration: reg, blockBytes: 1024, blocks: [0, 1] }, 'blocks', undefined],
        ['blocks as an Int32Array', { registration: reg, blockBytes: 1024, blocks: Int32Array.of(0, 1) }, 'blocks', undefined],
        ['no blocks', { registration: reg, blockBytes: 1024, blocks: new Uint32Array(0) }, 'blocks', undefined],
        ['not a registration', { registration: {}, blockBytes: 1024, blocks: Uint32Array.of(0) }, 'registration', undefined],
        ['a revoked registration', { registration: other, blockBytes: 16, blocks: Uint32Array.of(0) }, 'registration', undefined],
        // 10 blocks of 1 KiB fit (100 bytes are left over); block 10 would end past the registration.
        ['block 10 of 10 in the middle of 10,000 good ones', { registration: reg, blockBytes: 1024, blocks: Uint32Array.from({ length: 10_000 }, (_, i) => (i === 5000 ? 10 : i % 10)) }, 'blocks', 5000],
        ['a block listed twice', { registration: reg, blockBytes: 1024, blocks: Uint32Array.of(3, 1, 4, 1) }, 'blocks', 3],
        ['a block listed twice, in order', { registration: reg, blockBytes: 1024, blocks: Uint32Array.of(1, 2, 2, 3) }, 'blocks', 2],
      ];
      for (const [what, spec, field, range] of cases) {
        const err = await e.grant(spec as Parameters<TransferEngine['grant']>[0]).catch((x: unknown) => x);
        expect(err, what).toBeInstanceOf(InvalidInputError);
        expect((err as InvalidInputError).details['field'], what).toBe(field);
        if (range !== undefined) expect((err as InvalidInputError).details['range'], what).toBe(range);
      }
      const big = new TransferEngine({ nodeId: 'h2', transports: [new MemTransport()], logger: silentLogger, metrics: false, maxGrantRanges: 4 });
      await big.start();
      const r2 = await big.register({ kind: 'host', buffer: new Uint8Array(1024) });
      await expect(big.grant({ registration: r2, blockBytes: 8, blocks: Uint32Array.of(0, 1, 2, 3, 4) })).rejects.toThrow(/1 to 4 ranges, got 5/);
      await big.close();
      expect(e.liveGrants).toBe(0);
      expect(t.grants).toBe(0);
    } finally {
      await e.close();
    }
  });

  it('the transport gets a private copy of the indices; ranges are built from them only when read; the descriptor carries one run', async () => {
    const t = new SpyTransport();
    const e = await engineWith(t);
    try {
      const reg = await e.register({ kind: 'host', buffer: new Uint8Array(64 * 1024) });
      const blocks = Uint32Array.of(7, 0, 3);
      const g = await e.grant({ registration: reg, blockBytes: 4096, base: 100, blocks });
      blocks.set([1, 1, 1]); // the caller reuses its array at once
      const spec = t.last as GrantRanges;
      expect(spec.blocks?.indices).not.toBe(blocks);
      expect([...(spec.blocks?.indices ?? [])]).toEqual([7, 0, 3]);
      expect(spec.blocks).toMatchObject({ base: 100, blockBytes: 4096 });
      // The engine's checked spec is recognised (a transport may skip its own bound); a copy of it, or anyone else's, is not.
      expect(engineCheckedBlocks(spec)).toBe(true);
      expect(Object.isFrozen(spec.blocks)).toBe(true);
      expect(engineCheckedBlocks({ ...spec, blocks: { ...(spec.blocks as GrantBlocks) } })).toBe(false);
      expect(engineCheckedBlocks({ handles: [], count: 1, bytes: 1, ranges: new Float64Array(3) })).toBe(false);
      expect(engineCheckedBlocks({ handles: [], count: 1, bytes: 1, ranges: new Float64Array(3), blocks: null as unknown as GrantBlocks })).toBe(false);
      expect(spec.bytes).toBe(3 * 4096);
      expect([...spec.ranges]).toEqual([0, 100 + 7 * 4096, 4096, 0, 100, 4096, 0, 100 + 3 * 4096, 4096]);
      expect(spec.ranges).toBe(spec.ranges); // built once
      expect(g.rangeCount).toBe(3);
      expect(g.byteLength).toBe(3 * 4096);
      expect([...(decodeDescriptor(g.descriptor).rangeLengths ?? [])]).toEqual([4096, 4096, 4096]);
      await g.revoke();
      // transfer: the engine takes the ArrayBuffer (the caller's view is detached), no copy.
      const owned = Uint32Array.of(2, 9);
      const g2 = await e.grant({ registration: reg, blockBytes: 4096, blocks: owned, transfer: true });
      expect(owned.length).toBe(0);
      expect([...((t.last as GrantRanges).blocks?.indices ?? [])]).toEqual([2, 9]);
      await g2.revoke();
    } finally {
      await e.close();
    }
  });

  it('reads through a block grant over a transport without block support (the built ranges) land block blocks[k]', async () => {
    const a = await engineWith(new MemTransport(), 'a');
    const b = await engineWith(new MemTransport(), 'b');
    try {
      const region = pattern(32 * 256 + 3, 5);
      const reg = await b.register({ kind: 'host', buffer: region });
      const dst = new Uint8Array(4 * 256);
      const local = await a.register({ kind: 'host', buffer: dst });
      const blocks = [31, 4, 17, 0];
      const g = await b.grant({ registration: reg, blockBytes: 256, base: 3, blocks: Uint32Array.from(blocks) });
      await a.read(b.endpoint(), blocks.map((_, k) => ({ local, localOffset: k * 256, remote: g.descriptor, range: k, length: 256 })));
      for (const [k, blk] of blocks.entries()) expect(Buffer.compare(Buffer.from(dst.subarray(k * 256, (k + 1) * 256)), Buffer.from(region.subarray(3 + blk * 256, 3 + (blk + 1) * 256)))).toBe(0);
      await g.revoke();
    } finally {
      await Promise.all([a.close(), b.close()]);
    }
  });
});

describe('tcp block grants answer raw frames', () => {
  it('property: range k reads exactly block blocks[k]; an index or offset outside the grant is refused whole; a WRITEV lands in its block only', async () => {
    const holder = await holderNode('blocks');
    try {
      const BLOCK = 512;
      const N = 40;
      const BASE = 64;
      const region = new Uint8Array(BASE + N * BLOCK + 32);
      const reg = await holder.t.register({ kind: 'host', buffer: region });
      const req = fc.record({ k: fc.nat(N + 2), offset: fc.oneof(fc.nat(BLOCK + 4), fc.constant(2 ** 32)), length: fc.integer({ min: 1, max: BLOCK + 8 }) });
      await fc.assert(
        fc.asyncProperty(fc.uniqueArray(fc.nat(N - 1), { minLength: 1, maxLength: N }), fc.array(req, { minLength: 1, maxLength: 6 }), fc.nat(255), async (blocks, reqs, seed) => {
          region.set(pattern(region.length, seed));
          const before = Buffer.from(region);
          const indices = Uint32Array.from(blocks);
          const g = holder.t.grant({ handles: [reg.handle], count: blocks.length, bytes: blocks.length * BLOCK, blocks: { base: BASE, blockBytes: BLOCK, indices }, ranges: new Float64Array(0) });
          try {
            const inside = reqs.every((r) => r.k < blocks.length && r.offset + r.length <= BLOCK);
            const list = reqs.map((r) => ({ token: 0, range: r.k, offset: r.offset, length: r.length }));
            const total = reqs.reduce((s, r) => s + r.length, 0);
            const data = Buffer.from(pattern(total, seed + 1));
            const res = await hostile({ id: holder.id, port: holder.port }, [encodeReadvReq(1, [g.payload], list), encodeWritevReq(2, [g.payload], list, data)], { ms: 5000, until: (f) => f.length >= 2 });
            expect(res.closedByPeer).toBe(false);
            const [read, write] = res.frames;
            if (!inside) {
              const bad = reqs.findIndex((r) => !(r.k < blocks.length && r.offset + r.length <= BLOCK));
              for (const f of [read, write]) {
                expect(f?.type).toBe(FrameType.Error);
                expect(decodeError(f!.body)).toMatchObject({ code: (reqs[bad]?.k ?? 0) < blocks.length ? 'OUT_OF_BOUNDS' : 'NO_SUCH_RANGE', range: bad });
              }
              expect(Buffer.compare(Buffer.from(region), before)).toBe(0);
              return;
            }
            // The read was served before the write landed: it saw the region as it was.
            expect(read?.type).toBe(FrameType.ReadvData);
            const want = Buffer.concat(reqs.map((r) => before.subarray(BASE + (blocks[r.k] as number) * BLOCK + r.offset, BASE + (blocks[r.k] as number) * BLOCK + r.offset + r.length)));
            expect(Buffer.compare(read!.body, want)).toBe(0);
            expect(write?.type).toBe(FrameType.WritevAck);
            const after = Buffer.from(before);
            let p = 0;
            for (const r of reqs) {
              after.set(data.subarray(p, p + r.length), BASE + (blocks[r.k] as number) * BLOCK + r.offset);
              p += r.length;
            }
            expect(Buffer.compare(Buffer.from(region), after)).toBe(0);
          } finally {
            await holder.t.revokeGrant(g.handle);
          }
        }),
        { numRuns: 60 },
      );
      // The edges: the last byte of a block reads; one byte more, or the first byte after it, is refused.
      const edge = holder.t.grant({ handles: [reg.handle], count: 2, bytes: 2 * BLOCK, blocks: { base: BASE, blockBytes: BLOCK, indices: Uint32Array.of(5, 4) }, ranges: new Float64Array(0) });
      region.set(pattern(region.length, 99));
      const edges = await hostile(
        { id: holder.id, port: holder.port },
        [
          encodeReadvReq(1, [edge.payload], [{ token: 0, range: 1, offset: BLOCK - 1, length: 1 }]),
          encodeReadvReq(2, [edge.payload], [{ token: 0, range: 1, offset: 0, length: BLOCK + 1 }]),
          encodeReadvReq(3, [edge.payload], [{ token: 0, range: 1, offset: BLOCK, length: 1 }]),
          encodeReadvReq(4, [edge.payload], [{ token: 0, range: 2, offset: 0, length: 1 }]),
        ],
        { ms: 5000, until: (f) => f.length >= 4 },
      );
      expect(edges.frames[0]?.body[0]).toBe(region[BASE + 5 * BLOCK - 1]);
      expect(edges.frames.slice(1).map((f) => decodeError(f.body).code)).toEqual(['OUT_OF_BOUNDS', 'OUT_OF_BOUNDS', 'NO_SUCH_RANGE']);
      await holder.t.revokeGrant(edge.handle);
      // After revoke: REVOKED, nothing served.
      const g = holder.t.grant({ handles: [reg.handle], count: 1, bytes: BLOCK, blocks: { base: 0, blockBytes: BLOCK, indices: Uint32Array.of(0) }, ranges: new Float64Array(0) });
      await holder.t.revokeGrant(g.handle);
      const res = await hostile({ id: holder.id, port: holder.port }, [encodeReadvReq(1, [g.payload], [{ token: 0, range: 0, offset: 0, length: 1 }])], { ms: 5000, until: (f) => f.length >= 1 });
      expect(decodeError(res.frames[0]!.body).code).toBe('REVOKED');
      // A block grant names one registration, with indices for every range.
      expect(() => holder.t.grant({ handles: [reg.handle, reg.handle], count: 1, bytes: BLOCK, blocks: { base: 0, blockBytes: BLOCK, indices: Uint32Array.of(0) }, ranges: new Float64Array(0) })).toThrow(InvalidInputError);
      expect(() => holder.t.grant({ handles: [reg.handle], count: 2, bytes: BLOCK, blocks: { base: 0, blockBytes: BLOCK, indices: Uint32Array.of(0) }, ranges: new Float64Array(0) })).toThrow(InvalidInputError);
      expect(() => holder.t.grant({ handles: [reg.handle], count: 1, bytes: 0, blocks: { base: 0, blockBytes: 0, indices: Uint32Array.of(0) }, ranges: new Float64Array(0) })).toThrow(InvalidInputError);
      expect(() => holder.t.grant({ handles: [reg.handle], count: 1, bytes: 1, blocks: null as unknown as undefined, ranges: new Float64Array(0) })).toThrow(InvalidInputError);
    } finally {
      await holder.t.close();
    }
  });
});
