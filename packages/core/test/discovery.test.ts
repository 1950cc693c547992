import fc from 'fast-check';
import { afterEach, describe, expect, it } from 'vitest';
import {
  AbortedError,
  ClosedError,
  ConnectionBrokenError,
  InvalidInputError,
  InvalidRecordError,
  MAX_ADVERTISED_BLOCKS,
  MAX_NODE_RECORD_BYTES,
  StaticDiscovery,
  TcpTransport,
  TimedOutError,
  TransferEngine,
  attachDiscovery,
  decodeNodeRecord,
  encodeEndpoint,
  encodeNodeRecord,
  endpointToString,
  nodeRecordFor,
  silentLogger,
  tryDecodeNodeRecord,
  type ConnectionInfo,
  type DiscoveryEvent,
  type NodeRecord,
  type Registration,
} from '../src/index.js';
import { pattern } from '../src/testing/pattern.js';

const ownerArb = fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/);
const tokenArb = fc.stringMatching(/^[A-Za-z0-9_-]{1,64}$/);
const transportArb = fc.stringMatching(/^[a-z][a-z0-9-]{0,31}$/);
const blockArb = fc.tuple(ownerArb, fc.stringMatching(/^[A-Za-z0-9_-]{1,64}$/)).map(([o, l]) => `block:${o}:${l}`);
const hostArb = fc.oneof(
  fc.ipV4(),
  fc.stringMatching(/^[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){0,3}$/),
  fc.constant('[::1]'),
);

function endpointFor(nodeId: string, incarnation: string, hostId: string, transports: Map<string, Uint8Array> = new Map([['tcp', new Uint8Array([1, 2, 3])]])): Uint8Array {
  return encodeEndpoint({ identity: { nodeId, incarnation, hostId }, transports });
}

function record(nodeId: string, incarnation = 'inc1', extra: Partial<NodeRecord> = {}): NodeRecord {
  return { nodeId, incarnation, hostId: 'host1', endpoint: endpointFor(nodeId, incarnation, 'host1'), ...extra };
}

const recordArb: fc.Arbitrary<NodeRecord> = fc
  .record({
    nodeId: ownerArb,
    incarnation: tokenArb,
    hostId: tokenArb,
    transports: fc.uniqueArray(fc.tuple(transportArb, fc.uint8Array({ maxLength: 64 })), { minLength: 1, maxLength: 4, selector: (t) => t[0] }),
    lockAddress: fc.option(fc.tuple(hostArb, fc.integer({ min: 1, max: 65535 })).map(([h, p]) => `${h}:${p}`), { nil: undefined }),
    blockIds: fc.option(fc.uniqueArray(blockArb, { maxLength: 20 }), { nil: undefined }),
  })
  .map((r) => ({
    nodeId: r.nodeId,
    incarnation: r.incarnation,
    hostId: r.hostId,
    endpoint: endpointFor(r.nodeId, r.incarnation, r.hostId, new Map(r.transports)),
    ...(r.lockAddress !== undefined ? { lockAddress: r.lockAddress } : {}),
    ...(r.blockIds !== undefined ? { blockIds: r.blockIds } : {}),
  }));

function json(r: NodeRecord, patch: Record<string, unknown> = {}): string {
  return JSON.stringify({ ...JSON.parse(new TextDecoder().decode(encodeNodeRecord(r))), ...patch });
}

function reasonOf(input: Uint8Array | string): string {
  const res = tryDecodeNodeRecord(input);
  return res.ok ? 'ok' : res.reason;
}

describe('node record codec', () => {
  it('round-trips every valid record', () => {
    fc.assert(
      fc.property(recordArb, (r) => {
        const back = decodeNodeRecord(encodeNodeRecord(r));
        expect(back.nodeId).toBe(r.nodeId);
        expect(back.incarnation).toBe(r.incarnation);
        expect(back.hostId).toBe(r.hostId);
        expect(Buffer.compare(back.endpoint, r.endpoint)).toBe(0);
        expect(back.lockAddress).toBe(r.lockAddress);
        expect(back.blockIds).toEqual(r.blockIds);
      }),
    );
  });

  it('decoding arbitrary bytes or JSON either yields a valid record or a typed InvalidRecordError', () => {
    const anyJson = fc.oneof(
      fc.jsonValue().map((v) => JSON.stringify(v)),
      recordArb.chain((r) => fc.dictionary(fc.constantFrom('v', 'nodeId', 'incarnation', 'hostId', 'endpoint', 'lockAddress', 'blockIds', 'x'), fc.jsonValue()).map((p) => json(r, p))),
    );
    fc.assert(
      fc.property(fc.oneof(fc.uint8Array({ maxLength: 300 }), anyJson), (input) => {
        try {
          const r = decodeNodeRecord(input);
          // Whatever got through is fully valid: it re-encodes to the same record.
          expect(decodeNodeRecord(encodeNodeRecord(r))).toEqual(r);
        } catch (e) {
          expect(e).toBeInstanceOf(InvalidRecordError);
          expect(typeof (e as InvalidRecordError).reason).toBe('string');
        }
      }),
      { numRuns: 500 },
    );
  });

  it('refuses each kind of bad record with its reason', () => {
    const r = record('holder-a', 'inc1', { lockAddress: '10.231.0.1:7070', blockIds: ['block:kv:1'] });
    expect(reasonOf(encodeNodeRecord(r))).toBe('ok');
    expect(reasonOf('x'.repeat(MAX_NODE_RECORD_BYTES + 1))).toBe('oversized');
    expect(reasonOf(new Uint8Array([0xff, 0xfe]))).toBe('malformed');
    expect(reasonOf('{"v":1,')).toBe('malformed');
    expect(reasonOf('[1,2]')).toBe('malformed');
    expect(reasonOf(json(r, { extra: true }))).toBe('unknown-field');
    expect(reasonOf(json(r, { v: 2 }))).toBe('unsupported-version');
    expect(reasonOf(json(r, { nodeId: 'has:colon' }))).toBe('invalid-field');
    expect(reasonOf(json(r, { nodeId: 'holder-b' }))).toBe('identity-mismatch'); // endpoint says holder-a
    expect(reasonOf(json(r, { incarnation: 'other' }))).toBe('identity-mismatch');
    expect(reasonOf(json(r, { endpoint: '!!' }))).toBe('invalid-field');
    expect(reasonOf(json(r, { endpoint: 'A'.repeat(40_000) }))).toBe('oversized');
    expect(reasonOf(json(r, { blockIds: ['pool:kv:1'] }))).toBe('invalid-field');
    expect(reasonOf(json(r, { blockIds: ['block:kv:1', 'block:kv:1'] }))).toBe('invalid-field');
    expect(reasonOf(json(r, { blockIds: Array.from({ length: MAX_ADVERTISED_BLOCKS + 1 }, (_, i) => `block:kv:${i}`) }))).toBe('oversized');
    expect(reasonOf(json(r, { blockIds: 'block:kv:1' }))).toBe('invalid-field');
    for (const bad of ['nohost', ':80', 'h:0', 'h:65536', 'a b:1', 'h:1:2']) expect(reasonOf(json(r, { lockAddress: bad }))).toBe('invalid-field');
    expect(() => encodeNodeRecord({ ...r, blockIds: ['block:kv:1', 'block:kv:1'] })).toThrow(InvalidRecordError);
  });

  it('nodeRecordFor takes the identity and endpoint of a started engine', async () => {
    await using engine = new TransferEngine({ nodeId: 'n1', transports: [new TcpTransport()], logger: silentLogger, metrics: false });
    await engine.start();
    const r = nodeRecordFor(engine, { lockAddress: '127.0.0.1:7070', blockIds: ['block:n1:1'] });
    expect(r).toMatchObject({ nodeId: 'n1', incarnation: engine.identity.incarnation, hostId: engine.identity.hostId, lockAddress: '127.0.0.1:7070' });
    expect(decodeNodeRecord(encodeNodeRecord(r))).toEqual(r);
  });
});

describe('StaticDiscovery', () => {
  it('answers lookups, holdersOf and list from the given peers (records, endpoints, JSON, base64url)', async () => {
    const a = record('a', 'i1', { blockIds: ['block:kv:1', 'block:kv:2'], lockAddress: 'a.example:7070' });
    const b = record('b', 'i1', { blockIds: ['block:kv:2'] });
    const c = record('c');
    const d = record('d');
    await using disc = new StaticDiscovery({ peers: [a, encodeNodeRecord(b), c.endpoint, endpointToString(d.endpoint)] });
    expect((await disc.lookup('a'))?.lockAddress).toBe('a.example:7070');
    expect((await disc.lookup('c'))?.incarnation).toBe('inc1');
    expect((await disc.lookup('d'))?.nodeId).toBe('d');
    expect(await disc.lookup('zzz')).toBeUndefined();
    expect((await disc.holdersOf('block:kv:2')).map((r) => r.nodeId).sort()).toEqual(['a', 'b']);
    expect((await disc.holdersOf('block:kv:1')).map((r) => r.nodeId)).toEqual(['a']);
    expect(await disc.holdersOf('block:kv:9')).toEqual([]);
    expect((await disc.list()).length).toBe(4);
    await expect(disc.lookup('bad:id')).rejects.toBeInstanceOf(InvalidInputError);
    await expect(disc.holdersOf('pool:kv:1')).rejects.toBeInstanceOf(InvalidInputError);
    expect(() => new StaticDiscovery({ peers: ['{"v":1}'] })).toThrow(InvalidRecordError);
    expect(() => new StaticDiscovery({ peers: [new Uint8Array([1, 2, 3])] })).toThrow(InvalidRecordError);
  });

  it('emits added, updated, incarnation-changed and removed', async () => {
    await using disc = new StaticDiscovery();
    const events: DiscoveryEvent[] = [];
    disc.on((e) => events.push(e));
    disc.set(record('a', 'i1'));
    disc.set(record('a', 'i1')); // unchanged: no event
    disc.set(record('a', 'i1', { blockIds: ['block:kv:1'] }));
    disc.set(record('a', 'i2'));
    disc.remove('a');
    expect(disc.remove('a')).toBe(false);
    expect(events.map((e) => e.type)).toEqual(['added', 'updated', 'incarnation-changed', 'removed']);
    const changed = events[2] as Extract<DiscoveryEvent, { type: 'incarnation-changed' }>;
    expect([changed.previous.incarnation, changed.record.incarnation]).toEqual(['i1', 'i2']);
  });

  it('a listener that throws does not stop the others or the change', async () => {
    await using disc = new StaticDiscovery();
    const seen: string[] = [];
    disc.on(() => {
      throw new Error('boom');
    });
    disc.on((e) => seen.push(e.type));
    disc.set(record('a'));
    expect(seen).toEqual(['added']);
    expect(disc.peek('a')).toBeDefined();
  });

  it('waitFor resolves on arrival, honours until, timeout, abort and close', async () => {
    const disc = new StaticDiscovery();
    const first = disc.waitFor('a');
    const second = disc.waitFor('a', { until: (r) => r.incarnation === 'i2' });
    disc.set(record('a', 'i1'));
    expect((await first).incarnation).toBe('i1');
    disc.set(record('a', 'i2'));
    expect((await second).incarnation).toBe('i2');
    await expect(disc.waitFor('nobody', { timeoutMs: 20 })).rejects.toBeInstanceOf(TimedOutError);
    const ac = new AbortController();
    const aborted = disc.waitFor('nobody', { signal: ac.signal });
    ac.abort();
    await expect(aborted).rejects.toBeInstanceOf(AbortedError);
    await expect(disc.waitFor('nobody', { signal: AbortSignal.abort() })).rejects.toBeInstanceOf(AbortedError);
    await expect(disc.waitFor('x', { timeoutMs: -1 })).rejects.toBeInstanceOf(InvalidInputError);
    const pending = disc.waitFor('nobody');
    await disc.close();
    await disc.close();
    await disc[Symbol.asyncDispose]();
    await expect(pending).rejects.toBeInstanceOf(ClosedError);
    await expect(disc.lookup('a')).rejects.toBeInstanceOf(ClosedError);
    await expect(disc.waitFor('a')).rejects.toBeInstanceOf(ClosedError);
  });

  it('publish cannot take a node id another live incarnation holds; withdraw frees it', async () => {
    await using disc = new StaticDiscovery({ peers: [record('a', 'old')] });
    await expect(disc.publish(record('a', 'new'))).rejects.toMatchObject({ reason: 'conflicting-claim' });
    expect(disc.peek('a')?.incarnation).toBe('old');
    disc.remove('a');
    await disc.publish(record('a', 'new'));
    expect(disc.peek('a')?.incarnation).toBe('new');
    await disc.publish(record('a', 'new', { blockIds: ['block:kv:3'] })); // our own update
    expect((await disc.holdersOf('block:kv:3')).length).toBe(1);
    await expect(disc.publish(record('b'))).rejects.toBeInstanceOf(InvalidInputError); // one node per discovery
    expect(() => disc.set(record('a', 'x'))).toThrow(InvalidRecordError); // our own id
    await disc.withdraw();
    expect(disc.peek('a')).toBeUndefined();
  });

  it('the cache and its block index always match a model under random changes', () => {
    const op = fc.oneof(
      fc.record({ kind: fc.constant('set' as const), node: fc.constantFrom('a', 'b', 'c'), inc: fc.constantFrom('i1', 'i2'), blocks: fc.subarray(['block:kv:1', 'block:kv:2', 'block:kv:3']) }),
      fc.record({ kind: fc.constant('remove' as const), node: fc.constantFrom('a', 'b', 'c') }),
    );
    fc.assert(
      fc.property(fc.array(op, { maxLength: 40 }), (ops) => {
        const disc = new StaticDiscovery();
        const model = new Map<string, { inc: string; blocks: string[] }>();
        const events: DiscoveryEvent[] = [];
        disc.on((e) => events.push(e));
        for (const o of ops) {
          const before = model.get(o.node);
          events.length = 0;
          if (o.kind === 'set') {
            disc.set(record(o.node, o.inc, { blockIds: o.blocks }));
            model.set(o.node, { inc: o.inc, blocks: o.blocks });
            const expected = !before ? 'added' : before.inc !== o.inc ? 'incarnation-changed' : before.blocks.join() !== o.blocks.join() ? 'updated' : undefined;
            expect(events.map((e) => e.type)).toEqual(expected ? [expected] : []);
          } else {
            disc.remove(o.node);
            model.delete(o.node);
            expect(events.map((e) => e.type)).toEqual(before ? ['removed'] : []);
          }
          for (const b of ['block:kv:1', 'block:kv:2', 'block:kv:3']) {
            const want = [...model].filter(([, v]) => v.blocks.includes(b)).map(([k]) => k).sort();
            void disc.holdersOf(b).then((rs) => expect(rs.map((r) => r.nodeId).sort()).toEqual(want));
          }
          expect(new Map([...model].map(([k, v]) => [k, v.inc]))).toEqual(new Map(['a', 'b', 'c'].flatMap((n) => (disc.peek(n) ? [[n, disc.peek(n)?.incarnation]] : []))));
        }
      }),
    );
  });
});

describe('attachDiscovery', () => {
  function fakeEngine(conns: ConnectionInfo[] = []): { engine: Parameters<typeof attachDiscovery>[0]; calls: string[] } {
    const calls: string[] = [];
    return {
      calls,
      engine: {
        identity: { nodeId: 'me', incarnation: 'mine', hostId: 'h' },
        invalidate: (nodeId: string, _reason?: string, options?: { incarnation?: string }) => {
          calls.push(options?.incarnation === undefined ? nodeId : `${nodeId}/${options.incarnation}`);
          return Promise.resolve();
        },
        connections: () => conns,
      },
    };
  }

  it('invalidates a peer synchronously when its incarnation changes or it is removed, and never for updates or itself', async () => {
    await using disc = new StaticDiscovery({ peers: [record('a', 'i1')] });
    const { engine, calls } = fakeEngine();
    using _att = attachDiscovery(engine, disc);
    disc.set(record('a', 'i1', { blockIds: ['block:kv:1'] }));
    expect(calls).toEqual([]);
    disc.set(record('a', 'i2'));
    expect(calls).toEqual(['a/i1']); // already done when set() returns: before any caller can see i2
    disc.remove('a');
    expect(calls).toEqual(['a/i1', 'a/i2']);
    await disc.publish(record('me', 'mine'));
    await disc.withdraw();
    expect(calls).toEqual(['a/i1', 'a/i2']);
  });

  it('invalidates, when attaching, connections to incarnations discovery no longer lists', async () => {
    await using disc = new StaticDiscovery({ peers: [record('a', 'i2'), record('b', 'i1')] });
    const conn = (nodeId: string, incarnation: string): ConnectionInfo => ({ peer: { nodeId, incarnation, hostId: 'h' }, transport: 'tcp', state: 'open', initiator: 'me', streams: 1, inFlight: 0 });
    const { engine, calls } = fakeEngine([conn('a', 'i1'), conn('b', 'i1'), conn('c', 'i1')]);
    const att = attachDiscovery(engine, disc);
    expect(calls).toEqual(['a/i1']);
    att.detach();
    att.detach();
    disc.set(record('b', 'i9'));
    expect(calls).toEqual(['a/i1']); // detached: no more
  });

  it('signalFor aborts with ConnectionBrokenError when that incarnation ends, and is born aborted for a dead one', async () => {
    await using disc = new StaticDiscovery({ peers: [record('a', 'i1')] });
    const { engine } = fakeEngine();
    const ended: string[] = [];
    using att = attachDiscovery(engine, disc, { onPeerEnded: (id, old, next) => ended.push(`${id}:${old.incarnation}->${next?.incarnation ?? 'none'}`) });
    const s1 = att.signalFor('a', 'i1');
    expect(att.signalFor('a', 'i0').aborted).toBe(true);
    expect(att.signalFor('nobody', 'i1').aborted).toBe(true);
    disc.set(record('a', 'i1', { blockIds: ['block:kv:1'] }));
    expect(s1.aborted).toBe(false);
    disc.set(record('a', 'i2'));
    expect(s1.aborted).toBe(true);
    expect(s1.reason).toBeInstanceOf(ConnectionBrokenError);
    const s2 = att.signalFor('a', 'i2');
    disc.remove('a');
    expect(s2.aborted).toBe(true);
    expect(ended).toEqual(['a:i1->i2', 'a:i2->none']);
  });

  describe('with real engines over TCP', () => {
    const closers: (() => Promise<unknown>)[] = [];
    afterEach(async () => {
      for (const c of closers.splice(0).reverse()) await c().catch(() => undefined);
    });

    async function holder(incarnation: string): Promise<{ engine: TransferEngine; descriptor: Uint8Array; seed: number }> {
      const engine = new TransferEngine({ nodeId: 'holder', incarnation, transports: [new TcpTransport()], logger: silentLogger, metrics: false });
      closers.push(() => engine.close());
      await engine.start();
      const seed = incarnation.length * 7 + incarnation.charCodeAt(incarnation.length - 1);
      const reg = await engine.register({ kind: 'host', buffer: pattern(64 * 1024, seed) });
      return { engine, descriptor: reg.descriptor, seed };
    }

    /** A requester following a discovery, with a 64 KiB destination registered. */
    async function following(): Promise<{ requester: TransferEngine; dst: Uint8Array; local: Registration; disc: StaticDiscovery }> {
      const requester = new TransferEngine({ nodeId: 'requester', transports: [new TcpTransport()], logger: silentLogger });
      closers.push(() => requester.close());
      await requester.start();
      const dst = new Uint8Array(64 * 1024);
      const local = await requester.register({ kind: 'host', buffer: dst });
      const disc = new StaticDiscovery();
      closers.push(() => disc.close());
      const att = attachDiscovery(requester, disc);
      closers.push(async () => att.detach());
      return { requester, dst, local, disc };
    }

    it('a restarted holder gets a fresh connection; the old incarnation\'s connection is gone before the next read; stale descriptors are refused', async () => {
      const { requester, dst, local, disc } = await following();
      const h1 = await holder('first');
      disc.set(nodeRecordFor(h1.engine));
      const r1 = (await disc.lookup('holder')) as NodeRecord;
      await requester.read(r1.endpoint, [{ local, remote: h1.descriptor }], { timeoutMs: 10_000 });
      expect(Buffer.compare(dst, pattern(dst.length, h1.seed))).toBe(0);
      expect(requester.connections().map((c) => c.peer.incarnation)).toEqual(['first']);

      await h1.engine.close();
      const h2 = await holder('second');
      disc.set(nodeRecordFor(h2.engine));
      // Invalidated inside set(): nothing of the old incarnation is left to use.
      expect(requester.connections().filter((c) => c.peer.incarnation === 'first')).toEqual([]);
      const r2 = (await disc.lookup('holder')) as NodeRecord;
      await expect(requester.read(r2.endpoint, [{ local, remote: h1.descriptor }], { timeoutMs: 10_000 })).rejects.toBeInstanceOf(InvalidInputError);
      dst.fill(0);
      await requester.read(r2.endpoint, [{ local, remote: h2.descriptor }], { timeoutMs: 10_000 });
      expect(Buffer.compare(dst, pattern(dst.length, h2.seed))).toBe(0);
      expect(requester.connections().map((c) => c.peer.incarnation)).toEqual(['second']);
    });

    // A lease named the new incarnation, and the requester read from it, before discovery
    // listed it. Discovery then reports the restart either as one change or, as etcd does (the
    // new record is published only once the old owner's lease ended), as removed then added.
    it.each(['incarnation-changed', 'removed, then added'] as const)('a connection to the new incarnation opened before discovery listed it survives the restart reported as %s', async (how) => {
      const { requester, dst, local, disc } = await following();
      const h1 = await holder('first');
      disc.set(nodeRecordFor(h1.engine));
      await requester.read(h1.engine.endpoint(), [{ local, remote: h1.descriptor }], { timeoutMs: 10_000 });
      const h2 = await holder('second');
      await requester.read(h2.engine.endpoint(), [{ local, remote: h2.descriptor }], { timeoutMs: 10_000 });
      expect(requester.connections().map((c) => c.peer.incarnation).sort()).toEqual(['first', 'second']);
      if (how === 'removed, then added') {
        disc.remove('holder');
        expect(requester.connections().map((c) => c.peer.incarnation)).toEqual(['second']);
      }
      disc.set(nodeRecordFor(h2.engine));
      expect(requester.connections().map((c) => c.peer.incarnation)).toEqual(['second']);
      dst.fill(0);
      await requester.read(h2.engine.endpoint(), [{ local, remote: h2.descriptor }], { timeoutMs: 10_000 });
      expect(Buffer.compare(dst, pattern(dst.length, h2.seed))).toBe(0);
      // One connection to each incarnation was ever opened: the second one was kept, not redialled.
      const opened = (await (requester.metrics as NonNullable<TransferEngine['metrics']>).connectionEvents.get()).values.find((v) => v.labels.event === 'opened');
      expect(opened?.value).toBe(2);
    });
  });
});
