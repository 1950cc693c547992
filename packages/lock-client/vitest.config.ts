import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    name: 'lock-client',
    include: ['test/**/*.test.ts'],
    pool: 'forks',
    // The dropped-guard test forces a collection to prove the finalizer releases.
    execArgv: ['--expose-gc'],
    // Child-process tests import the built package; build it once if it is stale.
    globalSetup: ['test/global-setup.ts'],
    testTimeout: 60_000,
    hookTimeout: 60_000,
  },
});
