/**
 * `rdma`: READ and WRITE bandwidth through the engine's rdma transport at 4 MiB blocks with
 * 1, 2 and 4 queue pairs per peer (holder in a child process, requester here, both on the
 * selected NIC), beside perftest's ib_read_bw / ib_write_bw on the same NIC in the same run
 * when perftest is installed. Goal: ≥ 0.95× perftest with 2 QPs per peer.
 *
 * Where no RDMA device is usable it returns `skipped` with the exact reason from
 * `capabilities()` and moves nothing.
 */
import { spawn, spawnSync } from 'node:child_process';
import { TransferEngine, silentLogger, type Registration } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { RdmaTransport, capabilities } from '@tensorwire/rdma-verbs';
import { spawnWorker } from '../proc.js';
import { gbps, nowMs } from '../stats.js';
import type { Measurement, Ratio, Scenario, ScenarioContext, ScenarioResult } from '../types.js';

const MiB = 1024 * 1024;
const BLOCK = 4 * MiB;
const QP_COUNTS = [1, 2, 4] as const;
const GOAL = 0.95;

interface PerftestResult {
  readonly gbps?: number;
  readonly note: string;
}

function perftestInstalled(tool: string): boolean {
  const r = spawnSync(tool, ['--help'], { encoding: 'utf8' });
  return r.error === undefined;
}

/** Run `tool` as server and client on the same NIC over loopback; parse "BW average[Gb/sec]". */
async function perftest(tool: 'ib_read_bw' | 'ib_write_bw', device: string, gidIndex: number | undefined, qps: number, signal: AbortSignal): Promise<PerftestResult> {
  const port = String(18515 + qps + (tool === 'ib_write_bw' ? 10 : 0));
  const args = ['-d', device, '-s', String(BLOCK), '-q', String(qps), '-F', '-D', '3', '--report_gbits', '-p', port];
  if (gidIndex !== undefined) args.push('-x', String(gidIndex));
  const server = spawn(tool, args, { stdio: ['ignore', 'pipe', 'pipe'], signal });
  server.on('error', () => undefined);
  await new Promise((r) => setTimeout(r, 500));
  const client = spawn(tool, [...args, '127.0.0.1'], { stdio: ['ignore', 'pipe', 'pipe'], signal });
  client.on('error', () => undefined);
  let out = '';
  client.stdout.on('data', (d: Buffer) => (out += d.toString()));
  client.stderr.on('data', (d: Buffer) => (out += d.toString()));
  const code = await new Promise<number | null>((r) => client.on('close', r));
  server.kill('SIGKILL');
  const line = out
    .split('\n')
    .map((l) => l.trim().split(/\s+/))
    .find((f) => f.length >= 4 && f[0] === String(BLOCK));
  const avg = line ? Number(line[3]) : Number.NaN;
  if (code !== 0 || !Number.isFinite(avg)) return { note: `${tool} -q ${qps} failed (exit ${String(code)}): ${out.slice(-300).replace(/\s+/g, ' ')}` };
  return { gbps: avg / 8, note: `${tool} -q ${qps}: ${avg} Gb/s average` };
}

async function pump(
  engine: TransferEngine,
  op: 'read' | 'write',
  endpoint: Uint8Array,
  local: Registration,
  descriptor: Uint8Array,
  slots: number,
  totalBytes: number,
  window: number,
  signal: AbortSignal,
): Promise<number> {
  let next = 0;
  const blocks = Math.ceil(totalBytes / BLOCK);
  const t0 = nowMs();
  const lane = async (): Promise<void> => {
    for (;;) {
      const i = next++;
      if (i >= blocks) return;
      const slot = i % slots;
      const req = { local, localOffset: slot * BLOCK, remote: descriptor, remoteOffset: slot * BLOCK, length: BLOCK };
      await (op === 'read' ? engine.read(endpoint, [req], { signal, timeoutMs: 30_000 }) : engine.write(endpoint, [req], { signal, timeoutMs: 30_000 }));
    }
  };
  await Promise.all(Array.from({ length: window }, lane));
  return gbps(blocks * BLOCK, nowMs() - t0);
}

export const rdma: Scenario = async (ctx: ScenarioContext): Promise<ScenarioResult> => {
  const caps = capabilities();
  if (!caps.available || caps.selected === undefined) {
    const reason = caps.reason ?? 'no usable RDMA device';
    ctx.log(`rdma: skipped: ${reason}`);
    return {
      scenario: 'rdma',
      skipped: reason,
      measurements: [],
      ratios: [],
      verificationFailures: 0,
      notes: [`addon: ${caps.addon.loaded ? (caps.built ? 'built with verbs.h' : 'stub build') : 'not loaded'}`, `libibverbs: ${caps.library.loaded ? 'loaded' : (caps.library.error ?? 'not loaded')}`],
    };
  }
  const sel = caps.selected;
  const slots = ctx.quick ? 4 : 16;
  const regionBytes = slots * BLOCK;
  const totalBytes = ctx.totalBytes ?? (ctx.quick ? 64 * MiB : 4096 * MiB);
  const measurements: Measurement[] = [];
  const ratios: Ratio[] = [];
  const notes: string[] = [
    `device ${sel.device} port ${sel.port} (${sel.linkLayer}), GID ${sel.gidIndex} ${sel.gidType}, NUMA node ${String(sel.numaNode)}`,
    `grants: ${caps.memoryWindows.grants} (type-2 memory windows ${caps.memoryWindows.type2Supported ? 'supported' : 'not supported'}): ${caps.memoryWindows.note}`,
    `fork safety: ${caps.fork ? `${caps.fork.status}${caps.fork.error !== undefined ? ` (${caps.fork.error})` : ''}` : 'unknown'}`,
  ];
  let failures = 0;
  const expected = pattern(regionBytes, 4321);
  const steps = QP_COUNTS.length * 2;
  let done = 0;
  const ours = new Map<string, number>();
  for (const qps of QP_COUNTS) {
    const holder = spawnWorker('rdma-holder', [String(regionBytes), String(qps), sel.device]);
    const engine = new TransferEngine({
      nodeId: 'bench-rdma-requester',
      transports: [new RdmaTransport({ device: sel.device, queuePairsPerPeer: qps, listenHost: '127.0.0.1', advertiseHost: '127.0.0.1' })],
      streamsPerPeer: qps,
      chunkBytes: BLOCK,
      logger: silentLogger,
    });
    try {
      const ready = await holder.next<{ type: string; endpoint?: string; descriptor?: string; message?: string }>((m) => m['type'] === 'ready' || m['type'] === 'error', ctx.signal);
      if (ready.type === 'error') throw new Error(`rdma holder failed: ${ready.message ?? ''}`);
      await engine.start();
      const endpoint = new Uint8Array(Buffer.from(ready.endpoint ?? '', 'base64'));
      const descriptor = new Uint8Array(Buffer.from(ready.descriptor ?? '', 'base64'));
      const buffer = new Uint8Array(regionBytes);
      const local = await engine.register({ kind: 'host', buffer });
      const explained = engine.explain(endpoint);
      if (qps === 1) notes.push(`transport chosen: ${String(explained.chosen)} — ${explained.reason}`);
      await engine.read(endpoint, [{ local, remote: descriptor }], { signal: ctx.signal }); // connect + warm up
      const window = 4 * qps;
      for (const op of ['read', 'write'] as const) {
        if (op === 'write') buffer.set(expected); // write the pattern back: verification reads it again
        const g = await pump(engine, op, endpoint, local, descriptor, slots, totalBytes, window, ctx.signal);
        ctx.progress('rdma', ++done, steps);
        const name = `rdma ${op.toUpperCase()} via engine, ${qps} QP${qps > 1 ? 's' : ''}/peer`;
        ours.set(`${op}/${qps}`, g);
        measurements.push({ name, role: 'subject', blockBytes: BLOCK, totalBytes, gbps: g, extra: { queuePairs: qps, window } });
      }
      // Verify every byte after the timed phases: read the whole region back into a clean buffer.
      buffer.fill(0);
      await engine.read(endpoint, [{ local, remote: descriptor }], { signal: ctx.signal });
      for (let i = 0; i < regionBytes; i++) if (buffer[i] !== expected[i]) failures++;
    } finally {
      await engine.close().catch(() => undefined);
      holder.send({ type: 'stop' });
      const stop = setTimeout(() => holder.kill(), 3000);
      await holder.exited;
      clearTimeout(stop);
    }
  }
  const gidIndex = sel.linkLayer === 'Ethernet' ? sel.gidIndex : undefined;
  for (const [tool, op] of [
    ['ib_read_bw', 'read'],
    ['ib_write_bw', 'write'],
  ] as const) {
    if (!perftestInstalled(tool)) {
      notes.push(`${tool} is not installed (perftest): no external baseline for ${op.toUpperCase()}`);
      continue;
    }
    for (const qps of QP_COUNTS) {
      const r = await perftest(tool, sel.device, gidIndex, qps, ctx.signal);
      notes.push(r.note);
      if (r.gbps === undefined) continue;
      const baseline = `${tool} -q ${qps} (perftest)`;
      measurements.push({ name: baseline, role: 'external', blockBytes: BLOCK, gbps: r.gbps, extra: { queuePairs: qps } });
      const subject = `rdma ${op.toUpperCase()} via engine, ${qps} QP${qps > 1 ? 's' : ''}/peer`;
      const value = (ours.get(`${op}/${qps}`) ?? 0) / r.gbps;
      ratios.push({ name: `rdma ${op}/${tool} @ 4 MiB, ${qps} QPs`, subject, baseline, blockBytes: BLOCK, value, ...(qps === 2 ? { goal: GOAL, pass: value >= GOAL } : {}) });
    }
  }
  return { scenario: 'rdma', measurements, ratios, verificationFailures: failures, notes };
};
