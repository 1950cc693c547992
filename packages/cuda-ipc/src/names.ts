/**
 * Shared-memory segment names. Every name is `/tw-<k>.<owner>.<rest>` where `<k>` says
 * the kind (`p` pool slot, `g` grant, `n` node presence, `t` grant table), `<owner>` and `<rest>` are
 * `[A-Za-z0-9_-]` (the alphabet of owner-namespaced ids), so `.` separates them without
 * ambiguity and the whole pool id maps to exactly one name and back.
 */
import { randomBytes } from 'node:crypto';
import { InvalidInputError, parseId, assertOwner } from '@tensorwire/core';

export const NAME_PREFIX = '/tw-';
export const MAX_NAME_LENGTH = 200;
const NAME_RE = /^\/tw-[A-Za-z0-9._-]+$/;
const POOL_NAME_RE = /^\/tw-p\.([A-Za-z0-9][A-Za-z0-9_-]{0,63})\.([A-Za-z0-9_-]{1,64})$/;

/** Why `name` is not an acceptable segment name, or undefined. Mirrors the native check. */
export function segmentNameProblem(name: unknown): string | undefined {
  if (typeof name !== 'string') return 'segment name must be a string';
  if (name.length < 6) return 'segment name is too short';
  if (Buffer.byteLength(name) > MAX_NAME_LENGTH) return `segment name is longer than ${MAX_NAME_LENGTH} bytes`;
  if (!name.startsWith(NAME_PREFIX)) return 'segment name must start with /tw-';
  if (name.indexOf('/', 1) !== -1) return "segment name may not contain '/' after the leading one";
  if (!NAME_RE.test(name)) return 'segment name contains a character outside [A-Za-z0-9._-]';
  if (name.includes('..')) return "segment name may not contain '..'";
  return undefined;
}

export function assertSegmentName(name: unknown): asserts name is string {
  const p = segmentNameProblem(name);
  if (p !== undefined) throw new InvalidInputError(p, { details: { field: 'name' } });
}

/** The segment name of a pool id (the whole id: owner and local part). */
export function poolSegmentName(poolId: string): string {
  const { owner, local } = parseId(poolId, 'pool');
  return `${NAME_PREFIX}p.${owner}.${local}`;
}

/** The pool id a pool segment name stands for, or undefined when it is not one. */
export function poolIdFromSegmentName(name: string): string | undefined {
  const m = POOL_NAME_RE.exec(name);
  return m ? `pool:${m[1]}:${m[2]}` : undefined;
}

/** A fresh unguessable segment name of kind `k` for `owner`. */
export function randomSegmentName(k: 'g' | 'n' | 't', owner: string): string {
  assertOwner(owner);
  return `${NAME_PREFIX}${k}.${owner}.${randomBytes(16).toString('hex')}`;
}
