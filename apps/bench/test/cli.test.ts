import { describe, expect, it } from 'vitest';
import { noOrphans, runCli, validateOutput } from './helpers.js';

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

  it('rdma reports why it cannot run here, or runs where a device exists', async () => {
    const r = await runCli(['rdma', '--quick', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout) as { results: { skipped?: string; measurements: unknown[] }[] };
    expect(validateOutput(out)).toBeUndefined();
    const res = out.results[0]!;
    if (res.skipped !== undefined) expect(res.skipped).toMatch(/rdma|RDMA|infiniband|device|libibverbs|port/);
    else expect(res.measurements.length).toBeGreaterThan(0);
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

  for (const [label, args, pattern] of [
    ['an unknown flag', ['tcp', '--frobnicate'], /unknown option/],
    ['an impossible size', ['tcp', '--sizes', '4XB'], /not a size/],
    ['a zero size', ['tcp', '--sizes', '0'], /positive size/],
    ['an unknown command', ['frob'], /unknown command|too many arguments/],
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
