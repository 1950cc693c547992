/**
 * The bench's opaque per-block descriptor, handed out by the holder's lock service:
 *   u16 raw-baseline port | u16 endpoint length | engine endpoint | engine memory descriptor
 * lock-client never looks inside it.
 */
import { ByteReader, ByteWriter } from '@tensorwire/core';

export function encodeBlockGrant(rawPort: number, endpoint: Uint8Array, descriptor: Uint8Array): Uint8Array {
  return new ByteWriter(64 + endpoint.length + descriptor.length).u16(rawPort).blob16(endpoint).bytes(descriptor).finish();
}

export function decodeBlockGrant(bytes: Uint8Array): { rawPort: number; endpoint: Uint8Array; descriptor: Uint8Array } {
  const r = new ByteReader(bytes, 'block grant');
  const rawPort = r.u16('raw port');
  const endpoint = r.blob16('endpoint');
  const descriptor = r.bytes(r.remaining, 'descriptor');
  return { rawPort, endpoint, descriptor };
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
