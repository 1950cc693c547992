import fc from 'fast-check';
import { afterAll, describe, expect, it } from 'vitest';
import { ClosedError, InvalidInputError, TimedOutError, parseId } from '@tensorwire/core';
import { SegmentKind, TensorPool, capabilities, native, poolIdFromSegmentName, poolSegmentName, segmentNameProblem } from '../src/index.js';
import { uniqueOwner } from './helpers.js';

const pools: TensorPool[] = [];
function pool(prefix = 'p', opts: { maxSlotBytes?: number } = {}): TensorPool {
  const p = new TensorPool({ owner: uniqueOwner(prefix), ...opts });
  pools.push(p);
  return p;
}
afterAll(async () => {
  await Promise.all(pools.map((p) => p.close()));
});

async function rejects(p: Promise<unknown> | (() => unknown), type: new (...a: never[]) => Error, message?: RegExp): Promise<void> {
  let caught: unknown;
  try {
    await (typeof p === 'function' ? p() : p);
  } catch (e) {
    caught = e;
  }
  expect(caught).toBeInstanceOf(type);
  if (message) expect((caught as Error).message).toMatch(message);
}

describe('capabilities', () => {
  it('loads the addon here and says exactly why CUDA is or is not available', () => {
    const c = capabilities();
    expect(c.addon.loaded).toBe(true);
    expect(c.sharedMemory.available).toBe(true);
    if (!c.cuda.available) {
      expect(c.cuda.reason).toMatch(/libcuda\.so\.1|cuInit|cuDeviceGetCount|no devices/);
      console.warn(`[cuda-ipc] CUDA unavailable: ${c.cuda.reason}`);
    } else {
      expect(c.cuda.deviceCount).toBeGreaterThan(0);
    }
  });
});

describe('host slots in one process', () => {
  it('register / write / read / free round trip with dtype and shape', async () => {
    const a = pool('own');
    const b = pool('rd');
    const id = await a.register({ dtype: 'float32', shape: [2, 3] });
    expect(parseId(id, 'pool').owner).toBe(a.owner);
    a.writeSync(id, new Float32Array([1, 2, 3, 4, 5, 6]));
    using v = b.readSync(id);
    expect(v).toMatchObject({ id, dtype: 'float32', shape: [2, 3], byteLength: 24, device: 'cpu' });
    expect(Array.from(v.array() as Float32Array)).toEqual([1, 2, 3, 4, 5, 6]);
    expect(v.isConsistent()).toBe(true);
    a.writeSync(id, new Float32Array([9, 9]), { shape: [1, 2] });
    expect(v.isConsistent()).toBe(false);
    using w = b.readSync(id);
    expect(w.shape).toEqual([1, 2]);
    expect(Array.from(w.array() as Float32Array)).toEqual([9, 9]);
    const snap = b.snapshot(id);
    expect(snap.info.byteLength).toBe(8);
    await a.free(id);
    expect(w.isConsistent()).toBe(false);
    // The old view's memory stays mapped and readable.
    expect(Array.from(w.array() as Float32Array)).toEqual([9, 9]);
    await rejects(() => b.readSync(id), ClosedError, /does not exist|freed/);
    await rejects(() => a.readSync(id), ClosedError, /freed/);
    await rejects(() => a.writeSync(id, new Uint8Array(4)), ClosedError, /freed/);
  });

  it('disposed views refuse access; dispose is idempotent', async () => {
    const a = pool();
    const id = await a.register({ byteLength: 16 });
    const v = a.readSync(id);
    v.dispose();
    v.dispose();
    expect(v.disposed).toBe(true);
    await rejects(() => v.buffer, ClosedError);
  });

  it('close() is idempotent and removes owned slots', async () => {
    const a = new TensorPool({ owner: uniqueOwner('cl') });
    const b = pool();
    const id = await a.register({ byteLength: 16 });
    await Promise.all([a.close(), a.close(), a[Symbol.asyncDispose]()]);
    await rejects(a.register({ byteLength: 1 }), ClosedError);
    await rejects(() => b.readSync(id), ClosedError);
  });
});

describe('bad input gets typed errors naming what was wrong', () => {
  it('owner names', () => {
    for (const owner of ['', 'a:b', 'a/b', '../x', 'x'.repeat(65), '-lead']) {
      expect(() => new TensorPool({ owner })).toThrow(InvalidInputError);
    }
  });

  it('sizes, shapes, dtypes and devices', async () => {
    const a = pool('bad', { maxSlotBytes: 1 << 20 });
    await rejects(a.register({ byteLength: 0 }), InvalidInputError, /byteLength/);
    await rejects(a.register({ byteLength: -5 }), InvalidInputError, /byteLength/);
    await rejects(a.register({ byteLength: 1.5 }), InvalidInputError, /byteLength/);
    await rejects(a.register({ byteLength: (1 << 20) + 1 }), InvalidInputError, /limit/);
    await rejects(a.register({ shape: [2, -1] }), InvalidInputError, /shape\[1\]/);
    await rejects(a.register({ shape: [0] }), InvalidInputError, /shape\[0\]/);
    await rejects(a.register({ shape: [2 ** 40, 2 ** 40] }), InvalidInputError, /limit/);
    await rejects(a.register({ shape: [1, 1, 1, 1, 1, 1, 1, 1, 1] }), InvalidInputError, /dimensions/);
    await rejects(a.register({ dtype: 'complex64' as never, byteLength: 8 }), InvalidInputError, /dtype/);
    await rejects(a.register({ dtype: 'float32', byteLength: 6 }), InvalidInputError, /multiple/);
    await rejects(a.register({ shape: [4], byteLength: 5 }), InvalidInputError, /does not match/);
    await rejects(a.register({ byteLength: 8, device: 'gpu0' as never }), InvalidInputError, /device/);
  });

  it('writes larger than the slot, empty writes, shape mismatches', async () => {
    const a = pool();
    const id = await a.register({ byteLength: 64 });
    await rejects(() => a.writeSync(id, new Uint8Array(65)), InvalidInputError, /exceeds the slot capacity/);
    await rejects(() => a.writeSync(id, new Uint8Array(0)), InvalidInputError, /0 bytes/);
    await rejects(() => a.writeSync(id, new Uint8Array(8), { shape: [3] }), InvalidInputError, /shape/);
    await rejects(() => a.writeSync(id, 'hello' as never), InvalidInputError, /data/);
  });

  it('malformed and foreign ids', async () => {
    const a = pool();
    for (const id of ['', 'pool', 'pool:x', 'pool:x:1:2', 'block:x:1', 'pool:../etc:1', 'pool:a/b:1', 'pool:a:..', 42]) {
      await rejects(() => a.readSync(id as string), InvalidInputError);
      await rejects(a.free(id as string), InvalidInputError);
    }
    await rejects(() => a.writeSync(`pool:${a.owner}:999`, new Uint8Array(1)), InvalidInputError, /not registered/);
    await rejects(() => a.readSync('pool:nobody-here:1'), ClosedError, /does not exist/);
  });

  it('a header changed by another process is refused, never trusted', async () => {
    const a = pool('tamper');
    const b = pool('tamper-rd');
    const L = native.layout().offsets as Record<string, number>;
    const cases: [string, (dv: DataView) => void, RegExp][] = [
      ['magic', (dv) => dv.setUint32(L['magic'] as number, 0xdeadbeef, true), /magic/],
      ['byteLength beyond capacity', (dv) => dv.setBigUint64(L['byte_length'] as number, 1n << 40n, true), /byteLength|exceeds/],
      ['capacity', (dv) => dv.setBigUint64(L['capacity'] as number, 1n << 30n, true), /capacity/],
      ['dataOffset', (dv) => dv.setBigUint64(L['data_offset'] as number, 0n, true), /dataOffset/],
      ['ndim', (dv) => dv.setUint32(L['ndim'] as number, 99, true), /ndim/],
      ['dtype', (dv) => dv.setUint32(L['dtype'] as number, 77, true), /dtype/],
      ['shape', (dv) => dv.setBigUint64(L['shape'] as number, 3n, true), /shape/],
      ['id', (dv) => dv.setUint8(L['id'] as number, 0x2f), /id/],
      ['version', (dv) => dv.setUint32(L['version'] as number, 9, true), /version/],
    ];
    for (const [what, tamper, msg] of cases) {
      const id = await a.register({ byteLength: 256 });
      // Another process would map the segment by name; do exactly that.
      const rogue = native.shmOpen(poolSegmentName(id), 1 << 20);
      tamper(new DataView(rogue));
      let caught: unknown;
      try {
        b.readSync(id);
      } catch (e) {
        caught = e;
      }
      expect(caught, what).toBeInstanceOf(InvalidInputError);
      expect((caught as Error).message, what).toMatch(msg);
      // The owner's write checks against its own capacity and refuses a bad header too.
      if (what === 'capacity' || what === 'magic' || what === 'dataOffset') {
        expect(() => a.writeSync(id, new Uint8Array(8)), what).toThrow(InvalidInputError);
      }
      await a.free(id);
    }
  });
});

describe('properties (fast-check)', () => {
  const ownerArb = fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9_-]{0,20}$/);
  const localArb = fc.stringMatching(/^[A-Za-z0-9_-]{1,20}$/);

  it('pool id ↔ segment name is a bijection and every name passes validation', () => {
    fc.assert(
      fc.property(ownerArb, localArb, (owner, local) => {
        const id = `pool:${owner}:${local}`;
        const name = poolSegmentName(id);
        expect(segmentNameProblem(name)).toBeUndefined();
        expect(native.nameProblem(name)).toBeUndefined();
        expect(poolIdFromSegmentName(name)).toBe(id);
      }),
    );
  });

  it('the TypeScript and native name checks agree on arbitrary strings, and reject / and ..', () => {
    const chars = fc.constantFrom('/', '.', 't', 'w', '-', 'a', 'Z', '0', '_', ':', ' ', '\u00e9', '\0');
    const nameArb = fc.oneof(
      fc.string(),
      fc.array(chars, { maxLength: 220 }).map((c) => '/tw-' + c.join('')),
    );
    fc.assert(
      fc.property(nameArb, (name) => {
        const ts = segmentNameProblem(name);
        const nat = name.includes('\0') ? 'nul' : native.nameProblem(name);
        expect(ts === undefined).toBe(nat === undefined);
        if (ts === undefined) {
          expect(name.startsWith('/tw-')).toBe(true);
          expect(name.indexOf('/', 1)).toBe(-1);
          expect(name.includes('..')).toBe(false);
          expect(name.length).toBeLessThanOrEqual(200);
        }
      }),
      { numRuns: 2000 },
    );
  });

  it("owner guard: a non-owner's free never touches the owner's slots, whatever the counters", async () => {
    await fc.assert(
      fc.asyncProperty(fc.integer({ min: 1, max: 4 }), fc.array(fc.nat({ max: 6 }), { maxLength: 8 }), async (n, frees) => {
        const owner = pool('og');
        const other = pool('og');
        const ids: string[] = [];
        for (let i = 0; i < n; i++) {
          ids.push(await owner.register({ byteLength: 16 }));
          await other.register({ byteLength: 16 });
        }
        for (const id of ids) owner.writeSync(id, new Uint8Array(16).fill(7));
        for (const id of ids) other.readSync(id).dispose();
        for (const k of frees) {
          // Same counters, different owner, and ids of the owner itself.
          await other.free(`pool:${owner.owner}:${k + 1}`);
          await other.free(`pool:${other.owner}:${(k % n) + 1}`).catch(() => undefined);
        }
        expect(owner.owned()).toEqual(ids);
        for (const id of ids) {
          using v = other.readSync(id);
          expect(Array.from(v.buffer as Uint8Array).every((x) => x === 7)).toBe(true);
        }
        // The owner's guard also refuses a foreign write.
        expect(() => other.writeSync(ids[0] as string, new Uint8Array(1))).toThrow(InvalidInputError);
        await owner.close();
        await other.close();
      }),
      { numRuns: 25 },
    );
  });

  it('the header decoder never crashes or reads out of bounds on arbitrary bytes', () => {
    const L = native.layout();
    const off = L.offsets as Record<string, number>;
    // Start from a valid header so mutations reach deep fields, then flip bytes.
    const a = pool('fz');
    return a.register({ dtype: 'int16', shape: [8, 8] }).then((id) => {
      const seg = native.shmOpen(poolSegmentName(id), 1 << 20);
      const valid = new Uint8Array(seg.slice(0));
      fc.assert(
        fc.property(
          fc.array(fc.tuple(fc.nat({ max: 4095 }), fc.nat({ max: 255 })), { maxLength: 12 }),
          fc.constantFrom(4096, 4096 + 128, 4096 + 64, 100, 0),
          fc.boolean(),
          (flips, size, focus) => {
            const buf = new ArrayBuffer(size);
            const u8 = new Uint8Array(buf);
            u8.set(valid.subarray(0, size));
            for (const [pos, val] of flips) {
              const p = focus ? [off['byte_length'], off['ndim'], off['shape'], off['dtype'], off['capacity'], off['id_length']][pos % 6]! + (pos % 8) : pos;
              if (p < size) u8[p] = val;
            }
            for (const kind of [0, SegmentKind.Pool, SegmentKind.Grant]) {
              try {
                const m = native.headerDecode(buf, kind);
                // Whatever it accepted is consistent with the buffer it was given.
                expect(m.headerSize).toBe(4096);
                if (m.kind === SegmentKind.Pool && m.device === -1) {
                  expect(m.dataOffset + m.byteLength).toBeLessThanOrEqual(size);
                  expect(m.capacity).toBe(size - 4096);
                }
              } catch (e) {
                // Bad fields are InvalidInput; an odd generation (a writer that died mid-write) is TimedOut.
                expect(e instanceof InvalidInputError || e instanceof TimedOutError, String(e)).toBe(true);
              }
            }
            try {
              const m = native.seqCopy(buf, '', new Uint8Array(256));
              expect(m.byteLength).toBeLessThanOrEqual(Math.min(256, size - 4096));
            } catch (e) {
              expect((e as { code?: string }).code).toMatch(/^TW_/);
            }
          },
        ),
        { numRuns: 3000 },
      );
    });
  });
});
