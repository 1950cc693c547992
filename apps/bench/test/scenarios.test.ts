import { describe, expect, it } from 'vitest';
import { cmdline, noOrphans, processesWithMarker, runCli, validateOutput } from './helpers.js';

interface Out {
  results: {
    scenario: string;
    skipped?: string;
    verificationFailures: number;
    counters?: Record<string, number>;
    measurements: { role: string; name: string }[];
    ratios: { name: string }[];
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
  it('run: the remote-fetch flow verifies every byte and every lease is accounted for', async () => {
    const out = await quick('run');
    const run = out.results[0]!;
    expect(run.scenario).toBe('run');
    expect(run.verificationFailures).toBe(0);
    const c = run.counters!;
    expect(c['acquired']).toBeGreaterThan(0);
    expect(c['acquired']).toBe(c['released']! + c['expired']! + c['active']!);
    expect(run.notes.some((n) => /^transport chosen: tcp/.test(n))).toBe(true);
    expect(run.measurements.map((m) => m.name)).toEqual(expect.arrayContaining(['raw node:net stream', 'memcpy (Buffer.copy)']));
  });

  it('locks: cycles beside the gRPC echo baseline; killed requesters are expired and counted', async () => {
    const out = await quick('locks');
    const res = out.results[0]!;
    expect(res.measurements.some((m) => m.role === 'baseline')).toBe(true);
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
      ['holder', '--blocks', 'many'],
    ]) {
      const r = await runCli(args);
      expect(r.code, args.join(' ')).not.toBe(0);
      expect(r.stderr.trim().split('\n')).toHaveLength(1);
    }
  });
});
