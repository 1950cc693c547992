import type { Scenario } from '../types.js';
import { locks } from './locks.js';
import { pool } from './pool.js';
import { rdma } from './rdma.js';
import { kvScenario } from './kv.js';
import { runScenario } from './run.js';
import { tcp } from './tcp.js';

export type ScenarioName = 'run' | 'tcp' | 'pool' | 'locks' | 'rdma' | 'kv';

export const SCENARIOS: Record<ScenarioName, Scenario> = {
  tcp,
  run: (ctx) => runScenario(ctx),
  pool,
  locks,
  rdma,
  kv: (ctx) => kvScenario(ctx),
};
