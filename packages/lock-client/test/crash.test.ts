import type { ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { describe, expect, it } from 'vitest';
import { LockClient } from '../src/index.js';
import { LockServer, type LockServerCounters } from '../src/server/index.js';
import { forkFixture, killChildrenAfterEach, message } from './children.js';
import { waitFor } from './helpers.js';

killChildrenAfterEach();
const spawn = forkFixture;

async function kill(child: ChildProcess): Promise<void> {
  const exited = once(child, 'exit');
  child.kill('SIGKILL');
  const [, signal] = await exited;
  expect(signal).toBe('SIGKILL');
}

describe('crashes (real child processes, SIGKILL)', () => {
  it('requesters killed while holding leases: the GC expires them, counters balance, blocks unpin', async () => {
    const pinned = new Map<string, number>();
    const server = new LockServer({
      holderId: 'holder1',
      // Long enough that no lease expires before the four children hold theirs on a loaded
      // machine; short enough for the GC to expire the killed ones within the test.
      lockTimeoutMs: 3000,
      minLeaseMs: 3000,
      pin: (b) => pinned.set(b, 1),
      unpin: (b) => pinned.delete(b),
    });
    const port = await server.listen();
    const holder = `127.0.0.1:${port}`;
    try {
      const doomed = [0, 1, 2].map((i) => spawn('requester.mjs', [holder, `doomed${i}`, `block:holder1:${i}`, 'block:holder1:shared']));
      const polite = spawn('requester.mjs', [holder, 'polite', 'block:holder1:shared', 'block:holder1:9']);
      const sessions = await Promise.all([...doomed, polite].map((c) => message<{ sessionId: string }>(c, 'acquired')));
      expect(new Set(sessions.map((s) => s.sessionId)).size).toBe(4);
      expect(server.counters()).toMatchObject({ acquired: 4, active: 4, pinnedBlocks: 5 });
      for (const c of doomed) await kill(c);
      polite.send({ type: 'release' });
      const released = await message<{ confirmed: boolean; blocksReleased: number }>(polite, 'released');
      expect(released).toMatchObject({ confirmed: true, blocksReleased: 2 });
      // The shared block stays pinned while the dead requesters' leases are live.
      expect(pinned.has('block:holder1:shared')).toBe(server.counters().active > 0);
      await waitFor(() => server.counters().active === 0, 'GC to expire the dead requesters\' leases');
      const c = server.counters();
      expect(c).toMatchObject({ acquired: 4, released: 1, expired: 3, active: 0, activeBlocks: 0, pinnedBlocks: 0 });
      expect(c.acquired).toBe(c.released + c.expired + c.active);
      expect(c.blocksAcquired).toBe(c.blocksReleased + c.blocksExpired);
      expect(pinned.size).toBe(0);
    } finally {
      await server.close({ graceMs: 0 });
    }
  });

  it('a holder restarted under a live guard: the release reaches the new holder and is harmless', async () => {
    const first = spawn('holder.mjs', ['holder1', '30000', '127.0.0.1:0']);
    const { port } = await message<{ port: number }>(first, 'listening');
    const holder = `127.0.0.1:${port}`;
    const client = new LockClient({ releaseRetry: { initialDelayMs: 20, maxDelayMs: 200 } });
    try {
      const guard = await client.acquire(holder, ['block:holder1:1', 'block:holder1:2']);
      first.send({ type: 'counters' });
      expect((await message<{ counters: LockServerCounters }>(first, 'counters')).counters).toMatchObject({ acquired: 1, active: 1 });
      await kill(first);
      const second = spawn('holder.mjs', ['holder1', '30000', holder]);
      await message(second, 'listening');
      const result = await guard.release();
      expect(result).toMatchObject({ confirmed: true, blocksReleased: 0 });
      await guard[Symbol.asyncDispose]();
      second.send({ type: 'counters' });
      const c = (await message<{ counters: LockServerCounters }>(second, 'counters')).counters;
      expect(c).toMatchObject({ acquired: 0, released: 0, expired: 0, active: 0, rejected: 0 });
      expect(c.requests.releaseMany).toBe(1);
      expect(client.counters()).toMatchObject({ acquired: 1, released: 1, releaseFailures: 0, active: 0 });
      // The new incarnation serves new leases as usual.
      const again = await client.acquire(holder, ['block:holder1:1']);
      expect(again.sessionId).not.toBe(guard.sessionId);
      await again.release();
    } finally {
      await client.close();
    }
  });
});
