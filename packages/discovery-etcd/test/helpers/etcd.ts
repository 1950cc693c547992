/**
 * A real etcd for tests: `etcd` (Debian `etcd-server`) started on a free port with a
 * temporary data directory, optionally inside a network namespace, stopped and removed after.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Etcd3, Range } from 'etcd3';

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
  /** Serve clients over TLS with these files, requiring client certificates signed by `ca`. */
  readonly tls?: { readonly ca: string; readonly cert: string; readonly key: string };
}

export class TestEtcd {
  readonly dataDir: string;
  readonly hosts: readonly string[];
  readonly netns: string | undefined;
  readonly tls: EtcdOptions['tls'];
  port = 0;
  peerPort = 0;
  #proc: ChildProcess | undefined;
  #log = '';

  constructor(options: EtcdOptions = {}) {
    this.dataDir = mkdtempSync(join(tmpdir(), 'tw-etcd-'));
    this.hosts = options.hosts ?? ['127.0.0.1'];
    this.netns = options.netns;
    this.tls = options.tls;
    this.port = options.port ?? 0;
    this.peerPort = options.peerPort ?? 0;
  }

  url(host = this.hosts[0] as string): string {
    return `${this.tls ? 'etcds' : 'etcd'}://${host}:${this.port}`;
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
    const scheme = this.tls ? 'https' : 'http';
    const args = [
      '--name', 'tw',
      '--data-dir', this.dataDir,
      '--listen-client-urls', this.hosts.map((x) => `${scheme}://${x}:${this.port}`).join(','),
      '--advertise-client-urls', `${scheme}://${h}:${this.port}`,
      ...(this.tls ? ['--cert-file', this.tls.cert, '--key-file', this.tls.key, '--trusted-ca-file', this.tls.ca, '--client-cert-auth'] : []),
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
    const probeHost = this.netns || this.tls ? undefined : this.hosts[0];
    while (Date.now() < deadline) {
      if (!this.running) throw new Error(`etcd exited: ${this.log}`);
      if (probeHost === undefined) {
        // Inside a namespace: probe through `ip netns exec`.
        const probe = ['bash', '-c', `exec 3<>/dev/tcp/${this.hosts[0]}/${this.port}`];
        const r = this.netns ? spawnSync('ip', ['netns', 'exec', this.netns, ...probe], { timeout: 2000 }) : spawnSync(probe[0] as string, probe.slice(1), { timeout: 2000 });
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

/**
 * Write `value` as an owned record the way a publisher creates one: the record key and its
 * owner anchor in one transaction under `leaseId` (a stand-in for a node that then crashed).
 */
export async function writeOwnedRecord(client: Etcd3, prefix: string, nodeId: string, value: Uint8Array, leaseId: string): Promise<void> {
  const nodeKey = `${prefix}nodes/${nodeId}`;
  const ownerKey = `${prefix}owners/${nodeId}`;
  const r = await client
    .if(nodeKey, 'Create', '==', 0)
    .and(ownerKey, 'Create', '==', 0)
    .then(client.put(ownerKey).value(leaseId).lease(leaseId), client.put(nodeKey).value(Buffer.from(value)).lease(leaseId))
    .commit();
  if (!r.succeeded) throw new Error(`keys of ${nodeId} exist already`);
}

export interface TestPki {
  readonly dir: string;
  readonly ca: string;
  /** Server certificate and key for 127.0.0.1/localhost. */
  readonly server: { readonly cert: string; readonly key: string };
  /** A client certificate (CN = name) and key, signed by the CA. */
  client(name: string): { readonly cert: string; readonly key: string };
  /** A CA that signed nothing here (for a client that must not trust the server). */
  readonly otherCa: string;
  destroy(): void;
}

/** Why openssl cannot make test certificates, or undefined. */
export function opensslMissing(): string | undefined {
  const r = spawnSync('openssl', ['version'], { encoding: 'utf8' });
  if (r.error || r.status !== 0) return `openssl is not installed: ${r.error?.message ?? r.stderr}`;
  return undefined;
}

function openssl(args: string[], cwd: string): void {
  const r = spawnSync('openssl', args, { cwd, encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`openssl ${args.join(' ')} failed: ${r.stderr}`);
}

/** A throwaway CA, a server certificate and client certificates (EC P-256), in a temporary folder. */
export function makePki(clients: readonly string[]): TestPki {
  const dir = mkdtempSync(join(tmpdir(), 'tw-pki-'));
  const key = (name: string): void => openssl(['ecparam', '-name', 'prime256v1', '-genkey', '-noout', '-out', `${name}.key`], dir);
  const ca = (name: string): void => {
    key(name);
    openssl(['req', '-x509', '-new', '-key', `${name}.key`, '-subj', `/CN=${name}`, '-days', '2', '-out', `${name}.crt`], dir);
  };
  const leaf = (name: string, ext: string): void => {
    key(name);
    openssl(['req', '-new', '-key', `${name}.key`, '-subj', `/CN=${name}`, '-out', `${name}.csr`], dir);
    writeFileSync(join(dir, `${name}.ext`), ext);
    openssl(['x509', '-req', '-in', `${name}.csr`, '-CA', 'tw-test-ca.crt', '-CAkey', 'tw-test-ca.key', '-CAcreateserial', '-days', '2', '-extfile', `${name}.ext`, '-out', `${name}.crt`], dir);
  };
  ca('tw-test-ca');
  ca('tw-other-ca');
  leaf('etcd-server', 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n');
  for (const c of clients) leaf(c, 'extendedKeyUsage=clientAuth\n');
  const p = (f: string): string => join(dir, f);
  return {
    dir,
    ca: p('tw-test-ca.crt'),
    otherCa: p('tw-other-ca.crt'),
    server: { cert: p('etcd-server.crt'), key: p('etcd-server.key') },
    client: (name) => ({ cert: p(`${name}.crt`), key: p(`${name}.key`) }),
    destroy: () => rmSync(dir, { recursive: true, force: true }),
  };
}

/**
 * The role layout of the README: a `root` user; one user and one role per node, the role
 * allowed to write exactly that node's two keys and to read the cluster's prefix. Then
 * etcd auth is enabled. `admin` must be a root-capable client (before auth is on, any client).
 */
export async function enableAuth(admin: Etcd3, prefix: string, rootPassword: string, nodes: readonly string[], password = (n: string) => `pw-${n}`): Promise<void> {
  await admin.role('root').create();
  await admin.user('root').create(rootPassword);
  await admin.user('root').addRole('root');
  for (const n of nodes) {
    const role = admin.role(`tw-node-${n}`);
    await role.create();
    await role.grant({ permission: 'Read', range: Range.prefix(prefix) });
    await role.grant({ permission: 'Readwrite', key: `${prefix}nodes/${n}` });
    await role.grant({ permission: 'Readwrite', key: `${prefix}owners/${n}` });
    await admin.user(n).create(password(n));
    await admin.user(n).addRole(role);
  }
  await admin.auth.authEnable();
}
