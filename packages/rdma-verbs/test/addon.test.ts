import { execFileSync, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { addonCandidates, loadNative, tryLoadNative, type NativeAddon } from '../src/native.js';

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
    expect(c).toMatchObject({ devices: 0, pds: 0, mrs: 0, cqs: 0, qps: 0, channels: 0, threads: 0 });
  });

  it('names work-completion statuses', () => {
    const n = loadNative();
    const s = n.wcStatusString(5);
    if (n.probe().library?.loaded) expect(s).toMatch(/flush/i);
    else expect(s).toBe('status 5');
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
