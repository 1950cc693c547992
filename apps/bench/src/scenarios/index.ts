import type { Scenario } from '../types.js';
import { locks } from './locks.js';
import { pool } from './pool.js';
import { rdma } from './rdma.js';
import { runScenario } from './run.js';
import { tcp } from './tcp.js';

export type ScenarioName = 'run' | 'tcp' | 'pool' | 'locks' | 'rdma';

export const SCENARIOS: Record<ScenarioName, Scenario> = {
  tcp,
  run: (ctx) => runScenario(ctx),
  pool,
  locks,
  rdma,
};
