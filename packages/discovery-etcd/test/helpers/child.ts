/** A fixture run as a real child process that talks JSON lines on stdout and takes commands on stdin. */
import { spawn, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';

export class Child {
  readonly proc: ChildProcess;
  readonly messages: Record<string, unknown>[] = [];
  #stderr = '';
  #waiters: (() => void)[] = [];

  constructor(fixture: string, cfg: unknown) {
    const file = fileURLToPath(new URL(`../fixtures/${fixture}`, import.meta.url));
    this.proc = spawn(process.execPath, [file, JSON.stringify(cfg)], { stdio: ['pipe', 'pipe', 'pipe'] });
    createInterface({ input: this.proc.stdout as NodeJS.ReadableStream }).on('line', (line) => {
      try {
        this.messages.push(JSON.parse(line) as Record<string, unknown>);
      } catch {
        this.#stderr += `(stdout) ${line}\n`;
      }
      for (const w of this.#waiters.splice(0)) w();
    });
    this.proc.stderr?.on('data', (d: Buffer) => (this.#stderr += d.toString()));
    this.proc.once('exit', () => {
      for (const w of this.#waiters.splice(0)) w();
    });
  }

  get exited(): boolean {
    return this.proc.exitCode !== null || this.proc.signalCode !== null;
  }

  /** The first message (after `from`) that has `field`; rejects if the child exits first or after `timeoutMs`. */
  async next(field: string, timeoutMs = 20_000, from = 0): Promise<Record<string, unknown>> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const m = this.messages.slice(from).find((x) => field in x);
      if (m) return m;
      if (this.exited) throw new Error(`child exited (${this.proc.exitCode ?? this.proc.signalCode}) before "${field}": ${this.#stderr.slice(-2000)}`);
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`no "${field}" from the child within ${timeoutMs} ms: ${this.#stderr.slice(-2000)}`);
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, left);
        this.#waiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
  }

  send(line: string): void {
    this.proc.stdin?.write(`${line}\n`);
  }

  /** SIGKILL (a crash), and wait for the exit. Idempotent. */
  async kill(): Promise<void> {
    if (this.exited) return;
    const exited = new Promise<void>((r) => this.proc.once('exit', () => r()));
    this.proc.kill('SIGKILL');
    await exited;
  }
}
