import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { DeadlineHeap, LeaseTable, type LeaseError, type LeaseInfo } from '../src/server/index.js';

const BLOCKS = Array.from({ length: 8 }, (_, i) => `block:h:${i}`);
const REQUESTERS = ['r0', 'r1', 'r2'];
const LOCK_TIMEOUT = 1000;
const MIN_LEASE = 100;

type Op =
  | { kind: 'acquire'; requester: number; blocks: number[]; leaseMs: number; withAcquireId: boolean }
  | { kind: 'release'; requester: number; session: number; byAcquireId: boolean }
  | { kind: 'renew'; requester: number; session: number; leaseMs: number }
  | { kind: 'expire' }
  | { kind: 'step'; ms: number };

const opArb: fc.Arbitrary<Op> = fc.oneof(
  {
    weight: 4,
    arbitrary: fc.record({
      kind: fc.constant('acquire' as const),
      requester: fc.nat(REQUESTERS.length - 1),
      blocks: fc.uniqueArray(fc.nat(BLOCKS.length - 1), { minLength: 1, maxLength: 4 }),
      leaseMs: fc.oneof(fc.constant(0), fc.integer({ min: 1, max: 2 * LOCK_TIMEOUT })),
      withAcquireId: fc.boolean(),
    }),
  },
  {
    weight: 3,
    arbitrary: fc.record({
      kind: fc.constant('release' as const),
      requester: fc.nat(REQUESTERS.length - 1),
      session: fc.nat(40),
      byAcquireId: fc.boolean(),
    }),
  },
  {
    weight: 2,
    arbitrary: fc.record({
      kind: fc.constant('renew' as const),
      requester: fc.nat(REQUESTERS.length - 1),
      session: fc.nat(40),
      leaseMs: fc.oneof(fc.constant(0), fc.integer({ min: 1, max: 2 * LOCK_TIMEOUT })),
    }),
  },
  { weight: 1, arbitrary: fc.constant({ kind: 'expire' as const }) },
  { weight: 3, arbitrary: fc.record({ kind: fc.constant('step' as const), ms: fc.integer({ min: 0, max: 700 }) }) },
);

interface ModelLease {
  requester: string;
  blocks: string[];
  deadline: number;
  acquireId: string | undefined;
}

describe('LeaseTable (property)', () => {
  it('keeps acquired = released + expired + active and never unpins a block a live lease holds', () => {
    fc.assert(
      fc.property(fc.array(opArb, { maxLength: 120 }), (ops) => {
        let t = 1_000_000;
        const pinned = new Set<string>();
        const violations: string[] = [];
        const model = new Map<string, ModelLease>();
        const issued: { sessionId: string; acquireId: string | undefined; requester: string }[] = [];
        let revokedBeforeUnpin = true;
        const ended = new Set<string>();
        const table: LeaseTable = new LeaseTable({
          holderId: 'h',
          lockTimeoutMs: LOCK_TIMEOUT,
          minLeaseMs: MIN_LEASE,
          clock: { now: () => t },
          pin: (id) => {
            if (pinned.has(id)) violations.push(`pin of already pinned ${id}`);
            pinned.add(id);
          },
          unpin: (id) => {
            if (!pinned.has(id)) violations.push(`unpin of unpinned ${id}`);
            for (const l of table.leases()) if (l.blockIds.includes(id)) violations.push(`unpin of ${id} while ${l.sessionId} holds it`);
            pinned.delete(id);
          },
          onEnd: (lease: LeaseInfo) => {
            if (ended.has(lease.sessionId)) violations.push(`${lease.sessionId} ended twice`);
            ended.add(lease.sessionId);
            // Grants are revoked while the blocks are still pinned.
            for (const b of lease.blockIds) if (!pinned.has(b)) revokedBeforeUnpin = false;
          },
        });
        const modelExpire = (): void => {
          for (const [id, l] of model) if (l.deadline <= t) model.delete(id);
        };
        const clampLease = (ms: number): number => (ms === 0 ? LOCK_TIMEOUT : Math.min(LOCK_TIMEOUT, Math.max(MIN_LEASE, ms)));
        let n = 0;
        for (const op of ops) {
          n++;
          switch (op.kind) {
            case 'acquire': {
              modelExpire();
              const requester = REQUESTERS[op.requester] as string;
              const ids = op.blocks.map((i) => BLOCKS[i] as string);
              const acquireId = op.withAcquireId ? `a${n}` : undefined;
              const lease = table.acquire(requester, ids, { leaseMs: op.leaseMs, ...(acquireId ? { acquireId } : {}) });
              expect(lease.deadline).toBe(t + clampLease(op.leaseMs));
              model.set(lease.sessionId, { requester, blocks: ids, deadline: lease.deadline, acquireId });
              issued.push({ sessionId: lease.sessionId, acquireId, requester });
              break;
            }
            case 'release': {
              modelExpire();
              const requester = REQUESTERS[op.requester] as string;
              const target = issued[op.session];
              const sessionId = target?.sessionId ?? 'session:h:unknown';
              const live = model.get(sessionId);
              const useAcquire = op.byAcquireId && target?.acquireId !== undefined;
              // By acquire id the key includes the requester, so another requester simply finds nothing.
              const expectDenied = live !== undefined && live.requester !== requester && !useAcquire;
              const expectCount = live !== undefined && live.requester === requester ? live.blocks.length : 0;
              let got: number | string;
              try {
                got = table.release(requester, useAcquire ? { acquireId: target?.acquireId as string } : { sessionId });
              } catch (e) {
                got = (e as LeaseError).status;
              }
              if (expectDenied) expect(got).toBe('PERMISSION_DENIED');
              else expect(got).toBe(expectCount);
              if (expectCount > 0) model.delete(sessionId);
              break;
            }
            case 'renew': {
              modelExpire();
              const requester = REQUESTERS[op.requester] as string;
              const sessionId = issued[op.session]?.sessionId ?? 'session:h:unknown';
              const live = model.get(sessionId);
              let got: LeaseInfo | string;
              try {
                got = table.renew(requester, sessionId, op.leaseMs);
              } catch (e) {
                got = (e as LeaseError).status;
              }
              if (live === undefined) expect(got).toBe('NOT_FOUND');
              else if (live.requester !== requester) expect(got).toBe('PERMISSION_DENIED');
              else {
                live.deadline = Math.max(live.deadline, t + clampLease(op.leaseMs));
                expect((got as LeaseInfo).deadline).toBe(live.deadline);
              }
              break;
            }
            case 'expire': {
              const before = model.size;
              modelExpire();
              const expired = table.expireDue();
              expect(expired).toBe(before - model.size);
              // The sweep touches only what expires.
              expect(table.lastSweep.examined).toBe(expired);
              for (const l of table.leases()) expect(l.deadline).toBeGreaterThan(t);
              break;
            }
            case 'step':
              t += op.ms;
              break;
          }
          const c = table.counters();
          expect(c.acquired).toBe(c.released + c.expired + c.active);
          expect(c.blocksAcquired).toBe(c.blocksReleased + c.blocksExpired + c.activeBlocks);
          expect(c.active).toBe(model.size);
          const union = new Set<string>();
          let sum = 0;
          for (const l of model.values()) {
            sum += l.blocks.length;
            for (const b of l.blocks) union.add(b);
          }
          expect(c.activeBlocks).toBe(sum);
          expect([...pinned].sort()).toEqual([...union].sort());
          expect(c.pinnedBlocks).toBe(union.size);
          for (const b of BLOCKS) {
            let holders = 0;
            for (const l of model.values()) if (l.blocks.includes(b)) holders++;
            expect(table.pinCount(b)).toBe(holders);
          }
          expect(violations).toEqual([]);
          expect(revokedBeforeUnpin).toBe(true);
        }
        // Shutdown revokes everything, still balanced, and unpins every block.
        table.revokeAll();
        const c = table.counters();
        expect(c.active).toBe(0);
        expect(c.acquired).toBe(c.released + c.expired);
        expect(pinned.size).toBe(0);
        expect(violations).toEqual([]);
      }),
      { numRuns: 300 },
    );
  });
});

describe('DeadlineHeap (property)', () => {
  it('pops in deadline order after random pushes, removals and updates', () => {
    fc.assert(
      fc.property(
        fc.array(
          fc.oneof(
            fc.record({ k: fc.constant('push' as const), d: fc.integer({ min: 0, max: 1000 }) }),
            fc.record({ k: fc.constant('remove' as const), i: fc.nat(50) }),
            fc.record({ k: fc.constant('update' as const), i: fc.nat(50), d: fc.integer({ min: 0, max: 1000 }) }),
          ),
          { maxLength: 200 },
        ),
        (ops) => {
          const heap = new DeadlineHeap<{ deadline: number; heapIndex: number; id: number }>();
          const all: { deadline: number; heapIndex: number; id: number }[] = [];
          const live = new Set<number>();
          for (const op of ops) {
            if (op.k === 'push') {
              const e = { deadline: op.d, heapIndex: -1, id: all.length };
              all.push(e);
              live.add(e.id);
              heap.push(e);
            } else if (op.k === 'remove') {
              const e = all[op.i];
              if (e) {
                heap.remove(e);
                live.delete(e.id);
              }
            } else {
              const e = all[op.i];
              if (e) heap.update(e, op.d);
            }
            expect(heap.size).toBe(live.size);
          }
          const expected = [...live].map((i) => (all[i] as { deadline: number }).deadline).sort((a, b) => a - b);
          const popped: number[] = [];
          for (let e = heap.pop(); e; e = heap.pop()) popped.push(e.deadline);
          expect(popped).toEqual(expected);
        },
      ),
      { numRuns: 300 },
    );
  });
});
