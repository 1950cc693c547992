/**
 * Discovery and availability: what this machine has, and exactly why RDMA is unavailable
 * when it is. Combines the addon's verbs queries with sysfs (GID types, NUMA node).
 */
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import {
  parseGidType,
  selectGid,
  selectPort,
  unavailableReason,
  grantMode,
  lidProblem,
  linkLayerName,
  type Choice,
  type GrantMode,
  type DeviceRecord,
  type GidEntry,
  type PortRecord,
} from './attributes.js';
import { tryLoadNative, type NativeDeviceInfo, type NativeProbe } from './native.js';

export const SYSFS_INFINIBAND = '/sys/class/infiniband';

function readText(path: string): string | undefined {
  try {
    return readFileSync(path, 'utf8').trim();
  } catch {
    return undefined;
  }
}

/** The NIC's NUMA node from sysfs (-1 or missing → undefined). */
export function readNumaNode(device: string, root = SYSFS_INFINIBAND): number | undefined {
  const t = readText(join(root, device, 'device', 'numa_node'));
  if (t === undefined) return undefined;
  const n = Number.parseInt(t, 10);
  return Number.isInteger(n) && n >= 0 ? n : undefined;
}

export function readGidAttrs(device: string, port: number, index: number, root = SYSFS_INFINIBAND): { type: GidEntry['type']; netdev?: string } {
  const base = join(root, device, 'ports', String(port), 'gid_attrs');
  const type = parseGidType(readText(join(base, 'types', String(index))));
  const netdev = readText(join(base, 'ndevs', String(index)));
  return netdev ? { type, netdev } : { type };
}

/** A native device description plus sysfs facts, as the pure functions take it. */
export function toDeviceRecord(info: NativeDeviceInfo, root = SYSFS_INFINIBAND): DeviceRecord {
  const name = info.name ?? '?';
  const ports: PortRecord[] = [];
  for (const p of info.ports ?? []) {
    if (p.error !== undefined || p.state === undefined) continue;
    const gids: GidEntry[] = (p.gids ?? []).map((g) => ({ index: g.index, gid: g.gid, ...readGidAttrs(name, p.port, g.index, root) }));
    ports.push({
      port: p.port,
      state: p.state,
      linkLayer: p.linkLayer ?? 0,
      lid: p.lid ?? 0,
      activeMtu: p.activeMtu ?? 1,
      maxMtu: p.maxMtu ?? 1,
      gids,
    });
  }
  return {
    name,
    numaNode: readNumaNode(name, root),
    maxQpWr: info.maxQpWr ?? 0,
    maxSge: info.maxSge ?? 1,
    maxSgeRd: info.maxSgeRd ?? 0,
    maxQpRdAtom: info.maxQpRdAtom ?? 1,
    maxQpInitRdAtom: info.maxQpInitRdAtom ?? 1,
    memoryWindowType2: info.memoryWindowType2 === true,
    ports,
  };
}

/** A port is usable when it is active, has a GID, and (on InfiniBand) a valid LID. */
export function usablePort(device: DeviceRecord, port?: number, gidIndex?: number): Choice<{ port: PortRecord; gid: GidEntry }> {
  const p = selectPort(device, port);
  if (!p.ok) return p;
  const lid = lidProblem(p.value.linkLayer, p.value.lid);
  if (lid !== undefined) return { ok: false, reason: `${device.name} port ${p.value.port}: ${lid}` };
  const g = selectGid(p.value, gidIndex);
  if (!g.ok) return { ok: false, reason: `${device.name}: ${g.reason}` };
  return { ok: true, value: { port: p.value, gid: g.value } };
}

export interface RdmaCapabilities {
  readonly available: boolean;
  /** Exactly why not, when not available. */
  readonly reason?: string;
  readonly addon: { readonly loaded: boolean; readonly path?: string; readonly errors?: readonly string[] };
  /** Built against infiniband/verbs.h (false: the stub). */
  readonly built: boolean;
  readonly library: { readonly loaded: boolean; readonly error?: string };
  readonly kernel: { readonly sysfs: boolean; readonly uverbsDevices: readonly string[] };
  readonly devices: readonly DeviceRecord[];
  /** The device/port/GID the transport would use. */
  readonly selected?: {
    readonly device: string;
    readonly port: number;
    readonly linkLayer: 'InfiniBand' | 'Ethernet';
    readonly gidIndex: number;
    readonly gid: string;
    readonly gidType: GidEntry['type'];
    readonly numaNode: number | undefined;
  };
  /** ibv_reg_dmabuf_mr is exported: CUDA memory can be registered through a dma-buf fd. */
  readonly dmabuf: boolean;
  /**
   * Type-2 memory windows on the selected device, and the grants a transport with the default
   * `grants: 'auto'` uses there: `memory-window` (windows bound to each requester's queue
   * pairs) or `memory-region` (whole-MR rkeys). See README "Grants".
   */
  readonly memoryWindows: { readonly type2Supported: boolean; readonly grants: GrantMode; readonly note: string };
  /**
   * Fork safety of libibverbs in this process (undefined when it did not load): `unneeded`
   * (the kernel copies DMA pages on fork), `enabled` (ibv_fork_init), `disabled`
   * (TENSORWIRE_RDMA_FORK_INIT=0) or `failed`. See README "Fork safety".
   */
  readonly fork?: { readonly status: 'unneeded' | 'enabled' | 'disabled' | 'failed'; readonly error?: string };
}

export interface CapabilityOptions {
  /** Device to use; default TENSORWIRE_RDMA_DEVICE, else the first with an active port. */
  readonly device?: string;
  readonly port?: number;
  readonly gidIndex?: number;
  /** sysfs root (tests). */
  readonly sysfsRoot?: string;
}

function listUverbs(): string[] {
  try {
    return readdirSync('/dev/infiniband').filter((n) => n.startsWith('uverbs'));
  } catch {
    return [];
  }
}

/** Everything this machine offers for RDMA, and why not when it offers nothing usable. */
export function capabilities(options: CapabilityOptions = {}): RdmaCapabilities {
  const root = options.sysfsRoot ?? SYSFS_INFINIBAND;
  const requested = options.device ?? (process.env['TENSORWIRE_RDMA_DEVICE'] || undefined);
  const sysfs = existsSync(root);
  const kernel = { sysfs, uverbsDevices: listUverbs() };
  const load = tryLoadNative();
  const windows = (type2Supported: boolean): RdmaCapabilities['memoryWindows'] => {
    const m = grantMode('auto', type2Supported) as { mode: GrantMode; reason: string };
    return { type2Supported, grants: m.mode, note: m.reason };
  };
  if (!('addon' in load)) {
    const reason = `the native addon could not be loaded: ${load.errors.join('; ')}`;
    return {
      available: false,
      reason,
      addon: { loaded: false, errors: load.errors },
      built: false,
      library: { loaded: false },
      kernel,
      devices: [],
      dmabuf: false,
      memoryWindows: windows(false),
    };
  }
  const probe: NativeProbe = load.addon.probe();
  const devices: DeviceRecord[] = [];
  const choices = new Map<string, Choice<PortRecord>>();
  const usable = new Map<string, ReturnType<typeof usablePort>>();
  let listError = probe.deviceList?.ok === false ? probe.deviceList.error : undefined;
  if (probe.built && probe.library?.loaded === true && probe.deviceList?.ok === true && probe.deviceList.count > 0) {
    try {
      for (const info of load.addon.listDevices()) {
        if (info.error !== undefined) {
          choices.set(info.name ?? '?', { ok: false, reason: `${info.name ?? '?'}: ${info.error}` });
          continue;
        }
        const rec = toDeviceRecord(info, root);
        devices.push(rec);
        const u = usablePort(rec, options.port, options.gidIndex);
        usable.set(rec.name, u);
        choices.set(rec.name, u.ok ? { ok: true, value: u.value.port } : u);
      }
    } catch (e) {
      listError = e instanceof Error ? e.message : String(e);
    }
  }
  const reason = unavailableReason({
    built: probe.built,
    ...(probe.buildReason !== undefined ? { buildReason: probe.buildReason } : {}),
    ...(probe.library?.error !== undefined ? { libraryError: probe.library.error } : {}),
    sysfsPresent: sysfs,
    ...(listError !== undefined ? { deviceListError: listError } : {}),
    deviceNames: probe.deviceList?.names ?? [],
    ...(requested !== undefined ? { requestedDevice: requested } : {}),
    portChoices: choices,
  });
  let selected: RdmaCapabilities['selected'];
  if (reason === undefined) {
    const order = requested !== undefined ? devices.filter((d) => d.name === requested) : devices;
    for (const d of order) {
      const u = usable.get(d.name);
      if (u?.ok) {
        selected = {
          device: d.name,
          port: u.value.port.port,
          linkLayer: linkLayerName(u.value.port.linkLayer),
          gidIndex: u.value.gid.index,
          gid: u.value.gid.gid,
          gidType: u.value.gid.type,
          numaNode: d.numaNode,
        };
        break;
      }
    }
  }
  const selDev = devices.find((d) => d.name === selected?.device);
  return {
    available: reason === undefined && selected !== undefined,
    ...(reason !== undefined ? { reason } : {}),
    addon: { loaded: true, path: load.path },
    built: probe.built,
    library: { loaded: probe.library?.loaded === true, ...(probe.library?.error !== undefined ? { error: probe.library.error } : {}) },
    kernel,
    devices,
    ...(selected !== undefined ? { selected } : {}),
    dmabuf: probe.dmabuf,
    memoryWindows: windows(selDev?.memoryWindowType2 === true),
    ...(probe.fork !== undefined ? { fork: probe.fork } : {}),
  };
}

/** True when a device with an active, usable port exists. `capabilities().reason` says why not. */
export function isAvailable(options: CapabilityOptions = {}): boolean {
  return capabilities(options).available;
}
