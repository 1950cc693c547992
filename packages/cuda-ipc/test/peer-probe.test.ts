/**
 * The same-host transport's check that its peer is alive before a batch: the presence segment
 * on every batch (one atomic load), the peer's pid (kill 0, a syscall) at most once per
 * millisecond of Date.now(); a probe that finds the peer dead breaks the connection.
 */
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import { ConnectionBrokenError, createTransferBatch, defaultHostId, silentLogger, type TransportConnection, type TransportHost } from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory } from '../src/index.js';

const BLOCK = 4096;
const pid = process.pid;
const opened: CudaIpcTransport[] = [];
afterAll(async () => {
  await Promise.all(opened.map((t) => t.close()));
});
afterEach(() => {
  vi.restoreAllMocks();
});

async function setup(tag: string): Promise<{ read: () => Promise<void>; conn: TransportConnection; dst: Uint8Array; region: Uint8Array }> {
  const hosts: TransportHost[] = ['a', 'b'].map((n) => ({ identity: { nodeId: `pp${tag}${n}${pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
  const ta = new CudaIpcTransport();
  const tb = new CudaIpcTransport();
  opened.push(ta, tb);
  await ta.start(hosts[0] as TransportHost);
  await tb.start(hosts[1] as TransportHost);
  const region = allocateSharedMemory(4 * BLOCK, `pp${tag}${pid}`);
  region.fill(7);
  const reg = await tb.register({ kind: 'host', buffer: region });
  const remote = ta.decodeRemote(reg.payload, 'host', region.byteLength);
  const dst = new Uint8Array(BLOCK);
  const local = await ta.register({ kind: 'host', buffer: dst });
  const conn = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { signal: new AbortController().signal, deadline: Date.now() + 10_000, streams: 1 });
  const read = (): Promise<void> =>
    conn.execute(0, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote, remoteOffset: 0, length: BLOCK, request: 0 }]), {
      signal: new AbortController().signal,
      deadline: Date.now() + 10_000,
    });
  return { read, conn, dst, region };
}

/** Wait until Date.now() has moved past `t`. */
async function pastMs(t: number): Promise<void> {
  while (Date.now() <= t) await new Promise((r) => setTimeout(r, 1));
}

describe('cuda-ipc peer liveness probe', () => {
  it('probes the peer pid at most once per millisecond, however many batches run', async () => {
    const { read, dst } = await setup('rate');
    await read();
    const kill = vi.spyOn(process, 'kill');
    const t0 = Date.now();
    let batches = 0;
    // Enough batches that several run in the same millisecond (each is a few µs).
    while (batches < 2000 || Date.now() - t0 < 3) {
      await read();
      batches++;
    }
    const ms = Date.now() - t0;
    const probes = kill.mock.calls.filter(([p, sig]) => p === pid && sig === 0).length;
    expect(probes).toBeGreaterThanOrEqual(1);
    expect(probes).toBeLessThanOrEqual(ms + 1);
    expect(probes).toBeLessThan(batches);
    expect(dst.every((x) => x === 7)).toBe(true);
  });

  it('a probe that finds the peer gone breaks the connection, at the next millisecond at the latest', async () => {
    const { read, conn } = await setup('dead');
    await read();
    const probed = Date.now();
    await read(); // probed alive this millisecond (or the next)
    const kill = vi.spyOn(process, 'kill').mockImplementation((p, sig) => {
      if (p === pid && sig === 0) throw Object.assign(new Error('no such process'), { code: 'ESRCH' });
      return true;
    });
    await pastMs(Math.max(probed, Date.now()));
    await expect(read()).rejects.toBeInstanceOf(ConnectionBrokenError);
    expect(kill).toHaveBeenCalled();
    expect(conn.isOpen).toBe(false);
    await expect(read()).rejects.toThrow();
  });
});
