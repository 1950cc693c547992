import { strykerConfig } from './base.mjs';
import { methods } from '../ranges.mjs';

/** @tensorwire/lock-client: the holder's lease table, the client's release paths, and the client's side of the Session stream. */
export const FULL = [
  'src/server/lease-table.ts',
  'src/session.ts',
  ...methods('src/client.ts', ['release', '[Symbol.asyncDispose]', 'dropLeases', '#release', '#releaseLease', '#onGuardCollected', '#close']),
];

export default strykerConfig('lock-client', FULL);
