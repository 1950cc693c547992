/** Child process: the requester of `run`. argv: lockAddress blocks blockBytes blocksPerFetch durationMs lanes transport baselines(1|0) warmupFetches */
import { runFetcher } from '../fetcher.js';
import { workerInit } from '../proc.js';
import { isTransportChoice } from '../transports.js';

const ipc = workerInit();
const [lockAddress, blocks, blockBytes, blocksPerFetch, durationMs, lanes, transport, baselines, warmupFetches] = process.argv.slice(2);
try {
  const result = await runFetcher({
    lockAddress: lockAddress as string,
    blocks: Number(blocks),
    blockBytes: Number(blockBytes),
    blocksPerFetch: Number(blocksPerFetch),
    durationMs: Number(durationMs),
    lanes: Number(lanes),
    transport: isTransportChoice(transport) ? transport : 'auto',
    baselines: baselines !== '0',
    warmupFetches: Number(warmupFetches ?? 0),
    onProgress: (done, total) => ipc.send({ type: 'progress', done, total }),
  });
  // Its stage samples grow with the fetches: more than a pipe holds at once, so wait for the write.
  await ipc.sent({ type: 'result', result });
} catch (e) {
  await ipc.sent({ type: 'error', message: e instanceof Error ? e.message : String(e) });
}
process.disconnect?.();
