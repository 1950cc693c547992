/**
 * `run` (the default): the remote-fetch flow of DESIGN.md end to end, in two processes.
 * The holder keeps blocks in a @tensorwire/cuda-ipc host pool and serves them through the
 * lock service and the engine's transports; the requester leases random blocks, reads them,
 * verifies every byte and releases. Reported beside the raw-socket and memcpy baselines from
 * the same run, with the holder's lease counters (acquired = released + expired + active).
 * The holder serves through cuda-ipc and TCP; the requester registers what `--transport` allows
 * (default both), so by default the engine takes the same-host path and says so in the notes.
 * When it does, the same run then measures a `--transport tcp` requester against the same
 * holder, for the same-host/TCP ratio.
 */
import { spawnWorker } from '../proc.js';
import type { FetchResult } from '../fetcher.js';
import type { TransportChoice } from '../transports.js';
import { BenchError, type ScenarioContext, type ScenarioResult } from '../types.js';

export interface RunSettings {
  blocks: number;
  blockBytes: number;
  blocksPerFetch: number;
  durationMs: number;
  lanes: number;
  lockTimeoutMs: number;
  transport: TransportChoice;
}

export function runSettings(ctx: ScenarioContext, durationMs?: number, transport: TransportChoice = 'auto'): RunSettings {
  const blockBytes = ctx.sizes?.[0] ?? (ctx.quick ? 64 * 1024 : 1024 * 1024);
  return {
    blocks: ctx.quick ? 16 : 64,
    blockBytes,
    blocksPerFetch: ctx.quick ? 4 : 8,
    durationMs: durationMs ?? (ctx.quick ? 1500 : 10_000),
    lanes: 2,
    lockTimeoutMs: 5_000,
    transport,
  };
}

export async function runScenario(ctx: ScenarioContext, settings: RunSettings = runSettings(ctx)): Promise<ScenarioResult> {
  const s = settings;
  if (s.blocks * s.blockBytes > 8 * 1024 ** 3) throw new BenchError(`${s.blocks} blocks of ${s.blockBytes} bytes do not fit a bench holder (8 GiB at most)`);
  const holder = spawnWorker('run-holder', [String(s.blocks), String(s.blockBytes), String(s.lockTimeoutMs)]);
  const requesters: ReturnType<typeof spawnWorker>[] = [];
  try {
    const ready = await holder.next<{ lockAddress: string; transports: string[]; notes: string[] }>((m) => m['type'] === 'ready', ctx.signal);
    const holderDied = holder.exited.then((x) => {
      throw new BenchError(`the holder process died (${x.signal ?? `exit code ${x.code}`}) during the run`);
    });
    void holderDied.catch(() => undefined);
    const fetchWith = async (transport: TransportChoice, label: string): Promise<FetchResult> => {
      const req = spawnWorker('run-requester', [ready.lockAddress, String(s.blocks), String(s.blockBytes), String(s.blocksPerFetch), String(s.durationMs), String(s.lanes), transport]);
      requesters.push(req);
      req.child.on('message', (m: { type?: string; done?: number; total?: number }) => {
        if (m?.type === 'progress') ctx.progress(label, Math.round((m.done ?? 0) / 100), Math.round((m.total ?? 1) / 100));
      });
      const outcome = await Promise.race([req.next<{ type: string; result?: FetchResult; message?: string }>((m) => m['type'] === 'result' || m['type'] === 'error', ctx.signal), holderDied]);
      if (outcome.type === 'error' || !outcome.result) throw new BenchError(`the requester (--transport ${transport}) failed: ${outcome.message ?? 'no result'}`);
      return outcome.result;
    };
    const result = await fetchWith(s.transport, 'run');
    const subject = result.measurements[0];
    // On one host, the same run also measures the network path, for the same-host/TCP ratio.
    let tcp: FetchResult | undefined;
    if (s.transport === 'auto' && subject?.transport === 'cuda-ipc') tcp = await fetchWith('tcp', 'run (tcp lane)');
    // Every lease the requesters took must be accounted for at the holder.
    holder.send({ type: 'counters' });
    const { counters } = await Promise.race([holder.next<{ counters: Record<string, number> }>((m) => m['type'] === 'counters', ctx.signal), holderDied]);
    const acquired = counters['acquired'] ?? 0;
    const balance = (counters['released'] ?? 0) + (counters['expired'] ?? 0) + (counters['active'] ?? 0);
    const notes = [`holder serves: ${ready.transports.join(', ')}`, ...ready.notes, ...result.notes, `holder lease counters: acquired ${acquired} = released ${counters['released']} + expired ${counters['expired']} + active ${counters['active']}${acquired === balance ? '' : '  <-- MISMATCH'}`];
    if (acquired !== balance) throw new BenchError(`lease counters do not balance: acquired ${acquired} != ${balance}`);
    const measurements = [...result.measurements];
    const ratios = [...result.ratios];
    let failures = result.verificationFailures;
    if (tcp && subject) {
      const t = tcp.measurements[0];
      if (t) {
        measurements.push({ ...t, name: `${t.name}, --transport tcp lane of the same run`, role: 'baseline' });
        ratios.push({ name: 'same-host fetch/tcp fetch (same run)', subject: subject.name, baseline: `${t.name}, --transport tcp lane of the same run`, blockBytes: s.blockBytes, value: (subject.gbps ?? 0) / (t.gbps ?? 1), goal: 5, pass: (subject.gbps ?? 0) / (t.gbps ?? 1) >= 5 });
      }
      failures += tcp.verificationFailures;
      notes.push(`tcp lane (same holder, right after): ${tcp.notes.filter((n) => n.startsWith('transport chosen') || /fetches of/.test(n)).join('; ')}`);
    }
    return { scenario: 'run', measurements, ratios, verificationFailures: failures, counters, notes };
  } finally {
    for (const r of requesters) r.kill();
    holder.send({ type: 'stop' });
    const t = setTimeout(() => holder.kill(), 3000);
    await Promise.allSettled([holder.exited, ...requesters.map((r) => r.exited)]);
    clearTimeout(t);
  }
}
