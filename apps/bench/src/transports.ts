/**
 * Which transports the bench's engines are built with. A holder serves through every transport
 * it can (the same-host `cuda-ipc` transport of @tensorwire/cuda-ipc and the engine's TCP
 * transport); a requester registers the ones `--transport` allows, and the engine chooses
 * among them per peer (it says which and why in `explain()`).
 */
import { TcpTransport, type TcpTransportOptions, type Transport } from '@tensorwire/core';
import { CudaIpcTransport, capabilities } from '@tensorwire/cuda-ipc';
import { BenchError } from './types.js';
import { formatBytes, parseBytes } from './units.js';

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

/** The environment variable `--async-copy-bytes` sets for this process and the workers it forks. */
export const ASYNC_COPY_ENV = 'TENSORWIRE_BENCH_ASYNC_COPY_BYTES';

/**
 * The same-host transport's `asyncCopyBytes` from `--async-copy-bytes` (or {@link ASYNC_COPY_ENV}):
 * a size, or `never` (Infinity); undefined for the library default. Throws BenchError naming
 * the variable for a bad value.
 */
export function asyncCopySetting(env: NodeJS.ProcessEnv = process.env): number | undefined {
  const raw = env[ASYNC_COPY_ENV];
  if (raw === undefined) return undefined;
  if (raw.trim().toLowerCase() === 'never') return Number.POSITIVE_INFINITY;
  try {
    return parseBytes(raw);
  } catch {
    throw new BenchError(`--async-copy-bytes (${ASYNC_COPY_ENV}) ${JSON.stringify(raw)} must be a positive size (4096, 4KiB, 64MiB, 1GiB) or never`);
  }
}

/** The same-host transport as the bench builds it: `copyThreads` and `asyncCopyBytes` from the flags, else the library defaults. */
function sameHostTransport(): CudaIpcTransport {
  const n = copyThreadsSetting();
  const bytes = asyncCopySetting();
  return new CudaIpcTransport({ ...(n !== undefined ? { copyThreads: n } : {}), ...(bytes !== undefined ? { asyncCopyBytes: bytes } : {}) });
}

/** What the notes say about the same-host transport's copy threads and which batches it copies off the JavaScript thread. */
function copyThreadsNote(t: CudaIpcTransport): string {
  const how = copyThreadsSetting() === undefined ? "the library default: half this process's available cores, 1 to 4" : `--copy-threads, ${COPY_THREADS_ENV}`;
  const off = t.asyncCopyBytes === Number.POSITIVE_INFINITY ? 'every batch on the JavaScript thread' : `batches of ${formatBytes(t.asyncCopyBytes)} and more off the JavaScript thread`;
  const offHow = asyncCopySetting() === undefined ? 'the library default' : `--async-copy-bytes, ${ASYNC_COPY_ENV}`;
  return `cuda-ipc copies host batches of 1 MiB and more on up to ${t.copyThreads} thread(s) (${how}); ${off} (${offHow})`;
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
