// Stryker's vitest runner runs tests in worker threads, which take no --expose-gc: expose
// gc() from here instead (for lock-client's dropped-guard test, which forces a collection).
import v8 from 'node:v8';
import vm from 'node:vm';

v8.setFlagsFromString('--expose-gc');
globalThis.gc ??= vm.runInNewContext('gc');
