/**
 * The TCP transport: one-sided READ and WRITE against memory the other side registered,
 * over the kit's vectored protocol (kit/frames.ts, HELLO magic `TWH2`, see frames.ts) on
 * `node:net`. Everything but the medium is the kit's ({@link StreamTransport}): the handshake
 * with its expected-peer check, connections of N sockets grouped by connection id (both sides
 * can issue requests on every socket, so simultaneous open is a real case the engine settles),
 * the token table of registrations and range grants with O(1) range checks and revocation that
 * waits for the sockets still using the memory, frames cached per batch object with only their
 * request ids patched, scatter receive straight into destinations, the responder's bounded
 * request queue, retire, and quiesce on abort or deadline (invariant 6). See kit/*.ts.
 *
 * What is TCP's: where to listen ({@link TcpTransportOptions.host}, `port`), what address peers
 * are told to dial ({@link TcpTransportOptions.advertiseHost}; a wildcard listen advertises
 * 127.0.0.1), sockets with `noDelay` and keep-alive, and the endpoint blob:
 * `TWT\x01` | str8 host | u16 port.
 *
 * TCP itself proves no identity: run it on a trusted network, as with NIXL's or UCX's TCP paths.
 */
import net from 'node:net';
import { ByteReader, ByteWriter } from '../codec.js';
import { InvalidInputError } from '../errors.js';
import { StreamTransport, type DialTarget, type Listener, type StreamTransportOptions } from '../kit/transport.js';
import type { NodeIdentity } from '../transport.js';

export { KitConnection as TcpConnection } from '../kit/connection.js';

export interface TcpTransportOptions extends StreamTransportOptions {
  /** Address to listen on. Default 127.0.0.1. */
  host?: string;
  /** Port to listen on. Default 0 (any free port). */
  port?: number;
  /** Address peers should dial, when it differs from `host` (e.g. listening on 0.0.0.0). */
  advertiseHost?: string;
}

const ENDPOINT_MAGIC = [0x54, 0x57, 0x54, 0x01]; // TWT v1
/** Destination ranges with at least this much still to come are received straight into their memory. */
export const DIRECT_MIN_BYTES = 64 * 1024;
/**
 * Reply and WRITEV data ranges of at least this size are handed to the socket as they are (the
 * kernel copies them once, straight from the registered memory); smaller ones are coalesced into
 * one send buffer. Measured on loopback with ranges scattered over 64 MiB: from about 1 KiB up,
 * one copy by the kernel beats a user-space gather copy plus the kernel's copy of that.
 */
export const ZERO_COPY_MIN_BYTES = 1024;
/** A stream batch is cut into frames of at most this much data (a larger single range is a frame of its own). */
export const FRAME_TARGET_BYTES = 1024 * 1024;

const SOCKET_OPTIONS = { noDelay: true, keepAlive: true, keepAliveInitialDelay: 10_000 } as const;

/** The TCP endpoint blob: where to dial. */
export function encodeTcpEndpoint(host: string, port: number): Uint8Array {
  const w = new ByteWriter(32);
  for (const m of ENDPOINT_MAGIC) w.u8(m);
  return w.str8(host).u16(port).finish();
}

export function decodeTcpEndpoint(blob: Uint8Array): { host: string; port: number } {
  const r = new ByteReader(blob, 'tcp endpoint');
  for (const m of ENDPOINT_MAGIC) if (r.u8('magic') !== m) throw new InvalidInputError('not a tcp endpoint (bad magic or version)', { details: { field: 'magic' } });
  const host = r.str8('host');
  const port = r.u16('port');
  r.end();
  if (host.length === 0 || net.isIP(host) === 0 && !/^[A-Za-z0-9.-]{1,253}$/.test(host)) {
    throw new InvalidInputError(`tcp endpoint host ${JSON.stringify(host)} is not an address or host name`, { details: { field: 'host' } });
  }
  if (port === 0) throw new InvalidInputError('tcp endpoint port is 0', { details: { field: 'port' } });
  return { host, port };
}

export class TcpTransport extends StreamTransport {
  readonly #host: string;
  readonly #port: number;
  readonly #advertiseHost: string | undefined;
  #listening = 0;

  constructor(options: TcpTransportOptions = {}) {
    super(
      {
        name: 'tcp',
        magic: 'TWH2',
        local: true,
        remote: true,
        rank: 10,
        maxStreams: 64,
        tuning: { directMinBytes: DIRECT_MIN_BYTES, zeroCopyMinBytes: ZERO_COPY_MIN_BYTES, frameTargetBytes: FRAME_TARGET_BYTES },
      },
      options,
    );
    const port = options.port ?? 0;
    if (!Number.isInteger(port) || port < 0 || port > 65535) throw new InvalidInputError(`port ${port} is out of range`, { details: { field: 'port' } });
    this.#host = options.host ?? '127.0.0.1';
    this.#port = port;
    this.#advertiseHost = options.advertiseHost;
  }

  /** The port actually listened on (0 before start). */
  get port(): number {
    return this.#listening;
  }

  /** @internal for leak tests: live range grants over a registration handle. */
  rangeGrantsOver(handle: object): number {
    return this.grants.grantsOver(handle);
  }

  protected async listen(accept: (socket: net.Socket) => void): Promise<Listener> {
    const server = net.createServer(SOCKET_OPTIONS, accept);
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen({ host: this.#host, port: this.#port }, () => {
        server.off('error', reject);
        resolve();
      });
    }).catch((e: unknown) => {
      const err = e as NodeJS.ErrnoException;
      throw new InvalidInputError(`tcp transport cannot listen on ${this.#host}:${this.#port}: ${err.code ?? err.message}`, { cause: e });
    });
    const addr = server.address() as net.AddressInfo;
    const advertise = this.#advertiseHost ?? (addr.address === '0.0.0.0' || addr.address === '::' ? '127.0.0.1' : addr.address);
    const endpoint = encodeTcpEndpoint(advertise, addr.port);
    this.#listening = addr.port;
    return { server, endpoint };
  }

  protected dialTarget(endpoint: Uint8Array): DialTarget {
    const { host, port } = decodeTcpEndpoint(endpoint);
    return { options: { host, port, ...SOCKET_OPTIONS }, label: `${host}:${port}` };
  }

  unreachableReason(_peer: NodeIdentity, endpoint: Uint8Array): string | undefined {
    try {
      decodeTcpEndpoint(endpoint);
      return undefined;
    } catch (e) {
      return e instanceof Error ? e.message : String(e);
    }
  }
}
