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

/**
 * What is wrong with a list of block ids, checked in order, each id for its form, then for
 * `also` (a caller's own rule, when given), then for repeating an earlier one; undefined when
 * nothing is. The requester and the holder check an acquire's ids with it.
 */
export function blockIdsProblem(ids: readonly string[], also?: (id: string) => string | undefined): string | undefined {
  const n = ids.length;
  const seen = n <= PAIRWISE_MAX ? undefined : new Set<string>();
  for (let i = 0; i < n; i++) {
    const id = ids[i] as string;
    const problem = blockIdProblem(id);
    if (problem !== undefined) return `block id: ${problem}`;
    const other = also?.(id);
    if (other !== undefined) return other;
    if (seen === undefined ? occursBefore(ids, i) : seen.has(id)) return `block id ${JSON.stringify(id)} appears twice`;
    seen?.add(id);
  }
  return undefined;
}

/** Whether `ids[i]` also occurs before index `i` (pairwise; for short lists). */
export function occursBefore(ids: readonly string[], i: number): boolean {
  const id = ids[i];
  for (let j = 0; j < i; j++) if (ids[j] === id) return true;
  return false;
}

/**
 * Blocks named by number: block `n` is `block:<owner>:<n>` (`n` in decimal), a block of the
 * holder's numbered block space `owner` (for example a KV arena whose blocks are the indices
 * of its grid). A lease over numbered blocks travels as the owner once and the numbers packed,
 * and costs no string per block on either side.
 */
export interface NumberedBlocks {
  /** The owner part of the ids, an owner name (`[A-Za-z0-9][A-Za-z0-9_-]{0,63}`). */
  readonly owner: string;
  /** The block numbers, in lease order (block `i` of the lease is `numbers[i]`); no repeats. */
  readonly numbers: Uint32Array;
}

/** The ids of numbered blocks, as strings (`block:<owner>:<n>`), in order. */
export function numberedBlockIds(blocks: NumberedBlocks): readonly string[] {
  const { owner, numbers } = blocks;
  const ids = new Array<string>(numbers.length);
  for (let i = 0; i < numbers.length; i++) ids[i] = `block:${owner}:${numbers[i] as number}`;
  return Object.freeze(ids);
}
