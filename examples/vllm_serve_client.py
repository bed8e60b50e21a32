"""A client of stock `vllm serve` running EpicConnector: compile chunks through the server, link them in another
order by naming their spans, and let the server find them in a prompt that names nothing. Needs only `openai`
and `transformers` (for the model's tokenizer): epic_rag runs inside the server.

Start the server (any model vLLM loads; `find_chunks` switches the finder on for requests that name nothing):

    python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-Coder-0.5B-Instruct --enforce-eager \\
      --kv-transfer-config '{"kv_connector": "EpicConnector", "kv_connector_module_path": "epic_rag.engine.connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"store": "memory", "find_chunks": "query-20"}}'

then: python examples/vllm_serve_client.py --model Qwen/Qwen2.5-Coder-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import json
import uuid

# Documents as a retriever returns them. The server finds a chunk by its first 16 tokens, so shorter ones are not
# found in prompts that name nothing (they are still linked where a request names them).
CHUNKS = [
    "The Larkspur Bridge opened in 1931 and is 412 metres long. It carries two lanes of traffic and a footpath "
    "over the river Wend, and was repainted in 2004.",
    "The archive room's passcode is 7314. Only the head archivist and the night porter know it; it changes "
    "every spring, on the first Monday of April.",
    "The lighthouse on Gull Point was automated in 1987. Its lamp is visible for 18 nautical miles, and its "
    "last keeper, Ada Moss, still lives in the village below it.",
]
QUESTION = "\nQuestion: How long is the Larkspur Bridge?\nAnswer:"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument(
        "--tokenizer", default=None, help="the model's tokenizer: folder or Hugging Face id (default: --model)"
    )
    ap.add_argument("--policy", default="query-20", help="the link policy (query-20, legolink-16, full, ...)")
    ap.add_argument("--tenant", default=None, help="the tenant namespace (default: a fresh random one)")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    from openai import OpenAI
    from transformers import AutoTokenizer

    client = OpenAI(base_url=args.url, api_key="none")
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    # The chunk's sink: the token every chunk is compiled behind (BOS, or EOS where a model has no BOS).
    sink = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    # Every request of a tenant carries a cache_salt "<namespace>:..."; its records are linked and found only
    # under that namespace. One salt shared by its requests lets vLLM's prefix cache reuse blocks between them.
    salt = f"{args.tenant or uuid.uuid4().hex}:shared"

    def complete(prompt: list[int], max_tokens: int, params: dict | None, **extra) -> tuple[str, dict]:
        body = dict(extra, cache_salt=salt)
        if params is not None:
            body["kv_transfer_params"] = params
        r = client.completions.create(
            model=args.model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=body
        )
        return r.choices[0].text, (r.model_extra or {}).get("kv_transfer_params") or {}

    # 1. Compile: the prompt is the lead (the sink alone: lead 1) and the chunk; 2 tokens generated, so the
    #    outcome is known when the request ends. The server derives the record's key and returns it.
    chunk_ids = [tok(c, add_special_tokens=False).input_ids for c in CHUNKS]
    keys = []
    for ids in chunk_ids:
        _, params = complete([sink] + ids, 2, {"epic": {"compile": {"lead": 1}}}, min_tokens=2, ignore_eos=True)
        keys.append(params["epic"]["stored"])
    print("compiled:", ", ".join(k[:16] for k in keys))

    # 2. Link, in another order: a span is [key, offset in the record, start in the prompt, tokens, exact].
    prompt, spans = [], []
    for i in reversed(range(len(CHUNKS))):
        spans.append([keys[i], 0, len(prompt), 1 + len(chunk_ids[i]), False])
        prompt += [sink] + chunk_ids[i]
    prompt += tok(QUESTION, add_special_tokens=False).input_ids
    link = {"epic": {"link": {"policy": args.policy, "sink": sink, "spans": spans}}}
    text, params = complete(prompt, args.max_tokens, link)
    print(f"linked ({args.policy}): {text.strip()!r}")
    print("linked params:", json.dumps(params["epic"], sort_keys=True))

    # 3. The same prompt naming nothing: with find_chunks set, the server finds the compiled chunks and links them.
    text, params = complete(prompt, args.max_tokens, None)
    print(f"found: {text.strip()!r}")
    print("found params:", json.dumps(params.get("epic", {}), sort_keys=True))

    # 4. The same prompt computed without linking (exact KV), for comparison.
    text, _ = complete(prompt, args.max_tokens, {"epic": {"find": False}})
    print(f"plain: {text.strip()!r}")


if __name__ == "__main__":
    main()
