"""Which transports UCX has and which it chose, read from UCX itself, and whether device memory
would travel through host memory.

UCX prints its context's resources (``ucp_context_print_info``: one ``tl/device`` per line)
and an endpoint's lanes (``ucp_ep_print_info``: ``lane[i]: ... tl/device``); ucxx binds
neither, so they are called through ctypes on the ``libucp`` ucxx loaded, with the raw handles
ucxx exposes (``UCXContext.handle``, ``UCXEndpoint.handle``), into an ``open_memstream``.
Parsing is plain text (:func:`parse_resources`, :func:`parse_lanes`), tested on UCX's own
output.

Device memory (:func:`device_path`): UCX moves device buffers with ``cuda_copy`` (to and from
host memory), ``cuda_ipc`` (between GPUs of one host) and, across hosts, the verbs transports
(``rc``, ``dc``, ``ud``) with GPUDirect RDMA -- which needs UCX built with verbs and the
``nvidia_peermem`` kernel module. The ``libucx-cu12`` wheel has no verbs: across hosts it uses
TCP, and a device buffer is then copied through host memory at both ends. A rank warns about
that once at start (:func:`device_path` returns why).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from typing import Callable

log = logging.getLogger(__name__)

__all__ = ["context_resources", "endpoint_lanes", "parse_resources", "parse_lanes",
           "device_path", "RDMA_TRANSPORTS", "peermem_loaded"]

#: UCX transports that move data across hosts over RDMA (verbs / mlx5 / EFA).
RDMA_TRANSPORTS = ("rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs", "ud_mlx5",
                   "srd")

_RESOURCE = re.compile(r"^#\s+resource\s+\d+\s+:\s+md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+(\S+)")
_LANE = re.compile(r"^#\s+lane\[\d+\]:\s+\d+:(\S+?)(?:\.\d+)?\s")

_LIBS: dict[str, object] = {}


def _lib(name: str):
    """libc, or the libucp that ucxx loaded (the same file: one UCX in the process)."""
    lib = _LIBS.get(name)
    if lib is None:
        if name == "c":
            lib = ctypes.CDLL(None)
            lib.open_memstream.restype = ctypes.c_void_p
            lib.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p),
                                           ctypes.POINTER(ctypes.c_size_t)]
            lib.fclose.argtypes = [ctypes.c_void_p]
            lib.free.argtypes = [ctypes.c_void_p]
        else:
            lib = ctypes.CDLL(_loaded_libucp())
            for fn in ("ucp_context_print_info", "ucp_ep_print_info"):
                getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                getattr(lib, fn).restype = None
        _LIBS[name] = lib
    return lib


def _loaded_libucp(maps: str | None = None) -> str:
    """The path of the libucp this process mapped (ucxx's: the wheel's, or a system UCX when
    ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` chose one), so the handles ucxx gives are read by
    the library that made them; the wheel's when none is mapped yet. ``maps``: the text of
    ``/proc/self/maps`` (read when None)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            maps = ""
    for line in maps.splitlines():
        path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
        if os.path.basename(path).startswith("libucp.so"):
            return path
    import libucx

    return os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so")


def _capture(function: str, handle: int) -> str:
    """What ``function(handle, FILE*)`` of libucp prints."""
    libc, ucp = _lib("c"), _lib("ucp")
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        raise OSError(ctypes.get_errno(), "open_memstream failed")
    try:
        getattr(ucp, function)(ctypes.c_void_p(handle), ctypes.c_void_p(stream))
    finally:
        libc.fclose(ctypes.c_void_p(stream))
    try:
        return ctypes.string_at(buf, size.value).decode(errors="replace")
    finally:
        libc.free(buf)


def parse_resources(text: str) -> list[str]:
    """``tl/device`` of every resource line of ``ucp_context_print_info`` output."""
    return [m.group(1) for line in text.splitlines() if (m := _RESOURCE.match(line.strip()))]


def parse_lanes(text: str) -> list[str]:
    """``tl/device`` of every lane of ``ucp_ep_print_info`` output, in lane order, once each."""
    lanes = []
    for line in text.splitlines():
        m = _LANE.match(line.strip())
        if m and m.group(1) not in lanes:
            lanes.append(m.group(1))
    return lanes


def _ask(printer: str, handle: int, parse: Callable[[str], list[str]], what: str) -> list[str]:
    """``parse`` of what UCX's ``printer`` prints about ``handle``; [] (logged at DEBUG as
    "cannot read ``what``") when UCX cannot be asked."""
    try:
        return parse(_capture(printer, handle))
    except (OSError, AttributeError, ImportError) as e:
        log.debug("cannot read %s: %s", what, e)
        return []


def context_resources(context_handle: int) -> list[str]:
    """The transports of a UCX context (``tl/device``); [] when UCX cannot be asked."""
    return _ask("ucp_context_print_info", context_handle, parse_resources, "UCX's resources")


def endpoint_lanes(endpoint_handle: int) -> list[str]:
    """The transports an endpoint's lanes use (``tl/device``); [] when UCX cannot be asked."""
    return _ask("ucp_ep_print_info", endpoint_handle, parse_lanes, "an endpoint's lanes")


def peermem_loaded(modules: str | None = None) -> bool:
    """Whether the GPUDirect RDMA kernel module (``nvidia_peermem`` or ``nv_peer_mem``) is
    loaded (``modules``: the text of ``/proc/modules``, read when None)."""
    if modules is None:
        try:
            with open("/proc/modules") as f:
                modules = f.read()
        except OSError:
            return False
    names = {line.split(" ", 1)[0] for line in modules.splitlines()}
    return bool(names & {"nvidia_peermem", "nv_peer_mem"})


def device_path(memory: str, resources: list[str], *, peermem: bool | None = None) -> str:
    """Why a device-memory transfer of this rank would go through host memory ("" when it
    would not, or the pool is in host memory). ``resources``: the context's ``tl/device``
    list (empty: unknown, nothing said).

    - no ``cuda_copy``: UCX was built without CUDA; it cannot move device memory at all (the
      caller refuses to start);
    - no RDMA transport: across hosts the bytes go over TCP through host memory at both ends;
    - RDMA but no ``nvidia_peermem``: UCX pipelines device memory through host buffers.
    """
    if memory != "cuda" or not resources:
        return ""
    tls = {r.split("/", 1)[0] for r in resources}
    if "cuda_copy" not in tls:
        return ("UCX has no cuda_copy transport (built without CUDA): it cannot move device "
                "memory")
    rdma = sorted(tls & set(RDMA_TRANSPORTS))
    if not rdma:
        return (f"UCX has no RDMA transport (only {', '.join(sorted(tls))}): device memory "
                f"sent to another host is staged through host memory over TCP; use a UCX built "
                f"with verbs and GDRCopy (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true)")
    if peermem is None:
        peermem = peermem_loaded()
    if not peermem:
        return (f"UCX has {', '.join(rdma)} but the nvidia_peermem module is not loaded: "
                f"device memory sent to another host is staged through host memory")
    return ""
