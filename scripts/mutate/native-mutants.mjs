#!/usr/bin/env node
/**
 * Native mutants of @tensorwire/cuda-ipc (issue 14): a small scripted set of realistic bugs in
 * the addon's invariant code (segment modes, unlink, header checks, token compares, seqlock),
 * applied one at a time, each built and run against the tests that must catch it.
 *
 * Nothing in the working tree is modified: the package's native sources are copied to a
 * scratch build (node_modules/.cache/tensorwire-mutate/cuda-ipc, git-ignored), each mutant
 * is applied to that copy and built there (cmake-js, incremental), the tests run with
 * TENSORWIRE_CUDA_IPC_ADDON pointing at the scratch addon, and the copy is restored from the
 * real sources before the next mutant (and on exit, failure or interrupt).
 *
 * Usage: node scripts/mutate/native-mutants.mjs [--only id,id] [--list]
 * Exit status: 0 when every mutant was killed, 1 when one survived or could not be applied.
 */
import { spawnSync } from 'node:child_process';
import { cpSync, existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const pkg = join(root, 'packages', 'cuda-ipc');
const scratch = join(root, 'node_modules', '.cache', 'tensorwire-mutate', 'cuda-ipc');
const addon = join(scratch, 'build', 'Release', 'cuda_ipc.node');

/**
 * Each mutant: `file` (under native/), a `find` regex, its `replace`, how many matches to expect
 * at least (all are replaced), and the test files that must fail with it.
 */
export const MUTANTS = [
  {
    id: 'open-mode',
    what: 'opening a segment no longer refuses group/other-accessible modes (invariant 10)',
    file: 'shm.cc',
    find: /if \(\(st\.st_mode & 0077\) != 0\) return refuse\(/g,
    replace: 'if (false) return refuse(',
    tests: ['test/invariants.test.ts'],
  },
  {
    id: 'unlink',
    what: "the owner's free no longer removes the segment's name (invariant 10)",
    file: 'shm.cc',
    find: /(Status UnlinkSegment\([^]*?)if \((?:shm_)?unlink\([^;{]*\) != 0\) \{/,
    replace: '$1if ((errno = ENOENT, true)) {',
    tests: ['test/invariants.test.ts'],
  },
  {
    id: 'header-id',
    what: "a segment header's id is no longer compared with the expected pool id (invariant 10)",
    file: 'shm.cc',
    find: /if \(!expect_id\.empty\(\) && m->id != expect_id\)/,
    replace: 'if (false)',
    tests: ['test/invariants.test.ts'],
  },
  {
    id: 'header-capacity',
    what: "a host slot header's capacity is no longer checked against the mapping size (invariant 10)",
    file: 'shm.cc',
    find: /m->capacity == 0 \|\| m->capacity != size - kDataOffset/,
    replace: 'm->capacity == 0',
    tests: ['test/pool.test.ts'],
  },
  {
    id: 'grant-token',
    what: "a whole-registration grant's token is no longer compared (invariant 13)",
    file: 'shm.cc',
    nth: 0,
    find: /diff \|= static_cast<uint8_t>\(t \^ \(i < token_len \? token\[i\] : 0\)\);/g,
    replace: 'diff |= 0;',
    tests: ['test/invariants.test.ts'],
  },
  {
    id: 'record-token',
    what: "a range grant record's token is no longer compared (invariant 13)",
    file: 'shm.cc',
    nth: 1,
    find: /diff \|= static_cast<uint8_t>\(t \^ \(i < token_len \? token\[i\] : 0\)\);/g,
    replace: 'diff |= 0;',
    tests: ['test/grants.test.ts'],
  },
  {
    id: 'range-table-bound',
    what: "a range grant's table is written without checking each range against its registration (invariant 13)",
    file: 'shm.cc',
    find: /if \(off \+ len <= r\[2\]\) \{/,
    replace: 'if (true) {',
    tests: ['test/grant-table-write.test.ts'],
  },
  {
    id: 'range-table-integer',
    what: "a range grant's table accepts fractional offsets (invariant 13)",
    file: 'shm.cc',
    find: /static_cast<double>\(oi\) == off && /,
    replace: '',
    tests: ['test/grant-table-write.test.ts'],
  },
  {
    id: 'range-table-arena',
    what: "a range grant's table is written past its room in the arena",
    file: 'shm.cc',
    find: /count > \(g\.arena - arena_offset\) \/ kRangeEntryBytes/,
    replace: 'false',
    tests: ['test/grant-table-write.test.ts'],
  },
  {
    id: 'seqlock-recheck',
    what: "the seqlock reader no longer re-checks the generation after reading (invariant 11)",
    file: 'shm.cc',
    find: /if \(g1 != g2\) \{/g,
    replace: 'if (false) {',
    tests: ['test/seqlock.test.ts'],
  },
  {
    id: 'seqlock-odd',
    what: 'the seqlock writer no longer marks a write in progress (odd generation) (invariant 11)',
    file: 'shm.cc',
    find: /__atomic_compare_exchange_n\(gen, &g, g \+ 1,/,
    replace: '__atomic_compare_exchange_n(gen, &g, g,',
    tests: ['test/seqlock.test.ts'],
  },
  {
    id: 'freed-slot',
    what: 'a batch no longer refuses a pool slot its owner freed before the batch (stale bytes through a live registration)',
    file: 'shm.cc',
    find: /if \(m\.state != kStateLive\) \{\n(\s*)\/\/ Freed by its owner before the batch/,
    replace: 'if (false) {\n$1// Freed by its owner before the batch',
    tests: ['test/grants.test.ts'],
  },
  {
    id: 'plan-stale-local',
    what: 'a run of the batch tables (copyBatch, copyPlanned) trusts more local bytes than the buffer has now (a plan kept across a detach or a shrink)',
    file: 'addon.cc',
    find: /(plan\.locals\[i\]\.Value\(\)\.As<Napi::Uint8Array>\(\);\s*st\.locals\[i\] = BatchLocal\{u8\.Data\(\), )u8\.ByteLength\(\)\}/,
    replace: '$1u8.ByteLength() + 4096}',
    tests: ['test/batch.test.ts'],
  },
  {
    id: 'plan-flags',
    what: 'the batch table parser (copyBatch, planBatch) no longer refuses a segment flag other than 0 or 1',
    file: 'addon.cc',
    find: /if \(flags > 1\) ThrowInvalid\(env, name \+ ": segment flags must be 0 or 1"\);/,
    replace: '',
    tests: ['test/batch.test.ts'],
  },
  {
    id: 'pool-last-piece',
    what: 'the copy pool leaves the last piece of a threaded group uncopied (copyThreads > 1)',
    file: 'copy_pool.cc',
    find: /if \(p >= pieces\) return;/,
    replace: 'if (p + 1 >= pieces) return;',
    tests: ['test/copy-threads.test.ts'],
  },
  {
    id: 'async-generations',
    what: 'a copy off the JavaScript thread never reports the generations it copied pool slots at (a transfer split over batches could mix two versions of a slot)',
    file: 'addon.cc',
    find: /std::memcpy\(g, gens_\.data\(\), gens_\.size\(\) \* sizeof\(uint64_t\)\);/,
    replace: '(void)g;',
    tests: ['test/async-copy.test.ts'],
  },
  {
    id: 'async-teardown',
    what: 'a copy off the JavaScript thread that ends while its environment is torn down lets the failed settle escape (the process aborts)',
    file: 'addon.cc',
    find: /\} catch \(const Napi::Error&\) \{\n {4}\/\/ The environment is being torn down/,
    replace: '} catch (const int&) {\n    // The environment is being torn down',
    tests: ['test/async-copy.test.ts'],
  },
  {
    id: 'async-cancel-wait',
    what: 'a copy off the JavaScript thread no longer sees its cancellation while it waits for a write in progress (an aborted post waits for the writer, up to its deadline)',
    file: 'shm.cc',
    find: /if \(deadline_passed\(\)\) return Fail\(f, kTimedOut, "", "deadline passed while the slot was write-locked"\);\n(\s*)if \(Stopped\(in\)\) return FailStopped\(f\);/,
    replace: 'if (deadline_passed()) return Fail(f, kTimedOut, "", "deadline passed while the slot was write-locked");\n$1(void)0;',
    tests: ['test/async-copy.test.ts'],
  },
  {
    id: 'async-cancel-queued',
    what: 'a copy off the JavaScript thread cancelled while queued still runs when a thread takes it (its post has settled already: bytes land after the caller was told they would not)',
    file: 'addon.cc',
    find: /!__atomic_compare_exchange_n\(control_word_, &queued, kCopyRunning, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST\)/,
    replace: '(__atomic_store_n(control_word_, kCopyRunning, __ATOMIC_SEQ_CST), false)',
    tests: ['test/async-copy.test.ts'],
  },
  {
    id: 'async-queued-deadline',
    what: 'a copy off the JavaScript thread whose deadline passed while it waited for a pool thread still copies (bytes land after the caller gave up)',
    file: 'addon.cc',
    find: /if \(state_\.in\.deadline_ms > 0 && BatchNowMs\(\) > state_\.in\.deadline_ms\) \{/,
    replace: 'if (false) {',
    tests: ['test/async-copy.test.ts'],
  },
];

function run(cmd, args, opts = {}) {
  return spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 64 << 20, ...opts });
}

function syncSources() {
  mkdirSync(scratch, { recursive: true });
  cpSync(join(pkg, 'native'), join(scratch, 'native'), { recursive: true });
  cpSync(join(pkg, 'CMakeLists.txt'), join(scratch, 'CMakeLists.txt'));
  cpSync(join(pkg, 'package.json'), join(scratch, 'package.json'));
}

/** Restore a file of the scratch copy from the real sources (the real ones are never edited). */
function restore(file) {
  cpSync(join(pkg, 'native', file), join(scratch, 'native', file));
}

function build() {
  const r = run('npx', ['cmake-js', 'build', '--out', 'build'], { cwd: scratch });
  return { ok: r.status === 0 && existsSync(addon), log: `${r.stdout}\n${r.stderr}` };
}

function test(files) {
  const r = run('npx', ['vitest', 'run', '--root', pkg, ...files], {
    cwd: root,
    env: { ...process.env, TENSORWIRE_CUDA_IPC_ADDON: addon, FORCE_COLOR: '0' },
    timeout: 300_000,
  });
  return { passed: r.status === 0, log: `${r.stdout}\n${r.stderr}` };
}

function apply(m) {
  const path = join(scratch, 'native', m.file);
  const src = readFileSync(path, 'utf8');
  let count = 0;
  let out;
  if (m.nth !== undefined) {
    out = src.replace(m.find, (match) => (count++ === m.nth ? m.replace : match));
    if (count <= m.nth) return `anchor found ${count} times, mutant needs occurrence ${m.nth + 1}`;
  } else {
    out = src.replace(m.find, (...args) => {
      count++;
      // Expand $1.. like String.replace would.
      return m.replace.replace(/\$(\d)/g, (_, d) => args[Number(d)] ?? '');
    });
    if (count === 0) return 'anchor not found';
  }
  if (out === src) return 'replacement changed nothing';
  writeFileSync(path, out);
  return undefined;
}

function main() {
  const args = process.argv.slice(2);
  if (args.includes('--list')) {
    for (const m of MUTANTS) console.log(`${m.id.padEnd(16)} ${m.what}  [${m.tests.join(' ')}]`);
    return 0;
  }
  const onlyAt = args.indexOf('--only');
  const only = onlyAt >= 0 ? new Set(String(args[onlyAt + 1]).split(',')) : undefined;
  const mutants = MUTANTS.filter((m) => !only || only.has(m.id));
  const files = new Set(mutants.map((m) => m.file));
  const cleanup = () => {
    for (const f of files) if (existsSync(join(scratch, 'native', f))) restore(f);
  };
  for (const sig of ['SIGINT', 'SIGTERM']) {
    process.on(sig, () => {
      cleanup();
      process.exit(130);
    });
  }
  const started = Date.now();
  syncSources();
  console.log(`[native mutants] baseline build in ${scratch}`);
  const base = build();
  if (!base.ok) {
    console.error(base.log.slice(-4000));
    console.error('[native mutants] the unmutated addon does not build (someone may be mid-edit): retry in a few minutes');
    return 2;
  }
  const loaded = run(process.execPath, ['--input-type=module', '-e', "import('@tensorwire/cuda-ipc').then((m) => console.log(m.capabilities().addon.path ?? ''))"], {
    cwd: pkg,
    env: { ...process.env, TENSORWIRE_CUDA_IPC_ADDON: addon },
  });
  if (!String(loaded.stdout).includes(scratch)) {
    console.error(`[native mutants] the override is not honoured (loaded ${String(loaded.stdout).trim() || loaded.stderr}); refusing to report scores`);
    return 2;
  }
  const baseTests = test([...new Set(mutants.flatMap((m) => m.tests))]);
  if (!baseTests.passed) {
    console.error(baseTests.log.slice(-4000));
    console.error('[native mutants] the tests fail on the unmutated scratch addon: fix that first');
    return 2;
  }
  const results = [];
  try {
    for (const m of mutants) {
      const t0 = Date.now();
      const problem = apply(m);
      let status;
      let detail = '';
      if (problem) {
        status = 'not-applied';
        detail = problem;
      } else {
        const b = build();
        if (!b.ok) {
          status = 'compile-error';
          detail = b.log.split('\n').filter((l) => /error/.test(l)).slice(0, 3).join(' | ');
        } else {
          const t = test(m.tests);
          status = t.passed ? 'SURVIVED' : 'killed';
          if (!t.passed) detail = (t.log.match(/^.*(?:FAIL|×|✗).*$/m) ?? [''])[0].trim().slice(0, 160);
        }
      }
      restore(m.file);
      results.push({ id: m.id, status, seconds: Math.round((Date.now() - t0) / 1000), detail });
      console.log(`[native mutants] ${m.id.padEnd(16)} ${status.padEnd(13)} ${String(results.at(-1).seconds).padStart(4)} s  ${detail}`);
    }
  } finally {
    cleanup();
  }
  // Leave the scratch addon unmutated (rebuilt from the real sources).
  build();
  const killed = results.filter((r) => r.status === 'killed').length;
  const score = results.length ? Math.round((1000 * killed) / results.length) / 10 : 0;
  console.log(`[native mutants] ${killed}/${results.length} killed (${score}%), ${Math.round((Date.now() - started) / 1000)} s`);
  const report = join(root, 'coverage', 'mutation', 'native-mutants.json');
  mkdirSync(dirname(report), { recursive: true });
  writeFileSync(report, JSON.stringify({ when: new Date().toISOString(), results, score }, null, 2));
  console.log(`[native mutants] report: ${report}`);
  return killed === results.length ? 0 : 1;
}

process.exitCode = main();
