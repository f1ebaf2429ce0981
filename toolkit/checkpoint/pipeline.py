"""Read the next tensor while the current one is written: both cores busy, two tensors in memory.

A conversion is a loop of (read a tensor, write it). Reads (``readinto``) and writes
(``write``) release the GIL, so a reader thread that produces item N+1 while the caller writes
item N overlaps the two copies a conversion makes, the way two ``cp`` processes would. A
semaphore bounds what is alive to ``depth + 1`` produced values (the one being written and the
ones read ahead), which is what the converter's memory bound counts (two tensors at
``depth=1``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_END = object()


def read_ahead(items: Iterable[T], produce: Callable[[T], Any], depth: int = 1
               ) -> Iterator[tuple[T, Any]]:
    """Yield ``(item, produce(item))`` in order, producing up to ``depth`` items ahead in a
    thread. An exception in ``produce`` is raised here, at the item it failed on; closing the
    generator early stops the thread."""
    if depth < 1:
        for it in items:
            yield it, produce(it)
        return
    slots = threading.Semaphore(depth + 1)
    out: queue.Queue = queue.Queue()
    stop = threading.Event()

    def run() -> None:
        try:
            for it in items:
                slots.acquire()
                if stop.is_set():
                    return
                out.put((it, produce(it)))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            out.put(err)
            return
        out.put(_END)

    thread = threading.Thread(target=run, name="mdtk-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            got = out.get()
            if got is _END:
                return
            if isinstance(got, BaseException):
                raise got
            item, value = got
            del got
            yield item, value
            del value
            slots.release()
    finally:
        stop.set()
        slots.release(depth + 1)  # wake the thread wherever it waits; it sees ``stop``
        thread.join()


def background(fn: Callable[[], T]) -> Callable[[], T]:
    """Start ``fn()`` in a thread now; the returned call waits for it and gives its result (or
    raises its exception). For fixed work a conversion needs only at its end (importing the
    modules that write the metadata or config files): it runs while the data is copied, which
    in the kernel (``copy_file_range``) leaves the other core and the GIL free."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as err:  # noqa: BLE001 - raised in the caller when it waits
            box.append((False, err))

    thread = threading.Thread(target=run, name="mdtk-background", daemon=True)
    thread.start()

    def wait() -> T:
        thread.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    return wait
