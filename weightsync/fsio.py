"""Durable file writes: temp name, fsync, rename, fsync the directory.

Where the filesystem cannot rename (some object-store mounts), files are written once under
their final name instead; the caller keeps the commit order (the index last) either way.
"""

from __future__ import annotations

import errno
import os
from typing import Callable, Iterable

from .format.layout import tmp_name


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the data itself was fsynced
    finally:
        os.close(fd)


def write_file(path: str, chunks: Iterable[bytes | memoryview], *, atomic: bool = True) -> int:
    """Write chunks to path durably; returns bytes written."""
    target = tmp_name(path) if atomic else path
    total = 0
    try:
        with open(target, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                total += len(chunk) if not isinstance(chunk, memoryview) else chunk.nbytes
            f.flush()
            os.fsync(f.fileno())
        if atomic:
            os.replace(target, path)
    except BaseException:
        if atomic:
            try:
                os.unlink(target)
            except OSError:
                pass
        raise
    return total


def write_bytes(path: str, data: bytes, *, atomic: bool = True) -> int:
    return write_file(path, [data], atomic=atomic)


def copy_file(src: str, dst: str, progress: "Callable[[int], None] | None" = None) -> int:
    """Copy with the kernel's copy path (copy_file_range/sendfile), fsync, return the size.
    ``progress(nbytes)`` is told each chunk copied (the copy then goes in 64 MiB chunks)."""
    import shutil

    # A new inode, never a write through the old one: a local file hard-linked to the seed (cp
    # -al) would otherwise be the seed itself (shutil refuses: SameFileError), and an engine
    # that maps the old file keeps reading whole bytes instead of a truncated file.
    try:
        os.unlink(dst)
    except FileNotFoundError:
        pass
    if progress is None:
        shutil.copyfile(src, dst)
    else:
        _copy_in_chunks(src, dst, progress)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return os.path.getsize(dst)


_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}


def _copy_in_chunks(src: str, dst: str, progress: "Callable[[int], None]", chunk: int = 64 << 20) -> None:
    fin, fout = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        in_kernel = hasattr(os, "copy_file_range")
        while True:
            if in_kernel:
                try:
                    n = os.copy_file_range(fin, fout, chunk)
                except OSError as e:
                    if e.errno not in _NO_COPY_RANGE:
                        raise  # ENOSPC, EIO...: the caller's to type
                    in_kernel = False  # a kernel or filesystem without it: read and write from here on
                    continue
            else:
                data = memoryview(os.read(fin, chunk))
                n = len(data)
                while data:
                    data = data[os.write(fout, data):]
            if n <= 0:
                return
            progress(n)
    finally:
        os.close(fin)
        os.close(fout)


def drop_page_cache(path: str) -> None:
    """Evict a source file from the page cache so a seed copy does not push out hot data."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (an advisory note's writer may have died)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Filesystems whose pages are the file: a write through a shared writable mapping changes the
# bytes without moving mtime or ctime (no page_mkwrite hook updates the times), so only the
# bytes themselves show it.
_MEMORY_FS_MAGIC = {
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x958458F6: "hugetlbfs",
}


def find_memory_filesystem(path: str) -> str | None:
    """The name of the memory-backed filesystem ``path`` lives on (tmpfs, ramfs, hugetlbfs), or
    None (another filesystem, or statfs unavailable: the caller's cheaper path then applies)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field, a long
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return _MEMORY_FS_MAGIC.get(f_type)
