import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { bytesOf, descriptorsOf, firstAdjacent, grantLayers, regionNeeded, rng, scatter, slotsPerLayer } from '../src/kv-shape.js';
import { kvSettings } from '../src/scenarios/kv.js';
import { runSettings } from '../src/scenarios/run.js';
import type { ScenarioContext } from '../src/types.js';

const shape = fc.record({
  blockBytes: fc.constantFrom(1, 7, 512, 4096, 16384),
  layers: fc.integer({ min: 1, max: 40 }),
  blocks: fc.integer({ min: 1, max: 64 }),
});

describe('kv scatter', () => {
  it('reads the same distinct block ids from every layer, layer-major, inside the region, none adjacent to the one before', () => {
    fc.assert(
      fc.property(shape, fc.integer({ min: 0, max: 3 }), fc.integer(), (s, spare, seed) => {
        const region = regionNeeded(s) + spare * s.layers * s.blockBytes;
        const offsets = scatter(s, region, rng(seed));
        expect(offsets.length).toBe(descriptorsOf(s));
        expect(firstAdjacent(offsets, s.blockBytes)).toBe(-1);
        const slots = slotsPerLayer(s, region);
        const ids = new Set<number>();
        const wrong: string[] = [];
        for (let l = 0; l < s.layers; l++) {
          for (let k = 0; k < s.blocks; k++) {
            const off = offsets[l * s.blocks + k] as number;
            const slot = off / s.blockBytes - l * slots; // the block id within layer l
            if (off % s.blockBytes !== 0 || off + s.blockBytes > region) wrong.push(`descriptor ${l}/${k} at ${off} is outside the region or unaligned`);
            if (!(slot >= 0 && slot < slots)) wrong.push(`descriptor ${l}/${k} is not in layer ${l}`);
            if (l === 0) ids.add(slot);
            else if (slot !== offsets[k]! / s.blockBytes) wrong.push(`layer ${l} block ${k} is not the same id as in layer 0`);
          }
        }
        expect(wrong).toEqual([]);
        expect(ids.size).toBe(s.blocks);
      }),
    );
  });

  it('never runs from the last slot of one layer into slot 0 of the next (a tight region, many seeds)', () => {
    const s = { blockBytes: 4096, layers: 3, blocks: 2 };
    const region = regionNeeded(s); // 6 slots per layer
    for (let seed = 0; seed < 3000; seed++) expect(firstAdjacent(scatter(s, region, rng(seed)), s.blockBytes)).toBe(-1);
  });

  it('is deterministic per seed, so holder-side and requester-side checks agree', () => {
    const s = { blockBytes: 4096, layers: 4, blocks: 8 };
    expect([...scatter(s, regionNeeded(s), rng(9))]).toEqual([...scatter(s, regionNeeded(s), rng(9))]);
  });

  it('refuses a region too small for the shape', () => {
    const s = { blockBytes: 4096, layers: 2, blocks: 8 };
    expect(() => scatter(s, regionNeeded(s) - 1, rng(1))).toThrow(/too small/);
  });
});

function ctx(quick: boolean, extra: Partial<ScenarioContext> = {}): ScenarioContext {
  return { signal: new AbortController().signal, quick, progress: () => undefined, log: () => undefined, ...extra };
}

describe('kv settings', () => {
  it('defaults: 32 layers × 32 blocks × 16 KiB, sizes 4–256 KiB, batches 64–4096 descriptors, a plain 1 × 4 MiB read', () => {
    const s = kvSettings(ctx(false));
    const find = (b: number, d: number) => s.configs.find((c) => c.blockBytes === b && descriptorsOf(c) === d);
    expect(find(16384, 1024)).toMatchObject({ layers: 32, blocks: 32, sweep: 'size+batch' });
    for (const b of [4096, 65536]) expect(find(b, 1024)?.sweep).toBe('size');
    expect(s.configs.find((c) => c.blockBytes === 262144)?.sweep).toBe('size');
    for (const d of [64, 256, 4096]) expect(find(16384, d)?.sweep).toBe('batch');
    expect(find(4 * 1024 * 1024, 1)?.sweep).toBe('plain');
    for (const c of s.configs) {
      expect(regionNeeded(c)).toBeLessThanOrEqual(s.regionBytes);
      expect(bytesOf(c)).toBeLessThanOrEqual(s.maxRequestBytes);
    }
    expect(s.transport).toBe('auto');
    // Every shape's mean rests on at least 16 timed calls per method and round (a 64 MiB fetch
    // got 3 to 8 from the 40 ms floor alone), and the floor holds with a small --total too.
    expect(s.minFetches).toBe(16);
    expect(kvSettings(ctx(false, { totalBytes: 1024 * 1024 })).minFetches).toBe(16);
    // The lease path is brought to steady state before the rounds, unless warm-up is off.
    expect(s.leaseWarmupCycles).toBe(3000);
    expect(kvSettings(ctx(false), { warmupMs: 0 }).leaseWarmupCycles).toBe(0);
    expect(kvSettings(ctx(false), { leaseWarmup: 12 }).leaseWarmupCycles).toBe(12);
  });

  it('--quick is tiny', () => {
    const s = kvSettings(ctx(true));
    expect(s.regionBytes).toBeLessThanOrEqual(16 * 1024 * 1024);
    expect(s.rounds).toBe(1);
    expect(s.minFetches).toBe(2);
    expect(s.leaseWarmupCycles).toBe(0);
    expect(kvSettings(ctx(true), { warmupMs: 5 }).leaseWarmupCycles).toBe(3000);
    for (const c of s.configs) expect(bytesOf(c)).toBeLessThanOrEqual(4 * 1024 * 1024);
  });
});

describe('run settings', () => {
  it('each round\'s requester warms the lease path with 3,000 one-block fetches, none with --quick', () => {
    expect(runSettings(ctx(false)).warmupFetches).toBe(3000);
    expect(runSettings(ctx(true)).warmupFetches).toBe(0);
  });
});

describe('unsorted grant-cost leases', () => {
  it('split N ranges into layers × blocks exactly (at least 5 blocks a layer unless 1 layer), as the holder asks scatter for', () => {
    expect([10, 1000, 10_000].map(grantLayers)).toEqual([2, 40, 40]);
    fc.assert(
      fc.property(fc.integer({ min: 1, max: 100_000 }), (n) => {
        const l = grantLayers(n);
        expect(Number.isInteger(n / l)).toBe(true);
        if (l > 1) expect(n / l).toBeGreaterThanOrEqual(5);
      }),
    );
  });

  it('give the holder offsets out of order within a layer, in the region the default and --quick runs use', () => {
    for (const [n, region] of [
      [1000, 16 * 1024 * 1024],
      [10_000, 256 * 1024 * 1024],
    ] as const) {
      const l = grantLayers(n);
      const offsets = scatter({ blockBytes: 4096, layers: l, blocks: n / l }, region, rng(0x9e3779b9 ^ n));
      expect(offsets.length).toBe(n);
      let descents = 0;
      for (let i = 1; i < n; i++) if ((offsets[i] as number) < (offsets[i - 1] as number)) descents++;
      expect(descents).toBeGreaterThan(0);
      expect(new Set(offsets).size).toBe(n);
    }
  });
});
