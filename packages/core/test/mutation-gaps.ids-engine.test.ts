/**
 * Tests written to kill surviving Stryker mutants of the owner guard (src/ids.ts: isOwnedBy,
 * IdRegistry) and of the engine's remote-descriptor check (TransferEngine #remoteFor): a
 * malformed id is owned by nobody; the registry's has/delete/keys/values/clear/ownedBy; a
 * descriptor of an earlier incarnation, one without the chosen transport's payload, and an
 * undecodable payload are refused as invalid input naming the request.
 */
import { describe, expect, it } from 'vitest';
import { IdRegistry, InvalidInputError, TransferEngine, decodeDescriptor, encodeDescriptor, formatId, isOwnedBy, silentLogger } from '../src/index.js';
import { TcpTransport } from '../src/tcp/transport.js';

describe('isOwnedBy: exact owner of a well-formed id only', () => {
  it('a malformed id belongs to no owner, even when its second field is the owner', () => {
    expect(isOwnedBy('pool:cam:1', 'cam')).toBe(true);
    for (const bad of ['pool:cam', 'bogus:cam:1', 'pool:cam:1:2', 'pool:cam:', ':cam:1', 'pool:cam:a/b', 'pool:-cam:1']) {
      expect(isOwnedBy(bad, bad.split(':')[1] as string), bad).toBe(false);
    }
    expect(isOwnedBy('pool:cam_left:1', 'cam')).toBe(false);
  });
});

describe('IdRegistry: keyed by the whole id, of its kind', () => {
  it('has / get / delete / keys / values / size / clear / ownedBy', () => {
    const r = new IdRegistry<number, 'pool'>('pool');
    const a1 = formatId('pool', 'A', 1);
    const c1 = formatId('pool', 'C', 1);
    r.set(a1, 10).set(c1, 30);
    expect(r.size).toBe(2);
    expect(r.has(a1)).toBe(true);
    expect(r.has(formatId('pool', 'A', 2))).toBe(false);
    expect(r.has('1')).toBe(false); // a bare counter is never a key
    expect(r.has('block:A:1')).toBe(false); // another kind
    expect(r.get('1')).toBeUndefined();
    expect([...r.keys()]).toEqual([a1, c1]);
    expect([...r.values()]).toEqual([10, 30]);
    expect([...r]).toEqual([
      [a1, 10],
      [c1, 30],
    ]);
    expect([...r.ownedBy('A')]).toEqual([[a1, 10]]);
    expect([...r.ownedBy('C')]).toEqual([[c1, 30]]);
    expect([...r.ownedBy('')]).toEqual([]);
    expect(r.delete('1')).toBe(false);
    expect(r.delete('block:A:1')).toBe(false);
    expect(r.size).toBe(2);
    expect(r.delete(a1)).toBe(true);
    expect(r.delete(a1)).toBe(false);
    expect([...r.keys()]).toEqual([c1]);
    expect(() => r.set('1', 1)).toThrow(InvalidInputError);
    expect(() => r.set('block:A:1', 1)).toThrow(InvalidInputError);
    r.clear();
    expect(r.size).toBe(0);
    expect(r.has(c1)).toBe(false);
  });
});

describe('engine: remote descriptors are checked before anything is sent', () => {
  const make = (nodeId: string, incarnation?: string) =>
    new TransferEngine({ nodeId, transports: [new TcpTransport()], logger: silentLogger, metrics: false, ...(incarnation ? { incarnation } : {}) });

  async function refusal(p: Promise<unknown>): Promise<InvalidInputError> {
    try {
      await p;
    } catch (e) {
      expect(e).toBeInstanceOf(InvalidInputError);
      return e as InvalidInputError;
    }
    throw new Error('expected InvalidInputError');
  }

  it('an earlier incarnation, a missing transport payload and an undecodable payload are refused, naming the request', async () => {
    const a = make('gapa');
    const old = make('gapb', 'first');
    const now = make('gapb', 'second');
    try {
      await Promise.all([a.start(), old.start(), now.start()]);
      const dst = new Uint8Array(32);
      const local = await a.register({ kind: 'host', buffer: dst });
      const stale = (await old.register({ kind: 'host', buffer: new Uint8Array(32) })).descriptor;
      const good = (await now.register({ kind: 'host', buffer: new Uint8Array(32).fill(4) })).descriptor;
      await a.read(now.endpoint(), [{ local, remote: good }]);
      expect(dst.every((x) => x === 4)).toBe(true);

      const e1 = await refusal(a.read(now.endpoint(), [{ local, remote: good, length: 16 }, { local, localOffset: 16, remote: stale, length: 16 }]));
      expect(e1.message).toMatch(/^requests\[1\]\.remote was issued by an earlier incarnation of gapb \(first, peer is now second\)/);
      expect(e1.details).toMatchObject({ field: 'remote', request: 1 });

      const d = decodeDescriptor(good);
      const noTcp = encodeDescriptor({ ...d, transports: new Map([['other', new Uint8Array(16)]]) });
      const e2 = await refusal(a.read(now.endpoint(), [{ local, remote: good, length: 16 }, { local, localOffset: 16, remote: noTcp, length: 16 }]));
      expect(e2.message).toMatch(/^requests\[1\]\.remote has no tcp grant/);
      expect(e2.details).toMatchObject({ field: 'remote', request: 1 });

      const bad = encodeDescriptor({ ...d, transports: new Map([['tcp', new Uint8Array(5)]]) });
      const e3 = await refusal(a.read(now.endpoint(), [{ local, remote: good, length: 16 }, { local, localOffset: 16, remote: bad, length: 16 }]));
      expect(e3.message).toMatch(/^requests\[1\]\.remote: /);
      expect(e3.details).toMatchObject({ request: 1 });
    } finally {
      await Promise.all([a.close(), old.close(), now.close()]);
    }
  });
});
