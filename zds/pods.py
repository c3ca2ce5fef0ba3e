"""The pods the ZDS server has recorded, and the requests it sends about them.

A :class:`Message` is one ``WorkloadRequest`` ready to go: its kind (the metric label:
``add``, ``keep``, ``del``, ``snapshot_sent``), the pod uid (``""`` for SnapshotSent),
the encoded bytes, and the ``sendmsg`` ancillary data carrying the netns fd (SCM_RIGHTS)
or an empty list. A :class:`PodRecord` is the Message of a recorded pod (``AddWorkload``
when its netns is known, else ``KeepWorkload``, upstream ``sendSnapshot``), encoded once
when recorded rather than for every connection's snapshot, and holding the server's own
dup of the netns fd.

:data:`FD_LOCK` keeps an fd number from being closed (and reused by the process) while
another thread hands it to ``sendmsg``: the snapshot thread holds it from looking a
record up to ``sendmsg`` having taken the fd, and :meth:`PodRecord.close` takes it.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from typing import Literal

from zds import wire
from zds.api import MessageTooLarge, PodInfo

MessageKind = Literal["add", "keep", "del", "snapshot_sent"]

# Uncontended almost always; never held across a blocking call.
FD_LOCK = threading.Lock()

_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)


class Message:
    """One request to send: ``kind``, ``uid``, ``data`` (the packet), ``rights`` (the
    ``sendmsg`` ancillary list: one SCM_RIGHTS entry with the netns fd, or empty)."""

    __slots__ = ("kind", "uid", "data", "rights")

    def __init__(self, kind: MessageKind, uid: str, data: bytes,
                 rights: list[tuple[int, int, bytes]] | None = None):
        self.kind: MessageKind = kind
        self.uid = uid
        self.data = data
        self.rights: list[tuple[int, int, bytes]] = rights if rights is not None else []

    def what(self) -> str:
        """``"add <uid>"`` for pod messages, ``"snapshot_sent"`` for the uid-less one
        (the prefix of every error about this message)."""
        return f"{self.kind} {self.uid}" if self.uid else self.kind

    def __repr__(self) -> str:
        return f"<Message {self.what()}>"


SNAPSHOT_SENT = Message("snapshot_sent", "", wire.encode_snapshot_sent())


def del_message(uid: str) -> Message:
    """The ``DelWorkload`` of pod ``uid``."""
    return Message("del", uid, wire.encode_del(uid))


class PodRecord(Message):
    """A recorded pod: ``info`` (the :class:`PodInfo` as given), ``fd`` (the server's
    dup of its netns fd, None without a netns or once closed).

    Raises ValueError naming ``PodInfo.netns_fd`` when that is not an open fd, and
    :class:`~zds.api.MessageTooLarge` (a ValueError) when the pod's request would not fit
    ztunnel's receive buffer (:data:`zds.wire.MAX_MESSAGE` bytes: ztunnel reads into a
    1024-byte buffer, fails a longer message as truncated and drops the connection,
    which would hit every pod on the node).
    """

    __slots__ = ("info", "fd", "sendable")

    def __init__(self, info: PodInfo):
        self.info = info
        self.fd: int | None = None
        # Whether this record can still be announced: a Keep always, an Add until its
        # fd is closed (= deleted or replaced). A plain attribute: read per snapshot message.
        self.sendable = True
        if info.netns_fd is None:
            data = wire.encode_keep(info.uid)
            _check_size("KeepWorkload", info, data)
            super().__init__("keep", info.uid, data)
            return
        data = wire.encode_add(info.uid, info.name, info.namespace, info.service_account)
        _check_size("AddWorkload", info, data)
        try:
            fd = os.dup(info.netns_fd)  # non-inheritable, as Python makes dups
        except OSError as e:
            raise ValueError(f"PodInfo.netns_fd={info.netns_fd!r} of pod {info.uid!r} "
                             f"is not an open fd: {e.strerror}") from None
        self.fd = fd
        super().__init__("add", info.uid, data,
                         [(_SOL_SOCKET, _SCM_RIGHTS, struct.pack("i", fd))])

    def close(self) -> None:
        """Close the dup'd fd (idempotent); waits for a snapshot thread's ``sendmsg``."""
        with FD_LOCK:
            if self.fd is not None:
                self.sendable = False
                os.close(self.fd)
                self.fd = None
                self.rights = []


def _check_size(what: str, info: PodInfo, data: bytes) -> None:
    if len(data) > wire.MAX_MESSAGE:
        raise MessageTooLarge(
            f"{what} of pod {info.uid[:64]!r}{'...' if len(info.uid) > 64 else ''} would be "
            f"{len(data)} bytes, over ztunnel's {wire.MAX_MESSAGE}-byte receive buffer "
            f"(PodInfo.uid {len(info.uid)} characters, name {len(info.name)}, namespace "
            f"{len(info.namespace)}, service_account {len(info.service_account)}): not "
            "recorded, not sent", len(data))


class PodTable:
    """The recorded pods by uid, in the order they were recorded (a re-recorded pod
    moves to the end): what every snapshot carries, in that order."""

    __slots__ = ("_records", "get")

    def __init__(self) -> None:
        self._records: dict[str, PodRecord] = {}
        # ``get(uid) -> PodRecord | None``: the dict's own method (looked up per
        # snapshot message, so no Python-level wrapper)
        self.get = self._records.get

    def put(self, record: PodRecord) -> None:
        """Record ``record``, closing the fd of the record it replaces."""
        old = self._records.pop(record.uid, None)
        if old is not None:
            old.close()
        self._records[record.uid] = record

    def pop(self, uid: str) -> PodRecord | None:
        """Forget pod ``uid`` and close its fd; returns the record, or None if unknown."""
        record = self._records.pop(uid, None)
        if record is not None:
            record.close()
        return record

    def current(self, record: PodRecord) -> bool:
        """Whether ``record`` is still the one recorded for its uid, and sendable."""
        return self._records.get(record.uid) is record and record.sendable

    def uids(self) -> list[str]:
        """The recorded uids in snapshot order (a copy: safe to hold while pods change)."""
        return list(self._records)

    def items(self) -> list[tuple[str, PodRecord]]:
        return list(self._records.items())

    def clear(self) -> None:
        """Forget every pod, closing their fds."""
        for record in self._records.values():
            record.close()
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, uid: object) -> bool:
        return uid in self._records
