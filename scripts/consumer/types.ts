// The typings as a strict NodeNext consumer sees them: every entry point of every package.
// scripts/check-packages.mjs typechecks this with TypeScript 5.9, 6 and 7 (default `types`,
// no skipLibCheck) in an app installed from the packed tarballs.
import * as core from '@tensorwire/core';
import * as testing from '@tensorwire/core/testing';
import * as pattern from '@tensorwire/core/testing/pattern';
import * as cudaIpc from '@tensorwire/cuda-ipc';
import * as rdma from '@tensorwire/rdma-verbs';
import * as lock from '@tensorwire/lock-client';
import type * as lockServer from '@tensorwire/lock-client/server';
import type * as etcd from '@tensorwire/discovery-etcd';

export async function use(): Promise<number> {
  const engine: core.TransferEngine = new core.TransferEngine({ nodeId: 'a', transports: [new core.TcpTransport(), new cudaIpc.CudaIpcTransport()] });
  await using pool = new cudaIpc.TensorPool({ owner: 'a' });
  const id: string = await pool.register({ dtype: 'float32', shape: [2] });
  using view = pool.readSync(id);
  const caps: cudaIpc.Capabilities = cudaIpc.capabilities();
  const r: rdma.LoadResult = rdma.tryLoadNative();
  const client = new lock.LockClient({ requesterId: 'r' });
  await client.close();
  const server: lockServer.LockServer | undefined = undefined;
  const d: etcd.EtcdDiscoveryOptions | undefined = undefined;
  const e: core.TensorwireError = new core.BackendUnavailableError('x');
  void [testing, pattern, server, d, e, r, caps];
  await engine.close();
  return view.byteLength;
}
