/**
 * The local lane: the `Session` messages of a requester and a holder on one host over a Linux
 * abstract Unix socket, without gRPC.
 *
 * On one host the lease round trip is mostly gRPC's and HTTP/2's own work (frames, call
 * objects, streams), run with cold caches when the round trip follows a read that kept the
 * holder idle. The lane carries the very same `SessionRequest` / `SessionResponse` messages,
 * each as one frame (a 4-byte little-endian length, then the message), on a socket whose name
 * the holder hands out in its `Health` answer (`local_lane`): a random name, bound when the
 * holder listens, reachable only from the same network namespace (as a loopback port is).
 *
 * - **Hello.** The requester's first frame is a `SessionRequest` with id 0 and an empty method,
 *   whose payload is its `authorization` metadata value (empty without a token); the holder
 *   answers id 0, OK, with its holder id in `details`, and the requester checks that id
 *   against the one `Health` named. From then on every frame is one call or one answer, with
 *   the semantics of the gRPC `Session` stream (session.ts), auth from the hello.
 * - **Protocol errors** (a frame over the size limit, a message that does not decode, a first
 *   frame that is not a hello, no hello in time) close the socket: nothing is answered.
 * - **The socket closes**: every call in flight fails UNAVAILABLE, as when a stream ends.
 */
import { EventEmitter } from 'node:events';
import { createConnection, type Socket } from 'node:net';
import { status } from '@grpc/grpc-js';
import type { LockCodec } from './codec.js';
import type { SessionRequestMsg, SessionResponseMsg } from './proto.js';

/** Bytes of a frame's length prefix. */
export const LANE_HEADER_BYTES = 4;
/** Default largest frame either side reads (gRPC's default receive limit). */
export const LANE_MAX_FRAME_BYTES = 4 * 1024 * 1024;
/** Whether this platform has abstract Unix sockets (Linux). */
export const LANE_SUPPORTED = process.platform === 'linux';

/** `bytes` as one frame. */
export function laneFrame(bytes: Uint8Array): Buffer {
  const out = Buffer.allocUnsafe(LANE_HEADER_BYTES + bytes.length);
  out.writeUInt32LE(bytes.length, 0);
  out.set(bytes, LANE_HEADER_BYTES);
  return out;
}

/**
 * Splits a byte stream into frames. `push` returns the complete frames so far (views of the
 * input or of one joined buffer, valid until the next push), or throws RangeError for a frame
 * over `maxFrameBytes` (the connection is then to be closed: the stream cannot be resynced).
 */
export class LaneFrames {
  readonly #max: number;
  #pending: Buffer | undefined;
  constructor(maxFrameBytes: number) {
    this.#max = maxFrameBytes;
  }
  push(chunk: Buffer): Buffer[] {
    let buf = this.#pending === undefined ? chunk : Buffer.concat([this.#pending, chunk]);
    this.#pending = undefined;
    const out: Buffer[] = [];
    let at = 0;
    while (buf.length - at >= LANE_HEADER_BYTES) {
      const len = buf.readUInt32LE(at);
      if (len > this.#max) throw new RangeError(`lane frame of ${len} bytes is over the limit of ${this.#max}`);
      if (buf.length - at - LANE_HEADER_BYTES < len) break;
      out.push(buf.subarray(at + LANE_HEADER_BYTES, at + LANE_HEADER_BYTES + len));
      at += LANE_HEADER_BYTES + len;
    }
    if (at < buf.length) {
      // Keep the partial frame (a copy: `chunk` belongs to the socket).
      buf = buf.subarray(at);
      this.#pending = Buffer.from(buf);
    }
    return out;
  }
}

/** The abstract socket address of lane `name`. */
export function laneAddress(name: string): string {
  return `\0${name}`;
}

/**
 * The requester's end of a lane: what {@link SessionStream} uses of a gRPC duplex stream.
 * `write` sends a call; 'data' is an answer; 'status' ends it ({ code, details }): UNAVAILABLE
 * when the socket closes or breaks the protocol, CANCELLED after `cancel()`; 'ready' once the
 * holder answered the hello. Frames written before the socket connects are queued by the
 * socket. The hello goes first.
 */
export class LaneDuplex extends EventEmitter {
  readonly #socket: Socket;
  readonly #codec: LockCodec;
  readonly #frames: LaneFrames;
  readonly #holderId: string;
  #hello = false;
  #ended = false;

  constructor(name: string, holderId: string, authorization: string, codec: LockCodec, maxFrameBytes = LANE_MAX_FRAME_BYTES) {
    super();
    this.#codec = codec;
    this.#holderId = holderId;
    this.#frames = new LaneFrames(maxFrameBytes);
    const socket = createConnection({ path: laneAddress(name) });
    this.#socket = socket;
    socket.setNoDelay?.(true);
    socket.on('data', (chunk: Buffer) => this.#read(chunk));
    socket.on('error', (e) => this.#end(status.UNAVAILABLE, `local lane: ${e.message}`));
    socket.on('close', () => this.#end(status.UNAVAILABLE, 'local lane closed'));
    socket.write(laneFrame(codec.SessionRequest.encode({ id: 0, method: '', payload: Buffer.from(authorization, 'utf8'), timeoutMs: 0 })));
  }

  write(m: SessionRequestMsg): boolean {
    if (this.#ended) return false;
    return this.#socket.write(laneFrame(this.#codec.SessionRequest.encode(m)));
  }

  /** End the lane: 'status' CANCELLED (calls in flight are the caller's to fail). */
  cancel(): void {
    this.#end(status.CANCELLED, 'cancelled');
  }

  #read(chunk: Buffer): void {
    let frames: Buffer[];
    try {
      frames = this.#frames.push(chunk);
    } catch (e) {
      this.#end(status.UNAVAILABLE, `local lane: ${(e as Error).message}`);
      return;
    }
    for (const f of frames) {
      if (this.#ended) return;
      let m: SessionResponseMsg;
      try {
        m = this.#codec.SessionResponse.decode(f);
      } catch (e) {
        this.#end(status.UNAVAILABLE, `local lane: an answer does not decode: ${(e as Error).message}`);
        return;
      }
      if (!this.#hello) {
        // The holder's hello: the holder id Health named, or this is not the holder's lane.
        if (m.id !== 0 || m.code !== status.OK || m.details !== this.#holderId) {
          this.#end(status.UNAVAILABLE, `local lane: the hello is not from holder ${this.#holderId}`);
          return;
        }
        this.#hello = true;
        this.emit('ready');
        continue;
      }
      this.emit('data', m);
    }
  }

  #end(code: status, details: string): void {
    if (this.#ended) return;
    this.#ended = true;
    this.#socket.destroy();
    // On a later tick, as grpc-js reports a stream's end: a caller that cancels and then fails
    // its calls itself (the client's close) sees its own failure first.
    process.nextTick(() => this.emit('status', { code, details }));
  }
}

/**
 * Whether lane `name` of holder `holderId` answers a hello from this process: a lane connection
 * opened, greeted and closed. False when the name does not exist here (a holder on another host
 * or in another network namespace names a lane this process cannot reach), the hello is refused
 * or `timeoutMs` passes.
 */
export function probeLane(name: string, holderId: string, authorization: string, codec: LockCodec, timeoutMs: number): Promise<boolean> {
  return new Promise<boolean>((resolve) => {
    const d = new LaneDuplex(name, holderId, authorization, codec);
    const timer = setTimeout(() => finish(false), timeoutMs);
    timer.unref?.();
    function finish(ok: boolean): void {
      clearTimeout(timer);
      d.removeAllListeners('ready');
      d.cancel();
      resolve(ok);
    }
    d.once('ready', () => finish(true));
    d.once('status', () => finish(false));
  });
}
