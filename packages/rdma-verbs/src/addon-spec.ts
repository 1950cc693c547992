/** What the loader (`@tensorwire/core/addon`) needs to know about this package's addon. */
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { AddonSpec } from '@tensorwire/core/addon';

export const ADDON_SPEC: AddonSpec = {
  name: '@tensorwire/rdma-verbs',
  // dist/ or src/ -> the package directory
  root: resolve(dirname(fileURLToPath(import.meta.url)), '..'),
  envVar: 'TENSORWIRE_RDMA_ADDON',
  extraDebianPackages: ['libibverbs-dev'],
  cmakeDefines: ['TW_REQUIRE_VERBS=ON'],
};
