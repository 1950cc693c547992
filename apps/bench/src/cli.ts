#!/usr/bin/env node
/**
 * tensorwire-bench: the benchmark CLI. Every figure is printed beside a baseline measured in
 * the same run, and every byte moved is verified. See the package README.
 */
import './env.js';
import { writeFileSync } from 'node:fs';
import os from 'node:os';
import { Command, CommanderError, Option } from 'commander';
import cliProgress from 'cli-progress';
import { killAllWorkers } from './proc.js';
import { renderHtml } from './report.js';
import { renderTables } from './render.js';
import { SCHEMA_VERSION } from './schema.js';
import { SCENARIOS, type ScenarioName } from './scenarios/index.js';
import { runScenario, runSettings } from './scenarios/run.js';
import { kvScenario, kvSettings } from './scenarios/kv.js';
import { poolDevice, poolScenario } from './scenarios/pool.js';
import { locksBurst } from './scenarios/locks.js';
import { ASYNC_COPY_ENV, COPY_THREADS_ENV, TRANSPORT_CHOICES, asyncCopySetting, copyThreadsSetting, type TransportChoice } from './transports.js';
import { startHolder } from './holder.js';
import { runFetcher } from './fetcher.js';
import { publishHolder, resolveHolder } from './discovery.js';
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
  copyThreads?: string;
  asyncCopyBytes?: string;
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
  // Read where the same-host transport is built: in this process and in the workers it forks.
  if (opts.copyThreads !== undefined) process.env[COPY_THREADS_ENV] = opts.copyThreads;
  if (opts.asyncCopyBytes !== undefined) process.env[ASYNC_COPY_ENV] = opts.asyncCopyBytes;
  // A bad value (of the flag or of the variable set by hand) fails here, not in a worker.
  copyThreadsSetting();
  asyncCopySetting();
  const showProgress = opts.progress !== false && !opts.json && process.stderr.isTTY === true;
  const bar = showProgress ? new cliProgress.SingleBar({ format: '{label} [{bar}] {value}/{total}', clearOnComplete: true, stream: process.stderr }, cliProgress.Presets.shades_classic) : undefined;
  let started = false;
  return {
    signal,
    quick: opts.quick === true,
    ...(sizes ? { sizes } : {}),
    ...(totalBytes !== undefined ? { totalBytes } : {}),
    compare: opts.compare === true,
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

async function compare(command: string, results: ScenarioResult[], opts: GlobalOptions): Promise<ScenarioResult[]> {
  // kv runs its external tools itself, at its own message sizes.
  if (!opts.compare || command === 'kv') return results;
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

function positive(text: string | undefined, what: string, fallback: number): number {
  if (text === undefined) return fallback;
  const v = Number(text);
  if (!Number.isFinite(v) || v <= 0) throw new BenchError(`${what} ${JSON.stringify(text)} must be a positive number`);
  return v;
}

function whole(text: string | undefined, what: string): number | undefined {
  if (text === undefined) return undefined;
  const v = Number(text);
  if (!Number.isSafeInteger(v) || v <= 0) throw new BenchError(`${what} ${JSON.stringify(text)} must be a positive whole number`);
  return v;
}

function wholeOrZero(text: string, what: string): number {
  const v = Number(text);
  if (text.trim() === '' || !Number.isSafeInteger(v) || v < 0) throw new BenchError(`${what} ${JSON.stringify(text)} must be 0 or a positive whole number`);
  return v;
}

function transportOption(): Option {
  return new Option('--transport <name>', 'transports the requester registers: auto (cuda-ipc and tcp, the engine chooses), or only tcp or cuda-ipc').choices(TRANSPORT_CHOICES).default('auto');
}

function hostPort(text: string, what: string): { host: string; port: number } {
  const m = /^([A-Za-z0-9.-]+|\[[0-9a-fA-F:]+\]):(\d{1,5})$/.exec(text);
  const port = m ? Number(m[2]) : -1;
  if (!m || port > 65535) throw new BenchError(`${what} ${JSON.stringify(text)} must be HOST:PORT`);
  return { host: m[1] as string, port };
}

type Runner = (ctx: ScenarioContext) => Promise<ScenarioResult>;

async function execute(command: string, runners: readonly Runner[], opts: GlobalOptions): Promise<void> {
  const startedAt = new Date();
  const ac = new AbortController();
  const ctx = context(opts, ac.signal);
  let results: ScenarioResult[] = [];
  for (const run of runners) results.push(await run(ctx));
  results = await compare(command, results, opts);
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
    .option('--copy-threads <n>', "threads that copy a same-host batch of 1 MiB and more (cuda-ipc copyThreads, 1 to 16; default the library's: half the available cores, 1 to 4)")
    .option('--async-copy-bytes <size>', "same-host batches of this size and more are copied off the JavaScript thread, or never (cuda-ipc asyncCopyBytes; default the library's: 8 MiB)")
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
    .option('--duration <seconds>', 'how long the requester fetches (default 10, 1.5 with --quick)')
    .option('--blocks <n>', 'blocks in the holder\'s pool (default 64, 16 with --quick); the block size is the first of --sizes (default 1 MiB, 64 KiB with --quick)')
    .option('--per-fetch <n>', 'blocks per fetch (default 8, 4 with --quick)')
    .option('--lanes <n>', 'fetches in flight at once in the requester (default 2)')
    .option('--rounds <n>', 'rounds per lane; the same-host and tcp lanes alternate (default 2, 1 with --quick)')
    .option('--warmup-fetches <n>', "untimed one-block fetches by each round's requester before it times anything: the lease path compiled (default 3000, 0 with --quick)")
    .addOption(transportOption())
    .action((opts: GlobalOptions & { duration?: string; transport: TransportChoice; blocks?: string; perFetch?: string; lanes?: string; rounds?: string; warmupFetches?: string }) => {
      const durationMs = opts.duration === undefined ? undefined : positive(opts.duration, '--duration', 10) * 1000;
      const [blocks, perFetch, lanes, rounds] = [whole(opts.blocks, '--blocks'), whole(opts.perFetch, '--per-fetch'), whole(opts.lanes, '--lanes'), whole(opts.rounds, '--rounds')];
      const warmupFetches = opts.warmupFetches === undefined ? undefined : wholeOrZero(opts.warmupFetches, '--warmup-fetches');
      return execute('run', [(ctx) => {
        const base = runSettings(ctx, durationMs, opts.transport);
        const s = { ...base, ...(blocks ? { blocks } : {}), ...(perFetch ? { blocksPerFetch: perFetch } : {}), ...(lanes ? { lanes } : {}), ...(rounds ? { rounds } : {}), ...(warmupFetches !== undefined ? { warmupFetches } : {}) };
        if (s.blocksPerFetch > s.blocks) throw new BenchError(`--per-fetch ${s.blocksPerFetch} is more than the pool's ${s.blocks} blocks`);
        return runScenario(ctx, s);
      }], opts);
    });
  withGlobals(p.command('kv').description('KV-cache shaped fetches: layers × blocks scattered descriptors, same-host and TCP, prepared and not, vs memcpy and a raw stream'))
    .option('--layers <n>', 'layers per fetch (default 32, 4 with --quick)')
    .option('--blocks <n>', 'blocks read from each layer (default 32, 8 with --quick)')
    .option('--batches <list>', 'descriptors per fetch for the batch sweep at 16 KiB (default 64,256,1024,4096)')
    .option('--rounds <n>', 'interleaved rounds; figures are medians (default 3, 1 with --quick)')
    .option('--warmup-ms <ms>', 'untimed fetches per method and shape before the timed ones: at least 20, more until they took this long (default 300; 0, the --quick default, runs one)')
    .option('--lease-warmup <n>', 'untimed one-block leased fetches per lane before the rounds (half as many unary, a quarter by id): the lease path compiled (default 3000; 0 with --quick or --warmup-ms 0)')
    .addOption(transportOption())
    .action((opts: GlobalOptions & { layers?: string; blocks?: string; batches?: string; rounds?: string; warmupMs?: string; leaseWarmup?: string; transport: TransportChoice }) => {
      const layers = whole(opts.layers, '--layers');
      const blocks = whole(opts.blocks, '--blocks');
      const rounds = whole(opts.rounds, '--rounds');
      const batches = opts.batches?.split(',').map((b) => whole(b.trim(), '--batches') as number);
      const warmupMs = opts.warmupMs === undefined ? undefined : wholeOrZero(opts.warmupMs, '--warmup-ms');
      const leaseWarmup = opts.leaseWarmup === undefined ? undefined : wholeOrZero(opts.leaseWarmup, '--lease-warmup');
      return execute('kv', [(ctx) => kvScenario(ctx, kvSettings(ctx, { transport: opts.transport, ...(layers ? { layers } : {}), ...(blocks ? { blocks } : {}), ...(rounds ? { rounds } : {}), ...(batches ? { batches } : {}), ...(warmupMs !== undefined ? { warmupMs } : {}), ...(leaseWarmup !== undefined ? { leaseWarmup } : {}) }))], opts);
    });
  p.command('holder')
    .description('the holder half of `run`, in the foreground, for a requester on another machine (`fetch --holder`)')
    .option('--listen <host:port>', 'lock service address', '0.0.0.0:7070')
    .option('--advertise <host>', 'address requesters use to reach this machine', '127.0.0.1')
    .option('--blocks <n>', 'blocks in the pool', '64')
    .option('--block-size <size>', 'bytes per block', '1MiB')
    .option('--discovery <url>', 'publish this holder in etcd (etcd://HOST:PORT)')
    .action(async (o: { listen: string; advertise: string; blocks: string; blockSize: string; discovery?: string }) => {
      const { host, port } = hostPort(o.listen, '--listen');
      const blocks = positive(o.blocks, '--blocks', 64);
      if (!Number.isInteger(blocks)) throw new BenchError('--blocks must be a whole number');
      const holder = await startHolder({ blocks, blockBytes: parseBytes(o.blockSize, '--block-size'), lockAddress: `${host}:${port}`, tcpHost: host, advertiseHost: o.advertise, lockTimeoutMs: 5_000 }).catch((e: unknown) => {
        const m = e instanceof Error ? e.message : String(e);
        throw new BenchError(/EADDRINUSE|in use/i.test(m) ? `cannot listen on ${o.listen}: address in use` : `cannot start the holder: ${m}`);
      });
      const pub = o.discovery
        ? await publishHolder(holder, { discovery: o.discovery, advertiseHost: o.advertise, blocks }).catch(async (e: unknown) => {
            await holder.close();
            throw new BenchError(`cannot publish in ${o.discovery}: ${e instanceof Error ? e.message : String(e)}`);
          })
        : undefined;
      const how = o.discovery ? `--discovery ${o.discovery}` : `--holder ${o.advertise}:${holder.server.port}`;
      process.stdout.write(`holder ready: lock service on ${host}:${holder.server.port}, serving ${holder.transports.join(', ')}; fetch with: tensorwire-bench fetch ${how}\n`);
      await new Promise<void>((resolve) => {
        process.once('SIGINT', resolve);
        process.once('SIGTERM', resolve);
      });
      process.stdout.write(`holder counters: ${JSON.stringify(holder.counters())}\n`);
      await pub?.close();
      await holder.close();
    });
  withGlobals(p.command('fetch').description('the requester half of `run` against a holder started with `tensorwire-bench holder`'))
    .option('--holder <host:port>', 'the holder\'s lock service')
    .option('--discovery <url>', 'find the holder in etcd instead (etcd://HOST:PORT)')
    .option('--blocks <n>', 'blocks the holder has', '64')
    .option('--block-size <size>', 'bytes per block (as the holder)', '1MiB')
    .option('--duration <seconds>', 'how long to fetch', '10')
    .addOption(transportOption())
    .action((o: GlobalOptions & { holder?: string; discovery?: string; blocks: string; blockSize: string; duration: string; transport: TransportChoice }) => {
      if ((o.holder === undefined) === (o.discovery === undefined)) throw new BenchError('fetch needs exactly one of --holder HOST:PORT or --discovery etcd://HOST:PORT');
      if (o.holder !== undefined) hostPort(o.holder, '--holder');
      const blockBytes = parseBytes(o.blockSize, '--block-size');
      const blocks = positive(o.blocks, '--blocks', 64);
      const durationMs = positive(o.duration, '--duration', 10) * 1000;
      return execute(
        'fetch',
        [
          async (ctx) => {
            const resolved = o.discovery
              ? await resolveHolder({ discovery: o.discovery, signal: ctx.signal }).catch((e: unknown) => {
                  throw new BenchError(`cannot find a holder in ${o.discovery}: ${e instanceof Error ? e.message : String(e)}`);
                })
              : undefined;
            const lockAddress = resolved?.lockAddress ?? (o.holder as string);
            try {
              const r = await runFetcher({ lockAddress, blocks, blockBytes, blocksPerFetch: Math.min(8, blocks), durationMs, lanes: 2, transport: o.transport, signal: ctx.signal }).catch((e: unknown) => {
                throw new BenchError(`cannot fetch from ${lockAddress}: ${e instanceof Error ? e.message : String(e)}`);
              });
              const notes = resolved ? [`holder ${resolved.record.nodeId} (incarnation ${resolved.record.incarnation}) found in ${o.discovery}`, ...r.notes] : r.notes;
              return { scenario: 'fetch', measurements: r.measurements, ratios: r.ratios, verificationFailures: r.verificationFailures, notes };
            } finally {
              await resolved?.close();
            }
          },
        ],
        o,
      );
    });
  withGlobals(p.command('locks').description('lease acquire/release cycles vs a plain gRPC echo; requesters killed mid-lease; --burst N: N releases at once vs N echoes'))
    .option('--burst <n>', 'release N leases at once (and send N echoes at once) instead of cycles')
    .option('--rounds <n>', 'interleaved burst rounds (default 3, 1 with --quick)')
    .option('--against <dir>', "another build's lock-client dist to measure in the same rounds")
    .action((o: GlobalOptions & { burst?: string; rounds?: string; against?: string }) => {
      const burst = whole(o.burst, '--burst');
      const rounds = whole(o.rounds, '--rounds');
      return execute('locks', [burst ? (ctx) => locksBurst(ctx, { burst, ...(rounds ? { rounds } : {}), ...(o.against ? { against: o.against } : {}) }) : SCENARIOS.locks], o);
    });
  withGlobals(p.command('pool').description('shared-memory pool: producer writes vs memcpy, consumer pass over a view vs local memory; --device cuda:N: device slots by CUDA IPC'))
    .option('--device <device>', 'slot device: cpu (host shared memory) or cuda:N (device memory exported by IPC handle)', 'cpu')
    .action((o: GlobalOptions & { device: string }) => {
      const device = poolDevice(o.device);
      return execute('pool', [(ctx) => poolScenario(ctx, { device })], o);
    });
  for (const [name, description] of [
    ['tcp', 'TCP transport READ vs a raw node:net stream, block-size sweep'],
    ['rdma', 'RDMA READ/WRITE with 1, 2, 4 QPs vs perftest (needs an RDMA device)'],
  ] as const) {
    withGlobals(p.command(name).description(description)).action((opts: GlobalOptions) => execute(name, [SCENARIOS[name as ScenarioName]], opts));
  }
  return p;
}

/**
 * `npm run bench -- tcp` runs `cli.js run tcp` (the npm script names `run`, the default
 * command): a leading `run` followed by another command's name is that command.
 */
export function normalizeArgv(argv: readonly string[], commands: readonly string[]): string[] {
  const [node, script, first, second, ...rest] = argv;
  if (first === 'run' && second !== undefined && commands.includes(second)) return [node as string, script as string, second, ...rest];
  return [...argv];
}

async function main(argv: string[]): Promise<number> {
  const debug = argv.includes('--debug') || process.env['TENSORWIRE_DEBUG'] === '1';
  try {
    const p = program();
    await p.parseAsync(normalizeArgv(argv, p.commands.map((c) => c.name())));
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
