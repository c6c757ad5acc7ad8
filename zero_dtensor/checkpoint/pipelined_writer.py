"""The offline converter's DCP writer: :class:`PipelinedWriter`, :class:`~.writer.DirectWriter`'s files written by a
second thread while the next entry is prepared, and, with ``sync_files``, with direct I/O (Linux ``O_DIRECT``) so that
the output does not pass through the page cache. One process writing alone (``zd.convert``); ``zd.save`` keeps
:class:`~.writer.DirectWriter`. No communication.
"""

from __future__ import annotations

import errno
import io
import os
import queue
import threading
from typing import Any

import torch

from .writer import DirectWriter, _Writeback

__all__ = ["PipelinedWriter"]


class PipelinedWriter(DirectWriter):
    """:class:`DirectWriter` whose tensor bytes are written by a second thread while the caller prepares the next
    entry (for one process writing alone, as the offline converter): the same files, byte for byte.

    torch's zip writer hands each tensor's data to the stream as one view of the tensor's memory, after its CRC-32
    (computed with the GIL released). :class:`_Pipelined` queues that view (keeping the tensor alive) to its writer
    thread and returns, so the next tensor is built (memory-mapped pages read, pieces joined) and checksummed while
    the previous one's bytes go to the file. Small records are gathered and queued in order between them. At most
    one tensor is queued, and only one of at most :attr:`pipeline_bytes` (a larger one is written in the calling
    thread after the queue drains): the memory held beyond :class:`DirectWriter`'s is one such tensor.

    With ``sync_files`` (the bytes must reach the disk before the save returns anyway) the data file is written
    with direct I/O where the file system allows it (:class:`_DirectSink`: Linux ``O_DIRECT`` through two 2 MiB
    aligned buffers, one copied into by the writer thread while a third thread writes the other; the caller only
    queues, as without it, so that building and checksumming the next tensor overlaps the disk): the bytes go
    from that buffer to the disk without passing through the page cache, which
    saves the kernel allocating, copying and later writing back a page-cache copy of the whole file (most of a
    buffered write's CPU time, and the page cache keeps the checkpoint being read). The last partial block is
    written buffered, and the ``fsync`` at the end is :class:`DirectWriter`'s. Without ``sync_files``, or where
    ``O_DIRECT`` is refused, the bytes are written buffered, with :class:`DirectWriter`'s writeback hints."""

    #: the largest tensor whose bytes are written from the second thread
    pipeline_bytes = 128 * 2**20
    #: with ``sync_files``: write the data file with direct I/O (:class:`_DirectSink`) where the file system takes it
    direct_io = True

    def _output(self, stream: Any, writeback: _Writeback) -> Any:
        sink = _DirectSink.open(stream) if self.sync_files and self.direct_io else None
        return _Pipelined(stream, writeback, self.pipeline_bytes, sink)


class _Pipelined:
    """A write-only stream over ``stream`` for :class:`PipelinedWriter`: ``write`` copies small chunks into a
    buffer and queues views of the held tensor's memory to one writer thread, in order; ``tell`` is the position
    after everything written so far, queued or not; ``flush`` and ``seek`` wait for the queue first."""

    _SMALL = 1 << 20  #: chunks below this are copied (torch's zip writer reuses their memory once write returns)

    def __init__(self, stream: Any, writeback: _Writeback, limit: int, sink: _DirectSink | None = None) -> None:
        self._stream, self._writeback, self._limit, self._sink = stream, writeback, limit, sink
        self._position = stream.tell()
        self._buffer = bytearray()
        self._held: torch.Tensor | None = None
        self._queue: queue.Queue = queue.Queue()
        self._in_flight = threading.Semaphore(1)  # one tensor's bytes queued or being written, at most
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zero_dtensor-writer", daemon=True)
        self._thread.start()

    def hold(self, tensor: torch.Tensor) -> None:
        """The tensor whose bytes the next writes may view (kept alive until they are written)."""
        self._held = tensor

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        self._position += size
        if size < self._SMALL:
            self._buffer += view
            return size
        if size <= self._limit and self._inside_held(view):
            self._send()
            self._in_flight.acquire()  # the previous tensor's bytes are written: hold one more, at most
            self._put((view, self._held))
            return size
        self._drain()  # anything else (a torch.save archive, a tensor over the limit): here, once the queue is empty
        self._emit(view, True)
        return size

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self._drain()
        if self._sink is None:
            self._stream.flush()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._drain()
        if self._sink is not None:  # direct I/O writes whole blocks in order: the rest is written buffered
            self._sink.close()
            self._sink = None
        self._stream.flush()
        self._position = self._stream.seek(offset, whence)
        return self._position

    def written(self) -> None:
        """After each tensor: drop the reference (the queue holds its own)."""
        self._held = None

    def close(self) -> None:
        """Write everything queued and stop the thread; raises the writer thread's error, if any."""
        try:
            self._drain()
        finally:
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._sink is not None:
            self._sink.close()

    def _inside_held(self, view: memoryview) -> bool:
        held = self._held
        if held is None or view.nbytes > held.untyped_storage().nbytes():
            return False
        try:
            import numpy
        except ImportError:  # then every tensor is written in the calling thread
            return False
        address = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
        start = held.untyped_storage().data_ptr()
        return start <= address and address + view.nbytes <= start + held.untyped_storage().nbytes()

    def _send(self) -> None:
        if self._buffer:
            self._put((bytes(self._buffer), None))
            self._buffer.clear()

    def _put(self, chunk: tuple[Any, Any]) -> None:
        if self._error is not None:
            if chunk[1] is not None:
                self._in_flight.release()
            raise self._error
        self._queue.put(chunk)

    def _drain(self) -> None:
        self._send()
        self._queue.join()
        if self._error is not None:
            raise self._error

    def _emit(self, data: Any, tensor: bool) -> None:
        """Write ``data`` (in the writer thread, or in the caller's once the queue is empty)."""
        if self._sink is not None:
            self._sink.write(data)
            return
        self._stream.write(data)
        if tensor:
            self._writeback.written()

    def _run(self) -> None:
        while True:
            chunk = self._queue.get()
            held = chunk is not None and chunk[1] is not None
            try:
                if chunk is None:
                    return
                if self._error is None:
                    self._emit(chunk[0], held)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread at its next write or close
                self._error = exc
            finally:
                chunk = None  # the tensor let go before the caller may hold another (its memory may be reused)
                if held:
                    self._in_flight.release()
                self._queue.task_done()


class _DirectSink:
    """Writes a file's bytes, in order, with direct I/O (``O_DIRECT`` set on ``stream``'s descriptor): the caller
    copies them into one of two aligned buffers of :attr:`SIZE` bytes while a thread writes the other, full one
    (direct writes wait for the disk). :meth:`close` writes what is left buffered (``O_DIRECT`` cleared). Where the
    file system refuses direct I/O (``EINVAL``), the bytes are written buffered from then on. The caller's
    ``stream`` must hold no buffered bytes and be at an aligned position. Memory: the two buffers."""

    SIZE = 2 * 2**20
    ALIGN = 4096

    def __init__(self, fd: int, flags: int) -> None:
        import mmap

        self._fd, self._flags = fd, flags
        self._buffers = [mmap.mmap(-1, self.SIZE) for _ in range(2)]  # page-aligned, as O_DIRECT needs
        self._views = [memoryview(b) for b in self._buffers]
        self._free = [threading.Semaphore(1) for _ in range(2)]
        self._current, self._fill = 0, 0
        self._direct = True
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="zero_dtensor-direct-writer", daemon=True)
        self._free[0].acquire()
        self._thread.start()

    @classmethod
    def open(cls, stream: Any) -> _DirectSink | None:
        """A sink over ``stream``'s descriptor, or ``None`` where direct I/O cannot be set up (no ``O_DIRECT``,
        no descriptor, an unaligned position, a file system that refuses the flag)."""
        direct = getattr(os, "O_DIRECT", 0)
        if not direct:
            return None
        try:
            import fcntl

            stream.flush()
            fd = stream.fileno()
            if os.lseek(fd, 0, os.SEEK_CUR) % cls.ALIGN:
                return None
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation, ImportError):
            return None
        return cls(fd, flags)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        done, size = 0, view.nbytes
        while done < size:
            take = min(size - done, self.SIZE - self._fill)
            self._views[self._current][self._fill:self._fill + take] = view[done:done + take]
            self._fill += take
            done += take
            if self._fill == self.SIZE:
                self._queue.put(self._current)  # written by the thread; fill the other one meanwhile
                self._current, self._fill = 1 - self._current, 0
                self._free[self._current].acquire()
                if self._error is not None:
                    raise self._error

    def close(self) -> None:
        """Write what is gathered (the whole blocks directly, the rest buffered) and clear ``O_DIRECT``."""
        try:
            self._queue.put(None)
            self._thread.join()
            if self._error is not None:
                raise self._error
            view = self._views[self._current]
            whole = self._fill - self._fill % self.ALIGN
            if whole:
                self._write(view[:whole])
            self._restore()
            if self._fill > whole:
                self._write(view[whole:self._fill])
        finally:
            for v in self._views:
                v.release()
            for b in self._buffers:
                b.close()

    def _run(self) -> None:
        while True:
            index = self._queue.get()
            if index is None:
                return
            try:
                if self._error is None:
                    self._write(self._views[index])
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread at its next write or close
                self._error = exc
            finally:
                self._free[index].release()

    def _write(self, view: memoryview) -> None:
        while view.nbytes:
            try:
                written = os.write(self._fd, view)
            except OSError as exc:
                if not self._direct or exc.errno != errno.EINVAL:
                    raise
                self._restore()  # the file system takes no direct I/O: nothing was written, write it buffered
                continue
            if written < view.nbytes:
                self._restore()  # the rest may not be aligned any more
            view = view[written:]

    def _restore(self) -> None:
        if self._direct:
            import fcntl

            fcntl.fcntl(self._fd, fcntl.F_SETFL, self._flags)
            self._direct = False
