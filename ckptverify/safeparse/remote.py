"""Reading checkpoints in object stores and remote file systems (``s3://``, any fsspec URL).

Imported only for a URL; without fsspec/s3fs a URL is a :class:`~ckptverify.errors.UsageError`.
:class:`RemoteFile` has :class:`~ckptverify.safeparse.readers.ReadOnlyFile`'s interface, reading bounded ranged
requests from a shared pool; an object is never read into memory whole. An object's signature is size and ETag
(or version; mtime only without either). On S3 each GET carries ``If-Match``: a replaced object fails the next
read (``file-changed``). Credentials come from the store's own chain; nothing here reads or prints them.
Throttling is retried by botocore's ``standard`` mode, 10 attempts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import posixpath
import stat as stat_module
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any

from ckptverify.errors import FileChangedError, StorageError, UnsafeFileError, UsageError
from ckptverify.safeparse.fold import Folding

__all__ = ["CONCURRENCY", "JOBS", "OPTIONS_ENV", "RANGE_BYTES", "READ_AHEAD", "RemoteFile", "filesystem", "forget",
           "listdir", "probe", "put_small", "read_small", "scandir", "stat", "stats", "storage_options"]

#: Bytes per ranged request of a pass over an object (:meth:`RemoteFile.fold_at`).
RANGE_BYTES = 8 << 20
#: Ranged requests in flight ahead of the one being used, per pass: a pass holds at most this many ranges.
READ_AHEAD = 4
#: Threads issuing ranged requests, shared by every pass (``CKPTVERIFY_REMOTE_CONCURRENCY`` overrides).
_CONCURRENCY_ENV = os.environ.get("CKPTVERIFY_REMOTE_CONCURRENCY", "").strip()
CONCURRENCY = max(1, int(_CONCURRENCY_ENV)) if _CONCURRENCY_ENV.isdigit() else 16
#: Parallel workers a verification of a URL uses by default (at least): its reads wait on the network.
JOBS = 8
#: Environment variable holding extra fsspec options (a JSON object), e.g. ``{"anon": true}``.
OPTIONS_ENV = "CKPTVERIFY_STORAGE_OPTIONS"
#: Small reads fetch a block this size, kept LRU up to :data:`_BLOCK_BUDGET` (dropped on close), so nearby
#: small reads cost one request.
_BLOCK_BYTES = 256 << 10
_BLOCK_BUDGET = 64 << 20
#: Views handed to ``fn`` in a pass are at most this long (as a local file's reads).
_VIEW_BYTES = 1 << 20
_EXTRA = "pip install 'ckptverify[s3]'"

_lock = threading.Lock()
#: The kept blocks, by (file serial, block index), least recently used first; their total size.
_blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()
_blocks_held = [0]
_serials = itertools.count()
_filesystems: dict[tuple[str, ...], Any] = {}
_pool: ThreadPoolExecutor | None = None
_stats = {"requests": 0, "bytes": 0, "retries": 0}


#: Last fresh listing per prefix: (monotonic start, entries). End checks of objects read before it use it:
#: one listing per prefix, not a request per object.
_listings: dict[tuple[int, str], tuple[float, dict[str, dict[str, Any]]]] = {}
_LISTINGS_KEPT = 64


def _listed_after(fs: Any, parent: str, after: float) -> dict[str, dict[str, Any]]:
    with _lock:
        hit = _listings.get((id(fs), parent))
    if hit is not None and hit[0] > after:
        return hit[1]
    began = time.monotonic()
    fs.invalidate_cache(parent)
    listed = _store_call(parent, "a listing", fs.ls, parent, True)
    entries = {e["name"].rstrip("/"): e for e in listed}
    with _lock:
        _listings[(id(fs), parent)] = (began, entries)
        while len(_listings) > _LISTINGS_KEPT:  # a long-lived process (watch) verifies many prefixes
            del _listings[next(iter(_listings))]
    return entries


def stats() -> dict[str, int]:
    """Ranged requests made, bytes they returned, and retries botocore reported (throttling, errors)."""
    with _lock:
        return dict(_stats)


def _options(protocol: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if protocol in ("s3", "s3a") and not (os.environ.get("AWS_RETRY_MODE") or os.environ.get("AWS_MAX_ATTEMPTS")):
        # botocore's default (legacy, 5 attempts) gives up on a throttled bucket too soon for a long read.
        options["config_kwargs"] = {"retries": {"mode": "standard", "max_attempts": 10}}
    raw = os.environ.get(OPTIONS_ENV)
    if raw:
        try:
            extra = json.loads(raw)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):  # its content is never echoed: it may hold a secret
            raise UsageError(f"{OPTIONS_ENV} must hold a JSON object of fsspec options")
        options.update(extra)
    return options


def storage_options(url: str) -> dict[str, Any]:
    """The fsspec options this tool opens ``url``'s scheme with (for a reader of its own, e.g. DCP's)."""
    return _options(url.split("://", 1)[0].lower())


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system serving ``url`` and the path within it; :class:`~ckptverify.errors.UsageError` when
    fsspec (or the scheme's implementation) is not installed."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError:
        raise UsageError(f"{protocol}:// URLs need the object-store extra: {_EXTRA}") from None
    key = (protocol, os.environ.get("AWS_ENDPOINT_URL", ""), os.environ.get(OPTIONS_ENV, ""))
    with _lock:
        fs = _filesystems.get(key)
    if fs is None:
        try:
            # Our own cache (keyed by the endpoint too): fsspec's would keep an instance made for another one.
            fs, _ = fsspec.core.url_to_fs(url, skip_instance_cache=True, **_options(protocol))
        except ImportError as exc:
            raise UsageError(f"{protocol}:// URLs need a package that is not installed ({exc}); for s3:// "
                             f"{_EXTRA}") from None
        except ValueError as exc:
            raise UsageError(f"{url}: not a URL this tool can read ({exc})") from None
        with _lock:
            fs = _filesystems.setdefault(key, fs)
    path = fs._strip_protocol(url)
    # ``run/./step_3``, ``run/step_3/``: one key prefix, as a local path names one directory.
    return fs, posixpath.normpath(path) if path else path


def _pool_executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="ckptverify-get")
        return _pool


def _tag(info: dict[str, Any]) -> str:
    for name in ("ETag", "etag", "VersionId", "generation", "md5Hash", "version_id"):
        value = info.get(name)
        if value:
            return str(value)
    return ""


def _mtime_ns(info: dict[str, Any]) -> int:
    for name in ("LastModified", "last_modified", "mtime", "updated", "modified", "created"):
        value = info.get(name)
        if isinstance(value, datetime):
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value * 1e9)
        if isinstance(value, str):
            try:
                return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
            except ValueError:
                continue
    return 0


def _signature(info: dict[str, Any]) -> tuple[int, int, str]:
    """(size, mtime, tag). With a tag the time is 0: a listing and a HEAD state it at different precisions."""
    tag = _tag(info)
    return int(info.get("size") or 0), 0 if tag else _mtime_ns(info), tag


def _stat_result(info: dict[str, Any]) -> os.stat_result:
    directory = info.get("type") == "directory"
    mode = (stat_module.S_IFDIR | 0o555) if directory else (stat_module.S_IFREG | 0o444)
    size, _, tag = _signature(info)
    mtime_ns = _mtime_ns(info)
    # The tag as the inode: callers that compare (device, inode) see a replaced object as another file.
    ino = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=7).digest(), "big") if tag else 0
    seconds = mtime_ns // 10**9
    return os.stat_result((mode, ino, 0, 1, 0, 0, 0 if directory else size, seconds, seconds, seconds),
                          {"st_mtime_ns": mtime_ns, "st_atime_ns": mtime_ns, "st_ctime_ns": mtime_ns})


def _store_call(url: str, what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``; a failure of the store other than "no such object" is a :class:`StorageError`."""
    try:
        return fn(*args)
    except (FileNotFoundError, NotADirectoryError, StorageError):
        raise
    except Exception as exc:
        raise StorageError(f"{url}: the store did not answer {what} after its retries ({type(exc).__name__}: "
                           f"{str(exc)[:300]})", url) from None


def stat(url: str) -> os.stat_result:
    """``os.stat`` of an object (a regular file) or a prefix (a directory). Raises ``FileNotFoundError``."""
    fs, path = filesystem(url)
    return _stat_result(_store_call(url, "a request for the object's size and ETag", fs.info, path))


def forget(url: str) -> None:
    """Drop cached knowledge of ``url``, below and above it, so a long-lived process never judges by an old listing."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    cache = getattr(fs, "dircache", None)
    if cache is not None:
        below = path.rstrip("/") + "/"
        for key in [k for k in list(cache) if k.startswith(below)]:
            cache.pop(key, None)


def _segment(own: str, info: dict[str, Any]) -> str | None:
    """``info``'s name below ``own`` (``None`` for ``own`` itself or its ``own/`` folder marker)."""
    name = str(info.get("name", ""))
    if not name.startswith(own + "/"):
        return None
    seg = name[len(own) + 1:]
    if info.get("type") == "directory":
        return seg[:-1] if seg.endswith("/") else seg
    return None if seg == "" and not info.get("size") else seg


def listdir(url: str) -> list[str]:
    """Names directly under ``url``, listed afresh; unaddressable keys are left out (:meth:`_Scan.unaddressable`)."""
    return [e.name for e in scandir(url)]


class _Entry:
    """One entry of :func:`scandir`: what this package reads of an ``os.DirEntry`` (no links in an object store)."""

    def __init__(self, parent: str, info: dict[str, Any]) -> None:
        self.name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        self.path = parent.rstrip("/") + "/" + self.name
        self._info = info

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._info.get("type") == "directory"

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return _stat_result(self._info)


class _Scan(list[_Entry]):
    """:func:`scandir`'s entries, iterated in a ``with`` block as ``os.scandir``'s, and :meth:`unaddressable`."""

    def __init__(self, url: str, entries: list[_Entry], odd: list[tuple[str, dict[str, Any]]]) -> None:
        super().__init__(entries)
        self._url = url
        self._odd = odd

    def __enter__(self) -> _Scan:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def unaddressable(self, limit: int) -> tuple[list[str], bool]:
        """Keys under the prefix no path reaches, as stored relative to it, sorted; at most ``limit``, and whether there
        were more. One flat listing per such name."""
        fs, path = filesystem(self._url)
        own = path.rstrip("/")
        keys: list[str] = []
        for seg, info in self._odd:
            if info.get("type") != "directory":
                keys.append(seg)
                continue
            # The raw prefix ``own/SEG/``, listed flat: a walk into it by name would be normalised elsewhere.
            below = _store_call(self._url, "a listing", lambda s=seg: fs.find(own, prefix=s + "/"))
            keys.extend(str(k)[len(own) + 1:] for k in below)
            if len(keys) > limit:
                break
        fs.invalidate_cache(own)  # find filled the cache with the raw prefixes
        keys.sort()
        return keys[:limit], len(keys) > limit


def scandir(url: str) -> _Scan:
    """Entries directly under ``url`` (one fresh listing), as ``os.scandir``; unaddressable keys left out."""
    fs, path = filesystem(url)
    forget(url)  # a listing is the truth now: what changed since the last one must show
    entries = _store_call(url, "a listing", fs.ls, path, True)
    own = path.rstrip("/")
    if len(entries) == 1 and entries[0].get("type") == "file" and entries[0]["name"].rstrip("/") == own:
        raise NotADirectoryError(20, "Not a directory", url)
    good, odd = [], []
    for e in entries:
        seg = _segment(own, e)
        if seg is not None:
            # Unaddressable: a ``.``, ``..`` or empty segment, or a ``/`` the listing should have split at.
            (odd if seg in ("", ".", "..") or "/" in seg else good).append((seg, e))
    return _Scan(url, [_Entry(url, e) for _, e in good], odd)


def probe(url: str, method: str) -> bool:
    """fsspec's ``isdir``, ``isfile`` or ``exists`` (``method``) of ``url``; a store failing is a StorageError."""
    fs, path = filesystem(url)
    try:
        return bool(_store_call(url, "a request for the object or prefix", getattr(fs, method), path))
    except (FileNotFoundError, NotADirectoryError):
        return False


def read_small(url: str, limit: int) -> bytes:
    """Whole content of a small object, as ``read_small_file``: more than ``limit`` bytes is refused unread."""
    with RemoteFile(url) as f:
        if f.size > limit:
            raise UnsafeFileError(f"{url} is {f.size} bytes, more than the {limit} this tool reads for it", url)
        return f._get(0, f.size)  # read once, whole: not kept among the blocks


def put_small(url: str, data: bytes) -> None:
    """Write ``data`` as the object ``url`` in one request (a stamp, never a checkpoint's own bytes)."""
    fs, path = filesystem(url)
    fs.pipe_file(path, data)
    fs.invalidate_cache(path)


def _precondition_failed(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        text = f"{type(seen).__name__} {seen}"
        if "PreconditionFailed" in text or "Precondition Failed" in text or "(412)" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RemoteFile(Folding):
    """An object read with ranged requests; the interface of :class:`~ckptverify.safeparse.readers.ReadOnlyFile`.

    A short read, an ETag mismatch, or a changed signature at :meth:`changed` means the object changed under the
    reader. ``root`` is accepted for the interface (an object store has no links).
    """

    def __init__(self, path: str, *, root: str | None = None) -> None:
        self.path = path
        self._fs, self._key = filesystem(path)
        info = _store_call(path, "a request for the object's size and ETag", self._fs.info, self._key)
        if info.get("type") != "file":
            raise UnsafeFileError(f"{path} is a {info.get('type') or 'special entry'}, not a regular file", path)
        self.size = int(info.get("size") or 0)
        self._signature = _signature(info)
        self._etag = str(info.get("ETag") or "")
        self._if_match = hasattr(self._fs, "_call_s3") and hasattr(self._fs, "split_path") and bool(self._etag)
        self._serial = next(_serials)  # never reused (an id() may be): a block is never served to another file
        self._indexes: set[int] = set()
        self._last_read = time.monotonic()  # when the last read ended: an end check must list after it

    def close(self) -> None:
        with _lock:
            for index in self._indexes:
                data = _blocks.pop((self._serial, index), None)
                if data is not None:
                    _blocks_held[0] -= len(data)
            self._indexes.clear()

    def _get(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` in one ranged request, exactly that many or :class:`FileChangedError`."""
        if end <= start:
            return b""
        retries = 0
        try:
            if self._if_match:
                from fsspec.asyn import sync

                bucket, key, _ = self._fs.split_path(self._key)

                async def call() -> tuple[bytes, int]:
                    resp = await self._fs._call_s3("get_object", Bucket=bucket, Key=key,
                                                   Range=f"bytes={start}-{end - 1}", IfMatch=self._etag,
                                                   **self._fs.req_kw)
                    try:
                        body = await resp["Body"].read()
                    finally:
                        resp["Body"].close()
                    return body, int(resp.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)

                data, retries = sync(self._fs.loop, call)
            else:
                data = self._fs.cat_file(self._key, start=start, end=end)
        except FileNotFoundError:
            raise FileChangedError(f"{self.path} changed while it was verified: the object is gone",
                                   self.path) from None
        except Exception as exc:
            if self._if_match and _precondition_failed(exc):
                raise FileChangedError(f"{self.path} changed while it was verified: its ETag is no longer "
                                       f"{self._etag} (the object was replaced)", self.path) from None
            raise StorageError(f"{self.path}: the store did not serve bytes {start}-{end - 1} after its retries "
                               f"({type(exc).__name__}: {str(exc)[:300]}); nothing was judged from them",
                               self.path) from None
        with _lock:
            _stats["requests"] += 1
            _stats["bytes"] += len(data)
            _stats["retries"] += retries
        self._last_read = max(self._last_read, time.monotonic())
        if len(data) != end - start:
            got = start + len(data)
            raise FileChangedError(f"{self.path} ends at byte {got} now but was {self.size} bytes when opened",
                                   self.path)
        return bytes(data)

    def _block(self, index: int) -> bytes:
        key = (self._serial, index)
        with _lock:
            data = _blocks.get(key)
            if data is not None:
                _blocks.move_to_end(key)
                return data
        start = index * _BLOCK_BYTES
        data = self._get(start, min(self.size, start + _BLOCK_BYTES))
        with _lock:
            if key not in _blocks:
                _blocks[key] = data
                _blocks_held[0] += len(data)
                self._indexes.add(index)
            while _blocks_held[0] > _BLOCK_BUDGET and _blocks:
                _, dropped = _blocks.popitem(last=False)
                _blocks_held[0] -= len(dropped)
        return data

    def pread(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the object as opened, none past it)."""
        if n <= 0 or offset >= self.size or offset < 0:
            return b""
        want = min(n, self.size - offset)
        first, last = offset // _BLOCK_BYTES, (offset + want - 1) // _BLOCK_BYTES
        if last - first <= 1 and want <= _BLOCK_BYTES:  # small: through the block cache
            joined = b"".join([self._block(i) for i in range(first, last + 1)])  # one block: that very object
            lo = offset - first * _BLOCK_BYTES
            return joined[lo: lo + want]
        out = bytearray()
        self.fold(offset, offset + want, out.extend)
        return bytes(out)

    def fold_at(self, start: int, end: int, fn: Callable[[memoryview, int], None]) -> None:
        """Like :meth:`fold`, also passing each view's offset. Ranges are fetched :data:`READ_AHEAD` ahead."""
        end = min(end, self.size)
        if start >= end:
            return
        if end - start <= _BLOCK_BYTES:  # a small record: from the blocks its item's headers were read in
            data = self.pread(start, end - start)
            with memoryview(data) as view:
                fn(view, start)
            return
        ranges = iter([(a, min(a + RANGE_BYTES, end)) for a in range(start, end, RANGE_BYTES)])
        pool = _pool_executor()
        pending: deque[tuple[int, Future[bytes]]] = deque(
            (a, pool.submit(self._get, a, b)) for a, b in itertools.islice(ranges, READ_AHEAD))
        try:
            while pending:
                at, future = pending.popleft()
                data = future.result()
                following = next(ranges, None)
                if following is not None:
                    pending.append((following[0], pool.submit(self._get, *following)))
                with memoryview(data) as view:
                    for p in range(0, len(data), _VIEW_BYTES):
                        with view[p: p + _VIEW_BYTES] as part:
                            fn(part, at + p)
                del data
        finally:
            for _, future in pending:
                future.cancel()

    def changed(self) -> str | None:
        """How the object differs from open (size, mtime, ETag), read afresh, or ``None``."""
        try:
            listed = _listed_after(self._fs, posixpath.dirname(self._key.rstrip("/")), self._last_read)
        except FileNotFoundError:
            listed = {}  # a store failing (StorageError) is no change of the object: the command could not run
        info = listed.get(self._key.rstrip("/"))
        if info is None:
            return "its name no longer opens it (no such object)"
        now = _signature(info)
        if now == self._signature:
            return None
        size, mtime, tag = self._signature
        if now[2] != tag:
            return (f"its ETag was {tag} when opened and is {now[2]} now (the object was replaced; "
                    f"{size} bytes then, {now[0]} now)")
        return (f"it was {size} bytes modified at {mtime} ns when opened, and is {now[0]} bytes modified at "
                f"{now[1]} ns now")
