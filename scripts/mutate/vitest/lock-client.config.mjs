import { mutationVitest } from './shared.mjs';

export default mutationVitest('lock-client', {
  exclude: ['test/crash.test.ts', 'test/fetch.test.ts', 'test/server.test.ts', 'test/burst.test.ts'],
  // The dropped-guard test forces a collection to prove the finalizer releases.
  gc: true,
});
