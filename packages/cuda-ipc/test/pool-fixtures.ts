/**
 * In-process fixtures shared by the pool tests: pools closed after the file's tests, and fakes
 * of addon calls (the CUDA ones, for the deferred-free paths without a GPU) restored after each test.
 */
import { afterAll, afterEach, expect } from 'vitest';
import { TensorwireError, type Logger } from '@tensorwire/core';
import { TensorPool, native } from '../src/index.js';
import { uniqueOwner } from './helpers.js';

export interface PoolOptions {
  deferredFreeTimeoutMs?: number;
  logger?: Logger;
}

/**
 * A pool factory for this test file; every pool it made is closed after the file's tests.
 * `owner` turns the name into the pool's owner (default: a unique owner with that prefix).
 */
export function trackedPools(owner: (name: string) => string = uniqueOwner): TrackedPools {
  const pools: TensorPool[] = [];
  afterAll(async () => {
    await Promise.all(pools.map((p) => p.close()));
  });
  const make = (name: string, opts: PoolOptions = {}): TensorPool => {
    const p = new TensorPool({ owner: owner(name), ...opts });
    pools.push(p);
    return p;
  };
  return Object.assign(make, {
    track: (p: TensorPool): TensorPool => {
      pools.push(p);
      return p;
    },
  });
}

/** Makes a pool closed after the file's tests; `track` adds one made another way. */
export interface TrackedPools {
  (name: string, opts?: PoolOptions): TensorPool;
  track(p: TensorPool): TensorPool;
}

type Native = typeof native;

/** `fake(key, fn)` replaces one addon call until the end of the current test. */
export function nativeFakes(): <K extends keyof Native>(key: K, fn: Native[K]) => void {
  const saved = new Map<keyof Native, unknown>();
  afterEach(() => {
    for (const [k, v] of saved) (native as unknown as Record<string, unknown>)[k] = v;
    saved.clear();
  });
  return (key, fn) => {
    if (!saved.has(key)) saved.set(key, native[key]);
    (native as unknown as Record<string, unknown>)[key] = fn;
  };
}

/** The typed error `p` (a promise, or a function called and awaited) rejects with; fails the test if it does not. */
export async function failure(p: Promise<unknown> | (() => unknown)): Promise<TensorwireError> {
  try {
    await (typeof p === 'function' ? p() : p);
  } catch (e) {
    expect(e).toBeInstanceOf(TensorwireError);
    return e as TensorwireError;
  }
  throw new Error('expected a failure');
}

/** 'settled' or 'pending' after `ms` (a liveness guard far above what the test waits for). */
export async function within(p: Promise<unknown>, ms: number): Promise<unknown> {
  let timer: NodeJS.Timeout | undefined;
  const guard = new Promise((r) => (timer = setTimeout(() => r('pending'), ms)));
  return Promise.race([p.then(() => 'settled'), guard]).finally(() => clearTimeout(timer));
}
