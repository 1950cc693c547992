import { describeTransportConformance } from '../src/testing/index.js';
import { UdsTransport, decodeUdsEndpoint, encodeUdsEndpoint } from '../src/index.js';

describeTransportConformance({
  name: 'uds',
  createTransport: () => new UdsTransport(),
  // Lets the suite put a stalling relay between two nodes (the stalled-peer cases).
  socketAddress: {
    decode: (endpoint) => ({ path: decodeUdsEndpoint(endpoint).path }),
    encode: (address, original) => {
      if (!('path' in address)) throw new Error('a uds endpoint names a socket path');
      return encodeUdsEndpoint(decodeUdsEndpoint(original).hostId, address.path);
    },
  },
});
