import { describeTransportConformance } from '../src/testing/index.js';
import { TcpTransport } from '../src/index.js';

describeTransportConformance({ name: 'tcp', createTransport: () => new TcpTransport() });
