export interface Deferred<T> {
  readonly promise: Promise<T>;
  resolve(value: T): void;
  reject(error: unknown): void;
  readonly settled: boolean;
  /** Resolved (not rejected). */
  readonly fulfilled: boolean;
}

export function deferred<T>(): Deferred<T> {
  let resolve!: (v: T) => void;
  let reject!: (e: unknown) => void;
  let settled = false;
  let fulfilled = false;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  // A deferred nobody awaits must not become an unhandled rejection.
  promise.catch(() => undefined);
  return {
    promise,
    resolve(v) {
      if (settled) return;
      settled = true;
      fulfilled = true;
      resolve(v);
    },
    reject(e) {
      if (settled) return;
      settled = true;
      reject(e);
    },
    get settled() {
      return settled;
    },
    get fulfilled() {
      return fulfilled;
    },
  };
}

/** Race a promise against a signal without cancelling the promise itself. */
export function raceSignal<T>(promise: Promise<T>, signal: AbortSignal | undefined, onAbort: () => unknown): Promise<T> {
  if (!signal) return promise;
  if (signal.aborted) return Promise.reject(onAbort());
  return new Promise<T>((resolve, reject) => {
    const listener = (): void => reject(onAbort());
    signal.addEventListener('abort', listener, { once: true });
    promise.then(
      (v) => {
        signal.removeEventListener('abort', listener);
        resolve(v);
      },
      (e: unknown) => {
        signal.removeEventListener('abort', listener);
        reject(e);
      },
    );
  });
}

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done(): void {
      clearTimeout(t);
      signal?.removeEventListener('abort', done);
      resolve();
    }
    signal?.addEventListener('abort', done, { once: true });
  });
}
