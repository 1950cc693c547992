/**
 * Shared StrykerJS options for the per-package configs in this folder. Each package's run has
 * cwd = packages/<pkg> (scripts/mutate/run.mjs sets it), so paths here are relative to the
 * package. Reports go under the git-ignored `coverage/` folder (the sandbox is `.stryker-tmp/` of the package, removed after the run):
 * the incremental file and the reports
 * (<repo>/coverage/mutation/<pkg>/).
 */
import { URL, fileURLToPath } from 'node:url';

export function strykerConfig(pkg, mutate, extra = {}) {
  const vitestConfig = fileURLToPath(new URL(`../vitest/${pkg}.config.mjs`, import.meta.url));
  // TW_MUTATE_TAG=<name>: a separate report, incremental file (coverage/mutation/<pkg>-<name>/)
  // and sandbox folder (.stryker-tmp-<name>/) for a part of a package's run, so parts do not
  // overwrite each other's results and two parts of one package can run at once.
  const tag = process.env.TW_MUTATE_TAG ? `-${process.env.TW_MUTATE_TAG.replace(/[^\w.-]/g, '_')}` : '';
  const out = `../../coverage/mutation/${pkg}${tag}`;
  return {
    $schema: '../../node_modules/@stryker-mutator/core/schema/stryker-schema.json',
    packageManager: 'npm',
    testRunner: 'vitest',
    plugins: ['@stryker-mutator/vitest-runner', '@stryker-mutator/typescript-checker'],
    vitest: { configFile: vitestConfig, related: false },
    // The fast (CI) subset skips the type checker (about 1 s a mutant here): mutants that do not
    // type-check then run as tests, and are killed or listed in known-survivors.json.
    checkers: process.env.TW_MUTATE_FAST ? [] : ['typescript'],
    tsconfigFile: 'tsconfig.json',
    typescriptChecker: { prioritizePerformanceOverAccuracy: true },
    coverageAnalysis: 'perTest',
    mutate,
    // Incremental: only mutants whose code or covering tests changed are run again.
    incremental: true,
    incrementalFile: `${out}/stryker-incremental.json`,
    reporters: ['html', 'json', 'clear-text', 'progress'],
    htmlReporter: { fileName: `${out}/index.html` },
    jsonReporter: { fileName: `${out}/mutation.json` },
    clearTextReporter: { allowColor: false, logTests: false, reportScoreTable: true },
    // One level below the package: Stryker rewrites the tsconfig 'extends' for exactly that depth.
    tempDirName: `.stryker-tmp${tag}`,
    cleanTempDir: true,
    // A 2-core machine shared by several engineers: one test runner and one checker.
    concurrency: 1,
    // A mutant that makes a test loop is a timeout (detected); keep what that costs small in the fast run.
    timeoutMS: process.env.TW_MUTATE_FAST ? 5_000 : 20_000,
    timeoutFactor: 2,
    ignorePatterns: ['coverage', '.turbo', '*.tsbuildinfo', '.stryker-tmp*'],
    // Static mutants (module-level constants) would each rerun every test of the package:
    // hours here. They are left out of the run (counted as ignored, not as killed).
    ignoreStatic: true,
    thresholds: { high: 90, low: 75, break: null },
    ...extra,
  };
}
