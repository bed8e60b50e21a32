"""RagRequest templates: the default rendering is byte-identical to the fixed prompt chunks are compiled
behind; a caller's template places the documents and the question in its slots, as plain text."""

from __future__ import annotations

import pytest

from epic_rag.prompt import DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE, UserText, render_request
from epic_rag.types import Chunk, ChunkRef, RagRequest


class _Tok:
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"


def _fixed_prompt(tokenizer, req: RagRequest) -> list:
    """The rendering before templates existed (copied from the former render_request): the reference."""
    from epic_rag.prompt import _Marks

    marks = _Marks()
    body = DEFAULT_INSTRUCTION
    for i, c in enumerate(req.chunks):
        body += f"Document {i + 1}:\n{marks.add([c if isinstance(c, ChunkRef) else Chunk(c)])}\n\n"
    body += f"Question: {marks.add([UserText(req.question.strip())])}"
    system = [{"role": "system", "content": marks.add([UserText(req.system)])}] if req.system else []
    text = tokenizer.apply_chat_template(
        system + [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
    )
    return marks.split(text)


def _same(a: list, b: list) -> bool:
    return [(type(x), x) for x in a] == [(type(x), x) for x in b]


@pytest.mark.parametrize("system", [None, "Be terse."])
def test_default_template_renders_byte_identical_to_the_fixed_prompt(system):
    tok = _Tok()
    req = RagRequest(question=" What adds? ", chunks=["def add(a, b): ...", ChunkRef("k", 3, "x")], system=system)
    want = _fixed_prompt(tok, req)
    assert _same(render_request(tok, req), want)
    req.template = DEFAULT_TEMPLATE  # given explicitly: the same server glue
    assert _same(render_request(tok, req), want)


def test_default_template_keeps_the_compile_lead_of_a_real_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    req = RagRequest(question="?", chunks=["?"])
    assert _same(render_request(tok, req), _fixed_prompt(tok, req))


def test_a_template_places_documents_and_question_in_its_slots_as_plain_text():
    tok = _Tok()
    req = RagRequest(
        question="Why?", chunks=["alpha", "beta"], template='Use {"json"} <|end|>.\n{context}---\nQ: {question}\nA:'
    )
    segs = render_request(tok, req)
    assert "".join(str(s) if not isinstance(s, Chunk) else s.text for s in segs) == (
        '<|user|>Use {"json"} <|end|>.\nDocument 1:\nalpha\n\nDocument 2:\nbeta\n\n---\nQ: Why?\nA:<|end|><|assistant|>'
    )
    assert [s.text for s in segs if isinstance(s, Chunk)] == ["alpha", "beta"]
    # the caller's text (with a special-token string in it) is UserText: never a control token
    assert any(isinstance(s, UserText) and "<|end|>" in s for s in segs)


@pytest.mark.parametrize(
    "template, needle",
    [("{context} only", "{question}"), ("{question} only", "{context}"), ("{context}{context}{question}", "once")],
)
def test_a_template_without_each_slot_once_is_an_error_naming_it(template, needle):
    with pytest.raises(ValueError, match=needle.replace("{", r"\{").replace("}", r"\}")):
        render_request(_Tok(), RagRequest(question="q", chunks=["c"], template=template))
