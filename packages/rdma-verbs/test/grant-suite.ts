/**
 * The range-grant suite ("register once, grant per lease"), written once and run on simulated
 * verbs by grants.test.ts (both grant modes) and on a real device by hardware.test.ts (where one
 * exists). Each run says which it is; only the hardware run is evidence about a NIC.
 */
import {
  GRANT_STRIDE,
  InvalidInputError,
  RemoteRejectedError,
  TransferEngine,
  createTransferBatch,
  decodeDescriptor,
  silentLogger,
  type GrantRanges,
} from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import type { RdmaConnection, RdmaTransport, RdmaTransportOptions } from '../src/transport.js';
import { RANGE_DESCRIPTOR_PAYLOAD_BYTES, decodeGrant, encodeGrant } from '../src/wire.js';
import { failure, opts, testNodes } from './window-suite.js';

export interface GrantSuiteOptions {
  readonly name: string;
  /** When set, the suite is skipped (the caller prints why). */
  readonly skip?: string;
  readonly grants: 'memory-window' | 'memory-region';
  /** A new, unstarted transport with these options added. */
  readonly transport: (options: Partial<RdmaTransportOptions>) => RdmaTransport;
  /** Work requests posted and memory windows allocated so far (simulated fabric or nativeCounters()). */
  readonly counters: () => { readonly postedWrs: number; readonly mws: number; readonly mrs: number };
}

export const pattern = (n: number, seed: number): Uint8Array => new Uint8Array(n).map((_, i) => (i * 131 + seed * 17 + (i >> 8)) & 0xff);

/** Runs of granted blocks that touch (one window each in memory-window mode). */
export function runsOf(slots: readonly number[]): number {
  const s = [...slots].sort((a, b) => a - b);
  return s.filter((x, i) => i === 0 || s[i - 1] !== x - 1).length;
}

/** A GrantRanges over blocks of `size` bytes at `slots` of one registration. */
export function blocks(handle: object, slots: readonly number[], size: number): GrantRanges {
  const ranges = new Float64Array(slots.length * GRANT_STRIDE);
  slots.forEach((slot, k) => ranges.set([0, slot * size, size], k * GRANT_STRIDE));
  return { handles: [handle], count: slots.length, ranges, bytes: slots.length * size };
}

let engineN = 0;

export function describeRangeGrants(o: GrantSuiteOptions): void {
  describe.skipIf(o.skip !== undefined)(o.name, () => {
    const make = (extra: Partial<RdmaTransportOptions>): RdmaTransport => o.transport({ grants: o.grants, listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', ...extra });
    const { pair } = testNodes(`rdma-rg-${o.grants === 'memory-window' ? 'mw' : 'mr'}`, make);

    async function engines(extra: Partial<RdmaTransportOptions> = {}) {
      engineN++;
      const ta = make(extra);
      const tb = make(extra);
      const a = new TransferEngine({ nodeId: `rg-requester-${engineN}`, transports: [ta], logger: silentLogger, streamsPerPeer: 2 });
      const b = new TransferEngine({ nodeId: `rg-holder-${engineN}`, transports: [tb], logger: silentLogger, streamsPerPeer: 2 });
      await a.start();
      await b.start();
      return { a, b, ta, tb, close: () => Promise.all([a.close(), b.close()]) };
    }

    it('a grant over 1,000 blocks of one registration: one small descriptor, and range k reads block k', async () => {
      const { a, b, ta, tb, close } = await engines();
      try {
        expect(tb.grantMode).toBe(o.grants);
        const size = 4096;
        const region = pattern(2000 * size, 1);
        const reg = await b.register({ kind: 'host', buffer: region });
        const picked = Array.from({ length: 1000 }, (_, k) => (k * 7) % 2000);
        const g = await b.grant(picked.map((slot) => ({ registration: reg, offset: slot * size, length: size })));
        const d = decodeDescriptor(g.descriptor);
        expect(d.rangeLengths?.length).toBe(1000);
        expect(d.transports.get('rdma')?.length).toBe(RANGE_DESCRIPTOR_PAYLOAD_BYTES);
        expect(g.descriptor.length).toBeLessThan(160);
        const dst = new Uint8Array(1000 * size);
        const ra = await a.register({ kind: 'host', buffer: dst });
        const binds = ta.grantBindsSent;
        const mws = o.counters().mws;
        await a.read(b.endpoint(), picked.map((_, k) => ({ local: ra, localOffset: k * size, remote: g.descriptor, range: k, length: size })));
        for (const [k, slot] of picked.entries()) expect(Buffer.compare(dst.subarray(k * size, (k + 1) * size), region.subarray(slot * size, (slot + 1) * size))).toBe(0);
        expect(ta.grantBindsSent - binds).toBe(1);
        // Windows: one per run of touching blocks and queue pair; none in memory-region mode.
        expect(o.counters().mws - mws).toBe(o.grants === 'memory-window' ? runsOf(picked) * 2 : 0);
        // A second read through the same grant asks nothing more; an offset inside a range works.
        await a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 999, remoteOffset: 100, length: 50 }]);
        const last = (picked[999] as number) * size;
        expect(Buffer.compare(dst.subarray(0, 50), region.subarray(last + 100, last + 150))).toBe(0);
        // Writes land in the granted range only.
        const src = await a.register({ kind: 'host', buffer: new Uint8Array(64).fill(0xa5) });
        const before = region.slice();
        await a.write(b.endpoint(), [{ local: src, remote: g.descriptor, range: 3, remoteOffset: size - 64, length: 64 }]);
        const at = (picked[3] as number) * size + size - 64;
        before.fill(0xa5, at, at + 64);
        expect(Buffer.compare(region, before)).toBe(0);
        expect(ta.grantBindsSent - binds).toBe(1);
      } finally {
        await close();
      }
    });

    it('an offset past range k is refused before anything is posted: by the engine, and by the transport itself', async () => {
      const { a, b, close } = await engines();
      try {
        const reg = await b.register({ kind: 'host', buffer: pattern(64 * 1024, 2) });
        const g = await b.grant([0, 2, 4].map((slot) => ({ registration: reg, offset: slot * 4096, length: 4096 })));
        const ra = await a.register({ kind: 'host', buffer: new Uint8Array(8192) });
        await a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 1, length: 4096 }]); // the table is here
        const posted = o.counters().postedWrs;
        const err = await failure(a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 1, remoteOffset: 4000, length: 97 }]));
        expect(err).toBeInstanceOf(InvalidInputError);
        expect((err as InvalidInputError).details['request']).toBe(0);
        expect(await failure(a.read(b.endpoint(), [{ local: ra, remote: g.descriptor, range: 3, length: 1 }]))).toBeInstanceOf(InvalidInputError);
        expect(o.counters().postedWrs).toBe(posted);
      } finally {
        await close();
      }
      // The transport's own check, without the engine in front of it.
      const { a: x, b: y, conn } = await pair(2);
      const rr = await y.t.register({ kind: 'host', buffer: pattern(64 * 1024, 3) });
      const gr = y.t.grant(blocks(rr.handle, [0, 2, 4], 4096));
      const lr = await x.t.register({ kind: 'host', buffer: new Uint8Array(8192) });
      const remote = x.t.decodeRemote(gr.payload, 'host', 3 * 4096, Float64Array.of(4096, 4096, 4096));
      await conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteRange: 2, remoteOffset: 0, length: 4096 }]), opts());
      const posted = o.counters().postedWrs;
      const bad = [
        { local: lr.handle, localOffset: 0, remote, remoteRange: 0, remoteOffset: 0, length: 4096 },
        { local: lr.handle, localOffset: 4096, remote, remoteRange: 1, remoteOffset: 4000, length: 97 },
      ];
      const e1 = await failure(conn.execute(0, createTransferBatch('read', bad), opts()));
      expect(e1).toBeInstanceOf(InvalidInputError);
      expect((e1 as InvalidInputError).details).toMatchObject({ request: 1, field: 'remoteOffset' });
      expect((e1 as InvalidInputError).message).toMatch(/outside granted range 1 of 4096 bytes/);
      const e2 = await failure(conn.execute(1, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteRange: 3, remoteOffset: 0, length: 1 }]), opts()));
      expect((e2 as InvalidInputError).details).toMatchObject({ request: 0, field: 'range' });
      expect(o.counters().postedWrs).toBe(posted);
      expect(conn.isOpen).toBe(true);
    });

    it('a descriptor forged to claim longer ranges is refused before posting: the requester checks the lengths the holder granted', async () => {
      const { a, b, conn } = await pair(1);
      const size = 4096;
      const src = pattern(16 * size, 4);
      const rr = await b.t.register({ kind: 'host', buffer: src });
      const gr = b.t.grant(blocks(rr.handle, [1, 5, 6], size));
      const dst = new Uint8Array(2 * size).fill(0xee);
      const lr = await a.t.register({ kind: 'host', buffer: dst });
      // Range 0 claimed two blocks long: the descriptor's own check passes, the holder's table does not.
      const forged = a.t.decodeRemote(gr.payload, 'host', 3 * size, Float64Array.of(2 * size, 0.5 * size, 0.5 * size));
      const posted = o.counters().postedWrs;
      const err = await failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: forged, remoteRange: 0, remoteOffset: size, length: size }]), opts()));
      expect(err).toBeInstanceOf(InvalidInputError);
      expect((err as InvalidInputError).message).toMatch(/as the holder granted it/);
      expect(o.counters().postedWrs - posted).toBe(o.grants === 'memory-window' ? 2 : 0); // the window binds only
      expect(dst.every((x) => x === 0xee)).toBe(true);
      expect(conn.isOpen).toBe(true);
      // Ranges 1 and 2 (blocks 5 and 6) touch: one work request, in both modes.
      const honest = a.t.decodeRemote(gr.payload, 'host', 3 * size, Float64Array.of(size, size, size));
      const before = o.counters().postedWrs;
      await conn.execute(
        0,
        createTransferBatch('read', [
          { local: lr.handle, localOffset: 0, remote: honest, remoteRange: 1, remoteOffset: 0, length: size },
          { local: lr.handle, localOffset: size, remote: honest, remoteRange: 2, remoteOffset: 0, length: size },
        ]),
        opts(),
      );
      expect(Buffer.compare(dst, src.subarray(5 * size, 7 * size))).toBe(0);
      expect(o.counters().postedWrs - before).toBe(1);
    });

    it(
      o.grants === 'memory-window'
        ? 'a post forged below the transport (a window rkey, an address past its run) is refused by the NIC: windows cover exactly the ranges'
        : 'memory-region mode trusts the requester: a post forged below the transport with the MR rkey reads past the ranges (documented)',
      async () => {
        const { a, b, conn } = await pair(1);
        const size = 4096;
        const src = pattern(16 * size, 5);
        const rr = await b.t.register({ kind: 'host', buffer: src });
        // Blocks 5 and 6 (one run) and 9; block 7 is not granted.
        const gr = b.t.grant(blocks(rr.handle, [5, 6, 9], size));
        const dst = new Uint8Array(size).fill(0xee);
        const lr = await a.t.register({ kind: 'host', buffer: dst });
        const honest = a.t.decodeRemote(gr.payload, 'host', 3 * size, Float64Array.of(size, size, size));
        await conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: honest, remoteRange: 0, remoteOffset: 0, length: size }]), opts());
        // The key of the run 5..6 on this connection, as the holder handed it out.
        const g = decodeGrant(gr.payload);
        if (g.grant !== 'ranges') throw new Error('expected a range grant');
        const served = b.inbound[0] as RdmaConnection;
        const binding = b.t.grantLedger?.request(served, Buffer.from(g.token).toString('hex'));
        if (binding?.kind !== 'existing' || binding.binding.rkeys === undefined) throw new Error('expected the binding made for this connection');
        const rkey = binding.binding.rkeys[0] as number;
        const whole = decodeGrant(rr.payload);
        if (whole.grant === 'ranges') throw new Error('expected a registration payload');
        // A whole-MR descriptor made up from that key, one block past the run: no transport check stands in the way.
        const forged = a.t.decodeRemote(encodeGrant({ grant: 'mr', addr: whole.addr + BigInt(7 * size), length: size, rkey }), 'host', size);
        const err = await failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: forged, remoteOffset: 0, length: size }]), opts()));
        if (o.grants === 'memory-window') {
          expect(err).toBeInstanceOf(RemoteRejectedError);
          expect((err as RemoteRejectedError).remoteCode).toBe('remote-access');
          expect(Buffer.compare(dst, src.subarray(5 * size, 6 * size))).toBe(0); // nothing of block 7 arrived
          expect(conn.isOpen).toBe(false); // an access violation breaks an RC connection
        } else {
          expect(err).toBeUndefined();
          expect(Buffer.compare(dst, src.subarray(7 * size, 8 * size))).toBe(0);
        }
      },
    );

    it('10 ranges and 10,000 ranges cost one GRANT_BIND each and the same descriptor payload', async () => {
      const { a, b, ta, close } = await engines();
      try {
        const piece = 64;
        const region = pattern(20_000 * piece, 5);
        const reg = await b.register({ kind: 'host', buffer: region });
        const dst = new Uint8Array(10_000 * piece);
        const ra = await a.register({ kind: 'host', buffer: dst });
        const sizes: number[] = [];
        for (const n of [10, 10_000]) {
          // Every other block: no two touch, so memory-window mode binds one window per range.
          const slots = Array.from({ length: n }, (_, k) => 2 * k);
          const g = await b.grant({ registrations: [reg], ranges: blocks({}, slots, piece).ranges });
          sizes.push(decodeDescriptor(g.descriptor).transports.get('rdma')?.length ?? -1);
          const binds = ta.grantBindsSent;
          dst.fill(0);
          await a.read(b.endpoint(), slots.map((_, k) => ({ local: ra, localOffset: k * piece, remote: g.descriptor, range: k, length: piece })));
          expect(ta.grantBindsSent - binds).toBe(1);
          for (let k = 0; k < n; k++) expect(Buffer.compare(dst.subarray(k * piece, (k + 1) * piece), region.subarray(2 * k * piece, (2 * k + 1) * piece))).toBe(0);
          await g.revoke();
        }
        expect(sizes).toEqual([RANGE_DESCRIPTOR_PAYLOAD_BYTES, RANGE_DESCRIPTOR_PAYLOAD_BYTES]);
      } finally {
        await close();
      }
    });

    it('revoke: exactly once, registrations outlive their grants, access through the grant ends', async () => {
      const { a, b, conn } = await pair(2);
      const base = { ...o.counters() };
      const size = 4096;
      const region = pattern(16 * size, 6);
      const rr = await b.t.register({ kind: 'host', buffer: region });
      const dst = new Uint8Array(16 * size);
      const lr = await a.t.register({ kind: 'host', buffer: dst });
      const gr = b.t.grant(blocks(rr.handle, [3, 9], size));
      const remote = a.t.decodeRemote(gr.payload, 'host', 2 * size, Float64Array.of(size, size));
      const read = createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote, remoteRange: 1, remoteOffset: 0, length: size }]);
      await conn.execute(0, read, opts());
      const served = b.inbound[0] as RdmaConnection;
      expect(b.t.liveGrants).toBe(1);
      const first = b.t.revokeGrant(gr.handle);
      expect(b.t.revokeGrant(gr.handle)).toBe(first); // once, whatever the number of callers
      expect(served.grantUnbindsPending).toBe(1); // one GRANT_UNBIND, to the one connection that bound it
      await first;
      expect(served.grantUnbindsPending).toBe(0);
      expect(b.t.liveGrants).toBe(0);
      expect(o.counters().mws).toBe(base.mws); // its windows are gone
      expect(o.counters().mrs).toBe(base.mrs + 2); // the registrations are not
      const err = await failure(conn.execute(0, read, opts()));
      expect(err).toBeInstanceOf(RemoteRejectedError);
      expect(conn.isOpen).toBe(true);
      // The registration is still readable as a whole, and grantable again.
      await conn.execute(1, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: a.t.decodeRemote(rr.payload, 'host', region.length), remoteOffset: 0, length: region.length }]), opts());
      expect(Buffer.compare(dst, region)).toBe(0);
      const again = b.t.grant(blocks(rr.handle, [9], size));
      dst.fill(0);
      const remote2 = a.t.decodeRemote(again.payload, 'host', size, Float64Array.of(size));
      await conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: remote2, remoteOffset: 0, length: size }]), opts());
      expect(Buffer.compare(dst.subarray(0, size), region.subarray(9 * size, 10 * size))).toBe(0);
      // Revoking the registration revokes its grants first.
      await b.t.revoke(rr.handle);
      expect(b.t.liveGrants).toBe(0);
      expect(await failure(b.t.revokeGrant({}))).toBeInstanceOf(InvalidInputError);
      expect(await failure(conn.execute(0, createTransferBatch('read', [{ local: lr.handle, localOffset: 0, remote: remote2, remoteOffset: 0, length: size }]), opts()))).toBeInstanceOf(RemoteRejectedError);
      // Through the engine: Grant.revoke is idempotent and the transport is asked once.
      const { a: ea, b: eb, tb, close } = await engines();
      try {
        const reg = await eb.register({ kind: 'host', buffer: region });
        const g = await eb.grant([{ registration: reg, offset: 0, length: size }]);
        const ra = await ea.register({ kind: 'host', buffer: dst });
        await ea.read(eb.endpoint(), [{ local: ra, remote: g.descriptor, range: 0, length: size }]);
        await Promise.all([g.revoke(), g.revoke(), reg.revoke()]);
        expect(tb.liveGrants).toBe(0);
        expect(await failure(ea.read(eb.endpoint(), [{ local: ra, remote: g.descriptor, range: 0, length: size }]))).toBeInstanceOf(RemoteRejectedError);
      } finally {
        await close();
      }
    });
  });
}

