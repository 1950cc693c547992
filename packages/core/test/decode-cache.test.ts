/**
 * The engine decodes an endpoint or descriptor blob once: a new blob object with the same bytes
 * (what every fetch descriptor carries afresh) gets the same decoded value, so the transport
 * choice is made once per peer, not once per fetch. A blob that differs in any byte is decoded
 * on its own: a copy with another token is never served the decode of the original.
 */
import { afterEach, describe, expect, it, vi } from 'vitest';
import { RemoteRejectedError, TcpTransport, TransferEngine, silentLogger, type Registration } from '../src/index.js';

const engines: TransferEngine[] = [];
afterEach(async () => {
  vi.restoreAllMocks();
  await Promise.allSettled(engines.splice(0).map((e) => e.close()));
});

async function pair(): Promise<{ a: TransferEngine; tcp: TcpTransport; b: TransferEngine; local: Registration; remote: Registration }> {
  const tcp = new TcpTransport();
  const a = new TransferEngine({ nodeId: 'dc-a', transports: [tcp], logger: silentLogger, metrics: false });
  const b = new TransferEngine({ nodeId: 'dc-b', transports: [new TcpTransport()], logger: silentLogger, metrics: false });
  engines.push(a, b);
  await a.start();
  await b.start();
  const remote = await b.register({ kind: 'host', buffer: new Uint8Array(256).map((_, i) => i) });
  const local = await a.register({ kind: 'host', buffer: new Uint8Array(256) });
  return { a, tcp, b, local, remote };
}

describe('decoded blobs are found again by their bytes', () => {
  it('a new endpoint object with the same bytes reuses the transport choice; another peer is chosen for anew', async () => {
    const { a, tcp, b, local, remote } = await pair();
    const reach = vi.spyOn(tcp, 'unreachableReason');
    // A fresh copy every time, as each fetch descriptor brings one.
    const readOnce = (): Promise<unknown> => a.read(new Uint8Array(b.endpoint()), [{ local, remote: new Uint8Array(remote.descriptor), length: 16 }]);
    await readOnce();
    const first = reach.mock.calls.length;
    expect(first).toBeGreaterThan(0);
    for (let i = 0; i < 4; i++) await readOnce();
    expect(reach).toHaveBeenCalledTimes(first);
    const c = new TransferEngine({ nodeId: 'dc-c', transports: [new TcpTransport()], logger: silentLogger, metrics: false });
    engines.push(c);
    await c.start();
    const other = await c.register({ kind: 'host', buffer: new Uint8Array(64) });
    await a.read(new Uint8Array(c.endpoint()), [{ local, remote: new Uint8Array(other.descriptor), length: 16 }]);
    expect(reach.mock.calls.length).toBeGreaterThan(first);
  });

  it('a copy that differs in its last byte is decoded on its own and refused, never served the decode of the original', async () => {
    const { a, b, local, remote } = await pair();
    const endpoint = b.endpoint();
    await a.read(endpoint, [{ local, remote: new Uint8Array(remote.descriptor), length: 16 }]);
    const forged = new Uint8Array(remote.descriptor);
    forged[forged.length - 1] = (forged[forged.length - 1] as number) ^ 1;
    await expect(a.read(endpoint, [{ local, remote: forged, length: 16 }])).rejects.toBeInstanceOf(RemoteRejectedError);
    // The original still reads (its decode was not replaced).
    await a.read(endpoint, [{ local, remote: new Uint8Array(remote.descriptor), length: 16 }]);
  });
});
