/**
 * Hardware suites: run only where an RDMA device with an active port exists
 * (TENSORWIRE_RDMA_DEVICE=mlx5_0, or any active device). Elsewhere they skip and print why.
 * Nothing here fakes a device.
 */
import { createConnection } from 'node:net';
import {
  AbortedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  TimedOutError,
  createTransferBatch,
  type TransferRangeInit,
  type TransportConnection,
} from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import { describeTransportConformance } from '@tensorwire/core/testing';
import { capabilities } from '../src/capabilities.js';
import { loadNative, type NativeCounters } from '../src/native.js';
import { RdmaTransport, type RdmaConnection, type RdmaTransportOptions } from '../src/transport.js';
import { decodeEndpoint } from '../src/wire.js';
import { describeRangeGrants } from './grant-suite.js';
import { describeWindowGrants, opts, testNodes } from './window-suite.js';

const caps = capabilities();
const skipReason = caps.available ? undefined : `no usable RDMA device: ${caps.reason ?? 'unknown'}`;
if (skipReason) console.warn(`[rdma-verbs] skipping the hardware suites: ${skipReason}`);
const device = caps.selected?.device;

// ------------------------------------------------------------ core's conformance suite
describeTransportConformance({
  name: `rdma on ${device ?? 'no device'} (loopback)`,
  createTransport: () => new RdmaTransport({ ...(device ? { device } : {}), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1' }),
  ...(skipReason ? { skip: skipReason } : {}),
});

// ------------------------------------------------------------ transport-level hardware tests

const makeTransport = (extra: Partial<RdmaTransportOptions>): RdmaTransport => new RdmaTransport({ ...(device ? { device } : {}), quiesceTimeoutMs: 30_000, ...extra });
const { node, pair, closeAll } = testNodes('rdma-hw', makeTransport);

function counters(): NativeCounters {
  return loadNative().counters();
}

describe.skipIf(skipReason !== undefined)(`rdma transport on ${device ?? 'no device'}`, () => {
  it('READ and WRITE move the right bytes on every stream', async () => {
    const { a, b, conn } = await pair(2);
    const size = 1 << 20;
    const src = new Uint8Array(size).map((_, i) => (i * 7 + 3) & 0xff);
    const dst = new Uint8Array(size);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    const half = size / 2;
    await Promise.all(
      [0, 1].map((s) => conn.execute(s, createTransferBatch('read', [{ local: lr.handle, localOffset: s * half, remote, remoteOffset: s * half, length: half }]), opts())),
    );
    expect(Buffer.compare(Buffer.from(dst), Buffer.from(src))).toBe(0);
    dst.fill(0x5a);
    await conn.execute(1, createTransferBatch('write', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: size }]), opts());
    expect(src.every((x) => x === 0x5a)).toBe(true);
    expect(b.inbound).toHaveLength(1);
    expect(conn.streams).toBe(2);
    expect(conn.initiator).toBe(a.host.identity.nodeId);
    expect(b.inbound[0]?.initiator).toBe(a.host.identity.nodeId);
  });

  it('a deadline with work on the NIC quiesces (QP→ERR, every WR flushed) before rejecting', async () => {
    const { a, b, conn } = await pair(1);
    const size = 64 << 20;
    const src = new Uint8Array(size).fill(0xab);
    const dst = new Uint8Array(size);
    const rr = await b.t.register({ kind: 'host', buffer: src });
    const lr = await a.t.register({ kind: 'host', buffer: dst });
    const remote = a.t.decodeRemote(rr.payload, 'host', size);
    // 64 ranges of 1 MiB, in reverse order so that none is back to back with the one before
    // it on the remote side: 64 work requests, several chains.
    const ranges: TransferRangeInit[] = [];
    for (let off = size - (1 << 20); off >= 0; off -= 1 << 20) ranges.push({ local: lr.handle, localOffset: off, remote, remoteOffset: off, length: 1 << 20 });
    const ac = new AbortController();
    let closedWith: unknown = 'not closed';
    conn.onClose((e) => (closedWith = e));
    const p = conn.execute(0, createTransferBatch('read', ranges), { signal: ac.signal, deadline: Date.now() + 60_000 });
    // Work requests are on the NIC now (posted synchronously); no completion has been seen by JS yet.
    expect((conn as RdmaConnection).outstanding).toBeGreaterThan(0);
    ac.abort(new TimedOutError('deadline passed'));
    const err = await p.then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(TimedOutError);
    // Settled only after every outstanding work request completed or flushed.
    expect((conn as RdmaConnection).outstanding).toBe(0);
    expect(conn.isOpen).toBe(false);
    expect(closedWith).toBeInstanceOf(ConnectionBrokenError);
    // The NIC no longer writes into the buffer: a snapshot stays equal after more event-loop turns.
    const snapshot = Buffer.from(dst);
    await new Promise((r) => setTimeout(r, 200));
    expect(Buffer.compare(snapshot, Buffer.from(dst))).toBe(0);
    // The registration can be revoked at once: nothing holds it.
    await a.t.revoke(lr.handle);
  });

  it('an abort before anything is posted rejects with Aborted and posts nothing', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 4096);
    const ac = new AbortController();
    ac.abort();
    const before = counters().postedWrs;
    await expect(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }]), { signal: ac.signal, deadline: Date.now() + 1000 })).rejects.toBeInstanceOf(
      AbortedError,
    );
    expect(counters().postedWrs).toBe(before);
    expect(conn.isOpen).toBe(true);
  });

  it('bad input is a typed error and nothing is posted', async () => {
    const { a, b, conn } = await pair(2);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 4096);
    const before = counters().postedWrs;
    const chunk = { local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 };
    await expect(conn.execute(0, createTransferBatch('read', [{ ...chunk, local: {} }]), opts())).rejects.toBeInstanceOf(InvalidInputError); // unregistered
    await expect(conn.execute(0, createTransferBatch('read', [{ ...chunk, remote: { addr: 0n } }]), opts())).rejects.toBeInstanceOf(InvalidInputError);
    await expect(conn.execute(0, createTransferBatch('read', [{ ...chunk, remoteOffset: 1 }]), opts())).rejects.toBeInstanceOf(InvalidInputError); // beyond registration
    await expect(conn.execute(0, createTransferBatch('read', [{ ...chunk, localOffset: 4095, length: 2 }]), opts())).rejects.toBeInstanceOf(InvalidInputError);
    await expect(conn.execute(5, createTransferBatch('read', [chunk]), opts())).rejects.toBeInstanceOf(InvalidInputError);
    await a.t.revoke(lr.handle);
    await expect(conn.execute(0, createTransferBatch('read', [chunk]), opts())).rejects.toBeInstanceOf(InvalidInputError); // revoked
    expect(counters().postedWrs).toBe(before);
    expect(conn.isOpen).toBe(true);
  });

  it('a revoked remote registration is RemoteRejected', async () => {
    const { a, b, conn } = await pair(1);
    const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const remote = a.t.decodeRemote(rr.payload, 'host', 4096);
    await b.t.revoke(rr.handle);
    await expect(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }]), opts())).rejects.toBeInstanceOf(
      RemoteRejectedError,
    );
  });

  it('a peer with a different queue-pair count is refused with a typed error; nothing is left behind', async () => {
    const a = await node(2);
    const b = await node(4);
    const base = counters();
    const err = await a.t.connect(b.host.identity, b.t.endpoint(), { ...opts(), streams: 2 }).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('qp-count-mismatch');
    expect(counters()).toMatchObject({ qps: base.qps, cqs: base.cqs, postedWrs: base.postedWrs });
    expect(b.inbound).toHaveLength(0);
  });

  it('malformed and truncated handshakes are refused; no queue pair is created', async () => {
    const b = await node(2);
    const base = counters();
    const ep = decodeEndpoint(b.t.endpoint());
    for (const bytes of [Buffer.from([0, 0, 0, 5, 1, 0x52, 0x56, 0x48, 1]), Buffer.from([0, 0, 0x10, 0, 1]), Buffer.from([0, 0, 0, 2, 9, 9])]) {
      const s = createConnection({ host: ep.host, port: ep.port });
      await new Promise<void>((resolve) => {
        s.on('error', () => resolve());
        s.on('close', () => resolve());
        s.on('connect', () => s.write(bytes));
      });
    }
    expect(counters()).toMatchObject({ qps: base.qps, cqs: base.cqs });
    expect(b.inbound).toHaveLength(0);
  });

  it('retire() drains, tells the peer, and both sides close cleanly', async () => {
    const { b, conn } = await pair(2);
    const inbound = b.inbound[0] as TransportConnection;
    let retired = false;
    inbound.onRetire(() => (retired = true));
    const peerClosed = new Promise<unknown>((r) => inbound.onClose(r));
    await conn.retire();
    expect(await peerClosed).toBeUndefined();
    expect(retired).toBe(true);
    expect(conn.isOpen).toBe(false);
  });

  it('churn: QPs, CQs, MRs, devices and poller threads return to their starting counts', async () => {
    const base = counters();
    for (let i = 0; i < 20; i++) {
      const { a, b, conn } = await pair(2);
      const rr = await b.t.register({ kind: 'host', buffer: new Uint8Array(65536).fill(i) });
      const lr = await a.t.register({ kind: 'host', buffer: new Uint8Array(65536) });
      const remote = a.t.decodeRemote(rr.payload, 'host', 65536);
      await conn.execute(i % 2, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteOffset: 0, length: 65536 }]), opts());
      if (i % 3 === 0) await conn.close(new ConnectionBrokenError('churn'));
      await closeAll();
      expect(counters()).toMatchObject({ devices: base.devices, pds: base.pds, mrs: base.mrs, mws: base.mws, cqs: base.cqs, qps: base.qps, channels: base.channels, threads: base.threads });
    }
  });
});

// ------------------------------------------------------------ lease-scoped grants (type-2 memory windows)

const windowSkip = skipReason ?? (caps.memoryWindows.type2Supported ? undefined : `${device ?? 'the device'} has no type-2 memory windows (grants fall back to whole-MR rkeys)`);
if (windowSkip && !skipReason) console.warn(`[rdma-verbs] skipping the memory-window suite: ${windowSkip}`);

describeWindowGrants({
  name: `memory-window grants on ${device ?? 'no device'}`,
  ...(windowSkip !== undefined ? { skip: windowSkip } : {}),
  transport: makeTransport,
  counters,
});

// ------------------------------------------------------------ range grants, both modes
for (const grants of ['memory-region', 'memory-window'] as const) {
  const skip = grants === 'memory-window' ? windowSkip : skipReason;
  if (skip !== undefined && skipReason === undefined) console.warn(`[rdma-verbs] skipping the ${grants} range-grant suite: ${skip}`);
  describeRangeGrants({
    name: `range grants on ${device ?? 'no device'}, ${grants}`,
    grants,
    ...(skip !== undefined ? { skip } : {}),
    transport: makeTransport,
    counters,
  });
}
