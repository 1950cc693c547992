/**
 * The per-holder release queue (HolderLane), as a property: whatever the interleaving of
 * acquire, release, auto-renew, close and holder failure (refusals, lost replies, hangs
 * past the deadline, overload, per-entry errors, an old holder without the batched calls),
 * every release ends exactly once, as confirmed / failed (reported) / expired (never sent),
 * and consistently with the holder's lease table; calls in flight never exceed the bound;
 * no renew is sent for a lease whose release was asked; close() ends everything, cancels
 * what is in flight, and leaves no timer behind. Time is fake and stepped by the test.
 */
import { status } from '@grpc/grpc-js';
import { ConnectionBrokenError, RemoteRejectedError, ResourceExhaustedError, TimedOutError, type TensorwireError } from '@tensorwire/core';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { LeaseError } from '../src/errors.js';
import { HolderLane, type LaneTimers, type LaneTransport, type ReleaseResult, type RenewEntry } from '../src/holder-lane.js';
import type { EntryErrorMsg } from '../src/proto.js';
import { LeaseTable } from '../src/server/lease-table.js';

const MAX_IN_FLIGHT = 2;
const MAX_BATCH = 2;
const UNARY = 3;

class FakeTime implements LaneTimers {
  t = 1_000_000;
  #seq = 0;
  readonly #timers = new Map<number, { at: number; fn: () => void }>();
  now(): number {
    return this.t;
  }
  set(fn: () => void, ms: number): unknown {
    const id = ++this.#seq;
    this.#timers.set(id, { at: this.t + Math.max(0, ms), fn });
    return id;
  }
  clear(h: unknown): void {
    this.#timers.delete(h as number);
  }
  get live(): number {
    return this.#timers.size;
  }
  /** Step time by `ms`, firing due timers in time order (including ones they arm). */
  advance(ms: number): void {
    const until = this.t + ms;
    for (;;) {
      let next: [number, { at: number; fn: () => void }] | undefined;
      for (const e of this.#timers) if (e[1].at <= until && (next === undefined || e[1].at < next[1].at)) next = e;
      if (next === undefined) break;
      this.#timers.delete(next[0]);
      this.t = Math.max(this.t, next[1].at);
      next[1].fn();
    }
    this.t = until;
  }
}

type Mode = 'ok' | 'unavailable' | 'lostReply' | 'overloaded' | 'entryErrors';

type Op =
  | { kind: 'acquire'; leaseMs: number; withAcquireId: boolean }
  | { kind: 'release'; lease: number }
  | { kind: 'renew'; lease: number; everyMs: number }
  | { kind: 'mode'; mode: Mode }
  | { kind: 'deliver'; call: number }
  | { kind: 'advance'; ms: number }
  | { kind: 'close'; limitMs: number };

const opArb: fc.Arbitrary<Op> = fc.oneof(
  { weight: 8, arbitrary: fc.record({ kind: fc.constant('acquire' as const), leaseMs: fc.integer({ min: 50, max: 1500 }), withAcquireId: fc.boolean() }) },
  { weight: 10, arbitrary: fc.record({ kind: fc.constant('release' as const), lease: fc.nat(12) }) },
  { weight: 4, arbitrary: fc.record({ kind: fc.constant('renew' as const), lease: fc.nat(12), everyMs: fc.integer({ min: 20, max: 500 }) }) },
  { weight: 4, arbitrary: fc.record({ kind: fc.constant('mode' as const), mode: fc.constantFrom<Mode>('ok', 'ok', 'unavailable', 'lostReply', 'overloaded', 'entryErrors') }) },
  { weight: 20, arbitrary: fc.record({ kind: fc.constant('deliver' as const), call: fc.nat(10) }) },
  { weight: 8, arbitrary: fc.record({ kind: fc.constant('advance' as const), ms: fc.integer({ min: 0, max: 400 }) }) },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('close' as const), limitMs: fc.integer({ min: 0, max: 600 }) }) },
);

const flush = (): Promise<void> => new Promise((r) => setImmediate(r));

function grpcError(code: number, extra: Record<string, unknown> = {}): TensorwireError {
  const details = { grpcCode: code, ...extra };
  if (code === status.UNAVAILABLE) return new ConnectionBrokenError('UNAVAILABLE', { details });
  if (code === status.DEADLINE_EXCEEDED) return new TimedOutError('DEADLINE_EXCEEDED', { details });
  if (code === status.RESOURCE_EXHAUSTED) return new ResourceExhaustedError('RESOURCE_EXHAUSTED', { details });
  return new RemoteRejectedError(`status ${code}`, { details: { ...details, remoteCode: String(code) } });
}

interface Lease {
  sessionId: string;
  acquireId: string | undefined;
  deadline: number;
  entry: RenewEntry & { deadline: number; leaseMs: number };
  requested: boolean;
  renewing: boolean;
  result: ReleaseResult | undefined;
}

/** What the runs exercised, checked at the end so the property cannot pass vacuously. */
const tallies = { confirmed: 0, failed: 0, expired: 0, maxOpen: 0, retries: 0, budget: 0 };

async function run(ops: readonly Op[], oldHolder: boolean): Promise<void> {
  const time = new FakeTime();
  const table = new LeaseTable({ holderId: 'h', lockTimeoutMs: 5000, minLeaseMs: 50, clock: time });
  let mode: Mode = 'ok';
  const pending: { deliver: () => void; settled: boolean }[] = [];
  let open = 0;
  let maxOpen = 0;
  let closed = false;
  let sendsAfterClose = 0;
  let renewAfterRelease = 0;
  let maxBatchSeen = 0;
  const sent = new Set<string>();
  const requestedKeys = new Set<string>();
  const ended = new Map<string, number>();
  const failed = new Map<string, number>();
  const key = (sessionId: string | undefined, acquireId: string | undefined): string => (sessionId ? `s:${sessionId}` : `a:${acquireId ?? ''}`);

  function call<T>(work: () => T, batched: boolean, timeoutMs: number, signal: AbortSignal): Promise<T> {
    if (closed) sendsAfterClose++;
    return new Promise<T>((resolve, reject) => {
      const p = { settled: false, deliver: () => {} };
      open++;
      maxOpen = Math.max(maxOpen, open);
      const settle = (f: () => void): void => {
        if (p.settled) return;
        p.settled = true;
        open--;
        time.clear(timer);
        f();
      };
      // The holder hangs until the call's deadline unless the test delivers it.
      const timer = time.set(() => settle(() => reject(grpcError(status.DEADLINE_EXCEEDED))), timeoutMs);
      signal.addEventListener('abort', () => settle(() => reject(signal.reason as TensorwireError)), { once: true });
      p.deliver = () =>
        settle(() => {
          if (batched && oldHolder) return reject(grpcError(status.UNIMPLEMENTED));
          if (mode === 'unavailable') return reject(grpcError(status.UNAVAILABLE));
          if (mode === 'overloaded') return reject(grpcError(status.RESOURCE_EXHAUSTED, { retryAfterMs: 30 }));
          let out: T;
          try {
            out = work();
          } catch (e) {
            return reject(grpcError(e instanceof LeaseError ? e.grpcCode : status.INTERNAL));
          }
          if (mode === 'lostReply') return reject(grpcError(status.UNAVAILABLE));
          resolve(out);
        });
      pending.push(p);
    });
  }

  const releaseOne = (sessionId: string, acquireId: string): number => {
    sent.add(key(sessionId || undefined, acquireId || undefined));
    return table.release('req', sessionId ? { sessionId } : { acquireId });
  };
  const transport: LaneTransport = {
    releaseMany: (sessionIds, acquireIds, timeoutMs, signal) =>
      call(
        () => {
          const released: number[] = [];
          const errors: EntryErrorMsg[] = [];
          [...sessionIds.map((s) => [s, ''] as const), ...acquireIds.map((a) => ['', a] as const)].forEach(([s, a], i) => {
            // Per-entry refusals: every third entry, in that mode.
            if (mode === 'entryErrors' && i % 3 === 0) {
              released.push(0);
              errors.push({ index: i, code: i % 2 === 0 ? status.PERMISSION_DENIED : status.INTERNAL, message: 'refused' });
              return;
            }
            released.push(releaseOne(s, a));
          });
          return { released, errors };
        },
        true,
        timeoutMs,
        signal,
      ),
    release: (sessionId, acquireId, timeoutMs, signal) => call(() => releaseOne(sessionId, acquireId), false, timeoutMs, signal),
    renewMany: (sessionIds, leaseMs, timeoutMs, signal) => {
      for (const s of sessionIds) if (requestedKeys.has(key(s, undefined))) renewAfterRelease++;
      return call(
        () => {
          const deadlines: number[] = [];
          const granted: number[] = [];
          const errors: EntryErrorMsg[] = [];
          sessionIds.forEach((s, i) => {
            try {
              const l = table.renew('req', s, leaseMs[i]);
              deadlines.push(l.deadline);
              granted.push(l.leaseMs);
            } catch (e) {
              deadlines.push(0);
              granted.push(0);
              errors.push({ index: i, code: (e as LeaseError).grpcCode, message: 'x' });
            }
          });
          return { deadlineUnixMs: deadlines, leaseMs: granted, errors };
        },
        true,
        timeoutMs,
        signal,
      );
    },
    renew: (sessionId, leaseMs, timeoutMs, signal) => {
      if (requestedKeys.has(key(sessionId, undefined))) renewAfterRelease++;
      return call(
        () => {
          const l = table.renew('req', sessionId, leaseMs);
          return { deadlineUnixMs: l.deadline, leaseMs: l.leaseMs };
        },
        false,
        timeoutMs,
        signal,
      );
    },
  };

  type Entry = Lease['entry'];
  const lane = new HolderLane<Entry>(
    'h:1',
    transport,
    {
      releaseRetry: () => {},
      releaseFailed: (info) => failed.set(key(info.sessionId || undefined, info.acquireId || undefined), (failed.get(key(info.sessionId || undefined, info.acquireId || undefined)) ?? 0) + 1),
      ended: (info) => {
        const k = key(info.sessionId || undefined, info.acquireId || undefined);
        ended.set(k, (ended.get(k) ?? 0) + 1);
      },
      batch: (_kind, n) => {
        maxBatchSeen = Math.max(maxBatchSeen, n);
      },
      renewed: (e, sentAt, leaseMs) => {
        e.deadline = Math.max(e.deadline, sentAt + leaseMs);
      },
      renewLost: () => {},
      renewFailed: () => {},
    },
    {
      maxInFlight: MAX_IN_FLIGHT,
      maxBatch: MAX_BATCH,
      unaryConcurrency: UNARY,
      releaseTimeoutMs: 1000,
      renewTimeoutMs: 1000,
      initialDelayMs: 10,
      maxDelayMs: 200,
      retryBudget: { burst: 1, perSecond: 5, perSuccess: 0.5 },
      timers: time,
      random: () => 0.5,
    },
  );

  const leases: Lease[] = [];
  let closeP: Promise<void> | undefined;
  let closeDone = false;
  for (const op of ops) {
    switch (op.kind) {
      case 'acquire': {
        const acquireId = op.withAcquireId ? `a${leases.length}` : undefined;
        const l = table.acquire('req', [`block:h:${leases.length}`], { leaseMs: op.leaseMs, ...(acquireId ? { acquireId } : {}) });
        const entry = { sessionId: l.sessionId, leaseMs: l.leaseMs, deadline: l.deadline, marginMs: 10, renewEveryMs: 0, renewNextAt: 0, renewState: 0 as const };
        leases.push({ sessionId: l.sessionId, acquireId, deadline: l.deadline, entry, requested: false, renewing: false, result: undefined });
        break;
      }
      case 'release': {
        const l = leases[op.lease];
        if (l === undefined || l.requested) break;
        l.requested = true;
        lane.removeAutoRenew(l.entry);
        const byAcquire = l.acquireId !== undefined;
        requestedKeys.add(key(byAcquire ? undefined : l.sessionId, l.acquireId));
        if (byAcquire) requestedKeys.add(key(l.sessionId, undefined));
        void lane.release(byAcquire ? { acquireId: l.acquireId as string } : { sessionId: l.sessionId }, l.entry.deadline).then((r) => (l.result = r));
        break;
      }
      case 'renew': {
        const l = leases[op.lease];
        if (l === undefined || l.requested || l.renewing) break;
        l.renewing = true;
        l.entry.renewEveryMs = op.everyMs;
        lane.addAutoRenew(l.entry);
        break;
      }
      case 'mode':
        mode = op.mode;
        break;
      case 'deliver': {
        const live = pending.filter((p) => !p.settled);
        live[op.call % Math.max(1, live.length)]?.deliver();
        break;
      }
      case 'advance':
        time.advance(op.ms);
        break;
      case 'close':
        closeP ??= lane.close(op.limitMs).then(() => {
          closeDone = true;
        });
        break;
    }
    await flush();
  }
  closeP ??= lane.close(500).then(() => {
    closeDone = true;
  });
  for (let i = 0; i < 5000 && !closeDone; i++) {
    const live = pending.filter((p) => !p.settled);
    if (live.length > 0 && i % 2 === 0) live[0]?.deliver();
    else time.advance(50);
    await flush();
  }
  expect(closeDone).toBe(true);
  closed = true;
  await flush();

  // Every release ended exactly once, with one outcome, consistent with the holder.
  for (const l of leases) {
    if (!l.requested) continue;
    const k = key(l.acquireId === undefined ? l.sessionId : undefined, l.acquireId);
    expect(l.result, `release of ${k} ended`).toBeDefined();
    expect(ended.get(k)).toBe(1);
    const r = l.result as ReleaseResult;
    if (r.confirmed) {
      expect(table.get(l.sessionId)).toBeUndefined();
      expect(failed.get(k) ?? 0).toBe(0);
    } else if (r.expired === true) {
      expect(r.attempts).toBe(0);
      expect(sent.has(k)).toBe(false);
      expect(failed.get(k) ?? 0).toBe(0);
    } else {
      expect(r.error).toBeDefined();
      expect(failed.get(k)).toBe(1);
    }
  }
  // A release after close resolves at once, unconfirmed, and sends nothing.
  const late = await lane.release({ sessionId: 'session:h:late' }, time.now() + 1000);
  expect(late.confirmed).toBe(false);
  expect(sendsAfterClose).toBe(0);
  expect(pending.every((p) => p.settled)).toBe(true);
  expect(time.live).toBe(0);
  expect(renewAfterRelease).toBe(0);
  expect(maxBatchSeen).toBeLessThanOrEqual(oldHolder ? UNARY : MAX_BATCH);
  expect(maxOpen).toBeLessThanOrEqual(oldHolder ? MAX_IN_FLIGHT * UNARY : MAX_IN_FLIGHT);
  const stats = lane.stats();
  expect(stats).toMatchObject({ releaseQueued: 0, inFlight: 0 });
  for (const l of leases) if (l.result) tallies[l.result.confirmed ? 'confirmed' : l.result.expired ? 'expired' : 'failed']++;
  tallies.maxOpen = Math.max(tallies.maxOpen, maxOpen);
  tallies.retries += stats.releaseRetries;
  tallies.budget += stats.budgetExhausted;
  // The holder's books: whatever was not released expires; nothing stays.
  table.expireDue(time.now() + 1_000_000);
  const c = table.counters();
  expect(c.acquired).toBe(c.released + c.expired + c.active);
  expect(c.active).toBe(0);
}

describe('HolderLane (property)', () => {
  it('ends every release exactly once, within the in-flight bound, whatever the interleaving', async () => {
    const property = fc.asyncProperty(fc.array(opArb, { minLength: 10, maxLength: 120, size: 'max' }), fc.boolean(), (ops, oldHolder) => run(ops, oldHolder));
    // 150 interleavings of a fixed seed, so that the coverage checked below is the same on every
    // run (an expiry in the queue comes in about 3 of 150 random runs: a random set alone missed
    // it once in CI), then 150 new ones each run.
    await fc.assert(property, { numRuns: 150, seed: 7 });
    const seeded = { ...tallies };
    await fc.assert(property, { numRuns: 150 });
    if (process.env['TENSORWIRE_LANE_TALLIES']) console.log({ seeded, all: tallies });
    // Every outcome, retries, an empty retry budget and a full in-flight window all happened, in the seeded runs alone.
    expect(seeded.confirmed).toBeGreaterThan(0);
    expect(seeded.failed).toBeGreaterThan(0);
    expect(seeded.expired).toBeGreaterThan(0);
    expect(seeded.retries).toBeGreaterThan(0);
    expect(seeded.budget).toBeGreaterThan(0);
    expect(seeded.maxOpen).toBeGreaterThanOrEqual(MAX_IN_FLIGHT);
  });
});
