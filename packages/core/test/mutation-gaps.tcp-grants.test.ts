/**
 * Tests written to kill surviving Stryker mutants of the TCP grant check (src/kit/grants.ts,
 * GrantTable.check), through the wire as a hostile peer sends it: the frame-size bound, a WRITEV
 * whose data does not match its ranges, a head listing a token no range uses, and the refusal
 * messages that name the range.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { InvalidInputError } from '../src/errors.js';
import * as kitFrames from '../src/kit/frames.js';
import { GrantEntry, GrantTable } from '../src/kit/grants.js';
import * as tcpFrames from '../src/tcp/frames.js';
import { pattern } from '../src/testing/pattern.js';
import { GRANT_STRIDE, type TransportRegistration } from '../src/transport.js';
import { holderNode, hostile, type Frame } from './helpers/raw-peer.js';

const { FrameType, decodeError, encodeReadvReq, encodeWritevReq } = tcpFrames;

const MAX = 64 * 1024;

async function ask(target: Awaited<ReturnType<typeof holderNode>>, wire: Buffer[]): Promise<Frame[]> {
  const res = await hostile(target, wire, { ms: 5000, until: (f) => f.length >= wire.length });
  expect(res.closedByPeer).toBe(false);
  expect(res.frames.length).toBe(wire.length);
  return res.frames;
}

describe('tcp grant check: frame bounds, data lengths, unused tokens, messages', () => {
  let holder: Awaited<ReturnType<typeof holderNode>>;
  let mem: Uint8Array;
  let initial: Uint8Array;
  let reg: TransportRegistration;
  let grant: TransportRegistration;
  beforeAll(async () => {
    holder = await holderNode('gap-tcp', { maxChunkBytes: MAX });
    mem = pattern(4 * MAX, 5);
    initial = mem.slice();
    reg = await holder.t.register({ kind: 'host', buffer: mem });
    const ranges = Float64Array.of(0, 0, 100);
    grant = holder.t.grant({ handles: [reg.handle], count: 1, ranges, bytes: 100 });
    expect(ranges.length).toBe(GRANT_STRIDE);
  });
  afterAll(async () => {
    await holder.t.close();
  });

  it('an oversized frame, or a WRITEV whose data does not match its ranges, is never served and writes nothing (the frame layer refuses it first)', async () => {
    const big = [
      { token: 0, range: 0, offset: 0, length: MAX / 2 },
      { token: 0, range: 0, offset: MAX, length: MAX / 2 },
      { token: 0, range: 0, offset: 2 * MAX, length: 1 },
    ];
    const short = [{ token: 0, range: 0, offset: 10, length: 20 }];
    const wires: [string, Buffer][] = [
      ['READV over the chunk bound', encodeReadvReq(1, [reg.payload], big)],
      ['WRITEV over the chunk bound', encodeWritevReq(2, [reg.payload], big, Buffer.alloc(MAX + 1, 7))],
      ...[0, 19, 21].map((n): [string, Buffer] => [`WRITEV of 20 bytes with ${n} bytes of data`, encodeWritevReq(3, [grant.payload], short, Buffer.alloc(n, 0xc3))]),
    ];
    for (const [what, wire] of wires) {
      const res = await hostile(holder, [wire], { ms: 5000, until: (f) => f.length >= 1 });
      for (const f of res.frames) expect(f.type, what).toBe(FrameType.Error);
      expect(res.frames.length > 0 || res.closedByPeer, what).toBe(true);
      expect(Buffer.compare(mem, initial), what).toBe(0);
    }
  });

  it('check() itself: a total over the bound is TOO_LARGE naming the range that crosses it; a WRITEV with no data for its ranges is BAD_REQUEST', () => {
    const t = new GrantTable({ transport: 'test', revokeGraceMs: 1000 });
    const r = t.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const ranges = [
      { token: 0, offset: 0, length: 600 },
      { token: 0, offset: 1000, length: 500 },
      { token: 0, offset: 2000, length: 1 },
    ];
    const h = kitFrames.encodeReadvReq(1, [r.payload], ranges).subarray(kitFrames.HEADER_BYTES);
    expect(t.check(h, -1, 1000, [])).toMatchObject({ code: 'TOO_LARGE', range: 1, message: 'range 1: the frame asks for more than 1000 bytes' });
    expect(Array.isArray(t.check(h, -1, 1101, []))).toBe(true);
    const w = kitFrames.encodeWritevReq(1, [r.payload], [{ token: 0, offset: 0, length: 8 }], new Uint8Array(8));
    const wh = w.subarray(kitFrames.HEADER_BYTES, kitFrames.HEADER_BYTES + kitFrames.vecHeadBytes(1, 1));
    expect(t.check(wh, 0, 1024, [])).toMatchObject({ code: 'BAD_REQUEST', range: kitFrames.NO_RANGE, message: 'lengths do not match the data' });
    expect(Array.isArray(t.check(wh, 8, 1024, []))).toBe(true);
  });

  it('check() pins only live entries: an unknown token that no range uses is not pinned', () => {
    const t = new GrantTable({ transport: 'test', revokeGraceMs: 1000 });
    const r = t.register({ kind: 'host', buffer: new Uint8Array(64) });
    const h = kitFrames.encodeReadvReq(1, [new Uint8Array(16).fill(9), r.payload], [{ token: 1, offset: 0, length: 8 }]).subarray(kitFrames.HEADER_BYTES);
    const entries: unknown[] = [];
    const pin = t.check(h, -1, 1024, entries as never[]);
    expect(Array.isArray(pin)).toBe(true);
    expect((pin as unknown[]).length).toBe(1);
    expect((pin as unknown[])[0]).toBeInstanceOf(GrantEntry);
    expect(entries.length).toBe(2);
    expect(entries[0]).toMatchObject({ code: 'UNKNOWN_GRANT' });
  });

  it('a zero-length range is BAD_REQUEST with a message naming it', async () => {
    const [f] = await ask(holder, [encodeReadvReq(4, [grant.payload], [{ token: 0, range: 0, offset: 0, length: 8 }, { token: 0, range: 0, offset: 8, length: 0 }])]);
    expect(f?.type).toBe(FrameType.Error);
    expect(decodeError(f!.body)).toMatchObject({ code: 'BAD_REQUEST', range: 1 });
    expect(decodeError(f!.body).message).toMatch(/range 1 has length 0/);
  });

  it('out-of-bounds messages say what the range was checked against (a registration or a granted range)', async () => {
    const [a, b] = await ask(holder, [
      encodeReadvReq(5, [reg.payload], [{ token: 0, range: 0, offset: 4 * MAX - 1, length: 2 }]),
      encodeReadvReq(6, [grant.payload], [{ token: 0, range: 0, offset: 99, length: 2 }]),
    ]);
    expect(decodeError(a!.body).message).toMatch(/range 0: 262143\+2 exceeds the registration of 262144 bytes/);
    expect(decodeError(b!.body).message).toMatch(/range 0: 99\+2 exceeds granted range 0 of 100 bytes/);
  });

  it('a head that lists an unknown or revoked token no range uses is still served from its valid tokens', async () => {
    const unknown = new Uint8Array(16).fill(0x42);
    const [f, g] = await ask(holder, [
      encodeReadvReq(7, [grant.payload, unknown], [{ token: 0, range: 0, offset: 0, length: 32 }]),
      encodeWritevReq(8, [unknown, reg.payload], [{ token: 1, range: 0, offset: 3 * MAX, length: 4 }], Buffer.from(mem.subarray(3 * MAX, 3 * MAX + 4))),
    ]);
    expect(f?.type).toBe(FrameType.ReadvData);
    expect(Buffer.compare(f!.body, Buffer.from(mem.subarray(0, 32)))).toBe(0);
    expect(g?.type).not.toBe(FrameType.Error);
    expect(Buffer.compare(mem, initial)).toBe(0);
    // And afterwards the connection still serves (nothing was left pinned or broken).
    const [h] = await ask(holder, [encodeReadvReq(9, [grant.payload], [{ token: 0, range: 0, offset: 50, length: 50 }])]);
    expect(Buffer.compare(h!.body, Buffer.from(mem.subarray(50, 100)))).toBe(0);
  });
});

describe('tcp grants made by a direct call of the transport (not through the engine, which checks every range)', () => {
  let holder: Awaited<ReturnType<typeof holderNode>>;
  beforeAll(async () => {
    holder = await holderNode('direct-tcp', { maxChunkBytes: MAX });
  });
  afterAll(async () => {
    await holder.t.close();
  });

  it('a block grant naming a block past its registration is refused (InvalidInputError naming the index); one inside it is made', async () => {
    const reg = await holder.t.register({ kind: 'host', buffer: new Uint8Array(3000) });
    const spec = (indices: number[]) => ({ handles: [reg.handle], count: indices.length, bytes: indices.length * 1024, blocks: { base: 0, blockBytes: 1024, indices: Uint32Array.from(indices) }, ranges: new Float64Array(0) });
    // 3000 bytes hold blocks 0 and 1 of 1,024 bytes whole; block 2 would end at 3,072.
    expect(() => holder.t.grant(spec([0, 2]))).toThrow(InvalidInputError);
    expect(() => holder.t.grant(spec([0, 2]))).toThrow(/block 2 \(index 1\)/);
    const ok = holder.t.grant(spec([1, 0]));
    await holder.t.revokeGrant(ok.handle);
    await holder.t.revoke(reg.handle);
  });

  it('a range grant reaching past its registration: a read of it is refused OUT_OF_BOUNDS and nothing past the registration is sent, even with a read of other memory pipelined behind it', async () => {
    const mem = new Uint8Array(3000).fill(0x11);
    const other = new Uint8Array(4096).fill(0x5a);
    const reg = await holder.t.register({ kind: 'host', buffer: mem });
    const otherReg = await holder.t.register({ kind: 'host', buffer: other });
    // Granted bytes 2048..4096 of a 3000-byte registration: 1048 of them do not exist.
    const g = holder.t.grant({ handles: [reg.handle], count: 1, bytes: 2048, ranges: Float64Array.of(0, 2048, 2048) });
    const frames = await ask(holder, [encodeReadvReq(1, [g.payload], [{ token: 0, range: 0, offset: 0, length: 2048 }]), encodeReadvReq(2, [otherReg.payload], [{ token: 0, range: 0, offset: 0, length: 4096 }])]);
    expect(frames[0]?.type).toBe(FrameType.Error);
    expect(decodeError(frames[0]?.body as Buffer)).toMatchObject({ code: 'OUT_OF_BOUNDS', range: 0, message: 'range 0: granted range 0 lies outside its registration' });
    // The read behind it gets exactly its own bytes.
    expect(frames[1]?.type).toBe(FrameType.ReadvData);
    expect(Buffer.compare(frames[1]?.body as Buffer, Buffer.from(other))).toBe(0);
    // A range of it that starts inside the registration and ends past it, behind one that is served: refused, naming it.
    const across = await ask(holder, [
      encodeReadvReq(4, [g.payload, otherReg.payload], [
        { token: 1, range: 0, offset: 0, length: 16 },
        { token: 0, range: 0, offset: 100, length: 900 },
      ]),
    ]);
    expect(decodeError(across[0]?.body as Buffer)).toMatchObject({ code: 'OUT_OF_BOUNDS', range: 1, message: 'range 1: granted range 0 lies outside its registration' });
    // Inside the registration the same grant serves its bytes.
    const inside = await ask(holder, [encodeReadvReq(3, [g.payload], [{ token: 0, range: 0, offset: 0, length: 952 }])]);
    expect(inside[0]?.type).toBe(FrameType.ReadvData);
    expect(Buffer.compare(inside[0]?.body as Buffer, Buffer.from(mem.subarray(2048)))).toBe(0);
    await holder.t.revokeGrant(g.handle);
    await holder.t.revoke(reg.handle);
    await holder.t.revoke(otherReg.handle);
  });
});
