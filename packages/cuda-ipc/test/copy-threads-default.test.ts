/**
 * The default of `copyThreads`: half the cores this process may use (the peer of a same-host
 * transport runs on the same host), 1 to 4. `os.availableParallelism()` is stubbed so that the
 * rule is checked for hosts other than the one running the test.
 */
import type * as OsModule from 'node:os';
import { afterEach, describe, expect, it, vi } from 'vitest';

const cores = vi.hoisted(() => ({ n: 2 }));
vi.mock('node:os', async (importOriginal) => {
  const os = await importOriginal<typeof OsModule>();
  return { ...os, default: { ...os, availableParallelism: () => cores.n }, availableParallelism: () => cores.n };
});

const { CudaIpcTransport } = await import('../src/index.js');

afterEach(() => {
  cores.n = 2;
});

describe('cuda-ipc copyThreads default', () => {
  it.each([
    [1, 1],
    [2, 1],
    [3, 1],
    [4, 2],
    [5, 2],
    [8, 4],
    [64, 4],
  ])('%i cores: %i copy thread(s)', (n, expected) => {
    cores.n = n;
    expect(new CudaIpcTransport().copyThreads).toBe(expected);
  });

  it('an explicit copyThreads wins over the default', () => {
    cores.n = 64;
    expect(new CudaIpcTransport({ copyThreads: 1 }).copyThreads).toBe(1);
    cores.n = 1;
    expect(new CudaIpcTransport({ copyThreads: 6 }).copyThreads).toBe(6);
  });
});
