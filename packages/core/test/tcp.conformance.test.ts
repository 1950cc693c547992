import { describeTransportConformance } from '../src/testing/index.js';
import { TcpTransport, decodeTcpEndpoint, encodeTcpEndpoint } from '../src/index.js';

describeTransportConformance({
  name: 'tcp',
  createTransport: () => new TcpTransport(),
  // Lets the suite put a stalling relay between two nodes (the stalled-peer cases).
  socketAddress: {
    decode: (endpoint) => decodeTcpEndpoint(endpoint),
    encode: (address) => {
      if (!('port' in address)) throw new Error('a tcp endpoint names a host and a port');
      return encodeTcpEndpoint(address.host, address.port);
    },
  },
});
