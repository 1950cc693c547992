/** The npm `install` hook (scripts/install.mjs runs it): see installHook in load.ts. */
import { ADDON_SPEC } from './addon-spec.js';
import { installHook } from './load.js';

installHook(ADDON_SPEC);
