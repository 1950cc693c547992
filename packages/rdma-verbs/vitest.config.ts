import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    name: 'rdma-verbs',
    include: ['test/**/*.test.ts'],
    pool: 'forks',
    testTimeout: 120_000,
    hookTimeout: 120_000,
  },
});
