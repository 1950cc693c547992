#!/usr/bin/env node
/**
 * Run StrykerJS on one package: `node scripts/mutate/stryker.mjs <config.mjs>` with cwd = the
 * package (scripts/mutate/run.mjs does this). Uses Stryker's programmatic API: the CLI of
 * @stryker-mutator/core 10 refuses Node < 22 at import, while the engine itself runs on the
 * Node 20.19+ this repository supports (the machines here have Node 20).
 * Extra arguments narrow the run: `--mutate <glob[:range]>` (repeatable) replaces the config's
 * list; `--file <path>` (repeatable) keeps only the config's entries for that file (its method
 * ranges, found when the config is loaded). With TW_MUTATE_TAG=<name> the part gets its own
 * report, incremental file and sandbox (see stryker/base.mjs), e.g. from packages/cuda-ipc:
 *   TW_MUTATE_TAG=transport nice -n 19 node ../../scripts/mutate/stryker.mjs ../../scripts/mutate/stryker/cuda-ipc.config.mjs --file src/transport.ts
 */
import { rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';

const [configPath, ...rest] = process.argv.slice(2);
if (!configPath) {
  console.error('usage: node scripts/mutate/stryker.mjs <config.mjs> [--mutate pattern]...');
  process.exit(2);
}
const config = { ...(await import(pathToFileURL(resolve(configPath)).href)).default };
const narrowed = [];
const files = [];
for (let i = 0; i < rest.length; i++) {
  if (rest[i] === '--mutate') narrowed.push(rest[++i]);
  else if (rest[i] === '--file') files.push(rest[++i]);
}
if (narrowed.length) config.mutate = narrowed;
if (files.length) {
  config.mutate = config.mutate.filter((m) => files.some((f) => m === f || m.startsWith(`${f}:`)));
  if (config.mutate.length === 0) {
    console.error(`stryker.mjs: the config mutates nothing in ${files.join(', ')}`);
    process.exit(2);
  }
}

const require = createRequire(import.meta.url);
const core = dirname(require.resolve('@stryker-mutator/core/package.json'));
const { Stryker } = await import(pathToFileURL(join(core, 'dist', 'src', 'stryker.js')).href);

const sandbox = resolve(config.tempDirName ?? '.stryker-tmp');
const cleanup = () => rmSync(sandbox, { recursive: true, force: true });
for (const sig of ['SIGINT', 'SIGTERM']) {
  process.once(sig, () => {
    cleanup();
    process.exit(130);
  });
}
try {
  const results = await new Stryker(config).runMutationTest();
  const by = {};
  for (const r of results) by[r.status] = (by[r.status] ?? 0) + 1;
  console.log(`[stryker] ${process.cwd()}: ${JSON.stringify(by)}`);
} finally {
  cleanup();
}
