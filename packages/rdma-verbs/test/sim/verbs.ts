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
 *
 * With `adversary` set (SimFabricOptions), it behaves like the NICs and fabrics the pegaflow
 * incident met, every choice drawn from one seeded generator (the same seed, the same run):
 * - each device has its own QPN counter, starting at the same value on every device (peers
 *   "booted alike" allocate the same QPNs), and a QP is addressed by its device's GID and QPN;
 * - completions are delivered late and in bursts (per CQ in order, a random prefix per turn);
 * - a QP moved to ERR does not stop at once: work already posted may still move its bytes
 *   (a late write) before its flush completion is delivered;
 * - post() fails with ENOMEM/EAGAIN at random (nothing posted), or accepts only part of a chain
 *   (a send queue fuller than the caller counts);
 * - an MR deregistered while work requests that use it are posted is refused with EBUSY
 *   (`dereg: 'refuse'`) or, "sloppy NIC" (`dereg: 'sloppy'`), deregistered while that work
 *   still writes into the memory handed back;
 * - knobs take a port down (every QP on the device to ERR, peers' work fails with retry
 *   exceeded) and overrun a CQ (its completions are lost, its QPs go to ERR);
 * - an audit (`fabric.audit`) records every write into memory after it was released (an MR
 *   deregistered, or a range the test marks released when the transport settled the operation
 *   that used it); `fabric.assertClean()` fails with the seed.
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
  bound: { readonly mr: SimMr; readonly addr: bigint; readonly length: number; readonly access: number; readonly qp: SimQp } | undefined;
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
      /** Adversary: already on the wire when the QP went to ERR (moves its bytes before it flushes). */
      late?: boolean;
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
  /** The responder's device GID (hex), from the RTR address vector. */
  destGid: string;
  access: number;
  readonly work: Work[];
  running: boolean;
  /** Work requests posted so far; `posted - retired` hold send-queue slots. */
  posted: number;
  /** Every request before this sequence number has been retired by a polled completion. */
  retired: number;
  /** Adversary: wr_ids of its completions not delivered yet. */
  lateIds?: Set<number>;
  /** Bumped to restart execution (a step held at a gate from before exits). */
  gen?: number;
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
  /** Behave like a hostile NIC and fabric (see the file's doc comment); off by default. */
  readonly adversary?: AdversaryOptions;
}

/** The adversarial behaviours, each drawn from `seed`. */
export interface AdversaryOptions {
  /** Seed of every random choice (a failing seed reproduces the run). */
  readonly seed: number;
  /** Each device has its own QPN counter, all starting at 0x100. Default true. */
  readonly perDeviceQpns?: boolean;
  /** Most event-loop turns a completion may wait before it is delivered. Default 3. */
  readonly completionDelay?: number;
  /** Chance that work still posted when its QP goes to ERR moves its bytes before it flushes. Default 0.5. */
  readonly lateWrites?: number;
  /** Chance that a post() is refused whole with ENOMEM or EAGAIN. Default 0. */
  readonly postFailures?: number;
  /** Chance that a post() of more than one work request accepts only part of it (ENOMEM at the first refused). Default 0. */
  readonly partialPosts?: number;
  /** Deregistering an MR that posted work still uses: refused with EBUSY, or done while that work still writes into it. Default 'sloppy'. */
  readonly dereg?: 'refuse' | 'sloppy';
}

/** A small seeded generator (mulberry32). */
export class Rng {
  #s: number;
  constructor(seed: number) {
    this.#s = seed >>> 0;
  }
  /** In [0, 1). */
  next(): number {
    let t = (this.#s = (this.#s + 0x6d2b79f5) >>> 0);
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  /** An integer in [0, n). */
  int(n: number): number {
    return Math.floor(this.next() * n);
  }
  chance(p: number): boolean {
    return p > 0 && this.next() < p;
  }
}

/** The seed of a test run: TW_SIM_SEED when set (to reproduce one), else a fresh one. */
export function testSeed(): number {
  const env = process.env['TW_SIM_SEED'];
  if (env !== undefined && env !== '') return Number(env) >>> 0;
  return (Date.now() ^ (process.pid << 16) ^ Math.floor(Math.random() * 0x7fffffff)) >>> 0;
}

/**
 * Writes into memory after it was released: by deregistration, or by the test (a range the
 * transport settled). Each range is keyed by its ArrayBuffer, so views of the same memory agree.
 */
export class MemoryAudit {
  readonly #released = new Map<ArrayBufferLike, { start: number; end: number; why: string }[]>();
  readonly violations: string[] = [];
  /** Writes checked so far (the audit saw traffic). */
  writes = 0;
  /** From now on, any write into `view` is a violation (until reclaimed). */
  release(view: Uint8Array, why: string): void {
    const list = this.#released.get(view.buffer) ?? [];
    list.push({ start: view.byteOffset, end: view.byteOffset + view.byteLength, why });
    this.#released.set(view.buffer, list);
  }
  /** `view` is in use again (registered again, or handed to a new operation). */
  reclaim(view: Uint8Array): void {
    const list = this.#released.get(view.buffer);
    if (!list) return;
    const a = view.byteOffset;
    const b = a + view.byteLength;
    const left = list.filter((r) => r.end <= a || r.start >= b);
    if (left.length > 0) this.#released.set(view.buffer, left);
    else this.#released.delete(view.buffer);
  }
  /** @internal the simulated NIC writes `len` bytes at `view[off]`. */
  write(view: Uint8Array, off: number, len: number, what: string): void {
    this.writes++;
    const list = this.#released.get(view.buffer);
    if (!list) return;
    const a = view.byteOffset + off;
    const b = a + len;
    for (const r of list) if (a < r.end && b > r.start) this.violations.push(`${what} wrote ${len} bytes into memory released (${r.why})`);
  }
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
  /** Queue pairs by address: `${device GID hex}/${qpn}`. */
  readonly qps = new Map<string, SimQp>();
  /** Open devices. */
  readonly devices = new Set<SimDevice>();
  /** The adversary's options (with defaults), or undefined. */
  readonly adversary: Required<AdversaryOptions> | undefined;
  /** The adversary's generator (also for tests that draw their own choices from the seed). */
  readonly rng: Rng;
  readonly audit = new MemoryAudit();
  /** post() calls refused whole by the adversary (ENOMEM or EAGAIN). */
  postsInjected = 0;
  /** post() calls the adversary cut short (part of a chain accepted). */
  postsCut = 0;
  /** Work requests that moved their bytes after their QP went to ERR (late writes, before their flush). */
  lateWrites = 0;
  /** deregMr calls refused because posted work still uses the MR (dereg: 'refuse'). */
  deregRefused = 0;
  #backends = 0;
  #overrun = false;
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
    const a = options.adversary;
    this.adversary =
      a === undefined
        ? undefined
        : {
            seed: a.seed >>> 0,
            perDeviceQpns: a.perDeviceQpns ?? true,
            completionDelay: a.completionDelay ?? 3,
            lateWrites: a.lateWrites ?? 0.5,
            postFailures: a.postFailures ?? 0,
            partialPosts: a.partialPosts ?? 0,
            dereg: a.dereg ?? 'sloppy',
          };
    this.rng = new Rng(a?.seed ?? 1);
  }

  /**
   * Work requests posted and not yet executed (on the "NIC") whose local memory overlaps `view`:
   * what the NIC can still DMA into (READ) or out of (WRITE). 0 is what a settled operation needs.
   */
  inFlight(view: Uint8Array): number {
    let n = 0;
    for (const d of this.devices) n += d.inFlightOver(view);
    return n;
  }

  /** Fail with every audit violation, naming the seed. */
  assertClean(): void {
    const v = this.audit.violations;
    if (v.length > 0) throw new Error(`simulated verbs (seed ${this.adversary?.seed ?? 'none'}): ${v.length} late writes into released memory: ${v.slice(0, 5).join('; ')}`);
  }

  /** The device at `gid` (hex) takes its port down: every QP on it goes to ERR; peers' work to it fails (retry exceeded). */
  portDown(gid: string): void {
    for (const d of this.devices) if (d.gid === gid) d.portDown();
  }

  /** The port at `gid` is up again (new QPs work; the old ones stay in ERR). */
  portUp(gid: string): void {
    for (const d of this.devices) if (d.gid === gid) d.portUp();
  }

  /** The next completion queued overruns its CQ: it and every later one there are lost, and the CQ's QPs go to ERR. */
  overrunNextCompletion(): void {
    this.#overrun = true;
  }

  /** @internal */
  takeOverrun(): boolean {
    const o = this.#overrun;
    this.#overrun = false;
    return o;
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

  /**
   * A backend for one transport. Without an adversary every backend shares one GID (QPNs are
   * unique on the whole fabric); with one, each backend is its own device with its own GID
   * (IPv4-mapped 127.x.y.z) and, by default, its own QPN counter.
   */
  backend(memoryWindows = true, options: { readonly linkLayer?: 'ethernet' | 'infiniband' } = {}): RdmaBackend {
    const n = ++this.#backends;
    if (options.linkLayer === 'infiniband') {
      // An InfiniBand port: addressed by its LID (the subnet manager gave each port its own).
      const gid = `fe800000000000000000000000${(n + 1).toString(16).padStart(6, '0')}`;
      return simulatedBackend(this, memoryWindows, gid, n + 1);
    }
    const gid = this.adversary === undefined ? '00000000000000000000ffff7f000001' : `00000000000000000000ffff7f${(n + 1).toString(16).padStart(6, '0')}`;
    return simulatedBackend(this, memoryWindows, gid, 0);
  }
}

function simulatedBackend(fabric: SimFabric, memoryWindows: boolean, gid: string, lid: number): RdmaBackend {
  const ib = lid !== 0;
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
        linkLayer: ib ? 1 : 2,
        lid,
        activeMtu: 5,
        maxMtu: 5,
        gids: [{ index: ib ? 0 : 1, gid, type: ib ? ('IB/RoCE v1' as const) : ('RoCE v2' as const) }],
      },
    ],
  };
  class Device extends SimDevice {
    constructor(name: string, onCompletions: CompletionListener) {
      super(fabric, name, onCompletions, ib ? `lid:${lid}` : gid);
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
        2: 'local QP operation error',
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
      selected: ib
        ? { device: 'sim0', port: 1, linkLayer: 'InfiniBand', gidIndex: 0, gid, gidType: 'IB/RoCE v1', numaNode: undefined }
        : { device: 'sim0', port: 1, linkLayer: 'Ethernet', gidIndex: 1, gid, gidType: 'RoCE v2', numaNode: undefined },
      dmabuf: false,
      memoryWindows: { type2Supported: memoryWindows, grants: m.mode, note: m.reason },
    },
  };
}

const hex = (b: Uint8Array | undefined): string => (b === undefined ? '' : Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString('hex'));

export class SimDevice implements NativeDevice {
  readonly name: string;
  /** This port's address (its GID in hex on RoCE, `lid:<n>` on InfiniBand): with the QPN, the address of its QPs. */
  readonly gid: string;
  readonly #fabric: SimFabric;
  readonly #deliver: CompletionListener;
  readonly #mrs = new Map<number, SimMr>();
  readonly #mws = new Map<number, SimMw>();
  readonly #cqs = new Set<number>();
  /** Adversary: CQs that overran (their completions are lost). */
  readonly #overrun = new Set<number>();
  readonly #qps = new Map<number, SimQp>();
  #nextId = 1;
  #nextQpn = 0x100;
  #open = true;
  #portUp = true;
  #batch: number[] = [];
  /** Adversary: completions not yet delivered, in order (cqId, wrId, status, opcode, vendorErr each). */
  #late: number[] = [];
  #pumping = false;

  constructor(fabric: SimFabric, name: string, onCompletions: CompletionListener, gid = '00000000000000000000ffff7f000001') {
    if (name !== 'sim0') fail('TW_BACKEND_UNAVAILABLE', `no simulated device ${name}`);
    this.#fabric = fabric;
    this.name = name;
    this.gid = gid;
    this.#deliver = onCompletions;
    fabric.devices.add(this);
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
    f.audit.reclaim(view);
    return { id: mr.id, lkey: mr.rkey, rkey: mr.rkey, addr: mr.addr, length: mr.length };
  }

  regDmabuf(): NativeMr {
    return fail('TW_BACKEND_UNAVAILABLE', 'simulated verbs have no dma-buf');
  }

  /** @internal Posted work on this device's QPs (not executed yet) whose local SGEs overlap `view`. */
  inFlightOver(view: Uint8Array): number {
    const a = view.byteOffset;
    const b = a + view.byteLength;
    let n = 0;
    for (const q of this.#qps.values()) {
      for (const w of q.work) {
        if (w.kind !== 'rdma') continue;
        for (const e of w.sges) {
          const s = e.mr.buf.byteOffset + e.off;
          if (e.mr.buf.buffer === view.buffer && s < b && s + e.len > a) {
            n++;
            break;
          }
        }
      }
    }
    return n;
  }

  /** Work posted on this device's QPs (not executed yet) that uses `mr` locally. */
  #inFlight(mr: SimMr): boolean {
    for (const q of this.#qps.values()) for (const w of q.work) if (w.kind === 'rdma' && w.sges.some((e) => e.mr === mr)) return true;
    return false;
  }

  deregMr(id: number): boolean {
    if (!this.#open) return false;
    const mr = this.#mrs.get(id);
    if (!mr) return false;
    for (const w of this.#mws.values()) if (w.bound?.mr === mr) fail('TW_BACKEND_UNAVAILABLE', 'ibv_dereg_mr: Device or resource busy (errno 16): windows are bound to it');
    const adv = this.#fabric.adversary;
    if (adv?.dereg === 'refuse' && this.#inFlight(mr)) {
      this.#fabric.deregRefused++;
      fail('TW_BACKEND_UNAVAILABLE', 'ibv_dereg_mr: Device or resource busy (errno 16): work requests that use it are posted');
    }
    this.#mrs.delete(id);
    this.#fabric.counters.mrs--;
    // The memory is handed back: from now on no write may land in it.
    this.#fabric.audit.release(mr.buf, `MR ${id} deregistered`);
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
    this.#overrun.delete(id);
    this.#fabric.counters.cqs--;
    return true;
  }

  createQp(cqId: number, maxSendWr: number, maxSendSge = 1): NativeQp {
    this.#check();
    if (!this.#cqs.has(cqId)) fail('TW_INVALID_INPUT', `unknown CQ id ${cqId}`);
    const l = this.#fabric.limits;
    // ibv_create_qp refuses capacities beyond the device's (EINVAL); the addon reports it so.
    if (maxSendWr < 1 || maxSendWr > l.maxQpWr || maxSendSge < 1 || maxSendSge > l.maxSge) fail('TW_RESOURCE_EXHAUSTED', 'ibv_create_qp: Invalid argument (errno 22)');
    const perDevice = this.#fabric.adversary?.perDeviceQpns === true;
    const qp: SimQp = {
      id: this.#nextId++,
      qpn: perDevice ? this.#nextQpn++ : this.#fabric.nextQpn++,
      dev: this,
      cqId,
      maxSendWr,
      maxSendSge,
      state: 'RESET',
      destQpn: -1,
      destGid: '',
      access: 0,
      work: [],
      running: false,
      posted: 0,
      retired: 0,
    };
    this.#qps.set(qp.id, qp);
    this.#fabric.qps.set(`${this.gid}/${qp.qpn}`, qp);
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
    q.work.length = 0; // pending work and completions of a destroyed QP are never delivered; DMA stops
    this.#qps.delete(id);
    this.#fabric.qps.delete(`${this.gid}/${q.qpn}`);
    this.#fabric.counters.qps--;
    // Completions of it not delivered yet are dropped with it.
    this.#dropLate((cq, wr) => cq === q.cqId && this.#qpOfLate(q, wr));
    return true;
  }

  /** @internal whether a late completion with `wrId` belongs to `q` (tracked per QP). */
  #qpOfLate(q: SimQp, wrId: number): boolean {
    return q.lateIds?.has(wrId) === true;
  }

  #dropLate(match: (cqId: number, wrId: number) => boolean): void {
    if (this.#late.length === 0) return;
    const kept: number[] = [];
    for (let i = 0; i < this.#late.length; i += 5) {
      if (!match(this.#late[i] as number, this.#late[i + 1] as number)) kept.push(...this.#late.slice(i, i + 5));
    }
    this.#late = kept;
  }

  qpInit(id: number, _port: number, access: number): void {
    const q = this.#qp(id);
    q.state = 'INIT';
    q.access = access;
  }

  qpRtr(id: number, attrs: { destQpn: number; dgid?: Uint8Array; dlid: number; isGlobal: boolean }): void {
    const q = this.#qp(id);
    if (q.state !== 'INIT') fail('TW_CONNECTION_BROKEN', 'ibv_modify_qp(RTR): Invalid argument (errno 22)');
    q.destQpn = attrs.destQpn;
    q.destGid = attrs.isGlobal ? hex(attrs.dgid) : `lid:${attrs.dlid}`;
    q.state = 'RTR';
  }

  qpRts(id: number): void {
    const q = this.#qp(id);
    if (q.state !== 'RTR') fail('TW_CONNECTION_BROKEN', 'ibv_modify_qp(RTS): Invalid argument (errno 22)');
    q.state = 'RTS';
  }

  qpError(id: number): void {
    this.#toError(this.#qp(id));
  }

  /** A QP goes to ERR. Adversary: work already posted may be on the wire and still move its bytes before it flushes. */
  #toError(q: SimQp): void {
    if (q.state === 'ERR') return;
    q.state = 'ERR';
    const adv = this.#fabric.adversary;
    if (adv === undefined) return;
    for (const w of q.work) if (w.kind === 'rdma' && this.#fabric.rng.chance(adv.lateWrites)) w.late = true;
    // In ERR the gates do not hold work back: what waits at one flushes now.
    q.gen = (q.gen ?? 0) + 1;
    q.running = false;
    this.#run(q);
  }

  /** Adversary knob: the port goes down. */
  portDown(): void {
    this.#portUp = false;
    for (const q of this.#qps.values()) if (q.state !== 'RESET' && q.state !== 'INIT') this.#toError(q);
  }

  portUp(): void {
    this.#portUp = true;
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
    const items: (Work & { kind: 'rdma' })[] = [];
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
    const f = this.#fabric;
    const refused = f.takePostFault();
    if (refused !== undefined) {
      return { posted: 0, errno: refused, error: `ibv_post_send: injected failure (errno ${refused})` };
    }
    const adv = f.adversary;
    if (adv !== undefined && f.rng.chance(adv.postFailures)) {
      f.postsInjected++;
      const errno = f.rng.chance(0.5) ? 11 : 12;
      return { posted: 0, errno, error: `ibv_post_send: ${errno === 12 ? 'Cannot allocate memory' : 'Resource temporarily unavailable'} (errno ${errno}, injected)` };
    }
    // Like a provider: every request takes a slot; the first that does not fit fails the post
    // (ENOMEM) and those before it stay posted.
    let room = q.maxSendWr - (q.posted - q.retired);
    if (adv !== undefined && items.length > 1 && f.rng.chance(adv.partialPosts)) {
      // A send queue fuller than the caller counts: part of the chain fits.
      f.postsCut++;
      room = Math.min(room, 1 + f.rng.int(items.length - 1));
    }
    const posted = Math.max(0, Math.min(room, items.length));
    for (let i = 0; i < posted; i++) q.work.push({ ...(items[i] as Work & { kind: 'rdma' }), seq: q.posted++ });
    f.counters.postedWrs += posted;
    f.peakSlotsHeld = Math.max(f.peakSlotsHeld, q.posted - q.retired);
    if (posted > 0) f.posts++;
    if (posted < items.length) f.postsRefused++;
    if (f.recordPosts && posted > 0) {
      const mine = items.slice(0, posted);
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

  /** The responder's check of an incoming request that arrived on QP `via`. */
  resolve(rkey: number, addr: bigint, len: number, need: number, via: SimQp): { buf: Uint8Array; off: number } | undefined {
    const inRange = (base: bigint, size: number): boolean => addr >= base && addr + BigInt(len) <= base + BigInt(size);
    for (const mr of this.#mrs.values()) {
      if (mr.rkey === rkey && (mr.access & need) === need && inRange(mr.addr, mr.length)) return { buf: mr.buf, off: Number(addr - mr.addr) };
    }
    for (const mw of this.#mws.values()) {
      const b = mw.bound;
      if (b && mw.rkey === rkey && b.qp === via && (b.access & need) === need && inRange(b.addr, b.length)) return { buf: b.mr.buf, off: Number(addr - b.mr.addr) };
    }
    return undefined;
  }

  /** Execute a QP's work in order, one request per macrotask, like a (slow) NIC. */
  #run(q: SimQp): void {
    if (q.running) return;
    q.running = true;
    const gen = q.gen;
    const step = (): void => {
      if (q.gen !== gen) return; // restarted: another step runs this QP now
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

  /** Move a request's bytes between its SGEs and the responder's range. */
  #move(q: SimQp, w: Work & { kind: 'rdma' }, target: { buf: Uint8Array; off: number }, what: string): void {
    const audit = this.#fabric.audit;
    let at = target.off;
    for (const e of w.sges) {
      const local = e.mr.buf.subarray(e.off, e.off + e.len);
      const remote = target.buf.subarray(at, at + e.len);
      if (w.op === 0) {
        audit.write(e.mr.buf, e.off, e.len, `${what} READ wr ${w.wrId} on QP ${q.qpn}`);
        local.set(remote);
      } else {
        audit.write(target.buf, at, e.len, `${what} WRITE wr ${w.wrId} on QP ${q.qpn}`);
        remote.set(local);
      }
      at += e.len;
    }
  }

  #peerOf(q: SimQp): SimQp | undefined {
    const peer = this.#fabric.qps.get(`${q.destGid}/${q.destQpn}`);
    if (!peer || !this.#portUp || !peer.dev.#portUp) return undefined;
    if ((peer.state !== 'RTR' && peer.state !== 'RTS') || peer.destQpn !== q.qpn || peer.destGid !== this.gid) return undefined;
    return peer;
  }

  #execute(q: SimQp, w: Work): void {
    const opcode = w.kind === 'bind' ? OPCODE.BindMw : w.op === 0 ? OPCODE.RdmaRead : OPCODE.RdmaWrite;
    // In ERR every request flushes, and a flush always completes, signaled or not. Adversary: a
    // request that was on the wire when the QP went to ERR still moves its bytes first (its local
    // MR may be deregistered by now: a sloppy NIC still writes there).
    if (q.state === 'ERR') {
      if (w.kind === 'rdma' && w.late === true) {
        const peer = this.#fabric.qps.get(`${q.destGid}/${q.destQpn}`);
        const need = w.op === 0 ? ACCESS.RemoteRead : ACCESS.RemoteWrite;
        const target = peer && (peer.access & need) === need ? peer.dev.resolve(w.rkey, w.raddr, w.len, need, peer) : undefined;
        if (target) {
          this.#fabric.lateWrites++;
          this.#move(q, w, target, 'late');
        }
      }
      return this.#complete(q, w, WC.WrFlushErr, opcode);
    }
    if (w.kind === 'bind') {
      if (!this.#mws.has(w.mw.id) || !this.#mrs.has(w.mr.id)) {
        this.#toError(q);
        return this.#complete(q, w, WC.LocProtErr, opcode);
      }
      w.mw.bound = { mr: w.mr, addr: w.mr.addr + BigInt(w.off), length: w.len, access: w.access, qp: q };
      return this.#complete(q, w, WC.Success, opcode);
    }
    const peer = this.#peerOf(q);
    if (!peer) {
      this.#toError(q);
      return this.#complete(q, w, WC.RetryExcErr, opcode);
    }
    const injected = this.#fabric.takeFault();
    this.#fabric.executed++;
    if (injected !== undefined) {
      this.#toError(q);
      return this.#complete(q, w, injected, opcode);
    }
    // The local side: every SGE's MR must still be registered. A NIC fails a request whose MR is
    // gone with a protection error; a sloppy one (adversary, dereg: 'sloppy') still writes.
    const sloppy = this.#fabric.adversary?.dereg === 'sloppy';
    for (const e of w.sges) {
      if (!this.#mrs.has(e.mr.id) && !sloppy) {
        this.#toError(q);
        return this.#complete(q, w, WC.LocProtErr, opcode);
      }
    }
    const need = w.op === 0 ? ACCESS.RemoteRead : ACCESS.RemoteWrite;
    const target = (peer.access & need) === need ? peer.dev.resolve(w.rkey, w.raddr, w.len, need, peer) : undefined;
    if (!target) {
      // An access violation takes both ends to ERR (the responder raises IBV_EVENT_QP_ACCESS_ERR).
      this.#toError(q);
      peer.dev.#toError(peer);
      return this.#complete(q, w, WC.RemAccessErr, opcode);
    }
    // One contiguous remote range, scattered into (READ) or gathered from (WRITE) the SGEs in order.
    this.#move(q, w, target, 'a');
    this.#complete(q, w, WC.Success, opcode);
  }

  /** A request finished: a completion when it is signaled or failed (errors always complete). */
  #complete(q: SimQp, w: Work, status: number, opcode: number): void {
    if (status === WC.Success && !w.signaled) return;
    if (this.#fabric.completionGate.isClosed) {
      this.#fabric.completionGate.hold(() => this.#complete(q, w, status, opcode));
      return;
    }
    if (this.#overrun.has(q.cqId)) return; // the CQ overran: its completions are lost
    if (this.#fabric.takeOverrun()) {
      // More completions than the CQ holds: the CQ is in error (IBV_EVENT_CQ_ERR), what it
      // would have held is lost, and its QPs go to ERR (their flushes are lost too).
      this.#overrun.add(q.cqId);
      for (const o of this.#qps.values()) if (o.cqId === q.cqId) this.#toError(o);
      this.#dropLate((cq) => cq === q.cqId);
      return;
    }
    this.#fabric.counters.completions++;
    // Polling a completion retires its request and every earlier one: their slots are free.
    q.retired = Math.max(q.retired, w.seq + 1);
    const tuple = [q.cqId, w.wrId, status, opcode, status === WC.Success ? 0 : 0x81];
    if (this.#fabric.adversary !== undefined) {
      (q.lateIds ??= new Set()).add(w.wrId);
      this.#late.push(...tuple);
      this.#pumpLate();
      return;
    }
    const first = this.#batch.length === 0;
    this.#batch.push(...tuple);
    if (first) {
      setImmediate(() => {
        const t = Float64Array.from(this.#batch);
        this.#batch = [];
        if (this.#open) this.#deliver(t);
      });
    }
  }

  /** Adversary: deliver what is late in bursts: each turn a random prefix (possibly none), after a random wait. */
  #pumpLate(): void {
    if (this.#pumping) return;
    this.#pumping = true;
    const adv = this.#fabric.adversary as Required<AdversaryOptions>;
    const rng = this.#fabric.rng;
    const turn = (): void => {
      if (!this.#open || this.#late.length === 0) {
        this.#pumping = false;
        return;
      }
      const n = this.#late.length / 5;
      // Most turns deliver something; a turn may deliver nothing (late), or everything (a burst).
      const take = rng.chance(0.25) ? 0 : rng.chance(0.5) ? n : 1 + rng.int(n);
      if (take > 0) {
        const t = Float64Array.from(this.#late.slice(0, take * 5));
        this.#late = this.#late.slice(take * 5);
        for (let i = 0; i < t.length; i += 5) {
          for (const q of this.#qps.values()) if (q.cqId === t[i]) q.lateIds?.delete(t[i + 1] as number);
        }
        this.#deliver(t);
      }
      later(1 + rng.int(adv.completionDelay + 1), turn);
    };
    later(rng.int(adv.completionDelay + 1), turn);
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
    this.#late = [];
    this.#open = false;
    this.#fabric.devices.delete(this);
    const c = this.#fabric.counters;
    c.devices--;
    c.pds--;
    c.threads--;
    c.channels--;
  }
}

/** Run `f` after `turns` turns of the event loop (setImmediate hops; 0: on the next one). */
function later(turns: number, f: () => void): void {
  if (turns <= 0) setImmediate(f);
  else setImmediate(() => later(turns - 1, f));
}
