"""trace.md and trace.png of the RAG trace benchmark (trace_run.py)."""

from __future__ import annotations

from pathlib import Path

from .common import table
from .report import _met, _num, steps_table


def _pct(x) -> str:
    return _num(x, ".1f", 100.0, " %")


def _measured(t: dict) -> str:
    x = t["measured"]
    if t["unit"] == "x":
        return _num(x, ".2f", suffix="x")
    return _num(x, ".1f", suffix=t["unit"] if t["unit"] != "%" else " %")


def _summary_md(data: dict) -> list[str]:
    return table(
        [
            "policy",
            "saturated req/s",
            "vs prefix",
            "vs full",
            "sweep ended by",
            "TTFT p50 / p99, one at a time (s)",
            "TTFT p50 / p99 at half sat. (s)",
            "ITL p99 one at a time / half sat. (ms)",
            "prefix-cache hit rate",
            "of follow-up turns",
            "store hit rate",
        ],
        [
            [
                r["policy"],
                _num(r["saturated_rps"]),
                _num(r["vs_prefix"], ".2f", suffix="x"),
                _num(r["vs_full"], ".2f", suffix="x"),
                r["ended_by"],
                f"{_num(r['unloaded_ttft_p50_s'])} / {_num(r['unloaded_ttft_p99_s'])}",
                f"{_num(r['half_ttft_p50_s'])} / {_num(r['half_ttft_p99_s'])}",
                f"{_num(r['unloaded_itl_p99_s'], '.1f', 1e3)} / {_num(r['half_itl_p99_s'], '.1f', 1e3)}",
                _pct(r["prefix_hit_rate"]),
                _pct(r["follow_up_prefix_hit_rate"]),
                _pct(r["store_hit_rate"]),
            ]
            for r in data["summary"]
        ],
    )


def _windows_md(data: dict) -> list[str]:
    rows = []
    for p, d in data["policies"].items():
        steady = {x["rate"]: x for x in d["steady"]}  # in the columns' order (trace_run.RATES)
        for w in d["windows"]:
            rows.append(
                [
                    p,
                    f"{w['start_s']:.0f}-{w['end_s']:.0f}",
                    w["requests"],
                    _pct(w["prefix_hit_rate"]),
                    _pct(w["store_hit_rate"]),
                ]
            )
        verdicts = [
            "n/a"
            if x["steady"] is None
            else f"{_pct(x['earlier'])} then {_pct(x['later'])}" + (" (steady)" if x["steady"] else " (**decays**)")
            for x in steady.values()
        ]
        after = data["settings"]["steady_after_s"]
        rows.append([p, f"after {after:g} s: earlier half, then later half", "", *verdicts])
    return table(["policy", "window (s)", "requests", "prefix-cache hit rate", "store hit rate"], rows)


def _agreement_md(data: dict) -> list[str]:
    rows = data["agreement"]["rows"]
    if not rows:
        return ["(full was not run: no agreement to measure)"]
    return table(
        ["policy", "answers", "first line = full's", "token F1 vs full", "prompt tokens from the prefix cache", "ran"],
        [
            [
                r["policy"],
                r["n"],
                _num(r["first_line_match"], ".1f", suffix=" %"),
                _num(r["token_f1"], ".1f"),
                r["prefix_cached_tokens"],
                ", ".join(f"{p} {n}" for p, n in sorted((r.get("ran") or {}).items())),  # auto's picks
            ]
            for r in rows
        ],
    )


def _followups_md(f: dict) -> list[str]:
    rows = [
        [
            r["conversation"],
            r["linked"]["prompt_tokens"],
            f"{r['linked']['ttft_s']:.3f} ({r['linked']['prefix_cached']} cached, {r['linked']['recomputed']} recomp.)",
            f"{r['exact']['ttft_s']:.3f} ({r['exact']['prefix_cached']} cached)",
            f"{r['cold']['ttft_s']:.3f} ({r['cold']['recomputed']} recomp.)",
        ]
        for r in f["rows"]
    ]
    rows.append(
        [
            "**median**",
            _num(f["prompt_tokens"], ".0f"),
            f"{_num(f['linked_ttft_s'])} ({_num(f['linked_prefix_cached'], '.0f')} cached)",
            f"{_num(f['exact_ttft_s'])} ({_num(f['exact_prefix_cached'], '.0f')} cached)",
            _num(f["cold_ttft_s"]),
        ]
    )
    return table(
        [
            "conversation",
            "prompt tokens",
            f"{f['policy']}, first turn linked: TTFT (s)",
            "prefix, first turn exact: TTFT (s)",
            f"{f['policy']}, no first turn: TTFT (s)",
        ],
        rows,
    )


def _refined(data: dict) -> str:
    r = data.get("refine") or {}
    if not r.get("chunks"):
        return ""
    return (
        f"; the {r['chunks']} chunks the trace retrieves then refined behind their {r['neighbours']} nearest "
        f"(neighbour-aware compile) in {r['seconds']:.1f} s, {r['seconds'] / r['chunks']:.2f} s a chunk"
    )


def trace_markdown(data: dict, plot: str | None) -> str:
    """trace.md: targets, summary, hit rates over time, agreement, follow-ups and every step, with the
    command, model, dtype and machine."""
    s, mc, tr, f = data["settings"], data["machine"], data["trace"], data["followups"]
    acc = data["accurate_policy"]
    sent = {p: len(d["sent"]) for p, d in data["policies"].items()}
    md = [
        f"# RAG trace benchmark ({data['model']})",
        "",
        f"Command: `{data['command']}`  ",
        f"Machine: {mc['cpu']}, {mc['cores']} cores; date {mc['date']}; commit {mc['commit']}; dtype {data['dtype']}  ",
        f"Run time: {data['total_s'] / 60:.1f} min (corpus embedded and trace built in {data['workload_s']:.1f} s; "
        f"{tr['chunks']} chunks compiled up front in {data['compile_s']:.1f} s{_refined(data)}, not in any TTFT)",
        "",
        f"Trace (digest {tr['digest']}): {tr['chunks']} pydoc chunks of up to {s['chunk_tokens']} tokens embedded "
        "with MiniLM into a FAISS index; a new conversation's topic chunk drawn with Zipf popularity "
        f"(s = {s['zipf_s']:g}), one of the questions generated from it, its top k chunks by embedding search "
        f"(k uniform in {s['k_min']}-{s['k_max']}, {tr['mean_chunks_per_request']:.1f} on average); "
        f"{100 * tr['follow_up_share']:.0f} % of requests are follow-up turns (the same chunks in the same order, "
        f"the earlier turns, a new question; up to {s['max_turns']} turns). Every policy is sent the same "
        f"requests in the same order (requests sent: {', '.join(f'{p} {n}' for p, n in sent.items())}), each in "
        "a prefix-cache namespace of its own, as chats through `render_messages`; "
        f"exactly {s['output_tokens']} tokens generated per request (EOS ignored).",
        "",
        "Load: as `bench load` (load.md): one request at a time first (a warm-up, then "
        f"{s['unloaded_requests']}), then Poisson arrivals on a ladder of {s['factor']:g}^i req/s from about "
        f"{s['start_load']:g} / the policy's unloaded service time until completed req/s < "
        f"{s['throughput_floor']:g} x offered or TTFT p50 > {s['ttft_blowup']:g} x unloaded, or its "
        f"{s['max_minutes']:g}-minute budget (`cap`); each step sends the trace's next requests. Saturated "
        "req/s: the sweep's highest completed req/s. Prefix-cache hit rate: prompt tokens served by vLLM's "
        "prefix cache / prompt tokens; store hit rate: chunks found compiled / chunks linked (n/a: the policy "
        f"links nothing); over windows of {s['hit_window_s']:g} s of each policy's run (by arrival).",
        "",
        "## Targets",
        "",
        *table(
            ["target", "measured", "met", "note"],
            [[t["target"], _measured(t), _met(t["met"]), t["note"]] for t in data["targets"]],
        ),
        "",
        "## Summary",
        "",
        *_summary_md(data),
        "",
        "## Hit rates over time",
        "",
        *_windows_md(data),
        "",
        f"## Agreement with full ({len(data['agreement']['requests'])} requests of the first {s['scored']} "
        "conversations)",
        "",
        f"Greedy answers of at most {s['answer_tokens']} tokens, the same prompts under every policy (follow-ups "
        "after their first turn, in a namespace per policy); first lines compared after normalisation, token "
        "F1 over the whole answer.",
        "",
        *_agreement_md(data),
        "",
        f"## Follow-up turns ({f['conversations']} two-turn conversations)",
        "",
        f"The follow-up's TTFT (one token) under {acc} after its first turn was linked (its blocks reused "
        "through the link's prefix-cache scope), under prefix after its first turn ran exactly (an exact "
        f"prefix-cache hit of the same prompt), and under {acc} without a first turn (a fresh link). Median "
        "prompt tokens served from the link's cached blocks per conversation: "
        f"{_num(f['linked_prefix_cached'], '.0f')} of {_num(f['prompt_tokens'], '.0f')}; a fresh link's TTFT "
        f"over the follow-up's: {_num(f['cold_vs_linked'], '.2f', suffix='x')}; "
        f"linked / exact TTFT: {_num(f['linked_vs_exact'], '.2f', suffix='x')}.",
        "",
        *_followups_md(f),
        "",
        "## Every step",
        "",
        *(steps_table(data["rows"]) if data["rows"] else ["(no sweep step fitted in its budget)"]),
        "",
    ]
    if plot:
        md.append(f"![{plot}]({plot})")
    return "\n".join(md) + "\n"


def trace_plot(out: Path, data: dict) -> str | None:
    """trace.png: saturated req/s and TTFT p50 per policy, and both hit rates over each policy's run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]
    if not summary:
        return None
    out.mkdir(parents=True, exist_ok=True)
    pols = [r["policy"] for r in summary]
    x = list(range(len(pols)))  # numeric positions: a policy without a figure leaves a gap, not an error
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (thr, ttft), (pc, st) = axes
    thr.bar(x, [r["saturated_rps"] or 0.0 for r in summary], color="tab:blue")
    thr.set_ylabel("completed req/s at saturation")
    thr.set_title("Throughput")
    ttft.bar(x, [r["unloaded_ttft_p50_s"] for r in summary], color="tab:orange", label="one at a time")
    half = [(i, v) for i, r in zip(x, summary) if (v := r["half_ttft_p50_s"]) is not None and v == v]
    if half:
        ttft.scatter(*zip(*half), color="k", label="half sat.", zorder=3)
    ttft.set_ylabel("TTFT p50 (s)")
    ttft.set_title("Time to first token")
    ttft.legend(fontsize=7)
    for i, (p, d) in enumerate(data["policies"].items()):
        w = d["windows"]
        mid = [(x["start_s"] + x["end_s"]) / 2 / 60 for x in w]
        style = {"marker": "o", "label": p, "color": f"C{i}"}  # one colour per policy in both plots
        pc.plot(mid, [100 * x["prefix_hit_rate"] for x in w], **style)
        if any(x["store_hit_rate"] is not None for x in w):
            st.plot(
                [m for m, x in zip(mid, w) if x["store_hit_rate"] is not None],
                [100 * x["store_hit_rate"] for x in w if x["store_hit_rate"] is not None],
                **style,
            )
    for ax, name in ((pc, "vLLM prefix-cache hit rate"), (st, "chunk store hit rate")):
        ax.set_xlabel("minutes into the policy's run")
        ax.set_ylabel(f"{name} (%)")
        ax.set_title(f"{name} over time")
        ax.set_ylim(-2, 102)
        ax.legend(fontsize=7)
    for ax in (thr, ttft):
        ax.set_xticks(x, pols)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"RAG trace ({data['model'].split(' ')[0]}, {data['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "trace.png", dpi=110)
    plt.close(fig)
    return "trace.png"
