/** Helpers shared by the conformance suite's files. */
import { expect } from 'vitest';
import { TensorwireError } from '../errors.js';

export function equal(a: Uint8Array, b: Uint8Array): boolean {
  return a.length === b.length && Buffer.compare(Buffer.from(a.buffer, a.byteOffset, a.byteLength), Buffer.from(b.buffer, b.byteOffset, b.byteLength)) === 0;
}

export function allZero(a: Uint8Array): boolean {
  for (let i = 0; i < a.length; i++) if (a[i] !== 0) return false;
  return true;
}

/**
 * Index of the first byte of `dst` that is neither 0 (never written) nor the byte of `allowed` at
 * that place, or -1. A destination that may hold a partial copy of `allowed`, and nothing else.
 */
export function foreignByte(dst: Uint8Array, allowed: Uint8Array): number {
  for (let i = 0; i < dst.length; i++) if (dst[i] !== 0 && dst[i] !== allowed[i]) return i;
  return -1;
}

export async function outcome(p: Promise<unknown>): Promise<unknown> {
  try {
    await p;
    return 'ok';
  } catch (e) {
    return e;
  }
}

export async function expectCode(p: Promise<unknown>, codes: readonly string[], what?: string): Promise<TensorwireError> {
  const caught = await outcome(p);
  const label = what === undefined ? '' : `${what}: `;
  expect(caught, `${label}expected a TensorwireError with code ${codes.join(' or ')}`).toBeInstanceOf(TensorwireError);
  expect(codes, `${label}${(caught as Error).message}`).toContain((caught as TensorwireError).code);
  return caught as TensorwireError;
}

/** Let callbacks, socket events and late bytes run: a few event-loop turns and a short pause. */
export async function settle(ms = 50): Promise<void> {
  for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
  await new Promise((r) => setTimeout(r, ms));
}

/**
 * Fails with `what` if `p` has not settled `ms` after now. A liveness bound (a call that never
 * settles is the defect), not a measurement: `ms` is far beyond any deadline involved.
 */
export async function settlesWithin<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const guard = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: still not settled ${ms} ms later`)), ms);
  });
  try {
    return await Promise.race([p, guard]);
  } finally {
    clearTimeout(timer);
  }
}

/** Poll `check` between event-loop turns until it holds; fails with `what` after `ms`. */
export async function until(check: () => boolean | Promise<boolean>, ms: number, what: string): Promise<void> {
  const end = Date.now() + ms;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`${what}: not seen within ${ms} ms`);
    await new Promise((r) => setImmediate(r));
  }
}
