/**
 * Cross-host behaviour on real hosts: three network namespaces joined by veth pairs
 *
 *   etcd host  ──(10.231.n.0/24)── holder host ──(10.231.n+2.0/24, data + locks)── requester host
 *        └──────────────(10.231.n+1.0/24)──────────────────────────────────────────────┘
 *
 * with a real etcd in its own namespace, a holder (engine + lock service + discovery) and a
 * requester (discovery + lock client + engine) as separate node processes. Skips, printing
 * why, where namespaces or etcd are not available.
 */
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TestEtcd, etcdMissing } from './helpers/etcd.js';
import { NsProcess, Topology, netnsMissing, type Link } from './helpers/netns.js';

const fixtures = join(dirname(fileURLToPath(import.meta.url)), 'fixtures');
const skipReason = etcdMissing() ?? netnsMissing();
if (skipReason) console.warn(`[discovery-etcd] skipping cross-host (network namespace) tests: ${skipReason}`);

const TTL = 2;
const BLOCKS = 8;
const BLOCK_BYTES = 256 * 1024;

type Progress = {
  ok: number;
  okByIncarnation: Record<string, number>;
  genByIncarnation: Record<string, number>;
  errors: Record<string, number>;
  untyped: number | string[];
  verifyFailures: number;
  staleGrants: number;
  okWhileUnavailable: number;
  available: boolean;
};

describe.skipIf(skipReason !== undefined)('across hosts (network namespaces, real etcd)', () => {
  let topo: Topology;
  let etcd: TestEtcd;
  let etcdHolder: Link;
  let etcdRequester: Link;
  let data: Link;
  const procs: NsProcess[] = [];
  let nsH = '';
  let nsR = '';

  beforeAll(async () => {
    topo = new Topology();
    try {
      const nsE = topo.host('e');
      nsH = topo.host('h');
      nsR = topo.host('r');
      etcdHolder = topo.link(nsE, nsH, `${nsE}h`.slice(-12));
      etcdRequester = topo.link(nsE, nsR, `${nsE}r`.slice(-12));
      data = topo.link(nsH, nsR, `${nsH}r`.slice(-12));
      etcd = new TestEtcd({ netns: nsE, hosts: [etcdHolder.addrA, etcdRequester.addrA] });
      await etcd.start();
    } catch (e) {
      await etcd?.destroy();
      topo.destroySync();
      throw e;
    }
  });

  afterAll(async () => {
    for (const p of procs) await p.kill().catch(() => undefined);
    await etcd?.destroy();
    topo?.destroySync();
  });

  function holder(gen: number, lockTimeoutMs = 3000, blockBytes = BLOCK_BYTES): NsProcess {
    const p = new NsProcess(nsH, join(fixtures, 'holder.mjs'), {
      nodeId: 'holder',
      addr: data.addrA,
      etcd: `etcd://${etcdHolder.addrA}:${etcd.port}`,
      blocks: BLOCKS,
      blockBytes,
      gen,
      lockTimeoutMs,
      ttlSeconds: TTL,
    });
    procs.push(p);
    return p;
  }
  function requester(mode: 'loop' | 'big', blockBytes = BLOCK_BYTES): NsProcess {
    const p = new NsProcess(nsR, join(fixtures, 'requester.mjs'), { etcd: `etcd://${etcdRequester.addrA}:${etcd.port}`, blocks: BLOCKS, blockBytes, mode });
    procs.push(p);
    return p;
  }
  const progress = (p: NsProcess): Progress | undefined => p.last('progress') as Progress | undefined;
  const okNow = (p: NsProcess): number => progress(p)?.ok ?? 0;

  it('a requester fetches from a holder found through etcd; a restart (new incarnation) and an etcd outage never yield stale or unverified bytes', async () => {
    const h1 = holder(1);
    const ready1 = await h1.waitFor((m) => m['type'] === 'ready', 60_000, 'holder 1 ready');
    const r = requester('loop');
    await r.waitFor((m) => m['type'] === 'progress' && (m as unknown as Progress).ok >= 5, 60_000, 'first fetches');

    // Kill the holder mid-run and start a new incarnation while the requester keeps fetching.
    await h1.kill('SIGKILL');
    const h2 = holder(2);
    const ready2 = await h2.waitFor((m) => m['type'] === 'ready', 60_000, 'holder 2 ready (after the old lease lapsed)');
    expect(ready2['incarnation']).not.toBe(ready1['incarnation']);
    const inc2 = ready2['incarnation'] as string;
    await r.waitFor((m) => m['type'] === 'progress' && ((m as unknown as Progress).okByIncarnation[inc2] ?? 0) >= 5, 60_000, 'fetches from the new incarnation');

    // Stop etcd: the data plane goes on from the cache.
    await etcd.stop();
    await r.waitFor((m) => m['type'] === 'progress' && (m as unknown as Progress).available === false, 30_000, 'requester notices etcd is gone');
    const before = okNow(r);
    await r.waitFor((m) => m['type'] === 'progress' && (m as unknown as Progress).okWhileUnavailable >= 5 && (m as unknown as Progress).ok >= before + 5, 60_000, 'fetches while etcd is down');
    // Start it again: both sides resynchronise and the holder is published again.
    await etcd.start();
    await r.waitFor((m) => m['type'] === 'progress' && (m as unknown as Progress).available === true && (m as unknown as Progress).ok > before + 5, 60_000, 'requester resynchronised');
    h2.send('counters');
    await h2.waitFor((m) => m['type'] === 'counters' && m['published'] === true, 30_000, 'holder re-published');
    const after = okNow(r);
    await r.waitFor((m) => m['type'] === 'progress' && (m as unknown as Progress).ok >= after + 5, 60_000, 'fetches after etcd returned');

    r.send('stop');
    const summary = (await r.waitFor((m) => m['type'] === 'summary', 30_000, 'requester summary')) as unknown as Progress & { untyped: string[] };
    console.info(`[discovery-etcd] requester summary: ${JSON.stringify(summary)}`);
    // Every read either verified or failed with a typed error; none returned stale bytes.
    expect(summary.verifyFailures).toBe(0);
    expect(summary.untyped).toEqual([]);
    expect(summary.staleGrants).toBe(0);
    expect(summary.genByIncarnation).toEqual({ [ready1['incarnation'] as string]: 1, [inc2]: 2 });
    for (const code of Object.keys(summary.errors)) expect(code).toMatch(/^TW_/);
    h2.send('exit');
    await h2.waitFor((m) => m['type'] === 'exited', 30_000, 'holder 2 exit');
  });

  it('a link cut mid-transfer ends the read with a typed error by its deadline, and the holder expires the lease', async () => {
    const lockTimeoutMs = 4000;
    const big = 16 * 1024 * 1024;
    const h = holder(3, lockTimeoutMs, big);
    await h.waitFor((m) => m['type'] === 'ready', 60_000, 'holder 3 ready');
    // Slow the data link so that one 16 MiB read takes seconds, then cut it during the read.
    const tbf = topo.exec(nsH, ['tc', 'qdisc', 'add', 'dev', data.devA, 'root', 'tbf', 'rate', '16mbit', 'burst', '32kbit', 'latency', '400ms']);
    expect(tbf.ok, tbf.out).toBe(true);
    try {
      const r = requester('big', big);
      const reading = await r.waitFor((m) => m['type'] === 'reading', 60_000, 'read started');
      await new Promise((res) => setTimeout(res, 300));
      topo.setLink(data, false);
      const result = await r.waitFor((m) => m['type'] === 'big', 60_000, 'read settled');
      console.info(`[discovery-etcd] cut read: ${JSON.stringify(result)} (deadline ${String(reading['deadline'])})`);
      expect(result['outcome']).toMatch(/^TW_(TIMED_OUT|CONNECTION_BROKEN|ABORTED|SESSION_INVALIDATED)$/);
      // The read settled by the transfer deadline it was given (plus a grace to quiesce the sockets).
      expect(result['settledAt'] as number).toBeLessThanOrEqual((reading['deadline'] as number) + 1000);
      // The release cannot reach the holder; its GC expires the lease.
      const counters = await pollCounters(h, (c) => (c['expired'] as number) >= 1, 30_000);
      expect(counters['active']).toBe(0);
      expect(counters['acquired']).toBe((counters['released'] as number) + (counters['expired'] as number) + (counters['active'] as number));
    } finally {
      topo.setLink(data, true);
      topo.exec(nsH, ['tc', 'qdisc', 'del', 'dev', data.devA, 'root']);
    }
    h.send('exit');
    await h.waitFor((m) => m['type'] === 'exited', 30_000, 'holder 3 exit');
  });
});

async function pollCounters(h: NsProcess, pred: (c: Record<string, unknown>) => boolean, timeoutMs: number): Promise<Record<string, unknown>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const seen = h.messages.length;
    h.send('counters');
    const c = await h.waitFor((m) => m['type'] === 'counters' && h.messages.indexOf(m) >= seen, 10_000, 'holder counters');
    if (pred(c)) return c;
    if (Date.now() > deadline) throw new Error(`holder counters never matched: ${JSON.stringify(c)}`);
    await new Promise((r) => setTimeout(r, 250));
  }
}
