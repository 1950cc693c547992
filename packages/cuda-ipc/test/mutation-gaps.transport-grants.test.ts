/**
 * Tests written to kill surviving Stryker mutants of the same-host transport's grant code
 * (src/transport.ts: `#grant`, `#resolve`, `grant`, `revoke`, `revokeGrant`, `#revokeRange`; see
 * the package README, "Mutation testing"): each refusal of a whole-registration grant segment
 * (unknown, issued by another node or process, a hostile target, name or device) with its
 * message, remote code and request; a write into a pool slot through its registration grant;
 * the refusals of `grant()` with message and details; directory references and arena bytes
 * given back; `revoke()` of a registration waiting for its range grants' drain, also when called
 * twice; and a range grant's drain (a peer inside that leaves, one that does not, close()
 * waiting for it). A peer inside a record is this process entering it natively.
 */
import {
  ClosedError,
  GRANT_STRIDE,
  InvalidInputError,
  RemoteRejectedError,
  createTransferBatch,
  defaultHostId,
  silentLogger,
  type Logger,
  type TransportConnection,
  type TransportHost,
} from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { CudaIpcTransport, TensorPool, allocateSharedMemory, decodePayload, native, releaseSharedMemory } from '../src/index.js';
import { uniqueOwner } from './helpers.js';
import { failure } from './pool-fixtures.js';

const pid = process.pid;
const BLOCK = 4096;
const tick = (): Promise<void> => new Promise((r) => setImmediate(r));

/** Grant segment fields (little-endian, the owner's layout): the header's owner pid, then the extension. */
const OWNER_PID = 40;
const G_TARGET = 1024 + 16;
const G_OFFSET = 1024 + 24;
const G_LENGTH = 1024 + 32;
const G_NAME_LEN = 1024 + 40;

class Warnings implements Logger {
  readonly warns: { message: string; fields: Record<string, unknown> | undefined }[] = [];
  debug(): void {}
  info(): void {}
  error(): void {}
  warn(message: string, fields?: Record<string, unknown>): void {
    this.warns.push({ message, fields });
  }
}

let nodes = 0;
const cleanups: (() => unknown)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** Two started transports (`ta` reads from `tb`), a connection ta -> tb, and helpers. */
async function pair(options: ConstructorParameters<typeof CudaIpcTransport>[0] = {}) {
  const tag = `${++nodes}`;
  const logger = new Warnings();
  const hosts: TransportHost[] = ['ma', 'mb'].map((n) => ({ identity: { nodeId: `${n}${tag}x${pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger, inbound: () => undefined }));
  const ta = new CudaIpcTransport();
  const tb = new CudaIpcTransport(options);
  await ta.start(hosts[0] as TransportHost);
  await tb.start(hosts[1] as TransportHost);
  cleanups.push(() => Promise.all([ta.close(), tb.close()]));
  const connect = async (): Promise<TransportConnection> => {
    const c = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { signal: new AbortController().signal, deadline: Date.now() + 10_000, streams: 1 });
    cleanups.push(() => c.close());
    return c;
  };
  const conn = await connect();
  const dst = new Uint8Array(BLOCK).fill(0xee);
  const local = await ta.register({ kind: 'host', buffer: dst });
  const opts = () => ({ signal: new AbortController().signal, deadline: Date.now() + 10_000 });
  const shared = (bytes = BLOCK): Uint8Array => {
    const region = allocateSharedMemory(bytes, 'mgaps');
    cleanups.push(() => releaseSharedMemory(region));
    return region;
  };
  /** Post one range of `remote` on the connection, as request 3. */
  const post = (op: 'read' | 'write', remote: unknown, length = 64, remoteRange?: number, on = conn) =>
    on.execute(0, createTransferBatch(op, [{ local: local.handle, localOffset: 0, remote, remoteOffset: 0, length, request: 3, ...(remoteRange === undefined ? {} : { remoteRange }) }]), opts());
  return { ta, tb, hosts, conn, connect, dst, local, shared, post, logger, nodeB: (hosts[1] as TransportHost).identity.nodeId };
}

function thrown(f: () => unknown): InvalidInputError {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(InvalidInputError);
    return e as InvalidInputError;
  }
  throw new Error('expected a throw');
}

/** Where the fields of a range-grant payload are (big-endian). */
function rangeFields(p: Uint8Array): { table: string; record: number; generation: number; token: Uint8Array } {
  const nameLen = p[7] as number;
  const dv = new DataView(p.buffer, p.byteOffset, p.byteLength);
  return {
    table: Buffer.from(p.subarray(8, 8 + nameLen)).toString('latin1'),
    record: dv.getUint32(8 + nameLen),
    generation: Number(dv.getBigUint64(12 + nameLen)),
    token: p.slice(20 + nameLen, 36 + nameLen),
  };
}
/** Enter a range grant's record as a peer would (its in-flight count goes up); returns how to leave. */
function enter(payload: Uint8Array): { leave: () => void; active: () => number } {
  const f = rangeFields(payload);
  const mapping = native.shmOpen(f.table, 2 ** 33);
  const at = 4096 + f.record * 64;
  expect(native.recordEnter(mapping, at, f.generation, f.token)).toBe(0);
  return { leave: () => native.recordLeave(mapping, at), active: () => native.recordActive(mapping, at) };
}

describe('a whole-registration grant segment, checked by the reader (#grant, #resolve)', () => {
  it('a hostile or foreign grant segment is refused naming the grant, with its remote code and the request; nothing moves', async () => {
    const s = await pair();
    const region = s.shared();
    region.fill(0x11);
    const reg = await s.tb.register({ kind: 'host', buffer: region });
    const remote = decodePayload(reg.payload, 'host', BLOCK);
    const seg = new DataView(native.shmOpen(remote.grantName, 4096));
    // The genuine grant reads.
    await s.post('read', s.ta.decodeRemote(reg.payload, 'host', BLOCK));
    expect(s.dst[0]).toBe(0x11);
    s.dst.fill(0xee);
    const cases: [string, (dv: DataView) => () => void, string, string][] = [
      ['another owner pid', (dv) => swap32(dv, OWNER_PID, pid + 1), 'foreign-grant', `grant ${remote.grantName} was not issued by ${s.nodeB}`],
      ['target code 2', (dv) => swap32(dv, G_TARGET, 2), 'bad-grant', `grant ${remote.grantName} has an invalid target`],
      ['a target offset past 2^53', (dv) => swap64(dv, G_OFFSET, 2 ** 53 + 2), 'bad-grant', `grant ${remote.grantName} has an invalid target`],
      ['a target length past 2^53', (dv) => swap64(dv, G_LENGTH, 2 ** 53 + 2), 'bad-grant', `grant ${remote.grantName} has an invalid target`],
      ['a target length shorter than the payload says', (dv) => swap64(dv, G_LENGTH, BLOCK - 1), 'bad-grant', `grant ${remote.grantName} has an invalid target`],
      ['a target ending past the largest segment', (dv) => swap64(dv, G_OFFSET, 2 ** 40 - BLOCK + 1), 'bad-grant', `grant ${remote.grantName} has an invalid target`],
      ['an empty data segment name', (dv) => swap8(dv, G_NAME_LEN, 0), 'bad-grant', `grant ${remote.grantName} names an invalid segment`],
      ['a cuda target without a device', (dv) => swap32(dv, G_TARGET, 1), 'bad-grant', `grant ${remote.grantName} has no device`],
    ];
    for (const [label, forge, code, message] of cases) {
      const restore = forge(seg);
      try {
        // A new connection (a connection caches the grants it checked) and the payload decoded afresh.
        const fresh = await s.connect();
        const err = await failure(s.post('read', s.ta.decodeRemote(reg.payload, 'host', BLOCK), 64, undefined, fresh));
        await fresh.close();
        expect(err, label).toBeInstanceOf(RemoteRejectedError);
        expect(err.message, label).toBe(message);
        expect((err as RemoteRejectedError).remoteCode, label).toBe(code);
        expect(err.details['request'], label).toBe(3);
        expect(s.dst.every((x) => x === 0xee), label).toBe(true);
      } finally {
        restore();
      }
    }
    // Ending exactly at the largest segment is not a bad target (it fails later, for another reason).
    const restore = swap64(seg, G_OFFSET, 2 ** 40 - BLOCK);
    try {
      const err = await failure(s.post('read', s.ta.decodeRemote(reg.payload, 'host', BLOCK), 64, undefined, await s.connect()));
      expect(err.message).not.toMatch(/invalid target/);
    } finally {
      restore();
    }
    await s.tb.revoke(reg.handle);
  });

  it('a grant of another node presented to this peer is foreign; a grant segment that does not exist is unknown, with its cause', async () => {
    const s = await pair();
    const tc = new CudaIpcTransport();
    await tc.start({ identity: { nodeId: `mc${nodes}x${pid}`, incarnation: 'ic', hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined });
    cleanups.push(() => tc.close());
    const third = await tc.register({ kind: 'host', buffer: s.shared() });
    const name = decodePayload(third.payload, 'host', BLOCK).grantName;
    const foreign = await failure(s.post('read', s.ta.decodeRemote(third.payload, 'host', BLOCK)));
    expect(foreign).toBeInstanceOf(RemoteRejectedError);
    expect(foreign.message).toBe(`grant ${name} was not issued by ${s.nodeB}`);
    expect((foreign as RemoteRejectedError).remoteCode).toBe('foreign-grant');
    expect(foreign.details['request']).toBe(3);

    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const remote = s.ta.decodeRemote(reg.payload, 'host', BLOCK) as { grantName: string };
    const gone = { ...remote, grantName: `${remote.grantName.slice(0, -4)}zzzz` };
    const unknown = await failure(s.post('read', gone));
    expect(unknown).toBeInstanceOf(RemoteRejectedError);
    expect(unknown.message).toBe(`grant ${gone.grantName} is revoked or unknown`);
    expect((unknown as RemoteRejectedError).remoteCode).toBe('unknown-grant');
    expect(unknown.cause).toBeInstanceOf(Error);
    expect(unknown.details['request']).toBe(3);
  });

  it('a remote the transport did not decode is InvalidInputError naming the request', async () => {
    const s = await pair();
    const e = await failure(s.post('read', { kind: 'host', grantName: '/tw-g.x.y', token: new Uint8Array(15), length: 64 }));
    expect(e).toBeInstanceOf(InvalidInputError);
    expect(e.message).toBe('a remote of the batch was not decoded by the cuda-ipc transport');
    expect(e.details).toMatchObject({ field: 'remote', request: 3 });
  });

  it('a write into a pool slot through its registration grant is refused (read-only); the slot is unchanged', async () => {
    const s = await pair();
    const pool = new TensorPool({ owner: uniqueOwner('mgw') });
    cleanups.push(() => pool.close());
    const id = await pool.register({ dtype: 'uint8', shape: [BLOCK] });
    pool.writeSync(id, new Uint8Array(BLOCK).fill(0x22));
    const view = pool.readSync(id);
    cleanups.push(() => view.dispose());
    const reg = await s.tb.register({ kind: 'host', buffer: view.buffer as Uint8Array });
    cleanups.push(() => s.tb.revoke(reg.handle));
    const remote = s.ta.decodeRemote(reg.payload, 'host', BLOCK) as { grantName: string };
    await s.post('read', remote);
    expect(s.dst[0]).toBe(0x22);
    const err = await failure(s.post('write', remote));
    expect(err).toBeInstanceOf(RemoteRejectedError);
    expect((err as RemoteRejectedError).remoteCode).toBe('read-only');
    expect(err.message).toBe(`grant ${remote.grantName} is a pool slot: peers may read it, only its owner writes it (pool.write)`);
    expect(err.details['request']).toBe(3);
    const after = pool.readSync(id);
    try {
      expect((after.buffer as Uint8Array).every((x) => x === 0x22)).toBe(true);
    } finally {
      after.dispose();
    }
  });
});

describe('grant(): refusals, directory references and arena bytes', () => {
  it('malformed specs are refused as "ranges are malformed" (field ranges), at their boundaries', async () => {
    const s = await pair();
    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const h = [reg.handle];
    const bad: [string, unknown][] = [
      ['count 0', { handles: h, count: 0, ranges: new Float64Array(3), bytes: 1 }],
      ['count 1.5', { handles: h, count: 1.5, ranges: new Float64Array(6), bytes: 1 }],
      ['count NaN', { handles: h, count: Number.NaN, ranges: new Float64Array(3), bytes: 1 }],
      ['ranges a plain array', { handles: h, count: 1, ranges: [0, 0, 1], bytes: 1 }],
      ['ranges one number short', { handles: h, count: 2, ranges: Float64Array.of(0, 0, 1, 0, 8), bytes: 2 }],
      ['handles not an array', { handles: reg.handle, count: 1, ranges: Float64Array.of(0, 0, 1), bytes: 1 }],
    ];
    for (const [label, spec] of bad) {
      const e = thrown(() => s.tb.grant(spec as Parameters<CudaIpcTransport['grant']>[0]));
      expect(e.message, label).toBe('grant: ranges are malformed');
      expect(e.details, label).toMatchObject({ field: 'ranges' });
    }
    // Exactly count * GRANT_STRIDE numbers (and more) are fine.
    const ok = s.tb.grant({ handles: h, count: 2, ranges: Float64Array.of(0, 0, 8, 0, 8, 8, 99), bytes: 16 });
    expect(ok.payload).toBeInstanceOf(Uint8Array);
    expect(GRANT_STRIDE).toBe(3);
  });

  it('handles: a foreign one, a revoked one, local-only memory; each named by its index', async () => {
    const s = await pair();
    const good = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const gone = await s.tb.register({ kind: 'host', buffer: s.shared() });
    await s.tb.revoke(gone.handle);
    const plain = await s.tb.register({ kind: 'host', buffer: new Uint8Array(64) });
    const ranges = Float64Array.of(0, 0, 8, 1, 0, 8);
    const cases: [string, object, string][] = [
      ['foreign', {}, 'grant: handle 1 is not a cuda-ipc registration'],
      ['revoked', gone.handle, 'grant: registration 1 was revoked'],
      ['local only', plain.handle, 'grant: registration 1 is for local use only (not in shared memory: allocate it with allocateSharedMemory() or use a pool slot)'],
    ];
    for (const [label, second, message] of cases) {
      const e = thrown(() => s.tb.grant({ handles: [good.handle, second], count: 2, ranges, bytes: 16 }));
      expect(e.message, label).toBe(message);
      expect(e.details, label).toEqual({ field: 'registration', registration: 1 });
    }
  });

  it('a CUDA registration is refused: range grants cover host shared memory only (fake CUDA export)', async () => {
    const s = await pair();
    // Pretend this machine has CUDA (as test/bookkeeping.test.ts does); the one CUDA call made is faked.
    Object.defineProperty(s.tb, 'capabilities', { value: Object.freeze({ ...s.tb.capabilities, memoryKinds: ['host', 'cuda'] }) });
    const real = native.cudaExport;
    (native as { cudaExport: typeof native.cudaExport }).cudaExport = async () => ({ handle: new Uint8Array(64).fill(5), base: 0x1000n, offset: 0, allocSize: 1 << 20 });
    try {
      const good = await s.tb.register({ kind: 'host', buffer: s.shared() });
      const dev = await s.tb.register({ kind: 'cuda', device: 0, pointer: 0x1000n, byteLength: 4096 });
      const e = thrown(() => s.tb.grant({ handles: [good.handle, dev.handle], count: 2, ranges: Float64Array.of(0, 0, 8, 1, 0, 8), bytes: 16 }));
      expect(e.message).toBe('cuda-ipc range grants cover host shared memory only; CUDA memory is granted per registration (register it)');
      expect(e.details).toEqual({ field: 'registration', registration: 1 });
      await s.tb.revoke(dev.handle);
    } finally {
      (native as { cudaExport: typeof native.cudaExport }).cudaExport = real;
    }
  });

  it('a refused range gives its record and arena bytes back', async () => {
    const s = await pair();
    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const first = s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 });
    const [before] = s.tb.grantTables();
    // 3 ranges, the last outside the registration: checked by the transport itself.
    expect(() => s.tb.grant({ handles: [reg.handle], count: 3, ranges: Float64Array.of(0, 0, 8, 0, 8, 8, 0, BLOCK - 4, 8), bytes: 24 })).toThrow(InvalidInputError);
    const [after] = s.tb.grantTables();
    expect(after?.freeRangeBytes).toBe(before?.freeRangeBytes);
    expect(after?.freeRecords).toBe(before?.freeRecords);
    expect(after?.live).toBe(1);
    await s.tb.revokeGrant(first.handle);
  });

  it("a registration's directory entry is shared by its grants and freed when it is revoked: a one-entry table takes the next registration", async () => {
    const s = await pair({ grantTable: { segments: 1 } });
    const r1 = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const g1 = s.tb.grant({ handles: [r1.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 });
    const g2 = s.tb.grant({ handles: [r1.handle], count: 1, ranges: Float64Array.of(0, 8, 8), bytes: 8 });
    expect(s.tb.grantTables()).toHaveLength(1);
    await s.tb.revokeGrant(g1.handle);
    await s.tb.revokeGrant(g2.handle);
    await s.tb.revoke(r1.handle);
    const r2 = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const g3 = s.tb.grant({ handles: [r2.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 });
    expect(s.tb.grantTables()).toHaveLength(1);
    await s.tb.revokeGrant(g3.handle);
  });

  it('grant() after close() is ClosedError and takes no record', async () => {
    const s = await pair();
    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 });
    await s.tb.close();
    let err: unknown;
    try {
      s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 8, 8), bytes: 8 });
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(ClosedError);
    expect((err as ClosedError).message).toBe('cuda-ipc transport is closed');
    expect(s.tb.grantTables()).toEqual([]);
  });

  it('wrong handles are refused with their messages', async () => {
    const s = await pair();
    await expect(s.tb.revoke({})).rejects.toThrow(new InvalidInputError('not a cuda-ipc registration handle'));
    await expect(s.tb.revokeGrant({})).rejects.toThrow(new InvalidInputError('not a cuda-ipc range grant of this transport'));
  });
});

describe('revoking while a peer is inside a range grant (#revokeRange, revoke)', () => {
  it('a peer that leaves during the drain: the revoke resolves after it left, no warning, the record is reused', async () => {
    const s = await pair({ revokeTimeoutMs: 10_000, grantTable: { records: 2 } });
    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const g = s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 0, 64), bytes: 64 });
    const free = s.tb.grantTables()[0]?.freeRecords as number;
    const peer = enter(g.payload);
    let done = false;
    const p = s.tb.revokeGrant(g.handle).then(() => (done = true));
    for (let i = 0; i < 20; i++) await tick();
    expect(done).toBe(false);
    peer.leave();
    await p;
    expect(s.logger.warns).toEqual([]);
    const [t] = s.tb.grantTables();
    expect(t?.live).toBe(0);
    expect(t?.freeRecords).toBe(free + 1);
    // Both records can be taken again in this table.
    s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 });
    s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 8, 8), bytes: 8 });
    expect(s.tb.grantTables()).toHaveLength(1);
  });

  it('a drain that times out warns with the table and record, retires the record and gives its arena bytes back', async () => {
    const s = await pair({ revokeTimeoutMs: 30 });
    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const before = s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 0, 8), bytes: 8 });
    await s.tb.revokeGrant(before.handle);
    const [t0] = s.tb.grantTables();
    const g = s.tb.grant({ handles: [reg.handle], count: 2, ranges: Float64Array.of(0, 0, 64, 0, 64, 64), bytes: 128 });
    const f = rangeFields(g.payload);
    const peer = enter(g.payload);
    await s.tb.revokeGrant(g.handle);
    expect(s.logger.warns).toEqual([{ message: 'cuda-ipc: a peer batch was still inside a range grant when revoke timed out; its record is retired', fields: { table: f.table, record: f.record } }]);
    const [t1] = s.tb.grantTables();
    expect(t1?.freeRangeBytes).toBe(t0?.freeRangeBytes);
    expect(t1?.freeRecords).toBe((t0?.freeRecords as number) - 1);
    peer.leave();
  });

  it('close() waits for a range grant draining with a peer inside', async () => {
    const s = await pair({ revokeTimeoutMs: 10_000 });
    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const g = s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 0, 64), bytes: 64 });
    const peer = enter(g.payload);
    void s.tb.revokeGrant(g.handle);
    let closed = false;
    const c = s.tb.close().then(() => (closed = true));
    // Long enough for everything else close() does; the drain is bounded by revokeTimeoutMs (10 s).
    await new Promise((r) => setTimeout(r, 100));
    expect(closed).toBe(false);
    peer.leave();
    await c;
    expect(closed).toBe(true);
  });

  it("revoking a registration twice: both wait for its range grants' drain", async () => {
    const s = await pair({ revokeTimeoutMs: 10_000 });
    const reg = await s.tb.register({ kind: 'host', buffer: s.shared() });
    const g = s.tb.grant({ handles: [reg.handle], count: 1, ranges: Float64Array.of(0, 0, 64), bytes: 64 });
    const peer = enter(g.payload);
    const settled = [false, false];
    const first = s.tb.revoke(reg.handle).then(() => (settled[0] = true));
    const second = s.tb.revoke(reg.handle).then(() => (settled[1] = true));
    for (let i = 0; i < 20; i++) await tick();
    expect(settled).toEqual([false, false]);
    peer.leave();
    await Promise.all([first, second]);
    expect(peer.active()).toBe(0);
  });
});

function swap32(dv: DataView, at: number, v: number): () => void {
  const old = dv.getUint32(at, true);
  dv.setUint32(at, v, true);
  return () => dv.setUint32(at, old, true);
}
function swap64(dv: DataView, at: number, v: number): () => void {
  const old = dv.getBigUint64(at, true);
  dv.setBigUint64(at, BigInt(v), true);
  return () => dv.setBigUint64(at, old, true);
}
function swap8(dv: DataView, at: number, v: number): () => void {
  const old = dv.getUint8(at);
  dv.setUint8(at, v);
  return () => dv.setUint8(at, old);
}
