/**
 * The wire protocol: `proto/tensorwire/lock/v1/lock.proto` (shipped with the package, for
 * requesters and holders in other languages), serialized with protobufjs through `codec.ts`.
 */
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import { createLockCodec, type LockCodec, type MessageCodec } from './codec.js';

/** Absolute path of the `.proto` file shipped with the package. */
export const LOCK_PROTO_PATH: string = fileURLToPath(new URL('../proto/tensorwire/lock/v1/lock.proto', import.meta.url));
/** Fully qualified gRPC service name. */
export const LOCK_SERVICE_NAME = 'tensorwire.lock.v1.LockService';

export interface AcquireRequestMsg {
  requesterId: string;
  /** Blocks by id; empty when they go by number (`blockOwner`, `blockNumbers`). */
  blockIds: string[];
  leaseMs: number;
  acquireId: string;
  /**
   * The requester accepts a response that lists only the blocks with descriptors (a block
   * left out has none). Absent / false: one entry per requested block, as older holders send.
   */
  omitEmptyBlocks?: boolean;
  /** Blocks by number: block n is `block:<blockOwner>:<n>` (the holder's numbered block space). */
  blockOwner?: string;
  /** Sent from a Uint32Array; decoded as numbers. */
  blockNumbers?: Uint32Array | number[];
  /** The transports the requester reads through (a hint: the holder may grant over these only). Absent or empty: the holder's usual set. */
  transports?: string[];
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
  /** One entry per requested block, or (request with `omitEmptyBlocks`) only those with descriptors, in request order. */
  blocks: BlockGrantMsg[];
  holderId: string;
  /** Descriptors covering the whole lease (empty when the resolver gives none). */
  leaseDescriptors?: Uint8Array[];
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
/** A per-entry failure in a batched call: `code` is the gRPC status the unary call would give. */
export interface EntryErrorMsg {
  index: number;
  code: number;
  message: string;
}
export interface ReleaseManyRequestMsg {
  requesterId: string;
  /** Entries by session id. */
  sessionIds: string[];
  /** Entries by acquire id; indices in `errors`/`released` continue after `sessionIds`. */
  acquireIds: string[];
}
export interface ReleaseManyResponseMsg {
  /** Blocks released per entry (session ids, then acquire ids). */
  released: number[];
  errors: EntryErrorMsg[];
}
export interface RenewManyRequestMsg {
  requesterId: string;
  sessionIds: string[];
  /** Per entry; empty means 0 (the lock timeout) for every entry. */
  leaseMs: number[];
}
export interface RenewManyResponseMsg {
  deadlineUnixMs: number[];
  leaseMs: number[];
  errors: EntryErrorMsg[];
}
export type HealthRequestMsg = Record<string, never>;
export interface HealthResponseMsg {
  status: 'UNKNOWN' | 'SERVING' | 'DRAINING';
  holderId: string;
  lockTimeoutMs: number;
  activeSessions: number;
  activeBlocks: number;
  /** The name of the holder's local lane (the LockClient option `localLane`); '' (or absent, from an older holder) when it offers none. */
  localLane?: string;
}

/** One call of a `Session` stream: `payload` is the request of unary `method`, encoded. */
export interface SessionRequestMsg {
  id: number;
  method: string;
  payload: Buffer;
  timeoutMs: number;
}

/** The answer to a {@link SessionRequestMsg}: status `code` (0: `payload` is the method's response). */
export interface SessionResponseMsg {
  id: number;
  code: number;
  details: string;
  /** Only with an overload RESOURCE_EXHAUSTED. */
  retryAfterMs?: number;
  payload: Buffer;
}

/** The unary methods, by the names `Session` messages carry. */
export type LockMethod = 'Acquire' | 'Release' | 'Renew' | 'Health' | 'ReleaseMany' | 'RenewMany';

export type Unary<Req, Res> = (
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
  ReleaseMany: Unary<ReleaseManyRequestMsg, ReleaseManyResponseMsg>;
  RenewMany: Unary<RenewManyRequestMsg, RenewManyResponseMsg>;
  Session: (metadata: grpc.Metadata, options?: grpc.CallOptions) => grpc.ClientDuplexStream<SessionRequestMsg, SessionResponseMsg>;
}

export interface LockServiceClientConstructor {
  new (address: string, credentials: grpc.ChannelCredentials, options?: grpc.ClientOptions): LockServiceClient;
  service: grpc.ServiceDefinition;
}

/** One unary method of the service, with the protobufjs codecs of `codec.ts`. */
function method<Req, Res>(name: string, req: MessageCodec<Req>, res: MessageCodec<Res>): grpc.MethodDefinition<Req, Res> {
  return {
    path: `/${LOCK_SERVICE_NAME}/${name}`,
    requestStream: false,
    responseStream: false,
    requestSerialize: req.encode,
    requestDeserialize: req.decode,
    responseSerialize: res.encode,
    responseDeserialize: res.decode,
    originalName: name.charAt(0).toLowerCase() + name.slice(1),
  };
}

let cached: { service: grpc.ServiceDefinition; Client: LockServiceClientConstructor; codec: LockCodec } | undefined;

/**
 * The protocol, built once per process: the service definition and the client
 * constructor. The `.proto` file is loaded once with protobufjs; messages go through its
 * generated encoders and decoders (see `codec.ts`) and have the same shapes
 * `@grpc/proto-loader` would give them (`longs: Number, enums: String, bytes: Buffer,
 * defaults, arrays`), without its generic object conversion on every call.
 */
export function loadLockProtocol(): { service: grpc.ServiceDefinition; Client: LockServiceClientConstructor; codec: LockCodec } {
  if (cached) return cached;
  const c = createLockCodec(LOCK_PROTO_PATH);
  const service: grpc.ServiceDefinition = {
    Acquire: method('Acquire', c.AcquireRequest, c.AcquireResponse),
    Release: method('Release', c.ReleaseRequest, c.ReleaseResponse),
    Renew: method('Renew', c.RenewRequest, c.RenewResponse),
    Health: method('Health', c.HealthRequest, c.HealthResponse),
    ReleaseMany: method('ReleaseMany', c.ReleaseManyRequest, c.ReleaseManyResponse),
    RenewMany: method('RenewMany', c.RenewManyRequest, c.RenewManyResponse),
    Session: {
      path: `/${LOCK_SERVICE_NAME}/Session`,
      requestStream: true,
      responseStream: true,
      requestSerialize: c.SessionRequest.encode,
      requestDeserialize: c.SessionRequest.decode,
      responseSerialize: c.SessionResponse.encode,
      responseDeserialize: c.SessionResponse.decode,
      originalName: 'session',
    },
  };
  const Client = grpc.makeGenericClientConstructor(service, 'LockService') as unknown as LockServiceClientConstructor;
  cached = { service: Client.service, Client, codec: c };
  return cached;
}

/**
 * Trailing-metadata key a holder past its concurrency limit sets on RESOURCE_EXHAUSTED: how
 * long (ms) the requester should wait before retrying. Its presence also says that nothing
 * was done, so the call is safe to repeat.
 */
export const RETRY_AFTER_METADATA_KEY = 'tensorwire-retry-after-ms';

/**
 * The retry-after (ms) an overloaded holder's RESOURCE_EXHAUSTED carries, or undefined (another
 * status, no trailer, or one that is not a non-negative number).
 */
export function retryAfterOf(error: Partial<grpc.ServiceError> | null | undefined): number | undefined {
  if (error?.code !== grpc.status.RESOURCE_EXHAUSTED) return undefined;
  const after = error.metadata?.get(RETRY_AFTER_METADATA_KEY)[0];
  if (after === undefined) return undefined;
  const ms = Number(after);
  return Number.isFinite(ms) && ms >= 0 ? ms : undefined;
}

/** Metadata key carrying the shared token: `authorization: Bearer <token>`. */
export const AUTH_METADATA_KEY = 'authorization';
