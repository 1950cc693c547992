/**
 * Incarnations over real TCP: a requester that restarted while its old process hangs in the
 * middle of a large read. The kit transport's send ledger is per node (a peer cannot multiply
 * its budget by changing incarnations), so the old incarnation's unwritten replies would hold
 * back the new incarnation's; the new incarnation's inbound connection is what ends the old
 * one's at the responder (engine `#inbound`).
 */
import { afterEach, describe, expect, it } from 'vitest';
import { TcpTransport, TransferEngine, silentLogger, type ConnectOptions, type NodeIdentity, type TransportConnection } from '../src/index.js';

/** A TCP transport that keeps the connections it opened, to pause their sockets (a hung process). */
class PausableTcp extends TcpTransport {
  readonly opened: TransportConnection[] = [];
  override async connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    const c = await super.connect(peer, endpoint, options);
    this.opened.push(c);
    return c;
  }
  hang(): void {
    for (const c of this.opened) {
      const k = c as unknown as { streams: number; stream(i: number): { socket: { pause(): void } } | undefined };
      for (let i = 0; i < k.streams; i++) k.stream(i)?.socket.pause();
    }
  }
}

describe('a restarted requester while its old process hangs', () => {
  const closers: (() => Promise<unknown>)[] = [];
  afterEach(async () => {
    for (const c of closers.splice(0).reverse()) await c().catch(() => undefined);
  });

  it('the new incarnation is served at once: its connection ends the hung one\'s at the responder', async () => {
    // A send ledger of one byte: any unwritten reply to the node holds back the next ones.
    const responder = new TransferEngine({ nodeId: 'resp', transports: [new TcpTransport({ sendHighWaterMark: 1 })], logger: silentLogger, metrics: false });
    closers.push(() => responder.close());
    await responder.start();
    const big = await responder.register({ kind: 'host', buffer: new Uint8Array(64 << 20) });

    const tcp = new PausableTcp();
    const old = new TransferEngine({ nodeId: 'req', incarnation: 'old', transports: [tcp], logger: silentLogger, metrics: false });
    closers.push(() => old.close());
    await old.start();
    const oldDst = await old.register({ kind: 'host', buffer: new Uint8Array(64 << 20) });
    await old.read(responder.endpoint(), [{ local: oldDst, remote: big.descriptor, length: 1024 }], { timeoutMs: 10_000 });
    // The old process stops reading its sockets in the middle of a 64 MiB read.
    tcp.hang();
    const ac = new AbortController();
    closers.push(async () => ac.abort());
    void old.read(responder.endpoint(), [{ local: oldDst, remote: big.descriptor }], { signal: ac.signal, timeoutMs: 60_000 }).catch(() => undefined);
    await new Promise((r) => setTimeout(r, 300));

    const fresh = new TransferEngine({ nodeId: 'req', incarnation: 'new', transports: [new TcpTransport()], logger: silentLogger, metrics: false });
    closers.push(() => fresh.close());
    await fresh.start();
    const dst = await fresh.register({ kind: 'host', buffer: new Uint8Array(1024) });
    await fresh.read(responder.endpoint(), [{ local: dst, remote: big.descriptor, length: 1024 }], { timeoutMs: 5_000 });
    expect(responder.connections().map((c) => `${c.peer.nodeId}/${c.peer.incarnation}`)).toEqual(['req/new']);
  }, 30_000);
});
