/**
 * joinSignals (src/signals.ts): a signal that aborts when either source does, with that
 * source's reason, and unhooks from both when released or fired; never an AbortSignal.any
 * composite (which a long-lived source keeps listed for as long as it lives).
 */
import { getEventListeners } from 'node:events';
import { describe, expect, it } from 'vitest';
import { joinSignals } from '../src/signals.js';
import { dependants } from './helpers.js';

describe('joinSignals', () => {
  it('aborts with the reason of whichever source aborts first, and then holds on to neither', () => {
    for (const first of ['a', 'b'] as const) {
      const a = new AbortController();
      const b = new AbortController();
      const j = joinSignals(a.signal, b.signal);
      expect(j.signal.aborted).toBe(false);
      const reason = new Error(first);
      (first === 'a' ? a : b).abort(reason);
      expect(j.signal.aborted).toBe(true);
      expect(j.signal.reason).toBe(reason);
      expect(getEventListeners(a.signal, 'abort')).toHaveLength(0);
      expect(getEventListeners(b.signal, 'abort')).toHaveLength(0);
      (first === 'a' ? b : a).abort(new Error('later'));
      expect(j.signal.reason).toBe(reason);
    }
  });

  it('a source aborted already is the joined signal; release() unhooks from both', () => {
    const done = AbortSignal.abort(new Error('done'));
    const live = new AbortController();
    expect(joinSignals(done, live.signal).signal).toBe(done);
    expect(joinSignals(live.signal, done).signal).toBe(done);
    expect(getEventListeners(live.signal, 'abort')).toHaveLength(0);
    const long = new AbortController();
    for (let i = 0; i < 100; i++) {
      const short = new AbortController();
      const j = joinSignals(long.signal, short.signal);
      j.release();
      short.abort();
      expect(j.signal.aborted).toBe(false);
    }
    expect(getEventListeners(long.signal, 'abort')).toHaveLength(0);
    expect(dependants(long.signal) ?? 0).toBe(0);
  });
});
