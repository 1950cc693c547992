/**
 * The Unix-domain-socket transport: one-sided READ and WRITE of host memory between processes
 * on one host, over the kit's vectored protocol (kit/frames.ts) on `AF_UNIX` stream sockets.
 * Everything but the medium is the kit's ({@link StreamTransport}): handshake and expected-peer
 * check, streams grouped into connections, retire, grants, scatter receive, quiesce.
 *
 * The socket file:
 * - lives in a private directory: by default one the transport creates (mode 0700, random name)
 *   under the OS temporary directory or {@link UdsTransportOptions.dir}, removed on close; or at
 *   {@link UdsTransportOptions.path}, whose directory must already be a real directory owned by
 *   this user with no access for group or others;
 * - is made mode 0600 once bound, so only this user (and root) can connect;
 * - is refused when something else is at its path: a symbolic link, a file of another user, a
 *   non-socket, or a socket another transport listens on (a stale socket of ours, whose listener
 *   is gone, is replaced);
 * - is unlinked on close (and at process exit, when the process exits normally).
 *
 * A dialer refuses an endpoint whose socket is a symbolic link, not a socket, or not owned by
 * this user, and one published for another host. The handshake names the exact peer (node and
 * incarnation) and its host on both sides. Endpoint blob: `TWU\x01` | str8 host id | u16 length |
 * UTF-8 absolute path.
 */
import { lstatSync, rmdirSync, unlinkSync } from 'node:fs';
import { chmod, lstat, mkdtemp, rmdir, unlink } from 'node:fs/promises';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, isAbsolute, join, resolve } from 'node:path';
import { ByteReader, ByteWriter } from '../codec.js';
import { BackendUnavailableError, ConnectionBrokenError, InvalidInputError } from '../errors.js';
import { isToken } from '../ids.js';
import type { NodeIdentity } from '../transport.js';
import { StreamTransport, type DialTarget, type Listener, type StreamTransportOptions } from '../kit/transport.js';

export interface UdsTransportOptions extends StreamTransportOptions {
  /** Where the transport creates its private directory (mode 0700) for the socket. Default: the OS temporary directory. */
  dir?: string;
  /**
   * The exact socket path instead. Its directory must exist and be a real directory owned by this
   * user with no permissions for group or others; it is left in place on close.
   */
  path?: string;
}

const ENDPOINT_MAGIC = [0x54, 0x57, 0x55, 0x01]; // TWU v1
/** `sun_path` holds 108 bytes on Linux (104 on macOS), including the terminating NUL. */
export const MAX_SOCKET_PATH_BYTES = process.platform === 'darwin' ? 103 : 107;

function pathProblem(path: string): string | undefined {
  if (!isAbsolute(path)) return `socket path ${JSON.stringify(path)} is not absolute`;
  if (path.includes('\0')) return 'socket path contains a NUL byte';
  const bytes = Buffer.byteLength(path, 'utf8');
  if (bytes > MAX_SOCKET_PATH_BYTES) return `socket path of ${bytes} bytes exceeds the ${MAX_SOCKET_PATH_BYTES} a Unix socket address holds`;
  return undefined;
}

export function encodeUdsEndpoint(hostId: string, path: string): Uint8Array {
  const p = Buffer.from(path, 'utf8');
  return new ByteWriter(8 + hostId.length + p.length).bytes(Uint8Array.from(ENDPOINT_MAGIC)).str8(hostId).blob16(p).finish();
}

export function decodeUdsEndpoint(blob: Uint8Array): { hostId: string; path: string } {
  const r = new ByteReader(blob, 'uds endpoint');
  for (const m of ENDPOINT_MAGIC) if (r.u8('magic') !== m) throw new InvalidInputError('not a uds endpoint (bad magic or version)', { details: { field: 'magic' } });
  const hostId = r.str8('host id');
  let path: string;
  try {
    path = new TextDecoder('utf-8', { fatal: true }).decode(r.blob16('path'));
  } catch (e) {
    throw e instanceof InvalidInputError ? e : new InvalidInputError('uds endpoint path is not UTF-8', { cause: e, details: { field: 'path' } });
  }
  r.end();
  if (!isToken(hostId)) throw new InvalidInputError('uds endpoint host id is malformed', { details: { field: 'hostId' } });
  const problem = pathProblem(path);
  if (problem !== undefined) throw new InvalidInputError(`uds endpoint: ${problem}`, { details: { field: 'path' } });
  return { hostId, path };
}

function uid(): number {
  const u = process.getuid?.();
  if (u === undefined) throw new BackendUnavailableError('uds transport needs POSIX file ownership (not available on this platform)');
  return u;
}

function code(e: unknown): string {
  return (e as NodeJS.ErrnoException)?.code ?? (e instanceof Error ? e.message : String(e));
}

/** A real directory (not a link) of this user that group and others cannot enter. */
async function checkPrivateDir(dir: string): Promise<void> {
  let st;
  try {
    st = await lstat(dir);
  } catch (e) {
    throw new InvalidInputError(`uds socket directory ${dir}: ${code(e)}`, { cause: e, details: { field: 'path' } });
  }
  const why = st.isSymbolicLink() ? 'is a symbolic link' : !st.isDirectory() ? 'is not a directory' : st.uid !== uid() ? `is owned by uid ${st.uid}, not this user` : (st.mode & 0o077) !== 0 ? `has mode ${(st.mode & 0o777).toString(8)}: group or others have access (needs 0700)` : undefined;
  if (why) throw new InvalidInputError(`uds socket directory ${dir} ${why}`, { details: { field: 'path' } });
}

/** Whether a listener answers at `path`. */
function probe(path: string): Promise<'live' | 'stale'> {
  return new Promise((resolve, reject) => {
    const s = net.connect({ path });
    s.once('connect', () => {
      s.destroy();
      resolve('live');
    });
    s.once('error', (e: NodeJS.ErrnoException) => (e.code === 'ECONNREFUSED' || e.code === 'ENOENT' ? resolve('stale') : reject(e)));
  });
}

/** Make `path` free to bind: nothing there, or a stale socket of ours (removed). Refuses anything else. */
async function claim(path: string): Promise<void> {
  let st;
  try {
    st = await lstat(path);
  } catch (e) {
    if (code(e) === 'ENOENT') return;
    throw new InvalidInputError(`uds socket path ${path}: ${code(e)}`, { cause: e, details: { field: 'path' } });
  }
  if (st.isSymbolicLink()) throw new InvalidInputError(`uds socket path ${path} is a symbolic link; refusing to use it`, { details: { field: 'path', reason: 'symlink' } });
  if (st.uid !== uid()) throw new InvalidInputError(`uds socket path ${path} is owned by uid ${st.uid}, not this user; refusing to use it`, { details: { field: 'path', reason: 'owner' } });
  if (!st.isSocket()) throw new InvalidInputError(`uds socket path ${path} exists and is not a socket`, { details: { field: 'path', reason: 'not-socket' } });
  if ((await probe(path)) === 'live') throw new InvalidInputError(`another transport is already listening on ${path}`, { details: { field: 'path', reason: 'in-use' } });
  // Stale: its listener is gone. Remove it only if it is still the file we probed.
  const now = await lstat(path).catch(() => undefined);
  if (now && now.ino === st.ino && now.dev === st.dev) await unlink(path).catch(() => undefined);
}

/** Socket files (and directories we made) still to remove if the process exits without closing. */
const atExit = new Map<string, { dev: number; ino: number; dir: string | undefined }>();
let exitHook = false;
function removeAtExit(path: string, id: { dev: number; ino: number; dir: string | undefined }): void {
  atExit.set(path, id);
  if (exitHook) return;
  exitHook = true;
  process.once('exit', () => {
    for (const [p, f] of atExit) {
      try {
        const st = lstatSync(p);
        if (st.ino === f.ino && st.dev === f.dev) unlinkSync(p);
      } catch {
        // already gone
      }
      try {
        if (f.dir) rmdirSync(f.dir);
      } catch {
        // already gone, or not empty: not ours to empty
      }
    }
  });
}

export class UdsTransport extends StreamTransport {
  readonly #options: UdsTransportOptions;
  #path: string | undefined;
  #dir: string | undefined;
  #file: { dev: number; ino: number } | undefined;

  constructor(options: UdsTransportOptions = {}) {
    super({ name: 'uds', magic: 'TWU2', local: true, remote: false, rank: 20, maxStreams: 64, sameHost: true }, options);
    if (options.path !== undefined && options.dir !== undefined) throw new InvalidInputError('give uds either path or dir, not both', { details: { field: 'path' } });
    this.#options = options;
  }

  /** The socket file's path, once started. */
  get path(): string | undefined {
    return this.#path;
  }

  protected async listen(accept: (socket: net.Socket) => void): Promise<Listener> {
    const me = this.identity as NodeIdentity;
    const owner = uid();
    let path: string;
    if (this.#options.path !== undefined) {
      path = resolve(this.#options.path);
      await checkPrivateDir(dirname(path));
    } else {
      const parent = resolve(this.#options.dir ?? tmpdir());
      try {
        this.#dir = await mkdtemp(join(parent, 'tensorwire-uds-')); // mode 0700, a fresh name
      } catch (e) {
        throw new InvalidInputError(`uds cannot create its socket directory in ${parent}: ${code(e)}`, { cause: e, details: { field: 'dir' } });
      }
      await checkPrivateDir(this.#dir);
      path = join(this.#dir, 's');
    }
    const problem = pathProblem(path);
    try {
      if (problem !== undefined) throw new InvalidInputError(`uds: ${problem}`, { details: { field: 'path' } });
      await claim(path);
      const server = net.createServer(accept);
      await new Promise<void>((ok, fail) => {
        server.once('error', fail);
        server.listen({ path, exclusive: true }, () => {
          server.off('error', fail);
          ok();
        });
      }).catch((e: unknown) => {
        const c = code(e);
        throw new InvalidInputError(c === 'EADDRINUSE' ? `another transport is already listening on ${path}` : `uds cannot listen on ${path}: ${c}`, { cause: e, details: { field: 'path', reason: c === 'EADDRINUSE' ? 'in-use' : c } });
      });
      this.#path = path;
      await chmod(path, 0o600);
      const st = await lstat(path);
      if (!st.isSocket() || st.uid !== owner) throw new InvalidInputError(`uds socket ${path} changed under us after bind`, { details: { field: 'path' } });
      this.#file = { dev: st.dev, ino: st.ino };
      removeAtExit(path, { ...this.#file, dir: this.#dir });
      return { server, endpoint: encodeUdsEndpoint(me.hostId, path) };
    } catch (e) {
      await this.afterClose();
      throw e;
    }
  }

  protected async dialTarget(endpoint: Uint8Array): Promise<DialTarget> {
    const { hostId, path } = decodeUdsEndpoint(endpoint);
    const me = this.identity;
    if (me && hostId !== me.hostId) throw new InvalidInputError(`uds endpoint ${path} is on host ${hostId}, this is host ${me.hostId}`, { details: { field: 'hostId' } });
    let st;
    try {
      st = await lstat(path);
    } catch (e) {
      throw new ConnectionBrokenError(`cannot connect to ${path}: ${code(e)}`, { cause: e });
    }
    // Only a socket of this user: never a link, never someone else's listener posing as the peer.
    if (st.isSymbolicLink()) throw new ConnectionBrokenError(`refusing to connect to ${path}: it is a symbolic link`, { details: { reason: 'symlink' } });
    if (!st.isSocket()) throw new ConnectionBrokenError(`refusing to connect to ${path}: it is not a socket`, { details: { reason: 'not-socket' } });
    if (st.uid !== uid()) throw new ConnectionBrokenError(`refusing to connect to ${path}: owned by uid ${st.uid}, not this user`, { details: { reason: 'owner' } });
    return { options: { path }, label: path };
  }

  unreachableReason(peer: NodeIdentity, endpoint: Uint8Array): string | undefined {
    let hostId: string;
    try {
      hostId = decodeUdsEndpoint(endpoint).hostId;
    } catch (e) {
      return e instanceof Error ? e.message : String(e);
    }
    const me = this.identity;
    if (me && hostId !== me.hostId) return `the socket is on host ${hostId}, this is host ${me.hostId}`;
    if (hostId !== peer.hostId) return `the endpoint is on host ${hostId}, the peer on ${peer.hostId}`;
    return undefined;
  }

  /** The server is closed (libuv unlinked its socket); remove what is left of ours. */
  protected override async afterClose(): Promise<void> {
    const path = this.#path;
    if (path !== undefined) {
      const st = await lstat(path).catch(() => undefined);
      if (st && this.#file && st.ino === this.#file.ino && st.dev === this.#file.dev) await unlink(path).catch(() => undefined);
      atExit.delete(path);
    }
    if (this.#dir !== undefined) await rmdir(this.#dir).catch(() => undefined);
  }
}
