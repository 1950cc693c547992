/**
 * The rdma transport's peer events reach prom-client (`metrics` option): the counter the kit's
 * transports use, `tensorwire_transport_peer_events_total{transport="rdma",event}` (a dropped
 * connection's BoundReason, a refused handshake's code); none with `metrics: false`. The
 * getters keep their shape (only what happened). Simulated verbs backend.
 */
import { beforeEach, describe, expect, it } from 'vitest';
import { silentLogger, type Logger } from '@tensorwire/core';
import { RdmaTransport, type RdmaTransportOptions } from '../src/transport.js';
import { helloSetup, RawPeer } from './raw-peer.js';
import { SimFabric } from './sim/verbs.js';
import { testNodes, until } from './window-suite.js';

let fabric = new SimFabric();
beforeEach(() => {
  fabric = new SimFabric();
});
const { node } = testNodes('rdma-pe', (extra: Partial<RdmaTransportOptions>) => new RdmaTransport({ backend: fabric.backend(true, { linkLayer: 'ethernet' }), quiesceTimeoutMs: 2_000, ...extra }));

async function values(t: RdmaTransport): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  const m = t.metrics?.registry.getSingleMetric('tensorwire_transport_peer_events_total');
  for (const v of m ? (await m.get()).values : []) out[`${v.labels['transport']}/${v.labels['event']}`] = v.value;
  return out;
}

describe('rdma peer events in prom-client', () => {
  it('a refused handshake and a connection dropped over a bound are counted with transport="rdma", logged, and keep the getters\' shape', async () => {
    const warnings: string[] = [];
    const logger: Logger = { ...silentLogger, warn: (m: string) => warnings.push(m) };
    const b = await node(1, { logger });
    expect(b.t.peerDisconnects).toEqual({});
    expect(b.t.handshakeRefusals).toEqual({});
    // Refused: the first frame is not a HELLO.
    const r = await RawPeer.open(b.t.endpoint());
    r.send({ type: 'ready' });
    const reply = await r.next();
    expect(reply !== 'closed' && reply.type === 'reject' ? reply.code : reply).toBe('protocol');
    await r.closed;
    // Dropped: a HELLO followed by frames the handshake never reads (unread-frames).
    const p = await RawPeer.open(b.t.endpoint());
    p.send(
      { type: 'hello', setup: helloSetup({ nodeId: 'flooder', incarnation: 'h1', hostId: 'h' }, 1), target: { nodeId: b.host.identity.nodeId, incarnation: b.host.identity.incarnation } },
      ...Array.from({ length: 100 }, () => ({ type: 'retire' as const })),
    );
    await until(() => b.t.peerDisconnects['unread-frames'] === 1);
    p.destroy();
    expect(b.t.handshakeRefusals).toEqual({ protocol: 1 });
    expect(b.t.peerDisconnects).toEqual({ 'unread-frames': 1 });
    expect(await values(b.t)).toEqual({ 'rdma/protocol': 1, 'rdma/unread-frames': 1 });
    expect(warnings).toContain('rdma handshake refused: protocol');
    expect(warnings).toContain('rdma peer disconnected: unread-frames');
  });

  it('metrics: false: no metrics object; still counted', async () => {
    const b = await node(1, { metrics: false });
    expect(b.t.metrics).toBeUndefined();
    const r = await RawPeer.open(b.t.endpoint());
    r.send({ type: 'ready' });
    await r.next();
    await r.closed;
    expect(b.t.handshakeRefusals).toEqual({ protocol: 1 });
  });
});
