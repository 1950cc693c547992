/**
 * Vitest configs for mutation runs only (the packages' own vitest.config.ts stay the suite).
 * Stryker starts its test runner in the package's sandbox copy, so `root` is the cwd. Tests
 * that run real child processes import the built dist/ (which a mutant never changes) and are
 * slow, so they are left out here; they still run in the normal suite.
 */
import { URL, fileURLToPath } from 'node:url';
import { defineConfig } from 'vitest/config';

const exposeGc = fileURLToPath(new URL('./expose-gc.mjs', import.meta.url));

export function mutationVitest(name, { include = ['test/**/*.test.ts'], exclude = [], gc = false } = {}) {
  return defineConfig({
    test: {
      name: `${name}-mutation`,
      root: process.cwd(),
      include,
      exclude: ['**/node_modules/**', ...exclude],
      // (Stryker's vitest runner runs the tests in threads whatever is set here.)
      pool: 'forks',
      ...(gc ? { setupFiles: [exposeGc] } : {}),
      testTimeout: 60_000,
      hookTimeout: 60_000,
    },
  });
}
