#!/usr/bin/env node
// What a user gets from npm, checked end to end (CI runs it after `npm test` and
// `node scripts/prebuild.mjs`):
//   1. every published package is packed with `npm pack`; each tarball's file list must match
//      the allow-list below (no source maps, no tests, LICENSE, both prebuilds per addon);
//   2. the tarballs are installed into a fresh app in a temporary directory, on a PATH with no
//      compiler and no cmake (the addons must come from their prebuilds);
//   3. the consumer test: load each package, move a tensor through the cuda-ipc pool (to a
//      child process) and bytes through the engine, one copy of @tensorwire/core; a copy of an
//      addon without a matching prebuild still "installs" and then fails to load with
//      BackendUnavailableError naming the platform, its prebuilds and what to install;
//   4. a strict NodeNext consumer typechecks against every entry point of every package with
//      TypeScript 5.9, 6 and 7 (default `types`, no skipLibCheck);
//   5. the runnable README blocks (scripts/readme-blocks.mjs) run as written in that app.
//
//   node scripts/check-packages.mjs [--only tarballs,consumer,types,docs] [--keep] [--node PATH]
//                                   [--timeout-ms 90000] [--allow-skips rdma,etcd]
// --node: the Node.js that runs the consumer test and the README blocks (default: this one);
// CI passes the `engines` minimum. --allow-skips rdma,etcd: README blocks whose listed `needs`
// are missing here are reported as skipped (with the reason) instead of failing the run.
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { readmeBlocks } from './readme-blocks.mjs';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const { values } = parseArgs({
  options: {
    only: { type: 'string', default: 'tarballs,consumer,types,docs' },
    keep: { type: 'boolean', default: false },
    node: { type: 'string', default: process.execPath },
    'timeout-ms': { type: 'string', default: '90000' },
    'allow-skips': { type: 'string', default: '' },
  },
});
const only = new Set(values.only.split(','));
const nodeBin = resolve(values.node);
const timeoutMs = Number(values['timeout-ms']);

const PACKAGES = ['core', 'cuda-ipc', 'rdma-verbs', 'lock-client', 'discovery-etcd'];
const ADDONS = new Set(['cuda-ipc', 'rdma-verbs']);
const ARCHES = ['x64', 'arm64'];
const common = ['package.json', 'README.md', 'LICENSE', 'dist/**/*.js', 'dist/**/*.d.ts'];
/** Per package: the only files its tarball may hold (globs), and files it must hold. */
const ALLOW = {
  core: { allow: common, require: ['dist/index.js', 'dist/index.d.ts', 'dist/testing/index.js', 'dist/testing/pattern.js', 'dist/addon.js'] },
  'cuda-ipc': {
    allow: [...common, 'CMakeLists.txt', 'native/*.cc', 'native/*.h', 'scripts/install.mjs', 'prebuilds/linux-x64/@tensorwire+cuda-ipc.glibc.node', 'prebuilds/linux-arm64/@tensorwire+cuda-ipc.glibc.node'],
    require: ['dist/index.js', 'dist/install.js', 'CMakeLists.txt', 'scripts/install.mjs', 'prebuilds/linux-x64/@tensorwire+cuda-ipc.glibc.node', 'prebuilds/linux-arm64/@tensorwire+cuda-ipc.glibc.node'],
  },
  'rdma-verbs': {
    allow: [...common, 'CMakeLists.txt', 'native/*.cc', 'native/*.h', 'scripts/install.mjs', 'prebuilds/linux-x64/@tensorwire+rdma-verbs.glibc.node', 'prebuilds/linux-arm64/@tensorwire+rdma-verbs.glibc.node'],
    require: ['dist/index.js', 'dist/install.js', 'CMakeLists.txt', 'scripts/install.mjs', 'prebuilds/linux-x64/@tensorwire+rdma-verbs.glibc.node', 'prebuilds/linux-arm64/@tensorwire+rdma-verbs.glibc.node'],
  },
  'lock-client': { allow: [...common, 'proto/**/*.proto'], require: ['dist/index.js', 'dist/server/index.js', 'proto/tensorwire/lock/v1/lock.proto'] },
  'discovery-etcd': { allow: common, require: ['dist/index.js'] },
};

const failures = [];
const fail = (what) => {
  failures.push(what);
  console.error(`FAIL ${what}`);
};
const ok = (what) => console.log(`ok   ${what}`);

function glob(pattern) {
  const re = pattern.replace(/[.+^${}()|[\]\\]/g, '\\$&').replace(/\*\*\//g, '<<any>>').replace(/\*/g, '[^/]*').replace(/<<any>>/g, '(?:.*/)?');
  return new RegExp(`^${re}$`);
}

/** A PATH holding only node, npm, npx and sh: no compiler, no cmake, no make. */
function barePath(dir) {
  const bin = join(dir, 'bare-bin');
  mkdirSync(bin, { recursive: true });
  const npmCli = execFileSync('sh', ['-c', 'command -v npm'], { encoding: 'utf8' }).trim();
  const npxCli = execFileSync('sh', ['-c', 'command -v npx'], { encoding: 'utf8' }).trim();
  symlinkSync(nodeBin, join(bin, 'node'));
  symlinkSync(npmCli, join(bin, 'npm'));
  symlinkSync(npxCli, join(bin, 'npx'));
  symlinkSync('/bin/sh', join(bin, 'sh'));
  for (const tool of ['cmake', 'g++', 'c++', 'gcc', 'cc', 'clang++', 'make']) {
    if (spawnSync('/bin/sh', ['-c', `command -v ${tool}`], { env: { PATH: bin } }).status === 0) throw new Error(`bare PATH still has ${tool}`);
  }
  return bin;
}

/** Runs a command in its own process group; kills the group after `ms`. Never throws. */
function runBounded(cmd, args, { cwd, env, ms = timeoutMs, input } = {}) {
  return new Promise((resolvePromise) => {
    const child = spawn(cmd, args, { cwd, env, detached: true, stdio: ['pipe', 'pipe', 'pipe'] });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    if (input !== undefined) child.stdin.end(input);
    else child.stdin.end();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      try {
        process.kill(-child.pid, 'SIGKILL');
      } catch {
        // already gone
      }
    }, ms);
    child.on('error', (e) => {
      clearTimeout(timer);
      resolvePromise({ code: -1, out: `${out}${e.message}`, timedOut });
    });
    child.on('close', (code, signal) => {
      clearTimeout(timer);
      // a group member left behind (e.g. a forked child) goes too
      try {
        process.kill(-child.pid, 'SIGKILL');
      } catch {
        // none left
      }
      resolvePromise({ code: code ?? (signal ? 128 : -1), out, timedOut });
    });
  });
}

const work = mkdtempSync(join(tmpdir(), 'tensorwire-consumer-'));
const tarDir = join(work, 'tarballs');
const app = join(work, 'app');
mkdirSync(tarDir, { recursive: true });
mkdirSync(app, { recursive: true });
console.log(`working in ${work}`);

// ---------------------------------------------------------------- 1. pack + allow-list
const tarballs = {};
for (const pkg of PACKAGES) {
  const dir = join(root, 'packages', pkg);
  if (!existsSync(join(dir, 'dist', 'index.js'))) throw new Error(`packages/${pkg}/dist is missing: run npm run build first`);
  if (ADDONS.has(pkg) && !ARCHES.every((a) => existsSync(join(dir, 'prebuilds', `linux-${a}`)))) {
    throw new Error(`packages/${pkg}/prebuilds is incomplete: run node scripts/prebuild.mjs first`);
  }
  const json = execFileSync('npm', ['pack', '--json', '--ignore-scripts', '--pack-destination', tarDir], { cwd: dir, encoding: 'utf8' });
  const [info] = JSON.parse(json);
  tarballs[pkg] = join(tarDir, info.filename);
  const files = info.files.map((f) => f.path);
  const allow = ALLOW[pkg].allow.map(glob);
  const extra = files.filter((f) => !allow.some((re) => re.test(f)));
  const missing = ALLOW[pkg].require.filter((f) => !files.includes(f));
  if (extra.length > 0) fail(`tarball ${info.filename}: files not on the allow-list: ${extra.join(', ')}`);
  if (missing.length > 0) fail(`tarball ${info.filename}: required files missing: ${missing.join(', ')}`);
  if (readFileSync(join(dir, 'LICENSE'), 'utf8') !== readFileSync(join(root, 'LICENSE'), 'utf8')) fail(`packages/${pkg}/LICENSE differs from the repository's LICENSE`);
  if (extra.length === 0 && missing.length === 0) ok(`tarball ${info.filename}: ${files.length} files, ${(info.unpackedSize / 1024).toFixed(0)} KiB unpacked, matches the allow-list`);
}

// ---------------------------------------------------------------- 2. install without a toolchain
const bare = barePath(work);
const env = { ...process.env, PATH: bare, npm_config_update_notifier: 'false', npm_config_fund: 'false', npm_config_audit: 'false' };
delete env.TENSORWIRE_CUDA_IPC_ADDON;
delete env.TENSORWIRE_RDMA_ADDON;
const core = JSON.parse(readFileSync(join(root, 'packages', 'core', 'package.json'), 'utf8'));
const rootPkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'));
writeFileSync(
  join(app, 'package.json'),
  JSON.stringify(
    {
      name: 'tensorwire-consumer',
      private: true,
      type: 'module',
      dependencies: Object.fromEntries(PACKAGES.map((p) => [`@tensorwire/${p}`, `file:${tarballs[p]}`])),
      devDependencies: {
        '@types/node': rootPkg.devDependencies['@types/node'],
        // the README's `npx tsc` (the repository's TypeScript) and the three checked for the typings
        typescript: rootPkg.devDependencies.typescript,
        ts59: 'npm:typescript@~5.9.0',
        ts6: 'npm:typescript@~6.0.0',
        ts7: 'npm:typescript@^7.0.0',
        // @tensorwire/core/testing's optional peer
        vitest: core.peerDependencies.vitest,
      },
    },
    null,
    2,
  ),
);
const install = spawnSync('npm', ['install', '--no-package-lock'], { cwd: app, env, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
if (install.status !== 0) {
  console.error(install.stdout, install.stderr);
  throw new Error('npm install of the tarballs failed');
}
ok('the tarballs install into a fresh app on a PATH with no compiler, cmake or make');

// ---------------------------------------------------------------- 3. consumer test
if (only.has('consumer')) {
  cpSync(join(root, 'scripts', 'consumer', 'smoke.mjs'), join(app, 'smoke.mjs'));
  const r = await runBounded(join(bare, 'node'), ['smoke.mjs'], { cwd: app, env });
  if (r.code === 0) ok(`consumer smoke test (${nodeBin}):\n${r.out.trim().replace(/^/gm, '       ')}`);
  else fail(`consumer smoke test${r.timedOut ? ' timed out' : ` exited ${r.code}`}:\n${r.out}`);

  const ls = spawnSync('npm', ['ls', '@tensorwire/core', '--all', '--parseable'], { cwd: app, env, encoding: 'utf8' });
  const copies = ls.stdout.split('\n').filter((l) => l.endsWith('/@tensorwire/core'));
  if (new Set(copies).size === 1) ok('one @tensorwire/core in the app');
  else fail(`@tensorwire/core installed ${new Set(copies).size} times: ${[...new Set(copies)].join(', ')}`);

  // Bad input: a platform without a matching prebuild and without a toolchain.
  for (const pkg of ADDONS) {
    const copy = join(work, 'no-prebuild', 'node_modules', '@tensorwire', pkg);
    mkdirSync(dirname(copy), { recursive: true });
    cpSync(join(app, 'node_modules', '@tensorwire', pkg), copy, { recursive: true, dereference: true });
    rmSync(join(copy, 'prebuilds', `linux-${process.arch}`), { recursive: true, force: true });
    for (const [from, to] of [
      [join(app, 'node_modules', '@tensorwire', 'core'), join(dirname(copy), 'core')],
      [join(app, 'node_modules', 'node-gyp-build'), join(work, 'no-prebuild', 'node_modules', 'node-gyp-build')],
    ]) {
      if (!existsSync(to)) symlinkSync(from, to);
    }
    const hook = await runBounded(join(bare, 'node'), ['scripts/install.mjs'], { cwd: copy, env });
    const probe = await runBounded(join(bare, 'node'), ['--input-type=module', '-e', `
      import { BackendUnavailableError } from '@tensorwire/core';
      const m = await import('@tensorwire/${pkg}');
      try { ${pkg === 'cuda-ipc' ? "new m.TensorPool({ owner: 'probe' }); await m.native.layout();" : 'm.loadNative();'} console.log('LOADED'); }
      catch (e) { console.log(e instanceof BackendUnavailableError, e.message); }
    `], { cwd: join(work, 'no-prebuild'), env });
    const other = ARCHES.find((a) => a !== process.arch);
    const want = [`linux-${process.arch}`, `linux-${other}/@tensorwire+${pkg}.glibc.node`, 'apt-get install cmake g++ make', 'cmake-js', 'node-addon-api', `npm rebuild @tensorwire/${pkg}`];
    const good = hook.code === 0 && probe.out.startsWith('true ') && want.every((w) => probe.out.includes(w));
    if (good) ok(`${pkg} without a matching prebuild: install hook exits 0 ("${hook.out.split('\n')[0].slice(0, 90)}…"), loading throws BackendUnavailableError naming the platform, the prebuilds and what to install`);
    else fail(`${pkg} without a matching prebuild: hook exit ${hook.code} (${hook.out.trim()}); load: ${probe.out.trim()}`);
  }
}

// ---------------------------------------------------------------- 4. types
if (only.has('types')) {
  const dir = join(app, 'typecheck');
  mkdirSync(dir, { recursive: true });
  cpSync(join(root, 'scripts', 'consumer', 'types.ts'), join(dir, 'types.ts'));
  const compilerOptions = { module: 'nodenext', moduleResolution: 'nodenext', target: 'es2022', strict: true, noEmit: true, skipLibCheck: false, exactOptionalPropertyTypes: true, noUncheckedIndexedAccess: true };
  // One program per entry point (a consumer that imports only that one), and one using them all.
  const programs = ['types.ts'];
  for (const pkg of PACKAGES) {
    const manifest = JSON.parse(readFileSync(join(root, 'packages', pkg, 'package.json'), 'utf8'));
    for (const sub of Object.keys(manifest.exports)) {
      const spec = `${manifest.name}${sub.slice(1)}`;
      const file = `entry-${spec.replace(/[@/]/g, '_')}.ts`;
      writeFileSync(join(dir, file), `import * as entry from '${spec}';\nexport const loaded: unknown = entry;\n`);
      programs.push(file);
    }
  }
  for (const file of programs) writeFileSync(join(dir, `tsconfig.${file}.json`), JSON.stringify({ compilerOptions, files: [file] }, null, 2));
  for (const ts of ['ts59', 'ts6', 'ts7']) {
    const pkgJson = JSON.parse(readFileSync(join(app, 'node_modules', ts, 'package.json'), 'utf8'));
    const bad = [];
    for (const file of programs) {
      const r = await runBounded(join(bare, 'node'), [join(app, 'node_modules', ts, 'bin', 'tsc'), '-p', `tsconfig.${file}.json`], { cwd: dir, env, ms: 180_000 });
      if (r.code !== 0) bad.push(`${file}:\n${r.out.trim().split('\n').slice(0, 12).join('\n')}`);
    }
    if (bad.length === 0) ok(`typings: strict NodeNext consumer typechecks with TypeScript ${pkgJson.version} (default types, no skipLibCheck): ${programs.length} programs, one per entry point and one using all`);
    else fail(`typings with TypeScript ${pkgJson.version}:\n${bad.join('\n')}`);
  }
}

// ---------------------------------------------------------------- 5. runnable README blocks
if (only.has('docs')) {
  const readmes = ['README.md', ...PACKAGES.map((p) => `packages/${p}/README.md`), 'apps/bench/README.md'];
  for (const readme of readmes) {
    const blocks = readmeBlocks(readFileSync(join(root, readme), 'utf8'), readme);
    if (blocks.length === 0) continue;
    const dir = join(app, 'docs', readme.replace(/\/?README\.md$/, '').replace(/\//g, '-') || 'root');
    mkdirSync(dir, { recursive: true });
    for (const b of blocks) writeFileSync(join(dir, b.file), b.code);
    for (const b of blocks.filter((x) => x.run !== undefined || x.build !== undefined)) {
      const label = `${readme}: ${b.file} (line ${b.line})`;
      const missing = await missingNeeds(b.needs);
      const skippable = b.needs.every((n) => values['allow-skips'].split(',').includes(n));
      const steps = [b.build, missing.length === 0 ? b.run : undefined].filter((s) => s !== undefined);
      let passed = true;
      for (const step of steps) {
        const services = step === b.run ? await startServices(b.needs) : [];
        const r = await runBounded(join(bare, 'sh'), ['-c', step], { cwd: dir, env });
        for (const s of services) s.stop();
        const expectOk = step !== b.run || b.expect === undefined || r.out.includes(b.expect);
        if (r.code !== 0 || !expectOk) {
          passed = false;
          fail(`README block ${label}: \`${step}\` ${r.timedOut ? `timed out after ${timeoutMs} ms (killed)` : r.code !== 0 ? `exited ${r.code}` : `did not print ${JSON.stringify(b.expect)}`}:\n${r.out.trim().replace(/^/gm, '       ')}`);
          break;
        }
      }
      if (passed && missing.length === 0) ok(`README block ${label}: \`${[b.build, b.run].filter(Boolean).join('` then `')}\``);
      else if (passed) {
        const msg = `README block ${label}: ${b.build ? `\`${b.build}\` passed; ` : ''}\`${b.run}\` skipped: ${missing.join(', ')} not available here`;
        if (skippable) console.log(`skip ${msg}`);
        else fail(msg);
      }
    }
  }
}

async function missingNeeds(needs) {
  const out = [];
  for (const n of needs) {
    if (n === 'etcd' && spawnSync('/bin/sh', ['-c', 'command -v etcd'], { stdio: 'ignore' }).status !== 0) out.push('etcd (Debian: etcd-server)');
    if (n === 'rdma') {
      const r = await runBounded(nodeBin, ['--input-type=module', '-e', "const m = await import('@tensorwire/rdma-verbs'); process.exit(m.capabilities().available ? 0 : 1)"], { cwd: app, env });
      if (r.code !== 0) out.push('an active RDMA port');
    }
  }
  return out;
}

/** etcd for blocks that need it, on the address the README names (127.0.0.1:2379), with a throwaway data dir. */
async function startServices(needs) {
  const out = [];
  if (needs.includes('etcd')) {
    const data = mkdtempSync(join(work, 'etcd-'));
    const etcd = spawn('etcd', ['--data-dir', data, '--listen-client-urls', 'http://127.0.0.1:2379', '--advertise-client-urls', 'http://127.0.0.1:2379', '--listen-peer-urls', 'http://127.0.0.1:2380'], { stdio: 'ignore' });
    for (let i = 0; i < 100; i++) {
      const r = spawnSync('etcdctl', ['--endpoints=127.0.0.1:2379', 'endpoint', 'health'], { stdio: 'ignore' });
      if (r.status === 0) break;
      await new Promise((r2) => setTimeout(r2, 100));
    }
    out.push({ stop: () => etcd.kill('SIGKILL') });
  }
  return out;
}

if (!values.keep) rmSync(work, { recursive: true, force: true });
else console.log(`kept ${work}`);
console.log(failures.length === 0 ? '\nall package checks passed' : `\n${failures.length} package check(s) failed`);
process.exit(failures.length === 0 ? 0 : 1);
