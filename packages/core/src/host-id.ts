import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { hostname } from 'node:os';
import { isToken } from './ids.js';

let cached: string | undefined;

/**
 * An id for this machine (boot): processes with the same host id can share memory.
 * Derived from the kernel's boot id and the host name, hashed; override with
 * TENSORWIRE_HOST_ID (1-64 characters of [A-Za-z0-9_-]).
 */
export function defaultHostId(): string {
  if (cached !== undefined) return cached;
  const override = process.env['TENSORWIRE_HOST_ID'];
  if (isToken(override)) return (cached = override);
  let boot = '';
  for (const path of ['/proc/sys/kernel/random/boot_id', '/etc/machine-id']) {
    try {
      boot = readFileSync(path, 'utf8').trim();
      if (boot) break;
    } catch {
      // try the next source
    }
  }
  cached = createHash('sha256').update(`${hostname()}\0${boot}`).digest('hex').slice(0, 24);
  return cached;
}
