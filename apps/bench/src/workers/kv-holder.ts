/**
 * Holder half of the `kv` scenario: one large host region filled with a verifiable pattern,
 * registered once with an engine that serves it through the same-host transport (the region
 * is a shared segment from `allocateSharedMemory`, so cuda-ipc grants it zero-copy) and TCP.
 * Also serves the raw baseline: on a plain node:net socket, each request `u64 bytes, u64
 * offset` is answered with region[offset, offset + bytes) in slices of at most 4 MiB.
 * argv: regionBytes seed shared(1|0) blockSizes (comma-separated: a numbered block space for each)
 */
import net from 'node:net';
import { TcpTransport, TransferEngine, silentLogger, type GrantRange, type GrantSpec } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { allocateSharedMemory } from '@tensorwire/cuda-ipc';
import { LockServer, engineGrants } from '@tensorwire/lock-client/server';
import { grantLayers, kvSpace, parseKvBlockId, rng, scatter } from '../kv-shape.js';
import { workerInit } from '../proc.js';
import { holderTransports } from '../transports.js';

const SLICE = 4 * 1024 * 1024;
const ipc = workerInit();
const regionBytes = Number(process.argv[2]);
const seed = Number(process.argv[3]);
const shared = process.argv[4] === '1';
const blockSizes = (process.argv[5] ?? '').split(',').filter((x) => x !== '').map(Number);
const region = shared ? allocateSharedMemory(regionBytes, `kv-holder-${process.pid}`) : new Uint8Array(regionBytes);
region.set(pattern(regionBytes, seed));
const built = shared ? holderTransports() : { transports: [new TcpTransport()], notes: ['holder serves TCP only: its region is not in shared memory'] };
const engine = new TransferEngine({ nodeId: 'kv-holder', transports: built.transports, logger: silentLogger });
await engine.start();
const reg = await engine.register({ kind: 'host', buffer: region }); // once for the whole region (invariant 15)

const raw = net.createServer({ noDelay: true }, (socket) => {
  socket.on('error', () => undefined);
  let pending: Buffer = Buffer.alloc(0);
  let busy = false;
  const serve = async (): Promise<void> => {
    if (busy) return;
    busy = true;
    while (pending.length >= 16 && !socket.destroyed) {
      const bytes = Number(pending.readBigUInt64BE(0));
      const offset = Number(pending.readBigUInt64BE(8));
      pending = pending.subarray(16);
      if (!(bytes > 0 && offset >= 0 && offset + bytes <= regionBytes)) {
        socket.destroy();
        break;
      }
      for (let at = offset; at < offset + bytes && !socket.destroyed; at += SLICE) {
        if (!socket.write(region.subarray(at, Math.min(offset + bytes, at + SLICE)))) await new Promise((r) => socket.once('drain', r));
      }
    }
    busy = false;
  };
  socket.on('data', (d: Buffer) => {
    pending = pending.length === 0 ? d : Buffer.concat([pending, d]);
    void serve();
  });
});
await new Promise<void>((r) => raw.listen(0, '127.0.0.1', r));

// Leased fetches: the library's flow, one grant per lease over its blocks. By number (the
// default): each block size is a numbered block space over the whole region (block n at n ×
// size), the lease's grant is the block grant of its numbers. By id (the comparison row): block
// ids name their offset and length in the region (see kvBlockId); a real holder looks blocks up
// in its block table; here the parsed ids are kept in a map (bounded), so a pin costs a lookup,
// not a regular expression.
const blockTable = new Map<string, GrantRange>();
const grants = engineGrants({
  engine,
  spaces: Object.fromEntries(blockSizes.map((size) => [kvSpace(size), { registration: reg, blockBytes: size }])),
  blocks: (id) => {
    const known = blockTable.get(id);
    if (known) return known;
    const b = parseKvBlockId(id);
    if (!b || b.length === 0 || b.offset + b.length > regionBytes) return undefined;
    const range: GrantRange = { registration: reg, offset: b.offset, length: b.length };
    if (blockTable.size < 1 << 20) blockTable.set(id, range);
    return range;
  },
});
const lock = new LockServer({ holderId: 'kv-holder', lockTimeoutMs: 30_000, maxBlocksPerSession: 8192, ...grants.lockServerOptions, logger: silentLogger });
const lockPort = await lock.listen('127.0.0.1:0');

/**
 * The spec of an engine.grant over `n` scattered `size`-byte ranges of the region. `sorted`:
 * ranges at stride 7919 blocks, in offset order (the overlap check is then one pass);
 * unsorted: the order of a real lease's blocks, layer-major with random block ids per layer
 * (kv-shape.ts scatter, {@link grantLayers} layers), so offsets rise across layers only.
 * `blocks`: the same ranges as a block grant (blocks of `size` by index, what engineGrants makes
 * of a lease on the region's grid), else as a range grant (a Float64Array of ranges).
 */
function grantSpec(n: number, size: number, sorted: boolean, blocks: boolean): GrantSpec {
  let offsets: number[] | Float64Array;
  if (sorted) {
    const slots = Math.floor(regionBytes / size);
    offsets = Array.from({ length: n }, (_, k) => ((k * 7919) % slots) * size).sort((x, y) => x - y);
  } else {
    const layers = grantLayers(n);
    offsets = scatter({ blockBytes: size, layers, blocks: n / layers }, regionBytes, rng(0x9e3779b9 ^ n));
  }
  if (blocks) return { registration: reg, blockBytes: size, blocks: Uint32Array.from(offsets, (o) => o / size) };
  const ranges = new Float64Array(n * 3);
  for (let k = 0; k < n; k++) ranges.set([0, offsets[k] as number, size], k * 3);
  return { registrations: [reg], ranges };
}

/**
 * µs per engine.grant (and per revoke) for each of `sizes` ranges, median of `runs` samples
 * each, the sizes interleaved sample by sample (a grant over 10 ranges and one over 10,000 are
 * measured at the same time: the flatness ratio compares them).
 */
async function grantCosts(sizes: readonly number[], size: number, sorted: boolean, blocks: boolean, runs: number): Promise<{ grantUs: number; revokeUs: number }[]> {
  const specs = sizes.map((n) => grantSpec(n, size, sorted, blocks));
  const g: number[][] = sizes.map(() => []);
  const r: number[][] = sizes.map(() => []);
  for (let i = 0; i < runs; i++) {
    for (let j = 0; j < specs.length; j++) {
      // Rotating the order each run, so no size always follows the same one.
      const k = (i + j) % specs.length;
      const t0 = process.hrtime.bigint();
      const grant = await engine.grant(specs[k] as GrantSpec);
      const t1 = process.hrtime.bigint();
      await grant.revoke();
      const t2 = process.hrtime.bigint();
      (g[k] as number[]).push(Number(t1 - t0) / 1e3);
      (r[k] as number[]).push(Number(t2 - t1) / 1e3);
    }
  }
  const med = (x: number[]): number => x.sort((a, b) => a - b)[Math.floor(x.length / 2)] as number;
  return sizes.map((_, k) => ({ grantUs: med(g[k] as number[]), revokeUs: med(r[k] as number[]) }));
}

/** The way before range grants: one engine registration per block per lease (µs each), and its revoke. */
async function registerCost(n: number, size: number): Promise<{ grantUs: number; revokeUs: number }> {
  const slots = Math.floor(regionBytes / size);
  const t0 = process.hrtime.bigint();
  const regs = [];
  for (let k = 0; k < n; k++) {
    const off = ((k * 7919) % slots) * size;
    regs.push(await engine.register({ kind: 'host', buffer: region.subarray(off, off + size) }));
  }
  const t1 = process.hrtime.bigint();
  for (const x of regs) await x.revoke();
  const t2 = process.hrtime.bigint();
  return { grantUs: Number(t1 - t0) / 1e3 / n, revokeUs: Number(t2 - t1) / 1e3 / n };
}

ipc.send({
  type: 'ready',
  endpoint: Buffer.from(engine.endpoint()).toString('base64'),
  descriptor: Buffer.from(reg.descriptor).toString('base64'),
  rawPort: (raw.address() as net.AddressInfo).port,
  lockAddress: `127.0.0.1:${lockPort}`,
  transports: reg.transports,
  notes: [...built.notes, ...[...reg.skipped].map(([t, why]) => `holder region not registered with ${t}: ${why}`)],
});
ipc.onMessage((m) => {
  if (m['type'] === 'stop') {
    raw.close();
    void lock
      .close({ graceMs: 0 })
      .then(() => grants.settled())
      .then(() => engine.close())
      .then(() => process.exit(0));
  }
  if (m['type'] === 'grant-cost') {
    const size = Number(m['blockBytes']);
    const run = async (): Promise<void> => {
      type Row = { ranges: number; layers?: number; grantUs: number; revokeUs: number };
      const rows: Row[] = [];
      const unsorted: Row[] = [];
      const blockRows: Row[] = [];
      const blockUnsorted: Row[] = [];
      // Per form and order, every size interleaved sample by sample (see grantCosts).
      const sizes = m['ranges'] as number[];
      const runs = Number(m['runs'] ?? 200);
      for (const [sorted, blocks, out] of [
        [true, false, rows],
        [true, true, blockRows],
        [false, false, unsorted],
        [false, true, blockUnsorted],
      ] as const) {
        const costs = await grantCosts(sizes, size, sorted, blocks, runs);
        for (const [k, n] of sizes.entries()) out.push({ ranges: n, ...(sorted ? {} : { layers: grantLayers(n) }), ...(costs[k] as { grantUs: number; revokeUs: number }) });
      }
      const perBlock = await registerCost(Number(m['registerBlocks']), size);
      ipc.send({ type: 'grant-cost', rows, unsorted, blockRows, blockUnsorted, perBlock, counters: grants.counters(), lock: lock.counters() });
    };
    run().catch((e: unknown) => ipc.send({ type: 'grant-cost', error: e instanceof Error ? e.message : String(e) }));
  }
});
