/// <reference types="node" preserve="true" />
export * from './errors.js';
export * from './ids.js';
export * from './codec.js';
export * from './logger.js';
export * from './transport.js';
export * from './descriptor.js';
export * from './host-id.js';
export * from './deferred.js';
export * from './metrics.js';
export * from './engine.js';
export { engineCheckedBlocks } from './grant-check.js';
export * from './discovery.js';
export { TcpTransport, TcpConnection, encodeTcpEndpoint, decodeTcpEndpoint, type TcpTransportOptions } from './tcp/transport.js';
export * as tcpFrames from './tcp/frames.js';
export { Registry } from 'prom-client';
export * as kit from './kit/index.js';
export { UdsTransport, encodeUdsEndpoint, decodeUdsEndpoint, type UdsTransportOptions } from './uds/transport.js';
