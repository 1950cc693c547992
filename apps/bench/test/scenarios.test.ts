import { capabilities } from '@tensorwire/cuda-ipc';
import { describe, expect, it } from 'vitest';
import { cmdline, noOrphans, processesWithMarker, runCli, validateOutput } from './helpers.js';

/** The same-host transport needs the cuda-ipc addon's shared memory; everything else runs on TCP. */
const sameHost = capabilities().sharedMemory.available;
if (!sameHost) console.log(`same-host (cuda-ipc) expectations skipped: ${capabilities().sharedMemory.reason}`);

interface Out {
  results: {
    scenario: string;
    skipped?: string;
    verificationFailures: number;
    counters?: Record<string, number>;
    measurements: { role: string; name: string; transport?: string; blockBytes?: number; descriptors?: number; gbps?: number; descriptorsPerSec?: number; totalBytes?: number; latency?: { count: number; p50Ms: number }; extra?: Record<string, unknown> }[];
    ratios: { name: string; subject: string; baseline: string; goal?: number; pass?: boolean; value: number }[];
    notes: string[];
  }[];
}

async function quick(scenario: string, extra: string[] = []): Promise<Out> {
  const r = await runCli([scenario, '--quick', '--json', ...extra]);
  expect(r.code, r.stderr).toBe(0);
  const out = JSON.parse(r.stdout) as Out;
  expect(validateOutput(out)).toBeUndefined();
  expect(await noOrphans(r.marker)).toEqual([]);
  return out;
}

describe('bench scenarios (smoke, tiny sizes)', () => {
  it('run: the remote-fetch flow verifies every byte and every lease is accounted for, on the same-host path by default', async () => {
    const out = await quick('run');
    const run = out.results[0]!;
    expect(run.scenario).toBe('run');
    expect(run.verificationFailures).toBe(0);
    const c = run.counters!;
    expect(c['acquired']).toBeGreaterThan(0);
    expect(c['acquired']).toBe(c['released']! + c['expired']! + c['active']!);
    const want = sameHost ? 'cuda-ipc' : 'tcp';
    expect(run.notes.some((n) => n.startsWith(`transport chosen: ${want} — `))).toBe(true);
    expect(run.measurements.find((m) => m.role === 'subject' && m.transport !== undefined)?.transport).toBe(want);
    expect(run.measurements.map((m) => m.name)).toEqual(expect.arrayContaining(['raw node:net stream', 'memcpy (Buffer.copy)']));
    // --quick: no lease path warm-up before the timed fetches.
    expect(run.notes.some((n) => n.includes('lease path warm-up'))).toBe(false);
    // Every lane's fetches are broken down into stages, one sample per fetch in each.
    const lanes = sameHost ? ['', ', --transport tcp lane of the same run'] : [''];
    for (const suffix of lanes) {
      const flow = run.measurements.find((m) => m.name === `leased fetch via client.fetch (lease + range grant + read, then disposal; verification outside the timed part)${suffix}`);
      const wall = run.measurements.find((m) => m.name === `leased fetch via client.fetch (lease + range grant + read + verify + disposal, wall clock)${suffix}`);
      expect(flow?.gbps, suffix).toBeGreaterThan(0);
      expect(wall?.gbps, suffix).toBeGreaterThan(0);
      const fetches = flow?.latency?.count ?? 0;
      expect(fetches).toBeGreaterThan(0);
      for (const stage of ['acquire', 'read', 'verify', 'release']) {
        const row = run.measurements.find((m) => m.name.startsWith(`stage ${stage}: `) && m.name.endsWith(suffix) && (suffix !== '' || !m.name.includes('--transport tcp')));
        expect(row?.latency?.count, `${stage}${suffix}`).toBe(fetches);
      }
    }
    if (sameHost) {
      const goal = run.ratios.filter((r) => r.goal === 5);
      expect(goal.map((r) => r.name)).toEqual(['same-host fetch/tcp fetch (same run; lease + grant + read + disposal, verification outside the timed part)']);
      expect(run.ratios.some((r) => r.name === 'same-host fetch/tcp fetch (same run; wall clock with verification)')).toBe(true);
      expect(run.notes.some((n) => n.startsWith('stage medians per fetch (ms), same-host: acquire '))).toBe(true);
    }
  });

  it('run --transport tcp: the requester registers only TCP and the engine says why it is the one; --warmup-fetches runs that many untimed one-block fetches first', async () => {
    const out = await quick('run', ['--transport', 'tcp', '--warmup-fetches', '7']);
    const run = out.results[0]!;
    expect(run.verificationFailures).toBe(0);
    expect(run.notes.some((n) => n.startsWith('transport chosen: tcp — '))).toBe(true);
    expect(run.measurements.find((m) => m.role === 'subject' && m.transport !== undefined)?.transport).toBe('tcp');
    expect(run.notes.filter((n) => n.startsWith('lease path warm-up before the timed fetches (untimed): 7 fetches of one block in '))).toHaveLength(1);
    // The warm-up's leases are released like every other: the holder's counters balance.
    const c = run.counters!;
    expect(c['acquired']).toBe(c['released']! + c['expired']! + c['active']!);
    expect(c['active']).toBe(0);
  });

  it('kv: scattered layers × blocks fetches on the same-host transport and TCP, prepared and not, beside memcpy and a raw stream, every byte verified', async () => {
    const out = await quick('kv');
    const kv = out.results[0]!;
    expect(kv.scenario).toBe('kv');
    expect(kv.verificationFailures).toBe(0);
    const transports = sameHost ? ['cuda-ipc', 'tcp'] : ['tcp'];
    for (const t of transports) {
      for (const name of [`${t}: engine.prepare + run()`, `${t}: engine.read`, `${t}: client.fetch (lease + range grant + read), disposed (release queued)`]) {
        const rows = kv.measurements.filter((m) => m.name === name);
        expect(rows.length, name).toBeGreaterThan(0);
        for (const m of rows) {
          expect(m.transport).toBe(t);
          expect(m.gbps).toBeGreaterThan(0);
          expect(m.descriptorsPerSec).toBeGreaterThan(0);
          expect(m.descriptors).toBeGreaterThan(0);
          // --quick: no warm-up past the first call, which is reported as the cold cost.
          expect(m.extra?.['warmupCalls']).toBe(1);
          expect(m.extra?.['firstCallMs']).toBeGreaterThan(0);
        }
      }
    }
    if (!sameHost) expect(kv.measurements.some((m) => m.transport === 'cuda-ipc')).toBe(false);
    expect(kv.notes.some((n) => n.startsWith('no lease path warm-up before the rounds (--quick'))).toBe(true);
    for (const b of ['raw node:net stream (same byte count)', 'memcpy (Buffer.copy per descriptor, JS loop)']) {
      expect(kv.measurements.filter((m) => m.name === b && m.role === 'baseline').length, b).toBeGreaterThan(0);
    }
    // Grant cost rows: engine.grant over N ranges and over N blocks (the same ranges as a block grant), against per-block registration.
    for (const [what, form] of [['ranges', 'range grant: 4 KiB ranges'], ['blocks', 'block grant: 4 KiB blocks by index']] as const) {
      const f = form.replace(/[()]/g, '\\$&');
      const sorted = kv.measurements.filter((m) => new RegExp(`^engine\\.grant over \\d+ ${what} \\(${f}, sorted by offset\\)$`).test(m.name));
      const unsorted = kv.measurements.filter((m) => new RegExp(`^engine\\.grant over \\d+ ${what} \\(${f}, unsorted: \\d+ layers × \\d+ random blocks, layer-major\\)$`).test(m.name));
      expect(sorted.map((m) => m.extra?.['ranges']), form).toEqual([10, 1000]);
      expect(unsorted.map((m) => m.extra?.['ranges']), form).toEqual([10, 1000]);
      const flat = kv.ratios.find((r) => r.name.startsWith(`grant cost flatness (${form}): `));
      expect(flat?.subject, form).toBe(sorted[1]?.name);
      expect(flat?.baseline, form).toBe(sorted[0]?.name);
      expect(kv.ratios.find((r) => r.name.startsWith(`grant cost flatness (${form}), unsorted: `))?.subject, form).toBe(unsorted[1]?.name);
    }
    expect(kv.measurements.some((m) => m.name.startsWith('engine.register per 4 KiB block') && m.role === 'baseline')).toBe(true);
    // Ratio rows with the goals: 4 KiB, 64 KiB and the plain 1 × 4 MiB read.
    const goals = kv.ratios.filter((r) => r.goal !== undefined).map((r) => r.name);
    expect(goals).toEqual(expect.arrayContaining(['tcp prepared/raw @ 4 KiB × 32', 'tcp prepared/raw @ 64 KiB × 32', 'tcp prepared/raw @ 4 MiB × 1']));
    if (sameHost) expect(goals).toEqual(expect.arrayContaining(['same-host prepared/memcpy @ 4 KiB × 32', 'same-host prepared/memcpy @ 64 KiB × 32', 'same-host prepared/memcpy @ 4 MiB × 1']));
    if (sameHost) expect(kv.notes.some((n) => /^same-host engine \(cuda-ipc, tcp\): transport chosen: cuda-ipc — /.test(n))).toBe(true);
    if (sameHost) {
      // Each alternating fetch right after a read of the same blocks, timed apart: its ratio is
      // the reads' time over the fetches' time, per round (neither may be missing or zero).
      const alt = kv.ratios.find((r) => r.name === 'same-host leased/engine.read, alternating per fetch @ 64 KiB × 32 (each fetch right after a read)');
      expect(alt?.subject).toBe('cuda-ipc: client.fetch (disposed), each right after an engine.read of the same blocks (alternating)');
      expect(alt?.baseline).toBe('cuda-ipc: engine.read');
      expect(alt?.value).toBeGreaterThan(0);
      expect(Number.isFinite(alt?.value)).toBe(true);
      const piped = kv.ratios.find((r) => r.name === 'same-host leased pipelined/engine.read @ 64 KiB × 32 (next acquire during each read)');
      expect(piped?.subject).toBe("cuda-ipc: client.fetchLease of a lease acquired during the previous fetch's read (pipelined), disposed");
      expect(piped?.value).toBeGreaterThan(0);
      expect(kv.measurements.some((m) => m.name === piped?.subject && m.transport === 'cuda-ipc' && (m.totalBytes ?? 0) > 0)).toBe(true);
      // The local lane against the same leased fetch with the Session messages on the gRPC stream.
      const lane = kv.ratios.find((r) => r.name === 'same-host leased, local lane/gRPC stream @ 64 KiB × 32');
      expect(lane?.subject).toBe('cuda-ipc: client.fetch (lease + range grant + read), disposed (release queued)');
      expect(lane?.baseline).toBe('cuda-ipc: client.fetch with the Session messages on the gRPC stream (localLane: false)');
      expect(lane?.value).toBeGreaterThan(0);
      // One real read of the same bytes before every timed fetch.
      const altRows = kv.measurements.filter((m) => m.name === alt?.subject);
      expect(altRows.length).toBeGreaterThan(0);
      for (const m of altRows) {
        expect(m.transport).toBe('cuda-ipc');
        expect(m.totalBytes).toBeGreaterThan(0);
        expect(m.extra?.['pairedReadBytes']).toBe(m.totalBytes);
      }
    }
  });

  it('kv --compare: our transports measured the way ucx_perftest measures (one block re-read, window 1), beside the UCX rows and the scattered ratios', async () => {
    const out = await quick('kv', ['--compare', '--sizes', '4KiB', '--batches', '32']);
    const kv = out.results[0]!;
    expect(kv.verificationFailures).toBe(0);
    const transports = sameHost ? ['cuda-ipc', 'tcp'] : ['tcp'];
    for (const size of [4096, 4 * 1024 * 1024]) {
      for (const t of transports) {
        const row = kv.measurements.find((m) => m.name === `${t}: engine.prepare + run(), one block re-read, window 1 (ucx_perftest ucp_get shape)` && m.blockBytes === size);
        expect(row?.transport, `${t} @ ${size}`).toBe(t);
        expect(row?.descriptors).toBe(1);
        expect(row?.gbps).toBeGreaterThan(0);
        // The same total bytes as the UCX run at this size: iterations × size.
        expect(row?.totalBytes).toBe(Number(row?.extra?.['iterations']) * size);
        expect(row?.extra?.['window']).toBe(1);
      }
      const ucx = kv.measurements.filter((m) => m.role === 'external' && m.blockBytes === size);
      if (ucx.length === 0) {
        expect(kv.notes.some((n) => /ucx_perftest is not installed|UCX ucp_get over .*: no result/.test(n))).toBe(true);
        continue;
      }
      for (const m of ucx) {
        const lane = /over tcp/.test(m.name) ? 'tcp' : 'same-host';
        if (lane === 'same-host' && !sameHost) continue;
        expect(m.totalBytes).toBe(Number(m.extra?.['iterations']) * size);
        const same = kv.ratios.find((r) => r.name === `${lane} re-read/${m.name} @ ${size === 4096 ? '4 KiB' : '4 MiB'} (same shape: one block re-read, window 1)`);
        const scattered = kv.ratios.find((r) => r.name === `${lane} prepared/${m.name} @ ${size === 4096 ? '4 KiB' : '4 MiB'}`);
        expect(same?.value, m.name).toBeGreaterThan(0);
        expect(scattered?.value, m.name).toBeGreaterThan(0);
        expect(same?.goal).toBe(lane === 'tcp' ? 3 : size === 4096 ? undefined : 1);
      }
    }
  });

  it('kv --transport tcp: only TCP rows; --warmup-ms runs at least 20 untimed calls per measurement; --lease-warmup that many leased fetches per lane before the rounds', async () => {
    const out = await quick('kv', ['--transport', 'tcp', '--batches', '32', '--warmup-ms', '1', '--lease-warmup', '6']);
    const kv = out.results[0]!;
    expect(kv.verificationFailures).toBe(0);
    const engines = kv.measurements.filter((m) => m.role === 'subject' && m.descriptors !== undefined);
    expect(engines.length).toBeGreaterThan(0);
    expect(new Set(engines.map((m) => m.transport))).toEqual(new Set(['tcp']));
    for (const m of kv.measurements.filter((x) => x.descriptors !== undefined)) expect(m.extra?.['warmupCalls'], m.name).toBeGreaterThanOrEqual(20);
    expect(kv.ratios.some((r) => r.name.startsWith('same-host'))).toBe(false);
    const warm = kv.notes.filter((n) => n.startsWith('lease path warm-up before the rounds (untimed, once per run): 9 leased fetches of one '));
    expect(warm).toHaveLength(1);
    expect(warm[0]).toMatch(/\(tcp Session stream \(over (the holder's local lane|gRPC)\): 6 fetches, median of the first 100 \d+\.\d{3} ms, of the last 100 \d+\.\d{3} ms; tcp unary calls: 3 fetches, /);
  });

  it('locks: cycles beside the gRPC echo baseline; killed requesters are expired and counted', async () => {
    const out = await quick('locks');
    const res = out.results[0]!;
    expect(res.measurements.some((m) => m.role === 'baseline')).toBe(true);
    // Round trips back to back, after 5 ms of computing, after 5 ms idle: one run of 10 each.
    for (const call of ['lock acquire+release (4 blocks)', 'lock acquire+release (4 blocks) on the gRPC Session stream (localLane: false)', 'raw @grpc/grpc-js unary echo ×2']) {
      for (const pause of ['back to back', 'after 5 ms of computing', 'after 5 ms idle']) {
        const row = res.measurements.find((m) => m.name === `${call}, ${pause}`);
        expect(row?.latency?.count, `${call}, ${pause}`).toBe(10);
        expect(row?.latency?.p50Ms).toBeGreaterThan(0);
      }
      for (const pause of ['after 5 ms of computing', 'after 5 ms idle']) {
        const r = res.ratios.find((x) => x.name === `${call}: back to back / ${pause} (median cycle)`);
        expect(r?.value, pause).toBeGreaterThan(0);
        expect(Number.isFinite(r?.value)).toBe(true);
      }
    }
    for (const pause of ['back to back', 'after 5 ms of computing', 'after 5 ms idle']) {
      const r = res.ratios.find((x) => x.name === `lock cycle, local lane/gRPC stream, ${pause} (median cycle)`);
      expect(r?.value, pause).toBeGreaterThan(0);
    }
    expect(res.notes.some((n) => n.startsWith("lock cycles' calls: over the holder's local lane ("))).toBe(true);
    const c = res.counters!;
    expect(c['acquired']).toBe(c['released']! + c['expired']! + c['active']!);
    expect(c['expired']).toBeGreaterThan(0);
  });

  it('pool: producer/consumer figures beside memcpy and local-memory baselines', async () => {
    const out = await quick('pool');
    const res = out.results[0]!;
    expect(res.verificationFailures).toBe(0);
    expect(res.measurements.some((m) => m.role === 'baseline')).toBe(true);
    expect(res.ratios.length).toBeGreaterThan(0);
  });
});

describe('bench error paths', () => {
  it('a holder killed mid-run: a one-line error, non-zero exit, no orphans', async () => {
    let killed = false;
    const r = await runCli(['run', '--duration', '30', '--json'], {
      onSpawn: (_pid, marker) => {
        const poll = setInterval(() => {
          for (const pid of processesWithMarker(marker)) {
            if (cmdline(pid).includes('run-requester.js')) {
              // The requester exists, so the holder is serving: kill the holder.
              for (const h of processesWithMarker(marker)) {
                if (cmdline(h).includes('run-holder.js')) {
                  process.kill(h, 'SIGKILL');
                  killed = true;
                  clearInterval(poll);
                }
              }
            }
          }
        }, 100);
        setTimeout(() => clearInterval(poll), 60_000).unref();
      },
    });
    expect(killed).toBe(true);
    expect(r.code).not.toBe(0);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    expect(r.stderr).toMatch(/holder|requester/);
    expect(r.stderr).not.toMatch(/\n\s+at /);
    expect(await noOrphans(r.marker)).toEqual([]);
  });

  it('an unreachable holder: a one-line error and a non-zero exit', async () => {
    const r = await runCli(['fetch', '--holder', '127.0.0.1:1', '--duration', '1']);
    expect(r.code).not.toBe(0);
    expect(r.stderr).toMatch(/cannot fetch from 127\.0\.0\.1:1/);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    expect(await noOrphans(r.marker)).toEqual([]);
  });

  it('a port in use: a one-line error and a non-zero exit', async () => {
    const net = await import('node:net');
    const server = net.createServer();
    await new Promise<void>((res) => server.listen(0, '127.0.0.1', res));
    const port = (server.address() as { port: number }).port;
    try {
      const r = await runCli(['holder', '--listen', `127.0.0.1:${port}`, '--blocks', '2', '--block-size', '4KiB']);
      expect(r.code).not.toBe(0);
      expect(r.stderr).toMatch(/address in use/);
      expect(r.stderr.trim().split('\n')).toHaveLength(1);
      expect(await noOrphans(r.marker)).toEqual([]);
    } finally {
      server.close();
    }
  });

  it('bad holder addresses and numbers are refused before anything starts', async () => {
    for (const args of [
      ['fetch', '--holder', 'nope'],
      ['fetch', '--holder', '127.0.0.1:99999'],
      ['run', '--duration', '-3'],
      ['run', '--blocks', '4', '--per-fetch', '8'],
      ['run', '--lanes', '0'],
      ['run', '--warmup-fetches', '-1'],
      ['kv', '--lease-warmup', 'x'],
      ['holder', '--blocks', 'many'],
    ]) {
      const r = await runCli(args);
      expect(r.code, args.join(' ')).not.toBe(0);
      expect(r.stderr.trim().split('\n')).toHaveLength(1);
    }
  });
});
