/**
 * The requester half of `run` (also `tensorwire-bench fetch`): repeatedly fetch a random set
 * of blocks from the holder with the library's `client.fetch` (lease, range grant, one batched
 * read through the engine's chosen transport), verify every byte, release (exactly once, by
 * `await using`). Then the raw-socket and memcpy baselines.
 * The engine is built with the transports `transport` allows (see transports.ts): by default
 * cuda-ipc and TCP, so on the holder's host the engine takes the same-host path.
 */
import net from 'node:net';
import { TransferEngine, silentLogger, type Registration } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { LockClient, decodeFetchDescriptor } from '@tensorwire/lock-client';
import { blockId, blockSeed, decodeRawPort } from './fetch-protocol.js';
import { gbps, nowMs, summarize } from './stats.js';
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
  signal?: AbortSignal;
  onProgress?: (doneMs: number, totalMs: number) => void;
}

export interface FetchResult {
  measurements: Measurement[];
  ratios: Ratio[];
  verificationFailures: number;
  notes: string[];
  fetches: number;
  failedFetches: number;
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
  const fetchMs: number[] = [];
  const lockMs: number[] = [];
  try {
    const lanes = await Promise.all(
      Array.from({ length: o.lanes }, async () => {
        const buffer = new Uint8Array(o.blockBytes * o.blocksPerFetch).fill(1);
        const local: Registration = await engine.register({ kind: 'host', buffer });
        return { buffer, local };
      }),
    );
    const start = nowMs();
    const end = start + o.durationMs;
    let lastProgress = 0;
    await Promise.all(
      lanes.map(async ({ buffer, local }) => {
        while (nowMs() < end && !o.signal?.aborted) {
          const chosen = pick(o.blocks, o.blocksPerFetch);
          const t0 = nowMs();
          try {
            // The library's fetch flow: lease + one range grant + one batched read + length checks.
            await using fetch = await client.fetch(
              engine,
              o.lockAddress,
              chosen.map(blockId),
              chosen.map((_, k) => ({ local, offset: k * o.blockBytes, length: o.blockBytes })),
              { timeoutMs: 5_000, ...(o.signal ? { signal: o.signal } : {}) },
            );
            const t1 = nowMs();
            fetchMs.push(t1 - t0);
            rawPort = decodeRawPort(fetch.lease.descriptorsFor(blockId(chosen[0] as number))[0]) ?? rawPort;
            if (!explained) {
              explained = true;
              const { endpoint } = decodeFetchDescriptor(fetch.lease.leaseDescriptors[0] as Uint8Array);
              const ex = engine.explain(endpoint);
              chosenTransport = ex.chosen;
              notes.push(`transport chosen: ${ex.chosen ?? 'none'} — ${ex.reason}`);
            }
            used.add(fetch.transport);
            chosen.forEach((i, k) => {
              if (Buffer.compare(buffer.subarray(k * o.blockBytes, (k + 1) * o.blockBytes), expected[i] as Uint8Array) !== 0) failures++;
            });
            buffer.fill(0);
            bytes += chosen.length * o.blockBytes;
            fetches++;
            const t2 = nowMs();
            await fetch.release();
            lockMs.push(nowMs() - t2);
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
      }),
    );
    const elapsed = nowMs() - start;
    const transport = [...used].join('+') || (chosenTransport ?? 'none');
    if (used.size > 0 && (used.size !== 1 || !used.has(chosenTransport as string))) notes.push(`transports the engine reported using: ${transport} (explain() said ${chosenTransport})  <-- MISMATCH`);
    const subject = 'leased fetch via client.fetch (lease + range grant + read; verify and release after)';
    const measurements: Measurement[] = [
      { name: subject, role: 'subject', transport, blockBytes: o.blockBytes, totalBytes: bytes, gbps: gbps(bytes, elapsed), opsPerSec: fetches / (elapsed / 1000), latency: summarize(fetchMs) },
      { name: 'lease release (gRPC round trip)', role: 'subject', latency: summarize(lockMs), opsPerSec: lockMs.length / (elapsed / 1000) },
    ];
    // Baselines, same processes, right after: the same bytes over a raw socket, and memcpy.
    const rawTotal = Math.max(bytes, o.blockBytes * 16);
    const raw = await rawStream(o.lockAddress.replace(/:\d+$/, ''), rawPort, rawTotal);
    measurements.push({ name: 'raw node:net stream', role: 'baseline', blockBytes: o.blockBytes, totalBytes: rawTotal, gbps: raw });
    const mc = memcpy(o.blockBytes, Math.min(rawTotal, 2 * 1024 ** 3));
    measurements.push({ name: 'memcpy (Buffer.copy)', role: 'baseline', blockBytes: o.blockBytes, totalBytes: Math.min(rawTotal, 2 * 1024 ** 3), gbps: mc });
    const ratios: Ratio[] = [
      { name: 'fetch/raw socket', subject, baseline: 'raw node:net stream', blockBytes: o.blockBytes, value: gbps(bytes, elapsed) / raw },
      { name: 'fetch/memcpy', subject, baseline: 'memcpy (Buffer.copy)', blockBytes: o.blockBytes, value: gbps(bytes, elapsed) / mc },
    ];
    notes.push(`${fetches} fetches of ${o.blocksPerFetch} random blocks of ${o.blockBytes} bytes over ${(elapsed / 1000).toFixed(1)} s on ${o.lanes} lanes; ${failedFetches} failed`);
    return { measurements, ratios, verificationFailures: failures, notes, fetches, failedFetches };
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
