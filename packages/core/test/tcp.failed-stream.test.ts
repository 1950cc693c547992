/**
 * A stream that fails while the holder is still parsing the chunk that made it fail (a peer
 * over its queue bound, in one burst) must not act on the rest of that chunk: a WRITEV head
 * taken after the failure would pin its grant for data that can never arrive, after the
 * stream has already released everything it held. Every grant use is given back.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { GRANT_STRIDE, type TcpTransport } from '../src/index.js';
import { encodeReadvReq, encodeWritevReq } from '../src/kit/frames.js';
import { holderNode, hostile } from './helpers/raw-peer.js';

const SIZE = 1 << 20;
const closers: (() => Promise<void>)[] = [];
afterEach(async () => {
  for (const c of closers.splice(0)) await c();
});

async function usersSettle(handle: { users: number }): Promise<number> {
  for (let i = 0; i < 100 && handle.users !== 0; i++) await new Promise((r) => setTimeout(r, 20));
  return handle.users;
}

describe('tcp responder: frames after a failure in the same chunk', () => {
  it('a peer cut off at its queue bound mid-chunk leaves no grant in use, even with a WRITEV head after the cut', async () => {
    const h = await holderNode('failed-stream', { sendHighWaterMark: 1, maxQueuedRequests: 2 });
    const t: TcpTransport = h.t;
    closers.push(() => t.close());
    const reg = await t.register({ kind: 'host', buffer: new Uint8Array(SIZE).fill(7) });
    const ranges = new Float64Array(GRANT_STRIDE);
    ranges.set([0, 0, SIZE]);
    const grant = t.grant({ handles: [reg.handle], count: 1, ranges, bytes: SIZE });
    const token = grant.payload;
    // One burst: READVs of 64 KiB (the first fills the socket past the 1-byte high-water mark,
    // the next two queue, the fourth is over maxQueuedRequests and fails the stream), then more
    // READVs and a WRITEV head whose data never follows, all in the chunk being parsed.
    const frames: Buffer[] = [];
    for (let i = 0; i < 8; i++) frames.push(encodeReadvReq(i + 1, [token], [{ token: 0, offset: i * 65536, length: 65536 }]));
    const data = new Uint8Array(4096);
    const writev = encodeWritevReq(100, [token], [{ token: 0, offset: 0, length: data.length }], data);
    frames.push(writev.subarray(0, writev.length - data.length));
    const res = await hostile(h, [Buffer.concat(frames)], { ms: 5000, pauseMs: 200 });
    expect(res.closedByPeer).toBe(true);
    expect(t.peerEventCounts.request_queue).toBe(1);
    expect(await usersSettle(grant.handle as unknown as { users: number })).toBe(0);
    expect(await usersSettle(reg.handle as unknown as { users: number })).toBe(0);
  });
});
