#!/usr/bin/env node
// Pack what `packages/cuda-ipc/test/gpu/run-all.sh` needs on a GPU machine that has no npm
// registry and no node: DIR/deps.tar.xz (the built dist/ and addons of every workspace package,
// and the node_modules closure of vitest, fast-check and the bench) and DIR/node.xz (this node
// binary). Run after `npx turbo run build`, from the repository root:
//   node scripts/gpu-bundle.mjs .gpu
// On the GPU machine, from a copy of the repository with DIR beside it:
//   xz -dc DIR/node.xz > /tmp/node && chmod +x /tmp/node && export PATH=/tmp:$PATH
//   tar -xJf DIR/deps.tar.xz && bash packages/cuda-ipc/test/gpu/run-all.sh OUTDIR
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';

const root = path.resolve(path.dirname(new URL(import.meta.url).pathname), '..');
const dir = path.resolve(process.argv[2] ?? '.gpu');
fs.mkdirSync(dir, { recursive: true });

function find(name, from) {
  for (let d = from; ; d = path.dirname(d)) {
    const p = path.join(d, 'node_modules', name);
    if (fs.existsSync(path.join(p, 'package.json'))) return p;
    if (path.dirname(d) === d) return undefined;
  }
}
const seen = new Set();
function walk(p) {
  const real = fs.realpathSync(p);
  if (seen.has(real)) return;
  seen.add(real);
  const pj = JSON.parse(fs.readFileSync(path.join(real, 'package.json'), 'utf8'));
  for (const n of Object.keys({ ...pj.dependencies, ...pj.optionalDependencies, ...pj.peerDependencies })) {
    const q = find(n, real) ?? find(n, p);
    if (q) walk(q);
  }
}
for (const n of ['vitest', 'fast-check', '@tensorwire/bench']) {
  const p = find(n, root);
  if (!p) throw new Error(`${n} is not installed: run npm ci first`);
  walk(p);
}
const list = new Set();
for (const real of seen) {
  const rel = path.relative(root, real);
  if (rel.startsWith('node_modules')) list.add(rel);
  else for (const sub of ['dist', 'build/Release']) if (fs.existsSync(path.join(real, sub))) list.add(path.join(rel, sub));
}
for (const n of fs.readdirSync(path.join(root, 'node_modules', '@tensorwire'))) list.add(`node_modules/@tensorwire/${n}`);
if (!fs.existsSync(path.join(root, 'packages/cuda-ipc/build/Release/cuda_ipc.node'))) throw new Error('the cuda-ipc addon is not built: run npx turbo run build first');
const listFile = path.join(dir, 'files.txt');
fs.writeFileSync(listFile, [...list].sort().join('\n') + '\n');
execFileSync('tar', ['-cJf', path.join(dir, 'deps.tar.xz'), '-C', root, '-T', listFile], { stdio: 'inherit' });
execFileSync('sh', ['-c', `xz -T0 -6 -c "${process.execPath}" > "${path.join(dir, 'node.xz')}"`], { stdio: 'inherit' });
for (const f of ['deps.tar.xz', 'node.xz']) console.log(`${path.join(dir, f)}: ${(fs.statSync(path.join(dir, f)).size / 1e6).toFixed(1)} MB`);
