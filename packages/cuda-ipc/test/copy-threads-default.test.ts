/**
 * The default of `copyThreads`: half the cores this process may use (the peer of a same-host
 * transport runs on the same host), at least 2 where it may use 2 or more, at most 4. `os.availableParallelism()` is stubbed so that the
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
    [2, 2],
    [3, 2],
    [4, 2],
    [5, 2],
    [6, 3],
    [8, 4],
    [9, 4],
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
