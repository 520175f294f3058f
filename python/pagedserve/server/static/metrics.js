// The server's live state for the page: polls GET /metrics (Prometheus text
// format, vLLM's metric names) and parses its samples.

/** Parses Prometheus text into a Map of metric name -> value, summed over the
 * name's label sets (the server serves one model, so one set each). */
export function parsePrometheus(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    const sample = /^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)/.exec(line);
    if (sample) values.set(sample[1], (values.get(sample[1]) ?? 0) + Number(sample[3]));
  }
  return values;
}

/** Calls onUpdate(Map) with /metrics every intervalMs while the page is
 * visible, or onUpdate(null) when the server does not answer. */
export function pollMetrics(onUpdate, intervalMs = 1000) {
  async function poll() {
    if (!document.hidden) {
      try {
        const response = await fetch("metrics", { cache: "no-store" });
        onUpdate(response.ok ? parsePrometheus(await response.text()) : null);
      } catch {
        onUpdate(null);
      }
    }
    setTimeout(poll, intervalMs);
  }
  poll();
}
