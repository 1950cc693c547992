/**
 * `--discovery etcd://HOST:PORT` for `holder` and `fetch`: the holder publishes its record
 * (engine endpoint, lock-service address, the block ids it serves) under a kept-alive etcd
 * lease; the requester finds the holder of the blocks it wants there instead of `--holder`.
 * Composition only: the discovery logic lives in @tensorwire/core and @tensorwire/discovery-etcd.
 */
import { nodeRecordFor, type NodeRecord } from '@tensorwire/core';
import { EtcdDiscovery } from '@tensorwire/discovery-etcd';
import { blockId } from './fetch-protocol.js';
import type { Holder } from './holder.js';

export interface PublishedHolder {
  readonly discovery: EtcdDiscovery;
  readonly record: NodeRecord;
  /** Withdraw the record (the lease is revoked, requesters see the holder leave) and close. */
  close(): Promise<void>;
}

/**
 * Publish a started holder. `advertiseHost` is the address requesters use (the lock address
 * in the record is `advertiseHost:<lock port>`).
 */
export async function publishHolder(
  holder: Holder,
  o: { discovery: string; advertiseHost: string; blocks: number; ttlSeconds?: number; timeoutMs?: number },
): Promise<PublishedHolder> {
  const discovery = await EtcdDiscovery.open({ url: o.discovery, ...(o.ttlSeconds !== undefined ? { ttlSeconds: o.ttlSeconds } : {}), timeoutMs: o.timeoutMs ?? 10_000 });
  try {
    const record = nodeRecordFor(holder.engine, {
      lockAddress: `${o.advertiseHost}:${holder.server.port}`,
      blockIds: Array.from({ length: o.blocks }, (_, i) => blockId(i)),
    });
    await discovery.publish(record, { timeoutMs: o.timeoutMs ?? 30_000 });
    return { discovery, record, close: () => discovery.close() };
  } catch (e) {
    await discovery.close();
    throw e;
  }
}

export interface ResolvedHolder {
  readonly discovery: EtcdDiscovery;
  readonly record: NodeRecord;
  /** The holder's lock service, `host:port`: what `--holder` would have been. */
  readonly lockAddress: string;
  close(): Promise<void>;
}

/**
 * Find a holder that advertises the bench's blocks (block 0 is asked for; every block of a
 * bench holder is advertised together) and has a lock service. Waits for one to appear, up
 * to `timeoutMs` (default 30 s).
 */
export async function resolveHolder(o: { discovery: string; timeoutMs?: number; signal?: AbortSignal }): Promise<ResolvedHolder> {
  const timeoutMs = o.timeoutMs ?? 30_000;
  const discovery = await EtcdDiscovery.open({ url: o.discovery, timeoutMs: Math.min(timeoutMs, 10_000), ...(o.signal ? { signal: o.signal } : {}) });
  try {
    const wanted = blockId(0);
    let record = (await discovery.holdersOf(wanted)).find((r) => r.lockAddress !== undefined);
    if (!record) {
      record = await new Promise<NodeRecord>((resolve, reject) => {
        const ac = new AbortController();
        const off = discovery.on((e) => {
          if ((e.type === 'added' || e.type === 'updated' || e.type === 'incarnation-changed') && e.record.lockAddress && e.record.blockIds?.includes(wanted)) {
            off();
            ac.abort();
            resolve(e.record);
          }
        });
        const timer = setTimeout(() => {
          off();
          reject(new Error(`no holder of ${wanted} appeared in ${discovery.store} within ${timeoutMs} ms`));
        }, timeoutMs);
        ac.signal.addEventListener('abort', () => clearTimeout(timer), { once: true });
        o.signal?.addEventListener('abort', () => {
          off();
          clearTimeout(timer);
          reject(new Error('aborted'));
        }, { once: true });
      });
    }
    return { discovery, record, lockAddress: record.lockAddress as string, close: () => discovery.close() };
  } catch (e) {
    await discovery.close();
    throw e;
  }
}
