/**
 * The README's TypeScript blocks compile as written: they are extracted from README.md and
 * typechecked with the repository's compiler settings against the built package (what a
 * plugin author gets from npm), not against the sources.
 */
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import ts from 'typescript';
import { afterAll, describe, expect, it } from 'vitest';

const pkg = join(dirname(fileURLToPath(import.meta.url)), '..');
const dir = join(pkg, '.readme-check');

/** ```ts blocks, each with the file name its first comment or the text before it gives. */
function tsBlocks(markdown: string): { name: string; code: string }[] {
  const out: { name: string; code: string }[] = [];
  const re = /```ts\n([\s\S]*?)```/g;
  for (let m = re.exec(markdown); m; m = re.exec(markdown)) {
    const code = m[1] as string;
    const before = markdown.slice(Math.max(0, m.index - 400), m.index);
    const named = /^\/\/ ([\w.-]+\.ts)\b/.exec(code)?.[1] ?? /`([\w.-]+\.ts)`[^`]*$/.exec(before)?.[1] ?? `block-${out.length}.ts`;
    out.push({ name: named, code });
  }
  return out;
}

describe('README code', () => {
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('every TypeScript block of the README typechecks (strict, NodeNext, the built package)', () => {
    const blocks = tsBlocks(readFileSync(join(pkg, 'README.md'), 'utf8'));
    expect(blocks.map((b) => b.name)).toEqual(expect.arrayContaining(['my-transport.ts', 'my-transport.conformance.test.ts']));
    rmSync(dir, { recursive: true, force: true });
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'package.json'), JSON.stringify({ type: 'module', private: true }));
    const files = blocks.map((b) => {
      const f = join(dir, b.name);
      writeFileSync(f, b.code);
      return f;
    });
    const base = ts.readConfigFile(join(pkg, '..', '..', 'tsconfig.base.json'), (p) => ts.sys.readFile(p));
    const parsed = ts.parseJsonConfigFileContent(base.config, ts.sys, dir);
    const program = ts.createProgram(files, { ...parsed.options, noEmit: true, skipLibCheck: true, incremental: false });
    const diagnostics = ts.getPreEmitDiagnostics(program).map((d) => `${d.file ? `${d.file.fileName.replace(`${dir}/`, '')}: ` : ''}${ts.flattenDiagnosticMessageText(d.messageText, '\n')}`);
    expect(diagnostics).toEqual([]);
  });
});
