/// <reference types="node" preserve="true" />
/**
 * `@tensorwire/lock-client/server`: the holder side. A gRPC lease service, its lease
 * table (usable on its own), the expiry GC and metrics.
 */
export { LockServer, startLockServer } from './server.js';
export { MAX_ACQUIRE_TRANSPORTS } from '../hints.js';
export { engineGrants } from './grants.js';
export type { EngineBlockSpace, EngineGrantCounters, EngineGrants, EngineGrantsOptions } from './grants.js';
export type { AcquireHints, BlockDescriptors, BlockResolver, ResolvedLease, CloseOptions, LockServerCounters, LockServerOptions, RpcName } from './server.js';
export { LeaseTable, MAX_SPACE_BLOCKS, systemClock } from './lease-table.js';
export type { AcquireParams, BlockSpace, Clock, LeaseCounters, LeaseEndReason, LeaseInfo, LeaseTableOptions, SweepStats } from './lease-table.js';
export { ExpiryScheduler, systemTimers } from './expiry.js';
export type { ExpirySchedulerOptions, Timers } from './expiry.js';
export { DeadlineHeap } from './heap.js';
export type { HeapEntry } from './heap.js';
export { DEFAULT_SERVER_METRICS_PREFIX } from './metrics.js';
export { LeaseError } from '../errors.js';
export type { LeaseStatus } from '../errors.js';
export { numberedBlockIds } from '../ids.js';
export type { NumberedBlocks } from '../ids.js';
export { LOCK_PROTO_PATH, LOCK_SERVICE_NAME, loadLockProtocol } from '../proto.js';
