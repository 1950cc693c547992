/**
 * Conformance cases that drive a transport directly, as the engine does (start, register,
 * decodeRemote, connect, execute, retire, close), for behaviour the engine cannot show: the
 * handshake's identity checks, retire() and close() with work in flight on both sides, an
 * execute() whose signal already fired, ResourceExhaustedError, local bounds, and connect() to
 * a peer that is gone.
 */
import { randomBytes } from 'node:crypto';
import { afterAll, describe, expect, it } from 'vitest';
import { AbortedError, ErrorCode, TensorwireError, TimedOutError } from '../errors.js';
import { defaultHostId } from '../host-id.js';
import { silentLogger } from '../logger.js';
import { createTransferBatch, type NodeIdentity, type TransferBatch, type TransferRangeInit, type Transport, type TransportConnection } from '../transport.js';
import type { ConformanceBuffer, SuiteContext } from './index.js';
import { pattern } from './pattern.js';
import { allZero, equal, expectCode, outcome, settle, settlesWithin, until } from './util.js';

interface Node {
  readonly t: Transport;
  readonly identity: NodeIdentity;
  readonly blob: Uint8Array;
  readonly inbound: TransportConnection[];
}

interface Region {
  readonly buf: ConformanceBuffer;
  readonly handle: object;
  readonly payload: Uint8Array;
  readonly length: number;
}

let counter = 0;

export function describeContract(ctx: SuiteContext): void {
  const { options } = ctx;

  describe('transport contract (driven directly)', () => {
    const nodes: Node[] = [];
    afterAll(async () => {
      await Promise.allSettled(nodes.map((n) => n.t.close()));
    });

    async function node(prefix: string): Promise<Node> {
      const t = await options.createTransport();
      const nodeId = `${prefix}${++counter}`;
      const hostId = options.engineOptions?.hostId ?? (t.capabilities.local ? defaultHostId() : `host-${nodeId}`);
      const identity: NodeIdentity = { nodeId, incarnation: randomBytes(9).toString('base64url'), hostId };
      const inbound: TransportConnection[] = [];
      await t.start({ identity, logger: silentLogger, inbound: (c) => inbound.push(c) });
      const n = { t, identity, blob: t.endpoint(), inbound };
      nodes.push(n);
      return n;
    }

    async function region(n: Node, length: number, seed?: number): Promise<Region> {
      const buf = await ctx.buffer(length);
      if (seed !== undefined) await buf.write(pattern(length, seed));
      const r = await n.t.register(buf.memory);
      return { buf, handle: r.handle, payload: r.payload, length };
    }

    const live = (): { signal: AbortSignal; deadline: number } => ({ signal: new AbortController().signal, deadline: Date.now() + 60_000 });

    async function connect(from: Node, to: Node): Promise<{ conn: TransportConnection; back: TransportConnection }> {
      const seen = to.inbound.length;
      const conn = await settlesWithin(from.t.connect(to.identity, to.blob, { ...live(), streams: Math.min(2, from.t.capabilities.maxStreams) }), ctx.guardMs, 'connect()');
      await until(() => to.inbound.length > seen, ctx.guardMs, 'the acceptor reporting the connection (TransportHost.inbound)');
      return { conn, back: to.inbound[to.inbound.length - 1] as TransportConnection };
    }

    /** The largest range a batch on `conn` may have (the suite's chunk size at most). */
    function pieceOf(conn: TransportConnection, t: Transport): number {
      return Math.min(ctx.chunkBytes, t.capabilities.maxChunkBytes, conn.maxChunkBytes ?? Number.POSITIVE_INFINITY);
    }

    /** `length` bytes from `localOffset` / `remoteOffset`, cut into ranges of at most `piece`. */
    function ranges(local: object, localOffset: number, remote: unknown, remoteOffset: number, length: number, piece: number): TransferRangeInit[] {
      const out: TransferRangeInit[] = [];
      for (let at = 0; at < length; at += piece) out.push({ local, localOffset: localOffset + at, remote, remoteOffset: remoteOffset + at, length: Math.min(piece, length - at) });
      return out;
    }

    function remoteOf(on: Node, r: Region): unknown {
      return on.t.decodeRemote(r.payload, ctx.mem.kind, r.length);
    }

    function closed(conn: TransportConnection): Promise<TensorwireError | undefined> {
      return new Promise((resolve) => conn.onClose(resolve));
    }

    it('the handshake names both sides as they are: connect() returns the expected peer; the acceptor sees the connector', async () => {
      const a = await node('ha');
      const b = await node('hb');
      const { conn, back } = await connect(a, b);
      expect(conn.peer.nodeId).toBe(b.identity.nodeId);
      expect(conn.peer.incarnation).toBe(b.identity.incarnation);
      expect(back.peer.nodeId).toBe(a.identity.nodeId);
      expect(back.peer.incarnation).toBe(a.identity.incarnation);
      expect(conn.initiator).toBe(a.identity.nodeId);
      expect(back.initiator).toBe(a.identity.nodeId);
      expect(conn.isOpen && back.isOpen).toBe(true);
      expect(conn.streams).toBeGreaterThanOrEqual(1);
      expect(conn.streams).toBeLessThanOrEqual(Math.min(2, a.t.capabilities.maxStreams));
      await conn.close();
    });

    it('connect() to an endpoint where another node listens than the one named is refused, and leaves no open connection there', async () => {
      const a = await node('la');
      const b = await node('lb');
      const c = await node('lc');
      const e = await outcome(settlesWithin(a.t.connect(b.identity, c.blob, { ...live(), streams: 1 }), ctx.guardMs, 'connect() to the wrong node'));
      expect(e, `connect() expecting ${b.identity.nodeId} accepted ${c.identity.nodeId}`).toBeInstanceOf(TensorwireError);
      await settle();
      expect(c.inbound.filter((x) => x.isOpen)).toHaveLength(0);
    });

    for (const who of ['connector', 'acceptor'] as const) {
      it(`retire() by the ${who} with transfers in flight in both directions: all complete, both sides close in order, the peer is told`, async () => {
        const a = await node('ra');
        const b = await node('rb');
        const { conn, back } = await connect(a, b);
        const streams = Math.min(conn.streams, back.streams);
        const size = 1024 * 1024;
        const total = streams * size;
        const aSrc = await region(a, total, 120);
        const aDst = await region(a, total);
        const bSrc = await region(b, total, 121);
        const bDst = await region(b, total);
        const bSink = await region(b, total);
        const piece = Math.min(pieceOf(conn, a.t), pieceOf(back, b.t));
        const fromB = remoteOf(a, bSrc);
        const intoB = remoteOf(a, bSink);
        const fromA = remoteOf(b, aSrc);
        const retireSeen = { a: 0, b: 0 };
        conn.onRetire(() => retireSeen.a++);
        back.onRetire(() => retireSeen.b++);
        const closes = [closed(conn), closed(back)];
        const work: Promise<void>[] = [];
        for (let s = 0; s < streams; s++) {
          work.push(conn.execute(s, createTransferBatch('read', ranges(aDst.handle, s * size, fromB, s * size, size, piece)), live()));
          work.push(conn.execute(s, createTransferBatch('write', ranges(aSrc.handle, s * size, intoB, s * size, size, piece)), live()));
          work.push(back.execute(s, createTransferBatch('read', ranges(bDst.handle, s * size, fromA, s * size, size, piece)), live()));
        }
        const retiring = who === 'connector' ? conn : back;
        const retired = retiring.retire();
        const outcomes = await settlesWithin(Promise.all(work.map(outcome)), ctx.guardMs, 'transfers in flight on a retiring connection');
        for (const o of outcomes) expect(o, 'a transfer in flight when retire() was called failed').toBe('ok');
        expect(equal(await aDst.buf.read(0, total), await bSrc.buf.read(0, total))).toBe(true);
        expect(equal(await bSink.buf.read(0, total), await aSrc.buf.read(0, total))).toBe(true);
        expect(equal(await bDst.buf.read(0, total), await aSrc.buf.read(0, total))).toBe(true);
        await settlesWithin(retired, ctx.guardMs, 'retire()');
        const errors = await settlesWithin(Promise.all(closes), ctx.guardMs, 'both sides closing after retire()');
        expect(errors, 'an orderly close reports no error to onClose').toEqual([undefined, undefined]);
        expect(conn.isOpen || back.isOpen).toBe(false);
        expect(who === 'connector' ? retireSeen.b : retireSeen.a, 'the peer was told (onRetire)').toBe(1);
        await expectCode(settlesWithin(conn.execute(0, createTransferBatch('read', ranges(aDst.handle, 0, fromB, 0, 64, piece)), live()), ctx.guardMs, 'execute() after retire'), [
          ErrorCode.SessionInvalidated,
          ErrorCode.ConnectionBroken,
          ErrorCode.Closed,
        ]);
      });
    }

    it("execute() whose signal already fired rejects with the signal's error and moves nothing", async () => {
      const a = await node('sa');
      const b = await node('sb');
      const { conn } = await connect(a, b);
      const src = await region(b, 64 * 1024, 122);
      const dst = await region(a, 64 * 1024);
      const remote = remoteOf(a, src);
      for (const [reason, code] of [
        [new AbortedError('the suite aborted it'), ErrorCode.Aborted],
        [new TimedOutError('the suite timed it out'), ErrorCode.TimedOut],
      ] as const) {
        const ac = new AbortController();
        ac.abort(reason);
        const batch = createTransferBatch('read', ranges(dst.handle, 0, remote, 0, 64 * 1024, pieceOf(conn, a.t)));
        await expectCode(settlesWithin(conn.execute(0, batch, { signal: ac.signal, deadline: Date.now() + 60_000 }), ctx.guardMs, 'execute() with a fired signal'), [code]);
        await settle();
        expect(allZero(await dst.buf.read(0, 64 * 1024)), 'bytes moved for a call whose signal had fired').toBe(true);
      }
      await conn.close();
    });

    it('close() with transfers in flight: every call settles (complete, or a typed error), onClose runs once, and no byte lands after close() resolved', async () => {
      const a = await node('ca');
      const b = await node('cb');
      const { conn, back } = await connect(a, b);
      const size = 512 * 1024;
      const n = 16 * conn.streams;
      const src = await region(b, n * size, 123);
      const dst = await region(a, n * size);
      const remote = remoteOf(a, src);
      const piece = pieceOf(conn, a.t);
      let calls = 0;
      conn.onClose(() => calls++);
      const peerClosed = closed(back);
      const work = Array.from({ length: n }, (_, i) => outcome(conn.execute(i % conn.streams, createTransferBatch('read', ranges(dst.handle, i * size, remote, i * size, size, piece)), live())));
      await settlesWithin(conn.close(), ctx.guardMs, 'close()');
      const snapshot = await dst.buf.read(0, n * size);
      const outcomes = await settlesWithin(Promise.all(work), ctx.guardMs, 'calls in flight when close() was called');
      await settle();
      expect(equal(await dst.buf.read(0, n * size), snapshot), 'bytes landed after close() resolved').toBe(true);
      const expected = await src.buf.read(0, n * size);
      for (const [i, o] of outcomes.entries()) {
        if (o === 'ok') expect(equal(snapshot.subarray(i * size, (i + 1) * size), expected.subarray(i * size, (i + 1) * size)), `call ${i} resolved with partial data`).toBe(true);
        else expect(o).toBeInstanceOf(TensorwireError);
      }
      let late = 0;
      conn.onClose(() => late++);
      await settle();
      expect(calls, 'onClose listeners run exactly once').toBe(1);
      expect(late, 'a listener added after the close runs once too').toBe(1);
      expect(conn.isOpen).toBe(false);
      await expectCode(settlesWithin(conn.execute(0, createTransferBatch('read', ranges(dst.handle, 0, remote, 0, 64, piece)), live()), ctx.guardMs, 'execute() after close()'), [
        ErrorCode.SessionInvalidated,
        ErrorCode.ConnectionBroken,
        ErrorCode.Closed,
      ]);
      await settlesWithin(peerClosed, ctx.guardMs, "the peer's side closing");
    });

    it('ResourceExhaustedError only when nothing of that batch started: its destinations stay untouched', async () => {
      const a = await node('xa');
      const b = await node('xb');
      const { conn } = await connect(a, b);
      const piece = Math.min(32 * 1024, pieceOf(conn, a.t));
      // Many calls of uneven sizes at once on one stream, so any per-stream limit is crossed,
      // and (over rounds of differently shaped calls) crossed in the middle of a batch.
      const shapes = [0, 5, 11, 17].map((shift) => Array.from({ length: 64 }, (_, i) => 1 + ((i * 7 + shift) % 23)));
      const longest = Math.max(...shapes.map((counts) => counts.reduce((x, c) => x + c, 0))) * piece;
      const src = await region(b, longest, 124);
      const dst = await region(a, longest);
      const remote = remoteOf(a, src);
      const expected = await src.buf.read(0, longest);
      for (const [round, counts] of shapes.entries()) {
        await dst.buf.write(new Uint8Array(longest));
        const starts: number[] = [];
        let total = 0;
        for (const c of counts) {
          starts.push(total);
          total += c * piece;
        }
        const work = counts.map((c, i) => outcome(conn.execute(0, createTransferBatch('read', ranges(dst.handle, starts[i] as number, remote, starts[i] as number, c * piece, piece)), live())));
        const outcomes = await settlesWithin(Promise.all(work), ctx.guardMs, 'many calls on one stream');
        await settle();
        const got = await dst.buf.read(0, total);
        for (const [i, o] of outcomes.entries()) {
          const at = starts[i] as number;
          const part = got.subarray(at, at + (counts[i] as number) * piece);
          if (o === 'ok') expect(equal(part, expected.subarray(at, at + part.length))).toBe(true);
          else {
            expect(o, `round ${round} call ${i}: ${(o as Error).message}`).toBeInstanceOf(TensorwireError);
            expect((o as TensorwireError).code).toBe(ErrorCode.ResourceExhausted);
            expect(allZero(part), `round ${round} call ${i} was refused as ResourceExhausted after part of it had moved`).toBe(true);
          }
        }
      }
      await conn.close();
    });

    it("execute() refuses a local range outside its registration, a handle that is not a registration, or a revoked one, and moves nothing", async () => {
      const a = await node('ba');
      const b = await node('bb');
      const { conn } = await connect(a, b);
      const src = await region(b, 8192, 125);
      const dst = await region(a, 4096);
      const gone = await region(a, 4096);
      await a.t.revoke(gone.handle);
      const remote = remoteOf(a, src);
      const cases: [string, TransferBatch][] = [
        ['past the end', createTransferBatch('read', [{ local: dst.handle, localOffset: 4096 - 100, remote, remoteOffset: 0, length: 200 }])],
        ['one byte past the end', createTransferBatch('read', [{ local: dst.handle, localOffset: 1, remote, remoteOffset: 0, length: 4096 }])],
        ['not a registration', createTransferBatch('read', [{ local: {}, localOffset: 0, remote, remoteOffset: 0, length: 64 }])],
        ['revoked', createTransferBatch('read', [{ local: gone.handle, localOffset: 0, remote, remoteOffset: 0, length: 64 }])],
      ];
      for (const [what, batch] of cases) {
        await expectCode(settlesWithin(conn.execute(0, batch, live()), ctx.guardMs, `a local range ${what}`), [ErrorCode.InvalidInput], `a local range ${what}`);
        await settle(10);
        expect(allZero(await dst.buf.read(0, 4096)), `a local range ${what}: bytes moved`).toBe(true);
        expect(allZero(await gone.buf.read(0, 4096)), `a local range ${what}: bytes moved into revoked memory`).toBe(true);
        if (dst.buf.guardsIntact) expect(await dst.buf.guardsIntact(), `a local range ${what}: memory beyond the registration changed`).toBe(true);
      }
      await conn.close();
    });

    it('connect() to a peer that is gone rejects with ConnectionBrokenError', async () => {
      const a = await node('da');
      const d = await node('dd');
      await d.t.close();
      await expectCode(settlesWithin(a.t.connect(d.identity, d.blob, { ...live(), streams: 1 }), ctx.guardMs, 'connect() to a closed peer'), [ErrorCode.ConnectionBroken]);
    });
  });
}
