/**
 * Joining two abort signals without `AbortSignal.any`. A composite made by `AbortSignal.any`
 * stays listed among each source's dependants for as long as that source lives (Node 20: one
 * entry per call, never pruned), so joining a long-lived signal (a process's shutdown signal
 * passed to every fetch, the client's own close signal) call after call grows without bound.
 */

/** A signal that aborts when `a` or `b` does (with its reason), and `release()` to unhook it from both: call it when the operation is over. */
export interface JoinedSignal {
  readonly signal: AbortSignal;
  release(): void;
}

const NOTHING = (): void => undefined;

export function joinSignals(a: AbortSignal, b: AbortSignal): JoinedSignal {
  if (a.aborted) return { signal: a, release: NOTHING };
  if (b.aborted) return { signal: b, release: NOTHING };
  const ac = new AbortController();
  const release = (): void => {
    a.removeEventListener('abort', onA);
    b.removeEventListener('abort', onB);
  };
  const onA = (): void => {
    release();
    ac.abort(a.reason);
  };
  const onB = (): void => {
    release();
    ac.abort(b.reason);
  };
  a.addEventListener('abort', onA, { once: true });
  b.addEventListener('abort', onB, { once: true });
  return { signal: ac.signal, release };
}
