/**
 * Tests written to kill surviving Stryker mutants of the rest of src/ids.ts (owner and local
 * checks, formatId, parseId, IdAllocator) and of src/kit/grants.ts outside GrantTable.check
 * (register, grant, revoke, revokeGrant, #quiesce, decodeRemote, close, per-user counts); see
 * the package README, "Mutation testing". They assert the typed errors (class, message,
 * details.field) callers and peers see, that decoded tokens are copies,
 * and how many times a revocation aborts a user that holds the memory.
 */
import { describe, expect, it } from 'vitest';
import { ClosedError, InvalidInputError, TensorwireError } from '../src/errors.js';
import { IdAllocator, assertOwner, formatId, idProblem, isValidOwner, ownerProblem, parseId } from '../src/ids.js';
import { GrantTable, type GrantEntry, type GrantUser } from '../src/kit/grants.js';
import { GRANT_STRIDE, type GrantRanges } from '../src/transport.js';

function thrown(fn: () => unknown): TensorwireError {
  try {
    fn();
  } catch (e) {
    expect(e).toBeInstanceOf(TensorwireError);
    return e as TensorwireError;
  }
  throw new Error('expected a throw');
}

describe('ids: owners, local parts, formatId, parseId, IdAllocator', () => {
  it('owner checks: type, length at the boundary, characters; assertOwner names the field', () => {
    expect(ownerProblem(7)).toBe('owner must be a string, got number');
    expect(isValidOwner('a'.repeat(64))).toBe(true);
    expect(isValidOwner('a'.repeat(65))).toBe(false);
    expect(ownerProblem('a'.repeat(65))).toBe('owner is longer than 64 characters');
    expect(isValidOwner('cam_left')).toBe(true);
    expect(isValidOwner('-cam')).toBe(false);
    const e = thrown(() => assertOwner('no:colons'));
    expect(e).toBeInstanceOf(InvalidInputError);
    expect(e.details).toEqual({ field: 'owner' });
  });

  it('formatId refuses a bad kind, owner or local part, naming the field; the message quotes at most 80 characters', () => {
    const kind = thrown(() => formatId('bogus' as 'pool', 'cam', 1));
    expect(kind.message).toBe('unknown id kind "bogus"');
    expect(kind.details).toEqual({ field: 'kind' });
    const owner = thrown(() => formatId('pool', 'no:colons', 1));
    expect(owner).toBeInstanceOf(InvalidInputError);
    expect(owner.details).toEqual({ field: 'owner' });
    const local = thrown(() => formatId('pool', 'cam', `${'x'.repeat(200)}/`));
    expect(local.details).toEqual({ field: 'local' });
    expect(local.message).toBe(`local id ${JSON.stringify('x'.repeat(80))} must be 1-64 characters of letters, digits, '_' and '-'`);
    expect(formatId('block', 'cam', 12n)).toBe('block:cam:12');
    expect(formatId('block', 'cam', 'k_1')).toBe('block:cam:k_1');
  });

  it('idProblem stops at once on a very long string; parseId names the field', () => {
    expect(idProblem('x'.repeat(1000))).toBe('id is too long');
    expect(idProblem(`pool:${'a'.repeat(64)}:${'b'.repeat(64)}`)).toBeUndefined();
    const e = thrown(() => parseId('pool:cam'));
    expect(e).toBeInstanceOf(InvalidInputError);
    expect(e.details).toEqual({ field: 'id' });
  });

  it('IdAllocator refuses a bad owner', () => {
    expect(() => new IdAllocator('no:colons')).toThrow(InvalidInputError);
    expect(new IdAllocator('cam').next('pool')).toBe('pool:cam:1');
  });
});

function grantTable(revokeGraceMs = 10_000): GrantTable {
  return new GrantTable({ transport: 'test', revokeGraceMs });
}
function spec(handles: object[], list: [number, number, number][], count = list.length): GrantRanges {
  const r = new Float64Array(list.length * GRANT_STRIDE);
  list.forEach((x, k) => r.set(x, k * GRANT_STRIDE));
  return { handles, count, ranges: r, bytes: list.reduce((s, x) => s + x[2], 0) };
}
function user(): GrantUser & { aborted: number } {
  const u = {
    aborted: 0,
    abortForRevoke(): void {
      u.aborted++;
    },
  };
  return u;
}

describe('GrantTable: register, grant and revoke refuse what is not theirs, with typed errors', () => {
  it('register: host memory only (also for a missing memory); the payload is a copy of the token', () => {
    const t = grantTable();
    const e = thrown(() => t.register({ kind: 'cuda', device: 0, pointer: 1n, byteLength: 8 } as never));
    expect(e).toBeInstanceOf(InvalidInputError);
    expect(e.message).toBe('test moves host memory only, not cuda');
    expect(e.details).toEqual({ field: 'memory.kind' });
    expect(thrown(() => t.register(undefined as never)).message).toBe('test moves host memory only, not undefined');
    const { handle, payload } = t.register({ kind: 'host', buffer: new Uint8Array(8) });
    // The table finds an entry by the key it computed when it made the token: a caller that
    // scribbles over the payload it was handed changes nothing the table checks.
    const sent = Buffer.from(payload);
    payload.fill(0);
    expect(t.lookup(sent, 0)).toBe(handle);
  });

  it('grant: malformed range tables and handles are refused naming the field; the payload is a copy', () => {
    const t = grantTable();
    const { handle: reg } = t.register({ kind: 'host', buffer: new Uint8Array(64) });
    const bad = (s: GrantRanges, field: string, message: string): void => {
      const e = thrown(() => t.grant(s));
      expect(e).toBeInstanceOf(InvalidInputError);
      expect(e.details).toMatchObject({ field });
      expect(e.message).toBe(message);
    };
    const rangesMsg = `a test grant needs 1 to ${2 ** 32} ranges of ${GRANT_STRIDE} numbers each`;
    bad(spec([reg], [[0, 0, 8]], 0), 'ranges', rangesMsg);
    bad(spec([reg], [[0, 0, 8]], 1.5), 'ranges', rangesMsg);
    bad(spec([reg], [[0, 0, 8]], 2), 'ranges', rangesMsg); // 2 ranges, 3 numbers
    bad({ ...spec([reg], [[0, 0, 8]]), ranges: [0, 0, 8] as unknown as Float64Array }, 'ranges', rangesMsg);
    bad(spec([], [[0, 0, 8]]), 'handles', 'a test grant needs registration handles');
    bad({ ...spec([reg], [[0, 0, 8]]), handles: reg as unknown as object[] }, 'handles', 'a test grant needs registration handles');
    const other = grantTable().register({ kind: 'host', buffer: new Uint8Array(64) }).handle;
    const e = thrown(() => t.grant(spec([reg, other], [[1, 0, 8]])));
    expect(e.message).toBe('handles[1] is not a live test registration of this transport');
    expect(e.details).toEqual({ field: 'handles', registration: 1 });
    const { handle: g, payload } = t.grant(spec([reg], [[0, 0, 8]]));
    const sent = Buffer.from(payload);
    payload.fill(0);
    expect(t.lookup(sent, 0)).toBe(g);
    expect(t.grantsOver(reg)).toBe(1);
    expect(grantTable().grantsOver(reg)).toBe(0); // a handle of another table
  });

  it('after close(): register and grant are ClosedError; registrations are no longer live', () => {
    const t = grantTable();
    const { handle: reg } = t.register({ kind: 'host', buffer: new Uint8Array(64) });
    t.close();
    expect(t.isLive(reg)).toBe(false);
    const e1 = thrown(() => t.register({ kind: 'host', buffer: new Uint8Array(8) }));
    expect(e1).toBeInstanceOf(ClosedError);
    expect(e1.message).toBe('test transport is closed');
    const e2 = thrown(() => t.grant(spec([reg], [[0, 0, 8]])));
    expect(e2).toBeInstanceOf(ClosedError);
    expect(e2.message).toBe('test transport is closed');
  });

  it('revoke / revokeGrant refuse a handle of the other kind, naming the transport', async () => {
    const t = grantTable();
    const { handle: reg } = t.register({ kind: 'host', buffer: new Uint8Array(64) });
    const { handle: g } = t.grant(spec([reg], [[0, 0, 8]]));
    await expect(t.revoke(g)).rejects.toThrow(new InvalidInputError('not a test registration handle of this transport'));
    await expect(t.revokeGrant(reg)).rejects.toThrow(new InvalidInputError('not a test range grant handle of this transport'));
  });
});

describe('GrantTable: per-user counts and revocation', () => {
  it('a user that acquired twice holds the entry until it released twice; a third release changes nothing', async () => {
    const t = grantTable();
    const { handle } = t.register({ kind: 'host', buffer: new Uint8Array(8) });
    const e = t.lookup(Buffer.from((handle as { token: Uint8Array }).token), 0) as GrantEntry;
    const u = user();
    e.acquire(u);
    e.acquire(u);
    e.release(u);
    expect(e.users).toBe(1);
    expect(e.holders).toEqual([u]);
    e.release(u);
    expect(e.users).toBe(0);
    expect(e.holders).toEqual([]);
    e.release(u);
    expect(e.users).toBe(0);
    await e.idle();
  });

  it('revoking a grant twice while a user holds it aborts that user once, after the grace', async () => {
    const t = grantTable(20);
    const { handle: reg } = t.register({ kind: 'host', buffer: new Uint8Array(64) });
    const { handle: g } = t.grant(spec([reg], [[0, 0, 8]]));
    const entry = g as GrantEntry;
    const u = user();
    entry.acquire(u);
    const first = t.revokeGrant(g);
    const second = t.revokeGrant(g);
    await new Promise((r) => setTimeout(r, 80));
    expect(u.aborted).toBe(1);
    entry.release(u);
    await Promise.all([first, second]);
    expect(u.aborted).toBe(1);
  });
});

describe('GrantTable.decodeRemote', () => {
  it('refuses other memory kinds, payloads of the wrong size and bad byte lengths, naming the field', () => {
    const t = grantTable();
    const token = new Uint8Array(16).fill(3);
    const field = (fn: () => unknown, f: string, message: string): void => {
      const e = thrown(fn);
      expect(e).toBeInstanceOf(InvalidInputError);
      expect(e.details).toEqual({ field: f });
      expect(e.message).toBe(message);
    };
    field(() => t.decodeRemote(token, 'cuda', 8), 'memoryKind', 'test cannot reach cuda memory');
    field(() => t.decodeRemote(new Uint8Array(5), 'host', 8), 'payload', 'test descriptor payload must be 16 bytes, got 5');
    field(() => t.decodeRemote(undefined as never, 'host', 8), 'payload', 'test descriptor payload must be 16 bytes, got undefined');
    field(() => t.decodeRemote(token, 'host', -1), 'byteLength', 'byte length -1 is not a safe integer');
    field(() => t.decodeRemote(token, 'host', 8, new Float64Array(0)), 'rangeLengths', `range lengths must be a Float64Array of 1 to ${2 ** 32} lengths`);
    expect(t.decodeRemote(token, 'host', 0).byteLength).toBe(0);
  });

  it('keeps a copy of the token, and marks a range grant as granted', () => {
    const t = grantTable();
    const token = new Uint8Array(16).fill(3);
    const whole = t.decodeRemote(token, 'host', 8);
    const ranged = t.decodeRemote(token, 'host', 8, Float64Array.of(4, 4));
    token.fill(9);
    expect([...whole.token]).toEqual(new Array(16).fill(3));
    expect([...ranged.token]).toEqual(new Array(16).fill(3));
    expect(whole.granted).toBe(false);
    expect(ranged.granted).toBe(true);
    expect([...ranged.rangeLengths]).toEqual([4, 4]);
  });

  it('copies a Buffer payload too (Buffer#slice would be a view), and hands out tokens that are copies', () => {
    const t = grantTable();
    const token = Buffer.alloc(16, 3);
    const remote = t.decodeRemote(token, 'host', 8);
    token.fill(9);
    expect([...remote.token]).toEqual(new Array(16).fill(3));
    const { handle, payload } = t.register({ kind: 'host', buffer: new Uint8Array(64) });
    const entry = handle as GrantEntry;
    const before = [...entry.token];
    expect([...payload]).toEqual(before);
    payload.fill(0);
    expect([...entry.token]).toEqual(before);
  });
});
