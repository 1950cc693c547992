import { describe, expect, it } from 'vitest';
import { LeaseError } from '../src/server/index.js';
import { statusOf, table } from './helpers.js';

describe('LeaseTable', () => {
  it('issues owner-namespaced, distinct session ids', () => {
    const { t } = table();
    const a = t.acquire('r', ['block:h:1']);
    const b = t.acquire('r', ['block:h:1']);
    expect(a.sessionId).toMatch(/^session:h:[A-Za-z0-9_-]{22}$/);
    expect(a.sessionId).not.toBe(b.sessionId);
  });

  it('refuses bad input with specific statuses and leaves other leases alone', () => {
    const { t } = table({ maxBlocksPerSession: 3, maxSessions: 2 });
    const mine = t.acquire('alice', ['block:h:1']);
    expect(statusOf(() => t.acquire('alice', []))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.acquire('alice', ['block:h:1', 'block:h:1']))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.acquire('alice', ['pool:h:1']))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.acquire('alice', ['block:h'] as string[]))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.acquire('bad id', ['block:h:1']))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.acquire('alice', ['block:h:1', 'block:h:2', 'block:h:3', 'block:h:4']))).toBe('RESOURCE_EXHAUSTED');
    expect(statusOf(() => t.acquire('alice', ['block:h:2'], { leaseMs: -1 }))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.release('alice', { sessionId: 'nonsense' }))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.release('alice', {}))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.release('alice', { sessionId: mine.sessionId, acquireId: 'x' }))).toBe('INVALID_ARGUMENT');
    expect(statusOf(() => t.release('mallory', { sessionId: mine.sessionId }))).toBe('PERMISSION_DENIED');
    expect(statusOf(() => t.renew('mallory', mine.sessionId))).toBe('PERMISSION_DENIED');
    expect(statusOf(() => t.renew('alice', 'session:h:nope'))).toBe('NOT_FOUND');
    t.acquire('bob', ['block:h:9']);
    expect(statusOf(() => t.acquire('carol', ['block:h:10']))).toBe('RESOURCE_EXHAUSTED');
    expect(t.get(mine.sessionId)).toBe(mine);
    const c = t.counters();
    expect(c.active).toBe(2);
    expect(c.rejected).toBe(14);
  });

  it('treats release of unknown, released or expired sessions as harmless', () => {
    const { t, clock } = table();
    expect(t.release('r', { sessionId: 'session:h:unknown' })).toBe(0);
    expect(t.release('r', { sessionId: 'session:other:x' })).toBe(0);
    const a = t.acquire('r', ['block:h:1', 'block:h:2']);
    expect(t.release('r', { sessionId: a.sessionId })).toBe(2);
    expect(t.release('r', { sessionId: a.sessionId })).toBe(0);
    const b = t.acquire('r', ['block:h:1']);
    clock.t += 1000;
    expect(t.release('r', { sessionId: b.sessionId })).toBe(0);
    expect(t.counters()).toMatchObject({ acquired: 2, released: 1, expired: 1, active: 0 });
  });

  it('caps leases at the lock timeout and raises them to the minimum', () => {
    const { t } = table({ minLeaseMs: 100 });
    expect(t.acquire('r', ['block:h:1'], { leaseMs: 10_000 }).leaseMs).toBe(1000);
    expect(t.acquire('r', ['block:h:2'], { leaseMs: 5 }).leaseMs).toBe(100);
    expect(t.acquire('r', ['block:h:3']).leaseMs).toBe(1000);
  });

  it('refcounts pins across sessions and unpins only after the last holder ends', () => {
    const events: string[] = [];
    const { t } = table({ pin: (b) => events.push(`pin ${b}`), unpin: (b) => events.push(`unpin ${b}`), onEnd: (l, why) => events.push(`end ${why} ${l.blockIds.join(',')}`) });
    const a = t.acquire('r', ['block:h:1', 'block:h:2']);
    const b = t.acquire('s', ['block:h:2', 'block:h:3']);
    t.release('r', { sessionId: a.sessionId });
    expect(t.pinCount('block:h:2')).toBe(1);
    t.release('s', { sessionId: b.sessionId });
    expect(events).toEqual([
      'pin block:h:1',
      'pin block:h:2',
      'pin block:h:3',
      'end released block:h:1,block:h:2',
      'unpin block:h:1',
      'end released block:h:2,block:h:3',
      'unpin block:h:2',
      'unpin block:h:3',
    ]);
  });

  it('rolls back pins when the pin hook refuses a block', () => {
    const pinned = new Set<string>();
    const { t } = table({
      pin: (b) => {
        if (b === 'block:h:404') throw new LeaseError('NOT_FOUND', 'no such block');
        pinned.add(b);
      },
      unpin: (b) => pinned.delete(b),
    });
    t.acquire('r', ['block:h:1']);
    expect(statusOf(() => t.acquire('r', ['block:h:1', 'block:h:2', 'block:h:404']))).toBe('NOT_FOUND');
    expect([...pinned]).toEqual(['block:h:1']);
    expect(t.pinCount('block:h:1')).toBe(1);
    expect(t.pinCount('block:h:2')).toBe(0);
    expect(t.counters()).toMatchObject({ acquired: 1, active: 1, rejected: 1 });
  });

  it('releases by acquire id, and refuses an acquire whose id was released first', () => {
    const { t } = table();
    const a = t.acquire('r', ['block:h:1'], { acquireId: 'abc' });
    expect(statusOf(() => t.acquire('r', ['block:h:2'], { acquireId: 'abc' }))).toBe('ALREADY_EXISTS');
    expect(t.release('other', { acquireId: 'abc' })).toBe(0);
    expect(t.get(a.sessionId)).toBeDefined();
    expect(t.release('r', { acquireId: 'abc' })).toBe(1);
    expect(t.release('r', { acquireId: 'late' })).toBe(0);
    expect(statusOf(() => t.acquire('r', ['block:h:1'], { acquireId: 'late' }))).toBe('ABORTED');
    // The same nonce from another requester is a different key.
    expect(t.acquire('q', ['block:h:1'], { acquireId: 'late' }).requesterId).toBe('q');
  });

  it('never renews an expired lease, even before the GC ran', () => {
    const { t, clock } = table();
    const a = t.acquire('r', ['block:h:1']);
    clock.t += 999;
    expect(t.renew('r', a.sessionId).deadline).toBe(999 + 1000);
    clock.t += 1000;
    expect(statusOf(() => t.renew('r', a.sessionId))).toBe('NOT_FOUND');
    expect(t.counters()).toMatchObject({ expired: 1, active: 0 });
  });
});
