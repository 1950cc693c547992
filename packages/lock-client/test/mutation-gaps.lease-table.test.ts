/**
 * Tests for mutants of the holder's lease table (src/server/lease-table.ts) that survived the
 * mutation run of issue 14: the limits at their exact boundaries, session-id collisions, the
 * `pin`/`onEnd`/`unpin`/`onReject` hooks when they refuse or throw, `abandon` and `revokeAll`
 * (counted as released and as expired), what `renew` records, and acquire ids after a release.
 * Invariant 3: `acquired = released + expired + active` (sessions and blocks), every lease ends
 * exactly once, a block is unpinned only when its last live lease ends.
 */
import type { Logger } from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import { LeaseError, type LeaseEndReason, type LeaseTable } from '../src/server/index.js';
import { statusOf, table } from './helpers.js';

interface Logged {
  level: 'warn' | 'error';
  message: string;
  fields: Record<string, unknown> | undefined;
}

function recordingLogger(): { logger: Logger; logged: Logged[] } {
  const logged: Logged[] = [];
  const logger: Logger = {
    debug: () => undefined,
    info: () => undefined,
    warn: (message, fields) => logged.push({ level: 'warn', message, fields }),
    error: (message, fields) => logged.push({ level: 'error', message, fields }),
  };
  return { logger, logged };
}

const blocks = (n: number, from = 0): string[] => Array.from({ length: n }, (_, i) => `block:h:${from + i}`);

/** Both balance equations of invariant 3. */
function expectBalanced(t: LeaseTable): void {
  const c = t.counters();
  expect(c.acquired).toBe(c.released + c.expired + c.active);
  expect(c.blocksAcquired).toBe(c.blocksReleased + c.blocksExpired + c.activeBlocks);
}

describe('LeaseTable: limits at their boundaries', () => {
  it('grants exactly maxBlocksPerSession blocks and refuses one more', () => {
    const { t } = table({ maxBlocksPerSession: 3 });
    expect(t.acquire('r', blocks(3)).blockIds).toHaveLength(3);
    expect(statusOf(() => t.acquire('r', blocks(4, 10)))).toBe('RESOURCE_EXHAUSTED');
    expect(t.counters()).toMatchObject({ acquired: 1, rejected: 1 });
  });

  it('grants up to maxSessions live sessions and refuses the next', () => {
    const { t } = table({ maxSessions: 2 });
    t.acquire('r', ['block:h:1']);
    t.acquire('r', ['block:h:2']);
    expect(statusOf(() => t.acquire('r', ['block:h:3']))).toBe('RESOURCE_EXHAUSTED');
    expect(t.counters()).toMatchObject({ acquired: 2, active: 2, rejected: 1 });
  });

  it('grants up to maxActiveBlocks blocks over live sessions and refuses one more', () => {
    const { t } = table({ maxActiveBlocks: 4 });
    const a = t.acquire('r', blocks(2));
    t.acquire('r', blocks(2, 2));
    expect(t.counters().activeBlocks).toBe(4);
    expect(statusOf(() => t.acquire('r', ['block:h:9']))).toBe('RESOURCE_EXHAUSTED');
    // A request larger than what is left is refused even when the sum minus it would fit.
    t.release('r', { sessionId: a.sessionId });
    expect(statusOf(() => t.acquire('r', blocks(3, 10)))).toBe('RESOURCE_EXHAUSTED');
    expect(t.acquire('r', blocks(2, 10)).blockIds).toHaveLength(2);
    expect(t.counters()).toMatchObject({ activeBlocks: 4, rejected: 2 });
  });

  it('finds a repeated block id in a list longer than the pairwise limit', () => {
    const { t } = table();
    const ids = blocks(40);
    ids.push('block:h:7');
    expect(statusOf(() => t.acquire('r', ids))).toBe('INVALID_ARGUMENT');
    expect(t.acquire('r', blocks(40)).blockIds).toHaveLength(40);
    expect(t.counters()).toMatchObject({ acquired: 1, activeBlocks: 40, pinnedBlocks: 40, rejected: 1 });
  });

  it('refuses a block list that is not an array with INVALID_ARGUMENT', () => {
    const { t } = table();
    const arrayLike = { length: 1, 0: 'block:h:1' } as unknown as string[];
    expect(statusOf(() => t.acquire('r', arrayLike))).toBe('INVALID_ARGUMENT');
    expect(t.counters()).toMatchObject({ acquired: 0, pinnedBlocks: 0, rejected: 1 });
  });
});

describe('LeaseTable: session ids', () => {
  it('uses the newSecret hook and draws again on a collision with a live session', () => {
    const secrets = ['aaa', 'aaa', 'aaa', 'bbb'];
    const { t } = table({ newSecret: () => secrets.shift() as string });
    const a = t.acquire('r', ['block:h:1']);
    const b = t.acquire('r', ['block:h:2']);
    expect(a.sessionId).toBe('session:h:aaa');
    expect(b.sessionId).toBe('session:h:bbb');
    expect(secrets).toEqual([]);
    expect(t.size).toBe(2);
    expect(t.get(a.sessionId)).toBe(a);
    expect(t.release('r', { sessionId: a.sessionId })).toBe(1);
    expect(t.release('r', { sessionId: b.sessionId })).toBe(1);
    expectBalanced(t);
  });

  it('copies the block list: changing the caller array afterwards changes nothing', () => {
    const { t } = table();
    const ids = ['block:h:1', 'block:h:2'];
    const lease = t.acquire('r', ids);
    ids[0] = 'block:h:9';
    expect(lease.blockIds).toEqual(['block:h:1', 'block:h:2']);
    expect(t.pinCount('block:h:1')).toBe(1);
    expect(t.release('r', { sessionId: lease.sessionId })).toBe(2);
    expect(t.counters().pinnedBlocks).toBe(0);
  });

  it('records when a lease was acquired', () => {
    const { t, clock } = table({ minLeaseMs: 100 });
    clock.t = 5000;
    const lease = t.acquire('r', ['block:h:1'], { leaseMs: 400 });
    expect(lease).toMatchObject({ acquiredAt: 5000, deadline: 5400, leaseMs: 400, requesterId: 'r', acquireId: undefined });
  });
});

describe('LeaseTable: hooks that refuse or throw', () => {
  it('reports a pin refused with a LeaseError to onReject, and a plain error not', () => {
    const rejects: string[] = [];
    let fail: Error = new LeaseError('NOT_FOUND', 'no such block');
    const { t } = table({
      pin: (b) => {
        if (b === 'block:h:bad') throw fail;
      },
      onReject: (op, status) => rejects.push(`${op} ${status}`),
    });
    expect(statusOf(() => t.acquire('r', ['block:h:1', 'block:h:bad']))).toBe('NOT_FOUND');
    expect(rejects).toEqual(['acquire NOT_FOUND']);
    fail = new Error('disk on fire');
    expect(() => t.acquire('r', ['block:h:bad'])).toThrow('disk on fire');
    expect(rejects).toEqual(['acquire NOT_FOUND']);
    expect(t.counters()).toMatchObject({ acquired: 0, pinnedBlocks: 0, rejected: 2 });
  });

  it('rethrows the pin refusal, not the error of an onReject hook that throws', () => {
    const unpinned: string[] = [];
    const { t } = table({
      pin: (b) => {
        if (b === 'block:h:bad') throw new LeaseError('NOT_FOUND', 'no such block');
      },
      unpin: (b) => unpinned.push(b),
      onReject: () => {
        throw new Error('metrics broke');
      },
    });
    expect(statusOf(() => t.acquire('r', ['block:h:1', 'block:h:bad']))).toBe('NOT_FOUND');
    expect(unpinned).toEqual(['block:h:1']);
    expect(t.counters()).toMatchObject({ acquired: 0, active: 0, pinnedBlocks: 0, rejected: 1 });
  });

  it('still unpins and counts a lease whose onEnd hook throws, and logs it', () => {
    const { logger, logged } = recordingLogger();
    const unpinned: string[] = [];
    const { t } = table({
      logger,
      unpin: (b) => unpinned.push(b),
      onEnd: () => {
        throw new Error('revoke failed');
      },
    });
    const a = t.acquire('r', ['block:h:1', 'block:h:2']);
    expect(t.release('r', { sessionId: a.sessionId })).toBe(2);
    expect(unpinned).toEqual(['block:h:1', 'block:h:2']);
    expect(t.counters()).toMatchObject({ released: 1, active: 0, pinnedBlocks: 0 });
    expect(logged).toEqual([{ level: 'error', message: 'lock: onEnd hook threw; continuing', fields: { sessionId: a.sessionId, error: 'Error: revoke failed' } }]);
  });

  it('unpins every block of a lease even when the unpin hook throws, and logs each', () => {
    const { logger, logged } = recordingLogger();
    const tried: string[] = [];
    const { t } = table({
      logger,
      unpin: (b) => {
        tried.push(b);
        throw new Error(`cannot unpin ${b}`);
      },
    });
    const a = t.acquire('r', ['block:h:1', 'block:h:2']);
    expect(t.release('r', { sessionId: a.sessionId })).toBe(2);
    expect(tried).toEqual(['block:h:1', 'block:h:2']);
    expect(t.pinCount('block:h:1')).toBe(0);
    expect(t.counters()).toMatchObject({ released: 1, pinnedBlocks: 0 });
    expect(logged).toEqual([
      { level: 'error', message: 'lock: unpin hook threw; continuing', fields: { blockId: 'block:h:1', error: 'Error: cannot unpin block:h:1' } },
      { level: 'error', message: 'lock: unpin hook threw; continuing', fields: { blockId: 'block:h:2', error: 'Error: cannot unpin block:h:2' } },
    ]);
  });
});

describe('LeaseTable: abandon, revokeAll and renew', () => {
  it('abandon ends a live lease once, counted as released, with reason abandoned', () => {
    const ends: string[] = [];
    const unpinned: string[] = [];
    const { t } = table({ onEnd: (l, why: LeaseEndReason) => ends.push(`${why} ${l.sessionId}`), unpin: (b) => unpinned.push(b) });
    const a = t.acquire('r', ['block:h:1', 'block:h:2']);
    const b = t.acquire('r', ['block:h:2']);
    expect(t.abandon(a.sessionId)).toBe(2);
    expect(t.abandon(a.sessionId)).toBe(0);
    expect(t.abandon('session:h:unknown')).toBe(0);
    expect(ends).toEqual([`abandoned ${a.sessionId}`]);
    expect(unpinned).toEqual(['block:h:1']);
    expect(t.get(a.sessionId)).toBeUndefined();
    expect(t.get(b.sessionId)).toBe(b);
    expect(t.counters()).toMatchObject({ acquired: 2, released: 1, expired: 0, active: 1, blocksReleased: 2, blocksExpired: 0, activeBlocks: 1, pinnedBlocks: 1 });
    expectBalanced(t);
  });

  it('an abandoned lease does not expire later', () => {
    const ends: string[] = [];
    const { t, clock } = table({ onEnd: (_l, why) => ends.push(why) });
    const a = t.acquire('r', ['block:h:1']);
    t.abandon(a.sessionId);
    clock.t += 5000;
    expect(t.expireDue()).toBe(0);
    expect(t.nextDeadline()).toBeUndefined();
    expect(ends).toEqual(['abandoned']);
    expect(t.counters()).toMatchObject({ released: 1, expired: 0 });
  });

  it('revokeAll ends every live lease, counted as expired, and returns how many', () => {
    const ends: string[] = [];
    const { t } = table({ onEnd: (_l, why) => ends.push(why) });
    t.acquire('r', ['block:h:1', 'block:h:2']);
    t.acquire('s', ['block:h:2']);
    const c = t.acquire('s', ['block:h:3']);
    t.release('s', { sessionId: c.sessionId });
    expect(t.revokeAll()).toBe(2);
    expect(t.revokeAll()).toBe(0);
    expect(ends).toEqual(['released', 'shutdown', 'shutdown']);
    expect(t.counters()).toMatchObject({ acquired: 3, released: 1, expired: 2, active: 0, blocksExpired: 3, activeBlocks: 0, pinnedBlocks: 0 });
    expectBalanced(t);
  });

  it('renew records the lease length granted, and never shortens the deadline', () => {
    const { t, clock } = table({ minLeaseMs: 100 });
    const a = t.acquire('r', ['block:h:1'], { leaseMs: 800 });
    clock.t = 100;
    const r = t.renew('r', a.sessionId, 200);
    expect(r.leaseMs).toBe(200);
    expect(r.deadline).toBe(800);
    expect(t.renew('r', a.sessionId).leaseMs).toBe(1000);
    expect(t.get(a.sessionId)?.deadline).toBe(1100);
  });

  it('expireDue counts each expired lease once and reports what the sweep examined', () => {
    const ends: string[] = [];
    const { t, clock } = table({ onEnd: (l, why) => ends.push(`${why} ${l.blockIds.join(',')}`) });
    t.acquire('r', ['block:h:1'], { leaseMs: 1000 });
    t.acquire('r', ['block:h:2', 'block:h:3'], { leaseMs: 1000 });
    t.acquire('r', ['block:h:4'], { leaseMs: 1000 });
    clock.t = 999;
    expect(t.expireDue()).toBe(0);
    expect(t.lastSweep).toEqual({ examined: 0, expired: 0 });
    clock.t = 1000;
    expect(t.expireDue()).toBe(3);
    expect(t.lastSweep).toEqual({ examined: 3, expired: 3 });
    expect(ends).toHaveLength(3);
    expect(t.counters()).toMatchObject({ expired: 3, blocksExpired: 4, active: 0, pinnedBlocks: 0 });
    expect(t.expireDue()).toBe(0);
    expect(t.lastSweep).toEqual({ examined: 0, expired: 0 });
  });
});

describe('LeaseTable: acquire ids', () => {
  it('frees an acquire id when its lease is released by it, so the id can be used again', () => {
    const { t } = table();
    const a = t.acquire('r', ['block:h:1'], { acquireId: 'n1' });
    expect(t.release('r', { acquireId: 'n1' })).toBe(1);
    // Released while live: not a tombstone, and no longer live.
    const b = t.acquire('r', ['block:h:1'], { acquireId: 'n1' });
    expect(b.sessionId).not.toBe(a.sessionId);
    expect(t.release('r', { sessionId: b.sessionId })).toBe(1);
    // Released by session id: the acquire id is free too, and releasing by it finds nothing live.
    const c = t.acquire('r', ['block:h:1'], { acquireId: 'n1' });
    expect(t.abandon(c.sessionId)).toBe(1);
    expect(t.release('r', { acquireId: 'n1' })).toBe(0);
    expect(t.counters()).toMatchObject({ acquired: 3, released: 3, active: 0 });
  });

  it('an expired lease cannot be released by its acquire id, and the id is free again', () => {
    const { t, clock } = table();
    t.acquire('r', ['block:h:1'], { acquireId: 'n2' });
    clock.t = 1000;
    expect(t.expireDue()).toBe(1);
    expect(t.release('r', { acquireId: 'n2' })).toBe(0);
    expect(t.counters()).toMatchObject({ released: 0, expired: 1 });
  });

  it('a tombstoned acquire id is refused until the lock timeout has passed, then granted', () => {
    const { t, clock } = table();
    expect(t.release('r', { acquireId: 'early' })).toBe(0);
    clock.t = 999;
    expect(statusOf(() => t.acquire('r', ['block:h:1'], { acquireId: 'early' }))).toBe('ABORTED');
    clock.t = 1000;
    expect(t.acquire('r', ['block:h:1'], { acquireId: 'early' }).acquireId).toBe('early');
  });

  it('a release that names neither a session nor an acquire id is refused', () => {
    const { t } = table();
    expect(statusOf(() => t.release('r', { sessionId: '', acquireId: '' }))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.release('r', { acquireId: 'bad id!' }))).toBe('INVALID_ARGUMENT');
    expect(t.counters().rejected).toBe(2);
  });
});

function refusal(fn: () => unknown): string {
  try {
    fn();
  } catch (e) {
    if (e instanceof LeaseError) return `${e.status}: ${e.message}`;
    throw e;
  }
  return 'OK';
}

describe('LeaseTable: refusals say what was wrong', () => {
  it('acquire refusals name the status and the reason', () => {
    const { t } = table({ maxBlocksPerSession: 2 });
    expect(refusal(() => t.acquire('r', []))).toBe('INVALID_ARGUMENT: block list is empty');
    expect(refusal(() => t.acquire('r', blocks(3)))).toBe('RESOURCE_EXHAUSTED: 3 blocks requested; at most 2 per session');
    expect(refusal(() => t.acquire('r', ['pool:h:1']))).toMatch(/^INVALID_ARGUMENT: block id: \S/);
    expect(refusal(() => t.acquire('r', ['block:h:1', 'block:h:1']))).toBe('INVALID_ARGUMENT: block id "block:h:1" appears twice');
    expect(refusal(() => t.acquire('r', ['block:h:1'], { acquireId: 'bad id!' }))).toBe('INVALID_ARGUMENT: acquire id must be 1-64 characters of [A-Za-z0-9_-]');
    t.acquire('r', ['block:h:1'], { acquireId: 'n1' });
    expect(refusal(() => t.acquire('r', ['block:h:2'], { acquireId: 'n1' }))).toBe('ALREADY_EXISTS: acquire id n1 is already live');
    t.release('r', { acquireId: 'n2' });
    expect(refusal(() => t.acquire('r', ['block:h:2'], { acquireId: 'n2' }))).toBe('ABORTED: acquire n2 was released before it arrived');
    expect(t.counters()).toMatchObject({ acquired: 1, rejected: 7 });
  });

  it('limit refusals say how much is in use and the limit', () => {
    const sessions = table({ maxSessions: 1 }).t;
    sessions.acquire('r', ['block:h:1']);
    expect(refusal(() => sessions.acquire('r', ['block:h:2']))).toBe('RESOURCE_EXHAUSTED: holder has 1 live sessions; limit 1');
    const active = table({ maxActiveBlocks: 2 }).t;
    active.acquire('r', blocks(2));
    expect(refusal(() => active.acquire('r', ['block:h:9']))).toBe('RESOURCE_EXHAUSTED: holder has 2 blocks under lease; limit 2');
  });

  it('release and renew refusals name the status and the reason', () => {
    const { t } = table();
    const a = t.acquire('alice', ['block:h:1']);
    expect(refusal(() => t.release('alice', {}))).toBe('INVALID_ARGUMENT: give exactly one of session id and acquire id');
    expect(refusal(() => t.release('alice', { sessionId: 'nonsense' }))).toMatch(/^INVALID_ARGUMENT: session id: \S/);
    expect(refusal(() => t.release('alice', { acquireId: 'bad id!' }))).toBe('INVALID_ARGUMENT: acquire id must be 1-64 characters of [A-Za-z0-9_-]');
    expect(refusal(() => t.release('mallory', { sessionId: a.sessionId }))).toBe(`PERMISSION_DENIED: session ${a.sessionId} belongs to another requester`);
    expect(refusal(() => t.renew('alice', 'nonsense'))).toMatch(/^INVALID_ARGUMENT: session id: \S/);
    expect(refusal(() => t.renew('alice', 'session:h:nope'))).toBe('NOT_FOUND: session session:h:nope is not live (unknown, released or expired)');
    expect(refusal(() => t.renew('mallory', a.sessionId))).toBe(`PERMISSION_DENIED: session ${a.sessionId} belongs to another requester`);
    expect(t.counters()).toMatchObject({ active: 1, rejected: 7 });
  });
});

describe('LeaseTable: acquire id edge cases', () => {
  it('an empty acquire id means none', () => {
    const { t } = table();
    const a = t.acquire('r', ['block:h:1'], { acquireId: '' });
    expect(a.acquireId).toBeUndefined();
    expect(t.acquire('r', ['block:h:2'], { acquireId: '' }).acquireId).toBeUndefined();
    expect(t.counters()).toMatchObject({ acquired: 2, rejected: 0 });
  });

  it('a lease without an acquire id ending leaves a live lease whose acquire id is "undefined" findable', () => {
    const { t } = table();
    const named = t.acquire('r', ['block:h:1'], { acquireId: 'undefined' });
    const plain = t.acquire('r', ['block:h:2']);
    expect(t.release('r', { sessionId: plain.sessionId })).toBe(1);
    expect(t.release('r', { acquireId: 'undefined' })).toBe(1);
    expect(t.get(named.sessionId)).toBeUndefined();
    expect(t.counters()).toMatchObject({ released: 2, active: 0 });
  });
});
