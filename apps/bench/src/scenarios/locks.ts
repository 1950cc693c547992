/**
 * Scenario `locks`: acquire-and-release cycles of @tensorwire/lock-client against a holder
 * in a child process, next to a plain @grpc/grpc-js unary echo served by the same child
 * and measured in the same run (interleaved rounds). One lock cycle is two round trips
 * (acquire, release), so the ratio compares it with two echo round trips; goal ≥ 0.8.
 *
 * Fault injection: requester children acquire leases and are SIGKILLed mid-lease; the
 * holder's GC must expire them, and its counters must show every lease accounted for
 * (acquired = released + expired + active).
 */
import * as grpc from '@grpc/grpc-js';
import { LockClient } from '@tensorwire/lock-client';
import { ECHO_SERVICE } from '../echo.js';
import { spawnWorker, type Worker } from '../proc.js';
import { leaseCallPath, median, nowMs, summarize } from '../stats.js';
import { BenchError, type Measurement, type Ratio, type Scenario, type ScenarioContext, type ScenarioResult } from '../types.js';

interface EchoClient extends grpc.Client {
  Echo(req: Buffer, cb: (e: grpc.ServiceError | null, r?: Buffer) => void): grpc.ClientUnaryCall;
}

interface HolderCounters {
  acquired: number;
  released: number;
  expired: number;
  active: number;
  blocksAcquired: number;
  blocksReleased: number;
  blocksExpired: number;
  activeBlocks: number;
  pinnedBlocks: number;
  rejected: number;
  pinnedByHook: number;
}

const GOAL = 0.8;

/** The pause before a round trip in the gap measurements (ms): about one 64 MiB same-host read here. */
const GAP_MS = 5;
type GapKind = 'none' | 'busy' | 'idle';
const GAP_KINDS: readonly GapKind[] = ['none', 'busy', 'idle'];
const GAP_NAMES: Record<GapKind, string> = {
  none: 'back to back',
  busy: `after ${GAP_MS} ms of computing`,
  idle: `after ${GAP_MS} ms idle`,
};

/** Consecutive cycles of one kind of pause, kept (after one that is not). */
const GAP_RUN = 10;

/** A pause: nothing, the event loop held by a spin on the clock, or a timer. */
async function gap(kind: GapKind): Promise<void> {
  if (kind === 'busy') {
    const end = nowMs() + GAP_MS;
    while (nowMs() < end);
  } else if (kind === 'idle') await new Promise((r) => setTimeout(r, GAP_MS));
}

/**
 * Whether `bytes` are exactly the bytes of `text` (an id: ASCII by its grammar, so one
 * byte per character). Compares in place rather than decoding a string per block.
 */
function sameAsciiBytes(bytes: Uint8Array, text: string): boolean {
  if (bytes.byteLength !== text.length) return false;
  for (let i = 0; i < text.length; i++) if (bytes[i] !== text.charCodeAt(i)) return false;
  return true;
}

export const locks: Scenario = async (ctx): Promise<ScenarioResult> => {
  const { signal } = ctx;
  const lockTimeoutMs = ctx.quick ? 800 : 2000;
  const rounds = ctx.quick ? 4 : 10;
  const perRound = ctx.quick ? 50 : 1000;
  const warmup = ctx.quick ? 50 : 500;
  const victims = ctx.quick ? 2 : 4;
  const blocksPerLease = 4;
  const notes: string[] = [];
  const workers: Worker[] = [];
  let client: LockClient | undefined;
  /** The same lock cycles with the Session messages on the gRPC stream (no local lane), for the pause rows. */
  let streamClient: LockClient | undefined;
  let echo: EchoClient | undefined;
  try {
    const holderW = spawnWorker('locks-holder', [String(lockTimeoutMs)]);
    workers.push(holderW);
    const { lockPort, echoPort } = await holderW.next<{ lockPort: number; echoPort: number }>((m) => m['type'] === 'listening', signal);
    const holder = `127.0.0.1:${lockPort}`;
    client = new LockClient({ requesterId: 'bench' });
    streamClient = new LockClient({ requesterId: 'bench-stream', localLane: false });
    const Echo = grpc.makeGenericClientConstructor(ECHO_SERVICE, 'Echo') as unknown as new (a: string, c: grpc.ChannelCredentials) => EchoClient;
    echo = new Echo(`127.0.0.1:${echoPort}`, grpc.credentials.createInsecure());
    const echoClient = echo;
    const payload = Buffer.alloc(64, 7);
    const echoOnce = (): Promise<void> =>
      new Promise((resolve, reject) => {
        echoClient.Echo(payload, (e, r) => {
          if (e) reject(e);
          else if (r === undefined || !r.equals(payload)) reject(new BenchError('echo returned different bytes'));
          else resolve();
        });
      });

    let verificationFailures = 0;
    let blockSeq = 0;
    const lockCycle = async (by: LockClient = client as LockClient): Promise<void> => {
      const ids = Array.from({ length: blocksPerLease }, () => `block:benchholder:${blockSeq++ % 100_000}`);
      const guard = await by.acquire(holder, ids, { signal });
      try {
        for (const id of ids) {
          const d = guard.descriptorsFor(id)[0];
          if (d === undefined || !sameAsciiBytes(d, id)) verificationFailures++;
        }
      } finally {
        const r = await guard.release();
        if (!r.confirmed || r.blocksReleased !== blocksPerLease) verificationFailures++;
      }
    };
    const echoPair = async (): Promise<void> => {
      await echoOnce();
      await echoOnce();
    };

    // Warm both paths (connections, JIT).
    const viaStream = streamClient;
    for (let i = 0; i < warmup; i++) {
      await echoPair();
      await lockCycle();
      await lockCycle(viaStream);
    }
    const lockSamples: number[] = [];
    const echoSamples: number[] = [];
    let lockMs = 0;
    let echoMs = 0;
    const total = rounds * 2;
    for (let r = 0; r < rounds; r++) {
      if (signal.aborted) throw new BenchError('aborted');
      // Alternate which goes first so drift affects both alike.
      const order = r % 2 === 0 ? (['echo', 'lock'] as const) : (['lock', 'echo'] as const);
      for (const what of order) {
        const start = nowMs();
        for (let i = 0; i < perRound; i++) {
          const t0 = nowMs();
          if (what === 'lock') await lockCycle();
          else await echoPair();
          (what === 'lock' ? lockSamples : echoSamples).push(nowMs() - t0);
        }
        const elapsed = nowMs() - start;
        if (what === 'lock') lockMs += elapsed;
        else echoMs += elapsed;
        ctx.progress('locks: cycles', r * 2 + (what === order[0] ? 1 : 2), total);
      }
    }
    const lockOps = lockSamples.length / (lockMs / 1000);
    const echoOps = echoSamples.length / (echoMs / 1000);
    const ratio = lockOps / echoOps;

    // What a pause before a round trip costs on this host: the same lock cycle and echo pair
    // right after the previous one, after GAP_MS of this process computing (the holder idle, as
    // during a same-host copy), and after GAP_MS of both processes idle.
    const gapSamples: Record<GapKind, { lock: number[]; stream: number[]; echo: number[] }> = {
      none: { lock: [], stream: [], echo: [] },
      busy: { lock: [], stream: [], echo: [] },
      idle: { lock: [], stream: [], echo: [] },
    };
    // Runs of GAP_RUN cycles of one kind (the first of each run, which follows another kind, not
    // kept), the kinds and the two calls rotating run by run.
    const gapRuns = ctx.quick ? 1 : 30;
    for (let i = 0; i < gapRuns; i++) {
      for (const kind of GAP_KINDS) {
        for (const what of ['lock', 'stream', 'echo'] as const) {
          if (signal.aborted) throw new BenchError('aborted');
          for (let k = 0; k <= GAP_RUN; k++) {
            await gap(kind);
            const t0 = nowMs();
            if (what === 'lock') await lockCycle();
            else if (what === 'stream') await lockCycle(viaStream);
            else await echoPair();
            if (k > 0) gapSamples[kind][what].push(nowMs() - t0);
          }
        }
      }
    }
    const gapCycles = gapRuns * GAP_RUN;
    const path = leaseCallPath(client.sessionStats().get(holder));
    if (path !== undefined) notes.push(`lock cycles' calls: ${path}`);

    // Fault injection: requesters SIGKILLed while they hold leases.
    const victimWorkers: Worker[] = [];
    for (let i = 0; i < victims; i++) {
      const ids = Array.from({ length: blocksPerLease }, (_, j) => `block:benchholder:victim${i}-${j}`);
      const w = spawnWorker('locks-requester', [holder, `victim${i}`, ...ids, 'block:benchholder:shared']);
      workers.push(w);
      victimWorkers.push(w);
    }
    for (const w of victimWorkers) await w.next((m) => m['type'] === 'acquired', signal);
    const countersNow = async (): Promise<HolderCounters> => {
      holderW.send({ type: 'counters' });
      // No signal here: Worker.next leaves its abort listener behind, and this runs in a loop.
      // A dead holder rejects the wait; the loop below checks the signal itself.
      const m = await holderW.next<{ counters: HolderCounters }>((x) => x['type'] === 'counters');
      return m.counters;
    };
    const beforeKill = await countersNow();
    for (const w of victimWorkers) {
      w.kill();
      await w.exited;
    }
    ctx.log(`locks: killed ${victims} requesters holding leases; waiting for the holder's GC`);
    const killedAt = nowMs();
    let after = await countersNow();
    while (after.active > 0) {
      if (signal.aborted) throw new BenchError('aborted');
      if (nowMs() - killedAt > lockTimeoutMs * 10) throw new BenchError(`holder still has ${after.active} leases ${lockTimeoutMs * 10} ms after the requesters died`);
      await new Promise((r) => setTimeout(r, Math.max(10, lockTimeoutMs / 20)));
      after = await countersNow();
    }
    const gcWaitMs = nowMs() - killedAt;
    const balanced = after.acquired === after.released + after.expired + after.active && after.blocksAcquired === after.blocksReleased + after.blocksExpired + after.activeBlocks;
    if (!balanced) verificationFailures++;
    if (after.expired !== victims) {
      verificationFailures++;
      notes.push(`expected ${victims} expired leases, holder reports ${after.expired}`);
    }
    if (after.pinnedBlocks !== 0 || after.pinnedByHook !== 0) verificationFailures++;
    const cc = client.counters();
    if (cc.acquired !== cc.released + cc.releaseFailures + cc.expired + cc.dropped + cc.active || cc.active !== 0) verificationFailures++;

    const lockLatency = summarize(lockSamples);
    const echoLatency = summarize(echoSamples);
    const measurements: Measurement[] = [
      {
        name: `lock acquire+release (${blocksPerLease} blocks)`,
        role: 'subject',
        opsPerSec: lockOps,
        latency: lockLatency,
        extra: { blocksPerLease, cycles: lockSamples.length },
      },
      {
        name: 'raw @grpc/grpc-js unary echo ×2',
        role: 'baseline',
        opsPerSec: echoOps,
        latency: echoLatency,
        extra: { payloadBytes: payload.length, pairs: echoSamples.length },
      },
    ];
    const ratios: Ratio[] = [
      {
        name: 'lock cycle vs two echo round trips',
        subject: measurements[0]?.name ?? '',
        baseline: measurements[1]?.name ?? '',
        value: ratio,
        goal: GOAL,
        pass: ratio >= GOAL,
      },
    ];
    const lockLabel = `lock acquire+release (${blocksPerLease} blocks)`;
    const streamLabel = `${lockLabel} on the gRPC Session stream (localLane: false)`;
    for (const what of ['lock', 'stream', 'echo'] as const) {
      const label = what === 'lock' ? lockLabel : what === 'stream' ? streamLabel : 'raw @grpc/grpc-js unary echo ×2';
      for (const kind of GAP_KINDS) {
        measurements.push({ name: `${label}, ${GAP_NAMES[kind]}`, role: kind === 'none' ? 'baseline' : 'subject', latency: summarize(gapSamples[kind][what]), extra: { gapMs: kind === 'none' ? 0 : GAP_MS, cycles: gapSamples[kind][what].length } });
      }
      const p50 = (kind: GapKind): number => median(gapSamples[kind][what]);
      for (const kind of ['busy', 'idle'] as const) {
        // Time per cycle: the back-to-back cycle's median over the one after the gap (below 1: the gap costs).
        ratios.push({ name: `${label}: back to back / ${GAP_NAMES[kind]} (median cycle)`, subject: `${label}, ${GAP_NAMES.none}`, baseline: `${label}, ${GAP_NAMES[kind]}`, value: p50('none') / p50(kind) });
      }
    }
    // What the holder's local lane saves, per pause: the stream's median cycle over the lane's.
    for (const kind of GAP_KINDS) {
      ratios.push({ name: `lock cycle, local lane/gRPC stream, ${GAP_NAMES[kind]} (median cycle)`, subject: `${lockLabel}, ${GAP_NAMES[kind]}`, baseline: `${streamLabel}, ${GAP_NAMES[kind]}`, value: median(gapSamples[kind].stream) / median(gapSamples[kind].lock) });
    }
    notes.push(
      `holder in a child process, lock timeout ${lockTimeoutMs} ms; one request in flight; ${rounds} interleaved rounds of ${perRound}`,
      `pauses: ${gapCycles} cycles of each kind, in runs of ${GAP_RUN} that rotate kinds (lock cycle and echo pair each right after the previous call, after ${GAP_MS} ms of this process spinning on the clock while the holder waits, as during a same-host copy, and after a ${GAP_MS} ms timer with both idle); medians per cycle: lock ${GAP_KINDS.map((k) => `${k} ${median(gapSamples[k].lock).toFixed(3)}`).join(', ')} ms; lock on the gRPC stream ${GAP_KINDS.map((k) => `${k} ${median(gapSamples[k].stream).toFixed(3)}`).join(', ')} ms; echo pair ${GAP_KINDS.map((k) => `${k} ${median(gapSamples[k].echo).toFixed(3)}`).join(', ')} ms. What a round trip costs after a pause (caches, branch predictors and, on a VM, a halted virtual CPU) is what a lease pays after a fetch's read`,
      `fault injection: ${victims} requester processes SIGKILLed mid-lease; GC expired them ${Math.round(gcWaitMs)} ms after the kill (before: ${beforeKill.active} active)`,
      `holder counters: acquired ${after.acquired} = released ${after.released} + expired ${after.expired} + active ${after.active} → ${balanced ? 'balanced' : 'NOT BALANCED'}`,
    );
    return {
      scenario: 'locks',
      measurements,
      ratios,
      verificationFailures,
      counters: {
        acquired: after.acquired,
        released: after.released,
        expired: after.expired,
        active: after.active,
        blocksAcquired: after.blocksAcquired,
        blocksReleased: after.blocksReleased,
        blocksExpired: after.blocksExpired,
        activeBlocks: after.activeBlocks,
        pinnedBlocks: after.pinnedBlocks,
        rejected: after.rejected,
        requesterKilled: victims,
        clientReleaseFailures: cc.releaseFailures,
      },
      notes,
    };
  } finally {
    echo?.close();
    await client?.close();
    await streamClient?.close();
    for (const w of workers) w.kill();
    await Promise.all(workers.map((w) => w.exited));
  }
};

/** Settings of `locks --burst N`. */
export interface LocksBurstSettings {
  /** Leases released at once (and echoes sent at once for the baseline). */
  readonly burst: number;
  /** Interleaved rounds (default 3, 1 with --quick). */
  readonly rounds?: number;
  /** Concurrency of the acquires that set each round up (not measured; default 256). */
  readonly acquireConcurrency?: number;
  /**
   * Directory of another build of @tensorwire/lock-client's `dist` (e.g. the previous
   * release) to measure beside this one in the same run, holder and requester alike.
   */
  readonly against?: string;
}

interface BurstSide {
  readonly name: string;
  readonly holder: Worker;
  readonly requester: Worker;
  ms: number;
  cpuMicros: number;
  ops: number;
  attempts: number;
}

interface CpuMsg {
  userMicros: number;
  systemMicros: number;
}

const BURST_GOAL_ECHO = 0.8;
const BURST_GOAL_AGAINST = 5;

async function holderCpu(w: Worker, signal: AbortSignal): Promise<number> {
  w.send({ type: 'cpu' });
  const m = await w.next<CpuMsg>((x) => x['type'] === 'cpu', signal);
  return m.userMicros + m.systemMicros;
}

/**
 * `locks --burst N`: N leases held by one requester process are released all at once
 * (every `release()` issued before any is awaited), against a holder in another process;
 * beside it, the same number of plain grpc-js unary echoes sent at once to the same holder
 * process. Reports releases per second and the holder's CPU seconds per 1,000 releases
 * (or echoes), over interleaved rounds. With `against`, another build of the package
 * (holder and requester) is measured in the same rounds.
 */
export async function locksBurst(ctx: ScenarioContext, settings: LocksBurstSettings): Promise<ScenarioResult> {
  const { signal } = ctx;
  const n = settings.burst;
  if (!Number.isSafeInteger(n) || n <= 0) throw new BenchError(`--burst must be a positive whole number, got ${n}`);
  const rounds = settings.rounds ?? (ctx.quick ? 1 : 3);
  const concurrency = settings.acquireConcurrency ?? 256;
  const lockTimeoutMs = 600_000;
  const maxSessions = Math.max(200_000, n * 2);
  const workers: Worker[] = [];
  const notes: string[] = [];
  let verificationFailures = 0;
  try {
    const start = async (name: string, dir: string | undefined): Promise<BurstSide> => {
      const serverModule = dir === undefined ? '' : `${dir.replace(/\/$/, '')}/server/index.js`;
      const clientModule = dir === undefined ? '' : `${dir.replace(/\/$/, '')}/index.js`;
      const holder = spawnWorker('locks-burst-holder', [String(lockTimeoutMs), String(maxSessions), serverModule]);
      workers.push(holder);
      const { lockPort, echoPort } = await holder.next<{ lockPort: number; echoPort: number }>((m) => m['type'] === 'listening', signal);
      const requester = spawnWorker('locks-burst-requester', [`127.0.0.1:${lockPort}`, `127.0.0.1:${echoPort}`, clientModule]);
      workers.push(requester);
      await requester.next((m) => m['type'] === 'ready', signal);
      return { name, holder, requester, ms: 0, cpuMicros: 0, ops: 0, attempts: 0 };
    };
    const subject = await start(`lock release burst (${n} leases at once)`, undefined);
    const against = settings.against === undefined ? undefined : await start(`lock release burst (${n} leases at once, build at ${settings.against})`, settings.against);
    const echo: BurstSide = { ...subject, name: `raw @grpc/grpc-js unary echo burst (${n} at once)`, ms: 0, cpuMicros: 0, ops: 0, attempts: 0 };

    const releaseRound = async (side: BurstSide): Promise<void> => {
      side.requester.send({ type: 'acquire', n, concurrency, leaseMs: lockTimeoutMs });
      await side.requester.next((m) => m['type'] === 'acquired', signal);
      const cpu0 = await holderCpu(side.holder, signal);
      side.requester.send({ type: 'release' });
      const r = await side.requester.next<{ n: number; ms: number; confirmed: number; failed: number; blocksReleased: number; attempts: number }>(
        (m) => m['type'] === 'released' || m['type'] === 'error',
        signal,
      );
      const cpu1 = await holderCpu(side.holder, signal);
      if (r.confirmed !== n || r.blocksReleased !== n) {
        verificationFailures++;
        notes.push(`${side.name}: ${r.confirmed} of ${n} releases confirmed, ${r.blocksReleased} blocks released`);
      }
      side.ms += r.ms;
      side.cpuMicros += cpu1 - cpu0;
      side.ops += n;
      side.attempts += r.attempts;
    };
    const echoRound = async (): Promise<void> => {
      const cpu0 = await holderCpu(echo.holder, signal);
      echo.requester.send({ type: 'echo', n });
      const r = await echo.requester.next<{ ms: number; failed: number }>((m) => m['type'] === 'echoed', signal);
      const cpu1 = await holderCpu(echo.holder, signal);
      if (r.failed > 0) verificationFailures++;
      echo.ms += r.ms;
      echo.cpuMicros += cpu1 - cpu0;
      echo.ops += n;
    };
    // Warm both paths once (connections, JIT) with a small burst, not measured.
    echo.requester.send({ type: 'echo', n: Math.min(n, 1000) });
    await echo.requester.next((m) => m['type'] === 'echoed', signal);

    const steps: (() => Promise<void>)[] = [echoRound, () => releaseRound(subject)];
    if (against !== undefined) steps.push(() => releaseRound(against));
    for (let r = 0; r < rounds; r++) {
      if (signal.aborted) throw new BenchError('aborted');
      // Rotate the order so drift on a shared machine affects every side alike.
      for (let k = 0; k < steps.length; k++) {
        await (steps[(r + k) % steps.length] as () => Promise<void>)();
        ctx.progress('locks: burst rounds', r * steps.length + k + 1, rounds * steps.length);
      }
    }

    const sides = against === undefined ? [subject, echo] : [subject, echo, against];
    const counters: Record<string, number> = {};
    for (const side of [subject, ...(against ? [against] : [])]) {
      side.holder.send({ type: 'counters' });
      const c = (await side.holder.next<{ counters: HolderCounters }>((m) => m['type'] === 'counters', signal)).counters;
      const balanced = c.acquired === c.released + c.expired + c.active && c.active === 0;
      if (!balanced) verificationFailures++;
      notes.push(`${side.name}: holder counters acquired ${c.acquired} = released ${c.released} + expired ${c.expired} + active ${c.active} → ${balanced ? 'balanced' : 'NOT BALANCED'}`);
      const prefix = side === subject ? '' : 'against.';
      counters[`${prefix}acquired`] = c.acquired;
      counters[`${prefix}released`] = c.released;
      counters[`${prefix}expired`] = c.expired;
      counters[`${prefix}active`] = c.active;
    }
    const measurements: Measurement[] = sides.map((s) => ({
      name: s.name,
      role: s === echo ? 'baseline' : 'subject',
      opsPerSec: s.ops / (s.ms / 1000),
      extra: {
        burst: n,
        rounds,
        holderCpuSecondsPer1000: s.cpuMicros / 1e6 / (s.ops / 1000),
        ...(s === echo ? {} : { releaseAttemptsPerLease: s.attempts / s.ops }),
      },
    }));
    const rate = (s: BurstSide): number => s.ops / (s.ms / 1000);
    const ratios: Ratio[] = [
      { name: 'release burst vs echo burst', subject: subject.name, baseline: echo.name, value: rate(subject) / rate(echo), goal: BURST_GOAL_ECHO, pass: rate(subject) / rate(echo) >= BURST_GOAL_ECHO },
    ];
    if (against !== undefined) {
      const v = rate(subject) / rate(against);
      ratios.push({ name: 'release burst vs the other build', subject: subject.name, baseline: against.name, value: v, goal: BURST_GOAL_AGAINST, pass: v >= BURST_GOAL_AGAINST });
    }
    notes.push(
      `holder in a child process, requester in another; ${rounds} interleaved rounds; leases acquired with concurrency ${concurrency} before each round (not measured)`,
      'holder CPU seconds per 1,000 releases (or echoes): user + system time of the holder process across the burst',
    );
    for (const side of [subject, ...(against ? [against] : [])]) {
      side.requester.send({ type: 'close' });
      await side.requester.next((m) => m['type'] === 'closed', signal);
    }
    return { scenario: 'locks', measurements, ratios, verificationFailures, counters, notes };
  } finally {
    for (const w of workers) w.kill();
    await Promise.all(workers.map((w) => w.exited));
  }
}
