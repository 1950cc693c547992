import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vitest/config';

// Runs one gallery variant (gallery.test.ts starts one process per variant with this config).
export default defineConfig({
  root: fileURLToPath(new URL('../..', import.meta.url)),
  test: {
    name: 'gallery-variant',
    include: ['test/gallery/variant.suite.ts'],
    pool: 'forks',
    testTimeout: 20_000,
    hookTimeout: 20_000,
  },
});
