/// <reference types="node" preserve="true" />
/**
 * `@tensorwire/core/testing`: the conformance suite every transport runs against itself.
 *
 * ```ts
 * import { describeTransportConformance } from '@tensorwire/core/testing';
 * describeTransportConformance({ name: 'tcp', createTransport: () => new TcpTransport() });
 * ```
 *
 * It registers vitest `describe`/`it` blocks. Most run two or more TransferEngine instances
 * (nodes) in this process over fresh instances of the transport and check: correctness across
 * sizes (1 byte, unaligned, 4 KiB, 4 MiB, larger than the chunk cap), batches (10,000 tiny
 * ranges, merged adjacent ranges, ranges across chunk boundaries, a bad or revoked entry in the
 * middle), prepared transfers (posted many times, after revoke, after connection loss and peer
 * restart), range grants (skipped, saying why, for a transport without `grant`), deadlines and
 * aborts (against a stalled peer too, see {@link ConformanceOptions.socketAddress}), bad input
 * and forged descriptors (one payload byte changed, re-owned to another node, re-stamped with a
 * later incarnation, lengths one byte or one range too long), an endpoint that names one node
 * and points at another, revocation racing transfers in flight (local and remote, reads and
 * writes), peer death, connection reuse, simultaneous open with transfers in flight, and that
 * connect/invalidate cycles leak no handle or timer, unref'd ones included.
 *
 * The "transport contract" cases drive the transport directly, as the engine does, for what the
 * engine cannot show: the handshake's identity checks, retire() and close() with work in flight
 * on both sides, an execute() whose signal already fired, ResourceExhaustedError, local bounds,
 * and connect() to a peer that is gone.
 *
 * Nothing assumes a chunk size, stream count or host layout: the suite reads them from the
 * transport's capabilities and connections. Requires vitest (a peer dependency).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TransferEngine, type Registration, type TransferEngineOptions } from '../engine.js';
import { ErrorCode, TensorwireError } from '../errors.js';
import { silentLogger } from '../logger.js';
import { decodeDescriptor, decodeEndpoint, encodeDescriptor, encodeEndpoint } from '../descriptor.js';
import type { Memory, MemoryKind, Transport, TransportCapabilities } from '../transport.js';
import { describeAdversarial } from './adversarial.js';
import { describeContract } from './contract.js';
import { pattern } from './pattern.js';
import { createStreamRelay, type SocketAddress, type StreamRelay } from './relay.js';
import { ResourceTracker, activeResources, grownTypes } from './resources.js';
import { equal, expectCode, settle } from './util.js';

export { pattern };
export { createStreamRelay, type SocketAddress, type StreamRelay } from './relay.js';
export { ResourceTracker } from './resources.js';

/** A block of memory of the kind under test, with host-side access for checking. */
export interface ConformanceBuffer {
  readonly memory: Memory;
  write(data: Uint8Array, offset?: number): Promise<void>;
  read(offset: number, length: number): Promise<Uint8Array>;
  /**
   * Optional: whether the guard bytes around the buffer are intact (memory that surrounds each
   * buffer with guards, as {@link hostMemory} does). The suite checks it after forged writes.
   */
  guardsIntact?(): Promise<boolean>;
  free(): Promise<void>;
}

export interface ConformanceMemory {
  readonly kind: MemoryKind;
  allocate(byteLength: number): Promise<ConformanceBuffer>;
}

export interface ConformanceOptions {
  /** Shown in the describe block. */
  name: string;
  /** A fresh transport instance for one node. Called once per node. */
  createTransport: () => Transport | Promise<Transport>;
  /** Memory of the kind under test. Default: host memory (Uint8Array views with guard bytes around them). */
  memory?: ConformanceMemory;
  /** When set, the suite is skipped and this reason is printed. */
  skip?: string;
  /** Connect/invalidate cycles for the leak test. Default 1000. */
  churnCycles?: number;
  /**
   * Extra engine options (e.g. hostId for same-host transports). Without a hostId, the suite's
   * engines share this machine's host id when the transport works on one host
   * (`capabilities.local`), and each get their own when it works only between hosts.
   */
  engineOptions?: Partial<Omit<TransferEngineOptions, 'nodeId' | 'transports'>>;
  /**
   * For transports over stream sockets (TCP, Unix domain sockets): how an endpoint blob maps to
   * the socket address it names, and back. With it the suite puts a relay it controls
   * ({@link createStreamRelay}) in front of a peer to test a stalled peer (it accepts the
   * connection and never answers), deadlines and aborts against it, late replies arriving after
   * the call settled, and connections cut mid-transfer. Without it those cases are skipped, and
   * the reason is printed.
   */
  socketAddress?: {
    decode(endpoint: Uint8Array): SocketAddress;
    /** An endpoint like `original` (same options) that names `address` instead. */
    encode(address: SocketAddress, original: Uint8Array): Uint8Array;
  };
  /**
   * Liveness bound (ms) for calls the suite requires to settle: a call still pending this long
   * after every deadline involved has passed fails the case. Not a measurement. Default 20,000.
   */
  settleGuardMs?: number;
}

/** Bytes of guard before and after every buffer of {@link hostMemory}. */
export const GUARD_BYTES = 4096;
const GUARD_FILL = 0xa5;

/**
 * Host memory: Uint8Array views into a larger ArrayBuffer with {@link GUARD_BYTES} of guard on
 * each side (filled with 0xa5), so an out-of-bounds access by a transport reads or writes real
 * neighbouring memory (as it would in native code) and the suite can see it.
 */
export const hostMemory: ConformanceMemory = {
  kind: 'host',
  async allocate(byteLength) {
    const backing = new Uint8Array(byteLength + 2 * GUARD_BYTES).fill(GUARD_FILL);
    const buffer = backing.subarray(GUARD_BYTES, GUARD_BYTES + byteLength);
    buffer.fill(0);
    return {
      memory: { kind: 'host', buffer },
      async write(data, offset = 0) {
        buffer.set(data, offset);
      },
      async read(offset, length) {
        return buffer.slice(offset, offset + length);
      },
      async guardsIntact() {
        for (let i = 0; i < GUARD_BYTES; i++) if (backing[i] !== GUARD_FILL || backing[GUARD_BYTES + byteLength + i] !== GUARD_FILL) return false;
        return true;
      },
      async free() {},
    };
  },
};

const CHUNK = 256 * 1024;
let nodeCounter = 0;

/** What the suite's case files share: the options, the two main nodes, and helpers. */
export interface SuiteContext {
  readonly options: ConformanceOptions;
  readonly mem: ConformanceMemory;
  /** See {@link ConformanceOptions.settleGuardMs}. */
  readonly guardMs: number;
  /** The engine chunk size the suite asks for (the transport and connection may lower it). */
  readonly chunkBytes: number;
  a(): TransferEngine;
  b(): TransferEngine;
  /** The transport's name and capabilities (of node a's instance). */
  transportName(): string;
  caps(): TransportCapabilities;
  /** The chunk cap transfers between a and b can have at most. */
  cap(): number;
  /** A fresh started node (closed after the suite). */
  engine(prefix: string, extra?: Partial<TransferEngineOptions>): Promise<TransferEngine>;
  /** Close `e` and start a node with the same id (a new incarnation). */
  restart(e: TransferEngine): Promise<TransferEngine>;
  buffer(length: number): Promise<ConformanceBuffer>;
  registered(e: TransferEngine, length: number, seed?: number): Promise<{ buf: ConformanceBuffer; reg: Registration }>;
  /** A relay in front of `e`'s endpoint, and `e`'s endpoint through it; undefined without {@link ConformanceOptions.socketAddress}. */
  relay(e: TransferEngine): Promise<{ relay: StreamRelay; endpoint: Uint8Array } | undefined>;
  /** This node's host id for a new engine (see {@link ConformanceOptions.engineOptions}). */
  hostIdFor(t: Transport): string | undefined;
}

export function describeTransportConformance(options: ConformanceOptions): void {
  const mem = options.memory ?? hostMemory;
  const title = `transport conformance: ${options.name} (${mem.kind} memory)`;
  // Print why, so a skipped hardware suite is never silent.
  if (options.skip) process.stderr.write(`[tensorwire] skipping "${title}": ${options.skip}\n`);

  describe.skipIf(options.skip !== undefined)(options.skip ? `${title} — skipped: ${options.skip}` : title, () => {
    const engines: TransferEngine[] = [];
    const buffers: ConformanceBuffer[] = [];
    const relays: StreamRelay[] = [];
    let a: TransferEngine;
    let b: TransferEngine;

    function hostIdFor(t: Transport): string | undefined {
      if (options.engineOptions?.hostId !== undefined) return options.engineOptions.hostId;
      return t.capabilities.local ? undefined : `host${nodeCounter}`;
    }

    async function start(nodeId: string, extra: Partial<TransferEngineOptions>): Promise<TransferEngine> {
      const t = await options.createTransport();
      const hostId = hostIdFor(t);
      const e = new TransferEngine({
        nodeId,
        transports: [t],
        chunkBytes: CHUNK,
        logger: silentLogger,
        ...options.engineOptions,
        ...(hostId === undefined ? {} : { hostId }),
        ...extra,
      });
      await e.start();
      engines.push(e);
      return e;
    }

    async function engine(prefix: string, extra: Partial<TransferEngineOptions> = {}): Promise<TransferEngine> {
      return start(`${prefix}${++nodeCounter}`, extra);
    }

    async function buffer(length: number): Promise<ConformanceBuffer> {
      const buf = await mem.allocate(length);
      buffers.push(buf);
      return buf;
    }

    async function registered(e: TransferEngine, length: number, seed?: number): Promise<{ buf: ConformanceBuffer; reg: Registration }> {
      const buf = await buffer(length);
      if (seed !== undefined) await buf.write(pattern(length, seed));
      const reg = await e.register(buf.memory, { transports: [e.transports[0]?.name as string] });
      return { buf, reg };
    }

    const ctx: SuiteContext = {
      options,
      mem,
      guardMs: options.settleGuardMs ?? 20_000,
      chunkBytes: CHUNK,
      a: () => a,
      b: () => b,
      transportName: () => a.transports[0]?.name as string,
      caps: () => (a.transports[0] as Transport).capabilities,
      cap: () => Math.min(CHUNK, (a.transports[0] as Transport).capabilities.maxChunkBytes),
      engine,
      async restart(e) {
        const nodeId = e.identity.nodeId;
        const hostId = e.identity.hostId;
        await e.close();
        return start(nodeId, { hostId });
      },
      buffer,
      registered,
      async relay(e) {
        const sa = options.socketAddress;
        if (!sa) return undefined;
        const ep = decodeEndpoint(e.endpoint());
        const name = e.transports[0]?.name as string;
        const blob = ep.transports.get(name) as Uint8Array;
        const relay = await createStreamRelay(sa.decode(blob));
        relays.push(relay);
        return { relay, endpoint: encodeEndpoint({ identity: ep.identity, transports: new Map([[name, sa.encode(relay.address, blob)]]) }) };
      },
      hostIdFor,
    };

    beforeAll(async () => {
      a = await engine('a');
      b = await engine('b');
    });

    afterAll(async () => {
      await Promise.allSettled(relays.map((r) => r.close()));
      await Promise.allSettled(engines.map((e) => e.close()));
      await Promise.allSettled(buffers.map((x) => x.free()));
    });

    describe('correctness across sizes', () => {
      const cases: [string, number, number, number][] = [
        ['1 byte', 1, 0, 0],
        ['unaligned 1021 bytes at odd offsets', 1021, 3, 7],
        ['4 KiB', 4096, 0, 0],
        ['4 MiB', 4 * 1024 * 1024, 0, 0],
        ['larger than the chunk cap, unaligned', 3 * CHUNK + 13, 5, 1],
      ];
      for (const [label, length, localOffset, remoteOffset] of cases) {
        it(`READ ${label}`, async () => {
          const remote = await registered(b, length + remoteOffset + 16, length);
          const local = await registered(a, length + localOffset + 16);
          const report = await a.read(b.endpoint(), [{ local: local.reg, localOffset, remote: remote.reg.descriptor, remoteOffset, length }]);
          expect(report.bytes).toBe(length);
          const cap = ctx.cap();
          expect(report.chunks).toBeGreaterThanOrEqual(Math.ceil(length / cap));
          const expected = await remote.buf.read(remoteOffset, length);
          expect(equal(await local.buf.read(localOffset, length), expected)).toBe(true);
          // Nothing outside the range was touched.
          expect((await local.buf.read(0, localOffset)).every((x) => x === 0)).toBe(true);
          expect((await local.buf.read(localOffset + length, 16)).every((x) => x === 0)).toBe(true);
        });
        it(`WRITE ${label}`, async () => {
          const remote = await registered(b, length + remoteOffset + 16);
          const local = await registered(a, length + localOffset + 16, length + 1);
          await a.write(b.endpoint(), [{ local: local.reg, localOffset, remote: remote.reg.descriptor, remoteOffset, length }]);
          expect(equal(await remote.buf.read(remoteOffset, length), await local.buf.read(localOffset, length))).toBe(true);
          expect((await remote.buf.read(0, remoteOffset)).every((x) => x === 0)).toBe(true);
          expect((await remote.buf.read(remoteOffset + length, 16)).every((x) => x === 0)).toBe(true);
        });
      }

      it('a batch of requests into different places of one registration', async () => {
        const remote = await registered(b, 64 * 1024, 42);
        const local = await registered(a, 64 * 1024);
        const requests = Array.from({ length: 16 }, (_, i) => ({ local: local.reg, localOffset: (15 - i) * 4096, remote: remote.reg.descriptor, remoteOffset: i * 4096, length: 4096 }));
        await a.read(b.endpoint(), requests);
        const src = await remote.buf.read(0, 64 * 1024);
        const dst = await local.buf.read(0, 64 * 1024);
        for (let i = 0; i < 16; i++) expect(equal(dst.subarray((15 - i) * 4096, (16 - i) * 4096), src.subarray(i * 4096, (i + 1) * 4096))).toBe(true);
      });

      it('many concurrent operations each land in their own range', async () => {
        const n = 200;
        const size = 3000;
        const remote = await registered(b, n * size, 7);
        const local = await registered(a, n * size);
        await Promise.all(
          Array.from({ length: n }, (_, i) => a.read(b.endpoint(), [{ local: local.reg, localOffset: i * size, remote: remote.reg.descriptor, remoteOffset: (n - 1 - i) * size, length: size }])),
        );
        const src = await remote.buf.read(0, n * size);
        const dst = await local.buf.read(0, n * size);
        for (let i = 0; i < n; i++) expect(equal(dst.subarray(i * size, (i + 1) * size), src.subarray((n - 1 - i) * size, (n - i) * size))).toBe(true);
      });
    });

    describe('batches', () => {
      /** Scattered ranges: request i reads `size` bytes at a permuted remote slot into slot i. */
      function scattered(n: number, size: number, remoteSlots: number): { localOffset: number; remoteOffset: number; length: number }[] {
        const out: { localOffset: number; remoteOffset: number; length: number }[] = [];
        for (let i = 0; i < n; i++) out.push({ localOffset: i * size, remoteOffset: ((i * 7919) % remoteSlots) * size, length: size });
        return out;
      }

      it('10,000 tiny scattered ranges in one READ land exactly, and one WRITE back lands exactly', async () => {
        const n = 10_000;
        const size = 16;
        const remote = await registered(b, n * 2 * size, 21);
        const local = await registered(a, n * size);
        const list = scattered(n, size, n * 2);
        const report = await a.read(b.endpoint(), list.map((r) => ({ local: local.reg, remote: remote.reg.descriptor, ...r })));
        expect(report.bytes).toBe(n * size);
        expect(report.requests).toBe(n);
        const src = await remote.buf.read(0, n * 2 * size);
        const dst = await local.buf.read(0, n * size);
        for (const r of list) expect(equal(dst.subarray(r.localOffset, r.localOffset + size), src.subarray(r.remoteOffset, r.remoteOffset + size))).toBe(true);
        // And back: every local range written to a distinct remote place of a fresh registration.
        const target = await registered(b, n * 2 * size);
        await a.write(b.endpoint(), list.map((r) => ({ local: local.reg, localOffset: r.localOffset, remote: target.reg.descriptor, remoteOffset: r.remoteOffset, length: size })));
        const back = await target.buf.read(0, n * 2 * size);
        for (const r of list) expect(equal(back.subarray(r.remoteOffset, r.remoteOffset + size), dst.subarray(r.localOffset, r.localOffset + size))).toBe(true);
      });

      it('adjacent ranges (contiguous on both sides) are merged and land exactly', async () => {
        const remote = await registered(b, 64 * 1024, 22);
        const local = await registered(a, 64 * 1024);
        const requests = Array.from({ length: 64 }, (_, i) => ({ local: local.reg, localOffset: i * 512, remote: remote.reg.descriptor, remoteOffset: 1000 + i * 512, length: 512 }));
        const report = await a.read(b.endpoint(), requests);
        expect(report.ranges).toBe(1);
        expect(equal(await local.buf.read(0, 64 * 512), await remote.buf.read(1000, 64 * 512))).toBe(true);
        expect((await local.buf.read(64 * 512, 16)).every((x) => x === 0)).toBe(true);
      });

      it('ranges that cross chunk boundaries, unaligned, in one batch', async () => {
        const cap = ctx.cap();
        const len = cap + 17;
        const remote = await registered(b, 4 * len + 64, 23);
        const local = await registered(a, 4 * len + 64);
        const requests = [3, 0, 2, 1].map((slot, i) => ({ local: local.reg, localOffset: 5 + i * len, remote: remote.reg.descriptor, remoteOffset: 11 + slot * len, length: len }));
        const report = await a.read(b.endpoint(), requests);
        expect(report.chunks).toBeGreaterThanOrEqual(8);
        for (const r of requests) expect(equal(await local.buf.read(r.localOffset, len), await remote.buf.read(r.remoteOffset, len))).toBe(true);
      });

      it('a bad entry in the middle of a big batch fails the whole batch, names the entry, and moves nothing', async () => {
        const n = 4096;
        const remote = await registered(b, n * 64, 24);
        const local = await registered(a, n * 64);
        const requests = scattered(n, 64, n).map((r) => ({ local: local.reg, remote: remote.reg.descriptor, ...r }));
        requests[2049] = { ...(requests[2049] as (typeof requests)[number]), remoteOffset: n * 64 - 10 };
        const err = await expectCode(a.read(b.endpoint(), requests), [ErrorCode.InvalidInput]);
        expect(err.details['request']).toBe(2049);
        expect((await local.buf.read(0, n * 64)).every((x) => x === 0)).toBe(true);
      });

      it('an entry naming a revoked grant fails the whole batch as RemoteRejected', async () => {
        const good = await registered(b, 64 * 1024, 25);
        const gone = await registered(b, 4096, 26);
        const local = await registered(a, 64 * 1024 + 4096);
        await gone.reg.revoke();
        const requests = Array.from({ length: 16 }, (_, i) => ({ local: local.reg, localOffset: i * 4096, remote: good.reg.descriptor, remoteOffset: i * 4096, length: 4096 }));
        requests.splice(8, 0, { local: local.reg, localOffset: 64 * 1024, remote: gone.reg.descriptor, remoteOffset: 0, length: 4096 });
        const err = await expectCode(a.read(b.endpoint(), requests), [ErrorCode.RemoteRejected]);
        if (err.details['request'] !== undefined) expect(err.details['request']).toBe(8);
        expect((await local.buf.read(64 * 1024, 4096)).every((x) => x === 0)).toBe(true);
      });
    });

    describe('prepared transfers', () => {
      it('posted many times, each post gives the same bytes as a fresh read of the current contents', async () => {
        const remote = await registered(b, 256 * 1024, 31);
        const local = await registered(a, 128 * 1024);
        const fresh = await registered(a, 128 * 1024);
        const list = Array.from({ length: 32 }, (_, i) => ({ localOffset: i * 4096, remoteOffset: ((i * 13) % 64) * 4096, length: 4096 }));
        const prepared = await a.prepare(b.endpoint(), list.map((r) => ({ local: local.reg, remote: remote.reg.descriptor, ...r })), { op: 'read' });
        expect(prepared.transport).toBe(a.transports[0]?.name);
        for (let round = 0; round < 3; round++) {
          await remote.buf.write(pattern(256 * 1024, 100 + round));
          const report = await prepared.run();
          expect(report.bytes).toBe(32 * 4096);
          await a.read(b.endpoint(), list.map((r) => ({ local: fresh.reg, remote: remote.reg.descriptor, ...r })));
          expect(equal(await local.buf.read(0, 128 * 1024), await fresh.buf.read(0, 128 * 1024))).toBe(true);
        }
        await prepared.close();
        await expectCode(prepared.run(), [ErrorCode.Closed]);
      });

      it('a post after the peer revoked the grant is RemoteRejected, never stale bytes', async () => {
        const remote = await registered(b, 8192, 32);
        const local = await registered(a, 8192);
        const prepared = await a.prepare(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }], { op: 'read' });
        await prepared.run();
        await local.buf.write(new Uint8Array(8192));
        await remote.reg.revoke();
        await expectCode(prepared.run(), [ErrorCode.RemoteRejected]);
        expect((await local.buf.read(0, 8192)).every((x) => x === 0)).toBe(true);
        await prepared.close();
      });

      it('a post after connection loss or a peer restart is a connection error on every later post', async () => {
        const x = await engine('p');
        const y = await engine('p');
        const remote = await registered(y, 4096, 33);
        const local = await registered(x, 4096);
        const lost = await x.prepare(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }], { op: 'read' });
        await lost.run();
        await x.invalidate(y.identity.nodeId);
        await expectCode(lost.run(), [ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]);
        await expectCode(lost.run(), [ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]);
        // The peer restarts (same node id, new incarnation); x talks to the new one.
        const before = await x.prepare(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }], { op: 'read' });
        await before.run();
        const y2 = await ctx.restart(y);
        const remote2 = await registered(y2, 4096, 34);
        await x.read(y2.endpoint(), [{ local: local.reg, remote: remote2.reg.descriptor }]);
        await local.buf.write(new Uint8Array(4096));
        await expectCode(before.run(), [ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]);
        expect((await local.buf.read(0, 4096)).every((x) => x === 0)).toBe(true);
        // The connection to the new incarnation is untouched and works.
        await x.read(y2.endpoint(), [{ local: local.reg, remote: remote2.reg.descriptor }]);
        expect(equal(await local.buf.read(0, 4096), await remote2.buf.read(0, 4096))).toBe(true);
      });
    });

    describe('range grants', () => {
      /** Transports may leave range grants out; then these cases are skipped, saying so. */
      function needGrants(ctx: { skip: (note?: string) => void }): void {
        const t = a.transports[0];
        if (typeof t?.grant !== 'function' || typeof t.revokeGrant !== 'function') {
          const why = `${options.name} does not implement Transport.grant/revokeGrant`;
          process.stderr.write(`[tensorwire] skipping range-grant case: ${why}\n`);
          ctx.skip(why);
        }
      }

      it('a grant over 1,000 scattered ranges: range k reads exactly its bytes', async (ctx) => {
        needGrants(ctx);
        const n = 1000;
        const size = 64;
        const remote = await registered(b, 4 * n * size, 41);
        const local = await registered(a, n * size);
        const slots = Array.from({ length: n }, (_, k) => (k * 2731) % (4 * n));
        const g = await b.grant(slots.map((slot) => ({ registration: remote.reg, offset: slot * size, length: size })));
        expect(g.rangeCount).toBe(n);
        await a.read(b.endpoint(), slots.map((_, k) => ({ local: local.reg, localOffset: k * size, remote: g.descriptor, range: k, length: size })));
        const src = await remote.buf.read(0, 4 * n * size);
        const dst = await local.buf.read(0, n * size);
        for (const [k, slot] of slots.entries()) expect(equal(dst.subarray(k * size, (k + 1) * size), src.subarray(slot * size, (slot + 1) * size))).toBe(true);
        await g.revoke();
      });

      it('a descriptor forged to claim longer ranges reaches no byte outside the granted ones', async (ctx) => {
        needGrants(ctx);
        const remote = await registered(b, 64 * 1024, 42);
        const local = await registered(a, 8192);
        const g = await b.grant([
          { registration: remote.reg, offset: 4096, length: 1024 },
          { registration: remote.reg, offset: 16384, length: 1024 },
        ]);
        const d = decodeDescriptor(g.descriptor);
        const forged = encodeDescriptor({ ...d, byteLength: d.byteLength + 4096, rangeLengths: Float64Array.of(1024 + 4096, 1024) });
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: forged, range: 0, remoteOffset: 0, length: 1024 + 4096 }]), [ErrorCode.RemoteRejected, ErrorCode.InvalidInput]);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: forged, range: 0, remoteOffset: 1024, length: 16 }]), [ErrorCode.RemoteRejected, ErrorCode.InvalidInput]);
        expect((await local.buf.read(0, 8192)).every((x) => x === 0)).toBe(true);
        // A forged range index beyond the grant's ranges.
        const more = encodeDescriptor({ ...d, byteLength: d.byteLength + 1024, rangeLengths: Float64Array.of(1024, 1024, 1024) });
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: more, range: 2, length: 1024 }]), [ErrorCode.RemoteRejected, ErrorCode.InvalidInput]);
        expect((await local.buf.read(0, 8192)).every((x) => x === 0)).toBe(true);
        // Inside the grant, the forged descriptor still reads what was granted.
        await a.read(b.endpoint(), [{ local: local.reg, remote: forged, range: 1, length: 1024 }]);
        expect(equal(await local.buf.read(0, 1024), await remote.buf.read(16384, 1024))).toBe(true);
        await g.revoke();
      });

      it('a WRITE through a grant lands in its range only', async (ctx) => {
        needGrants(ctx);
        const remote = await registered(b, 16 * 1024);
        const local = await registered(a, 4096, 43);
        const g = await b.grant([{ registration: remote.reg, offset: 8192, length: 2048 }]);
        await a.write(b.endpoint(), [{ local: local.reg, remote: g.descriptor, range: 0, remoteOffset: 100, length: 1000 }]);
        expect(equal(await remote.buf.read(8292, 1000), await local.buf.read(0, 1000))).toBe(true);
        expect((await remote.buf.read(0, 8292)).every((x) => x === 0)).toBe(true);
        expect((await remote.buf.read(9292, 16 * 1024 - 9292)).every((x) => x === 0)).toBe(true);
        await g.revoke();
      });

      it('a block grant over 1,000 blocks in lease order (not sorted): range k reads exactly block blocks[k]; past a block is refused', async (ctx) => {
        needGrants(ctx);
        const n = 1000;
        const size = 64;
        const base = 32;
        const remote = await registered(b, base + 3 * n * size, 45);
        const local = await registered(a, n * size);
        // Layer-major like a KV lease: the same scattered block ids in each of 4 layers of 750 blocks.
        const blocks = Uint32Array.from({ length: n }, (_, k) => (k % 4) * 750 + ((Math.floor(k / 4) * 397) % 750));
        const g = await b.grant({ registration: remote.reg, blockBytes: size, base, blocks });
        expect(g.rangeCount).toBe(n);
        expect(g.byteLength).toBe(n * size);
        await a.read(b.endpoint(), Array.from(blocks, (_, k) => ({ local: local.reg, localOffset: k * size, remote: g.descriptor, range: k, length: size })));
        const src = await remote.buf.read(0, base + 3 * n * size);
        const dst = await local.buf.read(0, n * size);
        for (const [k, blk] of blocks.entries()) expect(equal(dst.subarray(k * size, (k + 1) * size), src.subarray(base + blk * size, base + (blk + 1) * size))).toBe(true);
        await local.buf.write(new Uint8Array(n * size));
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: g.descriptor, range: 7, remoteOffset: 1, length: size }]), [ErrorCode.RemoteRejected, ErrorCode.InvalidInput]);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: g.descriptor, range: n, length: 1 }]), [ErrorCode.RemoteRejected, ErrorCode.InvalidInput]);
        expect((await local.buf.read(0, n * size)).every((x) => x === 0)).toBe(true);
        await g.revoke();
      });

      it('a WRITE through a block grant lands in its block only; after revoke the block grant is RemoteRejected', async (ctx) => {
        needGrants(ctx);
        const remote = await registered(b, 16 * 1024);
        const local = await registered(a, 4096, 46);
        const g = await b.grant({ registration: remote.reg, blockBytes: 1024, blocks: Uint32Array.of(9, 2) });
        await a.write(b.endpoint(), [{ local: local.reg, remote: g.descriptor, range: 1, remoteOffset: 24, length: 1000 }]);
        expect(equal(await remote.buf.read(2048 + 24, 1000), await local.buf.read(0, 1000))).toBe(true);
        expect((await remote.buf.read(0, 2048 + 24)).every((x) => x === 0)).toBe(true);
        expect((await remote.buf.read(3072, 16 * 1024 - 3072)).every((x) => x === 0)).toBe(true);
        await g.revoke();
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: g.descriptor, range: 0, length: 1024 }]), [ErrorCode.RemoteRejected]);
        await expectCode(a.write(b.endpoint(), [{ local: local.reg, remote: g.descriptor, range: 0, length: 1024 }]), [ErrorCode.RemoteRejected]);
        expect((await remote.buf.read(9 * 1024, 1024)).every((x) => x === 0)).toBe(true);
      });

      it('after revoke the grant is RemoteRejected; the registration and other grants keep working; revoking the registration ends its grants', async (ctx) => {
        needGrants(ctx);
        const remote = await registered(b, 8192, 44);
        const local = await registered(a, 8192);
        const g1 = await b.grant([{ registration: remote.reg, offset: 0, length: 4096 }]);
        const g2 = await b.grant([{ registration: remote.reg, offset: 4096, length: 4096 }]);
        await a.read(b.endpoint(), [{ local: local.reg, remote: g1.descriptor, range: 0, length: 4096 }]);
        await g1.revoke();
        await local.buf.write(new Uint8Array(8192));
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: g1.descriptor, range: 0, length: 4096 }]), [ErrorCode.RemoteRejected]);
        expect((await local.buf.read(0, 4096)).every((x) => x === 0)).toBe(true);
        await a.read(b.endpoint(), [{ local: local.reg, localOffset: 4096, remote: g2.descriptor, range: 0, length: 4096 }]);
        await a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor, length: 4096 }]);
        expect(equal(await local.buf.read(0, 8192), await remote.buf.read(0, 8192))).toBe(true);
        await remote.reg.revoke();
        expect(g2.revoked).toBe(true);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: g2.descriptor, range: 0, length: 4096 }]), [ErrorCode.RemoteRejected]);
      });
    });

    describe('deadlines and aborts', () => {
      it('an already-passed deadline fails with TimedOut and moves nothing', async () => {
        const remote = await registered(b, 4096, 1);
        const local = await registered(a, 4096);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }], { deadline: Date.now() - 1 }), [ErrorCode.TimedOut]);
        expect((await local.buf.read(0, 4096)).every((x) => x === 0)).toBe(true);
      });

      it('an already-aborted signal fails with Aborted', async () => {
        const remote = await registered(b, 4096, 1);
        const local = await registered(a, 4096);
        const ac = new AbortController();
        ac.abort();
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }], { signal: ac.signal }), [ErrorCode.Aborted]);
      });

      it('an abort during a transfer: typed outcome, no byte lands after it, never wrong data, engine stays usable', async () => {
        const size = 16 * 1024 * 1024;
        const remote = await registered(b, size, 3);
        const expected = await remote.buf.read(0, size);
        // Warm the connection so the abort hits bytes in flight, not the handshake.
        const warm = await registered(a, 4096);
        await a.read(b.endpoint(), [{ local: warm.reg, remote: remote.reg.descriptor, length: 4096 }]);
        const victim = await registered(a, size);
        const bystanders = await Promise.all([0, 1, 2].map(() => registered(a, size)));
        const ac = new AbortController();
        const p = a.read(b.endpoint(), [{ local: victim.reg, remote: remote.reg.descriptor }], { signal: ac.signal }).then(
          () => 'ok' as const,
          (e: unknown) => e,
        );
        const others = bystanders.map((x) =>
          a.read(b.endpoint(), [{ local: x.reg, remote: remote.reg.descriptor }]).then(
            () => 'ok' as const,
            (e: unknown) => e,
          ),
        );
        await new Promise((r) => setTimeout(r, 1));
        ac.abort();
        const outcome = await p;
        if (outcome === 'ok') {
          expect(equal(await victim.buf.read(0, size), expected)).toBe(true);
        } else {
          expect(outcome).toBeInstanceOf(TensorwireError);
          expect((outcome as TensorwireError).code).toBe(ErrorCode.Aborted);
          // Quiesced before it was reported: nothing moves into the destination any more.
          const snapshot = await victim.buf.read(0, size);
          await new Promise((r) => setTimeout(r, 50));
          expect(equal(await victim.buf.read(0, size), snapshot)).toBe(true);
        }
        // Transfers sharing the connection either complete with the right bytes or fail with a
        // connection error (transports that must reset the connection to quiesce); never wrong data.
        const results = await Promise.all(others);
        for (const [i, r] of results.entries()) {
          if (r === 'ok') expect(equal(await (bystanders[i] as { buf: ConformanceBuffer }).buf.read(0, size), expected)).toBe(true);
          else expect([ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]).toContain((r as TensorwireError).code);
        }
        // A new transfer works (on the same or a fresh connection).
        const again = await registered(a, size);
        await a.read(b.endpoint(), [{ local: again.reg, remote: remote.reg.descriptor }]);
        expect(equal(await again.buf.read(0, size), expected)).toBe(true);
      });
    });

    describe('bad input', () => {
      it('garbage descriptors are InvalidInput', async () => {
        const local = await registered(a, 16);
        for (const bad of [new Uint8Array(0), new Uint8Array([1, 2, 3]), new Uint8Array(64).fill(0xff)]) {
          await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: bad }]), [ErrorCode.InvalidInput]);
        }
      });

      it("a descriptor of another node is refused before anything is sent", async () => {
        const own = await registered(a, 16, 1);
        const local = await registered(a, 16);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: own.reg.descriptor }]), [ErrorCode.InvalidInput]);
      });

      it('ranges beyond either registration are InvalidInput', async () => {
        const remote = await registered(b, 100, 1);
        const local = await registered(a, 100);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor, remoteOffset: 90, length: 20 }]), [ErrorCode.InvalidInput]);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, localOffset: 90, remote: remote.reg.descriptor, length: 20 }]), [ErrorCode.InvalidInput]);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor, length: 0 }]), [ErrorCode.InvalidInput]);
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor, remoteOffset: -1, length: 1 }]), [ErrorCode.InvalidInput]);
      });

      it('a descriptor whose byte length was inflated cannot reach past the real registration', async () => {
        const remote = await registered(b, 4096, 1);
        const local = await registered(a, 8192);
        const d = decodeDescriptor(remote.reg.descriptor);
        const forged = encodeDescriptor({ ...d, byteLength: 8192 });
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: forged, remoteOffset: 4096, length: 4096 }]), [ErrorCode.RemoteRejected, ErrorCode.InvalidInput]);
        expect((await local.buf.read(0, 8192)).every((x) => x === 0)).toBe(true);
      });

      it('a revoked registration is RemoteRejected, and others keep working', async () => {
        const remote = await registered(b, 4096, 1);
        const other = await registered(b, 4096, 2);
        const local = await registered(a, 4096);
        await a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]);
        await remote.reg.revoke();
        await remote.reg.revoke(); // idempotent
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]), [ErrorCode.RemoteRejected]);
        await a.read(b.endpoint(), [{ local: local.reg, remote: other.reg.descriptor }]);
        expect(equal(await local.buf.read(0, 4096), await other.buf.read(0, 4096))).toBe(true);
      });

      it('a forged grant (payload bytes flipped) is rejected', async () => {
        const remote = await registered(b, 4096, 1);
        const local = await registered(a, 4096);
        const d = decodeDescriptor(remote.reg.descriptor);
        const [name, payload] = [...d.transports][0] as [string, Uint8Array];
        const flipped = payload.slice();
        for (let i = 0; i < flipped.length; i++) flipped[i] = (flipped[i] as number) ^ 0x5a;
        const forged = encodeDescriptor({ ...d, transports: new Map([[name, flipped]]) });
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: forged }]), [ErrorCode.RemoteRejected, ErrorCode.InvalidInput]);
        expect((await local.buf.read(0, 4096)).every((x) => x === 0)).toBe(true);
      });

      it('a revoked local registration is InvalidInput', async () => {
        const remote = await registered(b, 64, 1);
        const local = await registered(a, 64);
        await local.reg.revoke();
        await expectCode(a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]), [ErrorCode.InvalidInput]);
      });
    });

    describe('connections', () => {
      it('concurrent first transfers share one handshake, later ones reuse it', async () => {
        const x = await engine('x');
        const y = await engine('y');
        const remote = await registered(y, 4096, 9);
        const local = await registered(x, 4096 * 8);
        await Promise.all(Array.from({ length: 8 }, (_, i) => x.read(y.endpoint(), [{ local: local.reg, localOffset: i * 4096, remote: remote.reg.descriptor, length: 4096 }])));
        expect(x.connections()).toHaveLength(1);
        await x.read(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor, length: 4096 }]);
        expect(x.connections()).toHaveLength(1);
        const yConns = y.connections().filter((c) => c.peer.nodeId === x.identity.nodeId);
        expect(yConns.length).toBeLessThanOrEqual(1);
      });

      it('simultaneous open from both sides ends with one working connection each way', async () => {
        const x = await engine('s');
        const y = await engine('s');
        const onX = await registered(x, 4096, 11);
        const onY = await registered(y, 4096, 12);
        const dx = await registered(x, 4096);
        const dy = await registered(y, 4096);
        await Promise.all([
          x.read(y.endpoint(), [{ local: dx.reg, remote: onY.reg.descriptor }]),
          y.read(x.endpoint(), [{ local: dy.reg, remote: onX.reg.descriptor }]),
        ]);
        expect(equal(await dx.buf.read(0, 4096), await onY.buf.read(0, 4096))).toBe(true);
        expect(equal(await dy.buf.read(0, 4096), await onX.buf.read(0, 4096))).toBe(true);
        // Let any retired duplicate finish, then both tables hold one connection, the same one.
        for (let i = 0; i < 3; i++) {
          await x.read(y.endpoint(), [{ local: dx.reg, remote: onY.reg.descriptor }]);
          await y.read(x.endpoint(), [{ local: dy.reg, remote: onX.reg.descriptor }]);
        }
        const cx = x.connections();
        const cy = y.connections();
        expect(cx).toHaveLength(1);
        expect(cy).toHaveLength(1);
        expect(cx[0]?.initiator).toBe(cy[0]?.initiator);
      });

      it('invalidate() drops the connection in one step; the next transfer reconnects', async () => {
        const remote = await registered(b, 4096, 5);
        const local = await registered(a, 4096);
        await a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]);
        expect(a.connections().some((c) => c.peer.nodeId === b.identity.nodeId)).toBe(true);
        await a.invalidate(b.identity.nodeId);
        expect(a.connections().some((c) => c.peer.nodeId === b.identity.nodeId)).toBe(false);
        local.buf.write(new Uint8Array(4096));
        await a.read(b.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]);
        expect(equal(await local.buf.read(0, 4096), await remote.buf.read(0, 4096))).toBe(true);
      });

      it('peer death mid-transfer is a connection error, never a hang or partial success', async () => {
        const x = await engine('d');
        const y = await engine('d');
        const size = 4 * 1024 * 1024;
        const remote = await registered(y, size, 13);
        const expected = await remote.buf.read(0, size);
        const local = await registered(x, size);
        await x.read(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]);
        const endpoint = y.endpoint();
        const dsts = await Promise.all(Array.from({ length: 8 }, () => registered(x, size)));
        const transfers = dsts.map((d) =>
          x.read(endpoint, [{ local: d.reg, remote: remote.reg.descriptor }], { timeoutMs: 20_000 }).then(
            () => undefined,
            (e: unknown) => e,
          ),
        );
        await y.close();
        const outcomes = await Promise.all(transfers);
        for (const [i, o] of outcomes.entries()) {
          if (o === undefined) {
            // Finished before the peer died: it must be complete, not partial.
            expect(equal(await (dsts[i] as { buf: ConformanceBuffer }).buf.read(0, size), expected)).toBe(true);
            continue;
          }
          expect(o).toBeInstanceOf(TensorwireError);
          expect([ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]).toContain((o as TensorwireError).code);
        }
        await expectCode(x.read(endpoint, [{ local: local.reg, remote: remote.reg.descriptor }], { timeoutMs: 20_000 }), [
          ErrorCode.ConnectionBroken,
          ErrorCode.SessionInvalidated,
          ErrorCode.TimedOut,
        ]);
        expect(x.connections().filter((c) => c.state === 'open')).toHaveLength(0);
      });

      it('simultaneous open with transfers in flight both ways: every transfer completes with the right bytes; one connection remains', async () => {
        const size = 2 * 1024 * 1024;
        for (let round = 0; round < 3; round++) {
          const x = await engine('so');
          const y = await engine('so');
          const onX = await registered(x, size, 60 + round);
          const onY = await registered(y, size, 70 + round);
          const dx = await Promise.all([0, 1, 2].map(() => registered(x, size)));
          const dy = await Promise.all([0, 1, 2].map(() => registered(y, size)));
          const sinkX = await registered(x, size);
          const sinkY = await registered(y, size);
          await Promise.all([
            ...dx.map((d) => x.read(y.endpoint(), [{ local: d.reg, remote: onY.reg.descriptor }])),
            ...dy.map((d) => y.read(x.endpoint(), [{ local: d.reg, remote: onX.reg.descriptor }])),
            x.write(y.endpoint(), [{ local: onX.reg, remote: sinkY.reg.descriptor }]),
            y.write(x.endpoint(), [{ local: onY.reg, remote: sinkX.reg.descriptor }]),
          ]);
          const srcX = await onX.buf.read(0, size);
          const srcY = await onY.buf.read(0, size);
          for (const d of dx) expect(equal(await d.buf.read(0, size), srcY)).toBe(true);
          for (const d of dy) expect(equal(await d.buf.read(0, size), srcX)).toBe(true);
          expect(equal(await sinkY.buf.read(0, size), srcX)).toBe(true);
          expect(equal(await sinkX.buf.read(0, size), srcY)).toBe(true);
          // The duplicate retires in order; afterwards each side holds one connection, the same one.
          for (let i = 0; i < 3; i++) {
            await x.read(y.endpoint(), [{ local: (dx[0] as { reg: Registration }).reg, remote: onY.reg.descriptor, length: 4096 }]);
            await y.read(x.endpoint(), [{ local: (dy[0] as { reg: Registration }).reg, remote: onX.reg.descriptor, length: 4096 }]);
          }
          expect(x.connections()).toHaveLength(1);
          expect(y.connections()).toHaveLength(1);
          expect(x.connections()[0]?.initiator).toBe(y.connections()[0]?.initiator);
          await Promise.all([x.close(), y.close()]);
        }
      });

      it('nodes on different hosts: transfers work when the transport works between hosts', async (tc) => {
        if (!ctx.caps().remote) {
          process.stderr.write(`[tensorwire] skipping different-hosts case: ${options.name} works on one host only\n`);
          tc.skip(`${options.name} works on one host only`);
          return;
        }
        if (options.engineOptions?.hostId !== undefined) {
          tc.skip('engineOptions.hostId is fixed');
          return;
        }
        const x = await engine('hx', { hostId: `hx${nodeCounter}` });
        const y = await engine('hy', { hostId: `hy${nodeCounter}` });
        const remote = await registered(y, 64 * 1024, 15);
        const local = await registered(x, 64 * 1024);
        await x.read(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]);
        expect(equal(await local.buf.read(0, 64 * 1024), await remote.buf.read(0, 64 * 1024))).toBe(true);
      });

      const cycles = options.churnCycles ?? 1000;
      it(`no handle or timer leaks, unref'd ones included, over ${cycles} connect/invalidate cycles`, { timeout: 300_000 }, async () => {
        const x = await engine('c');
        const y = await engine('c');
        const remote = await registered(y, 64, 1);
        const local = await registered(x, 64);
        // async_hooks sees every socket, server, timer (ref'd or not) from creation to
        // destruction; getActiveResourcesInfo() only what keeps the loop alive. Both must not grow.
        const tracker = new ResourceTracker().start();
        try {
          for (let i = 0; i < 2; i++) {
            await x.read(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]);
            await x.invalidate(y.identity.nodeId);
          }
          await settle();
          const before = tracker.counts();
          const activeBefore = activeResources();
          for (let i = 0; i < cycles; i++) {
            await x.read(y.endpoint(), [{ local: local.reg, remote: remote.reg.descriptor }]);
            await x.invalidate(y.identity.nodeId);
          }
          // The peer notices each close asynchronously; give it a moment, then compare.
          const grown = (): string[] => [...grownTypes(before, tracker.counts()), ...grownTypes(activeBefore, activeResources()).map((g) => `active ${g}`)];
          let left = grown();
          for (let i = 0; i < 40 && left.length > 0; i++) {
            await settle();
            left = grown();
          }
          expect(left, 'live resources that grew over the cycles').toEqual([]);
        } finally {
          tracker.stop();
        }
        expect(x.connections()).toHaveLength(0);
        expect(y.connections().length).toBeLessThanOrEqual(1);
      });
    });

    describeAdversarial(ctx);
    describeContract(ctx);

    describe('lifecycle', () => {
      it('close() is idempotent and later calls fail with Closed', async () => {
        const x = await engine('l');
        await Promise.all([x.close(), x.close()]);
        await x[Symbol.asyncDispose]();
        const local = new Uint8Array(8);
        await expectCode(x.register({ kind: 'host', buffer: local }), [ErrorCode.Closed]);
      });
    });
  });
}
