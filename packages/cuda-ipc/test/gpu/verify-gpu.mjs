#!/usr/bin/env node
// Dependency-free GPU check for @tensorwire/cuda-ipc. Needs only node, the built addon
// (build/Release/cuda_ipc.node) and a CUDA GPU. Run from packages/cuda-ipc:
//   node test/gpu/verify-gpu.mjs
// It allocates, exports an IPC handle, imports it in a child process, copies H2D/D2D/D2H,
// checks bytes, exercises the deferred free (importer count in a shared header) and prints
// figures as JSON. Exit code 0 = all checks passed, 1 = a check failed, 2 = no GPU.
import { fork } from 'node:child_process';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
const addon = require(join(here, '..', '..', 'build', 'Release', 'cuda_ipc.node'));
const SIZE = Number(process.env.VERIFY_BYTES ?? 256 * 1024 * 1024);
const HEADER = 4096;

function pattern(n, seed) {
  const b = new Uint8Array(n);
  for (let i = 0; i < n; i++) b[i] = (i * 131 + seed * 7 + (i >>> 13)) & 0xff;
  return b;
}
function equal(a, b) {
  return Buffer.compare(Buffer.from(a.buffer, a.byteOffset, a.byteLength), Buffer.from(b.buffer, b.byteOffset, b.byteLength)) === 0;
}
async function timed(fn) {
  const t0 = process.hrtime.bigint();
  await fn();
  return Number(process.hrtime.bigint() - t0) / 1e9;
}

if (process.argv[2] === 'child') {
  // Importer: open the header segment, take an importer slot, import, copy D2H, check, report.
  const [, , , name, seed, bytes] = process.argv;
  const seg = addon.shmOpen(name, HEADER);
  const meta = addon.headerDecode(seg, 1);
  if (!addon.importerAdd(seg)) throw new Error('slot not live');
  const base = await addon.cudaImport(meta.device, meta.ipcHandle);
  const ptr = base + BigInt(meta.ipcOffset);
  const out = new Uint8Array(Number(bytes));
  const s = await timed(() => addon.cudaCopy('d2h', meta.device, out, ptr, out.byteLength));
  process.send({ ok: equal(out, pattern(out.byteLength, Number(seed))), importD2hGBps: out.byteLength / s / 1e9, pointer: String(ptr) });
  await new Promise((r) => process.once('message', r)); // hold the import until told
  await addon.cudaCloseImport(meta.device, base);
  addon.importerRemove(seg);
  process.send({ closed: true });
  process.exit(0);
}

const result = { checks: {}, figures: {} };
const probe = addon.cudaProbe();
result.probe = probe;
if (!probe.available) {
  console.log(JSON.stringify({ ...result, skipped: probe.reason }, null, 2));
  process.exit(2);
}
let failed = false;
const check = (name, ok) => {
  result.checks[name] = ok;
  if (!ok) failed = true;
};
try {
  const src = pattern(SIZE, 3);
  const a = await addon.cudaAlloc(0, SIZE);
  const b = await addon.cudaAlloc(0, SIZE);
  await addon.cudaCopy('h2d', 0, a, src, SIZE); // warm-up
  const h2d = await timed(() => addon.cudaCopy('h2d', 0, a, src, SIZE));
  const d2d = await timed(() => addon.cudaCopy('d2d', 0, b, a, SIZE));
  const back = new Uint8Array(SIZE);
  const d2h = await timed(() => addon.cudaCopy('d2h', 0, back, b, SIZE));
  check('h2d→d2d→d2h bytes', equal(back, src));
  result.figures.h2dGBps = SIZE / h2d / 1e9;
  result.figures.d2dGBps = SIZE / d2d / 1e9;
  result.figures.d2hGBps = SIZE / d2h / 1e9;

  // Pinned host memory through a shared segment.
  const hostSeg = addon.shmCreate(`/tw-p.verifygpu.h${process.pid}`, HEADER + SIZE, {
    kind: 1, id: `pool:verifygpu:h${process.pid}`, dataOffset: HEADER, capacity: SIZE, ownerPid: process.pid, device: -1, byteLength: SIZE, dtype: 1, shape: [SIZE],
  });
  const pinned = new Uint8Array(hostSeg, HEADER, SIZE);
  await addon.cudaHostRegister(pinned);
  const pinnedD2h = await timed(() => addon.cudaCopy('d2h', 0, pinned, b, SIZE));
  check('pinned shm d2h bytes', equal(pinned, src));
  result.figures.pinnedShmD2hGBps = SIZE / pinnedD2h / 1e9;
  await addon.cudaHostUnregister(pinned);
  addon.shmUnlink(`/tw-p.verifygpu.h${process.pid}`);

  // Export with an offset inside the allocation, import in a child.
  const off = 4096;
  const exp = await addon.cudaExport(0, b + BigInt(off));
  check('export offset', exp.offset === off && exp.base === b);
  const name = `/tw-p.verifygpu.${process.pid}`;
  const seg = addon.shmCreate(name, HEADER, {
    kind: 1, id: `pool:verifygpu:${process.pid}`, dataOffset: 0, capacity: SIZE - off, ownerPid: process.pid, device: 0,
    ipcHandle: exp.handle, ipcOffset: exp.offset, byteLength: SIZE - off, dtype: 1, shape: [SIZE - off],
  });
  addon.setState(seg, 1);
  await addon.cudaCopy('h2d', 0, b + BigInt(off), pattern(SIZE - off, 9), SIZE - off);
  const child = fork(fileURLToPath(import.meta.url), ['child', name, '9', String(SIZE - off)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  const first = await new Promise((r) => child.once('message', r));
  check('child import + d2h bytes', first.ok === true);
  result.figures.importD2hGBps = first.importD2hGBps;
  check('importer counted', addon.importers(seg) === 1);

  // Deferred free: mark freed, then wait for the importer before cuMemFree.
  addon.setState(seg, 2);
  check('free deferred while imported', addon.importers(seg) === 1);
  child.send({ close: true });
  await new Promise((r) => child.once('message', r));
  const t0 = Date.now();
  while (addon.importers(seg) > 0 && Date.now() - t0 < 10000) await new Promise((r) => setTimeout(r, 5));
  check('importer released', addon.importers(seg) === 0);
  await addon.cudaFree(0, b);
  await addon.cudaFree(0, a);
  addon.shmUnlink(name);
  check('no new import after free', addon.importerAdd(seg) === false);
} catch (e) {
  result.error = { message: e?.message, code: e?.code, cuResult: e?.cuResult, cuCall: e?.cuCall };
  failed = true;
}
result.ok = !failed;
console.log(JSON.stringify(result, null, 2));
process.exit(failed ? 1 : 0);
