/**
 * The holder's end of the local lane (see ../lane.ts): what the `Session` handler uses of a
 * gRPC server stream, over one accepted Unix socket whose hello was read.
 */
import { EventEmitter } from 'node:events';
import type { Socket } from 'node:net';
import type * as grpc from '@grpc/grpc-js';
import type { LockCodec } from '../codec.js';
import { laneFrame } from '../lane.js';
import type { SessionResponseMsg } from '../proto.js';

/**
 * Events: 'data' (a SessionRequestMsg, emitted by the acceptor), 'end' (the requester
 * half-closed), 'cancelled' (the socket closed, for whatever reason: once the session has
 * ended it changes nothing), 'drain'.
 */
export class LaneServerStream extends EventEmitter {
  readonly metadata: grpc.Metadata;
  readonly #socket: Socket;
  readonly #codec: LockCodec;
  readonly #peer: string;

  constructor(socket: Socket, metadata: grpc.Metadata, codec: LockCodec, peer: string) {
    super();
    this.#socket = socket;
    this.metadata = metadata;
    this.#codec = codec;
    this.#peer = peer;
    socket.on('drain', () => this.emit('drain'));
    socket.on('end', () => this.emit('end'));
    socket.on('close', () => this.emit('cancelled'));
  }

  get cancelled(): boolean {
    return this.#socket.destroyed;
  }

  write(m: SessionResponseMsg): boolean {
    if (this.#socket.destroyed) return true;
    return this.#socket.write(laneFrame(this.#codec.SessionResponse.encode(m)));
  }

  pause(): void {
    this.#socket.pause();
  }

  resume(): void {
    this.#socket.resume();
  }

  end(): void {
    this.#socket.end();
  }

  getPeer(): string {
    return this.#peer;
  }

  getPath(): string {
    return '/tensorwire.lock.v1.LockService/Session';
  }

  /** No transport security to report (the socket is local). */
  getAuthContext(): ReturnType<grpc.ServerDuplexStream<unknown, unknown>['getAuthContext']> {
    return {};
  }
}
