/**
 * The expiry GC's timer. It sleeps until the earliest lease deadline plus a small
 * coalescing window (an eighth of the shortest lease the table grants), sweeps what is
 * due, and sleeps again. Leases are never scanned: each wake-up pops only due heap
 * entries. With timers on time, a lease outlives its deadline by at most an eighth of the
 * shortest lease, well inside the quarter of its own timeout the protocol promises.
 */
import type { LeaseTable } from './lease-table.js';

/** Timer functions, injectable for tests. */
export interface Timers {
  setTimeout(fn: () => void, ms: number): unknown;
  clearTimeout(handle: unknown): void;
}

export const systemTimers: Timers = {
  setTimeout: (fn, ms) => {
    const t = setTimeout(fn, ms);
    t.unref();
    return t;
  },
  clearTimeout: (h) => clearTimeout(h as NodeJS.Timeout),
};

export interface ExpirySchedulerOptions {
  readonly timers?: Timers;
  /** Called after a sweep that expired something. */
  readonly onSweep?: (expired: number) => void;
}

export class ExpiryScheduler {
  readonly #table: LeaseTable;
  readonly #timers: Timers;
  readonly #onSweep: ((expired: number) => void) | undefined;
  readonly slackMs: number;
  #handle: unknown;
  #armedFor = Number.POSITIVE_INFINITY;
  #running = false;

  constructor(table: LeaseTable, options: ExpirySchedulerOptions = {}) {
    this.#table = table;
    this.#timers = options.timers ?? systemTimers;
    this.#onSweep = options.onSweep;
    this.slackMs = Math.max(1, Math.floor(table.minLeaseMs / 8));
  }

  /** When the timer is set to fire (clock ms), or Infinity. */
  get armedFor(): number {
    return this.#armedFor;
  }

  start(): void {
    if (this.#running) return;
    this.#running = true;
    this.notify();
  }

  stop(): void {
    this.#running = false;
    this.#disarm();
  }

  /** Call after anything that may have moved the earliest deadline earlier (acquire, renew). */
  notify(): void {
    if (!this.#running) return;
    const next = this.#table.nextDeadline();
    if (next === undefined) return;
    const target = next + this.slackMs;
    if (target >= this.#armedFor) return;
    this.#arm(target);
  }

  /** Sweep now (also what the timer does). */
  sweep(): number {
    const expired = this.#table.expireDue();
    if (expired > 0) this.#onSweep?.(expired);
    return expired;
  }

  #arm(target: number): void {
    this.#disarm();
    this.#armedFor = target;
    // setTimeout holds at most 2^31-1 ms; a later deadline re-arms when this fires early.
    const delay = Math.min(0x7fffffff, Math.max(0, Math.ceil(target - this.#table.clock.now())));
    this.#handle = this.#timers.setTimeout(() => this.#fire(), delay);
  }

  #disarm(): void {
    if (this.#handle !== undefined) this.#timers.clearTimeout(this.#handle);
    this.#handle = undefined;
    this.#armedFor = Number.POSITIVE_INFINITY;
  }

  #fire(): void {
    this.#handle = undefined;
    this.#armedFor = Number.POSITIVE_INFINITY;
    if (!this.#running) return;
    this.sweep();
    this.notify();
  }
}
