/**
 * Lease lifecycle paths that once left something behind: an acquire answer the requester could
 * not receive (a message-size limit) left the lease pinned and granted until it expired; a
 * holder resolver that asked engineGrants twice for one lease left the first grant live after
 * the lease ended; a graceful close kept draining for all of `graceMs` when a Renew, not the
 * GC, ended the last lease. Real lock service and client on loopback.
 */
import { ResourceExhaustedError, TcpTransport, TransferEngine, silentLogger } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient } from '../src/index.js';
import { LockServer, engineGrants } from '../src/server/index.js';
import { waitFor } from './helpers.js';

const cleanups: (() => Promise<unknown> | unknown)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** A holder whose resolver answers 40 KiB of descriptors per block: an answer over 64 KiB for two blocks. */
async function bigAnswers(grpcOptions: Record<string, number> = {}): Promise<{ server: LockServer; address: string }> {
  const server = new LockServer({ holderId: 'holder', lockTimeoutMs: 30_000, logger: silentLogger, resolve: (ids) => ids.map(() => new Uint8Array(40 * 1024)), grpcOptions });
  const port = await server.listen('127.0.0.1:0');
  cleanups.push(() => server.close({ graceMs: 0 }));
  return { server, address: `127.0.0.1:${port}` };
}

describe('lease lifecycle gaps', () => {
  it.each([
    ["the client's receive limit", {}, { 'grpc.max_receive_message_length': 64 * 1024 }],
    ["the holder's send limit", { 'grpc.max_send_message_length': 64 * 1024 }, {}],
  ])('an acquire answer over %s: the holder\'s lease is released at once (by acquire id), not left to expire', async (_limit, holderOptions, channelOptions) => {
    const { server, address } = await bigAnswers(holderOptions);
    const client = new LockClient({ requesterId: 'req', logger: silentLogger, session: false, channelOptions });
    cleanups.push(() => client.close());
    const e = await client.acquire(address, ['block:kv:1', 'block:kv:2']).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(ResourceExhaustedError);
    await waitFor(() => server.counters().active === 0, 'the lease released');
    expect(server.counters()).toMatchObject({ acquired: 1, released: 1, expired: 0, pinnedBlocks: 0 });
  });

  it('a holder resolver that asks engineGrants twice for one lease: the acquire fails, and no grant outlives the lease', async () => {
    const engine = new TransferEngine({ nodeId: 'holder', transports: [new TcpTransport()], logger: silentLogger });
    cleanups.push(() => engine.close());
    const registration = await engine.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const grants = engineGrants({ engine, blocks: () => ({ registration, offset: 0, length: 4096 }) });
    const server = new LockServer({
      holderId: 'holder',
      lockTimeoutMs: 30_000,
      logger: silentLogger,
      ...grants.lockServerOptions,
      resolveLease: async (lease, hints) => {
        const a = (await grants.resolveLease(lease, hints)) as { lease: readonly Uint8Array[] };
        const b = (await grants.resolveLease(lease, hints)) as { lease: readonly Uint8Array[] };
        return { lease: [...a.lease, ...b.lease] };
      },
    });
    const port = await server.listen('127.0.0.1:0');
    cleanups.push(() => server.close({ graceMs: 0 }));
    const client = new LockClient({ requesterId: 'req', logger: silentLogger });
    cleanups.push(() => client.close());
    const e = await client.acquire(`127.0.0.1:${port}`, ['block:kv:0']).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(Error);
    expect(String((e as Error).message)).toMatch(/asked engineGrants twice/);
    await waitFor(() => server.counters().active === 0, 'the lease ended');
    await grants.settled();
    expect(grants.counters()).toMatchObject({ issued: 1, revoked: 1, live: 0 });
    expect(engine.liveGrants).toBe(0);
  });

  it('close({ graceMs }) ends as soon as a Renew, not the GC, ended the last lease', async () => {
    const clock = { t: 1_000_000, now: (): number => clock.t };
    // The GC never fires on its own here: the renew's own sweep is what ends the lease.
    const timers = { setTimeout: (): number => 0, clearTimeout: (): void => undefined };
    const server = new LockServer({ holderId: 'holder', lockTimeoutMs: 1000, logger: silentLogger, clock, timers });
    const port = await server.listen('127.0.0.1:0');
    cleanups.push(() => server.close({ graceMs: 0 }));
    const client = new LockClient({ requesterId: 'req', logger: silentLogger });
    cleanups.push(() => client.close());
    const g = await client.acquire(`127.0.0.1:${port}`, ['block:kv:1']);
    let closed = false;
    const closing = server.close({ graceMs: 60_000 }).then(() => (closed = true));
    clock.t += 1001;
    await g.renew().catch(() => undefined); // NOT_FOUND: its deadline passed
    expect(server.counters()).toMatchObject({ active: 0, expired: 1 });
    await waitFor(() => closed, 'the drain to end');
    await closing;
  });
});
