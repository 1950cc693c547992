/**
 * Hosts as Linux network namespaces joined by veth pairs, with 10.231.x.y addresses that
 * exist only inside the namespaces created here. Everything is removed by `destroy()` (also
 * registered for process exit, so a failing test leaves nothing behind).
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';

function run(args: string[]): { ok: boolean; out: string } {
  const r = spawnSync('ip', args, { encoding: 'utf8', timeout: 10_000 });
  return { ok: r.status === 0, out: `${r.stdout ?? ''}${r.stderr ?? ''}${r.error ? r.error.message : ''}` };
}

function must(args: string[]): void {
  const r = run(args);
  if (!r.ok) throw new Error(`ip ${args.join(' ')}: ${r.out.trim()}`);
}

/** Why namespaces cannot be created here, or undefined. */
export function netnsMissing(): string | undefined {
  if (process.platform !== 'linux') return `network namespaces need Linux (this is ${process.platform})`;
  const name = `twprobe${process.pid}`;
  const r = run(['netns', 'add', name]);
  if (!r.ok) return `cannot create a network namespace (needs root/CAP_SYS_ADMIN and iproute2): ${r.out.trim()}`;
  const v = run(['link', 'add', `tp${process.pid % 100000}a`, 'netns', name, 'type', 'veth', 'peer', 'name', `tp${process.pid % 100000}b`, 'netns', name]);
  run(['netns', 'del', name]);
  if (!v.ok) return `cannot create veth pairs: ${v.out.trim()}`;
  return undefined;
}

export interface Link {
  readonly a: string;
  readonly b: string;
  readonly devA: string;
  readonly devB: string;
  readonly addrA: string;
  readonly addrB: string;
}

export class Topology {
  readonly namespaces: string[] = [];
  readonly links: Link[] = [];
  readonly #tag = `tw${process.pid % 100000}`;
  readonly #subnetBase = ((process.pid % 80) * 3) + 1;
  #destroyed = false;
  readonly #onExit = (): void => this.destroySync();

  constructor() {
    process.once('exit', this.#onExit);
  }

  /** A host: a namespace with loopback up. */
  host(name: string): string {
    const ns = `${this.#tag}${name}`;
    must(['netns', 'add', ns]);
    this.namespaces.push(ns);
    must(['-n', ns, 'link', 'set', 'lo', 'up']);
    return ns;
  }

  /** A veth pair between two hosts on its own /24: a gets .1, b gets .2. */
  link(a: string, b: string, short: string): Link {
    const n = this.#subnetBase + this.links.length;
    const devA = `${short}a`;
    const devB = `${short}b`;
    must(['link', 'add', devA, 'netns', a, 'type', 'veth', 'peer', 'name', devB, 'netns', b]);
    const addrA = `10.231.${n}.1`;
    const addrB = `10.231.${n}.2`;
    must(['-n', a, 'addr', 'add', `${addrA}/24`, 'dev', devA]);
    must(['-n', b, 'addr', 'add', `${addrB}/24`, 'dev', devB]);
    must(['-n', a, 'link', 'set', devA, 'up']);
    must(['-n', b, 'link', 'set', devB, 'up']);
    const l = { a, b, devA, devB, addrA, addrB };
    this.links.push(l);
    return l;
  }

  setLink(l: Link, up: boolean): void {
    must(['-n', l.a, 'link', 'set', l.devA, up ? 'up' : 'down']);
    must(['-n', l.b, 'link', 'set', l.devB, up ? 'up' : 'down']);
  }

  /** Run a command inside a namespace. */
  exec(ns: string, cmd: string[]): { ok: boolean; out: string } {
    return run(['netns', 'exec', ns, ...cmd]);
  }

  destroySync(): void {
    if (this.#destroyed) return;
    this.#destroyed = true;
    process.removeListener('exit', this.#onExit);
    // Deleting a namespace deletes the veth ends in it (and so the pair).
    for (const ns of this.namespaces.reverse()) run(['netns', 'del', ns]);
  }
}

/** A node process inside a namespace, speaking JSON lines on stdout and taking commands on stdin. */
export class NsProcess {
  readonly proc: ChildProcess;
  readonly messages: Record<string, unknown>[] = [];
  stderr = '';
  readonly #waiters = new Set<() => void>();

  constructor(ns: string, script: string, config: unknown) {
    this.proc = spawn('ip', ['netns', 'exec', ns, process.execPath, script, JSON.stringify(config)], { stdio: ['pipe', 'pipe', 'pipe'] });
    createInterface({ input: this.proc.stdout! }).on('line', (line) => {
      try {
        this.messages.push(JSON.parse(line) as Record<string, unknown>);
      } catch {
        this.stderr += `stdout: ${line}\n`;
      }
      for (const w of [...this.#waiters]) w();
    });
    this.proc.stderr!.on('data', (d: Buffer) => {
      this.stderr = (this.stderr + d.toString()).slice(-8000);
    });
    this.proc.on('exit', () => {
      for (const w of [...this.#waiters]) w();
    });
  }

  get alive(): boolean {
    return this.proc.exitCode === null && this.proc.signalCode === null;
  }

  send(line: string): void {
    if (this.alive) this.proc.stdin!.write(`${line}\n`);
  }

  last(type: string): Record<string, unknown> | undefined {
    for (let i = this.messages.length - 1; i >= 0; i--) if (this.messages[i]?.['type'] === type) return this.messages[i];
    return undefined;
  }

  /** Wait for a message matching `pred` (checked on every new line), up to `timeoutMs`. */
  waitFor(pred: (m: Record<string, unknown>) => boolean, timeoutMs: number, what: string): Promise<Record<string, unknown>> {
    return new Promise((resolve, reject) => {
      const check = (): void => {
        const hit = this.messages.find(pred);
        if (hit) {
          done();
          resolve(hit);
        } else if (!this.alive) {
          done();
          reject(new Error(`${what}: process exited (${this.proc.exitCode ?? this.proc.signalCode}); stderr: ${this.stderr}`));
        }
      };
      const timer = setTimeout(() => {
        done();
        reject(new Error(`${what}: not seen within ${timeoutMs} ms; last: ${JSON.stringify(this.messages.at(-1))}; stderr: ${this.stderr}`));
      }, timeoutMs);
      const done = (): void => {
        clearTimeout(timer);
        this.#waiters.delete(check);
      };
      this.#waiters.add(check);
      check();
    });
  }

  async kill(signal: NodeJS.Signals = 'SIGKILL'): Promise<void> {
    if (!this.alive) return;
    const exited = new Promise<void>((r) => this.proc.once('exit', () => r()));
    this.proc.kill(signal);
    await exited;
  }
}
