"""Unpacking an uploaded artifact into a staging folder: a folder's files, or one .tar or .zip.

Only plain files and folders are kept; absolute paths, ``..``, links and devices are refused,
and an archive's unpacked size is held to the upload limit (a small archive may unpack to a
huge one). When everything lies under one top folder (the folder a person picked, or the one
an archive was made of), that folder is dropped so the artifact's files sit at its root.
"""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import IO

from core.errors import InvalidInput

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


def is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def safe_relative_path(name: str) -> PurePosixPath:
    """``name`` as a path inside the artifact, or InvalidInput when it would leave it."""
    path = PurePosixPath(name.replace("\\", "/"))
    if not name or path.is_absolute() or any(part in ("", ".", "..") for part in path.parts) or not path.parts:
        raise InvalidInput("artifact_files", f"{name!r} is not a path inside the artifact.")
    return path


def _drop_single_top_folder(root: Path) -> None:
    entries = list(root.iterdir())
    if len(entries) == 1 and entries[0].is_dir():
        top = entries[0]
        holder = root / f".unwrap-{top.name}"
        top.rename(holder)
        for child in holder.iterdir():
            child.rename(root / child.name)
        holder.rmdir()


def stage_files(files: Iterable[tuple[str, IO[bytes]]], *, target: Path, max_bytes: int) -> None:
    """Write each (relative path, readable) into ``target``."""
    total = 0
    count = 0
    for name, handle in files:
        path = target / safe_relative_path(name)
        if path.exists():
            raise InvalidInput("artifact_files", f"{name} was sent twice.")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as out:
            shutil.copyfileobj(handle, out, 1 << 20)
            total += out.tell()
        count += 1
        if total > max_bytes:
            raise InvalidInput("artifact_files", f"The files come to more than the limit of {max_bytes:,} bytes.")
    if not count:
        raise InvalidInput("artifact_files", "Choose a folder, its files, or one .tar or .zip.")
    _drop_single_top_folder(target)


def unpack_archive(archive: Path, *, original_name: str, target: Path, max_bytes: int) -> None:
    """Unpack a .zip or (gzipped) .tar into ``target``."""
    if original_name.lower().endswith(".zip"):
        _unpack_zip(archive, original=original_name, target=target, max_bytes=max_bytes)
    else:
        _unpack_tar(archive, original=original_name, target=target, max_bytes=max_bytes)
    if not any(p.is_file() for p in target.rglob("*")):
        raise InvalidInput("artifact_files", f"{original_name} holds no files.")
    _drop_single_top_folder(target)


def _too_big(original: str, max_bytes: int) -> InvalidInput:
    return InvalidInput("artifact_files", f"{original} unpacks to more than the limit of {max_bytes:,} bytes.")


def _unpack_zip(archive: Path, *, original: str, target: Path, max_bytes: int) -> None:
    try:
        with zipfile.ZipFile(archive) as bundle:
            members = [m for m in bundle.infolist() if not m.is_dir()]
            for member in members:
                # The upper bits of external_attr are the Unix mode: refuse links and devices.
                mode = member.external_attr >> 16
                if mode and (mode & 0o170000) not in (0, 0o100000):
                    raise InvalidInput("artifact_files", f"{member.filename} in the archive is not a plain file.")
                safe_relative_path(member.filename)
            if sum(m.file_size for m in members) > max_bytes:
                raise _too_big(original, max_bytes)
            for member in members:
                path = target / safe_relative_path(member.filename)
                path.parent.mkdir(parents=True, exist_ok=True)
                with bundle.open(member) as source, open(path, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
    except (zipfile.BadZipFile, EOFError):
        raise InvalidInput("artifact_files", "The .zip file is damaged or not a zip archive.") from None


def _unpack_tar(archive: Path, *, original: str, target: Path, max_bytes: int) -> None:
    try:
        with tarfile.open(archive, mode="r:*") as bundle:
            members = bundle.getmembers()
            for member in members:
                if not (member.isfile() or member.isdir()):
                    raise InvalidInput("artifact_files", f"{member.name} in the archive is not a plain file or folder.")
                if member.isfile():  # folders are made as their files need them
                    safe_relative_path(member.name)
            if sum(m.size for m in members if m.isfile()) > max_bytes:
                raise _too_big(original, max_bytes)
            bundle.extractall(target, members=[m for m in members if m.isfile()], filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InvalidInput("artifact_files", f"The archive cannot be read ({exc.__class__.__name__}).") from None
