import { describe, expect, it } from 'vitest';
import {
  ConnectionBrokenError,
  ErrorCode,
  InvalidInputError,
  Registry,
  ResourceExhaustedError,
  TransferEngine,
  silentLogger,
  type Logger,
} from '../src/index.js';
import { MemTransport } from './helpers/mem-transport.js';

/**
 * 64 bytes registered on `b` and on `a`, and what starts a read of them by `a` in the caller's
 * turn: it resolves to 'resolved' or the error's code.
 */
async function readOf(a: TransferEngine, b: TransferEngine): Promise<() => Promise<string | undefined>> {
  const rb = await b.register({ kind: 'host', buffer: new Uint8Array(64).fill(3) });
  const ra = await a.register({ kind: 'host', buffer: new Uint8Array(64) });
  return () =>
    a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { timeoutMs: 60_000 }).then(
      () => 'resolved',
      (e: unknown) => (e as { code?: string }).code,
    );
}

async function pair(make: () => MemTransport[], extra: Record<string, unknown> = {}) {
  const ta = make();
  const tb = make();
  const a = new TransferEngine({ nodeId: 'a', transports: ta, logger: silentLogger, ...extra });
  const b = new TransferEngine({ nodeId: 'b', transports: tb, logger: silentLogger, ...extra });
  await a.start();
  await b.start();
  return { a, b, ta, tb };
}

describe('transfer engine', () => {
  it('splits transfers into chunks of min(remaining, cap) and round-robins them over the streams', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport()], { chunkBytes: 1000, streamsPerPeer: 3 });
    const src = new Uint8Array(2500).map((_, i) => i & 255);
    const rb = await b.register({ kind: 'host', buffer: src });
    const dst = new Uint8Array(2500);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const report = await a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }]);
    expect(report.chunks).toBe(3);
    expect(dst).toEqual(src);
    const t = ta[0] as MemTransport;
    const all = t.executed.flatMap((e) => e.lengths).sort((x, y) => x - y);
    // Invariant 8: never "at least cap": the last chunk is exactly what is left.
    expect(all).toEqual([500, 1000, 1000]);
    expect(new Set(t.executed.map((e) => e.stream))).toEqual(new Set([0, 1, 2]));
    await a.close();
    await b.close();
  });

  it('a descriptor or endpoint blob reused after its bytes changed is decoded again, not served from a cache', async () => {
    const { a, b } = await pair(() => [new MemTransport()]);
    const one = await b.register({ kind: 'host', buffer: new Uint8Array(64).fill(1) });
    const two = await b.register({ kind: 'host', buffer: new Uint8Array(64).fill(2) });
    expect(two.descriptor.length).toBe(one.descriptor.length);
    const dst = new Uint8Array(64);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const descriptor = one.descriptor.slice();
    const endpoint = b.endpoint().slice();
    await a.read(endpoint, [{ local: ra, remote: descriptor }]);
    expect(dst.every((x) => x === 1)).toBe(true);
    await a.read(endpoint, [{ local: ra, remote: descriptor }]); // the cached decode
    expect(dst.every((x) => x === 1)).toBe(true);
    descriptor.set(two.descriptor); // same object, other bytes
    await a.read(endpoint, [{ local: ra, remote: descriptor }]);
    expect(dst.every((x) => x === 2)).toBe(true);
    // An endpoint blob rewritten to garbage is decoded again, and refused.
    endpoint.fill(0);
    await expect(a.read(endpoint, [{ local: ra, remote: descriptor }])).rejects.toBeInstanceOf(InvalidInputError);
    await a.close();
    await b.close();
  });

  it('caps the chunk size by the transport\'s maxChunkBytes', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport({ maxChunkBytes: 100 })], { chunkBytes: 1000 });
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(250) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(250) });
    await a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }]);
    expect((ta[0] as MemTransport).executed.flatMap((e) => e.lengths).sort((x, y) => x - y)).toEqual([50, 100, 100]);
    await a.close();
    await b.close();
  });

  it('picks the fastest usable transport, explains it, and logs and counts a slower path', async () => {
    const warnings: string[] = [];
    const logger: Logger = { ...silentLogger, warn: (m) => warnings.push(m) };
    const registry = new Registry();
    const fast = (): MemTransport => new MemTransport({ name: 'fast', rank: 50, local: false, remote: true, unreachable: 'no active port' });
    const slow = (): MemTransport => new MemTransport({ name: 'slow', rank: 10 });
    const a = new TransferEngine({ nodeId: 'a', transports: [fast(), slow()], logger, metrics: { registry } });
    const b = new TransferEngine({ nodeId: 'b', transports: [fast(), slow()], logger: silentLogger, metrics: false });
    await a.start();
    await b.start();
    const ex = a.explain(b.endpoint());
    expect(ex.chosen).toBe('slow');
    expect(ex.slowerPath).toBe(true);
    expect(ex.reason).toMatch(/fast: not usable between processes on one host/);
    expect(ex.candidates.map((c) => c.transport)).toEqual(['fast', 'slow']);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(8) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(8) });
    await a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }]);
    await a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }]);
    expect(warnings).toHaveLength(1);
    expect(warnings[0]).toMatch(/slower transport path/);
    const metrics = await registry.getMetricsAsJSON();
    const selections = metrics.find((m) => m.name === 'tensorwire_transport_selections_total');
    expect(selections?.values.find((v) => v.labels['transport'] === 'slow')?.labels['slower_path']).toBe('true');
    const bytes = metrics.find((m) => m.name === 'tensorwire_transfer_bytes_total');
    expect(bytes?.values.find((v) => v.labels['transport'] === 'slow' && v.labels['direction'] === 'read')?.value).toBe(16);
    // A peer on another host: the remote-capable fast transport is still unreachable (no active port).
    const other = a.explain({ identity: { ...b.identity, hostId: 'elsewhere' }, transports: new Map([['slow', new Uint8Array(1)], ['fast', new Uint8Array(1)]]) });
    expect(other.chosen).toBe('slow');
    expect(other.reason).toMatch(/no active port/);
    await a.close();
    await b.close();
  });

  it('explains when no transport can reach a peer', async () => {
    const a = new TransferEngine({ nodeId: 'a', transports: [new MemTransport({ name: 'shm', local: true, remote: false })], logger: silentLogger });
    await a.start();
    const ex = a.explain({ identity: { nodeId: 'far', incarnation: 'i', hostId: 'other' }, transports: new Map([['shm', new Uint8Array(1)]]) });
    expect(ex.chosen).toBeUndefined();
    expect(ex.reason).toMatch(/shm: works only on the same host/);
    await a.close();
  });

  it('local exhaustion backs off and keeps the connection; a broken connection is removed in one step', async () => {
    let exhaust = 2;
    let breakNext = false;
    const { a, b, ta } = await pair(() => [
      new MemTransport({
        beforeExecute: () => {
          if (exhaust > 0) {
            exhaust--;
            throw new ResourceExhaustedError('send queue full');
          }
          if (breakNext) {
            breakNext = false;
            throw new ConnectionBrokenError('qp in error');
          }
        },
      }),
    ]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(16).fill(3) });
    const dst = new Uint8Array(16);
    const ra = await a.register({ kind: 'host', buffer: dst });
    await a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor, length: 16 }], { timeoutMs: 10_000 });
    expect(dst.every((x) => x === 3)).toBe(true);
    const t = ta[0] as MemTransport;
    expect(t.connections).toHaveLength(1);
    expect(t.connections[0]?.isOpen).toBe(true);
    breakNext = true;
    await expect(a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }])).rejects.toMatchObject({ code: ErrorCode.ConnectionBroken });
    expect(t.connections[0]?.isOpen).toBe(false);
    expect(a.connections()).toHaveLength(0);
    await a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }]);
    expect(t.connections).toHaveLength(2);
    await a.close();
    await b.close();
  });

  it('rejects bad options and requests with InvalidInput naming the field', async () => {
    expect(() => new TransferEngine({ nodeId: 'bad/id', transports: [new MemTransport()] })).toThrow(InvalidInputError);
    expect(() => new TransferEngine({ nodeId: 'a', transports: [] })).toThrow(/at least one transport/);
    expect(() => new TransferEngine({ nodeId: 'a', transports: [new MemTransport(), new MemTransport()] })).toThrow(/given twice/);
    expect(() => new TransferEngine({ nodeId: 'a', transports: [new MemTransport()], streamsPerPeer: 0 })).toThrow(/streamsPerPeer/);
    const wrongVersion = Object.assign(new MemTransport(), { specificationVersion: 'v0' });
    expect(() => new TransferEngine({ nodeId: 'a', transports: [wrongVersion as unknown as MemTransport] })).toThrow(/specification v0/);
    const { a, b } = await pair(() => [new MemTransport()]);
    await expect(a.register({ kind: 'host', buffer: new Uint8Array(0) })).rejects.toThrow(/0 bytes/);
    await expect(a.register({ kind: 'gpu' } as never)).rejects.toThrow(/unknown memory kind/);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(8) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(8) });
    await expect(a.read(b.endpoint(), [])).rejects.toThrow(/at least one request/);
    await expect(a.read(b.endpoint(), [{ local: {} as never, remote: rb.descriptor }])).rejects.toThrow(/Registration of this engine/);
    await expect(a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { timeoutMs: -1 })).rejects.toThrow(/timeoutMs/);
    // A registration of another engine is refused even though it is a Registration.
    await expect(a.read(b.endpoint(), [{ local: rb, remote: rb.descriptor }])).rejects.toThrow(/not registered with this engine/);
    // A descriptor from an earlier incarnation of the peer is refused.
    const b2 = new TransferEngine({ nodeId: 'b', transports: [new MemTransport()], logger: silentLogger });
    await b2.start();
    await expect(a.read(b2.endpoint(), [{ local: ra, remote: rb.descriptor }])).rejects.toThrow(/earlier incarnation/);
    await a.close();
    await b.close();
    await b2.close();
  });

  it('a handshake that never settles times out and leaves no entry stuck in "connecting"', async () => {
    const ta = new MemTransport({ connectHangs: true });
    const a = new TransferEngine({ nodeId: 'a', transports: [ta], logger: silentLogger, connectTimeoutMs: 50 });
    const b = new TransferEngine({ nodeId: 'b', transports: [new MemTransport()], logger: silentLogger });
    await a.start();
    await b.start();
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(8) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(8) });
    for (let i = 0; i < 3; i++) {
      await expect(a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }], { timeoutMs: 10_000 })).rejects.toMatchObject({ code: ErrorCode.TimedOut });
      expect(a.connections()).toHaveLength(0);
    }
    // Each attempt started a fresh handshake instead of waiting on the wedged one.
    expect(ta.connectCalls).toBe(3);
    await a.close();
    await b.close();
  });

  it('a read issued in the same turn as close() fails ClosedError at once, not at the connect timeout, and leaves no connection', async () => {
    const { a, b } = await pair(() => [new MemTransport()], { connectTimeoutMs: 30_000 });
    const read = (await readOf(a, b))();
    const closed = a.close();
    // The test's own timeout is far below the 30 s connect timeout: the outcome must come from close().
    expect(await read).toBe(ErrorCode.Closed);
    await closed;
    expect(a.connections()).toHaveLength(0);
    await b.close();
  }, 10_000);

  it('close() while a dial is in flight: the read waiting on it fails ClosedError as soon as the dial ends, not at the connect timeout', async () => {
    let open: () => void = () => undefined;
    const gate = new Promise<void>((r) => (open = r));
    /** A transport whose connect finishes only when the test says so. */
    class Gated extends MemTransport {
      dialing = 0;
      override async connect(...args: Parameters<MemTransport['connect']>): ReturnType<MemTransport['connect']> {
        this.dialing++;
        await gate;
        return super.connect(...args);
      }
    }
    const { a, b, ta } = await pair(() => [new Gated()], { connectTimeoutMs: 30_000 });
    const dialer = ta[0] as Gated;
    const read = (await readOf(a, b))();
    while (dialer.dialing === 0) await new Promise((r) => setImmediate(r));
    const closed = a.close();
    open();
    expect(await read).toBe(ErrorCode.Closed);
    await closed;
    expect(a.connections()).toHaveLength(0);
    await b.close();
  }, 10_000);

  it('a restarted peer (new incarnation) gets its own connection; the old one ends with the old process', async () => {
    const { a, b, ta } = await pair(() => [new MemTransport()]);
    const rb = await b.register({ kind: 'host', buffer: new Uint8Array(8) });
    const ra = await a.register({ kind: 'host', buffer: new Uint8Array(8) });
    await a.read(b.endpoint(), [{ local: ra, remote: rb.descriptor }]);
    const b2 = new TransferEngine({ nodeId: 'b', transports: [new MemTransport()], logger: silentLogger });
    await b2.start();
    const rb2 = await b2.register({ kind: 'host', buffer: new Uint8Array(8).fill(9) });
    await a.read(b2.endpoint(), [{ local: ra, remote: rb2.descriptor }]);
    const t = ta[0] as MemTransport;
    expect(t.connections).toHaveLength(2);
    expect(t.connections.map((c) => c.isOpen)).toEqual([true, true]); // one per incarnation
    expect(a.connections().map((c) => c.peer.incarnation).sort()).toEqual([b.identity.incarnation, b2.identity.incarnation].sort());
    // The old process goes away and its connection's transport notices.
    await b.close();
    await t.connections[0]?.close(new ConnectionBrokenError('mem: the peer went away'));
    expect(a.connections().map((c) => c.peer.incarnation)).toEqual([b2.identity.incarnation]);
    await Promise.all([a.close(), b.close(), b2.close()]);
  });
});
