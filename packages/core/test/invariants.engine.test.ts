/**
 * Mutation-audit gaps of the engine (issue 14), each shown to fail with the guarded line broken
 * (see the package README, "Mutation testing"):
 *
 * - invariant 2: invalidating a connection removes its table entry itself, even when the
 *   transport's close() never calls the onClose listeners (a transport may call them later).
 * - invariant 4: the caller's AbortSignal ends a transfer with AbortedError (never success, never
 *   the deadline's TimedOutError), and the engine's defaultTimeoutMs bounds a transfer against a
 *   peer that never answers.
 * - invariant 7: while our own open is in flight, an inbound connection wins only when the peer
 *   has the smaller node id; otherwise it is retired and our outbound one is kept.
 *
 * The probe transport below is an in-process test double (no bytes move); it only shows the
 * engine's decisions: which connections it keeps, retires and closes, and how transfers end.
 */
import { describe, expect, it } from 'vitest';
import type {
  TensorwireError} from '../src/index.js';
import {
  AbortedError,
  ConnectionBrokenError,
  TRANSPORT_SPECIFICATION_VERSION,
  TimedOutError,
  TransferEngine,
  silentLogger,
  type ConnectOptions,
  type ExecuteOptions,
  type Memory,
  type NodeIdentity,
  type TransferBatch,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
} from '../src/index.js';
import { bounded, outcome, tick } from './helpers/settle.js';

type ExecuteMode = 'ok' | 'hang' | 'break' | 'ignore-signal';

class ProbeConnection implements TransportConnection {
  readonly transport: string;
  readonly streams: number;
  isOpen = true;
  retired = false;
  closedWith: TensorwireError | undefined;
  closes = 0;
  executes = 0;
  readonly #listeners: ((e: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  constructor(
    readonly owner: ProbeTransport,
    readonly peer: NodeIdentity,
    readonly initiator: string,
    streams: number,
  ) {
    this.transport = owner.name;
    this.streams = streams;
  }
  async execute(_stream: number, _batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    this.executes++;
    this.owner.lastExecute = options;
    if (!this.isOpen) throw new ConnectionBrokenError('probe connection is closed');
    if (options.signal.aborted) throw options.signal.reason;
    this.owner.onExecute?.();
    const mode = this.owner.mode.shift() ?? this.owner.defaultMode;
    if (mode === 'ok') return;
    if (mode === 'break') throw new ConnectionBrokenError('probe: the peer reset the connection');
    if (mode === 'ignore-signal') {
      await this.owner.ignoreGate;
      return;
    }
    // 'hang': a peer that accepted the connection and stopped answering; the signal ends it.
    await new Promise<void>((_, reject) => {
      const fail = (): void => reject(options.signal.reason as Error);
      if (options.signal.aborted) fail();
      else options.signal.addEventListener('abort', fail, { once: true });
    });
  }
  onClose(listener: (error: TensorwireError | undefined) => void): void {
    this.#listeners.push(listener);
  }
  onRetire(listener: () => void): void {
    this.#retireListeners.push(listener);
  }
  async retire(): Promise<void> {
    this.retired = true;
    this.isOpen = false;
  }
  async close(error?: TensorwireError): Promise<void> {
    this.closes++;
    if (!this.isOpen) return;
    this.isOpen = false;
    this.closedWith = error;
    // A transport that reports the close later (or never): the engine must not rely on it.
    if (!this.owner.silentClose) for (const l of this.#listeners.splice(0)) l(error);
  }
}

class ProbeTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name = 'probe';
  readonly capabilities: TransportCapabilities = {
    local: true,
    remote: true,
    memoryKinds: ['host'],
    oneSidedRead: true,
    oneSidedWrite: true,
    scopedGrants: false,
    rank: 5,
    maxStreams: 1,
    maxChunkBytes: 1 << 30,
  };
  host: TransportHost | undefined;
  silentClose = false;
  defaultMode: ExecuteMode = 'ok';
  mode: ExecuteMode[] = [];
  ignoreGate: Promise<void> = Promise.resolve();
  onExecute: (() => void) | undefined;
  lastExecute: ExecuteOptions | undefined;
  /** Outbound connects: when `holdConnect`, each waits for the test to resolve it. */
  holdConnect = false;
  readonly pending: { peer: NodeIdentity; streams: number; resolve: (c: ProbeConnection) => void; options: ConnectOptions }[] = [];
  readonly connections: ProbeConnection[] = [];
  async start(host: TransportHost): Promise<void> {
    this.host = host;
  }
  endpoint(): Uint8Array {
    return new Uint8Array([1]);
  }
  unreachableReason(): string | undefined {
    return undefined;
  }
  async register(memory: Memory): Promise<{ handle: object; payload: Uint8Array }> {
    return { handle: { memory }, payload: new Uint8Array([7]) };
  }
  async revoke(): Promise<void> {}
  decodeRemote(payload: Uint8Array): unknown {
    return payload[0];
  }
  connectCalls = 0;
  connect(peer: NodeIdentity, _endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    this.connectCalls++;
    const me = this.host?.identity.nodeId ?? '?';
    if (this.holdConnect) {
      return new Promise<TransportConnection>((resolve) => this.pending.push({ peer, streams: options.streams, options, resolve }));
    }
    const c = new ProbeConnection(this, peer, me, options.streams);
    this.connections.push(c);
    return Promise.resolve(c);
  }
  /** A connection `peer` opened to us (its initiator is the peer). */
  inbound(peer: NodeIdentity): ProbeConnection {
    const c = new ProbeConnection(this, peer, peer.nodeId, 1);
    this.connections.push(c);
    this.host?.inbound(c);
    return c;
  }
  /** Complete the oldest held outbound connect. */
  land(): ProbeConnection {
    const p = this.pending.shift();
    if (!p) throw new Error('no connect in flight');
    const c = new ProbeConnection(this, p.peer, this.host?.identity.nodeId ?? '?', p.streams);
    this.connections.push(c);
    p.resolve(c);
    return c;
  }
  async close(): Promise<void> {
    for (const c of this.connections) await c.close();
  }
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

let n = 0;
async function setup(me: string, peer: string, extra: Record<string, unknown> = {}) {
  const tag = `${++n}`;
  const ta = new ProbeTransport();
  const tb = new ProbeTransport();
  const a = new TransferEngine({ nodeId: `${me}${tag}`, transports: [ta], logger: silentLogger, metrics: false, ...extra });
  const b = new TransferEngine({ nodeId: `${peer}${tag}`, transports: [tb], logger: silentLogger, metrics: false });
  await a.start();
  await b.start();
  const local = await a.register({ kind: 'host', buffer: new Uint8Array(64) });
  const remote = (await b.register({ kind: 'host', buffer: new Uint8Array(64) })).descriptor;
  const read = (options: Parameters<TransferEngine['read']>[2] = {}) => a.read(b.endpoint(), [{ local, remote }], options);
  return {
    a,
    b,
    ta,
    read,
    async [Symbol.asyncDispose]() {
      await a.close();
      await b.close();
    },
  };
}

describe('invariant 2: invalidating a connection is one removal from the table, whatever the transport reports', () => {
  it('a broken connection whose close() never fires onClose is out of the table at once; the next transfer opens a new one', async () => {
    await using s = await setup('inv-a', 'inv-b');
    s.ta.silentClose = true;
    s.ta.mode.push('break');
    const err = await outcome(s.read());
    expect(err).toBeInstanceOf(ConnectionBrokenError);
    const first = s.ta.connections[0] as ProbeConnection;
    expect(first.isOpen).toBe(false);
    expect(first.closes).toBeGreaterThan(0);
    // The entry is gone although no onClose listener ran.
    expect(s.a.connections()).toEqual([]);
    await s.read();
    expect(s.ta.connectCalls).toBe(2);
    expect(first.executes).toBe(1);
    const second = s.ta.connections[1] as ProbeConnection;
    expect(second.executes).toBe(1);
    expect(s.a.connections().map((c) => c.state)).toEqual(['open']);
  });
});

describe('invariant 4: every transfer has a deadline and an AbortSignal', () => {
  it("the caller's abort while the peer does not answer rejects with AbortedError, not the deadline's TimedOutError", async () => {
    await using s = await setup('ab-a', 'ab-b');
    s.ta.defaultMode = 'hang';
    const ac = new AbortController();
    s.ta.onExecute = () => ac.abort();
    const err = await bounded(s.read({ signal: ac.signal, timeoutMs: 4000 }));
    expect(err).toBeInstanceOf(AbortedError);
    expect(s.ta.connections[0]?.executes).toBe(1);
  });

  it('an already-aborted signal rejects with AbortedError and moves nothing', async () => {
    await using s = await setup('ab-c', 'ab-d');
    await s.read(); // connection established
    const ac = new AbortController();
    ac.abort();
    const err = await outcome(s.read({ signal: ac.signal, timeoutMs: 4000 }));
    expect(err).toBeInstanceOf(AbortedError);
    expect(s.ta.connections[0]?.executes).toBe(1);
  });

  it('an abort during a connect that never completes rejects with AbortedError', async () => {
    await using s = await setup('ab-e', 'ab-f', { connectTimeoutMs: 60_000 });
    s.ta.holdConnect = true;
    const ac = new AbortController();
    const p = outcome(s.read({ signal: ac.signal, timeoutMs: 4000 }));
    while (s.ta.pending.length === 0) await tick();
    ac.abort();
    expect(await p).toBeInstanceOf(AbortedError);
  });

  it('without timeoutMs a transfer against a peer that never answers ends with TimedOutError after defaultTimeoutMs', async () => {
    await using s = await setup('dl-a', 'dl-b', { defaultTimeoutMs: 200 });
    s.ta.defaultMode = 'hang';
    const before = Date.now();
    const err = await bounded(s.read());
    expect(err).toBeInstanceOf(TimedOutError);
    // The transport was handed the default deadline (not an infinite one).
    const deadline = s.ta.lastExecute?.deadline as number;
    expect(Number.isFinite(deadline)).toBe(true);
    expect(deadline).toBeGreaterThanOrEqual(before + 200);
    expect(deadline).toBeLessThanOrEqual(Date.now() + 200);
  });

  it('engine.connect against a peer whose handshake never completes ends with TimedOutError after defaultTimeoutMs', async () => {
    await using s = await setup('dl-c', 'dl-d', { defaultTimeoutMs: 200, connectTimeoutMs: 60_000 });
    s.ta.holdConnect = true;
    const err = await bounded(s.a.connect(s.b.endpoint()));
    expect(err).toBeInstanceOf(TimedOutError);
  });
});

describe('invariant 7: simultaneous open while our own open is in flight', () => {
  it('the peer has the larger id: its inbound connection is retired, ours is kept when it lands', async () => {
    await using s = await setup('sa', 'sb'); // "sa<n>" < "sb<n>": our connection wins
    s.ta.holdConnect = true;
    const connecting = s.a.connect(s.b.endpoint());
    while (s.ta.pending.length === 0) await tick();
    const inbound = s.ta.inbound(s.b.identity);
    await tick();
    expect(inbound.retired).toBe(true);
    const outbound = s.ta.land();
    const info = await connecting;
    expect(info.initiator).toBe(s.a.identity.nodeId);
    expect(outbound.retired).toBe(false);
    expect(outbound.isOpen).toBe(true);
    expect(s.a.connections().map((c) => c.initiator)).toEqual([s.a.identity.nodeId]);
    await s.read();
    expect(outbound.executes).toBe(1);
    expect(inbound.executes).toBe(0);
  });

  it('the peer has the smaller id: its inbound connection is adopted, ours is retired when it lands', async () => {
    await using s = await setup('sd', 'sc'); // "sc<n>" < "sd<n>": the peer's connection wins
    s.ta.holdConnect = true;
    const connecting = s.a.connect(s.b.endpoint());
    while (s.ta.pending.length === 0) await tick();
    const inbound = s.ta.inbound(s.b.identity);
    const info = await connecting;
    expect(info.initiator).toBe(s.b.identity.nodeId);
    expect(inbound.retired).toBe(false);
    const outbound = s.ta.land();
    await tick();
    expect(outbound.retired).toBe(true);
    expect(s.a.connections().map((c) => c.initiator)).toEqual([s.b.identity.nodeId]);
    await s.read();
    expect(inbound.executes).toBe(1);
    expect(outbound.executes).toBe(0);
  });
});
