import type { Scenario } from '../types.js';
import { rdma } from './rdma.js';
import { tcp } from './tcp.js';

export type ScenarioName = 'run' | 'tcp' | 'pool' | 'locks' | 'rdma';

export const SCENARIOS: Record<ScenarioName, Scenario> = {
  tcp,
  run: tcp,
  pool: tcp,
  locks: tcp,
  rdma,
};
