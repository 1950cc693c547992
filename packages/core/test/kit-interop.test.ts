/**
 * The kit speaks the TCP transport's protocol: a TCP transport written on the kit in a few lines
 * (what moving TCP onto the kit would look like; not shipped) interoperates with the shipped
 * TcpTransport in both directions, range grants included, and passes the conformance suite.
 */
import net from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { StreamTransport, type DialTarget, type Listener } from '../src/kit/transport.js';
import { silentLogger } from '../src/logger.js';
import { TcpTransport, decodeTcpEndpoint, encodeTcpEndpoint } from '../src/tcp/transport.js';
import { describeTransportConformance } from '../src/testing/index.js';
import { pattern } from '../src/testing/pattern.js';
import { GRANT_STRIDE, createTransferBatch, type NodeIdentity, type Transport } from '../src/transport.js';

class KitTcpTransport extends StreamTransport {
  constructor(name = 'tcp') {
    super({ name, magic: 'TWH2', local: true, remote: true, rank: 10, maxStreams: 64 });
  }
  protected async listen(accept: (socket: net.Socket) => void): Promise<Listener> {
    const server = net.createServer({ noDelay: true, keepAlive: true, keepAliveInitialDelay: 10_000 }, accept);
    await new Promise<void>((ok, fail) => {
      server.once('error', fail);
      server.listen({ host: '127.0.0.1', port: 0 }, () => ok());
    });
    return { server, endpoint: encodeTcpEndpoint('127.0.0.1', (server.address() as net.AddressInfo).port) };
  }
  protected dialTarget(endpoint: Uint8Array): DialTarget {
    const { host, port } = decodeTcpEndpoint(endpoint);
    return { options: { host, port, noDelay: true, keepAlive: true, keepAliveInitialDelay: 10_000 }, label: `${host}:${port}` };
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

const closers: Transport[] = [];
afterEach(async () => {
  await Promise.allSettled(closers.splice(0).map((t) => t.close()));
});

let n = 0;
async function start(t: Transport): Promise<NodeIdentity> {
  const id = { nodeId: `i${++n}`, incarnation: `inc${n}`, hostId: 'host1' };
  await t.start({ identity: id, logger: silentLogger, inbound: () => undefined });
  closers.push(t);
  return id;
}

describe('kit on TCP interoperates with the shipped TCP transport', () => {
  for (const [dialer, acceptor] of [
    ['kit', 'tcp'],
    ['tcp', 'kit'],
  ] as const) {
    it(`${dialer} dials ${acceptor}: batched reads and writes of registrations and range grants land exactly`, async () => {
      const a = dialer === 'kit' ? new KitTcpTransport() : new TcpTransport();
      const b = acceptor === 'kit' ? new KitTcpTransport() : new TcpTransport();
      await start(a);
      const bid = await start(b);
      const conn = await a.connect(bid, b.endpoint(), { streams: 2, signal: new AbortController().signal, deadline: Date.now() + 10_000 });
      const size = 1 << 20;
      const held = pattern(size, 3);
      const reg = await b.register({ kind: 'host', buffer: held });
      const granted = new Float64Array(2 * GRANT_STRIDE);
      granted.set([0, 4096, 8192, 0, 65536, 100_000]);
      const g = await (b.grant as NonNullable<Transport['grant']>)({ handles: [reg.handle], count: 2, ranges: granted, bytes: 108_192 });
      const whole = a.decodeRemote(reg.payload, 'host', size);
      const viaGrant = a.decodeRemote(g.payload, 'host', 108_192, Float64Array.of(8192, 100_000));
      const dst = new Uint8Array(size);
      const local = await a.register({ kind: 'host', buffer: dst });
      const opts = () => ({ signal: new AbortController().signal, deadline: Date.now() + 10_000 });
      // 256 scattered 4 KiB ranges, then both granted ranges by index.
      await conn.execute(0, createTransferBatch('read', Array.from({ length: 256 }, (_, i) => ({ local: local.handle, localOffset: i * 4096, remote: whole, remoteOffset: ((i * 37) % 256) * 4096, length: 4096 }))), opts());
      for (let i = 0; i < 256; i++) expect(Buffer.compare(dst.subarray(i * 4096, (i + 1) * 4096), held.subarray(((i * 37) % 256) * 4096, ((i * 37) % 256) * 4096 + 4096))).toBe(0);
      await conn.execute(1, createTransferBatch('read', [
        { local: local.handle, localOffset: 0, remote: viaGrant, remoteOffset: 0, length: 8192, remoteRange: 0 },
        { local: local.handle, localOffset: 8192, remote: viaGrant, remoteOffset: 0, length: 100_000, remoteRange: 1 },
      ]), opts());
      expect(Buffer.compare(dst.subarray(0, 8192), held.subarray(4096, 12288))).toBe(0);
      expect(Buffer.compare(dst.subarray(8192, 108_192), held.subarray(65536, 165_536))).toBe(0);
      // A write back, and a refusal named by range index.
      const src = pattern(4096, 9);
      const sl = await a.register({ kind: 'host', buffer: src });
      await conn.execute(0, createTransferBatch('write', [{ local: sl.handle, localOffset: 0, remote: whole, remoteOffset: size - 4096, length: 4096 }]), opts());
      expect(Buffer.compare(held.subarray(size - 4096), src)).toBe(0);
      await (b.revokeGrant as NonNullable<Transport['revokeGrant']>)(g.handle);
      const refused = await conn.execute(0, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote: viaGrant, remoteOffset: 0, length: 16, remoteRange: 0 }]), opts()).then(
        () => undefined,
        (e: unknown) => e as { details: Record<string, unknown> },
      );
      expect(refused?.details['remoteCode']).toBe('REVOKED');
      await conn.retire();
    });
  }
});

describeTransportConformance({
  name: 'kit-tcp (sketch)',
  createTransport: () => new KitTcpTransport('kit-tcp'),
  socketAddress: {
    decode: (endpoint) => decodeTcpEndpoint(endpoint),
    encode: (address) => {
      if (!('host' in address)) throw new Error('a tcp endpoint names a host and port');
      return encodeTcpEndpoint(address.host, address.port);
    },
  },
});
