/**
 * The wire protocol: `proto/tensorwire/lock/v1/lock.proto`, loaded at run time with
 * `@grpc/proto-loader` relative to this module, so it works from `src/` and `dist/`.
 */
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

/** Absolute path of the `.proto` file shipped with the package. */
export const LOCK_PROTO_PATH: string = fileURLToPath(new URL('../proto/tensorwire/lock/v1/lock.proto', import.meta.url));
/** Fully qualified gRPC service name. */
export const LOCK_SERVICE_NAME = 'tensorwire.lock.v1.LockService';

export interface AcquireRequestMsg {
  requesterId: string;
  blockIds: string[];
  leaseMs: number;
  acquireId: string;
}
export interface BlockGrantMsg {
  blockId: string;
  descriptors: Uint8Array[];
}
export interface AcquireResponseMsg {
  sessionId: string;
  deadlineUnixMs: number;
  leaseMs: number;
  lockTimeoutMs: number;
  blocks: BlockGrantMsg[];
  holderId: string;
}
export interface ReleaseRequestMsg {
  requesterId: string;
  sessionId: string;
  acquireId: string;
}
export interface ReleaseResponseMsg {
  released: number;
}
export interface RenewRequestMsg {
  requesterId: string;
  sessionId: string;
  leaseMs: number;
}
export interface RenewResponseMsg {
  deadlineUnixMs: number;
  leaseMs: number;
}
export type HealthRequestMsg = Record<string, never>;
export interface HealthResponseMsg {
  status: 'UNKNOWN' | 'SERVING' | 'DRAINING';
  holderId: string;
  lockTimeoutMs: number;
  activeSessions: number;
  activeBlocks: number;
}

type Unary<Req, Res> = (
  request: Req,
  metadata: grpc.Metadata,
  options: grpc.CallOptions,
  callback: (error: grpc.ServiceError | null, response?: Res) => void,
) => grpc.ClientUnaryCall;

/** The typed gRPC client the proto loader builds. */
export interface LockServiceClient extends grpc.Client {
  Acquire: Unary<AcquireRequestMsg, AcquireResponseMsg>;
  Release: Unary<ReleaseRequestMsg, ReleaseResponseMsg>;
  Renew: Unary<RenewRequestMsg, RenewResponseMsg>;
  Health: Unary<HealthRequestMsg, HealthResponseMsg>;
}

export interface LockServiceClientConstructor {
  new (address: string, credentials: grpc.ChannelCredentials, options?: grpc.ClientOptions): LockServiceClient;
  service: grpc.ServiceDefinition;
}

const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: false,
  longs: Number,
  enums: String,
  bytes: Buffer,
  defaults: true,
  arrays: true,
  oneofs: false,
};

let cached: { service: grpc.ServiceDefinition; Client: LockServiceClientConstructor } | undefined;

/** Load the protocol once per process: the service definition and the client constructor. */
export function loadLockProtocol(): { service: grpc.ServiceDefinition; Client: LockServiceClientConstructor } {
  if (cached) return cached;
  const def = protoLoader.loadSync(LOCK_PROTO_PATH, LOADER_OPTIONS);
  const pkg = grpc.loadPackageDefinition(def) as unknown as {
    tensorwire: { lock: { v1: { LockService: LockServiceClientConstructor } } };
  };
  const Client = pkg.tensorwire.lock.v1.LockService;
  cached = { service: Client.service, Client };
  return cached;
}

/** Metadata key carrying the shared token: `authorization: Bearer <token>`. */
export const AUTH_METADATA_KEY = 'authorization';
