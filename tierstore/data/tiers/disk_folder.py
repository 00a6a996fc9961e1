"""Where the disk tier writes: a folder of its own inside the user's ``disk_path``.

Layout::

    <disk_path>/                     the user's: only read (made 0700 if it is missing)
        tierstore-disk-v1/           tierstore's: made 0700 by tierstore, and marked
            tierstore-folder.json    the marker (0600): tierstore's, its layout, who made it
            .lock                    claim of the machine's first NodeStore
            <namespace>/<n>.slab     its chunks (:mod:`tierstore.data.tiers.slab`)
            node-<id>/               another NodeStore of the same machine: .lock, <namespace>/

tierstore never chmods, deletes or truncates anything in ``disk_path`` but its own
folder's files, and never follows a symlink inside that folder: every file in it is
opened ``O_NOFOLLOW`` and checked to be this user's and private
(:mod:`tierstore.private_files`); a planted one is skipped with a warning naming it, or
refused by name where it cannot be skipped (a lock), its target untouched.

Why the layout version is in the folder's name (rather than a fixed name whose marker
holds the version): a layout change then starts in a new folder next to the old one, and
neither version ever reads, adopts or deletes the other's files; a downgrade finds its
folder intact. With a fixed name a version mismatch could only be refused (every upgrade
failing its start) or wiped (a destructive migration). The marker repeats the version,
so a folder whose name and marker disagree is refused too. A folder of that name without
the marker is never adopted: it may be the user's.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from tierstore.data.tiers.chunk_header import HEX
from tierstore.data.tiers.slab import payload_size_of
from tierstore.errors import ConfigError, TierStoreError
from tierstore.private_files import (
    PRIVATE_DIR_MODE,
    check_private,
    open_nofollow,
    open_private,
    private_dir,
)

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump on any change of what the folder holds; the old folder is left
FOLDER_NAME = f"tierstore-disk-v{LAYOUT_VERSION}"
MARKER_NAME = "tierstore-folder.json"
LOCK_NAME = ".lock"
_MARKER_KIND = "tierstore disk tier"
_MARKER_MAX_BYTES = 4096
# A folder just made by another NodeStore of this machine gets its marker within
# microseconds; an empty unmarked folder is given this long before it is refused.
_MARKER_WAIT_S = 2.0
# A NodeStore restarted on the same node waits this long for its killed predecessor's
# process (which holds the folder's lock) to exit; ray.kill returns first.
CLAIM_TIMEOUT_S = 30.0
_CLAIM_POLL_S = 0.1
_NODE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


class ForeignFolderError(TierStoreError, FileExistsError):
    """``disk_path`` holds a folder of tierstore's name that tierstore did not make (no
    marker, or another layout's): left alone, and the message names it."""


class DiskFolderBusyError(TierStoreError, RuntimeError):
    """Every disk folder this NodeStore could take is held by another live NodeStore."""


# ---- the folder ------------------------------------------------------------------------------
def open_folder(disk_path: Path) -> Path:
    """tierstore's marked folder in ``disk_path``: made (with its marker) if missing,
    checked if present. ``disk_path`` is made (0700, with its parents) if missing, and
    otherwise only read."""
    try:
        disk_path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    except FileExistsError:
        raise ConfigError(f"disk_path: {str(disk_path)!r} is not a directory") from None
    except OSError as exc:
        raise ConfigError(f"disk_path: cannot make {str(disk_path)!r}: {exc}") from exc
    _note_old_layouts(disk_path)
    folder = disk_path / FOLDER_NAME
    try:
        os.mkdir(folder, PRIVATE_DIR_MODE)
    except FileExistsError:
        check_private(folder, os.lstat(folder), stat.S_IFDIR)
        _check_marker(folder)
        return folder
    except OSError as exc:
        raise ConfigError(f"disk_path: cannot make tierstore's folder {folder}: {exc}") from exc
    _write_marker(folder)
    logger.info("disk tier: made %s (tierstore's folder in disk_path)", folder)
    return folder


def _note_old_layouts(disk_path: Path) -> None:
    """Name what looks like an older tierstore layout in ``disk_path`` (chunks kept in
    ``disk_path`` itself before this folder, another layout's folder): never read nor
    removed by tierstore, so its room is the user's to take back."""
    try:
        names = os.listdir(disk_path)
    except OSError:
        return  # not listable: nothing to name
    old = sorted(
        name
        for name in names
        if name != FOLDER_NAME
        and (
            HEX.fullmatch(name)
            or name in (LOCK_NAME, ".free")
            or name.startswith(("node-", "tierstore-disk-v"))
        )
    )
    if old:
        logger.warning(
            "disk_path %s holds what looks like an older tierstore layout (%s%s): tierstore "
            "no longer reads it and never removes it; remove it to free its space",
            disk_path,
            ", ".join(old[:5]),
            f" and {len(old) - 5} more" if len(old) > 5 else "",
        )


def _write_marker(folder: Path) -> None:
    """Written whole, then renamed into place: a reader sees none or all of it."""
    marker = {
        "kind": _MARKER_KIND,
        "layout": LAYOUT_VERSION,
        "created_by": {
            "user": _user(),
            "uid": os.geteuid(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        },
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "note": "KV-cache chunks of tierstore's disk tier: a cache, safe to remove while "
        "no tierstore NodeStore of this machine runs",
    }
    temp = folder / f".{MARKER_NAME}.{os.getpid()}.tmp"
    fd = open_private(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, json.dumps(marker, indent=1).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temp, folder / MARKER_NAME)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.geteuid()}"


def _check_marker(folder: Path) -> None:
    """Raise :class:`ForeignFolderError` unless ``folder`` carries this layout's marker
    (waiting briefly while it is empty: another NodeStore may have just made it)."""
    deadline = time.monotonic() + _MARKER_WAIT_S
    while True:
        try:
            marker = _read_marker(folder / MARKER_NAME)
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline or any(
                not name.startswith(f".{MARKER_NAME}.") for name in os.listdir(folder)
            ):
                raise ForeignFolderError(
                    f"{folder} exists but is not tierstore's (it has no {MARKER_NAME}): "
                    "tierstore never adopts nor wipes a folder it did not make. Move it "
                    "away, or set disk_path to another directory"
                ) from None
            time.sleep(0.05)
    if marker.get("kind") != _MARKER_KIND or marker.get("layout") != LAYOUT_VERSION:
        raise ForeignFolderError(
            f"{folder / MARKER_NAME} is not a tierstore disk tier layout {LAYOUT_VERSION} "
            f"marker (kind {marker.get('kind')!r}, layout {marker.get('layout')!r}): "
            f"tierstore leaves {folder} alone. Move it away, or set disk_path to another "
            "directory"
        )


def _read_marker(path: Path) -> dict[str, object]:
    fd = open_private(path, os.O_RDONLY)  # never through a symlink; this user's, private
    try:
        raw = os.read(fd, _MARKER_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        marker = json.loads(raw) if len(raw) <= _MARKER_MAX_BYTES else None
    except ValueError:
        marker = None
    return marker if isinstance(marker, dict) else {}


# ---- the claim -------------------------------------------------------------------------------
def claim(folder: Path, node_id: str, timeout_s: float = CLAIM_TIMEOUT_S) -> tuple[Path, int]:
    """The directory this NodeStore keeps its chunks in, and the descriptor of the lock
    it holds on it for its lifetime (closing it releases the claim).

    ``folder`` itself when this is the only NodeStore on the machine (so a restarted
    cluster, whose node ids are new, finds its chunks), else ``folder/node-<id>``. A node
    that already has its own directory keeps it: a NodeStore restarted after the
    folder's holder left (its node removed) must find its node's chunks. A holder of the
    same node id is a killed predecessor whose process has not exited yet: it is waited
    for up to ``timeout_s``, or the restarted NodeStore would take a fresh directory."""
    own = folder / f"node-{check_node_id(node_id)}"
    order = (own, folder) if _is_dir(own) else (folder, own)
    deadline = time.monotonic() + timeout_s
    held = []
    for path in order:
        private_dir(path)  # made 0700, or refused by name if planted
        fd, holder = _lock(path, node_id, deadline)
        if fd is not None:
            return path, fd
        held.append(f"{path} by node {holder or '?'}")
        logger.warning("%s is used by another NodeStore on this machine (node %s)", path, holder)
    raise DiskFolderBusyError(
        f"cannot claim a disk tier directory in {folder}: held by live NodeStores "
        f"({'; '.join(held)}); is another tierstore cluster using this disk_path?"
    )


def check_node_id(node_id: str) -> str:
    """A node id names a directory (``node-<id>``): ASCII letters, digits, - and _."""
    if not _NODE_ID.fullmatch(node_id):
        raise ValueError(f"node id must be 1-128 ASCII letters, digits, '-' or '_': {node_id!r}")
    return node_id


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _lock(path: Path, node_id: str, deadline: float) -> tuple[int | None, str]:
    """``path``'s lock with this node's id written in it, or None and the holder's id if
    another live process holds it (past ``deadline`` when that holder is this node)."""
    while True:
        fd = open_private(path / LOCK_NAME, os.O_RDWR | os.O_CREAT)  # never truncated here
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
            os.close(fd)
            if holder != node_id or time.monotonic() >= deadline:
                return None, holder
            time.sleep(_CLAIM_POLL_S)
            continue
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, node_id.encode(), 0)
        return fd, node_id


# ---- what is in it ---------------------------------------------------------------------------
def slab_files(root: Path) -> Iterator[tuple[str, Path, int]]:
    """``(namespace, path, payload bytes)`` of every slab file directly in ``root``'s
    namespace folders. Symlinks and other files planted in their place are skipped with a
    warning naming them; anything else (an operator's notes, ``node-<id>/``) is ignored."""
    for folder in _entries(root):
        if not HEX.fullmatch(folder.name):
            continue
        if not _real(folder, stat.S_IFDIR):
            continue
        for path in _entries(folder):
            nbytes = payload_size_of(path)
            if nbytes is not None and _real(path, stat.S_IFREG):
                yield folder.name, path, nbytes


def store_dirs(disk_path: Path) -> list[Path]:
    """The directories of every NodeStore that used tierstore's folder in ``disk_path``
    (which may also be that folder itself): the folder and its ``node-<id>/``."""
    folder = disk_path if disk_path.name == FOLDER_NAME else disk_path / FOLDER_NAME
    if not _is_dir(folder):
        return []
    nodes = [p for p in _entries(folder) if p.name.startswith("node-") and _is_dir(p)]
    return [folder, *nodes]


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory / name for name in os.listdir(directory))
    except OSError as exc:
        logger.warning("disk tier: cannot list %s: %s", directory, exc)
        return []


def _real(path: Path, kind: int) -> bool:
    """Whether ``path`` is itself of ``kind``; a symlink or other planted file is
    skipped with a warning naming it (never followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_IFMT(mode) == kind:
        return True
    what = "a symlink" if stat.S_ISLNK(mode) else "not a regular file or directory"
    logger.warning("disk tier: skipping %s: %s, never followed nor changed", path, what)
    return False


def open_file(path: Path) -> int:
    """A file in tierstore's folder, read-only, never through a symlink (tools): see
    :func:`~tierstore.private_files.open_nofollow`."""
    return open_nofollow(path, os.O_RDONLY)


# ---- room ------------------------------------------------------------------------------------
def size_of(nbytes: int) -> str:
    """``nbytes`` for a person: ``64 GiB``, ``3.5 MiB``, ``512 bytes``."""
    for unit, size in _UNITS:
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes} bytes"


def mount_of(path: Path) -> Path:
    """The mount point of the filesystem holding ``path``: walked up while the parent is
    on the same device (as far as the walk can stat: a failing disk ends it early).
    Never raises for an existing path."""
    path = Path(os.path.realpath(path))
    try:
        device = os.stat(path).st_dev
        while path != path.parent and os.stat(path.parent).st_dev == device:
            path = path.parent
    except OSError:
        pass
    return path


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (``disk_path`` may be made later)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_size(disk_path: Path, capacity_bytes: int) -> None:
    """Raise :class:`ConfigError` if ``capacity_bytes`` (``disk_bytes_per_node``) is more
    than the whole filesystem that holds (or would hold) ``disk_path``. Changes nothing."""
    where = _existing(disk_path)
    fs = os.statvfs(where)
    total = fs.f_blocks * fs.f_frsize
    if capacity_bytes > total:
        raise ConfigError(
            f"disk_bytes_per_node: {size_of(capacity_bytes)} ({capacity_bytes} bytes) exceeds "
            f"the {size_of(total)} ({total} bytes) filesystem mounted at {mount_of(where)} "
            f"holding disk_path {disk_path}; lower disk_bytes_per_node or set disk_path to a "
            "directory on a larger filesystem"
        )


def warn_if_short(disk_path: Path, capacity_bytes: int, held_bytes: int) -> bool:
    """Log a warning with the figures if the filesystem has less free space than the
    disk tier may still grow by (``capacity_bytes`` less the ``held_bytes`` its files
    already take there). Returns whether it warned."""
    fs = os.statvfs(disk_path)
    free = fs.f_bavail * fs.f_frsize
    wanted = capacity_bytes - held_bytes
    if free >= wanted:
        return False
    logger.warning(
        "disk_bytes_per_node: %s (%d bytes) configured, tierstore's files hold %s (%d bytes) "
        "of it, and the filesystem mounted at %s holding disk_path %s has only %s (%d bytes) "
        "free of the %s (%d bytes) more it may take: disk writes will fail once it fills",
        size_of(capacity_bytes),
        capacity_bytes,
        size_of(held_bytes),
        held_bytes,
        mount_of(disk_path),
        disk_path,
        size_of(free),
        free,
        size_of(wanted),
        wanted,
    )
    return True
