/**
 * Bounds on the cuda-ipc control channel (issue 19, Build 1; invariant 16): handshaking
 * sockets, inbound connections in all and per peer, control lines in parse, and the
 * mappings of a peer's segments a connection caches. Past each bound the peer is refused or
 * cut with a counted reason (`peerEvents()`), and honest peers keep being served.
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import net from 'node:net';
import { afterAll, describe, expect, it } from 'vitest';
import { TransferEngine, silentLogger, type TransportConnection } from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory, decodeEndpointBlob, releaseSharedMemory } from '../src/index.js';
import { fixture, uniqueOwner } from './helpers.js';

const closers: (() => Promise<unknown>)[] = [];
afterAll(async () => {
  for (const c of closers.reverse()) await c().catch(() => undefined);
});

async function engine(nodeId: string, t: CudaIpcTransport): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId, transports: [t], logger: silentLogger, metrics: false });
  await e.start();
  closers.push(() => e.close());
  return e;
}

/** A transport started under a host that keeps every inbound connection (no engine replaces them). */
async function bare(nodeId: string, limits: ConstructorParameters<typeof CudaIpcTransport>[0]): Promise<{ t: CudaIpcTransport; kept: TransportConnection[]; nodeId: string }> {
  const t = new CudaIpcTransport(limits);
  const kept: TransportConnection[] = [];
  await t.start({ identity: { nodeId, incarnation: 'i1', hostId: 'h' }, logger: silentLogger, inbound: (c) => kept.push(c) });
  closers.push(() => t.close());
  return { t, kept, nodeId };
}

/** Say hello on a raw socket as `as`, and return the first reply line. */
async function hello(socketPath: string, as: CudaIpcTransport, id: { nodeId: string; incarnation: string; hostId: string }): Promise<Record<string, unknown>> {
  const presence = decodeEndpointBlob(as.endpoint()).presence;
  const s = net.createConnection(socketPath);
  closers.push(async () => s.destroy());
  s.on('error', () => undefined);
  await once(s, 'connect');
  s.write(JSON.stringify({ t: 'hello', ...id, presence }) + '\n');
  const [chunk] = (await once(s, 'data')) as [Buffer];
  return JSON.parse(chunk.toString('utf8').split('\n')[0] as string) as Record<string, unknown>;
}

describe('cuda-ipc control channel bounds', () => {
  it('a flooding process: handshaking sockets are capped and timed out, a garbage line cuts only its socket; an honest peer keeps reading', async () => {
    const victimT = new CudaIpcTransport({ limits: { maxPendingHandshakes: 4, handshakeTimeoutMs: 300 } });
    const victim = await engine(uniqueOwner('cbv'), victimT);
    const honest = await engine(uniqueOwner('cbh'), new CudaIpcTransport());
    const mem = allocateSharedMemory(4096, 'cb');
    mem.fill(6);
    const remote = await victim.register({ kind: 'host', buffer: mem });
    const local = await honest.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const dst = (local.memory as { buffer: Uint8Array }).buffer;
    await honest.read(victim.endpoint(), [{ local, remote: remote.descriptor }]);
    expect(dst.every((x) => x === 6)).toBe(true);

    const socketPath = decodeEndpointBlob(victimT.endpoint()).socketPath;
    const flooder = fork(fixture('control-flooder.mjs'), [socketPath, '20'], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    closers.push(async () => flooder.kill('SIGKILL'));
    const exited = once(flooder, 'exit');
    const messages: Record<string, unknown>[] = [];
    flooder.on('message', (m: Record<string, unknown>) => messages.push(m));
    expect(await exited).toEqual([0, null]);
    expect(messages).toEqual([{ garbageClosed: true }, { closed: 20 }]);
    // 4 held until they timed out, the other 16 closed at once; the garbage line cut its own socket.
    expect(victimT.peerEvents()).toMatchObject({ protocol_violation: 1, pending_handshakes: 16, handshake_timeout: 4 });

    mem.fill(8);
    await honest.read(victim.endpoint(), [{ local, remote: remote.descriptor }]);
    expect(dst.every((x) => x === 8)).toBe(true);
    await remote.revoke();
    releaseSharedMemory(mem);
  });

  it('inbound connections are capped per peer and in all; refused hellos get a reason, the connections already open stay', async () => {
    const { t, kept } = await bare(uniqueOwner('cbb'), { limits: { maxConnectionsPerPeer: 2, maxConnections: 3 } });
    const socketPath = decodeEndpointBlob(t.endpoint()).socketPath;
    const p = await bare(uniqueOwner('cbp'), {});
    const q = await bare(uniqueOwner('cbq'), {});
    const replies: string[] = [];
    for (const peer of [p, p, p, q, q]) {
      const r = await hello(socketPath, peer.t, { nodeId: peer.nodeId, incarnation: 'i1', hostId: 'h' });
      replies.push(r['t'] === 'welcome' ? 'welcome' : `${String(r['t'])}: ${String(r['reason'])}`);
    }
    expect(replies).toEqual([
      'welcome',
      'welcome',
      expect.stringMatching(/^reject: busy: 2 inbound connections from /),
      'welcome',
      expect.stringMatching(/^reject: busy: 3 inbound connections are open/),
    ]);
    expect(kept.map((c) => c.peer.nodeId)).toEqual([p.nodeId, p.nodeId, q.nodeId]);
    expect(kept.every((c) => c.isOpen)).toBe(true);
    expect(t.peerEvents()).toMatchObject({ peer_connections: 1, connections: 1 });
  });

  it("a connection's cache of a peer's segment mappings is bounded; reads past the bound still land", async () => {
    const holder = await engine(uniqueOwner('cbs'), new CudaIpcTransport());
    const readerT = new CudaIpcTransport({ limits: { maxCachedSegments: 2 } });
    const reader = await engine(uniqueOwner('cbr'), readerT);
    const regions = [1, 2, 3, 4, 5].map((v) => allocateSharedMemory(4096, 'cbs').fill(v));
    const remotes = await Promise.all(regions.map((r) => holder.register({ kind: 'host', buffer: r })));
    const local = await reader.register({ kind: 'host', buffer: new Uint8Array(4096) });
    const dst = (local.memory as { buffer: Uint8Array }).buffer;
    for (let round = 0; round < 2; round++) {
      for (const [i, remote] of remotes.entries()) {
        await reader.read(holder.endpoint(), [{ local, remote: remote.descriptor }]);
        expect(dst.every((x) => x === i + 1)).toBe(true);
      }
    }
    // 5 grants and 5 data segments through caches of 2 each: every new one past the 2nd evicts.
    expect(readerT.peerEvents().cache_evictions).toBeGreaterThanOrEqual(2 * 3);
    for (const r of remotes) await r.revoke();
    for (const r of regions) releaseSharedMemory(r);
  });
});
