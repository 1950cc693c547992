import { strykerConfig } from './base.mjs';
import { methods } from '../ranges.mjs';

/** @tensorwire/lock-client: the holder's lease table, and the client's release paths. */
export const FULL = [
  'src/server/lease-table.ts',
  ...methods('src/client.ts', ['release', '[Symbol.asyncDispose]', 'dropLeases', '#release', '#releaseLease', '#onGuardCollected', '#close']),
];

export default strykerConfig('lock-client', FULL);
