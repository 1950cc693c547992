/**
 * One gallery variant under the conformance suite, in its own vitest process (see
 * ../gallery.test.ts): TENSORWIRE_GALLERY_BUG names the bug class (a key of BUGS).
 */
import { describeTransportConformance } from '../../src/testing/index.js';
import { BUGS, ReferenceTransport, referenceSocketAddress, type Bug } from './reference.js';

const bug = process.env['TENSORWIRE_GALLERY_BUG'] as Bug | undefined;
if (bug === undefined || !(bug in BUGS)) throw new Error(`TENSORWIRE_GALLERY_BUG must name one of: ${Object.keys(BUGS).join(', ')}`);

describeTransportConformance({
  name: `gallery variant ${bug}`,
  createTransport: () => new ReferenceTransport({ bug, revokeGraceMs: 500, retireTimeoutMs: 2000 }),
  socketAddress: referenceSocketAddress,
  churnCycles: 50,
  settleGuardMs: 4000,
});
