/**
 * An indexed binary min-heap keyed by deadline. Each entry remembers its own position,
 * so removing or re-keying an entry is O(log n) and the expiry GC touches only the
 * entries whose deadline has passed: its cost follows what expires, not what is live.
 */
export interface HeapEntry {
  deadline: number;
  /** Position in the heap; -1 when not in it. Owned by the heap. */
  heapIndex: number;
}

export class DeadlineHeap<T extends HeapEntry> {
  readonly #items: T[] = [];

  get size(): number {
    return this.#items.length;
  }

  peek(): T | undefined {
    return this.#items[0];
  }

  push(entry: T): void {
    entry.heapIndex = this.#items.length;
    this.#items.push(entry);
    this.#up(entry.heapIndex);
  }

  pop(): T | undefined {
    const top = this.#items[0];
    if (top !== undefined) this.remove(top);
    return top;
  }

  /** Remove an entry (no-op when it is not in the heap). */
  remove(entry: T): void {
    const i = entry.heapIndex;
    if (i < 0 || this.#items[i] !== entry) return;
    const last = this.#items.pop() as T;
    entry.heapIndex = -1;
    if (last !== entry) {
      this.#items[i] = last;
      last.heapIndex = i;
      this.#down(i);
      this.#up(last.heapIndex);
    }
  }

  /** Change an entry's deadline and restore heap order. */
  update(entry: T, deadline: number): void {
    entry.deadline = deadline;
    if (entry.heapIndex < 0 || this.#items[entry.heapIndex] !== entry) return;
    this.#up(entry.heapIndex);
    this.#down(entry.heapIndex);
  }

  clear(): T[] {
    const all = this.#items.splice(0);
    for (const e of all) e.heapIndex = -1;
    return all;
  }

  #swap(a: number, b: number): void {
    const items = this.#items;
    const x = items[a] as T;
    const y = items[b] as T;
    items[a] = y;
    items[b] = x;
    y.heapIndex = a;
    x.heapIndex = b;
  }

  #up(i: number): void {
    const items = this.#items;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if ((items[parent] as T).deadline <= (items[i] as T).deadline) break;
      this.#swap(i, parent);
      i = parent;
    }
  }

  #down(i: number): void {
    const items = this.#items;
    const n = items.length;
    for (;;) {
      const l = 2 * i + 1;
      const r = l + 1;
      let m = i;
      if (l < n && (items[l] as T).deadline < (items[m] as T).deadline) m = l;
      if (r < n && (items[r] as T).deadline < (items[m] as T).deadline) m = r;
      if (m === i) return;
      this.#swap(i, m);
      i = m;
    }
  }
}
