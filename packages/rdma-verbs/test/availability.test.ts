import { existsSync } from 'node:fs';
import { BackendUnavailableError, ClosedError, InvalidInputError, silentLogger } from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import { capabilities, isAvailable, SYSFS_INFINIBAND } from '../src/capabilities.js';
import { loadNative } from '../src/native.js';
import { RdmaTransport } from '../src/transport.js';
import { encodeGrant } from '../src/wire.js';

const caps = capabilities();
const host = { identity: { nodeId: 'node-a', incarnation: 'inc-a', hostId: 'host-a' }, logger: silentLogger, inbound: () => undefined };

if (caps.available) console.warn('[rdma-verbs] skipping the "no usable device" checks: this machine has a usable RDMA device');
describe.skipIf(caps.available)('on a machine without a usable RDMA device', () => {
  it('isAvailable() is false and capabilities() says exactly why', () => {
    expect(isAvailable()).toBe(false);
    expect(caps.available).toBe(false);
    expect(typeof caps.reason).toBe('string');
    const probe = loadNative().probe();
    if (!probe.built) {
      expect(caps.reason).toMatch(/^built without infiniband\/verbs\.h/);
    } else if (!probe.library?.loaded) {
      expect(caps.reason).toBe(`libibverbs is not usable: ${probe.library?.error ?? ''}`);
      expect(caps.reason).toMatch(/dlopen\(libibverbs\.so\.1\) failed/);
    } else if (!existsSync(SYSFS_INFINIBAND)) {
      expect(caps.kernel.sysfs).toBe(false);
      expect(caps.reason).toMatch(/^the kernel has no RDMA support: \/sys\/class\/infiniband does not exist/);
      if (probe.deviceList?.error !== undefined) expect(caps.reason).toContain(probe.deviceList.error);
    } else if ((probe.deviceList?.count ?? 0) === 0) {
      expect(caps.reason).toMatch(/^(no RDMA devices|cannot list RDMA devices)/);
    } else {
      expect(caps.reason).toMatch(/^(no active port|TENSORWIRE_RDMA_DEVICE=)/);
    }
    console.warn(`[rdma-verbs] RDMA unavailable here: ${caps.reason}`);
  });

  it('the transport refuses to start with BackendUnavailableError carrying the same reason', async () => {
    await using t = new RdmaTransport();
    const err = await t.start(host).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(BackendUnavailableError);
    expect((err as Error).message).toBe(`rdma is unavailable: ${caps.reason ?? ''}`);
    expect(loadNative().counters()).toMatchObject({ devices: 0, threads: 0 });
  });

  it('names a requested device that is missing', () => {
    const c = capabilities({ device: 'mlx5_99' });
    expect(c.available).toBe(false);
    expect(c.reason).toBeDefined();
  });
});

describe('transport without a started device', () => {
  it('validates its options', () => {
    expect(() => new RdmaTransport({ queuePairsPerPeer: 0 })).toThrow(InvalidInputError);
    expect(() => new RdmaTransport({ queuePairsPerPeer: 17 })).toThrow(InvalidInputError);
  });

  it('declares itself: v2, rdma, rank 100, remote and local, host memory, QPs = streams', () => {
    const t = new RdmaTransport({ queuePairsPerPeer: 4 });
    expect(t.specificationVersion).toBe('v2');
    expect(t.name).toBe('rdma');
    expect(t.capabilities).toMatchObject({ rank: 100, remote: true, local: true, oneSidedRead: true, oneSidedWrite: true, maxStreams: 4 });
    expect(t.capabilities.memoryKinds).toContain('host');
    // without a dma-buf exporter, CUDA memory is not offered
    expect(t.capabilities.memoryKinds).not.toContain('cuda');
  });

  it('register and connect before start fail with ClosedError; nothing is registered', async () => {
    const t = new RdmaTransport();
    await expect(t.register({ kind: 'host', buffer: new Uint8Array(16) })).rejects.toBeInstanceOf(ClosedError);
    expect(() => t.endpoint()).toThrow(ClosedError);
    expect(loadNative().counters().mrs).toBe(0);
  });

  it('decodeRemote rejects malformed payloads and envelope mismatches with InvalidInputError', () => {
    const t = new RdmaTransport();
    expect(() => t.decodeRemote(new Uint8Array([1, 2, 3]), 'host', 3)).toThrow(InvalidInputError);
    const p = encodeGrant({ grant: 'mr', addr: 0x1000n, length: 4096, rkey: 7 });
    expect(() => t.decodeRemote(p, 'host', 4095)).toThrow(InvalidInputError);
    expect(t.decodeRemote(p, 'host', 4096)).toBeDefined();
  });

  it('unreachableReason explains a malformed endpoint', () => {
    const t = new RdmaTransport();
    expect(t.unreachableReason(host.identity, new Uint8Array([0x52, 0x56]))).toMatch(/^malformed rdma endpoint/);
  });

  it('revoke refuses foreign handles', async () => {
    const t = new RdmaTransport();
    await expect(t.revoke({})).rejects.toBeInstanceOf(InvalidInputError);
  });

  it('close() and asyncDispose are idempotent', async () => {
    const t = new RdmaTransport();
    await t.close();
    await t.close();
    await t[Symbol.asyncDispose]();
    await expect(t.start(host)).rejects.toBeInstanceOf(ClosedError);
  });
});
