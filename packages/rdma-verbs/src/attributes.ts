/**
 * Attribute choices as pure functions of recorded port attributes: which port, which GID,
 * which MTU, whether a LID is usable, how many queue pairs, how many outstanding READs.
 * They take plain data (what discovery recorded) and never touch a device, so they are
 * tested on fixtures of real ConnectX ports.
 */

export const PortState = { Nop: 0, Down: 1, Init: 2, Armed: 3, Active: 4, ActiveDefer: 5 } as const;
export const LinkLayer = { Unspecified: 0, InfiniBand: 1, Ethernet: 2 } as const;

export function portStateName(state: number | undefined): string {
  switch (state) {
    case 0:
      return 'NOP';
    case 1:
      return 'DOWN';
    case 2:
      return 'INIT';
    case 3:
      return 'ARMED';
    case 4:
      return 'ACTIVE';
    case 5:
      return 'ACTIVE_DEFER';
    default:
      return `UNKNOWN(${String(state)})`;
  }
}

export type LinkLayerName = 'InfiniBand' | 'Ethernet';

/** ibv_port_attr.link_layer; IBV_LINK_LAYER_UNSPECIFIED means InfiniBand (old drivers). */
export function linkLayerName(linkLayer: number | undefined): LinkLayerName {
  return linkLayer === LinkLayer.Ethernet ? 'Ethernet' : 'InfiniBand';
}

/** ibv_mtu enum (1..5) → bytes. */
export function mtuBytes(mtu: number): number {
  if (!Number.isInteger(mtu) || mtu < 1 || mtu > 5) throw new RangeError(`ibv_mtu ${mtu} is not 1..5`);
  return 128 << mtu;
}

/** Path MTU for a connection: the smaller of both ports' active MTUs. */
export function chooseMtu(localActive: number, remoteActive: number): number {
  for (const [name, v] of [
    ['local active MTU', localActive],
    ['remote active MTU', remoteActive],
  ] as const) {
    if (!Number.isInteger(v) || v < 1 || v > 5) throw new RangeError(`${name} ${v} is not an ibv_mtu (1..5)`);
  }
  return Math.min(localActive, remoteActive);
}

/** GID type as sysfs writes it in ports/<p>/gid_attrs/types/<i>. */
export type GidType = 'IB/RoCE v1' | 'RoCE v2' | 'unknown';

export interface GidEntry {
  readonly index: number;
  /** 32 hex characters. */
  readonly gid: string;
  readonly type: GidType;
  /** The net device behind a RoCE GID (sysfs gid_attrs/ndevs/<i>), when known. */
  readonly netdev?: string;
}

/** What discovery recorded for one port (native query + sysfs). */
export interface PortRecord {
  readonly port: number;
  readonly state: number;
  readonly linkLayer: number;
  readonly lid: number;
  readonly activeMtu: number;
  readonly maxMtu: number;
  readonly gids: readonly GidEntry[];
}

export interface DeviceRecord {
  readonly name: string;
  readonly numaNode: number | undefined;
  readonly maxQpWr: number;
  /** ibv_device_attr.max_sge: SGEs per work request (RDMA WRITE). */
  readonly maxSge: number;
  /** ibv_device_attr.max_sge_rd: SGEs per RDMA READ; 0 when the provider does not say (then maxSge applies). */
  readonly maxSgeRd: number;
  readonly maxQpRdAtom: number;
  readonly maxQpInitRdAtom: number;
  readonly memoryWindowType2: boolean;
  readonly ports: readonly PortRecord[];
}

export function parseGidType(text: string | undefined): GidType {
  const t = (text ?? '').trim();
  if (t === 'RoCE v2') return 'RoCE v2';
  if (t === 'IB/RoCE v1' || t === 'RoCE v1' || t === 'IB') return 'IB/RoCE v1';
  return 'unknown';
}

/** fe80::/10 */
export function isLinkLocalGid(gid: string): boolean {
  const first = parseInt(gid.slice(0, 4), 16);
  return (first & 0xffc0) === 0xfe80;
}

/** ::ffff:a.b.c.d (a RoCE GID derived from an IPv4 address). */
export function isIpv4MappedGid(gid: string): boolean {
  return /^0{20}ffff[0-9a-f]{8}$/i.test(gid);
}

export function gidToBytes(gid: string): Uint8Array {
  if (!/^[0-9a-f]{32}$/i.test(gid)) throw new RangeError(`GID ${JSON.stringify(gid)} is not 32 hex characters`);
  return new Uint8Array(Buffer.from(gid, 'hex'));
}

export function gidFromBytes(b: Uint8Array): string {
  return Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString('hex');
}

export type Choice<T> = { readonly ok: true; readonly value: T } | { readonly ok: false; readonly reason: string };

/**
 * The GID to use on a port.
 * - InfiniBand: the port GID at index 0 (the LID does the routing inside a subnet).
 * - Ethernet (RoCE): RoCE v2 before v1 (v2 is routable and what ECN/PFC configs target),
 *   and within a type a non-link-local GID (an IP the fabric routes) before fe80::.
 *   Among equals, IPv4-mapped first (what most RoCE fabrics are addressed by), then the
 *   lowest index.
 * An explicit `gidIndex` is honoured if that entry exists.
 */
export function selectGid(port: PortRecord, gidIndex?: number): Choice<GidEntry> {
  const gids = port.gids;
  if (gidIndex !== undefined) {
    const g = gids.find((x) => x.index === gidIndex);
    return g ? { ok: true, value: g } : { ok: false, reason: `port ${port.port} has no GID at index ${gidIndex}` };
  }
  if (gids.length === 0) return { ok: false, reason: `port ${port.port} has no GIDs` };
  if (linkLayerName(port.linkLayer) === 'InfiniBand') {
    const g = gids.find((x) => x.index === 0) ?? [...gids].sort((a, b) => a.index - b.index)[0];
    return g ? { ok: true, value: g } : { ok: false, reason: `port ${port.port} has no GIDs` };
  }
  const score = (g: GidEntry): number =>
    (g.type === 'RoCE v2' ? 0 : g.type === 'IB/RoCE v1' ? 4 : 8) + (isLinkLocalGid(g.gid) ? 2 : 0) + (isIpv4MappedGid(g.gid) ? 0 : 1);
  const best = [...gids].sort((a, b) => score(a) - score(b) || a.index - b.index)[0];
  return best ? { ok: true, value: best } : { ok: false, reason: `port ${port.port} has no GIDs` };
}

/**
 * Why a LID cannot be used, or undefined. On InfiniBand the LID routes every packet: 0 means
 * the subnet manager never assigned one, and 0xC000 and above are multicast. On Ethernet
 * (RoCE) the LID is unused and always 0.
 */
export function lidProblem(linkLayer: number, lid: number): string | undefined {
  if (linkLayerName(linkLayer) !== 'InfiniBand') return undefined;
  if (!Number.isInteger(lid) || lid < 0 || lid > 0xffff) return `LID ${lid} is not a 16-bit value`;
  if (lid === 0) return 'LID 0 on an InfiniBand port: no subnet manager has assigned a LID (is opensm running on the fabric?)';
  if (lid >= 0xc000) return `LID 0x${lid.toString(16)} is a multicast LID, not a port LID`;
  return undefined;
}

/**
 * SGEs per work request: the device's `max_sge` (a provider reporting 0 or nothing counts as
 * 1), capped by `cap`, and for RDMA READ also by `max_sge_rd` when the provider reports it.
 * `write` is what a queue pair is created with (`max_send_sge`), so `read` never exceeds it.
 */
export function chooseSgeLimits(maxSge: number, maxSgeRd: number, cap: number): { readonly write: number; readonly read: number } {
  const whole = (v: number): number => (Number.isInteger(v) && v > 0 ? v : 0);
  const write = Math.max(1, Math.min(whole(maxSge) || 1, whole(cap) || 1));
  const rd = whole(maxSgeRd);
  return { write, read: rd > 0 ? Math.min(write, rd) : write };
}

/** The first ACTIVE port (or the one asked for), with a reason naming every port's state otherwise. */
export function selectPort(device: Pick<DeviceRecord, 'name' | 'ports'>, port?: number): Choice<PortRecord> {
  const candidates = port === undefined ? device.ports : device.ports.filter((p) => p.port === port);
  if (candidates.length === 0) {
    return { ok: false, reason: port === undefined ? `${device.name} has no ports` : `${device.name} has no port ${port}` };
  }
  const active = candidates.find((p) => p.state === PortState.Active || p.state === PortState.ActiveDefer);
  if (active) return { ok: true, value: active };
  const states = candidates.map((p) => `port ${p.port} is ${portStateName(p.state)}`).join(', ');
  return { ok: false, reason: `no active port on ${device.name}: ${states}` };
}

/** Queue pairs per peer per NIC: both sides must agree; 1..max. */
export function qpCountProblem(local: number, remote: number, max: number): string | undefined {
  if (!Number.isInteger(remote) || remote < 1 || remote > max) return `peer asked for ${remote} queue pairs; 1..${max} are allowed`;
  if (local !== remote) return `peer uses ${remote} queue pairs per connection, this node uses ${local}`;
  return undefined;
}

/** Outstanding RDMA READs an initiator may have: min(our initiator depth, their responder resources), at least 1, at most 16 (the IB limit encodable in the QP context on most HCAs). */
export function chooseRdAtomic(localInitiatorDepth: number, remoteResponderResources: number): number {
  return Math.max(1, Math.min(16, Math.floor(localInitiatorDepth) || 1, Math.floor(remoteResponderResources) || 1));
}

export interface AddressInputs {
  readonly linkLayer: number;
  readonly localPort: number;
  readonly localGidIndex: number;
  readonly localGid: string;
  readonly remoteLid: number;
  readonly remoteGid: string;
  readonly trafficClass?: number;
  readonly serviceLevel?: number;
}

/**
 * The address vector for RTR. RoCE always needs a GRH (global routing, hop limit 64).
 * InfiniBand routes by LID; a GRH is added only when the peer is in another subnet (its
 * GID's subnet prefix differs).
 */
export function addressVector(a: AddressInputs): {
  isGlobal: boolean;
  dlid: number;
  hopLimit: number;
  sgidIndex: number;
  trafficClass: number;
  sl: number;
  port: number;
  dgid: Uint8Array;
} {
  const ib = linkLayerName(a.linkLayer) === 'InfiniBand';
  const crossSubnet = ib && a.localGid.slice(0, 16) !== a.remoteGid.slice(0, 16);
  return {
    isGlobal: !ib || crossSubnet,
    dlid: ib ? a.remoteLid : 0,
    hopLimit: ib ? 255 : 64,
    sgidIndex: a.localGidIndex,
    trafficClass: a.trafficClass ?? 0,
    sl: a.serviceLevel ?? 0,
    port: a.localPort,
    dgid: gidToBytes(a.remoteGid),
  };
}

/** Is this a valid 24-bit PSN / QPN? */
export function isU24(v: number): boolean {
  return Number.isInteger(v) && v >= 0 && v <= 0xffffff;
}

export interface AvailabilityFacts {
  readonly addonError?: string;
  readonly built: boolean;
  readonly buildReason?: string;
  readonly libraryError?: string;
  readonly sysfsPresent: boolean;
  readonly deviceListError?: string;
  readonly deviceNames: readonly string[];
  readonly requestedDevice?: string;
  /** Per device: the port choice (or why none). */
  readonly portChoices: ReadonlyMap<string, Choice<PortRecord>>;
}

/**
 * Exactly why RDMA is unavailable here, or undefined when a usable device and port exist.
 * The order follows the stack from the bottom: addon, headers, library, kernel, devices, ports.
 */
export function unavailableReason(f: AvailabilityFacts): string | undefined {
  if (f.addonError !== undefined) return f.addonError;
  if (!f.built) return f.buildReason ?? 'the native addon was built without infiniband/verbs.h';
  if (f.libraryError !== undefined) return `libibverbs is not usable: ${f.libraryError}`;
  if (!f.sysfsPresent) {
    return (
      'the kernel has no RDMA support: /sys/class/infiniband does not exist (no RDMA driver or ib_core/ib_uverbs loaded)' +
      (f.deviceListError !== undefined ? `; ${f.deviceListError}` : '')
    );
  }
  if (f.deviceListError !== undefined) return `cannot list RDMA devices: ${f.deviceListError}`;
  if (f.deviceNames.length === 0) return 'no RDMA devices: ibv_get_device_list returned none (/sys/class/infiniband is empty)';
  const names = f.requestedDevice !== undefined ? [f.requestedDevice] : f.deviceNames;
  if (f.requestedDevice !== undefined && !f.deviceNames.includes(f.requestedDevice)) {
    return `TENSORWIRE_RDMA_DEVICE=${f.requestedDevice} is not among the RDMA devices (${f.deviceNames.join(', ')})`;
  }
  const reasons: string[] = [];
  for (const n of names) {
    const c = f.portChoices.get(n);
    if (c === undefined) reasons.push(`${n}: not queried`);
    else if (c.ok) return undefined;
    else reasons.push(c.reason);
  }
  return `no active port: ${reasons.join('; ')}`;
}

export type GrantRequest = 'auto' | 'memory-window' | 'memory-region';
export type GrantMode = 'memory-window' | 'memory-region';

/**
 * How grants are scoped on a device: type-2 memory windows bound per connection where the
 * device has them (and they are not turned off), else one MR per registration.
 */
export function grantMode(requested: GrantRequest, type2Supported: boolean): { readonly mode: GrantMode; readonly reason: string } | { readonly error: string } {
  if (requested === 'memory-region') return { mode: 'memory-region', reason: 'whole-MR rkeys were asked for (grants: memory-region)' };
  if (type2Supported) {
    return { mode: 'memory-window', reason: 'the device supports type-2 memory windows: each requester gets windows bound to its own queue pairs' };
  }
  if (requested === 'memory-window') return { error: 'grants: memory-window was asked for, but the device does not support type-2 memory windows' };
  return { mode: 'memory-region', reason: 'the device has no type-2 memory windows: each registration is its own MR, deregistered on revoke' };
}
