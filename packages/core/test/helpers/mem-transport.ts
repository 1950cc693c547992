/**
 * An in-process test double for engine unit tests: "remote" memory is another engine's
 * buffer in this process. It is not a device and is never reported as one; it exists to
 * observe what the engine hands a transport (chunks, streams, retries) and to inject errors.
 */
import { randomBytes } from 'node:crypto';
import {
  TRANSPORT_SPECIFICATION_VERSION,
  type ConnectOptions,
  type ExecuteOptions,
  type Memory,
  type NodeIdentity,
  type TensorwireError,
  type TransferBatch,
  type GrantRanges,
  GRANT_STRIDE,
  GrantField,
  RemoteRejectedError,
  RANGE_STRIDE,
  RangeField,
  type Transport,
  type TransportCapabilities,
  type TransportConnection,
  type TransportHost,
} from '../../src/index.js';

/** A range grant in the test world: its ranges as views of the granted memory. */
interface MemGrant {
  readonly views: Uint8Array[];
}
const world = new Map<string, Uint8Array | MemGrant>(); // token hex -> memory or grant

export interface MemTransportOptions {
  name?: string;
  rank?: number;
  local?: boolean;
  remote?: boolean;
  maxChunkBytes?: number;
  /** Called before each execute; may throw to inject an error. */
  beforeExecute?: (stream: number, batch: TransferBatch) => void;
  unreachable?: string;
  /** connect() never settles (a black-holed peer whose transport ignores the signal). */
  connectHangs?: boolean;
}

export class MemTransport implements Transport {
  readonly specificationVersion = TRANSPORT_SPECIFICATION_VERSION;
  readonly name: string;
  readonly capabilities: TransportCapabilities;
  readonly executed: { stream: number; lengths: number[]; batch: TransferBatch }[] = [];
  readonly connections: MemConnection[] = [];
  host: TransportHost | undefined;
  readonly #opts: MemTransportOptions;
  constructor(opts: MemTransportOptions = {}) {
    this.#opts = opts;
    this.name = opts.name ?? 'mem';
    this.capabilities = {
      local: opts.local ?? true,
      remote: opts.remote ?? true,
      memoryKinds: ['host'],
      oneSidedRead: true,
      oneSidedWrite: true,
      scopedGrants: true,
      rank: opts.rank ?? 5,
      maxStreams: 8,
      maxChunkBytes: opts.maxChunkBytes ?? 1 << 30,
    };
  }
  async start(host: TransportHost): Promise<void> {
    this.host = host;
  }
  endpoint(): Uint8Array {
    return new TextEncoder().encode(this.name);
  }
  unreachableReason(_peer: NodeIdentity, _endpoint: Uint8Array): string | undefined {
    return this.#opts.unreachable;
  }
  async register(memory: Memory): Promise<{ handle: object; payload: Uint8Array }> {
    if (memory.kind !== 'host') throw new Error('host only');
    const token = randomBytes(8);
    world.set(token.toString('hex'), memory.buffer);
    return { handle: { token: token.toString('hex'), buffer: memory.buffer }, payload: token };
  }
  async revoke(handle: object): Promise<void> {
    world.delete((handle as { token: string }).token);
  }
  grants = 0;
  grant(ranges: GrantRanges): { handle: object; payload: Uint8Array } {
    const token = randomBytes(8);
    const views: Uint8Array[] = [];
    for (let k = 0; k < ranges.count; k++) {
      const at = k * GRANT_STRIDE;
      const buffer = (ranges.handles[ranges.ranges[at + GrantField.Handle] as number] as { buffer: Uint8Array }).buffer;
      const off = ranges.ranges[at + GrantField.Offset] as number;
      views.push(buffer.subarray(off, off + (ranges.ranges[at + GrantField.Length] as number)));
    }
    world.set(token.toString('hex'), { views });
    this.grants++;
    return { handle: { token: token.toString('hex') }, payload: token };
  }
  async revokeGrant(handle: object): Promise<void> {
    this.grants--;
    world.delete((handle as { token: string }).token);
  }
  decodeRemote(payload: Uint8Array): unknown {
    return Buffer.from(payload).toString('hex');
  }
  connectCalls = 0;
  async connect(peer: NodeIdentity, _endpoint: Uint8Array, options: ConnectOptions): Promise<TransportConnection> {
    this.connectCalls++;
    if (this.#opts.connectHangs) return new Promise<TransportConnection>(() => undefined);
    const c = new MemConnection(this, peer, this.host?.identity.nodeId ?? '?', options.streams, this.#opts.beforeExecute);
    this.connections.push(c);
    return c;
  }
  async close(): Promise<void> {
    for (const c of this.connections) await c.close();
  }
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

/** A MemTransport that remembers the GrantRanges the engine handed it last. */
export class SpyTransport extends MemTransport {
  last: GrantRanges | undefined;
  override grant(spec: GrantRanges): { handle: object; payload: Uint8Array } {
    this.last = spec;
    return super.grant(spec);
  }
}

export class MemConnection implements TransportConnection {
  readonly transport: string;
  readonly peer: NodeIdentity;
  readonly initiator: string;
  readonly streams: number;
  isOpen = true;
  closedWith: TensorwireError | undefined;
  readonly #owner: MemTransport;
  readonly #hook: MemTransportOptions['beforeExecute'];
  readonly #closeListeners: ((e: TensorwireError | undefined) => void)[] = [];
  constructor(owner: MemTransport, peer: NodeIdentity, initiator: string, streams: number, hook: MemTransportOptions['beforeExecute']) {
    this.#owner = owner;
    this.transport = owner.name;
    this.peer = peer;
    this.initiator = initiator;
    this.streams = streams;
    this.#hook = hook;
  }
  async execute(stream: number, batch: TransferBatch, options: ExecuteOptions): Promise<void> {
    if (options.signal.aborted) throw options.signal.reason;
    this.#hook?.(stream, batch);
    const lengths: number[] = [];
    for (let i = 0; i < batch.count; i++) lengths.push(batch.ranges[i * RANGE_STRIDE + RangeField.Length] as number);
    this.#owner.executed.push({ stream, lengths, batch });
    for (let i = 0; i < batch.count; i++) {
      const at = i * RANGE_STRIDE;
      const entry = world.get(batch.remotes[batch.ranges[at + RangeField.Remote] as number] as string);
      if (!entry) throw new RemoteRejectedError('unknown grant', { details: { remoteCode: 'UNKNOWN_GRANT', request: batch.ranges[at + RangeField.Request] } });
      const remote = entry instanceof Uint8Array ? entry : (entry.views[batch.ranges[at + RangeField.RemoteRange] as number] as Uint8Array);
      const local = (batch.locals[batch.ranges[at + RangeField.Local] as number] as { buffer: Uint8Array }).buffer;
      const lo = batch.ranges[at + RangeField.LocalOffset] as number;
      const ro = batch.ranges[at + RangeField.RemoteOffset] as number;
      const n = batch.ranges[at + RangeField.Length] as number;
      if (batch.op === 'read') local.set(remote.subarray(ro, ro + n), lo);
      else remote.set(local.subarray(lo, lo + n), ro);
    }
  }
  onClose(listener: (error: TensorwireError | undefined) => void): void {
    this.#closeListeners.push(listener);
  }
  onRetire(): void {}
  async retire(): Promise<void> {
    await this.close();
  }
  async close(error?: TensorwireError): Promise<void> {
    if (!this.isOpen) return;
    this.isOpen = false;
    this.closedWith = error;
    for (const l of this.#closeListeners.splice(0)) l(error);
  }
}
