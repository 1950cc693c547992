/**
 * Batches through the cuda-ipc transport (one native call per stream batch): exact bytes for
 * many tiny ranges, all-or-nothing validation naming the bad request, revocation, and the
 * native entry point (`copyBatch`) against lying arrays, which must throw, never corrupt memory.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import fc from 'fast-check';
import {
  InvalidInputError,
  RANGE_STRIDE,
  RangeField,
  RemoteRejectedError,
  TensorwireError,
  TimedOutError,
  createTransferBatch,
  defaultHostId,
  silentLogger,
  type TransferRangeInit,
  type TransportConnection,
  type TransportHost,
} from '@tensorwire/core';
import { CudaIpcTransport, TensorPool, allocateSharedMemory, decodePayload, native, releaseSharedMemory, type PoolView } from '../src/index.js';
import { uniqueOwner } from './helpers.js';
import { failure } from './pool-fixtures.js';

const DATA_OFFSET = 4096;
const SLOT = 160_000;
const pattern = (x: number): number => (x * 31 + (x >> 8) + 7) & 255;

/** Deterministic pseudo-random numbers (LCG), so a failure reproduces. */
function rng(seed: number): () => number {
  let s = seed >>> 0;
  return () => (s = (Math.imul(s, 1103515245) + 12345) >>> 0);
}

let pool: TensorPool;
let ta: CudaIpcTransport;
let tb: CudaIpcTransport;
let conn: TransportConnection;
let slotView: PoolView;
let slotRemote: unknown;
let slotReg: { handle: object; payload: Uint8Array };
let shared: Uint8Array;
let sharedRemote: unknown;
let slot2View: PoolView;
let slot2Remote: unknown;
const signal = new AbortController().signal;
const opts = (): { signal: AbortSignal; deadline: number } => ({ signal, deadline: Date.now() + 10_000 });

beforeAll(async () => {
  pool = new TensorPool({ owner: uniqueOwner('bt') });
  const hosts: TransportHost[] = ['ba', 'bb'].map((n) => ({ identity: { nodeId: `${n}${process.pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
  ta = new CudaIpcTransport();
  tb = new CudaIpcTransport();
  await ta.start(hosts[0] as TransportHost);
  await tb.start(hosts[1] as TransportHost);
  const id = await pool.register({ dtype: 'uint8', shape: [SLOT] });
  pool.writeSync(id, Uint8Array.from({ length: SLOT }, (_, i) => pattern(i)));
  slotView = pool.readSync(id);
  slotReg = await tb.register({ kind: 'host', buffer: slotView.buffer as Uint8Array });
  slotRemote = ta.decodeRemote(slotReg.payload, 'host', SLOT);
  const id2 = await pool.register({ dtype: 'uint8', shape: [SLOT] });
  pool.writeSync(id2, Uint8Array.from({ length: SLOT }, (_, i) => pattern(i + 2)));
  slot2View = pool.readSync(id2);
  const slot2Reg = await tb.register({ kind: 'host', buffer: slot2View.buffer as Uint8Array });
  slot2Remote = ta.decodeRemote(slot2Reg.payload, 'host', SLOT);
  shared = allocateSharedMemory(SLOT, 'batch');
  for (let i = 0; i < SLOT; i++) shared[i] = pattern(i + 1);
  const sharedReg = await tb.register({ kind: 'host', buffer: shared });
  sharedRemote = ta.decodeRemote(sharedReg.payload, 'host', SLOT);
  conn = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { ...opts(), streams: 1 });
});

afterAll(async () => {
  await conn?.close();
  slotView?.dispose();
  slot2View?.dispose();
  if (shared) releaseSharedMemory(shared);
  await Promise.all([ta?.close(), tb?.close()]);
  await pool?.close();
});

async function local(bytes: number, fill = 0xee): Promise<{ handle: object; buffer: Uint8Array }> {
  const buffer = new Uint8Array(bytes).fill(fill);
  const reg = await ta.register({ kind: 'host', buffer });
  return { handle: reg.handle, buffer };
}

describe('cuda-ipc batches', () => {
  it('a batch of 10,000 tiny ranges over a pool slot lands exactly the right bytes, and nothing else', async () => {
    const n = 10_000;
    const dst = await local(n * 16 + 64);
    const next = rng(42);
    // Remote blocks in a random order; inside each 16-byte block a random 1..16-byte range.
    const perm = Array.from({ length: n }, (_, i) => i);
    for (let i = n - 1; i > 0; i--) {
      const j = next() % (i + 1);
      [perm[i], perm[j]] = [perm[j] as number, perm[i] as number];
    }
    const list: TransferRangeInit[] = [];
    for (let i = 0; i < n; i++) {
      const length = 1 + (next() % 16);
      list.push({ local: dst.handle, localOffset: 32 + i * 16 + (next() % (17 - length)), remote: slotRemote, remoteOffset: (perm[i] as number) * 16, length, request: i });
    }
    await conn.execute(0, createTransferBatch('read', list), opts());
    const expected = new Uint8Array(dst.buffer.byteLength).fill(0xee);
    for (const r of list) for (let k = 0; k < r.length; k++) expected[r.localOffset + k] = pattern(r.remoteOffset + k);
    expect(Buffer.compare(dst.buffer, expected)).toBe(0);
  });

  it('random batches over two pool slots and a shared region, read and written back, land exactly (fast-check)', async () => {
    const dst = await local(4096);
    const target = allocateSharedMemory(4096, 'batchw');
    const reg = await tb.register({ kind: 'host', buffer: target });
    const targetRemote = ta.decodeRemote(reg.payload, 'host', 4096);
    try {
      await fc.assert(
        fc.asyncProperty(
          fc.array(fc.record({ source: fc.constantFrom(0, 1, 2), remoteOffset: fc.nat(SLOT - 65), length: fc.integer({ min: 1, max: 64 }) }), { minLength: 1, maxLength: 60 }),
          async (ranges) => {
            dst.buffer.fill(0xee);
            // Disjoint destinations: range i owns local bytes [i * 64, i * 64 + length).
            // Source 0: the slot (pattern(x)), 1: the shared region (pattern(x + 1)), 2: the second slot (pattern(x + 2)).
            const list = ranges.map((r, i) => ({ local: dst.handle, localOffset: i * 64, remote: [slotRemote, sharedRemote, slot2Remote][r.source], remoteOffset: r.remoteOffset, length: r.length }));
            await conn.execute(0, createTransferBatch('read', list), opts());
            const expected = new Uint8Array(4096).fill(0xee);
            ranges.forEach((r, i) => {
              for (let k = 0; k < r.length; k++) expected[i * 64 + k] = pattern(r.remoteOffset + k + r.source);
            });
            expect(Buffer.compare(dst.buffer, expected)).toBe(0);
            // Write them back into a shared region (pool slots are read-only to peers), scattered.
            target.fill(0);
            await conn.execute(0, createTransferBatch('write', ranges.map((r, i) => ({ local: dst.handle, localOffset: i * 64, remote: targetRemote, remoteOffset: 4032 - i * 64, length: r.length }))), opts());
            const back = new Uint8Array(4096);
            ranges.forEach((r, i) => back.set(expected.subarray(i * 64, i * 64 + r.length), 4032 - i * 64));
            expect(Buffer.compare(target, back)).toBe(0);
          },
        ),
        { numRuns: 100 },
      );
    } finally {
      await tb.revoke(reg.handle);
      releaseSharedMemory(target);
    }
  });

  it('a batch with one bad range in the middle fails as a whole, names its request, and moves nothing', async () => {
    const n = 1000;
    const dst = await local(n * 64);
    const good = (i: number, remote: unknown = slotRemote): TransferRangeInit => ({ local: dst.handle, localOffset: i * 64, remote, remoteOffset: i * 64, length: 64, request: 7 + i });
    const cases: [string, TransferRangeInit, new (...a: never[]) => TensorwireError, string | undefined][] = [
      ['remote bytes past the grant', { ...good(500), remoteOffset: SLOT - 3, length: 8 }, RemoteRejectedError, 'bounds'],
      ['local bytes past the buffer', { ...good(500), localOffset: n * 64 - 3, length: 8 }, InvalidInputError, undefined],
      ['a NaN offset', { ...good(500), remoteOffset: Number.NaN }, InvalidInputError, undefined],
      ['a negative length', { ...good(500), length: -1 }, InvalidInputError, undefined],
      ['a fractional offset', { ...good(500), localOffset: 0.5 }, InvalidInputError, undefined],
      ['a range grant index the remote does not have', { ...good(500), remoteRange: 1 }, InvalidInputError, undefined],
    ];
    for (const remote of [slotRemote, sharedRemote]) {
      for (const [label, bad, type, remoteCode] of cases) {
        const list = Array.from({ length: n }, (_, i) => (i === 500 ? { ...bad, remote } : good(i, remote)));
        dst.buffer.fill(0xee);
        const err = await failure(conn.execute(0, createTransferBatch('read', list), opts()));
        expect(err, label).toBeInstanceOf(type);
        expect(err.details['request'], label).toBe(507);
        if (remoteCode) expect((err as RemoteRejectedError).remoteCode, label).toBe(remoteCode);
        expect(dst.buffer.every((x) => x === 0xee), `${label}: no byte moved`).toBe(true);
      }
    }
    // A write batch: nothing lands in the remote either.
    const target = allocateSharedMemory(n * 64, 'batchbad');
    const reg = await tb.register({ kind: 'host', buffer: target });
    const targetRemote = ta.decodeRemote(reg.payload, 'host', n * 64);
    try {
      dst.buffer.fill(9);
      const list = Array.from({ length: n }, (_, i) => (i === 500 ? { ...good(i, targetRemote), remoteOffset: n * 64 - 3, length: 8 } : good(i, targetRemote)));
      const err = await failure(conn.execute(0, createTransferBatch('write', list), opts()));
      expect((err as RemoteRejectedError).remoteCode).toBe('bounds');
      expect(err.details['request']).toBe(507);
      expect(target.every((x) => x === 0)).toBe(true);
      // A write into a pool slot is refused before anything moves, naming the first request that asks for it.
      const slotWrite = await failure(conn.execute(0, createTransferBatch('write', [good(0, targetRemote), good(1)]), opts()));
      expect((slotWrite as RemoteRejectedError).remoteCode).toBe('read-only');
      expect(slotWrite.details['request']).toBe(8);
      expect(target.every((x) => x === 0)).toBe(true);
    } finally {
      await tb.revoke(reg.handle);
      releaseSharedMemory(target);
    }
  });

  it('a batch over a revoked grant is RemoteRejected (revoked) and moves nothing, also for the other grants of the batch', async () => {
    const region = allocateSharedMemory(4096, 'batchrv');
    region.fill(3);
    const reg = await tb.register({ kind: 'host', buffer: region });
    const remote = ta.decodeRemote(reg.payload, 'host', 4096);
    const dst = await local(8192);
    const batch = createTransferBatch('read', [
      { local: dst.handle, localOffset: 0, remote: sharedRemote, remoteOffset: 0, length: 4096 },
      { local: dst.handle, localOffset: 4096, remote, remoteOffset: 0, length: 4096 },
    ]);
    await conn.execute(0, batch, opts());
    expect(dst.buffer.subarray(4096).every((x) => x === 3)).toBe(true);
    await tb.revoke(reg.handle);
    dst.buffer.fill(0xee);
    const err = await failure(conn.execute(0, batch, opts()));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('revoked');
    expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
    // The grant that was entered before the revoked one was left again.
    const grant = native.shmOpen((sharedRemote as { grantName: string }).grantName, 4096);
    expect(native.grantActive(grant)).toBe(0);
    releaseSharedMemory(region);
  });

  it('a batch with a revoked local handle (also revoked between posts of the same batch) is InvalidInput naming its first request, and moves nothing', async () => {
    const live = await local(4096);
    const gone = await local(8192);
    const read = createTransferBatch('read', [
      { local: live.handle, localOffset: 0, remote: sharedRemote, remoteOffset: 0, length: 4096, request: 7 },
      { local: gone.handle, localOffset: 0, remote: sharedRemote, remoteOffset: 0, length: 4096, request: 8 },
      { local: gone.handle, localOffset: 4096, remote: slotRemote, remoteOffset: 0, length: 4096, request: 9 },
    ]);
    const target = allocateSharedMemory(8192, 'batchlr');
    const reg = await tb.register({ kind: 'host', buffer: target });
    const targetRemote = ta.decodeRemote(reg.payload, 'host', 8192);
    const write = createTransferBatch('write', [
      { local: live.handle, localOffset: 0, remote: targetRemote, remoteOffset: 0, length: 4096, request: 3 },
      { local: gone.handle, localOffset: 0, remote: targetRemote, remoteOffset: 4096, length: 4096, request: 4 },
    ]);
    try {
      await conn.execute(0, read, opts());
      expect(gone.buffer[0]).toBe(pattern(1));
      await conn.execute(0, write, opts());
      await ta.revoke(gone.handle);
      live.buffer.fill(0xee);
      gone.buffer.fill(0xee);
      target.fill(0);
      const err = await failure(conn.execute(0, read, opts()));
      expect(err).toBeInstanceOf(InvalidInputError);
      expect(err.details['request']).toBe(8);
      expect(live.buffer.every((x) => x === 0xee), 'bytes moved into the live local').toBe(true);
      expect(gone.buffer.every((x) => x === 0xee), 'bytes moved into the revoked local').toBe(true);
      const werr = await failure(conn.execute(0, write, opts()));
      expect(werr).toBeInstanceOf(InvalidInputError);
      expect(werr.details['request']).toBe(4);
      expect(target.every((x) => x === 0), 'bytes of the batch reached the peer').toBe(true);
    } finally {
      await tb.revoke(reg.handle);
      releaseSharedMemory(target);
    }
  });

  it('a slot stuck write-locked fails the batch with TimedOut at the deadline', async () => {
    const mapping = (slotView.buffer as Uint8Array).buffer as ArrayBuffer;
    const gen = new BigUint64Array(mapping, 128, 1);
    const dst = await local(64);
    gen[0] = (gen[0] as bigint) + 1n; // a writer that took the lock and stalled
    try {
      const t0 = Date.now();
      const err = await failure(conn.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: 64 }]), { signal, deadline: Date.now() + 100 }));
      expect(err).toBeInstanceOf(TimedOutError);
      expect(Date.now() - t0).toBeLessThan(1500); // the deadline, not the 2 s stuck-writer bound
    } finally {
      gen[0] = (gen[0] as bigint) - 1n;
    }
    await conn.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 0, length: 64 }]), opts());
    expect(dst.buffer.every((x, i) => x === pattern(i))).toBe(true);
  });
});

describe('one plan per local and remote, reused by the next batch over them (unprepared reads)', () => {
  // The engine makes a new batch per engine.read; the transport reuses the native tables of an
  // earlier batch with the same local handle and remote, by op. Whatever changed since must
  // still be refused per batch, as for a prepared transfer's reused plan.
  it('new batches with other ranges over the same local and remote land their own bytes', async () => {
    const dst = await local(8192);
    for (let round = 0; round < 5; round++) {
      dst.buffer.fill(0xee);
      const list = Array.from({ length: 3 }, (_, i) => ({ local: dst.handle, localOffset: i * 2048 + round, remote: sharedRemote, remoteOffset: round * 1000 + i * 7000, length: 100 + round * 10 + i }));
      await conn.execute(0, createTransferBatch('read', list), opts());
      const expected = new Uint8Array(8192).fill(0xee);
      for (const r of list) for (let k = 0; k < r.length; k++) expected[r.localOffset + k] = pattern(r.remoteOffset + k + 1);
      expect(Buffer.compare(dst.buffer, expected), `round ${round}`).toBe(0);
    }
  });

  it('a write over a pool slot after reads of it through the same local is still refused (read-only), and moves nothing', async () => {
    const dst = await local(256, 0x11);
    const read = (): Promise<void> => conn.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 10, length: 64 }]), opts());
    await read();
    await read();
    expect(dst.buffer[0]).toBe(pattern(10));
    const before = Uint8Array.from(slotView.buffer as Uint8Array);
    const err = await failure(conn.execute(0, createTransferBatch('write', [{ local: dst.handle, localOffset: 0, remote: slotRemote, remoteOffset: 10, length: 64 }]), opts()));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('read-only');
    expect(Buffer.compare(slotView.buffer as Uint8Array, before)).toBe(0);
    await read(); // reads are still served
  });

  it('after the holder revokes the registration, the next batch over the same local and remote is RemoteRejected (revoked)', async () => {
    const src = allocateSharedMemory(4096, 'plancache');
    try {
      src.fill(0x5a);
      const reg = await tb.register({ kind: 'host', buffer: src });
      const remote = ta.decodeRemote(reg.payload, 'host', 4096);
      const dst = await local(4096);
      const read = (): Promise<void> => conn.execute(0, createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote, remoteOffset: 0, length: 4096 }]), opts());
      await read();
      expect(dst.buffer[4095]).toBe(0x5a);
      dst.buffer.fill(0xee);
      await tb.revoke(reg.handle);
      const err = await failure(read());
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect((err as RemoteRejectedError).remoteCode).toBe('revoked');
      expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
    } finally {
      releaseSharedMemory(src);
    }
  });

  it('after the local is revoked, the next batch over it is InvalidInput and moves nothing', async () => {
    const dst = await local(1024);
    const batch = (): ReturnType<typeof createTransferBatch> => createTransferBatch('read', [{ local: dst.handle, localOffset: 0, remote: sharedRemote, remoteOffset: 0, length: 512, request: 3 }]);
    await conn.execute(0, batch(), opts());
    dst.buffer.fill(0xee);
    await ta.revoke(dst.handle);
    const err = await failure(conn.execute(0, batch(), opts()));
    expect(err).toBeInstanceOf(InvalidInputError);
    expect(dst.buffer.every((x) => x === 0xee)).toBe(true);
  });
});

describe('copyBatch (the native batch entry point) against lying arrays', () => {
  // Real mappings: the slot (seqlocked) and a shared region as data segments, the slot's grant.
  let slotMapping: ArrayBuffer;
  let sharedMapping: ArrayBuffer;
  let grant: ArrayBuffer;
  let token: Uint8Array;
  beforeAll(() => {
    slotMapping = (slotView.buffer as Uint8Array).buffer as ArrayBuffer;
    sharedMapping = shared.buffer as ArrayBuffer;
    const decoded = decodePayload(slotReg.payload, 'host', SLOT);
    grant = native.shmOpen(decoded.grantName, 4096);
    token = decoded.token;
  });

  const S = 7; // numbers per range handed to the addon here (core's RANGE_STRIDE)
  const GUARD = 256;
  const LOCALS = [100, 4096, 1];

  /**
   * What the addon must decide, computed independently: does the whole call validate? Remotes
   * are (grant, first span, span count); spans (segment, base, limit); a range's span is
   * `first + remoteRange` of its remote, and only spans that ranges use are checked.
   */
  function oracle(
    op: 0 | 1,
    ranges: Float64Array,
    count: number,
    localLens: readonly number[],
    remotes: Float64Array,
    spans: Float64Array,
    segLens: readonly number[],
    seq: readonly number[],
    nGrants: number,
  ): boolean {
    const safe = (d: number): boolean => Number.isSafeInteger(d) && d >= 0;
    if (remotes.length % 3 !== 0 || spans.length % 3 !== 0 || count * S > ranges.length) return false;
    const nRemotes = remotes.length / 3;
    const nSpans = spans.length / 3;
    for (let r = 0; r < nRemotes; r++) {
      const [g, first, n] = Array.from(remotes.subarray(r * 3, r * 3 + 3)) as number[];
      if (![g, first, n].every((v) => safe(v as number))) return false;
      if ((g as number) >= nGrants || n === 0 || (first as number) + (n as number) > nSpans) return false;
    }
    for (let i = 0; i < count; i++) {
      const f = Array.from(ranges.subarray(i * S, i * S + S));
      if (!f.every((v) => safe(v))) return false;
      const [, li, lo, ri, ro, len, rr] = f as number[];
      if ((li as number) >= localLens.length || (ri as number) >= nRemotes || len === 0) return false;
      if ((rr as number) >= (remotes[(ri as number) * 3 + 2] as number)) return false;
      if ((lo as number) + (len as number) > (localLens[li as number] as number)) return false;
      const sp = (remotes[(ri as number) * 3 + 1] as number) + (rr as number);
      const [sg, base, limit] = Array.from(spans.subarray(sp * 3, sp * 3 + 3)) as number[];
      if (![sg, base, limit].every((v) => safe(v as number)) || (sg as number) >= segLens.length) return false;
      if ((base as number) < DATA_OFFSET || (base as number) + (limit as number) > (segLens[sg as number] as number)) return false;
      if ((ro as number) + (len as number) > (limit as number)) return false;
      if (op === 1 && seq[sg as number] === 1) return false;
    }
    return true;
  }

  /** Mostly plausible values, sometimes near the mappings' edges, sometimes junk. */
  const value = (small: number, plausible: fc.Arbitrary<number> = fc.nat(small)): fc.Arbitrary<number> =>
    fc.oneof(
      { weight: 30, arbitrary: plausible },
      { weight: 2, arbitrary: fc.integer({ min: DATA_OFFSET - 8, max: DATA_OFFSET + SLOT + 8 }) },
      { weight: 1, arbitrary: fc.constantFrom(Number.NaN, -1, -0.5, 0.5, Infinity, -Infinity, 2 ** 32, 2 ** 53, 2 ** 53 - 1, 2 ** 64, Number.MAX_VALUE, 1e-300) },
    );

  it('fast-check: any tables and ranges either validate (as an independent oracle says) or throw a typed error; no byte lands outside the ranges', () => {
    // The local buffers lie between guard bytes of one arena; the segments' headers and every
    // byte outside [base, base + limit) of a written segment must stay as they were.
    const arena = new Uint8Array(GUARD + LOCALS.reduce((a, b) => a + b + GUARD, 0));
    const locals: Uint8Array[] = [];
    let at = GUARD;
    for (const n of LOCALS) {
      locals.push(arena.subarray(at, at + n));
      at += n + GUARD;
    }
    const slotBefore = new Uint8Array(slotMapping).slice();
    const sharedCopy = new Uint8Array(sharedMapping);
    const sharedBefore = sharedCopy.slice();
    const grantHeader = new Uint8Array(grant, 0, 1024).slice();
    let copied = 0;
    fc.assert(
      fc.property(
        fc.constantFrom<0 | 1>(0, 1),
        fc.array(
          fc.tuple(value(3), value(1), value(60), value(1), value(SLOT / 2), value(0, fc.integer({ min: 1, max: 32 })), fc.oneof({ weight: 10, arbitrary: fc.constant(0) }, { weight: 3, arbitrary: fc.constant(1) }, { weight: 1, arbitrary: value(2) })),
          { maxLength: 6 },
        ),
        fc.integer({ min: -1, max: 2 }),
        fc.array(fc.tuple(value(0), value(1), value(0, fc.integer({ min: 1, max: 2 }))), { minLength: 2, maxLength: 3 }),
        fc.array(
          fc.tuple(
            value(1, fc.oneof({ weight: 3, arbitrary: fc.constant(0) }, { weight: 1, arbitrary: fc.constant(1) })),
            value(0, fc.integer({ min: DATA_OFFSET, max: DATA_OFFSET + 64 })),
            value(0, fc.integer({ min: SLOT / 2, max: SLOT })),
          ),
          { minLength: 3, maxLength: 4 },
        ),
        fc.constantFrom<number[]>([0, 1], [1, 0], [0, 0], [1, 1], [0], [1]),
        (op, rs, extra, rems, sps, seq) => {
          const ranges = new Float64Array(rs.flat());
          const count = Math.max(0, rs.length + (extra === 2 ? 1 : extra === -1 ? -1 : 0)); // sometimes one more than there is
          const remotes = new Float64Array(rems.flat());
          const spans = new Float64Array(sps.flat());
          // seq[k] says whether segment k is the slot (seqlocked) or the shared region.
          const segments = seq.map((q) => (q === 1 ? slotMapping : sharedMapping));
          const segLens = segments.map((m) => m.byteLength);
          arena.fill(0xa5);
          let threw: unknown;
          try {
            native.copyBatch(op, ranges, count, S, locals, remotes, spans, segments, Uint8Array.from(seq), [grant], new Float64Array(2), token, Date.now() + 5000, 100, new BigUint64Array(segments.length));
          } catch (e) {
            threw = e;
          }
          const valid = oracle(op, ranges, count, LOCALS, remotes, spans, segLens, seq, 1);
          if (threw !== undefined) expect(threw).toBeInstanceOf(TensorwireError);
          expect(threw === undefined, `valid per oracle: ${valid}; threw: ${String(threw)}`).toBe(valid);
          if (valid && count > 0) copied++;
          // The same tables kept natively (planBatch) and copied through (copyPlanned): the same
          // outcome, the same error code, the same bytes in the locals and the shared region.
          const arenaA = arena.slice();
          const sharedA = sharedCopy.slice();
          sharedCopy.set(sharedBefore);
          arena.fill(0xa5);
          let threwPlanned: unknown;
          try {
            const plan = native.planBatch(op, locals, remotes, spans, segments, Uint8Array.from(seq), [grant], new Float64Array(2), token, new BigUint64Array(segments.length));
            native.copyPlanned(plan, ranges, count, S, Date.now() + 5000, 100);
          } catch (e) {
            threwPlanned = e;
          }
          expect(threwPlanned === undefined, `copyBatch threw ${String(threw)}; planned threw ${String(threwPlanned)}`).toBe(threw === undefined);
          if (threw !== undefined) expect((threwPlanned as TensorwireError).code).toBe((threw as TensorwireError).code);
          expect(Buffer.compare(arena, arenaA)).toBe(0);
          expect(Buffer.compare(sharedCopy, sharedA)).toBe(0);
          // Guard bytes of the arena untouched (reads land only inside the local buffers).
          let g = 0;
          let smashed = 0;
          for (const n of [0, ...LOCALS]) {
            g += n;
            for (let k = 0; k < GUARD; k++) if (arena[g + k] !== 0xa5) smashed++;
            g += GUARD;
          }
          expect(smashed).toBe(0);
          // Writes only ever go to the shared region's data, inside a granted range: its header and the slot never change.
          expect(Buffer.compare(new Uint8Array(slotMapping), slotBefore)).toBe(0);
          expect(Buffer.compare(sharedCopy.subarray(0, DATA_OFFSET), sharedBefore.subarray(0, DATA_OFFSET))).toBe(0);
          sharedCopy.set(sharedBefore);
          expect(native.grantActive(grant)).toBe(0);
        },
      ),
      { numRuns: 10_000 },
    );
    expect(Buffer.compare(new Uint8Array(grant, 0, 1024), grantHeader)).toBe(0);
    // The generator reaches the copies too, not only the refusals.
    expect(copied).toBeGreaterThan(100); // about 3% of 10,000 runs; far from the threshold
  });

  it('refuses malformed arguments with a thrown error', () => {
    const ok = (): Parameters<typeof native.copyBatch> => [
      0,
      new Float64Array([0, 0, 0, 0, 0, 16, 0]),
      1,
      S,
      [new Uint8Array(16)],
      new Float64Array([0, 0, 1]),
      new Float64Array([0, DATA_OFFSET, SLOT]),
      [slotMapping],
      Uint8Array.of(1),
      [grant],
      new Float64Array(2),
      token,
      0,
      0,
      new BigUint64Array(1),
    ];
    expect(() => native.copyBatch(...ok())).not.toThrow();
    const bad: [string, (a: unknown[]) => void][] = [
      ['op 2', (a) => (a[0] = 2)],
      ['ranges not a Float64Array', (a) => (a[1] = new Float32Array(7))],
      ['count beyond the ranges', (a) => (a[2] = 2)],
      ['count negative', (a) => (a[2] = -1)],
      ['stride below the layout', (a) => (a[3] = 6)],
      ['stride fractional', (a) => (a[3] = 7.5)],
      ['locals not an array', (a) => (a[4] = new Uint8Array(16))],
      ['a local that is not a Uint8Array', (a) => (a[4] = [new Uint16Array(8)])],
      ['remotes not 3 numbers each', (a) => (a[5] = new Float64Array([0, 0]))],
      ['a remote naming a missing grant', (a) => (a[5] = new Float64Array([1, 0, 1]))],
      ['a remote whose spans are not in the span table', (a) => (a[5] = new Float64Array([0, 1, 1]))],
      ['a remote with no span', (a) => (a[5] = new Float64Array([0, 0, 0]))],
      ['a remote range past the remote’s spans', (a) => ((a[1] as Float64Array)[6] = 1)],
      ['spans not 3 numbers each', (a) => (a[6] = new Float64Array([0, DATA_OFFSET]))],
      ['a span over the header', (a) => (a[6] = new Float64Array([0, 0, 64]))],
      ['a span past the mapping', (a) => (a[6] = new Float64Array([0, DATA_OFFSET, SLOT + 1]))],
      ['a span naming a missing segment', (a) => (a[6] = new Float64Array([1, DATA_OFFSET, SLOT]))],
      ['a NaN span', (a) => (a[6] = new Float64Array([0, Number.NaN, SLOT]))],
      ['a range past its span (the granted range, not the region)', (a) => (a[6] = new Float64Array([0, DATA_OFFSET + 8, 8]))],
      ['a segment that is not an ArrayBuffer', (a) => (a[7] = [new Uint8Array(slotMapping)])],
      ['a seqlocked segment that is not a slot', (a) => (a[7] = [new ArrayBuffer(DATA_OFFSET + SLOT)])],
      ['segment flags of the wrong length', (a) => (a[8] = Uint8Array.of(1, 0))],
      ['a segment flag of 2', (a) => (a[8] = Uint8Array.of(2))],
      ['a grant that is not a grant segment', (a) => (a[9] = [new ArrayBuffer(4096)])],
      ['grant info of the wrong length', (a) => (a[10] = new Float64Array(1))],
      ['a record of a grant segment (not a grant table)', (a) => (a[10] = new Float64Array([4096, 1]))],
      ['a fractional record offset', (a) => (a[10] = new Float64Array([4096.5, 1]))],
      ['tokens of the wrong length', (a) => (a[11] = new Uint8Array(15))],
      ['a wrong token', (a) => (a[11] = new Uint8Array(16))],
      ['generations too short', (a) => (a[14] = new BigUint64Array(0))],
      ['generations of the wrong type', (a) => (a[14] = new Float64Array(1))],
      ['a write into a seqlocked segment', (a) => (a[0] = 1)],
    ];
    for (const [label, mutate] of bad) {
      const args = ok() as unknown[];
      mutate(args);
      expect(() => (native.copyBatch as (...x: unknown[]) => void)(...args), label).toThrow(TensorwireError);
      expect(native.grantActive(grant), label).toBe(0);
      // The same tables through planBatch and copyPlanned: refused at one or the other.
      expect(() => planned(args), `planned: ${label}`).toThrow(TensorwireError);
      expect(native.grantActive(grant), `planned: ${label}`).toBe(0);
    }
    expect(() => planned(ok() as unknown[])).not.toThrow();
  });

  /** copyBatch's arguments as planBatch + copyPlanned. */
  function planned(a: unknown[]): void {
    const plan = (native.planBatch as (...x: unknown[]) => ReturnType<typeof native.planBatch>)(a[0], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[14]);
    (native.copyPlanned as (...x: unknown[]) => void)(plan, a[1], a[2], a[3], a[12], a[13]);
  }

  it('copyPlanned takes only a plan of planBatch, and a plan whose local was detached since copies nothing into it', () => {
    for (const notPlan of [undefined, {}, 7, new ArrayBuffer(8), () => undefined]) {
      expect(() => (native.copyPlanned as (...x: unknown[]) => void)(notPlan, new Float64Array(7), 0, S, 0, 0)).toThrow(TensorwireError);
    }
    const victim = new Uint8Array(4096);
    const plan = native.planBatch(0, [victim], new Float64Array([0, 0, 1]), new Float64Array([0, DATA_OFFSET, SLOT]), [sharedMapping], Uint8Array.of(0), [grant], new Float64Array(2), token, new BigUint64Array(1));
    const ranges = new Float64Array([0, 0, 0, 0, 0, 4096, 0]);
    native.copyPlanned(plan, ranges, 1, S, 0, 0);
    expect(victim[0]).toBe(shared[0]);
    structuredClone(victim.buffer, { transfer: [victim.buffer] }); // detaches victim: 0 bytes now
    expect(() => native.copyPlanned(plan, ranges, 1, S, 0, 0)).toThrow(InvalidInputError);
    expect(native.grantActive(grant)).toBe(0);
  });

  it('a getter in a table array that detaches a buffer already read cannot make the addon use it', () => {
    const victim = new Uint8Array(4096);
    const locals: Uint8Array[] = [victim];
    Object.defineProperty(locals, 1, {
      enumerable: true,
      get() {
        structuredClone(victim.buffer, { transfer: [victim.buffer] }); // detaches victim
        return new Uint8Array(16);
      },
    });
    const ranges = new Float64Array([0, 0, 0, 0, 0, 4096, 0]);
    expect(() => native.copyBatch(0, ranges, 1, S, locals, new Float64Array([0, 0, 1]), new Float64Array([0, DATA_OFFSET, SLOT]), [slotMapping], Uint8Array.of(1), [grant], new Float64Array(2), token, 0, 0, new BigUint64Array(1))).toThrow(
      InvalidInputError,
    );
    expect(victim.byteLength).toBe(0);
    expect(native.grantActive(grant)).toBe(0);
  });

  it('range fields follow core’s RangeField layout', () => {
    // The addon reads the first seven numbers of a range in this order (see native/shm.h).
    expect([RangeField.Request, RangeField.Local, RangeField.LocalOffset, RangeField.Remote, RangeField.RemoteOffset, RangeField.Length, RangeField.RemoteRange]).toEqual([0, 1, 2, 3, 4, 5, 6]);
    expect(RANGE_STRIDE).toBe(S);
  });
});
