/**
 * A raw control-channel peer for tests: a TCP socket that speaks the rdma transport's frames
 * (wire.ts) by hand, to send forged, malformed or hostile handshakes and requests.
 */
import { createConnection, type Socket } from 'node:net';
import type { NodeIdentity } from '@tensorwire/core';
import { FrameReader, decodeEndpoint, encodeFrame, type ControlMessage, type QpSetup } from '../src/wire.js';

export class RawPeer {
  readonly socket: Socket;
  readonly #reader = new FrameReader();
  readonly #queue: ControlMessage[] = [];
  #wake: (() => void) | undefined;
  #closed = false;
  /** Resolves when the socket closes (either side). */
  readonly closed: Promise<void>;

  private constructor(socket: Socket) {
    this.socket = socket;
    this.closed = new Promise<void>((resolve) => {
      socket.on('close', () => {
        this.#closed = true;
        this.#wake?.();
        resolve();
      });
    });
    socket.on('error', () => undefined);
    socket.on('data', (d: Buffer) => {
      try {
        this.#queue.push(...this.#reader.push(d));
      } catch {
        socket.destroy();
      }
      this.#wake?.();
    });
  }

  /** Connect to the control listener named by an rdma endpoint blob. */
  static open(endpoint: Uint8Array): Promise<RawPeer> {
    const ep = decodeEndpoint(endpoint);
    return new Promise((resolve, reject) => {
      const s = createConnection({ host: ep.host, port: ep.port });
      s.once('connect', () => resolve(new RawPeer(s)));
      s.once('error', reject);
    });
  }

  send(...messages: ControlMessage[]): void {
    this.socket.write(Buffer.concat(messages.map((m) => encodeFrame(m))));
  }

  /** The next message, or 'closed' once the socket closed with nothing more to read. */
  async next(): Promise<ControlMessage | 'closed'> {
    for (;;) {
      const m = this.#queue.shift();
      if (m) return m;
      if (this.#closed) return 'closed';
      await new Promise<void>((r) => (this.#wake = r));
      this.#wake = undefined;
    }
  }

  destroy(): void {
    this.socket.destroy();
  }
}

/** A HELLO setup as a RoCE peer with `qps` queue pairs would send it; override any field. */
export function helloSetup(identity: NodeIdentity, qps: number, over: Partial<QpSetup> = {}): QpSetup {
  return {
    identity,
    linkLayer: 2,
    lid: 0,
    gid: '00000000000000000000ffff7f0000fe',
    activeMtu: 5,
    initiatorDepth: 16,
    responderResources: 16,
    qps: Array.from({ length: qps }, (_, i) => ({ qpn: 0x100 + i, psn: 1 + i })),
    ...over,
  };
}
