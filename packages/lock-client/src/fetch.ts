/**
 * The remote fetch flow as one call: lease, read through the engine, verify, release.
 *
 * `await using fetch = await client.fetch(engine, holder, blockIds, destinations, options)`
 * acquires a lease on the holder's blocks, reads every block (one batch, through the
 * transport the engine chooses for the holder) into its destination, checks that every
 * granted range has the length the caller expects, and returns a guard. The lease is
 * released exactly once: when the guard is disposed or released, or at once when anything
 * fails (the error is then rethrown). Disposal does not wait for the holder's answer to the
 * release (release never blocks a fetch); `release()` does. The holder must serve leases with
 * `engineGrants` (`@tensorwire/lock-client/server`).
 */
import {
  InvalidInputError,
  Registration,
  RemoteRejectedError,
  decodeDescriptor,
  type MemoryDescriptor,
  type TransferEngine,
  type TransferReport,
} from '@tensorwire/core';
import type { AcquireOptions, LockGuard, ReleaseResult } from './client.js';
import { decodeFetchDescriptor } from './fetch-descriptor.js';
import type { NumberedBlocks } from './ids.js';

/** Where one block lands: a registration of the requester's engine, at `offset`. */
export interface FetchDestination {
  readonly local: Registration;
  /** Default 0. */
  readonly offset?: number;
  /** The block's expected length; the fetch fails if the holder's range differs. Default: whatever the holder granted. */
  readonly length?: number;
}

export interface FetchOptions extends AcquireOptions {
  /** Absolute deadline (Date.now() ms) for acquire + read; the lease's transfer deadline also bounds the read. */
  readonly deadline?: number;
}

/** A finished fetch: the bytes are in place; the lease is held until this is disposed. */
export class FetchGuard implements AsyncDisposable {
  /** The lease the blocks were read under. */
  readonly lease: LockGuard;
  /** What the engine reported: transport, bytes, requests, ranges. */
  readonly report: TransferReport;
  /** @internal */
  constructor(lease: LockGuard, report: TransferReport) {
    this.lease = lease;
    this.report = report;
  }
  get transport(): string {
    return this.report.transport;
  }
  /**
   * Release the lease (idempotent, never rejects): resolves with the holder's answer. Every
   * later call, disposal included, returns the same release.
   */
  release(): Promise<ReleaseResult> {
    return this.lease.release();
  }
  /**
   * Starts the release and returns without waiting for the holder's answer: the bytes are in
   * place already, so a fetch does not pay a second round trip. The client's release queue
   * sends it, retries it and reports a failure (`releaseFailed`, `release_failures_total`);
   * `client.close()` waits for it; `await fetch.release()` waits for the answer when needed.
   */
  [Symbol.asyncDispose](): Promise<void> {
    void this.lease.release();
    return Promise.resolve();
  }
}

/** A request of a reused list: `range` is its index, the rest is rewritten per fetch. */
type MutableRequest = { local: Registration; localOffset: number; remote: MemoryDescriptor; readonly range: number; length: number };

/** Per destinations array: its request list, and whether a read is using it now. */
const requestLists = new WeakMap<readonly FetchDestination[], { readonly requests: MutableRequest[]; busy: boolean }>();

/** Options of {@link LockClient.fetchLease}: the deadline and signal of the read (the lease's transfer deadline and signal bound it too). */
export interface FetchLeaseOptions {
  /** Absolute deadline (Date.now() ms) for the read; the lease's transfer deadline also bounds it. */
  readonly deadline?: number;
  readonly signal?: AbortSignal;
}

/** The block count of `blocks` as an acquire takes them (the blocks themselves are the acquire's to check). */
function blockCount(blocks: readonly string[] | NumberedBlocks): number {
  return Array.isArray(blocks) ? blocks.length : (blocks as Partial<NumberedBlocks> | null)?.numbers instanceof Uint32Array ? (blocks as NumberedBlocks).numbers.length : 0;
}

/** One destination per block, each with a registration: InvalidInputError otherwise. */
function checkDestinations(destinations: readonly FetchDestination[], count: number): void {
  if (!Array.isArray(destinations) || destinations.length !== count) {
    throw new InvalidInputError(`fetch needs one destination per block (${count} blocks, ${Array.isArray(destinations) ? destinations.length : 0} destinations)`, {
      details: { field: 'destinations' },
    });
  }
  for (let i = 0; i < count; i++) {
    const d = destinations[i];
    if (!(d?.local instanceof Registration)) throw new InvalidInputError(`destinations[${i}].local must be a Registration of the engine`, { details: { field: 'destinations', request: i } });
  }
}

/** @internal The body of {@link LockClient.fetch}, given its acquire. */
export async function fetchBlocks(
  acquire: (holder: string, blocks: readonly string[] | NumberedBlocks, options: AcquireOptions) => Promise<LockGuard>,
  engine: TransferEngine,
  holder: string,
  blocks: readonly string[] | NumberedBlocks,
  destinations: readonly FetchDestination[],
  options: FetchOptions,
): Promise<FetchGuard> {
  checkDestinations(destinations, blockCount(blocks));
  const { deadline, ...acquireOptions } = options;
  const timeoutMs = deadline === undefined ? options.timeoutMs : Math.max(1, Math.min(options.timeoutMs ?? Number.POSITIVE_INFINITY, deadline - Date.now()));
  const lease = await acquire(holder, blocks, timeoutMs === undefined ? acquireOptions : { ...acquireOptions, timeoutMs });
  return readLease(engine, lease, destinations, options);
}

/**
 * @internal The body of {@link LockClient.fetchLease}: `lease` (held, this client's) is
 * checked against `destinations`; from here on every failure releases it before rethrowing,
 * and the guard returned owns it. `yieldFirst`: give the event loop one turn before the read
 * (writes of this client still queued in HTTP/2, such as the acquire of a pipelined next
 * fetch, go out before a same-host read holds the thread).
 */
export async function fetchLeased(engine: TransferEngine, lease: LockGuard, destinations: readonly FetchDestination[], options: FetchLeaseOptions, yieldFirst: boolean): Promise<FetchGuard> {
  try {
    checkDestinations(destinations, lease.blockCount);
    if (yieldFirst) await new Promise<void>((resolve) => setImmediate(resolve));
  } catch (e) {
    await lease.release();
    throw e;
  }
  return readLease(engine, lease, destinations, options);
}

/** Read the blocks of `lease` into `destinations` (checked already); releases the lease on any failure. */
async function readLease(engine: TransferEngine, lease: LockGuard, destinations: readonly FetchDestination[], options: FetchLeaseOptions): Promise<FetchGuard> {
  const count = lease.blockCount;
  const deadline = options.deadline;
  try {
    const leaseDescriptors = lease.leaseDescriptors;
    if (leaseDescriptors.length !== 1) {
      throw new RemoteRejectedError(`holder ${lease.holderId} granted ${leaseDescriptors.length} lease descriptors, expected one range grant (serve leases with engineGrants)`, {
        details: { remoteCode: 'no-grant' },
      });
    }
    let endpoint: Uint8Array;
    let d: MemoryDescriptor;
    try {
      const f = decodeFetchDescriptor(leaseDescriptors[0] as Uint8Array);
      endpoint = f.endpoint;
      d = decodeDescriptor(f.grant);
    } catch (e) {
      throw new RemoteRejectedError(`holder ${lease.holderId} sent a lease descriptor that does not decode: ${e instanceof Error ? e.message : String(e)}`, {
        cause: e,
        details: { remoteCode: 'bad-descriptor' },
      });
    }
    const lengths = d.rangeLengths ?? Float64Array.of(d.byteLength);
    if (lengths.length !== count) {
      throw new RemoteRejectedError(`holder ${lease.holderId} granted ${lengths.length} ranges for ${count} blocks`, { details: { remoteCode: 'grant-shape' } });
    }
    // The request list of the last fetch into these destinations, rewritten in place when no
    // read is using it (a KV fetch loop passes the same destinations every time): no object
    // per block per fetch.
    let reuse = requestLists.get(destinations);
    if (reuse === undefined || reuse.busy || reuse.requests.length !== count) {
      reuse = { requests: new Array<MutableRequest>(count), busy: false };
      requestLists.set(destinations, reuse);
    }
    const requests = reuse.requests;
    for (let i = 0; i < count; i++) {
      const dest = destinations[i] as FetchDestination;
      const granted = lengths[i] as number;
      if (dest.length !== undefined && dest.length !== granted) {
        throw new InvalidInputError(`block ${lease.blockIds[i] as string} is ${granted} bytes on the holder, the destination expects ${dest.length}`, { details: { field: 'destinations', request: i } });
      }
      const q = requests[i];
      if (q === undefined) requests[i] = { local: dest.local, localOffset: dest.offset ?? 0, remote: d, range: i, length: granted };
      else {
        q.local = dest.local;
        q.localOffset = dest.offset ?? 0;
        q.remote = d;
        q.length = granted;
      }
    }
    const until = deadline === undefined ? lease.transferDeadline : Math.min(deadline, lease.transferDeadline);
    const signal = options.signal ? AbortSignal.any([options.signal, lease.signal]) : lease.signal;
    reuse.busy = true;
    try {
      const report = await engine.read(endpoint, requests, { deadline: until, signal });
      return new FetchGuard(lease, report);
    } finally {
      reuse.busy = false;
    }
  } catch (e) {
    await lease.release();
    throw e;
  }
}
