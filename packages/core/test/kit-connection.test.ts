/**
 * The kit's connection/stream manager, driven directly (no engine) over the Unix-socket
 * transport: retire with transfers in flight in both directions, close and onClose exactly
 * once, work refused on a retiring connection, simultaneous open, quiesce on abort, and local
 * and remote revocation racing in-flight transfers.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import type { TensorwireError } from '../src/errors.js';
import { ClosedError, ErrorCode } from '../src/errors.js';
import { silentLogger } from '../src/logger.js';
import { FrameType, HEADER_BYTES } from '../src/kit/frames.js';
import { HandshakeCodec } from '../src/kit/handshake.js';
import type { KitConnection } from '../src/kit/connection.js';
import { pattern } from '../src/testing/pattern.js';
import { GRANT_STRIDE, createTransferBatch, type NodeIdentity, type TransferBatch, type TransportConnection } from '../src/transport.js';
import { UdsTransport, encodeUdsEndpoint, type UdsTransportOptions } from '../src/uds/transport.js';

const cleanups: (() => unknown)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

let n = 0;
async function node(options: UdsTransportOptions = {}) {
  const t = new UdsTransport(options);
  const id: NodeIdentity = { nodeId: `k${++n}`, incarnation: `inc${n}`, hostId: 'host1' };
  const inbound: KitConnection[] = [];
  const arrived: (() => void)[] = [];
  await t.start({
    identity: id,
    logger: silentLogger,
    inbound: (c) => {
      inbound.push(c as KitConnection);
      for (const f of arrived.splice(0)) f();
    },
  });
  cleanups.push(() => t.close());
  const nextInbound = (): Promise<KitConnection> => (inbound.length > 0 ? Promise.resolve(inbound.shift() as KitConnection) : new Promise((r) => arrived.push(() => r(inbound.shift() as KitConnection))));
  return { t, id, inbound, nextInbound };
}

async function pair(options: { a?: UdsTransportOptions; b?: UdsTransportOptions; streams?: number } = {}) {
  const a = await node(options.a);
  const b = await node(options.b);
  const ab = (await a.t.connect(b.id, b.t.endpoint(), { streams: options.streams ?? 2, signal: new AbortController().signal, deadline: Date.now() + 10_000 })) as KitConnection;
  const ba = await b.nextInbound();
  return { a, b, ab, ba };
}

function exec(conn: TransportConnection, batch: TransferBatch, options: { signal?: AbortSignal; stream?: number } = {}): Promise<void> {
  return conn.execute(options.stream ?? 0, batch, { signal: options.signal ?? AbortSignal.timeout(30_000), deadline: Date.now() + 30_000 });
}

async function outcome(p: Promise<unknown>): Promise<'ok' | TensorwireError> {
  return p.then(
    () => 'ok' as const,
    (e: unknown) => e as TensorwireError,
  );
}

/** `holder` registers `buffer`; `peer` decodes its descriptor. */
async function region(holder: UdsTransport, peer: UdsTransport, buffer: Uint8Array) {
  const reg = await holder.register({ kind: 'host', buffer });
  return { buffer, handle: reg.handle, remote: peer.decodeRemote(reg.payload, 'host', buffer.length) };
}

function closeRecorder(conn: TransportConnection): { calls: (TensorwireError | undefined)[]; closed: Promise<TensorwireError | undefined> } {
  const calls: (TensorwireError | undefined)[] = [];
  let done!: (e: TensorwireError | undefined) => void;
  const closed = new Promise<TensorwireError | undefined>((r) => (done = r));
  conn.onClose((e) => {
    calls.push(e);
    done(e);
  });
  return { calls, closed };
}

describe('kit connection: retire', () => {
  for (const side of ['dialer', 'acceptor'] as const) {
    it(`retire() by the ${side} with reads and writes in flight in both directions: all finish whole, new work is refused, both close orderly, onClose once`, async () => {
      const { a, b, ab, ba } = await pair({ streams: 2 });
      const size = 8 * 1024 * 1024;
      // Sources and destinations on both nodes; every transfer is issued before retire() in the same tick.
      const onB = await region(b.t, a.t, pattern(size, 1));
      const onA = await region(a.t, b.t, pattern(size, 2));
      const intoA = await region(a.t, b.t, new Uint8Array(size));
      const intoB = await region(b.t, a.t, new Uint8Array(size));
      const wroteOnB = await region(b.t, a.t, new Uint8Array(size));
      const wroteOnA = await region(a.t, b.t, new Uint8Array(size));
      const whole = (local: { handle: object }, remote: { remote: unknown }, op: 'read' | 'write') => createTransferBatch(op, Array.from({ length: 8 }, (_, i) => ({ local: local.handle, localOffset: i * (size / 8), remote: remote.remote, remoteOffset: i * (size / 8), length: size / 8 })));
      const closesA = closeRecorder(ab);
      const closesB = closeRecorder(ba);
      let retiredA = 0;
      let retiredB = 0;
      ab.onRetire(() => retiredA++);
      ba.onRetire(() => retiredB++);
      const flights = [
        exec(ab, whole(intoA, onB, 'read'), { stream: 0 }),
        exec(ab, whole(onA, wroteOnB, 'write'), { stream: 1 }),
        exec(ba, whole(intoB, onA, 'read'), { stream: 1 }),
        exec(ba, whole(onB, wroteOnA, 'write'), { stream: 0 }),
      ];
      const retiring = side === 'dialer' ? ab.retire() : ba.retire();
      const retirer = side === 'dialer' ? ab : ba;
      const other = side === 'dialer' ? ba : ab;
      expect(retirer.isOpen).toBe(false);
      // Work issued on the retiring side after retire() is refused, typed; nothing queues behind it.
      const late = side === 'dialer' ? whole(intoA, onB, 'read') : whole(intoB, onA, 'read');
      expect((await outcome(exec(retirer, late))) as TensorwireError).toMatchObject({ code: ErrorCode.SessionInvalidated });
      expect(await Promise.all(flights.map(outcome))).toEqual(['ok', 'ok', 'ok', 'ok']);
      expect(Buffer.compare(intoA.buffer, onB.buffer)).toBe(0);
      expect(Buffer.compare(intoB.buffer, onA.buffer)).toBe(0);
      expect(Buffer.compare(wroteOnB.buffer, onA.buffer)).toBe(0);
      expect(Buffer.compare(wroteOnA.buffer, onB.buffer)).toBe(0);
      await retiring;
      expect(await closesA.closed).toBeUndefined();
      expect(await closesB.closed).toBeUndefined();
      // The other side was told once, and refuses new work too.
      expect(side === 'dialer' ? retiredB : retiredA).toBe(1);
      expect(side === 'dialer' ? retiredA : retiredB).toBe(0);
      expect((await outcome(exec(other, whole(intoB, onA, 'read')))) as TensorwireError).toMatchObject({ code: ErrorCode.SessionInvalidated });
      await new Promise((r) => setTimeout(r, 20));
      expect(closesA.calls).toEqual([undefined]);
      expect(closesB.calls).toEqual([undefined]);
      expect(a.t.connectionCount + b.t.connectionCount).toBe(0);
      expect(a.t.socketCount + b.t.socketCount).toBe(0);
    });
  }

  it('a peer that never answers GOAWAY is cut off once the retirement stops making progress: onClose once, with ConnectionBroken', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'tw-kit-conn-'));
    cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
    const path = join(dir, 's');
    const peer: NodeIdentity = { nodeId: 'deaf', incarnation: 'd1', hostId: 'host1' };
    const codec = new HandshakeCodec('TWU2');
    const sockets: net.Socket[] = [];
    const server = net.createServer((s) => {
      sockets.push(s);
      s.on('error', () => undefined);
      s.once('data', (d: Buffer) => {
        if (d[1] === FrameType.Hello && d.length >= HEADER_BYTES) s.write(codec.encodeHelloAck({ ...peer, maxChunkBytes: 1 << 20 }));
      });
    });
    await new Promise<void>((r) => server.listen({ path }, () => r()));
    cleanups.push(() => {
      for (const s of sockets) s.destroy();
      return new Promise((r) => server.close(r));
    });
    const a = await node({ retireTimeoutMs: 150 });
    const conn = await a.t.connect(peer, encodeUdsEndpoint('host1', path), { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
    const closes = closeRecorder(conn);
    const retired = conn.retire();
    const e = await closes.closed;
    expect(e?.code).toBe(ErrorCode.ConnectionBroken);
    await retired;
    await new Promise((r) => setTimeout(r, 20));
    expect(closes.calls).toHaveLength(1);
    expect(a.t.socketCount).toBe(0);
  });
});

describe('kit connection: close', () => {
  it('close() is idempotent, fails in-flight work with its error after quiescing, onClose runs once on each side (late listeners too)', async () => {
    const { a, b, ab, ba } = await pair();
    const size = 16 * 1024 * 1024;
    const src = await region(b.t, a.t, pattern(size, 3));
    const dst = await region(a.t, b.t, new Uint8Array(size));
    const closesA = closeRecorder(ab);
    const closesB = closeRecorder(ba);
    const flight = outcome(exec(ab, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: src.remote, remoteOffset: 0, length: size }])));
    await new Promise((r) => setTimeout(r, 1));
    const reason = new ClosedError('test closes it');
    const c1 = ab.close(reason);
    const c2 = ab.close();
    expect(c2).toBe(c1);
    await c1;
    const result = await flight;
    if (result !== 'ok') expect(result).toBe(reason);
    // Quiesced before it settled: nothing lands any more.
    const snapshot = dst.buffer.slice();
    await new Promise((r) => setTimeout(r, 50));
    expect(Buffer.compare(dst.buffer, snapshot)).toBe(0);
    expect(await closesA.closed).toBe(reason);
    expect((await closesB.closed)?.code).toBe(ErrorCode.ConnectionBroken);
    let late = 0;
    ab.onClose((e) => {
      expect(e).toBe(reason);
      late++;
    });
    await ab.close();
    await new Promise((r) => setTimeout(r, 10));
    expect(late).toBe(1);
    expect(closesA.calls).toHaveLength(1);
    expect(closesB.calls).toHaveLength(1);
    expect((await outcome(exec(ab, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: src.remote, remoteOffset: 0, length: 8 }])))) as TensorwireError).toMatchObject({ code: ErrorCode.SessionInvalidated });
  });

  it('a peer transport closing mid-transfer: every call fails with a connection error, never partial success; onClose once', async () => {
    const { a, b, ab } = await pair({ streams: 2 });
    const size = 4 * 1024 * 1024;
    const src = await region(b.t, a.t, pattern(size, 4));
    const dsts = await Promise.all(Array.from({ length: 6 }, () => region(a.t, b.t, new Uint8Array(size))));
    const closes = closeRecorder(ab);
    const flights = dsts.map((d, i) => outcome(exec(ab, createTransferBatch('read', [{ local: d.handle, localOffset: 0, remote: src.remote, remoteOffset: 0, length: size }]), { stream: i % 2 })));
    await b.t.close();
    for (const [i, r] of (await Promise.all(flights)).entries()) {
      if (r === 'ok') expect(Buffer.compare((dsts[i] as { buffer: Uint8Array }).buffer, src.buffer)).toBe(0);
      else expect([ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]).toContain(r.code);
    }
    expect((await closes.closed)?.breaksConnection).toBe(true);
    await ab.close();
    expect(closes.calls).toHaveLength(1);
  });

  it('an abort mid-read is Aborted, settles only once nothing lands any more, and the connection or a new one works after', async () => {
    const { a, b, ab } = await pair({ streams: 1 });
    const size = 16 * 1024 * 1024;
    const src = await region(b.t, a.t, pattern(size, 5));
    const dst = await region(a.t, b.t, new Uint8Array(size));
    const ac = new AbortController();
    const flight = outcome(exec(ab, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: src.remote, remoteOffset: 0, length: size }]), { signal: ac.signal }));
    await new Promise((r) => setTimeout(r, 2));
    ac.abort();
    const r = await flight;
    if (r !== 'ok') {
      expect(r.code).toBe(ErrorCode.Aborted);
      const snapshot = dst.buffer.slice();
      await new Promise((res) => setTimeout(res, 50));
      expect(Buffer.compare(dst.buffer, snapshot)).toBe(0);
    }
    const conn = ab.isOpen ? ab : await a.t.connect(b.id, b.t.endpoint(), { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
    const again = await region(a.t, b.t, new Uint8Array(size));
    await exec(conn, createTransferBatch('read', [{ local: again.handle, localOffset: 0, remote: src.remote, remoteOffset: 0, length: size }]));
    expect(Buffer.compare(again.buffer, src.buffer)).toBe(0);
  });

  it('work on a stream that does not exist, or past its deadline, is refused typed before anything is sent', async () => {
    const { a, b, ab } = await pair({ streams: 2 });
    const src = await region(b.t, a.t, pattern(64, 6));
    const dst = await region(a.t, b.t, new Uint8Array(64));
    const batch = createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: src.remote, remoteOffset: 0, length: 64 }]);
    expect((await outcome(exec(ab, batch, { stream: 2 }))) as TensorwireError).toMatchObject({ code: ErrorCode.InvalidInput });
    expect((await outcome(ab.execute(0, batch, { signal: new AbortController().signal, deadline: Date.now() - 1 }))) as TensorwireError).toMatchObject({ code: ErrorCode.TimedOut });
    expect(dst.buffer.every((x) => x === 0)).toBe(true);
  });
});

describe('kit connection: deadlines against a stalled peer', () => {
  it('writes on several streams sharing one deadline against a peer that stopped reading: every call is TimedOut (not the ConnectionBroken of the quiesce)', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'tw-kit-conn-'));
    cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
    const path = join(dir, 's');
    const peer: NodeIdentity = { nodeId: 'stalled', incarnation: 's1', hostId: 'host1' };
    const codec = new HandshakeCodec('TWU2');
    const sockets: net.Socket[] = [];
    const server = net.createServer((s) => {
      sockets.push(s);
      s.on('error', () => undefined);
      s.once('data', () => {
        s.write(codec.encodeHelloAck({ ...peer, maxChunkBytes: 16 * 1024 * 1024 }));
        s.pause(); // accepted, answered the handshake, and never reads again
      });
    });
    await new Promise<void>((r) => server.listen({ path }, () => r()));
    cleanups.push(() => {
      for (const s of sockets) s.destroy();
      return new Promise((r) => server.close(r));
    });
    const a = await node();
    const conn = await a.t.connect(peer, encodeUdsEndpoint('host1', path), { streams: 2, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
    const size = 8 * 1024 * 1024;
    const src = await a.t.register({ kind: 'host', buffer: pattern(size, 11) });
    const remote = a.t.decodeRemote(new Uint8Array(16), 'host', size);
    const signal = AbortSignal.timeout(150);
    const calls = [0, 1].map((stream) =>
      outcome(conn.execute(stream, createTransferBatch('write', Array.from({ length: 8 }, (_, i) => ({ local: src.handle, localOffset: i * (size / 8), remote, remoteOffset: i * (size / 8), length: size / 8 }))), { signal, deadline: Date.now() + 150 })),
    );
    const results = await Promise.all(calls);
    expect(results.map((r) => (r as TensorwireError).code)).toEqual([ErrorCode.TimedOut, ErrorCode.TimedOut]);
  });
});

describe('kit connection: simultaneous open', () => {
  it('both nodes dialling each other at once: each gets the other\'s connection as inbound, with the dialer as initiator, and all four work', async () => {
    const a = await node();
    const b = await node();
    const opts = { streams: 2, signal: new AbortController().signal, deadline: Date.now() + 10_000 };
    const [ab, ba] = await Promise.all([a.t.connect(b.id, b.t.endpoint(), opts), b.t.connect(a.id, a.t.endpoint(), opts)]);
    const [inA, inB] = await Promise.all([a.nextInbound(), b.nextInbound()]);
    expect([ab.initiator, ba.initiator, inA.initiator, inB.initiator]).toEqual([a.id.nodeId, b.id.nodeId, b.id.nodeId, a.id.nodeId]);
    expect(inA.peer).toEqual(b.id);
    expect(inB.peer).toEqual(a.id);
    const onA = await region(a.t, b.t, pattern(4096, 7));
    const onB = await region(b.t, a.t, pattern(4096, 8));
    for (const [conn, local, remote] of [[ab, a, onB], [inA, a, onB], [ba, b, onA], [inB, b, onA]] as const) {
      const dst = await region(local.t, local === a ? b.t : a.t, new Uint8Array(4096));
      await exec(conn, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: remote.remote, remoteOffset: 0, length: 4096 }]));
      expect(Buffer.compare(dst.buffer, remote.buffer)).toBe(0);
    }
    // The loser is retired gracefully while the winner keeps working.
    await Promise.all([ba.retire(), inA.close()]).catch(() => undefined);
    const dst = await region(a.t, b.t, new Uint8Array(4096));
    await exec(ab, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: onB.remote, remoteOffset: 0, length: 4096 }]));
    expect(Buffer.compare(dst.buffer, onB.buffer)).toBe(0);
  });
});

describe('kit connection: revocation racing transfers', () => {
  it('local revoke: once revoke() of the destination resolved, its transfer has settled and no byte lands in it any more', async () => {
    const { a, b, ab } = await pair({ streams: 1, a: { revokeGraceMs: 100 } });
    const size = 32 * 1024 * 1024;
    const src = await region(b.t, a.t, pattern(size, 9));
    const dst = await region(a.t, b.t, new Uint8Array(size));
    let settled = false;
    const p = exec(ab, createTransferBatch('read', Array.from({ length: 8 }, (_, i) => ({ local: dst.handle, localOffset: i * (size / 8), remote: src.remote, remoteOffset: i * (size / 8), length: size / 8 }))));
    p.then(
      () => (settled = true),
      () => (settled = true),
    );
    const flight = outcome(p);
    await new Promise((r) => setTimeout(r, 1));
    await a.t.revoke(dst.handle);
    expect(settled).toBe(true);
    const snapshot = dst.buffer.slice();
    await new Promise((r) => setTimeout(r, 50));
    expect(Buffer.compare(dst.buffer, snapshot)).toBe(0);
    const r = await flight;
    if (r === 'ok') expect(Buffer.compare(dst.buffer, src.buffer)).toBe(0);
    else expect(r, String(r)).toMatchObject({ breaksConnection: true });
    // A post after the revoke is refused (locally, or because the stream was closed to quiesce).
    const after = await outcome(exec(ab, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: src.remote, remoteOffset: 0, length: 8 }])));
    expect([ErrorCode.InvalidInput, ErrorCode.SessionInvalidated]).toContain((after as TensorwireError).code);
  });

  it('remote revokeGrant racing a write through it: once it resolved, no byte lands in the granted memory', async () => {
    const { a, b, ab } = await pair({ streams: 1, b: { revokeGraceMs: 100 } });
    const size = 16 * 1024 * 1024;
    const target = new Uint8Array(size);
    const reg = await b.t.register({ kind: 'host', buffer: target });
    const r = new Float64Array(GRANT_STRIDE);
    r.set([0, 0, size]);
    const g = b.t.grant({ handles: [reg.handle], count: 1, ranges: r, bytes: size });
    const remote = a.t.decodeRemote(g.payload, 'host', size, Float64Array.of(size));
    const src = await region(a.t, b.t, pattern(size, 10));
    const flights = [0, 1, 2].map(() => outcome(exec(ab, createTransferBatch('write', Array.from({ length: 16 }, (_, i) => ({ local: src.handle, localOffset: i * (size / 16), remote, remoteOffset: i * (size / 16), length: size / 16 }))))));
    await new Promise((res) => setTimeout(res, 1));
    await b.t.revokeGrant(g.handle);
    const snapshot = target.slice();
    await new Promise((res) => setTimeout(res, 50));
    expect(Buffer.compare(target, snapshot)).toBe(0);
    for (const f of await Promise.all(flights)) if (f !== 'ok') expect([ErrorCode.RemoteRejected, ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]).toContain(f.code);
    expect(b.t.rangeGrantCount).toBe(0);
  });
});
