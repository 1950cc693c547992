/** The plain gRPC unary echo the `locks` scenario measures as its baseline (raw bytes, no protobuf). */
import type * as grpc from '@grpc/grpc-js';

export const ECHO_SERVICE: grpc.ServiceDefinition = {
  Echo: {
    path: '/tensorwire.bench.Echo/Echo',
    requestStream: false,
    responseStream: false,
    requestSerialize: (b: Buffer) => b,
    requestDeserialize: (b: Buffer) => b,
    responseSerialize: (b: Buffer) => b,
    responseDeserialize: (b: Buffer) => b,
  },
};
