/**
 * Requester half of the `kv` scenario. One engine per transport under test (the same-host
 * one is built with cuda-ipc and TCP and left to choose, unless `--transport cuda-ipc`; the
 * TCP one has only TCP), one destination buffer registered once with each, the holder's
 * pattern for verification, and a raw socket to the holder for the baseline.
 *
 * Each `measure` message names a fetch shape, a scatter seed and an order of methods; for
 * each method it runs untimed warm-up fetches (one if `warmupMs` is 0, else at least 20 and
 * more, up to 1,000, until they took `warmupMs`), then `fetches` timed fetches, one at a
 * time (more, up to 1,000, until they took `minMs`), and answers with the time spent inside
 * the timed calls and the time of the first warm-up call (what a fetch costs before the JIT
 * and the caches are warm).
 *
 * A `reread` message (kv --compare) measures the ucx_perftest ucp_get shape instead: one block
 * re-read from one remote offset into offset 0 of the destination, one post at a time (see
 * {@link reread}).
 *
 * Verification: the destination is zeroed before each method; before every timed fetch, the
 * first and last byte of 4 sampled descriptors are poisoned and after it those descriptors are
 * compared in full with the pattern at their remote offsets (outside the timed calls); after
 * the last fetch every descriptor is compared in full. Failures count descriptors. The memcpy
 * baseline, which copies out of the process-local pattern, is verified against the shared
 * segment's copy of it, so that verification never warms the source a fetch reads.
 *
 * argv: base64 JSON { endpoint, descriptor, rawPort, regionBytes, seed, maxRequestBytes, transport }
 */
import { readFileSync } from 'node:fs';
import net from 'node:net';
import { TcpTransport, TransferEngine, silentLogger, type PreparedTransfer, type Registration, type TransferRequest } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { allocateSharedMemory } from '@tensorwire/cuda-ipc';
import { LockClient, type LockGuard } from '@tensorwire/lock-client';
import { bytesOf, kvBlockId, kvSpace, rng, scatter, type KvMethod, type KvMethodResult, type KvRereadMethod, type KvRereadResult, type KvShape } from '../kv-shape.js';
import { workerInit } from '../proc.js';
import { nowMs, usedLocalLane, warmupTrend } from '../stats.js';
import { requesterTransports, type TransportChoice } from '../transports.js';

type KvLane = 'same-host' | 'tcp';

interface Config {
  endpoint: string;
  descriptor: string;
  rawPort: number;
  regionBytes: number;
  seed: number;
  maxRequestBytes: number;
  transport: TransportChoice;
  lockAddress: string;
}

const SAMPLES = 4;
/** Most timed fetches of one method in one measurement, whatever minMs asks. */
const MAX_FETCHES = 1000;
/** Each measurement runs timed fetches until they took at least this long (the `measure` message sets it). */
let minMs = 0;
/** Untimed fetches before the timed ones add up to at least this long (the `measure` message sets it). */
let warmupMs = 0;
/** Fewest warm-up calls when warmupMs > 0. */
const WARMUP_CALLS = 20;
const ipc = workerInit();
const cfg = JSON.parse(Buffer.from(process.argv[2] as string, 'base64').toString('utf8')) as Config;
const endpoint = new Uint8Array(Buffer.from(cfg.endpoint, 'base64'));
const descriptor = new Uint8Array(Buffer.from(cfg.descriptor, 'base64'));
const expectedBytes = pattern(cfg.regionBytes, cfg.seed);
const expected = Buffer.from(expectedBytes.buffer, expectedBytes.byteOffset, expectedBytes.byteLength);
// The same pattern in shared memory of this process too (a segment like the holder's): shared
// segments get no transparent huge pages here, process heap may, so copies out of them differ.
const shmExpected = (() => {
  try {
    const b = allocateSharedMemory(cfg.regionBytes, `kv-requester-${process.pid}`);
    b.set(expectedBytes);
    return Buffer.from(b.buffer, b.byteOffset, b.byteLength);
  } catch {
    return undefined;
  }
})();
const destBytes = new Uint8Array(cfg.maxRequestBytes);
destBytes.fill(1); // fault the pages in before anything is timed
const dest = Buffer.from(destBytes.buffer, destBytes.byteOffset, destBytes.byteLength);

interface Lane {
  readonly engine: TransferEngine;
  readonly reg: Registration;
  readonly transport: string;
}
const lanes = new Map<KvLane, Lane>();
const client = new LockClient({ requesterId: 'kv-requester', logger: silentLogger });
/** The same flow with every lease call unary (the way before the Session stream): the baseline of the leased rows. */
const unaryClient = new LockClient({ requesterId: 'kv-requester-unary', session: false, logger: silentLogger });
/** The same flow with the Session messages on the gRPC stream even on one host (no local lane): what the lane saves. */
const streamClient = new LockClient({ requesterId: 'kv-requester-stream', localLane: false, logger: silentLogger });
const notes: string[] = [];

async function lane(name: KvLane, nodeId: string, transports: TransferEngine['transports']): Promise<void> {
  const engine = new TransferEngine({ nodeId, transports, logger: silentLogger });
  await engine.start();
  const ex = engine.explain(endpoint, 'host');
  notes.push(`${name} engine (${engine.transports.map((t) => t.name).join(', ')}): transport chosen: ${ex.chosen ?? 'none'} — ${ex.reason}`);
  if (ex.chosen === undefined || (name === 'same-host' && ex.chosen !== 'cuda-ipc')) {
    notes.push(`${name} rows left out: the engine did not choose the same-host transport`);
    await engine.close();
    return;
  }
  const reg = await engine.register({ kind: 'host', buffer: destBytes });
  lanes.set(name, { engine, reg, transport: ex.chosen });
}

// Raw baseline socket: receives straight into the destination (Node's cheapest receive path).
const SLICE = 4 * 1024 * 1024;
let rawWant = 0;
let rawGot = 0;
let rawDone: (() => void) | undefined;
let rawFailed: ((e: Error) => void) | undefined;
let rawSocket: net.Socket | undefined;

function connectRaw(): Promise<net.Socket> {
  return new Promise<net.Socket>((resolve, reject) => {
    const s = net.connect({
      host: '127.0.0.1',
      port: cfg.rawPort,
      noDelay: true,
      onread: {
        // Node asks for the next read's buffer right after a read completes, so between fetches
        // it hands out the start of the destination: where the next fetch's first bytes go.
        buffer: () => {
          const at = rawGot < rawWant ? rawGot : 0;
          return dest.subarray(at, at + SLICE);
        },
        callback: (n: number) => {
          rawGot += n;
          if (rawGot >= rawWant && rawDone) {
            const done = rawDone;
            rawDone = undefined;
            done();
          }
          return true;
        },
      },
    });
    s.once('connect', () => resolve(s));
    s.once('error', reject);
  });
}

/** How much of this process's memory (its heap baseline, its shared segments) is in huge pages, from /proc/self/smaps_rollup. */
function hugePagesHeld(): string {
  try {
    const rollup = readFileSync('/proc/self/smaps_rollup', 'utf8');
    const kb = (field: string): string => new RegExp(`^${field}:\\s+(\\d+) kB`, 'm').exec(rollup)?.[1] ?? '?';
    return `requester memory in huge pages once its buffers are filled: AnonHugePages ${kb('AnonHugePages')} kB (process heap, where the memcpy baseline copies from), ShmemPmdMapped ${kb('ShmemPmdMapped')} kB (shared segments), of ${kb('Rss')} kB resident`;
  } catch {
    return 'requester huge pages unknown (no /proc/self/smaps_rollup)';
  }
}

async function setup(): Promise<void> {
  notes.push(hugePagesHeld());
  if (cfg.transport !== 'tcp') {
    const built = requesterTransports(cfg.transport === 'cuda-ipc' ? 'cuda-ipc' : 'auto');
    notes.push(...built.notes);
    await lane('same-host', 'kv-requester', built.transports);
  }
  if (cfg.transport !== 'cuda-ipc') await lane('tcp', 'kv-requester-tcp', [new TcpTransport()]);
  const s = await connectRaw();
  s.on('error', (e) => rawFailed?.(e));
  s.on('close', () => rawFailed?.(new Error('raw baseline socket closed')));
  rawSocket = s;
}

function rawFetch(bytes: number, offset: number): Promise<void> {
  return new Promise((resolve, reject) => {
    rawWant = bytes;
    rawGot = 0;
    rawDone = resolve;
    rawFailed = reject;
    const req = Buffer.alloc(16);
    req.writeBigUInt64BE(BigInt(bytes), 0);
    req.writeBigUInt64BE(BigInt(offset), 8);
    (rawSocket as net.Socket).write(req);
  });
}

/** Descriptor i of a fetch lands at i * blockBytes and comes from remote offset `offsets[i]`; `reference` holds the pattern. */
function sameBytes(i: number, offsets: Float64Array, s: number, reference: Buffer): boolean {
  const ro = offsets[i] as number;
  return dest.compare(reference, ro, ro + s, i * s, (i + 1) * s) === 0;
}

/**
 * Runs `once` untimed, then `fetches` times timed, verifying samples after each. `reference`
 * is what the bytes are compared with: never the buffer a baseline copies from, or the
 * comparison after each fetch would leave that baseline's source in the caches for its next
 * fetch (at 4 MiB × 1 that made memcpy out of the heap read at about 46 GB/s against 35 GB/s
 * out of a shared segment, which a loop without verification reads at the same speed).
 */
async function timed(
  offsets: Float64Array,
  s: number,
  fetches: number,
  random: () => number,
  once: () => Promise<{ transport: string } | void> | void,
  reference: Buffer = expected,
  before?: () => Promise<number>,
): Promise<Omit<KvMethodResult, 'method'> & { beforeMs?: number; beforeBytes?: number }> {
  const count = offsets.length;
  dest.fill(0, 0, count * s);
  // Warm-up, untimed: one fetch, or (warmupMs > 0) at least WARMUP_CALLS and more until they
  // took warmupMs. A long-running server fetches all day; a handful of calls measures V8's
  // interpreter on the lease path (client.fetch of 1,024 × 64 KiB blocks: the first call took
  // about 340 ms, the next ten 14 to 27 ms each, the ones after 50 about 6.6 ms).
  await before?.();
  let w0 = nowMs();
  await once();
  const firstMs = nowMs() - w0;
  let warm = firstMs;
  let warmupCalls = 1;
  for (; warmupMs > 0 && (warm < warmupMs || warmupCalls < WARMUP_CALLS) && warmupCalls < MAX_FETCHES; warmupCalls++) {
    await before?.();
    w0 = nowMs();
    await once();
    warm += nowMs() - w0;
  }
  let beforeMs = 0;
  let beforeBytes = 0;
  const latencies: number[] = [];
  const sample = new Int32Array(Math.min(SAMPLES, count));
  let ms = 0;
  let failures = 0;
  let transport: string | undefined;
  let done = 0;
  // At least `fetches`, and more (up to MAX_FETCHES) until the timed calls add up to minMs: a
  // measurement of a few milliseconds is mostly the noise of a shared machine.
  for (let f = 0; f < fetches || (ms < minMs && f < MAX_FETCHES); f++, done++) {
    if (before) {
      // The per-call baseline (alternating methods), timed on its own, before this call's
      // samples are poisoned (it writes the same destination).
      const b0 = nowMs();
      beforeBytes += await before();
      beforeMs += nowMs() - b0;
    }
    for (let j = 0; j < sample.length; j++) {
      const i = count <= SAMPLES ? j : Math.floor(random() * count);
      sample[j] = i;
      const ro = offsets[i] as number;
      dest[i * s] = (reference[ro] as number) ^ 0xff;
      dest[(i + 1) * s - 1] = (reference[ro + s - 1] as number) ^ 0xff;
    }
    const t0 = nowMs();
    const r = await once();
    const dt = nowMs() - t0;
    ms += dt;
    latencies.push(dt);
    if (r) transport = r.transport;
    for (let j = 0; j < sample.length; j++) if (!sameBytes(sample[j] as number, offsets, s, reference)) failures++;
  }
  for (let i = 0; i < count; i++) if (!sameBytes(i, offsets, s, reference)) failures++;
  return { ms, fetches: done, bytes: done * count * s, descriptors: done * count, latencies, failures, firstMs, warmupCalls, ...(before ? { beforeMs, beforeBytes } : {}), ...(transport !== undefined ? { transport } : {}) };
}

/** Descriptor i of the fetch from remote offset `offsets[i]` of the holder's registration into i × s of the lane's destination. */
function engineRequests(l: Lane, offsets: Float64Array, s: number): TransferRequest[] {
  const requests: TransferRequest[] = [];
  for (let i = 0; i < offsets.length; i++) requests.push({ local: l.reg, localOffset: i * s, remote: descriptor, remoteOffset: offsets[i] as number, length: s });
  return requests;
}

/** The same fetch as leased blocks: by number in the holder's space of `s`-byte blocks, and block i's destination. */
function leasedBlocks(l: Lane, offsets: Float64Array, s: number): { blocks: { owner: string; numbers: Uint32Array }; destinations: { local: Registration; offset: number; length: number }[] } {
  const numbers = new Uint32Array(offsets.length);
  const destinations: { local: Registration; offset: number; length: number }[] = [];
  for (let i = 0; i < offsets.length; i++) {
    numbers[i] = (offsets[i] as number) / s;
    destinations.push({ local: l.reg, offset: i * s, length: s });
  }
  return { blocks: { owner: kvSpace(s), numbers }, destinations };
}

/** Variants of the leased fetch: blocks by id strings; the release's answer inside the timed call; an engine.read before each fetch. */
interface LeasedVariant {
  readonly byId?: boolean;
  readonly awaitRelease?: boolean;
  readonly alternate?: boolean;
}

/**
 * Leased: the library's fetch flow per fetch: acquire + one grant + one batched read, then
 * disposal (the release is queued; its answer is awaited outside the timed calls and must be
 * a confirmation for every lease).
 * The blocks by number in the holder's space of `s`-byte blocks, or (`byId`) by id strings.
 */
async function runLeased(l: Lane, offsets: Float64Array, s: number, fetches: number, random: () => number, client: LockClient, variant: LeasedVariant = {}): Promise<Omit<KvMethodResult, 'method'>> {
  const { byId = false, awaitRelease = false, alternate = false } = variant;
  const numbered = leasedBlocks(l, offsets, s);
  const destinations = numbered.destinations;
  const blocks = byId ? Array.from(offsets, (o) => kvBlockId(o, s)) : numbered.blocks;
  const fetchMs: number[] = [];
  const releaseMs: number[] = [];
  const confirmMs: number[] = [];
  const releases: Promise<void>[] = [];
  const unconfirmed: string[] = [];
  // Alternating: an engine.read of the same blocks (through the holder's registration
  // descriptor) right before every fetch, so each fetch starts the way one in a busy process
  // does: after other work, with its code and data out of the caches.
  const reads = alternate ? engineRequests(l, offsets, s) : [];
  const before = alternate ? async (): Promise<number> => (await l.engine.read(endpoint, reads)).bytes : undefined;
  const r = await timed(offsets, s, fetches, random, async () => {
    const t0 = nowMs();
    const f = await client.fetch(l.engine, cfg.lockAddress, blocks, destinations, { timeoutMs: 10_000 });
    const t1 = nowMs();
    // What `await using` does: disposal queues the release and returns (release never blocks a
    // fetch); or (awaitRelease) the holder's answer inside the timed call, the way before.
    if (awaitRelease) await f.release();
    else await f[Symbol.asyncDispose]();
    const t2 = nowMs();
    fetchMs.push(t1 - t0);
    releaseMs.push(t2 - t1);
    // The same release (idempotent): its answer, outside the timed call.
    releases.push(
      f.release().then((res) => {
        confirmMs.push(nowMs() - t1);
        if (!res.confirmed) unconfirmed.push(`lease ${f.lease.sessionId}: ${res.error?.message ?? 'not confirmed'}`);
      }),
    );
    return { transport: f.transport };
  }, expected, before);
  await Promise.all(releases);
  // Every lease of the method was released and the holder said so: none left to its expiry GC.
  if (unconfirmed.length > 0) throw new Error(`${unconfirmed.length} of ${releases.length} releases were not confirmed: ${unconfirmed.slice(0, 3).join('; ')}`);
  // The timed fetches are the last ones (the warm-up came first).
  const med = (x: number[]): number => x.slice(-r.fetches).sort((a, b) => a - b)[Math.floor(Math.min(x.length, r.fetches) / 2)] as number;
  const { beforeMs = 0, beforeBytes = 0, ...rest } = r;
  return { ...rest, leaseSplit: { fetchMs: med(fetchMs), releaseMs: med(releaseMs), confirmMs: med(confirmMs) }, ...(alternate ? { pairedReadMs: beforeMs, pairedReadBytes: beforeBytes } : {}) };
}

/**
 * Pipelined: the same leased fetches, each one's lease acquired during the previous fetch's
 * read (`client.acquire` of the next fetch's blocks, then `client.fetchLease` of this one's
 * lease), so the holder grants the next lease while this one copies. The first (untimed) call
 * acquires its own lease; the lease acquired for a fetch that never comes is released at the
 * end. Every release's answer is awaited after the loop and must confirm it.
 */
async function runPipelined(l: Lane, offsets: Float64Array, s: number, fetches: number, random: () => number): Promise<Omit<KvMethodResult, 'method'>> {
  const { blocks, destinations } = leasedBlocks(l, offsets, s);
  const acquire = (): Promise<LockGuard> => client.acquire(cfg.lockAddress, blocks, { timeoutMs: 10_000 });
  let next: Promise<LockGuard> | undefined;
  const releases: Promise<boolean>[] = [];
  let result: Omit<KvMethodResult, 'method'> | undefined;
  let failure: unknown;
  try {
    result = await timed(offsets, s, fetches, random, async () => {
      const lease = await (next ?? acquire());
      next = acquire();
      next.catch(() => undefined); // awaited by the next fetch; a failure is not unhandled meanwhile
      const f = await client.fetchLease(l.engine, lease, destinations);
      await f[Symbol.asyncDispose]();
      releases.push(f.release().then((res) => res.confirmed));
      return { transport: f.transport };
    });
  } catch (e) {
    failure = e;
  }
  // The lease acquired for a fetch that never came, then every release's answer.
  const last = await next?.catch(() => undefined);
  if (last) releases.push(last.release().then((res) => res.confirmed));
  const confirmed = await Promise.all(releases);
  if (failure !== undefined || result === undefined) throw failure;
  const missing = confirmed.filter((c) => !c).length;
  if (missing > 0) throw new Error(`${missing} of ${confirmed.length} pipelined releases were not confirmed`);
  return result;
}

async function runEngine(l: Lane, prepared: boolean, offsets: Float64Array, s: number, fetches: number, random: () => number): Promise<Omit<KvMethodResult, 'method'>> {
  const requests = engineRequests(l, offsets, s);
  if (!prepared) return timed(offsets, s, fetches, random, () => l.engine.read(endpoint, requests));
  const t0 = nowMs();
  const p: PreparedTransfer = await l.engine.prepare(endpoint, requests, { op: 'read' });
  const prepareMs = nowMs() - t0;
  try {
    return { ...(await timed(offsets, s, fetches, random, () => p.run())), prepareMs, ranges: p.ranges };
  } finally {
    await p.close();
  }
}

async function measure(shape: KvShape, seed: number, fetches: number, order: readonly KvMethod[]): Promise<KvMethodResult[]> {
  const offsets = scatter(shape, cfg.regionBytes, rng(seed));
  const s = shape.blockBytes;
  const count = offsets.length;
  const bytes = bytesOf(shape);
  const random = rng(seed ^ 0x5bd1e995);
  const out: KvMethodResult[] = [];
  for (const method of order) {
    let r: Omit<KvMethodResult, 'method'>;
    if (method === 'memcpy' || method === 'memcpy-shm') {
      const src = method === 'memcpy' ? expected : shmExpected;
      if (!src) throw new Error('no shared memory in this process for the memcpy-shm baseline');
      // Verified against the other copy of the pattern (see timed()).
      const reference = method === 'memcpy' ? (shmExpected ?? expected) : expected;
      r = await timed(
        offsets,
        s,
        fetches,
        random,
        () => {
          for (let i = 0; i < count; i++) {
            const ro = offsets[i] as number;
            src.copy(dest, i * s, ro, ro + s);
          }
        },
        reference,
      );
    } else if (method === 'raw') {
      // The same byte count from the same region, as one contiguous run (no per-descriptor work).
      const offset = Math.floor(random() * Math.floor((cfg.regionBytes - bytes) / s + 1)) * s;
      const contiguous = new Float64Array(count);
      for (let i = 0; i < count; i++) contiguous[i] = offset + i * s;
      r = await timed(contiguous, s, fetches, random, () => rawFetch(bytes, offset));
    } else {
      const laneName: KvLane = method.startsWith('tcp') ? 'tcp' : 'same-host';
      const l = lanes.get(laneName);
      if (!l) throw new Error(`no ${method} lane in this run`);
      // What follows the lane in the method's name: prepared, read, leased, leased-<variant>.
      const kind = method.slice(laneName.length + 1);
      switch (kind) {
        case 'leased':
          r = await runLeased(l, offsets, s, fetches, random, client);
          break;
        case 'leased-unary':
          r = await runLeased(l, offsets, s, fetches, random, unaryClient);
          break;
        case 'leased-stream':
          r = await runLeased(l, offsets, s, fetches, random, streamClient);
          break;
        case 'leased-ids':
          r = await runLeased(l, offsets, s, fetches, random, client, { byId: true });
          break;
        case 'leased-awaited':
          r = await runLeased(l, offsets, s, fetches, random, client, { awaitRelease: true });
          break;
        case 'leased-alternating':
          r = await runLeased(l, offsets, s, fetches, random, client, { alternate: true });
          break;
        case 'leased-pipelined':
          r = await runPipelined(l, offsets, s, fetches, random);
          break;
        default:
          r = await runEngine(l, kind === 'prepared', offsets, s, fetches, random);
      }
    }
    out.push({ method, ...r });
  }
  return out;
}

/**
 * The ucx_perftest ucp_get shape (see KvRereadMethod): `size` bytes from `remoteOffset` into
 * offset 0 of the destination, `warmup` untimed posts, then `iterations` posts timed as one loop.
 * Before every timed post the first and last byte of the destination are poisoned and after it
 * they are checked (a few ns, inside the loop); after the loop the block is compared in full.
 */
async function reread(method: KvRereadMethod, size: number, remoteOffset: number, iterations: number, warmup: number, jitWarmupMs = 0): Promise<KvRereadResult> {
  let post: () => Promise<unknown> | void;
  let close: () => Promise<void> = () => Promise.resolve();
  let transport: string | undefined;
  if (method === 'memcpy-shm-reread') {
    const src = shmExpected;
    if (!src) throw new Error('no shared memory in this process for the memcpy-shm baseline');
    post = () => {
      src.copy(dest, 0, remoteOffset, remoteOffset + size);
    };
  } else {
    const l = lanes.get(method === 'tcp-reread' ? 'tcp' : 'same-host');
    if (!l) throw new Error(`no ${method} lane in this run`);
    const p = await l.engine.prepare(endpoint, [{ local: l.reg, localOffset: 0, remote: descriptor, remoteOffset, length: size }], { op: 'read' });
    transport = p.transport;
    post = () => p.run();
    close = () => p.close();
  }
  const first = expected[remoteOffset] as number;
  const last = expected[remoteOffset + size - 1] as number;
  let failures = 0;
  try {
    dest.fill(0, 0, size);
    // Untimed posts until jitWarmupMs passed (the kv methods' warm-up: compiled code), then the UCX run's own warm-up count.
    for (const until = nowMs() + jitWarmupMs; nowMs() < until; ) await post();
    for (let i = 0; i < warmup; i++) await post();
    const t0 = nowMs();
    for (let i = 0; i < iterations; i++) {
      dest[0] = first ^ 0xff;
      dest[size - 1] = last ^ 0xff;
      await post();
      if (dest[0] !== first || dest[size - 1] !== last) failures++;
    }
    const ms = nowMs() - t0;
    if (dest.compare(expected, remoteOffset, remoteOffset + size, 0, size) !== 0) failures++;
    return { method, ms, iterations, bytes: iterations * size, failures, ...(transport !== undefined ? { transport } : {}) };
  } finally {
    await close();
  }
}

/**
 * The lease path brought to steady state before anything is measured: `cycles` leased fetches
 * of one `blockBytes` block (acquire, grant, read, disposal) per lane through the Session
 * client, half as many through the unary client, and a quarter by id on the same-host lane.
 * A long-running server has made thousands of these calls; V8 needs about that many before
 * @grpc/grpc-js, the lock client and the holder run optimized code (an acquire of 1,024 blocks
 * went from about 1.0 ms in its first 500 calls to about 0.25 ms after 3,000 on this machine),
 * and the per-method warm-up (300 ms) makes a few dozen. Returns, per lane and client, the
 * median of the first and of the last 100 calls.
 */
async function warmLeases(cycles: number, blockBytes: number): Promise<{ ms: number; fetches: number; rows: string[] }> {
  const t0 = nowMs();
  const rows: string[] = [];
  let fetches = 0;
  const runs: { lane: KvLane; l: Lane; who: string; c: LockClient; n: number; byId: boolean }[] = [];
  for (const [name, l] of lanes) {
    runs.push({ lane: name, l, who: 'Session stream', c: client, n: cycles, byId: false });
    runs.push({ lane: name, l, who: 'unary calls', c: unaryClient, n: Math.ceil(cycles / 2), byId: false });
    if (name === 'same-host') {
      runs.push({ lane: name, l, who: 'Session stream with localLane: false', c: streamClient, n: Math.ceil(cycles / 2), byId: false });
      runs.push({ lane: name, l, who: 'blocks by id', c: client, n: Math.ceil(cycles / 4), byId: true });
    }
  }
  const slots = Math.floor(cfg.regionBytes / blockBytes);
  for (const r of runs) {
    const destinations = [{ local: r.l.reg, offset: 0, length: blockBytes }];
    const times: number[] = [];
    const releases: Promise<boolean>[] = [];
    let unconfirmed = 0;
    const settle = async (): Promise<void> => {
      for (const ok of await Promise.all(releases.splice(0))) if (!ok) unconfirmed++;
    };
    for (let i = 0; i < r.n; i++) {
      const n = (i * 7919) % slots;
      const blocks = r.byId ? [kvBlockId(n * blockBytes, blockBytes)] : { owner: kvSpace(blockBytes), numbers: Uint32Array.of(n) };
      const a = nowMs();
      const f = await r.c.fetch(r.l.engine, cfg.lockAddress, blocks, destinations, { timeoutMs: 10_000 });
      times.push(nowMs() - a);
      await f[Symbol.asyncDispose]();
      releases.push(f.release().then((res) => res.confirmed));
      // Bounded: the holder's live leases stay few.
      if (releases.length >= 64) await settle();
      fetches++;
    }
    await settle();
    // Like every leased method's: each release confirmed by the holder, none left to its GC.
    if (unconfirmed > 0) throw new Error(`lease path warm-up: ${unconfirmed} of ${r.n} releases (${r.lane}, ${r.who}) were not confirmed`);
    const st = r.c.sessionStats().get(cfg.lockAddress);
    const via = st === undefined ? '' : usedLocalLane(st) ? " (over the holder's local lane)" : ' (over gRPC)';
    rows.push(`${r.lane} ${r.who}${via}: ${r.n} fetches, ${warmupTrend(times)}`);
  }
  return { ms: nowMs() - t0, fetches, rows };
}

ipc.onMessage((m) => {
  const run = async (): Promise<void> => {
    if (m['type'] === 'stop') {
      rawSocket?.destroy();
      await Promise.all([client.close(), unaryClient.close(), streamClient.close()]);
      await Promise.allSettled([...lanes.values()].map((l) => l.engine.close()));
      process.exit(0);
    }
    if (m['type'] === 'reread') {
      const results: KvRereadResult[] = [];
      for (const method of m['order'] as KvRereadMethod[]) results.push(await reread(method, Number(m['blockBytes']), Number(m['remoteOffset']), Number(m['iterations']), Number(m['warmup']), Number(m['warmupMs'] ?? 0)));
      ipc.send({ type: 'result', id: m['id'], results });
      return;
    }
    if (m['type'] === 'warm-leases') {
      const r = await warmLeases(Number(m['cycles']), Number(m['blockBytes']));
      ipc.send({ type: 'result', id: m['id'], ...r });
      return;
    }
    if (m['type'] !== 'measure') return;
    minMs = Number(m['minMs'] ?? 0);
    warmupMs = Number(m['warmupMs'] ?? 0);
    const results = await measure(m['shape'] as KvShape, Number(m['seed']), Number(m['fetches']), m['order'] as KvMethod[]);
    ipc.send({ type: 'result', id: m['id'], results });
  };
  run().catch((e: unknown) => ipc.send({ type: 'error', id: m['id'], message: e instanceof Error ? e.message : String(e) }));
});
try {
  await setup();
  ipc.send({ type: 'ready', lanes: [...lanes.keys()], transports: Object.fromEntries([...lanes].map(([k, l]) => [k, l.transport])), notes });
} catch (e) {
  await ipc.sent({ type: 'error', message: e instanceof Error ? e.message : String(e) });
  process.disconnect?.();
}
