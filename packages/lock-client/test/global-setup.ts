/**
 * Child-process fixtures run the compiled package (Node cannot run the TypeScript
 * sources). Build it once when dist/ is missing or older than src/ or proto/.
 */
import { execFileSync } from 'node:child_process';
import { readdirSync, statSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');

function newest(dir: string): number {
  let t = 0;
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, entry.name);
    t = Math.max(t, entry.isDirectory() ? newest(p) : statSync(p).mtimeMs);
  }
  return t;
}

export default function setup(): void {
  let built = 0;
  try {
    built = statSync(join(root, 'dist', 'index.js')).mtimeMs;
    built = Math.min(built, statSync(join(root, 'dist', 'server', 'index.js')).mtimeMs);
  } catch {
    built = 0;
  }
  if (built >= newest(join(root, 'src'))) return;
  const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');
  execFileSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.build.json')], { stdio: 'inherit' });
}
