/**
 * Holder half of the `rdma` scenario: serves a pattern-filled region through the engine's
 * rdma transport with N queue pairs per peer.
 * argv: regionBytes queuePairs device
 */
import { TransferEngine, silentLogger } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { RdmaTransport } from '@tensorwire/rdma-verbs';
import { workerInit } from '../proc.js';

const ipc = workerInit();
const regionBytes = Number(process.argv[2]);
const qps = Number(process.argv[3]);
const device = process.argv[4];
try {
  const region = pattern(regionBytes, 4321);
  const engine = new TransferEngine({
    nodeId: 'bench-rdma-holder',
    transports: [new RdmaTransport({ ...(device ? { device } : {}), queuePairsPerPeer: qps, listenHost: '127.0.0.1', advertiseHost: '127.0.0.1' })],
    streamsPerPeer: qps,
    chunkBytes: 4 * 1024 * 1024,
    logger: silentLogger,
  });
  await engine.start();
  const reg = await engine.register({ kind: 'host', buffer: region });
  ipc.send({ type: 'ready', endpoint: Buffer.from(engine.endpoint()).toString('base64'), descriptor: Buffer.from(reg.descriptor).toString('base64') });
  ipc.onMessage((m) => {
    if (m['type'] === 'stop') void engine.close().then(() => process.exit(0));
  });
} catch (e) {
  ipc.send({ type: 'error', message: e instanceof Error ? e.message : String(e) });
  process.exitCode = 1;
}
