/**
 * The bookkeeping of memory-window grants, without a device: the holder's ledger (which
 * windows exist for which grant on which connection) and the requester's rkey cache. These
 * tests say nothing about a NIC; the hardware suite binds real windows.
 */
import fc from 'fast-check';
import { ConnectionBrokenError, RemoteRejectedError, ResourceExhaustedError, SessionInvalidatedError } from '@tensorwire/core';
import { describe, expect, it } from 'vitest';
import { WindowKeyCache, WindowLedger, refusal, tokenHex, type Binding } from '../src/windows.js';

const tok = (n: number): Uint8Array => {
  const t = new Uint8Array(16);
  new DataView(t.buffer).setUint32(12, n);
  return t;
};

describe('WindowLedger (holder side)', () => {
  it('refuses unknown grants, shares one binding per grant and connection, and enforces the per-connection limit', () => {
    const l = new WindowLedger<string, string>(2);
    expect(l.request('c1', 'aa')).toMatchObject({ kind: 'refused', code: 'unknown-grant' });
    l.addGrant('aa', 'regA');
    l.addGrant('bb', 'regB');
    l.addGrant('cc', 'regC');
    expect(() => l.addGrant('aa', 'again')).toThrow(/already in use/);
    const first = l.request('c1', 'aa');
    expect(first).toMatchObject({ kind: 'new', grant: 'regA' });
    const again = l.request('c1', 'aa');
    expect(again.kind).toBe('existing');
    expect((again as { binding: unknown }).binding).toBe((first as { binding: unknown }).binding);
    expect(l.request('c1', 'bb').kind).toBe('new');
    expect(l.request('c1', 'cc')).toMatchObject({ kind: 'refused', code: 'window-limit' });
    // Another connection has its own budget and its own binding for the same grant.
    expect(l.request('c2', 'aa').kind).toBe('new');
    expect(l.bindingCount('c1')).toBe(2);
    expect(l.bindingCount('c2')).toBe(1);
  });

  it('the budget is per peer: more connections buy a peer no more windows, and removing bindings returns it', () => {
    const peerOf = (c: string): string => c.split('#')[0] as string;
    const l = new WindowLedger<string, string>(2, peerOf);
    for (const t of ['aa', 'bb', 'cc']) l.addGrant(t, t);
    expect(l.request('p1#1', 'aa').kind).toBe('new');
    expect(l.request('p1#2', 'bb').kind).toBe('new');
    expect(l.request('p1#3', 'cc')).toMatchObject({ kind: 'refused', code: 'window-limit' });
    expect(l.request('p2#1', 'cc').kind).toBe('new'); // another peer
    expect(l.peerBindingCount('p1#9')).toBe(2);
    l.dropConnection('p1#1');
    expect(l.peerBindingCount('p1#9')).toBe(1);
    expect(l.request('p1#3', 'cc').kind).toBe('new');
  });

  it('revoking a grant removes every binding of it; one still binding is cancelled and its binder is told', async () => {
    const l = new WindowLedger<string, string>(8);
    l.addGrant('aa', 'regA');
    const bound = (l.request('c1', 'aa') as { binding: Binding<string> }).binding;
    bound.windows.push(1, 2);
    expect(l.complete(bound, [11, 12])).toBe(true);
    const binding = (l.request('c2', 'aa') as { binding: Binding<string> }).binding;
    const out = l.revokeGrant('aa');
    expect(out).toHaveLength(2);
    expect(out.find((b) => b.conn === 'c1')?.state).toBe('bound');
    expect(binding.state).toBe('cancelled');
    // The binder finishes later and learns it must deallocate instead of answering BOUND.
    expect(l.complete(binding, [21, 22])).toBe(false);
    binding.finish();
    await binding.settled;
    expect(l.request('c1', 'aa')).toMatchObject({ kind: 'refused', code: 'unknown-grant' });
    expect(l.bindingCount('c1') + l.bindingCount('c2')).toBe(0);
    expect(l.grantCount).toBe(0);
  });

  it('a connection that goes takes its bindings with it, and leaves other connections alone', () => {
    const l = new WindowLedger<string, string>(8);
    l.addGrant('aa', 'regA');
    l.addGrant('bb', 'regB');
    for (const c of ['c1', 'c2']) for (const t of ['aa', 'bb']) l.request(c, t);
    expect(l.dropConnection('c1').map((b) => b.token).sort()).toEqual(['aa', 'bb']);
    expect(l.bindingCount('c1')).toBe(0);
    expect(l.bindingCount('c2')).toBe(2);
    expect(l.revokeGrant('aa').map((b) => b.conn)).toEqual(['c2']);
  });

  it('model: after any sequence, every window ever allocated is deallocated exactly once when grants are revoked and connections dropped', () => {
    const conns = ['c0', 'c1', 'c2'];
    const tokens = ['t0', 't1', 't2', 't3'];
    const action = fc.oneof(
      fc.record({ t: fc.constant('add' as const), token: fc.constantFrom(...tokens) }),
      fc.record({ t: fc.constant('request' as const), conn: fc.constantFrom(...conns), token: fc.constantFrom(...tokens) }),
      fc.record({ t: fc.constant('finish' as const), ok: fc.boolean(), pick: fc.nat() }),
      fc.record({ t: fc.constant('revoke' as const), token: fc.constantFrom(...tokens) }),
      fc.record({ t: fc.constant('drop' as const), conn: fc.constantFrom(...conns) }),
    );
    fc.assert(
      fc.property(fc.array(action, { maxLength: 60 }), fc.integer({ min: 1, max: 3 }), (actions, limit) => {
        const l = new WindowLedger<string, string>(limit);
        const live = new Set<string>();
        const allocated = new Set<number>();
        const freed = new Map<number, number>();
        const free = (b: Binding<string>): void => {
          for (const w of b.windows) freed.set(w, (freed.get(w) ?? 0) + 1);
        };
        const binding: Binding<string>[] = []; // binders still at work
        let nextWindow = 1;
        for (const a of actions) {
          if (a.t === 'add') {
            if (!live.has(a.token)) {
              l.addGrant(a.token, a.token);
              live.add(a.token);
            }
          } else if (a.t === 'request') {
            const before = l.bindingCount(a.conn);
            const r = l.request(a.conn, a.token);
            if (r.kind === 'new') {
              expect(before).toBeLessThan(limit);
              r.binding.windows.push(nextWindow, nextWindow + 1);
              allocated.add(nextWindow).add(nextWindow + 1);
              nextWindow += 2;
              binding.push(r.binding);
            } else if (r.kind === 'refused') {
              expect(r.code === 'unknown-grant' ? !live.has(a.token) : before >= limit).toBe(true);
            }
            expect(l.bindingCount(a.conn)).toBeLessThanOrEqual(limit);
          } else if (a.t === 'finish') {
            if (binding.length === 0) continue;
            const b = binding.splice(a.pick % binding.length, 1)[0] as Binding<string>;
            // The binder: success records rkeys unless cancelled; failure or cancellation frees.
            if (a.ok && l.complete(b, [1, 2])) continue;
            free(b);
            if (a.ok) b.finish();
            else l.fail(b);
          } else {
            const out = a.t === 'revoke' ? l.revokeGrant(a.token) : l.dropConnection(a.conn);
            if (a.t === 'revoke') live.delete(a.token);
            // Bound windows are freed by whoever removed them; ones still binding by their binder.
            for (const b of out) if (b.state === 'bound') free(b);
          }
        }
        // Let the remaining binders finish, then tear everything down.
        for (const b of binding.splice(0)) {
          if (!l.complete(b, [1, 2])) {
            free(b);
            b.finish();
          }
        }
        for (const t of tokens) for (const b of l.revokeGrant(t)) if (b.state === 'bound') free(b);
        for (const c of conns) expect(l.dropConnection(c)).toEqual([]);
        for (const w of allocated) expect(freed.get(w)).toBe(1);
        expect(freed.size).toBe(allocated.size);
      }),
    );
  });
});

describe('WindowKeyCache (requester side)', () => {
  it('sends one BIND per grant however many transfers want it, then serves the cache', async () => {
    const sent: [number, string][] = [];
    const c = new WindowKeyCache(2, (id, t) => sent.push([id, tokenHex(t)]));
    const a = c.get(tok(1));
    const b = c.get(tok(1));
    expect(a).toBeInstanceOf(Promise);
    expect(b).toBe(a);
    expect(sent).toHaveLength(1);
    expect(c.onBound((sent[0] as [number, string])[0], [7, 8])).toBeUndefined();
    await expect(a).resolves.toEqual({ rkeys: [7, 8], revoked: false });
    expect(c.get(tok(1))).toEqual({ rkeys: [7, 8], revoked: false });
    expect(sent).toHaveLength(1);
    expect(c.size).toBe(1);
    expect(c.pending).toBe(0);
  });

  it('maps refusals to typed errors: window-limit is backpressure, the rest are remote rejections', async () => {
    const sent: number[] = [];
    const c = new WindowKeyCache(1, (id) => sent.push(id));
    const limit = c.get(tok(1));
    const gone = c.get(tok(2));
    c.onRefused(sent[0] as number, 'window-limit', 'full');
    c.onRefused(sent[1] as number, 'unknown-grant', 'revoked');
    await expect(limit).rejects.toBeInstanceOf(ResourceExhaustedError);
    await expect(gone).rejects.toBeInstanceOf(RemoteRejectedError);
    await expect(gone).rejects.toMatchObject({ details: { remoteCode: 'unknown-grant' } });
    // A refused grant is asked for again next time (the holder may have room by then).
    expect(c.get(tok(1))).toBeInstanceOf(Promise);
    expect(sent).toHaveLength(3);
  });

  it('closing is a session error, running out of windows is backpressure', () => {
    expect(refusal('closing', 'bye')).toBeInstanceOf(SessionInvalidatedError);
    expect(refusal('no-windows', 'ENOMEM')).toBeInstanceOf(ResourceExhaustedError);
    expect(refusal('bind-failed', 'x')).toBeInstanceOf(RemoteRejectedError);
  });

  it('keeps at most maxInFlight BINDs outstanding and sends the rest as answers come', async () => {
    const sent: number[] = [];
    const c = new WindowKeyCache(1, (id) => sent.push(id), 3);
    const all = Array.from({ length: 10 }, (_, i) => c.get(tok(100 + i)) as Promise<unknown>);
    expect(sent).toHaveLength(3);
    expect(c.inFlight).toBe(3);
    // An answer for a request not sent yet is a protocol error.
    expect(c.onBound(sent[2] as number + 1, [1])).toBeInstanceOf(ConnectionBrokenError);
    for (let i = 0; i < 10; i++) {
      expect(c.inFlight).toBeLessThanOrEqual(3);
      c.onBound(sent[i] as number, [i]);
    }
    await Promise.all(all);
    expect(sent).toHaveLength(10);
    expect(c.inFlight).toBe(0);
  });

  it('UNBIND marks the keys revoked for transfers that hold them and drops them from the cache', async () => {
    const sent: number[] = [];
    const c = new WindowKeyCache(1, (id) => sent.push(id));
    const p = c.get(tok(3));
    c.onBound(sent[0] as number, [5]);
    const keys = await p;
    c.onUnbind(tok(3));
    expect(keys.revoked).toBe(true);
    expect(c.size).toBe(0);
    expect(c.get(tok(3))).toBeInstanceOf(Promise);
  });

  it('answers it did not ask for, and a wrong window count, are protocol errors', async () => {
    const sent: number[] = [];
    const c = new WindowKeyCache(2, (id) => sent.push(id));
    expect(c.onBound(99, [1, 2])).toBeInstanceOf(ConnectionBrokenError);
    expect(c.onRefused(99, 'x', 'y')).toBeInstanceOf(ConnectionBrokenError);
    const p = c.get(tok(4));
    expect(c.onBound(sent[0] as number, [1])).toBeInstanceOf(ConnectionBrokenError);
    await expect(p).rejects.toBeInstanceOf(ConnectionBrokenError);
  });

  it('failAll rejects every waiting BIND, revokes cached keys, and refuses new ones', async () => {
    const sent: number[] = [];
    const c = new WindowKeyCache(1, (id) => sent.push(id));
    const cachedP = c.get(tok(5));
    c.onBound(sent[0] as number, [9]);
    const cached = await cachedP;
    const waiting = c.get(tok(6));
    const err = new ConnectionBrokenError('gone');
    c.failAll(err);
    await expect(waiting).rejects.toBe(err);
    expect(cached.revoked).toBe(true);
    await expect(c.get(tok(7))).rejects.toBe(err);
    expect(c.pending).toBe(0);
    expect(c.size).toBe(0);
  });
});
