/**
 * The Session stream: a client's calls to a holder as messages of one long-lived stream.
 *
 * - By default every call (acquire, release, renew, health) goes over one stream, dispatched to
 *   the same handlers the unary calls use; `session: false` makes them unary.
 * - Raw frames: an unknown method, a payload that does not decode, a bad request, a repeated
 *   acquire id: each answered with its id and the unary call's status; the stream goes on.
 * - A requester that sends many calls without reading loses none of the answers.
 * - The holder going away mid-call: the call fails ConnectionBrokenError (not a cancel), the
 *   acquire's possible grant is released by acquire id, and the next call opens a new stream.
 * - Idle: the stream ends after `sessionIdleMs` with nothing in flight; the next call reopens.
 * - Shutdown: a holder's close() ends open session streams.
 * (An older holder without Session: compat.test.ts, whose holder has no Session.)
 */
import * as grpc from '@grpc/grpc-js';
import { ConnectionBrokenError, silentLogger } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient, type SessionRequestMsg, type SessionResponseMsg } from '../src/index.js';
import { LockServer, loadLockProtocol } from '../src/server/index.js';
import { bindLoopback, waitFor } from './helpers.js';

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

type Handler = (call: unknown, cb: grpc.sendUnaryData<unknown>) => void;

interface Spied {
  address: string;
  lock: LockServer;
  /** Per method: calls that arrived as unary gRPC calls, and as Session messages. */
  unary: Record<string, number>;
  session: Record<string, number>;
  /** Session streams opened, and ended (either side). */
  streams: { opened: number; ended: number };
  stop(): void;
  /** When set, Health calls go here instead and are never answered. */
  hangHealth?: () => void;
}

/** A LockServer's handlers on a grpc server of our own, counting how each call arrived. */
async function spiedHolder(
  opts: Partial<ConstructorParameters<typeof LockServer>[0]> = {},
  replace: (handlers: Record<string, Handler>) => void = () => undefined,
): Promise<Spied> {
  const lock = new LockServer({ holderId: 'holder1', lockTimeoutMs: 60_000, logger: silentLogger, ...opts });
  const handlers = lock.handlers() as unknown as Record<string, Handler>;
  replace(handlers);
  const unary: Record<string, number> = {};
  const session: Record<string, number> = {};
  const streams = { opened: 0, ended: 0 };
  const spied: Partial<Spied> = {};
  for (const name of ['Acquire', 'Release', 'Renew', 'Health', 'ReleaseMany', 'RenewMany']) {
    const real = handlers[name] as Handler;
    handlers[name] = (call, cb) => {
      if (name === 'Health' && spied.hangHealth) {
        spied.hangHealth();
        return;
      }
      // A unary call is a grpc-js ServerUnaryCall; a Session message's call is a plain object.
      const bucket = Object.getPrototypeOf(call) === Object.prototype ? session : unary;
      bucket[name] = (bucket[name] ?? 0) + 1;
      real(call, cb);
    };
  }
  const realSession = handlers['Session'] as unknown as (s: grpc.ServerDuplexStream<unknown, unknown>) => void;
  (handlers as Record<string, unknown>)['Session'] = (s: grpc.ServerDuplexStream<unknown, unknown>) => {
    streams.opened++;
    let counted = false;
    const ended = (): void => {
      if (!counted) streams.ended++;
      counted = true;
    };
    s.on('finish', ended);
    s.on('cancelled', ended);
    realSession(s);
  };
  const server = new grpc.Server();
  server.addService(loadLockProtocol().service, handlers as unknown as grpc.UntypedServiceImplementation);
  const port = await bindLoopback(server);
  lock.gc.start();
  const stop = (): void => {
    server.forceShutdown();
    void lock.abort();
  };
  cleanups.push(stop);
  return Object.assign(spied, { address: `127.0.0.1:${port}`, lock, unary, session, streams, stop }) as Spied;
}

/** A raw Session stream to `address`, answers collected by id. */
function rawSession(address: string): {
  send(m: SessionRequestMsg): void;
  answers: Map<number, SessionResponseMsg>;
  stream: grpc.ClientDuplexStream<SessionRequestMsg, SessionResponseMsg>;
} {
  const { Client } = loadLockProtocol();
  const c = new Client(address, grpc.credentials.createInsecure());
  const stream = c.Session(new grpc.Metadata());
  const answers = new Map<number, SessionResponseMsg>();
  stream.on('data', (m: SessionResponseMsg) => answers.set(m.id, m));
  stream.on('error', () => undefined);
  cleanups.push(() => {
    stream.cancel();
    c.close();
  });
  return { send: (m) => stream.write(m), answers, stream };
}

// These pin the gRPC Session stream, so their clients do not look for a local lane (each
// would ask the holder's Health once); lane.test.ts has the lane's own tests.
describe('Session stream', () => {
  it('carries every call of a default client over one stream, to the same handlers; session: false makes them unary', async () => {
    const h = await spiedHolder();
    const client = new LockClient({ localLane: false, requesterId: 'req1', logger: silentLogger });
    cleanups.push(() => client.close());
    const a = await client.acquire(h.address, ['block:holder1:1', 'block:holder1:2']);
    const b = await client.acquire(h.address, ['block:holder1:3'], { leaseMs: 5000 });
    await b.renew({ leaseMs: 8000 });
    expect((await client.health(h.address)).activeSessions).toBe(2);
    expect(await a.release()).toMatchObject({ confirmed: true, blocksReleased: 2 });
    expect(await b.release()).toMatchObject({ confirmed: true, blocksReleased: 1 });
    expect(h.unary).toEqual({});
    expect(h.session['Acquire']).toBe(2);
    expect(h.session['Renew']).toBe(1);
    expect(h.session['Health']).toBe(1);
    expect((h.session['Release'] ?? 0) + (h.session['ReleaseMany'] ?? 0)).toBe(2);
    expect(h.streams.opened).toBe(1);
    expect(client.sessionStats().get(h.address)).toMatchObject({ state: 'open', inFlight: 0, opened: 1 });
    expect(h.lock.counters()).toMatchObject({ acquired: 2, released: 2, active: 0 });

    const unaryClient = new LockClient({ localLane: false, requesterId: 'req2', session: false, logger: silentLogger });
    cleanups.push(() => unaryClient.close());
    const c = await unaryClient.acquire(h.address, ['block:holder1:4']);
    await c.release();
    expect(h.unary['Acquire']).toBe(1);
    expect(h.streams.opened).toBe(1);
    expect(unaryClient.sessionStats().size).toBe(0);
  });

  it('answers each raw message with its id and the unary status, and keeps the stream going', async () => {
    const h = await spiedHolder();
    const { codec } = loadLockProtocol();
    const raw = rawSession(h.address);
    const acquire = codec.AcquireRequest.encode({ requesterId: 'raw', blockIds: ['block:holder1:1'], leaseMs: 0, acquireId: 'x1' });
    raw.send({ id: 1, method: 'Bogus', payload: Buffer.alloc(0), timeoutMs: 5000 });
    raw.send({ id: 2, method: 'Session', payload: Buffer.alloc(0), timeoutMs: 5000 });
    raw.send({ id: 3, method: 'Acquire', payload: Buffer.from([0x0a, 0x7f, 0x01]), timeoutMs: 5000 }); // a string longer than the message
    raw.send({ id: 4, method: 'Acquire', payload: codec.AcquireRequest.encode({ requesterId: 'raw', blockIds: ['not-a-block'], leaseMs: 0, acquireId: '' }), timeoutMs: 5000 });
    raw.send({ id: 5, method: 'Acquire', payload: acquire, timeoutMs: 5000 });
    raw.send({ id: 6, method: 'Acquire', payload: acquire, timeoutMs: 5000 }); // the same acquire id again
    await waitFor(() => raw.answers.size === 6, 'six answers');
    const code = (id: number): number | undefined => raw.answers.get(id)?.code;
    expect([code(1), code(2), code(3), code(4), code(5), code(6)]).toEqual([
      grpc.status.UNIMPLEMENTED,
      grpc.status.UNIMPLEMENTED,
      grpc.status.INTERNAL,
      grpc.status.INVALID_ARGUMENT,
      grpc.status.OK,
      grpc.status.ALREADY_EXISTS,
    ]);
    const granted = codec.AcquireResponse.decode(raw.answers.get(5)?.payload as Buffer);
    expect(granted.sessionId).toMatch(/^session:holder1:/);
    // A release on the same stream, by acquire id, ends it.
    raw.send({ id: 7, method: 'Release', payload: codec.ReleaseRequest.encode({ requesterId: 'raw', sessionId: '', acquireId: 'x1' }), timeoutMs: 5000 });
    await waitFor(() => raw.answers.has(7), 'release answer');
    expect(codec.ReleaseResponse.decode(raw.answers.get(7)?.payload as Buffer).released).toBe(1);
    expect(h.lock.counters()).toMatchObject({ acquired: 1, released: 1, active: 0 });
  });

  it('a requester that sends 5,000 calls before reading any answer gets every answer', async () => {
    const h = await spiedHolder();
    const raw = rawSession(h.address);
    raw.stream.pause();
    for (let id = 1; id <= 5000; id++) raw.send({ id, method: 'Health', payload: Buffer.alloc(0), timeoutMs: 60_000 });
    await new Promise((r) => setTimeout(r, 200));
    raw.stream.resume();
    await waitFor(() => raw.answers.size === 5000, '5,000 answers');
    expect([...raw.answers.values()].every((m) => m.code === grpc.status.OK)).toBe(true);
    expect(h.session['Health']).toBe(5000);
  });

  it('the holder going away mid-acquire: ConnectionBrokenError, the possible grant released by acquire id, then a new stream', async () => {
    let release: (() => void) | undefined;
    const h = await spiedHolder({
      resolve: () =>
        new Promise((r) => {
          release = () => r([]);
        }),
    });
    const client = new LockClient({ localLane: false, requesterId: 'req1', logger: silentLogger, releaseTimeoutMs: 300, closeTimeoutMs: 500 });
    cleanups.push(() => client.close());
    const pending = client.acquire(h.address, ['block:holder1:1'], { timeoutMs: 20_000 }).catch((e: unknown) => e);
    await waitFor(() => release !== undefined, 'acquire at the resolver');
    h.stop();
    const err = await pending;
    expect(err).toBeInstanceOf(ConnectionBrokenError);
    expect(client.counters().abandonedAcquires).toBe(1);
    // Later calls (the release by acquire id, this acquire) go on new streams, which the dead
    // address refuses: typed errors, no hang.
    const again = await client.acquire(h.address, ['block:holder1:2'], { timeoutMs: 300 }).catch((e: unknown) => e);
    expect(again).toMatchObject({ name: expect.stringMatching(/ConnectionBroken|TimedOut/) });
    expect(client.sessionStats().get(h.address)?.opened).toBeGreaterThanOrEqual(2);
  });

  it('refuses a sessionIdleMs that is not a timer length', () => {
    for (const bad of [-1, Number.NaN, Number.POSITIVE_INFINITY, 2 ** 31]) {
      expect(() => new LockClient({ sessionIdleMs: bad, logger: silentLogger })).toThrow(/sessionIdleMs/);
    }
    expect(() => new LockClient({ sessionIdleMs: 0, logger: silentLogger }).close()).not.toThrow();
  });

  it('ends an idle stream after sessionIdleMs and opens a new one for the next call', async () => {
    const h = await spiedHolder();
    const client = new LockClient({ localLane: false, requesterId: 'req1', sessionIdleMs: 20, logger: silentLogger });
    cleanups.push(() => client.close());
    await (await client.acquire(h.address, ['block:holder1:1'])).release();
    await waitFor(() => h.streams.ended === 1, 'the idle stream ended');
    expect(client.sessionStats().get(h.address)).toMatchObject({ state: 'idle', opened: 1 });
    await (await client.acquire(h.address, ['block:holder1:2'])).release();
    expect(h.streams.opened).toBe(2);
    expect(h.lock.counters()).toMatchObject({ acquired: 2, released: 2, active: 0 });
  });

  it("a holder's close() ends the open session streams (its gRPC shutdown does not wait on them)", async () => {
    const server = new LockServer({ holderId: 'holder1', lockTimeoutMs: 60_000, logger: silentLogger });
    const port = await server.listen();
    const address = `127.0.0.1:${port}`;
    const client = new LockClient({ localLane: false, requesterId: 'req1', sessionIdleMs: 60_000, logger: silentLogger });
    cleanups.push(() => client.close());
    await (await client.acquire(address, ['block:holder1:1'])).release();
    expect(client.sessionStats().get(address)?.state).toBe('open');
    await server.close({ graceMs: 0 });
    await waitFor(() => client.sessionStats().get(address)?.state === 'idle', 'the client saw its stream end');
  });

  it('a handler that throws is answered UNKNOWN and the stream goes on; a handler may use call.getPeer() as on a unary call', async () => {
    let peers = 0;
    const { address } = await spiedHolder({}, (handlers) => {
      const realHealth = handlers['Health'] as Handler;
      handlers['Renew'] = () => {
        throw new Error('a broken wrapper');
      };
      handlers['Health'] = (call, cb) => {
        if ((call as { getPeer(): string }).getPeer().length > 0) peers++;
        realHealth(call, cb);
      };
    });
    const client = new LockClient({ localLane: false, requesterId: 'req1', logger: silentLogger });
    cleanups.push(() => client.close());
    const g = await client.acquire(address, ['block:holder1:1'], { leaseMs: 5000 });
    await expect(g.renew()).rejects.toMatchObject({ details: { remoteCode: 'UNKNOWN' } });
    expect((await client.health(address)).holderId).toBe('holder1');
    expect(peers).toBe(1);
    expect(await g.release()).toMatchObject({ confirmed: true });
    expect(client.sessionStats().get(address)?.opened).toBe(1);
  });

  it('a stream that fails (an answer over the size limit) fails every call on it UNAVAILABLE, and their possible grants are released', async () => {
    const h = await spiedHolder({
      // One lease's descriptor is 5 MiB: more than the client's default 4 MiB per message.
      resolve: (ids) => ({ lease: [Buffer.alloc(ids.includes('block:holder1:big') ? 5 << 20 : 8)] }),
    });
    const client = new LockClient({ localLane: false, requesterId: 'req1', logger: silentLogger });
    cleanups.push(() => client.close());
    const [big, small] = await Promise.all([
      client.acquire(h.address, ['block:holder1:big']).catch((e: unknown) => e),
      client.acquire(h.address, ['block:holder1:small']).catch((e: unknown) => e),
    ]);
    // Either may have been answered before the stream failed; whatever failed, failed as a broken connection.
    const failed = [big, small].filter((r) => !(r !== null && typeof r === 'object' && 'sessionId' in r));
    expect(failed.length).toBeGreaterThanOrEqual(1);
    for (const e of failed) expect(e).toBeInstanceOf(ConnectionBrokenError);
    expect(client.counters().abandonedAcquires).toBe(failed.length);
    for (const r of [big, small]) if (!failed.includes(r)) await (r as { release(): Promise<unknown> }).release();
    // Every lease the holder granted ends: released by acquire id or by the guard.
    await waitFor(() => h.lock.counters().active === 0, 'the holder has no lease left');
    expect(h.lock.counters()).toMatchObject({ acquired: 2, released: 2, active: 0 });
  });

  it('a requester that half-closes after its calls still gets every answer', async () => {
    let finish: (() => void) | undefined;
    const h = await spiedHolder({
      resolve: () =>
        new Promise((r) => {
          finish = () => r({ lease: [] });
        }),
    });
    const { codec } = loadLockProtocol();
    const raw = rawSession(h.address);
    const statuses: number[] = [];
    raw.stream.on('status', (st: grpc.StatusObject) => {
      statuses.push(st.code);
      details.push(st.details);
    });
    const details: string[] = [];
    raw.send({ id: 1, method: 'Acquire', payload: codec.AcquireRequest.encode({ requesterId: 'raw', blockIds: ['block:holder1:1'], leaseMs: 0, acquireId: 'h1' }), timeoutMs: 60_000 });
    await waitFor(() => finish !== undefined, 'acquire at the resolver');
    raw.stream.end();
    await new Promise((r) => setTimeout(r, 50));
    expect(statuses).toEqual([]); // still open: an answer is owed
    finish?.();
    await waitFor(() => statuses.length === 1, 'the stream ended');
    expect({ statuses, details }).toEqual({ statuses: [grpc.status.OK], details: [expect.any(String)] });
    expect(raw.answers.get(1)?.code).toBe(grpc.status.OK);
    expect(h.lock.counters()).toMatchObject({ acquired: 1, active: 1 });
  });

  it('a timeout beyond what a timer holds (2^31 ms) does not end the call at once', async () => {
    const h = await spiedHolder();
    const client = new LockClient({ localLane: false, requesterId: 'req1', logger: silentLogger });
    cleanups.push(() => client.close());
    expect((await client.health(h.address, { timeoutMs: 3e9 })).holderId).toBe('holder1');
    const g = await client.acquire(h.address, ['block:holder1:1'], { timeoutMs: 3e9 });
    await g.release();
    expect(h.session['Health']).toBe(1);
    expect(h.lock.counters()).toMatchObject({ acquired: 1, released: 1 });
  });

  it('a call that times out or is aborted leaves nothing in flight on the stream; close() cancels the stream', async () => {
    const h = await spiedHolder();
    const client = new LockClient({ localLane: false, requesterId: 'req1', sessionIdleMs: 60_000, logger: silentLogger });
    cleanups.push(() => client.close());
    // A lease first, so the stream is open; then calls the holder does not answer in time.
    const g = await client.acquire(h.address, ['block:holder1:1'], { leaseMs: 5000 });
    const slow = spiedSlow(h);
    const timedOut = await client.health(h.address, { timeoutMs: 30 }).catch((e: unknown) => e);
    expect(timedOut).toMatchObject({ code: 'TW_TIMED_OUT' });
    expect(client.sessionStats().get(h.address)).toMatchObject({ state: 'open', inFlight: 0 });
    const ac = new AbortController();
    const aborted = client.health(h.address, { timeoutMs: 60_000, signal: ac.signal }).catch((e: unknown) => e);
    await waitFor(() => slow.calls === 2, 'the second health call at the holder');
    expect(client.sessionStats().get(h.address)?.inFlight).toBe(1);
    ac.abort();
    expect(await aborted).toMatchObject({ code: 'TW_ABORTED' });
    expect(client.sessionStats().get(h.address)).toMatchObject({ state: 'open', inFlight: 0, opened: 1 });
    await g.release();
    await client.close();
    await waitFor(() => h.streams.ended === h.streams.opened, 'the holder saw the stream end at close');
    expect(h.streams.opened).toBe(1);
  });
});

/** Make the spied holder's Health never answer (counting calls). */
function spiedSlow(h: Spied): { calls: number } {
  const state = { calls: 0 };
  h.hangHealth = () => {
    state.calls++;
  };
  return state;
}
