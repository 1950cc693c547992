import * as grpc from '@grpc/grpc-js';
import { TcpTransport, TransferEngine, silentLogger, type Registration, type Transport } from '@tensorwire/core';
import { LockClient, decodeFetchDescriptor, encodeFetchDescriptor, type LockClientOptions } from '../src/index.js';
import { LeaseError, LeaseTable, LockServer, type AcquireHints, type EngineGrants, type LeaseInfo, type LeaseTableOptions, type LockServerOptions, type ResolvedLease } from '../src/server/index.js';

/** Poll until `predicate` holds. Bounded by the test's own timeout, never asserted on time. */
export async function waitFor(predicate: () => boolean, what = 'condition', stepMs = 10): Promise<void> {
  const started = Date.now();
  while (!predicate()) {
    if (Date.now() - started > 50_000) throw new Error(`gave up waiting for ${what}`);
    await new Promise((r) => setTimeout(r, stepMs));
  }
}

/** Bind `server` (its services added) to a free loopback port, insecure; resolves to the port. */
export function bindLoopback(server: grpc.Server): Promise<number> {
  return new Promise<number>((resolve, reject) => server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))));
}

export function blocks(owner: string, n: number, from = 0): string[] {
  return Array.from({ length: n }, (_, i) => `block:${owner}:${from + i}`);
}

export interface Harness {
  server: LockServer;
  holder: string;
  client: LockClient;
  /** Releases the server has received: unary Release calls plus ReleaseMany entries. */
  releases(): number;
  close(): Promise<void>;
}

export async function harness(serverOpts: Partial<LockServerOptions> = {}, clientOpts: LockClientOptions = {}): Promise<Harness> {
  const server = new LockServer({ holderId: 'holder1', lockTimeoutMs: 30_000, ...serverOpts });
  const port = await server.listen('127.0.0.1:0');
  const holder = `127.0.0.1:${port}`;
  const client = new LockClient({ requesterId: 'req1', ...clientOpts });
  return {
    server,
    holder,
    client,
    releases: () => server.counters().requests.release + server.counters().releaseEntries,
    async close() {
      await client.close();
      await server.close({ graceMs: 0 });
    },
  };
}

export function expectBalanced(c: { acquired: number; released: number; expired: number; active: number }): boolean {
  return c.acquired === c.released + c.expired + c.active;
}

/** A lease table on a hand-driven clock (`clock.t` in ms), holder `h`, leases of 1 s unless told. */
export function table(extra: Partial<LeaseTableOptions> = {}): { t: LeaseTable; clock: { now: () => number; t: number } } {
  const clock = { t: 0, now: () => clock.t };
  return { t: new LeaseTable({ holderId: 'h', lockTimeoutMs: 1000, clock, ...extra }), clock };
}

/** The `LeaseError` status `fn` throws, or `'OK'` when it returns. */
export function statusOf(fn: () => unknown): string {
  try {
    fn();
  } catch (e) {
    if (e instanceof LeaseError) return e.status;
    throw e;
  }
  return 'OK';
}

/** Composites `AbortSignal.any` registered on `s` (Node's internal list; undefined where Node keeps none). */
export function dependants(s: AbortSignal): number | undefined {
  const key = Object.getOwnPropertySymbols(s).find((k) => k.toString() === 'Symbol(kDependantSignals)');
  const set = key === undefined ? undefined : (s as unknown as Record<symbol, { size: number } | undefined>)[key];
  return set?.size;
}

/** A requester of the fetch tests: an engine (TCP unless `transports` says), a client, and `blocks` blocks of destination registered. */
export interface FetchRequester {
  engine: TransferEngine;
  client: LockClient;
  local: Registration;
  dst: Uint8Array;
  close(): Promise<void>;
}

export async function fetchRequester(options: { name?: string; localLane?: boolean; blocks: number; blockBytes: number; transports?: () => Transport[] }): Promise<FetchRequester> {
  const name = options.name ?? 'req';
  const engine = new TransferEngine({ nodeId: name, transports: options.transports?.() ?? [new TcpTransport()], logger: silentLogger });
  const client = new LockClient({ requesterId: name, logger: silentLogger, localLane: options.localLane ?? true });
  const dst = new Uint8Array(options.blocks * options.blockBytes);
  const local = await engine.register({ kind: 'host', buffer: dst });
  return {
    engine,
    client,
    local,
    dst,
    async close() {
      await client.close();
      await engine.close();
    },
  };
}

/**
 * `resolveLease` of engineGrants, with each lease descriptor naming the endpoint `endpoint()`
 * gives instead of the holder engine's own (undefined: its own): a holder whose engine is
 * reached through a relay, or that looks restarted with other transports.
 */
export function namingEndpoint(
  resolveLease: (lease: LeaseInfo, hints?: AcquireHints) => Promise<ResolvedLease>,
  endpoint: () => Uint8Array | undefined,
): (lease: LeaseInfo, hints: AcquireHints) => Promise<ResolvedLease> {
  return async (lease, hints) => {
    const resolved = (await resolveLease(lease, hints)) as { lease: readonly Uint8Array[] };
    const ep = endpoint();
    return ep === undefined ? resolved : { lease: [encodeFetchDescriptor(ep, decodeFetchDescriptor(resolved.lease[0] as Uint8Array).grant)] };
  };
}

/** A holder of the fetch tests: its engine, lock service (serving `grants`) and region. */
export interface FetchHolder {
  engine: TransferEngine;
  server: LockServer;
  grants: EngineGrants;
  address: string;
  region: Uint8Array;
  close(): Promise<void>;
}

/** A lock service for `grants` of `engine` on a loopback port (`options` over engineGrants' own), closed with them. */
export async function serveFetchHolder(engine: TransferEngine, region: Uint8Array, grants: EngineGrants, options: Partial<LockServerOptions> = {}, onClose?: () => Promise<void>): Promise<FetchHolder> {
  const server = new LockServer({ holderId: 'holder', lockTimeoutMs: 30_000, ...grants.lockServerOptions, logger: silentLogger, ...options });
  const port = await server.listen('127.0.0.1:0');
  return {
    engine,
    server,
    grants,
    address: `127.0.0.1:${port}`,
    region,
    async close() {
      await server.close({ graceMs: 0 });
      await grants.settled();
      await onClose?.();
      await engine.close();
    },
  };
}
