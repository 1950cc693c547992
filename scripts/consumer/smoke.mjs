// The consumer test (scripts/check-packages.mjs copies it into a fresh app installed from the
// packed tarballs): load each package, move a tensor through the pool to another process and
// bytes through the engine. Prints one line per check; exits non-zero on the first failure.
import assert from 'node:assert/strict';
import { URL } from 'node:url';
import { fork } from 'node:child_process';
import { BackendUnavailableError, TcpTransport, TensorwireError, TransferEngine } from '@tensorwire/core';
import * as cudaIpc from '@tensorwire/cuda-ipc';
import * as rdma from '@tensorwire/rdma-verbs';
import * as lock from '@tensorwire/lock-client';
import * as lockServer from '@tensorwire/lock-client/server';
import * as etcd from '@tensorwire/discovery-etcd';

if (process.argv[2] === 'child') {
  const pool = new cudaIpc.TensorPool({ owner: 'consumer' });
  const view = pool.readSync(process.argv[3]);
  const sum = view.array().reduce((a, b) => a + b, 0);
  process.send?.({ sum, consistent: view.isConsistent(), dtype: view.dtype, shape: view.shape });
  view.dispose();
  await pool.close();
  process.exit(0);
}

const caps = cudaIpc.capabilities();
assert.equal(caps.addon.loaded, true, `cuda-ipc addon: ${caps.addon.errors.join('; ')}`);
assert.match(caps.addon.path ?? '', new RegExp(`prebuilds/linux-${process.arch}/@tensorwire\\+cuda-ipc\\.glibc\\.node$`));
console.log(`cuda-ipc addon from ${caps.addon.path.replace(/.*node_modules\//, '')}`);

// A tensor through the pool, read zero-copy by another process.
const pool = new cudaIpc.TensorPool({ owner: 'producer' });
const id = await pool.register({ dtype: 'float32', shape: [2, 3] });
pool.writeSync(id, new Float32Array([1, 2, 3, 4, 5, 6]));
const child = fork(new URL(import.meta.url).pathname, ['child', id]);
const [msg] = await Promise.all([new Promise((r) => child.once('message', r)), new Promise((r) => child.once('exit', r))]);
assert.deepEqual(msg, { sum: 21, consistent: true, dtype: 'float32', shape: [2, 3] });
console.log(`pool: ${id} read by another process: sum ${msg.sum}`);
await pool.free(id);
await pool.close();

// Bytes through the engine (TCP), and through the same-host transport.
for (const make of [() => new TcpTransport(), () => new cudaIpc.CudaIpcTransport()]) {
  const holder = new TransferEngine({ nodeId: 'holder', transports: [make()] });
  const requester = new TransferEngine({ nodeId: 'requester', transports: [make()] });
  await holder.start();
  await requester.start();
  const src = make().name === 'cuda-ipc' ? cudaIpc.allocateSharedMemory(1 << 20) : new Uint8Array(1 << 20);
  for (let i = 0; i < src.length; i++) src[i] = i % 251;
  const grant = await holder.register({ kind: 'host', buffer: src });
  const dst = new Uint8Array(src.length);
  const local = await requester.register({ kind: 'host', buffer: dst });
  const report = await requester.read(holder.endpoint(), [{ local, remote: grant.descriptor }], { timeoutMs: 10_000 });
  assert.equal(report.bytes, src.length);
  assert.ok(dst.every((v, i) => v === i % 251));
  console.log(`engine: ${report.bytes} bytes over ${report.transport}`);
  await grant.revoke();
  await requester.close();
  await holder.close();
  if (make().name === 'cuda-ipc') cudaIpc.releaseSharedMemory(src);
}

// rdma-verbs: its prebuilt addon loads and was built against verbs.h (not the stub).
const r = rdma.tryLoadNative();
assert.ok('addon' in r, `rdma addon: ${'errors' in r ? r.errors.join('; ') : ''}`);
assert.match(r.path, new RegExp(`prebuilds/linux-${process.arch}/@tensorwire\\+rdma-verbs\\.glibc\\.node$`));
assert.equal(r.addon.builtWithVerbs, true);
console.log(`rdma-verbs addon from ${r.path.replace(/.*node_modules\//, '')}: built with verbs.h; here: ${rdma.capabilities().reason ?? 'available'}`);

// One core: errors from the plugins are the app's core classes.
assert.ok(new BackendUnavailableError('x') instanceof TensorwireError);
try {
  new cudaIpc.TensorPool({ owner: 'not valid!' });
  assert.fail('expected InvalidInputError');
} catch (e) {
  assert.ok(e instanceof TensorwireError, 'cuda-ipc throws the app core TensorwireError');
}
assert.equal(typeof lock.LockClient, 'function');
assert.equal(typeof lockServer.LockServer, 'function');
assert.equal(typeof etcd.EtcdDiscovery, 'function');
const server = new lockServer.LockServer({ holderId: 'h', lockTimeoutMs: 1000, resolve: (ids) => ids.map(() => new Uint8Array(1)) });
const port = await server.listen('127.0.0.1:0');
const client = new lock.LockClient({ requesterId: 'r' });
{
  const guard = await client.acquire(`127.0.0.1:${port}`, ['block:h:1'], { timeoutMs: 5000 });
  await guard.release();
}
assert.equal(server.counters().released, 1);
await client.close();
await server.close();
console.log('lock-client: a lease acquired and released over gRPC; discovery-etcd loads');
