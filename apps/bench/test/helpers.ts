import { spawn } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { Ajv } from 'ajv';
import { benchOutputSchema } from '../src/schema.js';

export const CLI = fileURLToPath(new URL('../dist/cli.js', import.meta.url));

export interface CliRun {
  code: number | null;
  stdout: string;
  stderr: string;
  marker: string;
}

let counter = 0;

/** Run the built CLI with a unique marker in its environment (inherited by every child it forks). */
export function runCli(args: string[], options: { onSpawn?: (pid: number, marker: string) => void; env?: NodeJS.ProcessEnv } = {}): Promise<CliRun> {
  const marker = `twbench-${process.pid}-${++counter}-${Date.now()}`;
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [CLI, ...args], { env: { ...process.env, ...options.env, TW_BENCH_TEST_MARKER: marker }, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
    child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    options.onSpawn?.(child.pid ?? -1, marker);
    child.on('close', (code) => resolve({ code, stdout, stderr, marker }));
  });
}

/** Pids of live processes whose environment carries the marker. */
export function processesWithMarker(marker: string): number[] {
  const out: number[] = [];
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const env = readFileSync(`/proc/${entry}/environ`, 'latin1');
      if (env.includes(`TW_BENCH_TEST_MARKER=${marker}`)) {
        const stat = readFileSync(`/proc/${entry}/stat`, 'latin1');
        if (!/\) Z /.test(stat)) out.push(Number(entry));
      }
    } catch {
      // gone or not ours
    }
  }
  return out;
}

/** The command line of a pid, NUL-separated fields joined by spaces. */
export function cmdline(pid: number): string {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, 'latin1').split('\0').join(' ');
  } catch {
    return '';
  }
}

const ajv = new Ajv({ allErrors: true, strict: false });
const validate = ajv.compile(benchOutputSchema);

export function validateOutput(json: unknown): string | undefined {
  return validate(json) ? undefined : ajv.errorsText(validate.errors);
}

export async function noOrphans(marker: string): Promise<number[]> {
  // Children exit within moments of their parent; look a few times before calling it an orphan.
  let left = processesWithMarker(marker);
  for (let i = 0; i < 30 && left.length > 0; i++) {
    await new Promise((r) => setTimeout(r, 100));
    left = processesWithMarker(marker);
  }
  return left;
}
