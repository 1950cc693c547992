/**
 * Tests written to kill surviving Stryker mutants of the engine's connection table, deadline /
 * abort handling and simultaneous open (src/engine.ts: #deadlineSignal, #transfer, #post,
 * #execute, #connection, #open, #adopt, #inbound, #invalidateEntry, #dispose, invalidate,
 * #close; see the package README, "Mutation testing"). They assert what a caller sees: how a
 * transfer ends (error class, message, details), the connection table (`connections()`), the
 * connection lifecycle metrics (`tensorwire_connection_events_total`, `tensorwire_connections`),
 * and which connections the engine keeps, retires and closes.
 *
 * The probe transport is an in-process test double (no bytes move), like the one in
 * test/invariants.engine.test.ts.
 */
import { getEventListeners } from 'node:events';
import { describe, expect, it } from 'vitest';
import {
  AbortedError,
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  ResourceExhaustedError,
  TRANSPORT_SPECIFICATION_VERSION,
  type TensorwireError,
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

type ExecuteMode = 'ok' | 'hang' | 'break' | 'exhausted' | 'fail';

class ProbeConnection implements TransportConnection {
  readonly transport: string;
  readonly streams: number;
  isOpen = true;
  retired = false;
  closedWith: TensorwireError | undefined;
  closes = 0;
  executes = 0;
  readonly #listeners: ((e: TensorwireError | undefined) => void)[] = [];
  readonly retireListeners: (() => void)[] = [];
  readonly #hanging = new Set<(e: Error) => void>();
  /** The error of the last close() call (also when the connection was no longer open). */
  lastCloseError: TensorwireError | undefined;
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
    const mode = this.owner.mode.shift() ?? this.owner.defaultMode;
    this.owner.onExecute?.(this);
    if (mode === 'ok') return;
    if (mode === 'break') throw new ConnectionBrokenError('probe: the peer reset the connection');
    if (mode === 'exhausted') throw new ResourceExhaustedError('probe: no send credit');
    if (mode === 'fail') throw new InvalidInputError('probe: refused');
    // 'hang': the peer stopped answering; the signal or closing the connection ends it.
    await new Promise<void>((_, reject) => {
      const fail = (): void => reject(options.signal.reason as Error);
      this.#hanging.add(reject);
      if (options.signal.aborted) fail();
      else options.signal.addEventListener('abort', fail, { once: true });
    });
  }
  onClose(listener: (e: TensorwireError | undefined) => void): void {
    this.#listeners.push(listener);
  }
  onRetire(listener: () => void): void {
    this.retireListeners.push(listener);
  }
  async retire(): Promise<void> {
    this.retired = true;
    this.isOpen = false;
  }
  /** The transport reports that the peer retired this connection. */
  peerRetired(): void {
    this.isOpen = false;
    for (const l of this.retireListeners.splice(0)) l();
  }
  async close(error?: TensorwireError): Promise<void> {
    this.closes++;
    this.lastCloseError = error;
    for (const reject of this.#hanging) reject(error ?? new ConnectionBrokenError('probe connection closed'));
    this.#hanging.clear();
    if (!this.isOpen) return;
    this.isOpen = false;
    this.closedWith = error;
    if (!this.owner.silentClose) for (const l of this.#listeners.splice(0)) l(error);
  }
  /** The transport reports a close it noticed itself (the peer went away). */
  lost(error: TensorwireError | undefined): void {
    this.isOpen = false;
    for (const l of this.#listeners.splice(0)) l(error);
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
  onExecute: ((c: ProbeConnection) => void) | undefined;
  lastExecute: ExecuteOptions | undefined;
  holdConnect = false;
  /** Outbound connects fail with this. */
  connectError: Error | undefined;
  /** Outbound connections land already retired by the peer (isOpen false). */
  landClosed = false;
  readonly pending: { peer: NodeIdentity; streams: number; resolve: (c: ProbeConnection) => void; reject: (e: Error) => void; options: ConnectOptions }[] = [];
  readonly connections: ProbeConnection[] = [];
  closed = 0;
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
  revoked = 0;
  async revoke(): Promise<void> {
    this.revoked++;
  }
  decodeRemote(payload: Uint8Array): unknown {
    return payload[0];
  }
  connectCalls = 0;
  connect(peer: NodeIdentity, _endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    this.connectCalls++;
    if (this.connectError) return Promise.reject(this.connectError);
    if (this.holdConnect) {
      return new Promise<TransportConnection>((resolve, reject) => this.pending.push({ peer, streams: options.streams, options, resolve, reject }));
    }
    return Promise.resolve(this.#make(peer, options.streams));
  }
  #make(peer: NodeIdentity, streams: number): ProbeConnection {
    const c = new ProbeConnection(this, peer, this.host?.identity.nodeId ?? '?', streams);
    if (this.landClosed) c.isOpen = false;
    this.connections.push(c);
    return c;
  }
  inbound(peer: NodeIdentity): ProbeConnection {
    const c = new ProbeConnection(this, peer, peer.nodeId, 1);
    this.connections.push(c);
    this.host?.inbound(c);
    return c;
  }
  land(): ProbeConnection {
    const p = this.pending.shift();
    if (!p) throw new Error('no connect in flight');
    const c = this.#make(p.peer, p.streams);
    p.resolve(c);
    return c;
  }
  async close(): Promise<void> {
    this.closed++;
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
  const a = new TransferEngine({ nodeId: `${me}${tag}`, transports: [ta], logger: silentLogger, ...extra });
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

/** Another incarnation of `b`'s node (as after a restart), started; disposed with `await using`. */
async function incarnationOf(b: TransferEngine, incarnation: string): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId: b.identity.nodeId, incarnation, transports: [new ProbeTransport()], logger: silentLogger, metrics: false });
  await e.start();
  return e;
}

/** Connection lifecycle counts of engine `e` by event (`tensorwire_connection_events_total`). */
async function events(e: TransferEngine): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  for (const v of (await (e.metrics as NonNullable<TransferEngine['metrics']>).connectionEvents.get()).values) out[String(v.labels.event)] = v.value;
  return out;
}
/** The live-connections gauge (`tensorwire_connections`). */
async function live(e: TransferEngine): Promise<number> {
  const values = (await (e.metrics as NonNullable<TransferEngine['metrics']>).connections.get()).values;
  return values.reduce((s, v) => s + v.value, 0);
}
async function errorCodes(e: TransferEngine): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  for (const v of (await (e.metrics as NonNullable<TransferEngine['metrics']>).errors.get()).values) out[String(v.labels.code)] = v.value;
  return out;
}

describe('deadlines and abort (#deadlineSignal)', () => {
  it('timeoutMs must be a positive finite number; deadline a finite timestamp (InvalidInputError naming the field)', async () => {
    await using s = await setup('dv-a', 'dv-b');
    for (const bad of [0, -1, Number.NaN, Number.POSITIVE_INFINITY, '5' as unknown as number]) {
      const e = await outcome(s.read({ timeoutMs: bad }));
      expect(e, String(bad)).toBeInstanceOf(InvalidInputError);
      expect((e as InvalidInputError).message).toBe(`timeoutMs must be a positive finite number, got ${String(bad)}`);
      expect((e as InvalidInputError).details).toMatchObject({ field: 'timeoutMs' });
    }
    for (const bad of [Number.NaN, Number.POSITIVE_INFINITY, '1' as unknown as number]) {
      const e = await outcome(s.read({ deadline: bad }));
      expect(e, String(bad)).toBeInstanceOf(InvalidInputError);
      expect((e as InvalidInputError).message).toBe('deadline must be a finite Date.now() timestamp');
      expect((e as InvalidInputError).details).toMatchObject({ field: 'deadline' });
    }
    expect(s.ta.connectCalls).toBe(0);
    await s.read({ timeoutMs: 1000 });
  });

  it('a deadline already passed ends the transfer with TimedOutError before anything is posted', async () => {
    await using s = await setup('dp-a', 'dp-b');
    await s.read();
    const e = await outcome(s.read({ deadline: Date.now() - 1000 }));
    expect(e).toBeInstanceOf(TimedOutError);
    expect((e as TimedOutError).message).toMatch(/^deadline passed \(0 ms after the call\)/);
    expect(s.ta.connections[0]?.executes).toBe(1);
  });

  it('the earlier of timeoutMs and deadline is handed to the transport', async () => {
    await using s = await setup('dm-a', 'dm-b');
    const before = Date.now();
    await s.read({ timeoutMs: 60_000, deadline: before + 5_000 });
    expect(s.ta.lastExecute?.deadline).toBe(before + 5_000);
    const t0 = Date.now();
    await s.read({ timeoutMs: 2_000, deadline: t0 + 600_000 });
    const d = s.ta.lastExecute?.deadline as number;
    expect(d).toBeGreaterThanOrEqual(t0 + 2_000);
    expect(d).toBeLessThanOrEqual(Date.now() + 2_000);
  });

  it('a hung transfer ends at its deadline with TimedOutError; a timeout longer than a timer can hold is re-armed, not fired', async () => {
    await using s = await setup('dh-a', 'dh-b');
    s.ta.defaultMode = 'hang';
    const e = await bounded(s.read({ timeoutMs: 100 }));
    expect(e).toBeInstanceOf(TimedOutError);
    expect((e as TimedOutError).message).toMatch(/^deadline passed \(\d+ ms after the call\)/);
    // 2^31 ms and more: Node's setTimeout would fire at once; the engine re-arms instead.
    const ac = new AbortController();
    s.ta.onExecute = () => setTimeout(() => ac.abort(), 50);
    const long = await bounded(s.read({ timeoutMs: 2 ** 31 + 10, signal: ac.signal }));
    expect(long).toBeInstanceOf(AbortedError);
  });

  it("the caller's signal listener is removed when the transfer ends", async () => {
    await using s = await setup('dl-a', 'dl-b');
    const ac = new AbortController();
    await s.read({ signal: ac.signal });
    await s.read({ signal: ac.signal });
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    ac.abort(); // after the transfers: nothing to end
    await s.read();
  });
});

describe('the connection table and its lifecycle metrics', () => {
  it('open, use, a break: one opened and one invalidated event, the gauge back to 0, the entry gone at once', async () => {
    await using s = await setup('ct-a', 'ct-b');
    await s.read();
    expect(await events(s.a)).toEqual({ opened: 1 });
    expect(await live(s.a)).toBe(1);
    expect(s.a.connections().map((c) => [c.state, c.initiator])).toEqual([['open', s.a.identity.nodeId]]);
    s.ta.mode.push('break');
    const e = await outcome(s.read());
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('probe: the peer reset the connection');
    expect(s.a.connections()).toEqual([]);
    expect(await events(s.a)).toEqual({ opened: 1, invalidated: 1 });
    expect(await live(s.a)).toBe(0);
    expect(s.ta.connections[0]?.closedWith).toBe(e);
    expect(await errorCodes(s.a)).toEqual({ TW_CONNECTION_BROKEN: 1 });
  });

  it('a close the transport noticed itself: closed event, entry gone, the next transfer opens a new connection', async () => {
    await using s = await setup('cl-a', 'cl-b');
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    first.lost(new ConnectionBrokenError('probe: peer went away'));
    expect(s.a.connections()).toEqual([]);
    expect(await events(s.a)).toEqual({ opened: 1, closed: 1 });
    expect(await live(s.a)).toBe(0);
    await s.read();
    expect(s.ta.connectCalls).toBe(2);
    expect(first.executes).toBe(1);
    // A close reported without an error (an orderly end) is counted the same way.
    (s.ta.connections[1] as ProbeConnection).lost(undefined);
    expect(await events(s.a)).toEqual({ opened: 2, closed: 2 });
  });

  it('a connection the peer retired leaves the table at once', async () => {
    await using s = await setup('rt-a', 'rt-b');
    await s.read();
    (s.ta.connections[0] as ProbeConnection).peerRetired();
    expect(s.a.connections()).toEqual([]);
    await s.read();
    expect(s.ta.connectCalls).toBe(2);
  });

  it('an open connection that is no longer open when used is replaced, and the stale one is closed', async () => {
    await using s = await setup('so-a', 'so-b');
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    first.isOpen = false; // went away without telling anyone
    await s.read();
    expect(s.ta.connectCalls).toBe(2);
    expect(first.closes).toBe(1);
    expect(first.lastCloseError?.message).toBe('connection closed');
    expect(await events(s.a)).toMatchObject({ opened: 2, invalidated: 1 });
  });

  it('a new incarnation of a peer gets its own connection beside the old one, which stays open until its process goes away', async () => {
    await using s = await setup('inc-a', 'inc-b');
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    await using b2 = await incarnationOf(s.b, 'second');
    const info = await s.a.connect(b2.endpoint());
    expect(info.peer.incarnation).toBe('second');
    expect(first.closes).toBe(0);
    expect(s.a.connections().map((c) => c.peer.incarnation)).toEqual([s.b.identity.incarnation, 'second']);
    expect(await events(s.a)).toEqual({ opened: 2 });
    first.lost(new ConnectionBrokenError('probe: the old process went away'));
    expect(s.a.connections().map((c) => c.peer.incarnation)).toEqual(['second']);
    expect(await events(s.a)).toEqual({ opened: 2, closed: 1 });
  });

  it('a stale endpoint of the earlier incarnation goes to that incarnation\'s own connection; the new one\'s connection and its transfer in flight are left alone', async () => {
    await using s = await setup('st-a', 'st-b');
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    await using b2 = await incarnationOf(s.b, 'second');
    const remote2 = (await b2.register({ kind: 'host', buffer: new Uint8Array(64) })).descriptor;
    const local = await s.a.register({ kind: 'host', buffer: new Uint8Array(64) });
    await s.a.connect(b2.endpoint());
    const current = s.ta.connections[1] as ProbeConnection;
    s.ta.mode = ['hang'];
    const ac = new AbortController();
    const inFlight = outcome(s.a.read(b2.endpoint(), [{ local, remote: remote2 }], { signal: ac.signal }));
    await tick();
    expect(current.executes).toBe(1);
    // A stale endpoint (an old lease, an old discovery record) names the first incarnation.
    await s.read();
    expect(first.executes).toBe(2);
    expect(s.ta.connectCalls).toBe(2); // no dial: its connection was still open
    expect(current.closes).toBe(0);
    ac.abort();
    expect(await inFlight).toBeInstanceOf(AbortedError); // its own ending, nothing else's
    expect(s.a.connections().map((c) => c.peer.incarnation)).toContain('second');
  });

  it('invalidate(nodeId, reason, { incarnation }) drops that incarnation\'s connections only', async () => {
    await using s = await setup('iv-a', 'iv-b');
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    await using b2 = await incarnationOf(s.b, 'second');
    await s.a.connect(b2.endpoint());
    const second = s.ta.connections[1] as ProbeConnection;
    await s.a.invalidate(s.b.identity.nodeId, 'test: the first incarnation ended', { incarnation: s.b.identity.incarnation });
    expect(first.closedWith?.message).toBe('test: the first incarnation ended');
    expect(second.closes).toBe(0);
    expect(s.a.connections().map((c) => c.peer.incarnation)).toEqual(['second']);
    await s.a.invalidate(s.b.identity.nodeId, 'test: all of it');
    expect(second.closedWith?.message).toBe('test: all of it');
    expect(s.a.connections()).toEqual([]);
  });

  it('an endpoint of an incarnation never seen is dialled beside the live connection, which a failed handshake leaves alone', async () => {
    await using s = await setup('nv-a', 'nv-b');
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    await using b3 = await incarnationOf(s.b, 'third');
    s.ta.connectError = new ConnectionBrokenError('probe: WRONG_PEER');
    expect(await outcome(s.a.connect(b3.endpoint()))).toBe(s.ta.connectError);
    expect(first.closes).toBe(0);
    expect(s.a.connections().map((c) => c.peer.incarnation)).toEqual([s.b.identity.incarnation]);
    s.ta.connectError = undefined;
    await s.read(); // on the same connection
    expect(s.ta.connectCalls).toBe(2);
    expect(first.executes).toBe(2);
    expect(await events(s.a)).toEqual({ opened: 1 });
  });

  it('a failed connect rejects with its error, counts it, leaves no entry, and the next transfer connects again', async () => {
    await using s = await setup('cf-a', 'cf-b');
    s.ta.connectError = new ResourceExhaustedError('probe: no ports');
    const e = await outcome(s.read());
    expect(e).toBe(s.ta.connectError);
    expect(s.a.connections()).toEqual([]);
    expect(await errorCodes(s.a)).toMatchObject({ TW_RESOURCE_EXHAUSTED: 1 });
    s.ta.connectError = undefined;
    await s.read();
    expect(s.ta.connectCalls).toBe(2);
  });

  it('a handshake that outlives connectTimeoutMs fails with TimedOutError naming the peer, and leaves no entry', async () => {
    await using s = await setup('ht-a', 'ht-b', { connectTimeoutMs: 50 });
    s.ta.holdConnect = true;
    const e = await bounded(s.read({ timeoutMs: 5_000 }));
    expect(e).toBeInstanceOf(TimedOutError);
    expect((e as TimedOutError).message).toBe(`handshake with ${s.b.identity.nodeId} over probe timed out`);
    expect(s.a.connections()).toEqual([]);
    expect(s.ta.pending[0]?.options.signal.aborted).toBe(true);
    // The connect that lands late is retired, not adopted.
    const late = s.ta.land();
    await tick();
    expect(late.retired).toBe(true);
    expect(s.a.connections()).toEqual([]);
  });

  it('our connection lands already retired by the peer: the entry waits for its inbound one, and fails if none comes', async () => {
    await using s = await setup('lr-b', 'lr-a', { connectTimeoutMs: 100 }); // the peer has the smaller id
    s.ta.landClosed = true;
    const p = s.a.connect(s.b.endpoint());
    await tick();
    await tick();
    const ours = s.ta.connections[0] as ProbeConnection;
    expect(ours.retired).toBe(true);
    expect(s.a.connections().map((c) => c.state)).toEqual(['connecting']);
    const theirs = s.ta.inbound(s.b.identity);
    const info = await p;
    expect(info.initiator).toBe(s.b.identity.nodeId);
    expect(theirs.retired).toBe(false);
    expect(await events(s.a)).toEqual({ retired: 1, simultaneous_open: 1, adopted: 1 });

    await using t = await setup('lq-b', 'lq-a', { connectTimeoutMs: 100 });
    t.ta.landClosed = true;
    const e = await bounded(t.a.connect(t.b.endpoint(), { timeoutMs: 5_000 }));
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe(`${t.b.identity.nodeId} retired our connection and did not open its own`);
    expect(t.a.connections()).toEqual([]);
  });
});

describe('inbound connections and simultaneous open (#inbound)', () => {
  it('an inbound connection with no entry is adopted (event adopted); one from ourselves is ignored', async () => {
    await using s = await setup('ib-a', 'ib-b');
    const c = s.ta.inbound(s.b.identity);
    expect(s.a.connections().map((x) => [x.state, x.initiator])).toEqual([['open', s.b.identity.nodeId]]);
    expect(await events(s.a)).toEqual({ adopted: 1 });
    expect(await live(s.a)).toBe(1);
    await s.read();
    expect(c.executes).toBe(1);
    expect(s.ta.connectCalls).toBe(0);
    const self = s.ta.inbound(s.a.identity);
    expect(s.a.connections()).toHaveLength(1);
    expect(self.retired || self.closes > 0).toBe(false);
  });

  it('an existing connection we opened, and we have the smaller id: the inbound one is retired', async () => {
    await using s = await setup('ea', 'eb');
    await s.read();
    const ours = s.ta.connections[0] as ProbeConnection;
    const theirs = s.ta.inbound(s.b.identity);
    expect(theirs.retired).toBe(true);
    expect(ours.retired).toBe(false);
    expect(s.a.connections().map((c) => c.initiator)).toEqual([s.a.identity.nodeId]);
    expect(await events(s.a)).toEqual({ opened: 1, retired: 1 });
  });

  it('an existing connection we opened, and the peer has the smaller id: the inbound one replaces it, ours is retired', async () => {
    await using s = await setup('fd', 'fc');
    await s.read();
    const ours = s.ta.connections[0] as ProbeConnection;
    const theirs = s.ta.inbound(s.b.identity);
    expect(theirs.retired).toBe(false);
    expect(ours.retired).toBe(true);
    expect(s.a.connections().map((c) => c.initiator)).toEqual([s.b.identity.nodeId]);
    expect(await events(s.a)).toEqual({ opened: 1, simultaneous_open: 1, adopted: 1, retired: 1 });
    await s.read();
    expect(theirs.executes).toBe(1);
  });

  it("an existing connection the peer opened loses to the peer's newer one (whatever the ids)", async () => {
    await using s = await setup('ga', 'gb'); // we have the smaller id
    const older = s.ta.inbound(s.b.identity);
    const newer = s.ta.inbound(s.b.identity);
    expect(older.retired).toBe(true);
    expect(newer.retired).toBe(false);
    await s.read();
    expect(newer.executes).toBe(1);
    expect(older.executes).toBe(0);
  });

  it('an inbound connection replaces an entry whose connection is already going away, and closes the old one', async () => {
    await using s = await setup('ha', 'hb');
    await s.read();
    const ours = s.ta.connections[0] as ProbeConnection;
    ours.isOpen = false;
    const theirs = s.ta.inbound(s.b.identity);
    expect(theirs.retired).toBe(false);
    expect(ours.closes).toBe(1);
    expect(ours.lastCloseError?.message).toBe('replaced by a newer connection from the peer');
    expect(s.a.connections().map((c) => c.initiator)).toEqual([s.b.identity.nodeId]);
  });

  it('a node dialling in as a new incarnation ends the connections its earlier incarnations opened here, closed as invalidated', async () => {
    await using s = await setup('ja', 'jb');
    const theirs = s.ta.inbound(s.b.identity); // the node's first incarnation opened it
    await s.read(); // and it carries our reads too
    const next = s.ta.inbound({ ...s.b.identity, incarnation: 'restarted' });
    expect(theirs.closedWith?.message).toBe(`peer ${s.b.identity.nodeId} restarted (incarnation changed)`);
    expect(s.a.connections().map((c) => [c.peer.incarnation, c.initiator])).toEqual([['restarted', s.b.identity.nodeId]]);
    expect(next.retired).toBe(false);
    expect(await events(s.a)).toMatchObject({ adopted: 2, invalidated: 1 });
    expect(s.ta.connectCalls).toBe(0);
  });

  it('connections we opened are never ended by an inbound one from another incarnation: not the old one\'s, and not the successor\'s when an old process dials in late', async () => {
    await using s = await setup('jc', 'jd');
    await s.read();
    const ours = s.ta.connections[0] as ProbeConnection; // to the first incarnation, opened by us
    await using b2 = await incarnationOf(s.b, 'second');
    s.ta.inbound(b2.identity); // the successor dials in
    expect(ours.closes).toBe(0);
    await s.a.connect(b2.endpoint()); // its inbound connection serves our reads too
    const oursToNext = await (async () => {
      await s.a.invalidate(s.b.identity.nodeId, 'test: start over', { incarnation: 'second' });
      await s.a.connect(b2.endpoint());
      return s.ta.connections.at(-1) as ProbeConnection; // now one we opened
    })();
    expect(oursToNext.initiator).toBe(s.a.identity.nodeId);
    // The old process wakes up and dials in late.
    const late = s.ta.inbound(s.b.identity);
    expect(oursToNext.closes).toBe(0);
    expect(late.closedWith).toBeUndefined();
    expect(s.a.connections().map((c) => c.peer.incarnation).sort()).toEqual([s.b.identity.incarnation, 'second'].sort());
  });

  it('an inbound connection after close() is closed with ClosedError', async () => {
    await using s = await setup('ka', 'kb');
    await s.a.close();
    const c = s.ta.inbound(s.b.identity);
    expect(c.closedWith).toBeInstanceOf(ClosedError);
    expect(c.closedWith?.message).toBe('engine closed');
  });
});

describe('invalidate() and close()', () => {
  it('invalidate(nodeId) ends in-flight work with ConnectionBrokenError(reason), closes the connection and empties the table', async () => {
    await using s = await setup('iv-a', 'iv-b');
    await s.read();
    s.ta.defaultMode = 'hang';
    const p = bounded(s.read({ timeoutMs: 5_000 }));
    while ((s.ta.connections[0] as ProbeConnection).executes < 2) await tick();
    await s.a.invalidate(s.b.identity.nodeId, 'operator said so');
    const e = await p;
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('operator said so');
    expect(s.a.connections()).toEqual([]);
    const conn = s.ta.connections[0] as ProbeConnection;
    expect(conn.closedWith?.message).toBe('operator said so');
    expect(conn.closedWith?.details).toMatchObject({ peer: s.b.identity.nodeId });
    // One for invalidate() itself, one for the post that failed on the broken connection.
    expect(await events(s.a)).toEqual({ opened: 1, invalidated: 2 });
    await s.a.invalidate('nobody');
    s.ta.defaultMode = 'ok';
    await s.read();
    expect(s.ta.connectCalls).toBe(2);
    await s.a.invalidate(s.b.identity.nodeId);
    expect((s.ta.connections[1] as ProbeConnection).closedWith?.message).toBe('invalidated by caller');
  });

  it('close() aborts in-flight transfers with ClosedError, closes connections (event closed), revokes registrations and closes transports; twice is once', async () => {
    const s = await setup('cz-a', 'cz-b');
    await s.read();
    s.ta.defaultMode = 'hang';
    const p = bounded(s.read({ timeoutMs: 5_000 }));
    while ((s.ta.connections[0] as ProbeConnection).executes < 2) await tick();
    const closing = s.a.close();
    expect(s.a.close()).toBe(closing);
    await closing;
    const e = await p;
    expect(e).toBeInstanceOf(ClosedError);
    expect((e as ClosedError).message).toBe('engine closed');
    expect((s.ta.connections[0] as ProbeConnection).closedWith?.message).toBe('engine closed');
    expect(s.a.connections()).toEqual([]);
    expect(await events(s.a)).toMatchObject({ opened: 1, closed: 1 });
    expect(s.ta.revoked).toBe(1);
    expect(s.ta.closed).toBe(1);
    await s.b.close();
  });
});

describe('posting (#execute, #post)', () => {
  it('local exhaustion backs off on the same connection and succeeds; each backoff is counted', async () => {
    await using s = await setup('ex-a', 'ex-b');
    s.ta.mode.push('exhausted', 'exhausted');
    await s.read();
    expect(s.ta.connectCalls).toBe(1);
    expect((s.ta.connections[0] as ProbeConnection).executes).toBe(3);
    expect(await errorCodes(s.a)).toEqual({ TW_RESOURCE_EXHAUSTED: 2 });
  });

  it('exhaustion that lasts to the deadline ends as ResourceExhaustedError, the connection kept', async () => {
    await using s = await setup('ey-a', 'ey-b');
    s.ta.defaultMode = 'exhausted';
    const e = await bounded(s.read({ timeoutMs: 150 }));
    expect(e).toBeInstanceOf(ResourceExhaustedError);
    expect(s.a.connections()).toHaveLength(1);
  });

  it('retired while a post backed off: the post is retried on the connection that replaces it', async () => {
    await using s = await setup('ez-a', 'ez-b');
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    s.ta.mode.push('exhausted');
    s.ta.onExecute = (c) => {
      if (c === first) void first.retire();
    };
    await s.read();
    expect(s.ta.connectCalls).toBe(2);
    expect((s.ta.connections[1] as ProbeConnection).executes).toBe(1);
  });

  it('a failed post counts its outcome by code; a successful one counts bytes and requests', async () => {
    await using s = await setup('mo-a', 'mo-b');
    await s.read();
    s.ta.mode.push('fail');
    const e = await outcome(s.read());
    expect(e).toBeInstanceOf(InvalidInputError);
    expect(s.a.connections()).toHaveLength(1); // not a broken connection
    const ops = (await (s.a.metrics as NonNullable<TransferEngine['metrics']>).operations.get()).values.map((v) => [v.labels.outcome, v.value]);
    expect(ops).toEqual(
      expect.arrayContaining([
        ['ok', 1],
        ["TW_INVALID_INPUT", 1],
      ]),
    );
    const bytes = (await (s.a.metrics as NonNullable<TransferEngine['metrics']>).bytes.get()).values.map((v) => v.value);
    expect(bytes).toEqual([64]);
  });
});

describe('invalidate() of one peer, a connecting entry, and in-flight counts', () => {
  it('invalidate(nodeId) leaves the connections to other peers alone', async () => {
    await using s = await setup('ip-a', 'ip-b');
    const other = { ...s.b.identity, nodeId: `${s.b.identity.nodeId}x` };
    s.ta.inbound(other);
    await s.read();
    expect(s.a.connections()).toHaveLength(2);
    await s.a.invalidate(s.b.identity.nodeId);
    expect(s.a.connections().map((c) => c.peer.nodeId)).toEqual([other.nodeId]);
  });

  it('invalidate() while a connect is in flight rejects its waiters with the reason', async () => {
    await using s = await setup('iw-a', 'iw-b', { connectTimeoutMs: 60_000 });
    s.ta.holdConnect = true;
    const p = bounded(s.a.connect(s.b.endpoint(), { timeoutMs: 5_000 }));
    while (s.ta.pending.length === 0) await tick();
    await s.a.invalidate(s.b.identity.nodeId, 'gone now');
    const e = await p;
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('gone now');
  });

  it('a post in flight is counted on its connection, and uncounted when it ends', async () => {
    await using s = await setup('if-a', 'if-b');
    await s.read();
    s.ta.defaultMode = 'hang';
    const ac = new AbortController();
    const p = bounded(s.read({ signal: ac.signal, timeoutMs: 5_000 }));
    while ((s.ta.connections[0] as ProbeConnection).executes < 2) await tick();
    expect(s.a.connections().map((c) => c.inFlight)).toEqual([1]);
    ac.abort();
    expect(await p).toBeInstanceOf(AbortedError);
    expect(s.a.connections().map((c) => c.inFlight)).toEqual([0]);
  });
});
