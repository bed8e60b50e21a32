"""EpicConnector's worker-side load hook without a model: what it does with a load whose link job is gone."""

from __future__ import annotations

import logging

from epic_rag.engine import connector as conn
from epic_rag.engine.board import BOARD


class _Linker:
    def __init__(self) -> None:
        self.linked = []

    def link(self, job, block_ids, start, end):
        self.linked.append((job, block_ids, start, end))


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
        assert [(b, s, e) for _, b, s, e in c.linker.linked] == [([7, 8], 0, 20)]
        assert c.get_block_ids_with_load_errors() == set()
    finally:
        BOARD.drop_job("job-present")
