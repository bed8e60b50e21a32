"""First run of the demo, measured: `epic-rag demo` on its defaults (Qwen2.5-Coder-0.5B-Instruct, the
pydoc corpus, memory over disk store) started on a fresh data folder, a question asked as soon as the engine
serves and every chunk found so far is embedded (while the corpus is still chunked and compiled), then timed
until every chunk is compiled.

    .venv/bin/python -m epic_rag.bench.firstrun [--model M] [--question Q] [--out docs/bench]

Reports: engine ready (s after start), the question's answer with its TTFT, linked/recomputed tokens and
how far the compile was when it was asked, corpus embedded and compiled (s after start), peak RSS of the
server process, and the chunk KV on disk. Results: <out>/firstrun.json and firstrun.md. Run it alone: on
2 cores any other load slows it several-fold.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from .common import DEFAULT_OUT, command_line, machine, table, write
from .soak import KEY, DemoProcess

MODULE = "epic_rag.bench.firstrun"
QUESTION = "How do I pretty-print JSON with indentation in Python?"


class PeakRss:
    """Samples a process's RSS every `every_s` seconds in a thread; `peak` is the highest seen."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        import psutil

        self._p, self._every, self.peak = psutil.Process(pid), every_s, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._p.memory_info().rss)
            except Exception:  # the process ended
                return
            self._stop.wait(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(model: str | None, question: str, max_tokens: int, timeout_s: float) -> dict:
    import httpx

    work = Path(tempfile.mkdtemp(prefix="epic-firstrun-"))
    extra = [] if model is None else ["--model", model]
    t0 = time.monotonic()
    server = DemoProcess("builtin:pydoc", work / "data", extra_args=extra)  # type: ignore[arg-type]
    rss = PeakRss(server.proc.pid)
    h = {"Authorization": f"Bearer {KEY}"}
    out: dict = {}
    try:
        end = t0 + timeout_s
        while True:  # the engine serves: a chat can be answered (the corpus may still be compiling)
            if server.proc.poll() is not None:
                raise RuntimeError(f"epic-rag demo exited with {server.proc.returncode}; see {server.log_path}")
            if time.monotonic() > end:
                raise TimeoutError("the demo's engine did not become ready in time")
            try:
                if httpx.get(server.url + "/healthz", timeout=5).json()["status"] == "ok":
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        out["engine_ready_s"] = round(time.monotonic() - t0, 1)
        while True:  # ask once every chunk found so far is embedded (retrieval can search it), while chunks compile
            st = httpx.get(server.url + "/api/status", headers=h, timeout=30).json()
            if st["chunks"] and st["embedded"] >= st["chunks"] or st["state"] == "ready":
                break
            if time.monotonic() > end:
                raise TimeoutError("the demo did not finish embedding the corpus in time")
            time.sleep(0.5)
        out["corpus_indexed_s"] = round(time.monotonic() - t0, 1)
        asked = time.monotonic()
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=h, timeout=timeout_s)
        r.raise_for_status()
        resp = r.json()
        out["question"] = {
            "text": question,
            "asked_at_s": round(asked - t0, 1),
            "answered_after_s": round(time.monotonic() - asked, 2),
            "compile_progress_when_asked": {k: st[k] for k in ("state", "chunks", "embedded", "compiled")},
            "answer": resp["choices"][0]["message"]["content"],
            "epic": {k: v for k, v in resp.get("epic", {}).items() if k != "sources"},
            "sources": [s.get("id") for s in resp.get("epic", {}).get("sources", [])],
        }
        st = server.wait_ready(timeout=max(1.0, end - time.monotonic()))
        out["corpus_ready_s"] = round(time.monotonic() - t0, 1)
        out["corpus"] = {k: st[k] for k in ("documents", "chunks", "compiled", "compile_seconds")}
    finally:
        server.stop()
        out["peak_rss_mib"] = round(rss.stop() / 2**20)
    out["kv_on_disk_mib"] = round(_du(work / "data" / "kv") / 2**20) if (work / "data" / "kv").exists() else 0
    return out


def markdown(data: dict) -> str:
    r, q = data["result"], data["result"]["question"]
    e = q["epic"]
    prog = q["compile_progress_when_asked"]
    lines = [
        "# First run of the demo",
        "",
        f"Command: `{data['command']}`  ",
        f"Machine: {data['machine']}",
        "",
        "`epic-rag demo` on its defaults with a fresh data folder; one question asked as soon as retrieval "
        "could search every chunk found so far, while the corpus was still being chunked and compiled.",
        "",
        *table(
            ["figure", "value"],
            [
                ["engine ready (after start)", f"{r['engine_ready_s']} s"],
                ["corpus embedded, retrieval ready (after start)", f"{r.get('corpus_indexed_s')} s"],
                ["corpus embedded and compiled (after start)", f"{r['corpus_ready_s']} s"],
                ["corpus", f"{r['corpus']['documents']} documents, {r['corpus']['chunks']} chunks"],
                ["peak RSS of the server", f"{r['peak_rss_mib']} MiB"],
                ["chunk KV on disk", f"{r['kv_on_disk_mib']} MiB"],
                ["question", q["text"]],
                [
                    "asked at",
                    f"{q['asked_at_s']} s ({prog['state']}: {prog['embedded']} embedded, "
                    f"{prog['compiled']} of {prog['chunks']} compiled)",
                ],
                [
                    "answer stats",
                    f"policy {e.get('policy')}, TTFT {e.get('ttft_s')} s, {e.get('prompt_tokens')} prompt tokens, "
                    f"{e.get('linked_tokens')} linked, {e.get('recomputed_tokens')} recomputed, chunk hits "
                    f"{e.get('chunk_hits')} / misses {e.get('chunk_misses')}; answered {q['answered_after_s']} s "
                    "after asking",
                ],
                ["sources", ", ".join(str(s) for s in q["sources"])],
            ],
        ),
        "",
        "Answer:",
        "",
        "```",
        q["answer"].strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the demo's default model")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    result = measure(args.model, args.question, args.max_tokens, args.timeout)
    data = {"command": command_line(MODULE), "machine": machine(), "result": result}
    write(Path(args.out), "firstrun", data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
