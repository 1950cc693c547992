import { fork, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

export const DIST_BUILT = existsSync(fileURLToPath(new URL('../dist/index.js', import.meta.url)));
if (!DIST_BUILT) console.warn('[cuda-ipc tests] dist/ is missing: run `npm run build -w @tensorwire/cuda-ipc`; cross-process tests will fail');

export interface RemoteError {
  code?: string;
  name?: string;
  message?: string;
}

export interface Child {
  readonly proc: ChildProcess;
  readonly pid: number;
  call<T = unknown>(op: string, ...args: unknown[]): Promise<T>;
  /** Resolves to the error the child reported (rejects if the call succeeded). */
  fail(op: string, ...args: unknown[]): Promise<RemoteError>;
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
}

const children = new Set<ChildProcess>();
export function killChildren(): void {
  for (const c of children) c.kill('SIGKILL');
  children.clear();
}

export function fixture(name: string): string {
  return fileURLToPath(new URL(`./fixtures/${name}`, import.meta.url));
}

/** Start a pool node (test/fixtures/node.mjs) owning `owner` in a child process. */
export async function spawnNode(owner: string, extra: string[] = []): Promise<Child> {
  const proc = fork(fixture('node.mjs'), [owner, ...extra], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  children.add(proc);
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    proc.once('exit', (code, signal) => {
      children.delete(proc);
      resolve({ code, signal });
    }),
  );
  const pending = new Map<number, { resolve: (v: unknown) => void; reject: (e: unknown) => void }>();
  let seq = 0;
  let ready: (pid: number) => void = () => undefined;
  const readyP = new Promise<number>((r) => (ready = r));
  proc.on('message', (m: { ready?: boolean; pid?: number; seq?: number; ok?: boolean; result?: unknown; error?: RemoteError }) => {
    if (m.ready) return ready(m.pid as number);
    const p = pending.get(m.seq as number);
    if (!p) return;
    pending.delete(m.seq as number);
    if (m.ok) p.resolve(m.result);
    else p.reject(Object.assign(new Error(m.error?.message), { remote: m.error }));
  });
  void exited.then(() => {
    for (const p of pending.values()) p.reject(new Error('child exited'));
  });
  const pid = await readyP;
  const call = <T>(op: string, ...args: unknown[]): Promise<T> =>
    new Promise<T>((resolve, reject) => {
      const s = ++seq;
      pending.set(s, { resolve: resolve as (v: unknown) => void, reject });
      proc.send({ seq: s, op, args });
    });
  return {
    proc,
    pid,
    call,
    async fail(op, ...args) {
      try {
        await call(op, ...args);
      } catch (e) {
        return (e as { remote: RemoteError }).remote;
      }
      throw new Error(`${op} succeeded but was expected to fail`);
    },
    exited,
  };
}

let counter = 0;
/** A unique owner name per test run, so parallel test files never collide. */
export function uniqueOwner(prefix: string): string {
  return `${prefix}-${process.pid}-${++counter}`;
}
