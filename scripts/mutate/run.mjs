#!/usr/bin/env node
/**
 * Mutation testing of the invariant code (issue 14), one command:
 *
 *   npm run mutate                  StrykerJS on core, cuda-ipc, lock-client (incremental), then the native mutants
 *   npm run mutate -- --fast        the CI subset: native mutants + TypeScript mutants of the owner guard and grant checks
 *   npm run mutate -- --only core,native    some of: core, cuda-ipc, lock-client, native
 *
 * Reports: coverage/mutation/<pkg>/index.html (Stryker's HTML report), coverage/mutation/<pkg>/mutation.json,
 * coverage/mutation/native-mutants.json, and a per-file summary in coverage/mutation/summary.md.
 * Incremental files live next to the reports: a second run only tests mutants whose code or tests changed.
 *
 * Exit status: non-zero when a native mutant survived, a run failed, or (--fast) a TypeScript
 * mutant of the fast set survived that is not in KNOWN_SURVIVORS below.
 */
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const here = join(root, 'scripts', 'mutate');
const args = process.argv.slice(2);
const fast = args.includes('--fast');
const onlyAt = args.indexOf('--only');
const only = onlyAt >= 0 ? new Set(String(args[onlyAt + 1]).split(',')) : undefined;
const PACKAGES = fast ? ['core', 'cuda-ipc'] : ['core', 'cuda-ipc', 'lock-client'];
const wanted = (name) => !only || only.has(name);

/**
 * Surviving mutants judged equivalent, with why (known-survivors.json; also in the package
 * READMEs, "Mutation testing"). Matched by file, mutator, replacement and the text of the
 * mutated line (not its number: these files are edited all the time). A survivor not listed
 * fails the fast run.
 */
const survivorKey = (file, mutator, replacement, line) => `${file}|${mutator}|${replacement}|${line.trim()}`;
const KNOWN_SURVIVORS = new Set(JSON.parse(readFileSync(join(here, 'known-survivors.json'), 'utf8')).map((k) => survivorKey(k.file, k.mutator, k.replacement, k.line)));

/** Run a child to its end; an interrupt of this script is passed on to it (it cleans up its sandbox). */
let current;
for (const sig of ['SIGINT', 'SIGTERM']) {
  process.on(sig, () => {
    if (current) current.kill(sig);
    process.exitCode = 130;
    setTimeout(() => process.exit(130), 15_000).unref();
    interrupted = true;
  });
}
let interrupted = false;
function run(args, cwd) {
  return new Promise((resolve) => {
    current = spawn(process.execPath, args, { cwd, env, stdio: 'inherit' });
    current.on('exit', (code, signal) => {
      current = undefined;
      resolve({ status: code, signal });
    });
  });
}

const env = { ...process.env, FORCE_COLOR: '0', ...(fast ? { TW_MUTATE_FAST: '1' } : {}) };
const started = Date.now();
let failed = false;
const summary = [];

function scoreTable(pkg) {
  const file = join(root, 'coverage', 'mutation', pkg, 'mutation.json');
  if (!existsSync(file)) return [];
  const report = JSON.parse(readFileSync(file, 'utf8'));
  const rows = [];
  for (const [name, f] of Object.entries(report.files)) {
    const c = { Killed: 0, Timeout: 0, Survived: 0, NoCoverage: 0, CompileError: 0, RuntimeError: 0, Ignored: 0 };
    const survivors = [];
    const lines = f.source.split('\n');
    for (const m of f.mutants) {
      c[m.status] = (c[m.status] ?? 0) + 1;
      if (m.status === 'Survived' || m.status === 'NoCoverage') {
        const text = lines[m.location.start.line - 1] ?? '';
        survivors.push({ at: `packages/${pkg}/${name}:${m.location.start.line}`, key: survivorKey(`packages/${pkg}/${name}`, m.mutatorName, m.replacement ?? '', text), what: `${m.mutatorName} -> ${m.replacement ?? ''}: ${text.trim()}` });
      }
    }
    const detected = c.Killed + c.Timeout;
    const valid = detected + c.Survived + c.NoCoverage;
    rows.push({ file: `packages/${pkg}/${name}`, killed: c.Killed, timeout: c.Timeout, survived: c.Survived, noCoverage: c.NoCoverage, ignored: c.Ignored, score: valid ? Math.round((1000 * detected) / valid) / 10 : 100, survivors });
  }
  return rows;
}

for (const pkg of PACKAGES) {
  if (!wanted(pkg) || interrupted) continue;
  const t0 = Date.now();
  console.log(`\n[mutate] ${pkg}: StrykerJS${fast ? ' (fast subset)' : ''}`);
  const r = await run([join(here, 'stryker.mjs'), join(here, 'stryker', `${pkg}.config.mjs`)], join(root, 'packages', pkg));
  if (r.status !== 0) {
    console.error(`[mutate] ${pkg}: Stryker exited with ${r.status ?? r.signal}`);
    failed = true;
  }
  const rows = scoreTable(pkg);
  summary.push(...rows);
  for (const row of rows) {
    console.log(`[mutate] ${row.file}: ${row.score}% (killed ${row.killed}, timeout ${row.timeout}, survived ${row.survived}, no coverage ${row.noCoverage}, static ignored ${row.ignored})`);
    for (const s of row.survivors) if (!fast) console.log(`[mutate]   survivor ${s.at} ${s.what}${KNOWN_SURVIVORS.has(s.key) ? ' (known equivalent)' : ''}`);
    if (fast) {
      for (const s of row.survivors) {
        if (!KNOWN_SURVIVORS.has(s.key)) {
          console.error(`[mutate] new surviving mutant: ${s.at} ${s.what}`);
          failed = true;
        }
      }
    }
  }
  console.log(`[mutate] ${pkg}: ${Math.round((Date.now() - t0) / 1000)} s; report coverage/mutation/${pkg}/index.html`);
}

if (wanted('native') && !interrupted) {
  console.log('\n[mutate] native mutants (cuda-ipc addon)');
  const r = await run([join(here, 'native-mutants.mjs')], root);
  if (r.status !== 0) failed = true;
}

mkdirSync(join(root, 'coverage', 'mutation'), { recursive: true });
const lines = ['| file | score | killed | timeout | survived | no coverage | static (ignored) |', '|---|---|---|---|---|---|---|'];
for (const r of summary) lines.push(`| ${r.file} | ${r.score}% | ${r.killed} | ${r.timeout} | ${r.survived} | ${r.noCoverage} | ${r.ignored} |`);
writeFileSync(join(root, 'coverage', 'mutation', 'summary.md'), `${lines.join('\n')}\n`);
console.log(`\n[mutate] done in ${Math.round((Date.now() - started) / 1000)} s${failed ? ' — FAILED' : ''}; summary coverage/mutation/summary.md`);
process.exitCode = interrupted ? 130 : failed ? 1 : 0;
