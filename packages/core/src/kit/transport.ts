/**
 * `StreamTransport`: the v2 transport on byte streams, all of it but the medium. A subclass says
 * how to listen (a `net.Server` and the endpoint blob peers dial) and how to dial an endpoint
 * (`net.connect` options); everything else is here: the handshake (handshake.ts) with its
 * expected-peer check and timeouts on both sides, connections of N streams grouped by connection
 * id (connection.ts), simultaneous-open support, the grant table (grants.ts), the vectored
 * frames and scatter receive (frames.ts, stream.ts), close and quiesce.
 *
 * Outbound sockets receive with `onread` (straight into destinations, see stream.ts); accepted
 * sockets in copy mode. Accepted sockets must finish their handshake within
 * `handshakeTimeoutMs`, and every stream of a connection must arrive within it; at most
 * `maxPendingConnections` connections may be half-way there (more are refused with `BUSY`).
 *
 * Bounds on what peers can make this side hold (invariant 16), all options below:
 * - inbound connections: at most `maxConnections` in all (established, mid-handshake, and each
 *   accepted socket that has not sent its HELLO yet counts as one) and `maxConnectionsPerPeer`
 *   per node id; past either a new one is refused with `BUSY`, and established ones are untouched;
 * - per peer (node id, summed over all its streams and connections, see {@link PeerLedger}):
 *   requests and replies queued while the sockets are above the high-water mark, and the
 *   memory allocated for its replies until written; a peer past the queue bound has the
 *   offending connection closed;
 * - idle connections are retired after `idleTimeoutMs` (see connection.ts).
 * Each such event is logged (warn; idle retirements at info) and counted in
 * `tensorwire_transport_peer_events_total{transport,event}`.
 */
import { randomBytes } from 'node:crypto';
import net from 'node:net';
import { toHex } from '../codec.js';
import {
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  TimedOutError,
  type TensorwireError,
  errorFromSignal,
  toTensorwireError,
} from '../errors.js';
import type { Logger } from '../logger.js';
import type { MetricsOptions } from '../metrics.js';
import {
  TRANSPORT_SPECIFICATION_VERSION,
  type ConnectOptions,
  type GrantRanges,
  type Memory,
  type MemoryKind,
  type NodeIdentity,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
  type TransportRegistration,
} from '../transport.js';
import { KitConnection, type ConnectionHost } from './connection.js';
import { FrameParser, FrameType, decodeError, encodeError } from './frames.js';
import { GrantTable } from './grants.js';
import { PeerEvents, kitMetrics, type KitMetrics, type PeerEventText } from './peer-events.js';
import { CONNECTION_ID_BYTES, HandshakeCodec, RefusalCode, ackProblem, helloRefusal, type Hello, type HelloAck } from './handshake.js';
import { DEFAULT_TUNING, FramedStream, PeerLedger, SendBufferPool, type PeerEvent, type StreamContext, type StreamTuning } from './stream.js';

export interface StreamTransportOptions {
  /** Largest chunk accepted on the wire, and the most data one frame may carry. Default 16 MiB. */
  maxChunkBytes?: number;
  /**
   * The responder queues a stream's requests while more than this many bytes wait to be sent on
   * its socket, or while more than this many bytes allocated for one peer's replies (copies of
   * small ranges, headers, per-buffer bookkeeping; all its streams together) are not yet
   * written. Default 8 MiB.
   */
  sendHighWaterMark?: number;
  /** Most requests and replies one peer (all its streams and connections) may have waiting in the responder's queues; past it the connection is closed. Default 65,536. */
  maxQueuedRequests?: number;
  /** Most bytes of them (request heads plus bookkeeping) one peer may have waiting. Default 64 MiB. */
  maxQueuedRequestBytes?: number;
  /** Both sides of a handshake must finish within this; so must every stream of a connection. Default 10 s. */
  handshakeTimeoutMs?: number;
  /** How long a retiring connection may go without progress before it is closed abortively. Default 10 s. */
  retireTimeoutMs?: number;
  /** How long a revocation lets streams still using the memory finish before closing them. Default 2 s. */
  revokeGraceMs?: number;
  /** Connections whose streams have not all finished their handshakes, at most. Default 256. */
  maxPendingConnections?: number;
  /** Inbound connections at most, established or handshaking (an accepted socket before its HELLO counts as one). Default 1024. */
  maxConnections?: number;
  /** Inbound connections from one node id at most, established or handshaking. Default 8. */
  maxConnectionsPerPeer?: number;
  /** A connection with no traffic and nothing in flight for this long is retired with GOAWAY (the peer reconnects when it needs to). Default 300 s. */
  idleTimeoutMs?: number;
  /** Where to count peer events (`tensorwire_transport_peer_events_total`), or false. Default: a private Registry (`transport.metrics.registry`). */
  metrics?: MetricsOptions | false;
}

/** How each peer event is logged (after the transport's name). */
const PEER_EVENT_TEXT: Record<PeerEvent, PeerEventText> = {
  request_queue: { level: 'warn', text: 'peer disconnected: request queue over its bound' },
  protocol_violation: { level: 'warn', text: 'peer disconnected: protocol violation' },
  connections: { level: 'warn', text: 'connection refused: too many inbound connections' },
  peer_connections: { level: 'warn', text: 'connection refused: too many inbound connections from this peer' },
  pending_handshakes: { level: 'warn', text: 'connection refused: too many connections half-way through their handshakes' },
  handshake_timeout: { level: 'warn', text: 'connection closed: handshake not finished in time' },
  idle: { level: 'info', text: 'idle connection retired' },
};

/** What a subclass fixes about itself. */
export interface StreamTransportProfile {
  /** Transport name (lowercase): tags descriptors, endpoints, messages. */
  readonly name: string;
  /** 4 ASCII characters that open every HELLO (see handshake.ts). */
  readonly magic: string;
  readonly local: boolean;
  readonly remote: boolean;
  readonly rank: number;
  /** Most streams per connection (at most 255: the HELLO's stream count is a u8). */
  readonly maxStreams: number;
  /** A same-host transport: both sides also check the peer's host id. */
  readonly sameHost?: boolean;
  /** Overrides of the stream tuning (defaults: the TCP transport's). */
  readonly tuning?: Partial<StreamTuning>;
}

/** Where {@link StreamTransport.dialTarget} says to connect. */
export interface DialTarget {
  /** `net.connect` options without `onread` (the kit adds it): `{ host, port, noDelay }`, `{ path }`… */
  readonly options: net.TcpNetConnectOpts | net.IpcNetConnectOpts;
  /** For messages: `host:port`, a path. */
  readonly label: string;
}

/** A listener started by {@link StreamTransport.listen}. */
export interface Listener {
  readonly server: net.Server;
  readonly endpoint: Uint8Array;
}

interface PendingGroup {
  readonly conn: KitConnection;
  arrived: number;
  readonly timer: NodeJS.Timeout;
}

/** Entries kept in {@link StreamTransport.peerEventCounts}. */
export type PeerEventCounts = Record<PeerEvent, number>;

function positiveInt(name: string, v: number): number {
  if (!Number.isSafeInteger(v) || v < 1 || v > 0x7fffffff) throw new InvalidInputError(`${name} must be an integer from 1 to 2^31-1, got ${v}`, { details: { field: name } });
  return v;
}

export abstract class StreamTransport implements Transport, StreamContext, ConnectionHost {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name: string;
  readonly capabilities: TransportCapabilities;
  readonly maxChunkBytes: number;
  readonly sendHighWaterMark: number;
  readonly maxQueuedRequests: number;
  readonly maxQueuedRequestBytes: number;
  readonly handshakeTimeoutMs: number;
  readonly retireTimeoutMs: number;
  readonly revokeGraceMs: number;
  readonly maxPendingConnections: number;
  readonly maxConnections: number;
  readonly maxConnectionsPerPeer: number;
  readonly idleTimeoutMs: number;
  readonly metrics: KitMetrics | undefined;
  readonly tuning: StreamTuning;
  readonly grants: GrantTable;
  readonly sendBuffers: SendBufferPool;
  readonly handshake: HandshakeCodec;
  readonly #profile: StreamTransportProfile;
  readonly #connections = new Set<KitConnection>();
  readonly #pendingInbound = new Map<string, PendingGroup>();
  readonly #sockets = new Set<net.Socket>();
  readonly #ledgers = new Map<string, PeerLedger>();
  /** Inbound connections not yet closed (handshaking groups and established ones). */
  #inbound = 0;
  /** Accepted sockets that have not joined a connection yet (no accepted HELLO). */
  #handshaking = 0;
  /** Counted, logged at most once a second per kind, and counted in {@link KitMetrics}. */
  readonly #peerEvents: PeerEvents<PeerEvent>;
  #server: net.Server | undefined;
  #host: TransportHost | undefined;
  #endpoint: Uint8Array | undefined;
  #closed: Promise<void> | undefined;

  constructor(profile: StreamTransportProfile, options: StreamTransportOptions = {}) {
    const maxChunkBytes = options.maxChunkBytes ?? 16 * 1024 * 1024;
    if (!Number.isSafeInteger(maxChunkBytes) || maxChunkBytes < 1 || maxChunkBytes > 0x7fffffff) {
      throw new InvalidInputError(`maxChunkBytes must be 1..2^31-1, got ${maxChunkBytes}`, { details: { field: 'maxChunkBytes' } });
    }
    if (!Number.isInteger(profile.maxStreams) || profile.maxStreams < 1 || profile.maxStreams > 255) {
      throw new InvalidInputError(`maxStreams must be 1..255, got ${profile.maxStreams}`, { details: { field: 'maxStreams' } });
    }
    this.#profile = profile;
    this.name = profile.name;
    this.handshake = new HandshakeCodec(profile.magic);
    this.maxChunkBytes = maxChunkBytes;
    this.sendHighWaterMark = positiveInt('sendHighWaterMark', options.sendHighWaterMark ?? 8 * 1024 * 1024);
    this.maxQueuedRequests = positiveInt('maxQueuedRequests', options.maxQueuedRequests ?? 65_536);
    this.maxQueuedRequestBytes = positiveInt('maxQueuedRequestBytes', options.maxQueuedRequestBytes ?? 64 * 1024 * 1024);
    this.handshakeTimeoutMs = positiveInt('handshakeTimeoutMs', options.handshakeTimeoutMs ?? 10_000);
    this.retireTimeoutMs = positiveInt('retireTimeoutMs', options.retireTimeoutMs ?? 10_000);
    this.revokeGraceMs = positiveInt('revokeGraceMs', options.revokeGraceMs ?? 2_000);
    this.maxPendingConnections = positiveInt('maxPendingConnections', options.maxPendingConnections ?? 256);
    this.maxConnections = positiveInt('maxConnections', options.maxConnections ?? 1024);
    this.maxConnectionsPerPeer = positiveInt('maxConnectionsPerPeer', options.maxConnectionsPerPeer ?? 8);
    this.idleTimeoutMs = positiveInt('idleTimeoutMs', options.idleTimeoutMs ?? 300_000);
    this.metrics = kitMetrics(options.metrics);
    const texts = {} as Record<PeerEvent, PeerEventText>;
    for (const [k, { level, text }] of Object.entries(PEER_EVENT_TEXT)) texts[k as PeerEvent] = { level, text: `${profile.name} ${text}` };
    this.#peerEvents = new PeerEvents({ transport: profile.name, texts, counter: this.metrics?.peerEvents });
    this.tuning = Object.freeze({ ...DEFAULT_TUNING, ...profile.tuning });
    this.grants = new GrantTable({ transport: profile.name, revokeGraceMs: this.revokeGraceMs });
    this.sendBuffers = new SendBufferPool(this.tuning.frameTargetBytes);
    this.capabilities = Object.freeze({
      local: profile.local,
      remote: profile.remote,
      memoryKinds: Object.freeze(['host'] as MemoryKind[]),
      oneSidedRead: true,
      oneSidedWrite: true,
      cpuBypass: false,
      scopedGrants: true,
      rank: profile.rank,
      maxStreams: profile.maxStreams,
      maxChunkBytes,
    });
  }

  // --- what a subclass provides ------------------------------------------------------------

  /** Create a server whose connections go to `accept`, listen, and say what peers dial. Throws a TensorwireError. */
  protected abstract listen(accept: (socket: net.Socket) => void): Promise<Listener>;
  /** Decode an endpoint and say where to connect. Throws InvalidInputError (malformed) or another TensorwireError (refused). */
  protected abstract dialTarget(endpoint: Uint8Array): DialTarget | Promise<DialTarget>;
  abstract unreachableReason(peer: NodeIdentity, endpoint: Uint8Array): string | undefined;
  /** After the server and every socket closed (e.g. remove files). */
  protected async afterClose(): Promise<void> {}

  // --- state -------------------------------------------------------------------------------

  /** The engine's logger, once started. */
  get logger(): Logger | undefined {
    return this.#host?.logger;
  }

  /** This node, once started. */
  protected get identity(): NodeIdentity | undefined {
    return this.#host?.identity;
  }

  get isClosed(): boolean {
    return this.#closed !== undefined;
  }

  /** Open sockets (for leak tests and diagnostics). */
  get socketCount(): number {
    return this.#sockets.size;
  }

  get connectionCount(): number {
    return this.#connections.size;
  }

  /** Entries in the grant table: live registrations plus live range grants (one each, whatever its size). */
  get grantCount(): number {
    return this.grants.size;
  }

  get rangeGrantCount(): number {
    return this.grants.rangeGrantCount;
  }

  /** Inbound connections not yet closed (established or handshaking), plus accepted sockets before their HELLO. */
  get inboundCount(): number {
    return this.#inbound + this.#handshaking;
  }

  /** How often each peer event happened (also counted in {@link KitMetrics}). */
  get peerEventCounts(): Readonly<PeerEventCounts> {
    return this.#peerEvents.counts();
  }

  /** What a peer holds in the responder now (undefined: no connection with it). For diagnostics and tests. */
  peerUsage(nodeId: string): { readonly inbound: number; readonly connections: number; readonly queuedRequests: number; readonly queuedBytes: number; readonly sendBytes: number } | undefined {
    const l = this.#ledgers.get(nodeId);
    return l && { inbound: l.inbound, connections: l.refs, queuedRequests: l.queuedRequests, queuedBytes: l.queuedBytes, sendBytes: l.sendBytes };
  }

  ledgerFor(nodeId: string): PeerLedger {
    let l = this.#ledgers.get(nodeId);
    if (!l) {
      l = new PeerLedger(nodeId, this.sendHighWaterMark);
      this.#ledgers.set(nodeId, l);
    }
    l.refs++;
    return l;
  }

  peerEvent(event: PeerEvent, peer: string | undefined, message: string): void {
    // A flood of refusals is counted in full but logged at most once a second per kind.
    this.#peerEvents.record(event, peer, message, this.logger);
  }

  forget(conn: KitConnection): void {
    this.#connections.delete(conn);
    const l = conn.ledger;
    if (--l.refs <= 0 && this.#ledgers.get(l.nodeId) === l) this.#ledgers.delete(l.nodeId);
  }

  // --- Transport ---------------------------------------------------------------------------

  async start(host: TransportHost): Promise<void> {
    if (this.#closed) throw new ClosedError(`${this.name} transport is closed`);
    if (this.#host) throw new InvalidInputError(`${this.name} transport already started`);
    this.#host = host;
    try {
      const l = await this.listen((socket) => this.#accept(socket));
      this.#server = l.server;
      this.#endpoint = l.endpoint;
    } catch (e) {
      this.#host = undefined;
      throw toTensorwireError(e, InvalidInputError);
    }
    this.#server.on('error', (e) => this.logger?.error(`${this.name} listener error`, { error: e.message }));
  }

  endpoint(): Uint8Array {
    if (!this.#endpoint) throw new ClosedError(`${this.name} transport not started`);
    return this.#endpoint;
  }

  async register(memory: Memory): Promise<TransportRegistration> {
    if (this.#closed) throw new ClosedError(`${this.name} transport is closed`);
    return this.grants.register(memory);
  }

  /** Revoke a registration and its grants; resolves once no stream still uses its memory (see {@link StreamTransportOptions.revokeGraceMs}). */
  revoke(handle: object): Promise<void> {
    return this.grants.revoke(handle);
  }

  grant(spec: GrantRanges): TransportRegistration {
    if (this.#closed) throw new ClosedError(`${this.name} transport is closed`);
    return this.grants.grant(spec);
  }

  revokeGrant(handle: object): Promise<void> {
    return this.grants.revokeGrant(handle);
  }

  decodeRemote(payload: Uint8Array, memoryKind: MemoryKind, byteLength: number, rangeLengths?: Float64Array): unknown {
    return this.grants.decodeRemote(payload, memoryKind, byteLength, rangeLengths);
  }

  #track(socket: net.Socket): void {
    this.#sockets.add(socket);
    socket.once('close', () => this.#sockets.delete(socket));
  }

  async connect(peer: NodeIdentity, endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    if (this.#closed || !this.#host) throw new ClosedError(`${this.name} transport is closed or not started`);
    const me = this.#host.identity;
    const signal = options.signal;
    if (signal.aborted) throw errorFromSignal(signal, `connect to ${peer.nodeId}`);
    const target = await this.dialTarget(endpoint);
    const streams = Math.max(1, Math.min(options.streams, this.capabilities.maxStreams));
    const connectionId = randomBytes(CONNECTION_ID_BYTES);
    const conn = new KitConnection(this, peer, me.nodeId, streams, this.maxChunkBytes);
    const opened: FramedStream[] = [];
    const onAbort = (): void => {
      for (const s of opened) s.socket.destroy();
    };
    signal.addEventListener('abort', onAbort, { once: true });
    try {
      await Promise.all(
        Array.from({ length: streams }, async (_, index) => {
          const stream = await this.#dial(target, opened, signal);
          conn.addStream(stream, index);
          const ack = await this.#dialHandshake(stream, target.label, signal, {
            connectionId,
            streamIndex: index,
            streamCount: streams,
            nodeId: me.nodeId,
            incarnation: me.incarnation,
            hostId: me.hostId,
            expectedNodeId: peer.nodeId,
            expectedIncarnation: peer.incarnation,
            maxChunkBytes: this.maxChunkBytes,
          });
          conn.maxChunkBytes = Math.min(conn.maxChunkBytes, ack.maxChunkBytes);
          const problem = ackProblem(ack, peer, { hostId: this.#profile.sameHost === true });
          if (problem !== undefined) throw new ConnectionBrokenError(`${target.label}: ${problem}`, { details: { remoteCode: RefusalCode.WrongPeer } });
        }),
      );
    } catch (e) {
      for (const s of opened) s.socket.destroy();
      await Promise.all(opened.map((s) => s.closed));
      const err = signal.aborted ? errorFromSignal(signal, `connect to ${peer.nodeId}`) : toTensorwireError(e);
      await conn.close(err); // releases its ledger even when no stream got as far as joining it
      throw err;
    } finally {
      signal.removeEventListener('abort', onAbort);
    }
    this.#connections.add(conn);
    if (this.#closed) {
      await conn.close(new ClosedError(`${this.name} transport closed`));
      throw new ClosedError(`${this.name} transport closed`);
    }
    conn.startIdleTimer();
    return conn;
  }

  #dial(target: DialTarget, opened: FramedStream[], signal: AbortSignal): Promise<FramedStream> {
    return new Promise<FramedStream>((resolve, reject) => {
      if (signal.aborted) {
        reject(errorFromSignal(signal, `connect to ${target.label}`));
        return;
      }
      const ref: { stream?: FramedStream } = {};
      // The parser exists before the socket: Node asks for the first receive buffer inside net.connect().
      const parser = new FrameParser(undefined, this.maxChunkBytes, { handshaking: true });
      const staging = Buffer.allocUnsafe(this.tuning.stagingBytes);
      const socket = net.connect({
        ...target.options,
        onread: {
          // Receive straight into whatever the parser needs next (for READV_DATA: the destination).
          buffer: () => ref.stream?.nextReadBuffer() ?? staging,
          callback: (n: number) => {
            ref.stream?.onRead(n);
            return true;
          },
        },
      } as net.NetConnectOpts);
      this.#track(socket);
      const stream = new FramedStream(socket, this, { parser, staging });
      ref.stream = stream;
      opened.push(stream);
      const onError = (e: Error): void => reject(new ConnectionBrokenError(`cannot connect to ${target.label}: ${(e as NodeJS.ErrnoException).code ?? e.message}`, { cause: e }));
      // A socket destroyed while still connecting (abort, deadline) emits no 'error': settle on 'close' too.
      const onClose = (): void => reject(new ConnectionBrokenError(`connection to ${target.label} closed before it was established`));
      socket.once('error', onError);
      socket.once('close', onClose);
      socket.once('connect', () => {
        socket.off('error', onError);
        socket.off('close', onClose);
        resolve(stream);
      });
    });
  }

  /** Send HELLO, await HELLO_ACK (or the acceptor's refusal), bounded by the signal and handshakeTimeoutMs. */
  #dialHandshake(stream: FramedStream, label: string, signal: AbortSignal, hello: Hello): Promise<HelloAck> {
    return new Promise((resolve, reject) => {
      const fail = (e: TensorwireError): void => {
        cleanup();
        reject(e);
        stream.socket.destroy();
      };
      const onClose = (): void => fail(new ConnectionBrokenError(`${label} closed the connection during the handshake`));
      const onAbort = (): void => fail(errorFromSignal(signal, 'handshake'));
      const timer = setTimeout(() => fail(new TimedOutError(`${label} did not answer the handshake within ${this.handshakeTimeoutMs} ms`)), this.handshakeTimeoutMs);
      const cleanup = (): void => {
        clearTimeout(timer);
        stream.onHandshakeFrame = undefined;
        stream.socket.off('close', onClose);
        signal.removeEventListener('abort', onAbort);
      };
      stream.socket.once('close', onClose);
      signal.addEventListener('abort', onAbort, { once: true });
      stream.onHandshakeFrame = (type, body) => {
        try {
          if (type === FrameType.HelloAck) {
            const ack = this.handshake.decodeHelloAck(body);
            cleanup();
            // Frames may follow the ACK in the same read (a GOAWAY when the peer settled a
            // simultaneous open the other way, or its first requests): live from the next frame on.
            stream.establish();
            resolve(ack);
          } else if (type === FrameType.Error) {
            const info = decodeError(body);
            fail(new RemoteRejectedError(`${label} refused the connection: ${info.message}`, { details: { remoteCode: info.code } }));
          } else {
            fail(new ConnectionBrokenError(`unexpected frame 0x${type.toString(16)} during the handshake`));
          }
        } catch (e) {
          fail(toTensorwireError(e, ConnectionBrokenError));
        }
      };
      stream.send([this.handshake.encodeHello(hello)]);
    });
  }

  #accept(socket: net.Socket): void {
    this.#track(socket);
    if (this.#closed || !this.#host) {
      socket.destroy();
      return;
    }
    const me = this.#host.identity;
    if (this.#inbound + this.#handshaking >= this.maxConnections) {
      // Refused before it costs anything but the socket: no parser, no timers but the linger.
      const message = `${this.maxConnections} inbound connections are open or opening`;
      this.peerEvent('connections', undefined, message);
      socket.on('error', () => undefined);
      socket.end(encodeError(0, RefusalCode.Busy, message));
      const linger = setTimeout(() => socket.destroy(), 1000);
      socket.once('close', () => clearTimeout(linger));
      return;
    }
    this.#handshaking++;
    let handshaking = true;
    const joined = (): void => {
      if (handshaking) this.#handshaking--;
      handshaking = false;
    };
    const stream = new FramedStream(socket, this);
    const timer = setTimeout(() => {
      this.peerEvent('handshake_timeout', undefined, `no HELLO within ${this.handshakeTimeoutMs} ms`);
      socket.destroy();
    }, this.handshakeTimeoutMs);
    let lingering: NodeJS.Timeout | undefined;
    socket.once('close', () => {
      joined();
      clearTimeout(timer);
      clearTimeout(lingering);
    });
    const refuse = (code: RefusalCode, message: string, event?: PeerEvent, peer?: string): void => {
      if (event) this.peerEvent(event, peer, message);
      else this.logger?.warn(`${this.name} handshake refused`, { code, message });
      clearTimeout(timer);
      stream.onHandshakeFrame = () => undefined; // one refusal; anything after it is ignored
      socket.end(encodeError(0, code, message));
      lingering = setTimeout(() => socket.destroy(), 1000);
    };
    stream.onHandshakeFrame = (type, body) => {
      if (type !== FrameType.Hello) {
        refuse(RefusalCode.BadHandshake, `expected HELLO, got frame 0x${type.toString(16)}`);
        return;
      }
      let hello: Hello;
      try {
        hello = this.handshake.decodeHello(body);
      } catch (e) {
        refuse(RefusalCode.BadHandshake, e instanceof Error ? e.message : String(e));
        return;
      }
      const refusal = helloRefusal(hello, me, this.capabilities.maxStreams);
      if (refusal) {
        refuse(refusal.code, refusal.message);
        return;
      }
      if (this.#profile.sameHost === true && hello.hostId !== me.hostId) {
        refuse(RefusalCode.BadHandshake, `${this.name} serves this host only; HELLO came from host ${hello.hostId}`);
        return;
      }
      const key = toHex(hello.connectionId);
      let group = this.#pendingInbound.get(key);
      if (!group) {
        if (this.#pendingInbound.size >= this.maxPendingConnections) {
          refuse(RefusalCode.Busy, `${this.maxPendingConnections} connections are already half-way through their handshakes`, 'pending_handshakes', hello.nodeId);
          return;
        }
        if ((this.#ledgers.get(hello.nodeId)?.inbound ?? 0) >= this.maxConnectionsPerPeer) {
          refuse(RefusalCode.Busy, `${hello.nodeId} already has ${this.maxConnectionsPerPeer} inbound connections open or opening`, 'peer_connections', hello.nodeId);
          return;
        }
        const peer: NodeIdentity = { nodeId: hello.nodeId, incarnation: hello.incarnation, hostId: hello.hostId };
        const conn = new KitConnection(this, peer, hello.nodeId, hello.streamCount, Math.min(this.maxChunkBytes, hello.maxChunkBytes));
        // Counted until it closes, whether it finishes its handshake or not.
        this.#inbound++;
        conn.ledger.inbound++;
        conn.onClose(() => {
          this.#inbound--;
          conn.ledger.inbound--;
        });
        const gtimer = setTimeout(() => {
          this.#pendingInbound.delete(key);
          void conn.close(new ConnectionBrokenError('peer did not open all streams of its connection in time'));
        }, this.handshakeTimeoutMs);
        const g: PendingGroup = { conn, arrived: 0, timer: gtimer };
        this.#pendingInbound.set(key, g);
        // A stream of it failed before the rest arrived: the group goes with its connection.
        conn.onClose(() => {
          clearTimeout(g.timer);
          if (this.#pendingInbound.get(key) === g) this.#pendingInbound.delete(key);
        });
        group = g;
      }
      const conn = group.conn;
      const p = conn.peer;
      if (!conn.isOpen || hello.streamCount !== conn.streams || conn.stream(hello.streamIndex) !== undefined || hello.nodeId !== p.nodeId || hello.incarnation !== p.incarnation || hello.hostId !== p.hostId) {
        refuse(RefusalCode.BadHandshake, 'stream does not match its connection');
        return;
      }
      clearTimeout(timer);
      joined();
      conn.addStream(stream, hello.streamIndex);
      stream.establish();
      stream.send([this.handshake.encodeHelloAck({ nodeId: me.nodeId, incarnation: me.incarnation, hostId: me.hostId, maxChunkBytes: this.maxChunkBytes })]);
      group.arrived++;
      if (group.arrived === conn.streams) {
        clearTimeout(group.timer);
        this.#pendingInbound.delete(key);
        this.#connections.add(conn);
        conn.startIdleTimer();
        this.#host?.inbound(conn);
      }
    };
    stream.attachCopyReader();
  }

  close(): Promise<void> {
    this.#closed ??= this.#close();
    return this.#closed;
  }

  async #close(): Promise<void> {
    const server = this.#server;
    for (const g of this.#pendingInbound.values()) clearTimeout(g.timer);
    const conns = [...this.#connections, ...[...this.#pendingInbound.values()].map((g) => g.conn)];
    this.#pendingInbound.clear();
    await Promise.allSettled(conns.map((c) => c.close(new ClosedError(`${this.name} transport closed`))));
    for (const s of this.#sockets) s.destroy();
    if (server) await new Promise<void>((resolve) => server.close(() => resolve()));
    this.grants.close();
    await this.afterClose();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}
