import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    name: 'discovery-etcd',
    include: ['test/**/*.test.ts'],
    pool: 'forks',
    // Real etcd processes and namespaces on small machines: one file at a time.
    fileParallelism: false,
    // The cross-host tests run child processes on the built packages; build them if stale.
    globalSetup: ['test/global-setup.ts'],
    testTimeout: 120_000,
    hookTimeout: 60_000,
  },
});
