/// <reference types="node" preserve="true" />
/**
 * `@tensorwire/lock-client`: transfer locks. A requester pins blocks on a holder under a
 * lease while it moves their bytes; the guard releases exactly once on every exit path.
 * The holder side is `@tensorwire/lock-client/server`.
 */
export { LockClient, LockGuard } from './client.js';
export { FetchGuard } from './fetch.js';
export { MAX_ACQUIRE_TRANSPORTS } from './hints.js';
export { numberedBlockIds } from './ids.js';
export type { NumberedBlocks } from './ids.js';
export type { FetchDestination, FetchLeaseOptions, FetchOptions } from './fetch.js';
export { decodeFetchDescriptor, encodeFetchDescriptor } from './fetch-descriptor.js';
export type { FetchDescriptor } from './fetch-descriptor.js';
export type {
  AcquireOptions,
  AutoRenewOptions,
  CallOptions,
  GuardState,
  LeaseLost,
  LockClientEvents,
  LockClientOptions,
  ReleaseFailure,
  ReleaseResult,
  ReleaseRetryOptions,
  RenewOptions,
  RetryBudget,
} from './client.js';
export type { LaneStats } from './holder-lane.js';
export type { SessionStats } from './session.js';
export type { LockCodec, MessageCodec } from './codec.js';
export type { LockClientCounters } from './metrics.js';
export { DEFAULT_CLIENT_METRICS_PREFIX } from './metrics.js';
export { fromGrpcError, LeaseError } from './errors.js';
export type { LeaseStatus } from './errors.js';
export { AUTH_METADATA_KEY, RETRY_AFTER_METADATA_KEY, LOCK_PROTO_PATH, LOCK_SERVICE_NAME, loadLockProtocol } from './proto.js';
export type {
  AcquireRequestMsg,
  AcquireResponseMsg,
  BlockGrantMsg,
  HealthRequestMsg,
  HealthResponseMsg,
  LockServiceClient,
  LockServiceClientConstructor,
  Unary,
  EntryErrorMsg,
  ReleaseManyRequestMsg,
  ReleaseManyResponseMsg,
  ReleaseRequestMsg,
  ReleaseResponseMsg,
  RenewManyRequestMsg,
  RenewManyResponseMsg,
  RenewRequestMsg,
  RenewResponseMsg,
  LockMethod,
  SessionRequestMsg,
  SessionResponseMsg,
} from './proto.js';
