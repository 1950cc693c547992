/**
 * Raw-socket helpers for tests that play a hostile or careless peer against a TCP holder:
 * frame splitting, a started holder transport, and a peer that completes a real handshake and
 * then sends whatever bytes the test gives it.
 */
import { fork, type ChildProcess } from 'node:child_process';
import net from 'node:net';
import { fileURLToPath } from 'node:url';
import { silentLogger, type Logger } from '../../src/logger.js';
import * as tcpFrames from '../../src/tcp/frames.js';
import { TcpTransport, type TcpTransportOptions } from '../../src/tcp/transport.js';
import type { NodeIdentity } from '../../src/transport.js';

const { HEADER_BYTES, encodeHello } = tcpFrames;

export interface Frame {
  type: number;
  reqId: number;
  body: Buffer;
}

/** The complete frames at the start of `buf` (a trailing partial frame is left out). */
export function parseFrames(buf: Buffer): Frame[] {
  const out: Frame[] = [];
  let off = 0;
  while (buf.length - off >= HEADER_BYTES) {
    const len = buf.readUInt32BE(off + 8);
    if (buf.length - off < HEADER_BYTES + len) break;
    out.push({ type: buf.readUInt8(off + 1), reqId: buf.readUInt32BE(off + 4), body: buf.subarray(off + HEADER_BYTES, off + HEADER_BYTES + len) });
    off += HEADER_BYTES + len;
  }
  return out;
}

let nodes = 0;
/** A started TCP transport serving as node `<prefix><n>` (no engine: inbound connections only serve). */
export async function holderNode(prefix: string, options: TcpTransportOptions = {}, logger: Logger = silentLogger): Promise<{ t: TcpTransport; id: NodeIdentity; port: number }> {
  const t = new TcpTransport(options);
  const id = { nodeId: `${prefix}${++nodes}`, incarnation: `${prefix.slice(0, 1)}${nodes}`, hostId: 'h1' };
  await t.start({ identity: id, logger, inbound: () => undefined });
  return { t, id, port: t.port };
}

export interface HostileResult {
  /** Everything the holder sent after HELLO_ACK, as frames. */
  frames: Frame[];
  /** The holder closed the socket (we did not). */
  closedByPeer: boolean;
}

export interface HostileOptions {
  /** Give up (close the socket ourselves) after this long. */
  ms: number;
  until?: (frames: Frame[]) => boolean;
  /** Stop reading for this long after sending (a stalled peer). */
  pauseMs?: number;
  socket?: (s: net.Socket) => void;
}

/**
 * A peer that completes a real handshake, then sends `chunks`. Resolves with what the holder
 * sent after HELLO_ACK when `until` is satisfied, the holder closes the socket, or after `ms`.
 */
export function hostile(target: { id: NodeIdentity; port: number }, chunks: Uint8Array[], options: HostileOptions): Promise<HostileResult> {
  return new Promise((resolve) => {
    const s = net.connect({ port: target.port, host: '127.0.0.1' });
    options.socket?.(s);
    let got = Buffer.alloc(0);
    let byUs = false;
    const frames = (): Frame[] => parseFrames(got).slice(1); // the first is HELLO_ACK
    const finish = (): void => {
      if (s.destroyed) return;
      byUs = true;
      s.destroy();
    };
    s.on('error', () => undefined);
    s.on('data', (d: Buffer) => {
      got = Buffer.concat([got, d]);
      if (options.until?.(frames())) finish();
    });
    s.on('close', () => {
      clearTimeout(timer);
      resolve({ frames: frames(), closedByPeer: !byUs });
    });
    const timer = setTimeout(finish, options.ms);
    s.on('connect', () => {
      const id = target.id;
      s.write(encodeHello({ connectionId: new Uint8Array(16).map(() => Math.floor(Math.random() * 256)), streamIndex: 0, streamCount: 1, nodeId: 'mallory', incarnation: 'm1', hostId: 'h', expectedNodeId: id.nodeId, expectedIncarnation: id.incarnation, maxChunkBytes: 1 << 24 }));
      for (const c of chunks) s.write(c);
      // A paused socket reads nothing, so it also does not see the holder close it until resumed.
      if (options.pauseMs !== undefined) {
        s.pause();
        setTimeout(() => s.resume(), options.pauseMs);
      }
    });
  });
}

export interface RawPeerProcessOptions {
  /** Node id in the HELLO (with `distinct`, each socket gets `<nodeId><index>`). */
  nodeId: string;
  distinct?: boolean;
  connections?: number;
  /** What each socket does after its handshake (see fixtures/raw-flooder.mjs). */
  mode: 'readv' | 'readv-copy' | 'readv-bad' | 'writev' | 'idle' | 'stall';
  requests?: number;
  /** stall: how long it stops reading; length of each READV's one range. */
  pauseMs?: number;
  length?: number;
  /** Flooders: READVs of 64 KiB sent first, to fill the kernel's socket buffers. Default 128. */
  fill?: number;
  /** Flooders: after their last write, how long before they look whether the holder closed them. */
  settleMs?: number;
  /** Give up (close our sockets) after this long. */
  ms?: number;
  /** Where the token's memory starts in the holder's pattern (fixtures/bounded-holder.mjs: its grant starts at size / 2). */
  base?: number;
}

export interface RawPeerSocketResult {
  /** HELLO_ACK seen (flooders never read, so never see it). */
  acked: boolean;
  /** The holder refused the HELLO; with its code. */
  refused: boolean;
  refusal: string | undefined;
  goaway: boolean;
  closedByPeer: boolean;
  sent: number;
  replies: number;
  /** READV_DATA replies whose bytes matched the holder's pattern. */
  verified: number;
}

const RAW_PEER = fileURLToPath(new URL('../fixtures/raw-flooder.mjs', import.meta.url));

/**
 * A hostile or careless peer in its own process (fixtures/raw-flooder.mjs; it frames with the
 * built codecs of dist/), against a holder at `target` whose registration or grant is `token`.
 * Resolves with one result per socket once every socket closed.
 */
export function rawPeerProcess(target: { port: number; id: NodeIdentity }, token: Uint8Array, options: RawPeerProcessOptions, children?: ChildProcess[]): Promise<RawPeerSocketResult[]> {
  const arg = JSON.stringify({ ...options, port: target.port, expect: { nodeId: target.id.nodeId, incarnation: target.id.incarnation }, token: Buffer.from(token).toString('base64') });
  const child = fork(RAW_PEER, [arg], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'], execArgv: [] });
  children?.push(child);
  return new Promise((resolve, reject) => {
    let done = false;
    child.on('message', (m: { type: string; results: RawPeerSocketResult[] }) => {
      if (m.type !== 'done') return;
      done = true;
      resolve(m.results);
    });
    child.once('exit', (code, sig) => {
      if (!done) reject(new Error(`raw peer process exited without a result: ${code ?? sig}`));
    });
  });
}
