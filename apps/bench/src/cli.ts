#!/usr/bin/env node
/**
 * tensorwire-bench: the benchmark CLI. Every figure is printed beside a baseline measured in
 * the same run, and every byte moved is verified. See the package README.
 */
import { writeFileSync } from 'node:fs';
import os from 'node:os';
import { Command, CommanderError, Option } from 'commander';
import cliProgress from 'cli-progress';
import { killAllWorkers } from './proc.js';
import { renderHtml } from './report.js';
import { renderTables } from './render.js';
import { SCHEMA_VERSION } from './schema.js';
import { SCENARIOS, type ScenarioName } from './scenarios/index.js';
import { iperf3, ucxPerftest } from './external.js';
import { BenchError, type ScenarioContext, type ScenarioResult } from './types.js';
import { parseBytes } from './units.js';

const VERSION = '0.1.0';

interface GlobalOptions {
  json?: boolean;
  report?: string;
  quick?: boolean;
  sizes?: string;
  total?: string;
  compare?: boolean;
  progress?: boolean;
}

function machine(): Record<string, unknown> {
  return {
    platform: process.platform,
    arch: process.arch,
    cpus: os.cpus().length,
    cpuModel: os.cpus()[0]?.model ?? 'unknown',
    memoryBytes: os.totalmem(),
    node: process.version,
  };
}

function context(opts: GlobalOptions, signal: AbortSignal): ScenarioContext {
  const sizes = opts.sizes?.split(',').map((s) => parseBytes(s, 'block size'));
  if (sizes) for (const s of sizes) if (s > 1024 ** 3) throw new BenchError(`block size ${s} is larger than 1 GiB`);
  const totalBytes = opts.total !== undefined ? parseBytes(opts.total, 'total') : undefined;
  const showProgress = opts.progress !== false && !opts.json && process.stderr.isTTY === true;
  const bar = showProgress ? new cliProgress.SingleBar({ format: '{label} [{bar}] {value}/{total}', clearOnComplete: true, stream: process.stderr }, cliProgress.Presets.shades_classic) : undefined;
  let started = false;
  return {
    signal,
    quick: opts.quick === true,
    ...(sizes ? { sizes } : {}),
    ...(totalBytes !== undefined ? { totalBytes } : {}),
    progress(label, done, total) {
      if (!bar) return;
      if (!started) {
        bar.start(total, done, { label });
        started = true;
      } else {
        bar.setTotal(total);
        bar.update(done, { label });
      }
      if (done >= total) {
        bar.stop();
        started = false;
      }
    },
    log(line) {
      if (!opts.json) process.stderr.write(`${line}\n`);
    },
  };
}

async function compare(results: ScenarioResult[], opts: GlobalOptions): Promise<ScenarioResult[]> {
  if (!opts.compare) return results;
  const block = 4 * 1024 * 1024;
  const ip = await iperf3(block, opts.quick ? 64 * 1024 * 1024 : 1024 ** 3);
  const ucx = await ucxPerftest(block, opts.quick ? 20 : 200);
  return [
    ...results,
    {
      scenario: 'compare',
      measurements: [...ip.measurements, ...ucx.measurements],
      ratios: [],
      verificationFailures: 0,
      notes: [...ip.notes, ...ucx.notes, 'external tools on loopback at 4 MiB blocks, run right after the scenarios above'],
    },
  ];
}

async function execute(command: string, names: readonly ScenarioName[], opts: GlobalOptions): Promise<void> {
  const startedAt = new Date();
  const ac = new AbortController();
  const ctx = context(opts, ac.signal);
  let results: ScenarioResult[] = [];
  for (const name of names) results.push(await SCENARIOS[name](ctx));
  results = await compare(results, opts);
  const output = {
    schemaVersion: SCHEMA_VERSION,
    tool: 'tensorwire-bench',
    version: VERSION,
    command,
    startedAt: startedAt.toISOString(),
    durationMs: Date.now() - startedAt.getTime(),
    machine: machine(),
    results,
  };
  if (opts.json) process.stdout.write(`${JSON.stringify(output, null, 2)}\n`);
  else process.stdout.write(`${renderTables(results)}\n`);
  if (opts.report) {
    writeFileSync(opts.report, renderHtml(output));
    if (!opts.json) process.stdout.write(`report written to ${opts.report}\n`);
  }
  const failures = results.reduce((s, r) => s + r.verificationFailures, 0);
  if (failures > 0) throw new BenchError(`${failures} verification failure(s): bytes moved did not match`);
}

function withGlobals(cmd: Command): Command {
  return cmd
    .option('--json', 'print machine-readable JSON (schema version 1) instead of tables')
    .option('--report <file>', 'also write a self-contained HTML report with charts')
    .option('--quick', 'tiny sizes and few iterations (CI smoke runs)')
    .option('--sizes <list>', 'comma-separated block sizes for the sweep, e.g. 4KiB,1MiB,64MiB')
    .option('--total <size>', 'bytes to move per measurement, e.g. 1GiB')
    .option('--compare', 'also run iperf3 and ucx_perftest (UCX over tcp and posix shm) where installed')
    .option('--no-progress', 'no progress bar');
}

export function program(): Command {
  const p = new Command('tensorwire-bench')
    .description('Benchmarks for tensorwire: every figure beside a baseline from the same run, every byte verified.')
    .version(VERSION)
    .exitOverride()
    .configureOutput({ writeErr: (s) => process.stderr.write(s) })
    .showHelpAfterError(false);
  p.addOption(new Option('--debug', 'print stack traces on errors').hideHelp());
  withGlobals(p.command('run', { isDefault: true }).description('the remote-fetch flow end to end: holder process (pool, lock service, transports) and requester process'))
    .option('--duration <seconds>', 'how long the requester fetches', '10')
    .action((opts: GlobalOptions) => execute('run', ['run'], opts));
  for (const [name, description] of [
    ['tcp', 'TCP transport READ vs a raw node:net stream, block-size sweep'],
    ['pool', 'shared-memory pool: producer writes vs memcpy, consumer pass over a view vs local memory'],
    ['locks', 'lease acquire/release cycles vs a plain gRPC echo; requesters killed mid-lease'],
    ['rdma', 'RDMA READ/WRITE with 1, 2, 4 QPs vs perftest (needs an RDMA device)'],
  ] as const) {
    withGlobals(p.command(name).description(description)).action((opts: GlobalOptions) => execute(name, [name], opts));
  }
  return p;
}

async function main(argv: string[]): Promise<number> {
  const debug = argv.includes('--debug') || process.env['TENSORWIRE_DEBUG'] === '1';
  try {
    await program().parseAsync(argv);
    return 0;
  } catch (e) {
    killAllWorkers();
    if (e instanceof CommanderError) return e.exitCode === 0 ? 0 : 2; // commander already printed one line
    const message = e instanceof Error ? e.message : String(e);
    process.stderr.write(`tensorwire-bench: ${message}\n`);
    if (debug && e instanceof Error && e.stack) process.stderr.write(`${e.stack}\n`);
    return 1;
  }
}

main(process.argv).then((code) => {
  process.exitCode = code;
});
