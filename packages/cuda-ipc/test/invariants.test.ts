/**
 * Mutation-audit gaps (issue 14), one test per gap, each shown to fail with the guarded line
 * broken (see the package README, "Mutation testing"):
 *
 * - invariant 1: two foreign owners' slots with the same counter (`pool:A:1`, `pool:C:1`) mapped
 *   in one process; a non-owner free of one leaves the other mapped.
 * - invariant 9: the importer count is given back only after cuIpcCloseMemHandle finished
 *   (FAKE CUDA calls, like test/bookkeeping.test.ts: shared memory, headers and importer counts
 *   are the real ones; the GPU suite covers the hardware path).
 * - invariant 10: a group/other-accessible segment is refused on open; the owner's free()
 *   unlinks the name from /dev/shm; a header naming another pool id is refused.
 * - invariant 13: a same-host grant with the right grant name and a wrong token is refused.
 */
import { chmodSync, existsSync, statSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { InvalidInputError, RemoteRejectedError, createTransferBatch, defaultHostId, formatId, silentLogger, type TransportHost } from '@tensorwire/core';
import { CudaIpcTransport, SegmentKind, SegmentState, allocateSharedMemory, native, poolSegmentName, releaseSharedMemory } from '../src/index.js';
import { DATA_OFFSET } from '../src/shared.js';
import { uniqueOwner } from './helpers.js';
import { failure, nativeFakes, trackedPools } from './pool-fixtures.js';

const pool = trackedPools((owner) => owner);

const fake = nativeFakes();

const shmPath = (id: string): string => `/dev/shm${poolSegmentName(id)}`;

describe('invariant 1: a non-owner free is keyed by the whole pool id', () => {
  it('pool:A:1 and pool:C:1 mapped in one process: freeing one leaves the other mapped and readable', async () => {
    const a = pool(uniqueOwner('ga'));
    const c = pool(uniqueOwner('gc'));
    const b = pool(uniqueOwner('gb'));
    const idA = await a.register({ byteLength: 64 });
    const idC = await c.register({ byteLength: 64 });
    // Same counter, different owners: a table keyed by the counter would confuse them.
    expect(idA.split(':')[2]).toBe(idC.split(':')[2]);
    a.writeSync(idA, new Uint8Array(64).fill(0xa1));
    c.writeSync(idC, new Uint8Array(64).fill(0xc1));
    // Every mapping order and either target: a lookup by the bare counter finds the wrong one in one of them.
    for (const [first, second] of [
      [idA, idC],
      [idC, idA],
    ] as const) {
      for (const target of [first, second]) {
        const keep = target === idA ? idC : idA;
        const what = `mapped ${first} then ${second}, freed ${target}`;
        b.readSync(first).dispose();
        b.readSync(second).dispose();
        expect(b.mapped(), what).toEqual([first, second]);
        const r = await b.free(target);
        expect(r.deferred, what).toBe(false);
        expect(b.mapped(), what).toEqual([keep]);
        // The other slot is still mapped and reads its own bytes; the owners' slots are untouched.
        using v = b.readSync(keep);
        expect(v.buffer?.every((x) => x === (keep === idA ? 0xa1 : 0xc1)), what).toBe(true);
        expect(b.mapped(), what).toEqual([keep]);
        expect(a.owned(), what).toEqual([idA]);
        expect(c.owned(), what).toEqual([idC]);
        expect(existsSync(shmPath(idA)), what).toBe(true);
        expect(existsSync(shmPath(idC)), what).toBe(true);
        v.dispose();
        await b.free(keep);
        expect(b.mapped(), what).toEqual([]);
      }
    }
  });

  it('a non-owner free of an id with the owner of a mapping but another counter drops nothing', async () => {
    const a = pool(uniqueOwner('gd'));
    const b = pool(uniqueOwner('ge'));
    const one = await a.register({ byteLength: 16 });
    b.readSync(one).dispose();
    const other = formatId('pool', a.owner, 2);
    const r = await b.free(other);
    expect(r.deferred).toBe(false);
    expect(b.mapped()).toEqual([one]);
  });
});

describe('invariant 9 (fake CUDA): the importer count is given back after cuIpcCloseMemHandle, never before', () => {
  it('while the close of the import is in flight the owner still counts the importer and does not free the device memory', async () => {
    const events: string[] = [];
    let openClose = (): void => undefined;
    const closeGate = new Promise<void>((r) => (openClose = r));
    fake('cudaAlloc', async () => 0x1000n);
    fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(7), base: 0x1000n, offset: 0, allocSize: 4096 }));
    fake('cudaImport', async () => {
      events.push('import');
      return 0x2000n;
    });
    fake('cudaCloseImport', async () => {
      events.push('closeImport:start');
      await closeGate;
      events.push('closeImport:done');
    });
    fake('cudaFree', async () => {
      events.push('free');
    });
    const a = pool(uniqueOwner('da'), { deferredFreeTimeoutMs: 60_000 });
    const b = pool(uniqueOwner('db'));
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    const view = await b.read(id);
    expect(a.importers(id)).toBe(1);
    const mine = await b.free(id); // b's own mapping: deferred while its view is live
    expect(mine.deferred).toBe(true);
    let importerDone = false;
    void mine.released.then(() => (importerDone = true));
    view.dispose(); // the last view: b closes its import now
    await new Promise((r) => setTimeout(r, 20));
    expect(events).toEqual(['import', 'closeImport:start']);
    // cuIpcCloseMemHandle has not returned: b still maps the memory, and the owner must see it.
    expect(importerDone).toBe(false);
    expect(a.importers(id)).toBe(1);
    const owner = await a.free(id);
    expect(owner.deferred).toBe(true);
    let released = false;
    void owner.released.then(() => (released = true));
    await new Promise((r) => setTimeout(r, 60));
    expect(released).toBe(false);
    expect(events).not.toContain('free');
    openClose();
    await mine.released;
    await owner.released;
    expect(events).toEqual(['import', 'closeImport:start', 'closeImport:done', 'free']);
  });
});

describe('invariant 10: shared memory is private and untrusted', () => {
  it('a segment readable or writable by group or others is refused on open', async () => {
    const a = pool(uniqueOwner('ma'));
    const b = pool(uniqueOwner('mb'));
    const id = await a.register({ byteLength: 64 });
    const path = shmPath(id);
    expect(statSync(path).mode & 0o777).toBe(0o600);
    for (const mode of [0o640, 0o620, 0o604, 0o602, 0o660, 0o644]) {
      chmodSync(path, mode);
      const err = await failure(() => b.readSync(id));
      expect(err, mode.toString(8)).toBeInstanceOf(InvalidInputError);
      expect(err.message, mode.toString(8)).toMatch(/accessible to other users|mode/);
      expect(b.mapped(), mode.toString(8)).toEqual([]);
    }
    chmodSync(path, 0o600);
    using v = b.readSync(id);
    expect(v.byteLength).toBe(64);
  });

  it("the owner's free() and close() remove the segment's name from /dev/shm (host and cuda slots)", async () => {
    const a = pool(uniqueOwner('ua'));
    const id = await a.register({ byteLength: 64 });
    const id2 = await a.register({ byteLength: 64 });
    expect(existsSync(shmPath(id))).toBe(true);
    // An importer's view keeps its mapping, but the name is gone at once.
    const b = pool(uniqueOwner('ub'));
    using view = b.readSync(id);
    await a.free(id);
    expect(existsSync(shmPath(id))).toBe(false);
    expect(view.byteLength).toBe(64);
    expect(existsSync(shmPath(id2))).toBe(true);
    await a.close();
    expect(existsSync(shmPath(id2))).toBe(false);
  });

  it("the owner's free() of a cuda slot unlinks its header segment at once (fake CUDA)", async () => {
    fake('cudaAlloc', async () => 0x1000n);
    fake('cudaExport', async () => ({ handle: new Uint8Array(64).fill(7), base: 0x1000n, offset: 0, allocSize: 4096 }));
    fake('cudaFree', async () => undefined);
    const a = pool(uniqueOwner('uc'));
    const id = await a.register({ byteLength: 4096, device: 'cuda:0' });
    expect(existsSync(shmPath(id))).toBe(true);
    const r = await a.free(id);
    expect(existsSync(shmPath(id))).toBe(false);
    await r.released;
  });

  it('a segment whose header names another pool id than the one asked for is refused', async () => {
    const a = pool(uniqueOwner('ha'));
    const b = pool(uniqueOwner('hb'));
    const real = await a.register({ byteLength: 64 });
    a.writeSync(real, new Uint8Array(64).fill(9));
    // A well-formed, live segment under the name of pool:<a>:7 whose header says pool:<a>:1.
    const forged = formatId('pool', a.owner, 7);
    const name = poolSegmentName(forged);
    const mapping = native.shmCreate(name, DATA_OFFSET + 64, {
      kind: SegmentKind.Pool,
      id: real,
      dataOffset: DATA_OFFSET,
      capacity: 64,
      ownerPid: process.pid,
      device: -1,
      byteLength: 64,
      dtype: 0,
      shape: [64],
    });
    native.setState(mapping, SegmentState.Live);
    try {
      for (const [what, fn] of [
        ['readSync', () => b.readSync(forged)],
        ['read', () => b.read(forged)],
        ['snapshot', () => b.snapshot(forged)],
      ] as const) {
        const err = await failure(fn);
        expect(err, what).toBeInstanceOf(InvalidInputError);
        expect(err.message, what).toMatch(/names .* expected/);
      }
    } finally {
      native.shmUnlink(name);
    }
    using v = b.readSync(real);
    expect(v.buffer?.[0]).toBe(9);
  });
});

describe('invariant 13: a same-host grant is checked by its token, not only its name', () => {
  it('a payload with the right grant name and a wrong token is refused (bad-token); the right one reads', async () => {
    const pid = process.pid;
    const hosts: TransportHost[] = ['ta', 'tb'].map((n) => ({ identity: { nodeId: `inv${n}${pid}`, incarnation: `i${n}`, hostId: defaultHostId() }, logger: silentLogger, inbound: () => undefined }));
    const [ta, tb] = [new CudaIpcTransport(), new CudaIpcTransport()];
    await ta.start(hosts[0] as TransportHost);
    await tb.start(hosts[1] as TransportHost);
    const region = allocateSharedMemory(4096, 'invtok');
    region.fill(0x3c);
    try {
      const reg = await tb.register({ kind: 'host', buffer: region });
      const payload = reg.payload;
      const dst = new Uint8Array(64).fill(0xee);
      const local = await ta.register({ kind: 'host', buffer: dst });
      const conn = await ta.connect((hosts[1] as TransportHost).identity, tb.endpoint(), { signal: new AbortController().signal, deadline: Date.now() + 10_000, streams: 1 });
      const read = (p: Uint8Array): Promise<void> =>
        conn.execute(0, createTransferBatch('read', [{ local: local.handle, localOffset: 0, remote: ta.decodeRemote(p, 'host', 4096), remoteOffset: 0, length: 64, remoteRange: 0, request: 3 }]), {
          signal: new AbortController().signal,
          deadline: Date.now() + 10_000,
        });
      // The token is the last 16 bytes before the u64 length (magic, version, kind, mode, str8 name, token, u64).
      const tokenAt = payload.length - 8 - 16;
      for (const flip of [0, 7, 15]) {
        const forged = payload.slice();
        forged[tokenAt + flip] = (forged[tokenAt + flip] as number) ^ 0x01;
        const err = await failure(() => read(forged));
        expect(err, `byte ${flip}`).toBeInstanceOf(RemoteRejectedError);
        expect((err as RemoteRejectedError).remoteCode, `byte ${flip}`).toBe('bad-token');
        expect(dst.every((x) => x === 0xee), `byte ${flip}`).toBe(true);
      }
      await read(payload);
      expect(dst.every((x) => x === 0x3c)).toBe(true);
      await conn.close();
    } finally {
      await ta.close();
      await tb.close();
      releaseSharedMemory(region);
    }
  });
});

