/**
 * `run` (the default): the remote-fetch flow of DESIGN.md end to end, in two processes.
 * The holder keeps blocks in a @tensorwire/cuda-ipc host pool and serves them through the
 * lock service and the engine's transports; the requester leases random blocks, reads them,
 * verifies every byte and releases. Reported beside the raw-socket and memcpy baselines from
 * the same run, with the holder's lease counters (acquired = released + expired + active).
 * The holder serves through cuda-ipc and TCP; the requester registers what `--transport` allows
 * (default both), so by default the engine takes the same-host path and says so in the notes.
 * When it does, the same run also measures a `--transport tcp` requester against the same
 * holder, for the same-host/TCP ratio: the two lanes alternate in rounds (same-host, tcp, tcp,
 * same-host, ...), each round a fresh requester process fetching for duration / rounds.
 * Figures are over all rounds of a lane; every fetch is broken down into its stages (acquire,
 * read, verify, release: see fetcher.ts), and the ratio arithmetic is in the notes.
 */
import { spawnWorker } from '../proc.js';
import { FETCH_FLOW, FETCH_WALL, fetchMeasurements, type FetchResult } from '../fetcher.js';
import { LEASE_PATH_WARMUP, median } from '../stats.js';
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
  /** Rounds per lane; the same-host and TCP lanes alternate (ABBA), each round durationMs / rounds. */
  rounds: number;
  /**
   * Untimed fetches of one block by each round's requester (a fresh process) before its timed
   * fetches: the lease path at steady state (see FetchOptions.warmupFetches). 0 with --quick.
   */
  warmupFetches: number;
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
    rounds: ctx.quick ? 1 : 2,
    warmupFetches: ctx.quick ? 0 : LEASE_PATH_WARMUP,
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
    const fetchWith = async (transport: TransportChoice, label: string, baselines: boolean): Promise<FetchResult> => {
      const req = spawnWorker('run-requester', [ready.lockAddress, String(s.blocks), String(s.blockBytes), String(s.blocksPerFetch), String(Math.max(1, Math.round(s.durationMs / s.rounds))), String(s.lanes), transport, baselines ? '1' : '0', String(s.warmupFetches)]);
      requesters.push(req);
      req.child.on('message', (m: { type?: string; done?: number; total?: number }) => {
        if (m?.type === 'progress') ctx.progress(label, Math.round((m.done ?? 0) / 100), Math.round((m.total ?? 1) / 100));
      });
      const outcome = await Promise.race([req.next<{ type: string; result?: FetchResult; message?: string }>((m) => m['type'] === 'result' || m['type'] === 'error', ctx.signal), holderDied]);
      if (outcome.type === 'error' || !outcome.result) throw new BenchError(`the requester (--transport ${transport}) failed: ${outcome.message ?? 'no result'}`);
      return outcome.result;
    };
    const first = await fetchWith(s.transport, 'run', true);
    const mainRounds = [first];
    const tcpRounds: FetchResult[] = [];
    // On one host, the same run also measures the network path, for the same-host/TCP ratio,
    // alternating with the same-host lane: A B B A A B ...
    const twoLanes = s.transport === 'auto' && first.transport === 'cuda-ipc';
    for (let k = 1; k < (twoLanes ? 2 * s.rounds : s.rounds); k++) {
      const tcpTurn = twoLanes && (k % 4 === 1 || k % 4 === 2);
      if (tcpTurn) tcpRounds.push(await fetchWith('tcp', `run (tcp lane, round ${tcpRounds.length + 1})`, false));
      else mainRounds.push(await fetchWith(s.transport, `run (round ${mainRounds.length + 1})`, false));
    }
    // Every lease the requesters took must be accounted for at the holder.
    holder.send({ type: 'counters' });
    const { counters } = await Promise.race([holder.next<{ counters: Record<string, number> }>((m) => m['type'] === 'counters', ctx.signal), holderDied]);
    const acquired = counters['acquired'] ?? 0;
    const balance = (counters['released'] ?? 0) + (counters['expired'] ?? 0) + (counters['active'] ?? 0);
    const notes = [`holder serves: ${ready.transports.join(', ')}`, ...ready.notes, ...first.notes, `holder lease counters: acquired ${acquired} = released ${counters['released']} + expired ${counters['expired']} + active ${counters['active']}${acquired === balance ? '' : '  <-- MISMATCH'}`];
    if (acquired !== balance) throw new BenchError(`lease counters do not balance: acquired ${acquired} != ${balance}`);
    for (const r of mainRounds.slice(1)) notes.push(...r.notes.filter((n) => /fetches of|MISMATCH|first failed/.test(n)).map((n) => `later round: ${n}`));
    const measurements = [...fetchMeasurements(mainRounds, s.blockBytes), ...first.measurements.filter((m) => m.role === 'baseline')];
    const ratios = [...first.ratios];
    let failures = mainRounds.reduce((t, r) => t + r.verificationFailures, 0);
    const flowGbps = (rs: readonly FetchResult[]): number => rs.reduce((t, r) => t + r.bytes, 0) / 1e9 / (rs.reduce((t, r) => t + r.flowMs, 0) / 1000);
    const wallGbps = (rs: readonly FetchResult[]): number => rs.reduce((t, r) => t + r.bytes, 0) / 1e9 / (rs.reduce((t, r) => t + r.elapsedMs, 0) / 1000);
    if (tcpRounds.length > 0) {
      const suffix = ', --transport tcp lane of the same run';
      measurements.push(...fetchMeasurements(tcpRounds, s.blockBytes, suffix).map((m) => ({ ...m, role: 'baseline' as const })));
      const flow = flowGbps(mainRounds) / flowGbps(tcpRounds);
      const wall = wallGbps(mainRounds) / wallGbps(tcpRounds);
      ratios.push({ name: 'same-host fetch/tcp fetch (same run; lease + grant + read + disposal, verification outside the timed part)', subject: FETCH_FLOW, baseline: `${FETCH_FLOW}${suffix}`, blockBytes: s.blockBytes, value: flow, goal: 5, pass: flow >= 5 });
      ratios.push({ name: 'same-host fetch/tcp fetch (same run; wall clock with verification)', subject: FETCH_WALL, baseline: `${FETCH_WALL}${suffix}`, blockBytes: s.blockBytes, value: wall });
      failures += tcpRounds.reduce((t, r) => t + r.verificationFailures, 0);
      notes.push(`tcp lane (same holder, alternating rounds): ${[tcpRounds[0]?.notes.find((n) => n.startsWith('transport chosen')) ?? '', ...tcpRounds.map((r) => r.notes.find((n) => /fetches of/.test(n)) ?? '')].join('; ')}`);
      // The ratio from the stage medians: per fetch, a lane costs acquire + read + disposal (+ verify on the wall clock).
      const st = (rs: readonly FetchResult[], k: keyof FetchResult['stages']): number => median(rs.flatMap((r) => r.stages[k]));
      const [a1, r1, v1, l1] = [st(mainRounds, 'acquire'), st(mainRounds, 'read'), st(mainRounds, 'verify'), st(mainRounds, 'release')];
      const [a2, r2, v2, l2] = [st(tcpRounds, 'acquire'), st(tcpRounds, 'read'), st(tcpRounds, 'verify'), st(tcpRounds, 'release')];
      const f = (x: number): string => x.toFixed(2);
      notes.push(
        `stage medians per fetch (ms), same-host: acquire ${f(a1)} + read ${f(r1)} + disposal ${f(l1)} (+ verify ${f(v1)}); tcp: acquire ${f(a2)} + read ${f(r2)} + disposal ${f(l2)} (+ verify ${f(v2)}). ` +
          `From these, the flow ratio is about (${f(a2)} + ${f(r2)} + ${f(l2)}) / (${f(a1)} + ${f(r1)} + ${f(l1)}) = ${f((a2 + r2 + l2) / (a1 + r1 + l1))}; with the lease cost (acquire + disposal) of the same-host lane at 0 it would be at most ${f((a2 + r2 + l2) / r1)}, and with no lease at all on either lane ${f(r2 / r1)} (the read ratio); ` +
          `5× needs (tcp acquire + read + disposal) >= 5 × (same-host acquire + read + disposal): with these reads and the same lease cost L = acquire + disposal on both lanes, L <= (tcp read − 5 × same-host read) / 4 = ${f((r2 - 5 * r1) / 4)} ms per fetch (now ${f(a1 + l1)} same-host, ${f(a2 + l2)} tcp)${r2 < 5 * r1 ? ': impossible at any lease cost, the reads alone are under 5×' : ''}`,
      );
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
