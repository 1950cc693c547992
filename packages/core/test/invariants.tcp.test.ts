/**
 * Mutation-audit gaps of the TCP grant checks (issue 14, invariant 13), each shown to fail with
 * the guarded line broken (see the package README, "Mutation testing"):
 *
 * - a raw READV / WRITEV whose range starts inside a grant (or registration) and ends outside it
 *   is refused whole: the check is offset + length, not offset alone;
 * - a grant issued by a third node, presented through another peer, is refused: by the engine
 *   (the descriptor belongs to another node) and, on the wire, by the peer (not its token).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { InvalidInputError, TransferEngine, silentLogger } from '../src/index.js';
import * as tcpFrames from '../src/tcp/frames.js';
import { TcpTransport } from '../src/tcp/transport.js';
import { pattern } from '../src/testing/pattern.js';
import { GRANT_STRIDE, type GrantRanges, type TransportRegistration } from '../src/transport.js';
import { holderNode, hostile, type Frame } from './helpers/raw-peer.js';

const { FrameType, decodeError, encodeReadvReq, encodeWritevReq } = tcpFrames;

function grantRanges(handles: object[], list: readonly (readonly [number, number, number])[]): GrantRanges {
  const ranges = new Float64Array(list.length * GRANT_STRIDE);
  let bytes = 0;
  list.forEach((r, k) => {
    ranges.set(r, k * GRANT_STRIDE);
    bytes += r[2];
  });
  return { handles, count: list.length, ranges, bytes };
}

async function ask(target: Awaited<ReturnType<typeof holderNode>>, wire: Buffer[]): Promise<Frame[]> {
  const res = await hostile(target, wire, { ms: 5000, until: (f) => f.length >= wire.length });
  expect(res.closedByPeer).toBe(false);
  expect(res.frames.length).toBe(wire.length);
  return res.frames;
}

describe('tcp grant check: offset + length inside the granted range', () => {
  const SIZE = 4096;
  let holder: Awaited<ReturnType<typeof holderNode>>;
  let outer: Uint8Array;
  let initial: Uint8Array;
  let reg: TransportRegistration;
  let grant: TransportRegistration;
  beforeAll(async () => {
    holder = await holderNode('inv-tcp', { maxChunkBytes: 1 << 16 });
    outer = new Uint8Array(3 * SIZE).fill(0x5a);
    const mem = outer.subarray(SIZE, 2 * SIZE);
    mem.set(pattern(SIZE, 3));
    initial = outer.slice();
    reg = await holder.t.register({ kind: 'host', buffer: mem });
    // Range 0: bytes 1000..1100 of the registration; range 1: 2000..2010.
    grant = holder.t.grant(grantRanges([reg.handle], [[0, 1000, 100], [0, 2000, 10]]));
  });
  afterAll(async () => {
    await holder.t.close();
  });

  const cases: [string, 'grant' | 'reg', number, number, number][] = [
    ['starts inside range 0, ends one byte past it', 'grant', 0, 99, 2],
    ['starts inside range 0, ends far past it (still inside the registration)', 'grant', 0, 50, 1000],
    ['starts at the first byte of range 1, one byte too long', 'grant', 1, 0, 11],
    ['starts inside the registration, ends past its end', 'reg', 0, SIZE - 8, 16],
    ['the whole registration plus one byte', 'reg', 0, 0, SIZE + 1],
  ];

  it('a read or write that starts inside and ends outside is refused OUT_OF_BOUNDS, and moves no byte', async () => {
    for (const [what, which, range, offset, length] of cases) {
      const token = which === 'grant' ? grant.payload : reg.payload;
      const ranges = [{ token: 0, range, offset, length }];
      const [r, w] = await ask(holder, [encodeReadvReq(1, [token], ranges), encodeWritevReq(2, [token], ranges, Buffer.alloc(length, 0xc3))]);
      for (const f of [r, w] as Frame[]) {
        expect(f.type, what).toBe(FrameType.Error);
        expect(decodeError(f.body), what).toMatchObject({ code: 'OUT_OF_BOUNDS', range: 0 });
      }
      expect(Buffer.compare(outer, initial), what).toBe(0);
    }
  });

  it('the same ranges shortened to end exactly at the boundary are served (the check is not off by one)', async () => {
    for (const [what, which, range, offset, length] of cases) {
      const token = which === 'grant' ? grant.payload : reg.payload;
      const limit = which === 'grant' ? (range === 0 ? 100 : 10) : SIZE;
      const fit = limit - offset;
      const [f] = await ask(holder, [encodeReadvReq(1, [token], [{ token: 0, range, offset, length: fit }])]);
      expect(f?.type, what).toBe(FrameType.ReadvData);
      const base = which === 'grant' ? (range === 0 ? 1000 : 2000) : 0;
      expect(Buffer.compare(f!.body, Buffer.from(outer.subarray(SIZE + base + offset, SIZE + base + offset + fit))), what).toBe(0);
      void length;
    }
  });
});

describe('a grant issued by a third node, presented through another peer', () => {
  it('the engine refuses it before sending anything; the peer would not know the token either', async () => {
    const engines = ['inv3a', 'inv3b', 'inv3c'].map((id) => new TransferEngine({ nodeId: id, transports: [new TcpTransport()], logger: silentLogger, metrics: false }));
    const [a, b, c] = engines as [TransferEngine, TransferEngine, TransferEngine];
    try {
      await Promise.all(engines.map((e) => e.start()));
      const secret = pattern(256, 9);
      const regC = await c.register({ kind: 'host', buffer: secret });
      const grantC = await c.grant([{ registration: regC, offset: 0, length: 128 }]);
      const dst = new Uint8Array(128).fill(0xee);
      const local = await a.register({ kind: 'host', buffer: dst });
      // Through the owner itself it reads.
      await a.read(c.endpoint(), [{ local, remote: grantC.descriptor }]);
      expect(Buffer.compare(dst, secret.subarray(0, 128))).toBe(0);
      dst.fill(0xee);
      // Through b: refused as invalid input naming the owner, never sent to b.
      for (const remote of [grantC.descriptor, regC.descriptor]) {
        let err: unknown;
        try {
          await a.read(b.endpoint(), [{ local, remote }]);
        } catch (e) {
          err = e;
        }
        expect(err).toBeInstanceOf(InvalidInputError);
        expect((err as InvalidInputError).details['field']).toBe('remote');
        expect((err as Error).message).toMatch(/belongs to inv3c, not to peer inv3b/);
      }
      expect(dst.every((x) => x === 0xee)).toBe(true);
      expect(a.connections().map((i) => i.peer.nodeId)).toEqual(['inv3c']);
    } finally {
      await Promise.all(engines.map((e) => e.close()));
    }
  });

  it("on the wire: another holder's grant token is UNKNOWN_GRANT to this holder", async () => {
    const issuer = await holderNode('inv-issuer');
    const peer = await holderNode('inv-peer');
    try {
      const mem = pattern(512, 4);
      const regI = await issuer.t.register({ kind: 'host', buffer: mem });
      const gI = issuer.t.grant(grantRanges([regI.handle], [[0, 0, 256]]));
      await peer.t.register({ kind: 'host', buffer: new Uint8Array(512) });
      for (const token of [gI.payload, regI.payload]) {
        const [f] = await ask(peer, [encodeReadvReq(1, [token], [{ token: 0, range: 0, offset: 0, length: 16 }])]);
        expect(f?.type).toBe(FrameType.Error);
        expect(decodeError(f!.body)).toMatchObject({ code: 'UNKNOWN_GRANT', range: 0 });
      }
      // The issuer itself serves it.
      const [ok] = await ask(issuer, [encodeReadvReq(1, [gI.payload], [{ token: 0, range: 0, offset: 0, length: 16 }])]);
      expect(ok?.type).toBe(FrameType.ReadvData);
    } finally {
      await issuer.t.close();
      await peer.t.close();
    }
  });
});
