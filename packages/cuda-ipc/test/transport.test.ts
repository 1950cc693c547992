import { afterAll, describe, expect, it } from 'vitest';
import { RemoteRejectedError, TransferEngine, silentLogger } from '@tensorwire/core';
import { CudaIpcTransport, allocateSharedMemory, decodeEndpointBlob, decodePayload, releaseSharedMemory } from '../src/index.js';
import fc from 'fast-check';
import { InvalidInputError } from '@tensorwire/core';

const engines: TransferEngine[] = [];
afterAll(async () => {
  await Promise.all(engines.map((e) => e.close()));
});

async function engine(nodeId: string): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId, transports: [new CudaIpcTransport()], logger: silentLogger });
  await e.start();
  engines.push(e);
  return e;
}

describe('cuda-ipc transport grants (invariant 13)', () => {
  it('after revoke, a peer with the grant and the data segment cached is rejected', async () => {
    const a = await engine(`ta${process.pid}`);
    const b = await engine(`tb${process.pid}`);
    const remoteMem = allocateSharedMemory(4096, 'grants');
    remoteMem.fill(5);
    const remote = await b.register({ kind: 'host', buffer: remoteMem });
    const local = await a.register({ kind: 'host', buffer: new Uint8Array(4096) });
    await a.read(b.endpoint(), [{ local, remote: remote.descriptor }]);
    expect(local.memory.kind === 'host' && local.memory.buffer.every((x) => x === 5)).toBe(true);
    await remote.revoke();
    await expect(a.read(b.endpoint(), [{ local, remote: remote.descriptor }])).rejects.toBeInstanceOf(RemoteRejectedError);
    expect(releaseSharedMemory(remoteMem)).toBe(true);
  });

  it('plain (non-shared) host memory works as the local side, and is refused as a remote', async () => {
    const a = await engine(`tc${process.pid}`);
    const b = await engine(`td${process.pid}`);
    const plainRemote = await b.register({ kind: 'host', buffer: new Uint8Array(64) });
    const local = await a.register({ kind: 'host', buffer: new Uint8Array(64) });
    await expect(a.read(b.endpoint(), [{ local, remote: plainRemote.descriptor }])).rejects.toThrow(/local use only/);
  });

  it('unreachableReason says "different host" for a peer on another host', async () => {
    const t = new CudaIpcTransport();
    const e = new TransferEngine({ nodeId: `te${process.pid}`, transports: [t], logger: silentLogger });
    await e.start();
    engines.push(e);
    const blob = t.endpoint();
    expect(t.unreachableReason({ ...e.identity, hostId: 'elsewhere' }, blob)).toBe('different host');
    expect(t.unreachableReason(e.identity, blob)).toBeUndefined();
  });

  it('payload and endpoint decoders reject arbitrary bytes with InvalidInputError', () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 300 }), fc.nat({ max: 1 << 20 }), (bytes, len) => {
        for (const f of [() => decodePayload(bytes, 'host', len + 1), () => decodeEndpointBlob(bytes)]) {
          try {
            f();
          } catch (err) {
            expect(err).toBeInstanceOf(InvalidInputError);
          }
        }
      }),
      { numRuns: 2000 },
    );
  });
});
