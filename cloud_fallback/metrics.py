"""Prometheus text exposition of the worker's state (GET /metrics)."""
from __future__ import annotations


def _line(out: list[str], name: str, kind: str, help: str, value, labels: str = "") -> None:
    out.append(f"# HELP {name} {help}")
    out.append(f"# TYPE {name} {kind}")
    out.append(f"{name}{labels} {float(value):.6g}" if isinstance(value, float) else f"{name}{labels} {int(value)}")


def render_metrics(worker) -> str:
    s = worker.source.stats()
    c = worker.counters
    active = sum(1 for st in worker.streams.values() if st.final is None)
    out: list[str] = []
    _line(out, "edge_worker_queue_depth", "gauge", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
    _line(out, "edge_worker_running_requests", "gauge", "Requests being generated.", s.get("num_running", 0))
    _line(out, "edge_worker_streams", "gauge", "Streams held (in flight or resumable).", active)
    _line(out, "edge_worker_connections", "gauge", "Open WebSocket connections.", len(worker.connections))
    if "num_used_blocks" in s:
        _line(out, "edge_worker_kv_blocks_used", "gauge", "KV cache blocks in use.", s["num_used_blocks"])
        _line(out, "edge_worker_kv_blocks_free", "gauge", "KV cache blocks free (cached ones included).",
              s["num_free_blocks"])
        _line(out, "edge_worker_kv_blocks_cached", "gauge", "KV blocks holding prefix-cache entries.",
              s["num_cached_blocks"])
        _line(out, "edge_worker_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix "
              "cache.", s["num_hit_tokens"])
        _line(out, "edge_worker_preemptions_total", "counter", "Sequences preempted (recomputed later).",
              s.get("num_preemptions", 0))
    if s.get("draft"):
        d = s["draft"]
        _line(out, "edge_worker_draft_verifications_total", "counter", "Decode steps of a sequence that carried "
              "drafts (--draft ngram).", d["verifications"])
        _line(out, "edge_worker_draft_tokens_total", "counter", "Draft tokens proposed.", d["proposed"])
        _line(out, "edge_worker_draft_accepted_total", "counter", "Draft tokens accepted.", d["accepted"])
        if d.get("step_seconds"):
            out.append("# HELP edge_worker_step_seconds A decode call's time by its rows (the draft planner's t(R)).")
            out.append("# TYPE edge_worker_step_seconds gauge")
            for rows, sec in sorted(d["step_seconds"].items()):
                out.append(f'edge_worker_step_seconds{{rows="{rows}"}} {float(sec):.6g}')
    _line(out, "edge_worker_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
          float(s.get("tokens_per_s", 0.0)))
    _line(out, "edge_worker_generated_tokens_total", "counter", "Tokens generated.", s.get("tokens_generated", 0))
    _line(out, "edge_worker_requests_total", "counter", "Generate requests accepted.", c["requests"])
    out.append("# HELP edge_worker_finished_total Streams finished, by finish reason.")
    out.append("# TYPE edge_worker_finished_total counter")
    for reason in ("stop", "length", "cancelled"):
        out.append(f'edge_worker_finished_total{{reason="{reason}"}} {c["finished_" + reason]}')
    _line(out, "edge_worker_failed_total", "counter", "Streams that ended with an error.", c["failed"])
    _line(out, "edge_worker_busy_total", "counter", "Requests refused with busy.", c["busy"])
    _line(out, "edge_worker_bad_frames_total", "counter", "Frames answered with an error.", c["bad_frames"])
    _line(out, "edge_worker_auth_failures_total", "counter", "Connections closed for a missing or wrong token.",
          c["auth_failures"])
    _line(out, "edge_worker_resumes_total", "counter", "Streams resumed on a new connection.", c["resumes"])
    return "\n".join(out) + "\n"
