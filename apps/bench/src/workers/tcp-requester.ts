/**
 * Requester half of the `tcp` scenario. Runs one measurement per message:
 * { type: 'engine' | 'raw', blockBytes, totalBytes, window } and answers with figures.
 */
import net from 'node:net';
import { TcpTransport, TransferEngine, silentLogger, type Registration } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { workerInit } from '../proc.js';
import { gbps, nowMs } from '../stats.js';

const ipc = workerInit();
const endpoint = new Uint8Array(Buffer.from(process.argv[2] as string, 'base64'));
const descriptor = new Uint8Array(Buffer.from(process.argv[3] as string, 'base64'));
const rawPort = Number(process.argv[4]);
const regionBytes = Number(process.argv[5]);
const expected = pattern(regionBytes, 1234);
const engine = new TransferEngine({ nodeId: 'bench-requester', transports: [new TcpTransport()], logger: silentLogger });
await engine.start();
let dest: Uint8Array | undefined;
let destReg: Registration | undefined;

async function destination(bytes: number): Promise<{ buffer: Uint8Array; reg: Registration }> {
  if (!dest || dest.length < bytes) {
    await destReg?.revoke();
    dest = new Uint8Array(bytes);
    dest.fill(1); // fault the pages in before timing
    destReg = await engine.register({ kind: 'host', buffer: dest });
  }
  return { buffer: dest, reg: destReg as Registration };
}

async function runEngine(blockBytes: number, totalBytes: number, window: number): Promise<Record<string, unknown>> {
  const ops = Math.max(1, Math.floor(totalBytes / blockBytes));
  const { buffer, reg } = await destination(ops * blockBytes);
  buffer.fill(0, 0, ops * blockBytes);
  const blocks = Math.max(1, Math.floor(regionBytes / blockBytes));
  await engine.connect(endpoint);
  const latencies: number[] = [];
  let next = 0;
  const t0 = nowMs();
  async function lane(): Promise<void> {
    while (next < ops) {
      const i = next++;
      const s = nowMs();
      await engine.read(endpoint, [{ local: reg, localOffset: i * blockBytes, remote: descriptor, remoteOffset: (i % blocks) * blockBytes, length: blockBytes }]);
      latencies.push(nowMs() - s);
    }
  }
  await Promise.all(Array.from({ length: Math.min(window, ops) }, lane));
  const ms = nowMs() - t0;
  // Verify every byte of every block, outside the timed region.
  let failures = 0;
  for (let i = 0; i < ops; i++) {
    const off = (i % blocks) * blockBytes;
    if (Buffer.compare(buffer.subarray(i * blockBytes, (i + 1) * blockBytes), expected.subarray(off, off + blockBytes)) !== 0) failures++;
  }
  const ex = engine.explain(endpoint, 'host');
  return { gbps: gbps(ops * blockBytes, ms), ms, bytes: ops * blockBytes, latencies, failures, transport: ex.chosen, reason: ex.reason };
}

/**
 * Raw baseline: `sockets` plain node:net streams splitting the same bytes. With `onread`, each
 * socket receives straight into its half of the same destination memory the engine run uses
 * (the cheapest receive Node offers); without it, the default 'data' events.
 */
async function runRaw(blockBytes: number, totalBytes: number, sockets: number, onread: boolean): Promise<Record<string, unknown>> {
  const total = Math.max(1, Math.floor(totalBytes / blockBytes)) * blockBytes;
  const per = Math.ceil(total / sockets);
  // With onread, receive into the same pre-faulted destination memory the engine run uses,
  // advancing through it, so both write the same amount of cold memory.
  const dst = onread ? (await destination(total)).buffer : undefined;
  const t0 = nowMs();
  await Promise.all(
    Array.from({ length: sockets }, (_, k) => {
      const mine = Math.min(per, total - k * per);
      return new Promise<void>((resolve, reject) => {
        let got = 0;
        const base = k * per;
        const next = (): Uint8Array => (dst as Uint8Array).subarray(base + got, base + Math.min(mine, got + 4 * 1024 * 1024));
        const count = (n: number): void => {
          got += n;
          if (got >= mine) {
            socket.destroy();
            resolve();
          }
        };
        const socket = net.connect({ port: rawPort, host: '127.0.0.1', noDelay: true, ...(onread ? { onread: { buffer: () => (got < mine ? next() : Buffer.allocUnsafe(1)), callback: (n: number) => (count(n), true) } } : {}) });
        socket.on('error', reject);
        if (!onread) socket.on('data', (d: Buffer) => count(d.length));
        socket.on('connect', () => {
          const req = Buffer.alloc(12);
          req.writeBigUInt64BE(BigInt(mine), 0);
          req.writeUInt32BE(blockBytes, 8);
          socket.write(req);
        });
      });
    }),
  );
  const ms = nowMs() - t0;
  return { gbps: gbps(total, ms), ms, bytes: total };
}

ipc.onMessage((m) => {
  const run = async (): Promise<void> => {
    if (m['type'] === 'stop') {
      await engine.close();
      process.exit(0);
    }
    const blockBytes = Number(m['blockBytes']);
    const totalBytes = Number(m['totalBytes']);
    const result =
      m['type'] === 'engine'
        ? await runEngine(blockBytes, totalBytes, Number(m['window'] ?? 4))
        : m['type'] === 'raw'
          ? await runRaw(blockBytes, totalBytes, 1, false)
          : await runRaw(blockBytes, totalBytes, 2, true);
    ipc.send({ type: 'result', id: m['id'], ...result });
  };
  run().catch((e: unknown) => ipc.send({ type: 'error', id: m['id'], message: e instanceof Error ? e.message : String(e) }));
});
ipc.send({ type: 'ready' });
