/** The worker channel: a worker's last answer reaches the parent even when it is large and the worker leaves at once. */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { profilerArgs } from '../src/proc.js';

describe('workerInit().sent', () => {
  it('a 1 MiB answer sent just before disconnecting arrives whole', async () => {
    const child = fork(fileURLToPath(new URL('./fixtures/big-result.mjs', import.meta.url)), [String(1 << 20)], { serialization: 'advanced', stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    const got: unknown[] = [];
    child.on('message', (m) => got.push(m));
    const [code] = await once(child, 'exit');
    expect(code).toBe(0);
    expect(got).toHaveLength(1);
    const samples = (got[0] as { samples: number[] }).samples;
    expect(samples).toHaveLength((1 << 20) / 8);
    expect(samples[samples.length - 1]).toBe(samples.length - 1);
  });
});

describe('profilerArgs (TENSORWIRE_BENCH_CPU_PROF)', () => {
  it('profiles exactly the workers named, or all; nothing when unset', () => {
    expect(profilerArgs('kv-holder', {})).toEqual([]);
    expect(profilerArgs('kv-holder', { TENSORWIRE_BENCH_CPU_PROF: '' })).toEqual([]);
    expect(profilerArgs('kv-holder', { TENSORWIRE_BENCH_CPU_PROF: 'kv-requester' })).toEqual([]);
    expect(profilerArgs('kv-holder', { TENSORWIRE_BENCH_CPU_PROF: 'kv-requester, kv-holder', TENSORWIRE_BENCH_CPU_PROF_DIR: '/p' })).toEqual(['--cpu-prof', '--cpu-prof-dir=/p', '--cpu-prof-interval=100']);
    expect(profilerArgs('run-holder', { TENSORWIRE_BENCH_CPU_PROF: 'all' })).toEqual(['--cpu-prof', `--cpu-prof-dir=${join(tmpdir(), 'tensorwire-bench-prof')}`, '--cpu-prof-interval=100']);
  });

  it('a worker forked with them leaves a CPU profile behind', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'tw-prof-'));
    try {
      const execArgv = profilerArgs('big-result', { TENSORWIRE_BENCH_CPU_PROF: 'big-result', TENSORWIRE_BENCH_CPU_PROF_DIR: dir });
      const child = fork(fileURLToPath(new URL('./fixtures/big-result.mjs', import.meta.url)), ['1024'], { execArgv, serialization: 'advanced', stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
      child.on('message', () => undefined);
      const [code] = await once(child, 'exit');
      expect(code).toBe(0);
      const files = readdirSync(dir).filter((f) => f.endsWith('.cpuprofile'));
      expect(files).toHaveLength(1);
      const profile = JSON.parse(readFileSync(join(dir, files[0]!), 'utf8')) as { nodes: unknown[] };
      expect(profile.nodes.length).toBeGreaterThan(0);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
