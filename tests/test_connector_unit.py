"""EpicConnector's worker side without an engine: what its load hook does with a load whose link job is gone, and
that attach refuses an unsupported configuration."""

from __future__ import annotations

import logging

import pytest
import torch

from epic_rag.engine import connector as conn
from epic_rag.engine.board import BOARD
from epic_rag.engine.support import LinkUnsupported


class _Linker:
    def __init__(self) -> None:
        self.linked = []

    def link_many(self, loads):
        self.linked.append([(ld.job, ld.block_ids, ld.start, ld.end) for ld in loads])


def _worker(meta: conn.EpicMeta, block_size: int = 16) -> conn.EpicConnector:
    c = object.__new__(conn.EpicConnector)  # the worker-side state start_load_kv uses, without a vLLM config
    c.block_size, c.linker, c._load_errors = block_size, _Linker(), set()
    c._get_connector_metadata = lambda: meta
    return c


def test_a_load_whose_link_job_is_gone_reports_its_blocks_as_failed_loads(caplog):
    # claimed tokens 32..80 of a request with 16-token blocks: blocks 2, 3 and 4 (the last one partly)
    meta = conn.EpicMeta(loads=[conn.LoadSpec("req-1", "job-not-on-the-board", [10, 11, 12, 13, 14, 15], 32, 80)])
    c = _worker(meta)
    with caplog.at_level(logging.ERROR):
        c.start_load_kv(None)
    assert c.get_block_ids_with_load_errors() == {12, 13, 14}  # vLLM fails the request holding them
    assert c.get_block_ids_with_load_errors() == set()  # reported once
    assert "is gone" in caplog.text and "request is failed" in caplog.text
    assert c.linker.linked == []


def test_a_load_whose_job_is_on_the_board_is_linked_and_reports_no_failure():
    class Job:
        job_id, error = "job-present", None

    BOARD.post_job(Job())
    try:
        c = _worker(conn.EpicMeta(loads=[conn.LoadSpec("req-2", "job-present", [7, 8], 0, 20)]))
        c.start_load_kv(None)
        assert [[(b, s, e) for _, b, s, e in batch] for batch in c.linker.linked] == [[([7, 8], 0, 20)]]
        assert c.get_block_ids_with_load_errors() == set()
    finally:
        BOARD.drop_job("job-present")


def test_every_load_of_a_step_is_linked_in_one_batch_and_a_failed_batch_fails_each_job_without_raising():
    from types import SimpleNamespace

    jobs = [SimpleNamespace(job_id=f"job-batch-{i}", error=None) for i in range(3)]
    for j in jobs:
        BOARD.post_job(j)
    loads = [conn.LoadSpec(f"req-{i}", j.job_id, [i], 0, 10) for i, j in enumerate(jobs)]
    loads.insert(1, conn.LoadSpec("req-gone", "job-not-on-the-board", [5], 0, 10))
    try:
        c = _worker(conn.EpicMeta(loads=loads))
        c.start_load_kv(None)
        assert [[j for j, *_ in batch] for batch in c.linker.linked] == [jobs]  # one call, the gone one left out
        assert c.get_block_ids_with_load_errors() == {5}

        def broken(batch):
            batch[0].job.error = "its own data was bad"  # failed alone by the linker before the pass
            raise RuntimeError("simulated fault in the batched pass")

        c.linker.link_many = broken
        c.start_load_kv(None)  # never raises into vLLM's step
        assert jobs[0].error == "its own data was bad"
        assert [j.error for j in jobs[1:]] == ["RuntimeError: simulated fault in the batched pass"] * 2
    finally:
        for j in jobs:
            BOARD.drop_job(j.job_id)


def test_attach_refuses_an_unsupported_configuration_before_building_the_linker():
    # A one-layer model shaped like vLLM's (model.model.layers[i].self_attn.{attn, rotary_emb}) with an fp8
    # KV cache: attach must refuse it by name, before the layout self-check would trip over the uint8 cache.
    class Attention(torch.nn.Module):  # vllm_api.find_attention matches vLLM's class name
        def __init__(self) -> None:
            super().__init__()
            self.layer_name = "model.layers.0.self_attn.attn"
            self.num_heads, self.num_kv_heads, self.head_size = 2, 1, 8
            self.kv_cache_dtype = "fp8"
            self.impl = type("CPUAttentionBackendImpl", (), {"logits_soft_cap": 0, "alibi_slopes": None})()

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].self_attn = torch.nn.Module()
    model.model.layers[0].self_attn.attn = Attention()
    model.model.layers[0].self_attn.rotary_emb = object()
    c = object.__new__(conn.EpicConnector)
    c.block_size, c.linker = 16, None
    c.kv_caches = {"model.layers.0.self_attn.attn": torch.zeros((4, 1, 16, 16), dtype=torch.uint8)}
    with pytest.raises(LinkUnsupported, match="kv_cache_dtype='fp8'"):
        c.attach(model)
    assert c.linker is None
