/**
 * Counting the process's live async resources (sockets, servers, timers — unref'd ones too —
 * immediates, requests) for the leak test. `process.getActiveResourcesInfo()` lists only what
 * keeps the event loop alive, so an unref'd timer or socket never shows there; async_hooks sees
 * every resource from its creation to its destruction. Not counted: promises and crypto jobs
 * (`RANDOMBYTESREQUEST`, `PBKDF2REQUEST`… — a synchronous `randomBytes()` makes one), which the
 * garbage collector destroys, not the code under test. No test-runner imports.
 */
import { createHook } from 'node:async_hooks';

/** Resource types destroyed by the garbage collector rather than by the code that made them. */
const COLLECTED = /^PROMISE$|REQUEST$/;

export class ResourceTracker {
  readonly #live = new Map<number, string>();
  readonly #hook = createHook({
    init: (id, type) => {
      if (!COLLECTED.test(type)) this.#live.set(id, type);
    },
    destroy: (id) => {
      this.#live.delete(id);
    },
  });

  /** Start tracking: only resources created from now on are counted. */
  start(): this {
    this.#hook.enable();
    return this;
  }

  stop(): void {
    this.#hook.disable();
  }

  /** Live resources by type (`Timeout`, `TCPWRAP`, `PIPEWRAP`, `Immediate`…). */
  counts(): Map<string, number> {
    const out = new Map<string, number>();
    for (const type of this.#live.values()) out.set(type, (out.get(type) ?? 0) + 1);
    return out;
  }

  get total(): number {
    return this.#live.size;
  }
}

/** `type: before -> after` for every type that has more live resources in `after`. */
export function grownTypes(before: ReadonlyMap<string, number>, after: ReadonlyMap<string, number>): string[] {
  const out: string[] = [];
  for (const [type, n] of after) {
    const was = before.get(type) ?? 0;
    if (n > was) out.push(`${type}: ${was} -> ${n}`);
  }
  return out;
}

/** Active resources that keep the event loop alive, by type (Immediates left out: the test's own). */
export function activeResources(): Map<string, number> {
  const out = new Map<string, number>();
  for (const type of process.getActiveResourcesInfo()) if (type !== 'Immediate') out.set(type, (out.get(type) ?? 0) + 1);
  return out;
}
