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
  type TransferRequest,
} from '@tensorwire/core';
import type { AcquireOptions, LockGuard, ReleaseResult } from './client.js';
import { decodeFetchDescriptor } from './fetch-descriptor.js';
import { joinSignals, type JoinedSignal } from './signals.js';
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

/** A request of a reused list: `range` is its index; `length` is the destination's expected length, or {@link ANY_LENGTH}, until the grant fills it in. */
type MutableRequest = { local: Registration; localOffset: number; remote: MemoryDescriptor | undefined; readonly range: number; length: number };

/** A request list, laid out from one destinations array; busy while a fetch is using it. */
interface RequestList {
  readonly requests: MutableRequest[];
  busy: boolean;
}

/** What `length` holds for a destination that takes whatever the holder granted. */
const ANY_LENGTH = -1;

/** Per destinations array: its request list, rewritten in place by the next fetch that finds it free. */
const requestLists = new WeakMap<readonly FetchDestination[], RequestList>();

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

/** One destination per block: InvalidInputError otherwise (each entry is checked by {@link layOut}). */
function checkCount(destinations: readonly FetchDestination[], count: number): void {
  if (!Array.isArray(destinations) || destinations.length !== count) {
    throw new InvalidInputError(`fetch needs one destination per block (${count} blocks, ${Array.isArray(destinations) ? destinations.length : 0} destinations)`, {
      details: { field: 'destinations' },
    });
  }
}

/**
 * The request list of `destinations` (checked by {@link checkCount}), marked busy: every
 * destination checked (a registration) and written into its request, all but what the grant
 * gives. A KV fetch loop passes the same destinations every time: their list is rewritten in
 * place, no object per block per fetch. InvalidInputError (the list not taken) for a bad entry.
 */
function layOut(destinations: readonly FetchDestination[], count: number): RequestList {
  let list = requestLists.get(destinations);
  if (list === undefined || list.busy || list.requests.length !== count) {
    list = { requests: new Array<MutableRequest>(count), busy: false };
    requestLists.set(destinations, list);
  }
  const requests = list.requests;
  for (let i = 0; i < count; i++) {
    const dest = destinations[i];
    const local = dest?.local;
    if (!(local instanceof Registration)) throw new InvalidInputError(`destinations[${i}].local must be a Registration of the engine`, { details: { field: 'destinations', request: i } });
    const localOffset = (dest as FetchDestination).offset ?? 0;
    const length = (dest as FetchDestination).length ?? ANY_LENGTH;
    const q = requests[i];
    if (q === undefined) requests[i] = { local, localOffset, remote: undefined, range: i, length };
    else {
      q.local = local;
      q.localOffset = localOffset;
      q.length = length;
    }
  }
  list.busy = true;
  return list;
}

/** @internal The body of {@link LockClient.fetch}, given its acquire. */
export async function fetchBlocks(
  acquire: (holder: string, blocks: readonly string[] | NumberedBlocks, options: AcquireOptions) => Promise<LockGuard>,
  engine: TransferEngine,
  holder: string,
  blocks: readonly string[] | NumberedBlocks,
  destinations: readonly FetchDestination[],
  options: FetchOptions,
  closing: AbortSignal,
): Promise<FetchGuard> {
  const count = blockCount(blocks);
  checkCount(destinations, count);
  const { deadline, ...acquireOptions } = options;
  const timeoutMs = deadline === undefined ? options.timeoutMs : Math.max(1, Math.min(options.timeoutMs ?? Number.POSITIVE_INFINITY, deadline - Date.now()));
  // The acquire leaves now; the destinations are checked and laid out while the holder grants
  // (that work is off the fetch's path). A bad destination fails the fetch once the lease is
  // in hand, and releases it.
  const acquiring = acquire(holder, blocks, timeoutMs === undefined ? acquireOptions : { ...acquireOptions, timeoutMs });
  let list: RequestList | undefined;
  let bad: unknown;
  try {
    list = layOut(destinations, count);
  } catch (e) {
    bad = e;
  }
  let lease: LockGuard;
  try {
    lease = await acquiring;
  } catch (e) {
    if (list !== undefined) list.busy = false;
    throw e;
  }
  if (list === undefined) {
    await lease.release();
    throw bad;
  }
  // The read stops for the client's close and the lease's transfer deadline; a fetch without a
  // signal of its own needs nothing more, so it reads under the client's close signal as it is
  // (no controller and timer per lease). With the caller's signal, or a lease that renews itself
  // (and so may be lost during the read), the lease's signal joins the caller's, as fetchLease
  // does (joinSignals: never AbortSignal.any, see signals.ts).
  const leaseSignal = options.signal !== undefined || Boolean(options.autoRenew);
  const signal = leaseSignal ? options.signal : closing;
  return readLease(engine, lease, list, { ...(deadline !== undefined ? { deadline } : {}), ...(signal !== undefined ? { signal } : {}) }, leaseSignal);
}

/**
 * @internal The body of {@link LockClient.fetchLease}: `lease` (held, this client's) is
 * checked against `destinations`; from here on every failure releases it before rethrowing,
 * and the guard returned owns it. `yieldFirst`: give the event loop one turn before the read
 * (writes of this client still queued in HTTP/2, such as the acquire of a pipelined next
 * fetch, go out before a same-host read holds the thread).
 */
export async function fetchLeased(engine: TransferEngine, lease: LockGuard, destinations: readonly FetchDestination[], options: FetchLeaseOptions, yieldFirst: boolean): Promise<FetchGuard> {
  let list: RequestList;
  try {
    checkCount(destinations, lease.blockCount);
    list = layOut(destinations, lease.blockCount);
  } catch (e) {
    await lease.release();
    throw e;
  }
  if (yieldFirst) await new Promise<void>((resolve) => setImmediate(resolve));
  return readLease(engine, lease, list, options, true);
}

/**
 * Read the blocks of `lease` through the request list laid out for them (busy; handed back
 * here); releases the lease on any failure. `leaseSignal`: the read also stops when the lease
 * ends (its signal joins `options.signal`).
 */
async function readLease(engine: TransferEngine, lease: LockGuard, list: RequestList, options: FetchLeaseOptions, leaseSignal: boolean): Promise<FetchGuard> {
  const count = lease.blockCount;
  const requests = list.requests;
  let joined: JoinedSignal | undefined;
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
    for (let i = 0; i < count; i++) {
      const q = requests[i] as MutableRequest;
      const granted = lengths[i] as number;
      if (q.length !== granted) {
        if (q.length !== ANY_LENGTH) {
          throw new InvalidInputError(`block ${lease.blockIds[i] as string} is ${granted} bytes on the holder, the destination expects ${q.length}`, { details: { field: 'destinations', request: i } });
        }
        q.length = granted;
      }
      q.remote = d;
    }
    const deadline = options.deadline;
    const until = deadline === undefined ? lease.transferDeadline : Math.min(deadline, lease.transferDeadline);
    joined = leaseSignal && options.signal ? joinSignals(options.signal, lease.signal) : undefined;
    const signal = joined !== undefined ? joined.signal : leaseSignal ? lease.signal : options.signal;
    const report = await engine.read(endpoint, requests as TransferRequest[], { deadline: until, signal });
    return new FetchGuard(lease, report);
  } catch (e) {
    await lease.release();
    throw e;
  } finally {
    joined?.release();
    list.busy = false;
  }
}
