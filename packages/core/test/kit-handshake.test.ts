/**
 * The kit's handshake: the codec (identity validation, bounds, magic) and the refusals a kit
 * transport makes on both sides, over real sockets: the acceptor against raw, hostile dialers;
 * the dialer against raw, hostile acceptors (stalled, impostor, refusing, protocol-breaking).
 * The kit transport under test is the Unix-socket one.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import fc from 'fast-check';
import { afterEach, describe, expect, it } from 'vitest';
import { ErrorCode, InvalidInputError, TensorwireError } from '../src/errors.js';
import { silentLogger } from '../src/logger.js';
import { FrameType, HEADER_BYTES, decodeError, encodeError, encodeReadvReq, frameHeader } from '../src/kit/frames.js';
import { HandshakeCodec, RefusalCode, ackProblem, helloRefusal, type Hello } from '../src/kit/handshake.js';
import type { NodeIdentity, TransportConnection } from '../src/transport.js';
import { UdsTransport, encodeUdsEndpoint, type UdsTransportOptions } from '../src/uds/transport.js';
import { parseFrames, type Frame } from './helpers/raw-peer.js';

const codec = new HandshakeCodec('TWU2');
const HOST = 'host1';

const cleanups: (() => unknown)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

function privateDir(): string {
  const d = mkdtempSync(join(tmpdir(), 'tw-kit-hs-'));
  cleanups.push(() => rmSync(d, { recursive: true, force: true }));
  return d;
}

let n = 0;
async function node(options: UdsTransportOptions = {}, identity?: Partial<NodeIdentity>) {
  const t = new UdsTransport(options);
  const id: NodeIdentity = { nodeId: `n${++n}`, incarnation: `inc${n}`, hostId: HOST, ...identity };
  const inbound: TransportConnection[] = [];
  await t.start({ identity: id, logger: silentLogger, inbound: (c) => inbound.push(c) });
  cleanups.push(() => t.close());
  return { t, id, inbound, path: t.path as string };
}


/** A raw client: writes `chunks`, collects what comes back until the other side closes. */
function raw(path: string, chunks: Uint8Array[]): { socket: net.Socket; closed: Promise<Frame[]> } {
  const socket = net.connect({ path });
  cleanups.push(() => socket.destroy());
  let got = Buffer.alloc(0);
  socket.on('data', (d: Buffer) => (got = Buffer.concat([got, d])));
  socket.on('error', () => undefined);
  socket.on('connect', () => {
    for (const c of chunks) socket.write(c);
  });
  return { socket, closed: new Promise((resolve) => socket.once('close', () => resolve(parseFrames(got)))) };
}

function hello(to: NodeIdentity, over: Partial<Hello> = {}): Hello {
  return { connectionId: new Uint8Array(16).map(() => Math.floor(Math.random() * 256)), streamIndex: 0, streamCount: 1, nodeId: 'mallory', incarnation: 'm1', hostId: HOST, expectedNodeId: to.nodeId, expectedIncarnation: to.incarnation, maxChunkBytes: 1 << 20, ...over };
}

/** The code of the one ERROR a refused dialer got. */
function refusal(frames: Frame[]): string {
  expect(frames).toHaveLength(1);
  expect(frames[0]?.type).toBe(FrameType.Error);
  return decodeError((frames[0] as Frame).body).code;
}

async function rejection(p: Promise<unknown>): Promise<TensorwireError> {
  const e = await p.then(
    () => undefined,
    (x: unknown) => x,
  );
  expect(e).toBeInstanceOf(TensorwireError);
  return e as TensorwireError;
}

describe('kit handshake codec', () => {
  const owner = fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/);
  const tok = fc.stringMatching(/^[A-Za-z0-9_-]{1,64}$/);
  const helloArb = fc
    .record({ count: fc.integer({ min: 1, max: 255 }), idx: fc.nat(), nodeId: owner, incarnation: tok, hostId: tok, expectedNodeId: owner, expectedIncarnation: tok, maxChunkBytes: fc.integer({ min: 1, max: 0xffffffff }), id: fc.uint8Array({ minLength: 16, maxLength: 16 }) })
    .map((r) => ({ connectionId: r.id, streamIndex: r.idx % r.count, streamCount: r.count, nodeId: r.nodeId, incarnation: r.incarnation, hostId: r.hostId, expectedNodeId: r.expectedNodeId, expectedIncarnation: r.expectedIncarnation, maxChunkBytes: r.maxChunkBytes }));

  it('HELLO and HELLO_ACK round-trip any valid identity', () => {
    fc.assert(
      fc.property(helloArb, (h) => {
        const back = codec.decodeHello(codec.encodeHello(h).subarray(HEADER_BYTES));
        expect({ ...back, connectionId: new Uint8Array(back.connectionId) }).toEqual(h);
        const ack = { nodeId: h.nodeId, incarnation: h.incarnation, hostId: h.hostId, maxChunkBytes: h.maxChunkBytes };
        expect(codec.decodeHelloAck(codec.encodeHelloAck(ack).subarray(HEADER_BYTES))).toEqual(ack);
      }),
    );
  });

  it('decoders fed arbitrary or mutated bodies only throw InvalidInputError, and what they accept is valid', () => {
    const valid = codec.encodeHello(hello({ nodeId: 'b', incarnation: 'i', hostId: HOST })).subarray(HEADER_BYTES);
    fc.assert(
      fc.property(fc.oneof(fc.uint8Array({ maxLength: 200 }), fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 4 }).map((flips) => {
        const b = Buffer.from(valid);
        for (const [at, v] of flips) b[at % b.length] = v;
        return b;
      })), (body) => {
        for (const decode of [(b: Uint8Array) => codec.decodeHello(b), (b: Uint8Array) => codec.decodeHelloAck(b)]) {
          try {
            const v = decode(body) as { nodeId: string; maxChunkBytes: number };
            expect(v.nodeId).toMatch(/^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/);
            expect(v.maxChunkBytes).toBeGreaterThan(0);
          } catch (e) {
            expect(e).toBeInstanceOf(InvalidInputError);
          }
        }
      }),
      { numRuns: 1000 },
    );
  });

  it('bad identity fields, impossible streams, zero chunk limits, a foreign magic and trailing bytes are refused, naming the field', () => {
    const base = hello({ nodeId: 'b', incarnation: 'i', hostId: HOST });
    const cases: [Partial<Hello>, string][] = [
      [{ nodeId: 'a:b' }, 'nodeId'],
      [{ nodeId: '' }, 'nodeId'],
      [{ nodeId: 'x'.repeat(65) }, 'nodeId'],
      [{ nodeId: '_lead' }, 'nodeId'],
      [{ incarnation: 'has space' }, 'incarnation'],
      [{ incarnation: '' }, 'incarnation'],
      [{ hostId: 'h/1' }, 'hostId'],
      [{ expectedNodeId: 'b..' }, 'nodeId'],
      [{ expectedIncarnation: 'é' }, 'incarnation'],
      [{ maxChunkBytes: 0 }, 'maxChunkBytes'],
      [{ streamIndex: 2, streamCount: 2 }, 'stream'],
      [{ streamIndex: 0, streamCount: 0 }, 'stream'],
    ];
    for (const [over, field] of cases) {
      let caught: unknown;
      try {
        codec.decodeHello(codec.encodeHello({ ...base, ...over }).subarray(HEADER_BYTES));
      } catch (e) {
        caught = e;
      }
      expect(caught, JSON.stringify(over)).toBeInstanceOf(InvalidInputError);
      expect((caught as InvalidInputError).details['field']).toBe(field);
    }
    const tcp = new HandshakeCodec('TWH2').encodeHello(base).subarray(HEADER_BYTES);
    expect(() => codec.decodeHello(tcp)).toThrow(/bad magic/);
    expect(() => codec.decodeHello(Buffer.concat([codec.encodeHello(base).subarray(HEADER_BYTES), Buffer.of(0)]))).toThrow(/trailing/);
    expect(() => codec.decodeHelloAck(codec.encodeHelloAck({ nodeId: 'b', incarnation: 'i', hostId: 'h h', maxChunkBytes: 1 }).subarray(HEADER_BYTES))).toThrow(InvalidInputError);
    expect(() => new HandshakeCodec('TW')).toThrow(InvalidInputError);
  });

  it('helloRefusal: the exact expected node and incarnation, and a bounded stream count', () => {
    const me: NodeIdentity = { nodeId: 'b', incarnation: 'i2', hostId: HOST };
    expect(helloRefusal(hello(me), me, 64)).toBeUndefined();
    expect(helloRefusal(hello(me, { expectedNodeId: 'c' }), me, 64)?.code).toBe(RefusalCode.WrongPeer);
    expect(helloRefusal(hello(me, { expectedIncarnation: 'i1' }), me, 64)?.code).toBe(RefusalCode.WrongPeer);
    expect(helloRefusal(hello(me, { streamCount: 65, streamIndex: 0 }), me, 64)?.code).toBe(RefusalCode.BadHandshake);
  });

  it('ackProblem: the dialed node and incarnation, and its host when asked', () => {
    const peer: NodeIdentity = { nodeId: 'b', incarnation: 'i2', hostId: HOST };
    const ack = { nodeId: 'b', incarnation: 'i2', hostId: HOST, maxChunkBytes: 1 };
    expect(ackProblem(ack, peer, { hostId: true })).toBeUndefined();
    expect(ackProblem({ ...ack, nodeId: 'c' }, peer)).toMatch(/expected b/);
    expect(ackProblem({ ...ack, incarnation: 'i1' }, peer)).toMatch(/incarnation/);
    expect(ackProblem({ ...ack, hostId: 'other' }, peer)).toBeUndefined();
    expect(ackProblem({ ...ack, hostId: 'other' }, peer, { hostId: true })).toMatch(/host/);
  });
});

describe('kit acceptor refuses hostile dialers', () => {
  it('a HELLO naming another node or incarnation is refused WRONG_PEER; nothing reaches the engine', async () => {
    const b = await node();
    expect(refusal(await raw(b.path, [codec.encodeHello(hello(b.id, { expectedIncarnation: 'someone-else' }))]).closed)).toBe(RefusalCode.WrongPeer);
    expect(refusal(await raw(b.path, [codec.encodeHello(hello(b.id, { expectedNodeId: 'other' }))]).closed)).toBe(RefusalCode.WrongPeer);
    expect(b.inbound).toHaveLength(0);
    expect(b.t.connectionCount).toBe(0);
  });

  it('malformed identities, a foreign magic, too many streams, another host: BAD_HANDSHAKE', async () => {
    const b = await node();
    const bad = Buffer.from(codec.encodeHello(hello(b.id)));
    bad[HEADER_BYTES + 4 + 16 + 2 + 1] = 0x3a; // first byte of the dialer's nodeId becomes ':'
    const refusals = await Promise.all([
      raw(b.path, [bad]).closed,
      raw(b.path, [new HandshakeCodec('TWH2').encodeHello(hello(b.id))]).closed,
      raw(b.path, [codec.encodeHello(hello(b.id, { streamCount: 65 }))]).closed,
      raw(b.path, [codec.encodeHello(hello(b.id, { hostId: 'elsewhere' }))]).closed,
      raw(b.path, [encodeError(0, 'X', 'not a hello')]).closed,
    ]);
    for (const r of refusals) expect(refusal(r)).toBe(RefusalCode.BadHandshake);
    expect(b.inbound).toHaveLength(0);
  });

  it('an oversize frame or a vector frame before the handshake drops the socket unanswered, and nothing is read into memory', async () => {
    const b = await node();
    const buffer = new Uint8Array(64);
    const token = (await b.t.register({ kind: 'host', buffer })).payload;
    const oversize = await raw(b.path, [frameHeader(FrameType.Hello, 0, 5000), Buffer.alloc(5000)]).closed;
    expect(oversize).toHaveLength(0);
    const early = await raw(b.path, [encodeReadvReq(1, [token], [{ token: 0, offset: 0, length: 64 }])]).closed;
    expect(early).toHaveLength(0);
    expect(b.inbound).toHaveLength(0);
  });

  it('a dialer that never sends HELLO is dropped after handshakeTimeoutMs; so is a connection whose other streams never come', async () => {
    const b = await node({ handshakeTimeoutMs: 150 });
    const silent = raw(b.path, []);
    const half = raw(b.path, [codec.encodeHello(hello(b.id, { streamCount: 2, streamIndex: 0 }))]);
    expect(await silent.closed).toHaveLength(0);
    const frames = await half.closed;
    expect(frames.map((f) => f.type)).toEqual([FrameType.HelloAck]); // its stream was accepted, its connection never completed
    expect(b.inbound).toHaveLength(0);
    expect(b.t.connectionCount).toBe(0);
  });

  it('connections half-way through their handshakes are bounded: past maxPendingConnections a dialer is refused BUSY', async () => {
    const b = await node({ maxPendingConnections: 1, handshakeTimeoutMs: 5000 });
    const first = raw(b.path, [codec.encodeHello(hello(b.id, { streamCount: 2 }))]);
    await new Promise((r) => first.socket.once('data', r));
    expect(refusal(await raw(b.path, [codec.encodeHello(hello(b.id, { streamCount: 2 }))]).closed)).toBe(RefusalCode.Busy);
    first.socket.destroy();
    await first.closed;
    // The first group went with its socket: there is room again.
    const third = raw(b.path, [codec.encodeHello(hello(b.id))]);
    await new Promise((r) => third.socket.once('data', r));
    expect(b.inbound).toHaveLength(1);
  });

  it('a stream whose HELLO does not match its connection (another identity under the same connection id) is refused', async () => {
    const b = await node({ handshakeTimeoutMs: 5000 });
    const h0 = hello(b.id, { streamCount: 2, streamIndex: 0 });
    const first = raw(b.path, [codec.encodeHello(h0)]);
    await new Promise((r) => first.socket.once('data', r));
    const second = await raw(b.path, [codec.encodeHello({ ...h0, streamIndex: 1, incarnation: 'other' })]).closed;
    expect(refusal(second)).toBe(RefusalCode.BadHandshake);
    const dup = await raw(b.path, [codec.encodeHello(h0)]).closed; // the same index again
    expect(refusal(dup)).toBe(RefusalCode.BadHandshake);
    expect(b.inbound).toHaveLength(0);
  });
});

describe('kit dialer refuses hostile acceptors', () => {
  /** A raw acceptor at a private path: `onHello` answers (or not) each stream's HELLO. */
  async function fake(onHello: (socket: net.Socket, h: Hello) => void): Promise<{ endpoint: Uint8Array; sockets: net.Socket[] }> {
    const path = join(privateDir(), 's');
    const sockets: net.Socket[] = [];
    const server = net.createServer((s) => {
      sockets.push(s);
      s.on('error', () => undefined);
      let got = Buffer.alloc(0);
      s.on('data', (d: Buffer) => {
        got = Buffer.concat([got, d]);
        const f = parseFrames(got)[0];
        if (f && f.type === FrameType.Hello) {
          got = Buffer.alloc(0);
          onHello(s, codec.decodeHello(f.body));
        }
      });
    });
    await new Promise<void>((r) => server.listen({ path }, () => r()));
    cleanups.push(() => {
      for (const s of sockets) s.destroy();
      return new Promise((r) => server.close(r));
    });
    return { endpoint: encodeUdsEndpoint(HOST, path), sockets };
  }

  const peer: NodeIdentity = { nodeId: 'holder', incarnation: 'h1', hostId: HOST };
  const connect = async (endpoint: Uint8Array, options: { signal?: AbortSignal; streams?: number; handshakeTimeoutMs?: number } = {}) => {
    const a = await node({ handshakeTimeoutMs: options.handshakeTimeoutMs ?? 10_000 });
    return { a, p: a.t.connect(peer, endpoint, { streams: options.streams ?? 2, signal: options.signal ?? new AbortController().signal, deadline: Date.now() + 60_000 }) };
  };

  it('a stalled acceptor (accepts, never answers) gives TimedOut by handshakeTimeoutMs, even with a signal that never fires; its sockets are closed', async () => {
    const f = await fake(() => undefined);
    const { a, p } = await connect(f.endpoint, { handshakeTimeoutMs: 200 });
    expect((await rejection(p)).code).toBe(ErrorCode.TimedOut);
    expect(a.t.socketCount).toBe(0);
  });

  it('an impostor answering as another node, incarnation or host is refused as ConnectionBroken', async () => {
    for (const who of [{ nodeId: 'mallory' }, { incarnation: 'h0' }, { hostId: 'elsewhere' }]) {
      const f = await fake((s) => s.write(codec.encodeHelloAck({ ...peer, maxChunkBytes: 1 << 20, ...who })));
      const { a, p } = await connect(f.endpoint);
      const e = await rejection(p);
      expect(e.code).toBe(ErrorCode.ConnectionBroken);
      expect(e.message).toMatch(/expected/);
      expect(a.t.connectionCount).toBe(0);
      expect(a.t.socketCount).toBe(0);
    }
  });

  it("the acceptor's refusal is RemoteRejected with its code", async () => {
    const f = await fake((s) => s.end(encodeError(0, RefusalCode.WrongPeer, 'not me')));
    const e = await rejection((await connect(f.endpoint)).p);
    expect(e.code).toBe(ErrorCode.RemoteRejected);
    expect(e.details['remoteCode']).toBe(RefusalCode.WrongPeer);
  });

  it('an acceptor that sends a request or an oversize frame instead of HELLO_ACK is a broken connection', async () => {
    for (const reply of [encodeReadvReq(1, [new Uint8Array(16)], [{ token: 0, offset: 0, length: 1 }]), Buffer.concat([frameHeader(FrameType.HelloAck, 0, 5000), Buffer.alloc(5000)])]) {
      const f = await fake((s) => s.write(reply));
      const e = await rejection((await connect(f.endpoint, { streams: 1 })).p);
      expect(e.code).toBe(ErrorCode.ConnectionBroken);
    }
  });

  it('an abort during the handshake is Aborted, and leaves no socket open', async () => {
    const f = await fake(() => undefined);
    const ac = new AbortController();
    const { a, p } = await connect(f.endpoint, { signal: ac.signal });
    setTimeout(() => ac.abort(), 20);
    expect((await rejection(p)).code).toBe(ErrorCode.Aborted);
    expect(a.t.socketCount).toBe(0);
  });

  it('against a real kit acceptor, naming the wrong incarnation is RemoteRejected WRONG_PEER', async () => {
    const b = await node();
    const a = await node();
    const e = await rejection(a.t.connect({ ...b.id, incarnation: 'stale' }, b.t.endpoint(), { streams: 2, signal: new AbortController().signal, deadline: Date.now() + 10_000 }));
    expect(e.code).toBe(ErrorCode.RemoteRejected);
    expect(e.details['remoteCode']).toBe(RefusalCode.WrongPeer);
    expect(b.inbound).toHaveLength(0);
  });
});
