/// <reference types="node" preserve="true" />
export { EtcdDiscovery, parseEtcdUrl } from './etcd-discovery.js';
export type { EtcdDiscoveryOptions, EtcdDiscoveryStats, EtcdTlsOptions, PemInput } from './etcd-discovery.js';
