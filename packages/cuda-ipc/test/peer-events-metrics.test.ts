/**
 * The cuda-ipc transport's peer events reach prom-client (`metrics` option): the counter the
 * kit's transports use, `tensorwire_transport_peer_events_total{transport="cuda-ipc",event}`;
 * none with `metrics: false` (still counted in `peerEvents()`). Refusals logged at most once
 * a second per kind, all counted.
 */
import { once } from 'node:events';
import net from 'node:net';
import { afterAll, describe, expect, it } from 'vitest';
import { silentLogger, type Logger } from '@tensorwire/core';
import { CudaIpcTransport, decodeEndpointBlob } from '../src/index.js';
import { uniqueOwner } from './helpers.js';

const closers: (() => Promise<unknown>)[] = [];
afterAll(async () => {
  for (const c of closers.reverse()) await c().catch(() => undefined);
});

async function bare(nodeId: string, options: ConstructorParameters<typeof CudaIpcTransport>[0], logger: Logger = silentLogger): Promise<{ t: CudaIpcTransport; nodeId: string }> {
  const t = new CudaIpcTransport(options);
  await t.start({ identity: { nodeId, incarnation: 'i1', hostId: 'h' }, logger, inbound: () => undefined });
  closers.push(() => t.close());
  return { t, nodeId };
}

async function hello(socketPath: string, as: CudaIpcTransport, nodeId: string): Promise<string> {
  const presence = decodeEndpointBlob(as.endpoint()).presence;
  const s = net.createConnection(socketPath);
  closers.push(async () => s.destroy());
  s.on('error', () => undefined);
  await once(s, 'connect');
  s.write(JSON.stringify({ t: 'hello', nodeId, incarnation: 'i1', hostId: 'h', presence }) + '\n');
  const [chunk] = (await once(s, 'data')) as [Buffer];
  return String((JSON.parse(chunk.toString('utf8').split('\n')[0] as string) as Record<string, unknown>)['t']);
}

describe('cuda-ipc peer events in prom-client', () => {
  it('counts refusals in the given registry\'s counter with transport="cuda-ipc"; logs the first', async () => {
    // A registry of another transport's (the engine's or the TCP transport's in an application).
    const other = new CudaIpcTransport();
    closers.push(() => other.close());
    const registry = other.metrics!.registry;
    const warnings: string[] = [];
    const logger: Logger = { ...silentLogger, warn: (m) => warnings.push(m) };
    const { t } = await bare(uniqueOwner('pem'), { limits: { maxConnectionsPerPeer: 1 }, metrics: { registry } }, logger);
    expect(t.metrics?.registry).toBe(registry);
    const socketPath = decodeEndpointBlob(t.endpoint()).socketPath;
    const p = await bare(uniqueOwner('pep'), { metrics: false });
    const replies: string[] = [];
    for (let i = 0; i < 4; i++) replies.push(await hello(socketPath, p.t, p.nodeId));
    expect(replies).toEqual(['welcome', 'reject', 'reject', 'reject']);
    expect(t.peerEvents()).toMatchObject({ peer_connections: 3, connections: 0 });
    const values = (await registry.getSingleMetric('tensorwire_transport_peer_events_total')!.get()).values;
    expect(values.map((v) => ({ ...v.labels, value: v.value }))).toEqual([{ transport: 'cuda-ipc', event: 'peer_connections', value: 3 }]);
    // The first of a kind is always logged (how many of the next ones are depends on the clock;
    // the throttle itself is tested with a fake clock in core's peer-events.test.ts).
    expect(warnings[0]).toBe('cuda-ipc: connection refused: too many inbound connections from this peer');
  });

  it('metrics: false: no metrics object, peer events still counted', async () => {
    const { t } = await bare(uniqueOwner('pef'), { limits: { maxConnectionsPerPeer: 1 }, metrics: false });
    expect(t.metrics).toBeUndefined();
    const p = await bare(uniqueOwner('peg'), { metrics: false });
    const socketPath = decodeEndpointBlob(t.endpoint()).socketPath;
    expect([await hello(socketPath, p.t, p.nodeId), await hello(socketPath, p.t, p.nodeId)]).toEqual(['welcome', 'reject']);
    expect(t.peerEvents().peer_connections).toBe(1);
  });

  it('default: a private registry per transport', () => {
    const a = new CudaIpcTransport();
    const b = new CudaIpcTransport();
    closers.push(() => a.close(), () => b.close());
    expect(a.metrics?.registry).toBeDefined();
    expect(a.metrics?.registry).not.toBe(b.metrics?.registry);
    expect(a.metrics?.registry.getSingleMetric('tensorwire_transport_peer_events_total')).toBeDefined();
  });
});
