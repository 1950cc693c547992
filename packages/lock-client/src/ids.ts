/**
 * Hot-path forms of the `@tensorwire/core` id checks. A well-formed id passes one
 * precompiled pattern; anything else falls back to `idProblem` for its exact message, so
 * what is accepted and what is said about a refusal are the core's (a test checks the
 * two agree).
 */
import { idProblem } from '@tensorwire/core';

// <kind>:<owner>:<local>; owner and local exclude ':', so there are exactly three parts,
// and the longest match (7 + 1 + 64 + 1 + 64) is within the core's length limit.
const BLOCK_ID_RE = /^block:[A-Za-z0-9][A-Za-z0-9_-]{0,63}:[A-Za-z0-9_-]{1,64}$/;
const SESSION_ID_RE = /^session:[A-Za-z0-9][A-Za-z0-9_-]{0,63}:[A-Za-z0-9_-]{1,64}$/;

/** `idProblem(value, 'block')`, fast for valid ids. */
export function blockIdProblem(value: unknown): string | undefined {
  return typeof value === 'string' && BLOCK_ID_RE.test(value) ? undefined : idProblem(value, 'block');
}

/** `idProblem(value, 'session')`, fast for valid ids. */
export function sessionIdProblem(value: unknown): string | undefined {
  return typeof value === 'string' && SESSION_ID_RE.test(value) ? undefined : idProblem(value, 'session');
}

/** Lists at most this long are checked for duplicates pairwise (no allocation). */
export const PAIRWISE_MAX = 16;

/** Whether `ids[i]` also occurs before index `i` (pairwise; for short lists). */
export function occursBefore(ids: readonly string[], i: number): boolean {
  const id = ids[i];
  for (let j = 0; j < i; j++) if (ids[j] === id) return true;
  return false;
}
