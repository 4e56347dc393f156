"""The local-folder backend: FileStorage and its streams, every disk call in a worker
thread, and FILE_ERRORS, what each OSError says about the folder. A put that returned
survives a power cut (temporary name, fsync, rename, fsync of the folder).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import anyio

from darkroom import errors
from darkroom.errors import (
    PERMANENT,
    TRANSIENT,
    OriginalMissingError,
    Rule,
    StorageUnavailableError,
)
from darkroom.settings import DEFAULT_PROBE_KEY
from darkroom.store.storage.port import (
    CHUNK_BYTES,
    ObjectStream,
    Page,
    StoredObject,
    Upload,
    too_large,
)

# Folders (one per photo) per page of `list`.
LIST_FOLDERS = 250


class FileStorage:
    """A local folder; writes go to a temporary name in the same folder, fsynced, renamed
    into place, and the folder fsynced: a put that returned survives a power cut."""

    def __init__(self, root: Path, probe_key: str = DEFAULT_PROBE_KEY) -> None:
        self.root, self.probe_key = root, probe_key
        self._base = os.path.abspath(root)  # resolved once, not per key

    def _path(self, key: str) -> Path:
        path = os.path.normpath(os.path.join(self._base, key))
        if not path.startswith(self._base + os.sep):
            raise OriginalMissingError(f"key {key!r} escapes the storage folder")
        return Path(path)

    async def get(self, key: str, max_bytes: int) -> bytes:
        path = self._path(key)
        try:
            return await anyio.to_thread.run_sync(_read_file, path, key, max_bytes)
        except FileNotFoundError as exc:
            raise OriginalMissingError(f"no object at {key}") from exc
        except OSError as exc:
            raise _file_error(f"reading {key}", exc) from exc

    async def open(self, key: str, max_bytes: int) -> ObjectStream:
        """The file as it is now: a writer replaces it by rename, so this descriptor keeps
        reading the bytes it opened, never a half-written new version."""
        path = self._path(key)
        try:
            f = await anyio.to_thread.run_sync(_open_file, path, key, max_bytes)
        except FileNotFoundError as exc:
            raise OriginalMissingError(f"no object at {key}") from exc
        except OSError as exc:
            raise _file_error(f"reading {key}", exc) from exc
        return FileStream(f, key)

    async def put(
        self, key: str, data: bytes, content_type: str, cache_control: str | None = None
    ) -> None:
        """One thread hop per object: mkdir, write and fsync a temporary name, rename it
        into place, fsync the folder."""
        try:
            await anyio.to_thread.run_sync(_write_file, self._path(key), data)
        except OSError as exc:
            raise _file_error(f"writing {key}", exc) from exc

    async def put_many(self, objects: list[Upload], cache_control: str | None = None) -> None:
        """One thread hop for them all, and one fsync per folder (a photo's renditions
        share one): what a put of each costs four times."""
        files = [(self._path(o.key), o.data) for o in objects]
        try:
            await anyio.to_thread.run_sync(_write_files, files)
        except OSError as exc:
            more = f" (+{len(objects) - 1} more)" if len(objects) > 1 else ""
            raise _file_error(f"writing {objects[0].key}{more}", exc) from exc

    async def delete(self, key: str) -> None:
        try:
            await anyio.to_thread.run_sync(_remove_file, self._path(key))
        except OSError as exc:
            raise _file_error(f"deleting {key}", exc) from exc

    async def list(self, prefix: str) -> AsyncIterator[Page]:
        """The prefix's entries in name order, a few hundred folders (one per photo) per
        thread hop: of a large tree only the folder names are held at once."""
        try:
            top = self._path(prefix.rstrip("/"))
            names = await anyio.to_thread.run_sync(_sorted_names, top)
            for start in range(0, len(names), LIST_FOLDERS):
                chunk = names[start : start + LIST_FOLDERS]
                yield await anyio.to_thread.run_sync(_scan, self._base, top, chunk)
        except OSError as exc:
            raise StorageUnavailableError(f"listing {prefix}: {exc}") from exc

    async def stat(self, key: str) -> StoredObject | None:
        try:
            found = await anyio.to_thread.run_sync(_stat_file, self._path(key))
        except OSError as exc:
            raise _file_error(f"reading {key}", exc) from exc
        return None if found is None else StoredObject(key, found.st_size, found.st_mtime)

    async def probe(self) -> None:
        """Write and read back a small object: a read-only or full disk fails it."""
        try:
            await self.put(self.probe_key, b"darkroom", "text/plain")
            await anyio.Path(self._path(self.probe_key)).read_bytes()
        except (OSError, OriginalMissingError) as exc:
            raise StorageUnavailableError(f"storage folder {self.root}: {exc}") from exc

    async def aclose(self) -> None:
        return None


def _errno(*names: str) -> Any:
    codes = {getattr(errno, name) for name in names if hasattr(errno, name)}
    return lambda exc: getattr(exc, "errno", None) in codes


# What each OSError of the local folder says about it, first match wins (a network mount
# can be busy or time out; a full disk can be freed).
FILE_ERRORS: tuple[Rule, ...] = (
    Rule(OSError, StorageUnavailableError, "busy", TRANSIENT,
         _errno("EAGAIN", "EBUSY", "EINTR", "ETIMEDOUT", "ESTALE")),
    Rule(OSError, StorageUnavailableError, "resources", TRANSIENT,
         _errno("ENOSPC", "EDQUOT", "EMFILE", "ENFILE", "ENOMEM")),
    Rule(OSError, StorageUnavailableError, "io", PERMANENT),
)  # fmt: skip


def _file_error(what: str, exc: OSError) -> StorageUnavailableError:
    mapped = errors.classify(FILE_ERRORS, exc)
    assert mapped is not None  # the last row takes every OSError
    return StorageUnavailableError(f"{what}: {mapped}", reason=mapped.reason,
                                   transient=mapped.transient)  # fmt: skip


def _read_file(path: Path, key: str, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise too_large(key, size, max_bytes)
        return f.read()


def _open_file(path: Path, key: str, max_bytes: int) -> BinaryIO:
    f = open(path, "rb")  # noqa: SIM115 - FileStream owns it and closes it
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        f.close()
        raise too_large(key, size, max_bytes)
    return f


class FileStream:
    """One chunk per thread hop, so the event loop never waits on the disk."""

    def __init__(self, f: BinaryIO, key: str) -> None:
        self._f, self._key = f, key
        self.size = os.fstat(f.fileno()).st_size
        self._left = self.size

    async def read(self) -> bytes:
        if self._left <= 0:
            return b""
        try:
            data = await anyio.to_thread.run_sync(self._f.read, min(CHUNK_BYTES, self._left))
        except (OSError, ValueError) as exc:  # ValueError: read after close
            raise StorageUnavailableError(f"reading {self._key}: {exc}") from exc
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()


def _write_file(path: Path, data: bytes) -> None:
    _write_files([(path, data)])


def _write_files(files: list[tuple[Path, bytes]]) -> None:
    # Ordering: the bytes are on disk before the rename publishes the name, and the names
    # are on disk (folders fsynced) before put returns, so before the publishing commit.
    # Every temporary file is written before any is fsynced: on a journalling filesystem
    # the first fsync then commits most of their metadata at once, not one commit each.
    folders = list(dict.fromkeys(path.parent for path, _ in files))
    for folder in folders:
        _make_folders(folder)
    staged: list[tuple[BinaryIO, Path, Path]] = []
    try:
        for path, data in files:
            staged.append(_staged(path, data))
        for f, _, _ in staged:
            os.fsync(f.fileno())
            f.close()
        for _, tmp, path in staged:
            os.replace(tmp, path)
    except BaseException:
        _discard(staged)
        raise
    for folder in folders:
        _fsync_folder(folder)


def _staged(path: Path, data: bytes) -> tuple[BinaryIO, Path, Path]:
    """`data` written (not yet fsynced) to a temporary name beside `path`, still open."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    f = open(tmp, "wb")  # noqa: SIM115 - closed by the caller once fsynced
    try:
        f.write(data)
        f.flush()
    except BaseException:
        _discard([(f, tmp, path)])
        raise
    return f, tmp, path


def _discard(staged: list[tuple[BinaryIO, Path, Path]]) -> None:
    """Close and remove what a failed put staged (a renamed one is gone already: the
    renditions of a put that failed are unreferenced, for `darkroom gc`)."""
    for f, tmp, _ in staged:
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()


def _make_folders(folder: Path) -> None:
    """mkdir -p, fsyncing the parent of each folder it creates (a new name is an entry
    in its parent, lost in a power cut until the parent is synced)."""
    missing: list[Path] = []
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another put made it meanwhile
            new.mkdir()
        _fsync_folder(new.parent)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _stat_file(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _sorted_names(top: Path) -> list[str]:
    try:
        return sorted(os.listdir(top))
    except FileNotFoundError:
        return []


def _scan(base: str, top: Path, names: list[str]) -> Page:
    """The files under these entries of `top`, with keys relative to the storage folder.
    A file that vanishes while scanned (deleted, or a temporary name renamed) is skipped."""
    found: Page = []
    for name in names:
        path = top / name
        walked = os.walk(path) if path.is_dir() else [(str(top), [], [name])]
        for folder, _, files in walked:
            for file in sorted(files):
                full = os.path.join(folder, file)
                with contextlib.suppress(FileNotFoundError):
                    stat = os.stat(full)
                    key = os.path.relpath(full, base).replace(os.sep, "/")
                    found.append(StoredObject(key, stat.st_size, stat.st_mtime))
    return found
