/**
 * The TCP fast paths: a read frame's receive list merges destinations that follow each other
 * in one local buffer (a KV fetch into consecutive blocks is then received straight into its
 * memory, not staged and copied per range), and the range fields of vector heads are written
 * and read with byte arithmetic instead of Buffer#readUInt*BE / writeUInt*BE.
 */
import fc from 'fast-check';
import { afterEach, describe, expect, it } from 'vitest';
import { planBatch, receiveList } from '../src/kit/batch.js';
import { HEADER_BYTES, allocVecFrame, FrameType, headRangeAt, putRange, rangeGrantIndex, rangeLength, rangeOffset, rangeTokenIndex } from '../src/kit/frames.js';
import { GrantTable } from '../src/kit/grants.js';
import { silentLogger } from '../src/logger.js';
import { TcpTransport } from '../src/tcp/transport.js';
import { pattern } from '../src/testing/pattern.js';
import { RANGE_STRIDE, RangeField, createTransferBatch, type NodeIdentity, type TransferRangeInit } from '../src/transport.js';

/** Every data byte's destination, in arrival order, as "buffer:offset" runs [buffer, start, end). */
function destinations(buffersOf: (k: number) => number, table: Float64Array, stride: number, fields: [number, number, number], first: number, count: number): number[][] {
  const out: number[][] = [];
  for (let e = first; e < first + count; e++) {
    const at = e * stride;
    const b = buffersOf(table[at + fields[0]] as number);
    const off = table[at + fields[1]] as number;
    const len = table[at + fields[2]] as number;
    const last = out[out.length - 1];
    // Normalise: touching runs of one buffer are one run (what the bytes go to, not how it is cut).
    if (last && last[0] === b && last[2] === off) last[2] = off + len;
    else out.push([b, off, off + len]);
  }
  return out;
}

describe('read receive lists', () => {
  it('property: the merged receive list lands every byte where the unmerged ranges do, and leaves no two mergeable entries', () => {
    const range = fc.record({ local: fc.integer({ min: 0, max: 1 }), gap: fc.constantFrom(0, 0, 0, 1, 7), back: fc.boolean(), length: fc.integer({ min: 1, max: 9 }) });
    fc.assert(
      fc.property(fc.array(range, { minLength: 1, maxLength: 80 }), fc.nat({ max: 10 }), (list, cut) => {
        // Local offsets: mostly right after the previous range of that buffer, sometimes a gap, sometimes earlier.
        const next = [0, 0];
        const r = new Float64Array(list.length * RANGE_STRIDE);
        list.forEach((x, i) => {
          const lo = x.back ? Math.max(0, (next[x.local] as number) - 20) : (next[x.local] as number) + x.gap;
          next[x.local] = Math.max(next[x.local] as number, lo + x.length);
          const at = i * RANGE_STRIDE;
          r[at + RangeField.Local] = x.local;
          r[at + RangeField.LocalOffset] = lo;
          r[at + RangeField.Length] = x.length;
        });
        const buffers = [Buffer.alloc(2000), Buffer.alloc(2000)];
        const start = Math.min(cut, list.length - 1);
        const s = receiveList(buffers, r, start, list.length);
        expect(s.buffers).toBe(buffers);
        expect(s.count).toBeGreaterThanOrEqual(1);
        expect(s.count).toBeLessThanOrEqual(list.length - start);
        const fields: [number, number, number] = [s.bufferField, s.offsetField, s.lengthField];
        const want = destinations((k) => k, r, RANGE_STRIDE, [RangeField.Local, RangeField.LocalOffset, RangeField.Length], start, list.length - start);
        expect(destinations((k) => k, s.table, s.stride, fields, s.first, s.count)).toEqual(want);
        // Maximal: entry e+1 never continues entry e in the same buffer.
        for (let e = s.first; e + 1 < s.first + s.count; e++) {
          const a = e * s.stride;
          const b = (e + 1) * s.stride;
          const continues = s.table[a + s.bufferField] === s.table[b + s.bufferField] && (s.table[a + s.offsetField] as number) + (s.table[a + s.lengthField] as number) === s.table[b + s.offsetField];
          expect(continues).toBe(false);
        }
      }),
      { numRuns: 500 },
    );
  });

  it('a read of scattered remote ranges into consecutive local ranges plans one receive entry per frame', () => {
    const table = new GrantTable({ transport: 'tcp', revokeGraceMs: 100 });
    const remoteReg = table.register({ kind: 'host', buffer: new Uint8Array(64 << 20) });
    const local = table.register({ kind: 'host', buffer: new Uint8Array(4 << 20) });
    const remote = table.decodeRemote(remoteReg.payload, 'host', 64 << 20);
    const size = 4096;
    const list: TransferRangeInit[] = Array.from({ length: 1024 }, (_, k) => ({ local: local.handle, localOffset: k * size, remote, remoteOffset: ((k * 7919) % 16384) * size, length: size }));
    const plan = planBatch(createTransferBatch('read', list), table, { cap: 16 << 20, frameTargetBytes: 1 << 20, zeroCopyMinBytes: 1024 });
    expect(plan.frames.length).toBe(4);
    for (const f of plan.frames) {
      expect(f.count).toBe(256);
      expect(f.scatter?.count).toBe(1);
      expect(f.scatter?.table[2]).toBe(256 * size);
    }
    // Every other destination skipped: nothing to merge, one entry per range.
    const sparse = list.map((x, k) => ({ ...x, localOffset: 2 * k * 2048, length: 2048 }));
    const p2 = planBatch(createTransferBatch('read', sparse), table, { cap: 16 << 20, frameTargetBytes: 1 << 20, zeroCopyMinBytes: 1024 });
    expect(p2.frames.reduce((s, f) => s + (f.scatter?.count ?? 0), 0)).toBe(1024);
  });
});

const transports: TcpTransport[] = [];
afterEach(async () => {
  await Promise.allSettled(transports.splice(0).map((t) => t.close()));
});

let n = 0;
async function node(): Promise<{ t: TcpTransport; id: NodeIdentity }> {
  const t = new TcpTransport();
  const id = { nodeId: `s${++n}`, incarnation: `inc${n}`, hostId: 'host1' };
  await t.start({ identity: id, logger: silentLogger, inbound: () => undefined });
  transports.push(t);
  return { t, id };
}

describe('TCP reads through merged receive lists', () => {
  it('scattered remote blocks into consecutive local blocks of two buffers, interleaved with gaps, arrive byte for byte', async () => {
    const a = await node();
    const b = await node();
    const conn = await a.t.connect(b.id, b.t.endpoint(), { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
    const src = pattern(8 << 20, 11);
    const reg = await b.t.register({ kind: 'host', buffer: src });
    const remote = a.t.decodeRemote(reg.payload, 'host', src.length);
    const size = 4096;
    const dst = [new Uint8Array(4 << 20), new Uint8Array(4 << 20)];
    const locals = await Promise.all(dst.map((d) => a.t.register({ kind: 'host', buffer: d })));
    const list: TransferRangeInit[] = [];
    const want: [number, number, number][] = [];
    const next = [0, 0];
    for (let k = 0; k < 1200; k++) {
      const which = k % 7 < 5 ? 0 : 1; // runs in buffer 0, broken by buffer 1
      const lo = (next[which] as number) + (k % 97 === 0 ? size : 0); // an occasional gap
      const ro = ((k * 7919) % 2048) * size;
      next[which] = lo + size;
      list.push({ local: (locals[which] as { handle: object }).handle, localOffset: lo, remote, remoteOffset: ro, length: size });
      want.push([which, lo, ro]);
    }
    await conn.execute(0, createTransferBatch('read', list), { signal: new AbortController().signal, deadline: Date.now() + 20_000 });
    let bad = 0;
    for (const [which, lo, ro] of want) if (Buffer.compare((dst[which] as Uint8Array).subarray(lo, lo + size), src.subarray(ro, ro + size)) !== 0) bad++;
    expect(bad).toBe(0);
  });
});

describe('vector head fields', () => {
  it('property: putRange and the head readers round-trip every field value (u16 token, u32 range and length, offsets to 2^53)', () => {
    fc.assert(
      fc.property(
        fc.array(
          fc.record({
            token: fc.integer({ min: 0, max: 1023 }),
            range: fc.oneof(fc.nat(), fc.constantFrom(0xffffffff, 0x80000000, 0x7fffffff)),
            offset: fc.oneof(fc.maxSafeNat(), fc.constantFrom(0, 2 ** 32 - 1, 2 ** 32, 2 ** 53 - 1)),
            length: fc.oneof(fc.integer({ min: 1, max: 0xffffffff }), fc.constantFrom(0xffffffff, 0x80000000)),
          }),
          { minLength: 1, maxLength: 20 },
        ),
        fc.integer({ min: 1, max: 4 }),
        (ranges, tokens) => {
          const frame = allocVecFrame(FrameType.ReadvReq, 7, tokens, ranges.length, 0);
          ranges.forEach((r, i) => putRange(frame, tokens, i, r.token, r.range, r.offset, r.length));
          const head = frame.subarray(HEADER_BYTES);
          ranges.forEach((r, i) => {
            const at = headRangeAt(tokens, i);
            expect(rangeTokenIndex(head, at)).toBe(r.token);
            expect(rangeGrantIndex(head, at)).toBe(r.range);
            expect(rangeOffset(head, at)).toBe(r.offset);
            expect(rangeLength(head, at)).toBe(r.length);
            // The same bytes Buffer's big-endian readers see.
            expect(head.readUInt16BE(at)).toBe(r.token);
            expect(head.readUInt16BE(at + 2)).toBe(0);
            expect(head.readUInt32BE(at + 4)).toBe(r.range);
            expect(head.readUInt32BE(at + 8)).toBe(r.length);
            expect(head.readUInt32BE(at + 12) * 2 ** 32 + head.readUInt32BE(at + 16)).toBe(r.offset);
          });
        },
      ),
      { numRuns: 300 },
    );
  });
});
