/**
 * The Unix-socket transport across real processes (children import the built `dist/`): reads
 * and writes of a holder's memory, a holder killed with SIGKILL mid-transfer, its stale socket
 * replaced by a restarted holder at the same path, and socket files removed at a normal exit.
 */
import { fork, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { TransferEngine } from '../src/engine.js';
import type { TensorwireError } from '../src/errors.js';
import { ErrorCode } from '../src/errors.js';
import { silentLogger } from '../src/logger.js';
import { pattern } from '../src/testing/pattern.js';
import { UdsTransport } from '../src/uds/transport.js';

const DIST = pathToFileURL(fileURLToPath(new URL('../dist/index.js', import.meta.url))).href;
const PATTERN = pathToFileURL(fileURLToPath(new URL('../dist/testing/pattern.js', import.meta.url))).href;

// argv: size, socket path ('' for a private directory of its own), mode ('serve' | 'exit').
const HOLDER = `
import { TransferEngine, UdsTransport, silentLogger } from ${JSON.stringify(DIST)};
import { pattern } from ${JSON.stringify(PATTERN)};
const [size, path, mode] = [Number(process.argv[2]), process.argv[3], process.argv[4]];
const t = new UdsTransport(path ? { path } : {});
const engine = new TransferEngine({ nodeId: 'uholder', transports: [t], logger: silentLogger });
await engine.start();
const buffer = pattern(size, 99);
const reg = await engine.register({ kind: 'host', buffer });
if (mode === 'exit') {
  process.send({ type: 'ready', path: t.path }, () => process.exit(0)); // no close(): the exit hook cleans up
} else {
  process.on('message', (m) => {
    if (m?.type === 'sum') {
      let sum = 0;
      for (let i = 0; i < buffer.length; i++) sum = (sum + buffer[i] * ((i % 251) + 1)) % 2147483647;
      process.send({ type: 'sum', value: sum });
    }
  });
  process.on('disconnect', () => process.exit(0));
  process.send({ type: 'ready', path: t.path, endpoint: Buffer.from(engine.endpoint()).toString('base64'), descriptor: Buffer.from(reg.descriptor).toString('base64') });
}
`;

let dir: string;
let script: string;
const children: ChildProcess[] = [];
const engines: TransferEngine[] = [];

beforeAll(() => {
  dir = mkdtempSync(join(tmpdir(), 'tw-uds-proc-'));
  script = join(dir, 'holder.mjs');
  writeFileSync(script, HOLDER);
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));
afterEach(async () => {
  // Let holders exit normally (their exit hook removes their socket files); SIGKILL only stragglers.
  await Promise.all(
    children.splice(0).map(
      (c) =>
        new Promise<void>((resolve) => {
          if (c.exitCode !== null || c.signalCode !== null) return resolve();
          const kill = setTimeout(() => c.kill('SIGKILL'), 5000);
          c.once('exit', () => {
            clearTimeout(kill);
            resolve();
          });
          if (c.connected) c.disconnect();
          else c.kill('SIGKILL');
        }),
    ),
  );
  await Promise.allSettled(engines.splice(0).map((e) => e.close()));
});

interface Ready {
  child: ChildProcess;
  path: string;
  endpoint: Uint8Array;
  descriptor: Uint8Array;
}
function holder(size: number, path = '', mode = 'serve'): Promise<Ready> {
  const child = fork(script, [String(size), path, mode], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  children.push(child);
  return new Promise((resolve, reject) => {
    child.once('exit', (code, sig) => mode !== 'exit' && reject(new Error(`holder exited early: ${code ?? sig}`)));
    child.on('message', (m: { type: string; path: string; endpoint?: string; descriptor?: string }) => {
      if (m.type === 'ready') resolve({ child, path: m.path, endpoint: new Uint8Array(Buffer.from(m.endpoint ?? '', 'base64')), descriptor: new Uint8Array(Buffer.from(m.descriptor ?? '', 'base64')) });
    });
  });
}

async function requester(): Promise<TransferEngine> {
  const e = new TransferEngine({ nodeId: 'urequester', transports: [new UdsTransport()], logger: silentLogger });
  await e.start();
  engines.push(e);
  return e;
}

function checksum(b: Uint8Array): number {
  let sum = 0;
  for (let i = 0; i < b.length; i++) sum = (sum + (b[i] as number) * ((i % 251) + 1)) % 2147483647;
  return sum;
}

describe('uds across processes', () => {
  it("reads and writes a holder process's memory", async () => {
    const size = 8 * 1024 * 1024 + 5;
    const h = await holder(size);
    const e = await requester();
    const dst = new Uint8Array(size);
    const reg = await e.register({ kind: 'host', buffer: dst });
    const report = await e.read(h.endpoint, [{ local: reg, remote: h.descriptor }]);
    expect(report.transport).toBe('uds');
    expect(Buffer.compare(dst, pattern(size, 99))).toBe(0);
    const src = pattern(size, 5);
    await e.write(h.endpoint, [{ local: await e.register({ kind: 'host', buffer: src }), remote: h.descriptor }]);
    const sum = await new Promise<number>((r) => {
      h.child.once('message', (m: { value: number }) => r(m.value));
      h.child.send({ type: 'sum' });
    });
    expect(sum).toBe(checksum(src));
  });

  it('a holder killed mid-transfer is a connection error, never partial success; a restarted holder replaces its stale socket', async () => {
    const size = 16 * 1024 * 1024;
    const sockDir = mkdtempSync(join(dir, 'sock-'));
    const path = join(sockDir, 'holder.sock');
    const h = await holder(size, path);
    const e = await requester();
    const dsts = await Promise.all(Array.from({ length: 4 }, async () => {
      const buffer = new Uint8Array(size);
      return { buffer, reg: await e.register({ kind: 'host', buffer }) };
    }));
    await e.read(h.endpoint, [{ local: dsts[0]?.reg as never, remote: h.descriptor, length: 4096 }]);
    const flights = dsts.map((d) =>
      e.read(h.endpoint, [{ local: d.reg, remote: h.descriptor }], { timeoutMs: 20_000 }).then(
        () => undefined,
        (x: unknown) => x,
      ),
    );
    h.child.kill('SIGKILL');
    for (const [i, o] of (await Promise.all(flights)).entries()) {
      if (o === undefined) expect(Buffer.compare((dsts[i] as { buffer: Uint8Array }).buffer, pattern(size, 99))).toBe(0);
      else expect([ErrorCode.ConnectionBroken, ErrorCode.SessionInvalidated]).toContain((o as TensorwireError).code);
    }
    // SIGKILL left the socket file behind; a new holder at the same path takes it over.
    expect(existsSync(path)).toBe(true);
    const again = await holder(size, path);
    const fresh = new Uint8Array(size);
    await e.read(again.endpoint, [{ local: await e.register({ kind: 'host', buffer: fresh }), remote: again.descriptor }]);
    expect(Buffer.compare(fresh, pattern(size, 99))).toBe(0);
  });

  it('a process that exits without closing its transport leaves no socket file or directory behind', async () => {
    const h = await holder(64, '', 'exit');
    await new Promise((r) => (h.child.exitCode !== null ? r(undefined) : h.child.once('exit', r)));
    expect(h.path.startsWith(tmpdir())).toBe(true);
    expect(existsSync(h.path)).toBe(false);
    expect(existsSync(join(h.path, '..'))).toBe(false);
  });
});
