/** The npm `install` hook (scripts/install.mjs runs it): see installHook in `@tensorwire/core/addon`. */
import { ADDON_SPEC } from './addon-spec.js';
import { installHook } from '@tensorwire/core/addon';

installHook(ADDON_SPEC);
