/**
 * `tcp`: two processes on loopback. The requester reads blocks from the holder through the
 * engine's TCP transport (window of concurrent block reads, every byte verified after the
 * timed phase), and the same process pair streams the same bytes over a raw node:net socket
 * as the baseline. Rounds alternate subject and baseline; the best round of each is kept.
 */
import { spawnWorker } from '../proc.js';
import { summarize } from '../stats.js';
import type { Measurement, Ratio, ScenarioContext, ScenarioResult } from '../types.js';
import { formatBytes } from '../units.js';

export const DEFAULT_SWEEP = [4 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024, 64 * 1024 * 1024];
const GiB = 1024 * 1024 * 1024;

/** Block reads kept in flight: enough to cover 16 MiB (so small blocks are not latency-bound), 4 to 256. */
export function windowFor(blockBytes: number): number {
  return Math.min(256, Math.max(4, Math.ceil((16 * 1024 * 1024) / blockBytes)));
}

export async function tcp(ctx: ScenarioContext): Promise<ScenarioResult> {
  const sizes = ctx.sizes ?? (ctx.quick ? [64 * 1024, 1024 * 1024] : DEFAULT_SWEEP);
  const largest = Math.max(...sizes);
  const regionBytes = Math.max(largest, ctx.quick ? 4 * 1024 * 1024 : 64 * 1024 * 1024);
  const rounds = ctx.quick ? 1 : 2;
  const holder = spawnWorker('tcp-holder', [String(regionBytes)]);
  let requester: ReturnType<typeof spawnWorker> | undefined;
  try {
    const ready = await holder.next<{ endpoint: string; descriptor: string; rawPort: number }>((m) => m['type'] === 'ready', ctx.signal);
    requester = spawnWorker('tcp-requester', [ready.endpoint, ready.descriptor, String(ready.rawPort), String(regionBytes)]);
    await requester.next((m) => m['type'] === 'ready', ctx.signal);
    const measurements: Measurement[] = [];
    const ratios: Ratio[] = [];
    const notes: string[] = [];
    let failures = 0;
    let id = 0;
    const steps = sizes.length * rounds * 3;
    let done = 0;
    for (const blockBytes of sizes) {
      // 1 GiB at 4 MiB and up (the figure); fewer bytes for small blocks so the sweep stays short.
      const totalBytes = ctx.totalBytes ?? (ctx.quick ? 8 * blockBytes : blockBytes >= 4 * 1024 * 1024 ? GiB : Math.min(GiB, blockBytes * 16384));
      let bestEngine: Record<string, unknown> | undefined;
      let bestRaw: Record<string, unknown> | undefined;
      let bestRaw2: Record<string, unknown> | undefined;
      const latencies: number[] = [];
      for (let r = 0; r < rounds; r++) {
        for (const type of ['raw', 'engine', 'raw2'] as const) {
          const rid = ++id;
          requester.send({ type, id: rid, blockBytes, totalBytes, window: windowFor(blockBytes) });
          const res = await requester.next<Record<string, unknown>>((m) => m['id'] === rid, ctx.signal);
          if (res['type'] === 'error') throw new Error(`tcp ${type} run failed: ${String(res['message'])}`);
          ctx.progress('tcp', ++done, steps);
          if (type === 'engine') {
            failures += Number(res['failures']);
            latencies.push(...(res['latencies'] as number[]));
            if (!bestEngine || Number(res['gbps']) > Number(bestEngine['gbps'])) bestEngine = res;
            if (notes.length === 0) notes.push(`transport chosen: ${String(res['transport'])} — ${String(res['reason'])}`);
          } else if (type === 'raw') {
            if (!bestRaw || Number(res['gbps']) > Number(bestRaw['gbps'])) bestRaw = res;
          } else if (!bestRaw2 || Number(res['gbps']) > Number(bestRaw2['gbps'])) bestRaw2 = res;
        }
      }
      const eng = bestEngine as Record<string, unknown>;
      const raw = bestRaw as Record<string, unknown>;
      const subject = `tcp READ via engine`;
      const baseline = 'raw node:net stream';
      measurements.push({ name: subject, role: 'subject', blockBytes, totalBytes: Number(eng['bytes']), gbps: Number(eng['gbps']), latency: summarize(latencies) });
      measurements.push({ name: baseline, role: 'baseline', blockBytes, totalBytes: Number(raw['bytes']), gbps: Number(raw['gbps']) });
      const raw2 = bestRaw2 as Record<string, unknown>;
      const baseline2 = 'raw node:net, 2 sockets, onread';
      measurements.push({ name: baseline2, role: 'baseline', blockBytes, totalBytes: Number(raw2['bytes']), gbps: Number(raw2['gbps']) });
      const value = Number(eng['gbps']) / Number(raw['gbps']);
      const goal = blockBytes === 4 * 1024 * 1024 ? 0.9 : undefined;
      ratios.push({ name: `tcp/raw @ ${formatBytes(blockBytes)}`, subject, baseline, blockBytes, value, ...(goal !== undefined ? { goal, pass: value >= goal } : {}) });
      ratios.push({ name: `tcp/raw-2-onread @ ${formatBytes(blockBytes)}`, subject, baseline: baseline2, blockBytes, value: Number(eng['gbps']) / Number(raw2['gbps']) });
    }
    notes.push('baselines: one plain node:net stream with data events (the issue\'s baseline), and the strongest Node receive path: 2 sockets receiving with onread straight into the same destination memory, no protocol, no verification');
    notes.push(`requester keeps enough block reads in flight to cover 16 MiB (4 to 256); engine: 2 streams per peer, 1 MiB chunks; best of ${rounds} alternating round(s) each`);
    return { scenario: 'tcp', measurements, ratios, verificationFailures: failures, notes };
  } finally {
    requester?.send({ type: 'stop' });
    holder.send({ type: 'stop' });
    const stop = setTimeout(() => {
      requester?.kill();
      holder.kill();
    }, 3000);
    await Promise.allSettled([holder.exited, requester?.exited]);
    clearTimeout(stop);
  }
}
