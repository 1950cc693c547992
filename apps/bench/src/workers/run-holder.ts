/** Child process: the holder of `run`. argv: blocks blockBytes lockTimeoutMs */
import { startHolder } from '../holder.js';
import { workerInit } from '../proc.js';

const ipc = workerInit();
const holder = await startHolder({
  blocks: Number(process.argv[2]),
  blockBytes: Number(process.argv[3]),
  lockTimeoutMs: Number(process.argv[4]),
  lockAddress: '127.0.0.1:0',
  tcpHost: '127.0.0.1',
});
ipc.onMessage((m) => {
  if (m['type'] === 'counters') ipc.send({ type: 'counters', counters: holder.counters() });
  if (m['type'] === 'stop') void holder.close().finally(() => process.exit(0));
});
ipc.send({ type: 'ready', lockAddress: holder.lockAddress, transports: holder.transports, notes: holder.notes });
