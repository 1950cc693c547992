import { strykerConfig } from './base.mjs';
import { blockRange, engineRanges, fn, methods } from '../ranges.mjs';

/**
 * @tensorwire/core: ids, the TCP grant check, the engine's grant range check
 * (src/grant-check.ts: bounds, order and overlap of a grant's ranges), and the engine's
 * connection table, deadline / abort handling and remote-descriptor checks (by method, see
 * ../ranges.mjs).
 * FAST (CI): the owner-guard and grant-check code only.
 */
export const FAST = [
  fn('src/ids.ts', 'isOwnedBy'),
  blockRange('src/ids.ts', /^export class IdRegistry/),
  ...methods('src/kit/grants.ts', ['check']),
  ...engineRanges(['#remoteFor']),
];
export const FULL = ['src/ids.ts', 'src/kit/grants.ts', 'src/grant-check.ts', ...engineRanges()];

export default strykerConfig('core', process.env.TW_MUTATE_FAST ? FAST : FULL);
