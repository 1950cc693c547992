export * from './errors.js';
export * from './ids.js';
export * from './codec.js';
export * from './logger.js';
export * from './transport.js';
export * from './descriptor.js';
export * from './host-id.js';
