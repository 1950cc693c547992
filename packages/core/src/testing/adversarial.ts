/**
 * Conformance cases through the engine for what a broken transport gets wrong and a friendly
 * test never shows: stalled peers (through a relay the suite controls), forged descriptors, an
 * endpoint that names one node and points at another, and revocation racing transfers in flight.
 */
import { describe, expect, it } from 'vitest';
import { decodeDescriptor, decodeEndpoint, encodeDescriptor, encodeEndpoint, type MemoryDescriptor } from '../descriptor.js';
import type { TransferEngine, TransferRequest } from '../engine.js';
import { ErrorCode, TensorwireError } from '../errors.js';
import type { ConformanceBuffer, SuiteContext } from './index.js';
import { pattern } from './pattern.js';
import type { StreamRelay } from './relay.js';
import { allZero, equal, expectCode, foreignByte, outcome, settle, settlesWithin, until } from './util.js';

/** The deadline the suite gives transfers that cannot finish (a stalled peer). */
const STALLED_DEADLINE_MS = 250;
const REFUSED = [ErrorCode.RemoteRejected, ErrorCode.InvalidInput];
const BROKEN = [ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated];

type Skipper = { skip: (note?: string) => void };

export function describeAdversarial(ctx: SuiteContext): void {
  const { options } = ctx;

  /** Wait until the relay has forwarded nothing for a few event-loop rounds: late bytes have arrived. */
  async function quiet(relay: StreamRelay): Promise<void> {
    let last = -1;
    while (relay.forwarded !== last) {
      last = relay.forwarded;
      await settle(50);
    }
    await settle(50);
  }

  async function guardsIntact(buf: ConformanceBuffer): Promise<boolean> {
    return buf.guardsIntact ? buf.guardsIntact() : true;
  }

  /** Refused (RemoteRejected or InvalidInput), and `dst` holds what it held before. */
  async function refused(p: Promise<unknown>, dst: ConformanceBuffer, length: number, what: string): Promise<void> {
    const before = await dst.read(0, length);
    const e = await outcome(p);
    expect(e, `${what}: expected a refusal`).toBeInstanceOf(TensorwireError);
    expect(REFUSED, `${what}: ${(e as Error).message}`).toContain((e as TensorwireError).code);
    await settle(10);
    expect(equal(await dst.read(0, length), before), `${what}: the destination changed`).toBe(true);
    expect(await guardsIntact(dst), `${what}: bytes beyond the destination changed`).toBe(true);
  }

  function payloadOf(d: MemoryDescriptor): [string, Uint8Array] {
    return [...d.transports][0] as [string, Uint8Array];
  }

  describe('stalled peers (through a relay that stops forwarding)', () => {
    /** A fresh pair whose x reaches y only through a relay. */
    async function stalledPair(tc: Skipper): Promise<{ x: TransferEngine; y: TransferEngine; relay: StreamRelay; endpoint: Uint8Array } | undefined> {
      if (!options.socketAddress) {
        const why = `${options.name} does not give ConformanceOptions.socketAddress (stream-socket transports only)`;
        process.stderr.write(`[tensorwire] skipping stalled-peer case: ${why}\n`);
        tc.skip(why);
        return undefined;
      }
      const x = await ctx.engine('st');
      const y = await ctx.engine('st');
      const via = await ctx.relay(y);
      return via && { x, y, ...via };
    }
    const guard = (): number => STALLED_DEADLINE_MS + ctx.guardMs;

    it('a peer that accepts the connection and never answers: TimedOut by the deadline; once it answers, transfers work', async (tc) => {
      const p = await stalledPair(tc);
      if (!p) return;
      const remote = await ctx.registered(p.y, 4096, 80);
      const local = await ctx.registered(p.x, 4096);
      p.relay.stall();
      const read = p.x.read(p.endpoint, [{ local: local.reg, remote: remote.reg.descriptor }], { timeoutMs: STALLED_DEADLINE_MS });
      await expectCode(settlesWithin(read, guard(), 'a read from a peer that never answered the handshake'), [ErrorCode.TimedOut]);
      p.relay.resume();
      await quiet(p.relay);
      expect(allZero(await local.buf.read(0, 4096))).toBe(true);
      await settlesWithin(p.x.read(p.endpoint, [{ local: local.reg, remote: remote.reg.descriptor }]), ctx.guardMs, 'a read once the peer answers');
      expect(equal(await local.buf.read(0, 4096), await remote.buf.read(0, 4096))).toBe(true);
    });

    for (const how of ['deadline', 'abort'] as const) {
      const title =
        how === 'deadline'
          ? 'a READ from a peer that stops answering mid-connection: TimedOut by the deadline, and its late replies land nowhere'
          : 'a READ aborted while the peer is stalled: Aborted, and its late replies land nowhere';
      it(title, async (tc) => {
        const p = await stalledPair(tc);
        if (!p) return;
        const size = 1024 * 1024;
        const remote = await ctx.registered(p.y, size, 81);
        const warm = await ctx.registered(p.x, 4096);
        await p.x.read(p.endpoint, [{ local: warm.reg, remote: remote.reg.descriptor, length: 4096 }]);
        const local = await ctx.registered(p.x, size);
        p.relay.stall();
        const ac = new AbortController();
        const read = p.x.read(p.endpoint, [{ local: local.reg, remote: remote.reg.descriptor }], how === 'deadline' ? { timeoutMs: STALLED_DEADLINE_MS } : { signal: ac.signal });
        if (how === 'abort') {
          await settle(20);
          ac.abort();
        }
        await expectCode(settlesWithin(read, guard(), `a read from a stalled peer (${how})`), [how === 'deadline' ? ErrorCode.TimedOut : ErrorCode.Aborted]);
        // The peer wakes up and answers; the answer must not reach the caller's memory.
        p.relay.resume();
        await quiet(p.relay);
        expect(allZero(await local.buf.read(0, size)), 'a late reply landed after the call settled').toBe(true);
        await settlesWithin(p.x.read(p.endpoint, [{ local: local.reg, remote: remote.reg.descriptor }]), ctx.guardMs, 'a read after the peer woke up');
        expect(equal(await local.buf.read(0, size), await remote.buf.read(0, size))).toBe(true);
      });
    }

    it('a WRITE to a stalled peer: TimedOut by the deadline; memory the caller changes afterwards never reaches the peer', async (tc) => {
      const p = await stalledPair(tc);
      if (!p) return;
      const size = 16 * 1024 * 1024;
      const src = await ctx.registered(p.x, size, 82);
      const dst = await ctx.registered(p.y, size);
      await p.x.write(p.endpoint, [{ local: src.reg, remote: dst.reg.descriptor, length: 4096 }]);
      await dst.buf.write(new Uint8Array(4096));
      const old = await src.buf.read(0, size);
      p.relay.stall();
      const write = p.x.write(p.endpoint, [{ local: src.reg, remote: dst.reg.descriptor }], { timeoutMs: STALLED_DEADLINE_MS });
      await expectCode(settlesWithin(write, guard(), 'a write to a stalled peer'), [ErrorCode.TimedOut]);
      // The call settled: the caller may reuse its memory. Nothing of the new contents may be sent.
      await src.buf.write(pattern(size, 83));
      p.relay.resume();
      await quiet(p.relay);
      expect(foreignByte(await dst.buf.read(0, size), old), 'bytes written into the source after the call settled reached the peer').toBe(-1);
    });

    it('a connection cut mid-transfer: each transfer fails with a connection error or completed in full, never partial success', async (tc) => {
      const p = await stalledPair(tc);
      if (!p) return;
      const size = 8 * 1024 * 1024;
      const remote = await ctx.registered(p.y, size, 84);
      const expected = await remote.buf.read(0, size);
      const warm = await ctx.registered(p.x, 4096);
      await p.x.read(p.endpoint, [{ local: warm.reg, remote: remote.reg.descriptor, length: 4096 }]);
      const dsts = await Promise.all(Array.from({ length: 6 }, () => ctx.registered(p.x, size)));
      const reads = dsts.map((d) => outcome(p.x.read(p.endpoint, [{ local: d.reg, remote: remote.reg.descriptor }])));
      let done = false;
      void Promise.all(reads).then(() => (done = true));
      await until(async () => done || !allZero(await (dsts[0] as { buf: ConformanceBuffer }).buf.read(0, 64)), ctx.guardMs, 'first bytes of the transfer');
      p.relay.sever();
      const outcomes = await settlesWithin(Promise.all(reads), ctx.guardMs, 'transfers on a connection that was cut');
      for (const [i, o] of outcomes.entries()) {
        const got = await (dsts[i] as { buf: ConformanceBuffer }).buf.read(0, size);
        if (o === 'ok') expect(equal(got, expected), `transfer ${i} reported success with partial data`).toBe(true);
        else {
          expect(o).toBeInstanceOf(TensorwireError);
          expect(BROKEN).toContain((o as TensorwireError).code);
        }
      }
      await settlesWithin(p.x.read(p.endpoint, [{ local: warm.reg, remote: remote.reg.descriptor, length: 4096 }]), ctx.guardMs, 'a read after the cut');
    });
  });

  describe('forged descriptors', () => {
    it('a descriptor with any one payload byte changed is refused, or (a changed address) reaches other bytes of what it grants; no payload byte goes unchecked', async () => {
      const a = ctx.a();
      const b = ctx.b();
      const remote = await ctx.registered(b, 8192, 90);
      const local = await ctx.registered(a, 4096);
      // [what, descriptor, request, the bytes the descriptor grants]
      const cases: [string, Uint8Array, Partial<TransferRequest>, Uint8Array][] = [['registration', remote.reg.descriptor, { length: 4096 }, await remote.buf.read(0, 8192)]];
      const t = b.transports[0];
      if (typeof t?.grant === 'function' && typeof t.revokeGrant === 'function') {
        const g = await b.grant([{ registration: remote.reg, offset: 1024, length: 4096 }]);
        cases.push(['range grant', g.descriptor, { range: 0, length: 4096 }, await remote.buf.read(1024, 4096)]);
      }
      for (const [what, descriptor, request, granted] of cases) {
        await a.read(b.endpoint(), [{ local: local.reg, remote: descriptor, ...request }]);
        const original = await local.buf.read(0, 4096);
        await local.buf.write(new Uint8Array(4096));
        const d = decodeDescriptor(descriptor);
        const [name, payload] = payloadOf(d);
        for (let i = 0; i < payload.length; i++) {
          for (const flip of [0x01, 0x80]) {
            const changed = payload.slice();
            changed[i] = (changed[i] as number) ^ flip;
            const forged = encodeDescriptor({ ...d, transports: new Map([[name, changed]]) });
            const label = `${what} payload byte ${i} ^ 0x${flip.toString(16)}`;
            const e = await outcome(a.read(b.endpoint(), [{ local: local.reg, remote: forged, ...request }]));
            await settle(0);
            const got = await local.buf.read(0, 4096);
            expect(await guardsIntact(local.buf), `${label}: bytes beyond the destination changed`).toBe(true);
            if (e !== 'ok') {
              expect(e, label).toBeInstanceOf(TensorwireError);
              expect(REFUSED, `${label}: ${(e as Error).message}`).toContain((e as TensorwireError).code);
              expect(allZero(got), `${label}: refused, but bytes moved`).toBe(true);
              continue;
            }
            // Served: only an address-like field may do that, and only inside what was granted.
            expect(equal(got, original), `${label}: served exactly as the real descriptor (the byte is never checked)`).toBe(false);
            expect(Buffer.from(granted).indexOf(Buffer.from(got)), `${label}: read bytes outside what the descriptor grants`).toBeGreaterThanOrEqual(0);
            await local.buf.write(new Uint8Array(4096));
          }
        }
      }
    });

    it('a descriptor re-owned to another node is refused there, even where that node has a registration in the same place', async () => {
      const a = ctx.a();
      const y = await ctx.engine('fy');
      const z = await ctx.engine('fz');
      // Same sequence of registrations and grants on both: the same places, other memory.
      const onY = await ctx.registered(y, 4096, 91);
      await ctx.registered(z, 4096, 92);
      const local = await ctx.registered(a, 4096);
      const descriptors: [string, Uint8Array, Partial<TransferRequest>][] = [['registration', onY.reg.descriptor, {}]];
      const t = y.transports[0];
      if (typeof t?.grant === 'function') {
        const zReg = await ctx.registered(z, 4096, 93);
        const yReg = await ctx.registered(y, 4096, 94);
        const gy = await y.grant([{ registration: yReg.reg, offset: 0, length: 4096 }]);
        await z.grant([{ registration: zReg.reg, offset: 0, length: 4096 }]);
        descriptors.push(['range grant', gy.descriptor, { range: 0 }]);
      }
      for (const [what, descriptor, request] of descriptors) {
        const d = decodeDescriptor(descriptor);
        const forged = encodeDescriptor({ ...d, owner: { nodeId: z.identity.nodeId, incarnation: z.identity.incarnation }, registrationId: `block:${z.identity.nodeId}:${d.registrationId.split(':')[2]}` });
        await refused(a.read(z.endpoint(), [{ local: local.reg, remote: forged, ...request }]), local.buf, 4096, `${what} of ${y.identity.nodeId} presented to ${z.identity.nodeId}`);
      }
    });

    it('a descriptor of an earlier incarnation is refused: as it is (before anything is sent) and re-stamped with the current one (by the peer)', async () => {
      const a = ctx.a();
      const y = await ctx.engine('fi');
      const old = await ctx.registered(y, 4096, 95);
      const d = decodeDescriptor(old.reg.descriptor);
      const y2 = await ctx.restart(y);
      await ctx.registered(y2, 4096, 96); // the same place in the new incarnation
      const local = await ctx.registered(a, 4096);
      await expectCode(a.read(y2.endpoint(), [{ local: local.reg, remote: old.reg.descriptor }]), [ErrorCode.InvalidInput]);
      const restamped = encodeDescriptor({ ...d, owner: { nodeId: d.owner.nodeId, incarnation: y2.identity.incarnation } });
      await refused(a.read(y2.endpoint(), [{ local: local.reg, remote: restamped }]), local.buf, 4096, 'a re-stamped descriptor of the previous incarnation');
    });

    it('a descriptor that claims one byte (or one range) more reaches nothing past the end: reads and writes, registrations and grants', async () => {
      const a = ctx.a();
      const b = ctx.b();
      const remote = await ctx.registered(b, 4096, 97);
      const local = await ctx.registered(a, 8192);
      const src = await ctx.registered(a, 8192, 98);
      const d = decodeDescriptor(remote.reg.descriptor);
      const longer = encodeDescriptor({ ...d, byteLength: 4097 });
      const ep = b.endpoint();
      await refused(a.read(ep, [{ local: local.reg, remote: longer, remoteOffset: 4096, length: 1 }]), local.buf, 8192, 'read of the byte after a registration');
      await refused(a.read(ep, [{ local: local.reg, remote: longer, remoteOffset: 0, length: 4097 }]), local.buf, 8192, 'read of a registration and one byte more');
      await refused(a.write(ep, [{ local: src.reg, remote: longer, remoteOffset: 4096, length: 1 }]), remote.buf, 4096, 'write of the byte after a registration');
      await refused(a.write(ep, [{ local: src.reg, remote: longer, remoteOffset: 0, length: 4097 }]), remote.buf, 4096, 'write of a registration and one byte more');
      const t = b.transports[0];
      if (typeof t?.grant !== 'function') return;
      const region = await ctx.registered(b, 8192, 99);
      const g = await b.grant([{ registration: region.reg, offset: 2048, length: 1024 }]);
      const gd = decodeDescriptor(g.descriptor);
      const g1 = encodeDescriptor({ ...gd, byteLength: 1025, rangeLengths: Float64Array.of(1025) });
      await refused(a.read(ep, [{ local: local.reg, remote: g1, range: 0, remoteOffset: 1024, length: 1 }]), local.buf, 8192, 'read of the byte after a granted range');
      await refused(a.read(ep, [{ local: local.reg, remote: g1, range: 0, remoteOffset: 0, length: 1025 }]), local.buf, 8192, 'read of a granted range and one byte more');
      await refused(a.write(ep, [{ local: src.reg, remote: g1, range: 0, remoteOffset: 1024, length: 1 }]), region.buf, 8192, 'write of the byte after a granted range');
      const g2 = encodeDescriptor({ ...gd, byteLength: 2048, rangeLengths: Float64Array.of(1024, 1024) });
      await refused(a.read(ep, [{ local: local.reg, remote: g2, range: 1, length: 1 }]), local.buf, 8192, 'read of a range index one past the grant');
    });

    it('a grant descriptor with its range lengths shifted (same total) reaches only the granted ranges', async (tc) => {
      const a = ctx.a();
      const b = ctx.b();
      if (typeof b.transports[0]?.grant !== 'function') {
        tc.skip(`${options.name} does not implement Transport.grant`);
        return;
      }
      const remote = await ctx.registered(b, 64 * 1024, 100);
      const local = await ctx.registered(a, 4096);
      const g = await b.grant([
        { registration: remote.reg, offset: 4096, length: 1024 },
        { registration: remote.reg, offset: 16384, length: 1024 },
      ]);
      const gd = decodeDescriptor(g.descriptor);
      const shifted = encodeDescriptor({ ...gd, rangeLengths: Float64Array.of(512, 1536) });
      await refused(a.read(b.endpoint(), [{ local: local.reg, remote: shifted, range: 1, remoteOffset: 1024, length: 512 }]), local.buf, 4096, 'range 1 read past its granted end');
      const other = encodeDescriptor({ ...gd, rangeLengths: Float64Array.of(1536, 512) });
      await refused(a.read(b.endpoint(), [{ local: local.reg, remote: other, range: 0, remoteOffset: 1024, length: 512 }]), local.buf, 4096, 'range 0 read past its granted end');
      await a.read(b.endpoint(), [{ local: local.reg, remote: shifted, range: 0, length: 512 }]);
      expect(equal(await local.buf.read(0, 512), await remote.buf.read(4096, 512))).toBe(true);
    });
  });

  describe('identity', () => {
    it('an endpoint that names one node and points at another is refused; the named node is then reached for real', async () => {
      const x = await ctx.engine('ix');
      const y = await ctx.engine('iy');
      const z = await ctx.engine('iz');
      const onY = await ctx.registered(y, 4096, 101);
      await ctx.registered(z, 4096, 102); // z has memory in the same place
      const local = await ctx.registered(x, 4096);
      const name = ctx.transportName();
      const liar = encodeEndpoint({ identity: y.identity, transports: new Map([[name, decodeEndpoint(z.endpoint()).transports.get(name) as Uint8Array]]) });
      const e = await outcome(settlesWithin(x.read(liar, [{ local: local.reg, remote: onY.reg.descriptor }], { timeoutMs: 10_000 }), 10_000 + ctx.guardMs, 'a read through a lying endpoint'));
      expect(e, `${z.identity.nodeId} answered for ${y.identity.nodeId}`).toBeInstanceOf(TensorwireError);
      expect(allZero(await local.buf.read(0, 4096))).toBe(true);
      // Nothing of that attempt may stay in the way of the real node.
      await x.read(y.endpoint(), [{ local: local.reg, remote: onY.reg.descriptor }]);
      expect(equal(await local.buf.read(0, 4096), await onY.buf.read(0, 4096))).toBe(true);
    });
  });

  describe('revocation racing transfers in flight', () => {
    const size = 8 * 1024 * 1024;
    const acceptable = [ErrorCode.RemoteRejected, ...BROKEN];

    async function pair(): Promise<{ x: TransferEngine; y: TransferEngine }> {
      const x = await ctx.engine('rx');
      const y = await ctx.engine('ry');
      const warmL = await ctx.registered(x, 64);
      const warmR = await ctx.registered(y, 64, 1);
      await x.read(y.endpoint(), [{ local: warmL.reg, remote: warmR.reg.descriptor }]);
      return { x, y };
    }

    const started = (buf: ConformanceBuffer, at = 0) => async (): Promise<boolean> => !allZero(await buf.read(at, 64));

    it('the holder revokes while READs of the memory are in flight: once revoke() resolved, changes to the memory never reach a reader', async () => {
      const { x, y } = await pair();
      const remote = await ctx.registered(y, size, 110);
      const old = await remote.buf.read(0, size);
      const dsts = await Promise.all([0, 1, 2].map(() => ctx.registered(x, size)));
      const reads = dsts.map((d) => outcome(x.read(y.endpoint(), [{ local: d.reg, remote: remote.reg.descriptor }])));
      await until(started((dsts[0] as { buf: ConformanceBuffer }).buf), ctx.guardMs, 'first bytes of the reads');
      await remote.reg.revoke();
      await remote.buf.write(pattern(size, 111)); // the holder reuses its memory
      const outcomes = await settlesWithin(Promise.all(reads), ctx.guardMs, 'reads racing a revoke');
      await settle();
      for (const [i, o] of outcomes.entries()) {
        const got = await (dsts[i] as { buf: ConformanceBuffer }).buf.read(0, size);
        expect(foreignByte(got, old), `read ${i} received bytes written after revoke() resolved`).toBe(-1);
        if (o === 'ok') expect(equal(got, old)).toBe(true);
        else expect(acceptable).toContain((o as TensorwireError).code);
      }
    });

    it('the holder revokes while WRITEs into the memory are in flight: once revoke() resolved, the memory does not change', async () => {
      const { x, y } = await pair();
      const remote = await ctx.registered(y, 3 * size);
      const srcs = await Promise.all([0, 1, 2].map((i) => ctx.registered(x, size, 112 + i)));
      const writes = srcs.map((s, i) => outcome(x.write(y.endpoint(), [{ local: s.reg, remote: remote.reg.descriptor, remoteOffset: i * size, length: size }])));
      await until(started(remote.buf), ctx.guardMs, 'first bytes of the writes');
      await remote.reg.revoke();
      const snapshot = await remote.buf.read(0, 3 * size);
      const outcomes = await settlesWithin(Promise.all(writes), ctx.guardMs, 'writes racing a revoke');
      await settle();
      expect(equal(await remote.buf.read(0, 3 * size), snapshot), 'the memory changed after revoke() resolved').toBe(true);
      for (const [i, o] of outcomes.entries()) {
        if (o === 'ok') expect(equal(snapshot.subarray(i * size, (i + 1) * size), await (srcs[i] as { buf: ConformanceBuffer }).buf.read(0, size))).toBe(true);
        else expect(acceptable).toContain((o as TensorwireError).code);
      }
    });

    it('the reader revokes its own destination while a READ into it is in flight: once revoke() resolved, no byte lands there', async () => {
      const { x, y } = await pair();
      const remote = await ctx.registered(y, size, 115);
      const local = await ctx.registered(x, size);
      const read = outcome(x.read(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]));
      await until(started(local.buf), ctx.guardMs, 'first bytes of the read');
      await local.reg.revoke();
      const snapshot = await local.buf.read(0, size);
      const o = await settlesWithin(read, ctx.guardMs, 'a read racing the revocation of its destination');
      await settle();
      expect(equal(await local.buf.read(0, size), snapshot), 'bytes landed after revoke() resolved').toBe(true);
      if (o === 'ok') expect(equal(snapshot, await remote.buf.read(0, size))).toBe(true);
      else expect(o).toBeInstanceOf(TensorwireError);
    });

    it('the writer revokes its own source while a WRITE from it is in flight: once revoke() resolved, changes to it never reach the peer', async () => {
      const { x, y } = await pair();
      const local = await ctx.registered(x, size, 116);
      const old = await local.buf.read(0, size);
      const remote = await ctx.registered(y, size);
      const write = outcome(x.write(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]));
      await until(started(remote.buf), ctx.guardMs, 'first bytes of the write');
      await local.reg.revoke();
      await local.buf.write(pattern(size, 117)); // the writer reuses its memory
      const o = await settlesWithin(write, ctx.guardMs, 'a write racing the revocation of its source');
      await settle();
      const got = await remote.buf.read(0, size);
      expect(foreignByte(got, old), 'bytes written into the source after revoke() resolved reached the peer').toBe(-1);
      if (o === 'ok') expect(equal(got, old)).toBe(true);
      else expect(o).toBeInstanceOf(TensorwireError);
    });
  });
}
