/**
 * The holder half of `run` (also `tensorwire-bench holder`): blocks in a @tensorwire/cuda-ipc
 * host pool filled with a verifiable pattern, the lock service, and the engine's transports:
 * the same-host `cuda-ipc` transport (pool slots are shared memory, so it grants them
 * zero-copy) and TCP, so a requester on this host takes the fast path and one elsewhere TCP.
 * Every slot is registered with the engine once; each lease gets one range grant over its blocks
 * from the library (`engineGrants`), revoked when the lease ends, so a peer can only read what
 * its live lease pins.
 */
import net from 'node:net';
import { TransferEngine, silentLogger, type GrantRange } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { TensorPool } from '@tensorwire/cuda-ipc';
import { engineGrants, startLockServer, type LockServer } from '@tensorwire/lock-client/server';
import { blockId, blockSeed, encodeRawPort, poolOwner } from './fetch-protocol.js';
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

  // Register every pool slot once; each lease gets one range grant over its blocks
  // (@tensorwire/lock-client/server engineGrants), revoked when the lease ends.
  const blocks = new Map<string, GrantRange>();
  for (const [i, buffer] of memory.entries()) blocks.set(blockId(i), { registration: await engine.register({ kind: 'host', buffer }), offset: 0, length: o.blockBytes });
  const grants = engineGrants({ engine, blocks });
  const rawPortBlob = encodeRawPort(rawPort);
  const server = await startLockServer({
    holderId: 'bench-holder',
    lockTimeoutMs: o.lockTimeoutMs,
    address: o.lockAddress,
    logger: silentLogger,
    pin: grants.pin,
    revoke: grants.revoke,
    resolve: async (ids, lease) => {
      const r = await grants.resolve(ids, lease);
      // The bench's own extra: its raw baseline's port, on the first block (see fetch-protocol.ts).
      return { lease: (r as { lease: readonly Uint8Array[] }).lease, blocks: ids.map((_, k) => (k === 0 ? [rawPortBlob] : [])) };
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
      const g = grants.counters();
      return { acquired: c.acquired, released: c.released, expired: c.expired, active: c.active, activeBlocks: c.activeBlocks, rejected: c.rejected, grantsIssued: g.issued, grantsRevoked: g.revoked, liveGrants: g.live };
    },
    async close() {
      await server.close({ graceMs: 1000 });
      await grants.settled();
      raw.close();
      await engine.close();
      await pool.close();
    },
  };
}
