/**
 * Bursts across processes: leases held by this process on a holder in a child process,
 * released all at once (every `release()` issued before any is awaited). Every release is
 * confirmed, and the holder's counters balance with nothing left active; the same against a
 * holder that refuses half the batched calls for a while. Counts, not time.
 *
 * The normal suite runs 10,000 leases: setting them up is one unary acquire each, which on a
 * loaded 2-core machine runs at ~1,000-3,000/s, so 100,000 would take minutes to prepare.
 * The full size: `TENSORWIRE_BURST_LEASES=100000 npx vitest run packages/lock-client/test/burst.test.ts`.
 */
import type { ChildProcess } from 'node:child_process';
import { describe, expect, it } from 'vitest';
import { LockClient, type LockGuard, type ReleaseResult } from '../src/index.js';
import type { LockServerCounters } from '../src/server/index.js';
import { forkFixture, killChildrenAfterEach, message } from './children.js';

const N = Number(process.env['TENSORWIRE_BURST_LEASES'] ?? 10_000);
/** The test's own bound: generous for the full size, which spends minutes acquiring. */
const TIMEOUT_MS = N > 20_000 ? 900_000 : 60_000;

killChildrenAfterEach();

async function startHolder(refuse: number): Promise<{ child: ChildProcess; address: string; counters(): Promise<{ counters: LockServerCounters; releaseManyCalls: number; refused: number }> }> {
  const child = forkFixture('burst-holder.mjs', ['burstholder', '600000', String(refuse)]);
  const { port } = await message<{ port: number }>(child, 'listening');
  return {
    child,
    address: `127.0.0.1:${port}`,
    counters: () => {
      const reply = message<{ counters: LockServerCounters; releaseManyCalls: number; refused: number }>(child, 'counters');
      child.send({ type: 'counters' });
      return reply;
    },
  };
}

/** Acquire `n` one-block leases, `concurrency` at a time (the release is what is under test). */
async function acquireMany(client: LockClient, holder: string, n: number, concurrency = 512): Promise<LockGuard[]> {
  const guards = new Array<LockGuard>(n);
  let next = 0;
  const lane = async (): Promise<void> => {
    while (next < n) {
      const i = next++;
      guards[i] = await client.acquire(holder, [`block:burstholder:${i}`], { timeoutMs: 60_000 });
    }
  };
  await Promise.all(Array.from({ length: concurrency }, lane));
  return guards;
}

function tally(results: readonly ReleaseResult[]): { confirmed: number; blocks: number } {
  let confirmed = 0;
  let blocks = 0;
  for (const r of results) {
    if (r.confirmed) confirmed++;
    blocks += r.blocksReleased;
  }
  return { confirmed, blocks };
}

describe(`a burst of ${N.toLocaleString('en')} releases across processes`, () => {
  it('every release is confirmed and the holder balances with nothing active', async () => {
    const h = await startHolder(0);
    const client = new LockClient({ requesterId: 'burst' });
    try {
      const guards = await acquireMany(client, h.address, N);
      expect((await h.counters()).counters).toMatchObject({ acquired: N, active: N });
      // All at once: every release is issued before any of them is awaited.
      const results = await Promise.all(guards.map((g) => g.release()));
      expect(tally(results)).toEqual({ confirmed: N, blocks: N });
      const { counters: c } = await h.counters();
      expect(c).toMatchObject({ acquired: N, released: N, expired: 0, active: 0, blocksReleased: N, activeBlocks: 0 });
      expect(c.acquired).toBe(c.released + c.expired + c.active);
      // Coalesced: far fewer calls than leases, and every lease in exactly one of them.
      expect(c.releaseEntries).toBe(N);
      expect(c.requests.releaseMany).toBeLessThanOrEqual(Math.ceil(N / 1024) * 4);
      expect(client.counters()).toMatchObject({ acquired: N, released: N, releaseFailures: 0, expired: 0, active: 0, releaseRetries: 0 });
    } finally {
      await client.close();
    }
  }, TIMEOUT_MS);

  it('against a holder that refuses half the calls for a while, every release is still confirmed', async () => {
    // Every other batched call refused until this many were: about half of the first half of the burst.
    const refuse = Math.max(2, Math.floor(N / 2048));
    const h = await startHolder(refuse);
    const client = new LockClient({ requesterId: 'burst', releaseRetry: { initialDelayMs: 5, maxDelayMs: 50 }, retryBudget: { burst: 10, perSecond: 100, perSuccess: 1 } });
    try {
      const guards = await acquireMany(client, h.address, N);
      const results = await Promise.all(guards.map((g) => g.release()));
      expect(tally(results)).toEqual({ confirmed: N, blocks: N });
      const { counters: c, refused } = await h.counters();
      expect(refused).toBe(refuse);
      expect(c).toMatchObject({ acquired: N, released: N, expired: 0, active: 0 });
      expect(c.acquired).toBe(c.released + c.expired + c.active);
      const cc = client.counters();
      expect(cc).toMatchObject({ acquired: N, released: N, releaseFailures: 0, active: 0 });
      // The refused calls' leases were retried through the queue, not one call per lease.
      expect(cc.releaseRetries).toBeGreaterThan(0);
      expect(c.requests.releaseMany).toBeLessThanOrEqual(Math.ceil(N / 1024) * 4 + 2 * refuse);
    } finally {
      await client.close();
    }
  }, TIMEOUT_MS);
});
