import { execFileSync, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { Access, addonCandidates, loadNative, tryLoadNative, WcOpcode, type NativeAddon, type NativeProbe } from '../src/native.js';

const pkg = resolve(fileURLToPath(new URL('..', import.meta.url)));
const haveHeaders = existsSync('/usr/include/infiniband/verbs.h');

describe('native addon', () => {
  it('loads from a known build path', () => {
    const r = tryLoadNative();
    if (!('addon' in r)) throw new Error(`addon did not load: ${r.errors.join('; ')}`);
    expect(addonCandidates()).toContain(r.path);
    expect(r.addon.napiVersion).toBe(8);
  });

  if (!haveHeaders) console.warn('[rdma-verbs] skipping the verbs.h build check: infiniband/verbs.h is not installed (apt-get install libibverbs-dev)');
  it.skipIf(!haveHeaders)('was built against infiniband/verbs.h when the header exists', () => {
    expect(loadNative().builtWithVerbs).toBe(true);
  });

  it('does not link libibverbs (it is dlopen()ed at run time)', (ctx) => {
    const readelf = spawnSync('readelf', ['--version']);
    if (readelf.status !== 0) {
      console.warn('[rdma-verbs] skipping the link check: readelf is not installed');
      ctx.skip();
    }
    const r = tryLoadNative();
    if (!('addon' in r)) throw new Error('addon did not load');
    const dyn = execFileSync('readelf', ['-d', r.path], { encoding: 'utf8' });
    const needed = dyn.split('\n').filter((l) => l.includes('(NEEDED)'));
    expect(needed.length).toBeGreaterThan(0);
    expect(needed.join('\n')).not.toMatch(/ibverbs|rdmacm|mlx/);
  });

  it('probe() reports each layer: build, library, device list', () => {
    const p = loadNative().probe();
    expect(p.built).toBe(loadNative().builtWithVerbs);
    if (p.built) {
      expect(p.library).toBeDefined();
      if (p.library?.loaded) {
        expect(p.deviceList).toBeDefined();
        if (p.deviceList?.ok === false) expect(p.deviceList.error).toMatch(/^ibv_get_device_list: .*errno \d+/);
      } else {
        expect(p.library?.error).toMatch(/libibverbs/);
      }
    }
  });

  it('opening a device that does not exist fails with a typed code, and leaks nothing', () => {
    const n = loadNative();
    const before = n.counters();
    let err: unknown;
    try {
      new n.Device('tw-no-such-device', () => undefined);
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(Error);
    expect((err as { code?: string }).code).toBe('TW_BACKEND_UNAVAILABLE');
    expect(n.counters()).toEqual(before);
  });

  it('rejects bad constructor arguments with TW_INVALID_INPUT (verbs build)', (ctx) => {
    const n = loadNative();
    if (!n.builtWithVerbs) {
      console.warn('[rdma-verbs] stub build: argument checks live in the verbs build');
      ctx.skip();
    }
    const Ctor = n.Device as unknown as new (...a: unknown[]) => unknown;
    expect(() => new Ctor(42)).toThrow(expect.objectContaining({ code: 'TW_INVALID_INPUT' }) as Error);
  });

  it('starts with no native resources and no poller threads', () => {
    const c = loadNative().counters();
    expect(c).toMatchObject({ devices: 0, pds: 0, mrs: 0, mws: 0, cqs: 0, qps: 0, channels: 0, threads: 0 });
  });

  it('names work-completion statuses', () => {
    const n = loadNative();
    const s = n.wcStatusString(5);
    if (n.probe().library?.loaded) expect(s).toMatch(/flush/i);
    else expect(s).toBe('status 5');
  });
});

describe('memory windows (verbs build)', () => {
  const r = tryLoadNative();
  const reason = !('addon' in r) ? 'the addon did not load' : !r.addon.builtWithVerbs ? 'stub build (no infiniband/verbs.h)' : undefined;
  if (reason) console.warn(`[rdma-verbs] skipping the memory-window API check: ${reason}`);
  it.skipIf(reason !== undefined)('Device has allocMw, bindMw and deallocMw', () => {
    const proto = loadNative().Device.prototype as unknown as Record<string, unknown>;
    for (const m of ['allocMw', 'bindMw', 'deallocMw']) expect(typeof proto[m], m).toBe('function');
  });

  if (!haveHeaders) console.warn('[rdma-verbs] skipping the verbs.h constant check: infiniband/verbs.h is not installed');
  it.skipIf(!haveHeaders)('Access.MwBind and WcOpcode match infiniband/verbs.h', () => {
    const header = readFileSync('/usr/include/infiniband/verbs.h', 'utf8');
    const wc = enumValues(header, 'ibv_wc_opcode');
    expect(WcOpcode).toEqual({ RdmaWrite: wc.get('IBV_WC_RDMA_WRITE'), RdmaRead: wc.get('IBV_WC_RDMA_READ'), BindMw: wc.get('IBV_WC_BIND_MW') });
    const access = enumValues(header, 'ibv_access_flags');
    expect(Access).toEqual({
      LocalWrite: access.get('IBV_ACCESS_LOCAL_WRITE'),
      RemoteWrite: access.get('IBV_ACCESS_REMOTE_WRITE'),
      RemoteRead: access.get('IBV_ACCESS_REMOTE_READ'),
      MwBind: access.get('IBV_ACCESS_MW_BIND'),
    });
  });
});

/** Values of a C enum's members whose values are plain numbers, `1 << n`, or implicit. */
function enumValues(header: string, name: string): Map<string, number> {
  const body = new RegExp(`enum\\s+${name}\\s*\\{([^}]*)\\}`).exec(header)?.[1];
  if (body === undefined) throw new Error(`enum ${name} not found in verbs.h`);
  const out = new Map<string, number>();
  let next: number | undefined = 0;
  for (const raw of body.replace(/\/\*[\s\S]*?\*\//g, '').replace(/\/\/.*$/gm, '').split(',')) {
    const m = /^\s*(\w+)\s*(?:=\s*(.+?))?\s*$/.exec(raw);
    if (!m?.[1]) continue;
    const expr = m[2]?.replace(/[()\s]/g, '');
    let value: number | undefined = next;
    if (expr !== undefined) {
      const shift = /^(\d+)<<(\d+)$/.exec(expr);
      value = /^\d+$/.test(expr) ? Number(expr) : shift ? Number(shift[1]) << Number(shift[2]) : undefined;
    }
    if (value !== undefined) out.set(m[1], value);
    next = value === undefined ? undefined : value + 1;
  }
  return out;
}

describe('fork safety (ibv_fork_init)', () => {
  const r = tryLoadNative();
  let probe: NativeProbe | undefined;
  let reason: string | undefined;
  if (!('addon' in r)) reason = 'the addon did not load';
  else if (!r.addon.builtWithVerbs) reason = 'stub build (no infiniband/verbs.h)';
  else {
    probe = r.addon.probe();
    if (probe.library?.loaded !== true) reason = `libibverbs did not load: ${probe.library?.error ?? 'unknown'}`;
  }
  if (reason) console.warn(`[rdma-verbs] skipping the fork-safety checks: ${reason}`);
  const addonPath = 'addon' in r ? r.path : '';

  /** probe().fork from a fresh process (the decision is once per process), with env exactly this. */
  function forkInChild(env: Record<string, string | undefined>): NativeProbe['fork'] | null {
    const script = [
      "import { createRequire } from 'node:module';",
      `const path = ${JSON.stringify(addonPath)};`,
      'const p = createRequire(path)(path).probe();',
      'process.stdout.write(JSON.stringify(p.fork ?? null));',
    ].join('\n');
    const out = execFileSync(process.execPath, ['--input-type=module', '-e', script], { env, encoding: 'utf8' });
    return JSON.parse(out) as NativeProbe['fork'] | null;
  }

  /** The environment without anything that steers fork handling. */
  function baseEnv(): Record<string, string | undefined> {
    const env: Record<string, string | undefined> = { ...process.env };
    delete env['TENSORWIRE_RDMA_FORK_INIT'];
    delete env['RDMAV_FORK_SAFE'];
    delete env['IBV_FORK_SAFE'];
    return env;
  }

  it.skipIf(reason !== undefined)('probe() reports a fork status whenever libibverbs loaded', () => {
    const fork = probe?.fork;
    expect(fork).toBeDefined();
    expect(['unneeded', 'enabled', 'disabled', 'failed']).toContain(fork?.status);
    if (fork?.status === 'disabled') expect(fork.error).toMatch(/^TENSORWIRE_RDMA_FORK_INIT=/);
    if (fork?.status === 'failed') expect(fork.error).toMatch(/ibv_fork_init/);
    if (fork?.status === 'enabled' || fork?.status === 'unneeded') expect(fork.error).toBeUndefined();
  });

  it.skipIf(reason !== undefined)('enables fork support by default and honours TENSORWIRE_RDMA_FORK_INIT=0 (child processes)', () => {
    const on = forkInChild(baseEnv());
    const off = forkInChild({ ...baseEnv(), TENSORWIRE_RDMA_FORK_INIT: '0' });
    if (off?.status === 'unneeded') {
      // The kernel copies DMA pages on fork: nothing to enable, whatever the variable says.
      expect(on).toEqual({ status: 'unneeded' });
    } else {
      expect(off).toEqual({ status: 'disabled', error: 'TENSORWIRE_RDMA_FORK_INIT=0' });
      expect(on).toEqual({ status: 'enabled' });
    }
  });

  it.skipIf(reason !== undefined)('accepts "off" as an opt-out, and any other value leaves fork support on', () => {
    const off = forkInChild({ ...baseEnv(), TENSORWIRE_RDMA_FORK_INIT: 'off' });
    const one = forkInChild({ ...baseEnv(), TENSORWIRE_RDMA_FORK_INIT: '1' });
    if (off?.status === 'unneeded') {
      expect(one).toEqual({ status: 'unneeded' });
    } else {
      expect(off).toEqual({ status: 'disabled', error: 'TENSORWIRE_RDMA_FORK_INIT=off' });
      expect(one).toEqual({ status: 'enabled' });
    }
  });

  it.skipIf(reason !== undefined)('RDMAV_FORK_SAFE wins over the opt-out (libibverbs would enable it anyway)', () => {
    const fork = forkInChild({ ...baseEnv(), TENSORWIRE_RDMA_FORK_INIT: '0', RDMAV_FORK_SAFE: '1' });
    expect(['enabled', 'unneeded']).toContain(fork?.status);
    expect(fork?.error).toBeUndefined();
  });
});

describe('stub build (TW_FORCE_STUB)', () => {
  const cmake = spawnSync('cmake', ['--version']);
  const reason = cmake.status !== 0 ? 'cmake is not installed' : undefined;
  if (reason) console.warn(`[rdma-verbs] skipping the stub build: ${reason}`);
  it.skipIf(reason !== undefined)('builds and reports "built without infiniband/verbs.h"', () => {
    const out = mkdtempSync(join(tmpdir(), 'tw-rdma-stub-'));
    try {
      const cmakeJs = createRequire(import.meta.url).resolve('cmake-js/bin/cmake-js');
      const r = spawnSync(process.execPath, [cmakeJs, 'build', '--out', out, '--CDTW_FORCE_STUB=ON'], { cwd: pkg, encoding: 'utf8' });
      if (r.status !== 0) throw new Error(`stub build failed:\n${r.stdout}\n${r.stderr}`);
      const stub = createRequire(import.meta.url)(join(out, 'Release', 'tensorwire_rdma_verbs.node')) as NativeAddon;
      expect(stub.builtWithVerbs).toBe(false);
      const p = stub.probe();
      expect(p.built).toBe(false);
      expect(p.buildReason).toMatch(/^built without infiniband\/verbs\.h/);
      expect(() => new stub.Device('mlx5_0', () => undefined)).toThrow(/built without infiniband\/verbs\.h/);
    } finally {
      rmSync(out, { recursive: true, force: true });
    }
  });
});
