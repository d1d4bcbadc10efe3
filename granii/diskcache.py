"""Pure work kept across processes, as Python keeps byte code.

A value that is a function of its key alone (the plans enumerated for a layer's IR, the code
object of a plan's source, a parsed manifest) is stored under ``cache_dir()/<kind>/<h>``, with
``h`` the SHA-256 of the key, and a later process reads it back instead of computing it again: a
first call of a new process then pays a file read where it paid a search. The key names
everything the value is computed from: the input, and the stamp (``stamp``) of the source files
of the code that computes it, so an edited or upgraded granii never reads a value an older one
stored.

Files are written beside and renamed over, so a reader sees a whole file or none. Any failure to
read or write is a miss: a read-only home computes each time. ``GRANII_DISK_CACHE=0`` turns the
store off (reads and writes).
"""
import hashlib
import json
import marshal
import os
import sys
import threading
from pathlib import Path

_STAMPS = {}
_CODE = {}
_CODE_KEPT = 4096


def cache_dir():
    """Where granii keeps what it computed once for this machine: ``$GRANII_CACHE``, else
    ``~/.cache/granii``."""
    return Path(os.environ.get("GRANII_CACHE", Path.home() / ".cache" / "granii"))


def enabled():
    return os.environ.get("GRANII_DISK_CACHE", "1").strip() != "0"


def path(kind, key):
    """The file of ``key`` (bytes) in the store of ``kind``."""
    return os.path.join(cache_dir(), kind, hashlib.sha256(key).hexdigest())


def load(kind, key):
    """The bytes stored for ``key``, or ``None``."""
    if not enabled():
        return None
    try:
        with open(path(kind, key), "rb") as f:
            return f.read()
    except (OSError, RuntimeError):      # RuntimeError: no home directory to find
        return None


def store(kind, key, data):
    """Keep ``data`` (bytes) for ``key``; silently nothing where the store cannot be written."""
    if not enabled():
        return
    try:
        dest = path(kind, key)
    except RuntimeError:                 # no home directory to find
        return
    write_whole(dest, data)


def write_whole(dest, data):
    """Write ``data`` (bytes) to the file ``dest`` whole or not at all: written beside, under a
    name of this process and thread, and renamed over, so a reader (or a mapping of the old
    file) never sees part of it. ``False`` where it cannot be written (a read-only home)."""
    tmp = f"{dest}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.fspath(dest)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def stamp(*modules):
    """The Python version and ``(file, size, modification time)`` of each module's source, as a
    string (what Python's byte-code cache checks; computed once per process), or ``None`` when
    a module has no file to read them from (imported from a zip, say): nothing keyed by it is
    stored."""
    if modules not in _STAMPS:
        parts = [sys.implementation.cache_tag or "", sys.version]
        try:
            for name in modules:
                f = sys.modules[name].__file__
                st = os.stat(f)
                parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
        except (OSError, TypeError, AttributeError):
            parts = None
        _STAMPS[modules] = None if parts is None else "\n".join(parts)
    return _STAMPS[modules]


def compiled(src, filename, mode="exec"):
    """``compile(src, filename, mode)``, kept per process and in the store (by the source, the
    name, the mode and the Python version): the generated code of a plan or a check is compiled
    once per machine, not once per process."""
    key = (src, filename, mode)
    code = _CODE.get(key)
    if code is None:
        dkey = "\n".join([stamp(), filename, mode, src]).encode()
        data = load("code", dkey)
        try:
            code = marshal.loads(data) if data is not None else None
        except (EOFError, ValueError, TypeError):
            code = None
        if code is None:
            code = compile(src, filename, mode)
            store("code", dkey, marshal.dumps(code))
        if len(_CODE) >= _CODE_KEPT:
            _CODE.clear()
        _CODE[key] = code
    return code


def parsed_json(path):
    """``json.loads`` of the file at ``path``, kept in the store by the file's name, size and
    modification time (what Python's byte-code cache checks): a model folder's manifest is
    parsed once per machine, not once per process. Raises what reading and parsing raise."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}\n{st.st_size}\n{st.st_mtime_ns}".encode()
    data = load("json", key)
    if data is not None:
        try:
            return marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            pass
    with open(path, encoding="utf-8") as f:
        value = json.loads(f.read())
    store("json", key, marshal.dumps(value))
    return value
