/**
 * The requester half of `run` (also `tensorwire-bench fetch`): repeatedly fetch a random set
 * of blocks from the holder with the library's `client.fetch` (lease, range grant, one batched
 * read through the engine's chosen transport), verify every byte, release (exactly once, by
 * `await using`). Then the raw-socket and memcpy baselines.
 * The engine is built with the transports `transport` allows (see transports.ts): by default
 * cuda-ipc and TCP, so on the holder's host the engine takes the same-host path.
 *
 * Each lane registers its destination once. Per fetch it records the stages: `fetch` (the
 * whole client.fetch call), `read` (the engine.read inside it, timed by wrapping the engine's
 * `read` method: instrumentation only, the call is unchanged), `acquire` (= fetch − read: the
 * gRPC acquire, the holder's pin and engine.grant, the decode of the lease descriptor), `verify`
 * (Buffer.compare of every block against its pattern, then poisoning the first and last byte of
 * each block for the next fetch) and `release` (the gRPC release). A prepared transfer does not
 * help here: every lease carries a new grant (a new descriptor), so a transfer prepared for one
 * lease cannot serve the next.
 */
import net from 'node:net';
import { TransferEngine, silentLogger, type Registration } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { LockClient, decodeFetchDescriptor } from '@tensorwire/lock-client';
import { blockId, blockSeed, decodeRawPort } from './fetch-protocol.js';
import { gbps, leaseCallPath, median, nowMs, summarize, warmupTrend } from './stats.js';
import { requesterTransports, type TransportChoice } from './transports.js';
import type { Measurement, Ratio } from './types.js';

export interface FetchOptions {
  lockAddress: string;
  blocks: number;
  blockBytes: number;
  blocksPerFetch: number;
  durationMs: number;
  lanes: number;
  /** Which transports the requester's engine registers (default auto: every one it can build). */
  transport?: TransportChoice;
  /** Run the raw-socket and memcpy baselines after the fetches (default true). */
  baselines?: boolean;
  /**
   * Untimed fetches of one block before the timed loop (default 0): the lease path at steady
   * state. V8 needs thousands of calls before @grpc/grpc-js and the lease code run optimized
   * code; a requester process that starts timing at once measures the compiler for its first
   * seconds.
   */
  warmupFetches?: number;
  signal?: AbortSignal;
  onProgress?: (doneMs: number, totalMs: number) => void;
}

/** Per-fetch stage times (ms), one entry per successful fetch, every lane together. */
export interface FetchStages {
  fetch: number[];
  acquire: number[];
  read: number[];
  verify: number[];
  release: number[];
}

export interface FetchResult {
  measurements: Measurement[];
  ratios: Ratio[];
  verificationFailures: number;
  notes: string[];
  fetches: number;
  failedFetches: number;
  /** The transport(s) the engine reported using. */
  transport: string;
  bytes: number;
  /** Wall time of the fetch loop (every stage, every lane). */
  elapsedMs: number;
  /** Σ over lanes of the time inside client.fetch + its disposal, divided by the lane count (verification left out). */
  flowMs: number;
  stages: FetchStages;
}

/** The names of the subject rows (the same in `run` and `fetch`). */
export const FETCH_WALL = 'leased fetch via client.fetch (lease + range grant + read + verify + disposal, wall clock)';
export const FETCH_FLOW = 'leased fetch via client.fetch (lease + range grant + read, then disposal; verification outside the timed part)';

/** Subject and stage rows from one or more requester runs of the same lane (figures over all of them). */
export function fetchMeasurements(parts: readonly FetchResult[], blockBytes: number, suffix = ''): Measurement[] {
  const bytes = parts.reduce((t, p) => t + p.bytes, 0);
  const elapsed = parts.reduce((t, p) => t + p.elapsedMs, 0);
  const flow = parts.reduce((t, p) => t + p.flowMs, 0);
  const fetches = parts.reduce((t, p) => t + p.fetches, 0);
  const transport = [...new Set(parts.map((p) => p.transport))].join('+');
  const all = (k: keyof FetchStages): number[] => parts.flatMap((p) => p.stages[k]);
  const stage = (k: keyof FetchStages, what: string): Measurement => ({ name: `stage ${k}: ${what}${suffix}`, role: 'subject', transport, latency: summarize(all(k)), extra: { medianMs: median(all(k)) } });
  return [
    { name: `${FETCH_FLOW}${suffix}`, role: 'subject', transport, blockBytes, totalBytes: bytes, gbps: gbps(bytes, flow), opsPerSec: fetches / (flow / 1000), latency: summarize(all('fetch')), extra: { rounds: parts.length } },
    { name: `${FETCH_WALL}${suffix}`, role: 'subject', transport, blockBytes, totalBytes: bytes, gbps: gbps(bytes, elapsed), opsPerSec: fetches / (elapsed / 1000), extra: { rounds: parts.length } },
    stage('acquire', 'client.fetch minus its engine.read (gRPC acquire, pin + engine.grant on the holder, lease decode; with more than one lane also the time the other lanes hold the one JS thread)'),
    stage('read', 'the engine.read inside client.fetch'),
    stage('verify', 'Buffer.compare of every block, poison first/last byte of each'),
    stage('release', 'disposal of the fetch guard (queues the release; its answer is awaited after the loop)'),
  ];
}

function pick(n: number, k: number): number[] {
  const out = new Set<number>();
  while (out.size < Math.min(n, k)) out.add(Math.floor(Math.random() * n));
  return [...out];
}

export async function runFetcher(o: FetchOptions): Promise<FetchResult> {
  const choice = o.transport ?? 'auto';
  const built = requesterTransports(choice);
  const engine = new TransferEngine({ nodeId: 'bench-requester', transports: built.transports, logger: silentLogger });
  const client = new LockClient({ requesterId: 'bench-requester', logger: silentLogger });
  await engine.start();
  // Instrumentation: time each engine.read (client.fetch makes exactly one per fetch), by the
  // destination registration, which tells the lanes apart.
  const lastRead = new Map<Registration, number>();
  const read = engine.read.bind(engine);
  engine.read = async (peer, requests, options) => {
    const t = nowMs();
    try {
      return await read(peer, requests, options);
    } finally {
      const first = requests[0];
      if (first) lastRead.set(first.local, nowMs() - t);
    }
  };
  const expected = Array.from({ length: o.blocks }, (_, i) => pattern(o.blockBytes, blockSeed(i)));
  const notes: string[] = [`requester transports (--transport ${choice}): ${engine.transports.map((t) => t.name).join(', ')}`, ...built.notes];
  const used = new Set<string>();
  let chosenTransport: string | undefined;
  let failures = 0;
  let fetches = 0;
  let failedFetches = 0;
  let bytes = 0;
  let rawPort = 0;
  let explained = false;
  let flowMs = 0;
  const stages: FetchStages = { fetch: [], acquire: [], read: [], verify: [], release: [] };
  /** Each fetch's release (1 if the holder did not confirm it), awaited after the loop. */
  const releases: Promise<number>[] = [];
  const s = o.blockBytes;
  try {
    const lanes = await Promise.all(
      Array.from({ length: o.lanes }, async () => {
        const buffer = new Uint8Array(s * o.blocksPerFetch).fill(1);
        const local: Registration = await engine.register({ kind: 'host', buffer });
        return { buffer, local };
      }),
    );
    const fetchOnce = (local: Registration, chosen: number[]): ReturnType<LockClient['fetch']> =>
      client.fetch(
        engine,
        o.lockAddress,
        chosen.map(blockId),
        chosen.map((_, k) => ({ local, offset: k * s, length: s })),
        { timeoutMs: 5_000, ...(o.signal ? { signal: o.signal } : {}) },
      );
    // One untimed fetch per lane first: connections are set up here, not inside the timed loop.
    for (const { local } of lanes) {
      const warm = await fetchOnce(local, pick(o.blocks, o.blocksPerFetch));
      await warm.release();
    }
    const warmups = o.warmupFetches ?? 0;
    if (warmups > 0) {
      const w0 = nowMs();
      const times: number[] = [];
      const local = (lanes[0] as { local: Registration }).local;
      // Each warm-up release is checked with the timed fetches' after the loop.
      for (let i = 0; i < warmups && !o.signal?.aborted; i++) {
        const t = nowMs();
        const f = await fetchOnce(local, pick(o.blocks, 1));
        times.push(nowMs() - t);
        await f[Symbol.asyncDispose]();
        releases.push(f.release().then((r) => (r.confirmed ? 0 : 1)));
      }
      notes.push(
        `lease path warm-up before the timed fetches (untimed): ${times.length} fetches of one block in ${((nowMs() - w0) / 1000).toFixed(1)} s, ${warmupTrend(times)}`,
      );
    }
    const start = nowMs();
    const end = start + o.durationMs;
    let lastProgress = 0;
    await Promise.all(
      lanes.map(async ({ buffer, local }) => {
        let laneFlow = 0;
        while (nowMs() < end && !o.signal?.aborted) {
          const chosen = pick(o.blocks, o.blocksPerFetch);
          const t0 = nowMs();
          try {
            // The library's fetch flow: lease + one range grant + one batched read + length checks.
            await using fetch = await fetchOnce(local, chosen);
            const t1 = nowMs();
            const readMs = lastRead.get(local) ?? 0;
            rawPort = decodeRawPort(fetch.lease.descriptorsFor(blockId(chosen[0] as number))[0]) ?? rawPort;
            if (!explained) {
              explained = true;
              const { endpoint } = decodeFetchDescriptor(fetch.lease.leaseDescriptors[0] as Uint8Array);
              const ex = engine.explain(endpoint);
              chosenTransport = ex.chosen;
              notes.push(`transport chosen: ${ex.chosen ?? 'none'} — ${ex.reason}`);
            }
            used.add(fetch.transport);
            for (let k = 0; k < chosen.length; k++) {
              if (Buffer.compare(buffer.subarray(k * s, (k + 1) * s), expected[chosen[k] as number] as Uint8Array) !== 0) failures++;
              // Poison each block's ends: the next fetch must rewrite them.
              buffer[k * s] = ((expected[chosen[k] as number] as Uint8Array)[0] as number) ^ 0xff;
              buffer[(k + 1) * s - 1] = ((expected[chosen[k] as number] as Uint8Array)[s - 1] as number) ^ 0xff;
            }
            bytes += chosen.length * s;
            fetches++;
            const t2 = nowMs();
            // What the end of the `await using` scope does: queue the release, not wait for it.
            await fetch[Symbol.asyncDispose]();
            const t3 = nowMs();
            releases.push(fetch.release().then((r) => (r.confirmed ? 0 : 1)));
            stages.fetch.push(t1 - t0);
            stages.read.push(readMs);
            stages.acquire.push(t1 - t0 - readMs);
            stages.verify.push(t2 - t1);
            stages.release.push(t3 - t2);
            laneFlow += t1 - t0 + (t3 - t2);
          } catch (e) {
            failedFetches++;
            if (failedFetches === 1) notes.push(`first failed fetch: ${e instanceof Error ? e.message : String(e)}`);
            if (failedFetches > 3 && fetches === 0) throw e;
          }
          const now = nowMs();
          if (now - lastProgress > 200) {
            lastProgress = now;
            o.onProgress?.(Math.min(o.durationMs, now - start), o.durationMs);
          }
        }
        flowMs += laneFlow / o.lanes;
      }),
    );
    const elapsed = nowMs() - start;
    // Every release the fetches queued, answered: one the holder did not confirm is a failure.
    const unconfirmed = (await Promise.all(releases)).reduce((t, x) => t + x, 0);
    if (unconfirmed > 0) notes.push(`${unconfirmed} of ${releases.length} releases were not confirmed by the holder  <-- FAILURE`);
    failures += unconfirmed;
    const transport = [...used].join('+') || (chosenTransport ?? 'none');
    if (used.size > 0 && (used.size !== 1 || !used.has(chosenTransport as string))) notes.push(`transports the engine reported using: ${transport} (explain() said ${chosenTransport})  <-- MISMATCH`);
    const result: FetchResult = { measurements: [], ratios: [], verificationFailures: failures, notes, fetches, failedFetches, transport, bytes, elapsedMs: elapsed, flowMs, stages };
    const measurements = fetchMeasurements([result], s);
    const ratios: Ratio[] = [];
    if (o.baselines !== false) {
      // Baselines, same processes, right after: the same bytes over a raw socket, and memcpy.
      const rawTotal = Math.max(bytes, s * 16);
      const raw = await rawStream(o.lockAddress.replace(/:\d+$/, ''), rawPort, rawTotal);
      measurements.push({ name: 'raw node:net stream', role: 'baseline', blockBytes: s, totalBytes: rawTotal, gbps: raw });
      const mc = memcpy(s, Math.min(rawTotal, 2 * 1024 ** 3));
      measurements.push({ name: 'memcpy (Buffer.copy)', role: 'baseline', blockBytes: s, totalBytes: Math.min(rawTotal, 2 * 1024 ** 3), gbps: mc });
      ratios.push(
        { name: 'fetch/raw socket', subject: FETCH_FLOW, baseline: 'raw node:net stream', blockBytes: s, value: gbps(bytes, flowMs) / raw },
        { name: 'fetch/memcpy', subject: FETCH_FLOW, baseline: 'memcpy (Buffer.copy)', blockBytes: s, value: gbps(bytes, flowMs) / mc },
      );
    }
    notes.push(`${fetches} fetches of ${o.blocksPerFetch} random blocks of ${s} bytes over ${(elapsed / 1000).toFixed(1)} s on ${o.lanes} lanes; ${failedFetches} failed`);
    const path = leaseCallPath(client.sessionStats().get(o.lockAddress));
    if (path !== undefined) notes.push(`lease calls: ${path}`);
    return { ...result, measurements, ratios };
  } finally {
    await client.close();
    await engine.close();
  }
}

function rawStream(host: string, port: number, total: number): Promise<number> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host, port, noDelay: true });
    let got = 0;
    let t0 = 0;
    socket.on('error', reject);
    socket.on('connect', () => {
      const req = Buffer.alloc(12);
      req.writeBigUInt64BE(BigInt(total), 0);
      t0 = nowMs();
      socket.write(req);
    });
    socket.on('data', (d: Buffer) => {
      got += d.length;
      if (got >= total) {
        socket.destroy();
        resolve(gbps(total, nowMs() - t0));
      }
    });
  });
}

function memcpy(blockBytes: number, total: number): number {
  const src = Buffer.from(pattern(blockBytes, 1));
  const dst = Buffer.alloc(blockBytes);
  src.copy(dst); // warm
  const n = Math.max(1, Math.floor(total / blockBytes));
  const t0 = nowMs();
  for (let i = 0; i < n; i++) src.copy(dst);
  return gbps(n * blockBytes, nowMs() - t0);
}
