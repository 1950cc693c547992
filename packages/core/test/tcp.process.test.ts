import { fork, type ChildProcess } from 'node:child_process';
import net from 'node:net';
import { fileURLToPath } from 'node:url';
import { afterEach, describe, expect, it } from 'vitest';
import {
  ErrorCode,
  TensorwireError,
  TcpTransport,
  TransferEngine,
  createTransferBatch,
  decodeDescriptor,
  decodeEndpoint,
  encodeDescriptor,
  encodeEndpoint,
  encodeTcpEndpoint,
  silentLogger,
  tcpFrames,
} from '../src/index.js';
import { pattern } from '../src/testing/pattern.js';

const HOLDER = fileURLToPath(new URL('./fixtures/holder.mjs', import.meta.url));
const children: ChildProcess[] = [];
const engines: TransferEngine[] = [];
const servers: net.Server[] = [];
const closers: (() => Promise<void>)[] = [];

afterEach(async () => {
  for (const c of children.splice(0)) c.kill('SIGKILL');
  await Promise.allSettled(engines.splice(0).map((e) => e.close()));
  await Promise.allSettled(closers.splice(0).map((c) => c()));
  for (const s of servers.splice(0)) s.close();
});

function startHolder(size: number): Promise<{ child: ChildProcess; endpoint: Uint8Array; descriptor: Uint8Array }> {
  const child = fork(HOLDER, [String(size)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  children.push(child);
  return new Promise((resolve, reject) => {
    child.once('exit', (code, sig) => reject(new Error(`holder exited early: ${code ?? sig}`)));
    child.on('message', (m: { type: string; endpoint: string; descriptor: string }) => {
      if (m.type === 'ready') resolve({ child, endpoint: new Uint8Array(Buffer.from(m.endpoint, 'base64')), descriptor: new Uint8Array(Buffer.from(m.descriptor, 'base64')) });
    });
  });
}

async function requester(): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId: 'requester', transports: [new TcpTransport()], logger: silentLogger });
  await e.start();
  engines.push(e);
  return e;
}

describe('tcp across processes', () => {
  it('reads and writes a holder process\'s memory', async () => {
    const size = 8 * 1024 * 1024 + 5;
    const h = await startHolder(size);
    const e = await requester();
    const dst = new Uint8Array(size);
    const reg = await e.register({ kind: 'host', buffer: dst });
    await e.read(h.endpoint, [{ local: reg, remote: h.descriptor }]);
    expect(Buffer.compare(dst, pattern(size, 99))).toBe(0);
    // Write a new pattern into the holder, read it back through a second buffer.
    const src = pattern(size, 7);
    const sreg = await e.register({ kind: 'host', buffer: src });
    await e.write(h.endpoint, [{ local: sreg, remote: h.descriptor }]);
    dst.fill(0);
    await e.read(h.endpoint, [{ local: reg, remote: h.descriptor }]);
    expect(Buffer.compare(dst, src)).toBe(0);
  });

  it('a holder SIGKILLed mid-transfer yields connection errors, never a hang or partial data as success', async () => {
    const size = 32 * 1024 * 1024;
    const h = await startHolder(size);
    const e = await requester();
    const expected = pattern(size, 99);
    const dsts = Array.from({ length: 6 }, () => new Uint8Array(size));
    const regs = await Promise.all(dsts.map((buffer) => e.register({ kind: 'host', buffer })));
    await e.read(h.endpoint, [{ local: regs[0]!, remote: h.descriptor }]); // connected and warm
    dsts[0]!.fill(0);
    const outcomes = regs.map((local) =>
      e.read(h.endpoint, [{ local, remote: h.descriptor }], { timeoutMs: 30_000 }).then(
        () => 'ok' as const,
        (err: unknown) => err,
      ),
    );
    setImmediate(() => h.child.kill('SIGKILL'));
    const results = await Promise.all(outcomes);
    let failures = 0;
    results.forEach((r, i) => {
      if (r === 'ok') {
        expect(Buffer.compare(dsts[i]!, expected)).toBe(0);
      } else {
        failures++;
        expect(r).toBeInstanceOf(TensorwireError);
        expect([ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]).toContain((r as TensorwireError).code);
      }
    });
    expect(failures).toBeGreaterThan(0);
    expect(e.connections()).toHaveLength(0);
    // The dead holder is unreachable: a typed error, not a hang.
    await expect(e.read(h.endpoint, [{ local: regs[0]!, remote: h.descriptor }], { timeoutMs: 10_000 })).rejects.toMatchObject({ code: ErrorCode.ConnectionBroken });
  });

  it('a batched read of thousands of ranges whose holder is SIGKILLed mid-batch fails typed by the deadline, never as partial success', async () => {
    const size = 64 * 1024 * 1024;
    const expected = pattern(size, 99);
    for (const via of ['engine', 'connection'] as const) {
      const h = await startHolder(size);
      // 16,384 ranges of 4 KiB scattered over the holder's 64 MiB, in one read.
      const n = 16384;
      const block = 4096;
      const dst = new Uint8Array(n * block);
      const at = (i: number): number => ((i * 7919) % n) * block;
      const started = (): boolean => dst.subarray(0, block).some((x) => x !== 0);
      let call: Promise<unknown>;
      let connections: () => number;
      if (via === 'engine') {
        const e = await requester();
        const local = await e.register({ kind: 'host', buffer: dst });
        await e.connect(h.endpoint);
        const requests = Array.from({ length: n }, (_, i) => ({ local, localOffset: i * block, remote: h.descriptor, remoteOffset: at(i), length: block }));
        call = e.read(h.endpoint, requests, { timeoutMs: 20_000 });
        connections = () => e.connections().length;
      } else {
        // The same through one connection.execute of one batch, deadline by signal.
        const t = new TcpTransport();
        await t.start({ identity: { nodeId: 'requester2', incarnation: 'r2', hostId: 'h' }, logger: silentLogger, inbound: () => undefined });
        closers.push(() => t.close());
        const endpoint = decodeEndpoint(h.endpoint);
        const descriptor = decodeDescriptor(h.descriptor);
        const conn = await t.connect(endpoint.identity, endpoint.transports.get('tcp') as Uint8Array, { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
        const local = (await t.register({ kind: 'host', buffer: dst })).handle;
        const remote = t.decodeRemote(descriptor.transports.get('tcp') as Uint8Array, 'host', descriptor.byteLength);
        const batch = createTransferBatch('read', Array.from({ length: n }, (_, i) => ({ local, localOffset: i * block, remote, remoteOffset: at(i), length: block })));
        call = conn.execute(0, batch, { signal: AbortSignal.timeout(20_000), deadline: Date.now() + 20_000 });
        connections = () => (conn.isOpen ? 1 : 0);
      }
      const outcome = call.then(
        () => 'ok' as const,
        (err: unknown) => err,
      );
      // Kill the holder once the batch's bytes have started to land, long before they all have.
      let landed = false;
      while (!landed) {
        await new Promise((r) => setImmediate(r));
        landed = started();
      }
      h.child.kill('SIGKILL');
      const r = await outcome;
      if (r === 'ok') {
        // Finished before the kill reached it: then it must be complete.
        for (let i = 0; i < n; i++) expect(Buffer.compare(dst.subarray(i * block, (i + 1) * block), expected.subarray(at(i), at(i) + block))).toBe(0);
      } else {
        expect(r, via).toBeInstanceOf(TensorwireError);
        expect([ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated, ErrorCode.TimedOut], via).toContain((r as TensorwireError).code);
        // Settled after quiescing: nothing lands any more.
        const snapshot = dst.slice();
        await new Promise((res) => setTimeout(res, 50));
        expect(Buffer.compare(dst, snapshot)).toBe(0);
      }
      expect(connections()).toBe(0);
    }
  });
});

/** A fake peer that completes the handshake, then sends only part of a READV_DATA and stalls. */
async function stallingPeer(sendBytes: number): Promise<{ endpoint: Uint8Array; descriptor: Uint8Array; sockets: net.Socket[] }> {
  const identity = { nodeId: 'stall', incarnation: 'inc1', hostId: 'h1' };
  const sockets: net.Socket[] = [];
  const server = net.createServer((s) => {
    sockets.push(s);
    s.on('error', () => undefined);
    let buf = Buffer.alloc(0);
    let hello = false;
    s.on('data', (d: Buffer) => {
      buf = Buffer.concat([buf, d]);
      while (buf.length >= 12) {
        const len = buf.readUInt32BE(8);
        if (buf.length < 12 + len) return;
        const type = buf.readUInt8(1);
        const reqId = buf.readUInt32BE(4);
        const body = buf.subarray(12, 12 + len);
        buf = buf.subarray(12 + len);
        if (!hello && type === tcpFrames.FrameType.Hello) {
          hello = true;
          s.write(tcpFrames.encodeHelloAck(identity.nodeId, identity.incarnation, identity.hostId, 1 << 24));
        } else if (type === tcpFrames.FrameType.ReadvReq && sendBytes > 0) {
          const head = tcpFrames.decodeVecHead(body);
          const total = head.ranges.reduce((sum, r) => sum + r.length, 0);
          s.write(tcpFrames.frameHeader(tcpFrames.FrameType.ReadvData, reqId, total));
          s.write(Buffer.alloc(Math.min(sendBytes, total - 1), 0xab));
        }
      }
    });
  });
  servers.push(server);
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const port = (server.address() as net.AddressInfo).port;
  const endpoint = encodeEndpoint({ identity, transports: new Map([['tcp', encodeTcpEndpoint('127.0.0.1', port)]]) });
  const descriptor = encodeDescriptor({ owner: identity, registrationId: 'block:stall:1', memoryKind: 'host', byteLength: 4096, transports: new Map([['tcp', new Uint8Array(16)]]) });
  return { endpoint, descriptor, sockets };
}

describe('tcp deadlines against a stalled peer', () => {
  it('a peer that never answers yields TimedOut by the deadline', async () => {
    const peer = await stallingPeer(0);
    const e = await requester();
    const reg = await e.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await expect(e.read(peer.endpoint, [{ local: reg, remote: peer.descriptor }], { timeoutMs: 300 })).rejects.toMatchObject({ code: ErrorCode.TimedOut });
  });

  it('a peer that stalls mid-payload: the socket is quiesced before TimedOut, and nothing lands in memory afterwards', async () => {
    const peer = await stallingPeer(1000);
    const e = await requester();
    const dst = new Uint8Array(4096);
    const reg = await e.register({ kind: 'host', buffer: dst });
    await expect(e.read(peer.endpoint, [{ local: reg, remote: peer.descriptor }], { timeoutMs: 300 })).rejects.toMatchObject({ code: ErrorCode.TimedOut });
    const snapshot = dst.slice();
    // The peer now sends the rest of the payload; none of it may reach the buffer.
    for (const s of peer.sockets) if (!s.destroyed) s.write(Buffer.alloc(3096, 0xcd));
    await new Promise((r) => setTimeout(r, 100));
    expect(Buffer.compare(dst, snapshot)).toBe(0);
    expect(dst.includes(0xcd)).toBe(false);
    // The stream that was mid-payload was closed to quiesce it; the engine dropped the connection.
    expect(e.connections()).toHaveLength(0);
  });
});
