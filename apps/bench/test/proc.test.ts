/** The worker channel: a worker's last answer reaches the parent even when it is large and the worker leaves at once. */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';

describe('workerInit().sent', () => {
  it('a 1 MiB answer sent just before disconnecting arrives whole', async () => {
    const child = fork(fileURLToPath(new URL('./fixtures/big-result.mjs', import.meta.url)), [String(1 << 20)], { serialization: 'advanced', stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    const got: unknown[] = [];
    child.on('message', (m) => got.push(m));
    const [code] = await once(child, 'exit');
    expect(code).toBe(0);
    expect(got).toHaveLength(1);
    const samples = (got[0] as { samples: number[] }).samples;
    expect(samples).toHaveLength((1 << 20) / 8);
    expect(samples[samples.length - 1]).toBe(samples.length - 1);
  });
});
