/**
 * Line ranges for Stryker's `mutate` (`file:start-end`), found by what the code is, not by
 * fixed numbers: files under concurrent edit keep their methods, not their line numbers.
 *
 * blockRange(file, anchor): from the first line matching `anchor` to the line that closes the
 * brace block opened on it (brace counting; braces inside strings balance in this code base).
 * Paths are relative to the package (Stryker runs with cwd = the package).
 */
import { readFileSync } from 'node:fs';

export function blockRange(file, anchor, cwd = process.cwd()) {
  const lines = readFileSync(`${cwd}/${file}`, 'utf8').split('\n');
  const start = lines.findIndex((l) => anchor.test(l));
  if (start < 0) throw new Error(`mutate range: ${anchor} not found in ${file} (renamed? update scripts/mutate)`);
  let depth = 0;
  let opened = false;
  for (let i = start; i < lines.length; i++) {
    for (const ch of lines[i]) {
      if (ch === '{') {
        depth++;
        opened = true;
      } else if (ch === '}') depth--;
    }
    if (opened && depth <= 0) return `${file}:${start + 1}-${i + 1}`;
  }
  throw new Error(`mutate range: no end for ${anchor} in ${file}`);
}

/** A method of a class (two-space indented), by name: `#name(`, `name(`, `async name(`, `get name(`. */
export function method(file, name, cwd) {
  const n = name.replace(/[.*+?^${}()|[\]\\#]/g, '\\$&');
  return blockRange(file, new RegExp(`^  (?:async |static |get |private )*${n}\\s*[(<]`), cwd);
}

/** A top-level function, by name. */
export function fn(file, name, cwd) {
  return blockRange(file, new RegExp(`^(?:export )?(?:async )?function ${name}\\s*[(<]`), cwd);
}

/** Several methods of one file. */
export function methods(file, names, cwd) {
  return names.map((m) => method(file, m, cwd));
}

/** The engine's connection table, deadline and abort handling, and the remote-descriptor checks. */
export const ENGINE_METHODS = ['#remoteFor', '#deadlineSignal', '#transfer', '#runPrepared', '#post', '#execute', '#connection', '#open', '#adopt', '#inbound', '#disposeOtherIncarnations', '#takeEntries', '#invalidateEntry', '#dispose', 'invalidate', '#close'];

export function engineRanges(which = ENGINE_METHODS, cwd) {
  const out = [];
  for (const m of which) out.push(method('src/engine.ts', m, cwd));
  return out;
}
