/**
 * gRPC status ↔ tensorwire typed errors.
 *
 * Client side: every failed call surfaces as a `TensorwireError` from `@tensorwire/core`:
 * UNAVAILABLE → ConnectionBrokenError, DEADLINE_EXCEEDED → TimedOutError,
 * RESOURCE_EXHAUSTED → ResourceExhaustedError, INVALID_ARGUMENT → InvalidInputError,
 * CANCELLED → AbortedError, everything else → RemoteRejectedError with
 * `details.remoteCode` set to the status name (`'PERMISSION_DENIED'`, `'NOT_FOUND'`…).
 */
import { status, type ServiceError } from '@grpc/grpc-js';
import {
  AbortedError,
  ConnectionBrokenError,
  InvalidInputError,
  RemoteRejectedError,
  ResourceExhaustedError,
  TimedOutError,
  type TensorwireError,
} from '@tensorwire/core';

/** gRPC status names this package uses on the wire. */
export type LeaseStatus =
  | 'INVALID_ARGUMENT'
  | 'RESOURCE_EXHAUSTED'
  | 'PERMISSION_DENIED'
  | 'UNAUTHENTICATED'
  | 'NOT_FOUND'
  | 'ALREADY_EXISTS'
  | 'ABORTED'
  | 'UNAVAILABLE'
  | 'FAILED_PRECONDITION'
  | 'INTERNAL';

/**
 * An error with the gRPC status the holder answers with. The lease table throws these,
 * and a holder's `pin` hook or resolver may throw one to choose the status (for example
 * `new LeaseError('NOT_FOUND', 'no block block:a:7')`). Anything else thrown by a hook
 * is answered with INTERNAL (InvalidInputError → INVALID_ARGUMENT, ResourceExhaustedError
 * → RESOURCE_EXHAUSTED).
 */
export class LeaseError extends Error {
  override readonly name = 'LeaseError';
  readonly status: LeaseStatus;
  constructor(statusName: LeaseStatus, message: string) {
    super(message);
    this.status = statusName;
  }
  /** The numeric gRPC status. */
  get grpcCode(): status {
    return status[this.status];
  }
}

/** The numeric gRPC status for a name. */
export function grpcCodeOf(name: LeaseStatus): status {
  return status[name];
}

function statusName(code: number): string {
  const name = (status as unknown as Record<number, string>)[code];
  return typeof name === 'string' ? name : `STATUS_${code}`;
}

/** True for a value shaped like a grpc-js ServiceError. */
export function isServiceError(value: unknown): value is ServiceError {
  return value instanceof Error && typeof (value as Partial<ServiceError>).code === 'number';
}

/** Map a failed gRPC call to a typed error. `what` names the operation for the message. */
export function fromGrpcError(error: unknown, what: string, extra: Record<string, unknown> = {}): TensorwireError {
  if (!isServiceError(error)) {
    const message = error instanceof Error ? error.message : String(error);
    return new ConnectionBrokenError(`${what}: ${message}`, { cause: error, details: extra });
  }
  const remoteCode = statusName(error.code);
  const details = { ...extra, remoteCode, grpcCode: error.code };
  const message = `${what}: ${remoteCode}: ${error.details || error.message}`;
  const options = { cause: error, details };
  switch (error.code) {
    case status.UNAVAILABLE:
      return new ConnectionBrokenError(message, options);
    case status.DEADLINE_EXCEEDED:
      return new TimedOutError(message, options);
    case status.RESOURCE_EXHAUSTED:
      return new ResourceExhaustedError(message, options);
    case status.INVALID_ARGUMENT:
      return new InvalidInputError(message, options);
    case status.CANCELLED:
      return new AbortedError(message, options);
    default:
      return new RemoteRejectedError(message, options);
  }
}

/** Statuses after which repeating the same release can never succeed. */
export function isPermanentReleaseFailure(error: TensorwireError): boolean {
  const code = error.details['grpcCode'];
  return (
    code === status.PERMISSION_DENIED ||
    code === status.UNAUTHENTICATED ||
    code === status.INVALID_ARGUMENT ||
    code === status.UNIMPLEMENTED
  );
}
