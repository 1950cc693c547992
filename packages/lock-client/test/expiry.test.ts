import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { ExpiryScheduler, LeaseTable, type Timers } from '../src/server/index.js';

/** A fake clock and timer queue; `advance` fires due timers in order, checking a hook before each. */
class FakeTime implements Timers {
  t = 0;
  #seq = 0;
  #timers = new Map<number, { at: number; fn: () => void }>();
  beforeFire: () => void = () => {};
  now = (): number => this.t;
  setTimeout(fn: () => void, ms: number): unknown {
    const id = ++this.#seq;
    this.#timers.set(id, { at: this.t + ms, fn });
    return id;
  }
  clearTimeout(handle: unknown): void {
    this.#timers.delete(handle as number);
  }
  get pending(): number {
    return this.#timers.size;
  }
  advance(ms: number): void {
    const target = this.t + ms;
    for (;;) {
      let next: [number, { at: number; fn: () => void }] | undefined;
      for (const e of this.#timers) if (e[1].at <= target && (next === undefined || e[1].at < next[1].at)) next = e;
      if (next === undefined) break;
      this.#timers.delete(next[0]);
      this.t = Math.max(this.t, next[1].at);
      this.beforeFire();
      next[1].fn();
    }
    this.t = target;
  }
}

describe('expiry GC', () => {
  it('never lets a lease outlive its timeout by more than a quarter of it (property, stepped time)', () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 100, max: 60_000 }),
        fc.array(
          fc.oneof(
            fc.record({ k: fc.constant('acquire' as const), frac: fc.double({ min: 0, max: 1, noNaN: true }) }),
            fc.record({ k: fc.constant('release' as const), i: fc.nat(30) }),
            fc.record({ k: fc.constant('renew' as const), i: fc.nat(30), frac: fc.double({ min: 0, max: 1, noNaN: true }) }),
            fc.record({ k: fc.constant('step' as const), frac: fc.double({ min: 0, max: 3, noNaN: true }) }),
          ),
          { maxLength: 80 },
        ),
        (lockTimeoutMs, ops) => {
          const time = new FakeTime();
          const table = new LeaseTable({ holderId: 'h', lockTimeoutMs, clock: time });
          const gc = new ExpiryScheduler(table, { timers: time });
          gc.start();
          const check = (): void => {
            for (const l of table.leases()) expect(time.t).toBeLessThanOrEqual(l.deadline + l.leaseMs / 4);
          };
          time.beforeFire = check;
          const ids: string[] = [];
          let n = 0;
          for (const op of ops) {
            if (op.k === 'acquire') {
              const lease = table.acquire('r', [`block:h:${n++}`], { leaseMs: Math.round(op.frac * lockTimeoutMs) });
              ids.push(lease.sessionId);
              gc.notify();
            } else if (op.k === 'release') {
              const id = ids[op.i];
              if (id) table.release('r', { sessionId: id });
            } else if (op.k === 'renew') {
              const id = ids[op.i];
              if (id && table.get(id)) {
                table.renew('r', id, Math.round(op.frac * lockTimeoutMs));
                gc.notify();
              }
            } else {
              time.advance(Math.round(op.frac * lockTimeoutMs));
              check();
            }
          }
          // Eventually everything expires through the timer alone.
          time.advance(3 * lockTimeoutMs);
          expect(table.size).toBe(0);
          const c = table.counters();
          expect(c.acquired).toBe(c.released + c.expired);
          gc.stop();
          expect(time.pending).toBe(0);
        },
      ),
      { numRuns: 200 },
    );
  });

  it('costs in proportion to what expires, not to what is live', () => {
    let t = 0;
    const table = new LeaseTable({ holderId: 'h', lockTimeoutMs: 60_000, minLeaseMs: 1000, clock: { now: () => t } });
    for (let i = 0; i < 20_000; i++) table.acquire('r', [`block:h:${i}`]);
    for (let i = 0; i < 7; i++) table.acquire('r', [`block:h:short${i}`], { leaseMs: 1000 });
    t += 1000;
    expect(table.expireDue()).toBe(7);
    expect(table.lastSweep).toEqual({ examined: 7, expired: 7 });
    t += 1000;
    expect(table.expireDue()).toBe(0);
    expect(table.lastSweep.examined).toBe(0);
    expect(table.size).toBe(20_000);
  });

  it('sweeps with real timers and reports it', async () => {
    const table = new LeaseTable({ holderId: 'h', lockTimeoutMs: 40, minLeaseMs: 40 });
    const swept: number[] = [];
    const gc = new ExpiryScheduler(table, { onSweep: (n) => swept.push(n) });
    gc.start();
    table.acquire('r', ['block:h:1']);
    gc.notify();
    while (table.size > 0) await new Promise((r) => setTimeout(r, 5));
    gc.stop();
    expect(swept.reduce((a, b) => a + b, 0)).toBe(1);
    expect(table.counters().expired).toBe(1);
  });
});
