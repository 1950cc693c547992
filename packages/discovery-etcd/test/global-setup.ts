/**
 * The cross-host tests run child processes on compiled code (Node cannot run the TypeScript
 * sources): build this package when dist/ is missing or older than src/, and any workspace
 * package the children import whose dist/ is missing.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, readdirSync, statSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const packages = join(root, '..');

function newest(dir: string): number {
  let t = 0;
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, entry.name);
    t = Math.max(t, entry.isDirectory() ? newest(p) : statSync(p).mtimeMs);
  }
  return t;
}

function build(dir: string): void {
  const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');
  execFileSync(process.execPath, [tsc, '-p', join(dir, 'tsconfig.build.json')], { stdio: 'inherit' });
}

export default function setup(): void {
  for (const dep of ['core', 'lock-client']) {
    const dir = join(packages, dep);
    if (!existsSync(join(dir, 'dist', 'index.js'))) build(dir);
  }
  let built = 0;
  try {
    built = statSync(join(root, 'dist', 'index.js')).mtimeMs;
  } catch {
    built = 0;
  }
  if (built < newest(join(root, 'src'))) build(root);
}
