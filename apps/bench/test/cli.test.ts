import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { noOrphans, runCli, validateOutput } from './helpers.js';

/** The CLI arguments the root `npm run bench` script passes before the user's own (`--` …). */
function benchScriptArgs(): string[] {
  const pkg = JSON.parse(readFileSync(new URL('../../../package.json', import.meta.url), 'utf8')) as { scripts: Record<string, string> };
  const script = pkg.scripts['bench'] as string;
  const m = /node apps\/bench\/dist\/cli\.js((?: [^&|;]+)?)$/.exec(script);
  if (!m) throw new Error(`the root bench script ${JSON.stringify(script)} does not end by running apps/bench/dist/cli.js`);
  return (m[1] ?? '').trim().split(/\s+/).filter(Boolean);
}

describe('tensorwire-bench CLI', () => {
  it('tcp --quick prints JSON that matches the schema, verified, with its baselines', async () => {
    const r = await runCli(['tcp', '--quick', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout) as { results: { scenario: string; verificationFailures: number; measurements: { role: string }[]; ratios: unknown[] }[] };
    expect(validateOutput(out)).toBeUndefined();
    const tcp = out.results[0]!;
    expect(tcp.scenario).toBe('tcp');
    expect(tcp.verificationFailures).toBe(0);
    expect(tcp.measurements.some((m) => m.role === 'subject')).toBe(true);
    expect(tcp.measurements.some((m) => m.role === 'baseline')).toBe(true);
    expect(tcp.ratios.length).toBeGreaterThan(0);
    expect(await noOrphans(r.marker)).toEqual([]);
  });

  it('`npm run bench -- <scenario>` runs that scenario (the script\'s own arguments first, then the user\'s)', async () => {
    const r = await runCli([...benchScriptArgs(), 'rdma', '--quick', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout) as { command: string; results: { scenario: string }[] };
    expect(validateOutput(out)).toBeUndefined();
    expect(out.command).toBe('rdma');
    expect(out.results.map((x) => x.scenario)).toEqual(['rdma']);
  });

  it('`npm run bench -- <command> --help` is that command\'s help; `npm run bench -- --help` is run\'s', async () => {
    const kv = await runCli([...benchScriptArgs(), 'kv', '--help']);
    expect(kv.code, kv.stderr).toBe(0);
    expect(kv.stdout).toMatch(/Usage: tensorwire-bench kv/);
    expect(kv.stdout).toContain('--layers');
    const run = await runCli([...benchScriptArgs(), '--help']);
    expect(run.code, run.stderr).toBe(0);
    expect(run.stdout).toMatch(/Usage: tensorwire-bench run/);
    expect(run.stdout).toContain('--transport');
  });

  it('rdma reports why it cannot run here, or runs where a device exists', async () => {
    const r = await runCli(['rdma', '--quick', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout) as { results: { skipped?: string; measurements: unknown[] }[] };
    expect(validateOutput(out)).toBeUndefined();
    const res = out.results[0]!;
    if (res.skipped !== undefined) expect(res.skipped).toMatch(/rdma|RDMA|infiniband|device|libibverbs|port/);
    else expect(res.measurements.length).toBeGreaterThan(0);
  });

  it('pool --device cuda:0 reports why it cannot run here, or runs and checks every copy where a GPU exists', async () => {
    const r = await runCli(['pool', '--device', 'cuda:0', '--quick', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout) as { results: { skipped?: string; measurements: { name: string }[]; verificationFailures: number }[] };
    expect(validateOutput(out)).toBeUndefined();
    const res = out.results[0]!;
    if (res.skipped !== undefined) {
      console.log(`pool --device cuda:0 skipped: ${res.skipped}`);
      expect(res.skipped).toMatch(/^cuda:0: .*(CUDA|libcuda|device)/);
    } else {
      expect(res.verificationFailures).toBe(0);
      expect(res.measurements.map((m) => m.name)).toContain('imported d2d');
    }
  });

  it('writes a self-contained HTML report', async () => {
    const { mkdtempSync, readFileSync } = await import('node:fs');
    const { tmpdir } = await import('node:os');
    const { join } = await import('node:path');
    const dir = mkdtempSync(join(tmpdir(), 'twbench-'));
    const file = join(dir, 'report.html');
    const r = await runCli(['tcp', '--quick', '--report', file]);
    expect(r.code, r.stderr).toBe(0);
    const html = readFileSync(file, 'utf8');
    expect(html).toMatch(/^<!doctype html>/);
    expect(html).toContain('<svg');
    expect(html).toContain('GB/s by block size');
    expect(html).not.toMatch(/<script|https?:\/\/(?!tensorwire\.dev)/);
  });

  it('--copy-threads reaches the workers that build the same-host transport, and the notes say so', async () => {
    const r = await runCli(['kv', '--quick', '--copy-threads', '3', '--json', '--no-progress']);
    expect(r.code, r.stderr).toBe(0);
    const notes = (JSON.parse(r.stdout) as { results: { notes: string[] }[] }).results[0]?.notes ?? [];
    const sameHost = notes.filter((n) => n.startsWith('cuda-ipc copies host batches'));
    // The requester's note; none when this machine cannot build the same-host transport.
    if (sameHost.length > 0) expect(sameHost).toEqual(['cuda-ipc copies host batches of 1 MiB and more on up to 3 thread(s) (--copy-threads, TENSORWIRE_BENCH_COPY_THREADS); batches of 8 MiB and more off the JavaScript thread (the library default)']);
    else expect(notes.join('\n')).toMatch(/same-host transport is unavailable/);
  });

  it('--async-copy-bytes reaches the workers that build the same-host transport (a size, or never), and the notes say so', async () => {
    for (const [flag, says] of [
      ['64KiB', 'batches of 64 KiB and more off the JavaScript thread (--async-copy-bytes, TENSORWIRE_BENCH_ASYNC_COPY_BYTES)'],
      ['never', 'every batch on the JavaScript thread (--async-copy-bytes, TENSORWIRE_BENCH_ASYNC_COPY_BYTES)'],
    ] as const) {
      const r = await runCli(['kv', '--quick', '--async-copy-bytes', flag, '--json', '--no-progress']);
      expect(r.code, r.stderr).toBe(0);
      const notes = (JSON.parse(r.stdout) as { results: { notes: string[] }[] }).results[0]?.notes ?? [];
      const sameHost = notes.filter((n) => n.startsWith('cuda-ipc copies host batches'));
      if (sameHost.length > 0) expect(sameHost.map((n) => n.split('; ')[1])).toEqual([says]);
      else expect(notes.join('\n')).toMatch(/same-host transport is unavailable/);
    }
  });

  it('a bad TENSORWIRE_BENCH_ASYNC_COPY_BYTES set by hand: one-line error naming it, before any worker starts', async () => {
    const r = await runCli(['run', '--quick'], { env: { TENSORWIRE_BENCH_ASYNC_COPY_BYTES: '0' } });
    expect(r.code).not.toBe(0);
    expect(r.stderr).toMatch(/--async-copy-bytes \(TENSORWIRE_BENCH_ASYNC_COPY_BYTES\) "0" must be a positive size/);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    expect(await noOrphans(r.marker)).toEqual([]);
  });

  it('a bad TENSORWIRE_BENCH_COPY_THREADS set by hand: one-line error naming it, before any worker starts', async () => {
    const r = await runCli(['kv', '--quick'], { env: { TENSORWIRE_BENCH_COPY_THREADS: 'lots' } });
    expect(r.code).not.toBe(0);
    expect(r.stderr).toMatch(/--copy-threads \(TENSORWIRE_BENCH_COPY_THREADS\) "lots" must be an integer from 1 to 16/);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    expect(await noOrphans(r.marker)).toEqual([]);
  });

  for (const [label, args, pattern] of [
    ['an unknown flag', ['tcp', '--frobnicate'], /unknown option/],
    ['an impossible size', ['tcp', '--sizes', '4XB'], /not a size/],
    ['a zero size', ['tcp', '--sizes', '0'], /positive size/],
    ['an unknown command', ['frob'], /unknown command|too many arguments/],
    ['`run` before an unknown command', ['run', 'frob'], /unknown command|too many arguments/],
    ['an unknown transport', ['run', '--transport', 'carrier-pigeon'], /carrier-pigeon.*(invalid|Allowed choices)/],
    ['a kv batch that is not a number', ['kv', '--batches', '64,lots'], /--batches "lots" must be a positive whole number/],
    ['a kv warm-up that is not a number', ['kv', '--warmup-ms', 'soon'], /--warmup-ms "soon" must be 0 or a positive whole number/],
    ['a pool device that is neither cpu nor cuda:N', ['pool', '--device', 'gpu0'], /--device "gpu0" must be cpu or cuda:N/],
    ['a copy thread count of 0', ['kv', '--copy-threads', '0'], /--copy-threads \(TENSORWIRE_BENCH_COPY_THREADS\) "0" must be an integer from 1 to 16/],
    ['a copy thread count that is not a number', ['run', '--copy-threads', '2x'], /--copy-threads \(TENSORWIRE_BENCH_COPY_THREADS\) "2x" must be an integer from 1 to 16/],
    ['an async copy size that is not a size', ['kv', '--async-copy-bytes', 'big'], /--async-copy-bytes \(TENSORWIRE_BENCH_ASYNC_COPY_BYTES\) "big" must be a positive size \(4096, 4KiB, 64MiB, 1GiB\) or never/],
  ] as const) {
    it(`${label}: one-line error, non-zero exit, no stack trace, no orphans`, async () => {
      const r = await runCli([...args]);
      expect(r.code).not.toBe(0);
      expect(r.stderr).toMatch(pattern);
      expect(r.stderr.trim().split('\n')).toHaveLength(1);
      expect(r.stderr).not.toMatch(/\n\s+at /);
      expect(await noOrphans(r.marker)).toEqual([]);
    });
  }
});
