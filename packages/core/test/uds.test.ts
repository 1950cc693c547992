/**
 * What is specific to the Unix-socket transport: the socket file (mode 0600 in a private 0700
 * directory, unlinked on close), refusals of what is not ours at its path (a symbolic link,
 * another user's file, a non-socket, a live listener), stale sockets, the endpoint codec, the
 * dialer's own checks, capabilities and selection over TCP on one host.
 */
import { chmodSync, chownSync, existsSync, linkSync, lstatSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import fc from 'fast-check';
import { afterEach, describe, expect, it } from 'vitest';
import { TransferEngine } from '../src/engine.js';
import { ErrorCode, InvalidInputError, TensorwireError } from '../src/errors.js';
import { silentLogger } from '../src/logger.js';
import { TcpTransport } from '../src/tcp/transport.js';
import { pattern } from '../src/testing/pattern.js';
import { createTransferBatch, type NodeIdentity } from '../src/transport.js';
import { MAX_SOCKET_PATH_BYTES, UdsTransport, decodeUdsEndpoint, encodeUdsEndpoint, type UdsTransportOptions } from '../src/uds/transport.js';

const cleanups: (() => unknown)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

function privateDir(mode = 0o700): string {
  const d = mkdtempSync(join(tmpdir(), 'tw-uds-test-'));
  chmodSync(d, mode);
  cleanups.push(() => rmSync(d, { recursive: true, force: true }));
  return d;
}

let n = 0;
function identity(): NodeIdentity {
  n++;
  return { nodeId: `u${n}`, incarnation: `inc${n}`, hostId: 'host1' };
}

async function started(options: UdsTransportOptions = {}, id = identity()) {
  const t = new UdsTransport(options);
  cleanups.push(() => t.close());
  await t.start({ identity: id, logger: silentLogger, inbound: () => undefined });
  return { t, id };
}

async function startError(options: UdsTransportOptions): Promise<TensorwireError> {
  const t = new UdsTransport(options);
  cleanups.push(() => t.close());
  const e = await t.start({ identity: identity(), logger: silentLogger, inbound: () => undefined }).then(
    () => undefined,
    (x: unknown) => x,
  );
  expect(e).toBeInstanceOf(TensorwireError);
  return e as TensorwireError;
}

const mode = (p: string): number => lstatSync(p).mode & 0o777;
const ROOT = process.getuid?.() === 0;

describe('uds socket file', () => {
  it('is mode 0600 in a fresh private 0700 directory under the temp dir, and both are gone after close (close is idempotent)', async () => {
    const { t } = await started();
    const path = t.path as string;
    expect(path.startsWith(tmpdir())).toBe(true);
    expect(lstatSync(path).isSocket()).toBe(true);
    expect(mode(path)).toBe(0o600);
    const dir = join(path, '..');
    expect(mode(dir)).toBe(0o700);
    expect(lstatSync(dir).uid).toBe(process.getuid?.());
    await Promise.all([t.close(), t.close()]);
    expect(existsSync(path)).toBe(false);
    expect(existsSync(dir)).toBe(false);
    expect(decodeUdsEndpoint(t.endpoint()).path).toBe(path);
  });

  it('under a configured dir; at a configured path (whose directory is left in place)', async () => {
    const parent = privateDir(0o755);
    const a = await started({ dir: parent });
    expect((a.t.path as string).startsWith(parent)).toBe(true);
    expect(mode(join(a.t.path as string, '..'))).toBe(0o700);
    const dir = privateDir();
    const path = join(dir, 'node.sock');
    const b = await started({ path });
    expect(b.t.path).toBe(path);
    expect(mode(path)).toBe(0o600);
    await a.t.close();
    await b.t.close();
    expect(existsSync(path)).toBe(false);
    expect(existsSync(dir)).toBe(true);
    expect(existsSync(join(a.t.path as string, '..'))).toBe(false);
  });

  it('a second transport on the same path is refused with a clear error; the first keeps serving', async () => {
    const path = join(privateDir(), 's');
    const first = await started({ path });
    const e = await startError({ path });
    expect(e).toBeInstanceOf(InvalidInputError);
    expect(e.message).toBe(`another transport is already listening on ${path}`);
    expect(e.details['reason']).toBe('in-use');
    // Still there, still ours, still answering.
    expect(lstatSync(path).isSocket()).toBe(true);
    const peer = await started();
    const buffer = pattern(4096, 1);
    const reg = await first.t.register({ kind: 'host', buffer });
    const conn = await peer.t.connect(first.id, first.t.endpoint(), { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
    const dst = new Uint8Array(4096);
    const local = await peer.t.register({ kind: 'host', buffer: dst });
    await conn.execute(0, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote: peer.t.decodeRemote(reg.payload, 'host', 4096), remoteOffset: 0, length: 4096 }]), { signal: new AbortController().signal, deadline: Date.now() + 10_000 });
    expect(Buffer.compare(dst, buffer)).toBe(0);
  });

  it('a symbolic link at the path is refused and left alone, whatever it points to', async () => {
    const dir = privateDir();
    const elsewhere = join(privateDir(), 'target');
    writeFileSync(elsewhere, 'keep me');
    const path = join(dir, 's');
    symlinkSync(elsewhere, path);
    const e = await startError({ path });
    expect(e.message).toMatch(/symbolic link/);
    expect(e.details['reason']).toBe('symlink');
    expect(lstatSync(path).isSymbolicLink()).toBe(true);
    expect(readFileSync(elsewhere, 'utf8')).toBe('keep me');
    // A dangling link too.
    const dangling = join(dir, 'd');
    symlinkSync(join(dir, 'nothing'), dangling);
    expect((await startError({ path: dangling })).details['reason']).toBe('symlink');
  });

  it('a non-socket at the path is refused and left alone', async () => {
    const path = join(privateDir(), 's');
    writeFileSync(path, 'data');
    expect((await startError({ path })).details['reason']).toBe('not-socket');
    expect(readFileSync(path, 'utf8')).toBe('data');
  });

  it.skipIf(!ROOT)('a socket or directory owned by another user is refused (needs root to create one)', async () => {
    const dir = privateDir();
    const path = join(dir, 's');
    writeFileSync(path, '');
    chownSync(path, 65534, 65534);
    expect((await startError({ path })).details['reason']).toBe('owner');
    const theirs = join(privateDir(), 'theirs');
    mkdirSync(theirs, { mode: 0o700 });
    chownSync(theirs, 65534, 65534);
    expect((await startError({ path: join(theirs, 's') })).message).toMatch(/owned by uid 65534/);
  });

  it('a socket directory that group or others can enter, or that is a link, is refused', async () => {
    const open = privateDir(0o755);
    expect((await startError({ path: join(open, 's') })).message).toMatch(/mode 755/);
    const real = privateDir();
    const link = join(privateDir(), 'link');
    symlinkSync(real, link);
    expect((await startError({ path: join(link, 's') })).message).toMatch(/symbolic link/);
    expect((await startError({ path: join(privateDir(), 'missing', 's') })).message).toMatch(/ENOENT/);
  });

  it('a stale socket of ours (its listener gone) is replaced', async () => {
    const dir = privateDir();
    const live = join(dir, 'live');
    const path = join(dir, 's');
    const server = net.createServer();
    await new Promise<void>((r) => server.listen({ path: live }, () => r()));
    linkSync(live, path); // a second name for the socket; closing the server unlinks only the first
    await new Promise((r) => server.close(r));
    expect(lstatSync(path).isSocket()).toBe(true);
    const { t } = await started({ path });
    expect(lstatSync(path).ino).not.toBe(undefined);
    expect(mode(path)).toBe(0o600);
    await t.close();
    expect(existsSync(path)).toBe(false);
  });

  it('a path too long for a socket address, or both path and dir, is refused', async () => {
    const dir = privateDir();
    const long = join(dir, 'x'.repeat(MAX_SOCKET_PATH_BYTES));
    expect((await startError({ path: long })).message).toMatch(/exceeds/);
    expect(() => new UdsTransport({ path: join(dir, 's'), dir })).toThrow(InvalidInputError);
  });
});

describe('uds endpoint', () => {
  it('round-trips host id and path; arbitrary or mutated bytes only give InvalidInputError', () => {
    const e = encodeUdsEndpoint('host-1', '/tmp/a/s');
    expect(decodeUdsEndpoint(e)).toEqual({ hostId: 'host-1', path: '/tmp/a/s' });
    fc.assert(
      fc.property(fc.oneof(fc.uint8Array({ maxLength: 300 }), fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 4 }).map((flips) => {
        const b = Buffer.from(e);
        for (const [at, v] of flips) b[at % b.length] = v;
        return new Uint8Array(b);
      })), (blob) => {
        try {
          const d = decodeUdsEndpoint(blob);
          expect(d.path.startsWith('/')).toBe(true);
          expect(d.path.includes('\0')).toBe(false);
          expect(Buffer.byteLength(d.path)).toBeLessThanOrEqual(MAX_SOCKET_PATH_BYTES);
        } catch (x) {
          expect(x).toBeInstanceOf(InvalidInputError);
        }
      }),
      { numRuns: 2000 },
    );
    for (const bad of ['relative/s', '/a\0b', `/${'x'.repeat(MAX_SOCKET_PATH_BYTES)}`]) expect(() => decodeUdsEndpoint(encodeUdsEndpoint('h', bad))).toThrow(InvalidInputError);
    expect(() => decodeUdsEndpoint(encodeUdsEndpoint('bad host', '/s'))).toThrow(InvalidInputError);
  });
});

describe('uds dialer', () => {
  const connect = (t: UdsTransport, peer: NodeIdentity, endpoint: Uint8Array) => t.connect(peer, endpoint, { streams: 1, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
  async function error(p: Promise<unknown>): Promise<TensorwireError> {
    const e = await p.then(
      () => undefined,
      (x: unknown) => x,
    );
    expect(e).toBeInstanceOf(TensorwireError);
    return e as TensorwireError;
  }

  it('refuses an endpoint whose socket is a symbolic link (even to a live peer), or not a socket; a missing socket is a dead peer', async () => {
    const b = await started();
    const a = await started();
    const dir = privateDir();
    const link = join(dir, 'link');
    symlinkSync(b.t.path as string, link);
    const viaLink = await error(connect(a.t, b.id, encodeUdsEndpoint('host1', link)));
    expect(viaLink.code).toBe(ErrorCode.ConnectionBroken);
    expect(viaLink.details['reason']).toBe('symlink');
    const file = join(dir, 'file');
    writeFileSync(file, '');
    expect((await error(connect(a.t, b.id, encodeUdsEndpoint('host1', file)))).details['reason']).toBe('not-socket');
    const gone = await error(connect(a.t, b.id, encodeUdsEndpoint('host1', join(dir, 'nobody'))));
    expect(gone.code).toBe(ErrorCode.ConnectionBroken);
    expect(gone.message).toMatch(/ENOENT/);
    expect(a.t.socketCount).toBe(0);
  });

  it.skipIf(!ROOT)("refuses another user's socket posing as the peer (needs root to create one)", async () => {
    const dir = privateDir();
    const path = join(dir, 's');
    const server = net.createServer((s) => s.destroy());
    await new Promise<void>((r) => server.listen({ path }, () => r()));
    cleanups.push(() => new Promise((r) => server.close(r)));
    chownSync(path, 65534, 65534);
    const a = await started();
    expect((await error(connect(a.t, identity(), encodeUdsEndpoint('host1', path)))).details['reason']).toBe('owner');
  });

  it('an endpoint of another host is unreachable, and refused by connect', async () => {
    const a = await started();
    const other = encodeUdsEndpoint('host2', '/tmp/x/s');
    expect(a.t.unreachableReason({ nodeId: 'p', incarnation: 'i', hostId: 'host2' }, other)).toMatch(/host host2/);
    expect(a.t.unreachableReason({ nodeId: 'p', incarnation: 'i', hostId: 'host1' }, encodeUdsEndpoint('host1', '/tmp/x/s'))).toBeUndefined();
    expect(a.t.unreachableReason({ nodeId: 'p', incarnation: 'i', hostId: 'host1' }, new Uint8Array(3))).toMatch(/not a uds endpoint/);
    expect((await error(connect(a.t, { nodeId: 'p', incarnation: 'i', hostId: 'host2' }, other))).code).toBe(ErrorCode.InvalidInput);
  });
});

describe('uds capabilities and selection', () => {
  it('local only, host memory, range grants, ranked above TCP', () => {
    const c = new UdsTransport().capabilities;
    expect(c).toMatchObject({ local: true, remote: false, memoryKinds: ['host'], oneSidedRead: true, oneSidedWrite: true, scopedGrants: true });
    expect(c.rank).toBeGreaterThan(new TcpTransport().capabilities.rank);
    expect(typeof new UdsTransport().grant).toBe('function');
  });

  it('an engine with TCP and UDS chooses UDS for a peer on the same host, and TCP for one on another host', async () => {
    const engines: TransferEngine[] = [];
    cleanups.push(() => Promise.allSettled(engines.map((e) => e.close())));
    const make = async (nodeId: string, hostId: string) => {
      const e = new TransferEngine({ nodeId, hostId, transports: [new TcpTransport(), new UdsTransport()], logger: silentLogger });
      await e.start();
      engines.push(e);
      return e;
    };
    const a = await make('sel-a', 'hostA');
    const same = await make('sel-b', 'hostA');
    const far = await make('sel-c', 'hostB');
    expect(a.explain(same.endpoint()).chosen).toBe('uds');
    expect(a.explain(far.endpoint()).chosen).toBe('tcp');
    const buffer = pattern(64 * 1024, 3);
    const reg = await same.register({ kind: 'host', buffer });
    const dst = new Uint8Array(64 * 1024);
    const report = await a.read(same.endpoint(), [{ local: await a.register({ kind: 'host', buffer: dst }), remote: reg.descriptor }]);
    expect(report.transport).toBe('uds');
    expect(Buffer.compare(dst, buffer)).toBe(0);
  });
});
