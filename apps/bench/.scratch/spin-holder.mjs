if (process.env.HSPIN) { const spin = () => setImmediate(spin); spin(); }
await import('../dist/workers/kv-holder.js');
