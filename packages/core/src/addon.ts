/**
 * `@tensorwire/core/addon`: finding and loading a tensorwire plugin's native addon, shared by
 * every addon package (`@tensorwire/cuda-ipc`, `@tensorwire/rdma-verbs`) so the rules are one
 * piece of code. Order: the package's `*_ADDON` override, then what node-gyp-build (resolved
 * from the addon package, which depends on it) picks in the package directory: a build from
 * source in `build/Release` or `build/Debug`, else the prebuild in
 * `prebuilds/<platform>-<arch>/` whose tags match this Node and libc. Never throws: a failure
 * comes back as errors plus a description of the platform, the prebuilds the package has and
 * what to install to build from source, for BackendUnavailableError. Also the packages' npm
 * `install` hook ({@link installHook}).
 */
import { spawnSync } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join, resolve } from 'node:path';

/** What one addon package tells the loader about itself. */
export interface AddonSpec {
  /** The npm package name, e.g. `@tensorwire/cuda-ipc`. */
  readonly name: string;
  /** The package directory (where package.json, prebuilds/ and build/ are). */
  readonly root: string;
  /** Environment variable naming an addon file to load instead. */
  readonly envVar: string;
  /** Debian packages a build from source needs besides cmake, g++ and make. */
  readonly extraDebianPackages?: readonly string[];
  /** CMake definitions of a build from source (`NAME=VALUE`). */
  readonly cmakeDefines?: readonly string[];
}

/** This process's platform, as the prebuild tags name it. */
export interface PlatformInfo {
  readonly platform: string;
  readonly arch: string;
  readonly libc: 'glibc' | 'musl' | 'unknown';
  /** glibc's version when known, e.g. `2.36`. */
  readonly glibcVersion: string | undefined;
  readonly node: string;
  readonly napiVersion: number;
}

export interface AddonLoadResult<T> {
  readonly addon: T | undefined;
  readonly path: string | undefined;
  /** One entry per candidate that failed, `path: reason`. */
  readonly errors: readonly string[];
  readonly platform: PlatformInfo;
  /** The prebuilds this package ships, as `<platform>-<arch>/<file>`. */
  readonly prebuilds: readonly string[];
}

/** The platform as node-gyp-build sees it (libc from the process report, as detect-libc does). */
export function platformInfo(): PlatformInfo {
  const header = (process.report?.getReport() as { header?: { glibcVersionRuntime?: string } } | undefined)?.header;
  const glibcVersion = header?.glibcVersionRuntime;
  let libc: PlatformInfo['libc'] = 'unknown';
  if (glibcVersion !== undefined) libc = 'glibc';
  else if (process.platform === 'linux') libc = existsSync('/etc/alpine-release') || hasMuslLoader() ? 'musl' : 'unknown';
  return { platform: process.platform, arch: process.arch, libc, glibcVersion, node: process.versions.node, napiVersion: Number(process.versions.napi ?? 0) };
}

function hasMuslLoader(): boolean {
  try {
    return readdirSync('/lib').some((f) => f.startsWith('ld-musl-'));
  } catch {
    return false;
  }
}

/** The prebuilds shipped in `root`, as `<platform>-<arch>/<file>`. */
export function listPrebuilds(root: string): string[] {
  const out: string[] = [];
  const dir = join(root, 'prebuilds');
  let tuples: string[];
  try {
    tuples = readdirSync(dir).sort();
  } catch {
    return out;
  }
  for (const t of tuples) {
    try {
      for (const f of readdirSync(join(dir, t)).sort()) if (f.endsWith('.node')) out.push(`${t}/${f}`);
    } catch {
      // not a directory
    }
  }
  return out;
}

/** Candidate paths, in order; a candidate that could not even be resolved is reported in `errors`. */
export function addonPaths(spec: AddonSpec, errors: string[] = []): string[] {
  const out: string[] = [];
  const override = process.env[spec.envVar];
  if (override !== undefined && override !== '') out.push(resolve(override));
  const require = createRequire(join(spec.root, 'package.json'));
  try {
    const nodeGypBuild = require('node-gyp-build') as { path(dir: string): string };
    out.push(nodeGypBuild.path(spec.root));
  } catch (e) {
    errors.push(`${spec.root}: ${e instanceof Error ? (e.message.split('\n')[0] ?? e.message) : String(e)}`);
  }
  return out;
}

/** Try every candidate; never throws. */
export function loadAddon<T>(spec: AddonSpec): AddonLoadResult<T> {
  const errors: string[] = [];
  const require = createRequire(join(spec.root, 'package.json'));
  const platform = platformInfo();
  const prebuilds = listPrebuilds(spec.root);
  for (const path of addonPaths(spec, errors)) {
    try {
      const addon = require(path) as T;
      return { addon, path, errors, platform, prebuilds };
    } catch (e) {
      errors.push(`${path}: ${e instanceof Error ? (e.message.split('\n')[0] ?? e.message) : String(e)}`);
    }
  }
  return { addon: undefined, path: undefined, errors, platform, prebuilds };
}

/** What a build from source of this addon needs, as one sentence. */
export function sourceBuildHint(spec: AddonSpec): string {
  const debian = ['cmake', 'g++', 'make', ...(spec.extraDebianPackages ?? [])].join(' ');
  return (
    `to build it from source, install cmake >= 3.15, a C++17 compiler and make (Debian/Ubuntu: apt-get install ${debian}) ` +
    `and the build tools (npm install --save-dev cmake-js@^8 node-addon-api@^8), then run npm rebuild ${spec.name}`
  );
}

/** The message of the BackendUnavailableError for a failed load: platform, prebuilds, what to install, what failed. */
export function loadFailureMessage(spec: AddonSpec, r: AddonLoadResult<unknown>): string {
  const p = r.platform;
  const where = `${p.platform}-${p.arch} (${p.libc}${p.glibcVersion !== undefined ? ` ${p.glibcVersion}` : ''}, Node.js ${p.node}, Node-API ${p.napiVersion})`;
  const has = r.prebuilds.length > 0 ? `this package has prebuilds for ${r.prebuilds.join(', ')}` : 'this package has no prebuilds';
  return `the ${spec.name} native addon could not be loaded on ${where}: ${has}; ${sourceBuildHint(spec)}. Tried: ${r.errors.join('; ')}`;
}

/** Tools a build from source needs that this machine lacks (empty: a build can be tried). */
export function missingBuildTools(spec: AddonSpec): string[] {
  const missing: string[] = [];
  const onPath = (cmd: string): boolean => spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;
  if (!onPath('cmake')) missing.push('cmake');
  if (!['c++', 'g++', 'clang++'].some(onPath)) missing.push('a C++ compiler (g++)');
  if (!onPath('make') && !onPath('ninja')) missing.push('make');
  const require = createRequire(join(spec.root, 'package.json'));
  for (const pkg of ['cmake-js', 'node-addon-api']) {
    try {
      require.resolve(`${pkg}/package.json`);
    } catch {
      missing.push(`the npm package ${pkg}`);
    }
  }
  return missing;
}

/**
 * The package's npm `install` hook: nothing when an addon loads (a matching prebuild); else a
 * build from source when the tools are there; else a note saying what is missing. Never fails
 * the install: loading the package then throws BackendUnavailableError with the same advice.
 */
export function installHook(spec: AddonSpec): void {
  const before = loadAddon(spec);
  if (before.addon !== undefined) return;
  const missing = missingBuildTools(spec);
  if (missing.length > 0) {
    console.warn(`${spec.name}: no prebuilt native addon matches this platform and it cannot be built here (missing: ${missing.join(', ')}).\n${loadFailureMessage(spec, before)}`);
    return;
  }
  const require = createRequire(join(spec.root, 'package.json'));
  const cmakeJs = join(require.resolve('cmake-js/package.json'), '..', 'bin', 'cmake-js');
  const args = [cmakeJs, 'build', '--out', 'build', ...(spec.cmakeDefines ?? []).map((d) => `--CD${d}`)];
  console.warn(`${spec.name}: no prebuilt native addon matches this platform; building it from source (cmake-js)`);
  const r = spawnSync(process.execPath, args, { cwd: spec.root, stdio: 'inherit' });
  if (r.status !== 0) console.warn(`${spec.name}: the build from source failed (exit ${r.status}); the package will report BackendUnavailableError until it is rebuilt (npm rebuild ${spec.name})`);
}
