/**
 * Per-call deadlines travel to the holder: every call carries the grpc-js `deadline`
 * (the `grpc-timeout` header), and a call that outlives it fails as TimedOutError.
 */
import * as grpc from '@grpc/grpc-js';
import { TimedOutError } from '@tensorwire/core';
import { afterEach, describe, expect, it } from 'vitest';
import { LockClient } from '../src/index.js';
import { loadLockProtocol } from '../src/proto.js';
import { bindLoopback } from './helpers.js';

let server: grpc.Server | undefined;
let client: LockClient | undefined;
afterEach(async () => {
  await client?.close();
  server?.forceShutdown();
  server = client = undefined;
});

/** A holder that records each call's deadline and never answers an acquire. */
async function silentHolder(): Promise<{ holder: string; deadlines: Map<string, Date | number> }> {
  const deadlines = new Map<string, Date | number>();
  const s = new grpc.Server();
  const record = (name: string) => (call: grpc.ServerUnaryCall<unknown, unknown>, cb: grpc.sendUnaryData<unknown>) => {
    deadlines.set(name, call.getDeadline());
    if (name === 'Acquire') return; // hang until the caller gives up
    if (name === 'Release') cb(null, { released: 0 });
    else cb(null, { status: 'SERVING', holderId: 'h', lockTimeoutMs: 1000, activeSessions: 0, activeBlocks: 0 });
  };
  s.addService(loadLockProtocol().service, {
    Acquire: record('Acquire'),
    Release: record('Release'),
    Renew: record('Renew'),
    Health: record('Health'),
  });
  const port = await bindLoopback(s);
  server = s;
  return { holder: `127.0.0.1:${port}`, deadlines };
}

describe('call deadlines', () => {
  it('reach the holder, and a call past its deadline fails as DEADLINE_EXCEEDED; its possible grant is released', async () => {
    const { holder, deadlines } = await silentHolder();
    client = new LockClient({ requesterId: 'req1', releaseTimeoutMs: 4000 });
    const before = Date.now();
    await client.health(holder, { timeoutMs: 5000 });
    const health = deadlines.get('Health');
    // Without a grpc-timeout header grpc-js reports Infinity.
    expect(Number(health)).toBeGreaterThan(before);
    expect(Number(health)).toBeLessThanOrEqual(before + 5000 + 1000);

    const err = await client.acquire(holder, ['block:h:1'], { timeoutMs: 200 }).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(TimedOutError);
    expect((err as TimedOutError).details['grpcCode']).toBe(grpc.status.DEADLINE_EXCEEDED);
    expect(Number.isFinite(Number(deadlines.get('Acquire')))).toBe(true);
    // The acquire may have been granted: it is released by acquire id, under its own deadline.
    const started = Date.now();
    while (!deadlines.has('Release') && Date.now() - started < 20_000) await new Promise((r) => setTimeout(r, 10));
    expect(Number.isFinite(Number(deadlines.get('Release')))).toBe(true);
    expect(client.counters()).toMatchObject({ abandonedAcquires: 1 });
  });
});
