/**
 * The TCP transport driven directly (no engine): two TcpTransports connected by hand, batches
 * built with createTransferBatch and run with connection.execute.
 */
import fc from 'fast-check';
import { afterEach, describe, expect, it } from 'vitest';
import { ErrorCode, InvalidInputError, RemoteRejectedError, TensorwireError } from '../src/errors.js';
import { silentLogger } from '../src/logger.js';
import { FRAME_TARGET_BYTES, TcpTransport, type TcpTransportOptions } from '../src/tcp/transport.js';
import { pattern } from '../src/testing/pattern.js';
import { createTransferBatch, type NodeIdentity, type TransferBatch, type TransferRangeInit, type TransportConnection } from '../src/transport.js';

const transports: TcpTransport[] = [];
afterEach(async () => {
  await Promise.allSettled(transports.splice(0).map((t) => t.close()));
});

let n = 0;
async function node(options: TcpTransportOptions = {}): Promise<{ t: TcpTransport; id: NodeIdentity; inbound: TransportConnection[] }> {
  const t = new TcpTransport(options);
  const id = { nodeId: `n${++n}`, incarnation: `inc${n}`, hostId: 'host1' };
  const inbound: TransportConnection[] = [];
  await t.start({ identity: id, logger: silentLogger, inbound: (c) => inbound.push(c) });
  transports.push(t);
  return { t, id, inbound };
}

async function pair(options: { a?: TcpTransportOptions; b?: TcpTransportOptions; streams?: number } = {}) {
  const a = await node(options.a);
  const b = await node(options.b);
  const conn = await a.t.connect(b.id, b.t.endpoint(), { streams: options.streams ?? 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
  return { a, b, conn };
}

/** Register memory on `t`; the remote view of it as the peer decodes it. */
async function region(owner: TcpTransport, peer: TcpTransport, buffer: Uint8Array, claimed = buffer.length) {
  const reg = await owner.register({ kind: 'host', buffer });
  return { buffer, handle: reg.handle, remote: peer.decodeRemote(reg.payload, 'host', claimed) };
}

function exec(conn: TransportConnection, batch: TransferBatch, options: { signal?: AbortSignal; stream?: number } = {}): Promise<void> {
  return conn.execute(options.stream ?? 0, batch, { signal: options.signal ?? AbortSignal.timeout(30_000), deadline: Date.now() + 30_000 });
}

async function outcome(p: Promise<unknown>): Promise<unknown> {
  return p.then(
    () => 'ok',
    (e: unknown) => e,
  );
}

describe('tcp batches, driven directly', () => {
  // Ranges of mixed sizes (1 byte to past the zero-copy and direct-receive thresholds) over two
  // remote registrations and two local buffers, destinations not overlapping.
  const rangeArb = fc.record({
    length: fc.oneof(fc.integer({ min: 1, max: 64 }), fc.integer({ min: 900, max: 5000 }), fc.integer({ min: 60_000, max: 200_000 })),
    gap: fc.integer({ min: 0, max: 9 }),
    side: fc.integer({ min: 0, max: 1 }),
    at: fc.double({ min: 0, max: 1, noNaN: true }),
  });

  it('reads and writes exactly the bytes of every range, and nothing else', async () => {
    const { a, b, conn } = await pair({ streams: 2 });
    const sizes = [3 * 1024 * 1024 + 7, 512 * 1024 + 3];
    const remoteBufs = sizes.map((s, i) => pattern(s, 10 + i));
    const remotes = await Promise.all(remoteBufs.map((buf) => region(b.t, a.t, buf)));
    const localBufs = sizes.map(() => new Uint8Array(4 * 1024 * 1024));
    const locals = await Promise.all(localBufs.map((buf) => region(a.t, b.t, buf)));
    await fc.assert(
      fc.asyncProperty(fc.array(rangeArb, { minLength: 1, maxLength: 40 }), fc.boolean(), fc.integer({ min: 0, max: 1 }), async (specs, write, stream) => {
        for (const l of localBufs) l.fill(0);
        if (write) for (const l of localBufs) l.set(pattern(l.length, 77));
        const before = remoteBufs.map((r) => r.slice());
        // Destinations are laid out one after another (with gaps) on the destination side.
        const cursor = [0, 0];
        const list: TransferRangeInit[] = [];
        for (const s of specs) {
          const destSize = write ? sizes[s.side]! : localBufs[s.side]!.length;
          const srcSize = write ? localBufs[s.side]!.length : sizes[s.side]!;
          const length = Math.min(s.length, srcSize);
          const destAt = cursor[s.side]! + s.gap;
          if (destAt + length > destSize) continue;
          cursor[s.side] = destAt + length;
          const srcAt = Math.floor(s.at * (srcSize - length));
          list.push({
            local: locals[s.side]!.handle,
            localOffset: write ? srcAt : destAt,
            remote: remotes[s.side]!.remote,
            remoteOffset: write ? destAt : srcAt,
            length,
          });
        }
        if (list.length === 0) return;
        await exec(conn, createTransferBatch(write ? 'write' : 'read', list), { stream });
        if (write) {
          const want = before.map((r) => r.slice());
          for (const r of list) {
            const side = locals.findIndex((l) => l.handle === r.local);
            want[side]!.set(localBufs[side]!.subarray(r.localOffset, r.localOffset + r.length), r.remoteOffset);
          }
          remoteBufs.forEach((r, i) => expect(Buffer.compare(r, want[i]!)).toBe(0));
          remoteBufs.forEach((r, i) => r.set(before[i]!));
        } else {
          const want = localBufs.map((l) => new Uint8Array(l.length));
          for (const r of list) {
            const side = locals.findIndex((l) => l.handle === r.local);
            want[side]!.set(remoteBufs[side]!.subarray(r.remoteOffset, r.remoteOffset + r.length), r.localOffset);
          }
          localBufs.forEach((l, i) => expect(Buffer.compare(l, want[i]!)).toBe(0));
        }
      }),
      { numRuns: 40 },
    );
  });

  it('batches past one frame (by bytes, by range count, by distinct tokens) arrive whole', async () => {
    const { a, b, conn } = await pair();
    // Bytes: 3 MiB of 1 KiB ranges, scattered. Ranges: 9000 ranges of 16 bytes (over 8192 per
    // frame). Tokens: 1100 registrations (over 1024 per frame), a few bytes from each.
    const big = pattern(8 * 1024 * 1024, 3);
    const src = await region(b.t, a.t, big);
    const many = await Promise.all(Array.from({ length: 1100 }, (_, i) => region(b.t, a.t, pattern(64, 1000 + i))));
    const dst = new Uint8Array(4 * 1024 * 1024);
    const local = await region(a.t, b.t, dst);
    const cases: TransferRangeInit[][] = [
      Array.from({ length: 3072 }, (_, i) => ({ local: local.handle, localOffset: i * 1024, remote: src.remote, remoteOffset: ((i * 7919) % 8192) * 1024, length: 1024 })),
      Array.from({ length: 9000 }, (_, i) => ({ local: local.handle, localOffset: i * 16, remote: src.remote, remoteOffset: ((i * 104729) % 500_000) * 16, length: 16 })),
      many.map((m, i) => ({ local: local.handle, localOffset: i * 8, remote: m.remote, remoteOffset: i % 56, length: 8 })),
    ];
    for (const list of cases) {
      dst.fill(0);
      await exec(conn, createTransferBatch('read', list));
      for (const r of list) {
        const from = r.remote === src.remote ? big : many.find((m) => m.remote === r.remote)!.buffer;
        expect(Buffer.compare(dst.subarray(r.localOffset, r.localOffset + r.length), from.subarray(r.remoteOffset, r.remoteOffset + r.length))).toBe(0);
      }
      // And back the other way: write what was read to fresh places.
      const back = list.slice(0, 2000).map((r, i) => ({ ...r, remote: src.remote, remoteOffset: 4 * 1024 * 1024 + i * r.length }));
      await exec(conn, createTransferBatch('write', back));
      for (const r of back) expect(Buffer.compare(big.subarray(r.remoteOffset, r.remoteOffset + r.length), dst.subarray(r.localOffset, r.localOffset + r.length))).toBe(0);
      big.set(pattern(8 * 1024 * 1024, 3).subarray(4 * 1024 * 1024), 4 * 1024 * 1024);
    }
    expect(FRAME_TARGET_BYTES).toBeLessThan(3 * 1024 * 1024); // the first case really spans frames
  });

  it('the same batch object posted again, or twice at once, moves the current bytes each time', async () => {
    const { a, b, conn } = await pair();
    const remoteBuf = pattern(2 * 1024 * 1024, 4);
    const remote = await region(b.t, a.t, remoteBuf);
    const dst = new Uint8Array(2 * 1024 * 1024);
    const local = await region(a.t, b.t, dst);
    const list = Array.from({ length: 600 }, (_, i) => ({ local: local.handle, localOffset: i * 3000, remote: remote.remote, remoteOffset: ((i * 31) % 600) * 3000, length: i % 3 === 0 ? 100 : 3000 }));
    const read = createTransferBatch('read', list);
    const check = (): void => {
      for (const r of list) expect(Buffer.compare(dst.subarray(r.localOffset, r.localOffset + r.length), remoteBuf.subarray(r.remoteOffset, r.remoteOffset + r.length))).toBe(0);
    };
    await Promise.all([exec(conn, read), exec(conn, read), exec(conn, read)]);
    check();
    remoteBuf.set(pattern(remoteBuf.length, 5));
    await exec(conn, read);
    check();
    // Writes re-copy the source on every post: small ranges are coalesced into cached frames.
    const write = createTransferBatch('write', list.map((r) => ({ ...r, remoteOffset: r.localOffset })));
    for (const seed of [6, 7]) {
      dst.set(pattern(dst.length, seed));
      await Promise.all([exec(conn, write), exec(conn, write)]);
      for (const r of list) expect(Buffer.compare(remoteBuf.subarray(r.localOffset, r.localOffset + r.length), dst.subarray(r.localOffset, r.localOffset + r.length))).toBe(0);
    }
  });

  it('a range the peer refuses fails the whole batch and names its request; a refused write lands nothing', async () => {
    const { a, b, conn } = await pair();
    const good = await region(b.t, a.t, pattern(1024 * 1024, 8));
    const revokedBuf = pattern(4096, 9);
    const revoked = await region(b.t, a.t, revokedBuf);
    // The descriptor claims more than the peer registered: only the peer's own check stops it.
    const shortBuf = pattern(4096, 10);
    const inflated = await region(b.t, a.t, shortBuf, 8192);
    const dst = new Uint8Array(1024 * 1024);
    const local = await region(a.t, b.t, dst);
    await b.t.revoke(revoked.handle);
    const list = (bad: TransferRangeInit): TransferRangeInit[] =>
      Array.from({ length: 100 }, (_, i) => (i === 57 ? { ...bad, request: 1057 } : { local: local.handle, localOffset: i * 4096, remote: good.remote, remoteOffset: i * 4096, length: 4096, request: 1000 + i }));
    for (const [bad, code] of [
      [{ local: local.handle, localOffset: 57 * 4096, remote: revoked.remote, remoteOffset: 0, length: 4096 }, 'REVOKED'],
      [{ local: local.handle, localOffset: 57 * 4096, remote: inflated.remote, remoteOffset: 4096, length: 10 }, 'OUT_OF_BOUNDS'],
    ] as const) {
      for (const op of ['read', 'write'] as const) {
        dst.fill(op === 'write' ? 0x44 : 0);
        const before = [good.buffer.slice(), revokedBuf.slice(), shortBuf.slice()];
        const e = await outcome(exec(conn, createTransferBatch(op, list(bad))));
        expect(e).toBeInstanceOf(RemoteRejectedError);
        expect((e as RemoteRejectedError).remoteCode).toBe(code);
        expect((e as RemoteRejectedError).details['request']).toBe(1057);
        if (op === 'read') expect(dst.every((x) => x === 0)).toBe(true); // one frame: refused before any byte was sent
        else [good.buffer, revokedBuf, shortBuf].forEach((buf, i) => expect(Buffer.compare(buf, before[i]!)).toBe(0));
      }
    }
    // The connection is fine afterwards.
    await exec(conn, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote: good.remote, remoteOffset: 0, length: 4096 }]));
    expect(Buffer.compare(dst.subarray(0, 4096), good.buffer.subarray(0, 4096))).toBe(0);
    expect(conn.isOpen).toBe(true);
  });

  it('a batch spanning several frames, one of them refused, fails as a whole after every frame was answered', async () => {
    const { a, b, conn } = await pair();
    const good = await region(b.t, a.t, pattern(8 * 1024 * 1024, 11));
    const gone = await region(b.t, a.t, pattern(4096, 12));
    await b.t.revoke(gone.handle);
    const dst = new Uint8Array(8 * 1024 * 1024);
    const local = await region(a.t, b.t, dst);
    const list: TransferRangeInit[] = Array.from({ length: 2048 }, (_, i) => ({ local: local.handle, localOffset: i * 4096, remote: good.remote, remoteOffset: i * 4096, length: 4096 }));
    list[1500] = { local: local.handle, localOffset: 1500 * 4096, remote: gone.remote, remoteOffset: 0, length: 4096, request: 1500 };
    const e = await outcome(exec(conn, createTransferBatch('read', list)));
    expect(e).toBeInstanceOf(RemoteRejectedError);
    expect((e as RemoteRejectedError).details).toMatchObject({ request: 1500, remoteCode: 'REVOKED' });
    // Settled only after the other frames' data arrived: nothing moves afterwards.
    const snapshot = dst.slice();
    await new Promise((r) => setTimeout(r, 50));
    expect(Buffer.compare(dst, snapshot)).toBe(0);
  });

  it('local mistakes are InvalidInput naming the request, and nothing is sent', async () => {
    const { a, b, conn } = await pair();
    const remote = await region(b.t, a.t, pattern(64 * 1024, 13));
    const dst = new Uint8Array(8192);
    const local = await region(a.t, b.t, dst);
    const ok = { local: local.handle, localOffset: 0, remote: remote.remote, remoteOffset: 0, length: 4096 };
    const cases: [TransferRangeInit, RegExp][] = [
      [{ ...ok, localOffset: 8000, length: 1000 }, /does not fit the local registration/],
      [{ ...ok, remoteOffset: 64 * 1024 - 10, length: 11 }, /does not fit the remote registration/],
      [{ ...ok, length: 0 }, /length 0/],
      [{ ...ok, localOffset: -1 }, /does not fit the local/],
      [{ ...ok, localOffset: 0.5 }, /does not fit the local/],
      [{ ...ok, remote: { token: new Uint8Array(16), byteLength: 99 } }, /not a decoded tcp descriptor/],
      [{ ...ok, local: {} }, /not a tcp registration/],
    ];
    for (const [bad, message] of cases) {
      const e = await outcome(exec(conn, createTransferBatch('read', [ok, { ...bad, request: 41 }])));
      expect(e).toBeInstanceOf(InvalidInputError);
      expect((e as Error).message).toMatch(message);
      if (!/tcp (registration|descriptor)/.test(message.source)) expect((e as InvalidInputError).details['request']).toBe(41);
    }
    expect(dst.every((x) => x === 0)).toBe(true);
    const batch = createTransferBatch('read', [ok]);
    const ranges = batch.ranges;
    ranges[6] = 1; // RangeField.RemoteRange: a whole registration has only range 0
    await expect(exec(conn, batch)).rejects.toThrow(/remote range 1 does not exist \(the remote has 1\)/);
    // A revoked local registration is refused on every post, also of a batch that worked before.
    const again = createTransferBatch('read', [ok]);
    await exec(conn, again);
    await a.t.revoke(local.handle);
    await expect(exec(conn, again)).rejects.toBeInstanceOf(InvalidInputError);
    await expect(exec(conn, createTransferBatch('read', []))).resolves.toBeUndefined();
    expect(conn.isOpen).toBe(true);
  });

  it('an abort mid-batch is Aborted, settles only once nothing lands any more, and the transport stays usable', async () => {
    const { a, b, conn } = await pair();
    const size = 16 * 1024 * 1024;
    const srcBuf = pattern(size, 14);
    const src = await region(b.t, a.t, srcBuf);
    const dst = new Uint8Array(size);
    const local = await region(a.t, b.t, dst);
    // Large ranges (received straight into the destination) and small ones (staged), interleaved.
    const list: TransferRangeInit[] = [];
    for (let off = 0, i = 0; off < size; i++) {
      const length = Math.min(size - off, i % 2 ? 4096 : 256 * 1024);
      list.push({ local: local.handle, localOffset: off, remote: src.remote, remoteOffset: off, length });
      off += length;
    }
    const batch = createTransferBatch('read', list);
    let aborted = 0;
    for (let round = 0; round < 8; round++) {
      dst.fill(0);
      const ac = new AbortController();
      const p = outcome(exec(conn.isOpen ? conn : (await pair()).conn, batch, { signal: ac.signal }));
      await new Promise((r) => setTimeout(r, round % 4));
      ac.abort();
      const r = await p;
      if (r === 'ok') {
        expect(Buffer.compare(dst, srcBuf)).toBe(0);
        continue;
      }
      aborted++;
      expect(r).toBeInstanceOf(TensorwireError);
      expect((r as TensorwireError).code).toBe(ErrorCode.Aborted);
      const snapshot = dst.slice();
      await new Promise((res) => setTimeout(res, 30));
      expect(Buffer.compare(dst, snapshot)).toBe(0);
    }
    expect(aborted).toBeGreaterThan(0);
    // A fresh read on the same transports works.
    const fresh = conn.isOpen ? conn : await a.t.connect(b.id, b.t.endpoint(), { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
    dst.fill(0);
    await exec(fresh, batch);
    expect(Buffer.compare(dst, srcBuf)).toBe(0);
  });

  it('a write aborted before its data left the socket closes the stream to quiesce, and reports Aborted', async () => {
    const { a, b, conn } = await pair();
    const dstBuf = new Uint8Array(8 * 1024 * 1024);
    const remote = await region(b.t, a.t, dstBuf);
    const local = await region(a.t, b.t, pattern(8 * 1024 * 1024, 15));
    const ac = new AbortController();
    const p = exec(conn, createTransferBatch('write', [{ local: local.handle, localOffset: 0, remote: remote.remote, remoteOffset: 0, length: 8 * 1024 * 1024 }]), { signal: ac.signal });
    ac.abort(); // the frame is still corked in this tick: its data is unflushed
    await expect(p).rejects.toMatchObject({ code: ErrorCode.Aborted });
    expect(conn.isOpen).toBe(false);
    // The local registration was released by the call: revoke does not wait.
    await a.t.revoke(local.handle);
  });

  it('an already-aborted signal or a passed deadline moves nothing', async () => {
    const { a, b, conn } = await pair();
    const remote = await region(b.t, a.t, pattern(4096, 16));
    const dst = new Uint8Array(4096);
    const local = await region(a.t, b.t, dst);
    const batch = createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote: remote.remote, remoteOffset: 0, length: 4096 }]);
    const ac = new AbortController();
    ac.abort();
    await expect(conn.execute(0, batch, { signal: ac.signal, deadline: Date.now() + 1000 })).rejects.toMatchObject({ code: ErrorCode.Aborted });
    await expect(conn.execute(0, batch, { signal: new AbortController().signal, deadline: Date.now() - 1 })).rejects.toMatchObject({ code: ErrorCode.TimedOut });
    await new Promise((r) => setTimeout(r, 20));
    expect(dst.every((x) => x === 0)).toBe(true);
  });

  it('the peer closing mid-batch is a connection error for every call, never partial success', async () => {
    const { a, b, conn } = await pair({ streams: 2 });
    const size = 8 * 1024 * 1024;
    const src = await region(b.t, a.t, pattern(size, 17));
    const dsts = await Promise.all(Array.from({ length: 4 }, () => region(a.t, b.t, new Uint8Array(size))));
    const batches = dsts.map((d) => createTransferBatch('read', Array.from({ length: 1024 }, (_, i) => ({ local: d.handle, localOffset: i * 8192, remote: src.remote, remoteOffset: ((i * 13) % 1024) * 8192, length: 8192 }))));
    const calls = batches.map((batch, i) => outcome(exec(conn, batch, { stream: i % 2 })));
    setImmediate(() => void b.t.close());
    const results = await Promise.all(calls);
    for (const [i, r] of results.entries()) {
      if (r === 'ok') {
        for (let k = 0; k < 1024; k++) {
          const ro = ((k * 13) % 1024) * 8192;
          expect(Buffer.compare(dsts[i]!.buffer.subarray(k * 8192, (k + 1) * 8192), src.buffer.subarray(ro, ro + 8192))).toBe(0);
        }
      } else {
        expect([ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]).toContain((r as TensorwireError).code);
      }
    }
    expect(results.some((r) => r !== 'ok')).toBe(true);
    await expect(exec(conn, batches[0]!)).rejects.toBeInstanceOf(TensorwireError);
  });
});
