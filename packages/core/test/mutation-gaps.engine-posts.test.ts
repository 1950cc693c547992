/**
 * Tests written to kill surviving Stryker mutants of the engine (src/engine.ts, the methods of
 * scripts/mutate/ranges.mjs ENGINE_METHODS) that the one-stream probe of
 * test/mutation-gaps.engine-connections.test.ts cannot reach: several streams (the round-robin
 * cursor, which error a post reports when several streams fail), prepared transfers (a broken
 * connection invalidates them: `brokenBy`), the stale-entry guards of the late callbacks of
 * `#open` / `#adopt` / `#invalidateEntry` (a callback of an entry that was replaced must not
 * touch the entry that replaced it), the connect options, metric labels, the duration
 * histogram, the slower-path warning and close() revoking grants.
 *
 * The probe transport is an in-process test double (no bytes move); `behave` decides what each
 * execute does.
 */
import { describe, expect, it } from 'vitest';
import {
  AbortedError,
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  ResourceExhaustedError,
  SessionInvalidatedError,
  TRANSPORT_SPECIFICATION_VERSION,
  type TensorwireError,
  TimedOutError,
  TransferEngine,
  silentLogger,
  type ConnectOptions,
  type ExecuteOptions,
  type Logger,
  type Memory,
  type NodeIdentity,
  type TransferBatch,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
} from '../src/index.js';
import { bounded, outcome, tick } from './helpers/settle.js';

interface Call {
  readonly conn: ProbeConnection;
  readonly stream: number;
  readonly options: ExecuteOptions;
}

class ProbeConnection implements TransportConnection {
  readonly transport: string;
  isOpen = true;
  retired = false;
  closedWith: TensorwireError | undefined;
  readonly streamsUsed: number[] = [];
  readonly batches: TransferBatch[] = [];
  readonly #closeListeners: ((e: TensorwireError | undefined) => void)[] = [];
  readonly #retireListeners: (() => void)[] = [];
  readonly #hanging = new Set<(e: Error) => void>();
  constructor(
    readonly owner: ProbeTransport,
    readonly peer: NodeIdentity,
    readonly initiator: string,
    readonly streams: number,
  ) {
    this.transport = owner.name;
  }
  async execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    this.streamsUsed.push(stream);
    this.batches.push(batch);
    if (!this.isOpen) throw new ConnectionBrokenError('probe connection is closed');
    if (options.signal.aborted) throw options.signal.reason;
    const r = this.owner.behave?.({ conn: this, stream, options });
    if (r) await r;
  }
  /** Hang until the signal fires or the connection closes; then reject with `onAbort()` (default: the signal's reason). */
  hang(options: ExecuteOptions, onAbort: () => Error = () => options.signal.reason as Error): Promise<void> {
    return new Promise<void>((_, reject) => {
      this.#hanging.add(reject);
      if (options.signal.aborted) reject(onAbort());
      else options.signal.addEventListener('abort', () => reject(onAbort()), { once: true });
    });
  }
  onClose(listener: (e: TensorwireError | undefined) => void): void {
    this.#closeListeners.push(listener);
    this.owner.onCloseRegistered?.(this);
  }
  onRetire(listener: () => void): void {
    this.#retireListeners.push(listener);
  }
  async retire(): Promise<void> {
    this.retired = true;
    this.isOpen = false;
  }
  /** The transport reports that the peer retired this connection. */
  peerRetired(): void {
    this.isOpen = false;
    for (const l of this.#retireListeners.splice(0)) l();
  }
  /** The transport reports a close it noticed itself. */
  lost(error: TensorwireError | undefined): void {
    this.isOpen = false;
    for (const l of this.#closeListeners.splice(0)) l(error);
  }
  async close(error?: TensorwireError): Promise<void> {
    for (const reject of this.#hanging) reject(error ?? new ConnectionBrokenError('probe connection closed'));
    this.#hanging.clear();
    if (!this.isOpen) return;
    this.isOpen = false;
    this.closedWith = error;
    // silentClose: a transport that reports only the closes it noticed itself, not the ones asked of it.
    if (!this.owner.silentClose) for (const l of this.#closeListeners.splice(0)) l(error);
  }
}

class ProbeTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly capabilities: TransportCapabilities;
  host: TransportHost | undefined;
  behave: ((c: Call) => Promise<void> | void) | undefined;
  onCloseRegistered: ((c: ProbeConnection) => void) | undefined;
  holdConnect = false;
  silentClose = false;
  readonly pending: { options: ConnectOptions; resolve: (c: ProbeConnection) => void; reject: (e: Error) => void; peer: NodeIdentity; streams: number }[] = [];
  readonly connectOptions: ConnectOptions[] = [];
  readonly connections: ProbeConnection[] = [];
  readonly grantsRevoked: object[] = [];
  constructor(
    readonly name = 'probe',
    { maxStreams = 1, rank = 5, grants = false }: { maxStreams?: number; rank?: number; grants?: boolean } = {},
  ) {
    this.capabilities = { local: true, remote: true, memoryKinds: ['host'], oneSidedRead: true, oneSidedWrite: true, scopedGrants: grants, rank, maxStreams, maxChunkBytes: 1 << 30 };
    if (grants) {
      this.grant = (): TransportRegistration => ({ handle: {}, payload: new Uint8Array([9]) });
      this.revokeGrant = async (h: object): Promise<void> => {
        this.grantsRevoked.push(h);
      };
    }
  }
  grant?: (r: unknown) => TransportRegistration;
  revokeGrant?: (h: object) => Promise<void>;
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
  connect(peer: NodeIdentity, _endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    this.connectOptions.push(options);
    if (this.holdConnect) return new Promise((resolve, reject) => this.pending.push({ options, resolve, reject, peer, streams: options.streams }));
    return Promise.resolve(this.make(peer, options.streams));
  }
  make(peer: NodeIdentity, streams: number): ProbeConnection {
    const c = new ProbeConnection(this, peer, this.host?.identity.nodeId ?? '?', streams);
    this.connections.push(c);
    return c;
  }
  /** The held connect `i` lands with a new connection. */
  land(i = 0): ProbeConnection {
    const p = this.pending[i];
    if (!p) throw new Error('no connect in flight');
    const c = this.make(p.peer, p.streams);
    p.resolve(c);
    return c;
  }
  inbound(peer: NodeIdentity): ProbeConnection {
    const c = new ProbeConnection(this, peer, peer.nodeId, 1);
    this.connections.push(c);
    this.host?.inbound(c);
    return c;
  }
  async close(): Promise<void> {
    for (const c of this.connections) await c.close();
  }
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

class CapturingLogger implements Logger {
  readonly lines: { level: string; message: string; fields: Record<string, unknown> | undefined }[] = [];
  debug(): void {}
  info(message: string, fields?: Record<string, unknown>): void {
    this.lines.push({ level: 'info', message, fields });
  }
  warn(message: string, fields?: Record<string, unknown>): void {
    this.lines.push({ level: 'warn', message, fields });
  }
  error(message: string, fields?: Record<string, unknown>): void {
    this.lines.push({ level: 'error', message, fields });
  }
}

let n = 0;
interface SetupOptions {
  engine?: Record<string, unknown>;
  maxStreams?: number;
  grants?: boolean;
  extraTransports?: Transport[];
}
async function setup(me: string, peer: string, o: SetupOptions = {}) {
  const tag = `${++n}`;
  const ta = new ProbeTransport('probe', { maxStreams: o.maxStreams ?? 1, grants: o.grants ?? false });
  const tb = new ProbeTransport('probe', { maxStreams: o.maxStreams ?? 1, grants: o.grants ?? false });
  const logger = new CapturingLogger();
  const a = new TransferEngine({ nodeId: `${me}${tag}`, transports: [ta, ...(o.extraTransports ?? [])], logger, streamsPerPeer: o.maxStreams ?? 1, ...o.engine });
  const b = new TransferEngine({ nodeId: `${peer}${tag}`, transports: [tb], logger: silentLogger, metrics: false });
  await a.start();
  await b.start();
  const local = await a.register({ kind: 'host', buffer: new Uint8Array(64) });
  const remote = (await b.register({ kind: 'host', buffer: new Uint8Array(64) })).descriptor;
  const read = (options: Parameters<TransferEngine['read']>[2] = {}) => a.read(b.endpoint(), [{ local, remote }], options);
  const prepare = () => a.prepare(b.endpoint(), [{ local, remote }], { op: 'read' });
  return {
    a,
    b,
    ta,
    logger,
    local,
    read,
    prepare,
    async [Symbol.asyncDispose]() {
      await a.close();
      await b.close();
    },
  };
}

/** What setup() gives a test. */
type Setup = Awaited<ReturnType<typeof setup>>;

type Metrics = NonNullable<TransferEngine['metrics']>;
async function events(e: TransferEngine): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  for (const v of (await (e.metrics as Metrics).connectionEvents.get()).values) out[`${String(v.labels.transport)}/${String(v.labels.event)}`] = v.value;
  return out;
}
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
async function until(cond: () => boolean): Promise<void> {
  for (let i = 0; i < 2000 && !cond(); i++) await sleep(2);
  expect(cond()).toBe(true);
}

describe('several streams (#transfer, #post)', () => {
  it('successive one-chunk posts go round the streams: 0, 1, 2, 0, 1', async () => {
    await using s = await setup('rr-a', 'rr-b', { maxStreams: 3 });
    for (let i = 0; i < 5; i++) await s.read();
    expect(s.ta.connections).toHaveLength(1);
    expect(s.ta.connections[0]?.streams).toBe(3);
    expect(s.ta.connections[0]?.streamsUsed).toEqual([0, 1, 2, 0, 1]);
  });

  it('prepared transfers start on successive streams (0, 1, 2, 3), and each keeps its stream on later posts', async () => {
    await using s = await setup('rp-a', 'rp-b', { maxStreams: 4 });
    const [p0, p1, p2, p3] = [await s.prepare(), await s.prepare(), await s.prepare(), await s.prepare()];
    for (const p of [p0, p1, p2, p3]) await p.run();
    await p0.run();
    await p2.run();
    expect(s.ta.connections).toHaveLength(1);
    expect(s.ta.connections[0]?.streamsUsed).toEqual([0, 1, 2, 3, 0, 2]);
  });

  it('when several streams fail, the error reported is the first that is not a timeout or an abort', async () => {
    await using s = await setup('sf-a', 'sf-b', { maxStreams: 2, engine: { chunkBytes: 32 } });
    // Stream 0 times out in the transport (the engine's signal has not fired), stream 1 is refused.
    s.ta.behave = ({ stream }) => {
      if (stream === 0) throw new TimedOutError('probe: stream 0 timed out');
      throw new InvalidInputError('probe: stream 1 refused');
    };
    const e = await outcome(s.read());
    expect(e).toBeInstanceOf(InvalidInputError);
    expect((e as InvalidInputError).message).toBe('probe: stream 1 refused');
    expect(s.ta.connections[0]?.streamsUsed).toEqual([0, 1]);
    // An abort and a timeout only: the first of them.
    s.ta.behave = ({ stream }) => {
      throw stream === 0 ? new AbortedError('probe: stream 0 aborted') : new TimedOutError('probe: stream 1 timed out');
    };
    const e2 = await outcome(s.read());
    expect(e2).toBeInstanceOf(AbortedError);
    expect((e2 as AbortedError).message).toBe('probe: stream 0 aborted');
  });

  it('a connection that closed under a post with one stream invalidated and another refused is not an orderly retire: the post fails, no retry', async () => {
    await using s = await setup('mx-a', 'mx-b', { maxStreams: 2, engine: { chunkBytes: 32 } });
    await s.read();
    const first = s.ta.connections[0] as ProbeConnection;
    s.ta.behave = ({ conn, stream }) => {
      if (conn !== first) return;
      conn.isOpen = false;
      throw stream === 0 ? new SessionInvalidatedError('probe: retired') : new InvalidInputError('probe: refused');
    };
    const e = await outcome(s.read());
    expect(e).toBeInstanceOf(SessionInvalidatedError);
    expect(s.ta.connections).toHaveLength(1); // not posted again on a new connection
  });
});

describe('the signal fired during a post (#post)', () => {
  it("the caller's abort is reported as the signal's error, not the transport's own error for it", async () => {
    await using s = await setup('ab-a', 'ab-b');
    await s.read();
    const ac = new AbortController();
    s.ta.behave = ({ conn, options }) => {
      setTimeout(() => ac.abort(), 1);
      return conn.hang(options, () => new InvalidInputError('probe: cancelled'));
    };
    const e = await bounded(s.read({ signal: ac.signal, timeoutMs: 5_000 }));
    expect(e).toBeInstanceOf(AbortedError);
  });

  it('a transport error that breaks the connection is reported as itself even when the signal fired', async () => {
    await using s = await setup('ak-a', 'ak-b');
    await s.read();
    const ac = new AbortController();
    s.ta.behave = ({ conn, options }) => {
      setTimeout(() => ac.abort(), 1);
      return conn.hang(options, () => new ConnectionBrokenError('probe: reset while cancelling'));
    };
    const e = await bounded(s.read({ signal: ac.signal, timeoutMs: 5_000 }));
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('probe: reset while cancelling');
    expect(s.a.connections()).toEqual([]);
  });
});

describe('retire during a backed-off post (#execute)', () => {
  it('a post whose connection retires during the back-off three times in a row fails with the SessionInvalidatedError naming the peer', async () => {
    await using s = await setup('rb-a', 'rb-b');
    s.ta.behave = ({ conn }) => {
      void conn.retire();
      throw new ResourceExhaustedError('probe: no credit');
    };
    const e = await bounded(s.read({ timeoutMs: 5_000 }));
    expect(e).toBeInstanceOf(SessionInvalidatedError);
    expect((e as SessionInvalidatedError).message).toBe(`connection to ${s.b.identity.nodeId} retired while a post backed off; nothing of it was posted`);
    expect(s.ta.connections).toHaveLength(3);
  });
});

describe('a connection that closes between its handshake and its first post (#transfer, #runPrepared)', () => {
  it.each([
    [
      'a read',
      'hc',
      async (s: Setup): Promise<void> => {
        await s.read();
      },
    ],
    [
      'a prepared transfer',
      'ph',
      async (s: Setup): Promise<void> => {
        await (await s.prepare()).run();
      },
    ],
  ] as const)('%s: is replaced before the post', async (_label, id, post) => {
    await using s = await setup(`${id}-a`, `${id}-b`);
    // The connection goes away just after the engine adopted it (before the post uses it).
    s.ta.onCloseRegistered = (c) => {
      if (s.ta.connections.length === 1) queueMicrotask(() => (c.isOpen = false));
    };
    await post(s);
    expect(s.ta.connections).toHaveLength(2);
    expect(s.ta.connections[0]?.streamsUsed).toEqual([]);
    expect(s.ta.connections[1]?.streamsUsed).toEqual([0]);
  });
});

describe('prepared transfers: the plan made once, a signal that already fired (#runPrepared)', () => {
  it('every post hands the transport the same batch (the chunk plan is computed once)', async () => {
    await using s = await setup('pb1-a', 'pb1-b');
    const p = await s.prepare();
    await p.run();
    await p.run();
    await p.run();
    const batches = (s.ta.connections[0] as ProbeConnection).batches;
    expect(batches).toHaveLength(3);
    expect(batches[1]).toBe(batches[0]);
    expect(batches[2]).toBe(batches[0]);
  });

  it('a post whose signal already fired is refused before the transport sees it, and the next post runs', async () => {
    await using s = await setup('pa-a', 'pa-b');
    const p = await s.prepare();
    await p.run();
    const e = await outcome(p.run({ signal: AbortSignal.abort() }));
    expect(e).toBeInstanceOf(AbortedError);
    expect(s.ta.connections[0]?.streamsUsed).toEqual([0]);
    // The same refusal as a read's with such a signal.
    const viaRead = await outcome(s.read({ signal: AbortSignal.abort() }));
    expect((e as AbortedError).message).toBe((viaRead as AbortedError).message);
    expect(s.ta.connections[0]?.streamsUsed).toEqual([0]);
    await p.run();
    expect(s.ta.connections[0]?.streamsUsed).toEqual([0, 0]);
  });
});

describe('prepared transfers and brokenBy', () => {
  it('a connection the transport reports closed with an error invalidates a prepared transfer that used it', async () => {
    await using s = await setup('pb-a', 'pb-b');
    const p = await s.prepare();
    await p.run();
    (s.ta.connections[0] as ProbeConnection).lost(new ConnectionBrokenError('probe: peer went away'));
    const e = await outcome(p.run());
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('prepared transfer is invalidated: its connection broke (probe: peer went away)');
    expect((e as ConnectionBrokenError).details['peer']).toBe(s.b.identity.nodeId);
    expect(s.ta.connections).toHaveLength(1);
    // The close is logged with the peer, the transport and the error.
    expect(s.logger.lines.filter((l) => l.message === 'connection closed' || l.message === '')).toEqual([{ level: 'info', message: 'connection closed', fields: { peer: s.b.identity.nodeId, transport: 'probe', error: 'probe: peer went away' } }]);
  });

  it('a post that breaks the connection invalidates the prepared transfer', async () => {
    await using s = await setup('pp-a', 'pp-b');
    s.ta.silentClose = true; // so that only the engine's own bookkeeping marks the entry broken
    const p = await s.prepare();
    await p.run();
    s.ta.behave = () => {
      s.ta.behave = undefined;
      throw new ConnectionBrokenError('probe: reset');
    };
    expect(await outcome(p.run())).toBeInstanceOf(ConnectionBrokenError);
    const e = await outcome(p.run());
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('prepared transfer is invalidated: probe: reset');
    expect((e as ConnectionBrokenError).details['peer']).toBe(s.b.identity.nodeId);
    expect(s.ta.connections).toHaveLength(1);
  });

  it('a post that fails on its own while the transport reports the connection broken: the next post names the break', async () => {
    await using s = await setup('pt-a', 'pt-b');
    const p = await s.prepare();
    await p.run();
    s.ta.behave = ({ conn }) => {
      s.ta.behave = undefined;
      conn.lost(new ConnectionBrokenError('probe: peer went away'));
      throw new TimedOutError('probe: no answer');
    };
    expect(await outcome(p.run())).toBeInstanceOf(TimedOutError);
    const e = await outcome(p.run());
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('prepared transfer is invalidated: its connection broke (probe: peer went away)');
  });

  it('invalidate() of the peer invalidates a prepared transfer', async () => {
    await using s = await setup('pi-a', 'pi-b');
    s.ta.silentClose = true;
    const p = await s.prepare();
    await p.run();
    await s.a.invalidate(s.b.identity.nodeId, 'operator said so');
    const e = await outcome(p.run());
    expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect((e as ConnectionBrokenError).message).toBe('prepared transfer is invalidated: its connection broke (operator said so)');
    expect(s.ta.connections).toHaveLength(1);
  });
});

describe('late callbacks of a replaced entry leave its replacement alone (#open, #adopt, #invalidateEntry)', () => {
  it("the handshake timer of an invalidated entry does not remove the entry that replaced it", async () => {
    await using s = await setup('ta-a', 'ta-b', { engine: { connectTimeoutMs: 80 } });
    s.ta.holdConnect = true;
    const p = outcome(s.a.connect(s.b.endpoint(), { timeoutMs: 5_000 }));
    await until(() => s.ta.pending.length === 1);
    await s.a.invalidate(s.b.identity.nodeId, 'gone');
    expect(await p).toBeInstanceOf(ConnectionBrokenError);
    s.ta.holdConnect = false;
    await s.read();
    expect(s.a.connections().map((c) => c.state)).toEqual(['open']);
    // The first handshake's timer fires (it aborts that connect's signal first).
    await until(() => s.ta.pending[0]?.options.signal.aborted === true);
    await tick();
    expect(s.a.connections().map((c) => c.state)).toEqual(['open']);
    // That connect failing late does not remove it either.
    s.ta.pending[0]?.reject(new ConnectionBrokenError('probe: late failure'));
    await tick();
    expect(s.a.connections().map((c) => c.state)).toEqual(['open']);
  });

  it('an inbound connection that won while our connect was in flight: our timer, late success and late failure leave it in place', async () => {
    await using s = await setup('wb', 'wa', { engine: { connectTimeoutMs: 80 } }); // the peer has the smaller id
    s.ta.holdConnect = true;
    const p = s.a.connect(s.b.endpoint(), { timeoutMs: 5_000 });
    await until(() => s.ta.pending.length === 1);
    const theirs = s.ta.inbound(s.b.identity);
    expect((await p).initiator).toBe(s.b.identity.nodeId);
    // Our handshake timer fires: the adopted entry stays.
    await until(() => s.ta.pending[0]?.options.signal.aborted === true);
    await tick();
    expect(s.a.connections().map((c) => [c.state, c.initiator])).toEqual([['open', s.b.identity.nodeId]]);
    // Our connect lands late: it is retired (counted), the peer's stays.
    const ours = s.ta.land(0);
    await tick();
    expect(ours.retired).toBe(true);
    expect(theirs.retired).toBe(false);
    expect(await events(s.a)).toEqual({ 'probe/simultaneous_open': 1, 'probe/adopted': 1, 'probe/retired': 1 });
    await s.read();
    expect(theirs.streamsUsed).toEqual([0]);
    expect(ours.streamsUsed).toEqual([]);
  });

  it('an inbound connection that won while our connect was in flight stays when our connect then fails', async () => {
    await using s = await setup('xb', 'xa', { engine: { connectTimeoutMs: 60_000 } });
    s.ta.holdConnect = true;
    const p = s.a.connect(s.b.endpoint(), { timeoutMs: 5_000 });
    await until(() => s.ta.pending.length === 1);
    s.ta.inbound(s.b.identity);
    await p;
    s.ta.pending[0]?.reject(new ConnectionBrokenError('probe: refused late'));
    await tick();
    expect(s.a.connections().map((c) => [c.state, c.initiator])).toEqual([['open', s.b.identity.nodeId]]);
  });

  it('the peer retiring our replaced connection does not remove the entry of its own connection', async () => {
    await using s = await setup('yd', 'yc'); // the peer has the smaller id
    await s.read();
    const ours = s.ta.connections[0] as ProbeConnection;
    s.ta.inbound(s.b.identity); // replaces ours, which is retired
    ours.peerRetired();
    expect(s.a.connections().map((c) => c.initiator)).toEqual([s.b.identity.nodeId]);
  });

  it('a post on our replaced connection that then breaks does not remove the entry that replaced it', async () => {
    await using s = await setup('zd', 'zc'); // the peer has the smaller id
    await s.read();
    const ours = s.ta.connections[0] as ProbeConnection;
    let fail: ((e: Error) => void) | undefined;
    s.ta.behave = () => new Promise<void>((_, reject) => (fail = reject));
    const p = bounded(s.read({ timeoutMs: 5_000 }));
    await until(() => fail !== undefined);
    s.ta.behave = undefined;
    s.ta.inbound(s.b.identity);
    expect(ours.retired).toBe(true);
    (fail as (e: Error) => void)(new ConnectionBrokenError('probe: reset during drain'));
    expect(await p).toBeInstanceOf(ConnectionBrokenError);
    expect(s.a.connections().map((c) => c.initiator)).toEqual([s.b.identity.nodeId]);
  });
});

describe('the handshake (#open)', () => {
  it('the connect gets deadline = now + connectTimeoutMs and the streams asked for', async () => {
    await using s = await setup('cd-a', 'cd-b', { maxStreams: 2, engine: { connectTimeoutMs: 30_000 } });
    const before = Date.now();
    await s.read();
    const o = s.ta.connectOptions[0] as ConnectOptions;
    expect(o.deadline).toBeGreaterThanOrEqual(before + 30_000);
    expect(o.deadline).toBeLessThanOrEqual(Date.now() + 30_000);
    expect(o.streams).toBe(2);
  });

  it('close() aborts a connect in flight with ClosedError, and not the signal of a connect that already finished', async () => {
    const s = await setup('cc-a', 'cc-b', { engine: { connectTimeoutMs: 60_000 } });
    await s.read();
    const done = s.ta.connectOptions[0] as ConnectOptions;
    const other = { ...s.b.identity, nodeId: `${s.b.identity.nodeId}-2` };
    const b2 = new TransferEngine({ nodeId: other.nodeId, transports: [new ProbeTransport()], logger: silentLogger, metrics: false });
    await b2.start();
    s.ta.holdConnect = true;
    const p = outcome(s.a.connect(b2.endpoint(), { timeoutMs: 5_000 }));
    await until(() => s.ta.pending.length === 1);
    await s.a.close();
    expect(await p).toBeInstanceOf(ClosedError);
    const pending = s.ta.pending[0]?.options.signal as AbortSignal;
    expect(pending.aborted).toBe(true);
    expect(pending.reason).toBeInstanceOf(ClosedError);
    expect((pending.reason as ClosedError).message).toBe('engine closed');
    expect(done.signal.aborted).toBe(false);
    await b2.close();
    await s.b.close();
  });

  it('a slower path is warned once with the reason; the fastest path is not warned', async () => {
    // A faster transport the peer does not have: the probe is a slower path.
    const fast = new ProbeTransport('fast', { rank: 9 });
    await using s = await setup('sw-a', 'sw-b', { extraTransports: [fast] });
    await s.read();
    await s.read();
    const warns = s.logger.lines.filter((l) => l.level === 'warn');
    expect(warns).toHaveLength(1);
    expect(warns[0]?.message).toMatch(/^slower transport path: probe chosen for host memory on sw-b\d+ \(same host\); faster transports unusable: fast: /);
    await using t = await setup('sn-a', 'sn-b');
    await t.read();
    expect(t.logger.lines.filter((l) => l.level === 'warn')).toEqual([]);
  });

  it('an inbound connection that loses to our open in flight is retired and counted with its labels', async () => {
    await using s = await setup('la', 'lb', { engine: { connectTimeoutMs: 60_000 } }); // we have the smaller id
    s.ta.holdConnect = true;
    const p = s.a.connect(s.b.endpoint(), { timeoutMs: 5_000 });
    await until(() => s.ta.pending.length === 1);
    const theirs = s.ta.inbound(s.b.identity);
    expect(theirs.retired).toBe(true);
    expect(await events(s.a)).toEqual({ 'probe/retired': 1 });
    s.ta.land(0);
    expect((await p).initiator).toBe(s.a.identity.nodeId);
  });
});

describe('metrics of a post and a connection (#post, #adopt)', () => {
  it('the live-connections gauge is labelled by transport, up on adopt and down on close', async () => {
    await using s = await setup('gl-a', 'gl-b');
    await s.read();
    const gauge = async () => (await (s.a.metrics as Metrics).connections.get()).values.map((v) => [v.labels, v.value]);
    expect(await gauge()).toEqual([[{ transport: 'probe' }, 1]]);
    (s.ta.connections[0] as ProbeConnection).lost(undefined);
    expect(await gauge()).toEqual([[{ transport: 'probe' }, 0]]);
  });

  it('the duration histogram observes seconds: one sample per post, within the wall time of the posts', async () => {
    await using s = await setup('du-a', 'du-b');
    const t0 = process.hrtime.bigint();
    await s.read();
    await s.read();
    const wall = Number(process.hrtime.bigint() - t0) / 1e9;
    const values = (await (s.a.metrics as Metrics).duration.get()).values;
    const count = values.find((v) => v.metricName?.endsWith('_count'))?.value;
    const sum = values.find((v) => v.metricName?.endsWith('_sum'))?.value as number;
    expect(count).toBe(2);
    expect(sum).toBeGreaterThanOrEqual(0);
    expect(sum).toBeLessThanOrEqual(wall);
  });
});

describe('close() (#close)', () => {
  it('revokes the live range grants with every transport that made them', async () => {
    const s = await setup('gr-a', 'gr-b', { grants: true });
    const g = await s.a.grant([{ registration: s.local, offset: 0, length: 16 }]);
    expect(g.revoked).toBe(false);
    await s.a.close();
    expect(s.ta.grantsRevoked).toHaveLength(1);
    expect(g.revoked).toBe(true);
    await s.b.close();
  });
});

describe('after close() (#transfer)', () => {
  it('a read or write of a started engine after close() is ClosedError and connects nothing', async () => {
    const s = await setup('ac-a', 'ac-b');
    await s.a.close();
    for (const p of [s.read(), s.a.write(s.b.endpoint(), [{ local: s.local, remote: (await s.b.register({ kind: 'host', buffer: new Uint8Array(8) })).descriptor }])]) {
      const e = await outcome(p);
      expect(e).toBeInstanceOf(ClosedError);
      expect((e as ClosedError).message).toBe('engine is closed');
    }
    expect(s.ta.connectOptions).toHaveLength(0);
    await s.b.close();
  });
});
