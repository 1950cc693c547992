/**
 * The gallery's reference transport passes the whole conformance suite, in every shape a valid
 * transport may take: the suite must not assume a chunk size, a stream count or a host layout.
 */
import { describeTransportConformance } from '../src/testing/index.js';
import { ReferenceTransport, referenceSocketAddress, type ReferenceOptions } from './gallery/reference.js';

const shapes: [string, ReferenceOptions, number][] = [
  ['gallery reference', {}, 1000],
  ['gallery reference, 64 KiB chunks', { maxChunkBytes: 64 * 1024 }, 100],
  ['gallery reference, one stream', { maxStreams: 1 }, 100],
  ['gallery reference, same host only', { remote: false }, 100],
  ['gallery reference, between hosts only', { local: false }, 100],
];
for (const [name, options, churnCycles] of shapes) {
  describeTransportConformance({ name, createTransport: () => new ReferenceTransport(options), socketAddress: referenceSocketAddress, churnCycles });
}
