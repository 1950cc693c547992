/**
 * Child processes for scenarios. Every child is tracked and killed when the parent exits,
 * is interrupted, or the scenario is aborted, so no error path leaves an orphan. Children
 * talk to the parent over the IPC channel with JSON messages.
 */
import { fork, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { BenchError } from './types.js';

const live = new Set<ChildProcess>();
let hooked = false;

function killAll(): void {
  for (const c of live) {
    try {
      c.kill('SIGKILL');
    } catch {
      // already gone
    }
  }
  live.clear();
}

function hookExit(): void {
  if (hooked) return;
  hooked = true;
  process.on('exit', killAll);
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    process.on(sig, () => {
      killAll();
      process.exit(sig === 'SIGINT' ? 130 : 143);
    });
  }
}

/**
 * The flags that fork worker `name` under V8's CPU profiler, when the environment asks for it:
 * `TENSORWIRE_BENCH_CPU_PROF=kv-requester,kv-holder` (worker names, comma-separated, or `all`)
 * writes one `.cpuprofile` per such worker process into `TENSORWIRE_BENCH_CPU_PROF_DIR`
 * (default `<tmpdir>/tensorwire-bench-prof`), sampled every 100 µs. `--cpu-prof` is refused in
 * NODE_OPTIONS, so a worker's profile needs its own flags. Figures taken with it are slower.
 */
export function profilerArgs(name: string, env: NodeJS.ProcessEnv = process.env): string[] {
  const want = env['TENSORWIRE_BENCH_CPU_PROF'];
  if (want === undefined || want === '') return [];
  const names = want.split(',').map((x) => x.trim());
  if (!names.includes(name) && !names.includes('all')) return [];
  const dir = env['TENSORWIRE_BENCH_CPU_PROF_DIR'] || join(tmpdir(), 'tensorwire-bench-prof');
  return ['--cpu-prof', `--cpu-prof-dir=${dir}`, '--cpu-prof-interval=100'];
}

/** Absolute path of a compiled worker script in dist/workers. */
export function workerPath(name: string): string {
  return fileURLToPath(new URL(`./workers/${name}.js`, import.meta.url));
}

export interface Worker {
  readonly child: ChildProcess;
  readonly pid: number;
  /** Send a message. */
  send(message: unknown): void;
  /** Wait for the next message satisfying `match`; rejects if the child exits first or the signal fires. */
  next<T = Record<string, unknown>>(match: (m: Record<string, unknown>) => boolean, signal?: AbortSignal): Promise<T>;
  /** SIGKILL it (idempotent). */
  kill(): void;
  /** Wait for it to exit. */
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
}

/** Fork dist/workers/<name>.js with args; tracked for cleanup. */
export function spawnWorker(name: string, args: readonly string[] = [], env: NodeJS.ProcessEnv = {}): Worker {
  hookExit();
  const profile = profilerArgs(name);
  const child = fork(workerPath(name), [...args], {
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    env: { ...process.env, ...env },
    serialization: 'advanced',
    ...(profile.length > 0 ? { execArgv: [...process.execArgv, ...profile] } : {}),
  });
  live.add(child);
  const inbox: Record<string, unknown>[] = [];
  const waiters: { match: (m: Record<string, unknown>) => boolean; resolve: (m: Record<string, unknown>) => void; reject: (e: Error) => void }[] = [];
  let exitInfo: { code: number | null; signal: NodeJS.Signals | null } | undefined;
  const exited = once(child, 'exit').then(([code, signal]) => {
    live.delete(child);
    exitInfo = { code: code as number | null, signal: signal as NodeJS.Signals | null };
    for (const w of waiters.splice(0)) {
      w.reject(new BenchError(`worker ${name} exited (${exitInfo.signal ?? `code ${exitInfo.code}`}) before answering`));
    }
    return exitInfo;
  });
  child.on('message', (m: unknown) => {
    if (typeof m !== 'object' || m === null) return;
    const msg = m as Record<string, unknown>;
    const i = waiters.findIndex((w) => w.match(msg));
    if (i >= 0) {
      const [w] = waiters.splice(i, 1);
      w?.resolve(msg);
    } else inbox.push(msg);
  });
  child.on('error', () => {
    // surfaced through 'exit'
  });
  return {
    child,
    pid: child.pid ?? -1,
    send(message) {
      if (child.connected) child.send(message as never);
    },
    next<T>(match: (m: Record<string, unknown>) => boolean, signal?: AbortSignal): Promise<T> {
      const i = inbox.findIndex(match);
      if (i >= 0) return Promise.resolve(inbox.splice(i, 1)[0] as T);
      if (exitInfo) return Promise.reject(new BenchError(`worker ${name} has exited`));
      return new Promise<T>((resolve, reject) => {
        const onAbort = (): void => {
          const j = waiters.indexOf(w);
          if (j >= 0) waiters.splice(j, 1);
          reject(new BenchError('aborted'));
        };
        const w = {
          match,
          resolve: (m: Record<string, unknown>) => {
            signal?.removeEventListener('abort', onAbort);
            resolve(m as T);
          },
          reject: (e: Error) => {
            signal?.removeEventListener('abort', onAbort);
            reject(e);
          },
        };
        waiters.push(w);
        signal?.addEventListener('abort', onAbort, { once: true });
      });
    },
    kill() {
      if (exitInfo === undefined) child.kill('SIGKILL');
    },
    exited,
  };
}

/** Kill every worker still alive (used on error paths). */
export function killAllWorkers(): void {
  killAll();
}

/**
 * In a worker: send a message to the parent, and exit when the parent goes away so a
 * SIGKILLed parent never leaves this process behind.
 */
export function workerInit(): { send(message: unknown): void; sent(message: unknown): Promise<void>; onMessage(listener: (m: Record<string, unknown>) => void): void } {
  process.on('disconnect', () => process.exit(0));
  return {
    send(message) {
      process.send?.(message as never);
    },
    /**
     * Send and wait until the message is written to the channel: a worker that disconnects (and
     * so exits) right after a send larger than the pipe's buffer would otherwise lose it.
     */
    sent(message) {
      return new Promise<void>((resolve) => {
        if (!process.send) resolve();
        else process.send(message as never, undefined, undefined, () => resolve());
      });
    },
    onMessage(listener) {
      process.on('message', (m: unknown) => {
        if (typeof m === 'object' && m !== null) listener(m as Record<string, unknown>);
      });
    },
  };
}
