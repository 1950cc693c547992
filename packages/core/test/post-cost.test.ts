/**
 * The engine's per-post machinery (issue 11, fixed cost per post): one engine timer over a
 * deadline heap instead of a timer per call, reused AbortControllers, no closure per call.
 * Invariant 4 must hold through it: the caller's abort or the deadline settles the call with
 * AbortedError / TimedOutError, transports see a signal that fires on either, and nothing
 * (timer, listener) is left behind after the call.
 */
import { getEventListeners } from 'node:events';
import { describe, expect, it } from 'vitest';
import {
  AbortedError,
  ClosedError,
  ResourceExhaustedError,
  TimedOutError,
  TRANSPORT_SPECIFICATION_VERSION,
  TransferEngine,
  silentLogger,
  type ExecuteOptions,
  type NodeIdentity,
  type TransferBatch,
  type Transport,
  type TransportConnection,
  type TransportHost,
} from '../src/index.js';

type Mode = 'ok' | 'hang' | 'leak' | 'exhausted';

/** A transport whose execute resolves at once, hangs until its signal fires, or misbehaves. */
class ProbeTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name = 'probe';
  readonly capabilities = { local: true, remote: true, memoryKinds: ['host' as const], oneSidedRead: true, oneSidedWrite: true, scopedGrants: false, rank: 5, maxStreams: 8, maxChunkBytes: 1 << 30 };
  host: TransportHost | undefined;
  mode: Mode = 'ok';
  /** Queued modes for the next executes, before `mode`. */
  readonly next: Mode[] = [];
  readonly signals: AbortSignal[] = [];
  executes = 0;
  #token = 0;
  async start(host: TransportHost): Promise<void> {
    this.host = host;
  }
  endpoint(): Uint8Array {
    return new Uint8Array([1]);
  }
  unreachableReason(): string | undefined {
    return undefined;
  }
  async register(): Promise<{ handle: object; payload: Uint8Array }> {
    return { handle: {}, payload: new Uint8Array([++this.#token]) };
  }
  async revoke(): Promise<void> {}
  decodeRemote(payload: Uint8Array): unknown {
    return payload;
  }
  async connect(peer: NodeIdentity, _endpoint: Uint8Array, options: { streams: number }): Promise<TransportConnection> {
    const execute = (o: ExecuteOptions): Promise<void> => this.#execute(o);
    const initiator = this.host?.identity.nodeId ?? '?';
    return {
      transport: 'probe',
      peer,
      initiator,
      streams: options.streams,
      isOpen: true,
      execute: (_stream: number, _batch: TransferBatch, o: ExecuteOptions): Promise<void> => execute(o),
      onClose(): void {},
      onRetire(): void {},
      async retire(): Promise<void> {},
      async close(): Promise<void> {},
    } as TransportConnection;
  }
  #execute(o: ExecuteOptions): Promise<void> {
    this.executes++;
    this.signals.push(o.signal);
    const mode = this.next.shift() ?? this.mode;
    if (o.signal.aborted) return Promise.reject(o.signal.reason as Error);
    if (mode === 'ok') return Promise.resolve();
    if (mode === 'exhausted') return Promise.reject(new ResourceExhaustedError('probe: no send slots'));
    if (mode === 'leak') {
      o.signal.addEventListener('abort', () => undefined); // a transport bug: never removed
      return Promise.resolve();
    }
    return new Promise<void>((_resolve, reject) => {
      o.signal.addEventListener('abort', () => reject(o.signal.reason as Error), { once: true });
    });
  }
  async close(): Promise<void> {}
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

async function setup(streamsPerPeer = 2) {
  const t = new ProbeTransport();
  const a = new TransferEngine({ nodeId: 'pc-a', transports: [t], logger: silentLogger, metrics: false, streamsPerPeer });
  const b = new TransferEngine({ nodeId: 'pc-b', transports: [new ProbeTransport()], logger: silentLogger, metrics: false });
  await a.start();
  await b.start();
  const rb = await b.register({ kind: 'host', buffer: new Uint8Array(64) });
  const ra = await a.register({ kind: 'host', buffer: new Uint8Array(64) });
  const requests = [{ local: ra, remote: rb.descriptor }];
  return {
    a,
    t,
    requests,
    read: (o: { signal?: AbortSignal; timeoutMs?: number; deadline?: number } = {}) => a.read(b.endpoint(), requests, o),
    prepare: () => a.prepare(b.endpoint(), requests, { op: 'read' }),
    async [Symbol.asyncDispose]() {
      await a.close();
      await b.close();
    },
  };
}

const refTimers = (): number => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length;

describe('per-post deadlines on one engine timer', () => {
  it('many concurrent posts with different deadlines each time out by their own deadline, in deadline order', async () => {
    await using s = await setup();
    s.t.mode = 'hang';
    const timeouts = [170, 50, 290, 110, 20, 230, 80, 260, 140, 200, 35, 320];
    const order: number[] = [];
    const results = timeouts.map((ms) => {
      const deadline = Date.now() + ms;
      return s.read({ timeoutMs: ms }).then(
        () => ({ ms, error: undefined as unknown, late: 0 }),
        (error: unknown) => {
          order.push(ms);
          return { ms, error, late: Date.now() - deadline };
        },
      );
    });
    await new Promise((r) => setImmediate(r));
    expect(s.a.deadlineState.inFlight).toBe(timeouts.length);
    expect(s.a.deadlineState.timer).toBe(true);
    const settled = await Promise.all(results);
    for (const r of settled) {
      expect(r.error).toBeInstanceOf(TimedOutError);
      expect((r.error as TimedOutError).message).toMatch(/^deadline passed \(\d+ ms after the call\)/);
      expect(r.late).toBeGreaterThanOrEqual(0); // never before its own deadline
    }
    expect(order).toEqual([...timeouts].sort((x, y) => x - y));
    expect(s.a.deadlineState.inFlight).toBe(0);
    // Every signal a transport saw fired (each post is its own), and none has a listener left.
    expect(new Set(s.t.signals).size).toBe(timeouts.length);
    for (const sig of s.t.signals) {
      expect(sig.aborted).toBe(true);
      expect(getEventListeners(sig, 'abort')).toHaveLength(0);
    }
  });

  it('an absolute deadline earlier than the timeout wins, and a deadline already past fails before any execute', async () => {
    await using s = await setup();
    s.t.mode = 'hang';
    const e = await s.read({ timeoutMs: 60_000, deadline: Date.now() + 30 }).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(TimedOutError);
    const before = s.t.executes;
    const past = await s.read({ deadline: Date.now() - 1 }).catch((x: unknown) => x);
    expect(past).toBeInstanceOf(TimedOutError);
    expect(s.t.executes).toBe(before); // the transport saw an aborted signal or nothing
    expect(s.a.deadlineState.inFlight).toBe(0);
  });

  it('posts leave no referenced timer and no listener behind; the engine timer is dropped on close', async () => {
    const base = refTimers();
    const s = await setup();
    const ac = new AbortController();
    const prepared = await s.prepare();
    for (let i = 0; i < 50; i++) {
      await prepared.run(i % 2 ? { signal: ac.signal } : {});
      await s.read({ signal: ac.signal, timeoutMs: 1000 + i });
    }
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    expect(s.a.deadlineState.inFlight).toBe(0);
    // The engine timer may stay armed for its earliest deadline, but never keeps the process alive.
    expect(refTimers()).toBe(base);
    await prepared.close();
    await s[Symbol.asyncDispose]();
    expect(s.a.deadlineState.timer).toBe(false);
    expect(refTimers()).toBe(base);
  });

  it("a caller's abort ends the post with AbortedError and leaves no listener, in-flight entry or reusable signal", async () => {
    await using s = await setup();
    s.t.mode = 'hang';
    const ac = new AbortController();
    const prepared = await s.prepare();
    const p = prepared.run({ signal: ac.signal, timeoutMs: 60_000 });
    await new Promise((r) => setImmediate(r));
    expect(s.a.deadlineState.inFlight).toBe(1);
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(1);
    ac.abort();
    await expect(p).rejects.toBeInstanceOf(AbortedError);
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    expect(s.a.deadlineState.inFlight).toBe(0);
    const fired = s.t.signals.at(-1) as AbortSignal;
    expect(fired.aborted).toBe(true);
    // A post with an already-aborted caller signal fails at once, without a listener added.
    await expect(prepared.run({ signal: ac.signal })).rejects.toBeInstanceOf(AbortedError);
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    // Later posts never see a signal that already fired.
    s.t.mode = 'ok';
    await prepared.run();
    expect(s.t.signals.at(-1)).not.toBe(fired);
    expect(s.t.signals.at(-1)?.aborted).toBe(false);
    await prepared.close();
  });

  it('a signal is handed to a later post only if it never fired and no listener is left on it', async () => {
    await using s = await setup();
    await s.read();
    await s.read();
    const [first, second] = s.t.signals;
    expect(second).toBe(first); // clean: reused
    s.t.mode = 'leak';
    await s.read();
    const leaked = s.t.signals.at(-1) as AbortSignal;
    expect(getEventListeners(leaked, 'abort')).toHaveLength(1);
    s.t.mode = 'ok';
    for (let i = 0; i < 5; i++) await s.read();
    expect(s.t.signals.slice(-5)).not.toContain(leaked);
  });

  it('engine close aborts posts in flight with ClosedError', async () => {
    const s = await setup();
    s.t.mode = 'hang';
    const prepared = await s.prepare();
    const posts = [prepared.run({ timeoutMs: 60_000 }), s.read({ timeoutMs: 50_000 })];
    await new Promise((r) => setImmediate(r));
    const closing = prepared.close();
    let closed = false;
    void closing.then(() => (closed = true));
    await new Promise((r) => setTimeout(r, 10));
    expect(closed).toBe(false); // prepared.close() waits for its post in flight
    await s[Symbol.asyncDispose]();
    for (const p of posts) await expect(p).rejects.toBeInstanceOf(ClosedError);
    await closing;
    expect(s.a.deadlineState).toEqual({ inFlight: 0, timer: false, pooled: expect.any(Number) });
  });

  it('a single-stream post backs off on local exhaustion and then succeeds (invariant 5 on the fast path)', async () => {
    await using s = await setup(1);
    s.t.next.push('exhausted', 'exhausted');
    const report = await s.read();
    expect(report.bytes).toBe(64);
    expect(s.t.executes).toBe(3);
    const prepared = await s.prepare();
    s.t.next.push('exhausted');
    await prepared.run();
    expect(s.t.executes).toBe(5);
    await prepared.close();
  });
});
