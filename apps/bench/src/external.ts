/**
 * `--compare`: external tools as peers in the same table. Each runs its own server and
 * client on loopback, on the same block size. A tool that is not installed is reported as
 * such in the notes, never silently left out.
 */
import { spawn, spawnSync } from 'node:child_process';
import net from 'node:net';
import type { Measurement } from './types.js';

export interface ExternalOutcome {
  readonly measurements: Measurement[];
  readonly notes: string[];
}

function installed(cmd: string): boolean {
  return spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

function run(cmd: string, args: string[], env: NodeJS.ProcessEnv, timeoutMs: number): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(cmd, args, { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
    child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    const t = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    child.on('close', (code) => {
      clearTimeout(t);
      resolve({ code, stdout, stderr });
    });
  });
}

async function withServer<T>(cmd: string, args: string[], env: NodeJS.ProcessEnv, body: () => Promise<T>): Promise<T> {
  const server = spawn(cmd, args, { env: { ...process.env, ...env }, stdio: 'ignore' });
  try {
    await new Promise((r) => setTimeout(r, 700));
    return await body();
  } finally {
    server.kill('SIGKILL');
  }
}

/** iperf3, one stream, loopback: `bytes` in writes of `blockBytes`. */
export async function iperf3(blockBytes: number, bytes: number): Promise<ExternalOutcome> {
  if (!installed('iperf3')) return { measurements: [], notes: ['iperf3 is not installed (Debian: iperf3); no iperf3 figure'] };
  const port = await freePort();
  return withServer('iperf3', ['-s', '-1', '-p', String(port), '-B', '127.0.0.1'], {}, async () => {
    const len = Math.min(blockBytes, 1024 * 1024); // iperf3's largest write
    const r = await run('iperf3', ['-c', '127.0.0.1', '-p', String(port), '-n', String(bytes), '-l', String(len), '-J'], {}, 60_000);
    try {
      const j = JSON.parse(r.stdout) as { end?: { sum_received?: { bits_per_second?: number } }; error?: string };
      const bps = j.end?.sum_received?.bits_per_second;
      if (!bps) return { measurements: [], notes: [`iperf3 gave no result: ${j.error ?? r.stderr.trim()}`] };
      return { measurements: [{ name: 'iperf3 single stream', role: 'external', blockBytes, totalBytes: bytes, gbps: bps / 8 / 1e9 }], notes: [] };
    } catch {
      return { measurements: [], notes: [`iperf3 output was not JSON: ${r.stderr.trim().slice(0, 200)}`] };
    }
  });
}

/** The UCX transports `ucxPerftest` can run over. */
export type UcxTransport = 'tcp' | 'posix';

/** Display names of the UCX rows, by transport. */
export const UCX_NAMES: Record<UcxTransport, string> = { tcp: 'UCX ucp_get over tcp', posix: 'UCX ucp_get over posix shm' };

/** Warm-up iterations `ucxPerftest` asks for (`-w`), for callers that measure the same shape. */
export function ucxWarmup(iterations: number): number {
  return Math.max(2, Math.floor(iterations / 10));
}

/**
 * ucx_perftest ucp_get (one-sided READ) over UCX's tcp and posix shared-memory transports
 * (`only` picks some). How ucx_perftest measures it (UCX 1.13, src/tools/perf/lib/ucp_tests.cc,
 * run_stream_uni): the client posts `ucp_get_nbx` of `blockBytes` from the same remote address
 * into the same local buffer `iterations` times; ucp_get's window (`-O`, max outstanding) is 1
 * by default, so each get waits for the one before; the figure is the overall bandwidth
 * (MB = 2^20) over the timed iterations, after `-w` warm-up iterations. `-O 1` is passed
 * explicitly so the shape is pinned.
 */
export async function ucxPerftest(blockBytes: number, iterations: number, only: readonly UcxTransport[] = ['tcp', 'posix']): Promise<ExternalOutcome> {
  if (!installed('ucx_perftest')) return { measurements: [], notes: ['ucx_perftest is not installed (Debian: ucx-utils); no UCX figures'] };
  const measurements: Measurement[] = [];
  const notes: string[] = [];
  for (const t of only) {
    const tls = t === 'tcp' ? 'tcp' : 'posix,self';
    const label = UCX_NAMES[t];
    const port = await freePort();
    const env = { UCX_TLS: tls };
    const r = await withServer('ucx_perftest', ['-p', String(port)], env, () =>
      run('ucx_perftest', ['127.0.0.1', '-p', String(port), '-t', 'ucp_get', '-s', String(blockBytes), '-n', String(iterations), '-w', String(ucxWarmup(iterations)), '-O', '1'], env, 90_000),
    );
    const final = r.stdout.split('\n').find((l) => l.trim().startsWith('Final:'));
    const nums = final?.trim().split(/\s+/).slice(1).map(Number);
    // Final: iterations p50 avg overall-lat bw-avg bw-overall(MB/s, MB = 2^20) rate-avg rate-overall
    const mbps = nums?.[5];
    if (mbps === undefined || !Number.isFinite(mbps)) {
      notes.push(`${label}: no result (${(r.stderr || r.stdout).trim().split('\n').pop() ?? 'no output'})`);
      continue;
    }
    measurements.push({ name: label, role: 'external', blockBytes, totalBytes: blockBytes * iterations, gbps: (mbps * 1048576) / 1e9, extra: { p50LatencyUs: nums?.[1] ?? 0, iterations, window: 1 } });
  }
  return { measurements, notes };
}
