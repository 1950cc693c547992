#!/usr/bin/env node
// prebuildify's build command for the cmake-js addons. prebuildify (6.x) runs its
// `--node-gyp` command as `<cmd> rebuild --target=<node> --devdir=<dir> --arch=<arch> --release`
// in the package directory and then takes the `.node` file from build/Release; this maps that
// onto cmake-js. Extra CMake definitions come from TW_CMAKE_DEFINES (space separated
// NAME=VALUE), a cross toolchain file from TW_CMAKE_TOOLCHAIN.
import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';

const args = process.argv.slice(2);
if (args[0] !== 'rebuild') {
  console.error(`prebuildify-cmake-js: expected "rebuild", got ${JSON.stringify(args)}`);
  process.exit(2);
}
const debug = args.includes('--debug');
const require = createRequire(join(process.cwd(), 'package.json'));
const cmakeJsPkg = require.resolve('cmake-js/package.json');
const cmakeJs = join(dirname(cmakeJsPkg), 'bin', 'cmake-js');

const cmakeArgs = ['rebuild', '--out', 'build', '--log-level', 'warn', '--prefer-make'];
if (debug) cmakeArgs.push('--debug');
for (const d of (process.env.TW_CMAKE_DEFINES ?? '').split(/\s+/).filter(Boolean)) cmakeArgs.push(`--CD${d}`);
if (process.env.TW_CMAKE_TOOLCHAIN) cmakeArgs.push(`--CDCMAKE_TOOLCHAIN_FILE=${process.env.TW_CMAKE_TOOLCHAIN}`);

const r = spawnSync(process.execPath, [cmakeJs, ...cmakeArgs], { stdio: 'inherit' });
process.exit(r.status ?? 1);
