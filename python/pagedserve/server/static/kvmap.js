// The KV map panel: polls GET /v1/kv (the block pool block by block, read on
// the engine thread between two steps) and draws one cell per block on a
// canvas, coloured by state and owner: free, cached (evictable), in use
// (one hue per request), shared (held by more than one sequence: a prefix
// hit or forked choices). Pools larger than the canvas has pixels share a
// pixel between k blocks, the busiest state of them shown.

import { getJson } from "./api.js";

const WIDTH = 240; // canvas pixels across
const MAX_HEIGHT = 600; // canvas pixels down, at most
const FREE = [226, 229, 235];
const CACHED = [150, 190, 240];
const SHARED = [123, 63, 179];
const RANK = { ".": 0, c: 1, u: 2, U: 2 }; // which state a shared pixel shows

/** A request's colour: a hue from its id (stable while it runs). */
function ownerColour(requestId) {
  let h = 0;
  for (const ch of requestId) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  const hue = h % 360;
  // HSL(hue, 65%, 50%) to RGB
  const f = (n) => {
    const k = (n + hue / 30) % 12;
    return Math.round(255 * (0.5 - 0.65 * 0.5 * Math.max(-1, Math.min(k - 3, 9 - k, 1))));
  };
  return [f(0), f(8), f(4)];
}

/** Cell size in pixels and blocks per cell for n blocks on the canvas. */
export function layout(n) {
  for (let cell = 12; cell >= 1; cell--) {
    const cols = Math.floor(WIDTH / cell);
    if (Math.ceil(n / cols) * cell <= MAX_HEIGHT) return { cell, cols, perCell: 1 };
  }
  const perCell = Math.ceil(n / (WIDTH * MAX_HEIGHT));
  return { cell: 1, cols: WIDTH, perCell };
}

/** Draws the map `m` (GET /v1/kv) on `canvas`; returns the layout used. */
export function draw(canvas, m) {
  const n = m.num_blocks;
  const { cell, cols, perCell } = layout(n);
  const cells = Math.ceil(n / perCell);
  canvas.width = WIDTH;
  canvas.height = Math.max(cell, Math.ceil(cells / cols) * cell);
  const owner = new Map(); // block id -> request id
  for (const o of m.owners) for (const b of o.block_ids) owner.set(b, o.request_id);
  const shared = new Set(Object.keys(m.shared).map(Number));
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(canvas.width, canvas.height);
  const px = image.data;
  for (let c = 0; c < cells; c++) {
    let block = c * perCell; // the busiest block of this cell's blocks
    for (let b = block + 1; b < Math.min(n, (c + 1) * perCell); b++) {
      if (RANK[m.states[b]] > RANK[m.states[block]] || shared.has(b)) block = b;
    }
    const s = m.states[block];
    const rgb = shared.has(block) ? SHARED : s === "." ? FREE : s === "c" ? CACHED
      : ownerColour(owner.get(block) ?? "");
    const x0 = (c % cols) * cell, y0 = Math.floor(c / cols) * cell;
    for (let y = y0; y < y0 + cell; y++) {
      for (let x = x0; x < x0 + Math.max(1, cell - (cell > 3 ? 1 : 0)); x++) {
        const i = 4 * (y * canvas.width + x);
        px[i] = rgb[0]; px[i + 1] = rgb[1]; px[i + 2] = rgb[2]; px[i + 3] = 255;
      }
    }
  }
  ctx.putImageData(image, 0, 0);
  return { cell, perCell };
}

/** Polls /v1/kv every intervalMs while the page is visible and redraws the
 * panel; its numbers are also on the canvas' data-* attributes (tests read them). */
export function pollKvMap(intervalMs = 500) {
  const canvas = document.getElementById("kv-map");
  const text = document.getElementById("kv-summary");
  async function poll() {
    if (!document.hidden) {
      try {
        const m = await getJson("v1/kv");
        const { perCell } = draw(canvas, m);
        const sharedBlocks = Object.keys(m.shared).length;
        Object.assign(canvas.dataset, {
          numBlocks: m.num_blocks, inUse: m.num_in_use, cached: m.num_cached, free: m.num_free,
          shared: sharedBlocks, owners: m.owners.length,
        });
        const rate = (100 * m.prefix_cache.hit_rate).toFixed(1);
        text.textContent = `${m.num_blocks} blocks x ${m.block_size} tokens` +
          (perCell > 1 ? ` (${perCell} per pixel)` : "") +
          ` · in use ${m.num_in_use} · cached ${m.num_cached} · free ${m.num_free} · shared ${sharedBlocks}` +
          ` · prefix-cache hit rate ${rate} % · running ${m.num_running} · waiting ${m.num_waiting}`;
      } catch (error) {
        text.textContent = `KV map unavailable: ${error.message}`;
      }
    }
    setTimeout(poll, intervalMs);
  }
  poll();
}
