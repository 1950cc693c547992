import { BenchError } from './types.js';

const UNITS: Record<string, number> = { '': 1, b: 1, k: 1024, kb: 1024, kib: 1024, m: 1024 ** 2, mb: 1024 ** 2, mib: 1024 ** 2, g: 1024 ** 3, gb: 1024 ** 3, gib: 1024 ** 3 };

/** "4KiB", "64m", "1g", "4096" -> bytes. Throws BenchError naming the bad value. */
export function parseBytes(text: string, what = 'size'): number {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$/i.exec(text);
  const mult = m ? UNITS[(m[2] ?? '').toLowerCase()] : undefined;
  if (!m || mult === undefined) throw new BenchError(`${what} ${JSON.stringify(text)} is not a size (examples: 4096, 4KiB, 64MiB, 1GiB)`);
  const v = Math.round(Number(m[1]) * mult);
  if (!Number.isSafeInteger(v) || v <= 0) throw new BenchError(`${what} ${JSON.stringify(text)} must be a positive size`);
  return v;
}

export function formatBytes(n: number): string {
  if (n >= 1024 ** 3 && n % 1024 ** 3 === 0) return `${n / 1024 ** 3} GiB`;
  if (n >= 1024 ** 2 && n % 1024 ** 2 === 0) return `${n / 1024 ** 2} MiB`;
  if (n >= 1024 && n % 1024 === 0) return `${n / 1024} KiB`;
  return `${n} B`;
}
