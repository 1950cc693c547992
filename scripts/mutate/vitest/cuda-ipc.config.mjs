import { mutationVitest } from './shared.mjs';

export default mutationVitest('cuda-ipc', {
  include: process.env.TW_MUTATE_FAST
    ? ['test/invariants*.test.ts', 'test/mutation-gaps*.test.ts', 'test/pool.test.ts', 'test/bookkeeping.test.ts']
    : ['test/pool.test.ts', 'test/bookkeeping.test.ts', 'test/invariants*.test.ts', 'test/mutation-gaps*.test.ts', 'test/grants.test.ts', 'test/transport.test.ts', 'test/batch.test.ts', 'test/free-contract.test.ts'],
});
