/**
 * `run` (the default): the remote-fetch flow of DESIGN.md end to end, in two processes.
 * The holder keeps blocks in a @tensorwire/cuda-ipc host pool and serves them through the
 * lock service and the engine's transports; the requester leases random blocks, reads them,
 * verifies every byte and releases. Reported beside the raw-socket and memcpy baselines from
 * the same run, with the holder's lease counters (acquired = released + expired + active).
 * The holder serves through cuda-ipc and TCP; the requester registers what `--transport` allows
 * (default both), so by default the engine takes the same-host path and says so in the notes.
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
  let requester: ReturnType<typeof spawnWorker> | undefined;
  try {
    const ready = await holder.next<{ lockAddress: string; transports: string[]; notes: string[] }>((m) => m['type'] === 'ready', ctx.signal);
    requester = spawnWorker('run-requester', [ready.lockAddress, String(s.blocks), String(s.blockBytes), String(s.blocksPerFetch), String(s.durationMs), String(s.lanes), s.transport]);
    const req = requester;
    req.child.on('message', (m: { type?: string; done?: number; total?: number }) => {
      if (m?.type === 'progress') ctx.progress('run', Math.round((m.done ?? 0) / 100), Math.round((m.total ?? 1) / 100));
    });
    const holderDied = holder.exited.then((x) => {
      throw new BenchError(`the holder process died (${x.signal ?? `exit code ${x.code}`}) during the run`);
    });
    const outcome = await Promise.race([req.next<{ type: string; result?: FetchResult; message?: string }>((m) => m['type'] === 'result' || m['type'] === 'error', ctx.signal), holderDied]);
    if (outcome.type === 'error' || !outcome.result) throw new BenchError(`the requester failed: ${outcome.message ?? 'no result'}`);
    const result = outcome.result;
    // Every lease the requester took must be accounted for at the holder.
    holder.send({ type: 'counters' });
    const { counters } = await Promise.race([holder.next<{ counters: Record<string, number> }>((m) => m['type'] === 'counters', ctx.signal), holderDied]);
    const acquired = counters['acquired'] ?? 0;
    const balance = (counters['released'] ?? 0) + (counters['expired'] ?? 0) + (counters['active'] ?? 0);
    const notes = [`holder serves: ${ready.transports.join(', ')}`, ...ready.notes, ...result.notes, `holder lease counters: acquired ${acquired} = released ${counters['released']} + expired ${counters['expired']} + active ${counters['active']}${acquired === balance ? '' : '  <-- MISMATCH'}`];
    if (acquired !== balance) throw new BenchError(`lease counters do not balance: acquired ${acquired} != ${balance}`);
    void holderDied.catch(() => undefined);
    return { scenario: 'run', measurements: result.measurements, ratios: result.ratios, verificationFailures: result.verificationFailures, counters, notes };
  } finally {
    requester?.kill();
    holder.send({ type: 'stop' });
    const t = setTimeout(() => holder.kill(), 3000);
    await Promise.allSettled([holder.exited, requester?.exited]);
    clearTimeout(t);
  }
}
