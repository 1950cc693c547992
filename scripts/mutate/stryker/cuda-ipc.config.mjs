import { strykerConfig } from './base.mjs';
import { fn, methods } from '../ranges.mjs';

/**
 * @tensorwire/cuda-ipc: the pool's owner guard and deferred frees, and the same-host
 * transport's grant code (payload decoding, grant entry, range resolution, revocation).
 * FAST (CI): the owner guard (free, the foreign-mapping table) only.
 */
const OWNER_GUARD = methods('src/pool.ts', ['free', '#mappingFor', '#dropForeign']);
export const FAST = methods('src/pool.ts', ['free']);
export const FULL = [
  ...OWNER_GUARD,
  ...methods('src/pool.ts', ['#settle', '#import', '#viewRelease', '#releaseDevice', 'close']),
  fn('src/transport.ts', 'decodePayload'),
  ...methods('src/transport.ts', ['#resolveRanges', '#resolve', '#grant', 'grant', 'revokeGrant', '#revokeRange', 'revoke']),
];

export default strykerConfig('cuda-ipc', process.env.TW_MUTATE_FAST ? FAST : FULL);
