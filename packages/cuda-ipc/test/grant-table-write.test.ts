/**
 * The native write of a range grant's table (`native.writeRangeTable`, called by
 * `CudaIpcTransport.grant` through `GrantTable.writeRanges`): every range is checked against its
 * registration in the same pass that writes it (invariant 13: nothing readable outside the
 * granted ranges), the first bad range is named, a refused grant gives its record and arena
 * space back, and what was written reads back as the exact bytes of each range. The transport is
 * called directly (the engine checks ranges first, so through it the native check is never the
 * one that refuses).
 */
import fc from 'fast-check';
import { afterAll, describe, expect, it } from 'vitest';
import { GRANT_STRIDE, InvalidInputError, createTransferBatch, defaultHostId, silentLogger, type TransportHost } from '@tensorwire/core';
import { GrantTable } from '../src/grants.js';
import { CudaIpcTransport, allocateSharedMemory, native } from '../src/index.js';

const BLOCK = 4096;
const REGION_BLOCKS = 64;
const pid = process.pid;
const opened: CudaIpcTransport[] = [];
afterAll(async () => {
  await Promise.all(opened.map((t) => t.close()));
});

async function pair(tag: string): Promise<{ ta: CudaIpcTransport; tb: CudaIpcTransport; hosts: TransportHost[] }> {
  const hosts: TransportHost[] = ['a', 'b'].map((n) => ({ identity: { nodeId: `gtw${tag}${n}${pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
  const ta = new CudaIpcTransport();
  const tb = new CudaIpcTransport();
  opened.push(ta, tb);
  await ta.start(hosts[0] as TransportHost);
  await tb.start(hosts[1] as TransportHost);
  return { ta, tb, hosts };
}

describe('native range table write', () => {
  it('refuses every malformed range at its index, and gives the record and arena back', async () => {
    const { tb } = await pair('bad');
    const region = allocateSharedMemory(REGION_BLOCKS * BLOCK, `gtwbad${pid}`);
    const other = allocateSharedMemory(4 * BLOCK, `gtwbad2${pid}`);
    const reg = await tb.register({ kind: 'host', buffer: region });
    const reg2 = await tb.register({ kind: 'host', buffer: other });
    const good = (k: number): [number, number, number] => [k % 2, k * BLOCK % (4 * BLOCK), BLOCK];
    // One live grant first, so the table exists and its counts can be compared.
    const first = new Float64Array(4 * GRANT_STRIDE);
    for (let k = 0; k < 4; k++) first.set(good(k), k * GRANT_STRIDE);
    const g0 = tb.grant({ handles: [reg.handle, reg2.handle], count: 4, ranges: first, bytes: 4 * BLOCK }) as { handle: object };
    const before = tb.grantTables().map((t) => ({ live: t.live, freeRecords: t.freeRecords, freeRangeBytes: t.freeRangeBytes }));
    const cases: [string, [number, number, number]][] = [
      ['past the end of its registration', [1, 3 * BLOCK + 1, BLOCK]],
      ['ending one byte past its registration', [0, (REGION_BLOCKS - 1) * BLOCK, BLOCK + 1]],
      ['empty', [0, 0, 0]],
      ['a fractional offset', [0, 0.5, BLOCK]],
      ['a fractional length', [0, 0, BLOCK - 0.25]],
      ['a NaN offset', [0, Number.NaN, BLOCK]],
      ['a NaN length', [0, 0, Number.NaN]],
      ['a negative offset', [0, -BLOCK, BLOCK]],
      ['a registration index past the handles', [2, 0, BLOCK]],
      ['a negative registration index', [-1, 0, BLOCK]],
      ['a fractional registration index', [0.5, 0, BLOCK]],
      ['an offset of 2^53', [0, 2 ** 53, 1]],
      ['an infinite length', [0, 0, Number.POSITIVE_INFINITY]],
    ];
    for (const [what, bad] of cases) {
      for (const at of [0, 5, 9]) {
        const ranges = new Float64Array(10 * GRANT_STRIDE);
        for (let k = 0; k < 10; k++) ranges.set(k === at ? bad : good(k), k * GRANT_STRIDE);
        let err: unknown;
        try {
          tb.grant({ handles: [reg.handle, reg2.handle], count: 10, ranges, bytes: 10 * BLOCK });
        } catch (e) {
          err = e;
        }
        expect(err, `${what} at ${at}`).toBeInstanceOf(InvalidInputError);
        expect((err as InvalidInputError).details['range'], `${what} at ${at}`).toBe(at);
      }
    }
    // Nothing of the refused grants stays: same live records, free records and free arena bytes.
    expect(tb.grantTables().map((t) => ({ live: t.live, freeRecords: t.freeRecords, freeRangeBytes: t.freeRangeBytes }))).toEqual(before);
    await tb.revokeGrant(g0.handle);
  });

  it('refuses a table that does not fit, or one that is not a grant table', () => {
    const ranges = Float64Array.of(0, 0, BLOCK);
    const regs = Float64Array.of(0, 4096, 16 * BLOCK);
    const notTable = allocateSharedMemory(BLOCK, `gtwnt${pid}`);
    expect(() => native.writeRangeTable(notTable.buffer as ArrayBuffer, 0, ranges, 1, regs)).toThrow(/grant table|segment/);
    expect(() => native.writeRangeTable(notTable.buffer as ArrayBuffer, 0, ranges, 2, regs)).toThrow(/fewer than count/);
    expect(() => native.writeRangeTable(notTable.buffer as ArrayBuffer, 0, ranges, 1, Float64Array.of(0, 1))).toThrow(/3 numbers/);
    expect(() => native.writeRangeTable(notTable.buffer as ArrayBuffer, 0, ranges, 1, Float64Array.of(0, -1, 1))).toThrow(/non-negative integers/);
    // A real table with room for 4 ranges (96 bytes of arena): a fifth, or any start past its
    // room, or a misaligned start, is refused before anything is written.
    const table = GrantTable.create(`gtwfit${pid}`, { records: 1, dir: 1, arena: 96 });
    try {
      const five = new Float64Array(5 * GRANT_STRIDE);
      for (let k = 0; k < 5; k++) five.set([0, k * BLOCK, BLOCK], k * GRANT_STRIDE);
      const hs = [{ base: 4096, buffer: new Uint8Array(16 * BLOCK) }];
      const dirs = new Uint32Array(1);
      expect(table.writeRanges(0, five, 4, hs, dirs)).toBe(4 * BLOCK);
      for (const [at, n] of [[0, 5], [24, 4], [96, 1], [8, 4], [4, 1]] as const) {
        expect(() => table.writeRanges(at, five, n, hs, dirs), `${n} at ${at}`).toThrow(InvalidInputError);
      }
      expect(table.writeRanges(72, five, 1, hs, dirs)).toBe(BLOCK);
    } finally {
      table.close();
    }
  });

  it('what is written reads back: random range sets over two registrations land the exact bytes of each range', async () => {
    const { ta, tb, hosts } = await pair('rt');
    const regions = [allocateSharedMemory(REGION_BLOCKS * BLOCK, `gtwrt0${pid}`), allocateSharedMemory(REGION_BLOCKS * BLOCK, `gtwrt1${pid}`)];
    for (const [r, region] of regions.entries()) for (let i = 0; i < region.length; i++) region[i] = (i * 31 + (i >> 9) + r * 101) & 255;
    const regs = await Promise.all(regions.map((buffer) => tb.register({ kind: 'host', buffer })));
    const dst = new Uint8Array(REGION_BLOCKS * BLOCK);
    const local = await ta.register({ kind: 'host', buffer: dst });
    const conn = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { signal: new AbortController().signal, deadline: Date.now() + 10_000, streams: 1 });
    const range = fc.record({ reg: fc.integer({ min: 0, max: 1 }), off: fc.integer({ min: 0, max: REGION_BLOCKS * BLOCK - 1 }), len: fc.integer({ min: 1, max: 3 * BLOCK }) });
    await fc.assert(
      fc.asyncProperty(fc.array(range, { minLength: 1, maxLength: 24 }), async (list) => {
        const rs = list.map((x) => ({ ...x, len: Math.min(x.len, REGION_BLOCKS * BLOCK - x.off) }));
        const ranges = new Float64Array(rs.length * GRANT_STRIDE);
        rs.forEach((x, k) => ranges.set([x.reg, x.off, x.len], k * GRANT_STRIDE));
        const bytes = rs.reduce((s, x) => s + x.len, 0);
        const g = tb.grant({ handles: regs.map((r) => r.handle), count: rs.length, ranges, bytes }) as { handle: object; payload: Uint8Array };
        try {
          const remote = ta.decodeRemote(g.payload, 'host', bytes, Float64Array.from(rs.map((x) => x.len)));
          for (const [k, x] of rs.entries()) {
            dst.fill(0xee, 0, x.len + 1);
            await conn.execute(0, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote, remoteOffset: 0, length: x.len, remoteRange: k, request: k }]), {
              signal: new AbortController().signal,
              deadline: Date.now() + 10_000,
            });
            const src = regions[x.reg] as Uint8Array;
            expect(Buffer.compare(dst.subarray(0, x.len), src.subarray(x.off, x.off + x.len)), `range ${k}`).toBe(0);
            expect(dst[x.len]).toBe(0xee);
          }
        } finally {
          await tb.revokeGrant(g.handle);
        }
      }),
      { numRuns: 40 },
    );
  });
});
