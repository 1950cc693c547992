// npm "install" hook. In a development checkout before the first build there is no dist/ yet
// (the workspace build compiles the addon itself): nothing to do.
import { existsSync } from 'node:fs';
import { URL } from 'node:url';

const hook = new URL('../dist/install.js', import.meta.url);
if (existsSync(hook)) await import(hook.href);
