/**
 * The handshake of a kit transport: identity exchange with an expected-peer check.
 *
 * Each stream of a connection starts with one HELLO from the dialer and one HELLO_ACK (or one
 * ERROR naming a {@link RefusalCode}) from the acceptor:
 *
 *   HELLO       0x10  body: 4-byte magic | 16-byte connection id | u8 stream index | u8 stream count
 *                     | str8 nodeId | str8 incarnation | str8 hostId
 *                     | str8 expected peer nodeId | str8 expected peer incarnation | u32 max chunk bytes
 *   HELLO_ACK   0x11  body: str8 nodeId | str8 incarnation | str8 hostId | u32 max chunk bytes
 *
 * The magic names the transport's protocol (`TWH2` is TCP's, byte for byte its HELLO), so a
 * stream dialled at the wrong kind of listener is refused rather than misread.
 *
 * What the handshake proves: the dialer names the exact node and incarnation it expects (as
 * published in the peer's endpoint); the acceptor refuses a HELLO that names anyone else
 * (`WRONG_PEER`), and the dialer refuses a HELLO_ACK from anyone else. An incarnation is random
 * per process start, so a restarted process, or another process at the same address, cannot
 * answer for the one the dialer meant. It is no cryptographic proof: a transport adds what its
 * medium offers (file ownership for Unix sockets, a trusted network for TCP).
 *
 * Every identity field is validated (owner names, incarnation and host-id tokens); both frames
 * are control frames, so the parser bounds them to 4 KiB, and accepts nothing else on a stream
 * until its handshake finished. Both sides time out (see StreamTransportOptions.handshakeTimeoutMs).
 */
import { ByteReader, ByteWriter } from '../codec.js';
import { InvalidInputError } from '../errors.js';
import { isToken, ownerProblem } from '../ids.js';
import type { NodeIdentity } from '../transport.js';
import { FrameType, frameHeader } from './frames.js';

/** Codes of the ERROR an acceptor answers a refused HELLO with (`details.remoteCode` on the dialer). */
export const RefusalCode = {
  /** Malformed HELLO, wrong magic, an impossible stream index or count, a stream that does not match its connection. */
  BadHandshake: 'BAD_HANDSHAKE',
  /** The HELLO names another node or incarnation than the acceptor. */
  WrongPeer: 'WRONG_PEER',
  /** The acceptor has too many connections half-way through their handshakes. */
  Busy: 'BUSY',
} as const;
export type RefusalCode = (typeof RefusalCode)[keyof typeof RefusalCode];

/** Why identity fields are not acceptable, or undefined: an owner name, incarnation and host-id tokens. */
export function identityProblem(nodeId: unknown, incarnation: unknown, hostId?: unknown): { field: string; problem: string } | undefined {
  const problem = ownerProblem(nodeId);
  if (problem !== undefined) return { field: 'nodeId', problem };
  if (!isToken(incarnation)) return { field: 'incarnation', problem: 'malformed incarnation' };
  if (hostId !== undefined && !isToken(hostId)) return { field: 'hostId', problem: 'malformed host id' };
  return undefined;
}

function checkIdentity(what: string, nodeId: string, incarnation: string, hostId?: string): void {
  const p = identityProblem(nodeId, incarnation, hostId);
  if (p !== undefined) throw new InvalidInputError(`${what}: ${p.problem}`, { details: { field: p.field } });
}

export interface Hello {
  readonly connectionId: Uint8Array;
  readonly streamIndex: number;
  readonly streamCount: number;
  readonly nodeId: string;
  readonly incarnation: string;
  readonly hostId: string;
  readonly expectedNodeId: string;
  readonly expectedIncarnation: string;
  readonly maxChunkBytes: number;
}

export interface HelloAck {
  readonly nodeId: string;
  readonly incarnation: string;
  readonly hostId: string;
  readonly maxChunkBytes: number;
}

export const CONNECTION_ID_BYTES = 16;

/** HELLO / HELLO_ACK codecs for one protocol magic. Decoders throw InvalidInputError. */
export class HandshakeCodec {
  readonly magic: string;
  readonly #magic: Uint8Array;

  /** `magic`: 4 ASCII characters naming the protocol (`TWH2` for TCP). */
  constructor(magic: string) {
    if (!/^[\x21-\x7e]{4}$/.test(magic)) throw new InvalidInputError(`handshake magic must be 4 printable ASCII characters, got ${JSON.stringify(magic)}`, { details: { field: 'magic' } });
    this.magic = magic;
    this.#magic = Uint8Array.from(magic, (c) => c.charCodeAt(0));
  }

  encodeHello(h: Hello): Buffer {
    const w = new ByteWriter(128);
    w.bytes(this.#magic).bytes(h.connectionId).u8(h.streamIndex).u8(h.streamCount);
    w.str8(h.nodeId).str8(h.incarnation).str8(h.hostId).str8(h.expectedNodeId).str8(h.expectedIncarnation).u32(h.maxChunkBytes);
    const body = w.finish();
    return Buffer.concat([frameHeader(FrameType.Hello, 0, body.length), body]);
  }

  decodeHello(body: Uint8Array): Hello {
    const r = new ByteReader(body, 'HELLO frame');
    for (const m of this.#magic) if (r.u8('magic') !== m) throw new InvalidInputError(`HELLO frame is not of protocol ${this.magic} (bad magic)`, { details: { field: 'magic' } });
    const connectionId = r.bytes(CONNECTION_ID_BYTES, 'connection id').slice();
    const streamIndex = r.u8('stream index');
    const streamCount = r.u8('stream count');
    if (streamCount === 0 || streamIndex >= streamCount) {
      throw new InvalidInputError(`HELLO stream ${streamIndex} of ${streamCount} is impossible`, { details: { field: 'stream' } });
    }
    const h = {
      connectionId,
      streamIndex,
      streamCount,
      nodeId: r.str8('node id'),
      incarnation: r.str8('incarnation'),
      hostId: r.str8('host id'),
      expectedNodeId: r.str8('expected node id'),
      expectedIncarnation: r.str8('expected incarnation'),
      maxChunkBytes: r.u32('max chunk bytes'),
    };
    r.end();
    checkIdentity('HELLO', h.nodeId, h.incarnation, h.hostId);
    checkIdentity('HELLO (expected peer)', h.expectedNodeId, h.expectedIncarnation);
    if (h.maxChunkBytes === 0) throw new InvalidInputError('HELLO max chunk bytes is 0', { details: { field: 'maxChunkBytes' } });
    return h;
  }

  encodeHelloAck(a: HelloAck): Buffer {
    const body = new ByteWriter(64).str8(a.nodeId).str8(a.incarnation).str8(a.hostId).u32(a.maxChunkBytes).finish();
    return Buffer.concat([frameHeader(FrameType.HelloAck, 0, body.length), body]);
  }

  decodeHelloAck(body: Uint8Array): HelloAck {
    const r = new ByteReader(body, 'HELLO_ACK frame');
    const v = { nodeId: r.str8('node id'), incarnation: r.str8('incarnation'), hostId: r.str8('host id'), maxChunkBytes: r.u32('max chunk bytes') };
    r.end();
    checkIdentity('HELLO_ACK', v.nodeId, v.incarnation, v.hostId);
    if (v.maxChunkBytes === 0) throw new InvalidInputError('HELLO_ACK max chunk bytes is 0', { details: { field: 'maxChunkBytes' } });
    return v;
  }
}

/** An acceptor's reason to refuse a decoded HELLO. */
export interface Refusal {
  readonly code: RefusalCode;
  readonly message: string;
}

/**
 * The acceptor's check of a decoded HELLO: it must name this node and incarnation exactly, and
 * ask for no more streams than the transport allows. Undefined when it may proceed.
 */
export function helloRefusal(hello: Hello, me: NodeIdentity, maxStreams: number): Refusal | undefined {
  if (hello.expectedNodeId !== me.nodeId || hello.expectedIncarnation !== me.incarnation) {
    return { code: RefusalCode.WrongPeer, message: `this is ${me.nodeId} incarnation ${me.incarnation}, not ${hello.expectedNodeId} incarnation ${hello.expectedIncarnation}` };
  }
  if (hello.streamCount > maxStreams) return { code: RefusalCode.BadHandshake, message: `stream count ${hello.streamCount} exceeds ${maxStreams}` };
  return undefined;
}

/**
 * The dialer's check of a decoded HELLO_ACK: it must come from the node and incarnation it
 * dialled (and, with `hostId`, from the host the peer's identity names: same-host transports).
 * Undefined when it is the expected peer; otherwise what is wrong.
 */
export function ackProblem(ack: HelloAck, expected: NodeIdentity, options: { hostId?: boolean } = {}): string | undefined {
  if (ack.nodeId !== expected.nodeId || ack.incarnation !== expected.incarnation) {
    return `the peer is ${ack.nodeId} incarnation ${ack.incarnation}, expected ${expected.nodeId} incarnation ${expected.incarnation}`;
  }
  if (options.hostId === true && ack.hostId !== expected.hostId) return `the peer runs on host ${ack.hostId}, expected host ${expected.hostId}`;
  return undefined;
}
