/**
 * Peer events: the bounds and policies a transport applies to its peers (a connection refused
 * past a limit, a socket closed for a protocol violation, an idle connection retired, …),
 * counted per kind, logged at most once a second per kind, and counted in prom-client.
 *
 * One {@link PeerEvents} per transport (or per family of events). Every event is counted (in
 * {@link PeerEvents.counts} and, when given one, in the counter
 * `tensorwire_transport_peer_events_total{transport,event}`); a flood of one kind is logged once
 * per interval, and the next line logged for that kind says how many were left out since the
 * previous one (`suppressed`). Not a hot path: peer events are rare by design.
 */
import { Counter, Registry } from 'prom-client';
import type { Logger } from '../logger.js';
import type { MetricsOptions } from '../metrics.js';

/** How one kind of peer event is logged: the level and the message (used verbatim). */
export interface PeerEventText {
  readonly level: 'warn' | 'info' | 'debug';
  readonly text: string;
}

/** The counter of peer events: `transport` is the transport's name, `event` the kind. */
export type PeerEventCounter = Counter<'transport' | 'event'>;

export interface PeerEventsOptions<E extends string> {
  /** The `transport` label of the counter (the transport's name). */
  readonly transport: string;
  /**
   * How each kind is logged. A table (every kind listed: each starts at 0 in
   * {@link PeerEvents.counts}), or a function for an open set of kinds (a kind appears in
   * `counts()` once it has happened).
   */
  readonly texts: Readonly<Record<E, PeerEventText>> | ((event: E) => PeerEventText);
  /** Where to count each event too (see {@link KitMetrics}); none: counted in `counts()` only. */
  readonly counter?: PeerEventCounter | undefined;
  /** Each kind is logged at most once per this many milliseconds. Default 1000. */
  readonly intervalMs?: number;
  /** The clock (ms). Default `Date.now`; tests pass a fake one. */
  readonly now?: () => number;
}

/** Each kind of peer event is logged at most this often by default (all are counted). */
export const PEER_EVENT_LOG_INTERVAL_MS = 1000;

/** The kit's metrics: bounds and policies applied to peers. Transports sharing a registry share the counter. */
export class KitMetrics {
  readonly registry: Registry;
  readonly peerEvents: PeerEventCounter;
  constructor(options: MetricsOptions = {}) {
    const registry = options.registry ?? new Registry();
    const name = `${options.prefix ?? 'tensorwire_'}transport_peer_events_total`;
    this.registry = registry;
    this.peerEvents =
      (registry.getSingleMetric(name) as PeerEventCounter | undefined) ??
      new Counter({
        name,
        help: 'Bounds and policies applied to peers, by transport and event (e.g. request_queue and protocol_violation: connection closed; connections, peer_connections, pending_handshakes: new connection refused; handshake_timeout: closed; idle: retired)',
        labelNames: ['transport', 'event'],
        registers: [registry],
      });
  }
}

/** `metrics` option of a transport (`MetricsOptions | false | undefined`) to its {@link KitMetrics} (undefined when false). */
export function kitMetrics(options: MetricsOptions | false | undefined): KitMetrics | undefined {
  return options === false ? undefined : new KitMetrics(options ?? {});
}

/** Counts, rate-limited logs and prom-client counts of one transport's peer events. */
export class PeerEvents<E extends string> {
  readonly transport: string;
  readonly intervalMs: number;
  readonly #text: (event: E) => PeerEventText;
  readonly #counter: PeerEventCounter | undefined;
  readonly #now: () => number;
  readonly #counts: Record<string, number> = {};
  /** When each kind was last logged, and how many of it were not logged since. */
  readonly #lastLogged = new Map<E, number>();
  readonly #suppressed = new Map<E, number>();

  constructor(options: PeerEventsOptions<E>) {
    const intervalMs = options.intervalMs ?? PEER_EVENT_LOG_INTERVAL_MS;
    if (!Number.isFinite(intervalMs) || intervalMs < 0) throw new RangeError(`intervalMs must be a finite number >= 0, got ${intervalMs}`);
    this.transport = options.transport;
    this.intervalMs = intervalMs;
    this.#counter = options.counter;
    this.#now = options.now ?? Date.now;
    const texts = options.texts;
    if (typeof texts === 'function') {
      this.#text = texts;
    } else {
      this.#text = (event) => texts[event];
      for (const k of Object.keys(texts)) this.#counts[k] = 0;
    }
  }

  /**
   * Count one event of this kind (and in the counter), and log it unless this kind was logged
   * less than `intervalMs` ago; the line says how many were left out since the last one. With no
   * logger the event is only counted (and does not start an interval). Returns whether it was logged.
   */
  record(event: E, peer: string | undefined, reason: string, logger: Logger | undefined): boolean {
    const count = (this.#counts[event] ?? 0) + 1;
    this.#counts[event] = count;
    this.#counter?.inc({ transport: this.transport, event });
    if (!logger) return false;
    const now = this.#now();
    const last = this.#lastLogged.get(event);
    if (last !== undefined && now - last < this.intervalMs) {
      this.#suppressed.set(event, (this.#suppressed.get(event) ?? 0) + 1);
      return false;
    }
    this.#lastLogged.set(event, now);
    const suppressed = this.#suppressed.get(event) ?? 0;
    this.#suppressed.delete(event);
    const { level, text } = this.#text(event);
    logger[level](text, { event, peer, reason, count, ...(suppressed > 0 ? { suppressed } : {}) });
    return true;
  }

  /** How often one kind happened. */
  count(event: E): number {
    return this.#counts[event] ?? 0;
  }

  /** A snapshot: every kind of the table (0 if none yet), or, for an open set, each kind that happened. */
  counts(): Record<E, number> {
    return { ...this.#counts } as Record<E, number>;
  }
}
