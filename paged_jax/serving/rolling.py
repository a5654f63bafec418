"""Values kept with their times for a while (the last minute): rolling percentiles and rates for the
dashboard. The engine loop's thread appends, the server's reads: every access holds a lock."""

import collections
import threading
from collections.abc import Iterable

import numpy as np

PERCENTILES = (50, 95, 99)


class Rolling:
    def __init__(self, span: float = 60.0):
        """span: seconds a value is kept."""
        self.span = span
        self._items: collections.deque[tuple[float, float]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, now: float, values: Iterable[float]) -> None:
        """values observed at `now` (time.monotonic())."""
        with self._lock:
            self._items.extend((now, float(v)) for v in values)
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._items and self._items[0][0] < now - self.span:
            self._items.popleft()

    def values(self, now: float, span: float | None = None) -> np.ndarray:
        """float64 [k]: the values of the last `span` seconds (default: all kept)."""
        since = now - (self.span if span is None else span)
        with self._lock:
            self._prune(now)
            return np.array([v for t, v in self._items if t >= since], np.float64)

    def percentiles(self, now: float, scale: float = 1.0) -> dict:
        """{"n": count, "p50", "p95", "p99": percentiles times scale, None when nothing was observed}."""
        values = self.values(now)
        found = np.percentile(values, PERCENTILES) * scale if values.size else [None] * len(PERCENTILES)
        return {"n": int(values.size)} | {f"p{p}": None if v is None else round(float(v), 3)
                                          for p, v in zip(PERCENTILES, found)}

    def rate(self, now: float, span: float) -> float:
        """The sum of the last `span` seconds' values, per second."""
        return float(self.values(now, span).sum()) / span
