"""plotly.js for the console's charts, served from the installed plotly package (no CDN, no copy)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

import plotly
from django.contrib.staticfiles.finders import BaseFinder
from django.core.checks import CheckMessage
from django.core.files.storage import FileSystemStorage

# The build that matches the python figures (plotly's own package data).
SOURCE = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
STATIC_PATH = "plotly/plotly.min.js"


class PlotlyFinder(BaseFinder):
    """Finds exactly one file, ``plotly/plotly.min.js``."""

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        return []

    @overload
    def find(self, path: str, find_all: Literal[False] = False) -> str | None: ...

    @overload
    def find(self, path: str, find_all: Literal[True]) -> list[str]: ...

    def find(self, path: str, find_all: bool = False) -> str | list[str] | None:
        if path == STATIC_PATH and SOURCE.is_file():
            return [str(SOURCE)] if find_all else str(SOURCE)
        # Not ours: [] in both modes, as Django's own finders answer (a None would be
        # collected by django.contrib.staticfiles.finders.find as a match).
        return []

    def list(self, ignore_patterns: Any) -> Iterator[tuple[str, FileSystemStorage]]:
        storage = FileSystemStorage(location=str(SOURCE.parent))
        storage.prefix = "plotly"  # type: ignore[attr-defined]
        yield SOURCE.name, storage
