"""Dev-split screening: why look-alike lookups fail under linking, and which recompute sets fix them (not shipped).

Each variant replaces query-<r>'s picks (Linker._query_picks; the probe pass, its scores and the main pass are
the engine's own) with another recompute set, and every (sample, variant) is answered greedily, 12 tokens,
scored by substring; `full` runs once per sample. Variants, as `name@r` (r: the percentage of chunk tokens):
- base: the engine's picks (the top r % by the attention the question gives each token, summed over layers);
- nosink: the same with punctuation/whitespace-only tokens never picked (they draw most of the attention);
- win-nosink: windows of +-6 tokens around the best-scored tokens until the budget is spent;
- lex-nosink, lex-win-nosink: first the tokens matching the question's (+-4 around each match);
- after[-max]: the top r % by score among the tokens of the chunk the question attends to most (summed or max
  score, sinks left out) and the chunks after it;
- oracles, told where the asked record is: chunks:home, chunks:look, chunks:home+look, chunks:nothome,
  chunks:after, chunks:before (whole chunks recomputed: the asked record's chunk, its look-alike's, both, every
  other chunk, the chunks after it, before it; the budget r is ignored), records:all / records:after (every
  sentence or table row holding a digit: the records, in all chunks / in the chunks after the asked record's).
With --filler, chunks are compiled behind the template and a neutral filler document ("Document 1", about 280
tokens; the chunk is then "Document 2") instead of the template alone, and each variant is a plain policy name
(naive, query-20): does KV computed "not as the first document" link better?
Results: docs/bench/qwen-frontier/lookalike-dev.md.

Cross-chunk screen (docs/bench/qwen-frontier/crosschunk-dev.md): a variant may also be `[MODS/]POLICY`, POLICY a
policy name run as the engine runs it (full, naive, legolink-16, query-20, ...) or a `name@r` form above, MODS
joined by "+":
- nbrK: every chunk compiled behind its K nearest neighbours among the sample's chunks (MiniLM cosine; the
  nearest right before it, each a document of the template), not behind the template alone: records keyed by
  that lead, so they never meet the plain ones;
- order:oracle: the chunk holding the answer moved last, next to the question; order:retr: chunks in
  ascending order of the retriever's score (MiniLM cosine to the question), the best last.
Every row also records guard signals: the first token's margin (top-1 minus top-2 logprob), the retriever's
margin between its two best chunks, the lexical spread (how many chunks hold the question's rarest word), and for
query policies the probe's split (the second-most-attended chunk's share of the most-attended one's mass).

    .venv/bin/python scripts/screen_lookalike.py --dtype bfloat16 --tasks lookalike --samples 40 \
        --variants base@20 nosink@20 chunks:after@20 --out docs/bench/qwen-frontier/dev/screen.jsonl
    .venv/bin/python scripts/screen_lookalike.py --dtype float32 --tasks lookalike niah --samples 20 \
        --variants naive query-20 nbr2/naive nbr2/query-20 order:oracle/query-20 order:retr/query-20 \
        --out docs/bench/qwen-frontier/dev/crosschunk.jsonl
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path

import torch

from epic_rag import EngineConfig, EpicEngine
from epic_rag.bench.accuracy import _score, build_samples, sample_segments
from epic_rag.engine.link.linker import Linker

CUR: dict = {}  # the variant under way and the sample's facts (what the oracles are told)
FILLER = (
    "The report below collects notes from several teams. Each section was written separately and later "
    "gathered into one place, so the style changes from part to part. Some sections describe routine "
    "matters such as schedules, rooms and supplies, while others list facts that readers may need to look "
    "up later. Readers are expected to skim most of it and return to the parts that matter to them. Where "
    "a section refers to a person, a product or a service, the name is given in full, and numbers are "
    "written as digits. Nothing in this collection is confidential, and it may be shared within the "
    "organisation. Corrections can be sent to the editor, who updates the collection once a month. "
) * 2


def lead_with_filler(tokenizer, kind: str = "template") -> list[int]:
    """The template up to its second document, the first holding FILLER."""
    from epic_rag.prompt import compile_lead_behind, encode_text

    return compile_lead_behind(tokenizer, [encode_text(tokenizer, FILLER)], kind)


def home_of(s) -> int | None:
    """The chunk holding the answer (the look-alike task's asked record; else the first chunk holding the
    gold answer's text)."""
    if s.meta.get("home_chunk") is not None:
        return s.meta["home_chunk"]
    if s.meta.get("answer_chunk") is not None:
        return s.meta["answer_chunk"]
    return next((i for i, c in enumerate(s.chunks) if s.answer and s.answer.lower() in c.lower()), None)


def guard_signals(s, enc) -> dict:
    """Signals known before linking: the retriever's scores and the lexical spread of the question."""
    import re

    import numpy as np

    q = enc.encode([s.question], normalize_embeddings=True, show_progress_bar=False)
    cs = enc.encode(list(s.chunks), normalize_embeddings=True, show_progress_bar=False)
    sims = (cs @ q[0]).tolist()
    top = sorted(sims, reverse=True)
    words = [w for w in re.findall(r"[A-Za-z0-9_.-]{3,}", s.question)]
    counts = {w: sum(w.lower() in c.lower() for c in s.chunks) for w in words}
    held = [w for w in words if counts[w] > 0]
    rare = min(held, key=lambda w: (counts[w], -len(w))) if held else None
    return {
        "sims": [round(x, 4) for x in sims],
        "retr_margin": round(top[0] - top[1], 4) if len(top) > 1 else 1.0,
        "lex_spread": counts[rare] if rare else 0,
        "nbrs": [np.argsort(-(cs @ cs[i]))[1:].tolist() for i in range(len(cs))],
    }


def _sinkish(tok) -> torch.Tensor:
    """[vocab] bool: tokens without a letter or digit (punctuation, whitespace, newlines)."""
    out = torch.zeros(len(tok), dtype=torch.bool)
    for i in range(len(tok)):
        out[i] = not any(c.isalnum() for c in tok.decode([i]))
    return out


def _whole_chunks(var: str, spans, chosen) -> None:
    h = CUR["home"]
    named = {
        "home": [h],
        "look": [CUR["look"]] if CUR["look"] is not None else [],
        "nothome": [i for i in range(len(spans)) if i != h],
        "after": [i for i in range(len(spans)) if i > h],
        "before": [i for i in range(len(spans)) if i < h],
    }
    for part in var.split(":")[1].split("+"):
        for i in named[part]:
            sp = spans[i]
            chosen[sp.start : sp.start + sp.kv.num_tokens] = True


def _records(var: str, tok, job, spans, T: int) -> torch.Tensor:
    """Tokens of a sentence or table row that holds a digit, in the chunks the variant names."""
    text = [tok.decode([t]) for t in job.token_ids]
    seg, sid = [], 0
    for t in text:
        seg.append(sid)
        if "\n" in t or t.strip().endswith("."):
            sid += 1
    digit = {seg[i] for i, t in enumerate(text) if any(c.isdigit() for c in t)}
    mask = torch.tensor([seg[i] in digit for i in range(T)])
    allow = torch.zeros(T, dtype=torch.bool)
    for i, sp in enumerate(spans):
        if var.endswith(":all") or (var.endswith(":after") and i > CUR["home"]):
            allow[sp.start : sp.start + sp.kv.num_tokens] = True
    return mask & allow


def _fill_windows(chosen, cand, sc, left: int, T: int, w: int = 6) -> None:
    order = torch.argsort(torch.where(chosen, torch.tensor(-9.0), sc), descending=True).tolist()
    for p in order:
        if left <= 0 or sc[p] < 0:
            return
        lo, hi = max(0, p - w), min(T, p + w + 1)
        seg = cand[lo:hi] & ~chosen[lo:hi]
        k = int(seg.sum())
        if k > left:
            chosen[torch.nonzero(seg).flatten()[:left] + lo] = True
            return
        chosen[lo:hi] |= cand[lo:hi]
        left -= k


def make_picks(tok, engine_picks):
    sinkish = _sinkish(tok)

    def picks(self, s):
        var, job, a0 = CUR["v"], s.load.job, s.load.start
        T = len(job.token_ids)
        score = (s.score if s.score is not None else torch.zeros(T)).float().cpu()
        mass = sorted(
            (float(score[sp.start : sp.start + sp.kv.num_tokens].sum()) for sp in job.spans if not sp.exact),
            reverse=True,
        )
        CUR["split"] = round(mass[1] / mass[0], 4) if len(mass) > 1 and mass[0] > 0 else 0.0
        if var == "engine":
            return engine_picks(self, s)
        cand = s.candidate.clone()
        cand[:a0] = False
        keep = ~s.cached
        keep[:a0] = False
        n_pick = int(round(job.policy.ratio * int(cand.sum())))
        ids = torch.tensor(job.token_ids)
        sc = score.clone()
        if "nosink" in var:
            sc[sinkish[ids]] = -1
        sc[~cand] = -2
        chosen = torch.zeros(T, dtype=torch.bool)
        spans = [sp for sp in job.spans if not sp.exact]
        if var.startswith("chunks:"):
            _whole_chunks(var, spans, chosen)
            return torch.nonzero(keep | (chosen & cand)).flatten()
        if var.startswith("records"):
            return torch.nonzero(keep | (_records(var, tok, job, spans, T) & cand)).flatten()
        if var.startswith("after"):
            scn = score.clone()
            scn[sinkish[ids]] = 0
            pool = [scn[sp.start : sp.start + sp.kv.num_tokens] for sp in spans]
            mass = [float(p.max() if var == "after-max" else p.sum()) for p in pool]
            a = max(range(len(spans)), key=lambda i: mass[i])
            allow = torch.zeros(T, dtype=torch.bool)
            for sp in spans[a:]:
                allow[sp.start : sp.start + sp.kv.num_tokens] = True
            k = min(n_pick, int((allow & cand).sum()))
            if k:
                chosen[torch.topk(torch.where(allow & cand, sc, torch.tensor(-3.0)), k).indices] = True
        elif "lex" in var:
            q = {t for t in job.tail if not sinkish[t]}
            for p in torch.nonzero(torch.tensor([t in q for t in job.token_ids]) & cand).flatten().tolist():
                chosen[max(0, p - 4) : p + 5] = True
            chosen &= cand
            if int(chosen.sum()) > n_pick:  # the best-scored of them
                top = torch.topk(torch.where(chosen, score, torch.tensor(-5.0)), n_pick).indices
                chosen[:] = False
                chosen[top] = True
        left = n_pick - int(chosen.sum())
        if "win" in var and left > 0:
            _fill_windows(chosen, cand, sc, left, T)
        elif left > 0:
            chosen[torch.topk(torch.where(chosen, torch.tensor(-9.0), sc), left).indices] = True
        return torch.nonzero(keep | (chosen & cand)).flatten()

    return picks


def ordered(s, mods: set[str], sig: dict):
    """The sample with its chunks in the order the variant asks for."""
    import dataclasses

    order = list(range(len(s.chunks)))
    home = home_of(s)
    if "order:oracle" in mods and home is not None:
        order = [i for i in order if i != home] + [home]
    elif "order:retr" in mods:
        order = sorted(order, key=lambda i: sig["sims"][i])
    return dataclasses.replace(s, chunks=[s.chunks[i] for i in order]), order


def run_variant(eng, tok, s, v: str, sig: dict, k_of: dict) -> dict:
    """One (sample, variant): its chunks compiled as the variant asks, linked, answered and scored."""
    mods_s, _, pol = v.rpartition("/")
    mods = set(mods_s.split("+")) if mods_s else set()
    sample, order = ordered(s, mods, sig)
    nbr = next((int(m[3:]) for m in mods if m.startswith("nbr")), 0)
    if nbr:  # the engine's refine: each chunk behind its nearest (the nearest right before it)
        near = [[k_of[s.chunks[j]] for j in sig["nbrs"][i][:nbr]][::-1] for i in range(len(s.chunks))]
        eng.chunks.refine([k_of[c] for c in s.chunks], near)
    segs = sample_segments(tok, sample)
    CUR.update(split=None)
    if "@" in pol:
        name, r = pol.split("@")
        looks = s.meta.get("lookalike_values") or []
        look = next((order.index(i) for i, c in enumerate(s.chunks) if looks and looks[0] in c), None)
        home = home_of(s)
        CUR.update(v=name, home=order.index(home) if home is not None else None, look=look)
        pol = f"query-{r}"
    else:
        CUR.update(v="engine")
    salt = None if pol == "full" else uuid.uuid4().hex
    g = eng.generate(segs, max_tokens=12, policy=pol, cache_salt=salt, logprobs=2)
    first = g.logprobs[0] if g.logprobs else None
    alts = sorted((a["logprob"] for a in first["top_logprobs"]), reverse=True) if first else []
    row = {"id": s.id, "task": s.task, "variant": v, "ok": _score(s, g.text)["substring"]}
    row |= {"pred": g.text[:40], "rec": g.recomputed_tokens, "ttft": g.ttft_s, "prompt": g.prompt_tokens}
    row |= {"margin": round(alts[0] - alts[1], 4) if len(alts) > 1 else None, "split": CUR.get("split")}
    row |= {k: sig[k] for k in ("retr_margin", "lex_spread")}
    eng.chunks._refined.clear()  # the next variant links the plain records again (screening only)
    return row


GUARDS = {  # signal -> risk (higher: escalate first)
    "margin": lambda r: -(r["margin"] if r["margin"] is not None else 99.0),  # a first token barely chosen
    "split": lambda r: r["split"] if r["split"] is not None else 0.0,  # the probe's attention on two chunks
    "retr_margin": lambda r: -r["retr_margin"],  # the retriever barely prefers one chunk
    "lex_spread": lambda r: r["lex_spread"],  # the question's rarest word in many chunks
}


def report(rows: list[dict], guarded: list[str]) -> str:
    """Markdown: each variant's answers per task (complete samples only), and for each `guarded` variant the
    guard curves: escalating the riskiest share of its requests by each signal (escalated = answered as full),
    the errors caught and the accuracy that gives."""
    from collections import defaultdict

    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by[r["id"]][r["variant"]] = r
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    out = ["| variant | " + " | ".join(tasks) + " | recomputed tokens (median) |", "|---" * (len(tasks) + 2) + "|"]
    for v in variants:
        cells, recs = [], []
        for t in tasks:
            ids = [i for i, vs in by.items() if v in vs and "full" in vs and vs[v]["task"] == t]
            cells.append(f"{sum(by[i][v]['ok'] for i in ids):.0f} / {len(ids)}" if ids else "")
            recs += [by[i][v]["rec"] for i in ids]
        med = sorted(recs)[len(recs) // 2] if recs else ""
        out.append(f"| `{v}` | " + " | ".join(cells) + f" | {med} |")
    for v in guarded:
        ids = [i for i, vs in by.items() if v in vs and "full" in vs]
        if not ids:
            continue
        lost = {i for i in ids if by[i]["full"]["ok"] and not by[i][v]["ok"]}
        base = sum(by[i][v]["ok"] for i in ids)
        full = sum(by[i]["full"]["ok"] for i in ids)
        out += [
            "",
            f"Guard curves for `{v}` ({len(ids)} samples, {base:.0f} right; full {full:.0f}; {len(lost)} lost "
            "to full):",
            "",
            "| signal | escalated 10 % | 20 % | 30 % | 50 % |",
            "|---|---|---|---|---|",
        ]
        for name, risk in GUARDS.items():
            if all(by[i][v].get(name) is None for i in ids):  # not measured for this variant (split: query only)
                continue
            order = sorted(ids, key=lambda i: risk(by[i][v]), reverse=True)
            cells = []
            for share in (0.1, 0.2, 0.3, 0.5):
                esc = set(order[: round(share * len(ids))])
                acc = sum(by[i]["full" if i in esc else v]["ok"] for i in ids)
                cells.append(f"{len(esc & lost)}/{len(lost)} caught, {acc:.0f} right")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tasks", nargs="+", default=["lookalike"])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--variants", nargs="+", default=[])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--report",
        nargs="*",
        metavar="VARIANT",
        help="print the Markdown tables of --out (and the guard curves of these variants) instead of running",
    )
    ap.add_argument("--filler", action="store_true", help="compile behind the template and a filler document")
    a = ap.parse_args()
    if a.report is not None:
        print(report([json.loads(line) for line in a.out.read_text().splitlines()], a.report))
        return
    if a.filler:
        import epic_rag.engine.engine as engine_module

        engine_module.compile_lead = lead_with_filler
    from epic_rag.embeddings import sentence_encoder

    eng = EpicEngine(
        EngineConfig(model="qwen2.5-coder-0.5b-instruct", dtype=a.dtype, max_model_len=8192, kv_cache_gib=4)
    )
    tok = eng.tokenizer
    Linker._query_picks = make_picks(tok, Linker._query_picks)
    enc = sentence_encoder()
    samples = build_samples(tok, {t: a.samples for t in a.tasks}, tasks=tuple(a.tasks), split="dev")
    done = set()
    if a.out.exists():
        done = {(r["id"], r["variant"]) for r in map(json.loads, a.out.read_text().splitlines())}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        for s in samples:
            todo = [v for v in ([] if a.filler else ["full"]) + a.variants]
            todo = [v for v in todo if (s.id, f"filler/{v}" if a.filler else v) not in done]
            if not todo:
                continue
            eng.compile(list(s.chunks))
            sig = guard_signals(s, enc)
            k_of = {c: eng.chunks.chunk_tokens(c) for c in s.chunks}
            for v in todo:
                if a.filler:
                    segs = sample_segments(tok, s)
                    g = eng.generate(segs, max_tokens=12, policy=v, cache_salt=uuid.uuid4().hex)
                    row = {"id": s.id, "task": s.task, "variant": f"filler/{v}", "ok": _score(s, g.text)["substring"]}
                    row |= {"pred": g.text[:40], "rec": g.recomputed_tokens, "ttft": g.ttft_s}
                else:
                    row = run_variant(eng, tok, s, v, sig, k_of)
                print(json.dumps({k: row[k] for k in ("id", "variant", "ok", "rec", "margin", "split")}), flush=True)
                f.write(json.dumps(row) + "\n")
                f.flush()
    eng.shutdown()


if __name__ == "__main__":
    main()
