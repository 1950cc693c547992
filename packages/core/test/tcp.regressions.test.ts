/** Regression tests for TCP transport and engine defects found in review. */
import net from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import {
  ErrorCode,
  TcpTransport,
  TransferEngine,
  decodeDescriptor,
  decodeEndpoint,
  decodeTcpEndpoint,
  silentLogger,
  tcpFrames,
  type TcpTransportOptions,
} from '../src/index.js';
import { pattern } from '../src/testing/pattern.js';

const engines: TransferEngine[] = [];
const sockets: net.Socket[] = [];
afterEach(async () => {
  for (const s of sockets.splice(0)) s.destroy();
  await Promise.allSettled(engines.splice(0).map((e) => e.close()));
});

let n = 0;
async function engine(tcp: TcpTransportOptions = {}, extra: Record<string, unknown> = {}): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId: `r${++n}`, transports: [new TcpTransport(tcp)], logger: silentLogger, ...extra });
  await e.start();
  engines.push(e);
  return e;
}

function tcpPort(e: TransferEngine): number {
  return decodeTcpEndpoint(decodeEndpoint(e.endpoint()).transports.get('tcp') as Uint8Array).port;
}

describe('tcp transport regressions', () => {
  it('two peers reading lots from each other over one shared connection do not deadlock', async () => {
    const opts = { sendHighWaterMark: 256 * 1024 };
    const x = await engine(opts);
    const y = await engine(opts);
    const size = 4 * 1024 * 1024;
    const onX = await x.register({ kind: 'host', buffer: pattern(size, 1) });
    const onY = await y.register({ kind: 'host', buffer: pattern(size, 2) });
    const dx = Array.from({ length: 8 }, () => new Uint8Array(size));
    const dy = Array.from({ length: 8 }, () => new Uint8Array(size));
    const rx = await Promise.all(dx.map((buffer) => x.register({ kind: 'host', buffer })));
    const ry = await Promise.all(dy.map((buffer) => y.register({ kind: 'host', buffer })));
    await Promise.all([
      ...rx.map((local) => x.read(y.endpoint(), [{ local, remote: onY.descriptor }], { timeoutMs: 60_000 })),
      ...ry.map((local) => y.read(x.endpoint(), [{ local, remote: onX.descriptor }], { timeoutMs: 60_000 })),
    ]);
    for (const d of dx) expect(Buffer.compare(d, pattern(size, 2))).toBe(0);
    for (const d of dy) expect(Buffer.compare(d, pattern(size, 1))).toBe(0);
  });

  it('aborting one read leaves the other reads on the same connection intact', async () => {
    const x = await engine();
    const y = await engine();
    const size = 16 * 1024 * 1024;
    const src = await y.register({ kind: 'host', buffer: pattern(size, 5) });
    const warm = await x.register({ kind: 'host', buffer: new Uint8Array(size) });
    await x.read(y.endpoint(), [{ local: warm, remote: src.descriptor }]);
    for (let round = 0; round < 5; round++) {
      const dsts = Array.from({ length: 4 }, () => new Uint8Array(size));
      const regs = await Promise.all(dsts.map((buffer) => x.register({ kind: 'host', buffer })));
      const ac = new AbortController();
      const results = regs.map((local, i) =>
        x.read(y.endpoint(), [{ local, remote: src.descriptor }], i === 0 ? { signal: ac.signal } : {}).then(
          () => 'ok',
          (e: { code?: string }) => e.code,
        ),
      );
      await new Promise((r) => setTimeout(r, 2));
      ac.abort();
      const out = await Promise.all(results);
      expect(['ok', ErrorCode.Aborted]).toContain(out[0]);
      expect(out.slice(1)).toEqual(['ok', 'ok', 'ok']);
      for (const d of dsts.slice(1)) expect(Buffer.compare(d, pattern(size, 5))).toBe(0);
    }
  });

  it('peers with different chunk limits agree on the smaller one, both directions', async () => {
    const small = await engine({ maxChunkBytes: 64 * 1024 });
    const big = await engine({}, { chunkBytes: 1024 * 1024 });
    const size = 1024 * 1024 + 17;
    const onSmall = await small.register({ kind: 'host', buffer: pattern(size, 3) });
    const dst = new Uint8Array(size);
    const local = await big.register({ kind: 'host', buffer: dst });
    const report = await big.read(small.endpoint(), [{ local, remote: onSmall.descriptor }]);
    expect(Buffer.compare(dst, pattern(size, 3))).toBe(0);
    expect(report.bytes).toBe(size);
    const src = await big.register({ kind: 'host', buffer: pattern(size, 4) });
    await big.write(small.endpoint(), [{ local: src, remote: onSmall.descriptor }]);
    const back = new Uint8Array(size);
    await big.read(small.endpoint(), [{ local: await big.register({ kind: 'host', buffer: back }), remote: onSmall.descriptor }]);
    expect(Buffer.compare(back, pattern(size, 4))).toBe(0);
  });

  it('revoke() does not hang on a peer that stops reading; its socket is closed instead', async () => {
    const holder = await engine({ revokeGraceMs: 100, sendHighWaterMark: 64 * 1024 });
    const size = 32 * 1024 * 1024;
    const reg = await holder.register({ kind: 'host', buffer: pattern(size, 6) });
    const token = decodeDescriptor(reg.descriptor).transports.get('tcp') as Uint8Array;
    const id = holder.identity;
    const s = net.connect({ port: tcpPort(holder), host: '127.0.0.1' });
    sockets.push(s);
    s.on('error', () => undefined);
    await new Promise<void>((r) => s.once('connect', () => r()));
    s.write(tcpFrames.encodeHello({ connectionId: new Uint8Array(16).fill(9), streamIndex: 0, streamCount: 1, nodeId: 'slowpoke', incarnation: 's1', hostId: 'h1', expectedNodeId: id.nodeId, expectedIncarnation: id.incarnation, maxChunkBytes: 1 << 24 }));
    // Ask for 16 MiB twice and never read a byte.
    for (const rid of [1, 2]) s.write(tcpFrames.encodeReadvReq(rid, [token], [{ token: 0, offset: 0, length: 16 * 1024 * 1024 }]));
    s.pause();
    await new Promise((r) => setTimeout(r, 100));
    expect(holder.connections().map((c) => c.peer.nodeId)).toEqual(['slowpoke']);
    await reg.revoke(); // resolves: the stalled socket was closed to release the memory
    await new Promise((r) => setTimeout(r, 20));
    expect(holder.connections()).toHaveLength(0);
  });

  it('a WRITE before the handshake is refused and writes nothing', async () => {
    const holder = await engine();
    const buffer = new Uint8Array(64);
    const reg = await holder.register({ kind: 'host', buffer });
    const token = decodeDescriptor(reg.descriptor).transports.get('tcp') as Uint8Array;
    const s = net.connect({ port: tcpPort(holder), host: '127.0.0.1' });
    sockets.push(s);
    s.on('error', () => undefined);
    const closed = new Promise<void>((r) => s.once('close', () => r()));
    await new Promise<void>((r) => s.once('connect', () => r()));
    s.write(tcpFrames.encodeWritevReq(1, [token], [{ token: 0, offset: 0, length: 8 }], Buffer.from('AAAAAAAA')));
    await closed;
    expect(buffer.every((b) => b === 0)).toBe(true);
  });

  it('a HELLO that does not name the exact incarnation it dials is refused', async () => {
    const holder = await engine();
    const s = net.connect({ port: tcpPort(holder), host: '127.0.0.1' });
    sockets.push(s);
    s.on('error', () => undefined);
    let got = Buffer.alloc(0);
    s.on('data', (d: Buffer) => (got = Buffer.concat([got, d])));
    const closed = new Promise<void>((r) => s.once('close', () => r()));
    await new Promise<void>((r) => s.once('connect', () => r()));
    s.write(tcpFrames.encodeHello({ connectionId: new Uint8Array(16), streamIndex: 0, streamCount: 1, nodeId: 'guess', incarnation: 'g1', hostId: 'h', expectedNodeId: holder.identity.nodeId, expectedIncarnation: 'someone-else', maxChunkBytes: 1024 }));
    await closed;
    expect(got.readUInt8(1)).toBe(tcpFrames.FrameType.Error);
    expect(tcpFrames.decodeError(got.subarray(12)).code).toBe('WRONG_PEER');
    expect(holder.connections()).toHaveLength(0);
  });

  it('a deadline beyond the 2^31 ms timer limit does not fire at once', async () => {
    const x = await engine();
    const y = await engine();
    const src = await y.register({ kind: 'host', buffer: pattern(4096, 7) });
    const dst = new Uint8Array(4096);
    await x.read(y.endpoint(), [{ local: await x.register({ kind: 'host', buffer: dst }), remote: src.descriptor }], { timeoutMs: 30 * 24 * 3600 * 1000 });
    expect(Buffer.compare(dst, pattern(4096, 7))).toBe(0);
  });
});
