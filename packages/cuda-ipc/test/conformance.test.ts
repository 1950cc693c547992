import { describeTransportConformance, type ConformanceMemory } from '@tensorwire/core/testing';
import { CudaIpcTransport, allocateSharedMemory, capabilities, native, releaseSharedMemory } from '../src/index.js';

/** Host memory in shared segments, so registrations are zero-copy and grantable. */
const sharedHostMemory: ConformanceMemory = {
  kind: 'host',
  async allocate(byteLength) {
    const buffer = allocateSharedMemory(byteLength, 'conformance');
    return {
      memory: { kind: 'host', buffer },
      async write(data, offset = 0) {
        buffer.set(data, offset);
      },
      async read(offset, length) {
        return buffer.slice(offset, offset + length);
      },
      async free() {
        releaseSharedMemory(buffer);
      },
    };
  },
};

const caps = capabilities();
describeTransportConformance({
  name: 'cuda-ipc (host memory)',
  createTransport: () => new CudaIpcTransport(),
  memory: sharedHostMemory,
  ...(caps.sharedMemory.available ? {} : { skip: caps.sharedMemory.reason ?? 'shared memory unavailable' }),
});

/** CUDA device memory (cuMemAlloc), checked through host copies. Only where a GPU exists. */
const cudaMemory: ConformanceMemory = {
  kind: 'cuda',
  async allocate(byteLength) {
    const pointer = await native.cudaAlloc(0, byteLength);
    await native.cudaCopy('h2d', 0, pointer, new Uint8Array(byteLength), byteLength);
    return {
      memory: { kind: 'cuda', device: 0, pointer, byteLength },
      async write(data, offset = 0) {
        await native.cudaCopy('h2d', 0, pointer + BigInt(offset), data, data.byteLength);
      },
      async read(offset, length) {
        const out = new Uint8Array(length);
        if (length > 0) await native.cudaCopy('d2h', 0, out, pointer + BigInt(offset), length);
        return out;
      },
      async free() {
        await native.cudaFree(0, pointer);
      },
    };
  },
};

if (!caps.cuda.available) console.warn(`[cuda-ipc] CUDA conformance skipped: ${caps.cuda.reason}`);
describeTransportConformance({
  name: 'cuda-ipc (cuda memory)',
  createTransport: () => new CudaIpcTransport(),
  memory: cudaMemory,
  ...(caps.cuda.available ? {} : { skip: caps.cuda.reason ?? 'CUDA unavailable' }),
});
