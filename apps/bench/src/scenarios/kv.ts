/**
 * `kv`: fetches shaped like KV-cache reads. A holder process keeps one large pattern-filled
 * region (a shared segment, registered once with an engine serving cuda-ipc and TCP); a
 * requester process reads `layers × blocks` descriptors of `blockBytes` scattered across it
 * (see kv-shape.ts) per fetch, one fetch at a time, through the engine on the same-host
 * transport and on TCP, prepared (`engine.prepare` once, `run()` per fetch) and unprepared
 * (`engine.read` per fetch), every byte verified (see workers/kv-requester.ts).
 *
 * Baselines in the same process pair, interleaved with the subjects in every round: memcpy of
 * the same scatter (Buffer.copy per descriptor, a JS loop, in the requester) and a raw
 * node:net stream of the same byte count from the holder. With `--compare`, ucx_perftest
 * `ucp_get` at the same message sizes over UCX `posix` and `tcp`.
 */
import { readFileSync } from 'node:fs';
import { spawnWorker } from '../proc.js';
import { UCX_NAMES, ucxPerftest, ucxWarmup, type UcxTransport } from '../external.js';
import { bytesOf, descriptorsOf, regionNeeded, rng, type KvMethod, type KvMethodResult, type KvRereadMethod, type KvRereadResult, type KvShape } from '../kv-shape.js';
import { LEASE_PATH_WARMUP, gbps, median, summarize } from '../stats.js';
import { sameHostUnavailable, type TransportChoice } from '../transports.js';
import { BenchError, type Measurement, type Ratio, type ScenarioContext, type ScenarioResult } from '../types.js';
import { formatBytes } from '../units.js';

const KiB = 1024;
const MiB = 1024 * 1024;
const SEED = 4242;
/** Timed fetches per method, shape and round, at least (not --quick): every shape's mean rests on this many calls. */
const MIN_TIMED_FETCHES = 16;

export interface KvConfig extends KvShape {
  /** Which sweep the shape belongs to: block size, batch size (both when shared), or the plain 1 × 4 MiB read. */
  readonly sweep: 'size' | 'batch' | 'size+batch' | 'plain';
}

export interface KvSettings {
  readonly configs: readonly KvConfig[];
  readonly regionBytes: number;
  readonly maxRequestBytes: number;
  readonly rounds: number;
  /** Bytes each method moves per configuration per round (timed fetches = this / fetch bytes, clamped). */
  readonly targetBytes: number;
  readonly minFetches: number;
  /** Leased fetches of one block per lane before the rounds (0 with --quick, --warmup-ms 0 or --lease-warmup 0). */
  readonly leaseWarmupCycles: number;
  /** Each measurement (one method, shape and round) runs timed fetches until they took at least this long (at most 1,000 fetches). */
  readonly minMs: number;
  /** Untimed fetches before each measurement's timed ones: one if 0, else at least 20 and more until they took this long (at most 1,000). */
  readonly warmupMs: number;
  readonly transport: TransportChoice;
  readonly compare: boolean;
}

export interface KvOptions {
  layers?: number;
  blocks?: number;
  /** Descriptors per fetch for the batch sweep (at 16 KiB). */
  batches?: readonly number[];
  rounds?: number;
  /** Warm-up per measurement in ms (default 300, 0 with --quick): 0 keeps one untimed fetch. */
  warmupMs?: number;
  /** Leased fetches of one block per lane before the rounds (default 3000, 0 with --quick or warmupMs 0). */
  leaseWarmup?: number;
  transport?: TransportChoice;
}

export function kvSettings(ctx: ScenarioContext, o: KvOptions = {}): KvSettings {
  const layers = o.layers ?? (ctx.quick ? 4 : 32);
  const blocks = o.blocks ?? (ctx.quick ? 8 : 32);
  const sizes = ctx.sizes ?? (ctx.quick ? [4 * KiB, 64 * KiB] : [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB]);
  const batches = o.batches ?? (ctx.quick ? [64] : [64, 256, 1024, 4096]);
  // The size sweep keeps a fetch at most this big by reading fewer blocks (then fewer layers) at large sizes.
  const cap = ctx.quick ? 2 * MiB : 64 * MiB;
  const configs: KvConfig[] = [];
  const add = (c: KvConfig): void => {
    const same = configs.findIndex((x) => x.blockBytes === c.blockBytes && x.layers === c.layers && x.blocks === c.blocks);
    if (same < 0) configs.push(c);
    else if (configs[same]?.sweep !== c.sweep) configs[same] = { ...(configs[same] as KvConfig), sweep: 'size+batch' };
  };
  for (const s of sizes) {
    const limit = Math.max(cap, s);
    const l = Math.min(layers, Math.max(1, Math.floor(limit / s)));
    add({ blockBytes: s, layers: l, blocks: Math.min(blocks, Math.max(1, Math.floor(limit / (l * s)))), sweep: 'size' });
  }
  for (const d of batches) {
    const l = Math.min(layers, d);
    add({ blockBytes: 16 * KiB, layers: l, blocks: Math.max(1, Math.round(d / l)), sweep: 'batch' });
  }
  add({ blockBytes: 4 * MiB, layers: 1, blocks: 1, sweep: 'plain' });
  const needed = Math.max(ctx.quick ? 16 * MiB : 256 * MiB, ...configs.map(regionNeeded));
  const regionBytes = Math.ceil(needed / MiB) * MiB;
  if (regionBytes > 4 * 1024 * MiB) throw new BenchError(`kv shapes need a ${formatBytes(regionBytes)} holder region (4 GiB at most): use smaller --sizes, --layers or --blocks`);
  const rounds = o.rounds ?? (ctx.quick ? 1 : 3);
  const warmupMs = o.warmupMs ?? (ctx.quick ? 0 : 300);
  return {
    configs,
    regionBytes,
    maxRequestBytes: Math.max(...configs.map(bytesOf)),
    rounds,
    targetBytes: ctx.totalBytes ?? (ctx.quick ? 1 * MiB : 32 * MiB),
    // A 64 MiB fetch takes 5 to 17 ms here: 40 ms alone gave 3 to 8 timed fetches per method and
    // round, and a goal row's per-round ratios moved by ±0.15 between default runs.
    minFetches: ctx.quick ? 2 : MIN_TIMED_FETCHES,
    minMs: ctx.quick ? 0 : 40,
    warmupMs,
    // One-block leased fetches per lane (half as many unary, a quarter by id) before the rounds;
    // the per-method warm-up makes only a few dozen.
    leaseWarmupCycles: o.leaseWarmup ?? (warmupMs > 0 ? LEASE_PATH_WARMUP : 0),
    transport: o.transport ?? 'auto',
    compare: ctx.compare === true,
  };
}

const NAMES: Record<KvMethod, (transport: string) => string> = {
  'same-host-prepared': (t) => `${t}: engine.prepare + run()`,
  'same-host-read': (t) => `${t}: engine.read`,
  'same-host-leased': (t) => `${t}: client.fetch (lease + range grant + read), disposed (release queued)`,
  'same-host-leased-unary': (t) => `${t}: client.fetch with unary gRPC calls (session: false)`,
  'same-host-leased-stream': (t) => `${t}: client.fetch with the Session messages on the gRPC stream (localLane: false)`,
  'same-host-leased-ids': (t) => `${t}: client.fetch of the same blocks by id (one string per block)`,
  'same-host-leased-awaited': (t) => `${t}: client.fetch, then await fetch.release() (the holder's answer inside the timed call)`,
  'same-host-leased-alternating': (t) => `${t}: client.fetch (disposed), each right after an engine.read of the same blocks (alternating)`,
  'same-host-leased-pipelined': (t) => `${t}: client.fetchLease of a lease acquired during the previous fetch's read (pipelined), disposed`,
  'tcp-prepared': (t) => `${t}: engine.prepare + run()`,
  'tcp-read': (t) => `${t}: engine.read`,
  'tcp-leased': (t) => `${t}: client.fetch (lease + range grant + read), disposed (release queued)`,
  'tcp-leased-unary': (t) => `${t}: client.fetch with unary gRPC calls (session: false)`,
  raw: () => 'raw node:net stream (same byte count)',
  memcpy: () => 'memcpy (Buffer.copy per descriptor, JS loop)',
  'memcpy-shm': () => 'memcpy out of a shared segment (Buffer.copy per descriptor, JS loop)',
};

const REREAD_NAMES: Record<KvRereadMethod, (transport: string) => string> = {
  'same-host-reread': (t) => `${t}: engine.prepare + run(), one block re-read, window 1 (ucx_perftest ucp_get shape)`,
  'tcp-reread': (t) => `${t}: engine.prepare + run(), one block re-read, window 1 (ucx_perftest ucp_get shape)`,
  'memcpy-shm-reread': () => 'memcpy of one block re-read out of a shared segment, window 1 (ucx_perftest ucp_get shape)',
};

/**
 * The kernel's transparent huge page modes: whether the memcpy baseline (process heap) or the
 * same-host transport (shared segments) may be mapped with 2 MiB pages. Whether they are is in
 * the requester's own note (its smaps_rollup), since "madvise" gives the heap huge pages only
 * where a program asks for them.
 */
function hugePageNote(): string {
  const mode = (file: string): string | undefined => {
    try {
      return /\[(\w+)\]/.exec(readFileSync(`/sys/kernel/mm/transparent_hugepage/${file}`, 'utf8'))?.[1];
    } catch {
      return undefined;
    }
  };
  const anon = mode('enabled');
  const shmem = mode('shmem_enabled');
  if (anon === undefined || shmem === undefined) return 'transparent huge page modes unknown here (no /sys/kernel/mm/transparent_hugepage)';
  const why =
    shmem === 'never' || shmem === 'deny'
      ? `: shared segments use 4 KiB pages here; the process heap ${anon === 'always' ? 'may use 2 MiB pages' : anon === 'madvise' ? 'uses 2 MiB pages only where madvised (Node does not), so 4 KiB pages too' : 'uses 4 KiB pages too'} (the requester's huge page note says what it held)`
      : '';
  return `transparent huge pages: process heap "${anon}", shared memory "${shmem}"${why}`;
}

/** Goals from the issue, by ratio kind and shape. */
function goal(kind: 'same-host' | 'tcp', c: KvConfig): number | undefined {
  if (c.sweep === 'plain') return kind === 'same-host' ? 0.9 : 0.8;
  if (c.sweep === 'batch') return undefined;
  if (c.blockBytes === 4 * KiB) return 0.5;
  if (c.blockBytes === 64 * KiB) return 0.8;
  return undefined;
}

function label(c: KvConfig): string {
  return `${formatBytes(c.blockBytes)} × ${descriptorsOf(c)}`;
}

export async function kvScenario(ctx: ScenarioContext, s: KvSettings = kvSettings(ctx)): Promise<ScenarioResult> {
  const unavailable = sameHostUnavailable();
  if (unavailable !== undefined && s.transport === 'cuda-ipc') {
    return { scenario: 'kv', skipped: `--transport cuda-ipc: the same-host transport is unavailable here (${unavailable})`, measurements: [], ratios: [], verificationFailures: 0, notes: [] };
  }
  // Every block size of the run is a numbered block space of the holder (the leased fetches name blocks by number).
  const blockSizes = [...new Set(s.configs.map((c) => c.blockBytes))];
  const holder = spawnWorker('kv-holder', [String(s.regionBytes), String(SEED), unavailable === undefined ? '1' : '0', blockSizes.join(',')]);
  let requester: ReturnType<typeof spawnWorker> | undefined;
  try {
    const ready = await holder.next<{ endpoint: string; descriptor: string; rawPort: number; lockAddress: string; transports: string[]; notes: string[] }>((m) => m['type'] === 'ready', ctx.signal);
    const cfg = { endpoint: ready.endpoint, descriptor: ready.descriptor, rawPort: ready.rawPort, lockAddress: ready.lockAddress, regionBytes: s.regionBytes, seed: SEED, maxRequestBytes: s.maxRequestBytes, transport: s.transport };
    requester = spawnWorker('kv-requester', [Buffer.from(JSON.stringify(cfg)).toString('base64')]);
    const req = requester;
    const hello = await req.next<{ type: string; lanes: ('same-host' | 'tcp')[]; transports: Record<string, string>; notes: string[]; message?: string }>((m) => m['type'] === 'ready' || m['type'] === 'error', ctx.signal);
    if (hello.type === 'error') throw new BenchError(`the kv requester failed: ${hello.message}`);
    const methods: KvMethod[] = [];
    for (const l of hello.lanes) methods.push(`${l}-prepared`, `${l}-read`, `${l}-leased`, `${l}-leased-unary`);
    // The lease by id beside the lease by number, on the lane with the goal (same host).
    if (hello.lanes.includes('same-host')) methods.push('same-host-leased-stream', 'same-host-leased-ids', 'same-host-leased-awaited', 'same-host-leased-alternating', 'same-host-leased-pipelined');
    methods.push('raw', 'memcpy');
    if (hello.lanes.includes('same-host')) methods.push('memcpy-shm');
    if (hello.lanes.length === 0) throw new BenchError(`no engine lane to measure (--transport ${s.transport}): ${hello.notes.join('; ')}`);
    const transportOf = (m: KvMethod): string => (m.startsWith('same-host') ? (hello.transports['same-host'] as string) : m.startsWith('tcp') ? (hello.transports['tcp'] as string) : '');

    let id = 0;
    // The lease path at steady state first (see LEASE_PATH_WARMUP): untimed, once per run.
    let warmNote: string | undefined;
    if (s.leaseWarmupCycles > 0) {
      const warmBytes = Math.min(...blockSizes);
      const rid = ++id;
      ctx.progress('kv (lease path warm-up)', 0, 1);
      req.send({ type: 'warm-leases', id: rid, cycles: s.leaseWarmupCycles, blockBytes: warmBytes });
      const w = await req.next<{ type: string; ms?: number; fetches?: number; rows?: string[]; message?: string }>((m) => m['id'] === rid, ctx.signal);
      if (w.type === 'error' || w.rows === undefined) throw new BenchError(`kv lease path warm-up failed: ${w.message ?? 'no result'}`);
      warmNote = `lease path warm-up before the rounds (untimed, once per run): ${w.fetches ?? 0} leased fetches of one ${formatBytes(warmBytes)} block in ${((w.ms ?? 0) / 1000).toFixed(1)} s, each released (${w.rows.join('; ')})`;
    }

    // rounds × configs, each measuring every method once, in an order that alternates per round.
    const rows = new Map<string, KvMethodResult[]>(); // `${config index}/${method}` -> one result per round
    const steps = s.rounds * s.configs.length;
    let done = 0;
    for (let r = 0; r < s.rounds; r++) {
      for (const [ci, c] of s.configs.entries()) {
        const fetches = Math.min(1000, Math.max(s.minFetches, Math.ceil(s.targetBytes / bytesOf(c))));
        const order = (r + ci) % 2 === 0 ? methods : [...methods].reverse();
        const rid = ++id;
        req.send({ type: 'measure', id: rid, shape: { blockBytes: c.blockBytes, layers: c.layers, blocks: c.blocks }, seed: SEED + 7919 * (r * s.configs.length + ci + 1), fetches, minMs: s.minMs, warmupMs: s.warmupMs, order });
        const res = await req.next<{ type: string; results?: KvMethodResult[]; message?: string }>((m) => m['id'] === rid, ctx.signal);
        if (res.type === 'error' || !res.results) throw new BenchError(`kv ${label(c)} failed: ${res.message ?? 'no result'}`);
        for (const x of res.results) {
          const key = `${ci}/${x.method}`;
          rows.set(key, [...(rows.get(key) ?? []), x]);
        }
        ctx.progress('kv', ++done, steps);
      }
    }

    const measurements: Measurement[] = [];
    const ratios: Ratio[] = [];
    let failures = 0;
    const failedAt: string[] = [];
    const gbpsOf = new Map<string, number>();
    /**
     * A ratio as the median of per-round ratios: each round measured subject and baseline back
     * to back (order alternating), so pairing them by round cancels what drifts between rounds
     * (the load of a shared machine), where a ratio of the two medians would mix rounds.
     */
    const paired = (ci: number, subject: KvMethod, baseline: KvMethod): { value: number; rounds: number[] } => {
      const a = rows.get(`${ci}/${subject}`) ?? [];
      const b = rows.get(`${ci}/${baseline}`) ?? [];
      const rounds = a.map((x, r) => gbps(x.bytes, x.ms) / gbps((b[r] as KvMethodResult).bytes, (b[r] as KvMethodResult).ms));
      return { value: median(rounds), rounds };
    };
    /**
     * The ratio row of `subject` against `baseline` in shape `ci` (median of per-round ratios,
     * `paired` unless given); `after` follows the shape in its name.
     */
    const ratioRow = (ci: number, c: KvConfig, name: string, subject: KvMethod, baseline: KvMethod, goalValue?: number, after = '', measured = paired(ci, subject, baseline)): Ratio => {
      const { value, rounds } = measured;
      return {
        name: `${name} @ ${label(c)}${after}`,
        subject: NAMES[subject](transportOf(subject)),
        baseline: NAMES[baseline](transportOf(baseline)),
        blockBytes: c.blockBytes,
        descriptors: descriptorsOf(c),
        value,
        rounds,
        ...(goalValue !== undefined ? { goal: goalValue, pass: value >= goalValue } : {}),
      };
    };
    for (const [ci, c] of s.configs.entries()) {
      for (const m of methods) {
        const runs = rows.get(`${ci}/${m}`) ?? [];
        const failed = runs.reduce((t, x) => t + x.failures, 0);
        failures += failed;
        if (failed > 0) failedAt.push(`${NAMES[m](transportOf(m))} @ ${label(c)}: ${failed}`);
        const g = median(runs.map((x) => gbps(x.bytes, x.ms)));
        gbpsOf.set(`${ci}/${m}`, g);
        const transport = runs[0]?.transport ?? transportOf(m);
        if (transport && m !== 'raw' && m !== 'memcpy' && m !== 'memcpy-shm' && runs.some((x) => x.transport !== transportOf(m))) {
          throw new BenchError(`kv ${label(c)}: the engine used ${runs.map((x) => x.transport).join(', ')} where explain() chose ${transportOf(m)}`);
        }
        const prepare = runs.filter((x) => x.prepareMs !== undefined).map((x) => x.prepareMs as number);
        const ranges = runs.find((x) => x.ranges !== undefined)?.ranges;
        const splits = runs.flatMap((x) => (x.leaseSplit ? [x.leaseSplit] : []));
        const withReads = runs.filter((x) => x.pairedReadBytes !== undefined);
        measurements.push({
          name: NAMES[m](transportOf(m)),
          role: m === 'raw' || m === 'memcpy' || m === 'memcpy-shm' ? 'baseline' : 'subject',
          blockBytes: c.blockBytes,
          descriptors: descriptorsOf(c),
          totalBytes: runs.reduce((t, x) => t + x.bytes, 0),
          gbps: g,
          opsPerSec: median(runs.map((x) => x.fetches / (x.ms / 1000))),
          descriptorsPerSec: median(runs.map((x) => x.descriptors / (x.ms / 1000))),
          ...(m !== 'raw' && m !== 'memcpy' && m !== 'memcpy-shm' ? { transport } : {}),
          latency: summarize(runs.flatMap((x) => x.latencies)),
          extra: { layers: c.layers, blocks: c.blocks, sweep: c.sweep, rounds: runs.length, fetchesPerRound: runs[0]?.fetches ?? 0, firstCallMs: runs[0]?.firstMs ?? 0, warmupCalls: median(runs.map((x) => x.warmupCalls)), ...(prepare.length > 0 ? { prepareMedianMs: median(prepare) } : {}), ...(ranges !== undefined ? { rangesAfterMerge: ranges } : {}), ...(splits.length > 0 ? { clientFetchMedianMs: median(splits.map((x) => x.fetchMs)), releaseMedianMs: median(splits.map((x) => x.releaseMs)), releaseConfirmedMedianMs: median(splits.map((x) => x.confirmMs)) } : {}), ...(withReads.length > 0 ? { pairedReadBytes: withReads.reduce((t, x) => t + (x.pairedReadBytes as number), 0) } : {}) },
        });
      }
      for (const [lane, baseline, kind] of [
        ['same-host', 'memcpy', 'same-host'],
        ['tcp', 'raw', 'tcp'],
      ] as const) {
        if (!hello.lanes.includes(lane)) continue;
        for (const variant of ['prepared', 'read'] as const) {
          ratios.push(ratioRow(ci, c, `${lane} ${variant === 'prepared' ? 'prepared' : 'engine.read'}/${baseline}`, `${lane}-${variant}`, baseline, goal(kind, c)));
        }
        if (lane === 'same-host' && gbpsOf.has(`${ci}/memcpy-shm`)) {
          ratios.push(ratioRow(ci, c, 'same-host prepared/memcpy-shm', 'same-host-prepared', 'memcpy-shm', undefined, ' (same source memory kind)'));
        }
        // The lease and grant overhead: the whole leased fetch against the same engine.read alone.
        const lg = lane === 'same-host' && c.blockBytes === 64 * KiB && c.sweep !== 'batch' ? 0.8 : undefined;
        ratios.push(ratioRow(ci, c, `${lane} leased/engine.read`, `${lane}-leased`, `${lane}-read`, lg, ' (lease + grant overhead)'));
        // What the Session messages save (over the holder's local lane on one host, else the gRPC
        // stream): the same leased fetch with every lease call a unary gRPC call.
        if (rows.has(`${ci}/${lane}-leased-unary`)) ratios.push(ratioRow(ci, c, `${lane} leased, Session (local lane or stream)/unary calls`, `${lane}-leased`, `${lane}-leased-unary`));
        if (lane === 'same-host') {
          // What the holder's local lane saves: the same leased fetch with the Session messages on the gRPC stream.
          if (rows.has(`${ci}/same-host-leased-stream`)) ratios.push(ratioRow(ci, c, 'same-host leased, local lane/gRPC stream', 'same-host-leased', 'same-host-leased-stream'));
          // What not waiting for the release's answer saves: the same leased fetch with `await fetch.release()` in the timed call.
          if (rows.has(`${ci}/same-host-leased-awaited`)) ratios.push(ratioRow(ci, c, 'same-host leased, release queued/awaited', 'same-host-leased', 'same-host-leased-awaited'));
          // What naming blocks by number saves: the same leased fetch with one block id string per block.
          if (rows.has(`${ci}/same-host-leased-ids`)) ratios.push(ratioRow(ci, c, 'same-host leased, blocks by number/by id', 'same-host-leased', 'same-host-leased-ids'));
          // Leased fetches in a pipeline: each lease acquired while the previous fetch read.
          if (rows.has(`${ci}/same-host-leased-pipelined`)) ratios.push(ratioRow(ci, c, 'same-host leased pipelined/engine.read', 'same-host-leased-pipelined', 'same-host-read', undefined, ' (next acquire during each read)'));
          // The lease overhead when each fetch follows other work (an engine.read of the same
          // blocks, timed on its own as this fetch's baseline) instead of the previous fetch.
          const alt = rows.get(`${ci}/same-host-leased-alternating`) ?? [];
          if (alt.length > 0 && alt.every((x) => x.pairedReadMs !== undefined)) {
            const rounds = alt.map((x) => (x.pairedReadMs as number) / x.ms);
            ratios.push(ratioRow(ci, c, 'same-host leased/engine.read, alternating per fetch', 'same-host-leased-alternating', 'same-host-read', undefined, ' (each fetch right after a read)', { value: median(rounds), rounds }));
          }
        }
      }
    }

    // Grant cost against the number of ranges (register once, grant per lease), and the old way.
    const GRANT_SIZES = ctx.quick ? [10, 1000] : [10, 1000, 10_000];
    holder.send({ type: 'grant-cost', blockBytes: 4 * KiB, ranges: GRANT_SIZES, runs: ctx.quick ? 5 : 200, registerBlocks: ctx.quick ? 100 : 1000 });
    type GrantRow = { ranges: number; layers?: number; grantUs: number; revokeUs: number };
    const gc = await holder.next<{ rows?: GrantRow[]; unsorted?: GrantRow[]; blockRows?: GrantRow[]; blockUnsorted?: GrantRow[]; perBlock?: { grantUs: number; revokeUs: number }; error?: string }>(
      (m) => m['type'] === 'grant-cost',
      ctx.signal,
    );
    if (gc.error || !gc.rows || !gc.unsorted || !gc.blockRows || !gc.blockUnsorted || !gc.perBlock) throw new BenchError(`kv grant cost failed: ${gc.error ?? 'no result'}`);
    // Two forms of the same grants: a range grant (any ranges: a Float64Array of registration,
    // offset, length) and a block grant (4 KiB blocks of the region by index: what engineGrants
    // makes of a KV lease, whose blocks lie on the region's grid).
    const form = (blocks: boolean): string => (blocks ? 'block grant: 4 KiB blocks by index' : 'range grant: 4 KiB ranges');
    const sortedName = (n: number, blocks = false): string => `engine.grant over ${n} ${blocks ? 'blocks' : 'ranges'} (${form(blocks)}, sorted by offset)`;
    const unsortedName = (n: number, layers: number, blocks = false): string =>
      `engine.grant over ${n} ${blocks ? 'blocks' : 'ranges'} (${form(blocks)}, unsorted: ${layers} layers × ${n / layers} random blocks, layer-major)`;
    const grantRow = (name: string, row: GrantRow, order: string): void => {
      measurements.push({ name, role: 'subject', opsPerSec: 1e6 / row.grantUs, extra: { grantUs: row.grantUs, revokeUs: row.revokeUs, revokesPerSec: 1e6 / row.revokeUs, ranges: row.ranges, ...(row.layers === undefined ? {} : { layers: row.layers }), order } });
    };
    for (const blocks of [true, false]) {
      const sortedRows = blocks ? gc.blockRows : gc.rows;
      const unsortedRows = blocks ? gc.blockUnsorted : gc.unsorted;
      for (const [k, row] of sortedRows.entries()) {
        grantRow(sortedName(row.ranges, blocks), row, 'sorted');
        const u = unsortedRows[k];
        if (u) grantRow(unsortedName(u.ranges, u.layers as number, blocks), u, 'layer-major random');
      }
    }
    measurements.push({
      name: 'engine.register per 4 KiB block (the way before range grants)',
      role: 'baseline',
      opsPerSec: 1e6 / gc.perBlock.grantUs,
      extra: { registerUs: gc.perBlock.grantUs, revokeUs: gc.perBlock.revokeUs, revokesPerSec: 1e6 / gc.perBlock.revokeUs },
    });
    const grantNotes: string[] = [];
    for (const blocks of [true, false]) {
      const rows = blocks ? gc.blockRows : gc.rows;
      const unsortedRows = blocks ? gc.blockUnsorted : gc.unsorted;
      const what = blocks ? 'blocks' : 'ranges';
      const small = rows[0] as GrantRow;
      const large = rows[rows.length - 1] as GrantRow;
      // The goal (a lease's grant costs about the same for 10 blocks as for 10,000) is on the
      // block grant, the form a KV lease takes; the range grant's flatness is reported beside it.
      ratios.push({
        name: `grant cost flatness (${form(blocks)}): time of a grant over ${small.ranges} ${what} / over ${large.ranges} ${what} (sorted rows)`,
        subject: sortedName(large.ranges, blocks),
        baseline: sortedName(small.ranges, blocks),
        value: small.grantUs / large.grantUs,
        ...(blocks && large.ranges >= 10_000 ? { goal: 0.5, pass: small.grantUs / large.grantUs >= 0.5 } : {}),
      });
      const us = unsortedRows[0] as GrantRow;
      const ul = unsortedRows[unsortedRows.length - 1] as GrantRow;
      ratios.push({
        name: `grant cost flatness (${form(blocks)}), unsorted: time of a grant over ${us.ranges} ${what} / over ${ul.ranges} ${what} (layer-major random rows)`,
        subject: unsortedName(ul.ranges, ul.layers as number, blocks),
        baseline: unsortedName(us.ranges, us.layers as number, blocks),
        value: us.grantUs / ul.grantUs,
      });
      ratios.push({
        name: `${blocks ? 'block' : 'range'} grant over ${ul.ranges} ${what}: sorted / unsorted time (what the order of a real lease costs)`,
        subject: unsortedName(ul.ranges, ul.layers as number, blocks),
        baseline: sortedName(large.ranges, blocks),
        value: large.grantUs / ul.grantUs,
      });
      ratios.push({
        name: `a ${blocks ? 'block' : 'range'} grant over ${large.ranges} blocks against ${large.ranges} per-block registrations`,
        subject: sortedName(large.ranges, blocks),
        baseline: 'engine.register per 4 KiB block (the way before range grants)',
        value: (gc.perBlock.grantUs * large.ranges) / large.grantUs,
      });
      const marginalNs = ((large.grantUs - small.grantUs) * 1e3) / (large.ranges - small.ranges);
      const perRange = blocks
        ? "the engine's check of each index (one compare when sorted, a bitmap otherwise) and each transport's copy: one copy of the indices for cuda-ipc, none for TCP"
        : "the engine's one range check pass and each transport's range record: a native write for cuda-ipc, none for TCP, which keeps the engine's checked copy";
      grantNotes.push(
        `grant cost split (${form(blocks)}, sorted rows): ${small.grantUs.toFixed(1)} µs for ${small.ranges} ${what} (what every grant pays: the engine's checks, each transport's record, the token and descriptor), then ${marginalNs > 0 ? `${marginalNs.toFixed(2)} ns` : 'no cost above the noise of this run'} per further ${blocks ? 'block' : 'range'} (${perRange})`,
      );
    }

    const notes: string[] = [
      ...grantNotes,
      `holder region: ${formatBytes(s.regionBytes)} (${unavailable === undefined ? 'a shared segment from allocateSharedMemory' : 'process memory'}), registered once with ${ready.transports.join(', ')}`,
      ...ready.notes,
      ...hello.notes,
      'a fetch reads the same random block ids from every layer, layer-major, into one contiguous destination; no two consecutive descriptors are adjacent in the region, so the engine merges nothing',
      ...(warmNote !== undefined ? [warmNote] : ['no lease path warm-up before the rounds (--quick, --warmup-ms 0 or --lease-warmup 0): the leased rows include V8 compiling the gRPC and lease code']),
      `each method, per shape and round: untimed warm-up fetches (${s.warmupMs > 0 ? `at least 20, more until they took ${s.warmupMs} ms, at most 1,000` : 'one'}; extra.firstCallMs is the very first call of the method, in round 1: the cold cost), then at least ${s.minFetches} timed fetches (about ${formatBytes(s.targetBytes)}) and, past those, more until the timed calls took ${s.minMs} ms (at most 1,000), one at a time; GB/s and descriptors/s are from the time inside the fetch calls, median of ${s.rounds} round(s); methods alternate order every round; a ratio row is the median of its per-round ratios (subject and baseline of the same round; \`rounds\` in the JSON)`,
      'unprepared: engine.read with the same request list each fetch; prepared: engine.prepare once per shape and round (time in extra.prepareMedianMs), then run() per fetch',
      'leased: the library flow per fetch, client.fetch (gRPC acquire on the holder, which makes one engine.grant over the lease\'s blocks with engineGrants, over the one transport the requester\'s engine reads through, which client.fetch names in the acquire from its second fetch from the holder on; one engine.read; length checks) then its disposal, as `await using` does: the release (the holder revokes the grant) is queued and not waited for; every release\'s answer is awaited after the method\'s fetches and must confirm it; the ratio against engine.read is the lease + grant overhead. The blocks are named by number in the holder\'s numbered block space of the block size (`{ owner: \'kv-<bytes>\', numbers }`: the owner once, the numbers packed; the lease table counts pins in a typed array; the grant is the block grant of the numbers); "by id" is the same fetch naming each block by an id string (`block:kv:<offset>_<bytes>`, looked up in the holder\'s block map, pinned in its map of ids)',
      'grant cost: on the holder, engine.grant over N scattered 4 KiB ranges of its region then revoke, median µs of 200 samples per size, the sizes interleaved sample by sample (rotating order), in two forms of the same ranges (a block grant, 4 KiB blocks by index, what engineGrants makes of a lease whose blocks lie on the region\'s grid as the kv blocks do; and a range grant, a Float64Array of ranges, for any ranges) and two orders of the same kind of lease: sorted (stride 7919 blocks, in offset order) and unsorted (the order of a real lease\'s blocks: layer-major, the same random block ids in every layer, as the kv fetches; offsets rise only across layers); against engine.register of each 4 KiB block separately (what a lease cost before range grants). The flatness goal (0.5 at 10,000) is on the sorted block-grant rows; the other flatness and per-block ratios are without goals',
      'verification: before every timed fetch the first and last byte of 4 sampled descriptors are poisoned, after it those descriptors are compared in full with the pattern at their remote offsets; after the last fetch of each method every descriptor is compared in full (destination zeroed before each method)',
      'memcpy baseline: the same descriptors, Buffer.copy per descriptor in a JS loop inside the requester, from a process-local copy of the holder pattern (JS-driven: its per-descriptor cost includes the JS call); verified against the requester\'s shared-segment copy of the pattern, not the buffer it copies from, so that verification does not leave its source in the caches (every method is verified against a buffer it does not read)',
      `memcpy-shm baseline: the same loop, out of a shared segment of the requester filled with the same pattern: what the same-host transport copies from; ${hugePageNote()}`,
      'raw baseline: the holder writes the same byte count per fetch from its region as one contiguous run over one node:net socket (slices of at most 4 MiB), received straight into the destination with onread: no per-descriptor work, a ceiling for TCP',
    ];
    // Where a leased fetch's time goes: client.fetch (acquire + grant + read) and the release, beside engine.read alone.
    for (const [ci, c] of s.configs.entries()) {
      if (c.sweep === 'batch' && c.blockBytes * descriptorsOf(c) < 64 * MiB) continue;
      for (const lane of hello.lanes) {
        const split = rows.get(`${ci}/${lane}-leased`)?.flatMap((x) => (x.leaseSplit ? [x.leaseSplit] : [])) ?? [];
        const reads = rows.get(`${ci}/${lane}-read`) ?? [];
        if (split.length === 0 || reads.length === 0) continue;
        const readMs = median(reads.flatMap((x) => x.latencies));
        const fetchMs = median(split.map((x) => x.fetchMs));
        const releaseMs = median(split.map((x) => x.releaseMs));
        const confirmMs = median(split.map((x) => x.confirmMs));
        notes.push(
          `${lane} leased fetch @ ${label(c)}, medians: client.fetch ${fetchMs.toFixed(3)} ms (acquire + grant + read: the bytes are usable), then disposal ${releaseMs.toFixed(3)} ms (queues the release); engine.read alone ${readMs.toFixed(3)} ms (median call of the same round(s)): the lease adds about ${Math.max(0, fetchMs - readMs).toFixed(3)} ms before the bytes are usable (one round trip of the Session messages: over the holder's local lane on one host, see the warm-up note, else the gRPC stream); the holder confirmed each release ${confirmMs.toFixed(3)} ms after client.fetch returned, outside the timed calls`,
        );
      }
    }
    if (unavailable !== undefined) notes.push(`same-host transport unavailable here: ${unavailable}`);
    if (failedAt.length > 0) notes.push(`descriptors that failed verification: ${failedAt.join('; ')}`);

    if (s.compare) {
      const sizes = [...new Set(s.configs.filter((c) => c.sweep !== 'batch').map((c) => c.blockBytes))];
      const rereadMethods: KvRereadMethod[] = [];
      if (hello.lanes.includes('same-host')) rereadMethods.push('same-host-reread');
      if (hello.lanes.includes('tcp')) rereadMethods.push('tcp-reread');
      if (hello.lanes.includes('same-host')) rereadMethods.push('memcpy-shm-reread');
      const rereadTransport = (m: KvRereadMethod): string => (m === 'same-host-reread' ? (hello.transports['same-host'] as string) : m === 'tcp-reread' ? (hello.transports['tcp'] as string) : '');
      const iterationsOf = (size: number): number => Math.min(4000, Math.max(ctx.quick ? 20 : 100, Math.floor((ctx.quick ? 8 * MiB : 128 * MiB) / size)));
      const ucxRuns = new Map<string, Measurement[]>(); // `${size}/${UCX name}` -> one per round
      const oursRuns = new Map<string, KvRereadResult[]>(); // `${size}/${method}` -> one per round
      const ucxNotes = new Set<string>();
      const steps = s.rounds * sizes.length;
      let step = 0;
      // Rounds: at each size, our same-shape posts and the two UCX runs, in an order that alternates.
      for (let r = 0; r < s.rounds; r++) {
        for (const [si, size] of sizes.entries()) {
          const iterations = iterationsOf(size);
          const slots = Math.floor(s.regionBytes / size);
          const remoteOffset = Math.floor(rng(SEED + 31 * (r * sizes.length + si + 1))() * slots) * size;
          const ours = async (): Promise<void> => {
            const rid = ++id;
            req.send({ type: 'reread', id: rid, blockBytes: size, remoteOffset, iterations, warmup: ucxWarmup(iterations), warmupMs: s.warmupMs, order: r % 2 === 0 ? rereadMethods : [...rereadMethods].reverse() });
            const res = await req.next<{ type: string; results?: KvRereadResult[]; message?: string }>((m) => m['id'] === rid, ctx.signal);
            if (res.type === 'error' || !res.results) throw new BenchError(`kv --compare re-read of ${formatBytes(size)} failed: ${res.message ?? 'no result'}`);
            for (const x of res.results) oursRuns.set(`${size}/${x.method}`, [...(oursRuns.get(`${size}/${x.method}`) ?? []), x]);
          };
          const ucx = (t: UcxTransport) => async (): Promise<void> => {
            const u = await ucxPerftest(size, iterations, [t]);
            for (const n of u.notes) ucxNotes.add(`${formatBytes(size)}: ${n}`);
            for (const m of u.measurements) ucxRuns.set(`${size}/${m.name}`, [...(ucxRuns.get(`${size}/${m.name}`) ?? []), m]);
          };
          const order = [ours, ucx('posix'), ucx('tcp')];
          for (const run of (r + si) % 2 === 0 ? order : order.reverse()) await run();
          ctx.progress('kv --compare', ++step, steps);
        }
      }
      notes.push(...[...ucxNotes].map((n) => (/not installed/.test(n) ? n.replace(/^[^:]+: /, '') : n)).filter((n, i, a) => a.indexOf(n) === i));
      for (const size of sizes) {
        const ci = s.configs.findIndex((c) => c.blockBytes === size && c.sweep !== 'batch');
        const c = s.configs[ci] as KvConfig;
        const iterations = iterationsOf(size);
        // UCX rows: the median of the rounds.
        const ucxGbps = new Map<UcxTransport, number>();
        for (const t of ['posix', 'tcp'] as const) {
          const runs = ucxRuns.get(`${size}/${UCX_NAMES[t]}`) ?? [];
          if (runs.length === 0) continue;
          const g = median(runs.map((x) => x.gbps as number));
          ucxGbps.set(t, g);
          measurements.push({
            name: UCX_NAMES[t],
            role: 'external',
            blockBytes: size,
            totalBytes: runs.reduce((a, x) => a + (x.totalBytes ?? 0), 0),
            gbps: g,
            opsPerSec: (g * 1e9) / size,
            extra: { rounds: runs.length, iterations, warmup: ucxWarmup(iterations), window: 1, p50LatencyUs: median(runs.map((x) => Number(x.extra?.['p50LatencyUs'] ?? 0))) },
          });
        }
        // Ours in the ucx_perftest shape: one block re-read, window 1, same iterations and warm-up.
        const rereadGbps = new Map<KvRereadMethod, number>();
        for (const m of rereadMethods) {
          const runs = oursRuns.get(`${size}/${m}`) ?? [];
          const failed = runs.reduce((t, x) => t + x.failures, 0);
          failures += failed;
          if (failed > 0) notes.push(`re-read posts that failed verification: ${REREAD_NAMES[m](rereadTransport(m))} @ ${formatBytes(size)}: ${failed}`);
          const transport = runs[0]?.transport;
          if (m !== 'memcpy-shm-reread' && runs.some((x) => x.transport !== rereadTransport(m))) {
            throw new BenchError(`kv --compare ${formatBytes(size)}: the engine used ${runs.map((x) => x.transport).join(', ')} where explain() chose ${rereadTransport(m)}`);
          }
          const g = median(runs.map((x) => gbps(x.bytes, x.ms)));
          rereadGbps.set(m, g);
          measurements.push({
            name: REREAD_NAMES[m](rereadTransport(m)),
            role: m === 'memcpy-shm-reread' ? 'baseline' : 'subject',
            blockBytes: size,
            descriptors: 1,
            totalBytes: runs.reduce((t, x) => t + x.bytes, 0),
            gbps: g,
            opsPerSec: median(runs.map((x) => x.iterations / (x.ms / 1000))),
            descriptorsPerSec: median(runs.map((x) => x.iterations / (x.ms / 1000))),
            ...(transport !== undefined ? { transport } : {}),
            extra: { shape: 'ucx_perftest ucp_get', rounds: runs.length, iterations, warmup: ucxWarmup(iterations), window: 1, usPerPost: median(runs.map((x) => (x.ms * 1000) / x.iterations)) },
          });
        }
        for (const t of ['posix', 'tcp'] as const) {
          const u = ucxGbps.get(t);
          if (u === undefined) continue;
          const lane = t === 'tcp' ? 'tcp' : 'same-host';
          if (!hello.lanes.includes(lane)) continue;
          const g = t === 'tcp' ? 3 : size === 64 * KiB || size === 4 * MiB ? 1 : undefined;
          // The scattered kv fetch (the size sweep's shape) against UCX, as before.
          const scattered = (gbpsOf.get(`${ci}/${lane}-prepared`) as number) / u;
          ratios.push({ name: `${lane} prepared/${UCX_NAMES[t]} @ ${formatBytes(size)}`, subject: NAMES[`${lane}-prepared`](transportOf(`${lane}-prepared`)), baseline: UCX_NAMES[t], blockBytes: size, descriptors: descriptorsOf(c), value: scattered, ...(g !== undefined ? { goal: g, pass: scattered >= g } : {}) });
          // The same shape as ucx_perftest on both sides.
          const m: KvRereadMethod = `${lane}-reread`;
          const same = (rereadGbps.get(m) as number) / u;
          ratios.push({ name: `${lane} re-read/${UCX_NAMES[t]} @ ${formatBytes(size)} (same shape: one block re-read, window 1)`, subject: REREAD_NAMES[m](rereadTransport(m)), baseline: UCX_NAMES[t], blockBytes: size, descriptors: 1, value: same, ...(g !== undefined ? { goal: g, pass: same >= g } : {}) });
        }
      }
      notes.push(
        `UCX: ucx_perftest -t ucp_get -s <block size> -n <iterations> -w <iterations/10> -O 1 on loopback (UCX_TLS=posix,self and UCX_TLS=tcp; iterations = 128 MiB / size, clamped to 100..4000): it gets the same remote buffer into the same local buffer, one get at a time (ucp_get's default window is 1), so at small sizes both sides stay in cache; figures are medians of ${s.rounds} round(s), each round running, at each size, our same-shape posts and the two UCX runs in an order that alternates`,
        `UCX ratios "<lane> prepared/UCX ..." use the scattered kv fetch of the size sweep (layers × blocks over the whole holder region, 1 × 4 MiB at 4 MiB): not the shape UCX measures; "<lane> re-read/UCX ... (same shape)" use ours measured the way ucx_perftest measures: one prepared transfer of one request of the block size from one random block-aligned remote offset into offset 0 of the registered destination, run() one post at a time, the same iterations and warm-up as the UCX run, after untimed posts until ${s.warmupMs} ms had passed (as every kv method gets: JIT-compiled code, not V8's interpreter; UCX is C); the time is the wall time of the timed loop; every post's first and last destination byte are poisoned before it and checked after it, and the block is compared in full after the loop`,
      );
    }
    return { scenario: 'kv', measurements, ratios, verificationFailures: failures, notes };
  } finally {
    requester?.send({ type: 'stop' });
    holder.send({ type: 'stop' });
    const stop = setTimeout(() => {
      requester?.kill();
      holder.kill();
    }, 3000);
    await Promise.allSettled([holder.exited, requester?.exited]);
    clearTimeout(stop);
  }
}
