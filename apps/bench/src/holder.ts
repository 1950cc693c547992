/**
 * The holder half of `run` (also `tensorwire-bench holder`): blocks in a @tensorwire/cuda-ipc
 * host pool filled with a verifiable pattern, the lock service, and the engine's transports:
 * the same-host `cuda-ipc` transport (pool slots are shared memory, so it grants them
 * zero-copy) and TCP, so a requester on this host takes the fast path and one elsewhere TCP.
 * Each lease registers its blocks with the engine afresh (a new unguessable grant per block per
 * transport per lease) and revokes them when the lease ends, so a peer can only read what its
 * live lease pins.
 */
import net from 'node:net';
import { TransferEngine, silentLogger, type Registration } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { TensorPool } from '@tensorwire/cuda-ipc';
import { LeaseError } from '@tensorwire/lock-client';
import { startLockServer, type LockServer } from '@tensorwire/lock-client/server';
import { BLOCK_OWNER, blockSeed, encodeBlockGrant, poolOwner } from './fetch-protocol.js';
import { holderTransports } from './transports.js';

export interface HolderOptions {
  blocks: number;
  blockBytes: number;
  /** Lock service address, host:port (port 0 = any). */
  lockAddress: string;
  /** Address the engine's TCP transport listens on and advertises. */
  tcpHost: string;
  advertiseHost?: string;
  lockTimeoutMs: number;
}

export interface Holder {
  readonly lockAddress: string;
  readonly server: LockServer;
  readonly engine: TransferEngine;
  readonly pool: TensorPool;
  /** Transports the holder serves through, and what it could not serve through and why. */
  readonly transports: readonly string[];
  readonly notes: readonly string[];
  counters(): Record<string, number>;
  close(): Promise<void>;
}

export async function startHolder(o: HolderOptions): Promise<Holder> {
  const pool = new TensorPool({ owner: poolOwner() });
  try {
    return await serve(o, pool);
  } catch (e) {
    await pool.close().catch(() => undefined);
    throw e;
  }
}

async function serve(o: HolderOptions, pool: TensorPool): Promise<Holder> {
  const { transports, notes } = holderTransports({ host: o.tcpHost, ...(o.advertiseHost ? { advertiseHost: o.advertiseHost } : {}) });
  const engine = new TransferEngine({ nodeId: 'bench-holder', transports, logger: silentLogger });
  await engine.start();
  const closers: (() => Promise<unknown>)[] = [() => engine.close()];
  try {
    return await finish(o, pool, engine, notes, closers);
  } catch (e) {
    for (const c of closers.reverse()) await c().catch(() => undefined);
    throw e;
  }
}

async function finish(o: HolderOptions, pool: TensorPool, engine: TransferEngine, notes: readonly string[], closers: (() => Promise<unknown>)[]): Promise<Holder> {
  const memory: Uint8Array[] = [];
  for (let i = 0; i < o.blocks; i++) {
    const id = await pool.register({ byteLength: o.blockBytes });
    await pool.write(id, pattern(o.blockBytes, blockSeed(i)));
    const view = await pool.read(id);
    if (!view.buffer) throw new Error(`pool slot ${id} has no host mapping`);
    memory.push(view.buffer); // the holder keeps its own view of each slot for the lifetime of the run
  }

  // Raw baseline: the same bytes over a plain socket (client sends u64 total + u32 block size).
  const raw = net.createServer({ noDelay: true }, (socket) => {
    socket.on('error', () => undefined);
    socket.once('data', async (req: Buffer) => {
      const total = Number(req.readBigUInt64BE(0));
      let sent = 0;
      let i = 0;
      while (sent < total && !socket.destroyed) {
        const block = memory[i++ % memory.length] as Uint8Array;
        const n = Math.min(block.length, total - sent);
        if (!socket.write(block.subarray(0, n))) await new Promise((r) => socket.once('drain', r));
        sent += n;
      }
    });
  });
  await new Promise<void>((resolve, reject) => {
    raw.once('error', reject);
    raw.listen(0, o.tcpHost, () => resolve());
  });
  closers.push(() => new Promise((r) => raw.close(r)));
  const rawPort = (raw.address() as net.AddressInfo).port;

  const grants = new Map<string, Registration[]>(); // session id -> its lease-scoped registrations
  const server = await startLockServer({
    holderId: 'bench-holder',
    lockTimeoutMs: o.lockTimeoutMs,
    address: o.lockAddress,
    logger: silentLogger,
    pin: (id) => {
      const i = Number(id.split(':')[2]);
      if (!id.startsWith(`block:${BLOCK_OWNER}:`) || !(i >= 0 && i < o.blocks)) throw new LeaseError('NOT_FOUND', `no block ${id} on this holder`);
    },
    resolve: async (ids, lease) => {
      const regs = await Promise.all(ids.map((id) => engine.register({ kind: 'host', buffer: memory[Number(id.split(':')[2])] as Uint8Array })));
      grants.set(lease.sessionId, regs);
      const endpoint = engine.endpoint();
      return regs.map((r) => encodeBlockGrant(rawPort, endpoint, r.descriptor));
    },
    revoke: (lease) => {
      const regs = grants.get(lease.sessionId);
      grants.delete(lease.sessionId);
      for (const r of regs ?? []) void r.revoke();
    },
  });
  const lockAddress = `${o.lockAddress.replace(/:\d+$/, '')}:${server.port}`;
  return {
    lockAddress,
    server,
    engine,
    pool,
    transports: engine.transports.map((t) => t.name),
    notes,
    counters() {
      const c = server.counters();
      return { acquired: c.acquired, released: c.released, expired: c.expired, active: c.active, activeBlocks: c.activeBlocks, rejected: c.rejected, liveGrants: grants.size };
    },
    async close() {
      await server.close({ graceMs: 1000 });
      raw.close();
      await engine.close();
      await pool.close();
    },
  };
}
