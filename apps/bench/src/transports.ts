/**
 * Which transports the bench's engines are built with. A holder serves through every transport
 * it can (the same-host `cuda-ipc` transport of @tensorwire/cuda-ipc and the engine's TCP
 * transport); a requester registers the ones `--transport` allows, and the engine chooses
 * among them per peer (it says which and why in `explain()`).
 */
import { TcpTransport, type TcpTransportOptions, type Transport } from '@tensorwire/core';
import { CudaIpcTransport, capabilities } from '@tensorwire/cuda-ipc';
import { BenchError } from './types.js';

export const TRANSPORT_CHOICES = ['auto', 'tcp', 'cuda-ipc'] as const;
/** `auto`: every transport this process can build, the engine chooses; otherwise only that one. */
export type TransportChoice = (typeof TRANSPORT_CHOICES)[number];

export function isTransportChoice(text: unknown): text is TransportChoice {
  return typeof text === 'string' && (TRANSPORT_CHOICES as readonly string[]).includes(text);
}

/** The environment variable `--copy-threads` sets for this process and the workers it forks (a user may set it too). */
export const COPY_THREADS_ENV = 'TENSORWIRE_BENCH_COPY_THREADS';

/**
 * The same-host transport's `copyThreads` from `--copy-threads` (or {@link COPY_THREADS_ENV}),
 * undefined for the library default. Throws BenchError naming the variable for a bad value.
 */
export function copyThreadsSetting(env: NodeJS.ProcessEnv = process.env): number | undefined {
  const raw = env[COPY_THREADS_ENV];
  if (raw === undefined) return undefined;
  const n = Number(raw);
  if (!/^\d+$/.test(raw.trim()) || !Number.isSafeInteger(n) || n < 1 || n > 16) {
    throw new BenchError(`--copy-threads (${COPY_THREADS_ENV}) ${JSON.stringify(raw)} must be an integer from 1 to 16`);
  }
  return n;
}

/** The same-host transport as the bench builds it: `copyThreads` from `--copy-threads`, else the library default. */
function sameHostTransport(): CudaIpcTransport {
  const n = copyThreadsSetting();
  return n === undefined ? new CudaIpcTransport() : new CudaIpcTransport({ copyThreads: n });
}

/** What the notes say about the same-host transport's copy threads. */
function copyThreadsNote(t: CudaIpcTransport): string {
  const how = copyThreadsSetting() === undefined ? "the library default: half this process's available cores, 1 to 4" : `--copy-threads, ${COPY_THREADS_ENV}`;
  return `cuda-ipc copies host batches of 1 MiB and more on up to ${t.copyThreads} thread(s) (${how})`;
}

/** Why the same-host transport cannot be built in this process, or undefined when it can. */
export function sameHostUnavailable(): string | undefined {
  const caps = capabilities();
  return caps.sharedMemory.available ? undefined : (caps.sharedMemory.reason ?? 'shared memory unavailable');
}

/**
 * Transports for a holder: cuda-ipc (when this machine can build it) and TCP. `notes` says
 * what was left out and why.
 */
export function holderTransports(tcp: TcpTransportOptions = {}): { transports: Transport[]; notes: string[] } {
  const why = sameHostUnavailable();
  const transports: Transport[] = [];
  if (why === undefined) transports.push(sameHostTransport());
  transports.push(new TcpTransport(tcp));
  return { transports, notes: why === undefined ? [] : [`holder serves TCP only: the same-host transport is unavailable (${why})`] };
}

/**
 * Transports for a requester engine under `choice`. `auto` registers cuda-ipc (when it can be
 * built here) and TCP and lets the engine choose; `tcp` / `cuda-ipc` registers only that one.
 * Throws BenchError when `cuda-ipc` is asked for and cannot be built.
 */
export function requesterTransports(choice: TransportChoice, tcp: TcpTransportOptions = {}): { transports: Transport[]; notes: string[] } {
  const why = sameHostUnavailable();
  if (choice === 'cuda-ipc') {
    if (why !== undefined) throw new BenchError(`--transport cuda-ipc: the same-host transport is unavailable here (${why})`);
    const t = sameHostTransport();
    return { transports: [t], notes: [copyThreadsNote(t)] };
  }
  if (choice === 'tcp') return { transports: [new TcpTransport(tcp)], notes: [] };
  const transports: Transport[] = [];
  const sameHost = why === undefined ? sameHostTransport() : undefined;
  if (sameHost) transports.push(sameHost);
  transports.push(new TcpTransport(tcp));
  return { transports, notes: sameHost ? [copyThreadsNote(sameHost)] : [`requester has TCP only: the same-host transport is unavailable (${why})`] };
}
