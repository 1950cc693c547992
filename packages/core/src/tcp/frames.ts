/**
 * The TCP transport's wire protocol, version 2: the kit's vectored frames (kit/frames.ts, where
 * the format, its bounds and the parser are described) with the kit's handshake under the
 * protocol magic `TWH2` (kit/handshake.ts). This module re-exports the frame codecs and wraps
 * the HELLO / HELLO_ACK codecs in the TCP transport's historical signatures.
 *
 * TCP itself proves no identity: run it on a trusted network, as with NIXL's or UCX's TCP paths.
 */
import { HandshakeCodec, type Hello, type HelloAck } from '../kit/handshake.js';

export * from '../kit/frames.js';
export type { Hello, HelloAck } from '../kit/handshake.js';

/** The 4 bytes that open every TCP HELLO body. */
export const HELLO_MAGIC = 'TWH2';

/** HELLO / HELLO_ACK codecs of the TCP protocol. */
export const tcpHandshake = new HandshakeCodec(HELLO_MAGIC);

export function encodeHello(h: Hello): Buffer {
  return tcpHandshake.encodeHello(h);
}

export function decodeHello(body: Uint8Array): Hello {
  return tcpHandshake.decodeHello(body);
}

export function encodeHelloAck(nodeId: string, incarnation: string, hostId: string, maxChunkBytes: number): Buffer {
  return tcpHandshake.encodeHelloAck({ nodeId, incarnation, hostId, maxChunkBytes });
}

export function decodeHelloAck(body: Uint8Array): HelloAck {
  return tcpHandshake.decodeHelloAck(body);
}
