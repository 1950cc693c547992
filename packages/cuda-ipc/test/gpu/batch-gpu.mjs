#!/usr/bin/env node
// Batched engine reads between two processes' CUDA device buffers, through the cuda-ipc
// transport. Needs node, the built packages (core and cuda-ipc dist, the addon) and a GPU.
// Run from packages/cuda-ipc:  node test/gpu/batch-gpu.mjs
// The holder (this process) fills a device region with a known pattern and registers it once;
// a forked requester registers its own device buffer and reads N scattered descriptors of S
// bytes per engine.read (plain and prepared), checking every byte. Baselines in the same
// requester, interleaved: the same scatter as one cuMemcpyDtoD per descriptor between two
// local device buffers (what the transport does per range, without the engine), and one
// contiguous cuMemcpyDtoD of the same byte count. Prints one JSON object. Exit 0 = all
// checks passed, 1 = a check failed, 2 = no GPU.
import { fork } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { TransferEngine, silentLogger } from '@tensorwire/core';
import { pattern } from '@tensorwire/core/testing/pattern';
import { CudaIpcTransport, capabilities, native } from '../../dist/index.js';

const REGION = 128 * 1024 * 1024;
const SEED = 11;
const CASES = [
  { size: 4096, count: 1024 },
  { size: 65536, count: 1024 },
  { size: 4 * 1024 * 1024, count: 1 },
];
const ROUNDS = Number(process.env.BATCH_ROUNDS ?? 7);

function offsetsFor(size, count, seed) {
  // Distinct blocks of the region in a scattered order (a fixed LCG permutation walk).
  const blocks = REGION / size;
  const out = [];
  let x = seed;
  const used = new Set();
  while (out.length < count) {
    x = (x * 1103515245 + 12345) % 2147483648;
    const b = x % blocks;
    if (used.has(b)) continue;
    used.add(b);
    out.push(b * size);
  }
  return out;
}
const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1];
const ns = () => process.hrtime.bigint();
const since = (t) => Number(process.hrtime.bigint() - t) / 1e6; // ms

if (process.argv[2] === 'child') {
  const cfg = JSON.parse(Buffer.from(process.argv[3], 'base64').toString());
  const endpoint = new Uint8Array(Buffer.from(cfg.endpoint, 'base64'));
  const descriptor = new Uint8Array(Buffer.from(cfg.descriptor, 'base64'));
  const expect = pattern(REGION, SEED);
  const engine = new TransferEngine({ nodeId: 'gpu-requester', transports: [new CudaIpcTransport()], logger: silentLogger });
  await engine.start();
  const maxBytes = Math.max(...CASES.map((c) => c.size * c.count));
  const dst = await native.cudaAlloc(0, maxBytes);
  const src = await native.cudaAlloc(0, REGION); // a local copy of the region for the baselines
  await native.cudaCopy('h2d', 0, src, expect, REGION);
  const scratch = await native.cudaAlloc(0, maxBytes);
  const reg = await engine.register({ kind: 'cuda', device: 0, pointer: dst, byteLength: maxBytes });
  const out = { cases: [], failures: 0 };
  const host = new Uint8Array(maxBytes);
  const verify = async (offsets, size) => {
    await native.cudaCopy('d2h', 0, host, dst, offsets.length * size);
    let bad = 0;
    for (let i = 0; i < offsets.length; i++) {
      const got = host.subarray(i * size, (i + 1) * size);
      const want = expect.subarray(offsets[i], offsets[i] + size);
      if (Buffer.compare(got, want) !== 0) bad++;
    }
    return bad;
  };
  const poison = () => native.cudaCopy('h2d', 0, dst, new Uint8Array(maxBytes).fill(0xa5), maxBytes);
  for (const { size, count } of CASES) {
    const offsets = offsetsFor(size, count, size + count);
    const requests = offsets.map((o, i) => ({ local: reg, localOffset: i * size, remote: descriptor, remoteOffset: o, length: size }));
    const bytes = size * count;
    await poison();
    let t = ns();
    await engine.read(endpoint, requests); // the first read imports the holder's IPC handle (once per grant)
    const firstMs = since(t);
    let failures = await verify(offsets, size);
    const prepared = await engine.prepare(endpoint, requests, { op: 'read' });
    const perRange = async () => {
      for (let i = 0; i < count; i++) await native.cudaCopy('d2d', 0, scratch + BigInt(i * size), src + BigInt(offsets[i]), size);
    };
    const table = new Float64Array(count * 3);
    for (let i = 0; i < count; i++) table.set([Number(scratch) + i * size, Number(src) + offsets[i], size], i * 3);
    const oneCall = () => native.cudaCopyRanges(0, table, count);
    const contiguous = () => native.cudaCopy('d2d', 0, scratch, src, bytes);
    const subjects = [
      ['engine.read', () => engine.read(endpoint, requests)],
      ['prepared.run', () => prepared.run()],
      ['per-descriptor cuMemcpyDtoD (local)', perRange],
      ['cudaCopyRanges, one call (local)', oneCall],
      ['one contiguous cuMemcpyDtoD (local)', contiguous],
    ];
    for (const [, fn] of subjects) await fn(); // warm-up
    const times = subjects.map(() => []);
    for (let r = 0; r < ROUNDS; r++) {
      for (let k = 0; k < subjects.length; k++) {
        const j = (r + k) % subjects.length;
        t = ns();
        await subjects[j][1]();
        times[j].push(since(t));
      }
    }
    await poison();
    await prepared.run();
    failures += await verify(offsets, size);
    await prepared.close();
    out.failures += failures;
    const figures = Object.fromEntries(
      subjects.map(([name], j) => {
        const ms = median(times[j]);
        return [name, { medianMs: ms, gbps: bytes / ms / 1e6, descriptorsPerSec: (count / ms) * 1000 }];
      }),
    );
    const g = (name) => figures[name].gbps;
    out.cases.push({
      descriptorBytes: size,
      descriptors: count,
      rounds: ROUNDS,
      firstReadMs: firstMs,
      failures,
      figures,
      ratios: {
        'engine.read / per-descriptor local d2d': g('engine.read') / g('per-descriptor cuMemcpyDtoD (local)'),
        'prepared.run / per-descriptor local d2d': g('prepared.run') / g('per-descriptor cuMemcpyDtoD (local)'),
        'prepared.run / one-call local batch': g('prepared.run') / g('cudaCopyRanges, one call (local)'),
        'prepared.run / contiguous local d2d': g('prepared.run') / g('one contiguous cuMemcpyDtoD (local)'),
      },
    });
  }
  // cudaCopyRanges refuses bad tables before issuing anything.
  out.badInput = {};
  for (const [name, t, n] of [
    ['fractional address', new Float64Array([Number(dst) + 0.5, Number(src), 16]), 1],
    ['empty range', new Float64Array([Number(dst), Number(src), 0]), 1],
    ['count beyond table', new Float64Array([Number(dst), Number(src), 16]), 2],
    ['negative', new Float64Array([-1, Number(src), 16]), 1],
  ]) {
    try {
      await native.cudaCopyRanges(0, t, n);
      out.badInput[name] = 'accepted';
      out.failures++;
    } catch (e) {
      out.badInput[name] = e?.name ?? String(e);
      if (e?.name !== 'InvalidInputError') out.failures++;
    }
  }
  await reg.revoke();
  await engine.close();
  for (const p of [dst, src, scratch]) await native.cudaFree(0, p);
  process.send(out);
  process.exit(0);
}

const probe = capabilities().cuda;
if (!probe.available) {
  console.log(JSON.stringify({ skipped: probe.reason }, null, 2));
  process.exit(2);
}
const result = { device: probe.devices[0] };
let code = 0;
try {
  const region = await native.cudaAlloc(0, REGION);
  await native.cudaCopy('h2d', 0, region, pattern(REGION, SEED), REGION);
  const engine = new TransferEngine({ nodeId: 'gpu-holder', transports: [new CudaIpcTransport()], logger: silentLogger });
  await engine.start();
  const reg = await engine.register({ kind: 'cuda', device: 0, pointer: region, byteLength: REGION });
  const cfg = Buffer.from(JSON.stringify({ endpoint: Buffer.from(engine.endpoint()).toString('base64'), descriptor: Buffer.from(reg.descriptor).toString('base64') })).toString('base64');
  const child = fork(fileURLToPath(import.meta.url), ['child', cfg], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  const reply = await new Promise((resolve, reject) => {
    child.once('message', resolve);
    child.once('exit', (c) => reject(new Error(`requester exited with ${c} before reporting`)));
  });
  Object.assign(result, reply);
  if (reply.failures !== 0) code = 1;
  await reg.revoke();
  await engine.close();
  await native.cudaFree(0, region);
} catch (e) {
  result.error = { message: e?.message, code: e?.code, stack: e?.stack };
  code = 1;
}
result.ok = code === 0;
console.log(JSON.stringify(result, null, 2));
process.exit(code);
