export { EtcdDiscovery, parseEtcdUrl } from './etcd-discovery.js';
export type { EtcdDiscoveryOptions, EtcdDiscoveryStats } from './etcd-discovery.js';
