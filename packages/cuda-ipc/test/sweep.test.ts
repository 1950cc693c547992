import { fork, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { existsSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { poolSegmentName, sweep } from '../src/index.js';
import { fixture, killChildren, spawnNode, uniqueOwner } from './helpers.js';

afterAll(killChildren);

const shmPath = (name: string): string => `/dev/shm${name}`;

describe('sweep() after a SIGKILLed owner', () => {
  it("removes a dead owner's segments and keeps live owners' segments", async () => {
    const dead = await spawnNode(uniqueOwner('dead'));
    const live = await spawnNode(uniqueOwner('live'));
    const ids = [await dead.call<string>('register', { byteLength: 1024 }), await dead.call<string>('register', { dtype: 'float32', shape: [4, 4] })];
    const liveId = await live.call<string>('register', { byteLength: 64 });
    for (const id of ids) expect(existsSync(shmPath(poolSegmentName(id)))).toBe(true);

    dead.proc.kill('SIGKILL');
    const { signal } = await dead.exited;
    expect(signal).toBe('SIGKILL');
    // SIGKILL runs no exit hook: the segments are still there.
    for (const id of ids) expect(existsSync(shmPath(poolSegmentName(id)))).toBe(true);

    const report = sweep();
    for (const id of ids) {
      expect(report.removed).toContain(poolSegmentName(id));
      expect(existsSync(shmPath(poolSegmentName(id)))).toBe(false);
    }
    expect(report.removed).not.toContain(poolSegmentName(liveId));
    expect(existsSync(shmPath(poolSegmentName(liveId)))).toBe(true);

    // A clean exit unlinks its segments itself.
    await live.call('close');
    expect(existsSync(shmPath(poolSegmentName(liveId)))).toBe(false);
  });

  it('a normal exit (no close) unlinks the segments through the exit hook', async () => {
    const n = await spawnNode(uniqueOwner('exit'));
    const id = await n.call<string>('register', { byteLength: 128 });
    expect(existsSync(shmPath(poolSegmentName(id)))).toBe(true);
    n.proc.disconnect();
    await n.exited;
    expect(existsSync(shmPath(poolSegmentName(id)))).toBe(false);
  });
});

describe("the transport's listening socket file", () => {
  const forked: ChildProcess[] = [];
  afterAll(() => {
    // SIGTERM: the exit hook unlinks what a child left if a test failed half-way.
    for (const p of forked) if (p.exitCode === null && p.signalCode === null) p.kill('SIGTERM');
  });
  async function start(nodeId: string): Promise<{ proc: ChildProcess; socket: string; exited: Promise<[number | null, NodeJS.Signals | null]> }> {
    const proc = fork(fixture('socket-node.mjs'), [nodeId], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    forked.push(proc);
    const exited = once(proc, 'exit') as Promise<[number | null, NodeJS.Signals | null]>;
    const [{ sockets }] = (await once(proc, 'message')) as [{ sockets: string[] }];
    expect(sockets).toHaveLength(1);
    return { proc, socket: sockets[0] as string, exited };
  }

  it("sweep() removes a SIGKILLed transport's socket file and keeps a live one's", async () => {
    const dead = await start(`sockdead${process.pid}`);
    const live = await start(`socklive${process.pid}`);
    expect(existsSync(dead.socket)).toBe(true);
    dead.proc.kill('SIGKILL');
    const [, signal] = await dead.exited;
    expect(signal).toBe('SIGKILL');
    // SIGKILL runs no exit hook: the file is still there.
    expect(existsSync(dead.socket)).toBe(true);
    // A socket of a name sweep() does not own (no pid in it) is never touched.
    const foreign = join(tmpdir(), `tw-${process.pid}-not-a-transport.sock`);
    const server = createServer();
    await new Promise<void>((resolve) => server.listen(foreign, resolve));
    try {
      const report = sweep();
      expect(report.removedSockets).toContain(dead.socket);
      expect(report.removedSockets).not.toContain(live.socket);
      expect(existsSync(dead.socket)).toBe(false);
      expect(existsSync(live.socket)).toBe(true);
      expect(existsSync(foreign)).toBe(true);
    } finally {
      await new Promise<void>((resolve) => server.close(() => resolve()));
    }
    live.proc.send({ op: 'close' });
    const [closed] = (await once(live.proc, 'message')) as [{ closed: boolean; sockets: string[] }];
    expect(closed.sockets).toEqual([]);
    expect(existsSync(live.socket)).toBe(false);
    live.proc.disconnect();
    await live.exited;
  });

  it('a process that exits without closing its engine unlinks the file in the exit hook', async () => {
    const n = await start(`sockexit${process.pid}`);
    expect(existsSync(n.socket)).toBe(true);
    n.proc.send({ op: 'exit' });
    const [code] = await n.exited;
    expect(code).toBe(0);
    expect(existsSync(n.socket)).toBe(false);
  });
});

describe('signals without an application handler (exit cleanup)', () => {
  async function start(mode: 'none' | 'own-handler'): Promise<{ proc: ChildProcess; name: string; exited: Promise<[number | null, NodeJS.Signals | null]> }> {
    const proc = fork(fixture('signal.mjs'), [uniqueOwner('sig'), mode], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    const exited = once(proc, 'exit') as Promise<[number | null, NodeJS.Signals | null]>;
    const [{ name }] = (await once(proc, 'message')) as [{ name: string }];
    return { proc, name, exited };
  }

  it('SIGTERM with no handler of its own: segments are unlinked and the process still dies of SIGTERM', async () => {
    const { proc, name, exited } = await start('none');
    expect(existsSync(shmPath(name))).toBe(true);
    proc.kill('SIGTERM');
    const [, signal] = await exited;
    expect(signal).toBe('SIGTERM');
    expect(existsSync(shmPath(name))).toBe(false);
  });

  it("an application's own SIGTERM handler keeps its semantics: the process lives on and its segments stay", async () => {
    const { proc, name, exited } = await start('own-handler');
    proc.kill('SIGTERM');
    const [{ handled }] = (await once(proc, 'message')) as [{ handled: string }];
    expect(handled).toBe('SIGTERM');
    expect(proc.exitCode).toBe(null);
    expect(existsSync(shmPath(name))).toBe(true);
    proc.disconnect();
    proc.kill('SIGINT'); // no app handler for SIGINT: cleaned up, dies of SIGINT
    const [, signal] = await exited;
    expect(signal).toBe('SIGINT');
    expect(existsSync(shmPath(name))).toBe(false);
  });
});
