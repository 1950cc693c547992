/** What the loader (`@tensorwire/core/addon`) needs to know about this package's addon. */
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { AddonSpec } from '@tensorwire/core/addon';

export const ADDON_SPEC: AddonSpec = {
  name: '@tensorwire/cuda-ipc',
  // dist/ or src/ -> the package directory
  root: resolve(dirname(fileURLToPath(import.meta.url)), '..'),
  envVar: 'TENSORWIRE_CUDA_IPC_ADDON',
  extraDebianPackages: [],
  cmakeDefines: [],
};
