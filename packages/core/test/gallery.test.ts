/**
 * The gallery: the conformance suite must reject every broken variant of the reference
 * transport (test/gallery/reference.ts, one bug class each), and the reference itself passes it
 * (gallery.reference.test.ts). Each variant runs the whole suite in its own vitest process
 * (test/gallery/variant.suite.ts); this file asserts that it failed, and that the suite cases
 * written for its bug class are among those that caught it. The pairing is the table in
 * test/gallery/README.md; a variant that survives is a missing suite case.
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { BUGS, type Bug } from './gallery/reference.js';

/**
 * For each bug class, the suite cases written for it (substrings of their names): each must
 * fail on the variant. Other cases may fail too; all are recorded.
 */
const WRITTEN_FOR: Record<Bug, readonly string[]> = {
  'no-token-compare': ['any one payload byte changed', 're-owned to another node', 'earlier incarnation'],
  'no-bounds-check': ['one byte (or one range) more', 'range lengths shifted'],
  'off-by-one': ['one byte (or one range) more'],
  'no-local-bounds-check': ['refuses a local range outside its registration'],
  'ignores-abort': ["signal already fired", 'READ aborted while the peer is stalled'],
  'ignores-deadline-when-stalled': ['READ from a peer that stops answering mid-connection', 'WRITE to a stalled peer'],
  'settles-before-quiesce': ['READ from a peer that stops answering mid-connection', 'READ aborted while the peer is stalled'],
  'write-settles-before-flush': ['WRITE to a stalled peer'],
  'no-identity-proof': ['names one node and points at another', 'another node listens than the one named'],
  'abortive-retire': ['retire() by the connector with transfers in flight', 'retire() by the acceptor with transfers in flight'],
  'revoke-does-not-revoke': ['a revoked registration is RemoteRejected', 'after revoke the grant is RemoteRejected'],
  'revoke-does-not-wait': ['holder revokes while READs of the memory are in flight'],
  'local-revoke-lets-replies-land': ['reader revokes its own destination', 'writer revokes its own source'],
  'leaks-socket': ['no handle or timer leaks'],
  'leaks-timer': ['no handle or timer leaks'],
  'leaks-unref-timer': ['no handle or timer leaks'],
  'drops-queued-work-on-close': ['close() with transfers in flight'],
  'partial-success-on-peer-death': ['connection cut mid-transfer'],
  'exhausted-after-start': ['ResourceExhaustedError only when nothing of that batch started'],
  'wrong-error-for-dead-peer': ['connect() to a peer that is gone', 'peer death mid-transfer'],
};

/** TENSORWIRE_GALLERY_ONLY=bug,bug runs only those variants (for working on one). */
const ONLY = process.env['TENSORWIRE_GALLERY_ONLY']?.split(',').filter((x) => x !== '');

/** Variant processes at a time (the suite is I/O-heavy; two keep a 2-core machine busy). */
const PARALLEL = Math.max(1, Number(process.env['TENSORWIRE_GALLERY_PARALLEL'] ?? 2));

const here = dirname(fileURLToPath(import.meta.url));
const packageRoot = join(here, '..');
const vitestBin = join(dirname(createRequire(import.meta.url).resolve('vitest/package.json')), 'vitest.mjs');
const scratch = mkdtempSync(join(tmpdir(), 'tw-gallery-'));

interface Assertion {
  readonly fullName: string;
  readonly title: string;
  readonly status: string;
  readonly failureMessages: readonly string[];
}

interface VariantRun {
  readonly code: number | null;
  readonly failed: readonly Assertion[];
  readonly passed: number;
  readonly total: number;
  readonly output: string;
}

let slots = PARALLEL;
const queue: (() => void)[] = [];
async function slot<T>(f: () => Promise<T>): Promise<T> {
  if (slots === 0) await new Promise<void>((r) => queue.push(r));
  else slots--;
  try {
    return await f();
  } finally {
    const next = queue.shift();
    if (next) next();
    else slots++;
  }
}

function runVariant(bug: Bug): Promise<VariantRun> {
  const report = join(scratch, `${bug}.json`);
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [vitestBin, 'run', '--config', join(here, 'gallery', 'vitest.config.ts'), '--reporter=json', `--outputFile=${report}`], {
      cwd: packageRoot,
      env: { ...process.env, TENSORWIRE_GALLERY_BUG: bug, FORCE_COLOR: '0' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let output = '';
    child.stdout.on('data', (d: Buffer) => (output += d.toString()));
    child.stderr.on('data', (d: Buffer) => (output += d.toString()));
    child.on('error', reject);
    child.on('close', (code) => {
      let json: { testResults?: { assertionResults?: Assertion[] }[] };
      try {
        json = JSON.parse(readFileSync(report, 'utf8')) as typeof json;
      } catch (e) {
        reject(new Error(`variant ${bug}: no JSON report (exit ${code}): ${(e as Error).message}\n${output.slice(-4000)}`));
        return;
      }
      const all = (json.testResults ?? []).flatMap((f) => f.assertionResults ?? []);
      resolve({ code, failed: all.filter((t) => t.status === 'failed'), passed: all.filter((t) => t.status === 'passed').length, total: all.length, output });
    });
  });
}

const caught = new Map<Bug, readonly string[]>();

describe('gallery: the conformance suite rejects every broken variant of the reference transport', () => {
  afterAll(() => {
    rmSync(scratch, { recursive: true, force: true });
    if (caught.size === 0) return;
    const lines = [...caught].map(([bug, tests]) => `  ${bug} (${tests.length}): ${tests.join(' | ')}`);
    process.stdout.write(`[gallery] variant -> suite cases that failed on it\n${lines.join('\n')}\n`);
  });

  for (const bug of (Object.keys(BUGS) as Bug[]).filter((b) => ONLY === undefined || ONLY.includes(b))) {
    it.concurrent(`${bug} (${BUGS[bug]}) is caught by: ${WRITTEN_FOR[bug].join('; ')}`, { timeout: 600_000 }, async () => {
      const run = await slot(() => runVariant(bug));
      const names = run.failed.map((t) => t.title);
      caught.set(bug, names);
      expect(run.total, `variant ${bug} ran no suite case:\n${run.output.slice(-4000)}`).toBeGreaterThan(20);
      expect(names.length, `variant ${bug} survived the whole suite: a suite case is missing`).toBeGreaterThan(0);
      for (const want of WRITTEN_FOR[bug]) {
        expect(
          names.some((n) => n.includes(want)),
          `the case written for ${bug} ("${want}") did not fail on it; failed: ${names.join(' | ') || 'none'}`,
        ).toBe(true);
      }
    });
  }
});
