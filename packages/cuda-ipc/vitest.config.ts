import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    name: 'cuda-ipc',
    include: ['test/**/*.test.ts'],
    pool: 'forks',
    testTimeout: 60_000,
    hookTimeout: 60_000,
  },
});
