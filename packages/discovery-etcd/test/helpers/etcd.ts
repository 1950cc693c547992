/**
 * A real etcd for tests: `etcd` (Debian `etcd-server`) started on a free port with a
 * temporary data directory, optionally inside a network namespace, stopped and removed after.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Etcd3 } from 'etcd3';

/** Why etcd cannot run here, or undefined. */
export function etcdMissing(): string | undefined {
  const r = spawnSync('etcd', ['--version'], { encoding: 'utf8' });
  if (r.error || r.status !== 0) return `etcd is not installed (apt-get install etcd-server): ${r.error?.message ?? r.stderr}`;
  return undefined;
}

export async function freePort(host = '127.0.0.1'): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, host, () => {
      const port = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

export interface EtcdOptions {
  /** Address(es) etcd listens on for clients; the first is advertised. Default 127.0.0.1. */
  readonly hosts?: readonly string[];
  readonly port?: number;
  readonly peerPort?: number;
  /** Run inside this network namespace. */
  readonly netns?: string;
}

export class TestEtcd {
  readonly dataDir: string;
  readonly hosts: readonly string[];
  readonly netns: string | undefined;
  port = 0;
  peerPort = 0;
  #proc: ChildProcess | undefined;
  #log = '';

  constructor(options: EtcdOptions = {}) {
    this.dataDir = mkdtempSync(join(tmpdir(), 'tw-etcd-'));
    this.hosts = options.hosts ?? ['127.0.0.1'];
    this.netns = options.netns;
    this.port = options.port ?? 0;
    this.peerPort = options.peerPort ?? 0;
  }

  url(host = this.hosts[0] as string): string {
    return `etcd://${host}:${this.port}`;
  }

  get running(): boolean {
    return this.#proc !== undefined && this.#proc.exitCode === null && this.#proc.signalCode === null;
  }

  get log(): string {
    return this.#log.slice(-4000);
  }

  async start(): Promise<void> {
    if (this.running) return;
    if (this.port === 0) this.port = this.netns ? 23790 : await freePort();
    if (this.peerPort === 0) this.peerPort = this.netns ? 23800 : await freePort();
    const h = this.hosts[0] as string;
    const args = [
      '--name', 'tw',
      '--data-dir', this.dataDir,
      '--listen-client-urls', this.hosts.map((x) => `http://${x}:${this.port}`).join(','),
      '--advertise-client-urls', `http://${h}:${this.port}`,
      '--listen-peer-urls', `http://${h}:${this.peerPort}`,
      '--initial-advertise-peer-urls', `http://${h}:${this.peerPort}`,
      '--initial-cluster', `tw=http://${h}:${this.peerPort}`,
      '--log-level', 'error',
    ];
    const cmd = this.netns ? 'ip' : 'etcd';
    const full = this.netns ? ['netns', 'exec', this.netns, 'etcd', ...args] : args;
    const proc = spawn(cmd, full, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ETCD_UNSUPPORTED_ARCH: process.arch === 'arm64' ? 'arm64' : '' } });
    this.#proc = proc;
    proc.stdout?.on('data', (d: Buffer) => (this.#log += d.toString()));
    proc.stderr?.on('data', (d: Buffer) => (this.#log += d.toString()));
    await this.#ready();
  }

  async #ready(): Promise<void> {
    const deadline = Date.now() + 30_000;
    const probeHost = this.netns ? undefined : this.hosts[0];
    while (Date.now() < deadline) {
      if (!this.running) throw new Error(`etcd exited: ${this.log}`);
      if (probeHost === undefined) {
        // Inside a namespace: probe through `ip netns exec`.
        const r = spawnSync('ip', ['netns', 'exec', this.netns as string, 'bash', '-c', `exec 3<>/dev/tcp/${this.hosts[0]}/${this.port}`], { timeout: 2000 });
        if (r.status === 0) return this.#settle();
      } else {
        const client = new Etcd3({ hosts: `http://${probeHost}:${this.port}`, defaultCallOptions: () => ({ deadline: Date.now() + 1000 }) });
        try {
          await client.get('probe');
          return;
        } catch {
          // not yet
        } finally {
          client.close();
        }
      }
      await new Promise((r) => setTimeout(r, 200));
    }
    throw new Error(`etcd did not become ready: ${this.log}`);
  }

  async #settle(): Promise<void> {
    await new Promise((r) => setTimeout(r, 500)); // listening; give the raft leader a moment
  }

  /** Stop the process (SIGTERM, then SIGKILL); the data directory stays for a restart. */
  async stop(signal: NodeJS.Signals = 'SIGTERM'): Promise<void> {
    const p = this.#proc;
    if (!p || !this.running) return;
    const exited = new Promise<void>((r) => p.once('exit', () => r()));
    p.kill(signal);
    const t = setTimeout(() => p.kill('SIGKILL'), 5000);
    await exited;
    clearTimeout(t);
  }

  /** Stop and delete the data directory. Idempotent. */
  async destroy(): Promise<void> {
    await this.stop('SIGKILL').catch(() => undefined);
    rmSync(this.dataDir, { recursive: true, force: true });
  }
}
