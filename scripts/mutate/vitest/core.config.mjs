import { mutationVitest } from './shared.mjs';

const FAST = process.env.TW_MUTATE_FAST
  ? { include: ['test/ids.test.ts', 'test/kit-grants.test.ts', 'test/tcp-grant.test.ts', 'test/grant.test.ts', 'test/grant-blocks.test.ts', 'test/invariants.*.test.ts', 'test/mutation-gaps.*.test.ts', 'test/engine.test.ts'] }
  : {};

export default mutationVitest('core', {
  ...FAST,
  exclude: ['test/gallery*.test.ts', 'test/readme.test.ts', 'test/*.process.test.ts', 'test/tcp.responder-*.test.ts', 'test/discovery.test.ts', 'test/uds*.test.ts', 'test/fuzz.test.ts'],
});
