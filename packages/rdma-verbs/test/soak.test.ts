/**
 * A seeded soak of the transport on the adversarial simulator: random READs and WRITEs (SGE
 * chains: ranges back to back remotely and scattered locally, or scattered on both sides), aborts,
 * deadlines, injected failed completions, injected ENOMEM/EAGAIN and part-accepted posts, late
 * completions and late writes, holder revokes racing reads, connections closed under load,
 * ports going down, peer restarts (a new incarnation of the same node id) and simultaneous opens.
 * It asserts: no write lands in memory after the transport said it was released (the audit);
 * every operation settles (exactly once) with bytes exact on success or an error of a class its
 * fate allows; a connection that closed has nothing on the NIC; every native resource is back to
 * its starting count at the end.
 *
 * Bounded by default (TW_RDMA_SOAK_SEEDS seeds of TW_RDMA_SOAK_STEPS steps: 4 × 60); the long
 * run is e.g. `TW_RDMA_SOAK_SEEDS=200 TW_RDMA_SOAK_STEPS=200 npx vitest run packages/rdma-verbs/test/soak.test.ts`.
 * TW_SIM_SEED=<seed> with TW_RDMA_SOAK_SEEDS=1 reruns one seed.
 */
import {
  AbortedError,
  ClosedError,
  ConnectionBrokenError,
  RemoteRejectedError,
  ResourceExhaustedError,
  SessionInvalidatedError,
  TensorwireError,
  TimedOutError,
  createTransferBatch,
  silentLogger,
  type NodeIdentity,
  type TransportHost,
  type TransportRegistration,
} from '@tensorwire/core';
import { describe, expect, it, onTestFailed } from 'vitest';
import { RdmaTransport, type RdmaConnection } from '../src/transport.js';
import { Rng, SimFabric, WC, testSeed } from './sim/verbs.js';

const SEEDS = Number(process.env['TW_RDMA_SOAK_SEEDS'] ?? 4);
const STEPS = Number(process.env['TW_RDMA_SOAK_STEPS'] ?? 60);
const base = testSeed();

const HOLDER_BYTES = 64 * 1024;
const pattern = (n: number, s: number): Uint8Array => new Uint8Array(n).map((_, i) => (i * 131 + s * 17 + (i >> 8)) & 0xff);

type Fate = 'none' | 'abort' | 'deadline' | 'fail-completion';
/** Errors any operation may end with when the world around it misbehaves (peers restart, connections close, ports go down, revokes race). */
const ANY = [ConnectionBrokenError, SessionInvalidatedError, ClosedError, ResourceExhaustedError, RemoteRejectedError];

interface SoakNode {
  t: RdmaTransport;
  host: TransportHost;
  src: Uint8Array;
  srcReg: TransportRegistration;
  /** Connections this node opened, by holder index. */
  conns: Map<number, RdmaConnection>;
  generation: number;
}

async function soak(seed: number, grants: 'memory-window' | 'memory-region'): Promise<{ ops: number; ok: number; late: number }> {
  const fabric = new SimFabric({ adversary: { seed, postFailures: 0.03, partialPosts: 0.1, lateWrites: 0.5, dereg: 'sloppy' } });
  const rng = new Rng(seed ^ 0x5eed);
  const start = { ...fabric.counters };
  const nodes: SoakNode[] = [];
  const identity = (i: number, gen: number): NodeIdentity => ({ nodeId: `soak-${seed}-${i}`, incarnation: `g${gen}`, hostId: `h${i}` });
  const boot = async (i: number, gen: number): Promise<SoakNode> => {
    const t = new RdmaTransport({ backend: fabric.backend(grants === 'memory-window'), grants, queuePairsPerPeer: 2, maxSendWr: 16, listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', quiesceTimeoutMs: 2_000, retireTimeoutMs: 2_000 });
    const host: TransportHost = { identity: identity(i, gen), logger: silentLogger, inbound: () => undefined };
    await t.start(host);
    const src = pattern(HOLDER_BYTES, i + gen * 7);
    const srcReg = await t.register({ kind: 'host', buffer: src });
    return { t, host, src, srcReg, conns: new Map(), generation: gen };
  };
  for (let i = 0; i < 3; i++) nodes.push(await boot(i, 0));

  const connect = async (from: SoakNode, to: number): Promise<RdmaConnection | undefined> => {
    const have = from.conns.get(to);
    if (have?.isOpen) return have;
    const n = nodes[to] as SoakNode;
    try {
      const c = (await from.t.connect(n.host.identity, n.t.endpoint(), { signal: new AbortController().signal, deadline: Date.now() + 5_000, streams: 2 })) as RdmaConnection;
      from.conns.set(to, c);
      return c;
    } catch (e) {
      expect(e).toBeInstanceOf(TensorwireError); // a peer mid-restart: typed, never a throw of anything else
      return undefined;
    }
  };

  const pending = new Set<Promise<void>>();
  const restarting = new Set<number>();
  const stats = { ops: 0, ok: 0, late: 0 };
  const problems: string[] = [];

  const transfer = async (i: number, j: number): Promise<void> => {
    const me = nodes[i] as SoakNode;
    const holder = nodes[j] as SoakNode;
    const conn = await connect(me, j);
    if (!conn) return;
    const op = rng.chance(0.5) ? ('read' as const) : ('write' as const);
    const count = 1 + rng.int(48);
    const piece = 1 + rng.int(1024);
    const contiguousRemote = rng.chance(0.7); // back to back remotely: SGE lists
    const remoteBase = rng.int(HOLDER_BYTES - count * piece);
    const local = new Uint8Array(2 * count * piece).fill(0xee);
    if (op === 'write') local.set(pattern(local.length, 99));
    let lr: TransportRegistration;
    let target: Uint8Array | undefined;
    let remoteReg: TransportRegistration = holder.srcReg;
    let remoteBuf = holder.src;
    try {
      lr = await me.t.register({ kind: 'host', buffer: local });
      if (op === 'write') {
        // A WRITE gets a target of its own (revoked after), so its bytes can be checked exactly.
        target = new Uint8Array(HOLDER_BYTES);
        remoteBuf = target;
        remoteReg = await holder.t.register({ kind: 'host', buffer: target });
      }
    } catch {
      return; // a node closing under us
    }
    const remote = me.t.decodeRemote(remoteReg.payload, 'host', HOLDER_BYTES);
    const order = Array.from({ length: count }, (_, k) => k);
    for (let k = count - 1; k > 0; k--) {
      const r = rng.int(k + 1);
      [order[k], order[r]] = [order[r] as number, order[k] as number];
    }
    const ranges = order.map((k, at) => ({
      local: lr.handle,
      localOffset: 2 * k * piece,
      remote,
      remoteOffset: remoteBase + (contiguousRemote ? at : k) * piece,
      length: piece,
    }));
    const fates: Fate[] = ['none', 'none', 'none', 'abort', 'deadline', 'fail-completion'];
    const fate = fates[rng.int(fates.length)] as Fate;
    const ac = new AbortController();
    const deadline = Date.now() + (fate === 'deadline' ? 1 + rng.int(15) : 10_000);
    if (fate === 'fail-completion') fabric.failExecution(rng.int(4), rng.chance(0.5) ? WC.RemOpErr : WC.RetryExcErr);
    if (fate === 'abort') setTimeout(() => ac.abort(), rng.int(5));
    const id = ++stats.ops;
    let settled = 0;
    let outcome: unknown;
    const stream = rng.int(2);
    try {
      await conn.execute(stream, createTransferBatch(op, ranges), { signal: ac.signal, deadline });
      settled++;
    } catch (e) {
      settled++;
      outcome = e;
    }
    // Settled: from here on the transport may not touch this memory.
    fabric.audit.release(local, `op ${id} settled`);
    if (target) fabric.audit.release(target, `op ${id} settled`);
    // The hardware suite's check, per operation: nothing of it is still on the NIC when it settles.
    const onNic = fabric.inFlight(local);
    if (onNic !== 0) problems.push(`op ${id} (${op}, ${fate}) settled with ${onNic} of its work requests still posted`);
    if (outcome === undefined) {
      stats.ok++;
      for (let at = 0; at < count; at++) {
        const k = order[at] as number;
        const l = local.subarray(2 * k * piece, (2 * k + 1) * piece);
        const roff = remoteBase + (contiguousRemote ? at : k) * piece;
        const r = remoteBuf.subarray(roff, roff + piece);
        if (Buffer.compare(Buffer.from(l), Buffer.from(r)) !== 0) {
          problems.push(`op ${id} (${op}, ${fate}) resolved with wrong bytes in range ${at}`);
          break;
        }
      }
    } else {
      const allowed = [...ANY, ...(fate === 'abort' ? [AbortedError] : []), ...(fate === 'deadline' ? [TimedOutError] : [])];
      if (!allowed.some((c) => outcome instanceof c)) problems.push(`op ${id} (${op}, ${fate}) failed with ${String((outcome as Error)?.name)}: ${String((outcome as Error)?.message)}`);
    }
    if (settled !== 1) problems.push(`op ${id} settled ${settled} times`);
    // Nothing of a settled operation holds its registrations: revoking them resolves (bounded here
    // so that a regression fails with a message instead of hanging the soak).
    const revoked = Promise.all([me.t.revoke(lr.handle), op === 'write' ? holder.t.revoke(remoteReg.handle) : undefined]).catch(() => undefined);
    const late = await Promise.race([revoked.then(() => false), new Promise<boolean>((r) => setTimeout(() => r(true), 10_000).unref())]);
    if (late) problems.push(`op ${id} (${op}, ${fate}): revoking its registrations did not resolve after it settled`);
  };

  const track = (p: Promise<void>): void => {
    const q = p.catch((e: unknown) => {
      problems.push(`a step threw ${String(e)}`);
    });
    pending.add(q);
    void q.finally(() => pending.delete(q));
  };

  for (let step = 0; step < STEPS; step++) {
    const r = rng.next();
    const i = rng.int(3);
    const j = (i + 1 + rng.int(2)) % 3;
    if (r < 0.7) track(transfer(i, j));
    else if (r < 0.76) {
      // The holder revokes what reads are using, and grants a fresh registration.
      const h = nodes[j] as SoakNode;
      const old = h.srcReg;
      track(
        (async () => {
          try {
            h.srcReg = await h.t.register({ kind: 'host', buffer: h.src });
            await h.t.revoke(old.handle);
          } catch (e) {
            if (!(e instanceof ClosedError)) throw e; // the node restarted meanwhile
          }
        })(),
      );
    } else if (r < 0.82) {
      const c = (nodes[i] as SoakNode).conns.get(j);
      if (c) track(rng.chance(0.5) ? c.close(new ConnectionBrokenError('soak closes it')) : c.retire());
    } else if (r < 0.87) {
      const gid = (nodes[j] as SoakNode).t.discovery?.selected?.gid as string;
      fabric.portDown(gid);
      setTimeout(() => fabric.portUp(gid), rng.int(10));
    } else if (r < 0.93) {
      // Simultaneous open: both sides connect to each other at once.
      const a = nodes[i] as SoakNode;
      const b = nodes[j] as SoakNode;
      track(
        (async () => {
          const [x, y] = await Promise.all([connect(a, j), connect(b, i)]);
          if (x && y) expect(x.isOpen || y.isOpen).toBe(true);
        })(),
      );
    } else {
      // A peer restarts: its transport closes under load; a new incarnation takes its place.
      const old = nodes[j] as SoakNode;
      if (restarting.has(j)) continue;
      restarting.add(j);
      track(
        (async () => {
          await old.t.close();
          nodes[j] = await boot(j, old.generation + 1);
          for (const n of nodes) n.conns.delete(j);
        })().finally(() => restarting.delete(j)),
      );
    }
    // Let the event loop run a little (more work overlaps when it is short).
    await new Promise((res) => setTimeout(res, rng.int(3)));
    while (pending.size > 8) await Promise.race(pending);
  }
  while (pending.size > 0) await Promise.all(pending);
  stats.late = fabric.lateWrites;
  for (const n of nodes) await n.t.close();
  expect(problems).toEqual([]);
  fabric.assertClean();
  const c = fabric.counters;
  expect({ devices: c.devices, pds: c.pds, mrs: c.mrs, mws: c.mws, cqs: c.cqs, qps: c.qps, channels: c.channels, threads: c.threads }).toEqual({
    devices: start.devices,
    pds: start.pds,
    mrs: start.mrs,
    mws: start.mws,
    cqs: start.cqs,
    qps: start.qps,
    channels: start.channels,
    threads: start.threads,
  });
  return stats;
}

describe(`seeded soak on the adversarial simulator (${SEEDS} seeds × ${STEPS} steps from ${base})`, () => {
  for (let k = 0; k < SEEDS; k++) {
    const seed = (base + k) >>> 0;
    const grants = seed % 2 === 0 ? ('memory-window' as const) : ('memory-region' as const);
    it(`seed ${seed} (${grants})`, async () => {
      onTestFailed(() => console.error(`[rdma-verbs] soak seed ${seed} failed; rerun with TW_SIM_SEED=${seed} TW_RDMA_SOAK_SEEDS=1 TW_RDMA_SOAK_STEPS=${STEPS}`));
      const s = await soak(seed, grants);
      // It exercised something: operations ran, and some of them completed.
      expect(s.ops).toBeGreaterThan(STEPS / 20);
      expect(s.ok).toBeGreaterThan(0);
    }, 120_000 + STEPS * 1_000);
  }
});
