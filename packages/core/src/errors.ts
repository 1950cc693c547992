/**
 * Typed errors. Every error tensorwire raises is a {@link TensorwireError} with a stable
 * `code`. Policy lives in the codes: only {@link ConnectionBrokenError} tears a connection
 * down; {@link ResourceExhaustedError} is local backpressure and keeps the connection.
 */

export const ErrorCode = {
  ConnectionBroken: 'TW_CONNECTION_BROKEN',
  SessionInvalidated: 'TW_SESSION_INVALIDATED',
  ResourceExhausted: 'TW_RESOURCE_EXHAUSTED',
  RemoteRejected: 'TW_REMOTE_REJECTED',
  TimedOut: 'TW_TIMED_OUT',
  Aborted: 'TW_ABORTED',
  InvalidInput: 'TW_INVALID_INPUT',
  BackendUnavailable: 'TW_BACKEND_UNAVAILABLE',
  Closed: 'TW_CLOSED',
} as const;
export type ErrorCode = (typeof ErrorCode)[keyof typeof ErrorCode];

const ALL_CODES: ReadonlySet<string> = new Set(Object.values(ErrorCode));

export interface TensorwireErrorOptions {
  cause?: unknown;
  /** Free-form structured details (peer, transport, field names…). */
  details?: Readonly<Record<string, unknown>>;
}

export abstract class TensorwireError extends Error {
  abstract readonly code: ErrorCode;
  readonly details: Readonly<Record<string, unknown>>;
  constructor(message: string, options: TensorwireErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.details = options.details ?? {};
  }
  override get name(): string {
    return this.constructor.name;
  }
  /** True when this error means the connection it happened on can no longer be used. */
  get breaksConnection(): boolean {
    return false;
  }
  toJSON(): { code: ErrorCode; message: string; details: Readonly<Record<string, unknown>> } {
    return { code: this.code, message: this.message, details: this.details };
  }
}

/** The connection is unusable (peer died, socket reset, protocol violation, QP in error). */
export class ConnectionBrokenError extends TensorwireError {
  readonly code: ErrorCode = ErrorCode.ConnectionBroken;
  override get breaksConnection(): boolean {
    return true;
  }
}

/**
 * Work that was accepted but never started because its connection (session) was
 * invalidated first. Raised for every queued operation; never silently dropped.
 */
export class SessionInvalidatedError extends ConnectionBrokenError {
  override readonly code: ErrorCode = ErrorCode.SessionInvalidated;
}

/** A local resource ran out (queue depth, send credits, staging memory). Back off and retry; the connection stays. */
export class ResourceExhaustedError extends TensorwireError {
  readonly code = ErrorCode.ResourceExhausted;
}

/** The remote side refused the request (revoked grant, bad token, out of bounds, unknown registration). */
export class RemoteRejectedError extends TensorwireError {
  readonly code = ErrorCode.RemoteRejected;
  /** The code the remote side gave, when it gave one. */
  get remoteCode(): string | undefined {
    const c = this.details['remoteCode'];
    return typeof c === 'string' ? c : undefined;
  }
}

/** The operation's deadline passed. Hardware and sockets were quiesced before this was raised. */
export class TimedOutError extends TensorwireError {
  readonly code = ErrorCode.TimedOut;
}

/** The caller's AbortSignal fired. Quiesced before raised, like a timeout. */
export class AbortedError extends TensorwireError {
  readonly code = ErrorCode.Aborted;
}

/** The caller passed something malformed: bad id, bad descriptor, out-of-range offsets. */
export class InvalidInputError extends TensorwireError {
  readonly code = ErrorCode.InvalidInput;
}

/** A backend cannot run here (library missing, no device, no active port). */
export class BackendUnavailableError extends TensorwireError {
  readonly code = ErrorCode.BackendUnavailable;
}

/** The object was closed before or while the operation ran. */
export class ClosedError extends TensorwireError {
  readonly code = ErrorCode.Closed;
}

export function isTensorwireError(value: unknown): value is TensorwireError {
  return value instanceof TensorwireError;
}

export function isErrorCode(value: unknown): value is ErrorCode {
  return typeof value === 'string' && ALL_CODES.has(value);
}

const CONSTRUCTORS: Record<ErrorCode, new (message: string, options?: TensorwireErrorOptions) => TensorwireError> = {
  [ErrorCode.ConnectionBroken]: ConnectionBrokenError,
  [ErrorCode.SessionInvalidated]: SessionInvalidatedError,
  [ErrorCode.ResourceExhausted]: ResourceExhaustedError,
  [ErrorCode.RemoteRejected]: RemoteRejectedError,
  [ErrorCode.TimedOut]: TimedOutError,
  [ErrorCode.Aborted]: AbortedError,
  [ErrorCode.InvalidInput]: InvalidInputError,
  [ErrorCode.BackendUnavailable]: BackendUnavailableError,
  [ErrorCode.Closed]: ClosedError,
};

/** Rebuild a typed error from its code (for errors that crossed a process boundary). */
export function errorFromCode(code: ErrorCode, message: string, options?: TensorwireErrorOptions): TensorwireError {
  return new CONSTRUCTORS[code](message, options);
}

/** Wrap anything thrown into a TensorwireError, keeping typed errors as they are. */
export function toTensorwireError(
  value: unknown,
  fallback: new (message: string, options?: TensorwireErrorOptions) => TensorwireError = ConnectionBrokenError,
): TensorwireError {
  if (value instanceof TensorwireError) return value;
  const message = value instanceof Error ? value.message : String(value);
  return new fallback(message, { cause: value });
}

/** The error for an aborted signal: a timeout reason becomes TimedOutError, anything else AbortedError. */
export function errorFromSignal(signal: AbortSignal, what: string): TensorwireError {
  const reason: unknown = signal.reason;
  if (reason instanceof TensorwireError) return reason;
  if (reason instanceof Error && reason.name === 'TimeoutError') {
    return new TimedOutError(`${what} timed out`, { cause: reason });
  }
  return new AbortedError(`${what} aborted`, { cause: reason });
}
