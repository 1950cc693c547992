import { rmSync } from 'node:fs';
import { afterAll, describe, expect, it } from 'vitest';
import {
  addressVector,
  chooseMtu,
  chooseRdAtomic,
  chooseSgeLimits,
  grantMode,
  isIpv4MappedGid,
  isLinkLocalGid,
  lidProblem,
  mtuBytes,
  parseGidType,
  qpCountProblem,
  selectGid,
  selectPort,
  unavailableReason,
  type AvailabilityFacts,
  type PortRecord,
} from '../src/attributes.js';
import { readNumaNode, toDeviceRecord, usablePort } from '../src/capabilities.js';
import { loadFixture, writeSysfs } from './helpers.js';

const roce = loadFixture('connectx6dx-roce');
const ib = loadFixture('connectx7-ib');
const root = writeSysfs([roce, ib]);
afterAll(() => rmSync(root, { recursive: true, force: true }));

const roceDev = toDeviceRecord(roce.device, root);
const ibDev = toDeviceRecord(ib.device, root);
const rocePort = roceDev.ports[0] as PortRecord;
const ibPort = ibDev.ports[0] as PortRecord;

describe('discovery records from recorded ports', () => {
  it('reads GID types and the NUMA node from sysfs', () => {
    expect(roceDev.numaNode).toBe(1);
    expect(ibDev.numaNode).toBe(0);
    expect(rocePort.gids.map((g) => g.type)).toEqual(['IB/RoCE v1', 'RoCE v2', 'IB/RoCE v1', 'RoCE v2']);
    expect(rocePort.gids[3]?.netdev).toBe('ens1f0np0');
    expect(ibPort.gids[0]?.type).toBe('IB/RoCE v1');
    expect(roceDev.memoryWindowType2).toBe(true);
  });
  it('records max_sge (30 on both ConnectX ports) and an unreported max_sge_rd as 0', () => {
    expect([roceDev.maxSge, ibDev.maxSge]).toEqual([30, 30]);
    expect([roceDev.maxSgeRd, ibDev.maxSgeRd]).toEqual([0, 0]);
    expect(toDeviceRecord({ name: 'x', maxSge: 16, maxSgeRd: 8 }, root)).toMatchObject({ maxSge: 16, maxSgeRd: 8 });
    expect(toDeviceRecord({ name: 'x' }, root)).toMatchObject({ maxSge: 1, maxSgeRd: 0 });
  });
  it('reports no NUMA node when sysfs has none or says -1', () => {
    expect(readNumaNode('mlx5_9', root)).toBeUndefined();
  });
  it('parses sysfs GID type strings', () => {
    expect(parseGidType('RoCE v2\n')).toBe('RoCE v2');
    expect(parseGidType('IB/RoCE v1')).toBe('IB/RoCE v1');
    expect(parseGidType(undefined)).toBe('unknown');
    expect(parseGidType('something')).toBe('unknown');
  });
});

describe('GID selection', () => {
  it('prefers RoCE v2 with a routable (non-link-local) address on a ConnectX RoCE port', () => {
    const g = selectGid(rocePort);
    expect(g.ok && g.value.index).toBe(3);
    expect(g.ok && g.value.type).toBe('RoCE v2');
  });
  it('falls back to link-local RoCE v2 before any RoCE v1', () => {
    const port: PortRecord = { ...rocePort, gids: rocePort.gids.filter((g) => g.index !== 3) };
    const g = selectGid(port);
    expect(g.ok && g.value.index).toBe(1);
  });
  it('uses RoCE v1 only when no v2 GID exists, routable first', () => {
    const port: PortRecord = { ...rocePort, gids: rocePort.gids.filter((g) => g.type !== 'RoCE v2') };
    const g = selectGid(port);
    expect(g.ok && g.value.index).toBe(2);
  });
  it('uses the port GID (index 0) on InfiniBand', () => {
    const g = selectGid(ibPort);
    expect(g.ok && g.value.index).toBe(0);
  });
  it('honours an explicit index and explains a missing one', () => {
    const g = selectGid(rocePort, 1);
    expect(g.ok && g.value.index).toBe(1);
    const missing = selectGid(rocePort, 7);
    expect(missing.ok).toBe(false);
    expect(!missing.ok && missing.reason).toContain('no GID at index 7');
  });
  it('explains a port without GIDs', () => {
    const g = selectGid({ ...rocePort, gids: [] });
    expect(!g.ok && g.reason).toContain('has no GIDs');
  });
  it('classifies link-local and IPv4-mapped GIDs', () => {
    expect(isLinkLocalGid('fe80000000000000ba599ffffe3c1a2b')).toBe(true);
    expect(isLinkLocalGid('00000000000000000000ffff0a000015')).toBe(false);
    expect(isIpv4MappedGid('00000000000000000000ffff0a000015')).toBe(true);
    expect(isIpv4MappedGid('fe80000000000000ba599ffffe3c1a2b')).toBe(false);
  });
});

describe('LID rules', () => {
  it('accepts the SM-assigned LID on InfiniBand', () => {
    expect(lidProblem(ibPort.linkLayer, ibPort.lid)).toBeUndefined();
  });
  it('LID 0 on InfiniBand is an error that names the subnet manager', () => {
    expect(lidProblem(1, 0)).toMatch(/LID 0 on an InfiniBand port.*subnet manager/);
    const u = usablePort({ ...ibDev, ports: [{ ...ibPort, lid: 0 }] });
    expect(!u.ok && u.reason).toMatch(/mlx5_2 port 1: LID 0/);
  });
  it('a multicast LID is not a port LID', () => {
    expect(lidProblem(1, 0xc001)).toMatch(/multicast/);
  });
  it('treats an unspecified link layer as InfiniBand (old drivers)', () => {
    expect(lidProblem(0, 0)).toMatch(/LID 0/);
  });
  it('ignores the LID on RoCE, where it is always 0', () => {
    expect(lidProblem(rocePort.linkLayer, rocePort.lid)).toBeUndefined();
    expect(usablePort(roceDev).ok).toBe(true);
  });
});

describe('MTU, READ depth, QP count', () => {
  it('uses the smaller active MTU of both ports', () => {
    expect(chooseMtu(rocePort.activeMtu, ibPort.activeMtu)).toBe(3);
    expect(mtuBytes(chooseMtu(5, 5))).toBe(4096);
    expect(mtuBytes(3)).toBe(1024);
    expect(() => chooseMtu(0, 5)).toThrow(RangeError);
    expect(() => mtuBytes(6)).toThrow(RangeError);
  });
  it('limits outstanding READs to what both sides allow', () => {
    expect(chooseRdAtomic(roceDev.maxQpInitRdAtom, 4)).toBe(4);
    expect(chooseRdAtomic(16, 16)).toBe(16);
    expect(chooseRdAtomic(64, 64)).toBe(16);
    expect(chooseRdAtomic(0, 8)).toBe(1);
  });
  it('requires both sides to use the same number of queue pairs', () => {
    expect(qpCountProblem(2, 2, 16)).toBeUndefined();
    expect(qpCountProblem(2, 4, 16)).toMatch(/peer uses 4 queue pairs.*this node uses 2/);
    expect(qpCountProblem(2, 0, 16)).toMatch(/1\.\.16/);
    expect(qpCountProblem(2, 17, 16)).toMatch(/1\.\.16/);
  });
});

describe('SGEs per work request', () => {
  it('is the device max_sge under the cap; READ also under max_sge_rd when reported, never above the QP limit', () => {
    expect(chooseSgeLimits(roceDev.maxSge, roceDev.maxSgeRd, 64)).toEqual({ write: 30, read: 30 });
    expect(chooseSgeLimits(30, 0, 8)).toEqual({ write: 8, read: 8 });
    expect(chooseSgeLimits(30, 4, 64)).toEqual({ write: 30, read: 4 });
    expect(chooseSgeLimits(4, 30, 64)).toEqual({ write: 4, read: 4 });
    expect(chooseSgeLimits(0, 0, 64)).toEqual({ write: 1, read: 1 });
    expect(chooseSgeLimits(Number.NaN, -1, 0)).toEqual({ write: 1, read: 1 });
  });
});

describe('port selection', () => {
  it('picks the first ACTIVE port', () => {
    const dev = { ...roceDev, ports: [{ ...rocePort, port: 1, state: 1 }, { ...rocePort, port: 2 }] };
    const p = selectPort(dev);
    expect(p.ok && p.value.port).toBe(2);
  });
  it('names every port state when none is active', () => {
    const dev = { ...ibDev, ports: [{ ...ibPort, state: 2 }, { ...ibPort, port: 2, state: 1 }] };
    const p = selectPort(dev);
    expect(!p.ok && p.reason).toBe('no active port on mlx5_2: port 1 is INIT, port 2 is DOWN');
  });
  it('explains a port number the device does not have', () => {
    const p = selectPort(roceDev, 2);
    expect(!p.ok && p.reason).toBe('mlx5_0 has no port 2');
  });
});

describe('address vectors', () => {
  it('RoCE always routes globally with the chosen source GID', () => {
    const av = addressVector({
      linkLayer: 2,
      localPort: 1,
      localGidIndex: 3,
      localGid: '00000000000000000000ffff0a000015',
      remoteLid: 0,
      remoteGid: '00000000000000000000ffff0a000016',
    });
    expect(av.isGlobal).toBe(true);
    expect(av.sgidIndex).toBe(3);
    expect(av.dlid).toBe(0);
    expect(av.hopLimit).toBe(64);
    expect(Buffer.from(av.dgid).toString('hex')).toBe('00000000000000000000ffff0a000016');
  });
  it('InfiniBand routes by LID inside a subnet and adds a GRH across subnets', () => {
    const base = { linkLayer: 1, localPort: 1, localGidIndex: 0, localGid: 'fe80000000000000a088c20300456e70', remoteLid: 23 };
    const same = addressVector({ ...base, remoteGid: 'fe80000000000000a088c20300456e99' });
    expect(same.isGlobal).toBe(false);
    expect(same.dlid).toBe(23);
    const other = addressVector({ ...base, remoteGid: 'fec0000000000002a088c20300456e99' });
    expect(other.isGlobal).toBe(true);
  });
});

describe('why RDMA is unavailable', () => {
  const base: AvailabilityFacts = { built: true, sysfsPresent: true, deviceNames: ['mlx5_0'], portChoices: new Map([['mlx5_0', selectPort(roceDev)]]) };
  it('is available with an active port', () => {
    expect(unavailableReason(base)).toBeUndefined();
  });
  it('names the addon load failure first', () => {
    expect(unavailableReason({ ...base, addonError: 'addon missing' })).toBe('addon missing');
  });
  it('names a stub build', () => {
    expect(unavailableReason({ ...base, built: false, buildReason: 'built without infiniband/verbs.h' })).toBe('built without infiniband/verbs.h');
  });
  it('names a missing library with the dlopen error', () => {
    const r = unavailableReason({ ...base, libraryError: 'dlopen(libibverbs.so.1) failed: libibverbs.so.1: cannot open shared object file' });
    expect(r).toBe('libibverbs is not usable: dlopen(libibverbs.so.1) failed: libibverbs.so.1: cannot open shared object file');
  });
  it('names a kernel without RDMA support', () => {
    const r = unavailableReason({ ...base, sysfsPresent: false, deviceNames: [], deviceListError: 'ibv_get_device_list: Function not implemented (errno 38)' });
    expect(r).toMatch(/^the kernel has no RDMA support: \/sys\/class\/infiniband does not exist/);
    expect(r).toContain('errno 38');
  });
  it('names an empty device list', () => {
    expect(unavailableReason({ ...base, deviceNames: [], portChoices: new Map() })).toMatch(/^no RDMA devices/);
  });
  it('names a requested device that does not exist', () => {
    expect(unavailableReason({ ...base, requestedDevice: 'mlx5_7' })).toBe('TENSORWIRE_RDMA_DEVICE=mlx5_7 is not among the RDMA devices (mlx5_0)');
  });
  it('names ports that are not active', () => {
    const down = selectPort({ ...roceDev, ports: [{ ...rocePort, state: 1 }] });
    expect(unavailableReason({ ...base, portChoices: new Map([['mlx5_0', down]]) })).toBe('no active port: no active port on mlx5_0: port 1 is DOWN');
  });
});

describe('grantMode', () => {
  it('uses type-2 windows where the device has them unless whole-MR rkeys are asked for, and refuses windows it cannot have', () => {
    expect(grantMode('auto', true)).toMatchObject({ mode: 'memory-window' });
    expect(grantMode('auto', false)).toMatchObject({ mode: 'memory-region', reason: expect.stringMatching(/no type-2 memory windows/) });
    expect(grantMode('memory-window', true)).toMatchObject({ mode: 'memory-window' });
    expect(grantMode('memory-window', false)).toMatchObject({ error: expect.stringMatching(/does not support type-2/) });
    expect(grantMode('memory-region', true)).toMatchObject({ mode: 'memory-region' });
  });
});
