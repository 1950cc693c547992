/**
 * Simulated verbs: an in-process model of RC queue pairs, memory regions and type-2 memory
 * windows behind the addon's `NativeAddon`/`NativeDevice` interface, so the transport's own
 * TypeScript (handshake, posting and credits, completion routing, quiesce, window binds,
 * revocation) runs here over real control sockets.
 *
 * It models what the transport relies on, after the verbs semantics: work requests on a QP
 * execute in order; a failed request moves the QP to ERR and every later one completes with a
 * flush error; moving a QP to ERR flushes what has not executed; destroying a QP drops its
 * pending completions; an rkey is checked at the responder (an MR's on any QP, a type-2
 * window's only on the QP it was bound to); an MR with windows bound to it cannot be
 * deregistered. It proves nothing about libibverbs or a NIC: the hardware suites do that.
 */
import type { CompletionListener, NativeAddon, NativeCounters, NativeDevice, NativeDeviceInfo, NativeMr, NativeMw, NativeProbe, NativeQp } from '../../src/native.js';
import type { RdmaBackend } from '../../src/transport.js';
import { grantMode } from '../../src/attributes.js';

const ACCESS = { LocalWrite: 1, RemoteWrite: 2, RemoteRead: 4, MwBind: 16 };
const WC = { Success: 0, LocProtErr: 4, WrFlushErr: 5, RemAccessErr: 10, RetryExcErr: 12 };
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

type Work =
  | { readonly kind: 'rdma'; readonly op: 0 | 1; readonly wrId: number; readonly mr: SimMr; readonly off: number; readonly raddr: bigint; readonly rkey: number; readonly len: number }
  | { readonly kind: 'bind'; readonly wrId: number; readonly mw: SimMw; readonly mr: SimMr; readonly off: number; readonly len: number; readonly access: number; readonly rkey: number };

interface SimQp {
  readonly id: number;
  readonly qpn: number;
  readonly dev: SimDevice;
  readonly cqId: number;
  readonly maxSendWr: number;
  state: 'RESET' | 'INIT' | 'RTR' | 'RTS' | 'ERR';
  destQpn: number;
  access: number;
  readonly work: Work[];
  running: boolean;
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
  readonly counters = { devices: 0, pds: 0, mrs: 0, mws: 0, cqs: 0, qps: 0, channels: 0, threads: 0, postedWrs: 0, completions: 0 };
  /** Closed: window binds wait (to test revoke or close while a bind is on the "NIC"). */
  readonly bindGate = new Gate();
  /** Closed: work executes but its completions are not delivered yet. */
  readonly completionGate = new Gate();
  nextQpn = 0x100;
  nextAddr = 0x7f0000000000n;
  nextKey = 0x1000;
  /** Binds posted so far (BIND_MW work requests). */
  binds = 0;
  /** READs and WRITEs executed so far (successful or not). */
  executed = 0;

  backend(memoryWindows = true): RdmaBackend {
    return simulatedBackend(this, memoryWindows);
  }
}

function simulatedBackend(fabric: SimFabric, memoryWindows: boolean): RdmaBackend {
  const record = {
    name: 'sim0',
    numaNode: undefined,
    maxQpWr: 256,
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
    wcStatusString: (s: number) => ({ 0: 'success', 4: 'local protection error', 5: 'Work Request Flushed Error', 10: 'remote access error', 12: 'transport retry counter exceeded' })[s] ?? `status ${s}`,
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
    return { name: this.name, memoryWindowType2: true };
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

  createQp(cqId: number, maxSendWr: number): NativeQp {
    this.#check();
    if (!this.#cqs.has(cqId)) fail('TW_INVALID_INPUT', `unknown CQ id ${cqId}`);
    const qp: SimQp = { id: this.#nextId++, qpn: this.#fabric.nextQpn++, dev: this, cqId, maxSendWr, state: 'RESET', destQpn: -1, access: 0, work: [], running: false };
    this.#qps.set(qp.id, qp);
    this.#fabric.qps.set(qp.qpn, qp);
    this.#fabric.counters.qps++;
    return { id: qp.id, qpn: qp.qpn, maxSendWr };
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

  post(qpId: number, wrs: BigUint64Array): { posted: number; errno: number; error?: string } {
    const q = this.#qp(qpId);
    if (wrs.length === 0 || wrs.length % 7 !== 0) fail('TW_INVALID_INPUT', 'wrs length must be a positive multiple of 7');
    const items: Work[] = [];
    for (let i = 0; i < wrs.length; i += 7) {
      const [op, wrId, mrId, off, raddr, rkey, len] = Array.from(wrs.subarray(i, i + 7));
      const mr = this.#mrs.get(Number(mrId));
      if (!mr) fail('TW_INVALID_INPUT', 'local memory is not registered (or was revoked)');
      if (Number(off) + Number(len) > mr.length || len === 0n) fail('TW_INVALID_INPUT', 'local range is outside its registration');
      items.push({ kind: 'rdma', op: op === 0n ? 0 : 1, wrId: Number(wrId), mr, off: Number(off), raddr: raddr as bigint, rkey: Number(rkey), len: Number(len) });
    }
    const room = q.maxSendWr - q.work.length;
    const posted = Math.max(0, Math.min(room, items.length));
    q.work.push(...items.slice(0, posted));
    this.#fabric.counters.postedWrs += posted;
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
    if (q.work.length >= q.maxSendWr) return { posted: false, rkey: mw.rkey, errno: 12, error: 'ibv_post_send(BIND_MW): Cannot allocate memory (errno 12)' };
    const rkey = (mw.rkey & ~0xff) | ((mw.rkey + 1) & 0xff);
    q.work.push({ kind: 'bind', wrId: Number(wrId), mw, mr, off: offset, len: length, access, rkey });
    mw.rkey = rkey;
    this.#fabric.counters.postedWrs++;
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
      q.work.shift();
      this.#execute(q, w);
      setImmediate(step);
    };
    setImmediate(step);
  }

  #execute(q: SimQp, w: Work): void {
    const opcode = w.kind === 'bind' ? OPCODE.BindMw : w.op === 0 ? OPCODE.RdmaRead : OPCODE.RdmaWrite;
    if (q.state === 'ERR') return this.#complete(q, w.wrId, WC.WrFlushErr, opcode);
    if (w.kind === 'bind') {
      if (!this.#mws.has(w.mw.id) || !this.#mrs.has(w.mr.id)) {
        q.state = 'ERR';
        return this.#complete(q, w.wrId, WC.LocProtErr, opcode);
      }
      w.mw.bound = { mr: w.mr, addr: w.mr.addr + BigInt(w.off), length: w.len, access: w.access, qpn: q.qpn };
      return this.#complete(q, w.wrId, WC.Success, opcode);
    }
    const peer = this.#fabric.qps.get(q.destQpn);
    if (!peer || (peer.state !== 'RTR' && peer.state !== 'RTS') || peer.destQpn !== q.qpn) {
      q.state = 'ERR';
      return this.#complete(q, w.wrId, WC.RetryExcErr, opcode);
    }
    this.#fabric.executed++;
    const need = w.op === 0 ? ACCESS.RemoteRead : ACCESS.RemoteWrite;
    const target = (peer.access & need) === need ? peer.dev.resolve(w.rkey, w.raddr, w.len, need, peer.qpn) : undefined;
    if (!target) {
      // An access violation takes both ends to ERR (the responder raises IBV_EVENT_QP_ACCESS_ERR).
      q.state = 'ERR';
      peer.state = 'ERR';
      return this.#complete(q, w.wrId, WC.RemAccessErr, opcode);
    }
    const local = w.mr.buf.subarray(w.off, w.off + w.len);
    const remote = target.buf.subarray(target.off, target.off + w.len);
    if (w.op === 0) local.set(remote);
    else remote.set(local);
    this.#complete(q, w.wrId, WC.Success, opcode);
  }

  #complete(q: SimQp, wrId: number, status: number, opcode: number): void {
    this.#fabric.counters.completions++;
    if (this.#fabric.completionGate.isClosed) {
      this.#fabric.completionGate.hold(() => this.#complete(q, wrId, status, opcode));
      this.#fabric.counters.completions--;
      return;
    }
    const first = this.#batch.length === 0;
    this.#batch.push(q.cqId, wrId, status, opcode, status === WC.Success ? 0 : 0x81);
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
