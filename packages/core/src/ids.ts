/**
 * Owner-namespaced ids.
 *
 * Format: `<kind>:<owner>:<local>`, for example `pool:cam_left:42`.
 *
 * - `kind` is one of {@link ID_KINDS}.
 * - `owner` names the process or node that created the object: 1–64 characters of
 *   `[A-Za-z0-9_-]`, starting with a letter or digit. `_` and `-` are allowed; `:` is not,
 *   so the owner is always exactly the text between the first and second `:` and `cam`
 *   can never be confused with `cam_left`.
 * - `local` is unique within the owner: 1–64 characters of `[A-Za-z0-9_-]`.
 *
 * Tables are keyed by the whole id string ({@link IdRegistry}); nothing is keyed by the
 * bare local part, which is only unique inside one owner.
 */
import { InvalidInputError } from './errors.js';

export const ID_KINDS = ['pool', 'block', 'session', 'node', 'conn'] as const;
export type IdKind = (typeof ID_KINDS)[number];

export const MAX_OWNER_LENGTH = 64;
export const MAX_LOCAL_LENGTH = 64;
const OWNER_RE = /^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/;
const LOCAL_RE = /^[A-Za-z0-9_-]{1,64}$/;
const KINDS: ReadonlySet<string> = new Set(ID_KINDS);

/** A parsed id. `id` is the canonical string form and the only thing tables are keyed by. */
export interface ParsedId<K extends IdKind = IdKind> {
  readonly kind: K;
  readonly owner: string;
  readonly local: string;
  readonly id: string;
}

/** Why a value is not a valid owner, or undefined when it is. */
export function ownerProblem(owner: unknown): string | undefined {
  if (typeof owner !== 'string') return `owner must be a string, got ${typeof owner}`;
  if (owner.length === 0) return 'owner is empty';
  if (owner.length > MAX_OWNER_LENGTH) return `owner is longer than ${MAX_OWNER_LENGTH} characters`;
  if (!OWNER_RE.test(owner)) {
    return `owner ${JSON.stringify(owner)} may contain only letters, digits, '_' and '-', and must start with a letter or digit`;
  }
  return undefined;
}

export function isValidOwner(owner: unknown): owner is string {
  return ownerProblem(owner) === undefined;
}

/** Throws InvalidInputError naming the problem. */
export function assertOwner(owner: unknown): asserts owner is string {
  const problem = ownerProblem(owner);
  if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'owner' } });
}

/**
 * True for a token: 1-64 characters of `[A-Za-z0-9_-]` — the form of an id's local part, an
 * incarnation, a host id, an acquire nonce. One definition for every decoder that checks one.
 */
export function isToken(value: unknown): value is string {
  return typeof value === 'string' && LOCAL_RE.test(value);
}

function localProblem(local: unknown): string | undefined {
  if (typeof local !== 'string') return `local id must be a string, got ${typeof local}`;
  if (!LOCAL_RE.test(local)) {
    return `local id ${JSON.stringify(local.slice(0, 80))} must be 1-${MAX_LOCAL_LENGTH} characters of letters, digits, '_' and '-'`;
  }
  return undefined;
}

/** Build a canonical id. Throws InvalidInputError for a bad kind, owner or local part. */
export function formatId<K extends IdKind>(kind: K, owner: string, local: string | number | bigint): string {
  if (!KINDS.has(kind)) throw new InvalidInputError(`unknown id kind ${JSON.stringify(kind)}`, { details: { field: 'kind' } });
  assertOwner(owner);
  const localText = typeof local === 'string' ? local : local.toString();
  const problem = localProblem(localText);
  if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'local' } });
  return `${kind}:${owner}:${localText}`;
}

/** Why a string is not a valid id (of the expected kind, when given), or undefined. */
export function idProblem(value: unknown, expectedKind?: IdKind): string | undefined {
  if (typeof value !== 'string') return `id must be a string, got ${typeof value}`;
  if (value.length > 16 + MAX_OWNER_LENGTH + MAX_LOCAL_LENGTH) return 'id is too long';
  const parts = value.split(':');
  if (parts.length !== 3) return `id ${JSON.stringify(value)} must have the form <kind>:<owner>:<local>`;
  const [kind, owner, local] = parts as [string, string, string];
  if (!KINDS.has(kind)) return `id ${JSON.stringify(value)} has unknown kind ${JSON.stringify(kind)}`;
  if (expectedKind !== undefined && kind !== expectedKind) {
    return `id ${JSON.stringify(value)} is a ${kind} id, expected a ${expectedKind} id`;
  }
  return ownerProblem(owner) ?? localProblem(local);
}

export function isValidId(value: unknown, expectedKind?: IdKind): value is string {
  return idProblem(value, expectedKind) === undefined;
}

/** Parse an id; throws InvalidInputError naming what was wrong. */
export function parseId<K extends IdKind>(value: unknown, expectedKind?: K): ParsedId<K> {
  const problem = idProblem(value, expectedKind);
  if (problem !== undefined) throw new InvalidInputError(problem, { details: { field: 'id' } });
  const [kind, owner, local] = (value as string).split(':') as [K, string, string];
  return { kind, owner, local, id: value as string };
}

/** True when `id` belongs to `owner` (exact comparison of the owner field, never a prefix match). */
export function isOwnedBy(id: string, owner: string): boolean {
  const problem = idProblem(id);
  if (problem !== undefined) return false;
  return id.split(':')[1] === owner;
}

/** Hands out ids for one owner: `pool:<owner>:1`, `pool:<owner>:2`, … per kind. */
export class IdAllocator {
  readonly owner: string;
  readonly #counters = new Map<IdKind, bigint>();
  constructor(owner: string) {
    assertOwner(owner);
    this.owner = owner;
  }
  next(kind: IdKind): string {
    const n = (this.#counters.get(kind) ?? 0n) + 1n;
    this.#counters.set(kind, n);
    return formatId(kind, this.owner, n);
  }
}

/**
 * A map keyed by whole ids. It refuses malformed ids, so nothing can be keyed by a bare
 * counter, and offers owner-scoped views for "free everything of owner X" paths.
 */
export class IdRegistry<V, K extends IdKind = IdKind> implements Iterable<[string, V]> {
  readonly kind: K | undefined;
  readonly #map = new Map<string, V>();
  constructor(kind?: K) {
    this.kind = kind;
  }
  get size(): number {
    return this.#map.size;
  }
  #key(id: string): string {
    return parseId(id, this.kind).id;
  }
  has(id: string): boolean {
    return isValidId(id, this.kind) && this.#map.has(id);
  }
  get(id: string): V | undefined {
    // set() stores only valid ids, so a malformed id simply misses: no need to parse it here.
    return this.#map.get(id);
  }
  set(id: string, value: V): this {
    this.#map.set(this.#key(id), value);
    return this;
  }
  delete(id: string): boolean {
    return isValidId(id, this.kind) && this.#map.delete(id);
  }
  /** Entries whose owner is exactly `owner`. */
  *ownedBy(owner: string): IterableIterator<[string, V]> {
    for (const entry of this.#map) if (isOwnedBy(entry[0], owner)) yield entry;
  }
  keys(): IterableIterator<string> {
    return this.#map.keys();
  }
  values(): IterableIterator<V> {
    return this.#map.values();
  }
  clear(): void {
    this.#map.clear();
  }
  [Symbol.iterator](): IterableIterator<[string, V]> {
    return this.#map[Symbol.iterator]();
  }
}
