/**
 * The shape of the `kv` scenario's fetches, as a paged KV cache lays them out: the holder's
 * region holds `layers` layers, each of `slots` block slots of `blockBytes`; block `b` of layer
 * `l` lives at `(l * slots + b) * blockBytes`. One fetch reads the same `blocks` block ids from
 * every layer (a sequence's blocks), layer-major, into a contiguous local buffer: descriptor
 * `i = l * blocks + k` lands at `i * blockBytes`.
 *
 * Block ids are random and chosen so that no two consecutive descriptors are adjacent in the
 * region (no `id[k+1] = id[k] + 1`, and no run from the last slot of one layer into slot 0 of
 * the next): the engine merges adjacent requests, and this scenario measures the unmerged case.
 */
import { BenchError } from './types.js';

export interface KvShape {
  readonly blockBytes: number;
  readonly layers: number;
  /** Blocks read from each layer. */
  readonly blocks: number;
}

/** Descriptors per fetch. */
export function descriptorsOf(s: KvShape): number {
  return s.layers * s.blocks;
}

/** Bytes per fetch. */
export function bytesOf(s: KvShape): number {
  return s.layers * s.blocks * s.blockBytes;
}

/** Block slots per layer a region of `regionBytes` gives this shape. */
export function slotsPerLayer(s: KvShape, regionBytes: number): number {
  return Math.floor(regionBytes / (s.layers * s.blockBytes));
}

/** Smallest region in which this shape can be scattered (two slots per block, plus two). */
export function regionNeeded(s: KvShape): number {
  return s.layers * s.blockBytes * (2 * s.blocks + 2);
}

/** A small seeded PRNG (mulberry32): the same seed gives the same scatter in every process. */
export function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/**
 * Remote offsets of one fetch, in descriptor order (layer-major), as a Float64Array: distinct
 * random block ids, none adjacent to the one before it in the region. Throws BenchError when
 * the region is too small for the shape.
 */
export function scatter(s: KvShape, regionBytes: number, random: () => number): Float64Array {
  const slots = slotsPerLayer(s, regionBytes);
  if (slots < 2 * s.blocks + 2) {
    throw new BenchError(`a region of ${regionBytes} bytes is too small to scatter ${s.layers} layers × ${s.blocks} blocks of ${s.blockBytes} bytes`);
  }
  const ids: number[] = [];
  const used = new Set<number>();
  for (let k = 0; k < s.blocks; k++) {
    for (let tries = 0; ; tries++) {
      if (tries > 10_000) throw new BenchError(`could not scatter ${s.blocks} blocks over ${slots} slots`);
      const id = Math.floor(random() * slots);
      if (used.has(id)) continue;
      if (k > 0 && id === (ids[k - 1] as number) + 1) continue;
      // The last block of layer l must not run into the first block of layer l+1.
      if (k === s.blocks - 1 && s.layers > 1 && id === slots - 1 && ids[0] === 0) continue;
      ids.push(id);
      used.add(id);
      break;
    }
  }
  const out = new Float64Array(s.layers * s.blocks);
  for (let l = 0; l < s.layers; l++) {
    for (let k = 0; k < s.blocks; k++) out[l * s.blocks + k] = (l * slots + (ids[k] as number)) * s.blockBytes;
  }
  return out;
}

/**
 * Layers of the unsorted grant-cost lease of `n` ranges (layers × n/layers blocks): 40 (a
 * Llama-2-13B's layer count) where it divides n into at least 5 blocks a layer, else 32, 10, 5,
 * 2 or 1, the first that does (1 when none does).
 */
export function grantLayers(n: number): number {
  for (const l of [40, 32, 10, 5, 2]) if (n % l === 0 && n / l >= 5) return l;
  return 1;
}

/** Index of the first descriptor that continues the one before it in the region (mergeable), or -1. */
export function firstAdjacent(offsets: Float64Array, blockBytes: number): number {
  for (let i = 1; i < offsets.length; i++) if ((offsets[i - 1] as number) + blockBytes === offsets[i]) return i;
  return -1;
}

/** What the kv requester measures: the engine on each transport, prepared or not, and the two baselines. */
export type KvMethod =
  | 'same-host-prepared'
  | 'same-host-read'
  | 'same-host-leased'
  | 'same-host-leased-unary'
  | 'same-host-leased-stream'
  | 'same-host-leased-ids'
  | 'same-host-leased-awaited'
  | 'same-host-leased-alternating'
  | 'same-host-leased-pipelined'
  | 'tcp-prepared'
  | 'tcp-read'
  | 'tcp-leased'
  | 'tcp-leased-unary'
  | 'raw'
  | 'memcpy'
  | 'memcpy-shm';

/**
 * The holder's numbered block space of `blockBytes` blocks (block n: bytes [n × blockBytes, +
 * blockBytes) of its region): the leased fetches name their blocks by number in it.
 */
export function kvSpace(blockBytes: number): string {
  return `kv-${blockBytes}`;
}

/**
 * The lock-service block id of the descriptor at `offset` of `blockBytes` in the holder's region:
 * the holder's block map (`engineGrants`) parses it back, so any scatter can be leased.
 */
export function kvBlockId(offset: number, blockBytes: number): string {
  return `block:kv:${offset}_${blockBytes}`;
}

/** The inverse of {@link kvBlockId}, or undefined for an id that is not one. */
export function parseKvBlockId(id: string): { offset: number; length: number } | undefined {
  const m = /^block:kv:(\d{1,15})_(\d{1,15})$/.exec(id);
  if (!m) return undefined;
  return { offset: Number(m[1]), length: Number(m[2]) };
}

export interface KvMethodResult {
  readonly method: KvMethod;
  /** Sum of the timed fetch calls. */
  readonly ms: number;
  readonly fetches: number;
  readonly bytes: number;
  readonly descriptors: number;
  readonly latencies: number[];
  readonly failures: number;
  /** The first, untimed call of the method in this measurement (before its warm-up). */
  readonly firstMs: number;
  /** Untimed calls before the timed ones (the first included). */
  readonly warmupCalls: number;
  readonly transport?: string;
  readonly prepareMs?: number;
  /** Ranges of the prepared transfer after the engine merged adjacent requests. */
  readonly ranges?: number;
  /**
   * Leased methods, medians per timed fetch (ms): client.fetch (acquire + grant + read: the bytes
   * are usable); what follows it in the timed call (the disposal, which queues the release, or for
   * `leased-awaited` the release with the holder's answer); and when that answer came, counted
   * from client.fetch's return.
   */
  readonly leaseSplit?: { readonly fetchMs: number; readonly releaseMs: number; readonly confirmMs: number };
  /**
   * `same-host-leased-alternating`: the sum of the engine.read calls of the same blocks made
   * right before each timed fetch (timed on their own, outside `ms`): its per-fetch baseline.
   */
  readonly pairedReadMs?: number;
  /** Bytes those reads moved (as their reports say): the timed fetches' bytes, one read per fetch. */
  readonly pairedReadBytes?: number;
}

/**
 * The shape `ucx_perftest -t ucp_get` measures (see external.ts): one block of the message size
 * re-read from one remote offset into the same local buffer (offset 0 of the requester's
 * registered destination), one post at a time (window 1), `iterations` timed posts after
 * `warmup` untimed ones. `same-host-reread` / `tcp-reread`: one prepared transfer of that one
 * request, `run()` per post; `memcpy-shm-reread`: Buffer.copy of the same block out of a shared
 * segment (the same-host transport's source memory kind), for context.
 */
export type KvRereadMethod = 'same-host-reread' | 'tcp-reread' | 'memcpy-shm-reread';

export interface KvRereadResult {
  readonly method: KvRereadMethod;
  /** Wall time of the timed loop (every post, one after the other). */
  readonly ms: number;
  readonly iterations: number;
  readonly bytes: number;
  /** Posts whose first or last byte was not rewritten, plus 1 if the final full compare failed. */
  readonly failures: number;
  readonly transport?: string;
}
