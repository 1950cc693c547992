/// <reference types="node" preserve="true" />
export {
  RdmaTransport,
  RdmaConnection,
  DEFAULT_CONTROL_LIMITS,
  type RdmaTransportOptions,
  type RdmaBackend,
  type RdmaControlLimits,
  type BoundReason,
  type CudaDmabufExport,
} from './transport.js';
export { capabilities, isAvailable, toDeviceRecord, usablePort, readNumaNode, readGidAttrs, SYSFS_INFINIBAND, type RdmaCapabilities, type CapabilityOptions } from './capabilities.js';
export * from './attributes.js';
export * from './wire.js';
export { WindowLedger, WindowKeyCache, Binding, tokenHex, refusal, MAX_BINDS_IN_FLIGHT, type WindowKeys, type RefuseCode, type BindRequest } from './windows.js';
export { GrantTableCache, layoutGrant, grantKey, MAX_CACHED_GRANT_RANGES, type GrantTable, type GrantLayout, type GrantFields, type GrantTerms } from './grants.js';
export {
  loadNative,
  tryLoadNative,
  addonCandidates,
  nativeError,
  Access,
  WcStatus,
  WcOpcode,
  WrField,
  WR_STRIDE,
  SgeField,
  SGE_STRIDE,
  ADDON_FILE,
  type NativeAddon,
  type NativeDevice,
  type NativeCounters,
  type NativeProbe,
  type NativeDeviceInfo,
  type NativePort,
  type NativeMr,
  type NativeMw,
  type BindResult,
  type NativeQp,
  type RtrAttributes,
  type RtsAttributes,
  type PostResult,
  type LoadResult,
  type NativeGid,
  type CompletionListener,
} from './native.js';
export type { PlatformInfo } from '@tensorwire/core/addon';

import { tryLoadNative, type NativeCounters } from './native.js';

/** Live native resources (devices, PDs, MRs, CQs, QPs, channels, poller threads) in this environment. */
export function nativeCounters(): NativeCounters | undefined {
  const r = tryLoadNative();
  return 'addon' in r ? r.addon.counters() : undefined;
}
