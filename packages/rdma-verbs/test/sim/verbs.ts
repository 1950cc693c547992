/**
 * Simulated verbs: an in-process model of RC queue pairs, memory regions and type-2 memory
 * windows behind the addon's `NativeAddon`/`NativeDevice` interface, so the transport's own
 * TypeScript (handshake, posting and credits, completion routing, quiesce, window binds,
 * revocation) runs here over real control sockets.
 *
 * It models what the transport relies on, after the verbs semantics: work requests on a QP
 * execute in order; a READ/WRITE scatters/gathers its SGE list (at most the QP's
 * max_send_sge, itself at most the device's max_sge) against one contiguous remote range; only
 * signaled requests complete when they succeed, while a failed request completes in error
 * whether signaled or not, moves the QP to ERR, and every later one completes with a flush error
 * (signaled or not); moving a QP to ERR flushes what has not executed; send-queue slots are
 * freed only when a completion is polled, and that retires every earlier request on the QP too
 * (unsignaled ones hold their slots until then; a post past max_send_wr fails with ENOMEM at
 * the first request that does not fit, the ones before it posted); destroying a QP drops its
 * pending completions; an rkey is checked at the responder (an MR's on any QP, a type-2
 * window's only on the QP it was bound to); an MR with windows bound to it cannot be
 * deregistered; a request whose local MR was deregistered fails with a protection error. It
 * proves nothing about libibverbs or a NIC: the hardware suites do that.
 */
import {
  SGE_STRIDE,
  SgeField,
  WR_STRIDE,
  WrField,
  type CompletionListener,
  type NativeAddon,
  type NativeCounters,
  type NativeDevice,
  type NativeDeviceInfo,
  type NativeMr,
  type NativeMw,
  type NativeProbe,
  type NativeQp,
  type PostResult,
} from '../../src/native.js';
import type { RdmaBackend } from '../../src/transport.js';
import { grantMode } from '../../src/attributes.js';

const ACCESS = { LocalWrite: 1, RemoteWrite: 2, RemoteRead: 4, MwBind: 16 };
/** ibv_wc_status values the simulator produces (and tests may inject). */
export const WC = { Success: 0, LocLenErr: 1, LocProtErr: 4, WrFlushErr: 5, RemAccessErr: 10, RemOpErr: 11, RetryExcErr: 12 } as const;
const OPCODE = { RdmaWrite: 1, RdmaRead: 2, BindMw: 5 };

function fail(code: string, message: string): never {
  throw Object.assign(new Error(message), { code });
}

interface SimMr {
  readonly id: number;
  readonly buf: Uint8Array;
  readonly addr: bigint;
  readonly length: number;
  readonly rkey: number;
  readonly access: number;
}

interface SimMw {
  readonly id: number;
  rkey: number;
  bound: { readonly mr: SimMr; readonly addr: bigint; readonly length: number; readonly access: number; readonly qpn: number } | undefined;
}

interface SimSge {
  readonly mr: SimMr;
  readonly off: number;
  readonly len: number;
}

type Work =
  | {
      readonly kind: 'rdma';
      /** Position in the QP's send queue (post order). */
      readonly seq: number;
      readonly signaled: boolean;
      readonly op: 0 | 1;
      readonly wrId: number;
      readonly sges: readonly SimSge[];
      readonly raddr: bigint;
      readonly rkey: number;
      readonly len: number;
    }
  | {
      readonly kind: 'bind';
      readonly seq: number;
      readonly signaled: true;
      readonly wrId: number;
      readonly mw: SimMw;
      readonly mr: SimMr;
      readonly off: number;
      readonly len: number;
      readonly access: number;
      readonly rkey: number;
    };

interface SimQp {
  readonly id: number;
  readonly qpn: number;
  readonly dev: SimDevice;
  readonly cqId: number;
  readonly maxSendWr: number;
  readonly maxSendSge: number;
  state: 'RESET' | 'INIT' | 'RTR' | 'RTS' | 'ERR';
  destQpn: number;
  access: number;
  readonly work: Work[];
  running: boolean;
  /** Work requests posted so far; `posted - retired` hold send-queue slots. */
  posted: number;
  /** Every request before this sequence number has been retired by a polled completion. */
  retired: number;
}

/** One successful post() call, as recorded while `SimFabric.recordPosts` is set. */
export interface PostRecord {
  readonly qpn: number;
  /** SGE count of each work request of the chain. */
  readonly sges: readonly number[];
  /** Bytes of each work request. */
  readonly bytes: readonly number[];
  /** Send-queue slots held on the QP right after the post. */
  readonly slotsHeld: number;
}

export interface SimFabricOptions {
  /** ibv_device_attr.max_sge. Default 30 (ConnectX). */
  readonly maxSge?: number;
  /** ibv_device_attr.max_sge_rd. Default 0 (not reported: max_sge applies). */
  readonly maxSgeRd?: number;
  /** ibv_device_attr.max_qp_wr. Default 256. */
  readonly maxQpWr?: number;
  /** Address of the first registration (each next one follows, page aligned). Default 0x7f0000000000. */
  readonly firstAddress?: bigint;
}

/** A test knob: while closed, what passes it is held, and runs in order when it opens. */
export class Gate {
  #closed = false;
  readonly #held: (() => void)[] = [];
  get isClosed(): boolean {
    return this.#closed;
  }
  close(): void {
    this.#closed = true;
  }
  open(): void {
    this.#closed = false;
    for (const f of this.#held.splice(0)) f();
  }
  /** @internal */
  hold(f: () => void): void {
    this.#held.push(f);
  }
}

/** The shared "subnet": QPs by number, address and key spaces, counters, and test knobs. */
export class SimFabric {
  readonly qps = new Map<number, SimQp>();
  readonly limits: { readonly maxSge: number; readonly maxSgeRd: number; readonly maxQpWr: number };
  readonly counters = { devices: 0, pds: 0, mrs: 0, mws: 0, cqs: 0, qps: 0, channels: 0, threads: 0, postedWrs: 0, completions: 0 };
  /** Closed: window binds wait (to test revoke or close while a bind is on the "NIC"). */
  readonly bindGate = new Gate();
  /** Closed: work executes but its completions are not delivered yet. */
  readonly completionGate = new Gate();
  /** Closed: READs and WRITEs stay posted on their queue pair without executing (work on the "NIC"). */
  readonly executionGate = new Gate();
  nextQpn = 0x100;
  nextAddr = 0x7f0000000000n;
  nextKey = 0x1000;
  /** Binds posted so far (BIND_MW work requests). */
  binds = 0;
  /** READs and WRITEs executed so far (successful or not). */
  executed = 0;
  /** post() calls that posted at least one work request (chains). */
  posts = 0;
  /** post() calls refused in whole or part with ENOMEM because the send queue was full (not injected ones). */
  postsRefused = 0;
  /** Most send-queue slots any QP held at once (data and binds). */
  peakSlotsHeld = 0;
  /** Set to record every post() in `postLog`. */
  recordPosts = false;
  readonly postLog: PostRecord[] = [];
  /** Fault injection: the RDMA request executed when `executed` reaches `at` fails with `status`. */
  #fault: { at: number; status: number } | undefined;
  /** Fault injection: post() calls to let through before one is refused with `errno`. */
  #postFault: { skip: number; errno: number } | undefined;

  constructor(options: SimFabricOptions = {}) {
    this.limits = { maxSge: options.maxSge ?? 30, maxSgeRd: options.maxSgeRd ?? 0, maxQpWr: options.maxQpWr ?? 256 };
    if (options.firstAddress !== undefined) this.nextAddr = options.firstAddress;
  }

  /** Make the `n`th READ/WRITE executed from now on (0: the next one) fail with `status`. */
  failExecution(n: number, status: number = WC.RemOpErr): void {
    this.#fault = { at: this.executed + n, status };
  }

  /**
   * Make the `n`th post() from now on (0: the next one) post nothing and return `errno`
   * (ENOMEM 12 or EAGAIN 11: what a provider says when its send queue is full).
   */
  failPost(n: number, errno = 12): void {
    this.#postFault = { skip: n, errno };
  }

  /** @internal the errno to refuse this post() with, if any. */
  takePostFault(): number | undefined {
    const f = this.#postFault;
    if (f === undefined) return undefined;
    if (f.skip > 0) {
      f.skip--;
      return undefined;
    }
    this.#postFault = undefined;
    return f.errno;
  }

  /** @internal the injected failure for the request being executed now, if any. */
  takeFault(): number | undefined {
    if (this.#fault === undefined || this.#fault.at !== this.executed) return undefined;
    const s = this.#fault.status;
    this.#fault = undefined;
    return s;
  }

  backend(memoryWindows = true): RdmaBackend {
    return simulatedBackend(this, memoryWindows);
  }
}

function simulatedBackend(fabric: SimFabric, memoryWindows: boolean): RdmaBackend {
  const record = {
    name: 'sim0',
    numaNode: undefined,
    maxQpWr: fabric.limits.maxQpWr,
    maxSge: fabric.limits.maxSge,
    maxSgeRd: fabric.limits.maxSgeRd,
    maxQpRdAtom: 16,
    maxQpInitRdAtom: 16,
    memoryWindowType2: memoryWindows,
    ports: [
      {
        port: 1,
        state: 4,
        linkLayer: 2,
        lid: 0,
        activeMtu: 5,
        maxMtu: 5,
        gids: [{ index: 1, gid: '00000000000000000000ffff7f000001', type: 'RoCE v2' as const }],
      },
    ],
  };
  class Device extends SimDevice {
    constructor(name: string, onCompletions: CompletionListener) {
      super(fabric, name, onCompletions);
    }
  }
  const native: NativeAddon = {
    builtWithVerbs: true,
    napiVersion: 8,
    probe: (): NativeProbe => ({ built: true, library: { loaded: true }, dmabuf: false, fork: { status: 'unneeded' }, deviceList: { ok: true, count: 1, names: ['sim0'] } }),
    counters: (): NativeCounters => ({ ...fabric.counters }),
    listDevices: (): NativeDeviceInfo[] => [{ name: 'sim0' }],
    wcStatusString: (s: number) =>
      ({
        0: 'success',
        1: 'local length error',
        4: 'local protection error',
        5: 'Work Request Flushed Error',
        10: 'remote access error',
        11: 'remote operation error',
        12: 'transport retry counter exceeded',
      })[s] ?? `status ${s}`,
    Device,
  };
  const m = grantMode('auto', memoryWindows) as { mode: 'memory-window' | 'memory-region'; reason: string };
  return {
    native,
    capabilities: {
      available: true,
      addon: { loaded: true, path: 'simulated verbs' },
      built: true,
      library: { loaded: true },
      kernel: { sysfs: false, uverbsDevices: [] },
      devices: [record],
      selected: { device: 'sim0', port: 1, linkLayer: 'Ethernet', gidIndex: 1, gid: '00000000000000000000ffff7f000001', gidType: 'RoCE v2', numaNode: undefined },
      dmabuf: false,
      memoryWindows: { type2Supported: memoryWindows, grants: m.mode, note: m.reason },
    },
  };
}

export class SimDevice implements NativeDevice {
  readonly name: string;
  readonly #fabric: SimFabric;
  readonly #deliver: CompletionListener;
  readonly #mrs = new Map<number, SimMr>();
  readonly #mws = new Map<number, SimMw>();
  readonly #cqs = new Set<number>();
  readonly #qps = new Map<number, SimQp>();
  #nextId = 1;
  #open = true;
  #batch: number[] = [];

  constructor(fabric: SimFabric, name: string, onCompletions: CompletionListener) {
    if (name !== 'sim0') fail('TW_BACKEND_UNAVAILABLE', `no simulated device ${name}`);
    this.#fabric = fabric;
    this.name = name;
    this.#deliver = onCompletions;
    fabric.counters.devices++;
    fabric.counters.pds++;
    fabric.counters.threads++;
    fabric.counters.channels++;
  }

  get isOpen(): boolean {
    return this.#open;
  }

  #check(): void {
    if (!this.#open) fail('TW_CLOSED', 'device is closed');
  }

  info(): NativeDeviceInfo {
    const l = this.#fabric.limits;
    return { name: this.name, memoryWindowType2: true, maxQpWr: l.maxQpWr, maxSge: l.maxSge, maxSgeRd: l.maxSgeRd };
  }

  regHost(view: Uint8Array, access: number): NativeMr {
    this.#check();
    if (view.byteLength === 0) fail('TW_INVALID_INPUT', 'cannot register an empty buffer');
    const f = this.#fabric;
    const mr: SimMr = { id: this.#nextId++, buf: view, addr: f.nextAddr, length: view.byteLength, rkey: f.nextKey++, access };
    f.nextAddr += BigInt(Math.ceil(view.byteLength / 4096) * 4096 + 4096);
    this.#mrs.set(mr.id, mr);
    f.counters.mrs++;
    return { id: mr.id, lkey: mr.rkey, rkey: mr.rkey, addr: mr.addr, length: mr.length };
  }

  regDmabuf(): NativeMr {
    return fail('TW_BACKEND_UNAVAILABLE', 'simulated verbs have no dma-buf');
  }

  deregMr(id: number): boolean {
    if (!this.#open) return false;
    const mr = this.#mrs.get(id);
    if (!mr) return false;
    for (const w of this.#mws.values()) if (w.bound?.mr === mr) fail('TW_BACKEND_UNAVAILABLE', 'ibv_dereg_mr: Device or resource busy (errno 16): windows are bound to it');
    this.#mrs.delete(id);
    this.#fabric.counters.mrs--;
    return true;
  }

  createCq(): number {
    this.#check();
    const id = this.#nextId++;
    this.#cqs.add(id);
    this.#fabric.counters.cqs++;
    return id;
  }

  destroyCq(id: number): boolean {
    if (!this.#open || !this.#cqs.has(id)) return false;
    for (const q of this.#qps.values()) if (q.cqId === id) fail('TW_INVALID_INPUT', 'destroy the queue pairs on a CQ before the CQ');
    this.#cqs.delete(id);
    this.#fabric.counters.cqs--;
    return true;
  }

  createQp(cqId: number, maxSendWr: number, maxSendSge = 1): NativeQp {
    this.#check();
    if (!this.#cqs.has(cqId)) fail('TW_INVALID_INPUT', `unknown CQ id ${cqId}`);
    const l = this.#fabric.limits;
    // ibv_create_qp refuses capacities beyond the device's (EINVAL); the addon reports it so.
    if (maxSendWr < 1 || maxSendWr > l.maxQpWr || maxSendSge < 1 || maxSendSge > l.maxSge) fail('TW_RESOURCE_EXHAUSTED', 'ibv_create_qp: Invalid argument (errno 22)');
    const qp: SimQp = {
      id: this.#nextId++,
      qpn: this.#fabric.nextQpn++,
      dev: this,
      cqId,
      maxSendWr,
      maxSendSge,
      state: 'RESET',
      destQpn: -1,
      access: 0,
      work: [],
      running: false,
      posted: 0,
      retired: 0,
    };
    this.#qps.set(qp.id, qp);
    this.#fabric.qps.set(qp.qpn, qp);
    this.#fabric.counters.qps++;
    return { id: qp.id, qpn: qp.qpn, maxSendWr, maxSendSge };
  }

  #qp(id: number): SimQp {
    this.#check();
    const q = this.#qps.get(id);
    if (!q) return fail('TW_INVALID_INPUT', `unknown QP id ${id}`);
    return q;
  }

  destroyQp(id: number): boolean {
    if (!this.#open) return false;
    const q = this.#qps.get(id);
    if (!q) return false;
    q.state = 'ERR';
    q.work.length = 0; // pending completions of a destroyed QP are never delivered
    this.#qps.delete(id);
    this.#fabric.qps.delete(q.qpn);
    this.#fabric.counters.qps--;
    return true;
  }

  qpInit(id: number, _port: number, access: number): void {
    const q = this.#qp(id);
    q.state = 'INIT';
    q.access = access;
  }

  qpRtr(id: number, attrs: { destQpn: number }): void {
    const q = this.#qp(id);
    if (q.state !== 'INIT') fail('TW_CONNECTION_BROKEN', 'ibv_modify_qp(RTR): Invalid argument (errno 22)');
    q.destQpn = attrs.destQpn;
    q.state = 'RTR';
  }

  qpRts(id: number): void {
    const q = this.#qp(id);
    if (q.state !== 'RTR') fail('TW_CONNECTION_BROKEN', 'ibv_modify_qp(RTS): Invalid argument (errno 22)');
    q.state = 'RTS';
  }

  qpError(id: number): void {
    this.#qp(id).state = 'ERR';
  }

  /** Validates like the addon, then queues the chain; see NativeDevice.post. */
  post(qpId: number, wrs: Float64Array, sges: Float64Array, rkeys: Uint32Array, firstWr: number, count: number, wrIdBase: number): PostResult {
    const q = this.#qp(qpId);
    if (!(wrs instanceof Float64Array) || !(sges instanceof Float64Array) || !(rkeys instanceof Uint32Array)) fail('TW_INVALID_INPUT', 'post(qpId, wrs, sges, rkeys, firstWr, count, wrIdBase)');
    const uint = (v: number, max: number): boolean => Number.isInteger(v) && v >= 0 && v <= max;
    const wrTotal = Math.floor(wrs.length / WR_STRIDE);
    const sgeTotal = Math.floor(sges.length / SGE_STRIDE);
    if (!uint(firstWr, wrTotal) || !uint(count, wrTotal - firstWr) || count === 0) fail('TW_INVALID_INPUT', 'work requests out of range');
    if (count > q.maxSendWr) fail('TW_RESOURCE_EXHAUSTED', 'chain longer than the send queue');
    if (!uint(wrIdBase, 2 ** 53 - count)) fail('TW_INVALID_INPUT', 'wrIdBase + count must stay below 2^53');
    const items: Work[] = [];
    for (let i = 0; i < count; i++) {
      const at = (firstWr + i) * WR_STRIDE;
      const op = wrs[at + WrField.Op] as number;
      const hi = wrs[at + WrField.RemoteHi] as number;
      const lo = wrs[at + WrField.RemoteLo] as number;
      const rk = wrs[at + WrField.Rkey] as number;
      const s0 = wrs[at + WrField.FirstSge] as number;
      const ns = wrs[at + WrField.SgeCount] as number;
      if (!uint(op, 1)) fail('TW_INVALID_INPUT', 'unknown op');
      if (!uint(hi, 0xffffffff) || !uint(lo, 0xffffffff)) fail('TW_INVALID_INPUT', 'bad remote address');
      if (!uint(rk, rkeys.length - 1)) fail('TW_INVALID_INPUT', 'rkey index out of range');
      if (!uint(ns, q.maxSendSge) || ns === 0) fail('TW_INVALID_INPUT', `a work request needs 1..${q.maxSendSge} SGEs`);
      if (!uint(s0, sgeTotal) || ns > sgeTotal - s0) fail('TW_INVALID_INPUT', 'SGEs out of range');
      const list: SimSge[] = [];
      let len = 0;
      for (let k = 0; k < ns; k++) {
        const e = (s0 + k) * SGE_STRIDE;
        const mr = this.#mrs.get(sges[e + SgeField.Mr] as number);
        if (!mr) return fail('TW_INVALID_INPUT', 'local memory is not registered (or was revoked)');
        const off = sges[e + SgeField.Offset] as number;
        const l = sges[e + SgeField.Length] as number;
        if (!uint(off, Number.MAX_SAFE_INTEGER) || !uint(l, 2 ** 31) || l === 0 || off + l > mr.length) fail('TW_INVALID_INPUT', 'local range is outside its registration');
        list.push({ mr, off, len: l });
        len += l;
      }
      if (len > 2 ** 31) fail('TW_INVALID_INPUT', 'a work request moves at most 2 GiB');
      items.push({
        kind: 'rdma',
        seq: 0,
        signaled: i === count - 1,
        op: op === 0 ? 0 : 1,
        wrId: wrIdBase + i,
        sges: list,
        raddr: (BigInt(hi) << 32n) | BigInt(lo),
        rkey: rkeys[rk] as number,
        len,
      });
    }
    const refused = this.#fabric.takePostFault();
    if (refused !== undefined) {
      return { posted: 0, errno: refused, error: `ibv_post_send: injected failure (errno ${refused})` };
    }
    // Like a provider: every request takes a slot; the first that does not fit fails the post
    // (ENOMEM) and those before it stay posted.
    const room = q.maxSendWr - (q.posted - q.retired);
    const posted = Math.max(0, Math.min(room, items.length));
    for (let i = 0; i < posted; i++) q.work.push({ ...(items[i] as Work & { kind: 'rdma' }), seq: q.posted++ });
    const f = this.#fabric;
    f.counters.postedWrs += posted;
    f.peakSlotsHeld = Math.max(f.peakSlotsHeld, q.posted - q.retired);
    if (posted > 0) f.posts++;
    if (posted < items.length) f.postsRefused++;
    if (f.recordPosts && posted > 0) {
      const mine = items.slice(0, posted) as (Work & { kind: 'rdma' })[];
      f.postLog.push({ qpn: q.qpn, sges: mine.map((w) => w.sges.length), bytes: mine.map((w) => w.len), slotsHeld: q.posted - q.retired });
    }
    this.#run(q);
    return posted === items.length ? { posted, errno: 0 } : { posted, errno: 12, error: 'ibv_post_send: Cannot allocate memory (errno 12)' };
  }

  allocMw(): NativeMw {
    this.#check();
    const mw: SimMw = { id: this.#nextId++, rkey: this.#fabric.nextKey++ << 8, bound: undefined };
    this.#mws.set(mw.id, mw);
    this.#fabric.counters.mws++;
    return { id: mw.id, rkey: mw.rkey };
  }

  bindMw(qpId: number, mwId: number, mrId: number, offset: number, length: number, access: number, wrId: bigint): { posted: boolean; rkey: number; errno: number; error?: string } {
    const q = this.#qp(qpId);
    const mw = this.#mws.get(mwId);
    if (!mw) return fail('TW_INVALID_INPUT', `unknown MW id ${mwId}`);
    const mr = this.#mrs.get(mrId);
    if (!mr) return fail('TW_INVALID_INPUT', `unknown MR id ${mrId}`);
    if ((mr.access & ACCESS.MwBind) === 0) fail('TW_INVALID_INPUT', `MR ${mrId} was not registered with MwBind access`);
    if (length <= 0 || offset + length > mr.length) fail('TW_INVALID_INPUT', 'window range is outside its registration');
    if (q.posted - q.retired >= q.maxSendWr) return { posted: false, rkey: mw.rkey, errno: 12, error: 'ibv_post_send(BIND_MW): Cannot allocate memory (errno 12)' };
    const rkey = (mw.rkey & ~0xff) | ((mw.rkey + 1) & 0xff);
    q.work.push({ kind: 'bind', seq: q.posted++, signaled: true, wrId: Number(wrId), mw, mr, off: offset, len: length, access, rkey });
    mw.rkey = rkey;
    this.#fabric.counters.postedWrs++;
    this.#fabric.peakSlotsHeld = Math.max(this.#fabric.peakSlotsHeld, q.posted - q.retired);
    this.#fabric.binds++;
    this.#run(q);
    return { posted: true, rkey, errno: 0 };
  }

  deallocMw(id: number): boolean {
    if (!this.#open) return false;
    if (!this.#mws.delete(id)) return false;
    this.#fabric.counters.mws--;
    return true;
  }

  /** The responder's check of an incoming request that arrived on QP `qpn`. */
  resolve(rkey: number, addr: bigint, len: number, need: number, qpn: number): { buf: Uint8Array; off: number } | undefined {
    const inRange = (base: bigint, size: number): boolean => addr >= base && addr + BigInt(len) <= base + BigInt(size);
    for (const mr of this.#mrs.values()) {
      if (mr.rkey === rkey && (mr.access & need) === need && inRange(mr.addr, mr.length)) return { buf: mr.buf, off: Number(addr - mr.addr) };
    }
    for (const mw of this.#mws.values()) {
      const b = mw.bound;
      if (b && mw.rkey === rkey && b.qpn === qpn && (b.access & need) === need && inRange(b.addr, b.length)) return { buf: b.mr.buf, off: Number(addr - b.mr.addr) };
    }
    return undefined;
  }

  /** Execute a QP's work in order, one request per macrotask, like a (slow) NIC. */
  #run(q: SimQp): void {
    if (q.running) return;
    q.running = true;
    const step = (): void => {
      const w = q.work[0];
      if (!w || !this.#qps.has(q.id)) {
        q.running = false;
        return;
      }
      if (w.kind === 'bind' && this.#fabric.bindGate.isClosed && q.state !== 'ERR') {
        this.#fabric.bindGate.hold(() => setImmediate(step));
        return;
      }
      if (w.kind === 'rdma' && this.#fabric.executionGate.isClosed && q.state !== 'ERR') {
        this.#fabric.executionGate.hold(() => setImmediate(step));
        return;
      }
      q.work.shift();
      this.#execute(q, w);
      setImmediate(step);
    };
    setImmediate(step);
  }

  #execute(q: SimQp, w: Work): void {
    const opcode = w.kind === 'bind' ? OPCODE.BindMw : w.op === 0 ? OPCODE.RdmaRead : OPCODE.RdmaWrite;
    // In ERR every request flushes, and a flush always completes, signaled or not.
    if (q.state === 'ERR') return this.#complete(q, w, WC.WrFlushErr, opcode);
    if (w.kind === 'bind') {
      if (!this.#mws.has(w.mw.id) || !this.#mrs.has(w.mr.id)) {
        q.state = 'ERR';
        return this.#complete(q, w, WC.LocProtErr, opcode);
      }
      w.mw.bound = { mr: w.mr, addr: w.mr.addr + BigInt(w.off), length: w.len, access: w.access, qpn: q.qpn };
      return this.#complete(q, w, WC.Success, opcode);
    }
    const peer = this.#fabric.qps.get(q.destQpn);
    if (!peer || (peer.state !== 'RTR' && peer.state !== 'RTS') || peer.destQpn !== q.qpn) {
      q.state = 'ERR';
      return this.#complete(q, w, WC.RetryExcErr, opcode);
    }
    const injected = this.#fabric.takeFault();
    this.#fabric.executed++;
    if (injected !== undefined) {
      q.state = 'ERR';
      return this.#complete(q, w, injected, opcode);
    }
    // The local side: every SGE's MR must still be registered (deregistering memory the NIC
    // still uses is the transport's bug; a NIC would fail it with a protection error).
    for (const e of w.sges) {
      if (!this.#mrs.has(e.mr.id)) {
        q.state = 'ERR';
        return this.#complete(q, w, WC.LocProtErr, opcode);
      }
    }
    const need = w.op === 0 ? ACCESS.RemoteRead : ACCESS.RemoteWrite;
    const target = (peer.access & need) === need ? peer.dev.resolve(w.rkey, w.raddr, w.len, need, peer.qpn) : undefined;
    if (!target) {
      // An access violation takes both ends to ERR (the responder raises IBV_EVENT_QP_ACCESS_ERR).
      q.state = 'ERR';
      peer.state = 'ERR';
      return this.#complete(q, w, WC.RemAccessErr, opcode);
    }
    // One contiguous remote range, scattered into (READ) or gathered from (WRITE) the SGEs in order.
    let at = target.off;
    for (const e of w.sges) {
      const local = e.mr.buf.subarray(e.off, e.off + e.len);
      const remote = target.buf.subarray(at, at + e.len);
      if (w.op === 0) local.set(remote);
      else remote.set(local);
      at += e.len;
    }
    this.#complete(q, w, WC.Success, opcode);
  }

  /** A request finished: a completion when it is signaled or failed (errors always complete). */
  #complete(q: SimQp, w: Work, status: number, opcode: number): void {
    if (status === WC.Success && !w.signaled) return;
    if (this.#fabric.completionGate.isClosed) {
      this.#fabric.completionGate.hold(() => this.#complete(q, w, status, opcode));
      return;
    }
    this.#fabric.counters.completions++;
    // Polling a completion retires its request and every earlier one: their slots are free.
    q.retired = Math.max(q.retired, w.seq + 1);
    const first = this.#batch.length === 0;
    this.#batch.push(q.cqId, w.wrId, status, opcode, status === WC.Success ? 0 : 0x81);
    if (first) {
      setImmediate(() => {
        const t = Float64Array.from(this.#batch);
        this.#batch = [];
        if (this.#open) this.#deliver(t);
      });
    }
  }

  close(): void {
    if (!this.#open) return;
    for (const id of [...this.#mws.keys()]) this.deallocMw(id);
    for (const id of [...this.#qps.keys()]) this.destroyQp(id);
    for (const id of [...this.#cqs]) {
      this.#cqs.delete(id);
      this.#fabric.counters.cqs--;
    }
    for (const id of [...this.#mrs.keys()]) {
      this.#mrs.delete(id);
      this.#fabric.counters.mrs--;
    }
    this.#open = false;
    const c = this.#fabric.counters;
    c.devices--;
    c.pds--;
    c.threads--;
    c.channels--;
  }
}
