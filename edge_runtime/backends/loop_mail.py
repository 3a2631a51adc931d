"""Engine events handed to an asyncio loop: one wake-up per batch of events instead of one per event.

The engine thread produces an event for every running sequence at every step; handing each over with
`loop.call_soon_threadsafe` writes to the loop's self-pipe once per token, and with 8 streams those
writes and wake-ups were a few percent of the engine thread's time (py-spy under `bench serve`).
`LoopMail.post` queues the event and wakes the loop only when no drain is pending, so the events a
step makes for every stream arrive in one callback, in the order they were posted.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from typing import Any, Callable

_mail: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMail]" = weakref.WeakKeyDictionary()
_mail_lock = threading.Lock()


class LoopMail:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._pending = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopMail":
        """The loop's mailbox (one per loop)."""
        with _mail_lock:
            mail = _mail.get(loop)
            if mail is None:
                mail = _mail[loop] = cls(loop)
            return mail

    def post(self, put: Callable[[Any], None], item: Any) -> None:
        """From any thread: put(item) will run on the loop. Raises RuntimeError when the loop is closed (and
        keeps raising for later posts, so every sender finds out)."""
        with self._lock:
            self._items.append((put, item))
            if self._pending:
                return
            self._pending = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._pending = False
                self._items.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._pending = False
        for put, item in items:
            put(item)
