/// <reference types="node" preserve="true" />
export { TensorPool, PoolView } from './pool.js';
export type { PoolOptions, SlotSpec, WriteOptions, ReadOptions, FreeResult, PoolViewInfo, Device } from './pool.js';
export { CudaIpcTransport, decodePayload, decodeEndpointBlob } from './transport.js';
export type { CudaIpcTransportOptions, CudaIpcLimits, CudaIpcPeerEvent, RemoteGrant, RemoteRangeGrant, EndpointInfo } from './transport.js';
export { allocateSharedMemory, releaseSharedMemory, sweep } from './shared.js';
export type { SweepReport } from './shared.js';
export { capabilities, isAvailable, native, addonCandidates, SegmentKind, SegmentState, GrantResult } from './native.js';
export type { BatchPlanHandle, Capabilities, NativeAddon, SegmentMeta, SegmentLocator, SegmentInit, NativeLayout, CudaProbe, CudaExport } from './native.js';
export type { PlatformInfo } from '@tensorwire/core/addon';
export type { TableGeometry } from './grants.js';
export { DTYPES, MAX_NDIM } from './dtype.js';
export type { Dtype, TypedArrayFor } from './dtype.js';
export { poolSegmentName, poolIdFromSegmentName, segmentNameProblem } from './names.js';
export { isProcessAlive, processStartTime } from './proc.js';
