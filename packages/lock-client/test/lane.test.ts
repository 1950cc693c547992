/**
 * The local lane: a client's Session messages to a holder on the same host over an abstract
 * Unix socket instead of gRPC (src/lane.ts).
 *
 * - A default client finds the lane through Health after its first call and then calls over it:
 *   the same handlers, answers, leases and counters.
 * - Auth travels in the hello: a lane connection whose hello has a wrong token is answered
 *   UNAUTHENTICATED per call, as a gRPC stream with that metadata is.
 * - Protocol errors (a frame over the limit, bytes that do not decode, a first frame that is not
 *   a hello, a hello whose authorization is no header value, random bytes) close that
 *   connection; the holder goes on serving everyone else.
 * - A release that arrives while an acquire is being granted is answered after it (a fetch
 *   loop's release comes with its next acquire, whose answer the requester is waiting for).
 * - close() and abort() destroy every lane socket, a half-open one included.
 * - A holder whose lane this process cannot reach (another host) gets no call over it, and the
 *   search backs off.
 * - A lane whose hello names another holder is refused by the client (UNAVAILABLE).
 * - The holder going away: calls in flight on the lane fail ConnectionBrokenError, the client
 *   drops the lane (back to gRPC) and, a second or more later, finds the new holder's lane.
 * - Connections over `maxLaneConnections` are closed; `localLane: false` on either side, or
 *   `session: false` on the client, keeps every call on gRPC.
 */
import { once } from 'node:events';
import { createConnection, type Socket } from 'node:net';
import * as grpc from '@grpc/grpc-js';
import fc from 'fast-check';
import { ConnectionBrokenError, silentLogger } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient, loadLockProtocol, type SessionRequestMsg, type SessionResponseMsg } from '../src/index.js';
import { LANE_SUPPORTED, LaneDuplex, LaneFrames, laneAddress, laneFrame } from '../src/lane.js';
import { LockServer } from '../src/server/index.js';
import { waitFor } from './helpers.js';

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

const { codec } = loadLockProtocol();

async function holder(opts: Partial<ConstructorParameters<typeof LockServer>[0]> = {}, address = '127.0.0.1:0'): Promise<{ server: LockServer; address: string }> {
  const server = new LockServer({ holderId: 'holder1', lockTimeoutMs: 30_000, logger: silentLogger, ...opts });
  const port = await server.listen(address);
  cleanups.push(() => server.close({ graceMs: 0 }));
  return { server, address: `127.0.0.1:${port}` };
}

function client(opts: Partial<ConstructorParameters<typeof LockClient>[0]> = {}): LockClient {
  const c = new LockClient({ requesterId: 'req1', logger: silentLogger, ...opts });
  cleanups.push(() => c.close());
  return c;
}

/** A raw lane connection: frames out, answers in, and whether the holder closed it. */
function rawLane(name: string, allowHalfOpen = false): { socket: Socket; send(m: SessionRequestMsg): void; answers: SessionResponseMsg[]; closed: Promise<unknown> } {
  const socket = createConnection({ path: laneAddress(name), allowHalfOpen });
  const frames = new LaneFrames(1 << 20);
  const answers: SessionResponseMsg[] = [];
  socket.on('data', (chunk: Buffer) => {
    for (const f of frames.push(chunk)) answers.push(codec.SessionResponse.decode(f));
  });
  socket.on('error', () => undefined);
  const closed = new Promise((resolve) => socket.once('close', resolve));
  cleanups.push(() => void socket.destroy());
  return { socket, send: (m) => socket.write(laneFrame(codec.SessionRequest.encode(m))), answers, closed };
}

/** Health calls until the client's calls to `address` go over the holder's lane (the search, its probe, then the switch). */
async function onLane(c: LockClient, address: string): Promise<void> {
  for (let i = 0; i < 300; i++) {
    await c.health(address);
    if (c.sessionStats().get(address)?.lane === true) return;
    await new Promise((r) => setTimeout(r, 10));
  }
  throw new Error(`the client never moved to the lane of ${address}`);
}

const hello = (authorization = ''): SessionRequestMsg => ({ id: 0, method: '', payload: Buffer.from(authorization), timeoutMs: 0 });
const acquire = (id: number, block: string): SessionRequestMsg => ({
  id,
  method: 'Acquire',
  payload: codec.AcquireRequest.encode({ requesterId: 'raw', blockIds: [block], leaseMs: 0, acquireId: `a${id}` }),
  timeoutMs: 10_000,
});

describe.skipIf(!LANE_SUPPORTED)('local lane', () => {
  it('a default client finds the lane after its first call and then calls over it: the same leases, answers and counters', async () => {
    const h = await holder();
    expect(h.server.localLane).toMatch(/^tensorwire-lock-[0-9a-f]{32}$/);
    expect((await client({ localLane: false }).health(h.address)).localLane).toBe(h.server.localLane);
    const c = client();
    const a = await c.acquire(h.address, ['block:holder1:1', 'block:holder1:2']);
    // The first call went over gRPC, with the Health that looks for the lane behind it.
    expect(c.sessionStats().get(h.address)).toMatchObject({ lane: false, lanesOpened: 0 });
    await onLane(c, h.address);
    const b = await c.acquire(h.address, ['block:holder1:3'], { leaseMs: 5000 });
    expect(c.sessionStats().get(h.address)).toMatchObject({ state: 'open', lane: true, opened: 2, lanesOpened: 1 });
    await b.renew({ leaseMs: 8000 });
    expect((await c.health(h.address)).activeSessions).toBe(2);
    expect(await a.release()).toMatchObject({ confirmed: true, blocksReleased: 2 });
    expect(await b.release()).toMatchObject({ confirmed: true, blocksReleased: 1 });
    // A repeated block is the holder's answer, the same typed error as over gRPC.
    const dup = await c.acquire(h.address, ['block:holder1:5', 'block:holder1:5']).catch((e: unknown) => e);
    const viaGrpc = await client({ requesterId: 'req2', localLane: false }).acquire(h.address, ['block:holder1:5', 'block:holder1:5']).catch((e: unknown) => e);
    expect(dup?.constructor).toBe(viaGrpc?.constructor);
    expect((dup as Error).message).toBe((viaGrpc as Error).message);
    expect(c.sessionStats().get(h.address)?.lane).toBe(true);
    expect(h.server.counters()).toMatchObject({ acquired: 2, released: 2, active: 0 });
  });

  it('auth travels in the hello: the right token is served, a wrong or missing one is UNAUTHENTICATED per call', async () => {
    const h = await holder({ token: 's3cret' });
    const c = client({ token: 's3cret' });
    const g = await c.acquire(h.address, ['block:holder1:1']);
    await onLane(c, h.address);
    await (await c.acquire(h.address, ['block:holder1:2'])).release();
    expect(c.sessionStats().get(h.address)?.lane).toBe(true);
    await g.release();
    for (const auth of ['Bearer nope', '']) {
      const raw = rawLane(h.server.localLane as string);
      raw.send(hello(auth));
      raw.send(acquire(1, 'block:holder1:9'));
      await waitFor(() => raw.answers.length === 2, 'the hello and the answer');
      expect(raw.answers[0]).toMatchObject({ id: 0, code: grpc.status.OK, details: 'holder1' });
      expect(raw.answers[1]).toMatchObject({ id: 1, code: grpc.status.UNAUTHENTICATED });
    }
    expect(h.server.counters().active).toBe(0);
  });

  it('protocol errors close that connection, and the holder goes on serving', async () => {
    const h = await holder({ grpcOptions: { 'grpc.max_receive_message_length': 64 * 1024 } });
    const name = h.server.localLane as string;
    const cases: [string, (raw: ReturnType<typeof rawLane>) => void][] = [
      // After the hello (whose timer no longer runs): a frame header of 1 MiB, over the 64 KiB limit.
      ['a frame over the limit', (raw) => {
        raw.send(hello());
        raw.socket.write(Buffer.from([0x00, 0x00, 0x10, 0x00]));
      }],
      ['a first frame that is not a hello', (raw) => raw.send(acquire(1, 'block:holder1:1'))],
      ['a hello with an id', (raw) => raw.send({ ...hello(), id: 7 })],
      ['a hello whose authorization is no header value', (raw) => raw.send(hello('Bearer \u0000\n'))],
      ['a frame that does not decode', (raw) => raw.socket.write(laneFrame(Uint8Array.of(0xff, 0xff, 0xff)))],
      ['a message that does not decode after the hello', (raw) => {
        raw.send(hello());
        raw.socket.write(laneFrame(Uint8Array.of(0x0a, 0xff)));
      }],
    ];
    for (const [what, send] of cases) {
      const raw = rawLane(name);
      send(raw);
      await expect(raw.closed, what).resolves.toBeDefined();
    }
    await fc.assert(
      fc.asyncProperty(fc.uint8Array({ minLength: 1, maxLength: 256 }), async (bytes) => {
        const raw = rawLane(name);
        raw.socket.write(bytes);
        raw.socket.end();
        await raw.closed;
        // Nothing but the hello's answer, if the bytes happened to be one.
        expect(raw.answers.every((a) => a.id === 0)).toBe(true);
      }),
      { numRuns: 50 },
    );
    // Still serving, over the lane too.
    const c = client();
    await (await c.acquire(h.address, ['block:holder1:1'])).release();
    await onLane(c, h.address);
    await (await c.acquire(h.address, ['block:holder1:1'])).release();
    expect(c.sessionStats().get(h.address)?.lane).toBe(true);
    expect(h.server.counters()).toMatchObject({ acquired: 2, released: 2, active: 0 });
  });

  it('a release that arrives with an acquire being granted is answered after that acquire; one that arrives first is answered first', async () => {
    // A resolver that awaits, as engineGrants does (microtasks only): without the wait, the
    // release's synchronous work would run inside the acquire's grant and answer first.
    const h = await holder({ resolveLease: async () => {
      for (let i = 0; i < 4; i++) await null;
      return { lease: [Uint8Array.of(1, 2, 3)] };
    } });
    const raw = rawLane(h.server.localLane as string);
    raw.send(hello());
    const answered = (id: number): Promise<void> => waitFor(() => raw.answers.some((a) => a.id === id), `answer ${id}`);
    const sessionOf = (id: number): string => codec.AcquireResponse.decode((raw.answers.find((a) => a.id === id) as SessionResponseMsg).payload).sessionId;
    const releaseMany = (id: number, sessionId: string): SessionRequestMsg => ({
      id,
      method: 'ReleaseMany',
      payload: codec.ReleaseManyRequest.encode({ requesterId: 'raw', sessionIds: [sessionId], acquireIds: [] }),
      timeoutMs: 10_000,
    });
    const frames = (...ms: SessionRequestMsg[]): Buffer => Buffer.concat(ms.map((m) => laneFrame(codec.SessionRequest.encode(m))));
    raw.send(acquire(1, 'block:holder1:1'));
    await answered(1);
    // One write: the next fetch's acquire, then the last one's release, as a fetch loop sends them.
    raw.socket.write(frames(acquire(2, 'block:holder1:2'), releaseMany(3, sessionOf(1))));
    await answered(3);
    expect(raw.answers.filter((a) => a.id !== 0).map((a) => [a.id, a.code])).toEqual([[1, 0], [2, 0], [3, 0]]);
    // A release that comes first, with no grant under way, is not held back.
    raw.socket.write(frames(releaseMany(4, sessionOf(2)), acquire(5, 'block:holder1:3')));
    await answered(5);
    expect(raw.answers.slice(-2).map((a) => a.id)).toEqual([4, 5]);
    expect(codec.ReleaseManyResponse.decode((raw.answers.find((a) => a.id === 3) as SessionResponseMsg).payload).released).toEqual([1]);
    expect(h.server.counters()).toMatchObject({ acquired: 3, released: 2, active: 1 });
  });

  it('close() and abort() end the lane: its sockets are destroyed (also one that never closes its side) and no new one is accepted', async () => {
    for (const stop of ['close', 'abort'] as const) {
      const server = new LockServer({ holderId: 'holder1', lockTimeoutMs: 30_000, logger: silentLogger });
      await server.listen('127.0.0.1:0');
      const name = server.localLane as string;
      // Half-closed by the holder and never closed by this side: still destroyed.
      const served = rawLane(name, true);
      served.send(hello());
      await waitFor(() => served.answers.length === 1, 'the hello answered');
      const greeting = rawLane(name); // never says hello
      await new Promise((r) => setTimeout(r, 20));
      const ended = new Promise((resolve) => served.socket.once('end', resolve));
      if (stop === 'close') await server.close({ graceMs: 0 });
      else await server.abort();
      await greeting.closed;
      // The holder's side is gone, not just half-closed: writing to it fails (EPIPE / reset).
      await ended;
      const failed = new Promise((resolve) => served.socket.once('error', resolve));
      for (let i = 0; i < 200 && !served.socket.destroyed; i++) {
        served.send(hello());
        await new Promise((r) => setTimeout(r, 10));
      }
      await failed;
      expect(server.localLane).toBeUndefined();
      const late = rawLane(name);
      await late.closed;
      expect(late.answers).toEqual([]);
    }
  });

  it('a holder whose lane this process cannot reach (another host): no call is ever sent to it, and the search backs off', async () => {
    // The holder's handlers on a gRPC server of our own, its Health naming a lane that does not exist here.
    const lock = new LockServer({ holderId: 'far', lockTimeoutMs: 30_000, logger: silentLogger });
    const handlers = lock.handlers() as unknown as Record<string, (call: unknown, cb: grpc.sendUnaryData<unknown>) => void>;
    let healths = 0;
    handlers['Health'] = (_call, cb) => {
      healths++;
      cb(null, { status: 'SERVING', holderId: 'far', lockTimeoutMs: 30_000, activeSessions: 0, activeBlocks: 0, localLane: `tensorwire-lock-${'0'.repeat(32)}` });
    };
    const server = new grpc.Server();
    server.addService(loadLockProtocol().service, handlers as unknown as grpc.UntypedServiceImplementation);
    const port = await new Promise<number>((resolve, reject) => server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))));
    lock.gc.start();
    cleanups.push(() => {
      server.forceShutdown();
      return lock.abort();
    });
    const c = client();
    const address = `127.0.0.1:${port}`;
    const until = Date.now() + 2500;
    let cycles = 0;
    while (Date.now() < until) {
      await (await c.acquire(address, ['block:far:1'], { timeoutMs: 5000 })).release();
      cycles++;
      await new Promise((r) => setTimeout(r, 20));
    }
    expect(cycles).toBeGreaterThan(10);
    expect(c.sessionStats().get(address)).toMatchObject({ lane: false, lanesOpened: 0 });
    // Searches at about 0, 1 and 3 s: two or three in 2.5 s, not one per call or per second.
    expect(healths).toBeGreaterThanOrEqual(2);
    expect(healths).toBeLessThanOrEqual(3);
    expect(lock.counters()).toMatchObject({ acquired: cycles, released: cycles, active: 0 });
  });

  it("the client refuses a lane whose hello names another holder", async () => {
    const h = await holder();
    const d = new LaneDuplex(h.server.localLane as string, 'someone-else', '', codec);
    const [status] = (await once(d, 'status')) as [{ code: grpc.status; details: string }];
    expect(status.code).toBe(grpc.status.UNAVAILABLE);
    expect(status.details).toMatch(/not from holder someone-else/);
  });

  it('the holder going away: a call in flight on the lane fails ConnectionBroken; the client goes back to gRPC, then finds the new holder\'s lane', async () => {
    const h = await holder({ holderId: 'holder1' });
    const c = client();
    await (await c.acquire(h.address, ['block:holder1:1'])).release();
    await onLane(c, h.address);
    await (await c.acquire(h.address, ['block:holder1:1'])).release();
    expect(c.sessionStats().get(h.address)?.lane).toBe(true);
    // A holder that never answers an acquire, then goes away.
    const slow = await holder({ holderId: 'holder2', resolve: () => new Promise(() => undefined) });
    await onLane(c, slow.address);
    const pending = c.acquire(slow.address, ['block:holder2:1'], { timeoutMs: 10_000 }).catch((e: unknown) => e);
    await waitFor(() => slow.server.counters().requests.acquire >= 1, 'the acquire at the holder');
    expect(c.sessionStats().get(slow.address)?.lane).toBe(true);
    const port = Number(slow.address.split(':')[1]);
    await slow.server.close({ graceMs: 0 });
    expect(await pending).toBeInstanceOf(ConnectionBrokenError);
    // The lost lane is dropped with the call: the session is back on gRPC (the next stream it
    // opens is a gRPC call), and the lane search may start again a second later.
    const lost = c.sessionStats().get(slow.address);
    expect(lost).toMatchObject({ lane: false, state: 'idle' });
    // A new holder on the same address: the client reaches it (over gRPC once the channel
    // reconnects) and then finds its lane. Whether the first acquire that succeeds is already on
    // the new lane depends on how long the channel takes to reconnect (a search may be due by
    // then), so only the outcome is checked: a lane opened after the loss, and every lease released.
    const again = await holder({ holderId: 'holder2' }, `127.0.0.1:${port}`);
    for (let tries = 0; ; tries++) {
      const g = await c.acquire(again.address, ['block:holder2:1'], { timeoutMs: 10_000 }).catch((e: unknown) => {
        if (!(e instanceof ConnectionBrokenError) || tries > 50) throw e;
      });
      if (g === undefined) {
        await new Promise((r) => setTimeout(r, 100));
        continue;
      }
      await g.release();
      break;
    }
    await onLane(c, again.address);
    await (await c.acquire(again.address, ['block:holder2:1'])).release();
    expect(c.sessionStats().get(again.address)).toMatchObject({ lane: true, lanesOpened: (lost?.lanesOpened ?? 0) + 1 });
    expect(again.server.counters()).toMatchObject({ released: again.server.counters().acquired, active: 0 });
  });

  it('connections over maxLaneConnections are closed; localLane: false (holder or client) or session: false keeps calls on gRPC', async () => {
    const h = await holder({ maxLaneConnections: 2 });
    const name = h.server.localLane as string;
    const first = [rawLane(name), rawLane(name)];
    for (const r of first) r.send(hello());
    await waitFor(() => first.every((r) => r.answers.length === 1), 'two hellos answered');
    const third = rawLane(name);
    third.send(hello());
    await third.closed;
    expect(third.answers).toEqual([]);

    const off = await holder({ localLane: false });
    expect(off.server.localLane).toBeUndefined();
    const c = client();
    for (let i = 0; i < 3; i++) await (await c.acquire(off.address, ['block:holder1:1'])).release();
    await waitFor(() => off.server.counters().requests.health >= 1, 'the lane search');
    await (await c.acquire(off.address, ['block:holder1:1'])).release();
    expect(c.sessionStats().get(off.address)?.lane).toBe(false);

    const on = await holder();
    for (const opts of [{ localLane: false }, { session: false }]) {
      const cc = client({ requesterId: 'req3', ...opts });
      for (let i = 0; i < 3; i++) await (await cc.acquire(on.address, ['block:holder1:1'])).release();
      expect(cc.sessionStats().get(on.address)?.lane ?? false).toBe(false);
    }
    expect(on.server.counters().requests.health).toBe(0);
  });
});
