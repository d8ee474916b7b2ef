"""Writing a converted model folder without ever destroying what the user has.

* The destination must not be the source, inside it, or contain it.
* An existing non-empty destination is refused unless overwrite=True.
* Everything is written to a fresh temporary folder and moved into place only when the whole
  conversion succeeded; on failure only that temporary folder (and the parent folders this run
  created) is removed. A new destination is staged next to it; an existing folder (empty, or any
  with overwrite) stays the same folder (it may be the working directory or a mount point): the
  output is staged inside it, and with overwrite its old entries are deleted only at that last step.
* The finished folder and its files get the modes the umask gives new ones (0777 / 0666 masked):
  mkdtemp makes the folder 0700, and safetensors >= 0.8 writes its files 0600 (it renames a
  private temporary file into place), which would leave the weights unreadable to other users.
* Side files copied from a source folder (tokenizer, generation config, ...): a symbolic link is
  followed only when it resolves to a regular file inside the source folder or, for a Hugging
  Face cache snapshot (<repo>/snapshots/<revision>/), inside that repository's cache folder;
  anything else is refused, so that a link to a private file is never copied into the output.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ..cli_errors import UsageError


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Raises UsageError when writing `dst` could touch `src` or replace data without --overwrite,
    or where no folder can be made (a file on its path, a name the file system does not take)."""
    try:
        _check_destination(src, dst, overwrite)
    except OSError as e:  # a name longer than the file system takes, for one
        raise UsageError(f"destination {dst}: {e.strerror or e}; choose another output folder") from None


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise UsageError(f"destination {dst} is the source {src}, inside it or contains it: convert never writes "
                         "into its source; choose another output folder")
    if dst.is_symlink():
        raise UsageError(f"destination {dst} is a symbolic link (to {os.readlink(dst)}); convert writes only into a "
                         "real folder: name the folder itself, or another output folder")
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"destination {dst} exists and is not a folder; choose another output folder")
    above = next((p for p in dst.parents if _exists(p)), None)  # the nearest existing folder it goes in
    if above is not None and not above.is_dir():
        raise UsageError(f"destination {dst}: {above} is a file, not a folder, so no folder can be made in it; "
                         "choose another output folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise UsageError(f"destination {dst} exists and is not empty; pass --overwrite to replace it")


def _exists(path: Path) -> bool:
    """Whether `path` exists; an error other than its absence (a name too long, a loop of links)
    raises OSError, where Path.exists hides some of them."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


@contextlib.contextmanager
def staged_output(dst: Path) -> Iterator[Path]:
    """Yields a new empty folder to write the output in; on success what it holds becomes `dst`'s
    contents (replacing what an existing `dst` held); on any error it is removed, with the parent
    folders created for it, and `dst` is as it was.

    `dst` is taken as the folder it names (".", ".." or "out/.." have no usable name or parent of
    their own). A new `dst` is staged next to it and renamed into place. An existing one (empty,
    or any with overwrite) stays the same folder, which may be the caller's working directory or a
    mount point: the staging folder is made inside it, its old entries are moved aside into another
    hidden folder there, the new ones moved in, and the old ones deleted only then."""
    where = dst.resolve()
    with (_staged_into_existing if where.is_dir() else _staged_as_new)(where, shown=dst) as tmp:
        yield tmp


def _cannot_create(shown: Path, e: OSError) -> OSError:
    """The error of a folder that could not be made, named by the destination asked for (not by
    the temporary folder's name)."""
    return OSError(f"destination {shown}: cannot create a folder there ({e.strerror or e})")


def _staging_folder(parent: Path, prefix: str, shown: Path) -> Path:
    """A new empty hidden folder in `parent`."""
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as e:
        raise _cannot_create(shown, e) from None


@contextlib.contextmanager
def _staged_as_new(dst: Path, shown: Path) -> Iterator[Path]:
    created = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    except OSError as e:
        _remove_empty(created)
        raise _cannot_create(shown, e) from None
    umask = current_umask()
    tmp.chmod(0o777 & ~umask)
    try:
        yield tmp
        _umask_modes(tmp, umask)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


@contextlib.contextmanager
def _staged_into_existing(dst: Path, shown: Path) -> Iterator[Path]:
    tmp = _staging_folder(dst, ".partial-", shown)
    umask = current_umask()
    tmp.chmod(0o777 & ~umask)
    aside: Path | None = None
    moved_aside: list[str] = []
    moved_in: list[str] = []
    try:
        yield tmp
        _umask_modes(tmp, umask)
        previous = [p.name for p in dst.iterdir() if p != tmp]
        if previous:
            aside = _staging_folder(dst, ".old-", shown)
            for name in previous:
                os.replace(dst / name, aside / name)
                moved_aside.append(name)
        for p in list(tmp.iterdir()):
            os.replace(p, dst / p.name)
            moved_in.append(p.name)
    except BaseException:
        # Back to how it was: the new entries out, the old ones in; a hidden folder still holding
        # something (a move back failed) is left for the user rather than deleted.
        for name in moved_in:
            with contextlib.suppress(OSError):
                os.replace(dst / name, tmp / name)
        for name in moved_aside:
            with contextlib.suppress(OSError):
                os.replace(aside / name, dst / name)
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None:
            _remove_empty([aside])
        raise
    tmp.rmdir()
    if aside is not None:
        shutil.rmtree(aside)


def _remove_empty(folders: list[Path]) -> None:
    """Removes the folders this run created for the output, innermost first, each only if empty."""
    for p in folders:
        with contextlib.suppress(OSError):
            p.rmdir()


def current_umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _umask_modes(folder: Path, umask: int) -> None:
    """Gives the folders and regular files under `folder` (links untouched) the umask's modes."""
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root, name)
            if not p.is_symlink():
                p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def side_file_source(src_folder: Path, f: Path) -> Path:
    """The file to copy for `f` of `src_folder` (its target when `f` is a permitted symbolic link).

    Raises ValueError naming the link when it dangles or points outside the permitted folders."""
    if not f.is_symlink():
        return f
    target = f.resolve()
    root = src_folder.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":  # Hugging Face cache: links into <repo>/blobs
        allowed.append(root.parent.parent)
    if not target.is_file() or not any(target == a or a in target.parents for a in allowed):
        raise ValueError(f"{f}: a symbolic link to {target}, "
                         + ("which does not exist or is not a file" if not target.is_file() else
                            f"outside the source folder {src_folder}")
                         + "; convert copies only files inside the source (remove or replace the link)")
    return target
