/**
 * A connection retired in an orderly way under a post (GOAWAY, the idle rule, a simultaneous
 * open settled) must not fail the caller's transfer: the engine posts it again on the
 * connection that replaces it. A refusal on a connection that is still open is not a
 * retirement and reaches the caller.
 */
import { describe, expect, it } from 'vitest';
import { ErrorCode, ResourceExhaustedError, SessionInvalidatedError, TransferEngine, silentLogger } from '../src/index.js';
import { MemTransport, type MemConnection } from './helpers/mem-transport.js';

async function pair(hook: (conn: MemConnection) => void) {
  const ta = new MemTransport({ beforeExecute: () => hook(ta.connections[ta.connections.length - 1] as MemConnection) });
  const a = new TransferEngine({ nodeId: 'a', transports: [ta], logger: silentLogger });
  const b = new TransferEngine({ nodeId: 'b', transports: [new MemTransport()], logger: silentLogger });
  await a.start();
  await b.start();
  const src = new Uint8Array(4096).map((_, i) => (i * 7) & 255);
  const rb = await b.register({ kind: 'host', buffer: src });
  const dst = new Uint8Array(4096);
  const ra = await a.register({ kind: 'host', buffer: dst });
  const close = async () => {
    await a.close();
    await b.close();
  };
  return { a, b, ta, src, dst, requests: [{ local: ra, remote: rb.descriptor }], close };
}

describe('engine: a connection retired under a post', () => {
  it('read: the post refused by a retiring connection runs again on a new connection', async () => {
    let retireNext = true;
    const { a, b, ta, src, dst, requests, close } = await pair((conn) => {
      if (!retireNext) return;
      retireNext = false;
      void conn.retire();
      throw new SessionInvalidatedError('connection is retiring or closed; no new requests accepted');
    });
    const report = await a.read(b.endpoint(), requests, { timeoutMs: 10_000 });
    expect(report.bytes).toBe(4096);
    expect(dst).toEqual(src);
    expect(ta.connections).toHaveLength(2);
    expect(ta.connections[0]?.isOpen).toBe(false);
    expect(ta.connections[1]?.isOpen).toBe(true);
    await close();
  });

  it('prepared: a post refused by a retiring connection runs again, and later posts use the new connection', async () => {
    let retireNext = false;
    const { a, b, ta, src, dst, requests, close } = await pair((conn) => {
      if (!retireNext) return;
      retireNext = false;
      void conn.retire();
      throw new SessionInvalidatedError('connection is retiring or closed; no new requests accepted');
    });
    const prepared = await a.prepare(b.endpoint(), requests, { op: 'read' });
    await prepared.run({ timeoutMs: 10_000 });
    retireNext = true;
    dst.fill(0);
    await prepared.run({ timeoutMs: 10_000 });
    expect(dst).toEqual(src);
    expect(ta.connections).toHaveLength(2);
    dst.fill(0);
    await prepared.run({ timeoutMs: 10_000 });
    expect(dst).toEqual(src);
    expect(ta.connections).toHaveLength(2);
    await prepared.close();
    await close();
  });

  it('a post backing off from local exhaustion does not go on on a connection that retired meanwhile', async () => {
    let refusals = 0;
    const { a, b, ta, src, dst, requests, close } = await pair((conn) => {
      if (conn !== ta.connections[0]) return;
      // Invariant 5: exhaustion backs off; the connection retires during the back-off.
      refusals++;
      setImmediate(() => void conn.retire());
      throw new ResourceExhaustedError('send queue full');
    });
    await a.read(b.endpoint(), requests, { timeoutMs: 10_000 });
    expect(dst).toEqual(src);
    expect(refusals).toBe(1); // never posted again on the retired connection
    expect(ta.connections).toHaveLength(2);
    await close();
  });

  it('SessionInvalidatedError on a connection that stays open reaches the caller (no retry)', async () => {
    let calls = 0;
    const { a, b, ta, requests, close } = await pair(() => {
      calls++;
      throw new SessionInvalidatedError('the peer invalidated this session');
    });
    await expect(a.read(b.endpoint(), requests, { timeoutMs: 10_000 })).rejects.toMatchObject({ code: ErrorCode.SessionInvalidated });
    expect(calls).toBe(1);
    expect(ta.connections).toHaveLength(1);
    await close();
  });

  it('a connection that keeps retiring under every post fails after a bounded number of tries', async () => {
    let calls = 0;
    const { a, b, requests, close } = await pair((conn) => {
      calls++;
      void conn.retire();
      throw new SessionInvalidatedError('connection is retiring or closed; no new requests accepted');
    });
    await expect(a.read(b.endpoint(), requests, { timeoutMs: 10_000 })).rejects.toMatchObject({ code: ErrorCode.SessionInvalidated });
    expect(calls).toBe(3);
    await close();
  });

  it('a prepared transfer whose connection keeps retiring under every post fails after a bounded number of tries', async () => {
    let calls = 0;
    let retiring = false;
    const { a, b, requests, close } = await pair((conn) => {
      calls++;
      if (!retiring) return;
      void conn.retire();
      throw new SessionInvalidatedError('connection is retiring or closed; no new requests accepted');
    });
    const prepared = await a.prepare(b.endpoint(), requests, { op: 'read' });
    await prepared.run({ timeoutMs: 10_000 });
    retiring = true;
    calls = 0;
    await expect(prepared.run({ timeoutMs: 10_000 })).rejects.toMatchObject({ code: ErrorCode.SessionInvalidated });
    expect(calls).toBe(3);
    await prepared.close();
    await close();
  });
});
