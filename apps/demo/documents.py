"""The document routes: the library's status, listing, uploads (parsed in a worker process, off the chat path)
and deletes."""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, File, HTTPException, UploadFile

from .state import DemoState
from .uploads import NameTaken, QuotaExceeded


def documents_router(state: DemoState) -> APIRouter:
    cfg = state.cfg
    api = APIRouter()

    @api.get("/api/status")
    async def status():
        return {**state.library.status(), "engine": state.engine is not None}

    @api.get("/api/documents")
    async def list_documents():
        return {"documents": state.library.list_documents(), "status": state.library.status()}

    @api.post("/api/documents", status_code=202)
    async def upload_document(file: UploadFile = File(...)):
        data = await file.read(cfg.max_upload_bytes + 1)
        if len(data) > cfg.max_upload_bytes:
            raise HTTPException(413, f"document exceeds the upload limit of {cfg.max_upload_bytes} bytes")
        try:
            add = functools.partial(state.library.add_upload, file.filename or "", data)
            info = await asyncio.get_running_loop().run_in_executor(state.upload_pool, add)
        except QuotaExceeded as e:
            raise HTTPException(507, str(e)) from None
        except NameTaken as e:
            raise HTTPException(409, str(e)) from None
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return {"document": info.as_dict()}

    @api.delete("/api/documents/{name:path}")
    async def delete_document(name: str):
        info = await asyncio.to_thread(state.library.delete, name)
        if info is None:
            raise HTTPException(404, f"no document named {name!r}")
        return {"deleted": info.name, "file_removed": info.path is not None}

    return api
