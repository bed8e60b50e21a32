"""create_epic_rag_chain: question -> retriever -> ChatEpic, the retrieved Documents handed to the engine as
chunks (no prompt matching)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.runnables import (
    RunnableConfig,
    RunnableSerializable,
)
from langchain_core.runnables.config import patch_config
from pydantic import ConfigDict, model_validator

from ...prompt import check_template
from .chat_model import ChatEpic, content_text


def _question(value: Any) -> str:
    if isinstance(value, str):
        q = value
    elif isinstance(value, dict):
        q = next((value[k] for k in ("question", "input", "query") if k in value), None)
    elif isinstance(value, HumanMessage):
        q = content_text(value.content, "user")
    else:
        q = None
    if not isinstance(q, str) or not q.strip():
        raise ValueError("input must be a question string or a dict with a 'question' (or 'input') string")
    return q


def _template_of(prompt: Any) -> str | None:
    """A chain prompt as a RagRequest template: a string or a PromptTemplate with `{context}` and
    `{question}` (or `{input}`, as create_retrieval_chain prompts name it) slots."""
    if prompt is None:
        return None
    text = getattr(prompt, "template", prompt)
    if not isinstance(text, str):
        raise ValueError(
            "prompt must be a string or a PromptTemplate with {context} and {question} (or {input}) slots; "
            "for a chat prompt, give its user message as a string (and system= for the system message)"
        )
    return check_template(text.replace("{input}", "{question}") if "{question}" not in text else text)


class EpicRagChain(RunnableSerializable[Any, Any]):
    """question -> retriever -> ChatEpic with the retrieved Documents as chunks (a RagRequest).

    Input: a question string, or a dict with "question" (or "input"/"query"). Output: an AIMessage
    (AIMessageChunks when streaming) whose response_metadata also lists the retrieved `documents`; or, with
    `output="dict"`, create_retrieval_chain's shape: the input (a string as "input") plus "context" (the
    Documents) and "answer" (the text); streamed as {"input"...}, {"context": docs}, then {"answer": delta}s.
    `prompt`: the user message template (see _template_of); default: the engine's own prompt.
    """

    retriever: Any
    llm: ChatEpic
    system: str | None = None
    prompt: str | None = None
    output: Literal["message", "dict"] = "message"

    model_config = ConfigDict(arbitrary_types_allowed=True)

    @model_validator(mode="before")
    @classmethod
    def _prompt_is_a_template(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("prompt") is not None:
            values = {**values, "prompt": _template_of(values["prompt"])}
        return values

    def _call_kwargs(self, docs: list[Document], kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"chunks": docs, **({"template": self.prompt} if self.prompt else {}), **kwargs}

    def _shaped(self, value: Any, docs: list[Document], msg: Any) -> Any:
        if self.output == "message":
            return self._with_docs(msg, docs)
        head = dict(value) if isinstance(value, dict) else {"input": _question(value)}
        return {**head, "context": docs, "answer": msg.content}

    def _messages(self, q: str) -> list[BaseMessage]:
        return ([SystemMessage(self.system)] if self.system else []) + [HumanMessage(q)]

    @staticmethod
    def _docs(docs: Any) -> list[Document]:
        docs = list(docs)
        if not all(isinstance(d, Document) for d in docs):
            raise ValueError("the retriever must return Documents")
        return docs

    @staticmethod
    def _with_docs(msg: Any, docs: list[Document]) -> Any:
        msg.response_metadata["documents"] = docs
        return msg

    def _invoke(self, value: Any, run_manager, config: RunnableConfig, **kwargs: Any) -> AIMessage:
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(self.retriever.invoke(q, child))
        msg = self.llm.invoke(self._messages(q), child, **self._call_kwargs(docs, kwargs))
        return self._shaped(value, docs, msg)

    async def _ainvoke(self, value: Any, run_manager, config: RunnableConfig, **kwargs: Any) -> AIMessage:
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(await self.retriever.ainvoke(q, child))
        msg = await self.llm.ainvoke(self._messages(q), child, **self._call_kwargs(docs, kwargs))
        return self._shaped(value, docs, msg)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    def _head(self, value: Any, docs: list[Document]) -> list[dict]:
        """What a dict stream yields before the answer: the input, then the Documents."""
        if self.output == "message":
            return []
        return [dict(value) if isinstance(value, dict) else {"input": _question(value)}, {"context": docs}]

    def _piece(self, chunk: Any, docs: list[Document]) -> list[Any]:
        if self.output == "message":
            return [self._with_docs(chunk, docs) if chunk.chunk_position == "last" else chunk]
        return [{"answer": chunk.content}] if chunk.content else []

    def _transform(self, values: Iterator[Any], run_manager, config: RunnableConfig, **kwargs: Any) -> Iterator[Any]:
        value = None
        for value in values:  # noqa: B007 - the last input is the question
            pass
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(self.retriever.invoke(q, child))
        yield from self._head(value, docs)
        for chunk in self.llm.stream(self._messages(q), child, **self._call_kwargs(docs, kwargs)):
            yield from self._piece(chunk, docs)

    async def _atransform(
        self, values: AsyncIterator[Any], run_manager, config: RunnableConfig, **kwargs: Any
    ) -> AsyncIterator[Any]:
        value = None
        async for value in values:  # noqa: B007 - the last input is the question
            pass
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(await self.retriever.ainvoke(q, child))
        for head in self._head(value, docs):
            yield head
        async for chunk in self.llm.astream(self._messages(q), child, **self._call_kwargs(docs, kwargs)):
            for piece in self._piece(chunk, docs):
                yield piece

    def transform(
        self, input: Iterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        yield from self._transform_stream_with_config(input, self._transform, config, **kwargs)

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        yield from self.transform(iter([input]), config, **kwargs)

    async def atransform(
        self, input: AsyncIterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        async for chunk in self._atransform_stream_with_config(input, self._atransform, config, **kwargs):
            yield chunk

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self.atransform(one(), config, **kwargs):
            yield chunk


def create_epic_rag_chain(
    retriever: Any,
    engine: Any = None,
    *,
    llm: ChatEpic | None = None,
    system: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    policy: str | None = None,
    prompt: Any = None,
    output: Literal["message", "dict"] = "message",
) -> EpicRagChain:
    """A Runnable answering a question from what `retriever` returns, the Documents linked as chunks.

    `retriever`: any Runnable from a question string to a list of Documents (e.g. a vector store's
    `.as_retriever()`). Give `llm` to reuse a ChatEpic, else one is made on `engine` (or the shared one).
    `prompt`: a string or PromptTemplate with `{context}` and `{question}` (or `{input}`) slots; `{context}`
    becomes the Documents as "Document i:\n<text>\n\n". `output="dict"`: create_retrieval_chain's
    `{input, context, answer}` instead of an AIMessage.
    """
    if llm is None:
        llm = ChatEpic(engine=engine, max_tokens=max_tokens, temperature=temperature, policy=policy)
    return EpicRagChain(retriever=retriever, llm=llm, system=system, prompt=prompt, output=output)
