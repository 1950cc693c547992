/**
 * Child processes for the cross-process tests: fork a fixture from `test/fixtures/`, wait for
 * one of its IPC messages, and SIGKILL whatever is still running after each test (call
 * `killChildrenAfterEach()` once at the top of a test file).
 */
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { afterEach } from 'vitest';

const children = new Set<ChildProcess>();

/** Register the after-each cleanup: every child forked by {@link forkFixture} that still runs is SIGKILLed. */
export function killChildrenAfterEach(): void {
  afterEach(() => {
    for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
    children.clear();
  });
}

/** Fork `test/fixtures/<fixture>` with an IPC channel, its output inherited, no exec flags. */
export function forkFixture(fixture: string, args: readonly string[]): ChildProcess {
  const child = fork(fileURLToPath(new URL(`./fixtures/${fixture}`, import.meta.url)), [...args], {
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    execArgv: [],
  });
  children.add(child);
  return child;
}

/** The child's next IPC message of this `type`; rejects if the child exits first. */
export function message<T>(child: ChildProcess, type: string): Promise<T> {
  return new Promise((resolve, reject) => {
    const onMessage = (m: { type?: string }): void => {
      if (m?.type !== type) return;
      cleanup();
      resolve(m as T);
    };
    const onExit = (code: number | null, signal: string | null): void => {
      cleanup();
      reject(new Error(`child exited (${signal ?? code}) before sending ${type}`));
    };
    const cleanup = (): void => {
      child.off('message', onMessage);
      child.off('exit', onExit);
    };
    child.on('message', onMessage);
    child.on('exit', onExit);
  });
}
