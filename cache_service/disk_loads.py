"""Adapters on disk -> a filled upload, converting PEFT folders straight into the backend's buffer.

A PEFT folder (safetensors) is planned from its headers, then its rows are
written directly into the writer's buffer (for shm, the segment that will be
published) and checked for NaN/Inf row by row as they are written: the file
is read once, the segment written once, and no full-size intermediate tensor
exists. The writer's buffer is zero-filled (a fresh segment, a fresh
bytearray), so the rows' padding needs no writing. With conversion workers
(`convert_procs`) and a shared-memory buffer, a conversion that finds another
one running in this process goes to a worker process, which writes and hashes
the rows outside this process's GIL; one that finds none runs here (a lone cold
adapter pays no hand-over). Other formats are read whole and copied in.
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Callable

from loraplex.formats import AdapterError, detect_format, load_adapter
from loraplex.formats.peft_rows import PeftRows, plan_peft
from cache_service.convert_procs import ConvertProcesses, WorkersLost
from cache_service.uploads import (Upload, UploadClaim, claim_for, fill_rows_hashed, map_adapter_error,
                                   weight_bytes)


def _claim_for_rows(rows: PeftRows, task_id: int, name: str, source: str) -> UploadClaim:
    return UploadClaim(task_id=task_id, config=rows.config, dtype=str(rows.dtype).removeprefix("torch."),
                       shape=rows.shape, num_bytes=rows.num_bytes, source=source, name=name,
                       original_format="peft", extra=dict(rows.metadata.extra))


# One fill at a time in this process (its own threads still split it: `peft_rows.fill_workers`). A fill
# is a few thousand short array operations, each giving the GIL up and taking it back; fills of several
# adapters at once (a burst of new names) hand the GIL around on every one of them, and the convoy costs
# more than the work. 2 cores: 16 cold rank-64 SmolLM2 adapters asked for at once resolved in 0.95-1.04 s
# with this lock against 1.18-1.53 s without (one after another: 0.95-1.07 s either way).
_FILL_ONE_AT_A_TIME = threading.Lock()


def _fill(rows: PeftRows, upload: Upload, *, locked: bool = False) -> AdapterError | None:
    """Writes the rows into the upload's buffer and hashes them as they are written (`fill_rows_hashed`),
    one fill at a time (`locked`: the caller holds the turn); the refusal, if any, holds no frame (and so
    no view of the buffer), so the segment can be unmapped at once."""
    try:
        with contextlib.nullcontext() if locked else _FILL_ONE_AT_A_TIME:
            version = fill_rows_hashed(rows, upload.weights_view(), upload.writer.buffer)
    except AdapterError as exc:
        return exc.with_traceback(None)
    upload.mark_filled(values_checked=True, version=version)
    return None


def _fill_in_worker(rows: PeftRows, upload: Upload, path: Path, convert: ConvertProcesses) -> None:
    """The rows written and hashed by a worker process into the upload's segment."""
    location = upload.writer.shm_location
    assert location is not None
    segment, offset = location
    version = convert.fill(path, rows.dtype, segment, offset, rows.shape)
    upload.mark_filled(values_checked=True, version=version)
    upload.converted_by = "worker"


def _upload_rows(path: Path, rows: PeftRows, claim: UploadClaim, begin: Callable[[UploadClaim], Upload],
                 convert: ConvertProcesses | None) -> Upload:
    upload = begin(claim)
    here = False           # this thread holds the fill turn (a conversion that found none running)
    try:
        if convert is not None and upload.writer.shm_location is not None:
            here = convert.local_first and _FILL_ONE_AT_A_TIME.acquire(blocking=False)
            if not here:
                try:
                    _fill_in_worker(rows, upload, path, convert)
                    return upload
                except WorkersLost:
                    upload.abort()      # what the worker wrote is not trusted: a fresh segment, converted here
                    upload = begin(claim)
        refused = _fill(rows, upload, locked=here)
    except BaseException:
        upload.abort()
        raise
    finally:
        if here:
            _FILL_ONE_AT_A_TIME.release()
    if refused is not None:
        upload.abort()
        raise refused
    upload.converted_by = "service"
    return upload


def upload_from_disk(path: Path, task_id: int, *, name: str, source: str,
                     begin: Callable[[UploadClaim], Upload], convert: ConvertProcesses | None = None) -> Upload:
    """An upload holding the adapter at `path`, ready to finish; `begin` opens it in the cache. A PEFT
    folder is converted by a worker of `convert` when given and the upload's buffer is shared memory."""
    try:
        if detect_format(path) == "peft":
            rows = plan_peft(path)
            return _upload_rows(path, rows, _claim_for_rows(rows, task_id, name, source), begin, convert)
        adapter = load_adapter(path).with_metadata(source=source)
    except AdapterError as exc:
        raise map_adapter_error(exc, str(path)) from exc
    upload = begin(claim_for(adapter, task_id, name=name))
    try:
        upload.write(weight_bytes(adapter))
    except BaseException:
        upload.abort()
        raise
    return upload
