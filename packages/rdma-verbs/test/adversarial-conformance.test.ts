/**
 * Core's conformance suite on the adversarial simulator (test/sim/verbs.ts with `adversary`), in
 * both grant modes: per-device QPN counters that collide, late and bursty completions, late
 * writes after ERR until the flush, send queues that accept only part of a chain (ENOMEM), a sloppy
 * NIC that keeps writing into deregistered memory, and the audit of writes into released memory
 * checked after every case. The seed is printed on failure; TW_SIM_SEED=<seed> reproduces it.
 */
import { describeTransportConformance } from '@tensorwire/core/testing';
import { afterAll, afterEach, onTestFailed, beforeEach, expect } from 'vitest';
import { RdmaTransport } from '../src/transport.js';
import { SimFabric, testSeed } from './sim/verbs.js';

for (const windows of [true, false]) {
  const seed = testSeed();
  const fabric = new SimFabric({ adversary: { seed, partialPosts: 0.05 } });
  beforeEach(() => {
    onTestFailed(() => console.error(`[rdma-verbs] adversarial simulator seed ${seed} (${windows ? 'memory-window' : 'memory-region'}); rerun with TW_SIM_SEED=${seed}`));
  });
  afterEach(() => {
    expect(fabric.audit.violations, `seed ${seed}`).toEqual([]);
  });
  afterAll(() => {
    // The adversary was exercised, not configured and idle.
    expect(fabric.audit.writes, `seed ${seed}`).toBeGreaterThan(0);
  });
  describeTransportConformance({
    name: `rdma on adversarial simulated verbs (seed ${seed}), ${windows ? 'memory-window' : 'memory-region'} grants`,
    createTransport: () => new RdmaTransport({ backend: fabric.backend(windows), listenHost: '127.0.0.1', advertiseHost: '127.0.0.1', quiesceTimeoutMs: 2_000 }),
    churnCycles: 100,
  });
}
