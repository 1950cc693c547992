import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { afterEach, describe, expect, it } from 'vitest';
import { silentLogger } from '../src/logger.js';
import { pattern } from '../src/testing/pattern.js';
import { TcpTransport, type TcpTransportOptions } from '../src/tcp/transport.js';
import { createTransferBatch, type NodeIdentity, type TransportConnection } from '../src/transport.js';
import { rawPeerProcess, type RawPeerSocketResult } from './helpers/raw-peer.js';

/**
 * Issue 19, parts 1 and 2, with real processes: a victim holder process (fixtures/bounded-holder.mjs)
 * measures its own memory; hostile peers are raw-socket processes (fixtures/raw-flooder.mjs); the
 * honest requester is this process, verifying every byte it reads.
 */

const HOLDER = fileURLToPath(new URL('./fixtures/bounded-holder.mjs', import.meta.url));
const SIZE = 1 << 20;
const MiB = 1024 * 1024;
const expected = pattern(SIZE, 99);

interface Ready {
  port: number;
  identity: NodeIdentity;
  endpoint: string;
  token: string;
  grantToken: string;
  memory: { heapUsed: number; rss: number };
}
export interface HolderStats {
  memory: { heapUsed: number; rss: number; arrayBuffers: number };
  peak: { heapUsed: number; rss: number; arrayBuffers: number };
  inbound: number;
  connections: number;
  sockets: number;
  counts: Record<string, number>;
  peers: Record<string, unknown>;
  usage: unknown[];
  users: { registration: number; grant: number };
  grantCount: number;
  events: { level: string; message: string; event?: string; peer?: string }[];
}

const children: ChildProcess[] = [];
const closers: (() => Promise<void>)[] = [];
afterEach(async () => {
  await Promise.allSettled(closers.splice(0).map((c) => c()));
  for (const c of children.splice(0)) c.kill('SIGKILL');
});

export async function startHolder(options: TcpTransportOptions): Promise<{ child: ChildProcess; ready: Ready; stats: (peers?: string[]) => Promise<HolderStats> }> {
  const child = fork(HOLDER, [JSON.stringify(options), String(SIZE)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'], execArgv: ['--expose-gc'] });
  children.push(child);
  const ready = await new Promise<Ready>((resolve, reject) => {
    child.once('exit', (code, sig) => reject(new Error(`holder exited early: ${code ?? sig}`)));
    child.on('message', (m: Ready & { type: string }) => {
      if (m.type === 'ready') resolve(m);
    });
  });
  let n = 0;
  const stats = (peers: string[] = []): Promise<HolderStats> =>
    new Promise((resolve, reject) => {
      const tag = ++n;
      const onMessage = (m: HolderStats & { type: string; tag: number }): void => {
        if (m.type !== 'stats' || m.tag !== tag) return;
        child.off('message', onMessage);
        resolve(m);
      };
      child.on('message', onMessage);
      child.once('exit', (code, sig) => reject(new Error(`holder died: ${code ?? sig}`)));
      child.send({ type: 'stats', tag, peers });
    });
  return { child, ready, stats };
}

/** An honest requester in this process: reads the registration and the grant, checks every byte. */
export async function honest(ready: Ready, name: string): Promise<{ read: () => Promise<void>; conn: TransportConnection; t: TcpTransport; close: () => Promise<void> }> {
  const t = new TcpTransport();
  await t.start({ identity: { nodeId: name, incarnation: `${name}1`, hostId: 'h1' }, logger: silentLogger, inbound: () => undefined });
  const conn = await t.connect(ready.identity, new Uint8Array(Buffer.from(ready.endpoint, 'base64')), { streams: 2, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
  const dst = new Uint8Array(3 * 65536);
  const local = (await t.register({ kind: 'host', buffer: dst })).handle;
  const whole = t.decodeRemote(new Uint8Array(Buffer.from(ready.token, 'base64')), 'host', SIZE);
  const half = t.decodeRemote(new Uint8Array(Buffer.from(ready.grantToken, 'base64')), 'host', SIZE / 2, Float64Array.of(SIZE / 2));
  let round = 0;
  const read = async (): Promise<void> => {
    const a = (round++ * 4099) % (SIZE / 2 - 65536);
    dst.fill(0);
    const batch = createTransferBatch('read', [
      { local, localOffset: 0, remote: whole, remoteOffset: a, length: 65536 },
      { local, localOffset: 65536, remote: half, remoteOffset: a, length: 65536 },
      // Small ranges too: the path that copies into a reply buffer.
      ...Array.from({ length: 64 }, (_, i) => ({ local, localOffset: 131072 + i * 512, remote: whole, remoteOffset: a + i * 700, length: 512 })),
    ]);
    await conn.execute(round % 2, batch, { signal: AbortSignal.timeout(15_000), deadline: Date.now() + 15_000 });
    expect(Buffer.compare(dst.subarray(0, 65536), expected.subarray(a, a + 65536))).toBe(0);
    expect(Buffer.compare(dst.subarray(65536, 131072), expected.subarray(SIZE / 2 + a, SIZE / 2 + a + 65536))).toBe(0);
    for (let i = 0; i < 64; i++) expect(Buffer.compare(dst.subarray(131072 + i * 512, 131072 + (i + 1) * 512), expected.subarray(a + i * 700, a + i * 700 + 512))).toBe(0);
  };
  const close = (): Promise<void> => t.close();
  closers.push(close);
  return { read, conn, t, close };
}

/** Read in a loop until `done` settles; every read is verified. Resolves with how many were. */
export async function readWhile(read: () => Promise<void>, done: Promise<unknown>): Promise<number> {
  let over = false;
  void done.finally(() => (over = true)).catch(() => undefined);
  let n = 0;
  while (!over || n < 3) {
    await read();
    n++;
  }
  return n;
}

/** Holder stats once `ok` holds (sockets the peers closed take a moment to close here too). */
export async function statsWhen(h: { stats: (peers?: string[]) => Promise<HolderStats> }, ok: (s: HolderStats) => boolean, peers?: string[]): Promise<HolderStats> {
  for (let i = 0; ; i++) {
    const s = await h.stats(peers);
    if (ok(s) || i >= 100) return s;
    await new Promise((r) => setTimeout(r, 50));
  }
}

const tok = (r: Ready, grant = false): Uint8Array => new Uint8Array(Buffer.from(grant ? r.grantToken : r.token, 'base64'));
const target = (r: Ready): { port: number; id: NodeIdentity } => ({ port: r.port, id: r.identity });

describe('tcp responder under hostile peers (real processes)', () => {
  it('flooders that handshake, flood READV/WRITEV and never read are cut off at the per-peer bound; the holder\'s memory stays within it and honest reads are served and verified meanwhile', async () => {
    const limits = { maxChunkBytes: MiB, sendHighWaterMark: 256 * 1024, maxQueuedRequests: 1_000_000, maxQueuedRequestBytes: 2 * MiB };
    const h = await startHolder(limits);
    const before = await h.stats();
    const good = await honest(h.ready, 'honest');
    await good.read();
    // Four hostile peers, two connections each; 100,000 requests per connection (800,000 in all,
    // as in the attack): unbounded, their queues alone would hold ~190 bytes x 800,000 = 150 MB.
    const modes = ['readv', 'readv-copy', 'readv-bad', 'writev'] as const;
    const flood = Promise.all(modes.map((mode, i) => rawPeerProcess(target(h.ready), tok(h.ready, i % 2 === 1), { nodeId: `flood-${mode}`, mode, connections: 2, requests: 100_000, base: i % 2 === 1 ? SIZE / 2 : 0 }, children)));
    const reads = await readWhile(good.read, flood);
    const results = (await flood).flat();

    // Closed flooder sockets give their zero-copy replies back (and with them their use of the
    // grant) as the holder finishes tearing them down: wait for that too, so a use that is never
    // given back still fails below.
    const during = await statsWhen(h, (x) => x.inbound === 1 && x.users.grant === 0 && x.users.registration === 0, modes.map((m) => `flood-${m}`));
    // The bound: per peer, its queue plus its replies in flight plus one reply; generous slack.
    const bound = modes.length * (limits.maxQueuedRequestBytes + limits.sendHighWaterMark + limits.maxChunkBytes);
    const heapGrowth = during.peak.heapUsed + during.peak.arrayBuffers - (before.memory.heapUsed + before.memory.arrayBuffers);
    const rssGrowth = during.peak.rss - before.memory.rss;
    console.log(`holder memory under flood: heap+arrayBuffers +${(heapGrowth / MiB).toFixed(1)} MiB, rss +${(rssGrowth / MiB).toFixed(1)} MiB (bound ${(bound / MiB).toFixed(1)} MiB); ${reads} honest reads verified`);
    expect(heapGrowth).toBeLessThan(bound + 32 * MiB);
    expect(rssGrowth).toBeLessThan(bound + 64 * MiB);
    // Every hostile connection was closed by the holder, for its queue.
    expect(results.map((r: RawPeerSocketResult) => r.closedByPeer)).toEqual(results.map(() => true));
    expect(during.counts['request_queue']).toBe(8);
    const warned = new Set(during.events.filter((e) => e.level === 'warn' && e.event === 'request_queue').map((e) => e.peer));
    expect(warned.size).toBeGreaterThan(0);
    for (const p of warned) expect(p).toMatch(/^flood-/);
    // Honest reads went on, verified, on a connection that is still open.
    expect(reads).toBeGreaterThanOrEqual(3);
    expect(good.conn.isOpen).toBe(true);
    await good.read();
    // Accounting: no flooder holds anything, no grant is still in use, the honest peer is the one inbound left.
    expect(during.usage).toEqual(modes.map(() => null));
    expect(during.users).toEqual({ registration: 0, grant: 0 });
    expect(during.grantCount).toBe(before.grantCount);
    expect(during.inbound).toBe(1);
    await good.close();
    const after = await statsWhen(h, (x) => x.sockets === 0, ['honest']);
    expect(after.usage).toEqual([null]);
    expect(after.inbound).toBe(0);
    expect(after.sockets).toBe(0);
  });

  it('fifty idle handshaken peers are retired after idleTimeoutMs; a paused reader with replies in flight and an active honest peer are not', async () => {
    const h = await startHolder({ idleTimeoutMs: 700, retireTimeoutMs: 800, sendHighWaterMark: 256 * 1024 });
    const good = await honest(h.ready, 'honest');
    // 200 replies of 64 KiB (more than the socket buffers hold), then 2.5 s without reading: no
    // traffic, but replies in flight, so the idle rule must leave it alone.
    const stall = rawPeerProcess(target(h.ready), tok(h.ready), { nodeId: 'slow', mode: 'stall', requests: 200, length: 65536, pauseMs: 2500 }, children);
    const idle = rawPeerProcess(target(h.ready), tok(h.ready), { nodeId: 'sleeper', distinct: true, mode: 'idle', connections: 50, ms: 15_000 }, children);
    const both = Promise.all([stall, idle]);
    const reads = await readWhile(async () => {
      await good.read();
      await new Promise((r) => setTimeout(r, 50));
    }, both);
    const [[slow], sleepers] = await both;
    expect(sleepers).toHaveLength(50);
    for (const s of sleepers) expect(s).toMatchObject({ acked: true, goaway: true, closedByPeer: true });
    expect(slow).toMatchObject({ replies: 200, verified: 200, closedByPeer: false });
    const s = await statsWhen(h, (x) => x.inbound === 1);
    expect(s.counts['idle']).toBeGreaterThanOrEqual(50);
    expect(s.events.filter((e) => e.event === 'idle').every((e) => e.level === 'info')).toBe(true);
    // The honest peer kept reading: never idle, never retired.
    expect(reads).toBeGreaterThanOrEqual(3);
    expect(good.conn.isOpen).toBe(true);
    await good.read();
    expect(s.inbound).toBe(1);
    expect(s.users).toEqual({ registration: 0, grant: 0 });
  });

  it('a peer over maxConnectionsPerPeer and peers past maxConnections are refused BUSY; established connections are untouched', async () => {
    const h = await startHolder({ maxConnectionsPerPeer: 3, maxConnections: 20 });
    const good = await honest(h.ready, 'honest');
    const greedy = await rawPeerProcess(target(h.ready), tok(h.ready), { nodeId: 'greedy', mode: 'idle', connections: 8, ms: 1500 }, children);
    expect(greedy.filter((r) => r.acked)).toHaveLength(3);
    expect(greedy.filter((r) => r.refused).map((r) => r.refusal)).toEqual(['BUSY', 'BUSY', 'BUSY', 'BUSY', 'BUSY']);
    await good.read();
    // Many distinct peers at once: 19 more fit next to the honest one (handshaking ones count too).
    const crowd = await rawPeerProcess(target(h.ready), tok(h.ready), { nodeId: 'crowd', distinct: true, mode: 'idle', connections: 30, ms: 1500 }, children);
    expect(crowd.filter((r) => r.acked)).toHaveLength(19);
    expect(crowd.filter((r) => r.refused && r.refusal === 'BUSY')).toHaveLength(11);
    const s = await statsWhen(h, (x) => x.inbound === 1);
    expect(s.counts['peer_connections']).toBe(5);
    expect(s.counts['connections']).toBe(11);
    expect(s.events.some((e) => e.level === 'warn' && e.event === 'peer_connections' && e.peer === 'greedy')).toBe(true);
    expect(good.conn.isOpen).toBe(true);
    await good.read();
    expect(s.inbound).toBe(1);
    // Below the caps again, the same peer is served.
    const back = await rawPeerProcess(target(h.ready), tok(h.ready), { nodeId: 'greedy', mode: 'idle', connections: 3, ms: 500 }, children);
    expect(back.filter((r) => r.acked)).toHaveLength(3);
  });
});

describe('idle retirement and the engine', () => {
  it('a connection retired for idleness is dropped by both engines; the next read simply reconnects and verifies', async () => {
    const { TransferEngine } = await import('../src/engine.js');
    const mk = (nodeId: string): InstanceType<typeof TransferEngine> => new TransferEngine({ nodeId, transports: [new TcpTransport({ idleTimeoutMs: 300 })], logger: silentLogger });
    const holder = mk('idle-holder');
    const reader = mk('idle-reader');
    closers.push(() => holder.close(), () => reader.close());
    await holder.start();
    await reader.start();
    const src = pattern(256 * 1024, 5);
    const reg = await holder.register({ kind: 'host', buffer: src });
    const dst = new Uint8Array(src.length);
    const local = await reader.register({ kind: 'host', buffer: dst });
    await reader.read(holder.endpoint(), [{ local, remote: reg.descriptor }]);
    expect(Buffer.compare(dst, src)).toBe(0);
    const ht = holder.transports[0] as TcpTransport;
    const rt = reader.transports[0] as TcpTransport;
    expect(rt.connectionCount).toBe(1);
    // Nothing moves: both sides' idle rule retires it, orderly (GOAWAY both ways).
    for (let i = 0; i < 100 && (ht.connectionCount > 0 || rt.connectionCount > 0); i++) await new Promise((r) => setTimeout(r, 50));
    expect([ht.connectionCount, rt.connectionCount]).toEqual([0, 0]);
    expect(ht.peerEventCounts.idle + rt.peerEventCounts.idle).toBeGreaterThanOrEqual(1);
    dst.fill(0);
    await reader.read(holder.endpoint(), [{ local, remote: reg.descriptor }]);
    expect(Buffer.compare(dst, src)).toBe(0);
    expect(rt.connectionCount).toBe(1);
  });
});

/**
 * A soak of the responder: rounds of hostile flooders (every mode), idle peers and a stalled
 * reader against one holder while an honest peer reads and verifies. Bounded in time and count;
 * loopback only. Short here; `TENSORWIRE_SOAK_MS=60000` (and `TENSORWIRE_SOAK_ROUNDS`) for a long one.
 */
describe('tcp responder soak (honest and hostile peers)', () => {
  const soakMs = Number(process.env['TENSORWIRE_SOAK_MS'] ?? 2500);
  const maxRounds = Number(process.env['TENSORWIRE_SOAK_ROUNDS'] ?? (process.env['TENSORWIRE_SOAK_MS'] ? 1000 : 3));
  it(`holds for ${soakMs} ms or ${maxRounds} rounds: memory back near where it started, every peer and grant accounted for`, { timeout: soakMs + 120_000 }, async () => {
    const limits = { maxChunkBytes: MiB, sendHighWaterMark: 256 * 1024, maxQueuedRequestBytes: 2 * MiB, idleTimeoutMs: 400, retireTimeoutMs: 500 };
    const h = await startHolder(limits);
    const good = await honest(h.ready, 'honest');
    await good.read();
    const before = await h.stats();
    const modes = ['readv', 'readv-copy', 'readv-bad', 'writev'] as const;
    const start = Date.now();
    let rounds = 0;
    let reads = 0;
    let peak = 0;
    while (rounds < maxRounds && (rounds === 0 || Date.now() - start < soakMs)) {
      const r = rounds++;
      const round = Promise.all([
        ...[0, 1].map((k) => {
          const mode = modes[(2 * r + k) % modes.length] as (typeof modes)[number];
          return rawPeerProcess(target(h.ready), tok(h.ready, k === 1), { nodeId: `soak-${mode}-${r}`, mode, connections: 2, requests: 60_000, settleMs: 300, base: k === 1 ? SIZE / 2 : 0 }, children);
        }),
        rawPeerProcess(target(h.ready), tok(h.ready), { nodeId: `soak-idle-${r}-`, distinct: true, mode: 'idle', connections: 10, ms: 10_000 }, children),
        rawPeerProcess(target(h.ready), tok(h.ready), { nodeId: `soak-slow-${r}`, mode: 'stall', requests: 100, length: 65536, pauseMs: 600 }, children),
      ]);
      reads += await readWhile(good.read, round);
      const [a = [], b = [], idle = [], [slow] = []] = await round;
      for (const x of [...a, ...b]) expect(x.closedByPeer).toBe(true);
      for (const x of idle) expect(x).toMatchObject({ acked: true, goaway: true, closedByPeer: true });
      expect(slow).toMatchObject({ replies: 100, verified: 100 });
      const s = await h.stats();
      peak = Math.max(peak, s.peak.heapUsed + s.peak.arrayBuffers);
    }
    const after = await statsWhen(h, (x) => x.inbound === 1);
    const MB = (n: number): string => (n / MiB).toFixed(1);
    console.log(
      `soak: ${rounds} rounds in ${Date.now() - start} ms, ${reads} honest reads verified; holder heap+arrayBuffers ${MB(before.memory.heapUsed + before.memory.arrayBuffers)} -> ${MB(after.memory.heapUsed + after.memory.arrayBuffers)} MiB (peak ${MB(peak)}), rss ${MB(before.memory.rss)} -> ${MB(after.memory.rss)} MiB; events ${JSON.stringify(after.counts)}`,
    );
    expect(after.counts['request_queue']).toBe(4 * rounds);
    expect(after.counts['idle']).toBeGreaterThanOrEqual(10 * rounds);
    expect(after.inbound).toBe(1);
    expect(good.conn.isOpen).toBe(true);
    await good.read();
    expect(after.users).toEqual({ registration: 0, grant: 0 });
    expect(after.grantCount).toBe(before.grantCount);
    // Everything the hostile peers made the holder allocate is gone again (after a GC).
    expect(after.memory.heapUsed + after.memory.arrayBuffers - (before.memory.heapUsed + before.memory.arrayBuffers)).toBeLessThan(16 * MiB);
    // And at no point did it hold more than the bound for the peers of one round, with slack.
    const bound = 2 * (limits.maxQueuedRequestBytes + limits.sendHighWaterMark + limits.maxChunkBytes);
    expect(peak - (before.memory.heapUsed + before.memory.arrayBuffers)).toBeLessThan(bound + 32 * MiB);
  });
});
