/**
 * The lease descriptor of an engine-granted lease, shared by the holder's resolver
 * ({@link engineGrants}) and the requester's fetch ({@link LockClient.fetch}):
 *
 *   "TWF" | u8 version (1) | u16 endpoint length | engine endpoint | u32 length | grant descriptor
 *
 * The grant descriptor is one range grant over every block of the lease, block i being range i.
 */
import { ByteReader, ByteWriter, InvalidInputError } from '@tensorwire/core';

const MAGIC = [0x54, 0x57, 0x46]; // TWF
const VERSION = 1;
/** A grant descriptor is small (one token per transport, run-length encoded lengths); this bounds a lying one. */
const MAX_GRANT_BYTES = 8 * 1024 * 1024;

export interface FetchDescriptor {
  readonly endpoint: Uint8Array;
  readonly grant: Uint8Array;
}

export function encodeFetchDescriptor(endpoint: Uint8Array, grant: Uint8Array): Uint8Array {
  const w = new ByteWriter(16 + endpoint.length + grant.length);
  for (const m of MAGIC) w.u8(m);
  return w.u8(VERSION).blob16(endpoint).blob32(grant).finish();
}

export function decodeFetchDescriptor(bytes: Uint8Array): FetchDescriptor {
  const r = new ByteReader(bytes, 'fetch descriptor');
  for (const m of MAGIC) if (r.u8('magic') !== m) throw new InvalidInputError('not a tensorwire fetch descriptor (bad magic)', { details: { field: 'magic' } });
  const v = r.u8('version');
  if (v !== VERSION) throw new InvalidInputError(`fetch descriptor version ${v} is not supported (expected ${VERSION})`, { details: { field: 'version' } });
  const endpoint = r.blob16('endpoint').slice();
  const grant = r.blob32('grant', MAX_GRANT_BYTES).slice();
  r.end();
  return { endpoint, grant };
}
