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
import { nowMs, summarize } from '../stats.js';
import { BenchError, type Measurement, type Ratio, type Scenario, type ScenarioResult } from '../types.js';


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
  let echo: EchoClient | undefined;
  try {
    const holderW = spawnWorker('locks-holder', [String(lockTimeoutMs)]);
    workers.push(holderW);
    const { lockPort, echoPort } = await holderW.next<{ lockPort: number; echoPort: number }>((m) => m['type'] === 'listening', signal);
    const holder = `127.0.0.1:${lockPort}`;
    client = new LockClient({ requesterId: 'bench' });
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
    const lockCycle = async (): Promise<void> => {
      const ids = Array.from({ length: blocksPerLease }, () => `block:benchholder:${blockSeq++ % 100_000}`);
      const guard = await (client as LockClient).acquire(holder, ids, { signal });
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
    for (let i = 0; i < warmup; i++) {
      await echoPair();
      await lockCycle();
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
    if (cc.acquired !== cc.released + cc.releaseFailures + cc.active || cc.active !== 0) verificationFailures++;

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
    notes.push(
      `holder in a child process, lock timeout ${lockTimeoutMs} ms; one request in flight; ${rounds} interleaved rounds of ${perRound}`,
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
    for (const w of workers) w.kill();
    await Promise.all(workers.map((w) => w.exited));
  }
};
