// The runnable blocks of a README. A code block is runnable when an HTML comment right before
// its fence says so (GitHub does not render it):
//
//   <!-- runnable file="producer.mjs" run="node producer.mjs" expect="21" needs="etcd" -->
//
// file:   the name the README tells the reader to save the block as (required; the README's
//         text before the block must name it in backticks, and the `run` / `build` command too)
// run:    the command the README gives to run it, in the directory holding every runnable file
//         of that README (blocks without `run` are only saved: a module another block imports,
//         a tsconfig.json)
// build:  a command run before `run` that does not need `needs` (e.g. `npx tsc -p .`)
// expect: text the run must print
// needs:  comma separated: etcd (started on 127.0.0.1:2379 for the run), rdma (an active port)
const MARKER = /<!--\s*runnable\b([^>]*)-->\s*\n(?:\s*\n)*```[\w-]*\n([\s\S]*?)\n```/g;
const ATTR = /(\w+)="([^"]*)"/g;

export function readmeBlocks(markdown, where = 'README') {
  const out = [];
  for (let m = MARKER.exec(markdown); m; m = MARKER.exec(markdown)) {
    const attrs = Object.fromEntries([...m[1].matchAll(ATTR)].map((a) => [a[1], a[2]]));
    const line = markdown.slice(0, m.index).split('\n').length;
    if (!attrs.file) throw new Error(`${where}:${line}: a runnable block needs file="…"`);
    const prose = markdown.slice(Math.max(0, m.index - 800), m.index);
    for (const said of [attrs.file, attrs.run, attrs.build].filter(Boolean)) {
      if (!prose.includes(`\`${said}\``)) throw new Error(`${where}:${line}: the text before the block must tell the reader \`${said}\``);
    }
    if (out.some((b) => b.file === attrs.file)) throw new Error(`${where}:${line}: two runnable blocks save as ${attrs.file}`);
    out.push({
      file: attrs.file,
      run: attrs.run,
      build: attrs.build,
      expect: attrs.expect,
      needs: (attrs.needs ?? '').split(',').filter(Boolean),
      code: `${m[2]}\n`,
      line: line + 1,
    });
  }
  return out;
}
