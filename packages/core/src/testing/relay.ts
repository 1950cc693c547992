/**
 * A byte relay the conformance suite puts between two nodes of a stream-socket transport (TCP,
 * Unix domain sockets), so it can stall a peer (the peer's socket stays open and accepted, but
 * nothing is forwarded any more, in either direction) and later let everything through, or cut
 * every connection at once. No test-runner imports.
 */
import { randomBytes } from 'node:crypto';
import { rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

/** Where a stream socket listens: a TCP host and port, or a Unix domain socket path. */
export type SocketAddress = { readonly host: string; readonly port: number } | { readonly path: string };

export interface StreamRelay {
  /** Connect here instead of the target. Same kind as the target (TCP or a socket path). */
  readonly address: SocketAddress;
  /**
   * Stop forwarding, both directions, on every relayed connection and on any accepted later.
   * Bytes already handed on still arrive; everything else waits in the relay (and, once its
   * buffers are full, in the senders' socket buffers).
   */
  stall(): void;
  /** Forward again, starting with what waited. */
  resume(): void;
  /** Cut every relayed connection (TCP: reset), so both ends see it die; the relay keeps accepting. */
  sever(): void;
  /** Bytes forwarded so far, both directions together. */
  readonly forwarded: number;
  /** Relayed connections currently open. */
  readonly connections: number;
  /** Sever everything and stop listening. Idempotent. */
  close(): Promise<void>;
}

/** Listen on a fresh address of the same kind as `target` and relay every connection to it. */
export async function createStreamRelay(target: SocketAddress): Promise<StreamRelay> {
  const pairs = new Set<readonly [net.Socket, net.Socket]>();
  let stalled = false;
  let forwarded = 0;
  const server = net.createServer({ allowHalfOpen: true, pauseOnConnect: true }, (client) => {
    const upstream = net.connect({ ...target, allowHalfOpen: true } as net.NetConnectOpts);
    const pair = [client, upstream] as const;
    pairs.add(pair);
    const link = (from: net.Socket, to: net.Socket): void => {
      from.on('data', (d: Buffer) => {
        forwarded += d.length;
        if (!to.write(d)) from.pause();
      });
      to.on('drain', () => {
        if (!stalled) from.resume();
      });
      from.on('end', () => to.end());
      from.on('error', () => undefined);
      from.on('close', () => {
        to.destroy();
        pairs.delete(pair);
      });
    };
    link(client, upstream);
    link(upstream, client);
    if (stalled) {
      client.pause();
      upstream.pause();
    } else client.resume();
  });
  const path = 'path' in target ? join(tmpdir(), `tw-relay-${process.pid}-${randomBytes(6).toString('hex')}.sock`) : undefined;
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    if (path !== undefined) server.listen(path, () => resolve());
    else server.listen(0, (target as { host: string }).host, () => resolve());
  });
  const address: SocketAddress = path !== undefined ? { path } : { host: (target as { host: string }).host, port: (server.address() as net.AddressInfo).port };
  let closed: Promise<void> | undefined;
  return {
    address,
    stall() {
      stalled = true;
      for (const [c, u] of pairs) {
        c.pause();
        u.pause();
      }
    },
    resume() {
      stalled = false;
      for (const [c, u] of pairs) {
        c.resume();
        u.resume();
      }
    },
    sever() {
      // TCP: a reset, as when a peer dies. Unix domain sockets have none: close them.
      const cut = (x: net.Socket): void => void (path === undefined ? x.resetAndDestroy() : x.destroy());
      for (const [c, u] of pairs) {
        cut(c);
        cut(u);
      }
    },
    get forwarded() {
      return forwarded;
    },
    get connections() {
      return pairs.size;
    },
    close() {
      closed ??= new Promise<void>((resolve) => {
        for (const [c, u] of pairs) {
          c.destroy();
          u.destroy();
        }
        server.close(() => {
          if (path !== undefined) rmSync(path, { force: true });
          resolve();
        });
      });
      return closed;
    },
  };
}
