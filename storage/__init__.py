"""storage: reading expert bytes off disk.

This package knows safetensors files, checkpoint directories, packed stores and
byte ranges. It never builds MLX graphs: it only parses headers and writes bytes
into buffers that callers hand it.
"""

from storage.errors import StoreError
from storage.file_pages import drop_pages
from storage.keys import ExpertKey
from storage.layout import ExpertTensor, LayerLayout
from storage.loader import AsyncLoader, LoaderConfig, LoaderStats, LoadTicket
from storage.store import ExpertStore

__all__ = [
    "AsyncLoader",
    "ExpertKey",
    "ExpertStore",
    "ExpertTensor",
    "LayerLayout",
    "LoadTicket",
    "LoaderConfig",
    "LoaderStats",
    "StoreError",
    "drop_pages",
]
