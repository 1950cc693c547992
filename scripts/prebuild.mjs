#!/usr/bin/env node
// Release build of the native addons: prebuilt, stripped Node-API binaries for linux-x64 and
// linux-arm64 (glibc), written by prebuildify to packages/<addon>/prebuilds/linux-<arch>/
// (where node-gyp-build, the packages' loader, finds them). The arm64 builds use Debian's cross
// toolchain (apt-get install g++-aarch64-linux-gnu binutils-aarch64-linux-gnu).
//
//   node scripts/prebuild.mjs                    # both addons, both architectures
//   node scripts/prebuild.mjs --arch x64         # only some architectures (comma separated)
//   node scripts/prebuild.mjs --package rdma-verbs
//
// Fails (exit 1) when a toolchain is missing or rdma-verbs would be built without
// infiniband/verbs.h (TW_REQUIRE_VERBS): a release never ships the stub. Prints each binary's
// ELF machine and the newest GLIBC_ symbol version it needs.
import { spawnSync } from 'node:child_process';
import { cpSync, existsSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const { values } = parseArgs({
  options: {
    arch: { type: 'string', default: 'x64,arm64' },
    package: { type: 'string', default: 'cuda-ipc,rdma-verbs' },
  },
});

/** Per target architecture: the cross prefix (empty: the host's tools) and the CMake toolchain file. */
const ARCHES = {
  x64: { prefix: process.arch === 'x64' ? '' : 'x86_64-linux-gnu-', machine: 'Advanced Micro Devices X86-64' },
  arm64: { prefix: process.arch === 'arm64' ? '' : 'aarch64-linux-gnu-', machine: 'AArch64' },
};
/** CMake definitions of a release build, per addon. */
const DEFINES = { 'cuda-ipc': [], 'rdma-verbs': ['TW_REQUIRE_VERBS=ON'] };

function run(cmd, args, opts = {}) {
  const r = spawnSync(cmd, args, { stdio: ['ignore', 'pipe', 'inherit'], encoding: 'utf8', ...opts });
  if (r.error) throw new Error(`${cmd}: ${r.error.message}`);
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} exited with ${r.status}`);
  return r.stdout ?? '';
}
function has(cmd) {
  return spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;
}

const arches = values.arch.split(',').filter(Boolean);
const packages = values.package.split(',').filter(Boolean);
for (const a of arches) if (!(a in ARCHES)) throw new Error(`unknown --arch ${a} (known: ${Object.keys(ARCHES).join(', ')})`);
for (const p of packages) if (!(p in DEFINES)) throw new Error(`unknown --package ${p} (known: ${Object.keys(DEFINES).join(', ')})`);

const missing = [];
for (const a of arches) {
  const { prefix } = ARCHES[a];
  for (const tool of [`${prefix}g++`, `${prefix}strip`, `${prefix}objdump`]) if (!has(tool)) missing.push(tool);
}
if (!has('cmake')) missing.push('cmake');
if (missing.length > 0) {
  console.error(`prebuild: missing tools: ${missing.join(', ')} (Debian: apt-get install cmake g++ make g++-aarch64-linux-gnu binutils-aarch64-linux-gnu)`);
  process.exit(1);
}

const prebuildify = join(root, 'node_modules', 'prebuildify', 'bin.js');
const shim = join(root, 'scripts', 'prebuildify-cmake-js.mjs');
const summary = [];
let failed = false;
for (const pkg of packages) {
  const dir = join(root, 'packages', pkg);
  rmSync(join(dir, 'prebuilds'), { recursive: true, force: true });
  for (const arch of arches) {
    const { prefix, machine } = ARCHES[arch];
    // A staging copy, so the release build never touches the development build in build/.
    const stage = join(dir, 'build', `prebuild-${arch}`);
    rmSync(stage, { recursive: true, force: true });
    mkdirSync(stage, { recursive: true });
    for (const f of ['native', 'CMakeLists.txt', 'package.json']) cpSync(join(dir, f), join(stage, f), { recursive: true });
    const env = {
      ...process.env,
      PREBUILD_STRIP_BIN: `${prefix}strip`,
      TW_CMAKE_DEFINES: DEFINES[pkg].join(' '),
      TW_CMAKE_TOOLCHAIN: prefix === '' ? '' : join(root, 'scripts', `toolchain-linux-${arch}.cmake`),
    };
    console.log(`prebuild: ${pkg} linux-${arch}`);
    const r = spawnSync(
      process.execPath,
      [prebuildify, '--napi', '--strip', '--tag-libc', `--arch=${arch}`, '--platform=linux', `--cwd=${stage}`, `--out=${dir}`, `--node-gyp=${shim}`],
      { stdio: 'inherit', env },
    );
    if (r.status !== 0) {
      console.error(`prebuild: ${pkg} linux-${arch} failed`);
      failed = true;
      continue;
    }
    const out = join(dir, 'prebuilds', `linux-${arch}`);
    for (const f of readdirSync(out).filter((n) => n.endsWith('.node'))) {
      const file = join(out, f);
      const header = run('readelf', ['-h', file]);
      const got = /Machine:\s+(.+)/.exec(header)?.[1]?.trim();
      const symbols = run(`${prefix}objdump`, ['-T', file]);
      const glibc = [...symbols.matchAll(/GLIBC_(\d+)\.(\d+)(?:\.(\d+))?/g)]
        .map((m) => [Number(m[1]), Number(m[2]), Number(m[3] ?? 0)])
        .sort((x, y) => x[0] - y[0] || x[1] - y[1] || x[2] - y[2])
        .pop();
      const cxx = [...symbols.matchAll(/GLIBCXX_(\d+)\.(\d+)(?:\.(\d+))?/g)]
        .map((m) => [Number(m[1]), Number(m[2]), Number(m[3] ?? 0)])
        .sort((x, y) => x[0] - y[0] || x[1] - y[1] || x[2] - y[2])
        .pop();
      const stripped = !run(`${prefix}objdump`, ['-h', file]).includes('.symtab') && !/\.debug_/.test(run(`${prefix}objdump`, ['-h', file]));
      if (got !== machine) {
        console.error(`prebuild: ${file} is for ${got}, expected ${machine}`);
        failed = true;
      }
      summary.push({
        file: file.slice(root.length + 1),
        machine: got,
        glibc: glibc ? glibc.join('.').replace(/\.0$/, '') : 'none',
        glibcxx: cxx ? cxx.join('.').replace(/\.0$/, '') : 'none',
        stripped,
      });
    }
    rmSync(stage, { recursive: true, force: true });
  }
  if (!existsSync(join(dir, 'prebuilds'))) failed = true;
}
console.table(summary);
process.exit(failed ? 1 : 0);
