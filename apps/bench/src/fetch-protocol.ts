/**
 * The bench holder adds one per-block descriptor to each lease, on its first block: the port of
 * its raw-socket baseline (u16), so a requester on another machine (`fetch --holder`) can run
 * the baseline against the same holder. The blocks themselves travel through the library's
 * fetch flow (`engineGrants` / `client.fetch`), not through bench code.
 */
import { ByteReader, ByteWriter } from '@tensorwire/core';

export function encodeRawPort(port: number): Uint8Array {
  return new ByteWriter(4).u16(port).finish();
}

export function decodeRawPort(bytes: Uint8Array | undefined): number | undefined {
  if (bytes === undefined) return undefined;
  const r = new ByteReader(bytes, 'raw port');
  const port = r.u16('raw port');
  r.end();
  return port;
}

/**
 * Holder block i is pinned under the lock id `block:kv:<i>` (the logical KV-cache block) and
 * lives in the holder's i-th pool slot. The pool's owner name is per process
 * (`kv-holder-<pid>`), so two holders on one host never share pool ids.
 */
export const BLOCK_OWNER = 'kv';
export function blockId(i: number): string {
  return `block:${BLOCK_OWNER}:${i}`;
}
export function poolOwner(): string {
  return `kv-holder-${process.pid}`;
}
export function blockSeed(i: number): number {
  return 1000 + i;
}
