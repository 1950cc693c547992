import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    name: 'bench',
    include: ['test/**/*.test.ts'],
    pool: 'forks',
    testTimeout: 180_000,
    hookTimeout: 60_000,
  },
});
