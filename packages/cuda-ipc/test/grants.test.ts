/**
 * Range grants of the cuda-ipc transport (register once, grant per lease; invariants 13, 15, 10,
 * 9): one grant table record per grant, never a segment per grant; reads by range index land the
 * right bytes; no byte outside the granted ranges is reachable (the engine's check, the native
 * check against the grant's own range table, forged payloads, a hostile table); revocation is
 * O(1), exactly once, drains in-flight batches (across processes) and survives record reuse (ABA).
 */
import { fork, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { once } from 'node:events';
import { existsSync, readdirSync, statSync } from 'node:fs';
import fc from 'fast-check';
import { afterAll, describe, expect, it } from 'vitest';
import {
  GRANT_STRIDE,
  InvalidInputError,
  RemoteRejectedError,
  ResourceExhaustedError,
  TimedOutError,
  TransferEngine,
  createTransferBatch,
  decodeDescriptor,
  defaultHostId,
  encodeDescriptor,
  silentLogger,
  type Registration,
  type TransportHost,
} from '@tensorwire/core';
import { CudaIpcTransport, TensorPool, allocateSharedMemory, decodePayload, native, releaseSharedMemory } from '../src/index.js';
import { fixture, killChildren, uniqueOwner } from './helpers.js';
import { failure } from './pool-fixtures.js';

const pid = process.pid;
const BLOCK = 4096;
const pattern = (x: number): number => (x * 31 + (x >> 8) + 7) & 255;

const engines: TransferEngine[] = [];
afterAll(async () => {
  killChildren();
  await Promise.all(engines.map((e) => e.close()));
});

let nodes = 0;
async function engine(transport = new CudaIpcTransport(), extra: Record<string, unknown> = {}): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId: `g${++nodes}x${pid}`, transports: [transport], logger: silentLogger, metrics: false, ...extra });
  await e.start();
  engines.push(e);
  return e;
}

function shmNames(): string[] {
  return readdirSync('/dev/shm').filter((n) => n.startsWith('tw-'));
}

/** Set a u32 (little-endian) of a mapping; returns what puts the old value back. */
function swap32(dv: DataView, at: number, value: number): () => void {
  const old = dv.getUint32(at, true);
  dv.setUint32(at, value, true);
  return () => dv.setUint32(at, old, true);
}

/** The same for a byte. */
function swap8(dv: DataView, at: number, value: number): () => void {
  const old = dv.getUint8(at);
  dv.setUint8(at, value);
  return () => dv.setUint8(at, old);
}

function payloadOf(descriptor: Uint8Array): Uint8Array {
  return decodeDescriptor(descriptor).transports.get('cuda-ipc') as Uint8Array;
}

function thrown(f: () => unknown): unknown {
  try {
    f();
  } catch (e) {
    return e;
  }
  return undefined;
}

function withPayload(descriptor: Uint8Array, payload: Uint8Array): Uint8Array {
  return encodeDescriptor({ ...decodeDescriptor(descriptor), transports: new Map([['cuda-ipc', payload]]) });
}

/** Where the fields of a range-grant payload are (big-endian: magic, version, kind, mode, str8 table, u32 record, u64 generation, token, u32 count, u64 length). */
function fields(p: Uint8Array): { table: string; record: number; generation: number; at: { record: number; generation: number; token: number; table: number } } {
  const nameLen = p[7] as number;
  const at = { table: 8, record: 8 + nameLen, generation: 12 + nameLen, token: 20 + nameLen };
  const dv = new DataView(p.buffer, p.byteOffset, p.byteLength);
  return { table: Buffer.from(p.subarray(8, 8 + nameLen)).toString('latin1'), record: dv.getUint32(at.record), generation: Number(dv.getBigUint64(at.generation)), at };
}

/** The owner's table of a range-grant payload, mapped by the test (same uid): a hostile owner, or a look at the counters. */
function tableOf(payload: Uint8Array): { mapping: ArrayBuffer; dv: DataView; record: number; recordAt: number; dirAt: number; arenaAt: number } {
  const f = fields(payload);
  const mapping = native.shmOpen(f.table, 2 ** 33);
  const dv = new DataView(mapping);
  const records = dv.getUint32(1024, true);
  const dir = dv.getUint32(1028, true);
  const dirAt = 4096 + records * 64;
  return { mapping, dv, record: f.record, recordAt: 4096 + f.record * 64, dirAt, arenaAt: dirAt + dir * 256 };
}

function message<T>(child: ChildProcess, pred: (m: Record<string, unknown>) => boolean): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const onMessage = (m: Record<string, unknown>): void => {
      if (!pred(m)) return;
      child.off('message', onMessage);
      child.off('exit', onExit);
      resolve(m as T);
    };
    const onExit = (): void => reject(new Error('child exited'));
    child.on('message', onMessage);
    child.once('exit', onExit);
  });
}

describe('cuda-ipc range grants', () => {
  it('a grant over 1,000 blocks of one shared region is one record (no segment per grant) with a small payload; range k reads block k exactly', async () => {
    const tb = new CudaIpcTransport();
    const a = await engine();
    const b = await engine(tb);
    const n = 2000;
    const region = allocateSharedMemory(n * BLOCK, 'grants');
    for (let i = 0; i < region.length; i++) region[i] = pattern(i);
    const reg = await b.register({ kind: 'host', buffer: region });
    const before = shmNames();
    const picked = Array.from({ length: 1000 }, (_, k) => (k * 7) % n); // distinct, scattered
    const g = await b.grant(picked.map((slot) => ({ registration: reg, offset: slot * BLOCK, length: BLOCK })));
    const created = shmNames().filter((x) => !before.includes(x));
    expect(created).toHaveLength(1);
    expect(created[0]).toMatch(/^tw-t\./);
    expect(statSync(`/dev/shm/${created[0]}`).mode & 0o777).toBe(0o600);
    // The payload names the table, the record, its generation and the token: no range in it.
    expect(payloadOf(g.descriptor).length).toBeLessThan(128);
    expect(g.descriptor.length).toBeLessThan(256);
    // More grants are more records in the same table.
    const more = await Promise.all(Array.from({ length: 10 }, (_, i) => b.grant([{ registration: reg, offset: i * BLOCK, length: 100 }])));
    expect(shmNames().length).toBe(before.length + 1);
    expect(tb.grantTables()).toHaveLength(1);
    expect(tb.grantTables()[0]?.live).toBe(11);

    const dst = new Uint8Array(1000 * BLOCK);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const report = await a.read(
      b.endpoint(),
      picked.map((_, k) => ({ local: ra, localOffset: k * BLOCK, remote: g.descriptor, range: k, length: BLOCK })),
    );
    expect(report.transport).toBe('cuda-ipc');
    for (const [k, slot] of picked.entries()) {
      expect(Buffer.compare(dst.subarray(k * BLOCK, (k + 1) * BLOCK), region.subarray(slot * BLOCK, (slot + 1) * BLOCK)), `range ${k}`).toBe(0);
    }
    // Parts of ranges: the offset is inside the range.
    dst.fill(0);
    await a.read(b.endpoint(), [
      { local: ra, localOffset: 0, remote: g.descriptor, range: 999, remoteOffset: 4000, length: 96 },
      { local: ra, localOffset: 100, remote: g.descriptor, range: 0, remoteOffset: 1, length: 1 },
    ]);
    const last = (picked[999] as number) * BLOCK;
    expect(Buffer.compare(dst.subarray(0, 96), region.subarray(last + 4000, last + 4096))).toBe(0);
    expect(dst[100]).toBe(region[1]);
    // A write through a grant of plain shared memory lands in its range only.
    const src = new Uint8Array(64).fill(0xab);
    const rs = await a.register({ kind: 'host', buffer: src });
    await a.write(b.endpoint(), [{ local: rs, remote: g.descriptor, range: 2, remoteOffset: 10, length: 64 }]);
    const at2 = (picked[2] as number) * BLOCK;
    expect(region.subarray(at2 + 10, at2 + 74).every((x) => x === 0xab)).toBe(true);
    expect(region[at2 + 9]).toBe(pattern(at2 + 9));
    expect(region[at2 + 74]).toBe(pattern(at2 + 74));

    await g.revoke();
    await Promise.all(more.map((x) => x.revoke()));
    expect(tb.grantTables()[0]?.live).toBe(0);
    const err = await failure(a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 0, length: BLOCK }]));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('revoked');
    await reg.revoke();
    releaseSharedMemory(region);
  });

  it('a grant over 1,000 pool slots (one registration each) reads by index; slots stay read-only to peers', async () => {
    const pool = new TensorPool({ owner: uniqueOwner('gp') });
    const a = await engine();
    const b = await engine();
    const views = [];
    const regs: Registration[] = [];
    try {
      for (let i = 0; i < 1000; i++) {
        const id = await pool.register({ dtype: 'uint8', shape: [BLOCK] });
        pool.writeSync(
          id,
          Uint8Array.from({ length: BLOCK }, (_, x) => pattern(x + i)),
        );
        const view = pool.readSync(id);
        views.push(view);
        regs.push(await b.register({ kind: 'host', buffer: view.buffer as Uint8Array }));
      }
      // Range k is slot 999 - k.
      const g = await b.grant(regs.map((_, k) => ({ registration: regs[999 - k] as Registration })));
      expect(g.rangeCount).toBe(1000);
      const dst = new Uint8Array(1000 * BLOCK);
      const ra = await a.register({ kind: 'host', buffer: dst });
      await a.read(
        b.endpoint(),
        regs.map((_, k) => ({ local: ra, localOffset: k * BLOCK, remote: g.descriptor, range: k, length: BLOCK })),
      );
      for (let k = 0; k < 1000; k++) {
        const slot = 999 - k;
        const got = dst.subarray(k * BLOCK, (k + 1) * BLOCK);
        let same = true;
        for (let x = 0; x < BLOCK; x++) if (got[x] !== pattern(x + slot)) same = false;
        expect(same, `range ${k} (slot ${slot})`).toBe(true);
      }
      // Parts of slots, out of order, in one batch.
      dst.fill(0);
      await a.read(b.endpoint(), [
        { local: ra, localOffset: 0, remote: g.descriptor, range: 500, remoteOffset: 100, length: 50 },
        { local: ra, localOffset: 50, remote: g.descriptor, range: 3, remoteOffset: 0, length: 50 },
      ]);
      for (let x = 0; x < 50; x++) expect(dst[x]).toBe(pattern(100 + x + 499));
      for (let x = 0; x < 50; x++) expect(dst[50 + x]).toBe(pattern(x + 996));
      // A one-sided write into a pool slot would bypass its seqlock: refused, naming the request.
      const err = await failure(
        a.write(b.endpoint(), [
          { local: ra, remote: g.descriptor, range: 7, length: 16 },
          { local: ra, localOffset: 64, remote: g.descriptor, range: 8, length: 16 },
        ]),
      );
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('read-only');
      expect(err.details['request']).toBe(0);
      expect((views[992]?.buffer as Uint8Array).every((x, i) => x === pattern(i + 992))).toBe(true);
      await g.revoke();
    } finally {
      for (const v of views) v.dispose();
      await Promise.all(regs.map((r) => r.revoke()));
      await pool.close();
    }
  });

  it('no byte outside the granted ranges: the engine refuses, the native check refuses against the grant’s own table, forged payloads are refused', async () => {
    const hosts: TransportHost[] = ['oa', 'ob'].map((n) => ({ identity: { nodeId: `${n}${pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
    const [ta, tb] = [new CudaIpcTransport(), new CudaIpcTransport()];
    await ta.start(hosts[0] as TransportHost);
    await tb.start(hosts[1] as TransportHost);
    const region = allocateSharedMemory(64 * BLOCK, 'grantsob');
    for (let i = 0; i < region.length; i++) region[i] = pattern(i);
    try {
      const reg = await tb.register({ kind: 'host', buffer: region });
      // Ranges k = block 2k (gaps between them), 4 ranges.
      const ranges = new Float64Array(4 * GRANT_STRIDE);
      for (let k = 0; k < 4; k++) ranges.set([0, 2 * k * BLOCK, BLOCK], k * GRANT_STRIDE);
      const g = tb.grant({ handles: [reg.handle], count: 4, ranges, bytes: 4 * BLOCK }) as { handle: object; payload: Uint8Array };
      const lengths = Float64Array.of(BLOCK, BLOCK, BLOCK, BLOCK);
      const remote = ta.decodeRemote(g.payload, 'host', 4 * BLOCK, lengths);
      const dst = new Uint8Array(2 * BLOCK).fill(0xee);
      const local = await ta.register({ kind: 'host', buffer: dst });
      const conn = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { signal: new AbortController().signal, deadline: Date.now() + 10_000, streams: 1 });
      const opts = { signal: new AbortController().signal, deadline: Date.now() + 10_000 };
      const one = (remoteRange: number, remoteOffset: number, length: number, r: unknown = remote) =>
        conn.execute(0, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote: r, remoteOffset, length, remoteRange, request: 5 }]), opts);
      await one(1, 0, BLOCK);
      expect(Buffer.compare(dst.subarray(0, BLOCK), region.subarray(2 * BLOCK, 3 * BLOCK))).toBe(0);
      dst.fill(0xee);
      // Past the granted range, though inside the region (the next block is not granted).
      for (const [rr, off, len] of [
        [1, BLOCK - 3, 8],
        [1, 0, BLOCK + 1],
        [3, BLOCK, 1],
        [0, 2 ** 52, 1],
      ] as const) {
        const err = await failure(one(rr, off, len));
        expect(err, `${rr}: ${off}+${len}`).toBeInstanceOf(RemoteRejectedError);
        expect((err as RemoteRejectedError).remoteCode).toBe('bounds');
        expect(err.details['request']).toBe(5);
      }
      // A range index the grant does not have, in a batch where another grant's ranges follow
      // this one's in the span table (so range 4 of the first would be range 0 of the second).
      const other = tb.grant({ handles: [reg.handle], count: 4, ranges, bytes: 4 * BLOCK }) as { handle: object; payload: Uint8Array };
      const otherRemote = ta.decodeRemote(other.payload, 'host', 4 * BLOCK, lengths);
      const noRange = await failure(
        conn.execute(
          0,
          createTransferBatch('read', [
            { local: local.handle, localOffset: 0, remote, remoteOffset: 0, length: 16, remoteRange: 4, request: 5 },
            { local: local.handle, localOffset: BLOCK, remote: otherRemote, remoteOffset: 0, length: 16, remoteRange: 0, request: 6 },
          ]),
          opts,
        ),
      );
      expect(noRange).toBeInstanceOf(InvalidInputError);
      expect(noRange.details['request']).toBe(5);
      expect(dst.every((x) => x === 0xee)).toBe(true);
      // Lying range lengths (a longer range 1) change nothing: the table bounds every range.
      const liar = ta.decodeRemote(g.payload, 'host', 5 * BLOCK, Float64Array.of(BLOCK, 2 * BLOCK, BLOCK, BLOCK));
      const lie = await failure(one(1, BLOCK, 16, liar));
      expect((lie as RemoteRejectedError).remoteCode).toBe('bounds');
      await one(1, 16, 16, liar);
      expect(Buffer.compare(dst.subarray(0, 16), region.subarray(2 * BLOCK + 16, 2 * BLOCK + 32))).toBe(0);
      dst.fill(0xee);

      // Forged payloads, each decoded afresh (a new peer's view of them).
      const g2 = tb.grant({ handles: [reg.handle], count: 4, ranges, bytes: 4 * BLOCK }) as { handle: object; payload: Uint8Array };
      const f = fields(g.payload);
      const f2 = fields(g2.payload);
      expect(f2.record).not.toBe(f.record);
      expect(f2.generation).toBe(f.generation); // fresh records: only the token tells them apart
      const forge = (mutate: (q: Uint8Array, dv: DataView) => void): Uint8Array => {
        const q = g.payload.slice();
        mutate(q, new DataView(q.buffer));
        return q;
      };
      const cases: [string, Uint8Array, string][] = [
        ['another live record (another grant’s)', forge((_q, dv) => dv.setUint32(f.at.record, f2.record)), 'bad-token'],
        ['a free record', forge((_q, dv) => dv.setUint32(f.at.record, 4000)), 'revoked'],
        ['a record past the table', forge((_q, dv) => dv.setUint32(f.at.record, 2 ** 32 - 1)), 'bad-grant'],
        ['another generation', forge((_q, dv) => dv.setBigUint64(f.at.generation, BigInt(f.generation + 1))), 'revoked'],
        ['a flipped token bit', forge((q) => (q[f.at.token + 9] = (q[f.at.token + 9] as number) ^ 0x10)), 'bad-token'],
        ['only the token changed', forge((q) => q.set(randomBytes(16), f.at.token)), 'bad-token'],
        ['a table that does not exist', forge((q) => (q[f.at.table + 30] = q[f.at.table + 30] === 0x61 ? 0x62 : 0x61)), 'unknown-grant'],
        // The byte total is checked against the grant's own table, not the (forgeable) descriptor's byte length.
        ['a byte total one more', forge((_q, dv) => dv.setBigUint64(f.at.token + 20, BigInt(4 * BLOCK + 1))), 'bad-grant'],
        ['a byte total one less', forge((_q, dv) => dv.setBigUint64(f.at.token + 20, BigInt(4 * BLOCK - 1))), 'bad-grant'],
      ];
      // A range count that disagrees with the descriptor's range lengths does not decode; one
      // that agrees with forged lengths decodes, and the grant's own table refuses it.
      const fiveRanges = forge((_q, dv) => dv.setUint32(f.at.token + 16, 5));
      for (const n of [4, 3]) {
        let e: unknown;
        try {
          ta.decodeRemote(n === 4 ? fiveRanges : forge((_q, dv) => dv.setUint32(f.at.token + 16, n)), 'host', 4 * BLOCK, lengths);
        } catch (x) {
          e = x;
        }
        expect(e, `count ${n === 4 ? 5 : n} with 4 range lengths`).toBeInstanceOf(InvalidInputError);
        expect((e as InvalidInputError).details['field']).toBe('count');
      }
      cases.push(['a range count one more (and a range length more)', fiveRanges, 'bad-grant']);
      const table = tableOf(g.payload);
      for (const [label, payload, code] of cases) {
        const forged = payload === fiveRanges ? ta.decodeRemote(payload, 'host', 5 * BLOCK, Float64Array.of(BLOCK, BLOCK, BLOCK, BLOCK, BLOCK)) : ta.decodeRemote(payload, 'host', 4 * BLOCK, lengths);
        const err = await failure(one(0, 0, BLOCK, forged));
        expect(err, label).toBeInstanceOf(RemoteRejectedError);
        expect((err as RemoteRejectedError).remoteCode, label).toBe(code);
        expect(err.details['request'], label).toBe(5);
        expect(dst.every((x) => x === 0xee), `${label}: no byte moved`).toBe(true);
        expect(native.recordActive(table.mapping, table.recordAt), label).toBe(0);
        expect(native.recordActive(table.mapping, 4096 + f2.record * 64), label).toBe(0);
      }
      // The genuine payloads still work, each through its own record.
      await one(0, 0, BLOCK);
      await one(0, 0, BLOCK, ta.decodeRemote(g2.payload, 'host', 4 * BLOCK, lengths));

      // A batch that cached the grant's range table is refused once it is revoked (the native
      // check enters the record on every post).
      const batch = createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote, remoteOffset: 0, length: BLOCK, remoteRange: 2 }]);
      await conn.execute(0, batch, opts);
      await tb.revokeGrant(g.handle);
      dst.fill(0xee);
      const revoked = await failure(conn.execute(0, batch, opts));
      expect((revoked as RemoteRejectedError).remoteCode).toBe('revoked');
      expect(dst.every((x) => x === 0xee)).toBe(true);
      // Wrong handles.
      await expect(tb.revokeGrant({})).rejects.toBeInstanceOf(InvalidInputError);
      await expect(ta.revokeGrant(g2.handle)).rejects.toBeInstanceOf(InvalidInputError);
      await Promise.all([tb.revokeGrant(other.handle), tb.revokeGrant(g2.handle)]);
      await conn.close();
    } finally {
      await Promise.all([ta.close(), tb.close()]);
      releaseSharedMemory(region);
    }
  });

  it('revoke is exactly once; a revoked record reused by a new grant refuses the old payload; full tables grow, then exhaust', async () => {
    const tb = new CudaIpcTransport({ grantTable: { records: 2, segments: 4, rangeBytes: 4096, maxTables: 2 } });
    const a = await engine();
    const b = await engine(tb);
    const region = allocateSharedMemory(64 * BLOCK, 'grantsaba');
    for (let i = 0; i < region.length; i++) region[i] = pattern(i);
    const reg = await b.register({ kind: 'host', buffer: region });
    const dst = new Uint8Array(4 * BLOCK);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const g1 = await b.grant([
      { registration: reg, offset: 0, length: 1024 },
      { registration: reg, offset: 8192, length: 1024 },
    ]);
    await a.read(b.endpoint(), [{ local: ra, remote: g1.descriptor, range: 1, length: 1024 }]); // the requester caches g1's range table
    expect(Buffer.compare(dst.subarray(0, 1024), region.subarray(8192, 9216))).toBe(0);
    await Promise.all([g1.revoke(), g1.revoke()]);
    await g1.revoke();
    expect(tb.grantTables()[0]?.freeRecords).toBe(2);
    // The revoked record now holds a zeroed token at the next generation: a payload forged to
    // match that is refused too (the record is not live).
    const zeroed = payloadOf(g1.descriptor).slice();
    const pz = fields(zeroed);
    new DataView(zeroed.buffer).setBigUint64(pz.at.generation, BigInt(pz.generation + 1));
    zeroed.fill(0, pz.at.token, pz.at.token + 16);
    const dead = await failure(a.read(b.endpoint(), [{ local: ra, remote: withPayload(g1.descriptor, zeroed), range: 0, length: 1024 }]));
    expect((dead as RemoteRejectedError).remoteCode).toBe('revoked');
    // The record comes back at the next generation; the old payload is refused even though the
    // requester cached its range table, and the new grant reads its own ranges.
    const g2 = await b.grant([{ registration: reg, offset: 16384, length: 2048 }]);
    const [p1, p2] = [fields(payloadOf(g1.descriptor)), fields(payloadOf(g2.descriptor))];
    expect(p2.record).toBe(p1.record);
    expect(p2.table).toBe(p1.table);
    expect(p2.generation).toBe(p1.generation + 1);
    dst.fill(0);
    const stale = await failure(a.read(b.endpoint(), [{ local: ra, remote: g1.descriptor, range: 0, length: 1024 }]));
    expect(stale).toBeInstanceOf(RemoteRejectedError);
    expect((stale as RemoteRejectedError).remoteCode).toBe('revoked');
    expect(dst.every((x) => x === 0)).toBe(true);
    await a.read(b.endpoint(), [{ local: ra, remote: g2.descriptor, range: 0, length: 2048 }]);
    expect(Buffer.compare(dst.subarray(0, 2048), region.subarray(16384, 18432))).toBe(0);
    // The payload of g1 with g2's generation (the old token) is refused too.
    const q = payloadOf(g1.descriptor).slice();
    new DataView(q.buffer).setBigUint64(p1.at.generation, BigInt(p2.generation));
    const oldToken = await failure(a.read(b.endpoint(), [{ local: ra, remote: withPayload(g1.descriptor, q), range: 0, length: 1024 }]));
    expect((oldToken as RemoteRejectedError).remoteCode).toBe('bad-token');
    // Exactly once: the next grant takes the other record, then the table is full and a second
    // (twice as large) table is made.
    const g3 = await b.grant([{ registration: reg, offset: 0, length: 10 }]);
    expect(fields(payloadOf(g3.descriptor)).record).not.toBe(p2.record);
    expect(tb.grantTables()).toHaveLength(1);
    const g4 = await b.grant([{ registration: reg, offset: 4 * BLOCK, length: 100 }]);
    expect(tb.grantTables()).toHaveLength(2);
    expect(tb.grantTables()[1]?.geometry.records).toBe(4);
    expect(fields(payloadOf(g4.descriptor)).table).not.toBe(p2.table);
    await a.read(b.endpoint(), [{ local: ra, remote: g4.descriptor, range: 0, length: 100 }]);
    expect(Buffer.compare(dst.subarray(0, 100), region.subarray(4 * BLOCK, 4 * BLOCK + 100))).toBe(0);
    const rest = [];
    for (let i = 0; i < 3; i++) rest.push(await b.grant([{ registration: reg, offset: i, length: 1 }]));
    // Both tables full, no third allowed: backpressure, a typed error.
    await expect(b.grant([{ registration: reg, offset: 0, length: 1 }], { transports: ['cuda-ipc'] })).rejects.toBeInstanceOf(ResourceExhaustedError);
    await Promise.all([g2, g3, g4, ...rest].map((g) => g.revoke()));
    expect(tb.grantTables().map((t) => t.live)).toEqual([0, 0]);
    expect(tb.grantTables().map((t) => t.freeRangeBytes)).toEqual([4096, 8192]);
    await reg.revoke();
    releaseSharedMemory(region);
  });

  it('a revoke whose drain times out (a peer stuck inside) resolves, and the record is retired, never reused', async () => {
    const warnings: string[] = [];
    const logger = { ...silentLogger, warn: (m: string) => void warnings.push(m) };
    const tb = new CudaIpcTransport({ revokeTimeoutMs: 50, grantTable: { records: 2 } });
    const b = await engine(tb, { logger }); // the transport logs through its engine's logger
    const region = allocateSharedMemory(BLOCK, 'grantsstuck');
    const reg = await b.register({ kind: 'host', buffer: region });
    const g = await b.grant([{ registration: reg, offset: 0, length: 100 }]);
    // A peer that entered the record and died there: its in-flight count never drops.
    const p = payloadOf(g.descriptor);
    const f = fields(p);
    const t = tableOf(p);
    expect(native.recordEnter(t.mapping, t.recordAt, f.generation, p.slice(f.at.token, f.at.token + 16))).toBe(0);
    await g.revoke();
    expect(warnings.some((w) => /revoke timed out/.test(w))).toBe(true);
    const [table] = tb.grantTables();
    expect(table?.live).toBe(0);
    expect(table?.freeRecords).toBe(1); // the stuck record did not come back
    const g2 = await b.grant([{ registration: reg, offset: 0, length: 100 }]);
    expect(fields(payloadOf(g2.descriptor)).record).not.toBe(f.record);
    await b.grant([{ registration: reg, offset: 200, length: 100 }]); // no free record left here: a second table
    expect(tb.grantTables()).toHaveLength(2);
    native.recordLeave(t.mapping, t.recordAt);
    await reg.revoke();
    releaseSharedMemory(region);
  });

  it('revoking a registration through the transport revokes the range grants over it first', async () => {
    const hosts: TransportHost[] = ['ra', 'rb'].map((n) => ({ identity: { nodeId: `${n}${pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
    const [ta, tb] = [new CudaIpcTransport(), new CudaIpcTransport()];
    await ta.start(hosts[0] as TransportHost);
    await tb.start(hosts[1] as TransportHost);
    const r1 = allocateSharedMemory(BLOCK, 'grantsrv');
    const r2 = allocateSharedMemory(BLOCK, 'grantsrv');
    try {
      const reg1 = await tb.register({ kind: 'host', buffer: r1 });
      const reg2 = await tb.register({ kind: 'host', buffer: r2 });
      const both = tb.grant({ handles: [reg1.handle, reg2.handle], count: 2, ranges: Float64Array.of(0, 0, 100, 1, 0, 100), bytes: 200 }) as { handle: object; payload: Uint8Array };
      const only2 = tb.grant({ handles: [reg2.handle], count: 1, ranges: Float64Array.of(0, 0, 100), bytes: 100 }) as { handle: object; payload: Uint8Array };
      const dst = new Uint8Array(100);
      const local = await ta.register({ kind: 'host', buffer: dst });
      const conn = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { signal: new AbortController().signal, deadline: Date.now() + 10_000, streams: 1 });
      const opts = { signal: new AbortController().signal, deadline: Date.now() + 10_000 };
      const read = (payload: Uint8Array, lengths: Float64Array, rr: number) =>
        conn.execute(0, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote: ta.decodeRemote(payload, 'host', 100 * lengths.length, lengths), remoteOffset: 0, length: 100, remoteRange: rr }]), opts);
      await read(both.payload, Float64Array.of(100, 100), 1);
      await tb.revoke(reg1.handle);
      expect(((await failure(read(both.payload, Float64Array.of(100, 100), 1))) as RemoteRejectedError).remoteCode).toBe('revoked');
      await read(only2.payload, Float64Array.of(100), 0);
      // A revoked registration cannot be granted again.
      expect(() => tb.grant({ handles: [reg1.handle], count: 1, ranges: Float64Array.of(0, 0, 1), bytes: 1 })).toThrow(InvalidInputError);
      // Local-only memory and foreign handles are refused.
      const plain = await tb.register({ kind: 'host', buffer: new Uint8Array(64) });
      expect(() => tb.grant({ handles: [plain.handle], count: 1, ranges: Float64Array.of(0, 0, 1), bytes: 1 })).toThrow(/local use only/);
      expect(() => tb.grant({ handles: [{}], count: 1, ranges: Float64Array.of(0, 0, 1), bytes: 1 })).toThrow(InvalidInputError);
      expect(() => tb.grant({ handles: [reg2.handle], count: 1, ranges: Float64Array.of(0, BLOCK - 50, 51), bytes: 51 })).toThrow(InvalidInputError);
      // revokeGrant is exactly once, however often it is called: the record goes back once.
      const free = tb.grantTables()[0]?.freeRecords as number;
      const x = tb.grant({ handles: [reg2.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 }) as { handle: object; payload: Uint8Array };
      await read(x.payload, Float64Array.of(8), 0).catch(() => undefined);
      await Promise.all([tb.revokeGrant(x.handle), tb.revokeGrant(x.handle)]);
      await tb.revokeGrant(x.handle);
      expect(tb.grantTables()[0]?.freeRecords).toBe(free);
      const y = tb.grant({ handles: [reg2.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 }) as { handle: object; payload: Uint8Array };
      const z = tb.grant({ handles: [reg2.handle], count: 1, ranges: Float64Array.of(0, 8, 8), bytes: 8 }) as { handle: object; payload: Uint8Array };
      expect(fields(y.payload).record).not.toBe(fields(z.payload).record);
      await tb.revoke(reg2.handle);
      expect(tb.grantTables()[0]?.live).toBe(0);
      await conn.close();
    } finally {
      await Promise.all([ta.close(), tb.close()]);
      releaseSharedMemory(r1);
      releaseSharedMemory(r2);
    }
  });

  it('a hostile grant table (invariant 10) is refused with a typed error, never read past what the reader learned itself', async () => {
    const tb = new CudaIpcTransport();
    const a = await engine();
    const b = await engine(tb);
    const region = allocateSharedMemory(8 * BLOCK, 'grantshost');
    region.fill(9);
    const reg = await b.register({ kind: 'host', buffer: region });
    const dst = new Uint8Array(BLOCK).fill(0xee);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const read = (descriptor: Uint8Array, e = a) => e.read(b.endpoint(), [{ local: ra, remote: descriptor, range: 0, length: 16 }]);
    const u64 = (dv: DataView, at: number): number => dv.getUint32(at, true) + dv.getUint32(at + 4, true) * 2 ** 32;
    const tampers: [string, (t: ReturnType<typeof tableOf>, range0: number) => () => void, string][] = [
      ['a range count other than the payload’s', (t) => swap32(t.dv, t.recordAt + 40, 3), 'bad-grant'],
      ['a range table outside the arena', (t) => swap32(t.dv, t.recordAt + 36, 1), 'bad-grant'],
      ['a range over the segment header', (t, r0) => swap32(t.dv, r0 + 8, 0), 'bounds'],
      ['a range past the segment', (t, r0) => swap32(t.dv, r0 + 16, 9 * BLOCK), 'bounds'],
      ['a directory index past the directory', (t, r0) => swap32(t.dv, r0, 100_000), 'bad-grant'],
      ['a free directory entry', (t, r0) => swap32(t.dv, t.dirAt + t.dv.getUint32(r0, true) * 256, 0), 'bad-grant'],
      ['a directory entry naming a non-data segment', (t, r0) => swap8(t.dv, t.dirAt + t.dv.getUint32(r0, true) * 256 + 17 + 4, 0x6e /* /tw-p. -> /tw-n. */), 'bad-grant'],
    ];
    for (const [label, tamper, code] of tampers) {
      const g = await b.grant([{ registration: reg, offset: BLOCK, length: BLOCK }]);
      const t = tableOf(payloadOf(g.descriptor));
      const range0 = t.arenaAt + u64(t.dv, t.recordAt + 32);
      const restore = tamper(t, range0);
      const err = await failure(read(g.descriptor));
      restore();
      expect(err, label).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode, label).toBe(code);
      expect(dst.every((x) => x === 0xee), `${label}: no byte moved`).toBe(true);
      expect(native.recordActive(t.mapping, t.recordAt), label).toBe(0);
      await g.revoke();
    }
    // A table whose geometry does not add up to its size, seen by a new peer.
    const g = await b.grant([{ registration: reg, offset: 0, length: BLOCK }]);
    const t = tableOf(payloadOf(g.descriptor));
    for (const [at, value] of [
      [1024, t.dv.getUint32(1024, true) + 1],
      [1028, 0],
      [1032, 3],
      // Only the size check sees this one: every offset stays where it was.
      [1032, t.dv.getUint32(1032, true) + 8],
    ] as const) {
      const restore = swap32(t.dv, at, value);
      const c = await engine();
      const rc = await c.register({ kind: 'host', buffer: new Uint8Array(16) });
      const err = await failure(c.read(b.endpoint(), [{ local: rc, remote: g.descriptor, range: 0, length: 16 }]));
      restore();
      expect(err, `ext ${at}`).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('bad-grant');
    }
    await read(g.descriptor);
    expect(dst.subarray(0, 16).every((x) => x === 9)).toBe(true);
    await g.revoke();
    await reg.revoke();
    releaseSharedMemory(region);
  });

  it('a block grant is one record whose table holds the block indices; reads land block blocks[k]; a hostile block table is refused', async () => {
    const a = await engine();
    const b = await engine();
    const BLOCKS = 16;
    const region = allocateSharedMemory(BLOCKS * BLOCK + 512, 'grantsblk');
    for (let i = 0; i < region.length; i++) region[i] = pattern(i);
    const reg = await b.register({ kind: 'host', buffer: region });
    const dst = new Uint8Array(4 * BLOCK).fill(0xee);
    const ra = await a.register({ kind: 'host', buffer: dst });
    // Blocks out of order, from base 512: range k is block blocks[k].
    const blocks = Uint32Array.of(9, 2, 15, 0);
    const g = await b.grant({ registration: reg, blockBytes: BLOCK, base: 512, blocks });
    expect(g.rangeCount).toBe(4);
    await a.read(b.endpoint(), [...blocks].map((_, k) => ({ local: ra, localOffset: k * BLOCK, remote: g.descriptor, range: k, length: BLOCK })));
    for (const [k, blk] of [...blocks].entries()) {
      expect(Buffer.compare(Buffer.from(dst.subarray(k * BLOCK, (k + 1) * BLOCK)), Buffer.from(region.subarray(512 + blk * BLOCK, 512 + (blk + 1) * BLOCK))), `range ${k}`).toBe(0);
    }
    // The record says "blocks"; its table is one range entry then the indices, as written.
    const t = tableOf(payloadOf(g.descriptor));
    expect(t.dv.getUint32(t.recordAt + 44, true)).toBe(1);
    const table = t.arenaAt + t.dv.getUint32(t.recordAt + 32, true) + t.dv.getUint32(t.recordAt + 36, true) * 2 ** 32;
    expect([0, 1, 2, 3].map((k) => t.dv.getUint32(table + 24 + 4 * k, true))).toEqual([...blocks]);
    expect(t.dv.getUint32(table + 16, true)).toBe(BLOCK);
    // Past a block (the descriptor says BLOCK bytes: the engine refuses first; the table is the peer's own bound).
    expect(await failure(a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 1, remoteOffset: 1, length: BLOCK }]))).toBeInstanceOf(InvalidInputError);
    // The payload's mode (3, blocks) must be the record's form: forged to 2 (ranges), the reader refuses.
    const p = payloadOf(g.descriptor);
    expect(p[6]).toBe(3);
    const asRanges = p.slice();
    asRanges[6] = 2;
    const c = await engine();
    const rc = await c.register({ kind: 'host', buffer: new Uint8Array(BLOCK) });
    const forged = await failure(c.read(b.endpoint(), [{ local: rc, remote: withPayload(g.descriptor, asRanges), range: 0, length: 16 }]));
    expect(forged).toBeInstanceOf(RemoteRejectedError);
    expect((forged as RemoteRejectedError).remoteCode).toBe('bad-grant');
    await g.revoke();
    // The transport bounds the indices it writes itself (its grant() is public): a block past the
    // registration is refused, naming it, and nothing is published.
    const tb = new CudaIpcTransport();
    await engine(tb);
    const small = await tb.register({ kind: 'host', buffer: region.subarray(0, 4 * BLOCK) });
    const ok = tb.grant({ handles: [small.handle], count: 2, bytes: 2 * BLOCK, ranges: new Float64Array(0), blocks: { base: 0, blockBytes: BLOCK, indices: Uint32Array.of(1, 3) } }) as { handle: object };
    await tb.revokeGrant(ok.handle);
    const before = tb.grantTables()[0]?.freeRecords;
    const arena = tb.grantTables()[0]?.freeRangeBytes;
    const bad = thrown(() => tb.grant({ handles: [small.handle], count: 2, bytes: 2 * BLOCK, ranges: new Float64Array(0), blocks: { base: 0, blockBytes: BLOCK, indices: Uint32Array.of(1, 4) } }));
    expect(bad).toBeInstanceOf(InvalidInputError);
    expect((bad as InvalidInputError).details).toMatchObject({ field: 'blocks', range: 1 });
    expect(tb.grantTables()[0]?.freeRecords).toBe(before);
    expect(tb.grantTables()[0]?.freeRangeBytes).toBe(arena);
    for (const [what, spec] of [
      ['two registrations', { handles: [small.handle, small.handle], count: 1, bytes: BLOCK, ranges: new Float64Array(0), blocks: { base: 0, blockBytes: BLOCK, indices: Uint32Array.of(0) } }],
      ['blocks of 0 bytes', { handles: [small.handle], count: 1, bytes: 0, ranges: new Float64Array(0), blocks: { base: 0, blockBytes: 0, indices: Uint32Array.of(0) } }],
      ['null blocks', { handles: [small.handle], count: 1, bytes: BLOCK, ranges: new Float64Array(0), blocks: null }],
      ['fewer indices than ranges', { handles: [small.handle], count: 2, bytes: BLOCK, ranges: new Float64Array(0), blocks: { base: 0, blockBytes: BLOCK, indices: Uint32Array.of(0) } }],
    ] as const) {
      expect(thrown(() => tb.grant(spec as unknown as Parameters<CudaIpcTransport['grant']>[0])), what).toBeInstanceOf(InvalidInputError);
    }
    await tb.revoke(small.handle);
    // A hostile owner edits a block table: every edit is refused, typed, with no byte moved.
    const tampers: [string, (t: ReturnType<typeof tableOf>, table: number) => () => void, string][] = [
      ['an unknown table form', (x) => swap32(x.dv, x.recordAt + 44, 7), 'bad-grant'],
      ['a count other than the payload’s', (x) => swap32(x.dv, x.recordAt + 40, 5), 'bad-grant'],
      ['a block table outside the arena', (x) => swap32(x.dv, x.recordAt + 36, 1), 'bad-grant'],
      ['a block index past the segment', (x, tb) => swap32(x.dv, tb + 24 + 8, BLOCKS), 'bounds'],
      ['a block index of 2^32 - 1', (x, tb) => swap32(x.dv, tb + 24, 2 ** 32 - 1), 'bounds'],
      ['block 0 over the segment header', (x, tb) => swap32(x.dv, tb + 8, 0), 'bounds'],
      ['blocks of 0 bytes', (x, tb) => swap32(x.dv, tb + 16, 0), 'bounds'],
      ['blocks of another size than the payload’s byte total', (x, tb) => swap32(x.dv, tb + 16, (BLOCKS + 4) * BLOCK), 'bad-grant'],
      ['a directory index past the directory', (x, tb) => swap32(x.dv, tb, 100_000), 'bad-grant'],
    ];
    for (const [label, tamper, code] of tampers) {
      const h = await b.grant({ registration: reg, blockBytes: BLOCK, base: 512, blocks: Uint32Array.of(3, 1, 4) });
      const x = tableOf(payloadOf(h.descriptor));
      const tb = x.arenaAt + x.dv.getUint32(x.recordAt + 32, true) + x.dv.getUint32(x.recordAt + 36, true) * 2 ** 32;
      const restore = tamper(x, tb);
      dst.fill(0xee);
      const err = await failure(a.read(b.endpoint(), [{ local: ra, remote: h.descriptor, range: 0, length: 16 }]));
      restore();
      expect(err, label).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode, label).toBe(code);
      expect(dst.every((v) => v === 0xee), `${label}: no byte moved`).toBe(true);
      expect(native.recordActive(x.mapping, x.recordAt), label).toBe(0);
      await h.revoke();
    }
    await reg.revoke();
    releaseSharedMemory(region);
  });

  it('range grant payloads decode only as range grants, and arbitrary bytes are InvalidInput (fuzz)', async () => {
    const tb = new CudaIpcTransport();
    const b = await engine(tb);
    const region = allocateSharedMemory(BLOCK, 'grantsfz');
    const reg = await b.register({ kind: 'host', buffer: region });
    const g = await b.grant([{ registration: reg, offset: 0, length: 100 }]);
    const p = payloadOf(g.descriptor);
    const lengths = Float64Array.of(100);
    expect(decodePayload(p, 'host', 100, lengths)).toMatchObject({ kind: 'host', count: 1, length: 100 });
    // A range grant's payload in a registration's descriptor, and the other way round.
    expect(() => decodePayload(p, 'host', 100)).toThrow(InvalidInputError);
    expect(() => decodePayload(payloadOf(reg.descriptor), 'host', BLOCK, Float64Array.of(BLOCK))).toThrow(InvalidInputError);
    expect(() => decodePayload(p, 'cuda', 100, lengths)).toThrow(InvalidInputError);
    fc.assert(
      fc.property(fc.nat(p.length - 1), fc.integer({ min: 0, max: 255 }), fc.uint8Array({ maxLength: 200 }), (at, value, junk) => {
        const forged = p.slice();
        forged[at] = value;
        for (const bytes of [forged, junk, p.subarray(0, at)]) {
          try {
            decodePayload(bytes, 'host', 100, lengths);
          } catch (e) {
            expect(e).toBeInstanceOf(InvalidInputError);
          }
        }
      }),
      { numRuns: 3000 },
    );
    await g.revoke();
    releaseSharedMemory(region);
  });

  it('one stream: host batches gain nothing from more, and a transfer stays one batch (one snapshot per slot)', async () => {
    expect(new CudaIpcTransport().capabilities.maxStreams).toBe(1);
    const a = await engine(new CudaIpcTransport(), { streamsPerPeer: 4 });
    const b = await engine();
    await a.connect(b.endpoint());
    expect(a.connections()[0]?.streams).toBe(1);
  });

  it('grant tables are mode 0600 and unlinked on close, and on process exit', async () => {
    const tb = new CudaIpcTransport();
    const b = await engine(tb);
    const region = allocateSharedMemory(BLOCK, 'grantscl');
    const reg = await b.register({ kind: 'host', buffer: region });
    await b.grant([{ registration: reg, offset: 0, length: 1 }]);
    const name = tb.grantTables()[0]?.name as string;
    expect(statSync(`/dev/shm${name}`).mode & 0o777).toBe(0o600);
    await b.close(); // revokes the grant, then unlinks the table
    expect(existsSync(`/dev/shm${name}`)).toBe(false);
    releaseSharedMemory(region);
    for (const how of ['exit', 'SIGTERM'] as const) {
      const child = fork(fixture('grant-node.mjs'), ['holder', `gx${how.length}${pid}`, '4', String(BLOCK)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
      const [m] = (await once(child, 'message')) as [{ tables: string[] }];
      expect(m.tables).toHaveLength(1);
      const table = m.tables[0] as string;
      expect(statSync(`/dev/shm${table}`).mode & 0o777).toBe(0o600);
      const exited = once(child, 'exit');
      if (how === 'exit') child.send({ op: 'exit' });
      else child.kill('SIGTERM');
      await exited;
      expect(existsSync(`/dev/shm${table}`), how).toBe(false);
    }
  });

  it('across processes: a requester reading through a grant while the holder revokes never gets a byte written after the revoke resolved', async () => {
    const reader = fork(fixture('grant-node.mjs'), ['reader', `grd${pid}`], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    try {
      await message(reader, (m) => m['ready'] === true);
      const b = await engine();
      const blocks = 1000;
      const blockBytes = 16 * 1024; // 16 MiB per read: copies long enough to overlap a revoke
      const region = allocateSharedMemory(blocks * blockBytes, 'grantsrace');
      const reg = await b.register({ kind: 'host', buffer: region });
      const endpoint = Buffer.from(b.endpoint()).toString('base64');
      let ok = 0;
      for (let iter = 0; iter < 20; iter++) {
        const value = 1 + iter;
        region.fill(value);
        // Ranges in reverse block order, so the reader's requests do not merge into one.
        const g = await b.grant(Array.from({ length: blocks }, (_, k) => ({ registration: reg, offset: (blocks - 1 - k) * blockBytes, length: blockBytes })));
        const done = message<{ done: { ok: number; violations: number; code: string; remoteCode?: string } }>(reader, (m) => m['id'] === iter && m['done'] !== undefined);
        const started = message(reader, (m) => m['id'] === iter && m['started'] === true);
        reader.send({ op: 'read', id: iter, endpoint, descriptor: Buffer.from(g.descriptor).toString('base64'), blocks, blockBytes, expect: value });
        await started;
        await new Promise((r) => setTimeout(r, iter % 4));
        await g.revoke();
        // The memory is reused the moment revoke resolved: any copy still running would see this.
        region.fill(0xff);
        const { done: d } = await done;
        expect(d.violations, `iteration ${iter}: reads that saw bytes written after the revoke`).toBe(0);
        expect(d.code).toBe('TW_REMOTE_REJECTED');
        expect(d.remoteCode).toBe('revoked');
        ok += d.ok;
      }
      expect(ok).toBeGreaterThanOrEqual(20);
      console.info(`grant revoke race: ${ok} good reads over 20 revokes, none saw a byte written after its revoke`);
      await reg.revoke();
      releaseSharedMemory(region);
    } finally {
      reader.kill('SIGKILL');
    }
  });

  it('a pool slot read through a grant (scattered ranges, one batch) is one seqlock snapshot while its owner process rewrites it', async () => {
    const elems = 64 * 1024; // 256 KiB slot, granted as 64 ranges of 4 KiB in reverse order
    const holder = fork(fixture('slot-holder.mjs'), [uniqueOwner('gs'), String(elems), `gsh${pid}`, '1', '64'], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    try {
      const [ready] = (await once(holder, 'message')) as [{ endpoint: string; grant: string }];
      const endpoint = new Uint8Array(Buffer.from(ready.endpoint, 'base64'));
      const descriptor = new Uint8Array(Buffer.from(ready.grant, 'base64'));
      const a = await engine();
      const local = await a.register({ kind: 'host', buffer: new Uint8Array(elems * 4) });
      const view = new Uint32Array((local.memory as { buffer: Uint8Array }).buffer.buffer, 0, elems);
      const block = (elems * 4) / 64;
      // Local block i <- range i (slot block 63 - i): no two requests merge.
      const requests = Array.from({ length: 64 }, (_, i) => ({ local, localOffset: i * block, remote: descriptor, range: i, length: block }));
      let ok = 0;
      let torn = 0;
      let refused = 0;
      for (let i = 0; i < 1000; i++) {
        try {
          const report = await a.read(endpoint, requests);
          expect(report.ranges).toBe(64);
        } catch (e) {
          if (e instanceof TimedOutError || (e instanceof RemoteRejectedError && e.remoteCode === 'slot-rewritten')) {
            refused++;
            continue;
          }
          throw e;
        }
        ok++;
        const v = view[0];
        if (!view.every((x) => x === v)) torn++;
      }
      holder.send({ op: 'stop' });
      const [{ writes }] = (await once(holder, 'message')) as [{ writes: number }];
      expect(torn, `torn reads (${ok} good, ${refused} refused, ${writes} writes)`).toBe(0);
      expect(ok).toBeGreaterThan(100);
      expect(writes).toBeGreaterThan(100);
    } finally {
      holder.kill('SIGKILL');
    }
  });
});

describe('cuda-ipc: a freed pool slot is never read', () => {
  it('a pool made again under the same owner: a grant over its slot 1 reads the new slot, not the old one through a mapping cached under the same name', async () => {
    const owner = uniqueOwner('gre');
    const a = await engine();
    const b = await engine();
    const N = 4096;
    const dst = new Uint8Array(N);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const first = new TensorPool({ owner });
    const id1 = await first.register({ dtype: 'uint8', shape: [N] });
    first.writeSync(id1, new Uint8Array(N).fill(0x11));
    const v1 = first.readSync(id1);
    const reg1 = await b.register({ kind: 'host', buffer: v1.buffer as Uint8Array });
    const g1 = await b.grant([{ registration: reg1, offset: 0, length: N }]);
    await a.read(b.endpoint(), [{ local: ra, remote: g1.descriptor, range: 0, length: N }]);
    expect(dst[0]).toBe(0x11);
    await g1.revoke();
    await reg1.revoke();
    v1.dispose();
    await first.close();
    const second = new TensorPool({ owner });
    const id2 = await second.register({ dtype: 'uint8', shape: [N] });
    expect(id2).toBe(id1); // the same id, so the same segment name
    second.writeSync(id2, new Uint8Array(N).fill(0x22));
    const v2 = second.readSync(id2);
    try {
      const reg2 = await b.register({ kind: 'host', buffer: v2.buffer as Uint8Array });
      const g2 = await b.grant([{ registration: reg2, offset: 0, length: N }]);
      dst.fill(0);
      await a.read(b.endpoint(), [{ local: ra, remote: g2.descriptor, range: 0, length: N }]);
      expect(dst.every((x) => x === 0x22)).toBe(true);
      dst.fill(0);
      await a.read(b.endpoint(), [{ local: ra, remote: reg2.descriptor, length: N }]);
      expect(dst.every((x) => x === 0x22)).toBe(true);
      await g2.revoke();
      await reg2.revoke();
    } finally {
      v2.dispose();
      await second.close();
    }
  });

  it('a slot freed under a live registration: the next post of a prepared read of it is refused (RemoteRejectedError gone), no byte lands', async () => {
    const a = await engine();
    const b = await engine();
    const N = 4096;
    const dst = new Uint8Array(N);
    const ra = await a.register({ kind: 'host', buffer: dst });
    const pool = new TensorPool({ owner: uniqueOwner('grf') });
    const id = await pool.register({ dtype: 'uint8', shape: [N] });
    pool.writeSync(id, new Uint8Array(N).fill(0x33));
    const view = pool.readSync(id);
    const reg = await b.register({ kind: 'host', buffer: view.buffer as Uint8Array });
    const prepared = await a.prepare(b.endpoint(), [{ local: ra, remote: reg.descriptor, length: N }], { op: 'read' });
    try {
      await prepared.run();
      expect(dst[0]).toBe(0x33);
      dst.fill(0);
      await pool.free(id);
      const e = await prepared.run().catch((x: unknown) => x);
      expect(e).toBeInstanceOf(RemoteRejectedError);
      expect((e as RemoteRejectedError).remoteCode).toBe('gone');
      expect(dst.every((x) => x === 0)).toBe(true);
    } finally {
      await prepared[Symbol.asyncDispose]();
      view.dispose();
      await reg.revoke();
      await pool.close();
    }
  });
});

describe('cuda-ipc: revoking a registration waits for its range grants to drain', () => {
  /** Whether `p` settles within `ms`. */
  const settlesWithin = async (p: Promise<unknown>, ms: number): Promise<boolean> => {
    let done = false;
    void p.then(
      () => (done = true),
      () => (done = true),
    );
    await new Promise((r) => setTimeout(r, ms));
    return done;
  };

  for (const via of ['engine', 'transport'] as const) {
    it(`a range grant revoked earlier, a peer batch still inside it: the registration's revoke waits for that batch (${via})`, async () => {
      const transport = new CudaIpcTransport({ revokeTimeoutMs: 5_000 });
      const b = await engine(transport);
      const region = allocateSharedMemory(4096, `gdr${via}`);
      // Through the engine, or the transport's own calls (a caller that revokes in another order than the engine).
      let p: Uint8Array;
      let revokeGrant: () => Promise<void>;
      let revokeRegistration: () => Promise<void>;
      if (via === 'engine') {
        const reg = await b.register({ kind: 'host', buffer: region });
        const g = await b.grant([{ registration: reg, offset: 0, length: 100 }]);
        p = payloadOf(g.descriptor);
        revokeGrant = () => g.revoke();
        revokeRegistration = () => reg.revoke();
      } else {
        const reg = await transport.register({ kind: 'host', buffer: region });
        const g = transport.grant({ handles: [reg.handle], count: 1, bytes: 100, ranges: Float64Array.of(0, 0, 100) });
        p = g.payload;
        revokeGrant = () => transport.revokeGrant(g.handle);
        revokeRegistration = () => transport.revoke(reg.handle);
      }
      const f = fields(p);
      const mapping = native.shmOpen(f.table, 2 ** 33);
      const recordAt = 4096 + f.record * 64;
      // A peer batch inside the grant (what a reader's copy does), held there by the test.
      expect(native.recordEnter(mapping, recordAt, f.generation, p.slice(f.at.token, f.at.token + 16))).toBe(0);
      const grantRevoked = revokeGrant();
      expect(await settlesWithin(grantRevoked, 50)).toBe(false);
      const regRevoked = revokeRegistration();
      const early = await settlesWithin(regRevoked, 200);
      native.recordLeave(mapping, recordAt);
      await Promise.all([grantRevoked, regRevoked]);
      releaseSharedMemory(region);
      expect(early).toBe(false);
      await b.close();
    });
  }
});
