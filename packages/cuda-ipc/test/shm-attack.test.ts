/**
 * Shared memory that cannot be pulled away (issue 19, point 3). A hostile process of the same
 * user finds a live pool slot the way any reader does and truncates it, truncates its name,
 * mangles its header and forges its locator, while its owner (a child process that also serves
 * the slot through the cuda-ipc transport) and a reader (this process: a pool with a live
 * zero-copy view, and an engine reading through both kinds of grant) are active. Nobody dies:
 * truncation is refused by the kernel (the segment is a memfd sealed against shrinking and
 * growing), the library's own reads and writes of a mangled segment get typed errors, honest
 * work on the other slot goes on, and every grant is revoked and accounted for at the end.
 */
import { fork, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { rmSync } from 'node:fs';
import { afterAll, describe, expect, it } from 'vitest';
import { InvalidInputError, TensorwireError, TransferEngine, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport, TensorPool } from '../src/index.js';
import { fixture, uniqueOwner } from './helpers.js';

const SLOT = 64 * 1024;

interface Reply {
  seq: number;
  ok: boolean;
  [k: string]: unknown;
}

interface Driven {
  readonly proc: ChildProcess;
  readonly ready: Record<string, unknown>;
  call(op: string, extra?: Record<string, unknown>): Promise<Reply>;
  readonly exited: Promise<[number | null, NodeJS.Signals | null]>;
}

const procs: ChildProcess[] = [];
afterAll(() => {
  for (const p of procs) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
});

async function drive(script: string, args: string[]): Promise<Driven> {
  const proc = fork(fixture(script), args, { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  procs.push(proc);
  const exited = once(proc, 'exit') as Promise<[number | null, NodeJS.Signals | null]>;
  const pending = new Map<number, (r: Reply) => void>();
  let seq = 0;
  const readyP = new Promise<Record<string, unknown>>((resolve, reject) => {
    proc.on('message', (m: Reply & { ready?: boolean }) => {
      if (m.ready) return resolve(m);
      pending.get(m.seq)?.(m);
      pending.delete(m.seq);
    });
    void exited.then(([code, signal]) => reject(new Error(`${script} exited (${String(code)}, ${String(signal)}) before it was ready`)));
  });
  const ready = await readyP;
  return {
    proc,
    ready,
    exited,
    call: (op, extra = {}) =>
      new Promise<Reply>((resolve) => {
        const s = ++seq;
        pending.set(s, resolve);
        proc.send({ seq: s, op, ...extra });
      }),
  };
}

const u8 = (s: unknown): Uint8Array => new Uint8Array(Buffer.from(s as string, 'base64'));
const all = (b: Uint8Array, v: number): boolean => b.every((x) => x === v);

describe('a same-uid process attacking a live segment (issue 19, point 3)', () => {
  it('cannot truncate it; mangling gives typed errors to the owner, readers and the transport; nobody crashes; grants are accounted for', async () => {
    const ownerName = uniqueOwner('shv');
    const owner = await drive('shm-owner.mjs', [ownerName, String(SLOT)]);
    const attacker = await drive('shm-attacker.mjs', []);
    const victim = owner.ready['victim'] as Record<string, string>;
    const honest = owner.ready['honest'] as Record<string, string>;
    const endpoint = u8(owner.ready['endpoint']);

    // The reader: a pool holding a zero-copy view of the victim, and an engine that reads both
    // slots through their registration grants and their range grants.
    const pool = new TensorPool({ owner: uniqueOwner('shr') });
    const reader = new TransferEngine({ nodeId: uniqueOwner('she'), transports: [new CudaIpcTransport()], logger: silentLogger, metrics: false });
    await reader.start();
    try {
      const view = pool.readSync(victim['id'] as string);
      expect(all(view.buffer as Uint8Array, 1)).toBe(true);
      const local = await reader.register({ kind: 'host', buffer: new Uint8Array(SLOT) });
      const dst = (local.memory as { buffer: Uint8Array }).buffer;
      const readVia = async (slot: Record<string, string>, how: 'registration' | 'grant'): Promise<Uint8Array> => {
        dst.fill(0);
        const remote = u8(slot[how]);
        await reader.read(endpoint, [how === 'grant' ? { local, remote, range: 0, length: SLOT } : { local, remote }]);
        return dst;
      };
      for (const how of ['registration', 'grant'] as const) expect(all(await readVia(victim, how), 1)).toBe(true);

      // 1. Truncate the memfd (to its header, as in the incident) and grow it: both refused.
      const t = await attacker.call('truncate-memfd', { name: victim['name'] });
      expect(t).toMatchObject({ ok: true, shrink: 'EPERM', grow: 'EPERM', size: 4096 + SLOT });
      // Every byte of the live view is still there (a SIGBUS here would kill this process).
      expect(all(view.buffer as Uint8Array, 1)).toBe(true);
      expect(await owner.call('write', { args: [victim['id'], 3] })).toMatchObject({ ok: true });
      expect(all(view.buffer as Uint8Array, 3)).toBe(true);
      expect(all(pool.snapshot(victim['id'] as string).data, 3)).toBe(true);
      for (const how of ['registration', 'grant'] as const) expect(all(await readVia(victim, how), 3)).toBe(true);

      // 2. Truncate the name (the locator file): a new reader gets a typed error; what is
      // already mapped keeps working, and so does the owner.
      expect(await attacker.call('truncate-name', { name: victim['name'] })).toMatchObject({ ok: true });
      const fresh = new TensorPool({ owner: uniqueOwner('shf') });
      expect(() => fresh.readSync(victim['id'] as string)).toThrow(InvalidInputError);
      expect(await owner.call('write', { args: [victim['id'], 4] })).toMatchObject({ ok: true });
      expect(all(view.buffer as Uint8Array, 4)).toBe(true);
      expect(all(await readVia(victim, 'grant'), 4)).toBe(true);

      // 3. Mangle the header: typed errors for the owner's write, the reader's copies and the
      // transport; the owner process stays up.
      expect(await attacker.call('mangle-header', { name: victim['name'] })).toMatchObject({ ok: true });
      expect(await owner.call('write', { args: [victim['id'], 5] })).toMatchObject({ ok: false, code: 'TW_INVALID_INPUT' });
      expect(() => pool.snapshot(victim['id'] as string)).toThrow(InvalidInputError);
      expect(view.isConsistent()).toBe(false);
      for (const how of ['registration', 'grant'] as const) {
        const err = await readVia(victim, how).then(
          () => undefined,
          (e: unknown) => e,
        );
        expect(err, how).toBeInstanceOf(TensorwireError);
      }
      // The view's bytes can still be read (they are what the owner last wrote).
      expect(all(view.buffer as Uint8Array, 4)).toBe(true);

      // 4. Forge the locator to point at a plain (truncatable) file of the attacker: refused
      // before anything is mapped.
      const forged = await attacker.call('forge-locator', { name: victim['name'] });
      expect(forged).toMatchObject({ ok: true });
      const fresh2 = new TensorPool({ owner: uniqueOwner('shg') });
      expect(() => fresh2.readSync(victim['id'] as string)).toThrow(/not a tmpfs memfd|not sealed/);
      rmSync(forged['path'] as string, { force: true });

      // Honest work on the other slot never stopped.
      expect(await owner.call('write', { args: [honest['id'], 9] })).toMatchObject({ ok: true });
      using hv = pool.readSync(honest['id'] as string);
      expect(all(hv.buffer as Uint8Array, 9)).toBe(true);
      for (const how of ['registration', 'grant'] as const) expect(all(await readVia(honest, how), 9)).toBe(true);

      // Accounting: every grant and registration revokes (nothing left inside them), no range
      // grant is left live and every record is free again (none retired by a stuck drain).
      expect(await owner.call('revokeAll')).toMatchObject({ ok: true, live: 0, unfreed: 0, tables: 1 });
      view.dispose();
      await fresh.close();
      await fresh2.close();
    } finally {
      await reader.close();
      await pool.close();
    }
    owner.proc.disconnect();
    attacker.proc.disconnect();
    // Both children end normally (a SIGBUS would show here as the signal).
    expect(await owner.exited).toEqual([0, null]);
    expect(await attacker.exited).toEqual([0, null]);
  });
});
